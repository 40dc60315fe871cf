// Launchers for the non-GEMM, non-attention kernels of a Qwen3 layer and head: RMSNorm, fused
// q/k RMSNorm + RoPE, SwiGLU, embedding, cross entropy over a logits chunk, and the small
// deterministic reductions they share.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. BF16 storage, FP32 math; the RMSNorm and embedding ops also have
// overloads taking FP32 activations (the FP32 residual stream); the norm ops also take FP32 norm
// weights.
// Weight gradients are ADDED to FP32 outputs through a two-stage deterministic reduction: each
// block writes a partial row into a caller workspace, then one pass sums the partials in a fixed
// order (so results do not depend on scheduling). The *WorkspaceNumel() helpers size it.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// Number of partial rows the deterministic weight-gradient reductions use for `rows` rows.
int64_t PartialBlocks(int64_t rows);

// y[r] = bf16(w * (x[r] * rstd[r])) in FP32, rstd[r] = 1/sqrt(mean(x[r]^2) + eps). rstd may be
// null. Needs h % 8 == 0 and h <= 8192 (one thread per 8 columns).
// Every RMSNorm and q/k-norm launcher takes the norm weight w either in BF16 or in FP32 (HF
// autocast multiplies by the FP32 master weight; BF16 weights near 1.0 lose small updates). Only
// the load differs; w must be 16-byte aligned.
absl::Status RmsNormForward(const bf16* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream);
absl::Status RmsNormForward(const bf16* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream);

// FP32-residual variant (HF autocast with an FP32 residual stream): x is FP32, the norm is
// computed in FP32 and y = bf16(w * (x * rstd)) is the BF16 input of the following GEMM.
absl::Status RmsNormForward(const float* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream);
absl::Status RmsNormForward(const float* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream);

// dx = RMSNorm'(x)ᵀ dy (+ dres if non-null), dw += Σ_r dy[r] * x[r] * rstd[r] (may be null).
// rstd: from forward. ws: RmsNormBackwardWorkspaceNumel floats. dx may alias dres.
int64_t RmsNormBackwardWorkspaceNumel(int64_t rows, int64_t h);
absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream);
absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const float* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream);
// FP32-residual variant: dy, x, dres and dx are all FP32 (same math, no BF16 rounding of dx).
absl::Status RmsNormBackward(const float* dy, const float* x, const bf16* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream);
absl::Status RmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream);

// Per-head RMSNorm (q_norm / k_norm weights [hd], BF16 or FP32; n = (x * rstd) * w in FP32) then
// RoPE (rotate_half, positions per token), HF Qwen3 order. Reads q at qkv[:, 0:nq*hd] and k at
// qkv[:, nq*hd : (nq+nkv)*hd] (row stride ld_qkv); writes q_out [T, nq*hd] and k_out [T, nkv*hd]
// (contiguous). hd % 4 == 0, hd <= 256.
struct RopeArgs {
  int64_t tokens = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float eps = 1e-6f;
  float theta = 1e6f;
};
absl::Status QkNormRopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const bf16* q_norm_w,
                               const bf16* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                               cudaStream_t stream);
absl::Status QkNormRopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const float* q_norm_w,
                               const float* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                               cudaStream_t stream);
// Gradients back through RoPE and the per-head norms: writes dq_raw/dk_raw into
// dqkv[:, 0:(nq+nkv)*hd] (row stride ld_dqkv) and adds to dq_norm_w / dk_norm_w ([hd] FP32).
int64_t QkNormRopeBackwardWorkspaceNumel(const RopeArgs& a);
absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream);
absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const float* q_norm_w, const float* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream);

// act[t, i] = silu(gu[t, i]) * gu[t, I + i]   (gu = [gate | up], row stride 2I).
absl::Status SwiGluForward(const bf16* gu, int64_t tokens, int64_t inter, bf16* act, cudaStream_t stream);
// dgu[t, i] = dact * up * silu'(gate), dgu[t, I + i] = dact * silu(gate).
absl::Status SwiGluBackward(const bf16* gu, const bf16* dact, int64_t tokens, int64_t inter, bf16* dgu,
                            cudaStream_t stream);

// out[t] = embed[tokens[t]]  (embed [vocab, h]): BF16 rows (the FP32 output upcasts, exact), or
// FP32 rows (the BF16 output rounds to nearest even, as the mirror does). An FP32 table may be
// mapped host memory (the job's master, read in place over PCIe; cudaHostGetDevicePointer).
absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream);
absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream);
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream);
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream);
// Deterministic, atomic-free backward over a host-built grouping of positions by token id:
// for each u < num_unique: dembed[uniq_tokens[u]] += Σ_{p in seg} dout[sorted_pos[p]], summed in
// position order (seg = [seg_offsets[u], seg_offsets[u+1])).
absl::Status EmbeddingBackward(const bf16* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream);
absl::Status EmbeddingBackward(const float* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream);

// Cross entropy over a chunk of BF16 logits rows (row stride ld), in place: the logits become
// dlogits = loss_scale * (softmax - onehot(label)) (zero for ignored rows), and
// row_loss[r] = loss_scale * (logsumexp - logit[label]) (0 if ignored).
absl::Status CrossEntropyInPlace(bf16* logits, int64_t rows, int64_t vocab, int64_t ld, const int32_t* labels,
                                 int32_t ignore_index, float loss_scale, float* row_loss, cudaStream_t stream);

// *out += Σ vals[0..n) in a fixed order (one block).
absl::Status SumInto(const float* vals, int64_t n, float* out, cudaStream_t stream);
// *out = Σ x[i]² accumulated in FP64, deterministically: kSumSquaresBlocks blocks write partial
// sums (fixed element-to-thread mapping) to `partials`, then one block adds them in a fixed
// order. Calls sharing `partials` must be ordered (one stream).
constexpr int kSumSquaresBlocks = 528;
absl::Status SumSquaresF32(const float* x, int64_t n, double* partials, double* out, cudaStream_t stream);
// out[c] += Σ_p partial[p * cols + c] for p in [0, parts), fixed order.
absl::Status ReducePartialsInto(const float* partial, int64_t parts, int64_t cols, float* out, cudaStream_t stream);
// dst[i] = bf16(src[i] * scale).
absl::Status CastF32ToBf16(const float* src, int64_t n, float scale, bf16* dst, cudaStream_t stream);
// out[i] = res[i] + float(branch[i]): the FP32 residual add of a BF16 GEMM output, in HF autocast's
// order (the branch is rounded to BF16 first, the sum is FP32). out may alias res.
absl::Status AddBf16ToF32(const float* res, const bf16* branch, int64_t n, float* out, cudaStream_t stream);

}  // namespace slidedp::kernels
