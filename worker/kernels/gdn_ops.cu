// Gated DeltaNet token-local kernels and the attention output gate; see gdn_ops.h. All are
// memory-bound (a few FLOPs per byte): the ceiling is device copy bandwidth over the bytes each
// reads and writes once (docs/kernels.md lists them; measured: pending a GPU run).
#include "worker/kernels/gdn_ops.h"

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/gdn_ops_common.cuh"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/reductions.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh
using namespace gdn_internal;

namespace {

// =====================================================================================================
// Per-head row ops (2 and 4): one warp per (token, head); lane l holds elements (c·32 + l)·V .. +V-1
// for chunks c < 256 / (32·V), so a head of up to 256 values sits in registers and its sum is one
// warp reduction. V = 4 (8-byte BF16 / 16-byte FP32 accesses) when head_dim and strides allow, else 1.
constexpr int kRowThreads = 256;
constexpr int kMaxHeadDim = 256;

template <int V>
constexpr int RowChunks() {
  return kMaxHeadDim / (32 * V);
}

absl::Status CheckHeads(const char* op, int64_t tokens, int heads, int head_dim) {
  if (tokens < 0 || heads <= 0 || head_dim <= 0 || head_dim > kMaxHeadDim) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": tokens ", tokens, ", heads ", heads, ", head_dim ", head_dim,
                                                   " (need heads > 0, 0 < head_dim <= 256)"));
  }
  return absl::OkStatus();
}

// Warps per grid-stride loop: items = tokens·heads warps' worth of work.
int RowGrid(int64_t items) { return GridFor(items * 32, kRowThreads); }

// ---- 2. L2 norm per head.
template <int V, typename TY>
__global__ void __launch_bounds__(kRowThreads)
    L2NormForwardKernel(const bf16* __restrict__ x, int64_t ld_x, int64_t T, int heads, int d, float eps,
                        TY* __restrict__ y, int64_t ld_y) {
  constexpr int NC = RowChunks<V>();
  const int lane = threadIdx.x & 31;
  const int64_t items = T * heads;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t it = (static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x) / 32; it < items; it += warps) {
    const int64_t t = it / heads;
    const int64_t col = (it - t * heads) * d;
    float v[NC][V];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
#pragma unroll
      for (int i = 0; i < V; ++i) v[c][i] = 0.0f;
      if (e < d) LoadV<V>(x + t * ld_x + col + e, v[c]);
#pragma unroll
      for (int i = 0; i < V; ++i) ss += v[c][i] * v[c][i];
    }
    const float r = rsqrtf(WarpSum(ss) + eps);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
      if (e >= d) continue;
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = v[c][i] * r;
      StoreV<V>(y + t * ld_y + col + e, o);
    }
  }
}

// dx and dy are not __restrict__: dx may alias dy (each warp reads its head of dy before writing).
template <int V>
__global__ void __launch_bounds__(kRowThreads)
    L2NormBackwardKernel(const float* dy, int64_t ld_dy, const bf16* __restrict__ x, int64_t ld_x, int64_t T, int heads,
                         int d, float eps, float* dx, int64_t ld_dx) {
  constexpr int NC = RowChunks<V>();
  const int lane = threadIdx.x & 31;
  const int64_t items = T * heads;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t it = (static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x) / 32; it < items; it += warps) {
    const int64_t t = it / heads;
    const int64_t col = (it - t * heads) * d;
    float xv[NC][V], gv[NC][V];
    float ss = 0.0f, dot = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
#pragma unroll
      for (int i = 0; i < V; ++i) xv[c][i] = gv[c][i] = 0.0f;
      if (e < d) {
        LoadV<V>(x + t * ld_x + col + e, xv[c]);
        LoadV<V>(dy + t * ld_dy + col + e, gv[c]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) {
        ss += xv[c][i] * xv[c][i];
        dot += gv[c][i] * xv[c][i];
      }
    }
    ss = WarpSum(ss);
    dot = WarpSum(dot);
    const float r = rsqrtf(ss + eps);
    const float k = r * r * r * dot;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
      if (e >= d) continue;
      float o[V];
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] = r * gv[c][i] - k * xv[c][i];
      StoreV<V>(dx + t * ld_dx + col + e, o);
    }
  }
}

template <typename TY>
absl::Status L2NormForwardImpl(const bf16* x, int64_t ld_x, int64_t T, int heads, int d, float eps, TY* y, int64_t ld_y,
                               cudaStream_t stream) {
  const char* op = "L2NormHeadsForward";
  const absl::Status s = FirstError({CheckHeads(op, T, heads, d), CheckStrides(op, static_cast<int64_t>(heads) * d,
                                                                               {{"ld_x", ld_x}, {"ld_y", ld_y}})});
  if (!s.ok()) return s;
  if (T == 0) return absl::OkStatus();
  const int grid = RowGrid(T * heads);
  if (Divisible({d, ld_x, ld_y}, 4) && Aligned(x, 4) && Aligned(y, 4)) {
    L2NormForwardKernel<4, TY><<<grid, kRowThreads, 0, stream>>>(x, ld_x, T, heads, d, eps, y, ld_y);
  } else {
    L2NormForwardKernel<1, TY><<<grid, kRowThreads, 0, stream>>>(x, ld_x, T, heads, d, eps, y, ld_y);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

// ---- 4. Gated RMSNorm per head.
template <int V, typename TW>
__device__ __forceinline__ void LoadRowWeights(const TW* w, int d, int lane, float (&wf)[RowChunks<V>()][V]) {
#pragma unroll
  for (int c = 0; c < RowChunks<V>(); ++c) {
    const int e = (c * 32 + lane) * V;
#pragma unroll
    for (int i = 0; i < V; ++i) wf[c][i] = e < d ? ToF32(w[e + i]) : 0.0f;
  }
}

template <int V, typename TW>
__global__ void __launch_bounds__(kRowThreads)
    GatedRmsNormForwardKernel(const bf16* __restrict__ o, int64_t ld_o, const bf16* __restrict__ z, int64_t ld_z,
                              const TW* __restrict__ w, int64_t T, int heads, int d, float eps, bf16* __restrict__ y,
                              int64_t ld_y) {
  constexpr int NC = RowChunks<V>();
  const int lane = threadIdx.x & 31;
  float wf[NC][V];
  LoadRowWeights<V, TW>(w, d, lane, wf);
  const int64_t items = T * heads;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * (kRowThreads / 32);
  for (int64_t it = (static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x) / 32; it < items; it += warps) {
    const int64_t t = it / heads;
    const int64_t col = (it - t * heads) * d;
    float ov[NC][V], zv[NC][V];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
#pragma unroll
      for (int i = 0; i < V; ++i) ov[c][i] = zv[c][i] = 0.0f;
      if (e < d) {
        LoadV<V>(o + t * ld_o + col + e, ov[c]);
        LoadV<V>(z + t * ld_z + col + e, zv[c]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) ss += ov[c][i] * ov[c][i];
    }
    const float r = rsqrtf(WarpSum(ss) / d + eps);
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
      if (e >= d) continue;
      float out[V];
#pragma unroll
      for (int i = 0; i < V; ++i) out[i] = wf[c][i] * (ov[c][i] * r) * (zv[c][i] * Sigmoid(zv[c][i]));
      StoreV<V>(y + t * ld_y + col + e, out);
    }
  }
}

// dw: each lane sums its columns over the warp's items in registers; the block's warps are then
// added in warp order through shared memory into the block's partial row [d].
template <int V, typename TW>
__global__ void __launch_bounds__(kRowThreads)
    GatedRmsNormBackwardKernel(const bf16* __restrict__ dy, int64_t ld_dy, const bf16* __restrict__ o, int64_t ld_o,
                               const bf16* __restrict__ z, int64_t ld_z, const TW* __restrict__ w, int64_t T, int heads,
                               int d, float eps, float* __restrict__ d_o, int64_t ld_do, bf16* __restrict__ dz,
                               int64_t ld_dz, float* __restrict__ partial) {
  constexpr int NC = RowChunks<V>();
  constexpr int kWarps = kRowThreads / 32;
  __shared__ float red[kWarps][kMaxHeadDim];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float wf[NC][V], dwacc[NC][V];
  LoadRowWeights<V, TW>(w, d, lane, wf);
#pragma unroll
  for (int c = 0; c < NC; ++c)
#pragma unroll
    for (int i = 0; i < V; ++i) dwacc[c][i] = 0.0f;
  const int64_t items = T * heads;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t it = (static_cast<int64_t>(blockIdx.x) * kRowThreads + threadIdx.x) / 32; it < items; it += warps) {
    const int64_t t = it / heads;
    const int64_t col = (it - t * heads) * d;
    float ov[NC][V], zv[NC][V], gv[NC][V];
    float ss = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
#pragma unroll
      for (int i = 0; i < V; ++i) ov[c][i] = zv[c][i] = gv[c][i] = 0.0f;
      if (e < d) {
        LoadV<V>(o + t * ld_o + col + e, ov[c]);
        LoadV<V>(z + t * ld_z + col + e, zv[c]);
        LoadV<V>(dy + t * ld_dy + col + e, gv[c]);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) ss += ov[c][i] * ov[c][i];
    }
    const float r = rsqrtf(WarpSum(ss) / d + eps);
    // With n = o·r and s = silu(z): dn = dy·w·s, dz = dy·w·n·silu'(z), dw += dy·n·s, and
    // d_o = r·(dn − n·mean(dn·n)). gv becomes dn, zv becomes dz, ov becomes n.
    float dot = 0.0f;
#pragma unroll
    for (int c = 0; c < NC; ++c)
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float n = ov[c][i] * r, zz = zv[c][i], sg = Sigmoid(zz), s = zz * sg;
        const float gw = gv[c][i] * wf[c][i];
        dwacc[c][i] += gv[c][i] * n * s;
        zv[c][i] = gw * n * sg * (1.0f + zz * (1.0f - sg));
        gv[c][i] = gw * s;
        ov[c][i] = n;
        dot += gv[c][i] * n;
      }
    const float mean_dot = WarpSum(dot) / d;
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int e = (c * 32 + lane) * V;
      if (e >= d) continue;
      float dov[V];
#pragma unroll
      for (int i = 0; i < V; ++i) dov[i] = r * (gv[c][i] - ov[c][i] * mean_dot);
      StoreV<V>(d_o + t * ld_do + col + e, dov);
      StoreV<V>(dz + t * ld_dz + col + e, zv[c]);
    }
  }
  if (partial == nullptr) return;  // uniform across the block
#pragma unroll
  for (int c = 0; c < NC; ++c) {
    const int e = (c * 32 + lane) * V;
    if (e < d)
#pragma unroll
      for (int i = 0; i < V; ++i) red[warp][e + i] = dwacc[c][i];
  }
  __syncthreads();
  if (threadIdx.x < d) {
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < kWarps; ++k) s += red[k][threadIdx.x];
    partial[static_cast<int64_t>(blockIdx.x) * d + threadIdx.x] = s;
  }
}

int64_t GatedRmsNormParts(int64_t tokens, int heads) {
  return PartialBlocks((tokens * heads + kRowThreads / 32 - 1) / (kRowThreads / 32));
}

template <typename TW>
absl::Status GatedRmsNormForwardImpl(const bf16* o, int64_t ld_o, const bf16* z, int64_t ld_z, const TW* w, int64_t T,
                                     int heads, int d, float eps, bf16* y, int64_t ld_y, cudaStream_t stream) {
  const char* op = "GatedRmsNormForward";
  const int64_t width = static_cast<int64_t>(heads) * d;
  const absl::Status s = FirstError(
      {CheckHeads(op, T, heads, d), CheckStrides(op, width, {{"ld_o", ld_o}, {"ld_z", ld_z}, {"ld_y", ld_y}})});
  if (!s.ok()) return s;
  if (T == 0) return absl::OkStatus();
  const int grid = RowGrid(T * heads);
  if (Divisible({d, ld_o, ld_z, ld_y}, 4) && Aligned(o, 4) && Aligned(z, 4) && Aligned(y, 4)) {
    GatedRmsNormForwardKernel<4, TW><<<grid, kRowThreads, 0, stream>>>(o, ld_o, z, ld_z, w, T, heads, d, eps, y, ld_y);
  } else {
    GatedRmsNormForwardKernel<1, TW><<<grid, kRowThreads, 0, stream>>>(o, ld_o, z, ld_z, w, T, heads, d, eps, y, ld_y);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TW>
absl::Status GatedRmsNormBackwardImpl(const bf16* dy, int64_t ld_dy, const bf16* o, int64_t ld_o, const bf16* z,
                                      int64_t ld_z, const TW* w, int64_t T, int heads, int d, float eps, float* d_o,
                                      int64_t ld_do, bf16* dz, int64_t ld_dz, float* dw, float* ws,
                                      cudaStream_t stream) {
  const char* op = "GatedRmsNormBackward";
  const int64_t width = static_cast<int64_t>(heads) * d;
  const absl::Status s = FirstError(
      {CheckHeads(op, T, heads, d),
       CheckStrides(op, width,
                    {{"ld_dy", ld_dy}, {"ld_o", ld_o}, {"ld_z", ld_z}, {"ld_do", ld_do}, {"ld_dz", ld_dz}})});
  if (!s.ok()) return s;
  if (T == 0) return absl::OkStatus();
  // One block per partial row, so the partial count (and the sum order) depends on the sizes only.
  const int64_t parts = GatedRmsNormParts(T, heads);
  float* partial = dw != nullptr ? ws : nullptr;
  if (Divisible({d, ld_dy, ld_o, ld_z, ld_do, ld_dz}, 4) && Aligned(dy, 4) && Aligned(o, 4) && Aligned(z, 4) &&
      Aligned(d_o, 4) && Aligned(dz, 4)) {
    GatedRmsNormBackwardKernel<4, TW><<<static_cast<unsigned>(parts), kRowThreads, 0, stream>>>(
        dy, ld_dy, o, ld_o, z, ld_z, w, T, heads, d, eps, d_o, ld_do, dz, ld_dz, partial);
  } else {
    GatedRmsNormBackwardKernel<1, TW><<<static_cast<unsigned>(parts), kRowThreads, 0, stream>>>(
        dy, ld_dy, o, ld_o, z, ld_z, w, T, heads, d, eps, d_o, ld_do, dz, ld_dz, partial);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (dw != nullptr) return ReducePartialsInto(ws, parts, d, dw, stream);
  return absl::OkStatus();
}

// =====================================================================================================
// 3. Decay g and write strength beta. [T, nv] is small (nv ~ 32-64 per token); forward is a flat
// element-wise pass. Backward: block (32, 8) covers 32 heads x 8 tokens, walks tokens with a grid
// stride, sums dA_log / ddt_bias per head in registers, then over its 8 token lanes in a fixed order
// into its partial row [dA_log(nv) | ddt_bias(nv)].
constexpr int kDecayRows = 8;
constexpr int kDecayMaxParts = 256;

// torch.nn.functional.softplus with beta 1, threshold 20.
__device__ __forceinline__ float Softplus(float u) { return u > 20.0f ? u : log1pf(expf(u)); }

template <typename TP>
__global__ void DecayBetaForwardKernel(const bf16* __restrict__ a, int64_t ld_a, const bf16* __restrict__ b,
                                       int64_t ld_b, const TP* __restrict__ A_log, const TP* __restrict__ dt_bias,
                                       int64_t T, int nv, float* __restrict__ g, float* __restrict__ beta) {
  const int64_t n = T * nv;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / nv;
    const int h = static_cast<int>(i - t * nv);
    const float u = __bfloat162float(a[t * ld_a + h]) + ToF32(dt_bias[h]);
    g[i] = -expf(ToF32(A_log[h])) * Softplus(u);
    beta[i] = Sigmoid(__bfloat162float(b[t * ld_b + h]));
  }
}

template <typename TP, typename TD>
__global__ void __launch_bounds__(32 * kDecayRows)
    DecayBetaBackwardKernel(const float* __restrict__ dg, const float* __restrict__ dbeta, const bf16* __restrict__ a,
                            int64_t ld_a, const bf16* __restrict__ b, int64_t ld_b, const TP* __restrict__ A_log,
                            const TP* __restrict__ dt_bias, int64_t T, int nv, TD* __restrict__ da, int64_t ld_da,
                            TD* __restrict__ db, int64_t ld_db, float* __restrict__ partial) {
  __shared__ float red[2][kDecayRows][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int h = blockIdx.y * 32 + tx;
  float sum_a = 0.0f, sum_dt = 0.0f;
  if (h < nv) {
    const float neg_exp_a = -expf(ToF32(A_log[h])), bias = ToF32(dt_bias[h]);
    for (int64_t t = static_cast<int64_t>(blockIdx.x) * kDecayRows + ty; t < T;
         t += static_cast<int64_t>(gridDim.x) * kDecayRows) {
      const float u = __bfloat162float(a[t * ld_a + h]) + bias;
      const float gv = neg_exp_a * Softplus(u);
      const float dgv = dg[t * nv + h];
      // torch's softplus backward: 1 above the threshold, σ(u) below.
      const float dav = dgv * neg_exp_a * (u > 20.0f ? 1.0f : Sigmoid(u));
      sum_a += dgv * gv;  // ∂g/∂A_log = g
      sum_dt += dav;
      StoreV<1>(da + t * ld_da + h, &dav);
      const float sb = Sigmoid(__bfloat162float(b[t * ld_b + h]));
      const float dbv = dbeta[t * nv + h] * sb * (1.0f - sb);
      StoreV<1>(db + t * ld_db + h, &dbv);
    }
  }
  if (partial == nullptr) return;  // uniform across the block
  red[0][ty][tx] = sum_a;
  red[1][ty][tx] = sum_dt;
  __syncthreads();
  if (ty == 0 && h < nv) {
    float sa = 0.0f, sd = 0.0f;
#pragma unroll
    for (int k = 0; k < kDecayRows; ++k) {
      sa += red[0][k][tx];
      sd += red[1][k][tx];
    }
    partial[static_cast<int64_t>(blockIdx.x) * 2 * nv + h] = sa;
    partial[static_cast<int64_t>(blockIdx.x) * 2 * nv + nv + h] = sd;
  }
}

int64_t DecayParts(int64_t tokens) {
  return std::max<int64_t>(1, std::min<int64_t>((tokens + kDecayRows - 1) / kDecayRows, kDecayMaxParts));
}

absl::Status CheckDecay(const char* op, int64_t T, int nv, int64_t ld_a, int64_t ld_b) {
  if (T < 0 || nv <= 0 || nv > 65535 * 32) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": tokens ", T, ", nv ", nv));
  }
  return CheckStrides(op, nv, {{"ld_a", ld_a}, {"ld_b", ld_b}});
}

template <typename TP>
absl::Status DecayBetaForwardImpl(const bf16* a, int64_t ld_a, const bf16* b, int64_t ld_b, const TP* A_log,
                                  const TP* dt_bias, int64_t T, int nv, float* g, float* beta, cudaStream_t stream) {
  absl::Status s = CheckDecay("GdnDecayBetaForward", T, nv, ld_a, ld_b);
  if (!s.ok()) return s;
  if (T == 0) return absl::OkStatus();
  DecayBetaForwardKernel<TP>
      <<<GridFor(T * nv, 256), 256, 0, stream>>>(a, ld_a, b, ld_b, A_log, dt_bias, T, nv, g, beta);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

template <typename TP, typename TD>
absl::Status DecayBetaBackwardImpl(const float* dg, const float* dbeta, const bf16* a, int64_t ld_a, const bf16* b,
                                   int64_t ld_b, const TP* A_log, const TP* dt_bias, int64_t T, int nv, TD* da,
                                   int64_t ld_da, TD* db, int64_t ld_db, float* dA_log, float* ddt_bias, float* ws,
                                   cudaStream_t stream) {
  const char* op = "GdnDecayBetaBackward";
  const absl::Status s =
      FirstError({CheckDecay(op, T, nv, ld_a, ld_b), CheckStrides(op, nv, {{"ld_da", ld_da}, {"ld_db", ld_db}})});
  if (!s.ok()) return s;
  if ((dA_log == nullptr) != (ddt_bias == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": dA_log and ddt_bias must both be set or both be null"));
  }
  if (T == 0) return absl::OkStatus();
  const int64_t parts = DecayParts(T);
  const bool with_params = dA_log != nullptr;
  const dim3 grid(static_cast<unsigned>(parts), static_cast<unsigned>((nv + 31) / 32));
  DecayBetaBackwardKernel<TP, TD><<<grid, dim3(32, kDecayRows), 0, stream>>>(
      dg, dbeta, a, ld_a, b, ld_b, A_log, dt_bias, T, nv, da, ld_da, db, ld_db, with_params ? ws : nullptr);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (with_params) {
    ReducePartialsKernel<<<(2 * nv + 31) / 32, 1024, 0, stream>>>(ws, parts, 2 * static_cast<int64_t>(nv), nv, dA_log,
                                                                  ddt_bias);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  return absl::OkStatus();
}

// =====================================================================================================
// 5. Attention output gate: element-wise over [T, heads·hd] in groups of V = 8 (16-byte accesses)
// when hd and the strides allow, else V = 1; a group never straddles a head.
template <int V>
__global__ void AttnGateForwardKernel(const bf16* __restrict__ attn, const bf16* __restrict__ qp, int64_t ld_qp,
                                      int64_t T, int heads, int hd, bf16* __restrict__ out) {
  const int64_t width = static_cast<int64_t>(heads) * hd;
  const int64_t groups = T * width / V;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = gi * V, t = e / width, col = e - t * width, h = col / hd, i = col - h * hd;
    float av[V], gv[V];
    LoadV<V>(attn + e, av);
    LoadV<V>(qp + t * ld_qp + h * 2 * hd + hd + i, gv);
#pragma unroll
    for (int k = 0; k < V; ++k) av[k] *= Sigmoid(gv[k]);
    StoreV<V>(out + e, av);
  }
}

// dout and dattn are not __restrict__: dattn may alias dout.
template <int V>
__global__ void AttnGateBackwardKernel(const bf16* dout, const bf16* __restrict__ attn, const bf16* __restrict__ qp,
                                       int64_t ld_qp, int64_t T, int heads, int hd, bf16* dattn, bf16* __restrict__ dqp,
                                       int64_t ld_dqp) {
  const int64_t width = static_cast<int64_t>(heads) * hd;
  const int64_t groups = T * width / V;
  for (int64_t gi = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; gi < groups;
       gi += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = gi * V, t = e / width, col = e - t * width, h = col / hd, i = col - h * hd;
    float dv[V], av[V], gv[V], dgate[V];
    LoadV<V>(dout + e, dv);
    LoadV<V>(attn + e, av);
    LoadV<V>(qp + t * ld_qp + h * 2 * hd + hd + i, gv);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      const float s = Sigmoid(gv[k]);
      dgate[k] = dv[k] * av[k] * s * (1.0f - s);
      dv[k] *= s;
    }
    StoreV<V>(dattn + e, dv);
    StoreV<V>(dqp + t * ld_dqp + h * 2 * hd + hd + i, dgate);
  }
}

absl::Status CheckGate(const char* op, int64_t T, int heads, int hd, std::initializer_list<RowStride> strides) {
  if (T < 0 || heads <= 0 || hd <= 0) {
    return absl::InvalidArgumentError(absl::StrCat(op, ": tokens ", T, ", heads ", heads, ", head_dim ", hd));
  }
  return CheckStrides(op, 2 * static_cast<int64_t>(heads) * hd, strides);
}

}  // namespace

// ---- 2. L2 norm launchers
absl::Status L2NormHeadsForward(const bf16* x, int64_t ld_x, int64_t tokens, int heads, int head_dim, float eps,
                                bf16* y, int64_t ld_y, cudaStream_t stream) {
  return L2NormForwardImpl(x, ld_x, tokens, heads, head_dim, eps, y, ld_y, stream);
}
absl::Status L2NormHeadsForward(const bf16* x, int64_t ld_x, int64_t tokens, int heads, int head_dim, float eps,
                                float* y, int64_t ld_y, cudaStream_t stream) {
  return L2NormForwardImpl(x, ld_x, tokens, heads, head_dim, eps, y, ld_y, stream);
}

absl::Status L2NormHeadsBackward(const float* dy, int64_t ld_dy, const bf16* x, int64_t ld_x, int64_t tokens, int heads,
                                 int head_dim, float eps, float* dx, int64_t ld_dx, cudaStream_t stream) {
  const char* op = "L2NormHeadsBackward";
  const int64_t width = static_cast<int64_t>(heads) * head_dim;
  const absl::Status s = FirstError({CheckHeads(op, tokens, heads, head_dim),
                                     CheckStrides(op, width, {{"ld_dy", ld_dy}, {"ld_x", ld_x}, {"ld_dx", ld_dx}})});
  if (!s.ok()) return s;
  if (tokens == 0) return absl::OkStatus();
  const int grid = RowGrid(tokens * heads);
  if (Divisible({head_dim, ld_dy, ld_x, ld_dx}, 4) && Aligned(dy, 4) && Aligned(x, 4) && Aligned(dx, 4)) {
    L2NormBackwardKernel<4>
        <<<grid, kRowThreads, 0, stream>>>(dy, ld_dy, x, ld_x, tokens, heads, head_dim, eps, dx, ld_dx);
  } else {
    L2NormBackwardKernel<1>
        <<<grid, kRowThreads, 0, stream>>>(dy, ld_dy, x, ld_x, tokens, heads, head_dim, eps, dx, ld_dx);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

// ---- 3. Decay / beta launchers
absl::Status GdnDecayBetaForward(const bf16* a, int64_t ld_a, const bf16* b, int64_t ld_b, const float* A_log,
                                 const float* dt_bias, int64_t tokens, int nv, float* g, float* beta,
                                 cudaStream_t stream) {
  return DecayBetaForwardImpl(a, ld_a, b, ld_b, A_log, dt_bias, tokens, nv, g, beta, stream);
}
absl::Status GdnDecayBetaForward(const bf16* a, int64_t ld_a, const bf16* b, int64_t ld_b, const bf16* A_log,
                                 const bf16* dt_bias, int64_t tokens, int nv, float* g, float* beta,
                                 cudaStream_t stream) {
  return DecayBetaForwardImpl(a, ld_a, b, ld_b, A_log, dt_bias, tokens, nv, g, beta, stream);
}

int64_t GdnDecayBetaBackwardWorkspaceNumel(int64_t tokens, int nv) { return DecayParts(tokens) * 2 * nv; }

absl::Status GdnDecayBetaBackward(const float* dg, const float* dbeta, const bf16* a, int64_t ld_a, const bf16* b,
                                  int64_t ld_b, const float* A_log, const float* dt_bias, int64_t tokens, int nv,
                                  bf16* da, int64_t ld_da, bf16* db, int64_t ld_db, float* dA_log, float* ddt_bias,
                                  float* ws, cudaStream_t stream) {
  return DecayBetaBackwardImpl(dg, dbeta, a, ld_a, b, ld_b, A_log, dt_bias, tokens, nv, da, ld_da, db, ld_db, dA_log,
                               ddt_bias, ws, stream);
}
absl::Status GdnDecayBetaBackward(const float* dg, const float* dbeta, const bf16* a, int64_t ld_a, const bf16* b,
                                  int64_t ld_b, const float* A_log, const float* dt_bias, int64_t tokens, int nv,
                                  float* da, int64_t ld_da, float* db, int64_t ld_db, float* dA_log, float* ddt_bias,
                                  float* ws, cudaStream_t stream) {
  return DecayBetaBackwardImpl(dg, dbeta, a, ld_a, b, ld_b, A_log, dt_bias, tokens, nv, da, ld_da, db, ld_db, dA_log,
                               ddt_bias, ws, stream);
}
absl::Status GdnDecayBetaBackward(const float* dg, const float* dbeta, const bf16* a, int64_t ld_a, const bf16* b,
                                  int64_t ld_b, const bf16* A_log, const bf16* dt_bias, int64_t tokens, int nv,
                                  bf16* da, int64_t ld_da, bf16* db, int64_t ld_db, float* dA_log, float* ddt_bias,
                                  float* ws, cudaStream_t stream) {
  return DecayBetaBackwardImpl(dg, dbeta, a, ld_a, b, ld_b, A_log, dt_bias, tokens, nv, da, ld_da, db, ld_db, dA_log,
                               ddt_bias, ws, stream);
}

// ---- 4. Gated RMSNorm launchers
absl::Status GatedRmsNormForward(const bf16* o, int64_t ld_o, const bf16* z, int64_t ld_z, const bf16* w,
                                 int64_t tokens, int heads, int head_dim, float eps, bf16* y, int64_t ld_y,
                                 cudaStream_t stream) {
  return GatedRmsNormForwardImpl(o, ld_o, z, ld_z, w, tokens, heads, head_dim, eps, y, ld_y, stream);
}
absl::Status GatedRmsNormForward(const bf16* o, int64_t ld_o, const bf16* z, int64_t ld_z, const float* w,
                                 int64_t tokens, int heads, int head_dim, float eps, bf16* y, int64_t ld_y,
                                 cudaStream_t stream) {
  return GatedRmsNormForwardImpl(o, ld_o, z, ld_z, w, tokens, heads, head_dim, eps, y, ld_y, stream);
}

int64_t GatedRmsNormBackwardWorkspaceNumel(int64_t tokens, int heads, int head_dim) {
  return GatedRmsNormParts(tokens, heads) * head_dim;
}

absl::Status GatedRmsNormBackward(const bf16* dy, int64_t ld_dy, const bf16* o, int64_t ld_o, const bf16* z,
                                  int64_t ld_z, const bf16* w, int64_t tokens, int heads, int head_dim, float eps,
                                  float* d_o, int64_t ld_do, bf16* dz, int64_t ld_dz, float* dw, float* ws,
                                  cudaStream_t stream) {
  return GatedRmsNormBackwardImpl(dy, ld_dy, o, ld_o, z, ld_z, w, tokens, heads, head_dim, eps, d_o, ld_do, dz, ld_dz,
                                  dw, ws, stream);
}
absl::Status GatedRmsNormBackward(const bf16* dy, int64_t ld_dy, const bf16* o, int64_t ld_o, const bf16* z,
                                  int64_t ld_z, const float* w, int64_t tokens, int heads, int head_dim, float eps,
                                  float* d_o, int64_t ld_do, bf16* dz, int64_t ld_dz, float* dw, float* ws,
                                  cudaStream_t stream) {
  return GatedRmsNormBackwardImpl(dy, ld_dy, o, ld_o, z, ld_z, w, tokens, heads, head_dim, eps, d_o, ld_do, dz, ld_dz,
                                  dw, ws, stream);
}

// ---- 5. Attention output gate launchers
absl::Status AttnOutputGateForward(const bf16* attn, const bf16* qp, int64_t ld_qp, int64_t tokens, int heads,
                                   int head_dim, bf16* out, cudaStream_t stream) {
  const absl::Status s = CheckGate("AttnOutputGateForward", tokens, heads, head_dim, {{"ld_qp", ld_qp}});
  if (!s.ok()) return s;
  if (tokens == 0) return absl::OkStatus();
  const int64_t n = tokens * heads * head_dim;
  if (Divisible({head_dim, ld_qp}, 8) && Aligned(attn, 8) && Aligned(qp, 8) && Aligned(out, 8)) {
    AttnGateForwardKernel<8><<<GridFor(n / 8, 256), 256, 0, stream>>>(attn, qp, ld_qp, tokens, heads, head_dim, out);
  } else {
    AttnGateForwardKernel<1><<<GridFor(n, 256), 256, 0, stream>>>(attn, qp, ld_qp, tokens, heads, head_dim, out);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status AttnOutputGateBackward(const bf16* dout, const bf16* attn, const bf16* qp, int64_t ld_qp, int64_t tokens,
                                    int heads, int head_dim, bf16* dattn, bf16* dqp, int64_t ld_dqp,
                                    cudaStream_t stream) {
  const char* op = "AttnOutputGateBackward";
  const absl::Status s = CheckGate(op, tokens, heads, head_dim, {{"ld_qp", ld_qp}, {"ld_dqp", ld_dqp}});
  if (!s.ok()) return s;
  if (tokens == 0) return absl::OkStatus();
  const int64_t n = tokens * heads * head_dim;
  if (Divisible({head_dim, ld_qp, ld_dqp}, 8) && Aligned(dout, 8) && Aligned(attn, 8) && Aligned(qp, 8) &&
      Aligned(dattn, 8) && Aligned(dqp, 8)) {
    AttnGateBackwardKernel<8>
        <<<GridFor(n / 8, 256), 256, 0, stream>>>(dout, attn, qp, ld_qp, tokens, heads, head_dim, dattn, dqp, ld_dqp);
  } else {
    AttnGateBackwardKernel<1>
        <<<GridFor(n, 256), 256, 0, stream>>>(dout, attn, qp, ld_qp, tokens, heads, head_dim, dattn, dqp, ld_dqp);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
