"""``phalanx <command> ...``: dispatch only; each command's module parses its own arguments.

Example:
    $ phalanx train configs/demo.yaml train.steps=50
    $ phalanx plan model.layers=96 model.d_model=12288 --devices 1024 --hardware a100-80gb
"""

from __future__ import annotations

import importlib
import os
import sys

from phalanx.config import ConfigError

COMMANDS = {
    "train": ("phalanx.train.cli", "main_train", "train a model (config file + key=value overrides)"),
    "eval": ("phalanx.train.cli", "main_eval", "loss / perplexity of a run's latest checkpoint"),
    "generate": ("phalanx.train.cli", "main_generate", "sample text from a run's latest checkpoint"),
    "data": ("phalanx.data.cli", "main", "prepare / inspect TFRecord datasets"),
    "plan": ("phalanx.commands.plan", "main", "memory, FLOPs, time and layout search before training"),
    "schedule": ("phalanx.commands.schedule", "main", "print and draw a pipeline schedule"),
    "launch": ("phalanx.cluster.launch", "main", "run a local multi-process TensorFlow cluster"),
    "export": ("phalanx.export.cli", "main", "a run's model as keras/savedmodel/litert, quantized, + quality report"),
}


def usage() -> str:
    lines = ["usage: phalanx <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `phalanx <command> --help` for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # TensorFlow leaves oneDNN off on CPUs without AVX512 (e.g. this AMD EPYC); with it on,
    # matmuls ran 4-6x faster and the demo GPT 1.2x faster, with the same losses (measured).
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
    module_name, func, _ = COMMANDS[name]
    try:
        return int(getattr(importlib.import_module(module_name), func)(rest) or 0)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
