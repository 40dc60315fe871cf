// What both directions of the gated delta rule share (gated_delta.cu, gated_delta_backward.cu): the
// chunk map and workspace layout, the argument check, the warp-level TF32 GEMM on shared-memory
// operands with its precision split, fragment row/column sums, tile loads, the in-chunk cumulative
// decay and the 64x64 unit-lower-triangular inverse; and the forward launchers the backward reruns.
// Included by those two .cu files only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "absl/status/status.h"
#include "worker/kernels/gated_delta.h"
#include "worker/kernels/gated_delta_ptx.cuh"

namespace slidedp::kernels::gated_delta_internal {

using bf16 = __nv_bfloat16;

constexpr int kChunk = 64;     // tokens per chunk
constexpr int kThreads = 256;  // every kernel's block: 8 warps
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFullMask = 0xffffffffu;

// ---------------------------------------------------------------- chunk map and workspace

// One chunk: tokens [start, start + len) of one document. slot: where the state entering it is
// stored (-1 for a document's first chunk, whose entering state is zero); next_slot: the next
// chunk's slot (-1 for a document's last chunk).
struct ChunkInfo {
  int start, len, slot, next_slot;
};
// A document's chunks: [first, first + count).
struct DocChunks {
  int first, count;
};

inline int64_t AlignUp(int64_t x, int64_t a) { return (x + a - 1) / a * a; }

// Byte offsets into the workspace. Chunk c of document d (c counted over all documents) has
// slot c - d - 1 when it is not the document's first, so slots <= T / 64.
struct WorkspaceLayout {
  int64_t max_chunks = 0, slots = 0;
  int64_t chunks = 0, docs = 0, count = 0, w = 0, u = 0, states = 0, du = 0, dstates = 0, dgamma = 0, bytes = 0;
};

inline WorkspaceLayout MakeLayout(const GatedDeltaArgs& a, bool backward) {
  WorkspaceLayout l;
  const int64_t T = a.tokens, nv = a.num_v_heads, dk = a.k_dim, dv = a.v_dim;
  l.max_chunks = T / kChunk + a.num_docs;
  l.slots = std::max<int64_t>(1, T / kChunk);
  int64_t off = 0;
  auto take = [&off](int64_t bytes) {
    const int64_t at = off;
    off += AlignUp(bytes, 256);
    return at;
  };
  l.chunks = take(l.max_chunks * static_cast<int64_t>(sizeof(ChunkInfo)));
  l.docs = take(a.num_docs * static_cast<int64_t>(sizeof(DocChunks)));
  l.count = take(sizeof(int));
  l.w = take(T * nv * dk * 4);
  l.u = take(T * nv * dv * 4);
  l.states = take(l.slots * nv * dk * dv * 4);
  if (backward) {
    l.du = take(T * nv * dv * 4);
    l.dstates = take(l.slots * nv * dk * dv * 4);
    l.dgamma = take(dk / 64 * T * nv * 4);
  }
  l.bytes = off;
  return l;
}

// Everything a kernel reads or writes, by value in its parameters. The backward fields are null in
// the forward.
struct Problem {
  const bf16 *q, *k, *v;
  const float *g, *beta;
  int64_t tokens;
  int nk, nv, group;  // group = nv / nk value heads per key head
  float scale;
  const ChunkInfo* chunks;
  const DocChunks* docs;
  const int* num_chunks;  // chunks in use (<= max_chunks), written by the chunk map kernel
  float* w;               // [T, nv, dk]: W; the backward overwrites it with dW
  float* u;               // [T, nv, dv]: U~, overwritten with U by the state recurrence
  float* states;          // [slots, nv, dk, dv]: the state entering each non-first chunk
  // backward
  const bf16* d_o;
  float* du;       // [T, nv, dv]: dU
  float* dstates;  // [slots, nv, dk, dv]: dL/dS entering each non-first chunk
  float* dgamma;   // [dk / 64, T, nv]: the state-gradient kernel's parts of dL/dgamma
  float *dq, *dk, *dv, *dg, *dbeta;
};

// INVALID_ARGUMENT unless the sizes are supported (see gated_delta.h); CheckArgs also needs
// cu_seqlens (the workspace queries do not).
absl::Status CheckSizes(const GatedDeltaArgs& a);
absl::Status CheckArgs(const GatedDeltaArgs& a);
// The Problem for these arguments over this workspace (carved by MakeLayout).
Problem MakeProblem(const GatedDeltaArgs& a, const WorkspaceLayout& l, void* workspace, const bf16* q, const bf16* k,
                    const bf16* v, const float* g, const float* beta);
// The forward's first half, which the backward reruns: the chunk map, then W, U~ per chunk, then
// the state recurrence (U and the per-chunk states). Defined in gated_delta.cu.
absl::Status LaunchChunkMapPrepStates(const GatedDeltaArgs& a, const WorkspaceLayout& l, const Problem& p,
                                      void* workspace, cudaStream_t stream);

// ---------------------------------------------------------------- warp-level TF32 GEMM

// How an operand enters the tensor cores. kBf16: BF16 data (exact in TF32: one term). kFp32: any
// FP32 value, split into big = tf32(x) and small = tf32(x - big); a product costs 1, 2 or 3 MMAs
// and drops only small x small (~2^-22 relative).
enum class Prec { kBf16, kFp32 };

template <Prec P>
__device__ __forceinline__ void SplitTf32(float x, uint32_t& big, uint32_t& small) {
  if constexpr (P == Prec::kBf16) {
    big = __float_as_uint(x);
    small = 0u;
  } else {
    big = ToTf32(x);
    small = ToTf32(x - __uint_as_float(big));
  }
}

// The 8 warps of a block tile an M x N product: WARPS_M along M, the rest along N; each warp owns a
// (16 MI) x (8 NI) piece at (M0(), N0()).
template <int M, int N, int WARPS_M>
struct Tiling {
  static constexpr int kM = M, kN = N, kWarpsM = WARPS_M, kWarpsN = kWarps / WARPS_M;
  static constexpr int kTileM = M / WARPS_M, kTileN = N / kWarpsN;
  static constexpr int MI = kTileM / 16, NI = kTileN / 8;
  static_assert(kWarps % WARPS_M == 0 && M % WARPS_M == 0 && N % kWarpsN == 0, "tiling");
  static_assert(kTileM % 16 == 0 && kTileN % 8 == 0 && MI >= 1 && NI >= 1, "tile must hold whole MMA tiles");
  __device__ static int WarpM() { return static_cast<int>(threadIdx.x >> 5) % WARPS_M; }
  __device__ static int WarpN() { return static_cast<int>(threadIdx.x >> 5) / WARPS_M; }
  __device__ static int M0() { return WarpM() * kTileM; }
  __device__ static int N0() { return WarpN() * kTileN; }
};

template <int MI, int NI>
__device__ __forceinline__ void ZeroAcc(float (&acc)[MI][NI][4]) {
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[mi][ni][e] = 0.0f;
}

// acc (this warp's tile at (m0, n0)) += A B over k in [0, k_len) (a multiple of 8), with a(m, k)
// and b(k, n) returning the operands as floats: any shared-memory layout, transpose, scale or mask.
// The small parts go first, so the big product lands on an accumulator that already holds them.
template <Prec PA, Prec PB, int MI, int NI, typename FA, typename FB>
__device__ __forceinline__ void WarpGemm(float (&acc)[MI][NI][4], int m0, int n0, int k_len, FA a, FB b) {
  const int lane = static_cast<int>(threadIdx.x & 31), gr = lane >> 2, tg = lane & 3;
#pragma unroll 2
  for (int k0 = 0; k0 < k_len; k0 += 8) {
    uint32_t ab[MI][4], as[MI][4], bb[NI][2], bs[NI][2];
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
      const int r = m0 + 16 * mi + gr;
      SplitTf32<PA>(a(r, k0 + tg), ab[mi][0], as[mi][0]);
      SplitTf32<PA>(a(r + 8, k0 + tg), ab[mi][1], as[mi][1]);
      SplitTf32<PA>(a(r, k0 + tg + 4), ab[mi][2], as[mi][2]);
      SplitTf32<PA>(a(r + 8, k0 + tg + 4), ab[mi][3], as[mi][3]);
    }
#pragma unroll
    for (int ni = 0; ni < NI; ++ni) {
      const int n = n0 + 8 * ni + gr;
      SplitTf32<PB>(b(k0 + tg, n), bb[ni][0], bs[ni][0]);
      SplitTf32<PB>(b(k0 + tg + 4, n), bb[ni][1], bs[ni][1]);
    }
#pragma unroll
    for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        if constexpr (PA == Prec::kFp32) MmaTf32(acc[mi][ni], as[mi], bb[ni]);
        if constexpr (PB == Prec::kFp32) MmaTf32(acc[mi][ni], ab[mi], bs[ni]);
        MmaTf32(acc[mi][ni], ab[mi], bb[ni]);
      }
    }
  }
}

// f(row, col, value&) for every accumulator element of this warp's tile at (m0, n0).
template <int MI, int NI, typename F>
__device__ __forceinline__ void ForEachAcc(float (&acc)[MI][NI][4], int m0, int n0, F f) {
  const int lane = static_cast<int>(threadIdx.x & 31), gr = lane >> 2, tg = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int e = 0; e < 4; ++e) f(m0 + 16 * mi + gr + (e >> 1) * 8, n0 + 8 * ni + 2 * tg + (e & 1), acc[mi][ni][e]);
}

// f(row, col, v0&, v1&) for the element pairs (row, col), (row, col + 1), col even: one 8- or
// 4-byte store each.
template <int MI, int NI, typename F>
__device__ __forceinline__ void ForEachAccPair(float (&acc)[MI][NI][4], int m0, int n0, F f) {
  const int lane = static_cast<int>(threadIdx.x & 31), gr = lane >> 2, tg = lane & 3;
#pragma unroll
  for (int mi = 0; mi < MI; ++mi)
#pragma unroll
    for (int ni = 0; ni < NI; ++ni)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        f(m0 + 16 * mi + gr + 8 * h, n0 + 8 * ni + 2 * tg, acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
}

// Row sums of f(row, col, value) over this warp's columns, into part[WarpN * kM + row] (one writer
// per entry; after a barrier the caller adds the kWarpsN parts of a row in order: deterministic).
template <class TL, int MI, int NI, typename F>
__device__ __forceinline__ void RowPartials(float (&acc)[MI][NI][4], float* part, F f) {
  const int lane = static_cast<int>(threadIdx.x & 31), gr = lane >> 2, tg = lane & 3;
  const int m0 = TL::M0(), n0 = TL::N0();
#pragma unroll
  for (int mi = 0; mi < MI; ++mi) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = m0 + 16 * mi + gr + 8 * h;
      float s = 0.0f;
#pragma unroll
      for (int ni = 0; ni < NI; ++ni) {
        const int c = n0 + 8 * ni + 2 * tg;
        s += f(r, c, acc[mi][ni][2 * h]) + f(r, c + 1, acc[mi][ni][2 * h + 1]);
      }
      s += __shfl_xor_sync(kFullMask, s, 1);
      s += __shfl_xor_sync(kFullMask, s, 2);
      if (tg == 0) part[TL::WarpN() * TL::kM + r] = s;
    }
  }
}

// Column sums, into part[WarpM * kN + col].
template <class TL, int MI, int NI, typename F>
__device__ __forceinline__ void ColPartials(float (&acc)[MI][NI][4], float* part, F f) {
  const int lane = static_cast<int>(threadIdx.x & 31), gr = lane >> 2, tg = lane & 3;
  const int m0 = TL::M0(), n0 = TL::N0();
#pragma unroll
  for (int ni = 0; ni < NI; ++ni) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int c = n0 + 8 * ni + 2 * tg + e;
      float s = 0.0f;
#pragma unroll
      for (int mi = 0; mi < MI; ++mi) {
        const int r = m0 + 16 * mi + gr;
        s += f(r, c, acc[mi][ni][e]) + f(r + 8, c, acc[mi][ni][2 + e]);
      }
      s += __shfl_xor_sync(kFullMask, s, 4);
      s += __shfl_xor_sync(kFullMask, s, 8);
      s += __shfl_xor_sync(kFullMask, s, 16);
      if (gr == 0) part[TL::WarpM() * TL::kN + c] = s;
    }
  }
}

// ---------------------------------------------------------------- loads

// Rows [0, ROWS) of a [*, src_ld] matrix (COLS elements from src each) into shared memory with
// leading dimension dst_ld, asynchronously; rows >= valid_rows are zero-filled. COLS * sizeof(T)
// and dst_ld * sizeof(T) must be multiples of 16 bytes. Commit and wait are the caller's.
template <int ROWS, int COLS, typename T>
__device__ __forceinline__ void LoadRowsAsync(T* dst, int dst_ld, const T* src, int64_t src_ld, int valid_rows) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T)), kPerRow = COLS / kVec;
  static_assert(COLS % kVec == 0, "rows are copied in 16-byte pieces");
#pragma unroll 1
  for (int i = static_cast<int>(threadIdx.x); i < ROWS * kPerRow; i += kThreads) {
    const int r = i / kPerRow, c = (i % kPerRow) * kVec;
    const bool valid = r < valid_rows;
    CpAsync16(dst + r * dst_ld + c, valid ? src + r * src_ld + c : src, valid);
  }
}

// The chunk's per-token scalars src[i * stride], i < valid_rows (else 0), into dst[0, 64).
__device__ __forceinline__ void LoadScalarsAsync(float* dst, const float* src, int64_t stride, int valid_rows) {
  const int i = static_cast<int>(threadIdx.x);
  if (i < kChunk) CpAsync4(dst + i, i < valid_rows ? src + i * stride : src, i < valid_rows);
}

__device__ __forceinline__ float Bf(bf16 x) { return __bfloat162float(x); }

// ---------------------------------------------------------------- per-chunk pieces

// Warp 0: gamma = the inclusive prefix sum of g over the chunk's 64 rows (padded rows hold g = 0,
// so they keep the last value); optionally decay[i] = exp(gamma_last - gamma_i) (<= 1),
// egamma[i] = exp(gamma_i) and misc[0] = exp(gamma_last), with gamma_last = gamma[len - 1]. Only
// differences <= 0 are exponentiated. A barrier must follow.
__device__ __forceinline__ void ChunkDecay(const float* g, int len, float* gamma, float* decay, float* misc,
                                           float* egamma = nullptr) {
  if (threadIdx.x >= 32) return;
  const int lane = static_cast<int>(threadIdx.x);
  float a = g[lane], b = g[32 + lane];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float ta = __shfl_up_sync(kFullMask, a, o), tb = __shfl_up_sync(kFullMask, b, o);
    if (lane >= o) {
      a += ta;
      b += tb;
    }
  }
  b += __shfl_sync(kFullMask, a, 31);
  const int last = len - 1;
  const float la = __shfl_sync(kFullMask, a, last & 31), lb = __shfl_sync(kFullMask, b, last & 31);
  const float gl = last < 32 ? la : lb;
  gamma[lane] = a;
  gamma[32 + lane] = b;
  if (decay != nullptr) {
    decay[lane] = expf(gl - a);
    decay[32 + lane] = expf(gl - b);
  }
  if (egamma != nullptr) {
    egamma[lane] = expf(a);
    egamma[32 + lane] = expf(b);
  }
  if (lane == 0 && misc != nullptr) misc[0] = expf(gl);
}

// Warp 0: out[i] = sum_{j >= i} x[j] over the chunk's 64 rows (the reverse cumulative sum that
// turns dL/dgamma into dL/dg). A barrier must follow before other warps read out.
__device__ __forceinline__ void ChunkSuffixSum(const float* x, float* out) {
  if (threadIdx.x >= 32) return;
  const int lane = static_cast<int>(threadIdx.x);
  float a = x[lane], b = x[32 + lane];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const float ta = __shfl_down_sync(kFullMask, a, o), tb = __shfl_down_sync(kFullMask, b, o);
    if (lane + o < 32) {
      a += ta;
      b += tb;
    }
  }
  a += __shfl_sync(kFullMask, b, 0);
  out[lane] = a;
  out[32 + lane] = b;
}

// T = (I + diag(beta) E)^-1 for E strictly lower triangular (64 x 64, leading dimension ld):
// forward substitution T[i][c] = -beta_i sum_{c <= j < i} E[i][j] T[j][c] in FP32, each column
// owned by 4 lanes of one warp that interleave the j's (needs all 8 warps; 64 dependent steps of
// ~16 FMAs a lane). E and beta must be visible (barrier before); a barrier must follow.
__device__ __forceinline__ void InvertUnitLower(const float* E, const float* beta, float* T, int ld) {
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const int c = warp * 8 + (lane >> 2), part = lane & 3;
  for (int i = part; i < kChunk; i += 4) T[i * ld + c] = i == c ? 1.0f : 0.0f;
  __syncwarp();
  const int j0 = (c & ~3) + part;  // T[j][c] = 0 for j < c: those terms add nothing
#pragma unroll 1
  for (int i = 1; i < kChunk; ++i) {
    float s = 0.0f;
    for (int j = j0; j < i; j += 4) s += E[i * ld + j] * T[j * ld + c];
    s += __shfl_xor_sync(kFullMask, s, 1);
    s += __shfl_xor_sync(kFullMask, s, 2);
    if (part == 0 && i > c) T[i * ld + c] = -beta[i] * s;
    __syncwarp();
  }
}

// Shared-memory leading dimensions (elements). BF16 tiles: +8 (rows 16 bytes apart modulo 128, so
// the fragment loads of both orientations hit distinct banks). FP32 tiles read with the row index
// varying across a fragment's groups ("row access"): +4; with it varying across the lanes of a
// group ("column access", B operands [k][n] and transposed A operands): +8.
constexpr int LdBf(int cols) { return cols + 8; }
constexpr int LdRow(int cols) { return cols + 4; }
constexpr int LdCol(int cols) { return cols + 8; }
constexpr int Bytes16(int64_t b) { return static_cast<int>((b + 15) / 16 * 16); }

}  // namespace slidedp::kernels::gated_delta_internal
