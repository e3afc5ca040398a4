// Prefill for the integer-dot linears: the arithmetic of q8_dot.cpp (activations rounded to int8
// per block of 32, exact integer block dots, then scaled), laid out for many rows. The decode
// loops reuse a weight for at most four rows and reduce each output across vector lanes; here
// the lanes hold 8 or 16 rows of one column, so a weight's four bytes are broadcast once and
// multiplied into every row with one vpdpbusd (or maddubs + madd on AVX2), with no reductions.
// Same integers as the decode loops, so the outputs differ from them only in fp32 summation
// order (the float64 model is cpu_q8.linear_q8_reference for both).
//
// Activations are re-laid once per call as [row tiles][K/4][LANES][4] bytes with their block
// scales and bias corrections as [row tiles][blocks][LANES] (rows past M are zero and dropped).
// Weights are read per column: int4 nibbles are unpacked (and, for AVX2 int8, the biased codes
// turned signed) into a small per-thread buffer of CHUNK columns, then every row tile runs over
// them while they sit in L1/L2.
#include "q8_common.h"

#include <cstring>

namespace compress_q8 {
namespace {

#if defined(COMPRESS_AVX512VNNI)
constexpr int LANES = 16;
constexpr int ROW_TILES = 2;  // 2 x 4 x (int32, partial fp32, fp32) accumulators: 24 of 32 zmm
using vi = __m512i;
using vf = __m512;
inline vi load_i(const void* p) { return _mm512_loadu_si512(p); }
inline vf load_f(const float* p) { return _mm512_loadu_ps(p); }
inline void store_f(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vi bcst(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline vf bcst_f(float v) { return _mm512_set1_ps(v); }
inline vf zero_f() { return _mm512_setzero_ps(); }
inline vf cvt(vi v) { return _mm512_cvtepi32_ps(v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
template <bool Q4>
inline vi dot4(vi acc, vi w, vi x) { return _mm512_dpbusd_epi32(acc, w, x); }
#else
constexpr int LANES = 8;
constexpr int ROW_TILES = 1;  // 16 ymm registers: 4 int32 + 4 fp32 accumulators and temporaries
using vi = __m256i;
using vf = __m256;
inline vi load_i(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline vf load_f(const float* p) { return _mm256_loadu_ps(p); }
inline void store_f(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vi bcst(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline vf bcst_f(float v) { return _mm256_set1_ps(v); }
inline vf zero_f() { return _mm256_setzero_ps(); }
inline vf cvt(vi v) { return _mm256_cvtepi32_ps(v); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
template <bool Q4>
inline vi dot4(vi acc, vi w, vi x) {
#if defined(COMPRESS_AVXVNNI)
  return _mm256_dpbusd_avx_epi32(acc, w, x);
#else
  const __m256i ones = _mm256_set1_epi16(1);
  if constexpr (Q4)  // codes 0..15: maddubs' int16 pairs cannot saturate
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), ones));
  else  // signed codes (see prepare_columns): |w| . sign(x, w), as the decode loop does
    return _mm256_add_epi32(
        acc, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w)),
                               ones));
#endif
}
#endif

// AVX2 int4: maddubs pairs are at most 2 * 15 * 127 = 3810, so a block's 8 steps add up in
// int16 lanes (8 * 3810 < 32767) and widen to int32 once per block, not once per step.
#if defined(COMPRESS_AVX2)
template <bool Q4>
constexpr bool INT16_BLOCKS = Q4;
inline vi add16(vi acc, vi w, vi x) { return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, x)); }
inline vi widen(vi acc16, vi start) {
  return _mm256_add_epi32(start, _mm256_madd_epi16(acc16, _mm256_set1_epi16(1)));
}
#else
template <bool Q4>
constexpr bool INT16_BLOCKS = false;
inline vi add16(vi acc, vi, vi) { return acc; }
inline vi widen(vi acc, vi) { return acc; }
#endif

constexpr int CHUNK = 4;  // output columns per step (their weights broadcast, rows in lanes)

struct RowTiles {
  int64_t T, K4, B;
  aligned_vector<int8_t> q;       // [T, K/4, LANES, 4]
  aligned_vector<float> scale;    // [T, B, LANES]
  aligned_vector<int32_t> corr;   // [T, B, LANES]
};

RowTiles tile_rows(const RoundedX& x) {
  RowTiles r{(x.M + LANES - 1) / LANES, x.K / 4, x.B};
  r.q.assign(r.T * r.K4 * LANES * 4, 0);
  r.scale.assign(r.T * r.B * LANES, 0.f);
  r.corr.assign(r.T * r.B * LANES, 0);
  at::parallel_for(0, x.M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t t = m / LANES, lane = m % LANES;
      const int8_t* src = x.q.data() + m * x.K;
      int8_t* dst = r.q.data() + (t * r.K4 * LANES + lane) * 4;
      for (int64_t k4 = 0; k4 < r.K4; ++k4) std::memcpy(dst + k4 * LANES * 4, src + 4 * k4, 4);
      for (int64_t b = 0; b < x.B; ++b) {
        r.scale[(t * r.B + b) * LANES + lane] = x.scale[m * x.B + b];
        r.corr[(t * r.B + b) * LANES + lane] = x.corr[m * x.B + b];
      }
    }
  });
  return r;
}

// Columns [n, n + count) as the dot products take them, K bytes each: int4 nibbles unpacked
// to 0..15; int8 biased codes as they are, or (AVX2) made signed. Returns a pointer per column.
template <bool Q4>
void prepare_columns(const uint8_t* codes, int64_t K, int64_t n, int count, uint8_t* buf,
                     const uint8_t** cols) {
  for (int c = 0; c < count; ++c) {
    const uint8_t* row = codes + (n + c) * (Q4 ? K / 2 : K);
    if constexpr (Q4) {
      uint8_t* out = buf + c * K;
      for (int64_t p = 0; p < K / PAIR; ++p)
        for (int i = 0; i < BLOCK; ++i) {
          const uint8_t v = row[p * BLOCK + i];
          out[p * PAIR + i] = v & 0xF;
          out[p * PAIR + BLOCK + i] = v >> 4;
        }
      cols[c] = out;
    } else {
#if defined(COMPRESS_AVX2)
      uint8_t* out = buf + c * K;
      for (int64_t k = 0; k < K; ++k) out[k] = row[k] ^ 0x80;
      cols[c] = out;
#else
      cols[c] = row;
#endif
    }
  }
}

// Where a tile's outputs go: y [M, N] row-major, columns n.. of this chunk.
struct Out {
  float* y;
  int64_t M, N, n;
};

// C accumulators (C columns x LANES rows) into y's rows m0..: four columns are transposed in
// registers (per 128-bit lane, row 4j+i's four columns become one 16-byte store); a lone
// column goes lane by lane. Rows past M (the last tile's padding) are not written.
template <int C>
inline void store_tile(const Out& o, int64_t m0, const vf* acc) {
  alignas(64) float buf[4][LANES];
  const int64_t valid = std::min<int64_t>(LANES, o.M - m0);
  if constexpr (C == 4) {
#if defined(COMPRESS_AVX512VNNI)
    const vf t0 = _mm512_unpacklo_ps(acc[0], acc[1]), t1 = _mm512_unpackhi_ps(acc[0], acc[1]);
    const vf t2 = _mm512_unpacklo_ps(acc[2], acc[3]), t3 = _mm512_unpackhi_ps(acc[2], acc[3]);
    _mm512_store_ps(buf[0], _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_store_ps(buf[1], _mm512_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm512_store_ps(buf[2], _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm512_store_ps(buf[3], _mm512_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)));
#else
    const vf t0 = _mm256_unpacklo_ps(acc[0], acc[1]), t1 = _mm256_unpackhi_ps(acc[0], acc[1]);
    const vf t2 = _mm256_unpacklo_ps(acc[2], acc[3]), t3 = _mm256_unpackhi_ps(acc[2], acc[3]);
    _mm256_store_ps(buf[0], _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_store_ps(buf[1], _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)));
    _mm256_store_ps(buf[2], _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)));
    _mm256_store_ps(buf[3], _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)));
#endif
    for (int64_t l = 0; l < valid; ++l)  // row 4j + i sits in buf[i][4j .. 4j + 3]
      std::memcpy(o.y + (m0 + l) * o.N + o.n, &buf[l % 4][(l / 4) * 4], 4 * sizeof(float));
  } else {
    for (int c = 0; c < C; ++c) store_f(buf[c], acc[c]);
    for (int64_t l = 0; l < valid; ++l)
      for (int c = 0; c < C; ++c) o.y[(m0 + l) * o.N + o.n + c] = buf[c][l];
  }
}

// RT row tiles x C columns: per block of 32, 8 steps of (one x load per tile, one weight
// broadcast per column, RT * C dot4), then a convert and an FMA with the rows' block scales per
// accumulator; the weight scale once per group.
//
// The block loop is a do-while (x.B >= 1) and its 8 steps a loop of constant count, unrolled.
// Why: with `for (k4 = 8 b; k4 < 8 (b + 1); ...)` GCC 12 at -O3 kept each step's integer
// accumulators on the stack, a store and a reload per column per step (its loop peeling keeps
// values in memory for a loop that may not run; scripts/check_loop_stack_stores.py lists such
// loops). Same arithmetic, outputs bit for bit; at avx2 (Zen 3, 2 threads, SmolLM2's layers,
// scripts/bench_ops_ab.py --op int8|int4 --isa avx2 --shape smollm2 --base 5d69b74) int8
// ran 1.12x / 1.27x / 1.23x at 8 / 32 / 256 rows, int4 1.71x / 2.05x / 2.00x.
template <bool Q4, int RT, int C>
inline void tile(const RowTiles& x, int64_t t0, const uint8_t* const* cols,
                 const float* const* ws, const int32_t* gidx, const Out& out) {
  static_assert(C == 1 || C == 4, "store_tile takes one or four columns");
  vf acc[RT][C], part[RT][C];
  for (int r = 0; r < RT; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = part[r][c] = zero_f();
  int64_t b = 0;
  do {
    vi iacc[RT][C], start[RT];
    for (int r = 0; r < RT; ++r) {
      start[r] = load_i(x.corr.data() + ((t0 + r) * x.B + b) * LANES);
      for (int c = 0; c < C; ++c) iacc[r][c] = INT16_BLOCKS<Q4> ? vi{} : start[r];
    }
#pragma GCC unroll 8
    for (int step = 0; step < BLOCK / 4; ++step) {
      const int64_t k4 = b * (BLOCK / 4) + step;
      vi xv[RT];
      for (int r = 0; r < RT; ++r) xv[r] = load_i(x.q.data() + ((t0 + r) * x.K4 + k4) * LANES * 4);
      for (int c = 0; c < C; ++c) {
        const vi w = bcst(cols[c] + k4 * 4);
        for (int r = 0; r < RT; ++r)
          iacc[r][c] = INT16_BLOCKS<Q4> ? add16(iacc[r][c], w, xv[r])
                                        : dot4<Q4>(iacc[r][c], w, xv[r]);
      }
    }
    if constexpr (INT16_BLOCKS<Q4>)
      for (int r = 0; r < RT; ++r)
        for (int c = 0; c < C; ++c) iacc[r][c] = widen(iacc[r][c], start[r]);
    for (int r = 0; r < RT; ++r) {
      const vf sx = load_f(x.scale.data() + ((t0 + r) * x.B + b) * LANES);
      for (int c = 0; c < C; ++c) part[r][c] = fmadd(cvt(iacc[r][c]), sx, part[r][c]);
    }
    const int32_t j = gidx[b];
    if (b + 1 == x.B || gidx[b + 1] != j) {  // the group ends: its weight scale, once
      for (int c = 0; c < C; ++c) {
        const vf sw = bcst_f(ws[c][j]);
        for (int r = 0; r < RT; ++r) {
          acc[r][c] = fmadd(part[r][c], sw, acc[r][c]);
          part[r][c] = zero_f();
        }
      }
    }
  } while (++b < x.B);
  for (int r = 0; r < RT; ++r) store_tile<C>(out, (t0 + r) * LANES, acc[r]);
}

template <bool Q4, int C>
inline void columns(const RowTiles& x, const uint8_t* const* cols, const float* const* ws,
                    const int32_t* gidx, const Out& out) {
  int64_t t = 0;
  for (; t + ROW_TILES <= x.T; t += ROW_TILES) tile<Q4, ROW_TILES, C>(x, t, cols, ws, gidx, out);
  for (; t < x.T; ++t) tile<Q4, 1, C>(x, t, cols, ws, gidx, out);
}

}  // namespace

template <bool Q4>
at::Tensor gemm_q8(const RoundedX& x, const uint8_t* codes, const float* scales, int64_t N,
                   int64_t group) {
  const RowTiles rt = tile_rows(x);
  const int64_t G = x.G, K = x.K, row_bytes = Q4 ? K / 2 : K;
  std::vector<int32_t> gidx(x.B);
  for (int64_t b = 0; b < x.B; ++b) gidx[b] = static_cast<int32_t>(b * BLOCK / group);
  at::Tensor y = at::empty({x.M, N}, at::TensorOptions().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  // Column chunks spread over threads; each thread unpacks its own CHUNK columns at a time.
  at::parallel_for(0, (N + CHUNK - 1) / CHUNK, 1, [&](int64_t c0, int64_t c1) {
    aligned_vector<uint8_t> buf(CHUNK * K);
    const uint8_t* cols[CHUNK];
    const float* ws[CHUNK];
    for (int64_t chunk = c0; chunk < c1; ++chunk) {
      const int64_t n = chunk * CHUNK;
      const int count = static_cast<int>(std::min<int64_t>(CHUNK, N - n));
      // The next chunk's codes while this one computes: int8 columns are read in place, four
      // rows K apart, and at a few row tiles the loads stalled on them (measured on a Xeon:
      // int8 at 32 rows ran at 60% of int4's speed, whose columns are unpacked first).
      const int64_t next = std::min<int64_t>(N, n + 2 * CHUNK);
      const char* ahead = reinterpret_cast<const char*>(codes + (n + CHUNK) * row_bytes);
      for (int64_t i = 0; i < (next - std::min(N, n + CHUNK)) * row_bytes; i += 64)
        _mm_prefetch(ahead + i, _MM_HINT_T0);
      prepare_columns<Q4>(codes, K, n, count, buf.data(), cols);
      for (int c = 0; c < count; ++c) ws[c] = scales + (n + c) * G;
      if (count == CHUNK) {
        columns<Q4, CHUNK>(rt, cols, ws, gidx.data(), Out{yp, x.M, N, n});
      } else {
        for (int c = 0; c < count; ++c)
          columns<Q4, 1>(rt, cols + c, ws + c, gidx.data(), Out{yp, x.M, N, n + c});
      }
    }
  });
  return y;
}

template at::Tensor gemm_q8<true>(const RoundedX&, const uint8_t*, const float*, int64_t, int64_t);
template at::Tensor gemm_q8<false>(const RoundedX&, const uint8_t*, const float*, int64_t, int64_t);

}  // namespace compress_q8
