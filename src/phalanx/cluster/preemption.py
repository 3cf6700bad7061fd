"""Stopping every worker of a cluster at the same step after SIGTERM (preemption).

A preemption notice (SIGTERM from Kubernetes, Slurm or ``phalanx launch``) may reach
one worker, or all of them a few steps apart. Under ``MultiWorkerMirroredStrategy``
every worker must run the same collectives in the same order, so a worker that
stopped alone would leave the others blocked in the next all-reduce. The trainer
therefore asks :func:`stop_agreement` each step: every worker contributes its local
flag to one tiny all-reduce (SUM of 0/1; collectives on CPU support SUM and MEAN, not
MAX) and all stop together when any of them was signalled. The chief then writes the
checkpoint and all exit 0.

One process (and the parameter-server chief, the only process running the loop)
needs no agreement: the local flag is returned as is.

Example (one process):
    >>> agree = stop_agreement(None)
    >>> agree(False), agree(True)
    (False, True)
"""

from __future__ import annotations

from typing import Any, Callable


def stop_agreement(cluster: Any) -> Callable[[bool], bool]:
    """A function ``local_flag -> whether every worker stops now``.

    ``cluster``: a :class:`phalanx.cluster.strategies.ClusterSetup` or None. Under a
    multi-worker strategy with several workers, each call is a collective: every
    worker must call it once per step, in the same place of its loop.
    """
    import tensorflow as tf

    strategy = getattr(cluster, "strategy", None)
    # The workers of the cluster, not its data shards: the expert-parallel GPT feeds every worker the
    # whole batch (data_count 1), and its workers must still stop together.
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
