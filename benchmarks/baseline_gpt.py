"""A second phalanx, from another checkout, as a contender of ``bench_gpt.py``.

``python benchmarks/bench_gpt.py --baseline-src /path/to/old/checkout/src`` times that
checkout's one-device GPT step beside the current one and keras-hub in the same alternating
rounds, so "no slower than before" is a same-load ratio rather than two runs on a shared
machine. The other tree runs in its own process (two versions of the ``phalanx`` package
cannot share one), started with ``PYTHONPATH`` set to its ``src/`` and driven over a pipe:

* the worker builds the step the way THAT tree's ``benchmarks/bench_gpt.py`` did (its own
  ``PhalanxRunner``: the engine, task and config calls of that version), on the same token
  batch, policy, learning rate and shapes, then runs ``n`` steps per request and returns
  their wall and process CPU seconds;
* the parent kills the worker if its resident memory passes ``max_rss_gb`` (a step of an
  older engine can need much more memory than today's) and reports its peak.

Time to the first step counts the build and the first (tracing) step inside the worker, not
the interpreter and TensorFlow start-up, which the in-process contenders do not pay either.

Example (no benchmark is run: a path that is not a phalanx source tree is refused):
    >>> try:
    ...     check_src("/")
    ... except ValueError as exc:
    ...     print(str(exc).split(":")[0])
    --baseline-src
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

OPTION = "--baseline-src"
HERE = Path(__file__).resolve().parents[1] / "src"  # the checkout this script belongs to


def check_src(path) -> Path:
    """``path`` resolved if it is a phalanx ``src/`` directory whose checkout has its own
    ``benchmarks/bench_gpt.py`` (the worker builds the step with it); ValueError naming the
    option and what is missing otherwise."""
    src = Path(path).expanduser().resolve()
    if not (src / "phalanx" / "__init__.py").is_file():
        raise ValueError(f"{OPTION}: {path!r} is not a phalanx source tree (no phalanx/__init__.py in it); give "
                         f"the src/ directory of a phalanx checkout, e.g. after `git worktree add --detach "
                         f"/tmp/old <commit>`: {OPTION} /tmp/old/src")
    bench = src.parent / "benchmarks" / "bench_gpt.py"
    if not bench.is_file() or "class PhalanxRunner" not in bench.read_text():
        raise ValueError(f"{OPTION}: {path!r} is a phalanx source tree, but its checkout has no benchmarks/"
                         f"bench_gpt.py with a PhalanxRunner ({bench}), which builds that version's step")
    return src


def describe(src: Path) -> str:
    """The checkout's commit (``git describe``-like: short id, ``+dirty`` with local changes)."""
    def git(*args):
        return subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True).stdout.strip()

    commit = git("rev-parse", "--short", "HEAD") or "unknown commit"
    return commit + ("+dirty" if git("status", "--porcelain", "--", ".") else "")


def _rss(pid: int) -> tuple[float, float]:
    """(resident, peak resident) GB of ``pid`` from /proc (0 where it cannot be read)."""
    found = {}
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                key, _, value = line.partition(":")
                if key in ("VmRSS", "VmHWM"):
                    found[key] = int(value.split()[0]) / 2**20  # kB -> GB
    except OSError:
        pass
    return found.get("VmRSS", 0.0), found.get("VmHWM", 0.0)


class BaselineRunner:
    """A ``bench_gpt`` contender whose step is the ``src`` checkout's, run in a worker process."""

    def __init__(self, model_cfg: dict, batch: int, policy: str, lr: float, batch_data, *, src,
                 max_rss_gb: float = 10.0):
        import numpy as np

        self.src = check_src(src)
        self.commit = describe(self.src)
        self.max_rss_gb, self.peak_rss_gb, self.killed = max_rss_gb, 0.0, ""
        self.last_loss = float("nan")
        self._data = tempfile.NamedTemporaryFile(suffix=".npy", delete=False)
        np.save(self._data, np.asarray(batch_data))
        self._data.close()
        env = {**os.environ, "PYTHONPATH": str(self.src)}  # that tree's phalanx, not this one
        started = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, __file__, "--worker", str(self.src)], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self._watch = threading.Thread(target=self._watchdog, daemon=True)
        self._watch.start()
        reply = self._ask({"cmd": "build", "model_cfg": model_cfg, "batch": batch, "policy": policy, "lr": lr,
                           "data": self._data.name})
        # bench_gpt times construction + the first step; the start-up is not the step's to pay
        self.startup_seconds = time.perf_counter() - started - reply["build_s"]
        self.phalanx_file = reply["phalanx"]

    def _watchdog(self):
        while self.proc.poll() is None:
            rss, peak = _rss(self.proc.pid)
            self.peak_rss_gb = max(self.peak_rss_gb, peak, rss)
            if rss > self.max_rss_gb:
                self.killed = f"resident memory {rss:.1f} GB passed --baseline-max-rss-gb {self.max_rss_gb:g}"
                self.proc.kill()
                return
            time.sleep(0.25)

    def _ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait()
            raise RuntimeError(f"the baseline worker ({self.src}) stopped (exit {self.proc.returncode}"
                               f"{'; ' + self.killed if self.killed else ''}); its error is printed above")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"the baseline worker ({self.src}): {reply['error']}")
        return reply

    def run(self, steps: int):
        reply = self._ask({"cmd": "run", "steps": steps})
        self.last_loss = reply["loss"]
        return reply["times"], reply["cpu"]

    def close(self):
        """Stop the worker (its memory is freed before the next policy is built)."""
        if self.proc.poll() is None:
            try:
                self._ask({"cmd": "exit"})
            except (RuntimeError, OSError, ValueError):
                pass
            self.proc.wait(timeout=60)
        self._watch.join(timeout=5)
        os.unlink(self._data.name)


def table(results: dict, tokens: int, ratio, baseline_label: str) -> list[str]:
    """Markdown rows: every contender's tokens/s, its same-round speed over the current phalanx's
    (``ratio(a, b)``: bench_gpt's per-round ratios), and its time to the first step."""
    import statistics

    lines = ["", f"phalanx now against {baseline_label}, timed in the same alternating rounds (speed over the "
             f"current phalanx's: median of same-round ratios; time to the first step: build + the first, "
             f"tracing, step):", "",
             "| dtype | contender | tokens/s | vs current phalanx (wall) | (CPU time) | first step s | "
             "own process's peak RSS GB |",
             "|---|---|---|---|---|---|---|"]
    for policy, timings in results.items():
        ours = timings["phalanx"]
        for name, t in timings.items():
            if name not in ("phalanx", "baseline", "keras-hub"):
                continue
            label = {"baseline": baseline_label, "phalanx": f"phalanx {describe(HERE)} (this checkout)"}.get(name, name)
            lines.append(f"| {policy} | {label} | {tokens / t.median():.0f} | "
                         f"{statistics.median(ratio(t, ours)):.3f}x | "
                         f"{statistics.median(ratio(t, ours, cpu=True)):.3f}x | {t.first_step:.1f} | "
                         f"{'shared' if t.peak_rss_gb != t.peak_rss_gb else f'{t.peak_rss_gb:.2f}'} |")
    return lines


# ---------------------------------------------------------------------------
# The worker (run as ``python baseline_gpt.py --worker SRC`` with PYTHONPATH=SRC)


def _worker(src: str) -> int:
    import importlib.util

    # Replies go out on the original stdout; anything the tree prints goes to stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    parent = os.getppid()

    def orphaned():  # the parent killed mid-step: stop now rather than at the step's end (memory)
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(1)

    threading.Thread(target=orphaned, daemon=True).start()
    bench_dir = Path(src).parent / "benchmarks"
    # that tree's benchmarks/ (its bench_gpt may import its neighbours), not this one's
    sys.path[0] = str(bench_dir)
    runner = None
    for line in sys.stdin:
        request = json.loads(line)
        try:
            if request["cmd"] == "exit":
                out.write(json.dumps({"ok": True}) + "\n")
                return 0
            if request["cmd"] == "build":
                spec = importlib.util.spec_from_file_location("baseline_bench_gpt", bench_dir / "bench_gpt.py")
                module = importlib.util.module_from_spec(spec)
                sys.modules[spec.name] = module  # (its dataclasses look their module up there)
                spec.loader.exec_module(module)
                import numpy as np
                import phalanx

                if not Path(phalanx.__file__).resolve().is_relative_to(Path(src)):
                    raise RuntimeError(f"imported phalanx from {phalanx.__file__}, not from {src}")
                start = time.perf_counter()  # (the imports above: start-up, not build)
                runner = module.PhalanxRunner(request["model_cfg"], request["batch"], request["policy"],
                                              request["lr"], np.load(request["data"]))
                reply = {"build_s": time.perf_counter() - start, "phalanx": phalanx.__file__}
            elif request["cmd"] == "run":
                times, cpu = runner.run(request["steps"])
                reply = {"times": list(times), "cpu": list(cpu), "loss": float(runner.last_loss)}
            else:
                reply = {"error": f"unknown request {request['cmd']!r}"}
        except Exception as exc:  # noqa: BLE001 - reported to the parent, which raises it
            import traceback

            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    sys.exit(_worker(sys.argv[2]))
