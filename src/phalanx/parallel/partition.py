"""The cost-balanced cut of a chain of layers into pipeline stages.

:func:`partition` cuts a chain of layers into ``pp x virtual_stages`` contiguous
chunks minimising the most expensive chunk, with the embedding counted on the first
chunk and the head on the last (Lingvo's cost-balanced partitioner idea). The Keras graph
splitter cuts a model with it over estimated layer FLOPs, recomputation cuts a stage into
pieces with it, and the planner predicts the engine's cut with it over
:func:`phalanx.core.costs.layer_costs`.
Plain Python: no TensorFlow.

Example:
    >>> partition([1.0, 1.0, 1.0, 1.0], chunks=2, first_extra=0.0, last_extra=2.0)
    [(0, 3), (3, 4)]
"""

from __future__ import annotations

from typing import Sequence


def partition(costs: Sequence[float], chunks: int, first_extra: float = 0.0,
              last_extra: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` layer ranges, one per chunk, each non-empty.

    Minimises the largest chunk cost, where chunk 0 also pays ``first_extra`` (the
    embedding) and the last chunk ``last_extra`` (the head and loss); ties prefer
    earlier cuts. Exact dynamic programme, O(chunks x layers^2).
    """
    n = len(costs)
    if chunks < 1 or chunks > n:
        raise ValueError(f"cannot cut {n} layers into {chunks} non-empty pipeline chunks; "
                         f"need 1 <= pp x virtual_stages <= {n}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))

    def cost(k: int, a: int, b: int) -> float:
        extra = (first_extra if k == 0 else 0.0) + (last_extra if k == chunks - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    # best[k][b]: minimal max cost covering layers [0, b) with chunks 0..k
    best = [[inf] * (n + 1) for _ in range(chunks)]
    cut = [[0] * (n + 1) for _ in range(chunks)]
    for b in range(1, n + 1):
        best[0][b] = cost(0, 0, b)
    for k in range(1, chunks):
        for b in range(k + 1, n + 1):
            for a in range(k, b):
                value = max(best[k - 1][a], cost(k, a, b))
                if value < best[k][b] - 1e-12:
                    best[k][b], cut[k][b] = value, a
    bounds, b = [], n
    for k in range(chunks - 1, 0, -1):
        a = cut[k][b]
        bounds.append((a, b))
        b = a
    bounds.append((0, b))
    return bounds[::-1]
