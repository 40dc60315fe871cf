// Flash attention kernels; see attention.h for the contract.
//
// Limits: forward and backward are tensor-core bound (4·T_causal·hd FLOPs per head forward,
// 2.5x that backward). This FA2-style version uses mma.sync (HMMA), not Hopper's wgmma, so its
// ceiling is well under the chip's dense BF16 rate; bench/kernels reports what it reaches.
#include "worker/kernels/attention.h"
#include "worker/kernels/attention_order.h"

#include <algorithm>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
namespace {

using bf16 = __nv_bfloat16;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ---------------------------------------------------------------- PTX helpers
__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src, bool valid) {
  const int bytes = valid ? 16 : 0;  // 0: zero-fill, nothing read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void Ldsm4(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void Ldsm4T(uint32_t addr, uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
               : "r"(addr));
}
__device__ __forceinline__ void Mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// Tile of ROWS x HD bf16 in shared memory with 16-byte chunks XOR-swizzled by (row & 7), so the
// eight row addresses of one ldmatrix land in different banks.
template <int HD>
__device__ __forceinline__ int Swz(int row, int col) {
  return row * HD + ((((col >> 3) ^ (row & 7))) << 3) + (col & 7);
}

// Async copy of rows [row0, row0 + ROWS) of a [*, ld] matrix (columns col0 .. col0 + HD) into a
// swizzled tile; rows >= row_end are zero-filled.
template <int HD, int ROWS, int THREADS>
__device__ __forceinline__ void LoadTile(bf16* tile, const bf16* base, int64_t ld, int64_t row0, int64_t row_end) {
  constexpr int kChunks = ROWS * HD / 8;
  // Not unrolled: unrolled, the compiler hoists every chunk's address out of the main loop and
  // spends ~60 registers on them.
#pragma unroll 1
  for (int i = threadIdx.x; i < kChunks; i += THREADS) {
    const int r = i / (HD / 8), c = (i % (HD / 8)) * 8;
    const bool valid = row0 + r < row_end;
    const bf16* src = valid ? base + (row0 + r) * ld + c : base;
    CpAsync16(SmemAddr(tile + Swz<HD>(r, c)), src, valid);
  }
}

// ---------------------------------------------------------------- forward (tensor cores)
// Block: 4 warps, Br = 64·MT query rows (each warp owns MT m-tiles of 16 rows), Bc = 64 keys per
// step, K/V double-buffered with cp.async. Each K/V fragment read from shared memory feeds MT
// MMAs: with MT = 1 the loop was bound by shared-memory bandwidth (2 MMAs per ldmatrix.x4).
// Q fragments are re-read from shared memory each step (registers go to the accumulators).
constexpr int kFwdMt = 2, kFwdBr = 64 * kFwdMt, kFwdBc = 64, kFwdThreads = 128;

template <int HD>
__global__ void __launch_bounds__(kFwdThreads) FlashFwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v,
                                                              AttnOutTensor o, float* __restrict__ lse) {
  constexpr int MT = kFwdMt;
  extern __shared__ __align__(128) unsigned char smem_raw[];
  bf16* sq = reinterpret_cast<bf16*>(smem_raw);
  bf16* sk = sq + kFwdBr * HD;        // [2][Bc][HD]
  bf16* sv = sk + 2 * kFwdBc * HD;    // [2][Bc][HD]

  const int doc = blockIdx.z, head = blockIdx.y;
  const int64_t doc_start = a.cu_seqlens[doc];
  const int len = a.cu_seqlens[doc + 1] - static_cast<int>(doc_start);
  const int num_qb = (a.max_seqlen + kFwdBr - 1) / kFwdBr;
  const int qb = num_qb - 1 - blockIdx.x;  // heaviest first
  const int q0 = qb * kFwdBr;
  if (q0 >= len) return;
  const int kv_head = head / (a.num_q_heads / a.num_kv_heads);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;

  const bf16* qbase = q.ptr + doc_start * q.ld + static_cast<int64_t>(head) * HD;
  const bf16* kbase = k.ptr + doc_start * k.ld + static_cast<int64_t>(kv_head) * HD;
  const bf16* vbase = v.ptr + doc_start * v.ld + static_cast<int64_t>(kv_head) * HD;
  const int nblocks = (min(q0 + kFwdBr, len) + kFwdBc - 1) / kFwdBc;

  LoadTile<HD, kFwdBr, kFwdThreads>(sq, qbase, q.ld, q0, len);
  LoadTile<HD, kFwdBc, kFwdThreads>(sk, kbase, k.ld, 0, len);
  LoadTile<HD, kFwdBc, kFwdThreads>(sv, vbase, v.ld, 0, len);
  CpAsyncCommit();

  float acc[MT][HD / 8][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int i = 0; i < HD / 8; ++i) acc[mt][i][0] = acc[mt][i][1] = acc[mt][i][2] = acc[mt][i][3] = 0.f;
  float m_run[MT][2], l_run[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) m_run[mt][0] = m_run[mt][1] = -INFINITY, l_run[mt][0] = l_run[mt][1] = 0.f;
  const float scale_log2 = a.softmax_scale * kLog2e;
  const int wrow = warp * 16 * MT;  // first tile row of this warp

  for (int j = 0; j < nblocks; ++j) {
    const int stage = j & 1;
    if (j + 1 < nblocks) {
      const int ns = (j + 1) & 1;
      LoadTile<HD, kFwdBc, kFwdThreads>(sk + ns * kFwdBc * HD, kbase, k.ld, (j + 1) * kFwdBc, len);
      LoadTile<HD, kFwdBc, kFwdThreads>(sv + ns * kFwdBc * HD, vbase, v.ld, (j + 1) * kFwdBc, len);
      CpAsyncCommit();
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    const bf16* skt = sk + stage * kFwdBc * HD;
    const bf16* svt = sv + stage * kFwdBc * HD;
    const int key0 = j * kFwdBc;
    // Warps whose rows all precede this key block contribute nothing (causal): skip the math.
    const bool warp_active = key0 <= q0 + wrow + 16 * MT - 1;

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
          Ldsm4(SmemAddr(skt + Swz<HD>(np * 16 + (lane & 7) + ((lane >> 4) << 3), kk * 16 + ((lane >> 3) & 1) * 8)),
                b0, b1, b2, b3);
#pragma unroll
          for (int mt = 0; mt < MT; ++mt) {
            Mma(s[mt][2 * np], qa[mt], b0, b1);
            Mma(s[mt][2 * np + 1], qa[mt], b2, b3);
          }
        }
      }
      // Scale, mask (causal and the document end), online softmax.
      const bool need_mask = key0 + kFwdBc > q0 + wrow || key0 + kFwdBc > len;
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
              if (key > row || key >= len) val = -INFINITY;
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
      if (row_a < len)
        *reinterpret_cast<__nv_bfloat162*>(obase + row_a * o.ld + col) =
            __floats2bfloat162_rn(acc[mt][dt][0] * inv0, acc[mt][dt][1] * inv0);
      if (row_b < len)
        *reinterpret_cast<__nv_bfloat162*>(obase + row_b * o.ld + col) =
            __floats2bfloat162_rn(acc[mt][dt][2] * inv1, acc[mt][dt][3] * inv1);
    }
    if (t4 == 0) {
      if (row_a < len) lrow[row_a] = m_run[mt][0] * kLn2 + logf(l_run[mt][0]);
      if (row_b < len) lrow[row_b] = m_run[mt][1] * kLn2 + logf(l_run[mt][1]);
    }
  }
}

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

// D[h][t] = Σ_d dO[t, h*hd + d] * O[t, h*hd + d]; one warp per (token, head).
__global__ void AttnRowDotKernel(AttnArgs a, AttnTensor o, AttnTensor dout, float* __restrict__ dsum) {
  const int lane = threadIdx.x & 31;
  const int64_t n = a.tokens * a.num_q_heads;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / a.num_q_heads;
    const int h = static_cast<int>(r % a.num_q_heads);
    const bf16* op = o.ptr + t * o.ld + static_cast<int64_t>(h) * a.head_dim;
    const bf16* dp = dout.ptr + t * dout.ld + static_cast<int64_t>(h) * a.head_dim;
    float s = 0.f;
    for (int d = lane; d < a.head_dim; d += 32) s += __bfloat162float(op[d]) * __bfloat162float(dp[d]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) dsum[static_cast<int64_t>(h) * a.tokens + t] = s;
  }
}

template <int HD, int BR>
__global__ void __launch_bounds__(kBwdThreads) FlashBwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v,
                                                              const float* __restrict__ lse, AttnTensor dout,
                                                              const float* __restrict__ dsum,
                                                              float* __restrict__ dq_acc, AttnOutTensor dk,
                                                              AttnOutTensor dv, float* __restrict__ dkv_part,
                                                              int* __restrict__ dq_order) {
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
  const int64_t doc_start = a.cu_seqlens[doc];
  const int len = a.cu_seqlens[doc + 1] - static_cast<int>(doc_start);
  const int num_kb = (a.max_seqlen + kBwdBc - 1) / kBwdBc;
  const int kb = num_kb - 1 - blockIdx.x;
  const int k0 = kb * kBwdBc;
  if (k0 >= len) return;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const float scale_log2 = a.softmax_scale * kLog2e;

  LoadTile<HD, kBwdBc, kBwdThreads>(sk, k.ptr + doc_start * k.ld + static_cast<int64_t>(kvh) * HD, k.ld, k0, len);
  LoadTile<HD, kBwdBc, kBwdThreads>(sv, v.ptr + doc_start * v.ld + static_cast<int64_t>(kvh) * HD, v.ld, k0, len);
  CpAsyncCommit();

  float dk_acc[HD / 8][4], dv_acc[HD / 8][4];
#pragma unroll
  for (int i = 0; i < HD / 8; ++i)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk_acc[i][e] = dv_acc[i][e] = 0.f;

  const int key_a = k0 + warp * 16 + g, key_b = key_a + 8;  // doc-relative keys of this thread's rows
  const int qb_start = k0 / BR;
  const int qb_end = (len + BR - 1) / BR;
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
    LoadTile<HD, BR, kBwdThreads>(sq2 + buf * BR * HD, q.ptr + doc_start * q.ld + static_cast<int64_t>(head) * HD,
                                  q.ld, q0, len);
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
      const bool need_mask = q0 < k0 + kBwdBc;
#pragma unroll
      for (int nt = 0; nt < BR / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int qi = nt * 8 + 2 * t4 + (e & 1);
          const int key = e < 2 ? key_a : key_b;
          float p = exp2f(st[nt][e] * scale_log2 - slse[qi]);
          if (need_mask && q0 + qi < key) p = 0.f;
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
            Ldsm4T(SmemAddr(sk + Swz<HD>(kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                         dq_c0 + dp * 16 + (lane >> 4) * 8)),
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
            if (ra < len) atomicAdd(reinterpret_cast<float2*>(dqbase + ra * ldq + col), make_float2(dq[dt][0], dq[dt][1]));
            if (rb < len) atomicAdd(reinterpret_cast<float2*>(dqbase + rb * ldq + col), make_float2(dq[dt][2], dq[dt][3]));
          }
        } else {
          // Ordered (attention_order.h): the key blocks reaching this q block add in descending
          // kb, the launch order, so a block only ever waits for blocks launched before it.
          int* turn = dq_order + (static_cast<int64_t>(doc) * a.num_q_heads + head) * ((a.max_seqlen + BR - 1) / BR) + qb;
          const int rank = DqTurn(qb, kb, len, BR, kBwdBc);
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
  bf16* dkbase = dk.ptr + doc_start * dk.ld + static_cast<int64_t>(kvh) * HD;
  bf16* dvbase = dv.ptr + doc_start * dv.ld + static_cast<int64_t>(kvh) * HD;
  const float sc = a.softmax_scale;
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
constexpr int kSlowMaxDimPerLane = 8;

__device__ __forceinline__ int FindDoc(const int32_t* cu, int docs, int64_t t) {
  int lo = 0, hi = docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t) lo = mid; else hi = mid - 1;
  }
  return lo;
}

__global__ void SlowFwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o, float* lse) {
  const int lane = threadIdx.x & 31;
  const int hd = a.head_dim, group = a.num_q_heads / a.num_kv_heads;
  const int64_t n = a.tokens * a.num_q_heads;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / a.num_q_heads;
    const int h = static_cast<int>(r % a.num_q_heads), kvh = h / group;
    const int64_t start = a.cu_seqlens[FindDoc(a.cu_seqlens, a.num_docs, t)];
    float qv[kSlowMaxDimPerLane], acc[kSlowMaxDimPerLane];
#pragma unroll
    for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      qv[i] = d < hd ? __bfloat162float(q.ptr[t * q.ld + h * hd + d]) : 0.f;
      acc[i] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (int64_t j = start; j <= t; ++j) {
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
      if (d < hd) o.ptr[t * o.ld + h * hd + d] = __float2bfloat16(acc[i] / l);
    }
    if (lane == 0) lse[static_cast<int64_t>(h) * a.tokens + t] = m + logf(l);
  }
}

__global__ void SlowBwdKernel(AttnArgs a, AttnTensor q, AttnTensor k, AttnTensor v, const float* lse,
                              AttnTensor dout, const float* dsum, float* dq_acc, float* dk_acc, float* dv_acc) {
  const int lane = threadIdx.x & 31;
  const int hd = a.head_dim, group = a.num_q_heads / a.num_kv_heads;
  const int64_t n = a.tokens * a.num_q_heads;
  const int64_t qd = static_cast<int64_t>(a.num_q_heads) * hd, kvd = static_cast<int64_t>(a.num_kv_heads) * hd;
  for (int64_t r = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) / 32; r < n;
       r += static_cast<int64_t>(gridDim.x) * blockDim.x / 32) {
    const int64_t t = r / a.num_q_heads;
    const int h = static_cast<int>(r % a.num_q_heads), kvh = h / group;
    const int64_t start = a.cu_seqlens[FindDoc(a.cu_seqlens, a.num_docs, t)];
    const float L = lse[static_cast<int64_t>(h) * a.tokens + t], D = dsum[static_cast<int64_t>(h) * a.tokens + t];
    float qv[kSlowMaxDimPerLane], dov[kSlowMaxDimPerLane], dq[kSlowMaxDimPerLane];
#pragma unroll
    for (int i = 0; i < kSlowMaxDimPerLane; ++i) {
      const int d = lane + 32 * i;
      qv[i] = d < hd ? __bfloat162float(q.ptr[t * q.ld + h * hd + d]) : 0.f;
      dov[i] = d < hd ? __bfloat162float(dout.ptr[t * dout.ld + h * hd + d]) : 0.f;
      dq[i] = 0.f;
    }
    for (int64_t j = start; j <= t; ++j) {
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
          atomicAdd(dk_acc + j * kvd + kvh * hd + d, ds * qv[i]);
          atomicAdd(dv_acc + j * kvd + kvh * hd + d, p * dov[i]);
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

absl::Status CheckArgs(const AttnArgs& a) {
  if (a.head_dim <= 0 || a.head_dim > 32 * kSlowMaxDimPerLane || a.num_q_heads <= 0 || a.num_kv_heads <= 0 ||
      a.num_q_heads % a.num_kv_heads != 0 || a.num_docs <= 0 || a.cu_seqlens == nullptr || a.max_seqlen <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention: bad arguments head_dim=", a.head_dim, " heads=",
                                                   a.num_q_heads, "/", a.num_kv_heads, " docs=", a.num_docs,
                                                   " max_seqlen=", a.max_seqlen));
  }
  return absl::OkStatus();
}

int SlowGrid(const AttnArgs& a) {
  const int64_t warps = a.tokens * a.num_q_heads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((warps + 7) / 8, 132 * 16)));
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

template <int HD, int BR>
absl::Status LaunchBwd(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, const float* lse,
                       AttnTensor dout, const float* dsum, float* dq_acc, AttnOutTensor dk, AttnOutTensor dv,
                       float* dkv_part, int* dq_order, cudaStream_t stream) {
  const size_t smem = (2 * kBwdBc * HD + 4 * BR * HD + kBwdBc * (BR + 8)) * sizeof(bf16) + 2 * BR * sizeof(float);
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(FlashBwdKernel<HD, BR>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                    static_cast<int>(smem)));
  dim3 grid((a.max_seqlen + kBwdBc - 1) / kBwdBc, dkv_part != nullptr ? a.num_q_heads : a.num_kv_heads, a.num_docs);
  FlashBwdKernel<HD, BR>
      <<<grid, kBwdThreads, smem, stream>>>(a, q, k, v, lse, dout, dsum, dq_acc, dk, dv, dkv_part, dq_order);
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

bool FlashAttentionFastPath(int head_dim) { return head_dim == 64 || head_dim == 128; }

namespace {
// Per-q-head blocks when per-kv-head blocks would not fill the chip a few times over.
bool SplitBwdPerQHead(const AttnArgs& a) {
  if (!FlashAttentionFastPath(a.head_dim) || a.num_q_heads == a.num_kv_heads) return false;
  if (a.bwd_split != AttnArgs::BwdSplit::kAuto) return a.bwd_split == AttnArgs::BwdSplit::kPerQHead;
  const int64_t blocks = static_cast<int64_t>((a.max_seqlen + kBwdBc - 1) / kBwdBc) * a.num_kv_heads * a.num_docs;
  return blocks < 4 * 132;
}
}  // namespace

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

namespace {
// ordered_dq: one turn counter per (document, q head, q block of 32 rows or more).
int64_t OrderBytes(const AttnArgs& a) {
  return a.ordered_dq ? AlignUp(static_cast<int64_t>(a.num_docs) * a.num_q_heads * ((a.max_seqlen + 31) / 32) * 4) : 0;
}
}  // namespace

int64_t FlashAttentionBackwardWorkspaceBytes(const AttnArgs& a) {
  const int64_t dq = AlignUp(a.tokens * a.num_q_heads * a.head_dim * 4);
  const int64_t dsum = AlignUp(a.tokens * a.num_q_heads * 4);
  const int64_t dkv = FlashAttentionFastPath(a.head_dim) ? 0 : 2 * AlignUp(a.tokens * a.num_kv_heads * a.head_dim * 4);
  const int64_t part = SplitBwdPerQHead(a) ? AlignUp(2 * a.tokens * a.num_q_heads * a.head_dim * 4) : 0;
  return dq + dsum + dkv + part + OrderBytes(a);
}

absl::Status FlashAttentionBackward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                    const float* lse, AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk,
                                    AttnOutTensor dv, void* ws, cudaStream_t stream) {
  absl::Status s = CheckArgs(a);
  if (!s.ok()) return s;
  if (a.tokens <= 0) return absl::OkStatus();
  char* w = static_cast<char*>(ws);
  const int64_t qnumel = a.tokens * a.num_q_heads * a.head_dim;
  const int64_t kvnumel = a.tokens * a.num_kv_heads * a.head_dim;
  float* dq_acc = reinterpret_cast<float*>(w);
  float* dsum = reinterpret_cast<float*>(w + AlignUp(qnumel * 4));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dq_acc, 0, qnumel * 4, stream));
  AttnRowDotKernel<<<SlowGrid(a), 256, 0, stream>>>(a, o, dout, dsum);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
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
    absl::Status ls = a.head_dim == 128
                          ? LaunchBwd<128, 32>(a, q, k, v, lse, dout, dsum, dq_acc, dk, dv, part, order, stream)
                          : LaunchBwd<64, 64>(a, q, k, v, lse, dout, dsum, dq_acc, dk, dv, part, order, stream);
    if (!ls.ok()) return ls;
    CastRowsKernel<<<CastGrid(qnumel), 256, 0, stream>>>(dq_acc, a.tokens, qd, a.softmax_scale, dq.ptr, dq.ld);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  }
  if (a.ordered_dq) {
    return absl::FailedPreconditionError(absl::StrCat("attention backward with ordered dQ (deterministic) needs head_dim "
                                                      "64 or 128, not ", a.head_dim));
  }
  float* dk_acc = reinterpret_cast<float*>(w + AlignUp(qnumel * 4) + AlignUp(a.tokens * a.num_q_heads * 4));
  float* dv_acc = dk_acc + AlignUp(kvnumel * 4) / 4;
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dk_acc, 0, kvnumel * 4, stream));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(dv_acc, 0, kvnumel * 4, stream));
  SlowBwdKernel<<<SlowGrid(a), 256, 0, stream>>>(a, q, k, v, lse, dout, dsum, dq_acc, dk_acc, dv_acc);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  CastRowsKernel<<<CastGrid(qnumel), 256, 0, stream>>>(dq_acc, a.tokens, qd, 1.0f, dq.ptr, dq.ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  CastRowsKernel<<<CastGrid(kvnumel), 256, 0, stream>>>(dk_acc, a.tokens, kvd, 1.0f, dk.ptr, dk.ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  CastRowsKernel<<<CastGrid(kvnumel), 256, 0, stream>>>(dv_acc, a.tokens, kvd, 1.0f, dv.ptr, dv.ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
