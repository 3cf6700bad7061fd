"""What a local cluster exposes: the addresses its servers really listen on."""

import socket

import pytest

from phalanx.cluster.netns import PrivateNetwork
from phalanx.cluster.security import exposes_all_interfaces, listening_addresses, probe_tf_server


def test_listening_addresses_reads_the_kernel_tables():
    loop = socket.socket()
    loop.bind(("127.0.0.1", 0))
    port = loop.getsockname()[1]
    assert listening_addresses(port) == []  # bound, not listening yet
    loop.listen(1)
    assert listening_addresses(port) == ["127.0.0.1"]
    loop.close()
    assert listening_addresses(port) == []
    if socket.has_ipv6:
        wild = socket.socket(socket.AF_INET6)
        wild.bind(("::", 0))
        wild.listen(1)
        found = listening_addresses(wild.getsockname()[1])
        wild.close()
        assert found == ["::"] and exposes_all_interfaces(found)
    assert not exposes_all_interfaces(["127.0.0.1", "::1"])
    assert exposes_all_interfaces(["0.0.0.0"])


@pytest.mark.slow
def test_tf_server_listens_everywhere_but_the_namespace_hides_it():
    # The measured fact behind the launcher's private network: the cluster spec says
    # 127.0.0.1, yet the server binds its port on every interface. One TF process
    # (they are slow to start): inside a private namespace when possible.
    try:
        net = PrivateNetwork.create()
    except OSError:
        net = None
    try:
        probe = probe_tf_server("127.0.0.1", timeout=120, preexec_fn=net.join if net else None)
    finally:
        if net:
            net.close()
    assert probe.addresses, "the server does not listen at all"
    assert probe.all_interfaces, f"TF now binds only {probe.addresses}: update docs/clusters.md"
    if net is None:
        pytest.skip("no network namespace here: the server above is reachable from the network")
    assert listening_addresses(probe.port) == []  # invisible from the host's network
