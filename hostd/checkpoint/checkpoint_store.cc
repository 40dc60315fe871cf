// Atomic save, verification, discovery and restore of training checkpoints (exact, or converting
// the Adam moments to the job's state dtype). The on-disk layout and the atomicity protocol are
// described in checkpoint.h.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/io/small_file.h"
#include "common/numeric/bf16.h"
#include "common/numeric/finite.h"
#include "common/parallel/parallel_for.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/checkpoint/checkpoint.h"
#include "hostd/checkpoint/checkpoint_files.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;
using internal::FsyncPath;
using internal::kDirPrefix;
using internal::kFormat;
using internal::LayoutSignature;
using internal::PlannedFile;
using internal::ReadJsonObject;
using internal::StateTensorName;
using internal::StepOfDirName;
using internal::WriteSmallFile;
using update::StateDtype;

constexpr char kTmpPrefix[] = ".tmp-checkpoint-";
constexpr char kTrashPrefix[] = ".trash-checkpoint-";
constexpr int kFormatVersion = 1;
// optimizer.safetensors __metadata__ key of the moments' dtype; absent means fp32 (and keeps an
// fp32 job's file what it was before compact moments existed).
constexpr char kStateDtypeKey[] = "state_dtype";
constexpr int64_t kBlock = update::kInt8StateBlock;

// Removes a directory tree, first renaming it out of the checkpoint namespace so a crash during
// removal never leaves a half-deleted checkpoint-<N>.
void RemoveCheckpointDir(const fs::path& dir, const fs::path& root) {
  fs::path trash = root / absl::StrCat(kTrashPrefix, dir.filename().string(), "-", ::getpid());
  std::error_code ec;
  fs::rename(dir, trash, ec);
  fs::remove_all(ec ? dir : trash, ec);
  if (ec) LOG(WARNING) << "removing " << dir << ": " << ec.message();
}

// Who `e` names as its saver, for a message: "job J (run R)", "job J", or what it is.
std::string DescribeOwner(const CheckpointEntry& e, bool is_directory) {
  if (!is_directory) return "is not a directory (a file, a symbolic link or another kind of entry)";
  if (e.job_id.empty() && e.run_id.empty()) return "names no job (its trainer_state.json is missing or unreadable)";
  if (e.job_id == e.run_id || e.job_id.empty()) return absl::StrCat("belongs to job ", e.run_id);
  return absl::StrCat("belongs to job ", e.job_id, " of run ", e.run_id);
}

// Whether the entry `name` of the root (holding step `step`) may be replaced by a save of run
// `own`: a directory of the same run. FAILED_PRECONDITION naming `shown` (the path the user
// knows it by) and its owner otherwise; OK when there is no such entry.
absl::Status CheckReplaceable(int root_fd, const fs::path& root, const std::string& name, int64_t step,
                              const std::string& own, const fs::path& shown) {
  struct stat st;
  if (::fstatat(root_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) != 0) {
    return errno == ENOENT ? absl::OkStatus() : ErrnoStatus(absl::StrCat("stat ", shown.string()), errno);
  }
  bool is_directory = false;
  ASSIGN_OR_RETURN(const CheckpointEntry e,
                   internal::ExamineCheckpointEntry(root_fd, root.string(), name, step, nullptr, &is_directory));
  if (is_directory && e.run_id == own) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      shown.string(), " already exists and ", DescribeOwner(e, is_directory), "; this job's run is ",
      own.empty() ? "unnamed" : own, ", so it is left as it is. Give the job an output.dir of its own, or move ",
      shown.string(), " away (output.overwrite: true moves other runs' checkpoints aside)"));
}

// Removes tmp/trash directories left by dead processes (or by this one).
void CleanStaleDirs(const fs::path& root) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root, ec)) {
    const std::string name = entry.path().filename().string();
    if (!absl::StartsWith(name, kTmpPrefix) && !absl::StartsWith(name, kTrashPrefix)) continue;
    int64_t pid = 0;
    const size_t dash = name.rfind('-');
    if (dash == std::string::npos || !absl::SimpleAtoi(name.substr(dash + 1), &pid) || pid <= 0) continue;
    const bool alive = pid != ::getpid() && (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH);
    if (alive) continue;
    LOG(INFO) << "removing stale partial checkpoint " << entry.path();
    std::error_code rec;
    fs::remove_all(entry.path(), rec);
  }
}

// How optimizer.safetensors stores m and v for each state dtype, and their element bytes.
st::Dtype FileDtypeOfM(StateDtype d) {
  switch (d) {
    case StateDtype::kFp32: return st::Dtype::kF32;
    case StateDtype::kBf16: return st::Dtype::kBF16;
    case StateDtype::kInt8: return st::Dtype::kI8;
  }
  return st::Dtype::kF32;
}
st::Dtype FileDtypeOfV(StateDtype d) { return d == StateDtype::kInt8 ? st::Dtype::kU8 : FileDtypeOfM(d); }
size_t MomentElementBytes(StateDtype d) { return d == StateDtype::kFp32 ? 4 : d == StateDtype::kBf16 ? 2 : 1; }

bool IsKnownStateDtype(StateDtype d) {
  return d == StateDtype::kFp32 || d == StateDtype::kBf16 || d == StateDtype::kInt8;
}

// Whether an accessor's unit gives every array its dtype uses.
bool HasMomentArrays(StateDtype d, const UnitMoments& mo) {
  return mo.m != nullptr && mo.v != nullptr &&
         (d != StateDtype::kInt8 || (mo.m_scale != nullptr && mo.v_scale != nullptr));
}

absl::StatusOr<PlannedFile> PlanOptimizerFile(const SaveRequest& req) {
  const StateDtype dtype = req.arrays.moment_dtype;
  PlannedFile f;
  f.name = "optimizer.safetensors";
  f.metadata = {{"format", kFormat}, {"layout", LayoutSignature(*req.layout)}};
  if (dtype != StateDtype::kFp32) f.metadata[kStateDtypeKey] = update::StateDtypeName(dtype);
  for (const UnitLayout& unit : req.layout->units) {
    const float* master = req.arrays.master(unit.index);
    const UnitMoments mo = req.arrays.moments(unit.index);
    if (master == nullptr || !HasMomentArrays(dtype, mo)) {
      return absl::InvalidArgumentError(absl::StrCat("SaveCheckpoint: unit ", unit.name, " lacks its master or ",
                                                     update::StateDtypeName(dtype), " moment arrays"));
    }
    auto add = [&](const char* kind, st::Dtype t_dtype, int64_t numel, const void* data) {
      st::TensorSource t;
      t.name = StateTensorName(unit, kind);
      t.dtype = t_dtype;
      t.shape = {numel};
      t.data = data;
      f.tensors.push_back(std::move(t));
    };
    add("master", st::Dtype::kF32, unit.numel, master);
    add("adam_m", FileDtypeOfM(dtype), unit.numel, mo.m);
    add("adam_v", FileDtypeOfV(dtype), unit.numel, mo.v);
    if (dtype == StateDtype::kInt8) {
      add("adam_m_scale", st::Dtype::kF32, update::Int8StateBlocks(unit.numel), mo.m_scale);
      add("adam_v_scale", st::Dtype::kF32, update::Int8StateBlocks(unit.numel), mo.v_scale);
    }
  }
  return f;
}

absl::Status ValidateRequest(const SaveRequest& req) {
  if (req.layout == nullptr) return absl::InvalidArgumentError("SaveCheckpoint: layout is null");
  if (req.root_dir.empty()) return absl::InvalidArgumentError("SaveCheckpoint: root_dir is empty");
  if (req.step < 0) return absl::InvalidArgumentError(absl::StrCat("SaveCheckpoint: step ", req.step, " < 0"));
  if (!req.arrays.master || !req.arrays.moments) {
    return absl::InvalidArgumentError("SaveCheckpoint: the master and moments accessors are both required");
  }
  if (!IsKnownStateDtype(req.arrays.moment_dtype)) {
    return absl::InvalidArgumentError("SaveCheckpoint: moment_dtype is not fp32, bf16 or int8");
  }
  if (!req.trainer_state.is_object() && !req.trainer_state.is_null()) {
    return absl::InvalidArgumentError("SaveCheckpoint: trainer_state must be a JSON object");
  }
  if (req.shard_max_bytes == 0) return absl::InvalidArgumentError("SaveCheckpoint: shard_max_bytes is 0");
  return absl::OkStatus();
}

// Writes every file of the checkpoint into tmp; returns bytes written.
absl::StatusOr<uint64_t> WriteCheckpointFiles(const SaveRequest& req, const fs::path& tmp,
                                              const std::vector<PlannedFile>& weights, const PlannedFile& optimizer) {
  auto stage = [&](const std::string& name) -> absl::Status {
    return req.fault_hook ? req.fault_hook(name) : absl::OkStatus();
  };
  st::WriteOptions wopts;
  wopts.threads = std::max(1, req.io_threads);
  uint64_t bytes = 0;

  RETURN_IF_ERROR(stage("config.json"));
  const std::string config_json = internal::ConfigJsonFor(*req.layout, req.weight_dtype);
  RETURN_IF_ERROR(WriteSmallFile((tmp / "config.json").string(), config_json));
  bytes += config_json.size();

  RETURN_IF_ERROR(stage("model"));
  ASSIGN_OR_RETURN(const uint64_t weight_bytes, internal::WriteWeightFiles(tmp.string(), weights, req.io_threads));
  bytes += weight_bytes;

  RETURN_IF_ERROR(stage("optimizer.safetensors"));
  wopts.metadata = optimizer.metadata;
  ASSIGN_OR_RETURN(st::WriteStats os, st::WriteFile((tmp / optimizer.name).string(), optimizer.tensors, wopts));
  bytes += os.file_bytes;

  RETURN_IF_ERROR(stage("trainer_state.json"));
  nlohmann::json state = {
      {"format", kFormat},
      {"format_version", kFormatVersion},
      {"step", req.step},
      {"weights_dtype", req.weight_dtype == WeightDtype::kBF16 ? "bfloat16" : "float32"},
      {"trainer_state", req.trainer_state.is_null() ? nlohmann::json::object() : req.trainer_state}};
  RETURN_IF_ERROR(WriteSmallFile((tmp / "trainer_state.json").string(), state.dump(2) + "\n"));

  // What makes the directory one transformers loads whole: the model's tokenizer files and
  // generation_config.json (copied as they were read when the job started), else one made from
  // config.json's token ids.
  RETURN_IF_ERROR(stage("model_files"));
  ASSIGN_OR_RETURN(const uint64_t side_bytes, internal::WriteModelDirFiles(tmp.string(), req.model_files, config_json));
  bytes += side_bytes;

  RETURN_IF_ERROR(stage("COMPLETE"));
  nlohmann::json files = nlohmann::json::object();
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(tmp, ec)) {
    const uint64_t size = fs::file_size(entry.path(), ec);
    if (ec) return ErrnoStatus(absl::StrCat("stat ", entry.path().string()), ec.value());
    files[entry.path().filename().string()] = size;
  }
  if (ec) return ErrnoStatus(absl::StrCat("list ", tmp.string()), ec.value());
  RETURN_IF_ERROR(WriteSmallFile((tmp / "COMPLETE").string(),
                                 nlohmann::json({{"step", req.step}, {"files", files}}).dump(2) + "\n"));
  RETURN_IF_ERROR(FsyncPath(tmp.string(), O_RDONLY | O_DIRECTORY));
  return bytes;
}

}  // namespace

absl::StatusOr<SaveResult> SaveCheckpoint(const SaveRequest& req) {
  RETURN_IF_ERROR(ValidateRequest(req));
  ASSIGN_OR_RETURN(PlannedFile optimizer, PlanOptimizerFile(req));  // checks every unit's arrays first
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path root(req.root_dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return ErrnoStatus(absl::StrCat("create checkpoint root ", root.string()), ec.value());
  CleanStaleDirs(root);

  std::vector<PlannedFile> weights = internal::PlanWeightFiles(
      *req.layout, [&req](int unit) -> const float* { return req.arrays.master(unit); }, req.weight_dtype,
      req.shard_max_bytes);
  uint64_t needed = optimizer.data_bytes() + (uint64_t{1} << 20) * (weights.size() + 2);
  for (const auto& f : weights) needed += f.data_bytes();
  if (req.model_files != nullptr) {
    for (const ModelDirFile& f : *req.model_files) needed += f.content.size();
  }
  struct statvfs vfs {};
  if (::statvfs(root.c_str(), &vfs) == 0) {
    const uint64_t free_bytes = uint64_t{vfs.f_bavail} * vfs.f_frsize;
    if (free_bytes < needed) {
      return absl::ResourceExhaustedError(absl::StrCat("saving checkpoint-", req.step, " under ", root.string(),
                                                       " needs about ", needed, " bytes but its file system has ",
                                                       free_bytes, " bytes free; previous checkpoints are intact"));
    }
  }

  const fs::path tmp = root / absl::StrCat(kTmpPrefix, req.step, "-", ::getpid());
  const std::string final_name = absl::StrCat(kDirPrefix, req.step);
  const fs::path final_dir = root / final_name;
  const std::string own_run = RunIdOf(req.trainer_state);
  const int root_fd = ::open(root.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (root_fd < 0) return ErrnoStatus(absl::StrCat("open checkpoint root ", root.string()), errno);
  absl::Cleanup close_root = [root_fd] { ::close(root_fd); };
  // Another run's checkpoint of this step is refused before any byte is written (and checked
  // again after the exchange below, which is what decides).
  if (absl::Status mine = CheckReplaceable(root_fd, root, final_name, req.step, own_run, final_dir); !mine.ok()) {
    return Annotate(mine, absl::StrCat("saving checkpoint-", req.step, " under ", root.string()));
  }
  fs::remove_all(tmp, ec);
  if (!fs::create_directory(tmp, ec) || ec) {
    return ErrnoStatus(absl::StrCat("create ", tmp.string()), ec ? ec.value() : EEXIST);
  }
  auto abandon = [&](const absl::Status& s) {
    std::error_code rec;
    fs::remove_all(tmp, rec);
    return Annotate(s, absl::StrCat("saving checkpoint-", req.step, " under ", root.string()));
  };
  absl::StatusOr<uint64_t> bytes = WriteCheckpointFiles(req, tmp, weights, optimizer);
  if (!bytes.ok()) return abandon(bytes.status());
  if (req.fault_hook) {
    if (absl::Status s = req.fault_hook("rename"); !s.ok()) return abandon(s);
  }

  const std::string tmp_name = tmp.filename().string();
  int renamed = ::renameat2(root_fd, tmp_name.c_str(), root_fd, final_name.c_str(), RENAME_NOREPLACE);
  if (renamed != 0 && errno == EINVAL) {  // a file system without RENAME_NOREPLACE (NFS): check, then rename
    struct stat st;
    if (::fstatat(root_fd, final_name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0) {
      errno = EEXIST;
    } else {
      renamed = ::renameat(root_fd, tmp_name.c_str(), root_fd, final_name.c_str());
    }
  }
  if (renamed != 0) {
    if (errno != EEXIST) {
      return abandon(ErrnoStatus(absl::StrCat("rename ", tmp.string(), " to ", final_dir.string()), errno));
    }
    // Same step saved again: swap atomically; the old one, now at tmp, is dropped only when it is
    // this run's (it may have appeared since the check above), else swapped back.
    if (::renameat2(root_fd, tmp_name.c_str(), root_fd, final_name.c_str(), RENAME_EXCHANGE) != 0) {
      return abandon(ErrnoStatus(absl::StrCat("exchange ", tmp.string(), " with ", final_dir.string()), errno));
    }
    if (absl::Status mine = CheckReplaceable(root_fd, root, tmp_name, req.step, own_run, final_dir); !mine.ok()) {
      if (::renameat2(root_fd, tmp_name.c_str(), root_fd, final_name.c_str(), RENAME_EXCHANGE) != 0) {
        // Both are whole; the other run's one leaves the tmp name (which a later save would sweep
        // as stale) and the message says where it is, rather than anything being removed.
        const int err = errno;
        const std::string kept_name = absl::StrCat(final_name, ".kept-", ::getpid());
        const bool kept = ::renameat2(root_fd, tmp_name.c_str(), root_fd, kept_name.c_str(), RENAME_NOREPLACE) == 0;
        return Annotate(ErrnoStatus(absl::StrCat("exchanging back: ", mine.message(), "; it is now at ",
                                                     (root / (kept ? kept_name : tmp_name)).string(),
                                                     ", and this save at ", final_dir.string()),
                                        err),
                        absl::StrCat("saving checkpoint-", req.step, " under ", root.string()));
      }
      return abandon(mine);
    }
    fs::remove_all(tmp, ec);
  }
  RETURN_IF_ERROR(FsyncPath(root.string(), O_RDONLY | O_DIRECTORY));

  SaveResult result;
  result.dir = final_dir.string();
  result.bytes_written = *bytes;
  if (req.keep_last > 0) {
    // Only this run's own complete checkpoints: jobs sharing an output directory never prune
    // another run's (a checkpoint whose owner cannot be read counts as saved by run "", which
    // only a save naming no job shares).
    absl::StatusOr<std::vector<CheckpointEntry>> listed = ListCheckpoints(root.string());
    if (!listed.ok()) LOG(WARNING) << "keep_last: nothing removed: " << listed.status();
    std::vector<CheckpointEntry> own;  // newest first, as listed
    if (listed.ok()) {
      for (CheckpointEntry& e : *listed) {
        if (e.complete && e.step != req.step && e.run_id == own_run) own.push_back(std::move(e));
      }
    }
    // The checkpoint just written always counts as one of the kept.
    for (size_t i = static_cast<size_t>(req.keep_last) - 1; i < own.size(); ++i) {
      RemoveCheckpointDir(own[i].dir, root);
      result.removed.push_back(own[i].dir);
    }
  }
  result.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  LOG(INFO) << "saved " << result.dir << ": " << result.bytes_written << " bytes in " << result.seconds << " s ("
            << result.bytes_written / 1e9 / std::max(result.seconds, 1e-9) << " GB/s)";
  return result;
}

absl::StatusOr<int64_t> VerifyCheckpoint(const std::string& dir) {
  const fs::path path(dir);
  const int64_t step = StepOfDirName(path.filename().string());
  if (step < 0) return absl::InvalidArgumentError(absl::StrCat(dir, ": not a checkpoint-<step> directory"));
  auto complete = ReadJsonObject((path / "COMPLETE").string());
  if (!complete.ok()) {
    return absl::FailedPreconditionError(absl::StrCat(dir, ": incomplete (", complete.status().message(), ")"));
  }
  if (!complete->contains("files") || !(*complete)["files"].is_object() || !complete->contains("step") ||
      (*complete)["step"] != step) {
    return absl::DataLossError(absl::StrCat(dir, "/COMPLETE does not list the files of step ", step));
  }
  for (auto it = (*complete)["files"].begin(); it != (*complete)["files"].end(); ++it) {
    // The checkpoint's own files only: a name with a '/' (or . / ..) would reach outside it.
    if (it.key().empty() || it.key() == "." || it.key() == ".." || it.key().find('/') != std::string::npos ||
        it.key().find('\0') != std::string::npos) {
      return absl::DataLossError(
          absl::StrCat(dir, "/COMPLETE lists a name that is not a file of the checkpoint (a path, . or ..)"));
    }
    const fs::path file = path / it.key();
    std::error_code ec;
    const uint64_t size = fs::file_size(file, ec);
    if (ec || !it->is_number_unsigned() || size != it->get<uint64_t>()) {
      return absl::DataLossError(absl::StrCat(file.string(), ": ", ec ? ec.message() : absl::StrCat(size, " bytes"),
                                              ", COMPLETE recorded ", it->dump()));
    }
    if (absl::EndsWith(it.key(), ".safetensors")) RETURN_IF_ERROR(st::SafetensorsFile::Open(file.string()).status());
  }
  ASSIGN_OR_RETURN(nlohmann::json state, ReadJsonObject((path / "trainer_state.json").string()));
  // (Typed reads: a value of another type is the wrong state, never an exception.)
  const bool format_ok = state.contains("format") && state["format"].is_string() && state["format"] == kFormat;
  const bool step_ok =
      state.contains("step") && state["step"].is_number_integer() && state["step"].get<int64_t>() == step;
  if (!format_ok || !step_ok) {
    return absl::DataLossError(absl::StrCat(dir, "/trainer_state.json is not a ", kFormat, " state for step ", step));
  }
  return step;
}

absl::StatusOr<std::string> CheckpointJobId(const std::string& dir) {
  ASSIGN_OR_RETURN(nlohmann::json state, ReadJsonObject((fs::path(dir) / "trainer_state.json").string()));
  // The trainer's part, as SaveRequest::trainer_state held it.
  const nlohmann::json trainer = state.value("trainer_state", nlohmann::json::object());
  if (!trainer.is_object() || !trainer.contains("job_id") || !trainer["job_id"].is_string()) {
    return absl::DataLossError(absl::StrCat(dir, "/trainer_state.json names no job_id"));
  }
  return trainer["job_id"].get<std::string>();
}

absl::StatusOr<std::string> CheckpointRunId(const std::string& dir) {
  ASSIGN_OR_RETURN(nlohmann::json state, ReadJsonObject((fs::path(dir) / "trainer_state.json").string()));
  const nlohmann::json trainer = state.value("trainer_state", nlohmann::json::object());
  const std::string run = RunIdOf(trainer);
  if (run.empty()) return absl::DataLossError(absl::StrCat(dir, "/trainer_state.json names no run_id or job_id"));
  return run;
}

namespace {

// The newest verified checkpoint-<N> child of root (a directory, not a link) that `owned`
// accepts (given its directory).
absl::StatusOr<std::string> FindLatestVerified(const std::string& root_dir,
                                               const std::function<bool(const std::string&)>& owned,
                                               const std::string& whose) {
  std::vector<std::pair<int64_t, fs::path>> candidates;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root_dir, ec)) {
    const int64_t step = StepOfDirName(entry.path().filename().string());
    std::error_code tec;  // a link is never followed out of the root
    if (step >= 0 && entry.is_directory(tec) && !entry.is_symlink(tec)) candidates.emplace_back(step, entry.path());
  }
  if (ec) return ErrnoStatus(absl::StrCat("list checkpoints in ", root_dir), ec.value());
  std::sort(candidates.rbegin(), candidates.rend());
  for (const auto& [step, path] : candidates) {
    if (owned && !owned(path.string())) continue;
    absl::StatusOr<int64_t> ok = VerifyCheckpoint(path.string());
    if (!ok.ok()) {
      LOG(WARNING) << "skipping checkpoint " << path << ": " << ok.status();
      continue;
    }
    return path.string();
  }
  return absl::NotFoundError(absl::StrCat("no complete checkpoint", whose, " under ", root_dir));
}

}  // namespace

absl::StatusOr<std::string> FindLatestCheckpoint(const std::string& root_dir, const std::string& job_id) {
  if (job_id.empty()) return FindLatestVerified(root_dir, nullptr, "");
  return FindLatestVerified(
      root_dir,
      [&job_id](const std::string& dir) {
        absl::StatusOr<std::string> saved_by = CheckpointJobId(dir);
        return saved_by.ok() && *saved_by == job_id;
      },
      " of job " + job_id);
}

absl::StatusOr<std::string> FindLatestCheckpointOfRun(const std::string& root_dir, const std::string& run_id) {
  return FindLatestVerified(
      root_dir,
      [&run_id](const std::string& dir) {
        absl::StatusOr<std::string> run = CheckpointRunId(dir);
        return run.ok() && *run == run_id;
      },
      " of run " + run_id);
}

namespace {

// ---- LoadCheckpoint's parts ----

// Elements per task of a load (a multiple of the int8 block, so tasks never split one), and per
// conversion step inside a task: a conversion stages that many elements in FP32 (2 x 256 KiB
// per thread), whatever the model's size.
constexpr int64_t kLoadPieceNumel = int64_t{1} << 22;
constexpr int64_t kConvertNumel = int64_t{1} << 16;
static_assert(kLoadPieceNumel % kBlock == 0 && kConvertNumel % kBlock == 0 && kLoadPieceNumel % kConvertNumel == 0);

// A read-only range of moments in some dtype: element 0 at a block boundary (scales from its
// block 0). Only ever points at aligned memory (the job's arrays or ConvertBuffers): the file
// mapping is read through memcpy (CopyRaw), since a hostile header may misalign any tensor.
struct MomentsView {
  const void* m = nullptr;
  const void* v = nullptr;
  const float* m_scale = nullptr;
  const float* v_scale = nullptr;
};

MomentsView ReadOnly(const UnitMoments& mo) { return {mo.m, mo.v, mo.m_scale, mo.v_scale}; }

// The range of dtype-d moments `offset` elements (a multiple of the int8 block) into `mo`.
UnitMoments MomentsAt(StateDtype d, const UnitMoments& mo, int64_t offset) {
  const size_t eb = MomentElementBytes(d);
  UnitMoments at{static_cast<char*>(mo.m) + offset * eb, static_cast<char*>(mo.v) + offset * eb, nullptr, nullptr};
  if (d == StateDtype::kInt8) {
    at.m_scale = mo.m_scale + offset / kBlock;
    at.v_scale = mo.v_scale + offset / kBlock;
  }
  return at;
}

// The first value of n moments (from element `first` of the unit) that a job must not train on.
struct BadValue {
  const char* kind;   // "adam_m", "adam_v", "adam_m_scale", "adam_v_scale"
  int64_t index;      // element of the unit; block of the unit for a scale
  std::string value;  // as printed
  const char* rule;
};

std::string FloatText(float x) { return absl::StrCat(x); }

constexpr char kRuleFinite[] = "the state must be finite";
constexpr char kRuleSecondMoment[] = "Adam's second moment must be >= 0 and not NaN";
constexpr char kRuleScale[] = "int8 block scales must be finite and >= 0";
constexpr char kRuleMCode[] = "int8 m codes are in [-127, 127]";

// The first i in [0, n) with bad(x[i]), or -1: branch-free over blocks of 64 (so it vectorizes),
// then element by element inside the block that holds one (as FirstNonFinite does).
template <typename T, typename Bad>
int64_t FirstWhere(const T* x, int64_t n, Bad bad) {
  constexpr int64_t kScan = 64;
  int64_t i = 0;
  for (; i + kScan <= n; i += kScan) {
    uint32_t any = 0;
    for (int64_t k = 0; k < kScan; ++k) any |= static_cast<uint32_t>(bad(x[i + k]));
    if (any != 0) break;
  }
  for (; i < n; ++i) {
    if (bad(x[i])) return i;
  }
  return -1;
}

// Checks n elements of `view` (dtype d) starting at unit element `first` (a block boundary).
// The rules: m finite, v not NaN and >= 0 (+inf is what a huge finite gradient makes of it, as in
// PyTorch), int8 scales finite and >= 0 (a NaN scale is a block the kernel poisoned), int8 m codes
// not -128 (the encoder never writes it; it would decode beyond the block's maximum).
std::optional<BadValue> FirstBadMoment(StateDtype d, const MomentsView& view, int64_t first, int64_t n) {
  switch (d) {
    case StateDtype::kFp32: {
      const float* m = static_cast<const float*>(view.m);
      const float* v = static_cast<const float*>(view.v);
      if (int64_t i = FirstNonFinite(m, n, FiniteRule::kFinite); i >= 0) {
        return BadValue{"adam_m", first + i, FloatText(m[i]), kRuleFinite};
      }
      if (int64_t i = FirstNonFinite(v, n, FiniteRule::kSecondMoment); i >= 0) {
        return BadValue{"adam_v", first + i, FloatText(v[i]), kRuleSecondMoment};
      }
      return std::nullopt;
    }
    case StateDtype::kBf16: {
      // The FP32 rules on the upper 16 bits: non-finite is an all-ones exponent; NaN or negative
      // (but not -0) is above +inf's bits.
      const bf16_t* m = static_cast<const bf16_t*>(view.m);
      const bf16_t* v = static_cast<const bf16_t*>(view.v);
      if (int64_t i = FirstWhere(m, n, [](bf16_t b) { return (b & 0x7fffu) >= 0x7f80u; }); i >= 0) {
        return BadValue{"adam_m", first + i, FloatText(Bf16ToFloat(m[i])), kRuleFinite};
      }
      if (int64_t i = FirstWhere(v, n, [](bf16_t b) { return b > 0x7f80u && b != 0x8000u; }); i >= 0) {
        return BadValue{"adam_v", first + i, FloatText(Bf16ToFloat(v[i])), kRuleSecondMoment};
      }
      return std::nullopt;
    }
    case StateDtype::kInt8: {
      const int64_t blocks = update::Int8StateBlocks(n);
      const float* scales[] = {view.m_scale, view.v_scale};
      const char* kinds[] = {"adam_m_scale", "adam_v_scale"};
      for (int k = 0; k < 2; ++k) {
        for (int64_t b = 0; b < blocks; ++b) {
          const float x = scales[k][b];
          if (BreaksFiniteRule(x, FiniteRule::kFinite) || BreaksFiniteRule(x, FiniteRule::kSecondMoment)) {
            return BadValue{kinds[k], first / kBlock + b, FloatText(x), kRuleScale};
          }
        }
      }
      const int8_t* m = static_cast<const int8_t*>(view.m);
      if (int64_t i = FirstWhere(m, n, [](int8_t c) { return c == INT8_MIN; }); i >= 0) {
        return BadValue{"adam_m", first + i, "code -128", kRuleMCode};
      }
      return std::nullopt;  // every uint8 v code is valid
    }
  }
  return std::nullopt;
}

// "holds nan at element 5 (layers.0.mlp.down_proj.weight[0, 5]); the state must be finite", or
// for a scale "... at block 3 (elements 768..1023 from layers.0...[..])".
std::string DescribeBadValue(const UnitLayout& unit, const BadValue& bad) {
  const bool scale = absl::EndsWith(bad.kind, "_scale");
  const std::string where = scale
                                ? absl::StrCat("block ", bad.index, " (elements ", bad.index * kBlock, "..",
                                               std::min(unit.numel, (bad.index + 1) * kBlock) - 1, " from ",
                                               DescribeUnitElement(unit, bad.index * kBlock), ")")
                                : absl::StrCat("element ", bad.index, " (", DescribeUnitElement(unit, bad.index), ")");
  return absl::StrCat("holds ", bad.value, " at ", where, "; ", bad.rule);
}

// One unit's tensors in the file, checked before anything is written.
struct UnitSource {
  const UnitLayout* unit = nullptr;
  const st::TensorInfo* master = nullptr;
  const st::TensorInfo* m = nullptr;
  const st::TensorInfo* v = nullptr;
  const st::TensorInfo* m_scale = nullptr;  // int8 only
  const st::TensorInfo* v_scale = nullptr;
  float* master_dst = nullptr;
  UnitMoments dst;
};

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

// The tensor `name` as `dtype` [numel]; DATA_LOSS naming what the file has instead (and the
// file's state dtype, for the moments: a header whose metadata and tensors disagree).
absl::StatusOr<const st::TensorInfo*> FindStateTensor(const st::SafetensorsFile& file, const std::string& name,
                                                      st::Dtype dtype, int64_t numel, StateDtype saved) {
  const st::TensorInfo* t = file.Find(name);
  if (t != nullptr && t->dtype == dtype && t->shape == std::vector<int64_t>{numel}) return t;
  const std::string expected = absl::StrCat("state_dtype ", update::StateDtypeName(saved), " stores ",
                                            st::DtypeName(dtype), " [", numel, "] there");
  if (t == nullptr)
    return absl::DataLossError(absl::StrCat(file.path(), ": tensor \"", name, "\" is missing (", expected, ")"));
  return absl::DataLossError(absl::StrCat(file.path(), ": tensor \"", name, "\" is ", st::DtypeName(t->dtype), " ",
                                          ShapeText(t->shape), ", but ", expected));
}

absl::StatusOr<StateDtype> SavedStateDtype(const st::SafetensorsFile& file) {
  auto it = file.metadata().find(kStateDtypeKey);
  if (it == file.metadata().end()) return StateDtype::kFp32;  // every checkpoint before compact moments
  absl::StatusOr<StateDtype> d = update::ParseStateDtype(it->second);
  if (!d.ok()) {
    return absl::DataLossError(absl::StrCat(file.path(), ": __metadata__ ", kStateDtypeKey, " \"", it->second,
                                            "\" is not fp32, bf16 or int8"));
  }
  return *d;
}

absl::StatusOr<UnitSource> CheckUnitSource(const st::SafetensorsFile& file, const UnitLayout& unit, StateDtype saved,
                                           const StateArrays& arrays) {
  UnitSource src;
  src.unit = &unit;
  const int64_t n = unit.numel;
  ASSIGN_OR_RETURN(src.master, FindStateTensor(file, StateTensorName(unit, "master"), st::Dtype::kF32, n, saved));
  ASSIGN_OR_RETURN(src.m, FindStateTensor(file, StateTensorName(unit, "adam_m"), FileDtypeOfM(saved), n, saved));
  ASSIGN_OR_RETURN(src.v, FindStateTensor(file, StateTensorName(unit, "adam_v"), FileDtypeOfV(saved), n, saved));
  const std::string m_scale = StateTensorName(unit, "adam_m_scale"), v_scale = StateTensorName(unit, "adam_v_scale");
  if (saved == StateDtype::kInt8) {
    const int64_t blocks = update::Int8StateBlocks(n);
    ASSIGN_OR_RETURN(src.m_scale, FindStateTensor(file, m_scale, st::Dtype::kF32, blocks, saved));
    ASSIGN_OR_RETURN(src.v_scale, FindStateTensor(file, v_scale, st::Dtype::kF32, blocks, saved));
  } else if (file.Find(m_scale) != nullptr || file.Find(v_scale) != nullptr) {
    return absl::DataLossError(absl::StrCat(file.path(), ": holds int8 block scales for unit ", unit.name, " but its ",
                                            kStateDtypeKey, " is ", update::StateDtypeName(saved)));
  }
  src.master_dst = arrays.master(unit.index);
  src.dst = arrays.moments(unit.index);
  if (src.master_dst == nullptr || !HasMomentArrays(arrays.moment_dtype, src.dst)) {
    return absl::InvalidArgumentError(absl::StrCat("LoadCheckpoint: unit ", unit.name, " lacks its master or ",
                                                   update::StateDtypeName(arrays.moment_dtype), " moment arrays"));
  }
  return src;
}

// Copies `bytes` bytes of tensor t from byte `offset` (bounds: the caller's ranges lie inside the
// tensor, whose size the header check tied to its shape).
void CopyRaw(const st::SafetensorsFile& file, const st::TensorInfo* t, uint64_t offset, uint64_t bytes, void* dst) {
  std::memcpy(dst, file.Bytes(*t).data() + offset, bytes);
}

// The moments [begin, begin + n) of the file (dtype `saved`) copied raw into `out` (buffers or
// the job's arrays, laid out for `saved`, element 0 = element `begin`).
void CopyMoments(const st::SafetensorsFile& file, const UnitSource& src, StateDtype saved, int64_t begin, int64_t n,
                 const UnitMoments& out) {
  const size_t eb = MomentElementBytes(saved);
  CopyRaw(file, src.m, begin * eb, n * eb, out.m);
  CopyRaw(file, src.v, begin * eb, n * eb, out.v);
  if (saved == StateDtype::kInt8) {
    const uint64_t blocks = update::Int8StateBlocks(n);
    CopyRaw(file, src.m_scale, begin / kBlock * sizeof(float), blocks * sizeof(float), out.m_scale);
    CopyRaw(file, src.v_scale, begin / kBlock * sizeof(float), blocks * sizeof(float), out.v_scale);
  }
}

// Per-task buffers of a conversion: the file's moments raw (float storage keeps every view
// aligned for its dtype), then widened to FP32.
struct ConvertBuffers {
  explicit ConvertBuffers(StateDtype saved)
      : m_raw(RawFloats(saved)),
        v_raw(RawFloats(saved)),
        m_scale(kConvertNumel / kBlock),
        v_scale(kConvertNumel / kBlock),
        m(kConvertNumel),
        v(kConvertNumel) {}
  static size_t RawFloats(StateDtype d) { return (kConvertNumel * MomentElementBytes(d) + 3) / 4; }
  UnitMoments raw() { return {m_raw.data(), v_raw.data(), m_scale.data(), v_scale.data()}; }
  std::vector<float> m_raw, v_raw, m_scale, v_scale, m, v;
};

// FP32 of n moments of dtype d (the kernels' decoders; FP32 is copied).
void DecodeToF32(const update::AdamStateKernelTable& k, StateDtype d, const MomentsView& in, float* m, float* v,
                 int64_t n) {
  switch (d) {
    case StateDtype::kFp32:
      std::memcpy(m, in.m, n * sizeof(float));
      std::memcpy(v, in.v, n * sizeof(float));
      return;
    case StateDtype::kBf16:
      k.bf16_to_f32({static_cast<const bf16_t*>(in.m), static_cast<const bf16_t*>(in.v)}, m, v, n);
      return;
    case StateDtype::kInt8:
      k.int8_to_f32({static_cast<const int8_t*>(in.m), static_cast<const uint8_t*>(in.v), in.m_scale, in.v_scale}, m, v,
                    n);
      return;
  }
}

// n FP32 moments into dtype d at `out` (element 0 on a block boundary; the kernels' encoders).
void EncodeFromF32(const update::AdamStateKernelTable& k, StateDtype d, const float* m, const float* v,
                   const UnitMoments& out, int64_t n) {
  switch (d) {
    case StateDtype::kFp32:
      std::memcpy(out.m, m, n * sizeof(float));
      std::memcpy(out.v, v, n * sizeof(float));
      return;
    case StateDtype::kBf16:
      k.bf16_from_f32(m, v, {static_cast<bf16_t*>(out.m), static_cast<bf16_t*>(out.v)}, n);
      return;
    case StateDtype::kInt8:
      k.int8_from_f32(m, v, {static_cast<int8_t*>(out.m), static_cast<uint8_t*>(out.v), out.m_scale, out.v_scale}, n);
      return;
  }
}

std::string ConversionNote(StateDtype from, StateDtype to) {
  const std::string head =
      absl::StrCat("optimizer state converted from ", update::StateDtypeName(from), " to ", update::StateDtypeName(to));
  const char* via = from != StateDtype::kFp32 && to != StateDtype::kFp32 ? " through fp32" : "";
  switch (to) {
    case StateDtype::kInt8: return absl::StrCat(head, via, " (block-quantized moments: an approximation)");
    case StateDtype::kBf16: return absl::StrCat(head, via, " (moments rounded to BF16: an approximation)");
    case StateDtype::kFp32:
      return absl::StrCat(head, " (decoded exactly: the moments keep the precision they were saved with)");
  }
  return head;
}

// One task of a load: master and moments of [begin, begin + count) of one unit.
struct LoadPiece {
  const UnitSource* src;
  int64_t begin, count;
};

absl::Status LoadPieceOf(const st::SafetensorsFile& file, const LoadPiece& p, StateDtype saved, StateDtype target) {
  const UnitLayout& unit = *p.src->unit;
  const auto data_loss = [&](const BadValue& bad) {
    return absl::DataLossError(
        absl::StrCat(file.path(), ": tensor \"", StateTensorName(unit, bad.kind), "\" ", DescribeBadValue(unit, bad)));
  };
  float* master = p.src->master_dst + p.begin;
  CopyRaw(file, p.src->master, p.begin * sizeof(float), p.count * sizeof(float), master);
  if (const int64_t bad = FirstNonFinite(master, p.count, FiniteRule::kFinite); bad >= 0) {
    return data_loss({"master", p.begin + bad, FloatText(master[bad]), kRuleFinite});
  }
  if (saved == target) {  // a resume: bit for bit, checked where it landed
    const UnitMoments dst = MomentsAt(target, p.src->dst, p.begin);
    CopyMoments(file, *p.src, saved, p.begin, p.count, dst);
    if (auto bad = FirstBadMoment(target, ReadOnly(dst), p.begin, p.count)) return data_loss(*bad);
    return absl::OkStatus();
  }
  const update::AdamStateKernelTable& kernels = update::ActiveAdamStateKernels();
  ConvertBuffers buf(saved);
  const UnitMoments raw = buf.raw();
  for (int64_t b = p.begin; b < p.begin + p.count; b += kConvertNumel) {
    const int64_t n = std::min(kConvertNumel, p.begin + p.count - b);
    CopyMoments(file, *p.src, saved, b, n, raw);
    if (auto bad = FirstBadMoment(saved, ReadOnly(raw), b, n)) return data_loss(*bad);
    DecodeToF32(kernels, saved, ReadOnly(raw), buf.m.data(), buf.v.data(), n);
    const UnitMoments dst = MomentsAt(target, p.src->dst, b);
    EncodeFromF32(kernels, target, buf.m.data(), buf.v.data(), dst, n);
    // What the job's dtype cannot hold: +inf v (fine in FP32 and BF16) poisons an int8 block; an
    // m beyond BF16's range rounds to inf.
    if (auto bad = FirstBadMoment(target, ReadOnly(dst), b, n)) {
      return absl::FailedPreconditionError(
          absl::StrCat(file.path(), ": converting the moments from ", update::StateDtypeName(saved), " to ",
                       update::StateDtypeName(target), " gives \"", StateTensorName(unit, bad->kind), "\" that ",
                       DescribeBadValue(unit, *bad),
                       target == StateDtype::kInt8 ? " (an infinite moment in a block poisons its int8 scale)" : "",
                       "; resume this checkpoint with optimizer.state_dtype ", update::StateDtypeName(saved)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

UnitMomentsFn Fp32Moments(UnitArrayFn adam_m, UnitArrayFn adam_v) {
  return [m = std::move(adam_m), v = std::move(adam_v)](int unit) {
    return UnitMoments{m(unit), v(unit), nullptr, nullptr};
  };
}

absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& dir, const ModelLayout& layout,
                                                const StateArrays& arrays, const LoadOptions& options) {
  if (!arrays.master || !arrays.moments || !IsKnownStateDtype(arrays.moment_dtype)) {
    return absl::InvalidArgumentError(
        "LoadCheckpoint: the master and moments accessors and a moment_dtype are required");
  }
  ASSIGN_OR_RETURN(int64_t step, VerifyCheckpoint(dir));
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::FromFile(dir + "/config.json"));
  if (std::string m = DescribeConfigMismatch(config, layout.config); !m.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(dir, "/config.json: ", m));
  }
  ASSIGN_OR_RETURN(nlohmann::json state, ReadJsonObject(dir + "/trainer_state.json"));
  ASSIGN_OR_RETURN(auto file, st::SafetensorsFile::Open(dir + "/optimizer.safetensors"));
  auto sig = file->metadata().find("layout");
  if (sig == file->metadata().end() || sig->second != LayoutSignature(layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat(file->path(), ": saved with a different unit layout than the job's (model or alignment changed)"));
  }
  ASSIGN_OR_RETURN(const StateDtype saved, SavedStateDtype(*file));
  const StateDtype target = arrays.moment_dtype;
  // Every tensor checked before the first byte lands.
  std::vector<UnitSource> sources;
  sources.reserve(layout.units.size());
  for (const UnitLayout& unit : layout.units) {
    ASSIGN_OR_RETURN(UnitSource src, CheckUnitSource(*file, unit, saved, arrays));
    sources.push_back(src);
  }
  // Pieces over the threads (the embedding alone is most of a small model), each checked as it
  // lands: a NaN there (a damaged file, or a checkpoint of a run that diverged) would train NaN
  // and report success.
  std::vector<LoadPiece> pieces;
  for (const UnitSource& src : sources) {
    for (int64_t b = 0; b < src.unit->numel; b += kLoadPieceNumel) {
      pieces.push_back({&src, b, std::min(kLoadPieceNumel, src.unit->numel - b)});
    }
  }
  std::vector<absl::Status> piece_status(pieces.size());
  ParallelFor(pieces.size(), options.threads,
              [&](size_t i) { piece_status[i] = LoadPieceOf(*file, pieces[i], saved, target); });
  RETURN_IF_ERROR(file->Intact());  // truncated while loading: some pieces read zeros
  for (const absl::Status& s : piece_status) RETURN_IF_ERROR(s);
  LoadedCheckpoint loaded;
  loaded.step = step;
  loaded.trainer_state = state.contains("trainer_state") ? state["trainer_state"] : nlohmann::json::object();
  loaded.saved_moment_dtype = saved;
  if (saved != target) loaded.conversion_note = ConversionNote(saved, target);
  return loaded;
}

}  // namespace slidedp::checkpoint
