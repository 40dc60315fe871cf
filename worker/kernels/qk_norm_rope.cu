// q/k RMSNorm + RoPE kernels; see qk_norm_rope.h. Memory-bound: the ceiling is device copy
// bandwidth over the bytes each reads and writes once (bench/kernels reports the fraction).
#include "worker/kernels/qk_norm_rope.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace {

// Two consecutive elements as floats, for the per-head norm weights (BF16 or FP32 master weights).
// p must be 4-byte (BF16) or 8-byte (FP32) aligned.
__device__ __forceinline__ float2 Load2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 Load2(const float* p) { return *reinterpret_cast<const float2*>(p); }

// ---- q/k RMSNorm + RoPE: one warp per token; cos/sin are computed once per token and reused
// over all q and k heads. Lane owns pairs j, j+1 in the first half of each head and their
// rotation partners j + hd/2, j + hd/2 + 1.

__device__ __forceinline__ void RopeAngles(int pos, int j, const RopeArgs& a, float* c, float* s) {
  // Same float32 recipe as HF: inv_freq = 1 / theta^(2j/hd) (or the scaled table the host
  // computed, ModelConfig::RopeInverseFrequencies); angle = pos * inv_freq; cos and sin times
  // attention_scaling (HF's emb.cos() * attention_scaling; exact for 1).
  const int hd = a.head_dim;
  const float inv0 = a.inv_freq != nullptr ? a.inv_freq[j] : 1.0f / powf(a.theta, static_cast<float>(2 * j) / hd);
  const float inv1 =
      a.inv_freq != nullptr ? a.inv_freq[j + 1] : 1.0f / powf(a.theta, static_cast<float>(2 * (j + 1)) / hd);
  const float a0 = static_cast<float>(pos) * inv0, a1 = static_cast<float>(pos) * inv1;
  sincosf(a0, &s[0], &c[0]);
  sincosf(a1, &s[1], &c[1]);
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    c[e] *= a.attention_scaling;
    s[e] *= a.attention_scaling;
  }
}

// TW: the q_norm / k_norm weight type (bf16 or float), widened to FP32 on load. kNorm false: RoPE
// alone (no q/k norm: weights and rstd are 1, and x * 1 * 1 is x exactly).
template <int ITERS, int HB, typename TW, bool kNorm>
__global__ void QkNormRopeForwardKernel(RopeArgs a, const bf16* __restrict__ qkv, int64_t ld, const TW* __restrict__ qw,
                                        const TW* __restrict__ kw, const int32_t* __restrict__ pos,
                                        bf16* __restrict__ qo, bf16* __restrict__ ko) {
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
        RopeAngles(p, j, a, cs[it], sn[it]);
        if constexpr (!kNorm) {
#pragma unroll
          for (int e = 0; e < 4; ++e) wq[it][e] = wk[it][e] = 1.f;
          continue;
        }
        float2 l = Load2(qw + j), u = Load2(qw + j + half);
        wq[it][0] = l.x;
        wq[it][1] = l.y;
        wq[it][2] = u.x;
        wq[it][3] = u.y;
        l = Load2(kw + j);
        u = Load2(kw + j + half);
        wk[it][0] = l.x;
        wk[it][1] = l.y;
        wk[it][2] = u.x;
        wk[it][3] = u.y;
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
            x[b][it][0] = l.x;
            x[b][it][1] = l.y;
            x[b][it][2] = u.x;
            x[b][it][3] = u.y;
          }
        }
      }
#pragma unroll
      for (int b = 0; b < HB; ++b) {
        const int h = h0 + b;
        if (h >= heads) continue;  // uniform across the warp
        const bool is_q = h < a.num_q_heads;
        bf16* dst =
            is_q ? qo + t * a.num_q_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h) * hd
                 : ko + t * a.num_kv_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h - a.num_q_heads) * hd;
        float rstd = 1.f;
        if constexpr (kNorm) {
          float ss = 0.f;
#pragma unroll
          for (int it = 0; it < ITERS; ++it)
#pragma unroll
            for (int e = 0; e < 4; ++e) ss += x[b][it][e] * x[b][it][e];
          rstd = rsqrtf(WarpSum(ss) / hd + a.eps);
        }
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
template <typename TW, bool kNorm>
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
    if (kNorm && j < half) {
      float2 l = Load2(qw + j), u = Load2(qw + j + half);
      wq[it][0] = l.x;
      wq[it][1] = l.y;
      wq[it][2] = u.x;
      wq[it][3] = u.y;
      l = Load2(kw + j);
      u = Load2(kw + j + half);
      wk[it][0] = l.x;
      wk[it][1] = l.y;
      wk[it][2] = u.x;
      wk[it][3] = u.y;
    }
  }
  for (int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; t < a.tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    float cs[kRopeMaxIters][2], sn[kRopeMaxIters][2];
    const int p = pos[t];
#pragma unroll
    for (int it = 0; it < kRopeMaxIters; ++it) {
      const int j = 2 * lane + 64 * it;
      if (j < half) RopeAngles(p, j, a, cs[it], sn[it]);
    }
#pragma unroll 2
    for (int h = 0; h < heads; ++h) {
      const bool is_q = h < a.num_q_heads;
      const bf16* src = qkv + t * ld + static_cast<int64_t>(h) * hd;
      const bf16* g =
          is_q ? dq + t * a.num_q_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h) * hd
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
          if constexpr (kNorm) {  // the norm's input (RoPE alone does not read it: qkv may be null)
            float2 l = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + j));
            float2 u = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(src + j + half));
            x[it][0] = l.x;
            x[it][1] = l.y;
            x[it][2] = u.x;
            x[it][3] = u.y;
            ss += l.x * l.x + l.y * l.y + u.x * u.x + u.y * u.y;
          }
          float2 gl = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + j));
          float2 gu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + j + half));
          // out_lo = n_lo c - n_hi s ; out_hi = n_hi c + n_lo s  =>  dn_lo = g_lo c + g_hi s, dn_hi = g_hi c - g_lo s
          dn[it][0] = gl.x * cs[it][0] + gu.x * sn[it][0];
          dn[it][1] = gl.y * cs[it][1] + gu.y * sn[it][1];
          dn[it][2] = gu.x * cs[it][0] - gl.x * sn[it][0];
          dn[it][3] = gu.y * cs[it][1] - gl.y * sn[it][1];
        }
      }
      if constexpr (!kNorm) {  // the gradient of RoPE alone: the un-rotated output gradient
#pragma unroll
        for (int it = 0; it < kRopeMaxIters; ++it) {
          const int j = 2 * lane + 64 * it;
          if (j < half) {
            *reinterpret_cast<__nv_bfloat162*>(dst + j) = __floats2bfloat162_rn(dn[it][0], dn[it][1]);
            *reinterpret_cast<__nv_bfloat162*>(dst + j + half) = __floats2bfloat162_rn(dn[it][2], dn[it][3]);
          }
        }
        continue;
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
            if (is_q)
              dwq[it][e] += dn[it][e] * xhat;
            else
              dwk[it][e] += dn[it][e] * xhat;
          }
          *reinterpret_cast<__nv_bfloat162*>(dst + j) = __floats2bfloat162_rn(o[0], o[1]);
          *reinterpret_cast<__nv_bfloat162*>(dst + j + half) = __floats2bfloat162_rn(o[2], o[3]);
        }
      }
    }
  }
  if constexpr (kNorm) {
    // Block reduction of the per-lane dw into partial[block][0 (q) | 1 (k)][hd].
#pragma unroll
    for (int it = 0; it < kRopeMaxIters; ++it) {
      const int j = 2 * lane + 64 * it;
      if (j < half) {
        float* q = sm + (warp * 2 + 0) * hd;
        float* k = sm + (warp * 2 + 1) * hd;
        q[j] = dwq[it][0];
        q[j + 1] = dwq[it][1];
        q[j + half] = dwq[it][2];
        q[j + half + 1] = dwq[it][3];
        k[j] = dwk[it][0];
        k[j + 1] = dwk[it][1];
        k[j + half] = dwk[it][2];
        k[j + half + 1] = dwk[it][3];
      }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * hd; i += blockDim.x) {
      float s = 0.f;
      for (int wi = 0; wi < nwarps; ++wi) s += sm[wi * 2 * hd + i];
      partial[blockIdx.x * 2 * static_cast<int64_t>(hd) + i] = s;
    }
  }
}

}  // namespace

namespace {
absl::Status CheckRope(const RopeArgs& a) {
  if (a.head_dim <= 0 || a.head_dim % 4 != 0 || a.head_dim > 256 || a.num_q_heads <= 0 || a.num_kv_heads <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("q/k norm+RoPE: head_dim ", a.head_dim,
                                                   " must be a multiple of 4 in [4, 256]; heads ", a.num_q_heads, "/",
                                                   a.num_kv_heads));
  }
  return absl::OkStatus();
}
constexpr int kRopeThreads = 256;
int64_t RopeBlocks(const RopeArgs& a) {
  const int64_t warps = a.tokens;  // one warp per token
  return std::max<int64_t>(1, std::min<int64_t>((warps + 7) / 8, 132 * 8));
}

template <typename TW, bool kNorm = true>
absl::Status QkNormRopeForwardImpl(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const TW* q_norm_w,
                                   const TW* k_norm_w, const int32_t* positions, bf16* q_out, bf16* k_out,
                                   cudaStream_t stream) {
  absl::Status s = CheckRope(a);
  if (!s.ok()) return s;
  if (a.tokens <= 0) return absl::OkStatus();
  if (a.head_dim <= 128) {
    QkNormRopeForwardKernel<1, 8, TW, kNorm>
        <<<RopeBlocks(a), kRopeThreads, 0, stream>>>(a, qkv, ld_qkv, q_norm_w, k_norm_w, positions, q_out, k_out);
  } else {
    QkNormRopeForwardKernel<2, 4, TW, kNorm>
        <<<RopeBlocks(a), kRopeThreads, 0, stream>>>(a, qkv, ld_qkv, q_norm_w, k_norm_w, positions, q_out, k_out);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TW, bool kNorm = true>
absl::Status QkNormRopeBackwardImpl(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                    int64_t ld_qkv, const TW* q_norm_w, const TW* k_norm_w, const int32_t* positions,
                                    bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                    cudaStream_t stream) {
  absl::Status s = CheckRope(a);
  if (!s.ok()) return s;
  if (a.tokens <= 0) return absl::OkStatus();
  const int64_t blocks = RopeBlocks(a);
  const size_t smem = (kRopeThreads / 32) * 2 * a.head_dim * sizeof(float);
  QkNormRopeBackwardKernel<TW, kNorm><<<blocks, kRopeThreads, kNorm ? smem : 0, stream>>>(
      a, dq_out, dk_out, qkv, ld_qkv, q_norm_w, k_norm_w, positions, dqkv, ld_dqkv, ws);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (!kNorm) return absl::OkStatus();
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

absl::Status RopeForward(const RopeArgs& a, const bf16* qkv, int64_t ld_qkv, const int32_t* positions, bf16* q_out,
                         bf16* k_out, cudaStream_t stream) {
  return QkNormRopeForwardImpl<float, false>(a, qkv, ld_qkv, nullptr, nullptr, positions, q_out, k_out, stream);
}

absl::Status RopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const int32_t* positions,
                          bf16* dqkv, int64_t ld_dqkv, cudaStream_t stream) {
  return QkNormRopeBackwardImpl<float, false>(a, dq_out, dk_out, nullptr, 0, nullptr, nullptr, positions, dqkv,
                                              ld_dqkv, nullptr, nullptr, nullptr, stream);
}

absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const bf16* q_norm_w, const bf16* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream) {
  return QkNormRopeBackwardImpl(a, dq_out, dk_out, qkv, ld_qkv, q_norm_w, k_norm_w, positions, dqkv, ld_dqkv, dq_norm_w,
                                dk_norm_w, ws, stream);
}
absl::Status QkNormRopeBackward(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                int64_t ld_qkv, const float* q_norm_w, const float* k_norm_w, const int32_t* positions,
                                bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                cudaStream_t stream) {
  return QkNormRopeBackwardImpl(a, dq_out, dk_out, qkv, ld_qkv, q_norm_w, k_norm_w, positions, dqkv, ld_dqkv, dq_norm_w,
                                dk_norm_w, ws, stream);
}

}  // namespace slidedp::kernels
