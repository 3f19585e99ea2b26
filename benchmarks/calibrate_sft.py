"""Calibrate the SFT warm start: held-out greedy accuracy vs SFT steps for a model size and task.

For each step count S in --steps, trains a fresh random policy (same init seed) for S AdamW steps
(linear warmup, cosine decay to 0 at S) on the arithmetic task's gold completions, then decodes
the held-out split greedily (temperature 0, stop on EOS) and scores it with the math reward.
Prints one table row per setting (and appends JSON rows to --out):

    hidden layers heads task sft_steps lr batch sft_s eval_s wall_s final_loss held_out_acc s_acc pass@k

`sft_s` includes the step's compilation; `wall_s` = tokenizer + data + init + SFT + greedy evaluation.
`s_acc` (mean reward of K samples at temperature 1, what RL starts from) and `pass@k` (a prompt
solved by at least one of its K samples) on the first --sample-prompts held-out prompts measure
the headroom RL can turn into greedy accuracy.

    python benchmarks/calibrate_sft.py --hidden 64 --layers 2 --steps 50 100 200
    python benchmarks/calibrate_sft.py --hidden 128 --layers 4 --min-digits 2 --max-digits 2 --steps 100 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--intermediate", type=int, default=None, help="default 3 * hidden")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--init-seed", type=int, default=0)
    ap.add_argument("--min-digits", type=int, default=1)
    ap.add_argument("--max-digits", type=int, default=2)
    ap.add_argument("--operators", default="+-")
    ap.add_argument("--operands", type=int, default=2)
    ap.add_argument("--num-train", type=int, default=2000)
    ap.add_argument("--num-eval", type=int, default=200)
    ap.add_argument("--data-seed", type=int, default=0)
    ap.add_argument("--styles", nargs="+", default=["steps"], help="completion styles (data.arithmetic.styles)")
    ap.add_argument("--style-weights", type=float, nargs="*", default=[], help="one weight per style")
    ap.add_argument("--steps", type=int, nargs="+", default=[50, 100, 200])
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--samples", type=int, default=8,
                    help="K samples at temperature 1 per prompt (RL headroom: mean sampled reward, pass@K); 0 = off")
    ap.add_argument("--sample-prompts", type=int, default=64, help="held-out prompts used for the sampled metrics")
    ap.add_argument("--show", type=int, default=0, help="print this many held-out completions per setting")
    ap.add_argument("--out", default=None, help="append one JSON row per setting to this file")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    t_start = time.perf_counter()
    import jax
    from transformers import AutoTokenizer

    from jaxrl_async.config import ModelConfigSection, SFTConfig
    from jaxrl_async.data.arithmetic import ArithmeticConfig, build_splits, sft_example
    from jaxrl_async.data.tokenizer import build_tokenizer
    from jaxrl_async.models.transformer import init_params
    from jaxrl_async.rewards.math_reward import MathReward
    from jaxrl_async.trainer.sft import encode_examples, generate_completions, greedy_completions, run_sft

    with tempfile.TemporaryDirectory() as d:
        tok = AutoTokenizer.from_pretrained(build_tokenizer(d, kind="arithmetic"))
    task = ArithmeticConfig(min_digits=args.min_digits, max_digits=args.max_digits, operators=tuple(args.operators),
                            min_operands=args.operands, max_operands=args.operands, num_train=args.num_train,
                            num_eval=args.num_eval, seed=args.data_seed, styles=tuple(args.styles),
                            style_weights=tuple(args.style_weights))
    train, held = build_splits(task)
    examples = encode_examples([sft_example(p, tok) for p in train], tok)
    section = ModelConfigSection(hidden_size=args.hidden, intermediate_size=args.intermediate or 3 * args.hidden,
                                 num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                                 head_dim=args.head_dim)
    model_cfg = section.model_config(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    setup_s = time.perf_counter() - t_start
    n_params = sum(x.size for x in jax.tree.leaves(init_params(model_cfg, jax.random.key(args.init_seed))))
    task_name = f"{args.operands}x{args.min_digits}-{args.max_digits}d[{args.operators}]"
    print(f"# model hidden={args.hidden} layers={args.layers} heads={args.heads}/{args.kv_heads} "
          f"head_dim={args.head_dim} params={n_params:,}; task {task_name}: {len(train)} train / {len(held)} held-out; "
          f"devices {jax.devices()}", flush=True)
    print(f"{'hidden':>6} {'layers':>6} {'heads':>5} {'task':>14} {'steps':>5} {'lr':>7} {'batch':>5} {'sft_s':>6} "
          f"{'eval_s':>6} {'wall_s':>6} {'loss':>6} {'acc':>6} {'s_acc':>6} {'pass@k':>6}", flush=True)
    reward = MathReward()
    prompts = [sft_example(p, tok)[0] for p in held]
    for steps in args.steps:
        t0 = time.perf_counter()
        params = init_params(model_cfg, jax.random.key(args.init_seed))
        cfg = SFTConfig(steps=steps, batch_size=args.batch, lr=args.lr, warmup_steps=min(args.warmup, steps - 1),
                        weight_decay=args.weight_decay)
        params, hist = run_sft(params, model_cfg, examples, cfg, progress=False)
        jax.block_until_ready(params)
        t1 = time.perf_counter()
        comps = greedy_completions(params, model_cfg, tok, prompts, max_new_tokens=args.max_new_tokens)
        greedy_hits = [reward(p, c, prob.answer) for p, c, prob in zip(prompts, comps, held)]
        acc = sum(greedy_hits) / len(held)
        by_style = {}  # completion style -> (share of greedy completions, accuracy within it)
        for c, h in zip(comps, greedy_hits):
            by_style.setdefault("direct" if c.startswith("The answer") else "worked", []).append(h)
        by_style = {k: (len(v) / len(comps), sum(v) / len(v)) for k, v in sorted(by_style.items())}
        t2 = time.perf_counter()
        sample_acc = pass_k = float("nan")
        if args.samples > 0:
            sub = held[:args.sample_prompts]
            outs = generate_completions(params, model_cfg, tok, prompts[:len(sub)], max_new_tokens=args.max_new_tokens,
                                        temperature=1.0, n=args.samples, seed=1)
            hits = [[reward(p, c, prob.answer) > 0 for c in cs] for p, cs, prob in zip(prompts, outs, sub)]
            sample_acc = sum(map(sum, hits)) / (len(sub) * args.samples)
            pass_k = sum(map(any, hits)) / len(sub)
            flat = [(c.startswith("The answer"), h) for cs, hs in zip(outs, hits) for c, h in zip(cs, hs)]
            for name, is_direct in (("sampled_direct", True), ("sampled_worked", False)):
                hs = [h for d, h in flat if d == is_direct]
                by_style[name] = (len(hs) / len(flat), sum(hs) / len(hs) if hs else float("nan"))
        loss = sum(h["loss"] for h in hist[-5:]) / len(hist[-5:])
        row = dict(hidden=args.hidden, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                   head_dim=args.head_dim, params=n_params, task=task_name, sft_steps=steps, lr=args.lr,
                   batch=args.batch, warmup=cfg.warmup_steps, sft_s=t1 - t0, eval_s=t2 - t1,
                   wall_s=setup_s + t2 - t0, final_loss=loss, held_out_acc=acc, sample_acc=sample_acc,
                   pass_at_k=pass_k, k=args.samples, compilations=hist[-1]["compilations"],
                   styles=task.styles, style_weights=task.style_weights, by_style=by_style)
        print(f"{args.hidden:>6} {args.layers:>6} {args.heads:>5} {task_name:>14} {steps:>5} {args.lr:>7.1e} "
              f"{args.batch:>5} {row['sft_s']:>6.1f} {row['eval_s']:>6.1f} {row['wall_s']:>6.1f} {loss:>6.3f} "
              f"{acc:>6.3f} {sample_acc:>6.3f} {pass_k:>6.3f}", flush=True)
        if len(task.styles) > 1:
            print("    by style (share, accuracy): " + ", ".join(f"{k} {v[0]:.2f} {v[1]:.3f}" for k, v in by_style.items()))
        for prob, c in list(zip(held, comps))[:args.show]:
            print(f"    {prob.expression} = {prob.answer}: {c!r}")
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
