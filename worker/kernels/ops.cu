// Non-GEMM, non-attention kernels; see ops.h. All are memory-bound: their ceiling is device
// copy bandwidth over the bytes each reads and writes once (bench/kernels reports the fraction).
#include "worker/kernels/ops.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
namespace {

constexpr int kMaxPartialBlocks = 1056;  // 8 per SM on a 132-SM H200

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block; every thread gets the result. scratch: 33 floats of shared memory.
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
  f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
  f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
}

__device__ __forceinline__ void Store8(float* p, const float* f) {
  reinterpret_cast<float4*>(p)[0] = make_float4(f[0], f[1], f[2], f[3]);
  reinterpret_cast<float4*>(p)[1] = make_float4(f[4], f[5], f[6], f[7]);
}

// Two consecutive elements as floats, for the per-head norm weights (BF16 or FP32 master weights).
// p must be 4-byte (BF16) or 8-byte (FP32) aligned.
__device__ __forceinline__ float2 Load2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 Load2(const float* p) { return *reinterpret_cast<const float2*>(p); }

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
  if (lane == 0) { scratch[warp] = v.x; scratch[32 + warp] = v.y; }
  __syncthreads();
  if (warp == 0) {
    float a = lane < nwarps ? scratch[lane] : 0.0f, b = lane < nwarps ? scratch[32 + lane] : 0.0f;
    a = WarpSum(a);
    b = WarpSum(b);
    if (lane == 0) { scratch[64] = a; scratch[65] = b; }
  }
  __syncthreads();
  return make_float2(scratch[64], scratch[65]);
}

// TX: the input (residual stream) element type, bf16 or float; y is always BF16. TW: the norm
// weight type, bf16 or float (FP32 master weights); each thread widens its 8 weights to FP32 once.
template <typename TX, typename TW>
__global__ void RmsNormForwardKernel(const TX* __restrict__ x, const TW* __restrict__ w, int64_t rows, int h,
                                     float eps, bf16* __restrict__ y, float* __restrict__ rstd_out) {
  __shared__ float scratch[66];
  const int c = threadIdx.x * 8;
  const bool active = c < h;
  float wf[8] = {};
  if (active) Load8(w + c, wf);
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
    for (int i = 0; i < 8; ++i) { ss.x += x0[i] * x0[i]; ss.y += x1[i] * x1[i]; }
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
// norm weight type, as in the forward.
template <typename TA, typename TW>
__global__ void RmsNormBackwardKernel(const TA* __restrict__ dy, const TA* __restrict__ x,
                                      const TW* __restrict__ w, const float* __restrict__ rstd_in,
                                      const TA* dres, int64_t rows, int h, TA* dx, float* __restrict__ partial) {
  __shared__ float scratch[66];
  const int c = threadIdx.x * 8;
  const bool active = c < h;
  float wf[8] = {}, dw[8] = {};
  if (active) Load8(w + c, wf);
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

// out[c] += Σ_p partial[p][c] (columns c >= split go to out_hi[c - split]). A 32x32 block: thread
// (tx, ty) sums parts ty, ty+32, ... of column tx; the 32 sums are then added in ty order, so the
// result is the same on every run.
__global__ void ReducePartialsKernel(const float* __restrict__ partial, int64_t parts, int64_t cols, int64_t split,
                                     float* out_lo, float* out_hi) {
  __shared__ float sm[32][33];
  const int tx = threadIdx.x & 31, ty = threadIdx.x >> 5;
  const int64_t c = blockIdx.x * 32ll + tx;
  float s = 0.f;
  if (c < cols)
    for (int64_t p = ty; p < parts; p += 32) s += partial[p * cols + c];
  sm[ty][tx] = s;
  __syncthreads();
  if (ty == 0 && c < cols) {
    float t = 0.f;
    for (int i = 0; i < 32; ++i) t += sm[i][tx];
    if (c < split) out_lo[c] += t; else out_hi[c - split] += t;
  }
}

// ---- q/k RMSNorm + RoPE: one warp per token; cos/sin are computed once per token and reused
// over all q and k heads. Lane owns pairs j, j+1 in the first half of each head and their
// rotation partners j + hd/2, j + hd/2 + 1.

__device__ __forceinline__ void RopeAngles(int pos, int j, int hd, float theta, float* c, float* s) {
  // Same float32 recipe as HF: inv_freq = 1 / theta^(2j/hd); angle = pos * inv_freq.
  const float inv0 = 1.0f / powf(theta, static_cast<float>(2 * j) / hd);
  const float inv1 = 1.0f / powf(theta, static_cast<float>(2 * (j + 1)) / hd);
  const float a0 = static_cast<float>(pos) * inv0, a1 = static_cast<float>(pos) * inv1;
  sincosf(a0, &s[0], &c[0]);
  sincosf(a1, &s[1], &c[1]);
}

// TW: the q_norm / k_norm weight type (bf16 or float), widened to FP32 on load.
template <int ITERS, int HB, typename TW>
__global__ void QkNormRopeForwardKernel(RopeArgs a, const bf16* __restrict__ qkv, int64_t ld,
                                        const TW* __restrict__ qw, const TW* __restrict__ kw,
                                        const int32_t* __restrict__ pos, bf16* __restrict__ qo,
                                        bf16* __restrict__ ko) {
  const int lane = threadIdx.x & 31;
  const int heads = a.num_q_heads + a.num_kv_heads;
  const int hd = a.head_dim, half = hd / 2;
  for (int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; t < a.tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    float cs[ITERS][2], sn[ITERS][2], wq[ITERS][4], wk[ITERS][4];
    const int p = pos[t];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int j = 2 * lane + 64 * it;
      if (j < half) {
        RopeAngles(p, j, hd, a.theta, cs[it], sn[it]);
        float2 l = Load2(qw + j), u = Load2(qw + j + half);
        wq[it][0] = l.x; wq[it][1] = l.y; wq[it][2] = u.x; wq[it][3] = u.y;
        l = Load2(kw + j);
        u = Load2(kw + j + half);
        wk[it][0] = l.x; wk[it][1] = l.y; wk[it][2] = u.x; wk[it][3] = u.y;
      }
    }
    // HB heads at a time: all their loads are issued before the first reduction, so a warp
    // keeps HB requests in flight instead of one (the kernel is latency-bound otherwise).
    for (int h0 = 0; h0 < heads; h0 += HB) {
      float x[HB][ITERS][4];
#pragma unroll
      for (int b = 0; b < HB; ++b) {
        const int h = h0 + b;
        const bf16* src = qkv + t * ld + static_cast<int64_t>(h) * hd;
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          const int j = 2 * lane + 64 * it;
          x[b][it][0] = x[b][it][1] = x[b][it][2] = x[b][it][3] = 0.f;
          if (h < heads && j < half) {
            float2 l = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + j));
            float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + j + half));
            x[b][it][0] = l.x; x[b][it][1] = l.y; x[b][it][2] = u.x; x[b][it][3] = u.y;
          }
        }
      }
#pragma unroll
      for (int b = 0; b < HB; ++b) {
        const int h = h0 + b;
        if (h >= heads) continue;  // uniform across the warp
        const bool is_q = h < a.num_q_heads;
        bf16* dst = is_q ? qo + t * a.num_q_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h) * hd
                         : ko + t * a.num_kv_heads * static_cast<int64_t>(hd) +
                               static_cast<int64_t>(h - a.num_q_heads) * hd;
        float ss = 0.f;
#pragma unroll
        for (int it = 0; it < ITERS; ++it)
#pragma unroll
          for (int e = 0; e < 4; ++e) ss += x[b][it][e] * x[b][it][e];
        const float rstd = rsqrtf(WarpSum(ss) / hd + a.eps);
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          const int j = 2 * lane + 64 * it;
          if (j < half) {
            const float w0 = is_q ? wq[it][0] : wk[it][0], w1 = is_q ? wq[it][1] : wk[it][1];
            const float w2 = is_q ? wq[it][2] : wk[it][2], w3 = is_q ? wq[it][3] : wk[it][3];
            const float nl0 = x[b][it][0] * rstd * w0, nl1 = x[b][it][1] * rstd * w1;
            const float nu0 = x[b][it][2] * rstd * w2, nu1 = x[b][it][3] * rstd * w3;
            *reinterpret_cast<__nv_bfloat162*>(dst + j) =
                __floats2bfloat162_rn(nl0 * cs[it][0] - nu0 * sn[it][0], nl1 * cs[it][1] - nu1 * sn[it][1]);
            *reinterpret_cast<__nv_bfloat162*>(dst + j + half) =
                __floats2bfloat162_rn(nu0 * cs[it][0] + nl0 * sn[it][0], nu1 * cs[it][1] + nl1 * sn[it][1]);
          }
        }
      }
    }
  }
}

// Backward: un-rotate the output gradient, then the RMSNorm backward over hd; dw partials are
// kept per lane, summed over the block's warps in a fixed order into partial[block][2][hd].
constexpr int kRopeMaxIters = 2;  // hd <= 256

// (This per-token, one-head-at-a-time version is the one verified on the GPU; a batched variant
// like the forward's reached ~33% instead of ~29% of copy bandwidth but is not verified yet.)
template <typename TW>
__global__ void QkNormRopeBackwardKernel(RopeArgs a, const bf16* __restrict__ dq, const bf16* __restrict__ dk,
                                         const bf16* __restrict__ qkv, int64_t ld, const TW* __restrict__ qw,
                                         const TW* __restrict__ kw, const int32_t* __restrict__ pos,
                                         bf16* __restrict__ dqkv, int64_t ld_d, float* __restrict__ partial) {
  extern __shared__ float sm[];  // [warps][2][hd]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int heads = a.num_q_heads + a.num_kv_heads;
  const int hd = a.head_dim, half = hd / 2;
  float dwq[kRopeMaxIters][4] = {}, dwk[kRopeMaxIters][4] = {}, wq[kRopeMaxIters][4] = {}, wk[kRopeMaxIters][4] = {};
#pragma unroll
  for (int it = 0; it < kRopeMaxIters; ++it) {
    const int j = 2 * lane + 64 * it;
    if (j < half) {
      float2 l = Load2(qw + j), u = Load2(qw + j + half);
      wq[it][0] = l.x; wq[it][1] = l.y; wq[it][2] = u.x; wq[it][3] = u.y;
      l = Load2(kw + j);
      u = Load2(kw + j + half);
      wk[it][0] = l.x; wk[it][1] = l.y; wk[it][2] = u.x; wk[it][3] = u.y;
    }
  }
  for (int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; t < a.tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    float cs[kRopeMaxIters][2], sn[kRopeMaxIters][2];
    const int p = pos[t];
#pragma unroll
    for (int it = 0; it < kRopeMaxIters; ++it) {
      const int j = 2 * lane + 64 * it;
      if (j < half) RopeAngles(p, j, hd, a.theta, cs[it], sn[it]);
    }
#pragma unroll 2
    for (int h = 0; h < heads; ++h) {
      const bool is_q = h < a.num_q_heads;
      const bf16* src = qkv + t * ld + static_cast<int64_t>(h) * hd;
      const bf16* g = is_q ? dq + t * a.num_q_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h) * hd
                           : dk + t * a.num_kv_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h - a.num_q_heads) * hd;
      bf16* dst = dqkv + t * ld_d + static_cast<int64_t>(h) * hd;
      float x[kRopeMaxIters][4], dn[kRopeMaxIters][4];
      float ss = 0.f;
#pragma unroll
      for (int it = 0; it < kRopeMaxIters; ++it) {
        const int j = 2 * lane + 64 * it;
#pragma unroll
        for (int e = 0; e < 4; ++e) x[it][e] = dn[it][e] = 0.f;
        if (j < half) {
          float2 l = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + j));
          float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + j + half));
          float2 gl = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + j));
          float2 gu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + j + half));
          x[it][0] = l.x; x[it][1] = l.y; x[it][2] = u.x; x[it][3] = u.y;
          ss += l.x * l.x + l.y * l.y + u.x * u.x + u.y * u.y;
          // out_lo = n_lo c - n_hi s ; out_hi = n_hi c + n_lo s  =>  dn_lo = g_lo c + g_hi s, dn_hi = g_hi c - g_lo s
          dn[it][0] = gl.x * cs[it][0] + gu.x * sn[it][0];
          dn[it][1] = gl.y * cs[it][1] + gu.y * sn[it][1];
          dn[it][2] = gu.x * cs[it][0] - gl.x * sn[it][0];
          dn[it][3] = gu.y * cs[it][1] - gl.y * sn[it][1];
        }
      }
      const float rstd = rsqrtf(WarpSum(ss) / hd + a.eps);
      float dot = 0.f;
#pragma unroll
      for (int it = 0; it < kRopeMaxIters; ++it)
#pragma unroll
        for (int e = 0; e < 4; ++e) dot += dn[it][e] * (is_q ? wq[it][e] : wk[it][e]) * x[it][e] * rstd;
      dot = WarpSum(dot) / hd;
#pragma unroll
      for (int it = 0; it < kRopeMaxIters; ++it) {
        const int j = 2 * lane + 64 * it;
        if (j < half) {
          float o[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float xhat = x[it][e] * rstd;
            o[e] = rstd * (dn[it][e] * (is_q ? wq[it][e] : wk[it][e]) - xhat * dot);
            if (is_q) dwq[it][e] += dn[it][e] * xhat; else dwk[it][e] += dn[it][e] * xhat;
          }
          *reinterpret_cast<__nv_bfloat162*>(dst + j) = __floats2bfloat162_rn(o[0], o[1]);
          *reinterpret_cast<__nv_bfloat162*>(dst + j + half) = __floats2bfloat162_rn(o[2], o[3]);
        }
      }
    }
  }
  // Block reduction of the per-lane dw into partial[block][0 (q) | 1 (k)][hd].
#pragma unroll
  for (int it = 0; it < kRopeMaxIters; ++it) {
    const int j = 2 * lane + 64 * it;
    if (j < half) {
      float* q = sm + (warp * 2 + 0) * hd;
      float* k = sm + (warp * 2 + 1) * hd;
      q[j] = dwq[it][0]; q[j + 1] = dwq[it][1]; q[j + half] = dwq[it][2]; q[j + half + 1] = dwq[it][3];
      k[j] = dwk[it][0]; k[j + 1] = dwk[it][1]; k[j + half] = dwk[it][2]; k[j + half + 1] = dwk[it][3];
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < 2 * hd; i += blockDim.x) {
    float s = 0.f;
    for (int wi = 0; wi < nwarps; ++wi) s += sm[wi * 2 * hd + i];
    partial[blockIdx.x * 2 * static_cast<int64_t>(hd) + i] = s;
  }
}

// ---- SwiGLU
__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + __expf(-x)); }

__global__ void SwiGluForwardKernel(const bf16* __restrict__ gu, int64_t tokens, int64_t inter,
                                    bf16* __restrict__ act) {
  const int64_t vec_per_row = inter / 8;
  const int64_t n = tokens * vec_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vec_per_row, c = (v % vec_per_row) * 8;
    float g[8], u[8], o[8];
    Load8(gu + t * 2 * inter + c, g);
    Load8(gu + t * 2 * inter + inter + c, u);
#pragma unroll
    for (int i = 0; i < 8; ++i) o[i] = g[i] * Sigmoid(g[i]) * u[i];
    Store8(act + t * inter + c, o);
  }
}

__global__ void SwiGluBackwardKernel(const bf16* __restrict__ gu, const bf16* __restrict__ dact, int64_t tokens,
                                     int64_t inter, bf16* __restrict__ dgu) {
  const int64_t vec_per_row = inter / 8;
  const int64_t n = tokens * vec_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vec_per_row, c = (v % vec_per_row) * 8;
    float g[8], u[8], d[8], dg[8], du[8];
    Load8(gu + t * 2 * inter + c, g);
    Load8(gu + t * 2 * inter + inter + c, u);
    Load8(dact + t * inter + c, d);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float s = Sigmoid(g[i]);
      du[i] = d[i] * g[i] * s;
      dg[i] = d[i] * u[i] * s * (1.0f + g[i] * (1.0f - s));
    }
    Store8(dgu + t * 2 * inter + c, dg);
    Store8(dgu + t * 2 * inter + inter + c, du);
  }
}

// ---- Embedding
// TO: output element type; bf16 is a plain copy, float an exact upcast.
// TI: the table's type (BF16 mirror, or the FP32 master read in place from mapped host memory).
template <typename TI, typename TO>
__global__ void EmbeddingForwardKernel(const TI* __restrict__ embed, const int32_t* __restrict__ tokens,
                                       int64_t num_tokens, int64_t h, TO* __restrict__ out) {
  const int64_t vec_per_row = h / 8;
  const int64_t n = num_tokens * vec_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = v / vec_per_row, c = (v % vec_per_row) * 8;
    const TI* src = embed + static_cast<int64_t>(tokens[t]) * h + c;
    if constexpr (std::is_same_v<TI, bf16> && std::is_same_v<TO, bf16>) {
      *reinterpret_cast<Bf16x8*>(out + t * h + c) = *reinterpret_cast<const Bf16x8*>(src);
    } else {
      float f[8];
      Load8(src, f);
      Store8(out + t * h + c, f);
    }
  }
}

template <typename TD>
__global__ void EmbeddingBackwardKernel(const TD* __restrict__ dout, const int32_t* __restrict__ uniq,
                                        const int32_t* __restrict__ seg, const int32_t* __restrict__ sorted_pos,
                                        int64_t h, float* __restrict__ dembed) {
  const int64_t u = blockIdx.x;
  const int64_t row = uniq[u];
  const int b = seg[u], e = seg[u + 1];
  for (int64_t c = static_cast<int64_t>(threadIdx.x) * 8; c < h; c += static_cast<int64_t>(blockDim.x) * 8) {
    float acc[8] = {};
    for (int p = b; p < e; ++p) {
      float f[8];
      Load8(dout + static_cast<int64_t>(sorted_pos[p]) * h + c, f);
#pragma unroll
      for (int i = 0; i < 8; ++i) acc[i] += f[i];
    }
    float4* dst = reinterpret_cast<float4*>(dembed + row * h + c);
    float4 d0 = dst[0], d1 = dst[1];
    d0.x += acc[0]; d0.y += acc[1]; d0.z += acc[2]; d0.w += acc[3];
    d1.x += acc[4]; d1.y += acc[5]; d1.z += acc[6]; d1.w += acc[7];
    dst[0] = d0;
    dst[1] = d1;
  }
}

// ---- Cross entropy over a BF16 logits row, one block per row.
__device__ __forceinline__ void OnlineMerge(float& m, float& s, float m2, float s2) {
  if (m2 == -INFINITY) return;
  if (m == -INFINITY) { m = m2; s = s2; return; }
  if (m2 > m) { s = s * __expf(m - m2) + s2; m = m2; } else { s += s2 * __expf(m2 - m); }
}

__global__ void CrossEntropyKernel(bf16* logits, int64_t vocab, int64_t ld, const int32_t* __restrict__ labels,
                                   int32_t ignore_index, float loss_scale, float* __restrict__ row_loss) {
  __shared__ float sm_m[32], sm_s[32];
  __shared__ float lse_shared;
  const int64_t r = blockIdx.x;
  bf16* row = logits + r * ld;
  const int32_t label = labels[r];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int64_t nvec = vocab / 8;
  if (label == ignore_index) {
    Bf16x8 z;
#pragma unroll
    for (int i = 0; i < 4; ++i) z.v[i] = __floats2bfloat162_rn(0.f, 0.f);
    for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) *reinterpret_cast<Bf16x8*>(row + v * 8) = z;
    for (int64_t j = nvec * 8 + threadIdx.x; j < vocab; j += blockDim.x) row[j] = __float2bfloat16(0.f);
    if (threadIdx.x == 0) row_loss[r] = 0.f;
    return;
  }
  float m = -INFINITY, s = 0.f;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[8];
    Load8(row + v * 8, f);
    float mx = f[0];
#pragma unroll
    for (int i = 1; i < 8; ++i) mx = fmaxf(mx, f[i]);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) sum += __expf(f[i] - mx);
    OnlineMerge(m, s, mx, sum);
  }
  for (int64_t j = nvec * 8 + threadIdx.x; j < vocab; j += blockDim.x) OnlineMerge(m, s, __bfloat162float(row[j]), 1.f);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o);
    OnlineMerge(m, s, m2, s2);
  }
  if (lane == 0) { sm_m[warp] = m; sm_s[warp] = s; }
  __syncthreads();
  if (threadIdx.x == 0) {
    float mm = sm_m[0], ssum = sm_s[0];
    for (int w = 1; w < nwarps; ++w) OnlineMerge(mm, ssum, sm_m[w], sm_s[w]);
    const float lse = mm + logf(ssum);
    lse_shared = lse;
    row_loss[r] = loss_scale * (lse - __bfloat162float(row[label]));
  }
  __syncthreads();
  const float lse = lse_shared;
  for (int64_t v = threadIdx.x; v < nvec; v += blockDim.x) {
    float f[8];
    Load8(row + v * 8, f);
#pragma unroll
    for (int i = 0; i < 8; ++i) f[i] = loss_scale * (__expf(f[i] - lse) - (v * 8 + i == label ? 1.f : 0.f));
    Store8(row + v * 8, f);
  }
  for (int64_t j = nvec * 8 + threadIdx.x; j < vocab; j += blockDim.x) {
    const float f = __bfloat162float(row[j]);
    row[j] = __float2bfloat16(loss_scale * (__expf(f - lse) - (j == label ? 1.f : 0.f)));
  }
}

__global__ void SumIntoKernel(const float* __restrict__ vals, int64_t n, float* out) {
  __shared__ float scratch[33];
  float s = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += vals[i];
  s = BlockSum(s, scratch);
  if (threadIdx.x == 0) *out += s;
}

__device__ __forceinline__ double WarpSumF64(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Fixed-order block sum of doubles (blockDim.x a multiple of 32, at most 1024).
__device__ __forceinline__ double BlockSumF64(double v, double* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = WarpSumF64(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  double t = 0;
  if (warp == 0) {
    t = lane < nwarps ? scratch[lane] : 0.0;
    t = WarpSumF64(t);
  }
  return t;  // valid in thread 0
}

__global__ void SumSquaresPartialKernel(const float* __restrict__ x, int64_t n, double* __restrict__ partials) {
  __shared__ double scratch[32];
  double s = 0;
  const int64_t n4 = (reinterpret_cast<uintptr_t>(x) & 15) == 0 ? n / 4 : 0;
  const float4* x4 = reinterpret_cast<const float4*>(x);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n4;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float4 v = x4[i];
    s += static_cast<double>(v.x) * v.x + static_cast<double>(v.y) * v.y + static_cast<double>(v.z) * v.z +
         static_cast<double>(v.w) * v.w;
  }
  for (int64_t i = n4 * 4 + blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    s += static_cast<double>(x[i]) * x[i];
  }
  s = BlockSumF64(s, scratch);
  if (threadIdx.x == 0) partials[blockIdx.x] = s;
}

__global__ void SumPartialsF64Kernel(const double* __restrict__ partials, int parts, double* out) {
  __shared__ double scratch[32];
  double s = 0;
  for (int i = threadIdx.x; i < parts; i += blockDim.x) s += partials[i];
  s = BlockSumF64(s, scratch);
  if (threadIdx.x == 0) *out = s;
}

__global__ void CastKernel(const float* __restrict__ src, int64_t n, float scale, bf16* __restrict__ dst) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    dst[i] = __float2bfloat16(src[i] * scale);
}

// No __restrict__: out may alias res (each element is read before it is written, by one thread).
__global__ void AddBf16ToF32Kernel(const float* res, const bf16* __restrict__ branch, int64_t n, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x)
    out[i] = res[i] + __bfloat162float(branch[i]);
}

int GridFor(int64_t work, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((work + threads - 1) / threads, 132 * 16)));
}

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

int64_t PartialBlocks(int64_t rows) { return std::max<int64_t>(1, std::min<int64_t>(rows, kMaxPartialBlocks)); }

namespace {
template <typename TX, typename TW>
absl::Status RmsNormForwardImpl(const TX* x, const TW* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                                cudaStream_t stream) {
  absl::Status s = CheckNormWidth(h);
  if (!s.ok()) return s;
  if (rows <= 0) return absl::OkStatus();
  RmsNormForwardKernel<TX, TW><<<PartialBlocks(rows), BlockThreadsForWidth(h), 0, stream>>>(
      x, w, rows, static_cast<int>(h), eps, y, rstd);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TA, typename TW>
absl::Status RmsNormBackwardImpl(const TA* dy, const TA* x, const TW* w, const float* rstd, const TA* dres,
                                 int64_t rows, int64_t h, TA* dx, float* dw, float* ws, cudaStream_t stream) {
  absl::Status s = CheckNormWidth(h);
  if (!s.ok()) return s;
  if (rows <= 0) return absl::OkStatus();
  const int64_t blocks = PartialBlocks(rows);
  RmsNormBackwardKernel<TA, TW><<<blocks, BlockThreadsForWidth(h), 0, stream>>>(
      dy, x, w, rstd, dres, rows, static_cast<int>(h), dx, dw ? ws : nullptr);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (dw != nullptr) return ReducePartialsInto(ws, blocks, h, dw, stream);
  return absl::OkStatus();
}
}  // namespace

absl::Status RmsNormForward(const bf16* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream);
}
absl::Status RmsNormForward(const bf16* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream);
}
absl::Status RmsNormForward(const float* x, const bf16* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream);
}
absl::Status RmsNormForward(const float* x, const float* w, int64_t rows, int64_t h, float eps, bf16* y, float* rstd,
                            cudaStream_t stream) {
  return RmsNormForwardImpl(x, w, rows, h, eps, y, rstd, stream);
}

int64_t RmsNormBackwardWorkspaceNumel(int64_t rows, int64_t h) { return PartialBlocks(rows) * h; }

absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const bf16* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream);
}
absl::Status RmsNormBackward(const bf16* dy, const bf16* x, const float* w, const float* rstd, const bf16* dres,
                             int64_t rows, int64_t h, bf16* dx, float* dw, float* ws, cudaStream_t stream) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream);
}
absl::Status RmsNormBackward(const float* dy, const float* x, const bf16* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream);
}
absl::Status RmsNormBackward(const float* dy, const float* x, const float* w, const float* rstd, const float* dres,
                             int64_t rows, int64_t h, float* dx, float* dw, float* ws, cudaStream_t stream) {
  return RmsNormBackwardImpl(dy, x, w, rstd, dres, rows, h, dx, dw, ws, stream);
}

absl::Status ReducePartialsInto(const float* partial, int64_t parts, int64_t cols, float* out, cudaStream_t stream) {
  if (cols <= 0) return absl::OkStatus();
  ReducePartialsKernel<<<(cols + 31) / 32, 1024, 0, stream>>>(partial, parts, cols, cols, out, nullptr);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

namespace {
absl::Status CheckRope(const RopeArgs& a) {
  if (a.head_dim <= 0 || a.head_dim % 4 != 0 || a.head_dim > 256 || a.num_q_heads <= 0 || a.num_kv_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("q/k norm+RoPE: head_dim ", a.head_dim,
                                                   " must be a multiple of 4 in [4, 256]; heads ", a.num_q_heads,
                                                   "/", a.num_kv_heads));
  }
  return absl::OkStatus();
}
constexpr int kRopeThreads = 256;
int64_t RopeBlocks(const RopeArgs& a) {
  const int64_t warps = a.tokens;  // one warp per token
  return std::max<int64_t>(1, std::min<int64_t>((warps + 7) / 8, 132 * 8));
}


template <typename TW>
absl::Status QkNormRopeForwardImpl(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const TW* q_norm_w,
                                   const TW* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                                   cudaStream_t stream) {
  absl::Status s = CheckRope(a);
  if (!s.ok()) return s;
  if (a.tokens <= 0) return absl::OkStatus();
  if (a.head_dim <= 128) {
    QkNormRopeForwardKernel<1, 8, TW><<<RopeBlocks(a), kRopeThreads, 0, stream>>>(a, qkv, ld_qkv, q_norm_w, k_norm_w,
                                                                                 positions, q_out, k_out);
  } else {
    QkNormRopeForwardKernel<2, 4, TW><<<RopeBlocks(a), kRopeThreads, 0, stream>>>(a, qkv, ld_qkv, q_norm_w, k_norm_w,
                                                                                 positions, q_out, k_out);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TW>
absl::Status QkNormRopeBackwardImpl(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                    int64_t ld_qkv, const TW* q_norm_w, const TW* k_norm_w, const int32_t* positions,
                                    bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                    cudaStream_t stream) {
  absl::Status s = CheckRope(a);
  if (!s.ok()) return s;
  if (a.tokens <= 0) return absl::OkStatus();
  const int64_t blocks = RopeBlocks(a);
  const size_t smem = (kRopeThreads / 32) * 2 * a.head_dim * sizeof(float);
  QkNormRopeBackwardKernel<TW><<<blocks, kRopeThreads, smem, stream>>>(a, dq_out, dk_out, qkv, ld_qkv, q_norm_w,
                                                                       k_norm_w, positions, dqkv, ld_dqkv, ws);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  ReducePartialsKernel<<<(2 * a.head_dim + 31) / 32, 1024, 0, stream>>>(ws, blocks, 2 * a.head_dim, a.head_dim,
                                                                         dq_norm_w, dk_norm_w);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}
}  // namespace

absl::Status QkNormRopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const bf16* q_norm_w,
                               const bf16* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                               cudaStream_t stream) {
  return QkNormRopeForwardImpl(a, qkv, ld_qkv, q_norm_w, k_norm_w, positions, q_out, k_out, stream);
}
absl::Status QkNormRopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const float* q_norm_w,
                               const float* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                               cudaStream_t stream) {
  return QkNormRopeForwardImpl(a, qkv, ld_qkv, q_norm_w, k_norm_w, positions, q_out, k_out, stream);
}

int64_t QkNormRopeBackwardWorkspaceNumel(const RopeArgs& a) { return RopeBlocks(a) * 2 * a.head_dim; }

absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream) {
  return QkNormRopeBackwardImpl(a, dq_out, dk_out, qkv, ld_qkv, q_norm_w, k_norm_w, positions, dqkv, ld_dqkv,
                                dq_norm_w, dk_norm_w, ws, stream);
}
absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const float* q_norm_w, const float* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream) {
  return QkNormRopeBackwardImpl(a, dq_out, dk_out, qkv, ld_qkv, q_norm_w, k_norm_w, positions, dqkv, ld_dqkv,
                                dq_norm_w, dk_norm_w, ws, stream);
}

absl::Status SumSquaresF32(const float* x, int64_t n, double* partials, double* out, cudaStream_t stream) {
  if (n < 0) return absl::InvalidArgumentError(absl::StrCat("SumSquaresF32: n = ", n));
  SumSquaresPartialKernel<<<kSumSquaresBlocks, 256, 0, stream>>>(x, n, partials);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  SumPartialsF64Kernel<<<1, 512, 0, stream>>>(partials, kSumSquaresBlocks, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SwiGluForward(const bf16* gu, int64_t tokens, int64_t inter, bf16* act, cudaStream_t stream) {
  if (inter % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("SwiGLU width ", inter, " not a multiple of 8"));
  if (tokens <= 0) return absl::OkStatus();
  SwiGluForwardKernel<<<GridFor(tokens * inter / 8, 256), 256, 0, stream>>>(gu, tokens, inter, act);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SwiGluBackward(const bf16* gu, const bf16* dact, int64_t tokens, int64_t inter, bf16* dgu,
                            cudaStream_t stream) {
  if (inter % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("SwiGLU width ", inter, " not a multiple of 8"));
  if (tokens <= 0) return absl::OkStatus();
  SwiGluBackwardKernel<<<GridFor(tokens * inter / 8, 256), 256, 0, stream>>>(gu, dact, tokens, inter, dgu);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

namespace {
template <typename TI, typename TO>
absl::Status EmbeddingForwardImpl(const TI* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, TO* out,
                                  cudaStream_t stream) {
  if (h % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("embedding width ", h, " not a multiple of 8"));
  if (num_tokens <= 0) return absl::OkStatus();
  EmbeddingForwardKernel<TI, TO><<<GridFor(num_tokens * h / 8, 256), 256, 0, stream>>>(embed, tokens, num_tokens, h,
                                                                                      out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TD>
absl::Status EmbeddingBackwardImpl(const TD* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                                   const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                                   cudaStream_t stream) {
  if (h % 8 != 0) return absl::InvalidArgumentError(absl::StrCat("embedding width ", h, " not a multiple of 8"));
  if (num_unique <= 0) return absl::OkStatus();
  const int threads = static_cast<int>(std::min<int64_t>(256, (h / 8 + 31) / 32 * 32));
  EmbeddingBackwardKernel<TD><<<num_unique, threads, 0, stream>>>(dout, uniq_tokens, seg_offsets, sorted_pos, h,
                                                                  dembed);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}
}  // namespace

absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream);
}
absl::Status EmbeddingForward(const bf16* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream);
}
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, bf16* out,
                              cudaStream_t stream) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream);
}
absl::Status EmbeddingForward(const float* embed, const int32_t* tokens, int64_t num_tokens, int64_t h, float* out,
                              cudaStream_t stream) {
  return EmbeddingForwardImpl(embed, tokens, num_tokens, h, out, stream);
}

absl::Status EmbeddingBackward(const bf16* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream) {
  return EmbeddingBackwardImpl<bf16>(dout, uniq_tokens, seg_offsets, sorted_pos, num_unique, h, dembed, stream);
}
absl::Status EmbeddingBackward(const float* dout, const int32_t* uniq_tokens, const int32_t* seg_offsets,
                               const int32_t* sorted_pos, int64_t num_unique, int64_t h, float* dembed,
                               cudaStream_t stream) {
  return EmbeddingBackwardImpl<float>(dout, uniq_tokens, seg_offsets, sorted_pos, num_unique, h, dembed, stream);
}

absl::Status CrossEntropyInPlace(bf16* logits, int64_t rows, int64_t vocab, int64_t ld, const int32_t* labels,
                                 int32_t ignore_index, float loss_scale, float* row_loss, cudaStream_t stream) {
  if (ld % 8 != 0 || !Aligned16(logits)) {
    return absl::InvalidArgumentError(absl::StrCat("cross entropy: logits row stride ", ld,
                                                   " must be a multiple of 8 and the base 16-byte aligned"));
  }
  if (rows <= 0) return absl::OkStatus();
  CrossEntropyKernel<<<rows, 512, 0, stream>>>(logits, vocab, ld, labels, ignore_index, loss_scale, row_loss);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SumInto(const float* vals, int64_t n, float* out, cudaStream_t stream) {
  SumIntoKernel<<<1, 1024, 0, stream>>>(vals, n, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CastF32ToBf16(const float* src, int64_t n, float scale, bf16* dst, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  CastKernel<<<GridFor(n, 256), 256, 0, stream>>>(src, n, scale, dst);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status AddBf16ToF32(const float* res, const bf16* branch, int64_t n, float* out, cudaStream_t stream) {
  if (n <= 0) return absl::OkStatus();
  AddBf16ToF32Kernel<<<GridFor(n, 256), 256, 0, stream>>>(res, branch, n, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
