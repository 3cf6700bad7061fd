"""``phalanx <command> ...``: dispatch only; each command's module parses its own arguments.

Example:
    $ phalanx train configs/demo.yaml train.steps=50
    $ phalanx plan model.layers=96 model.d_model=12288 --devices 1024 --hardware a100-80gb
"""

from __future__ import annotations

import importlib
import io
import os
import re
import sys

from phalanx import __version__
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


# TensorFlow's native log lines ("I0000 00:00:1795... port.cc:153] oneDNN custom operations are on ..."),
# absl's "All log messages before absl::InitializeLog()" warning and the LiteRT converter's
# settings dump. TensorFlow 2.21 logs through absl, which writes everything to stderr before
# absl::InitializeLog() (never called) whatever TF_CPP_MIN_LOG_LEVEL says; the CPU wheel links
# absl into two shared libraries, each with its own once-only state, so every banner came twice.
NATIVE_NOISE = re.compile(
    rb"^(?:[IW]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] "  # absl INFO / WARNING lines
    rb"|E\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [^ \]]+:\d+\] (?:oneDNN supports DT_|.*cpu_feature_guard)"
    rb"|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+: [IW] "  # the pre-absl format of the same lines
    rb"|WARNING: All log messages before absl::InitializeLog\(\) is called"
    rb"|To enable the following instructions: |This TensorFlow binary is optimized to use available CPU"
    rb"|fully_quantize: \d+, inference_type: |Estimated count of arithmetic ops: "  # the LiteRT converter
    rb"|Summary on the non-converted ops:$|-{20,}$| \* Accepted dialects: | \* Non-Converted Ops: \d+, Total Ops "
    rb"| \* \d+ ARITH ops$|- arith\.constant: +\d+ occurrences|INFO: Created TensorFlow Lite XNNPACK delegate for CPU)")


def verbose_requested(argv: list[str]) -> tuple[bool, list[str]]:
    """``--verbose`` anywhere among the words (taken out) or ``PHALANX_VERBOSE=1``.

    >>> verbose_requested(["train", "--verbose", "train.steps=5"])[1]
    ['train', 'train.steps=5']
    """
    rest = [a for a in argv if a != "--verbose"]
    return len(rest) != len(argv) or os.environ.get("PHALANX_VERBOSE", "") not in ("", "0"), rest


def filter_native_stderr() -> None:
    """Drop :data:`NATIVE_NOISE` lines that native code (TensorFlow, the converter) writes to
    file descriptor 2, passing everything else through unchanged and in order.

    fd 2 becomes a pipe read by a small forked process that writes to the original stderr;
    Python's own ``sys.stderr`` writes there directly (so that a terminal is still seen as one:
    the progress bar). A separate process, not a thread: a native crash (an abort, a failed
    CHECK) still gets its last lines out, since the filter reads until every writer is gone.
    It ignores SIGINT and SIGTERM for that reason. Child processes inherit the filtered fd 2.
    Call it before any thread starts (it forks)."""
    try:
        read_end, write_end = os.pipe()
        original = os.dup(2)
    except OSError:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError:
        for fd in (read_end, write_end, original):
            os.close(fd)
        return
    if pid == 0:  # the filter
        try:
            import signal
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            os.close(write_end)
            _pump(read_end, original)
        finally:
            os._exit(0)
    os.close(read_end)
    os.dup2(write_end, 2)
    os.close(write_end)
    old = sys.stderr
    sys.stderr = io.TextIOWrapper(io.FileIO(original, "w", closefd=False), encoding=old.encoding,
                                  errors=old.errors or "backslashreplace", line_buffering=True)


def _pump(read_end: int, original: int) -> None:
    """Copy ``read_end`` to ``original`` until EOF, without the :data:`NATIVE_NOISE` lines."""
    import select
    held = b""
    while True:
        try:
            # C++ streams write a line in pieces: hold a partial line until its newline, or
            # until nothing more comes for 0.2 s (a prompt or a \r progress update)
            ready = select.select([read_end], [], [], 0.2 if held else None)[0]
            if not ready:
                if not NATIVE_NOISE.match(held):
                    _write_all(original, held)
                held = b""
                continue
            chunk = os.read(read_end, 65536)
        except InterruptedError:
            continue
        except (OSError, ValueError):
            break
        if not chunk:
            break
        lines = (held + chunk).split(b"\n")
        held = lines.pop()
        out = b"".join(line + b"\n" for line in lines if not NATIVE_NOISE.match(line))
        if out:
            _write_all(original, out)
    if held and not NATIVE_NOISE.match(held):
        _write_all(original, held)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except InterruptedError:
            continue
        except OSError:
            return


def usage() -> str:
    lines = ["usage: phalanx [--version] [--verbose] <command> [args...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, _, help_) in COMMANDS.items()]
    lines += ["", "Run `phalanx <command> --help` for a command's options. TensorFlow's own log lines are hidden",
              "unless --verbose (anywhere on the line) or PHALANX_VERBOSE=1."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    program = argv is None  # run as the `phalanx` program (not called from Python): fd 2 is ours
    argv = sys.argv[1:] if argv is None else argv
    verbose, argv = verbose_requested(argv)
    if argv[:1] == ["--version"]:
        print(f"phalanx {__version__}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    if verbose:
        os.environ["PHALANX_VERBOSE"] = "1"  # the processes `phalanx launch` starts are verbose too
    else:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # the lines TensorFlow filters itself
        if program and name != "launch":  # launch's tasks filter their own output
            filter_native_stderr()
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
