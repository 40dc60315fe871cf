// Admission control: the host memory a job needs, computed before anything is allocated, and a
// check against what the host has (MemAvailable and free /dev/shm), refusing with
// RESOURCE_EXHAUSTED and the numbers.
//
// Steady state is 14 bytes/param in the job segment (FP32 master 4 + Adam m 4 + v 4 + BF16 mirror
// 2) plus one shm::GradRing per worker; compact moments (optimizer.state_dtype) and no mirror
// (runtime.param_source: master, each worker then keeps pinned cast staging) take less. Exact global gradient-norm clipping needs every gradient of the
// step before the first update, so it adds one whole step of gradient staging (2 bytes/param in
// BF16, 4 in FP32), counted once: with GPU reduce-scatter each rank stages only its 1/R shard.
// Everything here lives in /dev/shm, so both limits apply to the same total.
#pragma once

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

enum class ClipMode {
  kNone,             // updates run as chunks arrive; rings hold only chunks in flight
  kExactGlobalNorm,  // updates wait for the global norm: a whole step of gradients is staged
};

struct MemoryPlan {
  int64_t param_numel = 0;          // padded numel over all units (what the segment holds)
  uint64_t master_bytes = 0;        // FP32
  uint64_t adam_bytes = 0;          // m + v (FP32, BF16, or int8 codes and their scales)
  uint64_t mirror_bytes = 0;        // BF16; 0 without a mirror (runtime.param_source: master)
  uint64_t job_segment_bytes = 0;   // the shm::JobState segment (above + control + alignment)
  uint64_t ring_bytes = 0;          // all workers' shm::GradRing segments
  uint64_t step_staging_bytes = 0;  // whole-step gradients for exact clipping, else 0 (hostd's own memory)
  uint64_t offload_bytes = 0;       // the workers' pinned copies of offloaded layer inputs (AddActivationOffload)
  uint64_t undo_bytes = 0;          // speculative clipping's undo copies (hostd's own memory; hostd/engine/undo_arena.h)
  uint64_t cast_staging_bytes = 0;  // without a mirror: the workers' pinned BF16 cast buffers (AddCastStaging)
  uint64_t shm_bytes = 0;           // what lives in /dev/shm: the job segment and the rings
  uint64_t total_bytes = 0;         // host memory the job needs
  std::string ToString() const;     // "13.04 GiB (master 3.73, adam 7.45, ...)"
};

// The gradient ring of one worker for a job: `slots` slots, each as large as one gradient chunk:
// chunk_bytes (the spec's H2D chunk) capped at kMaxGradChunkBytes and at the largest unit. The
// cap keeps the rings small next to the state (4 x 32 MiB per worker = 0.03 GiB per billion
// parameters at 4B): a chunk still takes ~1 ms to copy down, far more than a post costs.
inline constexpr uint64_t kMaxGradChunkBytes = 32ull << 20;
shm::GradRingConfig RingConfigFor(const ModelLayout& layout, int slots, int64_t chunk_bytes);

MemoryPlan PlanJobMemory(const ModelLayout& layout, const shm::GradRingConfig& ring, int num_workers, ClipMode clip,
                         Dtype staging_dtype = Dtype::kBF16, const shm::StateFormat& format = {});

// Without a mirror each worker casts the master into kCastStagingBuffers pinned buffers of
// CastStagingChunkBytes each (worker/pipeline/cuda_streamer.h; a CPU worker holds its acquired
// units' casts, no more): added to cast_staging_bytes and total_bytes.
inline constexpr int kCastStagingBuffers = 3;
// One cast chunk: the H2D chunk, at most the largest unit's BF16 bytes, whole 4 KiB pages.
int64_t CastStagingChunkBytes(const ModelLayout& layout, int64_t chunk_bytes);
void AddCastStaging(int num_workers, int64_t chunk_bytes, MemoryPlan& plan);

// What one token of a worker's step holds in offloaded checkpoints, summed over the layers (each
// offloaded layer's elements times its offload share): the layers' inputs, input_element_bytes
// each (4: FP32; 2: runtime.checkpoint_dtype bf16, DtypeBytes), and what the layers
// keep beyond them, in bytes (KeptBytesPerToken: the workers' backend's layout).
struct OffloadedPerToken {
  double input_elements = 0;
  int64_t input_element_bytes = 4;
  double kept_bytes = 0;
  double bytes() const { return input_elements * static_cast<double>(input_element_bytes) + kept_bytes; }
};
// Bytes per token a layer keeps beyond its input for `pieces` on the job's workers: the CUDA
// backend's layout (mostly BF16) when every worker is a CUDA one and the model is dense, else the
// CPU backend's FP32 elements (the most any backend keeps; a CUDA MoE block keeps its own set).
// 0 whatever the pieces for qwen3_5 / qwen3_5_moe, whose layers keep nothing on either backend
// (ModelShape::layers_keep_pieces): an offloaded checkpoint of theirs is the layer input alone.
int64_t KeptBytesPerToken(const ModelConfig& config, uint32_t pieces, bool cuda_workers);
// Offloaded checkpoints in the workers' pinned host memory: each of `num_workers` workers holds
// `per_token` for each of its `tokens_per_worker` tokens of a step: added to offload_bytes and
// total_bytes.
void AddOffloadedCheckpoints(const OffloadedPerToken& per_token, int num_workers, int64_t tokens_per_worker,
                             MemoryPlan& plan);
// runtime.offload_ratio > 0: every checkpoint of layout.OffloadedLayers(ratio) layers, each its
// input (input_element_bytes an element) and `kept_pieces` (common/policy/layer_pieces.h) beyond.
void AddActivationOffload(const ModelLayout& layout, double ratio, uint32_t kept_pieces, int64_t input_element_bytes,
                          bool cuda_workers, int num_workers, int64_t tokens_per_worker, MemoryPlan& plan);

struct HostMemoryInfo {
  uint64_t mem_total_bytes = 0;
  uint64_t mem_available_bytes = 0;  // /proc/meminfo MemAvailable
  uint64_t shm_total_bytes = 0;      // statvfs of the shm dir
  uint64_t shm_free_bytes = 0;
};

// Reads /proc/meminfo (or `meminfo_path`) and statvfs(shm_dir).
absl::StatusOr<HostMemoryInfo> ReadHostMemoryInfo(const std::string& meminfo_path = "/proc/meminfo",
                                                  const std::string& shm_dir = "/dev/shm");

struct AdmissionPolicy {
  uint64_t reserve_bytes = 1ull << 30;  // left to the OS, workers and page cache
};

// OK, or RESOURCE_EXHAUSTED naming the limit (host memory or /dev/shm), needed and available
// GiB. A plan that fits /dev/shm but not MemAvailable is refused too: the pages would be
// allocated at prefault time and the host would swap or OOM.
absl::Status CheckAdmission(const MemoryPlan& plan, const HostMemoryInfo& host, const AdmissionPolicy& policy = {});

}  // namespace slidedp::hostd
