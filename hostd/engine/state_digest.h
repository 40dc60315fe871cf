// A digest of a job's host state (FP32 master and Adam moments of every unit), for a job over
// several nodes with replicated state: every node's hostd applies the same update to the same bits,
// so the digests agree after every step, and a difference fails the job (docs/multi-node.md).
// Four 64-bit multiply-xor lanes over the bytes (not cryptographic: it tells equal states from
// diverged ones), several GB/s a core; the units in parallel.
#pragma once

#include <cstdint>

#include "common/model/model_config.h"
#include "shm/job_state.h"

namespace slidedp::hostd {

// `threads`: how many threads read the state (the result does not depend on it).
uint64_t StateDigest(const ModelLayout& layout, const shm::JobState& state, int threads = 1);
uint64_t DigestBytes(const void* data, uint64_t bytes, uint64_t seed);

// Whether a job over nodes compares digests after step t (0-based) of `steps`: every step while the
// state is small (at most kDigestEveryStepBytes: a fraction of a second on the host's threads), else
// every kDigestEverySteps steps and the last.
inline constexpr uint64_t kDigestEveryStepBytes = uint64_t{16} << 30;
inline constexpr int64_t kDigestEverySteps = 100;
inline bool DigestsAfter(int64_t t, int64_t steps, uint64_t state_bytes) {
  return state_bytes <= kDigestEveryStepBytes || (t + 1) % kDigestEverySteps == 0 || t + 1 == steps;
}

}  // namespace slidedp::hostd
