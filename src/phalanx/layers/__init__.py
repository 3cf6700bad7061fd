"""Keras layers written for phalanx: plain Keras layers that any model can use.

* :class:`~phalanx.layers.moe.MoE` — a mixture-of-experts feed-forward layer (top-k
  routing, capacity, load-balancing and z losses).
* Tensor-parallel layers (:mod:`~phalanx.layers.tensor_parallel`,
  :mod:`~phalanx.layers.attention`): :class:`ColumnParallelDense`, :class:`RowParallelDense`,
  :class:`VocabParallelEmbedding` with :func:`vocab_parallel_cross_entropy`,
  :class:`ParallelMLP` and :class:`ParallelSelfAttention`. Plain layers at ``tp=1``; at
  ``tp>1`` their weights are cut into shards (:mod:`~phalanx.layers.sharding`) that the
  engine places on the devices of the tensor axis.
* :class:`~phalanx.layers.transformer.TransformerBlock` — a pre-LN GPT block of those layers
  (MLP or MoE), with Megatron sequence parallelism; :class:`LayerNorm`,
  :class:`PositionEmbedding`, :func:`gelu_approximate` for the GPT built from them
  (:mod:`phalanx.models.transformer`).
* :mod:`~phalanx.layers.dropout` — dropout masks as a function of each element's place in the
  whole tensor, so every layout (micro-batches, replicas, sequence chunks) draws the same.
"""

from phalanx.layers.attention import ParallelSelfAttention
from phalanx.layers.moe import MoE
from phalanx.layers.tensor_parallel import (
    ColumnParallelDense,
    ParallelMLP,
    RowParallelDense,
    VocabParallelEmbedding,
    vocab_parallel_cross_entropy,
)
from phalanx.layers.transformer import LayerNorm, PositionEmbedding, TransformerBlock, gelu_approximate

__all__ = ["MoE", "ColumnParallelDense", "RowParallelDense", "VocabParallelEmbedding",
           "vocab_parallel_cross_entropy", "ParallelMLP", "ParallelSelfAttention"]
__all__ += ["TransformerBlock", "LayerNorm", "PositionEmbedding", "gelu_approximate"]
