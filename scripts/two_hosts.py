"""Two emulated hosts on one machine: two network namespaces joined by a rate-shaped veth pair.

    python scripts/two_hosts.py [--rate 1gbit] [--nproc-per-host 1] [--port 29400] -- ARGS...
    python scripts/two_hosts.py --rate 1gbit --measure

The first form runs one `torchrun` agent per namespace (`--nnodes 2`, the master at host 0's
address) with `python -m braid.cli ARGS...`, streams both agents' output prefixed `[h0]` and
`[h1]`, and exits with the first non-zero exit code (0 when both succeed). The second measures
the link's TCP throughput from host 0 to host 1 (~1.5 s) and prints it in Mbit/s.

Layout: namespaces `braid-h0` and `braid-h1`; veth ends `braid-v0` (in h0, 10.231.0.1/24) and
`braid-v1` (in h1, 10.231.0.2/24). Each end's egress is shaped by a tbf qdisc, so both
directions carry at most RATE. Nothing is configured in the root namespace (no address, no
route, no veth end): traffic between the hosts cannot leave the two namespaces, and the hosts
cannot reach anything else (not even the root namespace's loopback).

It needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN: `ip netns add`, `setns`), `ip` and `tc`;
`unavailable_reason()` says why not, where not. Setting up removes the leftovers of an earlier
run (processes still inside the namespaces, then the namespaces); leaving, also on an exception
or Ctrl-C, ends the processes it started and deletes both namespaces, which deletes the veth.

As a module (`scripts/` on sys.path):

    with TwoHosts("1gbit") as hosts:
        server = hosts.popen(0, [sys.executable, "-m", "braid.cli", "serve", ...])
        with hosts.in_namespace(0):        # this thread only: sockets made here live in h0
            client = socket.create_connection((hosts.address(0), 30000))
        pool = ThreadPoolExecutor(4, initializer=enter_namespace, initargs=(0,))

Sockets keep the namespace they were created in, so a socket made inside `in_namespace` may be
used from any thread afterwards.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

NAMESPACES = ("braid-h0", "braid-h1")
INTERFACES = ("braid-v0", "braid-v1")
ADDRESSES = ("10.231.0.1", "10.231.0.2")
PREFIX_LEN = 24

_CLONE_NEWNET = 0x40000000
# tbf's bucket: at least 4 ms of traffic (rate / 250; the tc manual's rule is rate / HZ and this
# kernel's HZ is 250) and 64 KiB (one GSO packet). Measured on 2 cores (veth, offloads on):
# at 10gbit a 64 KiB bucket gives ~5 Gbit/s, 1 MiB ~9.2, rate / 250 (5 MB) ~9.55 (95.5% is TCP
# over Ethernet framing at best); 300mbit and 1gbit are at 95.5-96% with either. The price: after
# an idle moment a full bucket passes at veth speed, so a lone message smaller than the bucket
# (4 ms of traffic) is not slowed; sustained traffic is. (Pass `burst=` for another trade.)
_BURST_SECONDS = 1 / 250
_MIN_BURST = 64 * 1024
# tbf's queue in bytes: packets beyond it are dropped. TCP small queues keep at most
# net.ipv4.tcp_limit_output_bytes (4 MiB here) of one socket queued below TCP, so 32 MiB holds
# several full flows at any rate without a drop (a latency-sized queue, e.g. 20 ms at 100mbit,
# dropped packets of a single flow).
_QUEUE_BYTES = 32 * 1024 * 1024

_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def rate_bytes_per_second(rate: str) -> float:
    """tc's rate syntax (`10gbit`, `300mbit`, `1.5gbit`, `100mbps` = bytes, `8000bit`) in
    bytes per second."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]i?)?(bit|bps)\s*", rate.lower())
    if not match:
        raise ValueError(f"not a rate: {rate!r} (e.g. 10gbit, 300mbit)")
    value = float(match.group(1)) * _UNITS[match.group(2) or ""]
    return value / 8 if match.group(3) == "bit" else value


_libc = ctypes.CDLL(None, use_errno=True)


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout).strip()}")
    return done


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None where two hosts can be set up here, else why not (for a test's skip)."""
    if os.geteuid() != 0:
        return "two emulated hosts need root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"two emulated hosts need `{tool}` (iproute2) on PATH"
    if not hasattr(_libc, "setns"):
        return "the C library has no setns()"
    probe = f"braid-probe-{os.getpid()}"
    try:
        for argv in (("ip", "netns", "add", probe),
                     ("ip", "-n", probe, "link", "add", "braid-pa", "type", "veth",
                      "peer", "name", "braid-pb"),
                     ("tc", "-n", probe, "qdisc", "add", "dev", "braid-pa", "root", "tbf",
                      "rate", "1gbit", "burst", "64kb", "limit", "1mb")):
            done = _run(*argv, check=False)
            if done.returncode != 0:
                return (f"`{' '.join(argv)}` failed: {(done.stderr or done.stdout).strip()} "
                        "(a container without CAP_SYS_ADMIN/CAP_NET_ADMIN, or no veth/tbf)")
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _existing_namespaces() -> set[str]:
    listed = _run("ip", "netns", "list", check=False).stdout
    return {line.split()[0] for line in listed.splitlines() if line.strip()}


def namespace_pids(name: str) -> list[int]:
    """The processes inside namespace `name` (this one excepted)."""
    listed = _run("ip", "netns", "pids", name, check=False).stdout
    return [int(p) for p in listed.split() if p.isdigit() and int(p) != os.getpid()]


def _kill_namespace_processes(name: str, grace: float = 2.0,
                              first: signal.Signals = signal.SIGTERM) -> None:
    """End every process inside namespace `name`: `first` (SIGTERM), then SIGKILL after
    `grace` s."""
    for sig, wait in ((first, grace), (signal.SIGKILL, 1.0)):
        running = namespace_pids(name)
        if not running:
            return
        for pid in running:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + wait
        while namespace_pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)


def remove_leftovers() -> None:
    """Remove what an earlier (aborted) run left: processes in the braid namespaces, the
    namespaces (with the veth inside), a veth end stranded in the root namespace."""
    existing = _existing_namespaces()
    for name in NAMESPACES:
        if name in existing:
            _kill_namespace_processes(name)
            _run("ip", "netns", "del", name, check=False)
    for interface in INTERFACES:
        if os.path.exists(f"/sys/class/net/{interface}"):
            _run("ip", "link", "del", interface, check=False)


def _setns(fd: int) -> None:
    if _libc.setns(fd, _CLONE_NEWNET) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"setns: {os.strerror(errno)}")


def enter_namespace(host: int) -> None:
    """Move the calling thread into host `host`'s namespace for good (until it ends), e.g. as
    `ThreadPoolExecutor(initializer=enter_namespace, initargs=(0,))`: every socket its workers
    create lives in that namespace. Other threads are not affected."""
    fd = os.open(f"/var/run/netns/{NAMESPACES[host]}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        _setns(fd)
    finally:
        os.close(fd)


@contextlib.contextmanager
def in_namespace(host: int) -> Iterator[None]:
    """Run the body with the calling thread in host `host`'s namespace, then move it back."""
    own = os.open(f"/proc/self/task/{threading.get_native_id()}/ns/net",
                  os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter_namespace(host)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(own)


def _cores() -> tuple[int, int]:
    usable = sorted(os.sched_getaffinity(0))
    return (usable[0], usable[1] if len(usable) > 1 else usable[0])


class TwoHosts:
    """Two namespaces joined by a veth pair whose both directions are shaped to `rate` (tc's
    syntax: `10gbit`, `300mbit`). A context manager; `close()` is idempotent."""

    def __init__(self, rate: str = "10gbit", burst: int | None = None):
        rate_bytes_per_second(rate)  # fail early on a typo
        self.rate = rate
        self.burst = burst
        self.processes: list[subprocess.Popen] = []
        self._up = False

    # -- setup and teardown -------------------------------------------------------------------

    def __enter__(self) -> TwoHosts:
        reason = unavailable_reason()
        if reason is not None:
            raise RuntimeError(reason)
        remove_leftovers()
        self._up = True
        try:
            for name in NAMESPACES:
                _run("ip", "netns", "add", name)
                _run("ip", "-n", name, "link", "set", "lo", "up")
            # Created inside the namespaces: no end ever exists in the root namespace.
            _run("ip", "link", "add", INTERFACES[0], "netns", NAMESPACES[0], "type", "veth",
                 "peer", "name", INTERFACES[1], "netns", NAMESPACES[1])
            for host in (0, 1):
                _run("ip", "-n", NAMESPACES[host], "addr", "add",
                     f"{ADDRESSES[host]}/{PREFIX_LEN}", "dev", INTERFACES[host])
                _run("ip", "-n", NAMESPACES[host], "link", "set", INTERFACES[host], "up")
            self.set_rate(self.rate)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """End the processes started here (their process groups: SIGTERM, SIGKILL 2 s later),
        then any other process left in the namespaces, then delete both namespaces."""
        # Ctrl-C (or SIGTERM) during teardown must not leave namespaces behind: finish first.
        previous = {}
        if threading.current_thread() is threading.main_thread():
            previous = {sig: signal.signal(sig, signal.SIG_IGN)
                        for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            self._stop_processes()
            if self._up:
                existing = _existing_namespaces()
                for name in NAMESPACES:
                    if name in existing:
                        _kill_namespace_processes(name)
                        _run("ip", "netns", "del", name, check=False)
                self._up = False
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _stop_processes(self, grace: float = 2.0) -> None:
        running = [p for p in self.processes if p.poll() is None]
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, 2.0)):
            for process in running:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(process.pid, sig)
            deadline = time.monotonic() + wait
            for process in running:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(max(0.0, deadline - time.monotonic()))
            running = [p for p in running if p.poll() is None]
            if not running:
                break
        # What outlives its group leader is still in a namespace: close() ends it there.

    # -- the link -----------------------------------------------------------------------------

    def set_rate(self, rate: str) -> None:
        """Shape both directions to `rate`, in place (open connections carry on)."""
        bytes_per_second = rate_bytes_per_second(rate)
        burst = self.burst or max(int(bytes_per_second * _BURST_SECONDS), _MIN_BURST)
        for host in (0, 1):
            _run("tc", "-n", NAMESPACES[host], "qdisc", "replace", "dev", INTERFACES[host],
                 "root", "tbf", "rate", rate, "burst", str(burst),
                 "limit", str(burst + _QUEUE_BYTES))
        self.rate = rate

    def link_down(self) -> None:
        """Take both ends down: nothing passes (new connections fail, sent data waits)."""
        for host in (0, 1):
            _run("ip", "-n", NAMESPACES[host], "link", "set", INTERFACES[host], "down")

    def kill_host(self, host: int) -> None:
        """SIGKILL every process in host `host` (torchrun's workers run in sessions of their
        own: killing an agent's process group leaves them running)."""
        _kill_namespace_processes(NAMESPACES[host], grace=0.0, first=signal.SIGKILL)

    def link_up(self) -> None:
        for host in (0, 1):
            _run("ip", "-n", NAMESPACES[host], "link", "set", INTERFACES[host], "up")

    def qdisc_stats(self, host: int) -> str:
        """`tc -s qdisc show` of host `host`'s end (sent bytes, drops, overlimits)."""
        return _run("tc", "-n", NAMESPACES[host], "-s", "qdisc", "show", "dev",
                    INTERFACES[host]).stdout

    def dropped(self, host: int) -> int:
        """Packets host `host`'s qdisc dropped (a full queue) since the rate was last set."""
        match = re.search(r"dropped (\d+)", self.qdisc_stats(host))
        return int(match.group(1)) if match else 0

    @staticmethod
    def address(host: int) -> str:
        return ADDRESSES[host]

    @staticmethod
    def interface(host: int) -> str:
        return INTERFACES[host]

    @staticmethod
    def namespace(host: int) -> str:
        return NAMESPACES[host]

    in_namespace = staticmethod(in_namespace)
    enter_namespace = staticmethod(enter_namespace)

    # -- processes ----------------------------------------------------------------------------

    def popen(self, host: int, argv: list[str], env: dict[str, str] | None = None,
              **popen_kwargs) -> subprocess.Popen:
        """Start `argv` inside host `host`'s namespace, in a session (process group) of its
        own, pinned to the host's core (host 0 the first usable core, host 1 the second), with
        GLOO_SOCKET_IFNAME set to the host's veth end. `env` adds to (or overrides) this
        process's environment. Every process started here ends when the hosts close."""
        environment = dict(os.environ)
        environment.update(env or {})
        environment["GLOO_SOCKET_IFNAME"] = INTERFACES[host]
        command = ["ip", "netns", "exec", NAMESPACES[host]]
        if shutil.which("taskset"):
            command += ["taskset", "-c", str(_cores()[host])]
        popen_kwargs.setdefault("start_new_session", True)
        process = subprocess.Popen([*command, *argv], env=environment, **popen_kwargs)
        self.processes.append(process)
        return process

    @staticmethod
    def torchrun_argv(host: int, braid_args: list[str], nproc_per_host: int = 1,
                      port: int = 29400) -> list[str]:
        """One torchrun agent of a two-node job running `python -m braid.cli braid_args`."""
        return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node-rank", str(host), "--nproc-per-node", str(nproc_per_host),
                "--master-addr", ADDRESSES[0], "--master-port", str(port),
                "-m", "braid.cli", *braid_args]

    def measure(self, seconds: float = 1.5, port: int = 5201) -> float:
        """TCP throughput from host 0 to host 1 over `seconds`, in Mbit/s (payload bytes)."""
        receiver = self.popen(1, [sys.executable, "-c", _RECEIVER, ADDRESSES[1], str(port)],
                              stdout=subprocess.PIPE, text=True)
        assert receiver.stdout is not None
        if receiver.stdout.readline().strip() != "listening":
            raise RuntimeError("the receiver did not start")
        sender = self.popen(0, [sys.executable, "-c", _SENDER, ADDRESSES[1], str(port),
                                str(seconds)])
        if sender.wait(seconds + 30) != 0:
            raise RuntimeError(f"the sender failed ({sender.returncode})")
        out, _ = receiver.communicate(timeout=30)
        received, elapsed = (float(v) for v in out.split())
        return received * 8 / elapsed / 1e6


_RECEIVER = """
import socket, sys, time
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(1)
print("listening", flush=True)
connection, _ = server.accept()
buffer = bytearray(1 << 20)
received, start = 0, None
while True:
    n = connection.recv_into(buffer)
    if not n:
        break
    if start is None:
        start = time.monotonic()
    received += n
print(received, time.monotonic() - start)
"""

_SENDER = """
import socket, sys, time
connection = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10)
chunk = bytes(1 << 20)
end = time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    connection.sendall(chunk)
connection.close()
"""


# -- the command line ---------------------------------------------------------------------------


def _stream(process: subprocess.Popen, prefix: str, lock: threading.Lock) -> None:
    assert process.stdout is not None
    for line in iter(process.stdout.readline, b""):
        with lock:
            sys.stdout.buffer.write(prefix.encode() + line)
            sys.stdout.buffer.flush()


def run_torchrun(hosts: TwoHosts, braid_args: list[str], nproc_per_host: int, port: int,
                 grace: float) -> int:
    """Run one torchrun agent per host; the first non-zero exit code, else 0. Once one agent
    fails, the other has `grace` seconds to end before it is terminated."""
    lock = threading.Lock()
    agents, streams = [], []
    for host in (0, 1):
        agent = hosts.popen(host, hosts.torchrun_argv(host, braid_args, nproc_per_host, port),
                            env={"PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        agents.append(agent)
        streams.append(threading.Thread(target=_stream, args=(agent, f"[h{host}] ", lock),
                                        daemon=True))
        streams[-1].start()
    first_failure, failed_at = 0, None
    running = set(agents)
    while running:
        for agent in list(running):
            if agent.poll() is not None:
                running.discard(agent)
                if agent.returncode != 0 and first_failure == 0:
                    first_failure, failed_at = agent.returncode, time.monotonic()
        if running and failed_at is not None and time.monotonic() - failed_at > grace:
            print(f"[two_hosts] one agent failed; terminating the other after {grace:.0f} s",
                  file=sys.stderr, flush=True)
            for agent in running:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(agent.pid, signal.SIGTERM)
            failed_at = float("inf")
        time.sleep(0.1)
    for stream in streams:
        stream.join(timeout=5)
    return first_failure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a two-node braid job (one torchrun agent per emulated host) over a "
        "rate-shaped veth pair between two network namespaces; needs root.",
        usage="%(prog)s [--rate RATE] [--nproc-per-host N] [--port PORT] -- BRAID_ARGS...\n"
              "       %(prog)s [--rate RATE] --measure")
    parser.add_argument("--rate", default="10gbit", help="link rate, each direction "
                        "(tc syntax: 10gbit, 1gbit, 300mbit; default 10gbit)")
    parser.add_argument("--nproc-per-host", type=int, default=1)
    parser.add_argument("--port", type=int, default=29400, help="torchrun's master port")
    parser.add_argument("--grace", type=float, default=60.0, help="seconds the other agent "
                        "has to end once one failed (default 60)")
    parser.add_argument("--measure", action="store_true",
                        help="measure the link's TCP throughput (h0 to h1) instead")
    parser.add_argument("--seconds", type=float, default=1.5, help="with --measure")
    parser.add_argument("braid_args", nargs=argparse.REMAINDER,
                        help="after --: the arguments of `braid` (python -m braid.cli)")
    args = parser.parse_args(argv)
    braid_args = args.braid_args[1:] if args.braid_args[:1] == ["--"] else args.braid_args
    if not args.measure and not braid_args:
        parser.error("give the braid arguments after --, or --measure")
    reason = unavailable_reason()
    if reason is not None:
        print(f"two_hosts: {reason}", file=sys.stderr)
        return 2

    # SIGTERM/SIGHUP unwind like Ctrl-C, so that the hosts are torn down.
    def interrupt(signum, frame):
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) != signal.SIG_IGN:  # (nohup ignores SIGHUP: keep it so)
            signal.signal(sig, interrupt)
    try:
        with TwoHosts(args.rate) as hosts:
            if args.measure:
                mbit = hosts.measure(args.seconds)
                print(f"{args.rate}: {mbit:.0f} Mbit/s measured (TCP payload, h0 -> h1, "
                      f"{args.seconds:g} s; {hosts.dropped(0)} packets dropped by the "
                      "shaper)")
                return 0
            return run_torchrun(hosts, braid_args, args.nproc_per_host, args.port, args.grace)
    except KeyboardInterrupt:
        print("two_hosts: interrupted; the hosts are torn down", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
