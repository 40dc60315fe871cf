// Flash attention forward and backward for packed variable-length documents (causal inside each
// document, GQA). No S×S matrix is ever stored; forward saves the log-sum-exp per (head, token).
//
// Fast path (head_dim 64 or 128): FA2-style tiles on mma.sync m16n8k16 BF16 tensor cores, FP32
// accumulation, online softmax in registers. Backward: one block per (key block, kv head,
// document) keeps dK/dV in registers over every q head of its group (no atomics for dK/dV); dQ
// is accumulated in FP32 with atomics into a workspace (or in a fixed order: AttnArgs::ordered_dq),
// then scaled and cast.
// Slow path (any other head_dim <= 256, for tiny test models): one warp per (token, head).
//
// Layouts: q [T, nq*hd], k/v [T, nkv*hd], o [T, nq*hd], each with its own row stride (elements);
// lse [nq, T] FP32 natural log of Σ exp(scale * q·k). cu_seqlens: device [docs + 1].
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

struct AttnArgs {
  int64_t tokens = 0;
  int num_docs = 0;
  int max_seqlen = 0;
  int num_q_heads = 0;
  int num_kv_heads = 0;
  int head_dim = 0;
  float softmax_scale = 0.f;
  const int32_t* cu_seqlens = nullptr;  // device
  // Backward work split (tensor-core path): one block per (key block, q head) with FP32 dK/dV
  // partials summed per GQA group afterwards, instead of one block per (key block, kv head).
  // More blocks for short inputs at the cost of 8·T·nq·hd bytes of traffic.
  enum class BwdSplit { kAuto, kPerKvHead, kPerQHead };
  BwdSplit bwd_split = BwdSplit::kAuto;
  // Backward (tensor-core path): dQ contributions are added in a fixed order (key block by key
  // block, each waiting for its turn) instead of with atomics, so the result is bitwise
  // repeatable; costs the waits and a small counter array in the workspace.
  bool ordered_dq = false;
};

struct AttnTensor {
  const __nv_bfloat16* ptr = nullptr;
  int64_t ld = 0;
};
struct AttnOutTensor {
  __nv_bfloat16* ptr = nullptr;
  int64_t ld = 0;
};

// True if the tensor-core path handles this head_dim.
bool FlashAttentionFastPath(int head_dim);

absl::Status FlashAttentionForward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o,
                                   float* lse, cudaStream_t stream);

// Workspace (bytes) the backward needs: FP32 dQ (and dK/dV on the slow path) plus the row dots.
int64_t FlashAttentionBackwardWorkspaceBytes(const AttnArgs& a);
// dq, dk, dv are written (not accumulated). ws: FlashAttentionBackwardWorkspaceBytes, 256-aligned.
absl::Status FlashAttentionBackward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                    const float* lse, AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk,
                                    AttnOutTensor dv, void* ws, cudaStream_t stream);

}  // namespace slidedp::kernels
