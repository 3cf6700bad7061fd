"""Text sources: the embedded standard-library corpus and globs of text files.

The embedded corpus is the running interpreter's own standard library: every ``.py``
file under ``sysconfig.get_paths()["stdlib"]``, in sorted path order, except the
directories named in :data:`STDLIB_SKIP_DIRS` (installed third-party packages,
the regression-test suites, whose files include deliberately broken encodings and
multi-megabyte data fixtures, and byte-code caches). On CPython 3.11 that is ~730
files, ~12 MB. It needs no download and is the same on every machine with the same
Python version.

A file that is not valid UTF-8 is skipped (and counted); NUL characters are removed,
because id 0 separates documents.

Example:
    >>> from phalanx.data.corpus import stdlib_files, read_documents
    >>> files = stdlib_files()
    >>> docs = read_documents(files, root=stdlib_root(), max_bytes=10_000)
    >>> sum(len(d.text.encode()) for d in docs.documents) <= 10_000
    True
"""

from __future__ import annotations

import glob
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class Document:
    """One unit of text; ``name`` is its path relative to the source root."""

    name: str
    text: str


@dataclass(frozen=True)
class Corpus:
    documents: list[Document]
    skipped: list[str] = field(default_factory=list)  # names of files that were not UTF-8
    truncated: bool = False  # True when max_bytes cut the corpus short

    @property
    def num_bytes(self) -> int:
        return sum(len(d.text.encode("utf-8")) for d in self.documents)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library (see module docstring)."""
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for directory, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in STDLIB_SKIP_DIRS]
        found.extend(Path(directory) / f for f in files if f.endswith(".py"))
    return sorted(found)


def glob_files(pattern: str) -> list[Path]:
    """Sorted regular files matching ``pattern`` (``~`` expanded, ``**`` recursive)."""
    return sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))


def glob_root(pattern: str) -> Path:
    """The directory part of ``pattern`` before its first wildcard (names are relative to it)."""
    parts = Path(os.path.expanduser(pattern)).parts
    fixed = []
    for part in parts:
        if any(c in part for c in "*?["):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path(".")


def read_documents(paths: Sequence[Path], root: str | Path, max_bytes: int = 0) -> Corpus:
    """Read ``paths`` as UTF-8 documents; stop once ``max_bytes`` (0: no cap) is reached,
    cutting the last document at a character boundary."""
    root = Path(root)
    docs: list[Document] = []
    skipped: list[str] = []
    total = 0
    for path in paths:
        name = _relative_name(path, root)
        try:
            text = Path(path).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            skipped.append(name)
            continue
        text = text.replace("\x00", "")
        if not text:
            continue
        if max_bytes:
            raw = text.encode("utf-8")
            room = max_bytes - total
            if len(raw) >= room:
                text = raw[:room].decode("utf-8", errors="ignore")
                if text:
                    docs.append(Document(name, text))
                return Corpus(docs, skipped, truncated=True)
            total += len(raw)
        docs.append(Document(name, text))
    return Corpus(docs, skipped, truncated=False)


def files_fingerprint(paths: Sequence[Path], root: str | Path) -> str:
    """sha256 of (relative name, size, mtime) of every file: changes when any file does."""
    h = hashlib.sha256()
    for path in paths:
        st = os.stat(path)
        h.update(f"{_relative_name(path, Path(root))}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def python_tag() -> str:
    """``py3.11.7`` style tag of the running interpreter (the stdlib corpus depends on it)."""
    v = sys.version_info
    return f"py{v.major}.{v.minor}.{v.micro}"


def _relative_name(path: Path, root: Path) -> str:
    # String arithmetic, not resolve(): paths come from walking or globbing under root,
    # and resolving ~1,500 paths per run costs most of a second.
    rel = os.path.relpath(path, root)
    return Path(path).as_posix() if rel.startswith("..") else Path(rel).as_posix()
