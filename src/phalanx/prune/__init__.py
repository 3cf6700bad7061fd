"""Gradual magnitude pruning during training (``train.prune.*``).

Which weights: the GPT's matmul kernels, i.e. logical names ending ``/kernel``
(``attn/qkv``, ``attn/out``, ``mlp/fc``, ``mlp/proj``, and ``head/kernel`` when the
head is untied) and the experts' ``moe/w_in`` / ``moe/w_out``. Never pruned: the
token and position embeddings (the tied head reads them too), biases, LayerNorm and
the MoE router (small, and every token depends on them).

Schedule (Zhu & Gupta 2017, "To prune, or not to prune"): at steps ``t = start,
start + every, ...`` up to ``end`` (and at ``end`` itself) the masks are recomputed from
the magnitudes of the whole logical weights with sparsity
``s_t = target x (1 - (1 - (t - start) / (end - start))^3)``; after ``end`` they stay.
``unstructured``: the ``round(s_t x size)`` smallest entries of each tensor are zeroed
(per tensor). ``N:M``: along the input dimension (axis -2 of ``[in, out]`` kernels and of
``[experts, in, out]``), of every M consecutive weights the ``M - N`` smallest are zeroed;
during the ramp ``round(s_t x M)`` per group (capped at ``M - N``), so the ramp moves in
steps of ``1/M``.

Shard by shard (:mod:`phalanx.prune.shards`): the masks are computed from the shards each
device holds, never from a joined weight; a tensor's global threshold comes from a radix
selection over its shards (:mod:`phalanx.prune.select`), and the masks equal, element for
element, those of the whole-tensor functions below (:func:`unstructured_mask`,
:func:`nm_mask`, which stay the reference) on every layout.

The engines hold the masks: installing one zeroes the masked weights and their AdamW
moments, and every optimizer step multiplies the updated weights and moments by the
mask, so masked weights are exactly zero after every step on every layout. Masks are
checkpointed as ``prune/mask/<name>`` (float32 0/1) among the engine's own checkpoint
slots, written and restored one at a time like the weights: by the Keras GPT engine
(``phalanx train``'s, :class:`~phalanx.engines.keras_gpt.KerasGPTEngine`) per device (cut like
the weights' variables). The
slots are optional, so a checkpoint written without pruning resumes into a pruning run
with every weight kept until the next update.

Example:
    >>> import numpy as np
    >>> nm_mask(np.array([[1.], [-3.], [2.], [0.5]], np.float32), zeros=2, m=4).ravel().tolist()
    [0.0, 1.0, 1.0, 0.0]
    >>> round(scheduled_sparsity(50, target=0.5, start=0, end=100), 4)
    0.4375
"""

from __future__ import annotations

import numpy as np

from phalanx import checkpoint
from phalanx.config import Config, PruneConfig, parse_prune_pattern
from phalanx.prune.shards import distinct, shard_masks, weight_shards

MASK_PREFIX = "prune/mask/"


def prunable(name: str) -> bool:
    """Whether weight ``name`` is pruned (see the module docstring)."""
    return name.endswith(("/kernel", "moe/w_in", "moe/w_out"))


def enabled(cfg: Config) -> bool:
    return cfg.train.prune.target > 0


def scheduled_sparsity(step: int, target: float, start: int, end: int) -> float:
    """Zhu & Gupta's cubic ramp: 0 before ``start``, ``target`` from ``end`` on."""
    if step <= start:
        return 0.0
    frac = min(1.0, (step - start) / (end - start))
    return float(target * (1.0 - (1.0 - frac) ** 3))


def is_update_step(step: int, pc: PruneConfig) -> bool:
    """Whether the masks are recomputed before the step that follows ``step`` completed steps."""
    return pc.start <= step <= pc.end and ((step - pc.start) % pc.every == 0 or step == pc.end)


def unstructured_mask(w: np.ndarray, sparsity: float) -> np.ndarray:
    """0/1 float32 mask zeroing the ``round(sparsity x size)`` smallest |w| (ties: lowest index)."""
    flat = np.abs(np.asarray(w, np.float32)).ravel()
    k = int(round(sparsity * flat.size))
    mask = np.ones(flat.size, np.float32)
    if k > 0:
        mask[np.argsort(flat, kind="stable")[:k]] = 0.0
    return mask.reshape(np.shape(w))


def nm_mask(w: np.ndarray, zeros: int, m: int) -> np.ndarray:
    """Zero the ``zeros`` smallest |w| of every ``m`` consecutive entries along axis -2."""
    w = np.asarray(w, np.float32)
    if zeros <= 0:
        return np.ones(w.shape, np.float32)
    moved = np.moveaxis(np.abs(w), -2, -1)  # [..., out, in]
    if moved.shape[-1] % m:
        raise ValueError(f"input dimension {moved.shape[-1]} is not divisible by M={m}")
    groups = moved.reshape(moved.shape[:-1] + (moved.shape[-1] // m, m))
    order = np.argsort(groups, axis=-1, kind="stable")
    mask = np.ones(groups.shape, np.float32)
    np.put_along_axis(mask, order[..., :zeros], 0.0, axis=-1)
    return np.moveaxis(mask.reshape(moved.shape), -1, -2)


def compute_masks(weights: dict[str, np.ndarray], sparsity: float, pattern: str) -> dict[str, np.ndarray]:
    """Masks of every prunable weight in ``weights`` for the scheduled ``sparsity``."""
    nm = parse_prune_pattern(pattern)
    out = {}
    for name, w in weights.items():
        if not prunable(name):
            continue
        if nm is None:
            out[name] = unstructured_mask(w, sparsity)
        else:
            n, m = nm
            out[name] = nm_mask(w, min(m - n, int(round(sparsity * m))), m)
    return out


def measured_sparsity(weights: dict[str, np.ndarray]) -> float:
    """Share of exact zeros over all prunable weights."""
    zeros = total = 0
    for name, w in weights.items():
        if prunable(name):
            zeros += int(np.count_nonzero(np.asarray(w) == 0))
            total += int(np.size(w))
    return zeros / total if total else 0.0


class Pruner:
    """Drives an engine's masks from the trainer (the schedule, the measured sparsity); works
    on the shards the engine's devices hold (:func:`phalanx.prune.shards.weight_shards`). The
    engine checkpoints and restores the masks with its own state (``prune/mask/*`` slots)."""

    def __init__(self, cfg: Config, engine):
        self.pc, self.engine = cfg.train.prune, engine
        self.shards = weight_shards(engine, prunable)

    def before_step(self, step: int) -> bool:
        """Recompute and install the masks if ``step`` (completed steps) is an update point."""
        if not is_update_step(step, self.pc):
            return False
        sparsity = scheduled_sparsity(step, self.pc.target, self.pc.start, self.pc.end)
        nm = parse_prune_pattern(self.pc.pattern)
        for name, shards in self.shards.items():  # one weight at a time, shard by shard
            for shard, mask in shard_masks(shards, sparsity, nm, nm_mask):
                shard.install(mask)
                del mask
        return True

    def whole_masks(self) -> dict[str, np.ndarray]:
        """The installed masks as whole logical tensors, read from the engine's checkpoint slots
        (joins them: for tests and tools)."""
        sets = checkpoint.state_of(self.engine)
        for s in sets:
            s.slots = [slot for slot in s.slots if slot.name.startswith(MASK_PREFIX)]
        return {k[len(MASK_PREFIX):]: v for k, v in checkpoint.gather(sets).items()}

    def sparsity(self) -> float:
        """Share of exact zeros over all pruned weights, counted shard by shard."""
        zeros = total = 0
        for shards in self.shards.values():
            for shard in distinct(shards):
                w = shard.fetch()
                zeros += int(w.size - np.count_nonzero(w))
                total += int(w.size)
        return zeros / total if total else 0.0
