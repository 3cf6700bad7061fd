"""Shared test helpers: a deterministic text corpus and tiny run configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

TINY_MODEL = ["model.layers=2", "model.d_model=32", "model.heads=2", "model.ffn=64", "model.seq_len=32"]


def write_corpus(directory: Path, files: int = 4, lines: int = 400, seed: int = 0) -> str:
    """Deterministic Python-like text files; returns a glob for ``data.source``."""
    rng = np.random.default_rng(seed)
    words = ["alpha", "beta", "gamma", "delta", "value", "items", "count", "total", "index", "name"]
    directory.mkdir(parents=True, exist_ok=True)
    for f in range(files):
        out = []
        for i in range(lines):
            a, b = rng.choice(words, 2)
            out.append(f"def {a}_{i}({b}):\n    return {b} * {int(rng.integers(1, 99))} + len({a!r})\n")
        (directory / f"part{f}.py").write_text("".join(out))
    return str(directory / "*.py")


def tiny_overrides(tmp_path: Path, corpus: str, run: str = "run", **extra) -> list[str]:
    items = TINY_MODEL + [
        f"data.source={corpus}", f"data.cache_dir={tmp_path / 'cache'}", f"run.dir={tmp_path / run}",
        "train.global_batch=8", "train.warmup=2", "train.log_every=1", "train.eval_every=0",
        "data.val_fraction=0.1",
    ]
    return items + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
