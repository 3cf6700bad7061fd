"""Refuse data that would train wrong, before it does: NaN or inf among the numbers, a label
outside the classes of a sparse cross-entropy (or a float label that is no class id), a token id
outside the model's vocabulary.

Each check is vectorised NumPy over an array once, in blocks of rows (so the temporary boolean
mask stays small beside a large array), and stops at the first bad value, which the error names
with its argument, its index and where it sits (``where(row)`` says which sample or batch).

Example:
    >>> import numpy as np
    >>> check_finite(np.array([[1.0, 2.0], [3.0, np.nan]]), "x", lambda row: f"sample {row}")
    Traceback (most recent call last):
    ...
    ValueError: x: nan at [1, 1] (sample 1); NaN and inf train every weight to NaN: repair or drop those samples before training
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

BLOCK_ELEMENTS = 1 << 22  # elements per block: a 4 MB mask whatever the array's size


@dataclass(frozen=True)
class ClassLabels:
    """What a sparse cross-entropy needs of the targets at ``path`` (keys or indices into ``y``;
    ``()`` for a single target): integer class ids in ``[0, classes)`` (``classes`` None: not
    known, only ``>= 0`` is checked), or ``ignore_class``. ``loss`` and ``output`` name them."""

    path: tuple
    classes: int | None
    ignore_class: int | None
    loss: str
    output: str | None = None


def named_leaves(value, name: str) -> Iterator[tuple[str, object]]:
    """``(label, leaf)`` of a nest of arrays: ``x``, ``x['a']``, ``y[1]`` (None leaves skipped)."""
    if value is None:
        return
    if isinstance(value, dict):
        for key, item in value.items():
            yield from named_leaves(item, f"{name}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from named_leaves(item, f"{name}[{i}]")
    else:
        yield name, value


def _first(array: np.ndarray, bad: Callable[[np.ndarray], np.ndarray]) -> tuple[int, ...] | None:
    """The index of the first element where ``bad`` holds, or None."""
    if array.size == 0:
        return None
    if array.ndim == 0:
        return () if bool(bad(array)) else None
    rows = max(1, BLOCK_ELEMENTS // max(1, array.size // array.shape[0]))
    for start in range(0, array.shape[0], rows):
        mask = bad(array[start:start + rows])
        if mask.any():
            index = np.unravel_index(int(np.argmax(mask)), mask.shape)
            return (int(index[0]) + start,) + tuple(int(i) for i in index[1:])
    return None


def _shown(index: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(i) for i in index) + "]"


def check_finite(array: np.ndarray, name: str, where: Callable[[int], str]) -> None:
    """ValueError naming ``name``, the index and ``where(row)`` of the first NaN or inf of a
    floating-point ``array`` (other dtypes hold no such value)."""
    array = np.asarray(array)
    if array.dtype.kind not in "fc":
        return
    index = _first(array, lambda block: ~np.isfinite(block))
    if index is not None:
        raise ValueError(f"{name}: {array[index]} at {_shown(index)} ({where(index[0] if index else 0)}); NaN and inf "
                         f"train every weight to NaN: repair or drop those samples before training")


def check_class_ids(array: np.ndarray, name: str, rule: ClassLabels, where: Callable[[int], str]) -> None:
    """ValueError naming ``name``, the value, its index and ``where(row)`` of the first label
    that is not a class id of ``rule``: not an integer, below 0, or ``>= rule.classes`` (a
    label equal to ``rule.ignore_class`` is allowed)."""
    array = np.asarray(array)
    if array.dtype.kind not in "biuf":
        return
    valid = f"[0, {rule.classes})" if rule.classes is not None else "[0, number of classes)"
    ignore = "" if rule.ignore_class is None else f" (or ignore_class={rule.ignore_class})"
    output = f" on output {rule.output!r}" if rule.output else ""
    if array.dtype.kind == "f":
        index = _first(array, lambda block: np.isfinite(block) & (block != np.floor(block)))
        if index is not None:
            raise ValueError(f"{name}: {array[index]} at {_shown(index)} ({where(index[0] if index else 0)}) is not a "
                             f"class id: {rule.loss}{output} takes integer labels in {valid}{ignore}")

    def outside(block):
        wrong = block < 0
        if rule.classes is not None:
            wrong |= block >= rule.classes
        if rule.ignore_class is not None:
            wrong &= block != rule.ignore_class
        return wrong

    index = _first(array, outside)
    if index is not None:
        value = array[index]
        value = int(value) if float(value).is_integer() else value
        raise ValueError(f"{name}: label {value} at {_shown(index)} ({where(index[0] if index else 0)}) is outside "
                         f"the classes {valid}{ignore} of {rule.loss}{output}: use class ids below the number of "
                         f"the model's output units")


def resolve(structure, path: tuple, names: list[str] | None = None):
    """The leaf of ``structure`` at ``path`` (a key may index a list through ``names``, the
    model's output names, and an index a dict), or None if there is none."""
    for key in path:
        if isinstance(structure, dict):
            if isinstance(key, int) and names and key < len(names):
                key = names[key]
            structure = structure.get(key)
        elif isinstance(structure, (list, tuple)):
            if isinstance(key, str):
                if not names or key not in names:
                    return None
                key = names.index(key)
            if not isinstance(key, int) or key >= len(structure):
                return None
            structure = structure[key]
        else:
            return None
    if isinstance(structure, (list, tuple)) and len(structure) == 1 and not path:
        structure = structure[0]
    return None if isinstance(structure, (dict, list, tuple)) else structure


def check_token_ids(array: np.ndarray, vocab: int, key: str, where: Callable[[tuple[int, ...]], str]) -> str | None:
    """The message for the first id of ``array`` outside ``[0, vocab)`` (``where(index)``
    says in which file it is), or None when every id is one of the vocabulary's."""
    array = np.asarray(array)
    index = _first(array, lambda block: (block < 0) | (block >= vocab))
    if index is None:
        return None
    return (f"token id {int(array[index])} ({where(index)}) is outside [0, {key}={vocab}): the data was prepared "
            f"for another vocabulary or is damaged; prepare it again (phalanx data prepare) or raise {key}")
