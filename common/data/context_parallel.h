// Context parallelism's split of one micro-batch over the C ranks of a group (issue 26,
// `runtime.context_parallel`): every rank holds a share of each row's tokens, runs the token-local
// work (embedding, norms, projections, MLP, head and loss) on them alone, and attends from its own
// queries to the keys and values of the whole micro-batch, which the group gathers layer by layer
// (worker/compute/cpu: AttentionForwardRows / AttentionBackwardRows).
//
// The split is zig-zag per row, for causal balance: row r of length L is cut into 2C chunks at
// floor(i L / 2C), and rank c takes chunks c and 2C-1-c, so every rank gets one early (cheap) and
// one late (expensive) piece of the causal triangle. Rows are the dataset rows a micro-batch
// concatenates (or the whole micro-batch as one row).
//
// A rank's local MicroBatch keeps each token's id, label and RoPE position (labels were formed on
// the whole row, so a chunk's last label is the next chunk's first token, as it should be); its
// cu_seqlens are the local pieces: maximal runs of tokens adjacent in the micro-batch and in one
// document, which is what the token-local ops need. Attention needs the whole micro-batch's
// document boundaries and each local token's global index (ContextShard::global_index).
#pragma once

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/data/batch.h"

namespace slidedp::data {

struct ContextShard {
  MicroBatch local;
  std::vector<int64_t> global_index;  // [local tokens], ascending: each token's index in the micro-batch
};

struct ContextSplit {
  int64_t num_tokens = 0;            // of the whole micro-batch
  std::vector<ContextShard> shards;  // one per rank
  // The most tokens any rank holds: the padded part size of a gather over the group.
  int64_t max_local_tokens() const;
  // For a gather of every rank's part padded to max_local_tokens() (rank-major), the position of
  // global token g in it: rank_of(g) * max_local_tokens() + its local index. [num_tokens].
  std::vector<int64_t> GatheredPosition() const;
};

// INVALID_ARGUMENT for ranks < 1, row lengths that are not positive or do not add up to the
// micro-batch's tokens, a malformed micro-batch (sizes, cu_seqlens), or a split that leaves a rank
// without tokens (rows shorter than the ranks). Empty row_lengths: the micro-batch is one row.
absl::StatusOr<ContextSplit> SplitForContextParallel(const MicroBatch& full, int ranks,
                                                     absl::Span<const int64_t> row_lengths = {});
// Rank `rank`'s share alone (what a worker builds for itself): SplitForContextParallel's
// shards[rank], without building the others.
absl::StatusOr<ContextShard> ContextShareOf(const MicroBatch& full, int ranks, int rank,
                                            absl::Span<const int64_t> row_lengths = {});

// A share's context fields checked against its tokens (a share comes from a worker's own split,
// but the backends treat it as input): its MicroBatchContext is consistent (rank among ranks, the
// whole's document boundaries, each local token's index in the whole ascending and gathering back
// to it, every gather position inside the ranks' parts) and each local piece (run of cu_seqlens)
// is consecutive tokens of one document of the whole. INVALID_ARGUMENT naming what disagrees.
absl::Status ValidateContextShare(const MicroBatch& share);

// What context-parallel attention of a share needs (worker/compute/cuda; validated as above):
struct ContextAttention {
  // [2 * pieces]: each local piece's keys in the whole, its document's first token .. its own
  // last token + 1 (kernels::AttnArgs::kv_bounds); 0, 0 for an empty piece.
  std::vector<int32_t> kv_bounds;
  int max_keys = 0;  // the longest of those ranges
  // [ranks * part]: the whole's token in each row of a rank-major gather (the inverse of
  // MicroBatchContext::gathered_position), -1 for a padding row.
  std::vector<int32_t> gather_rows;
};
absl::StatusOr<ContextAttention> ContextAttentionOf(const MicroBatch& share);

}  // namespace slidedp::data
