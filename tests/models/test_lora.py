"""LoRA adapters (models/lora.py): the forward is base + (alpha/r) x A B, a zero B leaves the logits
bit-identical, the adapters are rows of the parameter table (shapes, logical axes, shardings), merge
folds them into the weights, config mistakes name the field."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models import lora
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import apply, init_params, logical_axes, param_shapes
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import make_mesh

BASE = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=8, rope_theta=10000.0)
SPEC = lora.LoraSpec(rank=4, alpha=8.0)
CFG = BASE.replace(lora=SPEC)


def _tokens(seed=0, B=3, T=11):
    return jnp.asarray(np.random.default_rng(seed).integers(0, BASE.vocab_size, (B, T)), jnp.int32)


def _random_adapters(params, seed=1, std=0.3):
    """Non-zero A and B (a trained adapter)."""
    adapters, base = lora.split(params)
    keys = jax.random.split(jax.random.key(seed), len(adapters["layers"]))
    adapters = {"layers": {k: std * jax.random.normal(kk, v.shape, v.dtype)
                           for kk, (k, v) in zip(keys, sorted(adapters["layers"].items()))}}
    return lora.join(adapters, base)


def test_adapter_rows_of_the_parameter_table():
    shapes, axes = param_shapes(CFG)["layers"], logical_axes(CFG)["layers"]
    r, L, D, H, K, E, F = 4, 2, 32, 4, 2, 8, 48
    assert shapes["q_lora_a"].shape == (L, D, r) and shapes["q_lora_b"].shape == (L, r, H, E)
    assert shapes["k_lora_b"].shape == (L, r, K, E) and shapes["o_lora_a"].shape == (L, H, E, r)
    assert shapes["o_lora_b"].shape == (L, r, D) and shapes["down_lora_a"].shape == (L, F, r)
    assert axes["q_lora_a"] == ("layers", "embed", None) and axes["q_lora_b"] == ("layers", None, "heads", "head_dim")
    assert axes["down_lora_b"] == ("layers", None, "embed") and axes["gate_lora_b"] == ("layers", None, "mlp")
    assert sorted(k for k in shapes if lora.is_adapter_key(k)) == sorted(
        f"{t}_lora_{x}" for t in lora.TARGETS for x in "ab")
    # the trainer and generator rule sets shard them like their base weights; the rank stays whole
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    sh = model_shardings(CFG, mesh, "trainer")["layers"]
    assert tuple(sh["q_lora_a"].spec) == (None, "fsdp", None)
    assert tuple(sh["q_lora_b"].spec) == (None, None, "tensor", None)
    gmesh = make_mesh({"data": 4, "tensor": 2}, axis_names=("data", "tensor"))
    gsh = model_shardings(CFG, gmesh, "generator")["layers"]
    assert tuple(gsh["gate_lora_b"].spec) == (None, None, "tensor")


def test_init_like_peft_b_zero_and_zero_adapter_is_bit_identical():
    params = init_params(CFG, jax.random.key(0))
    layers = params["layers"]
    for t in lora.TARGETS:
        a, b = np.asarray(layers[f"{t}_lora_a"]), np.asarray(layers[f"{t}_lora_b"])
        fan_in = int(np.prod(layers[t].shape[1:1 + lora.TARGETS[t][1]]))
        assert np.all(b == 0)
        assert np.abs(a).max() <= 1 / np.sqrt(fan_in) and np.abs(a).max() > 0.5 / np.sqrt(fan_in)
    _, base = lora.split(params)
    tok = _tokens()
    for scan in (True, False):
        got = apply(params, CFG.replace(scan_layers=scan), tok)
        want = apply(base, BASE.replace(scan_layers=scan), tok)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_forward_is_base_plus_scaled_low_rank_update():
    params = _random_adapters(init_params(CFG, jax.random.key(0)))
    adapters, base = lora.split(params)
    tok = _tokens(3)
    got = np.asarray(apply(params, CFG, tok))
    # the reference: every target weight replaced by W + (alpha / r) A B, computed independently in numpy
    ref = jax.tree.map(np.asarray, base)
    for t, (w_sub, n_in) in lora.TARGETS.items():
        a = np.asarray(adapters["layers"][f"{t}_lora_a"], np.float64)
        b = np.asarray(adapters["layers"][f"{t}_lora_b"], np.float64)
        ab = np.einsum(f"l{w_sub[:n_in]}r,lr{w_sub[n_in:]}->l{w_sub}", a, b)
        ref["layers"][t] = (ref["layers"][t] + SPEC.scale * ab).astype(np.float32)
    want = np.asarray(apply(ref, BASE, tok))
    assert np.abs(want - np.asarray(apply(base, BASE, tok))).max() > 1e-2  # the adapters matter
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    # lora.merge is that reference
    merged = lora.merge(params, SPEC)
    assert not lora.has_adapters(merged)
    for t in lora.TARGETS:
        np.testing.assert_allclose(np.asarray(merged["layers"][t]), ref["layers"][t], atol=1e-6, rtol=0)
    # only the configured targets are adapted
    cfg_q = BASE.replace(lora=lora.LoraSpec(rank=2, alpha=2.0, targets=("q", "down")))
    p_q = init_params(cfg_q, jax.random.key(0))
    assert sorted(k for k in p_q["layers"] if lora.is_adapter_key(k)) == [
        "down_lora_a", "down_lora_b", "q_lora_a", "q_lora_b"]


def test_adapters_without_lora_config_and_bad_specs_name_the_field():
    params = init_params(CFG, jax.random.key(0))
    with pytest.raises(ValueError, match="ModelConfig.lora is None"):
        apply(params, BASE, _tokens())
    for kw, field in ((dict(rank=0), "rank"), (dict(alpha=-1.0), "alpha"), (dict(targets=("qkv",)), "targets"),
                      (dict(dropout=1.0), "dropout"), (dict(base_dtype="int8"), "base_dtype"),
                      (dict(targets=()), "targets")):
        with pytest.raises(ValueError, match=rf"^ModelConfig\.lora\.{field}:"):
            lora.LoraSpec(**kw)
    assert ModelConfig(**{**BASE.__dict__, "lora": {"rank": 2, "alpha": 4, "targets": ["q"]}}).lora == \
        lora.LoraSpec(rank=2, alpha=4, targets=("q",))


def test_nnx_module_carries_the_adapters_with_their_logical_axes():
    from flax import nnx

    from jaxrl_async.models.nnx_module import Transformer

    m = Transformer(CFG, rngs=nnx.Rngs(0))
    params = m.params()
    assert sorted(k for k in params["layers"] if lora.is_adapter_key(k)) == sorted(
        f"{t}_lora_{x}" for t in lora.TARGETS for x in "ab")
    assert m.layers["q_lora_b"].get_metadata()["out_sharding"] == ("layers", None, "heads", "head_dim")
    tok = _tokens()
    np.testing.assert_array_equal(np.asarray(m(tok)), np.asarray(apply(params, CFG, tok)))


def test_a_target_without_its_weight_is_named():
    """A model without dense MLP weights (mixture of experts) cannot take gate/up/down adapters: the error
    names the field and the targets it has."""
    from jaxrl_async.models.transformer import lora_param_table, param_table

    layers = {k: v for k, v in param_table(BASE)["layers"].items() if k not in ("gate", "up", "down")}
    with pytest.raises(ValueError, match=r"^ModelConfig\.lora\.targets: gate, up, down has no weight in this model "
                                         r"\(layer weights: q, k, v, o\)"):
        lora_param_table(CFG, layers)
    rows = lora_param_table(BASE.replace(lora=lora.LoraSpec(rank=2, targets=("q", "o"))), layers)
    assert sorted(rows) == ["o_lora_a", "o_lora_b", "q_lora_a", "q_lora_b"]


def test_dropout_only_inside_a_training_key_and_inverted_scaling():
    params = _random_adapters(init_params(CFG, jax.random.key(0)))
    tok = _tokens(5)
    f = jax.jit(apply, static_argnums=1)
    plain = np.asarray(f(params, CFG, tok))
    key = jax.random.key(3)

    def with_key(k, rate):
        def g(p, t):
            with lora.dropout_key(k, rate):
                return apply(p, CFG, t)
        return np.asarray(jax.jit(g)(params, tok))

    np.testing.assert_array_equal(with_key(None, 0.5), plain)  # no key: eval mode
    np.testing.assert_array_equal(with_key(key, 0.0), plain)
    a, b = with_key(key, 0.5), with_key(key, 0.5)
    np.testing.assert_array_equal(a, b)  # deterministic in the key
    assert np.abs(a - plain).max() > 1e-3 and np.abs(with_key(jax.random.key(4), 0.5) - a).max() > 1e-3
    # the mask: a fraction `rate` of the inputs zeroed, the rest scaled by 1 / (1 - rate)
    x = jnp.ones((1, 64, 512), jnp.float32)
    eye = jnp.eye(512, dtype=jnp.float32)[:, :8]  # A picks 8 input features; B sums them
    with lora.dropout_key(key, 0.25):
        y = np.asarray(lora.delta(x, eye, jnp.ones((8, 1), jnp.float32), "gate", 1.0, "btd", "btf"))
    assert set(np.unique(np.round(y * 0.75, 4))) <= set(float(k) for k in range(9))  # sums of 1/(1-p) terms
    kept = y.sum() * 0.75 / (64 * 8)
    assert abs(kept - 0.75) < 0.08, kept


def test_mixture_of_experts_takes_attention_adapters():
    moe = ModelConfig(model_type="qwen3_moe", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=10000.0, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=16)
    spec = lora.LoraSpec(rank=4, alpha=8.0, targets=("q", "k", "v", "o"))
    cfg = moe.replace(lora=spec)
    params = init_params(cfg, jax.random.key(0))
    tok = _tokens(7)
    _, base = lora.split(params)
    np.testing.assert_array_equal(np.asarray(apply(params, cfg, tok)), np.asarray(apply(base, moe, tok)))
    params = _random_adapters(params)
    got = np.asarray(apply(params, cfg, tok))
    want = np.asarray(apply(lora.merge(params, spec), moe, tok))
    assert np.abs(got - np.asarray(apply(base, moe, tok))).max() > 1e-2
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
