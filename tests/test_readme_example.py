"""The README's Python examples run verbatim: your Keras model data parallel and on pipeline
stages (Example 2), a keras-hub GPT-2 on dp x tp x pp (Example 3).

A user copies it into a file and runs it: a new process, so TensorFlow starts with the
devices ``phalanx.init`` asks for (conftest's 8 logical devices do not apply).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
INIT = 'cfg = phalanx.init("parallel.devices=cpu:2", "parallel.dp=2")'


def readme_example() -> str:
    text = README.read_text()
    section = text[text.index("## Example 2: your Keras model"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.slow
@pytest.mark.parametrize("init", [INIT, 'cfg = phalanx.init("parallel.devices=cpu:2", "parallel.pp=2", '
                                        '"parallel.microbatches=4")'])
def test_readme_python_example_runs(tmp_path, init):
    code = readme_example()
    assert INIT in code  # the example shows init first
    script = tmp_path / "example.py"
    script.write_text(code.replace(INIT, init))
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'mae'" in done.stdout and (tmp_path / "model.keras").is_file()
    assert len(list((tmp_path / "runs").iterdir())) == 1


@pytest.mark.slow
def test_readme_parallelism_example_runs(tmp_path):
    """Example 3, the keras-hub example, verbatim: dp2 x tp2 x pp2 on 8 logical CPUs."""
    text = README.read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## Example 3: a keras-hub LLM"):], re.S).group(1)
    assert '"parallel.dp=2", "parallel.tp=2", "parallel.pp=2"' in code
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "loss: vocabulary-parallel cross-entropy on the tp=2 shard logits" in done.stdout + done.stderr
    assert (tmp_path / "gpt2.keras").is_file()
    import keras_hub  # noqa: F401  (registers the classes the file names)
    import keras
    loaded = keras.saving.load_model(tmp_path / "gpt2.keras")
    assert type(loaded).__name__ == "GPT2CausalLM"
