// Token embedding gather (BF16 or FP32 rows into a BF16 or FP32 residual stream) and its
// deterministic, atomic-free backward.
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

// out[t] = embed[tokens[t]] x scale (embed [vocab, h]; scale: Gemma's sqrt(hidden), 1 elsewhere, which
// copies the rows bit for bit): BF16 rows (the FP32 output upcasts, exact), or
// FP32 rows (the BF16 output rounds to nearest even, as the mirror does). An FP32 table may be
// mapped host memory (the job's master, read in place over PCIe; cudaHostGetDevicePointer).
absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream, float scale = 1.0f);
absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream, float scale = 1.0f);
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream, float scale = 1.0f);
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream, float scale = 1.0f);
// Deterministic, atomic-free backward over a host-built grouping of positions by token id:
// for each u < num_unique: dembed[uniq_tokens[u]] += Σ_{p in seg} dout[sorted_pos[p]] x scale, summed
// in position order (seg = [seg_offsets[u], seg_offsets[u+1])).
absl::Status EmbeddingBackward(const bf16* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream, float scale = 1.0f);
absl::Status EmbeddingBackward(const float* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream, float scale = 1.0f);

}  // namespace slidedp::kernels
