"""The planner's memory model of the Keras-model engine under ZeRO 1/2/3 (by slices) and
recomputation (phalanx.plan.keras_memory), checked term by term against byte counts made by
hand for a tiny GPT, and the variable shapes and slices it counts against the model's own
variables and the engine's own slice layout. The measured side (every device's peak at zero=3)
is tests/test_calibrate_keras.py::test_zero3_calibrate_on_every_device.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from phalanx.core.costs import ModelSpec, param_count
from phalanx.plan.engine_rules import plan_only_reasons
from phalanx.plan.hardware import get_hardware
from phalanx.plan.keras_memory import gpt_device_shapes, keras_devices, slice_elements
from phalanx.plan.layout import Layout
from phalanx.plan.search import search

# 1 block, d_model 8, 2 heads (head_dim 4), ffn 16, vocab 32, 4 positions, tied embedding.
TINY = ModelSpec(layers=1, d_model=8, heads=2, ffn=16, vocab=32, seq_len=4)
# Its trainable variables (tp=1, pp=1) and their elements:
#   embed [32, 8] 256, positions [4, 8] 32, ln1 2 x [8] 16, query/key/value [8, 2, 4] 3 x 64,
#   their biases [2, 4] 3 x 8, output [2, 4, 8] 64, output bias [8] 8, ln2 2 x [8] 16,
#   MLP up [8, 16] 128, up bias [16] 16, down [16, 8] 128, down bias [8] 8, final LayerNorm 2 x [8] 16
N = 256 + 32 + 16 + 192 + 24 + 64 + 8 + 16 + 128 + 16 + 128 + 8 + 16          # 904
# One of dp=3 slices of each (ceil(rows / 3) rows when rows >= 3, else ceil(size / 3) of the flat
# value): embed 11 x 8 = 88, positions 2 x 8 = 16, six [8] LayerNorm vectors 3 each = 18,
# query/key/value 3 x (3 x 8) = 72, their biases (2 rows < 3: 8 flat) 3 x 3 = 9, output (2 rows:
# 64 flat) 22, output bias 3, up 3 x 16 = 48, up bias 6, down 6 x 8 = 48, down bias 3
PIECES3 = 88 + 16 + 18 + 72 + 9 + 22 + 3 + 48 + 6 + 48 + 3                     # 333
# The step of one micro-batch of one sequence (float32, 4 bytes an element, tokens = 4):
#   a block's activations (fused kernels, Korthikanti's terms): LayerNorm/matmul inputs
#   4 x 4 x (4 x 8) = 512, Q, K, V, attention-out and MLP (4 x 4 + 2 x 4 x 16 / 8) x (4 x 8) = 1024,
#   the attention core 4 x 2 heads x 4 x 4 = 128                                -> 1664
#   the backward's working set: 2 float32 copies of the MLP hidden 2 x 4 x 4 x 16 = 512
#   the head: its logits 4 x 4 x 32 = 512, the final LayerNorm input 4 x 4 x 8 = 128,
#   the joined logits and Keras's float32 loss (4 + 4) x 4 x 32 = 1024           -> 1664
SET, BACKWARD, HEAD = 1664, 512, 1664


def test_param_count_of_the_hand_count():
    assert param_count(TINY) == N


def test_zero3_slices_gathered_stage_and_gradient_sums_by_hand():
    """ZeRO-3, dp=3: between steps each device holds its slices of the weights (4 bytes) and of
    Adam's m and v (8); through the step the stage's weights gathered whole (4 x 904), and the
    three replicas' running gradient sums of its slices (3 x 4 x 333). The step's peak is its
    end (the gradient sums beside the head's buffers) or the first backward (a set + working set),
    whichever is larger. The host copy (the whole model's weights and m, v: 12 bytes each) counts
    on device 0 only when device 0 is the host (logical CPUs)."""
    mem = keras_devices(TINY, dp=3, zero=3)
    step = max(SET + BACKWARD, 3 * 4 * PIECES3) + HEAD + 4 * N
    for i in range(3):
        assert mem[i].optimizer == 8 * PIECES3
        assert mem[i].weights == 4 * PIECES3 + 4 * N       # the peak is in the step: the gathered weights
        assert mem[i].total == 4 * PIECES3 + 8 * PIECES3 + step
    host = keras_devices(TINY, dp=3, zero=3, host_on_device0=True)
    assert host[0].total - mem[0].total == (4 + 8) * N and host[1].total == mem[1].total


def test_zero1_and_zero2_by_hand():
    """ZeRO-1 and 2, dp=3: every replica keeps its whole weights (its copy) and the slices of the
    weights and of m and v. The step holds the replica's whole gradient sum, as without ZeRO. The
    update goes variable by variable: it starts with those sums and one weight's reduction beside
    them (ZeRO-1 forms the all-reduced sum whole, 4 x 256 for the embedding; ZeRO-2 a slice,
    4 x 88) and ends with the reduced sums (ZeRO-1 whole, 4 x 904, its slices views of them;
    ZeRO-2 the slices, 4 x 333) and Adam's temporaries on the largest slice (2 x 4 x 88). Here
    the step's end (the gradient sums beside the head's buffers) is larger than either."""
    state = 4 * (N + PIECES3) + 8 * PIECES3
    step = max(SET + BACKWARD, 4 * N) + HEAD
    update = {1: max(4 * N + 4 * 256, 4 * N + 2 * 4 * 88), 2: max(4 * N + 4 * 88, 4 * PIECES3 + 2 * 4 * 88)}
    for zero in (1, 2):
        mem = keras_devices(TINY, dp=3, zero=zero)
        assert update[zero] < step
        for i in range(3):
            assert mem[i].weights == 4 * (N + PIECES3)
            assert mem[i].optimizer == 8 * PIECES3
            assert mem[i].total == state + step


# 4 blocks of the same widths and 64 positions: activations dominate the step.
LONG = ModelSpec(layers=4, d_model=8, heads=2, ffn=16, vocab=32, seq_len=64)
LONG_N = 4 * 600 + 32 * 8 + 64 * 8 + 16                                        # 3184
# per block and sequence (sbh = 64 x 8 = 512 elements): 16 x 512 + 32 x 512 + core 4 x 2 x 64 x 64
BLOCK, CORE = 8192 + 16384 + 32768, 32768
LONG_BACKWARD = 2 * 4 * 64 * 16
LONG_HEAD = 4 * 64 * 32 + 4 * 64 * 8 + 8 * 64 * 32
STATES = 4 * LONG_N + 8 * LONG_N                   # weights and Keras's m and v, next to each weight


@pytest.mark.parametrize("recompute, expected", [
    # every block's activations kept
    ("none", STATES + 4 * BLOCK + LONG_BACKWARD + LONG_HEAD),
    # the attention cores not kept; the backward re-runs one block's core
    ("selective", STATES + 4 * (BLOCK - CORE) + LONG_BACKWARD + CORE + LONG_HEAD),
    # the stage's 8 ops that hold weights (embedding, positions, 4 blocks, final LayerNorm, the tied
    # embedding's reverse call) cut into ceil(sqrt(8)) = 3 recomputed pieces: their 3 inputs kept
    # ([64, 8] float32 each); the backward re-runs one piece, ceil(4 / 3) = 2 blocks
    ("full", STATES + 3 * 4 * 64 * 8 + LONG_BACKWARD + 2 * BLOCK + LONG_HEAD),
])
def test_recomputation_by_hand(recompute, expected):
    mem = keras_devices(LONG, recompute=recompute)[0]
    assert mem.total == expected
    assert math.ceil(math.sqrt(8)) == 3


@pytest.mark.parametrize("shape, n", [((5, 2), 2), ((32, 8), 3), ((2, 4), 3), ((2, 4, 8), 3), ((16,), 3),
                                      ((), 2), ((1, 7), 2), ((7,), 1)])
def test_slice_elements_are_the_engines_slices(shape, n):
    """What the planner counts per slice is the slice the engine makes (its SliceLayout)."""
    from phalanx.parallel.keras_zero import SliceLayout

    assert slice_elements(shape, n) == math.prod(SliceLayout(shape, n).slice_shape)


@pytest.mark.parametrize("extra", [{}, {"tie_embeddings": False}, {"experts": 4, "moe_every": 2, "top_k": 2}])
@pytest.mark.parametrize("tp", [1, 2])
def test_device_shapes_are_the_models_variables(extra, tp):
    """The shapes the planner slices are those of phalanx.models.transformer.gpt's trainable
    variables, per tensor rank (whole variables on rank 0)."""
    from phalanx.config import ModelConfig
    from phalanx.layers.sharding import placement_of
    from phalanx.models.transformer import gpt

    cfg = ModelConfig(layers=2, d_model=32, heads=4, seq_len=16, vocab=256, **extra)
    got = {j: Counter() for j in range(tp)}
    for v in gpt(cfg, tp=tp).trainable_variables:
        placement = placement_of(v)
        got[placement.rank if placement is not None and placement.axis == "tensor" else 0][tuple(v.shape)] += 1
    spec = ModelSpec.from_config(cfg)
    for j in range(tp):
        dense, experts = gpt_device_shapes(spec, 0, 2, 1, 0, tp, j)
        assert Counter(dense + experts) == got[j], j


def test_zero3_runs_within_a_node_and_the_search_proposes_it():
    """ZeRO-3 is runnable where the Keras-model engine runs it (one process, one node here, and
    across nodes: the slices span every worker's replicas), and the search proposes it."""
    m = ModelSpec(layers=8, d_model=1024, heads=16, vocab=256, seq_len=128)
    hw = get_hardware("a100-80gb")                                  # 8 devices per node
    assert plan_only_reasons(m, Layout(dp=8, zero=3), hw) == []
    assert plan_only_reasons(m, Layout(dp=16, zero=3), hw) == []  # 2 nodes (tests/test_cluster_train.py)
    assert plan_only_reasons(  # phalanx train runs it (tests/test_keras_gpt_zero.py)
        m, Layout(dp=2, pp=2, microbatches=2, schedule="interleaved", virtual_stages=2, zero=3), hw) == []
    one = search(m, hw, devices=8, global_batch=16, top=5, zero_stages=(3,))
    assert one.candidates and all(c.layout.zero == 3 for c in one.candidates)
    two = search(m, hw, devices=16, global_batch=16, top=5, zero_stages=(3,))
    assert two.candidates and all(c.layout.zero == 3 for c in two.candidates)
