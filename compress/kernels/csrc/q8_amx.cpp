// int4 column-tile linears on AMX (Intel Sapphire Rapids and later: AMX-TILE + AMX-INT8), for
// many rows: the arithmetic of q8_tiles.cpp (activations rounded to int8 per block of 32, exact
// integer block dots, then scaled) with each block's 16 x 16 integer dots done by one TDPBSSD.
//
// Why: at prefill sizes the VNNI tile kernel is compute-bound (one vpdpbusd: 64 products; one
// TDPBSSD with K = 32: 8192). Each block has its own activation scale, so every product is
// stored and scaled per block of 32 and the tile unit idles part of the time; still, measured
// on a Xeon (2 threads, docs/notes/2026-12-04-amx-prefill.md) the 1.1B shape's gate/up layer
// at 256 rows took 8.0 ms against the VNNI kernel's 14.7, and from 32 rows on it wins.
//
// Bit for bit the same outputs as int4_linear_q8_tiles: the block dot is the same exact integer
// (signed codes q = code - 8 times the int8 activations, no bias correction needed), and the
// float steps are the same operations in the same order: per block inner = fma(float(dot),
// x scale, inner), per group acc = fma(inner, weight scale, acc). So the runtime may send any
// row count here without changing a token (tests/kernels hold the two ops equal).
//
// Per pair of column tiles (32 outputs): their int4 codes are unpacked once into B tiles,
// [K/32][8][64] bytes in AMX's VNNI order (row r, byte 4c + i = column c's code at k = 4r + i,
// minus 8), then every pair of 16-row activation tiles runs over them. Step j of the column-tile
// layout already is that order: its low nibbles are B row 2j, its high nibbles row 2j + 1. The
// activations are re-laid once per call so that each A tile is one 512-byte run.
#include "q8_common.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>

// Compilers without AMX intrinsics (GCC before 11) still build the level; the op then says so.
#if defined(COMPRESS_AVX512VNNI) && defined(__linux__) && __has_include(<amxtileintrin.h>)
#define COMPRESS_AMX 1
#endif

namespace compress_q8 {

#if defined(COMPRESS_AMX)
namespace {

constexpr int64_t AMX_ROWS = 16;     // rows of an activation tile and of a result tile
constexpr int64_t B_BYTES = 512;     // an unpacked B tile: 8 rows x 64 bytes
constexpr int64_t A_BYTES = 512;     // an activation tile: 16 rows x 32 bytes
constexpr int64_t CHUNK_BYTES = 1 << 20;  // the bf16 op's activations per K chunk

// Linux hands out the tile registers' state only on request, once per process.
constexpr int ARCH_REQ_XCOMP_PERM = 0x1023;
constexpr int XFEATURE_XTILEDATA = 18;

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: results (16 x 16 int32), row tile i and column tile c in tile 2i + c; 4, 5:
// activations of row tiles 0, 1 (16 rows x 32 bytes); 6, 7: weights of column tiles 0, 1 (8
// rows x 64 bytes). Two by two, each loaded tile feeds two products.
__attribute__((target("amx-tile,amx-int8"))) void configure() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = t < 6 ? 16 : 8;
    cfg.colsb[t] = t == 4 || t == 5 ? 32 : 64;
  }
  // GCC 12 does not see ldtilecfg read the struct and dropped these stores (measured: SIGILL
  // at the first tilezero); the barrier keeps them
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

__attribute__((target("amx-tile"))) void release() { _tile_release(); }

// f(MT, NT) as std::integral_constant<int, ...>: two row tiles from 17 rows, two column tiles
// where a pair exists; the one place that picks the row_tiles* instantiation
template <typename F>
inline void by_tiles(int64_t rows, bool pair, const F& f) {
  using one = std::integral_constant<int, 1>;
  using two = std::integral_constant<int, 2>;
  if (rows > AMX_ROWS && pair)
    f(two{}, two{});
  else if (rows > AMX_ROWS)
    f(two{}, one{});
  else if (pair)
    f(one{}, two{});
  else
    f(one{}, one{});
}

// A column tile's codes [K/8, 64] -> B tiles [K/32][8][64] of signed codes (code - 8).
inline void unpack_tile(const uint8_t* tile, int64_t K, int8_t* out) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), eight = _mm512_set1_epi8(8);
  for (int64_t j = 0; j < K / 8; ++j) {
    const __m512i v = _mm512_loadu_si512(tile + j * 64);
    const __m512i lo = _mm512_sub_epi8(_mm512_and_si512(v, low4), eight);
    const __m512i hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(v, 4), low4), eight);
    _mm512_storeu_si512(out + j * 128, lo);
    _mm512_storeu_si512(out + j * 128 + 64, hi);
  }
}

// Block b's dots of MT row tiles (q: the first row tile's A tile of the block, 512 contiguous
// bytes; the second row tile's is 16 K bytes further) and NT column tiles (w0, w1: their B
// tiles of the block). GCC's tile intrinsics paste their tile
// numbers into the assembly, so every tile is named by a literal.
template <int MT, int NT>
__attribute__((target("amx-tile,amx-int8"))) inline void block_dots(const int8_t* q, int64_t K,
                                                                   const int8_t* w0,
                                                                   const int8_t* w1) {
  _tile_loadd(6, w0, 64);
  if constexpr (NT == 2) _tile_loadd(7, w1, 64);
  _tile_loadd(4, q, BLOCK);
  _tile_zero(0);
  _tile_dpbssd(0, 4, 6);
  if constexpr (NT == 2) {
    _tile_zero(1);
    _tile_dpbssd(1, 4, 7);
  }
  if constexpr (MT == 2) {
    _tile_loadd(5, q + K * AMX_ROWS, BLOCK);
    _tile_zero(2);
    _tile_dpbssd(2, 5, 6);
    if constexpr (NT == 2) {
      _tile_zero(3);
      _tile_dpbssd(3, 5, 7);
    }
  }
}

template <int MT, int NT>
__attribute__((target("amx-tile"))) inline void store_dots(int32_t* out) {
  _tile_stored(0, out, 64);
  if constexpr (NT == 2) _tile_stored(1, out + 256, 64);
  if constexpr (MT == 2) _tile_stored(2, out + 512, 64);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, out + 768, 64);
}

// MT row tiles (q: their A tiles, [MT][K/32][16][32] int8 from row m0; sx: their block scales,
// B apart) times NT
// column tiles (wb: their B tiles, one after the other; ws: their scales [G, 16] each, G * 16
// apart): y rows m0 .. m0 + rows - 1, columns col0 .. col0 + 16 NT - 1.
//
// Software-pipelined: block b + 1's products are issued before block b's dots are scaled, so
// the tile unit works while the vector units scale (the products are stored to cbuf, then
// scaled from there: AMX has no path from tiles to vector registers).
template <int MT, int NT>
__attribute__((target("amx-tile,amx-int8"))) void row_tiles(
    const int8_t* q, const float* sx, int64_t K, int64_t B, int64_t per_group, const int8_t* wb,
    const float* ws, int64_t G, float* y, int64_t N, int64_t rows) {
  const int64_t wstride = K / BLOCK * B_BYTES;
  alignas(64) int32_t cbuf[2][4][256];
  alignas(64) float inner[4][AMX_ROWS * 16], acc[4][AMX_ROWS * 16];
  std::memset(inner, 0, sizeof(inner));
  std::memset(acc, 0, sizeof(acc));
  block_dots<MT, NT>(q, K, wb, wb + wstride);
  store_dots<MT, NT>(cbuf[0][0]);
  for (int64_t b = 0; b < B; ++b) {
    if (b + 1 < B)
      block_dots<MT, NT>(q + (b + 1) * A_BYTES, K, wb + (b + 1) * B_BYTES,
                         wb + wstride + (b + 1) * B_BYTES);
    const bool group_end = (b + 1) % per_group == 0;
    for (int i = 0; i < MT; ++i)
      for (int c = 0; c < NT; ++c) {
        const int32_t* dots = cbuf[b & 1][2 * i + c];
        float* in = inner[2 * i + c];
        const float* s = sx + i * AMX_ROWS * B + b;
        // the same fma as q8_tiles.cpp's, the row's block scale broadcast
        for (int r = 0; r < AMX_ROWS; ++r)
          _mm512_store_ps(in + r * 16, _mm512_fmadd_ps(
                                           _mm512_cvtepi32_ps(_mm512_load_si512(dots + r * 16)),
                                           _mm512_set1_ps(s[r * B]), _mm512_load_ps(in + r * 16)));
        if (group_end) {  // the weight scales once per group, as q8_tiles.cpp
          const __m512 sw = _mm512_loadu_ps(ws + c * G * 16 + (b / per_group) * 16);
          float* out = acc[2 * i + c];
          for (int r = 0; r < AMX_ROWS; ++r) {
            _mm512_store_ps(out + r * 16, _mm512_fmadd_ps(_mm512_load_ps(in + r * 16), sw,
                                                          _mm512_load_ps(out + r * 16)));
            _mm512_store_ps(in + r * 16, _mm512_setzero_ps());
          }
        }
      }
    if (b + 1 < B) store_dots<MT, NT>(cbuf[(b + 1) & 1][0]);
  }
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < NT; ++c)
      for (int64_t r = 0; r < AMX_ROWS && i * AMX_ROWS + r < rows; ++r)
        std::memcpy(y + (i * AMX_ROWS + r) * N + c * 16, acc[2 * i + c] + r * 16, 64);
}


// ---- int4 x bf16 (AMX-BF16): activations rounded to bf16, no per-block activation scale ----
//
// tiles 0-3: results (16 x 16 fp32), as above; 4, 5: activations of row tiles 0, 1 (16 rows x
// 32 bf16, each tile one 1 KB run: read in place with x's row stride of 2K bytes, 16 rows
// landed in one L1 set and ran ~10% slower); 6, 7: weights of column tiles 0, 1 (16 rows x 16
// pairs of bf16: B row r holds k = 2r, 2r + 1 of each column).
__attribute__((target("amx-tile,amx-bf16"))) void configure_bf16() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  asm volatile("" : : "r"(&cfg) : "memory");  // as configure(): keep the stores
  _tile_loadconfig(&cfg);
}

// A column tile's codes [K/8, 64] -> B rows [K/2][32] bf16 of the signed codes (code - 8),
// exact. Step j's low nibbles hold k = 8j + i at byte 4c + i: its even 16-bit words (bytes 4c,
// 4c + 1) are B row 4j, its odd words row 4j + 1; the high nibbles rows 4j + 2, 4j + 3. A word
// permutation gathers even words then odd ones, bytes widen to words, a 16-entry table maps
// each code to its bf16 bits.
inline void unpack_tile_bf16(const uint8_t* tile, int64_t K, uint16_t* out) {
  alignas(64) uint16_t table[32] = {};
  for (int v = 0; v < 16; ++v) {
    const float f = static_cast<float>(v - 8);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    table[v] = static_cast<uint16_t>(bits >> 16);  // small integers: bf16 exact
  }
  alignas(64) uint16_t order[32];
  for (int w = 0; w < 16; ++w) {
    order[w] = static_cast<uint16_t>(2 * w);
    order[16 + w] = static_cast<uint16_t>(2 * w + 1);
  }
  const __m512i lut = _mm512_load_si512(table), split = _mm512_load_si512(order);
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t j = 0; j < K / 8; ++j) {
    const __m512i v = _mm512_loadu_si512(tile + j * 64);
    const __m512i nib[2] = {_mm512_and_si512(v, low4),
                            _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
    for (int h = 0; h < 2; ++h) {
      const __m512i s = _mm512_permutexvar_epi16(split, nib[h]);
      const __m512i even = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(s));
      const __m512i odd = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(s, 1));
      uint16_t* row = out + (4 * j + 2 * h) * 32;
      _mm512_storeu_si512(row, _mm512_permutexvar_epi16(even, lut));
      _mm512_storeu_si512(row + 32, _mm512_permutexvar_epi16(odd, lut));
    }
  }
}

// unpack_tile_bf16 with the weight scales folded in (ScaledUnpack below): B rows [k_len/2][32]
// of bf16((code - 8) x scale), the product rounded once to fp32 (one FMA: code x s - 8 s) and then to bf16 (nearest
// even), as cpu_q8.linear_bf16_reference does for more than 32 rows. `ws`: this column tile's
// scales [groups][16] from the chunk's first group. Element 2c + i of a B row is column c's, so
// a row's first 16 elements take scales s0 s0 s1 s1 .. s7 s7 and its last 16 s8 s8 .. s15 s15.
// one B row (32 code bytes in B order) -> bf16(code x s + b), s and b per element
__attribute__((target("avx512bf16"))) inline void scaled_b_row(__m256i codes, __m512 s_lo,
                                                               __m512 b_lo, __m512 s_hi,
                                                               __m512 b_hi, uint16_t* dst) {
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(codes)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(codes, 1)));
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(hi, s_hi, b_hi),
                                         _mm512_fmadd_ps(lo, s_lo, b_lo));
  _mm512_storeu_si512(dst, reinterpret_cast<const __m512i&>(v));
}

// One or two column tiles' codes (a pair) -> their B rows of bf16((code - 8) x scale), as above,
// resumable: `advance(n)` unpacks the next n steps (64 code bytes: 4 B rows of one tile), so the
// op spreads a pair's unpacking over the tile loops of the pair before it (the vector units
// then work while the tile unit does; int4_linear_bf16_tiles_amx says what that saved).
struct ScaledUnpack {
  const uint8_t* codes[2] = {};
  const float* ws[2] = {};  // each tile's scales [groups][16] from the chunk's first group
  uint16_t* out[2] = {};
  int64_t per_tile = 0, group = 0, steps = 0, next = 0, loaded = -1;
  __m512 s_lo, s_hi, b_lo, b_hi;

  // tiles: 1 or 2 (c1, w1, o1 unused for 1); k_len: the chunk's K
  void start(int tiles, const uint8_t* c0, const uint8_t* c1, const float* w0, const float* w1,
             uint16_t* o0, uint16_t* o1, int64_t k_len, int64_t group_size) {
    codes[0] = c0, codes[1] = c1, ws[0] = w0, ws[1] = w1, out[0] = o0, out[1] = o1;
    per_tile = k_len / 8, group = group_size, steps = tiles * per_tile, next = 0, loaded = -1;
  }
  bool done() const { return next >= steps; }

  __attribute__((target("avx512bf16"))) void advance(int64_t n) {
    for (; n > 0 && next < steps; --n, ++next) step(next / per_tile, next % per_tile);
  }

  __attribute__((target("avx512bf16"))) void step(int64_t t, int64_t j) {
    alignas(64) static constexpr uint16_t order[32] = {  // even words, then odd ones
        0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
        1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
    alignas(64) static constexpr int32_t pair_lo[16] = {0, 0, 1, 1, 2, 2, 3, 3,
                                                        4, 4, 5, 5, 6, 6, 7, 7};
    alignas(64) static constexpr int32_t pair_hi[16] = {8,  8,  9,  9,  10, 10, 11, 11,
                                                        12, 12, 13, 13, 14, 14, 15, 15};
    const int64_t key = t * per_tile + 8 * j / group;
    if (key != loaded) {  // another group or tile: its 16 scales spread over the row's pairs
      const __m512 sw = _mm512_loadu_ps(ws[t] + (8 * j / group) * 16);
      s_lo = _mm512_permutexvar_ps(_mm512_load_si512(pair_lo), sw);
      s_hi = _mm512_permutexvar_ps(_mm512_load_si512(pair_hi), sw);
      b_lo = _mm512_mul_ps(s_lo, _mm512_set1_ps(-8.f));  // exact: times a power of two
      b_hi = _mm512_mul_ps(s_hi, _mm512_set1_ps(-8.f));
      loaded = key;
    }
    const __m512i low4 = _mm512_set1_epi8(0x0F), split = _mm512_load_si512(order);
    const __m512i v = _mm512_loadu_si512(codes[t] + j * 64);
    const __m512i nib[2] = {_mm512_and_si512(v, low4),
                            _mm512_and_si512(_mm512_srli_epi16(v, 4), low4)};
    for (int h = 0; h < 2; ++h) {
      const __m512i sp = _mm512_permutexvar_epi16(split, nib[h]);
      uint16_t* dst = out[t] + (4 * j + 2 * h) * 32;
      scaled_b_row(_mm512_castsi512_si256(sp), s_lo, b_lo, s_hi, b_hi, dst);
      scaled_b_row(_mm512_extracti64x4_epi64(sp, 1), s_lo, b_lo, s_hi, b_hi, dst + 32);
    }
  }
};

constexpr int64_t A_BF16 = AMX_ROWS * BLOCK;  // elements of an activation tile (1 KB)

// x [M, K] (fp32 or bf16) -> bf16 A tiles [padded / 16][K / 32][16][32], rows M .. padded - 1
// zero; fp32 rounds to nearest even (as .to(torch.bfloat16)). In one pass over the threads:
// as torch ops (zeros, copy, permute) this cost a SmolLM2 32-row decode step ~6 ms of 49.
__attribute__((target("avx512bf16"))) void fp32_to_bf16_32(const float* src, uint16_t* dst) {
  const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(src + 16), _mm512_loadu_ps(src));
  _mm512_storeu_si512(dst, reinterpret_cast<const __m512i&>(v));
}

void to_a_tiles(const at::Tensor& x, int64_t M, int64_t K, int64_t padded, uint16_t* out) {
  const int64_t B = K / BLOCK;
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const float* xf = bf16 ? nullptr : x.data_ptr<float>();
  const uint16_t* xh = bf16 ? reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>())
                            : nullptr;
  at::parallel_for(0, padded, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      uint16_t* row = out + ((m / AMX_ROWS) * B * AMX_ROWS + m % AMX_ROWS) * BLOCK;
      for (int64_t b = 0; b < B; ++b) {
        uint16_t* dst = row + b * A_BF16;
        if (m >= M) {
          std::memset(dst, 0, BLOCK * 2);
        } else if (bf16) {
          std::memcpy(dst, xh + m * K + b * BLOCK, BLOCK * 2);
        } else {
          fp32_to_bf16_32(xf + m * K + b * BLOCK, dst);
        }
      }
    }
  });
}
// rows rounded up to whole 16-row tiles: the last row tile reads 16 rows, zero rows pad it
// (their outputs are dropped)
inline int64_t padded_rows(int64_t M) { return (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS; }

// x [M, K] as bf16 A tiles (to_a_tiles), padded_rows(M) rows
inline aligned_vector<uint16_t> a_tiles(const at::Tensor& x, int64_t M, int64_t K) {
  const int64_t padded = padded_rows(M);
  aligned_vector<uint16_t> xt(padded * K);
  to_a_tiles(x, M, K, padded, xt.data());
  return xt;
}

constexpr int64_t B_BF16 = 16 * 32;           // elements of a weight tile (1 KB)

// The tile unit's fp32 sums over blocks b0 .. b1 - 1 of MT row tiles (xa: their A tiles,
// [MT][K/32][16][32] bf16) times NT column tiles (block b's B tile at wb + (b - b0) * B_BF16,
// the second column tile's wstride elements on), stored to cbuf (row tile i, column tile c in
// cbuf[2i + c]). Each loaded tile feeds two products. `between()` runs after each block's
// products (vector work that overlaps them), as `nothing` where there is none.
constexpr auto nothing = [] {};
template <int MT, int NT, typename F = decltype(nothing)>
__attribute__((target("amx-tile,amx-bf16"))) inline void tile_sums_bf16(
    const uint16_t* xa, int64_t K, int64_t b0, int64_t b1, const uint16_t* wb, int64_t wstride,
    float (*cbuf)[AMX_ROWS * 16], const F& between = nothing) {
  _tile_zero(0);
  if constexpr (NT == 2) _tile_zero(1);
  if constexpr (MT == 2) _tile_zero(2);
  if constexpr (MT == 2 && NT == 2) _tile_zero(3);
  for (int64_t b = b0; b < b1; ++b) {
    const uint16_t* w = wb + (b - b0) * B_BF16;
    _tile_loadd(6, w, 64);
    if constexpr (NT == 2) _tile_loadd(7, w + wstride, 64);
    _tile_loadd(4, xa + b * A_BF16, 64);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (MT == 2) {
      _tile_loadd(5, xa + AMX_ROWS * K + b * A_BF16, 64);
      _tile_dpbf16ps(2, 5, 6);
      if constexpr (NT == 2) _tile_dpbf16ps(3, 5, 7);
    }
    between();
  }
  _tile_stored(0, cbuf[0], 64);
  if constexpr (NT == 2) _tile_stored(1, cbuf[1], 64);
  if constexpr (MT == 2) _tile_stored(2, cbuf[2], 64);
  if constexpr (MT == 2 && NT == 2) _tile_stored(3, cbuf[3], 64);
}

// Up to 32 rows: MT row tiles (xa: their A tiles, [MT][K/32][16][32] bf16 from row m0) times NT
// column tiles (codes: the first's, the second's K * 8 bytes on; ws: their scales [G, 16] each,
// G * 16 apart), written to y rows m0 .. m0 + rows - 1, columns col0 .. col0 + 16 NT - 1. Per
// group the codes are unpacked exact (unpack_tile_bf16) into wb (per_group tiles per column
// tile, wstride elements apart) just before their products, the tile unit sums the exact
// products (fp32), then the vector units scale the sums by the group's weight scales. Nothing is
// reused across row tiles here, so unpacking a whole tile ahead of use only wrote 128-360 KB
// per pair through L2 (one 11264 x 2048 layer at 32 rows: 1.79 ms, most of it unpacking); and
// folding the scales into the tiles (row_tiles_bf16_whole) costs more ALU work per weight than
// the per-group scaling saves (SmolLM2's layers at 16 rows 12.3-13.1 ms against 9.4-9.8, at 32
// rows 16.4-16.5 against 13.7-13.9; scripts/bench_prefill.py --rows 16 32 --only tiles).
template <int MT, int NT>
__attribute__((target("amx-tile,amx-bf16"))) void row_tiles_bf16(
    const uint16_t* xa, int64_t K, int64_t per_group, uint16_t* wb, int64_t wstride,
    const float* ws, int64_t G, float* y, int64_t N, int64_t rows, const uint8_t* codes) {
  alignas(64) float cbuf[4][AMX_ROWS * 16], acc[4][AMX_ROWS * 16];
  std::memset(acc, 0, sizeof(acc));
  const int64_t group = per_group * BLOCK, group_bytes = group * 8;
  // the codes GROUPS_AHEAD groups on into L1 at each group's start: each group's unpack waited
  // on DRAM (1.1B shape's layers, a pass at 8 rows 44 -> 36 ms, 16 rows 46 -> 40, 32 rows
  // 61 -> 58; Xeon, 2 threads, measured as in int4_linear_bf16_tiles_amx; 1 group ahead did as
  // well as 2, 4 less)
  constexpr int64_t GROUPS_AHEAD = 2;
  for (int64_t g = 0; g < G; ++g) {
    if (g + GROUPS_AHEAD < G)
      for (int c = 0; c < NT; ++c) {
        const char* ahead = reinterpret_cast<const char*>(codes + c * K * 8) +
                            (g + GROUPS_AHEAD) * group_bytes;
        for (int64_t l = 0; l < group_bytes; l += 64) _mm_prefetch(ahead + l, _MM_HINT_T0);
      }
    unpack_tile_bf16(codes + g * group * 8, group, wb);
    if constexpr (NT == 2) unpack_tile_bf16(codes + K * 8 + g * group * 8, group, wb + wstride);
    tile_sums_bf16<MT, NT>(xa, K, g * per_group, (g + 1) * per_group, wb, wstride, cbuf);
    for (int i = 0; i < MT; ++i)
      for (int c = 0; c < NT; ++c) {
        const __m512 sw = _mm512_loadu_ps(ws + c * G * 16 + g * 16);
        const float* sums = cbuf[2 * i + c];
        float* out = acc[2 * i + c];
        for (int r = 0; r < AMX_ROWS; ++r)
          _mm512_store_ps(out + r * 16, _mm512_fmadd_ps(_mm512_load_ps(sums + r * 16), sw,
                                                        _mm512_load_ps(out + r * 16)));
      }
  }
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < NT; ++c)
      for (int64_t r = 0; r < AMX_ROWS && i * AMX_ROWS + r < rows; ++r)
        std::memcpy(y + (i * AMX_ROWS + r) * N + c * 16, acc[2 * i + c] + r * 16, 64);
}

// MT row tiles (xa: their A tiles, [MT][K/32][16][32] bf16 from row m0) times NT column tiles
// whose B tiles hold the weights whole (dense bf16, or int4 with its scales folded in:
// ScaledUnpack), over blocks b0 .. b1 - 1 (wb: block b0's B tile of the first column
// tile, the second's wstride elements on): the tile unit sums every block's products in fp32,
// stored once at the end and written (`first`) or added to y rows m0 .. m0 + rows - 1, columns
// col0 .. col0 + 16 NT - 1; `between` as tile_sums_bf16's.
template <int MT, int NT, typename F = decltype(nothing)>
__attribute__((target("amx-tile,amx-bf16"))) void row_tiles_bf16_whole(
    const uint16_t* xa, int64_t K, int64_t b0, int64_t b1, const uint16_t* wb, int64_t wstride,
    float* y, int64_t N, int64_t rows, bool first, const F& between = nothing) {
  alignas(64) float cbuf[4][AMX_ROWS * 16];
  tile_sums_bf16<MT, NT>(xa, K, b0, b1, wb, wstride, cbuf, between);
  for (int i = 0; i < MT; ++i)
    for (int c = 0; c < NT; ++c)
      for (int64_t r = 0; r < AMX_ROWS && i * AMX_ROWS + r < rows; ++r) {
        float* out = y + (i * AMX_ROWS + r) * N + c * 16;
        const __m512 sums = _mm512_load_ps(cbuf[2 * i + c] + r * 16);
        _mm512_storeu_ps(out, first ? sums : _mm512_add_ps(sums, _mm512_loadu_ps(out)));
      }
}

}  // namespace
#endif

// Whether this process may use AMX: the CPU has it (CPUID) and Linux granted the tile state.
bool amx_ready() {
#if defined(COMPRESS_AMX)
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    const bool tile = edx & (1u << 24), int8 = edx & (1u << 25);
    if (!tile || !int8) return false;
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return ready;
#else
  return false;
#endif
}

// amx_ready() and the CPU has AMX-BF16 (every AMX CPU so far; CPUID says so for sure).
bool amx_bf16_ready() {
#if defined(COMPRESS_AMX)
  static const bool ready = [] {
    unsigned eax, ebx, ecx, edx;
    __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
    return (edx & (1u << 22)) != 0;
  }();
  return ready && amx_ready();
#else
  return false;
#endif
}

at::Tensor int4_linear_q8_tiles_amx(const at::Tensor& x, const at::Tensor& codes,
                                    const at::Tensor& scales,
                                    const std::optional<at::Tensor>& offsets, int64_t group) {
#if defined(COMPRESS_AMX)
  const char* what = "int4_linear_q8_tiles_amx";
  TORCH_CHECK(amx_ready(), what,
              ": this CPU or kernel does not grant AMX-INT8 (use int4_linear_q8_tiles)");
  const TilesArgs args = check_tiles_args(what, x, codes, scales, offsets, group);
  const int64_t M = args.M, K = args.K, G = args.G, T = args.T, N = args.N;
  const bool with_offsets = args.with_offsets;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  RoundedX rx = round_x(x.data_ptr<float>(), M, K, group, 8, with_offsets);
  const int64_t B = rx.B;
  // the last row tile reads 16 rows: pad codes and scales with zero rows (outputs dropped)
  const int64_t padded = padded_rows(M);
  rx.q.resize(padded * K, 0);
  // activations as A tiles, [row tiles][blocks][16 rows][32 bytes]: each tile one 512-byte run
  aligned_vector<int8_t> qa(padded * K);
  at::parallel_for(0, padded / AMX_ROWS, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t r = 0; r < AMX_ROWS; ++r)
          std::memcpy(qa.data() + (i * B + b) * A_BYTES + r * BLOCK,
                      rx.q.data() + (i * AMX_ROWS + r) * K + b * BLOCK, BLOCK);
  });
  rx.scale.resize(padded * B, 0.f);
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // column tiles in pairs over the threads; each pair's codes unpacked once, then every pair
  // of row tiles runs over them
  const int64_t per_group = group / BLOCK, wstride = K / BLOCK * B_BYTES;
  parallel_claims((T + 1) / 2, 1, [&](Claims& claims) {
    configure();
    aligned_vector<int8_t> wb(2 * wstride);
    for (int64_t p, p_end; claims.take(p, p_end);) {  // runs of one pair
      const int64_t t = 2 * p;
      const bool pair = t + 1 < T;
      unpack_tile(cp + t * K * 8, K, wb.data());
      if (pair) unpack_tile(cp + (t + 1) * K * 8, K, wb.data() + wstride);
      const float* ws = sp + t * G * 16;
      for (int64_t m0 = 0; m0 < M; m0 += 2 * AMX_ROWS) {
        const int8_t* q = qa.data() + m0 * K;
        const float* sx = rx.scale.data() + m0 * B;
        float* out = yp + m0 * N + t * 16;
        const int64_t rows = std::min(2 * AMX_ROWS, M - m0);
        by_tiles(rows, pair, [&](auto mt, auto nt) {
          row_tiles<decltype(mt)::value, decltype(nt)::value>(q, sx, K, B, per_group, wb.data(), ws, G, out, N, rows);
        });
      }
    }
    release();
  });
  if (with_offsets) {
    const at::Tensor xsum = at::from_blob(rx.xsum.data(), {M, G}, x.options());
    y.addmm_(xsum, offsets->t());
  }
  return y;
#else
  TORCH_CHECK(false, "int4_linear_q8_tiles_amx runs at the avx512vnni level, built by a compiler "
              "with AMX intrinsics (GCC 11 or later), on Linux");
  return at::Tensor();
#endif
}


// int4 column tiles times bf16 activations on AMX-BF16: y = x W^T with x rounded to bf16 (no
// per-block int8 rounding). Up to 32 rows the codes stay exact, each group's products are
// summed in fp32 by the tile unit and scaled once per group (row_tiles_bf16). From 33 rows
// (cpu_q8.BF16_WHOLE_MIN_ROWS) each column pair's weights are unpacked once per K chunk as
// bf16((code - 8) x scale), so the tile unit sums all of the chunk and the sums leave the tiles
// once (row_tiles_bf16_whole): the per-group stores and scaling had cost SmolLM2's layers at
// 256 rows 73-74 ms against 56-60 now (oneDNN's dense bf16 67-71; scripts/bench_prefill.py
// --rows 256 512 --only tiles bf16, Xeon, 2 threads), at 512 rows 142-149 against 114-120. The
// weights' bf16 rounding (relative 2^-9) is what a dequantize-then-bf16 GEMM does, far below
// the 4-bit grid's. Not the int8 ops' numbers: the runtime sends it only the rows of large
// steps (cpu_q8.BF16_AMX_MIN_ROWS). x fp32 or bf16 [M, K].
at::Tensor int4_linear_bf16_tiles_amx(const at::Tensor& x, const at::Tensor& codes,
                                      const at::Tensor& scales,
                                      const std::optional<at::Tensor>& offsets, int64_t group) {
#if defined(COMPRESS_AMX)
  const char* what = "int4_linear_bf16_tiles_amx";
  TORCH_CHECK(amx_bf16_ready(), what,
              ": this CPU or kernel does not grant AMX-BF16 (use int4_linear_q8_tiles)");
  const TilesArgs args = check_tiles_args(what, x, codes, scales, offsets, group, true);
  const int64_t M = x.size(0), K = args.K, G = args.G, T = args.T, N = args.N;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const int64_t padded = padded_rows(M);
  const aligned_vector<uint16_t> xt = a_tiles(x, M, K);
  const uint16_t* xp = xt.data();
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float* sp = scales.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  // K in chunks of whole groups whose activations (padded x chunk x 2 bytes) stay within
  // CHUNK_BYTES, so every column pair reads them from L2: with all of K, the 1.1B shape's
  // down_proj at 256 rows (2.9 MB of activations per pair) ran 1.4x slower than oneDNN's bf16
  const int64_t per_group = group / BLOCK;
  const int64_t chunk_groups = std::max<int64_t>(1, CHUNK_BYTES / (2 * padded * group));
  const int64_t wstride = std::min(G, chunk_groups) * group * 16;  // B elements per tile
  if (padded <= 2 * AMX_ROWS) {  // one row-tile pair: each group unpacked as it is used
    const int64_t gstride = per_group * B_BF16;
    parallel_claims((T + 1) / 2, 1, [&](Claims& claims) {
      configure_bf16();
      aligned_vector<uint16_t> wb(2 * gstride);
      for (int64_t p, p_end; claims.take(p, p_end);) {  // runs of one pair
        const int64_t t = 2 * p;
        const uint8_t* c = cp + t * K * 8;
        const float* ws = sp + t * G * 16;
        float* out = yp + t * 16;
        uint16_t* w = wb.data();
        by_tiles(M, t + 1 < T, [&](auto mt, auto nt) {
          row_tiles_bf16<decltype(mt)::value, decltype(nt)::value>(xp, K, per_group, w, gstride, ws, G, out, N, M, c);
        });
      }
      release();
    });
  }
  // else one claimed pass over the column pairs per K chunk (a pair's chunks add up in order).
  // Each thread claims its next pair before it runs the current one and unpacks the next one's
  // weights a step or so after each block of the current one's products, into the other half
  // of its buffer: the unpack (vector units) then overlaps the products (tile unit). Unpacking
  // each pair ahead of its products had cost the 1.1B shape's layers at 256 rows 304 against
  // 262 ms a pass now, at 64 rows 114 against 100 (Xeon, 2 threads; medians of 3 processes of
  // the two builds alternated, each the median of 5 passes).
  for (int64_t g0 = 0; padded > 2 * AMX_ROWS && g0 < G; g0 += chunk_groups) {
    const int64_t g1 = std::min(G, g0 + chunk_groups), k0 = g0 * group, kc = (g1 - g0) * group;
    const int64_t row_pairs = (M + 2 * AMX_ROWS - 1) / (2 * AMX_ROWS);
    // unpack steps of a pair spread over its predecessor's row_pairs x kc / 32 blocks
    const int64_t per_block = (2 * kc / 8 + row_pairs * (kc / BLOCK) - 1) / (row_pairs * (kc / BLOCK));
    parallel_claims((T + 1) / 2, 1, [&](Claims& claims) {
      configure_bf16();
      aligned_vector<uint16_t> wb(4 * wstride);  // two pairs' B tiles: this one, the next
      ScaledUnpack next;
      auto start = [&](int64_t p, int half) {
        const int64_t t = 2 * p;
        const float* ws = sp + t * G * 16 + g0 * 16;
        uint16_t* out = wb.data() + half * 2 * wstride;
        const uint8_t* c = cp + t * K * 8 + k0 * 8;
        next.start(t + 1 < T ? 2 : 1, c, c + K * 8, ws, ws + G * 16, out, out + wstride, kc,
                   group);
      };
      int64_t p, p_end, half = 0;
      if (!claims.take(p, p_end)) {
        release();
        return;
      }
      start(p, half);
      next.advance(next.steps);  // the first pair: nothing to overlap
      for (bool more = true; more;) {
        int64_t q, q_end;
        more = claims.take(q, q_end);
        if (more) start(q, 1 - half);
        const int64_t t = 2 * p, step = more ? per_block : 0;
        const bool pair = t + 1 < T;
        const uint16_t* w = wb.data() + half * 2 * wstride;
        for (int64_t m0 = 0; m0 < M; m0 += 2 * AMX_ROWS) {
          const uint16_t* xa = xp + m0 * K;
          float* out = yp + m0 * N + t * 16;
          const int64_t rows = std::min(2 * AMX_ROWS, M - m0);
          by_tiles(rows, pair, [&](auto mt, auto nt) {
            row_tiles_bf16_whole<decltype(mt)::value, decltype(nt)::value>(xa, K, k0 / BLOCK, (k0 + kc) / BLOCK, w, wstride, out, N, rows, g0 == 0, [&] { next.advance(step); });
          });
        }
        next.advance(next.steps);  // what the blocks left (rounding), then the next pair
        p = q, half = 1 - half;
      }
      release();
    });
  }
  if (args.with_offsets) {  // the offsets' term from the exact x sums, as the int8 ops
    const at::Tensor xsum = x.to(at::kFloat).view({M, G, group}).sum(-1);
    y.addmm_(xsum, offsets->t());
  }
  return y;
#else
  TORCH_CHECK(false, "int4_linear_bf16_tiles_amx runs at the avx512vnni level, built by a "
              "compiler with AMX intrinsics (GCC 11 or later), on Linux");
  return at::Tensor();
#endif
}


// Dense bf16 weights in B-tile order (cpu_q8.bf16_to_tiles: [N/16, K/2, 32], element 2c + i of
// row r = w[16t + c, 2r + i]) times bf16 activations on AMX-BF16: the int4 op's loops with the
// weights read in place (no unpack) and one group of all of K (scale 1: exact). y fp32 [M, N].
at::Tensor bf16_linear_tiles_amx(const at::Tensor& x, const at::Tensor& w) {
#if defined(COMPRESS_AMX)
  const char* what = "bf16_linear_tiles_amx";
  TORCH_CHECK(amx_bf16_ready(), what, ": this CPU or kernel does not grant AMX-BF16");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() &&
                  (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              what, ": x must be a contiguous fp32 or bf16 [M, K] tensor");
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kBFloat16 && w.is_contiguous() &&
                  w.size(2) == 32 && w.size(1) * 2 == x.size(1) && x.size(1) % BLOCK == 0,
              what, ": w must be contiguous bf16 [N/16, K/2, 32] with K = x's width, a "
              "multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), T = w.size(0), N = T * 16;
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kFloat));
  if (M == 0) return y;
  const aligned_vector<uint16_t> xt = a_tiles(x, M, K);
  const uint16_t* xp = xt.data();
  uint16_t* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  const int64_t wstride = K * 16;
  parallel_claims((T + 1) / 2, 1, [&](Claims& claims) {
    configure_bf16();
    for (int64_t p, p_end; claims.take(p, p_end);) {  // runs of one pair
      const int64_t t = 2 * p;
      const bool pair = t + 1 < T;
      uint16_t* wt = wp + t * wstride;
      for (int64_t m0 = 0; m0 < M; m0 += 2 * AMX_ROWS) {
        const uint16_t* xa = xp + m0 * K;
        float* out = yp + m0 * N + t * 16;
        const int64_t rows = std::min(2 * AMX_ROWS, M - m0);
        by_tiles(rows, pair, [&](auto mt, auto nt) {
          row_tiles_bf16_whole<decltype(mt)::value, decltype(nt)::value>(xa, K, 0, K / BLOCK, wt, wstride, out, N, rows, true);
        });
      }
    }
    release();
  });
  return y;
#else
  TORCH_CHECK(false, "bf16_linear_tiles_amx runs at the avx512vnni level, built with AMX "
              "intrinsics, on Linux");
  return at::Tensor();
#endif
}

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("int4_linear_q8_tiles_amx(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
  m.def("int4_linear_bf16_tiles_amx(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
  m.def("bf16_linear_tiles_amx(Tensor x, Tensor w) -> Tensor");
  m.def("amx_ready() -> bool", &compress_q8::amx_ready);
  m.def("amx_bf16_ready() -> bool", &compress_q8::amx_bf16_ready);
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("int4_linear_q8_tiles_amx", &compress_q8::int4_linear_q8_tiles_amx);
  m.impl("int4_linear_bf16_tiles_amx", &compress_q8::int4_linear_bf16_tiles_amx);
  m.impl("bf16_linear_tiles_amx", &compress_q8::bf16_linear_tiles_amx);
}
