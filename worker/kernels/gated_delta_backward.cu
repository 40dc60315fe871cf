// The gated delta rule's backward (gated_delta.h). After rerunning the forward's chunk map, WY
// preparation and state recurrence (gated_delta.cu), per chunk with dO, U and the entering state S_0:
//   dU_local = scale (M o Q K^T)^T dO                                      (local dU kernel)
//   backwards over a document's chunks, dH = dL/dS at the chunk's end (zero after the last):
//     dU = dU_local + diag(decay) K dH,
//     dH_prev = e^{gamma_last} dH + scale Q^T diag(e^gamma) dO - W^T dU    (state backward kernel)
//   dP = dO U^T;  dq = scale (diag(e^gamma) dO S_0^T + (M o dP) K);
//   dk = scale (M o dP)^T Q + diag(decay) U dH^T + ...;  dW = -dU S_0^T     (state gradient kernel)
//   through W = T diag(beta e^gamma) K and U~ = T diag(beta) V, T = (I + A)^-1:
//   dV = diag(beta) T^T dU;  dk += diag(beta e^gamma) T^T dW + D K + D^T K;
//   dA = -T^T (dU (beta V)^T + dW (beta e^gamma K)^T) T^T (strictly lower)   (WY gradient kernel)
// and dgamma from every place gamma enters, then dg = the in-chunk reverse cumulative sum of
// dgamma. What limits it: the state backward is sequential over a document's chunks like the
// forward recurrence; the two gradient kernels are TF32 MMA throughput (most products have an FP32
// operand on both sides: 3 MMAs each).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common/status/status_macros.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/gated_delta.h"
#include "worker/kernels/gated_delta_common.cuh"

namespace slidedp::kernels {
namespace gated_delta_internal {
namespace {

constexpr int kStateCols = 32;  // as the forward recurrence: dS columns per block
constexpr int kSlice = 64;      // dk columns per state-gradient block, dv columns per inner step

// ---------------------------------------------------------------- local dU

template <int DK>
struct LocalDuSmem {
  static constexpr int kLdQ = LdBf(DK), kLdO = LdBf(kSlice), kLdP = LdCol(kChunk);
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + Bytes16(kChunk * kLdQ * 2);
  static constexpr int kO = kK + Bytes16(kChunk * kLdQ * 2);
  static constexpr int kP = kO + Bytes16(kChunk * kLdO * 2);
  static constexpr int kG = kP + kChunk * kLdP * 4;
  static constexpr int kGamma = kG + kChunk * 4;
  static constexpr int kBytes = kGamma + kChunk * 4;
};

// One block per (chunk, value head, 64 columns of dv): dU_local = scale (M o Q K^T)^T dO.
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) LocalDuKernel(Problem p) {
  using L = LocalDuSmem<DK>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  if (static_cast<int>(blockIdx.x) >= *p.num_chunks) return;
  const ChunkInfo ci = p.chunks[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y), kh = h / p.group, col0 = static_cast<int>(blockIdx.z) * kSlice;
  bf16* sQ = reinterpret_cast<bf16*>(gdn_smem + L::kQ);
  bf16* sK = reinterpret_cast<bf16*>(gdn_smem + L::kK);
  bf16* sO = reinterpret_cast<bf16*>(gdn_smem + L::kO);
  float* sP = reinterpret_cast<float*>(gdn_smem + L::kP);
  float* sG = reinterpret_cast<float*>(gdn_smem + L::kG);
  float* sGam = reinterpret_cast<float*>(gdn_smem + L::kGamma);
  const int64_t row0 = ci.start, qk_ld = static_cast<int64_t>(p.nk) * DK, v_ld = static_cast<int64_t>(p.nv) * DV;
  LoadRowsAsync<kChunk, DK>(sQ, L::kLdQ, p.q + (row0 * p.nk + kh) * DK, qk_ld, ci.len);
  LoadRowsAsync<kChunk, DK>(sK, L::kLdQ, p.k + (row0 * p.nk + kh) * DK, qk_ld, ci.len);
  LoadRowsAsync<kChunk, kSlice>(sO, L::kLdO, p.d_o + (row0 * p.nv + h) * DV + col0, v_ld, ci.len);
  LoadScalarsAsync(sG, p.g + row0 * p.nv + h, p.nv, ci.len);
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();
  ChunkDecay(sG, ci.len, sGam, nullptr, nullptr);
  __syncthreads();
  using TP = Tiling<kChunk, kChunk, 2>;
  {
    float acc[TP::MI][TP::NI][4];
    ZeroAcc(acc);
    WarpGemm<Prec::kBf16, Prec::kBf16>(
        acc, TP::M0(), TP::N0(), DK, [&](int m, int k) { return Bf(sQ[m * L::kLdQ + k]); },
        [&](int k, int n) { return Bf(sK[n * L::kLdQ + k]); });
    const float scale = p.scale;
    ForEachAcc(acc, TP::M0(), TP::N0(), [&](int r, int c, float& v) {
      sP[r * L::kLdP + c] = c <= r ? scale * expf(sGam[r] - sGam[c]) * v : 0.0f;
    });
  }
  __syncthreads();
  float acc[TP::MI][TP::NI][4];
  ZeroAcc(acc);
  WarpGemm<Prec::kFp32, Prec::kBf16>(
      acc, TP::M0(), TP::N0(), kChunk, [&](int m, int k) { return sP[k * L::kLdP + m]; },
      [&](int k, int n) { return Bf(sO[k * L::kLdO + n]); });
  float* dst = p.du + (row0 * p.nv + h) * DV + col0;
  ForEachAccPair(acc, TP::M0(), TP::N0(), [&](int r, int c, float& v0, float& v1) {
    if (r < ci.len) *reinterpret_cast<float2*>(dst + r * v_ld + c) = make_float2(v0, v1);
  });
}

// ---------------------------------------------------------------- state backward

template <int DK>
struct StateBwdSmem {
  static constexpr int kLdK = LdBf(DK), kLdW = LdCol(DK), kLdO = LdBf(kStateCols), kLdU = LdCol(kStateCols),
                       kLdH = LdCol(kStateCols);
  // one stage: K, Q (BF16), W, dO, dU_local (then dU) and g of one chunk
  static constexpr int kK = 0;
  static constexpr int kQ = kK + Bytes16(kChunk * kLdK * 2);
  static constexpr int kW = kQ + Bytes16(kChunk * kLdK * 2);
  static constexpr int kO = kW + kChunk * kLdW * 4;
  static constexpr int kU = kO + Bytes16(kChunk * kLdO * 2);
  static constexpr int kG = kU + kChunk * kLdU * 4;
  static constexpr int kStage = kG + kChunk * 4;
  static constexpr int kH = 2 * kStage;
  static constexpr int kGamma = kH + DK * kLdH * 4;
  static constexpr int kDecay = kGamma + kChunk * 4;
  static constexpr int kEg = kDecay + kChunk * 4;
  static constexpr int kMisc = kEg + kChunk * 4;
  static constexpr int kBytes = kMisc + 16;
};

// One block per (document, value head, 32 columns of dS), the document's chunks in reverse with dH
// (dk x 32, FP32) in shared memory: store dH as dL/dS entering the next chunk, dU = dU_local +
// diag(decay) K dH (written over dU_local), dH = e^{gamma_last} dH + scale Q^T diag(e^gamma) dO -
// W^T dU. The previous chunk's operands load while this one computes.
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) StateBackwardKernel(Problem p) {
  using L = StateBwdSmem<DK>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  const DocChunks dc = p.docs[blockIdx.x];
  if (dc.count <= 1) return;
  const int h = static_cast<int>(blockIdx.y), kh = h / p.group, col0 = static_cast<int>(blockIdx.z) * kStateCols;
  float* sH = reinterpret_cast<float*>(gdn_smem + L::kH);
  float* sGam = reinterpret_cast<float*>(gdn_smem + L::kGamma);
  float* sDec = reinterpret_cast<float*>(gdn_smem + L::kDecay);
  float* sEg = reinterpret_cast<float*>(gdn_smem + L::kEg);
  float* sMisc = reinterpret_cast<float*>(gdn_smem + L::kMisc);
  const int64_t qk_ld = static_cast<int64_t>(p.nk) * DK, w_ld = static_cast<int64_t>(p.nv) * DK,
                v_ld = static_cast<int64_t>(p.nv) * DV;
  // step s handles chunk count - 1 - s from stage s & 1
  auto prefetch = [&](int s) {
    const int i = dc.count - 1 - s;
    const ChunkInfo ci = p.chunks[dc.first + i];
    unsigned char* st = gdn_smem + (s & 1) * L::kStage;
    const int64_t row0 = ci.start;
    LoadRowsAsync<kChunk, DK>(reinterpret_cast<bf16*>(st + L::kK), L::kLdK, p.k + (row0 * p.nk + kh) * DK, qk_ld, ci.len);
    if (i > 0) {
      LoadRowsAsync<kChunk, DK>(reinterpret_cast<bf16*>(st + L::kQ), L::kLdK, p.q + (row0 * p.nk + kh) * DK, qk_ld,
                                ci.len);
      LoadRowsAsync<kChunk, DK>(reinterpret_cast<float*>(st + L::kW), L::kLdW, p.w + (row0 * p.nv + h) * DK, w_ld, ci.len);
      LoadRowsAsync<kChunk, kStateCols>(reinterpret_cast<bf16*>(st + L::kO), L::kLdO,
                                        p.d_o + (row0 * p.nv + h) * DV + col0, v_ld, ci.len);
    }
    LoadRowsAsync<kChunk, kStateCols>(reinterpret_cast<float*>(st + L::kU), L::kLdU, p.du + (row0 * p.nv + h) * DV + col0,
                                      v_ld, ci.len);
    LoadScalarsAsync(reinterpret_cast<float*>(st + L::kG), p.g + row0 * p.nv + h, p.nv, ci.len);
    CpAsyncCommit();
  };
  prefetch(0);
  for (int idx = static_cast<int>(threadIdx.x); idx < DK * L::kLdH; idx += kThreads) sH[idx] = 0.0f;
#pragma unroll 1
  for (int s = 0; s < dc.count; ++s) {
    const int i = dc.count - 1 - s;
    const ChunkInfo ci = p.chunks[dc.first + i];
    if (i > 0) {
      prefetch(s + 1);
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    unsigned char* st = gdn_smem + (s & 1) * L::kStage;
    const bf16* sK = reinterpret_cast<const bf16*>(st + L::kK);
    const bf16* sQ = reinterpret_cast<const bf16*>(st + L::kQ);
    const float* sW = reinterpret_cast<const float*>(st + L::kW);
    const bf16* sO = reinterpret_cast<const bf16*>(st + L::kO);
    float* sU = reinterpret_cast<float*>(st + L::kU);
    ChunkDecay(reinterpret_cast<const float*>(st + L::kG), ci.len, sGam, sDec, sMisc, sEg);
    __syncthreads();
    if (s > 0) {  // dH is zero past the document's last chunk
      float* dst = p.dstates + (static_cast<int64_t>(ci.next_slot) * p.nv + h) * DK * DV + col0;
      for (int idx = static_cast<int>(threadIdx.x); idx < DK * kStateCols / 4; idx += kThreads) {
        const int r = idx / (kStateCols / 4), c = (idx % (kStateCols / 4)) * 4;
        *reinterpret_cast<float4*>(dst + r * DV + c) = *reinterpret_cast<const float4*>(sH + r * L::kLdH + c);
      }
      using TU = Tiling<kChunk, kStateCols, 4>;
      float acc[TU::MI][TU::NI][4];
      ZeroAcc(acc);
      WarpGemm<Prec::kBf16, Prec::kFp32>(
          acc, TU::M0(), TU::N0(), DK, [&](int m, int k) { return Bf(sK[m * L::kLdK + k]); },
          [&](int k, int n) { return sH[k * L::kLdH + n]; });
      float* dug = p.du + (static_cast<int64_t>(ci.start) * p.nv + h) * DV + col0;
      ForEachAccPair(acc, TU::M0(), TU::N0(), [&](int r, int c, float& v0, float& v1) {
        const float u0 = sU[r * L::kLdU + c] + sDec[r] * v0, u1 = sU[r * L::kLdU + c + 1] + sDec[r] * v1;
        sU[r * L::kLdU + c] = u0;
        sU[r * L::kLdU + c + 1] = u1;
        if (r < ci.len) *reinterpret_cast<float2*>(dug + r * v_ld + c) = make_float2(u0, u1);
      });
    }
    __syncthreads();
    if (i > 0) {
      using TS = Tiling<DK, kStateCols, 4>;
      float acc[TS::MI][TS::NI][4];
      const float el = sMisc[0], scale = p.scale;
      ForEachAcc(acc, TS::M0(), TS::N0(), [&](int r, int c, float& v) { v = el * sH[r * L::kLdH + c]; });
      WarpGemm<Prec::kBf16, Prec::kFp32>(
          acc, TS::M0(), TS::N0(), kChunk, [&](int m, int k) { return Bf(sQ[k * L::kLdK + m]); },
          [&](int k, int n) { return scale * sEg[k] * Bf(sO[k * L::kLdO + n]); });
      WarpGemm<Prec::kFp32, Prec::kFp32>(
          acc, TS::M0(), TS::N0(), kChunk, [&](int m, int k) { return -sW[k * L::kLdW + m]; },
          [&](int k, int n) { return sU[k * L::kLdU + n]; });
      ForEachAcc(acc, TS::M0(), TS::N0(), [&](int r, int c, float& v) { sH[r * L::kLdH + c] = v; });
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- state gradients

template <int DK>
struct StateGradSmem {
  static constexpr int kLdB = LdBf(kSlice), kLdF = LdRow(kSlice);
  static constexpr int kQs = 0;                                     // Q[:, slice] BF16
  static constexpr int kKs = kQs + Bytes16(kChunk * kLdB * 2);      // K[:, slice] BF16
  static constexpr int kO = kKs + Bytes16(kChunk * kLdB * 2);       // dO[:, dv slice] BF16
  static constexpr int kS0 = kO + Bytes16(kChunk * kLdB * 2);       // S_0[slice, dv slice]
  static constexpr int kDH = kS0 + kSlice * kLdF * 4;               // dH[slice, dv slice]
  static constexpr int kU = kDH + kSlice * kLdF * 4;                // U[:, dv slice]
  static constexpr int kDU = kU + kChunk * kLdF * 4;                // dU[:, dv slice]
  static constexpr int kDP = kDU + kChunk * kLdF * 4;               // scale M o dP
  static constexpr int kRowA = kDP + kChunk * kLdF * 4;             // [4][64] row partials: dO . (Q S_0)
  static constexpr int kRowG = kRowA + 4 * kChunk * 4;              // [4][64] row sums of G_P
  static constexpr int kColG = kRowG + 4 * kChunk * 4;              // [2][64] column sums of G_P
  static constexpr int kRowE = kColG + 2 * kChunk * 4;              // [4][64] row sums of K o (U dH^T)
  static constexpr int kG = kRowE + 4 * kChunk * 4;
  static constexpr int kGamma = kG + kChunk * 4;
  static constexpr int kDecay = kGamma + kChunk * 4;
  static constexpr int kEg = kDecay + kChunk * 4;
  static constexpr int kE = kEg + kChunk * 4;    // e_j = decay_j k_j . (U dH^T)_j (this slice)
  static constexpr int kDg = kE + kChunk * 4;    // dgamma (this slice, before the last row's sum)
  static constexpr int kSh = kDg + kChunk * 4;   // [8] per-warp <S_0, dH> parts
  static constexpr int kMisc = kSh + kWarps * 4;
  static constexpr int kBytes = kMisc + 16;
};

// One block per (chunk, key head, 64 columns of dk); the value heads of the key head in order,
// each over dv in slices of 64:
//   dP = dO U^T, X1 = dO S_0^T, X3 = dU S_0^T, X4 = U dH^T (this dk slice), and the row sums
//   dO . (Q S_0);  then dq += scale (diag(e^gamma) X1 + (M o dP) K), dk += scale (M o dP)^T Q +
//   diag(decay) X4, dW = -X3, and this slice's part of dgamma:
//   scale e^gamma_i dO_i . (Q S_0)_i + rowsum - colsum of (scale M o dP o Q K^T)
//   - e_i (+ sum_j e_j + e^{gamma_last} <S_0, dH> at the last row), e_j = decay_j k_j . X4_j.
// dq and dk (the sum over the value heads) are written, not accumulated; the WY kernel adds to dk.
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads, 1) StateGradKernel(Problem p) {
  using L = StateGradSmem<DK>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  if (static_cast<int>(blockIdx.x) >= *p.num_chunks) return;
  const ChunkInfo ci = p.chunks[blockIdx.x];
  const int kh = static_cast<int>(blockIdx.y), s0 = static_cast<int>(blockIdx.z) * kSlice;
  bf16* sQs = reinterpret_cast<bf16*>(gdn_smem + L::kQs);
  bf16* sKs = reinterpret_cast<bf16*>(gdn_smem + L::kKs);
  bf16* sO = reinterpret_cast<bf16*>(gdn_smem + L::kO);
  float* sS0 = reinterpret_cast<float*>(gdn_smem + L::kS0);
  float* sDH = reinterpret_cast<float*>(gdn_smem + L::kDH);
  float* sU = reinterpret_cast<float*>(gdn_smem + L::kU);
  float* sDU = reinterpret_cast<float*>(gdn_smem + L::kDU);
  float* sDP = reinterpret_cast<float*>(gdn_smem + L::kDP);
  float* sRowA = reinterpret_cast<float*>(gdn_smem + L::kRowA);
  float* sRowG = reinterpret_cast<float*>(gdn_smem + L::kRowG);
  float* sColG = reinterpret_cast<float*>(gdn_smem + L::kColG);
  float* sRowE = reinterpret_cast<float*>(gdn_smem + L::kRowE);
  float* sG = reinterpret_cast<float*>(gdn_smem + L::kG);
  float* sGam = reinterpret_cast<float*>(gdn_smem + L::kGamma);
  float* sDec = reinterpret_cast<float*>(gdn_smem + L::kDecay);
  float* sEg = reinterpret_cast<float*>(gdn_smem + L::kEg);
  float* sE = reinterpret_cast<float*>(gdn_smem + L::kE);
  float* sDg = reinterpret_cast<float*>(gdn_smem + L::kDg);
  float* sSh = reinterpret_cast<float*>(gdn_smem + L::kSh);
  float* sMisc = reinterpret_cast<float*>(gdn_smem + L::kMisc);
  constexpr int kLdB = L::kLdB, kLdF = L::kLdF;
  const int64_t row0 = ci.start, qk_ld = static_cast<int64_t>(p.nk) * DK, v_ld = static_cast<int64_t>(p.nv) * DV;
  const int tid = static_cast<int>(threadIdx.x), lane = tid & 31, warp = tid >> 5;
  const bool has_s0 = ci.slot >= 0, has_dh = ci.next_slot >= 0;
  LoadRowsAsync<kChunk, kSlice>(sQs, kLdB, p.q + (row0 * p.nk + kh) * DK + s0, qk_ld, ci.len);
  LoadRowsAsync<kChunk, kSlice>(sKs, kLdB, p.k + (row0 * p.nk + kh) * DK + s0, qk_ld, ci.len);
  CpAsyncCommit();

  using TP = Tiling<kChunk, kSlice, 2>;  // every product here is 64 x 64
  const int m0 = TP::M0(), n0 = TP::N0();
  float dq_tot[TP::MI][TP::NI][4], dk_tot[TP::MI][TP::NI][4];
  ZeroAcc(dq_tot);
  ZeroAcc(dk_tot);
#pragma unroll 1
  for (int hh = 0; hh < p.group; ++hh) {
    const int h = kh * p.group + hh;
    __syncthreads();  // the previous head's readers are done
    LoadScalarsAsync(sG, p.g + row0 * p.nv + h, p.nv, ci.len);
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
    ChunkDecay(sG, ci.len, sGam, sDec, sMisc, sEg);
    __syncthreads();
    float dP[TP::MI][TP::NI][4], x1[TP::MI][TP::NI][4], x3[TP::MI][TP::NI][4], x4[TP::MI][TP::NI][4];
    float row_a[TP::MI][2] = {};
    ZeroAcc(dP);
    ZeroAcc(x1);
    ZeroAcc(x3);
    ZeroAcc(x4);
    float sh = 0.0f;
#pragma unroll 1
    for (int v0 = 0; v0 < DV; v0 += kSlice) {
      if (v0 > 0) __syncthreads();  // the previous dv slice's readers are done
      const int64_t vrow = (row0 * p.nv + h) * DV + v0;
      LoadRowsAsync<kChunk, kSlice>(sU, kLdF, p.u + vrow, v_ld, ci.len);
      LoadRowsAsync<kChunk, kSlice>(sDU, kLdF, p.du + vrow, v_ld, ci.len);
      LoadRowsAsync<kChunk, kSlice>(sO, kLdB, p.d_o + vrow, v_ld, ci.len);
      if (has_s0) {
        LoadRowsAsync<kSlice, kSlice>(sS0, kLdF, p.states + ((static_cast<int64_t>(ci.slot) * p.nv + h) * DK + s0) * DV + v0,
                                      DV, kSlice);
      }
      if (has_dh) {
        LoadRowsAsync<kSlice, kSlice>(
            sDH, kLdF, p.dstates + ((static_cast<int64_t>(ci.next_slot) * p.nv + h) * DK + s0) * DV + v0, DV, kSlice);
      }
      CpAsyncCommit();
      CpAsyncWait<0>();
      __syncthreads();
      WarpGemm<Prec::kBf16, Prec::kFp32>(
          dP, m0, n0, kSlice, [&](int m, int k) { return Bf(sO[m * kLdB + k]); },
          [&](int k, int n) { return sU[n * kLdF + k]; });
      if (has_s0) {
        WarpGemm<Prec::kBf16, Prec::kFp32>(
            x1, m0, n0, kSlice, [&](int m, int k) { return Bf(sO[m * kLdB + k]); },
            [&](int k, int n) { return sS0[n * kLdF + k]; });
        WarpGemm<Prec::kFp32, Prec::kFp32>(
            x3, m0, n0, kSlice, [&](int m, int k) { return sDU[m * kLdF + k]; },
            [&](int k, int n) { return sS0[n * kLdF + k]; });
        float x2[TP::MI][TP::NI][4];
        ZeroAcc(x2);
        WarpGemm<Prec::kBf16, Prec::kFp32>(
            x2, m0, n0, kSlice, [&](int m, int k) { return Bf(sQs[m * kLdB + k]); },
            [&](int k, int n) { return sS0[k * kLdF + n]; });
#pragma unroll
        for (int mi = 0; mi < TP::MI; ++mi)
#pragma unroll
          for (int ni = 0; ni < TP::NI; ++ni)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int r = m0 + 16 * mi + (lane >> 2) + (e >> 1) * 8, c = n0 + 8 * ni + 2 * (lane & 3) + (e & 1);
              row_a[mi][e >> 1] += Bf(sO[r * kLdB + c]) * x2[mi][ni][e];
            }
        if (has_dh) {
          for (int idx = tid; idx < kSlice * kSlice; idx += kThreads) {
            const int a = idx / kSlice, c = idx % kSlice;
            sh += sS0[a * kLdF + c] * sDH[a * kLdF + c];
          }
        }
      }
      if (has_dh) {
        WarpGemm<Prec::kFp32, Prec::kFp32>(
            x4, m0, n0, kSlice, [&](int m, int k) { return sU[m * kLdF + k]; },
            [&](int k, int n) { return sDH[n * kLdF + k]; });
      }
    }
    // row sums of dO . (Q S_0): finish the lanes' sums as RowPartials does
#pragma unroll
    for (int mi = 0; mi < TP::MI; ++mi) {
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        float v = row_a[mi][hf];
        v += __shfl_xor_sync(kFullMask, v, 1);
        v += __shfl_xor_sync(kFullMask, v, 2);
        if ((lane & 3) == 0) sRowA[TP::WarpN() * kChunk + m0 + 16 * mi + (lane >> 2) + 8 * hf] = v;
      }
    }
    sh += __shfl_xor_sync(kFullMask, sh, 16);
    sh += __shfl_xor_sync(kFullMask, sh, 8);
    sh += __shfl_xor_sync(kFullMask, sh, 4);
    sh += __shfl_xor_sync(kFullMask, sh, 2);
    sh += __shfl_xor_sync(kFullMask, sh, 1);
    if (lane == 0) sSh[warp] = sh;
    // G_P = (scale M o dP) o (Q K^T restricted to this slice), and scale M o dP for the products
    {
      float qk[TP::MI][TP::NI][4];
      ZeroAcc(qk);
      WarpGemm<Prec::kBf16, Prec::kBf16>(
          qk, m0, n0, kSlice, [&](int m, int k) { return Bf(sQs[m * kLdB + k]); },
          [&](int k, int n) { return Bf(sKs[n * kLdB + k]); });
      const float scale = p.scale;
#pragma unroll
      for (int mi = 0; mi < TP::MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < TP::NI; ++ni)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = m0 + 16 * mi + (lane >> 2) + (e >> 1) * 8, c = n0 + 8 * ni + 2 * (lane & 3) + (e & 1);
            const float dpm = c <= r ? scale * expf(sGam[r] - sGam[c]) * dP[mi][ni][e] : 0.0f;
            sDP[r * kLdF + c] = dpm;
            qk[mi][ni][e] *= dpm;
          }
      RowPartials<TP>(qk, sRowG, [](int, int, float v) { return v; });
      ColPartials<TP>(qk, sColG, [](int, int, float v) { return v; });
    }
    RowPartials<TP>(x4, sRowE, [&](int r, int c, float v) { return Bf(sKs[r * kLdB + c]) * v; });
    __syncthreads();
    if (tid < kChunk) {
      float a = 0, gr = 0, gc = 0, e = 0;
      for (int w = 0; w < TP::kWarpsN; ++w) {
        a += sRowA[w * kChunk + tid];
        gr += sRowG[w * kChunk + tid];
        e += sRowE[w * kChunk + tid];
      }
      for (int w = 0; w < TP::kWarpsM; ++w) gc += sColG[w * kChunk + tid];
      e *= sDec[tid];
      sE[tid] = e;
      sDg[tid] = p.scale * sEg[tid] * a + gr - gc - e;
    }
    __syncthreads();
    if (tid < ci.len) {
      float d = sDg[tid];
      if (tid == ci.len - 1) {
        float esum = 0, shs = 0;
        for (int j = 0; j < kChunk; ++j) esum += sE[j];
        for (int w = 0; w < kWarps; ++w) shs += sSh[w];
        d += esum + sMisc[0] * shs;
      }
      p.dgamma[(static_cast<int64_t>(blockIdx.z) * p.tokens + row0 + tid) * p.nv + h] = d;
    }
    // dq, dk (this head's part), dW
    const float scale = p.scale;
    ForEachAcc(x1, m0, n0, [&](int r, int, float& v) { v *= scale * sEg[r]; });
    ForEachAcc(x4, m0, n0, [&](int r, int, float& v) { v *= sDec[r]; });
#pragma unroll
    for (int mi = 0; mi < TP::MI; ++mi)
#pragma unroll
      for (int ni = 0; ni < TP::NI; ++ni)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          dq_tot[mi][ni][e] += x1[mi][ni][e];
          dk_tot[mi][ni][e] += x4[mi][ni][e];
        }
    WarpGemm<Prec::kFp32, Prec::kBf16>(
        dq_tot, m0, n0, kChunk, [&](int m, int k) { return sDP[m * kLdF + k]; },
        [&](int k, int n) { return Bf(sKs[k * kLdB + n]); });
    WarpGemm<Prec::kFp32, Prec::kBf16>(
        dk_tot, m0, n0, kChunk, [&](int m, int k) { return sDP[k * kLdF + m]; },
        [&](int k, int n) { return Bf(sQs[k * kLdB + n]); });
    float* dw = p.w + (row0 * p.nv + h) * DK + s0;
    ForEachAccPair(x3, m0, n0, [&](int r, int c, float& v0, float& v1) {
      if (r < ci.len) *reinterpret_cast<float2*>(dw + r * static_cast<int64_t>(p.nv) * DK + c) = make_float2(-v0, -v1);
    });
  }
  float* dq = p.dq + (row0 * p.nk + kh) * DK + s0;
  float* dk = p.dk + (row0 * p.nk + kh) * DK + s0;
  ForEachAccPair(dq_tot, m0, n0, [&](int r, int c, float& v0, float& v1) {
    if (r < ci.len) *reinterpret_cast<float2*>(dq + r * qk_ld + c) = make_float2(v0, v1);
  });
  ForEachAccPair(dk_tot, m0, n0, [&](int r, int c, float& v0, float& v1) {
    if (r < ci.len) *reinterpret_cast<float2*>(dk + r * qk_ld + c) = make_float2(v0, v1);
  });
}

// ---------------------------------------------------------------- WY gradients

template <int DK, int DV>
struct WyGradSmem {
  static constexpr int kLdK = LdBf(DK), kLdV = LdBf(DV), kLdX = LdRow(DK > DV ? DK : DV), kLd = LdRow(kChunk);
  static constexpr int kK = 0;
  static constexpr int kV = kK + Bytes16(kChunk * kLdK * 2);
  static constexpr int kX = kV + Bytes16(kChunk * kLdV * 2);  // dU, then dW
  static constexpr int kE = kX + kChunk * kLdX * 4;           // E (decayed K K^T, strictly lower)
  static constexpr int kT = kE + kChunk * kLd * 4;            // T = (I + diag(beta) E)^-1
  static constexpr int kM1 = kT + kChunk * kLd * 4;           // dT, then D
  static constexpr int kM2 = kM1 + kChunk * kLd * 4;          // T^T dT
  static constexpr int kRowV = kM2 + kChunk * kLd * 4;        // [4][64] row sums of dB_v o V
  static constexpr int kRowK = kRowV + 4 * kChunk * 4;        // [4][64] row sums of dB_k o K
  static constexpr int kRowA = kRowK + 4 * kChunk * 4;        // [4][64] row sums of dA o beta E
  static constexpr int kColA = kRowA + 4 * kChunk * 4;        // [2][64] column sums of dA o beta E
  static constexpr int kRowB = kColA + 2 * kChunk * 4;        // [4][64] row sums of dA o E
  static constexpr int kG = kRowB + 4 * kChunk * 4;
  static constexpr int kGamma = kG + kChunk * 4;
  static constexpr int kEg = kGamma + kChunk * 4;
  static constexpr int kBeta = kEg + kChunk * 4;
  static constexpr int kDgam = kBeta + kChunk * 4;
  static constexpr int kDg = kDgam + kChunk * 4;
  static constexpr int kBytes = kDg + kChunk * 4;
};

// One block per (chunk, key head); the value heads of the key head in order: recompute E and T,
// then dB_v = T^T dU (dv = beta dB_v), dB_k = T^T dW (dk += beta e^gamma dB_k),
// dT = dU (beta V)^T + dW (beta e^gamma K)^T, dA = -(T^T dT) T^T (strictly lower),
// D = dA o beta e^{gamma_i - gamma_j} (dk += D K + D^T K); dbeta and dgamma from the row and
// column sums, plus the state-gradient kernel's dgamma parts; dg = reverse cumsum of dgamma.
// dk (the value heads' sum) is added to what the state-gradient kernel wrote.
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads, 1) WyGradKernel(Problem p) {
  using L = WyGradSmem<DK, DV>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  if (static_cast<int>(blockIdx.x) >= *p.num_chunks) return;
  const ChunkInfo ci = p.chunks[blockIdx.x];
  const int kh = static_cast<int>(blockIdx.y);
  bf16* sK = reinterpret_cast<bf16*>(gdn_smem + L::kK);
  bf16* sV = reinterpret_cast<bf16*>(gdn_smem + L::kV);
  float* sX = reinterpret_cast<float*>(gdn_smem + L::kX);
  float* sE = reinterpret_cast<float*>(gdn_smem + L::kE);
  float* sT = reinterpret_cast<float*>(gdn_smem + L::kT);
  float* sM1 = reinterpret_cast<float*>(gdn_smem + L::kM1);
  float* sM2 = reinterpret_cast<float*>(gdn_smem + L::kM2);
  float* sRowV = reinterpret_cast<float*>(gdn_smem + L::kRowV);
  float* sRowK = reinterpret_cast<float*>(gdn_smem + L::kRowK);
  float* sRowA = reinterpret_cast<float*>(gdn_smem + L::kRowA);
  float* sColA = reinterpret_cast<float*>(gdn_smem + L::kColA);
  float* sRowB = reinterpret_cast<float*>(gdn_smem + L::kRowB);
  float* sG = reinterpret_cast<float*>(gdn_smem + L::kG);
  float* sGam = reinterpret_cast<float*>(gdn_smem + L::kGamma);
  float* sEg = reinterpret_cast<float*>(gdn_smem + L::kEg);
  float* sBeta = reinterpret_cast<float*>(gdn_smem + L::kBeta);
  float* sDgam = reinterpret_cast<float*>(gdn_smem + L::kDgam);
  float* sDg = reinterpret_cast<float*>(gdn_smem + L::kDg);
  constexpr int kLdK = L::kLdK, kLdV = L::kLdV, kLdX = L::kLdX, kLd = L::kLd;
  const int64_t row0 = ci.start, qk_ld = static_cast<int64_t>(p.nk) * DK, v_ld = static_cast<int64_t>(p.nv) * DV,
                w_ld = static_cast<int64_t>(p.nv) * DK;
  const int tid = static_cast<int>(threadIdx.x);
  LoadRowsAsync<kChunk, DK>(sK, kLdK, p.k + (row0 * p.nk + kh) * DK, qk_ld, ci.len);
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();

  using T64 = Tiling<kChunk, kChunk, 2>;
  using TK = Tiling<kChunk, DK, 2>;
  using TV = Tiling<kChunk, DV, 2>;
  // K K^T, shared by the value heads (each decays it differently)
  float kk[T64::MI][T64::NI][4];
  ZeroAcc(kk);
  WarpGemm<Prec::kBf16, Prec::kBf16>(
      kk, T64::M0(), T64::N0(), DK, [&](int m, int k) { return Bf(sK[m * kLdK + k]); },
      [&](int k, int n) { return Bf(sK[n * kLdK + k]); });
  float dk_tot[TK::MI][TK::NI][4];
  ZeroAcc(dk_tot);
#pragma unroll 1
  for (int hh = 0; hh < p.group; ++hh) {
    const int h = kh * p.group + hh;
    __syncthreads();  // the previous head's readers are done
    LoadScalarsAsync(sG, p.g + row0 * p.nv + h, p.nv, ci.len);
    LoadScalarsAsync(sBeta, p.beta + row0 * p.nv + h, p.nv, ci.len);
    LoadRowsAsync<kChunk, DV>(sX, kLdX, p.du + (row0 * p.nv + h) * DV, v_ld, ci.len);
    LoadRowsAsync<kChunk, DV>(sV, kLdV, p.v + (row0 * p.nv + h) * DV, v_ld, ci.len);
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
    ChunkDecay(sG, ci.len, sGam, nullptr, nullptr, sEg);
    __syncthreads();
    {
      float e[T64::MI][T64::NI][4];
#pragma unroll
      for (int mi = 0; mi < T64::MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < T64::NI; ++ni)
#pragma unroll
          for (int x = 0; x < 4; ++x) e[mi][ni][x] = kk[mi][ni][x];
      ForEachAcc(e, T64::M0(), T64::N0(), [&](int r, int c, float& v) {
        sE[r * kLd + c] = c < r ? expf(sGam[r] - sGam[c]) * v : 0.0f;
      });
    }
    __syncthreads();
    InvertUnitLower(sE, sBeta, sT, kLd);
    __syncthreads();
    // dB_v = T^T dU: dv = beta dB_v, row sums of dB_v o V (dbeta)
    {
      float acc[TV::MI][TV::NI][4];
      ZeroAcc(acc);
      WarpGemm<Prec::kFp32, Prec::kFp32>(
          acc, TV::M0(), TV::N0(), kChunk, [&](int m, int k) { return sT[k * kLd + m]; },
          [&](int k, int n) { return sX[k * kLdX + n]; });
      RowPartials<TV>(acc, sRowV, [&](int r, int c, float v) { return v * Bf(sV[r * kLdV + c]); });
      float* dst = p.dv + (row0 * p.nv + h) * DV;
      ForEachAccPair(acc, TV::M0(), TV::N0(), [&](int r, int c, float& v0, float& v1) {
        if (r < ci.len) *reinterpret_cast<float2*>(dst + r * v_ld + c) = make_float2(sBeta[r] * v0, sBeta[r] * v1);
      });
    }
    // dT, first half: dU V^T (columns scaled by beta below)
    float dta[T64::MI][T64::NI][4];
    ZeroAcc(dta);
    WarpGemm<Prec::kFp32, Prec::kBf16>(
        dta, T64::M0(), T64::N0(), DV, [&](int m, int k) { return sX[m * kLdX + k]; },
        [&](int k, int n) { return Bf(sV[n * kLdV + k]); });
    __syncthreads();  // dU's readers are done: dW goes into the same buffer
    LoadRowsAsync<kChunk, DK>(sX, kLdX, p.w + (row0 * p.nv + h) * DK, w_ld, ci.len);
    CpAsyncCommit();
    CpAsyncWait<0>();
    __syncthreads();
    // dB_k = T^T dW: dk += beta e^gamma dB_k, row sums of dB_k o K (dbeta, dgamma)
    {
      float acc[TK::MI][TK::NI][4];
      ZeroAcc(acc);
      WarpGemm<Prec::kFp32, Prec::kFp32>(
          acc, TK::M0(), TK::N0(), kChunk, [&](int m, int k) { return sT[k * kLd + m]; },
          [&](int k, int n) { return sX[k * kLdX + n]; });
      RowPartials<TK>(acc, sRowK, [&](int r, int c, float v) { return v * Bf(sK[r * kLdK + c]); });
      ForEachAcc(acc, TK::M0(), TK::N0(), [&](int r, int, float& v) { v *= sBeta[r] * sEg[r]; });
#pragma unroll
      for (int mi = 0; mi < TK::MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < TK::NI; ++ni)
#pragma unroll
          for (int x = 0; x < 4; ++x) dk_tot[mi][ni][x] += acc[mi][ni][x];
    }
    // dT = beta_j (dU V^T + e^{gamma_j} dW K^T)_ij
    {
      float dtb[T64::MI][T64::NI][4];
      ZeroAcc(dtb);
      WarpGemm<Prec::kFp32, Prec::kBf16>(
          dtb, T64::M0(), T64::N0(), DK, [&](int m, int k) { return sX[m * kLdX + k]; },
          [&](int k, int n) { return Bf(sK[n * kLdK + k]); });
      const int lane = tid & 31;
#pragma unroll
      for (int mi = 0; mi < T64::MI; ++mi)
#pragma unroll
        for (int ni = 0; ni < T64::NI; ++ni)
#pragma unroll
          for (int x = 0; x < 4; ++x) {
            const int r = T64::M0() + 16 * mi + (lane >> 2) + (x >> 1) * 8;
            const int c = T64::N0() + 8 * ni + 2 * (lane & 3) + (x & 1);
            sM1[r * kLd + c] = sBeta[c] * (dta[mi][ni][x] + sEg[c] * dtb[mi][ni][x]);
          }
    }
    __syncthreads();
    // T^T dT
    {
      float acc[T64::MI][T64::NI][4];
      ZeroAcc(acc);
      WarpGemm<Prec::kFp32, Prec::kFp32>(
          acc, T64::M0(), T64::N0(), kChunk, [&](int m, int k) { return sT[k * kLd + m]; },
          [&](int k, int n) { return sM1[k * kLd + n]; });
      ForEachAcc(acc, T64::M0(), T64::N0(), [&](int r, int c, float& v) { sM2[r * kLd + c] = v; });
    }
    __syncthreads();
    // dA = -(T^T dT) T^T, strictly lower; its sums, and D = dA o beta_i e^{gamma_i - gamma_j} into sM1
    {
      float acc[T64::MI][T64::NI][4];
      ZeroAcc(acc);
      WarpGemm<Prec::kFp32, Prec::kFp32>(
          acc, T64::M0(), T64::N0(), kChunk, [&](int m, int k) { return sM2[m * kLd + k]; },
          [&](int k, int n) { return sT[n * kLd + k]; });
      ForEachAcc(acc, T64::M0(), T64::N0(), [&](int r, int c, float& v) { v = c < r ? -v : 0.0f; });
      RowPartials<T64>(acc, sRowA, [&](int r, int c, float v) { return v * sBeta[r] * sE[r * kLd + c]; });
      ColPartials<T64>(acc, sColA, [&](int r, int c, float v) { return v * sBeta[r] * sE[r * kLd + c]; });
      RowPartials<T64>(acc, sRowB, [&](int r, int c, float v) { return v * sE[r * kLd + c]; });
      ForEachAcc(acc, T64::M0(), T64::N0(), [&](int r, int c, float& v) {
        sM1[r * kLd + c] = c < r ? v * sBeta[r] * expf(sGam[r] - sGam[c]) : 0.0f;
      });
    }
    __syncthreads();
    // dk += D K + D^T K
    WarpGemm<Prec::kFp32, Prec::kBf16>(
        dk_tot, TK::M0(), TK::N0(), kChunk, [&](int m, int k) { return sM1[m * kLd + k]; },
        [&](int k, int n) { return Bf(sK[k * kLdK + n]); });
    WarpGemm<Prec::kFp32, Prec::kBf16>(
        dk_tot, TK::M0(), TK::N0(), kChunk, [&](int m, int k) { return sM1[k * kLd + m]; },
        [&](int k, int n) { return Bf(sK[k * kLdK + n]); });
    // per token: dbeta, dgamma (with the state-gradient kernel's parts), then dg
    if (tid < kChunk) {
      float rv = 0, rk = 0, ra = 0, rb = 0, ca = 0;
      for (int w = 0; w < TV::kWarpsN; ++w) rv += sRowV[w * kChunk + tid];
      for (int w = 0; w < TK::kWarpsN; ++w) rk += sRowK[w * kChunk + tid];
      for (int w = 0; w < T64::kWarpsN; ++w) {
        ra += sRowA[w * kChunk + tid];
        rb += sRowB[w * kChunk + tid];
      }
      for (int w = 0; w < T64::kWarpsM; ++w) ca += sColA[w * kChunk + tid];
      float dgam = 0.0f;
      if (tid < ci.len) {
        const int64_t t = row0 + tid;
        p.dbeta[t * p.nv + h] = rv + sEg[tid] * rk + rb;
        dgam = sBeta[tid] * sEg[tid] * rk + ra - ca;
        for (int s = 0; s < DK / kSlice; ++s) dgam += p.dgamma[(s * p.tokens + t) * p.nv + h];
      }
      sDgam[tid] = dgam;
    }
    __syncthreads();
    ChunkSuffixSum(sDgam, sDg);
    __syncthreads();
    if (tid < ci.len) p.dg[(row0 + tid) * p.nv + h] = sDg[tid];
  }
  float* dk = p.dk + (row0 * p.nk + kh) * DK;
  ForEachAccPair(dk_tot, TK::M0(), TK::N0(), [&](int r, int c, float& v0, float& v1) {
    if (r < ci.len) {
      float2* d = reinterpret_cast<float2*>(dk + r * qk_ld + c);
      const float2 old = *d;
      *d = make_float2(old.x + v0, old.y + v1);
    }
  });
}

// ---------------------------------------------------------------- launch

template <typename Kernel>
absl::Status LaunchWithSmem(Kernel kernel, dim3 grid, int smem, cudaStream_t stream, const Problem& p) {
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(p);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <int DK, int DV>
absl::Status LaunchBackward(const GatedDeltaArgs& a, const WorkspaceLayout& l, const Problem& p, cudaStream_t stream) {
  const unsigned chunks = static_cast<unsigned>(l.max_chunks), nv = static_cast<unsigned>(a.num_v_heads),
                 nk = static_cast<unsigned>(a.num_k_heads), docs = static_cast<unsigned>(a.num_docs);
  RETURN_IF_ERROR(LaunchWithSmem(LocalDuKernel<DK, DV>, dim3(chunks, nv, DV / kSlice), LocalDuSmem<DK>::kBytes, stream, p));
  RETURN_IF_ERROR(LaunchWithSmem(StateBackwardKernel<DK, DV>, dim3(docs, nv, DV / kStateCols), StateBwdSmem<DK>::kBytes,
                                 stream, p));
  RETURN_IF_ERROR(
      LaunchWithSmem(StateGradKernel<DK, DV>, dim3(chunks, nk, DK / kSlice), StateGradSmem<DK>::kBytes, stream, p));
  return LaunchWithSmem(WyGradKernel<DK, DV>, dim3(chunks, nk), WyGradSmem<DK, DV>::kBytes, stream, p);
}

bool Aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace
}  // namespace gated_delta_internal

namespace gdi = gated_delta_internal;

int64_t GatedDeltaBackwardWorkspaceBytes(const GatedDeltaArgs& args) {
  if (!gdi::CheckSizes(args).ok()) return 0;
  return gdi::MakeLayout(args, /*backward=*/true).bytes;
}

absl::Status GatedDeltaBackward(const GatedDeltaArgs& a, const bf16* q, const bf16* k, const bf16* v, const float* g,
                                const float* beta, const bf16* d_o, float* dq, float* dk, float* dv, float* dg,
                                float* dbeta, void* workspace, cudaStream_t stream) {
  RETURN_IF_ERROR(gdi::CheckArgs(a));
  if (a.tokens == 0) return absl::OkStatus();
  for (const void* ptr : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
                          static_cast<const void*>(g), static_cast<const void*>(beta), static_cast<const void*>(d_o),
                          static_cast<const void*>(dq), static_cast<const void*>(dk), static_cast<const void*>(dv),
                          static_cast<const void*>(dg), static_cast<const void*>(dbeta)}) {
    if (ptr == nullptr || !gdi::Aligned(ptr, 16)) {
      return absl::InvalidArgumentError("gated delta backward: a tensor pointer is null or not 16-byte aligned");
    }
  }
  if (workspace == nullptr || !gdi::Aligned(workspace, 256)) {
    return absl::InvalidArgumentError("gated delta backward: workspace is null or not 256-byte aligned");
  }
  const gdi::WorkspaceLayout l = gdi::MakeLayout(a, /*backward=*/true);
  gdi::Problem p = gdi::MakeProblem(a, l, workspace, q, k, v, g, beta);
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  p.d_o = d_o;
  p.du = reinterpret_cast<float*>(ws + l.du);
  p.dstates = reinterpret_cast<float*>(ws + l.dstates);
  p.dgamma = reinterpret_cast<float*>(ws + l.dgamma);
  p.dq = dq;
  p.dk = dk;
  p.dv = dv;
  p.dg = dg;
  p.dbeta = dbeta;
  RETURN_IF_ERROR(gdi::LaunchChunkMapPrepStates(a, l, p, workspace, stream));
  if (a.k_dim == 128 && a.v_dim == 128) return gdi::LaunchBackward<128, 128>(a, l, p, stream);
  if (a.k_dim == 128 && a.v_dim == 64) return gdi::LaunchBackward<128, 64>(a, l, p, stream);
  if (a.k_dim == 64 && a.v_dim == 128) return gdi::LaunchBackward<64, 128>(a, l, p, stream);
  return gdi::LaunchBackward<64, 64>(a, l, p, stream);
}

}  // namespace slidedp::kernels
