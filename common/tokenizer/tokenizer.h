// Tokenizer that loads HF tokenizer.json and produces the same ids as HF `tokenizers` (0.23.2), for
// two families of BPE models:
//   byte-level BPE (Qwen2/Qwen2.5/Qwen3/Qwen3.5, the Llama-3 kind), run here as HF runs it:
//   1. invalid UTF-8 is replaced by U+FFFD per maximal subpart (what Python's
//      bytes.decode("utf-8", "replace") and Rust's from_utf8_lossy do before HF ever sees text);
//   2. added tokens (<|im_start|>, <think>, ...) are matched first, leftmost-longest, and emitted
//      as their ids; the text between them goes through steps 3-6;
//   3. normalizer: none or NFC (ICU, restricted to Unicode 9.0's code points as HF's tables are);
//   4. pre-tokenizer: the Split regex (PCRE2, UTF + UCP, JIT) with Isolated behaviour, or
//      ByteLevel's own GPT-2 regex when use_regex is true; \s, \p{L}, \p{M}, \p{N} classify as
//      HF's Oniguruma does (White_Space; Unicode 16.0);
//   5. byte-level BPE on each piece: start from single bytes, repeatedly merge the adjacent pair
//      of lowest merge rank (leftmost on ties); ignore_merges (Llama-3) emits a whole piece that is
//      itself in the vocabulary directly;
//   6. ids; decode concatenates token bytes and replaces invalid UTF-8 with U+FFFD.
//   SentencePiece-style BPE (Llama 2, Mistral, Gemma: no ByteLevel pre-tokenizer): steps 1-2 as
//   above, then the `▁` normalizers / pre-tokenizers, character BPE with byte fallback and the
//   decoders of sentencepiece_bpe.h.
// Limits: BPE models only (no WordPiece/Unigram), no dropout; added tokens with
// lstrip/rstrip/single_word are rejected at load (none of the supported models use them).
//
// Thread-safety: a loaded Tokenizer is immutable; Encode may be called from many threads (each
// thread keeps its own word cache).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/tokenizer/added_tokens.h"
#include "common/tokenizer/bpe_merge.h"

namespace slidedp::tok {

enum class SpecialTokens {
  kRecognize,  // added tokens in the text become their ids (HF default, split_special_tokens=false)
  kAsText,     // added tokens in the text are tokenized as ordinary text
};
enum class SkipSpecial { kNo, kYes };
// kAlready: the caller guarantees the text is NFC (meaningful for NFC tokenizers only).
enum class Normalized { kNo, kAlready };

class SentencePieceBpe;


class Tokenizer {
 public:
  ~Tokenizer();
  // tokenizer.json text / file. UNIMPLEMENTED names the unsupported component.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromJson(absl::string_view json_text);
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromFile(const std::string& path);

  // Ids of `text`, as HF's encode(text, add_special_tokens=False). If `starts` is given, it
  // receives each token's first byte offset in the (UTF-8-repaired, normalized) text; with
  // Normalized::kAlready and valid UTF-8 input those are offsets into `text` itself. For
  // SentencePiece-style tokenizers they are always offsets into the UTF-8-repaired `text` (HF's
  // token offsets: `▁` counts as the space it replaced, a prepended one as the first character).
  std::vector<uint32_t> Encode(absl::string_view text, SpecialTokens special = SpecialTokens::kRecognize,
                               Normalized normalized = Normalized::kNo, std::vector<uint32_t>* starts = nullptr) const;

  // Documents in parallel over `threads` threads (0 = hardware concurrency); output order = input order.
  std::vector<std::vector<uint32_t>> EncodeBatch(absl::Span<const std::string> texts, int threads,
                                                 SpecialTokens special = SpecialTokens::kRecognize) const;

  // HF's decode: byte-level, the tokens' bytes with invalid UTF-8 repaired; SentencePiece-style,
  // tokenizer.json's decoder (Replace / ByteFallback / Fuse / Strip / Metaspace).
  std::string Decode(absl::Span<const uint32_t> ids, SkipSpecial skip = SkipSpecial::kNo) const;

  // `ids` with the special tokens tokenizer.json's post-processor puts around one sequence (HF's
  // encode with add_special_tokens=True: Llama 2's <s>, Gemma's <bos>, Llama 3's
  // <|begin_of_text|>); UNIMPLEMENTED, naming it, for a post-processor other than
  // TemplateProcessing / ByteLevel / a Sequence of them (refused at load for SentencePiece-style).
  absl::StatusOr<std::vector<uint32_t>> AddSpecialTokens(absl::Span<const uint32_t> ids) const;

  // The pieces the pre-tokenizer cuts `text` into (UTF-8 repaired, normalized; added tokens are
  // not matched), as raw bytes: what HF's normalizer then pre_tokenizer give, for comparisons
  // that ids alone cannot make (two splits can tokenize alike under a small vocabulary).
  std::vector<std::string> PreTokenize(absl::string_view text) const;

  // Id of a vocabulary entry or added token given as text (e.g. "<|im_end|>"), or NOT_FOUND.
  absl::StatusOr<uint32_t> TokenId(absl::string_view token_text) const;
  // Raw bytes of a token (the byte-level mapping undone; SentencePiece-style: the entry as it
  // stands in the normalized text, `▁` kept, a <0xNN> token that byte); empty for ids outside the
  // vocabulary. The tokens' bytes, concatenated, are the normalized text.
  const std::string& TokenBytes(uint32_t id) const;

  // One past the largest id (vocab and added tokens): every id Encode returns is below it.
  int64_t vocab_size() const { return static_cast<int64_t>(id_to_bytes_.size()); }
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  bool normalizes_nfc() const { return nfc_; }

  // Utilities exposed for prepare and tests.
  static std::string RepairUtf8(absl::string_view text);  // invalid sequences -> U+FFFD
  static bool IsValidUtf8(absl::string_view text);
  // NFC of `text` (valid UTF-8 expected); ASCII text is returned unchanged without calling ICU.
  static std::string NfcNormalize(absl::string_view text);

 private:
  Tokenizer();
  struct Regex;
  template <typename PieceFn>
  void ForEachPiece(absl::string_view text, PieceFn&& piece) const;
  void EncodePlain(absl::string_view text, uint32_t base, Normalized normalized, std::vector<uint32_t>* ids,
                   std::vector<uint32_t>* starts) const;
  void EncodePiece(absl::string_view piece, uint32_t base, std::vector<uint32_t>* ids,
                   std::vector<uint32_t>* starts) const;
  void Bpe(absl::string_view piece, std::vector<uint32_t>* out) const;
  // The vocabulary: byte-level, with raw-byte keys; SentencePiece-style, as tokenizer.json writes it.
  absl::flat_hash_map<std::string, uint32_t> bytes_to_id_;
  std::vector<std::string> id_to_bytes_;                            // decode table (added tokens included)
  std::vector<uint8_t> is_special_;                                 // per id
  MergeMap merges_;
  uint32_t byte_id_[256] = {};
  std::vector<AddedToken> added_;
  AddedTokenMatcher added_matcher_;
  std::unique_ptr<Regex> regex_;  // the split regex with HF's Unicode classes
  // The same with PCRE2's own classes, for text none of whose code points they classify otherwise
  // (faster); null when the pattern uses none of those classes.
  std::unique_ptr<Regex> regex_fast_;
  std::unique_ptr<SentencePieceBpe> sp_;  // set for SentencePiece-style tokenizers
  // What the post-processor adds around a sequence, or why it cannot be applied.
  std::vector<uint32_t> special_before_, special_after_;
  absl::Status post_processor_status_;
  bool nfc_ = false;
  bool ignore_merges_ = false;
  uint64_t instance_id_ = 0;  // keys the per-thread word caches
};

}  // namespace slidedp::tok
