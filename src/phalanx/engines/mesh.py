"""The mesh engine: the GPT trained over a ``(data, pipe, tensor)`` mesh by hand placement.

Every layout (dp x pp x tp, any schedule, ZeRO 0/1/2, recomputation) runs the same
step as :class:`phalanx.engines.strategy.StrategyEngine`, in the same order:

1. replica ``d`` takes rows ``[d*b, (d+1)*b)`` of the batch, cuts them into
   ``train.grad_accum`` accumulation steps and each of those into
   ``parallel.microbatches`` micro-batches, and runs the pipeline schedule
   (:mod:`phalanx.parallel.pipeline`) over its ``pipe`` ranks, each stage split over
   its ``tensor`` devices (:class:`phalanx.models.transformer.ShardedGPT`: the parallel
   layers' own per-shard code run on the engine's shard variables); the loss of each
   micro-batch is weighted ``loss_scale / (dp x grad_accum x microbatches)``;
2. gradients are summed over copies (tied embedding) and replicas
   (:mod:`phalanx.parallel.zero`: all-reduce, or reduce-scatter for ZeRO-2);
3. unscaled, global norm over all shards (replicated weights counted once), clipped;
   a non-finite norm skips the step (``tf.where``) and only moves the loss scale;
4. AdamW on every shard (optimizer states sharded over ``data`` with ZeRO >= 1).

With ``parallel.sequence_parallel`` (``tp > 1`` dividing ``model.seq_len``) the blocks run
their LayerNorm / dropout / residual regions on sequence chunks, chunk ``r`` on tensor rank
``r`` (all-gather / reduce-scatter in place of the all-reduce,
:mod:`phalanx.layers.transformer`). ``model.dropout`` draws the positional masks of
:mod:`phalanx.layers.dropout`, keyed by (seed, optimizer step, layer, site) and each
element's row in the whole batch and position: every layout (micro-batches, replicas,
sequence chunks, recomputation) draws the masks of the one-device run; eval has none.

Weights start from :func:`phalanx.models.gpt.initializer`, each shard made alone from
its boxes (equal to :func:`~phalanx.models.gpt.initial_weights` cut into shards, in every
layout); ``checkpoint_slots()`` describes every device's state by logical name and box
(sharded checkpoints: :mod:`phalanx.checkpoint`), so checkpoints move freely between
layouts, and ``state_dict()`` assembles whole tensors under the StrategyEngine keys.

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
from phalanx.core.costs import layer_costs
from phalanx.engines.pipelined import PipelinedEngine
from phalanx.engines.task import for_config
from phalanx.layers import dropout as dropout_lib
from phalanx.mesh import Mesh
from phalanx.models import gpt
from phalanx.models.transformer import ShardedGPT, gpt_splits
from phalanx.parallel import recompute
from phalanx.parallel.params import ShardedParams, ShardKey
from phalanx.parallel.partition import partition


class MeshEngine(PipelinedEngine):
    """GPT training step over a :class:`~phalanx.mesh.Mesh` (see the module docstring)."""

    def __init__(self, cfg: Config, mesh: Mesh, task=None):
        m, p = cfg.model, cfg.parallel
        if m.experts:
            raise ConfigError("model.experts", f"{m.experts}: the mixture-of-experts GPT trains data parallel "
                                               f"(tf.distribute: one device, dp, multi_worker) so far; tensor, "
                                               f"pipeline and expert parallelism, ZeRO and recomputation of its "
                                               f"experts are not built yet")
        if p.sequence_parallel and mesh.tp < 2:
            raise ConfigError("parallel.sequence_parallel", f"true needs tensor parallelism: parallel.tp > 1 "
                                                            f"(the mesh has tp={mesh.tp})")
        if p.sequence_parallel and m.seq_len % mesh.tp:
            raise ConfigError("parallel.sequence_parallel", f"true cuts the sequence into parallel.tp={mesh.tp} "
                                                            f"chunks: model.seq_len={m.seq_len} is not divisible")
        if task is not None:
            for_config(task, cfg)  # the model computes in precision.policy: a task built for another is refused
        try:
            self.model = ShardedGPT(m, mesh.tp, cfg.precision.policy, sequence_parallel=p.sequence_parallel)
        except ValueError as err:
            raise ConfigError("parallel.tp", str(err)) from None
        recompute.check_mode(p.recompute)
        self._init_schedule(cfg, mesh)
        costs, embed_cost, head_cost = layer_costs(m)
        try:
            self.bounds = partition(costs, self.chunks, embed_cost, head_cost)
        except ValueError as err:
            raise ConfigError("parallel.pp", str(err)) from None
        self.stage_of_block = {i: s for s, (a, b) in enumerate(self.bounds) for i in range(a, b)}
        # the weights ahead of the blocks (weight_shapes order): the embeddings, read by stage 0
        names = list(gpt.weight_shapes(m))
        self._embedding_names = set(names[:next(k for k, n in enumerate(names) if gpt.block_index(n) is not None)])
        seed = getattr(task, "seed", cfg.train.seed)
        self.dropout_seed = seed
        # Each shard is made alone from its boxes of the per-tensor tiled initialiser: no whole
        # weight exists on the host, and the values equal gpt.initial_weights in every layout.
        params = ShardedParams(gpt.weight_shapes(m), gpt_splits(m), self.tp, self.dp, self._place,
                               init=gpt.initializer(m, seed))
        self.stage_keys = [self._stage_keys(s, params) for s in range(self.chunks)]
        self._setup(params, gpt.decays)

    # -- placement -------------------------------------------------------------

    def stages_of(self, name: str) -> list[int]:
        """Pipeline stages (chunks) that read weight ``name``; the first holds the primary copy."""
        last, block = self.chunks - 1, gpt.block_index(name)
        if block is not None:
            return [self.stage_of_block[block]]
        if name not in self._embedding_names:  # after the blocks: the final LayerNorm, the head
            return [last]
        return [0, last] if (name == self.model.head_weight and last > 0) else [0]

    def _place(self, name: str, t: int, d: int) -> list[str]:
        return [self.stage_devices(d, s)[t] for s in self.stages_of(name)]

    def _stage_keys(self, stage: int, params: ShardedParams) -> list[tuple[ShardKey, int]]:
        """(shard key, copy index) of every variable stage ``stage`` reads."""
        out = []
        for name in params.names:
            stages = self.stages_of(name)
            if stage in stages:
                out += [(key, stages.index(stage)) for key in params.keys_of(name)]
        return out

    # -- the model on the mesh ----------------------------------------------------

    def micro_batches(self, batch, replica: int, parts: int) -> list:
        """As :meth:`PipelinedEngine.micro_batches`, each piece paired with its first row in
        ``batch`` (the dropout masks are keyed by rows of the whole batch)."""
        rows = batch.shape[0] // self.dp
        return [(piece, replica * rows + i * (rows // parts))
                for i, piece in enumerate(super().micro_batches(batch, replica, parts))]

    def _dropout(self, device: str, row_offset: int, training: bool):
        """``(key, row_offset)`` of this micro-batch's dropout masks, or None (no dropout): the
        key folds the seed and the optimizer step, so every step draws new masks, the same in
        every layout (:mod:`phalanx.layers.dropout`), and a resumed run draws the same again."""
        if not (training and self.cfg.model.dropout > 0):
            return None
        with tf.device(device):
            return dropout_lib.fold(self.dropout_seed, self.optimizer.step.read_value()), row_offset

    def forward(self, replica: int, stage: int, x, micro, training: bool = True):
        """Stage ``stage`` of replica ``replica`` on ``micro`` = (tokens, first row in the
        batch): activations, or the mean loss on the last stage."""
        tokens, row_offset = micro
        devices = self.stage_devices(replica, stage)
        dropout = self._dropout(devices[0], row_offset, training)
        lookup = {key: self.params.shards[key].copies[replica][c] for key, c in self.stage_keys[stage]}

        def w(name, t):
            return lookup[(name, t)]

        if stage == 0:
            with tf.device(devices[0]):
                inputs = tokens[:, :-1]
            x = self.model.embed(inputs, w, devices, dropout)
        elif self.model.sequence_parallel:
            # The schedule differentiates with respect to x: a sequence-parallel block reading
            # the chunks behind x (the previous stage's concat) would bypass it.
            with tf.device(devices[0]):
                x = tf.identity(x)
        wrap_core = recompute.core_wrapper(self.cfg.parallel.recompute)
        start, end = self.bounds[stage]
        for i in range(start, end):
            keys = [k for k in lookup if gpt.block_index(k[0]) == i]

            def run_block(h, *values, _keys=keys, _i=i):
                local = dict(zip(_keys, values))
                return self.model.block(h, lambda n, t: local[(n, t)], _i, devices, wrap_core, dropout)

            fn = recompute.wrap_block(run_block, self.cfg.parallel.recompute)
            x = fn(x, *[lookup[k] if self.cfg.parallel.recompute != "full" else lookup[k].read_value()
                        for k in keys])
        if stage == self.chunks - 1:
            with tf.device(devices[0]):
                targets = tokens[:, 1:]
            return self.model.loss(x, targets, w, devices)
        return x

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        return self._train_fn(tf.convert_to_tensor(batch, tf.int32))

    def eval_step(self, batch) -> tf.Tensor:
        return self._eval_fn(tf.convert_to_tensor(batch, tf.int32))

    def gradients(self, batch) -> dict[str, np.ndarray]:
        return super().gradients(tf.convert_to_tensor(batch, tf.int32))
