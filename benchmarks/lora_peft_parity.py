"""LoRA PEFT export parity, decomposed: our logits vs PEFT's on a LoRA run's checkpoint, next to the dense
transformers-vs-ours difference and transformers' own attention backends (sdpa vs eager) on the same model.

    python -m jaxrl_async.export --run-dir RUN --out PEFT_DIR --lora peft
    python benchmarks/lora_peft_parity.py --run-dir RUN --peft PEFT_DIR [--n 16]

Tokens: the first ``--n`` held-out records of the run (prompt + reference completion, tokenized by the
exported tokenizer; shorter rows padded by repeating their last token, which leaves the real positions
unchanged under causal attention). Everything fp32 (``jax_default_matmul_precision=highest``).
Also checks that our unmerged forward already computes PEFT's order (``base(x) + lora_B(lora_A(x)) *
scaling``): the same forward with barriers forcing that order is bitwise equal.

``--fp64`` adds the float64 view (NOTES.md, "Logit parity with transformers"): a float64 reference (transformers
and PEFT in float64, RMSNorm in float64 instead of its float32 cast, cos/sin of the float32 rope angles in
float64) and every float32 forward's distance to it; our own forward in float64 against that reference (a
formula check: equal up to float64 rounding if and only if both compute the same function;
`testing.ours_in_float64` / `testing.hf_in_float64`);
per-layer hidden states ours vs transformers eager (end to end, and each layer on transformers' input); and
the amplification of one-ulp differences: transformers eager fed our float32 cos/sin tables instead of its own.
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
    ap.add_argument("--fp64", action="store_true", help="add the float64 reference, per-layer and rope-table rows")
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
    if a.fp64:
        out["fp64"] = fp64_view(a, cfg, params, tokens, ours, ours_base, t)
    print(json.dumps(out, indent=1))


def fp64_view(a, cfg, params, tokens, ours, ours_base, t) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import peft
    import torch
    import transformers

    from jaxrl_async.models import lora, transformer as tr
    from jaxrl_async.testing import hf_in_float64, ours_in_float64

    base_dir = os.path.join(a.peft, "base")
    B, T = tokens.shape
    positions = np.broadcast_to(np.arange(T, dtype=np.int32), (B, T))

    def logits(model, dtype=torch.float32):
        with torch.no_grad():
            return model(torch.tensor(tokens, dtype=torch.long)).logits.to(dtype).numpy()

    def load64():
        return transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                                 attn_implementation="sdpa").eval()

    ref = {"base": logits(hf_in_float64(load64(), cfg), torch.float64),
           "lora": logits(hf_in_float64(peft.PeftModel.from_pretrained(load64(), a.peft).eval(), cfg), torch.float64)}
    o64 = {"lora": ours_in_float64(params, cfg, tokens),
           "base": ours_in_float64(lora.split(params)[1], cfg.replace(lora=None), tokens)}

    def d(x, y):
        return float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())

    # per layer, base model, fp32: ours vs transformers eager
    eager = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32,
                                                              attn_implementation="eager").eval()
    with torch.no_grad():
        th = [h.numpy() for h in eager(torch.tensor(tokens, dtype=torch.long), output_hidden_states=True).hidden_states]
    bcfg = cfg.replace(lora=None, scan_layers=False)
    bp = lora.split(params)[1]
    cos, sin = tr.rope_cos_sin(bcfg, jnp.asarray(positions))
    attend = tr.model_attention(bcfg, jnp.ones((B, T), jnp.int32))
    layer = jax.jit(lambda p, x, i: tr.decoder_layer(p, x, cos, sin, bcfg, attend, None, i)[0], static_argnums=2)
    x = jnp.take(bp["embed"], tokens, axis=0)
    per_layer = []
    for i in range(bcfg.num_layers):
        p = jax.tree.map(lambda w: w[i], bp["layers"])  # noqa: B023 (used within this iteration)
        x = layer(p, x, i)
        last = i == bcfg.num_layers - 1  # transformers' last hidden state is after the final norm
        mine = tr.rms_norm(x, bp["final_norm"], bcfg.rms_norm_eps) if last else x
        alone = layer(p, jnp.asarray(th[i]), i)
        alone = tr.rms_norm(alone, bp["final_norm"], bcfg.rms_norm_eps) if last else alone
        per_layer.append({"layer": i, "max_abs_hidden": float(np.abs(th[i + 1]).max()),
                          "end_to_end": d(mine, th[i + 1]), "on_transformers_input": d(alone, th[i + 1])})
    # one-ulp rope table differences, amplified: transformers eager with our float32 cos/sin
    tables = tuple(torch.tensor(np.asarray(v)) for v in tr.rope_cos_sin(cfg, jnp.asarray(positions)))
    own = eager.model.rotary_emb(torch.zeros(1), torch.tensor(positions, dtype=torch.long))
    eager.model.rotary_emb.forward = lambda x, position_ids: tables
    swapped = logits(eager)
    return {
        "reference": "transformers/PEFT float64 (RMSNorm float64, exact cos/sin of the float32 angles)",
        "formula_check_ours_fp64_vs_reference": {k: d(o64[k], ref[k]) for k in ref},
        "base_vs_fp64": {"ours": d(ours_base, ref["base"]), "transformers_sdpa": d(t["base_sdpa"], ref["base"]),
                         "transformers_eager": d(t["base_eager"], ref["base"])},
        "lora_vs_fp64": {"ours": d(ours, ref["lora"]), "peft_sdpa": d(t["peft_sdpa"], ref["lora"]),
                         "peft_eager": d(t["peft_eager"], ref["lora"])},
        "per_layer_base_ours_vs_transformers_eager": per_layer,
        "rope_tables_ours_vs_transformers": {
            "cos_entries_differing": float(np.mean(tables[0].numpy() != own[0].numpy())),
            "sin_entries_differing": float(np.mean(tables[1].numpy() != own[1].numpy())),
            "max_abs_table_difference": max(d(tables[0], own[0]), d(tables[1], own[1])),
            "transformers_eager_logits_with_our_tables_vs_own": d(swapped, t["base_eager"])},
    }


if __name__ == "__main__":
    main()
