"""`phalanx launch`: prefixing, failure handling, restarts, signals, no leftover processes,
network isolation. The launcher runs as a subprocess (as users run it), bounded in time."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from phalanx.cluster.launch import free_ports, main
from phalanx.cluster.netns import PrivateNetwork

LAUNCH = [sys.executable, "-m", "phalanx.cluster.launch"]
PY = sys.executable


def launch(*args, timeout=60):
    return subprocess.run([*LAUNCH, *args], capture_output=True, text=True, timeout=timeout)


def started(stderr):
    """task name -> pid from the launcher's 'started ...' lines (all attempts)."""
    return [dict((m[0], int(m[1])) for m in re.findall(r"(\w+:\d+) \(pid (\d+)\)", line))
            for line in stderr.splitlines() if "] started " in line]


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped running
    except FileNotFoundError:
        return False


def assert_gone(pids, bound=10.0):
    end = time.monotonic() + bound
    while any(running(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in pids if running(p)], "processes left behind"


def private_network_available():
    try:
        PrivateNetwork.create().close()
        return True
    except OSError:
        return False


def by_task(code):
    """A python -c program; `code` may use TASK (e.g. 'worker:1'), ATTEMPT and os/sys/time."""
    return [PY, "-c", "import os, sys, time, json\nTASK = os.environ['PHALANX_LAUNCH_TASK']\n"
                      "ATTEMPT = int(os.environ['PHALANX_LAUNCH_ATTEMPT'])\n" + code]


def test_output_prefixed_and_tf_config_per_task():
    code = ("cfg = json.loads(os.environ['TF_CONFIG'])\n"
            "print('task', cfg['task']['type'], cfg['task']['index'], json.dumps(cfg['cluster']))\n"
            "print('to stderr', file=sys.stderr)\n"
            "print('no newline', end='')\n")
    out = launch("--workers", "2", "--", *by_task(code))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    clusters = set()
    for i in (0, 1):
        [line] = [ln for ln in lines if ln.startswith(f"[worker:{i}] task ")]
        assert line.startswith(f"[worker:{i}] task worker {i} ")
        clusters.add(line.split(" ", 4)[4])
        assert f"[worker:{i}] no newline" in lines
        assert f"[worker:{i}] to stderr" in out.stderr.splitlines()
    assert len(clusters) == 1  # every task sees the same cluster
    ports = [a.rsplit(":", 1)[1] for a in json.loads(clusters.pop())["worker"]]
    assert len(set(ports)) == 2
    assert "[launch] all workers finished with status 0" in out.stderr
    assert_gone(started(out.stderr)[0].values())


def test_crashing_worker_stops_the_others():
    # worker:1 crashes at once; worker:0 would sleep for 5 minutes. The subprocess
    # timeout bounds the whole launch at 30 s.
    code = "if TASK == 'worker:1': sys.exit(3)\ntime.sleep(300)\n"
    out = launch("--workers", "2", "--grace", "2", "--", *by_task(code), timeout=30)
    assert out.returncode == 3
    assert "[launch] worker:1 exited with status 3; stopping the cluster" in out.stderr
    assert_gone(started(out.stderr)[0].values())


def test_task_killed_by_signal_is_a_failure():
    code = "if TASK == 'worker:0': os.kill(os.getpid(), 9)\ntime.sleep(300)\n"
    out = launch("--workers", "2", "--grace", "1", "--", *by_task(code), timeout=30)
    assert out.returncode == 128 + 9
    assert "worker:0 was killed by signal 9 (SIGKILL)" in out.stderr


def test_restarts_rerun_the_cluster(tmp_path):
    marker = tmp_path / "failed-once"
    code = (f"print('attempt', ATTEMPT)\n"
            f"if TASK == 'worker:1' and not os.path.exists({str(marker)!r}):\n"
            f"    open({str(marker)!r}, 'w').close(); sys.exit(7)\n")
    out = launch("--workers", "2", "--restarts", "2", "--", *by_task(code))
    assert out.returncode == 0, out.stderr
    assert "[launch] restarting the cluster (restart 1 of 2)" in out.stderr
    assert "[worker:0] attempt 1" in out.stdout and "[worker:1] attempt 1" in out.stdout
    attempts = started(out.stderr)
    assert len(attempts) == 2
    assert_gone([pid for a in attempts for pid in a.values()])


def test_restarts_give_up():
    out = launch("--workers", "1", "--restarts", "1", "--", *by_task("sys.exit(4)"))
    assert out.returncode == 4
    assert len(started(out.stderr)) == 2
    assert "giving up after 1 restart" in out.stderr


def test_parameter_server_topology_ends_with_the_chief():
    code = ("if TASK == 'chief:0': time.sleep(0.5); print('chief done'); sys.exit(0)\n"
            "print('serving'); time.sleep(300)\n")
    out = launch("--workers", "2", "--ps", "1", "--grace", "2", "--", *by_task(code))
    assert out.returncode == 0, out.stderr
    [tasks] = started(out.stderr)
    assert sorted(tasks) == ["chief:0", "ps:0", "worker:0", "worker:1"]
    assert "[chief:0] chief done" in out.stdout
    assert "the chief finished with status 0" in out.stderr
    assert_gone(tasks.values())


def test_server_task_exiting_early_is_a_failure():
    code = "if TASK == 'ps:0': sys.exit(0)\ntime.sleep(300)\n"
    out = launch("--workers", "1", "--ps", "1", "--grace", "1", "--", *by_task(code), timeout=30)
    assert out.returncode != 0
    assert "ps:0 exited with status 0 (a server task must run until the chief is done)" in out.stderr


def test_a_dead_worker_is_tolerated_with_keep_going_without_workers():
    # worker:1 dies at once; the chief finishes later: the run succeeds. A ps task dying still stops it.
    code = ("if TASK == 'worker:1': os.kill(os.getpid(), 9)\n"
            "if TASK == 'chief:0': time.sleep(1.5); print('chief done'); sys.exit(0)\n"
            "time.sleep(300)\n")
    out = launch("--workers", "2", "--ps", "1", "--grace", "1", "--keep-going-without-workers", "--",
                 *by_task(code), timeout=30)
    assert out.returncode == 0, out.stderr
    assert "worker:1 was killed by signal 9 (SIGKILL); going on without it" in out.stderr
    assert "[chief:0] chief done" in out.stdout
    [tasks] = started(out.stderr)
    assert_gone(tasks.values())
    code = "if TASK == 'ps:0': sys.exit(3)\ntime.sleep(300)\n"
    out = launch("--workers", "1", "--ps", "1", "--grace", "1", "--keep-going-without-workers", "--",
                 *by_task(code), timeout=30)
    assert out.returncode == 3 and "ps:0 exited with status 3; stopping the cluster" in out.stderr


def test_grandchildren_are_killed_too():
    # Each task starts a long sleep in the background and exits 0 at once.
    code = ("import subprocess\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
            "print('grandchild', p.pid)\n")
    out = launch("--workers", "2", "--", *by_task(code))
    assert out.returncode == 0, out.stderr
    grandchildren = [int(x) for x in re.findall(r"grandchild (\d+)", out.stdout)]
    assert len(grandchildren) == 2
    assert_gone(grandchildren)


def spawn_launcher(*args):
    return subprocess.Popen([*LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for_lines(stream, count, needle, bound=30.0):
    """Read lines until `count` contain `needle` (the pipe read blocks; the test's pytest
    timeout and the launcher's --timeout bound it)."""
    seen = []
    while len([s for s in seen if needle in s]) < count:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
    return seen


def test_sigterm_is_forwarded_and_tasks_may_exit_cleanly():
    code = ("import signal\n"
            "signal.signal(signal.SIGTERM, lambda *a: (print('saving checkpoint'), sys.exit(0)))\n"
            "print('ready', flush=True)\ntime.sleep(300)\n")
    proc = spawn_launcher("--workers", "2", "--timeout", "60", "--", *by_task(code))
    try:
        wait_for_lines(proc.stdout, 2, "ready")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert out.count("saving checkpoint") == 2
    assert "received SIGTERM; forwarding it to the tasks" in err
    assert_gone(started(err)[0].values())


def test_sigint_then_sigkill_after_grace():
    code = ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "print('ready', flush=True)\ntime.sleep(300)\n")
    proc = spawn_launcher("--workers", "2", "--grace", "1", "--timeout", "60", "--", *by_task(code))
    try:
        wait_for_lines(proc.stdout, 2, "ready")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT
    assert "still running 1 s after SIGINT" in err
    assert_gone(started(err)[0].values())


def test_killed_launcher_takes_its_tasks_along():
    proc = spawn_launcher("--workers", "2", "--", *by_task("print('ready', flush=True)\ntime.sleep(300)\n"))
    try:
        wait_for_lines(proc.stdout, 2, "ready")
        proc.kill()  # SIGKILL: no cleanup code runs in the launcher
        proc.wait(timeout=10)
        err = proc.stderr.read()
    finally:
        proc.kill()
    tasks = started(err)[0]
    assert len(tasks) == 2
    assert_gone(tasks.values())


def test_timeout():
    out = launch("--workers", "1", "--timeout", "1", "--grace", "1", "--", *by_task("time.sleep(300)"), timeout=30)
    assert out.returncode == 124
    assert "--timeout 1 s reached" in out.stderr


@pytest.mark.parametrize("args, message", [
    (["--workers", "0", "--", "true"], "--workers must be >= 1"),
    (["--workers", "1", "--ps", "-1", "--", "true"], "--ps must be >= 0"),
    (["--workers", "1", "--restarts", "-2", "--", "true"], "--restarts must be >= 0"),
    (["--workers", "1"], "no COMMAND given"),
    (["--workers", "2", "--keep-going-without-workers", "--", "true"], "--keep-going-without-workers needs --ps"),
])
def test_usage_errors(args, message, capsys):
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_missing_command():
    out = launch("--workers", "1", "--", "/nonexistent/phalanx-no-such-binary")
    assert out.returncode == 127
    assert "cannot start '/nonexistent/phalanx-no-such-binary'" in out.stderr


def test_free_ports_are_distinct():
    ports = free_ports(8)
    assert len(set(ports)) == 8 and all(0 < p < 65536 for p in ports)


@pytest.mark.skipif(not private_network_available(), reason="this OS forbids network namespaces")
def test_private_network_hides_the_tasks():
    # Each task listens on EVERY interface (as tf.distribute.Server does) on the port its
    # TF_CONFIG names; from this process's network the ports must not be reachable.
    code = ("import socket\n"
            "port = int(json.loads(os.environ['TF_CONFIG'])['cluster']['worker'][int(TASK[-1])].rsplit(':', 1)[1])\n"
            "s = socket.socket(socket.AF_INET6); s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)\n"
            "s.bind(('::', port)); s.listen(4)\n"
            "peer = json.loads(os.environ['TF_CONFIG'])['cluster']['worker'][1 - int(TASK[-1])]\n"
            "time.sleep(0.5)\n"
            "h, p = peer.rsplit(':', 1)\n"
            "socket.create_connection((h, int(p)), timeout=5).close()\n"  # the peers reach each other
            "print('interfaces', [n for _, n in socket.if_nameindex()], 'port', port, flush=True)\n"
            "time.sleep(300)\n")
    proc = spawn_launcher("--workers", "2", "--network", "private", "--timeout", "60", "--", *by_task(code))
    try:
        lines = wait_for_lines(proc.stdout, 2, "interfaces")
        ports = [int(ln.rsplit(" ", 1)[1]) for ln in lines if "interfaces" in ln]
        assert len(ports) == 2, lines
        assert all("interfaces ['lo'] port" in ln for ln in lines if "interfaces" in ln)
        for port in ports:
            with pytest.raises(OSError):  # refused: nothing listens there in our namespace
                socket.create_connection(("127.0.0.1", port), timeout=2).close()
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "network: private network namespace" in err
    assert_gone(started(err)[0].values())


def test_host_network_warns():
    out = launch("--workers", "1", "--network", "host", "--", PY, "-c", "pass")
    assert out.returncode == 0
    assert "WARNING: --network host" in out.stderr and "no authentication" in out.stderr
