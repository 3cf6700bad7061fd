"""The configuration of ``phalanx train`` on a run directory that already holds a checkpoint.

The run's saved ``config.yaml`` is the base; the config file and overrides given on the
command line are applied over it, and every key whose value then differs from the saved run
is named. Keys that would change the model or the data it is trained on (:data:`FIXED`) are
refused before anything is written; the others may change between sessions and are printed:

    resuming runs/x (its config.yaml): train.steps 100 -> 200, parallel.dp 1 -> 2

Fixed for a run's life (a checkpoint belongs to them): every ``model.*`` key (the weights'
shapes and what they compute), the data (``data.source``, ``data.tokenizer``,
``data.bpe_vocab``, ``data.val_fraction``, ``data.max_bytes``: the examples, their ids and the
held-out split), ``train.seed`` and ``train.global_batch`` (the order of the examples and the
position the checkpoint recorded in it). Everything else may change: the length and the
optimizer's schedule (``train.steps``, ``train.lr``, ``train.warmup``, ...), evaluation and
logging, ``checkpoint.*``, ``precision.*``, ``data.cache_dir`` and the layout (``parallel.*``,
``train.grad_accum``: checkpoints do not depend on the layout). When the command line changes
``parallel.devices``, ``parallel.tp`` or ``parallel.pp`` but not ``parallel.dp``, the saved
``dp`` is dropped and derived again (:func:`phalanx.config.derive_layout`).

Example (``$ phalanx train run.dir=runs/x train.steps=200`` after 100 steps):
    >>> cfg, note = resolve_train_config(None, ["run.dir=/nonexistent/run"])
    >>> note is None
    True
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

from phalanx import checkpoint
from phalanx.config import (Config, ConfigError, RunConfig, _deep_update, derived, from_dict, load_config,
                            read_raw)

FIXED = ("model.", "data.source", "data.tokenizer", "data.bpe_vocab", "data.val_fraction", "data.max_bytes",
         "train.seed", "train.global_batch")
# keys whose change re-derives parallel.dp when dp itself is not given
_LAYOUT = ("devices", "tp", "pp")


def is_fixed(key: str) -> bool:
    """Whether ``key`` is fixed for a run's life (module docstring).

    >>> is_fixed("model.layers"), is_fixed("train.steps"), is_fixed("data.cache_dir")
    (True, False, False)
    """
    return any(key.startswith(f) if f.endswith(".") else key == f for f in FIXED)


def resolve_train_config(path: str | None, overrides: Sequence[str]) -> tuple[Config, str | None]:
    """The config ``phalanx train [path] [overrides]`` runs, and the line saying that it resumes a
    run and what changed (None for a new run). Raises :class:`ConfigError` naming every fixed key
    that would change, before anything is written."""
    explicit = read_raw(path, overrides)
    run = explicit.get("run") if isinstance(explicit.get("run"), dict) else {}
    run_dir = Path(str(run.get("dir", RunConfig().dir))).expanduser()
    saved_path = run_dir / "config.yaml"
    if not saved_path.is_file() or checkpoint.latest(run_dir / "checkpoints") is None:
        return load_config(path, overrides), None
    try:
        saved_raw = read_raw(saved_path)
        saved = from_dict(saved_raw)
    except ConfigError as err:
        raise ConfigError(err.key, f"{err} (in {saved_path}, the saved config of the run being resumed; use a "
                                   f"new run.dir, or fix the file)") from None
    merged = copy.deepcopy(saved_raw)
    given = explicit.get("parallel") if isinstance(explicit.get("parallel"), dict) else {}
    if "dp" not in given and any(k in given for k in _LAYOUT) and isinstance(merged.get("parallel"), dict):
        merged["parallel"].pop("dp", None)  # derived again from the new device count
    _deep_update(merged, explicit)
    cfg = from_dict(derived(merged))
    changes = differences(saved, cfg)
    refused = [(k, old, new) for k, old, new in changes if is_fixed(k)]
    if refused:
        listed = ", ".join(f"{k} {old!r} -> {new!r}" for k, old, new in refused)
        raise ConfigError(refused[0][0], f"{run_dir} holds a run of another model or data: {listed}. These keys are "
                                         f"fixed for a run's life (the model.* keys, data.source/tokenizer/bpe_vocab/"
                                         f"val_fraction/max_bytes, train.seed, train.global_batch); drop them to "
                                         f"resume with the run's own config.yaml, or use a new run.dir")
    shown = ", ".join(f"{k} {_show(old)} -> {_show(new)}" for k, old, new in changes)
    return cfg, f"resuming {run_dir} (its config.yaml)" + (f": {shown}" if shown else "")


def differences(before: Config, after: Config) -> list[tuple[str, Any, Any]]:
    """``(dotted key, before, after)`` for every key whose value differs.

    >>> differences(Config(), Config().replace(train={"steps": 5}))
    [('train.steps', 300, 5)]
    """
    a, b = _flat(before.to_dict()), _flat(after.to_dict())
    return [(k, a[k], b.get(k)) for k in a if a[k] != b.get(k)]


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)
