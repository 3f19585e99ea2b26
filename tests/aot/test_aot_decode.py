"""The generator's decode step compiles for its accelerator kernels without the hardware (issue 16).

TPU (libtpu, compile-only slices): `PagedEngine(attention="auto")` picks `tpu_ragged` and its decode step holds
the Pallas/Mosaic ragged paged-attention kernel; a VMEM limit too small for its blocks fails to compile. H100
(CUDA plugin + the shipped target description): `auto` picks `gpu_paged` and the step holds the Triton
paged-attention kernel. Both on a data x tensor mesh (kernel per shard: slots over data, kv heads over tensor).

Needs the extras `[aot-tpu,aot-gpu]` (`.ci/run` adds them to the test environment after the suite; `JAX_PLATFORMS=cpu
.venv/bin/pytest tests/aot`); skipped without them.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jaxrl_async.plan import aot
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.models.transformer import param_shapes
from jaxrl_async.generator.engine import PagedEngine
from jaxrl_async.sharding import make_mesh

needs_tpu = pytest.mark.skipif(not aot.tpu_available(), reason="needs libtpu (extra [aot-tpu]); .ci/run runs "
                               "tests/aot in an environment with it")
needs_gpu = pytest.mark.skipif(not aot.gpu_available(), reason="needs the CUDA plugin (extra [aot-gpu]); "
                               ".ci/run runs tests/aot in an environment with it")

CFG = ModelConfig(vocab_size=2048, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8, num_kv_heads=4,
                  head_dim=128, max_position_embeddings=8192, dtype="bfloat16")


def _sds(tree, shardings):
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def _custom_calls(compiled) -> set[str]:
    return set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text()))


def _compiled_decode_step(kind: str, attention: str = "auto", **engine_kw):
    devs = aot.tpu_devices("v5e:2x2") if kind == "tpu" else aot.h100_devices(4)
    mesh = make_mesh({"data": 2, "tensor": 2}, devices=devs)
    eng = PagedEngine(CFG, mesh, max_concurrent_decodes=16, max_sequence_length=4096, prefill_buckets=(512,),
                      page_size=16, num_pages=2048, attention=attention, **engine_kw)
    params = _sds(param_shapes(CFG), eng.param_shardings)
    arrays = _sds(jax.eval_shape(eng._init_arrays), eng.state_shardings)
    new_pages = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=eng.slot_sharding)
    with jax.set_mesh(mesh):  # Pallas TPU reads the device kind from the current mesh
        return eng, eng._step.lower(params, arrays, new_pages).compile()


@needs_tpu
def test_tpu_decode_step_compiles_with_the_ragged_paged_attention_kernel():
    eng, c = _compiled_decode_step("tpu")
    assert eng.attention == "tpu_ragged" and eng.layout.keys == ("kv_pool",)
    assert eng.pool_sharding.spec[3] == "tensor"  # the combined 2K axis split like the kv heads
    assert eng.pool_sharding.spec[1] == "data"  # each decode replica holds its own pages
    assert "tpu_custom_call" in _custom_calls(c) and "ragged_paged_attention" in c.as_text()
    # per device: the pool (2048 / 2 replicas pages x 16 x 2 layers x 2 x 4/2 heads x 128 x bf16 = 32 MiB), slots,
    # params; a pool replicated over data would be 64 MiB
    assert 32 << 20 <= c.memory_analysis().argument_size_in_bytes < 64 << 20


@needs_tpu
def test_tpu_ragged_kernel_vmem_limit_is_real():
    with pytest.raises(Exception, match="CompileTimeScopedVmemOom"):
        _compiled_decode_step("tpu", kernel_options={"vmem_limit_bytes": 64 << 10, "pages_per_block": 64})


@needs_gpu
def test_gpu_decode_step_compiles_with_the_paged_attention_kernel():
    eng, c = _compiled_decode_step("gpu")
    assert eng.attention == "gpu_paged" and eng.layout.keys == ("k_pool", "v_pool")
    assert eng.pool_sharding.spec[0] == "tensor"  # heads-first layout, kv heads over tensor
    assert eng.pool_sharding.spec[2] == "data"  # each decode replica holds its own pages
    assert "__gpu$xla.gpu.triton" in _custom_calls(c) and "paged_attention" in c.as_text()
    assert 32 << 20 <= c.memory_analysis().argument_size_in_bytes < 64 << 20


@needs_gpu
def test_gpu_paged_kernel_too_large_for_shared_memory_fails_to_compile():
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        _compiled_decode_step("gpu", kernel_options={"pages_per_block": 256, "k_splits": 1})


@pytest.mark.parametrize("kind", [pytest.param("gpu", marks=needs_gpu), pytest.param("tpu", marks=needs_tpu)])
def test_portable_decode_step_compiles_for_the_target(kind):
    """The portable live-length path also compiles for both targets (no kernel: the fallback)."""
    eng, c = _compiled_decode_step(kind, attention="blocked")
    assert eng.attention == "blocked"
    assert not {"tpu_custom_call", "__gpu$xla.gpu.triton"} & _custom_calls(c)
