"""What `phalanx train` prints: no TensorFlow log lines unless --verbose, a status line naming
the whole layout, and the first (building) step timed apart from the throughput."""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import tiny_overrides, write_corpus

TF_LINE = re.compile(r"^[EWI]\d{4} |cpu_feature_guard|oneDNN custom operations|absl::InitializeLog", re.M)
LAYOUT_PARTS = ("dp=2", "tp=1", "pp=1", "ep=1", "schedule=1f1b", "microbatches=1", "grad_accum=2", "zero=1",
                "recompute=full", "sequence_parallel=off", "float32", "workers=1")


def run(*args, env=None):
    # The `phalanx` program (python -m phalanx.cli is the console script's main()), with oneDNN on
    # so that TensorFlow has its banner to print.
    base = {k: v for k, v in os.environ.items() if k != "PHALANX_VERBOSE"}
    env = {**base, "TF_ENABLE_ONEDNN_OPTS": "1", **(env or {})}

    return subprocess.run([sys.executable, "-m", "phalanx.cli", *args], capture_output=True, text=True,
                          timeout=600, env=env)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


def test_quiet_run_prints_no_tensorflow_lines_and_the_whole_layout(tmp_path, corpus):
    args = tiny_overrides(tmp_path, corpus, train__steps=3, parallel__devices="cpu:2", parallel__dp=2,
                          parallel__zero=1, parallel__recompute="full", train__grad_accum=2,
                          precision__policy="float32")
    proc = run("train", *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert not TF_LINE.search(out), TF_LINE.search(out).group(0) + "\n" + out[-3000:]
    status = next(line for line in proc.stderr.splitlines() if line.startswith("model: "))
    for part in LAYOUT_PARTS:
        assert part in status.replace(";", " ").split(), (part, status)
    # the first step is reported as the build, and its time is not in the first throughput
    assert re.search(r"^building the step \(\d+ s\)$", proc.stderr, re.M), proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert "build_s" in rows[0] and all("build_s" not in r for r in rows[1:])
    step1 = next(line for line in proc.stderr.splitlines() if line.startswith("step 1/3"))
    assert "tok/s" not in step1 and "building the step" in step1


def test_verbose_shows_tensorflow_lines(tmp_path, corpus):
    args = tiny_overrides(tmp_path, corpus, train__steps=1)
    # (--verbose anywhere on the line sets PHALANX_VERBOSE: phalanx.cli.verbose_requested's doctest)
    proc = run("train", *args, env={"PHALANX_VERBOSE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "oneDNN custom operations" in proc.stderr  # the filter, not TensorFlow, is what hides it


def test_version():
    from phalanx import __version__
    proc = run("--version")
    assert proc.returncode == 0 and proc.stdout.strip() == f"phalanx {__version__}"


def test_cli_doctests():
    import doctest

    from phalanx import cli
    assert doctest.testmod(cli).failed == 0


def test_the_filter_drops_native_noise_written_in_pieces_and_keeps_the_rest():
    program = """
import os, sys, time
from phalanx.cli import filter_native_stderr
filter_native_stderr()
os.write(2, b"I0000 00:00:1795793210.844681    9028 port.cc:153] oneDNN custom operations are on.\\n")
os.write(2, b"fully_quantize: ")  # a C++ stream writes a line in pieces
time.sleep(0.05)
os.write(2, b"0, inference_type: 6, input_inference_type: FLOAT32\\n")
os.write(2, b"E0000 00:00:1795793210.8 9028 op.cc:1] a real error\\n")
os.write(2, b"partial line without newline")
time.sleep(0.5)
print("python's stderr", file=sys.stderr)
os.write(2, b"native line\\n")
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["E0000 00:00:1795793210.8 9028 op.cc:1] a real error",
                                        "partial line without newline" + "python's stderr", "native line"], proc.stderr


def test_a_native_crash_still_gets_its_last_line_out():
    program = """
import os
from phalanx.cli import filter_native_stderr
filter_native_stderr()
os.write(2, b"F0000 00:00:1795793210.8 9028 op.cc:1] Check failed: a fatal error\\n")
os.abort()
"""
    proc = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Check failed: a fatal error" in proc.stderr, proc.stderr
