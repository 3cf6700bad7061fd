"""Boxes: rectangular regions of an n-dimensional tensor, ``((start, stop), ...)`` per axis.

A sharded checkpoint stores every piece of a logical tensor with the box it covers,
and a restore asks for the boxes each device needs; the reader copies
``intersect(stored, wanted)`` from every stored piece that overlaps. A 0-d tensor's
box is ``()``.

Example:
    >>> full((4, 6))
    ((0, 4), (0, 6))
    >>> intersect(((0, 4), (0, 3)), ((2, 4), (2, 6)))
    ((2, 4), (2, 3))
    >>> relative(((2, 4), (2, 3)), ((0, 4), (2, 6)))
    ((2, 4), (0, 1))
    >>> first_overlap([((0, 4), (0, 3)), ((2, 4), (2, 6))])
    (((0, 4), (0, 3)), ((2, 4), (2, 6)))
    >>> [(start, box) for start, box in flat_boxes((3, 4), 2, 11)]
    [(2, ((0, 1), (2, 4))), (4, ((1, 2), (0, 4))), (8, ((2, 3), (0, 3)))]
"""

from __future__ import annotations

import math

Box = tuple[tuple[int, int], ...]


def full(shape) -> Box:
    """The box of a whole tensor of ``shape``."""
    return tuple((0, int(n)) for n in shape)


def shape_of(box: Box) -> tuple[int, ...]:
    return tuple(b - a for a, b in box)


def volume(box: Box) -> int:
    return math.prod(b - a for a, b in box)


def intersect(a: Box, b: Box) -> Box | None:
    """The common part of two boxes of the same tensor, or None if they do not overlap."""
    out = tuple((max(x0, y0), min(x1, y1)) for (x0, x1), (y0, y1) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) else None


def relative(box: Box, origin: Box) -> Box:
    """``box`` in the coordinates of a box ``origin`` that contains it."""
    return tuple((a - o, b - o) for (a, b), (o, _) in zip(box, origin))


def translate(box: Box, offset) -> Box:
    """``box`` moved by ``offset`` (one integer per axis)."""
    return tuple((a + d, b + d) for (a, b), d in zip(box, offset))


def index(box: Box) -> tuple[slice, ...]:
    """NumPy index of ``box``: ``array[index(box)]`` is a view (``...`` for a 0-d box, whose
    ``()`` index would give a scalar)."""
    return tuple(slice(a, b) for a, b in box) if box else (Ellipsis,)


def contains(outer: Box, inner: Box) -> bool:
    return len(outer) == len(inner) and all(o0 <= i0 and i1 <= o1 for (o0, o1), (i0, i1) in zip(outer, inner))


def first_overlap(found: list[Box]) -> tuple[Box, Box] | None:
    """Two boxes of ``found`` (of one tensor) that overlap, or None: a sweep along the first
    axis, so a tensor's hundreds of ZeRO pieces cost about one comparison each.

    Example:
        >>> first_overlap([((0, 2), (0, 4)), ((2, 4), (0, 4))]) is None
        True
        >>> first_overlap([((0, 2), (0, 4)), ((2, 4), (0, 4)), ((1, 3), (3, 4))])
        (((0, 2), (0, 4)), ((1, 3), (3, 4)))
    """
    if any(not box for box in found):  # a scalar's boxes: any two overlap
        return (found[0], found[1]) if len(found) > 1 else None
    active: list[Box] = []
    for box in sorted(found):
        active = [a for a in active if a[0][1] > box[0][0]]
        for other in active:
            if intersect(other, box) is not None:
                return other, box
        active.append(box)
    return None


def flat_boxes(shape, lo: int, hi: int) -> list[tuple[int, Box]]:
    """Cut the row-major flat range ``[lo, hi)`` of a tensor of ``shape`` into boxes, each
    contiguous in flat order: ``(flat start, box)``, in order (at most ``2 x ndim - 1``).

    ZeRO keeps optimizer states as flat pieces of flattened shards; this maps such a
    piece back to boxes of the shard.
    """
    shape = tuple(int(n) for n in shape)
    if lo >= hi:
        return []
    if not shape:
        return [(0, ())]
    if len(shape) == 1:
        return [(lo, ((lo, hi),))]
    stride = math.prod(shape[1:])
    rest = full(shape[1:])
    first, last = lo // stride, (hi - 1) // stride
    if first == last:
        return [(first * stride + s, ((first, first + 1),) + b)
                for s, b in flat_boxes(shape[1:], lo - first * stride, hi - first * stride)]
    out = []
    start_full, end_full = first, last + 1
    if lo % stride:
        out += [(first * stride + s, ((first, first + 1),) + b) for s, b in flat_boxes(shape[1:], lo % stride, stride)]
        start_full = first + 1
    tail = []
    if hi % stride:
        tail = [(last * stride + s, ((last, last + 1),) + b) for s, b in flat_boxes(shape[1:], 0, hi % stride)]
        end_full = last
    if start_full < end_full:
        out.append((start_full * stride, ((start_full, end_full),) + rest))
    return out + tail


def to_json(box: Box) -> list[list[int]]:
    return [[a, b] for a, b in box]


def from_json(value) -> Box:
    """A box read from an index file; raises ValueError if it is not ``[[start, stop], ...]``."""
    if not isinstance(value, list) or not all(
            isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
            and 0 <= p[0] <= p[1] for p in value):
        raise ValueError(f"not a box [[start, stop], ...]: {value!r}")
    return tuple((a, b) for a, b in value)
