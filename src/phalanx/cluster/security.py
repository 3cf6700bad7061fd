"""What a TensorFlow cluster exposes: which addresses its gRPC servers really listen on.

TensorFlow's gRPC servers have no authentication: whoever can connect to a task can
run operations in it. The cluster spec names a host (``127.0.0.1:port`` for
``phalanx launch``), but the server binds its port on every interface anyway
(tensorflow/tensorflow#11689; measured again with TF 2.21, see docs/clusters.md).
These helpers measure it instead of trusting the spec.

Example:
    >>> import socket
    >>> s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
    >>> listening_addresses(s.getsockname()[1])
    ['127.0.0.1']
    >>> s.close()
"""

from __future__ import annotations

import ipaddress
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

_TCP_LISTEN = "0A"

# Start one tf.distribute.Server whose cluster spec names `host`, then report what
# the kernel says it listens on (read from this process's own network namespace).
_PROBE = r"""
import json, socket, sys
from phalanx.cluster.security import listening_addresses
host = sys.argv[1]
s = socket.socket(); s.bind((host, 0)); port = s.getsockname()[1]; s.close()
import tensorflow as tf
spec = tf.train.ClusterSpec({"worker": [f"{host}:{port}"]})
server = tf.distribute.Server(spec, job_name="worker", task_index=0, protocol="grpc", start=True)
print(json.dumps({"port": port, "addresses": listening_addresses(port)}), flush=True)
"""


def listening_addresses(port: int, proc_net: str | Path = "/proc/net") -> list[str]:
    """Local addresses with a TCP socket listening on ``port`` (``"::"`` and ``"0.0.0.0"``
    mean every interface), read from ``/proc/net/tcp`` and ``tcp6`` of the caller's
    network namespace."""
    found = []
    for name, width in (("tcp", 8), ("tcp6", 32)):
        path = Path(proc_net) / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            local, state = fields[1], fields[3]
            hex_addr, _, hex_port = local.partition(":")
            if state != _TCP_LISTEN or int(hex_port, 16) != port or len(hex_addr) != width:
                continue
            found.append(_decode_address(hex_addr))
    return found


def _decode_address(hex_addr: str) -> str:
    """/proc/net/tcp* print addresses as 32-bit words in host (little-endian) order."""
    raw = b"".join(bytes.fromhex(hex_addr[i:i + 8])[::-1] for i in range(0, len(hex_addr), 8))
    addr = ipaddress.ip_address(raw)
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped:
        return str(addr.ipv4_mapped)
    return str(addr)


def exposes_all_interfaces(addresses: list[str]) -> bool:
    """True if any of ``addresses`` is a wildcard (every interface)."""
    return any(ipaddress.ip_address(a).is_unspecified for a in addresses)


@dataclass(frozen=True)
class ServerProbe:
    port: int
    addresses: list[str]

    @property
    def all_interfaces(self) -> bool:
        return exposes_all_interfaces(self.addresses)


def probe_tf_server(host: str = "127.0.0.1", timeout: float = 120.0,
                    preexec_fn: Callable[[], None] | None = None) -> ServerProbe:
    """Start a ``tf.distribute.Server`` for ``host:<free port>`` in a subprocess and return
    what it really listens on. ``preexec_fn`` may move the subprocess elsewhere first
    (e.g. :meth:`phalanx.cluster.netns.PrivateNetwork.join`)."""
    out = subprocess.run([sys.executable, "-c", _PROBE, host], capture_output=True, text=True,
                         timeout=timeout, preexec_fn=preexec_fn)
    if out.returncode != 0:
        raise RuntimeError(f"the server probe failed with status {out.returncode}: {out.stderr[-2000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return ServerProbe(port=result["port"], addresses=result["addresses"])
