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

// Two consecutive elements as floats: BF16 activations, or the per-head norm weights (BF16 or FP32
// master weights). p must be 4-byte (BF16) or 8-byte (FP32) aligned.
__device__ __forceinline__ float2 Load2(const bf16* p) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
__device__ __forceinline__ float2 Load2(const float* p) { return *reinterpret_cast<const float2*>(p); }

// ---- q/k RMSNorm + RoPE: one warp per token; cos/sin are computed once per token and reused
// over all q and k heads. A head is hd / 4 groups of four dims; lane owns groups lane + 32 * it.
// A rotary group g (g < rotary_dim / 4) holds the pair 2g, 2g+1 of the rotated span's first half
// and its rotation partners 2g + rotary_dim/2, +1; a pass-through group the dims 4g .. 4g+3. With
// rotary_dim == hd that is the pairs j, j+1 and j + hd/2, j + hd/2 + 1 (j = 2g) of every group.

// A group's two element pairs: columns lo, lo+1 and hi, hi+1 of the head.
struct GroupCols {
  int lo, hi;
};
__device__ __forceinline__ GroupCols ColsOf(int g, int rotary_dim) {
  if (g < rotary_dim / 4) return {2 * g, 2 * g + rotary_dim / 2};
  return {4 * g, 4 * g + 2};
}

// The four values of a group as floats, in the order lo, lo+1, hi, hi+1 (BF16 activations, or the
// norm weights: BF16 or FP32).
template <typename T>
__device__ __forceinline__ void LoadGroup(const T* p, GroupCols c, float* v) {
  const float2 l = Load2(p + c.lo), u = Load2(p + c.hi);
  v[0] = l.x;
  v[1] = l.y;
  v[2] = u.x;
  v[3] = u.y;
}
__device__ __forceinline__ void StoreGroup(bf16* p, GroupCols c, const float* v) {
  *reinterpret_cast<__nv_bfloat162*>(p + c.lo) = __floats2bfloat162_rn(v[0], v[1]);
  *reinterpret_cast<__nv_bfloat162*>(p + c.hi) = __floats2bfloat162_rn(v[2], v[3]);
}
// A group's norm weights as the norm applies them: w, or 1 + w in FP32 (NormWeight::kOnePlus).
template <typename TW>
__device__ __forceinline__ void LoadGroupWeights(const TW* w, GroupCols c, NormWeight weight, float* v) {
  LoadGroup(w, c, v);
  if (weight == NormWeight::kOnePlus) {
#pragma unroll
    for (int e = 0; e < 4; ++e) v[e] += 1.0f;
  }
}

// Where head h of a token row starts: q heads q_head_stride apart from column 0, k heads
// contiguous from k_column (RopeArgs; the launchers resolve their defaults).
// Columns are int: a row is far narrower than 2^31 elements (CheckRope).
__device__ __forceinline__ int HeadColumn(const RopeArgs& a, int h) {
  return h < a.num_q_heads ? h * static_cast<int>(a.q_head_stride)
                           : static_cast<int>(a.k_column) + (h - a.num_q_heads) * a.head_dim;
}

// cos and sin of the rotary pair j, j+1 (j = 2g < rotary_dim / 2).
__device__ __forceinline__ void RopeAngles(int pos, int j, const RopeArgs& a, float* c, float* s) {
  // Same float32 recipe as HF: inv_freq = 1 / theta^(2j/rotary_dim) (or the scaled table the host
  // computed, ModelConfig::RopeInverseFrequencies); angle = pos * inv_freq; cos and sin times
  // attention_scaling (HF's emb.cos() * attention_scaling; exact for 1).
  const int rd = a.rotary_dim;
  const float inv0 = a.inv_freq != nullptr ? a.inv_freq[j] : 1.0f / powf(a.theta, static_cast<float>(2 * j) / rd);
  const float inv1 =
      a.inv_freq != nullptr ? a.inv_freq[j + 1] : 1.0f / powf(a.theta, static_cast<float>(2 * (j + 1)) / rd);
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
  const int hd = a.head_dim, groups = hd / 4, rot_groups = a.rotary_dim / 4;
  for (int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; t < a.tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    float cs[ITERS][2], sn[ITERS][2], wq[ITERS][4], wk[ITERS][4];
    const int p = pos[t];
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int g = lane + 32 * it;
      cs[it][0] = cs[it][1] = 1.f;  // pass-through groups: unused
      sn[it][0] = sn[it][1] = 0.f;
      if (g < groups) {
        if (g < rot_groups) RopeAngles(p, 2 * g, a, cs[it], sn[it]);
        if constexpr (!kNorm) {
#pragma unroll
          for (int e = 0; e < 4; ++e) wq[it][e] = wk[it][e] = 1.f;
          continue;
        }
        const GroupCols c = ColsOf(g, a.rotary_dim);
        LoadGroupWeights(qw, c, a.norm_weight, wq[it]);
        if (a.num_kv_heads > 0) LoadGroupWeights(kw, c, a.norm_weight, wk[it]);  // q alone: kw may be null
      }
    }
    // HB heads at a time: all their loads are issued before the first reduction, so a warp
    // keeps HB requests in flight instead of one (the kernel is latency-bound otherwise).
    for (int h0 = 0; h0 < heads; h0 += HB) {
      float x[HB][ITERS][4];
#pragma unroll
      for (int b = 0; b < HB; ++b) {
        const int h = h0 + b;
        const bf16* src = qkv + t * ld + HeadColumn(a, h);
#pragma unroll
        for (int it = 0; it < ITERS; ++it) {
          const int g = lane + 32 * it;
          x[b][it][0] = x[b][it][1] = x[b][it][2] = x[b][it][3] = 0.f;
          if (h < heads && g < groups) LoadGroup(src, ColsOf(g, a.rotary_dim), x[b][it]);
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
          const int g = lane + 32 * it;
          if (g < groups) {
            float n[4], out[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) n[e] = x[b][it][e] * rstd * (is_q ? wq[it][e] : wk[it][e]);
            if (g < rot_groups) {  // [lo pair | hi pair] = [n_lo c - n_hi s | n_hi c + n_lo s]
              out[0] = n[0] * cs[it][0] - n[2] * sn[it][0];
              out[1] = n[1] * cs[it][1] - n[3] * sn[it][1];
              out[2] = n[2] * cs[it][0] + n[0] * sn[it][0];
              out[3] = n[3] * cs[it][1] + n[1] * sn[it][1];
            } else {
#pragma unroll
              for (int e = 0; e < 4; ++e) out[e] = n[e];
            }
            StoreGroup(dst, ColsOf(g, a.rotary_dim), out);
          }
        }
      }
    }
  }
}

// Backward: un-rotate the output gradient, then the RMSNorm backward over hd; dw partials are
// kept per lane, summed over the block's warps in a fixed order into partial[block][2][hd]
// (partial[block][hd] for q alone).
constexpr int kRopeMaxIters = 2;  // hd <= 256: hd / 4 <= 64 groups, two per lane

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
  const int hd = a.head_dim, groups = hd / 4, rot_groups = a.rotary_dim / 4;
  float dwq[kRopeMaxIters][4] = {}, dwk[kRopeMaxIters][4] = {}, wq[kRopeMaxIters][4] = {}, wk[kRopeMaxIters][4] = {};
#pragma unroll
  for (int it = 0; it < kRopeMaxIters; ++it) {
    const int g = lane + 32 * it;
    if (kNorm && g < groups) {
      const GroupCols c = ColsOf(g, a.rotary_dim);
      LoadGroupWeights(qw, c, a.norm_weight, wq[it]);
      if (a.num_kv_heads > 0) LoadGroupWeights(kw, c, a.norm_weight, wk[it]);  // q alone: kw may be null
    }
  }
  for (int64_t t = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; t < a.tokens;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    float cs[kRopeMaxIters][2], sn[kRopeMaxIters][2];
    const int p = pos[t];
#pragma unroll
    for (int it = 0; it < kRopeMaxIters; ++it) {
      const int g = lane + 32 * it;
      cs[it][0] = cs[it][1] = 1.f;  // pass-through groups: unused
      sn[it][0] = sn[it][1] = 0.f;
      if (g < rot_groups) RopeAngles(p, 2 * g, a, cs[it], sn[it]);
    }
#pragma unroll 2
    for (int h = 0; h < heads; ++h) {
      const bool is_q = h < a.num_q_heads;
      const bf16* src = qkv + t * ld + HeadColumn(a, h);
      const bf16* gp =
          is_q ? dq + t * a.num_q_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h) * hd
               : dk + t * a.num_kv_heads * static_cast<int64_t>(hd) + static_cast<int64_t>(h - a.num_q_heads) * hd;
      bf16* dst = dqkv + t * ld_d + HeadColumn(a, h);
      float x[kRopeMaxIters][4], dn[kRopeMaxIters][4];
      float ss = 0.f;
#pragma unroll
      for (int it = 0; it < kRopeMaxIters; ++it) {
        const int g = lane + 32 * it;
#pragma unroll
        for (int e = 0; e < 4; ++e) x[it][e] = dn[it][e] = 0.f;
        if (g < groups) {
          const GroupCols c = ColsOf(g, a.rotary_dim);
          if constexpr (kNorm) {  // the norm's input (RoPE alone does not read it: qkv may be null)
            LoadGroup(src, c, x[it]);
#pragma unroll
            for (int e = 0; e < 4; ++e) ss += x[it][e] * x[it][e];
          }
          float go[4];
          LoadGroup(gp, c, go);
          if (g < rot_groups) {
            // out_lo = n_lo c - n_hi s ; out_hi = n_hi c + n_lo s  =>  dn_lo = g_lo c + g_hi s, dn_hi = g_hi c - g_lo s
            dn[it][0] = go[0] * cs[it][0] + go[2] * sn[it][0];
            dn[it][1] = go[1] * cs[it][1] + go[3] * sn[it][1];
            dn[it][2] = go[2] * cs[it][0] - go[0] * sn[it][0];
            dn[it][3] = go[3] * cs[it][1] - go[1] * sn[it][1];
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e) dn[it][e] = go[e];
          }
        }
      }
      if constexpr (!kNorm) {  // the gradient of RoPE alone: the un-rotated output gradient
#pragma unroll
        for (int it = 0; it < kRopeMaxIters; ++it) {
          const int g = lane + 32 * it;
          if (g < groups) StoreGroup(dst, ColsOf(g, a.rotary_dim), dn[it]);
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
        const int g = lane + 32 * it;
        if (g < groups) {
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
          StoreGroup(dst, ColsOf(g, a.rotary_dim), o);
        }
      }
    }
  }
  if constexpr (kNorm) {
    // Block reduction of the per-lane dw into partial[block][0 (q) | 1 (k)][hd].
#pragma unroll
    for (int it = 0; it < kRopeMaxIters; ++it) {
      const int g = lane + 32 * it;
      if (g < groups) {
        const GroupCols c = ColsOf(g, a.rotary_dim);
        float* q = sm + (warp * 2 + 0) * hd;
        float* k = sm + (warp * 2 + 1) * hd;
        q[c.lo] = dwq[it][0];
        q[c.lo + 1] = dwq[it][1];
        q[c.hi] = dwq[it][2];
        q[c.hi + 1] = dwq[it][3];
        k[c.lo] = dwk[it][0];
        k[c.lo + 1] = dwk[it][1];
        k[c.hi] = dwk[it][2];
        k[c.hi + 1] = dwk[it][3];
      }
    }
    __syncthreads();
    // q alone (no kv heads): the q half only, so the reduction writes nothing for k.
    const int cols = (a.num_kv_heads > 0 ? 2 : 1) * hd;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
      float s = 0.f;
      for (int wi = 0; wi < nwarps; ++wi) s += sm[wi * 2 * hd + i];
      partial[blockIdx.x * static_cast<int64_t>(cols) + i] = s;
    }
  }
}

}  // namespace

namespace {
// The arguments with RopeArgs' defaults made explicit (what the kernels read).
RopeArgs Resolved(RopeArgs a) {
  if (a.rotary_dim == 0) a.rotary_dim = a.head_dim;
  if (a.q_head_stride == 0) a.q_head_stride = a.head_dim;
  if (a.k_column < 0) a.k_column = a.num_q_heads * a.q_head_stride;
  return a;
}

// a: resolved. Two-element (4-byte) accesses need even head offsets; the lane layout needs
// hd / 4 <= 64 groups and whole groups of four in the rotated and the passed span.
absl::Status CheckRope(const RopeArgs& a) {
  if (a.head_dim <= 0 || a.head_dim % 4 != 0 || a.head_dim > 256 || a.num_q_heads <= 0 || a.num_kv_heads < 0) {
    return absl::InvalidArgumentError(absl::StrCat("q/k norm+RoPE: head_dim ", a.head_dim,
                                                   " must be a multiple of 4 in [4, 256]; heads ", a.num_q_heads, "/",
                                                   a.num_kv_heads));
  }
  if (a.rotary_dim <= 0 || a.rotary_dim % 4 != 0 || a.rotary_dim > a.head_dim) {
    return absl::InvalidArgumentError(absl::StrCat("q/k norm+RoPE: rotary_dim ", a.rotary_dim,
                                                   " must be a multiple of 4 in [4, head_dim ", a.head_dim, "]"));
  }
  const int64_t kInt = int64_t{1} << 31;  // head columns are int in the kernels
  if (a.q_head_stride < a.head_dim || a.q_head_stride % 2 != 0 || a.k_column % 2 != 0 ||
      a.q_head_stride * a.num_q_heads >= kInt || a.k_column + int64_t{a.num_kv_heads} * a.head_dim >= kInt) {
    return absl::InvalidArgumentError(absl::StrCat("q/k norm+RoPE: q_head_stride ", a.q_head_stride,
                                                   " must be even and >= head_dim ", a.head_dim, "; k_column ",
                                                   a.k_column, " must be even; both inside a row"));
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
  const RopeArgs r = Resolved(a);
  absl::Status s = CheckRope(r);
  if (!s.ok()) return s;
  if (r.tokens <= 0) return absl::OkStatus();
  if (r.head_dim <= 128) {
    QkNormRopeForwardKernel<1, 8, TW, kNorm>
        <<<RopeBlocks(r), kRopeThreads, 0, stream>>>(r, qkv, ld_qkv, q_norm_w, k_norm_w, positions, q_out, k_out);
  } else {
    QkNormRopeForwardKernel<2, 4, TW, kNorm>
        <<<RopeBlocks(r), kRopeThreads, 0, stream>>>(r, qkv, ld_qkv, q_norm_w, k_norm_w, positions, q_out, k_out);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TW, bool kNorm = true>
absl::Status QkNormRopeBackwardImpl(const RopeArgs& a, const bf16* dq_out, const bf16* dk_out, const bf16* qkv,
                                    int64_t ld_qkv, const TW* q_norm_w, const TW* k_norm_w, const int32_t* positions,
                                    bf16* dqkv, int64_t ld_dqkv, float* dq_norm_w, float* dk_norm_w, float* ws,
                                    cudaStream_t stream) {
  const RopeArgs r = Resolved(a);
  absl::Status s = CheckRope(r);
  if (!s.ok()) return s;
  if (r.tokens <= 0) return absl::OkStatus();
  const int64_t blocks = RopeBlocks(r);
  // 8 warps x 2 x hd floats: 16 KiB at hd 256, inside the 48 KiB a launch gets without opting in.
  const size_t smem = (kRopeThreads / 32) * 2 * r.head_dim * sizeof(float);
  QkNormRopeBackwardKernel<TW, kNorm><<<blocks, kRopeThreads, kNorm ? smem : 0, stream>>>(
      r, dq_out, dk_out, qkv, ld_qkv, q_norm_w, k_norm_w, positions, dqkv, ld_dqkv, ws);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (!kNorm) return absl::OkStatus();
  const int64_t cols = (r.num_kv_heads > 0 ? 2 : 1) * int64_t{r.head_dim};  // q alone: the q half
  ReducePartialsKernel<<<(cols + 31) / 32, 1024, 0, stream>>>(ws, blocks, cols, r.head_dim, dq_norm_w, dk_norm_w);
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
  return QkNormRopeBackwardImpl<float, false>(a, dq_out, dk_out, nullptr, 0, nullptr, nullptr, positions, dqkv, ld_dqkv,
                                              nullptr, nullptr, nullptr, stream);
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
