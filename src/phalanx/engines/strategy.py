"""Engines run one training step; :class:`StrategyEngine` does it with tf.distribute.

The trainer drives any engine through :class:`Engine` (docs/DESIGN.md). This one trains the
Trainer's Keras task (:class:`~phalanx.engines.task.KerasTask`) on one device
(``OneDeviceStrategy``), data parallel on one host (``MirroredStrategy``) and across workers
(``MultiWorkerMirroredStrategy``, built by :mod:`phalanx.cluster`), and is the step the
parameter-server engine (:class:`~phalanx.engines.ps.ParameterServerEngine`) schedules for the
built-in GPT (``phalanx train`` builds the Keras-model engine for the GPT everywhere else). The
step is, in order:

1. each replica takes its rows of the batch and runs ``grad_accum`` micro-batches,
   summing float32 gradients of ``loss x loss_scale / (replicas x grad_accum)``
   (gradient accumulation as a transform of the step: the sum equals the gradient of
   the mean loss over the whole global batch);
2. gradients are summed across replicas (``batch_reduce_to``);
3. they are unscaled, their global norm is taken and clipped; a step whose norm is
   not finite (float16 overflow) changes nothing but the loss scale;
4. AdamW (:mod:`phalanx.core.optim`) updates every copy of every variable.

Example:
    >>> from phalanx.config import Config
    >>> from phalanx.engines.task import GPTTask
    >>> cfg = Config().replace(model={"layers": 1, "d_model": 32, "heads": 2, "ffn": 64, "seq_len": 8},
    ...                        train={"global_batch": 4})
    >>> engine = StrategyEngine(cfg, GPTTask(cfg.model))
    >>> import numpy as np
    >>> out = engine.train_step(np.zeros([4, 9], np.int32))
    >>> sorted(out)
    ['grad_norm', 'loss', 'loss_scale', 'lr', 'skipped']
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import tensorflow as tf

from phalanx import checkpoint, prune
from phalanx.checkpoint import boxes
from phalanx.cluster.strategies import local_strategy
from phalanx.config import Config
from phalanx.core import optim
from phalanx.core.batch import rows, split_batch, take
from phalanx.core.loss_scale import LossScale
from phalanx.engines.task import Task, for_config


class Engine(Protocol):
    dp: int

    def train_step(self, batch) -> dict[str, tf.Tensor]: ...

    def eval_step(self, batch) -> tf.Tensor: ...

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...

    def num_params(self) -> int: ...


class JoinedVariable:
    """A logical tensor held by several variables, each holding a box of it
    (:mod:`phalanx.checkpoint.boxes`) in its own shape of that size: e.g. the built-in GPT's
    ``attn/qkv/kernel`` ``[d, 3d]`` is the attention's query, key and value ``[d, heads,
    head_dim]`` side by side (:func:`phalanx.models.transformer.weight_parts`). What the state,
    the checkpoints and pruning use of a variable: ``shape``, ``dtype``, ``read_value()``
    (joined on the device), ``numpy()`` and ``assign(array)`` (cut into the variables).

    Example:
        >>> q, k = tf.Variable(tf.ones([2, 1, 2])), tf.Variable(tf.zeros([2, 2]))
        >>> qk = JoinedVariable([(q, ((0, 2), (0, 2))), (k, ((0, 2), (2, 4)))])
        >>> qk.numpy().tolist()
        [[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0]]
        >>> qk.assign(np.arange(8, dtype="float32").reshape(2, 4)); q.numpy()[:, 0].tolist()
        [[0.0, 1.0], [4.0, 5.0]]
    """

    def __init__(self, parts: list):
        self.parts = [(v, tuple(tuple(int(i) for i in ab) for ab in box)) for v, box in parts]
        shape = tuple(max(box[a][1] for _, box in self.parts) for a in range(len(self.parts[0][1])))
        cut = [a for a in range(len(shape)) if any(box[a] != (0, shape[a]) for _, box in self.parts)]
        if len(cut) > 1:
            raise ValueError(f"the parts {[box for _, box in self.parts]} of a {shape} tensor are side by side along "
                             f"more than one axis")
        self.axis = cut[0] if cut else None
        # the parts in box order along that axis (what read_value concatenates)
        self._order = sorted(range(len(self.parts)), key=lambda i: self.parts[i][1][self.axis or 0][0])
        self.shape, self.dtype = tf.TensorShape(shape), self.parts[0][0].dtype

    def read_value(self):
        pieces = [tf.reshape(self.parts[i][0].read_value(), boxes.shape_of(self.parts[i][1])) for i in self._order]
        return pieces[0] if len(pieces) == 1 else tf.concat(pieces, axis=self.axis)

    def numpy(self) -> np.ndarray:
        return np.asarray(self.read_value().numpy())

    def join(self, values: list) -> np.ndarray:
        """The logical array from arrays shaped as the variables (one per part, in order)."""
        whole = np.empty(tuple(self.shape), np.asarray(values[0]).dtype)
        for (_, box), value in zip(self.parts, values):
            whole[boxes.index(box)] = np.reshape(value, boxes.shape_of(box))
        return whole

    def assign(self, value) -> None:
        value = np.asarray(value)
        for v, box in self.parts:
            v.assign(np.reshape(value[boxes.index(box)], tuple(v.shape)))


def _logical(names: list, var_names: list, variables: list, boxes_of: list) -> dict:
    """Logical name -> its variable (a whole one as it is) or :class:`JoinedVariable`."""
    out = {}
    for name in names:
        held = [(v, box) for n, v, box in zip(var_names, variables, boxes_of) if n == name]
        whole = len(held) == 1 and (held[0][1] is None or
                                    tuple(b - a for a, b in held[0][1]) == tuple(held[0][0].shape))
        out[name] = held[0][0] if whole else JoinedVariable(held)
    return out


class StrategyEngine:
    """Data-parallel training step through a ``tf.distribute`` strategy."""

    def __init__(self, cfg: Config, task: Task, strategy: tf.distribute.Strategy | None = None):
        # the task computes in precision.policy (a task built for another one is refused)
        task = for_config(task, cfg)
        self.cfg, self.task = cfg, task
        self.strategy = strategy or local_strategy(["/device:CPU:0"])
        self.dp = self.strategy.num_replicas_in_sync
        self.local_replicas = len(self.strategy.extended.worker_devices)
        self.accum = cfg.train.grad_accum
        with self.strategy.scope():
            self.model = task.build()
            # Logical name -> the model variables holding it, each with its box of the tensor (None:
            # the whole of it). The step updates the model's own variables (and moments and masks
            # of their shapes); the state, the checkpoints and pruning see the logical tensors.
            parts_of = getattr(task, "variable_parts", None)
            parts = parts_of(self.model) if parts_of is not None else \
                {n: [(v, None)] for n, v in task.named_variables(self.model).items()}
            self.names = list(parts)
            self._vars = [v for n in self.names for v, _ in parts[n]]
            self._var_names = [n for n in self.names for _ in parts[n]]  # each variable's logical name
            # what the task's loss adds to on each replica's own copy (GPTTask: MoE statistics)
            self.step_totals = list(getattr(task, "step_totals", lambda model: [])(self.model))
            self._m = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"m/{n}")
                       for n, v in zip(self._var_names, self._vars)]
            self._v = [tf.Variable(tf.zeros_like(v), trainable=False, name=f"v/{n}")
                       for n, v in zip(self._var_names, self._vars)]
            self.step = tf.Variable(0, trainable=False, dtype=tf.int64, name="optimizer_step")
            self.loss_scale = LossScale(cfg)
            # pruning masks (phalanx.prune), all ones until apply_masks; multiplied into every update
            self._masks = [None] * len(self._vars)
            if cfg.train.prune.target > 0:
                self._masks = [tf.Variable(tf.ones_like(v), trainable=False, name=f"mask/{n}") if prune.prunable(n)
                               else None for n, v in zip(self._var_names, self._vars)]
        boxes_of = [box for n in self.names for _, box in parts[n]]
        self.variables = _logical(self.names, self._var_names, self._vars, boxes_of)
        self.m = _logical(self.names, self._var_names, self._m, boxes_of)
        self.v = _logical(self.names, self._var_names, self._v, boxes_of)
        self.masks = _logical([n for n in self.names if prune.prunable(n)], self._var_names, self._masks, boxes_of) \
            if cfg.train.prune.target > 0 else {}
        self._train_fn = tf.function(self._train_step)
        self._eval_fn = tf.function(self._eval_step)

    # -- the step ------------------------------------------------------------

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        return self._train_fn(batch)

    def eval_step(self, batch) -> tf.Tensor:
        return self._eval_fn(batch)

    def _local_rows(self, batch):
        """This replica's rows of this worker's batch."""
        ctx = tf.distribute.get_replica_context()
        local_id = ctx.replica_id_in_sync_group % self.local_replicas
        per_replica = tf.shape(tf.nest.flatten(batch)[0])[0] // self.local_replicas
        return rows(batch, local_id * per_replica, per_replica)

    def _replica_grads(self, batch):
        variables = self._vars
        micro = split_batch(self._local_rows(batch), self.accum)
        scale = self.loss_scale.scale.read_value()
        norm = float(self.dp * self.accum)
        if self.accum == 1:
            # No accumulation: skip the while loop and the zero-initialised running sum
            # (a pass over every parameter); the result is bit-identical.
            with tf.GradientTape() as tape:
                loss = self.task.loss(self.model, take(micro, 0), training=True)
                scaled = loss * scale / norm
            grads = [tf.convert_to_tensor(tf.cast(g, tf.float32)) for g in tape.gradient(scaled, variables)]
            return grads, loss / norm
        grads = [tf.zeros_like(v) for v in variables]
        loss_sum = tf.constant(0.0)
        for i in tf.range(self.accum):
            with tf.GradientTape() as tape:
                loss = self.task.loss(self.model, take(micro, i), training=True)
                scaled = loss * scale / norm
            step_grads = tape.gradient(scaled, variables)
            grads = [a + tf.cast(g, tf.float32) for a, g in zip(grads, step_grads)]
            loss_sum += loss
        return grads, loss_sum / norm

    def _reduced_grads(self, batch):
        """Gradients of the mean loss (still multiplied by the loss scale), summed over replicas."""
        grads, loss = self.strategy.run(self._replica_grads, args=(batch,))
        variables = self._vars
        grads = self.strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, list(zip(grads, variables)))
        return grads, self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    def _step_gradients(self, batch):
        """:meth:`_reduced_grads` of a step: the step totals start at zero (every step sees only
        its own batch; the one replica of a parameter-server step adds the whole batch's)."""
        for var in self.step_totals:
            var.assign(tf.zeros(var.shape, var.dtype))
        return self._reduced_grads(batch)

    def _train_step(self, batch):
        grads, loss = self._step_gradients(batch)
        s = optim.step_scalars(optim.global_norm(grads), self.loss_scale.scale.read_value(), self.step,
                               self.cfg.train)
        for name, var, grad, m, v, mask in zip(self._var_names, self._vars, grads, self._m, self._v, self._masks):
            args = (grad, m, v, s.factor, s.count, s.lr, s.finite, self.task.decays(name))
            if mask is not None:
                args += (mask,)
            self._update_variable(var, args)
        return {"loss": loss, **optim.finish_step(s, self.step, self.loss_scale)}

    def _update_variable(self, var, args) -> None:
        """Apply AdamW to every device copy of ``var`` (cross-replica context)."""
        self.strategy.extended.update(var, self._apply_one, args=args, group=False)

    def _apply_one(self, var, grad, m, v, factor, t, lr, finite, decay, mask=None):
        # Runs once per device copy of `var`; m and v are that device's slot copies.
        # Non-finite gradients change nothing (optim.apply_adamw skips the update).
        return optim.apply_adamw(var, m, v, grad, step=t, lr=lr, factor=factor, finite=finite,
                                 cfg=self.cfg.train, decay=decay, mask=mask)

    def _replica_eval(self, batch):
        return self.task.loss(self.model, self._local_rows(batch), training=False) / float(self.dp)

    def _eval_step(self, batch):
        loss = self.strategy.run(self._replica_eval, args=(batch,))
        return self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    # -- state -----------------------------------------------------------------

    def _state_variables(self) -> dict[str, tf.Variable]:
        state = dict(self.variables)
        state["optimizer/step"] = self.step
        for n in self.names:
            state[f"optimizer/m/{n}"] = self.m[n]
            state[f"optimizer/v/{n}"] = self.v[n]
        state.update(self.loss_scale.state())
        return state

    def checkpoint_slots(self) -> list[checkpoint.ShardSet]:
        """The state (weights, ``optimizer/m|v/*``, ``optimizer/step``, loss scale and, when
        pruning, the masks ``prune/mask/*``) as whole-variable slots spread over a few shard sets
        (:func:`phalanx.checkpoint.variable_sets`): a save reads, and a restore assigns, one
        variable at a time per writer thread, so the host never holds the whole state
        (``state_dict`` does: for tests and tools). The mask slots are optional: restoring a checkpoint
        written without pruning leaves the masks as they are (all ones in a new engine)."""
        variables = self._state_variables()
        variables.update({prune.MASK_PREFIX + name: mask for name, mask in self.masks.items()})
        sets = checkpoint.variable_sets(variables)
        for slot in (slot for s in sets for slot in s.slots):
            # restoring a mask only assigns it: the weights and moments saved beside it are zero where it is
            slot.optional = slot.name.startswith(prune.MASK_PREFIX)
        return sets

    def state_dict(self) -> dict[str, np.ndarray]:
        return {k: np.asarray(v.numpy()) for k, v in self._state_variables().items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        targets = self._state_variables()
        missing = sorted(set(targets) - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
                           f"was it written for a different model?")
        for name, var in targets.items():
            value = state[name]
            if tuple(value.shape) != tuple(var.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, "
                                 f"the model expects {tuple(var.shape)}: a different model config?")
            var.assign(value.astype(var.dtype.as_numpy_dtype))

    def num_params(self) -> int:
        return int(sum(np.prod(v.shape) for v in self._vars))

    def apply_masks(self, masks: dict[str, np.ndarray]) -> None:
        """Install (or replace) pruning masks (0/1, whole logical shapes, by weight name):
        zero the masked weights and their AdamW moments now; every later step keeps them
        zero. Only weights named when the engine was built with ``train.prune.target > 0``."""
        for name, mask in masks.items():
            if name not in self.masks:
                raise KeyError(f"no pruning mask slot for {name!r}: the engine was built without "
                               f"train.prune.target, or {name!r} is not a pruned weight")
            mask = np.asarray(mask, np.float32)
            if mask.shape != tuple(self.masks[name].shape):
                raise ValueError(f"mask {name!r} has shape {mask.shape}, the weight {tuple(self.masks[name].shape)}")
            self.masks[name].assign(mask)
            for var in (self.variables[name], self.m[name], self.v[name]):
                var.assign(var.numpy() * mask)

    def weights(self) -> dict[str, np.ndarray]:
        return {n: self.variables[n].numpy() for n in self.names}
