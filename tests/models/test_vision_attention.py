"""The vision tower's attention behind its switch (`vision.VISION_ATTENTION_IMPLS`): ``blockwise`` (non-causal
segment-masked flash attention, `kernels.flash.blockwise_attention(causal=False)`) equals the dense ``xla``
reference in float32 (features and gradients, windows cut short, several images, t = 2 frames, the released
112 px windows of 14 px patches) and transformers' features; at a realistic patch count (one 1280-token image =
5120 patches) its compiled forward+backward holds no [N, N] buffer and a small fraction of the dense one's
temporaries."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.kernels.flash import blockwise_attention, grouped_attention, run_ends, run_starts
from jaxrl_async.models import vision
from jaxrl_async.models.transformer import init_from_table
from jaxrl_async.models.vision import VisionConfig

TOL = 1e-5


def _tower(v: VisionConfig, seed=0):
    params = init_from_table(vision.param_table(v, v.out_hidden_size), jax.random.PRNGKey(seed), "float32", 0.1)
    # non-trivial norms and biases (the table initialises them to ones / zeros)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed + 1), len(leaves))
    leaves = [x + 0.05 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(tree, leaves)


def _features(v, params, grids, impl, seed=0):
    lay = vision.vision_layout(v, grids).arrays()
    pixels = jnp.asarray(np.random.default_rng(seed).standard_normal((vision.num_patches(grids), v.patch_dim)),
                         jnp.float32)
    fn = jax.jit(lambda p, x: vision.vision_tower(p, v, x, lay, attention=impl))
    return fn, pixels


def test_non_causal_blockwise_kernel_matches_dense():
    rng = np.random.default_rng(0)
    lens = [5, 64, 17, 1, 40, 60, 16]
    T = sum(lens)
    seg = jnp.asarray(np.concatenate([np.full(n, i + 1) for i, n in enumerate(lens)])[None])
    q = jnp.asarray(rng.standard_normal((1, T, 4, 8)), jnp.float32)
    k, val = (jnp.asarray(rng.standard_normal((1, T, 2, 8)), jnp.float32) for _ in range(2))
    mask = seg[:, :, None] == seg[:, None, :]
    np.testing.assert_array_equal(np.asarray(run_ends(seg))[0], np.repeat(np.cumsum(lens) - 1, lens))
    assert int(run_starts(seg)[0, 10]) == 5
    w = jnp.sin(jnp.arange(8.0))

    def loss(f):
        return lambda *a: (f(*a) * w).sum()

    ref = lambda q, k, v: grouped_attention(q, k, v, mask, 0.3)  # noqa: E731
    g_ref = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, val)
    for bq, bk in [(32, 16), (512, 512)]:
        f = functools.partial(blockwise_attention, segment_ids=seg, scale=0.3, block_q=bq, block_k=bk, causal=False)
        assert float(jnp.abs(f(q, k, val) - ref(q, k, val)).max()) <= TOL
        for a, b in zip(jax.grad(loss(f), argnums=(0, 1, 2))(q, k, val), g_ref):
            assert float(jnp.abs(a - b).max()) <= TOL
    # causal rows still differ (the flag is not ignored)
    causal = blockwise_attention(q, k, val, seg, 0.3, 64, 64)
    assert float(jnp.abs(causal - ref(q, k, val)).max()) > 1e-2


# (tower, image grids): the tiny checkpoint's geometry (4 px patches, windows of 2 x 2 merge units = 16 patches, cut
# short), and the released one (14 px patches in 112 px windows = 64 patches; two images, partial windows)
GEOMETRIES = [
    (VisionConfig(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=4, window_size=16,
                  out_hidden_size=64, fullatt_block_indexes=(1,)), [(1, 6, 10), (2, 4, 4), (1, 2, 14)]),
    (VisionConfig(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                  fullatt_block_indexes=(1,)), [(1, 20, 28), (1, 10, 6)]),
]


@pytest.mark.parametrize("v, grids", GEOMETRIES)
def test_blockwise_tower_equals_dense(v, grids):
    params = _tower(v)
    dense, pixels = _features(v, params, grids, "xla")
    block, _ = _features(v, params, grids, "blockwise")
    ref, ours = dense(params, pixels), block(params, pixels)
    assert ours.shape == ref.shape
    assert float(jnp.abs(ours - ref).max()) <= TOL
    # the windows matter at this geometry (a tower attending whole frames everywhere differs)
    lay = vision.vision_layout(v, grids).arrays()
    full = vision.vision_tower(params, v, pixels, dict(lay, window_ids=lay["frame_ids"]), attention="blockwise")
    assert float(jnp.abs(full - ref).max()) > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("v, grids", GEOMETRIES)
def test_blockwise_tower_gradients_equal_dense(v, grids):
    params = _tower(v)
    dense, pixels = _features(v, params, grids, "xla")
    block, _ = _features(v, params, grids, "blockwise")
    ref = dense(params, pixels)
    w = jax.random.normal(jax.random.PRNGKey(3), ref.shape)
    g_ref = jax.grad(lambda p, x: (dense(p, x) * w).sum(), argnums=(0, 1))(params, pixels)
    g = jax.grad(lambda p, x: (block(p, x) * w).sum(), argnums=(0, 1))(params, pixels)
    err = max(float(jnp.abs(a - b).max() / (1 + jnp.abs(b).max())) for a, b in zip(jax.tree.leaves(g),
                                                                                  jax.tree.leaves(g_ref)))
    assert err <= TOL


def test_auto_and_errors():
    assert vision.resolve_vision_attention("auto", 64) == "xla"
    assert vision.resolve_vision_attention("auto", 5120) == "blockwise"
    assert VisionConfig().window_patches == 64
    with pytest.raises(ValueError, match="vision attention must be one of"):
        vision.resolve_vision_attention("splash", 64)


@pytest.mark.slow
def test_blockwise_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from jaxrl_async.models import load_hf, qwen2_5_vl
    from jaxrl_async.testing import make_tiny_vl_model

    d = make_tiny_vl_model(str(tmp_path / "tiny_vl"))
    hf = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(d, dtype=torch.float32).eval()
    cfg, params = load_hf(d)
    grids = [(1, 6, 10), (2, 4, 4)]
    pixels = np.random.default_rng(1).standard_normal((vision.num_patches(grids), cfg.vision.patch_dim)).astype(
        np.float32)
    with torch.no_grad():
        ref = torch.cat(hf.model.get_image_features(torch.tensor(pixels), torch.tensor(grids)).pooler_output).numpy()
    lay = vision.vision_layout(cfg.vision, grids).arrays()
    ours = np.asarray(qwen2_5_vl.image_features(params, cfg, jnp.asarray(pixels), lay, attention="blockwise"))
    assert np.abs(ours - ref).max() <= 1e-4  # the model file's tolerance against transformers


def _compiled_grad(v, grids, impl):
    lay = {k: jax.ShapeDtypeStruct(a.shape, a.dtype) for k, a in vision.vision_layout(v, grids).arrays().items()}
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, jnp.float32),
                          jax.eval_shape(lambda: _tower_shapes(v)))
    pixels = jax.ShapeDtypeStruct((vision.num_patches(grids), v.patch_dim), jnp.float32)

    def loss(p, x, layout):
        return vision.vision_tower(p, v, x, layout, jnp.bfloat16, attention=impl, remat="full").astype(
            jnp.float32).sum()

    return jax.jit(jax.grad(loss)).lower(params, pixels, lay).compile()


def _tower_shapes(v):
    return init_from_table(vision.param_table(v, v.out_hidden_size), jax.random.PRNGKey(0), "float32", 0.02)


def test_realistic_patch_count_compiles_without_n_by_n():
    """One image of 1280 visual tokens (Qwen2.5-VL's default max_pixels): a 64 x 80 patch grid, N = 5120. The
    dense reference materialises [Hv, N, N] float32 scores per block; the blockwise tower has no N x N buffer."""
    v = VisionConfig(depth=2, hidden_size=256, intermediate_size=512, num_heads=16, out_hidden_size=256,
                     fullatt_block_indexes=(1,))
    grids = [(1, 64, 80)]
    n = vision.num_patches(grids)
    assert n == 5120 and n // v.merge_unit == 1280
    block = _compiled_grad(v, grids, "blockwise")
    hlo = block.as_text()
    assert not re.search(rf"\b{n},{n}\b", hlo), "an N x N buffer in the blockwise tower"
    dense = _compiled_grad(v, grids, "xla")
    assert re.search(rf"\b{n},{n}\b", dense.as_text())
    t_block, t_dense = block.memory_analysis().temp_size_in_bytes, dense.memory_analysis().temp_size_in_bytes
    assert t_dense >= v.num_heads * n * n * 4  # at least one block's float32 scores
    assert t_block * 10 < t_dense, (t_block, t_dense)
