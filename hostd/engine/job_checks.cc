// What a job's spec, model, dataset and output directory must be before it runs; see job_checks.h.
#include "hostd/engine/job_checks.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp::hostd {

// Optimizer steps of a job: train.steps, or train.epochs over the dataset's rows (rounded up).
int64_t StepsOf(const JobSpec& spec, int64_t num_rows) {
  if (spec.train.steps > 0) return spec.train.steps;
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(spec.train.epochs * num_rows / spec.train.global_batch)));
}

absl::StatusOr<update::LrSchedule> ScheduleOf(const JobSpec& spec, int64_t total_steps) {
  update::LrScheduleConfig sc;
  switch (spec.schedule.kind) {
    case ScheduleKind::kConstant: sc.kind = update::LrScheduleKind::kConstant; break;
    case ScheduleKind::kLinear: sc.kind = update::LrScheduleKind::kLinear; break;
    case ScheduleKind::kCosine: sc.kind = update::LrScheduleKind::kCosine; break;
  }
  sc.base_lr = spec.optimizer.lr;
  sc.warmup_steps = spec.schedule.warmup_steps;
  sc.total_steps = total_steps;
  sc.min_lr = spec.schedule.min_lr;
  return update::LrSchedule::Create(sc);
}

// A model directory names its weights: model.safetensors, or an index of shards that exist. Read at
// submit, so a directory of only config.json (or of PyTorch .bin files) is refused then; the
// tensors themselves are checked as they load.
absl::Status CheckModelWeightsPresent(const std::string& model_dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path dir(model_dir);
  if (fs::exists(dir / "model.safetensors", ec) || fs::exists(dir / "model.safetensors.index.json", ec)) {
    return absl::OkStatus();
  }
  const bool pytorch = fs::exists(dir / "pytorch_model.bin", ec) || fs::exists(dir / "pytorch_model.bin.index.json", ec);
  return absl::FailedPreconditionError(absl::StrCat(
      "model.path ", model_dir, " has no weights: neither model.safetensors nor model.safetensors.index.json",
      pytorch ? " (it has PyTorch .bin weights: save them as safetensors, e.g. "
                "AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True))"
              : " (download the whole model, not only its config)"));
}

// The model directory's tokenizer, to compare with the dataset's record of the one that made it;
// nullopt when there is none to compare with (a preset, a directory without tokenizer.json).
absl::StatusOr<std::optional<tok::TokenizerIdentity>> ModelTokenizerOf(const JobSpec& spec) {
  if (spec.model.path.empty() || !spec.data.tokenizer_check) return std::optional<tok::TokenizerIdentity>();
  absl::StatusOr<tok::TokenizerIdentity> id = tok::IdentifyTokenizer(spec.model.path);
  if (absl::IsNotFound(id.status())) return std::optional<tok::TokenizerIdentity>();
  if (!id.ok()) {
    return absl::FailedPreconditionError(
        absl::StrCat("data.tokenizer_check: cannot read the tokenizer of model.path ", spec.model.path,
                     " to compare it with the "
                     "dataset's: ",
                     id.status().message(), " (data.tokenizer_check: false trains without the check)"));
  }
  return std::optional<tok::TokenizerIdentity>(*std::move(id));
}

// The dataset `key` names was made with the model's tokenizer (manifest.json "source", written by
// `slidedp prepare`). FAILED_PRECONDITION naming both when not; a note (for the job log) when it
// cannot be told: a dataset without the record, a model without a tokenizer, or the check off.
absl::StatusOr<std::string> CheckDatasetTokenizer(const JobSpec& spec, absl::string_view key,
                                                  const std::string& path, const data::DatasetReader& dataset,
                                                  const std::optional<tok::TokenizerIdentity>& model) {
  if (!spec.data.tokenizer_check) {
    return absl::StrCat(key, ": data.tokenizer_check is false: its tokenizer is not compared with the model's");
  }
  if (!model) {  // a preset has no tokenizer; a model directory may lack tokenizer.json
    return spec.model.path.empty()
               ? std::string()
               : absl::StrCat(key, ": model.path has no tokenizer.json to compare the dataset's tokenizer with");
  }
  const std::optional<data::DatasetSource>& source = dataset.manifest().source;
  if (!source || source->tokenizer_fingerprint.empty()) {
    return absl::StrCat("warning: ", key, " ", path,
                        " does not record the tokenizer that made it (an older slidedp prepare, or made elsewhere): "
                        "not checked against the model's tokenizer");
  }
  if (source->tokenizer_fingerprint != model->fingerprint) {
    return absl::FailedPreconditionError(absl::StrCat(
        key, " ", path, " was tokenized by another tokenizer than the model's: the dataset's is ",
        source->tokenizer_fingerprint,
        source->model.empty() ? std::string() : absl::StrCat(" (from ", source->model, ")"), ", model.path ",
        spec.model.path, "'s is ", model->fingerprint, ". Prepare the data again with --model ", spec.model.path,
        ", or set data.tokenizer_check: false if the tokenizers are known to agree"));
  }
  return std::string();
}

// output.dir, checked at submit: a directory hostd may create files in, or one it can create
// below the nearest existing ancestor, which must then be such a directory. (The job creates it
// when it starts; nothing here may throw, whatever the path names.)
absl::Status CheckOutputDir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  for (fs::path probe = fs::path(dir).lexically_normal();; probe = probe.parent_path()) {
    const fs::file_status st = fs::status(probe, ec);
    if (ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory) {
      return absl::FailedPreconditionError(absl::StrCat("output.dir ", dir, ": ", probe.string(), ": ", ec.message()));
    }
    if (fs::exists(st)) {
      if (!fs::is_directory(st)) {
        return absl::FailedPreconditionError(
            absl::StrCat("output.dir ", dir, ": ", probe.string(), " is not a directory"));
      }
      if (::access(probe.c_str(), W_OK | X_OK) == 0) return absl::OkStatus();
      const int err = errno;
      const std::string why = absl::StrCat("output.dir ", dir, ": hostd cannot create files in ", probe.string(), " (",
                                           std::strerror(err), ")");
      return err == EACCES || err == EPERM ? absl::PermissionDeniedError(why) : absl::FailedPreconditionError(why);
    }
    if (!probe.has_parent_path() || probe.parent_path() == probe) {
      return absl::FailedPreconditionError(absl::StrCat("output.dir ", dir, ": no part of it exists"));
    }
  }
}

}  // namespace slidedp::hostd
