// Embedding kernels; see embedding.h. Memory-bound: the ceiling is device copy bandwidth over the
// bytes each reads and writes once (bench/kernels reports the fraction).
#include "worker/kernels/embedding.h"

#include <algorithm>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace {

// ---- Embedding
// TO: output element type; bf16 is a plain copy, float an exact upcast.
// TI: the table's type (BF16 mirror, or the FP32 master read in place from mapped host memory).
template <typename TI, typename TO>
__global__ void EmbeddingForwardKernel(const TI* __restrict__ embed, const int32_t* __restrict__ tokens,
                                       int64_t num_tokens, int64_t h, float scale, TO* __restrict__ out) {
  const int64_t vec_per_row = h / 8;
  const int64_t n = num_tokens * vec_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vec_per_row, c = (v % vec_per_row) * 8;
    const TI* src = embed + static_cast<int64_t>(tokens[t]) * h + c;
    if constexpr (std::is_same_v<TI, bf16> && std::is_same_v<TO, bf16>) {
      if (scale == 1.0f) {
        *reinterpret_cast<Bf16x8*>(out + t * h + c) = *reinterpret_cast<const Bf16x8*>(src);
        continue;
      }
    }
    float f[8];
    Load8(src, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] *= scale;
    Store8(out + t * h + c, f);
  }
}

template <typename TD>
__global__ void EmbeddingBackwardKernel(const TD* __restrict__ dout, const int32_t* __restrict__ uniq,
                                        const int32_t* __restrict__ seg, const int32_t* __restrict__ sorted_pos,
                                        int64_t h, float scale, float* __restrict__ dembed) {
  const int64_t u = blockIdx.x;
  const int64_t row = uniq[u];
  const int b = seg[u], e = seg[u + 1];
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * 8; c < h; c += static_cast<int64_t>(blockDim.x) * 8) {
    float acc[8] = {};
    for (int p = b; p < e; ++p) {
      float f[8];
      Load8(dout + static_cast<int64_t>(sorted_pos[p]) * h + c, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += f[i] * scale;
    }
    float4* dst = reinterpret_cast<float4*>(dembed + row * h + c);
    float4 d0 = dst[0], d1 = dst[1];
    d0.x += acc[0];
    d0.y += acc[1];
    d0.z += acc[2];
    d0.w += acc[3];
    d1.x += acc[4];
    d1.y += acc[5];
    d1.z += acc[6];
    d1.w += acc[7];
    dst[0] = d0;
    dst[1] = d1;
  }
}

}  // namespace

namespace {
template <typename TI, typename TO>
absl::Status EmbeddingForwardImpl(const TI* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, TO* out,
                                  cudaStream_t stream, float scale) {
  if (h % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("embedding width ", h, " not a multiple of 8"));
  if (num_tokens <= 0) return absl::OkStatus();
  EmbeddingForwardKernel<TI, TO>
      <<<GridFor(num_tokens * h / 8, 256), 256, 0, stream>>>(embed, tokens, num_tokens, h, scale, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TD>
absl::Status EmbeddingBackwardImpl(const TD* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                                   const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                                   cudaStream_t stream, float scale) {
  if (h % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("embedding width ", h, " not a multiple of 8"));
  if (num_unique <= 0) return absl::OkStatus();
  const int threads = static_cast<int>(std::min<int64_t>(256, (h / 8 + 31) / 32 * 32));
  EmbeddingBackwardKernel<TD>
      <<<num_unique, threads, 0, stream>>>(dout, uniq_tokens, seg_offsets, sorted_pos, h, scale, dembed);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}
}  // namespace

absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream, float scale) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream, scale);
}
absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream, float scale) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream, scale);
}
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream, float scale) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream, scale);
}
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream, float scale) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream, scale);
}

absl::Status EmbeddingBackward(const bf16* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream, float scale) {
  return EmbeddingBackwardImpl<bf16>(dout, uniq_tokens, seg_offsets, sorted_pos, num_unique, h, dembed, stream, scale);
}
absl::Status EmbeddingBackward(const float* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream, float scale) {
  return EmbeddingBackwardImpl<float>(dout, uniq_tokens, seg_offsets, sorted_pos, num_unique, h, dembed, stream, scale);
}

}  // namespace slidedp::kernels
