"""``dflash benchmark openai``'s acceptance figures when verify steps differ in width (``dflash
serve --block-size auto``: a step proposes anywhere from 0 to L-1 drafts): per-position
acceptance from meta_info's per-step lists and from ``/metrics``, against hand-computed values,
and through ``dflash serve``'s app with a scripted pipeline (no model, no network server)."""

from __future__ import annotations

import json
import time

import pytest

from dflash.backends.openai_stats import SpecCounters, extract_meta, meta_stats
from dflash.bench.remote import RemoteRecord, _as_response_records, side_summary
from dflash.serve.metrics import ServerMetrics
from dflash.serve.protocol import meta_info
from dflash.types import RoundResult

# Four verify steps of one auto-width reply (L = 16): widths 4, 1 (plain), 16, 2.
PROPOSED = [3, 0, 15, 1]
TAUS = [4, 1, 3, 1]  # accepted drafts 3 (all), 0 (none proposed), 2 (3rd rejected), 0
# P(k accepted | 1..k-1 accepted) over the steps that proposed draft k:
#   k=1: steps 0, 2, 3 proposed it, 0 and 2 accepted it            -> 2/3
#   k=2: steps 0, 2 reached it (accepted draft 1), both accepted it -> 1
#   k=3: steps 0, 2 reached it, only step 0 accepted it             -> 1/2
#   k=4: step 0 never proposed it, step 2 stopped at draft 3        -> None (and so on to 15)
EXPECTED = [2 / 3, 1.0, 0.5] + [None] * 12


def _record(meta: dict, rid: str = "q1", new_tokens: int = 9) -> RemoteRecord:
    stats = meta_stats(meta)
    return RemoteRecord(dataset="gsm8k", id=rid, turn=0, side="dflash", ok=True,
                        new_tokens=new_tokens, ttft_s=0.1, e2e_s=1.0, tau=stats["tau"],
                        verify_ct=stats["verify_ct"], histogram=stats["histogram"],
                        accept_lengths=stats["accept_lengths"], proposed=stats["proposed"])  # fmt: skip


def _run(records: list[RemoteRecord], counters: dict | None = None) -> dict:
    return {"records": records, "wall_s": 1.0, "counters": counters, "warmup_errors": 0}


def _approx(rates: list[float | None]) -> list:
    return [None if r is None else pytest.approx(r) for r in rates]


def test_mixed_widths_give_exact_per_position_acceptance_and_none_where_never_proposed():
    meta = meta_info(TAUS, PROPOSED, 16, prompt_tokens=20, completion_tokens=9, e2e_s=1.0)
    rr = _as_response_records([_record(meta)])
    assert len(rr) == 1 and rr[0].block_size == 16
    assert rr[0].acceptance_lengths == TAUS and rr[0].proposed == PROPOSED
    summary = side_summary(_run([_record(meta)]))
    assert summary["per_position_acceptance"] == _approx(EXPECTED)
    assert summary["acceptance_source"] == "meta_info"
    assert summary["block_size"] == 16
    assert summary["histogram"] == [2, 0, 1, 1] + [0] * 12  # τ 1 (plain and rejected), 3, 4
    # what the histogram-only reading (every step proposing 15) made of the same reply
    hist_only = {k: v for k, v in meta.items() if not k.endswith("_per_step")}
    wrong = side_summary(_run([_record(hist_only)]))["per_position_acceptance"]
    assert wrong[:4] == _approx([2 / 4, 1.0, 0.5, 0.0]) and wrong != _approx(EXPECTED)


def test_the_bug_report_case_one_step_of_width_3_fully_accepted():
    """The reviewer's run: one step proposed 2 drafts and both were accepted (auto width 3 with a
    16-wide draft); position 3 was never proposed, so it is None, not 0."""
    meta = meta_info([3], [2], 16, prompt_tokens=20, completion_tokens=4, e2e_s=1.0)
    metrics = ServerMetrics("m", 16)
    metrics.step(3, 2)
    counters = SpecCounters.from_text(metrics.render()).stats()
    summary = side_summary(_run([_record(meta, new_tokens=4)], counters))
    assert summary["per_position_acceptance"] == [1.0, 1.0] + [None] * 13
    assert counters["per_position_acceptance"] == [1.0, 1.0] + [None] * 13
    assert (counters["drafts"], counters["draft_tokens"], counters["accepted_tokens"]) == (1, 2, 2)


def test_pooled_over_responses_and_plain_only_replies():
    """Steps pool over responses; a reply of plain steps only counts at no position."""
    a = meta_info(TAUS, PROPOSED, 16, prompt_tokens=20, completion_tokens=9, e2e_s=1.0)
    b = meta_info([2, 1, 1], [7, 7, 0], 16, prompt_tokens=20, completion_tokens=4, e2e_s=1.0)
    plain = meta_info([1, 1], [0, 0], 16, prompt_tokens=20, completion_tokens=2, e2e_s=1.0)
    records = [_record(a, "q1"), _record(b, "q2"), _record(plain, "q3")]
    # k=1: 3 of 5 steps that proposed it (q1: 0, 2 of 0, 2, 3; q2: first of two with drafts)
    # k=2: q1 steps 0 and 2 accepted it; q2's first step reached it and rejected it -> 2/3
    expected = [3 / 5, 2 / 3, 0.5] + [None] * 12
    assert side_summary(_run(records))["per_position_acceptance"] == _approx(expected)
    only_plain = side_summary(_run([_record(plain, "q3")]))
    assert only_plain["per_position_acceptance"] == [None] * 15
    assert only_plain["histogram"][0] == 2


def test_metrics_counters_match_the_meta_info_figures_under_mixed_widths():
    metrics = ServerMetrics("m", 16)
    for a, p in zip(TAUS, PROPOSED, strict=True):
        metrics.step(a, p)
    text = metrics.render()
    assert 'vllm:spec_decode_num_drafts_per_pos_total{model_name="m",position="2"} 2' in text
    counters = SpecCounters.from_text(text)
    assert counters.reached[:4] == [3, 2, 2, 0] and counters.per_pos[:4] == [2, 2, 1, 0]
    stats = counters.stats()
    assert stats["per_position_acceptance"] == _approx(EXPECTED)
    assert (stats["drafts"], stats["draft_tokens"], stats["accepted_tokens"]) == (3, 19, 5)
    # a scrape taken before the run is subtracted position by position
    total = ServerMetrics("m", 16)
    total.step(2, 15)  # an earlier request
    for a, p in zip(TAUS, PROPOSED, strict=True):
        total.step(a, p)
    earlier = ServerMetrics("m", 16)
    earlier.step(2, 15)
    delta = SpecCounters.from_text(total.render()).minus(SpecCounters.from_text(earlier.render()))
    assert delta.reached[:4] == [3, 2, 2, 0]
    assert delta.stats()["per_position_acceptance"] == _approx(EXPECTED)
    # /metrics is the source when meta_info is absent
    summary = side_summary(_run([RemoteRecord("gsm8k", "q", 0, "dflash", True, new_tokens=3)],
                                stats))  # fmt: skip
    assert summary["per_position_acceptance"] == _approx(EXPECTED)
    assert summary["acceptance_source"] == "/metrics"


def test_servers_without_the_new_fields_keep_the_fixed_width_reading():
    """SGLang (histogram only) and vLLM (no num_drafts_per_pos): one width for every step."""
    sglang = {"spec_accept_length": 3.0, "spec_verify_ct": 3,
              "spec_accept_histogram": [1, 0, 1, 0, 1] + [0] * 11}  # fmt: skip
    stats = meta_stats(sglang)
    assert stats["accept_lengths"] is None and stats["proposed"] is None
    rates = side_summary(_run([_record(sglang)]))["per_position_acceptance"]
    # 3 steps proposing 15 each, accepting 0, 2, 4
    assert rates[:5] == _approx([2 / 3, 1.0, 0.5, 1.0, 0.0]) and rates[5] is None
    vllm = SpecCounters(drafts=10, draft_tokens=30, accepted=12, per_pos=[8, 4, 0])
    assert vllm.stats()["per_position_acceptance"] == _approx([0.8, 0.5, 0.0])


@pytest.mark.parametrize(
    "bad",
    [
        {"spec_accept_length_per_step": [4, 1], "spec_proposed_drafts_per_step": [3]},
        {"spec_accept_length_per_step": [5], "spec_proposed_drafts_per_step": [3]},  # τ > width
        {"spec_accept_length_per_step": [0], "spec_proposed_drafts_per_step": [3]},
        {"spec_accept_length_per_step": [2.0], "spec_proposed_drafts_per_step": [3]},
        {"spec_accept_length_per_step": [2], "spec_proposed_drafts_per_step": None},
    ],
)
def test_inconsistent_per_step_lists_are_ignored(bad):
    stats = meta_stats({"spec_accept_length": 2.0, "spec_verify_ct": 1,
                        "spec_accept_histogram": [0, 1, 0, 0], **bad})  # fmt: skip
    assert stats["accept_lengths"] is None and stats["proposed"] is None
    assert stats["histogram"] == [0, 1, 0, 0]


# ---------------------------------------------------------------------------------------------
# dflash serve's app, auto width, with a scripted pipeline


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


class _Backend:
    use_graphs = False
    max_context = 4096


class _AutoPipe:
    """Resolves the block size to auto (trained L = 16) and streams the scripted steps."""

    block_size = 16
    stop_ids: list[int] = []

    def __init__(self):
        self.backend, self.tokenizer, self.widths = _Backend(), _Tokenizer(), []

    def resolve_block_size(self, value):
        assert value is None
        return "auto"

    def calibrate(self):
        pass

    def chat_prompt(self, messages, template_kwargs=None):
        return [1, 2, 3]

    def stream(self, ids, block_size, max_new_tokens, sampling, stop_ids):
        self.widths.append(block_size)
        yield RoundResult([0], None)  # the token sampled after prefill
        for i, (a, p) in enumerate(zip(TAUS, PROPOSED, strict=True)):
            last = i == len(TAUS) - 1
            yield RoundResult(list(range(a)), a, p, "length" if last else None)


def test_serve_meta_info_and_metrics_under_auto_width_feed_the_benchmark_exactly():
    pytest.importorskip("fastapi")
    from starlette.testclient import TestClient

    from dflash.serve.engine import Engine
    from dflash.serve.server import build_app
    from tests.helpers.openai_replay import sse_data

    pipe = _AutoPipe()
    engine = Engine(lambda: pipe, ["demo"], block_size=None)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10,
            "return_meta_info": True}  # fmt: skip
    with TestClient(build_app(engine)) as client:
        deadline = time.monotonic() + 30
        while client.get("/health").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        before = SpecCounters.from_text(client.get("/metrics").text)
        whole = client.post("/v1/chat/completions", json=body)
        assert whole.status_code == 200, whole.text
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_data(r)
        after = SpecCounters.from_text(client.get("/metrics").text)
    assert pipe.widths == ["auto", "auto"]
    streamed = extract_meta(json.loads(events[-2]))
    meta = extract_meta(whole.json())
    for m in (meta, streamed):
        assert m["spec_accept_length_per_step"] == TAUS
        assert m["spec_proposed_drafts_per_step"] == PROPOSED
        assert m["spec_num_proposed_drafts"] == sum(PROPOSED) and m["spec_verify_ct"] == 4
        assert m["block_size"] == 16 and len(m["spec_accept_histogram"]) == 16
    counters = after.minus(before).stats()
    assert counters["drafts"] == 2 * 3 and counters["draft_tokens"] == 2 * sum(PROPOSED)
    assert counters["per_position_acceptance"] == _approx(EXPECTED)
    summary = side_summary(_run([_record(meta, "q1"), _record(streamed, "q2")], counters))
    assert summary["per_position_acceptance"] == _approx(EXPECTED)
    assert summary["acceptance_source"] == "meta_info and /metrics"


def test_summary_counts_prompts_and_requests_apart():
    """A multi-turn prompt sends one request a turn: the summary counts both (the printed
    summary says "Num prompts" and, when they differ, "Num requests")."""
    recs = [RemoteRecord("mt-bench", "q1", 0, "dflash", True, new_tokens=3),
            RemoteRecord("mt-bench", "q1", 1, "dflash", True, new_tokens=4),
            RemoteRecord("mt-bench", "q2", 0, "dflash", False, error="boom", error_kind="http")]  # fmt: skip
    summary = side_summary(_run(recs))
    assert (summary["prompts"], summary["requests"], summary["ok"]) == (2, 3, 2)
