// Shared by q8_dot.cpp (decode) and q8_gemm.cpp (prefill): the activation rounding and the
// layout constants. Each ISA level is its own build of both files (compress.kernels.cpu_q8).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <new>
#include <optional>
#include <type_traits>
#include <vector>

#if !defined(COMPRESS_OPS)
#error "define COMPRESS_OPS (the op namespace); compress.kernels.cpu_q8 does"
#endif
#if defined(COMPRESS_AVX512VNNI) + defined(COMPRESS_AVXVNNI) + defined(COMPRESS_AVX2) != 1
#error "define exactly one of COMPRESS_AVX2, COMPRESS_AVXVNNI, COMPRESS_AVX512VNNI"
#endif

namespace compress_q8 {

constexpr int64_t BLOCK = 32;
constexpr int64_t PAIR = 64;  // the unit of the inner loops: two blocks

// Storage on 64-byte (cache-line) boundaries for the buffers that vector and tile loads read.
// glibc's malloc guarantees 16 bytes, so whether a 64-byte tile row or vector load spans two
// cache lines was left to chance. Measured on a Xeon (AMX-BF16), the ops' 2 x 2 tile loop alone
// from L1/L2 (scripts/bench_amx_tile_loop.cpp): 16-18 ns a TDPBF16PS 16 bytes off, 6-8 ns
// aligned; the ops themselves timed the same before and after (their buffers had landed
// aligned; docs/notes/2026-12-05-amx-tile-loop.md).
template <typename T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <typename U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(std::size_t n) {
    return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(64)));
  }
  void deallocate(T* p, std::size_t) { ::operator delete(p, std::align_val_t(64)); }
  template <typename U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <typename U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <typename T>
using aligned_vector = std::vector<T, Aligned64<T>>;

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(1, 0, 3, 2)));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(s);
}

// Work items [0, n) over torch's threads, each thread claiming the next run of `run` items
// from a shared counter until none is left, instead of at::parallel_for's fixed share per
// thread. Why: a server on 2 cores shares them with its HTTP thread and its clients, and a
// thread preempted for a moment held up every call until its whole share was done. Measured
// on a Xeon (2 threads, SmolLM2 W4, 32 requests of 128 + 64 tokens through the scheduler)
// beside a process busy 20% of the time: 6.0 s against 4.9 s alone (docs/notes/
// 2026-12-04-bf16-amx-prefill.md). `per_thread(claims)` runs once on each thread taking part
// (per-thread setup there), calling claims.take(begin, end) until it returns false.
struct Claims {
  Claims(int64_t items, int64_t run_length) : n(items), run(std::max<int64_t>(1, run_length)) {}
  // the next run [begin, end), false when every item is taken
  bool take(int64_t& begin, int64_t& end) {
    begin = next.fetch_add(run, std::memory_order_relaxed);
    if (begin >= n) return false;
    end = std::min(n, begin + run);
    return true;
  }
  const int64_t n, run;
  std::atomic<int64_t> next{0};
};

template <typename F>
void parallel_claims(int64_t n, int64_t run, const F& per_thread) {
  Claims claims(n, run);
  const int64_t runs = (n + claims.run - 1) / claims.run;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), runs);
  if (threads <= 1 || at::in_parallel_region()) {
    per_thread(claims);
    return;
  }
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { per_thread(claims); });
}

// x [M, K] fp32 -> per block: int8 codes, scale, and -bias * (sum of the codes). Division, not
// a reciprocal, so the rounding equals the reference's x / s; cvtps rounds half to even.
inline void round_activations(const float* x, int64_t blocks, int32_t bias, int8_t* q, float* scale,
                       int32_t* corr) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = 0; i < blocks; ++i) {
    const float* blk = x + i * BLOCK;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int t = 0; t < 4; ++t) {
      v[t] = _mm256_loadu_ps(blk + 8 * t);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[t]));
    }
    const float a = hmax(amax);
    const float s = a > 0.f ? a / 127.f : 1.f;
    scale[i] = s;
    const __m256 sv = _mm256_set1_ps(s);
    __m256i c[4];
    for (int t = 0; t < 4; ++t) c[t] = _mm256_cvtps_epi32(_mm256_div_ps(v[t], sv));
    corr[i] = -bias * hsum_i32(_mm256_add_epi32(_mm256_add_epi32(c[0], c[1]),
                                                _mm256_add_epi32(c[2], c[3])));
    // packs interleaves 128-bit lanes; the permute puts the 32 codes back in column order
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]),
                                              _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * BLOCK),
                        _mm256_permutevar8x32_epi32(packed, order));
  }
}

// Everything one call derives from x, shared by all output columns.
struct RoundedX {
  int64_t M, K, B, G;
  aligned_vector<int8_t> q;       // [M, K]
  aligned_vector<float> scale;    // [M, B]
  aligned_vector<int32_t> corr;   // [M, B] = -bias * code sum
  aligned_vector<float> xsum;     // [M, G] exact x sums (only with offsets)
#if defined(COMPRESS_AVX512VNNI)
  aligned_vector<float> scale16;   // [M, B/2, 16]: pair's scales, 8 lanes per block
  aligned_vector<int32_t> corr16;  // [M, B/2, 16]: the block's corr in lanes 0 and 8, else 0
#endif
};

// Rows in parallel from GEMM_MIN_ROWS on (prefill); decode's one row stays on the caller's
// thread. The 16-lane copies of scales and corrections serve the decode loops only.
constexpr int64_t GEMM_MIN_ROWS = 8;  // cpu_q8.GEMM_MIN_ROWS says the same

inline RoundedX round_x(const float* x, int64_t M, int64_t K, int64_t group, int32_t bias,
                        bool with_sums) {
  RoundedX r{M, K, K / BLOCK, K / group};
  r.q.resize(M * K);
  r.scale.resize(M * r.B);
  r.corr.resize(M * r.B);
  if (with_sums) r.xsum.assign(M * r.G, 0.f);
  const int64_t grain = M >= GEMM_MIN_ROWS ? 1 : M;
  at::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    round_activations(x + m0 * K, (m1 - m0) * r.B, bias, r.q.data() + m0 * K,
                      r.scale.data() + m0 * r.B, r.corr.data() + m0 * r.B);
    if (with_sums)
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t k = 0; k < K; ++k) r.xsum[m * r.G + k / group] += x[m * K + k];
  });
#if defined(COMPRESS_AVX512VNNI)
  if (M >= GEMM_MIN_ROWS) return r;
  const int64_t P = r.B / 2;
  r.scale16.resize(M * P * 16);
  r.corr16.assign(M * P * 16, 0);
  for (int64_t i = 0; i < M * P; ++i) {
    for (int t = 0; t < 16; ++t) r.scale16[i * 16 + t] = r.scale[2 * i + t / 8];
    r.corr16[i * 16] = r.corr[2 * i];
    r.corr16[i * 16 + 8] = r.corr[2 * i + 1];
  }
#endif
  return r;
}

// The offsets' share of one output: sum_j offset[j] * xsum[j] (asymmetric weights; else 0).
inline float offset_term(const float* off, const float* xsum, int64_t G) {
  float out = 0.f;
  if (off != nullptr)
    for (int64_t j = 0; j < G; ++j) out += off[j] * xsum[j];
  return out;
}

// Output columns per tile of the column-tile int4 layout at this level (q8_tiles.cpp): one
// vector of int32 lanes, 16 at avx512vnni, 8 at the 256-bit levels.
#if defined(COMPRESS_AVX512VNNI)
constexpr int64_t TILE_COLS = 16;
#else
constexpr int64_t TILE_COLS = 8;
#endif

// The column-tile ops' arguments (q8_tiles.cpp, q8_amx.cpp), checked: x fp32 [M, K] (or bf16
// where bf16_x), codes uint8 [N/W, K/8, 4W], scales fp32 [N/W, K/group, W], offsets fp32
// [N, K/group] or none; W = TILE_COLS.
struct TilesArgs {
  int64_t M, K, G, T, N;
  bool with_offsets;
};

inline TilesArgs check_tiles_args(const char* what, const at::Tensor& x, const at::Tensor& codes,
                                  const at::Tensor& scales,
                                  const std::optional<at::Tensor>& offsets, int64_t group,
                                  bool bf16_x = false) {
  const bool dtype_ok = x.scalar_type() == at::kFloat ||
                        (bf16_x && x.scalar_type() == at::kBFloat16);
  TORCH_CHECK(x.dim() == 2 && dtype_ok && x.is_contiguous(), what, ": x must be a contiguous ",
              bf16_x ? "fp32 or bf16" : "fp32", " [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(K % PAIR == 0 && group > 0 && group % BLOCK == 0 && K % group == 0, what,
              ": K must be a multiple of 64 and group a multiple of 32 dividing K (K=", K,
              ", group=", group, ")");
  const int64_t G = K / group;
  constexpr int64_t W = TILE_COLS;
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == K / 8 && codes.size(2) == 4 * W,
              what, ": codes must be contiguous uint8 [N/", W, ", K/8, ", 4 * W, "] for K=", K);
  const int64_t T = codes.size(0), N = T * W;
  TORCH_CHECK(scales.dim() == 3 && scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.size(0) == T && scales.size(1) == G && scales.size(2) == W,
              what, ": scales must be contiguous fp32 [N/", W, ", K/group, ", W, "]");
  const bool with_offsets = offsets.has_value() && offsets->defined();
  if (with_offsets)
    TORCH_CHECK(offsets->dim() == 2 && offsets->size(0) == N && offsets->size(1) == G &&
                    offsets->scalar_type() == at::kFloat,
                what, ": offsets must be fp32 [N, K/group]");
  return {M, K, G, T, N, with_offsets};
}

// Prefill (q8_gemm.cpp): the same block arithmetic as the decode loops with vector lanes over
// rows, for M >= GEMM_MIN_ROWS. y [M, N] fp32 without the offsets' term (the caller adds it).

template <bool Q4>
at::Tensor gemm_q8(const RoundedX& x, const uint8_t* codes, const float* scales, int64_t N,
                   int64_t group);

// exp(x) for x <= 0 (scores minus their max): x = n ln2 + r, |r| <= ln2 / 2, a degree-6
// polynomial of r (relative error ~2e-7), times 2^n built in the exponent bits; below -87 it
// is 0, as the float exp underflows there.
inline __m256 exp8(__m256 x) {
  const __m256 low = _mm256_set1_ps(-87.f);
  const __m256 under = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
  x = _mm256_max_ps(x, low);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.f / 720.f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

// Softmax's numerators in place: s[0 .. padded) (a multiple of 8; -inf entries become 0)
// replaced by exp(s - top), top = the max of `floor` and the scores, written to *top_out;
// returns the sum of the exponentials. `floor` joins the max only: an attention sink's logit,
// a running max of earlier blocks, or -inf.
inline float exp_from_max(float* s, int64_t padded, float floor, float* top_out) {
  __m256 top = _mm256_set1_ps(floor);
  for (int64_t i = 0; i < padded; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(s + i));
  const float high = hmax(top);
  const __m256 m = _mm256_set1_ps(high);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < padded; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + i), m));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  *top_out = high;
  return hsum(sum);
}

// eight values widened to fp32: fp32 as stored, bf16 exactly (its bits are the top half of an
// fp32)
inline __m256 load8f(const float* x) { return _mm256_loadu_ps(x); }
inline __m256 load8f(const at::BFloat16* x) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// eight fp32 lanes stored as bf16, rounded to nearest even (as c10::BFloat16 and .to() do for
// finite values)
inline void store8_bf16(at::BFloat16* out, __m256 y) {
  const __m256i b = _mm256_castps_si256(y);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), lsb), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}

}  // namespace compress_q8
