"""Orchestrator tests on the deterministic mock engine (tests/generator/mock_engine.py).

Expected tokens come from `reference_tokens`, an independent re-implementation of the mock's
decoding rule given the per-token versions, so every check can fail on a wrong token, a lost
or duplicated token, a token credited to the wrong sample, or a wrong version tag.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from jaxrl_async.generator.engine_api import OutOfPagesError, SamplingParams, StepResult
from jaxrl_async.generator.orchestrator import (
    Generator, GeneratorClosedError, GeneratorError, finish_reason_for, stop_string_hit,
)
from mock_engine import GatedEngine, MockEngine, MockParams, reference_tokens

T = 20.0  # every wait in these tests is bounded
SALTS = {0: 11, 1: 22, 2: 33}


def ref(prompt, n_tokens, sampling, sample_index=0, version=0, policy="keep_kv"):
    return reference_tokens(prompt, [version] * n_tokens, SALTS, policy, sampling, sample_index)


def prompts(k, base=3):
    return [[(7 * i + j) % 50 for j in range(base + i % 5)] for i in range(k)]


class CharTokenizer:
    """Token t decodes to the letter chr(97 + t % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + int(t) % 26) for t in ids)


# -- pure helpers ------------------------------------------------------------------------
def test_finish_reason_for():
    assert finish_reason_for(5, 1, 10, (5,), False) == "stop"
    assert finish_reason_for(5, 10, 10, (5,), False) == "stop"  # stop token wins over length
    assert finish_reason_for(4, 10, 10, (5,), False) == "length"
    assert finish_reason_for(4, 3, 10, (5,), True) == "length"  # engine's own limit
    assert finish_reason_for(4, 3, 10, (5,), False) is None


def test_stop_string_hit_only_when_completed_by_last_token():
    dec = CharTokenizer().decode
    assert stop_string_hit(dec, [0, 1, 2], ["bc"], 8) == "bc"  # "abc": completed by 'c'
    assert stop_string_hit(dec, [1, 2, 3], ["bc"], 8) is None  # "bcd": completed earlier
    assert stop_string_hit(dec, [3], ["d"], 8) == "d"
    assert stop_string_hit(dec, [9, 0, 1, 2], ["bc"], 2) == "bc"  # window 2 still sees "bc"


# -- continuous batching -----------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_continuous_batching_all_complete_and_slots_reused(temperature):
    eng = MockEngine(num_slots=4, step_latency_s=0.0005)
    ps = prompts(13)
    budgets = [3 + (11 * i) % 17 for i in range(len(ps))]
    with Generator(eng, MockParams(SALTS[0])) as gen:
        handles = [gen.submit(p, SamplingParams(temperature=temperature, seed=i, max_new_tokens=m))
                   for i, (p, m) in enumerate(zip(ps, budgets))]
        outs = [h.result(T) for h in handles]
        stats = gen.stats()
    for i, (p, m, o) in enumerate(zip(ps, budgets, outs)):
        sp = SamplingParams(temperature=temperature, seed=i, max_new_tokens=m)
        (s,) = o.samples
        assert s.prompt_ids == p and s.finish_reason == "length"
        assert s.completion_ids == ref(p, m, sp)
        assert s.versions == [0] * m
        assert s.first_token_time is not None and s.finish_time >= s.first_token_time >= s.submit_time
    assert max(eng.live_per_step) <= 4
    assert len(eng.inserted_slots) == 13 and set(eng.inserted_slots) == {0, 1, 2, 3}  # slots reused
    assert eng.num_prefills == 13
    assert stats.generated_tokens == sum(budgets) and stats.finished_samples == 13
    assert 0 < stats.slot_utilisation <= 1 and 0 <= stats.host_overhead_fraction <= 1
    assert stats.live_slots == 0 and stats.queued_requests == 0


def test_decode_results_read_after_next_dispatch():
    """Step k's to_host happens after step k+1 was dispatched (overlap), except for the last step."""
    events = []

    class Logged(MockEngine):
        def generate(self, params, state):
            state, step = super().generate(params, state)
            k = self.num_steps
            events.append(("gen", k))
            host = step.to_host()

            class R(StepResult):
                def to_host(self_inner):
                    events.append(("host", k))
                    return host

            return state, R(step.tokens, step.logprobs, step.valid, step.done)

    eng = Logged(num_slots=2)
    with Generator(eng, MockParams(SALTS[0])) as gen:
        out = gen.submit([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=8)).result(T)
    assert out.samples[0].completion_ids == ref([1, 2, 3], 8, SamplingParams(temperature=0, max_new_tokens=8))
    for k in range(1, 7):  # 8 tokens: 1 from prefill, 7 decode steps
        assert events.index(("host", k)) > events.index(("gen", k + 1))


def test_streaming_chunks_in_order_and_match_result():
    eng = MockEngine(num_slots=2, step_latency_s=0.0005)
    sp = SamplingParams(temperature=0.5, seed=3, max_new_tokens=12, n=2)
    with Generator(eng, MockParams(SALTS[0])) as gen:
        h = gen.submit([4, 5, 6], sp, request_id="r", stream=True)
        chunks = list(h)
        out = h.result(T)
    for i in range(2):
        mine = [c for c in chunks if c.sample_index == i]
        assert all(c.request_id == "r" for c in mine)
        assert [t for c in mine for t in c.token_ids] == out.samples[i].completion_ids == ref([4, 5, 6], 12, sp, i)
        assert [lp for c in mine for lp in c.logprobs] == out.samples[i].logprobs
        assert [c.finish_reason for c in mine] == [None] * 11 + ["length"]

    with Generator(MockEngine(), MockParams(0)) as gen:
        plain = gen.submit([1], SamplingParams(max_new_tokens=2))
        with pytest.raises(RuntimeError, match="stream=True"):
            next(iter(plain))


# -- n samples ---------------------------------------------------------------------------
def test_n_samples_share_one_prefill():
    eng = MockEngine(num_slots=4)
    sp = SamplingParams(temperature=1.0, seed=9, max_new_tokens=6, n=3)
    with Generator(eng, MockParams(SALTS[0])) as gen:
        out = gen.submit([1, 2, 3, 4], sp).result(T)
    assert eng.prefill_calls == [(4, 3, 0)]
    assert [s.sample_index for s in out.samples] == [0, 1, 2]
    for i, s in enumerate(out.samples):
        assert s.completion_ids == ref([1, 2, 3, 4], 6, sp, i)
    assert len({tuple(s.completion_ids) for s in out.samples}) == 3  # distinct random streams


def test_n_larger_than_slots_is_split_into_consecutive_chunks():
    eng = MockEngine(num_slots=4)
    sp = SamplingParams(temperature=1.0, seed=1, max_new_tokens=5, n=6)
    with Generator(eng, MockParams(SALTS[0])) as gen:
        out = gen.submit([1, 2], sp).result(T)
    assert eng.prefill_calls == [(2, 4, 0), (2, 2, 4)]
    for i, s in enumerate(out.samples):
        assert s.sample_index == i and s.completion_ids == ref([1, 2], 5, sp, i)


# -- stop conditions ---------------------------------------------------------------------
def test_stop_token_and_sequence_limit():
    eng = MockEngine(num_slots=2, max_prefill_length=16, max_sequence_length=20)
    greedy = SamplingParams(temperature=0, max_new_tokens=30)
    full = ref([3, 1, 4], 17, greedy)
    stop_tok = full[6]
    first = full.index(stop_tok)
    with Generator(eng, MockParams(SALTS[0])) as gen:
        a = gen.submit([3, 1, 4], SamplingParams(temperature=0, max_new_tokens=30, stop_token_ids=(stop_tok,)))
        b = gen.submit([3, 1, 4], greedy)  # clamped: 20 - 3 = 17 new tokens
        c = gen.submit([3, 1, 4], SamplingParams(temperature=0, max_new_tokens=1))
        a, b, c = (h.result(T).samples[0] for h in (a, b, c))
    assert a.completion_ids == full[:first + 1] and a.finish_reason == "stop"
    assert b.completion_ids == full and b.finish_reason == "length"
    assert c.completion_ids == full[:1] and c.finish_reason == "length"


def test_stop_strings_truncate_at_completing_token():
    eng = MockEngine(num_slots=1, step_latency_s=0.001)
    sp0 = SamplingParams(temperature=0.7, seed=5, max_new_tokens=100)
    full = ref([2, 7], 100, sp0)
    text = CharTokenizer().decode(full)
    stop = text[10:12]
    end = next(j for j in range(1, 101) if stop in CharTokenizer().decode(full[:j]))
    sp = SamplingParams(temperature=0.7, seed=5, max_new_tokens=100, stop_strings=(stop, "@@"))
    with Generator(eng, MockParams(SALTS[0]), tokenizer=CharTokenizer()) as gen:
        out = gen.submit([2, 7], sp).result(T)
        other = gen.submit([2, 7], sp0).result(T)  # the released slot is reusable
        assert gen.stats().live_slots == 0
    s = out.samples[0]
    assert s.completion_ids == full[:end] and s.finish_reason == "stop"
    assert s.text.endswith(stop) and s.text == CharTokenizer().decode(full[:end])
    assert other.samples[0].completion_ids == full
    # the stream thread released the slot promptly (a few lagging decode steps), not after 100 - end more steps
    assert sum(eng.live_per_step) <= (end - 1) + 20 + 99
    with pytest.raises(ValueError, match="tokenizer"):
        Generator(eng, MockParams(0)).submit([1], sp)


# -- abort -------------------------------------------------------------------------------
def test_abort_running_and_queued_requests():
    eng = MockEngine(num_slots=1, step_latency_s=0.002)
    sp = SamplingParams(temperature=0, max_new_tokens=100)
    with Generator(eng, MockParams(SALTS[0])) as gen:
        running = gen.submit([1, 2, 3], sp, request_id="run", stream=True)
        queued = gen.submit([4, 5], sp, request_id="queued")
        it = iter(running)
        for _ in range(5):
            next(it)
        queued.abort()
        running.abort()
        r, q = running.result(T).samples[0], queued.result(T).samples[0]
        after = gen.submit([6], SamplingParams(temperature=0, max_new_tokens=4)).result(T)  # slot was freed
    assert r.finish_reason == "abort" and 5 <= len(r.completion_ids) < 100
    assert r.completion_ids == ref([1, 2, 3], len(r.completion_ids), sp)
    assert q.finish_reason == "abort" and q.completion_ids == [] and q.first_token_time is None
    assert after.samples[0].completion_ids == ref([6], 4, sp)
    gen.abort("unknown-id")  # no effect, no error


# -- weight swap -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["keep_kv", "recompute_kv"])
def test_weight_swap_mid_generation(policy):
    other = {"keep_kv": "recompute_kv", "recompute_kv": "keep_kv"}[policy]
    eng = GatedEngine(MockEngine(num_slots=4), gate_step=5)  # decode step 5 waits until the test opens the gate
    sp = [SamplingParams(temperature=t, seed=i, max_new_tokens=40) for i, t in enumerate([0, 0.9, 0, 0.9, 0, 0.9])]
    ps = prompts(6)
    with Generator(eng, MockParams(SALTS[0]), kv_update_policy=policy) as gen:
        hs = [gen.submit(p, s, request_id=f"r{i}") for i, (p, s) in enumerate(zip(ps, sp))]
        assert eng.reached.wait(T)
        gen.update_params(MockParams(SALTS[2]), version=2)  # pending while step 5 is in progress ...
        gen.update_params(MockParams(SALTS[1]), version=1)  # ... and superseded by this one
        assert gen.version == 0
        eng.gate.set()
        deadline = time.monotonic() + T
        while gen.version != 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        assert gen.version == 1
        outs = [h.result(T) for h in hs]
        late = gen.submit(ps[0], sp[0]).result(T).samples[0]  # admitted after the swap
        stats = gen.stats()
    swapped = 0
    for p, s, o in zip(ps, sp, outs):
        (smp,) = o.samples
        v = smp.versions
        assert len(smp.completion_ids) == 40 and smp.finish_reason == "length"  # nothing lost or duplicated
        assert v == sorted(v) and set(v) <= {0, 1}
        assert smp.completion_ids == reference_tokens(p, v, SALTS, policy, s)
        j = v.index(1) if 1 in v else 0
        if j > 0:  # interrupted mid-generation
            swapped += 1
            assert smp.completion_ids != reference_tokens(p, v, SALTS, other, s)  # test discriminates
            assert smp.completion_ids[:j] == ref(p, 40, s)[:j]
            assert smp.completion_ids[j:] != ref(p, 40, s)[j:]
            if policy == "recompute_kv":
                assert smp.num_recomputes == 1
    assert swapped == 4  # the 4 requests in slots at the swap were interrupted, not drained
    assert all(o.samples[0].versions.index(1) == 6 for o in outs[:4])  # prefill token + 5 steps at version 0
    assert late.versions == [1] * 40 and late.completion_ids == ref(ps[0], 40, sp[0], version=1)
    assert stats.weight_updates == 1 and stats.version == 1  # the two updates were collapsed into one swap
    if policy == "recompute_kv":
        assert stats.recomputed_sequences == 4


def test_admission_and_recompute_prefill_in_batches():
    """Queued requests that fit the free slots are prefilled by one prefill_many call; a recompute_kv swap
    re-prefills every live sequence in one call too."""
    eng = GatedEngine(MockEngine(num_slots=4), gate_step=3)
    sp = SamplingParams(temperature=0, max_new_tokens=10)
    ps = prompts(6)
    gen = Generator(eng, MockParams(SALTS[0]), kv_update_policy="recompute_kv")
    hs = [gen.submit(p, sp) for p in ps]  # queued before the decode thread starts
    with gen:
        assert eng.reached.wait(T)
        gen.update_params(MockParams(SALTS[1]), version=1)
        eng.gate.set()
        outs = [h.result(T).samples[0] for h in hs]
    batches = eng.inner.prefill_batches
    assert batches[:2] == [4, 4]  # the 4 that fit the slots; then the 4 live ones re-prefilled at the swap
    assert sum(batches) == 6 + 4 and all(len(o.completion_ids) == 10 for o in outs)
    for p, o in zip(ps, outs):
        assert o.completion_ids == reference_tokens(p, o.versions, SALTS, "recompute_kv", sp)


def test_admission_by_slots_starts_a_group_as_slots_free_up():
    """A group of 4 samples with 2 free slots starts 2 samples now and the other 2 when slots free up
    (one prefill shared by all 4), instead of waiting for 4 free slots: it completes long before the
    40-token request holding the other slots."""
    eng = MockEngine(num_slots=4, step_latency_s=0.002)
    long_sp = SamplingParams(temperature=0.9, seed=1, max_new_tokens=40, n=2)
    grp_sp = SamplingParams(temperature=0.9, seed=2, max_new_tokens=5, n=4)
    gen = Generator(eng, MockParams(SALTS[0]))
    h_long = gen.submit([1, 2, 3], long_sp)
    h_grp = gen.submit([4, 5], grp_sp)
    with gen:
        grp, long_ = h_grp.result(T), h_long.result(T)
        stats = gen.stats()
    assert stats.partial_admissions == 1
    assert [c for c in eng.prefill_calls if c[0] == 2] == [(2, 4, 0)]  # one prefill of the group's 4 samples
    assert max(s.finish_time for s in grp.samples) < min(s.finish_time for s in long_.samples)
    for smp in grp.samples:
        assert smp.completion_ids == ref([4, 5], 5, grp_sp, sample_index=smp.sample_index)
    for smp in long_.samples:
        assert smp.completion_ids == ref([1, 2, 3], 40, long_sp, sample_index=smp.sample_index)


def test_update_params_before_start_and_superseded_update():
    eng = MockEngine(num_slots=2)
    gen = Generator(eng, MockParams(SALTS[0]))
    gen.update_params(MockParams(SALTS[1]), version=1)
    assert gen.version == 1
    with gen:
        gen.update_params(MockParams(SALTS[0]), version=0)
        gen.update_params(MockParams(SALTS[2]), version=2, wait=True, timeout=T)
        out = gen.submit([1, 2], SamplingParams(temperature=0, max_new_tokens=5)).result(T)
    assert out.samples[0].versions == [2] * 5
    assert out.samples[0].completion_ids == ref([1, 2], 5, SamplingParams(temperature=0), version=2)


# -- paged cache pressure ----------------------------------------------------------------
def test_preemption_on_out_of_pages_is_transparent():
    # 4 slots, pages of 4 tokens, 14 pages: 4 sequences of up to 6 + 30 tokens (9 pages each) cannot all fit.
    eng = MockEngine(num_slots=4, num_pages=14, page_size=4)
    ps = [[i, i + 1, i + 2, i + 3, i + 4, i + 5] for i in range(6)]
    sp = [SamplingParams(temperature=0.9, seed=i, max_new_tokens=30) for i in range(6)]
    with Generator(eng, MockParams(SALTS[0])) as gen:
        handles = [gen.submit(p, s) for p, s in zip(ps, sp)]
        outs = [h.result(T).samples[0] for h in handles]
        stats = gen.stats()
    assert eng.out_of_pages_raised > 0 and stats.preemptions > 0
    assert sum(o.num_preemptions for o in outs) == stats.preemptions
    for p, s, o in zip(ps, sp, outs):
        assert o.completion_ids == ref(p, 30, s) and o.finish_reason == "length"
    assert any(length > 6 for length, _, _ in eng.prefill_calls)  # continuations were re-prefilled


def test_insert_out_of_pages_keeps_request_queued_with_its_prefill():
    # 10 pages of 4 tokens. A (5 tokens) holds 2 pages, so B's 3 samples of 9 tokens (3 pages each, no sharing in
    # the mock) do not fit until A finishes: B's bulk insert fails, is rolled back and retried with the same prefill.
    eng = MockEngine(num_slots=4, num_pages=10, page_size=4, step_latency_s=0.0005)
    spa = SamplingParams(temperature=0, max_new_tokens=12)
    spb = SamplingParams(temperature=1.0, seed=4, max_new_tokens=3, n=3)
    with Generator(eng, MockParams(SALTS[0])) as gen:
        a, b = gen.submit([1] * 5, spa), gen.submit([2] * 9, spb)
        a, b = a.result(T), b.result(T)
    assert [c for c in eng.prefill_calls if c[0] == 9] == [(9, 3, 0)]  # one prefill for B despite the retries
    assert len(eng.inserted_slots) > 1 + 3  # failed partial bulk inserts were rolled back
    assert a.samples[0].completion_ids == ref([1] * 5, 12, spa)
    for i, s in enumerate(b.samples):
        assert s.completion_ids == ref([2] * 9, 3, spb, i)
        assert s.first_token_time > a.samples[0].finish_time  # admitted only once A released its pages


def test_sequence_that_cannot_fit_fails_alone():
    eng = MockEngine(num_slots=2, num_pages=3, page_size=4)  # at most 12 tokens in the whole cache
    with Generator(eng, MockParams(SALTS[0])) as gen:
        big = gen.submit([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=40))
        with pytest.raises(GeneratorError) as ei:
            big.result(T)
        assert isinstance(ei.value.__cause__, OutOfPagesError)
        ok = gen.submit([1, 2, 3], SamplingParams(temperature=0, max_new_tokens=5)).result(T)
    assert ok.samples[0].completion_ids == ref([1, 2, 3], 5, SamplingParams(temperature=0))


# -- failures ----------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["step", "prefill"])
def test_engine_exception_propagates_to_every_waiter(where):
    kw = {"fail_on_step": 6} if where == "step" else {"fail_on_prefill": 3}
    eng = MockEngine(num_slots=2, step_latency_s=0.001, **kw)
    gen = Generator(eng, MockParams(SALTS[0])).start()
    hs = [gen.submit([1, i], SamplingParams(temperature=0, max_new_tokens=50), stream=(i == 0)) for i in range(4)]
    t0 = time.monotonic()
    with pytest.raises(GeneratorError) as ei:
        list(hs[0])
    assert "injected" in str(ei.value.__cause__)
    for h in hs[1:]:
        with pytest.raises(GeneratorError, match="injected"):
            h.result(T)
    assert time.monotonic() - t0 < 5
    with pytest.raises(GeneratorError, match="injected"):
        gen.submit([1], SamplingParams())
    gen.stop()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("generator-"))


def test_stop_fails_unfinished_requests_without_hanging():
    eng = MockEngine(num_slots=1, step_latency_s=0.002)
    gen = Generator(eng, MockParams(SALTS[0])).start()
    h = gen.submit([1], SamplingParams(temperature=0, max_new_tokens=10_000))
    h2 = gen.submit([2], SamplingParams(temperature=0, max_new_tokens=10))
    time.sleep(0.02)
    gen.stop()
    for x in (h, h2):
        with pytest.raises(GeneratorClosedError):
            x.result(T)
    with pytest.raises(GeneratorClosedError):
        gen.submit([1])
    with pytest.raises(TimeoutError):
        Generator(eng, MockParams(0)).submit([1]).result(0.01)


def test_submit_validation():
    gen = Generator(MockEngine(max_prefill_length=8, max_sequence_length=8), MockParams(0))
    with pytest.raises(ValueError, match="empty prompt"):
        gen.submit([])
    with pytest.raises(ValueError, match="max_prefill_length 8"):
        gen.submit(list(range(9)), request_id="long")
    with pytest.raises(ValueError, match="no room"):
        gen.submit(list(range(8)))
    with pytest.raises(ValueError, match="top_p"):
        gen.submit([1], SamplingParams(top_p=0))
    gen.submit([1], request_id="a")
    with pytest.raises(ValueError, match="already in flight"):
        gen.submit([1], request_id="a")
    with pytest.raises(ValueError, match="kv_update_policy"):
        Generator(MockEngine(), MockParams(0), kv_update_policy="drain")


# =========================================================================================
# Integration with the real PagedEngine on a tiny random Qwen3 (fp32), checked against torch
# =========================================================================================
@pytest.fixture(scope="module")
def real(tmp_path_factory):
    torch = pytest.importorskip("torch")
    import transformers

    from jaxrl_async.models import load_hf
    from jaxrl_async.generator.factory import EngineConfig, build_engine
    from jaxrl_async.testing import make_tiny_hf_model

    dirs = [make_tiny_hf_model(str(tmp_path_factory.mktemp(f"m{s}")), "qwen3", seed=s) for s in (0, 1)]
    cfg, pa = load_hf(dirs[0])
    _, pb = load_hf(dirs[1])
    # 18 pages of 8 tokens: three 37-token sequences fit (weight-swap test), three ~50-token ones do not
    eng = build_engine(EngineConfig(max_concurrent_decodes=3, max_sequence_length=64, prefill_buckets=(16, 48),
                                    page_size=8, num_pages=18), cfg)
    pa, pb = eng.place_params(pa), eng.place_params(pb)
    # the same engine with multi-step decode (issue 28): up to 8 steps (one page) per dispatch
    eng.multi = build_engine(EngineConfig(max_concurrent_decodes=3, max_sequence_length=64, prefill_buckets=(16, 48),
                                          page_size=8, num_pages=18, decode_steps=8), cfg)
    torch_models = [transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval() for d in dirs]
    return eng, {0: pa, 1: pb}, {0: torch_models[0], 1: torch_models[1]}


def check_against_torch(models, prompt, completion, logprobs, versions, policy):
    """Teacher-forced check of every generated token: greedy argmax and behaviour log-prob under
    the weights of its version, with the KV arrangement of `policy` (see reference_tokens)."""
    import torch

    cache, logits = None, None
    with torch.no_grad():
        for i, (tok, lp, v) in enumerate(zip(completion, logprobs, versions)):
            if i == 0 or (policy == "recompute_kv" and v != versions[i - 1]):
                from transformers import DynamicCache
                cache = DynamicCache()
                inp = torch.tensor([list(prompt) + list(completion[:i])])
            else:
                inp = torch.tensor([[completion[i - 1]]])
            logits = models[v](inp, past_key_values=cache, use_cache=True).logits[0, -1]
            ref_lp = torch.log_softmax(logits.double(), -1)
            assert int(torch.argmax(logits)) == tok, f"token {i} (version {v}): {tok} != argmax {int(torch.argmax(logits))}"
            assert abs(float(ref_lp[tok]) - lp) < 1e-4, f"log-prob of token {i}: {lp} vs {float(ref_lp[tok])}"


def test_real_engine_greedy_matches_transformers_with_preemption(real):
    """Greedy tokens and log-probs equal transformers' on a page-starved cache (preemption is transparent)."""
    eng, params, models = real
    ps = [[(13 * i + 7 * j) % 250 + 3 for j in range(3 + (5 * i) % 12)] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_new_tokens=40)
    with Generator(eng, params[0]) as gen:
        outs = [h.result(60).samples[0] for h in [gen.submit(p, greedy) for p in ps]]
        assert gen.stats().preemptions > 0
    assert sum(o.num_preemptions for o in outs) > 0
    for p, o in zip(ps, outs):
        assert o.versions == [0] * len(o.completion_ids) and len(o.completion_ids) == 40
        check_against_torch(models, p, o.completion_ids, o.logprobs, o.versions, "keep_kv")


@pytest.mark.parametrize("policy", ["keep_kv", "recompute_kv"])
def test_real_engine_weight_swap(real, policy):
    eng, params, models = real
    gated = GatedEngine(eng, gate_step=6)
    ps = [[(11 * i + 5 * j) % 250 + 3 for j in range(4 + 3 * i)] for i in range(4)]
    sp = SamplingParams(temperature=0, max_new_tokens=24)
    with Generator(gated, params[0], kv_update_policy=policy) as gen:
        hs = [gen.submit(p, sp) for p in ps]
        assert gated.reached.wait(60)
        gen.update_params(params[1], version=1)  # applied right after the gated step
        gated.gate.set()
        outs = [h.result(60).samples[0] for h in hs]
        assert gen.stats().preemptions == 0  # a preemption would re-prefill and change the keep_kv arrangement
    interrupted = 0
    for p, o in zip(ps, outs):
        v = o.versions
        assert len(o.completion_ids) == 24 and v == sorted(v)
        check_against_torch(models, p, o.completion_ids, o.logprobs, v, policy)
        if 0 < v.count(0) < 24:
            interrupted += 1
            j = v.index(1)
            assert j >= 6  # first token from prefill + >= 5 decode steps before the swap
    assert interrupted == 3  # the three requests in slots at the swap; the fourth starts under version 1
    assert outs[3].versions == [1] * 24


def test_real_engine_recompute_kv_reprefills_sequences_longer_than_the_largest_bucket(real):
    """recompute_kv on an engine whose largest prefill bucket (16) is shorter than every in-flight
    sequence at the swap (>= 22 tokens): each is re-prefilled in chunks under the new weights (checked
    token by token against transformers with the recompute arrangement; the old code kept their KV of
    the previous weights, which the keep_kv arrangement would match instead), with no fallback."""
    from jaxrl_async.generator.factory import EngineConfig, build_engine

    base, params, models = real
    eng = build_engine(EngineConfig(max_concurrent_decodes=3, max_sequence_length=64, prefill_buckets=(16,),
                                    page_size=8, num_pages=40), base.cfg)
    assert eng.max_prefill_length == 16 and eng.max_reprefill_length == 63
    gated = GatedEngine(eng, gate_step=12)
    ps = [[(7 * i + 3 * j) % 250 + 3 for j in range(10 + 2 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_new_tokens=30)
    with Generator(gated, params[0], kv_update_policy="recompute_kv") as gen:
        hs = [gen.submit(p, sp) for p in ps]
        assert gated.reached.wait(60)
        gen.update_params(params[1], version=1)
        gated.gate.set()
        outs = [h.result(60).samples[0] for h in hs]
        stats = gen.stats()
    assert stats.recomputed_sequences == 3 and stats.recompute_fallbacks == 0 and stats.preemptions == 0
    for p, o in zip(ps, outs):
        v = o.versions
        j = v.index(1)
        assert len(p) + j > eng.max_prefill_length  # longer than the largest bucket when re-prefilled
        assert o.num_recomputes == 1 and len(o.completion_ids) == 30
        check_against_torch(models, p, o.completion_ids, o.logprobs, v, "recompute_kv")


def test_real_engine_multi_step_decode_equals_single_steps(real):
    """Multi-step decode (8 steps per dispatch) gives every sample the tokens and behaviour log-probs of single steps,
    bitwise: greedy and sampled, stop tokens ending samples mid-dispatch, a page-starved pool (preemption); the
    weights swap between dispatches, at most one dispatch after the update is made."""
    eng, params, models = real
    ps = [[(13 * i + 7 * j) % 250 + 3 for j in range(3 + (5 * i) % 12)] for i in range(6)]
    greedy = SamplingParams(temperature=0, max_new_tokens=40)
    outs = {}
    for name, e in (("single", eng), ("multi", eng.multi)):
        with Generator(e, params[0]) as gen:
            hs = [gen.submit(p, greedy) for p in ps]
            # sampled, with a frequent stop id (samples end mid-dispatch) and different lengths
            hs += [gen.submit(p, SamplingParams(temperature=1.0, max_new_tokens=9 + 5 * i, seed=i, n=2,
                                                stop_token_ids=(ps[0][0], 17)))
                   for i, p in enumerate(ps)]
            outs[name] = [s for h in hs for s in h.result(120).samples]
            st = gen.stats()
            assert st.preemptions > 0
            if name == "multi":
                assert st.dispatches < st.steps / 2, st  # most dispatches ran several steps
    # the schedule differs (admission waits for a dispatch's end, pages are taken a dispatch ahead, so samples run
    # in other slots and are preempted at other points): rounding-level differences only, as between any two
    # schedules (test_engine.py checks bitwise equality on one schedule)
    for a, b in zip(outs["single"], outs["multi"]):
        assert (a.completion_ids, a.finish_reason) == (b.completion_ids, b.finish_reason)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    for p, o in zip(ps, outs["multi"][:6]):
        check_against_torch(models, p, o.completion_ids, o.logprobs, o.versions, "keep_kv")


def test_real_engine_reads_the_last_dispatch_instead_of_running_a_useless_one(real):
    """A dispatch that every live sample's length budget ends is read before anything else is dispatched: 1 + 16
    tokens at 8 steps per dispatch are two dispatches (the generator used to launch a third, of finished slots
    only, before reading the second); the tokens are those of single steps."""
    eng, params, _ = real
    sp = SamplingParams(temperature=0, max_new_tokens=17, n=3)
    prompt = [5, 9, 200, 31, 77]
    with Generator(eng.multi, params[0]) as gen:
        out = gen.submit(prompt, sp).result(120)
        st = gen.stats()
    assert (st.dispatches, st.steps) == (2, 16), st
    with Generator(eng, params[0]) as gen:
        ref = gen.submit(prompt, sp).result(120)
    assert [s.completion_ids for s in out.samples] == [s.completion_ids for s in ref.samples]
    assert all(len(s.completion_ids) == 17 and s.finish_reason == "length" for s in out.samples)


def test_real_engine_multi_step_weight_update_waits_at_most_one_dispatch(real):
    eng, params, models = real
    gated = GatedEngine(eng.multi, gate_step=3)
    ps = [[(11 * i + 5 * j) % 250 + 3 for j in range(4 + 3 * i)] for i in range(3)]
    sp = SamplingParams(temperature=0, max_new_tokens=32)  # <= 42 tokens, 6 pages each: no preemption
    with Generator(gated, params[0]) as gen:
        hs = [gen.submit(p, sp) for p in ps]
        assert gated.reached.wait(60)  # dispatch 3 is about to run
        gen.update_params(params[1], version=1)
        gated.gate.set()
        outs = [h.result(60).samples[0] for h in hs]
        assert gen.stats().preemptions == 0  # a preemption would re-prefill and change the keep_kv arrangement
    for p, o in zip(ps, outs):
        v = o.versions
        assert v == sorted(v) and v.count(1) > 0
        # the first token (prefill) and three dispatches of up to 8 steps ran under version 0: the update landed
        # right after the dispatch that was waiting, not later
        assert v.count(0) <= 1 + 3 * 8, v.count(0)
        check_against_torch(models, p, o.completion_ids, o.logprobs, v, "keep_kv")
