"""Prometheus metrics of the server (`GET /metrics`), named as vLLM names its own where one
exists, under a `braid:` prefix. Engine gauges and totals come with every engine message;
latencies are measured in the API process, where the client sees them."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from braid.engine.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)


class Metrics:
    """The server's metrics, in a registry of their own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.running = Gauge("braid:num_requests_running",
                             "Sequences in the engine's running batch", registry=r)
        self.waiting = Gauge("braid:num_requests_waiting", "Sequences waiting to be admitted",
                             registry=r)
        self.kv_cache_usage = Gauge("braid:kv_cache_usage_perc",
                                    "Share of KV cache blocks held by sequences (1 = full)",
                                    registry=r)
        self.prefix_hit_rate = Gauge("braid:prefix_cache_hit_rate",
                                     "Share of looked-up prompt tokens found in the prefix cache",
                                     registry=r)
        self.spec_acceptance_rate = Gauge(
            "braid:spec_decode_acceptance_rate",
            "Share of the tokens proposed by speculative decoding that were accepted",
            registry=r)
        self._totals = {
            "prefix_cache_queries": Counter("braid:prefix_cache_queries",
                                            "Prompt tokens looked up in the prefix cache",
                                            registry=r),
            "prefix_cache_hits": Counter("braid:prefix_cache_hits",
                                         "Prompt tokens found in the prefix cache", registry=r),
            "num_preemptions": Counter("braid:num_preemptions", "Sequences preempted",
                                       registry=r),
            "num_steps": Counter("braid:engine_steps", "Forward steps run", registry=r),
            "num_steps_overlap": Counter("braid:engine_steps_two_batch_overlap",
                                         "Steps run as two overlapped micro-batches", registry=r),
            "num_steps_dp_linear": Counter("braid:engine_steps_dp_linear",
                                           "Steps with token-split replicated projections",
                                           registry=r),
            "num_draft_tokens": Counter("braid:spec_decode_num_draft_tokens",
                                        "Tokens proposed by speculative decoding and verified",
                                        registry=r),
            "num_accepted_tokens": Counter("braid:spec_decode_num_accepted_tokens",
                                           "Proposed tokens the verifying steps accepted",
                                           registry=r),
            "num_probe_steps": Counter("braid:auto_probe_steps",
                                       "Steps run by learning `auto` to time a setting of "
                                       "overlap, DP linear or compression", registry=r),
        }
        self.auto_choice = Gauge("braid:auto_choice",
                                 "Learning `auto`'s setting per step bucket (decode or prefill "
                                 "by token count, a power of two): 1 for the setting chosen, "
                                 "or for `probing` while it measures", ["bucket", "setting"],
                                 registry=r)
        self._auto_choices: dict[str, str] = {}
        # Constrained decoding: the driver fills masks while the forward runs; what rank 0
        # still waits for them is the cost the overlap did not hide.
        self._grammar = {
            "masks": Counter("braid:grammar_masks", "Token bitmasks filled for sequences "
                             "constrained by a grammar (one per sequence per step)", registry=r),
            "fill_s": Counter("braid:grammar_mask_fill_seconds", "Driver time spent filling "
                              "grammar bitmasks, while the forward step runs", registry=r),
            "wait_s": Counter("braid:grammar_mask_wait_seconds", "Time rank 0 waited for a "
                              "grammar bitmask after its logits were ready (not hidden by the "
                              "forward step)", registry=r),
        }
        # The engine reports running totals; counters grow by the change since the last report
        self._last: dict[str, int] = {}
        self.steps_by_path = Counter("braid:engine_steps_by_path",
                                     "Forward steps by the path they took: graph (the compiled "
                                     "decode graph), pieces (compiled between eager attention "
                                     "calls) or eager; +overlap for two micro-batches",
                                     ["path"], registry=r)
        self.prompt_tokens = Counter("braid:prompt_tokens", "Prompt tokens received",
                                     registry=r)
        self.generation_tokens = Counter("braid:generation_tokens", "Tokens generated",
                                         registry=r)
        self.requests = Counter("braid:request_success", "Requests finished, by reason",
                                ["finished_reason"], registry=r)
        self.rejected = Counter("braid:requests_rejected",
                                "Requests answered with an error before any work: "
                                "unauthorized (401), body_too_large (413), queue_full (429), "
                                "not_found (404) or invalid (other 4xx)", ["reason"], registry=r)
        self.queued = Gauge("braid:num_sequences_queued",
                            "Sequences accepted and not yet admitted, as admission control "
                            "counts them (--max-queued-sequences)", registry=r)
        self.rank_bytes = Gauge("braid:rank_memory_bytes",
                                "What each rank holds: its weights in every form (kind "
                                "weights), its KV cache (kv_cache) and its process's resident "
                                "memory (resident; absent for ranks on other hosts)",
                                ["rank", "kind"], registry=r)
        self.ttft = Histogram("braid:time_to_first_token_seconds",
                              "Time from arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("braid:inter_token_latency_seconds",
                             "Time between consecutive tokens of a completion",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("braid:e2e_request_latency_seconds",
                             "Time from arrival to the last token", buckets=_LATENCY_BUCKETS,
                             registry=r)

    def reject(self, reason: str) -> None:
        """Count a request refused before any work (a `rejected` reason)."""
        self.rejected.labels(reason=reason).inc()

    def update_engine(self, stats: EngineStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_cache_usage.set(stats.kv_cache_usage)
        if stats.prefix_cache_queries:
            self.prefix_hit_rate.set(stats.prefix_cache_hits / stats.prefix_cache_queries)
        if stats.num_draft_tokens:
            self.spec_acceptance_rate.set(stats.num_accepted_tokens / stats.num_draft_tokens)
        for name, counter in self._totals.items():
            self._add_since_last(counter, name, getattr(stats, name))
        for name, counter in self._grammar.items():
            self._add_since_last(counter, f"grammar:{name}", getattr(stats.grammar, name))
        for path, value in stats.steps_by_path.items():
            self._add_since_last(self.steps_by_path.labels(path=path), f"path:{path}", value)
        for rank, memory in enumerate(stats.memory):
            self.rank_bytes.labels(rank=rank, kind="weights").set(memory.weight_bytes)
            self.rank_bytes.labels(rank=rank, kind="kv_cache").set(memory.kv_cache_bytes)
            if memory.resident_bytes:
                self.rank_bytes.labels(rank=rank, kind="resident").set(memory.resident_bytes)
        for bucket, setting in stats.step_choices.items():
            previous = self._auto_choices.get(bucket)
            if previous != setting:
                if previous is not None:
                    self.auto_choice.remove(bucket, previous)
                self.auto_choice.labels(bucket=bucket, setting=setting).set(1)
                self._auto_choices[bucket] = setting

    def _add_since_last(self, counter, key: str, total: float) -> None:
        counter.inc(total - self._last.get(key, 0))
        self._last[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
