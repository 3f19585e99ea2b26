"""`python -m jaxrl_async.score`: log-probs equal transformers' log-softmax at the completion positions."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import transformers

from jaxrl_async.cli import score
from jaxrl_async.testing import make_tiny_hf_model, make_tiny_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("m"))
    make_tiny_hf_model(d, "qwen3")
    make_tiny_tokenizer(d)
    return d


def _write(path, rows):
    with open(path, "w") as fh:
        for r in rows:
            fh.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def _reference(model_dir, prompt, completion):
    m = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logp = torch.log_softmax(m(input_ids=ids).logits.double(), -1)[0]
    p = len(prompt)
    return np.array([logp[p + k - 1, t].item() for k, t in enumerate(completion)])


def test_score_matches_transformers(model_dir, tmp_path):
    rng = np.random.default_rng(0)
    rows = [{"prompt_ids": rng.integers(3, 256, int(rng.integers(1, 30))).tolist(),
             "completion_ids": rng.integers(3, 256, int(rng.integers(1, 40))).tolist()} for _ in range(9)]
    rows.append({"prompt": "What is 2+3?", "completion": " It is 5."})
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, rows)
    assert score.main(["--model", model_dir, "--input", str(inp), "--output", str(out), "--batch-tokens", "64"]) == 0
    got = [json.loads(l) for l in open(out)]
    assert [g["row"] for g in got] == list(range(1, len(rows) + 1))  # line numbers
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    worst = 0.0
    for r, g in zip(rows, got):
        if "prompt" in r:
            p, c = (tok(r["prompt"], add_special_tokens=False)["input_ids"],
                    tok(r["completion"], add_special_tokens=False)["input_ids"])
        else:
            p, c = r["prompt_ids"], r["completion_ids"]
        ref = _reference(model_dir, p, c)
        assert len(g["logprobs"]) == len(c) == len(g["entropy"])
        worst = max(worst, float(np.abs(np.array(g["logprobs"]) - ref).max()))
        assert all(e >= 0 for e in g["entropy"])
    assert worst <= 1e-5, worst


@pytest.mark.parametrize("row,needle", [
    ({"prompt_ids": [5, 6]}, "missing field 'completion_ids'"),
    ({"prompt_ids": [5, 6], "completion_ids": []}, "empty completion"),
    ({"prompt_ids": [5, 6], "completion_ids": [7, 999]}, "token id 999 outside the vocabulary"),
    ({"prompt_ids": [5] * 600, "completion_ids": [7]}, "longer than the model maximum 512"),
    ({"prompt": "hi"}, "missing field 'completion'"),
    ("{not json", "invalid JSON"),
])
def test_bad_rows(model_dir, tmp_path, capsys, row, needle):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    good = {"prompt_ids": [5, 6], "completion_ids": [7, 8]}
    _write(inp, [good, row, good])
    assert score.main(["--model", model_dir, "--input", str(inp), "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"score: error: {inp}: row 2: ") and needle in err and err.count("\n") == 1, err
    assert score.main(["--model", model_dir, "--input", str(inp), "--output", str(out), "--skip-bad-rows"]) == 0
    assert [json.loads(l)["row"] for l in open(out)] == [1, 3]
    assert "skipped 1 bad rows" in capsys.readouterr().err


def test_module_entry_point(model_dir, tmp_path):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt_ids": [5, 6, 7], "completion_ids": [8, 9]}])
    r = subprocess.run([sys.executable, "-m", "jaxrl_async.score", "--model", model_dir, "--input", str(inp),
                        "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert len(json.loads(open(out).read())["logprobs"]) == 2


def test_demo_builds_everything_locally(tmp_path):
    assert score.main(["--demo", str(tmp_path)]) == 0
    rows = [json.loads(l) for l in open(tmp_path / "scores.jsonl")]
    assert len(rows) == 3 and all(len(r["logprobs"]) == len(r["entropy"]) > 0 for r in rows)
    assert all(lp < 0 for r in rows for lp in r["logprobs"])
    transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))  # a real HF directory


def test_text_rows_use_the_chat_template_by_default(tmp_path, capsys):
    """Text rows are encoded as generate/evaluate build prompts: the chat template by default (one line's note
    and raw text when the tokenizer has none: see test_score_matches_transformers), --no-chat-template: raw."""
    from jaxrl_async.data.tokenizer import build_tokenizer
    from jaxrl_async.cli.generate import encode_prompt

    d = build_tokenizer(str(tmp_path / "m"), kind="arithmetic")
    tok = transformers.AutoTokenizer.from_pretrained(d)
    make_tiny_hf_model(d, "qwen3", vocab_size=len(tok))
    q, c = "What is 2+3?", " \\boxed{5}"
    comp = tok(c, add_special_tokens=False)["input_ids"]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    _write(inp, [{"prompt": q, "completion": c},
                 {"prompt_ids": encode_prompt(tok, q, chat=True), "completion_ids": comp},
                 {"prompt_ids": encode_prompt(tok, q, chat=False), "completion_ids": comp}])
    assert encode_prompt(tok, q, chat=True) != encode_prompt(tok, q, chat=False)
    for flags, same_as in (([], 1), (["--no-chat-template"], 2)):
        assert score.main(["--model", d, "--input", str(inp), "--output", str(out)] + flags) == 0
        got = [json.loads(l)["logprobs"] for l in open(out)]
        assert np.allclose(got[0], got[same_as], atol=1e-6) and not np.allclose(got[1], got[2], atol=1e-3)
    assert "note" not in capsys.readouterr().err
