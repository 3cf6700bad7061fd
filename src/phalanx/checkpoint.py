"""Layout-independent, atomic checkpoints.

A checkpoint is a directory ``<run.dir>/checkpoints/step-00000100/`` holding

- ``tensors.npz``: the engine's ``state_dict()``, whole tensors under logical names
  (weights, AdamW moments, optimizer step, loss scale), so a checkpoint written by one
  parallel layout loads into any other;
- ``meta.json``: step, the config, the layout that wrote it, wall time;
- ``data/``: the input iterator's position (written by the data pipeline).

Saving writes everything into a hidden temporary directory, flushes it to disk and
renames it into place: a process killed mid-save leaves the previous checkpoints
untouched and no half-written ``step-*`` directory (rename is atomic on POSIX).

Example:
    >>> import tempfile, numpy as np
    >>> root = tempfile.mkdtemp()
    >>> path = save(root, 5, {"w": np.ones(3, np.float32)}, meta={"note": "x"})
    >>> latest(root).name
    'step-00000005'
    >>> restore(latest(root)).tensors["w"].tolist()
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import quote, unquote

import numpy as np

from phalanx.fsutil import fsync_dir, pid_alive

PREFIX = "step-"
FORMAT_VERSION = 1


class CheckpointError(RuntimeError):
    pass


@dataclass
class Restored:
    path: Path
    step: int
    tensors: dict[str, np.ndarray]
    meta: dict


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def save(root: str | Path, step: int, tensors: dict[str, np.ndarray], meta: dict | None = None,
         writers: dict[str, Callable[[Path], None]] | None = None, keep: int | None = None) -> Path:
    """Atomically write checkpoint ``step`` under ``root``; prune to the newest ``keep``.

    ``writers`` maps a sub-directory name to a function that fills it (e.g. the data
    iterator's state), run inside the temporary directory before the rename.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    try:
        with open(tmp / "tensors.npz", "wb") as f:
            np.savez(f, **{_encode(k): v for k, v in tensors.items()})
            f.flush()
            os.fsync(f.fileno())
        for name, write in (writers or {}).items():
            sub = tmp / name
            sub.mkdir()
            write(sub)
        info = {"format": FORMAT_VERSION, "step": step, "time": time.time(), "tensors": len(tensors),
                **(meta or {})}
        _write_json(tmp / "meta.json", info)
        _fsync_tree(tmp)
        if final.exists():  # re-saving the same step (e.g. after a resume): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep:
        prune(root, keep)
    return final


def all_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under ``root``, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)
             and (p / "meta.json").is_file() and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest(root: str | Path) -> Path | None:
    found = all_checkpoints(root)
    return found[-1] if found else None


def prune(root: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoints and any stale temporary dirs."""
    found = all_checkpoints(root)
    for old in found[:-keep] if keep else []:
        shutil.rmtree(old, ignore_errors=True)
    for tmp in Path(root).glob(".tmp-*"):
        pid = tmp.name.split("-")[-2] if tmp.name.count("-") >= 3 else ""
        if pid.isdigit() and not pid_alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def restore(path: str | Path) -> Restored:
    """Read a checkpoint directory written by :func:`save`."""
    path = Path(path)
    meta_file = path / "meta.json"
    if not meta_file.is_file():
        raise CheckpointError(f"{path} is not a complete checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {meta.get('format')!r}, this phalanx reads "
                              f"{FORMAT_VERSION}")
    try:
        with np.load(path / "tensors.npz", allow_pickle=False) as data:
            tensors = {_decode(k): data[k] for k in data.files}
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path}/tensors.npz cannot be read: {err}") from None
    return Restored(path=path, step=int(meta["step"]), tensors=tensors, meta=meta)


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
