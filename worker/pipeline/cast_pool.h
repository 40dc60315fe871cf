// CastPool: persistent threads that cast an FP32 range to BF16 (CastF32ToBf16, bitwise
// FloatToBf16) in parallel pieces. A worker's uploads with runtime.param_source master cast on
// the host through one: the CUDA streamer per chunk (runtime.cast_on host), the CPU streamer per
// acquired unit. The threads are started once, not per chunk: a cast is a hot-path call.
//
// Cast() splits [0, n) into at most `threads` pieces of whole 64-byte lines of the output (never
// below kMinPieceNumel elements), casts the first on the calling thread and the others on the
// pool's, and returns when all are done. One caller at a time.
#pragma once

#include <cstdint>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "common/numeric/bf16.h"

namespace slidedp {

class CastPool {
 public:
  static constexpr int64_t kMinPieceNumel = 16384;  // below this a thread's wake-up costs more than it saves

  explicit CastPool(int threads);  // threads >= 1: the caller plus threads - 1 helpers
  ~CastPool();
  CastPool(const CastPool&) = delete;
  CastPool& operator=(const CastPool&) = delete;

  void Cast(const float* in, bf16_t* out, int64_t n);
  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

 private:
  void HelperLoop(int index);
  // Piece p of `pieces` over [0, n): boundaries on multiples of 32 elements.
  static int64_t PieceBegin(int64_t n, int pieces, int p);

  absl::Mutex mu_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;  // bumped per Cast() that uses helpers
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;  // helper pieces not yet done
  const float* in_ ABSL_GUARDED_BY(mu_) = nullptr;
  bf16_t* out_ ABSL_GUARDED_BY(mu_) = nullptr;
  int64_t n_ ABSL_GUARDED_BY(mu_) = 0;
  int pieces_ ABSL_GUARDED_BY(mu_) = 0;
  std::vector<std::thread> helpers_;
};

}  // namespace slidedp
