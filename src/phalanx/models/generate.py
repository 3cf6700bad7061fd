"""Autoregressive sampling from a GPT.

The model sees at most ``seq_len`` tokens; longer contexts keep the most recent
ones. Each step runs one compiled forward pass over a fixed-size window (so the
graph is traced once), reading the logits at the last real position.

Example:
    >>> from phalanx.config import ModelConfig
    >>> from phalanx.models.transformer import gpt
    >>> model = gpt(ModelConfig(layers=1, d_model=16, heads=2, ffn=32, vocab=256, seq_len=8))
    >>> len(generate(model, [65, 66], 5, seq_len=8, temperature=0))
    5
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf


def generate(model, prompt: list[int], n_tokens: int, seq_len: int, temperature: float = 0.8,
             top_k: int = 40, seed: int = 0) -> list[int]:
    """Return ``n_tokens`` new token ids continuing ``prompt`` (greedy when temperature is 0)."""
    @tf.function(input_signature=[tf.TensorSpec([1, seq_len], tf.int32), tf.TensorSpec([], tf.int32)])
    def last_logits(window, position):
        return tf.cast(model(window, training=False)[0, position], tf.float32)

    return sample(lambda window, position: last_logits(tf.constant(window), tf.constant(position)).numpy(),
                  prompt, n_tokens, seq_len, temperature, top_k, seed)


def sample(next_logits, prompt: list[int], n_tokens: int, seq_len: int, temperature: float = 0.8,
           top_k: int = 40, seed: int = 0) -> list[int]:
    """The sampling loop, for any runtime: ``next_logits(window [1, seq_len] int32, position)``
    returns the logits at ``position`` of the zero-padded window (a Keras model, an exported
    artifact). Greedy at temperature 0, else top-k sampling from the softened distribution."""
    rng = np.random.default_rng(seed)
    context = list(prompt) or [0]  # byte 0 separates documents: a neutral start
    out = []
    for _ in range(n_tokens):
        window = context[-seq_len:]
        padded = np.zeros([1, seq_len], np.int32)
        padded[0, : len(window)] = window
        logits = np.asarray(next_logits(padded, len(window) - 1), np.float64)
        if temperature == 0:
            token = int(np.argmax(logits))
        else:
            logits = logits / temperature
            if 0 < top_k < logits.size:
                cutoff = np.partition(logits, -top_k)[-top_k]
                logits = np.where(logits < cutoff, -np.inf, logits)
            probs = np.exp(logits - logits.max())
            token = int(rng.choice(logits.size, p=probs / probs.sum()))
        out.append(token)
        context.append(token)
    return out
