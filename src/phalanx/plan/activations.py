"""Activation memory: what one transformer block keeps for its backward, and how many
micro-batches' activations a pipeline rank holds at once under a schedule.

Used by the planner's memory model (:mod:`phalanx.plan.memory`, :mod:`phalanx.plan.keras_memory`).

Activations per transformer layer and micro-batch (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4): with 16-bit
activations and dropout, ``s b h (34 + 5 a s / h)`` bytes; with tensor parallelism
``s b h (10 + 24/t + 5 a s/(h t))``; with sequence parallelism too
``s b h (34/t + 5 a s/(h t))``; selective recomputation drops the ``5 a s/h``
attention-core term; full recomputation keeps only each layer's input ``2 s b h``.
Here the same terms are written for any element size and MLP width, and without the
dropout masks when dropout is 0. The pipeline schedule decides how many micro-batches'
activations a rank holds at once: the planner counts them from the very schedule table
the executor runs.

Example:
    >>> from phalanx.core.costs import ModelSpec
    >>> m = ModelSpec(layers=24, d_model=1024, heads=16, vocab=51200, seq_len=2048, dropout=0.1)
    >>> s, b, h, a = 2048, 1, 1024, 16
    >>> layer_activation_bytes(m, b, tp=1, recompute="none", elem_bytes=2) == s * b * h * (34 + 5 * a * s / h)
    True
"""

from __future__ import annotations

from functools import lru_cache

from phalanx.core.costs import ModelSpec
from phalanx.parallel.schedules import build_schedule

# bytes of one activation element under each precision policy
ACTIVATION_BYTES = {"float32": 4, "mixed_bfloat16": 2, "mixed_float16": 2}


def layer_activation_bytes(m: ModelSpec, micro_batch: int, tp: int = 1, recompute: str = "none",
                           sequence_parallel: bool = False, elem_bytes: int = 2, moe: bool = False,
                           fused: bool = True) -> float:
    """Activation bytes one transformer block keeps for its backward, for one micro-batch.

    >>> m = ModelSpec(layers=1, d_model=64, heads=4, seq_len=32, vocab=100)
    >>> layer_activation_bytes(m, 1, recompute="full", elem_bytes=4) == 32 * 64 * 4
    True

    ``fused=False`` counts what TensorFlow's autodiff keeps for phalanx's GPT ops
    without kernel fusion (no XLA), as on ``this-cpu``: per token, each LayerNorm keeps
    its input, ``x - mean``, the normalised value and its output (4h each); Q, K, V after
    the head transpose (3h) and the merged heads (h); the MLP keeps the GELU input, the
    tanh-approximation intermediates and the GELU output (about 6f); attention keeps the
    scaled scores and the softmax output (2 a s). Checked against
    ``get_memory_info`` with ``phalanx plan --calibrate``.
    """
    s, b, h, a, e = m.seq_len, micro_batch, m.d_model, m.heads, elem_bytes
    sbh = s * b * h
    mask = 1 if m.dropout > 0 else 0
    t = tp
    if recompute == "full":  # only the block's input survives the forward
        return e * sbh / (t if sequence_parallel else 1)
    mlp_width = m.ffn_dim / h * (m.top_k if moe else 1)
    if not fused:
        unsplit = 8 * e * sbh
        split = (4 * e + 6 * e * mlp_width) * sbh
        core = 0.0 if recompute == "selective" else 2 * e * a * s * s * b
        if sequence_parallel:
            return (unsplit + split + core) / t
        return unsplit + (split + core) / t
    # Not split by tp (unless sequence parallel): the two LayerNorm inputs, the inputs of
    # the QKV and MLP-in matmuls, and the two post-block dropout masks.
    unsplit = (4 * e + 2 * mask) * sbh
    # Split by tp: Q, K, V, the attention-out input; the MLP's GELU input and proj input.
    split = (4 * e + 2 * e * mlp_width) * sbh
    # The attention core: softmax output (+ dropout mask and dropout output), a x s x s per sequence.
    core = ((2 * e + mask) if mask else e) * a * s * s * b
    if recompute == "selective":
        core = 0.0
    if sequence_parallel:
        return (unsplit + split + core) / t
    return unsplit + (split + core) / t



@lru_cache(maxsize=4096)
def schedule_in_flight(name: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[tuple[int, ...], int]:
    """(peak activation sets per rank, peak sets of the last model stage) from the schedule table."""
    sched = build_schedule(name, pp, microbatches, virtual_stages)
    release = "W" if sched.split_backward else "B"
    peaks = []
    for actions in sched.per_stage:
        held = peak = 0
        for a in actions:
            held += 1 if a.kind == "F" else (-1 if a.kind == release else 0)
            peak = max(peak, held)
        peaks.append(peak)
    held = last = 0
    for a in sched.per_stage[-1]:
        if a.chunk == virtual_stages - 1:
            held += 1 if a.kind == "F" else (-1 if a.kind == release else 0)
            last = max(last, held)
    return tuple(peaks), last


def in_flight_estimate(name: str, pp: int, microbatches: int, virtual_stages: int) -> tuple[tuple[int, ...], int]:
    """Like :func:`schedule_in_flight`, in closed form for big tables (search pre-filter).

    Exact for gpipe, 1f1b and interleaved (Megatron's warm-up count + 1); an upper bound for zb.
    """
    m, v = microbatches, virtual_stages
    if pp * m * v <= 4096:
        return schedule_in_flight(name, pp, m, v)
    if name == "gpipe":
        return tuple([m] * pp), m
    if name == "1f1b" or (name == "interleaved" and v == 1):
        return tuple(min(pp - r, m) for r in range(pp)), 1
    if name == "interleaved":
        return tuple(min(2 * (pp - r - 1) + (v - 1) * pp + 1, m * v) for r in range(pp)), 1
    return tuple(min(2 * pp, m) for _ in range(pp)), min(2, m)
