// Finiteness scans over bulk FP32 data (weights and Adam moments as they are loaded, gradient
// chunks): one pass, branch-free within fixed-size blocks so the compiler vectorizes it at -O2,
// locating the element only inside the block that holds one.
#pragma once

#include <cstdint>
#include <cstring>

namespace slidedp {

enum class FiniteRule {
  kFinite,  // no NaN, no +-inf
  // Adam's second moment: not NaN and not below 0 (-0.0 is allowed). +inf is: a finite gradient
  // above ~1.8e19 squares to it in float (as in PyTorch), and the update of that element is 0.
  kSecondMoment,
};

// True when x breaks `rule`.
inline bool BreaksFiniteRule(float x, FiniteRule rule) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  if (rule == FiniteRule::kFinite) return (b & 0x7fffffffu) >= 0x7f800000u;
  return (b > 0x7f800000u && b != 0x80000000u);  // NaN of either sign, or a negative number
}

// The index of the first element of x[0, n) that breaks `rule`, or -1.
inline int64_t FirstNonFinite(const float* x, int64_t n, FiniteRule rule = FiniteRule::kFinite) {
  constexpr int64_t kBlock = 64;
  int64_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    uint32_t any = 0;
    for (int64_t k = 0; k < kBlock; ++k) {
      uint32_t b;
      std::memcpy(&b, x + i + k, sizeof(b));
      any |= rule == FiniteRule::kFinite ? static_cast<uint32_t>((b & 0x7fffffffu) >= 0x7f800000u)
                                         : static_cast<uint32_t>((b > 0x7f800000u) & (b != 0x80000000u));
    }
    if (any != 0) break;
  }
  for (; i < n; ++i) {
    if (BreaksFiniteRule(x[i], rule)) return i;
  }
  return -1;
}

}  // namespace slidedp
