"""``phalanx launch``: run a TensorFlow cluster of local processes on loopback.

::

    phalanx launch --workers 2 -- phalanx train parallel.strategy=multi_worker
    phalanx launch --workers 2 --ps 1 -- phalanx train parallel.strategy=parameter_server
    phalanx launch --workers 2 --restarts 3 -- phalanx train ...

Every task runs the same COMMAND with its own ``TF_CONFIG`` (free ports on
127.0.0.1). Topology (see :func:`phalanx.cluster.tf_config.local_tf_configs`):
without ``--ps`` the N workers are peers and ``worker:0`` is the chief; with
``--ps M`` a ``chief`` task is added, which runs the training loop as the
coordinator, while the N worker and M ps tasks serve it (``tf.distribute.Server``).

Behaviour:

* each output line is prefixed with its task (``[worker:1] ...``; stdout stays
  stdout, stderr stays stderr); the launcher's own status lines (``[launch] ...``)
  go to stderr;
* the run succeeds when every worker exits 0 (with ``--ps``: when the chief exits 0;
  the server tasks are then stopped);
* when a task exits non-zero (or dies), the others get SIGTERM, then SIGKILL after
  ``--grace`` seconds, and the launcher exits with that task's status (with ``--ps`` and
  ``--keep-going-without-workers``, a worker task that dies is only reported: the chief's
  ``ClusterCoordinator`` runs its steps on the other workers); with
  ``--restarts K`` the whole cluster is started again, up to K times (the training
  command resumes from its last checkpoint by itself);
* SIGINT/SIGTERM are forwarded to every task (a trainer saves a checkpoint and
  exits 0 on SIGTERM); a second signal kills them;
* every task runs in its own process group, which is killed at the end of every
  attempt, and dies with the launcher (PR_SET_PDEATHSIG): no process is left behind;
* network: ``--network auto`` (default) runs the tasks in a private network
  namespace when the OS allows it, so their unauthenticated gRPC servers are not
  reachable from other machines; otherwise it warns (see docs/clusters.md).

Environment of each task: ``TF_CONFIG``, ``PYTHONUNBUFFERED=1``,
``PHALANX_LAUNCH_TASK`` (e.g. ``worker:1``) and ``PHALANX_LAUNCH_ATTEMPT``
(0 for the first start, 1 after the first restart, ...).

Example:
    >>> main(["--workers", "2", "--network", "host", "--", "python", "-c", "print('hi')"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from phalanx.cluster.netns import PR_SET_PDEATHSIG, PrivateNetwork, _libc
from phalanx.cluster.tf_config import local_tf_configs

EXIT_TIMEOUT = 124
EXIT_USAGE = 2
POLL_S = 0.05


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="phalanx launch",
        description="Run COMMAND as a local TensorFlow cluster on 127.0.0.1, one process per task, "
                    "each with its own TF_CONFIG.",
        epilog="example: phalanx launch --workers 2 -- phalanx train parallel.strategy=multi_worker")
    p.add_argument("--workers", type=int, required=True, metavar="N", help="number of worker tasks (>= 1)")
    p.add_argument("--ps", type=int, default=0, metavar="M",
                   help="parameter-server tasks; adds a chief task that coordinates (default 0)")
    p.add_argument("--keep-going-without-workers", action="store_true",
                   help="with --ps: a worker task that dies does not stop the cluster (the chief's "
                        "ClusterCoordinator reschedules its steps on the other workers); the chief or a ps "
                        "task dying still does")
    p.add_argument("--restarts", type=int, default=0, metavar="K",
                   help="restart the whole cluster up to K times after a failure (default 0)")
    p.add_argument("--timeout", type=float, default=0.0, metavar="S",
                   help="stop everything and exit 124 after S seconds in total (default: no limit)")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL when stopping tasks (default 10)")
    p.add_argument("--network", choices=("auto", "private", "host"), default="auto",
                   help="private: tasks in a private network namespace (only loopback; required); "
                        "host: no namespace (servers reachable from the network); "
                        "auto: private when possible, else host with a warning (default)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...] run by every task")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``phalanx launch``; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    command = resolve_command(command)
    problems = [msg for bad, msg in (
        (args.workers < 1, f"--workers must be >= 1, got {args.workers}"),
        (args.ps < 0, f"--ps must be >= 0, got {args.ps}"),
        (args.restarts < 0, f"--restarts must be >= 0, got {args.restarts}"),
        (args.timeout < 0, f"--timeout must be >= 0 (0: no limit), got {args.timeout}"),
        (args.grace < 0, f"--grace must be >= 0, got {args.grace}"),
        (args.keep_going_without_workers and not args.ps,
         "--keep-going-without-workers needs --ps M (without parameter servers every worker holds a share of "
         "each step)"),
        (not command, "no COMMAND given; usage: phalanx launch --workers N -- COMMAND [ARGS...]"),
    ) if bad]
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return EXIT_USAGE
    launcher = Launcher(command=command, workers=args.workers, ps=args.ps, restarts=args.restarts,
                        timeout=args.timeout, grace=args.grace, network=args.network,
                        keep_going_without_workers=args.keep_going_without_workers)
    return launcher.run()


def resolve_command(command: list[str], bin_dir: str | None = None) -> list[str]:
    """``command`` with a bare ``phalanx`` replaced by the ``phalanx`` installed next to this
    Python (``bin_dir``, default ``sys.executable``'s directory), so that
    ``.venv/bin/phalanx launch -- phalanx train ...`` runs the same installation without an
    activated environment. Any other command, a path, or no such file: unchanged.

    >>> import os, tempfile
    >>> d = tempfile.mkdtemp(); open(os.path.join(d, "phalanx"), "w").close(); os.chmod(os.path.join(d, "phalanx"), 0o755)
    >>> resolve_command(["phalanx", "train"], d) == [os.path.join(d, "phalanx"), "train"]
    True
    >>> resolve_command(["python", "-c", "pass"], d)
    ['python', '-c', 'pass']
    """
    if not command or command[0] != "phalanx":
        return list(command)
    own = os.path.join(bin_dir or os.path.dirname(sys.executable), "phalanx")
    if os.path.isfile(own) and os.access(own, os.X_OK):
        return [own, *command[1:]]
    return list(command)


# ---------------------------------------------------------------------------


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct ports that are free on ``host`` right now (held open together
    while choosing, so they differ)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def status_text(code: int) -> str:
    return f"was killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with status {code}"


def exit_code(code: int) -> int:
    """A Popen return code as a shell-style exit status (signal N -> 128 + N)."""
    return 128 - code if code < 0 else code


@dataclass
class Task:
    name: str
    proc: subprocess.Popen
    server: bool  # a ps-mode worker/ps task: serves the chief and never finishes by itself
    lost: bool = False  # a ps-mode worker that died, tolerated (--keep-going-without-workers)
    partial: dict[int, bytes] = field(default_factory=dict)

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()


class Launcher:
    """Starts, watches, restarts and stops one local cluster. See the module docstring."""

    def __init__(self, command: list[str], workers: int, ps: int = 0, restarts: int = 0,
                 timeout: float = 0.0, grace: float = 10.0, network: str = "auto",
                 keep_going_without_workers: bool = False, out: Callable[[str], None] | None = None, err: Callable[[str], None] | None = None):
        self.command, self.workers, self.ps = command, workers, ps
        self.restarts, self.timeout, self.grace, self.network = restarts, timeout, grace, network
        self.keep_going_without_workers = keep_going_without_workers
        self._out = out or (lambda s: (sys.stdout.write(s), sys.stdout.flush()))
        self._err = err or (lambda s: (sys.stderr.write(s), sys.stderr.flush()))
        self._signal: int | None = None
        self._signal_count = 0
        self._libc = _libc()
        self._net: PrivateNetwork | None = None

    def status(self, message: str) -> None:
        self._err(f"[launch] {message}\n")

    # -- lifecycle -------------------------------------------------------------

    def run(self) -> int:
        deadline = time.monotonic() + self.timeout if self.timeout else None
        previous = self._install_signal_handlers()
        try:
            code = self._setup_network()
            if code:
                return code
            attempt = 0
            while True:
                code, retry = self._run_attempt(attempt, deadline)
                if code == 0 or not retry or attempt >= self.restarts or self._signal is not None:
                    if code and retry and self.restarts:
                        self.status(f"giving up after {attempt} restart{'s' if attempt != 1 else ''}")
                    return code
                attempt += 1
                self.status(f"restarting the cluster (restart {attempt} of {self.restarts})")
                time.sleep(0.5)
        finally:
            if self._net is not None:
                self._net.close()
            self._restore_signal_handlers(previous)

    def _setup_network(self) -> int:
        if self.network == "host":
            self.status("WARNING: --network host: TensorFlow's gRPC servers have no authentication and listen on "
                        "all interfaces; anyone who can reach this machine can reach the cluster")
            return 0
        try:
            self._net = PrivateNetwork.create()
        except OSError as err:
            if self.network == "private":
                print(f"error: --network private: cannot create a private network namespace: {err}", file=sys.stderr)
                return EXIT_USAGE
            self.status(f"WARNING: cannot create a private network namespace ({err}); the tasks' gRPC servers "
                        "have no authentication and listen on all interfaces: anyone who can reach this machine "
                        "can reach the cluster. Firewall it, or see docs/clusters.md")
            return 0
        self.status(f"network: {self._net.describe()}")
        return 0

    def _run_attempt(self, attempt: int, deadline: float | None) -> tuple[int, bool]:
        """Run the cluster once; returns (exit status, whether a restart may help)."""
        tasks: list[Task] = []
        sel = selectors.DefaultSelector()
        try:
            configs = local_tf_configs(self.workers, self.ps, free_ports(self.workers + self.ps + (1 if self.ps else 0)))
            for name, tf_config in configs:
                tasks.append(self._spawn(name, tf_config, attempt, sel))
            self.status(f"started {', '.join(f'{t.name} (pid {t.proc.pid})' for t in tasks)}: {shlex.join(self.command)}")
            return self._watch(tasks, sel, deadline)
        except FileNotFoundError as err:
            self.status(f"cannot start {self.command[0]!r}: {err.strerror}")
            return 127, False
        finally:
            self._stop(tasks, sel, signal.SIGTERM, self.grace)
            self._kill_groups(tasks)
            sel.close()

    def _spawn(self, name: str, tf_config: dict, attempt: int, sel: selectors.BaseSelector) -> Task:
        env = dict(os.environ, TF_CONFIG=json.dumps(tf_config), PYTHONUNBUFFERED="1",
                   PHALANX_LAUNCH_TASK=name, PHALANX_LAUNCH_ATTEMPT=str(attempt))
        proc = subprocess.Popen(self.command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True, preexec_fn=self._preexec())
        task = Task(name=name, proc=proc, server=bool(self.ps) and not name.startswith("chief"))
        for stream in (proc.stdout, proc.stderr):
            os.set_blocking(stream.fileno(), False)
            sel.register(stream, selectors.EVENT_READ, task)
        return task

    def _preexec(self) -> Callable[[], None]:
        libc, net = self._libc, self._net

        def preexec() -> None:
            if net is not None:
                net.join()
            # After setns (a credential change clears it): die with the launcher.
            libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        return preexec

    # -- watching --------------------------------------------------------------

    def _watch(self, tasks: list[Task], sel: selectors.BaseSelector, deadline: float | None) -> tuple[int, bool]:
        while True:
            self._pump(sel, POLL_S)
            if self._signal is not None:
                return self._on_signal(tasks, sel), False
            if deadline is not None and time.monotonic() > deadline:
                self.status(f"--timeout {self.timeout:g} s reached; stopping the cluster")
                return EXIT_TIMEOUT, False
            # Success first: once the chief is done, server tasks leave by themselves (they
            # watch the chief), and that must not be taken for a failure.
            finishing = [t for t in tasks if not t.server]
            if all(t.returncode == 0 for t in finishing):
                self.status(f"{'the chief' if self.ps else 'all workers'} finished with status 0")
                return 0, False
            for t in tasks:
                code = t.returncode
                if code is not None and not t.lost and self.keep_going_without_workers and t.server \
                        and t.name.startswith("worker"):
                    t.lost = True
                    self.status(f"{t.name} {status_text(code)}; going on without it (--keep-going-without-workers)")
                if code is not None and not t.lost and (code != 0 or t.server):
                    why = status_text(code) + (" (a server task must run until the chief is done)" if code == 0 else "")
                    self.status(f"{t.name} {why}; stopping the cluster")
                    return (exit_code(code) or 1), True

    def _on_signal(self, tasks: list[Task], sel: selectors.BaseSelector) -> int:
        signum = self._signal
        self.status(f"received {signal.Signals(signum).name}; forwarding it to the tasks")
        self._stop(tasks, sel, signum, self.grace)
        codes = [t.returncode for t in tasks]
        return 0 if all(c == 0 for c in codes) else 128 + signum

    def _pump(self, sel: selectors.BaseSelector, timeout: float) -> None:
        """Copy whatever the tasks printed, a whole line at a time, with the task prefix."""
        if not sel.get_map():
            time.sleep(timeout)
            return
        for key, _ in sel.select(timeout):
            task: Task = key.data
            fd = key.fileobj.fileno()
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            buf = task.partial.get(fd, b"") + chunk
            if not chunk:  # EOF: flush an unterminated last line
                sel.unregister(key.fileobj)
                key.fileobj.close()
                lines, rest = ([buf] if buf else []), b""
            else:
                *lines, rest = buf.split(b"\n")
            task.partial[fd] = rest
            if lines:
                write = self._out if key.fileobj is task.proc.stdout else self._err
                write("".join(f"[{task.name}] {line.decode(errors='replace')}\n" for line in lines))

    # -- stopping --------------------------------------------------------------

    def _stop(self, tasks: list[Task], sel: selectors.BaseSelector, signum: int, grace: float) -> None:
        """Send ``signum`` to every live task's process group; SIGKILL what is left after ``grace``."""
        alive = [t for t in tasks if t.returncode is None]
        if not alive:
            self._drain(sel)
            return
        for t in alive:
            self._signal_group(t, signum)
        end = time.monotonic() + grace
        first_signal_count = self._signal_count
        while any(t.returncode is None for t in alive) and time.monotonic() < end:
            if self._signal_count > first_signal_count and signum != signal.SIGKILL:
                self.status("second signal: killing the tasks")
                break
            self._pump(sel, POLL_S)
        left = [t for t in alive if t.returncode is None]
        if left:
            self.status(f"killing {', '.join(t.name for t in left)} (still running {grace:g} s after "
                        f"{signal.Signals(signum).name})")
            for t in left:
                self._signal_group(t, signal.SIGKILL)
        for t in alive:
            t.proc.wait()
        self._drain(sel)

    def _drain(self, sel: selectors.BaseSelector, limit: float = 2.0) -> None:
        end = time.monotonic() + limit
        while sel.get_map() and time.monotonic() < end:
            self._pump(sel, POLL_S)

    @staticmethod
    def _signal_group(task: Task, signum: int) -> None:
        try:
            os.killpg(task.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def _kill_groups(self, tasks: list[Task]) -> None:
        """Kill anything a task left in its process group (e.g. its own children)."""
        for t in tasks:
            self._signal_group(t, signal.SIGKILL)
            if t.proc.poll() is None:
                t.proc.wait()

    # -- signals ---------------------------------------------------------------

    def _install_signal_handlers(self) -> dict[int, object]:
        if threading.current_thread() is not threading.main_thread():
            return {}  # signal handlers can only be set from the main thread

        def handler(signum, frame):
            self._signal = signum
            self._signal_count += 1
        return {s: signal.signal(s, handler) for s in (signal.SIGINT, signal.SIGTERM)}

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, object]) -> None:
        for s, h in previous.items():
            signal.signal(s, h)


if __name__ == "__main__":
    sys.exit(main())
