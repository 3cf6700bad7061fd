"""The step shared by every hand-placed engine (GPT on the mesh, split Keras models).

A subclass says what a stage computes (:meth:`PipelinedEngine.forward`), which
variables each stage reads (``stage_keys``) and how a batch is cut into micro-batches;
this class runs the step in :class:`~phalanx.engines.strategy.StrategyEngine`'s order
(per-replica pipelines -> sum over copies and replicas -> unscale, global norm, clip,
skip on non-finite -> AdamW, ZeRO-sharded when asked) and describes its state as one
shard set per device, by logical name and box (:meth:`PipelinedEngine.checkpoint_slots`:
sharded checkpoints that load into any layout), or as whole logical tensors
(``state_dict``).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from phalanx import checkpoint
from phalanx.checkpoint import ShardSet, Slot
from phalanx.config import Config, ConfigError
from phalanx.core import optim
from phalanx.core.loss_scale import LossScale
from phalanx.mesh import Mesh
from phalanx.parallel.params import ShardedParams, ShardKey
from phalanx.parallel.pipeline import PipelineTrace, run_schedule, schedule_for
from phalanx.parallel.zero import ShardedAdamW

COMPUTE_DTYPES = {"float32": tf.float32, "mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16}


class PipelinedEngine:
    """Base of the mesh engines; see the module docstring. Subclasses call :meth:`_setup`."""

    cfg: Config
    mesh: Mesh
    params: ShardedParams
    stage_keys: list[list[tuple[ShardKey, int]]]  # per stage: (shard key, copy index)

    def _init_schedule(self, cfg: Config, mesh: Mesh) -> None:
        p = cfg.parallel
        self.cfg, self.mesh = cfg, mesh
        self.dp, self.pp, self.tp = mesh.dp, mesh.pp, mesh.tp
        self.accum, self.microbatches = cfg.train.grad_accum, p.microbatches
        if cfg.train.global_batch % (self.dp * self.accum * self.microbatches):
            raise ConfigError("train.global_batch",
                              f"{cfg.train.global_batch} is not divisible by dp x grad_accum x microbatches = "
                              f"{self.dp} x {self.accum} x {self.microbatches}")
        self.schedule = schedule_for(cfg, self.pp)
        self.chunks = self.schedule.num_stages
        self.compute_dtype = COMPUTE_DTYPES[cfg.precision.policy]

    def _setup(self, params: ShardedParams, decays) -> None:
        self.params = params
        self.optimizer = ShardedAdamW(params, self.cfg.train, self.cfg.parallel.zero, decays)
        with tf.device(self.mesh.device(0, 0, 0)):
            self.loss_scale = LossScale(self.cfg)
        self.traces: list[PipelineTrace] = [PipelineTrace() for _ in range(self.dp)]
        # Plain Python control flow builds the graph; autograph would only slow tracing.
        self._train_fn = tf.function(self._train_step, autograph=False)
        self._eval_fn = tf.function(self._eval_step, autograph=False)

    # -- to be provided ------------------------------------------------------------

    def forward(self, replica: int, stage: int, x, micro, training: bool = True):
        """Stage output for one micro-batch (``x`` is None on stage 0); the float32 mean
        loss on the last stage."""
        raise NotImplementedError

    # -- placement helpers -------------------------------------------------------------

    def stage_devices(self, replica: int, stage: int) -> list[str]:
        rank = stage % self.pp
        return [self.mesh.device(replica, rank, t) for t in range(self.tp)]

    def stage_variables(self, replica: int, stage: int) -> list[tf.Variable]:
        return [self.params.shards[key].copies[replica][c] for key, c in self.stage_keys[stage]]

    def micro_batches(self, batch, replica: int, parts: int) -> list:
        """Replica ``replica``'s rows of ``batch`` (any nest of tensors) in ``parts`` pieces."""
        rows = tf.nest.flatten(batch)[0].shape[0] // self.dp
        per = rows // parts
        with tf.device(self.mesh.device(replica, 0, 0)):
            return [tf.nest.map_structure(lambda t, i=i: t[replica * rows + i * per: replica * rows + (i + 1) * per],
                                          batch) for i in range(parts)]

    # -- the step ---------------------------------------------------------------------

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        return self._train_fn(batch)

    def eval_step(self, batch) -> tf.Tensor:
        return self._eval_fn(batch)

    def gradients(self, batch) -> dict[str, np.ndarray]:
        """The (unscaled) gradients of the mean loss over ``batch`` as whole logical
        tensors, summed over replicas and tied copies; changes nothing."""
        if not hasattr(self, "_grad_fn"):
            def grads_only(b):
                grads, _ = self._replica_grads(b, self.loss_scale.scale.read_value())
                return {f"{k[0]}@{k[1]}": tf.add_n(per) if len(per) > 1 else per[0] for k, per in grads.items()}
            self._grad_fn = tf.function(grads_only, autograph=False)
        flat = {k: v.numpy() for k, v in self._grad_fn(batch).items()}
        scale = float(self.loss_scale.scale.numpy())
        return {n: self.params.splits[n].join([flat[f"{n}@{t}"] for _, t in self.params.keys_of(n)]) / scale
                for n in self.params.names}

    def _replica_grads(self, batch, scale):
        """Per shard key, each replica's gradient of ``sum of micro-batch losses x scale /
        micro-batch count`` (summed over that replica's copies); and the list of losses.
        Every micro-batch's gradient is added into one running sum per stage as its backward
        ends (:func:`~phalanx.parallel.pipeline.run_schedule`, across accumulation steps too)."""
        micro_total = self.dp * self.accum * self.microbatches
        weight = scale / float(micro_total)
        grads: dict[ShardKey, list] = {key: [None] * self.dp for key in self.params.shards}
        losses = []
        for d in range(self.dp):
            micro = self.micro_batches(batch, d, self.accum * self.microbatches)
            variables = [self.stage_variables(d, s) for s in range(self.chunks)]
            stage_grads = None
            for a in range(self.accum):
                group = micro[a * self.microbatches:(a + 1) * self.microbatches]
                # Accumulation steps continue the same running sums: one gradient set per stage.
                stage_grads, loss_sum = run_schedule(
                    self.schedule, lambda s, i, x, _d=d, _g=group: self.forward(_d, s, x, _g[i]),
                    variables, weight, trace=self.traces[d] if a == 0 else None, prefix=f"dp{d}_acc{a}",
                    initial=stage_grads)
                losses.append(loss_sum)
            for s in range(self.chunks):  # the copies of a tied weight, summed on its primary device
                for (key, _), g in zip(self.stage_keys[s], stage_grads[s]):
                    with tf.device(self.params.shards[key].device(d)):
                        prev = grads[key][d]
                        grads[key][d] = g if prev is None else prev + g
        return grads, losses

    def _train_step(self, batch):
        rows = tf.nest.flatten(batch)[0].shape[0]
        micro_total = self.dp * self.accum * self.microbatches
        if rows % micro_total:
            raise ValueError(f"a batch of {rows} rows is not divisible by dp x grad_accum x microbatches = "
                             f"{self.dp} x {self.accum} x {self.microbatches}")
        scale = self.loss_scale.scale.read_value()
        grads, losses = self._replica_grads(batch, scale)
        with tf.device(self.mesh.device(0, 0, 0)):
            loss = tf.add_n(losses) / float(micro_total)
        s = self.optimizer.apply(grads, scale)
        return {"loss": loss, **optim.finish_step(s, self.optimizer.step, self.loss_scale)}

    def _eval_step(self, batch):
        rows = tf.nest.flatten(batch)[0].shape[0] // self.dp
        parts = self.microbatches if rows % self.microbatches == 0 else 1
        losses = []
        for d in range(self.dp):
            for micro in self.micro_batches(batch, d, parts):
                x = None
                for s in range(self.chunks):
                    x = self.forward(d, s, x, micro, training=False)
                losses.append(x)
        with tf.device(self.mesh.device(0, 0, 0)):
            return tf.add_n(losses) / float(len(losses))

    # -- state ------------------------------------------------------------------------

    def checkpoint_slots(self) -> list[ShardSet]:
        """The state as one shard set per mesh device (``dp0-pp1-tp0``, ...): the weight shards,
        ``m``/``v`` parts (ZeRO pieces on their own replica) and, on device (0, 0, 0), the
        optimizer step and loss scale, each slot by logical name and box
        (:mod:`phalanx.checkpoint`). A checkpoint written from these loads into any layout."""
        names = {}
        for d in range(self.dp):
            for r in range(self.pp):
                for t in range(self.tp):
                    names.setdefault(_canonical(self.mesh.device(d, r, t)), f"dp{d}-pp{r}-tp{t}")
        first = self.mesh.device(0, 0, 0)
        scalars = [(first, _scalar_slot("optimizer/step", self.optimizer.step))]
        scalars += [(first, _scalar_slot(k, v)) for k, v in self.loss_scale.state().items()]
        sets: dict[str, ShardSet] = {}
        for device, slot in scalars + self.params.checkpoint_slots() + self.optimizer.checkpoint_slots():
            key = _canonical(device)
            name = names.get(key) or "dev-" + "".join(c if c.isalnum() else "-" for c in key).strip("-")
            sets.setdefault(name, ShardSet(name)).slots.append(slot)
        order = {name: i for i, name in enumerate(names.values())}  # mesh order: dp, then pp, then tp
        return sorted(sets.values(), key=lambda s: (order.get(s.name, len(order)), s.name))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Whole logical tensors under the StrategyEngine keys (assembles the whole model on the
        host: for tests and tools; checkpoints use :meth:`checkpoint_slots`)."""
        return checkpoint.gather(self.checkpoint_slots())

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        """Load whole logical tensors (any layout's :meth:`state_dict`); KeyError names missing
        tensors, ValueError a shape that differs."""
        checkpoint.load_shard_sets(checkpoint.DictReader(state), self.checkpoint_slots())

    def num_params(self) -> int:
        return self.params.num_params()

    def apply_masks(self, masks: dict[str, np.ndarray]) -> None:
        """Install (or replace) pruning masks (whole logical 0/1 tensors by weight name): the
        masked weights (every shard and copy) and their moments (ZeRO pieces too) are zeroed now,
        and every later step multiplies its update by the mask (:class:`ShardedAdamW`)."""
        self.optimizer.set_masks(masks)
        for name, mask in masks.items():
            self.params.assign_logical(name, self.params.logical(name) * np.asarray(mask, np.float32))

    def weights(self) -> dict[str, np.ndarray]:
        """Whole logical weights by name."""
        return {name: self.params.logical(name) for name in self.params.names}


def _canonical(device: str) -> str:
    """A device name in the full form variables report (``/job:localhost/replica:0/task:0/device:CPU:1``)."""
    spec = tf.DeviceSpec.from_string(device)
    spec = spec.replace(job=spec.job or "localhost", replica=spec.replica or 0, task=spec.task or 0)
    return spec.to_string()


def _scalar_slot(name: str, var: tf.Variable) -> Slot:
    dtype = var.dtype.as_numpy_dtype
    return Slot(name, (), dtype, (), [((), ())], fetch=var.read_value,
                assign=lambda x: var.assign(np.asarray(x).astype(dtype)))
