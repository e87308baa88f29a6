"""``/metrics`` of ``dflash serve``: every counter, gauge and histogram is a prometheus_client
metric in the server's own :class:`~prometheus_client.CollectorRegistry` (several servers in
one process stay apart), exposed by ``generate_latest``; names and labels are vLLM's
(``model_name`` on every series), so scrapers and dashboards written for vLLM read it unchanged.

Counters (``_total``): ``vllm:prompt_tokens_total`` (prompt tokens run through the target, counted
at each prefill), ``vllm:generation_tokens_total`` (tokens committed, counted at every verify step),
``vllm:request_success_total{finished_reason}``, ``vllm:prefix_cache_queries_total`` /
``vllm:prefix_cache_hits_total`` (prompt tokens looked up in / supplied by the prefix cache) and
the spec-decode counters below. Gauges: ``vllm:num_requests_running`` (up to ``--max-batch``;
0 or 1 one generation at a time) and ``vllm:num_requests_waiting``, read from the engine's counts at each scrape, so
they fall as soon as a client leaves. Histograms (vLLM's buckets, seconds, per generated
choice): ``vllm:time_to_first_token_seconds`` (queue + prefill + the first token),
``vllm:inter_token_latency_seconds`` (each token after the first: a verify step's time divided
among the tokens it committed) and ``vllm:e2e_request_latency_seconds`` (queue to the last token).

Spec-decode counters follow vLLM: a draft = a verify step that checked >= 1 proposal; accepted
tokens per position p (0-based) = drafts whose first p+1 proposals were all accepted; so
τ = 1 + accepted / drafts as a vLLM scraper expects. vLLM divides the per-position counts by
``num_drafts``, right only when every draft has the same width; with ``--block-size auto`` the
width varies per step, so ``vllm:spec_decode_num_drafts_per_pos_total{position}`` (a dflash
addition under vLLM's prefix) counts the drafts that reached position p: proposed a token there
with the first p all accepted. Per-position acceptance P(p accepted | 0..p-1 accepted) =
``num_accepted_tokens_per_pos[p] / num_drafts_per_pos[p]``.
"""

from __future__ import annotations

import threading
from typing import Any

# vLLM's bucket bounds (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SPEC = "vllm:spec_decode_"


class ServerMetrics:
    """The server's metrics (thread-safe: the worker thread counts, the event loop scrapes).

    ``running`` and ``waiting`` are plain counts the engine changes under ``lock`` (a job's
    hand-over from the queue to the worker must move both at once); the gauges read them.

    Args:
        model: the served model name (the ``model_name`` label).
        block_size: the draft's block size: positions 0..block_size-2 are exported from the
            start (at 0); a wider step adds its positions when it comes.

    Raises:
        ImportError: prometheus_client is not installed (the serve extra).
    """

    def __init__(self, model: str, block_size: int):
        import prometheus_client
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        prometheus_client.disable_created_metrics()  # vLLM's exposition has no *_created series
        self.registry = registry = CollectorRegistry()
        self.model = model
        self.lock = threading.Lock()
        self.running = self.waiting = 0

        def counter(name: str, doc: str, *labels: str) -> Any:
            metric = Counter(name, doc, ["model_name", *labels], registry=registry)
            return metric if labels else metric.labels(model)

        def hist(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["model_name"], registry=registry, buckets=buckets).labels(
                model
            )

        self._drafts = counter(SPEC + "num_drafts", "Verify steps that checked a draft block.")
        self._draft_tokens = counter(SPEC + "num_draft_tokens", "Draft tokens proposed.")
        self._accepted = counter(SPEC + "num_accepted_tokens", "Draft tokens accepted.")
        self._per_pos = counter(SPEC + "num_accepted_tokens_per_pos",
                                "Drafts whose proposals up to this position were all accepted.",
                                "position")  # fmt: skip
        self._reached = counter(SPEC + "num_drafts_per_pos",
                                "Drafts that proposed a token at this position after all earlier "
                                "ones were accepted (the per-position acceptance's denominator "
                                "when widths vary).", "position")  # fmt: skip
        self.positions = 0
        self._add_positions(max(block_size - 1, 0))
        self._prompt = counter("vllm:prompt_tokens", "Prompt tokens prefilled.")
        self._generation = counter("vllm:generation_tokens", "Tokens generated.")
        self._success = counter("vllm:request_success", "Finished requests by reason.",
                                "finished_reason")  # fmt: skip
        self._prefix_queries = counter("vllm:prefix_cache_queries",
                                       "Prompt tokens looked up in the prefix cache.")  # fmt: skip
        self._prefix_hits = counter("vllm:prefix_cache_hits",
                                    "Prompt tokens the prefix cache supplied.")  # fmt: skip
        gauge = Gauge("vllm:num_requests_running", "Requests generating now.",
                      ["model_name"], registry=registry)  # fmt: skip
        gauge.labels(model).set_function(lambda: self.running)
        gauge = Gauge("vllm:num_requests_waiting", "Requests queued behind it.", ["model_name"],
                      registry=registry)  # fmt: skip
        gauge.labels(model).set_function(lambda: self.waiting)
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Time to the first token.", TTFT_BUCKETS
        )
        self.itl = hist("vllm:inter_token_latency_seconds", "Time per token after the first.",
                        ITL_BUCKETS)  # fmt: skip
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Queue to the last token.", E2E_BUCKETS)

    def _add_positions(self, n: int) -> None:
        while self.positions < n:
            self._per_pos.labels(self.model, str(self.positions))
            self._reached.labels(self.model, str(self.positions))
            self.positions += 1

    def step(self, accepted: int, proposed: int) -> None:
        """Count one verify step (accepted = tokens committed incl. the bonus; proposed = draft
        tokens it checked, 0 for a plain step)."""
        if proposed <= 0:
            return
        with self.lock:
            self._add_positions(proposed)
        self._drafts.inc()
        self._draft_tokens.inc(proposed)
        self._accepted.inc(accepted - 1)
        for p in range(min(accepted, proposed)):  # the accepted ones and the first rejected one
            self._reached.labels(self.model, str(p)).inc()
        for p in range(accepted - 1):
            self._per_pos.labels(self.model, str(p)).inc()

    def step_latency(self, seconds: float, tokens: int) -> None:
        """A verify step of ``seconds`` that committed ``tokens`` tokens: ``tokens`` inter-token
        latencies of ``seconds / tokens`` each."""
        for _ in range(max(tokens, 0)):
            self.itl.observe(seconds / tokens)

    def prompt(self, prompt_tokens: int) -> None:
        """Count a prompt forward outside a generation (the log-probabilities of an echoed
        prompt)."""
        self._prompt.inc(prompt_tokens)

    def prefix(self, prompt_tokens: int, cached_tokens: int) -> None:
        """Count a generation's prefill: its prompt tokens (``vllm:prompt_tokens_total`` counts
        all of them, as vLLM does) and those the prefix cache supplied."""
        self._prompt.inc(prompt_tokens)
        self._prefix_queries.inc(prompt_tokens)
        self._prefix_hits.inc(cached_tokens)

    def tokens(self, n: int) -> None:
        """Count tokens as a step commits them (``generation_tokens_total`` moves per step)."""
        self._generation.inc(n)

    def request_done(self, finish: str) -> None:
        """Count a finished choice by reason: stop, length, tool_calls or abort (its tokens
        were counted as they were prefilled and generated)."""
        self._success.labels(self.model, finish).inc()

    def render(self) -> str:
        """Prometheus text exposition format 0.0.4."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry).decode()
