"""Shard sets: what one device (or process) holds, written and read by logical name and box.

An engine describes its state as :class:`ShardSet` objects, one per device: each
:class:`Slot` is one local array (a tensor-parallel shard of a weight, a ZeRO piece of
an optimizer moment, a scalar) with the boxes of the *logical* tensor it holds. Saving
writes each shard set's slots into one data file of its own, one slot at a time (so a
writer holds one slot on the host, never the model), and returns index entries
``(name, box, file, offset)``; restoring fills each slot from the stored pieces that
overlap its boxes, whatever layout wrote them (:class:`ShardedReader` maps the data files
and copies only the overlaps).

File format (format 3, docs/checkpoint_format.md): ``shards/<set>.bin`` is the raw
C-order bytes of every piece written by that set, each starting at a multiple of
:data:`ALIGN` bytes; ``index.json`` gives, per logical tensor, its global shape and
dtype and where each piece lies.

Example:
    >>> import tempfile, numpy as np
    >>> from pathlib import Path
    >>> w = np.arange(12, dtype=np.float32).reshape(3, 4)
    >>> left = Slot("w", (3, 4), np.float32, (3, 2), [(((0, 3), (0, 2)), ((0, 3), (0, 2)))], lambda: w[:, :2])
    >>> right = Slot("w", (3, 4), np.float32, (3, 2), [(((0, 3), (0, 2)), ((0, 3), (2, 4)))], lambda: w[:, 2:])
    >>> d = Path(tempfile.mkdtemp())
    >>> parts = [write_shard_set(d, ShardSet("tp0", [left])), write_shard_set(d, ShardSet("tp1", [right]))]
    >>> reader = ShardedReader(d, build_index(parts))
    >>> reader.read("w", ((1, 3), (1, 3))).tolist()
    [[5.0, 6.0], [9.0, 10.0]]
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from phalanx.checkpoint import boxes
from phalanx.checkpoint.boxes import Box

#: sub-directory of a checkpoint holding the shard sets' data files
SHARDS = "shards"
#: every piece starts at a multiple of this many bytes in its data file
ALIGN = 64
#: dtypes a checkpoint may hold
DTYPES = ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool")
#: writer threads at most
MAX_THREADS = 8


@dataclass
class Slot:
    """One local array held by a device: part of logical tensor ``name``.

    ``regions`` pairs a box of the local array with the box of the logical tensor it
    holds (same shape); ``fetch()`` returns the local array now (a device tensor or a
    NumPy array); ``assign(array)`` loads it (restore). An ``optional`` slot keeps its
    value when a checkpoint lacks its tensor (pruning masks: a checkpoint written before
    pruning was switched on has none, and every weight is then kept).
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    local_shape: tuple[int, ...]
    regions: list[tuple[Box, Box]]
    fetch: Callable[[], Any]
    assign: Callable[[np.ndarray], None] | None = None
    optional: bool = False

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.local_shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass
class ShardSet:
    """The slots one device (or process) holds; written to ``shards/<name>.bin``."""

    name: str
    slots: list[Slot] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


@dataclass
class Written:
    """What :func:`write_shard_set` wrote: index entries, the file's size and sha256, and the
    slots that held non-finite values ``(name, nan count, inf count, size)``."""

    entries: list[tuple[str, tuple, str, Box, str, int]] = field(default_factory=list)  # name, shape, dtype, box, file, offset
    files: dict[str, dict] = field(default_factory=dict)
    non_finite: list[tuple[str, int, int, int]] = field(default_factory=list)


def whole_tensor_sets(tensors: Mapping[str, Any], name: str = "tensors", parts: int | None = None) -> list[ShardSet]:
    """Shard sets for whole tensors held by one process (``{name: array}``), spread over
    ``parts`` files of about equal size (default: one per 64 MiB, at most 8)."""
    slots = []
    for key, value in tensors.items():
        value = np.asarray(value)
        slots.append(Slot(key, value.shape, value.dtype, value.shape, [(boxes.full(value.shape),) * 2],
                          fetch=lambda v=value: v))
    return spread(slots, name, parts)


def variable_sets(variables: Mapping[str, Any], name: str = "tensors", parts: int | None = None) -> list[ShardSet]:
    """Shard sets for whole variables (``{name: tf.Variable}``, or anything with ``shape``,
    ``dtype``, ``read_value()`` and ``assign()``), spread like :func:`whole_tensor_sets`, each
    slot read from its variable when it is written and assigned when it is restored: the
    writer and restoring threads hold one variable at a time on the host, never the state
    (the parameter-server engine's ``checkpoint_slots``).

    Example:
        >>> import tensorflow as tf
        >>> w, step = tf.Variable(tf.ones([2, 3])), tf.Variable(0, dtype=tf.int64)
        >>> sets = variable_sets({"w": w, "optimizer/step": step})
        >>> [(s.name, [(x.name, x.shape, x.dtype.name) for x in s.slots]) for s in sets]
        [('tensors', [('w', (2, 3), 'float32'), ('optimizer/step', (), 'int64')])]
        >>> sets[0].slots[1].assign(np.array(7)); int(step.numpy())
        7
    """
    return spread([variable_slot(key, var) for key, var in variables.items()], name, parts)


def variable_slot(name: str, var: Any) -> Slot:
    """The :class:`Slot` of one whole variable: fetched by ``read_value()`` (a device
    tensor, copied to the host by the writer), restored by ``assign()``."""
    shape = tuple(int(n) for n in var.shape)
    dtype = np.dtype(getattr(var.dtype, "as_numpy_dtype", var.dtype))

    def assign(value: np.ndarray) -> None:
        var.assign(np.asarray(value).astype(dtype, copy=False))

    return Slot(name, shape, dtype, shape, [(boxes.full(shape),) * 2], fetch=var.read_value, assign=assign)


def spread(slots: Sequence[Slot], name: str = "tensors", parts: int | None = None) -> list[ShardSet]:
    """Whole-tensor ``slots`` spread over ``parts`` shard sets (``name``, or ``name-0``, ...)
    of about equal bytes (default: one per 64 MiB, at most :data:`MAX_THREADS`), largest
    first onto the lightest; each set keeps the slots' given order."""
    total = sum(s.nbytes for s in slots)
    parts = parts or set_count(total)
    sets = [ShardSet(f"{name}-{i}" if parts > 1 else name) for i in range(parts)]
    loads = [0] * parts
    for slot in sorted(slots, key=lambda s: -s.nbytes):
        i = loads.index(min(loads))
        loads[i] += slot.nbytes
        sets[i].slots.append(slot)
    order = {id(slot): i for i, slot in enumerate(slots)}
    for s in sets:
        s.slots.sort(key=lambda slot: order[id(slot)])
    return [s for s in sets if s.slots]


def set_count(total_bytes: float) -> int:
    """How many shard sets (files, writer threads) :func:`spread` makes of ``total_bytes`` of
    whole tensors: one per 64 MiB, at least 1, at most :data:`MAX_THREADS`."""
    return int(max(1, min(MAX_THREADS, -(-int(total_bytes) // (64 << 20)))))


# ---------------------------------------------------------------------------
# Writing


def snapshot(sets: Sequence[ShardSet]) -> list[list[Any]]:
    """Every slot's value now (``fetch()``): device tensors stay on their devices (a
    TensorFlow variable read is copy-on-write, so the next step's update copies the
    buffer instead of changing the snapshot); written later by :func:`write_shard_set`."""
    return [[slot.fetch() for slot in s.slots] for s in sets]


def write_shard_set(directory: Path, shard: ShardSet, values: Sequence[Any] | None = None) -> Written:
    """Write ``shard``'s slots (or the snapshot ``values``) into ``directory/shards/<name>.bin``,
    one slot at a time, hashing as it writes; flush the file to disk.

    Refuses nothing itself: slots holding NaN or inf are reported in ``Written.non_finite``
    (and still written) so that the caller can name all of them and discard the directory.
    """
    rel = f"{SHARDS}/{shard.name}.bin"
    path = Path(directory) / rel
    path.parent.mkdir(exist_ok=True)
    out = Written()
    digest = hashlib.sha256()
    offset = 0
    with open(path, "wb") as f:
        for i, slot in enumerate(shard.slots):
            value = slot.fetch() if values is None else values[i]
            array = np.asarray(value)  # a device tensor: copied to the host here, one slot at a time
            dtype = np.dtype(slot.dtype)
            if array.dtype != dtype:
                array = array.astype(dtype)
            if tuple(array.shape) != tuple(slot.local_shape):
                raise ValueError(f"slot {slot.name!r} of {shard.name} has shape {array.shape}, its plan says "
                                 f"{slot.local_shape}")
            if dtype.kind in "fc" and array.size:
                finite = np.isfinite(array)
                if not finite.all():
                    nans = int(np.isnan(array).sum())
                    out.non_finite.append((slot.name, nans, int(array.size - finite.sum()) - nans, array.size))
                del finite
            for local, logical in slot.regions:
                part = np.ascontiguousarray(array[boxes.index(local)])
                pad = -offset % ALIGN
                if pad:
                    f.write(b"\0" * pad)
                    digest.update(b"\0" * pad)
                    offset += pad
                data = memoryview(part).cast("B") if part.ndim else part.tobytes()
                f.write(data)
                digest.update(data)
                out.entries.append((slot.name, tuple(int(n) for n in slot.shape), dtype.name, logical, rel, offset))
                offset += part.nbytes
                del part, data
            del array, value
        f.flush()
        os.fsync(f.fileno())
    out.files[rel] = {"bytes": offset, "sha256": digest.hexdigest()}
    return out


def write_shard_sets(directory: Path, sets: Sequence[ShardSet], values: Sequence[Sequence[Any]] | None = None,
                     threads: int | None = None) -> list[Written]:
    """:func:`write_shard_set` for every set, in parallel threads (one per set, at most
    ``threads``, default :data:`MAX_THREADS`)."""
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"shard set names repeat: {names}")
    jobs = [(s, None if values is None else values[i]) for i, s in enumerate(sets) if s.slots]
    workers = max(1, min(threads or MAX_THREADS, len(jobs)))
    if workers == 1:
        return [write_shard_set(directory, s, v) for s, v in jobs]
    with ThreadPoolExecutor(workers, thread_name_prefix="phalanx-ckpt") as pool:
        return list(pool.map(lambda job: write_shard_set(directory, *job), jobs))


def build_index(parts: Iterable[Written]) -> dict[str, dict]:
    """The ``tensors`` table of ``index.json`` from every writer's entries: per logical name
    its shape, dtype and pieces ``{file, offset, box}``. Raises ValueError if the pieces of
    a tensor disagree on shape or dtype, or do not cover it exactly once."""
    tensors: dict[str, dict] = {}
    for part in parts:
        for name, shape, dtype, box, file, offset in part.entries:
            entry = tensors.setdefault(name, {"shape": list(shape), "dtype": dtype, "pieces": []})
            if entry["shape"] != list(shape) or entry["dtype"] != dtype:
                raise ValueError(f"pieces of {name!r} disagree: shape {entry['shape']} {entry['dtype']} vs "
                                 f"{list(shape)} {dtype}")
            entry["pieces"].append({"file": file, "offset": offset, "box": boxes.to_json(box)})
    for name, entry in tensors.items():
        entry["pieces"].sort(key=lambda p: (p["box"], p["file"]))
        covered = sum(boxes.volume(boxes.from_json(p["box"])) for p in entry["pieces"])
        size = int(np.prod(entry["shape"], dtype=np.int64))
        if covered != size:
            raise ValueError(f"the shard sets hold {covered} elements of {name!r}, which has {size}: a "
                             f"slice is written twice or not at all")
    return dict(sorted(tensors.items()))


# ---------------------------------------------------------------------------
# Reading


class Reader:
    """Read any box of any logical tensor of a checkpoint (or of an in-memory state)."""

    def names(self) -> list[str]:
        raise NotImplementedError

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def dtype(self, name: str) -> np.dtype:
        raise NotImplementedError

    def read(self, name: str, box: Box | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """The values of ``box`` (default: all) of tensor ``name``, into ``out`` if given."""
        raise NotImplementedError

    def __contains__(self, name: str) -> bool:
        return name in set(self.names())

    def close(self) -> None:
        pass


class DictReader(Reader):
    """A :class:`Reader` over whole tensors in memory (format 1 and 2 checkpoints, state dicts)."""

    def __init__(self, tensors: Mapping[str, Any]):
        self.tensors = tensors

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self.tensors[name]))

    def dtype(self, name: str) -> np.dtype:
        return np.asarray(self.tensors[name]).dtype

    def read(self, name, box=None, out=None):
        value = np.asarray(self.tensors[name])
        part = value[boxes.index(box)] if box is not None else value
        if out is None:
            return np.array(part)
        out[...] = part
        return out


class ShardedReader(Reader):
    """Reads a format-3 checkpoint directory through its index; each data file is mapped
    (``np.memmap``, read-only) and only the bytes of the requested boxes are touched.

    ``on_non_finite(file, name)`` is raised when a piece read holds NaN or inf (a checkpoint
    written by phalanx never does; a checksum-consistent one edited by hand may).
    """

    def __init__(self, directory: str | Path, tensors: Mapping[str, dict],
                 on_error: Callable[[Path, str], Exception] | None = None):
        self.directory = Path(directory)
        self.tensors = tensors
        self._maps: dict[str, np.memmap] = {}
        self._error = on_error or (lambda path, text: ValueError(f"{path}: {text}"))

    def names(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def shape(self, name):
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name):
        return np.dtype(self.tensors[name]["dtype"])

    def _file(self, rel: str) -> np.memmap:
        mm = self._maps.get(rel)
        if mm is None:
            path = self.directory / rel
            mm = np.memmap(path, np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
            self._maps[rel] = mm
        return mm

    def read(self, name, box=None, out=None):
        entry = self.tensors[name]
        dtype, shape = np.dtype(entry["dtype"]), tuple(entry["shape"])
        box = boxes.full(shape) if box is None else box
        if out is None:
            out = np.empty(boxes.shape_of(box), dtype)
        covered = 0
        for piece in entry["pieces"]:
            stored = boxes.from_json(piece["box"])
            common = boxes.intersect(stored, box) if stored else ()
            if common is None:
                continue
            count = boxes.volume(stored)
            raw = self._file(piece["file"])[piece["offset"]: piece["offset"] + count * dtype.itemsize]
            source = raw.view(dtype).reshape(boxes.shape_of(stored))
            chunk = source[boxes.index(boxes.relative(common, stored))]
            if dtype.kind in "fc" and chunk.size and not np.isfinite(chunk).all():
                raise self._error(self.directory / piece["file"], f"holds non-finite values in {name}")
            out[boxes.index(boxes.relative(common, box))] = chunk
            covered += boxes.volume(common)
        if covered != boxes.volume(box):
            raise self._error(self.directory / "index.json", f"its pieces cover {covered} of the {boxes.volume(box)} "
                                                             f"elements of {name} {list(box)}")
        return out

    def close(self) -> None:
        self._maps.clear()


class LazyTensors(Mapping):
    """Whole tensors of a :class:`Reader` by name, each read when asked for (not kept)."""

    def __init__(self, reader: Reader):
        self.reader = reader

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.reader:
            raise KeyError(name)
        return self.reader.read(name)

    def __iter__(self):
        return iter(self.reader.names())

    def __len__(self) -> int:
        return len(self.reader.names())

    def __contains__(self, name) -> bool:
        return name in self.reader


# ---------------------------------------------------------------------------
# Loading into slots


def _family(dtype) -> str:
    kind = np.dtype(dtype).kind
    return "float" if kind in "fc" else "integer" if kind in "biu" else kind


def check_dtype(name: str, stored, wanted) -> None:
    """Raise ValueError if a stored tensor's dtype is of another family (float vs integer /
    bool) than the variable it loads into: its bytes would be read as something else. A
    float32 checkpoint loads into float16 variables (and int32 into int64): a cast."""
    if _family(stored) != _family(wanted):
        raise ValueError(f"checkpoint tensor {name!r} is {np.dtype(stored).name}, the model holds "
                         f"{np.dtype(wanted).name}")


def check_fits(reader: Reader, sets: Sequence[ShardSet]) -> None:
    """Raise KeyError naming missing tensors, ValueError naming a shape that differs or a
    dtype of another family (:func:`check_dtype`)."""
    wanted: dict[str, tuple] = {}
    dtypes: dict[str, Any] = {}
    optional: set[str] = set()
    for s in sets:
        for slot in s.slots:
            wanted.setdefault(slot.name, tuple(slot.shape))
            dtypes.setdefault(slot.name, slot.dtype)
            if slot.optional:
                optional.add(slot.name)
    missing = sorted(n for n in wanted if n not in reader and n not in optional)
    if missing:
        raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
                       f"was it written for a different model?")
    for name, shape in wanted.items():
        if name not in reader:
            continue  # an optional slot (checked above)
        have = tuple(reader.shape(name))
        if have != shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {have}, the model expects {shape}: "
                             f"a different model config?")
        check_dtype(name, reader.dtype(name), dtypes[name])


def load_shard_set(reader: Reader, shard: ShardSet) -> None:
    """Fill every slot of ``shard`` from ``reader``: only the boxes it holds are read."""
    for slot in shard.slots:
        if slot.optional and slot.name not in reader:
            continue
        local = np.empty(slot.local_shape, reader.dtype(slot.name))
        for region, logical in slot.regions:
            reader.read(slot.name, logical, out=local[boxes.index(region)])
        if local.dtype != np.dtype(slot.dtype):
            local = local.astype(slot.dtype)
        slot.assign(local)
        del local


def load_shard_sets(reader: Reader, sets: Sequence[ShardSet], threads: int | None = None) -> None:
    """:func:`check_fits`, then :func:`load_shard_set` for every set in parallel threads."""
    check_fits(reader, sets)
    jobs = [s for s in sets if s.slots]
    workers = max(1, min(threads or MAX_THREADS, len(jobs)))
    if workers == 1:
        for s in jobs:
            load_shard_set(reader, s)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="phalanx-restore") as pool:
        list(pool.map(lambda s: load_shard_set(reader, s), jobs))


def gather(sets: Sequence[ShardSet]) -> dict[str, np.ndarray]:
    """Whole logical tensors assembled from every slot (``state_dict()``; holds the model)."""
    out: dict[str, np.ndarray] = {}
    for s in sets:
        for slot in s.slots:
            value = np.asarray(slot.fetch())
            whole = out.get(slot.name)
            if whole is None:
                whole = out[slot.name] = np.zeros(slot.shape, np.dtype(slot.dtype))
            for region, logical in slot.regions:
                whole[boxes.index(logical)] = value[boxes.index(region)]
    return out
