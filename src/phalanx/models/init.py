"""Seeded random tensors that any slice of can be made alone, identically in every layout.

A logical tensor is cut into fixed tiles (:data:`TILE_ROWS` along its first axis, and
:data:`TILE_COLS` along its last one when it has two or more; 1-d tensors in runs of
:data:`TILE_1D`); tile ``(i, j)`` of tensor ``name`` is drawn from its own stateless
generator seeded by ``(seed, hash(name), i, j)``. The tiles depend on the logical shape
only, so a device that holds a shard makes just the tiles that overlap it, and the
values equal those of the whole tensor made on one device: every parallel layout starts
from the same weights without any process building the whole model.

Example:
    >>> a = normal(0, "w", (300, 40), ((0, 300), (0, 40)), std=1.0)
    >>> b = normal(0, "w", (300, 40), ((130, 300), (10, 20)), std=1.0)
    >>> bool((a[130:300, 10:20] == b).all()), a.dtype.name
    (True, 'float32')
"""

from __future__ import annotations

import hashlib

import numpy as np

TILE_ROWS = 128
TILE_COLS = 512
TILE_1D = 65536


def name_key(name: str) -> int:
    """A stable 64-bit integer of a tensor name (the same in every process and run)."""
    return int.from_bytes(hashlib.blake2b(name.encode(), digest_size=8).digest(), "little")


def _tiles(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Tile extent per axis: rows on the first, columns on the last, middle axes whole."""
    if len(shape) == 0:
        return ()
    if len(shape) == 1:
        return (TILE_1D,)
    return (TILE_ROWS, *shape[1:-1], TILE_COLS)


def normal(seed: int, name: str, shape, box, std: float = 1.0) -> np.ndarray:
    """float32 ``N(0, std^2)`` values of ``box`` (``((start, stop), ...)``) of the logical
    tensor ``name`` of ``shape``; equal, element for element, whatever ``box`` is."""
    shape = tuple(int(n) for n in shape)
    box = tuple((int(a), int(b)) for a, b in box)
    out = np.empty(tuple(b - a for a, b in box), np.float32)
    if out.size == 0:
        return out
    key = name_key(name)
    if not shape:
        rng = np.random.default_rng([seed, key, 0, 0])
        out[...] = rng.standard_normal(dtype=np.float32) * np.float32(std)
        return out
    tiles = _tiles(shape)
    last = len(shape) - 1
    (r0, r1), (c0, c1) = box[0], box[last]
    for i in range(r0 // tiles[0], (r1 - 1) // tiles[0] + 1):
        t_r0, t_r1 = i * tiles[0], min((i + 1) * tiles[0], shape[0])
        cols = [0] if last == 0 else range(c0 // tiles[last], (c1 - 1) // tiles[last] + 1)
        for j in cols:
            tile_box = [(t_r0, t_r1)] + [(0, n) for n in shape[1:last]]
            if last:
                tile_box.append((j * tiles[last], min((j + 1) * tiles[last], shape[last])))
            rng = np.random.default_rng([seed, key, i, j])
            tile = rng.standard_normal([b - a for a, b in tile_box], dtype=np.float32)
            common = [(max(a, x), min(b, y)) for (a, b), (x, y) in zip(tile_box, box)]
            src = tuple(slice(a - t, b - t) for (a, b), (t, _) in zip(common, tile_box))
            dst = tuple(slice(a - o, b - o) for (a, b), (o, _) in zip(common, box))
            out[dst] = tile[src]
    out *= np.float32(std)
    return out
