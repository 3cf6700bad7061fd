"""Pipeline schedule tables, their validity, the simulator and `phalanx schedule`."""

from __future__ import annotations

import doctest

import pytest

from phalanx.commands import schedule as schedule_cli
from phalanx.parallel import schedule_plot, schedules
from phalanx.parallel.schedules import (Action, Schedule, build_schedule, bubble_formula, dependencies,
                                        peak_in_flight, render_text, validate_order)
from phalanx.plan import simulator
from phalanx.plan.simulator import simulate

CASES = [(name, pp, m, v)
         for name in ("gpipe", "1f1b", "zb")
         for pp in (1, 2, 3, 4, 8)
         for m in (1, 2, 3, 4, 8, 13)
         for v in (1,)]
CASES += [("interleaved", pp, m, v) for pp in (1, 2, 3, 4) for m in (pp, 2 * pp, 4 * pp) for v in (1, 2, 3, 4)]


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_every_table_is_complete_and_deadlock_free(name, pp, m, v):
    s = build_schedule(name, pp, m, v)
    validate_order(s)
    tl = simulate(s, 1.0, 2.0)
    assert len(tl.events) == sum(len(r) for r in s.per_stage)
    assert 0.0 <= tl.bubble_fraction < 1.0
    assert list(tl.peak_in_flight) == peak_in_flight(s)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 8), (4, 16), (8, 3), (3, 7)])
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_flush_schedules_bubble_equals_formula(name, pp, m):
    for f, b in ((1.0, 2.0), (1.0, 1.0), (0.3, 0.7)):
        assert simulate(build_schedule(name, pp, m), f, b).bubble_fraction == pytest.approx(
            (pp - 1) / (m + pp - 1), abs=1e-12)


@pytest.mark.parametrize("pp,m,v", [(2, 4, 2), (4, 8, 2), (4, 16, 4), (3, 9, 3)])
def test_interleaved_bubble_shrinks_by_virtual_stages(pp, m, v):
    tl = simulate(build_schedule("interleaved", pp, m, v), 1.0, 2.0)
    assert tl.bubble_fraction == pytest.approx(bubble_formula(pp, m, v), abs=1e-12)
    assert tl.bubble_fraction < bubble_formula(pp, m)


def test_gpipe_holds_all_microbatches_and_1f1b_at_most_pp():
    assert peak_in_flight(build_schedule("gpipe", 4, 8)) == [8, 8, 8, 8]
    for pp in (1, 2, 4, 8):
        for m in (1, 3, 8, 32):
            peaks = peak_in_flight(build_schedule("1f1b", pp, m))
            assert peaks == [min(pp - r, m) for r in range(pp)]
            assert max(peaks) <= pp


def test_1f1b_is_one_forward_one_backward_in_steady_state():
    s = build_schedule("1f1b", 4, 8)
    kinds = "".join(a.kind for a in s.per_stage[1])
    # rank 1: 2 warm-up forwards, then alternate, then 2 cool-down backwards
    assert kinds == "FF" + "FB" * 6 + "BB"
    assert [a.microbatch for a in s.per_stage[3] if a.kind == "B"] == list(range(8))


def test_interleaved_uses_every_chunk_in_megatron_order():
    s = build_schedule("interleaved", 2, 4, 2)
    assert [str(a) for a in s.per_stage[0][:4]] == ["F0", "F1", "F0c1", "F1c1"]
    # model stage of chunk c on rank r is c*pp + r
    assert s.model_stage(1, Action("F", 0, 1)) == 3
    assert s.rank_of(3) == (1, 1)
    # the last model stage's backward starts right after its own forward
    assert dependencies(s, 1, Action("B", 0, 1)) == ((1, Action("F", 0, 1)),)
    assert dependencies(s, 0, Action("F", 0, 1)) == ((1, Action("F", 0, 0)),)


def test_zero_bubble_splits_backward_and_beats_1f1b():
    for pp, m in ((4, 8), (4, 16), (8, 16)):
        zb = build_schedule("zb", pp, m)
        assert zb.split_backward
        one = simulate(build_schedule("1f1b", pp, m), 1.0, 2.0).bubble_fraction
        tl = simulate(zb, 1.0, 2.0)
        # ZB-H1 at T_F = T_B = T_W: (p-1)/(3m+p-1)
        assert tl.bubble_fraction == pytest.approx((pp - 1) / (3 * m + pp - 1), abs=1e-12)
        assert tl.bubble_fraction < one
        assert max(peak_in_flight(zb)) <= 2 * pp


def test_validate_order_catches_deadlock_and_missing_actions():
    good = build_schedule("1f1b", 2, 2)
    swapped = (tuple(reversed(good.per_stage[0])), good.per_stage[1])  # B before its F
    with pytest.raises(ValueError, match="deadlocks"):
        validate_order(Schedule("bad", 2, 2, 1, swapped))
    with pytest.raises(ValueError, match="incomplete"):
        validate_order(Schedule("bad", 2, 2, 1, (good.per_stage[0][:-1], good.per_stage[1])))


@pytest.mark.parametrize("args,match", [
    (("nope", 2, 2), "not known"),
    (("1f1b", 0, 2), "pp must be"),
    (("1f1b", 2, 0), "microbatches must be"),
    (("1f1b", 2, 4, 2), "needs the 'interleaved'"),
    (("interleaved", 4, 6, 2), "multiple of pp=4"),
])
def test_bad_arguments_raise_clear_errors(args, match):
    with pytest.raises(ValueError, match=match):
        build_schedule(*args)


def test_simulator_costs_per_stage_and_comm():
    s = build_schedule("gpipe", 2, 1)
    tl = simulate(s, [1.0, 3.0], [2.0, 6.0], comm_cost=0.5)
    # F0 r0 [0,1], F0 r1 [1.5,4.5], B0 r1 [4.5,10.5], B0 r0 [11,13]
    assert tl.makespan == pytest.approx(13.0)
    with pytest.raises(ValueError, match="one cost per model stage"):
        simulate(s, [1.0], 2.0)


def test_render_and_png(tmp_path):
    s = build_schedule("interleaved", 2, 2, 2)
    text = render_text(s)
    assert "virtual_stages=2" in text and "F0c1" in text
    out = schedule_plot.draw_png(simulate(s), str(tmp_path / "t.png"))
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.endswith("t.png")


def test_cli(tmp_path, capsys):
    png = tmp_path / "s.png"
    assert schedule_cli.main(["parallel.pp=4", "parallel.microbatches=8", "parallel.schedule=1f1b",
                              "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "0.2727" in out and "[4, 3, 2, 1]" in out
    assert png.stat().st_size > 1000
    assert schedule_cli.main(["parallel.pp=4", "parallel.microbatches=6", "parallel.schedule=interleaved",
                              "parallel.virtual_stages=2"]) == 2
    err = capsys.readouterr().err
    assert "parallel.microbatches" in err and "multiple of pp=4" in err


def test_cli_overrides_anywhere_config_keys_and_file(tmp_path, capsys):
    """One name per knob: the config keys, before/between/after flags, or from a config file."""
    assert schedule_cli.main(["--no-chart", "parallel.pp=2", "--comm-cost", "0", "parallel.microbatches=2",
                              "parallel.schedule=gpipe"]) == 0
    assert "gpipe  pp=2  microbatches=2" in capsys.readouterr().out
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {layers: 8}\nparallel: {pp: 4, microbatches: 8, schedule: gpipe}\n")
    assert schedule_cli.main([str(cfg), "--no-chart", "parallel.schedule=1f1b"]) == 0
    assert "1f1b  pp=4  microbatches=8" in capsys.readouterr().out
    assert schedule_cli.main(["parallel.pp=2", "parallel.microbatches=4", "parallel.schedule=zb", "--no-chart"]) == 0
    assert "plan only" in capsys.readouterr().out
    with pytest.raises(SystemExit):          # the old flag duplicates are gone
        schedule_cli.main(["--pp", "4"])
    capsys.readouterr()
    assert schedule_cli.main(["train.steps=3"]) == 2
    assert "train.steps" in capsys.readouterr().err
    assert schedule_cli.main(["parallel.pp=two"]) == 2
    assert "parallel.pp: expected an integer" in capsys.readouterr().err


@pytest.mark.parametrize("module", [schedules, schedule_plot, simulator, schedule_cli])
def test_doctests(module):
    assert doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE).failed == 0
