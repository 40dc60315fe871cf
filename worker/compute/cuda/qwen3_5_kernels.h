// Two pieces of the CUDA backend's Qwen3.5 layer (cuda_qwen3_5_layer.cc) that worker/kernels does not
// have, internal to worker/compute/cuda:
// - The gated delta rule for head dims the chunked kernels refuse (worker/kernels/gated_delta.h takes
//   dk, dv in {64, 128}; the CI-sized tiny-qwen3.5 presets have 16): the plain per-token recurrence
//   of gated_delta.h's header, one block per (document, value head), a thread per column of the state.
//   Limits: sequential over each document's tokens (no tensor cores), and the backward stores every
//   state, T·nv·dk·dv FP32 of workspace: for test-sized models, not for training at scale.
// - qwen3_5_moe's shared-expert gate, y += σ(xn·w_gate) · shared_expert(xn), forward and backward
//   (the shared expert's GEMMs and SwiGLU are the backend's usual ones).
// Both are checked through cuda_backend_gpu_test against the CPU backend (the FP32 oracle).
//
// Launchers as in worker/kernels: tensors, sizes and an explicit stream in, a Status out (bad sizes
// INVALID_ARGUMENT), never a synchronization. Deterministic: fixed summation orders, no atomics.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "worker/kernels/gated_delta.h"

namespace slidedp::cuda_backend_internal {

using bf16 = __nv_bfloat16;

// ---- The recurrent gated delta rule (layouts, g, beta and scale exactly as kernels::GatedDeltaArgs;
// 1 <= dk, dv <= 128, nv a multiple of nk). CheckRecurrentDelta: OK when the sizes are taken
// (cu_seqlens is not read).
absl::Status CheckRecurrentDelta(const kernels::GatedDeltaArgs& a);
int64_t RecurrentDeltaBackwardWorkspaceBytes(const kernels::GatedDeltaArgs& a);
absl::Status RecurrentDeltaForward(const kernels::GatedDeltaArgs& a, const bf16* q, const bf16* k, const bf16* v,
                                   const float* g, const float* beta, bf16* o, cudaStream_t stream);
// All gradients overwritten; dq and dk sum the value heads of a key head in ascending order.
// ws: RecurrentDeltaBackwardWorkspaceBytes, 256-byte aligned.
absl::Status RecurrentDeltaBackward(const kernels::GatedDeltaArgs& a, const bf16* q, const bf16* k, const bf16* v,
                                    const float* g, const float* beta, const bf16* d_o, float* dq, float* dk,
                                    float* dv, float* dg, float* dbeta, void* ws, cudaStream_t stream);

// ---- The shared expert's gate (HF Qwen3_5MoeSparseMoeBlock: shared_expert_gate is Linear(H, 1)).
// logit[t] = bf16(Σ_h xn[t, h] · w[h]) (F.linear under autocast: a BF16 output), kept as FP32.
absl::Status SharedGateLogits(const bf16* xn, const bf16* w, int64_t tokens, int64_t hidden, float* logit,
                              cudaStream_t stream);
// out[t, h] += σ(logit[t]) · ys[t, h] in FP32 (out: the routed experts' FP32 sum; ys: the shared
// expert's BF16 down_proj output).
absl::Status SharedExpertAddGated(const bf16* ys, const float* logit, int64_t tokens, int64_t hidden, float* out,
                                  cudaStream_t stream);
// From dy = dL/dout [T, H] FP32: dys = bf16(dy · σ(logit)) (the down_proj GEMMs' input) and
// dlogit[t] = σ(1 − σ) · Σ_h dy[t, h] · ys[t, h] (FP32).
absl::Status SharedExpertGateBackward(const float* dy, const bf16* ys, const float* logit, int64_t tokens,
                                      int64_t hidden, bf16* dys, float* dlogit, cudaStream_t stream);
// dxn[t, h] += dlogit[t] · w[h] (FP32) and dw[h] += Σ_t dlogit[t] · xn[t, h] (FP32, partial row sums
// in ws, then a fixed-order pass).
int64_t SharedGateInputBackwardWorkspaceNumel(int64_t tokens, int64_t hidden);
absl::Status SharedGateInputBackward(const float* dlogit, const bf16* w, const bf16* xn, int64_t tokens,
                                     int64_t hidden, float* dxn, float* dw, float* ws, cudaStream_t stream);

}  // namespace slidedp::cuda_backend_internal
