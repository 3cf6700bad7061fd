"""The built-in GPT's weight names are written once (models.gpt.weight_shapes): the helpers that
parse them, and the one table config.py keeps (it is the bottom layer and cannot import the
model), checked against that list."""

from __future__ import annotations

import re

import pytest

from phalanx.config import ModelConfig, prune_input_dims
from phalanx.models.gpt import block_index, block_prefix, weight_shapes
from phalanx.prune import prunable

CONFIGS = [
    ModelConfig(layers=2, d_model=16, heads=2, ffn=48, vocab=32, seq_len=8),
    ModelConfig(layers=3, d_model=16, heads=2, ffn=48, vocab=32, seq_len=8, tie_embeddings=False),
    ModelConfig(layers=4, d_model=16, heads=2, ffn=48, vocab=32, seq_len=8, experts=4, moe_every=2,
                tie_embeddings=False),
    ModelConfig(layers=2, d_model=16, heads=2, ffn=48, vocab=32, seq_len=8, experts=4, moe_every=1),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_block_index_parses_every_name(cfg):
    for name in weight_shapes(cfg):
        m = re.fullmatch(r"block_(\d+)/.+", name)  # the test's own parse, the oracle
        assert block_index(name) == (int(m.group(1)) if m else None), name
        if m:
            assert name.startswith(block_prefix(int(m.group(1))))
    assert block_index("block_x/ln1/gamma") is None and block_index("block_3") is None


@pytest.mark.parametrize("cfg", CONFIGS)
def test_prune_input_dims_match_weight_shapes(cfg):
    """Every pruned kind of weight is in config's table with its input dimension (axis -2 of
    ``[in, out]`` and ``[experts, in, out]``) and the key that sets it; no stray names."""
    def kind(name):
        i = block_index(name)
        return name if i is None else block_prefix(0) + name[len(block_prefix(i)):]

    dims = prune_input_dims(cfg)
    shapes = weight_shapes(cfg)
    pruned = {kind(n): s for n, s in shapes.items() if prunable(n)}
    assert set(pruned) == set(dims)
    for name, shape in pruned.items():
        dim, key = dims[name]
        assert dim == shape[-2] == getattr(cfg, key.removeprefix("model.")), name
