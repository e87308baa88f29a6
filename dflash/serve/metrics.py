"""Latency histograms of ``dflash serve`` under vLLM's names, through prometheus_client:
``vllm:time_to_first_token_seconds`` (queue + prefill + the first token),
``vllm:inter_token_latency_seconds`` (each token after the first: a verify step's time divided
among the tokens it committed) and ``vllm:e2e_request_latency_seconds`` (queue to the last
token), per generated choice. Rendered after :class:`dflash.serve.protocol.ServerMetrics`'s
counters on ``/metrics``."""

from __future__ import annotations

from typing import Any

# vLLM's bucket bounds (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Latency:
    """The three histograms in their own registry (several servers in one process stay apart).

    Args:
        model: the served model name (the ``model_name`` label).
    """

    def __init__(self, model: str):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Histogram

        prometheus_client.disable_created_metrics()  # vLLM's exposition has no *_created series
        self.registry = CollectorRegistry()
        self.model = model

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(name, doc, ["model_name"], registry=self.registry,
                             buckets=buckets).labels(model)  # fmt: skip

        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time per token after the first.",
                        ITL_BUCKETS)  # fmt: skip
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Queue to the last token.", E2E_BUCKETS)

    def step(self, seconds: float, tokens: int) -> None:
        """A verify step of ``seconds`` that committed ``tokens`` tokens."""
        for _ in range(max(tokens, 0)):
            self.itl.observe(seconds / tokens)

    def render(self) -> str:
        """Prometheus text of the histograms."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
