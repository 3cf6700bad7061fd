"""``precision.policy=auto``: bfloat16 where the hardware has bfloat16 units, float32 elsewhere.

:func:`resolve_policy` turns ``auto`` into ``mixed_bfloat16`` on

* a CPU whose ``/proc/cpuinfo`` flags show bfloat16 instructions: ``avx512_bf16`` or
  AMX (``amx_bf16``) on x86, ``bf16`` on Arm — unless oneDNN is switched off
  (``TF_ENABLE_ONEDNN_OPTS=0``), without which TensorFlow's CPU bfloat16 matmuls are
  emulated and slower than float32;
* GPUs of compute capability 8.0 or newer (Ampere, Hopper, ...), when the run uses GPUs;
* TPUs;

and into ``float32`` everywhere else (an AVX2-only CPU emulates bfloat16: measured no
faster than float32, ARCHITECTURE.md). ``mixed_float16`` is never chosen automatically:
it needs loss scaling and is slower than float32 on CPUs.

The configuration resolves ``auto`` when it is built (:class:`phalanx.config.Config`), so
every reader of ``cfg.precision.policy`` sees the policy that runs; :func:`describe` is the
line a run prints, e.g. ``precision: mixed_bfloat16 (auto: CPU has avx512_bf16)``.

A user's Keras model on ``phalanx.fit`` trains in the precision it was built in unless the
policy is set explicitly: ``auto`` never switches a float32-built model to a mixed policy
(:func:`phalanx.engines.keras_model.precision_of`; the run's precision line says how to
ask for it where this module would have chosen it). phalanx's own GPT follows ``auto``.

``PHALANX_AUTO_PRECISION=<policy>`` in the environment fixes what ``auto`` means (the
test suite sets ``float32`` so that its numerics do not depend on the machine).

Example:
    >>> resolve_policy("float32")
    ('float32', 'precision.policy=float32')
    >>> resolve_policy("auto", cpu_flags={"avx2", "fma"}, gpus=[], tpu=False, onednn="1", env={})
    ('float32', 'auto: no bfloat16 units (CPU flags lack avx512_bf16/amx_bf16, no Ampere+ GPU or TPU)')
    >>> resolve_policy("auto", cpu_flags={"avx512f", "avx512_bf16"}, gpus=[], tpu=False, onednn="1", env={})
    ('mixed_bfloat16', 'auto: CPU has avx512_bf16')
"""

from __future__ import annotations

import functools
import glob
import os
import sys
from typing import Any, Iterable, Mapping

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
AUTO = "auto"
ENV = "PHALANX_AUTO_PRECISION"
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")  # x86; Arm's is "bf16" (aarch64 only)
MIN_BF16_COMPUTE_CAPABILITY = (8, 0)


def resolve_policy(cfg_or_policy: Any, *, devices: str | None = None, cpu_flags: Iterable[str] | None = None,
                   gpus: list[tuple[int, int]] | None = None, tpu: bool | None = None, onednn: str | None = None,
                   env: Mapping[str, str] | None = None) -> tuple[str, str]:
    """``(policy, reason)``: the precision policy that runs, and why, one line.

    ``cfg_or_policy``: a :class:`phalanx.config.Config` (its policy is already resolved
    when it was built; the reason is the one recorded then), or a policy name, ``auto``
    included. ``devices`` is ``parallel.devices`` (``auto``, ``cpu:N``, ``gpu:N``): a
    ``cpu:`` run is decided by the CPU even on a machine with GPUs. The keyword arguments
    after it replace what is detected on this machine (for tests): ``cpu_flags``,
    ``gpus`` (compute capabilities), ``tpu``, ``onednn`` (``TF_ENABLE_ONEDNN_OPTS``),
    ``env`` (the environment, for ``PHALANX_AUTO_PRECISION``).
    """
    if hasattr(cfg_or_policy, "precision"):  # a Config
        precision = cfg_or_policy.precision
        return precision.policy, getattr(precision, "reason", None) or f"precision.policy={precision.policy}"
    if hasattr(cfg_or_policy, "policy"):  # a PrecisionConfig
        return cfg_or_policy.policy, getattr(cfg_or_policy, "reason", None) or f"precision.policy={cfg_or_policy.policy}"
    policy = str(cfg_or_policy)
    if policy != AUTO:
        if policy not in POLICIES:
            raise ValueError(f"precision.policy={policy!r} is not one of {', '.join((AUTO,) + POLICIES)}")
        return policy, f"precision.policy={policy}"
    env = os.environ if env is None else env
    forced = env.get(ENV, "").strip()
    if forced:
        if forced not in POLICIES:
            raise ValueError(f"{ENV}={forced!r} is not one of {', '.join(POLICIES)}")
        return forced, f"auto: {ENV}={forced}"
    devices = devices or "auto"
    if not devices.startswith("cpu"):
        if tpu if tpu is not None else _has_tpu(env):
            return "mixed_bfloat16", "auto: TPU"
        capabilities = _gpu_capabilities() if gpus is None else gpus
        if capabilities:
            best = max(capabilities)
            if all(c >= MIN_BF16_COMPUTE_CAPABILITY for c in capabilities):
                return "mixed_bfloat16", f"auto: GPU compute capability {best[0]}.{best[1]} >= 8.0"
            worst = min(capabilities)
            return "float32", f"auto: GPU compute capability {worst[0]}.{worst[1]} < 8.0 (no bfloat16 units)"
        if devices.startswith("gpu"):
            return "float32", "auto: parallel.devices asks for GPUs but none is visible"
    flags = set(_cpu_flags() if cpu_flags is None else cpu_flags)
    found = [f for f in BF16_CPU_FLAGS if f in flags] or (["bf16"] if "bf16" in flags and _is_arm() else [])
    if not found:
        return "float32", "auto: no bfloat16 units (CPU flags lack avx512_bf16/amx_bf16, no Ampere+ GPU or TPU)"
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS") if onednn is None else onednn
    if onednn is not None and onednn.strip().lower() in ("0", "false"):
        return "float32", (f"auto: CPU has {found[0]}, but TF_ENABLE_ONEDNN_OPTS={onednn} (bfloat16 matmuls "
                           f"without oneDNN are emulated)")
    return "mixed_bfloat16", f"auto: CPU has {found[0]}"


def describe(cfg_or_policy: Any) -> str:
    """The line a run prints: ``precision: <policy> (<why>)``."""
    policy, reason = resolve_policy(cfg_or_policy)
    return f"precision: {policy} ({reason})"


# -- detection ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    """The CPU feature flags of /proc/cpuinfo (``flags`` on x86, ``Features`` on Arm)."""
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return frozenset(value.split())
    except OSError:
        pass
    return frozenset()


def _is_arm() -> bool:
    import platform

    return platform.machine().lower() in ("aarch64", "arm64")


def _has_tpu(env: Mapping[str, str]) -> bool:
    if any(env.get(k) for k in ("TPU_NAME", "TPU_ACCELERATOR_TYPE", "COLAB_TPU_ADDR")):
        return True
    return bool(glob.glob("/dev/accel[0-9]*"))  # a TPU VM's chips (other accelerators live in /dev/accel/)


def _nvidia_present() -> bool:
    return os.path.exists("/proc/driver/nvidia/gpus") or bool(glob.glob("/dev/nvidia[0-9]*"))


@functools.lru_cache(maxsize=1)
def _gpu_capabilities() -> tuple[tuple[int, int], ...]:
    """Compute capabilities of the GPUs TensorFlow can use (none without an NVIDIA driver:
    TensorFlow is then not imported for this)."""
    if "tensorflow" not in sys.modules and not _nvidia_present():
        return ()
    try:
        import tensorflow as tf

        out = []
        for gpu in tf.config.list_physical_devices("GPU"):
            cc = tf.config.experimental.get_device_details(gpu).get("compute_capability")
            if cc:
                out.append((int(cc[0]), int(cc[1])))
        return tuple(out)
    except Exception:  # a broken driver or a CPU-only wheel: no usable GPU
        return ()
