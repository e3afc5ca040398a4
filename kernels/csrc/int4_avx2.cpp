// int4 weight x fp32 activation linear for AVX2 + FMA CPUs (compress.kernels.cpu_avx2).
//
// Layout (made once by cpu_avx2.prepack): codes uint8 [N, K/2]; each 32-column block of a row
// is 16 bytes, byte i holding column 32b+i in its low nibble and column 32b+16+i in its high
// nibble, codes q in 0..15. Per row n and group j (group a multiple of 32):
//   w[n, k] = q[n, k] * scales[n, j] + offsets[n, j]
// so y[m, n] = sum_j scales[n, j] * (x[m, group j] . q[n, group j]) + offsets[n, j] * xsum[m, j].
// The weights are unpacked in registers (never to memory) and multiplied in fp32, so the result
// is the fp32 product with the dequantized weight up to summation order. Rows of x are taken
// four at a time so that one unpack serves four FMAs (batched decode, short prefill).
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

// The 32 codes of one block as four fp32 vectors (columns 0-7, 8-15, 16-23, 24-31).
struct Block {
  __m256 w0, w1, w2, w3;
};

inline Block unpack(const uint8_t* p, __m128i low4) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(v, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8)))};
}

// One output column n for R rows of x (R known at compile time so the accumulators live in
// registers). Independent accumulators per block keep the FMAs off one latency chain: with a
// single accumulator the loop ran at ~1 weight per cycle, bound by FMA latency.
template <int R>
inline void column(const float* x, const float* xsum, const uint8_t* row, const float* s,
                   const float* o, int64_t K, int64_t G, int64_t group, float* y, int64_t N) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  constexpr int A = R == 1 ? 4 : 2;  // accumulators per row (16 ymm registers in all)
  __m256 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  const int64_t blocks = group / 32;
  for (int64_t j = 0; j < G; ++j) {
    __m256 g[R][A];
    for (int r = 0; r < R; ++r)
      for (int a = 0; a < A; ++a) g[r][a] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t k0 = j * group + b * 32;
      const Block w = unpack(row + k0 / 2, low4);
      for (int r = 0; r < R; ++r) {
        const float* xr = x + r * K + k0;
        g[r][0] = _mm256_fmadd_ps(w.w0, _mm256_loadu_ps(xr), g[r][0]);
        g[r][1] = _mm256_fmadd_ps(w.w1, _mm256_loadu_ps(xr + 8), g[r][1]);
        g[r][2 % A] = _mm256_fmadd_ps(w.w2, _mm256_loadu_ps(xr + 16), g[r][2 % A]);
        g[r][3 % A] = _mm256_fmadd_ps(w.w3, _mm256_loadu_ps(xr + 24), g[r][3 % A]);
      }
    }
    const __m256 sv = _mm256_set1_ps(s[j]);
    for (int r = 0; r < R; ++r) {
      __m256 sum = _mm256_add_ps(g[r][0], g[r][1]);
      if (A == 4) sum = _mm256_add_ps(sum, _mm256_add_ps(g[r][2 % A], g[r][3 % A]));
      acc[r] = _mm256_fmadd_ps(sum, sv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float out = hsum(acc[r]);
    for (int64_t j = 0; j < G; ++j) out += o[j] * xsum[r * G + j];
    y[r * N] = out;
  }
}

// Sum of x over each group of columns: [M, K] -> [M, K / group] (the offsets' coefficients).
std::vector<float> group_sums(const float* x, int64_t M, int64_t K, int64_t group) {
  std::vector<float> out(M * (K / group), 0.f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) out[m * (K / group) + k / group] += x[m * K + k];
  return out;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                       const at::Tensor& offsets, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes must be uint8");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  TORCH_CHECK(codes.size(1) * 2 == K, "codes must be [N, K/2]");
  const int64_t G = K / group;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == N && scales.size(1) == G,
              "scales must be contiguous fp32 [N, K/group]");
  TORCH_CHECK(offsets.sizes() == scales.sizes() && offsets.scalar_type() == at::kFloat &&
                  offsets.is_contiguous(),
              "offsets must be like scales");
  const float* xp = x.data_ptr<float>();
  std::vector<float> xsum_buf = group_sums(xp, M, K, group);  // [M, G]
  const float* xs = xsum_buf.data();
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 32, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * (K / 2);
      const float* s = sp + n * G;
      const float* o = op + n * G;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = xp + m0 * K;
        const float* xr = xs + m0 * G;
        float* out = yp + m0 * N + n;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: column<1>(xm, xr, row, s, o, K, G, group, out, N); break;
          case 2: column<2>(xm, xr, row, s, o, K, G, group, out, N); break;
          case 3: column<3>(xm, xr, row, s, o, K, G, group, out, N); break;
          default: column<4>(xm, xr, row, s, o, K, G, group, out, N); break;
        }
      }
    }
  });
  return y;
}


// ---- int8-activation variant (llama.cpp's Q4 x Q8 scheme) ----------------------------------
// x is quantized per 32-column block to int8 (scale amax/127), and each block's dot product is
// done in integers: maddubs(u8 codes, s8 x) -> int16 pairs, madd with ones -> int32, one
// convert and one FMA per 32 weights. Faster, but no longer the fp32 product: activations carry
// int8 rounding (<= half a step per element), as in llama.cpp.
inline __m256i codes32(const uint8_t* p, __m128i low4) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(v, low4);
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
  return _mm256_set_m128i(hi, lo);  // bytes 0-15: columns 0-15, bytes 16-31: columns 16-31
}

at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const at::Tensor& offsets, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous fp32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(group % 32 == 0 && K % group == 0 && codes.size(1) * 2 == K,
              "codes must be [N, K/2] with group a multiple of 32 dividing K");
  const int64_t G = K / group, B = K / 32, per = group / 32;
  // Plain loops, not ATen ops: at decode sizes (M = 1, K = 576) a handful of ATen calls cost
  // more than the product itself.
  const float* xp = x.data_ptr<float>();
  std::vector<int8_t> xq_buf(M * K);
  std::vector<float> xscale_buf(M * B);
  for (int64_t i = 0; i < M * B; ++i) {
    const float* blk = xp + i * 32;
    float amax = 0.f;
    for (int t = 0; t < 32; ++t) amax = std::max(amax, std::fabs(blk[t]));
    const float scale = amax > 0.f ? amax / 127.f : 1.f;
    xscale_buf[i] = scale;
    for (int t = 0; t < 32; ++t)
      xq_buf[i * 32 + t] = static_cast<int8_t>(std::nearbyint(blk[t] / scale));
  }
  std::vector<float> xsum_buf = group_sums(xp, M, K, group);
  at::Tensor y = at::empty({M, N}, x.options());
  const int8_t* qp = xq_buf.data();
  const float* xsp = xscale_buf.data();
  const float* xs = xsum_buf.data();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * (K / 2);
      const float* s = sp + n * G;
      const float* o = op + n * G;
      for (int64_t m = 0; m < M; ++m) {
        const int8_t* xr = qp + m * K;
        const float* sx = xsp + m * B;
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        for (int64_t b = 0; b < B; b += 2) {  // B is even: K is a multiple of 64 here or
          const __m256i w0 = codes32(row + b * 16, low4);  // handled by the tail below
          const __m256i p0 = _mm256_madd_epi16(
              _mm256_maddubs_epi16(w0, _mm256_loadu_si256(
                                           reinterpret_cast<const __m256i*>(xr + b * 32))),
              ones);
          acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(sx[b] * s[b / per]),
                                 acc0);
          if (b + 1 < B) {
            const __m256i w1 = codes32(row + (b + 1) * 16, low4);
            const __m256i p1 = _mm256_madd_epi16(
                _mm256_maddubs_epi16(w1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(
                                             xr + (b + 1) * 32))),
                ones);
            acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                   _mm256_set1_ps(sx[b + 1] * s[(b + 1) / per]), acc1);
          }
        }
        float out = hsum(_mm256_add_ps(acc0, acc1));
        const float* xsr = xs + m * G;
        for (int64_t j = 0; j < G; ++j) out += o[j] * xsr[j];
        yp[m * N + n] = out;
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(compress_cpu, m) {
  m.def("int4_linear(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int group) -> Tensor");
  m.def(
      "int4_linear_q8(Tensor x, Tensor codes, Tensor scales, Tensor offsets, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(compress_cpu, CPU, m) {
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_linear_q8", &int4_linear_q8);
}
