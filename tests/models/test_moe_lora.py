"""LoRA on mixture-of-experts expert MLPs (models/lora.py module doc, models/moe.py): per-expert adapters in
PEFT's fused-expert form (one A shared by gate and up, B per half; down's pair) are rows of the parameter
table with the `expert` logical axis; every grouped-matmul kernel (ragged_dot, tiled, megablox in Pallas
interpret mode) computes base + scale (x A[x]) B[x] on the expert-sorted rows, equal to a dense
every-expert reference in value and adapter gradients (fp32); a zero B leaves the logits bit-identical;
merge folds W[l, x] + scale A[l, x] B[l, x]."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models import lora
from jaxrl_async.models import transformer
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.moe import grouped_swiglu, routing
from jaxrl_async.models.transformer import apply, init_params, logical_axes, param_shapes, sequence_logprobs
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import make_mesh

MOE = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=16, qk_norm=True)
SPEC = lora.LoraSpec(rank=4, alpha=8.0)  # every target: q k v o + the experts' gate, up, down
CFG = MOE.replace(lora=SPEC)
KERNELS = ("ragged", "tiled", "megablox")


def _tokens(seed=0, B=3, T=11):
    return jnp.asarray(np.random.default_rng(seed).integers(0, MOE.vocab_size, (B, T)), jnp.int32)


def _random_adapters(params, seed=1, std=0.3):
    """Non-zero A and B in every stack (a trained adapter)."""
    adapters, base = lora.split(params)
    out = {}
    for stack, a in adapters.items():
        keys = jax.random.split(jax.random.fold_in(jax.random.key(seed), len(out)), len(a))
        out[stack] = {k: std * jax.random.normal(kk, v.shape, v.dtype) for kk, (k, v) in zip(keys, sorted(a.items()))}
    return lora.join(out, base)


_apply = jax.jit(apply, static_argnums=1)


def test_expert_adapter_rows_shapes_axes_init_and_shardings():
    shapes, axes = param_shapes(CFG)["layers"], logical_axes(CFG)["layers"]
    L, X, D, F, r = 2, 4, 32, 16, 4
    assert shapes["moe_gate_up_lora_a"].shape == (L, X, D, r)
    assert shapes["moe_gate_up_lora_b"].shape == (L, X, r, 2, F)
    assert shapes["moe_down_lora_a"].shape == (L, X, F, r) and shapes["moe_down_lora_b"].shape == (L, X, r, D)
    assert axes["moe_gate_up_lora_a"] == ("layers", "expert", "embed", None)
    assert axes["moe_gate_up_lora_b"] == ("layers", "expert", None, None, "mlp")
    assert axes["moe_down_lora_a"] == ("layers", "expert", "mlp", None)
    assert axes["moe_down_lora_b"] == ("layers", "expert", None, "embed")
    assert not any(k in shapes for k in ("gate_lora_a", "up_lora_a", "down_lora_a"))  # no dense MLP here
    # per layer X times (D r + r 2F) + X (F r + r D) expert adapter parameters
    n_expert = sum(int(np.prod(shapes[k].shape)) for k in shapes if k.startswith("moe_") and lora.is_adapter_key(k))
    assert n_expert == L * X * r * ((D + 2 * F) + (F + D))
    # A as PEFT (U(+-1/sqrt(fan_in)), fan_in = D for gate_up, F for down), B = 0
    params = init_params(CFG, jax.random.key(0))["layers"]
    for k, fan_in in (("moe_gate_up_lora_a", D), ("moe_down_lora_a", F)):
        a = np.abs(np.asarray(params[k]))
        assert a.max() <= 1 / np.sqrt(fan_in) and a.max() > 0.5 / np.sqrt(fan_in)
    assert not np.any(np.asarray(params["moe_gate_up_lora_b"])) and not np.any(np.asarray(params["moe_down_lora_b"]))
    assert {k for k in transformer.init_adapters(CFG, jax.random.key(0))["layers"]} == {
        k for k in shapes if lora.is_adapter_key(k)}
    # sharded over `expert` like the base experts (each expert's low-rank product stays on its device)
    sh = model_shardings(CFG, make_mesh({"expert": 4, "fsdp": 2}), "trainer")["layers"]
    for k in ("moe_gate", "moe_gate_up_lora_a", "moe_gate_up_lora_b", "moe_down_lora_a", "moe_down_lora_b"):
        assert tuple(sh[k].spec)[:2] == (None, "expert"), (k, sh[k].spec)


@pytest.mark.parametrize("kernel", KERNELS)
def test_zero_adapter_is_bit_identical_and_trained_one_equals_merged(kernel):
    cfg, base_cfg = CFG.replace(moe_kernel=kernel), MOE.replace(moe_kernel=kernel)
    params = init_params(cfg, jax.random.key(0))
    _, base = lora.split(params)
    tok = _tokens()
    np.testing.assert_array_equal(np.asarray(_apply(params, cfg, tok)), np.asarray(_apply(base, base_cfg, tok)))
    params = _random_adapters(params)
    got = np.asarray(_apply(params, cfg, tok))
    merged = lora.merge(params, SPEC)
    assert not lora.has_adapters(merged)
    want = np.asarray(_apply(merged, base_cfg, tok))
    assert np.abs(got - np.asarray(_apply(base, base_cfg, tok))).max() > 1e-2  # the expert adapters matter
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_merge_is_w_plus_scaled_a_b_per_expert():
    params = _random_adapters(init_params(CFG, jax.random.key(0)))
    ad, base = lora.split(params)
    a = {k: np.asarray(v, np.float64) for k, v in ad["layers"].items()}
    merged = lora.merge(params, SPEC)["layers"]
    s = SPEC.scale
    for name, b in (("moe_gate", a["moe_gate_up_lora_b"][:, :, :, 0]), ("moe_up", a["moe_gate_up_lora_b"][:, :, :, 1])):
        ref = np.asarray(base["layers"][name], np.float64) + s * np.einsum("lxdr,lxrf->lxdf", a["moe_gate_up_lora_a"], b)
        np.testing.assert_allclose(np.asarray(merged[name]), ref, atol=1e-6, rtol=0)
    ref = np.asarray(base["layers"]["moe_down"], np.float64) + s * np.einsum(
        "lxfr,lxrd->lxfd", a["moe_down_lora_a"], a["moe_down_lora_b"])
    np.testing.assert_allclose(np.asarray(merged["moe_down"]), ref, atol=1e-6, rtol=0)


def _dense_reference(x, ids, w, wg, wu, wd, ad, scale):
    """Every expert on every token with W + scale A B (computed as x W + scale (x A) B), weighted by the chosen
    experts' routing weights: independent of the sort, grouped matmuls and scatter."""
    X = wg.shape[0]
    outs = []
    for e in range(X):
        g, u = x @ wg[e], x @ wu[e]
        if "gate_up_a" in ad:
            xa = x @ ad["gate_up_a"][e]
            g = g + scale * (xa @ ad["gate_b"][e]) if "gate_b" in ad else g
            u = u + scale * (xa @ ad["up_b"][e]) if "up_b" in ad else u
        h = jax.nn.silu(g) * u
        y = h @ wd[e]
        if "down_a" in ad:
            y = y + scale * ((h @ ad["down_a"][e]) @ ad["down_b"][e])
        outs.append(y)
    dense_w = jnp.zeros((x.shape[0], X)).at[jnp.arange(x.shape[0])[:, None], ids].set(w)
    return jnp.einsum("nx,nxd->nd", dense_w, jnp.stack(outs, axis=1))


_ALL = ("gate_up_a", "gate_b", "up_b", "down_a", "down_b")
_UP, _DOWN = ("gate_up_a", "up_b"), ("down_a", "down_b")


# every kernel with every adapter; the target subsets on ragged in the suite, on tiled / megablox in `slow`
@pytest.mark.parametrize("kernel,keys", [
    pytest.param(k, keys, id=f"{name}-{k}", marks=[pytest.mark.slow] if name != "all" and k != "ragged" else [])
    for name, keys in (("all", _ALL), ("up", _UP), ("down", _DOWN)) for k in KERNELS])
def test_grouped_lora_equals_dense_reference_values_and_adapter_gradients(kernel, keys):
    """Skewed routing (one expert takes most rows, one none): the grouped forward with adapters equals the
    dense reference, and so do the gradients w.r.t. every adapter (fp32)."""
    rng = np.random.default_rng(5)
    N, D, F, X, k, r = 29, 16, 8, 5, 2, 3
    f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)  # noqa: E731
    x, router = f32(N, D), f32(D, X)
    wg, wu, wd = 0.3 * f32(X, D, F), 0.3 * f32(X, D, F), 0.3 * f32(X, F, D)
    shapes = {"gate_up_a": (X, D, r), "gate_b": (X, r, F), "up_b": (X, r, F), "down_a": (X, F, r), "down_b": (X, r, D)}
    ad = {key: 0.5 * f32(*shapes[key]) for key in keys}
    scale = 1.7
    ids, _, logits = routing(x, router, k, True)
    ids = ids.at[: N - 4].set(jnp.asarray([1, 3])).at[N - 4:].set(jnp.asarray([2, 0]))  # 1, 3 most rows; 4 none
    w = jnp.take_along_axis(jax.nn.softmax(logits, -1), ids, -1)
    cot = f32(N, D)

    def grouped(ad):
        return grouped_swiglu(x, ids, w, wg, wu, wd, kernel, {**ad, "scale": scale})

    def dense(ad):
        return _dense_reference(x, ids, w, wg, wu, wd, ad, scale)

    out, ref = jax.jit(grouped)(ad), jax.jit(dense)(ad)
    assert np.abs(np.asarray(ref - dense({}))).max() > 1e-1
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    g_grouped = jax.jit(jax.grad(lambda a: jnp.sum(grouped(a) * cot)))(ad)
    g_dense = jax.jit(jax.grad(lambda a: jnp.sum(dense(a) * cot)))(ad)
    for key in keys:
        assert np.abs(np.asarray(g_dense[key])).max() > 1e-2, key
        np.testing.assert_allclose(np.asarray(g_grouped[key]), np.asarray(g_dense[key]), rtol=1e-4, atol=1e-5,
                                   err_msg=key)
    # an expert without rows gets no gradient
    idle = sorted(set(range(X)) - set(np.asarray(ids).ravel().tolist()))
    assert idle and not np.any(np.asarray(g_grouped[keys[-1]])[idle])


def test_model_adapter_gradients_equal_the_dense_reference(monkeypatch):
    """Through the whole model (the trainer's loss shape): gradients w.r.t. the expert adapters with the
    grouped kernel equal those with the dense every-expert MoE."""
    from jaxrl_async.models import moe as moe_lib

    params = _random_adapters(init_params(CFG, jax.random.key(0)), std=0.1)
    adapters, base = lora.split(params)
    tok = _tokens(2, B=2, T=12)
    seg = jnp.asarray(np.r_[np.ones(12), np.ones(8), np.zeros(4)].reshape(2, 12), jnp.int32)

    def loss(a):
        return sequence_logprobs(lora.join(a, base), CFG, tok, seg)[0].sum()

    g = jax.jit(jax.grad(loss))(adapters)["layers"]

    def dense_swiglu(x, ids, w, wg, wu, wd, impl=None, *, lora):
        return _dense_reference(x, ids, w, wg, wu, wd, {k: v for k, v in lora.items() if k != "scale"}, lora["scale"])

    monkeypatch.setattr(moe_lib, "grouped_swiglu", dense_swiglu)
    g_ref = jax.jit(jax.grad(loss))(adapters)["layers"]
    for key in ("moe_gate_up_lora_a", "moe_gate_up_lora_b", "moe_down_lora_a", "moe_down_lora_b", "q_lora_b"):
        assert np.abs(np.asarray(g_ref[key])).max() > 1e-3, key
        np.testing.assert_allclose(np.asarray(g[key]), np.asarray(g_ref[key]), rtol=1e-4, atol=1e-6, err_msg=key)


@pytest.mark.parametrize("targets", [("gate",), ("up", "down"), ("q", "gate", "up")])
def test_target_subsets(targets):
    """Only the configured halves are adapted (gate alone: B has one slice; an unadapted half's weight is
    untouched by merge), and the forward equals the merged model."""
    cfg = MOE.replace(lora=lora.LoraSpec(rank=2, alpha=3.0, targets=targets))
    params = _random_adapters(init_params(cfg, jax.random.key(0)))
    layers = params["layers"]
    halves = [t for t in ("gate", "up") if t in targets]
    assert ("moe_gate_up_lora_a" in layers) == bool(halves)
    if halves:
        assert layers["moe_gate_up_lora_b"].shape[3] == len(halves)
    assert ("moe_down_lora_a" in layers) == ("down" in targets)
    merged = lora.merge(params, cfg.lora)
    for t in ("gate", "up", "down"):
        same = np.array_equal(np.asarray(merged["layers"][f"moe_{t}"]), np.asarray(layers[f"moe_{t}"]))
        assert same == (t not in targets), t
    tok = _tokens(4)
    np.testing.assert_allclose(np.asarray(_apply(params, cfg, tok)), np.asarray(_apply(merged, MOE, tok)),
                               atol=1e-5, rtol=0)


def test_mixed_stacks_dense_layers_take_dense_adapters():
    """A mixture of experts with a dense-MLP layer: the dense stack gets gate/up/down adapters, the sparse
    stack per-expert ones; zero adapters are bit-identical and trained ones equal the merged model."""
    mixed = MOE.replace(num_layers=3, mlp_only_layers=(1,))
    cfg = mixed.replace(lora=SPEC)
    params = init_params(cfg, jax.random.key(0))
    assert "gate_lora_a" in params["dense_layers"] and "moe_gate_up_lora_a" in params["layers"]
    _, base = lora.split(params)
    tok = _tokens(6)
    np.testing.assert_array_equal(np.asarray(_apply(params, cfg, tok)), np.asarray(_apply(base, mixed, tok)))
    params = _random_adapters(params)
    np.testing.assert_allclose(np.asarray(_apply(params, cfg, tok)),
                               np.asarray(_apply(lora.merge(params, SPEC), mixed, tok)), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_megablox_with_expert_adapters_under_a_mesh_equals_ragged():
    """The megablox path runs in shard_map (adapters gathered with the expert weights): log-probs and adapter
    gradients equal the ragged_dot model's."""
    from jaxrl_async.sharding.activations import activation_rules

    mesh = make_mesh({"fsdp": 4, "expert": 2})
    params = jax.device_put(_random_adapters(init_params(CFG, jax.random.key(0)), std=0.1),
                            model_shardings(CFG, mesh, "trainer"))
    adapters, base = lora.split(params)
    tok = _tokens(8, B=4, T=12)
    seg = jnp.ones((4, 12), jnp.int32)

    def run(kernel):
        c = CFG.replace(moe_kernel=kernel)

        def f(a):
            with activation_rules(mesh, "trainer"):
                return jax.value_and_grad(lambda a: sequence_logprobs(lora.join(a, base), c, tok, seg)[0].sum())(a)

        return jax.jit(f)(adapters)

    v_ref, g_ref = run("ragged")
    v_mb, g_mb = run("megablox")
    np.testing.assert_allclose(float(v_mb), float(v_ref), rtol=1e-6)
    for key in ("moe_gate_up_lora_a", "moe_gate_up_lora_b", "moe_down_lora_a", "moe_down_lora_b"):
        a, b = np.asarray(g_ref["layers"][key]), np.asarray(g_mb["layers"][key])
        assert np.abs(a).max() > 1e-3
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg=key)


def test_run_config_refuses_dropout_on_expert_adapters_naming_the_field():
    """PEFT's target_parameters take no dropout, nor do ours: the run config's one-line error names
    model.lora.dropout; attention-only adapters on the same model keep their dropout."""
    import dataclasses

    from jaxrl_async.config import ConfigError, LoraSection, validate
    from jaxrl_async.config.default import get_config

    cfg = get_config()
    moe = dataclasses.replace(cfg.model, model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                              moe_intermediate_size=32)
    bad = dataclasses.replace(cfg, model=dataclasses.replace(moe, lora=LoraSection(rank=4, dropout=0.1)))
    with pytest.raises(ConfigError, match=r"model\.lora\.dropout: 0\.1: the expert adapters"):
        validate(bad, 2)
    ok = LoraSection(rank=4, dropout=0.1, targets=("q", "v"))
    validate(dataclasses.replace(cfg, model=dataclasses.replace(moe, lora=ok)), 2)
