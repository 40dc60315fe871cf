#include "worker/pipeline/step_data.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "common/data/context_parallel.h"
#include "common/data/validation.h"
#include "common/status/status_macros.h"

namespace slidedp {
namespace {

// Reads the files hostd verified as it saw them: no checksums, no second scan per rank; rows are
// read with pread (a truncation mid-job is DATA_LOSS, not SIGBUS).
absl::StatusOr<std::unique_ptr<data::DatasetReader>> OpenVerified(const std::string& path,
                                                                  const std::vector<data::FileIdentity>& files) {
  data::ReaderOptions dopt;
  dopt.verify_checksums = data::VerifyChecksums::kNo;
  dopt.expected_files = files;
  return data::DatasetReader::Open(path, dopt);
}

absl::Status CheckFileCount(const std::vector<data::FileIdentity>& files, const char* what) {
  if (files.size() == static_cast<size_t>(data::kNumBinFiles)) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("assignment lists ", files.size(), " ", what, " files, not ", data::kNumBinFiles));
}

}  // namespace

ContextPlace ContextPlace::Of(int rank, int world, int context_parallel) {
  ContextPlace c;
  c.ranks = std::max(1, context_parallel);
  c.rank = rank % c.ranks;
  c.dp_rank = rank / c.ranks;
  c.dp_world = std::max(1, world / c.ranks);
  return c;
}

absl::StatusOr<MicroBatch> ContextPlace::Share(MicroBatch mb) const {
  if (ranks == 1) return mb;
  ASSIGN_OR_RETURN(data::ContextShard share, data::ContextShareOf(mb, ranks, rank));
  return std::move(share.local);
}

absl::StatusOr<std::unique_ptr<StepData>> StepData::Open(const std::string& path,
                                                         const std::vector<data::FileIdentity>& files,
                                                         int64_t global_batch, int64_t micro_batch, uint64_t seed,
                                                         ContextPlace place) {
  if (!files.empty()) RETURN_IF_ERROR(CheckFileCount(files, "dataset"));
  ASSIGN_OR_RETURN(auto dataset, OpenVerified(path, files));
  ASSIGN_OR_RETURN(auto sampler,
                   data::GlobalBatchSampler::Create(dataset->num_rows(), global_batch, place.dp_world, seed));
  return std::unique_ptr<StepData>(new StepData(std::move(dataset), std::move(sampler), micro_batch, place));
}

absl::StatusOr<StepBatch> StepData::Batch(int64_t step) const {
  StepBatch b;
  const std::vector<int64_t> rows = sampler_.RankRows(step, place_.dp_rank);
  for (size_t i = 0; i < rows.size(); i += micro_batch_) {
    const size_t n = std::min<size_t>(micro_batch_, rows.size() - i);
    absl::StatusOr<MicroBatch> mb = data::BuildMicroBatch(*dataset_, absl::MakeConstSpan(rows.data() + i, n));
    if (mb.ok()) mb = place_.Share(std::move(*mb));
    if (!mb.ok()) return Annotate(mb.status(), absl::StrCat("step ", step + 1));
    b.micro_batches.push_back(std::move(*mb));
  }
  const std::vector<int64_t> global_rows = sampler_.GlobalRows(step);
  absl::StatusOr<int64_t> trained = data::CountTrainedLabels(*dataset_, global_rows);
  if (!trained.ok()) return Annotate(trained.status(), absl::StrCat("step ", step + 1));
  b.trained_tokens = *trained;
  b.loss_scale = b.trained_tokens > 0 ? 1.0f / static_cast<float>(b.trained_tokens) : 0.0f;
  return b;
}

absl::StatusOr<ValidationShare> OpenValidation(const std::string& path, const std::vector<data::FileIdentity>& files,
                                               int64_t global_batch, int64_t micro_batch, ContextPlace place) {
  ValidationShare v;
  if (path.empty()) return v;
  RETURN_IF_ERROR(CheckFileCount(files, "validation"));
  ASSIGN_OR_RETURN(auto dataset, OpenVerified(path, files));
  const int64_t rows = dataset->num_rows();
  v.micro_batches_total = data::ValidationMicroBatches(rows, micro_batch);
  for (int64_t k : data::RankValidationMicroBatches(v.micro_batches_total, place.dp_rank, place.dp_world)) {
    const std::vector<int64_t> r = data::ValidationRows(k, rows, micro_batch);
    absl::StatusOr<MicroBatch> mb = data::BuildMicroBatch(*dataset, r);
    if (mb.ok()) mb = place.Share(std::move(*mb));
    if (!mb.ok()) return Annotate(mb.status(), absl::StrCat("validation micro-batch ", k));
    v.micro_batches.push_back(std::move(*mb));
  }
  // As many at once as a training step holds on this rank: the pass fits where the step did.
  v.per_sweep = static_cast<int>(std::max<int64_t>(1, global_batch / place.dp_world / micro_batch));
  v.sweeps = data::ValidationSweeps(v.micro_batches_total, place.dp_world, v.per_sweep);
  return v;
}

}  // namespace slidedp
