"""Mixture-of-experts figures for the rows ``phalanx.fit`` writes (``metrics.jsonl``, TensorBoard).

Every :class:`phalanx.layers.MoE` sums statistics over its training calls (totals that
``phalanx.fit``'s engine starts at zero every step). The layer is called once per
micro-batch of every data replica, so after a step the totals cover the whole batch.
:class:`MoEStats` reads them after every training step and gives each epoch's row the
mean over that epoch's steps (as the row's ``loss`` is the epoch's mean) of the step's:

* ``moe_aux_loss``: the load-balancing loss the layers added to the step's loss, ``sum
  over layers of aux_loss_coef x balance`` (the router z-loss is not in it);
* ``moe_balance``: ``balance`` averaged over layers, where a layer's ``balance`` is ``E x
  sum_e f_e x P_e`` before the coefficient (1.0 for a uniform router, ``E`` when every
  token picks one expert) averaged over the step's calls — each micro-batch balances its
  own tokens, as the loss it adds does;
* ``moe_dropped``: the share of the step's token-to-expert assignments dropped by
  capacity (each call has its own capacity), over all layers: dropped assignments /
  assignments;
* ``moe_load_min`` / ``moe_load_max``: the least / most loaded expert's share of the
  step's kept assignments x E (counts summed over the calls), min / max over layers
  (1.0 is perfect balance).

Across workers the totals are averaged over the workers like any other float state,
which leaves these ratios the whole global batch's.

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
        self._coef = np.array([float(layer.aux_loss_coef) for layer in self.layers])
        self._sums: dict[str, float] = {}
        self._steps = 0

    def __bool__(self) -> bool:
        return bool(self.layers)

    def read(self) -> dict[str, float]:
        """The figures of the calls since the totals were last reset: in ``phalanx.fit``,
        the last training step (empty without MoE layers)."""
        if not self.layers:
            return {}
        balance, dropped, assignments, load_min, load_max = [], 0.0, 0.0, [], []
        for m in self.layers:
            calls, total_balance, total, load = (np.asarray(v.numpy(), np.float64) for v in m.statistics_totals())
            kept = max(float(load.sum()), 1.0)
            balance.append(float(total_balance) / max(float(calls), 1.0))
            dropped += float(total) - float(load.sum())
            assignments += float(total)
            load_min.append(float(load.min()) / kept * m.num_experts)
            load_max.append(float(load.max()) / kept * m.num_experts)
        return {"moe_aux_loss": float(self._coef @ np.array(balance)), "moe_balance": float(np.mean(balance)),
                "moe_dropped": dropped / max(assignments, 1.0), "moe_load_min": min(load_min),
                "moe_load_max": max(load_max)}

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
