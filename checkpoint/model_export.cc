// ExportModel (`slidedp export`): a checkpoint's HF model directory without the optimizer state,
// written next to its destination and renamed into place (checkpoint.h).
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_files.h"
#include "common/io/json_depth.h"
#include "common/io/small_file.h"
#include "common/model/model_dir.h"
#include "common/numeric/finite.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;

constexpr char kTmpPrefix[] = ".tmp-export-";

// "job J" or "job J of run R" for a message.
std::string WhoseText(const std::string& job_id, const std::string& run_id) {
  if (job_id.empty() && run_id.empty()) return "no job";
  if (job_id.empty() || job_id == run_id) return absl::StrCat("job ", run_id);
  return absl::StrCat("job ", job_id, " of run ", run_id);
}

// One run's complete checkpoints under a directory (newest first) and the jobs that saved them.
struct RunCheckpoints {
  std::string run_id;
  std::vector<std::string> jobs;  // in the order first seen (newest first)
  std::vector<const CheckpointEntry*> entries;
  std::string newest;  // the newest that verifies; "" when none does
  int64_t newest_step = -1;
};

// "run R (jobs a, b): newest complete checkpoint D (step N)".
std::string DescribeRun(const RunCheckpoints& r) {
  const std::string who = r.run_id.empty() ? std::string("checkpoints naming no job")
                                           : absl::StrCat("run ", r.run_id, " (job", r.jobs.size() > 1 ? "s " : " ",
                                                          absl::StrJoin(r.jobs, ", "), ")");
  return absl::StrCat(who, ": newest complete checkpoint ", r.newest, " (step ", r.newest_step, ")");
}

// The checkpoint-<N> directory a request names: itself (of `run`, when given), or the newest
// complete one below it of its one run (or of `run`).
absl::StatusOr<std::string> ResolveCheckpoint(const std::string& path, const std::string& run) {
  std::error_code ec;
  if (!fs::is_directory(path, ec)) {
    return absl::NotFoundError(absl::StrCat("checkpoint ", path, " is not a directory"));
  }
  const fs::path p = fs::absolute(path).lexically_normal();
  const fs::path named = p.filename().empty() ? p.parent_path() : p;
  if (internal::StepOfDirName(named.filename().string()) >= 0) {
    RETURN_IF_ERROR(VerifyCheckpoint(named.string()).status());
    if (!run.empty()) {
      const absl::StatusOr<std::string> job = CheckpointJobId(named.string());
      const absl::StatusOr<std::string> owner = CheckpointRunId(named.string());
      const std::string job_id = job.ok() ? *job : "", run_id = owner.ok() ? *owner : "";
      if (job_id != run && run_id != run) {
        return absl::FailedPreconditionError(absl::StrCat("checkpoint ", named.string(), " was saved by ",
                                                          WhoseText(job_id, run_id), ", not by job or run ", run,
                                                          " (--job)"));
      }
    }
    return named.string();
  }
  ASSIGN_OR_RETURN(const std::vector<CheckpointEntry> entries, ListCheckpoints(named.string()));
  std::vector<RunCheckpoints> runs;  // in the order of their newest checkpoint
  for (const CheckpointEntry& e : entries) {
    if (!e.complete) continue;
    auto it = std::find_if(runs.begin(), runs.end(), [&](const RunCheckpoints& r) { return r.run_id == e.run_id; });
    if (it == runs.end()) it = runs.insert(runs.end(), RunCheckpoints{e.run_id, {}, {}, "", -1});
    if (!e.job_id.empty() && std::find(it->jobs.begin(), it->jobs.end(), e.job_id) == it->jobs.end()) {
      it->jobs.push_back(e.job_id);
    }
    if (run.empty() || e.job_id == run || e.run_id == run) it->entries.push_back(&e);
  }
  // Each run's newest checkpoint that verifies (sizes, safetensors headers).
  std::vector<const RunCheckpoints*> found;
  for (RunCheckpoints& r : runs) {
    for (const CheckpointEntry* e : r.entries) {
      absl::StatusOr<int64_t> ok = VerifyCheckpoint(e->dir);
      if (!ok.ok()) {
        LOG(WARNING) << "skipping checkpoint " << e->dir << ": " << ok.status();
        continue;
      }
      r.newest = e->dir;
      r.newest_step = e->step;
      break;
    }
    if (!r.newest.empty()) found.push_back(&r);
  }
  if (found.size() == 1) return found[0]->newest;
  std::vector<std::string> listed;
  for (const RunCheckpoints* r : found) listed.push_back(DescribeRun(*r));
  if (found.empty()) {
    if (run.empty()) return absl::NotFoundError(absl::StrCat("no complete checkpoint under ", named.string()));
    std::vector<std::string> others;
    for (const RunCheckpoints& r : runs) {
      others.push_back(r.run_id.empty() ? "checkpoints naming no job"
                                        : absl::StrCat("run ", r.run_id, " (job", r.jobs.size() > 1 ? "s " : " ",
                                                       absl::StrJoin(r.jobs, ", "), ")"));
    }
    return absl::NotFoundError(absl::StrCat("no complete checkpoint of job or run ", run, " under ", named.string(),
                                            others.empty() ? "" : "; it holds those of ", absl::StrJoin(others, "; ")));
  }
  // Several runs (only without --job: a run id or job id selects one run).
  return absl::FailedPreconditionError(
      absl::StrCat(named.string(), " holds the checkpoints of ", found.size(), " runs: ", absl::StrJoin(listed, "; "),
                   ". Choose one with --job ID (a job or run id above), or export a checkpoint-<N> directory itself"));
}

// Removes <parent>/.tmp-export-<name>-<pid> directories of processes that are gone.
void CleanStaleExports(const fs::path& parent, const std::string& name) {
  const std::string prefix = absl::StrCat(kTmpPrefix, name, "-");
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(parent, ec)) {
    const std::string n = entry.path().filename().string();
    int64_t pid = 0;
    if (!absl::StartsWith(n, prefix) || !absl::SimpleAtoi(n.substr(prefix.size()), &pid) || pid <= 0) continue;
    if (pid == ::getpid() || ::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) continue;
    LOG(INFO) << "removing stale partial export " << entry.path();
    std::error_code rec;
    fs::remove_all(entry.path(), rec);
  }
}

// What the destination is now.
enum class Destination { kAbsent, kEmptyDir, kModelDir, kOther };

absl::StatusOr<Destination> DestinationOf(const fs::path& out) {
  std::error_code ec;
  const fs::file_status s = fs::symlink_status(out, ec);
  if (ec && ec != std::errc::no_such_file_or_directory) {
    return ErrnoStatus(absl::StrCat("export: stat ", out.string()), ec.value());
  }
  if (!fs::exists(s)) return Destination::kAbsent;
  if (!fs::is_directory(s)) return Destination::kOther;
  if (fs::is_empty(out, ec)) return Destination::kEmptyDir;
  return fs::is_regular_file(fs::symlink_status(out / "config.json", ec)) ? Destination::kModelDir
                                                                          : Destination::kOther;
}

// --to's parent: an existing directory this process may create entries in. Checked before the
// checkpoint is read (access(2) reports a read-only file system as EROFS).
absl::Status CheckDestinationParent(const fs::path& parent) {
  struct stat st;
  if (::stat(parent.c_str(), &st) != 0)
    return internal::ExportDestinationErrno(absl::StrCat("stat ", parent.string()), parent.string(), errno);
  if (!S_ISDIR(st.st_mode)) {
    return absl::FailedPreconditionError(
        absl::StrCat("export: ", parent.string(), ", the directory --to would be made in, is not a directory"));
  }
  if (::faccessat(AT_FDCWD, parent.c_str(), W_OK | X_OK, AT_EACCESS) != 0) {
    return internal::ExportDestinationErrno(absl::StrCat("access ", parent.string()), parent.string(), errno);
  }
  return absl::OkStatus();
}

// The checkpoint's config.json for weights of `dtype`: its text as it is when the dtype is the
// checkpoint's, else with torch_dtype (and transformers 5's `dtype`, where present) changed.
absl::StatusOr<std::string> ExportedConfig(const std::string& text, const std::string& path, Dtype dtype) {
  const char* name = dtype == Dtype::kBF16 ? "bfloat16" : "float32";
  if (absl::Status deep = CheckJsonDepth(text, path); !deep.ok()) return absl::DataLossError(deep.message());
  nlohmann::ordered_json j = nlohmann::ordered_json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::DataLossError(absl::StrCat(path, ": not a JSON object"));
  if (j.contains("torch_dtype") && j["torch_dtype"] == name && (!j.contains("dtype") || j["dtype"] == name))
    return text;
  j["torch_dtype"] = name;
  if (j.contains("dtype")) j["dtype"] = name;
  return j.dump(2) + "\n";
}

// The FP32 master of every unit, checked: present as F32 [numel], 4-byte aligned in the mapping
// (a hostile header may place it anywhere), finite.
absl::StatusOr<std::vector<const float*>> MasterArrays(const st::SafetensorsFile& file, const ModelLayout& layout) {
  auto sig = file.metadata().find("layout");
  if (sig == file.metadata().end() || sig->second != internal::LayoutSignature(layout)) {
    return absl::DataLossError(absl::StrCat(
        file.path(), ": its unit layout is not the one its config.json gives (the checkpoint is damaged)"));
  }
  std::vector<const float*> masters;
  for (const UnitLayout& unit : layout.units) {
    const std::string name = internal::StateTensorName(unit, "master");
    const st::TensorInfo* t = file.Find(name);
    if (t == nullptr || t->dtype != st::Dtype::kF32 || t->shape != std::vector<int64_t>{unit.numel}) {
      return absl::DataLossError(absl::StrCat(file.path(), ": tensor \"", name, "\" is ",
                                              t == nullptr ? "missing" : "not F32 of the unit's size", " (F32 [",
                                              unit.numel, "] expected)"));
    }
    const char* bytes = file.Bytes(*t).data();
    if (reinterpret_cast<uintptr_t>(bytes) % alignof(float) != 0) {
      return absl::DataLossError(absl::StrCat(file.path(), ": tensor \"", name, "\" is not 4-byte aligned"));
    }
    const float* master = reinterpret_cast<const float*>(bytes);
    for (const TensorSlot& slot : unit.tensors) {
      if (const int64_t bad = FirstNonFinite(master + slot.offset_numel, slot.numel); bad >= 0) {
        return absl::DataLossError(
            absl::StrCat(file.path(), ": tensor \"", name, "\" holds ", master[slot.offset_numel + bad], " at ",
                         DescribeUnitElement(unit, slot.offset_numel + bad), "; exported weights must be finite"));
      }
    }
    masters.push_back(master);
  }
  return masters;
}

}  // namespace

absl::StatusOr<ExportResult> ExportModel(const ExportRequest& req) {
  if (req.out_dir.empty()) return absl::InvalidArgumentError("export: no destination directory");
  if (req.shard_max_bytes == 0) return absl::InvalidArgumentError("export: the shard size must be positive");
  ASSIGN_OR_RETURN(const std::string ckpt, ResolveCheckpoint(req.checkpoint, req.run));
  const fs::path out = fs::absolute(req.out_dir).lexically_normal();
  const fs::path out_dir = out.filename().empty() ? out.parent_path() : out;
  const fs::path parent = out_dir.parent_path();
  RETURN_IF_ERROR(CheckDestinationParent(parent));

  // The destination, checked before any work (and again by the rename itself).
  ASSIGN_OR_RETURN(const Destination existing, DestinationOf(out_dir));
  if (existing == Destination::kOther) {
    return absl::FailedPreconditionError(absl::StrCat("export: ", out_dir.string(),
                                                      " exists and is not a model directory (no config.json) or an "
                                                      "empty directory; choose another --to"));
  }
  if (existing == Destination::kModelDir) {
    if (req.existing != ExportRequest::Existing::kReplace) {
      return absl::FailedPreconditionError(
          absl::StrCat("export: ", out_dir.string(), " exists and is not empty; give --force to replace it"));
    }
    std::error_code ec;
    const fs::path real_out = fs::canonical(out_dir, ec);
    const fs::path real_ckpt = fs::canonical(ckpt, ec);
    const std::string o = real_out.string() + "/";
    if (real_out == real_ckpt || absl::StartsWith(real_ckpt.string() + "/", o)) {
      return absl::FailedPreconditionError(
          absl::StrCat("export: ", out_dir.string(), " is or holds the checkpoint ", ckpt, "; it is not replaced"));
    }
  }

  // The checkpoint: config, master, dtype, tokenizer files.
  const std::string config_path = ckpt + "/config.json";
  ASSIGN_OR_RETURN(const std::string config_text, ReadSmallFile(config_path, kMaxConfigFileBytes, "model config"));
  absl::StatusOr<ModelConfig> config = ModelConfig::FromJson(config_text);
  if (!config.ok()) return Annotate(config.status(), config_path);
  // The names the checkpoint's weights give (experts fused or per expert, gemma3's hub spelling).
  RETURN_IF_ERROR(AdoptDirNaming(ckpt, &*config));
  const ModelLayout layout = ModelLayout::Build(*config);
  ASSIGN_OR_RETURN(nlohmann::json state, internal::ReadJsonObject(ckpt + "/trainer_state.json"));
  if (state.contains("weights_dtype") && !state["weights_dtype"].is_string()) {
    return absl::DataLossError(absl::StrCat(ckpt, "/trainer_state.json: weights_dtype is not a string"));
  }
  Dtype dtype = state.contains("weights_dtype") && state["weights_dtype"] == "float32" ? Dtype::kF32 : Dtype::kBF16;
  if (req.dtype) dtype = *req.dtype;
  ASSIGN_OR_RETURN(auto optimizer, st::SafetensorsFile::Open(ckpt + "/optimizer.safetensors"));
  ASSIGN_OR_RETURN(std::vector<const float*> masters, MasterArrays(*optimizer, layout));
  RETURN_IF_ERROR(optimizer->Intact());
  ASSIGN_OR_RETURN(std::vector<ModelDirFile> model_files, ReadModelDirFiles(ckpt));
  ASSIGN_OR_RETURN(const std::string config_json, ExportedConfig(config_text, config_path, dtype));
  // The checkpoint's pass-through tensors (a qwen3_5 vision tower, mtp.*), from its weight files.
  ASSIGN_OR_RETURN(const PassThrough pass_through, ReadPassThrough(ckpt, *config));
  const std::vector<internal::PlannedFile> weights = internal::PlanWeightFiles(
      layout, [&masters](int unit) { return masters[unit]; }, dtype, req.shard_max_bytes, &pass_through);

  // Space for all of it (an export replaced with --force is removed only after), 1 MiB of slack
  // per file as a save allows.
  uint64_t needed = config_json.size() + (uint64_t{1} << 20) * (weights.size() + model_files.size() + 3);
  for (const auto& f : weights) needed += f.data_bytes();
  for (const ModelDirFile& f : model_files) needed += f.content.size();
  struct statvfs vfs {};
  if (::statvfs(parent.c_str(), &vfs) == 0) {
    const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
    if (free_bytes < needed) {
      return absl::ResourceExhaustedError(absl::StrCat("export: writing ", out_dir.string(), " needs about ", needed,
                                                       " bytes but the file system of ", parent.string(), " has ",
                                                       free_bytes, " bytes free"));
    }
  }

  std::error_code ec;
  const std::string name = out_dir.filename().string();
  CleanStaleExports(parent, name);
  const fs::path tmp = parent / absl::StrCat(kTmpPrefix, name, "-", ::getpid());
  fs::remove_all(tmp, ec);
  if (::mkdir(tmp.c_str(), 0755) != 0)
    return internal::ExportDestinationErrno(absl::StrCat("create ", tmp.string()), parent.string(), errno);
  auto abandon = [&](const absl::Status& s) {
    std::error_code rec;
    fs::remove_all(tmp, rec);
    return Annotate(s, absl::StrCat("exporting ", ckpt, " to ", out_dir.string()));
  };

  ExportResult result;
  result.checkpoint = ckpt;
  result.step = internal::StepOfDirName(fs::path(ckpt).filename().string());
  result.dir = out_dir.string();
  result.dtype = dtype;
  absl::Status written = internal::WriteSmallFile((tmp / "config.json").string(), config_json);
  if (!written.ok()) return abandon(written);
  absl::StatusOr<uint64_t> weight_bytes = internal::WriteWeightFiles(tmp.string(), weights, req.io_threads);
  if (!weight_bytes.ok()) return abandon(weight_bytes.status());
  // The masters were read through the mapping: a checkpoint truncated meanwhile read zeros.
  if (absl::Status intact = optimizer->Intact(); !intact.ok()) return abandon(intact);
  absl::StatusOr<uint64_t> side_bytes = internal::WriteModelDirFiles(tmp.string(), &model_files, config_json);
  if (!side_bytes.ok()) return abandon(side_bytes.status());
  result.bytes_written = config_json.size() + *weight_bytes + *side_bytes;
  written = internal::FsyncPath(tmp.string(), O_RDONLY | O_DIRECTORY);
  if (!written.ok()) return abandon(written);
  for (const auto& entry : fs::directory_iterator(tmp, ec)) result.files.push_back(entry.path().filename().string());
  std::sort(result.files.begin(), result.files.end());

  // Into place: a rename (onto nothing or an empty directory), or an exchange with the model
  // directory it replaces, which then goes; either way the destination is whole at every moment.
  absl::StatusOr<Destination> now = DestinationOf(out_dir);
  if (!now.ok()) return abandon(now.status());
  if (*now == Destination::kModelDir && req.existing == ExportRequest::Existing::kReplace) {
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, out_dir.c_str(), RENAME_EXCHANGE) != 0) {
      return abandon(internal::ExportDestinationErrno(
          absl::StrCat("exchange ", tmp.string(), " with ", out_dir.string()), parent, errno));
    }
    result.replaced = true;
    fs::remove_all(tmp, ec);  // the replaced directory
    if (ec) LOG(WARNING) << "export: removing the replaced " << tmp << ": " << ec.message();
  } else if (::rename(tmp.c_str(), out_dir.c_str()) != 0) {
    const int err = errno;
    if (err == ENOTEMPTY || err == EEXIST || err == ENOTDIR) {
      return abandon(absl::FailedPreconditionError(
          absl::StrCat("export: ", out_dir.string(), " appeared or changed while exporting; nothing was replaced")));
    }
    return abandon(internal::ExportDestinationErrno(absl::StrCat("rename ", tmp.string(), " to ", out_dir.string()),
                                                    parent.string(), err));
  }
  RETURN_IF_ERROR(internal::FsyncPath(parent.string(), O_RDONLY | O_DIRECTORY));
  LOG(INFO) << "exported " << ckpt << " to " << result.dir << ": " << result.bytes_written << " bytes";
  return result;
}

}  // namespace slidedp::checkpoint
