// Dataset rows -> MicroBatch (common/data/batch.h), what every compute backend uploads.
//
// Label convention (identical to HF causal-LM training with labels = input_ids and -100 where not
// trained, which shifts internally so position t predicts token t+1): within each document piece
// [b, e) of a row, labels[t] = tokens[t+1] if loss_mask[t+1] == 1, else kIgnoreIndex; the last
// position of every piece is kIgnoreIndex (nothing follows it inside the piece). Positions restart
// at 0 for every piece; cu_seqlens has one entry per piece. Rows are concatenated without padding:
// the micro-batch is variable-length (num_tokens = sum of row lengths).
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/data/batch.h"
#include "common/data/dataset.h"

namespace slidedp::data {

// INVALID_ARGUMENT for a row id outside the dataset; DATA_LOSS naming the file when the dataset was
// truncated or changed since it was opened (DatasetReader::ReadTokens, CheckUnchanged).
absl::StatusOr<MicroBatch> BuildMicroBatch(const DatasetReader& dataset, absl::Span<const int64_t> rows);

// Number of labels != kIgnoreIndex BuildMicroBatch would produce for these rows (for the
// global trained-token count that normalises the loss), without building the batch.
absl::StatusOr<int64_t> CountTrainedLabels(const DatasetReader& dataset, absl::Span<const int64_t> rows);

}  // namespace slidedp::data
