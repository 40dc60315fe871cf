// Reading and writing the safetensors format (HF's tensor file: 8-byte little-endian header
// length, a JSON header, then the raw data area).
//
// The reader trusts nothing: every header field is checked against the file before any tensor
// byte is touched, so a corrupted, truncated or lying file is an error, never a crash or an
// out-of-bounds read. Error codes:
//   INVALID_ARGUMENT  the header is malformed or lies (bad JSON, unknown dtype, size that does not
//                     match the shape, overlapping tensors, bytes no tensor covers, ...)
//   DATA_LOSS         the file is shorter than its header says (truncated)
//   UNIMPLEMENTED     a valid tensor whose dtype cannot be converted (only BF16/F16/F32 can)
//   NOT_FOUND etc.    from the file system (see ErrnoStatus)
// Messages name the file, the tensor and the numbers.
//
// The writer lays the tensors out back to back in the order given, pads the header with spaces
// so the data area starts at a multiple of 8 bytes, reserves the whole file up front (a full disk
// fails before anything is written, as RESOURCE_EXHAUSTED with the numbers) and writes with
// several threads using pwrite at known offsets. Tensors whose bytes already exist in memory are
// written straight from there (no copy); others are produced chunk by chunk by a fill callback
// (e.g. FP32 master -> BF16).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <map>
#include <memory>
#include <initializer_list>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/io/mapping_guard.h"

namespace slidedp::safetensors {

// Every dtype the format defines, so any valid HF file parses; loading converts only the
// floating-point ones the trainer uses (BF16, F16, F32).
enum class Dtype { kBool, kU8, kI8, kF8E5M2, kF8E4M3, kI16, kU16, kF16, kBF16, kI32, kU32, kF32, kF64, kI64, kU64 };

// "BF16" -> kBF16; INVALID_ARGUMENT for a name the format does not define.
absl::StatusOr<Dtype> ParseDtype(absl::string_view name);
const char* DtypeName(Dtype dtype);
size_t DtypeSize(Dtype dtype);

// Header limit: real headers are a few hundred KiB even for sharded 100B-parameter models.
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

struct TensorInfo {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t data_begin = 0;  // offsets into the data area (after the header), as in the file
  uint64_t data_end = 0;
  uint64_t byte_size() const { return data_end - data_begin; }
};

struct Header {
  std::vector<TensorInfo> tensors;                  // sorted by data_begin
  std::map<std::string, std::string> metadata;      // "__metadata__", string values only
  uint64_t data_start = 0;                          // file offset of the data area (8 + header length)
  uint64_t data_size = 0;                           // bytes in the data area
};

// Validates a whole safetensors file held in memory (file_bytes is the entire file) and returns
// its header. `path` only labels error messages. Never reads outside file_bytes.
absl::StatusOr<Header> ParseHeader(absl::string_view file_bytes, absl::string_view path);

// A validated, read-only memory-mapped safetensors file. A file truncated while it is mapped
// does not crash the reader: see Intact().
class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return header_.tensors; }
  const std::map<std::string, std::string>& metadata() const { return header_.metadata; }
  uint64_t file_size() const { return size_; }
  // nullptr when absent.
  const TensorInfo* Find(absl::string_view name) const;

  // The tensor's raw little-endian bytes inside the mapping (valid while this object lives).
  absl::string_view Bytes(const TensorInfo& tensor) const;

  // Converts the tensor to FP32 into out[0, numel). BF16/F16 widen exactly; F32 is copied.
  // UNIMPLEMENTED for other dtypes.
  absl::Status ReadAsFloat32(const TensorInfo& tensor, float* out) const;

  // OK while every read through Bytes() has read the file; DATA_LOSS once the file shrank under
  // the mapping (truncated after Open checked it) and a read got zeros (common/io/mapping_guard.h:
  // such a read does not raise SIGBUS). Ask once a load is done; on DATA_LOSS discard what it read.
  absl::Status Intact() const { return guard_.Intact(); }

 private:
  SafetensorsFile() = default;
  std::string path_;
  const char* base_ = nullptr;
  uint64_t size_ = 0;
  Header header_;
  std::map<std::string, size_t, std::less<>> by_name_;
  MappingGuard guard_;
};

// Converts n elements of a BF16/F16/F32 buffer to FP32 (UNIMPLEMENTED otherwise).
absl::Status ConvertToFloat32(Dtype dtype, const void* src, int64_t n, float* out);

// One tensor to write. Exactly one of `data` (bytes already in memory, byte_size() long) or
// `fill` must be set. fill(byte_offset, byte_len, dst) writes the tensor's bytes
// [byte_offset, byte_offset + byte_len) to dst; offsets and lengths are multiples of 8 bytes
// except at the tensor's end. fill may be called from several threads at once for different
// ranges of the same tensor.
struct TensorSource {
  std::string name;
  Dtype dtype = Dtype::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  std::function<void(uint64_t byte_offset, size_t byte_len, char* dst)> fill;
  // Set: only these [begin, end) byte ranges of the tensor's data are written (several writers filling
  // one file, WriteOptions::into_existing); fill is then asked for bytes inside them only. Unset: all.
  std::optional<std::vector<std::pair<uint64_t, uint64_t>>> only = std::nullopt;

  uint64_t byte_size() const;
};

enum class Durability { kNone, kFsync };

struct WriteOptions {
  std::map<std::string, std::string> metadata;  // written as "__metadata__" when non-empty
  Durability durability = Durability::kFsync;
  int threads = 4;                           // pwrite workers; output does not depend on it
  size_t chunk_bytes = size_t{16} << 20;     // unit of work and of each fill buffer
  // Write into a file another writer created with the same tensors and metadata (the nodes of a
  // sharded state writing one checkpoint, each its own byte ranges): it must exist with this
  // header and size (FAILED_PRECONDITION otherwise); nothing else of it is touched, and a failure
  // leaves it in place for its creator to remove.
  bool into_existing = false;
};

struct WriteStats {
  uint64_t file_bytes = 0;
  double seconds = 0;
};

// Writes `tensors` to `path` (created or truncated, mode 0644). On failure the partial file is
// removed. Disk full is RESOURCE_EXHAUSTED naming the path, bytes needed and bytes free.
absl::StatusOr<WriteStats> WriteFile(const std::string& path, const std::vector<TensorSource>& tensors,
                                     const WriteOptions& options = {});

// The header bytes (length prefix included) WriteFile would produce; exposed for tests/tools.
absl::StatusOr<std::string> SerializeHeader(const std::vector<TensorSource>& tensors,
                                            const std::map<std::string, std::string>& metadata,
                                            std::vector<uint64_t>* data_offsets);

// Whether a model directory's weights (model.safetensors, else the model.safetensors.index.json
// weight_map) hold a tensor whose name `matches`; false for a directory with neither (the
// loader refuses it later). The header and index are read bounded and validated (the directory is
// a job spec's: hostile); INVALID_ARGUMENT / DATA_LOSS as Open and the index parse give them.
absl::StatusOr<bool> ModelDirHasTensor(const std::string& dir, const std::function<bool(absl::string_view)>& matches);
// The name a MoE layer's experts fused over the expert dimension end in (transformers 5's layout:
// ExpertStorage::kFused in common/model/model_config.h), and the tensors whose experts do not count
// (a qwen3_5 checkpoint's multi-token-prediction layer and vision tower pass through as they are).
inline constexpr absl::string_view kFusedExpertsSuffix = ".mlp.experts.gate_up_proj";
inline constexpr std::initializer_list<absl::string_view> kNotLanguageModelPrefixes = {"mtp.", "model.visual."};

}  // namespace slidedp::safetensors
