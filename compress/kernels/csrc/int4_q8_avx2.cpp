// int4 weight x int8-rounded activation linear for AVX2 CPUs: llama.cpp's Q4 x Q8 scheme
// (compress.kernels.cpu_avx2 builds and documents it).
//
// Layout (made once by cpu_avx2.prepack): codes uint8 [N, K/2]; each 32-column block of a row
// is 16 bytes, byte i holding column 32b+i in its low nibble and column 32b+16+i in its high
// nibble, codes q in 0..15. Per row n and group j (group a multiple of 32):
//   w[n, k] = q[n, k] * scales[n, j] + offsets[n, j]
// x is rounded per 32-column block to int8 (scale = amax / 127, round half to even), and
//   y[m, n] = sum_b xscale[m, b] * scales[n, b / per] * (xq[m, block b] . q[n, block b])
//           + sum_j offsets[n, j] * xsum[m, j]          (xsum from the exact x)
// The block dot products are exact integers: maddubs(u8 codes, s8 x) -> int16 pairs (at most
// 2 * 15 * 127 = 3810, no saturation), madd with ones -> int32, then one convert and one FMA
// per 32 weights. Why: unpacking int4 to floats is what bounds torch's kernel and an fp32
// variant of ours on this CPU; the integer dot product does 32 weights in four instructions.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  __m128 shuf = _mm_movehdup_ps(s);
  s = _mm_add_ps(s, shuf);
  shuf = _mm_movehl_ps(shuf, s);
  s = _mm_add_ss(s, shuf);
  return _mm_cvtss_f32(s);
}

// The 32 codes of one block as 32 bytes: bytes 0-15 columns 0-15, bytes 16-31 columns 16-31.
inline __m256i codes32(const uint8_t* p, __m128i low4) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(v, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  return _mm256_set_m128i(hi, lo);
}

// int32 lanes of one block's dot product, as floats (sum them for the block's value).
inline __m256 block_dot(__m256i w, const int8_t* xq, __m256i ones) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
}

// One output column n for R rows of x. The block's codes are unpacked once and serve all R
// rows (batched decode). R = 1 runs two accumulators over alternate blocks so consecutive FMAs
// do not wait on each other; R > 1 gets that independence from its rows. gidx[b] is block b's
// group: a table lookup, because an integer division per block was the kernel's bottleneck.
template <int R>
inline void column(const int8_t* xq, const float* sx, const float* xs, const uint8_t* row,
                   const float* s, const float* o, const int32_t* gidx, int64_t K, int64_t B,
                   int64_t G, float* y, int64_t N) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R];
  if constexpr (R == 1) {
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < B; b += 2) {
      a0 = _mm256_fmadd_ps(block_dot(codes32(row + b * 16, low4), xq + b * 32, ones),
                           _mm256_set1_ps(sx[b] * s[gidx[b]]), a0);
      a1 = _mm256_fmadd_ps(block_dot(codes32(row + b * 16 + 16, low4), xq + b * 32 + 32, ones),
                           _mm256_set1_ps(sx[b + 1] * s[gidx[b + 1]]), a1);
    }
    if (b < B)
      a0 = _mm256_fmadd_ps(block_dot(codes32(row + b * 16, low4), xq + b * 32, ones),
                           _mm256_set1_ps(sx[b] * s[gidx[b]]), a0);
    acc[0] = _mm256_add_ps(a0, a1);
  } else {
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < B; ++b) {
      const __m256i w = codes32(row + b * 16, low4);
      const float ws = s[gidx[b]];
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(block_dot(w, xq + r * K + b * 32, ones),
                                 _mm256_set1_ps(sx[r * B + b] * ws), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out = hsum(acc[r]);
    for (int64_t j = 0; j < G; ++j) out += o[j] * xs[r * G + j];
    y[r * N] = out;
  }
}

at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& offsets, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(),
              "codes must be contiguous uint8 [N, K/2]");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group > 0 && group % 32 == 0 && K % group == 0 && codes.size(1) * 2 == K,
              "codes must be [N, K/2] with group a multiple of 32 dividing K");
  const int64_t G = K / group, B = K / 32, per = group / 32;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == G,
              "scales must be contiguous fp32 [N, K/group]");
  TORCH_CHECK(offsets.sizes() == scales.sizes() && offsets.scalar_type() == at::kFloat &&
                  offsets.is_contiguous(),
              "offsets must be like scales");
  // Plain loops, not ATen ops: at decode sizes (M = 1, K = 576) a handful of ATen calls cost
  // more than the product itself.
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> xq(M * K);
  std::vector<float> xscale(M * B), xsum(M * G, 0.f);
  for (int64_t i = 0; i < M * B; ++i) {
    const float* blk = xp + i * 32;
    float amax = 0.f;
    for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(blk[t]));
    const float scale = amax > 0.f ? amax / 127.f : 1.f;
    xscale[i] = scale;
    for (int t = 0; t < 32; ++t) xq[i * 32 + t] = static_cast<int8_t>(std::nearbyint(blk[t] / scale));
  }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xsum[m * G + k / group] += xp[m * K + k];
  std::vector<int32_t> gidx(B);
  for (int64_t b = 0; b < B; ++b) gidx[b] = static_cast<int32_t>(b / per);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // Needs -fopenmp at build time: without it at::parallel_for runs on one thread. Layers under
  // ~128K weights stay on one thread: waking the second one cost more than it saved (measured:
  // 192x576 took 33 us on 2 threads, 25 us on 1; 576x576 gained from the second thread).
  const int64_t grain = std::max<int64_t>(16, ((int64_t{1} << 17) + K - 1) / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * (K / 2);
      const float* s = sp + n * G;
      const float* o = op + n * G;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int8_t* xr = xq.data() + m0 * K;
        const float* sx = xscale.data() + m0 * B;
        const float* xs = xsum.data() + m0 * G;
        float* out = yp + m0 * N + n;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: column<1>(xr, sx, xs, row, s, o, gidx.data(), K, B, G, out, N); break;
          case 2: column<2>(xr, sx, xs, row, s, o, gidx.data(), K, B, G, out, N); break;
          case 3: column<3>(xr, sx, xs, row, s, o, gidx.data(), K, B, G, out, N); break;
          default: column<4>(xr, sx, xs, row, s, o, gidx.data(), K, B, G, out, N); break;
        }
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(compress_cpu, m) {
  m.def(
      "int4_linear_q8(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_cpu, CPU, m) { m.impl("int4_linear_q8", &int4_linear_q8); }
