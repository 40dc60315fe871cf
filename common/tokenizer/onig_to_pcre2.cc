// OnigToPcre2 and HF's character classes (onig_to_pcre2.h).
#include "common/tokenizer/onig_to_pcre2.h"

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/status/status_macros.h"

namespace slidedp::tok {
namespace {
// HF compiles the split regex with Oniguruma, whose \s is the Unicode White_Space property.
// PCRE2 10.42 with UCP also counts U+180E (MONGOLIAN VOWEL SEPARATOR, no longer a space since
// Unicode 6.3) as \s, which changed ids on text containing it (found by the fuzz corpus in
// tools/tokenizer/compare_and_bench.py). So \s and \S are spelled out as the White_Space set.
constexpr char kWhiteSpaceSet[] =
    R"(\t\n\x{0B}\f\r\x{20}\x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000})";

// HF's Oniguruma (tokenizers 0.23.2) classifies by Unicode 16.0, PCRE2 10.42 by Unicode 14.0:
// letters, marks and digits of scripts added since (Garay, Todhri, Kawi, Kirat Rai, ...) were
// split differently. These are the code points HF's \p{L} / \p{M} / \p{N} match and PCRE2
// 10.42's do not (HF's sets probed per code point through its npm package; none the other way
// round). The loader adds them to each class, harmless where PCRE2 already knows them (its Unicode
// version is checked at load). Found by tools/tokenizer/npm_tokenizers_check.mjs --sweep.
struct CodePointRange {
  uint32_t lo, hi;
};
constexpr CodePointRange kUnicode16Letters[] = {
    {0x1C89, 0x1C8A},   {0xA7CB, 0xA7CD},   {0xA7DA, 0xA7DC},   {0x105C0, 0x105F3}, {0x10D4A, 0x10D65},
    {0x10D6F, 0x10D85}, {0x10EC2, 0x10EC4}, {0x1123F, 0x11240}, {0x11380, 0x11389}, {0x1138B, 0x1138B},
    {0x1138E, 0x1138E}, {0x11390, 0x113B5}, {0x113B7, 0x113B7}, {0x113D1, 0x113D1}, {0x113D3, 0x113D3},
    {0x11BC0, 0x11BE0}, {0x11F02, 0x11F02}, {0x11F04, 0x11F10}, {0x11F12, 0x11F33}, {0x1342F, 0x1342F},
    {0x13441, 0x13446}, {0x13460, 0x143FA}, {0x16100, 0x1611D}, {0x16D40, 0x16D6C}, {0x18CFF, 0x18CFF},
    {0x1B132, 0x1B132}, {0x1B155, 0x1B155}, {0x1DF25, 0x1DF2A}, {0x1E030, 0x1E06D}, {0x1E4D0, 0x1E4EB},
    {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0}, {0x2B739, 0x2B739}, {0x2EBF0, 0x2EE5D}, {0x31350, 0x323AF},
};
constexpr CodePointRange kUnicode16Marks[] = {
    {0x897, 0x897},     {0xCF3, 0xCF3},     {0xECE, 0xECE},     {0x10D69, 0x10D6D}, {0x10EFC, 0x10EFF},
    {0x11241, 0x11241}, {0x113B8, 0x113C0}, {0x113C2, 0x113C2}, {0x113C5, 0x113C5}, {0x113C7, 0x113CA},
    {0x113CC, 0x113D0}, {0x113D2, 0x113D2}, {0x113E1, 0x113E2}, {0x11F00, 0x11F01}, {0x11F03, 0x11F03},
    {0x11F34, 0x11F3A}, {0x11F3E, 0x11F42}, {0x11F5A, 0x11F5A}, {0x13440, 0x13440}, {0x13447, 0x13455},
    {0x1611E, 0x1612F}, {0x1E08F, 0x1E08F}, {0x1E4EC, 0x1E4EF}, {0x1E5EE, 0x1E5EF},
};
constexpr CodePointRange kUnicode16Digits[] = {
    {0x10D40, 0x10D49}, {0x116D0, 0x116E3}, {0x11BF0, 0x11BF9}, {0x11F50, 0x11F59}, {0x16130, 0x16139},
    {0x16D70, 0x16D79}, {0x1CCF0, 0x1CCF9}, {0x1D2C0, 0x1D2D3}, {0x1E4F0, 0x1E4F9}, {0x1E5F1, 0x1E5FA},
};

// The letters above by general category (o200k's split regex, GPT-OSS's, names Lu, Ll, Lm, Lo and
// Lt; Unicode 15-16 added no Lt), as HF's \p{..} classifies them (probed the same way).
constexpr CodePointRange kUnicode16Upper[] = {
    {0x1C89, 0x1C89}, {0xA7CB, 0xA7CC}, {0xA7DA, 0xA7DA}, {0xA7DC, 0xA7DC}, {0x10D50, 0x10D65},
};
constexpr CodePointRange kUnicode16Lower[] = {
    {0x1C8A, 0x1C8A}, {0xA7CD, 0xA7CD}, {0xA7DB, 0xA7DB}, {0x10D70, 0x10D85}, {0x1DF25, 0x1DF2A},
};
constexpr CodePointRange kUnicode16Modifier[] = {
    {0x10D4E, 0x10D4E}, {0x10D6F, 0x10D6F}, {0x16D40, 0x16D42}, {0x16D6B, 0x16D6C}, {0x1E030, 0x1E06D},
    {0x1E4EB, 0x1E4EB},
};
constexpr CodePointRange kUnicode16Other[] = {
    {0x105C0, 0x105F3}, {0x10D4A, 0x10D4D}, {0x10D4F, 0x10D4F}, {0x10EC2, 0x10EC4}, {0x1123F, 0x11240},
    {0x11380, 0x11389}, {0x1138B, 0x1138B}, {0x1138E, 0x1138E}, {0x11390, 0x113B5}, {0x113B7, 0x113B7},
    {0x113D1, 0x113D1}, {0x113D3, 0x113D3}, {0x11BC0, 0x11BE0}, {0x11F02, 0x11F02}, {0x11F04, 0x11F10},
    {0x11F12, 0x11F33}, {0x1342F, 0x1342F}, {0x13441, 0x13446}, {0x13460, 0x143FA}, {0x16100, 0x1611D},
    {0x16D43, 0x16D6A}, {0x18CFF, 0x18CFF}, {0x1B132, 0x1B132}, {0x1B155, 0x1B155}, {0x1E4D0, 0x1E4EA},
    {0x1E5D0, 0x1E5ED}, {0x1E5F0, 0x1E5F0}, {0x2B739, 0x2B739}, {0x2EBF0, 0x2EE5D}, {0x31350, 0x323AF},
};

// The additions to PCRE2's \p{X} for X in L (and Lu, Ll, Lm, Lo), M, N; empty for other properties.
absl::Span<const CodePointRange> Unicode16Additions(std::string_view property) {
  if (property == "L") return kUnicode16Letters;
  if (property == "Lu") return kUnicode16Upper;
  if (property == "Ll") return kUnicode16Lower;
  if (property == "Lm") return kUnicode16Modifier;
  if (property == "Lo") return kUnicode16Other;
  if (property == "M") return kUnicode16Marks;
  if (property == "N") return kUnicode16Digits;
  return {};
}

// Ranges as PCRE2 class items: "\x{1C89}-\x{1C8A}\x{A7CB}-...".
std::string ClassItems(absl::Span<const CodePointRange> ranges) {
  std::string out;
  char item[32];
  for (const CodePointRange& r : ranges) {
    if (r.lo == r.hi) {
      std::snprintf(item, sizeof(item), "\\x{%X}", r.lo);
    } else {
      std::snprintf(item, sizeof(item), "\\x{%X}-\\x{%X}", r.lo, r.hi);
    }
    out += item;
  }
  return out;
}

// Whether `text` (valid UTF-8) holds a code point of the additions: only then can the classes with
// and without them match differently. Those of the BMP start with byte E0, E1 or EA in UTF-8 (the
// rest take 4 bytes), so CJK and most other text is skipped byte by byte without decoding.
}  // namespace

bool HasUnicode16Additions(absl::string_view text) {
  static const std::vector<CodePointRange>* all = [] {
    auto* v = new std::vector<CodePointRange>;
    for (auto t :
         {absl::Span<const CodePointRange>(kUnicode16Letters), absl::Span<const CodePointRange>(kUnicode16Marks),
          absl::Span<const CodePointRange>(kUnicode16Digits)}) {
      v->insert(v->end(), t.begin(), t.end());
    }
    std::sort(v->begin(), v->end(), [](CodePointRange a, CodePointRange b) { return a.lo < b.lo; });
    return v;
  }();
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    if (b < 0xE0 || (b > 0xE1 && b != 0xEA && b < 0xF0)) {
      ++i;
      continue;
    }
    const uint32_t cp = NextCodepoint(text, i);
    auto it = std::upper_bound(all->begin(), all->end(), cp, [](uint32_t c, CodePointRange r) { return c < r.lo; });
    if (it != all->begin() && cp <= std::prev(it)->hi) return true;
  }
  return false;
}

// `pattern` in PCRE2's syntax; with Classes::kHf, \p{L} / \p{M} / \p{N} hold the Unicode 16
// additions (HF's classes), with Classes::kPcre2 they are PCRE2's own (faster; the same matches on
// text without those code points).
absl::StatusOr<std::string> OnigToPcre2(const std::string& pattern, Classes classes) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      ++i;
      if ((e == 'p' || e == 'P') && i + 1 < pattern.size() && pattern[i + 1] == '{') {
        const size_t close = pattern.find('}', i + 1);
        const std::string property = close == std::string::npos ? "" : pattern.substr(i + 2, close - i - 2);
        const auto extra = Unicode16Additions(property);
        if (extra.empty() || classes == Classes::kPcre2) {  // PCRE2's own tables
          out.push_back('\\');
          out.push_back(e);
          continue;
        }
        const std::string cls = absl::StrCat("\\p{", property, "}", ClassItems(extra));
        if (in_class && e == 'P') {
          return absl::UnimplementedError(
              absl::StrCat("split regex uses \\P{", property, "} inside a character class"));
        }
        absl::StrAppend(&out, in_class ? cls : absl::StrCat(e == 'P' ? "[^" : "[", cls, "]"));
        i = close;
        continue;
      }
      if (e == 's') {
        absl::StrAppend(&out, in_class ? kWhiteSpaceSet : absl::StrCat("[", kWhiteSpaceSet, "]"));
      } else if (e == 'S') {
        if (in_class) return absl::UnimplementedError("split regex uses \\S inside a character class");
        absl::StrAppend(&out, "[^", kWhiteSpaceSet, "]");
      } else {
        out.push_back('\\');
        out.push_back(e);
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out.push_back(c);
      // A leading '^' and a ']' right after the opening bracket are literal parts of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out.push_back(pattern[++i]);
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out.push_back(pattern[++i]);
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out.push_back(c);
  }
  return out;
}


}  // namespace slidedp::tok
