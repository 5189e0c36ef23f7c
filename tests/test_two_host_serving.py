"""`braid serve --tp 2` across two emulated hosts (scripts/two_hosts.py: network namespaces, a
veth pair shaped to 1 Gbit/s, one torchrun agent each): the openai client's completions, chat,
streaming and 16 concurrent streams from inside host 0; greedy tokens equal tp 2 on one host in
fp32; learning `auto` reports its choices; a lost host ends the server with exit 1 in time."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from two_hosts import TwoHosts, enter_namespace, unavailable_reason  # noqa: E402

pytestmark = pytest.mark.skipif(unavailable_reason() is not None,
                                reason=f"two emulated hosts: {unavailable_reason()}")

PROMPTS = ["The capital of France is", "Once upon a time, in a small village,"]
PORT = 30000  # inside host 0's namespace, where nothing else listens
COMM_TIMEOUT_S = 10
START_TIMEOUT_S = 240


@contextmanager
def two_host_server(log_dir: Path, *args: str):
    """`braid serve --tp 2` with rank 0 (and the API) on host 0, rank 1 on host 1; yields
    (hosts, the agents' processes, a client pool of threads inside host 0)."""
    serve = ["serve", "--tp", "2", "--host", TwoHosts.address(0), "--port", str(PORT),
             "--dtype", "fp32", "--compile", "off", "--comm-timeout", str(COMM_TIMEOUT_S),
             "--log-level", "warning", *args]
    with TwoHosts("1gbit") as hosts, ThreadPoolExecutor(
            16, initializer=enter_namespace, initargs=(0,)) as pool:
        logs = [open(log_dir / f"h{h}.log", "w") for h in (0, 1)]
        agents = [hosts.popen(h, hosts.torchrun_argv(h, serve), stdout=logs[h],
                              stderr=subprocess.STDOUT) for h in (0, 1)]
        url = f"http://{hosts.address(0)}:{PORT}"

        def healthy() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        deadline = time.monotonic() + START_TIMEOUT_S
        while not pool.submit(healthy).result():
            if agents[0].poll() is not None or time.monotonic() > deadline:
                pytest.fail("the two-host server did not start:\n"
                            + (log_dir / "h0.log").read_text()[-3000:])
            time.sleep(0.5)
        try:
            yield hosts, agents, pool, url
        finally:
            for log in logs:
                log.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    # Uncompressed sums: compression changes the tokens (its effect is measured, not equal)
    with two_host_server(tmp_path_factory.mktemp("two-hosts"), "--comm-compression",
                         "none") as (hosts, agents, pool, url):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                               timeout=120)
        yield pool, client, url


def in_host0(pool, fn, *args):
    return pool.submit(fn, *args).result()


def test_greedy_completions_equal_one_host_tp2_fp32(served):
    pool, client, _ = served
    one_host = subprocess.run(
        [sys.executable, "-m", "braid.cli", "generate", "--tp", "2", "--dtype", "fp32",
         "--temperature", "0", "--max-new-tokens", "24", "--json", *PROMPTS],
        capture_output=True, text=True, timeout=300)
    assert one_host.returncode == 0, one_host.stderr
    expected = [json.loads(line)["text"] for line in one_host.stdout.splitlines()]
    model = in_host0(pool, lambda: client.models.list().data[0].id)
    response = in_host0(pool, lambda: client.completions.create(
        model=model, prompt=PROMPTS, max_tokens=24, temperature=0))
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected


def test_chat_streamed_and_not(served):
    pool, client, _ = served
    model = in_host0(pool, lambda: client.models.list().data[0].id)
    messages = [{"role": "user", "content": "What is the capital of Japan?"}]
    full = in_host0(pool, lambda: client.chat.completions.create(
        model=model, messages=messages, max_tokens=24, temperature=0))
    text = full.choices[0].message.content
    assert "Tokyo" in text

    def streamed() -> str:
        stream = client.chat.completions.create(model=model, messages=messages, max_tokens=24,
                                                temperature=0, stream=True)
        return "".join(chunk.choices[0].delta.content or "" for chunk in stream
                       if chunk.choices)

    assert in_host0(pool, streamed) == text


def test_sixteen_concurrent_streams(served):
    pool, client, url = served
    model = in_host0(pool, lambda: client.models.list().data[0].id)

    def stream(i: int) -> tuple[str, str]:
        chunks = client.completions.create(model=model, prompt=PROMPTS[i % 2], max_tokens=16,
                                           temperature=0, stream=True)
        text, reason = "", None
        for chunk in chunks:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    results = [f.result(timeout=300) for f in [pool.submit(stream, i) for i in range(16)]]
    assert all(reason == "length" and text for text, reason in results)
    for i in range(2):  # greedy: the same prompt, the same text, whatever the batch
        assert len({text for j, (text, _) in enumerate(results) if j % 2 == i}) == 1
    # overlap is learned across hosts: /metrics says what each step bucket chose
    metrics = in_host0(pool, lambda: httpx.get(f"{url}/metrics").text)
    assert re.search(r'^braid:auto_choice\{bucket="(decode|prefill):\d+",setting="[^"]+"\} 1',
                     metrics, re.MULTILINE), metrics


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
