// Zig-zag split of a micro-batch over a context-parallel group; see context_parallel.h.
#include "common/data/context_parallel.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp::data {
namespace {

// Every rank's token indices in the micro-batch (the cheap part, all ranks' are needed for the
// gather positions), after checking the micro-batch and the rows.
absl::StatusOr<std::vector<std::vector<int64_t>>> RankIndices(const MicroBatch& full, int ranks,
                                                              absl::Span<const int64_t> row_lengths) {
  const int64_t T = full.num_tokens();
  if (ranks < 1) return absl::InvalidArgumentError(absl::StrCat("context parallel: ", ranks, " ranks"));
  if (static_cast<int64_t>(full.labels.size()) != T || static_cast<int64_t>(full.positions.size()) != T ||
      full.cu_seqlens.size() < 2 || full.cu_seqlens.front() != 0 || full.cu_seqlens.back() != T ||
      !std::is_sorted(full.cu_seqlens.begin(), full.cu_seqlens.end())) {
    return absl::InvalidArgumentError(
        "context parallel: malformed micro-batch (token, label, position or "
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
  std::vector<std::vector<int64_t>> index(ranks);
  const int64_t chunks = 2 * static_cast<int64_t>(ranks);
  int64_t row_start = 0;
  for (int64_t L : rows) {
    auto bound = [&](int64_t i) { return row_start + i * L / chunks; };
    for (int c = 0; c < ranks; ++c) {
      for (int64_t i : {static_cast<int64_t>(c), chunks - 1 - c}) {
        for (int64_t t = bound(i); t < bound(i + 1); ++t) index[c].push_back(t);
      }
    }
    row_start += L;
  }
  for (int c = 0; c < ranks; ++c) {
    if (index[c].empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("context parallel: ", T, " tokens leave rank ", c, " of ", ranks, " without any"));
    }
  }
  return index;
}

int64_t MaxSize(const std::vector<std::vector<int64_t>>& index) {
  int64_t m = 0;
  for (const auto& i : index) m = std::max<int64_t>(m, static_cast<int64_t>(i.size()));
  return m;
}

std::vector<int64_t> GatherPositions(const std::vector<std::vector<int64_t>>& index, int64_t num_tokens) {
  std::vector<int64_t> pos(num_tokens, -1);
  const int64_t part = MaxSize(index);
  for (size_t r = 0; r < index.size(); ++r) {
    for (size_t i = 0; i < index[r].size(); ++i)
      pos[index[r][i]] = static_cast<int64_t>(r) * part + static_cast<int64_t>(i);
  }
  return pos;
}

// Rank c's share: its tokens' ids, labels and positions, its local pieces, and (with more than one
// rank) what attention needs of the whole.
ContextShard MakeShard(const MicroBatch& full, const std::vector<std::vector<int64_t>>& index, int c,
                       const std::vector<int64_t>& gathered) {
  ContextShard s;
  s.global_index = index[c];
  // A local piece ends where the next local token is not the next token of the same document.
  auto doc_end = [&](int64_t t) {  // the end of the document holding token t
    return *std::upper_bound(full.cu_seqlens.begin(), full.cu_seqlens.end(), static_cast<int32_t>(t));
  };
  MicroBatch& m = s.local;
  m.cu_seqlens = {0};
  for (size_t i = 0; i < s.global_index.size(); ++i) {
    const int64_t t = s.global_index[i];
    m.tokens.push_back(full.tokens[t]);
    m.labels.push_back(full.labels[t]);
    m.positions.push_back(full.positions[t]);
    const bool ends_piece = i + 1 == s.global_index.size() || s.global_index[i + 1] != t + 1 || t + 1 == doc_end(t);
    if (ends_piece) m.cu_seqlens.push_back(static_cast<int32_t>(i + 1));
  }
  for (size_t d = 0; d + 1 < m.cu_seqlens.size(); ++d) {
    m.max_seqlen = std::max(m.max_seqlen, m.cu_seqlens[d + 1] - m.cu_seqlens[d]);
  }
  const int ranks = static_cast<int>(index.size());
  if (ranks > 1) {  // one rank keeps its micro-batch as it was
    MicroBatchContext& ctx = m.context;
    ctx.ranks = ranks;
    ctx.rank = c;
    ctx.full_cu_seqlens = full.cu_seqlens;
    ctx.global_index = s.global_index;
    ctx.part = MaxSize(index);
    ctx.gathered_position = gathered;
  }
  return s;
}

}  // namespace

int64_t ContextSplit::max_local_tokens() const {
  int64_t m = 0;
  for (const ContextShard& s : shards) m = std::max<int64_t>(m, s.local.num_tokens());
  return m;
}

std::vector<int64_t> ContextSplit::GatheredPosition() const {
  std::vector<std::vector<int64_t>> index;
  for (const ContextShard& s : shards) index.push_back(s.global_index);
  return GatherPositions(index, num_tokens);
}

absl::StatusOr<ContextSplit> SplitForContextParallel(const MicroBatch& full, int ranks,
                                                     absl::Span<const int64_t> row_lengths) {
  ASSIGN_OR_RETURN(const std::vector<std::vector<int64_t>> index, RankIndices(full, ranks, row_lengths));
  const std::vector<int64_t> gathered = ranks > 1 ? GatherPositions(index, full.num_tokens()) : std::vector<int64_t>();
  ContextSplit split;
  split.num_tokens = full.num_tokens();
  for (int c = 0; c < ranks; ++c) split.shards.push_back(MakeShard(full, index, c, gathered));
  return split;
}

absl::StatusOr<ContextShard> ContextShareOf(const MicroBatch& full, int ranks, int rank,
                                            absl::Span<const int64_t> row_lengths) {
  if (rank < 0 || rank >= ranks) {
    return absl::InvalidArgumentError(absl::StrCat("context parallel: rank ", rank, " of ", ranks));
  }
  ASSIGN_OR_RETURN(const std::vector<std::vector<int64_t>> index, RankIndices(full, ranks, row_lengths));
  const std::vector<int64_t> gathered = ranks > 1 ? GatherPositions(index, full.num_tokens()) : std::vector<int64_t>();
  return MakeShard(full, index, rank, gathered);
}

absl::Status ValidateContextShare(const MicroBatch& mb) {
  const MicroBatchContext& c = mb.context;
  const int64_t T = mb.num_tokens();
  if (c.ranks < 1 || c.rank < 0 || c.rank >= c.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch context: rank ", c.rank, " of ", c.ranks));
  }
  if (c.ranks == 1) return absl::OkStatus();
  const int64_t full = static_cast<int64_t>(c.gathered_position.size());
  const auto& cu = c.full_cu_seqlens;
  if (cu.size() < 2 || cu.front() != 0 || cu.back() != full || !std::is_sorted(cu.begin(), cu.end()) ||
      static_cast<int64_t>(c.global_index.size()) != T || c.part < T || c.part > full ||
      full > std::numeric_limits<int32_t>::max() / c.ranks) {
    return absl::InvalidArgumentError(absl::StrCat("micro-batch context: ", T, " tokens of ", full, ", part ", c.part,
                                                   ", ", cu.size(), " document boundaries"));
  }
  for (int64_t i = 0; i < T; ++i) {
    const int64_t g = c.global_index[i];
    if (g < 0 || g >= full || (i > 0 && g <= c.global_index[i - 1]) ||
        c.gathered_position[g] != static_cast<int64_t>(c.rank) * c.part + i) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch context: token ", i, " has index ", g,
                                                     " in the whole, which does not map back to it"));
    }
  }
  for (int64_t g = 0; g < full; ++g) {
    if (c.gathered_position[g] < 0 || c.gathered_position[g] >= static_cast<int64_t>(c.ranks) * c.part) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch context: token ", g, " of the whole gathers from ",
                                                     c.gathered_position[g], ", outside ", c.ranks, " parts of ",
                                                     c.part));
    }
  }
  const auto& lcu = mb.cu_seqlens;
  if (lcu.size() < 2 || lcu.front() != 0 || lcu.back() != T || !std::is_sorted(lcu.begin(), lcu.end())) {
    return absl::InvalidArgumentError("micro-batch context: malformed local document boundaries");
  }
  for (size_t d = 0; d + 1 < lcu.size(); ++d) {
    if (lcu[d] == lcu[d + 1]) continue;
    const int64_t first = c.global_index[lcu[d]], last = c.global_index[lcu[d + 1] - 1];
    const auto doc = std::upper_bound(cu.begin(), cu.end(), first) - 1;
    if (last - first != lcu[d + 1] - 1 - lcu[d] || last >= *(doc + 1)) {
      return absl::InvalidArgumentError(absl::StrCat("micro-batch context: local piece ", d, " (tokens ", first, "..",
                                                     last, " of the whole) is not a run of one document"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ContextAttention> ContextAttentionOf(const MicroBatch& mb) {
  RETURN_IF_ERROR(ValidateContextShare(mb));
  const MicroBatchContext& c = mb.context;
  if (c.ranks == 1) return absl::InvalidArgumentError("micro-batch context: not a context-parallel share");
  ContextAttention a;
  const auto& cu = c.full_cu_seqlens;
  const auto& lcu = mb.cu_seqlens;
  for (size_t d = 0; d + 1 < lcu.size(); ++d) {
    if (lcu[d] == lcu[d + 1]) {  // an empty piece attends nothing
      a.kv_bounds.insert(a.kv_bounds.end(), {0, 0});
      continue;
    }
    const int64_t first = c.global_index[lcu[d]], last = c.global_index[lcu[d + 1] - 1];
    const int32_t begin = *(std::upper_bound(cu.begin(), cu.end(), first) - 1);
    a.kv_bounds.push_back(begin);
    a.kv_bounds.push_back(static_cast<int32_t>(last + 1));
    a.max_keys = std::max(a.max_keys, static_cast<int>(last + 1 - begin));
  }
  a.gather_rows.assign(static_cast<size_t>(c.ranks) * c.part, -1);
  for (size_t g = 0; g < c.gathered_position.size(); ++g) {
    int32_t& row = a.gather_rows[c.gathered_position[g]];
    if (row >= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("micro-batch context: tokens ", row, " and ", g, " of the whole gather from the same row"));
    }
    row = static_cast<int32_t>(g);
  }
  return a;
}

}  // namespace slidedp::data
