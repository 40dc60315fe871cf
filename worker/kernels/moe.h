// Kernels of the Qwen3-MoE sparse block (HF Qwen3MoeSparseMoeBlock; the math is written out in
// worker/compute/cpu/moe_reference_math.h): the router's softmax and top-k, the grouping of the
// (token, slot) pairs by expert, the row gather in front of the experts' GEMMs, the weighted
// combine behind them, and their backward. The GEMMs themselves run through GemmRunner, one per
// expert (worker/compute/cuda/cuda_moe.h drives the block).
//
// Grouped layout (MoePermutation of the reference): row r of the T*k grouped rows is slot
// slot_index[r] of token token_index[r]; expert e owns rows [expert_offsets[e], expert_offsets[e+1]),
// experts ascending, each expert's rows in token order; row_of_slot[t*k + j] is the inverse. Rows
// ascending are so experts ascending, which is the order HF's expert loop accumulates in.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. Everything is deterministic:
// reductions run in fixed orders and the only atomics are integer ones (bitwise repeatable).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// The router kernels keep one token's [E] row per warp in shared memory: E is limited to this.
constexpr int64_t kMoeMaxExperts = 2048;

// How the k selected probabilities become routing weights (HF norm_topk_prob).
enum class MoeTopKNorm {
  kProbabilities,  // w_j = p_{s_j}                 (norm_topk_prob false)
  kRenormalized,   // w_j = p_{s_j} / sum_i p_{s_i}  (norm_topk_prob true; the sum in slot order)
};

// Router, per token t (one warp each): p = softmax(float(logits[t, :E])) in FP32 (max subtracted,
// expf, sum, division), then the k largest p by repeated arg-max, largest first, equal values to
// the lower expert index (torch.topk fixes no order on ties; the reference's rule). logits is the
// router GEMM's BF16 output [T, logits_ld] (HF: F.linear under autocast gives BF16 logits, softmax
// is taken with dtype=float). Writes probs [T, E], topk_expert [T, k], topk_weight [T, k] (FP32, as
// HF 5.x keeps them: router_top_value.to(router_logits.dtype), the FP32 softmax output).
absl::Status MoeRouteTopK(const bf16* logits, int64_t logits_ld, int64_t tokens, int64_t experts, int64_t top_k,
                          MoeTopKNorm norm, float* probs, int32_t* topk_expert, float* topk_weight,
                          cudaStream_t stream);

// Groups topk_expert [T, k] (entries in [0, E); a token names an expert at most once, as a top-k
// does) by expert into the layout above: expert_counts [E], expert_offsets [E + 1] (exclusive
// prefix sum, offsets[E] = T * k), token_index / slot_index / row_of_slot [T * k]. ws holds
// MoePermutationWorkspaceNumel(T, E) int32. Tokens are cut into chunks of 64: per-chunk counts,
// a prefix over the chunks per expert, then each chunk places its rows in token order, so no
// row position depends on scheduling.
int64_t MoePermutationWorkspaceNumel(int64_t tokens, int64_t experts);
absl::Status MoeBuildPermutation(const int32_t* topk_expert, int64_t tokens, int64_t top_k, int64_t experts,
                                 int32_t* ws, int32_t* expert_counts, int32_t* expert_offsets, int32_t* token_index,
                                 int32_t* slot_index, int32_t* row_of_slot, cudaStream_t stream);

// prob_sums[e] = sum over tokens of probs[t, e] (FP64, overwritten): the S_e of the auxiliary loss
// (MoeRouterStats::prob_sums). Fixed order: FP64 sums over chunks of 256 tokens in token order,
// then the chunks in order. ws holds MoeProbSumsWorkspaceNumel(T, E) doubles.
int64_t MoeProbSumsWorkspaceNumel(int64_t tokens, int64_t experts);
absl::Status MoeProbSums(const float* probs, int64_t tokens, int64_t experts, double* ws, double* prob_sums,
                         cudaStream_t stream);

// out[r, :] = x[index[r], :] for r < rows, width cols (row strides cols): the expert GEMMs' input.
absl::Status MoeGatherRows(const bf16* x, const int32_t* index, int64_t rows, int64_t cols, bf16* out,
                           cudaStream_t stream);

// out[t, :] = sum over token t's k rows in ascending row (= expert) order of
// float(expert_out[row, :]) * topk_weight[t, slot], in FP32: acc = 0, then acc += (o * w), each
// product rounded to FP32 before the add (no FMA), as HF's (down_out * weight) then index_add_ into
// the FP32 zeros, expert by expert. expert_out [T*k, H] BF16 grouped rows; out [T, H] FP32,
// overwritten.
absl::Status MoeCombine(const bf16* expert_out, const int32_t* row_of_slot, const float* topk_weight, int64_t tokens,
                        int64_t top_k, int64_t hidden, float* out, cudaStream_t stream);

// The combine's backward, per grouped row r (token t = token_index[r], slot j = slot_index[r]):
//   d_expert_out[r, :] = bf16(dout[t, :] * w[t, j])          (HF: the BF16 down_proj output's gradient)
//   dweight[t * k + j] = sum_i dout[t, i] * float(expert_out[r, i])   (FP32, fixed order)
// dout [T, H] FP32; rows = T * k.
absl::Status MoeCombineBackward(const float* dout, const bf16* expert_out, const int32_t* token_index,
                                const int32_t* slot_index, const float* topk_weight, int64_t rows, int64_t top_k,
                                int64_t hidden, bf16* d_expert_out, float* dweight, cudaStream_t stream);

// The router's backward to its BF16 logits, per token (one warp each): dp[e] = aux_prob_grad[e]
// (as float; 0 when aux_prob_grad is null), plus the routing weights' gradient at the selected
// experts, (dw_j - sum_i dw_i w_i) / sum_i p_{s_i} when renormalised, else dw_j; then the softmax
// backward dz = p * (dp - sum_e p_e dp_e), rounded to BF16 into dlogits [T, dlogits_ld] (the
// router GEMM's dgrad and wgrad operand, HF: the gradient of the BF16 logits). The selected
// probabilities' sum is recomputed from probs in slot order, as MoeRouteTopK formed it.
absl::Status MoeRouterBackward(const float* probs, const int32_t* topk_expert, const float* topk_weight,
                               const float* dweight, const double* aux_prob_grad, int64_t tokens, int64_t experts,
                               int64_t top_k, MoeTopKNorm norm, bf16* dlogits, int64_t dlogits_ld, cudaStream_t stream);

// dst[index[r], :] += src[r, :] for r < rows, width cols, FP32. The indices of one call must be
// distinct (one expert's rows: a token reaches an expert once), so no two threads add into one
// element; calls on one stream run in order, which fixes the accumulation order across calls.
absl::Status MoeScatterAddRows(const float* src, const int32_t* index, int64_t rows, int64_t cols, float* dst,
                               cudaStream_t stream);

}  // namespace slidedp::kernels
