// What the reference math's files share (dense_reference_math.cc: the op-level references;
// dense_attention_math.cc; dense_decoder_layer_math.cc; dense_model_math.cc; moe_reference_math.cc):
// the inner loops its ops are built of and the SwiGLU of the dense MLP and the experts. Internal to
// worker/compute/cpu.
#pragma once

#include <cmath>
#include <cstdint>

namespace slidedp::dense_math {

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

}  // namespace slidedp::dense_math
