// bf16_weight_linear: y = x @ w.T in fp32 for bf16 weights w [N, K] on CPUs without bf16
// matmuls (no AVX512-BF16, no AMX), where oneDNN has no bf16 path and ATen's bf16 GEMM is
// several times slower than fp32. The weights are read as stored (half the bytes of an fp32
// copy) and widened to fp32 in registers (a bf16 is the top half of an fp32: exact), x (fp32,
// or bf16 widened once) is not rounded, and the sums run in fp32: the product of the fp32
// weights, within fp32 rounding (another summation order). Python side:
// compress.kernels.cpu_float (bf16_weight_linear_reference is the definition).
//
// Two forms, both over runs of output columns that threads claim:
// - under BLOCKED_MIN_ROWS rows (decode), dot-product tiles: for each group of NR columns every
//   block of MR rows, so those NR weight rows (a few KB) stay in L1 while x (M x K fp32) is
//   read from L1/L2, and the weights come from memory once per call;
// - from BLOCKED_MIN_ROWS rows (prompts), a blocked GEMM: panels of weights widened to fp32
//   once and multiplied by every block of rows as outer products.
#include "q8_common.h"

#include <cstring>

namespace compress_q8 {
namespace {

// A bf16 is the top half of an fp32. One vector load of 2 x LANES bf16 weights yields two fp32
// vectors with one instruction each: the even elements shifted up, the odd ones masked in
// place. x is reordered to match once per call (``deinterleave``): each block of 2 x LANES
// columns as its even columns, then its odd ones. (A zero-extending load and a shift take two
// instructions a vector; on an AVX2-only EPYC, Zen 3, both forms ran at 9-12 GMAC/s a thread
// over L2-resident weights at one row: the loop is bound elsewhere there.)
#if defined(COMPRESS_AVX512VNNI)
using Vec = __m512;
using IVec = __m512i;
constexpr int64_t LANES = 16;
inline IVec load_pairs(const uint16_t* p) { return _mm512_loadu_si512(p); }
inline Vec evens(IVec v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline Vec odds(IVec v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int32_t(0xFFFF0000u))));
}
inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec _add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float sum(Vec v) { return _mm512_reduce_add_ps(v); }
// 32 vector registers: 4 rows x 4 columns of accumulators, 4 widened weight vectors, x
constexpr int ROWS = 4, COLS = 4;
#else
using Vec = __m256;
using IVec = __m256i;
constexpr int64_t LANES = 8;
inline IVec load_pairs(const uint16_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline Vec evens(IVec v) { return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)); }
inline Vec odds(IVec v) {
  return _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(int32_t(0xFFFF0000u))));
}
inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec _add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float sum(Vec v) { return hsum(v); }
// 16 vector registers: 4 rows x 3 columns of accumulators, 3 widened weight vectors, x
constexpr int ROWS = 4, COLS = 3;
#endif
constexpr int64_t STEP = 2 * LANES;  // columns of x (bf16 weights) per step of the loops
// one row alone: more columns, so that enough independent sums hide the FMA latency
constexpr int ONE_ROW_COLS = 8;

inline float widen1(uint16_t b) {
  const uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// x [M, K] -> each whole block of STEP columns as its even columns, then its odd ones; the
// last K % STEP columns as they are
void deinterleave(const float* x, int64_t M, int64_t K, float* out) {
  const int64_t kv = K - K % STEP;
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float* dst = out + m * K;
    for (int64_t b = 0; b < kv; b += STEP)
      for (int64_t t = 0; t < LANES; ++t) {
        dst[b + t] = row[b + 2 * t];
        dst[b + LANES + t] = row[b + 2 * t + 1];
      }
    for (int64_t k = kv; k < K; ++k) dst[k] = row[k];
  }
}

// out[i, j] for MR rows of x (deinterleaved, stride K) and NR weight rows (stride K)
template <int MR, int NR>
inline void tile(const float* x, const uint16_t* w, int64_t K, float* out, int64_t ldo) {
  Vec acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = zero();
  const int64_t kv = K - K % STEP;
  for (int64_t k = 0; k < kv; k += STEP) {
    if constexpr (MR == 1) {  // each weight vector used as it is widened
      // The weight rows two groups on, fetched as these are read: a row of a few hundred
      // columns is too short a stream for the hardware prefetcher. Measured on the Zen 3 EPYC,
      // one row against SmolLM2's 49152 x 576 head from DRAM: 5.4-5.7 -> 3.1 ms on one thread,
      // 2.9-3.2 -> 1.9-2.0 ms on two.
      const char* ahead = reinterpret_cast<const char*>(w + 2 * NR * K) + k * NR * 2;
      for (int64_t b = 0; b < NR * STEP * 2; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T1);
      const Vec xe = load(x + k), xo = load(x + k + LANES);
      for (int j = 0; j < NR; ++j) {
        const IVec v = load_pairs(w + j * K + k);
        acc[0][j] = fma(evens(v), xe, acc[0][j]);
        acc[0][j] = fma(odds(v), xo, acc[0][j]);
      }
    } else {  // NR widened weight vectors at a time, each row of x used across them
      Vec wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = evens(load_pairs(w + j * K + k));
      for (int i = 0; i < MR; ++i) {
        const Vec xv = load(x + i * K + k);
        for (int j = 0; j < NR; ++j) acc[i][j] = fma(wv[j], xv, acc[i][j]);
      }
      for (int j = 0; j < NR; ++j) wv[j] = odds(load_pairs(w + j * K + k));
      for (int i = 0; i < MR; ++i) {
        const Vec xv = load(x + i * K + k + LANES);
        for (int j = 0; j < NR; ++j) acc[i][j] = fma(wv[j], xv, acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = sum(acc[i][j]);
      for (int64_t k = kv; k < K; ++k) s += x[i * K + k] * widen1(w[j * K + k]);
      out[i * ldo + j] = s;
    }
}

// columns [n0, n1) of every row: full NR groups, then one column at a time
template <int MR, int NR>
void rows_block(const float* x, const uint16_t* w, int64_t K, int64_t n0, int64_t n1, float* out,
                int64_t N) {
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<MR, NR>(x, w + n * K, K, out + n, N);
  for (; n < n1; ++n) tile<MR, 1>(x, w + n * K, K, out + n, N);
}

void columns(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0,
             int64_t n1, float* y) {
  if (M == 1) {
    rows_block<1, ONE_ROW_COLS>(x, w, K, n0, n1, y, N);
    return;
  }
  // groups of COLS columns, each against every block of ROWS rows (the group stays in L1)
  for (int64_t c0 = n0; c0 < n1; c0 += COLS) {
    const int64_t c1 = std::min(n1, c0 + COLS);
    int64_t m = 0;
    for (; m + ROWS <= M; m += ROWS)
      rows_block<ROWS, COLS>(x + m * K, w, K, c0, c1, y + m * N, N);
    switch (M - m) {
      case 3: rows_block<3, COLS>(x + m * K, w, K, c0, c1, y + m * N, N); break;
      case 2: rows_block<2, COLS>(x + m * K, w, K, c0, c1, y + m * N, N); break;
      case 1: rows_block<1, COLS>(x + m * K, w, K, c0, c1, y + m * N, N); break;
      default: break;
    }
  }
}

// ---- the blocked form, for calls of many rows ----
// The dot-product tiles above read a weight group once per block of ROWS rows and x once per
// group: from about a hundred rows oneDNN's fp32 GEMM was ahead of them. Here a panel of GN
// weight columns x KC is widened once into fp32 [KC][GN] (L1) and every block of GM rows of x
// multiplies it as outer products (GM broadcasts and GV loads per GM x GV FMAs), the usual
// register-blocked GEMM. The panel's widening is shared by MC rows.
constexpr int GM = 6;               // rows of x per micro-tile
constexpr int GV = 2;               // vectors of output columns per micro-tile
constexpr int64_t GN = GV * LANES;  // columns per panel
constexpr int64_t KC = 256;         // K per panel: GN x KC fp32 is 16 KB (AVX2), 32 KB (AVX-512)
constexpr int64_t MC = 96;          // rows of x per pass over the panels (MC x KC fp32: 96 KB)
// From this many rows the blocked form; the dot-product tiles below it. Measured on the Zen 3
// EPYC, 2 threads, weights from DRAM, SmolLM2's four shapes against oneDNN's fp32 GEMM
// (scripts/bench_float_linears.py --bf16-weights, two runs each): at 8 and 16 rows the tiles
// were the faster (0.8-1.07x oneDNN's time against 1.0-1.27x), from 24 rows the blocked form
// (0.7-1.07x against 1.0-1.45x at 48 rows), and at 256 rows it is level with oneDNN where the
// tiles took 1.3-1.4x its time.
constexpr int64_t BLOCKED_MIN_ROWS = 24;

#if defined(COMPRESS_AVX512VNNI)
inline Vec broadcast(const float* p) { return _mm512_set1_ps(*p); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
#else
inline Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
#endif

// 8 rows of 8 fp32 -> 8 columns (r[i] holds column i on return); AVX2 instructions, also in
// the AVX-512 build
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// panel[kk * GN + c] = w[c, k0 + kk] widened for c < nv (rows of w, stride K); zero beyond.
// Blocks of 8 columns x 8 k are widened and transposed in registers; the rest one at a time.
void pack_panel(const uint16_t* w, int64_t K, int64_t nv, int64_t k0, int64_t kc, float* panel) {
  const int64_t c8 = nv - nv % 8, k8 = kc - kc % 8;
  for (int64_t c = 0; c < c8; c += 8) {
    for (int64_t kk = 0; kk < k8; kk += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) {
        const __m128i h = _mm_loadu_si128(
            reinterpret_cast<const __m128i*>(w + (c + i) * K + k0 + kk));
        r[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
      transpose8(r);
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(panel + (kk + i) * GN + c, r[i]);
    }
    for (int64_t i = 0; i < 8; ++i)
      for (int64_t kk = k8; kk < kc; ++kk)
        panel[kk * GN + c + i] = widen1(w[(c + i) * K + k0 + kk]);
  }
  for (int64_t c = c8; c < GN; ++c) {
    const uint16_t* row = w + c * K + k0;
    if (c < nv)
      for (int64_t kk = 0; kk < kc; ++kk) panel[kk * GN + c] = widen1(row[kk]);
    else
      for (int64_t kk = 0; kk < kc; ++kk) panel[kk * GN + c] = 0.0f;
  }
}

// out[i, :nv] (+)= x[i, :kc] @ panel for MR rows of x (stride ldx); ``add``: onto what is there
template <int MR>
void micro(const float* x, int64_t ldx, const float* panel, int64_t kc, float* out, int64_t ldo,
           int64_t nv, bool add) {
  Vec acc[MR][GV];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < GV; ++j) acc[i][j] = zero();
  // every loop over the accumulators unrolled: one left rolled kept them on the stack as well,
  // stored on every step (GCC 12)
  for (int64_t kk = 0; kk < kc; ++kk) {
    Vec b[GV];
#pragma GCC unroll 4
    for (int j = 0; j < GV; ++j) b[j] = load(panel + kk * GN + j * LANES);
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i) {
      const Vec a = broadcast(x + i * ldx + kk);
#pragma GCC unroll 4
      for (int j = 0; j < GV; ++j) acc[i][j] = fma(a, b[j], acc[i][j]);
    }
  }
  if (nv == GN) {
#pragma GCC unroll 8
    for (int i = 0; i < MR; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < GV; ++j) {
        float* o = out + i * ldo + j * LANES;
        store(o, add ? _add(acc[i][j], load(o)) : acc[i][j]);
      }
    return;
  }
  alignas(64) float tmp[GN];
#pragma GCC unroll 8
  for (int i = 0; i < MR; ++i) {
#pragma GCC unroll 8
    for (int j = 0; j < GV; ++j) store(tmp + j * LANES, acc[i][j]);
    float* o = out + i * ldo;
    for (int64_t c = 0; c < nv; ++c) o[c] = add ? o[c] + tmp[c] : tmp[c];
  }
}

// columns [n0, n1) of every row, blocked; ``panel``: GN x KC floats of the thread's own
void gemm_columns(const float* x, const uint16_t* w, int64_t M, int64_t K, int64_t N, int64_t n0,
                  int64_t n1, float* y, float* panel) {
  for (int64_t m0 = 0; m0 < M; m0 += MC) {
    const int64_t m1 = std::min(M, m0 + MC);
    for (int64_t p = n0; p < n1; p += GN) {
      const int64_t nv = std::min(GN, n1 - p);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t kc = std::min(KC, K - k0);
        pack_panel(w + p * K, K, nv, k0, kc, panel);
        const bool add = k0 > 0;
        int64_t m = m0;
        for (; m + GM <= m1; m += GM)
          micro<GM>(x + m * K + k0, K, panel, kc, y + m * N + p, N, nv, add);
        const float* xm = x + m * K + k0;
        float* ym = y + m * N + p;
        switch (m1 - m) {
          case 5: micro<5>(xm, K, panel, kc, ym, N, nv, add); break;
          case 4: micro<4>(xm, K, panel, kc, ym, N, nv, add); break;
          case 3: micro<3>(xm, K, panel, kc, ym, N, nv, add); break;
          case 2: micro<2>(xm, K, panel, kc, ym, N, nv, add); break;
          case 1: micro<1>(xm, K, panel, kc, ym, N, nv, add); break;
          default: break;
        }
      }
    }
  }
}

}  // namespace

at::Tensor bf16_weight_linear(const at::Tensor& x, const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "bf16_weight_linear: w must be a contiguous bf16 [N, K] tensor, got ",
              w.scalar_type(), " ", w.sizes());
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "bf16_weight_linear: x must be fp32 or bf16 [M, K], got ", x.scalar_type(), " ",
              x.sizes());
  TORCH_CHECK(x.size(1) == w.size(1), "bf16_weight_linear: x has ", x.size(1),
              " columns, w ", w.size(1));
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "bf16_weight_linear runs on the CPU");
  const at::Tensor xf = x.to(at::kFloat).contiguous();  // bf16 -> fp32 is exact
  const int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, xf.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  if (M >= BLOCKED_MIN_ROWS) {
    const float* xp = xf.data_ptr<float>();
    const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
    float* yp = y.data_ptr<float>();
    const int64_t run = GN * 8;
    parallel_claims((N + run - 1) / run, 1, [&](Claims& claims) {
      aligned_vector<float> panel(GN * KC);
      int64_t begin, end;
      while (claims.take(begin, end))
        for (int64_t r = begin; r < end; ++r)
          gemm_columns(xp, wp, M, K, N, r * run, std::min(N, (r + 1) * run), yp, panel.data());
    });
    return y;
  }
  aligned_vector<float> xd(M * K);
  deinterleave(xf.data_ptr<float>(), M, K, xd.data());
  const float* xp = xd.data();
  const uint16_t* wp = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  // runs of columns a thread claims: a few hundred KB of weights each, a multiple of the tile
  const int64_t step = M == 1 ? ONE_ROW_COLS : COLS;
  const int64_t run = std::max<int64_t>(step, (int64_t{1} << 17) / (2 * K) / step * step);
  const int64_t runs = (N + run - 1) / run;
  // small calls on one thread: a second one costs more to start than it saves
  if (M * N * K < (int64_t{1} << 18)) {
    columns(xp, wp, M, K, N, 0, N, yp);
    return y;
  }
  parallel_claims(runs, 1, [&](Claims& claims) {
    int64_t begin, end;
    while (claims.take(begin, end))
      for (int64_t r = begin; r < end; ++r)
        columns(xp, wp, M, K, N, r * run, std::min(N, (r + 1) * run), yp);
  });
  return y;
}

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("bf16_weight_linear(Tensor x, Tensor w) -> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("bf16_weight_linear", &compress_q8::bf16_weight_linear);
}
