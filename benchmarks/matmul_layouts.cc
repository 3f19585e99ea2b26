// Few-row matmul y [M, N] = x [M, K] @ w [K, N] with w streamed from memory: the CPU kernel's scheme
// (`jaxrl_async/kernels/cpu/stacked_matmul.cc`: column blocks of 64, 4 rows x 4 vectors of 16 in 512-bit registers,
// k-slices of 128 rows that every group of rows reads in turn, prefetch 32 rows ahead) on w as the model stores it
// ([K, N] row-major) and on w packed per column block ([N / 64, K, 64], each block contiguous). Two threads, each
// a half of the column blocks; the matrices (~200 MB) are cycled so that they come from DRAM; also a plain
// two-thread read of the same bytes (the host's streaming ceiling). Issue 28, NOTES session 23.
//
//   g++ -O3 -march=native -std=c++17 -pthread benchmarks/matmul_layouts.cc -o matmul_layouts
//   ./matmul_layouts M K N [rounds]        e.g. 16 512 1536 (shape A's gate / up at 16 rows)
//
// Needs AVX-512. Prints us per matmul and GB/s of w for each layout, interleaved over the rounds, and checks that
// both layouts give the same bits (the same multiply-adds in the same order).
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

namespace {

struct Dims {
  int64_t M, K, N;
};
constexpr int64_t kAhead = 32, kSlice = 128;

// rows [m0, m0 + R) x the 64 columns at w (row stride ws) of y's columns [n0, n0 + 64), over k in [k0, k1)
template <int64_t R>
inline void tile(const Dims& d, const float* x, const float* w, int64_t ws, float* y, int64_t m0, int64_t n0,
                 int64_t k0, int64_t k1, bool prefetch) {
  __m512 acc[R][4];
  float* yr = y + m0 * d.N + n0;
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = k0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(yr + r * d.N + 16 * c);
  for (int64_t k = k0; k < k1; ++k) {
    const float* wk = w + k * ws;
    if (prefetch && k + kAhead < d.K)
      for (int c = 0; c < 4; ++c) _mm_prefetch(reinterpret_cast<const char*>(wk + kAhead * ws + 16 * c), _MM_HINT_T1);
    __m512 wv[4];
    for (int c = 0; c < 4; ++c) wv[c] = _mm512_loadu_ps(wk + 16 * c);
    for (int64_t r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[(m0 + r) * d.K + k]);
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) _mm512_storeu_ps(yr + r * d.N + 16 * c, acc[r][c]);
}

void column_block(const Dims& d, const float* x, const float* w, int64_t ws, float* y, int64_t n0) {
  for (int64_t k0 = 0; k0 < d.K; k0 += kSlice) {
    const int64_t k1 = std::min(d.K, k0 + kSlice);
    int64_t m = 0;
    for (; m + 4 <= d.M; m += 4) tile<4>(d, x, w, ws, y, m, n0, k0, k1, m == 0);
    for (; m < d.M; ++m) tile<1>(d, x, w, ws, y, m, n0, k0, k1, m == 0);
  }
}

// one helper thread, spinning between jobs (the kernel shares XLA's pool the same way: no thread start per call)
struct Pair {
  std::thread helper;
  std::atomic<int> job{0}, done{0};
  std::function<void(int)> fn;
  bool stop = false;
  Pair() {
    helper = std::thread([this] {
      for (int seen = 0;;) {
        while (job.load(std::memory_order_acquire) == seen) _mm_pause();
        seen = job.load();
        if (stop) return;
        fn(1);
        done.fetch_add(1, std::memory_order_release);
      }
    });
  }
  void run(std::function<void(int)> f) {
    fn = std::move(f);
    const int before = done.load();
    job.fetch_add(1, std::memory_order_release);
    fn(0);
    while (done.load(std::memory_order_acquire) == before) _mm_pause();
  }
  ~Pair() {
    stop = true;
    job.fetch_add(1);
    helper.join();
  }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s M K N [rounds]\n", argv[0]);
    return 2;
  }
  const Dims d{std::atoll(argv[1]), std::atoll(argv[2]), std::atoll(argv[3])};
  const int rounds = argc > 4 ? std::atoi(argv[4]) : 3;
  if (d.N % 64 || d.M < 1 || d.K < 1) {
    std::fprintf(stderr, "N must be a multiple of 64\n");
    return 2;
  }
  const int64_t bytes = d.K * d.N * 4, count = std::max<int64_t>(4, 200000000 / bytes), blocks = d.N / 64;
  std::vector<float*> plain(count), packed(count);
  for (int64_t j = 0; j < count; ++j) {
    plain[j] = static_cast<float*>(std::aligned_alloc(64, bytes));
    packed[j] = static_cast<float*>(std::aligned_alloc(64, bytes));
    for (int64_t i = 0; i < d.K * d.N; ++i) plain[j][i] = static_cast<float>((i * 7 + j) % 97) * 0.01f;
    for (int64_t b = 0; b < blocks; ++b)
      for (int64_t k = 0; k < d.K; ++k) std::memcpy(packed[j] + (b * d.K + k) * 64, plain[j] + k * d.N + b * 64, 256);
  }
  float* x = static_cast<float*>(std::aligned_alloc(64, d.M * d.K * 4));
  for (int64_t i = 0; i < d.M * d.K; ++i) x[i] = static_cast<float>(i % 13) * 0.1f;
  std::vector<float> y(d.M * d.N), y_plain(d.M * d.N);
  Pair pair;
  float sums[2];
  const auto matmul = [&](bool is_packed, int64_t j) {
    pair.run([&](int t) {
      for (int64_t b = t * blocks / 2; b < (t + 1) * blocks / 2; ++b)
        if (is_packed) column_block(d, x, packed[j] + b * d.K * 64, 64, y.data(), b * 64);
        else column_block(d, x, plain[j] + b * 64, d.N, y.data(), b * 64);
    });
  };
  const auto stream = [&](int64_t j) {
    pair.run([&](int t) {
      const float* p = plain[j] + t * (d.K * d.N / 2);
      __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
      for (int64_t i = 0; i + 64 <= d.K * d.N / 2; i += 64) {
        s0 = _mm512_add_ps(s0, _mm512_loadu_ps(p + i));
        s1 = _mm512_add_ps(s1, _mm512_loadu_ps(p + i + 16));
        s2 = _mm512_add_ps(s2, _mm512_loadu_ps(p + i + 32));
        s3 = _mm512_add_ps(s3, _mm512_loadu_ps(p + i + 48));
      }
      alignas(64) float lanes[16];
      _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(s0, s1), _mm512_add_ps(s2, s3)));
      sums[t] = 0;
      for (float v : lanes) sums[t] += v;
    });
  };
  matmul(false, 0);
  y_plain = y;
  matmul(true, 0);
  if (std::memcmp(y.data(), y_plain.data(), y.size() * 4)) {
    std::fprintf(stderr, "the two layouts disagree\n");
    return 1;
  }
  const char* names[3] = {"model layout [K, N]", "packed [N/64, K, 64]", "plain read (ceiling)"};
  std::vector<double> best(3, 1e30);
  for (int r = 0; r < rounds; ++r)
    for (int v = 0; v < 3; ++v) {
      for (int64_t j = 0; j < count; ++j) v == 2 ? stream(j) : matmul(v == 1, j);  // warm-up pass
      const auto t0 = std::chrono::steady_clock::now();
      for (int rep = 0; rep < 5; ++rep)
        for (int64_t j = 0; j < count; ++j) v == 2 ? stream(j) : matmul(v == 1, j);
      const std::chrono::duration<double> dt = std::chrono::steady_clock::now() - t0;
      const double us = 1e6 * dt.count() / (5 * count);
      best[v] = std::min(best[v], us);
      std::printf("round %d  %-22s M=%lld K=%lld N=%lld: %8.1f us per matmul, %5.2f GB/s\n", r, names[v],
                  static_cast<long long>(d.M), static_cast<long long>(d.K), static_cast<long long>(d.N), us,
                  bytes / us / 1e3);
    }
  std::printf("best: model layout %.1f us, packed %.1f us (%.2fx), plain read %.1f us (%g)\n", best[0], best[1],
              best[0] / best[1], best[2], static_cast<double>(sums[0] + sums[1]));
  return 0;
}
