"""The install as the README gives it: one TensorFlow distribution per extra, none in the base
dependencies; ``phalanx launch -- phalanx ...`` runs the launcher's own ``phalanx`` without an
activated environment; a clear error when no TensorFlow is installed."""

from __future__ import annotations

import doctest
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from phalanx.cluster import launch

ROOT = Path(__file__).resolve().parents[1]
# every distribution that provides the `tensorflow` module (two of them in one environment
# overwrite each other's files)
TENSORFLOW_DISTRIBUTIONS = {"tensorflow", "tensorflow-cpu", "tensorflow-gpu", "tensorflow-intel",
                            "tensorflow-macos", "tf-nightly", "tf-nightly-cpu", "tf-keras"}


def distribution(requirement: str) -> str:
    """``"tensorflow[and-cuda]==2.21.*"`` -> ``"tensorflow"`` (PEP 503 normalised)."""
    name = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement).group(1)
    return re.sub(r"[-_.]+", "-", name).lower()


def test_distribution_names():
    assert distribution("tensorflow[and-cuda]==2.21.*") == "tensorflow"
    assert distribution("TensorFlow_CPU==2.21.*") == "tensorflow-cpu"
    assert distribution("keras>=3.15,<4  # note") == "keras"


def test_each_tensorflow_extra_names_exactly_one_tensorflow_and_the_base_none():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {distribution(r) for r in project["dependencies"]}
    assert not base & TENSORFLOW_DISTRIBUTIONS, "the base dependencies must not choose a TensorFlow build"
    extras = project["optional-dependencies"]
    for extra in ("cpu", "gpu"):
        found = [distribution(r) for r in extras[extra] if distribution(r) in TENSORFLOW_DISTRIBUTIONS]
        assert len(found) == 1, (extra, found)
    assert distribution(extras["cpu"][0]) == "tensorflow-cpu" and "and-cuda" in extras["gpu"][0]
    # the other extras add tools, never a second TensorFlow
    for extra, requirements in extras.items():
        if extra not in ("cpu", "gpu"):
            assert not {distribution(r) for r in requirements} & TENSORFLOW_DISTRIBUTIONS, extra


def test_makefile_installs_the_cpu_build():
    pip_lines = [line for line in (ROOT / "Makefile").read_text().splitlines() if "pip install" in line and "-e" in line]
    assert pip_lines and all("cpu" in line for line in pip_lines), pip_lines


def test_resolve_command_doctests():
    assert doctest.testmod(launch, extraglobs={"main": None}).failed == 0


def test_launch_runs_its_own_phalanx_without_an_activated_environment():
    own = Path(sys.executable).parent / "phalanx"
    if not own.is_file():
        pytest.skip("phalanx is not installed next to this Python (not a pip install)")
    # PATH without this environment's bin directory: a bare `phalanx` is found only by the launcher
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep)
                           if p and Path(p).resolve() != own.parent.resolve())
    done = subprocess.run([str(own), "launch", "--workers", "1", "--network", "host", "--", "phalanx", "--help"],
                          env=dict(os.environ, PATH=path), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[worker:0] usage: phalanx [--version] [--verbose] <command>" in done.stdout
    assert str(own) in done.stderr  # the launcher's status line names the command it started


def test_import_without_tensorflow_says_which_extra_to_install():
    # a Python without site-packages (-S), so without TensorFlow, that sees phalanx's source
    done = subprocess.run([sys.executable, "-S", "-c", "import phalanx"], env=dict(os.environ, PYTHONPATH=str(ROOT / "src")),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ImportError: phalanx needs TensorFlow 2.21" in done.stderr, done.stderr[-2000:]
    assert "pip install 'phalanx[cpu]'" in done.stderr and "'phalanx[gpu]'" in done.stderr
