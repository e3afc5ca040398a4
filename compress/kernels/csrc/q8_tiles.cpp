// int4 linears in column tiles (the AVX512-VNNI and AVX2 levels): the arithmetic of q8_dot.cpp
// (activations rounded to int8 per block of 32, exact integer block dots, then scaled) with
// vector lanes that hold W output columns instead of W int32 pieces of one dot product.
//
// Layout (cpu_q8.to_tiles; N a multiple of W = TILE_COLS: 16 at avx512vnni, 8 at avx2): codes
// uint8 [N/W, K/8, 4W], per tile and 8 columns of K one vector whose byte 4c+i holds tile
// column c's codes k = 8j+i (low nibble) and 8j+4+i (high nibble); scales fp32 [N/W, K/group, W].
//
// Why: one vpdpbusd multiplies 4 codes of each of 16 columns by 4 activation bytes broadcast to
// every lane, so a block of 32 takes 8 of them, then one convert and one FMA for all 16
// columns: no horizontal sums, one weight load and one AND for two vpdpbusd, and M rows reuse
// each unpacked weight vector. The high nibbles go in unshifted (16 x the code, AND 0xF0): their
// int32 sum is a multiple of 16 and is shifted right once per block, exactly. A standalone
// prototype ran the 1.1B gate/up shape at the DRAM read bound and 8 rows in 1.4x one row's time
// (docs/notes/2026-12-03-decode-prefetch-and-compute.md).
#include "q8_common.h"

#include <cstring>
#include <utility>

namespace compress_q8 {

#if defined(COMPRESS_AVX512VNNI)
constexpr int64_t TILE = 16;           // output columns per tile
constexpr int64_t TILE_BLOCK = 256;    // bytes of one tile per block of 32 (16 x 32 / 2)
constexpr int64_t TILES_AHEAD = 4096;  // prefetch distance in the tile stream, bytes

// R rows (m0 .. m0 + R - 1) of NT adjacent tiles (the first at `tile`, each `tile_bytes` long):
// y[m, col0 + 16 t + c]. Each activation broadcast feeds NT tiles' vpdpbusd. With SUMS_IN_Y the
// running sum over groups lives in y (loaded and stored once per group), which leaves the
// registers to 2 NT R block accumulators and NT R group sums (16 + 8 at NT = 2, R = 4); without,
// it stays in registers (faster from DRAM at up to 8 rows of one tile, measured, though it
// spills at 8). Either way the same integer dots and float operations in the same order: the
// outputs are the same bit for bit.
template <int NT, int R, bool SUMS_IN_Y>
inline void tile_rows(const RoundedX& x, int64_t m0, const uint8_t* tile, int64_t tile_bytes,
                      const float* ws, int64_t group, float* y, int64_t N, int64_t col0,
                      bool prefetch) {
  const int64_t G = x.G, per_group = group / BLOCK;
  const __m512i low4 = _mm512_set1_epi8(0x0F), high4 = _mm512_set1_epi8(static_cast<char>(0xF0));
  __m512 acc[NT][R];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < NT; ++t) {
      acc[t][r] = _mm512_setzero_ps();
      if constexpr (SUMS_IN_Y) _mm512_storeu_ps(y + (m0 + r) * N + col0 + t * TILE, acc[t][r]);
    }
  }
  for (int64_t j = 0; j < G; ++j) {
    __m512 inner[NT][R];
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < R; ++r) inner[t][r] = _mm512_setzero_ps();
    for (int64_t b = j * per_group; b < (j + 1) * per_group; ++b) {
      if (prefetch)
        for (int t = 0; t < NT; ++t)
          for (int64_t l = 0; l < TILE_BLOCK; l += 64)
            _mm_prefetch(reinterpret_cast<const char*>(tile + t * tile_bytes + b * TILE_BLOCK +
                                                       TILES_AHEAD + l),
                         _MM_HINT_T1);
      __m512i low[NT][R], high[NT][R];
      for (int r = 0; r < R; ++r) {
        const __m512i corr = _mm512_set1_epi32(x.corr[(m0 + r) * x.B + b]);  // -8 x code sum
        for (int t = 0; t < NT; ++t) {
          low[t][r] = corr;
          high[t][r] = _mm512_setzero_si512();
        }
      }
      for (int q = 0; q < 4; ++q) {
        __m512i wl[NT], wh[NT];
        for (int t = 0; t < NT; ++t) {
          const __m512i v = _mm512_loadu_si512(tile + t * tile_bytes + b * TILE_BLOCK + q * 64);
          wl[t] = _mm512_and_si512(v, low4);
          wh[t] = _mm512_and_si512(v, high4);
        }
        for (int r = 0; r < R; ++r) {
          int32_t x0, x1;  // activation bytes k = 8q .. 8q + 3 and 8q + 4 .. 8q + 7 of block b
          const int8_t* xb = x.q.data() + (m0 + r) * x.K + b * BLOCK + q * 8;
          std::memcpy(&x0, xb, 4);
          std::memcpy(&x1, xb + 4, 4);
          const __m512i b0 = _mm512_set1_epi32(x0), b1 = _mm512_set1_epi32(x1);
          for (int t = 0; t < NT; ++t) {
            low[t][r] = _mm512_dpbusd_epi32(low[t][r], wl[t], b0);
            high[t][r] = _mm512_dpbusd_epi32(high[t][r], wh[t], b1);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 xs = _mm512_set1_ps(x.scale[(m0 + r) * x.B + b]);
        for (int t = 0; t < NT; ++t) {
          const __m512i dot = _mm512_add_epi32(low[t][r], _mm512_srai_epi32(high[t][r], 4));
          inner[t][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), xs, inner[t][r]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) {
      const __m512 sw = _mm512_loadu_ps(ws + t * G * TILE + j * TILE);
      for (int r = 0; r < R; ++r) {
        float* out = y + (m0 + r) * N + col0 + t * TILE;
        if constexpr (SUMS_IN_Y)
          _mm512_storeu_ps(out, _mm512_fmadd_ps(inner[t][r], sw, _mm512_loadu_ps(out)));
        else
          acc[t][r] = _mm512_fmadd_ps(inner[t][r], sw, acc[t][r]);
      }
    }
  }
  if constexpr (!SUMS_IN_Y)
    for (int t = 0; t < NT; ++t)
      for (int r = 0; r < R; ++r) _mm512_storeu_ps(y + (m0 + r) * N + col0 + t * TILE, acc[t][r]);
}

// Every row of NT adjacent tiles in steps of up to STEP rows; the tiles' bytes are in L1/L2
// after the first step, which alone prefetches.
template <int NT, int STEP, bool SUMS_IN_Y>
inline void tile_all_rows(const RoundedX& x, int64_t M, const uint8_t* tile, int64_t tile_bytes,
                          const float* ws, int64_t group, float* y, int64_t N, int64_t col0) {
  for (int64_t m0 = 0; m0 < M; m0 += STEP) {
    const bool first = m0 == 0;
    [&]<int... R>(std::integer_sequence<int, R...>) {  // tile_rows<NT, min(STEP, M - m0)>
      const int64_t rows = std::min<int64_t>(STEP, M - m0);
      ((rows == R + 1 ? tile_rows<NT, R + 1, SUMS_IN_Y>(x, m0, tile, tile_bytes, ws, group, y,
                                                        N, col0, first)
                      : void()),
       ...);
    }(std::make_integer_sequence<int, STEP>{});
  }
}
#endif

#if defined(COMPRESS_AVX2)
// The AVX2 form (8 columns a tile). No vpdpbusd: vpmaddubsw multiplies the unsigned codes by
// the activation bytes broadcast to every lane and adds pairs into int16, so each 32-bit lane
// holds two int16 partial sums of its column. A block's eight products add up in int16 without
// overflow (|pair| <= 2 x 15 x 127 = 3810, 8 x 3810 = 30480 < 32767: codes 0..15, activations
// -127..127), then one vpmaddwd by ones gives the column's int32 block dot. The high nibbles
// are shifted down (16 x a code would saturate the int16 pairs). Per 256 codes: 4 loads,
// 12 unpacking ops, 8 vpmaddubsw, 8 int16 adds and 4 per-block ops, against about twice the
// vector work of the row layout's one-column dots (q8_dot.cpp, which also ends every column
// in a horizontal sum); measured in docs/notes/2026-12-07-avx2-column-tiles.md.
constexpr int64_t TILE = TILE_COLS;   // 8
constexpr int64_t TILE_BLOCK = 128;   // bytes of one tile per block of 32 (8 x 32 / 2)
constexpr int64_t TILES_AHEAD = 4096; // prefetch distance in the tile stream, bytes

// An empty asm that claims to read and rewrite v in a vector register. Why: without it GCC 12
// reassociates a block's eight int16 adds per row into an add tree that keeps every product
// live, more than the 16 ymm registers hold, and spills them to the stack (34 spill stores a
// block of 4 rows); with it each add is one instruction on one running sum in a register. The
// same arithmetic (int16 adds wrap, so any order gives the same sums). Measured in one process,
// the two forms taking turns 60 times (a standalone copy of this loop, SmolLM2's 256 x 576 x
// 1536 and 256 x 1536 x 576, one thread, Zen 3): 68.8 and 71.9 GMAC/s against 51.6 and 55.3.
// With the row blocks and claims below and the pairs of tiles from 20 rows, SmolLM2's layers
// at 16-256 rows ran 1.23-1.47x the earlier op, the 1.1B shape's 1.26-1.44x, decode level
// (scripts/bench_ops_ab.py --op tiles --shape smollm2|1b, docs/notes/
// 2026-12-07-avx2-tile-registers.md).
inline void in_register(__m256i& v) { asm volatile("" : "+x"(v)); }

// 4 bytes (activation codes) in every 32-bit lane
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// R rows (m0 .. m0 + R - 1) of one tile: y[m, col0 .. col0 + 7]. The running sum over groups
// lives in y (loaded and stored once per group), leaving the 16 registers to R int16 block
// sums, R block-scaled sums, the two unpacked weight vectors and the broadcasts.
template <int R>
inline void tile_rows8(const RoundedX& x, int64_t m0, const uint8_t* tile, const float* ws,
                       int64_t group, float* y, int64_t N, int64_t col0, bool prefetch) {
  const int64_t G = x.G, per_group = group / BLOCK;
  const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const int8_t* xrow[R];  // each row's activation codes
  for (int r = 0; r < R; ++r) {
    xrow[r] = x.q.data() + (m0 + r) * x.K;
    _mm256_storeu_ps(y + (m0 + r) * N + col0, _mm256_setzero_ps());
  }
  for (int64_t j = 0; j < G; ++j) {
    __m256 inner[R];
    for (int r = 0; r < R; ++r) inner[r] = _mm256_setzero_ps();
    for (int64_t b = j * per_group; b < (j + 1) * per_group; ++b) {
      if (prefetch)
        for (int64_t l = 0; l < TILE_BLOCK; l += 64)
          _mm_prefetch(reinterpret_cast<const char*>(tile + b * TILE_BLOCK + TILES_AHEAD + l),
                       _MM_HINT_T1);
      __m256i sum16[R];
      for (int r = 0; r < R; ++r) sum16[r] = _mm256_setzero_si256();
      // unrolled by hand-set pragmas: the asm in in_register keeps GCC from unrolling on its own
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i v =
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + b * TILE_BLOCK + q * 32));
        const __m256i wl = _mm256_and_si256(v, low4);
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          // activation bytes k = 8q .. 8q + 3 and 8q + 4 .. 8q + 7 of block b
          const int8_t* xb = xrow[r] + b * BLOCK + q * 8;
          sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(wl, broadcast4(xb)));
          in_register(sum16[r]);
          sum16[r] = _mm256_add_epi16(sum16[r], _mm256_maddubs_epi16(wh, broadcast4(xb + 4)));
          in_register(sum16[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const int64_t i = (m0 + r) * x.B + b;
        const __m256i dot = _mm256_add_epi32(_mm256_madd_epi16(sum16[r], ones),
                                             _mm256_set1_epi32(x.corr[i]));  // -8 x code sum
        inner[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(x.scale[i]), inner[r]);
      }
    }
    const __m256 sw = _mm256_loadu_ps(ws + j * TILE);
    for (int r = 0; r < R; ++r) {
      float* out = y + (m0 + r) * N + col0;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(inner[r], sw, _mm256_loadu_ps(out)));
    }
  }
}

// From PAIR_MIN_ROWS rows (prompts) the tiles go in pairs, their nibbles unpacked once per block
// of rows into a per-thread buffer (unpack_tile), and each activation broadcast feeds both
// tiles' maddubs, whose weight operands come from that buffer as they are: per 32 products one
// maddubs, one add and half a broadcast, against one maddubs, one add, one broadcast and the
// unpacking's share in tile_rows8. Each block's sums start at the block's correction in the
// low int16 of each lane (corr_low), which the final vpmaddwd adds in. Exact: a lane's low half
// covers 16 of the block's 32 products and ends at sum over those of (code - 8) x a minus 8 x
// the other 16 activations, |.| <= 16 x 8 x 127 + 8 x 16 x 127 = 32512, inside int16, so the
// wrapping int16 adds give it exactly (maddubs' pairs, <= 3810, never saturate). Measured in a
// standalone copy, both forms in turns (Zen 3, one thread, 64 and 256 rows, SmolLM2's shapes):
// 65-81 against 50-65 GMAC/s.
constexpr int64_t PAIR_MIN_ROWS = 20;
constexpr int64_t UNPACKED_BLOCK = 256;  // bytes of one unpacked tile per block of 32

// One tile's codes [K/8, 32] -> per block and step of 8 columns of K, the low nibbles' 32
// bytes, then the high ones': the vectors tile_rows8 makes with its AND and shift.
inline void unpack_tile(const uint8_t* tile, int64_t K, uint8_t* out) {
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  for (int64_t s = 0; s < K / 8; ++s) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + s * 32));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + s * 64), _mm256_and_si256(v, low4));
    _mm256_store_si256(reinterpret_cast<__m256i*>(out + s * 64 + 32),
                       _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  }
}

// R rows (m0 .. m0 + R - 1) of two adjacent tiles, unpacked (u0, u1) with their scales (ws0,
// ws1): y[m, col0 .. col0 + 15]. Registers: 2R int16 sums, 2R block-scaled sums, the two
// broadcasts and the ones (15 at R = 3).
template <int R>
inline void tile_pair_rows8(const RoundedX& x, const int32_t* corr_low, int64_t m0,
                            const uint8_t* u0, const uint8_t* u1, const float* ws0,
                            const float* ws1, int64_t group, float* y, int64_t N, int64_t col0) {
  const int64_t G = x.G, per_group = group / BLOCK;
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* xrow[R];
  for (int r = 0; r < R; ++r) {
    xrow[r] = x.q.data() + (m0 + r) * x.K;
    _mm256_storeu_ps(y + (m0 + r) * N + col0, _mm256_setzero_ps());
    _mm256_storeu_ps(y + (m0 + r) * N + col0 + TILE, _mm256_setzero_ps());
  }
  for (int64_t j = 0; j < G; ++j) {
    __m256 inner0[R], inner1[R];
    for (int r = 0; r < R; ++r) inner0[r] = inner1[r] = _mm256_setzero_ps();
    for (int64_t b = j * per_group; b < (j + 1) * per_group; ++b) {
      __m256i sum0[R], sum1[R];
      for (int r = 0; r < R; ++r)
        sum0[r] = sum1[r] = _mm256_set1_epi32(corr_low[(m0 + r) * x.B + b]);
#pragma GCC unroll 4
      for (int q = 0; q < 4; ++q) {
        const __m256i* w0 = reinterpret_cast<const __m256i*>(u0 + b * UNPACKED_BLOCK + q * 64);
        const __m256i* w1 = reinterpret_cast<const __m256i*>(u1 + b * UNPACKED_BLOCK + q * 64);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          // activation bytes k = 8q .. 8q + 3 and 8q + 4 .. 8q + 7 of block b
          const int8_t* xb = xrow[r] + b * BLOCK + q * 8;
          const __m256i b0 = broadcast4(xb), b1 = broadcast4(xb + 4);
          sum0[r] = _mm256_add_epi16(sum0[r], _mm256_maddubs_epi16(_mm256_load_si256(w0), b0));
          in_register(sum0[r]);
          sum1[r] = _mm256_add_epi16(sum1[r], _mm256_maddubs_epi16(_mm256_load_si256(w1), b0));
          in_register(sum1[r]);
          sum0[r] = _mm256_add_epi16(sum0[r], _mm256_maddubs_epi16(_mm256_load_si256(w0 + 1), b1));
          in_register(sum0[r]);
          sum1[r] = _mm256_add_epi16(sum1[r], _mm256_maddubs_epi16(_mm256_load_si256(w1 + 1), b1));
          in_register(sum1[r]);
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m256 xs = _mm256_set1_ps(x.scale[(m0 + r) * x.B + b]);
        inner0[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum0[r], ones)), xs,
                                    inner0[r]);
        inner1[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(sum1[r], ones)), xs,
                                    inner1[r]);
      }
    }
    const __m256 sw0 = _mm256_loadu_ps(ws0 + j * TILE), sw1 = _mm256_loadu_ps(ws1 + j * TILE);
    for (int r = 0; r < R; ++r) {
      float* out = y + (m0 + r) * N + col0;
      _mm256_storeu_ps(out, _mm256_fmadd_ps(inner0[r], sw0, _mm256_loadu_ps(out)));
      _mm256_storeu_ps(out + TILE, _mm256_fmadd_ps(inner1[r], sw1, _mm256_loadu_ps(out + TILE)));
    }
  }
}
#endif

#if defined(COMPRESS_AVX512VNNI) || defined(COMPRESS_AVX2)
// Work units (tiles or pairs of `unit_weights` weights) per claim for M rows: ~128K weights
// for one pass of up to 4 rows, so a decode call under that stays on the calling thread and a
// prompt's call is claimed in runs of about the same work. Why: with 128K weights whatever M,
// 256 rows over SmolLM2's 1536 x 576 gate/up made 7 runs of 28 tiles on 2 threads, one of them
// doing 4 runs and the other 3 (measured 2 threads at 1.5x one before this, on Zen 3).
// At least 64 output columns a claim: the threads' runs meet at one cache line of y each,
// not at every tile (8 columns at avx2 are half a line, written once per group).
inline int64_t claim_grain(int64_t unit_weights, int64_t unit_columns, int64_t M) {
  const int64_t passes = std::max<int64_t>(1, (M + 3) / 4);
  return std::max<int64_t>(64 / unit_columns, (int64_t{1} << 17) / (unit_weights * passes));
}

// y [M, N] (without the offsets' term) from every tile for every row of ``rx``, by this
// level's loops
inline void tiles_all_rows(const RoundedX& rx, const TilesArgs& args, const uint8_t* cp,
                           const float* sp, int64_t group, float* yp) {
  const int64_t M = args.M, K = args.K, G = args.G, T = args.T, N = args.N;
  const int64_t tile_bytes = K * TILE / 2;
#if defined(COMPRESS_AVX512VNNI)
  // Up to 8 rows (decode), one tile at a time and all rows in one pass: each weight byte comes
  // from DRAM once, while the arithmetic runs. From 9 rows, pairs of tiles, 4 rows a pass, an
  // odd last tile alone: half the activation broadcasts per vpdpbusd. Measured on a Zen 5 EPYC
  // (docs/notes/2026-12-05-tile-pairs.md), L2-resident weights, one thread: 6.1 G vpdpbusd/s for
  // pairs of 4 rows against 4.8 for one tile of 8 rows (peak 8.8); from DRAM, pairs ran 128 rows
  // 1.3x faster but 8 rows 0.96x (two passes, the second one's arithmetic not overlapping the
  // first one's reads).
  const bool pairs = M > 8;
  const int64_t units = pairs ? (T + 1) / 2 : T, per_unit = pairs ? 2 : 1;
  // as q8_dot.cpp's decode: units under ~128K weights a thread stay on the calling thread; a
  // claim of tiles is that many weights for one pass of up to 4 rows (claim_grain)
  const int64_t grain = claim_grain(K * per_unit * TILE, per_unit * TILE, M);
  parallel_claims(units, grain, [&](Claims& claims) {
    for (int64_t u0, u1; claims.take(u0, u1);)
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t t = u * per_unit;
        const uint8_t* tile = cp + t * tile_bytes;
        const float* ws = sp + t * G * TILE;
        if (!pairs)
          tile_all_rows<1, 8, false>(rx, M, tile, tile_bytes, ws, group, yp, N, t * TILE);
        else if (t + 1 < T)
          tile_all_rows<2, 4, true>(rx, M, tile, tile_bytes, ws, group, yp, N, t * TILE);
        else
          tile_all_rows<1, 4, true>(rx, M, tile, tile_bytes, ws, group, yp, N, t * TILE);
      }
  });
#else
  // A claim's tiles take the rows in blocks whose int8 activations (rows x K bytes) stay near
  // 128 KB, so they are read from L2 by every tile of the claim, not from L3 (256 rows x K = 1536
  // are 384 KB, Zen 3's L2 512 KB).
  const int64_t row_block = std::max<int64_t>(4, ((int64_t{1} << 17) / K) / 4 * 4);
  // one tile for the rows [b0, b1), 4 at a time (the tile is in L1/L2 after the first 4, which
  // alone prefetch)
  auto single = [&](int64_t t, int64_t b0, int64_t b1) {
    const uint8_t* tile = cp + t * tile_bytes;
    const float* ws = sp + t * G * TILE;
    for (int64_t m0 = b0; m0 < b1; m0 += 4) {
      const bool first = m0 == 0;
      switch (std::min<int64_t>(4, b1 - m0)) {
        case 1: tile_rows8<1>(rx, m0, tile, ws, group, yp, N, t * TILE, first); break;
        case 2: tile_rows8<2>(rx, m0, tile, ws, group, yp, N, t * TILE, first); break;
        case 3: tile_rows8<3>(rx, m0, tile, ws, group, yp, N, t * TILE, first); break;
        default: tile_rows8<4>(rx, m0, tile, ws, group, yp, N, t * TILE, first); break;
      }
    }
  };
  if (M < PAIR_MIN_ROWS) {
    // tiles under ~128K weights a thread stay on the calling thread, as in q8_dot.cpp, a claim
    // being that many weights for one pass of up to 4 rows (claim_grain)
    parallel_claims(T, claim_grain(K * TILE, TILE, M), [&](Claims& claims) {
      for (int64_t t0, t1; claims.take(t0, t1);)
        for (int64_t t = t0; t < t1; ++t) single(t, 0, M);
    });
    return;
  }
  // pairs of tiles (tile_pair_rows8), an odd last tile alone
  aligned_vector<int32_t> corr_low(rx.corr.size());
  for (size_t i = 0; i < corr_low.size(); ++i)
    corr_low[i] = static_cast<int32_t>(static_cast<uint16_t>(rx.corr[i]));
  const int64_t pairs = (T + 1) / 2;
  parallel_claims(pairs, claim_grain(K * 2 * TILE, 2 * TILE, M), [&](Claims& claims) {
    aligned_vector<uint8_t> unpacked(2 * (K / BLOCK) * UNPACKED_BLOCK);
    uint8_t* u0 = unpacked.data();
    uint8_t* u1 = u0 + (K / BLOCK) * UNPACKED_BLOCK;
    for (int64_t p0, p1; claims.take(p0, p1);)
      for (int64_t b0 = 0; b0 < M; b0 += row_block) {
        const int64_t b1 = std::min(M, b0 + row_block);
        for (int64_t p = p0; p < p1; ++p) {
          const int64_t t = 2 * p;
          if (t + 1 == T) {
            single(t, b0, b1);
            continue;
          }
          unpack_tile(cp + t * tile_bytes, K, u0);
          unpack_tile(cp + (t + 1) * tile_bytes, K, u1);
          const float *ws0 = sp + t * G * TILE, *ws1 = ws0 + G * TILE;
          int64_t m0 = b0;
          for (; m0 + 3 <= b1; m0 += 3)
            tile_pair_rows8<3>(rx, corr_low.data(), m0, u0, u1, ws0, ws1, group, yp, N, t * TILE);
          if (b1 - m0 == 2)
            tile_pair_rows8<2>(rx, corr_low.data(), m0, u0, u1, ws0, ws1, group, yp, N, t * TILE);
          else if (b1 - m0 == 1)
            tile_pair_rows8<1>(rx, corr_low.data(), m0, u0, u1, ws0, ws1, group, yp, N, t * TILE);
        }
      }
  });
#endif
}
#endif

at::Tensor int4_linear_q8_tiles(const at::Tensor& x, const at::Tensor& codes,
                                const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                                int64_t group) {
#if defined(COMPRESS_AVX512VNNI) || defined(COMPRESS_AVX2)
  const TilesArgs args = check_tiles_args("int4_linear_q8_tiles", x, codes, scales, offsets, group);
  const RoundedX rx = round_x(x.data_ptr<float>(), args.M, args.K, group, 8, args.with_offsets);
  at::Tensor y = at::empty({args.M, args.N}, x.options());
  tiles_all_rows(rx, args, codes.data_ptr<uint8_t>(), scales.data_ptr<float>(), group,
                 y.data_ptr<float>());
  if (args.with_offsets) {
    const at::Tensor xsum =
        at::from_blob(const_cast<float*>(rx.xsum.data()), {args.M, args.G}, x.options());
    y.addmm_(xsum, offsets->t());
  }
  return y;
#else
  TORCH_CHECK(false, "int4_linear_q8_tiles runs at the avx512vnni and avx2 levels only");
  return at::Tensor();
#endif
}

// The codes between the row layout (q8_dot.cpp: byte 32p + i of a row holds columns 64p + i
// and 64p + 32 + i) and tiles of `width` columns (16 or 8), both ways (plain loops, every level;
// cpu_q8.to_tiles_reference is the torch definition). Step j of a tile takes row bytes b0 ..
// b0 + 7, b0 = 32 (j / 8) + 8 (j % 4), their low nibbles for j % 8 < 4, else their high ones.
at::Tensor int4_to_tiles(const at::Tensor& rows, int64_t width) {
  TORCH_CHECK(width == 8 || width == 16, "int4_to_tiles: width must be 8 or 16, not ", width);
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous() &&
                  rows.size(0) % width == 0 && (rows.size(1) * 2) % PAIR == 0,
              "int4_to_tiles: codes must be contiguous uint8 [N, K/2], N a multiple of ", width);
  const int64_t N = rows.size(0), half = rows.size(1), K = half * 2, T = N / width;
  at::Tensor out = at::empty({T, K / 8, 4 * width}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < width; ++c) {
        const uint8_t* row = src + (t * width + c) * half;
        for (int64_t j = 0; j < K / 8; ++j) {
          const uint8_t* b = row + 32 * (j / 8) + 8 * (j % 4);
          uint8_t* o = dst + (t * (K / 8) + j) * 4 * width + 4 * c;
          const bool high = j % 8 >= 4;
          for (int i = 0; i < 4; ++i)
            o[i] = high ? static_cast<uint8_t>((b[i] >> 4) | (b[4 + i] & 0xF0))
                        : static_cast<uint8_t>((b[i] & 0x0F) | (b[4 + i] << 4));
        }
      }
  });
  return out;
}

// the tile width from the layout: codes [N/W, K/8, 4W]
inline int64_t checked_tile_width(const char* what, const at::Tensor& tiles) {
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  (tiles.size(2) == 64 || tiles.size(2) == 32) &&
                  (tiles.size(1) * 8) % PAIR == 0,
              what, ": codes must be contiguous uint8 [N/W, K/8, 4W], W 16 or 8");
  return tiles.size(2) / 4;
}

at::Tensor int4_from_tiles(const at::Tensor& tiles) {
  const int64_t width = checked_tile_width("int4_from_tiles", tiles);
  const int64_t T = tiles.size(0), K = tiles.size(1) * 8, half = K / 2;
  at::Tensor out = at::empty({T * width, half}, tiles.options());
  const uint8_t* src = tiles.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < width; ++c) {
        uint8_t* row = dst + (t * width + c) * half;
        for (int64_t j = 0; j < K / 8; ++j) {
          if (j % 8 >= 4) continue;  // each low step j writes its bytes with step j + 4's nibbles
          const uint8_t* lo = src + (t * (K / 8) + j) * 4 * width + 4 * c;
          const uint8_t* hi = lo + 4 * 4 * width;
          uint8_t* b = row + 32 * (j / 8) + 8 * (j % 4);
          for (int i = 0; i < 4; ++i) {
            b[i] = static_cast<uint8_t>((lo[i] & 0x0F) | (hi[i] << 4));
            b[4 + i] = static_cast<uint8_t>((lo[i] >> 4) | (hi[i] & 0xF0));
          }
        }
      }
  });
  return out;
}

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("int4_linear_q8_tiles(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
  m.def("int4_to_tiles(Tensor codes, int width) -> Tensor");
  m.def("int4_from_tiles(Tensor tiles) -> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("int4_linear_q8_tiles", &compress_q8::int4_linear_q8_tiles);
  m.impl("int4_to_tiles", &compress_q8::int4_to_tiles);
  m.impl("int4_from_tiles", &compress_q8::int4_from_tiles);
}
