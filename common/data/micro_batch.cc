// Builds MicroBatch tokens/labels/positions/cu_seqlens from dataset rows.
#include "common/data/micro_batch.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace slidedp::data {
namespace {

absl::Status CheckRows(const DatasetReader& dataset, absl::Span<const int64_t> rows) {
  for (int64_t r : rows) {
    if (r < 0 || r >= dataset.num_rows()) {
      return absl::InvalidArgumentError(
          absl::StrCat("row ", r, " is outside dataset ", dataset.dir(), " of ", dataset.num_rows(), " rows"));
    }
  }
  if (rows.empty()) return absl::InvalidArgumentError("a micro-batch needs at least one row");
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<MicroBatch> BuildMicroBatch(const DatasetReader& dataset, absl::Span<const int64_t> rows) {
  if (absl::Status s = CheckRows(dataset, rows); !s.ok()) return s;
  const auto tokens = dataset.tokens();
  const auto mask = dataset.loss_mask();
  MicroBatch mb;
  int64_t total = 0;
  for (int64_t r : rows) {
    const RowSegment row = dataset.Row(r);
    total += row.end - row.begin;
  }
  mb.tokens.reserve(total);
  mb.labels.reserve(total);
  mb.positions.reserve(total);
  mb.cu_seqlens.push_back(0);
  for (int64_t r : rows) {
    for (const RowSegment& seg : dataset.RowSegments(r)) {
      for (int64_t t = seg.begin; t < seg.end; ++t) {
        mb.tokens.push_back(static_cast<int32_t>(tokens[t]));
        mb.positions.push_back(static_cast<int32_t>(t - seg.begin));
        const bool trained_next = t + 1 < seg.end && mask[t + 1] != 0;
        mb.labels.push_back(trained_next ? static_cast<int32_t>(tokens[t + 1]) : kIgnoreIndex);
      }
      mb.cu_seqlens.push_back(static_cast<int32_t>(mb.tokens.size()));
      mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(seg.end - seg.begin));
    }
  }
  return mb;
}

absl::StatusOr<int64_t> CountTrainedLabels(const DatasetReader& dataset, absl::Span<const int64_t> rows) {
  if (absl::Status s = CheckRows(dataset, rows); !s.ok()) return s;
  const auto mask = dataset.loss_mask();
  int64_t n = 0;
  for (int64_t r : rows) {
    for (const RowSegment& seg : dataset.RowSegments(r)) {
      for (int64_t t = seg.begin + 1; t < seg.end; ++t) n += mask[t] != 0 ? 1 : 0;
    }
  }
  return n;
}

}  // namespace slidedp::data
