// The worker's debug and fault-injection switches: every SLIDEDP_* environment variable that code
// under worker/ reads, read here and nowhere else, each validated once (a malformed value is an
// error naming the variable). Listed, with their defaults and effects, in docs/environment.md.
//
// It sits below the agent, pipeline, compute and kernels because all of them read it: the agent and
// the pipeline get their switches passed down from slidedp-worker's start (WorkerOptions), while
// the CUDA backend's factory, its memory ledger and the cuDNN loader are also used by programs other
// than the worker (bench_step, tools/verify, the GPU tests) and read the process's switches
// (ProcessDebugSwitches) themselves. Production settings belong in the job spec, not here.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace slidedp {

struct DebugSwitches {
  // SLIDEDP_INJECT_NONFINITE: one test-only NaN, in element 0 of `unit`'s gradient at `step`, or
  // with unit -1 in the loss; on `rank` only, or every rank with -1.
  struct NonFiniteInjection {
    int64_t step = 0;  // 0-based (the variable's STEP is 1-based)
    int unit = -1;
    int rank = -1;
  };
  enum class Attention { kAuto, kCudnn, kOwn };

  // ---- slidedp-worker (worker/agent, worker/pipeline) ----
  // SLIDEDP_CPU_DEVICE_MEMORY_BYTES: the CPU backend's "device" capacity (0: the host's memory).
  int64_t cpu_device_memory_bytes = 0;
  // SLIDEDP_INJECT_DELAY_MS: a random delay in [0, this] before every gate wait and gradient post.
  absl::Duration inject_max_delay = absl::ZeroDuration();
  // SLIDEDP_INJECT_NONFINITE, as written (for the job's warning) and parsed.
  std::string inject_nonfinite_text;
  std::vector<NonFiniteInjection> inject_nonfinite;
  bool autopolicy_sweep = false;  // SLIDEDP_AUTOPOLICY_SWEEP=1
  bool log_unit_norms = false;    // SLIDEDP_LOG_UNIT_NORMS=1 (CUDA device gradient staging)

  // ---- the CUDA backend (worker/compute/cuda, worker/kernels) ----
  bool cuda_fp32_residual = true;          // SLIDEDP_CUDA_FP32_RESIDUAL=0: the BF16 residual stream
  Attention attention = Attention::kAuto;  // SLIDEDP_ATTENTION=auto|cudnn|own
  // SLIDEDP_DETERMINISTIC=1: every job of the process bitwise repeatable. It adds to a job's
  // runtime.deterministic, never takes it away: a job is deterministic when either asks.
  bool deterministic = false;
  bool cudnn_cross_attention = true;  // SLIDEDP_CUDNN_CROSS=0: context-parallel attention on the own kernels
  bool cudnn_window = true;           // SLIDEDP_CUDNN_WINDOW=0: sliding windows on the own kernels
  bool gpu_memory_ledger = false;     // SLIDEDP_GPU_MEMORY_LEDGER=1
  std::string cudnn_library;          // SLIDEDP_CUDNN_LIB: libcudnn.so.9 or its directory; empty: the search path

  // Reads every switch through `lookup` (the environment: getenv; nullptr or "" for an unset
  // variable). INVALID_ARGUMENT naming the variable and its value for a malformed one.
  static absl::StatusOr<DebugSwitches> Read(absl::FunctionRef<const char*(const char*)> lookup);
  static absl::StatusOr<DebugSwitches> FromEnvironment();
};

// The process's switches: its environment read on the first call (thread-safe) and kept, so every
// caller sees the same values, or the same error. slidedp-worker calls it at start and refuses to
// run on an error.
const absl::StatusOr<DebugSwitches>& ProcessDebugSwitches();

}  // namespace slidedp
