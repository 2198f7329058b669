"""The server's Prometheus metrics: what an operator (and `planner.endpoint.client`) reads from `/metrics`.

Names follow Prometheus conventions under a `kvplan_` prefix; `kvplan_cache_config_info` carries the KV pool's
shape as labels, the way vLLM's `vllm:cache_config_info` does, so the planner can read a server's capacity.
`kvplan_kv_pages_used` counts the pages requests hold: it is 0 on an idle server, whatever the prefix cache keeps
(`kvplan_kv_pages_cached`) or an integrity check quarantined (`kvplan_kv_pages_quarantined`).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, ProcessCollector, generate_latest

# latency buckets (seconds): a GPU decode step is milliseconds, a CPU prefill of a long prompt seconds
TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0)
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)


class ServerMetrics:
    """One registry per server (never the process-wide default: tests start several servers)."""

    def __init__(self, cache_config: dict[str, str | int]) -> None:
        self.registry = registry = CollectorRegistry()
        self.running = Gauge("kvplan_requests_running", "Requests in the running batch", registry=registry)
        self.waiting = Gauge("kvplan_requests_waiting", "Requests queued for admission", registry=registry)
        self.pages_used = Gauge("kvplan_kv_pages_used", "KV-cache pages held by requests", registry=registry)
        self.pages_quarantined = Gauge("kvplan_kv_pages_quarantined", "KV-cache pages taken out of use by an "
                                       "integrity check (neither free nor held)", registry=registry)
        self.pages_free = Gauge("kvplan_kv_pages_free", "KV-cache pages free", registry=registry)
        self.pages_cached = Gauge("kvplan_kv_pages_cached", "KV-cache pages published in the prefix cache (held or "
                                  "evictable)", registry=registry)
        # vLLM's prefix_cache_queries and prefix_cache_hits: tokens looked up at admission, and those found
        self.prefix_queries = Counter("kvplan_prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      registry=registry)
        self.prefix_hits = Counter("kvplan_prefix_cache_hits", "Prompt tokens found in the prefix cache",
                                   registry=registry)
        # vLLM's spec_decode_num_draft_tokens and spec_decode_num_accepted_tokens: drafts verified, and those that stood
        self.draft_tokens = Counter("kvplan_spec_decode_num_draft_tokens", "Speculative tokens verified",
                                    registry=registry)
        self.accepted_tokens = Counter("kvplan_spec_decode_num_accepted_tokens", "Speculative tokens that stood",
                                       registry=registry)
        self.capacity = Gauge("kvplan_kv_capacity_tokens", "Token slots of the KV pool", registry=registry)
        self.preemptions = Counter("kvplan_preemptions", "Requests preempted (recomputed later)", registry=registry)
        self.integrity_aborts = Counter("kvplan_integrity_aborts", "Requests aborted by a KV-cache integrity check",
                                        registry=registry)
        self.prompt_tokens = Counter("kvplan_prompt_tokens", "Prompt tokens of accepted requests", registry=registry)
        self.generation_tokens = Counter("kvplan_generation_tokens", "Tokens sent to clients", registry=registry)
        self.finished = Counter("kvplan_requests_finished", "Requests ended, by finish reason", ["finish_reason"],
                                registry=registry)
        self.rejected = Counter("kvplan_requests_rejected", "Requests refused, by HTTP status", ["status"],
                                registry=registry)
        self.ttft = Histogram("kvplan_time_to_first_token_seconds", "From arrival to the first token sent",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("kvplan_inter_token_latency_seconds", "Between successive tokens of a request",
                             buckets=ITL_BUCKETS, registry=registry)
        self.step_seconds = Histogram("kvplan_step_duration_seconds", "Engine steps by regime (prefill, decode, "
                                      "mixed): the model's compute, without HTTP", ["regime"],
                                      buckets=STEP_BUCKETS, registry=registry)
        Info("kvplan_cache_config", "The KV pool and batching limits", registry=registry).info(
            {key: str(value) for key, value in cache_config.items()})
        self.capacity.set(int(cache_config["num_pages"]) * int(cache_config["page_size"]))
        ProcessCollector(registry=registry)     # process_resident_memory_bytes and friends: a soak watches them

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
