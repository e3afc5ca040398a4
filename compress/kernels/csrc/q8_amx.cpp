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
  const int64_t padded = (M + AMX_ROWS - 1) / AMX_ROWS * AMX_ROWS;
  rx.q.resize(padded * K, 0);
  // activations as A tiles, [row tiles][blocks][16 rows][32 bytes]: each tile one 512-byte run
  std::vector<int8_t> qa(padded * K);
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
  at::parallel_for(0, (T + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    configure();
    std::vector<int8_t> wb(2 * wstride);
    for (int64_t p = p0; p < p1; ++p) {
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
        if (rows > AMX_ROWS && pair)
          row_tiles<2, 2>(q, sx, K, B, per_group, wb.data(), ws, G, out, N, rows);
        else if (rows > AMX_ROWS)
          row_tiles<2, 1>(q, sx, K, B, per_group, wb.data(), ws, G, out, N, rows);
        else if (pair)
          row_tiles<1, 2>(q, sx, K, B, per_group, wb.data(), ws, G, out, N, rows);
        else
          row_tiles<1, 1>(q, sx, K, B, per_group, wb.data(), ws, G, out, N, rows);
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

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("int4_linear_q8_tiles_amx(Tensor x, Tensor codes, Tensor scales, Tensor? offsets, int group) -> Tensor");
  m.def("amx_ready() -> bool", &compress_q8::amx_ready);
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("int4_linear_q8_tiles_amx", &compress_q8::int4_linear_q8_tiles_amx);
}
