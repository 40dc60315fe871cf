// Builds MicroBatch tokens/labels/positions/cu_seqlens from dataset rows.
#include "common/data/micro_batch.h"

#include <algorithm>
#include <vector>

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
  // One pread of each file per row (rows are at most seq_len tokens), then the identity check:
  // the batch was read from the bytes the job verified, or the job fails with DATA_LOSS.
  std::vector<uint32_t> tokens;
  std::vector<uint8_t> mask;
  for (int64_t r : rows) {
    const RowSegment row = dataset.Row(r);
    tokens.resize(row.end - row.begin);
    mask.resize(row.end - row.begin);
    if (absl::Status s = dataset.ReadTokens(row.begin, row.end, tokens.data(), mask.data()); !s.ok()) return s;
    for (const RowSegment& seg : dataset.RowSegments(r)) {
      for (int64_t t = seg.begin; t < seg.end; ++t) {
        const int64_t i = t - row.begin;
        mb.tokens.push_back(static_cast<int32_t>(tokens[i]));
        mb.positions.push_back(static_cast<int32_t>(t - seg.begin));
        const bool trained_next = t + 1 < seg.end && mask[i + 1] != 0;
        mb.labels.push_back(trained_next ? static_cast<int32_t>(tokens[i + 1]) : kIgnoreIndex);
      }
      mb.cu_seqlens.push_back(static_cast<int32_t>(mb.tokens.size()));
      mb.max_seqlen = std::max<int32_t>(mb.max_seqlen, static_cast<int32_t>(seg.end - seg.begin));
    }
  }
  if (absl::Status s = dataset.CheckUnchanged(); !s.ok()) return s;
  return mb;
}

absl::StatusOr<int64_t> CountTrainedLabels(const DatasetReader& dataset, absl::Span<const int64_t> rows) {
  if (absl::Status s = CheckRows(dataset, rows); !s.ok()) return s;
  int64_t n = 0;
  std::vector<uint8_t> mask;
  for (int64_t r : rows) {
    const RowSegment row = dataset.Row(r);
    mask.resize(row.end - row.begin);
    if (absl::Status s = dataset.ReadTokens(row.begin, row.end, nullptr, mask.data()); !s.ok()) return s;
    for (const RowSegment& seg : dataset.RowSegments(r)) {
      for (int64_t t = seg.begin + 1; t < seg.end; ++t) n += mask[t - row.begin] != 0 ? 1 : 0;
    }
  }
  if (absl::Status s = dataset.CheckUnchanged(); !s.ok()) return s;
  return n;
}

}  // namespace slidedp::data
