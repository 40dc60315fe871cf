// SwiGLU of a Qwen3 MLP block over the fused [gate | up] GEMM output, forward and backward.
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

// act[t, i] = silu(gu[t, i]) * gu[t, I + i]   (gu = [gate | up], row stride 2I).
absl::Status SwiGluForward(const bf16* gu, int64_t tokens, int64_t inter, bf16* act, cudaStream_t stream);
// dgu[t, i] = dact * up * silu'(gate), dgu[t, I + i] = dact * silu(gate).
absl::Status SwiGluBackward(const bf16* gu, const bf16* dact, int64_t tokens, int64_t inter, bf16* dgu,
                            cudaStream_t stream);

}  // namespace slidedp::kernels
