"""Every `phalanx train` command of README.md and docs/*.md runs, in a shortened form: 2 steps of a
tiny model (the command's own parallel.*, model.layers and config file kept), in a fresh run
directory. A command followed by an `error: ...` line in its block must exit 2 with that line.
Commands with placeholders (CONFIG.yaml, my.yaml, data/, [..]) or run under `phalanx launch`
are left out (tests/test_cluster_*.py run the launcher)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLACEHOLDERS = ("[", "CONFIG", "my.yaml", "data/", "RUN_DIR", "...", "$RUN_DIR", "configs/gpt.yaml")
SHORT = {"train.steps": "2", "model.d_model": "32", "model.heads": "2", "model.ffn": "64", "model.seq_len": "16",
         "data.max_bytes": "100000", "train.eval_batches": "1", "checkpoint.every": "0", "train.log_every": "1"}


def documented_commands():
    found = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"^```[^\n]*\n(.*?)^```", page.read_text(), re.S | re.M):
            lines = block.replace("\\\n", " ").splitlines()
            for i, line in enumerate(lines):
                command = line.split("#")[0].strip().removeprefix("$ ").strip()
                if not command.startswith("phalanx train") or any(p in command for p in PLACEHOLDERS):
                    continue
                error = lines[i + 1].strip() if i + 1 < len(lines) and lines[i + 1].startswith("error:") else None
                found.append(pytest.param(command.split()[2:], error, id=f"{page.name}:{' '.join(command.split()[2:])}"))
    return found


@pytest.mark.slow
@pytest.mark.parametrize("args,error", documented_commands())
def test_documented_train_command_runs(tmp_path, args, error):
    given = {a.split("=")[0] for a in args if "=" in a}
    extra = [f"{k}={v}" for k, v in SHORT.items() if k not in given or k == "train.steps"]
    cmd = [sys.executable, "-m", "phalanx.cli", "train", *args, *extra, f"run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=dict(os.environ))
    if error:
        assert proc.returncode == 2 and error in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "done: step 2" in proc.stderr


def test_the_documents_hold_train_commands():
    assert len(documented_commands()) >= 5  # the extraction itself works
