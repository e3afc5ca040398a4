// Causal attention for a prompt (prefill) on the CPU, flash-style: each block of queries walks
// its key blocks up to the diagonal with a running max and sum per row (online softmax), so the
// scores never exist whole and the blocks above the diagonal are never computed. Query i sits
// at position offset + i and sees keys 0 .. offset + i (offset > 0: a prompt's later chunk over
// the keys already in the cache). Grouped heads: query head h reads key/value head h / (H / Hkv).
//
// Layout per call: K packed in tiles of 16 keys, fp32 [Hkv, Lp / 16, D, 16] (a tile's D x 16
// values contiguous; Lp = L rounded up to 16, the padding keys zero: finite, masked), packed by
// the threads before they attend. q and V are read where they lie (fp32 or bf16, any head and
// row strides with D contiguous): each query block's rows are scaled into a per-thread fp32
// buffer, V rows widen as they load (no fp32 copies of q and V in fresh tensors per call). The
// packing is O(L D) next to the O(T L D) arithmetic.
// Scores of 6 query rows x 16 keys per register tile (12 accumulators, 2 key loads and 6 query
// broadcasts per 12 FMAs), then P V as 6 rows x 16 channels; both 256-bit (every level builds
// this file; the runtime calls it where it was measured faster than ATen's flash attention:
// cpu_attention.PREFILL_ISAS and PREFILL_HEAD_DIMS).
//
// Definition: cpu_attention.causal_prefill_attention_reference (float64 softmax attention).
#include "q8_common.h"

#include <cmath>
#include <limits>

namespace compress_q8 {
namespace {

constexpr int64_t BQ = 48;  // query rows per block (8 tiles of 6)
constexpr int64_t BK = 64;  // keys per block (4 tiles of 16)
constexpr int MR = 6;       // query rows per register tile

// The tiles' loops are do-while: each runs at least once (D >= 16, n >= 1). Why: with a for
// loop GCC 12 at -O3 (its loop peeling) kept the accumulators' values in memory for the case of
// no iterations and stored all 12 to the stack on every step (perf annotate); whether it did
// depended on where the tile was inlined. It did in this file's fp32/bf16 templates, and the
// kernel ran at 0.70x (SmolLM2's heads over 1,024 tokens, 17.8 against 12.5 ms, 2 threads,
// Zen 3).

// S[r, 0 .. 15] for R rows: q rows (stride D, pre-scaled) against a tile of 16 keys, kt [D, 16]
template <int R>
struct ScoreTile {
  static void run(const float* q, int64_t D, const float* kt, float* s, int64_t lds) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t d = 0;
    do {
      const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(q + r * D + d);
        acc[r][0] = _mm256_fmadd_ps(a, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, k1, acc[r][1]);
      }
    } while (++d < D);
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(s + r * lds, acc[r][0]);
      _mm256_storeu_ps(s + r * lds + 8, acc[r][1]);
    }
  }
};

// O[r, 0 .. 15] += sum_j P[r, j] V[j, 0 .. 15] for R rows over n keys (V rows stride ldv)
template <int R>
struct ValueTile {
  template <typename VT>
  static void run(const float* p, int64_t ldp, const VT* v, int64_t ldv, int64_t n, float* o,
                  int64_t ldo) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      acc[r][0] = _mm256_loadu_ps(o + r * ldo);
      acc[r][1] = _mm256_loadu_ps(o + r * ldo + 8);
    }
    int64_t j = 0;
    do {
      const __m256 v0 = load8f(v + j * ldv), v1 = load8f(v + j * ldv + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 a = _mm256_broadcast_ss(p + r * ldp + j);
        acc[r][0] = _mm256_fmadd_ps(a, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(a, v1, acc[r][1]);
      }
    } while (++j < n);
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(o + r * ldo, acc[r][0]);
      _mm256_storeu_ps(o + r * ldo + 8, acc[r][1]);
    }
  }
};

// Tile<rows>::run(args...) for rows 1 .. MR
template <template <int> class Tile, typename... A>
inline void by_rows(int rows, A&&... args) {
  switch (rows) {
    case 1: Tile<1>::run(args...); break;
    case 2: Tile<2>::run(args...); break;
    case 3: Tile<3>::run(args...); break;
    case 4: Tile<4>::run(args...); break;
    case 5: Tile<5>::run(args...); break;
    default: Tile<6>::run(args...); break;
  }
}

// Scaled query rows [i0, i1) of one head (q: rows stride ldq, fp32 [rows, D]) over their
// keys: kt the head's packed tiles, v its rows (stride ldv) -> out rows stride ldy
template <typename VT>
void query_block(const float* q, const float* kt, const VT* v, int64_t ldv, int64_t D,
                 int64_t offset, int64_t i0, int64_t i1, float* out, int64_t ldy, float* s,
                 float* o, float* m, float* l) {
  const int64_t rows = i1 - i0;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = 0; r < rows; ++r) {
    m[r] = neg_inf;
    l[r] = 0.f;
  }
  std::fill(o, o + rows * D, 0.f);
  const int64_t keys = offset + i1;  // the last row sees keys 0 .. offset + i1 - 1
  for (int64_t k0 = 0; k0 < keys; k0 += BK) {
    const int64_t n = std::min(BK, keys - k0);
    const int64_t n16 = (n + 15) / 16 * 16;  // whole tiles: the padding is masked below
    for (int64_t r = 0; r < rows; r += MR)
      for (int64_t j = 0; j < n16; j += 16)
        by_rows<ScoreTile>(static_cast<int>(std::min<int64_t>(MR, rows - r)), q + r * D, D,
                        kt + (k0 + j) * D, s + r * BK + j, BK);
    for (int64_t r = 0; r < rows; ++r) {
      float* sr = s + r * BK;
      const int64_t seen = std::min(n, offset + i0 + r + 1 - k0);  // keys this row sees here
      for (int64_t j = std::max<int64_t>(seen, 0); j < n16; ++j) sr[j] = neg_inf;
      float mnew;
      const float sum = exp_from_max(sr, n16, m[r], &mnew);
      const float alpha = m[r] == neg_inf ? 0.f : std::exp(m[r] - mnew);
      l[r] = l[r] * alpha + sum;
      m[r] = mnew;
      if (alpha != 1.f) {
        const __m256 av = _mm256_set1_ps(alpha);
        for (int64_t d = 0; d < D; d += 8)
          _mm256_storeu_ps(o + r * D + d, _mm256_mul_ps(av, _mm256_loadu_ps(o + r * D + d)));
      }
    }
    for (int64_t r = 0; r < rows; r += MR)
      for (int64_t d = 0; d < D; d += 16)
        by_rows<ValueTile>(static_cast<int>(std::min<int64_t>(MR, rows - r)), s + r * BK, BK,
                        v + k0 * ldv + d, ldv, n, o + r * D + d, D);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const __m256 inv = _mm256_set1_ps(1.f / l[r]);
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + r * ldy + d, _mm256_mul_ps(inv, _mm256_loadu_ps(o + r * D + d)));
  }
}

// rows x D values (rows stride ld, fp32 or bf16) times scale -> fp32 [rows, D]
template <typename T>
void scaled_rows(const T* x, int64_t ld, int64_t rows, int64_t D, float scale, float* out) {
  const __m256 sv = _mm256_set1_ps(scale);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t d = 0; d < D; d += 8)
      _mm256_storeu_ps(out + r * D + d, _mm256_mul_ps(sv, load8f(x + r * ld + d)));
}

// Tile j of key head g: keys 16 j .. 16 j + 15 (k rows stride ldk, L of them) -> fp32 [D, 16]
// (zero past L)
template <typename T>
void pack_key_tile(const T* k, int64_t ldk, int64_t L, int64_t D, int64_t j, float* tile) {
  for (int64_t i = 0; i < 16; ++i) {
    const int64_t key = 16 * j + i;
    if (key >= L) {
      for (int64_t d = 0; d < D; ++d) tile[d * 16 + i] = 0.f;
      continue;
    }
    const T* row = k + key * ldk;
    for (int64_t d = 0; d < D; ++d) tile[d * 16 + i] = static_cast<float>(row[d]);
  }
}

// Query heads' rows [i0, i0 + rows) of head h (fp32 or bf16) times scale -> fp32 [rows, D]
void scaled_query_rows(const at::Tensor& q, int64_t h, int64_t i0, int64_t rows, float scale,
                       float* out) {
  const int64_t first = h * q.stride(0) + i0 * q.stride(1);
  if (q.scalar_type() == at::kFloat)
    scaled_rows(q.data_ptr<float>() + first, q.stride(1), rows, q.size(2), scale, out);
  else
    scaled_rows(q.data_ptr<at::BFloat16>() + first, q.stride(1), rows, q.size(2), scale, out);
}

// Tile j of key head g (fp32 or bf16) -> fp32 [D, 16]
void pack_key_head_tile(const at::Tensor& k, int64_t g, int64_t j, float* tile) {
  const int64_t L = k.size(1), D = k.size(2);
  if (k.scalar_type() == at::kFloat)
    pack_key_tile(k.data_ptr<float>() + g * k.stride(0), k.stride(1), L, D, j, tile);
  else
    pack_key_tile(k.data_ptr<at::BFloat16>() + g * k.stride(0), k.stride(1), L, D, j, tile);
}

// q and K are converted per block and per tile (a branch on their dtype there); V, read in the
// inner loop, is the template's type
template <typename VT>
void attend_all(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, float scale,
                int64_t offset, at::Tensor& y) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), L = k.size(1);
  const int64_t tiles = (L + 15) / 16, group = H / Hkv;
  at::Tensor packed = at::empty({Hkv, tiles, D, 16}, y.options());
  float* ktp = packed.data_ptr<float>();
  parallel_claims(Hkv * tiles, 16, [&](Claims& claims) {
    for (int64_t u0, u1; claims.take(u0, u1);)
      for (int64_t u = u0; u < u1; ++u)
        pack_key_head_tile(k, u / tiles, u % tiles, ktp + u * D * 16);
  });
  const VT* vp = v.data_ptr<VT>();
  float* yp = y.data_ptr<float>();
  const int64_t blocks = (T + BQ - 1) / BQ;
  // head by head, so that the threads share one key head's K and V in cache at a time; within
  // a head the last query blocks, which see the most keys, first
  parallel_claims(H * blocks, 1, [&](Claims& claims) {
    aligned_vector<float> qs(BQ * D), s(BQ * BK), o(BQ * D), m(BQ), l(BQ);
    for (int64_t u0, u1; claims.take(u0, u1);)
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t b = blocks - 1 - u % blocks, h = u / blocks, g = h / group;
        const int64_t i0 = b * BQ, i1 = std::min(T, i0 + BQ);
        scaled_query_rows(q, h, i0, i1 - i0, scale, qs.data());
        query_block(qs.data(), ktp + g * tiles * D * 16, vp + g * v.stride(0), v.stride(1), D,
                    offset, i0, i1, yp + i0 * H * D + h * D, H * D, s.data(), o.data(),
                    m.data(), l.data());
      }
  });
}

}  // namespace

at::Tensor causal_prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    double scale, int64_t offset) {
  const char* what = "causal_prefill_attention";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, what,
              ": q [H, T, D], k and v [Hkv, L, D] expected, got ", q.sizes(), ", ", k.sizes(),
              ", ", v.sizes());
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), Hkv = k.size(0), L = k.size(1);
  TORCH_CHECK(v.sizes() == k.sizes() && k.size(2) == D, what, ": k ", k.sizes(), " and v ",
              v.sizes(), " must match each other and q's head dim ", D);
  TORCH_CHECK(Hkv > 0 && H % Hkv == 0, what, ": ", H, " query heads over ", Hkv,
              " key/value heads (a whole number of query heads per key head needed)");
  TORCH_CHECK(D % 16 == 0 && D > 0, what, ": head dim ", D, " must be a multiple of 16");
  TORCH_CHECK(offset >= 0 && L == offset + T, what, ": ", L, " keys for ", T,
              " queries at offset ", offset, " (L = offset + T expected)");
  for (const at::Tensor* t : {&q, &k, &v})
    TORCH_CHECK(t->scalar_type() == at::kFloat || t->scalar_type() == at::kBFloat16, what,
                ": fp32 or bf16 expected, got ", t->scalar_type());
  at::Tensor y = at::empty({T, H * D}, q.options().dtype(at::kFloat));
  if (T == 0) return y;
  // D contiguous is what the loops read; other layouts get a copy
  const auto rows_of = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor qr = rows_of(q), kr = rows_of(k), vr = rows_of(v);
  if (v.scalar_type() == at::kFloat)
    attend_all<float>(qr, kr, vr, static_cast<float>(scale), offset, y);
  else
    attend_all<at::BFloat16>(qr, kr, vr, static_cast<float>(scale), offset, y);
  return y;
}

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("causal_prefill_attention(Tensor q, Tensor k, Tensor v, float scale, int offset) -> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("causal_prefill_attention", &compress_q8::causal_prefill_attention);
}
