// tokenizer.json's added tokens (<|im_start|>, <s>, Gemma 3's 6,415 newline / tab / ▁ runs, HTML
// tags and <unusedN>, ...) and their matching in raw text before any other step, as HF's
// AddedVocabulary does for tokens with normalized=false: leftmost, then longest.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/string_view.h"

namespace slidedp::tok {

struct AddedToken {
  uint32_t id = 0;
  std::string content;
  bool special = false;
};

enum class SkipSpecialMatches { kNo, kYes };

// A byte trie over the tokens' contents: a match at a position walks as many bytes as the
// longest token there (thousands of tokens sharing a first byte cost nothing).
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  explicit AddedTokenMatcher(const std::vector<AddedToken>& tokens);  // non-empty contents

  // Index into `tokens` of the longest token that starts at text[at] (with kYes, the longest
  // that is not special), or -1. Of two tokens with the same content the first counts.
  int LongestAt(absl::string_view text, size_t at, SkipSpecialMatches skip) const;

 private:
  bool can_start_[256] = {};
  absl::flat_hash_map<uint64_t, uint32_t> edges_;  // node << 8 | byte -> node; the root is 0
  std::vector<int32_t> token_at_;                  // per node: the token ending there, or -1
  std::vector<uint8_t> special_;                   // per token
};

}  // namespace slidedp::tok
