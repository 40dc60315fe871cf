// A tokenizer's identity: a fingerprint of what decides the ids it produces, so a dataset
// tokenized for one model can be told apart from another model's tokenizer: `slidedp prepare`
// records it in the dataset manifest's "source", hostd compares it with the model directory's at
// submit (docs/dataset-format.md, "Source").
//
// The fingerprint is SHA-256 over a canonical form of the parsed files, not their bytes, so
// reformatting the JSON (indentation, key order, \u escapes, merges as "a b" strings or as
// ["a", "b"] pairs) does not change it. It covers, from tokenizer.json: the model's type and
// options (everything in "model" but vocab and merges), the vocabulary (token -> id), the merges
// in rank order, the normalizer and the pre-tokenizer; the added tokens as one set of (id,
// content, special) from tokenizer.json's added_tokens and tokenizer_config.json's
// added_tokens_decoder (a config with or without that copy is the same tokenizer); from
// tokenizer_config.json (when present): the bos_token and eos_token (prepare renders and appends
// them) and split_special_tokens. It leaves
// out what does not change ids or what prepare writes: the decoder, post_processor, padding,
// truncation, pad_token, model_max_length and the chat template (the manifest records the
// template's hash on its own).
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp::tok {

// Caps on a model directory's tokenizer files, read whole: tokenizer.json runs to tens of MB for
// 200k-token vocabularies; a path may name a FIFO or /dev/zero, or a file far larger than its kind.
inline constexpr uint64_t kMaxTokenizerJsonBytes = 256ull << 20;
inline constexpr uint64_t kMaxTokenizerConfigBytes = 4ull << 20;

struct TokenizerIdentity {
  std::string fingerprint;  // "sha256:" and 64 lowercase hex digits
  int64_t vocab_size = 0;   // max id + 1 over tokenizer.json's vocabulary and added tokens
};

// The identity of model_dir's tokenizer.json (and tokenizer_config.json beside it, when present).
// Both are read bounded (kMaxTokenizer*Bytes), non-blocking, regular files only. NOT_FOUND when
// there is no tokenizer.json (callers treat that as "no fingerprint"); INVALID_ARGUMENT naming
// the file and field when either is not a tokenizer file. Cost: one JSON parse and one SHA-256
// pass, about 0.3 s for a 10 MB tokenizer.json (docs/dataset-format.md), so it may run in a handler.
absl::StatusOr<TokenizerIdentity> IdentifyTokenizer(const std::string& model_dir);

// The same from the files' text; tokenizer_config_json empty: no tokenizer_config.json.
absl::StatusOr<TokenizerIdentity> IdentifyTokenizerJson(absl::string_view tokenizer_json,
                                                        absl::string_view tokenizer_config_json);

// SHA-256 of bytes as 64 lowercase hex digits (OpenSSL's libcrypto).
std::string Sha256Hex(absl::string_view bytes);

}  // namespace slidedp::tok
