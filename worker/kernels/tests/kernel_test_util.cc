// Host-side kernel-check helpers; see kernel_test_util.h.
#include "worker/kernels/tests/kernel_test_util.h"

#include <cmath>

namespace slidedp::kernel_test {

std::mt19937_64& Rng() {
  static std::mt19937_64 rng;
  return rng;
}

double RelErr(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (!std::isfinite(got[i])) return INFINITY;
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

std::vector<double> RandVec(int64_t n, double scale, double mean) {
  std::normal_distribution<double> d(mean, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = Bf16ToFloat(FloatToBf16(static_cast<float>(d(Rng()))));
  return v;
}
std::vector<bf16_t> ToBf16(const std::vector<double>& v) {
  std::vector<bf16_t> o(v.size());
  for (size_t i = 0; i < v.size(); ++i) o[i] = FloatToBf16(static_cast<float>(v[i]));
  return o;
}
std::vector<float> ToF32(const std::vector<double>& v) { return std::vector<float>(v.begin(), v.end()); }
std::vector<double> RandF32NormWeights(int64_t n, double scale, double mean) {
  std::uniform_real_distribution<double> frac(0.25, 0.45);
  std::bernoulli_distribution negative(0.5);
  std::vector<double> v = RandVec(n, scale, mean);
  for (auto& x : v) {
    const double ulp = x == 0 ? 0.0 : std::ldexp(1.0, std::ilogb(x) - 7);  // BF16: 7 stored mantissa bits
    x = static_cast<float>(x + (negative(Rng()) ? -1 : 1) * frac(Rng()) * ulp);
  }
  return v;
}

std::vector<double> ColumnGain(const std::vector<double>& got, const std::vector<double>& ref, int64_t cols) {
  std::vector<double> num(cols, 0.0), den(cols, 0.0);
  for (size_t i = 0; i < got.size() && i < ref.size(); ++i) {
    num[i % cols] += got[i] * ref[i];
    den[i % cols] += ref[i] * ref[i];
  }
  for (int64_t c = 0; c < cols; ++c) num[c] = den[c] == 0 ? 1.0 : num[c] / den[c];
  return num;
}

std::vector<double> DownBf16(const bf16* p, size_t n) {
  std::vector<bf16_t> h(n);
  cudaMemcpy(h.data(), p, n * 2, cudaMemcpyDeviceToHost);
  std::vector<double> o(n);
  for (size_t i = 0; i < n; ++i) o[i] = Bf16ToFloat(h[i]);
  return o;
}
std::vector<double> DownF32(const float* p, size_t n) {
  std::vector<float> h(n);
  cudaMemcpy(h.data(), p, n * 4, cudaMemcpyDeviceToHost);
  return std::vector<double>(h.begin(), h.end());
}
Dev<bf16>* NewBf16(const std::vector<double>& v) {
  auto* d = new Dev<bf16>(v.size());
  auto h = ToBf16(v);
  cudaMemcpy(d->p, h.data(), h.size() * 2, cudaMemcpyHostToDevice);
  return d;
}

Dev<float>* NewF32(const std::vector<double>& v) {
  auto* d = new Dev<float>(v.size());
  auto h = ToF32(v);
  cudaMemcpy(d->p, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  return d;
}

}  // namespace slidedp::kernel_test
