"""One evaluation path (issue 24, Found 6): the run's held-out evaluation is the ``evaluate`` CLI's code
(``evaluate.evaluate_params``), so both give the same accuracy on the same checkpoint and data. The reward
here counts only when the row's metadata reaches it (the in-run evaluation used to call the reward without
it: accuracy 0 in the run, not 0 in the CLI). Sampled at temperature 1 (a tiny model's greedy completions
carry no digit): every request has its own seed and RNG stream, so the two engines draw the same samples."""
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


def test_in_run_evaluation_equals_the_evaluate_cli_on_the_same_checkpoint(tmp_path):
    run = tmp_path / "run"
    cfg = tiny_run_config(run, steps=2, reward="loop_targets:has_digit_given_row",
                          **{"eval.at_end": "true", "checkpoint.export_hf": "true", "eval.temperature": "1.0"})
    res = RLRun(cfg).run()
    assert res.stopped_by == "completed" and res.export_dir
    step, _, in_run = res.eval_history[-1]
    assert step == 2
    out = tmp_path / "summary.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, ROOT, os.environ.get("PYTHONPATH", "")]))
    env["XLA_FLAGS"] = subprocess_xla_flags()
    proc = subprocess.run([sys.executable, "-m", "jaxrl_async.evaluate", "--model", res.export_dir,
                           "--data", str(run / "data" / "eval.jsonl"), "--format", "generic", "--n", "1",
                           "--temperature", "1.0", "--seed", str(cfg.seed),
                           "--max-new-tokens", str(cfg.rollout.sampling.max_new_tokens),
                           "--max-prompt-length", str(cfg.data.max_prompt_len),
                           "--reward", "loop_targets:has_digit_given_row", "--summary-json", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cli = json.loads(out.read_text())
    assert cli["items"] == cfg.data.arithmetic.num_eval
    assert cli["pass@1"] == in_run, (cli["pass@1"], in_run)
    assert 0 < in_run  # not vacuous: the metadata reached the reward in the run
