"""One evaluation path (issue 24, Found 6; issue 31 item 6): the run's held-out evaluation is the ``evaluate`` CLI's
code (``evaluate.evaluate_params``), and ``evaluate`` on the run's export takes the run's prompt recipe from it
(``data.recipe``: chat template, ``data.prompt_suffix``, ``data.max_prompt_len``, the reward, the held-out
evaluation's max_new_tokens), so with no prompt flag both give the policy the same token ids and score the same
accuracy on the same checkpoint and data. The reward here counts only when the row's metadata reaches it (the
in-run evaluation used to call the reward without it: accuracy 0 in the run, not 0 in the CLI). Sampled at
temperature 1 (a tiny model's greedy completions carry no digit): every request has its own seed and RNG stream,
so the two engines draw the same samples."""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_rl_loop import tiny_run_config  # noqa: E402

from jaxrl_async.loop import RLRun  # noqa: E402
from jaxrl_async.testing import subprocess_xla_flags  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SUFFIX = " Show the digits."


def test_in_run_evaluation_equals_the_evaluate_cli_on_the_runs_export(tmp_path):
    from jaxrl_async.cli import evaluate
    from jaxrl_async.loop.setup import load_tokenizer_and_data

    run = tmp_path / "run"
    cfg = tiny_run_config(run, steps=2, reward="loop_targets:has_digit_given_row",
                          **{"eval.at_end": "true", "checkpoint.export_hf": "true", "eval.temperature": "1.0",
                             "data.prompt_suffix": repr(SUFFIX), "data.max_prompt_len": "40",
                             "rollout.engine.max_prefill_length": "40", "rollout.engine.max_sequence_length": "56"})
    res = RLRun(cfg).run()
    assert res.stopped_by == "completed" and res.export_dir
    step, _, in_run = res.eval_history[-1]
    assert step == 2
    data = str(run / "data" / "eval.jsonl")
    # the prompts: the run's loader (loop.setup) and evaluate's, with no prompt flag, give the same token ids
    _, _, _, run_records = load_tokenizer_and_data(cfg, str(run), lambda _: None)
    args = evaluate.build_parser().parse_args(["--model", res.export_dir, "--data", data])
    cli_records = evaluate._load_inputs(args, evaluate.resolve_settings(args))[1]
    assert [r.prompt_ids for r in cli_records] == [r.prompt_ids for r in run_records]
    assert len(run_records) == cfg.data.arithmetic.num_eval and all(SUFFIX in r.prompt for r in run_records)
    # the accuracy: only the protocol's flags (n, temperature, seed) given
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    env["XLA_FLAGS"] = subprocess_xla_flags()
    proc = subprocess.run([sys.executable, "-m", "jaxrl_async.evaluate", "--model", res.export_dir, "--data", data,
                           "--n", "1", "--temperature", "1.0", "--seed", str(cfg.seed), "--summary-json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"evaluate: prompt recipe of run {run} step 2 ({res.export_dir}/jaxrl_async_run.json): chat template" \
           in proc.stderr, proc.stderr[-3000:]
    cli = json.loads(out.read_text())
    assert cli["items"] == cfg.data.arithmetic.num_eval and cli["reward"] == "loop_targets:has_digit_given_row"
    assert cli["pass@1"] == in_run, (cli["pass@1"], in_run)
    assert 0 < in_run  # not vacuous: the metadata reached the reward in the run
