"""The server on a real tiny Qwen3 (paged engine): through the openai client, a greedy chat completion has the
token ids of ``python -m jaxrl_async.generate`` for the same message and the log-probs of ``score`` on those tokens;
seeds, n and streaming on the real sampler."""
from __future__ import annotations

import json

import pytest
from serve_helpers import make_model_dir, running_server

MSG = [{"role": "user", "content": "the cat sat"}]


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
                                       prefill_buckets=(64,), page_size=16, num_pages=64), cfg)
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
