// Fused per-head q/k RMSNorm + RoPE of a Qwen3 attention block, forward and backward, with BF16
// or FP32 norm weights (HF Qwen3 order: norm, then rotate_half); and RoPE alone (Qwen2, Llama,
// Mistral: no q/k norm), with plain or scaled inverse frequencies and HF's attention scaling.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. BF16 storage, FP32 math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

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
  // Device [head_dim / 2] inverse frequencies (a scaled RoPE, ModelConfig::RopeInverseFrequencies);
  // nullptr: 1 / theta^(2j / head_dim), computed in the kernel.
  const float* inv_freq = nullptr;
  // Multiplies cos and sin, as HF's attention_scaling does (ModelConfig::RopeAttentionScaling: yarn's
  // attention factor); forward and backward. 1 leaves every result bit-identical.
  float attention_scaling = 1.0f;
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

// RoPE alone on q and k (no q/k norm), read from qkv as above; and its backward, which writes the
// un-rotated gradients into dqkv[:, 0:(nq+nkv)*hd]. No workspace, no weight gradient.
absl::Status RopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const int32_t* positions, bf16* q_out,
                         bf16* k_out, cudaStream_t stream);
absl::Status RopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const int32_t* positions,
                          bf16* dqkv, int64_t ld_dqkv, cudaStream_t stream);

}  // namespace slidedp::kernels
