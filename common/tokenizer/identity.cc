// Tokenizer fingerprint: a canonical, length-prefixed encoding of the parsed tokenizer files fed
// to SHA-256 (identity.h says what it covers and why).
#include "common/tokenizer/identity.h"

#include <openssl/evp.h>

#include <algorithm>
#include <memory>
#include <set>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/io/json_depth.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"

namespace slidedp::tok {
namespace {

using json = nlohmann::json;

// Bumped whenever the canonical form below changes (every recorded fingerprint changes with it).
constexpr char kCanonicalFormName[] = "slidedp-tokenizer-identity-v1";

std::string Hex(const unsigned char* bytes, size_t n) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    out[2 * i] = kDigits[bytes[i] >> 4];
    out[2 * i + 1] = kDigits[bytes[i] & 15];
  }
  return out;
}

struct EvpCtxFree {
  void operator()(EVP_MD_CTX* c) const { EVP_MD_CTX_free(c); }
};

// SHA-256 over a sequence of typed, length-prefixed fields, so no two different field sequences
// encode to the same bytes ("ab","c" vs "a","bc"). Buffered: the vocabulary is ~300k small fields.
class CanonicalHasher {
 public:
  CanonicalHasher() : ctx_(EVP_MD_CTX_new()) {
    CHECK(ctx_ != nullptr && EVP_DigestInit_ex(ctx_.get(), EVP_sha256(), nullptr) == 1) << "OpenSSL SHA-256 init";
    buffer_.reserve(kFlushBytes + 64);
  }
  void Tag(char tag) { buffer_.push_back(tag); }
  void Int(uint64_t v) {
    for (int i = 0; i < 8; ++i) buffer_.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
    MaybeFlush();
  }
  void Str(absl::string_view s) {
    Int(s.size());
    if (s.size() >= kFlushBytes) {
      Flush();
      Update(s.data(), s.size());
      return;
    }
    buffer_.append(s.data(), s.size());
    MaybeFlush();
  }
  // A JSON value by its canonical text: nlohmann's objects are sorted maps and its numbers print
  // in shortest round-trip form, so this ignores the file's formatting and key order.
  void Json(const json& v) { Str(v.dump()); }
  std::string HexDigest() {
    Flush();
    unsigned char digest[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    CHECK_EQ(EVP_DigestFinal_ex(ctx_.get(), digest, &n), 1) << "OpenSSL SHA-256 final";
    return Hex(digest, n);
  }

 private:
  static constexpr size_t kFlushBytes = 1 << 16;
  void MaybeFlush() {
    if (buffer_.size() >= kFlushBytes) Flush();
  }
  void Flush() {
    Update(buffer_.data(), buffer_.size());
    buffer_.clear();
  }
  void Update(const void* data, size_t n) {
    if (n > 0) CHECK_EQ(EVP_DigestUpdate(ctx_.get(), data, n), 1) << "OpenSSL SHA-256 update";
  }
  std::unique_ptr<EVP_MD_CTX, EvpCtxFree> ctx_;
  std::string buffer_;
};

// "an array", "an object", "a string", "null", ...: a JSON value's type for messages.
std::string TypeWithArticle(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  const std::string name = v.type_name();
  return (name[0] == 'a' || name[0] == 'o' ? "an " : "a ") + name;
}

// A token id: an integer in [0, 2^31) (what the tokenizer loader accepts).
absl::StatusOr<uint32_t> TokenIdOf(const json& v, const std::string& what) {
  if (v.is_number_unsigned() && v.get<uint64_t>() < (uint64_t{1} << 31))
    return static_cast<uint32_t>(v.get<uint64_t>());
  if (v.is_number_integer() && v.get<int64_t>() >= 0 && v.get<int64_t>() < (int64_t{1} << 31)) {
    return static_cast<uint32_t>(v.get<int64_t>());
  }
  return absl::InvalidArgumentError(
      absl::StrCat(what, ": id ", v.dump().substr(0, 40), " is not an integer in [0, 2^31)"));
}

// Whether obj[key] is JSON true (absent, null or anything else: false).
bool IsTrue(const json& obj, const char* key) {
  auto it = obj.find(key);
  return it != obj.end() && it->is_boolean() && it->get<bool>();
}

absl::StatusOr<std::string> StringOf(const json& v, const std::string& what) {
  if (!v.is_string()) return absl::InvalidArgumentError(absl::StrCat(what, ": ", TypeWithArticle(v), ", not a string"));
  return v.get<std::string>();
}

// tokenizer_config.json's bos_token / eos_token: a string, an AddedToken object's "content", or none.
absl::StatusOr<std::string> SpecialTokenOf(const json& config, const char* key) {
  if (!config.contains(key) || config[key].is_null()) return std::string();
  const json& t = config[key];
  if (t.is_string()) return t.get<std::string>();
  if (t.is_object() && t.contains("content") && t["content"].is_string()) return t["content"].get<std::string>();
  return absl::InvalidArgumentError(absl::StrCat("tokenizer_config.json ", key, ": ", TypeWithArticle(t),
                                                 ", neither a string nor an object with a string \"content\""));
}

absl::StatusOr<json> ParseObject(absl::string_view text, absl::string_view what) {
  RETURN_IF_ERROR(CheckJsonDepth(text, what));
  json j = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(what, ": not valid JSON"));
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(what, ": not a JSON object"));
  return j;
}

absl::StatusOr<TokenizerIdentity> Identify(const json& tok, const json& config) {
  CanonicalHasher h;
  h.Str(kCanonicalFormName);

  if (!tok.contains("model") || !tok["model"].is_object()) {
    return absl::InvalidArgumentError("tokenizer.json model: missing or not an object");
  }
  const json& model = tok["model"];
  // The model's type and options (dropout, ignore_merges, byte_fallback, unk_token, ...).
  json options = json::object();
  for (auto it = model.begin(); it != model.end(); ++it) {
    if (it.key() != "vocab" && it.key() != "merges") options[it.key()] = it.value();
  }
  h.Tag('O');
  h.Json(options);

  // Vocabulary, in the key order of nlohmann's sorted object (not the file's).
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return absl::InvalidArgumentError("tokenizer.json model.vocab: missing or not an object");
  }
  const json& vocab = model["vocab"];
  int64_t vocab_size = 0;
  h.Tag('V');
  h.Int(vocab.size());
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    ASSIGN_OR_RETURN(const uint32_t id, TokenIdOf(it.value(), absl::StrCat("tokenizer.json model.vocab[\"",
                                                                           it.key().substr(0, 40), "\"]")));
    vocab_size = std::max<int64_t>(vocab_size, int64_t{id} + 1);
    h.Str(it.key());
    h.Int(id);
  }

  // Merges in rank order: ["a", "b"] pairs (tokenizers >= 0.20) and "a b" strings alike.
  if (!model.contains("merges") || !model["merges"].is_array()) {
    return absl::InvalidArgumentError("tokenizer.json model.merges: missing or not an array");
  }
  const json& merges = model["merges"];
  h.Tag('M');
  h.Int(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const json& m = merges[rank];
    const std::string what = absl::StrCat("tokenizer.json model.merges[", rank, "]");
    if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      h.Str(m[0].get_ref<const std::string&>());
      h.Str(m[1].get_ref<const std::string&>());
    } else if (m.is_string()) {
      const std::string& s = m.get_ref<const std::string&>();
      const size_t sp = s.find(' ', 1);  // as the loader splits it: the first space after the first byte
      if (sp == std::string::npos) return absl::InvalidArgumentError(absl::StrCat(what, ": no space in \"", s, "\""));
      h.Str(absl::string_view(s).substr(0, sp));
      h.Str(absl::string_view(s).substr(sp + 1));
    } else {
      return absl::InvalidArgumentError(absl::StrCat(what, ": neither [\"a\", \"b\"] nor \"a b\""));
    }
  }

  // Added tokens: the set of (id, content, special) of tokenizer.json's added_tokens and
  // tokenizer_config.json's added_tokens_decoder together. transformers loads both, and saves the
  // same tokens in both, so a config with or without the copy has one fingerprint, while a token
  // changed in either file changes it.
  std::set<std::tuple<uint32_t, std::string, bool>> added;
  if (tok.contains("added_tokens") && !tok["added_tokens"].is_null()) {
    if (!tok["added_tokens"].is_array()) return absl::InvalidArgumentError("tokenizer.json added_tokens: not an array");
    const json& list = tok["added_tokens"];
    for (size_t i = 0; i < list.size(); ++i) {
      const std::string what = absl::StrCat("tokenizer.json added_tokens[", i, "]");
      const json& a = list[i];
      if (!a.is_object() || !a.contains("id") || !a.contains("content")) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": not an object with an id and a content"));
      }
      ASSIGN_OR_RETURN(const uint32_t id, TokenIdOf(a["id"], what));
      ASSIGN_OR_RETURN(std::string content, StringOf(a["content"], absl::StrCat(what, ".content")));
      vocab_size = std::max<int64_t>(vocab_size, int64_t{id} + 1);
      added.emplace(id, std::move(content), IsTrue(a, "special"));
    }
  }
  if (config.contains("added_tokens_decoder") && !config["added_tokens_decoder"].is_null()) {
    const json& decoder = config["added_tokens_decoder"];
    if (!decoder.is_object()) {
      return absl::InvalidArgumentError("tokenizer_config.json added_tokens_decoder: not an object");
    }
    for (auto it = decoder.begin(); it != decoder.end(); ++it) {
      const std::string what =
          absl::StrCat("tokenizer_config.json added_tokens_decoder[\"", it.key().substr(0, 20), "\"]");
      uint64_t id = 0;
      const std::string& key = it.key();
      if (key.empty() || key.size() > 10 || key.find_first_not_of("0123456789") != std::string::npos ||
          (id = std::stoull(key)) >= (uint64_t{1} << 31)) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": the key is not an id in [0, 2^31)"));
      }
      const json& a = it.value();
      if (!a.is_object() || !a.contains("content")) {
        return absl::InvalidArgumentError(absl::StrCat(what, ": not an object with a content"));
      }
      ASSIGN_OR_RETURN(std::string content, StringOf(a["content"], absl::StrCat(what, ".content")));
      added.emplace(static_cast<uint32_t>(id), std::move(content), IsTrue(a, "special"));
    }
  }
  h.Tag('A');
  h.Int(added.size());
  for (const auto& [id, content, special] : added) {
    h.Int(id);
    h.Str(content);
    h.Int(special ? 1 : 0);
  }

  h.Tag('S');
  for (const char* key : {"bos_token", "eos_token"}) {
    ASSIGN_OR_RETURN(std::string text, SpecialTokenOf(config, key));
    h.Str(text);
  }
  h.Int(IsTrue(config, "split_special_tokens") ? 1 : 0);

  h.Tag('N');
  h.Json(tok.value("normalizer", json()));
  h.Tag('P');
  h.Json(tok.value("pre_tokenizer", json()));

  if (vocab_size == 0) return absl::InvalidArgumentError("tokenizer.json: no vocabulary entries and no added tokens");
  return TokenizerIdentity{absl::StrCat("sha256:", h.HexDigest()), vocab_size};
}

}  // namespace

absl::StatusOr<TokenizerIdentity> IdentifyTokenizerJson(absl::string_view tokenizer_json,
                                                        absl::string_view tokenizer_config_json) {
  ASSIGN_OR_RETURN(json tok, ParseObject(tokenizer_json, "tokenizer.json"));
  json config = json::object();
  if (!tokenizer_config_json.empty()) {
    ASSIGN_OR_RETURN(config, ParseObject(tokenizer_config_json, "tokenizer_config.json"));
  }
  try {
    return Identify(tok, config);
  } catch (const json::exception& e) {  // every field is type-checked first; this keeps a missed one an error
    return absl::InvalidArgumentError(absl::StrCat("tokenizer files: ", e.what()));
  }
}

absl::StatusOr<TokenizerIdentity> IdentifyTokenizer(const std::string& model_dir) {
  const std::string tokenizer_path = absl::StrCat(model_dir, "/tokenizer.json");
  const std::string config_path = absl::StrCat(model_dir, "/tokenizer_config.json");
  ASSIGN_OR_RETURN(const std::string tokenizer_text,
                   ReadSmallFile(tokenizer_path, kMaxTokenizerJsonBytes, "tokenizer.json"));
  std::string config_text;
  absl::StatusOr<std::string> config = ReadSmallFile(config_path, kMaxTokenizerConfigBytes, "tokenizer_config.json");
  if (config.ok()) {
    config_text = std::move(*config);
  } else if (config.status().code() != absl::StatusCode::kNotFound) {
    return config.status();
  }
  auto identity = IdentifyTokenizerJson(tokenizer_text, config_text);
  if (!identity.ok()) return Annotate(identity.status(), model_dir);
  return identity;
}

std::string Sha256Hex(absl::string_view bytes) {
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  CHECK_EQ(EVP_Digest(bytes.data(), bytes.size(), digest, &n, EVP_sha256(), nullptr), 1) << "OpenSSL SHA-256";
  return Hex(digest, n);
}

}  // namespace slidedp::tok
