// Gated DeltaNet's causal depthwise conv1d + SiLU with per-document left padding, forward and
// backward (gdn_ops.h, op 1).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/gdn_ops.h"
#include "worker/kernels/gdn_ops_common.cuh"
#include "worker/kernels/reductions.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh
using namespace gdn_internal;

namespace {

// =====================================================================================================
// 1. Causal depthwise conv1d + SiLU.
//
// Each thread owns V adjacent channels and walks a run of tokens in order with the last K inputs in
// registers (a sliding window), so x is read once per run plus K-1 halo rows. Document starts come
// from a cursor over cu_seqlens: when a token starts a new document the window is cleared, which is
// the per-document left zero padding.
constexpr int kConvThreads = 128;
constexpr int kConvFwdTokens = 64;  // tokens per forward block (halo overhead (K-1)/64)
constexpr int kConvBwdParts = 128;  // token runs of the backward = dw partial rows
constexpr int kConvMaxKernel = 8;

// The document of token t: the largest d < num_docs with cu[d] <= t (with empty documents, the
// non-empty one that holds t). Tokens at or past cu[num_docs] count as the last document's.
struct DocCursor {
  const int32_t* cu;
  int last;       // num_docs - 1
  int d;          // current document
  int64_t start;  // cu[d]
  int64_t next;   // cu[d + 1], or INT64_MAX for the last document

  __device__ __forceinline__ void Init(const int32_t* cu_seqlens, int num_docs, int64_t t) {
    cu = cu_seqlens;
    last = num_docs - 1;
    int lo = 0, hi = last;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (cu[mid] <= t) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    d = lo;
    start = cu[d];
    next = d < last ? cu[d + 1] : INT64_MAX;
  }
  // Moves to t's document (t nondecreasing across calls); true when t starts a new one.
  __device__ __forceinline__ bool Advance(int64_t t) {
    bool moved = false;
    while (t >= next) {
      ++d;
      start = next;
      next = d < last ? cu[d + 1] : INT64_MAX;
      moved = true;
    }
    return moved;
  }
};

// win[j] = x[t0-K+j, c0:c0+V] for j = 1..K-1 (zero before t0's document start or before token 0):
// the window as it stands just before token t0 enters it.
template <int K, int V>
__device__ __forceinline__ void ConvPrefill(const bf16* x, int64_t ld_x, int c0, int64_t t0, int64_t doc_start,
                                            float (&win)[K][V]) {
#pragma unroll
  for (int j = 0; j < K; ++j) {
#pragma unroll
    for (int v = 0; v < V; ++v) win[j][v] = 0.0f;
    const int64_t s = t0 - K + j;
    if (j > 0 && s >= doc_start && s >= 0) LoadV<V>(x + s * ld_x + c0, win[j]);
  }
}

template <int K, int V>
__device__ __forceinline__ void ConvLoadWeights(const bf16* w, int c0, float (&wf)[K][V]) {
#pragma unroll
  for (int v = 0; v < V; ++v)
#pragma unroll
    for (int j = 0; j < K; ++j) wf[j][v] = __bfloat162float(w[static_cast<int64_t>(c0 + v) * K + j]);
}

// Shift the window by one token and append x[t]; cleared first when t starts a new document.
template <int K, int V>
__device__ __forceinline__ void ConvPush(const bf16* x, int64_t ld_x, int c0, int64_t t, bool new_doc,
                                         float (&win)[K][V]) {
#pragma unroll
  for (int j = 0; j + 1 < K; ++j)
#pragma unroll
    for (int v = 0; v < V; ++v) win[j][v] = new_doc ? 0.0f : win[j + 1][v];
  LoadV<V>(x + t * ld_x + c0, win[K - 1]);
}

// grid (ceil(T / kConvFwdTokens), ceil(C / V / kConvThreads)).
template <int K, int V>
__global__ void __launch_bounds__(kConvThreads)
    ConvSiluForwardKernel(const bf16* __restrict__ x, int64_t ld_x, const bf16* __restrict__ w,
                          const int32_t* __restrict__ cu, int num_docs, int64_t T, int C, bf16* __restrict__ y,
                          int64_t ld_y) {
  const int c0 = (blockIdx.y * kConvThreads + threadIdx.x) * V;
  if (c0 >= C) return;
  const int64_t t0 = static_cast<int64_t>(blockIdx.x) * kConvFwdTokens;
  const int64_t t1 = min(T, t0 + kConvFwdTokens);
  float wf[K][V], win[K][V];
  ConvLoadWeights<K, V>(w, c0, wf);
  DocCursor doc;
  doc.Init(cu, num_docs, t0);
  ConvPrefill<K, V>(x, ld_x, c0, t0, doc.start, win);
  for (int64_t t = t0; t < t1; ++t) {
    ConvPush<K, V>(x, ld_x, c0, t, doc.Advance(t), win);
    float out[V];
#pragma unroll
    for (int v = 0; v < V; ++v) {
      float pre = 0.0f;
#pragma unroll
      for (int j = 0; j < K; ++j) pre += wf[j][v] * win[j][v];
      out[v] = pre * Sigmoid(pre);
    }
    StoreV<V>(y + t * ld_y + c0, out);
  }
}

// grid (parts, ceil(C / V / kConvThreads)); part p owns tokens [p·part_tokens, +part_tokens).
// A thread walks its run plus K-1 tokens past it (recomputing those tokens' dpre, which the next
// run also computes), scattering w·dpre[t] into a ring of K dx accumulators for tokens t-K+1..t;
// the oldest is complete after token t and is stored. dw sums over the owned tokens only, kept in
// registers and written as this part's partial row [C, K] (zeros for a part past the end, so that
// every partial row the reduction reads is written).
template <int K, int V, typename TDX>
__global__ void __launch_bounds__(kConvThreads)
    ConvSiluBackwardKernel(const float* __restrict__ dy, int64_t ld_dy, const bf16* __restrict__ x, int64_t ld_x,
                           const bf16* __restrict__ w, const int32_t* __restrict__ cu, int num_docs, int64_t T, int C,
                           int64_t part_tokens, TDX* __restrict__ dx, int64_t ld_dx, float* __restrict__ partial) {
  const int c0 = (blockIdx.y * kConvThreads + threadIdx.x) * V;
  if (c0 >= C) return;
  const int64_t tA = static_cast<int64_t>(blockIdx.x) * part_tokens;
  const int64_t tB = min(T, tA + part_tokens);
  float dwacc[K][V];
#pragma unroll
  for (int j = 0; j < K; ++j)
#pragma unroll
    for (int v = 0; v < V; ++v) dwacc[j][v] = 0.0f;
  if (tA < T) {
    float wf[K][V], win[K][V], dxacc[K][V];
    ConvLoadWeights<K, V>(w, c0, wf);
    DocCursor doc;
    doc.Init(cu, num_docs, tA);
    ConvPrefill<K, V>(x, ld_x, c0, tA, doc.start, win);
#pragma unroll
    for (int j = 0; j < K; ++j)
#pragma unroll
      for (int v = 0; v < V; ++v) dxacc[j][v] = 0.0f;
    for (int64_t t = tA; t < tB + K - 1; ++t) {
      // dxacc[j] accumulates dx[t-K+1+j] here.
      if (t < T) {
        ConvPush<K, V>(x, ld_x, c0, t, doc.Advance(t), win);
        float g[V];
        LoadV<V>(dy + t * ld_dy + c0, g);
#pragma unroll
        for (int v = 0; v < V; ++v) {
          float pre = 0.0f;
#pragma unroll
          for (int j = 0; j < K; ++j) pre += wf[j][v] * win[j][v];
          const float dpre = g[v] * SiluGrad(pre);
#pragma unroll
          for (int j = 0; j < K; ++j) {
            // Taps before the document start read the zero padding: no gradient flows there.
            if (t - (K - 1) + j >= doc.start) dxacc[j][v] += wf[j][v] * dpre;
            if (t < tB) dwacc[j][v] += dpre * win[j][v];  // win is zero outside the document
          }
        }
      }
      const int64_t te = t - (K - 1);
      if (te >= tA) StoreV<V>(dx + te * ld_dx + c0, dxacc[0]);
#pragma unroll
      for (int j = 0; j < K; ++j)
#pragma unroll
        for (int v = 0; v < V; ++v) dxacc[j][v] = j + 1 < K ? dxacc[j + 1][v] : 0.0f;
    }
  }
  if (partial != nullptr) {
    float* row = partial + static_cast<int64_t>(blockIdx.x) * C * K + static_cast<int64_t>(c0) * K;
#pragma unroll
    for (int v = 0; v < V; ++v)
#pragma unroll
      for (int j = 0; j < K; ++j) row[v * K + j] = dwacc[j][v];
  }
}

int64_t ConvParts(int64_t tokens) { return std::max<int64_t>(1, std::min<int64_t>(tokens, kConvBwdParts)); }

absl::Status CheckConv(const char* op, int num_docs, int64_t tokens, int channels, int kernel_size) {
  if (tokens < 0 || channels <= 0 || num_docs <= 0 || kernel_size < 1 || kernel_size > kConvMaxKernel) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": tokens ", tokens, ", channels ", channels, ", num_docs ",
                                                   num_docs, ", kernel_size ", kernel_size,
                                                   " (need channels > 0, num_docs > 0, 1 <= kernel_size <= 8)"));
  }
  return absl::OkStatus();
}

template <int K>
absl::Status LaunchConvForward(const bf16* x, int64_t ld_x, const bf16* w, const int32_t* cu, int num_docs, int64_t T,
                               int C, bf16* y, int64_t ld_y, cudaStream_t stream) {
  const int64_t tiles = (T + kConvFwdTokens - 1) / kConvFwdTokens;
  if (Divisible({C, ld_x, ld_y}, 8) && Aligned(x, 8) && Aligned(y, 8)) {
    const dim3 grid(static_cast<unsigned>(tiles), (C / 8 + kConvThreads - 1) / kConvThreads);
    ConvSiluForwardKernel<K, 8><<<grid, kConvThreads, 0, stream>>>(x, ld_x, w, cu, num_docs, T, C, y, ld_y);
  } else {
    const dim3 grid(static_cast<unsigned>(tiles), (C + kConvThreads - 1) / kConvThreads);
    ConvSiluForwardKernel<K, 1><<<grid, kConvThreads, 0, stream>>>(x, ld_x, w, cu, num_docs, T, C, y, ld_y);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <int K, typename TDX>
absl::Status LaunchConvBackward(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, const bf16* w,
                                const int32_t* cu, int num_docs, int64_t T, int C, TDX* dx, int64_t ld_dx,
                                float* partial, cudaStream_t stream) {
  const int64_t parts = ConvParts(T), part_tokens = (T + parts - 1) / parts;
  // 4 channels per thread: 16-byte dy loads; 8 would need 4·K·8 FP32 registers for the windows.
  if (Divisible({C, ld_x, ld_dy, ld_dx}, 4) && Aligned(x, 4) && Aligned(dy, 4) && Aligned(dx, 4)) {
    const dim3 grid(static_cast<unsigned>(parts), (C / 4 + kConvThreads - 1) / kConvThreads);
    ConvSiluBackwardKernel<K, 4, TDX>
        <<<grid, kConvThreads, 0, stream>>>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, part_tokens, dx, ld_dx, partial);
  } else {
    const dim3 grid(static_cast<unsigned>(parts), (C + kConvThreads - 1) / kConvThreads);
    ConvSiluBackwardKernel<K, 1, TDX>
        <<<grid, kConvThreads, 0, stream>>>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, part_tokens, dx, ld_dx, partial);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TDX>
absl::Status ConvBackwardImpl(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, const bf16* w,
                              const int32_t* cu, int num_docs, int64_t T, int C, int K, TDX* dx, int64_t ld_dx,
                              float* dw, float* ws, cudaStream_t stream) {
  const char* op = "CausalConvSiluBackward";
  const absl::Status s = FirstError(
      {CheckConv(op, num_docs, T, C, K), CheckStrides(op, C, {{"ld_dy", ld_dy}, {"ld_x", ld_x}, {"ld_dx", ld_dx}})});
  if (!s.ok()) return s;
  if (T == 0) return absl::OkStatus();
  float* partial = dw != nullptr ? ws : nullptr;
  const absl::Status launched = [&] {
    switch (K) {
      case 1: return LaunchConvBackward<1>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
      case 2: return LaunchConvBackward<2>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
      case 3: return LaunchConvBackward<3>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
      case 4: return LaunchConvBackward<4>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
      case 5: return LaunchConvBackward<5>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
      case 6: return LaunchConvBackward<6>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
      case 7: return LaunchConvBackward<7>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
      default: return LaunchConvBackward<8>(dy, ld_dy, x, ld_x, w, cu, num_docs, T, C, dx, ld_dx, partial, stream);
    }
  }();
  if (!launched.ok()) return launched;
  if (dw != nullptr) return ReducePartialsInto(ws, ConvParts(T), static_cast<int64_t>(C) * K, dw, stream);
  return absl::OkStatus();
}

}  // namespace

// ---- 1. Conv launchers
absl::Status CausalConvSiluForward(const bf16* x, int64_t ld_x, const bf16* w, const int32_t* cu_seqlens, int num_docs,
                                   int64_t tokens, int channels, int kernel_size, bf16* y, int64_t ld_y,
                                   cudaStream_t stream) {
  const char* op = "CausalConvSiluForward";
  const absl::Status s = FirstError({CheckConv(op, num_docs, tokens, channels, kernel_size),
                                     CheckStrides(op, channels, {{"ld_x", ld_x}, {"ld_y", ld_y}})});
  if (!s.ok()) return s;
  if (tokens == 0) return absl::OkStatus();
  if ((tokens + kConvFwdTokens - 1) / kConvFwdTokens > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": ", tokens, " tokens is too many"));
  }
  const int32_t* cu = cu_seqlens;
  const int64_t T = tokens;
  const int C = channels;
  switch (kernel_size) {
    case 1: return LaunchConvForward<1>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
    case 2: return LaunchConvForward<2>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
    case 3: return LaunchConvForward<3>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
    case 4: return LaunchConvForward<4>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
    case 5: return LaunchConvForward<5>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
    case 6: return LaunchConvForward<6>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
    case 7: return LaunchConvForward<7>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
    default: return LaunchConvForward<8>(x, ld_x, w, cu, num_docs, T, C, y, ld_y, stream);
  }
}

int64_t CausalConvSiluBackwardWorkspaceNumel(int64_t tokens, int channels, int kernel_size) {
  return ConvParts(tokens) * channels * kernel_size;
}

absl::Status CausalConvSiluBackward(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, const bf16* w,
                                    const int32_t* cu_seqlens, int num_docs, int64_t tokens, int channels,
                                    int kernel_size, bf16* dx, int64_t ld_dx, float* dw, float* ws,
                                    cudaStream_t stream) {
  return ConvBackwardImpl(dy, ld_dy, x, ld_x, w, cu_seqlens, num_docs, tokens, channels, kernel_size, dx, ld_dx, dw, ws,
                          stream);
}
absl::Status CausalConvSiluBackward(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, const bf16* w,
                                    const int32_t* cu_seqlens, int num_docs, int64_t tokens, int channels,
                                    int kernel_size, float* dx, int64_t ld_dx, float* dw, float* ws,
                                    cudaStream_t stream) {
  return ConvBackwardImpl(dy, ld_dy, x, ld_x, w, cu_seqlens, num_docs, tokens, channels, kernel_size, dx, ld_dx, dw, ws,
                          stream);
}

}  // namespace slidedp::kernels
