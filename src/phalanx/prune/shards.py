"""Magnitude masks computed shard by shard: no process joins a whole weight to prune it.

An engine's prunable weights are seen as :class:`WeightShard` objects (:func:`weight_shards`):
the local array a device holds, the boxes of the logical tensor it holds, and how to
install that part of the mask. :func:`shard_masks` yields each shard's 0/1 mask equal,
element for element, to the whole-tensor rule of :func:`phalanx.prune.unstructured_mask`
/ :func:`phalanx.prune.nm_mask`:

* unstructured (one threshold per logical tensor): the ``k = round(s x size)``-th smallest
  ``|w|`` is found by radix selection over the shards' float32 bit patterns
  (:func:`phalanx.prune.select.kth_smallest`), the entries below it are zeroed and, of
  those equal to it, the ones with the lowest logical flat index until ``k`` are zeroed
  (a second selection over the ties' indices, only when some ties stay) -- the order of
  a stable sort of the whole tensor;
* ``N:M`` (groups of M along the input axis): each shard alone, whenever its boxes start
  and end on group boundaries along that axis (every GPT split does when M divides the
  shard's rows); otherwise that one tensor is joined on the host (its shards straddle groups).

Every pass walks the shards one at a time and each shard in chunks of :data:`CHUNK`
elements, so the host holds one shard, its mask and a chunk's temporaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from phalanx.checkpoint import boxes
from phalanx.checkpoint.boxes import Box
from phalanx.config import ConfigError
from phalanx.prune.select import kth_smallest

#: elements per chunk of a shard in every pass (its keys and temporaries: about 1 MiB)
CHUNK = 1 << 16


@dataclass
class WeightShard:
    """The part of logical weight ``name`` (``shape``) that one device holds.

    ``regions`` pairs boxes of the local array with boxes of the logical tensor;
    ``fetch()`` returns the local array (a host copy); ``install(mask)`` installs the local
    0/1 ``mask``: the engine zeroes the masked weights (every copy and replica) and their
    moments on the devices, and keeps them zero from now on.
    """

    name: str
    shape: tuple[int, ...]
    regions: list[tuple[Box, Box]]
    fetch: Callable[[], np.ndarray]
    install: Callable[[np.ndarray], None]


def weight_shards(engine, prunable: Callable[[str], bool]) -> dict[str, list[WeightShard]]:
    """The prunable weights of ``engine`` by name, each as the shards its devices hold.

    An engine with a ``weight_shards(prunable)`` method (the Keras GPT engine: one shard per
    variable holding a part of a weight) gives them; anything else is a ConfigError naming
    ``train.prune.target``.
    """
    if hasattr(engine, "weight_shards"):
        return engine.weight_shards(prunable)
    raise ConfigError("train.prune.target", f"{type(engine).__name__} cannot apply pruning masks; set "
                                            f"train.prune.target=0")


def distinct(shards: list[WeightShard]) -> list[WeightShard]:
    """The shards whose logical boxes no earlier shard holds (replicated parts counted once)."""
    seen, out = set(), []
    for s in shards:
        held = tuple(logical for _, logical in s.regions)
        if held not in seen:
            seen.add(held)
            out.append(s)
    return out


def _chunks(region: np.ndarray) -> Iterator[tuple[int, np.ndarray]]:
    """``(first row, view)`` pieces of ``region`` along axis 0, about :data:`CHUNK` elements each."""
    if region.ndim == 0:
        yield 0, region.reshape(1)
        return
    row = max(1, math.prod(region.shape[1:]))
    step = max(1, CHUNK // row)
    for r in range(0, region.shape[0], step):
        yield r, region[r:r + step]


def _keys(chunk: np.ndarray) -> np.ndarray:
    """uint32 keys ordered as ``|chunk|`` (the bit pattern of a non-negative float32)."""
    return np.abs(np.asarray(chunk, np.float32)).view(np.uint32)


def _flat_index(where: tuple[np.ndarray, ...], start: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    """Logical flat indices of local coordinates ``where`` of a chunk starting at ``start``."""
    coords = tuple(w + s for w, s in zip(where, start))
    return np.ravel_multi_index(coords, shape).astype(np.uint64) if shape else np.zeros(len(where[0]), np.uint64)


def _walk(shards: list[WeightShard], fetched: np.ndarray | None = None, shard: WeightShard | None = None):
    """``(local box, chunk's first row, chunk, logical start of the chunk)`` over every chunk
    of every region of ``shards`` (or of one ``shard`` already ``fetched``)."""
    for s in ([shard] if shard is not None else shards):
        w = fetched if shard is not None else s.fetch()
        for local, logical in s.regions:
            region = w[boxes.index(local)]
            for r, chunk in _chunks(region):
                start = tuple(a for a, _ in logical)
                start = (start[0] + r,) + start[1:] if start else start
                yield local, r, chunk, start


def _unstructured(shards: list[WeightShard], sparsity: float):
    shape = shards[0].shape
    size = math.prod(shape)
    k = int(round(sparsity * size))
    stats = distinct(shards)
    if k <= 0:
        for s in shards:
            yield s, np.ones(s.fetch().shape, np.float32)
        return

    def parts():
        for _, _, chunk, _ in _walk(stats):
            yield _keys(chunk)

    tau = np.uint32(kth_smallest(parts, k - 1, bits=32))
    less = equal = 0
    for _, _, chunk, _ in _walk(stats):
        keys = _keys(chunk)
        less += int(np.count_nonzero(keys < tau))
        equal += int(np.count_nonzero(keys == tau))
    del keys, chunk  # a view of that pass's fetched shard: it would live on through the next pass
    need = k - less  # of the entries equal to tau, the `need` lowest logical indices are zeroed
    cut = None
    if need < equal:
        def tie_indices():
            for _, _, chunk, start in _walk(stats):
                yield _flat_index(np.nonzero(_keys(chunk) == tau), start, shape)
        cut = np.uint64(kth_smallest(tie_indices, need - 1, bits=max(1, (size - 1).bit_length())))
    for s in shards:
        w = s.fetch()
        mask = np.ones(w.shape, np.float32)
        for local, r, chunk, start in _walk([], fetched=w, shard=s):
            keys = _keys(chunk)
            off = keys < tau
            ties = keys == tau
            if cut is None:
                off |= ties
            elif ties.any():
                where = np.nonzero(ties)
                chosen = _flat_index(where, start, shape) <= cut
                off[tuple(x[chosen] for x in where)] = True
            view = mask[boxes.index(local)]
            (view.reshape(1) if view.ndim == 0 else view[r:r + len(chunk)])[off] = 0.0
        del w, keys, off, ties, chunk, view  # the host holds the mask alone while it is installed
        yield s, mask
        del mask  # before the next shard's: one mask at a time


def _aligned(shard: WeightShard, m: int) -> bool:
    """Whether every box of ``shard`` starts and ends on an M-group boundary along axis -2."""
    return all(len(logical) >= 2 and logical[-2][0] % m == 0 and logical[-2][1] % m == 0
               for _, logical in shard.regions)


def _join(shards: list[WeightShard]) -> np.ndarray:
    whole = np.empty(shards[0].shape, np.float32)
    for s in distinct(shards):
        w = s.fetch()
        for local, logical in s.regions:
            whole[boxes.index(logical)] = w[boxes.index(local)]
    return whole


def _n_m(shards: list[WeightShard], zeros: int, m: int, nm_mask):
    if all(_aligned(s, m) for s in shards):
        for s in shards:
            w = s.fetch()
            mask = np.ones(w.shape, np.float32)
            for local, _ in s.regions:
                region = w[boxes.index(local)]
                # groups run along axis -2, so column chunks of the last axis are independent
                cols = max(1, CHUNK // max(1, math.prod(region.shape[:-1])))
                for c in range(0, region.shape[-1], cols):
                    mask[boxes.index(local)][..., c:c + cols] = nm_mask(region[..., c:c + cols], zeros, m)
            del w, region
            yield s, mask
            del mask  # before the next shard's: one mask at a time
        return
    whole_mask = nm_mask(_join(shards), zeros, m)
    for s in shards:
        w = s.fetch()
        mask = np.ones(w.shape, np.float32)
        for local, logical in s.regions:
            mask[boxes.index(local)] = whole_mask[boxes.index(logical)]
        del w
        yield s, mask
        del mask  # before the next shard's: one mask at a time


def shard_masks(shards: list[WeightShard], sparsity: float, nm: tuple[int, int] | None, nm_mask):
    """``(shard, local 0/1 mask)`` for every shard of one logical
    weight: unstructured at ``sparsity`` (``nm`` None), or N:M with ``round(sparsity x M)``
    zeros per group (capped at ``M - N``); ``nm_mask`` is :func:`phalanx.prune.nm_mask`."""
    if nm is None:
        yield from _unstructured(shards, sparsity)
    else:
        n, m = nm
        yield from _n_m(shards, min(m - n, int(round(sparsity * m))), m, nm_mask)
