// GPTQ's column walk on a CPU, and the exact int4 dequantization of the calibrated passes'
// forwards (compress/kernels/cpu_gptq.py; references: compress.quant.gptq._walk_block and
// compress.kernels.reference.dequantize).
//
// gptq_walk: the torch walk is ~12 small ops a column over all N rows of the block (strided
//   column reads of a row-major block), on one thread because thread hand-offs cost more than
//   they save there. Measured on a Xeon (2 threads), a 7B-shaped layer's GPTQ spent 24% of its
//   time in that loop. Every row of w walks independently (only hinv is shared), so here each
//   thread takes whole rows and walks all of a call's columns on one row, its block row
//   (<= 256 floats) in L1, the update w[j] -= err * hinv[i, j] over contiguous memory. The
//   arithmetic is the reference's: round half to even (nearbyint), IEEE division, the clamp
//   after adding the zero point; the update may contract to FMA as the reference's addr_ may,
//   so a code can differ in a rare tie (tests/kernels/test_cpu_gptq.py bounds it).
// dequantize_int4_exact: (code - zero) * scale in fp32, the reference's operations in its order,
//   so the result is bit-equal to it; the reference path (unpack to int32, then int8, then fp32,
//   subtract, multiply: seven passes over 4-byte temporaries) took 16% of a 7B GPTQ layer's
//   time, re-dequantizing every weight for each calibration sample's forward.
#include "q8_common.h"

namespace compress_q8 {
namespace {

void walk_rows(float* w, const float* hinv, const float* scales, const int8_t* zeros,
               int8_t* codes, float* err, float* losses, const int32_t* cols,
               const int32_t* groups, int64_t width, int64_t start, int64_t stop,
               int64_t stride_w, int64_t stride_s, int64_t stride_z, int64_t stride_c,
               int64_t stride_e, float qmin, float qmax, int64_t r0, int64_t r1) {
  for (int64_t r = r0; r < r1; ++r) {
    float* wr = w + r * stride_w;
    const float* sr = scales + r * stride_s;
    const int8_t* zr = zeros ? zeros + r * stride_z : nullptr;
    float loss = losses[r];
    for (int64_t i = start; i < stop; ++i) {
      const int64_t g = groups[i];
      const float s = sr[g];
      const float z = zr ? static_cast<float>(zr[g]) : 0.0f;
      const float wi = wr[i];
      float q = std::nearbyint(wi / s) + z;
      q = std::min(std::max(q, qmin), qmax);
      codes[r * stride_c + cols[i]] = static_cast<int8_t>(q);
      const float e = (wi - (q - z) * s) / hinv[i * width + i];
      loss += e * e;
      const float* h = hinv + i * width;
      for (int64_t j = i; j < width; ++j) wr[j] -= e * h[j];
      err[r * stride_e + i] = e;
    }
    losses[r] = loss;
  }
}

void gptq_walk(at::Tensor w, const at::Tensor& hinv, const at::Tensor& scales,
               const std::optional<at::Tensor>& zeros, at::Tensor codes, at::Tensor err,
               at::Tensor losses, const at::Tensor& cols, const at::Tensor& groups,
               int64_t start, int64_t stop, int64_t qmin, int64_t qmax) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.stride(1) == 1,
              "w must be an fp32 [N, width] block with unit column stride");
  const int64_t N = w.size(0), width = w.size(1);
  TORCH_CHECK(hinv.scalar_type() == at::kFloat && hinv.is_contiguous() &&
                  hinv.size(0) == width && hinv.size(1) == width,
              "hinv must be a contiguous fp32 [width, width] tensor");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 2 && scales.size(0) == N &&
                  scales.stride(1) == 1,
              "scales must be fp32 [N, groups] with unit column stride");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 2 && codes.size(0) == N &&
                  codes.stride(1) == 1,
              "codes must be int8 [N, K] with unit column stride");
  TORCH_CHECK(err.scalar_type() == at::kFloat && err.dim() == 2 && err.size(0) == N &&
                  err.size(1) == width && err.stride(1) == 1,
              "err must be fp32 [N, width] with unit column stride");
  TORCH_CHECK(losses.scalar_type() == at::kFloat && losses.is_contiguous() &&
                  losses.numel() == N,
              "losses must be a contiguous fp32 [N] tensor");
  TORCH_CHECK(cols.scalar_type() == at::kInt && groups.scalar_type() == at::kInt &&
                  cols.is_contiguous() && groups.is_contiguous() && cols.numel() == width &&
                  groups.numel() == width,
              "cols and groups must be contiguous int32 [width] tensors");
  TORCH_CHECK(0 <= start && start <= stop && stop <= width, "columns ", start, "..", stop,
              " outside 0..", width);
  const int32_t* col = cols.data_ptr<int32_t>();
  const int32_t* grp = groups.data_ptr<int32_t>();
  for (int64_t i = start; i < stop; ++i)
    TORCH_CHECK(0 <= col[i] && col[i] < codes.size(1) && 0 <= grp[i] && grp[i] < scales.size(1),
                "column ", i, " indexes outside codes or scales");
  const int8_t* zp = nullptr;
  int64_t stride_z = 0;
  if (zeros.has_value()) {
    TORCH_CHECK(zeros->scalar_type() == at::kChar && zeros->dim() == 2 &&
                    zeros->sizes() == scales.sizes() && zeros->stride(1) == 1,
                "zeros must be int8 shaped as scales, with unit column stride");
    zp = zeros->data_ptr<int8_t>();
    stride_z = zeros->stride(0);
  }
  float* wp = w.data_ptr<float>();
  const float* hp = hinv.data_ptr<float>();
  const float* sp = scales.data_ptr<float>();
  int8_t* cp = codes.data_ptr<int8_t>();
  float* ep = err.data_ptr<float>();
  float* lp = losses.data_ptr<float>();
  const int64_t sw = w.stride(0), ss = scales.stride(0), sc = codes.stride(0), se = err.stride(0);
  const float lo = static_cast<float>(qmin), hi = static_cast<float>(qmax);
  at::parallel_for(0, N, 16, [&](int64_t r0, int64_t r1) {
    walk_rows(wp, hp, sp, zp, cp, ep, lp, col, grp, width, start, stop, sw, ss, stride_z, sc, se,
              lo, hi, r0, r1);
  });
}

// packed [N, K/8] int32 (eight 4-bit codes a word, low nibble first, stored +8), scales
// [N, K/g] fp32, zeros packed [N/8, K/g] int32 along N (or none) -> fp32 [N, K]
at::Tensor dequantize_int4_exact(const at::Tensor& packed, const at::Tensor& scales,
                                 const std::optional<at::Tensor>& zeros, int64_t K,
                                 int64_t group) {
  TORCH_CHECK(packed.scalar_type() == at::kInt && packed.dim() == 2 && packed.is_contiguous(),
              "packed must be a contiguous int32 [N, K/8] tensor");
  const int64_t N = packed.size(0), words = packed.size(1);
  TORCH_CHECK(group > 0 && K > 0 && K % group == 0 && words * 8 >= K,
              "K must be a positive multiple of the group size the words can hold");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() &&
                  scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group,
              "scales must be a contiguous fp32 [N, K / group] tensor");
  const int32_t* zp = nullptr;
  if (zeros.has_value()) {
    TORCH_CHECK(zeros->scalar_type() == at::kInt && zeros->is_contiguous() &&
                    zeros->dim() == 2 && zeros->size(0) * 8 >= N &&
                    zeros->size(1) == K / group,
                "zeros must be a contiguous int32 [N/8, K / group] tensor (packed along N)");
    zp = zeros->data_ptr<int32_t>();
  }
  auto out = at::empty({N, K}, packed.options().dtype(at::kFloat));
  const int32_t* pp = packed.data_ptr<int32_t>();
  const float* sp = scales.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t G = K / group;
  at::parallel_for(0, N, 8, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(pp + r * words);
      float* o = op + r * K;
      for (int64_t g = 0; g < G; ++g) {
        const float s = sp[r * G + g];
        float z = 0.0f;
        if (zp) {
          const uint32_t word = static_cast<uint32_t>(zp[(r / 8) * G + g]);
          z = static_cast<float>(static_cast<int32_t>((word >> (4 * (r % 8))) & 0xF) - 8);
        }
        if (group % 8 == 0) {  // whole words: eight codes from each, low nibble first
          for (int64_t wd = g * group / 8; wd < (g + 1) * group / 8; ++wd) {
            const uint32_t word = row[wd];
            float* ow = o + wd * 8;
            for (int j = 0; j < 8; ++j)
              ow[j] = (static_cast<float>(static_cast<int32_t>((word >> (4 * j)) & 0xF) - 8) -
                       z) * s;
          }
          continue;
        }
        for (int64_t k = g * group; k < (g + 1) * group; ++k) {
          const int32_t code = static_cast<int32_t>((row[k / 8] >> (4 * (k % 8))) & 0xF) - 8;
          o[k] = (static_cast<float>(code) - z) * s;
        }
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace compress_q8

TORCH_LIBRARY_FRAGMENT(COMPRESS_OPS, m) {
  m.def("gptq_walk(Tensor(a!) w, Tensor hinv, Tensor scales, Tensor? zeros, Tensor(b!) codes, "
        "Tensor(c!) err, Tensor(d!) losses, Tensor cols, Tensor groups, int start, int stop, "
        "int qmin, int qmax) -> ()");
  m.def("dequantize_int4_exact(Tensor packed, Tensor scales, Tensor? zeros, int K, int group) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(COMPRESS_OPS, CPU, m) {
  m.impl("gptq_walk", &compress_q8::gptq_walk);
  m.impl("dequantize_int4_exact", &compress_q8::dequantize_int4_exact);
}
