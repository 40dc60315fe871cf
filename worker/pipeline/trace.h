// NVTX ranges around the pipeline's phases (forward/backward per unit, gate waits, gradient
// posts), visible in Nsight Systems next to the kernels and copies. NVTX 3 is header-only and
// costs a few nanoseconds when no profiler is attached; builds without the CUDA toolkit (the CPU
// backend in CI) compile the ranges away.
#pragma once

#if __has_include(<nvtx3/nvToolsExt.h>)
#include <nvtx3/nvToolsExt.h>
#define SLIDEDP_HAVE_NVTX 1
#endif

namespace slidedp {

class TraceRange {
 public:
  explicit TraceRange(const char* name) {
#ifdef SLIDEDP_HAVE_NVTX
    nvtxRangePushA(name);
#else
    (void)name;
#endif
  }
  ~TraceRange() {
#ifdef SLIDEDP_HAVE_NVTX
    nvtxRangePop();
#endif
  }
  TraceRange(const TraceRange&) = delete;
  TraceRange& operator=(const TraceRange&) = delete;
};

}  // namespace slidedp
