"""PagedEngine: greedy parity with transformers, exact behaviour log-probs, reproducibility,
paging under memory pressure, OutOfPagesError, sharded mesh, no recompilation."""
import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxrl_async.models import apply, load_hf, sequence_logprobs
from jaxrl_async.generator.engine import PagedEngine
from jaxrl_async.generator.engine_api import OutOfPagesError, SamplingParams
from jaxrl_async.sharding import make_mesh
from jaxrl_async.testing import TINY_FAMILIES, make_tiny_hf_model

torch.set_num_threads(1)  # tiny models: threads only contend with XLA on the 2-core CI machine

MAX_SEQ = 64
PAGE = 8
SLOTS = 4
MAX_NEW = 12
# 10 pages * 8 tokens = 80 < SLOTS * MAX_SEQ = 256 (a max-length reservation per slot would need 32
# pages) and < the peak live tokens of the workloads below (4 slots * 32 tokens): the driver must
# preempt (release + re-queue as a continuation re-prefill) when the pool runs out.
NUM_PAGES = 10


def make_engine(cfg, **kw):
    # decode blocks of 2 pages (16 tokens): the live-length loop runs 1..4 blocks on these workloads
    args = dict(max_concurrent_decodes=SLOTS, max_sequence_length=MAX_SEQ, prefill_buckets=(32,), page_size=PAGE,
                num_pages=NUM_PAGES, decode_block_pages=2)
    args.update(kw)
    return PagedEngine(cfg, **args)


@pytest.fixture(scope="module", params=TINY_FAMILIES)
def fam(request, tmp_path_factory):
    d = str(tmp_path_factory.mktemp(request.param))
    make_tiny_hf_model(d, request.param)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    cfg, params = load_hf(d)
    engine = make_engine(cfg)
    return request.param, cfg, engine.place_params(params), engine, hf


def prompts(n=32, seed=0, lo=3, hi=21):
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 256, int(rng.integers(lo, hi))).tolist() for _ in range(n)]


def run(engine, params, requests, state=None, slot_order=None, stats=None, decode_steps=1, tops=None):
    """Continuous-batching driver: prefill -> insert into a free slot -> generate -> release on done.

    When a step raises OutOfPagesError the most recently admitted request among `err.slots` is
    preempted: released and re-queued first as a continuation (prompt + tokens so far, remaining
    max_new_tokens); its absolute positions, hence its random stream, are unchanged.
    requests: list of (prompt, SamplingParams). Returns per request (tokens, logprobs, first slot).
    tops (a list): filled with, per request, one (top log-probs [K], top ids [K]) per token (max_top_logprobs = K).
    """
    state = state if state is not None else engine.init_decode_state()
    queue = collections.deque((i, list(p), sp) for i, (p, sp) in enumerate(requests))
    free = list(slot_order if slot_order is not None else range(engine.max_concurrent_decodes))
    owner: dict[int, int] = {}
    admitted: list[int] = []  # slots in admission order
    toks = [[] for _ in requests]
    lps = [[] for _ in requests]
    slots_used = [None] * len(requests)
    if tops is not None:
        tops[:] = [[] for _ in requests]
    stats = stats if stats is not None else {}
    stats.setdefault("preemptions", 0)
    for _ in range(10_000):
        while queue and free:
            i, prompt, sp = queue[0]
            pre = engine.prefill(params, prompt, sp)
            try:
                state = engine.insert(pre, state, free[0])
            except OutOfPagesError:
                break
            queue.popleft()
            slot = free.pop(0)
            toks[i].append(int(pre.first_tokens[0]))
            lps[i].append(float(pre.first_logprobs[0]))
            if tops is not None:
                tops[i].append((pre.first_top_logprobs[0], pre.first_top_ids[0]))
            slots_used[i] = slots_used[i] if slots_used[i] is not None else slot
            if pre.first_done[0]:
                state = engine.release(state, slot)
                free.append(slot)
            else:
                owner[slot] = i
                admitted.append(slot)
        if not owner:
            break
        try:
            state, step = engine.generate(params, state, decode_steps) if decode_steps > 1 else engine.generate(
                params, state)
        except OutOfPagesError as err:
            victim = [s for s in admitted if s in err.slots][-1]
            i = owner.pop(victim)
            admitted.remove(victim)
            state = engine.release(state, victim)
            free.append(victim)
            sp = requests[i][1]
            rest = dataclasses.replace(sp, max_new_tokens=sp.max_new_tokens - len(toks[i]))
            queue.appendleft((i, list(requests[i][0]) + toks[i], rest))
            stats["preemptions"] += 1
            continue
        for row in step.to_host().rows():  # one row per decode step of the dispatch
            for slot, i in list(owner.items()):
                if row.valid[slot]:
                    toks[i].append(int(row.tokens[slot]))
                    lps[i].append(float(row.logprobs[slot]))
                    if tops is not None:
                        tops[i].append((row.top_logprobs[slot], row.top_ids[slot]))
                if row.done[slot]:
                    state = engine.release(state, slot)
                    del owner[slot]
                    admitted.remove(slot)
                    free.append(slot)
    assert not owner and not queue, "driver did not finish"
    state.host.alloc.check()
    assert engine.free_pages(state) == engine.num_pages
    return toks, lps, slots_used


def hf_greedy(hf, prompts_, max_new, stop=None):
    """transformers greedy `generate` on the left-padded batch of prompts; cut after the first stop id."""
    T = max(len(p) for p in prompts_)
    ids = torch.zeros((len(prompts_), T), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts_):
        ids[r, T - len(p):] = torch.tensor(p)
        mask[r, T - len(p):] = 1
    with torch.no_grad():
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new,
                          eos_token_id=stop, pad_token_id=0)
    res = []
    for row in out[:, T:].tolist():
        cut = [k for k, t in enumerate(row) if stop is not None and t in stop]
        res.append(row[:cut[0] + 1] if cut else row)
    return res


_seq_logprobs = jax.jit(sequence_logprobs, static_argnums=1)


def reference_logprobs(cfg, params, prompt, gen, temperature):
    """Trainer-path log-probs of `gen` after `prompt` (padded to MAX_SEQ: one compilation)."""
    seq = np.zeros((1, MAX_SEQ), np.int32)
    seg = np.zeros((1, MAX_SEQ), np.int32)
    n = len(prompt) + len(gen)
    seq[0, :n] = prompt + gen
    seg[0, :n] = 1
    lp, _ = _seq_logprobs(params, cfg, jnp.asarray(seq), jnp.asarray(seg), temperature=temperature)
    return np.asarray(lp)[0, len(prompt):n]


def test_greedy_matches_transformers_and_logprobs_exact(fam):
    family, cfg, params, engine, hf = fam
    ps = prompts()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    stats = {}
    toks, lps, slots = run(engine, params, [(p, greedy) for p in ps], stats=stats)
    assert len(set(slots)) == SLOTS  # every slot was reused
    assert stats["preemptions"] > 0  # the pool was too small for the live tokens: paging + preemption ran
    ref = hf_greedy(hf, ps, MAX_NEW)
    assert toks == ref
    worst = max(np.abs(reference_logprobs(cfg, params, p, t, 1.0) - np.array(l)).max()
                for p, t, l in zip(ps, toks, lps))
    assert worst <= 1e-5, worst

    # stop tokens: the most frequent generated token (so many requests stop early), + a second id
    counts = collections.Counter(t for seq in ref for t in seq[1:])
    stop = counts.most_common(1)[0][0]
    sp = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=(stop, 255))
    toks_s, _, _ = run(engine, params, [(p, sp) for p in ps])
    ref_s = hf_greedy(hf, ps, MAX_NEW, stop=[stop, 255])
    assert toks_s == ref_s
    assert sum(len(t) < MAX_NEW for t in toks_s) >= 3  # the stop ids really cut sequences


def test_sampled_logprobs_exact_with_temperature(fam):
    family, cfg, params, engine, hf = fam
    ps = prompts(12, seed=1)
    reqs = [(p, SamplingParams(temperature=t, top_k=k, top_p=tp, max_new_tokens=MAX_NEW, seed=i))
            for i, (p, (t, k, tp)) in enumerate(zip(ps, [(0.7, 0, 1.0), (1.3, 20, 1.0), (0.5, 0, 0.9)] * 4))]
    toks, lps, _ = run(engine, params, reqs)
    for (p, sp), t, l in zip(reqs, toks, lps):
        diff = np.abs(reference_logprobs(cfg, params, p, t, sp.temperature) - np.array(l)).max()
        assert diff <= 1e-5, (sp, diff)
        # wrong temperature would not match: the check can fail
        assert np.abs(reference_logprobs(cfg, params, p, t, 1.0) - np.array(l)).max() > 1e-3


def test_reproducible_across_slots_and_batch(fam):
    family, cfg, params, engine, hf = fam
    target = (prompts(1, seed=7)[0], SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=MAX_NEW, seed=1234))
    alone, alone_lp, slot_a = run(engine, params, [target], slot_order=[2, 0, 1, 3])
    others = [(p, SamplingParams(temperature=0.9, top_k=5, max_new_tokens=5 + i, seed=i)) for i, p in
              enumerate(prompts(5, seed=8))]
    mixed, mixed_lp, slots = run(engine, params, others[:3] + [target] + others[3:], slot_order=[3, 2, 1, 0])
    assert slots[3] != slot_a[0]
    assert mixed[3] == alone[0]
    np.testing.assert_allclose(mixed_lp[3], alone_lp[0], atol=1e-5)
    # a different seed gives a different continuation
    other_seed, _, _ = run(engine, params, [(target[0], SamplingParams(temperature=1.0, top_p=0.95,
                                                                        max_new_tokens=MAX_NEW, seed=99))])
    assert other_seed[0] != alone[0]


def test_n_samples_share_prompt_pages_and_match_single_prefills(fam):
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    prompt = prompts(1, seed=3, lo=20, hi=21)[0]  # 20 tokens = 2 full pages + a 4-token tail
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=42, n=3)
    state = engine.init_decode_state()
    pre = engine.prefill(params, prompt, sp, num_samples=3)
    state = engine.bulk_insert(pre, state, [2, 0, 3])
    pages = state.host.alloc.slot_pages
    assert pages[2][:2] == pages[0][:2] == pages[3][:2]  # full prompt pages shared
    assert len({pages[2][2], pages[0][2], pages[3][2]}) == 3  # tails copied
    assert engine.free_pages(state) == engine.num_pages - 2 - 3
    state.host.alloc.check()
    out = {s: [int(pre.first_tokens[k])] for k, s in enumerate([2, 0, 3])}
    for _ in range(5):
        state, step = engine.generate(params, state)
        step = step.to_host()
        for s in out:
            if step.valid[s]:
                out[s].append(int(step.tokens[s]))
    for s in (2, 0, 3):
        state = engine.release(state, s)
    assert engine.free_pages(state) == engine.num_pages and not state.host.alloc.prefix_pages
    for k, s in enumerate([2, 0, 3]):
        single = SamplingParams(temperature=1.0, max_new_tokens=6, seed=42)
        st2 = engine.init_decode_state()
        p1 = engine.prefill(params, prompt, single, num_samples=1, sample_offset=k)
        st2 = engine.insert(p1, st2, 1)
        seq = [int(p1.first_tokens[0])]
        for _ in range(5):
            st2, step = engine.generate(params, st2)
            seq.append(int(np.asarray(step.tokens)[1]))
        assert seq == out[s], (k, seq, out[s])
    assert len({tuple(v) for v in out.values()}) == 3


def test_paged_cache_premise(fam):
    """The greedy parity workload above runs with fewer pages than a max-length reservation needs."""
    family, cfg, params, engine, hf = fam
    assert SLOTS * MAX_SEQ > engine.num_pages * PAGE
    assert engine.num_pages < SLOTS * engine.max_pages_per_seq


def test_out_of_pages_raises_without_corruption(fam):
    family, cfg, params, engine, hf = fam
    if family != "llama":
        pytest.skip("engine-level property; one family suffices")
    greedy = SamplingParams(temperature=0.0, max_new_tokens=20)
    ps = prompts(4, seed=5, lo=20, hi=21)  # 20 tokens = 3 pages each; 3 prompts leave 1 of 10 pages
    state = engine.init_decode_state()
    outs = [[], [], []]
    for s in range(3):
        pre = engine.prefill(params, ps[s], greedy)
        state = engine.insert(pre, state, s)
        outs[s].append(int(pre.first_tokens[0]))
    assert engine.free_pages(state) == 1
    with pytest.raises(OutOfPagesError) as info:
        engine.insert(engine.prefill(params, ps[3], greedy), state, 3)
    assert info.value.slots == (3,) and not state.host.live[3] and engine.free_pages(state) == 1
    for _ in range(4):  # positions 20..23 fit in each slot's third page
        state, step = engine.generate(params, state)
        step = step.to_host()
        for s in range(3):
            outs[s].append(int(step.tokens[s]))
    before = {k: np.asarray(v).copy() for k, v in state.arrays.items()}
    with pytest.raises(OutOfPagesError) as info:
        engine.generate(params, state)  # position 24 needs a 4th page for all three slots, 1 is free
    assert sorted(info.value.slots) == [0, 1, 2] and info.value.pages_needed == 3
    assert engine.free_pages(state) == 1
    state.host.alloc.check()
    for k, v in state.arrays.items():  # nothing donated or modified
        np.testing.assert_array_equal(np.asarray(v), before[k], err_msg=k)
    # the orchestrator preempts slot 1; slots 0 and 2 continue exactly as they would have
    state = engine.release(state, 1)
    while len(outs[0]) < 20:
        state, step = engine.generate(params, state)
        step = step.to_host()
        for s in (0, 2):
            outs[s].append(int(step.tokens[s]))
    ref = hf_greedy(hf, ps[:3], 20)
    assert outs[0] == ref[0] and outs[2] == ref[2]
    assert outs[1] == ref[1][:5]


def test_no_recompilation_after_warmup(fam):
    family, cfg, params, engine, hf = fam
    if family != "qwen3_untied":
        pytest.skip("engine-level property; one family suffices")
    engine.warmup(params, max_samples=4)
    before = engine.compile_counts()
    rng = np.random.default_rng(11)
    reqs = [(p, SamplingParams(temperature=float(rng.choice([0.0, 0.6, 1.0, 1.7])), top_k=int(rng.choice([0, 3, 50])),
                               top_p=float(rng.choice([1.0, 0.8])), max_new_tokens=int(rng.integers(1, 15)),
                               stop_token_ids=tuple(int(x) for x in rng.integers(3, 256, int(rng.integers(0, 4)))),
                               seed=int(rng.integers(0, 2**32))))
            for p in prompts(20, seed=12, lo=1, hi=19)]
    run(engine, params, reqs, slot_order=[2, 0, 3, 1])
    state = engine.init_decode_state()
    for n in (1, 3, 4):
        pre = engine.prefill(params, prompts(1, seed=n)[0], SamplingParams(temperature=1.0, n=n), num_samples=n)
        state = engine.bulk_insert(pre, state, list(range(n)))
        state, _ = engine.generate(params, state)
        for s in range(n):
            state = engine.release(state, s)
    new_params = jax.tree.map(lambda x: x * 1.01, params)  # a weight swap
    run(engine, new_params, reqs[:3])
    assert engine.compile_counts() == before, (before, engine.compile_counts())
    # one decode program whatever the lengths (the CPU kernel reads each slot's own pages; the blocked loop's trip
    # count is traced)
    assert engine.attention == "cpu_paged" and before["generate"] == 1


def test_warmup_compiles_each_program_once(fam):
    """`warmup` compiles every program ahead of time from abstract arguments (in parallel); its runs on scratch
    states, and a workload afterwards, reuse those compilations: each program's backend compile happens once."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    from jax._src.dispatch import BACKEND_COMPILE_EVENT

    compiles = collections.Counter()

    def listen(event, duration, **kw):
        if event == BACKEND_COMPILE_EVENT:
            compiles[kw.get("fun_name", "?")] += 1

    eng = make_engine(cfg, prefill_buckets=(8, 32), max_prefill_length=32)
    p = eng.place_params(params)
    jax.monitoring.register_event_duration_secs_listener(listen)
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a persistent-cache hit is no backend compile
    try:
        eng.warmup(p, max_samples=16)
        after_warmup = dict(compiles)
        run(eng, p, [(q, SamplingParams(temperature=1.0, top_k=int(i % 2) * 5, max_new_tokens=4, seed=i, n=1 + i % 3))
                     for i, q in enumerate(prompts(6, seed=5))])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
        jax.config.update("jax_enable_compilation_cache", cached)
    programs = {name: n for name, n in compiles.items() if name.startswith("jit(") and "_fn" in name}
    # 2 buckets x (prefill, insert); sample_first: 2 samplers x row counts {8, 16}; 2 decode steps; release
    assert programs == {"jit(prefill_fn)": 2, "jit(insert_fn)": 2, "jit(sample_first_fn)": 4,
                        "jit(decode_step_fn)": 2, "jit(release_fn)": 1}, programs
    assert dict(compiles) == after_warmup, "the workload compiled something after warmup"


def ragged_reference_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, *, sm_scale):
    """jax's `ref_ragged_paged_attention` for one query per sequence, vectorised (the original loops in
    Python over a concrete num_seqs): same arguments and combined k/v format as the TPU kernel."""
    S, H, E = q.shape
    K = kv_pages.shape[2] // 2
    pages = kv_pages[page_indices]  # [S, pages, page, 2K, E]
    k = jnp.repeat(pages[..., 0::2, :].reshape(S, -1, K, E), H // K, axis=2)
    v = jnp.repeat(pages[..., 1::2, :].reshape(S, -1, K, E), H // K, axis=2)
    s = jnp.einsum("shd,skhd->shk", q, k, preferred_element_type=jnp.float32) * sm_scale
    s = jnp.where(jnp.arange(k.shape[1])[None, None] < kv_lens[:, None, None], s, -jnp.inf)
    return jnp.einsum("shk,skhd->shd", jax.nn.softmax(s, -1).astype(v.dtype), v).astype(q.dtype)


# the kernel paths on CPU: the Triton kernel in Pallas interpret mode, the TPU kernel's reference (the
# engine's layout, page offsets per layer, lengths and shard_map are what these check)
KERNEL_OPTIONS = {"blocked": None, "cpu_paged": None, "gpu_paged": {"interpret": True},
                  "tpu_ragged": {"kernel": ragged_reference_kernel}}


_GATHER_REFERENCE: dict[str, tuple] = {}  # family -> the gather engine's (tokens, log-probs) on the workload below


@pytest.mark.parametrize("attention,mesh_shape", [("cpu_paged", None), ("blocked", None), ("gpu_paged", None),
                                                  ("tpu_ragged", None), ("cpu_paged", (2, 2)), ("gpu_paged", (2, 2)),
                                                  ("tpu_ragged", (2, 2))])
def test_decode_attention_paths_agree(fam, attention, mesh_shape):
    """Every decode attention equals the full-reservation gather in fp32: same tokens, log-probs within
    1e-5, on sampled requests that page, preempt and stop; the kernel paths also per shard of a data x
    tensor mesh (slots over data, kv heads over tensor)."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    mesh = None if mesh_shape is None else make_mesh({"data": mesh_shape[0], "tensor": mesh_shape[1]},
                                                     devices=jax.devices()[:4])
    if attention == "cpu_paged" and mesh is None:
        other, p_other = engine, params  # the module's engine: "auto" is the CPU kernel (already compiled)
    else:
        other = make_engine(cfg, attention=attention, mesh=mesh, kernel_options=KERNEL_OPTIONS[attention])
        p_other = other.place_params(params)
    assert other.attention == attention
    if attention == "tpu_ragged":
        assert other.layout.keys == ("kv_pool",)
    ps = prompts(10, seed=21)
    reqs = [(p, SamplingParams(temperature=1.0, top_p=0.9 if i % 2 else 1.0, max_new_tokens=MAX_NEW, seed=i))
            for i, p in enumerate(ps)]
    st = {}
    toks_o, lps_o, _ = run(other, p_other, reqs, stats=st)
    if family not in _GATHER_REFERENCE:  # the same reference for every path: compiled and run once per module
        gather = make_engine(cfg, attention="gather")
        assert gather.attention == "gather"
        _GATHER_REFERENCE[family] = run(gather, gather.place_params(params), reqs)[:2]
    toks_g, lps_g = _GATHER_REFERENCE[family]
    assert st["preemptions"] > 0
    assert toks_o == toks_g
    worst = max(np.abs(np.array(a) - np.array(b)).max() for a, b in zip(lps_o, lps_g))
    assert worst <= 1e-5, worst
    if mesh is not None:
        assert other.pool_sharding.spec[other.layout.head_axis] == "tensor" and other.slot_sharding.spec[0] == "data"


def test_auto_decode_attention_by_platform():
    from jaxrl_async.kernels import paged_attention

    assert [paged_attention.resolve("auto", p) for p in ("cpu", "tpu", "gpu", "cuda")] == [
        "cpu_paged", "tpu_ragged", "gpu_paged", "gpu_paged"]
    assert paged_attention.resolve("gather", "tpu") == "gather"
    with pytest.raises(ValueError, match="decode attention"):
        paged_attention.resolve("flash", "cpu")


def test_sharded_engine_matches_single_device(fam):
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("sharding property; one family suffices")
    mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    sharded = make_engine(cfg, mesh=mesh)
    assert sharded.layout.name == "page_heads" and sharded.pool_sharding.spec[sharded.layout.head_axis] == "tensor"
    assert sharded.pool_sharding.spec[1] == "data"
    assert sharded.slot_sharding.spec[0] == "data"
    sp_params = sharded.place_params(params)
    ps = prompts(8, seed=9)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW)
    ref, _, _ = run(engine, params, [(p, greedy) for p in ps])
    got, _, _ = run(sharded, sp_params, [(p, greedy) for p in ps])
    assert got == ref


def test_kv_pool_split_per_data_replica(fam):
    """On a data=2 mesh each decode replica owns half of the pool's pages (per-device KV bytes = pool / 2) and
    allocates them itself (local page ids): a group split over both replicas writes its prompt pages once per
    replica, and its tokens and log-probs equal a one-device engine's; a short replica raises OutOfPagesError
    naming its own slots while the other still admits; slots are offered emptiest replica first."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    mesh = make_mesh({"data": 2, "tensor": 1}, devices=jax.devices()[:2])
    split = make_engine(cfg, mesh=mesh, num_pages=20)
    assert split.kv_replicas == 2 and split.pages_per_replica == 10 and split.pool_sharding.spec[1] == "data"
    sp_params = split.place_params(params)
    state = split.init_decode_state()
    pool = state.arrays["k_pool"]
    assert {sh.data.shape[1] for sh in pool.addressable_shards} == {10}  # each device holds its replica's pages
    prompt = prompts(1, seed=3, lo=20, hi=21)[0]  # 2 full pages + a tail
    sp = SamplingParams(temperature=1.0, max_new_tokens=8, seed=42, n=3)
    pre = split.prefill(sp_params, prompt, sp, num_samples=3)
    state = split.bulk_insert(pre, state, [0, 2, 1])  # samples 0, 2 on replica 0; sample 1 on replica 1
    allocs = state.host.alloc.allocs
    assert [a.num_free for a in allocs] == [10 - 2 - 2, 10 - 2 - 1]  # prompt pages once per replica, tails each
    pages = state.host.alloc.slot_pages
    assert pages[0][:2] == pages[1][:2] and all(p < 10 for p in pages[2])  # local ids of replica 1
    state.host.alloc.check()
    ref_state = engine.init_decode_state()
    ref_pre = engine.prefill(params, prompt, sp, num_samples=3)
    ref_state = engine.bulk_insert(ref_pre, ref_state, [0, 2, 1])
    np.testing.assert_array_equal(pre.first_tokens, ref_pre.first_tokens)
    for _ in range(6):
        state, step = split.generate(sp_params, state)
        ref_state, ref = engine.generate(params, ref_state)
        step, ref = step.to_host(), ref.to_host()
        np.testing.assert_array_equal(step.tokens, ref.tokens)
        np.testing.assert_allclose(step.logprobs, ref.logprobs, atol=1e-5)
    for s in (0, 1, 2):
        state = split.release(state, s)
    assert split.free_pages(state) == 20 and not state.host.alloc.prefix_pages
    # a short replica: 4 pages each, 20-token prompts take 3
    small = make_engine(cfg, mesh=mesh, num_pages=8)
    state = small.init_decode_state()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=4)
    ps = prompts(3, seed=5, lo=20, hi=21)
    state = small.insert(small.prefill(sp_params, ps[0], greedy), state, 0)
    with pytest.raises(OutOfPagesError) as info:
        small.insert(small.prefill(sp_params, ps[1], greedy), state, 1)
    assert info.value.slots == (1,) and small.pool_of(1) == 0 and small.pool_of(3) == 1
    assert small.order_free_slots(state, [1, 2, 3]) == [2, 3, 1]  # replica 1 (4 free) before replica 0 (1 free)
    state = small.insert(small.prefill(sp_params, ps[1], greedy), state, 2)
    state.host.alloc.check()
    with pytest.raises(ValueError, match="multiple of the 2 decode replicas"):
        make_engine(cfg, mesh=mesh, num_pages=9)


def _full_and_compacted(cfg, data, **comp_kw):
    """Two engines of 8 slots on a data=`data` mesh: the full batch, and compacting down to 1/2 and 1/4 of each
    replica's slots (checked)."""
    mesh = make_mesh({"data": data, "tensor": 1}, devices=jax.devices()[:data])
    kw = dict(mesh=mesh, max_concurrent_decodes=8, num_pages=32)
    full = make_engine(cfg, compact_decode=False, **kw)
    comp = make_engine(cfg, compact_decode=True, compact_min_rows=1, **comp_kw, **kw)
    per = 8 // data
    assert comp.compact_sizes == (per // 2, per // 4)
    return full, comp


@pytest.mark.parametrize("data", [1, 2])
def test_compacted_decode_equals_the_full_batch(fam, data):
    """When the live slots fit in half / a quarter of the decode batch (per replica), the step runs a compacted
    program on those slots only: every request's tokens and log-probs equal the full-batch engine's, through
    admissions, finishes at different lengths, greedy / sampled / top-k rows (both sampling programs); at most
    one program per size and sampler; on a data=2 mesh each replica compacts its own slots."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    full, comp = _full_and_compacted(cfg, data)
    assert full.compact_sizes == ()
    rng = np.random.default_rng(21)
    reqs = [(p, SamplingParams(temperature=float(rng.choice([0.0, 1.0])), top_k=5 if i == 9 else 0,
                               max_new_tokens=int(rng.integers(1, MAX_NEW + 1)), seed=int(rng.integers(0, 2**32))))
            for i, p in enumerate(prompts(14, seed=22))]
    p_full, p_comp = full.place_params(params), comp.place_params(params)
    comp.warmup(p_comp, max_samples=4)  # starts the compacted steps' compiles (2 sizes x 2 samplers)
    stats_full, stats_comp = {}, {}
    toks_f, lps_f, _ = run(full, p_full, reqs, stats=stats_full)
    toks_c, lps_c, _ = run(comp, p_comp, reqs, stats=stats_comp)
    assert stats_full["preemptions"] == stats_comp["preemptions"] == 0
    assert toks_c == toks_f
    for a, b in zip(lps_c, lps_f):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert comp.compact_steps > 0 and full.compact_steps == 0
    counts = comp.compile_counts()
    assert counts["generate_compact"] == 4, counts
    run(comp, p_comp, reqs[:5])  # a second workload compiles nothing
    assert comp.compile_counts() == counts


@pytest.mark.parametrize("data", [1, 2])
def test_compacted_multi_step_decode_equals_the_full_batch(fam, data):
    """Multi-step dispatches compact too (issue 28): K = 4 steps of the rows chosen at the dispatch's start
    (`decode_rows_fn` over `decode_multi_fn`). Every request's tokens equal the full-batch single-step engine's and
    its log-probs agree within 1e-5, with stop ids and length limits ending samples mid-dispatch (the row stays
    in the dispatch, inactive), three long requests making a tail of compacted dispatches; one program per size,
    sampler and dispatch length, and a second workload compiles nothing."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    full, comp = _full_and_compacted(cfg, data, max_decode_steps=4)
    rng = np.random.default_rng(23)
    ps = prompts(14, seed=24)
    stops = tuple(t for t, _ in collections.Counter(t for seq in hf_greedy(hf, ps, MAX_NEW)
                                                    for t in seq[1:]).most_common(2))
    reqs = [(p, SamplingParams(temperature=float(rng.choice([0.0, 1.0])), top_k=5 if i == 9 else 0,
                               max_new_tokens=40 if i in (0, 5, 11) else int(rng.integers(1, MAX_NEW + 1)),
                               seed=int(rng.integers(0, 2**32)), stop_token_ids=() if i in (0, 5, 11) else stops))
            for i, p in enumerate(ps)]
    p_full, p_comp = full.place_params(params), comp.place_params(params)
    comp.warmup(p_comp, max_samples=4)  # starts the compacted programs' compiles (2 sizes x 2 samplers x K in (4, 1))
    toks_f, lps_f, _ = run(full, p_full, reqs)
    toks_c, lps_c, _ = run(comp, p_comp, reqs, decode_steps=4)
    assert toks_c == toks_f
    assert sum(len(t) < sp.max_new_tokens for t, (_, sp) in zip(toks_c, reqs)) >= 3  # the stop ids cut samples
    for a, b in zip(lps_c, lps_f):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
    assert comp.compact_steps >= 16 and comp.compact_steps % 4 == 0  # only K-step dispatches ran
    counts = comp.compile_counts()
    assert counts["generate_compact"] == 8, counts
    run(comp, p_comp, reqs[:5], decode_steps=4)
    assert comp.compile_counts() == counts


def test_lean_sampling_programs_until_a_request_truncates(fam):
    """Slots sampling without top-k/top-p run the decode step and first-token sampler compiled without the
    truncation machinery; the full programs compile only when a truncating request is running."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    eng = make_engine(cfg)
    plain = SamplingParams(temperature=1.0, max_new_tokens=4, seed=1)
    run(eng, params, [(p, plain) for p in prompts(3, seed=2)])
    c = eng.compile_counts()
    assert (c["generate"], c["generate_plain"], c["sample_first"], c["sample_first_plain"]) == (0, 1, 0, 1)
    run(eng, params, [(p, dataclasses.replace(plain, top_k=5)) for p in prompts(2, seed=4)])
    c = eng.compile_counts()
    assert (c["generate"], c["generate_plain"], c["sample_first"], c["sample_first_plain"]) == (1, 1, 1, 1)


def test_chunked_prefill_equals_one_pass_prefill(fam):
    """A sequence longer than the largest bucket (32) is prefilled in chunks of 32 (each attending to the
    chunks before it): first token, its log-prob, the KV (the continuation) equal a one-pass prefill."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    one_pass = make_engine(cfg, prefill_buckets=(56,))
    assert engine.max_prefill_length == 32 and engine.max_reprefill_length == MAX_SEQ - 1
    sp = SamplingParams(temperature=1.0, max_new_tokens=6, seed=5)
    for n in (33, 50, 56):
        toks = prompts(1, seed=n, lo=n, hi=n + 1)[0]
        outs = []
        for eng in (engine, one_pass):
            pre = eng.prefill(params, toks, sp)
            state = eng.insert(pre, eng.init_decode_state(), 0)
            seq, lps = [int(pre.first_tokens[0])], [float(pre.first_logprobs[0])]
            while not state.host.done[0]:
                state, step = eng.generate(params, state)
                seq.append(int(np.asarray(step.tokens)[0]))
                lps.append(float(np.asarray(step.logprobs)[0]))
            eng.release(state, 0)
            outs.append((seq, lps))
        assert outs[0][0] == outs[1][0]
        np.testing.assert_allclose(outs[0][1], outs[1][1], atol=1e-5)
    assert engine.compile_counts()["prefill_chunk"] == 1  # one program per buffer length (2 chunks of 32 here)
    with pytest.raises(ValueError, match="no room"):
        engine.prefill(params, [5] * MAX_SEQ, sp)


def test_prefill_many_packs_prompts_and_equals_single_prefills(fam):
    """prefill_many packs prompts into rows of the largest bucket (here 32 tokens, at most 8 prompts a row;
    a 40-token continuation goes chunked) with one host read: first tokens, log-probs and the inserted KV
    (the continuations, with n = 2 samples sharing pages) equal one prefill per prompt."""
    family, cfg, params, engine, hf = fam
    if family != "qwen3":
        pytest.skip("engine-level property; one family suffices")
    from jaxrl_async.generator.engine_api import PrefillRequest

    ps = [prompts(1, seed=40 + i, lo=n, hi=n + 1)[0] for i, n in enumerate((5, 9, 17, 3, 40, 12))]
    sps = [SamplingParams(temperature=t, max_new_tokens=5, seed=i, top_k=k) for i, (t, k) in
           enumerate([(1.0, 0), (0.0, 0), (0.7, 5), (1.3, 0), (1.0, 0), (0.9, 3)])]
    reqs = [PrefillRequest(p, sp, num_samples=2 if i == 1 else 1, sample_offset=i % 2) for i, (p, sp) in
            enumerate(zip(ps, sps))]
    calls = []
    inner = engine._prefill
    engine._prefill = lambda *a: calls.append(a[2]) or inner(*a)
    try:
        many = engine.prefill_many(params, reqs)
    finally:
        engine._prefill = inner
    # rows: [5, 9, 17] (31 tokens), [3], [40] chunked, [12]: three packed calls, the first with 3 prompts
    assert [int((np.asarray(x) > 0).sum()) for x in calls] == [3, 1, 1]
    assert many[1].kv.k is many[0].kv.k and many[2].kv.offset == 14
    singles = [engine.prefill(params, r.tokens, r.sampling, r.num_samples, r.sample_offset) for r in reqs]

    def continuation(pre):
        state = engine.bulk_insert(pre, engine.init_decode_state(), list(range(len(pre.first_tokens))))
        seqs = [[int(t)] for t in pre.first_tokens]
        for _ in range(4):
            state, step = engine.generate(params, state)
            for s, seq in enumerate(seqs):
                seq.append(int(np.asarray(step.tokens)[s]))
        for s in range(len(seqs)):
            state = engine.release(state, s)
        return seqs

    for a, b in zip(many, singles):
        np.testing.assert_array_equal(a.first_tokens, b.first_tokens)
        np.testing.assert_allclose(a.first_logprobs, b.first_logprobs, atol=1e-5)
        assert a.length == b.length and a.sample_indices == b.sample_indices
        assert continuation(a) == continuation(b)


def test_multi_step_decode_equals_single_steps_bitwise(fam):
    """Issue 28: K decode steps per dispatch (`generate(..., num_steps=K)`, one program and one host copy) give the
    tokens of K single steps, and their behaviour log-probs to rounding (XLA fuses the step inside the K-step loop
    differently; a short pool preempts at other points, re-prefilling; bitwise run to run at a fixed K): greedy
    with stop ids ending sequences mid-dispatch, sampled with top-k / top-p, length limits that are not multiples of K, and a
    pool too small for the live tokens (pages are mapped a dispatch ahead; preemption as with single steps)."""
    family, cfg, params, engine, hf = fam
    multi = make_engine(cfg, max_decode_steps=PAGE)
    ps = prompts()
    ref = hf_greedy(hf, ps, MAX_NEW)
    stop = collections.Counter(t for seq in ref for t in seq[1:]).most_common(1)[0][0]
    cases = [[(p, SamplingParams(temperature=0.0, max_new_tokens=MAX_NEW, stop_token_ids=(stop, 255))) for p in ps],
             [(p, SamplingParams(temperature=t, top_k=k, top_p=tp, max_new_tokens=5 + i % 9, seed=i))
              for i, (p, (t, k, tp)) in enumerate(zip(ps[:12], [(0.7, 0, 1.0), (1.3, 20, 1.0), (0.5, 0, 0.9)] * 4))]]
    for reqs in cases:
        toks, lps, _ = run(engine, params, reqs)
        toks_k, lps_k, _ = run(multi, params, reqs, decode_steps=PAGE)
        assert toks_k == toks  # (the schedule differs where the pool runs short: pages are taken a dispatch ahead)
        for a, b in zip(lps, lps_k):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5)
        again = run(multi, params, reqs, decode_steps=PAGE)  # deterministic at a fixed K: bitwise
        assert again[:2] == (toks_k, lps_k)
    greedy_k = run(multi, params, cases[0], stats=(st := {}), decode_steps=PAGE)[0]
    assert greedy_k == hf_greedy(hf, ps, MAX_NEW, stop=[stop, 255]) and st["preemptions"] > 0
    assert sum(len(t) < MAX_NEW for t in greedy_k) >= 3  # the stop ids really cut sequences (mid-dispatch)
    counts = multi.compile_counts()
    assert counts["generate_multi"] == 2 and counts["generate"] + counts["generate_plain"] == 0, counts
    with pytest.raises(ValueError, match="num_steps"):
        multi.generate(params, multi.init_decode_state(), PAGE + 1)
    with pytest.raises(ValueError, match="max_decode_steps"):
        make_engine(cfg, max_decode_steps=PAGE + 1)


_apply = jax.jit(apply, static_argnums=1)


def reference_distributions(cfg, params, prompt, gen, temperature):
    """log_softmax(logits / T) of the trainer's forward at every position that predicted a token of `gen`, [len(gen),
    V] (padded to MAX_SEQ: one compilation)."""
    n = len(prompt) + len(gen)
    seq = np.zeros((1, MAX_SEQ), np.int32)
    seq[0, :n] = prompt + gen
    seg = (np.arange(MAX_SEQ) < n).astype(np.int32)[None]
    logits = _apply(params, cfg, jnp.asarray(seq), None, jnp.asarray(seg))[0, len(prompt) - 1:n - 1]
    return np.asarray(jax.nn.log_softmax(logits / temperature, axis=-1))


def test_top_logprobs_are_the_sampled_distribution_and_change_nothing(fam):
    """max_top_logprobs = K: every token (prefill's first, single and multi-step decode) comes with the K largest
    log-probs of the distribution it was sampled from, descending, equal to the trainer forward's
    log_softmax(logits / T) within 1e-5 (raw logits when greedy); the top-1 entry of a greedy token is its behaviour
    log-prob bitwise; the tokens and behaviour log-probs are bitwise those of the engine without top log-probs
    (paging and preemption included), and no further program compiles."""
    family, cfg, params, engine, hf = fam
    K = 5
    top = make_engine(cfg, max_top_logprobs=K)
    ps = prompts(8, seed=3)
    reqs = [(p, SamplingParams(temperature=t, top_k=k, top_p=tp, max_new_tokens=MAX_NEW, seed=i, top_logprobs=K))
            for i, (p, (t, k, tp)) in enumerate(zip(ps, [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 20, 1.0),
                                                        (1.3, 0, 0.9)] * 2))]
    base = run(engine, params, [(p, dataclasses.replace(sp, top_logprobs=0)) for p, sp in reqs])
    tops, stats = [], {}
    got = run(top, params, reqs, tops=tops, stats=stats)
    assert got[0] == base[0] and got[1] == base[1]  # bitwise
    assert stats["preemptions"] > 0  # re-prefilled continuations: their first tokens come from prefill
    for (p, sp), t, lp, tp in zip(reqs, got[0], got[1], tops):
        vals, ids = np.stack([v for v, _ in tp]), np.stack([i for _, i in tp])
        assert vals.shape == ids.shape == (len(t), K) and vals.dtype == np.float32 and ids.dtype == np.int32
        assert np.all(np.diff(vals, axis=1) <= 0)  # descending
        ref = reference_distributions(cfg, params, p, t, sp.temperature or 1.0)
        np.testing.assert_allclose(vals, np.take_along_axis(ref, ids, axis=1), rtol=0, atol=1e-5)
        np.testing.assert_allclose(vals, -np.sort(-ref, axis=1)[:, :K], rtol=0, atol=1e-5)  # the K largest
        assert len(set(map(tuple, ids.tolist()))) > 1
        for j, tok in enumerate(t):  # the sampled token's entry (where it is among the K) is its log-prob
            if tok in ids[j]:
                assert vals[j, ids[j].tolist().index(tok)] == np.float32(lp[j])
        if sp.temperature == 0:
            assert ids[:, 0].tolist() == t and vals[:, 0].tolist() == lp
    # multi-step decode: the same tokens and top log-probs (to rounding, as its behaviour log-probs)
    multi = make_engine(cfg, max_top_logprobs=K, max_decode_steps=PAGE)
    mtops = []
    mgot = run(multi, params, reqs, tops=mtops, decode_steps=PAGE)
    assert mgot[0] == got[0]
    for a, b in zip(tops, mtops):
        assert [i.tolist() for _, i in a] == [i.tolist() for _, i in b]
        np.testing.assert_allclose(np.stack([v for v, _ in a]), np.stack([v for v, _ in b]), rtol=0, atol=1e-5)
    # requests asking for fewer (or none) run on the same programs; K = 0 compiles no top-k at all
    counts = top.compile_counts()
    run(top, params, [(p, dataclasses.replace(sp, top_logprobs=0)) for p, sp in reqs[:3]])
    assert top.compile_counts() == counts
    # K = 0: the lean decode step has no top-k op and the step's 4 outputs (the programs of before)
    lowered = {e: e._steps[False].lower(params, e.init_decode_state().arrays, np.full(SLOTS, -1, np.int32))
               for e in (engine, top)}
    assert "chlo.top_k" not in lowered[engine].as_text() and "chlo.top_k" in lowered[top].as_text()
    assert len(lowered[engine].out_info[1]) == 4 and len(lowered[top].out_info[1]) == 6


def test_top_logprobs_limits(fam):
    family, cfg, params, engine, hf = fam
    with pytest.raises(ValueError, match="top_logprobs=1 exceeds this engine's max_top_logprobs=0"):
        engine.prefill(params, [1, 2, 3], SamplingParams(top_logprobs=1))
    with pytest.raises(ValueError, match="SamplingParams.top_logprobs must be >= 0"):
        engine.prefill(params, [1, 2, 3], SamplingParams(top_logprobs=-1))
    with pytest.raises(ValueError, match="max_top_logprobs must be in"):
        make_engine(cfg, max_top_logprobs=cfg.vocab_size + 1)


def test_generator_delivers_top_logprobs(fam):
    """The generator hands each token's first `SamplingParams.top_logprobs` (id, log-prob) pairs to the sample's
    output and its stream chunks (`()` per token for a request asking for none), and refuses more than the engine's
    max_top_logprobs naming the field."""
    from jaxrl_async.generator.orchestrator import Generator

    family, cfg, params, engine, hf = fam
    if family != TINY_FAMILIES[0]:
        pytest.skip("the generator's plumbing does not depend on the model family")
    top = make_engine(cfg, max_top_logprobs=4)
    p = prompts(1, seed=11)[0]
    sp = SamplingParams(temperature=1.0, max_new_tokens=MAX_NEW, seed=5, top_logprobs=3)
    tops = []
    toks, lps, _ = run(top, params, [(p, sp)], tops=tops)
    with Generator(top, params) as gen:
        h = gen.submit(p, sp, stream=True)
        chunks = list(h)
        out = h.result(60).samples[0]
        none = gen.submit(p, dataclasses.replace(sp, top_logprobs=0)).result(60).samples[0]
        with pytest.raises(ValueError, match="top_logprobs=5 exceeds the engine's max_top_logprobs=4"):
            gen.submit(p, dataclasses.replace(sp, top_logprobs=5))
    assert out.completion_ids == toks[0] and out.logprobs == lps[0]
    assert out.top_logprobs == [tuple(zip(i[:3].tolist(), v[:3].tolist())) for v, i in tops[0]]
    assert all(len(t) == 3 for t in out.top_logprobs)
    assert [t for c in chunks for t in c.top_logprobs] == out.top_logprobs
    assert none.completion_ids == out.completion_ids and none.top_logprobs == [()] * len(out.completion_ids)
    # the compacted decode step (one live slot: 2 rows) returns them too
    comp = make_engine(cfg, max_top_logprobs=4, compact_decode=True, compact_min_rows=1, compact_levels=1)
    ctops = []
    assert run(comp, params, [(p, sp)], tops=ctops)[0] == toks and comp.compact_steps > 0
    assert [i.tolist() for _, i in ctops[0]] == [i.tolist() for _, i in tops[0]]
    np.testing.assert_allclose([v for v, _ in ctops[0]], [v for v, _ in tops[0]], rtol=0, atol=1e-5)
