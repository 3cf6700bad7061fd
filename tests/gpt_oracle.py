"""The one-device oracle of the built-in GPT: Keras's own ``train_on_batch`` / ``test_on_batch``.

The same Keras model ``phalanx train`` builds (:func:`phalanx.models.transformer.gpt`, one
device, no tensor or expert shards), started from :func:`phalanx.models.gpt.initial_weights`,
compiled with phalanx's AdamW (:class:`~phalanx.engines.keras_gpt.PhalanxAdamW`: the trainer's
schedule, decay mask, clipping and loss scale) and the mean token cross-entropy, and stepped by
Keras's trainer alone. No phalanx engine runs: any layout of the engine must reproduce its
losses, gradient norms and weights.

Example:
    >>> import numpy as np
    >>> from phalanx.config import Config
    >>> cfg = Config().replace(model={"layers": 1, "d_model": 16, "heads": 2, "ffn": 32, "vocab": 64,
    ...                               "seq_len": 8}, train={"global_batch": 2})
    >>> oracle = KerasGPT(cfg)
    >>> out = oracle.train_step(np.zeros([2, 9], np.int32))
    >>> sorted(out)
    ['grad_norm', 'loss', 'loss_scale', 'lr', 'skipped']
"""

from __future__ import annotations

import keras
import numpy as np

from phalanx.config import Config
from phalanx.engines.keras_gpt import PhalanxAdamW
from phalanx.models import gpt as builtin
from phalanx.models import transformer
from phalanx.train.moe_stats import moe_layers


class KerasGPT:
    """The built-in GPT of ``cfg.model`` trained on one device by Keras (module docstring).

    ``policy``: the Keras dtype policy its layers compute in (default ``float32``);
    ``device``: where it runs (the optimizer's scalars live there too). ``chunks``: each batch
    is cut into that many equal micro-batches, each with its own MoE capacity and balancing
    loss, the losses averaged (:func:`helpers.ghost_batches`: what a layout's micro-batches or
    data replicas of the mixture-of-experts GPT compute; the dense GPT is the same either way)."""

    def __init__(self, cfg: Config, policy: str = "float32", device: str = "/device:CPU:0", seed: int | None = None,
                 chunks: int = 1):
        from helpers import ghost_batches

        self.cfg = cfg
        seed = cfg.train.seed if seed is None else seed
        self.gpt = transformer.gpt(cfg.model, seed=None, dtype_policy=policy)
        transformer.load_gpt_weights(self.gpt, builtin.initial_weights(cfg.model, seed))
        self.model = self.gpt if chunks == 1 else ghost_batches(self.gpt, chunks, average_added_losses=True)
        decays = {id(p.variable): builtin.decays(name)
                  for name, parts in transformer.weight_parts(self.gpt).items() for p in parts}
        self.optimizer = PhalanxAdamW(cfg, decays, device)
        self.model.compile(optimizer=self.optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        # Keras wraps an optimizer in its LossScaleOptimizer under mixed_float16; this one scales itself
        self.model.optimizer = self.optimizer
        self.optimizer.build(self.model.trainable_variables)  # (its apply takes every variable, built)

    def train_step(self, batch: np.ndarray) -> dict[str, float]:
        """One step of Keras's ``train_on_batch`` on ``batch`` ``[B, T+1]``: loss (before the
        update) and the optimizer's figures."""
        batch = np.asarray(batch)
        for layer in moe_layers(self.gpt):  # a step's MoE totals start at zero, as the engines' do
            layer.reset_statistics()
        loss = self.model.train_on_batch(batch[:, :-1], batch[:, 1:], return_dict=True)["loss"]
        out = {key: float(var.numpy()) for key, var in self.optimizer.last.items()}
        out["loss"] = float(loss)
        return out

    def eval_loss(self, batch: np.ndarray) -> float:
        batch = np.asarray(batch)
        return float(self.model.test_on_batch(batch[:, :-1], batch[:, 1:], return_dict=True)["loss"])

    def weights(self) -> dict[str, np.ndarray]:
        """The weights by the built-in GPT's logical names."""
        return transformer.gpt_weights(self.gpt)

    def load_weights(self, weights: dict[str, np.ndarray]) -> None:
        """Assign weights by logical name (e.g. another engine's ``weights()``)."""
        transformer.load_gpt_weights(self.gpt, {n: np.asarray(w, np.float32) for n, w in weights.items()})

    def state_dict(self) -> dict[str, np.ndarray]:
        """Weights, ``optimizer/m|v/<name>``, ``optimizer/step`` and ``loss_scale/*`` by the built-in logical names
        (the engines' state keys): each AdamW moment is laid out as its variable, joined by the
        same boxes (:func:`~phalanx.models.transformer.weight_parts`)."""
        state = self.weights()
        index = {id(v): i for i, v in enumerate(self.optimizer._trainable_variables)}
        for name, parts in transformer.weight_parts(self.gpt).items():
            for slot, slots in (("m", self.optimizer.m), ("v", self.optimizer.v)):
                whole = np.empty(transformer.built_in_shape(parts), np.float32)
                for p in parts:
                    value = slots[index[id(p.variable)]].numpy()
                    whole[tuple(slice(a, b) for a, b in p.box)] = np.reshape(value, p.shape)
                state[f"optimizer/{slot}/{name}"] = whole
        state["optimizer/step"] = np.asarray(self.optimizer.step.numpy())
        state.update({k: np.asarray(var.numpy()) for k, var in self.optimizer.loss_scale.state().items()})
        return state


def run(cfg: Config, batches, policy: str = "float32", weights_after: int | None = None):
    """``(losses, grad_norms, weights)`` of the oracle trained on ``batches`` in order; the
    weights after the first ``weights_after`` steps (default all of them)."""
    oracle = KerasGPT(cfg, policy)
    losses, norms, weights = [], [], None
    for i, b in enumerate(batches):
        if i == weights_after:
            weights = oracle.weights()
        out = oracle.train_step(b)
        losses.append(out["loss"])
        norms.append(out["grad_norm"])
    return losses, norms, oracle.weights() if weights is None else weights
