"""The trainer's accelerator attention kernels compile for their real targets, without the hardware.

TPU (libtpu, compile-only v5e:2x2 slice): the train step with `model.attention=splash` (and `auto`, which
picks it on TPU) holds the Pallas/Mosaic kernel; a block too large for VMEM fails to compile. H100 (CUDA
plugin + `jaxrl_async/targets/h100_sxm.txtpb`): the train step with `gpu_flash` (and `auto`) holds the
Triton kernel; a block too large for shared memory fails to compile. So the check is real both ways.

Needs the extras `[aot-tpu,aot-gpu]`; `.ci/run` runs this file in an environment of its own. In the test
environment without them every test is skipped with that reason.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_async.plan import aot
from jaxrl_async.kernels.attention_pallas import gpu_flash_attention, splash_attention
from jaxrl_async.models.config import ModelConfig
from jaxrl_async.plan.planner import _abstract_batch, _abstract_state
from jaxrl_async.sharding import make_mesh
from jaxrl_async.sharding.activations import activation_rules
from jaxrl_async.trainer.train_step import Trainer, TrainStepConfig

needs_tpu = pytest.mark.skipif(not aot.tpu_available(), reason="needs libtpu (extra [aot-tpu]); .ci/run runs "
                               "tests/aot in an environment with it")
needs_gpu = pytest.mark.skipif(not aot.gpu_available(), reason="needs the CUDA plugin (extra [aot-gpu]); "
                               ".ci/run runs tests/aot in an environment with it")


def _mesh(kind: str):
    devs = aot.tpu_devices("v5e:2x2") if kind == "tpu" else aot.h100_devices(4)
    return make_mesh((2, 2), ("fsdp", "tensor"), devices=devs)


#: the 2-layer model of the FSDP checks (hidden 512, 8 heads / 4 kv heads x 64, MLP 1024, vocab 4096)
FSDP_MODEL = ModelConfig(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_layers=2, num_heads=8,
                         num_kv_heads=4, head_dim=64, max_position_embeddings=4096, dtype="bfloat16", remat="full")


def _compile_step(mesh, cfg: ModelConfig, batch_shape: tuple[int, int, int]):
    """The trainer's step (``Trainer._step_fn``) for ``cfg`` on ``mesh``, compiled from abstract arguments."""
    tr = Trainer(cfg, TrainStepConfig(), mesh=mesh)
    state, batch = _abstract_state(tr), _abstract_batch(batch_shape, tr.batch_sharding)
    scalar = lambda dt: jax.ShapeDtypeStruct((), dt, sharding=tr.replicated)  # noqa: E731
    return tr._step_fn(5).lower(state, batch, scalar(jnp.float32), scalar(jnp.int32)).compile()


def _compiled_train_step(mesh, attention: str, row_len: int = 2048, rows: int = 2):
    cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=128, max_position_embeddings=max(8192, 2 * row_len),
                      attention=attention, dtype="bfloat16", remat="full")
    return _compile_step(mesh, cfg, (1, rows, row_len))


def _kernel_grad(mesh, kernel, block: int, T: int):
    def fn(q, k, v, seg):
        with activation_rules(mesh, "trainer"):
            return jax.grad(lambda q: kernel(q, k, v, seg, 0.1, block=block).astype(jnp.float32).sum())(q)

    sds = lambda s, spec, dt: jax.ShapeDtypeStruct(s, dt, sharding=NamedSharding(mesh, spec))  # noqa: E731
    heads = P("fsdp", None, "tensor")
    args = (sds((4, T, 8, 128), heads, jnp.bfloat16), sds((4, T, 4, 128), heads, jnp.bfloat16),
            sds((4, T, 4, 128), heads, jnp.bfloat16), sds((4, T), P("fsdp"), jnp.int32))
    return jax.jit(fn).lower(*args).compile()


@needs_tpu
@pytest.mark.parametrize("attention", ["splash", "auto"])
def test_train_step_with_splash_compiles_for_tpu(attention):
    c = _compiled_train_step(_mesh("tpu"), attention)
    assert "tpu_custom_call" in c.as_text()  # the Mosaic kernel, not an XLA fallback
    assert c.memory_analysis().temp_size_in_bytes > 0


@needs_tpu
def test_splash_block_too_large_for_vmem_fails_to_compile():
    mesh = _mesh("tpu")
    _kernel_grad(mesh, splash_attention, 512, 2048)  # control: the default block compiles
    with pytest.raises(Exception, match="vmem"):
        _kernel_grad(mesh, splash_attention, 8192, 8192)


@needs_gpu
@pytest.mark.parametrize("attention", ["gpu_flash", "auto"])
def test_train_step_with_gpu_flash_compiles_for_h100(attention):
    c = _compiled_train_step(_mesh("gpu"), attention)
    assert "triton" in c.as_text().lower()  # the Pallas-Triton kernel
    assert c.memory_analysis().temp_size_in_bytes > 0


@needs_gpu
def test_gpu_flash_block_too_large_for_shared_memory_fails_to_compile():
    mesh = _mesh("gpu")
    _kernel_grad(mesh, gpu_flash_attention, 128, 2048)  # control
    with pytest.raises(Exception, match="Shared memory size limit exceeded"):
        _kernel_grad(mesh, gpu_flash_attention, 512, 2048)


def _all_gathers(hlo: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of every array an all-gather of the compiled program produces."""
    import re

    out = []
    for line in hlo.split("\n"):
        line = line.strip()
        if not re.match(r"%all-gather(-start)?(\.\d+)? = ", line):
            continue
        head = line.split(" all-gather")[0]
        shapes = re.findall(r"(bf16|f32|s32|u32)\[([\d,]*)\]", head)
        if "-start" in line:  # async form: (operands, results)
            shapes = shapes[len(shapes) // 2:]
        out += [(dt, tuple(int(d) for d in s.split(",") if d)) for dt, s in shapes]
    return out


@pytest.mark.parametrize("kind", [pytest.param("gpu", marks=needs_gpu), pytest.param("tpu", marks=needs_tpu)])
def test_fsdp_all_gathers_move_bf16_weights(kind):
    """FSDP gathers the layer weights in the compute dtype (bf16), not the fp32 master weights: XLA moves the
    convert before the all-gather on both targets. (On TPU the only fp32 all-gathers are the [B, T, D]
    cotangents of the embedding lookup, gathered for the scatter-add into the embedding gradient.)"""
    devs = aot.tpu_devices("v5e:2x2") if kind == "tpu" else aot.h100_devices(4)
    gathers = _all_gathers(_compile_step(make_mesh((4,), ("fsdp",), devices=devs), FSDP_MODEL, (1, 4, 512)).as_text())
    weight_shapes = {(512, 8, 64), (512, 4, 64), (8, 64, 512), (512, 1024), (1024, 512)}  # one layer's q k/v o mlp
    assert {s for dt, s in gathers if dt == "bf16"} >= {(512, 8, 64), (512, 1024)}, gathers  # gathers exist
    assert not [s for dt, s in gathers if dt == "f32" and s in weight_shapes], gathers


@pytest.mark.parametrize("kind", [pytest.param("gpu", marks=needs_gpu), pytest.param("tpu", marks=needs_tpu)])
def test_layer_gradients_stay_sharded_in_the_scan(kind):
    """The layer loop's backward reduce-scatters each layer's weight gradient: no full-size (unsharded)
    float32 stack of a layer weight exists in the compiled step (before the loop constrained its weights,
    the H100 compile accumulated f32[L, D, F] gradients of every layer: 7 GiB per MLP matrix for 8B)."""
    devs = aot.tpu_devices("v5e:2x2") if kind == "tpu" else aot.h100_devices(4)
    hlo = _compile_step(make_mesh((4,), ("fsdp",), devices=devs), FSDP_MODEL, (1, 4, 512)).as_text()
    full = ["f32[2,512,1024]", "f32[2,1024,512]", "f32[2,512,8,64]", "f32[2,8,64,512]"]
    assert "f32[2,128,1024]" in hlo or "f32[2,256,1024]" in hlo  # the sharded stacks are there
    assert not [s for s in full if s in hlo], [s for s in full if s in hlo]


@pytest.mark.parametrize("kind", [pytest.param("gpu", marks=needs_gpu), pytest.param("tpu", marks=needs_tpu)])
def test_context_parallel_train_step_compiles_and_halves_the_row(kind):
    """The train step on an fsdp 2 x context 2 mesh compiles for the target (TPU: splash with the mask split
    over context; GPU: blockwise on query chunks) and needs less temporary memory per device than fsdp 4
    with a whole row per device (half a row each)."""
    devs = aot.tpu_devices("v5e:2x2") if kind == "tpu" else aot.h100_devices(4)
    temps = {}
    for shape, axes, rows in (((2, 2), ("fsdp", "context"), 2), ((4,), ("fsdp",), 4)):
        c = _compiled_train_step(make_mesh(shape, axes, devices=devs), "auto", row_len=8192, rows=rows)
        temps[axes[-1]] = c.memory_analysis().temp_size_in_bytes
        if axes[-1] == "context" and kind == "tpu":
            assert "tpu_custom_call" in c.as_text()  # the splash kernel runs on the chunks
    assert temps["context"] < 0.75 * temps["fsdp"], temps


@needs_gpu
def test_moe_grouped_matmul_on_h100_is_not_dense():
    """XLA:GPU lowers ragged_dot densely (every row against every expert); the tiled path the MoE layer picks on
    GPUs keeps the temporaries near the rows' own size. Same shapes, both compiled for H100."""
    from jaxrl_async.kernels.grouped_matmul import grouped_matmul, grouped_matmul_impl

    mesh = make_mesh((1,), ("data",), devices=aot.h100_devices(1))
    sh = NamedSharding(mesh, P())
    M, K, F, X = 8192, 512, 256, 64
    args = (jax.ShapeDtypeStruct((M, K), jnp.bfloat16, sharding=sh), jax.ShapeDtypeStruct((X, K, F), jnp.float32,
            sharding=sh), jax.ShapeDtypeStruct((X,), jnp.int32, sharding=sh))
    temps = {}
    for impl in ("ragged", "tiled"):
        c = jax.jit(lambda r, w, g, impl=impl: grouped_matmul(r, w, g, impl)).lower(*args).compile(
            compiler_options=aot.compiler_options(mesh.devices.flat))
        temps[impl] = c.memory_analysis().temp_size_in_bytes
    dense = X * M * K * 2  # the rows broadcast to every expert, bf16
    assert temps["ragged"] >= dense and temps["tiled"] < dense / 8, temps
    with activation_rules(make_mesh((2,), ("fsdp",), devices=aot.h100_devices(2)), "trainer"):
        assert grouped_matmul_impl() == "tiled"


#: a 2-layer mixture of experts (8 experts, top 2, width 256) with layer 0 dense (`mlp_only_layers`); attention
#: xla (the only other Mosaic kernel would be splash: here the MoE kernels are counted alone)
MOE_MODEL = ModelConfig(model_type="qwen3_moe", vocab_size=1024, hidden_size=512, intermediate_size=1024, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=256, mlp_only_layers=(0,), dtype="bfloat16", remat="full",
                        attention="xla")


def _mosaic_calls(hlo: str) -> list[str]:
    """The last op_name component of every Mosaic custom call (``pallas_call``: a Pallas kernel such as megablox;
    ``ragged-dot-*``: XLA:TPU's own lowering of ``ragged_dot``, also a Mosaic kernel)."""
    import re

    out = []
    for line in hlo.split("\n"):
        if 'custom_call_target="tpu_custom_call"' in line:
            m = re.search(r'op_name="([^"]*)"', line)
            out.append(m.group(1).split("/")[-1] if m else "")
    return out


@needs_tpu
@pytest.mark.parametrize("kernel", ["megablox", "auto"])
def test_moe_train_step_with_megablox_compiles_for_tpu(kernel):
    """The MoE train step with the Pallas TPU grouped matmul (megablox gmm forward, gmm + tgmm backward, inside
    shard_map over the fsdp x tensor mesh) compiles deviceless for a v5e slice: its Mosaic kernels are in the
    compiled HLO and no ragged_dot is left; `auto` picks megablox on TPU. (`ragged` compiles XLA:TPU's own
    ragged-dot Mosaic kernels instead; those need the native precision for bf16, hence the context.)"""
    calls = _mosaic_calls(_compile_step(_mesh("tpu"), MOE_MODEL.replace(moe_kernel=kernel), (1, 4, 512)).as_text())
    assert calls.count("pallas_call") >= 3 * 3 and not [c for c in calls if "ragged" in c], calls  # 3 fwd, 6 bwd
    with jax.default_matmul_precision("default"):
        ragged = _mosaic_calls(_compile_step(_mesh("tpu"), MOE_MODEL.replace(moe_kernel="ragged"), (1, 4, 512)).as_text())
    assert "pallas_call" not in ragged and any(c.startswith("ragged-dot") for c in ragged), ragged


@pytest.mark.parametrize("kind", [pytest.param("gpu", marks=needs_gpu), pytest.param("tpu", marks=needs_tpu)])
def test_expert_parallel_train_step_compiles_and_keeps_experts_sharded(kind):
    """Expert parallelism (`moe.expert_parallel_swiglu`, fsdp 2 x expert 2): the MoE train step compiles for the
    target with its kernel (tiled on H100, megablox on TPU); the expert weights are gathered over fsdp only (the
    local 4 of 8 experts), never all 8; the tokens' partial outputs are reduce-scattered back."""
    import re

    devs = aot.tpu_devices("v5e:2x2") if kind == "tpu" else aot.h100_devices(4)
    mesh = make_mesh((2, 2), ("fsdp", "expert"), devices=devs)
    hlo = _compile_step(mesh, MOE_MODEL, (1, 4, 512)).as_text()
    X, D, F = MOE_MODEL.num_experts, MOE_MODEL.hidden_size, MOE_MODEL.moe_intermediate_size
    experts = [s for _, s in _all_gathers(hlo) if len(s) == 3 and D in s[1:]]
    # local experts with their hidden dim gathered (XLA may combine gate and up: width 2F)
    assert any(s[0] == X // 2 and set(s[1:]) & {F, 2 * F} for s in experts), experts
    assert not [s for s in experts if s[0] == X], experts  # never all experts
    assert re.search(r"reduce-scatter(-start)?\(", hlo)
    if kind == "tpu":
        assert _mosaic_calls(hlo).count("pallas_call") >= 3 * 3
