"""Fault injection: what a user or an attacker can do to a run, and what phalanx must answer.

Each case ends with nothing lost and either the normal result or one clear line naming the
problem (docs/reliability.md lists them):

* export onto an existing folder, a file, the run directory, a path inside it, a folder
  holding the run; ``--overwrite`` of anything but a previous export: refused, every byte
  left as it was; a previous export replaced only with ``--overwrite``;
* export of a run whose newest checkpoint is damaged: falls back to the one before with the
  warning ``phalanx eval`` gives, moving nothing; export while a trainer holds the run:
  refused naming it; a read-only folder, a file as parent, a full disk: one line, nothing
  left behind.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from phalanx import checkpoint
from phalanx.cli import main
from phalanx.config import load_config
from phalanx.fsutil import RunLock

from helpers import tiny_overrides, write_corpus


def tree_bytes(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root`` (and ``root`` itself) by relative path: file bytes, link
    targets, ``"dir"``: what must be identical after a refused command."""
    out: dict[str, bytes | str] = {}
    if root.is_file():
        return {".": root.read_bytes()}
    for path in sorted([root, *root.rglob("*")]):
        rel = path.relative_to(root).as_posix()
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_dir():
            out[rel] = "dir"
        else:
            out[rel] = path.read_bytes()
    return out


def one_error_line(err: str) -> str:
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# ---------------------------------------------------------------------------
# Export never destroys


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A 2-layer GPT trained 4 steps, checkpoints at steps 2 and 4 (a few seconds)."""
    from phalanx.train.trainer import Trainer
    tmp = tmp_path_factory.mktemp("trained")
    corpus = write_corpus(tmp / "corpus", files=2, lines=200)
    cfg = load_config(None, tiny_overrides(tmp, corpus, "run", train__steps=4, checkpoint__every=2,
                                           train__eval_batches=1))
    Trainer(cfg, quiet=True).fit()
    assert [p.name for p in checkpoint.all_checkpoints(Path(cfg.run.dir) / "checkpoints")] == [
        "step-00000002", "step-00000004"]
    return Path(cfg.run.dir)


@pytest.fixture
def run_copy(trained, tmp_path) -> Path:
    """A copy of the trained run this test may damage (the module's run stays intact)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    return run


def export_cli(run: Path, *extra: str) -> int:
    return main(["export", str(run), "--format", "keras", "--eval-batches", "1", "--quiet", *extra])


def _existing_folder(run: Path) -> Path:
    target = run.parent / "mine"
    target.mkdir()
    (target / "notes.txt").write_text("my notes")
    return target


def _existing_file(run: Path) -> Path:
    target = run.parent / "model.keras"
    target.write_bytes(b"someone else's model")
    return target


def _fake_export_inside_the_run(run: Path) -> Path:
    target = run / "checkpoints"  # looks like an export (export.json) to tempt --overwrite
    (target / "export.json").write_text("{}")
    return target


REFUSED = {
    # case: (make the target, words of the error without --overwrite; with it, refused all the same)
    "existing folder": (_existing_folder, "already exists (a folder); export never replaces what it did not write"),
    "existing file": (_existing_file, "already exists (a file)"),
    "the run directory": (lambda run: run, "is the run directory being exported or holds it"),
    "a folder holding the run": (lambda run: run.parent, "is the run directory being exported or holds it"),
    "a path inside the run": (lambda run: run / "checkpoints", "is inside the run directory"),
    "a new path inside the run": (lambda run: run / "checkpoints" / "new", "is inside the run directory"),
    "a fake export inside the run": (_fake_export_inside_the_run, "is inside the run directory"),
}


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("case", list(REFUSED))
def test_export_onto_what_it_did_not_write_is_refused_and_nothing_changes(run_copy, case, overwrite, capsys):
    make, words = REFUSED[case]
    target = make(run_copy)
    if overwrite and case == "existing folder":
        words = "holds no export.json: not a previous export"
    if overwrite and case == "existing file":
        words = "is a file, not a previous export directory"
    before = tree_bytes(run_copy.parent)
    code = export_cli(run_copy, "--output", str(target), *(["--overwrite"] if overwrite else []))
    line = one_error_line(capsys.readouterr().err)
    assert code == 2
    assert line.startswith("error: --output: ") and str(target) in line and words in line, line
    assert tree_bytes(run_copy.parent) == before  # byte-identical: nothing removed, replaced or added


def test_overwrite_replaces_a_previous_export_and_nothing_else(run_copy, tmp_path, capsys):
    out = tmp_path / "served"
    assert export_cli(run_copy, "--output", str(out)) == 0
    first = json.loads((out / "export.json").read_text())
    assert first["step"] == 4 and sorted(os.listdir(out)) == ["config.yaml", "export.json", "export_report.json",
                                                              "model.keras", "tokenizer"]
    before = tree_bytes(out)
    assert export_cli(run_copy, "--output", str(out)) == 2  # again without --overwrite: refused
    assert "already exists (a folder)" in one_error_line(capsys.readouterr().err)
    assert tree_bytes(out) == before
    assert export_cli(run_copy, "--output", str(out), "--overwrite") == 0
    assert json.loads((out / "export.json").read_text())["created"] > first["created"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    (out / "my-notes.txt").write_text("keep me")  # a file export did not write: --overwrite refuses
    capsys.readouterr()
    before = tree_bytes(out)
    assert export_cli(run_copy, "--output", str(out), "--overwrite") == 2
    assert "holds files an export does not write (my-notes.txt)" in one_error_line(capsys.readouterr().err)
    assert tree_bytes(out) == before


def test_export_falls_back_past_a_damaged_newest_checkpoint_and_moves_nothing(run_copy, tmp_path, capsys):
    newest = run_copy / "checkpoints" / "step-00000004"
    flip_byte(newest / "shards" / "tensors.bin")
    checkpoints = tree_bytes(run_copy / "checkpoints")
    out = tmp_path / "out"
    assert export_cli(run_copy, "--output", str(out)) == 0
    err = capsys.readouterr().err
    # the warning `phalanx eval` and `phalanx train` print, naming the file and the fault
    assert "warning: skipping damaged checkpoint step-00000004: " in err
    assert "step-00000004/shards/tensors.bin: checksum mismatch" in err
    meta = json.loads((out / "export.json").read_text())
    assert meta["step"] == 2 and meta["checkpoint"].endswith("step-00000002")
    assert tree_bytes(run_copy / "checkpoints") == checkpoints  # a reader moves nothing

    # and `phalanx eval` says the same
    assert main(["eval", str(run_copy), "--json", "train.eval_batches=1"]) == 0
    captured = capsys.readouterr()
    assert "warning: skipping damaged checkpoint step-00000004: " in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 2


def test_export_while_a_trainer_holds_the_run_is_refused_naming_it(run_copy, tmp_path, capsys):
    with RunLock(run_copy):  # what `phalanx train` holds (flock: a second open file is refused)
        assert export_cli(run_copy, "--output", str(tmp_path / "out")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "cannot export the run while it is being trained" in line and f"pid {os.getpid()}" in line
    assert not (tmp_path / "out").exists()


@pytest.fixture
def mounted(tmp_path):
    """Mount a tmpfs with the given options (skipped where mounting is impossible)."""
    mounts = []

    def mount(name: str, options: str) -> Path:
        point = tmp_path / name
        point.mkdir()
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)], capture_output=True)
        if proc.returncode:
            pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.decode().strip()})")
        mounts.append(point)
        return point
    try:
        yield mount
    finally:
        for point in mounts:
            subprocess.run(["umount", "-l", str(point)], check=False)


def test_export_under_a_read_only_folder_or_a_file_is_one_line(run_copy, tmp_path, mounted, capsys):
    plain = tmp_path / "plain-file"
    plain.write_text("x")
    assert export_cli(run_copy, "--output", str(plain / "out")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write '{plain / 'out'}': '{plain}' is a file, not a folder" in line
    assert plain.read_text() == "x"

    read_only = mounted("ro", "ro,size=1m")  # a real read-only file system (root ignores chmod)
    assert export_cli(run_copy, "--output", str(read_only / "sub" / "out")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"the folder '{read_only}' is not writable" in line
    assert os.listdir(read_only) == []


def test_a_full_disk_during_export_is_one_line_and_leaves_nothing(run_copy, mounted, capsys):
    small = mounted("small", "size=64k")  # the tiny GPT's .keras file is ~250 KB
    assert export_cli(run_copy, "--output", str(small / "out")) == 2
    line = one_error_line(capsys.readouterr().err)
    assert f"cannot write the export '{small / 'out'}'" in line and "No space left on device [ENOSPC]" in line
    assert os.listdir(small) == []  # the temporary sibling removed, nothing at --output


def test_the_python_export_refuses_an_existing_path_too(tmp_path):
    import keras

    import phalanx
    from phalanx.config import ConfigError
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "data.csv").write_text("1,2\n")
    with pytest.raises(ConfigError, match=r"^path: '.*taken' already exists \(a folder\)"):
        phalanx.export(model, taken, quiet=True, print_table=False)
    with pytest.raises(ConfigError, match="holds no export.json"):
        phalanx.export(model, taken, overwrite=True, quiet=True, print_table=False)
    assert os.listdir(taken) == ["data.csv"]
    report = phalanx.export(model, tmp_path / "new", quiet=True, print_table=False)
    assert report["format"] == "keras" and (tmp_path / "new" / "model.keras").is_file()
    np.testing.assert_equal(sorted(os.listdir(tmp_path)), ["new", "taken"])
