"""A mixture-of-experts feed-forward layer (a Keras layer any model can use).

Every token is routed by a learned router (a bias-free linear map to one logit per
expert, computed in float32) to its ``top_k`` experts, each an MLP (plain or gated).
Its output is the gate-weighted sum of those experts' outputs:

* ``top_k=1`` (Switch Transformer, Fedus et al. 2021): the gate is the router's softmax
  probability of the chosen expert;
* ``top_k>=2`` (GShard, Lepikhin et al. 2020; Mixtral): the top-k probabilities,
  renormalised to sum to 1.

**Capacity.** With ``capacity_factor > 0`` each expert takes at most
``ceil(capacity_factor x tokens x top_k / experts)`` tokens of a call; tokens fill it in
order of choice (every token's first choice before any second choice, as GShard), then in
token order. A token's assignment past capacity is dropped: it adds nothing for that
expert (the model's residual connection carries the token on). ``capacity_factor=0``
drops nothing. The capacity is per call: a pipeline's micro-batch is its own call.

**Auxiliary losses** (added with ``add_loss``, so ``fit`` adds them to the loss):

* load balancing (Switch eq. 4): ``aux_loss_coef x E x sum_e f_e x P_e``, where ``f_e`` is
  the share of tokens whose first choice is expert ``e`` and ``P_e`` the mean router
  probability of ``e`` (1.0 at a perfectly uniform router);
* router z-loss (ST-MoE, Zoph et al. 2022, eq. 5): ``z_loss_coef x mean_t
  logsumexp(logits_t)^2``.

**Statistics.** Four non-trainable scalars hold those of the last training call:
``dropped_fraction`` (share of token-to-expert assignments dropped), ``load_min`` and
``load_max`` (the least and most loaded expert's share of the kept assignments, x E: 1.0
is perfect balance) and ``balance`` (``E x sum_e f_e x P_e``, the balancing loss before its
coefficient). Totals over the training calls since the last :meth:`MoE.reset_statistics`
(``total_calls``, ``total_balance``, ``total_assignments`` and ``total_load``, the kept
assignments of each expert) give the same figures over several calls: ``phalanx.fit``
starts them at zero every step, so that after a step they cover the whole batch, every
data replica and micro-batch (:mod:`phalanx.train.moe_stats`). They are statistics, not
state: ``.keras`` files do not hold them (``phalanx.fit``'s checkpoints, which hold every
model variable, do).

**Dispatch.** The tokens routed to the experts of one shard are gathered once, sent to
the shard's device, split by expert there and sent back once (one exchange per shard
and direction, whatever the number of experts per shard).

**Mixed precision.** The experts compute in the layer's compute dtype from float32 weights.
A call casts each shard it reads, on the shard's device, unless the value the engine hands in
for the shard carries a cast copy already (:func:`attach_compute_copy`): the Keras-model
engine casts each expert shard once per device and step and hands that copy to every replica
and micro-batch that reads it, so a device holds one compute-dtype copy of its shard, not one
per reading call.

Example:
    >>> import numpy as np
    >>> moe = MoE(num_experts=4, hidden_dim=16, top_k=2)
    >>> tuple(moe(np.ones([2, 3, 8], "float32")).shape)
    (2, 3, 8)
"""

from __future__ import annotations

import math

import keras
from keras import ops

from phalanx.layers.sharding import ShardedLayer, on_device_of, shard_values

_TOTAL = "_phalanx_step_total"
_COMPUTE_COPY = "_phalanx_compute_copy"


def is_step_total(variable) -> bool:
    """Whether ``variable`` sums an MoE layer's statistics over its training calls: an
    engine that runs a step as several calls starts it at zero every step, so that after
    the step it holds the whole step's totals."""
    return getattr(variable, _TOTAL, False)


def attach_compute_copy(value, copy) -> None:
    """Hand an :class:`MoE` call ``copy``, the value ``value`` of an expert shard already cast
    to the layer's compute dtype: the call reads ``copy`` (its gradient flows through whatever
    made it) instead of casting ``value`` itself. ``value`` is the tensor an engine passes for
    the shard's variable (``stateless_call``); a copy of another dtype is not used.

    Example:
        >>> import tensorflow as tf
        >>> moe = MoE(num_experts=2, hidden_dim=4, top_k=1, dtype="mixed_bfloat16")
        >>> x = tf.ones([1, 2, 4], "bfloat16")
        >>> _ = moe(x)  # builds it
        >>> state = [v.value for v in moe.non_trainable_variables]
        >>> values = [tf.identity(v.value) for v in moe.trainable_variables]
        >>> [v.path.rsplit("/", 1)[-1] for v in moe.trainable_variables][:2]
        ['router', 'w_in']
        >>> def call():
        ...     return moe.stateless_call(values, state, x)[0]
        >>> bool(tf.reduce_any(call() != 0))
        True
        >>> attach_compute_copy(values[1], tf.zeros([2, 4, 4], "bfloat16"))  # a zero w_in, in bfloat16
        >>> bool(tf.reduce_any(call() != 0))  # the copy was read: zero in, zero biases, zero out
        False
    """
    setattr(value, _COMPUTE_COPY, copy)


def _compute_values(layer, variables) -> list:
    """:func:`~phalanx.layers.sharding.shard_values` of ``variables``, except that a value
    carrying a compute-dtype copy (:func:`attach_compute_copy`) is that copy."""
    import tensorflow as tf
    from keras.src.backend.common.variables import AutocastScope  # no public un-cast read

    out = []
    for v in variables:
        with AutocastScope(None):
            raw = tf.convert_to_tensor(v)
        copy = getattr(raw, _COMPUTE_COPY, None)
        if copy is not None and copy.dtype == layer.compute_dtype:
            out.append(copy)
        else:
            out.extend(shard_values(layer, [raw]))
    return out


@keras.saving.register_keras_serializable(package="phalanx")
class MoE(ShardedLayer):
    """Mixture of ``num_experts`` MLP experts of width ``hidden_dim`` (see the module
    docstring). ``gated=True`` makes each expert a SwiGLU MLP (``activation`` on the
    gate branch, Shazeer 2020). ``ep``: the experts are cut into ``ep`` shards of
    ``num_experts / ep`` experts; with ``parallel.ep=ep`` each shard lives on one data
    replica of a group and the group's tokens are sent to it (expert parallelism)."""

    def __init__(self, num_experts: int, hidden_dim: int, top_k: int = 2, capacity_factor: float = 0.0,
                 aux_loss_coef: float = 0.01, z_loss_coef: float = 0.0, gated: bool = False,
                 activation: str = "gelu", kernel_initializer="glorot_uniform", ep: int = 1, **kwargs):
        if kwargs.get("tp", 1) != 1:
            raise ValueError(f"MoE: tp: {kwargs['tp']!r}: the experts are not cut over tensor devices; each runs "
                             f"whole on the device of its expert shard. Leave tp=1 (a model may still mix MoE "
                             f"with tensor-parallel layers under parallel.tp) and shard experts with ep= and "
                             f"parallel.ep")
        super().__init__(**kwargs)
        if not isinstance(ep, int) or ep < 1 or num_experts % ep if isinstance(num_experts, int) else False:
            raise ValueError(f"ep: {ep!r} must be a positive integer that divides num_experts={num_experts}")
        self.ep = ep
        if not isinstance(num_experts, int) or num_experts < 1:
            raise ValueError(f"num_experts: {num_experts!r} is not a positive integer")
        if not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k: {top_k!r} must be an integer in [1, num_experts={num_experts}]")
        if not capacity_factor >= 0 or not math.isfinite(capacity_factor):
            raise ValueError(f"capacity_factor: {capacity_factor!r} must be >= 0 (0: no token is dropped)")
        for name, value in (("aux_loss_coef", aux_loss_coef), ("z_loss_coef", z_loss_coef)):
            if not value >= 0 or not math.isfinite(value):
                raise ValueError(f"{name}: {value!r} must be a finite number >= 0")
        self.num_experts, self.hidden_dim, self.top_k = num_experts, hidden_dim, top_k
        self.capacity_factor, self.aux_loss_coef, self.z_loss_coef = capacity_factor, aux_loss_coef, z_loss_coef
        self.gated, self.activation = gated, keras.activations.get(activation)
        self._activation_name = activation
        self.kernel_initializer = keras.initializers.get(kernel_initializer)

    def build(self, input_shape):
        d, e, f = input_shape[-1], self.num_experts, self.hidden_dim
        # The router stays float32 under mixed precision (routing decisions are brittle).
        self.router = self.add_logical_weight("router", (d, e), None, self.kernel_initializer,
                                              dtype="float32", autocast=False)[0]

        def experts(name, shape, initializer):  # cut by expert over the `ep` shards
            return self.add_logical_weight(name, shape, 0, initializer, axis="expert", shards=self.ep)

        self.w_in = experts("w_in", (e, d, f), self.kernel_initializer)
        self.b_in = experts("b_in", (e, f), "zeros")
        if self.gated:
            self.w_gate = experts("w_gate", (e, d, f), self.kernel_initializer)
        self.w_out = experts("w_out", (e, f, d), self.kernel_initializer)
        self.b_out = experts("b_out", (e, d), "zeros")
        for name in ("dropped_fraction", "load_min", "load_max", "balance"):
            # only_first_replica: under tf.distribute each replica may write it (no reduction).
            setattr(self, name, self.add_logical_weight(name, (), None, "zeros", trainable=False, dtype="float32",
                                                        autocast=False, aggregation="only_first_replica")[0])
        # Totals over the training calls since the last reset (module docstring). Plain
        # weights, not logical ones: statistics, not state, so .keras files do not hold them.
        self.total_calls, self.total_balance, self.total_assignments, self.total_load = (
            self.add_weight(shape=shape, initializer="zeros", name=name, trainable=False, dtype="float32",
                            autocast=False, aggregation="only_first_replica")
            for name, shape in (("total_calls", ()), ("total_balance", ()), ("total_assignments", ()),
                                ("total_load", (e,))))
        for v in self.statistics_totals():
            setattr(v, _TOTAL, True)

    def statistics_totals(self) -> list:
        """The variables that sum statistics over training calls (see the module docstring)."""
        return [self.total_calls, self.total_balance, self.total_assignments, self.total_load]

    def reset_statistics(self) -> None:
        """Start the statistics totals again from zero (phalanx.fit does it every step)."""
        for v in self.statistics_totals():
            v.assign(keras.ops.zeros(v.shape, v.dtype))

    def capacity(self, tokens: int) -> int:
        """Slots per expert for a call of ``tokens`` tokens (``tokens`` when nothing drops)."""
        if self.capacity_factor == 0:
            return tokens
        return max(1, math.ceil(self.capacity_factor * tokens * self.top_k / self.num_experts))

    def _expert(self, shard: dict, i: int, x):
        """Local expert ``i`` of a shard (``shard``: its weight values) on tokens ``x``."""
        h = ops.matmul(x, shard["w_in"][i]) + shard["b_in"][i]
        if self.gated:
            h = self.activation(ops.matmul(x, shard["w_gate"][i])) * h
        else:
            h = self.activation(h)
        return ops.matmul(h, shard["w_out"][i]) + shard["b_out"][i]

    def _shard(self, shard: dict, local, x):
        """A shard's experts on its routed tokens ``x`` (``local``: each row's expert within
        the shard): the rows are split by expert, each expert runs on its own rows, and the
        results are put back in the rows' order. Runs where the shard lives."""
        import tensorflow as tf

        per_shard = self.num_experts // self.ep
        if per_shard == 1:
            return self._expert(shard, 0, x)
        rows = tf.dynamic_partition(tf.range(tf.shape(x)[0]), local, per_shard)
        parts = tf.dynamic_partition(x, local, per_shard)
        return tf.dynamic_stitch(rows, [self._expert(shard, i, part) for i, part in enumerate(parts)])

    def call(self, inputs, training=None):
        import tensorflow as tf  # the dispatch uses TensorFlow's gather/scatter ops

        shape = tf.shape(inputs)
        d = inputs.shape[-1]
        x = tf.reshape(inputs, [-1, d])
        n = tf.shape(x)[0]
        logits = tf.matmul(tf.cast(x, tf.float32), tf.convert_to_tensor(self.router))
        probs = tf.nn.softmax(logits, axis=-1)
        gates, chosen = tf.math.top_k(probs, k=self.top_k)                  # [n, k]
        if self.top_k > 1:
            gates = gates / tf.reduce_sum(gates, axis=-1, keepdims=True)
        # Position of each assignment in its expert's queue: first choices of all tokens,
        # then second choices, each in token order.
        onehot = tf.one_hot(tf.transpose(chosen), self.num_experts, dtype=tf.int32)  # [k, n, E]
        flat = tf.reshape(onehot, [-1, self.num_experts])
        position = tf.reshape(tf.reduce_sum((tf.cumsum(flat, axis=0) - 1) * flat, axis=-1), [self.top_k, n])
        capacity = n if self.capacity_factor == 0 else tf.cast(tf.math.ceil(
            self.capacity_factor * tf.cast(n * self.top_k, tf.float32) / self.num_experts), tf.int32)
        kept = tf.transpose(position < tf.maximum(capacity, 1))               # [n, k]
        out = tf.zeros_like(x)
        names = ["w_in", "b_in", "w_out", "b_out"] + (["w_gate"] if self.gated else [])
        per_shard = self.num_experts // self.ep
        # One dispatch per shard, not per expert: the tokens routed to any expert of shard j
        # are gathered once (token order, a token's choices in order), sent to the shard's
        # device with their expert within the shard, computed there and sent back once.
        for j in range(self.ep):
            shard = dict(zip(names, _compute_values(self, [getattr(self, name)[j] for name in names])))
            mine = kept if self.ep == 1 else tf.logical_and(tf.equal(chosen // per_shard, j), kept)  # [n, k]
            where = tf.where(mine)                                           # (token, choice) pairs
            tokens = where[:, 0]
            gate = tf.gather_nd(gates, where)
            local = tf.gather_nd(chosen, where) - j * per_shard
            routed = tf.gather(x, tokens)
            # Expert parallelism: the shard's experts run where the shard lives (the engine
            # puts it on another replica's device); its tokens go there and come back.
            with on_device_of(shard["w_in"]):
                y = self._shard(shard, local, routed)
            out = tf.tensor_scatter_nd_add(out, tokens[:, None], y * tf.cast(gate[:, None], y.dtype))
        balance = self._add_losses(logits, probs, chosen)
        if training:
            # the kept assignments of each expert
            load = tf.reduce_sum(tf.one_hot(chosen, self.num_experts, dtype=tf.float32) *
                                 tf.cast(kept, tf.float32)[..., None], axis=[0, 1])
            total = tf.cast(n * self.top_k, tf.float32)
            kept_total = tf.maximum(tf.reduce_sum(load), 1.0)
            self.balance.assign(balance)
            self.dropped_fraction.assign(1.0 - tf.reduce_sum(load) / total)
            self.load_min.assign(tf.reduce_min(load) / kept_total * self.num_experts)
            self.load_max.assign(tf.reduce_max(load) / kept_total * self.num_experts)
            for variable, value in ((self.total_calls, 1.0), (self.total_balance, balance),
                                    (self.total_assignments, total), (self.total_load, load)):
                variable.assign(variable + value)
        return tf.reshape(out, shape)

    def _add_losses(self, logits, probs, chosen) -> None:
        import tensorflow as tf

        first = tf.one_hot(chosen[:, 0], self.num_experts, dtype=tf.float32)
        fraction = tf.reduce_mean(first, axis=0)                             # f_e
        mean_prob = tf.reduce_mean(probs, axis=0)                            # P_e
        balance = self.num_experts * tf.reduce_sum(fraction * mean_prob)
        if self.aux_loss_coef:
            self.add_loss(self.aux_loss_coef * balance)
        if self.z_loss_coef:
            self.add_loss(self.z_loss_coef * tf.reduce_mean(tf.square(tf.reduce_logsumexp(logits, axis=-1))))
        return balance

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        config = super().get_config()
        config.update({"num_experts": self.num_experts, "hidden_dim": self.hidden_dim, "top_k": self.top_k,
                       "capacity_factor": self.capacity_factor, "aux_loss_coef": self.aux_loss_coef,
                       "z_loss_coef": self.z_loss_coef, "gated": self.gated, "activation": self._activation_name,
                       "kernel_initializer": keras.initializers.serialize(self.kernel_initializer), "ep": self.ep})
        return config
