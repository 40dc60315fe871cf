// dump_batches: the exact global batches a job trains on, for the HF loss-curve reference
// (tools/verify/hf_train_reference.py, issue 4's GPU verification).
//
//   dump_batches --job JOB.yaml --out BATCHES.bin [--steps N] [--write-init DIR]
//   dump_batches --data DATASET_DIR --global-batch B --seed S --steps N --out BATCHES.bin
//
// Uses the trainer's own code (DatasetReader, GlobalBatchSampler, BuildMicroBatch), so the Python
// side never re-implements sampling or labelling. For each step t < N the file holds the whole
// global batch (all ranks' rows, in rank order) as one MicroBatch: tokens, labels (already
// shifted, -100 = not trained), positions and cu_seqlens (document pieces).
//
// File format: one line of JSON (the header, '\n'-terminated), then the data area. Header:
//   {"format": "slidedp-batches", "version": 1, "dataset": DIR, "num_rows": R,
//    "global_batch": B, "seed": S, "shuffle": true, "job": {...} | null, "model_dir": DIR | null,
//    "steps": [{"step": t, "epoch": e, "rows": [...], "row_tokens": [...], "num_tokens": T,
//               "num_segments": D, "trained_tokens": n, "offset": BYTES}, ...]}
// Step t's data starts `offset` bytes after the header line: int32 little-endian
// tokens[T], labels[T], positions[T], cu_seqlens[D + 1], back to back. "row_tokens" holds each
// row's token count (the rows lie back to back in that order; every row boundary is a piece
// boundary).
// "job" (with --job) carries the optimizer and schedule settings of the spec: lr, beta1, beta2,
// eps, weight_decay, no_decay (the groups exempt from decay: ["norm", "bias"] by default),
// max_grad_norm, schedule, warmup_steps, min_lr, steps, total_steps.
// --write-init DIR (jobs with model.preset): writes the job's random initial weights
// (InitRandom with model.init_seed, as hostd does) as an F32 HF directory, so HF starts from
// exactly our FP32 master; "model_dir" names it (or the job's model.path).
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "common/data/sampler.h"
#include "common/jobspec/job_spec.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "tools/verify/whole_model.h"

namespace slidedp::verify {
namespace {

namespace fs = std::filesystem;

struct Options {
  std::string job_path;
  std::string data_dir;
  int64_t global_batch = 0;
  uint64_t seed = 0;
  int64_t steps = 0;
  std::string out_path;
  std::string init_dir;
};

const char* ScheduleName(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kConstant: return "constant";
    case ScheduleKind::kLinear: return "linear";
    case ScheduleKind::kCosine: return "cosine";
  }
  return "constant";
}

// InitRandom(init_seed) as hostd does for a preset, written as an F32 HF model directory.
absl::Status WriteInitModel(const JobSpec& spec, const std::string& dir) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Preset(spec.model.preset));
  const ModelLayout layout = ModelLayout::Build(config);
  std::vector<std::vector<float>> master(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) master[u].assign(layout.units[u].numel, 0.0f);
  checkpoint::InitRandom(layout, spec.model.init_seed, [&](int u) { return master[u].data(); });
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return absl::InternalError(absl::StrCat("cannot create ", dir, ": ", ec.message()));
  config.torch_dtype = "float32";
  {
    std::ofstream f(dir + "/config.json");
    f << config.ToJson() << "\n";
    if (!f) return absl::InternalError(absl::StrCat("cannot write ", dir, "/config.json"));
  }
  std::vector<safetensors::TensorSource> tensors = HfTensorsF32(layout, master);
  safetensors::WriteOptions wo;
  wo.metadata = {{"format", "pt"}};
  return safetensors::WriteFile(dir + "/model.safetensors", tensors, wo).status();
}

absl::Status Run(Options o) {
  nlohmann::json job = nullptr;
  nlohmann::json model_dir = nullptr;
  if (!o.job_path.empty()) {
    std::ifstream in(o.job_path);
    if (!in) return absl::NotFoundError(absl::StrCat("cannot open job spec ", o.job_path));
    std::stringstream text;
    text << in.rdbuf();
    const std::string base = fs::absolute(fs::path(o.job_path)).parent_path().string();
    ASSIGN_OR_RETURN(JobSpec spec, JobSpec::Parse(text.str(), base, JobSpec::FileCheck::kSkip));
    if (o.data_dir.empty()) o.data_dir = spec.data.path;
    if (o.global_batch == 0) o.global_batch = spec.train.global_batch;
    o.seed = spec.train.seed;
    if (o.steps == 0) o.steps = spec.train.steps;
    nlohmann::json no_decay = nlohmann::json::array();
    for (NoDecay g : spec.optimizer.no_decay) no_decay.push_back(ToString(g));
    job = {{"name", spec.name},
           {"lr", spec.optimizer.lr},
           {"beta1", spec.optimizer.beta1},
           {"beta2", spec.optimizer.beta2},
           {"eps", spec.optimizer.eps},
           {"weight_decay", spec.optimizer.weight_decay},
           {"no_decay", no_decay},
           {"max_grad_norm", spec.train.max_grad_norm},
           {"schedule", ScheduleName(spec.schedule.kind)},
           {"warmup_steps", spec.schedule.warmup_steps},
           {"min_lr", spec.schedule.min_lr},
           {"steps", spec.train.steps},
           {"total_steps", std::max<int64_t>(spec.train.steps, 1)},
           {"seq_len", spec.train.seq_len},
           {"micro_batch", spec.train.micro_batch},
           {"model_path", spec.model.path},
           {"model_preset", spec.model.preset},
           {"init_seed", spec.model.init_seed}};
    if (!spec.model.path.empty()) model_dir = spec.model.path;
    if (!o.init_dir.empty()) {
      if (spec.model.preset.empty()) {
        return absl::InvalidArgumentError(absl::StrCat("--write-init: the job loads ", spec.model.path,
                                                       " (no model.preset); give HF that directory instead"));
      }
      RETURN_IF_ERROR(WriteInitModel(spec, o.init_dir));
      model_dir = fs::absolute(o.init_dir).string();
    }
  } else if (!o.init_dir.empty()) {
    return absl::InvalidArgumentError("--write-init needs --job (the preset and init_seed come from the spec)");
  }
  if (o.data_dir.empty() || o.global_batch <= 0 || o.steps <= 0) {
    return absl::InvalidArgumentError("need a dataset, a global batch > 0 and steps > 0 (--job or the flags)");
  }
  ASSIGN_OR_RETURN(auto dataset, data::DatasetReader::Open(o.data_dir));
  ASSIGN_OR_RETURN(auto sampler, data::GlobalBatchSampler::Create(dataset->num_rows(), o.global_batch, 1, o.seed));

  std::string data;
  nlohmann::json steps = nlohmann::json::array();
  auto append = [&data](const std::vector<int32_t>& v) {
    data.append(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(int32_t));  // little-endian host
  };
  for (int64_t t = 0; t < o.steps; ++t) {
    const std::vector<int64_t> rows = sampler.GlobalRows(t);
    ASSIGN_OR_RETURN(MicroBatch mb, data::BuildMicroBatch(*dataset, rows));
    ASSIGN_OR_RETURN(int64_t trained, data::CountTrainedLabels(*dataset, rows));
    if (trained != mb.num_trained()) {
      return absl::InternalError(absl::StrCat("step ", t, ": CountTrainedLabels says ", trained, ", the batch has ",
                                              mb.num_trained()));
    }
    std::vector<int64_t> row_tokens;
    for (int64_t r : rows) {
      const data::RowSegment row = dataset->Row(r);
      row_tokens.push_back(row.end - row.begin);
    }
    steps.push_back({{"step", t},
                     {"epoch", sampler.EpochOfStep(t)},
                     {"rows", rows},
                     {"row_tokens", row_tokens},
                     {"num_tokens", mb.num_tokens()},
                     {"num_segments", mb.cu_seqlens.size() - 1},
                     {"trained_tokens", trained},
                     {"offset", data.size()}});
    append(mb.tokens);
    append(mb.labels);
    append(mb.positions);
    append(mb.cu_seqlens);
  }
  nlohmann::json header = {{"format", "slidedp-batches"},
                           {"version", 1},
                           {"dataset", fs::absolute(o.data_dir).string()},
                           {"num_rows", dataset->num_rows()},
                           {"global_batch", o.global_batch},
                           {"seed", o.seed},
                           {"shuffle", true},
                           {"job", job},
                           {"model_dir", model_dir},
                           {"steps", steps}};
  std::ofstream out(o.out_path, std::ios::binary | std::ios::trunc);
  if (!out) return absl::NotFoundError(absl::StrCat("cannot create ", o.out_path));
  out << header.dump() << "\n";
  out.write(data.data(), static_cast<std::streamsize>(data.size()));
  out.close();
  if (!out) return absl::InternalError(absl::StrCat("writing ", o.out_path, " failed"));
  std::cout << nlohmann::json({{"out", o.out_path}, {"steps", o.steps}, {"bytes", data.size()},
                               {"model_dir", model_dir}})
                   .dump()
            << std::endl;
  return absl::OkStatus();
}

}  // namespace
}  // namespace slidedp::verify

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  slidedp::verify::Options o;
  CLI::App app{"Dump a job's global batches (tokens, labels, positions, cu_seqlens) for the HF reference"};
  app.add_option("--job", o.job_path, "job spec YAML (dataset, global batch, seed, steps, optimizer)");
  app.add_option("--data", o.data_dir, "dataset directory (overrides the job's)");
  app.add_option("--global-batch", o.global_batch, "rows per step (overrides the job's)");
  app.add_option("--seed", o.seed, "data-order seed (without --job)");
  app.add_option("--steps", o.steps, "number of steps to dump (default: the job's train.steps)");
  app.add_option("--out", o.out_path, "output file")->required();
  app.add_option("--write-init", o.init_dir, "write the job's random initial weights here as an F32 HF dir");
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = slidedp::verify::Run(o);
  if (!s.ok()) {
    std::cerr << "dump_batches: " << s << std::endl;
    return 1;
  }
  return 0;
}
