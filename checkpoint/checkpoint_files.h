// Pieces of the checkpoint directory format shared by the save (checkpoint_store.cc) and the
// export (model_export.cc): durable small files, the HF weight files (sharded with HF's index
// above a size), the unit layout signature of optimizer.safetensors, and the files beside the
// weights that make a directory one transformers loads (tokenizer, generation_config.json).
// Internal to ckpt_lib; checkpoint.h is the interface.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "checkpoint/checkpoint.h"
#include "common/model/model_config.h"
#include "common/safetensors/safetensors.h"
#include "nlohmann/json.hpp"

namespace slidedp::checkpoint::internal {

inline constexpr char kDirPrefix[] = "checkpoint-";
// trainer_state.json's "format".
inline constexpr char kFormat[] = "slidedp-checkpoint";

// Step of a "checkpoint-<N>" directory name, or -1.
int64_t StepOfDirName(const std::string& name);

// A failure `what` (e.g. "create P/.tmp-export-x-1") to write in `parent`, --to's parent
// directory of an export, as the user's mistake it is, naming `parent`: EROFS
// FAILED_PRECONDITION, EACCES/EPERM PERMISSION_DENIED, ENOENT NOT_FOUND, ENOSPC/EDQUOT
// RESOURCE_EXHAUSTED, else ErrnoStatus. Never INTERNAL for those.
absl::Status ExportDestinationErrno(const std::string& what, const std::string& parent, int err);

// One entry `name` of the root (opened as root_fd, O_DIRECTORY) examined as ListCheckpoints does,
// as the checkpoint of `step` (the name's, or the one a renamed checkpoint held). The bytes read
// count against *state_budget when it is not null: FAILED_PRECONDITION when the entry's
// trainer_state.json would exceed what is left. `is_directory` (may be null) tells whether the
// entry is a directory (not a symbolic link).
absl::StatusOr<CheckpointEntry> ExamineCheckpointEntry(int root_fd, const std::string& root, const std::string& name,
                                                       int64_t step, uint64_t* state_budget,
                                                       bool* is_directory = nullptr);

absl::Status FsyncPath(const std::string& path, int flags);
// Creates (or truncates) path with `content`, fsynced.
absl::Status WriteSmallFile(const std::string& path, const std::string& content);
// A checkpoint's JSON metadata file (bounded, regular files only), DATA_LOSS unless an object.
absl::StatusOr<nlohmann::json> ReadJsonObject(const std::string& path);

// The unit/tensor table stored with the optimizer state, so a resume into a different layout is
// refused instead of silently misplacing values; and the optimizer state's tensor names.
std::string LayoutSignature(const ModelLayout& layout);
std::string StateTensorName(const UnitLayout& u, const char* kind);

// One safetensors file to write.
struct PlannedFile {
  std::string name;
  std::vector<safetensors::TensorSource> tensors;
  std::map<std::string, std::string> metadata;
  uint64_t data_bytes() const;
};

// The unit's FP32 master values (layout.units[unit].numel floats, 4-byte aligned), read only.
using ConstUnitArrayFn = std::function<const float*(int unit)>;

// The HF weight files of the layout's tensors from the master (BF16: round to nearest even, or
// F32): "model.safetensors" when the weights take at most shard_max_bytes, else
// "model-0000i-of-0000n.safetensors", each at most shard_max_bytes unless one tensor is larger
// (HF's save_pretrained splits the same way). A tied model has no lm_head.weight.
// A fused checkpoint tensor (ExpertStorage::kFused) is gathered from its slots; the pass-through
// tensors (null: none) follow the trained ones with their own bytes and dtype.
// With `share` (a node of a sharded state): the same files, tensors and bytes, each tensor writing only
// the share's elements (TensorSource::only), read from arrays holding the units from share->held on.
std::vector<PlannedFile> PlanWeightFiles(const ModelLayout& layout, const ConstUnitArrayFn& master, Dtype dtype,
                                         uint64_t shard_max_bytes, const PassThrough* pass_through = nullptr,
                                         const NodeShare* share = nullptr);
// Writes them into dir, and model.safetensors.index.json ({"metadata": {"total_size": bytes},
// "weight_map": {tensor: file}}) when there are several; every file fsynced. Returns the bytes
// written. into_existing: into files another node created (its share only; no index).
absl::StatusOr<uint64_t> WriteWeightFiles(const std::string& dir, const std::vector<PlannedFile>& files,
                                          int io_threads, bool into_existing = false);

// config.json of a layout's weights saved as `dtype` (torch_dtype says which).
std::string ConfigJsonFor(const ModelLayout& layout, Dtype dtype);

// Writes `files` (ReadModelDirFiles' result; may be null) into dir, and a generation_config.json
// made from config_json (GenerationConfigFromConfig) when they hold none. Returns the bytes
// written.
absl::StatusOr<uint64_t> WriteModelDirFiles(const std::string& dir, const std::vector<ModelDirFile>* files,
                                            const std::string& config_json);

// optimizer.safetensors __metadata__ key of the moments' dtype; absent means fp32 (and keeps an
// fp32 job's file what it was before compact moments existed).
inline constexpr char kStateDtypeKey[] = "state_dtype";

// How optimizer.safetensors stores m and v for each state dtype, and their element bytes.
inline safetensors::Dtype FileDtypeOfM(MomentForm d) {
  switch (d) {
    case MomentForm::kF32: return safetensors::Dtype::kF32;
    case MomentForm::kBF16: return safetensors::Dtype::kBF16;
    case MomentForm::kInt8: return safetensors::Dtype::kI8;
  }
  return safetensors::Dtype::kF32;
}
inline safetensors::Dtype FileDtypeOfV(MomentForm d) {
  return d == MomentForm::kInt8 ? safetensors::Dtype::kU8 : FileDtypeOfM(d);
}
inline size_t MomentElementBytes(MomentForm d) { return d == MomentForm::kF32 ? 4 : d == MomentForm::kBF16 ? 2 : 1; }

inline bool IsKnownMomentForm(MomentForm d) {
  return d == MomentForm::kF32 || d == MomentForm::kBF16 || d == MomentForm::kInt8;
}

// Whether an accessor's unit gives every array its dtype uses.
inline bool HasMomentArrays(MomentForm d, const UnitMoments& mo) {
  return mo.m != nullptr && mo.v != nullptr &&
         (d != MomentForm::kInt8 || (mo.m_scale != nullptr && mo.v_scale != nullptr));
}

}  // namespace slidedp::checkpoint::internal
