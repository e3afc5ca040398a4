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
// registers. AVX2 + FMA intrinsics, so every ISA level builds the same code. Reference:
// compress.kernels.cpu_attention.paged_decode_attention_reference (float64 torch).
#include "q8_common.h"

namespace compress_q8 {

// Eight values of a page row widened to fp32: fp32 as stored, bf16 exactly (its bits are the
// top half of an fp32), int8 codes times their row's scale (PagedKVCache's per token and head
// scales).
inline __m256 load8(const float* x, float) { return _mm256_loadu_ps(x); }
inline __m256 load8(const at::BFloat16* x, float) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
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

// The G query heads of one (row, kv head) task over its keys: key t (first <= t < L) lies at
// kpool + rows[t - first] * D, its scale at kscale[rows[t - first] & per_row]. `q`: the task's
// first query head; `out`: its first output head; `scores`: G * padded floats, -inf filled.
template <typename T>
void attend_heads(const float* q, const T* kpool, const T* vpool, const float* kscale,
                  const float* vscale, int64_t per_row, const int64_t* rows, int64_t first,
                  int64_t L, float* out, int64_t G, int64_t D, float scale, float softcap,
                  float* scores, int64_t padded) {
  const int64_t V = D / 8, row_bytes = D * static_cast<int64_t>(sizeof(T)), n = L - first;
  for (int64_t g = 0; g < G; ++g) {
    const float* qg = q + g * D;
    float* sg = scores + g * padded;
    // scores eight keys at a time: eight independent FMA chains, summed across in one go
    int64_t t = first;
    for (; t + 8 <= L; t += 8) {
      const T* k[8];
      float ks[8];
      for (int i = 0; i < 8; ++i) {
        const int64_t at = rows[t + i - first];
        k[i] = kpool + at * D;
        ks[i] = kscale ? kscale[at & per_row] : 1.f;
      }
      if (g == 0)  // the next eight keys' rows: they lie in other blocks, out of the stream
        for (int64_t i = t + 8 - first; i < std::min(t + 16, L) - first; ++i)
          for (int64_t c = 0; c < row_bytes; c += 64)
            _mm_prefetch(reinterpret_cast<const char*>(kpool + rows[i] * D) + c, _MM_HINT_T0);
      __m256 acc[8];
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_setzero_ps();
      for (int64_t j = 0; j < V; ++j) {
        const __m256 qj = _mm256_loadu_ps(qg + 8 * j);
        for (int i = 0; i < 8; ++i) acc[i] = _mm256_fmadd_ps(qj, load8(k[i] + 8 * j, ks[i]), acc[i]);
      }
      _mm256_storeu_ps(sg + (t - first), _mm256_mul_ps(hsum8(acc), _mm256_set1_ps(scale)));
    }
    for (; t < L; ++t) {
      const int64_t at = rows[t - first];
      const T* k = kpool + at * D;
      const float ks = kscale ? kscale[at & per_row] : 1.f;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t j = 0; j < V; ++j)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * j), load8(k + 8 * j, ks), acc);
      sg[t - first] = hsum(acc) * scale;
    }
    if (softcap > 0.f)
      for (int64_t i = 0; i < n; ++i) sg[i] = std::tanh(sg[i] / softcap) * softcap;
    // softmax over the n scores, eight at a time (the padding adds 0)
    __m256 top = _mm256_set1_ps(-INFINITY);
    for (int64_t i = 0; i < padded; i += 8) top = _mm256_max_ps(top, _mm256_loadu_ps(sg + i));
    const __m256 m = _mm256_set1_ps(hmax(top));
    __m256 sum = _mm256_setzero_ps();
    for (int64_t i = 0; i < padded; i += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + i), m));
      _mm256_storeu_ps(sg + i, e);
      sum = _mm256_add_ps(sum, e);
    }
    const float inv = 1.f / hsum(sum);
    float* og = out + g * D;
    // out = sum over keys of p x v: 64 columns at a time, eight accumulators in registers
    // (a loop bound the compiler sees as constant, or they spill); what is left (D % 64)
    // one column group at a time
    const __m256 norm = _mm256_set1_ps(inv);
    int64_t j0 = 0;
    for (; j0 + 8 <= V; j0 += 8) {
      __m256 o[8];
      for (int j = 0; j < 8; ++j) o[j] = _mm256_setzero_ps();
      for (int64_t t = first; t < L; ++t) {
        const int64_t at = rows[t - first];
        const T* v = vpool + at * D + 8 * j0;
        if (g == 0 && j0 == 0 && t + 8 < L)
          for (int64_t c = 0; c < row_bytes; c += 64)
            _mm_prefetch(reinterpret_cast<const char*>(vpool + rows[t + 8 - first] * D) + c,
                         _MM_HINT_T0);
        const float vs = vscale ? vscale[at & per_row] : 1.f;
        const __m256 p = _mm256_set1_ps(sg[t - first]);
        for (int j = 0; j < 8; ++j) o[j] = _mm256_fmadd_ps(p, load8(v + 8 * j, vs), o[j]);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_ps(og + 8 * (j0 + j), _mm256_mul_ps(o[j], norm));
    }
    for (; j0 < V; ++j0) {
      __m256 o = _mm256_setzero_ps();
      for (int64_t t = first; t < L; ++t) {
        const int64_t at = rows[t - first];
        const float vs = vscale ? vscale[at & per_row] : 1.f;
        o = _mm256_fmadd_ps(_mm256_set1_ps(sg[t - first]), load8(vpool + at * D + 8 * j0, vs), o);
      }
      _mm256_storeu_ps(og + 8 * j0, _mm256_mul_ps(o, norm));
    }
  }
}

template <typename T>
void decode_attention(const float* q, const T* kpool, const T* vpool, const float* kscale,
                      const float* vscale, const int64_t* tables, const int64_t* lengths,
                      float* out, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t nb,
                      int64_t bs, float scale, float softcap, int64_t window) {
  const int64_t G = H / Hkv, V = D / 8;
  // int8 pages: a scale per slot and kv head (index `at`); fp8 pages: one per layer (index 0)
  constexpr bool fp8 = std::is_same_v<T, at::Float8_e4m3fn>;
  const int64_t per_row = std::is_same_v<T, int8_t> ? -1 : 0;
  // Widen a task's int8 or fp8 keys and values to fp32 once for all of its G query heads
  // (the same code x scale products the per-head path computes, so the same numbers) instead
  // of once per head. Measured on a Xeon (2 threads, pages in cache,
  // scripts/bench_paged_attention.py, three runs): fp8 at G = 3 (SmolLM2, 32 rows of 160 keys)
  // 389 -> 342-368 us, at G = 8 (1.1B shape, 28 rows of 600 keys) 4608 -> 2546-2610; int8 at
  // G = 8 2800 -> 2528-2738, but at G = 3 230 -> 306 (its widening per head is cheaper than the
  // scratch's store and reload), so int8 keeps the per-head path below 4 heads.
  const bool widen = fp8 ? G > 1 : std::is_same_v<T, int8_t> && G >= 4;
  parallel_claims(B * Hkv, 1, [&](Claims& claims) {
    std::vector<float> scores, wide_k, wide_v;
    std::vector<int64_t> rows, order;  // rows [n]: each key's index into the pool's rows
    for (int64_t task, task_end; claims.take(task, task_end);) {  // runs of one task
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = lengths[b];
      const int64_t first = window > 0 ? std::max<int64_t>(0, L - window) : 0;
      const int64_t n = L - first, padded = (n + 7) / 8 * 8;
      scores.assign(G * padded, -INFINITY);  // the tail past n: exp(-inf - max) = 0
      const int64_t* table = tables + b * nb;
      rows.resize(n);
      for (int64_t t = first; t < L; ++t) rows[t - first] = (table[t / bs] * bs + t % bs) * Hkv + h;
      const float* qt = q + (b * H + h * G) * D;
      float* ot = out + (b * H + h * G) * D;
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
                            first, L, ot, G, D, scale, softcap, scores.data(), padded);
      } else {
        attend_heads<T>(qt, kpool, vpool, kscale, vscale, per_row, rows.data(), first, L, ot, G,
                        D, scale, softcap, scores.data(), padded);
      }
    }
  });
}

// q [B, H, D] fp32; k_pool, v_pool [slots, Hkv, D] fp32, bf16, int8 or fp8 e4m3fn (slots =
// blocks * block_size; int8 with k_scale, v_scale fp32 [slots, Hkv], fp8 with k_scale, v_scale
// fp32 [1]); tables [B, nb] int64 block ids;
// lengths [B] int64 keys per row (its new token's included); softcap <= 0: none; window <= 0:
// none, else the last `window` keys -> [B, H, D] fp32.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  const at::Tensor& tables, const at::Tensor& lengths,
                                  int64_t block_size, double scale, double softcap,
                                  int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(),
              "q must be a contiguous fp32 [B, heads, D] tensor");
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
  TORCH_CHECK(D % 8 == 0, "head_dim ", D, " is not a multiple of 8");
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
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= nb * block_size, "row ", b, ": length ", len[b],
                " outside 1..", nb * block_size, " (its table's slots)");
    for (int64_t i = 0; i < (len[b] + block_size - 1) / block_size; ++i)
      TORCH_CHECK(tab[b * nb + i] >= 0 && tab[b * nb + i] < num_blocks, "row ", b, ": block id ",
                  tab[b * nb + i], " outside the pool's ", num_blocks, " blocks");
  }
  auto out = at::empty({B, H, D}, q.options());
  const float cap = static_cast<float>(softcap), s = static_cast<float>(scale);
  const float* ks = codes ? k_scale->data_ptr<float>() : nullptr;
  const float* vs = codes ? v_scale->data_ptr<float>() : nullptr;
  float* o = out.data_ptr<float>();
  if (dtype == at::kFloat)
    decode_attention(q.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), ks,
                     vs, tab, len, o, B, H, Hkv, D, nb, block_size, s, cap, window);
  else if (dtype == at::kBFloat16)
    decode_attention(q.data_ptr<float>(), k_pool.data_ptr<at::BFloat16>(),
                     v_pool.data_ptr<at::BFloat16>(), ks, vs, tab, len, o, B, H, Hkv, D, nb,
                     block_size, s, cap, window);
  else if (fp8)
    decode_attention(q.data_ptr<float>(), k_pool.data_ptr<at::Float8_e4m3fn>(),
                     v_pool.data_ptr<at::Float8_e4m3fn>(), ks, vs, tab, len, o, B, H, Hkv, D, nb,
                     block_size, s, cap, window);
  else
    decode_attention(q.data_ptr<float>(), k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>(),
                     ks, vs, tab, len, o, B, H, Hkv, D, nb, block_size, s, cap, window);
  return out;
}

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor? k_scale, "
        "Tensor? v_scale, Tensor tables, Tensor lengths, int block_size, float scale, "
        "float softcap, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("paged_decode_attention", &compress_q8::paged_decode_attention);
}
