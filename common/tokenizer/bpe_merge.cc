// BPE merging by rank (bpe_merge.h).
#include "common/tokenizer/bpe_merge.h"

#include <queue>

namespace slidedp::tok {
namespace {

constexpr uint32_t kNone = UINT32_MAX;
constexpr size_t kLinearMaxSymbols = 48;

MergeTarget Lookup(const MergeMap& merges, uint32_t a, uint32_t b) {
  auto it = merges.find(MergeKey(a, b));
  return it == merges.end() ? MergeTarget{kNone, 0} : it->second;
}

// Short rows: a linear scan for the lowest-rank pair. kTrackFirst keeps each symbol's first index
// (the byte-level hot path does without).
template <bool kTrackFirst>
void MergeShort(const MergeMap& merges, absl::Span<const uint32_t> symbols, std::vector<uint32_t>* out,
                std::vector<uint32_t>* first) {
  uint32_t sym[kLinearMaxSymbols];
  uint32_t pos[kLinearMaxSymbols];
  MergeTarget pair[kLinearMaxSymbols];
  size_t m = symbols.size();
  for (size_t i = 0; i < m; ++i) {
    sym[i] = symbols[i];
    if (kTrackFirst) pos[i] = static_cast<uint32_t>(i);
  }
  for (size_t i = 0; i + 1 < m; ++i) pair[i] = Lookup(merges, sym[i], sym[i + 1]);
  while (m > 1) {
    size_t best = 0;
    for (size_t i = 1; i + 1 < m; ++i) {
      if (pair[i].rank < pair[best].rank) best = i;
    }
    if (pair[best].rank == kNone) break;
    sym[best] = pair[best].new_id;
    for (size_t i = best + 1; i + 1 < m; ++i) {
      sym[i] = sym[i + 1];
      if (kTrackFirst) pos[i] = pos[i + 1];
    }
    for (size_t i = best + 1; i + 2 < m; ++i) pair[i] = pair[i + 1];
    --m;
    if (best > 0) pair[best - 1] = Lookup(merges, sym[best - 1], sym[best]);
    if (best + 1 < m) pair[best] = Lookup(merges, sym[best], sym[best + 1]);
  }
  out->insert(out->end(), sym, sym + m);
  if (kTrackFirst) first->insert(first->end(), pos, pos + m);
}

// Long rows: HF's algorithm, a min-heap on (rank, position); a merged symbol keeps the position
// of its left part, which is therefore its first symbol's index.
void MergeLong(const MergeMap& merges, absl::Span<const uint32_t> symbols, std::vector<uint32_t>* out,
               std::vector<uint32_t>* first) {
  const size_t n = symbols.size();
  struct Symbol {
    uint32_t id;
    int32_t prev, next;
    bool alive;
  };
  std::vector<Symbol> s(n);
  for (size_t i = 0; i < n; ++i) {
    s[i] = {symbols[i], static_cast<int32_t>(i) - 1, i + 1 < n ? static_cast<int32_t>(i + 1) : -1, true};
  }
  struct Candidate {
    uint32_t rank;
    uint32_t pos;
    uint32_t new_id;
    bool operator>(const Candidate& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  for (size_t i = 0; i + 1 < n; ++i) {
    MergeTarget t = Lookup(merges, s[i].id, s[i + 1].id);
    if (t.rank != kNone) queue.push({t.rank, static_cast<uint32_t>(i), t.new_id});
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& left = s[top.pos];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = s[left.next];
    const MergeTarget now = Lookup(merges, left.id, right.id);
    if (now.rank == kNone || now.new_id != top.new_id) continue;  // stale entry
    left.id = top.new_id;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) s[left.next].prev = static_cast<int32_t>(top.pos);
    if (left.prev >= 0) {
      MergeTarget t = Lookup(merges, s[left.prev].id, left.id);
      if (t.rank != kNone) queue.push({t.rank, static_cast<uint32_t>(left.prev), t.new_id});
    }
    if (left.next >= 0) {
      MergeTarget t = Lookup(merges, left.id, s[left.next].id);
      if (t.rank != kNone) queue.push({t.rank, top.pos, t.new_id});
    }
  }
  for (int32_t i = 0; i >= 0; i = s[i].next) {
    out->push_back(s[i].id);
    if (first != nullptr) first->push_back(static_cast<uint32_t>(i));
  }
}

}  // namespace

void MergeByRank(const MergeMap& merges, absl::Span<const uint32_t> symbols, std::vector<uint32_t>* out,
                 std::vector<uint32_t>* first) {
  if (symbols.empty()) return;
  if (symbols.size() > kLinearMaxSymbols) {
    MergeLong(merges, symbols, out, first);
  } else if (first != nullptr) {
    MergeShort<true>(merges, symbols, out, first);
  } else {
    MergeShort<false>(merges, symbols, out, nullptr);
  }
}

}  // namespace slidedp::tok
