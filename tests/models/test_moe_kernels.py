"""The megablox (Pallas TPU grouped matmul) path of the MoE layer, run in Pallas interpret mode on CPU: values
and gradients equal ``jax.lax.ragged_dot`` in fp32, and the whole model with ``moe_kernel="megablox"`` (inside
``shard_map`` on a simulated mesh) gives the ``ragged`` model's log-probs and gradients. The TPU compile of the
same train step is in tests/aot/test_aot_kernels.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models import load_hf, sequence_logprobs
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.kernels.grouped_matmul import grouped_matmul, grouped_matmul_impl, megablox_grouped_matmul
from jaxrl_async.testing import grouped_matmul_against_ragged_dot, make_tiny_hf_model


@pytest.mark.parametrize("tiling", [(512, 1024, 1024), (128, 8, 128)], ids=["default", "k_tiles"])
def test_megablox_equals_ragged_dot_values_and_gradients(tiling):
    """Empty groups, a group spanning row tiles, rows not a multiple of the tile (padded), K split into tiles."""
    out, ref, gm, gr = grouped_matmul_against_ragged_dot(lambda r, w, g: megablox_grouped_matmul(r, w, g, tiling),
                                                         [0, 130, 1, 0, 40, 6], K=16, F=24)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=1e-5, atol=1e-5)
    for a, b in zip(gr, gm):
        assert np.abs(np.asarray(a)).max() > 0
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)
    # the weights' gradient of an empty group is exactly zero
    assert not np.asarray(gm[1])[0].any() and not np.asarray(gm[1])[3].any()


def test_kernel_choice_by_config_and_platform():
    assert grouped_matmul_impl("auto") == "ragged"  # CPU
    assert grouped_matmul_impl("megablox") == "megablox"
    with pytest.raises(ValueError, match="ModelConfig.moe_kernel"):
        ModelConfig(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                    moe_kernel="pallas")
    x = jnp.ones((4, 8))
    assert grouped_matmul(x, jnp.ones((2, 8, 3)), jnp.asarray([1, 3], jnp.int32), "megablox").shape == (4, 3)


def test_model_with_megablox_under_a_mesh_equals_ragged(tmp_path):
    """The MoE layer's megablox path runs inside shard_map (here the expert-parallel exchange: experts split over
    `expert`, tokens over the batch axes): sequence log-probs and parameter gradients equal the ragged_dot model's (fp32)."""
    from jaxrl_async.models.shardings import model_shardings
    from jaxrl_async.sharding import make_mesh
    from jaxrl_async.sharding.activations import activation_rules

    d = make_tiny_hf_model(str(tmp_path / "moe"), "qwen3_moe", num_hidden_layers=3, mlp_only_layers=[1])
    mesh = make_mesh({"fsdp": 4, "expert": 2})
    cfg, params = load_hf(d, shardings=lambda c: model_shardings(c, mesh, "trainer"))
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(3, cfg.vocab_size, (4, 12)), jnp.int32)
    seg = jnp.asarray(np.r_[np.ones(36), np.ones(7), np.zeros(5)].reshape(4, 12), jnp.int32)

    def run(kernel):
        c = cfg.replace(moe_kernel=kernel)

        def f(p):
            with activation_rules(mesh, "trainer"):
                return jax.value_and_grad(lambda p: sequence_logprobs(p, c, tokens, seg)[0].sum())(p)

        return jax.jit(f)(params), str(jax.make_jaxpr(f)(params))

    (v_ref, g_ref), jaxpr_ref = run("ragged")
    (v_mb, g_mb), jaxpr_mb = run("megablox")
    assert "ragged_dot" in jaxpr_ref and "ragged_dot" not in jaxpr_mb  # the kernel replaced ragged_dot
    # an expert axis of 2: both kernels run in the expert-parallel exchange (moe.expert_parallel_swiglu)
    assert "pallas_call" in jaxpr_mb and "shard_map" in jaxpr_mb and "shard_map" in jaxpr_ref
    np.testing.assert_allclose(float(v_mb), float(v_ref), rtol=1e-6)
    for key in ("moe_gate", "moe_up", "moe_down", "router", "q"):
        a, b = np.asarray(g_ref["layers"][key]), np.asarray(g_mb["layers"][key])
        assert np.abs(a).max() > 1e-2
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg=key)  # fp32 sums in another order
