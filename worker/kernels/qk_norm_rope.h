// Fused per-head q/k RMSNorm + RoPE of a Qwen3 / Qwen3.5 attention block, forward and backward,
// with BF16 or FP32 norm weights acting as w or (1 + w) (HF order: norm, then rotate_half); and
// RoPE alone (Qwen2, Llama, Mistral: no q/k norm), with plain or scaled inverse frequencies, HF's
// attention scaling, and RoPE on all of a head or on its first rotary_dim dims (Qwen3.5).
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. BF16 storage, FP32 math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "worker/kernels/rmsnorm.h"  // NormWeight

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// Per-head RMSNorm (q_norm / k_norm weights [hd], BF16 or FP32; n = (x * rstd) * w' in FP32, w' = w
// or 1 + w: norm_weight) then RoPE (rotate_half, positions per token), HF Qwen3 order. Reads q head
// h at qkv[:, h*q_head_stride :+hd] and k head h at qkv[:, k_column + h*hd :+hd] (row stride ld_qkv);
// writes q_out [T, nq*hd] and k_out [T, nkv*hd] (contiguous). With the defaults (q_head_stride hd,
// k_column nq*hd) that is q at qkv[:, 0:nq*hd] and k right after it, the fused QKV layout.
// hd % 4 == 0, hd <= 256; rotary_dim % 4 == 0; q_head_stride, k_column and ld_qkv even.
struct RopeArgs {
  int64_t tokens = 0;
  int num_q_heads = 0;
  // 0: q alone (a layer that attends with another layer's keys: Gemma 4's kv-shared layers); the k
  // arguments (k_norm_w, k_out, dk_out, dk_norm_w) are then neither read nor written and may be null.
  int num_kv_heads = 0;
  int head_dim = 0;
  float eps = 1e-6f;
  float theta = 1e6f;
  // Device [rotary_dim / 2] inverse frequencies (a scaled RoPE, ModelConfig::RopeInverseFrequencies);
  // nullptr: 1 / theta^(2j / rotary_dim), computed in the kernel.
  const float* inv_freq = nullptr;
  // Multiplies cos and sin, as HF's attention_scaling does (ModelConfig::RopeAttentionScaling: yarn's
  // attention factor); forward and backward. 1 leaves every result bit-identical.
  float attention_scaling = 1.0f;
  // The q_norm / k_norm weights' action (rmsnorm.h): Qwen3.5's act as 1 + w. RoPE alone ignores it.
  NormWeight norm_weight = NormWeight::kPlain;
  // RoPE rotates the first rotary_dim dims of each head (rotate_half within them: dims i and
  // i + rotary_dim/2, inverse frequencies over rotary_dim) and passes the rest through unchanged, as
  // HF's partial_rotary_factor (ModelConfig::rotary_dim(): Qwen3.5 64 of 256). The q/k norm still
  // spans the whole head. 0: head_dim (all of it).
  int rotary_dim = 0;
  // Elements from one q head to the next in qkv and in dqkv. 0: head_dim (heads contiguous). Qwen3.5's
  // q_proj emits [query | gate] per head, so 2 * head_dim: the query of head h is read at
  // h * 2 * head_dim, its gradient written there in dqkv, and the gate columns between are neither
  // read nor written (the output gate's kernels own them).
  int64_t q_head_stride = 0;
  // Column of k head 0 in qkv and in dqkv (the k heads contiguous from it). -1: right after the
  // q heads, num_q_heads * q_head_stride (the fused [q (| gates) | k | v] rows). q and k come from
  // one buffer with one row stride; projections that run as separate GEMMs write their outputs into
  // column ranges of that buffer (GemmArgs::ldd) rather than into separate buffers.
  int64_t k_column = -1;
};
absl::Status QkNormRopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const bf16* q_norm_w,
                               const bf16* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                               cudaStream_t stream);
absl::Status QkNormRopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const float* q_norm_w,
                               const float* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                               cudaStream_t stream);
// Gradients back through RoPE and the per-head norms: writes dq_raw/dk_raw into dqkv at the
// columns the forward read q and k from in qkv (defaults: dqkv[:, 0:(nq+nkv)*hd]; row stride
// ld_dqkv) and adds to dq_norm_w / dk_norm_w ([hd] FP32: the gradient of w, whichever norm_weight).
int64_t QkNormRopeBackwardWorkspaceNumel(const RopeArgs& a);
absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream);
absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const float* q_norm_w, const float* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream);

// RoPE alone on q and k (no q/k norm), read from qkv as above; and its backward, which writes the
// un-rotated gradients into dqkv at those columns. No workspace, no weight gradient.
absl::Status RopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const int32_t* positions, bf16* q_out,
                         bf16* k_out, cudaStream_t stream);
absl::Status RopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const int32_t* positions,
                          bf16* dqkv, int64_t ld_dqkv, cudaStream_t stream);

}  // namespace slidedp::kernels
