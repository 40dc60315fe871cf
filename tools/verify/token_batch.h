// The token batch file the HF comparison (tools/verify/hf_compare.py) hands to model_grads, and
// its conversion into the worker's MicroBatch (worker/compute/backend.h).
//
// File format (JSON):
//   {"rows": [[id, id, ...], ...],            token ids per row, each in [0, vocab)
//    "doc_lens": [[len, len, ...], ...]}      optional: the packed documents of each row, in order;
//                                             they must sum to the row's length. Absent (or an
//                                             empty list for a row): the row is one document.
// Labels follow HF's causal-LM shift inside each document: position t predicts token t+1 of the
// same document; the last token of every document has no label (kIgnoreIndex). Positions restart
// at 0 per document and attention never crosses a document (cu_seqlens), exactly as a row of the
// pre-tokenized dataset with every token trained (common/data/micro_batch.h).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "worker/compute/backend.h"

namespace slidedp::verify {

struct TokenBatch {
  std::vector<std::vector<int32_t>> rows;
  std::vector<std::vector<int64_t>> doc_lens;  // one (possibly empty) list per row after parsing
};

// INVALID_ARGUMENT naming `where`, the row and the field for: bad JSON, no rows, an empty row,
// a negative id (ids >= vocab are rejected by the backend's UploadBatch, which knows the vocab),
// doc_lens of the wrong count, a non-positive length or lengths not summing to the row length.
absl::StatusOr<TokenBatch> ParseTokenBatch(absl::string_view json_text, const std::string& where);
absl::StatusOr<TokenBatch> ReadTokenBatchFile(const std::string& path);

// How rows become micro-batches: one micro-batch per row (gradients accumulate across them),
// or every row in one variable-length micro-batch.
enum class Grouping { kPerRow, kSingle };

// The micro-batches of `batch` under `grouping` (labels/positions/cu_seqlens as above).
std::vector<MicroBatch> BuildMicroBatches(const TokenBatch& batch, Grouping grouping);

}  // namespace slidedp::verify
