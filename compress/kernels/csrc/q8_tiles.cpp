// int4 linears in column tiles (AVX512-VNNI level only): the arithmetic of q8_dot.cpp
// (activations rounded to int8 per block of 32, exact integer block dots, then scaled) with
// vector lanes that hold 16 output columns instead of 16 int32 pieces of one dot product.
//
// Layout (cpu_q8.to_tiles; N a multiple of 16): codes uint8 [N/16, K/8, 64], per tile and 8
// columns of K one 64-byte vector whose byte 4c+i holds tile column c's codes k = 8j+i (low
// nibble) and 8j+4+i (high nibble); scales fp32 [N/16, K/group, 16].
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

at::Tensor int4_linear_q8_tiles(const at::Tensor& x, const at::Tensor& codes,
                                const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                                int64_t group) {
#if defined(COMPRESS_AVX512VNNI)
  const char* what = "int4_linear_q8_tiles";
  const TilesArgs args = check_tiles_args(what, x, codes, scales, offsets, group);
  const int64_t M = args.M, K = args.K, G = args.G, T = args.T, N = args.N;
  const bool with_offsets = args.with_offsets;
  const RoundedX rx = round_x(x.data_ptr<float>(), M, K, group, 8, with_offsets);
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tile_bytes = K * TILE / 2;
  // Up to 8 rows (decode), one tile at a time and all rows in one pass: each weight byte comes
  // from DRAM once, while the arithmetic runs. From 9 rows, pairs of tiles, 4 rows a pass, an
  // odd last tile alone: half the activation broadcasts per vpdpbusd. Measured on a Zen 5 EPYC
  // (docs/notes/2026-12-05-tile-pairs.md), L2-resident weights, one thread: 6.1 G vpdpbusd/s for
  // pairs of 4 rows against 4.8 for one tile of 8 rows (peak 8.8); from DRAM, pairs ran 128 rows
  // 1.3x faster but 8 rows 0.96x (two passes, the second one's arithmetic not overlapping the
  // first one's reads).
  const bool pairs = M > 8;
  const int64_t units = pairs ? (T + 1) / 2 : T, per_unit = pairs ? 2 : 1;
  // as q8_dot.cpp's decode: units under ~128K weights a thread stay on the calling thread
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / (K * per_unit * TILE));
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
  if (with_offsets) {
    const at::Tensor xsum = at::from_blob(const_cast<float*>(rx.xsum.data()), {M, G}, x.options());
    y.addmm_(xsum, offsets->t());
  }
  return y;
#else
  TORCH_CHECK(false, "int4_linear_q8_tiles runs at the avx512vnni level only");
  return at::Tensor();
#endif
}

// The codes between the row layout (q8_dot.cpp: byte 32p + i of a row holds columns 64p + i
// and 64p + 32 + i) and the tiles, both ways (plain loops, every level; cpu_q8.to_tiles_reference
// is the torch definition). Step j of a tile takes row bytes b0 .. b0 + 7, b0 = 32 (j / 8) +
// 8 (j % 4), their low nibbles for j % 8 < 4, else their high ones.
at::Tensor int4_to_tiles(const at::Tensor& rows) {
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kByte && rows.is_contiguous() &&
                  rows.size(0) % 16 == 0 && (rows.size(1) * 2) % PAIR == 0,
              "int4_to_tiles: codes must be contiguous uint8 [N, K/2], N a multiple of 16");
  const int64_t N = rows.size(0), half = rows.size(1), K = half * 2, T = N / 16;
  at::Tensor out = at::empty({T, K / 8, 64}, rows.options());
  const uint8_t* src = rows.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < 16; ++c) {
        const uint8_t* row = src + (t * 16 + c) * half;
        for (int64_t j = 0; j < K / 8; ++j) {
          const uint8_t* b = row + 32 * (j / 8) + 8 * (j % 4);
          uint8_t* o = dst + (t * (K / 8) + j) * 64 + 4 * c;
          const bool high = j % 8 >= 4;
          for (int i = 0; i < 4; ++i)
            o[i] = high ? static_cast<uint8_t>((b[i] >> 4) | (b[4 + i] & 0xF0))
                        : static_cast<uint8_t>((b[i] & 0x0F) | (b[4 + i] << 4));
        }
      }
  });
  return out;
}

at::Tensor int4_from_tiles(const at::Tensor& tiles) {
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.size(2) == 64 && (tiles.size(1) * 8) % PAIR == 0,
              "int4_from_tiles: codes must be contiguous uint8 [N/16, K/8, 64]");
  const int64_t T = tiles.size(0), K = tiles.size(1) * 8, half = K / 2;
  at::Tensor out = at::empty({T * 16, half}, tiles.options());
  const uint8_t* src = tiles.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t c = 0; c < 16; ++c) {
        uint8_t* row = dst + (t * 16 + c) * half;
        for (int64_t j = 0; j < K / 8; ++j) {
          if (j % 8 >= 4) continue;  // each low step j writes its bytes with step j + 4's nibbles
          const uint8_t* lo = src + (t * (K / 8) + j) * 64 + 4 * c;
          const uint8_t* hi = lo + 4 * 64;
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
  m.def("int4_to_tiles(Tensor codes) -> Tensor");
  m.def("int4_from_tiles(Tensor tiles) -> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("int4_linear_q8_tiles", &compress_q8::int4_linear_q8_tiles);
  m.impl("int4_to_tiles", &compress_q8::int4_to_tiles);
  m.impl("int4_from_tiles", &compress_q8::int4_from_tiles);
}
