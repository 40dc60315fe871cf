// Host-side helpers for checking CUDA kernels against a CPU reference: random BF16-representable
// data (kept as doubles for the FP64 reference), NaN-poisoned device buffers and their
// upload/download, and the relative L2 error the checks compare by. No gtest here, so that tools
// (attn_layouts_check) share it; the gtest parts are in gpu_test.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "common/numeric/bf16.h"

namespace slidedp::kernel_test {

using bf16 = __nv_bfloat16;  // kernels::bf16

// The random engine every helper draws from. Tests reseed it per case (gpu_test.h), tools once.
std::mt19937_64& Rng();

// ‖got − ref‖ / ‖ref‖ (‖got − ref‖ where ref is all zero); INFINITY if got holds a NaN or an inf.
double RelErr(const std::vector<double>& got, const std::vector<double>& ref);

// Random BF16-representable values, N(mean, scale²), as doubles for the reference.
std::vector<double> RandVec(int64_t n, double scale = 1.0, double mean = 0.0);
std::vector<bf16_t> ToBf16(const std::vector<double>& v);
std::vector<float> ToF32(const std::vector<double>& v);
// Norm weights as FP32 master weights: BF16 values around `mean` plus fine-tuning updates of
// 0.25..0.45 BF16 ulp with random sign, the largest that rounding to BF16 still loses entirely.
// The values are FP32-exact and not BF16-representable.
std::vector<double> RandF32NormWeights(int64_t n, double scale, double mean);

// Least-squares gain of got against ref per column of a [rows, cols] row-major matrix:
// g[c] = Σ_r got·ref / Σ_r ref². BF16 output rounding averages out over the rows, so a per-column
// scale error such as an FP32 norm weight rounded to BF16 shows as |g - 1|, while it hides inside
// the element-wise tolerance. Compare against ones.
std::vector<double> ColumnGain(const std::vector<double>& got, const std::vector<double>& ref, int64_t cols);

// A device buffer of `count` T, poisoned with NaN (all bits set) when made, so a kernel that
// leaves part of its output unwritten fails the comparison. p is null if cudaMalloc failed.
template <typename T>
struct Dev {
  T* p = nullptr;
  size_t n = 0;
  explicit Dev(size_t count) : n(count) {
    if (cudaMalloc(&p, std::max<size_t>(1, n) * sizeof(T)) != cudaSuccess) p = nullptr;
    Poison();
  }
  ~Dev() { cudaFree(p); }
  Dev(const Dev&) = delete;
  // BF16 0xFFFF and FP32 0xFFFFFFFF are NaN.
  void Poison() {
    cudaMemset(p, 0xFF, n * sizeof(T));
    cudaDeviceSynchronize();
  }
  T* get() const { return p; }
};

template <typename T>
void Upload(Dev<T>& d, const std::vector<T>& h) {
  cudaMemcpy(d.p, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice);
}
std::vector<double> DownBf16(const bf16* p, size_t n);
std::vector<double> DownF32(const float* p, size_t n);
Dev<bf16>* NewBf16(const std::vector<double>& v);
Dev<float>* NewF32(const std::vector<double>& v);

// Typed helpers: T is bf16 (BF16 residual stream) or float (FP32 residual stream, or FP32 norm
// weights).
template <typename T>
Dev<T>* NewAct(const std::vector<double>& v) {
  if constexpr (std::is_same_v<T, bf16>) {
    return NewBf16(v);
  } else {
    return NewF32(v);
  }
}
inline std::vector<double> Down(const bf16* p, size_t n) { return DownBf16(p, n); }
inline std::vector<double> Down(const float* p, size_t n) { return DownF32(p, n); }
template <typename T>
const char* ActName() {
  return std::is_same_v<T, bf16> ? "bf16" : "fp32";
}

}  // namespace slidedp::kernel_test
