// The Qwen3-MoE sparse MoE block of the CPU reference backend, forward and backward, in plain
// C++ templated on the real type (float: what a backend runs; double: what gradient checks run).
//
// Semantics follow HF transformers 5.x Qwen3MoeSparseMoeBlock (Qwen3MoeTopKRouter +
// Qwen3MoeExperts in models/qwen3_moe/modeling_qwen3_moe.py) on the T post-attention-norm tokens
// x [T, hidden]:
//   logits = x Wr^T                           [T, E]  (HF mlp.gate.weight, [E, hidden])
//   p      = softmax(logits) over experts     [T, E]
//   (s_1..s_k, p_s) = topk(p, k)              largest first; equal values: the lower expert
//                                              index first (torch.topk documents no tie order;
//                                              this fixes one so routing is deterministic)
//   w_j    = p_{s_j} / sum_i p_{s_i}  if norm_topk_prob, else p_{s_j}
//   y[t]   = sum_j w_j * down_e(silu(gate_e(x[t])) * up_e(x[t])),  e = s_j
// with every projection HF's [out, in] row-major (y = x W^T). HF computes the softmax, top-k and
// renormalisation in FP32 and casts the weights to the activation dtype; here all of it is in R,
// which for R = float is the same arithmetic. y[t] accumulates the token's expert terms in
// ascending expert index, the order of HF's expert loop with index_add_; each term is the
// expert output times its weight, rounded in R.
//
// Experts run grouped by expert: a permutation lists, for each expert in ascending order, the
// (token, slot) pairs routed to it in token order, and each expert is one GEMM over its rows.
// This is the layout the CUDA grouped GEMMs use; MoePermutation exposes it.
//
// Auxiliary load-balancing loss, as HF's load_balancing_loss_func with no attention mask: HF
// concatenates the router logits of all L MoE layers into N = sum_l T_l rows, recomputes the
// softmax and top-k on them (the same selection as the routing above), and returns
//   aux = E * sum_e (C_e / N) * (S_e / N),   C_e = #rows whose top-k contains e (over all slots),
//                                            S_e = sum over rows of p[row, e].
// (HF: mean over rows of one_hot(topk) gives [k, E]; times mean probs [E], summed over k and E.)
// C_e counts slots, so a perfectly balanced router gives aux = k, not 1, and the layers are not
// added loss by loss: the cross terms C_e(layer a) * S_e(layer b) count. A block's forward returns
// its (C_e, S_e, T) in MoeRouterStats; LoadBalancingLoss combines layers as HF's concatenation
// does. The gradient of coef * aux reaches the router only through p (C_e is a count):
// d(coef * aux)/dp[t, e] = coef * E * C_e / N^2, the same for every row of every layer;
// LoadBalancingProbGrad returns it and the block backward adds it into dp.
// HF 5.x routers returned softmax probabilities as router_logits until transformers PR #45131
// (issue #45120), so the aux loss took softmax(softmax(logits)); this follows the fixed code and
// transformers 4.x, where the aux softmax is taken once, on the raw logits.
//
// Threads: work goes through CpuWorkerPool's fixed ranges (via the dense Linear* ops) and every
// reduction runs in one fixed order, so results are bitwise independent of the thread count.
// Backward writes dx and ADDs into the parameter gradients; each call's partial sums are formed
// first and added once. Experts that received no token are skipped: their gradients are not
// touched. Inputs must be finite (NaN probabilities would make the top-k order meaningless).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#include "common/model/model_config.h"
#include "worker/compute/cpu/cpu_worker_pool.h"

namespace slidedp {

// Sizes of one MoE block (HF Qwen3MoeConfig names in comments).
struct MoeDims {
  int64_t hidden = 0;            // hidden_size
  int64_t intermediate = 0;      // moe_intermediate_size
  int64_t num_experts = 0;       // num_experts
  int64_t top_k = 0;             // num_experts_per_tok, 1 <= top_k <= num_experts
  bool norm_topk_prob = true;    // norm_topk_prob: renormalise the k selected probabilities
  // gpt_oss's block (GptOssMLP; gpt_oss_math.h): a biased router whose weights are the softmax of the
  // top-k logits, experts with biases and a SwiGLU clamped at swiglu_limit, alpha swiglu_alpha
  // (GptOssExperts' constants). MoeBlockForward / MoeBlockBackward hand such a block to it.
  bool gpt_oss = false;
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
  // A qwen3_moe model's sizes (ModelConfig's MoE fields).
  static MoeDims Of(const ModelConfig& config);
};

// Element offsets of the block's tensors inside one flat parameter array. Expert e's gate_proj
// and up_proj are [intermediate, hidden] at gate_at(e) / up_at(e); its down_proj is
// [hidden, intermediate] at down_at(e); the router is [num_experts, hidden] at `router`.
struct MoeOffsets {
  int64_t router = 0;
  int64_t gate = 0;
  int64_t up = 0;
  int64_t gate_up_expert_stride = 0;  // elements from expert e's gate (or up) to expert e+1's
  int64_t down = 0;
  int64_t down_expert_stride = 0;
  int64_t block_numel = 0;
  // gpt_oss (MoeDims::gpt_oss): the router's bias [E] and each expert's biases, gate_up [2I] at
  // gate_up_bias_at(e) and down [H] at down_bias_at(e) (-1: none). Its gate_at(e) is the fused
  // gate_up [H, 2I] (x @ W, gate in the even columns), down_at(e) [I, H]; `up` is unused.
  int64_t router_bias = -1;
  int64_t gate_up_bias = -1;
  int64_t down_bias = -1;
  int64_t gate_up_bias_at(int64_t e) const { return gate_up_bias + e * gate_up_expert_stride; }
  int64_t down_bias_at(int64_t e) const { return down_bias + e * down_expert_stride; }

  int64_t gate_at(int64_t e) const { return gate + e * gate_up_expert_stride; }
  int64_t up_at(int64_t e) const { return up + e * gate_up_expert_stride; }
  int64_t down_at(int64_t e) const { return down + e * down_expert_stride; }

  // router [E, H] | gate [E, I, H] | up [E, I, H] | down [E, H, I]: one stack per HF per-expert
  // checkpoint tensor (mlp.experts.{e}.gate_proj / up_proj / down_proj).
  static MoeOffsets Stacked(const MoeDims& dims);
  // router [E, H] | gate_up [E, 2I, H] | down [E, H, I]: HF 5.x Qwen3MoeExperts' in-memory
  // gate_up_proj, whose rows [0, I) of each expert are gate_proj and [I, 2I) up_proj.
  static MoeOffsets FusedGateUp(const MoeDims& dims);
  // A sparse decoder unit of ModelLayout (common/model/model_config.h): the router and the experts
  // where the unit keeps them, offsets from the unit's start, each expert's block one stride after
  // the previous; block_numel is the unit's numel. A dense unit gives all zeros.
  static MoeOffsets InUnit(const UnitLayout& unit);
};

// Tokens grouped by expert. Row r of the grouped layout is slot slot_index[r] of token
// token_index[r]; expert e owns rows [expert_offsets[e], expert_offsets[e + 1]), in token order.
struct MoePermutation {
  std::vector<int64_t> expert_counts;   // [E] rows per expert; they sum to T * k
  std::vector<int64_t> expert_offsets;  // [E + 1] exclusive prefix sum of expert_counts
  std::vector<int32_t> token_index;     // [T * k]
  std::vector<int32_t> slot_index;      // [T * k]
  std::vector<int64_t> row_of_slot;     // [T * k] inverse: the row of (token t, slot j) at t * k + j
};

// Groups the top-k choices topk_expert [T, k] (each entry in [0, E)) by expert.
MoePermutation BuildMoePermutation(const int32_t* topk_expert, int64_t num_tokens, int64_t top_k,
                                   int64_t num_experts);

// One layer's share of the auxiliary loss: what HF's concatenation needs from it.
struct MoeRouterStats {
  int64_t num_tokens = 0;
  std::vector<int64_t> expert_counts;  // [E] C_e: tokens whose top-k contains e
  std::vector<double> prob_sums;       // [E] S_e: sum over tokens of p[t, e], in token order
};

// HF's load_balancing_loss_func over the layers' concatenated router logits (no padding mask):
// E * sum_e (sum_l C_le / N) * (sum_l S_le / N), N = sum_l T_l; 0 when there are no tokens.
double LoadBalancingLoss(const std::vector<MoeRouterStats>& layers);
// [E] d(coef * LoadBalancingLoss)/dp[t, e] = coef * E * C_e / N^2, for every token of every layer.
std::vector<double> LoadBalancingProbGrad(const std::vector<MoeRouterStats>& layers, double coef);

// Context parallelism: the whole micro-batch's statistics from every rank's share of it. `mine`
// packed in 8-byte words (per layer: tokens, C_e, S_e bits), gathered rank-major by `gather`
// (local words -> ranks x words) and summed in rank order, so every rank gets the same bits.
using GatherWords = std::function<absl::Status(const uint64_t* local, int64_t words, uint64_t* all)>;
absl::StatusOr<std::vector<MoeRouterStats>> SumRouterStatsOverGroup(const std::vector<MoeRouterStats>& mine,
                                                                    int64_t experts, int ranks,
                                                                    const GatherWords& gather);

// What the block's backward reads; filled by MoeBlockForward. Grouped tensors are in
// MoePermutation row order.
template <typename R>
struct MoeActs {
  std::vector<R> router_logits;      // [T, E]
  std::vector<R> router_probs;       // [T, E] softmax of router_logits
  std::vector<int32_t> topk_expert;  // [T, k] selected experts, largest probability first
  std::vector<R> topk_weight;        // [T, k] routing weights w (renormalised if norm_topk_prob)
  MoePermutation perm;
  std::vector<R> gate;               // [T * k, I] gate_proj outputs, grouped
  std::vector<R> up;                 // [T * k, I] up_proj outputs, grouped
  std::vector<R> expert_out;         // [T * k, H] down_proj outputs before the routing weight
  MoeRouterStats stats;
};

// Router: logits, softmax, top-k and routing weights for x [T, hidden] (fills the first four
// fields of acts).
template <typename R>
void MoeRoute(const MoeDims& dims, const MoeOffsets& offs, const R* params, const R* x, int64_t num_tokens,
              MoeActs<R>* acts, CpuWorkerPool* pool);

// The whole block: y [T, hidden] (overwritten; must not alias x) and acts.
template <typename R>
void MoeBlockForward(const MoeDims& dims, const MoeOffsets& offs, const R* params, const R* x, int64_t num_tokens,
                     R* y, MoeActs<R>* acts, CpuWorkerPool* pool);

// dx = dL/dx (overwritten; may alias dy), dparams += dL/dparams for L with dL/dy = dy, through
// the experts, the routing weights, the renormalisation, the top-k gather and the softmax. When
// aux_prob_grad ([E], from LoadBalancingProbGrad) is not null it is added to dL/dp of every
// token, which puts coef * aux's gradient into the router and dx.
template <typename R>
void MoeBlockBackward(const MoeDims& dims, const MoeOffsets& offs, const R* params, const R* x, int64_t num_tokens,
                      const MoeActs<R>& acts, const R* dy, const double* aux_prob_grad, R* dx, R* dparams,
                      CpuWorkerPool* pool);

}  // namespace slidedp
