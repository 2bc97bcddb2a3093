"""vLLM's metric names beside lightinfer's own on ``/metrics``: what Kubernetes' Gateway API Inference Extension
(its endpoint picker, llm-d's) reads from a model server by the Model Server Protocol, and what vLLM's Grafana
dashboards query.

Every series carries ``model_name`` (the served name), as vLLM's do:

* gauges ``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` (0-1), and
  ``vllm:cache_config_info`` (value 1; the KV cache's settings as labels: ``block_size``, ``num_gpu_blocks`` (the
  engine's KV pool, in host memory on a CPU), ``cache_dtype``, ``enable_prefix_caching``);
* counters ``vllm:prefix_cache_queries`` / ``vllm:prefix_cache_hits`` (tokens), ``vllm:prompt_tokens``,
  ``vllm:generation_tokens``, ``vllm:num_preemptions``, ``vllm:request_success`` (by ``finished_reason``);
* histograms ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``,
  ``vllm:e2e_request_latency_seconds``.

The gauges and counters are read from the engines' stats snapshots at scrape time; the histograms are fed by the
same observer calls as lightinfer's own (:mod:`metrics`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

VLLM = "vllm:"
# vLLM's own buckets (seconds), so that dashboards' quantiles read alike
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
# what a gateway may find missing or renamed: the protocol's names and their Prometheus types (tests check them)
PROTOCOL = {"vllm:num_requests_waiting": "gauge", "vllm:num_requests_running": "gauge",
            "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge",
            "vllm:prefix_cache_queries": "counter", "vllm:prefix_cache_hits": "counter",
            "vllm:time_to_first_token_seconds": "histogram", "vllm:inter_token_latency_seconds": "histogram",
            "vllm:e2e_request_latency_seconds": "histogram"}

Sources = Callable[[], list[tuple[str, Any]]]  # (served model name, AsyncLLMEngine) of each loaded model


class VllmStatsCollector(Collector):
    """The protocol's gauges and counters of every loaded model, from its engine's stats at scrape time."""

    def __init__(self, sources: Sources) -> None:
        self.sources = sources

    def collect(self) -> Iterator[Metric]:
        def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
            return GaugeMetricFamily(VLLM + name, doc, labels=["model_name", *labels])

        def counter(name: str, doc: str) -> CounterMetricFamily:
            return CounterMetricFamily(VLLM + name, doc, labels=["model_name"])

        running = gauge("num_requests_running", "Requests in the running batch.")
        waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        usage = gauge("kv_cache_usage_perc", "KV cache usage, 0-1 (1 = every block in use).")
        info = gauge("cache_config_info", "The KV cache's settings (labels); value 1.",
                     ("block_size", "num_gpu_blocks", "cache_dtype", "enable_prefix_caching"))
        queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        prompt = counter("prompt_tokens", "Prompt tokens processed.")
        generation = counter("generation_tokens", "Tokens generated.")
        preemptions = counter("num_preemptions", "Sequences preempted (KV recomputed) for lack of blocks.")
        for name, engine in self.sources():
            s, model = engine.get_stats(), engine.model_info()
            running.add_metric([name], float(s.num_running))
            waiting.add_metric([name], float(s.num_waiting))
            usage.add_metric([name], float(s.kv_cache_usage))
            info.add_metric([name, str(model.get("block_size", "")), str(s.num_total_blocks),
                             str(model.get("kv_cache_dtype", "")),
                             str(bool(model.get("enable_prefix_caching")))], 1.0)
            queries.add_metric([name], float(s.prefix_cache_queries))
            hits.add_metric([name], float(s.prefix_cache_hits))
            prompt.add_metric([name], float(s.num_prompt_tokens))
            generation.add_metric([name], float(s.num_generation_tokens))
            preemptions.add_metric([name], float(s.num_preemptions))
        yield from (running, waiting, usage, info, queries, hits, prompt, generation, preemptions)


class VllmLatencies:
    """The protocol's latency histograms and the finished requests by reason, labelled ``model_name``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.ttft = Histogram(VLLM + "time_to_first_token_seconds", "Time to first token, seconds.", ["model_name"],
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(VLLM + "inter_token_latency_seconds", "Time between a request's token-producing "
                             "steps, seconds.", ["model_name"], buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(VLLM + "e2e_request_latency_seconds", "Time from arrival to the end of a request, "
                             "seconds.", ["model_name"], buckets=E2E_BUCKETS, registry=registry)
        self.success = Counter(VLLM + "request_success", "Requests finished, by reason.",
                               ["model_name", "finished_reason"], registry=registry)

    def first_token(self, model: str, seconds: float) -> None:
        self.ttft.labels(model_name=model).observe(seconds)

    def inter_token(self, model: str, seconds: float) -> None:
        self.itl.labels(model_name=model).observe(seconds)

    def finished(self, model: str, reason: str, seconds: float) -> None:
        self.e2e.labels(model_name=model).observe(seconds)
        self.success.labels(model_name=model, finished_reason=reason).inc()
