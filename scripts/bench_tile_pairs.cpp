// The column-tile int4 loop of csrc/q8_tiles.cpp in isolation, weights resident in L2 (16
// tiles of K = 2048: 256 KB), one thread, 8 rows: G vpdpbusd/s per way to lay out the loop,
// beside this core's peak (16 independent vpdpbusd chains). Linux, a CPU with AVX512-VNNI:
//
//     g++ -O3 -mavx2 -mfma -mavx512f -mavx512bw -mavx512vl -mavx512vnni \
//         scripts/bench_tile_pairs.cpp -o tile_pairs && ./tile_pairs
//
// v0<R>: one tile, R rows, group sums in registers (the op up to 8 rows); v1: v0 with the
// activation bytes as embedded broadcasts; v2: high nibbles shifted down first, one accumulator
// per row (8-deep chains per block); vb<R>: two tiles, R rows, each activation broadcast feeding
// both, group sums in y (the op from 9 rows). Every variant's outputs equal v0's bit for bit.
#include <immintrin.h>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <vector>
#include <cstdlib>
constexpr int64_t TILE = 16, TILE_BLOCK = 256, BLOCK = 32;
struct X { int64_t M, K, B, G; std::vector<int8_t> q; std::vector<float> scale; std::vector<int32_t> corr; };

// v0<R>, and with EMBEDDED v1<R>: the activation bytes as vpdpbusd's embedded broadcast
template <int R, bool EMBEDDED = false>
__attribute__((noinline)) void v0(const X& x, int64_t m0, const uint8_t* tile, const float* ws, int64_t group, float* y, int64_t N, int64_t col0) {
  const int64_t G = x.G, per_group = group / BLOCK;
  const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t j = 0; j < G; ++j) {
    __m512 inner[R];
    for (int r = 0; r < R; ++r) inner[r] = _mm512_setzero_ps();
    for (int64_t b = j * per_group; b < (j + 1) * per_group; ++b) {
      const uint8_t* wb = tile + b * TILE_BLOCK;
      __m512i low[R], high[R];
      for (int r = 0; r < R; ++r) { low[r] = _mm512_set1_epi32(x.corr[(m0 + r) * x.B + b]); high[r] = _mm512_setzero_si512(); }
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(wb + q * 64);
        const __m512i wl = _mm512_and_si512(v, low4), wh = _mm512_and_si512(v, high4);
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = x.q.data() + (m0 + r) * x.K + b * BLOCK + q * 8;
          if constexpr (EMBEDDED) {
            asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(low[r]) : "v"(wl), "m"(*(const int32_t*)xb));
            asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(high[r]) : "v"(wh), "m"(*(const int32_t*)(xb + 4)));
          } else {
            int32_t x0, x1;
            std::memcpy(&x0, xb, 4); std::memcpy(&x1, xb + 4, 4);
            low[r] = _mm512_dpbusd_epi32(low[r], wl, _mm512_set1_epi32(x0));
            high[r] = _mm512_dpbusd_epi32(high[r], wh, _mm512_set1_epi32(x1));
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512i dot = _mm512_add_epi32(low[r], _mm512_srai_epi32(high[r], 4));
        inner[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_set1_ps(x.scale[(m0 + r) * x.B + b]), inner[r]);
      }
    }
    const __m512 sw = _mm512_loadu_ps(ws + j * TILE);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(inner[r], sw, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + col0, acc[r]);
}

// V2: high nibbles shifted down once per weight vector; one accumulator per row
template <int R>
__attribute__((noinline)) void v2(const X& x, int64_t m0, const uint8_t* tile, const float* ws, int64_t group, float* y, int64_t N, int64_t col0) {
  const int64_t G = x.G, per_group = group / BLOCK;
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x.q.data() + (m0 + r) * x.K;
  for (int64_t j = 0; j < G; ++j) {
    __m512 inner[R];
    for (int r = 0; r < R; ++r) inner[r] = _mm512_setzero_ps();
    for (int64_t b = j * per_group; b < (j + 1) * per_group; ++b) {
      const uint8_t* wb = tile + b * TILE_BLOCK;
      __m512i dot[R];
      for (int r = 0; r < R; ++r) dot[r] = _mm512_set1_epi32(x.corr[(m0 + r) * x.B + b]);
      #pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m512i v = _mm512_loadu_si512(wb + q * 64);
        const __m512i wl = _mm512_and_si512(v, low4), wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const int8_t* xb = xr[r] + b * BLOCK + q * 8;
          asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot[r]) : "v"(wl), "m"(*(const int32_t*)xb));
          asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(dot[r]) : "v"(wh), "m"(*(const int32_t*)(xb + 4)));
        }
      }
      for (int r = 0; r < R; ++r)
        inner[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[r]), _mm512_set1_ps(x.scale[(m0 + r) * x.B + b]), inner[r]);
    }
    const __m512 sw = _mm512_loadu_ps(ws + j * TILE);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(inner[r], sw, acc[r]);
  }
  for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + col0, acc[r]);
}


// VB: two tiles x R rows; each activation broadcast feeds both tiles; acc kept in y
template <int R>
__attribute__((noinline)) void vb(const X& x, int64_t m0, const uint8_t* tile, const float* ws, int64_t group, float* y, int64_t N, int64_t col0) {
  // tile: first of two tiles, the second at tile + K*8; ws likewise + G*16
  const int64_t G = x.G, per_group = group / BLOCK, tile_bytes = x.K * 8;
  const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  for (int r = 0; r < R; ++r) for (int t = 0; t < 2; ++t) _mm512_storeu_ps(y + (m0 + r) * N + col0 + 16 * t, _mm512_setzero_ps());
  const int8_t* xr[R];
  for (int r = 0; r < R; ++r) xr[r] = x.q.data() + (m0 + r) * x.K;
  for (int64_t j = 0; j < G; ++j) {
    __m512 inner[2][R];
    for (int r = 0; r < R; ++r) inner[0][r] = inner[1][r] = _mm512_setzero_ps();
    for (int64_t b = j * per_group; b < (j + 1) * per_group; ++b) {
      __m512i low[2][R], high[2][R];
      for (int r = 0; r < R; ++r) { low[0][r] = low[1][r] = _mm512_set1_epi32(x.corr[(m0 + r) * x.B + b]); high[0][r] = high[1][r] = _mm512_setzero_si512(); }
      #pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m512i v0 = _mm512_loadu_si512(tile + b * TILE_BLOCK + q * 64);
        const __m512i v1 = _mm512_loadu_si512(tile + tile_bytes + b * TILE_BLOCK + q * 64);
        const __m512i wl0 = _mm512_and_si512(v0, low4), wh0 = _mm512_and_si512(v0, high4);
        const __m512i wl1 = _mm512_and_si512(v1, low4), wh1 = _mm512_and_si512(v1, high4);
        #pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          int32_t x0, x1; const int8_t* xb = xr[r] + b * BLOCK + q * 8;
          std::memcpy(&x0, xb, 4); std::memcpy(&x1, xb + 4, 4);
          const __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);
          low[0][r] = _mm512_dpbusd_epi32(low[0][r], wl0, b0);
          low[1][r] = _mm512_dpbusd_epi32(low[1][r], wl1, b0);
          high[0][r] = _mm512_dpbusd_epi32(high[0][r], wh0, b1);
          high[1][r] = _mm512_dpbusd_epi32(high[1][r], wh1, b1);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_set1_ps(x.scale[(m0 + r) * x.B + b]);
        for (int t = 0; t < 2; ++t) {
          const __m512i dot = _mm512_add_epi32(low[t][r], _mm512_srai_epi32(high[t][r], 4));
          inner[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), s, inner[t][r]);
        }
      }
    }
    for (int t = 0; t < 2; ++t) {
      const __m512 sw = _mm512_loadu_ps(ws + t * G * TILE + j * TILE);
      for (int r = 0; r < R; ++r) {
        float* yp = y + (m0 + r) * N + col0 + 16 * t;
        _mm512_storeu_ps(yp, _mm512_fmadd_ps(inner[t][r], sw, _mm512_loadu_ps(yp)));
      }
    }
  }
}
// Best seconds of 20 passes over every tile (TILES_PER_CALL tiles a call: 1, or 2 for vb)
// and every step of R rows, over 30 repeats.
template <int TILES_PER_CALL = 1, typename F>
double bench(F f, const X& x, const std::vector<uint8_t>& codes, const std::vector<float>& scales, int64_t T, int64_t group, std::vector<float>& y, int M, int R) {
  const int64_t K = x.K, N = T * 16;
  double best = 1e9;
  for (int rep = 0; rep < 30; ++rep) {
    auto t0 = std::chrono::steady_clock::now();
    for (int it = 0; it < 20; ++it)
      for (int64_t t = 0; t < T; t += TILES_PER_CALL)
        for (int64_t m0 = 0; m0 + R <= M; m0 += R)
          f(x, m0, codes.data() + t * K * 8, scales.data() + t * x.G * 16, group, y.data(), N, t * 16);
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / 20;
    if (s < best) best = s;
  }
  return best;
}
double peak() {
  __m512i acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_set1_epi32(i);
  __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(5);
  const int64_t iters = 50000000;
  auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    _Pragma("GCC unroll 16") for (int i = 0; i < 16; ++i) acc[i] = _mm512_dpbusd_epi32(acc[i], a, b);
    asm volatile("" : "+v"(a));
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512i t = acc[0];
  for (int i = 1; i < 16; ++i) t = _mm512_add_epi32(t, acc[i]);
  volatile int sink = _mm512_reduce_add_epi32(t);
  (void)sink;
  return iters * 16 / s / 1e9;
}

int main() {
  const int64_t K = 2048, T = 16, group = 128, M = 8;
  X x{M, K, K / 32, K / group};
  x.q.resize(M * K); x.scale.resize(M * x.B); x.corr.resize(M * x.B);
  for (auto& v : x.q) v = rand() % 255 - 127;
  for (auto& v : x.scale) v = 0.01f + (rand() % 100) * 1e-4f;
  for (auto& v : x.corr) v = rand() % 1000;
  std::vector<uint8_t> codes(T * K * 8); for (auto& c : codes) c = rand();
  std::vector<float> scales(T * x.G * 16, 0.02f), ref(M * T * 16), y(M * T * 16);
  bench(v0<8>, x, codes, scales, T, group, ref, M, 8);
  auto report = [&](const char* n, int R, double t) {
    double macs = double(M / R * R) * K * T * 16;
    const bool same = R == 8 || R == 4 ? memcmp(ref.data(), y.data(), y.size() * 4) == 0 : true;
    printf("%-6s %.2f G vpdpbusd/s%s\n", n, macs / 64 / t / 1e9, same ? "" : "  OUTPUTS DIFFER");
  };
  printf("peak   %.2f G vpdpbusd/s\n", peak());
  report("v0<1>", 1, bench(v0<1>, x, codes, scales, T, group, y, M, 1));
  report("v0<4>", 4, bench(v0<4>, x, codes, scales, T, group, y, M, 4));
  report("v0<8>", 8, bench(v0<8>, x, codes, scales, T, group, y, M, 8));
  report("v1<8>", 8, bench(v0<8, true>, x, codes, scales, T, group, y, M, 8));
  report("v2<8>", 8, bench(v2<8>, x, codes, scales, T, group, y, M, 8));
  report("vb<1>", 1, bench<2>(vb<1>, x, codes, scales, T, group, y, M, 1));
  report("vb<2>", 2, bench<2>(vb<2>, x, codes, scales, T, group, y, M, 2));
  report("vb<4>", 4, bench<2>(vb<4>, x, codes, scales, T, group, y, M, 4));
}
