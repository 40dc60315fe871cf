// cuDNN operation graphs of the fused SDPA forward and backward (the "composite" graphs
// cudnn-frontend 1.x lowers to), built for one PlanKey into a finalized execution plan, plus what
// cudnn_attention.cu needs to bind them: the tensor uids, the ragged-offset slots and the
// per-version backward variant. See cudnn_attention.h for the varlen mapping.
#pragma once

#include "worker/kernels/cudnn_loader.h"

#ifdef SLIDEDP_HAVE_CUDNN_GRAPH_H

#include <cstdint>
#include <memory>
#include <tuple>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/kernels/cudnn_attention.h"

namespace slidedp::kernels::cudnn_internal {

// A finalized execution plan and everything it references (kept alive together: the frontend
// does the same, and the backend API does not promise plans copy what they point to).
struct Plan {
  std::vector<Desc> descs;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace_bytes = 0;
  uint64_t last_use = 0;  // the cache's call stamp when it last served (dense plans are evicted by it)
};

// Unique ids of the tensors the caller binds at execution (virtual tensors get ids >= 1000).
enum Uid : int64_t {
  kUidQ = 1,
  kUidK,
  kUidV,
  kUidO,
  kUidStats,
  kUidDO,
  kUidDQ,
  kUidDK,
  kUidDV,
  kUidSeqQ,
  kUidSeqKv,
  kUidScale,
  kUidNegInf,
  kUidOne,
  kUidWindow,
  kUidSoftmaxSum,
  kUidDqAccum,
  kUidOffsetBase = 100,  // + OffsetSlot
};
// Ragged-offset arrays, one per tensor (each has its own row stride).
enum OffsetSlot : int { kOffQ, kOffK, kOffV, kOffO, kOffStats, kOffDO, kOffDQ, kOffDK, kOffDV, kNumOffsets };

// What a plan depends on. Not in the key: tokens, document lengths, pointers, softmax scale
// (passed by value at execution).
enum class Direction { kForward, kBackward };

struct PlanKey {
  Direction direction = Direction::kForward;
  int64_t b = 0, s = 0, nq = 0, nkv = 0, hd = 0;
  AttnRowStrides ld;
  // ragged: documents as batch entries with ragged offsets (THD); else one dense entry of exactly
  // s tokens (b = 1, no offsets, stats [nq, s]). padding: the padding mask and the per-entry
  // length overrides (always with ragged). engine: which accepted engine configuration (0 = the
  // heuristics' first).
  bool ragged = true, padding = true;
  int engine = 0;
  // Cross attention (a context-parallel query piece): s_kv key rows per entry (0: s, self
  // attention) and the causal diagonal aligned bottom-right (query i of seq_q sees keys
  // 0 .. seq_kv - seq_q + i; needs padding's lengths).
  int64_t s_kv = 0;
  bool bottom_right = false;
  // A sliding window (AttnArgs::window, self attention only): the causal mask's band also bounded
  // on the left, key > query - window (cudnn-frontend's composite left-bound mask, top-left
  // aligned); its value is passed by value at execution (kUidWindow). 0: none.
  int64_t window = 0;
  int64_t skv() const { return s_kv > 0 ? s_kv : s; }
  auto Tie() const {
    return std::tie(direction, b, s, nq, nkv, hd, ld.q, ld.k, ld.v, ld.o, ld.dout, ld.dq, ld.dk, ld.dv, ragged,
                    padding, engine, s_kv, bottom_right, window);
  }
  bool operator<(const PlanKey& o) const { return Tie() < o.Tie(); }
};

// Per-version choices of the backward graph (mirroring cudnn-frontend's).
struct BwdVariant {
  bool ragged_accumulators;  // >= 9.6: softmax_sum / dQ accumulator sized by tokens (THD)
  bool second_padding_mask;  // [9.0, 9.10): padding mask applied again after subtracting stats
  bool zero_dq_accum;        // < 9.6: the accumulator must be zeroed by the caller
};
inline BwdVariant BwdVariantFor(int64_t version) {
  return {version >= 90600, version >= 90000 && version < 91000, version < 90600};
}

// The graph of one direction for `k`, finalized with the first engine that accepts it.
// UNIMPLEMENTED when none does.
absl::StatusOr<std::unique_ptr<Plan>> BuildForward(const CudnnApi& api, cudnnHandle_t handle, const PlanKey& k);
absl::StatusOr<std::unique_ptr<Plan>> BuildBackward(const CudnnApi& api, cudnnHandle_t handle, const PlanKey& k);

}  // namespace slidedp::kernels::cudnn_internal

#endif  // SLIDEDP_HAVE_CUDNN_GRAPH_H
