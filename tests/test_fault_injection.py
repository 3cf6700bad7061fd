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
    damaged = sorted(newest.glob("shards/*.bin"))[0]  # the first shard set's data file
    flip_byte(damaged)
    checkpoints = tree_bytes(run_copy / "checkpoints")
    out = tmp_path / "out"
    assert export_cli(run_copy, "--output", str(out)) == 0
    err = capsys.readouterr().err
    # the warning `phalanx eval` and `phalanx train` print, naming the file and the fault
    assert "warning: skipping damaged checkpoint step-00000004: " in err
    assert f"step-00000004/shards/{damaged.name}: checksum mismatch" in err
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


# ---------------------------------------------------------------------------
# Tampered checkpoints: consistent checksums (re-signed), wrong contents


def sign(ckpt: Path, rel: str) -> None:
    """Re-sign ``rel`` in the manifest: what only the content checks can catch."""
    manifest = json.loads((ckpt / "manifest.json").read_text())
    path = ckpt / rel
    if path.exists():
        manifest["files"][rel] = {"bytes": path.stat().st_size, "sha256": checkpoint.sha256_file(path)}
    else:
        del manifest["files"][rel]
    (ckpt / "manifest.json").write_text(json.dumps(manifest))


def edit_index(ckpt: Path, name: str, change) -> dict:
    index = json.loads((ckpt / "index.json").read_text())
    entry = index["tensors"][name]
    change(entry)
    (ckpt / "index.json").write_text(json.dumps(index))
    sign(ckpt, "index.json")
    return entry


#: a (32, 32) float32 tensor of the tiny GPT, stored as one piece on one device
TENSOR = "embed/positions"


def _overlapping(ckpt: Path) -> None:
    def change(entry):
        [piece] = entry["pieces"]
        # the same 1024 elements counted (rows 0-16 and 8-24): the summed volume is right, rows 24-32
        # are never read, and the two pieces lie back to back in the file as the writer puts them
        entry["pieces"] = [{**piece, "box": [[0, 16], [0, 32]]},
                           {**piece, "offset": piece["offset"] + 16 * 32 * 4, "box": [[8, 24], [0, 32]]}]
    edit_index(ckpt, TENSOR, change)


def _uncovered(ckpt: Path) -> None:
    edit_index(ckpt, TENSOR, lambda e: e["pieces"][0].update(box=[[0, 16], [0, 32]]))


def _narrower_dtype(ckpt: Path) -> None:
    edit_index(ckpt, TENSOR, lambda e: e.update(dtype="float16"))


def _other_family_dtype(ckpt: Path) -> None:  # same item size: the file's layout still agrees
    edit_index(ckpt, TENSOR, lambda e: e.update(dtype="int32"))


def _other_shape(ckpt: Path) -> None:  # the same 1024 elements, another shape: consistent in itself
    def change(entry):
        entry["shape"] = [16, 64]
        entry["pieces"][0]["box"] = [[0, 16], [0, 64]]
    edit_index(ckpt, TENSOR, change)


def _nan_weights(ckpt: Path) -> None:
    index = json.loads((ckpt / "index.json").read_text())
    [piece] = index["tensors"][TENSOR]["pieces"]
    data = bytearray((ckpt / piece["file"]).read_bytes())
    data[piece["offset"] + 40: piece["offset"] + 44] = np.array([np.nan], np.float32).tobytes()
    (ckpt / piece["file"]).write_bytes(bytes(data))
    sign(ckpt, piece["file"])


def _no_data_position(ckpt: Path) -> None:
    (ckpt / "data" / "data_iterator.json").unlink()
    sign(ckpt, "data/data_iterator.json")


TAMPERED = {
    # case: (tamper, caught by verification alone (restore) or only when loaded, words of the warning)
    "overlapping boxes": (_overlapping, True, f"index.json: bad entry for '{TENSOR}': pieces [[0, 16], [0, 32]] "
                                              f"and [[8, 24], [0, 32]] overlap"),
    "uncovered tensor": (_uncovered, True, "pieces cover 512 of its 1024 elements"),
    "dtype float16 for float32 bytes": (_narrower_dtype, True, "the index's dtypes or shapes do not describe the "
                                                               "file"),
    "dtype int32 for float32 bytes": (_other_family_dtype, False, f"does not fit this model: checkpoint tensor "
                                                                  f"'{TENSOR}' is int32, the model holds float32"),
    "shape changed, same size": (_other_shape, False, f"does not fit this model: checkpoint tensor '{TENSOR}' has "
                                                      f"shape (16, 64), the model expects (32, 32)"),
    "NaN weights, re-signed": (_nan_weights, False, f"holds non-finite values in {TENSOR}"),
    "data position and its manifest entry removed": (_no_data_position, False,
                                                     "data/data_iterator.json: missing, though the data/ folder is "
                                                     "there"),
}


@pytest.mark.parametrize("case", [c for c, (_, verified, _) in TAMPERED.items() if verified])
def test_a_tampered_checkpoint_fails_verification_and_is_skipped(run_copy, case):
    tamper, _, words = TAMPERED[case]
    root = run_copy / "checkpoints"
    tamper(root / "step-00000004")
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.verify(root / "step-00000004")
    assert words in str(err.value)
    heard = []
    assert checkpoint.restore_latest(root, warn=heard.append).step == 2
    assert len(heard) == 1 and heard[0].startswith("skipping damaged checkpoint step-00000004: ") and words in heard[0]


@pytest.mark.parametrize("case", list(TAMPERED))
def test_phalanx_train_resumes_past_a_tampered_checkpoint_from_the_previous_one(run_copy, case, capsys):
    """Each kind of tampering (re-signed: the checksums agree) makes ``phalanx train`` fall back
    to step 2 with the warning naming the fault, and move step 4 to damaged/."""
    from phalanx.train.trainer import Trainer
    tamper, _, words = TAMPERED[case]
    root = run_copy / "checkpoints"
    tamper(root / "step-00000004")
    cfg = load_config(run_copy / "config.yaml", [f"run.dir={run_copy}", "train.steps=5"])
    summary = Trainer(cfg, quiet=True).fit()
    err = capsys.readouterr().err
    assert "Traceback" not in err
    warning = next(line for line in err.splitlines() if line.startswith("warning: skipping damaged checkpoint"))
    assert warning.startswith("warning: skipping damaged checkpoint step-00000004: ") and words in warning, warning
    assert "warning: moved the skipped checkpoint to " in err
    assert [p.name.split("-2")[0] for p in (root / "damaged").iterdir()] == ["step-00000004"]
    assert summary.steps == 5
    rows = [json.loads(line) for line in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]  # steps 3 and 4 trained again from step 2
    assert checkpoint.latest_valid(root).name == "step-00000005"


def test_eval_and_export_fall_back_past_nan_weights_that_verify(run_copy, tmp_path, capsys):
    _nan_weights(run_copy / "checkpoints" / "step-00000004")
    checkpoint.verify(run_copy / "checkpoints" / "step-00000004")  # the checksums agree
    assert main(["eval", str(run_copy), "--json", "train.eval_batches=1"]) == 0
    captured = capsys.readouterr()
    assert f"warning: skipping damaged checkpoint step-00000004: " in captured.err
    assert f"holds non-finite values in {TENSOR}" in captured.err
    assert json.loads(captured.out.strip().splitlines()[-1])["step"] == 2
    assert export_cli(run_copy, "--output", str(tmp_path / "out")) == 0
    assert f"holds non-finite values in {TENSOR}" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "export.json").read_text())["step"] == 2


# ---------------------------------------------------------------------------
# phalanx.fit: a damaged checkpoint is reported and moved whatever verbose is


def test_fit_with_verbose_0_reports_and_moves_a_damaged_checkpoint(tmp_path, capsys):
    import keras

    import phalanx

    def build():
        keras.utils.set_random_seed(1)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse")
        return model

    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 6)).astype(np.float32)
    y = rng.standard_normal((32, 1)).astype(np.float32)
    run = [f"run.dir={tmp_path / 'run'}"]
    phalanx.fit(build(), x, y, batch_size=8, epochs=2, shuffle=False, verbose=0, overrides=run)
    root = tmp_path / "run" / "checkpoints"
    first, newest = checkpoint.all_checkpoints(root)  # one per epoch: steps 4 and 8
    flip_byte(sorted((newest / "shards").glob("*.bin"))[0])  # one device's shard set
    capsys.readouterr()

    resumed = build()
    history = phalanx.fit(resumed, x, y, batch_size=8, epochs=3, shuffle=False, verbose=0, overrides=run)
    err = capsys.readouterr().err
    assert f"warning: skipping damaged checkpoint {newest.name}: " in err and "checksum mismatch" in err
    assert f"warning: moved the skipped checkpoint to {root / 'damaged' / newest.name}-" in err
    assert [p.name.split("-2")[0] for p in (root / "damaged").iterdir()] == [newest.name]
    # resumed after epoch 1 (the valid checkpoint): epochs 2 and 3 as Keras's own fit trains them
    reference = build()
    ref = reference.fit(x, y, batch_size=8, epochs=3, shuffle=False, verbose=0).history
    np.testing.assert_allclose(history.history["loss"], ref["loss"], rtol=1e-5)
    for a, b in zip(resumed.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("module", ["phalanx.checkpoint.boxes", "phalanx.cluster.preemption"])
def test_doctests(module):
    import doctest
    import importlib
    assert doctest.testmod(importlib.import_module(module), optionflags=doctest.ELLIPSIS).failed == 0
