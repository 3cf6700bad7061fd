"""What phalanx's engines run, as the planner needs to know it.

The planner can model more than the engines run (the ``zb`` schedule, sequence parallelism for
the mixture-of-experts GPT or without ``tp > 1`` dividing the sequence, ZeRO-3 across nodes,
and expert parallelism across nodes). Such a layout is *plan only*: shown in its
own labelled list, never proposed as the best. What is runnable is read from the engines' own
rules where they can be probed:

* ZeRO stages and schedules: the values :func:`phalanx.config.validate` accepts for
  ``parallel.zero`` and ``parallel.schedule`` (the same checks the engine relies on). ZeRO-1/2/3
  (3: weights sliced too) run on the Keras-model engine
  (:class:`~phalanx.engines.keras_model.KerasModelEngine`, :mod:`phalanx.parallel.keras_zero`),
  ``phalanx train``'s for the built-in GPT and ``phalanx.fit``'s, in one process and across
  nodes (:data:`KERAS_ZERO_ACROSS_NODES`), with expert parallelism up to :data:`KERAS_EP_ZERO`;
* the stage split: the engine's cost-balanced :func:`phalanx.parallel.partition.partition`
  over :func:`phalanx.core.costs.layer_costs` (FLOPs per token of each block,
  the embedding and the head), not equal layer counts;
* gradient reduction: in one process the engine sums each weight's replicas on the weight's
  own device (``add_n`` onto one device, every replica reads the sum back); ZeRO-2/3
  reduce-scatter (replica ``d`` sums slice ``d``); only ``parallel.strategy=multi_worker``
  sums across workers with TensorFlow's collective RING all-reduce (the engine's worker group,
  :mod:`phalanx.engines.keras_cluster`);
* the mixture-of-experts GPT: four flags, :data:`GPT_EXPERT_PARALLEL`, :data:`GPT_EP_WITH_TP_PP`,
  :data:`GPT_EP_WITH_ZERO` and :data:`GPT_EP_WITH_RECOMPUTE`, stated here because the refusals sit
  inside the engines' constructors; ``tests/test_plan_engine.py`` checks each against the engine's refusal,
  so when an engine learns one the test says which flag to flip.

Example:
    >>> from phalanx.core.costs import ModelSpec
    >>> from phalanx.plan.hardware import get_hardware
    >>> from phalanx.plan.layout import Layout
    >>> m = ModelSpec(layers=4, d_model=64, heads=4, vocab=256, seq_len=32)
    >>> plan_only_reasons(m, Layout(dp=2, zero=3)), plan_only_reasons(m, Layout(dp=2, zero=2))
    ([], [])
    >>> plan_only_reasons(m, Layout(dp=16, zero=3), get_hardware("a100-80gb"))   # 2 nodes of 8
    []
    >>> moe = ModelSpec(layers=4, d_model=64, heads=4, vocab=256, seq_len=32, experts=4)
    >>> plan_only_reasons(moe, Layout(dp=4)), plan_only_reasons(moe, Layout(dp=4, ep=2))
    ([], [])
    >>> plan_only_reasons(moe, Layout(dp=2, ep=2, zero=3))
    []
    >>> engine_zero_stages(), engine_schedules()
    ((0, 1, 2, 3), ('gpipe', '1f1b', 'interleaved'))
"""

from __future__ import annotations

from functools import lru_cache

from phalanx.config import ConfigError, SCHEDULES, from_dict
from phalanx.core.costs import layer_costs
from phalanx.parallel.partition import partition


# What the built-in GPT's engines run for a mixture-of-experts model (``model.experts``).
# Flip a flag when the engine runs it: the planner then proposes those layouts.
# True: `phalanx train` runs dp x ep for the MoE GPT (engines/factory.py build_engine routes
# parallel.ep > 1 to engines/keras_gpt.py KerasGPTEngine), in one process (its devices: one node).
GPT_EXPERT_PARALLEL = True
# True: that engine runs ep with tp and pp too (it cuts the GPT into tensor shards and stages).
GPT_EP_WITH_TP_PP = True
# True: that engine runs ep with ZeRO (the AdamW moments, at parallel.zero=2 the gradients, at 3
# the weights, cut into slices over the data replicas, engines/keras_model.py) up to KERAS_EP_ZERO.
GPT_EP_WITH_ZERO = True
# True: that engine runs ep with parallel.recompute=full|selective (parallel/recompute.py).
GPT_EP_WITH_RECOMPUTE = True
# The highest ZeRO stage the Keras-model engine runs with ep (at 3 an expert shard is gathered from
# its slices, one per ep group, on the group's replica that holds it: engines/keras_model.py), for
# phalanx train and phalanx.fit.
KERAS_EP_ZERO = 3
# True: the Keras-model engine runs ZeRO 1-3 across nodes: under parallel.strategy=multi_worker it
# slices over the data replicas of every worker (parallel/keras_zero.py: workers x local replicas
# slices, gradients all-reduced across workers and cut, slices all-gathered; engines/keras_cluster.py),
# and under parallel.strategy=mesh over the data replicas of a mesh spanning the workers' devices
# (tests/test_cluster_train.py), so ZeRO-3 layouts across nodes are not plan only. False would list
# them as "ZeRO-3 across nodes" again.
KERAS_ZERO_ACROSS_NODES = True


@lru_cache(maxsize=None)
def _config_accepts(key: str, value) -> bool:
    section, name = key.split(".")
    try:
        from_dict({section: {name: value}})
    except ConfigError:
        return False
    return True


@lru_cache(maxsize=None)
def engine_zero_stages() -> tuple[int, ...]:
    """ZeRO stages ``parallel.zero`` accepts (probed from the config's own validation): 0-3 on
    the Keras-model engine, ``phalanx train``'s and ``phalanx.fit``'s (:func:`plan_only_reasons`
    says where ZeRO-3 runs)."""
    return tuple(z for z in range(4) if _config_accepts("parallel.zero", z))


def engine_schedules() -> tuple[str, ...]:
    """Pipeline schedules ``parallel.schedule`` accepts (the executor's list)."""
    return tuple(SCHEDULES)


def plan_only_reasons(m, lay, hw=None) -> list[str]:
    """Why the engine cannot run layout ``lay`` of model ``m`` (empty: it can); with the
    :class:`~phalanx.plan.hardware.Hardware` ``hw``, also the layouts that would need one node to
    reach into another (experts sharded across nodes, ZeRO with ep across nodes)."""
    reasons = []
    if lay.zero not in engine_zero_stages():
        reasons.append(f"ZeRO-{lay.zero} (the engines run parallel.zero {', '.join(map(str, engine_zero_stages()))})")
    elif lay.zero == 3 and hw is not None and lay.devices > hw.devices_per_node and not KERAS_ZERO_ACROSS_NODES:
        reasons.append(f"ZeRO-3 across nodes ({lay.devices} devices, {hw.devices_per_node} per node: the "
                       f"Keras-model engine slices over the data replicas of one process)")
    if lay.pp > 1 and lay.schedule not in engine_schedules():
        reasons.append(f"the {lay.schedule} schedule (the executor runs {', '.join(engine_schedules())})")
    if lay.sequence_parallel and (lay.tp < 2 or m.seq_len % lay.tp or m.experts):
        reasons.append("sequence parallelism without tp > 1 dividing the sequence, or with experts (the engine "
                       "runs it for the dense GPT)")
    if m.experts and lay.ep > 1:
        if not GPT_EXPERT_PARALLEL:
            reasons.append(f"expert parallelism parallel.ep={lay.ep} for the built-in GPT (phalanx train refuses "
                           f"parallel.ep > 1: its experts train data parallel; ep runs for Keras models with "
                           f"phalanx.layers.MoE(ep=...) through phalanx.fit)")
        elif (lay.tp > 1 or lay.pp > 1) and not GPT_EP_WITH_TP_PP:
            reasons.append(f"expert parallelism parallel.ep={lay.ep} with tp/pp (phalanx train runs ep as dp x ep "
                           f"only)")
        elif (lay.zero > (KERAS_EP_ZERO if GPT_EP_WITH_ZERO else 0)
              or (lay.recompute != "none" and not GPT_EP_WITH_RECOMPUTE)):
            reasons.append(f"expert parallelism parallel.ep={lay.ep} with ZeRO-{lay.zero}/recompute "
                           f"{lay.recompute} (the engines run ep with dp, tp, pp"
                           f"{f' and ZeRO up to {KERAS_EP_ZERO}' if GPT_EP_WITH_ZERO else ''} only)")
        elif hw is not None and lay.dp * lay.tp * lay.pp > hw.devices_per_node:
            # Across nodes (phalanx launch, multi_worker): parallel.* is each node's own layout, the
            # experts sharded over the node's own data replicas, the nodes data parallel.
            per_node = lay.tp * lay.pp
            local_dp = hw.devices_per_node // per_node if hw.devices_per_node % per_node == 0 else 0
            if not local_dp or local_dp % lay.ep or lay.dp % local_dp:
                reasons.append(f"expert parallelism parallel.ep={lay.ep} across nodes (phalanx train shards the "
                               f"experts within one node: ep must divide the data replicas of a node, "
                               f"{local_dp or 'none'} here)")
            elif lay.zero and (lay.zero < 3 or KERAS_ZERO_ACROSS_NODES):  # (ZeRO-3 across nodes: said above)
                reasons.append(f"ZeRO-{lay.zero} with expert parallelism across nodes (the Keras-model engine "
                               f"slices expert shards over the replicas of one process only)")
    return reasons


def divisibility_reason(m, tp: int) -> str | None:
    """The engine's tensor-parallel rule (``phalanx.models.transformer.check_tp``): tp divides
    heads, ffn and vocab."""
    for key, value in (("model.heads", m.heads), ("model.ffn", m.ffn_dim), ("model.vocab", m.vocab)):
        if value % tp:
            return f"tp={tp} does not divide {key}={value}"
    return None


@lru_cache(maxsize=4096)
def stage_bounds(m, pp: int, virtual_stages: int = 1) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` blocks of each model stage, balanced by forward FLOPs per token as the
    engine balances its cut (:func:`phalanx.parallel.keras_graph.split_keras_model`,
    ``balance="flops"``; the embedding on the first stage, the head and loss on the last), so
    the last stage usually holds fewer blocks. The costs are
    :func:`phalanx.core.costs.layer_costs` (an expert block costs its ``top_k`` MLPs and
    router).

    >>> from phalanx.core.costs import ModelSpec
    >>> stage_bounds(ModelSpec(layers=8, d_model=64, heads=4, vocab=4096, seq_len=32), 2)  # a heavy head
    ((0, 7), (7, 8))
    """
    chunks = pp * virtual_stages
    costs, embed, head = layer_costs(m)
    try:
        return tuple(partition(costs, chunks, embed, head))
    except ValueError as err:
        raise ValueError(str(err)) from None
