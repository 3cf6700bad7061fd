"""``phalanx train``'s built-in GPT on parameter servers (``parallel.strategy=parameter_server``).

:class:`GPTParameterServerEngine` trains the Keras model every other layout trains
(:func:`~phalanx.engines.keras_gpt.compiled_gpt`: the built-in GPT of phalanx's Keras layers,
its initial weights, :class:`~phalanx.engines.keras_gpt.PhalanxAdamW` with the decay mask,
learning-rate schedule, clipping and loss scale) on the one parameter-server engine,
:class:`~phalanx.engines.ps.KerasParameterServerEngine`: the model is built in the strategy's
scope (every variable on a ps task), and the chief's :class:`~phalanx.train.trainer.Trainer`
hands each step to the ``ClusterCoordinator``, which runs it on a free worker. What makes it
the trainer's engine:

* **the step** is Keras's ``train_step`` arithmetic on a batch of token ids ``[b, seq_len + 1]``
  (inputs ``[:, :-1]``, labels ``[:, 1:]``): the forward, ``model._compute_loss`` (the mean token
  cross-entropy plus the MoE balancing losses), the loss scaled by the optimizer, the gradient,
  ``optimizer.apply_gradients``. ``train.grad_accum`` splits the batch into that many equal
  micro-batches whose gradients (each of its loss / grad_accum) are summed before the one
  apply. A step returns its own loss and figures (``grad_norm``, ``lr``, ``loss_scale``,
  ``skipped``) as :class:`~phalanx.engines.ps.RemoteScalar` values, read when the trainer logs;
* **asynchronous**: up to 2 steps per worker run at once, each on the weights it read; with one
  worker the steps run one after another, each on the weights the previous one wrote, and the
  losses are Keras's one-device ``train_on_batch`` losses on the same batches
  (``tests/test_ps_gpt.py``). The MoE statistics totals (reset by every step) and the dropout
  seed states (advanced by every step) are variables on the ps tasks like the weights: steps
  in flight together share them;
* **the state** has the built-in GPT's logical names (weights, ``optimizer/m|v/*``,
  ``optimizer/step``, ``loss_scale/*``): :meth:`checkpoint_slots` first waits for the steps in
  flight, then the chief's writer reads the ps variables one at a time into an ordinary
  checkpoint that any layout loads (``phalanx eval RUN_DIR`` in one process), and back.

What it cannot honour is refused before anything is built (:func:`refuse_unhonoured`; tensor,
pipeline and expert parallelism, ZeRO, recomputation, micro-batches and ``parallel.devices``
are refused with the cluster's strategy, :func:`phalanx.cluster.strategies.resolve_strategy_name`).

Example (the chief of ``phalanx launch --workers 2 --ps 1 -- phalanx train parallel.strategy=parameter_server``)::

    setup = setup_cluster(cfg)           # worker and ps tasks serve in here
    engine = GPTParameterServerEngine(cfg, GPTTask(cfg.model), setup.strategy, setup.coordinator, 2)
    out = engine.train_step(tokens)      # scheduled; float(out["loss"]) waits for it
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from phalanx import checkpoint
from phalanx.config import Config, ConfigError
from phalanx.engines.keras_gpt import compiled_gpt
from phalanx.engines.ps import KerasParameterServerEngine, RemoteScalar, replica_function
from phalanx.engines.task import GPTTask, _tf_variable, for_config
from phalanx.layers import dropout as dropout_lib
from phalanx.layers.moe import MoE
from phalanx.models import gpt as builtin
from phalanx.models import transformer


def refuse_unhonoured(cfg: Config) -> None:
    """Raise :class:`ConfigError` naming the first key a parameter-server run of the built-in
    GPT would not honour (beyond the strategy's own refusals and the config's: sequence
    parallelism without tp, a batch grad_accum does not divide).

    >>> refuse_unhonoured(Config().replace(parallel={"dp": 2}))
    Traceback (most recent call last):
    ...
    phalanx.config.ConfigError: parallel.dp: 2: under parameter_server every step is one worker's (the cluster's workers run steps concurrently); leave parallel.dp=1
    """
    p, t = cfg.parallel, cfg.train
    if p.dp not in (1, -1):
        raise ConfigError("parallel.dp", f"{p.dp}: under parameter_server every step is one worker's (the "
                                         f"cluster's workers run steps concurrently); leave parallel.dp=1")
    if t.prune.target > 0:
        raise ConfigError("train.prune.target", f"{t.prune.target}: pruning is not built for parameter_server "
                                                f"(asynchronous steps in flight would race the mask updates); train "
                                                f"in one process or with multi_worker, or set train.prune.target=0")


class GPTParameterServerEngine:
    """The built-in GPT (``cfg.model``) trained asynchronously on parameter servers by
    :class:`~phalanx.engines.ps.KerasParameterServerEngine` (module docstring); what the
    trainer drives (``train_step``, ``eval_step``, ``checkpoint_slots``, ``join``)."""

    def __init__(self, cfg: Config, task: GPTTask, strategy: tf.distribute.Strategy, coordinator: Any,
                 num_workers: int = 1, max_in_flight: int | None = None):
        if not isinstance(task, GPTTask):
            raise TypeError(f"GPTParameterServerEngine trains the built-in GPT (a GPTTask), got "
                            f"{type(task).__name__}")
        if task.cfg != cfg.model:
            raise ConfigError("model", "the GPTTask's ModelConfig differs from cfg.model; build the task from "
                                       "cfg.model")
        refuse_unhonoured(cfg)
        self.cfg, self.task = cfg, for_config(task, cfg)
        self.names = list(builtin.weight_shapes(cfg.model))
        self.accum = cfg.train.grad_accum
        built: dict = {}

        def build():  # inside the strategy's scope: every variable on a ps task
            # (the optimizer's scalars go where the scope puts them: no device of their own)
            built["model"], built["convert"] = compiled_gpt(cfg, self.task, "")
            return built["model"]

        tokens = np.zeros([cfg.train.global_batch, cfg.model.seq_len], np.int32)
        self.ps = KerasParameterServerEngine(build, strategy, coordinator, (tokens, tokens), num_workers,
                                             max_in_flight)
        self.strategy, self.coordinator = strategy, coordinator
        self.model, self._convert = built["model"], built["convert"]
        self.optimizer = self.model.optimizer
        self.loss_scale = self.optimizer.loss_scale
        self.lost_steps = self.ps.lost_steps
        self.max_in_flight, self.num_workers = self.ps.max_in_flight, self.ps.num_workers
        # a step is one worker's over the whole global batch: one replica (the MFU counts every worker)
        self.dp, self.n_devices = 1, self.ps.num_workers
        self._moe = [layer for layer in self.model._flatten_layers(include_self=True, recursive=True)
                     if isinstance(layer, MoE)]
        self._state = self._state_variables()
        self._restored = False  # a restore assigned the state: the dropout seeds follow it before the next step
        self._train_fn = replica_function(strategy, self._replica_step)
        self._eval_fn = replica_function(strategy, self._replica_eval)

    # -- the step (traced, run on a worker) --------------------------------------------------

    def _loss(self, tokens, training: bool):
        x, y = tokens[:, :-1], tokens[:, 1:]
        y_pred = self.model(x, training=training)
        return self.model._compute_loss(x=x, y=y, y_pred=y_pred, training=training)

    def _replica_step(self, tokens):
        model, optimizer = self.model, self.optimizer
        for layer in self._moe:  # a step's MoE totals start at zero (as every engine's)
            layer.reset_statistics()
        variables = model.trainable_variables
        # grad_accum equal micro-batches (tf.split keeps their static shapes), summed before the one apply
        micro = [tokens] if self.accum == 1 else tf.split(tokens, self.accum, axis=0)
        grads, losses = None, []
        for piece in micro:
            with tf.GradientTape() as tape:
                loss = self._loss(piece, training=True)
                scaled = optimizer.scale_loss(loss)
                if self.accum > 1:
                    scaled = scaled / float(self.accum)
            step_grads = tape.gradient(scaled, variables)
            grads = step_grads if grads is None else \
                [a if g is None else (g if a is None else a + g) for a, g in zip(grads, step_grads)]
            losses.append(loss)
        optimizer.apply_gradients(zip(grads, variables))
        loss = losses[0] if self.accum == 1 else tf.add_n(losses) / float(self.accum)
        return {"loss": tf.cast(loss, tf.float32), **optimizer.step_figures}

    def _replica_eval(self, tokens):
        return {"loss": tf.cast(self._loss(tokens, training=False), tf.float32)}

    # -- what the trainer calls -----------------------------------------------------------------

    def train_step(self, batch) -> dict[str, RemoteScalar]:
        """Schedule one step on a free worker (the batch ``[b, seq_len + 1]`` travels with it);
        its loss and figures are fetched when read (``float()``)."""
        if self._restored:
            self._after_restore()
        return self.ps.schedule(self._train_fn, tf.convert_to_tensor(batch), "train")

    def eval_step(self, batch) -> tf.Tensor:
        """The loss of ``batch`` on the weights a free worker reads (waits for it)."""
        if self._restored:
            self._after_restore()
        out = self.ps.schedule(self._eval_fn, tf.convert_to_tensor(batch), "eval")
        return tf.constant(float(out["loss"]), tf.float32)

    def join(self) -> None:
        """Wait until every scheduled step has run (a step's error is raised here)."""
        self.ps.join()

    def gradients(self, batch) -> dict[str, np.ndarray]:
        raise NotImplementedError("gradients() is not available under ParameterServerStrategy")

    # -- state ---------------------------------------------------------------------------------

    def _state_variables(self) -> dict:
        """The state by logical name: each weight and moment a
        :class:`~phalanx.engines.joined.JoinedVariable` of the variables holding its parts
        (a moment lies beside its weight's variable, laid out alike), the step and the loss scale."""
        weights = self._convert.joined([_tf_variable(v) for v in self.model.trainable_variables])
        state = {name: weights[name] for name in self.names}
        for slot, slots in (("m", self.optimizer.m), ("v", self.optimizer.v)):
            moments = self._convert.joined([_tf_variable(s) for s in slots])
            state.update({f"optimizer/{slot}/{name}": moments[name] for name in self.names})
        state["optimizer/step"] = self.optimizer.step
        state.update(self.loss_scale.state())
        return state

    def checkpoint_slots(self) -> list[checkpoint.ShardSet]:
        """The state as whole-tensor slots by logical name (:func:`phalanx.checkpoint.variable_sets`),
        after every scheduled step has run: a save reads, and a restore assigns, one tensor at a
        time per writer thread, so the chief never holds the whole state. The layout of every
        other engine's checkpoint by name: each loads into the other."""
        self.join()  # no step in flight while the slots are read (save) or assigned (restore)
        self._restored = True  # (a save too: the seeds are set to what they already are)
        return checkpoint.variable_sets(self._state)

    def _after_restore(self) -> None:
        """After state was assigned outside a step: the dropout layers' seed states at the steps
        run so far (applied and skipped), so a resumed run draws the masks of the next step."""
        self._restored = False
        if self.cfg.model.dropout:
            dropout_lib.set_calls(self.model, int(self.optimizer.step.numpy()) + int(self.loss_scale.skipped.numpy()))

    def state_dict(self) -> dict[str, np.ndarray]:
        self.join()
        return {k: np.asarray(v.numpy()) for k, v in self._state.items()}

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self.join()
        missing = [k for k in self._state if k not in state]
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}; "
                           f"was it written for a different model?")
        for name, var in self._state.items():
            value = np.asarray(state[name])
            if tuple(value.shape) != tuple(var.shape):
                raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}, the model expects "
                                 f"{tuple(var.shape)}: a different model config?")
            var.assign(value.astype(var.dtype.as_numpy_dtype))
        self._restored = True

    def weights(self) -> dict[str, np.ndarray]:
        self.join()
        return transformer.gpt_weights(self.model)

    def num_params(self) -> int:
        return builtin.num_params(self.cfg.model)
