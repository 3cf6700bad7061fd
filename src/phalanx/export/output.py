"""Where an export may be written: refuse what it would destroy, then move it into place.

An export never removes or overwrites anything it did not create:

- an existing ``--output`` (a folder, a file, a link) is refused, before any work;
- a run directory (checkpoints, metrics or its lock inside), a folder holding the run
  being exported, and a path inside a run directory other than its ``export/`` folder
  are never an output, with or without ``overwrite``;
- ``overwrite=True`` (``--overwrite``) replaces only a previous export directory: one
  holding ``export.json`` and nothing but what an export writes (the model file,
  ``export.json``, ``export_report.json``, ``config.yaml``, ``tokenizer/``);
- the export is built in a hidden temporary sibling (``.tmp-<name>-<pid>-...``) and renamed
  into place at the end (``renameat2(RENAME_NOREPLACE)`` on Linux, so a path created
  meanwhile is not replaced either); a failed export removes its temporary directory and
  leaves nothing at ``--output``;
- every file-system failure is a :class:`~phalanx.config.ConfigError` naming the path
  (the CLI prints it on one line and exits 2).

Example:
    >>> import tempfile
    >>> from pathlib import Path
    >>> root = Path(tempfile.mkdtemp())
    >>> check_output(root / "new", overwrite=False) == root / "new"
    True
    >>> (root / "taken").write_text("mine")
    4
    >>> check_output(root / "taken", overwrite=False)
    Traceback (most recent call last):
    ...
    phalanx.config.ConfigError: --output: '.../taken' already exists (a file); export never replaces ...
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import time
from pathlib import Path

from phalanx.config import ConfigError
from phalanx.export.formats import META_FILE, MODEL_FILES, REPORT_FILE
from phalanx.fsutil import LOCK_FILE

#: what an export directory holds (a previous export may be replaced by one with ``overwrite``)
EXPORT_ENTRIES = frozenset({*MODEL_FILES.values(), META_FILE, REPORT_FILE, "config.yaml", "tokenizer"})
#: what marks a run directory (written by ``phalanx train`` / ``phalanx.fit``)
RUN_MARKERS = ("checkpoints", "metrics.jsonl", LOCK_FILE)
#: the folder of a run directory where exports go by default
EXPORT_FOLDER = "export"

_RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a training run's directory (checkpoints, metrics or its lock)."""
    return path.is_dir() and any(os.path.lexists(path / marker) for marker in RUN_MARKERS)


def _kind(path: Path) -> str:
    if path.is_symlink():
        return "a symbolic link"
    if path.is_dir():
        return "a folder"
    return "a file" if path.is_file() else "a special file"


def check_output(out: str | Path, overwrite: bool, run_dir: str | Path | None = None, key: str = "--output") -> Path:
    """``out`` (made absolute) if an export may be written there, else a ConfigError naming it.

    ``run_dir``: the run being exported (its directory, or one holding it, is never an
    output). Also checks that the nearest existing parent is a writable folder, so a
    read-only or file parent fails before any work.
    """
    out = Path(os.path.abspath(Path(out).expanduser()))
    real = Path(os.path.realpath(out))
    if run_dir is not None:
        source = Path(os.path.realpath(Path(run_dir).expanduser()))
        if real == source or source.is_relative_to(real):
            raise ConfigError(key, f"{str(out)!r} is the run directory being exported or holds it; an export "
                                   f"never writes there: choose a new --output (default "
                                   f"RUN_DIR/export/FORMAT-QUANTIZE)")
    _check_not_in_a_run(out, real, key)
    if os.path.lexists(out):
        if not overwrite:
            raise ConfigError(key, f"{str(out)!r} already exists ({_kind(out)}); export never replaces what it "
                                   f"did not write: choose a new --output")
        _check_replaceable(out, real, key)
    _check_parent(out, key)
    return out


def _check_not_in_a_run(out: Path, real: Path, key: str) -> None:
    """A run directory, or a path inside one other than its ``export/`` folder, is never an output."""
    if is_run_dir(real):
        raise ConfigError(key, f"{str(out)!r} is a run directory; an export never writes there: choose a new "
                               f"--output")
    for parent in real.parents:
        if is_run_dir(parent) and not real.is_relative_to(parent / EXPORT_FOLDER):
            raise ConfigError(key, f"{str(out)!r} is inside the run directory {str(parent)!r}; an export goes "
                                   f"there only under {EXPORT_FOLDER}/ (the default), or outside it")


def _check_replaceable(out: Path, real: Path, key: str) -> None:
    """With ``overwrite``: ``out`` must be a previous export directory, outside any run."""
    if out.is_symlink() or not out.is_dir():
        raise ConfigError(key, f"{str(out)!r} is {_kind(out)}, not a previous export directory; --overwrite "
                               f"replaces only an export (a folder holding {META_FILE})")
    _check_not_in_a_run(out, real, key)
    if not (out / META_FILE).is_file():
        raise ConfigError(key, f"{str(out)!r} holds no {META_FILE}: not a previous export; --overwrite replaces "
                               f"only an export directory")
    try:
        others = sorted(name for name in os.listdir(out) if name not in EXPORT_ENTRIES)
    except OSError as err:
        raise io_error(out, err, key) from None
    if others:
        raise ConfigError(key, f"{str(out)!r} holds files an export does not write ({', '.join(others[:5])}); "
                               f"--overwrite never removes them: move them, or choose a new --output")


def _check_parent(out: Path, key: str) -> None:
    parent = out.parent
    while not os.path.lexists(parent) and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(key, f"cannot write {str(out)!r}: {str(parent)!r} is {_kind(parent)}, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(key, f"cannot write {str(out)!r}: the folder {str(parent)!r} is not writable "
                               f"(permission denied or a read-only file system); choose another --output")


def io_error(path: Path, err: OSError, key: str = "--output") -> ConfigError:
    """One line naming ``path`` (or the file the OS names) and the OS's reason."""
    where = err.filename if err.filename else path
    code = errno.errorcode.get(err.errno, "") if err.errno else ""
    return ConfigError(key, f"cannot write the export {str(path)!r}: {where}: {err.strerror or err}"
                            f"{f' [{code}]' if code else ''}; nothing was left there")


def make_temporary(out: Path, key: str = "--output") -> Path:
    """A new hidden sibling of ``out`` (the parents made as needed) to build the export in."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".tmp-{out.name}-{os.getpid()}-{time.monotonic_ns()}"
        tmp.mkdir()
    except OSError as err:
        raise io_error(out, err, key) from None
    return tmp


def move_into_place(tmp: Path, out: Path, overwrite: bool, key: str = "--output") -> None:
    """Rename the finished ``tmp`` to ``out``. A previous export at ``out`` (allowed by
    :func:`check_output` with ``overwrite``, checked again here) is moved aside first and
    deleted after; anything else found at ``out`` now is refused, not replaced."""
    if os.path.lexists(out):
        if not overwrite:
            raise ConfigError(key, f"{str(out)!r} appeared while exporting ({_kind(out)}); it was left as it is: "
                                   f"choose a new --output")
        _check_replaceable(out, Path(os.path.realpath(out)), key)
        old = out.parent / f".tmp-old-{out.name}-{os.getpid()}-{time.monotonic_ns()}"
        os.rename(out, old)
        try:
            _rename_noreplace(tmp, out)
        except BaseException:
            os.rename(old, out)  # put the previous export back
            raise
        shutil.rmtree(old, ignore_errors=True)
        return
    _rename_noreplace(tmp, out)


def _rename_noreplace(src: Path, dst: Path) -> None:
    """``rename`` that fails with EEXIST instead of replacing ``dst`` (a plain ``rename`` of a
    folder silently replaces an empty folder at ``dst``)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        renameat2 = None
    if renameat2 is not None:
        if renameat2(_AT_FDCWD, os.fsencode(src), _AT_FDCWD, os.fsencode(dst), _RENAME_NOREPLACE) == 0:
            return
        code = ctypes.get_errno()
        if code not in (errno.ENOSYS, errno.EINVAL):  # not supported here: the checked rename below
            raise OSError(code, os.strerror(code), str(dst))
    if os.path.lexists(dst):
        raise OSError(errno.EEXIST, os.strerror(errno.EEXIST), str(dst))
    os.rename(src, dst)
