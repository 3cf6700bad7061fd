"""One rule for the state a training step changes but does not train, whatever the layout.

Non-trainable state (BatchNormalization's moving statistics, Dropout's seed state, an MoE
layer's statistics) is updated by every call of a layer in training. A step runs the model as
several calls — micro-batches within a data replica, replicas in one process, workers — and
their updates are combined as Keras's ``MirroredStrategy`` combines its replicas':

* **within a replica** the micro-batches are threaded in order: each starts from the state
  the previous one left (GPipe: each micro-batch moves BatchNorm's averages once with its own
  batch statistics, each draws its own dropout mask);
* **across replicas** (in one process, and across workers alike) every replica starts from the
  step's starting state, and the replicas' results are combined once per step by
  :func:`rule_of` the variable:

  - ``sum``: an MoE layer's step totals (:func:`phalanx.layers.moe.is_step_total`): they start
    at zero every step, so the sum over replicas is the whole batch's;
  - a variable created with a Keras ``aggregation`` follows it (``only_first_replica``, e.g.
    the MoE layer's last-call figures: replica 0's value);
  - ``mean``: any other floating-point state — BatchNorm's moving mean and variance are the
    average of the replicas' updated values, as ``MirroredStrategy`` reduces them;
  - ``first``: integer state (Dropout's ``seed_generator_state``): every replica started from
    the same value and made the same number of calls, so every replica ends with the same
    value — the replicas of one step draw the same dropout masks, as the workers of a cluster do.

So a layout's statistics do not depend on where its replicas are: dp2 in one process and 2
workers x dp1 give the same moving averages.

Example:
    >>> import tensorflow as tf
    >>> float(combine([tf.constant(1.0), tf.constant(3.0)], "mean"))
    2.0
    >>> float(combine([tf.constant(1.0), tf.constant(3.0)], "sum"))
    4.0
"""

from __future__ import annotations

from typing import Sequence

import tensorflow as tf

from phalanx.layers.moe import is_step_total

RULES = ("sum", "mean", "first")


# A Keras variable's own ``aggregation`` (what MirroredStrategy would do with it), when set.
_AGGREGATIONS = {"sum": "sum", "mean": "mean", "only_first_replica": "first"}


def rule_of(variable) -> str:
    """How the replicas' values of ``variable`` join: ``sum``, ``mean`` or ``first`` (module
    docstring). A variable created with an ``aggregation`` (``sum``, ``mean``,
    ``only_first_replica``: replica 0's value) follows it, as under MirroredStrategy; an MoE
    step total is summed whatever its aggregation says."""
    if is_step_total(variable):
        return "sum"
    aggregation = str(getattr(variable, "aggregation", "none") or "none").lower()
    if aggregation in _AGGREGATIONS:
        return _AGGREGATIONS[aggregation]
    if tf.as_dtype(variable.dtype).is_floating:
        return "mean"
    return "first"


def combine(values: Sequence[tf.Tensor], rule: str) -> tf.Tensor:
    """The replicas' end values of one state variable joined by ``rule``."""
    if rule not in RULES:
        raise ValueError(f"rule: {rule!r} is not one of {', '.join(RULES)}")
    if rule == "first" or len(values) == 1:
        return values[0]
    total = tf.add_n([tf.convert_to_tensor(v) for v in values])
    return total if rule == "sum" else total / tf.cast(len(values), total.dtype)


def combine_replicas(start: list, ends: list[list], rules: list[str]) -> list:
    """Per state slot, the replicas' end values ``ends[replica][slot]`` joined by ``rules[slot]``;
    a slot no replica changed stays ``start[slot]`` (the very object: nothing to write)."""
    out = []
    for k, (before, rule) in enumerate(zip(start, rules)):
        values = [replica[k] for replica in ends]
        out.append(before if all(v is before for v in values) else combine(values, rule))
    return out
