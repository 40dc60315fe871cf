// The token mixer of Qwen3.5's linear-attention layers (HF Qwen3_5GatedDeltaNet, which is
// Qwen3NextGatedDeltaNet with separate in_proj_qkv / in_proj_z / in_proj_b / in_proj_a), forward
// and backward, in plain C++ templated on the real type: float is what the CPU backend runs, double
// what the gradient checks run. The oracle for the CUDA kernels.
//
// On xn [T, hidden], the layer input after its RMSNorm, with every weight HF's [out, in] row-major:
//   mixed = xn Wqkv^T [T, C], C = 2 key_dim + value_dim;  z = xn Wz^T [T, value_dim];
//   b = xn Wb^T, a = xn Wa^T [T, nv]
//   c = silu(pre), pre[t, ch] = sum_j w[ch, j] mixed[t - (K-1) + j, ch]   (causal depthwise conv;
//       positions before the token's document start read 0, as HF's K-1 zeros of left padding)
//   q, k, v = split(c, [key_dim, key_dim, value_dim]); q, k per key head: x / sqrt(|x|^2 + 1e-6)
//   beta = sigmoid(b);  g = -exp(A_log) * softplus(a + dt_bias)   (softplus: x itself above 20)
//   per value head h (key head h / (nv / nk), HF's repeat_interleave), state S [dk, dv] zero at
//   every document start:  S = exp(g_t) S;  u = beta_t (v_t - S^T k_t);  S += k_t u^T;
//                          o_t = S^T (q_t / sqrt(dk))
//   y = (norm_w * (o * rsqrt(mean(o^2) + eps))) * silu(z)   per value head (norm_w: plain, not 1+w)
//   out = y Wout^T [T, hidden]
// The recurrence is the plain per-token loop (HF's torch_recurrent_gated_delta_rule; its chunked
// form is the same function). Its backward is the reverse-time adjoint loop; the states it needs
// are recomputed from checkpoints every L tokens of a document (L = ceil(sqrt(length)) unless
// given), so a head needs O((length / L + L) dk dv) scratch, never O(T dk dv).
//
// Determinism as in dense_reference_math.h: every reduction runs in one thread in a fixed order,
// results do not depend on the thread count, and documents are independent, so a row of packed
// documents gives each document's outputs (and input gradients) bit for bit. The recurrence runs
// one value head per thread. Backward overwrites input gradients and ADDS into parameter gradients,
// each call's partial sums formed first and added once.
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/status.h"

#include "worker/compute/cpu/cpu_worker_pool.h"
#include "worker/compute/cpu/dense_reference_math.h"

namespace slidedp {

// Sizes of one linear-attention mixer (HF Qwen3_5TextConfig names in comments).
struct LinearAttentionDims {
  int64_t hidden = 0;       // hidden_size
  int64_t num_k_heads = 0;  // linear_num_key_heads
  int64_t num_v_heads = 0;  // linear_num_value_heads, a multiple of num_k_heads
  int64_t k_dim = 0;        // linear_key_head_dim
  int64_t v_dim = 0;        // linear_value_head_dim
  int64_t conv_kernel = 0;  // linear_conv_kernel_dim
  double norm_eps = 1e-6;   // rms_norm_eps (the gated RMSNorm's)

  // The l2norm epsilon of q and k (HF l2norm's default, fixed).
  static constexpr double kL2NormEps = 1e-6;

  int64_t key_dim() const { return num_k_heads * k_dim; }
  int64_t value_dim() const { return num_v_heads * v_dim; }
  int64_t conv_dim() const { return 2 * key_dim() + value_dim(); }
  // Value heads per key head.
  int64_t group() const { return num_v_heads / num_k_heads; }
  absl::Status Validate() const;
};

// Element offsets of the mixer's tensors inside a flat parameter array (HF names in comments).
struct LinearAttentionOffsets {
  int64_t in_proj_qkv = 0;  // in_proj_qkv.weight [conv_dim, hidden]
  int64_t in_proj_z = 0;    // in_proj_z.weight [value_dim, hidden]
  int64_t in_proj_b = 0;    // in_proj_b.weight [nv, hidden]
  int64_t in_proj_a = 0;    // in_proj_a.weight [nv, hidden]
  int64_t conv1d = 0;       // conv1d.weight [conv_dim, 1, K]
  int64_t dt_bias = 0;      // dt_bias [nv]
  int64_t a_log = 0;        // A_log [nv]
  int64_t norm = 0;         // norm.weight [v_dim]
  int64_t out_proj = 0;     // out_proj.weight [hidden, value_dim]

  // The tensors back to back from `base` in the order above; *end_numel (if given) is one past the
  // last element.
  static LinearAttentionOffsets Packed(const LinearAttentionDims& dims, int64_t base = 0,
                                       int64_t* end_numel = nullptr);
};

// ---- Op-level references (the oracles of the CUDA kernels) ----
// Token-major layouts throughout: [T, heads, head_dim] rows; documents from geom.cu_seqlens (its
// RoPE fields are not read).

// Causal depthwise conv1d + SiLU over x [T, C] with w [C, K] inside each document:
// pre[t, ch] = sum_{j ascending} w[ch, j] x[t - (K-1) + j, ch] over positions in t's document;
// y = silu(pre). pre may be null.
template <typename R>
void CausalConv1dSiluForward(const R* x, const R* w, int64_t channels, int64_t kernel, const TokenGeometry& geom,
                             R* pre, R* y, CpuWorkerPool* pool);
// Its backward from pre and dy: dx [T, C] overwritten (must not alias dy), dw [C, K] added.
template <typename R>
void CausalConv1dSiluBackward(const R* x, const R* w, const R* pre, const R* dy, int64_t channels, int64_t kernel,
                              const TokenGeometry& geom, R* dx, R* dw, CpuWorkerPool* pool);

// L2 normalisation of `rows` rows of dim: y = x * inv, inv = 1 / sqrt(sum(x^2) + eps) (saved).
// y may alias x.
template <typename R>
void HeadL2NormForward(const R* x, int64_t rows, int64_t dim, R eps, R* y, R* inv, CpuWorkerPool* pool);
// Its backward from the output: dx = inv * (dy - y (dy . y)). dx overwritten; may alias dy.
template <typename R>
void HeadL2NormBackward(const R* y, const R* inv, const R* dy, int64_t rows, int64_t dim, R* dx,
                        CpuWorkerPool* pool);

// Decay and write strength from a, b [T, nv]: g = -exp(a_log[h]) * softplus(a + dt_bias[h]),
// beta = sigmoid(b).
template <typename R>
void DecayAndBetaForward(const R* a, const R* b, const R* a_log, const R* dt_bias, int64_t tokens, int64_t heads,
                         R* g, R* beta, CpuWorkerPool* pool);
// Its backward: da, db overwritten; da_log, ddt_bias [nv] added (sums over tokens in order).
template <typename R>
void DecayAndBetaBackward(const R* a, const R* beta, const R* a_log, const R* dt_bias, const R* dg, const R* dbeta,
                          int64_t tokens, int64_t heads, R* da, R* db, R* da_log, R* ddt_bias, CpuWorkerPool* pool);

// The gated delta rule: q, k [T, key_dim] (L2-normalised, unscaled), v [T, value_dim], g, beta
// [T, nv] -> o [T, value_dim]. One value head per thread.
template <typename R>
void GatedDeltaRuleForward(const LinearAttentionDims& dims, const TokenGeometry& geom, const R* q, const R* k,
                           const R* v, const R* g, const R* beta, R* o, CpuWorkerPool* pool);
// Its backward from do: dq, dk [T, key_dim], dv [T, value_dim], dg, dbeta [T, nv], all
// overwritten (dq and dk summed over the value heads of a key head in ascending order).
// checkpoint_interval: tokens between saved states (the states in between are recomputed, bit for
// bit the forward's); 0 picks ceil(sqrt(length)) per document; >= the document length stores every
// state of the document. Every choice gives the same bits.
template <typename R>
void GatedDeltaRuleBackward(const LinearAttentionDims& dims, const TokenGeometry& geom, const R* q, const R* k,
                            const R* v, const R* g, const R* beta, const R* dout, R* dq, R* dk, R* dv, R* dg,
                            R* dbeta, CpuWorkerPool* pool, int64_t checkpoint_interval = 0);

// Gated RMSNorm over `rows` rows of dim: y = (w * (x * rstd)) * silu(z), rstd = 1 / sqrt(mean(x^2)
// + eps) (saved).
template <typename R>
void GatedRmsNormForward(const R* x, const R* z, const R* w, int64_t rows, int64_t dim, R eps, R* y, R* rstd,
                         CpuWorkerPool* pool);
// Its backward: dx, dz overwritten (dx may alias dy), dw [dim] added (rows in order).
template <typename R>
void GatedRmsNormBackward(const R* x, const R* z, const R* w, const R* rstd, const R* dy, int64_t rows, int64_t dim,
                          R* dx, R* dz, R* dw, CpuWorkerPool* pool);

// ---- The mixer ----

// What the mixer's backward reads: LinearAttentionActs (dense_reference_math.h, where a decoder
// layer's activations hold one). The conv output, q/k/v, g and beta are recomputed from these (bit
// for bit the forward's), so the saved set is T * (conv_dim + 2 value_dim + 3 nv) elements.

// out [T, hidden] (overwritten; may alias xn) and, if acts is not null, acts. params is the flat
// array the offsets index.
template <typename R>
void LinearAttentionForward(const LinearAttentionDims& dims, const LinearAttentionOffsets& offs, const R* params,
                            const TokenGeometry& geom, const R* xn, R* out, LinearAttentionActs<R>* acts,
                            CpuWorkerPool* pool);

// dxn = dL/dxn (overwritten; may alias dout), dparams += dL/dparams for every tensor of the
// offsets, given dout = dL/dout and the forward's acts.
template <typename R>
void LinearAttentionBackward(const LinearAttentionDims& dims, const LinearAttentionOffsets& offs, const R* params,
                             const TokenGeometry& geom, const R* xn, const LinearAttentionActs<R>& acts,
                             const R* dout, R* dxn, R* dparams, CpuWorkerPool* pool,
                             int64_t checkpoint_interval = 0);

}  // namespace slidedp
