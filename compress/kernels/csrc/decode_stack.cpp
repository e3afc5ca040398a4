// A decode step's decoder layers in one C++ call (compress.runtime.decode_stack builds it from
// the runtime's layer holders; compress.runtime.paged.forward_step calls it on decode-only
// steps). Each layer runs the same ops, on the same tensors, in the same order as the Python
// layer's fused path (runtime/layers.py: _Layer._project_qkv_fused, the paged write and decode
// attention of forward_step, _Layer._finish_fused), so the result is bit for bit the Python
// path's: that path is the reference, and tests/runtime/test_decode_stack.py holds it to it.
// What it saves is the host code between the ops: on an AMD EPYC Zen 3 (2 threads) the Python
// and dispatcher work between them was about half of a one-row SmolLM2 W4 step.
//
//   norm_in -> qkv -> rope (+ per-head q/k norms) -> write k, v to the pages -> paged attention
//   -> o -> residual add + post-attention norm -> gate_up -> SiLU(gate) x up -> down -> add
//
// A linear is one of the runtime's holders, described by its kind (Linear::Kind) and tensors;
// the input is cast the way that holder casts it, and the output is the holder's native one
// (bf16 for a bf16 float layer without bias; fp32 plus the bias otherwise), as
// layers._native_out leaves it.
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

struct Layer {
  std::optional<at::Tensor> norm_in;  // fp32 [hidden]; none: the input as it is
  at::Tensor norm_post;               // fp32 [hidden]
  double eps = 1e-6;
  int64_t qkv = 0, o = 0, gate_up = 0, down = 0;  // indices into DecodeStack::linears_
  at::ScalarType qkv_in = at::kFloat, gate_up_in = at::kFloat, down_in = at::kFloat;
  int64_t heads = 0, kv_heads = 0, head_dim = 0, rope = 0, window = 0;
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

  void add_layer(std::optional<at::Tensor> norm_in, at::Tensor norm_post, double eps,
                 std::vector<int64_t> linears, std::vector<int64_t> bf16_inputs,
                 std::vector<int64_t> heads, std::optional<at::Tensor> q_norm,
                 std::optional<at::Tensor> k_norm, double scale, double softcap, int64_t window,
                 std::optional<at::Tensor> sinks) {
    TORCH_CHECK(linears.size() == 4 && bf16_inputs.size() == 3 && heads.size() == 4,
                "decode stack: a layer takes 4 linears (qkv, o, gate_up, down), 3 input dtypes "
                "(qkv, gate_up, down) and (heads, kv_heads, head_dim, rope table)");
    for (int64_t i : linears)
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(linears_.size()),
                  "decode stack: linear ", i, " was not added");
    for (const auto* w : {&norm_in, &q_norm, &k_norm, &sinks})
      if (*w)
        TORCH_CHECK((*w)->scalar_type() == at::kFloat && (*w)->dim() == 1 &&
                        (*w)->is_contiguous(),
                    "decode stack: norm weights and sinks are contiguous fp32 vectors");
    Layer l;
    l.norm_in = std::move(norm_in);
    l.norm_post = std::move(norm_post);
    l.eps = eps;
    l.qkv = linears[0], l.o = linears[1], l.gate_up = linears[2], l.down = linears[3];
    l.qkv_in = dtype_of(bf16_inputs[0]);
    l.gate_up_in = dtype_of(bf16_inputs[1]);
    l.down_in = dtype_of(bf16_inputs[2]);
    l.heads = heads[0], l.kv_heads = heads[1], l.head_dim = heads[2], l.rope = heads[3];
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
    l.scale = scale, l.softcap = softcap, l.window = window;
    l.sinks = std::move(sinks);
    layers_.push_back(std::move(l));
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
      const at::Tensor h = l.norm_in ? rms_norm(x, *l.norm_in, l.eps, l.qkv_in) : x.to(l.qkv_in);
      const at::Tensor qkv = linears_[l.qkv](h).contiguous();
      const auto qkv_heads = rope_qkv(qkv, cos[l.rope], sin[l.rope], l.heads, l.kv_heads,
                                      l.q_norm, l.k_norm, l.eps);
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
      const at::Tensor attn = linears_[l.o](a.view({rows, l.heads * l.head_dim})).contiguous();
      const auto summed = add_rms_norm(x, attn, l.norm_post, l.eps, l.gate_up_in);
      const at::Tensor up = silu_mul(linears_[l.gate_up](summed[1]).contiguous(), l.down_in);
      x = at::add(summed[0], linears_[l.down](up));
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
