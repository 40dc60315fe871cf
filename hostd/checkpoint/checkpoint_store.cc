// Atomic save, verification, discovery and exact restore of training checkpoints.
// The on-disk layout and the atomicity protocol are described in checkpoint.h.
#include <fcntl.h>
#include <signal.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/io/small_file.h"
#include "common/numeric/bf16.h"
#include "common/numeric/finite.h"
#include "common/parallel/parallel_for.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/checkpoint/checkpoint.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;

constexpr char kDirPrefix[] = "checkpoint-";
constexpr char kTmpPrefix[] = ".tmp-checkpoint-";
constexpr char kTrashPrefix[] = ".trash-checkpoint-";
constexpr char kFormat[] = "slidedp-checkpoint";
constexpr int kFormatVersion = 1;
const char* const kStateKinds[] = {"master", "adam_m", "adam_v"};

// Step of a "checkpoint-<N>" directory name, or -1.
int64_t StepOfDirName(const std::string& name) {
  if (!absl::StartsWith(name, kDirPrefix)) return -1;
  int64_t step;
  const std::string digits = name.substr(sizeof(kDirPrefix) - 1);
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  if (!absl::SimpleAtoi(digits, &step)) return -1;
  return step;
}

absl::Status FsyncPath(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return ErrnoStatus(absl::StrCat("open ", path, " for fsync"), errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoStatus(absl::StrCat("fsync ", path), err);
  return absl::OkStatus();
}

absl::Status WriteSmallFile(const std::string& path, const std::string& content) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus(absl::StrCat("create ", path), errno);
  const char* p = content.data();
  size_t left = content.size();
  while (left > 0) {
    ssize_t w = ::write(fd, p, left);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      int err = w < 0 ? errno : EIO;
      ::close(fd);
      return ErrnoStatus(absl::StrCat("write ", path), err);
    }
    p += w;
    left -= static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoStatus(absl::StrCat("fsync ", path), err);
  }
  if (::close(fd) != 0) return ErrnoStatus(absl::StrCat("close ", path), errno);
  return absl::OkStatus();
}

absl::StatusOr<nlohmann::json> ReadJsonObject(const std::string& path) {
  ASSIGN_OR_RETURN(std::string text, ReadSmallFile(path, kMaxConfigFileBytes, "checkpoint metadata"));
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::DataLossError(absl::StrCat(path, ": not a JSON object"));
  return j;
}

// The unit/tensor table, stored with the optimizer state so a resume into a different layout
// (other alignment, other model) is refused instead of silently misplacing values.
std::string LayoutSignature(const ModelLayout& layout) {
  nlohmann::json units = nlohmann::json::array();
  for (const UnitLayout& u : layout.units) {
    nlohmann::json tensors = nlohmann::json::array();
    for (const TensorSlot& t : u.tensors) tensors.push_back({t.hf_name, t.offset_numel, t.numel});
    units.push_back({{"name", u.name}, {"numel", u.numel}, {"tensors", tensors}});
  }
  return units.dump();
}

std::string StateTensorName(const UnitLayout& u, const char* kind) { return absl::StrCat("unit.", u.name, ".", kind); }

// Removes a directory tree, first renaming it out of the checkpoint namespace so a crash during
// removal never leaves a half-deleted checkpoint-<N>.
void RemoveCheckpointDir(const fs::path& dir, const fs::path& root) {
  fs::path trash = root / absl::StrCat(kTrashPrefix, dir.filename().string(), "-", ::getpid());
  std::error_code ec;
  fs::rename(dir, trash, ec);
  fs::remove_all(ec ? dir : trash, ec);
  if (ec) LOG(WARNING) << "removing " << dir << ": " << ec.message();
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

struct PlannedFile {
  std::string name;
  std::vector<st::TensorSource> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_bytes() const {
    uint64_t n = 0;
    for (const auto& t : tensors) n += t.byte_size();
    return n;
  }
};

std::vector<PlannedFile> PlanWeightFiles(const SaveRequest& req) {
  const ModelLayout& layout = *req.layout;
  std::vector<st::TensorSource> all;
  for (const UnitLayout& unit : layout.units) {
    const float* base = req.arrays.master(unit.index);
    for (const TensorSlot& slot : unit.tensors) {
      st::TensorSource t;
      t.name = slot.hf_name;
      t.shape = slot.shape;
      const float* src = base + slot.offset_numel;
      if (req.weight_dtype == WeightDtype::kF32) {
        t.dtype = st::Dtype::kF32;
        t.data = src;
      } else {
        t.dtype = st::Dtype::kBF16;
        t.fill = [src](uint64_t byte_offset, size_t byte_len, char* dst) {
          const float* s = src + byte_offset / 2;
          bf16_t* d = reinterpret_cast<bf16_t*>(dst);
          const size_t n = byte_len / 2;
          for (size_t i = 0; i < n; ++i) d[i] = FloatToBf16(s[i]);
        };
      }
      all.push_back(std::move(t));
    }
  }
  uint64_t total = 0;
  for (const auto& t : all) total += t.byte_size();
  std::vector<PlannedFile> files;
  if (total <= req.shard_max_bytes) {
    files.push_back({"model.safetensors", std::move(all), {{"format", "pt"}}});
    return files;
  }
  uint64_t in_shard = 0;
  for (auto& t : all) {
    if (files.empty() || (in_shard > 0 && in_shard + t.byte_size() > req.shard_max_bytes)) {
      files.push_back({"", {}, {{"format", "pt"}}});
      in_shard = 0;
    }
    in_shard += t.byte_size();
    files.back().tensors.push_back(std::move(t));
  }
  char buf[64];
  for (size_t i = 0; i < files.size(); ++i) {
    std::snprintf(buf, sizeof(buf), "model-%05zu-of-%05zu.safetensors", i + 1, files.size());
    files[i].name = buf;
  }
  return files;
}

PlannedFile PlanOptimizerFile(const SaveRequest& req) {
  PlannedFile f;
  f.name = "optimizer.safetensors";
  f.metadata = {{"format", kFormat}, {"layout", LayoutSignature(*req.layout)}};
  const UnitArrayFn* fns[] = {&req.arrays.master, &req.arrays.adam_m, &req.arrays.adam_v};
  for (const UnitLayout& unit : req.layout->units) {
    for (int k = 0; k < 3; ++k) {
      st::TensorSource t;
      t.name = StateTensorName(unit, kStateKinds[k]);
      t.dtype = st::Dtype::kF32;
      t.shape = {unit.numel};
      t.data = (*fns[k])(unit.index);
      f.tensors.push_back(std::move(t));
    }
  }
  return f;
}

absl::Status ValidateRequest(const SaveRequest& req) {
  if (req.layout == nullptr) return absl::InvalidArgumentError("SaveCheckpoint: layout is null");
  if (req.root_dir.empty()) return absl::InvalidArgumentError("SaveCheckpoint: root_dir is empty");
  if (req.step < 0) return absl::InvalidArgumentError(absl::StrCat("SaveCheckpoint: step ", req.step, " < 0"));
  if (!req.arrays.master || !req.arrays.adam_m || !req.arrays.adam_v) {
    return absl::InvalidArgumentError("SaveCheckpoint: master, adam_m and adam_v accessors are all required");
  }
  if (!req.trainer_state.is_object() && !req.trainer_state.is_null()) {
    return absl::InvalidArgumentError("SaveCheckpoint: trainer_state must be a JSON object");
  }
  if (req.shard_max_bytes == 0) return absl::InvalidArgumentError("SaveCheckpoint: shard_max_bytes is 0");
  return absl::OkStatus();
}

// Writes every file of the checkpoint into tmp; returns bytes written.
absl::StatusOr<uint64_t> WriteCheckpointFiles(const SaveRequest& req, const fs::path& tmp,
                                              std::vector<PlannedFile>& weights, PlannedFile& optimizer) {
  auto stage = [&](const std::string& name) -> absl::Status {
    return req.fault_hook ? req.fault_hook(name) : absl::OkStatus();
  };
  st::WriteOptions wopts;
  wopts.threads = std::max(1, req.io_threads);
  uint64_t bytes = 0;

  RETURN_IF_ERROR(stage("config.json"));
  Qwen3Config config = req.layout->config;
  config.torch_dtype = req.weight_dtype == WeightDtype::kBF16 ? "bfloat16" : "float32";
  RETURN_IF_ERROR(WriteSmallFile((tmp / "config.json").string(), config.ToJson()));

  RETURN_IF_ERROR(stage("model"));
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  uint64_t weight_bytes = 0;
  for (PlannedFile& f : weights) {
    wopts.metadata = f.metadata;
    ASSIGN_OR_RETURN(st::WriteStats ws, st::WriteFile((tmp / f.name).string(), f.tensors, wopts));
    bytes += ws.file_bytes;
    weight_bytes += f.data_bytes();
    for (const auto& t : f.tensors) weight_map[t.name] = f.name;
  }
  if (weights.size() > 1) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", weight_bytes}};
    index["weight_map"] = weight_map;
    RETURN_IF_ERROR(WriteSmallFile((tmp / "model.safetensors.index.json").string(), index.dump(2) + "\n"));
  }

  RETURN_IF_ERROR(stage("optimizer.safetensors"));
  wopts.metadata = optimizer.metadata;
  ASSIGN_OR_RETURN(st::WriteStats os, st::WriteFile((tmp / optimizer.name).string(), optimizer.tensors, wopts));
  bytes += os.file_bytes;

  RETURN_IF_ERROR(stage("trainer_state.json"));
  nlohmann::json state = {
      {"format", kFormat},
      {"format_version", kFormatVersion},
      {"step", req.step},
      {"weights_dtype", config.torch_dtype},
      {"trainer_state", req.trainer_state.is_null() ? nlohmann::json::object() : req.trainer_state}};
  RETURN_IF_ERROR(WriteSmallFile((tmp / "trainer_state.json").string(), state.dump(2) + "\n"));

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
  const auto t0 = std::chrono::steady_clock::now();
  const fs::path root(req.root_dir);
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec) return ErrnoStatus(absl::StrCat("create checkpoint root ", root.string()), ec.value());
  CleanStaleDirs(root);

  std::vector<PlannedFile> weights = PlanWeightFiles(req);
  PlannedFile optimizer = PlanOptimizerFile(req);
  uint64_t needed = optimizer.data_bytes() + (uint64_t{1} << 20) * (weights.size() + 2);
  for (const auto& f : weights) needed += f.data_bytes();
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
  const fs::path final_dir = root / absl::StrCat(kDirPrefix, req.step);
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

  if (fs::exists(final_dir, ec)) {
    // Same step saved again: swap atomically, then drop the old one (now at tmp).
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) != 0) {
      return abandon(ErrnoStatus(absl::StrCat("exchange ", tmp.string(), " with ", final_dir.string()), errno));
    }
    fs::remove_all(tmp, ec);
  } else if (::rename(tmp.c_str(), final_dir.c_str()) != 0) {
    return abandon(ErrnoStatus(absl::StrCat("rename ", tmp.string(), " to ", final_dir.string()), errno));
  }
  RETURN_IF_ERROR(FsyncPath(root.string(), O_RDONLY | O_DIRECTORY));

  SaveResult result;
  result.dir = final_dir.string();
  result.bytes_written = *bytes;
  if (req.keep_last > 0) {
    std::vector<std::pair<int64_t, fs::path>> complete;
    for (const auto& entry : fs::directory_iterator(root, ec)) {
      const int64_t step = StepOfDirName(entry.path().filename().string());
      if (step >= 0 && step != req.step && fs::exists(entry.path() / "COMPLETE", ec))
        complete.emplace_back(step, entry.path());
    }
    std::sort(complete.rbegin(), complete.rend());
    // The checkpoint just written always counts as one of the kept.
    for (size_t i = static_cast<size_t>(req.keep_last) - 1; i < complete.size(); ++i) {
      RemoveCheckpointDir(complete[i].second, root);
      result.removed.push_back(complete[i].second.string());
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
  if (state.value("format", "") != kFormat || state.value("step", int64_t{-1}) != step) {
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

absl::StatusOr<std::string> FindLatestCheckpoint(const std::string& root_dir, const std::string& job_id) {
  std::vector<std::pair<int64_t, fs::path>> candidates;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(root_dir, ec)) {
    const int64_t step = StepOfDirName(entry.path().filename().string());
    if (step >= 0 && entry.is_directory(ec)) candidates.emplace_back(step, entry.path());
  }
  if (ec) return ErrnoStatus(absl::StrCat("list checkpoints in ", root_dir), ec.value());
  std::sort(candidates.rbegin(), candidates.rend());
  for (const auto& [step, path] : candidates) {
    absl::StatusOr<int64_t> ok = VerifyCheckpoint(path.string());
    if (!ok.ok()) {
      LOG(WARNING) << "skipping checkpoint " << path << ": " << ok.status();
      continue;
    }
    if (job_id.empty()) return path.string();
    absl::StatusOr<std::string> saved_by = CheckpointJobId(path.string());
    if (saved_by.ok() && *saved_by == job_id) return path.string();
  }
  return absl::NotFoundError(
      absl::StrCat("no complete checkpoint", job_id.empty() ? "" : " of job " + job_id, " under ", root_dir));
}

absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& dir, const ModelLayout& layout,
                                                const StateArrays& arrays, const LoadOptions& options) {
  ASSIGN_OR_RETURN(int64_t step, VerifyCheckpoint(dir));
  ASSIGN_OR_RETURN(Qwen3Config config, Qwen3Config::FromFile(dir + "/config.json"));
  if (std::string m = DescribeConfigMismatch(config, layout.config); !m.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(dir, "/config.json: ", m));
  }
  ASSIGN_OR_RETURN(auto file, st::SafetensorsFile::Open(dir + "/optimizer.safetensors"));
  auto sig = file->metadata().find("layout");
  if (sig == file->metadata().end() || sig->second != LayoutSignature(layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat(file->path(), ": saved with a different unit layout than the job's (model or alignment changed)"));
  }
  // Copied in pieces over the threads (the embedding alone is most of a small model), each piece
  // checked as it lands: master and m finite, v not NaN and >= 0 (+inf is what a huge finite
  // gradient makes of it, as in PyTorch). A NaN there (a damaged file, or a checkpoint of a run
  // that diverged) would train NaN and report success.
  constexpr int64_t kPieceNumel = int64_t{1} << 22;
  struct Piece {
    const UnitLayout* unit;
    int kind;  // kStateKinds index
    const st::TensorInfo* info;
    float* dst;
    int64_t begin, count;
  };
  std::vector<Piece> pieces;
  const UnitArrayFn* fns[] = {&arrays.master, &arrays.adam_m, &arrays.adam_v};
  for (const UnitLayout& unit : layout.units) {
    for (int k = 0; k < 3; ++k) {
      const std::string name = StateTensorName(unit, kStateKinds[k]);
      const st::TensorInfo* t = file->Find(name);
      if (t == nullptr || t->dtype != st::Dtype::kF32 || t->shape != std::vector<int64_t>{unit.numel}) {
        return absl::DataLossError(
            absl::StrCat(file->path(), ": tensor \"", name, "\" missing or not F32 [", unit.numel, "]"));
      }
      float* dst = (*fns[k])(unit.index);
      for (int64_t b = 0; b < unit.numel; b += kPieceNumel) {
        pieces.push_back({&unit, k, t, dst, b, std::min(kPieceNumel, unit.numel - b)});
      }
    }
  }
  std::vector<absl::Status> piece_status(pieces.size());
  ParallelFor(pieces.size(), options.threads, [&](size_t i) {
    const Piece& p = pieces[i];
    const char* src = file->Bytes(*p.info).data() + p.begin * sizeof(float);
    float* dst = p.dst + p.begin;
    std::memcpy(dst, src, p.count * sizeof(float));
    const FiniteRule rule = p.kind == 2 ? FiniteRule::kSecondMoment : FiniteRule::kFinite;
    if (const int64_t bad = FirstNonFinite(dst, p.count, rule); bad >= 0) {
      piece_status[i] = absl::DataLossError(
          absl::StrCat(file->path(), ": tensor \"", p.info->name, "\" holds ", dst[bad], " at element ", p.begin + bad,
                       " (", DescribeUnitElement(*p.unit, p.begin + bad), "); ",
                       p.kind == 2 ? "Adam's second moment must be >= 0 and not NaN" : "the state must be finite"));
    }
  });
  for (const absl::Status& s : piece_status) RETURN_IF_ERROR(s);
  ASSIGN_OR_RETURN(nlohmann::json state, ReadJsonObject(dir + "/trainer_state.json"));
  LoadedCheckpoint loaded;
  loaded.step = step;
  loaded.trainer_state = state.contains("trainer_state") ? state["trainer_state"] : nlohmann::json::object();
  return loaded;
}

}  // namespace slidedp::checkpoint
