"""What every benchmark records about the machine it ran on (issue 14: "every benchmark
records the CPU model and flags, the TensorFlow/oneDNN settings, the date and the load").

Benchmarks run as scripts (``python benchmarks/bench_x.py``), so this directory is on
``sys.path`` and they import it as ``from machine_report import machine, load``.

Example:
    >>> info = machine()
    >>> sorted(k for k in info if k in ("model", "flags", "cores", "onednn"))
    ['cores', 'flags', 'model', 'onednn']
"""

from __future__ import annotations

import os
import platform
import subprocess

# The CPU features that decide which kernels TensorFlow/oneDNN can use.
KEY_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_tile", "amx_bf16")


def lscpu() -> dict[str, str]:
    """``lscpu``'s fields (empty where the command is missing)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        out = ""
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        fields[key.strip()] = value.strip()
    return fields


def machine(**extra: str) -> dict[str, str]:
    """CPU model, its key flags, cores, TensorFlow/Keras versions, the oneDNN and thread
    settings, plus ``extra`` (e.g. ``keras_hub=keras_hub.__version__``)."""
    import keras
    import tensorflow as tf

    fields = lscpu()
    flags = set(fields.get("Flags", "").split())
    threads = tf.config.threading
    return {
        "model": fields.get("Model name", platform.processor() or "unknown"),
        "flags": ", ".join(f for f in KEY_FLAGS if f in flags) or "none of " + "/".join(KEY_FLAGS),
        "cores": str(os.cpu_count()),
        "tf": tf.__version__,
        "keras": keras.__version__,
        **extra,
        "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset (TensorFlow's default)"),
        "threads": f"intra-op {threads.get_intra_op_parallelism_threads() or 'default'}, "
                   f"inter-op {threads.get_inter_op_parallelism_threads() or 'default'}",
    }


def load() -> str:
    """The 1/5/15-minute load averages, ``a/b/c``."""
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def cpu_line(info: dict[str, str] | None = None) -> str:
    """The line a results table starts with: CPU model, flags, cores, TF/Keras, oneDNN, the load now."""
    info = info or machine()
    return (f"CPU: {info['model']} ({info['cores']} cores; {info['flags']}); TF {info['tf']}, Keras "
            f"{info['keras']}; oneDNN {info['onednn']}; load at start {load()}")
