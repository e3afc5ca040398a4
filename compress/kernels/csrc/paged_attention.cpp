// Decode attention read straight from the paged KV pool (compress/runtime/paged.py): each row
// has one query token and attends to the first `length` slots of its own block table. The
// torch path (PagedKVCache.read + scaled_dot_product_attention) first copies every row's blocks
// into a contiguous [B, kv_heads, L, D] tensor, padded to the longest row, then reads it again.
// Here each key and value row is read where it lies, and rows stop at their own length.
// Measured on a Xeon, 2 threads, one SmolLM2 layer at 32 rows of ~170 keys: 0.91 ms gathered
// (two index_selects and SDPA) against 0.30 ms here on fp32 pages, 0.25 on bf16.
//
// One task per (row, kv head), its G = heads / kv_heads query heads one after another (grouped-
// query attention: query head i reads kv head i / G, as SDPA's enable_gqa). Scores in fp32
// (bf16 pages widen exactly, int8 pages as code x scale, fp8 pages as value x their layer's
// scale), eight keys at a time; an optional
// tanh softcap (Gemma 2); the window keeps the last `window` keys; softmax with the max
// subtracted (a polynomial exp); then the weighted sum of values, 64 columns at a time in
// registers. AVX2 + FMA intrinsics, so every ISA level builds the same code; the avx512vnni
// level adds attend_heads16 (head_dim a multiple of 16) below. Reference:
// compress.kernels.cpu_attention.paged_decode_attention_reference (float64 torch).
#include "q8_common.h"

namespace compress_q8 {

// Eight values of a page row widened to fp32: fp32 and bf16 as load8f widens them, int8 codes
// times their row's scale (PagedKVCache's per token and head scales).
inline __m256 load8(const float* x, float) { return load8f(x); }
inline __m256 load8(const at::BFloat16* x, float) { return load8f(x); }
inline __m256 load8(const int8_t* x, float scale) {
  const __m128i c = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(x));
  return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), _mm256_set1_ps(scale));
}
// fp8 e4m3fn (sign, 4 exponent bits of bias 7, 3 mantissa bits, no infinities): its seven
// magnitude bits moved up to fp32's bit 20 are the fp32 of the same mantissa and exponent, off
// by 2^(127 - 7); times 2^120 (exact), then the layer's scale (PagedKVCache's per-tensor
// scales, vLLM's k_scale / v_scale). A code of exponent 0 (subnormal) becomes an fp32
// subnormal first: exact unless the thread flushes denormal inputs (MXCSR DAZ, off by default;
// the tests check subnormal codes). NaN codes (0x7F, 0xFF) are never written.
inline __m256 load8(const at::Float8_e4m3fn* x, float scale) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(x)));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256 v = _mm256_castsi256_ps(_mm256_or_si256(sign, mag));
  return _mm256_mul_ps(_mm256_mul_ps(v, _mm256_set1_ps(0x1p120f)), _mm256_set1_ps(scale));
}

// the eight sums of acc[0..7]'s lanes, in that order
inline __m256 hsum8(const __m256* a) {
  const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20),
                       _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Softcap and softmax of one head's n scores in place (the padding to `padded` holds -inf and
// becomes 0); returns 1 / the sum of the exponentials. `sink` (-inf: none) joins the softmax
// as one more score without a value (GPT-OSS's attention sinks): its share is in the sum only.
inline float softmax_scores(float* sg, int64_t n, int64_t padded, float softcap, float sink) {
  if (softcap > 0.f)
    for (int64_t i = 0; i < n; ++i) sg[i] = std::tanh(sg[i] / softcap) * softcap;
  float high;
  const float sum = exp_from_max(sg, padded, sink, &high);
  return 1.f / (sum + std::exp(sink - high));
}

// The sums of a[0..3]'s lanes, in that order
inline __m128 hsum4(const __m256* a) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// Scores of GC query heads (q: the first, D apart) over the n keys at kpool + rows[i] * D, four
// keys at a time, each key vector loaded (and widened) once for the GC heads. `s`: GC rows of
// `padded` scores. With `prefetch`, the rows of the keys two steps ahead (they lie in other
// blocks, out of the stream) and the values of these keys are asked for.
template <typename T, int GC>
void scores_heads8(const float* q, const T* kpool, const T* vpool, const float* kscale,
                   int64_t per_row, const int64_t* rows, int64_t n, int64_t D, float scale,
                   float* s, int64_t padded, bool prefetch) {
  const int64_t V = D / 8, row_bytes = D * static_cast<int64_t>(sizeof(T));
  auto ask = [&](const T* pool, int64_t r, int hint) {
    const char* row = reinterpret_cast<const char*>(pool + rows[r] * D);
    for (int64_t c = 0; c < row_bytes; c += 64)
      _mm_prefetch(row + c, hint == 0 ? _MM_HINT_T0 : _MM_HINT_T1);
  };
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const T* k[4];
    float ks[4];
    for (int r = 0; r < 4; ++r) {
      const int64_t at = rows[i + r];
      k[r] = kpool + at * D;
      ks[r] = kscale ? kscale[at & per_row] : 1.f;
    }
    if (prefetch) {
      for (int64_t r = i + 8; r < std::min(i + 12, n); ++r) ask(kpool, r, 0);
      for (int64_t r = i; r < i + 4; ++r) ask(vpool, r, 1);
    }
    __m256 acc[GC][4];
    for (int g = 0; g < GC; ++g)
      for (int r = 0; r < 4; ++r) acc[g][r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < V; ++j) {
      __m256 qj[GC];
      for (int g = 0; g < GC; ++g) qj[g] = _mm256_loadu_ps(q + g * D + 8 * j);
      for (int r = 0; r < 4; ++r) {
        const __m256 kv = load8(k[r] + 8 * j, ks[r]);
        for (int g = 0; g < GC; ++g) acc[g][r] = _mm256_fmadd_ps(qj[g], kv, acc[g][r]);
      }
    }
    for (int g = 0; g < GC; ++g)
      _mm_storeu_ps(s + g * padded + i, _mm_mul_ps(hsum4(acc[g]), _mm_set1_ps(scale)));
  }
  for (; i < n; ++i) {
    const int64_t at = rows[i];
    const float ks = kscale ? kscale[at & per_row] : 1.f;
    if (prefetch) ask(vpool, i, 1);
    __m256 acc[GC];
    for (int g = 0; g < GC; ++g) acc[g] = _mm256_setzero_ps();
    for (int64_t j = 0; j < V; ++j) {
      const __m256 kv = load8(kpool + at * D + 8 * j, ks);
      for (int g = 0; g < GC; ++g)
        acc[g] = _mm256_fmadd_ps(_mm256_loadu_ps(q + g * D + 8 * j), kv, acc[g]);
    }
    for (int g = 0; g < GC; ++g) s[g * padded + i] = hsum(acc[g]) * scale;
  }
}

// Columns c0 .. c0 + 8W of GC heads' outputs: the sum over keys of p x v, each value vector
// loaded (and widened) once for the GC heads, then times the heads' 1 / softmax sums (`norm`).
template <typename T, int GC, int W>
void values_heads8(const T* vpool, const float* vscale, int64_t per_row, const int64_t* rows,
                   int64_t n, int64_t D, int64_t c0, const float* s, int64_t padded,
                   const float* norm, float* out) {
  __m256 o[GC][W];
  for (int g = 0; g < GC; ++g)
    for (int w = 0; w < W; ++w) o[g][w] = _mm256_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t at = rows[t];
    const float vs = vscale ? vscale[at & per_row] : 1.f;
    const T* v = vpool + at * D + c0;
    __m256 p[GC];
    for (int g = 0; g < GC; ++g) p[g] = _mm256_set1_ps(s[g * padded + t]);
    for (int w = 0; w < W; ++w) {
      const __m256 vv = load8(v + 8 * w, vs);
      for (int g = 0; g < GC; ++g) o[g][w] = _mm256_fmadd_ps(p[g], vv, o[g][w]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int w = 0; w < W; ++w)
      _mm256_storeu_ps(out + g * D + c0 + 8 * w, _mm256_mul_ps(o[g][w], _mm256_set1_ps(norm[g])));
}

// The G query heads of one (row, kv head) task over its n keys, two at a time (the last alone
// when G is odd): key i lies at kpool + rows[i] * D, its scale at kscale[rows[i] & per_row].
// `q`: the task's first query head; `out`: its first output head; `scores`: G * padded floats,
// -inf filled. Two heads share each key and value load (and bf16 widening). Measured against
// one head per pass, both built side by side, on an AMD EPYC Zen 3 (AVX2), 2 threads, pages
// scattered in blocks of 16, identical outputs but for summation order: the 1.1B shape's heads
// (32 over 4 kv heads) one row over 2048 bf16 keys 809 -> 551 us, over 512 fp32 146 -> 124,
// 28 rows of 150 fp32 keys 807 -> 642; SmolLM2's (9 over 3) 1.02-1.10x faster; one case of
// 28 rows of 600 fp32 keys (34 MB of pages, from DRAM) 4.90 against 5.16 ms, within its spread.
template <typename T>
void attend_heads(const float* q, const T* kpool, const T* vpool, const float* kscale,
                  const float* vscale, int64_t per_row, const int64_t* rows, int64_t n,
                  float* out, int64_t G, int64_t D, float scale, float softcap,
                  const float* sinks, float* scores, int64_t padded) {
  for (int64_t g0 = 0; g0 < G; g0 += 2) {
    const bool pair = g0 + 1 < G;
    const float* qg = q + g0 * D;
    float* sg = scores + g0 * padded;
    float* og = out + g0 * D;
    const bool prefetch = g0 == 0;
    if (pair)
      scores_heads8<T, 2>(qg, kpool, vpool, kscale, per_row, rows, n, D, scale, sg, padded,
                          prefetch);
    else
      scores_heads8<T, 1>(qg, kpool, vpool, kscale, per_row, rows, n, D, scale, sg, padded,
                          prefetch);
    float norm[2];
    for (int g = 0; g < (pair ? 2 : 1); ++g)
      norm[g] = softmax_scores(sg + g * padded, n, padded, softcap,
                               sinks ? sinks[g0 + g] : -INFINITY);
    // a pair: 32 columns a pass (8 accumulators and 4 value vectors in registers); one head:
    // 64; then 8 at a time
    int64_t c0 = 0;
    if (pair) {
      for (; c0 + 32 <= D; c0 += 32)
        values_heads8<T, 2, 4>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
      for (; c0 < D; c0 += 8)
        values_heads8<T, 2, 1>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
    } else {
      for (; c0 + 64 <= D; c0 += 64)
        values_heads8<T, 1, 8>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
      for (; c0 < D; c0 += 8)
        values_heads8<T, 1, 1>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
    }
  }
}

#if defined(COMPRESS_AVX512VNNI)
// The AVX-512 build, for head_dim a multiple of 16: sixteen values per register, and each key
// and value row widened once for up to three query heads of its kv head (the AVX2 loop above
// for two: for bf16 pages, one conversion op per FMA). Same products, other
// summation order; reference: paged_decode_attention_reference. Measured on a Xeon (2 threads,
// scripts/bench_paged_attention.py, bf16 pages, AVX2 loop -> this): SmolLM2's heads, 32 rows of
// 400 keys 787 -> 503-533 us; the 1.1B shape's, 28 rows of 600 keys 2709 -> 1568-1608 us; int8
// and fp8 pages gain as much (so they no longer widen into a scratch first). In a SmolLM2 W4
// serving run (32 requests of 128 + 64 tokens, the scheduler alone) attention took 584 ms
// against 804 and the run 4.44 s against 4.76.
constexpr int64_t PF = 2;
inline __m512 load16(const float* x, float) { return _mm512_loadu_ps(x); }
inline __m512 load16(const at::BFloat16* x, float) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load16(const int8_t* x, float scale) {
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)), _mm512_set1_ps(scale));
}
inline __m512 load16(const at::Float8_e4m3fn* x, float scale) {  // as load8 above
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
  const __m512 v = _mm512_castsi512_ps(_mm512_or_si512(sign, mag));
  return _mm512_mul_ps(_mm512_mul_ps(v, _mm512_set1_ps(0x1p120f)), _mm512_set1_ps(scale));
}

// the eight sums of a[0..7]'s sixteen lanes, in that order: pairs interleaved and added within
// 128-bit lanes twice, then the four 128-bit lanes added (24 ops for eight sums)
inline __m256 hsum8x16(const __m512* a) {
  auto pair = [](__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_unpacklo_ps(x, y), _mm512_unpackhi_ps(x, y));
  };
  auto quad = [](__m512 x, __m512 y) {
    const __m512d xd = _mm512_castps_pd(x), yd = _mm512_castps_pd(y);
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(xd, yd)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(xd, yd)));
  };
  // lane l of s0123 holds lane l's sums of a0..a3 (in order), of s4567 of a4..a7
  const __m512 s0123 = quad(pair(a[0], a[1]), pair(a[2], a[3]));
  const __m512 s4567 = quad(pair(a[4], a[5]), pair(a[6], a[7]));
  // [A0 + A1, A2 + A3, B0 + B1, B2 + B3] (A: s0123's 128-bit lanes, B: s4567's)
  const __m512 h = _mm512_add_ps(_mm512_shuffle_f32x4(s0123, s4567, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_f32x4(s0123, s4567, _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512 r = _mm512_add_ps(_mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(3, 1, 2, 0)),
                                 _mm512_shuffle_f32x4(h, h, _MM_SHUFFLE(2, 0, 3, 1)));
  return _mm512_castps512_ps256(r);
}

// GC query heads (q, stride D) of one kv head over its n keys (rows[i]: key i's pool row):
// scores times `scale` into s (GC rows of stride `padded`). Eight keys at a time, each widened
// once and multiplied into GC x 8 accumulators. While the first head group scores, the next
// keys are prefetched to L1 and these keys' value rows to L2 (the value pass reads them next).
template <typename T, int GC>
void scores_heads16(const float* q, const T* kpool, const T* vpool, const float* kscale,
                    int64_t per_row, const int64_t* rows, int64_t n, int64_t D, float scale,
                    float* s, int64_t padded, bool prefetch) {
  const int64_t V = D / 16, row_bytes = D * static_cast<int64_t>(sizeof(T));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const T* k[8];
    float ks[8];
    for (int r = 0; r < 8; ++r) {
      const int64_t at = rows[i + r];
      k[r] = kpool + at * D;
      ks[r] = kscale ? kscale[at & per_row] : 1.f;
    }
    if (prefetch) {
      for (int64_t r = i + 8 * PF; r < std::min(i + 8 * PF + 8, n); ++r)
        for (int64_t c = 0; c < row_bytes; c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(kpool + rows[r] * D) + c, _MM_HINT_T0);
      for (int64_t r = i; r < i + 8; ++r)
        for (int64_t c = 0; c < row_bytes; c += 64)
          _mm_prefetch(reinterpret_cast<const char*>(vpool + rows[r] * D) + c, _MM_HINT_T1);
    }
    __m512 acc[GC][8];
    for (int g = 0; g < GC; ++g)
      for (int r = 0; r < 8; ++r) acc[g][r] = _mm512_setzero_ps();
    for (int64_t j = 0; j < V; ++j)
      for (int r = 0; r < 8; ++r) {
        const __m512 kv = load16(k[r] + 16 * j, ks[r]);
        for (int g = 0; g < GC; ++g)
          acc[g][r] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * j), kv, acc[g][r]);
      }
    for (int g = 0; g < GC; ++g)
      _mm256_storeu_ps(s + g * padded + i, _mm256_mul_ps(hsum8x16(acc[g]), _mm256_set1_ps(scale)));
  }
  for (; i < n; ++i) {
    const int64_t at = rows[i];
    const float ks = kscale ? kscale[at & per_row] : 1.f;
    if (prefetch)
      for (int64_t c = 0; c < row_bytes; c += 64)
        _mm_prefetch(reinterpret_cast<const char*>(vpool + at * D) + c, _MM_HINT_T1);
    __m512 acc[GC];
    for (int g = 0; g < GC; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t j = 0; j < V; ++j) {
      const __m512 kv = load16(kpool + at * D + 16 * j, ks);
      for (int g = 0; g < GC; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(q + g * D + 16 * j), kv, acc[g]);
    }
    for (int g = 0; g < GC; ++g) s[g * padded + i] = _mm512_reduce_add_ps(acc[g]) * scale;
  }
}

// out (GC heads, stride D) = sum over the n keys of p x v, p = s's rows (stride `padded`) times
// norm[g]: W column groups of 16 at a time (W <= 4: up to 12 accumulators for three heads),
// each value row widened once for the GC heads.
template <typename T, int GC, int W>
void values_heads16(const T* vpool, const float* vscale, int64_t per_row, const int64_t* rows,
                    int64_t n, int64_t D, int64_t c0, const float* s, int64_t padded,
                    const float* norm, float* out) {
  __m512 o[GC][W];
  for (int g = 0; g < GC; ++g)
    for (int w = 0; w < W; ++w) o[g][w] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    const int64_t at = rows[t];
    const float vs = vscale ? vscale[at & per_row] : 1.f;
    const T* v = vpool + at * D + c0;
    __m512 vv[W];
    for (int w = 0; w < W; ++w) vv[w] = load16(v + 16 * w, vs);
    for (int g = 0; g < GC; ++g) {
      const __m512 p = _mm512_set1_ps(s[g * padded + t]);
      for (int w = 0; w < W; ++w) o[g][w] = _mm512_fmadd_ps(p, vv[w], o[g][w]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int w = 0; w < W; ++w)
      _mm512_storeu_ps(out + g * D + c0 + 16 * w, _mm512_mul_ps(o[g][w], _mm512_set1_ps(norm[g])));
}

// attend_heads for D % 16 == 0: the G heads in groups of up to three, each group scoring,
// normalizing and summing values with every key and value row widened once for the group
template <typename T>
void attend_heads16(const float* q, const T* kpool, const T* vpool, const float* kscale,
                    const float* vscale, int64_t per_row, const int64_t* rows, int64_t n,
                    float* out, int64_t G, int64_t D, float scale, float softcap,
                    const float* sinks, float* scores, int64_t padded) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int gc = static_cast<int>(std::min<int64_t>(3, G - g0));
    const float* qg = q + g0 * D;
    float* sg = scores + g0 * padded;
    float* og = out + g0 * D;
    const bool prefetch = g0 == 0;
    if (gc == 3)
      scores_heads16<T, 3>(qg, kpool, vpool, kscale, per_row, rows, n, D, scale, sg, padded, prefetch);
    else if (gc == 2)
      scores_heads16<T, 2>(qg, kpool, vpool, kscale, per_row, rows, n, D, scale, sg, padded, prefetch);
    else
      scores_heads16<T, 1>(qg, kpool, vpool, kscale, per_row, rows, n, D, scale, sg, padded, prefetch);
    float norm[3];
    for (int g = 0; g < gc; ++g)
      norm[g] = softmax_scores(sg + g * padded, n, padded, softcap,
                               sinks ? sinks[g0 + g] : -INFINITY);
    int64_t c0 = 0;
    for (; c0 + 64 <= D; c0 += 64) {
      if (gc == 3)
        values_heads16<T, 3, 4>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
      else if (gc == 2)
        values_heads16<T, 2, 4>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
      else
        values_heads16<T, 1, 4>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
    }
    for (; c0 < D; c0 += 16) {
      if (gc == 3)
        values_heads16<T, 3, 1>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
      else if (gc == 2)
        values_heads16<T, 2, 1>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
      else
        values_heads16<T, 1, 1>(vpool, vscale, per_row, rows, n, D, c0, sg, padded, norm, og);
    }
  }
}
#endif

// Steps with fewer query-key products than this (heads x keys x D, summed over rows) run on one
// thread: waking the second cost more than it saved (AMD EPYC Zen 3, 2 threads, fp32 cache: 9
// heads over 64 keys of 64 took 12.9 us on two threads, 8.2 on one; 32 heads over 64 keys 14.9
// against 16.7, 9 heads over 512 keys 30.9 against 43.5).
constexpr int64_t PARALLEL_MIN_PRODUCTS = int64_t{1} << 16;

// One task per (row b, kv head h): rows_of(b, h, rows) lists the task's keys in order, each as
// its index into the pools' rows of D values (a paged table's slots, or a contiguous cache's
// unmasked positions); every task has at least one key (the ops check). `keys`: the rows' key
// counts summed (or a bound), for PARALLEL_MIN_PRODUCTS.
template <typename T, typename RowsOf>
void decode_attention(const float* q, const T* kpool, const T* vpool, const float* kscale,
                      const float* vscale, float* out, int64_t B, int64_t H, int64_t Hkv,
                      int64_t D, float scale, float softcap, const float* sinks, int64_t keys,
                      const RowsOf& rows_of) {
  const int64_t G = H / Hkv, V = D / 8;
  constexpr bool fp8 = std::is_same_v<T, at::Float8_e4m3fn>;
  const int64_t per_row = std::is_same_v<T, int8_t> ? -1 : 0;
  const bool widen = fp8 ? G > 1 : std::is_same_v<T, int8_t> && G >= 4;
  const int64_t run = keys * H * D < PARALLEL_MIN_PRODUCTS ? B * Hkv : 1;  // one run: one thread
  parallel_claims(B * Hkv, run, [&](Claims& claims) {
    std::vector<float> scores, wide_k, wide_v;
    std::vector<int64_t> rows, order;  // rows [n]: each key's index into the pool's rows
    for (int64_t begin, end; claims.take(begin, end);)  // runs of tasks
      for (int64_t task = begin; task < end; ++task) {
        const int64_t b = task / Hkv, h = task % Hkv;
        rows_of(b, h, rows);
        const int64_t n = static_cast<int64_t>(rows.size()), padded = (n + 7) / 8 * 8;
        scores.assign(G * padded, -INFINITY);  // the tail past n: exp(-inf - max) = 0
        const float* qt = q + (b * H + h * G) * D;
        float* ot = out + (b * H + h * G) * D;
        const float* st = sinks ? sinks + h * G : nullptr;  // the task's heads' sinks
#if defined(COMPRESS_AVX512VNNI)
        if (D % 16 == 0) {
          attend_heads16<T>(qt, kpool, vpool, kscale, vscale, per_row, rows.data(), n, ot, G, D,
                            scale, softcap, st, scores.data(), padded);
          continue;
        }
#endif
        if (widen) {
          wide_k.resize(n * D);
          wide_v.resize(n * D);
          order.resize(n);
          for (int64_t i = 0; i < n; ++i) {
            order[i] = i;
            const int64_t at = rows[i];
            const float ks = kscale[at & per_row], vs = vscale[at & per_row];
            for (int64_t j = 0; j < V; ++j) {
              _mm256_storeu_ps(wide_k.data() + i * D + 8 * j, load8(kpool + at * D + 8 * j, ks));
              _mm256_storeu_ps(wide_v.data() + i * D + 8 * j, load8(vpool + at * D + 8 * j, vs));
            }
          }
          attend_heads<float>(qt, wide_k.data(), wide_v.data(), nullptr, nullptr, 0, order.data(),
                              n, ot, G, D, scale, softcap, st, scores.data(), padded);
        } else {
          attend_heads<T>(qt, kpool, vpool, kscale, vscale, per_row, rows.data(), n, ot, G, D,
                          scale, softcap, st, scores.data(), padded);
        }
      }
  });
}

// decode_attention on pools of any page dtype
template <typename RowsOf>
void attend_pools(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const float* ks,
                  const float* vs, at::Tensor& out, int64_t Hkv, float scale, float softcap,
                  const float* sinks, int64_t keys, const RowsOf& rows_of) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  const float* qp = q.data_ptr<float>();
  float* o = out.data_ptr<float>();
  switch (k.scalar_type()) {
    case at::kFloat:
      decode_attention(qp, k.data_ptr<float>(), v.data_ptr<float>(), ks, vs, o, B, H, Hkv, D,
                       scale, softcap, sinks, keys, rows_of);
      break;
    case at::kBFloat16:
      decode_attention(qp, k.data_ptr<at::BFloat16>(), v.data_ptr<at::BFloat16>(), ks, vs, o, B,
                       H, Hkv, D, scale, softcap, sinks, keys, rows_of);
      break;
    case at::kFloat8_e4m3fn:
      decode_attention(qp, k.data_ptr<at::Float8_e4m3fn>(), v.data_ptr<at::Float8_e4m3fn>(), ks,
                       vs, o, B, H, Hkv, D, scale, softcap, sinks, keys, rows_of);
      break;
    default:
      decode_attention(qp, k.data_ptr<int8_t>(), v.data_ptr<int8_t>(), ks, vs, o, B, H, Hkv, D,
                       scale, softcap, sinks, keys, rows_of);
  }
}

// the query and sinks of both ops: q contiguous fp32 [B, heads, D], sinks fp32 [heads]
inline void check_query(const at::Tensor& q, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous fp32 [B, heads, D] tensor");
  TORCH_CHECK(q.size(2) % 8 == 0, "head_dim ", q.size(2), " is not a multiple of 8");
  if (sinks)
    TORCH_CHECK(sinks->scalar_type() == at::kFloat && sinks->is_contiguous() &&
                    sinks->dim() == 1 && sinks->size(0) == q.size(1),
                "sinks must be contiguous fp32 [heads]");
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  const at::Tensor& tables, const at::Tensor& lengths,
                                  int64_t block_size, double scale, double softcap,
                                  int64_t window, const std::optional<at::Tensor>& sinks) {
  check_query(q, sinks);
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == v_pool.scalar_type() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous(),
              "k_pool and v_pool must be contiguous [slots, kv_heads, D] tensors of one dtype");
  const auto dtype = k_pool.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar ||
                  dtype == at::kFloat8_e4m3fn,
              "KV pages must be fp32, bf16, int8 or fp8 e4m3fn, got ", dtype);
  const bool fp8 = dtype == at::kFloat8_e4m3fn, codes = dtype == at::kChar || fp8;
  TORCH_CHECK(codes == (k_scale.has_value() && v_scale.has_value()) &&
                  codes == (k_scale.has_value() || v_scale.has_value()),
              "int8 and fp8 pages need k_scale and v_scale, other pages neither");
  if (codes)
    for (const auto& s : {*k_scale, *v_scale})
      TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous() &&
                      (fp8 ? s.numel() == 1
                           : s.dim() == 2 && s.size(0) == k_pool.size(0) &&
                                 s.size(1) == k_pool.size(1)),
                  fp8 ? "fp8 pages' scales must be one fp32 value each (per layer)"
                      : "int8 pages' scales must be contiguous fp32 [slots, kv_heads]");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), Hkv = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D && Hkv > 0 && H % Hkv == 0,
              "heads (", H, ") must be a multiple of kv_heads (", Hkv, ") and D equal");
  TORCH_CHECK(block_size > 0 && k_pool.size(0) % block_size == 0,
              "the pool's slots must be whole blocks of block_size");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && tables.scalar_type() == at::kLong &&
                  tables.is_contiguous(),
              "tables must be contiguous int64 [B, blocks]");
  TORCH_CHECK(lengths.dim() == 1 && lengths.size(0) == B &&
                  lengths.scalar_type() == at::kLong && lengths.is_contiguous(),
              "lengths must be contiguous int64 [B]");
  const int64_t nb = tables.size(1), num_blocks = k_pool.size(0) / block_size;
  const int64_t* tab = tables.data_ptr<int64_t>();
  const int64_t* len = lengths.data_ptr<int64_t>();
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= nb * block_size, "row ", b, ": length ", len[b],
                " outside 1..", nb * block_size, " (its table's slots)");
    keys += window > 0 ? std::min(len[b], window) : len[b];
    for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tab[b * nb + i] >= 0 && tab[b * nb + i] < num_blocks, "row ", b, ": block id ",
                  tab[b * nb + i], " outside the pool's ", num_blocks, " blocks");
  }
  auto out = at::empty({B, H, D}, q.options());
  // a row's keys: the last `window` (all: window <= 0) of its first lengths[b] table slots
  const int64_t bs = block_size;
  auto rows_of = [&](int64_t b, int64_t h, std::vector<int64_t>& rows) {
    const int64_t L = len[b], first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
    const int64_t* table = tab + b * nb;
    rows.resize(L - first);
    for (int64_t t = first; t < L; ++t) rows[t - first] = (table[t / bs] * bs + t % bs) * Hkv + h;
  };
  attend_pools(q, k_pool, v_pool, codes ? k_scale->data_ptr<float>() : nullptr,
               codes ? v_scale->data_ptr<float>() : nullptr, out, Hkv,
               static_cast<float>(scale), static_cast<float>(softcap),
               sinks ? sinks->data_ptr<float>() : nullptr, keys, rows_of);
  return out;
}

// Decode attention over the runtime's contiguous cache (compress.runtime.engine: one
// [B_max, kv_heads, S, D] buffer per layer for keys and one for values, fp32 or bf16), read in
// place through a view keys[:B, :, :L] (or any [B, kv_heads, L, D] view whose positions are
// D contiguous values, as the paged cache's gathered [B, L, kv_heads, D] transposed): row b
// attends to the positions t < L where mask[b, t] (left padding and sliding windows are masked
// out; every row keeps at least one key). The same loops as the paged op, in place of
// scaled_dot_product_attention's one-query path: measured on an AMD EPYC Zen 3, 2 threads, one
// row, through cpu_attention.attend_decode: 9 heads (3 kv) over 128 fp32 keys 24 us against
// SDPA's 31, over 512 bf16 keys 47 against 379; 32 heads (4 kv) over 64 bf16 keys 29 against
// 186, over 512 114 against 1394.
at::Tensor cache_decode_attention(const at::Tensor& q, const at::Tensor& keys,
                                  const at::Tensor& values, const at::Tensor& mask, double scale,
                                  double softcap, const std::optional<at::Tensor>& sinks) {
  check_query(q, sinks);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  TORCH_CHECK(keys.dim() == 4 && keys.sizes() == values.sizes() &&
                  keys.strides() == values.strides() &&
                  keys.scalar_type() == values.scalar_type() &&
                  (keys.scalar_type() == at::kFloat || keys.scalar_type() == at::kBFloat16),
              "keys and values must be fp32 or bf16 [B, kv_heads, L, D] views of one layout");
  const int64_t Hkv = keys.size(1), L = keys.size(2);
  TORCH_CHECK(keys.size(0) == B && keys.size(3) == D && Hkv > 0 && H % Hkv == 0,
              "keys must be [B, kv_heads, L, D] for q [B, heads, D] with heads (", H,
              ") a multiple of kv_heads (", Hkv, ")");
  TORCH_CHECK(keys.stride(3) == 1 && keys.stride(2) % D == 0 && keys.stride(1) % D == 0 &&
                  keys.stride(0) % D == 0,
              "keys and values must hold each position's D values contiguously");
  TORCH_CHECK(mask.dim() == 2 && mask.size(0) == B && mask.size(1) == L &&
                  mask.scalar_type() == at::kBool,
              "mask must be bool [B, L]");
  const bool* mp = mask.data_ptr<bool>();
  const int64_t mb = mask.stride(0), mt = mask.stride(1);
  int64_t kept = 0;
  for (int64_t b = 0; b < B; ++b) {
    int64_t row_kept = 0;
    for (int64_t t = 0; t < L; ++t) row_kept += mp[b * mb + t * mt];
    TORCH_CHECK(row_kept > 0, "row ", b, " of the mask has no key to attend to");
    kept += row_kept;
  }
  auto out = at::empty({B, H, D}, q.options());
  // row indices count positions of D values from the views' first element
  const int64_t sb = keys.stride(0) / D, sh = keys.stride(1) / D, st = keys.stride(2) / D;
  auto rows_of = [&](int64_t b, int64_t h, std::vector<int64_t>& rows) {
    rows.clear();
    const int64_t base = b * sb + h * sh;
    for (int64_t t = 0; t < L; ++t)
      if (mp[b * mb + t * mt]) rows.push_back(base + t * st);
  };
  attend_pools(q, keys, values, nullptr, nullptr, out, Hkv, static_cast<float>(scale),
               static_cast<float>(softcap), sinks ? sinks->data_ptr<float>() : nullptr, kept,
               rows_of);
  return out;
}

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor? k_scale, "
        "Tensor? v_scale, Tensor tables, Tensor lengths, int block_size, float scale, "
        "float softcap, int window, Tensor? sinks=None) -> Tensor");
  m.def("cache_decode_attention(Tensor q, Tensor keys, Tensor values, Tensor mask, float scale, "
        "float softcap, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("paged_decode_attention", &compress_q8::paged_decode_attention);
  m.impl("cache_decode_attention", &compress_q8::cache_decode_attention);
}
