"""Sharded HF import on 8 simulated CPU devices gives the same logits as one device."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_async.models import apply, load_hf
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import logical_to_spec, make_mesh, split_devices
from jaxrl_async.testing import make_tiny_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_hf_model(str(tmp_path_factory.mktemp("q3")), "qwen3_untied")


@pytest.mark.parametrize("shape,rules", [
    ({"fsdp": 8}, "trainer"),
    ({"fsdp": 4, "tensor": 2}, "trainer"),
    ({"data": 2, "tensor": 4}, "generator"),
])
def test_sharded_import_same_logits(model_dir, shape, rules):
    assert len(jax.devices()) == 8
    cfg, ref_params = load_hf(model_dir)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (4, 16)))
    ref = np.asarray(apply(ref_params, cfg, tokens))
    mesh = make_mesh(shape)
    cfg, params = load_hf(model_dir, shardings=lambda c: model_shardings(c, mesh, rules))
    # really sharded: the q projection is split over the heads axis (tensor) or embed (fsdp)
    q = params["layers"]["q"]
    assert len(q.sharding.device_set) == 8
    assert q.addressable_shards[0].data.size < q.size
    out = np.asarray(jax.jit(apply, static_argnums=1)(params, cfg, tokens))
    np.testing.assert_allclose(out, ref, atol=2e-5, rtol=0)


def test_rules_resolution():
    mesh = make_mesh({"fsdp": 2, "tensor": 4})
    # kv_heads=2 is not divisible by tensor=4 -> replicated; embed over fsdp
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), (64, 2, 24), "trainer", mesh) == P("fsdp", None, None)
    assert logical_to_spec(("embed", "heads", "head_dim"), (64, 4, 24), "trainer", mesh) == P("fsdp", "tensor", None)
    assert logical_to_spec(("batch", "length"), (8, 16), "trainer", mesh) == P("fsdp", None)
    with pytest.raises(ValueError, match="no sharding rule"):
        logical_to_spec(("nonsense",), (4,), "trainer", mesh)


def test_mesh_helpers_errors():
    with pytest.raises(ValueError, match="needs 6 devices"):
        make_mesh({"data": 2, "tensor": 3})
    gen, tr = split_devices(generator_fraction=0.75)
    assert len(gen) == 6 and len(tr) == 2 and not set(gen) & set(tr)
    m = make_mesh({"data": 3, "tensor": 2}, devices=gen)
    assert m.devices.shape == (3, 2) and set(m.devices.flat) == set(gen)
    one_g, one_t = split_devices(jax.devices()[:1])
    assert one_g == one_t
