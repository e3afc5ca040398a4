// A decode step's decoder layers in one C++ call (compress.runtime.decode_stack builds it from
// the runtime's layer holders; compress.runtime.paged.forward_step calls it on decode-only
// steps). Each layer runs the same ops, on the same tensors, in the same order as the Python
// layer (runtime/layers.py: _Layer._project_qkv_fused or project_qkv's torch ops, the paged
// write and decode attention of forward_step, then _Layer._finish_fused or _Layer.finish with
// _mlp and _block_out), so the
// result is bit for bit the Python path's: that path is the reference, and
// tests/runtime/test_decode_stack.py holds it to it. What it saves is the host code between the
// ops: on an AMD EPYC Zen 3 (2 threads) the Python and dispatcher work between them was about
// half of a one-row SmolLM2 W4 step (docs/notes/2026-12-07-decode-stack.md).
//
//   norm_in -> qkv -> rope (+ per-head q/k norms) -> write k, v to the pages -> paged attention
//   -> o -> residual add + post-attention norm -> gate_up -> SiLU(gate) x up -> down -> add
//   (or the unfused forms: torch's norms, LayerNorm, q/k norms, permuted RoPE, activations,
//   post-block norms, multipliers, parallel blocks)
//
// A linear is one of the runtime's holders, described by its kind (Linear::Kind) and tensors;
// the input is cast the way that holder casts it, and the output is the holder's native one
// (bf16 for a bf16 float layer without bias; fp32 plus the bias otherwise), as
// layers._native_out leaves it (DecodeStack::forward widens it to fp32, as a holder's forward).
#include "ops.h"
#include "q8_common.h"

#include <torch/custom_class.h>

#include <string>

namespace compress_q8 {
namespace {

// oneDNN's linear over a weight that mkldnn::_reorder_linear_weight packed (what
// _FloatLinear.onednn calls), boxed: the schema's argument types vary between torch versions
at::Tensor onednn_linear(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack;
  stack.reserve(6);
  stack.emplace_back(x);
  stack.emplace_back(packed);
  stack.emplace_back();  // no bias
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<std::optional<at::Scalar>>());
  stack.emplace_back(std::string(""));
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

at::ScalarType dtype_of(int64_t bf16) { return bf16 ? at::kBFloat16 : at::kFloat; }

// x [N, Hkv, D] fp32 into rows `slots` of fp8 e4m3fn pages as PagedKVCache.write does in
// torch, with the same ATen ops (so the same bytes): x / the layer's scale [1], saturated at
// +-448
void write_fp8(at::Tensor& pool, const at::Tensor& scale, const at::Tensor& slots,
               const at::Tensor& x) {
  const at::Tensor q = (x / scale).clamp(-448.0, 448.0).to(at::kFloat8_e4m3fn);
  pool.view(at::kByte).index_copy_(0, slots, q.view(at::kByte));
}

}  // namespace

struct Linear {
  // the runtime holders these stand for (compress.runtime.decode_stack.KINDS says which)
  enum Kind : int64_t {
    Q4_TILES = 1,   // int4 column tiles: a = codes, b = scales, c = offsets
    Q4_ROWS = 2,    // int4 row layout: the same
    Q8_ROWS = 3,    // int8 row layout: the same
    BF16_WEIGHT = 4,  // a = bf16 [N, K] (bf16_weight_linear)
    BF16_TILES_AMX = 5,  // a = bf16 B tiles (bf16_linear_tiles_amx)
    DENSE = 6,      // a = [N, K] for at::linear; c = oneDNN-packed a from `packed_rows` rows
    ONEDNN = 7,     // a = oneDNN-packed
  };
  int64_t kind = 0;
  at::Tensor a, b;
  std::optional<at::Tensor> c, bias;
  int64_t group = 0, packed_rows = 0;
  at::ScalarType cast = at::kFloat;  // DENSE, ONEDNN: the dtype the input is cast to

  at::Tensor operator()(const at::Tensor& x) const {
    at::Tensor y;
    switch (kind) {
      case Q4_TILES:
        y = int4_linear_q8_tiles(x.to(at::kFloat).contiguous(), a, b, c, group);
        break;
      case Q4_ROWS:
        y = int4_linear_q8(x.to(at::kFloat).contiguous(), a, b, c, group);
        break;
      case Q8_ROWS:
        y = int8_linear_q8(x.to(at::kFloat).contiguous(), a, b, c, group);
        break;
      case BF16_WEIGHT:
      case BF16_TILES_AMX: {
        // bf16 input stays bf16, any other is widened (_FloatLinear.native)
        const at::Tensor x2 = x.scalar_type() == at::kBFloat16 ? x : x.to(at::kFloat);
        y = kind == BF16_WEIGHT ? bf16_weight_linear(x2.contiguous(), a)
                                : bf16_linear_tiles_amx(x2.contiguous(), a);
        break;
      }
      case DENSE:
        y = c && x.size(0) >= packed_rows ? onednn_linear(x.to(cast).contiguous(), *c)
                                          : at::linear(x.to(cast), a);
        break;
      case ONEDNN:
        y = onednn_linear(x.to(cast).contiguous(), a);
        break;
      default:
        TORCH_CHECK(false, "decode stack: linear kind ", kind, " unknown");
    }
    return bias ? at::add(y.to(at::kFloat), *bias) : y;
  }
};

// The runtime's MLP activations (runtime/families.ACTIVATIONS), by the ATen op each is
enum Act : int64_t { SILU = 0, GELU_TANH = 1, GELU = 2, RELU = 3, RELU2 = 4 };

at::Tensor activate(const at::Tensor& x, int64_t act) {
  switch (act) {
    case SILU: return at::silu(x);
    case GELU_TANH: return at::gelu(x, "tanh");
    case GELU: return at::gelu(x);
    case RELU: return at::relu(x);
    case RELU2: return at::square(at::relu(x));
    default: TORCH_CHECK(false, "decode stack: activation ", act, " unknown");
  }
}

// norms.py's _rms_norm, op for op: w * (x * rsqrt(mean(x^2) + eps))
at::Tensor rms_norm_aten(const at::Tensor& x, const at::Tensor& w, double eps) {
  return w * (x * at::rsqrt(x.pow(2).mean({-1}, true) + eps));
}

// norms.py's _norm: RMSNorm (torch's ops) plus an optional bias, or LayerNorm (`centered`)
at::Tensor norm_aten(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                     double eps, bool centered) {
  if (centered) return at::layer_norm(x, {x.size(-1)}, w, bias, eps);
  const at::Tensor y = rms_norm_aten(x, w, eps);
  return bias ? y + *bias : y;
}

// layers._rotate: x * cos + rotate_half(x) * sin
at::Tensor rotate(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t d = x.size(-1), half = d / 2;
  const at::Tensor rotated = at::cat({-x.narrow(-1, half, d - half), x.narrow(-1, 0, half)}, -1);
  return x * cos + rotated * sin;
}

struct Layer {
  std::optional<at::Tensor> norm_in, norm_post, norm_post_bias;  // fp32 [hidden]
  std::optional<at::Tensor> norm_in_bias, rope_perm;  // LayerNorm's bias; int64 [head_dim]
  bool fused_qkv = true;  // _Layer._project_qkv_fused, else project_qkv's torch ops
  bool centered = false, parallel = false, qkv_per_head = false;
  bool qk_norm_heads = false, qk_norm_after_rope = false;
  int64_t q = -1, k = -1, v = -1;  // separate projections (qkv -1)
  std::optional<at::Tensor> attn_out_norm, mlp_out_norm;          // after o, after down
  double eps = 1e-6;
  std::optional<double> residual_multiplier;
  // indices into DecodeStack::linears_; -1: none (gate_up, or gate and up, or up alone)
  int64_t qkv = -1, o = -1, gate_up = -1, down = -1, gate = -1, up = -1;
  at::ScalarType qkv_in = at::kFloat, gate_up_in = at::kFloat, down_in = at::kFloat;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rope = 0, window = 0, act = SILU;
  bool fused_finish = false;  // _Layer._finish_fused (SiLU, one gate/up call), else finish
  std::optional<at::Tensor> q_norm, k_norm, sinks;
  double scale = 1.0, softcap = 0.0;
};

struct DecodeStack : torch::CustomClassHolder {
  std::vector<Linear> linears_;
  std::vector<Layer> layers_;

  // -> the linear's index, for add_layer
  int64_t add_linear(int64_t kind, at::Tensor a, std::optional<at::Tensor> b,
                     std::optional<at::Tensor> c, int64_t group, std::optional<at::Tensor> bias,
                     int64_t cast_bf16, int64_t packed_rows) {
    TORCH_CHECK(kind >= Linear::Q4_TILES && kind <= Linear::ONEDNN, "decode stack: linear kind ",
                kind, " unknown");
    const bool codes = kind <= Linear::Q8_ROWS;
    TORCH_CHECK(codes == b.has_value(), "decode stack: scales go with int codes only");
    TORCH_CHECK(!c || codes || kind == Linear::DENSE,
                "decode stack: a third tensor is an int layer's offsets or a dense layer's "
                "packed copy");
    if (bias)
      TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->dim() == 1 && bias->is_contiguous(),
                  "decode stack: a bias is a contiguous fp32 [N] tensor");
    Linear l;
    l.kind = kind;
    l.a = std::move(a);
    if (b) l.b = *b;
    l.c = std::move(c);
    l.bias = std::move(bias);
    l.group = group;
    l.cast = dtype_of(cast_bf16);
    l.packed_rows = packed_rows;
    linears_.push_back(std::move(l));
    return static_cast<int64_t>(linears_.size()) - 1;
  }

  // norms: norm_in, norm_post, norm_post_bias, attn_out_norm, mlp_out_norm, q_norm, k_norm,
  // sinks, norm_in_bias (each fp32 or none), rope_perm (int64 or none); linears: qkv, o,
  // gate_up, down, gate, up, q, k, v (-1: none); bf16_inputs: what the fused norms write for
  // qkv, gate_up and down (1: bf16, 0: fp32); ints: heads, kv_heads, head_dim, rope table,
  // window (0: none), activation (Act), then 0/1 flags: fused finish, fused qkv, centered,
  // parallel, qkv per head, q/k norms over all heads, q/k norms after RoPE; floats: eps,
  // attention scale, softcap (0: none), residual multiplier (NaN: none)
  void add_layer(std::vector<std::optional<at::Tensor>> norms, std::vector<int64_t> linears,
                 std::vector<int64_t> bf16_inputs, std::vector<int64_t> ints,
                 std::vector<double> floats) {
    TORCH_CHECK(norms.size() == 10 && linears.size() == 9 && bf16_inputs.size() == 3 &&
                    ints.size() == 13 && floats.size() == 4,
                "decode stack: a layer takes 10 norm slots, 9 linear slots, 3 input dtypes, 13 "
                "ints and 4 floats");
    for (int64_t i : linears)
      TORCH_CHECK(i >= -1 && i < static_cast<int64_t>(linears_.size()),
                  "decode stack: linear ", i, " was not added");
    for (size_t i = 0; i < 9; ++i)
      if (norms[i])
        TORCH_CHECK(norms[i]->scalar_type() == at::kFloat && norms[i]->dim() == 1 &&
                        norms[i]->is_contiguous(),
                    "decode stack: norm weights, biases and sinks are contiguous fp32 vectors");
    if (norms[9])
      TORCH_CHECK(norms[9]->scalar_type() == at::kLong && norms[9]->dim() == 1,
                  "decode stack: rope_perm is an int64 [head_dim] index");
    Layer l;
    l.norm_in = norms[0], l.norm_post = norms[1], l.norm_post_bias = norms[2];
    l.attn_out_norm = norms[3], l.mlp_out_norm = norms[4];
    l.q_norm = norms[5], l.k_norm = norms[6], l.sinks = norms[7];
    l.norm_in_bias = norms[8], l.rope_perm = norms[9];
    l.qkv = linears[0], l.o = linears[1], l.gate_up = linears[2], l.down = linears[3];
    l.gate = linears[4], l.up = linears[5], l.q = linears[6], l.k = linears[7], l.v = linears[8];
    TORCH_CHECK((l.qkv >= 0) != (l.q >= 0 && l.k >= 0 && l.v >= 0) && l.o >= 0 && l.down >= 0 &&
                    (l.gate_up >= 0 || l.up >= 0) && (l.gate_up < 0 || (l.gate < 0 && l.up < 0)),
                "decode stack: a layer has qkv or q, k and v; o; down; and gate_up or (gate "
                "and) up");
    TORCH_CHECK(l.q_norm.has_value() == l.k_norm.has_value(),
                "decode stack: q and k norms come together");
    l.qkv_in = dtype_of(bf16_inputs[0]);
    l.gate_up_in = dtype_of(bf16_inputs[1]);
    l.down_in = dtype_of(bf16_inputs[2]);
    l.heads = ints[0], l.kv_heads = ints[1], l.head_dim = ints[2], l.rope = ints[3];
    l.window = ints[4], l.act = ints[5], l.fused_finish = ints[6] != 0;
    l.fused_qkv = ints[7] != 0, l.centered = ints[8] != 0, l.parallel = ints[9] != 0;
    l.qkv_per_head = ints[10] != 0, l.qk_norm_heads = ints[11] != 0;
    l.qk_norm_after_rope = ints[12] != 0;
    TORCH_CHECK(!l.fused_qkv || (l.qkv >= 0 && !l.centered && !l.qkv_per_head &&
                                 !l.qk_norm_heads && !l.qk_norm_after_rope && !l.rope_perm),
                "decode stack: the fused projection is RMSNorm over one [q; k; v] call with "
                "per-head q/k norms before unpermuted RoPE");
    TORCH_CHECK(!l.parallel || (!l.fused_finish && (l.norm_post || l.norm_in)),
                "decode stack: a parallel block takes the unfused finish and a norm");
    TORCH_CHECK(l.act >= SILU && l.act <= RELU2, "decode stack: activation ", l.act, " unknown");
    TORCH_CHECK(!l.fused_finish || (l.act == SILU && l.gate_up >= 0),
                "decode stack: the fused finish is SiLU over one gate/up call");
    l.eps = floats[0], l.scale = floats[1], l.softcap = floats[2];
    if (!std::isnan(floats[3])) l.residual_multiplier = floats[3];
    layers_.push_back(std::move(l));
  }

  // _Layer._block_out: what a block adds to the residual (post-normed, scaled)
  at::Tensor block_out(at::Tensor y, const Layer& l, const std::optional<at::Tensor>& norm) const {
    if (norm) y = rms_norm_aten(y, *norm, l.eps);
    if (l.residual_multiplier) y = y * *l.residual_multiplier;
    return y;
  }

  at::Tensor forward(int64_t i, const at::Tensor& x) const {  // a holder's forward: fp32 out
    return linears_[i](x).to(at::kFloat);
  }

  // _Layer._finish_fused, the branches it takes
  at::Tensor finish_fused(at::Tensor x, const at::Tensor& a, const Layer& l) const {
    at::Tensor h;
    if (!l.norm_post) {
      x = x + block_out(forward(l.o, a), l, l.attn_out_norm);
      h = x.to(l.gate_up_in);
    } else if (!l.attn_out_norm && !l.residual_multiplier) {
      const auto summed = add_rms_norm(x, linears_[l.o](a).contiguous(), *l.norm_post, l.eps,
                                       l.gate_up_in);
      x = summed[0], h = summed[1];
    } else {
      x = x + block_out(forward(l.o, a), l, l.attn_out_norm);
      h = rms_norm(x, *l.norm_post, l.eps, l.gate_up_in);
    }
    const at::Tensor up = silu_mul(linears_[l.gate_up](h).contiguous(), l.down_in);
    if (!l.mlp_out_norm && !l.residual_multiplier) return at::add(x, linears_[l.down](up));
    return x + block_out(forward(l.down, up), l, l.mlp_out_norm);
  }

  // _Layer._mlp on its normed input (fp32)
  at::Tensor mlp(const at::Tensor& h, const Layer& l) const {
    if (l.gate_up >= 0) {
      const auto parts = forward(l.gate_up, h).chunk(2, -1);
      return forward(l.down, activate(parts[0], l.act) * parts[1]);
    }
    if (l.gate >= 0) return forward(l.down, activate(forward(l.gate, h), l.act) * forward(l.up, h));
    return forward(l.down, activate(forward(l.up, h), l.act));
  }

  // _Layer.finish: torch's ops, as the Python layer runs them
  at::Tensor finish(at::Tensor x, const at::Tensor& a, const Layer& l) const {
    if (l.parallel) {  // the MLP reads a norm of the block's input (its own, or attention's)
      const bool own = l.norm_post.has_value();
      const at::Tensor h = norm_aten(x, own ? *l.norm_post : *l.norm_in,
                                     own ? l.norm_post_bias : l.norm_in_bias, l.eps, l.centered);
      return x + block_out(forward(l.o, a), l, std::nullopt) +
             block_out(mlp(h, l), l, std::nullopt);
    }
    x = x + block_out(forward(l.o, a), l, l.attn_out_norm);
    const at::Tensor h =
        l.norm_post ? norm_aten(x, *l.norm_post, l.norm_post_bias, l.eps, l.centered) : x;
    return x + block_out(mlp(h, l), l, l.mlp_out_norm);
  }

  // _Layer.project_qkv's torch ops (the unfused form): x [R, hidden] -> q [R, heads, D], k and
  // v [R, kv_heads, D] fp32
  std::vector<at::Tensor> project(const at::Tensor& x, const at::Tensor& cos,
                                  const at::Tensor& sin, const Layer& l) const {
    const int64_t R = x.size(0), H = l.heads, Hkv = l.kv_heads, D = l.head_dim;
    const at::Tensor h =
        l.norm_in ? norm_aten(x, *l.norm_in, l.norm_in_bias, l.eps, l.centered) : x;
    at::Tensor q, k, v;
    if (l.qkv >= 0 && l.qkv_per_head) {  // [R, heads, 3, D]: q, k, v per head
      const auto parts = forward(l.qkv, h).view({R, H, 3, D}).unbind(2);
      q = parts[0], k = parts[1], v = parts[2];
    } else if (l.qkv >= 0) {
      const at::Tensor y = forward(l.qkv, h);
      const auto parts = y.split_with_sizes({y.size(-1) - 2 * Hkv * D, Hkv * D, Hkv * D}, -1);
      q = parts[0], k = parts[1], v = parts[2];
    } else {
      q = forward(l.q, h), k = forward(l.k, h), v = forward(l.v, h);
    }
    if (l.q_norm && l.qk_norm_heads)
      q = rms_norm_aten(q, *l.q_norm, l.eps), k = rms_norm_aten(k, *l.k_norm, l.eps);
    q = q.view({R, H, D}), k = k.view({R, Hkv, D});
    const bool per_head = l.q_norm && !l.qk_norm_heads;
    if (per_head && !l.qk_norm_after_rope)
      q = rms_norm_aten(q, *l.q_norm, l.eps), k = rms_norm_aten(k, *l.k_norm, l.eps);
    if (l.rope_perm) q = q.index_select(-1, *l.rope_perm), k = k.index_select(-1, *l.rope_perm);
    const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);  // [R, 1, D]
    q = rotate(q, c, s), k = rotate(k, c, s);
    if (per_head && l.qk_norm_after_rope)
      q = rms_norm_aten(q, *l.q_norm, l.eps), k = rms_norm_aten(k, *l.k_norm, l.eps);
    return {q.contiguous(), k.contiguous(), v.view({R, Hkv, D}).contiguous()};
  }

  int64_t layers() const { return static_cast<int64_t>(layers_.size()); }

  // x [R, hidden] fp32 (the embedded decode rows); cos, sin: [R, head_dim] fp32 per rope
  // table; slots [R] where each row's new key goes; tables [R, blocks], lengths [R]: each
  // row's keys (PagedKVCache); k_pools, v_pools: each layer's pages (fp32, bf16, or int8 or
  // fp8 with k_scales, v_scales: one each per layer; none for the others) -> [R, hidden]
  at::Tensor run(at::Tensor x, std::vector<at::Tensor> cos, std::vector<at::Tensor> sin,
                 at::Tensor slots, at::Tensor tables, at::Tensor lengths,
                 std::vector<at::Tensor> k_pools, std::vector<at::Tensor> v_pools,
                 std::vector<at::Tensor> k_scales, std::vector<at::Tensor> v_scales,
                 int64_t block_size) {
    const int64_t n = layers();
    TORCH_CHECK(static_cast<int64_t>(k_pools.size()) == n &&
                    static_cast<int64_t>(v_pools.size()) == n,
                "decode stack: ", n, " layers, ", k_pools.size(), " key and ", v_pools.size(),
                " value pools");
    const bool codes = !k_scales.empty();
    TORCH_CHECK(k_scales.size() == v_scales.size() &&
                    (!codes || static_cast<int64_t>(k_scales.size()) == n),
                "decode stack: a key and a value scale tensor per layer (int8 or fp8 pages), "
                "or none");
    TORCH_CHECK(cos.size() == sin.size(), "decode stack: a sin table per cos table");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat,
                "decode stack: x must be fp32 [rows, hidden]");
    x = x.contiguous();
    const int64_t rows = x.size(0);
    for (int64_t i = 0; i < n; ++i) {
      const Layer& l = layers_[i];
      TORCH_CHECK(l.rope >= 0 && l.rope < static_cast<int64_t>(cos.size()),
                  "decode stack: layer ", i, " reads rope table ", l.rope, " of ", cos.size());
      std::vector<at::Tensor> qkv_heads;
      if (l.fused_qkv) {
        const at::Tensor h =
            l.norm_in ? rms_norm(x, *l.norm_in, l.eps, l.qkv_in) : x.to(l.qkv_in);
        qkv_heads = rope_qkv(linears_[l.qkv](h).contiguous(), cos[l.rope], sin[l.rope], l.heads,
                             l.kv_heads, l.q_norm, l.k_norm, l.eps);
      } else {
        qkv_heads = project(x, cos[l.rope], sin[l.rope], l);
      }
      std::optional<at::Tensor> k_scale, v_scale;
      if (codes) {
        k_scale = k_scales[i], v_scale = v_scales[i];
        if (k_pools[i].scalar_type() == at::kChar) {
          write_kv_int8(k_pools[i], v_pools[i], k_scales[i], v_scales[i], slots, qkv_heads[1],
                        qkv_heads[2]);
        } else {
          write_fp8(k_pools[i], k_scales[i], slots, qkv_heads[1]);
          write_fp8(v_pools[i], v_scales[i], slots, qkv_heads[2]);
        }
      } else {
        write_kv(k_pools[i], v_pools[i], slots, qkv_heads[1], qkv_heads[2]);
      }
      const at::Tensor a = paged_decode_attention(
          qkv_heads[0], k_pools[i], v_pools[i], k_scale, v_scale, tables, lengths, block_size,
          l.scale, l.softcap, l.window, l.sinks);
      const at::Tensor attn = a.view({rows, l.heads * l.head_dim});
      x = l.fused_finish ? finish_fused(x, attn, l) : finish(x, attn, l);
    }
    return x;
  }
};

}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.class_<compress_q8::DecodeStack>("DecodeStack")
      .def(torch::init<>())
      .def("add_linear", &compress_q8::DecodeStack::add_linear)
      .def("add_layer", &compress_q8::DecodeStack::add_layer)
      .def("layers", &compress_q8::DecodeStack::layers)
      .def("run", &compress_q8::DecodeStack::run);
}
