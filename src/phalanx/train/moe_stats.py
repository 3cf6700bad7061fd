"""Mixture-of-experts figures for the rows ``phalanx.fit`` writes (``metrics.jsonl``, TensorBoard).

Every :class:`phalanx.layers.MoE` keeps statistics of its last training call in
non-trainable scalars (``balance``, ``dropped_fraction``, ``load_min``, ``load_max``).
:class:`MoEStats` reads them after every training step and gives each epoch's row the
mean over that epoch's steps (as the row's ``loss`` is the epoch's mean) of:

* ``moe_aux_loss``: the load-balancing loss the layers added, ``sum over layers of
  aux_loss_coef x balance`` (the router z-loss is not in it);
* ``moe_balance``: ``balance`` averaged over layers (``E x sum_e f_e x P_e`` before the
  coefficient: 1.0 for a uniform router, ``E`` when every token picks one expert);
* ``moe_dropped``: the share of token-to-expert assignments dropped by capacity, over all
  layers (each layer weighted by its ``top_k``: dropped assignments / assignments);
* ``moe_load_min`` / ``moe_load_max``: the least / most loaded expert's share of the kept
  assignments x E, min / max over layers (1.0 is perfect balance).

What "the last training call" is on a layout: the layer is called once per micro-batch,
so with several data replicas or micro-batches the figures are those of the step's last
micro-batch in the engine's order (the last replica's last micro-batch; across workers,
averaged over the workers like any other float state). On one device with one
micro-batch they are the whole batch's.

Example:
    >>> import keras, numpy as np
    >>> from phalanx.layers import MoE
    >>> inputs = keras.Input((4, 8))
    >>> model = keras.Model(inputs, MoE(num_experts=4, hidden_dim=8, capacity_factor=0.5)(inputs))
    >>> _ = model(np.ones([2, 4, 8], "float32"), training=True)
    >>> stats = MoEStats(model)
    >>> stats.update()
    >>> row = stats.epoch_row()
    >>> sorted(row), row["moe_dropped"] > 0
    (['moe_aux_loss', 'moe_balance', 'moe_dropped', 'moe_load_max', 'moe_load_min'], True)
"""

from __future__ import annotations

import numpy as np

from phalanx.layers.moe import MoE

KEYS = ("moe_aux_loss", "moe_balance", "moe_dropped", "moe_load_min", "moe_load_max")


def moe_layers(model) -> list[MoE]:
    """The :class:`MoE` layers of ``model``, nested models and layers included, each once."""
    found, seen = [], set()
    for layer in model._flatten_layers(include_self=True, recursive=True):
        if isinstance(layer, MoE) and id(layer) not in seen:
            seen.add(id(layer))
            found.append(layer)
    return found


class MoEStats:
    """Reads the MoE layers' statistics after each training step; ``epoch_row`` gives
    the epoch's means (module docstring) and starts the next epoch. A model without MoE
    layers (or ``model`` None) gives empty rows and reads nothing."""

    def __init__(self, model):
        self.layers = moe_layers(model) if model is not None else []
        weights = np.array([float(layer.top_k) for layer in self.layers])
        self._top_k = weights / weights.sum() if self.layers else weights
        self._coef = np.array([float(layer.aux_loss_coef) for layer in self.layers])
        self._sums: dict[str, float] = {}
        self._steps = 0

    def __bool__(self) -> bool:
        return bool(self.layers)

    def read(self) -> dict[str, float]:
        """The figures of the last training step (empty without MoE layers)."""
        if not self.layers:
            return {}
        # rows: layers; columns: balance, dropped_fraction, load_min, load_max
        v = np.array([[float(np.asarray(var.numpy())) for var in
                       (m.balance, m.dropped_fraction, m.load_min, m.load_max)] for m in self.layers])
        return {"moe_aux_loss": float(self._coef @ v[:, 0]), "moe_balance": float(v[:, 0].mean()),
                "moe_dropped": float(self._top_k @ v[:, 1]), "moe_load_min": float(v[:, 2].min()),
                "moe_load_max": float(v[:, 3].max())}

    def update(self) -> None:
        """Add the last training step's figures to the epoch's sums."""
        if not self.layers:
            return
        for key, value in self.read().items():
            self._sums[key] = self._sums.get(key, 0.0) + value
        self._steps += 1

    def epoch_row(self) -> dict[str, float]:
        """The means over the steps since the last call (empty if none), then reset."""
        if not self._steps:
            return {}
        row = {key: self._sums[key] / self._steps for key in KEYS}
        self._sums, self._steps = {}, 0
        return row
