// Test helpers for compact Adam moments, shared by common_moments_test and hostd/update's
// adam_state_test: the ISAs to cover, misaligned buffers, an int8 state with guards after its arrays and its bitwise
// comparison, and a realistic random FP32 moment state.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "common/moments/moments.h"
#include "gtest/gtest.h"

namespace slidedp::moments::testing {

// The ISAs this CPU and build run: those whose tables a test can compare.
inline std::vector<AdamIsa> SupportedIsas() {
  std::vector<AdamIsa> out;
  for (AdamIsa isa : {AdamIsa::kScalar, AdamIsa::kAvx2, AdamIsa::kAvx512}) {
    if (AdamIsaSupported(isa)) out.push_back(isa);
  }
  return out;
}

inline uint32_t Bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Owns an array with a chosen misalignment (in elements) from a 64-byte boundary.
template <typename T>
struct Buffer {
  Buffer(size_t n, size_t shift) : storage(n + 64 + shift), data(storage.data() + AlignShift(shift)) {}
  size_t AlignShift(size_t shift) const {
    const auto addr = reinterpret_cast<uintptr_t>(storage.data());
    return ((64 - addr % 64) % 64) / sizeof(T) + shift;
  }
  std::vector<T> storage;
  T* data;
};

// Int8 moments for n elements plus guard space after each array, misaligned by `shift`.
struct Int8State {
  static constexpr int64_t kGuard = 8;
  Int8State(int64_t n, size_t shift)
      : n(n),
        blocks(Int8MomentBlocks(n)),
        m(n + kGuard, shift),
        v(n + kGuard, (shift * 3 + 1) % 64),
        ms(blocks + kGuard, shift % 4),
        vs(blocks + kGuard, (shift + 1) % 4) {
    std::fill(m.storage.begin(), m.storage.end(), int8_t{0x55});
    std::fill(v.storage.begin(), v.storage.end(), uint8_t{0xAA});
    std::fill(ms.storage.begin(), ms.storage.end(), -7.0f);
    std::fill(vs.storage.begin(), vs.storage.end(), -9.0f);
  }
  Int8Moments Ref() { return {m.data, v.data, ms.data, vs.data}; }
  Int8MomentsView View() const { return {m.data, v.data, ms.data, vs.data}; }
  void CopyFrom(const Int8State& o) {  // the n elements and blocks, not the guards
    std::copy(o.m.data, o.m.data + n, m.data);
    std::copy(o.v.data, o.v.data + n, v.data);
    std::copy(o.ms.data, o.ms.data + blocks, ms.data);
    std::copy(o.vs.data, o.vs.data + blocks, vs.data);
  }
  int64_t n, blocks;
  Buffer<int8_t> m;
  Buffer<uint8_t> v;
  Buffer<float> ms, vs;
};

// Codes and scales equal bit for bit, and the guards after them untouched.
inline ::testing::AssertionResult SameInt8(const Int8State& a, const Int8State& b) {
  if (std::memcmp(a.m.data, b.m.data, a.n) != 0) return ::testing::AssertionFailure() << "m codes differ";
  if (std::memcmp(a.v.data, b.v.data, a.n) != 0) return ::testing::AssertionFailure() << "v codes differ";
  if (std::memcmp(a.ms.data, b.ms.data, 4 * a.blocks) != 0) return ::testing::AssertionFailure() << "m scales differ";
  if (std::memcmp(a.vs.data, b.vs.data, 4 * a.blocks) != 0) return ::testing::AssertionFailure() << "v scales differ";
  for (const Int8State* s : {&a, &b}) {
    for (int64_t i = 0; i < Int8State::kGuard; ++i) {
      if (s->m.data[s->n + i] != 0x55 || s->v.data[s->n + i] != 0xAA || s->ms.data[s->blocks + i] != -7.0f ||
          s->vs.data[s->blocks + i] != -9.0f) {
        return ::testing::AssertionFailure() << "wrote past the end";
      }
    }
  }
  return ::testing::AssertionSuccess();
}

// A realistic FP32 moment state: per-element scales over three decades, v ~ m^2 .. 4 m^2, some
// exact zeros (elements that never had a gradient).
inline void RandomMoments(int64_t n, uint32_t seed, std::vector<float>* m, std::vector<float>* v) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  m->resize(n);
  v->resize(n);
  for (int64_t i = 0; i < n; ++i) {
    const float scale = std::pow(10.0f, -1.0f - 3.0f * u(rng));
    if (u(rng) < 0.03f) {
      (*m)[i] = 0.0f;
      (*v)[i] = 0.0f;
      continue;
    }
    (*m)[i] = scale * normal(rng);
    (*v)[i] = scale * scale * (1.0f + 3.0f * u(rng));
  }
}

}  // namespace slidedp::moments::testing
