// SwiGLU kernels; see swiglu.h. Memory-bound: the ceiling is device copy bandwidth over the bytes
// each reads and writes once (bench/kernels reports the fraction).
#include "worker/kernels/swiglu.h"

#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace {

// ---- SwiGLU / GeGLU
__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

// f(g) and f'(g) of the gate's activation.
template <GluActivation F>
__device__ __forceinline__ float Act(float g) {
  if constexpr (F == GluActivation::kSilu) {
    return g * Sigmoid(g);
  } else {
    return GeluTanh(g);
  }
}
template <GluActivation F>
__device__ __forceinline__ float ActGrad(float g) {
  if constexpr (F == GluActivation::kSilu) {
    const float s = Sigmoid(g);
    return s * (1.0f + g * (1.0f - s));
  } else {
    return GeluTanhGrad(g);
  }
}

template <GluActivation F>
__global__ void SwiGluForwardKernel(const bf16* __restrict__ gu, int64_t tokens, int64_t inter,
                                    bf16* __restrict__ act) {
  const int64_t vec_per_row = inter / 8;
  const int64_t n = tokens * vec_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vec_per_row, c = (v % vec_per_row) * 8;
    float g[8], u[8], o[8];
    Load8(gu + t * 2 * inter + c, g);
    Load8(gu + t * 2 * inter + inter + c, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = Act<F>(g[i]) * u[i];
    Store8(act + t * inter + c, o);
  }
}

template <GluActivation F>
__global__ void SwiGluBackwardKernel(const bf16* __restrict__ gu, const bf16* __restrict__ dact, int64_t tokens,
                                     int64_t inter, bf16* __restrict__ dgu) {
  const int64_t vec_per_row = inter / 8;
  const int64_t n = tokens * vec_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vec_per_row, c = (v % vec_per_row) * 8;
    float g[8], u[8], d[8], dg[8], du[8];
    Load8(gu + t * 2 * inter + c, g);
    Load8(gu + t * 2 * inter + inter + c, u);
    Load8(dact + t * inter + c, d);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      du[i] = d[i] * Act<F>(g[i]);
      dg[i] = d[i] * u[i] * ActGrad<F>(g[i]);
    }
    Store8(dgu + t * 2 * inter + c, dg);
    Store8(dgu + t * 2 * inter + inter + c, du);
  }
}

}  // namespace

absl::Status SwiGluForward(const bf16* gu, int64_t tokens, int64_t inter, bf16* act, cudaStream_t stream,
                           GluActivation f) {
  if (inter % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("SwiGLU width ", inter, " not a multiple of 8"));
  if (tokens <= 0) return absl::OkStatus();
  auto* kernel = f == GluActivation::kSilu ? SwiGluForwardKernel<GluActivation::kSilu>
                                           : SwiGluForwardKernel<GluActivation::kGeluTanh>;
  kernel<<<GridFor(tokens * inter / 8, 256), 256, 0, stream>>>(gu, tokens, inter, act);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SwiGluBackward(const bf16* gu, const bf16* dact, int64_t tokens, int64_t inter, bf16* dgu,
                            cudaStream_t stream, GluActivation f) {
  if (inter % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("SwiGLU width ", inter, " not a multiple of 8"));
  if (tokens <= 0) return absl::OkStatus();
  auto* kernel = f == GluActivation::kSilu ? SwiGluBackwardKernel<GluActivation::kSilu>
                                           : SwiGluBackwardKernel<GluActivation::kGeluTanh>;
  kernel<<<GridFor(tokens * inter / 8, 256), 256, 0, stream>>>(gu, dact, tokens, inter, dgu);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
