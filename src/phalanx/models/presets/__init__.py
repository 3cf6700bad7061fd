"""Tensor-parallel rule tables (presets) for keras-hub's LLM families.

A table is an ordered list of ``(regex on the layer path, kind)`` read by
:func:`phalanx.models.parallelize.parallelize`; a task model (``GPT2CausalLM``, ...) has
the paths of its backbone under the backbone's name (``gpt2_backbone/transformer_layer_0/
self_attention``), which the regexes (``re.search``) match as well as the backbone alone.

============  ================================================  ==========================
family        layer (path regex)                                kind
============  ================================================  ==========================
GPT-2         ``token_embedding$`` (tied LM head too)           vocab
              ``transformer_layer_\\d+/self_attention$``          attention (MHA, biases)
              ``transformer_layer_\\d+/feedforward_intermediate_dense$``  column
              ``transformer_layer_\\d+/feedforward_output_dense$``  row
Llama         ``token_embedding$`` (untied LM head too)         vocab
              ``transformer_layer_\\d+/self_attention$``          attention (GQA, RoPE)
              ``transformer_layer_\\d+$``                         mlp (SwiGLU FFN)
Mistral       as Llama (the sliding window lives in the block's mask)
============  ================================================  ==========================

Positional embeddings and norms stay replicated. With ``tp`` given, :func:`preset_for`
leaves the token embedding replicated when ``tp`` does not divide the vocabulary (GPT-2's
50257 is odd): the vocab-parallel embedding needs whole, equal shards.

Example:
    >>> [kind for _, kind in PRESETS["LlamaBackbone"]]
    ['vocab', 'attention', 'mlp']
"""

from __future__ import annotations

_EMBEDDING = r"(^|/)token_embedding$"
_ATTENTION = r"(^|/)transformer_layer_\d+/self_attention$"

GPT2 = [
    (_EMBEDDING, "vocab"),
    (_ATTENTION, "attention"),
    (r"(^|/)transformer_layer_\d+/feedforward_intermediate_dense$", "column"),
    (r"(^|/)transformer_layer_\d+/feedforward_output_dense$", "row"),
]

LLAMA = [
    (_EMBEDDING, "vocab"),
    (_ATTENTION, "attention"),
    (r"(^|/)transformer_layer_\d+$", "mlp"),
]

MISTRAL = list(LLAMA)

PRESETS = {"GPT2Backbone": GPT2, "LlamaBackbone": LLAMA, "MistralBackbone": MISTRAL}


def backbone_of(model):
    """``model`` if it is a keras-hub backbone, its ``backbone`` if it is a keras-hub task
    model, else None."""
    for candidate in (model, getattr(model, "backbone", None)):
        if candidate is None:
            continue
        if any(c.__name__ == "Backbone" and c.__module__.startswith("keras_hub") for c in type(candidate).__mro__):
            return candidate
    return None


def family_of(model) -> str | None:
    """The preset name (a keras-hub backbone class, e.g. ``"LlamaBackbone"``) of ``model``'s
    family, looking through subclasses (``Llama3Backbone`` is Llama); None if none fits."""
    backbone = backbone_of(model)
    if backbone is None:
        return None
    for cls in type(backbone).__mro__:
        if cls.__name__ in PRESETS and cls.__module__.startswith("keras_hub"):
            return cls.__name__
    return None


def preset_for(model, tp: int | None = None):
    """The rule table for ``model`` (a copy), or None when its family has no preset. With
    ``tp``, the token embedding is left replicated if ``tp`` does not divide the vocabulary."""
    family = family_of(model)
    if family is None:
        return None
    rules = list(PRESETS[family])
    if tp is not None:
        vocab = getattr(backbone_of(model), "vocabulary_size", None)
        if vocab is not None and vocab % tp:
            rules = [(pattern, "replicated" if kind == "vocab" else kind) for pattern, kind in rules]
    return rules


__all__ = ["PRESETS", "GPT2", "LLAMA", "MISTRAL", "preset_for", "family_of", "backbone_of"]
