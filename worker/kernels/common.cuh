// Device-side pieces the row and element-wise kernel families share (rmsnorm, qk_norm_rope,
// swiglu, embedding, cross_entropy, reductions; Gemma 4's layer kernels): the warp sum, GELU-tanh, 8-wide BF16/FP32 vector loads and
// stores, the grid of the grid-stride kernels, and the partial-row reduction kernel the norm weight
// gradients end in. Included by those .cu files only; launch checks are cuda_check.h's.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace slidedp::kernels {

using bf16 = __nv_bfloat16;

namespace internal {

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// HF's gelu_pytorch_tanh, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), and its derivative (the
// CPU backend's GeluTanh / GeluTanhGrad): GeGLU (swiglu.cu) and Gemma 4's per-layer input gate.
__device__ __forceinline__ float GeluTanh(float g) {
  constexpr float kC = 0.7978845608028654f;  // sqrt(2 / pi)
  return 0.5f * g * (1.0f + tanhf(kC * (g + 0.044715f * g * g * g)));
}
__device__ __forceinline__ float GeluTanhGrad(float g) {
  constexpr float kC = 0.7978845608028654f;
  const float th = tanhf(kC * (g + 0.044715f * g * g * g));
  return 0.5f * (1.0f + th) + 0.5f * g * (1.0f - th * th) * kC * (1.0f + 3.0f * 0.044715f * g * g);
}

// Sum over the block in a fixed order (warp butterflies, then warp 0 sums the warp sums); every
// thread gets it. scratch: 33 floats of shared memory (reusable across calls).
__device__ __forceinline__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
  v = WarpSum(v);
  __syncthreads();  // scratch reuse across calls
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float t = lane < nwarps ? scratch[lane] : 0.0f;
    t = WarpSum(t);
    if (lane == 0) scratch[32] = t;
  }
  __syncthreads();
  return scratch[32];
}

struct alignas(16) Bf16x8 {
  __nv_bfloat162 v[4];
};

__device__ __forceinline__ void Load8(const bf16* p, float* f) {
  Bf16x8 x = *reinterpret_cast<const Bf16x8*>(p);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 t = __bfloat1622float2(x.v[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void Store8(bf16* p, const float* f) {
  Bf16x8 x;
#pragma unroll
  for (int i = 0; i < 4; ++i) x.v[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<Bf16x8*>(p) = x;
}

// FP32 versions (FP32 residual stream): two 16-byte accesses; p must be 16-byte aligned.
__device__ __forceinline__ void Load8(const float* p, float* f) {
  const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
  f[0] = a.x;
  f[1] = a.y;
  f[2] = a.z;
  f[3] = a.w;
  f[4] = b.x;
  f[5] = b.y;
  f[6] = b.z;
  f[7] = b.w;
}

__device__ __forceinline__ void Store8(float* p, const float* f) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// Blocks for a grid-stride loop over `work` items of `threads` per block: at most 16 per SM.
inline int GridFor(int64_t work, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 132 * 16)));
}

// out[c] += Σ_p partial[p][c] (columns c >= split go to out_hi[c - split]). A 32x32 block: thread
// (tx, ty) sums parts ty, ty+32, ... of column tx; the 32 sums are then added in ty order, so the
// result is the same on every run.
// Defined in reductions.cu (behind ReducePartialsInto); qk_norm_rope.cu launches it directly, with
// the q and k norm-weight columns going to two outputs.
__global__ void ReducePartialsKernel(const float* __restrict__ partial, int64_t parts, int64_t cols, int64_t split,
                                     float* out_lo, float* out_hi);

}  // namespace internal
}  // namespace slidedp::kernels
