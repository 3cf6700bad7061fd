"""Stopping a run cleanly on SIGTERM (preemption) or SIGINT (Ctrl-C), every worker at the same step.

:class:`StopSignals` turns the first SIGTERM or SIGINT into a flag that the training loop
reads at each step boundary: it saves a checkpoint there and returns normally (exit 0).
A SIGINT after the first signal means "now": it raises :class:`KeyboardInterrupt` at once, wherever the
loop is (a save in progress is abandoned, its temporary directory removed, and the
checkpoints already written stay as they were: saves are atomic renames).

A preemption notice (SIGTERM from Kubernetes, Slurm or ``phalanx launch``) may reach
one worker, or all of them a few steps apart. Under ``MultiWorkerMirroredStrategy``
every worker must run the same collectives in the same order, so a worker that
stopped alone would leave the others blocked in the next all-reduce. The trainer
therefore asks :func:`stop_agreement` each step: every worker contributes its local
flag to one tiny all-reduce (SUM of 0/1; collectives on CPU support SUM and MEAN, not
MAX) and all stop together when any of them was signalled (SIGTERM or SIGINT). The chief then writes the
checkpoint and all exit 0.

One process (and the parameter-server chief, the only process running the loop)
needs no agreement: the local flag is returned as is.

Example (one process):
    >>> agree = stop_agreement(None)
    >>> agree(False), agree(True)
    (False, True)
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any, Callable


class StopSignals:
    """While entered (in the main thread; elsewhere it does nothing): the first SIGTERM or
    SIGINT sets :attr:`signal` (its name) and :attr:`set` (and with ``announce``, says so
    on stderr at once); a SIGINT after either raises :class:`KeyboardInterrupt`. The
    previous handlers come back on exit.

    Example:
        >>> import os, signal
        >>> with StopSignals() as stop:
        ...     os.kill(os.getpid(), signal.SIGINT)
        ...     stop.set, stop.signal
        (True, 'SIGINT')
        >>> with StopSignals() as stop:
        ...     os.kill(os.getpid(), signal.SIGTERM)
        ...     try:
        ...         os.kill(os.getpid(), signal.SIGINT)
        ...     except KeyboardInterrupt as err:
        ...         print(err)
        a second SIGINT: stopped at once
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, announce: bool = False):
        self.announce = announce
        self.signal: str | None = None
        self._previous: dict = {}

    @property
    def set(self) -> bool:
        return self.signal is not None

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt("a second SIGINT: stopped at once")
        if self.signal is None:
            self.signal = signal.Signals(signum).name
            if self.announce:
                # os.write, not print: a handler may run in the middle of a print to stderr
                again = " (Ctrl-C again stops at once, without saving)" if signum == signal.SIGINT else ""
                os.write(2, f"\n{self.signal} received: stopping at the end of this step with a checkpoint"
                            f"{again}\n".encode())

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def stop_agreement(cluster: Any) -> Callable[[bool], bool]:
    """A function ``local_flag -> whether every worker stops now``.

    ``cluster``: a :class:`phalanx.cluster.strategies.ClusterSetup` or None. Under a
    multi-worker strategy with several workers, each call is a collective: every
    worker must call it once per step, in the same place of its loop.
    """
    import tensorflow as tf

    strategy = getattr(cluster, "strategy", None)
    # The workers of the cluster: each reads the whole batch and trains its rows of it, and they
    # must stop together.
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy) or cluster.info.num_workers < 2:
        return bool
    return _CollectiveFlag(strategy)


class _CollectiveFlag:
    """Sum of the workers' 0/1 flags over the strategy's replicas (one all-reduce)."""

    def __init__(self, strategy):
        import tensorflow as tf

        self.strategy = strategy

        @tf.function
        def any_set(flag):
            # Every local replica contributes the process's flag; the sum is > 0 iff any worker's was set.
            per_replica = strategy.run(lambda: tf.identity(flag))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)

        self._any_set = any_set

    def __call__(self, flag: bool) -> bool:
        import tensorflow as tf

        return float(self._any_set(tf.constant(1.0 if flag else 0.0))) > 0.0
