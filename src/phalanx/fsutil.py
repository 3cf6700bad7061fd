"""Small file-system helpers for atomic writes (checkpoints, prepared datasets).

Example:
    >>> import os
    >>> pid_alive(os.getpid())
    True
"""

from __future__ import annotations

import os
from pathlib import Path


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
