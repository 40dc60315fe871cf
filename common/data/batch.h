// The host-side micro-batch: what the data layer builds (common/data/micro_batch.h) and every
// compute backend uploads (worker/compute/backend.h). Token ids, next-token labels, RoPE
// positions and document boundaries of num_tokens tokens flattened from packed rows.
#pragma once

#include <cstdint>
#include <vector>

namespace slidedp {

// The label of a position that is not trained (HF's ignore_index).
inline constexpr int32_t kIgnoreIndex = -100;

struct MicroBatch {
  std::vector<int32_t> tokens;      // [T] token ids, each in [0, vocab)
  std::vector<int32_t> labels;      // [T] next-token targets, kIgnoreIndex where not trained
  std::vector<int32_t> positions;   // [T] RoPE positions, restarting at 0 per document
  std::vector<int32_t> cu_seqlens;  // [D+1] document boundaries in [0, T], cu_seqlens[0]=0, back()=T
  int32_t max_seqlen = 0;           // longest document
  int64_t num_tokens() const { return static_cast<int64_t>(tokens.size()); }
  int64_t num_trained() const;  // labels != kIgnoreIndex
};

}  // namespace slidedp
