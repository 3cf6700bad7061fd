"""The one parameter and FLOP model of GPT-style transformers.

Every FLOP figure of phalanx comes from here: MFU (:func:`gpt_training_flops_per_token`,
through the trainer's task), the pipeline partitioner's stage costs (:func:`layer_costs`,
used by the planner's stage split) and the planner's time and
memory estimates (``phalanx.plan``).

Dense layers follow phalanx's GPT (docs/DESIGN.md): pre-LayerNorm blocks with
biases, a fused QKV projection, a GELU MLP of width ``ffn``, learned position
embeddings, an optionally tied output head. A mixture-of-experts (MoE) variant
replaces the MLP of every ``moe_every``-th layer by ``experts`` MLPs and a router;
each token visits ``top_k`` of them (Switch/GShard style).

Formulas:

* Parameters: ``12 l h^2 (1 + 13/(12h) + (V+s)/(12 l h))`` for ``ffn = 4h`` with tied
  embeddings (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", section 5.1); here counted term by term so
  that any ``ffn``, untied heads and experts are exact.
* Training FLOPs per token (matmuls only; a multiply-add is 2 FLOPs; backward =
  2 x forward): ``72 l h^2 (1 + s/(6h) + V/(12 l h))`` without recomputation and
  ``96 l h^2 (1 + s/(6h) + V/(16 l h))`` with full recomputation (an extra forward of
  every layer) — Narayanan et al. 2021, eq. (3) divided by ``B s``. Selective
  recomputation (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models") re-runs only the attention core ``softmax(QK^T)V``: ``+4 s h``
  per layer per token.

Example:
    >>> gpt3 = ModelSpec(layers=96, d_model=12288, heads=96, ffn=4 * 12288, vocab=50257, seq_len=2048)
    >>> round(param_count(gpt3) / 1e9, 1)
    174.6
    >>> f = flops_per_token(gpt3, recompute="none")
    >>> round(f / (6 * param_count(gpt3)), 3)   # ~6N plus the attention term
    1.027
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from phalanx.config import check_model_shape

RECOMPUTE_MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class ModelSpec:
    """The shape of a GPT (dense when ``experts == 0``).

    ``ffn=0`` means ``4 * d_model``. MoE: ``experts`` MLPs in every ``moe_every``-th
    layer (layers ``moe_every-1, 2*moe_every-1, ...``), ``top_k`` of them per token.
    """

    layers: int
    d_model: int
    heads: int
    ffn: int = 0
    vocab: int = 51200
    seq_len: int = 2048
    tie_embeddings: bool = True
    experts: int = 0
    top_k: int = 1
    moe_every: int = 1
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_model_shape(self)  # the rule config.ModelConfig follows (ConfigError is a ValueError)

    @property
    def ffn_dim(self) -> int:
        return self.ffn or 4 * self.d_model

    @property
    def moe_layers(self) -> int:
        """How many layers hold experts."""
        return self.layers // self.moe_every if self.experts else 0

    @classmethod
    def from_config(cls, model) -> "ModelSpec":
        """From ``phalanx.config.ModelConfig`` (MoE from ``model.experts``, ``model.top_k``,
        ``model.moe_every``)."""
        return cls(layers=model.layers, d_model=model.d_model, heads=model.heads, ffn=model.ffn_dim,
                   vocab=model.vocab, seq_len=model.seq_len, tie_embeddings=model.tie_embeddings,
                   experts=model.experts, top_k=model.top_k if model.experts else 1, moe_every=model.moe_every,
                   dropout=model.dropout)


# ---------------------------------------------------------------------------
# Parameters


def attention_params(m: ModelSpec) -> int:
    """QKV ``[d, 3d] + 3d`` and output ``[d, d] + d``."""
    d = m.d_model
    return 4 * d * d + 4 * d


def mlp_params(m: ModelSpec) -> int:
    """One MLP: ``[d, f] + f`` and ``[f, d] + d``."""
    d, f = m.d_model, m.ffn_dim
    return 2 * d * f + f + d


def layer_params(m: ModelSpec, moe: bool = False) -> int:
    """One block: attention, MLP (or ``experts`` MLPs and a ``[d, E]`` router), two LayerNorms."""
    ffn = m.experts * mlp_params(m) + m.d_model * m.experts if moe else mlp_params(m)
    return attention_params(m) + ffn + 4 * m.d_model


def embedding_params(m: ModelSpec) -> int:
    """Token and position embeddings."""
    return (m.vocab + m.seq_len) * m.d_model


def head_params(m: ModelSpec) -> int:
    """Final LayerNorm, plus the output projection when it is not tied to the embedding."""
    return 2 * m.d_model + (0 if m.tie_embeddings else m.d_model * m.vocab)


def param_count(m: ModelSpec) -> int:
    """All parameters (each expert counted once).

    >>> param_count(ModelSpec(layers=2, d_model=8, heads=2, ffn=32, vocab=10, seq_len=4))
    1872
    """
    dense = m.layers - m.moe_layers
    return (dense * layer_params(m) + m.moe_layers * layer_params(m, moe=True)
            + embedding_params(m) + head_params(m))


def active_param_count(m: ModelSpec) -> int:
    """Parameters a token passes through (``top_k`` experts per MoE layer)."""
    if not m.experts:
        return param_count(m)
    per_moe = attention_params(m) + m.top_k * mlp_params(m) + m.d_model * m.experts + 4 * m.d_model
    return ((m.layers - m.moe_layers) * layer_params(m) + m.moe_layers * per_moe
            + embedding_params(m) + head_params(m))


# ---------------------------------------------------------------------------
# FLOPs


def layer_forward_flops_per_token(m: ModelSpec, moe: bool = False) -> float:
    """Matmul FLOPs of one block's forward for one token (full causal square counted, as the papers do).

    ``2 (4 h^2 + 2 h f) + 4 s h``: projections, then ``QK^T`` and ``AV``; an MoE block
    runs ``top_k`` MLPs plus the ``h x E`` router.
    """
    h, f, s = m.d_model, m.ffn_dim, m.seq_len
    mlp = 2 * 2 * h * f
    if moe:
        mlp = m.top_k * mlp + 2 * h * m.experts
    return 2 * 4 * h * h + mlp + 4 * s * h


def attention_core_flops_per_token(m: ModelSpec) -> float:
    """``QK^T`` and ``softmax . V``: what selective recomputation runs again."""
    return 4 * m.seq_len * m.d_model


def logits_forward_flops_per_token(m: ModelSpec) -> float:
    return 2 * m.d_model * m.vocab


def forward_flops_per_token(m: ModelSpec) -> float:
    """One forward pass of the whole model for one token."""
    dense = m.layers - m.moe_layers
    return (dense * layer_forward_flops_per_token(m) + m.moe_layers * layer_forward_flops_per_token(m, True)
            + logits_forward_flops_per_token(m))


def recompute_flops_per_token(m: ModelSpec, recompute: str) -> float:
    """Extra forward FLOPs per token spent recomputing activations in the backward."""
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {RECOMPUTE_MODES}, got {recompute!r}")
    if recompute == "none":
        return 0.0
    if recompute == "selective":
        return m.layers * attention_core_flops_per_token(m)
    return forward_flops_per_token(m) - logits_forward_flops_per_token(m)


def flops_per_token(m: ModelSpec, recompute: str = "none") -> float:
    """Training FLOPs per token: forward + backward (2x forward) + recomputation.

    With ``recompute="none"`` these are the *model* FLOPs used for MFU; with
    recomputation, the *hardware* FLOPs actually executed.

    >>> m = ModelSpec(layers=128, d_model=25600, heads=160, vocab=51200, seq_len=2048)
    >>> l, h, s, V = 128, 25600, 2048, 51200
    >>> abs(flops_per_token(m, "full") / (96 * l * h**2 * (1 + s / (6 * h) + V / (16 * l * h))) - 1) < 1e-12
    True
    """
    return 3.0 * forward_flops_per_token(m) + recompute_flops_per_token(m, recompute)


def with_layers(m: ModelSpec, layers: int) -> ModelSpec:
    """The same shape with another depth (handy for per-stage arithmetic)."""
    return replace(m, layers=layers)


# ---------------------------------------------------------------------------
# Users of the model: MFU and the pipeline partitioner


def gpt_training_flops_per_token(cfg) -> float:
    """Model FLOPs per token of a training step (forward + backward, no recomputation) of
    the GPT ``cfg`` (a ``phalanx.config.ModelConfig``): what MFU divides by.

    >>> from phalanx.config import ModelConfig
    >>> cfg = ModelConfig(layers=2, d_model=64, heads=4, ffn=256, vocab=512, seq_len=32)
    >>> gpt_training_flops_per_token(cfg) == flops_per_token(ModelSpec.from_config(cfg), "none")
    True
    """
    return flops_per_token(ModelSpec.from_config(cfg), "none")


def embedding_forward_flops_per_token(m: ModelSpec) -> float:
    """The embedding's elementwise work (token row + position row): ``2 h``. Not a matmul, so
    not in :func:`flops_per_token`; the partitioner counts it so the first stage is not free."""
    return 2.0 * m.d_model


def loss_forward_flops_per_token(m: ModelSpec) -> float:
    """Softmax cross-entropy over the vocabulary (max, exp, sum, log, pick): ``5 V``. Not a
    matmul, so not in :func:`flops_per_token`; the partitioner counts it on the last stage."""
    return 5.0 * m.vocab


def layer_costs(model) -> tuple[list[float], float, float]:
    """Forward FLOPs per token of each block, of the embedding and of the head + loss: the
    costs the pipeline partitioner (:func:`phalanx.parallel.partition.partition`) balances.

    ``model``: a :class:`ModelSpec` or a ``phalanx.config.ModelConfig``. A block is
    :func:`layer_forward_flops_per_token` (an expert block's when ``experts`` says so), the
    head :func:`logits_forward_flops_per_token` plus :func:`loss_forward_flops_per_token`.

    >>> blocks, embed, head = layer_costs(ModelSpec(layers=2, d_model=8, heads=2, ffn=32, vocab=10, seq_len=4))
    >>> blocks, embed, head
    ([1664.0, 1664.0], 16.0, 210.0)
    """
    m = model if isinstance(model, ModelSpec) else ModelSpec.from_config(model)
    blocks = [float(layer_forward_flops_per_token(m, bool(m.experts) and (i + 1) % m.moe_every == 0))
              for i in range(m.layers)]
    return (blocks, embedding_forward_flops_per_token(m),
            logits_forward_flops_per_token(m) + loss_forward_flops_per_token(m))
