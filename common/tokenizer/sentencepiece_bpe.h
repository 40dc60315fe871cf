// SentencePiece-style BPE as HF `tokenizers` runs it for Llama 2, Mistral (v0.1-v0.3) and Gemma
// (1-3) tokenizer.json files: BPE over characters (not bytes) whose vocabulary writes a space as
// `▁`, a character outside the vocabulary falling back to its UTF-8 bytes as `<0xNN>` tokens
// (byte_fallback), else to unk_token. Tokenizer (tokenizer.h) matches the added tokens and hands
// each text between them to Encode here.
//
// Components, each exactly as HF implements it (docs/tokenizer.md, "SentencePiece-style BPE"):
//   normalizer:     null, Prepend, Replace (String pattern), Sequence of those;
//   pre_tokenizer:  null, Metaspace (prepend_scheme first / always / never, split), Split (String
//                   pattern, every behavior, invert), Sequence of those;
//   model:          BPE with byte_fallback, unk_token, fuse_unk, ignore_merges (no dropout, no
//                   continuing_subword_prefix / end_of_word_suffix);
//   decoder:        null, Replace (String), ByteFallback, Fuse, Strip, Metaspace, Sequence;
//   post_processor: TemplateProcessing (also read for byte-level tokenizers: ReadPostProcessor).
// Anything else is refused at load with UNIMPLEMENTED naming the component.
//
// Offsets: every normalized byte keeps the offset, in the whole text, of the character it comes
// from (a replaced space: the space; a prepended `▁`: the first character), so a token's start is
// HF's token offset (every <0xNN> token of a character starts at that character).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/tokenizer/bpe_merge.h"
#include "nlohmann/json.hpp"

namespace slidedp::tok {

// Whether tokenizer.json `j` is SentencePiece-style: its pre-tokenizer has no ByteLevel step (the
// byte-level alphabet only means something with one).
bool IsSentencePieceStyle(const nlohmann::json& j);

// The special tokens HF's post-processor puts around a single sequence (encode with
// add_special_tokens=True): TemplateProcessing's `single` (one Sequence "A"), ByteLevel (no ids),
// null, or a Sequence of those; UNIMPLEMENTED names any other.
struct SpecialTokenTemplate {
  std::vector<uint32_t> before, after;
};
absl::StatusOr<SpecialTokenTemplate> ReadPostProcessor(const nlohmann::json& post_processor);

class SentencePieceBpe {
 public:
  // Reads the model options, normalizer, pre_tokenizer and decoder of tokenizer.json `j`; `vocab`
  // is its model's vocabulary (entry -> id) and `merges` its merges, both read by the caller.
  static absl::StatusOr<std::unique_ptr<SentencePieceBpe>> FromJson(const nlohmann::json& j,
                                                                    const absl::flat_hash_map<std::string, uint32_t>& vocab,
                                                                    MergeMap merges);

  // What a vocabulary entry stands for in the normalized text: a <0xNN> byte token (with
  // byte_fallback) that byte, any other entry itself.
  std::string EntryText(const std::string& entry) const;

  // Ids (appended to *ids) of `text` (valid UTF-8, no added tokens), which starts at byte `offset`
  // of the whole text: Metaspace's prepend_scheme "first" prepends only at offset 0, as HF does.
  // `starts` (optional) receives each token's start as an offset in the whole text.
  void Encode(absl::string_view text, uint32_t offset, std::vector<uint32_t>* ids,
              std::vector<uint32_t>* starts) const;

  // The normalizer's and pre-tokenizer's pieces of `text` (as HF's normalize_str + pre_tokenize_str).
  std::vector<std::string> PreTokenize(absl::string_view text) const;

  // A token's text as the decoder sees it (an added token's content, else the vocabulary entry);
  // null for an id that has neither, which HF's decode skips. SetTokenText records added tokens.
  const std::string* TokenText(uint32_t id) const;
  void SetTokenText(uint32_t id, std::string text);

  // The decoder over token texts; with no decoder, HF joins them with spaces.
  std::string Decode(std::vector<std::string> tokens) const;

  ~SentencePieceBpe();

 private:
  SentencePieceBpe();
  struct Aligned;
  struct Normalizer;
  struct PreTokenizer;
  struct Decoder;
  struct PieceTokens;
  Aligned Normalize(absl::string_view text, uint32_t offset) const;
  std::vector<Aligned> Split(Aligned normalized) const;
  void EncodePiece(const Aligned& piece, std::vector<uint32_t>* ids, std::vector<uint32_t>* starts) const;
  PieceTokens Tokenize(const std::string& piece) const;

  absl::flat_hash_map<std::string, uint32_t> vocab_;  // text -> id (kept for ignore_merges only)
  absl::flat_hash_map<uint32_t, uint32_t> char_id_;   // code point -> id of a one-character entry
  uint32_t byte_id_[256] = {};                         // <0xNN> -> id (kNoId where absent)
  bool byte_fallback_ = false;
  uint32_t unk_id_ = 0;
  bool has_unk_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  MergeMap merges_;
  std::vector<std::string> id_text_;
  std::vector<uint8_t> has_text_;
  std::vector<Normalizer> normalizers_;
  std::vector<PreTokenizer> pre_tokenizers_;
  std::vector<Decoder> decoders_;
  bool has_decoder_ = false;
  uint64_t cache_owner_ = NextCacheOwner();  // keys the per-thread piece caches
};

}  // namespace slidedp::tok
