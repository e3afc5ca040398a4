// Prototype: int4 GEMV with 16-column tiles (lanes = output columns), AVX-512 VNNI.
// Layout per tile, per 8 k-values (two quads): 64 bytes, byte c*4+i = code[c][8j+i] | code[c][8j+4+i] << 4.
#include <immintrin.h>
#include <omp.h>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <cstdint>
#include <vector>
#include <cmath>
#include <random>
static inline void gemv(const uint8_t* W, const float* ws /*[tiles][G][16]*/, const int8_t* xq,
                        const float* xs /*[B]*/, const int32_t* corr /*[B]*/, float* y,
                        int64_t N, int64_t K, int64_t group) {
  const int64_t T = N / 16, B = K / 32, G = K / group, bpg = group / 32;
  const int64_t tile_bytes = K * 8;  // 16 cols * K/2
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* w = W + t * tile_bytes;
    const float* s = ws + t * G * 16;
    __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8((char)0xF0);
    for (int64_t g = 0; g < G; ++g) {
      __m512 inner = _mm512_setzero_ps();
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        const uint8_t* wb = w + b * 256;  // 4 chunks of 64 bytes per block
        _mm_prefetch((const char*)wb + 4096, _MM_HINT_T1);
        _mm_prefetch((const char*)wb + 4096 + 64, _MM_HINT_T1);
        _mm_prefetch((const char*)wb + 4096 + 128, _MM_HINT_T1);
        _mm_prefetch((const char*)wb + 4096 + 192, _MM_HINT_T1);
        __m512i a0 = _mm512_set1_epi32(corr[b]), a1 = _mm512_setzero_si512();
        const int32_t* xb = (const int32_t*)(xq + b * 32);
        #pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const __m512i v = _mm512_loadu_si512(wb + q * 64);
          a0 = _mm512_dpbusd_epi32(a0, _mm512_and_si512(v, lo4), _mm512_set1_epi32(xb[2 * q]));
          a1 = _mm512_dpbusd_epi32(a1, _mm512_and_si512(v, hi4), _mm512_set1_epi32(xb[2 * q + 1]));
        }
        const __m512i dot = _mm512_add_epi32(a0, _mm512_srai_epi32(a1, 4));
        inner = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs[b]), inner);
      }
      acc = _mm512_fmadd_ps(inner, _mm512_loadu_ps(s + g * 16), acc);
    }
    _mm512_storeu_ps(y + t * 16, acc);
  }
}

template <int M>
static inline void gemm_small(const uint8_t* W, const float* ws, const int8_t* xq /*[M][K]*/,
                        const float* xs /*[M][B]*/, const int32_t* corr /*[M][B]*/, float* y /*[M][N]*/,
                        int64_t N, int64_t K, int64_t group) {
  const int64_t T = N / 16, B = K / 32, G = K / group, bpg = group / 32;
  const int64_t tile_bytes = K * 8;
  #pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const uint8_t* w = W + t * tile_bytes;
    const float* s = ws + t * G * 16;
    __m512 acc[M];
    for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0F), hi4 = _mm512_set1_epi8((char)0xF0);
    for (int64_t g = 0; g < G; ++g) {
      __m512 inner[M];
      for (int m = 0; m < M; ++m) inner[m] = _mm512_setzero_ps();
      for (int64_t b = g * bpg; b < (g + 1) * bpg; ++b) {
        const uint8_t* wb = w + b * 256;
        for (int l = 0; l < 256; l += 64) _mm_prefetch((const char*)wb + 4096 + l, _MM_HINT_T1);
        __m512i a0[M], a1[M];
        for (int m = 0; m < M; ++m) { a0[m] = _mm512_set1_epi32(corr[m * B + b]); a1[m] = _mm512_setzero_si512(); }
        #pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          const __m512i v = _mm512_loadu_si512(wb + q * 64);
          const __m512i wl = _mm512_and_si512(v, lo4), wh = _mm512_and_si512(v, hi4);
          for (int m = 0; m < M; ++m) {
            const int32_t* xb = (const int32_t*)(xq + m * K + b * 32);
            a0[m] = _mm512_dpbusd_epi32(a0[m], wl, _mm512_set1_epi32(xb[2 * q]));
            a1[m] = _mm512_dpbusd_epi32(a1[m], wh, _mm512_set1_epi32(xb[2 * q + 1]));
          }
        }
        for (int m = 0; m < M; ++m) {
          const __m512i dot = _mm512_add_epi32(a0[m], _mm512_srai_epi32(a1[m], 4));
          inner[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(xs[m * B + b]), inner[m]);
        }
      }
      const __m512 sv = _mm512_loadu_ps(s + g * 16);
      for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(inner[m], sv, acc[m]);
    }
    for (int m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N + t * 16, acc[m]);
  }
}
int main(int argc, char** argv) {
  int64_t N = atol(argv[1]), K = atol(argv[2]), group = 128; int copies = atoi(argv[3]);
  std::mt19937 rng(0);
  // codes and reference
  std::vector<std::vector<uint8_t>> Ws(copies); std::vector<std::vector<float>> Ss(copies);
  std::vector<uint8_t> codes(N * K);
  for (auto& c : codes) c = rng() % 16;
  std::vector<float> scale(N * (K / group)); for (auto& v : scale) v = (rng() % 1000) / 1000.f + 0.01f;
  std::vector<uint8_t> W(N * K / 2); std::vector<float> S(N / 16 * (K / group) * 16);
  for (int64_t t = 0; t < N / 16; ++t) for (int64_t j = 0; j < K / 8; ++j) for (int c = 0; c < 16; ++c) for (int i = 0; i < 4; ++i) {
    int64_t n = t * 16 + c; W[t * K * 8 + j * 64 + c * 4 + i] = codes[n * K + 8 * j + i] | (codes[n * K + 8 * j + 4 + i] << 4); }
  for (int64_t t = 0; t < N / 16; ++t) for (int64_t g = 0; g < K / group; ++g) for (int c = 0; c < 16; ++c) S[(t * (K / group) + g) * 16 + c] = scale[(t * 16 + c) * (K / group) + g];
  for (int i = 0; i < copies; ++i) { Ws[i] = W; Ss[i] = S; }
  std::vector<float> x(K); for (auto& v : x) v = (rng() % 2000) / 1000.f - 1.f;
  std::vector<int8_t> xq(K); std::vector<float> xs(K / 32); std::vector<int32_t> corr(K / 32);
  for (int64_t b = 0; b < K / 32; ++b) { float a = 0; for (int i = 0; i < 32; ++i) a = std::max(a, std::fabs(x[b*32+i])); float s = a / 127; xs[b] = s; int sum = 0;
    for (int i = 0; i < 32; ++i) { int q = (int)std::nearbyint(x[b*32+i] / s); xq[b*32+i] = q; sum += q; } corr[b] = -8 * sum; }
  std::vector<float> y(N);
  gemv(Ws[0].data(), Ss[0].data(), xq.data(), xs.data(), corr.data(), y.data(), N, K, group);
  double maxerr = 0, maxref = 0;
  for (int64_t n = 0; n < N; ++n) { double r = 0; for (int64_t b = 0; b < K / 32; ++b) { long d = 0; for (int i = 0; i < 32; ++i) d += (long)xq[b*32+i] * (codes[n*K+b*32+i] - 8); r += d * (double)xs[b] * scale[n*(K/group) + b*32/group]; }
    maxerr = std::max(maxerr, std::fabs(r - y[n])); maxref = std::max(maxref, std::fabs(r)); }
  printf("check: max err %.3g of %.3g\n", maxerr, maxref);
  for (int mode = 0; mode < 2; ++mode) {
    double best = 1e9;
    for (int rep = 0; rep < 5; ++rep) {
      double t0 = omp_get_wtime(); int R = mode == 0 ? copies : 200;
      for (int i = 0; i < R; ++i) { int c = mode == 0 ? i : 0; gemv(Ws[c].data(), Ss[c].data(), xq.data(), xs.data(), corr.data(), y.data(), N, K, group); }
      best = std::min(best, (omp_get_wtime() - t0) / R);
    }
    printf("%s %ldx%ld: %.1f us  %.1f GB/s  %.1f Gweights/s\n", mode == 0 ? "DRAM" : "hot ", N, K, best * 1e6, N * K / 2 / best / 1e9, N * K / best / 1e9);
  }
  // M rows from DRAM: the same x repeated per row
  std::vector<int8_t> xqM(8 * K); std::vector<float> xsM(8 * (K / 32)); std::vector<int32_t> corrM(8 * (K / 32)); std::vector<float> yM(8 * N);
  for (int m = 0; m < 8; ++m) { memcpy(xqM.data() + m * K, xq.data(), K); memcpy(xsM.data() + m * (K/32), xs.data(), 4 * (K/32)); memcpy(corrM.data() + m * (K/32), corr.data(), 4 * (K/32)); }
  auto timeM = [&](auto fn, int M) { double best = 1e9; for (int rep = 0; rep < 5; ++rep) { double t0 = omp_get_wtime(); for (int i = 0; i < copies; ++i) fn(Ws[i].data(), Ss[i].data()); best = std::min(best, (omp_get_wtime() - t0) / copies); } printf("DRAM M=%d: %.1f us (%.1f us/row)\n", M, best * 1e6, best * 1e6 / M); };
  timeM([&](const uint8_t* w, const float* s) { gemm_small<2>(w, s, xqM.data(), xsM.data(), corrM.data(), yM.data(), N, K, group); }, 2);
  timeM([&](const uint8_t* w, const float* s) { gemm_small<4>(w, s, xqM.data(), xsM.data(), corrM.data(), yM.data(), N, K, group); }, 4);
  timeM([&](const uint8_t* w, const float* s) { gemm_small<8>(w, s, xqM.data(), xsM.data(), corrM.data(), yM.data(), N, K, group); }, 8);
  for (int64_t n = 0; n < N; ++n) if (std::fabs(yM[7 * N + n] - y[n]) > 1e-3 * maxref) { printf("M mismatch at %ld\n", n); break; }
}
