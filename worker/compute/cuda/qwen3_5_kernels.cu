// The recurrent gated delta rule and the shared-expert gate of the CUDA backend's Qwen3.5 layer; see
// qwen3_5_kernels.h. The recurrence is latency-bound (one dependent step per token, a thread's dk
// multiply-adds per step), which is why the chunked kernels exist; it runs only where they refuse
// the head dims. The gate kernels are memory-bound element- and row-wise passes.
#include "worker/compute/cuda/qwen3_5_kernels.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/reductions.h"

namespace slidedp::cuda_backend_internal {
namespace {

constexpr int kMaxWarps = 4;  // dv <= 128: one thread per state column

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float Sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

int64_t AlignUp(int64_t b) { return (b + 255) / 256 * 256; }

// One block per (document, value head): thread j keeps column j of the dk x dv state S in registers
// (kDk >= dk rows, unrolled). Per token: S = exp(g) S; u = beta (v - Sᵀk); S += k uᵀ; o = Sᵀ(scale q).
// states (may be null): every token's S after its update, [T, nv, dk, dv] FP32, for the backward.
template <int kDk>
__global__ void __launch_bounds__(128)
    RecurrentForwardKernel(kernels::GatedDeltaArgs a, const bf16* q, const bf16* k, const bf16* v, const float* g,
                           const float* beta, bf16* o, float* states) {
  const int doc = blockIdx.x, h = blockIdx.y, j = threadIdx.x;
  const int nk = a.num_k_heads, nv = a.num_v_heads, dk = a.k_dim, dv = a.v_dim;
  const int kh = h / (nv / nk);
  const int64_t t0 = a.cu_seqlens[doc], t1 = a.cu_seqlens[doc + 1];
  __shared__ float sk[kDk], sq[kDk];
  float S[kDk];
#pragma unroll
  for (int i = 0; i < kDk; ++i) S[i] = 0.0f;
  for (int64_t t = t0; t < t1; ++t) {
    __syncthreads();  // the previous token's sk / sq are read
    for (int i = j; i < dk; i += blockDim.x) {
      sk[i] = __bfloat162float(k[(t * nk + kh) * dk + i]);
      sq[i] = __bfloat162float(q[(t * nk + kh) * dk + i]) * a.scale;
    }
    __syncthreads();
    if (j >= dv) continue;
    const float decay = expf(g[t * nv + h]), b = beta[t * nv + h];
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kDk; ++i) {
      if (i < dk) {
        S[i] *= decay;
        kv += S[i] * sk[i];
      }
    }
    const float u = b * (__bfloat162float(v[(t * nv + h) * dv + j]) - kv);
    float out = 0.0f;
#pragma unroll
    for (int i = 0; i < kDk; ++i) {
      if (i < dk) {
        S[i] += sk[i] * u;
        out += S[i] * sq[i];
      }
    }
    if (o != nullptr) o[(t * nv + h) * dv + j] = __float2bfloat16_rn(out);
    if (states != nullptr) {
      float* st = states + (t * nv + h) * static_cast<int64_t>(dk) * dv + j;
#pragma unroll
      for (int i = 0; i < kDk; ++i) {
        if (i < dk) st[static_cast<int64_t>(i) * dv] = S[i];
      }
    }
  }
}

// The reverse-time adjoint of the recurrence, per (document, value head), with S_t read from the
// forward's stored states. Per token, dS the adjoint of S_t (zero after the document's last token):
//   dS += q~ doᵀ;  dq~ = S_t do;  du = dSᵀk;  dk = dS u;  dv = beta du;  dbeta = du·(v − S'ᵀk);
//   dkv = −beta du;  dS' = dS + k dkvᵀ;  dk += S' dkv;  dg = <S', dS'>;  dS = exp(g) dS'
// with S' = exp(g) S_{t-1}. dq, dk are per value head here (dq_part, dk_part [T, nv, dk]); the key
// head's sum is GroupSumKernel's. Cross-thread sums: a warp reduction per row, warps added in order.
template <int kDk>
__global__ void __launch_bounds__(128)
    RecurrentBackwardKernel(kernels::GatedDeltaArgs a, const bf16* q, const bf16* k, const bf16* v, const float* g,
                            const float* beta, const bf16* d_o, const float* states, float* dq_part, float* dk_part,
                            float* dv_out, float* dg, float* dbeta) {
  const int doc = blockIdx.x, h = blockIdx.y, j = threadIdx.x, lane = j & 31, warp = j >> 5;
  const int warps = blockDim.x / 32;
  const int nk = a.num_k_heads, nv = a.num_v_heads, dk = a.k_dim, dv = a.v_dim;
  const int kh = h / (nv / nk);
  const int64_t t0 = a.cu_seqlens[doc], t1 = a.cu_seqlens[doc + 1];
  const int64_t state_numel = static_cast<int64_t>(dk) * dv;
  __shared__ float sk[kDk], sq[kDk];
  __shared__ float red_q[kMaxWarps][kDk], red_k[kMaxWarps][kDk], red_s[kMaxWarps][2];
  const bool on = j < dv;
  float dS[kDk];
#pragma unroll
  for (int i = 0; i < kDk; ++i) dS[i] = 0.0f;
  for (int64_t t = t1 - 1; t >= t0; --t) {
    __syncthreads();  // the previous step's shared reads are done
    for (int i = j; i < dk; i += blockDim.x) {
      sk[i] = __bfloat162float(k[(t * nk + kh) * dk + i]);
      sq[i] = __bfloat162float(q[(t * nk + kh) * dk + i]) * a.scale;
    }
    __syncthreads();
    const float decay = expf(g[t * nv + h]), b = beta[t * nv + h];
    const float do_j = on ? __bfloat162float(d_o[(t * nv + h) * dv + j]) : 0.0f;
    const float v_j = on ? __bfloat162float(v[(t * nv + h) * dv + j]) : 0.0f;
    const float* st = states + (t * nv + h) * state_numel + j;
    const float* prev = t > t0 ? states + ((t - 1) * nv + h) * state_numel + j : nullptr;
    float Sp[kDk];
    float kv = 0.0f;
#pragma unroll
    for (int i = 0; i < kDk; ++i) {
      Sp[i] = 0.0f;
      if (i < dk) {
        if (on && prev != nullptr) Sp[i] = decay * prev[static_cast<int64_t>(i) * dv];
        kv += Sp[i] * sk[i];
      }
    }
    const float u = b * (v_j - kv);
#pragma unroll
    for (int i = 0; i < kDk; ++i) {
      if (i < dk) {
        float c = on ? st[static_cast<int64_t>(i) * dv] * do_j : 0.0f;
        c = WarpSum(c);
        if (lane == 0) red_q[warp][i] = c;
        dS[i] += sq[i] * do_j;
      }
    }
    float du = 0.0f;
#pragma unroll
    for (int i = 0; i < kDk; ++i) {
      if (i < dk) du += dS[i] * sk[i];
    }
    const float dkv = -b * du;
    float dbeta_c = du * (v_j - kv), dg_c = 0.0f;
#pragma unroll
    for (int i = 0; i < kDk; ++i) {
      if (i < dk) {
        const float dsp = dS[i] + sk[i] * dkv;
        float c = dS[i] * u + Sp[i] * dkv;
        c = WarpSum(c);
        if (lane == 0) red_k[warp][i] = c;
        dg_c += Sp[i] * dsp;
        dS[i] = decay * dsp;
      }
    }
    if (on) dv_out[(t * nv + h) * dv + j] = b * du;
    dbeta_c = WarpSum(on ? dbeta_c : 0.0f);
    dg_c = WarpSum(on ? dg_c : 0.0f);
    if (lane == 0) {
      red_s[warp][0] = dbeta_c;
      red_s[warp][1] = dg_c;
    }
    __syncthreads();
    for (int i = j; i < dk; i += blockDim.x) {
      float sum_q = 0.0f, sum_k = 0.0f;
      for (int w = 0; w < warps; ++w) {
        sum_q += red_q[w][i];
        sum_k += red_k[w][i];
      }
      dq_part[(t * nv + h) * dk + i] = a.scale * sum_q;
      dk_part[(t * nv + h) * dk + i] = sum_k;
    }
    if (j == 0) {
      float sb = 0.0f, sg = 0.0f;
      for (int w = 0; w < warps; ++w) {
        sb += red_s[w][0];
        sg += red_s[w][1];
      }
      dbeta[t * nv + h] = sb;
      dg[t * nv + h] = sg;
    }
  }
}

// out[t, kh, i] = Σ over the value heads of key head kh, ascending, of part[t, h, i].
__global__ void GroupSumKernel(const float* part, int64_t tokens, int nk, int nv, int dk, float* out) {
  const int64_t n = tokens * nk * dk;
  const int group = nv / nk;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % dk);
    const int64_t row = idx / dk;
    const int kh = static_cast<int>(row % nk);
    const int64_t t = row / nk;
    float s = 0.0f;
    for (int g = 0; g < group; ++g) s += part[(t * nv + kh * group + g) * dk + i];
    out[idx] = s;
  }
}

int GridFor(int64_t n, int threads) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + threads - 1) / threads, 65535)));
}

int BlockThreads(int dv) { return (dv + 31) / 32 * 32; }

template <typename F>
absl::Status ByDk(int dk, F&& launch) {
  if (dk <= 16) return launch(std::integral_constant<int, 16>());
  if (dk <= 32) return launch(std::integral_constant<int, 32>());
  if (dk <= 64) return launch(std::integral_constant<int, 64>());
  return launch(std::integral_constant<int, 128>());
}

// logit[t] = bf16(Σ xn[t, :] · w): one warp per token.
__global__ void SharedGateLogitsKernel(const bf16* xn, const bf16* w, int64_t tokens, int64_t hidden, float* logit) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (t >= tokens) return;
  float s = 0.0f;
  for (int64_t c = lane; c < hidden; c += 32) s += __bfloat162float(xn[t * hidden + c]) * __bfloat162float(w[c]);
  s = WarpSum(s);
  if (lane == 0) logit[t] = __bfloat162float(__float2bfloat16_rn(s));
}

__global__ void SharedExpertAddGatedKernel(const bf16* ys, const float* logit, int64_t tokens, int64_t hidden,
                                           float* out) {
  const int64_t n = tokens * hidden;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] += Sigmoid(logit[i / hidden]) * __bfloat162float(ys[i]);
  }
}

// One warp per token: dys = bf16(dy σ), dlogit = σ(1 − σ) Σ dy·ys.
__global__ void SharedExpertGateBackwardKernel(const float* dy, const bf16* ys, const float* logit, int64_t tokens,
                                               int64_t hidden, bf16* dys, float* dlogit) {
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (t >= tokens) return;
  const float s = Sigmoid(logit[t]);
  float dot = 0.0f;
  for (int64_t c = lane; c < hidden; c += 32) {
    const float d = dy[t * hidden + c];
    dot += d * __bfloat162float(ys[t * hidden + c]);
    dys[t * hidden + c] = __float2bfloat16_rn(d * s);
  }
  dot = WarpSum(dot);
  if (lane == 0) dlogit[t] = dot * s * (1.0f - s);
}

__global__ void SharedGateDxnKernel(const float* dlogit, const bf16* w, int64_t tokens, int64_t hidden, float* dxn) {
  const int64_t n = tokens * hidden;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dxn[i] += dlogit[i / hidden] * __bfloat162float(w[i % hidden]);
  }
}

// partial[p, c] = Σ over part p's rows (in order) of dlogit[t] · xn[t, c]; a thread per column.
__global__ void SharedGateDwPartialsKernel(const float* dlogit, const bf16* xn, int64_t tokens, int64_t hidden,
                                           int64_t rows_per_part, float* partial) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t p = blockIdx.y;
  if (c >= hidden) return;
  const int64_t r0 = p * rows_per_part, r1 = std::min(tokens, r0 + rows_per_part);
  float s = 0.0f;
  for (int64_t t = r0; t < r1; ++t) s += dlogit[t] * __bfloat162float(xn[t * hidden + c]);
  partial[p * hidden + c] = s;
}

int64_t GateParts(int64_t tokens) { return std::max<int64_t>(1, std::min<int64_t>((tokens + 255) / 256, 256)); }

}  // namespace

absl::Status CheckRecurrentDelta(const kernels::GatedDeltaArgs& a) {
  if (a.tokens < 0 || a.num_docs < 1 || a.num_k_heads < 1 || a.num_v_heads < 1 ||
      a.num_v_heads % a.num_k_heads != 0 || a.num_v_heads > 65535 || a.k_dim < 1 || a.k_dim > 128 || a.v_dim < 1 ||
      a.v_dim > 32 * kMaxWarps) {
    return absl::InvalidArgumentError(absl::StrCat("recurrent gated delta rule: tokens ", a.tokens, ", documents ",
                                                   a.num_docs, ", heads k/v ", a.num_k_heads, "/", a.num_v_heads,
                                                   ", dims k/v ", a.k_dim, "/", a.v_dim,
                                                   " (needs nv a multiple of nk, dk and dv in [1, 128])"));
  }
  return absl::OkStatus();
}

// The launchers' check: the sizes, and the device cu_seqlens they read.
static absl::Status CheckRecurrentDeltaCall(const kernels::GatedDeltaArgs& a) {
  if (absl::Status s = CheckRecurrentDelta(a); !s.ok()) return s;
  if (a.cu_seqlens == nullptr) return absl::InvalidArgumentError("recurrent gated delta rule: cu_seqlens is null");
  return absl::OkStatus();
}

int64_t RecurrentDeltaBackwardWorkspaceBytes(const kernels::GatedDeltaArgs& a) {
  if (!CheckRecurrentDelta(a).ok()) return 0;
  const int64_t states = a.tokens * a.num_v_heads * static_cast<int64_t>(a.k_dim) * a.v_dim * 4;
  const int64_t part = a.tokens * a.num_v_heads * static_cast<int64_t>(a.k_dim) * 4;
  return AlignUp(states) + 2 * AlignUp(part);
}

absl::Status RecurrentDeltaForward(const kernels::GatedDeltaArgs& a, const bf16* q, const bf16* k, const bf16* v,
                                   const float* g, const float* beta, bf16* o, cudaStream_t stream) {
  if (absl::Status s = CheckRecurrentDeltaCall(a); !s.ok()) return s;
  if (a.tokens == 0) return absl::OkStatus();
  const dim3 grid(a.num_docs, a.num_v_heads);
  return ByDk(a.k_dim, [&](auto dk) -> absl::Status {
    RecurrentForwardKernel<decltype(dk)::value>
        <<<grid, BlockThreads(a.v_dim), 0, stream>>>(a, q, k, v, g, beta, o, nullptr);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  });
}

absl::Status RecurrentDeltaBackward(const kernels::GatedDeltaArgs& a, const bf16* q, const bf16* k, const bf16* v,
                                    const float* g, const float* beta, const bf16* d_o, float* dq, float* dk,
                                    float* dv, float* dg, float* dbeta, void* ws, cudaStream_t stream) {
  if (absl::Status s = CheckRecurrentDeltaCall(a); !s.ok()) return s;
  if (a.tokens == 0) return absl::OkStatus();
  char* w = static_cast<char*>(ws);
  float* states = reinterpret_cast<float*>(w);
  const int64_t state_bytes = AlignUp(a.tokens * a.num_v_heads * static_cast<int64_t>(a.k_dim) * a.v_dim * 4);
  const int64_t part_bytes = AlignUp(a.tokens * a.num_v_heads * static_cast<int64_t>(a.k_dim) * 4);
  float* dq_part = reinterpret_cast<float*>(w + state_bytes);
  float* dk_part = reinterpret_cast<float*>(w + state_bytes + part_bytes);
  const dim3 grid(a.num_docs, a.num_v_heads);
  const int threads = BlockThreads(a.v_dim);
  absl::Status s = ByDk(a.k_dim, [&](auto kdk) -> absl::Status {
    constexpr int kDk = decltype(kdk)::value;
    RecurrentForwardKernel<kDk><<<grid, threads, 0, stream>>>(a, q, k, v, g, beta, nullptr, states);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    RecurrentBackwardKernel<kDk>
        <<<grid, threads, 0, stream>>>(a, q, k, v, g, beta, d_o, states, dq_part, dk_part, dv, dg, dbeta);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  });
  if (!s.ok()) return s;
  const int64_t n = a.tokens * a.num_k_heads * a.k_dim;
  GroupSumKernel<<<GridFor(n, 256), 256, 0, stream>>>(dq_part, a.tokens, a.num_k_heads, a.num_v_heads, a.k_dim, dq);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  GroupSumKernel<<<GridFor(n, 256), 256, 0, stream>>>(dk_part, a.tokens, a.num_k_heads, a.num_v_heads, a.k_dim, dk);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SharedGateLogits(const bf16* xn, const bf16* w, int64_t tokens, int64_t hidden, float* logit,
                              cudaStream_t stream) {
  if (tokens < 0 || hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("SharedGateLogits: tokens ", tokens, ", hidden ", hidden));
  }
  if (tokens == 0) return absl::OkStatus();
  constexpr int kWarps = 8;
  const int64_t blocks = (tokens + kWarps - 1) / kWarps;
  if (blocks > INT32_MAX) return absl::InvalidArgumentError(absl::StrCat("SharedGateLogits: ", tokens, " tokens"));
  SharedGateLogitsKernel<<<static_cast<int>(blocks), 32 * kWarps, 0, stream>>>(xn, w, tokens, hidden, logit);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SharedExpertAddGated(const bf16* ys, const float* logit, int64_t tokens, int64_t hidden, float* out,
                                  cudaStream_t stream) {
  if (tokens < 0 || hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("SharedExpertAddGated: tokens ", tokens, ", hidden ", hidden));
  }
  if (tokens == 0) return absl::OkStatus();
  SharedExpertAddGatedKernel<<<GridFor(tokens * hidden, 256), 256, 0, stream>>>(ys, logit, tokens, hidden, out);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status SharedExpertGateBackward(const float* dy, const bf16* ys, const float* logit, int64_t tokens,
                                      int64_t hidden, bf16* dys, float* dlogit, cudaStream_t stream) {
  if (tokens < 0 || hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("SharedExpertGateBackward: tokens ", tokens, ", hidden ", hidden));
  }
  if (tokens == 0) return absl::OkStatus();
  constexpr int kWarps = 8;
  const int64_t blocks = (tokens + kWarps - 1) / kWarps;
  if (blocks > INT32_MAX) {
    return absl::InvalidArgumentError(absl::StrCat("SharedExpertGateBackward: ", tokens, " tokens"));
  }
  SharedExpertGateBackwardKernel<<<static_cast<int>(blocks), 32 * kWarps, 0, stream>>>(dy, ys, logit, tokens, hidden,
                                                                                       dys, dlogit);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

int64_t SharedGateInputBackwardWorkspaceNumel(int64_t tokens, int64_t hidden) { return GateParts(tokens) * hidden; }

absl::Status SharedGateInputBackward(const float* dlogit, const bf16* w, const bf16* xn, int64_t tokens,
                                     int64_t hidden, float* dxn, float* dw, float* ws, cudaStream_t stream) {
  if (tokens < 0 || hidden < 1) {
    return absl::InvalidArgumentError(absl::StrCat("SharedGateInputBackward: tokens ", tokens, ", hidden ", hidden));
  }
  if (tokens == 0) return absl::OkStatus();
  SharedGateDxnKernel<<<GridFor(tokens * hidden, 256), 256, 0, stream>>>(dlogit, w, tokens, hidden, dxn);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  const int64_t parts = GateParts(tokens);
  const int64_t rows_per_part = (tokens + parts - 1) / parts;
  const dim3 grid(static_cast<unsigned>((hidden + 127) / 128), static_cast<unsigned>(parts));
  SharedGateDwPartialsKernel<<<grid, 128, 0, stream>>>(dlogit, xn, tokens, hidden, rows_per_part, ws);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return kernels::ReducePartialsInto(ws, parts, hidden, dw, stream);
}

}  // namespace slidedp::cuda_backend_internal
