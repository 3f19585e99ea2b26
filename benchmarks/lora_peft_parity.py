"""LoRA PEFT export parity, decomposed: our logits vs PEFT's on a LoRA run's checkpoint, next to the dense
transformers-vs-ours difference and transformers' own attention backends (sdpa vs eager) on the same model.

    python -m jaxrl_async.export --run-dir RUN --out PEFT_DIR --lora peft
    python benchmarks/lora_peft_parity.py --run-dir RUN --peft PEFT_DIR [--n 16]

Tokens: the first ``--n`` held-out records of the run (prompt + reference completion, tokenized by the
exported tokenizer; shorter rows padded by repeating their last token, which leaves the real positions
unchanged under causal attention). Everything fp32 (``jax_default_matmul_precision=highest``).
Also checks that our unmerged forward already computes PEFT's order (``base(x) + lora_B(lora_A(x)) *
scaling``): the same forward with barriers forcing that order is bitwise equal.
"""

from __future__ import annotations

import argparse
import json
import os


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--peft", required=True, help="the run's `export --lora peft` directory")
    ap.add_argument("--n", type=int, default=16)
    a = ap.parse_args()
    import jax
    import jax.numpy as jnp
    import numpy as np

    jax.config.update("jax_default_matmul_precision", "highest")
    import peft
    import torch
    import transformers

    from jaxrl_async.checkpoint import Checkpointer
    from jaxrl_async.models import apply, lora

    tok = transformers.AutoTokenizer.from_pretrained(a.peft)
    with open(os.path.join(a.run_dir, "data", "eval.jsonl")) as f:
        recs = [json.loads(line) for line in f][: a.n]
    ids = [tok(r["prompt"] + " " + r["completion"])["input_ids"] for r in recs]
    width = max(map(len, ids))
    tokens = np.array([x + [x[-1]] * (width - len(x)) for x in ids], np.int32)
    r = Checkpointer(a.run_dir, read_only=True).restore(items=["params"], targets={"params": "host"},
                                                        restore_trajectories=False)
    cfg, params = r.model_config, r.arrays["params"]
    if cfg.lora is None:
        raise SystemExit(f"{a.run_dir}: not a LoRA run")
    base_cfg = cfg.replace(lora=None)
    fwd = jax.jit(lambda p: apply(p, cfg, tokens))
    ours = np.asarray(fwd(params))
    ours_merged = np.asarray(apply(lora.merge(params, cfg.lora), base_cfg, tokens))
    ours_base = np.asarray(apply(lora.split(params)[1], base_cfg, tokens))

    # PEFT's order forced with barriers: (x A), then B, then * scaling, added to the barrier'd x W
    orig = lora.delta

    def peft_order(x, A, B, target, scale, x_sub, out_sub):
        w_sub, n_in = lora.TARGETS[target]
        xa = jax.lax.optimization_barrier(jnp.einsum(f"{x_sub},{w_sub[:n_in]}r->{x_sub[:-n_in]}r", x,
                                                     A.astype(x.dtype)))
        xab = jax.lax.optimization_barrier(jnp.einsum(f"{x_sub[:-n_in]}r,r{w_sub[n_in:]}->{out_sub}", xa,
                                                      B.astype(x.dtype)))
        return xab * scale

    lora.delta = peft_order
    try:
        forced = np.asarray(jax.jit(lambda p: apply(p, cfg, tokens))(params))
    finally:
        lora.delta = orig

    def logits(model):
        with torch.no_grad():
            return model(torch.tensor(tokens, dtype=torch.long)).logits.float().numpy()

    t = {}
    for impl in ("sdpa", "eager"):
        base = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(a.peft, "base") if os.path.isdir(
            os.path.join(a.peft, "base")) else json.load(open(os.path.join(a.peft, "adapter_config.json")))[
            "base_model_name_or_path"], dtype=torch.float32, attn_implementation=impl).eval()
        t[f"base_{impl}"] = logits(base)
        pm = peft.PeftModel.from_pretrained(base, a.peft).eval()
        t[f"peft_{impl}"] = logits(pm)
        t[f"merged_{impl}"] = logits(pm.merge_and_unload())
    top = float(np.abs(t["peft_sdpa"]).max())

    def d(x, y):
        m = float(np.abs(x - y).max())
        return {"max_abs": m, "of_max_logit": m / top}

    out = {"tokens": list(tokens.shape), "max_abs_logit": top, "lora_scale": cfg.lora.scale,
           "ours_vs_peft_sdpa": d(ours, t["peft_sdpa"]), "ours_vs_peft_eager": d(ours, t["peft_eager"]),
           "ours_merged_vs_transformers_merged": d(ours_merged, t["merged_sdpa"]),
           "ours_vs_transformers_base_no_lora_sdpa": d(ours_base, t["base_sdpa"]),
           "ours_vs_transformers_base_no_lora_eager": d(ours_base, t["base_eager"]),
           "transformers_sdpa_vs_eager_base": d(t["base_sdpa"], t["base_eager"]),
           "peft_sdpa_vs_peft_eager": d(t["peft_sdpa"], t["peft_eager"]),
           "peft_unmerged_vs_peft_merged": d(t["peft_sdpa"], t["merged_sdpa"]),
           "ours_equals_forced_peft_order_bitwise": bool(np.array_equal(ours, forced))}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
