"""Layout-independent, atomic, verified checkpoints.

A checkpoint is a directory ``<run.dir>/checkpoints/step-00000100/`` holding

- ``tensors.npz``: the engine's ``state_dict()``, whole tensors under logical names
  (weights, AdamW moments, optimizer step, loss scale), so a checkpoint written by one
  parallel layout loads into any other;
- ``meta.json``: format, step, the config, the layout that wrote it, wall time;
- ``data/``: the input iterator's position (written by the data pipeline);
- ``manifest.json``, written last: size and sha256 of every other file.

Saving refuses non-finite tensors (a diverged run must not replace its last good
checkpoint), writes everything into a hidden temporary directory, flushes it to
disk and renames it into place: a process killed mid-save leaves the previous
checkpoints untouched and no half-written ``step-*`` directory (rename is atomic on
POSIX). Before writing it prunes to ``keep - 1`` old checkpoints (never the newest),
so lowering ``checkpoint.keep`` frees the space the new one needs; an I/O error
(disk full, read-only, ...) is a one-line :class:`CheckpointError` naming the path and
the bytes needed, with the temporary directory removed.

Loading verifies: every file against the manifest, ``meta.json`` and the data
position parse and name the step of the directory, the tensors are finite.
:func:`restore_latest` / :func:`latest_valid` skip a damaged newest checkpoint with a
warning naming the file and the fault, and fall back to the newest valid one.
Checkpoints of format 1 (before manifests) still load, unverified, with a warning.

Example:
    >>> import tempfile, numpy as np
    >>> root = tempfile.mkdtemp()
    >>> path = save(root, 5, {"w": np.ones(3, np.float32)}, meta={"note": "x"})
    >>> sorted(p.name for p in path.iterdir())
    ['manifest.json', 'meta.json', 'tensors.npz']
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
import time
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote, unquote

import numpy as np

from phalanx.config import ConfigError
from phalanx.fsutil import fsync_dir, pid_alive

PREFIX = "step-"
FORMAT_VERSION = 2
#: formats this phalanx reads: 1 (no manifest, loaded unverified with a warning) and 2
READABLE_FORMATS = (1, 2)
TENSORS = "tensors.npz"
META = "meta.json"
MANIFEST = "manifest.json"
#: the data pipeline's position file (phalanx.data.pipeline.ITERATOR_FILE inside ``data/``)
DATA_POSITION = "data/data_iterator.json"
#: where damaged checkpoints newer than the resumed one are moved (kept for inspection)
DAMAGED_DIR = "damaged"
_HASH_CHUNK = 1 << 20


class CheckpointError(ConfigError):
    """A checkpoint cannot be written or read. ``key`` (and ``path``) is the file or
    directory at fault; the message says what is wrong. A ConfigError, so the CLI
    prints it on one line and exits 2."""

    def __init__(self, path: str | Path, message: str):
        super().__init__(str(path), message)
        self.path = Path(path)


class CheckpointWarning(UserWarning):
    """A checkpoint was skipped (damaged) or loaded unverified (format 1)."""


@dataclass
class Restored:
    path: Path
    step: int
    tensors: dict[str, np.ndarray]
    meta: dict


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def step_of(path: str | Path) -> int | None:
    """The step in a ``step-00000012`` directory name (None for any other name)."""
    name = Path(path).name
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


# ---------------------------------------------------------------------------
# Saving


def save(root: str | Path, step: int, tensors: dict[str, np.ndarray], meta: dict | None = None,
         writers: dict[str, Callable[[Path], None]] | None = None, keep: int | None = None) -> Path:
    """Atomically write checkpoint ``step`` under ``root``; keep the newest ``keep``.

    ``writers`` maps a sub-directory name to a function that fills it (e.g. the data
    iterator's state), run inside the temporary directory before the manifest and the
    rename. Raises :class:`CheckpointError` before writing anything if a tensor is not
    finite or the file system lacks the space, and after cleaning up if writing fails;
    the checkpoints already there stay as they were (except those pruned by ``keep``).
    """
    root = Path(root)
    check_finite(tensors, f"refusing to save step {step}")
    final = step_dir(root, step)
    needed = estimate_bytes(tensors)
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
    try:
        tmp.mkdir()
        write_tensors(tmp / TENSORS, tensors)
        for name, write in (writers or {}).items():
            sub = tmp / name
            sub.mkdir()
            write(sub)
        info = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "tensors": len(tensors),
                **(meta or {})}
        _write_json(tmp / META, info)
        _write_json(tmp / MANIFEST, {"format": FORMAT_VERSION, "step": step, "files": _describe_files(tmp)})
        _fsync_tree(tmp)
        _replace_dir(tmp, final)
        fsync_dir(root)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _io_error(root, step, err, needed) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep:
        prune(root, keep)
    return final


def write_tensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write ``tensors`` as an uncompressed ``.npz`` at ``path`` and flush it to disk."""
    with open(path, "wb") as f:
        np.savez(f, **{_encode(k): v for k, v in tensors.items()})
        f.flush()
        os.fsync(f.fileno())


def check_finite(tensors: dict[str, np.ndarray], what: str, where: str | Path | None = None) -> None:
    """Raise :class:`CheckpointError` naming every tensor holding NaN or inf."""
    bad = []
    for name, value in tensors.items():
        value = np.asarray(value)
        if value.dtype.kind not in "fc" or value.size == 0:
            continue
        finite = np.isfinite(value)
        if not finite.all():
            nans = int(np.isnan(value).sum())
            bad.append(f"{name} ({nans} NaN, {int(value.size - finite.sum()) - nans} inf of {value.size})")
    if bad:
        shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise CheckpointError(where or "checkpoint", f"{what}: non-finite values in {shown}; the training "
                              f"diverged (lower train.lr, raise train.warmup, or use train.clip_norm); "
                              f"the last good checkpoint is kept")


def estimate_bytes(tensors: dict[str, np.ndarray]) -> int:
    """Bytes a checkpoint of ``tensors`` takes on disk: the data, ~400 bytes of npy and
    zip headers per tensor, and six 4 KiB blocks (the small json files, their dirs, the
    npz's last block)."""
    return int(sum(np.asarray(v).nbytes for v in tensors.values()) + 400 * len(tensors) + 6 * 4096)


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
    ``meta.json`` or data position; a step that differs from the directory's name.
    A format-1 checkpoint (no manifest) gets a :class:`CheckpointWarning` and only the
    structural checks (and the zip CRCs of its tensors).
    """
    path = Path(path)
    step = step_of(path)
    if not path.is_dir() or step is None:
        raise CheckpointError(path, f"not a checkpoint directory (expected {PREFIX}<step>/)")
    manifest = path / MANIFEST
    if manifest.is_file():
        listed = _read_manifest(manifest)
        for rel, entry in listed.items():
            _check_file(path, rel, entry)
        for required in (TENSORS, META):
            if required not in listed:
                raise CheckpointError(manifest, f"lists no {required}; the checkpoint is incomplete")
        meta = _read_json(path / META, "meta.json")
        has_position = DATA_POSITION in listed
    else:
        meta = _read_json(path / META, "meta.json")
        if meta.get("format") != 1:
            raise CheckpointError(manifest, f"missing; a format-{meta.get('format')} checkpoint is only "
                                            f"complete with it (the save did not finish or the file was deleted)")
        warnings.warn(f"{path} has no {MANIFEST} (format 1, written before checksums): loading it unverified",
                      CheckpointWarning, stacklevel=2)
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
    if has_position:
        position = _read_json(path / DATA_POSITION, "the data position")
        data_step = position.get("step")
        if data_step != step:
            raise CheckpointError(path / DATA_POSITION, f"puts the data at step {data_step!r}, but the "
                                                        f"checkpoint is step {step}; resuming would repeat or "
                                                        f"skip batches")
    return meta


def restore(path: str | Path, verify_files: bool = True) -> Restored:
    """Read a checkpoint directory written by :func:`save`, verified (see :func:`verify`)
    and with every float tensor checked finite; raises :class:`CheckpointError`."""
    path = Path(path)
    meta = verify(path) if verify_files else _read_json(path / META, "meta.json")
    try:
        with np.load(path / TENSORS, allow_pickle=False) as data:
            tensors = {_decode(k): data[k] for k in data.files}
    except FileNotFoundError:
        raise CheckpointError(path / TENSORS, "missing") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as err:
        raise CheckpointError(path / TENSORS, f"unreadable ({type(err).__name__}: {err})") from None
    check_finite(tensors, "holds non-finite tensors", where=path / TENSORS)
    return Restored(path=path, step=int(meta["step"]), tensors=tensors, meta=meta)


def restore_latest(root: str | Path, warn: Callable[[str], None] | None = None) -> Restored | None:
    """The newest checkpoint under ``root`` that loads and verifies (:func:`restore`).

    A damaged newer one is skipped with a warning (``warn(text)``, by default a
    :class:`CheckpointWarning`) naming the file and the fault. Returns None when
    ``root`` holds no checkpoint; raises :class:`CheckpointError` listing every fault
    when it holds some but none is valid.
    """
    return _newest(root, restore, warn)


def latest_valid(root: str | Path, warn: Callable[[str], None] | None = None) -> Path | None:
    """Like :func:`restore_latest` but verifies files only (checksums, meta, data
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
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _describe_files(root: Path) -> dict[str, dict]:
    out = {}
    for dirpath, _, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST:
                out[rel] = {"bytes": path.stat().st_size, "sha256": sha256_file(path)}
    return out


# npz member names become zip paths; percent-encode "/" (and "%") so names round-trip.
def _encode(name: str) -> str:
    return quote(name, safe="")


def _decode(name: str) -> str:
    return unquote(name)


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, default=str)
        f.flush()
        os.fsync(f.fileno())


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(dirpath))
