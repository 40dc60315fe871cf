// Device helpers and host checks both directions of the own flash attention share
// (attention_forward.cu, attention_backward.cu): the PTX wrappers (cp.async, ldmatrix, mma.sync
// m16n8k16), the swizzled shared-memory tiles, the slow path's document lookup, and the argument
// check and grid of the launchers. Included by those two .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "worker/kernels/attention.h"

namespace slidedp::kernels::attention_internal {

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

// ---------------------------------------------------------------- slow path (any head_dim <= 256)
constexpr int kSlowMaxDimPerLane = 8;

__device__ __forceinline__ int FindDoc(const int32_t* cu, int docs, int64_t t) {
  int lo = 0, hi = docs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (cu[mid] <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// A piece's (or document's) queries and keys: rows of q from q_start (len of them) against rows of
// k/v from kv_start (len + off of them), query i seeing keys 0 .. i + off. Self attention: the
// document's own rows, off 0.
struct AttnSpan {
  int64_t q_start, kv_start;
  int len, off;
};
// CROSS false: self attention whatever the arguments (the tensor-core kernels' instantiation
// without the cross-attention code, whose registers it would cost).
template <bool CROSS = true>
__device__ __forceinline__ AttnSpan SpanOf(const AttnArgs& a, int doc) {
  AttnSpan s;
  s.q_start = a.cu_seqlens[doc];
  s.len = a.cu_seqlens[doc + 1] - static_cast<int>(s.q_start);
  if (!CROSS || a.kv_bounds == nullptr) {
    s.kv_start = s.q_start;
    s.off = 0;
  } else {
    s.kv_start = a.kv_bounds[2 * doc];
    s.off = a.kv_bounds[2 * doc + 1] - static_cast<int>(s.kv_start) - s.len;
  }
  return s;
}

inline absl::Status CheckArgs(const AttnArgs& a) {
  if (a.kv_bounds != nullptr && (a.kv_tokens <= 0 || a.max_seqlen_kv < a.max_seqlen)) {
    return absl::InvalidArgumentError(absl::StrCat("attention: cross attention with kv_tokens=", a.kv_tokens,
                                                   " max_seqlen_kv=", a.max_seqlen_kv, " (queries ", a.max_seqlen,
                                                   ")"));
  }
  if (a.window < 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention: bad window ", a.window));
  }
  if (a.head_dim <= 0 || a.head_dim > 32 * kSlowMaxDimPerLane || a.num_q_heads <= 0 || a.num_kv_heads <= 0 ||
      a.num_q_heads % a.num_kv_heads != 0 || a.num_docs <= 0 || a.cu_seqlens == nullptr || a.max_seqlen <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("attention: bad arguments head_dim=", a.head_dim,
                                                   " heads=", a.num_q_heads, "/", a.num_kv_heads, " docs=", a.num_docs,
                                                   " max_seqlen=", a.max_seqlen));
  }
  return absl::OkStatus();
}

// Key blocks of a backward grid: over the longest key range.
__host__ __device__ inline int MaxKeys(const AttnArgs& a) {
  return a.kv_bounds != nullptr ? a.max_seqlen_kv : a.max_seqlen;
}

inline int SlowGrid(const AttnArgs& a) {
  const int64_t warps = a.tokens * a.num_q_heads;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((warps + 7) / 8, 132 * 16)));
}

}  // namespace slidedp::kernels::attention_internal
