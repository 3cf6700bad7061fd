"""Train a user's compiled Keras 3 model on a ``(data, pipe)`` mesh, the way Keras would.

What the user compiled rules: ``model.optimizer`` (any Keras optimizer, with its
learning-rate schedule, clipping and weight decay), ``model.loss`` (objects, strings,
per-output losses, ``loss_weights``, plus the model's own regularisation losses) and the
compiled metrics. The engine only decides *where* things run:

* **Placement.** The model is cut into ``pp x virtual_stages`` stages by estimated FLOPs
  (:func:`phalanx.parallel.keras_graph.split_keras_model`); with one stage, any model —
  subclassed included — is that stage. Each stage's variables (the user's own
  ``keras.Variable`` objects) are moved to the stage's device of data replica 0 and stay
  there: the model object is trained in place, and the optimizer's slots, which Keras
  creates next to each variable, live with the weights they update. Replicas 1..dp-1 hold
  plain copies of the trainable weights, refreshed after every step.
* **ZeRO** (``parallel.zero``; Rajbhandari et al. 2020) by slices
  (:mod:`phalanx.parallel.keras_zero`): every trainable variable is cut into ``dp`` slices
  (zero-padded), slice ``k`` on data replica ``k``'s device for the variable's stage and tensor
  rank (an expert shard: one slice per group of ``ep`` replicas that holds a copy). A second
  instance of the user's optimizer, made from its config, applies on the slices (one
  ``apply``: ``global_clipnorm`` and ``iterations`` as one optimizer), so each device holds
  ``1/dp`` of the optimizer state. ``model.optimizer`` keeps whole-shaped slots on the host
  CPU, written at each epoch's end (:meth:`KerasModelEngine.gather_state`), for ``evaluate``
  and ``save`` (checkpoints are written from the slices: :meth:`KerasModelEngine.checkpoint_slots`).
  Stage 1: the summed gradient of a variable is formed on each
  slice's device (an all-reduce) and cut there; the whole weights on every replica are
  refreshed from the updated slices (an all-gather). Stage 2: each replica's gradient is cut
  where it was formed and slice ``k`` of every replica's is summed on replica ``k`` (a
  reduce-scatter): no device holds a whole summed gradient. Stage 3: the weights too: the
  model's trainable variables are the host copy (written at ``gather_state``), no replica
  holds a whole weight between steps; each replica gathers a stage's weights from the slices
  (a concat on its device) at the stage's first forward of the step, keeps them for its
  later micro-batches and its backward (not gathered again), and the gradient of each slice
  flows back to the slice's device (a reduce-scatter). With ``pp=1`` the whole model is the
  gathered stage (it is not cut into smaller gather chunks). An expert shard is gathered on
  the device of its ep group's replica that holds it (from its one slice per group), once for
  the group: every replica of the group sends its tokens to that one gathered shard, and each
  replica's gradient of it is cut there into the groups' slices (in one process). **Across workers** the slices span every data replica of the run: with ``W``
  workers of ``dp`` local replicas each variable is cut into ``W x dp`` slices and worker ``w``'s
  replica ``k`` holds slice ``w dp + k``, so each device holds ``1/(W dp)`` of the optimizer
  state (and at stage 3 of the weights; ``model.optimizer``'s whole host copy aside). Each
  worker sums its replicas' gradients on one device, the workers sum them with a collective
  all-reduce (the step's exchange) and each device keeps its slice of the sum: TensorFlow's
  reduce-scatter collective has no CPU implementation, so at stage 2 and 3 a worker holds the
  whole summed gradient during the exchange, as at stage 1. The updated slices (stage 1, 2) and a
  stage's weights (stage 3, once per step and stage, shared by the worker's replicas) are
  all-gathered across workers on the worker's first device and copied to its replicas.
  ``global_clipnorm`` clips by the norm over every worker's slices and a ``LossScaleOptimizer``
  skips a step when any worker's slices are not finite.
* **The step** (one ``tf.function``): every replica cuts its rows of the global batch into
  ``grad_accum x microbatches`` micro-batches and runs the pipeline schedule once per
  accumulation step (:func:`phalanx.parallel.pipeline.run_schedule`), the replica's gradient
  sums carried from one step into the next and each step started on a rank once the previous
  one ended there (one step's activations and one gradient set at a time); each stage runs *statelessly* on the
  replica's weight values; without expert shards the stage's forward is traced once per replica
  and called for every micro-batch, tensor shards on their ranks and recomputed pieces inside the
  call (:mod:`phalanx.parallel.stage_calls`): its ops are traced and optimised once, not once per
  micro-batch.
  The last stage computes the compiled loss plus the model's own
  losses, updates the loss tracker and the compiled metrics, and weights the loss by
  ``loss_scale / (dp x grad_accum x microbatches)`` times the micro-batch's share of the rows
  (1 when they divide evenly; a batch of any size is cut as evenly as it goes:
  :func:`row_plan`), so the summed gradient is the gradient of the mean loss over the global
  batch, exactly as on one device. Gradients are summed
  over replicas on each weight's device and applied by ``model.optimizer`` (a
  ``LossScaleOptimizer`` under ``mixed_float16``, which unscales and skips non-finite
  steps itself, as in Keras).
* **Expert shards under a mixed policy** are cast to the compute dtype once per device and
  step, where the shard lives, and every replica and micro-batch of its ep group reads that
  copy (:func:`phalanx.layers.moe.attach_compute_copy`; the gradients flow through the one
  cast to the float32 weight): a device holds one compute-dtype copy of its shard, not one per
  reading call. The values are those of a cast per call.
* **A vocabulary-parallel loss.** With ``tp > 1``, when the last stage's output is the
  vocabulary-parallel head's logits (the reverse call of a
  :class:`~phalanx.layers.VocabParallelEmbedding`, a tied or untied keras-hub head after
  :func:`phalanx.parallelize`, or a :class:`~phalanx.layers.ColumnParallelDense` head), the
  compiled loss is one ``SparseCategoricalCrossentropy(from_logits=True)`` and no compiled
  metric reads ``y_pred``, the loss is computed from the shard logits
  (:func:`~phalanx.layers.tensor_parallel.shard_logits_cross_entropy`): each tensor rank's
  ``[..., vocab/tp]`` logits stay on its device, only per-token scalars cross, and the joined
  logits are never formed. Keras's own reduction then applies (its ``reduction``, sample
  weights, ``ignore_class``, an output mask, ``loss_weights``). Otherwise the shard logits are
  joined on the tensor rank 0 device for Keras's loss, and :attr:`KerasModelEngine.loss_note`
  says why (``phalanx.fit`` prints it). ``predict`` returns the joined logits. A last stage run
  as a stage call returns the shard logits as separate outputs, each read on its rank.
* **State that is not trained** (BatchNormalization moving statistics, Dropout's seed
  state, MoE statistics) follows one rule on every layout (:mod:`phalanx.parallel.replica_state`):
  within a replica it is threaded through the micro-batches in order, as GPipe does (each
  micro-batch is normalised with its own batch statistics and moves the averages once, and
  each draws its own dropout mask); every replica starts from the step's starting state, and
  the replicas' results are combined once per step as MirroredStrategy does (moving
  statistics averaged, MoE step totals summed, integer seed state equal on every replica, so
  the replicas of a step draw the same dropout masks). With one replica and one micro-batch
  this is exactly Keras's own step. phalanx's positional dropout layers
  (:mod:`phalanx.layers.dropout`) are the exception: their per-call context is given, not
  threaded: every call of a step reads the step's starting seed state and its micro-batch's
  first row in the global batch, so every layout draws the masks of one device's one call.
* **Recomputation** (``parallel.recompute``): ``full`` runs each stage's forward on a
  micro-batch as blocks whose activations are recomputed in the backward (a Functional or
  Sequential stage cut into about ``sqrt(n)`` blocks, a subclassed model as one);
  ``selective`` recomputes the attention cores of ``ParallelSelfAttention`` and
  ``MultiHeadAttention`` layers only (:mod:`phalanx.parallel.recompute`). Same numbers.
* **Across workers** (``workers=``, a :class:`~phalanx.engines.keras_cluster.WorkerGroup`):
  the mesh is this worker's own devices, the step runs on its rows of the global batch with
  the loss weights divided by the number of workers too, and one exchange before the
  optimizer sums the gradients and the metrics' changes and joins the state across workers
  by the same rule as across replicas (:mod:`phalanx.engines.keras_cluster`).

Example:
    >>> import keras, numpy as np
    >>> from phalanx.config import Config
    >>> from phalanx.mesh import Mesh
    >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    >>> model.compile(optimizer="sgd", loss="mse")
    >>> batch = (np.ones([4, 3], "float32"), np.zeros([4, 2], "float32"), None)
    >>> engine = KerasModelEngine(model, Config(), Mesh.from_devices(["/device:CPU:0"], 1, 1, 1), batch)
    >>> float(engine.train_step(batch)["loss"]) >= 0
    True
"""

from __future__ import annotations

import contextlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend import get_keras_mask  # Keras's loss reads y_pred's mask this way; no public API
from keras.src.losses.loss import reduce_weighted_values  # Keras's own reduction, so the vocab-parallel loss is its

from phalanx.config import Config, ConfigError
from phalanx.engines import keras_slots
from phalanx.layers import dropout as dropout_lib
from phalanx.layers.moe import MoE, attach_compute_copy, is_step_total
from phalanx.layers.sharding import placement_of
from phalanx.layers.tensor_parallel import VocabParallelEmbedding, shard_logits_cross_entropy, vocab_logit_shards
from phalanx.mesh import Mesh
from phalanx.parallel import recompute
from phalanx.parallel.gradients import finish, join_gradients
from phalanx.parallel.keras_graph import split_keras_model
from phalanx.parallel.keras_zero import ZeroSlices, check_sliceable
from phalanx.parallel.pipeline import run_schedule, schedule_for
from phalanx.parallel.replica_state import combine_replicas, rule_of
from phalanx.parallel.schedules import calls_used
from phalanx.parallel.stage_calls import StageCalls, glue_options
from phalanx.precision import resolve_policy

MIXED_POLICIES = ("mixed_bfloat16", "mixed_float16")


# -- precision --------------------------------------------------------------------------


def precision_of(model, cfg: Config, *, auto_switches: bool = False) -> tuple[str, str]:
    """``(policy, reason)``: the Keras dtype policy ``model`` trains under with ``cfg``.

    A model trains in the precision it was built in unless ``precision.policy`` is set
    explicitly, so that the default run gives Keras's own numbers on every machine:

    * built under a mixed Keras policy (``model.dtype_policy``: the global policy when it was
      made): it runs as built, its layers' own policies (a float32 softmax head included) being
      the user's choice. ``precision.policy=auto`` keeps it; an explicit policy that differs is
      a ConfigError (it could not be honoured without discarding the layers' choices);
    * built under float32: ``precision.policy=auto`` keeps float32 — where ``auto`` would have
      chosen ``mixed_bfloat16`` (the hardware has bfloat16 units) the reason says how to get it
      (``precision.policy=mixed_bfloat16``), and a run prints it as its precision line; an
      explicit policy is taken.

    ``auto_switches=True`` lets ``auto`` switch a float32-built model to the policy it resolved
    to: for phalanx's own GPT (its numbers are phalanx's, not a user's Keras run to reproduce).

    Example:
        >>> import keras
        >>> from phalanx.config import load_config
        >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        >>> precision_of(model, load_config(None, ["precision.policy=mixed_bfloat16"]))
        ('mixed_bfloat16', 'precision.policy=mixed_bfloat16')
    """
    policy, reason = resolve_policy(cfg)
    built = model.dtype_policy.name
    auto = reason.startswith("auto")  # the config records how auto resolved (phalanx.config.Config)
    if built in MIXED_POLICIES and built != policy:
        if auto:
            return built, f"the model was built under {built}; precision.policy=auto keeps it"
        raise ConfigError("precision.policy", f"{policy}, but model {model.name!r} was built under the Keras policy "
                                              f"{built}: set precision.policy={built} (or auto), or build the model "
                                              f"under float32 and let phalanx apply {policy}")
    if auto and built not in MIXED_POLICIES and policy != built and not auto_switches:
        return _kept_as_built(built, policy, reason)
    return policy, reason


def _kept_as_built(built: str, policy: str, reason: str) -> tuple[str, str]:
    """The reason ``auto`` leaves a model built under ``built`` as it is, naming the ``policy``
    auto chose and the setting that would run it."""
    why = reason.split(":", 1)[1].strip() if ":" in reason else reason
    return built, (f"the model was built under {built}; precision.policy=auto keeps it ({why}: set "
                   f"precision.policy={policy} for mixed precision)")


def apply_precision(model, cfg: Config, *, auto_switches: bool = False) -> None:
    """Run ``model`` under :func:`precision_of` its config, as if it had been built under it.

    A model built under float32 takes a mixed ``precision.policy`` on every layer still on
    float32 (float32 variables, bfloat16/float16 compute); layers the user set to another
    policy keep theirs. A model built under the mixed policy keeps every layer's own policy
    (a float32 head stays float32, as in Keras). Under ``mixed_float16`` the optimizer is
    wrapped in a ``LossScaleOptimizer`` (as ``model.compile`` does under that policy), started
    at ``precision.loss_scale_init`` and grown every ``precision.loss_scale_growth_interval``
    good steps.
    """
    policy, _ = precision_of(model, cfg, auto_switches=auto_switches)
    if policy not in MIXED_POLICIES:
        return
    if model.dtype_policy.name != policy:  # built under float32: the layers that took the default take the policy
        for layer in model._flatten_layers(include_self=True):
            if layer.dtype_policy.name == "float32":
                layer.dtype_policy = policy
    optimizer = getattr(model, "optimizer", None)
    if policy == "mixed_float16" and optimizer is not None and \
            not isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if optimizer.built:
            raise ValueError(f"model {model.name!r}: precision.policy=mixed_float16 needs a loss-scaling optimizer, "
                             f"but {type(optimizer).__name__} was already used; compile the model again before fit")
        model.optimizer = keras.optimizers.LossScaleOptimizer(
            optimizer, initial_scale=cfg.precision.loss_scale_init,
            dynamic_growth_steps=cfg.precision.loss_scale_growth_interval)


# -- placement ----------------------------------------------------------------------------


def _same_device(a: str, b: str) -> bool:
    sa, sb = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    same = (sa.device_type or "CPU").upper() == (sb.device_type or "CPU").upper() and \
        (sa.device_index or 0) == (sb.device_index or 0)
    for field in ("job", "replica", "task"):
        x, y = getattr(sa, field), getattr(sb, field)
        if x is not None and y is not None and x != y and not (field == "job" and "localhost" in (x, y)):
            same = False
    return same


def place_variable(variable, device: str) -> bool:
    """Move a ``keras.Variable``'s storage to ``device``, keeping the object, name and value.

    Returns whether it moved. The Keras object stays the one the model, its callbacks and
    its saved files refer to; only the TensorFlow variable behind it is new.
    """
    current = variable.value
    if _same_device(current.device, device):
        return False
    with tf.init_scope(), tf.device(device):
        moved = tf.Variable(current.read_value(), trainable=current.trainable, dtype=current.dtype,
                            name=current.name.split(":")[0])
    variable._value = moved  # the TF backend's keras.Variable keeps its storage here
    return True


def _reindex_optimizer(optimizer) -> None:
    """Re-key an already built optimizer after its variables' storage moved.

    Keras keys slots by the identity of the TensorFlow variable behind each
    ``keras.Variable``, which :func:`place_variable` replaces.
    """
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is not None and opt.built:
            opt._trainable_variables_indices = {opt._var_key(v): i for i, v in enumerate(opt._trainable_variables)}


def check_tensor_layout(model, tp: int) -> None:
    """Refuse a tensor-parallel layout the model's weights or optimizer cannot honour.

    With ``tp > 1`` the model must hold tensor shards (layers from
    :mod:`phalanx.layers.tensor_parallel`, or :func:`phalanx.parallelize`) cut into ``tp``
    pieces, and its optimizer must update each shard as it would the whole weight: true of
    element-wise optimizers, not of per-tensor clipping (``clipnorm``) or of optimizers that
    look at a whole matrix (Adafactor, LAMB, Muon).
    """
    shards = {placement_of(v).shards for v in model.weights
              if placement_of(v) is not None and placement_of(v).axis == "tensor"}
    if tp == 1:
        return
    if not shards:
        raise ConfigError("parallel.tp", f"{tp}: model {model.name!r} has no tensor-parallel layers; build it from "
                                         f"phalanx.layers (ColumnParallelDense, ParallelSelfAttention, ...) or call "
                                         f"phalanx.parallelize(model, tp={tp}) first (automatic for keras-hub models "
                                         f"with a preset)")
    if shards != {tp}:
        raise ConfigError("parallel.tp", f"{tp}: model {model.name!r} holds weights cut into {sorted(shards)} "
                                         f"tensor shards; parallel.tp must equal that")
    optimizer = getattr(model, "optimizer", None)
    inner = getattr(optimizer, "inner_optimizer", optimizer)
    if inner is not None:
        if getattr(inner, "clipnorm", None):
            raise ConfigError("parallel.tp", f"{tp}: {type(inner).__name__}(clipnorm={inner.clipnorm}) clips each "
                                             f"weight by its own norm, which a weight cut into {tp} shards does "
                                             f"not have; use global_clipnorm (the norm over all weights), or tp=1")
        if type(inner).__name__ in ("Adafactor", "Lamb", "Muon"):
            raise ConfigError("parallel.tp", f"{tp}: {type(inner).__name__} scales each update by statistics of the "
                                             f"whole weight matrix, which a weight cut into {tp} shards does not "
                                             f"see; use an element-wise optimizer (SGD, Adam, AdamW, RMSprop, "
                                             f"Lion, ...) or tp=1")


def check_zero(zero: int, workers: int = 1, ep: int = 1) -> None:
    """Refuse a ZeRO stage the Keras-model engine does not run: it runs 0, 1, 2 and 3 (see
    the module docstring), with any tensor, pipeline or expert layout in one process, and across
    ``workers`` workers; stage 3 with expert parallelism (``ep``) in one process only.

    Example:
        >>> check_zero(3), check_zero(1, workers=2), check_zero(3, ep=2)
        (None, None, None)
        >>> try:
        ...     check_zero(3, workers=2, ep=2)
        ... except ConfigError as err:
        ...     print(err.key)
        parallel.zero
    """
    if zero not in (0, 1, 2, 3):
        raise ConfigError("parallel.zero", f"{zero}: the Keras-model engine runs parallel.zero=0, 1, 2 or 3")
    if zero == 3 and ep > 1 and workers > 1:
        raise ConfigError("parallel.zero", f"3 with parallel.ep={ep} across {workers} workers: an expert shard is "
                                           f"gathered from its slices within one process only; use "
                                           f"parallel.zero=2 (or 1, 0) with expert parallelism across workers, or "
                                           f"run in one process")


def place_optimizer_slots(optimizer, variables) -> bool:
    """Move the slots of an optimizer built before its variables were placed (a model the
    user trained before) next to the variable each belongs to. Keras names a slot
    ``<the variable's path, '/' -> '_'>_<slot name>`` and gives it the variable's shape;
    the longest such name that matches wins. Returns whether any slot moved."""
    by_name = {v.path.replace("/", "_"): v for v in variables}
    moved, seen = False, set()
    for opt in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if opt is None or not opt.built:
            continue
        for slot in opt.variables:
            if id(slot) in seen:
                continue
            seen.add(id(slot))
            name, cut = slot.name, len(slot.name)
            while (cut := name.rfind("_", 0, cut)) > 0:
                owner = by_name.get(name[:cut])
                if owner is not None and tuple(owner.shape) == tuple(slot.shape):
                    moved |= place_variable(slot, owner.value.device)
                    break
    return moved


def _host_device(mesh: Mesh) -> str:
    """The CPU of the process that owns ``mesh``'s first device: where ZeRO keeps the whole
    host copy of the weights and of the optimizer's state."""
    spec = tf.DeviceSpec.from_string(mesh.device(0, 0, 0))
    return spec.replace(device_type="CPU", device_index=0).to_string()


def check_expert_layout(model, ep: int, dp: int, workers: int = 1) -> None:
    """Refuse an expert-parallel degree the model's expert layers are not cut for, or that
    the data replicas (this worker's own, across ``workers`` workers) cannot group."""
    shards = {placement_of(v).shards for v in model.weights
              if placement_of(v) is not None and placement_of(v).axis == "expert"}
    if ep == 1:  # shards, if any, stay with each replica (as a tensor-parallel model on tp=1)
        return
    if not shards:
        raise ConfigError("parallel.ep", f"{ep}: model {model.name!r} has no expert-parallel layers; build its "
                                         f"mixture-of-experts layers as phalanx.layers.MoE(..., ep={ep})")
    if shards and shards != {ep}:
        raise ConfigError("parallel.ep", f"{ep}: model {model.name!r} holds experts cut into {sorted(shards)} "
                                         f"shards (phalanx.layers.MoE(ep=...)); parallel.ep must equal that")
    if dp % ep:
        across = (f" (parallel.strategy=multi_worker over {workers} workers: dp={dp} is each worker's own "
                  f"replicas; the experts are sharded within a worker, never across workers)") if workers > 1 else ""
        raise ConfigError("parallel.ep", f"{ep} does not divide dp={dp}: experts are sharded over the "
                                         f"data replicas, in groups of ep{across}")


# -- stages --------------------------------------------------------------------------------


class _WholeModel:
    """The whole model as one stage (any Keras model, subclassed included)."""

    def __init__(self, model):
        self.model = model
        self.trainable_variables = list(model.trainable_variables)
        self.non_trainable_variables = list(model.non_trainable_variables)
        self.input_keys, self.output_keys = ["x"], ["y"]

    def apply(self, trainable_values, non_trainable_values, inputs, training):
        kwargs = {"training": training} if getattr(self.model, "_call_has_training_arg", True) else {}
        y, state, losses = self.model.stateless_call(trainable_values, non_trainable_values, inputs["x"],
                                                     return_losses=True, **kwargs)
        return {"y": y}, list(state), list(losses)


class _SplitStage:
    """A stage of a :class:`~phalanx.parallel.keras_graph.KerasSplit` (cut Functional/Sequential)."""

    def __init__(self, stage):
        self.stage = stage
        self.trainable_variables = list(stage.trainable_variables)
        self.non_trainable_variables = list(stage.non_trainable_variables)
        self.input_keys, self.output_keys = list(stage.input_keys), list(stage.output_keys)

    def apply(self, trainable_values, non_trainable_values, inputs, training):
        outputs, state, losses = self.stage.apply(trainable_values, non_trainable_values, inputs, training,
                                                  return_losses=True)
        return outputs, list(state), losses


def vocab_loss_plan(model, tp: int, custom_loss: bool = False) -> tuple[bool, str | None]:
    """``(eligible, note)``: whether :class:`KerasModelEngine` may compute ``model``'s compiled
    loss from a vocabulary-parallel head's shard logits (it then does when the last stage's
    output is such a head's: :func:`~phalanx.layers.tensor_parallel.vocab_logit_shards`), and
    the one line that says which loss runs for a model with a
    :class:`~phalanx.layers.VocabParallelEmbedding` cut ``tp > 1`` ways (None for others).

    Eligible: one ``SparseCategoricalCrossentropy(from_logits=True)`` (object, or the function
    with ``from_logits=True``) on a single output, in float32, over the last axis, no compiled
    metric (they read the joined ``y_pred``: accuracy would need the full logits), and neither
    ``compute_loss`` nor ``compute_metrics`` overridden.

    ``model``'s compiled loss must be built (the engine builds it first).

    Example:
        >>> model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
        >>> model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        >>> _ = model.evaluate(np.zeros((2, 3)), np.zeros((2,)), verbose=0)  # builds the compiled loss
        >>> vocab_loss_plan(model, tp=2)  # eligible; no vocabulary-parallel head to speak of
        (True, None)
    """
    reason = None
    compile_loss = getattr(model, "_compile_loss", None)
    metrics = getattr(model, "_compile_metrics", None)
    flat = list(getattr(compile_loss, "_flat_losses", None) or [])
    if custom_loss:
        reason = f"{type(model).__name__} overrides compute_loss"
    elif type(model).compute_metrics is not keras.Model.compute_metrics:
        reason = f"{type(model).__name__} overrides compute_metrics, which reads the logits"
    elif metrics is not None and any(m is not None for m in keras.tree.flatten(
            [metrics._user_metrics, metrics._user_weighted_metrics])):
        reason = "compiled metrics read the full logits (y_pred)"
    elif len(flat) != 1 or flat[0].path not in ((), None):
        reason = "the compiled loss is not one loss on a single output"
    else:
        fn = flat[0].loss
        kwargs = getattr(fn, "_fn_kwargs", {})
        if getattr(fn, "fn", None) is not keras.losses.sparse_categorical_crossentropy:
            reason = f"the loss {getattr(fn, 'name', fn)!r} is not SparseCategoricalCrossentropy"
        elif not kwargs.get("from_logits", False):
            reason = "SparseCategoricalCrossentropy has from_logits=False (it reads softmax probabilities)"
        elif kwargs.get("axis", -1) != -1:
            reason = f"SparseCategoricalCrossentropy has axis={kwargs['axis']} (the vocabulary is the last axis)"
        elif fn.dtype != "float32":
            reason = f"the loss computes in {fn.dtype} (the vocabulary-parallel loss computes in float32)"
    has_head = tp > 1 and any(isinstance(layer, VocabParallelEmbedding) and layer.tp > 1
                              for layer in model._flatten_layers(include_self=False))
    if not has_head:
        return reason is None, None
    if reason is None:
        return True, (f"loss: vocabulary-parallel cross-entropy on the tp={tp} shard logits "
                      f"(the full logits are never on one device)")
    return False, (f"loss: the tp={tp} shard logits are joined on one device for the compiled loss: {reason} "
                   f"(vocabulary-parallel: one SparseCategoricalCrossentropy(from_logits=True), no compiled metrics)")


def _first_tensor(x) -> tf.Tensor:
    return next(t for t in tf.nest.flatten(x) if t is not None)


def _rows(x) -> int:
    return int(_first_tensor(x).shape[0])


def _slice(batch, start: int, size: int):
    return tf.nest.map_structure(lambda t: None if t is None else t[start:start + size], batch)


def _even(rows: int, parts: int) -> list[int]:
    """``rows`` cut into ``parts`` counts that differ by at most one, the larger first."""
    base, extra = divmod(rows, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def row_plan(rows: int, dp: int, accum: int, microbatches: int) -> list[list[list[int]]]:
    """``plan[d][a]``: the row counts of the micro-batches of replica ``d``'s accumulation
    step ``a``, in batch order. Rows are cut as evenly as they go (replicas, then steps,
    then micro-batches; the larger parts first); a step with fewer rows than
    ``microbatches`` runs that many one-row micro-batches, one with none is left out. Each
    micro-batch's mean loss is then weighted by its share of the rows, so a batch of any size
    gives the gradient of its mean loss, as one device would.

    Example:
        >>> row_plan(7, 2, 1, 2)
        [[[2, 2]], [[2, 1]]]
        >>> row_plan(3, 2, 1, 2)
        [[[1, 1]], [[1]]]
    """
    plan = []
    for replica_rows in _even(rows, dp):
        steps = []
        for step_rows in _even(replica_rows, accum):
            steps.append([n for n in _even(step_rows, min(microbatches, step_rows))] if step_rows else [])
        plan.append(steps)
    return plan


class KerasModelEngine:
    """One training, evaluation or prediction step of a compiled Keras model on ``mesh``.

    ``sample_batch`` is one ``(x, y, sample_weight)`` batch (NumPy or tensors): it builds
    the model, its compiled loss and metrics and the optimizer before anything is traced.
    ``stage_calls=False`` traces every stage inline for every micro-batch (every op then
    shows in the step's own graph, on its device). See the module docstring for what runs where.
    """

    def __init__(self, model, cfg: Config, mesh: Mesh, sample_batch, inference_only: bool = False,
                 workers=None, stage_calls: bool = True):
        p = cfg.parallel
        self.ep = p.ep
        if not inference_only:
            check_tensor_layout(model, mesh.tp)
            check_expert_layout(model, p.ep, mesh.dp, 1 if workers is None else workers.size)
        check_zero(p.zero, 1 if workers is None or inference_only else workers.size, p.ep)
        # Prediction reads whole weights and has no optimizer: no slices.
        self.zero = 0 if inference_only else p.zero
        if not inference_only:
            check_sliceable(getattr(model, "optimizer", None), self.zero)
        self.model, self.cfg, self.mesh = model, cfg, mesh
        self.dp, self.pp = mesh.dp, mesh.pp
        # workers: a keras_cluster.WorkerGroup when the fit spans the workers of a cluster
        # (this mesh is then this worker's own devices); None in one process.
        self.workers = None if inference_only else workers
        self.world = 1 if self.workers is None else self.workers.size
        self.accum, self.microbatches = cfg.train.grad_accum, p.microbatches
        self.schedule = schedule_for(cfg, self.pp)
        self.chunks = self.schedule.num_stages
        self.inference_only = inference_only
        self.optimizer = None if inference_only else model.optimizer
        if not model.built:
            model(sample_batch[0])  # a model without an Input builds on its first batch, as in Keras
        if self.chunks == 1:
            self.split = None
            self.stages = [_WholeModel(model)]
        else:
            self.split = split_keras_model(model, self.chunks, balance="flops")
            self.stages = [_SplitStage(s) for s in self.split.stages]
        self.home = self._home_stages()
        # How each stage runs in a training step under parallel.recompute (parallel/recompute.py).
        self.runners = [recompute.stage_runner(stage, p.recompute, model) for stage in self.stages]
        # Under ZeRO-3 the model's own trainable variables are the host copy (module docstring).
        self.host = _host_device(mesh)
        trained = {id(v) for v in model.trainable_variables}
        moved = False
        for s, stage in enumerate(self.stages):
            for v in stage.trainable_variables + stage.non_trainable_variables:
                if self.home.get(id(v), s) == s:
                    device = self.host if self.zero == 3 and id(v) in trained else self.variable_device(v, 0, s)
                    moved |= place_variable(v, device)
        if moved:
            _reindex_optimizer(getattr(model, "optimizer", None))
            # Keras's own cached step functions captured the old storage.
            model.train_function = model.test_function = model.predict_function = None
        if getattr(model, "optimizer", None) is not None:
            place_optimizer_slots(model.optimizer, model.trainable_variables)
        # Every replica but replica 0 reads its own copy of the weight, and a stage reads a
        # mirror of a weight whose home is another stage (a tied embedding). ZeRO-3 keeps no
        # whole copy: each stage gathers its weights from the slices.
        self.copies: dict[tuple[int, int], list[tf.Variable | None]] = {}
        for d in range(self.dp if self.zero < 3 else 0):
            for s, stage in enumerate(self.stages):
                copies = []
                for v in stage.trainable_variables:
                    owner = self._copy_owner(v, d)
                    if owner == 0 and self.home[id(v)] == s:
                        copies.append(None)
                    elif owner != d:  # an expert shard: read the copy its owner holds
                        copies.append(self.copies[(owner, s)][len(copies)])
                    else:
                        with tf.init_scope(), tf.device(self.variable_device(v, d, s)):
                            copies.append(tf.Variable(v.value.read_value(), trainable=True,
                                                      name=f"replica{d}_stage{s}/" + v.value.name.split(":")[0]))
                self.copies[(d, s)] = copies
        # Weight regularisation of a cut model: computed once per step on the weights
        # themselves (a one-stage model returns it from stateless_call with the rest).
        self.regularized = [v for v in model.trainable_variables if getattr(v, "regularizer", None) is not None] \
            if self.split is not None else []
        self._custom_loss = type(model).compute_loss is not keras.Model.compute_loss
        # per stage: the positions of the dropout layers' per-call context among its non-trainable
        # variables (_call_state), and while a training step is traced the state it started from
        self._contexts = [[k for k, v in enumerate(stage.non_trainable_variables)
                           if dropout_lib.is_row_offset(v) or dropout_lib.is_step_seed(v)] for stage in self.stages]
        self._step_start = None
        # id(variable read for an expert shard) -> the traced step's compute-dtype copy (_expert_casts)
        self._casts: dict[int, tf.Tensor] = {}
        # ZeRO-3: (replica, stage, id(variable)) -> the traced step's gathered weight (_stage_values;
        # for an expert shard the replica is its ep group's first), and the expert shards' compute
        # dtypes under a mixed policy (_gather; the policy is the model's when the engine is built)
        self._gathered: dict[tuple, tf.Tensor] = {}
        self._read: dict[tuple, list] = {}  # (replica, stage, row) -> the weight values a forward read
        self._shard_dtypes: dict[int, str] | None = None
        # Each stage's forward traced once and called per micro-batch (tensor shards run on their
        # ranks inside the call), when no expert shards are read: their layers place their ops by
        # their inputs' devices (parallel/stage_calls.py). Under recomputation too: the
        # recomputed pieces run inside the call (its backward re-runs them).
        no_experts = not any(placement_of(v) is not None and placement_of(v).axis == "expert"
                             for v in model.weights)
        self.stage_calls = StageCalls() if stage_calls and no_experts \
            and calls_used(p.microbatches, cfg.train.grad_accum) else None
        self._build(sample_batch)
        # ZeRO: the slices, and the user's optimizer applied on them (parallel/keras_zero.py).
        self.slices = self._make_slices() if self.zero else None
        # Whether the compiled loss may read a vocabulary-parallel head's shard logits (see the
        # module docstring), and the line that says which loss runs (None: no such head).
        self.vocab_loss, self.loss_note = (False, None) if inference_only else \
            vocab_loss_plan(model, mesh.tp, self._custom_loss)
        self._train_fn = tf.function(self._train_step, autograph=False)  # static shapes: one trace per batch shape
        self._test_fn = tf.function(self._test_step, autograph=False)  # static shapes: one trace per batch shape
        self._predict_fn = tf.function(self._predict_step, autograph=False)  # static shapes: one trace per batch shape

    # -- set-up ------------------------------------------------------------------------------

    def stage_device(self, replica: int, stage: int) -> str:
        """Where stage ``stage`` of replica ``replica`` runs what is not sharded: tensor rank 0."""
        return self.mesh.device(replica, stage % self.pp, 0)

    def variable_device(self, variable, replica: int, stage: int) -> str:
        """Where replica ``replica``'s copy of ``variable`` for stage ``stage`` lives: a
        tensor shard (:mod:`phalanx.layers.sharding`) on its rank's device, the rest on the
        stage's device."""
        placement = placement_of(variable)
        if placement is not None and placement.axis == "expert":
            return self.mesh.device(self.expert_owner(variable, replica), stage % self.pp, 0)
        rank = placement.rank if placement is not None else 0
        return self.mesh.device(replica, stage % self.pp, rank % self.mesh.tp)

    def expert_owner(self, variable, replica: int) -> int:
        """The replica whose devices hold the copy of an expert shard that ``replica`` reads.

        The data replicas form groups of ``ep`` consecutive replicas; within a group, expert
        shard ``j`` lives only with the group's ``j``-th replica, and every replica of the
        group sends its tokens there (the all-to-all of expert parallelism). The groups hold
        data-parallel copies of the experts."""
        group = replica // self.ep
        return group * self.ep + placement_of(variable).rank % self.ep

    def _slice_devices(self, variable) -> list[str]:
        """Where the ZeRO slices of ``variable`` live: one per data replica (on its device for
        the variable's home stage and tensor rank), or for an expert shard one per group of
        ``ep`` replicas (on the device of the group's replica that holds the shard)."""
        s = self.home[id(variable)]
        placement = placement_of(variable)
        if placement is not None and placement.axis == "expert":
            return [self.variable_device(variable, g * self.ep, s) for g in range(self.dp // self.ep)]
        return [self.variable_device(variable, k, s) for k in range(self.dp)]

    def _make_slices(self) -> ZeroSlices:
        """The ZeRO slices of every trainable variable, and the user's optimizer applied on
        them (:mod:`phalanx.parallel.keras_zero`). ``model.optimizer`` keeps whole-shaped slots,
        moved to the host, written at :meth:`gather_state`."""
        user = self.optimizer
        for opt in (user, getattr(user, "inner_optimizer", None)):
            for var in (opt.variables if opt is not None else []):
                place_variable(var, self.host)
        variables = list(self.model.trainable_variables)
        slices = ZeroSlices(variables, [self._slice_devices(v) for v in variables], user, self.zero,
                            workers=self.workers)
        self.optimizer = slices.optimizer  # the loss scale of a mixed_float16 step is the sliced optimizer's
        return slices

    def _copy_owner(self, variable, replica: int) -> int:
        """The replica that holds the copy ``replica`` reads: itself, or for an expert shard
        the first replica of its group (group 0's: the variable itself)."""
        placement = placement_of(variable)
        if placement is None or placement.axis != "expert":
            return replica
        return replica // self.ep * self.ep

    def _home_stages(self) -> dict[int, int]:
        """Variable id -> the stage that holds it: the first stage that reads it."""
        home: dict[int, int] = {}
        for s, stage in enumerate(self.stages):
            for v in stage.trainable_variables + stage.non_trainable_variables:
                home.setdefault(id(v), s)
        missing = [v.path for v in self.model.trainable_variables if id(v) not in home]
        if missing:
            raise ConfigError("parallel.pp", f"weights {missing[:3]} belong to no pipeline stage")
        return home

    def _build(self, sample_batch) -> None:
        """Create every variable (model, compiled loss/metrics, optimizer) before tracing."""
        if self.inference_only:
            return
        x, y, sw = sample_batch
        try:
            self.model._symbolic_build(data_batch=(x, y, sw) if sw is not None else (x, y))
        except (ValueError, TypeError) as err:
            # Keras found that the data, the model and the compiled loss/metrics do not fit.
            raise ValueError(f"x / y / loss: model {self.model.name!r} cannot compute its compiled loss and metrics "
                             f"on this data: {err}") from None
        if self.optimizer is None:
            raise ValueError(f"model {self.model.name!r} has no optimizer; compile it with one")
        if not self.optimizer.built:
            self.optimizer.build(self.model.trainable_variables)

    # -- one stage on one micro-batch -------------------------------------------------------

    def _params(self, replica: int, stage: int) -> list:
        """What stage ``stage`` of ``replica`` differentiates: its weights (or their copies),
        or under ZeRO-3 the whole weights gathered from their slices for this step
        (:meth:`_stage_values`). Differentiating the gathered tensor, not the slices, gives
        each replica the gradient one device's tape gives (an embedding's sparse rows
        included), which the reduce-scatter then cuts and joins slice by slice
        (:meth:`phalanx.parallel.keras_zero.ZeroSlices.reduce`)."""
        if self.zero == 3:
            return self._stage_values(replica, stage)
        return [v.value if copy is None else copy
                for v, copy in zip(self.stages[stage].trainable_variables, self.copies[(replica, stage)])]

    def _initial_state(self, training: bool = False) -> list[list[tf.Tensor]]:
        """Each stage's non-trainable values at the start of a step. A training step starts
        the MoE layers' statistics totals at zero: every micro-batch of every replica then
        adds to them, and after the step they are the whole batch's."""
        state = []
        for stage in self.stages:
            values = []
            for v in stage.non_trainable_variables:
                with tf.device(v.value.device):
                    values.append(tf.zeros(v.shape, v.dtype) if training and is_step_total(v)
                                  else tf.convert_to_tensor(v.value))
            state.append(values)
        return state

    def _call_state(self, s: int, state: list, row: int) -> list:
        """Stage ``s``'s non-trainable values for one call: the threaded ``state``, with the
        positional dropout layers' context (:func:`phalanx.layers.dropout.call_context`) in place:
        the call's first row in the global batch and the seed state the step started from, so
        that every layout draws the one-device masks."""
        if not self._contexts[s]:
            return state
        call = list(state)
        for k in self._contexts[s]:
            call[k] = dropout_lib.call_context(self.stages[s].non_trainable_variables[k], row,
                                               self._step_start[s][k] if self._step_start else state[k])
        return call

    def _forward(self, replica: int, s: int, carried, micro, state, mode: str, row: int = 0):
        """Stage ``s`` on one micro-batch: the tensors handed on, or at the last stage the
        float32 loss (``train``/``test``) or the flat predictions (``predict``). ``row``: the
        micro-batch's first row in the global batch (the dropout masks' rows)."""
        stage = self.stages[s]
        x, y, sw = micro
        training = mode == "train"
        with tf.device(self.stage_device(replica, s)):
            values = self._stage_values(replica, s)
            added = tf.zeros([], tf.float32)  # this micro-batch's add_loss terms so far
            if self.split is None:
                available = {"x": x}
            else:
                # A cut model hands on the crossing tensors and the running sum of the losses
                # its layers added (their gradient flows back through it like an activation).
                if s > 0:
                    *carried, added = carried
                available = dict(zip(self.split.crossing(s - 1), carried)) if s > 0 else {}
                flat_x = None
                for key in stage.input_keys:
                    if key.startswith("in:"):
                        flat_x = flat_x if flat_x is not None else self.split.flatten_inputs(x)
                        available[key] = flat_x[int(key[3:])]
            inputs = {k: available[k] for k in stage.input_keys}
            call_state = self._call_state(s, state[s], row)  # the dropout context: tensors, traced as inputs
            outputs, new_state, losses = self._stage_call(replica, s, values, call_state, inputs, mode)
            if training:
                self._read[(replica, s, row)] = values  # what this micro-batch's backward differentiates
                for k in self._contexts[s]:  # a row offset is never written back
                    if dropout_lib.is_row_offset(stage.non_trainable_variables[k]):
                        new_state[k] = state[s][k]
                state[s] = new_state
            available.update(outputs)
            for extra in losses:  # Keras's _aggregate_additional_loss
                extra = tf.convert_to_tensor(extra)
                added += tf.cast(tf.reduce_sum(extra), tf.float32)
            if s < self.chunks - 1:
                # Through an identity: the next stage must differentiate this very tensor. A
                # row-parallel layer there would otherwise read a column layer's concat
                # inputs directly, and the concat handed on here would get no gradient.
                return [tf.identity(available[k]) for k in self.split.crossing(s)] + [added]
            if self.split is None:
                y_pred = available["y"]
            else:
                y_pred = self.split.pack_outputs([available[k] for k in self.split.output_keys])
            if mode == "predict":
                self._output_structure = y_pred  # structure only, to pack the flat outputs again
                return tf.nest.flatten(y_pred)
            return self._loss_and_metrics(x, y, sw, y_pred, added if losses or s > 0 else None, training)

    def _stage_call(self, replica: int, s: int, values, state, inputs, mode: str):
        """Stage ``s``'s forward on one micro-batch: ``(outputs, new state, added losses)``.
        Traced once per replica, stage and mode and called for each micro-batch when the
        stage reads no expert shard (:mod:`phalanx.parallel.stage_calls`)."""
        training = mode == "train"
        if training:
            runner, device = self.runners[s], self.stage_device(replica, s)

            def run(v, st, inp):
                return runner.apply(v, st, inp, True, device)
        else:
            stage = self.stages[s]

            def run(v, st, inp):
                return stage.apply(v, st, inp, False)
        if self.stage_calls is None:
            return run(values, state, inputs)
        return self.stage_calls.call((replica, s, training), run, values, state, inputs,
                                     device=self.stage_device(replica, s), backward=training)

    def _own_sources(self, params: list, replica: int, s: int, row: int) -> list:
        """What the backward of stage ``s`` on the micro-batch at ``row`` differentiates: the
        values its forward read (:func:`~phalanx.parallel.pipeline.run_schedule`'s ``sources``),
        except where every micro-batch reads one tensor (ZeRO-3's gathered weights, an expert
        shard's compute-dtype copy): ``params``."""
        values = self._read.pop((replica, s, row))
        if self.zero == 3:
            return params
        return [p if id(p) in self._casts else v for v, p in zip(values, params)]

    def _stage_values(self, replica: int, s: int) -> list[tf.Tensor]:
        """The values of stage ``s``'s trainable weights that ``replica`` computes with.

        Under ZeRO-3 each weight is gathered from its slices on the device that computes with
        it (a tensor shard on its rank's, an expert shard on its owner's in the replica's ep
        group), once per step, replica and stage: the first forward of the stage gathers, its
        later micro-batches and every backward read that tensor, so the gathered weights stay
        until the stage's last backward (they are not gathered again for the backward). The
        replicas of an ep group read one gathered expert shard, as they read one copy of it
        without ZeRO-3 (:meth:`_copy_owner`)."""
        stage = self.stages[s]
        if self.zero == 3:
            need, keys = [], []
            for v in stage.trainable_variables:
                key = (self._copy_owner(v, replica), s, id(v))
                if key not in self._gathered and key not in keys:
                    need.append(v)
                    keys.append(key)
            # (across workers one all-gather per stage and step: the cache keeps it for the other replicas)
            devices = [self.variable_device(v, replica, s) for v in need]
            for v, key, device, value in zip(need, keys, devices,
                                             self.slices.gather_many(need, devices, cache=self._gathered)):
                self._gathered[key] = self._with_compute_copy(v, value, device)
            return [self._gathered[(self._copy_owner(v, replica), s, id(v))] for v in stage.trainable_variables]
        values = []
        for v, param in zip(stage.trainable_variables, self._params(replica, s)):
            if placement_of(v) is None:
                values.append(tf.convert_to_tensor(param))
            else:  # a shard: its value carries its device, and the layer's ops follow it
                with tf.device(self.variable_device(v, replica, s)):
                    values.append(tf.identity(param))
                if id(param) in self._casts:  # the step's one compute-dtype copy of an expert shard
                    attach_compute_copy(values[-1], self._casts[id(param)])
        return values

    def _with_compute_copy(self, variable, value: tf.Tensor, device: str) -> tf.Tensor:
        """ZeRO-3: ``variable``'s gathered ``value`` on ``device``; an expert shard that a mixed
        policy computes in another dtype carries its cast, made there once
        (:func:`~phalanx.layers.moe.attach_compute_copy`): every replica and micro-batch of the ep
        group reads that one copy, as :meth:`_expert_casts` gives them without ZeRO-3."""
        if self._shard_dtypes is None:
            self._shard_dtypes = self._expert_dtypes()
        dtype = self._shard_dtypes.get(id(variable))
        if dtype is not None:
            with tf.device(device):
                attach_compute_copy(value, tf.cast(value, dtype))
        return value

    def _loss_and_metrics(self, x, y, sw, y_pred, added, training: bool):
        """The compiled loss and metrics of one micro-batch, as Keras's train/test step does."""
        model = self.model
        if self._custom_loss:  # a model that overrides compute_loss defines its own loss
            loss = model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sw, training=training)
        else:
            parts = []
            # (A nested y or sample weight goes Keras's own way: its packing rules, not repeated here.)
            shards = vocab_logit_shards(y_pred, self.mesh.tp) if self.vocab_loss and isinstance(y, tf.Tensor) \
                and not tf.nest.is_nested(sw) else None
            if shards is not None:
                parts.append(self._vocab_parallel_loss(y, y_pred, shards, sw))
            elif model._compile_loss is not None:
                compiled = model._compile_loss(y, y_pred, sw)
                if compiled is not None:
                    parts.append(compiled)
            if added is not None:  # the layers' add_loss terms (and a one-stage model's regularisers)
                parts.append(added)
            if self._reg_value is not None:
                parts.append(tf.stop_gradient(self._reg_value))  # its gradient is added once per step
            if not parts:
                raise ValueError(f"model {model.name!r} has no loss: compile it with loss=...")
            loss = tf.add_n([tf.cast(p, tf.float32) for p in parts])
        loss = tf.cast(loss, tf.float32)
        model._loss_tracker.update_state(loss, sample_weight=tf.shape(_first_tensor(x))[0])
        model.compute_metrics(x, y, y_pred, sample_weight=sw)
        return loss

    def _vocab_parallel_loss(self, y, y_pred, shards, sw):
        """The compiled ``SparseCategoricalCrossentropy(from_logits=True)`` of one micro-batch,
        as Keras's ``CompileLoss`` computes it on the joined ``y_pred``, from the head's shard
        logits: the per-token losses come from :func:`shard_logits_cross_entropy`, the rest
        (``ignore_class``, the output mask, sample weights, the reduction, ``loss_weights``) is
        Keras's code on them."""
        compile_loss = self.model._compile_loss
        _, loss_fn, loss_weight, _ = compile_loss._flat_losses[0]
        in_mask = get_keras_mask(y_pred)
        ignore = loss_fn._fn_kwargs.get("ignore_class")
        with tf.name_scope(compile_loss.name), tf.name_scope(loss_fn.name):
            labels = tf.cast(y, loss_fn.dtype)  # as Loss.__call__ (the op then casts to integers)
            if labels.shape.rank == y_pred.shape.rank and labels.shape[-1] == 1:  # as sparse_categorical_crossentropy
                labels = tf.squeeze(labels, axis=-1)
            valid = None
            if ignore is not None:
                valid = tf.not_equal(labels, tf.cast(ignore, labels.dtype))
                labels = tf.where(valid, labels, tf.zeros_like(labels))
            labels = tf.cast(labels, "int32")
            vocab = sum(int(z.shape[-1]) for z in shards)
            # Keras's SparseSoftmaxCrossEntropyWithLogits refuses such labels on a CPU; the shards
            # would silently give them the log-sum-exp alone.
            checks = [tf.debugging.assert_non_negative(labels, message=f"y: labels must be in [0, {vocab})"),
                      tf.debugging.assert_less(labels, vocab, message=f"y: labels must be in [0, {vocab})")]
            with tf.control_dependencies(checks):
                labels = tf.identity(labels)
            losses = shard_logits_cross_entropy(shards, labels)
            mask = in_mask
            if valid is not None:
                losses = tf.where(valid, losses, tf.zeros_like(losses))
                mask = valid if in_mask is None else tf.logical_and(tf.cast(in_mask, "bool"), valid)
            value = reduce_weighted_values(losses, sample_weight=sw, mask=mask, reduction=loss_fn.reduction,
                                           dtype=loss_fn.dtype)
        value = tf.cast(value, compile_loss.dtype)
        return value if loss_weight is None else value * loss_weight

    # -- steps ------------------------------------------------------------------------------

    def _expert_dtypes(self) -> dict[int, str]:
        """id(an expert shard's variable) -> the compute dtype of the
        :class:`~phalanx.layers.moe.MoE` layer that reads it, for the shards a mixed policy
        computes in a dtype other than their own."""
        dtypes = {}
        for layer in self.model._flatten_layers(include_self=False):
            if isinstance(layer, MoE):
                for v in layer.trainable_variables:
                    placement = placement_of(v)
                    if placement is not None and placement.axis == "expert" and \
                            tf.as_dtype(layer.compute_dtype) != tf.as_dtype(v.dtype):
                        dtypes[id(v)] = layer.compute_dtype
        return dtypes

    def _expert_casts(self, replicas: int) -> dict[int, tf.Tensor]:
        """id(a variable the replicas read for an expert shard) -> its value in the compute
        dtype of the :class:`~phalanx.layers.moe.MoE` layer that reads it, cast once for the
        step on the variable's device, for the shards a mixed policy computes in another dtype.

        Without it every replica of an ep group (and each of its micro-batches) cast the shard
        on the shard's device for its own call, and a device held a copy per call alive between
        its forward and its backward. Made before any replica's work, outside the pipeline's
        control dependencies, it is one tensor every call reads. Under ZeRO-3 there is no whole
        shard before its stage gathers it: the cast is made where it is gathered (:meth:`_gather`)."""
        casts: dict[int, tf.Tensor] = {}
        if self.zero == 3:
            return casts
        dtypes = self._expert_dtypes()
        for d in range(replicas):
            for s, stage in enumerate(self.stages):
                for v, param in zip(stage.trainable_variables, self._params(d, s)):
                    if id(v) in dtypes and id(param) not in casts:  # the replicas of a group share the variable
                        with tf.device(self.variable_device(v, d, s)):
                            casts[id(param)] = tf.cast(tf.convert_to_tensor(param), dtypes[id(v)])
        return casts

    def _weighted(self, out, stage: int, share: float):
        """The last stage's loss times its micro-batch's share of the rows (:func:`row_plan`)."""
        return out * share if stage == self.chunks - 1 and share != 1.0 else out

    def _schedule_of(self, microbatches: int):
        """The schedule for a step of ``microbatches`` micro-batches (fewer than configured only
        for a batch with fewer rows than micro-batches)."""
        if microbatches == self.microbatches:
            return self.schedule
        return schedule_for(self.cfg.replace(parallel={"microbatches": microbatches}), self.pp)

    def _micro_batches(self, batch, replica: int, per_replica: int, parts: int) -> list:
        size = per_replica // parts
        with tf.device(self.stage_device(replica, 0)):
            return [_slice(batch, replica * per_replica + i * size, size) for i in range(parts)]

    def _regularization(self):
        """(value, gradients) of the weight-regularisation loss of a cut model (under ZeRO-3:
        of the weights gathered on their home devices, gradients by id of each slice)."""
        sources = [v.value for v in self.regularized] if self.zero < 3 else \
            self.slices.gather_many(self.regularized, [self._reg_device(v) for v in self.regularized])
        with tf.GradientTape() as tape:
            tape.watch([t for t in sources if isinstance(t, tf.Tensor)])
            terms = []
            for v, source in zip(self.regularized, sources):
                with tf.device(self._reg_device(v)):
                    terms.append(tf.cast(v.regularizer(tf.convert_to_tensor(source)), tf.float32))
            value = tf.add_n(terms)
        return value, dict(zip([id(v) for v in self.regularized], tape.gradient(value, sources)))

    def _reg_device(self, v) -> str:
        """Where a regularised weight's penalty and its gradient are formed: the weight's device,
        or under ZeRO-3 its first slice's."""
        return v.value.device if self.zero < 3 else self._slice_devices(v)[0]

    def _train_step(self, x, y, sw, global_rows=None):
        batch = (x, y, sw)
        rows = _rows(x)
        total = self.dp * self.accum * self.microbatches
        plan = row_plan(rows, self.dp, self.accum, self.microbatches)
        # A micro-batch's loss is its mean: weighted by its share of the rows (1 when they divide
        # evenly). Across workers, of the global batch's ``global_rows`` (this worker's share may
        # differ from the others'); with rows * world == global_rows the same number as in one process.
        if global_rows is None or global_rows == rows * self.world:
            share = [[[n * total / rows for n in sizes] for sizes in steps] for steps in plan]
        else:
            share = [[[n * total * self.world / global_rows for n in sizes] for sizes in steps] for steps in plan]
        scale = tf.cast(self.optimizer.scale_loss(tf.constant(1.0)), tf.float32)
        metrics_before = None if self.workers is None else self.workers.read_metrics(self.model)
        self._reg_value, reg_grads = self._regularization() if self.regularized else (None, {})
        self._casts = self._expert_casts(self.dp)
        start = self._initial_state(training=True)
        self._step_start = start
        ends = []  # each replica's state after its micro-batches (parallel.replica_state)
        self._gathered, self._read = {}, {}
        acc = [[[] for _ in stage.trainable_variables] for stage in self.stages]
        losses = []
        first = 0
        # this worker's first row in the global batch (the workers take consecutive rows: local_rows)
        base = 0 if self.workers is None or global_rows is None else \
            sum(sum(map(sum, steps)) for steps in row_plan(global_rows, self.world, 1, 1)[:self.workers.rank])
        for d in range(self.dp):
            state = [list(values) for values in start]  # every replica from the step's starting state
            ends.append(state)
            params = [self._params(d, s) for s in range(self.chunks)]
            running = None  # the replica's gradient sums, carried through its accumulation steps
            for a in range(self.accum):
                if not plan[d][a]:
                    continue
                with tf.device(self.stage_device(d, 0)):
                    group, rows_at = [], []
                    for n in plan[d][a]:
                        group.append(_slice(batch, first, n))
                        rows_at.append(base + first)
                        first += n
                grads, loss_sum = run_schedule(
                    self._schedule_of(len(group)),
                    lambda s, i, h, _d=d, _g=group, _w=share[d][a], _st=state, _r=rows_at: self._weighted(
                        self._forward(_d, s, h, _g[i], _st, "train", _r[i]), s, _w[i]),
                    params, scale / float(total * self.world), prefix=f"dp{d}_acc{a}", keep_sparse=True,
                    initial=running,
                    sources=lambda s, i, _d=d, _r=rows_at: self._own_sources(params[s], _d, s, _r[i]))
                # One running sum per weight through the accumulation steps, and each step starts on a
                # rank once the previous one ended there (run_schedule's ``initial``): a replica holds
                # one step's activations and one gradient set, however many steps it accumulates.
                running = grads
                losses.append(loss_sum)
            for s, stage_grads in enumerate(running or []):
                for j, g in enumerate(stage_grads):
                    if g is not None:
                        acc[s][j].append((d, g))
        # Sum every variable's gradients over replicas and the stages that read it, on the
        # variable's own device (under ZeRO on each slice's: _sliced_gradients).
        grads, variables = [], []
        # ZeRO in one process: reduced into the slices here. Across workers each worker sums its
        # replicas' gradients whole, the exchange sums them over the workers and each device keeps
        # its slice of the sum (ZeroSlices.cut; module docstring).
        sliced_here = self.zero and self.workers is None
        if sliced_here:
            grads, variables = self._sliced_gradients(acc, reg_grads, scale), self.slices.flat
        parts: dict[int, list] = {}
        for s, stage in enumerate(self.stages):
            for j, v in enumerate(stage.trainable_variables):
                parts.setdefault(id(v), []).extend(g for _, g in acc[s][j])
        for v in (self.model.trainable_variables if not sliced_here else []):
            with tf.device(v.value.device):
                g = None
                for part in parts[id(v)]:  # sparse ones as one device's tape gives them (parallel.gradients)
                    g = join_gradients(g, part)
                if id(v) in reg_grads:
                    reg = tf.cast(reg_grads[id(v)], tf.float32) * scale / float(self.world)  # once over the workers
                    g = join_gradients(g, reg)
                # None: no stage used the weight this step; Keras's optimizer skips it, as in fit.
                grads.append(g)
            variables.append(v)
        loss_sum = tf.add_n(losses)
        rules = [[rule_of(v) for v in stage.non_trainable_variables] for stage in self.stages]
        state = []
        for s in range(len(self.stages)):  # the replicas' state joined once per step, by one rule
            with tf.device(self.stage_device(0, s)):
                state.append(combine_replicas(start[s], [end[s] for end in ends], rules[s]))
        if self.workers is not None:  # across workers: gradients, metrics, state by the same rule (keras_cluster)
            changed = [(s, k) for s, values in enumerate(state) for k, value in enumerate(values)
                       if value is not start[s][k]]
            grads, combined, loss_sum = self.workers.exchange(self.model, grads, metrics_before,
                                                              [state[s][k] for s, k in changed], loss_sum,
                                                              rules=[rules[s][k] for s, k in changed])
            for (s, k), value in zip(changed, combined):
                state[s][k] = value
        if self.zero and self.workers is not None:
            grads, variables = self.slices.cut(grads), self.slices.flat
        joined = grads
        grads = []
        for g, v in zip(joined, variables):
            with tf.device(v.value.device):
                grads.append(None if g is None else finish(g, v.dtype))
        # The whole update waits for every gradient of the step. Keras's AdamW decays each
        # weight first and needs no gradient for it, so the executor would run the decay as
        # soon as the forward read the weight, while that read is still held for the backward:
        # the decayed weight went to a new buffer (every weight held twice), and with pp > 1
        # the decay products of the first stage waited on the first device. Same values:
        # nothing writes a weight between the forward and here.
        with tf.control_dependencies([tf.group(*[t for g in grads if g is not None
                                                 for t in tf.nest.flatten(g, expand_composites=True)])]):
            if self.zero:
                self.slices.apply(grads)
            else:
                self.optimizer.apply(grads, variables)
        if self._after_update is not None:  # e.g. pruning's masks, on the weights (slices) just updated
            self._after_update()
        # TensorFlow orders ops on one variable as written: the copies read updated weights.
        self.refresh_copies()
        for s, stage in enumerate(self.stages):
            for v, new, old in zip(stage.non_trainable_variables, state[s], start[s]):
                if new is not old or is_step_total(v):  # totals: this step's, even if never added to
                    v.value.assign(tf.cast(new, v.value.dtype))
        self._reg_value, self._casts, self._gathered, self._step_start, self._read = None, {}, {}, None, {}
        with tf.device(self.stage_device(0, self.chunks - 1)):
            return {"loss": loss_sum / float(total * self.world)}

    def _sliced_gradients(self, acc, reg_grads, scale) -> list:
        """ZeRO: the gradient of every slice (aligned with ``self.slices.flat``), summed over
        replicas, stages and micro-batches. ``acc[s][j]``: ``(replica, gradient)`` of stage
        ``s``'s ``j``-th weight (under ZeRO-3 of its gathered value), formed on that replica's
        device for the weight: zero=1 sums them whole, zero=2/3 cut each where it was formed
        (the reduce-scatter)."""
        factor = scale / float(self.world)  # the regularisers' gradient, once over the workers
        parts: dict[int, list] = {}
        for s, stage in enumerate(self.stages):
            for j, v in enumerate(stage.trainable_variables):
                parts.setdefault(id(v), []).extend((self.variable_device(v, d, s), g) for d, g in acc[s][j])
        for v in self.regularized:
            parts.setdefault(id(v), []).append((self._reg_device(v), tf.cast(reg_grads[id(v)], tf.float32) * factor))
        return self.slices.reduce(parts)

    def _split_for_inference(self, rows: int) -> tuple[int, int]:
        """(replicas, micro-batches per replica) that divide an evaluation batch evenly."""
        if rows % (self.dp * self.microbatches) == 0:
            return self.dp, self.microbatches
        if rows % self.dp == 0:
            return self.dp, 1
        return 1, 1

    def _inference(self, batch, mode: str):
        replicas, parts = self._split_for_inference(_rows(batch[0]))
        state = self._initial_state()
        self._casts, self._gathered = self._expert_casts(replicas), {}
        results = []
        per_replica = _rows(batch[0]) // replicas
        for d in range(replicas):
            for i, micro in enumerate(self._micro_batches(batch, d, per_replica, parts)):
                carried, row = None, d * per_replica + i * (per_replica // parts)
                for s in range(self.chunks):
                    carried = self._forward(d, s, carried, micro, state, mode, row)
                results.append(carried)
        self._casts, self._gathered = {}, {}
        return results

    def _test_step(self, x, y, sw):
        self._reg_value = self._regularization()[0] if self.regularized else None
        losses = self._inference((x, y, sw), "test")
        self._reg_value = None
        with tf.device(self.stage_device(0, self.chunks - 1)):
            return {"loss": tf.add_n(losses) / float(len(losses))}

    def _predict_step(self, x):
        pieces = self._inference((x, None, None), "predict")
        with tf.device(self.stage_device(0, self.chunks - 1)):
            return [tf.concat([p[i] for p in pieces], axis=0) if len(pieces) > 1 else pieces[0][i]
                    for i in range(len(pieces[0]))]

    # -- public ------------------------------------------------------------------------------

    _reg_value: Any = None
    _after_update: Any = None

    def set_after_update(self, fn) -> None:
        """Run ``fn()`` inside every training step, after the optimizer updated the weights
        (under ZeRO the slices it updates, :attr:`slices`) and before the replicas' whole
        copies are refreshed from them, so the copies read what ``fn`` wrote: pruning
        multiplies the updated weights by its masks there. ``None`` removes it; the step is
        traced again at its next call.

        Example:
            >>> engine.set_after_update(lambda: kernel.assign(kernel * mask))  # doctest: +SKIP
        """
        self._after_update = fn
        self._train_fn = tf.function(self._train_step, autograph=False)

    def train_step(self, batch) -> dict[str, tf.Tensor]:
        """One optimizer step on a global batch ``(x, y, sample_weight)``; updates the
        compiled metrics; returns ``{"loss": mean loss of the batch}``. Across workers
        every worker passes the same global batch and trains on its own rows of it."""
        if self.workers is None:
            with glue_options() if self.stage_calls is not None else contextlib.nullcontext():
                return self._train_fn(*_as_tensors(batch))
        rows = _rows(batch[0])
        batch = self.workers.local_rows(batch, rows)
        # The global row count is a Python value: one trace per (local, global) batch shape.
        with glue_options() if self.stage_calls is not None else contextlib.nullcontext():
            result = self._train_fn(*_as_tensors(batch), rows)
        self.workers.check_batch()
        return result

    def sync_copies(self, from_slices: bool = False) -> None:
        """Refresh the replicas' weight copies after the model's weights were assigned
        outside a step (a restored checkpoint, the chief's broadcast weights); under ZeRO cut
        the model's weights and ``model.optimizer``'s state into the slices again, or with
        ``from_slices`` (a checkpoint restored into the slices themselves) leave the slices as
        they are and refresh the whole copies from them."""
        if self.slices is not None and not from_slices:
            self.slices.load()
            if self.workers is not None:
                # The model's whole weights are the same on every worker: the replicas copy them, with no
                # collective (a worker may call this alone: the chief after writing a checkpoint).
                for v in (self.model.trainable_variables if self.zero < 3 else []):
                    for copy in self._whole_copies(v)[1:]:
                        copy.assign(v.value)
                return
        self.refresh_copies()

    def gather_state(self) -> None:
        """Under ZeRO: write the sliced weights and optimizer state into the model's weights
        and ``model.optimizer``'s variables (before a checkpoint is saved, at an epoch's end, after
        the fit). Without ZeRO they are the state itself: nothing to do."""
        if self.slices is not None:
            self.slices.store(weights=self.zero == 3)

    # -- checkpoints ---------------------------------------------------------------------------

    def checkpoint_slots(self, parts: dict | None = None, scalars: dict | None = None,
                         extra=()) -> list:
        """The state as one checkpoint shard set per device (:mod:`phalanx.engines.keras_slots`):
        each variable's part of a logical tensor a slot by logical name and box, written from the
        device that holds it (under ZeRO the slices, by flat range), its optimizer slots beside it
        as ``optimizer/<slot>/<name>``. ``parts``: logical name -> ``[(variable, box)]`` (default:
        every model variable by its Keras path, :func:`~phalanx.engines.keras_slots.logical_parts`);
        ``scalars``: name -> variable, on the first device (default: the optimizer's own);
        ``extra``: more ``(device, slot)`` pairs. After loading a checkpoint into the slots, call
        :meth:`restored`."""
        if parts is None:
            parts = keras_slots.logical_parts(self.model)
        return keras_slots.shard_sets(self, parts, scalars, list(extra))

    def restored(self) -> None:
        """After :meth:`checkpoint_slots` were loaded: the replicas' copies follow the restored
        weights; under ZeRO (the slots were the slices) the whole copies, the model's weights and
        ``model.optimizer``'s state follow the slices."""
        if keras_slots.saved_slices(self) is None:  # (across workers the slots were whole)
            self.sync_copies()
        else:
            self.sync_copies(from_slices=True)
            self.gather_state()

    def refresh_copies(self) -> None:
        """Every replica's whole weight copy from the weights the optimizer updates: without
        ZeRO from the model's weights, at ZeRO-1/2 from the slices (an all-gather); at ZeRO-3
        there are none. For weights changed in place between steps (pruning's masks)."""
        if self.slices is not None:  # ZeRO-1/2: every whole copy from the updated slices (all-gather)
            if self.zero < 3:
                self.slices.refresh(self._whole_copies)
            return
        done = set()  # an expert shard's copy is shared by the replicas of its group
        for (d, s), copies in self.copies.items():
            for copy, v in zip(copies, self.stages[s].trainable_variables):
                if copy is not None and id(copy) not in done:
                    done.add(id(copy))
                    copy.assign(v.value)

    def _whole_copies(self, variable) -> list:
        """Every whole copy of ``variable`` a replica reads: the variable itself (replica 0)
        and the replicas' copies and stage mirrors, each once."""
        out, seen = [variable.value], {id(variable.value)}
        for (d, s), copies in self.copies.items():
            for copy, v in zip(copies, self.stages[s].trainable_variables):
                if v is variable and copy is not None and id(copy) not in seen:
                    seen.add(id(copy))
                    out.append(copy)
        return out

    def test_step(self, batch) -> dict[str, tf.Tensor]:
        """Loss and compiled metrics of a batch, weights unchanged."""
        return self._test_fn(*_as_tensors(batch))

    def predict_step(self, x) -> list[tf.Tensor]:
        """The model's outputs for ``x``, flattened; :meth:`pack_outputs` restores the
        structure ``model(x)`` returns."""
        return self._predict_fn(tf.nest.map_structure(_to_tensor, x))

    def pack_outputs(self, flat: list):
        return tf.nest.pack_sequence_as(self._output_structure, list(flat))


def _to_tensor(t):
    return t if t is None or isinstance(t, tf.Tensor) else tf.convert_to_tensor(t)


def _as_tensors(batch):
    x, y, sw = batch
    return (tf.nest.map_structure(_to_tensor, x), tf.nest.map_structure(_to_tensor, y),
            None if sw is None else tf.nest.map_structure(_to_tensor, sw))
