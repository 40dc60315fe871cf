// What the reference math's files share (dense_reference_math.cc: the op-level references;
// dense_attention_math.cc; dense_decoder_layer_math.cc; dense_model_math.cc; moe_reference_math.cc):
// the inner loops its ops are built of, the SwiGLU of the dense MLP and the experts, and gemma3's
// GeGLU. Internal to worker/compute/cpu.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "common/model/model_config.h"

namespace slidedp::dense_math {

// y[t, :] += b for each of T rows of O.
template <typename R>
inline void AddBiasRows(const R* b, int64_t T, int64_t O, R* y) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < O; ++o) y[t * O + o] += b[o];
}

// db += the sum over the T rows of dy [T, O] (formed first, in row order, then added once): a bias's
// gradient.
template <typename R>
inline void BiasBackward(const R* dy, int64_t T, int64_t O, R* db) {
  std::vector<R> acc(O, R(0));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < O; ++o) acc[o] += dy[t * O + o];
  for (int64_t o = 0; o < O; ++o) db[o] += acc[o];
}

// Dot product with 8 independent partial sums (vectorizable without reassociation flags).
template <typename R>
inline R Dot(const R* a, const R* b, int64_t n) {
  R acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  R tail = 0;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

// y += a x over n elements.
template <typename R>
inline void Axpy(R a, const R* x, R* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

template <typename R>
inline R Sigmoid(R g) {
  return R(1) / (R(1) + std::exp(-g));
}

// m = silu(gate) * up over n elements.
template <typename R>
inline void SwiGlu(const R* gate, const R* up, int64_t n, R* m) {
  for (int64_t i = 0; i < n; ++i) m[i] = gate[i] * Sigmoid(gate[i]) * up[i];
}

// Its backward from dm = dL/dm: dgate and dup (overwritten).
template <typename R>
inline void SwiGluBackward(const R* gate, const R* up, const R* dm, int64_t n, R* dgate, R* dup) {
  for (int64_t i = 0; i < n; ++i) {
    const R gt = gate[i], sg = Sigmoid(gt);
    dup[i] = dm[i] * gt * sg;
    dgate[i] = dm[i] * up[i] * (sg * (R(1) + gt * (R(1) - sg)));
  }
}

// PyTorch's gelu(x, approximate="tanh") (HF's gelu_pytorch_tanh): 0.5 x (1 + tanh(b (x + k x^3))),
// b = sqrt(2 / pi), k = 0.044715; and its derivative as PyTorch's GeluBackward computes it:
// 0.5 (1 + t) + 0.5 x (1 - t^2) b (1 + 3 k x^2), t the same tanh.
template <typename R>
struct GeluTanhTerms {
  static constexpr double kBeta = 0.7978845608028654;  // M_SQRT2 * M_2_SQRTPI * 0.5
  static constexpr double kKappa = 0.044715;
  static R Inner(R x) { return R(kBeta) * (x + R(kKappa) * (x * x * x)); }
};

template <typename R>
inline R GeluTanh(R x) {
  return R(0.5) * x * (R(1) + std::tanh(GeluTanhTerms<R>::Inner(x)));
}

template <typename R>
inline R GeluTanhGrad(R x) {
  const R t = std::tanh(GeluTanhTerms<R>::Inner(x));
  const R inner_grad = R(GeluTanhTerms<R>::kBeta) * (R(1) + R(3) * R(GeluTanhTerms<R>::kKappa) * (x * x));
  return R(0.5) * (R(1) + t) + R(0.5) * x * (R(1) - t * t) * inner_grad;
}

// m = act(gate) * up over n elements: SwiGLU, or gemma3's GeGLU.
template <typename R>
inline void GatedMlp(MlpActivation act, const R* gate, const R* up, int64_t n, R* m) {
  if (act == MlpActivation::kSilu) return SwiGlu(gate, up, n, m);
  for (int64_t i = 0; i < n; ++i) m[i] = GeluTanh(gate[i]) * up[i];
}

// Its backward from dm = dL/dm: dgate and dup (overwritten).
template <typename R>
inline void GatedMlpBackward(MlpActivation act, const R* gate, const R* up, const R* dm, int64_t n, R* dgate, R* dup) {
  if (act == MlpActivation::kSilu) return SwiGluBackward(gate, up, dm, n, dgate, dup);
  for (int64_t i = 0; i < n; ++i) {
    dup[i] = dm[i] * GeluTanh(gate[i]);
    dgate[i] = dm[i] * up[i] * GeluTanhGrad(gate[i]);
  }
}

}  // namespace slidedp::dense_math
