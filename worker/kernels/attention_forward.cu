// Flash attention forward: the tensor-core kernel (head_dim 64, 128) and the slow path; see
// attention.h for the contract.
//
// Limits: tensor-core bound (4·T_causal·hd FLOPs per head). This FA2-style version uses mma.sync
// (HMMA), not Hopper's wgmma, so its ceiling is well under the chip's dense BF16 rate;
// bench/kernels reports what it reaches.
#include "worker/kernels/attention.h"

#include <algorithm>
#include <cmath>

#include "worker/kernels/attention_common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace attention_internal;  // attention_common.cuh

namespace {

// ---------------------------------------------------------------- forward (tensor cores)
// Block: 4 warps, Br = 64·MT query rows (each warp owns MT m-tiles of 16 rows), Bc = 64 keys per
// step, K/V double-buffered with cp.async. Each K/V fragment read from shared memory feeds MT
// MMAs: with MT = 1 the loop was bound by shared-memory bandwidth (2 MMAs per ldmatrix.x4).
// Q fragments are re-read from shared memory each step (registers go to the accumulators).
constexpr int kFwdMt = 2, kFwdBr = 64 * kFwdMt, kFwdBc = 64, kFwdThreads = 128;

// Two adjacent output values at element `at` of o, and (lo non-null) what their BF16 rounding lost
// at the same element of lo (AttnArgs::o_lo).
__device__ __forceinline__ void StoreOut(bf16* o, bf16* lo, int64_t at, float x0, float x1) {
  const __nv_bfloat162 hi = __floats2bfloat162_rn(x0, x1);
  *reinterpret_cast<__nv_bfloat162*>(o + at) = hi;
  if (lo == nullptr) return;
  const float2 back = __bfloat1622float2(hi);
  *reinterpret_cast<__nv_bfloat162*>(lo + at) = __floats2bfloat162_rn(x0 - back.x, x1 - back.y);
}

template <int HD>
__global__ void __launch_bounds__(kFwdThreads)
    FlashFwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o, float* __restrict__ lse) {
  constexpr int MT = kFwdMt;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sq = reinterpret_cast<bf16*>(smem_raw);
  bf16* sk = sq + kFwdBr * HD;      // [2][Bc][HD]
  bf16* sv = sk + 2 * kFwdBc * HD;  // [2][Bc][HD]

  const int doc = blockIdx.z, head = blockIdx.y;
  const AttnSpan span = SpanOf(a, doc);
  const int64_t doc_start = span.q_start;
  const int len = span.len, off = span.off, len_kv = len + off;
  const int num_qb = (a.max_seqlen + kFwdBr - 1) / kFwdBr;
  const int qb = num_qb - 1 - blockIdx.x;  // heaviest first
  const int q0 = qb * kFwdBr;
  if (q0 >= len) return;
  const int kv_head = head / (a.num_q_heads / a.num_kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;

  const bf16* qbase = q.ptr + doc_start * q.ld + static_cast<int64_t>(head) * HD;
  const bf16* kbase = k.ptr + span.kv_start * k.ld + static_cast<int64_t>(kv_head) * HD;
  const bf16* vbase = v.ptr + span.kv_start * v.ld + static_cast<int64_t>(kv_head) * HD;
  const int nblocks = (min(q0 + kFwdBr, len) + off + kFwdBc - 1) / kFwdBc;
  // A sliding window: the block's first row sees keys from q0 + off - W + 1 on.
  const int W = a.window;
  const int jfirst = W > 0 ? max(0, q0 + off - W + 1) / kFwdBc : 0;

  LoadTile<HD, kFwdBr, kFwdThreads>(sq, qbase, q.ld, q0, len);
  LoadTile<HD, kFwdBc, kFwdThreads>(sk + (jfirst & 1) * kFwdBc * HD, kbase, k.ld, jfirst * kFwdBc, len_kv);
  LoadTile<HD, kFwdBc, kFwdThreads>(sv + (jfirst & 1) * kFwdBc * HD, vbase, v.ld, jfirst * kFwdBc, len_kv);
  CpAsyncCommit();

  float acc[MT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  // A sink starts each row's running max at its logit and its sum at exp(0) = 1 (counted once per
  // row: by the quad's first thread, the quad's partial sums being added at the end).
  float m_run[MT][2], l_run[MT][2];
  const float m0 = a.sinks != nullptr ? a.sinks[head] * kLog2e : -INFINITY;
  const float l0 = a.sinks != nullptr && t4 == 0 ? 1.f : 0.f;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = m0, l_run[mt][0] = l_run[mt][1] = l0;
  const float scale_log2 = a.softmax_scale * kLog2e;
  const int wrow = warp * 16 * MT;  // first tile row of this warp

  for (int j = jfirst; j < nblocks; ++j) {
    const int stage = j & 1;
    if (j + 1 < nblocks) {
      const int ns = (j + 1) & 1;
      LoadTile<HD, kFwdBc, kFwdThreads>(sk + ns * kFwdBc * HD, kbase, k.ld, (j + 1) * kFwdBc, len_kv);
      LoadTile<HD, kFwdBc, kFwdThreads>(sv + ns * kFwdBc * HD, vbase, v.ld, (j + 1) * kFwdBc, len_kv);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    const bf16* skt = sk + stage * kFwdBc * HD;
    const bf16* svt = sv + stage * kFwdBc * HD;
    const int key0 = j * kFwdBc;
    // Warps whose rows all precede this key block contribute nothing (causal), nor do those whose
    // windows all end before it: skip the math.
    const bool warp_active =
        key0 <= q0 + wrow + 16 * MT - 1 + off && (W == 0 || key0 + kFwdBc - 1 > q0 + wrow + off - W);

    float s[MT][kFwdBc / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int i = 0; i < kFwdBc / 8; ++i) s[mt][i][0] = s[mt][i][1] = s[mt][i][2] = s[mt][i][3] = 0.f;
    if (warp_active) {
      // Rolled: unrolled, the compiler hoists K fragments far ahead and spills.
#pragma unroll 1
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t qa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          Ldsm4(SmemAddr(sq + Swz<HD>(wrow + mt * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)), qa[mt][0], qa[mt][1],
                qa[mt][2], qa[mt][3]);
#pragma unroll
        for (int np = 0; np < kFwdBc / 16; ++np) {
          uint32_t b0, b1, b2, b3;
          Ldsm4(SmemAddr(skt + Swz<HD>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 16 + ((lane >> 3) & 1) * 8)), b0,
                b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma(s[mt][2 * np], qa[mt], b0, b1);
            Mma(s[mt][2 * np + 1], qa[mt], b2, b3);
          }
        }
      }
      // Scale, mask (causal, the window and the document end), online softmax.
      const bool need_mask = key0 + kFwdBc > q0 + wrow + off || key0 + kFwdBc > len_kv ||
                             (W > 0 && key0 <= q0 + wrow + 16 * MT - 1 + off - W);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int row_a = q0 + wrow + mt * 16 + g, row_b = row_a + 8;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kFwdBc / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            float val = s[mt][nt][e] * scale_log2;
            if (need_mask) {
              const int key = key0 + nt * 8 + 2 * t4 + (e & 1);
              const int row = e < 2 ? row_a : row_b;
              if (key > row + off || key >= len_kv || (W > 0 && key <= row + off - W)) val = -INFINITY;
            }
            s[mt][nt][e] = val;
            mx[e >> 1] = fmaxf(mx[e >> 1], val);
          }
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
          mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        float alpha[2], mbase[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(m_run[mt][r], mx[r]);
          mbase[r] = m_new == -INFINITY ? 0.f : m_new;
          alpha[r] = exp2f(m_run[mt][r] - mbase[r]);
          m_run[mt][r] = m_new;
          l_run[mt][r] *= alpha[r];
        }
#pragma unroll
        for (int nt = 0; nt < kFwdBc / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const float p = exp2f(s[mt][nt][e] - mbase[e >> 1]);
            s[mt][nt][e] = p;
            l_run[mt][e >> 1] += p;
          }
        }
#pragma unroll
        for (int dt = 0; dt < HD / 8; ++dt) {
          acc[mt][dt][0] *= alpha[0];
          acc[mt][dt][1] *= alpha[0];
          acc[mt][dt][2] *= alpha[1];
          acc[mt][dt][3] *= alpha[1];
        }
      }
      // O += P V  (P from the S accumulators, re-packed as A fragments).
#pragma unroll
      for (int kk = 0; kk < kFwdBc / 16; ++kk) {
        uint32_t pa[MT][4];
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          pa[mt][0] = PackBf16(s[mt][2 * kk][0], s[mt][2 * kk][1]);
          pa[mt][1] = PackBf16(s[mt][2 * kk][2], s[mt][2 * kk][3]);
          pa[mt][2] = PackBf16(s[mt][2 * kk + 1][0], s[mt][2 * kk + 1][1]);
          pa[mt][3] = PackBf16(s[mt][2 * kk + 1][2], s[mt][2 * kk + 1][3]);
        }
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          uint32_t b0, b1, b2, b3;
          Ldsm4T(SmemAddr(svt + Swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dp * 16 + (lane >> 4) * 8)), b0,
                 b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma(acc[mt][2 * dp], pa[mt], b0, b1);
            Mma(acc[mt][2 * dp + 1], pa[mt], b2, b3);
          }
        }
      }
    }
    __syncthreads();  // the next prefetch overwrites this stage
  }
  bf16* obase = o.ptr + doc_start * o.ld + static_cast<int64_t>(head) * HD;
  bf16* lobase = a.o_lo != nullptr ? a.o_lo + doc_start * o.ld + static_cast<int64_t>(head) * HD : nullptr;
  float* lrow = lse + static_cast<int64_t>(head) * a.tokens + doc_start;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l_run[mt][r] += __shfl_xor_sync(0xffffffffu, l_run[mt][r], 1);
      l_run[mt][r] += __shfl_xor_sync(0xffffffffu, l_run[mt][r], 2);
    }
    const float inv0 = 1.f / l_run[mt][0], inv1 = 1.f / l_run[mt][1];
    const int row_a = q0 + wrow + mt * 16 + g, row_b = row_a + 8;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      const int col = dt * 8 + 2 * t4;
      if (row_a < len) StoreOut(obase, lobase, row_a * o.ld + col, acc[mt][dt][0] * inv0, acc[mt][dt][1] * inv0);
      if (row_b < len) StoreOut(obase, lobase, row_b * o.ld + col, acc[mt][dt][2] * inv1, acc[mt][dt][3] * inv1);
    }
    if (t4 == 0) {
      if (row_a < len) lrow[row_a] = m_run[mt][0] * kLn2 + logf(l_run[mt][0]);
      if (row_b < len) lrow[row_b] = m_run[mt][1] * kLn2 + logf(l_run[mt][1]);
    }
  }
}

// ---------------------------------------------------------------- slow path (any head_dim <= 256)
__global__ void SlowFwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o, float* lse) {
  const int lane = threadIdx.x & 31;
  const int hd = a.head_dim, group = a.num_q_heads / a.num_kv_heads;
  const int64_t n = a.tokens * a.num_q_heads;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / a.num_q_heads;
    const int h = static_cast<int>(r % a.num_q_heads), kvh = h / group;
    const AttnSpan span = SpanOf(a, FindDoc(a.cu_seqlens, a.num_docs, t));
    const int64_t last = span.kv_start + (t - span.q_start) + span.off;
    const int64_t start =
        a.window > 0 && last - a.window + 1 > span.kv_start ? last - a.window + 1 : span.kv_start;
    float qv[kSlowMaxDimPerLane], acc[kSlowMaxDimPerLane];
#pragma unroll
    for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      qv[i] = d < hd ? __bfloat162float(q.ptr[t * q.ld + h * hd + d]) : 0.f;
      acc[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    if (a.sinks != nullptr) m = a.sinks[h], l = 1.f;  // the sink's exp(0) in the denominator
    for (int64_t j = start; j <= last; ++j) {
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) s += qv[i] * __bfloat162float(k.ptr[j * k.ld + kvh * hd + d]);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      s *= a.softmax_scale;
      const float m_new = fmaxf(m, s);
      const float alpha = __expf(m - m_new), p = __expf(s - m_new);
      l = l * alpha + p;
#pragma unroll
      for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
        const int d = lane + 32 * i;
        acc[i] = acc[i] * alpha + (d < hd ? p * __bfloat162float(v.ptr[j * v.ld + kvh * hd + d]) : 0.f);
      }
      m = m_new;
    }
#pragma unroll
    for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) {
        const float x = acc[i] / l;
        const bf16 hi = __float2bfloat16(x);
        o.ptr[t * o.ld + h * hd + d] = hi;
        if (a.o_lo != nullptr) a.o_lo[t * o.ld + h * hd + d] = __float2bfloat16(x - __bfloat162float(hi));
      }
    }
    if (lane == 0) lse[static_cast<int64_t>(h) * a.tokens + t] = m + logf(l);
  }
}

template <int HD>
absl::Status LaunchFwd(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o, float* lse,
                       cudaStream_t stream) {
  const size_t smem = (kFwdBr + 4 * kFwdBc) * HD * sizeof(bf16);
  SLIDEDP_CUDA_RETURN_IF_ERROR(
      cudaFuncSetAttribute(FlashFwdKernel<HD>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid((a.max_seqlen + kFwdBr - 1) / kFwdBr, a.num_q_heads, a.num_docs);
  FlashFwdKernel<HD><<<grid, kFwdThreads, smem, stream>>>(a, q, k, v, o, lse);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace

bool FlashAttentionFastPath(int head_dim) { return head_dim == 64 || head_dim == 128; }

absl::Status FlashAttentionForward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o,
                                   float* lse, cudaStream_t stream) {
  absl::Status s = CheckArgs(a);
  if (!s.ok()) return s;
  if (a.tokens <= 0) return absl::OkStatus();
  if (a.head_dim == 128) return LaunchFwd<128>(a, q, k, v, o, lse, stream);
  if (a.head_dim == 64) return LaunchFwd<64>(a, q, k, v, o, lse, stream);
  SlowFwdKernel<<<SlowGrid(a), 256, 0, stream>>>(a, q, k, v, o, lse);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
