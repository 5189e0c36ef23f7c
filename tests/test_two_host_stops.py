"""How a two-host server (two_host_utils) stops: a lost host ends it with exit 1 within
--comm-timeout; SIGTERM, idle or while both ranks compile their steps at start, stops both
hosts within 5 s with exit 0 and nothing left in either namespace (under load:
test_two_host_serving). Its own module, so that no other server shares the namespaces."""

from __future__ import annotations

import time

import pytest
from two_host_utils import (
    COMM_TIMEOUT_S,
    START_TIMEOUT_S,
    STOP_WITHIN_S,
    process_names,
    start_agents,
    stop_and_time,
    two_host_server,
)
from two_hosts import TwoHosts, unavailable_reason

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"two emulated hosts: {unavailable_reason()}")


# make test-all: a lost host (make test: a dead rank ends a one-host server, test_server)
@pytest.mark.slow
@pytest.mark.parametrize("loss", ["killed", "link_down"])
def test_a_lost_host_ends_the_server_with_exit_1(tmp_path, loss):
    with two_host_server(tmp_path) as (hosts, agents, pool, url):
        if loss == "killed":
            hosts.kill_host(1)
        else:
            hosts.link_down()
        start = time.monotonic()
        code = agents[0].wait(COMM_TIMEOUT_S + 5)
        waited = time.monotonic() - start
    log = (tmp_path / "h0.log").read_text()
    assert code == 1 and waited <= COMM_TIMEOUT_S + 5
    assert "lost contact with rank 1" in log, log[-3000:]


# make test-all: the stop under load runs at the end of test_two_host_serving's `served`
@pytest.mark.slow
@pytest.mark.parametrize("when", ["idle", "compiling"])
def test_sigterm_stops_both_hosts_within_5s(tmp_path, when):
    """Idle, and while both ranks compile their steps at start with cold caches (the stop
    reaches the busy rank 1 through the heartbeat, not the plans it cannot read yet)."""
    if when == "idle":
        with two_host_server(tmp_path) as (_, agents, _, _):
            assert stop_and_time(agents, tmp_path) < STOP_WITHIN_S
        return
    cold = {"XDG_CACHE_HOME": str(tmp_path / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    with TwoHosts("1gbit") as hosts:
        agents = start_agents(hosts, tmp_path, "--compile", "on", env=cold)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not {"g++", "cc1plus"} & set(process_names(1)):
            assert agents[0].poll() is None, (tmp_path / "h0.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no compiler ran on host 1"
            time.sleep(0.05)
        assert stop_and_time(agents, tmp_path) < STOP_WITHIN_S
