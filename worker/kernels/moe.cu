// MoE block kernels; see moe.h. None is on the critical path next to the experts' GEMMs (per
// layer and token they move O(k * hidden) bytes, where the GEMMs do O(k * hidden * moe_inter)
// FLOPs): the router kernels are latency-bound (a warp per token, E <= kMoeMaxExperts), the
// gather, combine and scatter-add memory-bound (their ceiling is device copy bandwidth over the
// bytes each reads and writes once; not yet measured on the H200), and the permutation's serial
// placement walks 64 tokens per block (k * 64 shared-memory steps). Deterministic throughout: fixed
// reduction orders, integer atomics only.
#include "worker/kernels/moe.h"

#include <cub/block/block_scan.cuh>

#include <algorithm>
#include <climits>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/kernels/common.cuh"
#include "worker/kernels/cuda_check.h"

namespace slidedp::kernels {
using namespace internal;  // common.cuh

namespace {

constexpr int kRouterWarps = 4;           // tokens per block of the router kernels (a warp each)
constexpr int64_t kPermChunkTokens = 64;  // tokens whose rows one block places, in token order
constexpr int kPermScanThreads = 256;
constexpr int64_t kProbSumChunkTokens = 256;
constexpr int kNoIndex = INT_MAX;
constexpr float kTaken = -1.0f;  // a probability already selected (probabilities are >= 0)

// std::min takes references, which device code cannot form to the host constants above.
__host__ __device__ __forceinline__ int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float WarpMax(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Arg-max order of the top-k: the larger value first, equal values (or values that do not compare,
// NaN) the lower index first; kNoIndex (nothing) last.
__device__ __forceinline__ bool Beats(float av, int ai, float bv, int bi) {
  if (ai == kNoIndex) return false;
  if (bi == kNoIndex) return true;
  if (av > bv) return true;
  if (bv > av) return false;
  return ai < bi;
}

// ---- Router: softmax and top-k, a warp per token, its row in shared memory.
__global__ void RouteTopKKernel(const bf16* __restrict__ logits, int64_t ld, int64_t tokens, int experts, int top_k,
                                bool renormalize, float* __restrict__ probs, int32_t* __restrict__ topk_expert,
                                float* __restrict__ topk_weight) {
  extern __shared__ float router_rows[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouterWarps) + warp;
  if (t >= tokens) return;  // whole warps leave; only __syncwarp below
  float* p = router_rows + warp * experts;
  const bf16* z = logits + t * ld;
  float mx = -INFINITY;
  for (int e = lane; e < experts; e += 32) {
    const float v = __bfloat162float(z[e]);
    p[e] = v;
    mx = fmaxf(mx, v);
  }
  mx = WarpMax(mx);
  float sum = 0.0f;
  for (int e = lane; e < experts; e += 32) {
    const float x = expf(p[e] - mx);
    p[e] = x;
    sum += x;
  }
  sum = WarpSum(sum);
  float* prow = probs + t * experts;
  for (int e = lane; e < experts; e += 32) {
    const float q = p[e] / sum;
    p[e] = q;
    prow[e] = q;
  }
  __syncwarp();
  int32_t* sel = topk_expert + t * top_k;
  float* w = topk_weight + t * top_k;
  for (int j = 0; j < top_k; ++j) {
    float bv = 0.0f;
    int bi = kNoIndex;
    for (int e = lane; e < experts; e += 32) {  // ascending e: a lane keeps its lowest index on ties
      const float v = p[e];
      if (v != kTaken && Beats(v, e, bv, bi)) bv = v, bi = e;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
      const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
      if (Beats(ov, oi, bv, bi)) bv = ov, bi = oi;
    }
    // Lane 0's pick for all (with finite values every lane has the same one).
    bi = __shfl_sync(0xffffffffu, bi, 0);
    bv = __shfl_sync(0xffffffffu, bv, 0);
    if (lane == 0) {
      sel[j] = bi;
      w[j] = bv;
    }
    if (lane == (bi & 31)) p[bi] = kTaken;
    __syncwarp();
  }
  if (renormalize && lane == 0) {  // the reference's SelectedProbSum: slot order
    float s = 0.0f;
    for (int j = 0; j < top_k; ++j) s += w[j];
    for (int j = 0; j < top_k; ++j) w[j] = w[j] / s;
  }
}

__global__ void RouterBackwardKernel(const float* __restrict__ probs, const int32_t* __restrict__ topk_expert,
                                     const float* __restrict__ topk_weight, const float* __restrict__ dweight,
                                     const double* __restrict__ aux, int64_t tokens, int experts, int top_k,
                                     bool renormalize, bf16* __restrict__ dlogits, int64_t ld) {
  extern __shared__ float router_rows[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = blockIdx.x * static_cast<int64_t>(kRouterWarps) + warp;
  if (t >= tokens) return;
  float* dp = router_rows + warp * experts;
  const float* p = probs + t * experts;
  for (int e = lane; e < experts; e += 32) dp[e] = aux != nullptr ? static_cast<float>(aux[e]) : 0.0f;
  __syncwarp();
  if (lane == 0) {  // k terms, serial in slot order as the reference
    const int32_t* sel = topk_expert + t * top_k;
    const float* w = topk_weight + t * top_k;
    const float* dw = dweight + t * top_k;
    if (renormalize) {
      float s = 0.0f, dw_dot_w = 0.0f;
      for (int j = 0; j < top_k; ++j) s += p[sel[j]];
      for (int j = 0; j < top_k; ++j) dw_dot_w += dw[j] * w[j];
      for (int j = 0; j < top_k; ++j) dp[sel[j]] += (dw[j] - dw_dot_w) / s;
    } else {
      for (int j = 0; j < top_k; ++j) dp[sel[j]] += dw[j];
    }
  }
  __syncwarp();
  float pd = 0.0f;
  for (int e = lane; e < experts; e += 32) pd += p[e] * dp[e];
  pd = WarpSum(pd);
  bf16* dz = dlogits + t * ld;
  for (int e = lane; e < experts; e += 32) dz[e] = __float2bfloat16(p[e] * (dp[e] - pd));
}

// ---- Permutation: per-chunk counts, a prefix over chunks per expert, expert offsets, placement.
__global__ void PermCountKernel(const int32_t* __restrict__ topk_expert, int64_t tokens, int top_k, int experts,
                                int32_t* __restrict__ chunk_counts) {
  extern __shared__ int32_t hist[];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  const int64_t t0 = blockIdx.x * kPermChunkTokens;
  const int64_t n = MinI64(kPermChunkTokens, tokens - t0) * top_k;
  const int32_t* sel = topk_expert + t0 * top_k;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) atomicAdd(&hist[sel[i]], 1);  // integer: order-free
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    chunk_counts[blockIdx.x * static_cast<int64_t>(experts) + e] = hist[e];
}

// Block e: chunk_counts[:, e] becomes its exclusive prefix over the chunks; counts[e] the total.
__global__ void PermScanChunksKernel(int32_t* __restrict__ chunk_counts, int64_t chunks, int experts,
                                     int32_t* __restrict__ counts) {
  using Scan = cub::BlockScan<int32_t, kPermScanThreads>;
  __shared__ typename Scan::TempStorage tmp;
  const int e = blockIdx.x;
  int32_t carry = 0;
  for (int64_t c0 = 0; c0 < chunks; c0 += kPermScanThreads) {
    const int64_t c = c0 + threadIdx.x;
    const int32_t v = c < chunks ? chunk_counts[c * experts + e] : 0;
    int32_t excl = 0, total = 0;
    Scan(tmp).ExclusiveSum(v, excl, total);
    if (c < chunks) chunk_counts[c * experts + e] = carry + excl;
    carry += total;
    __syncthreads();  // tmp is reused
  }
  if (threadIdx.x == 0) counts[e] = carry;
}

// E serial adds (E <= kMoeMaxExperts): one thread.
__global__ void PermOffsetsKernel(const int32_t* __restrict__ counts, int experts, int32_t* __restrict__ offsets) {
  int32_t run = 0;
  offsets[0] = 0;
  for (int e = 0; e < experts; ++e) {
    run += counts[e];
    offsets[e + 1] = run;
  }
}

__global__ void PermPlaceKernel(const int32_t* __restrict__ topk_expert, int64_t tokens, int top_k, int experts,
                                const int32_t* __restrict__ chunk_start, const int32_t* __restrict__ offsets,
                                int32_t* __restrict__ token_index, int32_t* __restrict__ slot_index,
                                int32_t* __restrict__ row_of_slot) {
  extern __shared__ int32_t cursor[];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    cursor[e] = offsets[e] + chunk_start[blockIdx.x * static_cast<int64_t>(experts) + e];
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  const int64_t t0 = blockIdx.x * kPermChunkTokens, t1 = MinI64(tokens, t0 + kPermChunkTokens);
  for (int64_t t = t0; t < t1; ++t) {  // token order: each expert's rows come out in token order
    for (int j = 0; j < top_k; ++j) {
      const int32_t r = cursor[topk_expert[t * top_k + j]]++;
      token_index[r] = static_cast<int32_t>(t);
      slot_index[r] = j;
      row_of_slot[t * top_k + j] = r;
    }
  }
}

// ---- Router statistics.
__global__ void ProbSumsPartialKernel(const float* __restrict__ probs, int64_t tokens, int experts,
                                      double* __restrict__ ws) {
  const int e = blockIdx.y * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  const int64_t t0 = blockIdx.x * kProbSumChunkTokens, t1 = MinI64(tokens, t0 + kProbSumChunkTokens);
  double s = 0.0;
  for (int64_t t = t0; t < t1; ++t) s += static_cast<double>(probs[t * experts + e]);
  ws[blockIdx.x * static_cast<int64_t>(experts) + e] = s;
}

__global__ void ProbSumsFinalKernel(const double* __restrict__ ws, int64_t chunks, int experts,
                                    double* __restrict__ out) {
  const int e = blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= experts) return;
  double s = 0.0;
  for (int64_t c = 0; c < chunks; ++c) s += ws[c * experts + e];
  out[e] = s;
}

// ---- Rows.
__global__ void GatherRows8Kernel(const bf16* __restrict__ x, const int32_t* __restrict__ index, int64_t rows,
                                  int64_t cols, bf16* __restrict__ out) {
  const int64_t vec_per_row = cols / 8, n = rows * vec_per_row;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / vec_per_row, c = (v % vec_per_row) * 8;
    *reinterpret_cast<uint4*>(out + r * cols + c) = *reinterpret_cast<const uint4*>(x + index[r] * cols + c);
  }
}

__global__ void GatherRows1Kernel(const bf16* __restrict__ x, const int32_t* __restrict__ index, int64_t rows,
                                  int64_t cols, bf16* __restrict__ out) {
  const int64_t n = rows * cols;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / cols, c = v % cols;
    out[v] = x[index[r] * cols + c];
  }
}

// A block per token: its k (row, weight) pairs sorted by row in shared memory, then the columns.
__global__ void CombineKernel(const bf16* __restrict__ expert_out, const int32_t* __restrict__ row_of_slot,
                              const float* __restrict__ topk_weight, int top_k, int64_t hidden,
                              float* __restrict__ out) {
  extern __shared__ int32_t combine_smem[];
  int32_t* rows = combine_smem;
  float* w = reinterpret_cast<float*>(combine_smem + top_k);
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {  // insertion sort of k rows (k is small)
    for (int j = 0; j < top_k; ++j) {
      const int32_t r = row_of_slot[t * top_k + j];
      const float wj = topk_weight[t * top_k + j];
      int q = j;
      for (; q > 0 && rows[q - 1] > r; --q) rows[q] = rows[q - 1], w[q] = w[q - 1];
      rows[q] = r;
      w[q] = wj;
    }
  }
  __syncthreads();
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    float acc = 0.0f;
    for (int q = 0; q < top_k; ++q) {
      acc = __fadd_rn(acc, __fmul_rn(__bfloat162float(expert_out[static_cast<int64_t>(rows[q]) * hidden + i]), w[q]));
    }
    out[t * hidden + i] = acc;
  }
}

// A block per grouped row.
__global__ void CombineBackwardKernel(const float* __restrict__ dout, const bf16* __restrict__ expert_out,
                                      const int32_t* __restrict__ token_index, const int32_t* __restrict__ slot_index,
                                      const float* __restrict__ topk_weight, int top_k, int64_t hidden,
                                      bf16* __restrict__ d_expert_out, float* __restrict__ dweight) {
  __shared__ float scratch[33];
  const int64_t r = blockIdx.x, t = token_index[r];
  const int j = slot_index[r];
  const float wt = topk_weight[t * top_k + j];
  const float* d = dout + t * hidden;
  const bf16* o = expert_out + r * hidden;
  bf16* g = d_expert_out + r * hidden;
  float acc = 0.0f;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    const float di = d[i];
    g[i] = __float2bfloat16(__fmul_rn(di, wt));
    acc = fmaf(di, __bfloat162float(o[i]), acc);
  }
  acc = BlockSum(acc, scratch);
  if (threadIdx.x == 0) dweight[t * top_k + j] = acc;
}

__global__ void ScatterAddRowsKernel(const float* __restrict__ src, const int32_t* __restrict__ index, int64_t rows,
                                     int64_t cols, float* __restrict__ dst) {
  const int64_t n = rows * cols;
  for (int64_t v = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; v < n;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = v / cols, c = v % cols;
    float* p = dst + static_cast<int64_t>(index[r]) * cols + c;
    *p = __fadd_rn(*p, src[v]);
  }
}

absl::Status CheckRouterSizes(const char* what, int64_t tokens, int64_t experts, int64_t top_k) {
  if (tokens < 0 || experts < 1 || experts > kMoeMaxExperts || top_k < 1 || top_k > experts) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": tokens ", tokens, ", experts ", experts, " (1..",
                                                   kMoeMaxExperts, "), top_k ", top_k, " (1..experts)"));
  }
  if (tokens * top_k > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, ": ", tokens, " tokens x top-", top_k, " grouped rows exceed the int32 row indices"));
  }
  return absl::OkStatus();
}

int64_t Chunks(int64_t n, int64_t chunk) { return (n + chunk - 1) / chunk; }

bool Aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

}  // namespace

absl::Status MoeRouteTopK(const bf16* logits, int64_t logits_ld, int64_t tokens, int64_t experts, int64_t top_k,
                          MoeTopKNorm norm, float* probs, int32_t* topk_expert, float* topk_weight,
                          cudaStream_t stream) {
  RETURN_IF_ERROR(CheckRouterSizes("MoeRouteTopK", tokens, experts, top_k));
  if (logits_ld < experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeRouteTopK: logits row stride ", logits_ld, " < experts ", experts));
  }
  if (tokens == 0) return absl::OkStatus();
  const int blocks = static_cast<int>(Chunks(tokens, kRouterWarps));
  const size_t smem = kRouterWarps * experts * sizeof(float);
  RouteTopKKernel<<<blocks, kRouterWarps * 32, smem, stream>>>(
      logits, logits_ld, tokens, static_cast<int>(experts), static_cast<int>(top_k), norm == MoeTopKNorm::kRenormalized,
      probs, topk_expert, topk_weight);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

int64_t MoePermutationWorkspaceNumel(int64_t tokens, int64_t experts) {
  return std::max<int64_t>(1, Chunks(tokens, kPermChunkTokens) * experts);
}

absl::Status MoeBuildPermutation(const int32_t* topk_expert, int64_t tokens, int64_t top_k, int64_t experts,
                                 int32_t* ws, int32_t* expert_counts, int32_t* expert_offsets, int32_t* token_index,
                                 int32_t* slot_index, int32_t* row_of_slot, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckRouterSizes("MoeBuildPermutation", tokens, experts, top_k));
  const int64_t chunks = Chunks(tokens, kPermChunkTokens);
  const int E = static_cast<int>(experts), k = static_cast<int>(top_k);
  const size_t smem = experts * sizeof(int32_t);
  if (chunks > 0) {
    PermCountKernel<<<static_cast<unsigned>(chunks), 256, smem, stream>>>(topk_expert, tokens, k, E, ws);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  PermScanChunksKernel<<<E, kPermScanThreads, 0, stream>>>(ws, chunks, E, expert_counts);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  PermOffsetsKernel<<<1, 1, 0, stream>>>(expert_counts, E, expert_offsets);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (chunks > 0) {
    PermPlaceKernel<<<static_cast<unsigned>(chunks), 128, smem, stream>>>(topk_expert, tokens, k, E, ws, expert_offsets,
                                                                          token_index, slot_index, row_of_slot);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  return absl::OkStatus();
}

int64_t MoeProbSumsWorkspaceNumel(int64_t tokens, int64_t experts) {
  return std::max<int64_t>(1, Chunks(tokens, kProbSumChunkTokens) * experts);
}

absl::Status MoeProbSums(const float* probs, int64_t tokens, int64_t experts, double* ws, double* prob_sums,
                         cudaStream_t stream) {
  RETURN_IF_ERROR(CheckRouterSizes("MoeProbSums", tokens, experts, 1));
  const int64_t chunks = Chunks(tokens, kProbSumChunkTokens);
  const int E = static_cast<int>(experts);
  const unsigned eblocks = static_cast<unsigned>(Chunks(experts, 128));
  if (chunks > 0) {
    ProbSumsPartialKernel<<<dim3(static_cast<unsigned>(chunks), eblocks), 128, 0, stream>>>(probs, tokens, E, ws);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  }
  ProbSumsFinalKernel<<<eblocks, 128, 0, stream>>>(ws, chunks, E, prob_sums);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status MoeGatherRows(const bf16* x, const int32_t* index, int64_t rows, int64_t cols, bf16* out,
                           cudaStream_t stream) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat("MoeGatherRows: rows ", rows, ", cols ", cols));
  }
  if (rows == 0 || cols == 0) return absl::OkStatus();
  if (cols % 8 == 0 && Aligned16(x) && Aligned16(out)) {
    GatherRows8Kernel<<<GridFor(rows * cols / 8, 256), 256, 0, stream>>>(x, index, rows, cols, out);
  } else {
    GatherRows1Kernel<<<GridFor(rows * cols, 256), 256, 0, stream>>>(x, index, rows, cols, out);
  }
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status MoeCombine(const bf16* expert_out, const int32_t* row_of_slot, const float* topk_weight, int64_t tokens,
                        int64_t top_k, int64_t hidden, float* out, cudaStream_t stream) {
  if (tokens < 0 || top_k < 1 || top_k > kMoeMaxExperts || hidden < 1 || tokens * top_k > INT32_MAX) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeCombine: tokens ", tokens, ", top_k ", top_k, ", hidden ", hidden));
  }
  if (tokens == 0) return absl::OkStatus();
  if (tokens > INT32_MAX) return absl::InvalidArgumentError("MoeCombine: more tokens than grid blocks");
  const size_t smem = top_k * (sizeof(int32_t) + sizeof(float));
  CombineKernel<<<static_cast<unsigned>(tokens), 128, smem, stream>>>(expert_out, row_of_slot, topk_weight,
                                                                      static_cast<int>(top_k), hidden, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status MoeCombineBackward(const float* dout, const bf16* expert_out, const int32_t* token_index,
                                const int32_t* slot_index, const float* topk_weight, int64_t rows, int64_t top_k,
                                int64_t hidden, bf16* d_expert_out, float* dweight, cudaStream_t stream) {
  if (rows < 0 || rows > INT32_MAX || top_k < 1 || hidden < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeCombineBackward: rows ", rows, ", top_k ", top_k, ", hidden ", hidden));
  }
  if (rows == 0) return absl::OkStatus();
  CombineBackwardKernel<<<static_cast<unsigned>(rows), 128, 0, stream>>>(
      dout, expert_out, token_index, slot_index, topk_weight, static_cast<int>(top_k), hidden, d_expert_out, dweight);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status MoeRouterBackward(const float* probs, const int32_t* topk_expert, const float* topk_weight,
                               const float* dweight, const double* aux_prob_grad, int64_t tokens, int64_t experts,
                               int64_t top_k, MoeTopKNorm norm, bf16* dlogits, int64_t dlogits_ld,
                               cudaStream_t stream) {
  RETURN_IF_ERROR(CheckRouterSizes("MoeRouterBackward", tokens, experts, top_k));
  if (dlogits_ld < experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("MoeRouterBackward: dlogits row stride ", dlogits_ld, " < experts ", experts));
  }
  if (tokens == 0) return absl::OkStatus();
  const int blocks = static_cast<int>(Chunks(tokens, kRouterWarps));
  const size_t smem = kRouterWarps * experts * sizeof(float);
  RouterBackwardKernel<<<blocks, kRouterWarps * 32, smem, stream>>>(
      probs, topk_expert, topk_weight, dweight, aux_prob_grad, tokens, static_cast<int>(experts),
      static_cast<int>(top_k), norm == MoeTopKNorm::kRenormalized, dlogits, dlogits_ld);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status MoeScatterAddRows(const float* src, const int32_t* index, int64_t rows, int64_t cols, float* dst,
                               cudaStream_t stream) {
  if (rows < 0 || cols < 0) {
    return absl::InvalidArgumentError(absl::StrCat("MoeScatterAddRows: rows ", rows, ", cols ", cols));
  }
  if (rows == 0 || cols == 0) return absl::OkStatus();
  ScatterAddRowsKernel<<<GridFor(rows * cols, 256), 256, 0, stream>>>(src, index, rows, cols, dst);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

}  // namespace slidedp::kernels
