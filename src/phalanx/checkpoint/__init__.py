"""Layout-independent, sharded, atomic, verified checkpoints.

A checkpoint is a directory ``<run.dir>/checkpoints/step-00000100/`` holding (format 3,
docs/checkpoint_format.md)

- ``shards/<set>.bin``: one data file per shard set, i.e. per device (or process) that
  holds part of the state, with only the slices that device holds: tensor-parallel
  shards of weights, ZeRO pieces of optimizer moments, scalars;
- ``index.json``: per logical tensor (weights, ``optimizer/m/*``, ``optimizer/v/*``,
  ``optimizer/step``, ``loss_scale/*``, ...), its global shape, dtype and the list of
  pieces ``(file, byte offset, box)``, so a checkpoint written by one parallel layout
  loads into any other, each device reading only the boxes it needs;
- ``meta.json``: format, step, the config, the layout that wrote it, wall time;
- ``data/``: the input iterator's position (written by the data pipeline);
- ``manifest.json``, written last: size and sha256 of every other file.

Saving (:func:`save`) writes the shard sets in parallel threads, each one slot at a
time, so no writer holds more than one slot on the host; it refuses non-finite tensors
(a diverged run must not replace its last good checkpoint), writes everything into a
hidden temporary directory, flushes it to disk and renames it into place: a process
killed mid-save leaves the previous checkpoints untouched and no half-written
``step-*`` directory (rename is atomic on POSIX). Before writing it prunes to
``keep - 1`` old checkpoints (never the newest), so lowering ``checkpoint.keep`` frees
the space the new one needs; an I/O error (disk full, read-only, ...) is a one-line
:class:`CheckpointError` naming the path and the bytes needed, with the temporary
directory removed. :class:`AsyncSaver` (``checkpoint.async=true``) does the writing in
a background thread from a snapshot taken at the step boundary.

Loading verifies: every file against the manifest, ``meta.json``, the index and the
data position parse and name the step of the directory; pieces are checked finite as
they are read. :func:`restore_latest` / :func:`latest_valid` skip a damaged newest
checkpoint with a warning naming the file and the fault, and fall back to the newest
valid one. :func:`load_into` fills an engine's shard sets (any layout) from it.
Checkpoints of format 2 (one ``tensors.npz`` of whole tensors) load, verified;
format 1 (before manifests) loads unverified, with a warning.

Example:
    >>> import tempfile, numpy as np
    >>> root = tempfile.mkdtemp()
    >>> path = save(root, 5, {"w": np.ones(3, np.float32)}, meta={"note": "x"})
    >>> sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    ['index.json', 'manifest.json', 'meta.json', 'shards/tensors.bin']
    >>> latest_valid(root).name
    'step-00000005'
    >>> restore(latest(root)).tensors["w"].tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import threading
import time
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import quote, unquote

import numpy as np

from phalanx.checkpoint import boxes
from phalanx.checkpoint.sharded import (ALIGN, DTYPES, MAX_THREADS, SHARDS, DictReader, LazyTensors, Reader,
                                        ShardedReader, ShardSet, Slot, Written, build_index, check_dtype, gather,
                                        load_shard_sets, snapshot, variable_sets, whole_tensor_sets,
                                        write_shard_set)
from phalanx.config import ConfigError
from phalanx.fsutil import fsync_dir, pid_alive

PREFIX = "step-"
FORMAT_VERSION = 3
#: formats this phalanx reads: 1 (no manifest, loaded unverified with a warning), 2 (whole
#: tensors in one tensors.npz) and 3 (shard sets + index)
READABLE_FORMATS = (1, 2, 3)
TENSORS = "tensors.npz"  # formats 1 and 2
INDEX = "index.json"
META = "meta.json"
MANIFEST = "manifest.json"
#: the data pipeline's position file (phalanx.data.pipeline.ITERATOR_FILE inside ``data/``)
DATA_POSITION = "data/data_iterator.json"
#: where damaged checkpoints newer than the resumed one are moved (kept for inspection)
DAMAGED_DIR = "damaged"
_HASH_CHUNK = 1 << 18

__all__ = [
    "AsyncSaver", "CheckpointError", "CheckpointWarning", "Reader", "Restored", "ShardSet", "Slot", "all_checkpoints",
    "check_dtype", "check_finite", "estimate_bytes", "gather", "latest", "latest_valid", "load_into", "load_shard_sets",
    "open_reader", "print_warning", "prune", "quarantine_after", "restore", "restore_latest", "resume_latest",
    "save", "sha256_file", "state_of",
    "step_dir", "step_of", "variable_sets", "verify", "whole_tensor_sets", "write_shard_set",
]


class CheckpointError(ConfigError):
    """A checkpoint cannot be written or read. ``key`` (and ``path``) is the file or
    directory at fault; the message says what is wrong. A ConfigError, so the CLI
    prints it on one line and exits 2."""

    def __init__(self, path: str | Path, message: str):
        super().__init__(str(path), message)
        self.path, self.message = Path(path), message


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged) or loaded unverified (format 1)."""


@dataclass
class Restored:
    """A verified checkpoint: ``tensors`` maps each logical name to its whole tensor, read
    when asked for (format 3) or held (formats 1, 2); ``reader`` reads any box of any
    tensor (what :func:`load_into` uses, so no process assembles the whole model)."""

    path: Path
    step: int
    tensors: Mapping[str, np.ndarray]
    meta: dict
    reader: Reader | None = None

    def __post_init__(self):
        if self.reader is None:
            self.reader = DictReader(self.tensors)


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def step_of(path: str | Path) -> int | None:
    """The step in a ``step-00000012`` directory name (None for any other name)."""
    name = Path(path).name
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


# ---------------------------------------------------------------------------
# What an engine saves and loads


def state_of(engine, extra: Mapping[str, np.ndarray] | None = None) -> list[ShardSet]:
    """The shard sets of ``engine``'s state: its own (``engine.checkpoint_slots()``: one per
    device on the Keras GPT engine, :func:`variable_sets` of whole variables on the
    parameter-server engine; either way each slot is read when it is written, one at a time) or, for an
    engine without them, :func:`whole_tensor_sets` of ``state_dict()`` (the whole state on
    the host); plus ``extra`` whole tensors (e.g. pruning masks) in a set of their own."""
    slots = getattr(engine, "checkpoint_slots", None)
    sets = list(slots()) if slots is not None else whole_tensor_sets(engine.state_dict())
    if extra:
        sets += whole_tensor_sets(extra, name="extra")
    return sets


def load_into(engine, restored: "Restored | Reader", threads: int | None = None) -> None:
    """Load a checkpoint into ``engine`` in any layout: every device's slots are filled
    with the boxes they hold (``engine.checkpoint_slots()``), else ``load_state_dict``
    with whole tensors read one at a time. Raises KeyError / ValueError when the
    checkpoint does not fit the model."""
    reader = restored.reader if isinstance(restored, Restored) else restored
    slots = getattr(engine, "checkpoint_slots", None)
    if slots is not None:
        load_shard_sets(reader, slots(), threads=threads)
    else:
        engine.load_state_dict(LazyTensors(reader))


# ---------------------------------------------------------------------------
# Saving


@dataclass
class _Job:
    root: Path
    step: int
    final: Path
    tmp: Path
    sets: list[ShardSet]
    meta: dict
    keep: int | None
    needed: int
    threads: int | None


def save(root: str | Path, step: int, state: Mapping[str, np.ndarray] | Sequence[ShardSet], meta: dict | None = None,
         writers: dict[str, Callable[[Path], None]] | None = None, keep: int | None = None,
         threads: int | None = None) -> Path:
    """Atomically write checkpoint ``step`` under ``root``; keep the newest ``keep``.

    ``state`` is whole tensors by logical name, or shard sets (:func:`state_of`), each
    written to its own file by its own thread (at most ``threads``). ``writers`` maps a
    sub-directory name to a function that fills it (e.g. the data iterator's state), run
    inside the temporary directory before the manifest and the rename. Raises
    :class:`CheckpointError` if a tensor is not finite or the file system lacks the space
    (before writing when it can tell), and after cleaning up if writing fails; the
    checkpoints already there stay as they were (except those pruned by ``keep``).
    """
    return _complete(_prepare(root, step, state, meta, writers, keep, threads))


def _prepare(root, step, state, meta, writers, keep, threads) -> _Job:
    """Everything before the shard data: checks, pruning, the temporary dir and the small
    ``writers`` (so that a data position is taken at the step boundary)."""
    root = Path(root)
    if isinstance(state, Mapping):
        check_finite(state, f"refusing to save step {step}")
        sets = whole_tensor_sets(state)
    else:
        sets = list(state)
    final = step_dir(root, step)
    needed = estimate_bytes(sets)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise _io_error(root, step, err, needed) from None
    if keep:
        # Prune first so a lowered checkpoint.keep frees the space for this save; the newest
        # old checkpoint is never deleted before its successor is in place.
        prune(root, max(keep - 1, 1), exclude=final)
    free = _free_bytes(root)
    if free is not None and free < needed:
        raise _io_error(root, step, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root)), needed)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    info = {"format": FORMAT_VERSION, "step": step, "time": time.time(), **(meta or {})}
    job = _Job(root, step, final, tmp, sets, info, keep, needed, threads)
    try:
        tmp.mkdir()
        for name, write in (writers or {}).items():
            sub = tmp / name
            sub.mkdir()
            write(sub)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _io_error(root, step, err, needed) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return job


def _complete(job: _Job, values: list[list[Any]] | None = None) -> Path:
    """Write the shard sets (from ``values``, a :func:`snapshot`, if given), the index, meta
    and manifest, then rename into place and prune."""
    try:
        written = _write_all(job.tmp, job.sets, values, job.threads)
        bad = [b for w in written for b in w.non_finite]
        if bad:
            raise _non_finite_error(bad, f"refusing to save step {job.step}", "checkpoint")
        tensors = build_index(written)
        job.meta["tensors"] = len(tensors)
        job.meta["shard_sets"] = [s.name for s in job.sets if s.slots]
        _write_json(job.tmp / INDEX, {"format": FORMAT_VERSION, "step": job.step, "tensors": tensors}, compact=True)
        _write_json(job.tmp / META, job.meta)
        known = {rel: entry for w in written for rel, entry in w.files.items()}
        _write_json(job.tmp / MANIFEST, {"format": FORMAT_VERSION, "step": job.step,
                                         "files": _describe_files(job.tmp, known)})
        _fsync_tree(job.tmp, skip=set(known))
        _replace_dir(job.tmp, job.final)
        fsync_dir(job.root)
    except OSError as err:
        shutil.rmtree(job.tmp, ignore_errors=True)
        raise _io_error(job.root, job.step, err, job.needed) from None
    except BaseException:
        shutil.rmtree(job.tmp, ignore_errors=True)
        raise
    if job.keep:
        prune(job.root, job.keep)
    return job.final


def _write_all(directory: Path, sets: list[ShardSet], values, threads) -> list[Written]:
    """:func:`write_shard_set` for every non-empty set, one thread per set (at most ``threads``)."""
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise ValueError(f"shard set names repeat: {names}")
    jobs = [(s, None if values is None else values[i]) for i, s in enumerate(sets) if s.slots]
    (directory / SHARDS).mkdir(exist_ok=True)
    workers = max(1, min(threads or MAX_THREADS, len(jobs)))
    if workers == 1:
        return [write_shard_set(directory, s, v) for s, v in jobs]
    with ThreadPoolExecutor(workers, thread_name_prefix="phalanx-ckpt") as pool:
        return list(pool.map(lambda job: write_shard_set(directory, *job), jobs))


class AsyncSaver:
    """Saves in a background thread while training goes on (``checkpoint.async=true``).

    :meth:`save` does at the step boundary what must see that step: the checks, pruning,
    the temporary directory, the ``writers`` (the data position) and a snapshot of every
    slot (:func:`~phalanx.checkpoint.sharded.snapshot`: device reads, copied only when the
    next step overwrites a variable). A thread then writes the shard files, index, meta
    and, last, the manifest, and renames the directory into place: a kill mid-write
    leaves only a ``.tmp-*`` directory, never a valid-looking checkpoint. One save runs at
    a time: the next :meth:`save` and :meth:`wait` (call it at the end of training) wait
    for it and raise its error, naming the checkpoint path.
    """

    def __init__(self, threads: int | None = None):
        self.threads = threads
        self._thread: threading.Thread | None = None
        self._job: _Job | None = None
        self._error: BaseException | None = None
        self._done: Path | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def save(self, root, step, state, meta=None, writers=None, keep=None) -> Path:
        """Start saving checkpoint ``step`` (see :func:`save`); returns the path it will have."""
        self.wait()
        job = _prepare(root, step, state, meta, writers, keep, self.threads)
        try:
            values = snapshot(job.sets)
        except BaseException:
            shutil.rmtree(job.tmp, ignore_errors=True)
            raise
        self._job, self._done = job, None
        self._thread = threading.Thread(target=self._run, args=(job, values), name=f"phalanx-save-{step}")
        self._thread.start()
        return job.final

    def _run(self, job: _Job, values) -> None:
        try:
            self._done = _complete(job, values)
        except BaseException as err:  # surfaced by wait()
            self._error = err

    def wait(self) -> Path | None:
        """Wait for the save in flight; return its path, or raise its error as a
        :class:`CheckpointError` naming the checkpoint."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        err, job = self._error, self._job
        self._error = None
        if err is not None:
            if isinstance(err, CheckpointError):
                raise CheckpointError(err.path, f"{err.message} (background save of {job.final})") from None
            raise CheckpointError(job.final, f"the background save of step {job.step} failed: "
                                             f"{type(err).__name__}: {err}") from err
        return self._done


def check_finite(tensors: Mapping[str, np.ndarray], what: str, where: str | Path | None = None) -> None:
    """Raise :class:`CheckpointError` naming every tensor holding NaN or inf."""
    bad = []
    for name, value in tensors.items():
        value = np.asarray(value)
        if value.dtype.kind not in "fc" or value.size == 0:
            continue
        finite = np.isfinite(value)
        if not finite.all():
            nans = int(np.isnan(value).sum())
            bad.append((name, nans, int(value.size - finite.sum()) - nans, value.size))
    if bad:
        raise _non_finite_error(bad, what, where or "checkpoint")


def _non_finite_error(bad: list[tuple[str, int, int, int]], what: str, where) -> CheckpointError:
    """``bad``: (name, NaN count, inf count, size) per tensor or piece; pieces of one name summed."""
    total: dict[str, list[int]] = {}
    for name, nans, infs, size in bad:
        t = total.setdefault(name, [0, 0, 0])
        t[0], t[1], t[2] = t[0] + nans, t[1] + infs, t[2] + size
    shown = [f"{n} ({a} NaN, {b} inf of {c})" for n, (a, b, c) in total.items()]
    text = ", ".join(shown[:5]) + (f" and {len(shown) - 5} more" if len(shown) > 5 else "")
    return CheckpointError(where, f"{what}: non-finite values in {text}; the training diverged (lower "
                                  f"train.lr, raise train.warmup, or use train.clip_norm); the last good "
                                  f"checkpoint is kept")


def estimate_bytes(state: Mapping[str, np.ndarray] | Sequence[ShardSet]) -> int:
    """Bytes a checkpoint of ``state`` takes on disk: the data, ~200 bytes of alignment and
    index per piece, and six 4 KiB blocks (the small json files, their dirs, the last
    block of each data file is counted in the pieces' share)."""
    sets = whole_tensor_sets(state) if isinstance(state, Mapping) else state
    pieces = sum(len(slot.regions) for s in sets for slot in s.slots)
    return int(sum(s.nbytes for s in sets) + (ALIGN + 200) * pieces + 4096 * (6 + len(sets)))


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def _io_error(root: Path, step: int, err: OSError, needed: int) -> CheckpointError:
    code = errno.errorcode.get(err.errno, str(err.errno)) if err.errno else "I/O error"
    where = f" ({err.filename})" if err.filename and Path(err.filename) != root else ""
    free = _free_bytes(root)
    space = f"; {_human(free)} free there" if free is not None else ""
    newest = latest(root) if root.is_dir() else None
    kept = f"the previous checkpoints are intact (newest {newest.name})" if newest else "no checkpoint was written"
    hint = ("free space, lower checkpoint.keep (older checkpoints are pruned before a save) or move run.dir"
            if err.errno in (errno.ENOSPC, errno.EDQUOT) else "check the file system and its permissions")
    return CheckpointError(root, f"cannot write checkpoint step {step}{where}: {err.strerror or err} [{code}]; "
                                 f"it needs {_human(needed)} ({needed:,} bytes){space}; {kept}; {hint}")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename ``tmp`` to ``final``; an existing ``final`` (re-saving a step) is moved
    aside first and deleted after, so a kill never leaves that step absent and the
    complete new copy lost."""
    if not final.exists():
        os.rename(tmp, final)
        return
    old = final.parent / f".tmp-old-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    os.rename(final, old)
    os.rename(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------
# Listing and pruning


def all_checkpoints(root: str | Path) -> list[Path]:
    """Checkpoint directories under ``root`` (complete by the atomic rename, not
    verified), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and step_of(p) is not None]
    return sorted(found, key=step_of)


def latest(root: str | Path) -> Path | None:
    """The newest checkpoint directory, unverified; see :func:`latest_valid`."""
    found = all_checkpoints(root)
    return found[-1] if found else None


def prune(root: str | Path, keep: int, exclude: Path | None = None) -> None:
    """Delete all but the newest ``keep`` checkpoints (not counting ``exclude``) and the
    temporary dirs of writers that no longer run."""
    found = [p for p in all_checkpoints(root) if exclude is None or p.name != Path(exclude).name]
    for old in found[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in Path(root).glob(".tmp-*"):
        pid = tmp.name.split("-")[-2] if tmp.name.count("-") >= 3 else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def quarantine_after(root: str | Path, step: int) -> list[Path]:
    """Move checkpoints newer than ``step`` (those skipped as damaged on resume) to
    ``root/damaged/``: left in place they would count as the newest for pruning and
    get the valid one deleted. Returns their new paths."""
    moved = []
    for path in all_checkpoints(root):
        if step_of(path) > step:
            target = Path(root) / DAMAGED_DIR / f"{path.name}-{time.strftime('%Y%m%d-%H%M%S')}"
            target.parent.mkdir(exist_ok=True)
            os.rename(path, target)
            moved.append(target)
    return moved


# ---------------------------------------------------------------------------
# Verifying and loading


def verify(path: str | Path) -> dict:
    """Check the checkpoint at ``path`` without decoding its tensors; returns its meta.

    Raises :class:`CheckpointError` naming the file and the fault: a file missing,
    truncated or changed since the manifest was written; an unreadable manifest,
    ``meta.json``, index or data position; a step that differs from the directory's
    name; an index whose pieces lie outside their files or do not cover their tensors.
    A format-1 checkpoint (no manifest) gets a :class:`CheckpointWarning` and only the
    structural checks (and the zip CRCs of its tensors).
    """
    return _verify(Path(path))[0]


def _verify(path: Path) -> tuple[dict, dict | None]:
    """(meta, the index's tensors table for format 3 else None)."""
    step = step_of(path)
    if not path.is_dir() or step is None:
        raise CheckpointError(path, f"not a checkpoint directory (expected {PREFIX}<step>/)")
    manifest = path / MANIFEST
    listed: dict[str, dict] = {}
    if manifest.is_file():
        listed = _read_manifest(manifest)
        for rel, entry in listed.items():
            _check_file(path, rel, entry)
        if META not in listed:
            raise CheckpointError(manifest, f"lists no {META}; the checkpoint is incomplete")
        meta = _read_json(path / META, "meta.json")
        required = INDEX if meta.get("format") == 3 else TENSORS
        if required not in listed:
            raise CheckpointError(manifest, f"lists no {required}; the checkpoint is incomplete")
        has_position = DATA_POSITION in listed
    else:
        meta = _read_json(path / META, "meta.json")
        if meta.get("format") != 1:
            raise CheckpointError(manifest, f"missing; a format-{meta.get('format')} checkpoint is only "
                                            f"complete with it (the save did not finish or the file was deleted)")
        warnings.warn(f"{path} has no {MANIFEST} (format 1, written before checksums): loading it unverified",
                      CheckpointWarning, stacklevel=3)
        _check_zip(path / TENSORS)
        has_position = (path / "data").is_dir()
    fmt = meta.get("format")
    if fmt not in READABLE_FORMATS:
        raise CheckpointError(path / META, f"checkpoint format {fmt!r}; this phalanx reads formats "
                                           f"{', '.join(map(str, READABLE_FORMATS))}")
    meta_step = meta.get("step")
    if not isinstance(meta_step, int) or isinstance(meta_step, bool) or meta_step != step:
        raise CheckpointError(path / META, f"says step {meta_step!r}, but its directory {path.name} is step "
                                           f"{step}; it was renamed or damaged")
    index = _read_index(path, listed, step) if fmt == 3 else None
    count = meta.get("tensors")
    if index is not None and isinstance(count, int) and count != len(index):
        raise CheckpointError(path / INDEX, f"holds {len(index)} tensors, meta.json says {count}")
    if has_position:
        position = _read_json(path / DATA_POSITION, "the data position")
        data_step = position.get("step")
        if data_step != step:
            raise CheckpointError(path / DATA_POSITION, f"puts the data at step {data_step!r}, but the "
                                                        f"checkpoint is step {step}; resuming would repeat or "
                                                        f"skip batches")
    return meta, index


def _read_index(path: Path, listed: dict[str, dict], step: int) -> dict[str, dict]:
    """The ``tensors`` table of ``index.json``, checked: shapes, dtypes, boxes inside their
    tensors, not overlapping and covering them, pieces inside files the manifest lists and
    lying in each file exactly where the writer puts them (so each piece's bytes are the
    dtype and box the index says: a dtype or shape edited in the index moves them)."""
    where = path / INDEX
    doc = _read_json(where, "index.json")
    if doc.get("step") != step:
        raise CheckpointError(where, f"says step {doc.get('step')!r}, but the checkpoint is step {step}")
    tensors = doc.get("tensors")
    if not isinstance(tensors, dict):
        raise CheckpointError(where, "has no 'tensors' table of {name: {shape, dtype, pieces}}")
    spans: dict[str, list[tuple[int, int, str]]] = {}  # file -> (offset, end, tensor) of its pieces
    for name, entry in tensors.items():
        try:
            shape, dtype, pieces = entry["shape"], entry["dtype"], entry["pieces"]
            if not (isinstance(shape, list) and all(isinstance(n, int) and n >= 0 for n in shape)):
                raise ValueError(f"shape {shape!r}")
            if dtype not in DTYPES:
                raise ValueError(f"dtype {dtype!r}")
            if not isinstance(pieces, list):
                raise ValueError(f"pieces {pieces!r}")
            itemsize = np.dtype(dtype).itemsize
            covered, seen = 0, []
            for piece in pieces:
                box = boxes.from_json(piece["box"])
                file, offset = piece["file"], piece["offset"]
                if len(box) != len(shape) or not boxes.contains(boxes.full(shape), box):
                    raise ValueError(f"box {piece['box']} outside shape {shape}")
                if file not in listed or not isinstance(offset, int) or offset < 0:
                    raise ValueError(f"piece in {file!r} at {offset!r}, a file the manifest does not list")
                end = offset + boxes.volume(box) * itemsize
                if end > listed[file]["bytes"]:
                    raise ValueError(f"piece at byte {offset} of {file} runs past its end")
                seen.append(box)
                spans.setdefault(file, []).append((offset, end, name))
                covered += boxes.volume(box)
            overlap = boxes.first_overlap(seen)
            if overlap is not None:
                raise ValueError(f"pieces {boxes.to_json(overlap[0])} and {boxes.to_json(overlap[1])} overlap "
                                 f"(each element is stored once)")
            if covered != int(np.prod(shape, dtype=np.int64)):
                raise ValueError(f"pieces cover {covered} of its {int(np.prod(shape))} elements")
        except (KeyError, TypeError, ValueError) as err:
            raise CheckpointError(where, f"bad entry for {name!r}: {err}") from None
    for file, found in spans.items():
        _check_layout(where, file, sorted(found), listed[file]["bytes"])
    return tensors


def _check_layout(where: Path, file: str, spans: list[tuple[int, int, str]], size: int) -> None:
    """The pieces of a data file, by offset, lie back to back, each at the next multiple of
    :data:`ALIGN`, and the last ends at the file's end: how :func:`write_shard_set` lays them
    out. A piece elsewhere means the index no longer describes the bytes (its dtype or
    shape was changed, or pieces were dropped or added)."""
    expected = 0
    for offset, end, name in spans:
        expected += -expected % ALIGN
        if offset != expected:
            raise CheckpointError(where, f"the piece of {name!r} starts at byte {offset:,} of {file}, where its writer "
                                         f"put byte {expected:,}: the index's dtypes or shapes do not describe "
                                         f"the file")
        expected = end
    if expected != size:
        raise CheckpointError(where, f"its pieces of {file} end at byte {expected:,}, the file has {size:,}: the "
                                     f"index's dtypes or shapes do not describe the file")


def restore(path: str | Path, verify_files: bool = True) -> Restored:
    """Open a checkpoint directory written by :func:`save`, verified (see :func:`verify`).

    Format 3: nothing is read yet; ``Restored.reader`` reads any box of any tensor (each
    piece checked finite as it is read) and ``Restored.tensors`` whole tensors on
    demand. Formats 1 and 2: the ``.npz`` is read and every float tensor checked finite.
    Raises :class:`CheckpointError`.
    """
    path = Path(path)
    if verify_files:
        meta, index = _verify(path)
    else:
        meta = _read_json(path / META, "meta.json")
        index = _read_json(path / INDEX, "index.json").get("tensors", {}) if meta.get("format") == 3 else None
    if index is not None:
        reader = ShardedReader(path, index, on_error=CheckpointError)
        return Restored(path=path, step=int(meta["step"]), tensors=LazyTensors(reader), meta=meta, reader=reader)
    tensors = _read_npz(path / TENSORS)
    check_finite(tensors, "holds non-finite tensors", where=path / TENSORS)
    return Restored(path=path, step=int(meta["step"]), tensors=tensors, meta=meta)


def open_reader(path: str | Path) -> Reader:
    """A :class:`Reader` of a checkpoint directory, unverified (for tools that inspect one)."""
    return restore(path, verify_files=False).reader


def _read_npz(path: Path) -> dict[str, np.ndarray]:
    try:
        with np.load(path, allow_pickle=False) as data:
            return {_decode(k): data[k] for k in data.files}
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as err:
        raise CheckpointError(path, f"unreadable ({type(err).__name__}: {err})") from None


def restore_latest(root: str | Path, warn: Callable[[str], None] | None = None,
                   accept: Callable[[Restored], Any] | None = None) -> Restored | None:
    """The newest checkpoint under ``root`` that loads and verifies (:func:`restore`) and
    that ``accept`` takes.

    ``accept(restored)`` is where the caller reads it (loads it into a model, reads the
    data position, ...): a :class:`CheckpointError` it raises (a piece holding NaN or inf
    though the manifest agrees, a tensor that does not fit) skips that checkpoint like a
    damaged file; any other error propagates. A damaged newer one is skipped with a warning
    (``warn(text)``, by default a :class:`CheckpointWarning`) naming the file and the
    fault. Returns None when ``root`` holds no checkpoint; raises :class:`CheckpointError`
    listing every fault when it holds some but none is valid.
    """
    if accept is None:
        return _newest(root, restore, warn)

    def load(path: Path) -> Restored:
        restored = restore(path)
        accept(restored)
        return restored
    return _newest(root, load, warn)


def print_warning(text: str) -> None:
    """``warning: <text>`` on stderr, flushed: how every phalanx command and loop reports a
    skipped checkpoint, whatever its verbosity (a damaged file never passes unnoticed)."""
    print(f"warning: {text}", file=sys.stderr, flush=True)


def resume_latest(root: str | Path, warn: Callable[[str], None] = print_warning,
                  accept: Callable[[Restored], Any] | None = None, move_damaged: bool = True) -> Restored | None:
    """What a training loop resumes from: :func:`restore_latest` (``accept`` loads it), then
    (``move_damaged``: the process that owns the run directory) the damaged newer
    checkpoints it skipped moved to ``root/damaged/`` (:func:`quarantine_after`), each move
    reported through ``warn``.

    ``phalanx train`` and ``phalanx.fit`` both resume through this; readers (``eval``,
    ``generate``, ``export``) call :func:`restore_latest` and move nothing.
    """
    restored = restore_latest(root, warn=warn, accept=accept)
    if restored is not None and move_damaged:
        for moved in quarantine_after(root, restored.step):
            warn(f"moved the skipped checkpoint to {moved}")
    return restored


def latest_valid(root: str | Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """Like :func:`restore_latest` but verifies files only (checksums, meta, index, data
    position; no tensor decoding): the path of the newest valid checkpoint, or None."""
    return _newest(root, lambda p: (verify(p), p)[1], warn)


def _newest(root, load, warn):
    warn = warn or (lambda text: warnings.warn(text, CheckpointWarning, stacklevel=3))
    found = all_checkpoints(root)
    faults = []
    for path in reversed(found):
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", CheckpointWarning)
                result = load(path)
        except CheckpointError as err:
            faults.append(str(err))
            warn(f"skipping damaged checkpoint {path.name}: {err}")
            continue
        for w in caught:
            warn(str(w.message))
        return result
    if faults:
        raise CheckpointError(root, f"none of its {len(found)} checkpoints is valid ({'; '.join(faults[:3])}"
                                    f"{'; ...' if len(faults) > 3 else ''}); move the checkpoints directory "
                                    f"away to start from scratch")
    return None


def _read_manifest(path: Path) -> dict[str, dict]:
    doc = _read_json(path, "manifest.json")
    files = doc.get("files")
    if not isinstance(files, dict) or not all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                                               and isinstance(e.get("bytes"), int) for e in files.values()):
        raise CheckpointError(path, "has no valid 'files' table of {name: {bytes, sha256}}")
    return files


def _check_file(root: Path, rel: str, entry: dict) -> None:
    path = root / rel
    if ".." in Path(rel).parts or Path(rel).is_absolute():
        raise CheckpointError(root / MANIFEST, f"lists a path outside the checkpoint: {rel!r}")
    if not path.is_file():
        raise CheckpointError(path, "missing (listed in manifest.json)")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise CheckpointError(path, f"truncated or overwritten: {size:,} bytes, manifest.json says "
                                    f"{entry['bytes']:,}")
    digest = sha256_file(path)
    if digest != entry["sha256"]:
        raise CheckpointError(path, f"checksum mismatch: sha256 {digest[:16]}..., manifest.json says "
                                    f"{entry['sha256'][:16]}... (damaged after it was written)")


def _check_zip(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as z:
            bad = z.testzip()
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except (OSError, zipfile.BadZipFile, EOFError, ValueError) as err:
        raise CheckpointError(path, f"not a readable .npz ({type(err).__name__}: {err})") from None
    if bad is not None:
        raise CheckpointError(path, f"member {bad!r} fails its CRC check (damaged)")


def _read_json(path: Path, what: str) -> dict:
    try:
        obj = json.loads(path.read_bytes().decode("utf-8"))
    except FileNotFoundError:
        raise CheckpointError(path, "missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(path, f"not valid JSON ({err})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(path, f"not a JSON object but a {type(obj).__name__}")
    return obj


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file, read in 256 KiB chunks into one buffer (memory stays flat)."""
    h = hashlib.sha256()
    buffer = bytearray(min(_HASH_CHUNK, max(os.path.getsize(path), 1)))
    view = memoryview(buffer)
    with open(path, "rb") as f:
        while n := f.readinto(buffer):
            h.update(view[:n])
    return h.hexdigest()


def _describe_files(root: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """Size and sha256 of every file under ``root`` but the manifest (``known``: entries the
    shard writers computed while writing)."""
    known = known or {}
    out = {}
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel == MANIFEST:
                continue
            out[rel] = known[rel] if rel in known else {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return out


# npz member names become zip paths; percent-encode "/" (and "%") so names round-trip.
def _encode(name: str) -> str:
    return quote(name, safe="")


def _decode(name: str) -> str:
    return unquote(name)


def _write_json(path: Path, obj, compact: bool = False) -> None:
    """Write ``obj`` as JSON and flush it; ``compact``: one line per entry of ``obj["tensors"]``."""
    with open(path, "w") as f:
        if compact:
            head = {k: v for k, v in obj.items() if k != "tensors"}
            lines = [f" {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in obj["tensors"].items()]
            f.write(json.dumps(head)[:-1] + ', "tensors": {\n' + ",\n".join(lines) + "\n}}\n")
        else:
            json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path, skip: set[str] = frozenset()) -> None:
    """fsync every file (but ``skip``, already flushed by its writer) and directory under ``root``."""
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if Path(path).relative_to(root).as_posix() in skip:
                continue
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))
