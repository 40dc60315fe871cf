// SentencePiece-style BPE (sentencepiece_bpe.h): load, normalize with offsets, pre-tokenize,
// character BPE with byte fallback, decode; each step as HF tokenizers 0.23 implements it
// (normalizers/{prepend,replace}.rs, pre_tokenizers/{metaspace,split}.rs, models/bpe/model.rs
// merge_word, decoders/*.rs, processors/template.rs).
#include "common/tokenizer/sentencepiece_bpe.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "common/tokenizer/onig_to_pcre2.h"
#include "common/tokenizer/tokenizer.h"

namespace slidedp::tok {
namespace {

using json = nlohmann::json;
constexpr uint32_t kNoId = UINT32_MAX;
constexpr char kReplacementCharacter[] = "\xEF\xBF\xBD";  // U+FFFD

std::string TypeOf(const json& c) {
  return c.is_object() && c.contains("type") && c["type"].is_string() ? c["type"].get<std::string>() : std::string();
}

absl::Status Refuse(absl::string_view what, const json& c, absl::string_view supported) {
  return absl::UnimplementedError(absl::StrCat(what, " ", c.dump().substr(0, 200),
                                               " is not supported (SentencePiece-style tokenizers: ", supported, ")"));
}

// The steps of a component that may be a Sequence (nested ones flattened, as HF runs them).
void Flatten(const json& c, const char* list_key, std::vector<json>* steps) {
  if (TypeOf(c) == "Sequence" && c.contains(list_key) && c[list_key].is_array()) {
    for (const json& s : c[list_key]) Flatten(s, list_key, steps);
  } else {
    steps->push_back(c);
  }
}

// A {"String": "..."} pattern (non-empty); a Regex one is refused.
absl::StatusOr<std::string> StringPattern(const json& c, absl::string_view what) {
  const json& p = c.at("pattern");
  if (!p.is_object() || !p.contains("String") || !p["String"].is_string() || p["String"].get<std::string>().empty()) {
    return Refuse(what, c, "a non-empty String pattern");
  }
  return p["String"].get<std::string>();
}

// A field HF reads as one `char` (Metaspace's replacement, Strip's content). nlohmann's parser
// has already checked the UTF-8.
absl::StatusOr<std::string> OneCharacter(const json& v, absl::string_view what) {
  if (v.is_string() && !v.get_ref<const std::string&>().empty()) {
    const std::string& s = v.get_ref<const std::string&>();
    size_t i = 0;
    NextCodepoint(s, i);
    if (i == s.size()) return s;
  }
  return absl::InvalidArgumentError(absl::StrCat(what, ": ", v.dump().substr(0, 40), " is not one character"));
}

// HF's SplitDelimiterBehavior.
enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

absl::StatusOr<Behavior> ReadBehavior(const json& c) {
  const std::string b = c.at("behavior").get<std::string>();
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  return absl::InvalidArgumentError(absl::StrCat("Split behavior \"", b, "\""));
}

enum class PrependScheme { kFirst, kAlways, kNever };

// Metaspace's fields, read as HF's deserializer does: prepend_scheme defaults to "always"; the
// legacy add_prefix_space=false means "never" and contradicts any other scheme; split defaults to true.
struct MetaspaceOptions {
  std::string replacement;
  PrependScheme prepend = PrependScheme::kAlways;
  bool split = true;
};
absl::StatusOr<MetaspaceOptions> ReadMetaspace(const json& c) {
  MetaspaceOptions m;
  ASSIGN_OR_RETURN(m.replacement, OneCharacter(c.at("replacement"), "Metaspace replacement"));
  if (c.contains("prepend_scheme")) {
    const std::string s = c["prepend_scheme"].get<std::string>();
    if (s == "first") {
      m.prepend = PrependScheme::kFirst;
    } else if (s == "never") {
      m.prepend = PrependScheme::kNever;
    } else if (s != "always") {
      return absl::InvalidArgumentError(absl::StrCat("Metaspace prepend_scheme \"", s, "\""));
    }
  }
  if (c.contains("add_prefix_space") && c["add_prefix_space"].is_boolean() && !c["add_prefix_space"].get<bool>()) {
    if (m.prepend != PrependScheme::kNever) {
      return absl::InvalidArgumentError("Metaspace add_prefix_space does not match declared prepend_scheme");
    }
  }
  if (c.contains("split") && c["split"].is_boolean()) m.split = c["split"].get<bool>();
  return m;
}

// A <0xNN> token (as HF's byte fallback names them: two upper-case hex digits) -> its byte, or -1.
int ByteOfToken(absl::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1; };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// The byte HF's ByteFallback decoder reads from a token (Rust's u8::from_str_radix on the two
// characters after "<0x": either case, and a leading '+' sign is accepted), or -1.
int ByteOfDecodedToken(absl::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t[3] == '+') return hex(t[4]);
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// Non-overlapping leftmost occurrences of `pattern` in `text` as the (begin, end, is_match) ranges
// covering it, HF's Pattern::find_matches.
struct Range {
  size_t begin, end;
  bool match;
};
std::vector<Range> FindLiteral(absl::string_view text, absl::string_view pattern) {
  std::vector<Range> out;
  if (text.empty()) return out;
  size_t prev = 0;
  for (size_t at = text.find(pattern); at != absl::string_view::npos; at = text.find(pattern, at + pattern.size())) {
    if (at > prev) out.push_back({prev, at, false});
    out.push_back({at, at + pattern.size(), true});
    prev = at + pattern.size();
  }
  if (prev < text.size()) out.push_back({prev, text.size(), false});
  return out;
}

// `text` with every occurrence of `pattern` replaced by `content` (the Replace decoder).
std::string ReplaceAll(const std::string& text, const std::string& pattern, const std::string& content) {
  std::string out;
  for (const Range& r : FindLiteral(text, pattern)) {
    if (r.match) {
      out += content;
    } else {
      out.append(text, r.begin, r.end - r.begin);
    }
  }
  return out;
}

// HF's Strip decoder on one token: up to `start` leading and `stop` trailing characters equal to
// `content` removed. (Where HF's slice bounds would cross, it panics; here the token empties.)
std::string StripToken(const std::string& token, const std::string& content, size_t start, size_t stop) {
  std::vector<size_t> at;  // first byte of each character
  for (size_t i = 0; i < token.size();) {
    at.push_back(i);
    NextCodepoint(token, i);
  }
  const size_t n = at.size();
  auto is_content = [&](size_t k) {
    const size_t end = k + 1 < n ? at[k + 1] : token.size();
    return token.compare(at[k], end - at[k], content) == 0;
  };
  size_t start_cut = 0, stop_cut = n;
  for (size_t k = 0; k < std::min(start, n) && is_content(k); ++k) start_cut = k + 1;
  for (size_t k = 0; k < std::min(stop, n) && is_content(n - k - 1); ++k) stop_cut = n - k - 1;
  if (stop_cut <= start_cut) return std::string();
  const size_t begin = at[start_cut], end = stop_cut < n ? at[stop_cut] : token.size();
  return token.substr(begin, end - begin);
}

// NormalizedString::split's grouping of the ranges into pieces.
std::vector<Range> GroupRanges(std::vector<Range> ranges, Behavior behavior) {
  std::vector<Range> out;
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kIsolated:
      return ranges;
    case Behavior::kRemoved:
      for (const Range& r : ranges) {
        if (!r.match) out.push_back(r);
      }
      return out;
    case Behavior::kContiguous:
      for (const Range& r : ranges) {
        if (r.match == previous_match && !out.empty()) {
          out.back().end = r.end;
        } else {
          out.push_back(r);
        }
        previous_match = r.match;
      }
      return out;
    case Behavior::kMergedWithPrevious:
      for (const Range& r : ranges) {
        if (r.match && !previous_match && !out.empty()) {
          out.back().end = r.end;
        } else {
          out.push_back(r);
        }
        previous_match = r.match;
      }
      return out;
    case Behavior::kMergedWithNext:
      for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
        if (it->match && !previous_match && !out.empty()) {
          out.back().begin = it->begin;
        } else {
          out.push_back(*it);
        }
        previous_match = it->match;
      }
      std::reverse(out.begin(), out.end());
      return out;
  }
  return out;
}

}  // namespace

// Text with, for each byte, the offset in the whole text of the character it comes from.
struct SentencePieceBpe::Aligned {
  std::string text;
  std::vector<uint32_t> orig;

  Aligned Slice(size_t begin, size_t end) const {
    return {text.substr(begin, end - begin), std::vector<uint32_t>(orig.begin() + begin, orig.begin() + end)};
  }
  void Prepend(const std::string& s) {
    if (text.empty()) return;
    text.insert(0, s);
    orig.insert(orig.begin(), s.size(), orig[0]);
  }
  // Every occurrence of `pattern` becomes `content`, aligned with the occurrence's first byte.
  void Replace(const std::string& pattern, const std::string& content) {
    if (text.find(pattern) == std::string::npos) return;
    Aligned out;
    out.text.reserve(text.size() + text.size() / 2);
    out.orig.reserve(text.size() + text.size() / 2);
    for (const Range& r : FindLiteral(text, pattern)) {
      if (r.match) {
        out.text += content;
        out.orig.insert(out.orig.end(), content.size(), orig[r.begin]);
      } else {
        out.text.append(text, r.begin, r.end - r.begin);
        out.orig.insert(out.orig.end(), orig.begin() + r.begin, orig.begin() + r.end);
      }
    }
    *this = std::move(out);
  }
};

struct SentencePieceBpe::Normalizer {
  enum class Kind { kPrepend, kReplace } kind;
  std::string pattern;  // Replace's
  std::string content;  // what Prepend prepends / Replace puts in
};

struct SentencePieceBpe::PreTokenizer {
  enum class Kind { kMetaspace, kSplit } kind;
  MetaspaceOptions metaspace;
  std::string pattern;  // Split's
  Behavior behavior = Behavior::kIsolated;
  bool invert = false;
};

struct SentencePieceBpe::Decoder {
  enum class Kind { kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string pattern, content;  // Replace's; Strip's content
  size_t start = 0, stop = 0;    // Strip's
  MetaspaceOptions metaspace;
};

SentencePieceBpe::SentencePieceBpe() { std::fill(std::begin(byte_id_), std::end(byte_id_), kNoId); }
SentencePieceBpe::~SentencePieceBpe() = default;

bool IsSentencePieceStyle(const json& j) {
  if (!j.contains("pre_tokenizer")) return true;
  std::vector<json> steps;
  Flatten(j["pre_tokenizer"], "pretokenizers", &steps);
  return std::none_of(steps.begin(), steps.end(), [](const json& s) { return TypeOf(s) == "ByteLevel"; });
}

absl::StatusOr<SpecialTokenTemplate> ReadPostProcessor(const json& post_processor) try {
  SpecialTokenTemplate t;
  std::vector<json> steps;
  Flatten(post_processor, "processors", &steps);
  for (const json& p : steps) {
    const std::string type = TypeOf(p);
    if (p.is_null() || type == "ByteLevel") continue;  // ByteLevel only trims offsets
    if (type != "TemplateProcessing") {
      return absl::UnimplementedError(absl::StrCat("post_processor ", p.dump().substr(0, 200),
                                                   " (supported: TemplateProcessing, ByteLevel, a Sequence of them)"));
    }
    SpecialTokenTemplate one;
    bool sequence_seen = false;
    for (const json& item : p.at("single")) {
      if (item.contains("Sequence")) {
        if (sequence_seen || item["Sequence"].at("id").get<std::string>() != "A") {
          return absl::UnimplementedError("TemplateProcessing single template with other than one sequence A");
        }
        sequence_seen = true;
        continue;
      }
      const std::string name = item.at("SpecialToken").at("id").get<std::string>();
      if (!p.at("special_tokens").contains(name)) {
        return absl::InvalidArgumentError(absl::StrCat("TemplateProcessing: special token \"", name, "\" is not defined"));
      }
      std::vector<uint32_t>& side = sequence_seen ? one.after : one.before;
      for (const json& id : p["special_tokens"][name].at("ids")) {
        if (!id.is_number_unsigned() || id.get<uint64_t>() >= (uint64_t{1} << 31)) {
          return absl::InvalidArgumentError(absl::StrCat("TemplateProcessing: id of \"", name, "\" is not in [0, 2^31)"));
        }
        side.push_back(id.get<uint32_t>());
      }
    }
    if (!sequence_seen) return absl::UnimplementedError("TemplateProcessing single template without sequence A");
    // A later processor wraps what the earlier ones produced.
    one.before.insert(one.before.end(), t.before.begin(), t.before.end());
    one.after.insert(one.after.begin(), t.after.begin(), t.after.end());
    t = std::move(one);
  }
  return t;
} catch (const json::exception& e) {
  return absl::InvalidArgumentError(absl::StrCat("post_processor: ", e.what()));
}

absl::StatusOr<std::unique_ptr<SentencePieceBpe>> SentencePieceBpe::FromJson(
    const json& j, const absl::flat_hash_map<std::string, uint32_t>& vocab, MergeMap merges) {
  std::unique_ptr<SentencePieceBpe> sp(new SentencePieceBpe());
  const json& model = j.at("model");
  if (model.value("type", std::string("BPE")) != "BPE") {
    return Refuse("model type", model.value("type", std::string()), "BPE");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0) {
    return absl::UnimplementedError("BPE dropout is not supported");
  }
  for (const char* affix : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    if (model.contains(affix) && !model[affix].is_null() && !model[affix].get<std::string>().empty()) {
      return absl::UnimplementedError(absl::StrCat("BPE ", affix, " is not supported"));
    }
  }
  auto flag = [&](const char* key) { return model.contains(key) && model[key].is_boolean() && model[key].get<bool>(); };
  sp->byte_fallback_ = flag("byte_fallback");
  sp->fuse_unk_ = flag("fuse_unk");
  sp->ignore_merges_ = flag("ignore_merges");
  for (const char* part : {"truncation", "padding"}) {
    if (j.contains(part) && !j[part].is_null()) return Refuse(part, j[part], "null");
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const json& a : j["added_tokens"]) {
      if (a.value("normalized", false)) {
        return absl::UnimplementedError(absl::StrCat("added token \"", a.value("content", std::string()),
                                                     "\" has normalized=true (HF matches it in the normalized text), "
                                                     "which SentencePiece-style tokenizers do not support here"));
      }
    }
  }

  uint32_t max_id = 0;
  for (const auto& [text, id] : vocab) {
    max_id = std::max(max_id, id);
    size_t i = 0;
    const uint32_t cp = NextCodepoint(text, i);
    if (i == text.size()) sp->char_id_[cp] = id;
    const int byte = ByteOfToken(text);
    if (byte >= 0) sp->byte_id_[byte] = id;
  }
  sp->id_text_.assign(vocab.empty() ? 0 : size_t{max_id} + 1, std::string());
  sp->has_text_.assign(sp->id_text_.size(), 0);
  for (const auto& [text, id] : vocab) {
    sp->id_text_[id] = text;
    sp->has_text_[id] = 1;
  }
  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    const std::string unk = model["unk_token"].get<std::string>();
    auto it = vocab.find(unk);
    const bool every_byte = sp->byte_fallback_ && std::none_of(std::begin(sp->byte_id_), std::end(sp->byte_id_),
                                                               [](uint32_t id) { return id == kNoId; });
    if (it == vocab.end() && !every_byte) {
      return absl::InvalidArgumentError(absl::StrCat("BPE unk_token \"", unk, "\" is not in the vocabulary"));
    }
    sp->has_unk_ = it != vocab.end();
    if (sp->has_unk_) sp->unk_id_ = it->second;
  }
  if (sp->ignore_merges_) sp->vocab_ = vocab;
  sp->merges_ = std::move(merges);

  std::vector<json> steps;
  if (j.contains("normalizer")) Flatten(j["normalizer"], "normalizers", &steps);
  for (const json& n : steps) {
    const std::string type = TypeOf(n);
    if (n.is_null()) continue;
    if (type == "Prepend") {
      sp->normalizers_.push_back({Normalizer::Kind::kPrepend, "", n.at("prepend").get<std::string>()});
    } else if (type == "Replace") {
      ASSIGN_OR_RETURN(std::string pattern, StringPattern(n, "normalizer Replace"));
      sp->normalizers_.push_back({Normalizer::Kind::kReplace, std::move(pattern), n.at("content").get<std::string>()});
    } else {
      return Refuse("normalizer", n, "Prepend, Replace with a String pattern, a Sequence of them");
    }
  }
  steps.clear();
  if (j.contains("pre_tokenizer")) Flatten(j["pre_tokenizer"], "pretokenizers", &steps);
  for (const json& p : steps) {
    const std::string type = TypeOf(p);
    if (p.is_null()) continue;
    PreTokenizer pt;
    if (type == "Metaspace") {
      pt.kind = PreTokenizer::Kind::kMetaspace;
      ASSIGN_OR_RETURN(pt.metaspace, ReadMetaspace(p));
    } else if (type == "Split") {
      pt.kind = PreTokenizer::Kind::kSplit;
      ASSIGN_OR_RETURN(pt.pattern, StringPattern(p, "pre-tokenizer Split"));
      ASSIGN_OR_RETURN(pt.behavior, ReadBehavior(p));
      pt.invert = p.at("invert").get<bool>();
    } else {
      return Refuse("pre-tokenizer", p, "Metaspace, Split with a String pattern, a Sequence of them");
    }
    sp->pre_tokenizers_.push_back(std::move(pt));
  }
  steps.clear();
  sp->has_decoder_ = j.contains("decoder") && !j["decoder"].is_null();
  if (sp->has_decoder_) Flatten(j["decoder"], "decoders", &steps);
  for (const json& d : steps) {
    const std::string type = TypeOf(d);
    Decoder dec;
    if (type == "Replace") {
      dec.kind = Decoder::Kind::kReplace;
      ASSIGN_OR_RETURN(dec.pattern, StringPattern(d, "decoder Replace"));
      dec.content = d.at("content").get<std::string>();
    } else if (type == "ByteFallback") {
      dec.kind = Decoder::Kind::kByteFallback;
    } else if (type == "Fuse") {
      dec.kind = Decoder::Kind::kFuse;
    } else if (type == "Strip") {
      dec.kind = Decoder::Kind::kStrip;
      ASSIGN_OR_RETURN(dec.content, OneCharacter(d.at("content"), "decoder Strip content"));
      dec.start = d.at("start").get<size_t>();
      dec.stop = d.at("stop").get<size_t>();
    } else if (type == "Metaspace") {
      dec.kind = Decoder::Kind::kMetaspace;
      ASSIGN_OR_RETURN(dec.metaspace, ReadMetaspace(d));
    } else {
      return Refuse("decoder", d, "Replace with a String pattern, ByteFallback, Fuse, Strip, Metaspace, a Sequence");
    }
    sp->decoders_.push_back(std::move(dec));
  }
  if (j.contains("post_processor")) RETURN_IF_ERROR(ReadPostProcessor(j["post_processor"]).status());
  return sp;
}

std::string SentencePieceBpe::EntryText(const std::string& entry) const {
  const int byte = byte_fallback_ ? ByteOfToken(entry) : -1;
  return byte >= 0 ? std::string(1, static_cast<char>(byte)) : entry;
}

const std::string* SentencePieceBpe::TokenText(uint32_t id) const {
  return id < id_text_.size() && has_text_[id] ? &id_text_[id] : nullptr;
}

void SentencePieceBpe::SetTokenText(uint32_t id, std::string text) {
  if (id >= id_text_.size()) {
    id_text_.resize(size_t{id} + 1);
    has_text_.resize(size_t{id} + 1, 0);
  }
  id_text_[id] = std::move(text);
  has_text_[id] = 1;
}

// ---------------------------------------------------------------------------------------------
// Encoding

SentencePieceBpe::Aligned SentencePieceBpe::Normalize(absl::string_view text, uint32_t offset) const {
  Aligned a{std::string(text), std::vector<uint32_t>(text.size())};
  for (size_t i = 0; i < text.size();) {
    const size_t begin = i;
    NextCodepoint(text, i);
    std::fill(a.orig.begin() + begin, a.orig.begin() + std::min(i, text.size()), offset + static_cast<uint32_t>(begin));
  }
  for (const Normalizer& n : normalizers_) {
    if (n.kind == Normalizer::Kind::kPrepend) {
      a.Prepend(n.content);
    } else {
      a.Replace(n.pattern, n.content);
    }
  }
  return a;
}

// The pre-tokenizers in order, each on every piece the previous ones left; empty pieces dropped.
std::vector<SentencePieceBpe::Aligned> SentencePieceBpe::Split(Aligned normalized) const {
  std::vector<Aligned> pieces;
  if (!normalized.text.empty()) pieces.push_back(std::move(normalized));
  for (const PreTokenizer& pt : pre_tokenizers_) {
    std::vector<Aligned> next;
    for (Aligned& piece : pieces) {
      std::vector<Range> ranges;
      Behavior behavior = pt.behavior;
      if (pt.kind == PreTokenizer::Kind::kMetaspace) {
        const MetaspaceOptions& m = pt.metaspace;
        piece.Replace(" ", m.replacement);
        const bool starts_with = piece.text.compare(0, m.replacement.size(), m.replacement) == 0;
        if (!starts_with && (m.prepend == PrependScheme::kAlways ||
                             (m.prepend == PrependScheme::kFirst && !piece.orig.empty() && piece.orig[0] == 0))) {
          piece.Prepend(m.replacement);
        }
        if (!m.split) {
          next.push_back(std::move(piece));
          continue;
        }
        ranges = FindLiteral(piece.text, m.replacement);
        behavior = Behavior::kMergedWithNext;
      } else {
        ranges = FindLiteral(piece.text, pt.pattern);
        if (pt.invert) {
          for (Range& r : ranges) r.match = !r.match;
        }
      }
      for (const Range& r : GroupRanges(std::move(ranges), behavior)) {
        if (r.end > r.begin) next.push_back(piece.Slice(r.begin, r.end));
      }
    }
    pieces = std::move(next);
  }
  return pieces;
}

void SentencePieceBpe::Encode(absl::string_view text, uint32_t offset, std::vector<uint32_t>* ids,
                              std::vector<uint32_t>* starts) const {
  for (const Aligned& piece : Split(Normalize(text, offset))) EncodePiece(piece, ids, starts);
}

std::vector<std::string> SentencePieceBpe::PreTokenize(absl::string_view text) const {
  std::vector<std::string> out;
  for (Aligned& piece : Split(Normalize(text, 0))) out.push_back(std::move(piece.text));
  return out;
}

// The tokens of a piece: their ids and each one's first byte in the piece.
struct SentencePieceBpe::PieceTokens {
  std::vector<uint32_t> ids, at;
};

namespace {
constexpr size_t kCacheMaxPieceBytes = 255;  // HF caches pieces shorter than 256 bytes
}  // namespace

void SentencePieceBpe::EncodePiece(const Aligned& piece, std::vector<uint32_t>* ids,
                                   std::vector<uint32_t>* starts) const {
  PieceTokens computed;
  const PieceTokens* tokens = &computed;
  if (piece.text.size() <= kCacheMaxPieceBytes) {
    auto& cache = PieceCache<PieceTokens>::For(cache_owner_);
    auto it = cache.find(piece.text);
    if (it == cache.end()) it = cache.emplace(piece.text, Tokenize(piece.text)).first;
    tokens = &it->second;
  } else {
    computed = Tokenize(piece.text);
  }
  ids->insert(ids->end(), tokens->ids.begin(), tokens->ids.end());
  if (starts != nullptr) {
    for (uint32_t at : tokens->at) starts->push_back(piece.orig[at]);
  }
}

// HF's BPE::merge_word: one symbol per character (its vocabulary entry), else its bytes' <0xNN>
// tokens when all exist, else unk (consecutive ones fused with fuse_unk; a pending unk is only
// written before the next in-vocabulary character or at the end, so byte tokens that come
// between go first, as in HF); a character with neither is dropped. Then merges by rank.
SentencePieceBpe::PieceTokens SentencePieceBpe::Tokenize(const std::string& s) const {
  PieceTokens out;
  if (ignore_merges_) {
    auto it = vocab_.find(s);
    if (it != vocab_.end()) return {{it->second}, {0}};
  }
  std::vector<uint32_t> symbols, symbol_at;  // ids, and their first byte in `s`
  symbols.reserve(s.size());
  symbol_at.reserve(s.size());
  bool unk_pending = false;
  uint32_t unk_at = 0;
  auto add = [&](uint32_t id, size_t at) {
    symbols.push_back(id);
    symbol_at.push_back(static_cast<uint32_t>(at));
  };
  for (size_t i = 0; i < s.size();) {
    const size_t begin = i;
    const uint32_t cp = NextCodepoint(s, i);
    auto it = char_id_.find(cp);
    if (it != char_id_.end()) {
      if (unk_pending) add(unk_id_, unk_at);
      unk_pending = false;
      add(it->second, begin);
      continue;
    }
    if (byte_fallback_ && std::all_of(s.begin() + begin, s.begin() + i, [&](char b) {
          return byte_id_[static_cast<unsigned char>(b)] != kNoId;
        })) {
      for (size_t k = begin; k < i; ++k) add(byte_id_[static_cast<unsigned char>(s[k])], k);
      continue;
    }
    if (!has_unk_) continue;
    if (unk_pending && !fuse_unk_) add(unk_id_, unk_at);
    if (!unk_pending || !fuse_unk_) unk_at = static_cast<uint32_t>(begin);
    unk_pending = true;
  }
  if (unk_pending) add(unk_id_, unk_at);
  std::vector<uint32_t> first;
  MergeByRank(merges_, symbols, &out.ids, &first);
  out.at.reserve(first.size());
  for (uint32_t f : first) out.at.push_back(symbol_at[f]);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decoding: each decoder maps the list of token strings to another (decode_chain), then the
// results are concatenated.

std::string SentencePieceBpe::Decode(std::vector<std::string> tokens) const {
  if (!has_decoder_) {
    std::string out;
    for (size_t i = 0; i < tokens.size(); ++i) absl::StrAppend(&out, i > 0 ? " " : "", tokens[i]);
    return out;
  }
  for (const Decoder& d : decoders_) {
    std::vector<std::string> next;
    switch (d.kind) {
      case Decoder::Kind::kReplace:
        for (const std::string& t : tokens) next.push_back(ReplaceAll(t, d.pattern, d.content));
        break;
      case Decoder::Kind::kByteFallback: {
        // A run of <0xNN> tokens becomes its bytes if they are valid UTF-8, else one U+FFFD per
        // byte (not per invalid sequence).
        std::string run;
        auto flush = [&] {
          if (run.empty()) return;
          if (Tokenizer::IsValidUtf8(run)) {
            next.push_back(run);
          } else {
            for (size_t k = 0; k < run.size(); ++k) next.push_back(kReplacementCharacter);
          }
          run.clear();
        };
        for (std::string& t : tokens) {
          const int byte = ByteOfDecodedToken(t);
          if (byte >= 0) {
            run.push_back(static_cast<char>(byte));
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        flush();
        break;
      }
      case Decoder::Kind::kFuse: {
        std::string all;
        for (const std::string& t : tokens) all += t;
        next.push_back(std::move(all));
        break;
      }
      case Decoder::Kind::kStrip:
        for (const std::string& t : tokens) next.push_back(StripToken(t, d.content, d.start, d.stop));
        break;
      case Decoder::Kind::kMetaspace:
        for (size_t i = 0; i < tokens.size(); ++i) {
          // HF drops every replacement character of the first token unless prepend_scheme is never.
          const bool drop = i == 0 && d.metaspace.prepend != PrependScheme::kNever;
          next.push_back(ReplaceAll(tokens[i], d.metaspace.replacement, drop ? "" : " "));
        }
        break;
    }
    tokens = std::move(next);
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

}  // namespace slidedp::tok
