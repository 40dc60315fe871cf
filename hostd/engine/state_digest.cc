#include "hostd/engine/state_digest.h"

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "common/numeric/dtype.h"

namespace slidedp::hostd {
namespace {

constexpr uint64_t kMul = 0x9E3779B97F4A7C15ull;

inline uint64_t Mix(uint64_t h, uint64_t w) {
  h ^= w * kMul;
  h = (h << 31) | (h >> 33);
  return h * 0xC2B2AE3D27D4EB4Full;
}

}  // namespace

uint64_t DigestBytes(const void* data, uint64_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  uint64_t lane[4] = {seed ^ 1, seed ^ 2, seed ^ 3, seed ^ 4};
  uint64_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = Mix(lane[k], w);
    }
  }
  uint64_t h = Mix(Mix(Mix(Mix(bytes, lane[0]), lane[1]), lane[2]), lane[3]);
  for (; i < bytes; ++i) h = Mix(h, p[i]);
  return h;
}

namespace {

// One unit's master and moments (m and v, and the blocks' scales of int8 moments), each region by
// itself: alignment gaps between them are no part of the state.
uint64_t UnitDigest(const shm::JobState& state, int u) {
  const uint64_t numel = static_cast<uint64_t>(state.unit_numel(u));
  uint64_t h = DigestBytes(state.master(u), numel * sizeof(float), static_cast<uint64_t>(u));
  const shm::JobState::Moments m = state.moments(u);
  const uint64_t elem = m.dtype == MomentForm::kF32 ? 4 : m.dtype == MomentForm::kBF16 ? 2 : 1;
  h = DigestBytes(m.m, numel * elem, h);
  h = DigestBytes(m.v, numel * elem, h);
  if (m.m_scale != nullptr) {
    const uint64_t blocks = (numel + static_cast<uint64_t>(kInt8MomentBlock) - 1) / static_cast<uint64_t>(kInt8MomentBlock);
    h = DigestBytes(m.m_scale, blocks * sizeof(float), h);
    h = DigestBytes(m.v_scale, blocks * sizeof(float), h);
  }
  return h;
}

}  // namespace

uint64_t StateDigest(const ModelLayout& layout, const shm::JobState& state, int threads) {
  // The units' digests in parallel (each thread takes every threads-th unit), folded in unit order:
  // the same value for any thread count.
  const int units = layout.num_units();
  std::vector<uint64_t> per_unit(static_cast<size_t>(units));
  threads = std::clamp(threads, 1, std::max(1, units));
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (int u = t; u < units; u += threads) per_unit[u] = UnitDigest(state, u);
    });
  }
  for (int u = 0; u < units; u += threads) per_unit[u] = UnitDigest(state, u);
  for (std::thread& th : pool) th.join();
  return DigestBytes(per_unit.data(), per_unit.size() * sizeof(uint64_t), static_cast<uint64_t>(units));
}

}  // namespace slidedp::hostd
