// cuDNN's fused flash attention behind the same contract as FlashAttentionForward/Backward
// (attention.h): packed variable-length documents, causal inside each document, GQA, BF16 in/out,
// row strides (ld) for tensors inside the fused QKV buffer, LSE saved as FP32 [nq, T] natural log.
//
// Why: on H200 cuDNN's fused SDPA measured 456-648 TFLOP/s forward and 377-531 backward against
// 145-232 / 108-179 for our mma.sync kernels (PyTorch SDPA, one causal document, head_dim 128).
//
// How: libcudnn.so.9 is loaded at run time (dlopen; no link-time dependency). The graphs are
// built with cuDNN 9's backend API as the "composite" SDPA operation graph that cudnn-frontend
// lowers to (matmul, pointwise, reduction, reshape nodes), which cuDNN's fused attention engines
// recognise. Varlen packing maps onto cuDNN's ragged (THD) layout:
//   - document d            -> batch entry d of B = next power of two >= num_docs; entries past
//                              num_docs get length 0 (nothing to compute);
//   - its tokens            -> sequence positions [0, len_d) of that entry, with a per-entry
//                              ragged offset = cu_seqlens[d] · ld (elements) into the packed
//                              buffer, so q/k/v/o/do/dq/dk/dv keep their own row strides;
//   - document boundaries   -> padding mask with per-entry lengths (seq_len_q = seq_len_kv =
//                              len_d), so documents never attend to each other;
//   - causality             -> row >= col mask (top-left diagonal) inside each entry;
//   - S (max sequence)      -> next power of two >= max_seqlen (at least 64).
// Offsets and lengths are derived from cu_seqlens on the device (one tiny kernel per call), so a
// plan depends only on (B, S, heads, head_dim, row strides) and not on the document lengths.
// cuDNN's softmax stats are the same quantity as our LSE (natural log of Σ exp(scale·q·k)), but
// ragged stats are token-major [T, nq]; a small transpose kernel converts to/from our [nq, T].
//
// Long calls: ragged offsets are INT32 elements, so a call whose tokens · row stride reaches 2^31
// (Qwen3-8B's fused QKV rows at ~350K tokens) runs in pieces: whole documents grouped so each
// group's offsets fit (pointers shifted to the group's first row; needs AttnArgs::cu_seqlens_host),
// and a document too long for any group on its own as one dense entry (B = 1, S = its length, no
// offsets, 64-bit strides). CudnnAttentionOptions::dense_single_document runs every one-document
// call densely too.
//
// Cross attention (AttnArgs::kv_bounds: a context-parallel share's query pieces against the keys
// its group gathered), when CudnnAttentionOptions::cross allows it: each query piece runs as one
// dense entry against its key range (S = its queries, S_kv = its keys, the causal diagonal aligned
// bottom-right through the per-entry lengths), pointers moved to the piece's rows; needs the host
// copies of cu_seqlens and kv_bounds and pieces of at least cross_min_tokens queries (a dense plan
// serves one pair of lengths), else UNIMPLEMENTED. The backward writes a piece's dK / dV into
// workspace scratch and adds them in FP32 into the caller's accumulators (BackwardCross), pieces
// one after another, so overlapping key ranges sum there.
//
// Errors: UNAVAILABLE when libcudnn cannot be loaded or is older than 9.0, UNIMPLEMENTED when no
// cuDNN engine accepts the graph or a long call of several documents comes without
// cu_seqlens_host (callers fall back to the own kernels).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "worker/kernels/attention.h"

namespace slidedp::kernels {

// Row strides (elements) of every tensor of one call. They are baked into cuDNN's plans, so the
// workspace queries take them too. Forward uses q, k, v, o; backward all eight.
struct AttnRowStrides {
  int64_t q = 0, k = 0, v = 0, o = 0;
  int64_t dout = 0, dq = 0, dk = 0, dv = 0;
};

struct CudnnAttentionOptions {
  // A call of one document of at least dense_min_tokens runs one dense entry instead of the ragged
  // layout. A dense plan serves one length (the ragged ones serve power-of-two buckets), so short
  // calls of varied lengths stay ragged and at most kMaxDensePlans dense plans are kept (the least
  // recently used go first).
  bool dense_single_document = true;
  int64_t dense_min_tokens = 32768;
  // Dense entries carry the padding mask and length overrides (as ragged ones must) or not.
  bool dense_padding_mask = false;
  // Which engine configuration that accepts a graph runs it (0: the heuristics' first; benches).
  int engine = 0;
  // Ragged offsets must stay below this (elements); tests lower it to exercise the groups.
  int64_t ragged_offset_limit = (int64_t{1} << 31) - 1;
  // Cross attention on cuDNN (else UNIMPLEMENTED: the own kernels run it), for query pieces of at
  // least cross_min_tokens (CudaBackendOptions turns it on; docs/context-parallel.md).
  bool cross = false;
  int64_t cross_min_tokens = 32768;
  // Sliding windows (AttnArgs::window shorter than the longest document) through the left-bound
  // mask (cudnn_attention_graph.cc: cudnn-frontend's composite diagonal-band pattern), else
  // UNIMPLEMENTED (the own kernels run such calls). Off by default: not yet run on a GPU
  // (cudnn_attention_gpu_test's Windows cases turn it on and check it against FP64).
  bool window_mask = false;
};

class CudnnAttention {
 public:
  static constexpr int kMaxDensePlans = 16;
  // Loads libcudnn (SLIDEDP_CUDNN_LIB: a file or the directory holding libcudnn.so.9, else the
  // loader's search path) and creates a cuDNN handle on `device`. Every later call must run with
  // `device` current.
  static absl::StatusOr<std::unique_ptr<CudnnAttention>> Create(int device);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // cuDNN's version as cudnnGetVersion() reports it (e.g. 91900).
  int64_t version() const;

  // Applies to calls after it (plans are cached per option set).
  void set_options(const CudnnAttentionOptions& options);
  // Plans cached now, dense ones among them (tests: the dense ones stay within kMaxDensePlans).
  int cached_plans(bool dense_only) const;

  // Workspace (bytes, to be 256-aligned) for one call; builds and caches the plan, so this is
  // also the "is this shape supported" probe. Grows with tokens (LSE scratch, offsets) and, for
  // backward, with the FP32 dQ accumulator (T·ld_dq·4 bytes on cuDNN >= 9.6, B·nq·S·hd·4 before).
  absl::StatusOr<int64_t> ForwardWorkspaceBytes(const AttnArgs& a, const AttnRowStrides& ld);
  absl::StatusOr<int64_t> BackwardWorkspaceBytes(const AttnArgs& a, const AttnRowStrides& ld);

  // Same semantics as FlashAttentionForward/Backward (a.bwd_split is ignored); ws holds at least
  // the bytes the matching query returned. Never synchronizes. Calls are serialized internally
  // (one cuDNN handle).
  absl::Status Forward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o, float* lse,
                       void* ws, cudaStream_t stream);
  absl::Status Backward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o, const float* lse,
                        AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk, AttnOutTensor dv, void* ws,
                        cudaStream_t stream);
  // Cross attention's backward with FlashAttentionBackwardCross's contract (attention.h): dq
  // written, dK (scaled) and dV ADDED in FP32 into dk_acc / dv_acc ([kv_tokens, ld_acc]); ws holds
  // BackwardWorkspaceBytes(a, ld) (a cross call's dk / dv strides are its scratch's, ld's ignored).
  absl::Status BackwardCross(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                             const float* lse, AttnTensor dout, AttnOutTensor dq, float* dk_acc, float* dv_acc,
                             int64_t ld_acc, void* ws, cudaStream_t stream);

 private:
  struct Impl;
  explicit CudnnAttention(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace slidedp::kernels
