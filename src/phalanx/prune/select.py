"""The k-th smallest of unsigned integer keys held in parts, without joining the parts.

:func:`kth_smallest` is a radix selection: a pass per 16-bit digit, from the highest,
counts the digit's values among the keys that share the prefix found so far (one
``bincount`` per chunk of every part, added up), and descends into the digit that holds
position ``k``. It is exact, needs ``ceil(bits / 16)`` passes over the parts and only a
histogram of 65,536 counts besides one chunk, whatever the parts' total size. Pruning
uses it to find a tensor's global magnitude threshold from its tensor-parallel shards:
the bit pattern of a non-negative float32 orders as the float does.

Example:
    >>> import numpy as np
    >>> keys = np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.uint64)
    >>> parts = lambda: iter([keys[:300], keys[300:]])
    >>> bool(kth_smallest(parts, 417, bits=32) == np.sort(keys)[417])
    True
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

#: bits decided per pass (a histogram of 2**DIGIT counts)
DIGIT = 16


def kth_smallest(parts: Callable[[], Iterable[np.ndarray]], k: int, bits: int) -> int:
    """The key at sorted position ``k`` (0-based) of all keys that ``parts()`` yields
    (called once per pass; each call yields the same arrays of unsigned keys < 2**bits,
    in any order). Raises IndexError if there are not more than ``k`` keys."""
    if k < 0:
        raise IndexError(f"position {k} < 0")
    prefix, shift = 0, bits
    while shift > 0:
        width = min(DIGIT, shift)
        shift -= width
        counts = np.zeros(1 << width, np.int64)
        for keys in parts():
            keys = np.asarray(keys).ravel()
            kind = keys.dtype.type  # shifts and masks in the keys' own width: no wider temporaries
            if shift + width < bits:  # only the keys whose higher digits are the prefix so far
                keys = keys[(keys >> kind(shift + width)) == kind(prefix)]
            counts += np.bincount((keys >> kind(shift)) & kind((1 << width) - 1), minlength=1 << width)
        below = np.cumsum(counts)
        if below[-1] <= k:
            raise IndexError(f"position {k} of {int(below[-1])} keys")
        digit = int(np.searchsorted(below, k, side="right"))  # the first digit whose count passes k
        k -= int(below[digit - 1]) if digit else 0
        prefix = (prefix << width) | digit
    return prefix
