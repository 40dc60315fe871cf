// The gated delta rule's forward (gated_delta.h): the chunk map, the chunk-local WY preparation,
// the state recurrence over chunks and the output; the first three are rerun by the backward
// (gated_delta_backward.cu). What limits it: the recurrence is sequential over a document's chunks
// (one block per (document, value head, 32 state columns) walks them, so a long single document
// has nv * dv / 32 blocks in flight); the chunk-parallel kernels are TF32 MMA throughput with
// fragment loads from shared memory. Measured: see docs/kernels.md, "Gated delta rule".
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/gated_delta.h"
#include "worker/kernels/gated_delta_common.cuh"

namespace slidedp::kernels {
namespace gated_delta_internal {
namespace {

// ---------------------------------------------------------------- chunk map

constexpr int kMapThreads = 1024;

// One block: chunk counts per document, a block-wide scan, then each thread writes its documents'
// chunks. cu_seqlens values are clamped into [0, T] and non-decreasing, and chunks or slots beyond
// the workspace's bounds are dropped, so invalid cu_seqlens give wrong results, never stray writes.
__global__ void __launch_bounds__(kMapThreads)
    ChunkMapKernel(const int32_t* cu, int num_docs, long long tokens, long long max_chunks, long long max_slots,
                   ChunkInfo* chunks, DocChunks* docs, int* num_chunks) {
  __shared__ long long scan[kMapThreads];
  const int tid = static_cast<int>(threadIdx.x);
  const int per = (num_docs + kMapThreads - 1) / kMapThreads;
  const int d0 = min(num_docs, tid * per), d1 = min(num_docs, d0 + per);
  auto doc_bounds = [&](int d, long long& b, long long& e) {
    b = min(max(static_cast<long long>(cu[d]), 0LL), tokens);
    e = min(max(static_cast<long long>(cu[d + 1]), b), tokens);
  };
  long long local = 0;
  for (int d = d0; d < d1; ++d) {
    long long b, e;
    doc_bounds(d, b, e);
    local += (e - b + kChunk - 1) / kChunk;
  }
  scan[tid] = local;
  __syncthreads();
  for (int o = 1; o < kMapThreads; o <<= 1) {
    const long long v = tid >= o ? scan[tid - o] : 0;
    __syncthreads();
    scan[tid] += v;
    __syncthreads();
  }
  long long c = scan[tid] - local;
  for (int d = d0; d < d1; ++d) {
    long long b, e;
    doc_bounds(d, b, e);
    const long long n = (e - b + kChunk - 1) / kChunk;
    DocChunks dc{static_cast<int>(min(c, max_chunks)), 0};
    for (long long i = 0; i < n; ++i, ++c) {
      if (c >= max_chunks) continue;
      const long long slot = c - d - 1, next = c - d;
      ChunkInfo ci;
      ci.start = static_cast<int>(b + i * kChunk);
      ci.len = static_cast<int>(min(static_cast<long long>(kChunk), e - b - i * kChunk));
      ci.slot = i > 0 && slot < max_slots ? static_cast<int>(slot) : -1;
      ci.next_slot = i + 1 < n && next < max_slots ? static_cast<int>(next) : -1;
      chunks[c] = ci;
      ++dc.count;
    }
    docs[d] = dc;
  }
  if (tid == kMapThreads - 1) *num_chunks = static_cast<int>(min(scan[tid], max_chunks));
}

// ---------------------------------------------------------------- prep: W and U~ per chunk

template <int DK, int DV>
struct PrepSmem {
  static constexpr int kLdK = LdBf(DK), kLdV = LdBf(DV), kLd = LdRow(kChunk);
  static constexpr int kK = 0;
  static constexpr int kV = kK + Bytes16(kChunk * kLdK * 2);
  static constexpr int kE = kV + Bytes16(kChunk * kLdV * 2);
  static constexpr int kT = kE + kChunk * kLd * 4;
  static constexpr int kG = kT + kChunk * kLd * 4;
  static constexpr int kGamma = kG + kChunk * 4;
  static constexpr int kBeta = kGamma + kChunk * 4;
  static constexpr int kCoef = kBeta + kChunk * 4;
  static constexpr int kBytes = kCoef + kChunk * 4;
};

// One block per (chunk, value head): E = decayed K K^T (strictly lower), T = (I + diag(beta) E)^-1,
// W = T diag(beta e^gamma) K and U~ = T diag(beta) V, stored FP32 at the chunk's token rows.
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) PrepKernel(Problem p) {
  using L = PrepSmem<DK, DV>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  if (static_cast<int>(blockIdx.x) >= *p.num_chunks) return;
  const ChunkInfo ci = p.chunks[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y), kh = h / p.group;
  bf16* sK = reinterpret_cast<bf16*>(gdn_smem + L::kK);
  bf16* sV = reinterpret_cast<bf16*>(gdn_smem + L::kV);
  float* sE = reinterpret_cast<float*>(gdn_smem + L::kE);
  float* sT = reinterpret_cast<float*>(gdn_smem + L::kT);
  float* sG = reinterpret_cast<float*>(gdn_smem + L::kG);
  float* sGam = reinterpret_cast<float*>(gdn_smem + L::kGamma);
  float* sBeta = reinterpret_cast<float*>(gdn_smem + L::kBeta);
  float* sCoef = reinterpret_cast<float*>(gdn_smem + L::kCoef);
  const int64_t row0 = ci.start;
  LoadRowsAsync<kChunk, DK>(sK, L::kLdK, p.k + (row0 * p.nk + kh) * DK, static_cast<int64_t>(p.nk) * DK, ci.len);
  LoadRowsAsync<kChunk, DV>(sV, L::kLdV, p.v + (row0 * p.nv + h) * DV, static_cast<int64_t>(p.nv) * DV, ci.len);
  LoadScalarsAsync(sG, p.g + row0 * p.nv + h, p.nv, ci.len);
  LoadScalarsAsync(sBeta, p.beta + row0 * p.nv + h, p.nv, ci.len);
  CpAsyncCommit();
  CpAsyncWait<0>();
  __syncthreads();
  ChunkDecay(sG, ci.len, sGam, nullptr, nullptr);
  __syncthreads();
  if (threadIdx.x < kChunk) sCoef[threadIdx.x] = sBeta[threadIdx.x] * expf(sGam[threadIdx.x]);
  {
    using TE = Tiling<kChunk, kChunk, 2>;
    float acc[TE::MI][TE::NI][4];
    ZeroAcc(acc);
    WarpGemm<Prec::kBf16, Prec::kBf16>(
        acc, TE::M0(), TE::N0(), DK, [&](int m, int k) { return Bf(sK[m * L::kLdK + k]); },
        [&](int k, int n) { return Bf(sK[n * L::kLdK + k]); });
    ForEachAcc(acc, TE::M0(), TE::N0(), [&](int r, int c, float& v) {
      sE[r * L::kLd + c] = c < r ? expf(sGam[r] - sGam[c]) * v : 0.0f;
    });
  }
  __syncthreads();
  InvertUnitLower(sE, sBeta, sT, L::kLd);
  __syncthreads();
  {
    using TW = Tiling<kChunk, DK, 2>;
    float acc[TW::MI][TW::NI][4];
    ZeroAcc(acc);
    WarpGemm<Prec::kFp32, Prec::kBf16>(
        acc, TW::M0(), TW::N0(), kChunk, [&](int m, int k) { return sT[m * L::kLd + k] * sCoef[k]; },
        [&](int k, int n) { return Bf(sK[k * L::kLdK + n]); });
    float* dst = p.w + (row0 * p.nv + h) * DK;
    ForEachAccPair(acc, TW::M0(), TW::N0(), [&](int r, int c, float& v0, float& v1) {
      if (r < ci.len) *reinterpret_cast<float2*>(dst + r * static_cast<int64_t>(p.nv) * DK + c) = make_float2(v0, v1);
    });
  }
  {
    using TU = Tiling<kChunk, DV, 2>;
    float acc[TU::MI][TU::NI][4];
    ZeroAcc(acc);
    WarpGemm<Prec::kFp32, Prec::kBf16>(
        acc, TU::M0(), TU::N0(), kChunk, [&](int m, int k) { return sT[m * L::kLd + k] * sBeta[k]; },
        [&](int k, int n) { return Bf(sV[k * L::kLdV + n]); });
    float* dst = p.u + (row0 * p.nv + h) * DV;
    ForEachAccPair(acc, TU::M0(), TU::N0(), [&](int r, int c, float& v0, float& v1) {
      if (r < ci.len) *reinterpret_cast<float2*>(dst + r * static_cast<int64_t>(p.nv) * DV + c) = make_float2(v0, v1);
    });
  }
}

// ---------------------------------------------------------------- the state recurrence

constexpr int kStateCols = 32;  // state columns per recurrence block

template <int DK>
struct StateFwdSmem {
  static constexpr int kLdW = LdRow(DK), kLdU = LdCol(kStateCols), kLdK = LdBf(DK), kLdS = LdCol(kStateCols);
  // one stage of the double buffer: W, U~ (then U), K rows and g of one chunk
  static constexpr int kW = 0;
  static constexpr int kU = kW + kChunk * kLdW * 4;
  static constexpr int kK = kU + kChunk * kLdU * 4;
  static constexpr int kG = kK + Bytes16(kChunk * kLdK * 2);
  static constexpr int kStage = kG + kChunk * 4;
  static constexpr int kS = 2 * kStage;
  static constexpr int kGamma = kS + DK * kLdS * 4;
  static constexpr int kDecay = kGamma + kChunk * 4;
  static constexpr int kMisc = kDecay + kChunk * 4;
  static constexpr int kBytes = kMisc + 16;
};

// One block per (document, value head, 32 state columns), walking the document's chunks in order
// with the state S (dk x 32, FP32) in shared memory: store S as the chunk's entering state,
// U = U~ - W S (written over U~), S = e^{gamma_last} S + K^T diag(decay) U. The next chunk's W, U~,
// K and g load (cp.async) while this one computes. Documents of one chunk have nothing to do
// (U = U~, entering state zero).
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) StateForwardKernel(Problem p) {
  using L = StateFwdSmem<DK>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  const DocChunks dc = p.docs[blockIdx.x];
  if (dc.count <= 1) return;
  const int h = static_cast<int>(blockIdx.y), kh = h / p.group, col0 = static_cast<int>(blockIdx.z) * kStateCols;
  float* sS = reinterpret_cast<float*>(gdn_smem + L::kS);
  float* sGam = reinterpret_cast<float*>(gdn_smem + L::kGamma);
  float* sDec = reinterpret_cast<float*>(gdn_smem + L::kDecay);
  float* sMisc = reinterpret_cast<float*>(gdn_smem + L::kMisc);
  const int64_t w_ld = static_cast<int64_t>(p.nv) * DK, u_ld = static_cast<int64_t>(p.nv) * DV,
                k_ld = static_cast<int64_t>(p.nk) * DK;
  auto prefetch = [&](int i) {
    const ChunkInfo ci = p.chunks[dc.first + i];
    unsigned char* st = gdn_smem + (i & 1) * L::kStage;
    const int64_t row0 = ci.start;
    if (i > 0) LoadRowsAsync<kChunk, DK>(reinterpret_cast<float*>(st + L::kW), L::kLdW, p.w + (row0 * p.nv + h) * DK, w_ld, ci.len);
    LoadRowsAsync<kChunk, kStateCols>(reinterpret_cast<float*>(st + L::kU), L::kLdU, p.u + (row0 * p.nv + h) * DV + col0,
                                      u_ld, ci.len);
    LoadRowsAsync<kChunk, DK>(reinterpret_cast<bf16*>(st + L::kK), L::kLdK, p.k + (row0 * p.nk + kh) * DK, k_ld, ci.len);
    LoadScalarsAsync(reinterpret_cast<float*>(st + L::kG), p.g + row0 * p.nv + h, p.nv, ci.len);
    CpAsyncCommit();
  };
  prefetch(0);
  for (int idx = static_cast<int>(threadIdx.x); idx < DK * L::kLdS; idx += kThreads) sS[idx] = 0.0f;
#pragma unroll 1
  for (int i = 0; i < dc.count; ++i) {
    const ChunkInfo ci = p.chunks[dc.first + i];
    if (i + 1 < dc.count) {
      prefetch(i + 1);
      CpAsyncWait<1>();
    } else {
      CpAsyncWait<0>();
    }
    __syncthreads();
    unsigned char* st = gdn_smem + (i & 1) * L::kStage;
    const float* sW = reinterpret_cast<const float*>(st + L::kW);
    float* sU = reinterpret_cast<float*>(st + L::kU);
    const bf16* sK = reinterpret_cast<const bf16*>(st + L::kK);
    ChunkDecay(reinterpret_cast<const float*>(st + L::kG), ci.len, sGam, sDec, sMisc);
    __syncthreads();
    if (i > 0) {
      float* dst = p.states + (static_cast<int64_t>(ci.slot) * p.nv + h) * DK * DV + col0;
      for (int idx = static_cast<int>(threadIdx.x); idx < DK * kStateCols / 4; idx += kThreads) {
        const int r = idx / (kStateCols / 4), c = (idx % (kStateCols / 4)) * 4;
        *reinterpret_cast<float4*>(dst + r * DV + c) = *reinterpret_cast<const float4*>(sS + r * L::kLdS + c);
      }
      using TU = Tiling<kChunk, kStateCols, 4>;
      float acc[TU::MI][TU::NI][4];
      ZeroAcc(acc);
      WarpGemm<Prec::kFp32, Prec::kFp32>(
          acc, TU::M0(), TU::N0(), DK, [&](int m, int k) { return sW[m * L::kLdW + k]; },
          [&](int k, int n) { return sS[k * L::kLdS + n]; });
      float* ug = p.u + (static_cast<int64_t>(ci.start) * p.nv + h) * DV + col0;
      ForEachAccPair(acc, TU::M0(), TU::N0(), [&](int r, int c, float& v0, float& v1) {
        const float u0 = sU[r * L::kLdU + c] - v0, u1 = sU[r * L::kLdU + c + 1] - v1;
        sU[r * L::kLdU + c] = u0;
        sU[r * L::kLdU + c + 1] = u1;
        if (r < ci.len) *reinterpret_cast<float2*>(ug + r * u_ld + c) = make_float2(u0, u1);
      });
    }
    __syncthreads();
    if (i + 1 < dc.count) {
      using TS = Tiling<DK, kStateCols, 4>;
      float acc[TS::MI][TS::NI][4];
      const float el = sMisc[0];
      ForEachAcc(acc, TS::M0(), TS::N0(), [&](int r, int c, float& v) { v = el * sS[r * L::kLdS + c]; });
      WarpGemm<Prec::kBf16, Prec::kFp32>(
          acc, TS::M0(), TS::N0(), kChunk, [&](int m, int k) { return Bf(sK[k * L::kLdK + m]); },
          [&](int k, int n) { return sDec[k] * sU[k * L::kLdU + n]; });
      ForEachAcc(acc, TS::M0(), TS::N0(), [&](int r, int c, float& v) { sS[r * L::kLdS + c] = v; });
    }
    __syncthreads();
  }
}

// ---------------------------------------------------------------- output

constexpr int kOutCols = 64;  // output (and local dU) columns per block

template <int DK>
struct OutSmem {
  static constexpr int kLdQ = LdBf(DK), kLdS = LdCol(kOutCols), kLdU = LdCol(kOutCols), kLdP = LdRow(kChunk);
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + Bytes16(kChunk * kLdQ * 2);
  static constexpr int kS = kK + Bytes16(kChunk * kLdQ * 2);
  static constexpr int kU = kS + DK * kLdS * 4;
  static constexpr int kP = kU + kChunk * kLdU * 4;
  static constexpr int kG = kP + kChunk * kLdP * 4;
  static constexpr int kGamma = kG + kChunk * 4;
  static constexpr int kBytes = kGamma + kChunk * 4;
};

// One block per (chunk, value head, 64 output columns):
// O = scale (diag(e^gamma) Q S_0 + (M o Q K^T) U), stored BF16.
template <int DK, int DV>
__global__ void __launch_bounds__(kThreads) OutputKernel(Problem p, bf16* o) {
  using L = OutSmem<DK>;
  extern __shared__ __align__(16) unsigned char gdn_smem[];
  if (static_cast<int>(blockIdx.x) >= *p.num_chunks) return;
  const ChunkInfo ci = p.chunks[blockIdx.x];
  const int h = static_cast<int>(blockIdx.y), kh = h / p.group, col0 = static_cast<int>(blockIdx.z) * kOutCols;
  bf16* sQ = reinterpret_cast<bf16*>(gdn_smem + L::kQ);
  bf16* sK = reinterpret_cast<bf16*>(gdn_smem + L::kK);
  float* sS = reinterpret_cast<float*>(gdn_smem + L::kS);
  float* sU = reinterpret_cast<float*>(gdn_smem + L::kU);
  float* sP = reinterpret_cast<float*>(gdn_smem + L::kP);
  float* sG = reinterpret_cast<float*>(gdn_smem + L::kG);
  float* sGam = reinterpret_cast<float*>(gdn_smem + L::kGamma);
  const int64_t row0 = ci.start, qk_ld = static_cast<int64_t>(p.nk) * DK, v_ld = static_cast<int64_t>(p.nv) * DV;
  LoadRowsAsync<kChunk, DK>(sQ, L::kLdQ, p.q + (row0 * p.nk + kh) * DK, qk_ld, ci.len);
  LoadRowsAsync<kChunk, DK>(sK, L::kLdQ, p.k + (row0 * p.nk + kh) * DK, qk_ld, ci.len);
  LoadRowsAsync<kChunk, kOutCols>(sU, L::kLdU, p.u + (row0 * p.nv + h) * DV + col0, v_ld, ci.len);
  if (ci.slot >= 0) {
    LoadRowsAsync<DK, kOutCols>(sS, L::kLdS, p.states + (static_cast<int64_t>(ci.slot) * p.nv + h) * DK * DV + col0, DV,
                                DK);
  }
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
    ForEachAcc(acc, TP::M0(), TP::N0(), [&](int r, int c, float& v) {
      sP[r * L::kLdP + c] = c <= r ? expf(sGam[r] - sGam[c]) * v : 0.0f;
    });
  }
  __syncthreads();
  using TO = Tiling<kChunk, kOutCols, 2>;
  float acc[TO::MI][TO::NI][4];
  ZeroAcc(acc);
  if (ci.slot >= 0) {
    WarpGemm<Prec::kBf16, Prec::kFp32>(
        acc, TO::M0(), TO::N0(), DK, [&](int m, int k) { return Bf(sQ[m * L::kLdQ + k]); },
        [&](int k, int n) { return sS[k * L::kLdS + n]; });
    ForEachAcc(acc, TO::M0(), TO::N0(), [&](int r, int, float& v) { v *= expf(sGam[r]); });
  }
  WarpGemm<Prec::kFp32, Prec::kFp32>(
      acc, TO::M0(), TO::N0(), kChunk, [&](int m, int k) { return sP[m * L::kLdP + k]; },
      [&](int k, int n) { return sU[k * L::kLdU + n]; });
  bf16* dst = o + (row0 * p.nv + h) * DV + col0;
  const float scale = p.scale;
  ForEachAccPair(acc, TO::M0(), TO::N0(), [&](int r, int c, float& v0, float& v1) {
    if (r < ci.len) *reinterpret_cast<__nv_bfloat162*>(dst + r * v_ld + c) = __floats2bfloat162_rn(scale * v0, scale * v1);
  });
}

// ---------------------------------------------------------------- launch helpers

template <typename Kernel, typename... Args>
absl::Status LaunchWithSmem(Kernel kernel, dim3 grid, int smem, cudaStream_t stream, Args... args) {
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<grid, kThreads, smem, stream>>>(args...);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <int DK, int DV>
absl::Status LaunchPrepStates(const GatedDeltaArgs& a, const WorkspaceLayout& l, const Problem& p,
                              cudaStream_t stream) {
  const unsigned nv = static_cast<unsigned>(a.num_v_heads);
  RETURN_IF_ERROR(LaunchWithSmem(PrepKernel<DK, DV>, dim3(static_cast<unsigned>(l.max_chunks), nv),
                                 PrepSmem<DK, DV>::kBytes, stream, p));
  return LaunchWithSmem(StateForwardKernel<DK, DV>, dim3(static_cast<unsigned>(a.num_docs), nv, DV / kStateCols),
                        StateFwdSmem<DK>::kBytes, stream, p);
}

template <int DK, int DV>
absl::Status LaunchOutput(const GatedDeltaArgs& a, const WorkspaceLayout& l, const Problem& p, bf16* o,
                          cudaStream_t stream) {
  return LaunchWithSmem(OutputKernel<DK, DV>,
                        dim3(static_cast<unsigned>(l.max_chunks), static_cast<unsigned>(a.num_v_heads), DV / kOutCols),
                        OutSmem<DK>::kBytes, stream, p, o);
}

bool Aligned(const void* ptr, uintptr_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }

}  // namespace
}  // namespace gated_delta_internal

namespace gdi = gated_delta_internal;

absl::Status gdi::CheckSizes(const GatedDeltaArgs& a) {
  const bool dims_ok = (a.k_dim == 64 || a.k_dim == 128) && (a.v_dim == 64 || a.v_dim == 128);
  if (a.tokens < 0 || a.tokens > (int64_t{1} << 30) || a.num_docs <= 0 || a.num_k_heads <= 0 ||
      a.num_v_heads <= 0 || a.num_v_heads % a.num_k_heads != 0 || a.num_v_heads > 65535 || !dims_ok ||
      !std::isfinite(a.scale)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "gated delta rule: unsupported sizes tokens=", a.tokens, " num_docs=", a.num_docs, " heads k/v=",
        a.num_k_heads, "/", a.num_v_heads, " dims k/v=", a.k_dim, "/", a.v_dim, " scale=", a.scale,
        " (need tokens in [0, 2^30], num_docs >= 1, nv a multiple of nk, dk and dv in {64, 128})"));
  }
  return absl::OkStatus();
}

absl::Status gdi::CheckArgs(const GatedDeltaArgs& a) {
  RETURN_IF_ERROR(CheckSizes(a));
  if (a.cu_seqlens == nullptr) return absl::InvalidArgumentError("gated delta rule: cu_seqlens is null");
  return absl::OkStatus();
}

gdi::Problem gdi::MakeProblem(const GatedDeltaArgs& a, const WorkspaceLayout& l, void* workspace, const bf16* q,
                              const bf16* k, const bf16* v, const float* g, const float* beta) {
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  Problem p{};
  p.q = q;
  p.k = k;
  p.v = v;
  p.g = g;
  p.beta = beta;
  p.tokens = a.tokens;
  p.nk = a.num_k_heads;
  p.nv = a.num_v_heads;
  p.group = a.num_v_heads / a.num_k_heads;
  p.scale = a.scale;
  p.chunks = reinterpret_cast<const ChunkInfo*>(ws + l.chunks);
  p.docs = reinterpret_cast<const DocChunks*>(ws + l.docs);
  p.num_chunks = reinterpret_cast<const int*>(ws + l.count);
  p.w = reinterpret_cast<float*>(ws + l.w);
  p.u = reinterpret_cast<float*>(ws + l.u);
  p.states = reinterpret_cast<float*>(ws + l.states);
  return p;
}

absl::Status gdi::LaunchChunkMapPrepStates(const GatedDeltaArgs& a, const WorkspaceLayout& l, const Problem& p,
                                           void* workspace, cudaStream_t stream) {
  unsigned char* ws = static_cast<unsigned char*>(workspace);
  ChunkMapKernel<<<1, kMapThreads, 0, stream>>>(a.cu_seqlens, a.num_docs, a.tokens, l.max_chunks, l.slots,
                                                 reinterpret_cast<ChunkInfo*>(ws + l.chunks),
                                                 reinterpret_cast<DocChunks*>(ws + l.docs),
                                                 reinterpret_cast<int*>(ws + l.count));
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (a.k_dim == 128 && a.v_dim == 128) return LaunchPrepStates<128, 128>(a, l, p, stream);
  if (a.k_dim == 128 && a.v_dim == 64) return LaunchPrepStates<128, 64>(a, l, p, stream);
  if (a.k_dim == 64 && a.v_dim == 128) return LaunchPrepStates<64, 128>(a, l, p, stream);
  return LaunchPrepStates<64, 64>(a, l, p, stream);
}

int64_t GatedDeltaForwardWorkspaceBytes(const GatedDeltaArgs& args) {
  if (!gdi::CheckSizes(args).ok()) return 0;
  return gdi::MakeLayout(args, /*backward=*/false).bytes;
}

absl::Status GatedDeltaForward(const GatedDeltaArgs& a, const bf16* q, const bf16* k, const bf16* v, const float* g,
                               const float* beta, bf16* o, void* workspace, cudaStream_t stream) {
  RETURN_IF_ERROR(gdi::CheckArgs(a));
  if (a.tokens == 0) return absl::OkStatus();
  for (const void* ptr : {static_cast<const void*>(q), static_cast<const void*>(k), static_cast<const void*>(v),
                          static_cast<const void*>(g), static_cast<const void*>(beta), static_cast<const void*>(o)}) {
    if (ptr == nullptr || !gdi::Aligned(ptr, 16)) {
      return absl::InvalidArgumentError("gated delta forward: a tensor pointer is null or not 16-byte aligned");
    }
  }
  if (workspace == nullptr || !gdi::Aligned(workspace, 256)) {
    return absl::InvalidArgumentError("gated delta forward: workspace is null or not 256-byte aligned");
  }
  const gdi::WorkspaceLayout l = gdi::MakeLayout(a, /*backward=*/false);
  const gdi::Problem p = gdi::MakeProblem(a, l, workspace, q, k, v, g, beta);
  RETURN_IF_ERROR(gdi::LaunchChunkMapPrepStates(a, l, p, workspace, stream));
  if (a.k_dim == 128 && a.v_dim == 128) return gdi::LaunchOutput<128, 128>(a, l, p, o, stream);
  if (a.k_dim == 128 && a.v_dim == 64) return gdi::LaunchOutput<128, 64>(a, l, p, o, stream);
  if (a.k_dim == 64 && a.v_dim == 128) return gdi::LaunchOutput<64, 128>(a, l, p, o, stream);
  return gdi::LaunchOutput<64, 64>(a, l, p, o, stream);
}

}  // namespace slidedp::kernels
