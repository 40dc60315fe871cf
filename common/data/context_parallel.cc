// Zig-zag split of a micro-batch over a context-parallel group; see context_parallel.h.
#include "common/data/context_parallel.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace slidedp::data {

int64_t ContextSplit::max_local_tokens() const {
  int64_t m = 0;
  for (const ContextShard& s : shards) m = std::max<int64_t>(m, s.local.num_tokens());
  return m;
}

std::vector<int64_t> ContextSplit::GatheredPosition() const {
  std::vector<int64_t> pos(num_tokens, -1);
  const int64_t part = max_local_tokens();
  for (size_t r = 0; r < shards.size(); ++r) {
    const std::vector<int64_t>& g = shards[r].global_index;
    for (size_t i = 0; i < g.size(); ++i) pos[g[i]] = static_cast<int64_t>(r) * part + static_cast<int64_t>(i);
  }
  return pos;
}

absl::StatusOr<ContextSplit> SplitForContextParallel(const MicroBatch& full, int ranks,
                                                     absl::Span<const int64_t> row_lengths) {
  const int64_t T = full.num_tokens();
  if (ranks < 1) return absl::InvalidArgumentError(absl::StrCat("context parallel: ", ranks, " ranks"));
  if (static_cast<int64_t>(full.labels.size()) != T || static_cast<int64_t>(full.positions.size()) != T ||
      full.cu_seqlens.size() < 2 || full.cu_seqlens.front() != 0 || full.cu_seqlens.back() != T ||
      !std::is_sorted(full.cu_seqlens.begin(), full.cu_seqlens.end())) {
    return absl::InvalidArgumentError("context parallel: malformed micro-batch (token, label, position or "
                                      "document boundary arrays disagree)");
  }
  std::vector<int64_t> rows(row_lengths.begin(), row_lengths.end());
  if (rows.empty()) rows.push_back(T);
  int64_t sum = 0;
  for (int64_t L : rows) {
    if (L < 1) return absl::InvalidArgumentError(absl::StrCat("context parallel: a row of ", L, " tokens"));
    sum += L;
  }
  if (sum != T) {
    return absl::InvalidArgumentError(
        absl::StrCat("context parallel: rows add up to ", sum, " tokens, the micro-batch has ", T));
  }
  // Every token's document (for the local pieces).
  std::vector<int32_t> doc(T);
  for (size_t d = 0; d + 1 < full.cu_seqlens.size(); ++d) {
    for (int64_t t = full.cu_seqlens[d]; t < full.cu_seqlens[d + 1]; ++t) doc[t] = static_cast<int32_t>(d);
  }

  ContextSplit split;
  split.num_tokens = T;
  split.shards.resize(ranks);
  const int64_t chunks = 2 * static_cast<int64_t>(ranks);
  int64_t row_start = 0;
  for (int64_t L : rows) {
    auto bound = [&](int64_t i) { return row_start + i * L / chunks; };
    for (int c = 0; c < ranks; ++c) {
      std::vector<int64_t>& g = split.shards[c].global_index;
      for (int64_t i : {static_cast<int64_t>(c), chunks - 1 - c}) {
        for (int64_t t = bound(i); t < bound(i + 1); ++t) g.push_back(t);
      }
    }
    row_start += L;
  }
  for (int c = 0; c < ranks; ++c) {
    ContextShard& s = split.shards[c];
    if (s.global_index.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("context parallel: ", T, " tokens leave rank ", c, " of ", ranks,
                                                     " without any"));
    }
    MicroBatch& m = s.local;
    m.cu_seqlens = {0};
    for (size_t i = 0; i < s.global_index.size(); ++i) {
      const int64_t t = s.global_index[i];
      m.tokens.push_back(full.tokens[t]);
      m.labels.push_back(full.labels[t]);
      m.positions.push_back(full.positions[t]);
      const bool ends_piece = i + 1 == s.global_index.size() || s.global_index[i + 1] != t + 1 || doc[t + 1] != doc[t];
      if (ends_piece) m.cu_seqlens.push_back(static_cast<int32_t>(i + 1));
    }
    for (size_t d = 0; d + 1 < m.cu_seqlens.size(); ++d) {
      m.max_seqlen = std::max(m.max_seqlen, m.cu_seqlens[d + 1] - m.cu_seqlens[d]);
    }
  }
  if (ranks > 1) {  // what attention needs of the whole (one rank keeps its micro-batch as it was)
    const std::vector<int64_t> gathered = split.GatheredPosition();
    const int64_t part = split.max_local_tokens();
    for (int c = 0; c < ranks; ++c) {
      MicroBatchContext& ctx = split.shards[c].local.context;
      ctx.ranks = ranks;
      ctx.rank = c;
      ctx.full_cu_seqlens = full.cu_seqlens;
      ctx.global_index = split.shards[c].global_index;
      ctx.part = part;
      ctx.gathered_position = gathered;
    }
  }
  return split;
}

}  // namespace slidedp::data
