"""LoRA training: the gradient is taken w.r.t. the adapters only and equals the chain rule through the
merged weights (dL/dA = s G B^T, dL/dB = s A^T G with G = dL/dW of the merged model), AdamW state exists
only for the adapters, the frozen base passes through steps bit-identically (also stored in bfloat16)."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_async.models import lora
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import init_params
from jaxrl_async.rl.losses import PolicyLossConfig
from jaxrl_async.sharding import make_mesh
from jaxrl_async.trainer import OptimizerConfig, PackingConfig, Trainer, TrainStepConfig, TrainSequence, pack

BASE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, rope_theta=10000.0)
ROW = 16
FULL = PackingConfig(tokens_per_micro=8 * ROW, row_len_buckets=(ROW,), max_seqs_per_row=4)
OPT = OptimizerConfig(lr=1e-2, eps=1e-8, weight_decay=0.0, max_grad_norm=None)
LOSS = PolicyLossConfig()


def make_trajs(seed, n=8, lo=5, hi=ROW):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        L, p = int(rng.integers(lo, hi + 1)), int(rng.integers(1, 4))
        mask = (np.arange(L) >= p).astype(np.int32)
        out.append(TrainSequence(tokens=rng.integers(0, BASE.vocab_size, L), loss_mask=mask,
                              behaviour_logprobs=np.where(mask > 0, -rng.uniform(0.5, 6.0, L), 0.0),
                              advantages=np.where(mask > 0, rng.normal(size=L), 0.0),
                              versions=np.where(mask > 0, 2, -1),
                              proximal_logprobs=np.where(mask > 0, -4.2 + 0.3 * rng.normal(size=L), 0.0)))
    return out

SPEC = lora.LoraSpec(rank=4, alpha=8.0)
CFG = BASE.replace(lora=SPEC)


@pytest.fixture(scope="module")
def params():
    p = init_params(CFG, jax.random.key(0), 0.1)
    adapters, base = lora.split(p)
    keys = jax.random.split(jax.random.key(5), len(adapters["layers"]))
    adapters = {"layers": {k: 0.2 * jax.random.normal(kk, v.shape) for kk, (k, v) in
                           zip(keys, sorted(adapters["layers"].items()))}}  # trained-looking A and B
    return lora.join(adapters, base)


def test_adapter_gradient_is_the_chain_rule_through_the_merged_weights(params):
    trajs = make_trajs(1)
    packed = pack(trajs, FULL)
    t_lora = Trainer(CFG, TrainStepConfig(optimizer=OPT, packing=FULL), loss_cfg=LOSS)
    t_full = Trainer(BASE, TrainStepConfig(optimizer=OPT, packing=FULL), loss_cfg=LOSS)
    g, loss, _ = t_lora.gradients(params, packed)
    assert set(g) == {"layers"} and all(lora.is_adapter_key(k) for k in g["layers"])  # no base gradient
    g_full, loss_full, _ = t_full.gradients(lora.merge(params, SPEC), packed)
    np.testing.assert_allclose(float(loss), float(loss_full), rtol=1e-5)
    s = SPEC.scale
    for t, (w_sub, n_in) in lora.TARGETS.items():
        G = np.asarray(g_full["layers"][t], np.float64)
        A = np.asarray(params["layers"][f"{t}_lora_a"], np.float64)
        B = np.asarray(params["layers"][f"{t}_lora_b"], np.float64)
        i, o = w_sub[:n_in], w_sub[n_in:]
        want_a = s * np.einsum(f"l{w_sub},lr{o}->l{i}r", G, B)
        want_b = s * np.einsum(f"l{i}r,l{w_sub}->lr{o}", A, G)
        for got, want in ((g["layers"][f"{t}_lora_a"], want_a), (g["layers"][f"{t}_lora_b"], want_b)):
            got = np.asarray(got, np.float64)
            assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want) and np.linalg.norm(want) > 0


@pytest.mark.parametrize("base_dtype", ["float32", "bfloat16"])
def test_steps_update_only_adapters_with_adapter_only_adam_state(params, base_dtype):
    cfg = BASE.replace(lora=lora.LoraSpec(rank=4, alpha=8.0, base_dtype=base_dtype))
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    tr = Trainer(cfg, TrainStepConfig(optimizer=OPT, packing=FULL), mesh=mesh, loss_cfg=LOSS)
    state = tr.init_state(params)
    adapters0, base0 = jax.device_get(lora.split(state.params))
    assert all(x.dtype == jnp.dtype(base_dtype) for x in jax.tree.leaves(base0))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(adapters0))
    # AdamW moments: exactly the adapter leaves
    mu = [s for s in jax.tree.leaves(state.opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
          if isinstance(s, optax.ScaleByAdamState)][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(adapters0)
    assert sum(x.size for x in jax.tree.leaves(state.opt_state)) < 0.5 * sum(x.size for x in jax.tree.leaves(base0))
    for seed in (1, 2):
        state, m = tr.step(state, pack(make_trajs(seed), FULL))
        assert int(m["skipped"]) == 0
    adapters1, base1 = jax.device_get(lora.split(state.params))
    for a, b in zip(jax.tree.leaves(base0), jax.tree.leaves(base1)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert all(np.abs(np.asarray(a) - np.asarray(b)).max() > 0
               for a, b in zip(jax.tree.leaves(adapters0), jax.tree.leaves(adapters1)))


def test_lora_dropout_in_training_steps_only(params):
    cfg = BASE.replace(lora=lora.LoraSpec(rank=4, alpha=8.0, dropout=0.3))
    packed = pack(make_trajs(3), FULL)
    results = []
    for spec_cfg in (cfg, CFG, cfg):
        tr = Trainer(spec_cfg, TrainStepConfig(optimizer=OPT, packing=FULL), loss_cfg=LOSS)
        state, m = tr.step(tr.init_state(params), packed)
        lp, _ = tr.compute_logprobs(state.params, tr.put_batch(packed))
        results.append((float(m["loss"]), jax.device_get(lora.split(state.params)[0]), np.asarray(lp)))
    (l_do, a_do, _), (l_plain, a_plain, _), (l_do2, a_do2, lp_do2) = results
    assert l_do != l_plain  # the step's forward dropped adapter inputs
    assert l_do == l_do2 and all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a_do), jax.tree.leaves(a_do2)))
    # log-probs outside the step (proximal pass, generator parity) never drop: same as without dropout
    tr_plain = Trainer(CFG, TrainStepConfig(optimizer=OPT, packing=FULL), loss_cfg=LOSS)
    st = tr_plain.init_state(lora.join(a_do2, lora.split(params)[1]))
    lp_plain, _ = tr_plain.compute_logprobs(st.params, tr_plain.put_batch(packed))
    np.testing.assert_array_equal(np.asarray(lp_plain), lp_do2)
