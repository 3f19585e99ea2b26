// Vectorizable float math shared by the CPU kernels (loops over it compile to SIMD code under `#pragma omp simd`).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

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

}  // namespace jaxrl_cpu
