// The gated MLP's activation over the fused [gate | up] GEMM output, forward and backward: SwiGLU
// (Qwen, Llama, Mistral: silu) or GeGLU with the tanh-approximated GELU (Gemma: HF's
// gelu_pytorch_tanh, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))).
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

enum class GluActivation { kSilu, kGeluTanh };

// act[t, i] = f(gu[t, i]) * gu[t, I + i]   (gu = [gate | up], row stride 2I; f per `f`).
absl::Status SwiGluForward(const bf16* gu, int64_t tokens, int64_t inter, bf16* act, cudaStream_t stream,
                           GluActivation f = GluActivation::kSilu);
// dgu[t, i] = dact * up * f'(gate), dgu[t, I + i] = dact * f(gate).
absl::Status SwiGluBackward(const bf16* gu, const bf16* dact, int64_t tokens, int64_t inter, bf16* dgu,
                            cudaStream_t stream, GluActivation f = GluActivation::kSilu);

}  // namespace slidedp::kernels
