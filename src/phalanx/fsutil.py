"""Small file-system helpers: atomic writes (checkpoints, prepared datasets) and the
one-trainer-per-run-directory lock.

Example:
    >>> import os, tempfile
    >>> pid_alive(os.getpid())
    True
    >>> with RunLock(tempfile.mkdtemp()) as lock:
    ...     lock.holder_pid() == os.getpid()
    True
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from phalanx.config import ConfigError

LOCK_FILE = ".phalanx.lock"


def pid_alive(pid: int) -> bool:
    """Whether a process exists (to tell a crashed writer's temporary dir from a live one)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fsync_dir(path: str | Path) -> None:
    """Flush a directory entry (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RunLock:
    """Exclusive lock on a run directory: at most one trainer writes a ``run.dir``.

    Two trainers on one directory interleave their metrics rows and race for the
    newest checkpoint, so the second one must stop before it writes anything.
    ``flock`` on ``<run_dir>/.phalanx.lock`` does it: the kernel drops the lock when
    the holder exits in any way (``kill -9`` included), so a stale lock cannot
    exist and needs no clean-up; the file only carries the holder's pid, host and
    start time for the error message. ``flock`` (not ``lockf``) because its locks
    belong to the open file, so a second trainer in the *same* process is refused
    too. The file is never deleted: unlinking a lock file lets a waiter lock the
    old inode while a newcomer locks a new one.

    Raises :class:`phalanx.config.ConfigError` (key ``run.dir``, exit status 2 in the
    CLI) naming the holder's pid when the directory is taken.
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir).expanduser()
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> "RunLock":
        """Take the lock or raise ConfigError at once (never waits)."""

        if self._fd is not None:
            return self
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise ConfigError("run.dir", f"cannot create the lock file {str(self.path)!r}: {err.strerror}; "
                                         f"use a writable run.dir") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = _read_holder(fd)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise ConfigError("run.dir", f"cannot lock {str(self.path)!r}: {err.strerror}") from None
            raise ConfigError("run.dir", f"{str(self.run_dir)!r} is in use by another trainer ({holder}); "
                                         f"wait for it to finish, stop it, or use another run.dir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        """Drop the lock (the file stays, emptied, see the class docstring)."""
        if self._fd is None:
            return
        try:
            os.ftruncate(self._fd, 0)
        except OSError:
            pass  # a full or read-only disk must not stop the release
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def holder_pid(self) -> int | None:
        """The pid written by the current holder (None if none is recorded)."""
        try:
            text = self.path.read_text()
        except OSError:
            return None
        parts = text.split()
        return int(parts[1]) if len(parts) > 1 and parts[0] == "pid" and parts[1].isdigit() else None

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _read_holder(fd: int) -> str:
    try:
        text = os.pread(fd, 512, 0).decode(errors="replace").strip()
    except OSError:
        text = ""
    # The holder writes its pid right after locking: an empty file means it is just starting.
    return text or "pid not yet recorded"
