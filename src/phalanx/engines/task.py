"""What is trained: a model, its named variables, its loss on a batch.

The engines are written against :class:`Task`, so the built-in GPT and any user
Keras 3 model (Sequential, Functional or subclassed, with a Keras loss) train
through the same loop.

Example:
    >>> import keras, numpy as np
    >>> task = KerasTask(lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)]),
    ...                  keras.losses.MeanSquaredError())
    >>> model = task.build()
    >>> float(task.loss(model, (np.ones([4, 3], "float32"), np.zeros([4, 1], "float32")))) >= 0
    True
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import tensorflow as tf

from phalanx.checkpoint import boxes
from phalanx.config import Config, ConfigError, ModelConfig
from phalanx.core import costs
from phalanx.models import gpt, transformer


class Task(Protocol):
    def build(self) -> Any:
        """Create the model's variables (called inside the engine's strategy scope)."""

    def named_variables(self, model) -> dict[str, tf.Variable]:
        """Logical name -> trainable variable (the names checkpoints use)."""

    def loss(self, model, batch, training: bool = False) -> tf.Tensor:
        """Mean loss over the batch, float32 scalar."""

    def decays(self, name: str) -> bool:
        """Whether AdamW weight decay applies to the named variable."""

    def flops_per_example(self) -> float:
        """Training FLOPs (forward + backward) per example, for MFU; 0 if unknown."""

    def tokens_per_example(self) -> int:
        """Tokens (or samples) an example counts as, for throughput."""


def call_with_losses(model, inputs, training: bool = False):
    """``model(inputs)`` and the float32 sum of the losses its layers added in this call.

    Under tf.distribute every replica calls the same layer objects at once (a thread each),
    so the losses a layer keeps for ``model.losses`` may be another replica's (measured: a
    dp2 MoE GPT step's loss 13% above the mean of the replicas' own). A Keras
    ``StatelessScope`` collects this call's own; it also holds the call's variable updates
    (MoE statistics, dropout seeds) back, and they are applied after it, each to this
    replica's copy (:func:`_assign_here`).

    Example:
        >>> import keras, numpy as np
        >>> from phalanx.layers import MoE
        >>> x, moe = keras.Input((4, 8)), MoE(num_experts=4, hidden_dim=8, aux_loss_coef=0.5)
        >>> model = keras.Model(x, moe(x))
        >>> y, aux = call_with_losses(model, np.ones([2, 4, 8], "float32"), training=True)
        >>> bool(np.isclose(float(aux), 0.5 * float(moe.balance.numpy())))  # the call's balancing loss
        True
    """
    import keras  # the scope is Keras's; TensorFlow is already loaded

    with keras.StatelessScope(collect_losses=True, initialize_variables=False) as scope:
        outputs = model(inputs, training=training)
    updates = [(v, scope.get_current_value(v)) for v in model.variables]
    updates = [(v, value) for v, value in updates if value is not None]
    if len(updates) != len(scope.state_mapping):
        raise RuntimeError(f"{model.name}: {len(scope.state_mapping) - len(updates)} variable updates of the call "
                           f"are on variables model.variables does not list; they cannot be applied")
    for variable, value in updates:
        _assign_here(variable, value)
    losses = [tf.cast(loss, tf.float32) for loss in scope.losses]
    return outputs, tf.add_n(losses) if losses else tf.zeros([], tf.float32)


def _tf_variable(v) -> tf.Variable:
    """The ``tf.Variable`` behind a Keras 3 variable (Keras wraps it in ``.value``)."""
    return v.value if hasattr(v, "value") and isinstance(v.value, tf.Variable) else v


def _assign_here(variable, value) -> None:
    """Assign a (Keras) variable's copy on this replica only. An aggregated write (MoE's
    statistics are ``only_first_replica``) is a cross-replica synchronisation, which
    TensorFlow refuses inside the engine's micro-batch loop (``merge_call`` in control flow)
    and which would keep replica 0's value alone; each replica writes its own copy instead,
    and the engine sums the step totals' copies after the step (:meth:`GPTTask.step_totals`)."""
    var = variable.value if hasattr(variable, "value") and isinstance(variable.value, tf.Variable) else variable
    if tf.distribute.has_strategy() and not tf.distribute.in_cross_replica_context() \
            and hasattr(var, "_get_on_device_or_primary"):  # a distributed variable: this replica's copy
        var = var._get_on_device_or_primary()
    var.assign(tf.cast(value, var.dtype))


MIXED_POLICIES = ("mixed_bfloat16", "mixed_float16")


def for_config(task, cfg: Config):
    """``task`` as an engine trains it under ``cfg``: a task that names no precision policy
    (``GPTTask(model_cfg)``, ``KerasTask(...)``) gets ``precision.policy`` (a copy: the
    caller's task is left as it is); one that names another policy is refused, so that no
    engine trains in a precision its config does not say. A task without a ``dtype_policy``
    attribute (a user's own :class:`Task`) is returned as it is.

    Example:
        >>> from phalanx.config import Config
        >>> cfg = Config().replace(precision={"policy": "mixed_bfloat16"})
        >>> for_config(GPTTask(cfg.model), cfg).dtype_policy
        'mixed_bfloat16'
        >>> try:
        ...     for_config(GPTTask(cfg.model, "float32"), cfg)
        ... except ConfigError as err:
        ...     print(err.key, "|", str(err).split(":")[1].split(" its model")[0])
        precision.policy |  mixed_bfloat16, but the GPTTask was built for float32
    """
    if not hasattr(task, "dtype_policy"):
        return task
    policy = cfg.precision.policy
    if task.dtype_policy is None:
        return task.with_policy(policy)
    if task.dtype_policy != policy:
        raise ConfigError("precision.policy", f"{policy}, but the {type(task).__name__} was built for "
                                              f"{task.dtype_policy}: its model would train in {task.dtype_policy}. "
                                              f"Build the task without a policy (it then takes precision.policy) "
                                              f"or set precision.policy={task.dtype_policy}")
    return task


class GPTTask:
    """The built-in GPT (:func:`phalanx.models.transformer.gpt` at ``tp=1``) on int32 batches
    ``[b, seq_len + 1]``; its weights are named as :func:`phalanx.models.gpt.weight_shapes`
    names them (:meth:`variable_parts`).

    ``dtype_policy``: the Keras policy its layers compute in. None (the default): the
    ``precision.policy`` of the config an engine trains it under (:func:`for_config`; an engine
    refuses a task built for another policy); built outside an engine, float32."""

    def __init__(self, cfg: ModelConfig, dtype_policy: str | None = None, seed: int = 0):
        self.cfg, self.dtype_policy, self.seed = cfg, dtype_policy, seed

    def with_policy(self, dtype_policy: str) -> "GPTTask":
        """The same task computing in ``dtype_policy``."""
        return GPTTask(self.cfg, dtype_policy, self.seed)

    def build(self):
        model = transformer.gpt(self.cfg, seed=None, dtype_policy=self.dtype_policy or "float32")
        # one tensor at a time (the values of gpt.initial_weights, drawn in seeded tiles): the
        # host never holds the whole initial model
        init = gpt.initializer(self.cfg, self.seed)
        for name, parts in self.variable_parts(model).items():
            value = init(name)
            for var, box in parts:
                var.assign(value[boxes.index(box)].reshape(tuple(var.shape)))
        return model

    def variable_parts(self, model) -> dict[str, list]:
        """Logical name -> ``[(tf.Variable, box of the logical tensor it holds)]``
        (:func:`phalanx.models.transformer.weight_parts`), in :func:`~phalanx.models.gpt.weight_shapes`
        order; the engines keep their state under these names."""
        parts = transformer.weight_parts(model)
        shapes = gpt.weight_shapes(self.cfg)
        got = {n: transformer.built_in_shape(p) for n, p in parts.items()}
        if list(got) != list(shapes) or any(got[n] != shapes[n] for n in shapes):
            raise ValueError(f"model {model.name!r} does not hold the weights of model config {self.cfg}: "
                             f"{sorted(set(got.items()) ^ set(shapes.items()))[:4]} differ")
        return {n: [(_tf_variable(p.variable), p.box) for p in parts[n]] for n in shapes}

    def loss(self, model, batch, training: bool = False) -> tf.Tensor:
        """Mean token cross-entropy, plus for an MoE GPT the balancing losses of this call
        (this replica's rows: :func:`call_with_losses`)."""
        if not self.cfg.experts:
            return gpt.lm_loss(model(batch[:, :-1], training=training), batch[:, 1:])
        logits, balancing = call_with_losses(model, batch[:, :-1], training)
        return gpt.lm_loss(logits, batch[:, 1:]) + balancing

    def decays(self, name: str) -> bool:
        return gpt.decays(name)

    def step_totals(self, model) -> list:
        """The variables :meth:`loss` adds to on each replica's own copy: the MoE layers'
        statistics totals (:meth:`phalanx.layers.MoE.statistics_totals`). The engine starts
        them at zero every step and sums the copies after it, so that they hold the whole
        batch's (what :mod:`phalanx.train.moe_stats` reads); empty for a dense GPT."""
        return [v for block in transformer.blocks(model) if block.moe is not None
                for v in block.moe.statistics_totals()]

    def flops_per_example(self) -> float:
        return costs.gpt_training_flops_per_token(self.cfg) * self.cfg.seq_len

    def tokens_per_example(self) -> int:
        return self.cfg.seq_len


class KerasTask:
    """Any Keras 3 model with a Keras loss, on ``(x, y)`` batches.

    ``model_fn`` builds the model (it is called inside the strategy scope, so the
    variables land on the right devices). Weights are named by their Keras path.

    ``dtype_policy`` (None: the ``precision.policy`` of the config an engine trains it under,
    :func:`for_config`): under a mixed policy, the layers the model left on ``float32`` take it
    (float32 variables, lower-precision compute: as if built under it, as :func:`phalanx.fit`
    runs a model); a layer on another mixed policy is refused (:func:`honour_policy`).
    """

    def __init__(self, model_fn: Callable[[], Any], loss_fn: Callable, sample_input=None,
                 dtype_policy: str | None = None):
        self.model_fn, self.loss_fn, self.sample_input = model_fn, loss_fn, sample_input
        self.dtype_policy = dtype_policy

    def with_policy(self, dtype_policy: str) -> "KerasTask":
        """The same task computing in ``dtype_policy``."""
        return KerasTask(self.model_fn, self.loss_fn, self.sample_input, dtype_policy)

    def build(self):
        model = self.model_fn()
        if self.dtype_policy is not None:
            honour_policy(model, self.dtype_policy)
        if not model.built and self.sample_input is not None:
            model(self.sample_input)
        return model

    def named_variables(self, model) -> dict[str, tf.Variable]:
        names = {}
        for v in model.trainable_variables:
            names[v.path] = v.value if hasattr(v, "value") else v
        return names

    def loss(self, model, batch, training: bool = False) -> tf.Tensor:
        """``loss_fn(y, model(x))`` plus, as Keras's ``compute_loss`` adds ``model.losses``,
        the losses the model's layers added in this call (``add_loss``: this replica's own,
        :func:`call_with_losses`) and its weights' regularisation losses, each summed."""
        x, y = batch
        y_pred, added = call_with_losses(model, x, training)
        parts = [tf.cast(self.loss_fn(y, y_pred), tf.float32) * self._keras_replica_scale(), added]
        # Read outside the call's scope: a regulariser reads the (replica's) variable itself.
        parts += [tf.cast(tf.reduce_sum(v.regularizer(v)), tf.float32)
                  for v in model.trainable_weights if getattr(v, "regularizer", None) is not None]
        return tf.add_n(parts)

    def _keras_replica_scale(self) -> float:
        """What undoes Keras's share of a replica: a ``keras.losses.Loss`` with a mean reduction
        divides its value by the strategy's replicas under tf.distribute (for Keras's own
        step to sum them: ``keras/src/losses/loss.py``, ``scale_loss_for_distribution``); the
        engines take the mean over replicas themselves, so the loss here is the rows' own mean."""
        import keras  # loaded with the model; TensorFlow is already loaded

        if isinstance(self.loss_fn, keras.losses.Loss) and \
                getattr(self.loss_fn, "reduction", None) in ("sum_over_batch_size", "mean", "mean_with_sample_weight"):
            return float(tf.distribute.get_strategy().num_replicas_in_sync)
        return 1.0

    def decays(self, name: str) -> bool:
        return name.endswith("kernel") or name.endswith("embeddings")

    def flops_per_example(self) -> float:
        return 0.0

    def tokens_per_example(self) -> int:
        return 1


def honour_policy(model, policy: str) -> None:
    """Run the Keras ``model`` in ``precision.policy`` = ``policy``, or refuse: under a mixed
    policy its layers still on ``float32`` (Keras's default) take it, as if the model had been
    built under it; a layer that computes in a mixed policy other than ``policy`` (under
    ``float32``: any mixed policy) is a :class:`ConfigError` naming both. Layers on other
    policies (e.g. a quantized one) keep theirs.

    Example:
        >>> import keras
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        >>> honour_policy(model, "mixed_bfloat16")
        >>> model.layers[0].compute_dtype, model.layers[0].kernel.dtype
        ('bfloat16', 'float32')
        >>> try:
        ...     honour_policy(model, "float32")
        ... except ConfigError as err:
        ...     print(err.key)
        precision.policy
    """
    for layer in model._flatten_layers(include_self=True):
        name = layer.dtype_policy.name
        if name == policy:
            continue
        if name == "float32" and policy in MIXED_POLICIES:
            layer.dtype_policy = policy
        elif name in MIXED_POLICIES:
            raise ConfigError("precision.policy", f"{policy}, but layer {layer.name!r} of model {model.name!r} "
                                                  f"computes in {name}: set precision.policy={name}, or build "
                                                  f"the model without that policy")
