"""Prometheus metrics at GET /metrics, named as vLLM names them (with the `dsv4:` prefix), in a registry of the
server's own (prometheus_client's global registry is never touched)."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0, 7680.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class Metrics:
    def __init__(self, model_name: str, capacity_tokens: int):
        self.registry = CollectorRegistry()
        kw = dict(labelnames=["model_name"], registry=self.registry)

        def make(kind, name, doc, **extra):
            return kind(f"dsv4:{name}", doc, **kw, **extra).labels(model_name)

        self.running = make(Gauge, "num_requests_running", "Requests in a cache slot (prefilling or decoding).")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests accepted and waiting for a cache slot.")
        self.cache_usage = make(Gauge, "kv_cache_usage_perc", "Fraction of the decode cache's pages in use (0-1).")
        make(Gauge, "kv_cache_capacity_tokens", "Decode cache capacity in tokens (pages x page tokens).").set(capacity_tokens)
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens of accepted requests.")
        self.generation_tokens = make(Counter, "generation_tokens", "Generated tokens.")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "From arrival to the first token.",
                         buckets=TTFT_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Between consecutive tokens of a request.",
                        buckets=ITL_BUCKETS)
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "From arrival to the end of a request.",
                        buckets=E2E_BUCKETS)
        self._finished = Counter("dsv4:request_success", "Requests ended, by finish reason.",
                                 labelnames=["model_name", "finished_reason"], registry=self.registry)
        self._model_name = model_name

    def finished(self, reason: str) -> None:
        self._finished.labels(self._model_name, reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
