"""kv_cache.py: page allocator, paged writes/attention vs contiguous attention, automatic sizing."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_async.models import ModelConfig
from jaxrl_async.models.transformer import grouped_attention
from jaxrl_async.generator import kv_cache
from jaxrl_async.generator.engine_api import OutOfPagesError
from jaxrl_async.models.shardings import model_shardings
from jaxrl_async.sharding import make_mesh


def test_pages_for():
    assert [kv_cache.pages_for(n, 8) for n in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]


def test_allocator_refcounts_sharing_and_prefix_registry():
    a = kv_cache.PageAllocator(6, num_slots=3)
    shared = a.allocate(2, [0])
    a.register_prefix(11, shared)
    a.slot_pages[0] = shared + a.allocate(1, [0])
    a.share(shared)
    a.slot_pages[1] = shared + a.allocate(1, [1])
    a.check()
    assert a.num_free == 2 and list(a.refcount[shared]) == [2, 2]
    with pytest.raises(OutOfPagesError) as info:
        a.allocate(3, [2])
    assert info.value.slots == (2,) and info.value.pages_needed == 3 and info.value.pages_free == 2
    assert a.num_free == 2  # nothing changed
    a.release_slot(0)
    assert a.num_free == 3 and 11 in a.prefix_pages  # shared pages still held by slot 1
    a.release_slot(1)
    assert a.num_free == 6 and not a.prefix_pages
    a.check()
    with pytest.raises(RuntimeError):
        a.release_pages([0])


def _contiguous_attention(q, k, v, length):
    mask = (jnp.arange(k.shape[1])[None, :] < length[:, None])[:, None, :]
    return grouped_attention(q, k, v, mask, 0.3)


def test_paged_decode_matches_contiguous_attention():
    """Write a prompt through write_prefix into scattered pages, then one decode token via
    paged_decode_attend: the output equals attention over the contiguous sequence."""
    rng = np.random.default_rng(0)
    L, P, page, K, H, E = 2, 9, 4, 2, 4, 8
    lens = [6, 9]  # tokens already in the cache per slot; the decode token is at position len
    page_table = np.array([[7, 2, 4, P], [0, 5, 8, P]], np.int32)  # P = null page
    pool_k = jnp.asarray(rng.normal(size=(L, P, page, K, E)), jnp.float32)  # stale garbage
    pool_v = jnp.asarray(rng.normal(size=(L, P, page, K, E)), jnp.float32)
    full_k = rng.normal(size=(2, 12, K, E)).astype(np.float32)
    full_v = rng.normal(size=(2, 12, K, E)).astype(np.float32)
    for s, n in enumerate(lens):
        dest = np.where(np.arange(12) < n, page_table[s][np.arange(12) // page], P).astype(np.int32)
        kv_k = np.broadcast_to(full_k[s], (L, 12, K, E))
        kv_v = np.broadcast_to(full_v[s], (L, 12, K, E))
        pool_k = kv_cache.write_prefix(pool_k, jnp.asarray(kv_k), jnp.asarray(dest), page)
        pool_v = kv_cache.write_prefix(pool_v, jnp.asarray(kv_v), jnp.asarray(dest), page)
    pos = np.array(lens, np.int32)
    write_pages = page_table[np.arange(2), pos // page]
    q = jnp.asarray(rng.normal(size=(2, 1, H, E)), jnp.float32)
    new_k = jnp.asarray(full_k[np.arange(2), pos][:, None])
    new_v = jnp.asarray(full_v[np.arange(2), pos][:, None])
    attend = kv_cache.paged_decode_attend(jnp.asarray(page_table), jnp.asarray(pos), jnp.asarray(write_pages), page, 0.3)
    out, (pk, pv) = attend(q, new_k, new_v, 1, (pool_k, pool_v))
    ref = _contiguous_attention(q, jnp.asarray(full_k), jnp.asarray(full_v), jnp.asarray(pos + 1))
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-5)
    # the new token landed at (page_table[s, pos // page], pos % page) of layer 1 only
    for s in range(2):
        np.testing.assert_array_equal(np.asarray(pk[1, write_pages[s], pos[s] % page]), full_k[s, pos[s]])
    np.testing.assert_array_equal(np.asarray(pk[0]), np.asarray(pool_k[0]))
    # a null write page drops the write
    null = jnp.asarray([P, P], jnp.int32)
    _, (pk2, _) = kv_cache.paged_decode_attend(jnp.asarray(page_table), jnp.asarray(pos), null, page, 0.3)(
        q, new_k, new_v, 1, (pool_k, pool_v))
    np.testing.assert_array_equal(np.asarray(pk2), np.asarray(pool_k))


@pytest.mark.parametrize("block_pages", [1, 2, 3, 5, 8])
def test_blocked_decode_matches_gather_and_reads_only_live_blocks(block_pages):
    """blocked_decode_attend (``page_heads`` pool) == paged_decode_attend (``split`` pool) (fp32, <= 1e-5) for any
    block size, with the same pool write; pages past the longest active slot's last block are never read (NaN there
    would leak)."""
    rng = np.random.default_rng(1)
    L, P, page, K, H, E, S, maxp = 2, 48, 4, 2, 8, 8, 4, 10
    lens = np.array([3, 13, 22, 9])  # the decode token is at position lens[s]
    active = np.array([True, True, True, False])  # slot 3 is done: its length does not count
    perm = rng.permutation(P - 9)  # live pages; 39..46 will hold NaN; 47 (read for null entries) stays finite
    page_table = np.full((S, maxp), P, np.int32)
    for s in range(S):
        n = kv_cache.pages_for(lens[s] + 1, page)
        page_table[s, :n] = perm[s * maxp:s * maxp + n]
    pool_k = rng.normal(size=(L, P, page, K, E)).astype(np.float32)
    pool_v = rng.normal(size=(L, P, page, K, E)).astype(np.float32)
    pos = jnp.asarray(lens, jnp.int32)
    write_pages = jnp.asarray(np.where(active, page_table[np.arange(S), lens // page], P), jnp.int32)
    q = jnp.asarray(rng.normal(size=(S, 1, H, E)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(S, 1, K, E)), jnp.float32) for _ in range(2))
    ref, (rk, rv) = kv_cache.paged_decode_attend(jnp.asarray(page_table), pos, write_pages, page, 0.3)(
        q, k, v, 1, (jnp.asarray(pool_k), jnp.asarray(pool_v)))
    nblk = kv_cache.live_blocks(pos, jnp.asarray(active), block_pages * page)
    assert int(nblk) == -(-23 // (block_pages * page))  # longest active slot: 23 tokens
    # page-table entries past the live blocks point at NaN pages: the loop must not read them
    pt = page_table.copy()
    first_unread = int(nblk) * block_pages
    nan_pages = np.arange(P - 9, P - 1)
    pt[:, first_unread:] = nan_pages[np.arange(max(maxp - first_unread, 0)) % 8]
    pk, pv = pool_k.copy(), pool_v.copy()
    pk[:, nan_pages] = np.nan
    pv[:, nan_pages] = np.nan
    attend = kv_cache.blocked_decode_attend(jnp.asarray(pt), pos, write_pages, page, 0.3, nblk, block_pages)
    to_page_heads = lambda x: jnp.asarray(np.swapaxes(x, 2, 3))  # noqa: E731  [L, P, page, K, E] -> [L, P, K, page, E]
    out, (bk, bv) = jax.jit(attend)(q, k, v, 1, (to_page_heads(pk), to_page_heads(pv)))
    bk, bv = np.swapaxes(np.asarray(bk), 2, 3), np.swapaxes(np.asarray(bv), 2, 3)
    out, ref = np.asarray(out), np.asarray(ref)
    assert np.isfinite(out[active]).all()
    np.testing.assert_allclose(out[active], ref[active], atol=1e-5, rtol=0)
    keep = np.setdiff1d(np.arange(P), nan_pages)
    np.testing.assert_array_equal(np.asarray(bk)[:, keep], np.asarray(rk)[:, keep])
    np.testing.assert_array_equal(np.asarray(bv)[:, keep], np.asarray(rv)[:, keep])


def _cfg(**kw):
    base = dict(model_type="qwen3", vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=4, num_heads=4,
                num_kv_heads=2, head_dim=16)
    base.update(kw)
    return ModelConfig(**base)


def _sizing(cfg, mesh, monkeypatch, limit, in_use, fraction=0.5, slots=8, max_seq=256, reserve_weight_push=False):
    monkeypatch.setattr(kv_cache, "device_memory", lambda devices: (limit, in_use, "memory_stats"))
    spec = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=16,
                max_pages_per_seq=kv_cache.pages_for(max_seq, 16), dtype=cfg.dtype)
    return kv_cache.auto_num_pages(spec, cfg, mesh, model_shardings(cfg, mesh, "generator"), max_slots=slots,
                                   max_prefill=128, max_seq=max_seq, fraction=fraction,
                                   reserve_weight_push=reserve_weight_push)


def test_auto_sizing_formula(monkeypatch):
    cfg = _cfg()
    mesh = make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1])
    limit, in_use = 8 << 20, 1 << 20
    r = _sizing(cfg, mesh, monkeypatch, limit, in_use)
    page_bytes = 2 * 4 * 16 * 2 * 16 * 4  # k+v, layers, page, kv heads, head dim, fp32
    assert r.page_bytes == page_bytes
    assert r.param_bytes == cfg.num_params() * 4
    budget = 0.5 * (limit - max(in_use, r.param_bytes)) - r.workspace_bytes
    assert r.num_pages == min(int(budget // page_bytes), 8 * 16)
    # tensor parallelism halves the per-device page (kv heads split) and the params
    mesh2 = make_mesh({"data": 1, "tensor": 2}, devices=jax.devices()[:2])
    r2 = _sizing(cfg, mesh2, monkeypatch, limit, in_use)
    assert r2.page_bytes == page_bytes // 2 and r2.param_bytes < r.param_bytes and r2.num_pages > r.num_pages


def test_auto_sizing_with_the_pool_split_over_data(monkeypatch):
    """With the pages split over a data=2 axis each device holds half of the pool: twice the pages fit, a
    multiple of 2, and the per-replica cap is half the slots at full length."""
    cfg = _cfg()
    mesh = make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1])
    mesh2 = make_mesh({"data": 2, "tensor": 1}, devices=jax.devices()[:2])
    limit, in_use = 8 << 20, 1 << 20
    one = _sizing(cfg, mesh, monkeypatch, limit, in_use, slots=4)
    spec = dict(num_layers=cfg.num_layers, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, page_size=16,
                max_pages_per_seq=kv_cache.pages_for(256, 16), dtype=cfg.dtype)
    two = kv_cache.auto_num_pages(spec, cfg, mesh2, model_shardings(cfg, mesh2, "generator"), max_slots=4,
                                  max_prefill=128, max_seq=256, fraction=0.5, replicas=2)
    budget = 0.5 * (limit - max(in_use, two.param_bytes)) - two.workspace_bytes
    assert two.num_pages == 2 * min(int(budget // two.page_bytes), 2 * 16) and two.num_pages % 2 == 0
    assert two.workspace_bytes <= one.workspace_bytes  # half the decode slots per device


def test_replica_allocators_keep_each_replica_to_its_slots():
    ra = kv_cache.ReplicaAllocators(num_pages=8, num_slots=4, replicas=2)
    assert ra.pages_per_replica == 4 and [ra.replica(s) for s in range(4)] == [0, 0, 1, 1]
    ra.of(3).slot_pages[3] = ra.of(3).allocate(3, [3])
    assert ra.num_free == 5 and ra.max_free == 4 and ra.free_of(2) == 1 and ra.slot_pages[3] == [0, 1, 2]
    with pytest.raises(OutOfPagesError) as info:
        ra.of(2).allocate(2, [2])
    assert info.value.slots == (2,)
    ra.check()
    ra.allocs[0].slot_pages[3] = ra.allocs[0].allocate(1, [3])  # a page of replica 0 given to replica 1's slot
    with pytest.raises(AssertionError, match="other replicas"):
        ra.check()
    with pytest.raises(ValueError, match="split over 3 replicas"):
        kv_cache.ReplicaAllocators(num_pages=8, num_slots=4, replicas=3)


def test_auto_sizing_keeps_room_for_a_weight_push(monkeypatch):
    """An RL generator receives new weights while the old ones serve: the pool leaves room for that
    second copy (as the planner counts it), standalone generation does not."""
    cfg = _cfg()
    mesh = make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1])
    limit, in_use = 40 << 20, 1 << 20
    plain = _sizing(cfg, mesh, monkeypatch, limit, in_use, slots=64)
    rl = _sizing(cfg, mesh, monkeypatch, limit, in_use, slots=64, reserve_weight_push=True)
    assert plain.incoming_weight_bytes == 0 and rl.incoming_weight_bytes == rl.param_bytes > 0
    budget = 0.5 * (limit - max(in_use, rl.param_bytes) - rl.param_bytes) - rl.workspace_bytes
    assert rl.num_pages == int(budget // rl.page_bytes) < plain.num_pages < 64 * 16  # the cap does not bind
    from jaxrl_async.generator.factory import EngineConfig, build_engine

    monkeypatch.setattr(kv_cache, "device_memory", lambda devices: (limit, in_use, "memory_stats"))
    engine = build_engine(EngineConfig(max_concurrent_decodes=64, max_sequence_length=256,
                                       max_prefill_length=128, page_size=16, cache_memory_fraction=0.5),
                          cfg, mesh, reserve_weight_push=True)
    assert engine.sizing.incoming_weight_bytes == engine.sizing.param_bytes  # the RL engine reserves it
    from jaxrl_async.generator.packed_weights import packed_bytes

    # and the packed copy of the layer matrices where the engine makes one (CPU kernels, float32)
    assert engine.sizing.packed_weight_bytes == (2 * packed_bytes(cfg) if engine.packed_weights else 0)
    cfg32 = _cfg(dtype="float32", param_dtype="float32")
    ec = EngineConfig(max_concurrent_decodes=64, max_sequence_length=256, max_prefill_length=128, page_size=16,
                      cache_memory_fraction=0.5)
    packed = build_engine(ec, cfg32, mesh, reserve_weight_push=True)
    if packed.packed_weights:
        r = packed.sizing
        assert r.packed_weight_bytes == 2 * packed_bytes(cfg32) > 0  # the copy, and a push's staged copy
        standalone = build_engine(ec, cfg32, mesh)  # no pushes: no staged copy
        assert standalone.sizing.packed_weight_bytes == packed_bytes(cfg32)
        from jaxrl_async.models import lora

        # unmerged LoRA adapters are pushed alone: the packed base matrices stay, no staged copy
        lcfg = cfg32.replace(lora=lora.LoraSpec(rank=4, alpha=8.0, targets=("q", "v")))
        assert build_engine(ec, lcfg, mesh, reserve_weight_push=True).sizing.packed_weight_bytes == packed_bytes(lcfg)
        assert r.num_pages == int((0.5 * (limit - max(in_use, r.param_bytes) - r.incoming_weight_bytes
                                          - r.packed_weight_bytes) - r.workspace_bytes) // r.page_bytes)
        unpacked = build_engine(ec, cfg32, mesh, reserve_weight_push=True, packed_weights=False)
        assert unpacked.sizing.packed_weight_bytes == 0 and unpacked.sizing.num_pages > r.num_pages


def test_auto_sizing_clamps_and_errors(monkeypatch):
    cfg = _cfg()
    mesh = make_mesh({"data": 1, "tensor": 1}, devices=jax.devices()[:1])
    assert _sizing(cfg, mesh, monkeypatch, 1 << 40, 0).num_pages == 8 * 16  # never more than a full reservation
    with pytest.raises(MemoryError, match="max_sequence_length=256"):
        _sizing(cfg, mesh, monkeypatch, 2 << 20, 0)


def test_cpu_sizes_from_the_hosts_available_ram_without_a_fixed_cap():
    """Issue 30: on a CPU the pool's limit is what the host can give (MemAvailable / the devices), not 1 GiB."""
    avail = kv_cache.host_available_bytes()
    limit, in_use, source = kv_cache.device_memory(jax.devices("cpu")[:2])
    assert source == "host RAM" and in_use == 0
    assert 0.8 * avail / 2 <= limit <= 1.2 * avail / 2  # (the free memory moves a little between the two reads)


def _advance_by_steps(h, steps, max_seq):
    """`host_slots.advance` as it was written before session 22: one step at a time."""
    for _ in range(steps):
        act = h.live & ~h.done
        h.pos[act] += 1
        h.num_generated[act] += 1
        h.done |= act & ((h.num_generated >= h.max_new) | (h.pos + 1 >= max_seq))


def test_host_advance_and_page_allocation_equal_the_step_by_step_forms():
    """The host mirror's K-step advance (closed form) equals K single steps on random slots near their limits, and
    a dispatch's pages are handed out per replica in slot order (as one page per slot, slot by slot)."""
    import copy

    from jaxrl_async.generator import host_slots

    rng = np.random.default_rng(0)
    for trial in range(200):
        S, max_seq, k = 16, int(rng.integers(8, 40)), int(rng.integers(0, 17))
        h = host_slots.HostSlots.empty(64, S, replicas=2)
        h.live[:] = rng.random(S) < 0.8
        h.done[:] = h.live & (rng.random(S) < 0.2)
        h.pos[:] = rng.integers(0, max_seq - 1, S)
        h.max_new[:] = rng.integers(1, 30, S)
        h.num_generated[:] = np.minimum(rng.integers(0, 30, S), h.max_new)
        ref = copy.deepcopy(h)
        host_slots.advance(h, k, max_seq)
        _advance_by_steps(ref, k, max_seq)
        for name in ("pos", "num_generated", "done"):
            np.testing.assert_array_equal(getattr(h, name), getattr(ref, name), err_msg=f"{name}, trial {trial}")
    h = host_slots.HostSlots.empty(32, 8, replicas=2)
    h.live[:] = True
    h.alloc.allocs[1].allocate(3, [4])  # replica 1 has used pages: its ids start later
    need = np.array([1, 0, 1, 1, 0, 1, 1, 0], bool)
    new_pages, new_index = host_slots.allocate_pages(h, need)
    np.testing.assert_array_equal(new_pages, [0, -1, 1, 2, -1, 3, 4, -1])
    assert [h.alloc.of(s).slot_pages[s] for s in range(8)] == [[0], [], [1], [2], [], [3], [4], []]
    np.testing.assert_array_equal(new_index, 0)
    np.testing.assert_array_equal(h.num_pages, need.astype(int))
