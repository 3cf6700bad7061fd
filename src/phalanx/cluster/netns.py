"""A private network namespace for the processes of a local cluster.

Why: TensorFlow's gRPC servers have no authentication, and ``tf.distribute.Server``
listens on every interface (``[::]:port``, measured with TF 2.21; see
docs/clusters.md) even when the cluster spec names 127.0.0.1. Anyone who can
reach the machine could then run graphs in the training processes. A fresh Linux
network namespace holds only its own loopback interface, so servers inside it are
unreachable from outside, whatever address they bind.

How: a small *holder* process unshares a new network namespace (directly as root,
or inside a new user namespace as an unprivileged user), brings ``lo`` up and
waits; every launched task joins the holder's namespace with ``setns`` before it
executes, so the tasks reach each other on 127.0.0.1 and nothing else. The holder
exits when its stdin closes, i.e. when the launcher goes away, however it goes.

Example (Linux, where namespaces are allowed)::

    net = PrivateNetwork.create()          # raises OSError when not possible
    subprocess.run(["ip", "addr"], preexec_fn=net.join)   # shows only lo
    net.close()
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
from dataclasses import dataclass, field

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_PDEATHSIG = 1

# The holder: bring lo up (ioctl SIOCGIFFLAGS / SIOCSIFFLAGS, so no `ip` binary is
# needed), prove loopback works, report, then block until the launcher closes stdin.
_HOLDER = r"""
import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
ifr = struct.pack("16sh22x", b"lo", 0)
flags = struct.unpack("16sh22x", fcntl.ioctl(s, 0x8913, ifr))[1]
fcntl.ioctl(s, 0x8914, struct.pack("16sh22x", b"lo", flags | 1))
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(1)
socket.create_connection(srv.getsockname(), timeout=5).close()
srv.close()
sys.stdout.write("ready\n"); sys.stdout.flush()
sys.stdin.read()
"""


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


@dataclass
class PrivateNetwork:
    """A network namespace with only ``lo``; tasks join it through :meth:`join`."""

    holder: subprocess.Popen
    user_namespace: bool
    _fds: list[int] = field(default_factory=list)
    _libc: ctypes.CDLL = field(default_factory=_libc)

    @classmethod
    def create(cls, timeout: float = 10.0) -> "PrivateNetwork":
        """Start the holder in a new namespace; OSError says why when the OS forbids it."""
        if not sys.platform.startswith("linux"):
            raise OSError("network namespaces exist only on Linux")
        libc = _libc()
        errors = []
        # As root a plain network namespace suffices; otherwise (or when a container
        # denies it) a user namespace grants the capability inside it.
        modes = [False, True] if os.geteuid() == 0 else [True]
        for user_ns in modes:
            try:
                return cls._start(libc, user_ns, timeout)
            except (OSError, subprocess.SubprocessError) as err:
                errors.append(f"{'user+net' if user_ns else 'net'} namespace: {err}")
        raise OSError("; ".join(errors))

    @classmethod
    def _start(cls, libc: ctypes.CDLL, user_ns: bool, timeout: float) -> "PrivateNetwork":
        uid, gid = os.getuid(), os.getgid()  # read before unshare: afterwards they read as nobody

        def enter() -> None:
            _check(libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0), "prctl")
            if user_ns:
                _check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNET), "unshare(user+net)")
                for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                    with open(f"/proc/self/{name}", "w") as f:
                        f.write(text)
            else:
                _check(libc.unshare(CLONE_NEWNET), "unshare(net)")

        holder = subprocess.Popen([sys.executable, "-I", "-c", _HOLDER], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=enter)
        net = cls(holder=holder, user_namespace=user_ns, _libc=libc)
        try:
            line = net._read_ready(timeout)
            if line != b"ready\n":
                raise OSError(f"the namespace holder did not start: {holder.stderr.read().decode(errors='replace')[-500:]}"
                              if holder.poll() is not None else "the namespace holder did not answer")
            kinds = (["user"] if user_ns else []) + ["net"]
            net._fds = [os.open(f"/proc/{holder.pid}/ns/{kind}", os.O_RDONLY) for kind in kinds]
        except BaseException:
            net.close()
            raise
        return net

    def _read_ready(self, timeout: float) -> bytes:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.holder.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                return b""
        return self.holder.stdout.readline()

    def join(self) -> None:
        """Move the calling (freshly forked, single-threaded) process into the namespace.

        Meant as ``preexec_fn``: user namespace first (it grants the right to join the
        network namespace it owns), then the network namespace.
        """
        for fd, kind in zip(self._fds, (["user"] if self.user_namespace else []) + ["net"]):
            _check(self._libc.setns(fd, CLONE_NEWUSER if kind == "user" else CLONE_NEWNET), f"setns({kind})")

    def describe(self) -> str:
        via = "a user namespace (unprivileged)" if self.user_namespace else "root"
        return f"private network namespace (only lo; created via {via}; holder pid {self.holder.pid})"

    def close(self) -> None:
        """Stop the holder; the namespace disappears when its last process exits."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        if self.holder.poll() is None:
            try:
                self.holder.stdin.close()
                self.holder.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.holder.kill()
                self.holder.wait()
        for stream in (self.holder.stdin, self.holder.stdout, self.holder.stderr):
            if stream and not stream.closed:
                stream.close()
