"""`python -m jaxrl_async.evaluate`: pass@k arithmetic, evaluate_params on a scripted generator with the math
reward, the CLI end to end on a tiny exported model, and clear errors for bad paths/rows/options."""
import json
import shutil

import pytest

from fakes import DoneHandle, request, sample
from jaxrl_async.cli import evaluate
from jaxrl_async.cli.evaluate import EvalResult, ItemResult, evaluate_params, pass_at_k, report_ks
from jaxrl_async.rewards.math_reward import MathReward
from jaxrl_async.rollout.workflow import derive_seed


# -- metrics ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, c, k, expected", [
    (4, 1, 1, 0.25), (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    (4, 1, 4, 1.0), (4, 0, 2, 0.0), (4, 4, 1, 1.0), (5, 2, 2, 0.7),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
])
def test_pass_at_k(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_validation_and_reported_ks():
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    with pytest.raises(ValueError):
        pass_at_k(4, 1, 5)
    assert report_ks(1) == [1] and report_ks(4) == [1, 2, 4] and report_ks(6) == [1, 2, 4, 6]


def test_eval_result_summary_and_table():
    items = [ItemResult("a", "p", "1", ["x"] * 2, [1.0, 0.0], ["stop", "length"], [3, 5]),
             ItemResult("b", "p", "2", ["y"] * 2, [0.0, 0.0], ["stop", "stop"], [1, 1])]
    s = EvalResult(items, 2, elapsed_s=2.0).summary()
    assert (s["pass@1"], s["pass@2"], s["mean_reward"], s["truncated_fraction"]) == (0.25, 0.5, 0.25, 0.25)
    assert (s["generated_tokens"], s["mean_completion_tokens"], s["tokens_per_s"]) == (10, 2.5, 5.0)
    table = EvalResult(items, 2, elapsed_s=2.0).table()
    assert "pass@1 (mean over 2 samples)  0.2500" in table and "pass@2" in table and "25.0 %" in table


# -- evaluate_params on a scripted generator ------------------------------------------------------------
class ScriptedGenerator:
    """Answers request i (the i-th record) with the texts script[i]; all tokens tagged version 7."""

    error = None

    def __init__(self, script):
        self.script, self.requests = script, []

    def submit(self, prompt_ids, sampling=None, request_id=None, metadata=None):
        i = int(request_id.rsplit("-", 1)[1])
        self.requests.append((i, list(prompt_ids), sampling))
        texts = self.script[i]
        assert len(texts) == sampling.n
        return DoneHandle(request([sample(k, list(prompt_ids), [5] * (k + 1), versions=[7] * (k + 1),
                                          finish_reason="stop" if k else "length", text=t)
                                   for k, t in enumerate(texts)]))


def test_evaluate_params_math_reward_pass_at_k():
    records = [{"id": "a", "prompt": "1+1?", "prompt_ids": [1, 2], "answer": "2", "metadata": {"source": "x:1"}},
               {"id": "b", "prompt": "half of 3?", "prompt_ids": [3], "answer": "3/2"},
               {"id": "c", "prompt": "2*3?", "prompt_ids": [4], "answer": "6"}]
    script = {0: ["\\boxed{2}", "\\boxed{3}", "it is 5", "no idea"],  # 1 of 4 correct
              1: ["\\boxed{\\frac{3}{2}}", "\\boxed{1.5}", "so \\boxed{3/2}.", "\\boxed{\\dfrac{3}{2}}"],  # 4 of 4
              2: ["\\boxed{5}", "\\boxed{7}", "\\boxed{-6}", "6 is wrong, \\boxed{60}"]}  # 0 of 4
    gen = ScriptedGenerator(script)
    with MathReward() as reward:
        res = evaluate_params(None, None, None, records, reward, n=4, temperature=0.6, max_new_tokens=32, seed=11,
                              generator=gen, stop_token_ids=(9,))
    assert [r.rewards for r in res.items] == [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    assert res.pass_at_1 == pytest.approx((0.25 + 1 + 0) / 3)
    assert res.pass_at(2) == pytest.approx((0.5 + 1 + 0) / 3) and res.pass_at_n == pytest.approx(2 / 3)
    assert res.versions == (7, 7) and res.n == 4
    sp = {i: s for i, _, s in gen.requests}
    assert all(sp[i].seed == derive_seed(11, i) and sp[i].n == 4 and sp[i].temperature == 0.6 for i in range(3))
    assert sp[0].stop_token_ids == (9,) and sp[0].max_new_tokens == 32
    row = next(res.rows())
    assert (row["id"], row["answer"], row["rewards"], row["correct"], row["pass@1"]) == \
        ("a", "2", [1.0, 0.0, 0.0, 0.0], [True, False, False, False], 0.25)
    assert row["finish_reasons"] == ["length", "stop", "stop", "stop"] and row["completion_tokens"] == [1, 2, 3, 4]


def test_evaluate_params_rejects_bad_records():
    with pytest.raises(ValueError, match="record 1 \\(id 'b'\\) has no prompt_ids"):
        evaluate_params(None, None, None, [{"id": "a", "prompt_ids": [1]}, {"id": "b", "prompt_ids": []}],
                        lambda *a, **k: 0.0, n=1, temperature=0, max_new_tokens=4, seed=0,
                        generator=ScriptedGenerator({}))


# -- CLI end to end on a tiny exported model ------------------------------------------------------------
def parity_reward(prompt, completion, answer, **metadata):
    """Deterministic in the completion text, so the test can recompute every reward."""
    return float(len(completion) % 2 == 0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoTokenizer

    from jaxrl_async.data.tokenizer import build_tokenizer
    from jaxrl_async.testing import make_tiny_hf_model

    d = build_tokenizer(str(tmp_path_factory.mktemp("model")), kind="arithmetic")
    make_tiny_hf_model(d, "qwen3", vocab_size=len(AutoTokenizer.from_pretrained(d)))
    return d


def write_rows(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GSM_ROWS = [{"question": f"What is {a} + {b}?", "answer": f"{a} + {b} = {a + b}\n#### {a + b}"}
            for a, b in ((2, 3), (10, 7), (40, 2))]


def test_cli_end_to_end(model_dir, tmp_path, capsys):
    data = write_rows(tmp_path / "data.jsonl", GSM_ROWS)
    out, summ = tmp_path / "results.jsonl", tmp_path / "summary.json"
    argv = ["--model", model_dir, "--data", data, "--format", "gsm8k", "--n", "3", "--temperature", "1.0",
            "--max-new-tokens", "6", "--output", str(out), "--summary-json", str(summ),
            "--reward", "test_evaluate_cli:parity_reward", "--max-concurrent", "4", "--num-pages", "32",
            "--boxed-instruction"]
    assert evaluate.main(argv) == 0
    rows = [json.loads(line) for line in open(out)]
    assert [r["id"] for r in rows] == ["data.jsonl:1", "data.jsonl:2", "data.jsonl:3"]
    assert [r["answer"] for r in rows] == ["5", "17", "42"]
    for r, q in zip(rows, GSM_ROWS):
        assert q["question"] in r["prompt"] and "\\boxed{}" in r["prompt"] and r["prompt"].startswith("<|im_start|>user")
        assert len(r["completions"]) == len(r["rewards"]) == len(r["finish_reasons"]) == 3
        assert r["rewards"] == [parity_reward("", c, "") for c in r["completions"]]
        assert r["correct"] == [x > 0.5 for x in r["rewards"]] and r["pass@1"] == sum(r["correct"]) / 3
        assert all(1 <= t <= 6 for t in r["completion_tokens"])
        assert all(f in ("stop", "length") for f in r["finish_reasons"])
        assert all(t == 6 for f, t in zip(r["finish_reasons"], r["completion_tokens"]) if f == "length")
    s = json.loads(summ.read_text())
    c = [sum(r["correct"]) for r in rows]
    assert s["items"] == 3 and s["n"] == 3 and s["samples"] == 9
    assert s["pass@1"] == pytest.approx(sum(ci / 3 for ci in c) / 3)
    assert s["pass@2"] == pytest.approx(sum(1 - (ci < 2) * (3 - ci) * (2 - ci) / 2 / 3 for ci in c) / 3)  # C(3-c,2)/C(3,2)
    assert s["pass@3"] == pytest.approx(sum(ci > 0 for ci in c) / 3)
    assert s["mean_reward"] == pytest.approx(sum(sum(r["rewards"]) for r in rows) / 9)
    assert s["generated_tokens"] == sum(sum(r["completion_tokens"]) for r in rows)
    assert s["policy_versions"] == [0, 0]
    table = capsys.readouterr().out
    assert f"pass@1 (mean over 3 samples)  {s['pass@1']:.4f}" in table and "pass@3" in table


@pytest.mark.parametrize("case, message", [
    ("no_model_dir", "--model {tmp}/missing: not found"),
    ("no_config", "no config.json"),
    ("truncated", "--model {tmp}/trunc: cannot load the weights: {tmp}/trunc/model.safetensors: tensor"),
    ("no_tokenizer", "--model {tmp}/notok: no tokenizer files"),
    ("no_data", "--data {tmp}/nope.jsonl: file not found"),
    ("bad_row", "data.jsonl: row 2: [gsm8k] gsm8k field 'answer' has no '#### <number>' final-answer marker"),
    ("bad_json", "data.jsonl: row 1: [gsm8k] invalid JSON"),
    ("bad_reward", "--reward nonexistent: unknown reward 'nonexistent'"),
    ("empty", "no usable rows"),
    ("ambiguous", "--format auto: ambiguous format: {tmp}/data.jsonl: row 1 looks like gsm8k but {tmp}/data.jsonl: "
                  "row 2 looks like generic; pass --format"),
])
def test_cli_errors(case, message, model_dir, tmp_path, capsys):
    data = write_rows(tmp_path / "data.jsonl", GSM_ROWS)
    model, extra = model_dir, ["--format", "gsm8k"]
    if case == "no_model_dir":
        model = str(tmp_path / "missing")
    elif case == "no_config":
        model = str(tmp_path)
    elif case == "truncated":
        model = shutil.copytree(model_dir, tmp_path / "trunc")
        with open(model / "model.safetensors", "r+b") as fh:
            fh.truncate(fh.seek(0, 2) // 2)
    elif case == "no_tokenizer":
        model = tmp_path / "notok"
        model.mkdir()
        for f in ("config.json", "model.safetensors"):
            shutil.copy(f"{model_dir}/{f}", model)
    elif case == "no_data":
        data = str(tmp_path / "nope.jsonl")
    elif case == "bad_row":
        write_rows(tmp_path / "data.jsonl", [GSM_ROWS[0], {"question": "q", "answer": "no marker"}])
    elif case == "bad_json":
        write_rows(tmp_path / "data.jsonl", ['{"question": '])
    elif case == "bad_reward":
        extra += ["--reward", "nonexistent"]
    elif case == "empty":
        extra += ["--max-prompt-length", "2"]  # every prompt is longer: all dropped
    elif case == "ambiguous":
        write_rows(tmp_path / "data.jsonl", [GSM_ROWS[0], {"prompt": "1+1?", "answer": "2"}])
        extra = []
    argv = ["--model", str(model), "--data", data] + extra
    assert evaluate.main(argv) == 2
    err = capsys.readouterr().err
    assert message.format(tmp=tmp_path) in err, err
    assert err.strip().splitlines()[-1].startswith("evaluate: error: ") and "Traceback" not in err


def test_cli_without_chat_template_falls_back_to_raw_text(model_dir, tmp_path, capsys):
    """A tokenizer without a chat template: a one-line note, the raw problem text as the prompt."""
    from jaxrl_async.testing import make_tiny_tokenizer

    model = str(tmp_path / "plain")
    make_tiny_tokenizer(model)
    for f in ("config.json", "model.safetensors"):
        shutil.copy(f"{model_dir}/{f}", model)
    data = write_rows(tmp_path / "data.jsonl", GSM_ROWS[:1])
    out = tmp_path / "r.jsonl"
    assert evaluate.main(["--model", model, "--data", data, "--n", "1", "--max-new-tokens", "2",
                          "--output", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"evaluate: note: the tokenizer in {model} has no chat template; prompts are used as raw text" in err
    assert "evaluate: format gsm8k (detected from the columns" in err  # no --format given
    assert json.loads(out.read_text())["prompt"] == GSM_ROWS[0]["question"]


def test_reward_failures_are_reported(capsys):
    from jaxrl_async.rewards.registry import SafeReward

    def boom(prompt, completion, answer, **kw):
        raise RuntimeError("bad reward")

    r = SafeReward(boom, name="boom")
    assert r("p", "c", "a") == 0.0 and r("p", "c", "a") == 0.0
    evaluate._report_reward_failures(r)
    err = capsys.readouterr().err
    assert "failed on 2 of 2 samples" in err and "boom raised RuntimeError: bad reward" in err


def test_cli_rejects_bad_options(model_dir, tmp_path):
    for bad in (["--n", "0"], ["--temperature", "-1"], ["--top-p", "0"], ["--max-items", "0"]):
        with pytest.raises(SystemExit) as e:
            evaluate.main(["--model", model_dir, "--data", "x.jsonl"] + bad)
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--model", model_dir, "--data", "x.jsonl", "--boxed-instruction", "--prompt-suffix", "x"])
    assert e.value.code == 2


# -- a run's prompt recipe (issue 31 item 6): `evaluate` on a run's export prompts as the run did --------------
def _run_config_dict(**data):
    """to_dict of a gsm8k run config whose data section has ``data``, with the parity reward, 5 new tokens in
    the held-out evaluation and a stop string."""
    from jaxrl_async.config import RunConfig, to_dict

    d = to_dict(RunConfig(seed=7))
    d["data"].update(task="dataset", format="gsm8k", **data)
    d["rollout"]["reward"] = "test_evaluate_cli:parity_reward"
    d["rollout"]["sampling"].update(max_new_tokens=9, stop_strings=["}}"])
    d["eval"].update(max_new_tokens=5)
    return d


def _export_with_recipe(model_dir, tmp_path, config):
    from jaxrl_async.data.recipe import write_run_recipe

    run = tmp_path / "run"
    hf = shutil.copytree(model_dir, run / "hf")
    assert write_run_recipe(str(hf), config, run_dir=str(run), step=3) == str(hf / "jaxrl_async_run.json")
    return str(run), str(hf)


def _prompts(argv):
    """The settings and records ``evaluate`` would evaluate with ``argv`` (nothing generated)."""
    args = evaluate.build_parser().parse_args(argv)
    settings = evaluate.resolve_settings(args)
    return settings, evaluate._load_inputs(args, settings)[1]


def test_recipe_of_a_run_config_and_its_file_round_trip(tmp_path):
    from jaxrl_async.config import RunConfig, from_dict
    from jaxrl_async.data.datasets import BOXED_INSTRUCTION
    from jaxrl_async.data.recipe import RunRecipe, find_run_recipe, run_recipe, write_run_recipe

    d = _run_config_dict(prompt_suffix=BOXED_INSTRUCTION, system_prompt="Be brief.", max_prompt_len=200)
    rc = run_recipe(d, run_dir=str(tmp_path), step=3)
    assert rc == run_recipe(from_dict(RunConfig, d), run_dir=str(tmp_path), step=3)  # a RunConfig or its dict
    assert (rc.prompt.format, rc.prompt.prompt_suffix, rc.prompt.system_prompt, rc.prompt.max_prompt_len) == \
        ("gsm8k", BOXED_INSTRUCTION, "Be brief.", 200)
    assert (rc.reward, rc.max_new_tokens, rc.stop_strings, rc.seed, rc.temperature, rc.n) == \
        ("test_evaluate_cli:parity_reward", 5, ("}}",), 7, 0.0, 1)
    assert run_recipe({**d, "data": {**d["data"], "task": "arithmetic"}}).prompt.format == "generic"
    assert RunRecipe.from_json(json.loads(json.dumps(rc.to_json()))) == rc
    write_run_recipe(str(tmp_path), d, run_dir=str(tmp_path), step=3)
    assert find_run_recipe(str(tmp_path)) == (rc, str(tmp_path / "jaxrl_async_run.json"))
    assert write_run_recipe(str(tmp_path / "x"), None) is None and write_run_recipe(str(tmp_path / "x"), {"a": 1}) is None
    assert find_run_recipe(str(tmp_path / "nothing")) is None


def test_evaluate_prompts_a_runs_export_as_the_run_did(model_dir, tmp_path, capsys):
    """No prompt flag: the export's recipe gives the prompts (token ids) the run's loader gives, its reward, its
    held-out evaluation's max_new_tokens and stop strings; one line says where the recipe came from."""
    from transformers import AutoTokenizer

    from jaxrl_async.data import load_prompt_dataset
    from jaxrl_async.data.datasets import BOXED_INSTRUCTION
    from jaxrl_async.data.recipe import run_recipe

    config = _run_config_dict(prompt_suffix=BOXED_INSTRUCTION, system_prompt="Be brief.", max_prompt_len=200)
    run, hf = _export_with_recipe(model_dir, tmp_path, config)
    data = write_rows(tmp_path / "data.jsonl", GSM_ROWS)
    out, summ = tmp_path / "r.jsonl", tmp_path / "s.json"
    assert evaluate.main(["--model", hf, "--data", data, "--n", "2", "--temperature", "1.0", "--output", str(out),
                          "--summary-json", str(summ), "--max-concurrent", "4", "--num-pages", "64"]) == 0
    err = capsys.readouterr().err
    line = [ln for ln in err.splitlines() if "prompt recipe" in ln]
    assert len(line) == 1 and line[0].startswith(f"evaluate: prompt recipe of run {run} step 3 ({hf}/jaxrl_async_run.json): "
                                                 "chat template, system prompt 'Be brief.', suffix "), err
    assert "reward test_evaluate_cli:parity_reward, <= 5 new tokens, stop strings ['}}']; the run evaluated with " \
           "--n 1 --temperature 0 --seed 7" in line[0]
    # the run's loader (loop.setup: run_recipe(cfg).prompt.dataset_config) on the same file gives the same token ids
    tok = AutoTokenizer.from_pretrained(hf)
    run_records = load_prompt_dataset(run_recipe(config).prompt.dataset_config(data), tok).records
    settings, records = _prompts(["--model", hf, "--data", data])
    assert [r.prompt_ids for r in records] == [r.prompt_ids for r in run_records]
    rows = [json.loads(x) for x in open(out)]
    assert [r["prompt"] for r in rows] == [r.prompt for r in run_records]
    assert all("Be brief." in r["prompt"] and "\\boxed{}" in r["prompt"] for r in rows)
    assert all(t <= 5 for r in rows for t in r["completion_tokens"])
    assert all(r["rewards"] == [parity_reward("", c, "") for c in r["completions"]] for r in rows)
    s = json.loads(summ.read_text())
    assert s["reward"] == "test_evaluate_cli:parity_reward" and s["prompt_recipe"] == f"{hf}/jaxrl_async_run.json"
    assert settings.stop_strings == ("}}",)


def test_flags_override_the_recipe_and_no_run_recipe_ignores_it(model_dir, tmp_path, capsys):
    from jaxrl_async.data.datasets import BOXED_INSTRUCTION

    _, hf = _export_with_recipe(model_dir, tmp_path, _run_config_dict(prompt_suffix=BOXED_INSTRUCTION,
                                                                       system_prompt="Be brief."))
    data = write_rows(tmp_path / "data.jsonl", GSM_ROWS)
    base = ["--model", hf, "--data", data]
    st, recs = _prompts(base + ["--prompt-suffix", "", "--reward", "math", "--max-new-tokens", "3", "--stop", "x"])
    assert "\\boxed" not in recs[0].prompt and "Be brief." in recs[0].prompt
    assert (st.reward, st.max_new_tokens, st.stop_strings) == ("math", 3, ("x",))
    assert "overridden by --prompt-suffix --reward --max-new-tokens --stop" in capsys.readouterr().err
    st, recs = _prompts(base + ["--no-chat-template"])
    assert recs[0].prompt == GSM_ROWS[0]["question"] + BOXED_INSTRUCTION
    st, recs = _prompts(base + ["--no-run-recipe"])
    assert "\\boxed" not in recs[0].prompt and "Be brief." not in recs[0].prompt
    assert (st.reward, st.max_new_tokens, st.stop_strings, st.source) == ("math", 1024, (), None)
    assert "evaluate: prompt recipe: the flags' (--no-run-recipe)" in capsys.readouterr().err
    _, recs = _prompts(["--model", model_dir, "--data", data])  # not a run's export: today's defaults
    assert "\\boxed" not in recs[0].prompt
    assert f"prompt recipe: the flags' ({model_dir} has no jaxrl_async_run.json: not a run's export)" in \
        capsys.readouterr().err


def test_an_older_export_finds_its_runs_config_and_a_run_dir_is_refused(model_dir, tmp_path, capsys):
    from jaxrl_async.config import RunConfig, from_dict, save_config
    from jaxrl_async.data.datasets import BOXED_INSTRUCTION

    run = tmp_path / "run"
    hf = str(shutil.copytree(model_dir, run / "hf"))  # an export without jaxrl_async_run.json, inside its run
    save_config(from_dict(RunConfig, _run_config_dict(prompt_suffix=BOXED_INSTRUCTION)), run)
    data = write_rows(tmp_path / "data.jsonl", GSM_ROWS)
    st, recs = _prompts(["--model", hf, "--data", data])
    assert st.source == str(run / "config.json") and "\\boxed{}" in recs[0].prompt
    assert f"prompt recipe of run {run} ({run}/config.json)" in capsys.readouterr().err
    (run / "checkpoints").mkdir()
    assert evaluate.main(["--model", str(run), "--data", data]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"evaluate: error: --model {run}: a jaxrl_async run directory, not a model directory; its export is {hf}")
    (tmp_path / "bad").mkdir()
    hf2 = shutil.copytree(model_dir, tmp_path / "bad" / "hf")
    (hf2 / "jaxrl_async_run.json").write_text("{}")
    assert evaluate.main(["--model", str(hf2), "--data", data]) == 2
    assert f"evaluate: error: --model {hf2}: {hf2}/jaxrl_async_run.json: not a readable jaxrl_async run recipe: " \
           "prompt missing (--no-run-recipe ignores it)" in capsys.readouterr().err
