// The pieces of the CUDA backend's Gemma 4 layer (cuda_gemma4_layer.cc) that worker/kernels does
// not have, internal to worker/compute/cuda (the CPU backend's gemma4_layer_math.cc is their
// oracle, through cuda_backend_gpu_test's gemma4 cases):
// - v_norm, Gemma4RMSNorm without a weight, per head over a strided row (the value projection's
//   columns inside the fused q | k | v rows), forward and backward;
// - the per-layer inputs: their formation in layer 0 (the normed projection plus the scaled table
//   rows, times 2^-0.5) and each layer's gate, gelu_tanh(gate) x p_l, forward and backward;
// - scaling by a device scalar (layer_scalar, a buffer that streams with the layer) and by a host one.
//
// Launchers as in worker/kernels: tensors, sizes and an explicit stream in, a Status out (bad sizes
// INVALID_ARGUMENT, launch failures INTERNAL), never a synchronization. BF16 storage, FP32 math.
// Deterministic: fixed summation orders, no atomics. Memory-bound element- and row-wise passes.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace slidedp::cuda_backend_internal {

using bf16 = __nv_bfloat16;

// y[t, h] = bf16(x[t, h] * rstd[t, h]), rstd[t, h] = 1 / sqrt(mean(x[t, h]^2) + eps), for `heads`
// heads of hd columns per token: head h of token t at x + t * ld_x + h * hd (row stride ld_x), y
// contiguous [tokens, heads * hd], rstd [tokens, heads]. hd in [1, 1024].
absl::Status HeadRmsNormForward(const bf16* x, int64_t ld_x, int64_t tokens, int heads, int hd, float eps, bf16* y,
                                float* rstd, cudaStream_t stream);
// Its backward: dx[t, h] = rstd (dy - n mean(dy n)), n = x rstd (FP32), written as BF16 at the
// forward's columns of dx (row stride ld_dx); dy contiguous like y.
absl::Status HeadRmsNormBackward(const bf16* dy, const bf16* x, int64_t ld_x, const float* rstd, int64_t tokens,
                                 int heads, int hd, bf16* dx, int64_t ld_dx, cudaStream_t stream);

// ple[i] = (float(normed[i]) + ple_token[i]) * scale over n elements (Gemma4TextModel's per-layer
// inputs: the normed projection plus the scaled table rows, times per_layer_input_scale).
absl::Status PleInputsCombine(const bf16* normed, const float* ple_token, int64_t n, float scale, float* ple,
                              cudaStream_t stream);

// gated[t, i] = bf16(gelu_tanh(gate[t, i]) * p[t * ld_p + i]) for i < width: gate [tokens, width]
// (FP32), p the layer's columns of the per-layer inputs (row stride ld_p).
absl::Status PleGateForward(const float* gate, const float* p, int64_t ld_p, int64_t tokens, int64_t width,
                            bf16* gated, cudaStream_t stream);
// Its backward from dgated [tokens, width]: dp[t * ld_p + i] += dgated * gelu_tanh(gate) (FP32; each
// element added once), dgate = bf16(dgated * p * gelu_tanh'(gate)).
absl::Status PleGateBackward(const bf16* dgated, const float* gate, const float* p, int64_t ld_p, int64_t tokens,
                             int64_t width, float* dp, bf16* dgate, cudaStream_t stream);

// out[i] = in[i] * float(scale[0]) over n elements; scale a device scalar (BF16, or its FP32 side
// copy). out may alias in.
absl::Status ScaleByDeviceScalar(const float* in, int64_t n, const bf16* scale, float* out, cudaStream_t stream);
absl::Status ScaleByDeviceScalar(const float* in, int64_t n, const float* scale, float* out, cudaStream_t stream);
// x[i] *= scale over n elements.
absl::Status ScaleF32InPlace(float* x, int64_t n, float scale, cudaStream_t stream);

}  // namespace slidedp::cuda_backend_internal
