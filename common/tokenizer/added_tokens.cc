// Added-token matching (added_tokens.h).
#include "common/tokenizer/added_tokens.h"

namespace slidedp::tok {

AddedTokenMatcher::AddedTokenMatcher(const std::vector<AddedToken>& tokens) : token_at_(1, -1) {
  for (size_t t = 0; t < tokens.size(); ++t) {
    const std::string& s = tokens[t].content;
    special_.push_back(tokens[t].special ? 1 : 0);
    if (s.empty()) continue;
    can_start_[static_cast<unsigned char>(s[0])] = true;
    uint32_t node = 0;
    for (unsigned char b : s) {
      auto [it, inserted] = edges_.try_emplace((uint64_t{node} << 8) | b, static_cast<uint32_t>(token_at_.size()));
      if (inserted) token_at_.push_back(-1);
      node = it->second;
    }
    if (token_at_[node] < 0) token_at_[node] = static_cast<int32_t>(t);
  }
}

int AddedTokenMatcher::LongestAt(absl::string_view text, size_t at, SkipSpecialMatches skip) const {
  if (at >= text.size() || !can_start_[static_cast<unsigned char>(text[at])]) return -1;
  int best = -1;
  uint32_t node = 0;
  for (size_t k = at; k < text.size(); ++k) {
    auto it = edges_.find((uint64_t{node} << 8) | static_cast<unsigned char>(text[k]));
    if (it == edges_.end()) break;
    node = it->second;
    const int32_t t = token_at_[node];
    if (t >= 0 && !(skip == SkipSpecialMatches::kYes && special_[t])) best = t;
  }
  return best;
}

}  // namespace slidedp::tok
