"""What phalanx's engines run, as the planner needs to know it.

The planner can model more than the engines run (the ``zb`` schedule, sequence parallelism for
the mixture-of-experts GPT or without ``tp > 1`` dividing the sequence, and expert parallelism
across nodes that is not within each node, or with ZeRO). Such a layout is *plan only*: shown in its
own labelled list, never proposed as the best. What is runnable is read from the engines' own
rules where they can be probed:

* ZeRO stages and schedules: the values :func:`phalanx.config.validate` accepts for
  ``parallel.zero`` and ``parallel.schedule`` (the same checks the engine relies on). ZeRO-1/2/3
  (3: weights sliced too) run on the Keras-model engine
  (:class:`~phalanx.engines.keras_model.KerasModelEngine`, :mod:`phalanx.parallel.keras_zero`),
  ``phalanx train``'s for the built-in GPT and ``phalanx.fit``'s, in one process and across
  nodes (sliced over every worker's replicas), with expert parallelism too (in one node);
* the stage split: the engine's cost-balanced :func:`phalanx.parallel.partition.partition`
  over :func:`phalanx.core.costs.layer_costs` (FLOPs per token of each block,
  the embedding and the head), not equal layer counts;
* gradient reduction: in one process the engine sums each weight's replicas on the weight's
  own device (``add_n`` onto one device, every replica reads the sum back); ZeRO-2/3
  reduce-scatter (replica ``d`` sums slice ``d``); only ``parallel.strategy=multi_worker``
  sums across workers with TensorFlow's collective RING all-reduce (the engine's worker group,
  :mod:`phalanx.engines.keras_cluster`);
* the mixture-of-experts GPT: expert parallelism with tp, pp, ZeRO 1-3 and recomputation runs
  on the Keras-model engine; across nodes the experts are sharded within a node (ep divides a
  node's data replicas) and ZeRO is not combined with ep (:func:`plan_only_reasons`);
  ``tests/test_plan_engine.py`` builds the engine for each layout said to run.

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
    if lay.pp > 1 and lay.schedule not in engine_schedules():
        reasons.append(f"the {lay.schedule} schedule (the executor runs {', '.join(engine_schedules())})")
    if lay.sequence_parallel and (lay.tp < 2 or m.seq_len % lay.tp or m.experts):
        reasons.append("sequence parallelism without tp > 1 dividing the sequence, or with experts (the engine "
                       "runs it for the dense GPT)")
    if m.experts and lay.ep > 1 and hw is not None and lay.dp * lay.tp * lay.pp > hw.devices_per_node:
        # Across nodes (phalanx launch, multi_worker): parallel.* is each node's own layout, the
        # experts sharded over the node's own data replicas, the nodes data parallel.
        per_node = lay.tp * lay.pp
        local_dp = hw.devices_per_node // per_node if hw.devices_per_node % per_node == 0 else 0
        if not local_dp or local_dp % lay.ep or lay.dp % local_dp:
            reasons.append(f"expert parallelism parallel.ep={lay.ep} across nodes (phalanx train shards the "
                           f"experts within one node: ep must divide the data replicas of a node, "
                           f"{local_dp or 'none'} here)")
        elif lay.zero:
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
