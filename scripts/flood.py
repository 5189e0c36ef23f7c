"""Flood a running `braid serve` and time one plain request from another client meanwhile.

    python scripts/flood.py --base-url http://127.0.0.1:30000 [--api-key KEY]

Sends 200 concurrent completions requests, of which 20 are large (400 prompts x n 64) and 180
small (one prompt, 32 tokens); one second in, a plain one-prompt request of another client.
Prints the plain request's latency, the status counts of the flood, and the server's queue and
rejection metrics; then leaves (its requests are aborted by the server). Every request's loop
is bounded in count and time. See docs/serving.md ("Limits and errors").
"""

from __future__ import annotations

import argparse
import asyncio
import re
import time
from collections import Counter

import httpx


async def flood(base_url: str, api_key: str | None, timeout: float) -> None:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    large = {"prompt": [f"Story {i}: once upon a time" for i in range(400)], "n": 64,
             "max_tokens": 16, "ignore_eos": True}
    limits = httpx.Limits(max_connections=300)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout,
                                 limits=limits) as crowd, \
            httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout) as plain:
        bodies = [large] * 20 + [{"prompt": f"Tell me about the number {i}.", "max_tokens": 32}
                                 for i in range(180)]
        tasks = [asyncio.ensure_future(crowd.post("/v1/completions", json=body))
                 for body in bodies]
        await asyncio.sleep(1.0)
        start = time.monotonic()
        answer = await plain.post("/v1/completions", json={
            "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0})
        latency = time.monotonic() - start
        print(f"plain request: HTTP {answer.status_code} in {latency:.2f} s: "
              f"{answer.json()['choices'][0]['text']!r}" if answer.status_code == 200
              else f"plain request: HTTP {answer.status_code} {answer.text}")
        done, pending = await asyncio.wait(tasks, timeout=5)
        statuses = Counter(t.result().status_code if not t.exception() else
                           type(t.exception()).__name__ for t in done)
        print(f"flood after {time.monotonic() - start + 1:.0f} s: {dict(statuses)} "
              f"answered, {len(pending)} still running (left now)")
        metrics = (await plain.get("/metrics")).text
        for name in ("braid:num_sequences_queued", "braid:num_requests_waiting",
                     "braid:num_requests_running", "braid:requests_rejected_total"):
            for line in re.findall(rf"^{re.escape(name)}\S* \S+$", metrics, re.MULTILINE):
                print(f"  {line}")
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:30000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    args = parser.parse_args()
    asyncio.run(flood(args.base_url, args.api_key, args.timeout))


if __name__ == "__main__":
    main()
