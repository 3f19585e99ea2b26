"""A deterministic host-only `Engine` for orchestrator tests, and its reference decoder.

The "model" is a hash: a slot's KV is summarised by a rolling digest over the (token, salt)
pairs it has processed, where the salt identifies the weights (`MockParams.salt`) that
computed that KV entry. The token sampled at absolute position p is

    greedy  (temperature 0): mix(salt, digest, p)                          mod vocab
    sampled (temperature>0): mix(salt, digest, p, seed, sample_index)      mod vocab

and its log-prob is -0.05 * (1 + mix(token, salt) mod 20). So tokens depend on the whole
context *and* on which weights computed each cached entry: `keep_kv` (old entries keep their
old salt) and `recompute_kv` (all entries re-computed with the new salt) give different
continuations, and `reference_tokens` reproduces either from the per-token versions.

Paging: a slot holding KV of L tokens holds ceil(L / page_size) pages of a pool of
`num_pages`; a decode step that needs a page the pool lacks raises `OutOfPagesError` with
`.slots` (the slots that needed one), leaving the state unchanged.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from typing import Any, Sequence

import numpy as np

from jaxrl_async.generator.engine_api import Engine, OutOfPagesError, Prefix, SamplingParams, StepResult

_M = 0xFFFFFFFF


def mix(*vals: int) -> int:
    """Deterministic 32-bit FNV-style hash of a few ints."""
    h = 2166136261
    for v in vals:
        h = ((h ^ (int(v) & _M)) * 16777619) & _M
        h ^= h >> 13
    return h


def fold(tokens: Sequence[int], salt: int, digest: int = 0) -> int:
    """Digest of a KV that processed `tokens` with weights `salt`, continuing from `digest`."""
    for t in tokens:
        digest = mix(digest, t, salt)
    return digest


def next_token(salt: int, digest: int, position: int, sampling: SamplingParams, sample_index: int, vocab: int) -> int:
    if sampling.temperature == 0:
        return mix(salt, digest, position) % vocab
    return mix(salt, digest, position, sampling.seed, sample_index) % vocab


def token_logprob(token: int, salt: int) -> float:
    return float(np.float32(-0.05 * (1 + mix(token, salt) % 20)))


@dataclasses.dataclass(frozen=True)
class MockParams:
    salt: int


@dataclasses.dataclass
class _MockKV:
    digest: int
    salt: int


@dataclasses.dataclass
class _Slot:
    digest: int
    kv_len: int  # tokens whose KV is cached
    last_token: int  # sampled, not yet in the KV
    generated: int
    sampling: SamplingParams
    sample_index: int
    pages: int
    done: bool


class MockState:
    def __init__(self, num_slots: int, num_pages: int):
        self.slots: list[_Slot | None] = [None] * num_slots
        self.free_pages = num_pages


class MockEngine(Engine):
    """Deterministic engine; every call is checked against the contract (busy slots, page accounting)."""

    def __init__(self, num_slots: int = 4, max_prefill_length: int = 64, max_sequence_length: int = 128,
                 vocab_size: int = 50, step_latency_s: float = 0.0, num_pages: int = 1 << 20, page_size: int = 4,
                 fail_on_step: int | None = None, fail_on_prefill: int | None = None):
        self.num_slots = num_slots
        self._max_prefill = max_prefill_length
        self._max_seq = max_sequence_length
        self.vocab_size = vocab_size
        self.step_latency_s = step_latency_s
        self.num_pages = num_pages
        self.page_size = page_size
        self.fail_on_step = fail_on_step
        self.fail_on_prefill = fail_on_prefill
        # call log (for assertions)
        self.num_steps = 0
        self.num_prefills = 0
        self.prefill_calls: list[tuple[int, int, int]] = []  # (length, num_samples, sample_offset)
        self.prefill_batches: list[int] = []  # sizes of the prefill_many calls
        self.inserted_slots: list[int] = []
        self.live_per_step: list[int] = []
        self.out_of_pages_raised = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    # -- contract -------------------------------------------------------------------------
    @property
    def max_concurrent_decodes(self) -> int:
        return self.num_slots

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def max_sequence_length(self) -> int:
        return self._max_seq

    def pages_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.page_size)

    def free_pages(self, state: MockState) -> int:
        return state.free_pages

    def init_decode_state(self) -> MockState:
        return MockState(self.num_slots, self.num_pages)

    def prefill(self, params: MockParams, tokens, sampling: SamplingParams, num_samples: int = 1,
                sample_offset: int = 0) -> Prefix:
        self.threads.add(threading.current_thread().name)
        tokens = [int(t) for t in tokens]
        if len(tokens) > self._max_prefill:
            raise ValueError(f"prompt of {len(tokens)} tokens > max_prefill_length {self._max_prefill}")
        self.num_prefills += 1
        self.prefill_calls.append((len(tokens), num_samples, sample_offset))
        if self.fail_on_prefill is not None and self.num_prefills == self.fail_on_prefill:
            raise RuntimeError(f"injected prefill failure #{self.num_prefills}")
        digest = fold(tokens, params.salt)
        firsts = [next_token(params.salt, digest, len(tokens), sampling, sample_offset + k, self.vocab_size)
                  for k in range(num_samples)]
        return Prefix(kv=_MockKV(digest, params.salt), length=len(tokens),
                      first_tokens=np.asarray(firsts, np.int32),
                      first_logprobs=np.asarray([token_logprob(t, params.salt) for t in firsts], np.float32),
                      sampling=sampling, sample_indices=tuple(range(sample_offset, sample_offset + num_samples)))

    def prefill_many(self, params, requests):
        self.prefill_batches.append(len(requests))
        return super().prefill_many(params, requests)

    def insert(self, prefix: Prefix, state: MockState, slot: int, sample: int = 0) -> MockState:
        if state.slots[slot] is not None:
            raise RuntimeError(f"insert into busy slot {slot}")
        pages = self.pages_needed(prefix.length)
        if pages > state.free_pages:
            raise OutOfPagesError(f"insert needs {pages} pages, {state.free_pages} free")
        state.free_pages -= pages
        tok = int(prefix.first_tokens[sample])
        sp = prefix.sampling
        state.slots[slot] = _Slot(prefix.kv.digest, prefix.length, tok, 1, sp, prefix.sample_indices[sample], pages,
                                  done=self._is_done(tok, 1, prefix.length, sp))
        self.inserted_slots.append(slot)
        return state

    def _is_done(self, tok: int, generated: int, kv_len: int, sp: SamplingParams) -> bool:
        return tok in sp.stop_token_ids or generated >= sp.max_new_tokens or kv_len + 1 >= self._max_seq

    def generate(self, params: MockParams, state: MockState) -> tuple[MockState, StepResult]:
        self.threads.add(threading.current_thread().name)
        self.num_steps += 1
        if self.fail_on_step is not None and self.num_steps == self.fail_on_step:
            raise RuntimeError(f"injected decode failure at step {self.num_steps}")
        active = [i for i, s in enumerate(state.slots) if s is not None and not s.done]
        grow = {i: self.pages_needed(state.slots[i].kv_len + 1) - state.slots[i].pages for i in active}
        need = sum(grow.values())
        if need > state.free_pages:
            self.out_of_pages_raised += 1
            self.num_steps -= 1
            err = OutOfPagesError(f"decode step needs {need} pages, {state.free_pages} free")
            err.slots = tuple(i for i, g in grow.items() if g > 0)
            raise err
        if self.step_latency_s:
            time.sleep(self.step_latency_s)
        S = self.num_slots
        tokens = np.zeros(S, np.int32)
        logprobs = np.zeros(S, np.float32)
        valid = np.zeros(S, bool)
        done = np.zeros(S, bool)
        for i in active:
            s = state.slots[i]
            state.free_pages -= grow[i]
            s.pages += grow[i]
            s.digest = mix(s.digest, s.last_token, params.salt)
            s.kv_len += 1
            tok = next_token(params.salt, s.digest, s.kv_len, s.sampling, s.sample_index, self.vocab_size)
            s.generated += 1
            s.last_token = tok
            s.done = self._is_done(tok, s.generated, s.kv_len, s.sampling)
            tokens[i], logprobs[i], valid[i], done[i] = tok, token_logprob(tok, params.salt), True, s.done
        self.live_per_step.append(len(active))
        return state, StepResult(tokens, logprobs, valid, done)

    def release(self, state: MockState, slot: int) -> MockState:
        s = state.slots[slot]
        if s is None:
            raise RuntimeError(f"release of free slot {slot}")
        state.free_pages += s.pages
        state.slots[slot] = None
        return state


def reference_tokens(prompt: Sequence[int], versions: Sequence[int], salts: dict[int, int], policy: str,
                     sampling: SamplingParams, sample_index: int = 0, vocab: int = 50) -> list[int]:
    """Tokens the mock produces given the version of each generated token and the KV policy.

    keep_kv: the KV entry of token t_{j-1} is computed by the step that samples t_j (salt of
    version v_j), earlier entries keep their salts. recompute_kv: at a version change the
    whole prefix (prompt + t_0..t_{j-1}) is re-computed under the new salt.
    """
    out: list[int] = []
    digest = None
    for j, v in enumerate(versions):
        salt = salts[v]
        if j == 0 or (policy == "recompute_kv" and v != versions[j - 1]):
            digest = fold(list(prompt) + out, salt)
        else:
            digest = mix(digest, out[-1], salt)
        out.append(next_token(salt, digest, len(prompt) + j, sampling, sample_index, vocab))
    return out


class GatedEngine(Engine):
    """Delegates to `inner`, but decode step number `gate_step` waits for `gate` (set by the test).

    Lets a test act (e.g. `update_params`) at a known point of generation on a real engine.
    """

    def __init__(self, inner: Engine, gate_step: int, timeout_s: float = 30.0):
        self.inner = inner
        self.vl_cfg = getattr(inner, "vl_cfg", None)  # a vision-language engine's (requests with images)
        self.gate_step = gate_step
        self.gate = threading.Event()
        self.reached = threading.Event()
        self.timeout_s = timeout_s
        self.num_steps = 0

    @property
    def max_concurrent_decodes(self) -> int:
        return self.inner.max_concurrent_decodes

    @property
    def max_prefill_length(self) -> int:
        return self.inner.max_prefill_length

    @property
    def max_sequence_length(self) -> int:
        return self.inner.max_sequence_length

    @property
    def max_reprefill_length(self) -> int:
        return self.inner.max_reprefill_length

    def init_decode_state(self) -> Any:
        return self.inner.init_decode_state()

    def prefill(self, params, tokens, sampling, num_samples=1, sample_offset=0):
        return self.inner.prefill(params, tokens, sampling, num_samples=num_samples, sample_offset=sample_offset)

    def prefill_many(self, params, requests):
        return self.inner.prefill_many(params, requests)

    def insert(self, prefix, state, slot, sample=0):
        return self.inner.insert(prefix, state, slot, sample=sample)

    def bulk_insert(self, prefix, state, slots):
        return self.inner.bulk_insert(prefix, state, slots)

    @property
    def max_decode_steps(self) -> int:
        return getattr(self.inner, "max_decode_steps", 1)

    def generate(self, params, state, num_steps=1):
        """(`num_steps`: a multi-step dispatch of the inner engine; the gate counts dispatches.)"""
        self.num_steps += 1
        if self.num_steps == self.gate_step:
            self.reached.set()
            if not self.gate.wait(self.timeout_s):
                raise TimeoutError("GatedEngine: gate never opened")
        return self.inner.generate(params, state, num_steps) if num_steps > 1 else self.inner.generate(params, state)

    def release(self, state, slot):
        return self.inner.release(state, slot)

    def free_pages(self, state) -> int:
        return self.inner.free_pages(state)

    def pages_needed(self, num_tokens: int) -> int:
        return self.inner.pages_needed(num_tokens)
