// y = x @ w[layer] for XLA:CPU (issue 28): a decode step's projections at a few rows, reading the layer's matrix in
// place from the stacked [L, K, N] weights. Inside the scan over layers XLA:CPU copies every layer's matrices out of
// the stack before its dots (a dynamic slice each), which at a few rows costs more than the dots (NOTES, session
// 16); this kernel streams each matrix once from where it lies.
//
// Operands: x [M, K] float32, w [L, K, N] float32, layer [] int32. Result: y [M, N] float32.
// `stacked_matmul_packed`: the same product from w packed per column block, [L, ceil(N / 64), K, 64] (each block's
// K x 64 floats contiguous, the last one zero-padded; `cpu_kernels.pack_columns`): the hardware prefetchers stream a
// block where the model's layout starts a new 4 KiB page every row or few rows (1.3-1.5x at 16 rows; session 23).
// Same tile, same multiply-adds in the same order: the same bits as from the model's layout.
// Work: column blocks of 64 (the last one narrower), shared with XLA's intra-op thread pool (parallel.h). Within a
// block, groups of rows accumulate in registers over k, in order (one float32 multiply-add chain per output); w's
// rows 32 ahead are prefetched into L2 (the block's rows are N floats apart: the hardware prefetchers lose them at
// every 4 KiB page). AVX-512 builds write the tile with 512-bit intrinsics (`tile_avx512`, any block width, the last
// vector masked; the same multiply-adds in the same order, so the same bits) and walk a block in slices of 128 rows
// of w (32 KiB), every group of rows of x over one slice before the next (the sums stored and picked up again
// exactly), so the groups after the first read the slice from L1 instead of L2 (NOTES, session 19).
#include <algorithm>
#include <cstdint>
#include <string>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// the tile and block functions are inlined into each kernel's loop: with two kernels calling them GCC stopped
// inlining them on its own, and the in-place kernel ran ~1.4x slower (session 24)
#define JAXRL_INLINE __attribute__((always_inline)) inline

constexpr int64_t kCols = 64;
constexpr int64_t kRows = 4;
constexpr int64_t kAhead = 32;
constexpr int64_t kSlice = 128;

struct MatmulDims {
  int64_t M, K, N;
};

// rows [m0, m0 + R) x columns [n0, n0 + width) of y from the block of w at `w` (row stride ldw: N in the model's
// layout, kCols packed); W == kCols: a compile-time width (accumulators in registers)
template <int64_t R, int64_t W>
JAXRL_INLINE void tile(const MatmulDims& d, const float* x, const float* w, int64_t ldw, float* y, int64_t m0,
                       int64_t n0, int64_t width) {
  const int64_t cols = W > 0 ? W : width;
  float acc[R][kCols] = {};
  for (int64_t k = 0; k < d.K; ++k) {
    const float* wk = w + k * ldw;
    if (k + kAhead < d.K)
      for (int64_t c = 0; c < cols; c += 16) __builtin_prefetch(wk + kAhead * ldw + c, 0, 2);
    for (int64_t r = 0; r < R; ++r) {
      const float xv = x[(m0 + r) * d.K + k];
#pragma omp simd
      for (int64_t c = 0; c < cols; ++c) acc[r][c] += xv * wk[c];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < cols; ++c) y[(m0 + r) * d.N + n0 + c] = acc[r][c];
}

#if defined(__AVX512F__)
// The tile with 512-bit vectors written out, C vectors of 16 columns per row (width <= 16 x C; the last vector's
// lanes past the width masked off: `last`): GCC's tuning for Intel's AVX-512 cores prefers 256-bit vectors, and 4
// rows x 64 columns then need all 32 ymm registers for the accumulators alone (spills); a block narrower than 64
// (the last one, or a whole matrix of 16 / 32 / 48 columns, e.g. a small model's k / v projections) would otherwise
// take the portable tile, whose accumulators at a run-time width live in memory (~5x slower; session 22).
template <int64_t R, int C>
JAXRL_INLINE void tile_avx512(const MatmulDims& d, const float* x, const float* w, int64_t ldw, float* y, int64_t m0,
                              int64_t n0, int64_t k0, int64_t k1, __mmask16 last, bool prefetch) {
  __m512 acc[R][C];
  float* yr = y + m0 * d.N + n0;
  const auto lanes = [last](int c) { return c == C - 1 ? last : static_cast<__mmask16>(0xFFFF); };
  for (int64_t r = 0; r < R; ++r)  // a later slice of k continues the sums where the last one stored them
    for (int c = 0; c < C; ++c)
      acc[r][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(lanes(c), yr + r * d.N + 16 * c);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * ldw;
    if (prefetch && k + kAhead < d.K)
      for (int c = 0; c < C; ++c) __builtin_prefetch(wk + kAhead * ldw + 16 * c, 0, 2);
    __m512 wv[C];
    for (int c = 0; c < C; ++c) wv[c] = _mm512_maskz_loadu_ps(lanes(c), wk + 16 * c);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + r) * d.K + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_mask_storeu_ps(yr + r * d.N + 16 * c, lanes(c), acc[r][c]);
}

// a column block of C vectors: slices of kSlice rows of w (at most 32 KiB) read by every group of rows in turn
// (groups of 4 rows at 3-4 vectors, of 8 at 1-2: at most 16 accumulators), then single rows
template <int C>
JAXRL_INLINE void column_block_avx512(const MatmulDims& d, const float* x, const float* w, int64_t ldw, float* y,
                                      int64_t n0, int64_t width) {
  constexpr int64_t R = C >= 3 ? 4 : 8;
  const int64_t tail = width - 16 * (C - 1);
  const __mmask16 last = tail >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << tail) - 1);
  for (int64_t k0 = 0; k0 < d.K; k0 += kSlice) {
    const int64_t k1 = std::min(d.K, k0 + kSlice);
    int64_t m = 0;
    for (; m + R <= d.M; m += R) tile_avx512<R, C>(d, x, w, ldw, y, m, n0, k0, k1, last, m == 0);
    for (; m < d.M; ++m) tile_avx512<1, C>(d, x, w, ldw, y, m, n0, k0, k1, last, m == 0);
  }
}
#endif

// the column block [n0, n0 + width) of y, width <= kCols, from w's block at `w` (row stride ldw)
JAXRL_INLINE void column_block(const MatmulDims& d, const float* x, const float* w, int64_t ldw, float* y,
                               int64_t n0, int64_t width) {
#if defined(__AVX512F__)
  switch ((width + 15) / 16) {
    case 1: return column_block_avx512<1>(d, x, w, ldw, y, n0, width);
    case 2: return column_block_avx512<2>(d, x, w, ldw, y, n0, width);
    case 3: return column_block_avx512<3>(d, x, w, ldw, y, n0, width);
    default: return column_block_avx512<4>(d, x, w, ldw, y, n0, width);
  }
#else
  int64_t m = 0;
  if (width == kCols) {
    for (; m + kRows <= d.M; m += kRows) tile<kRows, kCols>(d, x, w, ldw, y, m, n0, width);
    for (; m < d.M; ++m) tile<1, kCols>(d, x, w, ldw, y, m, n0, width);
    return;
  }
  for (; m + kRows <= d.M; m += kRows) tile<kRows, 0>(d, x, w, ldw, y, m, n0, width);
  for (; m < d.M; ++m) tile<1, 0>(d, x, w, ldw, y, m, n0, width);
#endif
}

// `stacked_matmul` (kPacked false: w [L, K, N], the model's layout) and `stacked_matmul_packed` (w [L, ceil(N / 64),
// K, 64]): one function, the layout a template parameter, so each kernel's loop keeps its row stride and block offset
// as constants
template <bool kPacked>
ffi::Error stacked_matmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                          ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y) {
  constexpr const char* kName = kPacked ? "stacked_matmul_packed" : "stacked_matmul";
  constexpr const char* kShapes = kPacked ? ": x [M, K], w [L, ceil(N / 64), K, 64], y [M, N]"
                                          : ": x [M, K], w [L, K, N], y [M, N]";
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] ||
      !(kPacked ? (wd.size() == 4 && wd[2] == xd[1] && wd[3] == kCols && wd[1] == (yd[1] + kCols - 1) / kCols)
                : (wd.size() == 3 && wd[1] == xd[1] && yd[1] == wd[2])))
    return ffi::Error::InvalidArgument(std::string(kName) + kShapes);
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= wd[0]) return ffi::Error::InvalidArgument(std::string(kName) + ": layer out of range");
  const MatmulDims d{xd[0], xd[1], yd[1]};
  const int64_t blocks = (d.N + kCols - 1) / kCols;
  const float* xp = x.typed_data();
  const float* wp = w.typed_data() + l * (kPacked ? blocks * kCols : d.N) * d.K;
  float* yp = y->typed_data();
  jaxrl_cpu::parallel_for(pool, blocks, [d, xp, wp, yp](int64_t b) {
    const int64_t n0 = b * kCols;
    // the block: column n0 of the model's layout (rows N apart), or its own K x 64 floats when packed (rows 64 apart)
    const float* wb = wp + (kPacked ? b * d.K * kCols : n0);
    column_block(d, xp, wb, kPacked ? kCols : d.N, yp, n0, std::min(kCols, d.N - n0));
  });
  return ffi::Error::Success();
}

// y = x @ w.T (per block yt = w @ xt) for w [N, K] row-major (a tied embedding as the LM head: logits = hidden @
// embed.T) and xt = x.T [K, M], M <= 64, reading w in place. XLA:CPU's transposed dot runs this at a few rows at ~95
// GFLOP/s (16 rows of shape A's [16384, 512] embedding: 2.8 ms, the largest single op of a compacted decode step;
// session 17). Work: blocks of 64 rows of w shared with the thread pool; within a block, 8 rows of w at a time, each
// row's M outputs accumulated in registers over k in order (per k: the M values of xt[k] loaded once, 8 broadcasts of
// w[n, k], 8 x M / 16 multiply-adds) into the block's [64, M] outputs, which are then stored as y's [M, 64] columns (y
// [M, N] directly: XLA's transpose of a [N, M] result cost more than the 512-bit tile saved at 64 rows, session 19).
// AVX-512 builds write the tile for M = 16 / 32 / 64 with 512-bit intrinsics (6 rows of w at a time at 64).
constexpr int64_t kNtBlock = 64;
constexpr int64_t kNtRows = 8;

template <int64_t R, int64_t MC>
void tile_nt(const float* xt, const float* w, float* yt, int64_t K, int64_t M, int64_t n0) {
  const int64_t mc = MC > 0 ? MC : M;
  float acc[R][MC > 0 ? MC : 64] = {};
  for (int64_t k = 0; k < K; ++k) {
    const float* xk = xt + k * M;
#pragma GCC unroll 8
    for (int64_t r = 0; r < R; ++r) {
      const float wv = w[(n0 + r) * K + k];
#pragma omp simd
      for (int64_t m = 0; m < mc; ++m) acc[r][m] += wv * xk[m];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t m = 0; m < mc; ++m) yt[(n0 + r) * M + m] = acc[r][m];
}

template <int64_t MC, int64_t R = kNtRows>
void tile_nt_rows(const float* xt, const float* w, float* yt, int64_t K, int64_t M, int64_t n0, int64_t rows) {
  if constexpr (R > 0) {
    if (rows < R) return tile_nt_rows<MC, R - 1>(xt, w, yt, K, M, n0, rows);
    tile_nt<R, MC>(xt, w, yt, K, M, n0);
  }
}

#if defined(__AVX512F__)
// The tile with 512-bit intrinsics for M = 16 x C (the same multiply-adds in the same order): GCC's Intel tuning
// prefers 256-bit vectors, and 8 rows x 32 outputs then need all 32 ymm registers for the accumulators.
template <int64_t R, int C>
void tile_nt_avx512(const float* xt, const float* w, float* yt, int64_t K, int64_t n0) {
  constexpr int64_t M = 16 * C;
  __m512 acc[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  const float* wr = w + n0 * K;
  for (int64_t k = 0; k < K; ++k) {
    __m512 xv[C];
    for (int c = 0; c < C; ++c) xv[c] = _mm512_loadu_ps(xt + k * M + 16 * c);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 wv = _mm512_set1_ps(wr[r * K + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(wv, xv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(yt + (n0 + r) * M + 16 * c, acc[r][c]);
}

template <int C, int64_t R>
void tile_nt_rows_avx512(const float* xt, const float* w, float* yt, int64_t K, int64_t n0, int64_t rows) {
  if constexpr (R > 0) {
    if (rows < R) return tile_nt_rows_avx512<C, R - 1>(xt, w, yt, K, n0, rows);
    tile_nt_avx512<R, C>(xt, w, yt, K, n0);
  }
}
#endif

template <int64_t MC>
void block_nt(const float* xt, const float* w, float* yt, int64_t K, int64_t M, int64_t n0, int64_t end) {
#if defined(__AVX512F__)
  if constexpr (MC >= 16 && MC % 16 == 0) {  // 6 rows of w at 64 outputs (24 accumulators), else 8
    constexpr int C = MC / 16;
    constexpr int64_t R = C >= 4 ? 6 : kNtRows;
    for (int64_t n = n0; n < end; n += R) tile_nt_rows_avx512<C, R>(xt, w, yt, K, n, std::min(R, end - n));
    return;
  }
#endif
  for (int64_t n = n0; n < end; n += kNtRows)
    tile_nt_rows<MC>(xt, w, yt, K, M, n, std::min(kNtRows, end - n));
}

ffi::Error matmul_nt(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xt, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = xt.dimensions();
  const auto wd = w.dimensions();
  const auto yd = y->dimensions();
  if (xd.size() != 2 || wd.size() != 2 || yd.size() != 2 || wd[1] != xd[0] || yd[0] != xd[1] || yd[1] != wd[0])
    return ffi::Error::InvalidArgument("matmul_nt: xt [K, M], w [N, K], y [M, N]");
  const int64_t K = xd[0], M = xd[1], N = wd[0];
  if (M > 64) return ffi::Error::InvalidArgument("matmul_nt: at most 64 rows of x");
  const float* xp = xt.typed_data();
  const float* wp = w.typed_data();
  float* yp = y->typed_data();
  const int64_t blocks = (N + kNtBlock - 1) / kNtBlock;
  jaxrl_cpu::parallel_for(pool, blocks, [M, K, N, xp, wp, yp](int64_t b) {
    const int64_t n0 = b * kNtBlock, rows = std::min(N, n0 + kNtBlock) - n0;
    // the block's [rows, M] outputs (yt's layout) in a per-thread buffer, then stored as y's columns
    // [n0, n0 + rows) of each of the M rows: no transposed copy of the whole result after the call
    alignas(64) thread_local float block[kNtBlock * 64];
    const float* wb = wp + n0 * K;
    if (M == 16)
      block_nt<16>(xp, wb, block, K, M, 0, rows);
    else if (M == 32)
      block_nt<32>(xp, wb, block, K, M, 0, rows);
    else if (M == 8)
      block_nt<8>(xp, wb, block, K, M, 0, rows);
    else if (M == 64)
      block_nt<64>(xp, wb, block, K, M, 0, rows);
    else
      block_nt<0>(xp, wb, block, K, M, 0, rows);
    for (int64_t m = 0; m < M; ++m) {
      float* ym = yp + m * N + n0;
      for (int64_t j = 0; j < rows; ++j) ym[j] = block[j * M + m];
    }
  });
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlMatmulNt, matmul_nt,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlStackedMatmulPacked, stacked_matmul<true>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxrlStackedMatmul, stacked_matmul<false>,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
