"""The quality report of an export: the artifact, run in its own runtime, beside the float model.

For every export: size on disk (the float model's artifact in the same format, written to
a temporary directory, against the exported one); held-out loss and perplexity for the
GPT, accuracy (and cross-entropy) for classifiers, mean squared error otherwise; tokens/s
or latency per batch; and how far the artifact's outputs are from the float model's on the
same batches (top-1 agreement, mean and max absolute difference). Both run on the very same
batches, one after the other. Printed as a table, written as ``export_report.json``.

Example:
    >>> import numpy as np
    >>> r = compare(lambda x: x, lambda x: x + 0.01, [(np.eye(4, dtype="float32"), np.arange(4))], "classifier")
    >>> r["float"]["accuracy"], r["exported"]["accuracy"], r["agreement"]["top1"]
    (1.0, 1.0, 1.0)
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np

from phalanx import checkpoint, prune
from phalanx.export.runtime import lm_loss


def _softmax_xent(logits: np.ndarray, labels: np.ndarray) -> float:
    return lm_loss(logits, labels)


def compare(float_predict: Callable, artifact_predict: Callable, batches: Iterable, kind: str,
            progress: Callable[[str], None] | None = None, total: int | None = None) -> dict:
    """Run both predictors on every ``(x, y)`` batch; return their metrics and agreement.

    ``kind``: ``lm`` (x tokens, y next tokens: loss, perplexity, tokens/s), ``classifier``
    (y integer labels or one-hot: accuracy, cross-entropy of the outputs taken as logits or
    probabilities) or ``regressor`` (mean squared error). Speed: the first batch of each
    shape is a warm-up (tracing, tensor allocation) and is not timed, unless no batch is
    left; latency is the median over the timed batches and the rate is items per median
    batch, robust to other load on a shared machine. The two predictors alternate batch by
    batch, so load changes hit both alike.
    """
    acc = {"float": _Acc(kind), "exported": _Acc(kind)}
    agree = {"n": 0, "top1": 0, "abs_sum": 0.0, "abs_max": 0.0, "ref_abs_sum": 0.0}
    n_batches = 0
    seen_shapes = set()
    for x, y in batches:
        shape = tuple(np.shape(t) for t in (x if isinstance(x, (list, tuple)) else [x]))
        timed = shape in seen_shapes
        seen_shapes.add(shape)
        outs = {}
        for name, fn in (("float", float_predict), ("exported", artifact_predict)):
            t0 = time.perf_counter()
            out = np.asarray(fn(x), np.float32)
            dt = time.perf_counter() - t0
            acc[name].add(out, np.asarray(y), dt, timed=timed)
            outs[name] = out
        a, b = outs["float"], outs["exported"]
        diff = np.abs(a - b)
        agree["n"] += a[..., 0].size
        agree["top1"] += int((a.argmax(-1) == b.argmax(-1)).sum()) if a.shape[-1] > 1 else 0
        agree["abs_sum"] += float(diff.sum())
        agree["abs_max"] = max(agree["abs_max"], float(diff.max()))
        agree["ref_abs_sum"] += float(np.abs(a).sum())
        n_batches += 1
        if progress is not None:
            progress(f"scored batch {n_batches}{f'/{total}' if total else ''}")
    if not n_batches:
        raise ValueError("no evaluation batch")
    size = agree["n"] * (a.shape[-1] if a.ndim else 1)
    agreement = {"top1": agree["top1"] / agree["n"] if a.shape[-1] > 1 else None,
                 "mean_abs_diff": agree["abs_sum"] / size, "max_abs_diff": agree["abs_max"],
                 "relative_mean_abs_diff": agree["abs_sum"] / max(agree["ref_abs_sum"], 1e-30)}
    return {"kind": kind, "batches": n_batches, "float": acc["float"].result(), "exported": acc["exported"].result(),
            "agreement": agreement}


class _Acc:
    def __init__(self, kind: str):
        self.kind = kind
        self.loss_sum = 0.0
        self.batches = 0
        self.correct = 0
        self.count = 0
        self.items = 0
        self.timed: list[tuple[float, int]] = []  # (seconds, items) of batches after the warm-up
        self.untimed: list[tuple[float, int]] = []

    def add(self, out: np.ndarray, y: np.ndarray, seconds: float, timed: bool) -> None:
        items = int(np.prod(y.shape)) if self.kind == "lm" else int(y.shape[0])
        (self.timed if timed else self.untimed).append((seconds, items))
        self.batches += 1
        self.items += items
        if self.kind == "lm":
            self.loss_sum += lm_loss(out, y)
        elif self.kind == "classifier":
            labels = y.argmax(-1) if y.ndim == out.ndim and y.shape[-1] == out.shape[-1] and y.shape[-1] > 1 else y
            labels = labels.reshape(out.shape[:-1]).astype(np.int64)
            self.correct += int((out.argmax(-1) == labels).sum())
            self.count += labels.size
            probs_like = out.min() >= 0 and np.allclose(out.sum(-1), 1.0, atol=1e-3)
            logits = np.log(np.clip(out, 1e-12, None)) if probs_like else out
            self.loss_sum += _softmax_xent(logits, labels)
        else:
            self.loss_sum += float(np.mean((out.reshape(y.shape) - y) ** 2))

    def result(self) -> dict:
        samples = self.timed or self.untimed
        seconds = float(np.median([t for t, _ in samples]))
        rate = float(np.median([n / t if t > 0 else float("inf") for t, n in samples]))
        res = {"latency_ms_per_batch": 1000 * seconds, "timed_batches": len(self.timed)}
        loss = self.loss_sum / max(self.batches, 1)
        if self.kind == "lm":
            res.update({"loss": loss, "perplexity": math.exp(min(loss, 50.0)), "tokens_per_s": rate})
        elif self.kind == "classifier":
            res.update({"accuracy": self.correct / max(self.count, 1), "loss": loss, "examples_per_s": rate})
        else:
            res.update({"mse": loss, "examples_per_s": rate})
        return res


def compressed_size(path: str | Path, level: int = 6) -> int:
    """Bytes of the artifact after zlib/gzip level ``level`` (each file of a directory on its
    own): what storing or shipping it compressed costs. Zeros (pruned weights) compress."""
    import zlib
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    total = 0
    for file in files:
        comp = zlib.compressobj(level)
        with open(file, "rb") as f:
            while chunk := f.read(1 << 22):
                total += len(comp.compress(chunk))
        total += len(comp.flush())
    return total


def checkpoint_sparsity(checkpoint_dir: str | Path) -> dict | None:
    """Sparsity of a pruned run's checkpoint (``train.prune``): the share of exact zeros in
    the pruned weights (:func:`phalanx.prune.prunable`) and the masks' share; None when the
    checkpoint holds no ``prune/mask/*`` tensors. Reads only those tensors."""
    try:
        reader = checkpoint.open_reader(checkpoint_dir)  # any checkpoint format; reads one tensor at a time
    except checkpoint.CheckpointError:
        return None
    masks = [n for n in reader.names() if n.startswith(prune.MASK_PREFIX)]
    if not masks:
        return None
    zeros = total = masked = 0
    for m in masks:
        w = reader.read(m[len(prune.MASK_PREFIX):])
        zeros += int(np.count_nonzero(w == 0))
        masked += int(np.count_nonzero(reader.read(m) == 0))
        total += int(w.size)
    return {"weights": len(masks), "pruned_params": total, "zero_fraction": zeros / total,
            "mask_fraction": masked / total}


def build(meta: dict, quality: dict | None, float_size: int, artifact_size: int, notes: list[str]) -> dict:
    """The report document (see the module docstring).

    ``size_bytes.exported_compressed``: the artifact gzip'd (level 6). For a pruned run
    (``sparsity``), keras, savedmodel and litert all store the zeros densely, so the size on
    disk does not shrink; only compression (storage, download) gains from them, and the
    runtime's memory and speed do not change. A note in the report says so with the figures.
    """
    notes = list(notes)
    compressed = None
    if meta.get("artifact") and Path(meta["artifact"]).exists():
        compressed = compressed_size(meta["artifact"])
    report = {**meta, "size_bytes": {"float": float_size, "exported": artifact_size,
                                     "ratio": float_size / artifact_size if artifact_size else None,
                                     "exported_compressed": compressed},
              "notes": notes}
    sparsity = checkpoint_sparsity(meta["checkpoint"]) if meta.get("checkpoint") else None
    if sparsity is not None:
        report["sparsity"] = sparsity["zero_fraction"]
        report["sparsity_detail"] = sparsity
        what = (f"pruned run: {100 * sparsity['zero_fraction']:.1f}% of the {sparsity['pruned_params']:,} "
                f"matmul-kernel weights are zero; the {meta.get('format', 'exported')} artifact stores them densely "
                f"(no sparse encoding), so its size on disk, memory and speed are those of the dense model")
        if compressed:
            what += (f"; gzip'd it takes {human_bytes(compressed)} ({100 * compressed / artifact_size:.0f}% of "
                     f"{human_bytes(artifact_size)}): that is what the zeros save, in storage and transfer only")
        notes.append(what)
    if quality is not None:
        report["quality"] = quality
        f, e = quality["float"], quality["exported"]
        key = {"lm": "perplexity", "classifier": "accuracy", "regressor": "mse"}[quality["kind"]]
        report["quality"]["change"] = {key: (e[key] - f[key]) / f[key] if f[key] else None}
    return report


def write(report: dict, path: str | Path) -> Path:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2, default=_json_default) + "\n")
    os.replace(tmp, path)
    return path


def _json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    return str(o)


RUNTIMES = {"keras": "keras.saving.load_model", "savedmodel": "tf.saved_model.load",
            "litert": "ai-edge-litert interpreter"}


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"


def table(report: dict) -> str:
    """The report as an aligned text table: float model | exported artifact | change."""
    fmt, q = report.get("format"), report.get("quantize")
    head = ["", "float32 (Keras)", f"{fmt} {q}", "change"]
    sizes = report["size_bytes"]
    rows = [["size on disk", human_bytes(sizes["float"]) + f" ({fmt})", human_bytes(sizes["exported"]),
             "same model" if q == "none" else f"{sizes['ratio']:.2f}x smaller" if sizes.get("ratio") else "-"]]
    if sizes.get("exported_compressed"):
        rows.append(["gzip'd (level 6)", "", human_bytes(sizes["exported_compressed"]),
                     f"{100 * sizes['exported_compressed'] / sizes['exported']:.0f}% of on disk"])
    if report.get("sparsity") is not None:
        rows.append(["sparsity (kernels)", "", f"{100 * report['sparsity']:.1f}% zeros", ""])
    quality = report.get("quality")
    if quality:
        f, e = quality["float"], quality["exported"]

        def rel(a, b, digits=2):
            return f"{100 * (b - a) / a:+.{digits}f}%" if a else "-"

        if quality["kind"] == "lm":
            rows += [["held-out loss", f"{f['loss']:.4f}", f"{e['loss']:.4f}", rel(f["loss"], e["loss"])],
                     ["perplexity", f"{f['perplexity']:.3f}", f"{e['perplexity']:.3f}",
                      rel(f["perplexity"], e["perplexity"])],
                     ["tokens/s", f"{f['tokens_per_s']:,.0f}", f"{e['tokens_per_s']:,.0f}",
                      f"{e['tokens_per_s'] / f['tokens_per_s']:.2f}x"]]
        elif quality["kind"] == "classifier":
            rows += [["accuracy", f"{f['accuracy']:.4f}", f"{e['accuracy']:.4f}",
                      f"{100 * (e['accuracy'] - f['accuracy']):+.2f} pts"],
                     ["loss", f"{f['loss']:.4f}", f"{e['loss']:.4f}", rel(f["loss"], e["loss"])],
                     ["examples/s", f"{f['examples_per_s']:,.0f}", f"{e['examples_per_s']:,.0f}",
                      f"{e['examples_per_s'] / f['examples_per_s']:.2f}x"]]
        else:
            rows += [["mse", f"{f['mse']:.5g}", f"{e['mse']:.5g}", rel(f["mse"], e["mse"])]]
        rows.append(["ms per batch", f"{f['latency_ms_per_batch']:.2f}", f"{e['latency_ms_per_batch']:.2f}",
                     f"{e['latency_ms_per_batch'] / f['latency_ms_per_batch']:.2f}x"
                     if f["latency_ms_per_batch"] else "-"])
        a = quality["agreement"]
        if a.get("top1") is not None:
            rows.append(["top-1 agreement", "", f"{100 * a['top1']:.2f}%", ""])
        rows.append(["mean |diff|", "", f"{a['mean_abs_diff']:.4g}", f"(max {a['max_abs_diff']:.4g})"])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [head] + rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    ev = (f"held-out: {quality['batches']} batches ({report.get('eval_source', 'validation split')}); "
          if quality else "no held-out data: sizes only; ")
    tail = [ev + f"the artifact ran in its own runtime ({RUNTIMES.get(fmt, fmt)})"]
    tail += [f"note: {n}" for n in report.get("notes", [])]
    return "\n".join(lines + tail)
