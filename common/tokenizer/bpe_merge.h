// The BPE merge loop shared by the byte-level model (tokenizer.cc) and the SentencePiece-style
// one (sentencepiece_bpe.cc): both start from a row of symbol ids (bytes there, characters or
// <0xNN> byte tokens here) and merge exactly as HF's `Word::merge_all` does. Also their per-thread
// cache of results for short pieces (words repeat heavily in real text).
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace slidedp::tok {

struct MergeTarget {
  uint32_t rank;
  uint32_t new_id;
};
// (left id << 32 | right id) -> the merge's rank and the merged token's id. HF builds it with a
// plain collect, so where tokenizer.json lists a pair twice the later rank wins.
using MergeMap = absl::flat_hash_map<uint64_t, MergeTarget>;

inline uint64_t MergeKey(uint32_t left, uint32_t right) { return (static_cast<uint64_t>(left) << 32) | right; }

// Merges `symbols` by rank: repeatedly the adjacent pair of lowest rank, leftmost on ties, until
// no pair has a merge. Appends the resulting ids to *out and, when `first` is given, for each of
// them the index in `symbols` of its first symbol. Up to 48 symbols a linear scan, beyond HF's
// own heap algorithm (stale entries skipped; the same merges in O(n log n)).
void MergeByRank(const MergeMap& merges, absl::Span<const uint32_t> symbols, std::vector<uint32_t>* out,
                 std::vector<uint32_t>* first = nullptr);

// The calling thread's cache of `Value` per piece for one owner (a model instance, NextCacheOwner)
// at a time: another owner's call empties it. At most kMaxEntries pieces (then emptied).
template <typename Value>
class PieceCache {
 public:
  static constexpr size_t kMaxEntries = 1 << 16;
  static absl::flat_hash_map<std::string, Value>& For(uint64_t owner) {
    thread_local PieceCache cache;
    if (cache.owner_ != owner || cache.map_.size() >= kMaxEntries) {
      cache.map_.clear();
      cache.owner_ = owner;
    }
    return cache.map_;
  }

 private:
  uint64_t owner_ = 0;
  absl::flat_hash_map<std::string, Value> map_;
};

// A process-wide unique owner id for PieceCache (never 0).
inline uint64_t NextCacheOwner() {
  static std::atomic<uint64_t> next{1};
  return next.fetch_add(1);
}

}  // namespace slidedp::tok
