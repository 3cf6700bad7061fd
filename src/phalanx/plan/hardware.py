"""Accelerator presets and the matmul peak probe.

Each :class:`Hardware` gives peak dense matmul FLOP/s per compute dtype, memory per
device, devices per node and the per-device bandwidth inside a node (NVLink, TPU ICI)
and between nodes (InfiniBand/DCN). Vendor datasheet values, dense (no sparsity);
every field can be overridden (``phalanx plan --peak-tflops ... --memory-gb ...``).

``this-cpu`` is measured: :func:`measure_matmul_peak` times square matmuls with
TensorFlow for about a second and caches the result per machine, CPU model, dtype and TF
version under ``$XDG_CACHE_HOME/phalanx`` (``~/.cache/phalanx``), with the date and the
machine's load at the time: a figure older than :data:`PEAK_MAX_AGE_DAYS`, one recorded
without them, or one measured under load when the machine is quieter now is measured again.
The trainer uses the same probe for MFU (and measures again when a run beats the peak).

Example:
    >>> hw = get_hardware("a100-80gb")
    >>> hw.peak_flops("mixed_bfloat16") / 1e12, hw.memory_bytes / 2**30
    (312.0, 80.0)
    >>> get_hardware("a100-80gb", memory_gb=40).memory_bytes / 2**30
    40.0
"""

from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

GiB = 2**30
DTYPE_OF_POLICY = {"float32": "float32", "mixed_bfloat16": "bfloat16", "mixed_float16": "float16"}


@dataclass(frozen=True)
class Hardware:
    """One accelerator type. Bandwidths are bytes/s per device, one direction."""

    name: str
    peak: dict = field(default_factory=dict)   # compute dtype -> dense matmul FLOP/s
    memory_bytes: float = 0.0
    devices_per_node: int = 8
    intra_node_bw: float = 0.0                 # NVLink / ICI, per device
    inter_node_bw: float = 0.0                 # network, per device
    overhead_bytes: float = 0.0                # runtime context, communication buffers, workspace
    notes: str = ""
    fused_kernels: bool = True                 # activations as fused kernels keep them (else unfused TF ops)

    def peak_flops(self, policy_or_dtype: str) -> float:
        """Peak FLOP/s for a precision policy (``mixed_bfloat16``) or dtype (``bfloat16``)."""
        dtype = DTYPE_OF_POLICY.get(policy_or_dtype, policy_or_dtype)
        if dtype not in self.peak:
            raise ValueError(f"hardware {self.name!r} has no peak for {dtype!r}; known: {sorted(self.peak)} "
                             f"(override with --peak-tflops)")
        return self.peak[dtype]


def _gpu(name, bf16, fp32, mem, intra, inter, notes):
    return Hardware(name, {"bfloat16": bf16, "float16": bf16, "float32": fp32}, mem, 8, intra, inter,
                    overhead_bytes=2 * GiB, notes=notes)


# Datasheet values. fp32 on NVIDIA is TF32 tensor-core throughput, which TensorFlow uses
# for float32 matmuls by default on Ampere and later. On TPUs float32 matmuls run at
# bfloat16 rate under the default precision. Inter-node: one 200 Gb/s (A100, HDR) or
# 400 Gb/s (H100/H200, NDR) NIC per GPU. TPU "node" = the ICI-connected slice.
PRESETS: dict[str, Hardware] = {
    "a100-40gb": _gpu("a100-40gb", 312e12, 156e12, 40 * GiB, 300e9, 25e9, "NVIDIA A100 SXM 40GB, NVLink3"),
    "a100-80gb": _gpu("a100-80gb", 312e12, 156e12, 80 * GiB, 300e9, 25e9, "NVIDIA A100 SXM 80GB, NVLink3"),
    "h100-80gb": _gpu("h100-80gb", 989e12, 494e12, 80 * GiB, 450e9, 50e9, "NVIDIA H100 SXM, NVLink4"),
    "h200-141gb": _gpu("h200-141gb", 989e12, 494e12, 141e9, 450e9, 50e9, "NVIDIA H200 SXM, NVLink4"),
    "tpu-v4": Hardware("tpu-v4", {"bfloat16": 275e12, "float32": 275e12}, 32 * GiB, 4096, 300e9, 25e9,
                       overhead_bytes=0.5 * GiB, notes="Cloud TPU v4, 3D torus ICI"),
    "tpu-v5p": Hardware("tpu-v5p", {"bfloat16": 459e12, "float32": 459e12}, 95 * GiB, 8960, 600e9, 25e9,
                        overhead_bytes=0.5 * GiB, notes="Cloud TPU v5p, 3D torus ICI"),
}
HARDWARE_NAMES = tuple(PRESETS) + ("this-cpu",)


def get_hardware(name: str, *, devices: int = 1, peak_tflops: float | None = None, memory_gb: float | None = None,
                 devices_per_node: int | None = None, intra_node_gbps: float | None = None,
                 inter_node_gbps: float | None = None, overhead_gb: float | None = None,
                 measure: bool = True) -> Hardware:
    """A preset with overrides (``*_gb`` in GiB, bandwidths in GB/s, peak in TFLOP/s for every dtype).

    ``this-cpu``: peak from :func:`measure_matmul_peak` (or 0 with ``measure=False``), the host's
    RAM split over ``devices`` logical devices, all devices on one node.
    """
    if name == "this-cpu":
        hw = _this_cpu(devices, measure)
    elif name in PRESETS:
        hw = PRESETS[name]
    else:
        raise ValueError(f"unknown hardware {name!r}; choose one of: {', '.join(HARDWARE_NAMES)}")
    changes: dict = {}
    if peak_tflops is not None:
        changes["peak"] = {k: peak_tflops * 1e12 for k in ("bfloat16", "float16", "float32")}
    if memory_gb is not None:
        changes["memory_bytes"] = memory_gb * GiB
    if devices_per_node is not None:
        changes["devices_per_node"] = devices_per_node
    if intra_node_gbps is not None:
        changes["intra_node_bw"] = intra_node_gbps * 1e9
    if inter_node_gbps is not None:
        changes["inter_node_bw"] = inter_node_gbps * 1e9
    if overhead_gb is not None:
        changes["overhead_bytes"] = overhead_gb * GiB
    for key, value in changes.items():
        if key != "peak" and value is not None and value < 0:
            raise ValueError(f"hardware override {key} must be >= 0, got {value}")
    return replace(hw, **changes) if changes else hw


def _this_cpu(devices: int, measure: bool) -> Hardware:
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = {}
    if measure:
        peak = {dt: measure_matmul_peak(dt) for dt in ("float32", "bfloat16")}
        peak["float16"] = peak["float32"] / 2  # no AVX512-FP16 here: oneDNN falls back to slow paths
    return Hardware("this-cpu", peak, ram / max(devices, 1), max(devices, 1), 20e9, 20e9, 0.0,
                    notes=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, measured")


# ---------------------------------------------------------------------------
# The matmul probe


#: a cached peak older than this is measured again (a new TensorFlow, BIOS or kernel may change it)
PEAK_MAX_AGE_DAYS = 30
#: 1-minute load average per CPU above which the machine counts as loaded when the probe runs
LOADED_PER_CPU = 0.5


def _cache_path(cache_dir: str | os.PathLike | None) -> Path:
    if cache_dir is None:
        cache_dir = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache") / "phalanx"
    return Path(os.path.expanduser(str(cache_dir))) / "matmul_peak.json"


def load_per_cpu() -> float:
    """The 1-minute load average per CPU (0 where the OS does not say)."""
    try:
        return os.getloadavg()[0] / max(os.cpu_count() or 1, 1)
    except (OSError, AttributeError):
        return 0.0


def stale_reason(record, *, now: float | None = None, load: float | None = None) -> str | None:
    """Why a cached probe ``record`` must be measured again, or None if it holds.

    A record is ``{"flops": F, "measured_at": unix seconds, "load_per_cpu": L}``; a bare number
    (the older cache format) has no date nor load, so it is measured again.

    >>> stale_reason({"flops": 1e11, "measured_at": 0.0, "load_per_cpu": 0.1}, now=86400.0, load=0.1) is None
    True
    >>> stale_reason({"flops": 1e11, "measured_at": 0.0, "load_per_cpu": 0.1}, now=40 * 86400.0, load=0.1)
    'measured 40 days ago (older than 30)'
    >>> stale_reason({"flops": 1e11, "measured_at": 0.0, "load_per_cpu": 3.0}, now=60.0, load=0.2)
    'measured under load (3.0 per CPU; 0.2 now)'
    >>> stale_reason(2.5e11)
    'recorded without its date and load'
    """
    if not isinstance(record, dict):
        return "recorded without its date and load"
    flops, when, then = record.get("flops"), record.get("measured_at"), record.get("load_per_cpu")
    if not all(isinstance(v, (int, float)) for v in (flops, when, then)) or flops <= 0:
        return "recorded without its date and load"
    now = time.time() if now is None else now
    load = load_per_cpu() if load is None else load
    days = (now - when) / 86400
    if days > PEAK_MAX_AGE_DAYS:
        return f"measured {days:.0f} days ago (older than {PEAK_MAX_AGE_DAYS})"
    # Under load the probe gets a share of the CPU: its figure is low, and a quieter run beats it.
    if then >= LOADED_PER_CPU and load < then / 2:
        return f"measured under load ({then:.1f} per CPU; {load:.1f} now)"
    return None


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as fh:
            cpu = next((ln.split(":", 1)[1].strip() for ln in fh if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return cpu


def _machine_key(dtype: str) -> str:
    import tensorflow as tf

    cpu = cpu_model()
    gpus = ",".join(d.name for d in tf.config.list_physical_devices("GPU"))
    onednn = os.environ.get("TF_ENABLE_ONEDNN_OPTS", "default")  # changes CPU matmul speed 4-6x
    return f"probe2|{platform.node()}|{cpu}|{os.cpu_count()}|{gpus}|tf{tf.__version__}|onednn={onednn}|{dtype}"


def measure_matmul_peak(dtype: str = "float32", *, seconds: float = 0.6, size: int = 1024,
                        cache_dir: str | os.PathLike | None = None, refresh: bool = False) -> float:
    """Achievable dense matmul FLOP/s of the default TensorFlow device, cached per machine.

    Times ``size x size`` matmuls (``2 size^3`` FLOPs each) in a ``tf.function`` for about
    ``seconds`` after a warm-up, keeps the best of three rounds, and stores it with the time
    and the load per CPU in ``$XDG_CACHE_HOME/phalanx/matmul_peak.json`` (``~/.cache/...``);
    later calls read the cache (no TensorFlow work) unless :func:`stale_reason` says the
    figure no longer holds, or ``refresh``. ``dtype``: ``float32``, ``bfloat16`` or ``float16``
    (or a precision policy).

    >>> peak = measure_matmul_peak("float32")   # doctest: +SKIP
    >>> peak > 1e9                               # doctest: +SKIP
    True
    """
    dtype = DTYPE_OF_POLICY.get(dtype, dtype)
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
    path = _cache_path(cache_dir)
    key = _machine_key(dtype)
    cache: dict = {}
    if path.is_file():
        try:
            cache = json.loads(path.read_text())
        except (OSError, ValueError):
            cache = {}  # a corrupt cache is re-measured, never fatal
    if not refresh and key in cache and stale_reason(cache[key]) is None:
        return float(cache[key]["flops"])
    load = load_per_cpu()
    value = _probe(dtype, seconds, size)
    cache[key] = {"flops": value, "measured_at": time.time(), "load_per_cpu": round(max(load, load_per_cpu()), 3),
                  "cpu": cpu_model()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, path)  # atomic: concurrent probes never leave half a file
    except OSError:
        pass
    return value


def _probe(dtype: str, seconds: float, size: int) -> float:
    import tensorflow as tf

    reps = 4
    a = tf.cast(tf.random.normal([size, size], dtype=tf.float32), dtype)
    # One right operand per repetition: Grappler merges identical matmuls of one graph into one
    # (measured: four identical 1024^3 matmuls ran in the time of one, a 4x overstated peak).
    bs = [tf.cast(tf.random.normal([size, size], dtype=tf.float32), dtype) for _ in range(reps)]

    @tf.function
    def run(x, ys):
        acc = tf.zeros([], tf.float32)
        for y in ys:  # unrolled: several matmuls per call amortise the call overhead
            acc += tf.cast(tf.reduce_sum(tf.matmul(x, y)[:1, :1]), tf.float32)
        return acc

    run(a, bs).numpy()  # trace and warm up
    best = 0.0
    per_round = seconds / 3
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while True:
            run(a, bs).numpy()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= per_round:
                break
        best = max(best, calls * reps * 2 * size**3 / elapsed)
    return best
