"""Output tokens/s: our engine through the orchestrator vs transformers `generate` (torch CPU).

    python benchmarks/bench_generate.py [--num-prompts 48] [--batch 16] [--layers 8] [--hidden 512] ...

Model: one random Qwen3-shaped checkpoint (default hidden 512, 8 layers, 8 heads / 4 kv heads of
64, MLP 1536, vocab 32000, tied embeddings: ~41M parameters) written with `save_pretrained`;
both systems load the same files, fp32.

Workload (same for both): `--num-prompts` random-token prompts of uniform length in
[16, 128]; each prompt gets its own output length drawn from a long-tailed (Pareto) law,
    max_new_tokens_i = clip(floor(L_min * U_i^(-1/alpha)), L_min, L_max),  U_i ~ Uniform(0, 1],
(default L_min 8, alpha 1.1, L_max 256: median ~15 tokens, a few prompts run to 256), greedy
decoding, no EOS stop, so every sequence produces exactly max_new_tokens_i tokens in both systems.

Ours: `Generator` over `PagedEngine(max_concurrent_decodes=--batch)`, all requests submitted at
once; continuous batching refills a slot as soon as its sequence ends. Compilation is excluded
(`engine.warmup` first).

transformers: `model.generate(do_sample=False)` on batches of `--batch` prompts in arrival order,
left-padded, `max_new_tokens` = the batch's largest budget (HF cannot stop a row early, and a row
that is done still costs compute, as with EOS-terminated sampling); only each prompt's own budget
counts as output tokens. One warm-up generate first. `--hf-sorted` also runs the oracle baseline
that sorts prompts by budget before batching (it knows the lengths in advance, which real
sampling does not).

Output tokens/s = sum_i max_new_tokens_i / wall time. Both are measured in the same process, one
after the other, and reported with their ratio. Also reported: the orchestrator's stats
(slot utilisation, host Python time per decode step vs the step) and greedy agreement (share of
prompts whose tokens are identical in both systems; fp32 near-ties can differ).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np


def pareto_lengths(rng: np.random.Generator, n: int, lo: int, alpha: float, hi: int) -> np.ndarray:
    u = 1.0 - rng.random(n)  # (0, 1]
    return np.clip(np.floor(lo * u ** (-1.0 / alpha)), lo, hi).astype(int)


def make_model(out_dir: str, args) -> str:
    from jaxrl_async.testing import make_tiny_hf_model

    return make_tiny_hf_model(
        out_dir, "qwen3", std=0.05, vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=3 * args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(args.hidden // 128, 1), head_dim=64, max_position_embeddings=1024)


def run_ours(model_dir: str, prompts, budgets, args) -> dict:
    import jax

    from jaxrl_async.models import load_hf
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.generator.engine_api import SamplingParams
    from jaxrl_async.generator.orchestrator import Generator

    cfg, params = load_hf(model_dir)
    max_prompt = max(len(p) for p in prompts)
    eng = build_engine(EngineConfig(max_concurrent_decodes=args.batch,
                                    max_sequence_length=max_prompt + int(max(budgets)) + 1,
                                    max_prefill_length=max_prompt, page_size=16), cfg)
    params = eng.place_params(params)
    t = time.perf_counter()
    eng.warmup(params, max_samples=1)
    warm = time.perf_counter() - t
    with Generator(eng, params) as gen:
        t0 = time.perf_counter()
        hs = [gen.submit(p, SamplingParams(temperature=0, max_new_tokens=int(b)), request_id=str(i))
              for i, (p, b) in enumerate(zip(prompts, budgets))]
        outs = [h.result(3600).samples[0] for h in hs]
        wall = time.perf_counter() - t0
        st = gen.stats()
    n_tok = sum(len(o.completion_ids) for o in outs)
    assert n_tok == int(sum(budgets)), (n_tok, sum(budgets))
    return dict(wall_s=wall, tokens=n_tok, tok_s=n_tok / wall, warmup_s=warm, num_pages=eng.num_pages,
                device=str(jax.devices()[0].platform), completions=[o.completion_ids for o in outs],
                steps=st.steps, slot_utilisation=st.slot_utilisation, step_ms=1e3 * st.step_s,
                host_ms_per_step=1e3 * st.host_s_per_step, device_wait_ms_per_step=1e3 * st.device_wait_s_per_step,
                host_overhead_fraction=st.host_overhead_fraction, prefills=st.prefills,
                compile_counts=eng.compile_counts())


def run_hf(model_dir: str, prompts, budgets, args, order) -> dict:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = 0

    def batch_generate(idx):
        L = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        mask = torch.zeros((len(idx), L), dtype=torch.long)
        for r, i in enumerate(idx):  # left padding
            ids[r, L - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, L - len(prompts[i]):] = 1
        n_new = int(max(budgets[i] for i in idx))
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n_new, min_new_tokens=n_new,
                                 do_sample=False, eos_token_id=None, pad_token_id=pad)
        return {i: out[r, L:L + int(budgets[i])].tolist() for r, i in enumerate(idx)}

    batch_generate(list(order[:2]))  # warm-up
    t0 = time.perf_counter()
    comps = {}
    for lo in range(0, len(order), args.batch):
        comps.update(batch_generate(list(order[lo:lo + args.batch])))
    wall = time.perf_counter() - t0
    n_tok = int(sum(budgets))
    return dict(wall_s=wall, tokens=n_tok, tok_s=n_tok / wall, threads=torch.get_num_threads(),
                completions=[comps[i] for i in range(len(prompts))])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--batch", type=int, default=16, help="our max_concurrent_decodes = HF batch size")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=128)
    ap.add_argument("--min-new", type=int, default=8)
    ap.add_argument("--alpha", type=float, default=1.1)
    ap.add_argument("--max-new", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hf-sorted", action="store_true", help="also run the length-sorted (oracle) HF baseline")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args()

    rng = np.random.default_rng(args.seed)
    prompts = [rng.integers(3, args.vocab, rng.integers(args.min_prompt, args.max_prompt + 1)).tolist()
               for _ in range(args.num_prompts)]
    budgets = pareto_lengths(rng, args.num_prompts, args.min_new, args.alpha, args.max_new)
    with tempfile.TemporaryDirectory() as d:
        model_dir = make_model(d, args)
        from safetensors import safe_open

        with safe_open(os.path.join(model_dir, "model.safetensors"), "np") as f:
            n_params = sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())
        ours = run_ours(model_dir, prompts, budgets, args)
        hf = run_hf(model_dir, prompts, budgets, args, np.arange(args.num_prompts))
        hf_sorted = run_hf(model_dir, prompts, budgets, args, np.argsort(-budgets, kind="stable")) if args.hf_sorted else None
    agree = np.mean([a == b for a, b in zip(ours.pop("completions"), hf.pop("completions"))])
    res = dict(params_m=n_params / 1e6, num_prompts=args.num_prompts, batch=args.batch,
               budgets=dict(total=int(budgets.sum()), median=float(np.median(budgets)), max=int(budgets.max()),
                            p90=float(np.percentile(budgets, 90))),
               ours=ours, hf=hf, ratio=ours["tok_s"] / hf["tok_s"], greedy_agreement=float(agree))
    if hf_sorted is not None:
        hf_sorted.pop("completions")
        res["hf_sorted"] = hf_sorted
        res["ratio_vs_sorted"] = ours["tok_s"] / hf_sorted["tok_s"]
    print(json.dumps(res, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
