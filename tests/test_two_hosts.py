"""scripts/two_hosts.py: two network namespaces joined by a rate-shaped veth pair (needs root;
skipped where namespaces cannot be made)."""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import two_hosts  # noqa: E402
from two_hosts import TwoHosts, enter_namespace, in_namespace, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=str(unavailable_reason()))

PAYLOAD = 5_000_000


def netns_list() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture
def hosts():
    with TwoHosts("10gbit") as h:
        yield h
    assert "braid-h" not in netns_list()


def connect(hosts: TwoHosts, port: int, timeout: float = 2.0):
    """A listener in h1 and a connection to it from h0: (client in h0, its peer in h1)."""
    with in_namespace(1):
        server = socket.create_server((hosts.address(1), port))
    with server:
        with in_namespace(0):
            client = socket.create_connection((hosts.address(1), port), timeout=timeout)
        peer, _ = server.accept()
    peer.settimeout(timeout)
    return client, peer


def transfer_seconds(hosts: TwoHosts, port: int, size: int = PAYLOAD) -> float:
    """Seconds to send `size` bytes from h0 to h1 until h1 has them all."""
    client, peer = connect(hosts, port, timeout=10)
    received = [0]

    def drain():
        buffer = bytearray(1 << 20)
        while received[0] < size:
            n = peer.recv_into(buffer)
            if not n:
                break
            received[0] += n

    with client, peer:
        reader = threading.Thread(target=drain)
        start = time.monotonic()
        reader.start()
        client.sendall(bytes(size))
        reader.join(timeout=15)
        elapsed = time.monotonic() - start
    assert received[0] == size
    return elapsed


def test_link_carries_traffic_both_ways(hosts):
    client, peer = connect(hosts, 7001)
    with client, peer:
        client.sendall(b"ping")
        assert peer.recv(4) == b"ping"
        peer.sendall(b"pong")
        assert client.recv(4) == b"pong"
        assert client.getsockname()[0] == hosts.address(0)
        assert peer.getsockname()[0] == hosts.address(1)


def test_shaping_follows_the_rate(hosts):
    fast = transfer_seconds(hosts, 7002)
    hosts.set_rate("100mbit")
    try:
        slow = transfer_seconds(hosts, 7003)  # 5 MB at 100 Mbit/s: ~0.42 s
    finally:
        hosts.set_rate("10gbit")
    assert slow >= 0.35, (slow, fast)
    assert fast < slow / 3, (slow, fast)
    assert hosts.dropped(0) == 0


def test_link_down_stops_traffic_and_up_restores_it(hosts):
    client, peer = connect(hosts, 7004)
    with client, peer:
        hosts.link_down()
        try:
            client.sendall(b"lost?")
            with pytest.raises(TimeoutError):
                peer.settimeout(0.5)
                peer.recv(5)
            with in_namespace(0), socket.socket() as other, pytest.raises(OSError) as failed:
                other.settimeout(0.5)
                other.connect((hosts.address(1), 7005))
            assert isinstance(failed.value, TimeoutError) or failed.value.errno in (
                errno.ENETUNREACH, errno.EHOSTUNREACH), failed.value
        finally:
            hosts.link_up()
        # TCP retransmits what was sent while the link was down.
        peer.settimeout(5)
        assert peer.recv(5) == b"lost?"
    client, peer = connect(hosts, 7006)
    with client, peer:
        client.sendall(b"back")
        assert peer.recv(4) == b"back"


def test_threads_in_a_namespace(hosts):
    with in_namespace(0):
        server = socket.create_server((hosts.address(0), 7007))
    main_thread_net = os.readlink(f"/proc/self/task/{threading.get_native_id()}/ns/net")

    def reach() -> bytes:
        with socket.create_connection((hosts.address(0), 7007), timeout=2) as client:
            return client.recv(2)

    with server, ThreadPoolExecutor(2, initializer=enter_namespace, initargs=(0,)) as pool:
        answer = pool.submit(reach)
        peer, _ = server.accept()
        with peer:
            peer.sendall(b"ok")
            assert answer.result(timeout=5) == b"ok"
    # The main thread stayed in the root namespace, where 10.231.0.1 does not exist.
    assert os.readlink(f"/proc/self/task/{threading.get_native_id()}/ns/net") == main_thread_net
    with socket.socket() as sock, pytest.raises(OSError) as failed:
        sock.bind((hosts.address(0), 0))
    assert failed.value.errno == errno.EADDRNOTAVAIL


def test_popen_runs_in_the_namespace_on_its_core(hosts):
    code = ("import os, socket; s = socket.socket(); s.bind(('10.231.0.2', 0)); "
            "print(os.environ['GLOO_SOCKET_IFNAME'], sorted(os.sched_getaffinity(0)), "
            "os.environ['EXTRA'])")
    process = hosts.popen(1, [sys.executable, "-c", code], env={"EXTRA": "x"},
                          stdout=subprocess.PIPE, text=True)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 0
    core = two_hosts._cores()[1]
    assert out.split() == ["braid-v1", f"[{core}]", "x"]
    assert os.getpgid(os.getpid()) != process.pid  # a session of its own
    argv = hosts.torchrun_argv(1, ["generate", "--tp", "2"], nproc_per_host=2, port=29500)
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[argv.index("--node-rank") + 1] == "1"
    assert argv[argv.index("--master-addr") + 1] == "10.231.0.1"
    assert argv[-5:] == ["-m", "braid.cli", "generate", "--tp", "2"]


def test_leftovers_are_removed_and_nothing_stays():
    # An aborted run: a namespace with a process still inside.
    subprocess.run(["ip", "netns", "add", "braid-h0"], check=True)
    stray = subprocess.Popen(["ip", "netns", "exec", "braid-h0", "sleep", "60"],
                             start_new_session=True)
    try:
        with TwoHosts("1gbit") as hosts:
            assert stray.wait(timeout=5) is not None
            sleeper = hosts.popen(0, ["sleep", "60"])
            client, peer = connect(hosts, 7008)
            client.close()
            peer.close()
        assert sleeper.poll() is not None
        assert "braid-h" not in netns_list()
        with pytest.raises(KeyboardInterrupt), TwoHosts():
            raise KeyboardInterrupt
        assert "braid-h" not in netns_list()
        links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
        assert "braid-v" not in links
    finally:
        if stray.poll() is None:
            stray.kill()
        stray.wait()
