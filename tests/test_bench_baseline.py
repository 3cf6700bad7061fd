"""bench_gpt.py --baseline-src refuses, before anything is built, a path that is not the src/
directory of a phalanx checkout (no benchmark runs here)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"


def _load(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))  # bench_gpt imports its neighbour as a script does
    spec = importlib.util.spec_from_file_location(f"_test_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)
    spec.loader.exec_module(module)
    return module


def test_bench_gpt_refuses_a_path_that_is_not_a_phalanx_src_tree(tmp_path, monkeypatch, capsys):
    bench_gpt = _load("bench_gpt", monkeypatch)
    (tmp_path / "src").mkdir()
    with pytest.raises(SystemExit) as exit_:
        bench_gpt.parse_args(["--baseline-src", str(tmp_path / "src")])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--baseline-src" in err and "is not a phalanx source tree (no phalanx/__init__.py in it)" in err
    assert "git worktree add --detach" in err  # says how to make one


def test_a_src_tree_needs_its_checkouts_bench_gpt(tmp_path, monkeypatch):
    baseline = _load("baseline_gpt", monkeypatch)
    (tmp_path / "src" / "phalanx").mkdir(parents=True)
    (tmp_path / "src" / "phalanx" / "__init__.py").write_text("")
    with pytest.raises(ValueError, match=r"--baseline-src: .* no benchmarks/bench_gpt.py with a PhalanxRunner"):
        baseline.check_src(tmp_path / "src")
    # this checkout's own src/ is a valid baseline
    assert baseline.check_src(BENCH.parent / "src") == (BENCH.parent / "src").resolve()
