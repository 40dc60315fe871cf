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
// lse [nq, T] FP32 natural log of Σ exp(scale * q·k) (+ exp(sink)). cu_seqlens: device [docs + 1].
// Sliding windows (AttnArgs::window) and attention sinks (AttnArgs::sinks) on both paths; the
// tensor-core kernels skip the key blocks outside the band.
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
  // The same on the host, where the caller has it (optional): cuDNN cuts a call whose ragged
  // offsets overflow INT32 into groups of documents by it (cudnn_attention.h).
  const int32_t* cu_seqlens_host = nullptr;
  // Backward work split (tensor-core path): one block per (key block, q head) with FP32 dK/dV
  // partials summed per GQA group afterwards, instead of one block per (key block, kv head).
  // More blocks for short inputs at the cost of 8·T·nq·hd bytes of traffic.
  enum class BwdSplit { kAuto, kPerKvHead, kPerQHead };
  BwdSplit bwd_split = BwdSplit::kAuto;
  // Backward (tensor-core path): dQ contributions are added in a fixed order (key block by key
  // block, each waiting for its turn) instead of with atomics, so the result is bitwise
  // repeatable; costs the waits and a small counter array in the workspace.
  bool ordered_dq = false;
  // Cross attention of query pieces against a separate key range each (context parallelism: a
  // rank's queries against the keys and values its group gathered). Set, the "documents" are
  // query pieces: piece d's queries are rows [cu_seqlens[d], cu_seqlens[d+1]) of q, o, lse and dO,
  // and its keys rows [kv_bounds[2d], kv_bounds[2d+1]) of k and v (kv_tokens rows), at least as
  // many as its queries; the piece's queries are the last of its keys' positions (bottom-right
  // causal): its query i sees its keys 0 .. len_kv - len_q + i. max_seqlen is the longest piece's
  // queries, max_seqlen_kv its longest key range. Key ranges of different pieces may overlap.
  // Null: self attention (the keys are the queries' own rows, causal inside each document).
  const int32_t* kv_bounds = nullptr;  // device [2 * num_docs]
  const int32_t* kv_bounds_host = nullptr;  // the same on the host, where the caller has it (cuDNN needs it)
  int64_t kv_tokens = 0;
  int max_seqlen_kv = 0;
  bool cross() const { return kv_bounds != nullptr; }
  // Sliding-window attention (HF's sliding_window): query i sees only the `window` keys ending at
  // its own, keys i + off - window < key <= i + off (window 1: itself alone); 0: no limit but the
  // document's (piece's) start.
  int window = 0;
  // Attention sinks (GPT-OSS): a learned logit per q head (device [num_q_heads], FP32, natural-log
  // units, not scaled by softmax_scale) joining each row's softmax denominator only, so a row's
  // weights sum to less than 1; lse includes it. Backward ADDS d loss / d sink into dsinks
  // (device [num_q_heads], FP32): -Σ_rows exp(sink - lse) · (dO·O).
  const float* sinks = nullptr;
  float* dsinks = nullptr;
  // The low half of the FP32 output (optional; own kernels only, cuDNN neither writes nor reads it):
  // [T, nq*hd] with o's row stride. Forward writes o_fp32 - bf16(o_fp32) rounded to BF16 beside o;
  // backward forms the row dots D = dO·O from o + o_lo, i.e. from the FP32 output. Without it D
  // carries O's BF16 rounding, one error per row that every dS of the row shares: where the
  // values share a large component (a v bias) it dominates O, and dQ / dK (which sum dS over a
  // row or a document) come out several times noisier than the BF16 operands alone make them
  // (docs/kernels.md, "The row dots").
  __nv_bfloat16* o_lo = nullptr;
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
// Self attention only (INVALID_ARGUMENT for cross arguments: FlashAttentionBackwardCross).
absl::Status FlashAttentionBackward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                    const float* lse, AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk,
                                    AttnOutTensor dv, void* ws, cudaStream_t stream);

// Cross attention's backward (AttnArgs::kv_bounds set): dq written as above; the key side's
// gradients ADDED in FP32 into dk_acc and dv_acc ([kv_tokens, ld] each, dK already scaled by
// softmax_scale), so pieces whose key ranges overlap sum there. Every key row receives at most one
// add per piece covering it; where at most two pieces cover a row (a zig-zag share has at most two
// pieces per document) the sum is independent of their order, so with ordered_dq the result is
// bitwise repeatable. ws: FlashAttentionBackwardWorkspaceBytes(a).
absl::Status FlashAttentionBackwardCross(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                         const float* lse, AttnTensor dout, AttnOutTensor dq, float* dk_acc,
                                         float* dv_acc, int64_t ld_acc, void* ws, cudaStream_t stream);

}  // namespace slidedp::kernels
