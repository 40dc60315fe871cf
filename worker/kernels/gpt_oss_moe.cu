// GPT-OSS MoE block kernels; see gpt_oss_moe.h. As moe.cu's, none is on the critical path next to
// the experts' GEMMs: the router kernels are latency-bound (a warp per token), the SwiGLU, combine
// and bias kernels memory-bound (each reads and writes its rows once; the ceiling is device copy
// bandwidth, not yet measured on the H100/H200). The bias sums run over up to kBiasParts row groups
// per expert so that an expert with many rows still fills the GPU. Deterministic throughout: fixed
// reduction orders, no atomics.
#include "worker/kernels/gpt_oss_moe.h"

#include <algorithm>
#include <climits>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/moe.h"
#include "worker/kernels/reductions.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace {

constexpr int kRouterWarps = 4;      // tokens per block of the router kernels (a warp each)
constexpr int64_t kBiasParts = 128;  // row groups of the bias sums (partial rows before the reduce)
constexpr int kBiasThreads = 256;    // columns per block of the bias kernels
constexpr int kNoIndex = INT_MAX;
// The router's top-k marks taken experts in a per-lane bit mask: lane l holds experts l + 32 i.
static_assert(kMoeMaxExperts <= 64 * 32, "GptOssRouteKernel's taken mask holds 64 experts per lane");

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// The value rounded to BF16 (nearest even) and widened back: a BF16 tensor's FP32 view.
__device__ __forceinline__ float RoundBf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// Arg-max order of the top-k (moe.cu's): the larger value first, equal values (or values that do not
// compare, NaN) the lower index first; kNoIndex (nothing) last.
__device__ __forceinline__ bool Beats(float av, int ai, float bv, int bi) {
  if (ai == kNoIndex) return false;
  if (bi == kNoIndex) return true;
  if (av > bv) return true;
  if (bv > av) return false;
  return ai < bi;
}

// torch.clamp's forward: NaN passes through (the comparisons are false).
__device__ __forceinline__ float ClampMax(float x, float hi) { return x > hi ? hi : x; }
__device__ __forceinline__ float Clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
// torch.sigmoid's float kernel: 1 / (1 + exp(-x)) with the accurate expf.
__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// ---- Router: logits, full softmax, top-k of the logits and the softmax over those k; a warp per
// token, its logits row in shared memory.
__global__ void RouteKernel(const float* __restrict__ acc, int64_t ld, const bf16* __restrict__ bias, int64_t tokens,
                            int experts, int top_k, float* __restrict__ probs, int32_t* __restrict__ topk_expert,
                            float* __restrict__ topk_weight) {
  extern __shared__ float gpt_oss_router_rows[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouterWarps) + warp;
  if (t >= tokens) return;  // whole warps leave; only __syncwarp below
  float* z = gpt_oss_router_rows + warp * experts;
  const float* a = acc + t * ld;
  float mx = -INFINITY;
  for (int e = lane; e < experts; e += 32) {
    const float v = RoundBf16(__fadd_rn(a[e], __bfloat162float(bias[e])));  // F.linear's BF16 logits
    z[e] = v;
    mx = fmaxf(mx, v);
  }
  mx = WarpMax(mx);
  float sum = 0.0f;
  for (int e = lane; e < experts; e += 32) sum += expf(z[e] - mx);
  sum = WarpSum(sum);
  float* prow = probs + t * experts;
  for (int e = lane; e < experts; e += 32) prow[e] = expf(z[e] - mx) / sum;

  int32_t* sel = topk_expert + t * top_k;
  uint64_t taken = 0;  // bit i: expert lane + 32 i
  for (int j = 0; j < top_k; ++j) {
    float bv = 0.0f;
    int bi = kNoIndex;
    int i = 0;
    for (int e = lane; e < experts; e += 32, ++i) {  // ascending e: a lane keeps its lowest index on ties
      if (((taken >> i) & 1) == 0 && Beats(z[e], e, bv, bi)) bv = z[e], bi = e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (Beats(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    bi = __shfl_sync(0xffffffffu, bi, 0);  // lane 0's pick for all (NaN makes the order partial)
    if (lane == 0) sel[j] = bi;
    if (lane == (bi & 31)) taken |= uint64_t{1} << (bi >> 5);
  }
  __syncwarp();     // z of every lane, and sel, for lane 0
  if (lane == 0) {  // softmax(top_v, dtype=bf16): FP32 math over the k values, largest first, one rounding
    float* w = topk_weight + t * top_k;
    const float top = z[sel[0]];
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j) s += expf(z[sel[j]] - top);
    for (int j = 0; j < top_k; ++j) w[j] = RoundBf16(expf(z[sel[j]] - top) / s);
  }
}

__global__ void RouterBackwardKernel(const float* __restrict__ probs, const int32_t* __restrict__ topk_expert,
                                     const float* __restrict__ topk_weight, const float* __restrict__ dweight,
                                     const double* __restrict__ aux, int64_t tokens, int experts, int top_k,
                                     bf16* __restrict__ dlogits, int64_t ld) {
  extern __shared__ float gpt_oss_router_rows[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouterWarps) + warp;
  if (t >= tokens) return;
  float* dz = gpt_oss_router_rows + warp * experts;
  const float* p = probs + t * experts;
  if (aux != nullptr) {  // the aux loss through the full FP32 softmax, cast back to the BF16 logits
    float pa = 0.0f;
    for (int e = lane; e < experts; e += 32) pa += p[e] * static_cast<float>(aux[e]);
    pa = WarpSum(pa);
    for (int e = lane; e < experts; e += 32) dz[e] = RoundBf16(p[e] * (static_cast<float>(aux[e]) - pa));
  } else {
    for (int e = lane; e < experts; e += 32) dz[e] = 0.0f;
  }
  __syncwarp();
  if (lane == 0) {  // the BF16 softmax over the k values, serial in slot order
    const int32_t* sel = topk_expert + t * top_k;
    const float* w = topk_weight + t * top_k;
    const float* dw = dweight + t * top_k;
    float gw = 0.0f;
    for (int j = 0; j < top_k; ++j) gw += RoundBf16(dw[j]) * w[j];
    for (int j = 0; j < top_k; ++j) {
      const float r = RoundBf16(w[j] * (RoundBf16(dw[j]) - gw));
      dz[sel[j]] = RoundBf16(dz[sel[j]] + r);  // the two BF16 gradients of the logits, summed
    }
  }
  __syncwarp();
  bf16* out = dlogits + t * ld;
  for (int e = lane; e < experts; e += 32) out[e] = __float2bfloat16(dz[e]);  // exact: already BF16 values
}

// ---- Clamped SwiGLU on one expert's interleaved gate_up rows.
__global__ void GluForwardKernel(const bf16* __restrict__ gu, const bf16* __restrict__ bias, int64_t rows,
                                 int64_t inter, float alpha, float limit, bf16* __restrict__ act) {
  const int64_t n = rows * inter;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / inter, i = v % inter;
    const bf16* p = gu + r * 2 * inter + 2 * i;
    const float g = __fadd_rn(__bfloat162float(p[0]), __bfloat162float(bias[2 * i]));
    const float u = __fadd_rn(__bfloat162float(p[1]), __bfloat162float(bias[2 * i + 1]));
    const float gc = ClampMax(g, limit), uc = Clamp(u, -limit, limit);
    const float glu = __fmul_rn(gc, Sigmoid(__fmul_rn(gc, alpha)));
    act[v] = __float2bfloat16(__fmul_rn(__fadd_rn(uc, 1.0f), glu));
  }
}

// Thread: column pair i (gate 2i, up 2i + 1) over rows blockIdx.y, + gridDim.y, ...; its FP32 sums
// go to partial row blockIdx.y.
__global__ void GluBackwardKernel(const bf16* __restrict__ gu, const bf16* __restrict__ bias,
                                  const bf16* __restrict__ dact, int64_t rows, int64_t inter, float alpha, float limit,
                                  bf16* __restrict__ dgu, float* __restrict__ partial) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= inter) return;
  const float bg = __bfloat162float(bias[2 * i]), bu = __bfloat162float(bias[2 * i + 1]);
  float sum_g = 0.0f, sum_u = 0.0f;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const bf16* p = gu + r * 2 * inter + 2 * i;
    const float g = __fadd_rn(__bfloat162float(p[0]), bg);
    const float u = __fadd_rn(__bfloat162float(p[1]), bu);
    const float gc = ClampMax(g, limit), uc = Clamp(u, -limit, limit);
    const float s = Sigmoid(__fmul_rn(gc, alpha));
    const float glu = __fmul_rn(gc, s);
    const float d = __bfloat162float(dact[r * inter + i]);
    // Autograd's steps: m = (uc + 1) glu; glu = gc s; s = sigmoid(alpha gc); then the clamps' masks.
    const float dglu = d * (uc + 1.0f);
    const float dgc = dglu * s + dglu * gc * ((1.0f - s) * s) * alpha;
    const float dg = g <= limit ? dgc : 0.0f;
    const float du = u >= -limit && u <= limit ? d * glu : 0.0f;
    bf16* q = dgu + r * 2 * inter + 2 * i;
    q[0] = __float2bfloat16(dg);
    q[1] = __float2bfloat16(du);
    sum_g += dg;
    sum_u += du;
  }
  partial[blockIdx.y * 2 * inter + 2 * i] = sum_g;
  partial[blockIdx.y * 2 * inter + 2 * i + 1] = sum_u;
}

// ---- Combine: a block per token, its k (row, weight, expert) triples sorted by row in shared memory.
__global__ void CombineKernel(const bf16* __restrict__ expert_out, const int32_t* __restrict__ row_of_slot,
                              const int32_t* __restrict__ topk_expert, const float* __restrict__ topk_weight,
                              const bf16* __restrict__ down_bias, int64_t bias_stride, int top_k, int64_t hidden,
                              float* __restrict__ out) {
  extern __shared__ int32_t gpt_oss_combine_smem[];
  int32_t* rows = gpt_oss_combine_smem;
  int32_t* experts = rows + top_k;
  float* w = reinterpret_cast<float*>(experts + top_k);
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {  // insertion sort of k rows (k is small)
    for (int j = 0; j < top_k; ++j) {
      const int32_t r = row_of_slot[t * top_k + j], e = topk_expert[t * top_k + j];
      const float wj = topk_weight[t * top_k + j];
      int q = j;
      for (; q > 0 && rows[q - 1] > r; --q) rows[q] = rows[q - 1], experts[q] = experts[q - 1], w[q] = w[q - 1];
      rows[q] = r;
      experts[q] = e;
      w[q] = wj;
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float acc = 0.0f;
    for (int q = 0; q < top_k; ++q) {
      const float o = __bfloat162float(expert_out[static_cast<int64_t>(rows[q]) * hidden + i]);
      const float b = __bfloat162float(down_bias[experts[q] * bias_stride + i]);
      acc = __fadd_rn(acc, __fmul_rn(__fadd_rn(o, b), w[q]));
    }
    out[t * hidden + i] = acc;
  }
}

// A block per grouped row.
__global__ void CombineBackwardKernel(const float* __restrict__ dout, const bf16* __restrict__ expert_out,
                                      const int32_t* __restrict__ token_index, const int32_t* __restrict__ slot_index,
                                      const int32_t* __restrict__ topk_expert, const float* __restrict__ topk_weight,
                                      const bf16* __restrict__ down_bias, int64_t bias_stride, int top_k,
                                      int64_t hidden, bf16* __restrict__ d_expert_out, float* __restrict__ dweight) {
  __shared__ float scratch[33];
  const int64_t r = blockIdx.x, t = token_index[r];
  const int j = slot_index[r];
  const float wt = topk_weight[t * top_k + j];
  const float* d = dout + t * hidden;
  const bf16* o = expert_out + r * hidden;
  const bf16* b = down_bias + topk_expert[t * top_k + j] * bias_stride;
  bf16* g = d_expert_out + r * hidden;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float di = d[i];
    g[i] = __float2bfloat16(__fmul_rn(di, wt));
    acc = fmaf(di, __fadd_rn(__bfloat162float(o[i]), __bfloat162float(b[i])), acc);
  }
  acc = BlockSum(acc, scratch);
  if (threadIdx.x == 0) dweight[t * top_k + j] = acc;
}

// Thread: column c over the expert's rows blockIdx.y, + gridDim.y, ...; partial row blockIdx.y.
__global__ void DownBiasKernel(const float* __restrict__ dout, const int32_t* __restrict__ token_index,
                               const int32_t* __restrict__ slot_index, const float* __restrict__ topk_weight,
                               int64_t rows, int top_k, int64_t hidden, float* __restrict__ partial) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= hidden) return;
  float s = 0.0f;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t t = token_index[r];
    s += __fmul_rn(dout[t * hidden + c], topk_weight[t * top_k + slot_index[r]]);  // HF's FP32 d(out)
  }
  partial[blockIdx.y * hidden + c] = s;
}

absl::Status CheckRouterSizes(const char* what, int64_t tokens, int64_t experts, int64_t top_k, int64_t ld) {
  if (tokens < 0 || experts < 1 || experts > kMoeMaxExperts || top_k < 1 || top_k > experts || ld < experts) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tokens ", tokens, ", experts ", experts, " (1..",
                                                   kMoeMaxExperts, "), top_k ", top_k, " (1..experts), row stride ", ld,
                                                   " (>= experts)"));
  }
  if (tokens * top_k > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", tokens, " tokens x top-", top_k, " grouped rows exceed the int32 row indices"));
  }
  return absl::OkStatus();
}

int64_t Chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

int64_t BiasParts(int64_t rows) { return std::max<int64_t>(1, std::min(rows, kBiasParts)); }

// The grid of the bias kernels: column blocks by row groups.
dim3 BiasGrid(int64_t rows, int64_t cols) {
  return dim3(static_cast<unsigned>(Chunks(cols, kBiasThreads)), static_cast<unsigned>(BiasParts(rows)));
}

}  // namespace

absl::Status GptOssRouteTopK(const float* acc, int64_t acc_ld, const bf16* bias, int64_t tokens, int64_t experts,
                             int64_t top_k, float* probs, int32_t* topk_expert, float* topk_weight,
                             cudaStream_t stream) {
  RETURN_IF_ERROR(CheckRouterSizes("GptOssRouteTopK", tokens, experts, top_k, acc_ld));
  if (tokens == 0) return absl::OkStatus();
  const size_t smem = kRouterWarps * experts * sizeof(float);
  RouteKernel<<<static_cast<unsigned>(Chunks(tokens, kRouterWarps)), kRouterWarps * 32, smem, stream>>>(
      acc, acc_ld, bias, tokens, static_cast<int>(experts), static_cast<int>(top_k), probs, topk_expert, topk_weight);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status GptOssGluForward(const bf16* gu, const bf16* bias, int64_t rows, int64_t inter, GptOssGluParams glu,
                              bf16* act, cudaStream_t stream) {
  if (rows < 0 || inter < 1) {
    return absl::InvalidArgumentError(absl::StrCat("GptOssGluForward: rows ", rows, ", intermediate ", inter));
  }
  if (rows == 0) return absl::OkStatus();
  GluForwardKernel<<<GridFor(rows * inter, 256), 256, 0, stream>>>(gu, bias, rows, inter, glu.alpha, glu.limit, act);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

int64_t GptOssBiasWorkspaceNumel(int64_t rows, int64_t cols) { return BiasParts(rows) * std::max<int64_t>(1, cols); }

absl::Status GptOssGluBackward(const bf16* gu, const bf16* bias, const bf16* dact, int64_t rows, int64_t inter,
                               GptOssGluParams glu, bf16* dgu, float* ws, float* dbias, cudaStream_t stream) {
  if (rows < 0 || inter < 1) {
    return absl::InvalidArgumentError(absl::StrCat("GptOssGluBackward: rows ", rows, ", intermediate ", inter));
  }
  if (rows == 0) return absl::OkStatus();
  GluBackwardKernel<<<BiasGrid(rows, inter), kBiasThreads, 0, stream>>>(gu, bias, dact, rows, inter, glu.alpha,
                                                                        glu.limit, dgu, ws);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return ReducePartialsInto(ws, BiasParts(rows), 2 * inter, dbias, stream);
}

absl::Status GptOssCombine(const bf16* expert_out, const int32_t* row_of_slot, const int32_t* topk_expert,
                           const float* topk_weight, const bf16* down_bias, int64_t bias_stride, int64_t tokens,
                           int64_t top_k, int64_t hidden, float* out, cudaStream_t stream) {
  if (tokens < 0 || tokens > INT32_MAX || top_k < 1 || top_k > kMoeMaxExperts || hidden < 1 ||
      tokens * top_k > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("GptOssCombine: tokens ", tokens, ", top_k ", top_k, ", hidden ", hidden));
  }
  if (tokens == 0) return absl::OkStatus();
  const size_t smem = top_k * (2 * sizeof(int32_t) + sizeof(float));
  CombineKernel<<<static_cast<unsigned>(tokens), 128, smem, stream>>>(
      expert_out, row_of_slot, topk_expert, topk_weight, down_bias, bias_stride, static_cast<int>(top_k), hidden, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status GptOssCombineBackward(const float* dout, const bf16* expert_out, const int32_t* token_index,
                                   const int32_t* slot_index, const int32_t* topk_expert, const float* topk_weight,
                                   const bf16* down_bias, int64_t bias_stride, int64_t rows, int64_t top_k,
                                   int64_t hidden, bf16* d_expert_out, float* dweight, cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX || top_k < 1 || hidden < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("GptOssCombineBackward: rows ", rows, ", top_k ", top_k, ", hidden ", hidden));
  }
  if (rows == 0) return absl::OkStatus();
  CombineBackwardKernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      dout, expert_out, token_index, slot_index, topk_expert, topk_weight, down_bias, bias_stride,
      static_cast<int>(top_k), hidden, d_expert_out, dweight);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status GptOssDownBiasBackward(const float* dout, const int32_t* token_index, const int32_t* slot_index,
                                    const float* topk_weight, int64_t rows, int64_t top_k, int64_t hidden, float* ws,
                                    float* dbias, cudaStream_t stream) {
  if (rows < 0 || top_k < 1 || hidden < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("GptOssDownBiasBackward: rows ", rows, ", top_k ", top_k, ", hidden ", hidden));
  }
  if (rows == 0) return absl::OkStatus();
  DownBiasKernel<<<BiasGrid(rows, hidden), kBiasThreads, 0, stream>>>(dout, token_index, slot_index, topk_weight, rows,
                                                                      static_cast<int>(top_k), hidden, ws);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return ReducePartialsInto(ws, BiasParts(rows), hidden, dbias, stream);
}

absl::Status GptOssRouterBackward(const float* probs, const int32_t* topk_expert, const float* topk_weight,
                                  const float* dweight, const double* aux_prob_grad, int64_t tokens, int64_t experts,
                                  int64_t top_k, bf16* dlogits, int64_t dlogits_ld, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckRouterSizes("GptOssRouterBackward", tokens, experts, top_k, dlogits_ld));
  if (tokens == 0) return absl::OkStatus();
  const size_t smem = kRouterWarps * experts * sizeof(float);
  RouterBackwardKernel<<<static_cast<unsigned>(Chunks(tokens, kRouterWarps)), kRouterWarps * 32, smem, stream>>>(
      probs, topk_expert, topk_weight, dweight, aux_prob_grad, tokens, static_cast<int>(experts),
      static_cast<int>(top_k), dlogits, dlogits_ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
