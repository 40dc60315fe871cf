// GPT-OSS's pieces of the CPU reference math (HF transformers 5.17 modeling_gpt_oss.py), in plain
// C++ templated on the real type (float: the backend; double: the gradient checks and oracles):
//
// Attention sinks (GptOssAttention.sinks, eager_attention_forward): each head h has a learned
// logit s_h that joins every query's softmax over its scaled scores and is dropped after it:
//   p_j = exp(z_j) / (sum_i exp(z_i) + exp(s_h)),  o = sum_j p_j v_j.
// The dense attention (AttentionForward) gives o' and lse = log sum_i exp(z_i) without the sink;
// ApplyAttentionSinks turns them into o = o' exp(lse - lse_s) and lse_s = log(exp(lse) + exp(s_h)),
// after which AttentionBackward's p_j = exp(z_j - lse_s) and D = dout . o are the sink's softmax
// exactly (the sink has no value: its dp is 0). The sink's own gradient is
//   dL/ds_h = sum over queries of -p_sink D,  p_sink = exp(s_h - lse_s)
// (AttentionSinksBackward).
//
// The MoE block (GptOssMLP = GptOssTopKRouter + GptOssExperts), on x [T, hidden]:
//   z      = x Wr^T + br                        [T, E]   (mlp.router.weight, mlp.router.bias)
//   (s_1..s_k) = topk(z, k)                     largest first; equal logits: the lower expert first
//   w_j    = softmax(z_{s_1}, ..., z_{s_k})_j   (torch.topk then softmax over the k values)
//   gu     = x Wgu_e + bgu_e                    [2I]     (gate_up_proj[e] is [hidden, 2I]: x @ W)
//   gate, up = gu[0::2], gu[1::2]               (interleaved columns)
//   m      = (clamp(up, -L, L) + 1) * g sigmoid(alpha g),  g = min(gate, L)   (L 7, alpha 1.702)
//   out_e  = m Wd_e + bd_e                      [hidden] (down_proj[e] is [I, hidden])
//   y[t]   = sum_j w_j out_{s_j}                in ascending expert order (HF's index_add_ loop)
// The clamps pass the gradient where PyTorch's clamp does (min <= x <= max, ends included). The
// aux loss's statistics are those of the full softmax of z (load_balancing_loss_func takes the
// router's raw logits), kept in MoeActs as for qwen3_moe; its gradient reaches z through that
// softmax. MoeActs' gate and up hold the raw (unclamped) gate and up columns, grouped by expert.
// Threads and reductions as moe_reference_math.h: bitwise independent of the thread count.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "worker/compute/cpu/cpu_worker_pool.h"
#include "worker/compute/cpu/moe_reference_math.h"

namespace slidedp {

// ---- Attention sinks ----

// attn [T, heads * head_dim] and lse [T, heads] from AttentionForward become the sinks' (in place).
template <typename R>
void ApplyAttentionSinks(int64_t T, int64_t heads, int64_t head_dim, const R* sinks, R* attn, R* lse);
// dsinks [heads] += dL/dsinks from the sinks' attn and lse (after ApplyAttentionSinks) and dattn.
template <typename R>
void AttentionSinksBackward(int64_t T, int64_t heads, int64_t head_dim, const R* sinks, const R* attn, const R* lse,
                            const R* dattn, R* dsinks);

// ---- The experts' clamped SwiGLU ----

// m = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit), over n.
template <typename R>
inline void GptOssGlu(R alpha, R limit, const R* gate, const R* up, int64_t n, R* m) {
  for (int64_t i = 0; i < n; ++i) {
    const R g = std::min(gate[i], limit);
    const R u = std::clamp(up[i], -limit, limit);
    const R glu = g * (R(1) / (R(1) + std::exp(-(g * alpha))));
    m[i] = (u + R(1)) * glu;
  }
}

// Its backward from dm: dgate and dup (overwritten), zero where the clamp held the input.
template <typename R>
inline void GptOssGluBackward(R alpha, R limit, const R* gate, const R* up, const R* dm, int64_t n, R* dgate, R* dup) {
  for (int64_t i = 0; i < n; ++i) {
    const R g = std::min(gate[i], limit);
    const R u = std::clamp(up[i], -limit, limit);
    const R sg = R(1) / (R(1) + std::exp(-(g * alpha)));
    dup[i] = up[i] >= -limit && up[i] <= limit ? dm[i] * g * sg : R(0);
    dgate[i] = gate[i] <= limit ? dm[i] * (u + R(1)) * (sg + g * alpha * sg * (R(1) - sg)) : R(0);
  }
}

// ---- The MoE block ----

// y [T, hidden] (overwritten; must not alias x) and acts, as MoeBlockForward (which calls it for
// dims.gpt_oss).
template <typename R>
void GptOssMoeForward(const MoeDims& dims, const MoeOffsets& offs, const R* params, const R* x, int64_t num_tokens,
                      R* y, MoeActs<R>* acts, CpuWorkerPool* pool);
// dx (overwritten; may alias dy), dparams += dL/dparams, as MoeBlockBackward.
template <typename R>
void GptOssMoeBackward(const MoeDims& dims, const MoeOffsets& offs, const R* params, const R* x, int64_t num_tokens,
                       const MoeActs<R>& acts, const R* dy, const double* aux_prob_grad, R* dx, R* dparams,
                       CpuWorkerPool* pool);

}  // namespace slidedp
