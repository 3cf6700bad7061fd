"""The matmul peak probe's cache holds only figures that still hold, and MFU is never above 100%.

The cache (``$XDG_CACHE_HOME/phalanx/matmul_peak.json``, here in a temporary directory) records
when and under what load each peak was measured; a figure recorded without them, older than
PEAK_MAX_AGE_DAYS or measured under load on a machine that is quieter now is measured again.
A run that beats its peak measures it again, and reports no MFU if it still beats it.
"""

from __future__ import annotations

import json
import time

import pytest

from phalanx.config import load_config
from phalanx.plan import hardware
from phalanx.train.metrics import RunPeak, mfu_text
from phalanx.train.trainer import Summary

PROBE = dict(seconds=0.05, size=256)  # a short real probe: tens of GFLOP/s on any CPU of today


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache directory (XDG_CACHE_HOME) and a writer of fake entries for this machine."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tmp_path / "phalanx" / "matmul_peak.json"
    key = hardware._machine_key("float32")

    def write(entry) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({key: entry}))

    def read():
        return json.loads(path.read_text())[key]

    return write, read


def record(flops: float, age_days: float = 0.0, load: float = 0.0) -> dict:
    return {"flops": flops, "measured_at": time.time() - age_days * 86400, "load_per_cpu": load, "cpu": "x"}


def test_a_fresh_record_is_read_without_measuring(cache):
    write, read = cache
    write(record(1234.0))
    assert hardware.measure_matmul_peak("float32", **PROBE) == 1234.0  # a probe would give ~1e9 or more
    assert read()["flops"] == 1234.0


@pytest.mark.parametrize("entry", [1234.0, record(1234.0, age_days=hardware.PEAK_MAX_AGE_DAYS + 1),
                                   record(1234.0, load=50.0)],
                         ids=["without_date_or_load", "too_old", "measured_under_load"])
def test_a_record_that_no_longer_holds_is_measured_again(cache, entry):
    write, read = cache
    write(entry)
    before = time.time()
    peak = hardware.measure_matmul_peak("float32", **PROBE)
    assert peak > 1e6  # measured, not the 1,234 FLOP/s written above
    now = read()
    assert now["flops"] == peak and now["measured_at"] >= before and now["load_per_cpu"] >= 0
    assert now["cpu"] == hardware.cpu_model()


def test_a_run_faster_than_its_cached_peak_measures_it_again(cache):
    write, read = cache
    write(record(1.0))  # e.g. measured while the machine was busy: 1 FLOP/s, and recent
    said = []
    run = RunPeak(load_config(None, ["precision.policy=float32"]), 1, say=said.append)
    assert run.peak == 1.0
    util = run.mfu(flops_per_step=1e6, step_time_s=1.0)  # 1 MFLOP/s: far below any real peak
    assert said and "the peak probe is stale, re-measuring" in said[0]
    assert 0 < util < 1 and run.peak == read()["flops"] > 1e6
    # A step faster than the new peak too: no MFU (never a figure above 100%), said once.
    assert run.mfu(flops_per_step=1e20, step_time_s=1.0) is None
    assert run.mfu(flops_per_step=1e20, step_time_s=1.0) is None
    assert len(said) == 2 and said[1].startswith("MFU unavailable")


def test_an_unavailable_mfu_is_printed_as_such(tmp_path):
    summary = Summary(steps=3, loss=1.0, eval_loss=None, tokens_per_s=10.0, mfu=None, wall_s=1.0, skipped_steps=0,
                      run_dir=tmp_path, checkpoint=None)
    assert "MFU n/a" in summary.line() and "%" not in summary.line().split("MFU")[1].split(",")[0]
    assert mfu_text(0.5) == "MFU 50.0%"


def test_the_docstring_examples_run():
    import doctest

    from phalanx.train import metrics

    assert doctest.testmod(hardware).failed == 0 and doctest.testmod(metrics).failed == 0
