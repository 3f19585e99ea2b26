"""The server on a real tiny Qwen3 (paged engine): through the openai client, a greedy chat completion has the
token ids of ``python -m jaxrl_async.generate`` for the same message and the log-probs of ``score`` on those tokens;
seeds, n and streaming on the real sampler; top_logprobs (chat) and logprobs: k (completions) equal to the trainer
forward's log-softmax, in OpenAI's shapes, streamed too, and refused above --max-top-logprobs."""
from __future__ import annotations

import json

import pytest
from serve_helpers import make_model_dir, running_server

MSG = [{"role": "user", "content": "the cat sat"}]
TOP_MAX = 8  # the server's --max-top-logprobs


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from transformers import AutoTokenizer

    from jaxrl_async.data.tokenizer import stop_token_ids
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.generator.orchestrator import Generator
    from jaxrl_async.models import load_hf
    from jaxrl_async.serve.backend import ServeBackend

    d = make_model_dir(str(tmp_path_factory.mktemp("tiny")))
    tok = AutoTokenizer.from_pretrained(d)
    cfg, params = load_hf(d)
    engine = build_engine(EngineConfig(max_concurrent_decodes=4, max_sequence_length=128, max_prefill_length=64,
                                       prefill_buckets=(64,), page_size=16, num_pages=64,
                                       max_top_logprobs=TOP_MAX), cfg)
    params = engine.place_params(params)
    with Generator(engine, params, tokenizer=tok) as gen:
        backend = ServeBackend(gen, tok, model_name="tiny", vocab_size=cfg.vocab_size,
                               eos_ids=stop_token_ids(cfg, tok, d))
        with running_server(backend) as url:
            yield {"dir": d, "url": url, "cfg": cfg, "params": params, "tok": tok}


def client(served):
    import openai

    return openai.OpenAI(base_url=served["url"], api_key="none", max_retries=0, timeout=60)


def test_greedy_chat_equals_generate_and_its_logprobs_equal_score(served, tmp_path):
    from jaxrl_async.cli import generate
    from jaxrl_async.cli.score import ScoreItem, score_items

    r = client(served).chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=12, logprobs=True)
    ids = r.choices[0].model_extra["token_ids"]
    prompt = r.model_extra["prompt_token_ids"]
    assert len(ids) >= 1
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text(json.dumps({"prompt": MSG[0]["content"]}) + "\n")
    assert generate.main(["--model", served["dir"], "--input", str(inp), "--output", str(out), "--temperature", "0",
                          "--max-new-tokens", "12", "--max-concurrent", "1"]) == 0
    row = json.loads(out.read_text())
    assert row["completion_ids"] == ids
    assert r.choices[0].message.content == row["text"]
    # behaviour log-probs of greedy decoding: log-softmax of the raw logits, the trainer's / score's numbers
    lps = [e.logprob for e in r.choices[0].logprobs.content]
    assert lps == r.choices[0].model_extra["token_logprobs"]
    scored = score_items(served["params"], served["cfg"], [ScoreItem(1, prompt, ids)], temperature=1.0)[1][0]
    assert lps == pytest.approx(scored, abs=1e-4)
    assert r.model_extra["policy_version"] == 0 and r.choices[0].model_extra["policy_versions"] == [0] * len(ids)


def test_seed_n_and_stream_on_the_real_sampler(served):
    c = client(served)
    kw = dict(model="tiny", messages=MSG, temperature=1.0, max_tokens=8, extra_body={"ignore_eos": True})
    a = c.chat.completions.create(**kw, seed=7, n=2)
    b = c.chat.completions.create(**kw, seed=7, n=2)
    ids_a = [ch.model_extra["token_ids"] for ch in a.choices]
    assert ids_a == [ch.model_extra["token_ids"] for ch in b.choices]  # same seed, same samples
    assert ids_a[0] != ids_a[1] and all(len(x) == 8 for x in ids_a)  # the n samples differ
    other = c.chat.completions.create(**kw, seed=8)
    assert other.choices[0].model_extra["token_ids"] != ids_a[0]
    # streamed greedy text and tokens equal the non-streamed ones
    g = c.chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=10)
    chunks = list(c.chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=10, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    ids = [t for ch in chunks if ch.choices for t in ch.choices[0].model_extra.get("token_ids", [])]
    assert text == g.choices[0].message.content and ids == g.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == len(ids)


def reference_top(served, prompt, ids, temperature, k):
    """The k largest log_softmax(logits / T) of the trainer forward at each position that predicted a token of
    `ids` after `prompt`, [len(ids), k] descending."""
    import jax
    import numpy as np

    from jaxrl_async.models import apply

    seq = np.asarray([prompt + ids], np.int32)
    logits = apply(served["params"], served["cfg"], seq)[0, len(prompt) - 1:len(prompt) + len(ids) - 1]
    lsm = np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))
    return -np.sort(-lsm, axis=1)[:, :k]


def test_chat_top_logprobs_equal_the_trainer_forward(served):
    import numpy as np

    c = client(served)
    for temperature in (0.0, 0.7):
        r = c.chat.completions.create(model="tiny", messages=MSG, temperature=temperature, max_tokens=10, seed=3,
                                      logprobs=True, top_logprobs=5, extra_body={"ignore_eos": True})
        ch = r.choices[0]
        content = ch.logprobs.content
        ids, prompt = ch.model_extra["token_ids"], r.model_extra["prompt_token_ids"]
        assert len(content) == len(ids) == 10
        tops = np.asarray([[t.logprob for t in e.top_logprobs] for e in content])
        assert tops.shape == (10, 5) and np.all(np.diff(tops, axis=1) <= 0)
        ref = reference_top(served, prompt, ids, temperature or 1.0, 5)
        np.testing.assert_allclose(tops, ref, rtol=0, atol=1e-5)
        for e in content:
            assert all(t.bytes == list(t.token.encode()) for t in e.top_logprobs)
            if temperature == 0:  # greedy: the top-1 entry is the token and its log-prob, exactly
                assert (e.top_logprobs[0].token, e.top_logprobs[0].logprob) == (e.token, e.logprob)
            else:  # sampled: the token's log-prob is at most the top-1, and above the 5th it is an entry, exactly
                assert e.logprob <= e.top_logprobs[0].logprob
                if e.logprob > e.top_logprobs[-1].logprob:  # (the tiny tokenizer decodes several ids to "")
                    assert any((t.token, t.logprob) == (e.token, e.logprob) for t in e.top_logprobs)
        # the same request streamed: the same entries, chunk by chunk
        chunks = list(c.chat.completions.create(model="tiny", messages=MSG, temperature=temperature, max_tokens=10,
                                                seed=3, logprobs=True, top_logprobs=5, stream=True,
                                                extra_body={"ignore_eos": True}))
        streamed = [e for k in chunks if k.choices and k.choices[0].logprobs for e in k.choices[0].logprobs.content]
        assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # none asked: empty lists, as OpenAI
    r = c.chat.completions.create(model="tiny", messages=MSG, temperature=0, max_tokens=3, logprobs=True)
    assert all(e.top_logprobs == [] for e in r.choices[0].logprobs.content)


def test_completion_logprobs_k_and_the_limits(served):
    import numpy as np
    import openai

    c = client(served)
    r = c.completions.create(model="tiny", prompt="the cat", temperature=0, max_tokens=6, logprobs=3,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids, prompt = r.choices[0].model_extra["token_ids"], r.choices[0].model_extra["prompt_token_ids"]
    assert len(lp.top_logprobs) == len(lp.tokens) == 6
    ref = reference_top(served, prompt, ids, 1.0, 3)
    for j, d in enumerate(lp.top_logprobs):
        assert isinstance(d, dict) and 1 <= len(d) <= 4  # the 3 alternatives (tokens decoding alike share one)
        assert d[lp.tokens[j]] == lp.token_logprobs[j] == max(d.values())  # greedy: the token is the top-1
        np.testing.assert_allclose(sorted(d.values(), reverse=True), ref[j, :len(d)], rtol=0, atol=1e-5)
    events = list(c.completions.create(model="tiny", prompt="the cat", temperature=0, max_tokens=6, logprobs=3,
                                       stream=True, extra_body={"ignore_eos": True}))
    assert [d for e in events for d in e.choices[0].logprobs.top_logprobs] == lp.top_logprobs
    # above the server's --max-top-logprobs (and OpenAI's 20): 400 naming the field and the limit
    for kw, field, limit in (({"top_logprobs": TOP_MAX + 1}, "top_logprobs", f"at most {TOP_MAX}"),
                             ({"top_logprobs": 21}, "top_logprobs", "[0, 20]")):
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="tiny", messages=MSG, max_tokens=2, logprobs=True, **kw)
        assert e.value.body["param"] == field and limit in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="tiny", prompt="the cat", max_tokens=2, logprobs=TOP_MAX + 1)
    assert e.value.body["param"] == "logprobs" and f"at most {TOP_MAX}" in e.value.body["message"]
