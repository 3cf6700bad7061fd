"""The mesh engine: the GPT trained over a ``(data, pipe, tensor)`` mesh by hand placement.

Every layout (dp x pp x tp, any schedule, ZeRO 0/1/2, recomputation) runs the same
step as :class:`phalanx.train.engine.StrategyEngine`, in the same order:

1. replica ``d`` takes rows ``[d*b, (d+1)*b)`` of the batch, cuts them into
   ``train.grad_accum`` accumulation steps and each of those into
   ``parallel.microbatches`` micro-batches, and runs the pipeline schedule
   (:mod:`phalanx.parallel.pipeline`) over its ``pipe`` ranks, each stage split over
   its ``tensor`` devices (:mod:`phalanx.parallel.tensor`); the loss of each
   micro-batch is weighted ``loss_scale / (dp x grad_accum x microbatches)``;
2. gradients are summed over copies (tied embedding) and replicas
   (:mod:`phalanx.parallel.zero`: all-reduce, or reduce-scatter for ZeRO-2);
3. unscaled, global norm over all shards (replicated weights counted once), clipped;
   a non-finite norm skips the step (``tf.where``) and only moves the loss scale;
4. AdamW on every shard (optimizer states sharded over ``data`` with ZeRO >= 1).

Weights start from :func:`phalanx.models.gpt.initial_weights` cut into shards, and
``state_dict()`` returns whole logical tensors under the StrategyEngine keys, so
checkpoints move freely between layouts.

Example:
    >>> from phalanx.config import Config
    >>> from phalanx.mesh import Mesh
    >>> import numpy as np
    >>> cfg = Config().replace(model={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "vocab": 256,
    ...                               "seq_len": 8}, train={"global_batch": 2})
    >>> engine = MeshEngine(cfg, Mesh.from_devices(["/device:CPU:0"], 1, 1, 1))
    >>> sorted(engine.train_step(np.zeros([2, 9], np.int32)))
    ['grad_norm', 'loss', 'loss_scale', 'lr', 'skipped']
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from phalanx.config import Config, ConfigError
from phalanx.mesh import Mesh
from phalanx.models import gpt
from phalanx.parallel import recompute, tensor
from phalanx.parallel.params import ShardedParams, ShardKey
from phalanx.parallel.pipeline import PipelineTrace, partition, run_schedule
from phalanx.parallel.schedules import build_schedule
from phalanx.parallel.zero import ShardedAdamW
from phalanx.train.engine import LossScale

COMPUTE_DTYPES = {"float32": tf.float32, "mixed_bfloat16": tf.bfloat16, "mixed_float16": tf.float16}


def layer_costs(cfg) -> tuple[list[float], float, float]:
    """Forward FLOPs per token of each block, of the embedding and of the head + loss."""
    d, f, t, v = cfg.d_model, cfg.ffn_dim, cfg.seq_len, cfg.vocab
    blk = 2.0 * (3 * d * d + d * d + 2 * d * f) + 4.0 * t * d
    return [blk] * cfg.layers, 2.0 * d, 2.0 * d * v + 5.0 * v


class MeshEngine:
    """GPT training step over a :class:`~phalanx.mesh.Mesh` (see the module docstring)."""

    def __init__(self, cfg: Config, mesh: Mesh, task=None):
        m, p = cfg.model, cfg.parallel
        if m.dropout > 0:
            raise ConfigError("model.dropout", f"{m.dropout}: the mesh engine does not implement dropout; "
                                               f"set model.dropout=0 or use a tf.distribute strategy")
        try:
            tensor.check_tp(m, mesh.tp)
        except ValueError as err:
            raise ConfigError("parallel.tp", str(err)) from None
        recompute.check_mode(p.recompute)
        self.cfg, self.mesh = cfg, mesh
        self.dp, self.pp, self.tp = mesh.dp, mesh.pp, mesh.tp
        self.accum, self.microbatches = cfg.train.grad_accum, p.microbatches
        if cfg.train.global_batch % (self.dp * self.accum * self.microbatches):
            raise ConfigError("train.global_batch",
                              f"{cfg.train.global_batch} is not divisible by dp x grad_accum x microbatches = "
                              f"{self.dp} x {self.accum} x {self.microbatches}")
        virtual = p.virtual_stages if p.schedule == "interleaved" else 1
        try:
            self.schedule = build_schedule(p.schedule, self.pp, self.microbatches, virtual)
        except ValueError as err:
            raise ConfigError("parallel.schedule", str(err)) from None
        self.chunks = self.schedule.num_stages
        costs, embed_cost, head_cost = layer_costs(m)
        try:
            self.bounds = partition(costs, self.chunks, embed_cost, head_cost)
        except ValueError as err:
            raise ConfigError("parallel.pp", str(err)) from None
        self.compute_dtype = COMPUTE_DTYPES[cfg.precision.policy]
        seed = getattr(task, "seed", cfg.train.seed)
        initial = gpt.initial_weights(m, seed)
        self.stage_of_block = {i: s for s, (a, b) in enumerate(self.bounds) for i in range(a, b)}
        self.params = ShardedParams(initial, tensor.gpt_splits(m), self.tp, self.dp, self._place)
        self.optimizer = ShardedAdamW(self.params, cfg.train, p.zero, gpt.decays)
        with tf.device(mesh.device(0, 0, 0)):
            self.loss_scale = LossScale(cfg)
        self.stage_keys = [self._stage_keys(s) for s in range(self.chunks)]
        self.traces: list[PipelineTrace] = [PipelineTrace() for _ in range(self.dp)]
        # Plain Python control flow builds the graph; autograph would only slow tracing.
        self._train_fn = tf.function(self._train_step, autograph=False)
        self._eval_fn = tf.function(self._eval_step, autograph=False)

    # -- placement -------------------------------------------------------------

    def stages_of(self, name: str) -> list[int]:
        """Pipeline stages (chunks) that read weight ``name``; the first holds the primary copy."""
        last = self.chunks - 1
        if name == "embed/tokens":
            return [0, last] if (self.cfg.model.tie_embeddings and last > 0) else [0]
        if name.startswith("embed/"):
            return [0]
        if name.startswith("block_"):
            return [self.stage_of_block[int(name.split("/")[0][len("block_"):])]]
        return [last]

    def stage_devices(self, replica: int, stage: int) -> list[str]:
        rank = stage % self.pp
        return [self.mesh.device(replica, rank, t) for t in range(self.tp)]

    def _place(self, name: str, t: int, d: int) -> list[str]:
        return [self.stage_devices(d, s)[t] for s in self.stages_of(name)]

    def _stage_keys(self, stage: int) -> list[tuple[ShardKey, int]]:
        """(shard key, copy index) of every variable stage ``stage`` reads."""
        out = []
        for name in self.params.names:
            stages = self.stages_of(name)
            if stage in stages:
                out += [(key, stages.index(stage)) for key in self.params.keys_of(name)]
        return out

    def stage_variables(self, replica: int, stage: int) -> list[tf.Variable]:
        return [self.params.shards[key].copies[replica][c] for key, c in self.stage_keys[stage]]

    # -- the model on the mesh ----------------------------------------------------

    def _forward(self, replica: int, stage: int, x, tokens):
        """Stage ``stage`` of replica ``replica``: activations, or the mean loss on the last stage."""
        m = self.cfg.model
        devices = self.stage_devices(replica, stage)
        lookup = {key: self.params.shards[key].copies[replica][c] for key, c in self.stage_keys[stage]}

        def w(name, t):
            return lookup[(name, t)]

        if stage == 0:
            with tf.device(devices[0]):
                inputs = tokens[:, :-1]
            x = tensor.vocab_parallel_embed(inputs, w, devices, m.vocab, self.compute_dtype)
        attention = recompute.attention_fn(self.cfg.parallel.recompute)
        start, end = self.bounds[stage]
        for i in range(start, end):
            prefix = f"block_{i}/"
            keys = [k for k in lookup if k[0].startswith(prefix)]

            def run_block(h, *values, _keys=keys, _prefix=prefix):
                local = dict(zip(_keys, values))
                return tensor.block(h, lambda n, t: local[(n, t)], _prefix, devices, m.heads, attention)

            fn = recompute.wrap_block(run_block, self.cfg.parallel.recompute)
            x = fn(x, *[lookup[k] if self.cfg.parallel.recompute != "full" else lookup[k].read_value()
                        for k in keys])
        if stage == self.chunks - 1:
            with tf.device(devices[0]):
                targets = tokens[:, 1:]
            return tensor.vocab_parallel_loss(x, targets, w, devices, m)
        return x

    def _replica_micro(self, batch, replica: int, parts: int):
        """Replica ``replica``'s rows of ``batch`` as a list of ``parts`` micro-batches."""
        b = batch.shape[0] // self.dp
        per = b // parts
        with tf.device(self.mesh.device(replica, 0, 0)):
            return [batch[replica * b + i * per: replica * b + (i + 1) * per] for i in range(parts)]

    # -- the step -----------------------------------------------------------------

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        return self._train_fn(tf.convert_to_tensor(batch, tf.int32))

    def eval_step(self, batch) -> tf.Tensor:
        return self._eval_fn(tf.convert_to_tensor(batch, tf.int32))

    def _train_step(self, batch):
        if batch.shape[0] % (self.dp * self.accum * self.microbatches):
            raise ValueError(f"batch of {batch.shape[0]} rows is not divisible by dp x grad_accum x "
                             f"microbatches = {self.dp} x {self.accum} x {self.microbatches}")
        scale = self.loss_scale.scale.read_value()
        micro_total = self.dp * self.accum * self.microbatches
        weight = scale / float(micro_total)
        grads: dict[ShardKey, list] = {key: [None] * self.dp for key in self.params.shards}
        losses = []
        for d in range(self.dp):
            micro = self._replica_micro(batch, d, self.accum * self.microbatches)
            variables = [self.stage_variables(d, s) for s in range(self.chunks)]
            for a in range(self.accum):
                group = micro[a * self.microbatches:(a + 1) * self.microbatches]
                stage_grads, loss_sum = run_schedule(
                    self.schedule, lambda s, i, x, _d=d, _g=group: self._forward(_d, s, x, _g[i]),
                    variables, weight, trace=self.traces[d] if a == 0 else None, prefix=f"dp{d}_acc{a}")
                losses.append(loss_sum)
                for s in range(self.chunks):
                    for (key, _), g in zip(self.stage_keys[s], stage_grads[s]):
                        with tf.device(self.params.shards[key].device(d)):
                            prev = grads[key][d]
                            grads[key][d] = g if prev is None else prev + g
        with tf.device(self.mesh.device(0, 0, 0)):
            loss = tf.add_n(losses) / float(micro_total)
        norm, finite, lr = self.optimizer.apply(grads, scale)
        self.loss_scale.update(finite)
        return {"loss": loss, "grad_norm": norm, "skipped": 1.0 - tf.cast(finite, tf.float32),
                "loss_scale": scale, "lr": lr}

    def _eval_step(self, batch):
        rows = batch.shape[0] // self.dp
        parts = self.microbatches if rows % self.microbatches == 0 else 1
        losses = []
        for d in range(self.dp):
            for tokens in self._replica_micro(batch, d, parts):
                x = None
                for s in range(self.chunks):
                    x = self._forward(d, s, x, tokens)
                losses.append(x)
        with tf.device(self.mesh.device(0, 0, 0)):
            return tf.add_n(losses) / float(len(losses))

    # -- state ----------------------------------------------------------------------

    def state_dict(self) -> dict[str, np.ndarray]:
        state = {name: self.params.logical(name) for name in self.params.names}
        state["optimizer/step"] = np.asarray(self.optimizer.step.numpy())
        for name in self.params.names:
            state[f"optimizer/m/{name}"] = self.optimizer.logical_state(name, "m")
            state[f"optimizer/v/{name}"] = self.optimizer.logical_state(name, "v")
        state.update({k: np.asarray(v.numpy()) for k, v in self.loss_scale.state().items()})
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        expected = set(self.params.names) | {"optimizer/step"} | set(self.loss_scale.state())
        expected |= {f"optimizer/{s}/{n}" for s in ("m", "v") for n in self.params.names}
        missing = sorted(expected - set(state))
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
                           f"was it written for a different model?")
        for name in self.params.names:
            self.params.assign_logical(name, state[name])
            self.optimizer.assign_logical_state(name, "m", state[f"optimizer/m/{name}"])
            self.optimizer.assign_logical_state(name, "v", state[f"optimizer/v/{name}"])
        self.optimizer.step.assign(int(state["optimizer/step"]))
        for key, var in self.loss_scale.state().items():
            var.assign(np.asarray(state[key]).astype(var.dtype.as_numpy_dtype))

    def num_params(self) -> int:
        return self.params.num_params()

    def weights(self) -> dict[str, np.ndarray]:
        return {name: self.params.logical(name) for name in self.params.names}
