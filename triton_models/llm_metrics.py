"""The llm model's custom metrics on Triton's metrics port: engine stats as gauges and counters,
one series per lower KV tier, and latency histograms. Each set, increment or observation is a
round trip to the server, which is why only changes are published."""
from __future__ import annotations

import triton_python_backend_utils as pb_utils

# engine stats key -> custom metric on Triton's metrics port
METRICS = [
    ("kv_utilization", "kvforge_kv_cache_utilization",
     "Bytes of the KV slot buffers' layout now over their budget kv_cache_bytes (0..1)", "GAUGE"),
    ("kv_bytes_held", "kvforge_kv_cache_bytes_held",
     "Bytes of KV memory the process holds: the slot reservation every layout lives in", "GAUGE"),
    ("running", "kvforge_running_sequences", "Sequences in the running batch", "GAUGE"),
    ("threads", "kvforge_engine_threads",
     "ONNX Runtime intra-op threads the engine's session runs (--decode-threads, $KVFORGE_THREADS; 0: a GPU engine)",
     "GAUGE"),
    ("step_budget", "kvforge_step_prefill_budget_tokens",
     "Prompt tokens a step beside decoding rows may carry now (the ITL target over the measured step costs)", "GAUGE"),
    ("waiting", "kvforge_waiting_sequences", "Requests waiting for a KV slot", "GAUGE"),
    ("generated_tokens", "kvforge_generated_tokens_total", "Tokens generated", "COUNTER"),
    ("steps", "kvforge_steps_total", "Engine steps run", "COUNTER"),
    ("multi_row_steps", "kvforge_batched_steps_total", "Engine steps that ran more than one sequence", "COUNTER"),
    ("finished", "kvforge_finished_requests_total", "Requests ended by a stop, their length or an error", "COUNTER"),
    ("cancelled", "kvforge_cancelled_requests_total", "Requests ended because their client went away", "COUNTER"),
    ("prefix_cache_queried_tokens", "kvforge_prefix_cache_queried_tokens_total",
     "Prompt tokens looked up in the prefix cache", "COUNTER"),
    ("prefix_cache_hit_tokens", "kvforge_prefix_cache_hit_tokens_total",
     "Prompt tokens whose KV came from the prefix cache", "COUNTER"),
    ("kv_host_pool_bytes", "kvforge_kv_host_pool_bytes", "Bytes of KV blocks in the host RAM pool", "GAUGE"),
    ("kv_host_pool_budget_bytes", "kvforge_kv_host_pool_budget_bytes", "Byte budget of the host RAM pool", "GAUGE"),
    ("blocks_evicted", "kvforge_kv_blocks_evicted_total", "KV blocks evicted from the host RAM pool", "COUNTER"),
    ("preempted_swap", "kvforge_preempted_swap_total",
     "Running sequences preempted with their KV swapped to the host pool (resumed, not recomputed)", "COUNTER"),
    ("preempted_recompute", "kvforge_preempted_recompute_total",
     "Running sequences preempted beyond the swap reserve (their KV recomputed)", "COUNTER"),
    ("longrope_recomputes", "kvforge_longrope_recomputes_total",
     "Sequences recomputed on longrope's long factors when they passed the original length", "COUNTER"),
    ("loading", "kvforge_loading_sequences", "Requests waiting for their prefix to load from disk or Redis", "GAUGE"),
    ("tier_write_queue_blocks", "kvforge_kv_tier_write_queue_blocks",
     "KV blocks queued for the disk / Redis tiers", "GAUGE"),
    ("tier_write_dropped_blocks", "kvforge_kv_tier_write_dropped_blocks_total",
     "KV blocks not written to disk / Redis because the write queue was full", "COUNTER"),
    ("tier_loads_abandoned", "kvforge_kv_tier_loads_abandoned_total",
     "Prefix loads skipped because recomputing was estimated faster", "COUNTER"),
    ("tier_loads_expired", "kvforge_kv_tier_loads_expired_total",
     "Prefix loads given up at their recompute deadline", "COUNTER"),
    ("expired", "kvforge_expired_requests_total", "Requests ended by the queue or request timeout", "COUNTER"),
    ("cancel_poll_seconds", "kvforge_cancel_poll_seconds_total",
     "CPU seconds the sender spent asking whether clients went away (the cost of cancellation)", "COUNTER"),
    # prefill/decode disaggregation (runtime/disaggregation.py); all 0 when serving aggregated
    ("spec_verify_rows", "kvforge_spec_verify_rows_total", "Rows of decode steps that verified drafted tokens",
     "COUNTER"),
    ("spec_draft_tokens", "kvforge_spec_draft_tokens_total", "Tokens drafted by prompt lookup and verified",
     "COUNTER"),
    ("spec_accepted_tokens", "kvforge_spec_accepted_tokens_total", "Drafted tokens the model agreed with",
     "COUNTER"),
    ("pd_remote_prefills", "kvforge_pd_remote_prefills_total", "Prompts sent to the prefill worker", "COUNTER"),
    ("pd_local_prefills", "kvforge_pd_local_prefills_total",
     "Prompts the decode engine prefilled itself while disaggregated (short, cached, worker busy or failed)",
     "COUNTER"),
    ("pd_handoffs", "kvforge_pd_handoffs_total", "Prefilled prompts handed over to the decode engine", "COUNTER"),
    ("pd_handoff_bytes", "kvforge_pd_handoff_bytes_total", "Bytes of KV handed over", "COUNTER"),
    ("pd_handoff_failures", "kvforge_pd_handoff_failures_total",
     "Hand-offs that failed or timed out (each prompt prefilled by the decode engine instead)", "COUNTER"),
    ("pd_handoff_expired", "kvforge_pd_handoff_expired_total", "Hand-offs given up at their timeout", "COUNTER"),
    ("pd_prefill_queue", "kvforge_pd_prefill_queue", "Prompts at the prefill worker now", "GAUGE"),
    ("pd_prefill_worker_up", "kvforge_pd_prefill_worker_up", "1 while the prefill worker is connected", "GAUGE"),
]
# per lower tier (label tier="disk" | "redis"): engine stats["tiers"][tier] key -> custom metric
TIER_METRICS = [
    ("hit_tokens", "kvforge_kv_tier_hit_tokens_total", "Prompt tokens whose KV was loaded from the tier", "COUNTER"),
    ("read_bytes", "kvforge_kv_tier_read_bytes_total", "Bytes of KV read from the tier", "COUNTER"),
    ("written_bytes", "kvforge_kv_tier_written_bytes_total", "Bytes of KV written to the tier", "COUNTER"),
    ("evicted_blocks", "kvforge_kv_tier_evicted_blocks_total",
     "KV blocks the tier evicted for its byte budget (Redis evicts on its own: 0)", "COUNTER"),
    ("errors", "kvforge_kv_tier_errors_total", "Failed tier operations (each one a miss)", "COUNTER"),
    ("corrupt_blocks", "kvforge_kv_tier_corrupt_blocks_total", "Tier entries refused by their checksum or header",
     "COUNTER"),
    ("load_p50_seconds", "kvforge_kv_tier_load_seconds_p50", "Median latency of a load from the tier", "GAUGE"),
    ("load_p99_seconds", "kvforge_kv_tier_load_seconds_p99", "99th percentile latency of a load from the tier",
     "GAUGE"),
    ("bytes", "kvforge_kv_tier_bytes", "Bytes of KV the tier holds (disk; Redis: not tracked, 0)", "GAUGE"),
    ("enabled", "kvforge_kv_tier_enabled", "1 while the tier is in use, 0 once it switched itself off", "GAUGE"),
]
# latency histograms (seconds), observed by the sender as responses go out
LATENCY_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
HISTOGRAMS = [
    ("ttft", "kvforge_time_to_first_token_seconds", "From arrival to the first token sent"),
    ("inter_token", "kvforge_inter_token_seconds", "Between a stream's consecutive responses, per token"),
    ("queue", "kvforge_queue_wait_seconds", "From arrival until the request got a KV slot"),
    ("e2e", "kvforge_request_seconds", "From arrival to the final response"),
    ("handoff", "kvforge_pd_handoff_seconds", "Writing a prefilled prompt's KV to the hand-off, acknowledged"),
]



class Published:
    """A custom metric and the value last sent to it: each set/increment is a round trip to the
    server, so only changes are sent, and a counter's value is never read back."""

    def __init__(self, metric, kind):
        self.metric, self.kind, self.value = metric, kind, 0

    def update(self, value):
        if value == self.value:
            return
        if self.kind == "GAUGE":
            self.metric.set(value)
        elif value > self.value:
            self.metric.increment(value - self.value)
        self.value = value



class EngineMetrics:
    """The metrics of one llm model instance (labels: model, version; tier for the tier series)."""

    def __init__(self, labels: dict[str, str], tiers: list[str]):
        # MetricFamily exists only in a model instance's stub, not while Triton loads the model
        self.families = {key: pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind))
                         for key, name, description, kind in METRICS}
        self.metrics = {key: Published(self.families[key].Metric(labels=labels), kind) for key, _, _, kind in METRICS}
        for key, name, description in HISTOGRAMS:
            self.families[key] = pb_utils.MetricFamily(name, description, pb_utils.MetricFamily.HISTOGRAM)
        self.histograms = {key: self.families[key].Metric(labels=labels, buckets=LATENCY_BUCKETS)
                           for key, _, _ in HISTOGRAMS}
        self.tier_families = {key: pb_utils.MetricFamily(name, description, getattr(pb_utils.MetricFamily, kind))
                              for key, name, description, kind in TIER_METRICS} if tiers else {}
        self.tier_metrics = {(tier, key): Published(self.tier_families[key].Metric(labels={**labels, "tier": tier}),
                                                    kind)
                             for tier in tiers for key, _, _, kind in TIER_METRICS}

    def publish(self, stats: dict) -> None:
        """The engine's stats (LLMEngine.stats(), plus the sender's cancel_poll_seconds)."""
        for key, metric in self.metrics.items():
            metric.update(stats[key])
        for (tier, key), metric in self.tier_metrics.items():
            metric.update(stats["tiers"][tier][key])

    def observe(self, histogram: str, seconds: float) -> None:
        self.histograms[histogram].observe(seconds)

    def close(self) -> None:
        self.metrics.clear()  # metrics before their families, as the backend requires
        self.histograms.clear()
        self.tier_metrics.clear()
        self.families.clear()
        self.tier_families.clear()
