// slidedp prepare as a library: users' JSONL / text -> the training dataset (docs/dataset-format.md),
// tokenized with the model's own tokenizer (common/tokenizer). The CLI (client/cli) maps flags to
// PrepareOptions and draws the progress bar from the callback.
//
// Inputs, one document per line of .jsonl/.json files, in one of the forms of input_formats.h
// (messages, sharegpt, alpaca, conversational_prompt_completion: rendered with the model's chat
// template, the answers trained; prompt_completion: prompt + completion (+ EOS) concatenated
// without a template, the completion trained; text (+ EOS): all trained). The form is detected per
// file from its first record, or forced (PrepareOptions::format); a file whose records change form
// is refused (INVALID_ARGUMENT, file:line), whatever bad_lines says. A .json file may instead hold
// one JSON array of such records ("line" = element number), and .txt files are one text document
// each. Errors name file:line and the field.
// Memory: inputs are read as a stream (a JSON array too, element by element) and tokenized in
// batches of at most batch_documents records or batch_bytes input bytes, and the writer streams
// rows to disk, so prepare holds one batch (at least its longest document) whatever the corpus
// size and seq_len.
// The chat template is the model's: tokenizer_config.json's chat_template, or chat_template.jinja
// beside it, which wins as in transformers (chat_template.h says which templates are reproduced).
// Output: <output>/train and, when validation_fraction > 0, <output>/validation (split per
// document by a seeded hash of (input index, line), so it does not depend on threads or on other
// lines), plus <output>/prepare_summary.json. Tokenization runs in parallel over documents; output
// order is input order.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/prepare/chat_template.h"
#include "client/prepare/input_formats.h"
#include "common/data/dataset.h"
#include "common/tokenizer/tokenizer.h"

namespace slidedp::prepare {

// The longest row (--seq-len) prepare writes: the trainer's micro-batch (common/data/batch.h)
// indexes its tokens, positions and cu_seqlens with int32, so one row must fit in int32.
inline constexpr int64_t kMaxSeqLen = int64_t{2147483647};
// The longest rendered document in bytes (about 250M tokens, far beyond any row): the tokenizer's
// byte offsets are uint32, and repairing invalid UTF-8 or NFC can grow a text at most threefold.
inline constexpr int64_t kMaxDocumentBytes = int64_t{1} << 30;
// A validation split with fewer documents than this gets a warning (its loss would be noise).
inline constexpr int64_t kFewValidationDocuments = 10;

enum class BadLines { kFail, kSkip };
enum class TextEos { kAppend, kNone };  // append tokenizer_config's eos_token to text / completion docs

struct PrepareProgress {
  int64_t bytes_done = 0;  // of all inputs
  int64_t bytes_total = 0;
  int64_t documents = 0;  // written so far
  int64_t tokens = 0;
};

struct PrepareOptions {
  std::string model_dir;            // holds tokenizer.json and tokenizer_config.json (config.json: optional)
  std::vector<std::string> inputs;  // .jsonl / .json (JSON lines) / .txt
  std::string output_dir;
  InputFormat format = InputFormat::kAuto;  // kAuto: per file, from its first record
  int64_t seq_len = 4096;                   // in [2, kMaxSeqLen]
  data::Packing packing = data::Packing::kPacked;
  double validation_fraction = 0.0;  // in [0, 1)
  uint64_t seed = 0;
  LossOn loss_on = LossOn::kAssistant;
  ChatTemplate chat_template = ChatTemplate::kAuto;
  std::string chat_date;  // Llama 3.1/3.2 "Today Date"; empty = kLlamaDefaultDate ("26 Jul 2024")
  TextEos text_eos = TextEos::kAppend;
  BadLines bad_lines = BadLines::kFail;
  int threads = 0;  // 0 = hardware concurrency
  data::Overwrite overwrite = data::Overwrite::kNo;
  // A parallel batch ends at batch_documents records or batch_bytes input bytes, whichever comes
  // first. It holds its records and their tokens at once (3.5 bytes per input byte measured on
  // 2-byte tokens: 64 MiB batches of 300k-token documents peak at 350 MB, 110 MB of it the tokenizer), so
  // the byte bound keeps long documents (a 1M-token row is about 4 MB of text) from multiplying it.
  int64_t batch_documents = 2048;
  int64_t batch_bytes = int64_t{64} << 20;
  std::function<void(const PrepareProgress&)> progress;  // called after each batch; may be empty
};

struct SplitSummary {
  std::string dir;  // empty when the split got no documents
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t trained_tokens = 0;
  int64_t truncated_documents = 0;       // padded mode: longer than seq_len, their tails not stored
  int64_t truncated_trained_tokens = 0;  // padded mode: trained tokens in those tails
  int64_t dropped_documents = 0;         // padded mode: nothing trained within seq_len, not written
  int64_t split_documents = 0;           // packed mode: longer than seq_len
  int64_t rows = 0;
};

struct PrepareSummary {
  SplitSummary train;
  SplitSummary validation;
  int64_t skipped_lines = 0;
  std::vector<std::string> skipped_examples;  // the first few skip reasons, "file:line: ..."
  std::string chat_template;  // ChatTemplateName ("qwen3", "llama3.1", ...); "" when no chat data was seen
  int64_t vocab_size = 0;
  std::vector<std::string> input_formats;  // per input: InputFormatName; "none" when it held no usable record
  data::DatasetSource source;              // what each manifest's "source" says
  // What the user should know before training: truncated or dropped documents, a validation
  // split too small to be useful, a tokenizer larger than the model's vocabulary.
  std::vector<std::string> warnings;
  std::string ToJson() const;
};

// Writes the dataset. Besides the input errors above: a validation_fraction > 0 that puts no
// document in the validation split is FAILED_PRECONDITION (nothing is written; the message has
// the counts and a fraction that would work); fewer than kFewValidationDocuments is a warning.
absl::StatusOr<PrepareSummary> Prepare(const PrepareOptions& options);

// The first `count` documents of the inputs exactly as Prepare renders and tokenizes them
// (output_dir and the split options are not used; nothing is written), for `slidedp prepare
// --show`. Bad records fail or are skipped as bad_lines says.
struct DocumentPreview {
  std::string where;  // "file:line" ("file" for a .txt document)
  InputFormat format = InputFormat::kAuto;
  std::string chat_template;  // ChatTemplateName of the template rendered; "" without one
  // The document's tokens decoded, in runs that are trained (predicted with loss) or not. The
  // first token is never trained: nothing precedes it.
  std::vector<Segment> spans;
  int64_t tokens = 0;
  int64_t trained_tokens = 0;
  int64_t seq_len = 0;  // tokens past it are cut (padded) or continue in the next row (packed)
};
absl::StatusOr<std::vector<DocumentPreview>> PreviewDocuments(const PrepareOptions& options, int64_t count);

enum class SpanMarks {
  kBrackets,  // trained runs between "[[" and "]]" (files, pipes)
  kColor,     // trained runs in green (ANSI escapes, for a terminal)
};
// One preview as text: a header line ("--- 1: data.jsonl:3 (sharegpt, qwen3 template): 40 tokens,
// 12 trained ---") and the document with its trained runs marked.
std::string FormatPreview(const DocumentPreview& preview, int64_t number, SpanMarks marks);

// One rendered document: token ids and per-token loss mask (exposed for tests and tools).
struct TokenizedDocument {
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> loss_mask;
};

// Tokenizes the concatenated segments in one pass (so tokens across segment borders are exactly
// what HF gives for the whole rendered string) and marks a token trained when its first byte
// lies in a trained segment. Each segment is NFC-normalized on its own when the tokenizer
// normalizes (identical to normalizing the whole text unless a segment starts with a combining
// mark; segment borders here follow "\n" or special tokens). The segments hold at most
// kMaxDocumentBytes in all (CHECK: Prepare refuses longer documents).
TokenizedDocument TokenizeSegments(const tok::Tokenizer& tokenizer, const std::vector<Segment>& segments);

}  // namespace slidedp::prepare
