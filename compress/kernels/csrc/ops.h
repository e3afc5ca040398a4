// The ops of this extension that decode_stack.cpp calls as C++ functions (no dispatcher, no
// Python between them). Each is defined, checked and documented in its own file; the schemas
// are registered there too.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <vector>

namespace compress_q8 {

// q8_dot.cpp: int4 / int8 weights in the row layout, activations rounded to int8 per block
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::optional<at::Tensor>& offsets, int64_t group);
at::Tensor int8_linear_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                          const std::optional<at::Tensor>& offsets, int64_t group);
// q8_tiles.cpp: int4 weights in column tiles
at::Tensor int4_linear_q8_tiles(const at::Tensor& x, const at::Tensor& codes,
                                const at::Tensor& scales, const std::optional<at::Tensor>& offsets,
                                int64_t group);
// bf16_linear.cpp: bf16 weights [N, K], fp32 or bf16 activations, fp32 out
at::Tensor bf16_weight_linear(const at::Tensor& x, const at::Tensor& w);
// q8_amx.cpp: bf16 weights in AMX B-tile order, fp32 out
at::Tensor bf16_linear_tiles_amx(const at::Tensor& x, const at::Tensor& w);
// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, at::ScalarType out_dtype);
std::vector<at::Tensor> rope_qkv(const at::Tensor& qkv, const at::Tensor& cos,
                                 const at::Tensor& sin, int64_t H, int64_t Hkv,
                                 const std::optional<at::Tensor>& q_norm,
                                 const std::optional<at::Tensor>& k_norm, double eps);
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y, const at::Tensor& w,
                                     double eps, at::ScalarType out_dtype);
at::Tensor silu_mul(const at::Tensor& gate_up, at::ScalarType out_dtype);
void write_kv(at::Tensor& k_pool, at::Tensor& v_pool, const at::Tensor& slots,
              const at::Tensor& k, const at::Tensor& v);
void write_kv_int8(at::Tensor& k_pool, at::Tensor& v_pool, at::Tensor& k_scale,
                   at::Tensor& v_scale, const at::Tensor& slots, const at::Tensor& k,
                   const at::Tensor& v);
// paged_attention.cpp
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool,
                                  const at::Tensor& v_pool, const std::optional<at::Tensor>& k_scale,
                                  const std::optional<at::Tensor>& v_scale,
                                  const at::Tensor& tables, const at::Tensor& lengths,
                                  int64_t block_size, double scale, double softcap,
                                  int64_t window, const std::optional<at::Tensor>& sinks);

}  // namespace compress_q8
