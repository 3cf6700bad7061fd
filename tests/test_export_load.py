"""A `.keras` export loads in a fresh process with `import phalanx` and `keras.saving.load_model`
(in either import order), and does not without phalanx: the registration is what makes it load."""

import subprocess
import sys

import pytest

SAVE = """
import keras, numpy as np
from phalanx.config import ModelConfig
from phalanx.models import gpt
from phalanx.export.gpt_keras import build
cfg = ModelConfig(layers=1, d_model=16, heads=2, ffn=32, vocab=64, seq_len=8)
model = build(cfg, gpt.initial_weights(cfg, 0))
model.save(sys.argv[1])
np.save(sys.argv[2], keras.ops.convert_to_numpy(model(np.arange(8, dtype="int32")[None])))
"""

LOAD = """
{imports}
import numpy as np
model = keras.saving.load_model(sys.argv[1])
np.testing.assert_array_equal(keras.ops.convert_to_numpy(model(np.arange(8, dtype="int32")[None])), np.load(sys.argv[2]))
print("loaded")
"""


def python(code, *args):
    return subprocess.run([sys.executable, "-c", "import sys\n" + code, *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    proc = python(SAVE, str(d / "gpt.keras"), str(d / "logits.npy"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return str(d / "gpt.keras"), str(d / "logits.npy")


@pytest.mark.parametrize("imports", ["import phalanx\nimport keras", "import keras\nimport phalanx"])
def test_a_keras_export_loads_after_import_phalanx(saved, imports):
    proc = python(LOAD.format(imports=imports), *saved)
    assert proc.returncode == 0 and "loaded" in proc.stdout, proc.stderr[-2000:]


def test_without_phalanx_it_does_not_load(saved):
    proc = python(LOAD.format(imports="import keras"), *saved)
    assert proc.returncode != 0 and "Could not locate class" in proc.stderr


def test_import_phalanx_does_not_import_keras():
    proc = python("import phalanx\nprint('keras' in sys.modules, 'tensorflow' in sys.modules)")
    assert proc.stdout.strip() == "False False", proc.stderr
