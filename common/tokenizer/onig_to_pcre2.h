// The pre-tokenizer's split pattern from HF's (Oniguruma) syntax into PCRE2's, with HF's character
// classes: its White_Space \s, and \p{L} / \p{M} / \p{N} at HF's Unicode version (tokenizer.cc
// compiles both forms and picks per text: HasUnicode16Additions).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp::tok {

// Decodes one UTF-8 code point of valid text; advances i.
inline uint32_t NextCodepoint(absl::string_view s, size_t& i) {
  const auto c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) {
    ++i;
    return c;
  }
  int len = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : 2;
  uint32_t cp = c & (0x3F >> (len - 1));
  for (int k = 1; k < len && i + k < s.size(); ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
  i += len;
  return cp;
}


// With Classes::kHf, \p{L} / \p{M} / \p{N} hold the Unicode 16 additions (HF's classes); with
// Classes::kPcre2 they are PCRE2's own (faster; the same matches on text without those code points).
enum class Classes { kHf, kPcre2 };
absl::StatusOr<std::string> OnigToPcre2(const std::string& pattern, Classes classes);
// Whether `text` (valid UTF-8) holds a code point of the additions.
bool HasUnicode16Additions(absl::string_view text);

}  // namespace slidedp::tok
