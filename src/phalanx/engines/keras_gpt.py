"""The built-in GPT config trained by :class:`~phalanx.engines.keras_model.KerasModelEngine`:
what ``phalanx train`` runs for the built-in GPT on every layout but parameter servers (one
device, dp, tp, pp with any schedule, sequence parallelism, ep for ``model.experts``, grad
accumulation, mixed precision, ZeRO-1/2/3, recomputation).

The model is :func:`phalanx.models.transformer.gpt` — the built-in GPT written from
phalanx's parallel Keras layers, equal logits — with its experts cut into ``parallel.ep``
shards and its attention, MLPs and vocabulary into ``parallel.tp`` tensor shards, started from
the same :func:`phalanx.models.gpt.initial_weights`. The Keras engine places it (expert shard
``j`` of each group of ``ep`` data replicas lives on that group's ``j``-th replica; tokens
travel to their experts and back; tensor shard ``r`` on the replica's tensor rank ``r``),
cuts it into ``parallel.pp`` pipeline stages as it does for :func:`phalanx.fit`, and runs the
step: every replica's rows, ``train.grad_accum x parallel.microbatches`` micro-batches on the
``parallel.schedule``, the loss ``mean token cross-entropy + the MoE balancing losses`` as the
built-in task's (each micro-batch balances its own tokens). What makes it the trainer's run
and not a Keras ``fit``:

* **the optimizer** is phalanx's: :class:`PhalanxAdamW`, a Keras optimizer whose ``apply`` is
  the one AdamW apply (:func:`phalanx.core.optim.apply_adamw`) with the built-in decay mask
  (:func:`phalanx.models.gpt.decays`), the trainer's learning-rate schedule, global-norm
  clipping (``train.clip_norm``) and :class:`~phalanx.core.loss_scale.LossScale`
  (``mixed_float16``), exactly as the parameter-server engine's;
* **the state** has the built-in GPT's logical names (weights, ``optimizer/m/*``,
  ``optimizer/v/*``, ``optimizer/step``, ``loss_scale/*``), written per device by box: a
  checkpoint written here resumes on any layout (one device included), and back;
* **the figures**: ``train_step`` returns ``loss``, ``grad_norm``, ``lr``, ``loss_scale`` and
  ``skipped``; the MoE layers' step totals (all replicas and micro-batches) are on
  ``model`` for :mod:`phalanx.train.moe_stats`.

With ``parallel.zero=1|2|3`` the AdamW moments (2: and the gradients, 3: and the weights) are
cut into slices over the data replicas (:mod:`phalanx.parallel.keras_zero`):
:meth:`PhalanxAdamW.zero_clone` applies on the slices, sharing the step counter, loss scale and
figures, and a checkpoint holds each replica's slices (weights and moments) in its shard set, by
logical name and box. ``parallel.recompute`` runs as for any Keras model
(:mod:`phalanx.parallel.recompute`; ``selective``: the attention cores of the GPT's blocks). What
it cannot honour is refused before anything is built (:func:`refuse_unhonoured`).

``model.dropout`` draws the positional masks of :mod:`phalanx.layers.dropout` (the model's
dropout layers are seeded from the task's seed; the engine gives each call its global rows and
the step's seed state: every layout draws Keras's one-device masks; after a restore the seed
states follow the steps run). ``train.prune.*`` (driven by :class:`phalanx.prune.Pruner`):
a 0/1 mask beside every variable holding a part of a prunable weight, chosen shard by shard
over the whole logical weight (:meth:`KerasGPTEngine.weight_shards`,
:func:`phalanx.prune.shards.shard_masks`); installing one zeroes the masked weights and their
AdamW moments, and :class:`PhalanxAdamW` keeps them zero after every update (under ZeRO each
slice with its piece of the mask); the masks are checkpointed as optional ``prune/mask/*``
slots beside the weights'.

Example:
    >>> from phalanx.config import Config
    >>> from phalanx.mesh import Mesh
    >>> from phalanx.engines.task import GPTTask
    >>> cfg = Config().replace(model={"layers": 2, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 8,
    ...                               "experts": 2, "moe_every": 2}, train={"global_batch": 2})
    >>> engine = KerasGPTEngine(cfg, GPTTask(cfg.model), Mesh.from_devices(["/device:CPU:0"], 1, 1, 1))
    >>> import numpy as np
    >>> sorted(engine.train_step(np.zeros([2, 9], np.int32)))
    ['grad_norm', 'loss', 'loss_scale', 'lr', 'skipped']
"""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from phalanx import checkpoint, prune
from phalanx.checkpoint import boxes
from phalanx.config import Config, ConfigError
from phalanx.core import optim
from phalanx.core.loss_scale import LossScale
from phalanx.engines import keras_slots
from phalanx.engines.keras_model import KerasModelEngine, check_zero
from phalanx.engines.joined import JoinedVariable
from phalanx.engines.task import GPTTask, for_config
from phalanx.layers import dropout as dropout_lib
from phalanx.layers.losses import TokenCrossEntropy
from phalanx.mesh import Mesh
from phalanx.models import gpt as builtin
from phalanx.models import transformer
from phalanx.prune.shards import WeightShard


def refuse_unhonoured(cfg: Config, mesh: Mesh | None = None) -> None:
    """Raise :class:`ConfigError` naming the first key of ``cfg`` this engine would not honour,
    or a layout that cannot exist, before anything is built."""
    p, m = cfg.parallel, cfg.model
    if p.ep > 1 and not m.experts:
        raise ConfigError("parallel.ep", f"{p.ep}: expert parallelism shards the experts of a mixture-of-experts "
                                         f"model, and model.experts=0 (dense); set model.experts or parallel.ep=1")
    if m.experts and m.experts % p.ep:
        divisors = [d for d in range(1, m.experts + 1) if m.experts % d == 0]
        raise ConfigError("parallel.ep", f"{p.ep} does not divide model.experts={m.experts}: each of the ep shards "
                                         f"holds experts/ep experts; pick ep from {divisors}")
    dp = mesh.dp if mesh is not None else p.dp
    if dp >= 1 and dp % p.ep:
        raise ConfigError("parallel.ep", f"{p.ep} does not divide parallel.dp={dp}: experts are sharded over the "
                                         f"data replicas in groups of ep" +
                          (" (under parallel.strategy=multi_worker, parallel.dp is each worker's own replicas: the "
                           "experts are sharded within a worker, never across workers)"
                           if p.strategy == "multi_worker" else ""))
    why = ("the expert-parallel GPT (parallel.ep > 1) trains through the Keras-model engine" if p.ep > 1 else
           "the built-in GPT trains here through the Keras-model engine")
    tp = mesh.tp if mesh is not None else p.tp
    try:  # (the layers would refuse it too, naming their own arguments)
        transformer.check_tp(m, max(tp, 1))
    except ValueError as err:
        raise ConfigError("parallel.tp", str(err)) from None
    if p.sequence_parallel and (m.experts or tp < 2 or m.seq_len % tp):
        raise ConfigError("parallel.sequence_parallel", f"true: sequence parallelism cuts the dense GPT's sequence "
                                                        f"into the tensor ranks' chunks: it needs parallel.tp > 1 "
                                                        f"dividing model.seq_len={m.seq_len} (tp={tp}) and "
                                                        f"model.experts=0 ({m.experts})")
    check_zero(p.zero)
    if p.strategy not in ("auto", "mesh", "mirrored", "multi_worker"):
        raise ConfigError("parallel.strategy", f"{p.strategy!r}: {why}, which places the model on the devices "
                                               f"itself: in one process (auto), or on each worker's own devices with "
                                               f"the workers data parallel (multi_worker under phalanx launch); use "
                                               f"parallel.strategy=auto, mirrored or multi_worker")
    pp = mesh.pp if mesh is not None else p.pp
    if p.microbatches != 1 and pp == 1:
        raise ConfigError("parallel.microbatches", f"{p.microbatches} splits a pipeline's batch, but parallel.pp=1; "
                                                   f"use train.grad_accum={p.microbatches} to split each step's batch")


class PhalanxAdamW(keras.optimizers.Optimizer):
    """phalanx's AdamW step (:func:`phalanx.core.optim.apply_adamw`, the trainer's schedule,
    clipping and loss scaling) as a Keras optimizer, so that a Keras-model engine applies it.

    ``decays``: ``id(keras variable) -> bool``, whether weight decay applies (from the
    logical name of the weight the variable holds a part of). Moments are float32 Keras
    slots next to each variable (``m``, ``v``, in ``build`` order; named
    ``<variable path>_m``/``_v``); ``step``
    counts applied updates (a step skipped on non-finite gradients does not count), as
    ``optimizer/step`` of the other engines. ``last`` holds the figures of the last step.
    """

    def __init__(self, cfg: Config, decays: dict[int, bool], device: str, name: str = "phalanx_adamw",
                 shared: "PhalanxAdamW | None" = None):
        super().__init__(learning_rate=cfg.train.lr, name=name)
        self.cfg, self._decays = cfg, decays
        self._device = device
        if shared is not None:  # zero_clone: one step counter, loss scale and set of figures
            self.step, self.loss_scale, self.last = shared.step, shared.loss_scale, shared.last
        else:
            with tf.init_scope(), tf.device(device):
                self.step = tf.Variable(0, trainable=False, dtype=tf.int64, name="optimizer_step")
                self.loss_scale = LossScale(cfg)
                self.last = {key: tf.Variable(0.0, trainable=False, dtype=tf.float32, name=f"last_{key}")
                             for key in ("grad_norm", "lr", "loss_scale", "skipped")}
        self.m: list = []
        self.v: list = []
        self._by_path: dict[str, bool] | None = None
        # ZeRO across workers (parallel.keras_zero): a float32 tensor -> its sum over the workers, so
        # that the global norm (clipping, the non-finite skip) is that of every worker's slices
        self.sum_across_workers = None
        # pruning: id(variable applied on) -> its 0/1 mask's value (a function, read in the step):
        # the masked weights and their moments are zeroed after every update
        self.masks: dict = {}

    def zero_clone(self) -> "PhalanxAdamW":
        """The instance that applies on ZeRO slices (:mod:`phalanx.parallel.keras_zero`): a
        slice carries its variable's path, so its decay flag is looked up by path; the step
        counter, loss scale and figures are this optimizer's."""
        clone = PhalanxAdamW(self.cfg, {}, self._device, name=self.name, shared=self)
        clone._by_path = {v.path: self._decays[id(v)] for v in self._trainable_variables}
        return clone

    def build(self, variables):
        super().build(variables)
        if self._by_path is not None:
            self._decays = {id(v): self._by_path[v.path] for v in variables if v.path in self._by_path}
        missing = [v.path for v in variables if id(v) not in self._decays]
        if missing:
            raise ValueError(f"PhalanxAdamW: no decay flag for {missing[:3]}: built for another model")
        for var in variables:  # float32 moments beside the variable (Keras colocates a slot with it)
            self.m.append(self.add_variable_from_reference(var, "m"))
            self.v.append(self.add_variable_from_reference(var, "v"))

    def scale_loss(self, loss):
        return loss * self.loss_scale.scale.read_value()

    def apply(self, grads, trainable_variables=None):
        variables = self._trainable_variables if trainable_variables is None else list(trainable_variables)
        if not self.built:  # as Keras's own apply: a model's first train step builds the optimizer
            self.build(variables)
        if [id(v) for v in variables] != [id(v) for v in self._trainable_variables]:
            raise ValueError("PhalanxAdamW.apply: takes the gradients of every variable it was built for, in order")
        dense = []
        for var, grad in zip(variables, grads):
            with tf.device(var.value.device):  # an unused weight (None) still decays and moves with its moments
                dense.append(tf.zeros(var.shape, tf.float32) if grad is None
                             else tf.cast(tf.convert_to_tensor(grad), tf.float32))
        t = self.cfg.train
        norm = optim.global_norm(dense)
        if self.sum_across_workers is not None:
            norm = tf.sqrt(self.sum_across_workers(tf.square(norm)))
        s = optim.step_scalars(norm, self.loss_scale.scale.read_value(), self.step, t)
        with tf.device(self._device):  # once for every variable
            scalars = optim.adamw_scalars(s.count, s.lr, s.factor, s.finite, t)
        for var, grad, m, v in zip(variables, dense, self.m, self.v):
            with tf.device(var.value.device):
                mask = self.masks.get(id(var))
                optim.apply_adamw(var.value, m.value, v.value, grad, scalars=scalars, cfg=t,
                                  decay=self._decays[id(var)], mask=None if mask is None else mask())
        figures = {key: tf.cast(value, tf.float32) for key, value in
                   optim.finish_step(s, self.step, self.loss_scale).items()}
        for key, value in figures.items():
            self.last[key].assign(value)
        # this call's own figures (tensors of the graph being traced): a parameter-server step returns
        # them, since ``last`` may hold another worker's step by the time it is read
        self.step_figures = figures


class _Converter:
    """Moves per-variable arrays of the Keras GPT ``model`` (weights, or AdamW moments:
    element-wise, so laid out as the weights) to and from the built-in GPT's logical names, on
    arrays alone: :func:`~phalanx.models.transformer.weight_parts` of the model (the one
    definition of the mapping) says which box of which logical tensor each variable holds.

    Example:
        >>> from phalanx.config import ModelConfig
        >>> cfg = ModelConfig(layers=2, d_model=8, heads=2, ffn=16, vocab=16, seq_len=4, experts=2, moe_every=2)
        >>> model = transformer.gpt(cfg, tp=2, ep=2, seed=0)
        >>> convert = _Converter(model)
        >>> arrays = [v.numpy() for v in model.trainable_variables]
        >>> logical = convert.to_logical(arrays)
        >>> sorted(logical) == sorted(builtin.weight_shapes(cfg))
        True
        >>> all(np.array_equal(a, b) for a, b in zip(convert.from_logical(logical), arrays))
        True
    """

    def __init__(self, model):
        variables = list(model.trainable_variables)
        self.shapes = [tuple(int(n) for n in v.shape) for v in variables]
        position = {id(v): i for i, v in enumerate(variables)}
        # logical name -> the positions (in model.trainable_variables) of the variables holding it,
        # and a JoinedVariable of its parts (its shape, and join: arrays of the parts -> the tensor)
        self.parts: dict[str, tuple[list[int], JoinedVariable]] = {}
        for name, parts in transformer.weight_parts(model).items():
            stray = [p.variable.path for p in parts if id(p.variable) not in position]
            if stray:
                raise ValueError(f"keras_gpt: {name} is held by {stray[:3]}, not trainable variables of the model")
            self.parts[name] = ([position[id(p.variable)] for p in parts],
                                JoinedVariable([(p.variable, p.box) for p in parts]))
        held = sorted(i for indices, _ in self.parts.values() for i in indices)
        if held != list(range(len(variables))):
            unheld = [variables[i].path for i in sorted(set(range(len(variables))) - set(held))]
            raise ValueError(f"keras_gpt: every trainable variable must hold one part of one built-in weight; "
                             f"{unheld[:3] or 'some hold several'}")

    def joined(self, variables: list) -> dict[str, JoinedVariable]:
        """Logical name -> a :class:`JoinedVariable` of ``variables`` (laid out as the model's
        trainable variables: the weights themselves, or a moment slot beside each)."""
        return {name: JoinedVariable([(variables[i], box) for i, (_, box) in zip(indices, joined.parts)])
                for name, (indices, joined) in self.parts.items()}

    def to_logical(self, arrays: list[np.ndarray]) -> dict[str, np.ndarray]:
        return {name: joined.join([arrays[i] for i in indices]) for name, (indices, joined) in self.parts.items()}

    def from_logical(self, tensors: dict[str, np.ndarray]) -> list[np.ndarray]:
        out: list = [None] * len(self.shapes)
        for name, (indices, joined) in self.parts.items():
            value = np.asarray(tensors[name])
            if value.shape != tuple(joined.shape):
                raise ValueError(f"keras_gpt: {name!r} has shape {value.shape}, the model's is {tuple(joined.shape)}")
            for i, (_, box) in zip(indices, joined.parts):
                out[i] = np.reshape(value[boxes.index(box)], self.shapes[i])
        return out


def compiled_gpt(cfg: Config, task: GPTTask, device: str, tp: int = 1, ep: int = 1) -> tuple:
    """``(model, converter)``: the built-in GPT of ``cfg.model`` as the Keras model every engine
    trains (:func:`phalanx.models.transformer.gpt`, ``tp`` tensor shards, ``ep`` expert shards),
    holding the built-in initial weights and compiled with :class:`PhalanxAdamW` (its scalars on
    ``device``; the decay mask of :func:`phalanx.models.gpt.decays`) and the mean token
    cross-entropy; ``converter`` maps its variables to the built-in logical names. The
    variables are made where the caller's scope puts them (a strategy's: on its ps tasks).

    Example:
        >>> from phalanx.config import Config
        >>> cfg = Config().replace(model={"layers": 1, "d_model": 16, "heads": 2, "ffn": 32, "seq_len": 8})
        >>> model, convert = compiled_gpt(cfg, GPTTask(cfg.model), "/device:CPU:0")
        >>> type(model.optimizer).__name__, sorted(convert.parts) == sorted(builtin.weight_shapes(cfg.model))
        ('PhalanxAdamW', True)
    """
    task = for_config(task, cfg)
    model = transformer.gpt(cfg.model, tp=tp, ep=ep, seed=None, dtype_policy=task.dtype_policy,
                            sequence_parallel=cfg.parallel.sequence_parallel, dropout_seed=task.seed)
    convert = _Converter(model)
    transformer.initialize(model, cfg.model, task.seed)  # each variable's part made alone
    # each variable holds a part of one logical weight (_Converter checks it): its decay flag
    variables = model.trainable_variables
    decays = {id(variables[i]): builtin.decays(name) for name, (indices, _) in convert.parts.items()
              for i in indices}
    optimizer = PhalanxAdamW(cfg, decays, device)
    # the mean token cross-entropy read from the logits in the compute dtype (no float32 copy of them)
    model.compile(optimizer=optimizer, loss=TokenCrossEntropy())
    # Keras wraps any optimizer in its LossScaleOptimizer under mixed_float16; this one scales
    # the loss itself (phalanx's LossScale, the other engines' state and checkpoint names).
    model.optimizer = optimizer
    return model, convert


class KerasGPTEngine:
    """The built-in GPT (``cfg.model``) with tensor shards over ``mesh.tp``, stages over
    ``mesh.pp`` and experts over ``parallel.ep``, trained by :class:`KerasModelEngine` on
    ``mesh`` with phalanx's AdamW (module docstring).

    ``workers`` (a :class:`~phalanx.engines.keras_cluster.WorkerGroup`, ``multi_worker`` under
    ``phalanx launch``): ``mesh`` is this worker's own devices, every worker passes the same
    global batch to :meth:`train_step` and trains its rows of it, the gradients are summed across
    workers before the AdamW apply (the same update on every worker; under ZeRO each worker applies
    on its slices, the global norm summed across workers, and :meth:`before_checkpoint` gathers
    them on every worker) and the MoE totals averaged; the experts stay within a worker. :meth:`eval_step` runs the whole batch on every worker.

    ``stage_calls``: passed to :class:`KerasModelEngine` (False traces every pipeline stage
    inline per micro-batch, so that every op shows in the step's own graph: the memory profiler,
    :mod:`phalanx.train.calibrate`)."""

    def __init__(self, cfg: Config, task: GPTTask, mesh: Mesh, workers=None, stage_calls: bool = True):
        if not isinstance(task, GPTTask):
            raise TypeError(f"KerasGPTEngine trains the built-in GPT (a GPTTask), got {type(task).__name__}")
        if task.cfg != cfg.model:
            raise ConfigError("model", "the GPTTask's ModelConfig differs from cfg.model; build the task from "
                                       "cfg.model")
        refuse_unhonoured(cfg, mesh)
        task = for_config(task, cfg)  # its layers compute in precision.policy (another policy is refused)
        self.cfg, self.task, self.mesh = cfg, task, mesh
        # workers: a keras_cluster.WorkerGroup when the run spans the workers of a cluster (``mesh`` is
        # then this worker's own devices; the workers are data parallel over it); None in one process.
        self.workers = workers
        self.world = 1 if workers is None else workers.size
        # dp and n_devices count every worker's (the run's data replicas).
        self.dp, self.tp, self.pp, self.ep = mesh.dp * self.world, mesh.tp, mesh.pp, cfg.parallel.ep
        self.n_devices = len(mesh.devices) * self.world
        self.names = list(builtin.weight_shapes(cfg.model))
        # Cut for the mesh's tensor ranks; the Keras engine cuts it into pipeline stages itself
        # (split_keras_model, as for phalanx.fit) and places each tensor shard on its rank.
        self.model, self._convert = compiled_gpt(cfg, task, mesh.device(0, 0, 0), tp=self.tp, ep=self.ep)
        self.optimizer = self.model.optimizer
        self.loss_scale = self.optimizer.loss_scale
        tokens = np.zeros([cfg.train.global_batch, cfg.model.seq_len], np.int32)
        self.engine = KerasModelEngine(self.model, cfg, mesh, (tokens, tokens, None), workers=workers,
                                       stage_calls=stage_calls)
        # False, or what was assigned outside a step and the rest must follow: "whole" (the model's
        # weights: a mask installed, weights loaded) or "slices" (a checkpoint restored into ZeRO's slices)
        self._stale: bool | str = False
        self._whole = False  # under ZeRO: the whole state was gathered from the slices since the last step
        # pruning (train.prune.*): logical name -> a 0/1 mask variable beside each variable holding a part
        self._masks = self._make_masks() if prune.enabled(cfg) else {}
        if workers is not None:  # every worker holds the same model and starts from the chief's weights
            workers.start(self.model, None, {})
            self.engine.sync_copies()

    # -- pruning ---------------------------------------------------------------------------------

    def _make_masks(self) -> dict[str, list[tf.Variable]]:
        """A mask (all ones) beside every variable holding a part of a prunable weight
        (:func:`phalanx.prune.prunable`), and the optimizers reading them: each update zeroes the
        masked weights and their AdamW moments (:func:`phalanx.core.optim.apply_adamw`), the whole
        variables' or, under ZeRO, each slice's own piece of the mask."""
        variables = self.model.trainable_variables
        masks: dict[str, list[tf.Variable]] = {}
        by_variable = {}
        for name, (indices, _) in self._convert.parts.items():
            if not prune.prunable(name):
                continue
            for i in indices:
                var = variables[i]
                with tf.init_scope(), tf.device(var.value.device):
                    mask = tf.Variable(tf.ones(var.shape, tf.float32), trainable=False,
                                       name=f"prune_mask/{var.path}")
                masks.setdefault(name, []).append(mask)
                by_variable[id(var)] = mask
                self.optimizer.masks[id(var)] = mask.read_value
        slices = self.engine.slices
        if slices is not None:  # the optimizer that applies on the slices: each slice's piece of its mask
            for var, layout, row in zip(slices.variables, slices.layouts, slices.slices):
                if id(var) in by_variable:
                    for k, piece in enumerate(row):
                        slices.optimizer.masks[id(piece)] = \
                            lambda m=by_variable[id(var)], layout=layout, k=k: layout.piece(m.read_value(), k)
        return masks

    def weight_shards(self, prunable) -> dict[str, list]:
        """The prunable weights as :class:`~phalanx.prune.shards.WeightShard` objects for
        :class:`phalanx.prune.Pruner`: one per variable holding a part (its box of the logical
        weight), read from the variable; installing a mask zeroes the part's weights and AdamW
        moments now (the optimizer keeps them zero)."""
        if not self._masks:
            raise ConfigError("train.prune.target", "the engine was built without train.prune.target > 0; set it "
                                                    "to prune")
        variables = self.model.trainable_variables
        out: dict[str, list] = {}
        for name, masks in self._masks.items():
            if not prunable(name):
                continue
            indices, joined = self._convert.parts[name]
            shape = tuple(int(n) for n in joined.shape)
            for i, mask, (_, box) in zip(indices, masks, joined.parts):
                local = boxes.shape_of(box)

                def fetch(var=variables[i], local=local):
                    return np.reshape(var.numpy(), local)

                def install(array, i=i, mask=mask):
                    self._install(i, mask, array)
                out.setdefault(name, []).append(WeightShard(name, shape, [(boxes.full(local), box)], fetch=fetch,
                                                          install=install))
        return out

    def _install(self, i: int, mask: tf.Variable, array) -> None:
        """Install ``array`` as the mask of trainable variable ``i``: zero its masked weights and
        moments (under ZeRO in the whole state gathered from the slices, cut again before the
        next step)."""
        if self.engine.slices is not None and not self._whole:
            self.engine.gather_state()
            self._whole = True
        var = self.model.trainable_variables[i]
        mask.assign(np.reshape(np.asarray(array, np.float32), tuple(var.shape)))
        for target in (var, self.optimizer.m[i], self.optimizer.v[i]):
            target.assign(target.value * mask)
        self._stale = "whole"  # the replicas' copies (and the slices) follow the masked weights

    # -- steps ---------------------------------------------------------------------------------

    @staticmethod
    def _xy(batch):
        batch = tf.convert_to_tensor(batch)
        return batch[:, :-1], batch[:, 1:], None

    def _sync(self) -> None:
        """Refresh the replicas' weight copies if the weights were assigned outside a step
        (under ZeRO the checkpoint's slots are the slices: the copies follow them)."""
        if self._stale:
            self._restored(from_slices=self._stale == "slices")
            self._stale = False

    def _restored(self, from_slices: bool = False) -> None:
        """After state was assigned outside a step: the replicas' copies (and under ZeRO the
        slices) from the weights, or with ``from_slices`` the whole copies from ZeRO's slices,
        and the dropout layers' seed states at the steps run so far
        (applied and skipped), so a resumed run draws the masks an uninterrupted one would."""
        self.engine.sync_copies(from_slices=from_slices)
        if self.cfg.model.dropout:
            dropout_lib.set_calls(self.model, int(self.optimizer.step.numpy()) + int(self.loss_scale.skipped.numpy()))

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        """One step on a global batch ``[b, seq_len + 1]`` of token ids."""
        self._sync()
        loss = self.engine.train_step(self._xy(batch))["loss"]
        self._whole = False
        out = {key: tf.identity(var) for key, var in self.optimizer.last.items()}
        out["loss"] = loss
        return out

    def eval_step(self, batch) -> tf.Tensor:
        self._sync()
        return self.engine.test_step(self._xy(batch))["loss"]

    # -- state ------------------------------------------------------------------------------

    def checkpoint_slots(self) -> list[checkpoint.ShardSet]:
        """The state as one shard set per device holding it (the sharded format,
        docs/checkpoint_format.md), built by :meth:`KerasModelEngine.checkpoint_slots` with the
        built-in GPT's names: each variable's part of a logical weight (and its ``m``/``v``
        moments as ``optimizer/m|v/*``) a slot by logical name and box, under ZeRO each
        replica's slices; ``optimizer/step`` and the loss scale on the first device; the pruning
        masks as optional ``prune/mask/*`` slots beside the weights' variables. A save reads, and
        a restore assigns, one part at a time per writer thread, so the host never holds a whole
        tensor of a sharded weight; any layout's checkpoint (those of the former mesh engine included)
        restores into it box by box."""
        # what was assigned since the last step (a mask installed) reaches the slices before they are saved
        self._sync()
        # a restore assigns the weights outside a step: under ZeRO into the slices themselves (across
        # workers the whole state, all-gathered on every worker by before_checkpoint, cut again after)
        self._stale = "slices" if keras_slots.saved_slices(self.engine) is not None else "whole"
        variables = self.model.trainable_variables
        parts = {name: [(variables[i], box) for i, (_, box) in zip(indices, joined.parts)]
                 for name, (indices, joined) in self._convert.parts.items()}
        scalars = {"optimizer/step": self.optimizer.step, **self.loss_scale.state()}
        masks = []
        for name, held in self._masks.items():  # laid out as the weight's variables, whole under ZeRO too
            _, joined = self._convert.parts[name]
            masks += keras_slots.part_slots(prune.MASK_PREFIX + name,
                                            [(m, box) for m, (_, box) in zip(held, joined.parts)])
        for _, slot in masks:
            # a mask is only assigned on restore: the weights and moments saved beside it are zero where
            # it is; a checkpoint written without pruning leaves the masks as they are (all ones)
            slot.optional = True
        return self.engine.checkpoint_slots(parts, scalars=scalars, extra=masks)

    def before_checkpoint(self) -> None:
        """Called on every worker before the chief saves a checkpoint: under ZeRO across workers
        the slices are all-gathered into the model's weights and the whole AdamW moments (a
        collective; one process needs nothing)."""
        if self.workers is not None and self.engine.slices is not None:
            self._sync()
            self.engine.gather_state()
            self._whole = True

    def _moments(self, slots: list[tf.Variable]) -> dict[str, np.ndarray]:
        return self._convert.to_logical([s.numpy() for s in slots])

    def state_dict(self) -> dict[str, np.ndarray]:
        self._sync()  # a checkpoint restored into ZeRO's slices: the whole weights follow them first
        self.engine.gather_state()  # under ZeRO: the moments' slices into self.optimizer's whole ones
        state = transformer.gpt_weights(self.model)
        state["optimizer/step"] = np.asarray(self.optimizer.step.numpy())
        m, v = self._moments(self.optimizer.m), self._moments(self.optimizer.v)
        for n in self.names:
            state[f"optimizer/m/{n}"], state[f"optimizer/v/{n}"] = m[n], v[n]
        state.update({k: np.asarray(var.numpy()) for k, var in self.loss_scale.state().items()})
        return state

    def load_state_dict(self, state) -> None:
        wanted = list(self.names) + ["optimizer/step"] + [f"optimizer/{s}/{n}" for s in "mv" for n in self.names] + \
            list(self.loss_scale.state())
        missing = [k for k in wanted if k not in state]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
                           f"was it written for a different model?")
        shapes = builtin.weight_shapes(self.cfg.model)
        values = {}
        for key in wanted:
            value = np.asarray(state[key])
            logical = key.rsplit("optimizer/m/", 1)[-1].rsplit("optimizer/v/", 1)[-1]
            if logical in shapes and tuple(value.shape) != shapes[logical]:
                raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(value.shape)}, the model expects "
                                 f"{shapes[logical]}: a different model config?")
            values[key] = value
        transformer.load_gpt_weights(self.model, {n: values[n].astype(np.float32) for n in self.names})
        for prefix, slots in (("optimizer/m/", self.optimizer.m), ("optimizer/v/", self.optimizer.v)):
            arrays = self._convert.from_logical({n: values[prefix + n].astype(np.float32) for n in self.names})
            for slot, array in zip(slots, arrays):
                slot.assign(array)
        self.optimizer.step.assign(int(values["optimizer/step"]))
        for key, var in self.loss_scale.state().items():
            var.assign(values[key].astype(var.dtype.as_numpy_dtype))
        self._restored()  # the replicas' copies (and under ZeRO the slices) of what was loaded

    def num_params(self) -> int:
        return builtin.num_params(self.cfg.model)

    def weights(self) -> dict[str, np.ndarray]:
        self._sync()
        if self.engine.zero == 3:  # the model's weights are the host copy: written from the slices first
            self.engine.gather_state()
        return transformer.gpt_weights(self.model)
