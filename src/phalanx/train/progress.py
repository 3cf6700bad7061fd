"""Run output: progress bar or plain lines, ``metrics.jsonl``, TensorBoard, loss PNG.

On a terminal a rich progress bar shows loss, tokens/s, MFU and the ETA; otherwise
(CI, a pipe, a launcher prefixing lines) one plain line per logged step. Every
logged step is appended to ``<run.dir>/metrics.jsonl`` as one JSON object and
written to TensorBoard event files under ``<run.dir>/tb``. A resumed run first drops
the rows past the step it resumes from (written after that checkpoint by the run
that died), so the file holds exactly one row per logged step.

Example:
    >>> import tempfile, json, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> with RunOutput(d, total_steps=2, interactive=False, quiet=True) as out:
    ...     out.log({"step": 1, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 10.0, "mfu": 0.1, "step_time_s": 0.5})
    >>> json.loads((d / "metrics.jsonl").read_text())["loss"]
    2.5
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from phalanx.train.metrics import mfu_text


class RunOutput:
    """Writes one run's logs. Use as a context manager; ``log`` once per logged step."""

    def __init__(self, run_dir: str | Path, total_steps: int, start_step: int = 0,
                 interactive: bool | None = None, quiet: bool = False, tensorboard: bool = True,
                 prefix: str = "", write: bool = True):
        # write=False: a non-chief worker of a multi-process run, which shows and writes nothing
        self.run_dir = Path(run_dir)
        self.write = write
        self.total, self.start = total_steps, start_step
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.quiet, self.prefix = quiet, prefix
        self._tb_enabled = tensorboard
        self._metrics = None
        self._tb = None
        self._progress = None
        self._task = None
        self._t0 = time.monotonic()
        self._t0_step = start_step  # the ETA counts from here (after the building step, see built())

    def __enter__(self) -> "RunOutput":
        if not self.write:
            self.quiet = True
            return self
        self.run_dir.mkdir(parents=True, exist_ok=True)
        drop_rows_after(self.run_dir, self.start)
        self._metrics = open(self.run_dir / "metrics.jsonl", "a")
        if self._tb_enabled:
            import tensorflow as tf
            self._tb = tf.summary.create_file_writer(str(self.run_dir / "tb"))
        if self.interactive and not self.quiet:
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
            self._progress = Progress(TextColumn("[bold]train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                      TextColumn("{task.fields[info]}"), TimeRemainingColumn())
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, completed=self.start,
                                                 info="building the step")
        return self

    def built(self, step: int, seconds: float) -> None:
        """The first step (``step``) of this process ran, tracing and compiling the step in
        ``seconds``: say so, and count the ETA and the bar's speed from here on."""
        self.message(f"building the step ({seconds:.0f} s)")
        self._t0, self._t0_step = time.monotonic(), step
        if self._progress is not None:  # rich's speed estimate would otherwise include the build
            self._progress.reset(self._task, completed=step, total=self.total, info="")

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        if self._tb is not None:
            self._tb.flush()
            self._tb.close()
            self._tb = None

    def log(self, row: dict) -> None:
        """Record one logged step (keys: step, loss, lr, tokens_per_s, mfu, step_time_s, ...)."""
        if not self.write:
            return
        row = {k: (float(v) if hasattr(v, "__float__") and not isinstance(v, (int, bool)) else v)
               for k, v in row.items()}
        self._metrics.write(json.dumps(row) + "\n")
        self._metrics.flush()
        if self._tb is not None:
            with self._tb.as_default():
                import tensorflow as tf
                for k, v in row.items():
                    if k != "step" and isinstance(v, (int, float)):
                        tf.summary.scalar(k, v, step=int(row["step"]))
        self._show(row)

    def message(self, text: str) -> None:
        if self.quiet:
            return
        if self._progress is not None:
            self._progress.console.print(text)
        else:
            print(f"{self.prefix}{text}", file=sys.stderr, flush=True)

    def _show(self, row: dict) -> None:
        if self.quiet:
            return
        parts = [f"loss {row['loss']:.4f}"]
        if "eval_loss" in row:
            parts.append(f"eval {row['eval_loss']:.4f}")
        if "build_s" in row:  # a window of only the building step: its rate is not the throughput
            parts.append(f"(building the step {row['build_s']:.0f} s)")
        else:
            parts += [f"{row.get('tokens_per_s', 0):,.0f} tok/s", mfu_text(row.get('mfu', 0))]
        info = "  ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=row["step"], info=info)
        else:
            done = row["step"] - self._t0_step
            elapsed = time.monotonic() - self._t0
            eta = f"ETA {_hms(elapsed / done * (self.total - row['step']))}" if done > 0 else "ETA -"
            print(f"{self.prefix}step {row['step']}/{self.total}  {info}  lr {row.get('lr', 0):.2e}  "
                  f"{eta}", file=sys.stderr, flush=True)


def _hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600:d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def read_metrics(run_dir: str | Path) -> list[dict]:
    """The rows of ``<run_dir>/metrics.jsonl`` (a line cut short by a kill is skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [row for row in map(_parse_row, path.read_text(errors="replace").splitlines()) if row is not None]


def drop_rows_after(run_dir: str | Path, step: int) -> int:
    """Rewrite ``<run_dir>/metrics.jsonl`` without the rows past ``step`` (and any line
    cut short by a kill); returns how many lines were dropped.

    A run killed after its last checkpoint logged steps it will repeat on resume;
    keeping those rows would give a step two rows and the loss plot a zig-zag. The
    file is replaced atomically (temporary file + rename), so a kill here loses nothing.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = path.read_text(errors="replace").splitlines()
    kept = [line for line in lines if (row := _parse_row(line)) is not None and row.get("step", 0) <= step]
    if len(kept) == len(lines):
        return 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(line + "\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return len(lines) - len(kept)


def _parse_row(line: str) -> dict | None:
    if not line.strip():
        return None
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def plot_loss(run_dir: str | Path) -> Path | None:
    """Write ``<run.dir>/loss.png`` (train and eval loss against step) from metrics.jsonl."""
    rows = read_metrics(run_dir)
    if not rows:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train loss")
    evals = [r for r in rows if "eval_loss" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o-", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(run_dir) / "loss.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
