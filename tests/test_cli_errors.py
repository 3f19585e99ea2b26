"""One error style for every command-line tool (issue 14): each CLI, run as users run it
(``python -m jaxrl_async.<tool>`` subprocesses), on each kind of user mistake ends with exit status 2,
one error line (the last line of stderr) naming the culprit (the path, row, field or flag), and no
traceback.

The subprocesses are independent: they all start in one module fixture, a few at a time, and each
parametrized case checks its own result (the whole file takes about a minute on 2 cores, almost all
of it Python/JAX start-up of the ~40 processes).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from jaxrl_async.testing import subprocess_xla_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


GSM = [{"question": "What is 2 + 3?", "answer": "2 + 3 = 5\n#### 5"}, {"question": "What is 1 + 1?", "answer": "#### 2"}]

# (case id, module, argv template, culprit the error line must name). Templates are formatted with the
# paths of the `files` fixture: {model} a tiny model directory with a chat-template tokenizer, {missing}
# a path that does not exist, {noconfig} a directory without config.json, {trunc} the model with its
# model.safetensors truncated to half, {t} the temporary directory.
GEN = "jaxrl_async.generate"
SCORE = "jaxrl_async.score"
EVAL = "jaxrl_async.evaluate"
CASES = [
    # generate
    ("generate-missing-model", GEN, "--model {missing} --input {t}/prompts.jsonl --output {t}/o1.jsonl",
     "--model {missing}: not found"),
    ("generate-no-config", GEN, "--model {noconfig} --input {t}/prompts.jsonl --output {t}/o1.jsonl",
     "--model {noconfig}: no config.json"),
    ("generate-truncated-weights", GEN, "--model {trunc} --input {t}/prompts.jsonl --output {t}/o1.jsonl",
     "{trunc}/model.safetensors: tensor"),
    ("generate-missing-input", GEN, "--model {model} --input {t}/nope.jsonl --output {t}/o1.jsonl",
     "--input {t}/nope.jsonl: file not found"),
    ("generate-malformed-row", GEN, "--model {model} --input {t}/prompts_bad.jsonl --output {t}/o1.jsonl",
     "{t}/prompts_bad.jsonl: row 3: invalid JSON"),
    ("generate-bad-flag", GEN, "--model {model} --input {t}/prompts.jsonl --output {t}/o1.jsonl --n 0",
     "--n must be >= 1"),
    ("generate-bad-output", GEN, "--model {model} --input {t}/prompts.jsonl --output {missing}/o.jsonl",
     "--output {missing}/o.jsonl: directory {missing} does not exist"),
    # score
    ("score-missing-model", SCORE, "--model {missing} --input {t}/score.jsonl --output {t}/o2.jsonl",
     "--model {missing}: not found"),
    ("score-no-config", SCORE, "--model {noconfig} --input {t}/score.jsonl --output {t}/o2.jsonl",
     "--model {noconfig}: no config.json"),
    ("score-truncated-weights", SCORE, "--model {trunc} --input {t}/score.jsonl --output {t}/o2.jsonl",
     "{trunc}/model.safetensors: tensor"),
    ("score-missing-input", SCORE, "--model {model} --input {t}/nope.jsonl --output {t}/o2.jsonl",
     "--input {t}/nope.jsonl: file not found"),
    ("score-malformed-row", SCORE, "--model {model} --input {t}/score_bad.jsonl --output {t}/o2.jsonl",
     "{t}/score_bad.jsonl: row 2: missing field 'completion_ids'"),
    ("score-bad-flag", SCORE, "--model {model} --input {t}/score.jsonl --output {t}/o2.jsonl --batch-tokens 0",
     "--batch-tokens must be >= 1"),
    # evaluate
    ("evaluate-missing-model", EVAL, "--model {missing} --data {t}/gsm.jsonl", "--model {missing}: not found"),
    ("evaluate-no-config", EVAL, "--model {noconfig} --data {t}/gsm.jsonl", "--model {noconfig}: no config.json"),
    ("evaluate-truncated-weights", EVAL, "--model {trunc} --data {t}/gsm.jsonl", "{trunc}/model.safetensors: tensor"),
    ("evaluate-missing-input", EVAL, "--model {model} --data {t}/nope.jsonl", "--data {t}/nope.jsonl: file not found"),
    ("evaluate-malformed-row", EVAL, "--model {model} --data {t}/gsm_bad.jsonl",
     "{t}/gsm_bad.jsonl: row 2: [gsm8k] gsm8k field 'answer' has no '#### <number>'"),
    ("evaluate-ambiguous-format", EVAL, "--model {model} --data {t}/mixed.jsonl",
     "{t}/mixed.jsonl: row 1 looks like gsm8k but {t}/mixed.jsonl: row 2 looks like generic"),
    ("evaluate-bad-flag", EVAL, "--model {model} --data {t}/gsm.jsonl --n 0", "--n must be >= 1"),
    # export
    ("export-missing-run-dir", "jaxrl_async.export", "--run-dir {missing} --out {t}/e1", "--run-dir {missing}: not found"),
    ("export-no-checkpoints", "jaxrl_async.export", "--run-dir {noconfig} --out {t}/e1",
     "{noconfig}: no checkpoints/ directory"),
    ("export-missing-step", "jaxrl_async.export", "--run-dir {t}/run --step 7 --out {t}/e1",
     "no committed checkpoint at step 7"),
    ("export-corrupt-checkpoint", "jaxrl_async.export", "--run-dir {t}/run_corrupt --out {t}/e1",
     "checkpoint step 1 is corrupt: params/"),
    ("export-out-not-empty", "jaxrl_async.export", "--run-dir {t}/run --out {model}",
     "--out {model}: directory exists and is not empty (pass --overwrite"),
    ("export-bad-flag", "jaxrl_async.export", "--run-dir {t}/run --out {t}/e1 --dtype int8",
     "argument --dtype: invalid choice: 'int8'"),
    # plan
    ("plan-missing-config", "jaxrl_async.plan", "--config {t}/nope.py", "--config: file '{t}/nope.py' does not exist"),
    ("plan-bad-key", "jaxrl_async.plan", "rollout.n_sample=3", "rollout.n_sample: unknown field"),
    ("plan-bad-layout", "jaxrl_async.plan", "--layout nope", "--layout: unknown layout 'nope'"),
    ("plan-bad-flag", "jaxrl_async.plan", "--bogus", "unknown option '--bogus'"),
    # distributed.launch (checked before any process starts)
    ("launch-missing-config", "jaxrl_async.distributed.launch", "--config {t}/nope.py",
     "--config: file '{t}/nope.py' does not exist"),
    ("launch-bad-key", "jaxrl_async.distributed.launch", "rollout.n_sample=3", "rollout.n_sample: unknown field"),
    ("launch-bad-flag", "jaxrl_async.distributed.launch", "--generators 0", "--generators must be >= 1"),
    ("launch-unknown-option", "jaxrl_async.distributed.launch", "--bogus", "unknown option '--bogus'"),
    # launch.ray (checked before connecting to a cluster)
    ("ray-missing-config", "jaxrl_async.launch.ray", "--config {t}/nope.py",
     "--config: file '{t}/nope.py' does not exist"),
    ("ray-bad-flag", "jaxrl_async.launch.ray", "--generators 0", "--generators must be >= 1"),
    ("ray-bad-resource", "jaxrl_async.launch.ray", "--trainer-resources gpu_node",
     "--trainer-resources 'gpu_node': expected KEY=NUMBER"),
    # main (the RL run)
    ("main-missing-config", "jaxrl_async.main", "--config {t}/nope.py", "--config: file '{t}/nope.py' does not exist"),
    ("main-bad-key", "jaxrl_async.main", "rollout.n_sample=3", "rollout.n_sample: unknown field"),
    ("main-missing-model", "jaxrl_async.main", "model.path={missing}", "model.path: '{missing}' has no config.json"),
    ("main-no-config", "jaxrl_async.main", "model.path={noconfig}", "model.path: '{noconfig}' has no config.json"),
    ("main-truncated-weights", "jaxrl_async.main",
     "run_dir={t}/run_trunc model.path={trunc} data.task=dataset data.train_path={t}/gsm.jsonl data.format=gsm8k",
     "{trunc}/model.safetensors: tensor"),
    ("main-missing-input", "jaxrl_async.main", "data.task=dataset data.train_path={t}/nope.jsonl",
     "data.train_path: file '{t}/nope.jsonl' does not exist"),
    ("main-malformed-row", "jaxrl_async.main",
     "run_dir={t}/run_bad model.path={model} data.task=dataset data.train_path={t}/gsm_bad.jsonl data.format=gsm8k",
     "{t}/gsm_bad.jsonl: row 2: [gsm8k]"),
    ("main-bad-flag", "jaxrl_async.main", "--bogus", "unknown option '--bogus'"),
    ("main-no-tokenizer", "jaxrl_async.main",
     "run_dir={t}/run_notok model.path={notok} data.task=dataset data.train_path={t}/gsm.jsonl data.format=gsm8k",
     "model.path: {notok} has no tokenizer files"),
    # main: settings that used to validate and then crash after the warm start (issue 24, Found 2)
    ("main-kl-coef", "jaxrl_async.main", "run_dir={t}/run_kl trainer.advantage.kl_coef=0.1",
     "trainer.advantage.kl_coef: must be 0: a KL penalty needs a reference policy"),
    ("main-short-buckets", "jaxrl_async.main", "run_dir={t}/run_len rollout.engine.max_sequence_length=256 "
     "rollout.sampling.max_new_tokens=192 model.max_position_embeddings=256",
     "trainer.packing.row_len_buckets: largest bucket 128 is shorter than rollout.engine.max_sequence_length=256"),
    ("main-sft-warmup", "jaxrl_async.main", "run_dir={t}/run_sft trainer.sft.steps=5",
     "trainer.sft.warmup_steps: must be in [0, trainer.sft.steps=5), got 10"),
    ("main-resume-never-used-dir", "jaxrl_async.main", "run_dir={t}/run checkpoint.resume=never",
     "checkpoint.resume: 'never', but {t}/run/checkpoints holds committed checkpoints (steps [1])"),
    ("main-resume-changed-seed", "jaxrl_async.main", "run_dir={t}/run_cfg seed=7",
     "seed: differs from the checkpoint this run resumes ({t}/run_cfg/checkpoints/1): seed 0 -> 7"),
    # issue 31 item 5: every import string of a config resolves at validation (--dry-run included)
    ("main-bad-reward", "jaxrl_async.main", "--dry-run rollout.reward=nope_pkg.mod:fn",
     "rollout.reward: reward 'nope_pkg.mod:fn': cannot import module 'nope_pkg.mod'"),
    ("main-bad-workflow", "jaxrl_async.main", "--dry-run rollout.workflow=json:dumps",
     "rollout.workflow: 'json:dumps' is not a RolloutWorkflow subclass"),
    ("main-param-dtype", "jaxrl_async.main", "--dry-run model.param_dtype=bfloat16",
     "model.param_dtype: bfloat16 would be ignored: the trainer keeps float32 master weights"),
    # issue 30: a KV pool beyond the host's memory names the config field and the largest value that fits
    ("main-kv-too-large", "jaxrl_async.main", "run_dir={t}/run_kv rollout.engine.num_pages=1099511627776",
     "main: error: the KV cache does not fit: 1099511627776 pages asked"),
]


def _make_files(t) -> dict[str, str]:
    from transformers import AutoTokenizer

    from jaxrl_async.checkpoint import CheckpointConfig, Checkpointer, TrainMeta
    from jaxrl_async.data.tokenizer import build_tokenizer
    from jaxrl_async.models import load_hf
    from jaxrl_async.testing import make_tiny_hf_model

    model = build_tokenizer(str(t / "model"), kind="arithmetic")  # has a chat template
    make_tiny_hf_model(model, "qwen3", vocab_size=len(AutoTokenizer.from_pretrained(model)))
    trunc = shutil.copytree(model, t / "trunc")
    notok = t / "notok"  # weights + config only, as a model's save_pretrained writes them
    notok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(os.path.join(model, f), notok / f)
    with open(trunc / "model.safetensors", "r+b") as fh:
        fh.truncate(fh.seek(0, 2) // 2)
    (t / "noconfig").mkdir()
    _write(t / "prompts.jsonl", [{"prompt": "What is 1+1?"}])
    _write(t / "prompts_bad.jsonl", [{"prompt_ids": [5, 6]}, "", '{"prompt": '])  # line 3: the blank line counts
    _write(t / "score.jsonl", [{"prompt_ids": [5, 6], "completion_ids": [7]}])
    _write(t / "score_bad.jsonl", [{"prompt_ids": [5, 6], "completion_ids": [7]}, {"prompt_ids": [5]}])
    _write(t / "gsm.jsonl", GSM)
    _write(t / "gsm_bad.jsonl", [GSM[0], {"question": "q", "answer": "no marker"}])
    _write(t / "mixed.jsonl", [GSM[0], {"prompt": "1+1?", "answer": "2"}])
    cfg, params = load_hf(model)
    with Checkpointer(str(t / "run"), CheckpointConfig(keep_last=2), model_config=cfg, tokenizer_dir=model) as ck:
        ck.save({"params": params}, TrainMeta(step=1, policy_version=1))
    from jaxrl_async.config import to_dict
    from jaxrl_async.config.default import get_config

    with Checkpointer(str(t / "run_cfg"), CheckpointConfig(keep_last=2), model_config=cfg, tokenizer_dir=model) as ck:
        ck.save({"params": params}, TrainMeta(step=1, policy_version=1, config=to_dict(get_config())))
    corrupt = shutil.copytree(t / "run", t / "run_corrupt")
    for root, _, files in os.walk(corrupt / "checkpoints" / "1" / "params"):
        for f in files:
            if os.sep + "d" == root[-2:] and os.path.getsize(os.path.join(root, f)) > 100:
                with open(os.path.join(root, f), "r+b") as fh:
                    fh.truncate(10)
    return {"model": model, "missing": str(t / "missing"), "noconfig": str(t / "noconfig"), "trunc": str(trunc),
            "notok": str(notok), "t": str(t)}


def _run(module: str, argv: list[str], cwd: str) -> tuple[subprocess.CompletedProcess, float]:
    import time

    env = dict(os.environ, XLA_FLAGS=subprocess_xla_flags())  # as a user runs it: no simulated devices
    env.update(JAX_PLATFORMS="cpu", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", module, *argv], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    return proc, time.perf_counter() - t0


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """Every case's (process, seconds), a few at a time."""
    t = tmp_path_factory.mktemp("cli_errors")
    files = _make_files(t)
    with cf.ThreadPoolExecutor(min(4, (os.cpu_count() or 2) + 1)) as pool:
        futures = {case: pool.submit(_run, module, [a.format(**files) for a in argv.split()], str(t))
                   for case, module, argv, _ in CASES}
        out = {case: f.result() for case, f in futures.items()}
    print("slowest cases: " + ", ".join(f"{c} {s:.1f} s" for c, (_, s) in
                                        sorted(out.items(), key=lambda kv: -kv[1][1])[:5]))
    return files, out


@pytest.mark.parametrize("case, module, argv, culprit", CASES, ids=[c[0] for c in CASES])
def test_user_mistake_is_one_line_exit_2_no_traceback(results, case, module, argv, culprit):
    files, out = results
    proc, _ = out[case]
    culprit = culprit.format(**files)
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-3000:])
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    assert culprit in lines[-1], (culprit, err[-3000:])  # the last line names the culprit
    error_lines = [line for line in lines if re.search(r"\berror:", line)]
    if "must be >= 1" in culprit or "invalid choice" in culprit:  # argparse: the usage, then one error line
        assert lines[0].startswith("usage: ") and error_lines == [lines[-1]], err
    else:
        tool = {"jaxrl_async.launch.ray": "launch.ray"}.get(module, module.rsplit(".", 1)[1])
        assert error_lines == [lines[-1]] and lines[-1].startswith(f"{tool}: "), err


def test_cli_main_keeps_tracebacks_of_internal_errors(capsys):
    from jaxrl_async.cli.common import UserError, cli_main

    @cli_main("tool")
    def fails(kind):
        if kind == "user":
            raise UserError("--x y: not found")
        raise KeyError("bug")

    assert fails("user") == 2
    assert capsys.readouterr().err == "tool: error: --x y: not found\n"
    with pytest.raises(KeyError):
        fails("bug")


@pytest.mark.parametrize("module, parser, expected", [
    ("jaxrl_async.cli.generate", "build_parser", ["--max-new-tokens MAX_NEW_TOKENS", "(default: 1024)", "(default: float32)"]),
    ("jaxrl_async.cli.score", "build_parser", ["(default: 8192)"]),
    ("jaxrl_async.cli.evaluate", "build_parser", ["(default: auto)", "(default: 0.6)",
                                                  "(default: a run's export: its rollout.reward; else math)"]),
    ("jaxrl_async.cli.export", "build_parser", ["(default: 2.0)"]),
    ("jaxrl_async.cli.plan", "_parser", ["(default: cpu)", "(default: 0.1)"]),
    ("jaxrl_async.distributed.launch", "build_parser", ["(default: 1)", "(default: 60.0)"]),
    ("jaxrl_async.distributed.ray_launch", "build_parser", ["(default: auto)", "(default: PACK)", "(default: 300.0)"]),
])
def test_help_shows_defaults(module, parser, expected):
    import importlib

    text = " ".join(getattr(importlib.import_module(module), parser)().format_help().split())
    for e in expected:
        assert e in text, (e, text)
    assert "(default: None)" not in text and "(default: False)" not in text
