// Vectorizable float math shared by the CPU kernels (loops over it compile to SIMD code under `#pragma omp simd`).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace jaxrl_cpu {

// exp(x) for x <= 0 (the softmax's arguments), vectorizable: 2^n * p(r) with x = n ln2 + r, |r| <= ln2 / 2, p the
// degree-6 Taylor polynomial (relative error < 2e-7, as std::exp's rounding on these arguments); below -87 (and
// -inf): 0.
inline float exp_approx(float x) {
  const float xc = std::max(x, -87.f);
  const float n = std::nearbyint(xc * 1.44269504088896341f);
  const float r = (xc - n * 0.693145751953125f) - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return x < -87.f ? 0.f : p * scale;
}

#if defined(__AVX512F__)
// exp_approx 16 lanes at a time (GCC's tuning for Intel cores vectorizes a loop over exp_approx with 8)
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.f);
  const __m512 xc = _mm512_max_ps(x, lo);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(xc, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), xc);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 q = _mm512_set1_ps(1.f / 720.f);
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f / 120.f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f / 24.f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f / 6.f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(0.5f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  q = _mm512_fmadd_ps(q, r, _mm512_set1_ps(1.f));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ), _mm512_mul_ps(q, _mm512_castsi512_ps(bits)));
}
#endif

}  // namespace jaxrl_cpu
