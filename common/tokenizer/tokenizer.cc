// BPE matching HF tokenizers: load, encode (added tokens, NFC, regex split, BPE), decode; the
// SentencePiece-style models' own steps are in sentencepiece_bpe.cc.
#define PCRE2_CODE_UNIT_WIDTH 8
#include "common/tokenizer/tokenizer.h"
#include "common/tokenizer/onig_to_pcre2.h"
#include "common/tokenizer/sentencepiece_bpe.h"
#include "common/io/json_depth.h"

#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/stringpiece.h>
#include <unicode/uniset.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"

namespace slidedp::tok {
namespace {

using json = nlohmann::json;

// GPT-2's bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
// U+0100.. in byte order. Vocabulary strings are written in this alphabet.
std::vector<int> ByteToCodepoint() {
  std::vector<int> map(256, -1);
  auto keep = [](int b) { return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF); };
  int n = 0;
  for (int b = 0; b < 256; ++b) map[b] = keep(b) ? b : 256 + n++;
  return map;
}


// Length of the valid UTF-8 sequence at s[i], or 0 with *bad = bytes forming the maximal invalid
// subpart (at least 1), following the Unicode "maximal subpart" practice.
size_t Utf8SequenceAt(absl::string_view s, size_t i, size_t* bad) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (int k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      *bad = k;
      return 0;
    }
    const auto b = static_cast<unsigned char>(s[i + k]);
    const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
    if (b < l || b > h) {
      *bad = k;
      return 0;
    }
  }
  return need + 1;
}

bool IsAscii(absl::string_view s) {
  const char* p = s.data();
  size_t n = s.size(), i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w & 0x8080808080808080ull) return false;
  }
  for (; i < n; ++i) {
    if (static_cast<unsigned char>(p[i]) & 0x80) return false;
  }
  return true;
}

// The pre-tokenizer pattern ByteLevel uses when its use_regex is true (GPT-2).
constexpr char kGpt2Pattern[] = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

// ---------------------------------------------------------------------------------------------
// PCRE2 regex with per-thread match data and JIT stack.

struct Tokenizer::Regex {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Regex() {
    if (code != nullptr) pcre2_code_free(code);
  }
  // `pattern` (PCRE2 syntax) compiled with UTF + UCP, JIT-compiled where PCRE2 can.
  static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& pattern);
};

absl::StatusOr<std::unique_ptr<Tokenizer::Regex>> Tokenizer::Regex::Compile(const std::string& pattern) {
  // The Unicode 16 additions (kUnicode16Letters, ...) make PCRE2 with Unicode 14 to 16 classify as
  // HF does; an older PCRE2 lacks more, a newer one knows code points HF does not.
  char version[32] = {};
  pcre2_config(PCRE2_CONFIG_UNICODE_VERSION, version);
  const int major = std::atoi(version);
  if (major < 14 || major > 16) {
    return absl::UnimplementedError(absl::StrCat(
        "PCRE2's Unicode version is ", version, "; the tokenizer matches HF's classes with PCRE2 of Unicode 14 to 16"));
  }
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  auto regex = std::make_unique<Regex>();
  regex->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(), PCRE2_UTF | PCRE2_UCP, &err,
                              &err_offset, nullptr);
  if (regex->code == nullptr) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof(msg));
    return absl::InvalidArgumentError(
        absl::StrCat("split regex does not compile at offset ", err_offset, ": ", reinterpret_cast<const char*>(msg)));
  }
  regex->jit = pcre2_jit_compile(regex->code, PCRE2_JIT_COMPLETE) == 0;
  if (!regex->jit) LOG(WARNING) << "PCRE2 JIT unavailable; the tokenizer regex runs interpreted (slower)";
  return regex;
}

namespace {
struct ThreadMatchState {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* mctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ThreadMatchState() {
    md = pcre2_match_data_create(1, nullptr);
    mctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
    pcre2_jit_stack_assign(mctx, nullptr, stack);
  }
  ~ThreadMatchState() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(mctx);
    pcre2_jit_stack_free(stack);
  }
};
ThreadMatchState& MatchState() {
  thread_local ThreadMatchState state;
  return state;
}
}  // namespace

namespace {
constexpr size_t kCacheMaxWordBytes = 64;
}  // namespace

Tokenizer::Tokenizer() : instance_id_(NextCacheOwner()) {}
Tokenizer::~Tokenizer() = default;

// ---------------------------------------------------------------------------------------------
// Loading

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open tokenizer file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  auto t = FromJson(ss.str());
  if (!t.ok()) return Annotate(t.status(), path);
  return t;
}

namespace {
// A token id from tokenizer.json: an integer in [0, 2^31) (a negative one would wrap in uint32,
// a huge one would size the id tables past memory).
absl::StatusOr<uint32_t> JsonTokenId(const json& v, absl::string_view what) {
  if (v.is_number_unsigned() && v.get<uint64_t>() < (uint64_t{1} << 31)) {
    return static_cast<uint32_t>(v.get<uint64_t>());
  }
  if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < (int64_t{1} << 31)) {
    return static_cast<uint32_t>(v.get<int64_t>());
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": id ", v.dump().substr(0, 40), " is not an integer in [0, 2^31)"));
}

// The parts of tokenizer.json FromJson reads; each throws json::exception on a missing key or a
// value of the wrong type, which FromJson reports.

// The model of a tokenizer with a ByteLevel pre-tokenizer must be a BPE without byte_fallback or dropout.
absl::Status CheckByteLevelModel(const json& model) {
  if (model.value("type", std::string("BPE")) != "BPE") {
    return absl::UnimplementedError(absl::StrCat("tokenizer model type ", model.value("type", std::string()),
                                                 " (only byte-level BPE is supported)"));
  }
  if (model.contains("byte_fallback") && model["byte_fallback"].is_boolean() && model["byte_fallback"].get<bool>()) {
    return absl::UnimplementedError("BPE byte_fallback with a ByteLevel pre-tokenizer is not supported");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].get<double>() > 0) {
    return absl::UnimplementedError("BPE dropout is not supported");
  }
  return absl::OkStatus();
}

// Vocabulary strings, written in GPT-2's byte-to-unicode alphabet, back to their raw bytes.
class ByteLevelAlphabet {
 public:
  ByteLevelAlphabet() {
    const std::vector<int> b2c = ByteToCodepoint();
    for (int b = 0; b < 256; ++b) c2b_[static_cast<uint32_t>(b2c[b])] = static_cast<uint8_t>(b);
  }
  // False when `s` holds a character outside the alphabet.
  bool ToBytes(const std::string& s, std::string* out) const {
    out->clear();
    size_t i = 0;
    while (i < s.size()) {
      uint32_t cp = NextCodepoint(s, i);
      auto it = c2b_.find(cp);
      if (it == c2b_.end()) return false;
      out->push_back(static_cast<char>(it->second));
    }
    return true;
  }

 private:
  absl::flat_hash_map<uint32_t, uint8_t> c2b_;
};

using VocabEntries = std::vector<std::pair<uint32_t, std::string>>;  // (id, raw bytes)

// The vocabulary into *bytes_to_id; returns its entries, in the file's order. With `alphabet`
// (byte-level) the keys become raw bytes, without (SentencePiece-style) they stay as written.
absl::StatusOr<VocabEntries> ReadVocab(const json& vocab, const ByteLevelAlphabet* alphabet,
                                       absl::flat_hash_map<std::string, uint32_t>* bytes_to_id) {
  std::string bytes;
  bytes_to_id->reserve(vocab.size());
  VocabEntries entries;
  entries.reserve(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    if (alphabet == nullptr) {
      bytes = it.key();
    } else if (!alphabet->ToBytes(it.key(), &bytes)) {
      return absl::UnimplementedError(
          absl::StrCat("vocabulary entry \"", it.key(), "\" is not in the byte-level alphabet (not a byte-level BPE)"));
    }
    ASSIGN_OR_RETURN(const uint32_t id,
                     JsonTokenId(it.value(), absl::StrCat("vocabulary entry \"", it.key().substr(0, 40), "\"")));
    (*bytes_to_id)[bytes] = id;
    entries.emplace_back(id, bytes);
  }
  return entries;
}

// The id of every single byte, which a byte-level vocabulary must hold.
absl::Status ReadByteIds(const absl::flat_hash_map<std::string, uint32_t>& bytes_to_id, uint32_t* byte_id) {
  for (int b = 0; b < 256; ++b) {
    auto it = bytes_to_id.find(std::string(1, static_cast<char>(b)));
    if (it == bytes_to_id.end()) {
      return absl::InvalidArgumentError(absl::StrCat("byte-level vocabulary lacks the single byte ", b));
    }
    byte_id[b] = it->second;
  }
  return absl::OkStatus();
}

// Merges: either ["a", "b"] pairs (tokenizers >= 0.20) or "a b" strings (HF: "#version" lines
// skipped, exactly two parts split at spaces); in rank order. `alphabet` as for ReadVocab.
absl::StatusOr<MergeMap> ReadMerges(const json& merges, const ByteLevelAlphabet* alphabet,
                                    const absl::flat_hash_map<std::string, uint32_t>& bytes_to_id) {
  MergeMap map;
  map.reserve(merges.size());
  std::string left, right;
  uint32_t rank = 0;
  for (const json& m : merges) {
    std::string a, b;
    if (m.is_array()) {
      a = m.at(0).get<std::string>();
      b = m.at(1).get<std::string>();
    } else {
      const std::string s = m.get<std::string>();
      if (absl::StartsWith(s, "#version")) continue;
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        return absl::InvalidArgumentError(absl::StrCat("merge ", rank, " \"", s, "\" is not two tokens"));
      }
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    }
    if (alphabet == nullptr) {
      left = a;
      right = b;
    } else if (!alphabet->ToBytes(a, &left) || !alphabet->ToBytes(b, &right)) {
      return absl::InvalidArgumentError(absl::StrCat("merge ", rank, " is not byte-level"));
    }
    auto la = bytes_to_id.find(left), lb = bytes_to_id.find(right), lm = bytes_to_id.find(left + right);
    if (la == bytes_to_id.end() || lb == bytes_to_id.end() || lm == bytes_to_id.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("merge ", rank, " (\"", a, "\", \"", b, "\") refers to a token missing from the vocabulary"));
    }
    // HF collects the merges into a map: a pair listed twice keeps its later rank.
    map.insert_or_assign(MergeKey(la->second, lb->second), MergeTarget{rank, lm->second});
    ++rank;
  }
  return map;
}

absl::StatusOr<std::vector<AddedToken>> ReadAddedTokens(const json& j) {
  std::vector<AddedToken> added;
  if (!j.contains("added_tokens") || !j["added_tokens"].is_array()) return added;
  for (const json& a : j["added_tokens"]) {
    ASSIGN_OR_RETURN(const uint32_t added_id, JsonTokenId(a.at("id"), "added token"));
    AddedToken at{added_id, a.at("content").get<std::string>(), a.value("special", false)};
    if (a.value("lstrip", false) || a.value("rstrip", false) || a.value("single_word", false)) {
      return absl::UnimplementedError(
          absl::StrCat("added token \"", at.content, "\" uses lstrip/rstrip/single_word, which is not supported"));
    }
    if (at.content.empty()) return absl::InvalidArgumentError("an added token has empty content");
    added.push_back(std::move(at));
  }
  return added;
}

// The tables indexed by id (vocabulary and added tokens).
struct IdTables {
  std::vector<std::string> id_to_bytes;
  std::vector<uint8_t> is_special;
};

absl::StatusOr<IdTables> BuildIdTables(VocabEntries entries, const std::vector<AddedToken>& added) {
  uint32_t max_id = 0;
  for (const auto& [id, bytes] : entries) max_id = std::max(max_id, id);
  for (const AddedToken& a : added) max_id = std::max(max_id, a.id);
  // The id tables are as long as the largest id: ids far past the vocabulary would size them
  // past memory (real tokenizers leave at most a few thousand unused ids).
  const uint64_t bound = uint64_t{entries.size()} + added.size() + (uint64_t{1} << 20);
  if (uint64_t{max_id} >= bound) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", max_id, " is far beyond the ", entries.size(),
                                                   " vocabulary entries and ", added.size(), " added tokens (at most ",
                                                   bound - 1, ")"));
  }
  IdTables t;
  t.id_to_bytes.assign(size_t{max_id} + 1, std::string());
  t.is_special.assign(size_t{max_id} + 1, 0);
  for (auto& [id, b] : entries) t.id_to_bytes[id] = std::move(b);
  for (const AddedToken& a : added) {
    t.id_to_bytes[a.id] = a.content;
    t.is_special[a.id] = a.special ? 1 : 0;
  }
  return t;
}

// The normalizer: none (false) or NFC (true).
absl::StatusOr<bool> ReadNfc(const json& j) {
  const json& norm = j.value("normalizer", json());
  if (norm.is_null()) return false;
  if (norm.value("type", std::string()) == "NFC") return true;
  return absl::UnimplementedError(absl::StrCat("normalizer ", norm.dump(), " (supported: none, NFC)"));
}

// The split regex (Oniguruma syntax, as HF has it) of a pre-tokenizer Sequence[Split(Regex,
// Isolated), ByteLevel(use_regex=false)] or ByteLevel(use_regex=true).
absl::StatusOr<std::string> ReadSplitPattern(const json& pre) {
  std::string pattern;
  std::vector<json> steps;
  if (pre.value("type", std::string()) == "Sequence") {
    for (const json& p : pre.at("pretokenizers")) steps.push_back(p);
  } else {
    steps.push_back(pre);
  }
  bool byte_level = false;
  for (const json& p : steps) {
    const std::string type = p.value("type", std::string());
    if (type == "Split" && pattern.empty() && !byte_level) {
      if (!p.at("pattern").contains("Regex") || p.value("behavior", std::string()) != "Isolated" ||
          p.value("invert", false)) {
        return absl::UnimplementedError(
            absl::StrCat("pre-tokenizer ", p.dump(), " (supported: Split with a Regex, Isolated)"));
      }
      pattern = p["pattern"]["Regex"].get<std::string>();
    } else if (type == "ByteLevel" && !byte_level) {
      byte_level = true;
      if (p.value("add_prefix_space", false)) {
        return absl::UnimplementedError("ByteLevel add_prefix_space=true is not supported");
      }
      if (p.value("use_regex", true)) {
        if (!pattern.empty()) return absl::UnimplementedError("Split followed by ByteLevel(use_regex=true)");
        pattern = kGpt2Pattern;
      }
    } else {
      return absl::UnimplementedError(absl::StrCat("pre-tokenizer step ", p.dump()));
    }
  }
  if (!byte_level || pattern.empty()) {
    return absl::UnimplementedError("pre-tokenizer must end in ByteLevel and define a split regex");
  }
  return pattern;
}
}  // namespace

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromJson(absl::string_view json_text) {
  RETURN_IF_ERROR(CheckJsonDepth(json_text, "tokenizer.json"));
  json j = json::parse(json_text.begin(), json_text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::InvalidArgumentError("tokenizer.json is not a JSON object");
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  try {
    const json& model = j.at("model");
    if (model.value("type", std::string("BPE")) != "BPE") {
      return absl::UnimplementedError(
          absl::StrCat("tokenizer model type ", model.value("type", std::string()), " (only BPE is supported)"));
    }
    // Byte-level vocabularies are written in GPT-2's alphabet; SentencePiece-style ones as text.
    const bool sentencepiece = IsSentencePieceStyle(j);
    const ByteLevelAlphabet alphabet;
    const ByteLevelAlphabet* byte_level = sentencepiece ? nullptr : &alphabet;
    if (byte_level != nullptr) RETURN_IF_ERROR(CheckByteLevelModel(model));
    ASSIGN_OR_RETURN(VocabEntries entries, ReadVocab(model.at("vocab"), byte_level, &t->bytes_to_id_));
    ASSIGN_OR_RETURN(MergeMap merges, ReadMerges(model.at("merges"), byte_level, t->bytes_to_id_));
    if (sentencepiece) {
      ASSIGN_OR_RETURN(t->sp_, SentencePieceBpe::FromJson(j, t->bytes_to_id_, std::move(merges)));
      for (auto& entry : entries) entry.second = t->sp_->EntryText(entry.second);
    } else {
      t->merges_ = std::move(merges);
      t->ignore_merges_ = model.value("ignore_merges", false);
      RETURN_IF_ERROR(ReadByteIds(t->bytes_to_id_, t->byte_id_));
    }
    ASSIGN_OR_RETURN(t->added_, ReadAddedTokens(j));
    ASSIGN_OR_RETURN(IdTables ids, BuildIdTables(std::move(entries), t->added_));
    t->id_to_bytes_ = std::move(ids.id_to_bytes);
    t->is_special_ = std::move(ids.is_special);
    t->added_matcher_ = AddedTokenMatcher(t->added_);
    // Byte-level tokenizers load whatever their post-processor (prepare does not apply it); only
    // AddSpecialTokens reports one it cannot apply. SentencePieceBpe::FromJson refused those.
    auto post = ReadPostProcessor(j.value("post_processor", json()));
    if (post.ok()) {
      t->special_before_ = std::move(post->before);
      t->special_after_ = std::move(post->after);
    } else {
      t->post_processor_status_ = post.status();
    }
    if (sentencepiece) {
      for (const AddedToken& a : t->added_) t->sp_->SetTokenText(a.id, a.content);
      return t;
    }
    ASSIGN_OR_RETURN(t->nfc_, ReadNfc(j));
    ASSIGN_OR_RETURN(const std::string pattern, ReadSplitPattern(j.at("pre_tokenizer")));
    ASSIGN_OR_RETURN(const std::string hf_pattern, OnigToPcre2(pattern, Classes::kHf));
    ASSIGN_OR_RETURN(const std::string fast_pattern, OnigToPcre2(pattern, Classes::kPcre2));
    ASSIGN_OR_RETURN(t->regex_, Regex::Compile(hf_pattern));
    // Classes with the additions cost PCRE2's JIT 2.5-4x the matching time of its own; text
    // without any of those code points (nearly all) takes the plain pattern.
    if (fast_pattern != hf_pattern) {
      ASSIGN_OR_RETURN(t->regex_fast_, Regex::Compile(fast_pattern));
    }
  } catch (const json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", e.what()));
  }
  return t;
}

// ---------------------------------------------------------------------------------------------
// Text utilities

bool Tokenizer::IsValidUtf8(absl::string_view text) {
  if (IsAscii(text)) return true;
  size_t i = 0, bad = 0;
  while (i < text.size()) {
    size_t n = Utf8SequenceAt(text, i, &bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string Tokenizer::RepairUtf8(absl::string_view text) {
  std::string out;
  out.reserve(text.size() + 8);
  size_t i = 0, bad = 0;
  while (i < text.size()) {
    size_t n = Utf8SequenceAt(text, i, &bad);
    if (n > 0) {
      out.append(text.data() + i, n);
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

namespace {
// HF's NFC normalizer is the `unicode-normalization-alignments` crate, whose tables are Unicode
// 9.0's: a mark assigned later (U+07FD, U+1AC0, U+1DFA, ...) is an unassigned code point there,
// so it neither reorders nor composes and blocks both across it. ICU's normalizer restricted to
// the code points of Unicode <= 9.0 behaves exactly so (normalization data of assigned characters
// is stable across versions; text outside the filter is copied and splits the spans normalized).
// Found by tools/tokenizer/npm_tokenizers_check.mjs (--sweep, --fuzz) against tokenizers 0.23.2.
const icu::Normalizer2& HfNfc() {
  static const icu::Normalizer2* nfc = [] {
    UErrorCode ec = U_ZERO_ERROR;
    const icu::Normalizer2* full = icu::Normalizer2::getNFCInstance(ec);
    CHECK(U_SUCCESS(ec)) << "ICU NFC data unavailable: " << u_errorName(ec);
    auto* unicode9 = new icu::UnicodeSet(icu::UnicodeString(u"[:age=9.0:]"), ec);
    CHECK(U_SUCCESS(ec)) << "ICU age set unavailable: " << u_errorName(ec);
    unicode9->freeze();
    return new icu::FilteredNormalizer2(*full, *unicode9);
  }();
  return *nfc;
}
}  // namespace

std::string Tokenizer::NfcNormalize(absl::string_view text) {
  if (IsAscii(text)) return std::string(text);
  UErrorCode ec = U_ZERO_ERROR;
  const icu::Normalizer2* nfc = &HfNfc();
  const icu::StringPiece piece(text.data(), static_cast<int32_t>(text.size()));
  if (nfc->isNormalizedUTF8(piece, ec) && U_SUCCESS(ec)) return std::string(text);
  ec = U_ZERO_ERROR;
  std::string out;
  icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(text.size()));
  nfc->normalizeUTF8(0, piece, sink, nullptr, ec);
  CHECK(U_SUCCESS(ec)) << "ICU normalizeUTF8 failed: " << u_errorName(ec);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Encoding

std::vector<uint32_t> Tokenizer::Encode(absl::string_view text, SpecialTokens special, Normalized normalized,
                                        std::vector<uint32_t>* starts) const {
  std::string repaired;
  if (!IsValidUtf8(text)) {
    repaired = RepairUtf8(text);
    text = repaired;
  }
  std::vector<uint32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (starts != nullptr) starts->clear();
  // Added tokens first: leftmost-longest.
  size_t plain_begin = 0, i = 0;
  // `base` tracks offsets in the normalized output text (pieces may change length under NFC).
  uint32_t base = 0;
  const bool any_added = !added_.empty();
  const SkipSpecialMatches skip = special == SpecialTokens::kAsText ? SkipSpecialMatches::kYes : SkipSpecialMatches::kNo;
  while (any_added && i < text.size()) {
    const int index = added_matcher_.LongestAt(text, i, skip);
    if (index < 0) {
      ++i;
      continue;
    }
    const AddedToken* hit = &added_[index];
    if (i > plain_begin) {
      const size_t before = ids.size();
      EncodePlain(text.substr(plain_begin, i - plain_begin), base, normalized, &ids, starts);
      // base advances by the normalized length, which EncodePlain reports through starts only;
      // recompute it from the token bytes just emitted (SentencePiece-style: offsets in `text`).
      for (size_t k = before; k < ids.size(); ++k) base += static_cast<uint32_t>(id_to_bytes_[ids[k]].size());
      if (sp_ != nullptr) base = static_cast<uint32_t>(i);
    }
    ids.push_back(hit->id);
    if (starts != nullptr) starts->push_back(base);
    base += static_cast<uint32_t>(hit->content.size());
    i += hit->content.size();
    plain_begin = i;
  }
  if (plain_begin < text.size()) EncodePlain(text.substr(plain_begin), base, normalized, &ids, starts);
  return ids;
}

// Calls piece(text, offset) for each piece the split regex cuts `text` into, in order: matches
// and the unmatched gaps between them (the supported patterns leave none).
template <typename PieceFn>
void Tokenizer::ForEachPiece(absl::string_view text, PieceFn&& piece) const {
  const Regex& re = regex_fast_ != nullptr && !HasUnicode16Additions(text) ? *regex_fast_ : *regex_;
  ThreadMatchState& ms = MatchState();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  const size_t len = text.size();
  size_t offset = 0;
  while (offset < len) {
    int rc = re.jit ? pcre2_jit_match(re.code, subject, len, offset, 0, ms.md, ms.mctx)
                    : pcre2_match(re.code, subject, len, offset, PCRE2_NO_UTF_CHECK, ms.md, ms.mctx);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    CHECK_GT(rc, 0) << "PCRE2 match error " << rc;
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(ms.md);
    const size_t mb = ov[0], me = ov[1];
    if (mb > offset) piece(text.substr(offset, mb - offset), offset);  // an unmatched gap
    if (me == mb) {  // empty match: step one code point (cannot happen with the supported patterns)
      size_t next = mb;
      NextCodepoint(text, next);
      if (next > mb) piece(text.substr(mb, next - mb), mb);
      offset = next;
      continue;
    }
    piece(text.substr(mb, me - mb), mb);
    offset = me;
  }
  if (offset < len) piece(text.substr(offset), offset);
}

void Tokenizer::EncodePlain(absl::string_view text, uint32_t base, Normalized normalized, std::vector<uint32_t>* ids,
                            std::vector<uint32_t>* starts) const {
  if (sp_ != nullptr) {
    sp_->Encode(text, base, ids, starts);
    return;
  }
  std::string norm;
  if (nfc_ && normalized == Normalized::kNo && !IsAscii(text)) {
    norm = NfcNormalize(text);
    text = norm;
  }
  ForEachPiece(text, [&](absl::string_view piece, size_t offset) {
    EncodePiece(piece, base + static_cast<uint32_t>(offset), ids, starts);
  });
}

std::vector<std::string> Tokenizer::PreTokenize(absl::string_view text) const {
  if (sp_ != nullptr) return sp_->PreTokenize(RepairUtf8(text));
  std::string fixed = RepairUtf8(text);
  if (nfc_) fixed = NfcNormalize(fixed);
  std::vector<std::string> pieces;
  ForEachPiece(fixed, [&](absl::string_view piece, size_t) { pieces.emplace_back(piece); });
  return pieces;
}

void Tokenizer::EncodePiece(absl::string_view piece, uint32_t base, std::vector<uint32_t>* ids,
                            std::vector<uint32_t>* starts) const {
  const size_t first = ids->size();
  if (piece.size() == 1) {
    ids->push_back(byte_id_[static_cast<unsigned char>(piece[0])]);
  } else if (piece.size() <= kCacheMaxWordBytes) {
    auto& cache = PieceCache<std::vector<uint32_t>>::For(instance_id_);
    auto it = cache.find(piece);
    if (it != cache.end()) {
      ids->insert(ids->end(), it->second.begin(), it->second.end());
    } else {
      Bpe(piece, ids);
      cache.emplace(std::string(piece), std::vector<uint32_t>(ids->begin() + first, ids->end()));
    }
  } else {
    Bpe(piece, ids);
  }
  if (starts != nullptr) {
    uint32_t at = base;
    for (size_t k = first; k < ids->size(); ++k) {
      starts->push_back(at);
      at += static_cast<uint32_t>(id_to_bytes_[(*ids)[k]].size());
    }
  }
}

// Byte-level BPE: one symbol per byte, then merges by rank (bpe_merge.h).
void Tokenizer::Bpe(absl::string_view piece, std::vector<uint32_t>* out) const {
  if (ignore_merges_) {
    auto it = bytes_to_id_.find(piece);
    if (it != bytes_to_id_.end()) {
      out->push_back(it->second);
      return;
    }
  }
  constexpr size_t kStackSymbols = 64;
  uint32_t on_stack[kStackSymbols];
  std::vector<uint32_t> on_heap;
  uint32_t* sym = on_stack;
  if (piece.size() > kStackSymbols) {
    on_heap.resize(piece.size());
    sym = on_heap.data();
  }
  for (size_t i = 0; i < piece.size(); ++i) sym[i] = byte_id_[static_cast<unsigned char>(piece[i])];
  MergeByRank(merges_, absl::MakeConstSpan(sym, piece.size()), out);
}

std::vector<std::vector<uint32_t>> Tokenizer::EncodeBatch(absl::Span<const std::string> texts, int threads,
                                                          SpecialTokens special) const {
  std::vector<std::vector<uint32_t>> out(texts.size());
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  threads = static_cast<int>(std::min<size_t>(threads, std::max<size_t>(1, texts.size())));
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next.fetch_add(1); i < texts.size(); i = next.fetch_add(1)) out[i] = Encode(texts[i], special);
  };
  if (threads == 1) {
    work();
    return out;
  }
  std::vector<std::thread> pool;
  for (int k = 0; k < threads; ++k) pool.emplace_back(work);
  for (auto& th : pool) th.join();
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decoding and lookups

std::string Tokenizer::Decode(absl::Span<const uint32_t> ids, SkipSpecial skip) const {
  if (sp_ != nullptr) {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (uint32_t id : ids) {
      if (skip == SkipSpecial::kYes && id < is_special_.size() && is_special_[id]) continue;
      if (const std::string* text = sp_->TokenText(id)) tokens.push_back(*text);
    }
    return sp_->Decode(std::move(tokens));
  }
  std::string bytes;
  for (uint32_t id : ids) {
    if (id >= id_to_bytes_.size()) continue;
    if (skip == SkipSpecial::kYes && is_special_[id]) continue;
    bytes += id_to_bytes_[id];
  }
  return IsValidUtf8(bytes) ? bytes : RepairUtf8(bytes);
}

absl::StatusOr<std::vector<uint32_t>> Tokenizer::AddSpecialTokens(absl::Span<const uint32_t> ids) const {
  RETURN_IF_ERROR(post_processor_status_);
  std::vector<uint32_t> out = special_before_;
  out.insert(out.end(), ids.begin(), ids.end());
  out.insert(out.end(), special_after_.begin(), special_after_.end());
  return out;
}

absl::StatusOr<uint32_t> Tokenizer::TokenId(absl::string_view token_text) const {
  for (const AddedToken& a : added_) {
    if (a.content == token_text) return a.id;
  }
  auto it = bytes_to_id_.find(token_text);
  if (it != bytes_to_id_.end()) return it->second;
  return absl::NotFoundError(absl::StrCat("token \"", std::string(token_text), "\" is not in the vocabulary"));
}

const std::string& Tokenizer::TokenBytes(uint32_t id) const {
  static const std::string* const kEmpty = new std::string();
  return id < id_to_bytes_.size() ? id_to_bytes_[id] : *kEmpty;
}

}  // namespace slidedp::tok
