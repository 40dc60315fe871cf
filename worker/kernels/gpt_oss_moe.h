// Kernels of GPT-OSS's sparse MoE block (HF GptOssMLP = GptOssTopKRouter + GptOssExperts; the math is
// written out in worker/compute/cpu/gpt_oss_math.h) that differ from Qwen3-MoE's: the router's top-k
// of the biased logits with the softmax over the k selected ones, the experts' clamped SwiGLU on the
// interleaved gate_up output with its bias, the combine with the down bias, and their backward. The
// grouping, the row gather, the scatter-add and the probability sums are moe.h's (same grouped
// layout); the GEMMs run through GemmRunner (worker/compute/cuda/cuda_moe.h drives the block).
//
// Numerics are HF transformers 5.17 under torch.autocast(bf16) with FP32 master weights: the GEMM
// outputs are BF16, the biases are added to them in FP32 (an FP32 parameter plus a BF16 tensor is
// FP32), the SwiGLU and the combine are FP32, the routing weights are BF16 (softmax with
// dtype=top_v.dtype). Here the biases are the BF16 copies the worker holds (HF adds the FP32 master).
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. Deterministic: fixed
// reduction orders, no atomics (bitwise repeatable).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// The experts' clamped SwiGLU constants (GptOssExperts.alpha, .limit; MoeDims::swiglu_*).
struct GptOssGluParams {
  float alpha = 1.702f;
  float limit = 7.0f;
};

// Router, per token t (one warp each; experts <= kMoeMaxExperts of moe.h):
//   z      = float(bf16(acc[t, e] + float(bias[e])))   the BF16 logits of F.linear(x, Wr, br) under
//                                                       autocast: the FP32 GEMM accumulator plus the
//                                                       bias, rounded once (cuBLASLt's bias epilogue)
//   probs  = softmax(z) in FP32 (max subtracted, expf, sum, division): the aux loss's statistics
//            (load_balancing_loss_func softmaxes the raw logits)
//   topk_expert = the k largest z by repeated arg-max, largest first, equal logits (and NaN) to the
//            lower expert (the CPU reference's rule; torch.topk fixes none)
//   topk_weight = float(bf16(softmax over the k selected z, in FP32)): softmax(top_v, dtype=bf16)
// acc [T, acc_ld] FP32 (the router GEMM's output without its bias), bias [E] BF16; probs [T, E],
// topk_expert [T, k], topk_weight [T, k] (BF16 values held in FP32).
absl::Status GptOssRouteTopK(const float* acc, int64_t acc_ld, const bf16* bias, int64_t tokens, int64_t experts,
                             int64_t top_k, float* probs, int32_t* topk_expert, float* topk_weight,
                             cudaStream_t stream);

// One expert's clamped SwiGLU, rows [rows, 2I] of its gate_up GEMM output gu (BF16, gate in the even
// columns, up in the odd ones) plus its bias [2I] (BF16), in FP32:
//   g = float(gu[2i]) + b[2i], u = float(gu[2i+1]) + b[2i+1]
//   act[i] = bf16((clamp(u, -limit, limit) + 1) * min(g, limit) * sigmoid(alpha * min(g, limit)))
// (NaN passes through the clamps, as torch.clamp). act [rows, I] is the down GEMM's BF16 input.
absl::Status GptOssGluForward(const bf16* gu, const bf16* bias, int64_t rows, int64_t inter, GptOssGluParams glu,
                              bf16* act, cudaStream_t stream);

// Its backward from dact [rows, I] (BF16: the down GEMM's dgrad output), through the same FP32 math:
// d(gate_up) in FP32, zero where a clamp held its input (ends included: torch.clamp's backward), then
//   dgu [rows, 2I] = bf16(d(gate_up))     (the gradient of the BF16 GEMM output, interleaved)
//   dbias [2I]    += sum over rows of d(gate_up) in FP32 (the FP32 bias's gradient, unrounded)
// The bias sum is deterministic: ws holds GptOssBiasWorkspaceNumel(rows, 2I) floats of partial sums
// over fixed row groups, added in a fixed order (reductions.h's ReducePartialsInto).
int64_t GptOssBiasWorkspaceNumel(int64_t rows, int64_t cols);
absl::Status GptOssGluBackward(const bf16* gu, const bf16* bias, const bf16* dact, int64_t rows, int64_t inter,
                               GptOssGluParams glu, bf16* dgu, float* ws, float* dbias, cudaStream_t stream);

// out[t, :] = sum over token t's k rows in ascending row (= expert) order, in FP32, of
//   (float(expert_out[row, :]) + float(down_bias[e * bias_stride + :])) * topk_weight[t, slot]
// (e = topk_expert[t, slot]): acc = 0, then acc += ((o + b) * w), each operation rounded in FP32 (no
// FMA), as HF's `out = m @ W + b` (FP32), `out * w`, index_add_ into the FP32 zeros expert by
// expert. expert_out [T*k, H] BF16 grouped rows (the down GEMM's output without its bias); out [T, H]
// FP32, overwritten.
absl::Status GptOssCombine(const bf16* expert_out, const int32_t* row_of_slot, const int32_t* topk_expert,
                           const float* topk_weight, const bf16* down_bias, int64_t bias_stride, int64_t tokens,
                           int64_t top_k, int64_t hidden, float* out, cudaStream_t stream);

// The combine's backward, per grouped row r (token t = token_index[r], slot j = slot_index[r],
// expert e = topk_expert[t, j]):
//   d_expert_out[r, :] = bf16(dout[t, :] * w[t, j])       (the BF16 down GEMM output's gradient)
//   dweight[t * k + j] = sum_i dout[t, i] * (float(expert_out[r, i]) + float(down_bias[e, i]))
//                        (FP32, fixed order; HF's gradient of the routing weight before its BF16
//                        rounding, which GptOssRouterBackward applies)
// dout [T, H] FP32; rows = T * k.
absl::Status GptOssCombineBackward(const float* dout, const bf16* expert_out, const int32_t* token_index,
                                   const int32_t* slot_index, const int32_t* topk_expert, const float* topk_weight,
                                   const bf16* down_bias, int64_t bias_stride, int64_t rows, int64_t top_k,
                                   int64_t hidden, bf16* d_expert_out, float* dweight, cudaStream_t stream);

// One expert's down bias gradient: dbias [H] += sum over its rows r < rows of dout[t, :] * w[t, j]
// in FP32 (t = token_index[r], j = slot_index[r]: the expert's slices of the grouped layout), the
// FP32 output's gradient before its BF16 rounding. Deterministic as GptOssGluBackward's bias sum: ws
// holds GptOssBiasWorkspaceNumel(rows, H) floats.
absl::Status GptOssDownBiasBackward(const float* dout, const int32_t* token_index, const int32_t* slot_index,
                                    const float* topk_weight, int64_t rows, int64_t top_k, int64_t hidden, float* ws,
                                    float* dbias, cudaStream_t stream);

// The router's backward to its BF16 logits, per token (one warp each), autograd through HF's casts:
//   g_j  = bf16(dweight[t, j])                       (the BF16 routing weights' gradient)
//   r_j  = bf16(w_j * (g_j - sum_i g_i w_i))          (BF16 softmax backward over the k values, FP32
//                                                      math, the sum in slot order) at expert s_j
//   a_e  = bf16(p_e * (aux_e - sum_e' p_e' aux_e'))   (the full FP32 softmax's backward for the aux
//                                                      loss's dL/dp, cast back to the BF16 logits;
//                                                      0 when aux_prob_grad is null)
//   dlogits[t, e] = bf16(r_e + a_e)                   (autograd's sum of the logits' two BF16 grads)
// probs, topk_expert, topk_weight as GptOssRouteTopK wrote them; dlogits [T, dlogits_ld] BF16 is the
// router GEMM's dgrad and wgrad operand, and its column sums the router bias's gradient.
absl::Status GptOssRouterBackward(const float* probs, const int32_t* topk_expert, const float* topk_weight,
                                  const float* dweight, const double* aux_prob_grad, int64_t tokens, int64_t experts,
                                  int64_t top_k, bf16* dlogits, int64_t dlogits_ld, cudaStream_t stream);

}  // namespace slidedp::kernels
