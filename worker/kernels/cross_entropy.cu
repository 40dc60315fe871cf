// Cross-entropy kernel; see cross_entropy.h. Memory-bound: the ceiling is device copy bandwidth
// over the bytes it reads and writes once (bench/kernels reports the fraction).
#include "worker/kernels/cross_entropy.h"

#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace {

// ---- Cross entropy over a BF16 logits row, one block per row.
__device__ __forceinline__ void OnlineMerge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) {
    m = m2;
    s = s2;
    return;
  }
  if (m2 > m) {
    s = s * __expf(m - m2) + s2;
    m = m2;
  } else {
    s += s2 * __expf(m2 - m);
  }
}

// Soft-capping (Gemma): the loss is over z = cap tanh(l / cap) of the stored logits l, and the
// stored gradient is dL/dl = dL/dz (1 - (z / cap)^2). Without it z = l.
template <bool kCap>
__device__ __forceinline__ float Capped(float l, float cap) {
  if constexpr (kCap) {
    return cap * tanhf(l / cap);
  } else {
    return l;
  }
}
template <bool kCap>
__device__ __forceinline__ float CapGrad(float z, float cap) {
  if constexpr (kCap) {
    const float t = z / cap;
    return 1.0f - t * t;
  } else {
    return 1.0f;
  }
}

template <bool kCap>
__global__ void CrossEntropyKernel(bf16* logits, int64_t vocab, int64_t ld, const int32_t* __restrict__ labels,
                                   int32_t ignore_index, float loss_scale, float cap, float* __restrict__ row_loss) {
  __shared__ float sm_m[32], sm_s[32];
  __shared__ float lse_shared;
  const int64_t r = blockIdx.x;
  bf16* row = logits + r * ld;
  const int32_t label = labels[r];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t nvec = vocab / 8;
  if (label == ignore_index) {
    Bf16x8 z;
#pragma unroll
    for (int i = 0; i < 4; ++i) z.v[i] = __floats2bfloat162_rn(0.f, 0.f);
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) *reinterpret_cast<Bf16x8*>(row + v * 8) = z;
    for (int64_t j = nvec * 8 + threadIdx.x; j < vocab; j += blockDim.x) row[j] = __float2bfloat16(0.f);
    if (threadIdx.x == 0) row_loss[r] = 0.f;
    return;
  }
  float m = -INFINITY, s = 0.f;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[8];
    Load8(row + v * 8, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = Capped<kCap>(f[i], cap);
    float mx = f[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) mx = fmaxf(mx, f[i]);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += __expf(f[i] - mx);
    OnlineMerge(m, s, mx, sum);
  }
  for (int64_t j = nvec * 8 + threadIdx.x; j < vocab; j += blockDim.x) {
    OnlineMerge(m, s, Capped<kCap>(__bfloat162float(row[j]), cap), 1.f);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    OnlineMerge(m, s, m2, s2);
  }
  if (lane == 0) {
    sm_m[warp] = m;
    sm_s[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mm = sm_m[0], ssum = sm_s[0];
    for (int w = 1; w < nwarps; ++w) OnlineMerge(mm, ssum, sm_m[w], sm_s[w]);
    const float lse = mm + logf(ssum);
    lse_shared = lse;
    row_loss[r] = loss_scale * (lse - Capped<kCap>(__bfloat162float(row[label]), cap));
  }
  __syncthreads();
  const float lse = lse_shared;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[8];
    Load8(row + v * 8, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float z = Capped<kCap>(f[i], cap);
      f[i] = loss_scale * (__expf(z - lse) - (v * 8 + i == label ? 1.f : 0.f)) * CapGrad<kCap>(z, cap);
    }
    Store8(row + v * 8, f);
  }
  for (int64_t j = nvec * 8 + threadIdx.x; j < vocab; j += blockDim.x) {
    const float z = Capped<kCap>(__bfloat162float(row[j]), cap);
    row[j] = __float2bfloat16(loss_scale * (__expf(z - lse) - (j == label ? 1.f : 0.f)) * CapGrad<kCap>(z, cap));
  }
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

absl::Status CrossEntropyInPlace(bf16* logits, int64_t rows, int64_t vocab, int64_t ld, const int32_t* labels,
                                 int32_t ignore_index, float loss_scale, float* row_loss, cudaStream_t stream,
                                 float softcap) {
  if (ld % 8 != 0 || !Aligned16(logits)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cross entropy: logits row stride ", ld, " must be a multiple of 8 and the base 16-byte aligned"));
  }
  if (!(softcap >= 0.0f) || std::isinf(softcap)) {
    return absl::InvalidArgumentError(absl::StrCat("cross entropy: soft cap ", softcap, " (0: none, else finite > 0)"));
  }
  if (rows <= 0) return absl::OkStatus();
  if (softcap > 0.0f) {
    CrossEntropyKernel<true><<<rows, 512, 0, stream>>>(logits, vocab, ld, labels, ignore_index, loss_scale, softcap,
                                                       row_loss);
  } else {
    CrossEntropyKernel<false><<<rows, 512, 0, stream>>>(logits, vocab, ld, labels, ignore_index, loss_scale, 0.0f,
                                                        row_loss);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
