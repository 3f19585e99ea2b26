// The sampler of a decode step for XLA:CPU (issue 28): one token per row of logits and the row's log-normaliser, in
// two passes over the row (its maximum, then exp and block sums) where XLA's program makes about ten (scaling, two
// maxima, two exp passes for the inverse CDF and the logsumexp, block sums, their prefix sums, the crossings, the
// gathers), each a thunk of its own. The math is `generator/sampling.py`'s, row by row:
//
//   z = l * (1 / T) (T > 0), p_v = exp(z_v - max z) on the support {v : z_v >= theta}, 0 off it; the token is the
//   inverse CDF of p at u times the support's mass, over blocks of 128 entries (first the block where the prefix sum
//   of the block sums exceeds it, then the entry inside the block), never an entry of zero mass; T <= 0 (greedy):
//   the first index of max l. lse = max z + log sum_v exp(z_v - max z) over the FULL vocabulary (z = l if greedy).
//
// Operands: logits [B, V] f32, temperature [B] f32, theta [B] f32 (-inf: no truncation; computed by XLA from the same
// z bits when a row truncates), u [B] f32 in [0, 1). Results: tokens [B] s32, lse [B] f32; the behaviour log-prob
// z[token] - lse is formed by XLA (`sampling.sample`), as are the top log-probs from the same lse, so the sampled
// token's entry among them is its log-prob bitwise. The sums run in another order than XLA's and exp is
// `fast_math.h`'s, so a draw's boundaries move by ~1e-7 of the mass and lse by ~1e-7 (tests/generator/
// test_cpu_kernels.py holds it to the reference path). Rows are shared with XLA's intra-op pool.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "fast_math.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 128;  // sampling.CDF_BLOCK

constexpr int64_t kLanes = 16;  // independent accumulators: the loops below compile to vector max / add chains

inline float row_max(const float* l, int64_t V) {
  float acc[kLanes];
  for (int64_t k = 0; k < kLanes; ++k) acc[k] = -INFINITY;
  const int64_t body = V - V % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
#pragma omp simd
    for (int64_t k = 0; k < kLanes; ++k) acc[k] = l[i + k] > acc[k] ? l[i + k] : acc[k];
  }
  float m = -INFINITY;
  for (int64_t i = body; i < V; ++i) m = std::max(m, l[i]);
  for (int64_t k = 0; k < kLanes; ++k) m = std::max(m, acc[k]);
  return m;
}

// exp(z - zmax) of the entries [a, b) of a row (z = l * inv_t): their sum into *all, the sum of those with z >= th
// into *kept, and, with p, the masses themselves (0 off the support) into p[0, b - a): the block sums and the block
// searched for the token see the same values.
#if defined(__AVX512F__)
inline void block_masses(const float* l, int64_t a, int64_t b, float inv_t, float zmax, float th, float* all,
                         float* kept, float* p) {
  const __m512 vinv = _mm512_set1_ps(inv_t), vzmax = _mm512_set1_ps(zmax), vth = _mm512_set1_ps(th);
  const __m512 none = _mm512_set1_ps(-INFINITY);
  __m512 va = _mm512_setzero_ps(), vk = _mm512_setzero_ps();
  for (int64_t i = a; i < b; i += 16) {
    const int64_t n = std::min<int64_t>(16, b - i);
    const __mmask16 m = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
    const __m512 z = _mm512_mul_ps(_mm512_mask_loadu_ps(none, m, l + i), vinv);  // lanes past b: -inf, mass 0
    const __m512 e = jaxrl_cpu::exp16(_mm512_sub_ps(z, vzmax));
    const __mmask16 keep = _mm512_cmp_ps_mask(z, vth, _CMP_GE_OQ) & m;
    va = _mm512_add_ps(va, e);
    vk = _mm512_mask_add_ps(vk, keep, vk, e);
    if (p != nullptr) _mm512_mask_storeu_ps(p + (i - a), m, _mm512_maskz_mov_ps(keep, e));
  }
  *all = _mm512_reduce_add_ps(va);
  *kept = _mm512_reduce_add_ps(vk);
}
#else
inline void block_masses(const float* l, int64_t a, int64_t b, float inv_t, float zmax, float th, float* all_out,
                         float* kept_out, float* p) {
  float all[kLanes] = {}, kept[kLanes] = {};
  for (int64_t i0 = a; i0 < b; i0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, b - i0);
    float e[kLanes];
#pragma omp simd
    for (int64_t k = 0; k < kLanes; ++k) {
      const float z = k < n ? l[i0 + k] * inv_t : -INFINITY;
      e[k] = z >= th ? jaxrl_cpu::exp_approx(z - zmax) : 0.f;
      all[k] += k < n ? jaxrl_cpu::exp_approx(z - zmax) : 0.f;
      kept[k] += e[k];
    }
    if (p != nullptr)
      for (int64_t k = 0; k < n; ++k) p[i0 - a + k] = e[k];
  }
  float sa = 0.f, sk = 0.f;
  for (int64_t k = 0; k < kLanes; ++k) sa += all[k], sk += kept[k];
  *all_out = sa;
  *kept_out = sk;
}
#endif

void sample_row(const float* l, int64_t V, float temperature, float theta, float u, int32_t* token, float* lse) {
  const float lmax = row_max(l, V);
  const bool greedy = !(temperature > 0.f);
  // z = l * (1 / T), the bits of sampling.scale_logits (the truncation threshold theta is one of XLA's z values)
  const float inv_t = greedy ? 1.f : 1.f / temperature;
  const float zmax = lmax * inv_t;  // rounding is monotonic: max(l * c) = max(l) * c for c > 0
  const int64_t nb = (V + kBlock - 1) / kBlock;
  thread_local std::vector<float> sums;
  if (static_cast<int64_t>(sums.size()) < nb) sums.resize(nb);
  float total = 0.f;  // the full row's sum of exp(z - max z): the log-prob's normaliser
  float support = 0.f;
  const float th = greedy ? zmax : theta;  // a greedy row's support: its maximal entries
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t a = j * kBlock, b = std::min(V, a + kBlock);
    float block_all, block_kept;
    block_masses(l, a, b, inv_t, zmax, th, &block_all, &block_kept, nullptr);
    total += block_all;
    sums[j] = block_kept;
    support += block_kept;
  }
  int64_t tok;
  if (greedy) {
    tok = 0;
    while (tok < V && !(l[tok] == lmax)) ++tok;
    if (tok == V) tok = 0;  // all NaN: no maximum
  } else {
    // the block: the first of positive mass whose inclusive prefix sum exceeds t, else the last of positive mass
    const float t = u * support;
    float cum = 0.f, below = 0.f;
    int64_t jb = -1, last = -1;
    for (int64_t j = 0; j < nb; ++j) {
      const float before = cum;
      cum += sums[j];
      if (sums[j] > 0.f) {
        last = j;
        if (cum > t) {
          jb = j;
          below = before;
          break;
        }
      }
    }
    if (jb < 0) {  // rounding left t at the very top: the last block of positive mass
      jb = std::max<int64_t>(last, 0);
      below = 0.f;
      for (int64_t j = 0; j < jb; ++j) below += sums[j];
    }
    float p[kBlock];
    const int64_t a = jb * kBlock, b = std::min(V, a + kBlock);
    float unused_all, unused_kept;
    block_masses(l, a, b, inv_t, zmax, th, &unused_all, &unused_kept, p);  // the block's masses, as its sum saw them
    const float ti = t - below;
    float c = 0.f;
    int64_t hit = -1, last_i = -1;
    for (int64_t i = 0; i < b - a; ++i) {
      c += p[i];
      if (p[i] > 0.f) {
        last_i = i;
        if (c > ti) {
          hit = i;
          break;
        }
      }
    }
    tok = a + (hit >= 0 ? hit : std::max<int64_t>(last_i, 0));
  }
  *token = static_cast<int32_t>(tok);
  *lse = zmax + std::log(total);
}

ffi::Error sample_rows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> logits, ffi::Buffer<ffi::F32> temperature,
                       ffi::Buffer<ffi::F32> theta, ffi::Buffer<ffi::F32> u, ffi::Result<ffi::Buffer<ffi::S32>> tokens,
                       ffi::Result<ffi::Buffer<ffi::F32>> lses) {
  const auto ld = logits.dimensions();
  if (ld.size() != 2 || temperature.dimensions().size() != 1 || temperature.dimensions()[0] != ld[0] ||
      theta.dimensions().size() != 1 || theta.dimensions()[0] != ld[0] || u.dimensions().size() != 1 ||
      u.dimensions()[0] != ld[0] || ld[1] < 1)
    return ffi::Error::InvalidArgument("sample_rows: logits [B, V >= 1], temperature, theta and u [B]");
  const int64_t B = ld[0], V = ld[1];
  const float* lp = logits.typed_data();
  const float* tp = temperature.typed_data();
  const float* thp = theta.typed_data();
  const float* up = u.typed_data();
  int32_t* tok = tokens->typed_data();
  float* lse = lses->typed_data();
  jaxrl_cpu::parallel_for(pool, B, [lp, tp, thp, up, tok, lse, V](int64_t b) {
    sample_row(lp + b * V, V, tp[b], thp[b], up[b], tok + b, lse + b);
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlSampleRows, sample_rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
