// The Gemma 4 layer's own kernels (gemma4_kernels.h): memory-bound element- and row-wise passes,
// grid-stride loops; the head norm is one warp per (token, head), reading its row twice (sum of
// squares, then the scaled values), which stays in L1 at the head dims the backend takes (<= 256).
#include "worker/compute/cuda/gemma4_kernels.h"

#include <algorithm>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::cuda_backend_internal {
namespace {

using kernels::internal::GeluTanh;
using kernels::internal::GeluTanhGrad;
using kernels::internal::GridFor;
using kernels::internal::WarpSum;


constexpr int kWarpsPerBlock = 8;  // the head norm's rows per block

// One warp per (token, head) row; rows are numbered t * heads + h.
__global__ void HeadRmsNormForwardKernel(const bf16* __restrict__ x, int64_t ld_x, int64_t tokens, int heads, int hd,
                                         float eps, bf16* __restrict__ y, float* __restrict__ rstd) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = tokens * heads;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / heads;
    const int h = static_cast<int>(r % heads);
    const bf16* xr = x + t * ld_x + static_cast<int64_t>(h) * hd;
    float ss = 0.f;
    for (int i = lane; i < hd; i += 32) {
      const float v = __bfloat162float(xr[i]);
      ss += v * v;
    }
    const float rs = rsqrtf(WarpSum(ss) / hd + eps);
    bf16* yr = y + r * hd;
    for (int i = lane; i < hd; i += 32) yr[i] = __float2bfloat16_rn(__bfloat162float(xr[i]) * rs);
    if (lane == 0) rstd[r] = rs;
  }
}

__global__ void HeadRmsNormBackwardKernel(const bf16* __restrict__ dy, const bf16* __restrict__ x, int64_t ld_x,
                                          const float* __restrict__ rstd, int64_t tokens, int heads, int hd,
                                          bf16* __restrict__ dx, int64_t ld_dx) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = tokens * heads;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < rows;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / heads;
    const int h = static_cast<int>(r % heads);
    const bf16* xr = x + t * ld_x + static_cast<int64_t>(h) * hd;
    const bf16* gr = dy + r * hd;
    const float rs = rstd[r];
    float dot = 0.f;  // Σ dy n
    for (int i = lane; i < hd; i += 32) dot += __bfloat162float(gr[i]) * __bfloat162float(xr[i]) * rs;
    dot = WarpSum(dot) / hd;
    bf16* dr = dx + t * ld_dx + static_cast<int64_t>(h) * hd;
    for (int i = lane; i < hd; i += 32) {
      const float n = __bfloat162float(xr[i]) * rs;
      dr[i] = __float2bfloat16_rn(rs * (__bfloat162float(gr[i]) - n * dot));
    }
  }
}

__global__ void PleInputsCombineKernel(const bf16* __restrict__ normed, const float* __restrict__ ple_token, int64_t n,
                                       float scale, float* __restrict__ ple) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    ple[i] = (__bfloat162float(normed[i]) + ple_token[i]) * scale;
  }
}

__global__ void PleGateForwardKernel(const float* __restrict__ gate, const float* __restrict__ p, int64_t ld_p,
                                     int64_t tokens, int64_t width, bf16* __restrict__ gated) {
  const int64_t n = tokens * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / width, c = i % width;
    gated[i] = __float2bfloat16_rn(GeluTanh(gate[i]) * p[t * ld_p + c]);
  }
}

__global__ void PleGateBackwardKernel(const bf16* __restrict__ dgated, const float* __restrict__ gate,
                                      const float* __restrict__ p, int64_t ld_p, int64_t tokens, int64_t width,
                                      float* __restrict__ dp, bf16* __restrict__ dgate) {
  const int64_t n = tokens * width;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / width, c = i % width;
    const float g = gate[i], d = __bfloat162float(dgated[i]);
    dp[t * ld_p + c] += d * GeluTanh(g);
    dgate[i] = __float2bfloat16_rn(d * p[t * ld_p + c] * GeluTanhGrad(g));
  }
}

__device__ __forceinline__ float AsFloat(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float AsFloat(float v) { return v; }

template <typename TS>
__global__ void ScaleByDeviceScalarKernel(const float* in, int64_t n, const TS* __restrict__ scale, float* out) {
  const float s = AsFloat(scale[0]);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = in[i] * s;
  }
}

__global__ void ScaleF32InPlaceKernel(float* x, int64_t n, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] *= scale;
  }
}

absl::Status CheckHeads(const char* op, int64_t tokens, int heads, int hd) {
  if (tokens < 0 || heads < 1 || hd < 1 || hd > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": tokens ", tokens, ", heads ", heads, ", head dim ", hd,
                                                   " (1..1024)"));
  }
  return absl::OkStatus();
}

template <typename TS>
absl::Status ScaleByDeviceScalarImpl(const float* in, int64_t n, const TS* scale, float* out, cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("ScaleByDeviceScalar: ", n, " elements"));
  if (n == 0) return absl::OkStatus();
  ScaleByDeviceScalarKernel<TS><<<GridFor(n, 256), 256, 0, stream>>>(in, n, scale, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace

absl::Status HeadRmsNormForward(const bf16* x, int64_t ld_x, int64_t tokens, int heads, int hd, float eps, bf16* y,
                                float* rstd, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckHeads("HeadRmsNormForward", tokens, heads, hd));
  if (tokens == 0) return absl::OkStatus();
  // A warp per row: blocks of kWarpsPerBlock rows.
  HeadRmsNormForwardKernel<<<GridFor(tokens * heads, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
      x, ld_x, tokens, heads, hd, eps, y, rstd);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status HeadRmsNormBackward(const bf16* dy, const bf16* x, int64_t ld_x, const float* rstd, int64_t tokens,
                                 int heads, int hd, bf16* dx, int64_t ld_dx, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckHeads("HeadRmsNormBackward", tokens, heads, hd));
  if (tokens == 0) return absl::OkStatus();
  HeadRmsNormBackwardKernel<<<GridFor(tokens * heads, kWarpsPerBlock), 32 * kWarpsPerBlock, 0, stream>>>(
      dy, x, ld_x, rstd, tokens, heads, hd, dx, ld_dx);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status PleInputsCombine(const bf16* normed, const float* ple_token, int64_t n, float scale, float* ple,
                              cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("PleInputsCombine: ", n, " elements"));
  if (n == 0) return absl::OkStatus();
  PleInputsCombineKernel<<<GridFor(n, 256), 256, 0, stream>>>(normed, ple_token, n, scale, ple);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status PleGateForward(const float* gate, const float* p, int64_t ld_p, int64_t tokens, int64_t width,
                            bf16* gated, cudaStream_t stream) {
  if (tokens < 0 || width < 1 || ld_p < width) {
    return absl::InvalidArgumentError(
        absl::StrCat("PleGateForward: tokens ", tokens, ", width ", width, ", row stride ", ld_p));
  }
  if (tokens == 0) return absl::OkStatus();
  PleGateForwardKernel<<<GridFor(tokens * width, 256), 256, 0, stream>>>(gate, p, ld_p, tokens, width, gated);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status PleGateBackward(const bf16* dgated, const float* gate, const float* p, int64_t ld_p, int64_t tokens,
                             int64_t width, float* dp, bf16* dgate, cudaStream_t stream) {
  if (tokens < 0 || width < 1 || ld_p < width) {
    return absl::InvalidArgumentError(
        absl::StrCat("PleGateBackward: tokens ", tokens, ", width ", width, ", row stride ", ld_p));
  }
  if (tokens == 0) return absl::OkStatus();
  PleGateBackwardKernel<<<GridFor(tokens * width, 256), 256, 0, stream>>>(dgated, gate, p, ld_p, tokens, width, dp,
                                                                        dgate);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status ScaleByDeviceScalar(const float* in, int64_t n, const bf16* scale, float* out, cudaStream_t stream) {
  return ScaleByDeviceScalarImpl(in, n, scale, out, stream);
}
absl::Status ScaleByDeviceScalar(const float* in, int64_t n, const float* scale, float* out, cudaStream_t stream) {
  return ScaleByDeviceScalarImpl(in, n, scale, out, stream);
}

absl::Status ScaleF32InPlace(float* x, int64_t n, float scale, cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("ScaleF32InPlace: ", n, " elements"));
  if (n == 0) return absl::OkStatus();
  ScaleF32InPlaceKernel<<<GridFor(n, 256), 256, 0, stream>>>(x, n, scale);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::cuda_backend_internal
