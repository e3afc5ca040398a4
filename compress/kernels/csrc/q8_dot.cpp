// Integer-dot CPU linears, decode side (one or a few rows; from GEMM_MIN_ROWS rows the ops hand
// over to q8_gemm.cpp): int4 or int8 weights x activations rounded to int8 per
// block of 32 columns (llama.cpp's Q4 x Q8 and Q8 x Q8 schemes). compress.kernels.cpu_q8 builds
// this file once per ISA level and documents the layouts; the float64 model of the arithmetic
// is cpu_q8.linear_q8_reference.
//
// Built with exactly one of -DCOMPRESS_AVX2 (maddubs/madd), -DCOMPRESS_AVXVNNI (256-bit
// vpdpbusd) or -DCOMPRESS_AVX512VNNI (512-bit vpdpbusd), and -DCOMPRESS_OPS=<op namespace>, so
// each level registers its own ops and the dispatcher picks one at run time from the CPU flags.
//
// Arithmetic, per row m, output n, block b (32 columns) and weight group j = group(b):
//   weights   w[n, k] = (c[n, k] - bias) * scale[n, j] + offset[n, j]     (offset optional)
//   int4: c in 0..15, bias 8; int8: c in 0..255 (the signed code + 128), bias 128
//   x rounded per block: s[m, b] = amax / 127 (1 if the block is all zero), q = rint(x / s)
//   y[m, n] = sum_b s[m, b] * scale[n, j] * (sum_t q[m, b, t] * c[n, b, t] - bias * qsum[m, b])
//           + sum_j offset[n, j] * xsum[m, j]                  (xsum from the exact x)
// The integer part of each block is exact (int32); the bias correction enters as the initial
// value of the block's int32 accumulator, so it costs nothing per weight.
//
// Layouts (K a multiple of 64, the group a multiple of 32 dividing K):
//   int4 codes uint8 [N, K/2]: per 64 columns 32 bytes, byte i = column i (low nibble) |
//        column 32 + i (high nibble), so one 32-byte load unpacks to two whole blocks;
//   int8 codes uint8 [N, K], natural order.
#include "q8_common.h"

namespace compress_q8 {

// Decode streams every weight byte once from DRAM, in short per-thread runs (a few hundred KB
// per call) that the hardware prefetchers ramp up on too late: measured on a Xeon, 30 layers of
// SmolLM2 int4 ran at 7 GB/s cold against 25 GB/s of read bandwidth. So each step asks for the
// rows PREFETCH_ROWS ahead: all their lines at once (prefetch_rows, into L1), or spread over
// the step (prefetch_pair).
constexpr int64_t PREFETCH_ROWS = 16;

inline void prefetch_rows(const uint8_t* codes, int64_t row_bytes, int64_t n0, int64_t n1) {
  const char* begin = reinterpret_cast<const char*>(codes + n0 * row_bytes);
  const char* end = reinterpret_cast<const char*>(codes + n1 * row_bytes);
  for (const char* p = begin; p < end; p += 64) _mm_prefetch(p, _MM_HINT_T0);
}

// The rows ahead asked for while the pair loop runs, one line per row as the loop reaches its
// offset, into L2 (``ahead``: the first of the COLS rows PREFETCH_ROWS ahead; null: nothing).
// The burst of prefetch_rows sends COLS * row_bytes / 64 requests at the start of each step;
// spread, they kept the int4 decode layers 10-25% faster from DRAM (1.1B shapes 19-23 against
// 16-18 GB/s, SmolLM2's 14-20 against 13-17) and int8 layers with K >= 4096 12-19% faster
// (7B o_proj 24.8 against 23.6 GB/s, down_proj 26.5 against 22.5), while int8 layers with
// K <= 2048 ran 1-13% slower than with the burst, so they keep it (``spread_prefetch``). Xeon
// with AVX-512, 2 threads, 2026-12-03. Its AVX2 level (COMPRESS_CPU_ISA=avx2) gained as much on
// int4 (7B down_proj 26.7 against 16.7 GB/s), and on int8 with K >= 4096 (23.2 against 19.4)
// while int8 with K <= 2048 stayed within 3%; the AVX-VNNI level and AMD CPUs were not measured.
inline bool spread_prefetch(bool q4, int64_t row_bytes) { return q4 || row_bytes >= 4096; }

template <int COLS, bool Q4>
inline void prefetch_pair(const uint8_t* ahead, int64_t row_bytes, int64_t p) {
  constexpr int64_t pair_bytes = Q4 ? PAIR / 2 : PAIR;
  if (ahead == nullptr || (p * pair_bytes) % 64 != 0) return;
  for (int c = 0; c < COLS; ++c)
    _mm_prefetch(reinterpret_cast<const char*>(ahead + c * row_bytes + p * pair_bytes),
                 _MM_HINT_T1);
}

// Output columns per step of the one-row (decode) loop. int4: four, sharing the activation loads
// with four independent FMA chains (Xeon, avx512vnni, 2 threads: 576x576 23 -> 13 us). int8:
// one, a single stream of weight rows per thread: measured on a Zen 5 EPYC (2 threads, a
// 1.1B-shaped decode pass on 2 MB pages, four against one column, rounds alternated) one column
// ran 1.25-1.26x faster at the avx2 level, 1.22x at avxvnni and 1.09x at avx512vnni, SmolLM2's
// shapes at parity; int4 lost 16% with one column (docs/notes/2026-12-05-huge-pages.md). Not
// measured on a Xeon.
template <bool Q4>
constexpr int COLUMNS = Q4 ? 4 : 1;

// ---- the two blocks of one pair, as unsigned bytes ----------------------------------------
#if defined(COMPRESS_AVX512VNNI)
template <bool Q4>
inline __m512i pair_codes(const uint8_t* row, int64_t p) {
  if constexpr (Q4) {
    // The 32 bytes in both halves (a broadcast load: no ALU work), the upper half shifted
    // right by 4 per 16-bit lane, then one mask: 2 vector ALU ops per 64 codes instead of 4
    // (and, shift, and, insert). Decode is bound by those ops on ports 0/5: 1.1B-shaped int4
    // layers ran at ~21-24 GB/s even from cache, below DRAM bandwidth; this made them 10%
    // faster from cache and 7% from DRAM (Xeon, 2 threads, same run, identical outputs).
    const __m512i v = _mm512_broadcast_i64x4(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * 32)));
    const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    return _mm512_and_si512(_mm512_srlv_epi16(v, shifts), _mm512_set1_epi8(0x0F));
  } else {
    return _mm512_loadu_si512(row + p * PAIR);
  }
}

// One output column for R rows: per pair one vpdpbusd per row (16 int32 lanes, 8 per block),
// started from the bias correction, then one convert and one FMA with the pair's scales.
template <int R, bool Q4>
inline void column(const RoundedX& x, const uint8_t* row, const float* ws, const float* off,
                   const int32_t* gidx, int64_t m0, float* y, int64_t N) {
  const int64_t P = x.B / 2;
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    const __m512i w = pair_codes<Q4>(row, p);
    const int32_t g0 = gidx[2 * p], g1 = gidx[2 * p + 1];
    const __m512 wscale = g0 == g1 ? _mm512_set1_ps(ws[g0])
                                   : _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(ws[g0]),
                                                          _mm512_set1_ps(ws[g1]));
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * P + p;
      const __m512i xq = _mm512_loadu_si512(x.q.data() + (m0 + r) * x.K + p * PAIR);
      const __m512i start = _mm512_loadu_si512(x.corr16.data() + i * 16);
      const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, w, xq));
      const __m512 s = _mm512_mul_ps(_mm512_loadu_ps(x.scale16.data() + i * 16), wscale);
      acc[r] = _mm512_fmadd_ps(dot, s, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    y[(m0 + r) * N] = _mm512_reduce_add_ps(acc[r]) +
                      offset_term(off, x.xsum.data() + (m0 + r) * x.G, x.G);
}

// One row (decode), COLS output columns at once: the pair's activations, corrections and
// scales are loaded once for all of them, and their FMA chains are independent (measured on
// a Xeon: 576x576 int4 in 25 us as one column at a time, 13 us four at a time). Groups of 64+
// columns apply the activation scale per block and the weight scale once per group.
template <int COLS, bool Q4>
inline void row_columns(const RoundedX& x, const uint8_t* row, int64_t row_bytes,
                        const float* ws, const float* off, const int32_t* gidx, float* y,
                        const uint8_t* ahead) {
  const int64_t P = x.B / 2, G = x.G;
  __m512 acc[COLS];
  for (int c = 0; c < COLS; ++c) acc[c] = _mm512_setzero_ps();
  if (G == x.B) {  // groups of 32: the two blocks of a pair have their own weight scales
    for (int64_t p = 0; p < P; ++p) {
      prefetch_pair<COLS, Q4>(ahead, row_bytes, p);
      const __m512i xq = _mm512_loadu_si512(x.q.data() + p * PAIR);
      const __m512i start = _mm512_loadu_si512(x.corr16.data() + p * 16);
      const __m512 sx = _mm512_loadu_ps(x.scale16.data() + p * 16);
      for (int c = 0; c < COLS; ++c) {
        const __m512 dot = _mm512_cvtepi32_ps(
            _mm512_dpbusd_epi32(start, pair_codes<Q4>(row + c * row_bytes, p), xq));
        const float* s = ws + c * G + 2 * p;
        const __m512 wscale =
            _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1]));
        acc[c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sx, wscale), acc[c]);
      }
    }
  } else {
    const int64_t per_group = P / G;  // pairs
    for (int64_t j = 0; j < G; ++j) {
      __m512 inner[COLS];
      for (int c = 0; c < COLS; ++c) inner[c] = _mm512_setzero_ps();
      for (int64_t p = j * per_group; p < (j + 1) * per_group; ++p) {
        prefetch_pair<COLS, Q4>(ahead, row_bytes, p);
        const __m512i xq = _mm512_loadu_si512(x.q.data() + p * PAIR);
        const __m512i start = _mm512_loadu_si512(x.corr16.data() + p * 16);
        const __m512 sx = _mm512_loadu_ps(x.scale16.data() + p * 16);
        for (int c = 0; c < COLS; ++c) {
          const __m512 dot = _mm512_cvtepi32_ps(
              _mm512_dpbusd_epi32(start, pair_codes<Q4>(row + c * row_bytes, p), xq));
          inner[c] = _mm512_fmadd_ps(dot, sx, inner[c]);
        }
      }
      for (int c = 0; c < COLS; ++c)
        acc[c] = _mm512_fmadd_ps(inner[c], _mm512_set1_ps(ws[c * G + j]), acc[c]);
    }
  }
  for (int c = 0; c < COLS; ++c)
    y[c] = _mm512_reduce_add_ps(acc[c]) +
           offset_term(off == nullptr ? nullptr : off + c * G, x.xsum.data(), G);
}
#else
// 256-bit: one block per vector. int4 codes are 0..15 and go to maddubs/vpdpbusd as they are.
// int8 codes (signed + 128) would overflow maddubs' int16 pairs (2 * 255 * 127), so AVX2 takes
// the signed code c - 128 (xor 0x80) and llama.cpp's sign trick: |c| . sign(x, c), pairs at
// most 2 * 128 * 127 = 32512; that product needs no bias correction. VNNI's vpdpbusd sums four
// products straight into int32 and takes the biased codes.
struct Block {
  __m256i w;  // unsigned codes (VNNI, int4) or |signed codes| (AVX2 int8)
#if defined(COMPRESS_AVX2)
  __m256i sign;  // signed int8 codes (AVX2 int8 only)
#endif
};

template <bool Q4>
inline void pair_blocks(const uint8_t* row, int64_t p, Block& b0, Block& b1) {
  if constexpr (Q4) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * 32));
    const __m256i low4 = _mm256_set1_epi8(0x0F);
    b0.w = _mm256_and_si256(v, low4);
    b1.w = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
  } else {
    b0.w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * PAIR));
    b1.w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + p * PAIR + BLOCK));
#if defined(COMPRESS_AVX2)
    const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
    b0.sign = _mm256_xor_si256(b0.w, flip);
    b1.sign = _mm256_xor_si256(b1.w, flip);
    b0.w = _mm256_abs_epi8(b0.sign);
    b1.w = _mm256_abs_epi8(b1.sign);
#endif
  }
}

// int32 lanes of one block's dot product as floats; start holds the bias correction in lane 0.
template <bool Q4>
inline __m256 block_dot(const Block& b, __m256i x, __m256i start) {
#if defined(COMPRESS_AVXVNNI)
  return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(start, b.w, x));
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Q4)
    return _mm256_cvtepi32_ps(
        _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(b.w, x), ones), start));
  else  // start is 0 here: the signed product needs no correction (the op passes bias 0)
    return _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_maddubs_epi16(b.w, _mm256_sign_epi8(x, b.sign)), ones));
#endif
}

inline __m256i load_x(const int8_t* xq) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
}

inline __m256i corr_start(int32_t corr) { return _mm256_setr_epi32(corr, 0, 0, 0, 0, 0, 0, 0); }

// One output column for R rows; two accumulators per row (one per block of the pair), so
// consecutive FMAs do not wait on each other.
template <int R, bool Q4>
inline void column(const RoundedX& x, const uint8_t* row, const float* ws, const float* off,
                   const int32_t* gidx, int64_t m0, float* y, int64_t N) {
  const int64_t P = x.B / 2;
  __m256 acc0[R], acc1[R];
  for (int r = 0; r < R; ++r) acc0[r] = acc1[r] = _mm256_setzero_ps();
  for (int64_t p = 0; p < P; ++p) {
    Block b0, b1;
    pair_blocks<Q4>(row, p, b0, b1);
    const float s0 = ws[gidx[2 * p]], s1 = ws[gidx[2 * p + 1]];
    for (int r = 0; r < R; ++r) {
      const int64_t i = (m0 + r) * x.B + 2 * p;
      const int8_t* xq = x.q.data() + (m0 + r) * x.K + p * PAIR;
      acc0[r] = _mm256_fmadd_ps(block_dot<Q4>(b0, load_x(xq), corr_start(x.corr[i])),
                                _mm256_set1_ps(x.scale[i] * s0), acc0[r]);
      acc1[r] = _mm256_fmadd_ps(block_dot<Q4>(b1, load_x(xq + BLOCK), corr_start(x.corr[i + 1])),
                                _mm256_set1_ps(x.scale[i + 1] * s1), acc1[r]);
    }
  }
  for (int r = 0; r < R; ++r)
    y[(m0 + r) * N] = hsum(_mm256_add_ps(acc0[r], acc1[r])) +
                      offset_term(off, x.xsum.data() + (m0 + r) * x.G, x.G);
}

// One row (decode), COLS output columns at once: the pair's activations and corrections are
// loaded once for all of them, and their FMA chains are independent. Groups of 64+ columns
// apply the activation scale per block and the weight scale once per group.
template <int COLS, bool Q4>
inline void row_columns(const RoundedX& x, const uint8_t* row, int64_t row_bytes,
                        const float* ws, const float* off, const int32_t* gidx, float* y,
                        const uint8_t* ahead) {
  const int64_t P = x.B / 2, G = x.G;
  __m256 acc[COLS];
  for (int c = 0; c < COLS; ++c) acc[c] = _mm256_setzero_ps();
  const bool g32 = G == x.B;  // the two blocks of a pair have their own weight scales
  const int64_t per_group = g32 ? 1 : P / G;  // pairs per accumulation step
  for (int64_t j = 0; j < P / per_group; ++j) {
    __m256 inner[COLS];
    for (int c = 0; c < COLS; ++c) inner[c] = _mm256_setzero_ps();
    for (int64_t p = j * per_group; p < (j + 1) * per_group; ++p) {
      prefetch_pair<COLS, Q4>(ahead, row_bytes, p);
      const __m256i x0 = load_x(x.q.data() + p * PAIR);
      const __m256i x1 = load_x(x.q.data() + p * PAIR + BLOCK);
      const __m256i start0 = corr_start(x.corr[2 * p]), start1 = corr_start(x.corr[2 * p + 1]);
      const __m256 sx0 = _mm256_set1_ps(x.scale[2 * p]), sx1 = _mm256_set1_ps(x.scale[2 * p + 1]);
      for (int c = 0; c < COLS; ++c) {
        Block b0, b1;
        pair_blocks<Q4>(row + c * row_bytes, p, b0, b1);
        if (g32) {  // both weight scales here; the group step below multiplies by 1
          const float* s = ws + c * G + 2 * p;
          inner[c] = _mm256_fmadd_ps(block_dot<Q4>(b0, x0, start0),
                                     _mm256_mul_ps(sx0, _mm256_set1_ps(s[0])), inner[c]);
          inner[c] = _mm256_fmadd_ps(block_dot<Q4>(b1, x1, start1),
                                     _mm256_mul_ps(sx1, _mm256_set1_ps(s[1])), inner[c]);
        } else {
          inner[c] = _mm256_fmadd_ps(block_dot<Q4>(b0, x0, start0), sx0, inner[c]);
          inner[c] = _mm256_fmadd_ps(block_dot<Q4>(b1, x1, start1), sx1, inner[c]);
        }
      }
    }
    for (int c = 0; c < COLS; ++c)
      acc[c] = g32 ? _mm256_add_ps(acc[c], inner[c])
                   : _mm256_fmadd_ps(inner[c], _mm256_set1_ps(ws[c * G + j]), acc[c]);
  }
  for (int c = 0; c < COLS; ++c)
    y[c] = hsum(acc[c]) + offset_term(off == nullptr ? nullptr : off + c * G, x.xsum.data(), G);
}
#endif

// The weight operands of every op: K and the group, scales fp32 [N, K/group], offsets (if any)
// like scales. Returns whether offsets are given.
inline bool check_weight(const char* what, int64_t N, int64_t K, int64_t group,
                         const at::Tensor& scales, const std::optional<at::Tensor>& offsets) {
  TORCH_CHECK(K % PAIR == 0 && group > 0 && group % BLOCK == 0 && K % group == 0, what,
              ": K must be a multiple of 64 and group a multiple of 32 dividing K (K=", K,
              ", group=", group, ")");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == N && scales.size(1) == K / group,
              what, ": scales must be contiguous fp32 [N, K/group]");
  const bool with_offsets = offsets.has_value() && offsets->defined();
  if (with_offsets)
    TORCH_CHECK(offsets->sizes() == scales.sizes() &&
                    offsets->scalar_type() == at::kFloat && offsets->is_contiguous(),
                what, ": offsets must be like scales");
  return with_offsets;
}

template <bool Q4>
at::Tensor linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const std::optional<at::Tensor>& offsets, int64_t group) {
  const char* what = Q4 ? "int4_linear_q8" : "int8_linear_q8";
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), what,
              ": x must be a contiguous fp32 [M, K] tensor");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  codes.size(1) == (Q4 ? K / 2 : K),
              what, ": codes must be contiguous uint8 [N, ", Q4 ? "K/2" : "K", "] for K=", K);
  const int64_t N = codes.size(0);
  const bool with_offsets = check_weight(what, N, K, group, scales, offsets);
  const int64_t G = K / group;
#if defined(COMPRESS_AVX2)
  const int32_t bias = Q4 ? 8 : 0;  // AVX2 int8 multiplies signed codes (see Block)
#else
  const int32_t bias = Q4 ? 8 : 128;
#endif
  // Plain loops, not ATen ops: at decode sizes (M = 1, K = 576) a handful of ATen calls cost
  // more than the product itself.
  const RoundedX rx = round_x(x.data_ptr<float>(), M, K, group, bias, with_offsets);
  if (M >= GEMM_MIN_ROWS) {  // prefill
    at::Tensor y = gemm_q8<Q4>(rx, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), N, group);
    if (with_offsets) {
      const at::Tensor xsum = at::from_blob(const_cast<float*>(rx.xsum.data()), {M, G}, x.options());
      y.addmm_(xsum, offsets->t());
    }
    return y;
  }
  std::vector<int32_t> gidx(rx.B);
  for (int64_t b = 0; b < rx.B; ++b) gidx[b] = static_cast<int32_t>(b * BLOCK / group);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = with_offsets ? offsets->data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const int64_t row_bytes = Q4 ? K / 2 : K;
  // Needs -fopenmp at build time: without it at::parallel_for runs on one thread. Layers under
  // ~128K weights stay on one thread: waking the second one cost more than it saved (measured
  // on an AVX2 EPYC: 192x576 took 33 us on 2 threads, 25 us on 1).
  const int64_t grain = std::max<int64_t>(16, ((int64_t{1} << 17) + K - 1) / K);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (M == 1) {  // decode: COLUMNS output columns at a time
      constexpr int64_t cols = COLUMNS<Q4>;
      int64_t n = n0;
      for (; n + cols <= n1; n += cols) {
        // the rows ahead: spread over this step, or at once (near the end of the range, or
        // int8 rows under spread_prefetch's length)
        const bool spread = spread_prefetch(Q4, row_bytes) && n + PREFETCH_ROWS + cols <= n1;
        if (!spread)
          prefetch_rows(cp, row_bytes, n + PREFETCH_ROWS, std::min(n + PREFETCH_ROWS + cols, n1));
        row_columns<cols, Q4>(rx, cp + n * row_bytes, row_bytes, sp + n * G,
                                 op == nullptr ? nullptr : op + n * G, gidx.data(), yp + n,
                                 spread ? cp + (n + PREFETCH_ROWS) * row_bytes : nullptr);
      }
      for (; n < n1; ++n)
        row_columns<1, Q4>(rx, cp + n * row_bytes, row_bytes, sp + n * G,
                           op == nullptr ? nullptr : op + n * G, gidx.data(), yp + n, nullptr);
      return;
    }
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * row_bytes;
      const float* s = sp + n * G;
      const float* o = op == nullptr ? nullptr : op + n * G;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        float* out = yp + n;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: column<1, Q4>(rx, row, s, o, gidx.data(), m0, out, N); break;
          case 2: column<2, Q4>(rx, row, s, o, gidx.data(), m0, out, N); break;
          case 3: column<3, Q4>(rx, row, s, o, gidx.data(), m0, out, N); break;
          default: column<4, Q4>(rx, row, s, o, gidx.data(), m0, out, N); break;
        }
      }
    }
  });
  return y;
}

// The weights as fp32 [N, K], w = (c - bias) * scale + offset: for long prompts on levels whose
// integer GEMM loses to an fp32 GEMM (cpu_q8.FLOAT_GEMM_MIN_ROWS: the 256-bit ones). Written
// for the compiler to vectorize (32 columns of one group per inner loop); N x K stores, small
// next to the GEMM at the row counts that take this path.
template <bool Q4>
at::Tensor dequantize_codes(const at::Tensor& codes, const at::Tensor& scales,
                            const std::optional<at::Tensor>& offsets, int64_t group) {
  const char* what = Q4 ? "dequantize_q4" : "dequantize_q8";
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous(), what,
              ": codes must be contiguous uint8 [N, K", Q4 ? "/2]" : "]");
  const int64_t N = codes.size(0), K = Q4 ? codes.size(1) * 2 : codes.size(1);
  const bool with_offsets = check_weight(what, N, K, group, scales, offsets);
  const int64_t G = K / group;
  at::Tensor w = at::empty({N, K}, scales.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  const float* op = with_offsets ? offsets->data_ptr<float>() : nullptr;
  float* wp = w.data_ptr<float>();
  const int64_t row_bytes = Q4 ? K / 2 : K;
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* row = cp + n * row_bytes;
      float* out = wp + n * K;
      for (int64_t b = 0; b < K / BLOCK; ++b) {  // block b: columns 32b .. 32b + 31
        const int64_t j = b * BLOCK / group;
        const float s = sp[n * G + j], o = op == nullptr ? 0.f : op[n * G + j];
        float* dst = out + b * BLOCK;
        if constexpr (Q4) {  // block 2p in the low nibbles of pair p's 32 bytes, 2p + 1 high
          const uint8_t* src = row + (b / 2) * BLOCK;
          const int shift = (b % 2) * 4;
          for (int i = 0; i < BLOCK; ++i)
            dst[i] = static_cast<float>(((src[i] >> shift) & 0xF) - 8) * s + o;
        } else {
          const uint8_t* src = row + b * BLOCK;
          for (int i = 0; i < BLOCK; ++i) dst[i] = static_cast<float>(src[i] - 128) * s + o;
        }
      }
    }
  });
  return w;
}

at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::optional<at::Tensor>& offsets, int64_t group) {
  return linear_q8<true>(x, codes, scales, offsets, group);
}

at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::optional<at::Tensor>& offsets, int64_t group) {
  return linear_q8<false>(x, codes, scales, offsets, group);
}

at::Tensor dequantize_q4(const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& offsets, int64_t group) {
  return dequantize_codes<true>(codes, scales, offsets, group);
}

at::Tensor dequantize_q8(const at::Tensor& codes, const at::Tensor& scales,
                         const std::optional<at::Tensor>& offsets, int64_t group) {
  return dequantize_codes<false>(codes, scales, offsets, group);
}

}  // namespace compress_q8

using compress_q8::dequantize_q4;
using compress_q8::dequantize_q8;
using compress_q8::int4_linear_q8;
using compress_q8::int8_linear_q8;

TORCH_LIBRARY(COMPRESS_OPS, m) {
  m.def("int4_linear_q8(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
  m.def("int8_linear_q8(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
  m.def("dequantize_q4(Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
  m.def("dequantize_q8(Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("int4_linear_q8", &int4_linear_q8);
  m.impl("int8_linear_q8", &int8_linear_q8);
  m.impl("dequantize_q4", &dequantize_q4);
  m.impl("dequantize_q8", &dequantize_q8);
}
