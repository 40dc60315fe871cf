// RMSNorm kernels; see rmsnorm.h. Memory-bound: the ceiling is device copy bandwidth over the
// bytes each reads and writes once (bench/kernels reports the fraction).
#include "worker/kernels/rmsnorm.h"

#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/reductions.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace {

int BlockThreadsForWidth(int64_t h) { return static_cast<int>(((h / 8) + 31) / 32 * 32); }

absl::Status CheckNormWidth(int64_t h) {
  if (h <= 0 || h % 8 != 0 || h > 8192) {
    return absl::InvalidArgumentError(absl::StrCat("RMSNorm width ", h, " must be a positive multiple of 8, <= 8192"));
  }
  return absl::OkStatus();
}

// ---- RMSNorm: one thread per 8 columns; a block walks rows with a grid stride, two rows per
// iteration so two loads per thread are in flight across the block reduction.
__device__ __forceinline__ float2 BlockSum2(float2 v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v.x = WarpSum(v.x);
  v.y = WarpSum(v.y);
  __syncthreads();
  if (lane == 0) {
    scratch[warp] = v.x;
    scratch[32 + warp] = v.y;
  }
  __syncthreads();
  if (warp == 0) {
    float a = lane < nwarps ? scratch[lane] : 0.0f, b = lane < nwarps ? scratch[32 + lane] : 0.0f;
    a = WarpSum(a);
    b = WarpSum(b);
    if (lane == 0) {
      scratch[64] = a;
      scratch[65] = b;
    }
  }
  __syncthreads();
  return make_float2(scratch[64], scratch[65]);
}

// A thread's 8 norm weights widened to FP32, as the norm applies them: w, or 1 + w in FP32
// (NormWeight::kOnePlus; kPlain adds nothing, so its results stay bit-identical).
template <typename TW>
__device__ __forceinline__ void LoadNormWeight8(const TW* w, NormWeight weight, float* wf) {
  Load8(w, wf);
  if (weight == NormWeight::kOnePlus) {
#pragma unroll
    for (int i = 0; i < 8; ++i) wf[i] += 1.0f;
  }
}

// TX: the input (residual stream) element type, bf16 or float; y is always BF16. TW: the norm
// weight type, bf16 or float (FP32 master weights); each thread widens its 8 weights to FP32 once.
template <typename TX, typename TW>
__global__ void RmsNormForwardKernel(const TX* __restrict__ x, const TW* __restrict__ w, NormWeight weight,
                                     int64_t rows, int h, float eps, bf16* __restrict__ y,
                                     float* __restrict__ rstd_out) {
  __shared__ float scratch[66];
  const int c = threadIdx.x * 8;
  const bool active = c < h;
  float wf[8] = {};
  if (active) LoadNormWeight8(w + c, weight, wf);
  for (int64_t r0 = blockIdx.x; r0 < rows; r0 += 2 * static_cast<int64_t>(gridDim.x)) {
    const int64_t r1 = r0 + gridDim.x;
    const bool has1 = r1 < rows;
    float x0[8] = {}, x1[8] = {};
    if (active) {
      Load8(x + r0 * h + c, x0);
      if (has1) Load8(x + r1 * h + c, x1);
    }
    float2 ss = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      ss.x += x0[i] * x0[i];
      ss.y += x1[i] * x1[i];
    }
    ss = BlockSum2(ss, scratch);
    const float rs0 = rsqrtf(ss.x / h + eps), rs1 = rsqrtf(ss.y / h + eps);
    if (active) {
      float o[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = wf[i] * (x0[i] * rs0);
      Store8(y + r0 * h + c, o);
      if (has1) {
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = wf[i] * (x1[i] * rs1);
        Store8(y + r1 * h + c, o);
      }
    }
    if (threadIdx.x == 0 && rstd_out != nullptr) {
      rstd_out[r0] = rs0;
      if (has1) rstd_out[r1] = rs1;
    }
  }
}

// TA: the element type of dy, x, dres and dx (bf16, or float for the FP32 residual stream); TW: the
// norm weight type, as in the forward. dx takes the applied weight (w or 1 + w); dw is Σ dy * n.
template <typename TA, typename TW>
__global__ void RmsNormBackwardKernel(const TA* __restrict__ dy, const TA* __restrict__ x, const TW* __restrict__ w,
                                      NormWeight weight, const float* __restrict__ rstd_in, const TA* dres,
                                      int64_t rows, int h, TA* dx, float* __restrict__ partial) {
  __shared__ float scratch[66];
  const int c = threadIdx.x * 8;
  const bool active = c < h;
  float wf[8] = {}, dw[8] = {};
  if (active) LoadNormWeight8(w + c, weight, wf);
  for (int64_t r0 = blockIdx.x; r0 < rows; r0 += 2 * static_cast<int64_t>(gridDim.x)) {
    const int64_t r1 = r0 + gridDim.x;
    const bool has1 = r1 < rows;
    float x0[8] = {}, g0[8] = {}, x1[8] = {}, g1[8] = {};
    if (active) {
      Load8(x + r0 * h + c, x0);
      Load8(dy + r0 * h + c, g0);
      if (has1) {
        Load8(x + r1 * h + c, x1);
        Load8(dy + r1 * h + c, g1);
      }
    }
    const float rs0 = rstd_in[r0], rs1 = has1 ? rstd_in[r1] : 0.f;
    float2 dot = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float xh0 = x0[i] * rs0, xh1 = x1[i] * rs1;
      dw[i] += g0[i] * xh0 + g1[i] * xh1;
      dot.x += g0[i] * wf[i] * xh0;
      dot.y += g1[i] * wf[i] * xh1;
    }
    dot = BlockSum2(dot, scratch);
    dot.x /= h;
    dot.y /= h;
    if (active) {
      float res[8] = {}, o[8];
      if (dres != nullptr) Load8(dres + r0 * h + c, res);
#pragma unroll
      for (int i = 0; i < 8; ++i) o[i] = res[i] + rs0 * (g0[i] * wf[i] - x0[i] * rs0 * dot.x);
      Store8(dx + r0 * h + c, o);
      if (has1) {
        if (dres != nullptr) Load8(dres + r1 * h + c, res);
#pragma unroll
        for (int i = 0; i < 8; ++i) o[i] = res[i] + rs1 * (g1[i] * wf[i] - x1[i] * rs1 * dot.y);
        Store8(dx + r1 * h + c, o);
      }
    }
  }
  if (active && partial != nullptr) {
#pragma unroll
    for (int i = 0; i < 8; ++i) partial[blockIdx.x * static_cast<int64_t>(h) + c + i] = dw[i];
  }
}

}  // namespace

namespace {
template <typename TX, typename TW>
absl::Status RmsNormForwardImpl(const TX* x, const TW* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                                cudaStream_t stream, NormWeight weight) {
  absl::Status s = CheckNormWidth(h);
  if (!s.ok()) return s;
  if (rows <= 0) return absl::OkStatus();
  RmsNormForwardKernel<TX, TW><<<PartialBlocks(rows), BlockThreadsForWidth(h), 0, stream>>>(
      x, w, weight, rows, static_cast<int>(h), eps, y, rstd);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TA, typename TW>
absl::Status RmsNormBackwardImpl(const TA* dy, const TA* x, const TW* w, const float* rstd, const TA* dres,
                                 int64_t rows, int64_t h, TA* dx, float* dw, float* ws, cudaStream_t stream,
                                 NormWeight weight) {
  absl::Status s = CheckNormWidth(h);
  if (!s.ok()) return s;
  if (rows <= 0) return absl::OkStatus();
  const int64_t blocks = PartialBlocks(rows);
  RmsNormBackwardKernel<TA, TW><<<blocks, BlockThreadsForWidth(h), 0, stream>>>(
      dy, x, w, weight, rstd, dres, rows, static_cast<int>(h), dx, dw ? ws : nullptr);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (dw != nullptr) return ReducePartialsInto(ws, blocks, h, dw, stream);
  return absl::OkStatus();
}
}  // namespace

absl::Status RmsNormForward(const bf16* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream, weight);
}
absl::Status RmsNormForward(const bf16* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream, weight);
}
absl::Status RmsNormForward(const float* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream, weight);
}
absl::Status RmsNormForward(const float* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream, weight);
}

int64_t RmsNormBackwardWorkspaceNumel(int64_t rows, int64_t h) { return PartialBlocks(rows) * h; }

absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream, weight);
}
absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const float* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream, weight);
}
absl::Status RmsNormBackward(const float* dy, const float* x, const bf16* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream, weight);
}
absl::Status RmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream, weight);
}

}  // namespace slidedp::kernels
