// CastPool: persistent host threads for the FP32 -> BF16 upload cast; see cast_pool.h.
#include "worker/pipeline/cast_pool.h"

#include <algorithm>

#include "common/numeric/bf16_cast.h"

namespace slidedp {

CastPool::CastPool(int threads) {
  for (int i = 1; i < std::max(threads, 1); ++i) helpers_.emplace_back([this, i] { HelperLoop(i); });
}

CastPool::~CastPool() {
  {
    absl::MutexLock l(&mu_);
    stopping_ = true;
  }
  for (std::thread& t : helpers_) t.join();
}

int64_t CastPool::PieceBegin(int64_t n, int pieces, int p) { return std::min(n, (n * p / pieces + 31) / 32 * 32); }

void CastPool::Cast(const float* in, bf16_t* out, int64_t n) {
  if (n <= 0) return;
  const int pieces = static_cast<int>(std::clamp<int64_t>(n / kMinPieceNumel, 1, threads()));
  if (pieces == 1) {
    CastF32ToBf16(in, out, n);
    return;
  }
  {
    absl::MutexLock l(&mu_);
    in_ = in;
    out_ = out;
    n_ = n;
    pieces_ = pieces;
    remaining_ = pieces - 1;
    ++generation_;
  }
  const int64_t first_end = PieceBegin(n, pieces, 1);
  CastF32ToBf16(in, out, first_end);
  absl::MutexLock l(&mu_);
  mu_.Await(absl::Condition(
      +[](int* remaining) { return *remaining == 0; }, &remaining_));
}

void CastPool::HelperLoop(int index) {
  uint64_t seen = 0;
  for (;;) {
    const float* in;
    bf16_t* out;
    int64_t n;
    int pieces;
    {
      absl::MutexLock l(&mu_);
      auto ready = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stopping_ || generation_ != seen; };
      mu_.Await(absl::Condition(&ready));
      if (stopping_) return;
      seen = generation_;
      in = in_;
      out = out_;
      n = n_;
      pieces = pieces_;
    }
    // Helper i casts piece i of this call, if the call has that many (fewer for short ranges).
    if (index < pieces) {
      const int64_t b = PieceBegin(n, pieces, index), e = PieceBegin(n, pieces, index + 1);
      CastF32ToBf16(in + b, out + b, e - b);
      absl::MutexLock l(&mu_);
      --remaining_;
    }
  }
}

}  // namespace slidedp
