"""Engines run one training step; :class:`StrategyEngine` does it with tf.distribute.

The trainer drives any engine through :class:`Engine` (docs/DESIGN.md). This one
covers one device (``OneDeviceStrategy``), data parallelism on one host
(``MirroredStrategy``) and across workers (``MultiWorkerMirroredStrategy``, built by
:mod:`phalanx.cluster`). The step is, in order:

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
from phalanx.cluster.strategies import local_strategy
from phalanx.config import Config
from phalanx.core import optim
from phalanx.core.batch import rows, split_batch, take
from phalanx.core.loss_scale import LossScale
from phalanx.engines.task import Task


class Engine(Protocol):
    dp: int

    def train_step(self, batch) -> dict[str, tf.Tensor]: ...

    def eval_step(self, batch) -> tf.Tensor: ...

    def state_dict(self) -> dict[str, np.ndarray]: ...

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None: ...

    def num_params(self) -> int: ...


class StrategyEngine:
    """Data-parallel training step through a ``tf.distribute`` strategy."""

    def __init__(self, cfg: Config, task: Task, strategy: tf.distribute.Strategy | None = None):
        self.cfg, self.task = cfg, task
        self.strategy = strategy or local_strategy(["/device:CPU:0"])
        self.dp = self.strategy.num_replicas_in_sync
        self.local_replicas = len(self.strategy.extended.worker_devices)
        self.accum = cfg.train.grad_accum
        with self.strategy.scope():
            self.model = task.build()
            self.variables = task.named_variables(self.model)
            self.names = list(self.variables)
            # what the task's loss adds to on each replica's own copy (GPTTask: MoE statistics)
            self.step_totals = list(getattr(task, "step_totals", lambda model: [])(self.model))
            self.m = {n: tf.Variable(tf.zeros_like(v), trainable=False, name=f"m/{n}")
                      for n, v in self.variables.items()}
            self.v = {n: tf.Variable(tf.zeros_like(v), trainable=False, name=f"v/{n}")
                      for n, v in self.variables.items()}
            self.step = tf.Variable(0, trainable=False, dtype=tf.int64, name="optimizer_step")
            self.loss_scale = LossScale(cfg)
            # pruning masks (phalanx.prune), all ones until apply_masks; multiplied into every update
            self.masks = {}
            if cfg.train.prune.target > 0:
                self.masks = {n: tf.Variable(tf.ones_like(v), trainable=False, name=f"mask/{n}")
                              for n, v in self.variables.items() if prune.prunable(n)}
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
        variables = [self.variables[n] for n in self.names]
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
        variables = [self.variables[n] for n in self.names]
        grads = self.strategy.extended.batch_reduce_to(
            tf.distribute.ReduceOp.SUM, list(zip(grads, variables)))
        return grads, self.strategy.reduce(tf.distribute.ReduceOp.SUM, loss, axis=None)

    def gradients(self, batch) -> dict[str, np.ndarray]:
        """The (unscaled) gradients of the mean loss over ``batch``, by name; changes nothing."""
        if not hasattr(self, "_grad_fn"):
            self._grad_fn = tf.function(lambda b: self._reduced_grads(b)[0])
        grads = self._grad_fn(batch)
        scale = float(self.loss_scale.scale.numpy())
        return {n: np.asarray(tf.convert_to_tensor(g)) / scale for n, g in zip(self.names, grads)}

    def _sum_step_totals(self) -> None:
        """After a step's replicas each added their calls to their own copy of the step totals
        (started at zero): every copy gets the sum, the whole batch's."""
        if not self.step_totals or self.strategy.num_replicas_in_sync == 1:
            return
        copies = self.strategy.run(lambda: [tf.identity(v) for v in self.step_totals])
        for var, copy in zip(self.step_totals, copies):
            var.assign(self.strategy.reduce(tf.distribute.ReduceOp.SUM, copy, axis=None))

    def _train_step(self, batch):
        variables = [self.variables[n] for n in self.names]
        for var in self.step_totals:
            var.assign(tf.zeros(var.shape, var.dtype))
        grads, loss = self._reduced_grads(batch)
        self._sum_step_totals()
        scale = self.loss_scale.scale.read_value()
        norm = optim.global_norm(grads) / scale
        finite = tf.math.is_finite(norm)
        factor = optim.clip_factor(norm, self.cfg.train.clip_norm) / scale
        lr = optim.learning_rate(self.step, self.cfg.train)
        t = self.step + 1
        for name, var, grad in zip(self.names, variables, grads):
            args = (grad, self.m[name], self.v[name], factor, t, lr, finite, self.task.decays(name))
            if name in self.masks:
                args += (self.masks[name],)
            self._update_variable(var, args)
        self.step.assign_add(tf.cast(finite, tf.int64))
        self.loss_scale.update(finite)
        return {"loss": loss, "grad_norm": norm, "skipped": 1.0 - tf.cast(finite, tf.float32),
                "loss_scale": scale, "lr": lr}

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
        return int(sum(np.prod(v.shape) for v in self.variables.values()))

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
