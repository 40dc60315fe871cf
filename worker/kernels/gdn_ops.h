// The token-local ops of a Qwen3.5 hybrid layer around its two token mixers, forward and backward:
// for the Gated DeltaNet ("linear attention", HF Qwen3_5GatedDeltaNet) the causal depthwise conv1d +
// SiLU over packed documents, the per-head L2 norm of q and k, the decay g and write strength beta,
// and the gated RMSNorm of the core's output; for the gated full attention (HF Qwen3NextAttention)
// the sigmoid output gate. The delta-rule core itself and the projections (cuBLAS) are elsewhere.
//
// Layer order: in_proj_qkv -> CausalConvSilu -> split q|k|v -> L2NormHeads(q|k) -> core(q, k, v, g,
// beta) -> GatedRmsNorm(core out, z) -> out_proj; GdnDecayBeta makes g and beta from in_proj_a/b.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes or
// misaligned strides are INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. BF16
// storage, FP32 math. Row strides (ld_*) are in elements. Weight gradients are ADDED to FP32 outputs
// through the deterministic two-stage reduction of reductions.h (per-block partial rows in a caller
// workspace `ws`, then a fixed-order sum); the *WorkspaceNumel functions size `ws` (floats). A
// weight-gradient output may be null (then ws is not touched). All kernels are memory-bound.
// Each kernel picks a vectorized path when widths, strides and pointers allow 8- or 16-byte accesses
// and a scalar one otherwise, so any width works.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// ---- 1. Causal depthwise conv1d + SiLU over packed documents (HF conv1d with K-1 zeros of left
// padding per sequence, no bias, then SiLU).
//   pre[t, c] = Σ_{j<K} w[c, j] · x[t-K+1+j, c],  x[t'] = 0 for t' before the start of t's document
//   y[t, c]   = silu(pre[t, c])
// x: [tokens, channels] BF16, row stride ld_x (the in_proj_qkv output, possibly a column slice of a
// wider GEMM output); w: [channels, K] BF16 (HF conv1d.weight [C, 1, K] flattened); y: BF16, stride
// ld_y. cu_seqlens: device int32 [num_docs + 1], cu_seqlens[0] = 0, nondecreasing (empty documents
// allowed), cu_seqlens[num_docs] = tokens. 1 <= kernel_size <= 8. HF under BF16 rounds pre to BF16
// before the SiLU (cuDNN conv output); here pre stays FP32 and only y is rounded (the causal-conv1d
// CUDA kernel HF uses when installed does the same).
// The forward keeps nothing: the backward recomputes pre from x (so x must be kept).
absl::Status CausalConvSiluForward(const bf16* x, int64_t ld_x, const bf16* w, const int32_t* cu_seqlens, int num_docs,
                                   int64_t tokens, int channels, int kernel_size, bf16* y, int64_t ld_y,
                                   cudaStream_t stream);
// Backward, with dpre = dy · silu'(pre) (pre recomputed):
//   dx[t', c]  = Σ_j w[c, j] · dpre[t'+K-1-j, c] over the taps inside the document of t' (overwritten)
//   dw[c, j]  += Σ_t dpre[t, c] · x[t-K+1+j, c]   (FP32 [channels, K]; may be null)
// dy: FP32 [tokens, channels], stride ld_dy (the q|k|v gradients side by side). dx: BF16 (the input of
// the in_proj_qkv dgrad/wgrad GEMMs) or FP32, stride ld_dx; it must not alias dy or x.
int64_t CausalConvSiluBackwardWorkspaceNumel(int64_t tokens, int channels, int kernel_size);
absl::Status CausalConvSiluBackward(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, const bf16* w,
                                    const int32_t* cu_seqlens, int num_docs, int64_t tokens, int channels,
                                    int kernel_size, bf16* dx, int64_t ld_dx, float* dw, float* ws,
                                    cudaStream_t stream);
absl::Status CausalConvSiluBackward(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, const bf16* w,
                                    const int32_t* cu_seqlens, int num_docs, int64_t tokens, int channels,
                                    int kernel_size, float* dx, int64_t ld_dx, float* dw, float* ws,
                                    cudaStream_t stream);

// ---- 2. Per-head L2 norm (FLA / HF l2norm, use_qk_l2norm_in_kernel): y = x · rsqrt(Σ x² + eps)
// over each head of head_dim values (HF eps 1e-6; no mean, no weight). x: BF16 [tokens, heads·head_dim]
// at row stride ld_x; q and k sit side by side in the conv output, so one call with heads = 2·nk
// normalizes both. y: BF16 or FP32 (whichever the core reads), stride ld_y. head_dim <= 256. The
// core's 1/sqrt(dk) query scale is not applied here.
absl::Status L2NormHeadsForward(const bf16* x, int64_t ld_x, int64_t tokens, int heads, int head_dim, float eps,
                                bf16* y, int64_t ld_y, cudaStream_t stream);
absl::Status L2NormHeadsForward(const bf16* x, int64_t ld_x, int64_t tokens, int heads, int head_dim, float eps,
                                float* y, int64_t ld_y, cudaStream_t stream);
// dx = r·dy − r³·(dy·x)·x with r = rsqrt(Σ x² + eps), recomputed from x. dy, dx FP32 (dx typically the
// q|k columns of the conv's FP32 dy buffer, stride ld_dx). dx may alias dy when ld_dx == ld_dy.
absl::Status L2NormHeadsBackward(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, int64_t tokens, int heads,
                                 int head_dim, float eps, float* dx, int64_t ld_dx, cudaStream_t stream);

// ---- 3. Decay and write strength per token and value head:
//   g = −exp(A_log) · softplus(a + dt_bias)  (torch softplus: beta 1, threshold 20: u > 20 -> u)
//   beta = sigmoid(b)
// a, b: BF16 [tokens, nv] (the in_proj_a / in_proj_b outputs) at strides ld_a, ld_b; A_log, dt_bias
// [nv]: FP32 master values or BF16. g, beta: FP32 [tokens, nv] contiguous. HF computes g in FP32 and
// beta = b.sigmoid() in BF16; beta stays FP32 here.
absl::Status GdnDecayBetaForward(const bf16* a, int64_t ld_a, const bf16* b, int64_t ld_b, const float* A_log,
                                 const float* dt_bias, int64_t tokens, int nv, float* g, float* beta,
                                 cudaStream_t stream);
absl::Status GdnDecayBetaForward(const bf16* a, int64_t ld_a, const bf16* b, int64_t ld_b, const bf16* A_log,
                                 const bf16* dt_bias, int64_t tokens, int nv, float* g, float* beta,
                                 cudaStream_t stream);
// From dg, dbeta (FP32 [tokens, nv] contiguous): da = dg · (−exp(A_log)) · softplus'(a + dt_bias),
// db = dbeta · beta(1 − beta), overwritten (BF16: the in_proj_a/b dgrad GEMM inputs, or FP32) at
// strides ld_da, ld_db; dA_log[h] += Σ_t dg·g, ddt_bias[h] += Σ_t da (FP32 [nv]; both or neither null).
int64_t GdnDecayBetaBackwardWorkspaceNumel(int64_t tokens, int nv);
absl::Status GdnDecayBetaBackward(const float* dg, const float* dbeta, const bf16* a, int64_t ld_a, const bf16* b,
                                  int64_t ld_b, const float* A_log, const float* dt_bias, int64_t tokens, int nv,
                                  bf16* da, int64_t ld_da, bf16* db, int64_t ld_db, float* dA_log, float* ddt_bias,
                                  float* ws, cudaStream_t stream);
absl::Status GdnDecayBetaBackward(const float* dg, const float* dbeta, const bf16* a, int64_t ld_a, const bf16* b,
                                  int64_t ld_b, const float* A_log, const float* dt_bias, int64_t tokens, int nv,
                                  float* da, int64_t ld_da, float* db, int64_t ld_db, float* dA_log, float* ddt_bias,
                                  float* ws, cudaStream_t stream);
absl::Status GdnDecayBetaBackward(const float* dg, const float* dbeta, const bf16* a, int64_t ld_a, const bf16* b,
                                  int64_t ld_b, const bf16* A_log, const bf16* dt_bias, int64_t tokens, int nv,
                                  bf16* da, int64_t ld_da, bf16* db, int64_t ld_db, float* dA_log, float* ddt_bias,
                                  float* ws, cudaStream_t stream);

// ---- 4. Gated RMSNorm per value head (HF Qwen3NextRMSNormGated / FLA FusedRMSNormGated; weight
// initialized to ones, used as w, not 1 + w):
//   n = o · rsqrt(mean(o²) + eps);  y = (w · n) · silu(z)
// o: BF16 [tokens, heads·head_dim] (the core's output), z: BF16 (in_proj_z output), w: [head_dim] BF16
// or FP32 (the FP32 master copy), y: BF16. Strides ld_o, ld_z, ld_y. head_dim <= 256.
// Precision: FP32 throughout, y rounded once (as FLA's fused kernel, which HF uses when installed).
// HF's eager module under BF16 instead rounds n to BF16 before multiplying by w (a BF16 product when
// w is BF16) and multiplies by silu(z) in FP32 before the final BF16 cast.
absl::Status GatedRmsNormForward(const bf16* o, int64_t ld_o, const bf16* z, int64_t ld_z, const bf16* w,
                                 int64_t tokens, int heads, int head_dim, float eps, bf16* y, int64_t ld_y,
                                 cudaStream_t stream);
absl::Status GatedRmsNormForward(const bf16* o, int64_t ld_o, const bf16* z, int64_t ld_z, const float* w,
                                 int64_t tokens, int heads, int head_dim, float eps, bf16* y, int64_t ld_y,
                                 cudaStream_t stream);
// From dy (BF16, the out_proj dgrad output): d_o FP32 (what the core's backward reads) and dz BF16
// (the in_proj_z dgrad GEMM input), overwritten; dw [head_dim] FP32 += Σ over tokens and heads
// (may be null). rstd is recomputed from o.
int64_t GatedRmsNormBackwardWorkspaceNumel(int64_t tokens, int heads, int head_dim);
absl::Status GatedRmsNormBackward(const bf16* dy, int64_t ld_dy, const bf16* o, int64_t ld_o, const bf16* z,
                                  int64_t ld_z, const bf16* w, int64_t tokens, int heads, int head_dim, float eps,
                                  float* d_o, int64_t ld_do, bf16* dz, int64_t ld_dz, float* dw, float* ws,
                                  cudaStream_t stream);
absl::Status GatedRmsNormBackward(const bf16* dy, int64_t ld_dy, const bf16* o, int64_t ld_o, const bf16* z,
                                  int64_t ld_z, const float* w, int64_t tokens, int heads, int head_dim, float eps,
                                  float* d_o, int64_t ld_do, bf16* dz, int64_t ld_dz, float* dw, float* ws,
                                  cudaStream_t stream);

// ---- 5. Output gate of the gated full attention (HF Qwen3NextAttention). q_proj's output holds per
// head [query(hd) | gate(hd)]: qp [tokens, heads·2·hd] at row stride ld_qp, gate of head h at column
// h·2·hd + hd.
//   out[t, h·hd + i] = attn[t, h·hd + i] · sigmoid(gate[t, h, i])
// attn, out: BF16 [tokens, heads·hd] contiguous. FP32 math, one rounding (HF: sigmoid in BF16, BF16
// product).
absl::Status AttnOutputGateForward(const bf16* attn, const bf16* qp, int64_t ld_qp, int64_t tokens, int heads,
                                   int head_dim, bf16* out, cudaStream_t stream);
// dattn = dout · sigmoid(gate) (BF16 [tokens, heads·hd], the attention backward's dO; may alias dout);
// dgate = dout · attn · σ(1 − σ) written into the gate columns of dqp (BF16, q_proj's output gradient,
// stride ld_dqp) so that the q_proj GEMMs read one buffer; the query columns of dqp are not touched.
absl::Status AttnOutputGateBackward(const bf16* dout, const bf16* attn, const bf16* qp, int64_t ld_qp, int64_t tokens,
                                    int heads, int head_dim, bf16* dattn, bf16* dqp, int64_t ld_dqp,
                                    cudaStream_t stream);

}  // namespace slidedp::kernels
