// Atomic save, verification and discovery of training checkpoints (restore: checkpoint_load.cc).
// The on-disk layout and the atomicity protocol are described in checkpoint.h.
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
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_files.h"
#include "common/io/small_file.h"
#include "common/numeric/bf16.h"
#include "common/numeric/finite.h"
#include "common/parallel/parallel_for.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;
using internal::FileDtypeOfM;
using internal::FileDtypeOfV;
using internal::FsyncPath;
using internal::HasMomentArrays;
using internal::IsKnownMomentForm;
using internal::kDirPrefix;
using internal::kFormat;
using internal::kStateDtypeKey;
using internal::LayoutSignature;
using internal::PlannedFile;
using internal::ReadJsonObject;
using internal::StateTensorName;
using internal::StepOfDirName;
using internal::WriteSmallFile;

constexpr char kTmpPrefix[] = ".tmp-checkpoint-";
constexpr char kTrashPrefix[] = ".trash-checkpoint-";
constexpr int kFormatVersion = 1;

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

absl::StatusOr<PlannedFile> PlanOptimizerFile(const SaveRequest& req) {
  const MomentForm dtype = req.arrays.moment_form;
  PlannedFile f;
  f.name = "optimizer.safetensors";
  f.metadata = {{"format", kFormat}, {"layout", LayoutSignature(*req.layout)}};
  if (dtype != MomentForm::kF32) f.metadata[kStateDtypeKey] = ToString(dtype);
  for (const UnitLayout& unit : req.layout->units) {
    const float* master = req.arrays.master(unit.index);
    const UnitMoments mo = req.arrays.moments(unit.index);
    if (master == nullptr || !HasMomentArrays(dtype, mo)) {
      return absl::InvalidArgumentError(
          absl::StrCat("SaveCheckpoint: unit ", unit.name, " lacks its master or ", ToString(dtype), " moment arrays"));
    }
    // A node's share (NodeShare): the arrays start at element `held`, and only the share's elements
    // (per_block: its blocks of 256, for the int8 scales) are written.
    const int64_t held = req.share != nullptr ? req.share->held[unit.index] : 0;
    const ShardRange write = req.share != nullptr ? req.share->write[unit.index] : ShardRange{0, unit.numel};
    auto add = [&](const char* kind, st::Dtype t_dtype, int64_t numel, const void* data, bool per_block) {
      st::TensorSource t;
      t.name = StateTensorName(unit, kind);
      t.dtype = t_dtype;
      t.shape = {numel};
      if (req.share == nullptr) {
        t.data = data;
      } else {
        const uint64_t eb = st::DtypeSize(t_dtype);
        const int64_t skip = per_block ? held / kInt8MomentBlock : held;
        const int64_t first = per_block ? write.offset / kInt8MomentBlock : write.offset;
        const int64_t count = per_block ? Int8MomentBlocks(write.offset + write.numel) - first : write.numel;
        const char* bytes = static_cast<const char*>(data);
        t.fill = [bytes, skip, eb](uint64_t byte_offset, size_t byte_len, char* dst) {
          std::memcpy(dst, bytes + byte_offset - static_cast<uint64_t>(skip) * eb, byte_len);
        };
        t.only.emplace();
        if (write.numel > 0) t.only->emplace_back(first * eb, (first + count) * eb);
      }
      f.tensors.push_back(std::move(t));
    };
    add("master", st::Dtype::kF32, unit.numel, master, false);
    add("adam_m", FileDtypeOfM(dtype), unit.numel, mo.m, false);
    add("adam_v", FileDtypeOfV(dtype), unit.numel, mo.v, false);
    if (dtype == MomentForm::kInt8) {
      add("adam_m_scale", st::Dtype::kF32, Int8MomentBlocks(unit.numel), mo.m_scale, true);
      add("adam_v_scale", st::Dtype::kF32, Int8MomentBlocks(unit.numel), mo.v_scale, true);
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
  if (!IsKnownMomentForm(req.arrays.moment_form)) {
    return absl::InvalidArgumentError("SaveCheckpoint: moment_form is not fp32, bf16 or int8");
  }
  if (!req.trainer_state.is_object() && !req.trainer_state.is_null()) {
    return absl::InvalidArgumentError("SaveCheckpoint: trainer_state must be a JSON object");
  }
  if (req.shard_max_bytes == 0) return absl::InvalidArgumentError("SaveCheckpoint: shard_max_bytes is 0");
  return absl::OkStatus();
}

// A sharded save's files, made before any node writes into them: each with its header and its blocks
// reserved, no tensor data (TensorSource::only empty), and the weights' index when there are several.
absl::Status CreateEmptyFiles(const std::string& dir, const std::vector<PlannedFile>& weights,
                              const PlannedFile& optimizer, int io_threads) {
  auto empty = [](PlannedFile f) {
    for (st::TensorSource& t : f.tensors) t.only.emplace();
    return f;
  };
  std::vector<PlannedFile> bare;
  for (const PlannedFile& f : weights) bare.push_back(empty(f));
  RETURN_IF_ERROR(internal::WriteWeightFiles(dir, bare, io_threads).status());
  st::WriteOptions wopts;
  wopts.metadata = optimizer.metadata;
  wopts.durability = st::Durability::kNone;  // fsynced once the data is in
  return st::WriteFile(dir + "/" + optimizer.name, empty(optimizer).tensors, wopts).status();
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

  // A sharded state: the files are made first (headers, every block reserved, no data), then every node
  // writes its share into them at once, this one here while other_nodes tells the others and waits.
  std::thread others;
  absl::Status others_status;
  if (req.share != nullptr) {
    if (!req.other_nodes) return absl::InvalidArgumentError("SaveCheckpoint: a node's share without other_nodes");
    RETURN_IF_ERROR(CreateEmptyFiles(tmp.string(), weights, optimizer, req.io_threads));
    others = std::thread([&] { others_status = req.other_nodes(tmp.string()); });
  }
  auto join_others = [&]() -> absl::Status {
    if (!others.joinable()) return absl::OkStatus();
    others.join();
    return others_status;
  };
  // Whatever ends this early, the thread telling the others is joined (it returns once each node said
  // how its share went, or after the step timeout).
  absl::Cleanup join_on_exit = [&] { (void)join_others(); };
  wopts.into_existing = req.share != nullptr;

  RETURN_IF_ERROR(stage("model"));
  absl::StatusOr<uint64_t> weight_bytes = internal::WriteWeightFiles(tmp.string(), weights, req.io_threads, req.share != nullptr);
  if (!weight_bytes.ok()) return weight_bytes.status();
  bytes += *weight_bytes;

  RETURN_IF_ERROR(stage("optimizer.safetensors"));
  wopts.metadata = optimizer.metadata;
  absl::StatusOr<st::WriteStats> os = st::WriteFile((tmp / optimizer.name).string(), optimizer.tensors, wopts);
  const absl::Status others_done = join_others();
  RETURN_IF_ERROR(os.status());
  bytes += os->file_bytes;
  RETURN_IF_ERROR(others_done);

  RETURN_IF_ERROR(stage("trainer_state.json"));
  nlohmann::json state = {
      {"format", kFormat},
      {"format_version", kFormatVersion},
      {"step", req.step},
      {"weights_dtype", req.weight_dtype == Dtype::kBF16 ? "bfloat16" : "float32"},
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

absl::StatusOr<uint64_t> WriteCheckpointShare(const SaveRequest& req, const std::string& tmp_dir) {
  RETURN_IF_ERROR(ValidateRequest(req));
  if (req.share == nullptr) return absl::InvalidArgumentError("WriteCheckpointShare: no share");
  ASSIGN_OR_RETURN(PlannedFile optimizer, PlanOptimizerFile(req));
  std::vector<PlannedFile> weights = internal::PlanWeightFiles(
      *req.layout, [&req](int unit) -> const float* { return req.arrays.master(unit); }, req.weight_dtype,
      req.shard_max_bytes, req.pass_through, req.share);
  ASSIGN_OR_RETURN(uint64_t bytes, internal::WriteWeightFiles(tmp_dir, weights, req.io_threads, /*into_existing=*/true));
  st::WriteOptions wopts;
  wopts.threads = std::max(1, req.io_threads);
  wopts.metadata = optimizer.metadata;
  wopts.into_existing = true;
  ASSIGN_OR_RETURN(st::WriteStats os, st::WriteFile(tmp_dir + "/" + optimizer.name, optimizer.tensors, wopts));
  return bytes + os.file_bytes;
}

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
      req.shard_max_bytes, req.pass_through, req.share);
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
                                                 (root / (kept ? kept_name : tmp_name)).string(), ", and this save at ",
                                                 final_dir.string()),
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

}  // namespace slidedp::checkpoint
