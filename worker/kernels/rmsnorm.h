// RMSNorm forward and backward launchers of a decoder layer and the head: BF16 or FP32 activations
// (the FP32 residual stream), BF16 or FP32 norm weights acting as w or as (1 + w) (NormWeight); the
// weight gradient goes through the two-stage deterministic reduction of reductions.h.
//
// Every launcher takes its tensors, sizes and an explicit stream, returns a Status (bad sizes are
// INVALID_ARGUMENT, launch failures INTERNAL) and never synchronizes. BF16 storage, FP32 math.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

// How a norm weight w scales the normalized row n: kPlain y = n * w (Llama, Qwen2/3); kOnePlus
// y = n * (1 + w), 1 + w formed in FP32 from the stored weight (Qwen3.5's zero-centred weights, HF
// Qwen3NextRMSNorm: norm(x.float()) * (1.0 + w.float())). Backward: dx uses the same factor; the
// weight gradient is Σ dy * n either way. kPlain is bit-identical to the launchers before the option.
enum class NormWeight { kPlain, kOnePlus };

// y[r] = bf16(w' * (x[r] * rstd[r])) in FP32 (w' = w, or 1 + w: NormWeight), rstd[r] =
// 1/sqrt(mean(x[r]^2) + eps). rstd may be null. Needs h % 8 == 0 and h <= 8192 (one thread per 8 columns).
// Every RMSNorm and q/k-norm launcher takes the norm weight w either in BF16 or in FP32 (HF
// autocast multiplies by the FP32 master weight; BF16 weights near 1.0 lose small updates). Only
// the load differs; w must be 16-byte aligned.
absl::Status RmsNormForward(const bf16* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight = NormWeight::kPlain);
absl::Status RmsNormForward(const bf16* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight = NormWeight::kPlain);

// FP32-residual variant (HF autocast with an FP32 residual stream): x is FP32, the norm is
// computed in FP32 and y = bf16(w' * (x * rstd)) is the BF16 input of the following GEMM.
absl::Status RmsNormForward(const float* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight = NormWeight::kPlain);
absl::Status RmsNormForward(const float* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream, NormWeight weight = NormWeight::kPlain);

// dx = RMSNorm'(x)ᵀ dy (+ dres if non-null) with the forward's w', dw += Σ_r dy[r] * x[r] * rstd[r]
// (may be null; the gradient of w, whichever NormWeight).
// rstd: from forward. ws: RmsNormBackwardWorkspaceNumel floats. dx may alias dres.
int64_t RmsNormBackwardWorkspaceNumel(int64_t rows, int64_t h);
absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight = NormWeight::kPlain);
absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const float* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight = NormWeight::kPlain);
// FP32-residual variant: dy, x, dres and dx are all FP32 (same math, no BF16 rounding of dx).
absl::Status RmsNormBackward(const float* dy, const float* x, const bf16* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight = NormWeight::kPlain);
absl::Status RmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream,
                             NormWeight weight = NormWeight::kPlain);

}  // namespace slidedp::kernels
