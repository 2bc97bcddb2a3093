"""Prometheus metrics of the server (``/metrics``), built with ``prometheus-client``.

Two sources:
- engine totals and gauges (running / waiting requests, KV cache usage, tokens, preemptions,
  prefix cache) are read from the async engine's stats snapshot at scrape time, by a custom
  collector, so the engine thread pays nothing for them;
- per-request latencies (time to first token, inter-token latency, end-to-end) are histograms
  fed by the async engine's observer hooks on the engine thread.

Beside them, vLLM's names for the same figures (:mod:`vllm_metrics`: the Model Server Protocol that Kubernetes
inference gateways read, and vLLM's dashboards).

Each server gets its own ``CollectorRegistry`` (no process-global state: tests build many apps). A many-model
server (``entrypoints/model_pool.py``) labels every series with ``model_name`` (vLLM's label), one per loaded
model; a one-model server's series carry no label.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from lightinfer.engine.async_engine import AsyncLLMEngine
from lightinfer.entrypoints.vllm_metrics import VllmLatencies, VllmStatsCollector

PREFIX = "lightinfer_"
# CPU decode runs at ~10-60 ms/token, a GPU at ~5-30 ms: buckets cover both, seconds.
_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_ITL_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


Sources = Callable[[], list[tuple[str, AsyncLLMEngine]]]  # (model name, engine) of each loaded model


class _EngineStatsCollector(Collector):
    """Exports the engines' ``EngineStats`` snapshots at scrape time (labelled by model when ``labelled``)."""

    def __init__(self, sources: Sources, labelled: bool) -> None:
        self.sources, self.labelled = sources, labelled

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for name, engine in self.sources():
            for metric in self._collect_one(engine):
                if not self.labelled:
                    yield metric
                    continue
                for sample in metric.samples:
                    if sample.name not in (metric.name, metric.name + "_total"):  # e.g. a counter's _created
                        continue
                    merged = families.get(metric.name)
                    if merged is None:
                        merged = families[metric.name] = type(metric)(metric.name, metric.documentation,
                                                                      labels=["model_name", *sample.labels])
                    merged.add_metric([name, *sample.labels.values()], sample.value)
        yield from families.values()

    @staticmethod
    def _collect_one(engine: AsyncLLMEngine) -> Iterator[Metric]:
        s = engine.get_stats()
        gauges = {
            "num_requests_running": ("Requests in the running batch.", s.num_running),
            "num_requests_waiting": ("Requests queued for the batch.", s.num_waiting),
            "kv_cache_usage_ratio": ("Share of KV cache blocks in use (0..1).", s.kv_cache_usage),
            "kv_cache_free_blocks": ("Free KV cache blocks.", s.num_free_blocks),
            "kv_cache_total_blocks": ("KV cache blocks in the pool.", s.num_total_blocks),
            "batch_size": ("Sequences in the last engine step.", s.last_batch_size),
            "batch_size_max": ("Largest number of sequences in one step so far.", s.max_batch_size),
            "prefix_cache_hit_rate": ("Prefix-cache hits / queries, in tokens, since start (0..1).",
                                      s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
        counters = {
            "prompt_tokens": ("Prompt tokens processed.", s.num_prompt_tokens),
            "generation_tokens": ("Tokens generated.", s.num_generation_tokens),
            "num_preemptions": ("Sequences preempted (KV recomputed) for lack of blocks.", s.num_preemptions),
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries),
            "prefix_cache_hits": ("Prompt tokens served from the prefix cache.", s.prefix_cache_hits),
        }
        spec = s.spec_decode
        if spec is not None:  # speculative decoding: vLLM's spec_decode counters, under our prefix
            counters.update({
                "spec_decode_num_drafts": ("Verify runs: one sequence's drafts checked in one step.", spec["num_drafts"]),
                "spec_decode_num_draft_tokens": ("Draft tokens verified.", spec["num_draft_tokens"]),
                "spec_decode_num_accepted_tokens": ("Draft tokens accepted.", spec["num_accepted_tokens"]),
            })
        for name, (doc, value) in counters.items():
            yield CounterMetricFamily(PREFIX + name, doc, value=float(value))
        if spec is not None:
            per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by their position in the draft (0 = first).",
                                          labels=["position"])
            for i, n in enumerate(spec["accepted_per_pos"]):
                per_pos.add_metric([str(i)], float(n))
            yield per_pos


class ServingMetrics:
    """The server's metrics; also the async engine's ``RequestObserver``.

    Args:
        engine: the async engine to read stats from and to observe (a one-model server).
        model_name: its served name (the ``model_name`` label of vLLM's series); default the engine's model.
        sources: instead of ``engine``, a many-model server's loaded models, ``() -> [(name, engine)]``; series are
            labelled ``model_name``, and each engine is observed from :meth:`attach`.
    """

    def __init__(self, engine: AsyncLLMEngine | None = None, *, model_name: str | None = None,
                 sources: Sources | None = None) -> None:
        if (engine is None) == (sources is None):
            raise ValueError("ServingMetrics takes an engine or sources, not both")
        self.registry = CollectorRegistry()
        labelled = sources is not None
        self.model_name = model_name or (str(engine.model_info().get("model")) if engine is not None else "")
        single: Sources = lambda: [(self.model_name, engine)]
        self.registry.register(_EngineStatsCollector(sources or single, labelled))
        self.registry.register(VllmStatsCollector(sources or single))
        self.vllm = VllmLatencies(self.registry)
        by_model = ["model_name"] if labelled else []
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time from arrival to the first token.",
                              by_model, buckets=_TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between a request's engine steps "
                             "that produced tokens.", by_model, buckets=_ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "request_latency_seconds", "Time from arrival to the end of a request.",
                             by_model, buckets=_E2E_BUCKETS, registry=self.registry)
        self.finished = Counter(PREFIX + "requests_finished", "Requests ended, by finish reason.",
                                ["finish_reason", *by_model], registry=self.registry)
        self.rejected = Counter(PREFIX + "requests_rejected", "Requests refused because the queue was full.",
                                by_model, registry=self.registry)
        if engine is not None:
            engine.add_observer(self)

    def attach(self, name: str, engine: AsyncLLMEngine) -> None:
        """Observe a many-model server's newly loaded ``engine`` under ``model_name=name``."""
        engine.add_observer(_ModelObserver(self, name))

    def on_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)
        self.vllm.first_token(self.model_name, seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.itl.observe(seconds)
        self.vllm.inter_token(self.model_name, seconds)

    def on_finished(self, finish_reason: str, seconds: float) -> None:
        self.finished.labels(finish_reason=finish_reason).inc()
        self.e2e.observe(seconds)
        self.vllm.finished(self.model_name, finish_reason, seconds)

    def on_rejected(self) -> None:
        self.rejected.inc()

    def render(self) -> tuple[bytes, str]:
        """``(body, content_type)`` in the Prometheus text format."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ModelObserver:
    """One loaded model's ``RequestObserver`` feeding the labelled series of a many-model server's metrics."""

    def __init__(self, metrics: ServingMetrics, name: str) -> None:
        self.metrics, self.name = metrics, name

    def on_first_token(self, seconds: float) -> None:
        self.metrics.ttft.labels(model_name=self.name).observe(seconds)
        self.metrics.vllm.first_token(self.name, seconds)

    def on_inter_token(self, seconds: float) -> None:
        self.metrics.itl.labels(model_name=self.name).observe(seconds)
        self.metrics.vllm.inter_token(self.name, seconds)

    def on_finished(self, finish_reason: str, seconds: float) -> None:
        self.metrics.finished.labels(finish_reason=finish_reason, model_name=self.name).inc()
        self.metrics.e2e.labels(model_name=self.name).observe(seconds)
        self.metrics.vllm.finished(self.name, finish_reason, seconds)

    def on_rejected(self) -> None:
        self.metrics.rejected.labels(model_name=self.name).inc()
