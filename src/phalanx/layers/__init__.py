"""Keras layers written for phalanx: plain Keras layers that any model can use.

* :class:`~phalanx.layers.moe.MoE` — a mixture-of-experts feed-forward layer (top-k
  routing, capacity, load-balancing and z losses).
"""

from phalanx.layers.moe import MoE

__all__ = ["MoE"]
