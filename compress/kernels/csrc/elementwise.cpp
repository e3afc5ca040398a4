// The runtime's per-layer elementwise work in one pass each, for eager decode steps on a CPU
// (compress/kernels/cpu_elementwise.py; references: the torch expressions in that module).
// In eager mode every torch op costs a dispatch and a pass over its tensor: measured on a Xeon
// (2 threads, SmolLM2-135M, a 32-row bf16 decode step of 50 ms) the norms, RoPE and SiLU x up
// took ~9 ms in ~30 small ops a layer. Here each is one call:
//   rms_norm:  w * x / sqrt(mean(x^2) + eps) per row, written in fp32 or bf16 (the dtype the
//              next matmul reads);
//   rope_qkv:  a q/k/v projection's output [R, (H + 2 Hkv) D] -> q [R, H, D], k and v
//              [R, Hkv, D] fp32, q and k optionally RMS-normed per head (Qwen3, Gemma 3) and
//              rotated (rotate-half RoPE with the rows' cos/sin tables);
//   silu_mul:  SiLU(gate) x up of a gate/up projection's output [R, 2I] -> [R, I];
//   add_rms_norm: the residual add before a norm, and the norm, in one pass;
//   greedy_tokens: each row's argmax of the logits, with the finite check sampling needs;
//   write_kv:  a step's keys and values into their slots of fp32 or bf16 pages;
//   write_kv_int8: the same into int8 pages, codes and a scale per token and head.
// AVX2 + FMA intrinsics, so every ISA level builds the same code; sums in eight fp32 lanes.
#include "q8_common.h"

namespace compress_q8 {
namespace {

inline float sum_squares(const float* x, int64_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256 u = _mm256_loadu_ps(x + i), v = _mm256_loadu_ps(x + i + 8);
    a0 = _mm256_fmadd_ps(u, u, a0);
    a1 = _mm256_fmadd_ps(v, v, a1);
  }
  float s = hsum(_mm256_add_ps(a0, a1));
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// out[i] = w[i] * (x[i] * r), eight at a time; bf16 out rounds to nearest even (as .to())
template <typename T>
inline void scale_row(const float* x, const float* w, float r, T* out, int64_t n) {
  const __m256 rv = _mm256_set1_ps(r);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 y = _mm256_mul_ps(_mm256_loadu_ps(w + i), _mm256_mul_ps(_mm256_loadu_ps(x + i), rv));
    if constexpr (std::is_same_v<T, float>)
      _mm256_storeu_ps(out + i, y);
    else
      store8_bf16(out + i, y);
  }
  for (; i < n; ++i) out[i] = static_cast<T>(w[i] * (x[i] * r));
}

template <typename T>
void rms_norm_rows(const float* x, const float* w, T* out, int64_t R, int64_t C, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(C, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * C;
      const float inv = 1.f / std::sqrt(sum_squares(xr, C) / static_cast<float>(C) + eps);
      scale_row(xr, w, inv, out + r * C, C);
    }
  });
}

// one head's D values: optional RMS norm (weight wn), then rotate-half RoPE into out
template <typename T>
inline void norm_rope_head(const T* xin, const float* wn, float eps, const float* cos,
                           const float* sin, float* out, int64_t D, float* tmp) {
  const float* x;
  if constexpr (std::is_same_v<T, float>) {
    x = xin;
  } else {  // widen the head once (tmp holds 2 D floats)
    for (int64_t i = 0; i < D; ++i) tmp[D + i] = static_cast<float>(xin[i]);
    x = tmp + D;
  }
  const float* src = x;
  if (wn != nullptr) {
    const float inv = 1.f / std::sqrt(sum_squares(x, D) / static_cast<float>(D) + eps);
    scale_row(x, wn, inv, tmp, D);
    src = tmp;
  }
  const int64_t half = D / 2;
  // out[:half] = x[:half] cos[:half] - x[half:] sin[:half]; out[half:] = x[half:] cos[half:]
  // + x[:half] sin[half:] (the torch reference: x * cos + cat(-x[half:], x[:half]) * sin)
  int64_t i = 0;
  for (; i + 8 <= half; i += 8) {
    const __m256 lo = _mm256_loadu_ps(src + i), hi = _mm256_loadu_ps(src + half + i);
    _mm256_storeu_ps(out + i, _mm256_add_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(cos + i)),
                                            _mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), hi),
                                                          _mm256_loadu_ps(sin + i))));
    _mm256_storeu_ps(out + half + i,
                     _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(cos + half + i)),
                                   _mm256_mul_ps(lo, _mm256_loadu_ps(sin + half + i))));
  }
  for (; i < half; ++i) {
    const float lo = src[i], hi = src[half + i];
    out[i] = lo * cos[i] + (-hi) * sin[i];
    out[half + i] = hi * cos[half + i] + lo * sin[half + i];
  }
}

}  // namespace

// the arguments rms_norm and add_rms_norm share: x [R, C] and w [C] fp32, an fp32/bf16 output
void check_norm_args(const at::Tensor& x, const at::Tensor& w, at::ScalarType out_dtype,
                     const char* op) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "x must be a contiguous fp32 [rows, C] tensor");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.scalar_type() == at::kFloat &&
                  w.is_contiguous(),
              "w must be a contiguous fp32 [C] tensor");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16, op,
              " writes fp32 or bf16, not ", out_dtype);
}

// x [R, C] fp32 contiguous, w [C] fp32 -> [R, C] in `out_dtype` (fp32 or bf16)
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::ScalarType out_dtype) {
  check_norm_args(x, w, out_dtype, "rms_norm");
  auto out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const int64_t R = x.size(0), C = x.size(1);
  if (out_dtype == at::kFloat)
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), R, C,
                  static_cast<float>(eps));
  else
    rms_norm_rows(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<at::BFloat16>(), R, C,
                  static_cast<float>(eps));
  return out;
}

template <typename T>
void rope_rows(const T* src, const float* c, const float* s, const float* wq, const float* wk,
               float* qo, float* ko, float* vo, int64_t R, int64_t H, int64_t Hkv, int64_t D,
               float e) {
  const int64_t width = (H + 2 * Hkv) * D;
  const int64_t grain = std::max<int64_t>(1, 16384 / width);
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(2 * D);
    for (int64_t r = begin; r < end; ++r) {
      const T* row = src + r * width;
      const float *cr = c + r * D, *sr = s + r * D;
      for (int64_t h = 0; h < H; ++h)
        norm_rope_head(row + h * D, wq, e, cr, sr, qo + (r * H + h) * D, D, tmp.data());
      for (int64_t h = 0; h < Hkv; ++h)
        norm_rope_head(row + (H + h) * D, wk, e, cr, sr, ko + (r * Hkv + h) * D, D, tmp.data());
      const T* v = row + (H + Hkv) * D;
      for (int64_t i = 0; i < Hkv * D; ++i) vo[r * Hkv * D + i] = static_cast<float>(v[i]);
    }
  });
}

// qkv [R, (H + 2 Hkv) D] fp32 or bf16 contiguous; cos, sin [R, D] fp32 contiguous; q_norm,
// k_norm [D] fp32 or none -> q [R, H, D], k [R, Hkv, D], v [R, Hkv, D] fp32 contiguous
std::vector<at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t H, int64_t Hkv,
                                 const std::optional<at::Tensor>& q_norm,
                                 const std::optional<at::Tensor>& k_norm, double eps) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() &&
                  (qkv.scalar_type() == at::kFloat || qkv.scalar_type() == at::kBFloat16),
              "qkv must be a contiguous fp32 or bf16 [rows, (heads + 2 kv_heads) * D] tensor");
  TORCH_CHECK(H > 0 && Hkv > 0 && qkv.size(1) % (H + 2 * Hkv) == 0,
              "qkv's width is not (heads + 2 kv_heads) x head_dim");
  const int64_t R = qkv.size(0), D = qkv.size(1) / (H + 2 * Hkv);
  TORCH_CHECK(D % 2 == 0, "head_dim ", D, " is odd: rotate-half RoPE needs halves");
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == R && t->size(1) == D &&
                    t->scalar_type() == at::kFloat && t->is_contiguous(),
                "cos and sin must be contiguous fp32 [rows, head_dim] tensors");
  TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "give both q_norm and k_norm or neither");
  if (q_norm)
    for (const auto* t : {&*q_norm, &*k_norm})
      TORCH_CHECK(t->dim() == 1 && t->size(0) == D && t->scalar_type() == at::kFloat &&
                      t->is_contiguous(),
                  "q_norm and k_norm must be contiguous fp32 [head_dim] tensors");
  const auto f32 = qkv.options().dtype(at::kFloat);
  auto q = at::empty({R, H, D}, f32), k = at::empty({R, Hkv, D}, f32);
  auto v = at::empty({R, Hkv, D}, f32);
  const float *c = cos.data_ptr<float>(), *s = sin.data_ptr<float>();
  const float* wq = q_norm ? q_norm->data_ptr<float>() : nullptr;
  const float* wk = k_norm ? k_norm->data_ptr<float>() : nullptr;
  float *qo = q.data_ptr<float>(), *ko = k.data_ptr<float>(), *vo = v.data_ptr<float>();
  const float e = static_cast<float>(eps);
  if (qkv.scalar_type() == at::kFloat)
    rope_rows(qkv.data_ptr<float>(), c, s, wq, wk, qo, ko, vo, R, H, Hkv, D, e);
  else
    rope_rows(qkv.data_ptr<at::BFloat16>(), c, s, wq, wk, qo, ko, vo, R, H, Hkv, D, e);
  return {q, k, v};
}

template <typename S, typename T>
void add_rms_norm_rows(const float* x, const S* y, const float* w, float* sum, T* out, int64_t R,
                       int64_t C, float eps) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(C, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* sr = sum + r * C;
      int64_t i = 0;
      for (; i + 8 <= C; i += 8)
        _mm256_storeu_ps(sr + i, _mm256_add_ps(_mm256_loadu_ps(x + r * C + i), load8f(y + r * C + i)));
      for (; i < C; ++i) sr[i] = x[r * C + i] + static_cast<float>(y[r * C + i]);
      const float inv = 1.f / std::sqrt(sum_squares(sr, C) / static_cast<float>(C) + eps);
      scale_row(sr, w, inv, out + r * C, C);
    }
  });
}

// x [R, C] fp32 (the residual stream), y [R, C] fp32 or bf16 (a block's output), w [C] fp32 ->
// (x + y in fp32, rms_norm(x + y) in out_dtype)
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,
                                     double eps, at::ScalarType out_dtype) {
  check_norm_args(x, w, out_dtype, "add_rms_norm");
  TORCH_CHECK(y.sizes() == x.sizes() && y.is_contiguous() &&
                  (y.scalar_type() == at::kFloat || y.scalar_type() == at::kBFloat16),
              "y must be a contiguous fp32 or bf16 tensor of x's shape");
  auto sum = at::empty_like(x);
  auto out = at::empty(x.sizes(), x.options().dtype(out_dtype));
  const int64_t R = x.size(0), C = x.size(1);
  const float e = static_cast<float>(eps);
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* sp = sum.data_ptr<float>();
  const bool bf16_in = y.scalar_type() == at::kBFloat16, bf16_out = out_dtype == at::kBFloat16;
  if (!bf16_in && !bf16_out)
    add_rms_norm_rows(xp, y.data_ptr<float>(), wp, sp, out.data_ptr<float>(), R, C, e);
  else if (!bf16_in)
    add_rms_norm_rows(xp, y.data_ptr<float>(), wp, sp, out.data_ptr<at::BFloat16>(), R, C, e);
  else if (!bf16_out)
    add_rms_norm_rows(xp, y.data_ptr<at::BFloat16>(), wp, sp, out.data_ptr<float>(), R, C, e);
  else
    add_rms_norm_rows(xp, y.data_ptr<at::BFloat16>(), wp, sp, out.data_ptr<at::BFloat16>(), R, C,
                      e);
  return {sum, out};
}

// logits [R, V] fp32 contiguous -> int64 [R]: each row's first maximal index (as argmax and
// max(-1)), or -1 where the row holds NaN or +-Inf (the caller refuses those)
at::Tensor greedy_tokens(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous() &&
                  logits.size(1) > 0,
              "logits must be a contiguous fp32 [rows, vocab] tensor");
  const int64_t R = logits.size(0), V = logits.size(1);
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  const float* src = logits.data_ptr<float>();
  int64_t* tok = out.data_ptr<int64_t>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = src + r * V;
      // pass 1: the max (NaN-free rows) and a finite check: x - x is 0 for finite x, NaN
      // for NaN and +-Inf, and NaN poisons the sum
      __m256 top = _mm256_set1_ps(-INFINITY), poison = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= V; i += 8) {
        const __m256 v = _mm256_loadu_ps(row + i);
        top = _mm256_max_ps(top, v);
        poison = _mm256_add_ps(poison, _mm256_sub_ps(v, v));
      }
      float m = hmax(top), bad = hsum(poison);
      for (; i < V; ++i) {
        m = std::max(m, row[i]);
        bad += row[i] - row[i];
      }
      if (!(bad == 0.f)) {
        tok[r] = -1;
        continue;
      }
      int64_t j = 0;  // pass 2: the first index holding it (in cache: the row was just read)
      while (row[j] != m) ++j;
      tok[r] = j;
    }
  });
  return out;
}

// What write_kv and write_kv_int8 check of their rows: k, v contiguous fp32 [N, kv_heads, D]
// of the pool's row shape, slots contiguous int64 [N] inside the pool (all checked before any
// write) -> N
int64_t check_kv_rows(const at::Tensor& pool, const at::Tensor& slots, const at::Tensor& k,
                      const at::Tensor& v) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == pool.size(1) &&
                  k.size(2) == pool.size(2) && k.scalar_type() == at::kFloat &&
                  v.scalar_type() == at::kFloat && k.is_contiguous() && v.is_contiguous(),
              "k and v must be contiguous fp32 [N, kv_heads, D] tensors of the pools' rows");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == k.size(0) && slots.scalar_type() == at::kLong &&
                  slots.is_contiguous(),
              "slots must be contiguous int64 [N]");
  const int64_t N = k.size(0), total = pool.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < total, "slot ", slot[i], " outside the pool's ", total);
  return N;
}

// k, v [N, Hkv, D] fp32 contiguous -> rows `slots` [N] of the pools [slots, Hkv, D] (fp32 or
// bf16, rounded to nearest even), keys and values in one call (PagedKVCache.write: two casts
// and two index_copy_ calls in torch)
void write_kv(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v) {
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == v_pool.scalar_type() && k_pool.is_contiguous() &&
                  v_pool.is_contiguous() &&
                  (k_pool.scalar_type() == at::kFloat || k_pool.scalar_type() == at::kBFloat16),
              "the pools must be contiguous fp32 or bf16 [slots, kv_heads, D] tensors of one dtype");
  const int64_t row = k_pool.size(1) * k_pool.size(2);
  const int64_t N = check_kv_rows(k_pool, slots, k, v);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const bool bf16 = k_pool.scalar_type() == at::kBFloat16;
  at::BFloat16* kb = bf16 ? k_pool.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* vb = bf16 ? v_pool.data_ptr<at::BFloat16>() : nullptr;
  float* kf = bf16 ? nullptr : k_pool.data_ptr<float>();
  float* vf = bf16 ? nullptr : v_pool.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 8192 / row), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t at = slot[i] * row;
      if (bf16) {
        at::BFloat16 *ko = kb + at, *vo = vb + at;
        int64_t j = 0;
        for (; j + 8 <= row; j += 8) {
          store8_bf16(ko + j, _mm256_loadu_ps(kp + i * row + j));
          store8_bf16(vo + j, _mm256_loadu_ps(vp + i * row + j));
        }
        for (; j < row; ++j) {
          ko[j] = static_cast<at::BFloat16>(kp[i * row + j]);
          vo[j] = static_cast<at::BFloat16>(vp[i * row + j]);
        }
      } else {
        std::copy(kp + i * row, kp + (i + 1) * row, kf + at);
        std::copy(vp + i * row, vp + (i + 1) * row, vf + at);
      }
    }
  });
}

// k, v [N, Hkv, D] fp32 contiguous -> rows `slots` [N] of int8 pools [slots, Hkv, D] and
// their fp32 scales [slots, Hkv]: per token and head, scale = max(absmax, 1e-8) / 127 and
// codes round(x / scale) (half to even, as torch.round) clamped to +-127. The same fp32
// operations as compress.runtime.paged.quantize_int8 (an exact max, one IEEE division each), so
// the same bytes. A row holding NaN gets a NaN scale (codes 0): its attention is NaN, which
// sampling refuses.
void write_kv_int8(at::Tensor& k_pool, at::Tensor& v_pool, at::Tensor& k_scale,
                   at::Tensor& v_scale, const at::Tensor& slots, const at::Tensor& k,
                   const at::Tensor& v) {
  TORCH_CHECK(k_pool.dim() == 3 && k_pool.sizes() == v_pool.sizes() &&
                  k_pool.scalar_type() == at::kChar && v_pool.scalar_type() == at::kChar &&
                  k_pool.is_contiguous() && v_pool.is_contiguous(),
              "the pools must be contiguous int8 [slots, kv_heads, D] tensors of one shape");
  for (const auto* s : {&k_scale, &v_scale})
    TORCH_CHECK(s->dim() == 2 && s->size(0) == k_pool.size(0) && s->size(1) == k_pool.size(1) &&
                    s->scalar_type() == at::kFloat && s->is_contiguous(),
                "the scales must be contiguous fp32 [slots, kv_heads] tensors");
  const int64_t H = k_pool.size(1), D = k_pool.size(2);
  const int64_t N = check_kv_rows(k_pool, slots, k, v);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* src[2] = {k.data_ptr<float>(), v.data_ptr<float>()};
  int8_t* codes[2] = {k_pool.data_ptr<int8_t>(), v_pool.data_ptr<int8_t>()};
  float* scales[2] = {k_scale.data_ptr<float>(), v_scale.data_ptr<float>()};
  // one task per (side, token, head) row of D values
  at::parallel_for(0, 2 * N * H, std::max<int64_t>(1, 4096 / D), [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t side = task / (N * H), row = task % (N * H), i = row / H, h = row % H;
      const float* x = src[side] + row * D;
      const int64_t at = slot[i] * H + h;
      int8_t* out = codes[side] + at * D;
      float amax = 0.f;
      bool nan = false;
      for (int64_t j = 0; j < D; ++j) {
        nan |= std::isnan(x[j]);
        amax = std::max(amax, std::fabs(x[j]));
      }
      if (nan) {
        scales[side][at] = NAN;
        std::fill(out, out + D, int8_t{0});
        continue;
      }
      const float scale = std::max(amax, 1e-8f) / 127.f;
      scales[side][at] = scale;
      for (int64_t j = 0; j < D; ++j)
        out[j] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, std::nearbyint(x[j] / scale))));
    }
  });
}

// SiLU(g) x u of eight lanes: g x sigmoid(g), the sigmoid from e = exp(-|g|) <= 1 (exp8 takes
// x <= 0): 1 / (1 + e) for g >= 0, e / (1 + e) below (relative error ~1e-7 against torch's
// g / (1 + exp(-g)))
inline __m256 silu_mul8(__m256 g, __m256 u) {
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 e = exp8(_mm256_min_ps(g, _mm256_sub_ps(_mm256_setzero_ps(), g)));
  const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(_mm256_set1_ps(1.f), e, neg),
                                   _mm256_add_ps(_mm256_set1_ps(1.f), e));
  return _mm256_mul_ps(_mm256_mul_ps(g, sig), u);
}

template <typename S, typename T>
void silu_mul_rows(const S* src, T* out, int64_t R, int64_t I) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(I, 1));
  at::parallel_for(0, R, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S *g = src + r * 2 * I, *u = g + I;
      T* o = out + r * I;
      int64_t j = 0;
      for (; j + 8 <= I; j += 8) {
        const __m256 y = silu_mul8(load8f(g + j), load8f(u + j));
        if constexpr (std::is_same_v<T, float>)
          _mm256_storeu_ps(o + j, y);
        else
          store8_bf16(o + j, y);
      }
      for (; j < I; ++j) {
        const float gj = static_cast<float>(g[j]), uj = static_cast<float>(u[j]);
        o[j] = static_cast<T>(gj / (1.f + std::exp(-gj)) * uj);
      }
    }
  });
}

// gate_up [R, 2I] fp32 or bf16 contiguous (gate columns first) -> SiLU(gate) x up [R, I] in
// out_dtype
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType out_dtype) {
  const auto in = gate_up.scalar_type();
  TORCH_CHECK(gate_up.dim() == 2 && (in == at::kFloat || in == at::kBFloat16) &&
                  gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gate_up must be a contiguous fp32 or bf16 [rows, 2 x intermediate] tensor");
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "silu_mul writes fp32 or bf16, not ", out_dtype);
  const int64_t R = gate_up.size(0), I = gate_up.size(1) / 2;
  auto out = at::empty({R, I}, gate_up.options().dtype(out_dtype));
  const bool bf16_out = out_dtype == at::kBFloat16;
  if (in == at::kFloat && !bf16_out)
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<float>(), R, I);
  else if (in == at::kFloat)
    silu_mul_rows(gate_up.data_ptr<float>(), out.data_ptr<at::BFloat16>(), R, I);
  else if (!bf16_out)
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<float>(), R, I);
  else
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), R, I);
  return out;
}

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, ScalarType out_dtype) -> Tensor");
  m.def("rope_qkv(Tensor qkv, Tensor cos, Tensor sin, int heads, int kv_heads, Tensor? q_norm, "
        "Tensor? k_norm, float eps) -> Tensor[]");
  m.def("silu_mul(Tensor gate_up, ScalarType out_dtype) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor y, Tensor w, float eps, ScalarType out_dtype) -> Tensor[]");
  m.def("greedy_tokens(Tensor logits) -> Tensor");
  m.def("write_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor slots, Tensor k, Tensor v) -> ()");
  m.def("write_kv_int8(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slots, Tensor k, Tensor v) -> ()");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("rms_norm", &compress_q8::rms_norm);
  m.impl("rope_qkv", &compress_q8::rope_qkv);
  m.impl("silu_mul", &compress_q8::silu_mul);
  m.impl("add_rms_norm", &compress_q8::add_rms_norm);
  m.impl("greedy_tokens", &compress_q8::greedy_tokens);
  m.impl("write_kv", &compress_q8::write_kv);
  m.impl("write_kv_int8", &compress_q8::write_kv_int8);
}
