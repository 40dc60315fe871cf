// JSON nesting checks on the text; see json_depth.h.
#include "common/io/json_depth.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace slidedp {

int JsonNestingDepth(absl::string_view text, int stop_above) {
  int depth = 0, max_depth = 0;
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      max_depth = std::max(max_depth, ++depth);
      if (max_depth > stop_above) return max_depth;
    } else if (c == '}' || c == ']') {
      if (--depth < 0) return -1;
    }
  }
  return max_depth;
}

absl::Status CheckJsonDepth(absl::string_view text, absl::string_view what, int max_depth) {
  if (JsonNestingDepth(text, max_depth) > max_depth) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": JSON nested deeper than ", max_depth, " levels (refused: no such file needs it)"));
  }
  return absl::OkStatus();
}

}  // namespace slidedp
