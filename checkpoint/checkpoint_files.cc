// The files of a checkpoint (or exported model) directory besides the optimizer state: durable
// small files, HF weight files and their index, tokenizer files and generation_config.json read
// from a model directory with hostile-input care. See checkpoint_files.h and checkpoint.h.
#include "checkpoint/checkpoint_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/io/json_depth.h"
#include "common/io/small_file.h"
#include "common/numeric/bf16.h"
#include "common/status/status_macros.h"

namespace slidedp::checkpoint {
namespace internal {

namespace fs = std::filesystem;
namespace st = safetensors;

int64_t StepOfDirName(const std::string& name) {
  if (!absl::StartsWith(name, kDirPrefix)) return -1;
  int64_t step;
  const std::string digits = name.substr(sizeof(kDirPrefix) - 1);
  if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) return -1;
  if (!absl::SimpleAtoi(digits, &step)) return -1;
  return step;
}

absl::Status ExportDestinationErrno(const std::string& what, const std::string& parent, int err) {
  const std::string cause = absl::StrCat(" (", what, ": ", std::strerror(err), ")");
  switch (err) {
    case EROFS:
      return absl::FailedPreconditionError(absl::StrCat("export: ", parent, " is on a read-only file system", cause,
                                                        "; choose a --to on a writable one"));
    case EACCES:
    case EPERM:
      return absl::PermissionDeniedError(
          absl::StrCat("export: may not write in ", parent, cause, "; choose a --to you may write"));
    case ENOENT:
      return absl::NotFoundError(absl::StrCat("export: ", parent, " does not exist", cause,
                                              "; create it first (--to's parent directory is not created, so a "
                                              "mistyped path does not fill another disk)"));
    case ENOSPC:
    case EDQUOT: return absl::ResourceExhaustedError(absl::StrCat("export: no space left in ", parent, cause));
    default: return ErrnoStatus(absl::StrCat("export: ", what), err);
  }
}

absl::StatusOr<CheckpointEntry> ExamineCheckpointEntry(int root_fd, const std::string& root, const std::string& name,
                                                       int64_t step, uint64_t* state_budget, bool* is_directory) {
  CheckpointEntry e;
  e.dir = (fs::path(root) / name).string();
  e.step = step;
  struct stat st;
  const bool dir = ::fstatat(root_fd, name.c_str(), &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
  if (is_directory != nullptr) *is_directory = dir;
  if (!dir) return e;  // a link, a file, a FIFO..., or gone: no checkpoint, whoever made it
  // O_NOFOLLOW: the entry may have become a link since the fstatat.
  const int fd = ::openat(root_fd, name.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) return e;
  absl::Cleanup close_fd = [fd] { ::close(fd); };
  const bool has_complete = ::fstatat(fd, "COMPLETE", &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode);
  const int sfd = ::openat(fd, "trainer_state.json", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (sfd < 0) return e;
  absl::Cleanup close_state = [sfd] { ::close(sfd); };
  if (::fstat(sfd, &st) != 0 || !S_ISREG(st.st_mode) || static_cast<uint64_t>(st.st_size) > kMaxListedStateBytes) {
    return e;
  }
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (state_budget != nullptr) {
    if (size > *state_budget) {
      return absl::FailedPreconditionError(absl::StrCat(
          "listing the checkpoints of ", root, ": their trainer_state.json files hold more than ",
          kMaxListedStateTotalBytes, " bytes together (at ", e.dir, "); not a checkpoint directory slidedp made"));
    }
    *state_budget -= size;
  }
  std::string text(size, '\0');
  size_t got = 0;
  while (got < text.size()) {
    const ssize_t n = ::pread(sfd, text.data() + got, text.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;  // unreadable or shrank: what is there (and then, most likely, no JSON)
    got += static_cast<size_t>(n);
  }
  text.resize(got);
  if (!CheckJsonDepth(text, e.dir).ok()) return e;
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return e;
  // (Typed reads: a value of another type is no owner, never an exception.)
  auto trainer = j.find("trainer_state");
  if (trainer != j.end() && trainer->is_object()) {
    auto job = trainer->find("job_id");
    if (job != trainer->end() && job->is_string()) e.job_id = job->get<std::string>();
    e.run_id = RunIdOf(*trainer);
  }
  auto format = j.find("format");
  auto saved_step = j.find("step");
  e.complete = has_complete && format != j.end() && format->is_string() && *format == kFormat &&
               saved_step != j.end() && saved_step->is_number_integer() && saved_step->get<int64_t>() == step;
  return e;
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
  if (absl::Status deep = CheckJsonDepth(text, path); !deep.ok()) return absl::DataLossError(deep.message());
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return absl::DataLossError(absl::StrCat(path, ": not a JSON object"));
  return j;
}

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

uint64_t PlannedFile::data_bytes() const {
  uint64_t n = 0;
  for (const auto& t : tensors) n += t.byte_size();
  return n;
}

namespace {

// Writes elements [first, first + count) of a tensor, as `dtype`, from FP32 values.
void ConvertOut(const float* src, size_t count, Dtype dtype, char* dst) {
  if (dtype == Dtype::kF32) {
    std::memcpy(dst, src, count * sizeof(float));
    return;
  }
  bf16_t* d = reinterpret_cast<bf16_t*>(dst);
  for (size_t i = 0; i < count; ++i) d[i] = FloatToBf16(src[i]);
}

// What of a slot a save writes, and where from: its elements [lo, hi), element i read at array[at + i]
// (the whole slot from the unit's array, or a node's share of it, NodeShare).
struct SlotSource {
  const float* array;
  int64_t at;
  const TensorSlot* slot;
  int64_t lo, hi;
};

// A checkpoint tensor made of several slots (ExpertStorage::kFused): each slot's elements at its
// hf_offset_numel.
struct FusedTensor {
  std::vector<int64_t> shape;
  std::vector<SlotSource> slices;
};

// The [begin, end) byte ranges of a tensor that `slices` write (sorted, adjacent ones merged).
std::vector<std::pair<uint64_t, uint64_t>> WrittenBytes(const std::vector<SlotSource>& slices, size_t elem) {
  std::vector<std::pair<uint64_t, uint64_t>> ranges;
  for (const SlotSource& s : slices) {
    if (s.lo >= s.hi) continue;
    ranges.emplace_back((s.slot->hf_offset_numel + s.lo) * elem, (s.slot->hf_offset_numel + s.hi) * elem);
  }
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<uint64_t, uint64_t>> merged;
  for (const auto& r : ranges) {
    if (!merged.empty() && merged.back().second >= r.first) {
      merged.back().second = std::max(merged.back().second, r.second);
    } else {
      merged.push_back(r);
    }
  }
  return merged;
}

}  // namespace

std::vector<PlannedFile> PlanWeightFiles(const ModelLayout& layout, const ConstUnitArrayFn& master, Dtype dtype,
                                         uint64_t shard_max_bytes, const PassThrough* pass_through,
                                         const NodeShare* share) {
  std::vector<st::TensorSource> all;
  const size_t elem = dtype == Dtype::kF32 ? sizeof(float) : sizeof(bf16_t);
  const st::Dtype file_dtype = dtype == Dtype::kF32 ? st::Dtype::kF32 : st::Dtype::kBF16;
  std::map<std::string, std::shared_ptr<FusedTensor>> fused;
  for (const UnitLayout& unit : layout.units) {
    const float* base = master(unit.index);
    const int64_t held = share != nullptr ? share->held[unit.index] : 0;
    const ShardRange write = share != nullptr ? share->write[unit.index] : ShardRange{0, unit.numel};
    for (const TensorSlot& slot : unit.tensors) {
      SlotSource source{base, slot.offset_numel - held, &slot,
                        std::clamp(write.offset - slot.offset_numel, int64_t{0}, slot.numel),
                        std::clamp(write.offset + write.numel - slot.offset_numel, int64_t{0}, slot.numel)};
      if (slot.is_slice()) {
        std::shared_ptr<FusedTensor>& f = fused[slot.hf_name];
        if (f == nullptr) {
          f = std::make_shared<FusedTensor>();
          f->shape = slot.hf_shape;
          st::TensorSource t;
          t.name = slot.hf_name;
          t.shape = slot.hf_shape;
          t.dtype = file_dtype;
          t.fill = [f, dtype, elem](uint64_t byte_offset, size_t byte_len, char* dst) {
            const int64_t first = static_cast<int64_t>(byte_offset / elem);
            const int64_t last = first + static_cast<int64_t>(byte_len / elem);
            for (const SlotSource& s : f->slices) {
              const int64_t from = s.slot->hf_offset_numel;
              const int64_t lo = std::max(first, from + s.lo), hi = std::min(last, from + s.hi);
              if (lo >= hi) continue;
              ConvertOut(s.array + s.at + (lo - from), static_cast<size_t>(hi - lo), dtype, dst + (lo - first) * elem);
            }
          };
          all.push_back(std::move(t));
        }
        f->slices.push_back(source);
        continue;
      }
      st::TensorSource t;
      t.name = slot.hf_name;
      t.shape = slot.shape;
      t.dtype = file_dtype;
      if (share == nullptr && dtype == Dtype::kF32) {
        t.data = base + slot.offset_numel;
      } else {
        t.fill = [source, dtype, elem](uint64_t byte_offset, size_t byte_len, char* dst) {
          ConvertOut(source.array + source.at + static_cast<int64_t>(byte_offset / elem), byte_len / elem, dtype, dst);
        };
      }
      if (share != nullptr) t.only = WrittenBytes({source}, elem);
      all.push_back(std::move(t));
    }
  }
  if (share != nullptr) {
    for (st::TensorSource& t : all) {
      auto it = fused.find(t.name);
      if (it != fused.end()) t.only = WrittenBytes(it->second->slices, elem);
    }
  }
  // Pass-through tensors: their own bytes and dtype, after the trained ones.
  // (By pointer: the sources keep pointing into *pass_through, which outlives the write.)
  for (size_t i = 0; pass_through != nullptr && i < pass_through->size(); ++i) {
    const PassThroughTensor& p = (*pass_through)[i];
    st::TensorSource t;
    t.name = p.name;
    t.shape = p.shape;
    t.dtype = p.dtype;
    t.data = p.bytes.data();
    if (share != nullptr && !share->writes_pass_through) t.only.emplace();  // the coordinator's to write
    all.push_back(std::move(t));
  }
  uint64_t total = 0;
  for (const auto& t : all) total += t.byte_size();
  std::vector<PlannedFile> files;
  if (total <= shard_max_bytes) {
    files.push_back({"model.safetensors", std::move(all), {{"format", "pt"}}});
    return files;
  }
  uint64_t in_shard = 0;
  for (auto& t : all) {
    if (files.empty() || (in_shard > 0 && in_shard + t.byte_size() > shard_max_bytes)) {
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

absl::StatusOr<uint64_t> WriteWeightFiles(const std::string& dir, const std::vector<PlannedFile>& files,
                                          int io_threads, bool into_existing) {
  st::WriteOptions wopts;
  wopts.threads = std::max(1, io_threads);
  wopts.into_existing = into_existing;
  uint64_t bytes = 0, weight_bytes = 0;
  nlohmann::ordered_json weight_map = nlohmann::ordered_json::object();
  for (const PlannedFile& f : files) {
    wopts.metadata = f.metadata;
    ASSIGN_OR_RETURN(st::WriteStats ws, st::WriteFile(dir + "/" + f.name, f.tensors, wopts));
    bytes += ws.file_bytes;
    weight_bytes += f.data_bytes();
    for (const auto& t : f.tensors) weight_map[t.name] = f.name;
  }
  if (files.size() > 1 && !into_existing) {
    nlohmann::ordered_json index;
    index["metadata"] = {{"total_size", weight_bytes}};
    index["weight_map"] = weight_map;
    const std::string text = index.dump(2) + "\n";
    RETURN_IF_ERROR(WriteSmallFile(dir + "/model.safetensors.index.json", text));
    bytes += text.size();
  }
  return bytes;
}

std::string ConfigJsonFor(const ModelLayout& layout, Dtype dtype) {
  ModelConfig config = layout.config;
  config.torch_dtype = dtype == Dtype::kBF16 ? "bfloat16" : "float32";
  return config.ToJson();
}

absl::StatusOr<uint64_t> WriteModelDirFiles(const std::string& dir, const std::vector<ModelDirFile>* files,
                                            const std::string& config_json) {
  uint64_t bytes = 0;
  bool generation_config = false;
  for (const ModelDirFile& f : files != nullptr ? *files : std::vector<ModelDirFile>{}) {
    RETURN_IF_ERROR(WriteSmallFile(dir + "/" + f.name, f.content));
    bytes += f.content.size();
    generation_config |= f.name == "generation_config.json";
  }
  if (!generation_config) {
    const std::string text = GenerationConfigFromConfig(config_json);
    RETURN_IF_ERROR(WriteSmallFile(dir + "/generation_config.json", text));
    bytes += text.size();
  }
  return bytes;
}

}  // namespace internal

namespace {

namespace fs = std::filesystem;

// Where a hub cache snapshot's links may lead: <repo>/snapshots/<revision>/<file> links to
// ../../blobs/<hash>. Empty for any other directory.
fs::path HubBlobsOf(const fs::path& canonical_dir) {
  const fs::path snapshots = canonical_dir.parent_path();
  if (snapshots.filename() != "snapshots") return {};
  return snapshots.parent_path() / "blobs";
}

bool IsInside(const fs::path& path, const fs::path& dir) {
  if (dir.empty()) return false;
  std::string d = dir.string();
  if (d.back() != '/') d += '/';
  const std::string p = path.string();
  return p.size() > d.size() && absl::StartsWith(p, d);
}

// One file of the model directory, or nullopt when there is none by that name. The path the open
// landed on (/proc/self/fd: after every symbolic link, without a race between a check and the
// open) must lie inside the directory or the hub's blobs.
absl::StatusOr<std::optional<std::string>> ReadModelFile(const fs::path& dir, const fs::path& blobs,
                                                         const std::string& name, uint64_t max_bytes) {
  const std::string path = (dir / name).string();
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC | O_NOCTTY);
  if (fd < 0) {
    if (errno == ENOENT) return std::optional<std::string>();  // absent, or a link to nothing
    return ErrnoStatus(absl::StrCat("open model file ", path), errno);
  }
  absl::Cleanup close_fd = [fd] { ::close(fd); };
  char target[4096];
  const ssize_t len = ::readlink(absl::StrCat("/proc/self/fd/", fd).c_str(), target, sizeof(target) - 1);
  if (len <= 0) return ErrnoStatus(absl::StrCat("resolve model file ", path), len < 0 ? errno : EIO);
  const fs::path real(std::string(target, static_cast<size_t>(len)));
  if (!IsInside(real, dir) && !IsInside(real, blobs)) {
    return absl::InvalidArgumentError(absl::StrCat("model file ", path, " is a symbolic link to ", real.string(),
                                                   ", outside the model directory ", dir.string(),
                                                   ": copy the file into the directory"));
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) return ErrnoStatus(absl::StrCat("stat ", path), errno);
  if (!S_ISREG(st.st_mode))
    return absl::InvalidArgumentError(absl::StrCat("model file ", path, " is not a regular file"));
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model file ", path, " is ", st.st_size, " bytes: tokenizer files and ", "generation_config.json may have ",
        kMaxModelDirFileBytes, " bytes each and ", kMaxModelDirFilesBytes, " together"));
  }
  std::string out(static_cast<size_t>(st.st_size), '\0');
  size_t got = 0;
  while (got < out.size()) {
    const ssize_t n = ::pread(fd, out.data() + got, out.size() - got, static_cast<off_t>(got));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return ErrnoStatus(absl::StrCat("read ", path), errno);
    if (n == 0) break;  // shrank while read: what is there
    got += static_cast<size_t>(n);
  }
  out.resize(got);
  return std::optional<std::string>(std::move(out));
}

}  // namespace

absl::StatusOr<std::vector<ModelDirFile>> ReadModelDirFiles(const std::string& model_dir) {
  std::error_code ec;
  const fs::path dir = fs::canonical(model_dir, ec);
  if (ec) return absl::NotFoundError(absl::StrCat("model directory ", model_dir, ": ", ec.message()));
  const fs::path blobs = HubBlobsOf(dir);
  std::vector<ModelDirFile> files;
  uint64_t total = 0;
  for (const char* name : kModelDirFileNames) {
    ASSIGN_OR_RETURN(std::optional<std::string> content,
                     ReadModelFile(dir, blobs, name, std::min(kMaxModelDirFileBytes, kMaxModelDirFilesBytes - total)));
    if (!content) continue;
    total += content->size();
    files.push_back({name, std::move(*content)});
  }
  return files;
}

std::string GenerationConfigFromConfig(const std::string& config_json) {
  const nlohmann::json config = CheckJsonDepth(config_json, "config.json").ok()
                                    ? nlohmann::json::parse(config_json, nullptr, /*allow_exceptions=*/false)
                                    : nlohmann::json();
  nlohmann::ordered_json g = nlohmann::ordered_json::object();
  g["_from_model_config"] = true;
  for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
    if (!config.is_object() || !config.contains(key)) continue;
    const nlohmann::json& v = config[key];
    // A token id, or a list of them (Llama 3's eos); null and anything else is left out.
    const bool ids = v.is_number_integer() ||
                     (v.is_array() && !v.empty() &&
                      std::all_of(v.begin(), v.end(), [](const nlohmann::json& x) { return x.is_number_integer(); }));
    if (ids) g[key] = v;
  }
  return g.dump(2) + "\n";
}

}  // namespace slidedp::checkpoint
