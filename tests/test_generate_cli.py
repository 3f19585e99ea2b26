"""`python -m jaxrl_async.generate` on a tiny random Qwen3 with a local WordLevel tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from jaxrl_async.cli import generate

WORDS = "the a cat dog sat ran on under mat log red blue big small one two three and then".split()
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]  # ids 0, 1, 2, 3 (the tiny config: pad 0, bos 1, eos 2)
CHAT_TEMPLATE = ("{% for m in messages %}<bos> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}then{% endif %}")


def make_tokenizer(out_dir: str):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from jaxrl_async.testing import make_tiny_hf_model

    d = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_hf_model(d, "qwen3", vocab_size=64)  # 64 >= 24 tokenizer entries
    make_tokenizer(d)
    return d


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def torch_greedy(model_dir, prompt_ids, n_new, stop_ids=(2,)):
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt_ids)
    out = []
    with torch.no_grad():
        for _ in range(n_new):
            t = int(torch.argmax(m(torch.tensor([ids])).logits[0, -1]))
            out.append(t)
            ids.append(t)
            if t in stop_ids:
                break
    return out


def test_encode_prompt_plain_and_chat(model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    assert generate.encode_prompt(tok, "the cat sat", chat=False) == [ids["the"], ids["cat"], ids["sat"]]
    assert generate.encode_prompt(tok, "the cat", chat=True) == [ids["<bos>"], ids["the"], ids["cat"], ids["then"]]


def test_generate_cli_rows_order_n_samples_and_truncation(model_dir, tmp_path, capsys):
    rows = [{"prompt": "the cat sat on the mat"},
            {"prompt_ids": [5, 6, 7]},
            {"prompt": "a big red dog ran under the small blue log and then sat"},  # 13 tokens > 8: truncated
            {"prompt_ids": [9]},
            {"prompt": "one two three"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    out = str(tmp_path / "out.jsonl")
    rc = generate.main(["--model", model_dir, "--input", inp, "--output", out, "--max-new-tokens", "6",
                        "--temperature", "0", "--n", "2", "--max-concurrent", "3", "--max-prompt-length", "8",
                        "--truncate-prompts", "--page-size", "4", "--no-chat-template"])
    err = capsys.readouterr().err
    assert rc == 0, err
    assert "truncated 1 prompt(s) to their last 8 tokens" in err
    res = read_jsonl(out)
    assert [(r["row"], r["sample_index"]) for r in res] == [(i, k) for i in range(1, 6) for k in range(2)]
    for r in res:  # the prompt as given is echoed
        given = rows[r["row"] - 1]
        assert {k: r[k] for k in given} == given and not ({"prompt", "prompt_ids"} - set(given)) & set(r)
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    prompts = [[vocab[w] for w in "the cat sat on the mat".split()], [5, 6, 7],
               [vocab[w] for w in "a big red dog ran under the small blue log and then sat".split()][-8:], [9],
               [vocab[w] for w in "one two three".split()]]
    for r in res:
        expect = torch_greedy(model_dir, prompts[r["row"] - 1], 6)
        assert r["completion_ids"] == expect, r  # greedy: both samples equal transformers' greedy
        assert len(r["logprobs"]) == len(expect) and all(lp <= 0 for lp in r["logprobs"])
        assert r["finish_reason"] == ("stop" if expect[-1] == 2 else "length")
        assert isinstance(r["text"], str)


def test_generate_cli_bad_rows_are_named(model_dir, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "bad.jsonl", [
        {"prompt_ids": [1, 2]}, "{not json", {"text": "x"}, {"prompt_ids": [1, 999]},
        {"prompt": "the cat sat on the mat and then ran"}, {"prompt_ids": []}])
    out = tmp_path / "o.jsonl"
    argv = ["--model", model_dir, "--input", inp, "--output", str(out), "--max-prompt-length", "4",
            "--no-chat-template"]
    rc = generate.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    # one line: the first bad row in full (rows are 1-based line numbers), then every bad row's number
    assert err == [f"generate: error: {inp}: row 2: invalid JSON (Expecting property name enclosed in double quotes "
                   f"at column 2) (5 bad rows in all: rows 2, 3, 4, 5, 6); nothing generated"], err
    assert not out.exists()
    for row, needle in ((3, "row 3: needs exactly one of the fields"),
                        (4, "row 4: prompt_ids [999] out of the model's vocabulary [0, 64)"),
                        (5, "row 5: prompt has 9 tokens > max prompt length 4 (pass --truncate-prompts"),
                        (6, "row 6: empty prompt")):
        lines = open(inp).read().splitlines()
        write_jsonl(tmp_path / "one.jsonl", [lines[0], lines[row - 1]])
        assert generate.main(["--input", str(tmp_path / "one.jsonl")] + argv[:2] + argv[4:]) == 2
        assert needle.replace(f"row {row}", "row 2") in capsys.readouterr().err


def test_generate_cli_module_entry_point_help():
    r = subprocess.run([sys.executable, "-m", "jaxrl_async.generate", "--help"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0 and "--truncate-prompts" in r.stdout and "--max-concurrent" in r.stdout


def test_generate_without_tokenizer_takes_ids_and_stops_only_at_real_eos(model_dir, tmp_path, capsys):
    """Weights + config only (what `save_pretrained` of a model writes): no tokenizer is invented, so the
    stop ids are config.json's / generation_config.json's EOS (2), not the empty stand-in tokenizer's EOS
    id 0, which this model samples greedily after prompt [8]."""
    import shutil

    from transformers import AutoTokenizer

    from jaxrl_async.models import ModelConfig

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "generation_config.json", "model.safetensors"):
        shutil.copy(f"{model_dir}/{f}", bare)
    invented = AutoTokenizer.from_pretrained(str(bare))  # what the old code used: EOS id 0
    assert invented.eos_token_id == 0 and not generate.is_real_tokenizer(invented)
    cfg = ModelConfig.from_hf(str(bare))
    assert generate.stop_token_ids(cfg, invented, str(bare)) == (2,)

    rows = [{"prompt_ids": [8], "id": "a"}, {"prompt_ids": [3, 4]}]
    inp, out = write_jsonl(tmp_path / "ids.jsonl", rows), tmp_path / "out.jsonl"
    assert generate.main(["--model", str(bare), "--input", inp, "--output", str(out), "--max-new-tokens", "10",
                          "--temperature", "0"]) == 0
    assert f"generate: note: {bare} has no tokenizer files: rows must give prompt_ids" in capsys.readouterr().err
    res = read_jsonl(out)
    assert [(r["row"], r.get("id"), r["prompt_ids"], r["text"]) for r in res] == [(1, "a", [8], None),
                                                                                   (2, None, [3, 4], None)]
    for r, given in zip(res, rows):
        expect = torch_greedy(model_dir, given["prompt_ids"], 10)
        assert r["completion_ids"] == expect
    assert 0 in res[0]["completion_ids"][:-1]  # token 0 sampled and generation went on

    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt_ids": [8]}, {"prompt": "the cat"}])
    assert generate.main(["--model", str(bare), "--input", text, "--output", str(out)]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"generate: error: {text}: row 2: a text prompt needs a tokenizer, but --model {bare} has no tokenizer "
        "files; give prompt_ids; nothing generated")


def test_generate_uses_the_chat_template_by_default(model_dir, tmp_path, capsys):
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "the cat"}])
    outs = {}
    for flags in (["--chat"], ["--no-chat-template"]):  # --chat: the deprecated alias of the default
        out = tmp_path / "out.jsonl"
        assert generate.main(["--model", model_dir, "--input", inp, "--output", str(out), "--max-new-tokens", "3",
                              "--temperature", "0"] + flags) == 0
        outs[flags[0]] = read_jsonl(out)[0]["completion_ids"]
    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    assert outs["--chat"] == torch_greedy(model_dir, [vocab[w] for w in "<bos> the cat then".split()], 3)
    assert outs["--no-chat-template"] == torch_greedy(model_dir, [vocab["the"], vocab["cat"]], 3)
    assert "--chat is deprecated and has no effect" in capsys.readouterr().err


def test_generate_and_evaluate_agree_on_an_exported_model(tmp_path, capsys):
    """Acceptance (issue 14): on a model directory written like the RL run's `hf/` export (weights,
    config.json, generation_config.json, a tokenizer with a chat template), `generate` and `evaluate` build
    the same prompts and stop at the same ids by default, so greedy answers are identical; `evaluate` reads
    a GSM8K-column file without --format."""
    import jax
    from transformers import AutoTokenizer

    from jaxrl_async.cli import evaluate
    from jaxrl_async.data.tokenizer import build_tokenizer
    from jaxrl_async.models import ModelConfig, init_params, save_hf

    tok_dir = build_tokenizer(str(tmp_path / "tok"), kind="arithmetic")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.chat_template
    cfg = ModelConfig(model_type="qwen3", vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0, max_position_embeddings=128,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id)
    hf = str(tmp_path / "hf")
    params = init_params(cfg, jax.random.PRNGKey(3))
    # a larger EOS embedding (tied: also its output row) makes some answers end at EOS, others at the length limit
    params["embed"] = params["embed"].at[cfg.eos_token_id].multiply(3.0)
    save_hf(params, cfg, hf, tokenizer_dir=tok_dir)

    questions = ["What is 2 + 3?", "What is 17 + 25?", "Tom has 3 apples and buys 4 more. How many now?"]
    data = tmp_path / "gsm.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": f"so\n#### {a}"}) + "\n"
                            for q, a in zip(questions, (5, 42, 7))))
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": q} for q in questions])
    gen_out, eval_out = tmp_path / "gen.jsonl", tmp_path / "eval.jsonl"
    assert generate.main(["--model", hf, "--input", prompts, "--output", str(gen_out), "--temperature", "0"]) == 0
    assert evaluate.main(["--model", hf, "--data", str(data), "--output", str(eval_out), "--temperature", "0",
                          "--n", "1"]) == 0
    err = capsys.readouterr().err
    assert "evaluate: format gsm8k (detected from the columns of 3 of the first 3 rows" in err
    gen, ev = read_jsonl(gen_out), read_jsonl(eval_out)
    assert [g["prompt"] for g in gen] == questions
    assert [e["prompt"] for e in ev] == [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                                  add_generation_prompt=True) for q in questions]
    assert [g["text"] for g in gen] == [e["completions"][0] for e in ev]
    assert [len(g["completion_ids"]) for g in gen] == [e["completion_tokens"][0] for e in ev]
    assert [g["finish_reason"] for g in gen] == [e["finish_reasons"][0] for e in ev]
    assert {g["finish_reason"] for g in gen} == {"stop", "length"}  # both endings compared (measured: 41, 36, 79)


def test_compile_cache_serves_a_second_process(model_dir, tmp_path):
    """The CLIs turn JAX's persistent compilation cache on (`compile_cache`): a first run writes the engine's compiled
    programs (decode step, prefill, ...) under JAXRL_ASYNC_COMPILE_CACHE/programs, a second run of the same shapes
    loads them (no new entry) and generates the same output; 'off' turns it off."""
    import os

    from jaxrl_async.cli import compile_cache

    cache = tmp_path / "xla"
    inp = write_jsonl(tmp_path / "in.jsonl", [{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [9]}])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update({compile_cache.ENV: str(cache), "TQDM_DISABLE": "1"})  # (not the test session's shared cache)
    outs, entries = [], []
    for k in range(2):
        out = tmp_path / f"out{k}.jsonl"
        r = subprocess.run([sys.executable, "-m", "jaxrl_async.generate", "--model", model_dir, "--input", inp,
                            "--output", str(out), "--max-new-tokens", "6", "--temperature", "1", "--max-concurrent",
                            "4"], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        outs.append(out.read_text())
        entries.append(sorted(p.name for p in (cache / "programs").iterdir()))
    # every engine program is in the program cache (`generator/program_cache.py`, under the compilation cache's
    # directory) after the first run; the second run found them all: it wrote nothing
    assert {n.rsplit("-", 1)[0] for n in entries[0]} >= {"decode_step_False", "prefill", "insert", "release", "init",
                                                          "sample_first_False"}
    assert entries[1] == entries[0]
    assert outs[0] == outs[1]
    import jax

    session_cache = jax.config.jax_compilation_cache_dir  # (the test session's own, tests/conftest.py)
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        assert compile_cache.enable("off") is None
    finally:
        jax.config.update("jax_compilation_cache_dir", session_cache)


def test_a_smaller_job_compiles_the_programs_of_a_later_bigger_one(model_dir, tmp_path):
    """The engine's shapes follow the flags and the prompts' length bucket, not the job (`for_prompts(reusable=True)`):
    after a job of 2 short prompts, a job of 4 others (other lengths, same bucket, same flags) finds every program
    in the cache: no program is compiled for other shapes."""
    import os

    from jaxrl_async.cli import compile_cache

    cache = tmp_path / "xla"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION_CACHE", "JAX_PERSISTENT_CACHE"))}
    env.update({compile_cache.ENV: str(cache), "TQDM_DISABLE": "1"})
    jobs = [[{"prompt_ids": [5, 6, 7]}, {"prompt_ids": [9]}],
            [{"prompt_ids": list(range(3, 3 + n))} for n in (11, 2, 7, 16)]]
    entries = []
    for k, rows in enumerate(jobs):
        inp = write_jsonl(tmp_path / f"in{k}.jsonl", rows)
        r = subprocess.run([sys.executable, "-m", "jaxrl_async.generate", "--model", model_dir, "--input", inp,
                            "--output", str(tmp_path / f"out{k}.jsonl"), "--max-new-tokens", "6", "--temperature",
                            "1", "--max-concurrent", "4"], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        entries.append(sorted(p.name for p in (cache / "programs").iterdir()))
        assert len(read_jsonl(tmp_path / f"out{k}.jsonl")) == len(rows)
    assert any(n.startswith("decode_step_False-") for n in entries[0])
    assert entries[1] == entries[0]  # every program of the second job was the first's


def test_cut_at_stop():
    assert generate.cut_at_stop("x = 1\n\nso", ["\n\n", "="]) == ("x ", "=")  # the earliest
    assert generate.cut_at_stop("ab</a>c", ["</", "</a>"]) == ("ab", "</a>")  # of two starting there, the longer
    assert generate.cut_at_stop("abc", ["z", ""]) == ("abc", None)


def test_stop_string_is_left_out_of_the_text_and_kept_in_the_ids(model_dir, tmp_path, capsys):
    """As OpenAI's `stop` (issue 31 item 9): the text ends before the stop string; completion_ids / logprobs keep
    every generated token up to the one completing it, finish_reason "stop", stop_string names it."""
    rows = [{"prompt": "one two three"}, {"prompt": "a big red dog"}]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    base = ["--model", model_dir, "--input", inp, "--max-new-tokens", "12", "--temperature", "0",
            "--no-chat-template", "--ignore-eos"]
    free, stopped = str(tmp_path / "free.jsonl"), str(tmp_path / "stop.jsonl")
    assert generate.main(base + ["--output", free]) == 0
    assert generate.main(base + ["--output", stopped, "--stop", "sat"]) == 0
    capsys.readouterr()
    (f1, f2), (s1, s2) = read_jsonl(free), read_jsonl(stopped)
    # measured on this tiny random model: row 1 generates "... sat ..." (cat a sat dog a), row 2 no "sat"
    assert "sat" in f1["text"] and "stop_string" not in f1
    k = f1["completion_ids"].index(8) + 1  # "sat" is id 8: the token that completes the stop string ends the sample
    assert s1["completion_ids"] == f1["completion_ids"][:k] and s1["logprobs"] == pytest.approx(f1["logprobs"][:k])
    assert s1["finish_reason"] == "stop" and s1["stop_string"] == "sat"
    assert s1["text"] == f1["text"][:f1["text"].index("sat")] and "sat" not in s1["text"]
    assert "sat" not in f2["text"] and (s2["text"], s2["finish_reason"], s2["stop_string"]) == (f2["text"], "length", None)
