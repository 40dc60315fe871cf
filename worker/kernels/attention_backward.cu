// Flash attention backward: the tensor-core kernel (head_dim 64, 128; dQ by atomics or in a fixed
// order), the slow path, and the workspace; see attention.h for the contract.
//
// Limits: tensor-core bound (2.5x the forward's 4·T_causal·hd FLOPs per head). This FA2-style
// version uses mma.sync (HMMA), not Hopper's wgmma, so its ceiling is well under the chip's dense
// BF16 rate; bench/kernels reports what it reaches.
#include "worker/kernels/attention.h"
#include "worker/kernels/attention_order.h"

#include <algorithm>
#include <cmath>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/kernels/attention_common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace attention_internal;  // attention_common.cuh

namespace {

// ---------------------------------------------------------------- backward (tensor cores)
constexpr int kBwdBc = 64, kBwdThreads = 128;

// GPU-scope acquire load / release store of a turn counter (ordered dQ).
__device__ __forceinline__ int AcquireLoad(const int* p) {
  int v;
  asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}
// Spins until *turn == want. A turn that never comes (blocks not launched in index order, which
// the ordering relies on) traps after 10 s instead of hanging: the launch then fails with an
// error the worker reports.
__device__ __forceinline__ void AwaitTurn(const int* turn, int want) {
  const uint64_t start = GlobalTimerNs();
  while (AcquireLoad(turn) != want) {
    __nanosleep(64);
    if (GlobalTimerNs() - start > 10'000'000'000ull) __trap();
  }
}
__device__ __forceinline__ void ReleaseStore(int* p, int v) {
  __threadfence();  // the block's dQ stores (ordered before this by __syncthreads) reach L2 first
  asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// D[h][t] = Σ_d dO[t, h*hd + d] * O[t, h*hd + d], O the FP32 output where AttnArgs::o_lo holds its
// low half (o + o_lo), else the BF16 o; one warp per (token, head).
__global__ void AttnRowDotKernel(AttnArgs a, AttnTensor o, AttnTensor dout, float* __restrict__ dsum) {
  const int lane = threadIdx.x & 31;
  const int64_t n = a.tokens * a.num_q_heads;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / a.num_q_heads;
    const int h = static_cast<int>(r % a.num_q_heads);
    const bf16* op = o.ptr + t * o.ld + static_cast<int64_t>(h) * a.head_dim;
    const bf16* dp = dout.ptr + t * dout.ld + static_cast<int64_t>(h) * a.head_dim;
    const bf16* lp = a.o_lo != nullptr ? a.o_lo + (op - o.ptr) : nullptr;
    float s = 0.f;
    for (int d = lane; d < a.head_dim; d += 32) {
      const float ov = lp != nullptr ? __bfloat162float(op[d]) + __bfloat162float(lp[d]) : __bfloat162float(op[d]);
      s += ov * __bfloat162float(dp[d]);
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) dsum[static_cast<int64_t>(h) * a.tokens + t] = s;
  }
}

// Attention sinks: dsinks[h] += -Σ_t exp(sink_h - lse[h][t]) · D[h][t] (the sink's probability
// times its dP - D, its value being zero). One block per q head; FP32 block sum, one add.
__global__ void SinkGradKernel(AttnArgs a, const float* __restrict__ lse, const float* __restrict__ dsum) {
  const int h = blockIdx.x;
  const float sink = a.sinks[h];
  const float* lrow = lse + static_cast<int64_t>(h) * a.tokens;
  const float* drow = dsum + static_cast<int64_t>(h) * a.tokens;
  float s = 0.f;
  for (int64_t t = threadIdx.x; t < a.tokens; t += blockDim.x) s -= __expf(sink - lrow[t]) * drow[t];
  __shared__ float part[32];
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
  __syncthreads();
  if (threadIdx.x < 32) {
    s = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (threadIdx.x == 0) a.dsinks[h] += s;
  }
}

template <int HD, int BR, bool CROSS>
__global__ void __launch_bounds__(kBwdThreads)
    FlashBwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v, const float* __restrict__ lse, AttnTensor dout,
                   const float* __restrict__ dsum, float* __restrict__ dq_acc, AttnOutTensor dk, AttnOutTensor dv,
                   float* __restrict__ dkv_part, int* __restrict__ dq_order, float* dk_add, float* dv_add,
                   int64_t ld_add) {
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sk = reinterpret_cast<bf16*>(smem_raw);  // [Bc][HD]
  bf16* sv = sk + kBwdBc * HD;                   // [Bc][HD]
  bf16* sq2 = sv + kBwdBc * HD;                  // [2][BR][HD] (double-buffered)
  bf16* sdo2 = sq2 + 2 * BR * HD;                // [2][BR][HD]
  bf16* sds = sdo2 + 2 * BR * HD;                // [Bc][BR + 8] dSᵀ (padded rows)
  constexpr int kDsLd = BR + 8;
  float* slse = reinterpret_cast<float*>(sds + kBwdBc * kDsLd);  // [BR] lse * log2e (+inf: invalid row)
  float* sdd = slse + BR;                                        // [BR]

  const int group = a.num_q_heads / a.num_kv_heads;
  // dkv_part != null: this block handles one q head (blockIdx.y) and writes FP32 partials.
  const bool per_q = dkv_part != nullptr;
  const int doc = blockIdx.z, kvh = per_q ? blockIdx.y / group : blockIdx.y;
  const int hq_first = per_q ? blockIdx.y % group : 0, hq_count = per_q ? 1 : group;
  // dk_add set (cross attention): dK·scale and dV added into those FP32 rows of the key range.
  const AttnSpan span = SpanOf<CROSS>(a, doc);
  const int64_t doc_start = span.q_start;
  const int len = span.len, off = CROSS ? span.off : 0, len_kv = len + off;
  const int num_kb = (MaxKeys(a) + kBwdBc - 1) / kBwdBc;
  const int kb = num_kb - 1 - blockIdx.x;
  const int k0 = kb * kBwdBc;
  if (k0 >= len_kv) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const float scale_log2 = a.softmax_scale * kLog2e;

  LoadTile<HD, kBwdBc, kBwdThreads>(sk, k.ptr + span.kv_start * k.ld + static_cast<int64_t>(kvh) * HD, k.ld, k0,
                                    len_kv);
  LoadTile<HD, kBwdBc, kBwdThreads>(sv, v.ptr + span.kv_start * v.ld + static_cast<int64_t>(kvh) * HD, v.ld, k0,
                                    len_kv);
  CpAsyncCommit();

  float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.f;

  const int key_a = k0 + warp * 16 + g, key_b = key_a + 8;  // range-relative keys of this thread's rows
  const int qb_start = max(0, k0 - off) / BR;               // the first query seeing key k0 is k0 - off
  // A sliding window: the block's last key is seen up to W - 1 queries after its own row.
  const int W = a.window;
  const int last_q = min(k0 + kBwdBc, len_kv) - 1 - off + W - 1;  // the last query seeing its last key
  const int qb_end = W > 0 ? min((len + BR - 1) / BR, last_q < 0 ? 0 : last_q / BR + 1) : (len + BR - 1) / BR;
  // dQ partition: BR/16 m-tiles; the 4 warps split each m-tile's HD columns.
  constexpr int kMTiles = BR / 16;
  constexpr int kWarpsPerM = 4 / kMTiles;
  constexpr int kDqCols = HD / kWarpsPerM;
  const int dq_m = warp / kWarpsPerM, dq_c0 = (warp % kWarpsPerM) * kDqCols;

  // Work items: (q head of the group, q block), flattened so the next item's Q/dO tiles load
  // (cp.async) while this one computes.
  const int nqb = qb_end - qb_start;
  const int n_items = hq_count * nqb;
  auto issue = [&](int item, int buf) {
    const int head = kvh * group + hq_first + item / nqb;
    const int q0 = (qb_start + item % nqb) * BR;
    LoadTile<HD, BR, kBwdThreads>(sq2 + buf * BR * HD, q.ptr + doc_start * q.ld + static_cast<int64_t>(head) * HD, q.ld,
                                  q0, len);
    LoadTile<HD, BR, kBwdThreads>(sdo2 + buf * BR * HD,
                                  dout.ptr + doc_start * dout.ld + static_cast<int64_t>(head) * HD, dout.ld, q0, len);
    CpAsyncCommit();
  };
  if (n_items > 0) issue(0, 0);
  for (int item = 0; item < n_items; ++item) {
    {
      const int hq = hq_first + item / nqb, qb = qb_start + item % nqb;
      const int head = kvh * group + hq;
      const float* lrow = lse + static_cast<int64_t>(head) * a.tokens + doc_start;
      const float* drow = dsum + static_cast<int64_t>(head) * a.tokens + doc_start;
      const int q0 = qb * BR;
      const bf16* sq = sq2 + (item & 1) * BR * HD;
      const bf16* sdo = sdo2 + (item & 1) * BR * HD;
      if (item + 1 < n_items) {
        issue(item + 1, (item + 1) & 1);
        CpAsyncWait<1>();
      } else {
        CpAsyncWait<0>();
      }
      for (int i = threadIdx.x; i < BR; i += kBwdThreads) {
        const bool valid = q0 + i < len;
        slse[i] = valid ? lrow[q0 + i] * kLog2e : INFINITY;
        sdd[i] = valid ? drow[q0 + i] : 0.f;
      }
      __syncthreads();

      // Sᵀ (keys x queries) and dPᵀ = V dOᵀ for this warp's 16 keys.
      float st[BR / 8][4], dpt[BR / 8][4];
#pragma unroll
      for (int i = 0; i < BR / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) st[i][e] = dpt[i][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < HD / 16; ++kk) {
        uint32_t ka[4], va[4];
        Ldsm4(SmemAddr(sk + Swz<HD>(warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)), ka[0], ka[1], ka[2], ka[3]);
        Ldsm4(SmemAddr(sv + Swz<HD>(warp * 16 + (lane & 15), kk * 16 + (lane >> 4) * 8)), va[0], va[1], va[2], va[3]);
#pragma unroll
        for (int np = 0; np < BR / 16; ++np) {
          const int qr = np * 16 + (lane & 7) + ((lane >> 4) << 3), qc = kk * 16 + ((lane >> 3) & 1) * 8;
          uint32_t b0, b1, b2, b3;
          Ldsm4(SmemAddr(sq + Swz<HD>(qr, qc)), b0, b1, b2, b3);
          Mma(st[2 * np], ka, b0, b1);
          Mma(st[2 * np + 1], ka, b2, b3);
          Ldsm4(SmemAddr(sdo + Swz<HD>(qr, qc)), b0, b1, b2, b3);
          Mma(dpt[2 * np], va, b0, b1);
          Mma(dpt[2 * np + 1], va, b2, b3);
        }
      }
      // Pᵀ = exp2(S·scale·log2e − lse·log2e), masked; dSᵀ = Pᵀ (dPᵀ − D).
      const bool need_mask = q0 + off < k0 + kBwdBc || (W > 0 && q0 + BR - 1 + off - W >= k0);
#pragma unroll
      for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * 8 + 2 * t4 + (e & 1);
          const int key = e < 2 ? key_a : key_b;
          float p = exp2f(st[nt][e] * scale_log2 - slse[qi]);
          if (need_mask && (q0 + qi + off < key || (W > 0 && q0 + qi + off - W >= key))) p = 0.f;
          st[nt][e] = p;
          dpt[nt][e] = p * (dpt[nt][e] - sdd[qi]);
        }
      }
      // dV += Pᵀ dO ; dK += dSᵀ Q  (k dimension = queries).
#pragma unroll
      for (int kq = 0; kq < BR / 16; ++kq) {
        uint32_t pa[4] = {PackBf16(st[2 * kq][0], st[2 * kq][1]), PackBf16(st[2 * kq][2], st[2 * kq][3]),
                          PackBf16(st[2 * kq + 1][0], st[2 * kq + 1][1]),
                          PackBf16(st[2 * kq + 1][2], st[2 * kq + 1][3])};
        uint32_t da[4] = {PackBf16(dpt[2 * kq][0], dpt[2 * kq][1]), PackBf16(dpt[2 * kq][2], dpt[2 * kq][3]),
                          PackBf16(dpt[2 * kq + 1][0], dpt[2 * kq + 1][1]),
                          PackBf16(dpt[2 * kq + 1][2], dpt[2 * kq + 1][3])};
#pragma unroll
        for (int dp = 0; dp < HD / 16; ++dp) {
          const int qr = kq * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, qc = dp * 16 + (lane >> 4) * 8;
          uint32_t b0, b1, b2, b3;
          Ldsm4T(SmemAddr(sdo + Swz<HD>(qr, qc)), b0, b1, b2, b3);
          Mma(dv_acc[2 * dp], pa, b0, b1);
          Mma(dv_acc[2 * dp + 1], pa, b2, b3);
          Ldsm4T(SmemAddr(sq + Swz<HD>(qr, qc)), b0, b1, b2, b3);
          Mma(dk_acc[2 * dp], da, b0, b1);
          Mma(dk_acc[2 * dp + 1], da, b2, b3);
        }
      }
      // dSᵀ to shared memory for dQ = dS K.
#pragma unroll
      for (int nt = 0; nt < BR / 8; ++nt) {
        const int qi = nt * 8 + 2 * t4;
        *reinterpret_cast<__nv_bfloat162*>(sds + (warp * 16 + g) * kDsLd + qi) =
            __floats2bfloat162_rn(dpt[nt][0], dpt[nt][1]);
        *reinterpret_cast<__nv_bfloat162*>(sds + (warp * 16 + g + 8) * kDsLd + qi) =
            __floats2bfloat162_rn(dpt[nt][2], dpt[nt][3]);
      }
      __syncthreads();
      {
        float dq[kDqCols / 8][4];
#pragma unroll
        for (int i = 0; i < kDqCols / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < kBwdBc / 16; ++kk) {
          uint32_t aa[4];
          const int kr = kk * 16 + (lane & 7) + ((lane >> 4) << 3), qc = dq_m * 16 + ((lane >> 3) & 1) * 8;
          Ldsm4T(SmemAddr(sds + kr * kDsLd + qc), aa[0], aa[1], aa[2], aa[3]);
#pragma unroll
          for (int dp = 0; dp < kDqCols / 16; ++dp) {
            uint32_t b0, b1, b2, b3;
            Ldsm4T(
                SmemAddr(sk + Swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, dq_c0 + dp * 16 + (lane >> 4) * 8)),
                b0, b1, b2, b3);
            Mma(dq[2 * dp], aa, b0, b1);
            Mma(dq[2 * dp + 1], aa, b2, b3);
          }
        }
        const int ra = q0 + dq_m * 16 + g, rb = ra + 8;
        float* dqbase = dq_acc + doc_start * static_cast<int64_t>(a.num_q_heads) * HD + static_cast<int64_t>(head) * HD;
        const int64_t ldq = static_cast<int64_t>(a.num_q_heads) * HD;
        if (dq_order == nullptr) {
#pragma unroll
          for (int dt = 0; dt < kDqCols / 8; ++dt) {
            const int col = dq_c0 + dt * 8 + 2 * t4;
            if (ra < len)
              atomicAdd(reinterpret_cast<float2*>(dqbase + ra * ldq + col), make_float2(dq[dt][0], dq[dt][1]));
            if (rb < len)
              atomicAdd(reinterpret_cast<float2*>(dqbase + rb * ldq + col), make_float2(dq[dt][2], dq[dt][3]));
          }
        } else {
          // Ordered (attention_order.h): the key blocks reaching this q block add in descending
          // kb, the launch order, so a block only ever waits for blocks launched before it.
          int* turn =
              dq_order + (static_cast<int64_t>(doc) * a.num_q_heads + head) * ((a.max_seqlen + BR - 1) / BR) + qb;
          const int rank = DqTurn(qb, kb, len, BR, kBwdBc, off);
          if (threadIdx.x == 0) AwaitTurn(turn, rank);
          __syncthreads();
#pragma unroll
          for (int dt = 0; dt < kDqCols / 8; ++dt) {
            const int col = dq_c0 + dt * 8 + 2 * t4;
            if (ra < len) {
              float2* p = reinterpret_cast<float2*>(dqbase + ra * ldq + col);
              const float2 x = __ldcg(p);
              __stcg(p, make_float2(x.x + dq[dt][0], x.y + dq[dt][1]));
            }
            if (rb < len) {
              float2* p = reinterpret_cast<float2*>(dqbase + rb * ldq + col);
              const float2 x = __ldcg(p);
              __stcg(p, make_float2(x.x + dq[dt][2], x.y + dq[dt][3]));
            }
          }
          __syncthreads();  // every thread's adds are issued before the turn passes on
          if (threadIdx.x == 0) ReleaseStore(turn, rank + 1);
        }
      }
      __syncthreads();  // this buffer, sds, slse and sdd are rewritten by the next items
    }
  }
  if (per_q) {
    // FP32 partials [T][nq][2][HD]-like layout: dk at dkv_part[t][head*HD], dv at +nq*HD.
    const int head = blockIdx.y;
    const int64_t ldp = 2ll * a.num_q_heads * HD;
    float* pk = dkv_part + doc_start * ldp + static_cast<int64_t>(head) * HD;
    float* pv = pk + static_cast<int64_t>(a.num_q_heads) * HD;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      const int col = dt * 8 + 2 * t4;
      if (key_a < len) {
        *reinterpret_cast<float2*>(pk + key_a * ldp + col) = make_float2(dk_acc[dt][0], dk_acc[dt][1]);
        *reinterpret_cast<float2*>(pv + key_a * ldp + col) = make_float2(dv_acc[dt][0], dv_acc[dt][1]);
      }
      if (key_b < len) {
        *reinterpret_cast<float2*>(pk + key_b * ldp + col) = make_float2(dk_acc[dt][2], dk_acc[dt][3]);
        *reinterpret_cast<float2*>(pv + key_b * ldp + col) = make_float2(dv_acc[dt][2], dv_acc[dt][3]);
      }
    }
    return;
  }
  const float sc = a.softmax_scale;
  if constexpr (CROSS) {
    float* pk = dk_add + span.kv_start * ld_add + static_cast<int64_t>(kvh) * HD;
    float* pv = dv_add + span.kv_start * ld_add + static_cast<int64_t>(kvh) * HD;
#pragma unroll
    for (int dt = 0; dt < HD / 8; ++dt) {
      const int col = dt * 8 + 2 * t4;
      if (key_a < len_kv) {
        atomicAdd(reinterpret_cast<float2*>(pk + key_a * ld_add + col),
                  make_float2(dk_acc[dt][0] * sc, dk_acc[dt][1] * sc));
        atomicAdd(reinterpret_cast<float2*>(pv + key_a * ld_add + col), make_float2(dv_acc[dt][0], dv_acc[dt][1]));
      }
      if (key_b < len_kv) {
        atomicAdd(reinterpret_cast<float2*>(pk + key_b * ld_add + col),
                  make_float2(dk_acc[dt][2] * sc, dk_acc[dt][3] * sc));
        atomicAdd(reinterpret_cast<float2*>(pv + key_b * ld_add + col), make_float2(dv_acc[dt][2], dv_acc[dt][3]));
      }
    }
    return;
  }
  bf16* dkbase = dk.ptr + doc_start * dk.ld + static_cast<int64_t>(kvh) * HD;
  bf16* dvbase = dv.ptr + doc_start * dv.ld + static_cast<int64_t>(kvh) * HD;
#pragma unroll
  for (int dt = 0; dt < HD / 8; ++dt) {
    const int col = dt * 8 + 2 * t4;
    if (key_a < len) {
      *reinterpret_cast<__nv_bfloat162*>(dkbase + key_a * dk.ld + col) =
          __floats2bfloat162_rn(dk_acc[dt][0] * sc, dk_acc[dt][1] * sc);
      *reinterpret_cast<__nv_bfloat162*>(dvbase + key_a * dv.ld + col) =
          __floats2bfloat162_rn(dv_acc[dt][0], dv_acc[dt][1]);
    }
    if (key_b < len) {
      *reinterpret_cast<__nv_bfloat162*>(dkbase + key_b * dk.ld + col) =
          __floats2bfloat162_rn(dk_acc[dt][2] * sc, dk_acc[dt][3] * sc);
      *reinterpret_cast<__nv_bfloat162*>(dvbase + key_b * dv.ld + col) =
          __floats2bfloat162_rn(dv_acc[dt][2], dv_acc[dt][3]);
    }
  }
}

// dst[t, c] = bf16(src[t, c] * scale) for a [T, cols] FP32 source and a strided BF16 target.
__global__ void CastRowsKernel(const float* __restrict__ src, int64_t rows, int64_t cols, float scale, bf16* dst,
                               int64_t ld) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[r * ld + c] = __float2bfloat16(src[i] * scale);
  }
}

// dk[t, kvh*hd + d] = bf16(scale · Σ_{q heads of the group, in order} part_k[t][head*hd + d]); same for dv.
__global__ void GroupSumKernel(const float* __restrict__ part, int64_t tokens, int nq, int nkv, int hd, float scale,
                               AttnOutTensor dk, AttnOutTensor dv) {
  const int group = nq / nkv;
  const int64_t kvd = static_cast<int64_t>(nkv) * hd, ldp = 2ll * nq * hd;
  const int64_t n = tokens * kvd;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / kvd;
    const int c = static_cast<int>(i % kvd), kvh = c / hd, d = c % hd;
    const float* pk = part + t * ldp + static_cast<int64_t>(kvh) * group * hd + d;
    const float* pv = pk + static_cast<int64_t>(nq) * hd;
    float sk = 0.f, sv = 0.f;
    for (int h = 0; h < group; ++h) {
      sk += pk[h * hd];
      sv += pv[h * hd];
    }
    dk.ptr[t * dk.ld + c] = __float2bfloat16(sk * scale);
    dv.ptr[t * dv.ld + c] = __float2bfloat16(sv);
  }
}

// ---------------------------------------------------------------- slow path (any head_dim <= 256)
__global__ void SlowBwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v, const float* lse, AttnTensor dout,
                              const float* dsum, float* dq_acc, float* dk_acc, float* dv_acc, int64_t ld_acc) {
  const int lane = threadIdx.x & 31;
  const int hd = a.head_dim, group = a.num_q_heads / a.num_kv_heads;
  const int64_t n = a.tokens * a.num_q_heads;
  const int64_t qd = static_cast<int64_t>(a.num_q_heads) * hd;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / a.num_q_heads;
    const int h = static_cast<int>(r % a.num_q_heads), kvh = h / group;
    const AttnSpan span = SpanOf(a, FindDoc(a.cu_seqlens, a.num_docs, t));
    const int64_t last = span.kv_start + (t - span.q_start) + span.off;
    const int64_t start =
        a.window > 0 && last - a.window + 1 > span.kv_start ? last - a.window + 1 : span.kv_start;
    const float L = lse[static_cast<int64_t>(h) * a.tokens + t], D = dsum[static_cast<int64_t>(h) * a.tokens + t];
    float qv[kSlowMaxDimPerLane], dov[kSlowMaxDimPerLane], dq[kSlowMaxDimPerLane];
#pragma unroll
    for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      qv[i] = d < hd ? __bfloat162float(q.ptr[t * q.ld + h * hd + d]) : 0.f;
      dov[i] = d < hd ? __bfloat162float(dout.ptr[t * dout.ld + h * hd + d]) : 0.f;
      dq[i] = 0.f;
    }
    for (int64_t j = start; j <= last; ++j) {
      float s = 0.f, dp = 0.f;
#pragma unroll
      for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) {
          s += qv[i] * __bfloat162float(k.ptr[j * k.ld + kvh * hd + d]);
          dp += dov[i] * __bfloat162float(v.ptr[j * v.ld + kvh * hd + d]);
        }
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, off);
        dp += __shfl_xor_sync(0xffffffffu, dp, off);
      }
      const float p = __expf(s * a.softmax_scale - L);
      const float ds = p * (dp - D) * a.softmax_scale;
#pragma unroll
      for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < hd) {
          dq[i] += ds * __bfloat162float(k.ptr[j * k.ld + kvh * hd + d]);
          atomicAdd(dk_acc + j * ld_acc + kvh * hd + d, ds * qv[i]);
          atomicAdd(dv_acc + j * ld_acc + kvh * hd + d, p * dov[i]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      if (d < hd) dq_acc[t * qd + h * hd + d] = dq[i];
    }
  }
}

template <int HD, int BR, bool CROSS>
absl::Status LaunchBwd(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, const float* lse, AttnTensor dout,
                       const float* dsum, float* dq_acc, AttnOutTensor dk, AttnOutTensor dv, float* dkv_part,
                       int* dq_order, float* dk_add, float* dv_add, int64_t ld_add, cudaStream_t stream) {
  const size_t smem = (2 * kBwdBc * HD + 4 * BR * HD + kBwdBc * (BR + 8)) * sizeof(bf16) + 2 * BR * sizeof(float);
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(
      FlashBwdKernel<HD, BR, CROSS>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  dim3 grid((MaxKeys(a) + kBwdBc - 1) / kBwdBc, dkv_part != nullptr ? a.num_q_heads : a.num_kv_heads, a.num_docs);
  FlashBwdKernel<HD, BR, CROSS><<<grid, kBwdThreads, smem, stream>>>(a, q, k, v, lse, dout, dsum, dq_acc, dk, dv,
                                                                     dkv_part, dq_order, dk_add, dv_add, ld_add);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (dkv_part != nullptr) {
    const int64_t n = a.tokens * a.num_kv_heads * HD;
    GroupSumKernel<<<static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 16))), 256, 0,
                     stream>>>(dkv_part, a.tokens, a.num_q_heads, a.num_kv_heads, HD, a.softmax_scale, dk, dv);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  return absl::OkStatus();
}

int CastGrid(int64_t n) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 16))); }

int64_t AlignUp(int64_t x) { return (x + 255) / 256 * 256; }

}  // namespace

namespace {
// Per-q-head blocks when per-kv-head blocks would not fill the chip a few times over.
bool SplitBwdPerQHead(const AttnArgs& a) {
  // Cross attention adds its dK/dV per kv head (overlapping key ranges would race in the partials).
  if (!FlashAttentionFastPath(a.head_dim) || a.num_q_heads == a.num_kv_heads || a.cross()) return false;
  if (a.bwd_split != AttnArgs::BwdSplit::kAuto) return a.bwd_split == AttnArgs::BwdSplit::kPerQHead;
  const int64_t blocks = static_cast<int64_t>((a.max_seqlen + kBwdBc - 1) / kBwdBc) * a.num_kv_heads * a.num_docs;
  return blocks < 4 * 132;
}
}  // namespace

namespace {
// ordered_dq: one turn counter per (document, q head, q block of 32 rows or more).
int64_t OrderBytes(const AttnArgs& a) {
  return a.ordered_dq ? AlignUp(static_cast<int64_t>(a.num_docs) * a.num_q_heads * ((a.max_seqlen + 31) / 32) * 4) : 0;
}
}  // namespace

int64_t FlashAttentionBackwardWorkspaceBytes(const AttnArgs& a) {
  const int64_t dq = AlignUp(a.tokens * a.num_q_heads * a.head_dim * 4);
  const int64_t dsum = AlignUp(a.tokens * a.num_q_heads * 4);
  const int64_t dkv =
      FlashAttentionFastPath(a.head_dim) || a.cross() ? 0 : 2 * AlignUp(a.tokens * a.num_kv_heads * a.head_dim * 4);
  const int64_t part = SplitBwdPerQHead(a) ? AlignUp(2 * a.tokens * a.num_q_heads * a.head_dim * 4) : 0;
  return dq + dsum + dkv + part + OrderBytes(a);
}

namespace {
// Both backward entry points: dk/dv written (self attention) or dk_add/dv_add added (cross).
absl::Status Backward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o, const float* lse,
                      AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk, AttnOutTensor dv, float* dk_add,
                      float* dv_add, int64_t ld_add, void* ws, cudaStream_t stream) {
  absl::Status s = CheckArgs(a);
  if (!s.ok()) return s;
  if (a.sinks != nullptr && a.dsinks == nullptr) {
    return absl::InvalidArgumentError("attention backward: sinks without dsinks to add their gradient into");
  }
  if (a.tokens <= 0) return absl::OkStatus();
  char* w = static_cast<char*>(ws);
  const int64_t qnumel = a.tokens * a.num_q_heads * a.head_dim;
  const int64_t kvnumel = a.tokens * a.num_kv_heads * a.head_dim;
  float* dq_acc = reinterpret_cast<float*>(w);
  float* dsum = reinterpret_cast<float*>(w + AlignUp(qnumel * 4));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dq_acc, 0, qnumel * 4, stream));
  AttnRowDotKernel<<<SlowGrid(a), 256, 0, stream>>>(a, o, dout, dsum);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (a.sinks != nullptr) {
    SinkGradKernel<<<a.num_q_heads, 256, 0, stream>>>(a, lse, dsum);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  const int64_t qd = static_cast<int64_t>(a.num_q_heads) * a.head_dim;
  const int64_t kvd = static_cast<int64_t>(a.num_kv_heads) * a.head_dim;
  if (FlashAttentionFastPath(a.head_dim)) {
    char* after_dsum = w + AlignUp(qnumel * 4) + AlignUp(a.tokens * a.num_q_heads * 4);
    float* part = SplitBwdPerQHead(a) ? reinterpret_cast<float*>(after_dsum) : nullptr;
    int* order = nullptr;
    if (a.ordered_dq) {
      order = reinterpret_cast<int*>(after_dsum + (part != nullptr ? AlignUp(2 * qnumel * 4) : 0));
      SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(order, 0, OrderBytes(a), stream));
    }
    auto launch = [&](auto hd, auto br, auto cross) {
      return LaunchBwd<decltype(hd)::value, decltype(br)::value, decltype(cross)::value>(
          a, q, k, v, lse, dout, dsum, dq_acc, dk, dv, part, order, dk_add, dv_add, ld_add, stream);
    };
    using T128 = std::integral_constant<int, 128>;
    using T64 = std::integral_constant<int, 64>;
    using T32 = std::integral_constant<int, 32>;
    const bool cross = dk_add != nullptr;
    absl::Status ls = a.head_dim == 128
                          ? (cross ? launch(T128(), T32(), std::true_type()) : launch(T128(), T32(), std::false_type()))
                          : (cross ? launch(T64(), T64(), std::true_type()) : launch(T64(), T64(), std::false_type()));
    if (!ls.ok()) return ls;
    CastRowsKernel<<<CastGrid(qnumel), 256, 0, stream>>>(dq_acc, a.tokens, qd, a.softmax_scale, dq.ptr, dq.ld);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  }
  if (a.ordered_dq) {
    return absl::FailedPreconditionError(
        absl::StrCat("attention backward with ordered dQ (deterministic) needs head_dim "
                     "64 or 128, not ",
                     a.head_dim));
  }
  if (dk_add != nullptr) {  // cross: the slow path adds straight into the caller's FP32 rows
    SlowBwdKernel<<<SlowGrid(a), 256, 0, stream>>>(a, q, k, v, lse, dout, dsum, dq_acc, dk_add, dv_add, ld_add);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    CastRowsKernel<<<CastGrid(qnumel), 256, 0, stream>>>(dq_acc, a.tokens, qd, 1.0f, dq.ptr, dq.ld);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  }
  float* dk_acc = reinterpret_cast<float*>(w + AlignUp(qnumel * 4) + AlignUp(a.tokens * a.num_q_heads * 4));
  float* dv_acc = dk_acc + AlignUp(kvnumel * 4) / 4;
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dk_acc, 0, kvnumel * 4, stream));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dv_acc, 0, kvnumel * 4, stream));
  SlowBwdKernel<<<SlowGrid(a), 256, 0, stream>>>(a, q, k, v, lse, dout, dsum, dq_acc, dk_acc, dv_acc, kvd);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  CastRowsKernel<<<CastGrid(qnumel), 256, 0, stream>>>(dq_acc, a.tokens, qd, 1.0f, dq.ptr, dq.ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  CastRowsKernel<<<CastGrid(kvnumel), 256, 0, stream>>>(dk_acc, a.tokens, kvd, 1.0f, dk.ptr, dk.ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  CastRowsKernel<<<CastGrid(kvnumel), 256, 0, stream>>>(dv_acc, a.tokens, kvd, 1.0f, dv.ptr, dv.ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}
}  // namespace

absl::Status FlashAttentionBackward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                    const float* lse, AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk,
                                    AttnOutTensor dv, void* ws, cudaStream_t stream) {
  if (a.cross())
    return absl::InvalidArgumentError("attention backward: cross arguments need FlashAttentionBackwardCross");
  return Backward(a, q, k, v, o, lse, dout, dq, dk, dv, nullptr, nullptr, 0, ws, stream);
}

absl::Status FlashAttentionBackwardCross(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                         const float* lse, AttnTensor dout, AttnOutTensor dq, float* dk_acc,
                                         float* dv_acc, int64_t ld_acc, void* ws, cudaStream_t stream) {
  if (!a.cross() || dk_acc == nullptr || dv_acc == nullptr ||
      ld_acc < static_cast<int64_t>(a.num_kv_heads) * a.head_dim) {
    return absl::InvalidArgumentError(
        "attention backward (cross): needs kv_bounds, dK/dV accumulators and their row stride");
  }
  return Backward(a, q, k, v, o, lse, dout, dq, {}, {}, dk_acc, dv_acc, ld_acc, ws, stream);
}

}  // namespace slidedp::kernels
