// The host-side micro-batch: what the data layer builds (common/data/micro_batch.h) and every
// compute backend uploads (worker/compute/backend.h). Token ids, next-token labels, RoPE
// positions and document boundaries of num_tokens tokens flattened from packed rows.
#pragma once

#include <cstdint>
#include <vector>

namespace slidedp {

// The label of a position that is not trained (HF's ignore_index).
inline constexpr int32_t kIgnoreIndex = -100;

// Context parallelism (common/data/context_parallel.h, runtime.context_parallel): a micro-batch
// that is one rank's share of a bigger one. Its token-local work runs on its own tokens; attention
// reads the keys and values of the whole, which the backend gathers over its context group.
struct MicroBatchContext {
  int ranks = 1;  // 1: a micro-batch of its own (the fields below empty)
  int rank = 0;
  std::vector<int32_t> full_cu_seqlens;    // the whole micro-batch's document boundaries
  std::vector<int64_t> global_index;       // [T] each token's index in the whole, ascending
  int64_t part = 0;                        // a rank's padded share in the group's gathers
  std::vector<int64_t> gathered_position;  // [whole's tokens] rank * part + local index
};

struct MicroBatch {
  std::vector<int32_t> tokens;      // [T] token ids, each in [0, vocab)
  std::vector<int32_t> labels;      // [T] next-token targets, kIgnoreIndex where not trained
  std::vector<int32_t> positions;   // [T] RoPE positions, restarting at 0 per document
  std::vector<int32_t> cu_seqlens;  // [D+1] document boundaries in [0, T], cu_seqlens[0]=0, back()=T
  int32_t max_seqlen = 0;           // longest document
  MicroBatchContext context;        // context parallelism's share, or none (ranks 1)
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_trained() const;  // labels != kIgnoreIndex
};

}  // namespace slidedp
