// Paged decode attention for XLA:CPU (issue 28): one query token per slot attends over the slot's pages, read
// in place from the pool. The portable `blocked` path (kernels/paged.py) has to gather every block of pages into a
// contiguous copy before XLA's dots can read it, which on a CPU costs more than the attention's arithmetic
// (NOTES, session 15); this kernel reads each page's keys and values once, where they lie.
//
// Operands (the ``page_heads`` pool layout, kernels/paged_attention.py):
//   q       [S, H, E]           float32 or bfloat16
//   k_pool  [L, P, K, page, E]  float32 or bfloat16 (the pool of every layer: no per-layer slice is copied)
//   v_pool  [L, P, K, page, E]  same dtype as k_pool
//   lens    [S]    int32        keys 0..lens[s]-1 of slot s are attended; lens[s] <= 0: the slot's output is 0
//   pages   [S, maxp] int32     page ids of slot s; entries past its length are never read
//   layer   []     int32        the layer whose pages are read
// Attribute: scale (float). Result: [S, H, E] in q's dtype.
// Query head h uses kv head h / (H / K) (grouped-query attention). Math: float32 scores and softmax, as the
// blocked path computes; the result equals it up to summation order. Work items are (slot, kv head) pairs, shared
// with XLA's intra-op thread pool (parallel.h).
// On AVX-512 builds, with pages of a multiple of 16 tokens and head dims of 32, 64 or 128 (the compile-time
// sizes), `attend_item_avx512` takes the item in three passes (every score, 16 tokens at a time; the softmax over
// the row; the weighted values); elsewhere `attend_item` runs one online-softmax step per page with one dot
// product per score.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "fast_math.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using jaxrl_cpu::exp_approx;
#if defined(__AVX512F__)
using jaxrl_cpu::exp16;
#endif

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
inline void from_float(float x, float* out) { *out = x; }
inline void from_float(float x, uint16_t* out) {  // round to nearest even, NaN kept quiet
  uint32_t bits;
  std::memcpy(&bits, &x, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) {
    *out = static_cast<uint16_t>((bits >> 16) | 0x40u);
    return;
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}

#if defined(__AVX512F__)
// Scores of 16 consecutive tokens for one query head, with AVX-512: the head dim EC (a multiple of 16) is reduced
// as 16-lane partial sums per token (EC / 16 FMAs), and the 16 partial vectors are summed across lanes together
// (a transpose-and-add tree: 15 adds and 30 shuffles for 16 scores) instead of one horizontal reduction per score,
// which cost more than the products (NOTES, session 18). Lane i of the result is token i's score (unscaled).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // bfloat16 -> float32: the 16 bits on top
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 pair_lo_hi(__m512 x, __m512 y) {  // per 128-bit lane: [x0+x2, y0+y2, x1+x3, y1+y3]
  return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
}
inline __m512 pair_pd(__m512 a, __m512 b) {  // per 128-bit lane: [a's two sums, b's two sums]
  const __m512d ad = _mm512_castps_pd(a), bd = _mm512_castps_pd(b);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ad, bd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ad, bd)));
}
inline __m512 pair_lanes(__m512 a, __m512 b) {  // 128-bit lanes: [a0+a1, a2+a3, b0+b1, b2+b3]
  return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, 0x88), _mm512_shuffle_f32x4(a, b, 0xDD));
}
template <int EC, typename KT>
inline __m512 partial(const __m512* qv, const KT* kt) {
  __m512 a = _mm512_mul_ps(qv[0], load16(kt));
  for (int c = 1; c < EC / 16; ++c) a = _mm512_fmadd_ps(qv[c], load16(kt + c * 16), a);
  return a;
}
template <int EC, typename KT>
inline __m512 scores16(const __m512* qv, const KT* k) {  // k: 16 rows of EC
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    const KT* r = k + i * 4 * EC;
    b[i] = pair_pd(pair_lo_hi(partial<EC>(qv, r), partial<EC>(qv, r + EC)),
                   pair_lo_hi(partial<EC>(qv, r + 2 * EC), partial<EC>(qv, r + 3 * EC)));
  }
  return pair_lanes(pair_lanes(b[0], b[1]), pair_lanes(b[2], b[3]));
}
#endif

struct Dims {
  int64_t S, H, E, K, G, page, P, maxp, layer;
  float scale;
};

// Where page j of slot s lies in a pool, for kv head kh: the offset of its [page, E] block (the page id clamped
// into the pool, so a bad table entry cannot read outside it).
inline int64_t page_base(const Dims& d, const int32_t* pages, int64_t s, int64_t kh, int64_t E, int64_t j) {
  int64_t pid = pages[s * d.maxp + j];
  pid = std::min(std::max<int64_t>(pid, 0), d.P - 1);
  return ((d.layer * d.P + pid) * d.K + kh) * d.page * E;
}

// One (slot, kv head) item: the G query heads of kv head `kh` of slot `s`. EC: the head dim when it is one of the
// common sizes (a compile-time constant lets the compiler keep a head's accumulator in vector registers), else 0.
template <typename QT, typename KT, int EC>
void attend_item(const Dims& d, const QT* q, const KT* kpool, const KT* vpool, const int32_t* lens,
                 const int32_t* pages, QT* out, int64_t item) {
  const int64_t s = item / d.K, kh = item % d.K;
  const int64_t G = d.G;
  const int64_t E = EC > 0 ? EC : d.E;
  QT* o = out + (s * d.H + kh * G) * E;
  const int64_t len = lens[s];
  if (len <= 0) {
    for (int64_t i = 0; i < G * E; ++i) from_float(0.f, o + i);
    return;
  }
  // scratch of this thread, sized once (no allocation per item)
  thread_local std::vector<float> scratch;
  const size_t need = static_cast<size_t>(G * E * 2 + G * 2 + G * d.page);
  if (scratch.size() < need) scratch.resize(need);
  float* qf = scratch.data();
  float* acc = qf + G * E;
  float* m = acc + G * E;
  float* l = m + G;
  float* sc = l + G;
  const QT* qs = q + (s * d.H + kh * G) * E;
  for (int64_t i = 0; i < G * E; ++i) qf[i] = to_float(qs[i]), acc[i] = 0.f;
  for (int64_t g = 0; g < G; ++g) m[g] = -INFINITY, l[g] = 0.f;
  const int64_t npages = std::min((len + d.page - 1) / d.page, d.maxp);
  auto base_of = [&](int64_t j) { return page_base(d, pages, s, kh, E, j); };
  // The pages of a slot lie anywhere in the pool, and the hardware prefetchers stop at a page's end: the keys and
  // values of the page two ahead are prefetched into L2, a row per token of this one (measured on a 2-core Zen 4:
  // one ahead or three, or into L1, was 3-40% slower; none, 1.5x).
  constexpr int64_t kLine = 64 / sizeof(KT);
  for (int64_t j = 0; j < npages; ++j) {
    const int64_t nt = std::min(d.page, len - j * d.page);
    const int64_t base = base_of(j);
    const KT* kb = kpool + base;
    const KT* vb = vpool + base;
    const int64_t ahead = j + 2 < npages ? base_of(j + 2) : -1;
    if (ahead >= 0) {  // the key and value rows of the page two ahead, a row per token of this one
      for (int64_t i = 0; i < nt * E; i += kLine) {
        __builtin_prefetch(kpool + ahead + i, 0, 2);
        __builtin_prefetch(vpool + ahead + i, 0, 2);
      }
    }
    for (int64_t t = 0; t < nt; ++t) {  // one dot product per score
      const KT* kt = kb + t * E;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * E;
        float acc_s = 0.f;
#pragma omp simd reduction(+ : acc_s)
        for (int64_t e = 0; e < E; ++e) acc_s += qg[e] * to_float(kt[e]);
        sc[g * d.page + t] = acc_s * d.scale;
      }
    }
    for (int64_t g = 0; g < G; ++g) {
      float* sg = sc + g * d.page;
      float mx = m[g];
      for (int64_t t = 0; t < nt; ++t) mx = std::max(mx, sg[t]);
      const float corr = exp_approx(m[g] - mx);  // exp(-inf) = 0 on the first page
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < nt; ++t) {
        sg[t] = exp_approx(sg[t] - mx);
        sum += sg[t];
      }
      l[g] = l[g] * corr + sum;
      m[g] = mx;
      float* ag = acc + g * E;
      if constexpr (EC > 0) {  // the head's accumulator stays in registers over the page's tokens
        float a[EC];
        for (int64_t e = 0; e < EC; ++e) a[e] = ag[e] * corr;
        for (int64_t t = 0; t < nt; ++t) {
          const float pt = sg[t];
          const KT* vt = vb + t * EC;
          for (int64_t e = 0; e < EC; ++e) a[e] += pt * to_float(vt[e]);
        }
        for (int64_t e = 0; e < EC; ++e) ag[e] = a[e];
      } else {
#pragma omp simd
        for (int64_t e = 0; e < E; ++e) ag[e] *= corr;
        for (int64_t t = 0; t < nt; ++t) {
          const float pt = sg[t];
          const KT* vt = vb + t * E;
#pragma omp simd
          for (int64_t e = 0; e < E; ++e) ag[e] += pt * to_float(vt[e]);
        }
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = 1.f / l[g];
    for (int64_t e = 0; e < E; ++e) from_float(acc[g * E + e] * inv, o + g * E + e);
  }
}

#if defined(__AVX512F__)
// The item on AVX-512 (head dim EC of 32, 64 or 128; pages of a multiple of 16 tokens), in three passes over the
// slot's tokens: (1) every score, 16 tokens of a page at a time (`scores16`), into a row per query head; (2) per
// head, the row's max, the weights exp(score - max) (16 lanes at a time, `exp16`) and their sum; (3) the weighted
// values, each page's rows read from memory once (the G heads read them again from L1), summed in two chains
// (even and odd tokens). The keys are read once in (1) and the values once in (3), as in the online softmax, but
// nothing waits on a running max: the online form's per-page rescale, scalar max and exp chains left this CPU
// waiting on latencies (the fixed model's attention ~1.4x longer on the same data; NOTES, session 21). Same math as
// `attend_item` up to summation order.
template <typename QT, typename KT, int EC>
void attend_item_avx512(const Dims& d, const QT* q, const KT* kpool, const KT* vpool, const int32_t* lens,
                        const int32_t* pages, QT* out, int64_t item) {
  const int64_t s = item / d.K, kh = item % d.K;
  const int64_t G = d.G;
  QT* o = out + (s * d.H + kh * G) * EC;
  const int64_t len = lens[s];
  if (len <= 0) {
    for (int64_t i = 0; i < G * EC; ++i) from_float(0.f, o + i);
    return;
  }
  const int64_t npages = std::min((len + d.page - 1) / d.page, d.maxp);
  const int64_t n_all = std::min(len, npages * d.page);
  const int64_t LP = npages * d.page;  // a row's length: a multiple of 16
  thread_local std::vector<float> scratch;  // of this thread, grown to the longest item seen
  const size_t need = static_cast<size_t>(G * EC * 2 + G + G * LP);
  if (scratch.size() < need) scratch.resize(need);
  float* qf = scratch.data();
  float* acc = qf + G * EC;
  float* inv = acc + G * EC;
  float* sc = inv + G;  // [G, LP]: scores, then weights
  const QT* qs = q + (s * d.H + kh * G) * EC;
  for (int64_t i = 0; i < G * EC; ++i) qf[i] = to_float(qs[i]), acc[i] = 0.f;
  auto base_of = [&](int64_t j) { return page_base(d, pages, s, kh, EC, j); };
  // The pages of a slot lie anywhere in the pool, and the hardware prefetchers stop at a page's end: the rows of
  // the page two ahead are prefetched into L2 (measured on a 2-core Zen 4 for the online form: one ahead or three,
  // or into L1, was 3-40% slower; none, 1.5x; on the Xeon of session 21 two to four ahead were alike here).
  constexpr int64_t kLine = 64 / sizeof(KT);
  auto prefetch = [&](const KT* pool, int64_t j) {
    if (j + 2 >= npages) return;
    const KT* ahead = pool + base_of(j + 2);
    const int64_t nt = std::min(d.page, len - (j + 2) * d.page);
    for (int64_t i = 0; i < nt * EC; i += kLine) __builtin_prefetch(ahead + i, 0, 2);
  };
  constexpr int C = EC / 16;
  const __m512 ninf = _mm512_set1_ps(-INFINITY);
  const __m512 scale = _mm512_set1_ps(d.scale);
  for (int64_t j = 0; j < npages; ++j) {  // (1) scores; lanes past the slot's length: -inf
    const int64_t nt = std::min(d.page, len - j * d.page);
    const KT* kb = kpool + base_of(j);
    prefetch(kpool, j);
    for (int64_t t0 = 0; t0 < nt; t0 += 16) {  // rows past nt lie in this page; their scores are masked
      const int64_t n = std::min<int64_t>(16, nt - t0);
      const __mmask16 live = n == 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
      for (int64_t g = 0; g < G; ++g) {
        __m512 qv[C];
        for (int c = 0; c < C; ++c) qv[c] = _mm512_loadu_ps(qf + g * EC + c * 16);
        const __m512 sg = _mm512_mul_ps(scores16<EC>(qv, kb + t0 * EC), scale);
        _mm512_storeu_ps(sc + g * LP + j * d.page + t0, _mm512_mask_mov_ps(ninf, live, sg));
      }
    }
  }
  const int64_t filled = (n_all + 15) / 16 * 16;  // blocks past the last one scored (pages of 32+ tokens): -inf
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = filled; t < LP; ++t) sc[g * LP + t] = -INFINITY;
  for (int64_t g = 0; g < G; ++g) {  // (2) the softmax's weights and normaliser per head
    float* sg = sc + g * LP;
    __m512 vm = ninf;
    for (int64_t t = 0; t < LP; t += 16) vm = _mm512_max_ps(vm, _mm512_loadu_ps(sg + t));
    const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(vm));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < LP; t += 16) {
      const __m512 p = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), mx));
      _mm512_storeu_ps(sg + t, p);
      sum = _mm512_add_ps(sum, p);
    }
    inv[g] = 1.f / _mm512_reduce_add_ps(sum);
  }
  for (int64_t j = 0; j < npages; ++j) {  // (3) the weighted values
    const int64_t nt = std::min(d.page, len - j * d.page);
    const KT* vb = vpool + base_of(j);
    prefetch(vpool, j);
    for (int64_t g = 0; g < G; ++g) {
      const float* pg = sc + g * LP + j * d.page;
      float* ag = acc + g * EC;
      __m512 a[C], b[C];
      for (int c = 0; c < C; ++c) a[c] = _mm512_loadu_ps(ag + c * 16), b[c] = _mm512_setzero_ps();
      int64_t t = 0;
      for (; t + 1 < nt; t += 2) {
        const __m512 p0 = _mm512_set1_ps(pg[t]), p1 = _mm512_set1_ps(pg[t + 1]);
        for (int c = 0; c < C; ++c) {
          a[c] = _mm512_fmadd_ps(p0, load16(vb + t * EC + c * 16), a[c]);
          b[c] = _mm512_fmadd_ps(p1, load16(vb + (t + 1) * EC + c * 16), b[c]);
        }
      }
      if (t < nt) {
        const __m512 p0 = _mm512_set1_ps(pg[t]);
        for (int c = 0; c < C; ++c) a[c] = _mm512_fmadd_ps(p0, load16(vb + t * EC + c * 16), a[c]);
      }
      for (int c = 0; c < C; ++c) _mm512_storeu_ps(ag + c * 16, _mm512_add_ps(a[c], b[c]));
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t e = 0; e < EC; ++e) from_float(acc[g * EC + e] * inv[g], o + g * EC + e);
}
#endif

template <typename QT, typename KT>
void attend_any(const Dims& d, const QT* q, const KT* kpool, const KT* vpool, const int32_t* lens,
                const int32_t* pages, QT* out, int64_t item) {
#if defined(__AVX512F__)
  if (d.page % 16 == 0) {
    if (d.E == 32) return attend_item_avx512<QT, KT, 32>(d, q, kpool, vpool, lens, pages, out, item);
    if (d.E == 64) return attend_item_avx512<QT, KT, 64>(d, q, kpool, vpool, lens, pages, out, item);
    if (d.E == 128) return attend_item_avx512<QT, KT, 128>(d, q, kpool, vpool, lens, pages, out, item);
  }
#endif
  if (d.E == 32)
    attend_item<QT, KT, 32>(d, q, kpool, vpool, lens, pages, out, item);
  else if (d.E == 64)
    attend_item<QT, KT, 64>(d, q, kpool, vpool, lens, pages, out, item);
  else if (d.E == 128)
    attend_item<QT, KT, 128>(d, q, kpool, vpool, lens, pages, out, item);
  else
    attend_item<QT, KT, 0>(d, q, kpool, vpool, lens, pages, out, item);
}

template <typename QT, typename KT>
void run(ffi::ThreadPool& pool, const Dims& d, const void* q, const void* kpool, const void* vpool,
         const int32_t* lens, const int32_t* pages, void* out) {
  const QT* qp = static_cast<const QT*>(q);
  const KT* kp = static_cast<const KT*>(kpool);
  const KT* vp = static_cast<const KT*>(vpool);
  QT* op = static_cast<QT*>(out);
  jaxrl_cpu::parallel_for(pool, d.S * d.K, [d, qp, kp, vp, lens, pages, op](int64_t i) {
    attend_any<QT, KT>(d, qp, kp, vp, lens, pages, op, i);
  });
}

ffi::Error paged_decode(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k_pool, ffi::AnyBuffer v_pool,
                        ffi::Buffer<ffi::S32> lens, ffi::Buffer<ffi::S32> pages, ffi::Buffer<ffi::S32> layer,
                        ffi::Result<ffi::AnyBuffer> out, float scale) {
  const auto qd = q.dimensions();
  const auto kd = k_pool.dimensions();
  const auto pd = pages.dimensions();
  if (qd.size() != 3 || kd.size() != 5 || pd.size() != 2 || lens.dimensions().size() != 1)
    return ffi::Error::InvalidArgument("paged_decode: q [S, H, E], pools [L, P, K, page, E], pages [S, maxp]");
  Dims d;
  d.S = qd[0];
  d.H = qd[1];
  d.E = qd[2];
  d.P = kd[1];
  d.K = kd[2];
  d.page = kd[3];
  d.maxp = pd[1];
  d.scale = scale;
  d.layer = layer.typed_data()[0];
  if (kd[4] != d.E || d.K <= 0 || d.H % d.K != 0 || pd[0] != d.S || lens.dimensions()[0] != d.S ||
      d.layer < 0 || d.layer >= kd[0] || k_pool.element_type() != v_pool.element_type() ||
      out->element_type() != q.element_type())
    return ffi::Error::InvalidArgument("paged_decode: operand shapes or dtypes disagree");
  d.G = d.H / d.K;
  const bool q32 = q.element_type() == ffi::DataType::F32, qbf = q.element_type() == ffi::DataType::BF16;
  const bool k32 = k_pool.element_type() == ffi::DataType::F32, kbf = k_pool.element_type() == ffi::DataType::BF16;
  const int32_t* lp = lens.typed_data();
  const int32_t* pp = pages.typed_data();
  void* o = out->untyped_data();
  if (q32 && k32)
    run<float, float>(pool, d, q.untyped_data(), k_pool.untyped_data(), v_pool.untyped_data(), lp, pp, o);
  else if (q32 && kbf)
    run<float, uint16_t>(pool, d, q.untyped_data(), k_pool.untyped_data(), v_pool.untyped_data(), lp, pp, o);
  else if (qbf && k32)
    run<uint16_t, float>(pool, d, q.untyped_data(), k_pool.untyped_data(), v_pool.untyped_data(), lp, pp, o);
  else if (qbf && kbf)
    run<uint16_t, uint16_t>(pool, d, q.untyped_data(), k_pool.untyped_data(), v_pool.untyped_data(), lp, pp, o);
  else
    return ffi::Error::InvalidArgument("paged_decode: float32 or bfloat16 only");
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlPagedDecode, paged_decode,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("scale"));
