"""What phalanx's engines run, as the planner needs to know it.

The planner can model more than the engines run (ZeRO-3, the ``zb`` schedule,
sequence parallelism, mixture of experts). Such a layout is *plan only*: shown in its
own labelled list, never proposed as the best. What is runnable is read from the
engine's own rules, not restated here:

* ZeRO stages and schedules: the values :func:`phalanx.config.validate` accepts for
  ``parallel.zero`` and ``parallel.schedule`` (the same checks the engine relies on);
* the stage split: the engine's cost-balanced :func:`phalanx.parallel.pipeline.partition`
  over :func:`phalanx.parallel.mesh_engine.layer_costs` (FLOPs per token of each block,
  the embedding and the head), not equal layer counts;
* gradient reduction: the single-process mesh engine (and ``MirroredStrategy`` with
  ``ReductionToOneDevice``) sums each shard's replicas with ``add_n`` on one device and
  every replica reads the sum back (reduce-to-one + broadcast); ZeRO-2 reduce-scatters
  directly (replica ``d`` sums piece ``d``); only ``parallel.strategy=multi_worker``
  uses ``MultiWorkerMirroredStrategy``'s collective RING all-reduce.

Example:
    >>> from phalanx.plan.arithmetic import ModelSpec
    >>> from phalanx.plan.layout import Layout
    >>> m = ModelSpec(layers=4, d_model=64, heads=4, vocab=256, seq_len=32)
    >>> plan_only_reasons(m, Layout(dp=2, zero=3))
    ['ZeRO-3 (the engine runs parallel.zero 0, 1, 2)']
    >>> plan_only_reasons(m, Layout(dp=2, zero=2))
    []
    >>> engine_zero_stages(), engine_schedules()
    ((0, 1, 2), ('gpipe', '1f1b', 'interleaved'))
"""

from __future__ import annotations

from functools import lru_cache

from phalanx.config import SCHEDULES, ConfigError, from_dict


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
    """ZeRO stages ``parallel.zero`` accepts (probed from the config's own validation)."""
    return tuple(z for z in range(4) if _config_accepts("parallel.zero", z))


def engine_schedules() -> tuple[str, ...]:
    """Pipeline schedules ``parallel.schedule`` accepts (the executor's list)."""
    return tuple(SCHEDULES)


def plan_only_reasons(m, lay) -> list[str]:
    """Why the engine cannot run layout ``lay`` of model ``m`` (empty: it can)."""
    reasons = []
    if lay.zero not in engine_zero_stages():
        reasons.append(f"ZeRO-{lay.zero} (the engine runs parallel.zero {', '.join(map(str, engine_zero_stages()))})")
    if lay.pp > 1 and lay.schedule not in engine_schedules():
        reasons.append(f"the {lay.schedule} schedule (the executor runs {', '.join(engine_schedules())})")
    if lay.sequence_parallel:
        reasons.append("sequence parallelism (not in the mesh engine)")
    if m.experts:
        reasons.append("mixture of experts (no MoE layers in the engine)")
    mesh_engine = lay.tp > 1 or lay.pp > 1 or lay.zero > 0 or lay.recompute != "none"
    if m.dropout > 0 and mesh_engine:
        reasons.append("dropout with tp/pp/ZeRO/recompute (the mesh engine refuses model.dropout > 0)")
    return reasons


def divisibility_reason(m, tp: int) -> str | None:
    """The engine's tensor-parallel rule (``phalanx.parallel.tensor.check_tp``): tp divides
    heads, ffn and vocab."""
    for key, value in (("model.heads", m.heads), ("model.ffn", m.ffn_dim), ("model.vocab", m.vocab)):
        if value % tp:
            return f"tp={tp} does not divide {key}={value}"
    return None


@lru_cache(maxsize=4096)
def stage_bounds(m, pp: int, virtual_stages: int = 1) -> tuple[tuple[int, int], ...]:
    """``[start, end)`` blocks of each model stage, cut exactly as the mesh engine cuts them.

    The engine balances stages by forward FLOPs per token (the embedding on the first
    stage, the head and loss on the last), so the last stage usually holds fewer blocks.
    Dense models use the engine's own ``layer_costs``; a mixture-of-experts model (plan
    only) uses the planner's per-block FLOPs with the same partitioner.

    >>> from phalanx.plan.arithmetic import ModelSpec
    >>> stage_bounds(ModelSpec(layers=8, d_model=64, heads=4, vocab=4096, seq_len=32), 2)  # a heavy head
    ((0, 7), (7, 8))
    """
    # Imported here: both modules import TensorFlow, which plain arithmetic does not need.
    from phalanx.parallel.mesh_engine import layer_costs
    from phalanx.parallel.pipeline import partition

    chunks = pp * virtual_stages
    costs, embed, head = layer_costs(m)
    if m.experts:
        from phalanx.plan.arithmetic import layer_forward_flops_per_token

        costs = [layer_forward_flops_per_token(m, bool(m.experts and (i + 1) % m.moe_every == 0))
                 for i in range(m.layers)]
    try:
        return tuple(partition(costs, chunks, embed, head))
    except ValueError as err:
        raise ValueError(str(err)) from None
