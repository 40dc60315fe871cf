// Per-op benchmark of the CUDA kernels at Qwen3-4B/8B/14B shapes (4K/16K/32K tokens), one
// decoder layer forward+backward at Qwen3-8B over 64K tokens, and the fused LM head + loss
// against an unfused (full-logits) path. Ceilings are measured in the same run: a cuBLASLt BF16
// GEMM (8192³) and a device-to-device copy (bytes read + written). Prints a table and one JSON
// line per measurement. Times are medians of CUDA-event-timed repetitions after a warm-up.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_split.h"
#include "common/model/model_config.h"
#include "worker/compute/backend.h"
#include "worker/compute/cuda/cuda_backend.h"
#include "worker/kernels/attention.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/qk_norm_rope.h"
#include "worker/kernels/rmsnorm.h"
#include "worker/kernels/swiglu.h"

namespace slidedp {
namespace {

using kernels::bf16;

#define BENCH_CHECK(expr)                                                                                  \
  do {                                                                                                     \
    absl::Status s_ = (expr);                                                                              \
    if (!s_.ok()) {                                                                                        \
      std::fprintf(stderr, "error: %s -> %s (%s:%d)\n", #expr, s_.ToString().c_str(), __FILE__, __LINE__); \
      std::exit(1);                                                                                        \
    }                                                                                                      \
  } while (0)
#define CUDA_CHECK(expr)                                                                                    \
  do {                                                                                                      \
    cudaError_t e_ = (expr);                                                                                \
    if (e_ != cudaSuccess) {                                                                                \
      std::fprintf(stderr, "error: %s -> %s (%s:%d)\n", #expr, cudaGetErrorString(e_), __FILE__, __LINE__); \
      std::exit(1);                                                                                         \
    }                                                                                                       \
  } while (0)

// Deterministic pseudo-random BF16 in [-scale, scale) (never zeros: zeros time faster).
__global__ void FillKernel(bf16* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = __float2bfloat16((static_cast<float>(x & 0xffffff) / 16777216.0f * 2.0f - 1.0f) * scale);
  }
}

__global__ void FillF32Kernel(float* p, int64_t n, uint32_t seed, float scale) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    uint32_t x = static_cast<uint32_t>(i) * 2654435761u ^ seed;
    x ^= x >> 13;
    x *= 0x5bd1e995u;
    x ^= x >> 15;
    p[i] = (static_cast<float>(x & 0xffffff) / 16777216.0f * 2.0f - 1.0f) * scale;
  }
}

struct Arena {
  std::vector<void*> ptrs;
  ~Arena() {
    for (void* p : ptrs) cudaFree(p);
  }
  template <typename T>
  T* Get(int64_t n) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<int64_t>(n, 1) * sizeof(T)));
    ptrs.push_back(p);
    return static_cast<T*>(p);
  }
  bf16* Rand(int64_t n, float scale = 1.0f) {
    bf16* p = Get<bf16>(n);
    static uint32_t seed = 1234;
    FillKernel<<<1024, 256>>>(p, n, seed++, scale);
    CUDA_CHECK(cudaGetLastError());
    return p;
  }
  float* RandF32(int64_t n, float scale = 1.0f) {
    float* p = Get<float>(n);
    static uint32_t seed = 4321;
    FillF32Kernel<<<1024, 256>>>(p, n, seed++, scale);
    CUDA_CHECK(cudaGetLastError());
    return p;
  }
  // A residual-stream activation in the backend's dtype (FP32 or BF16).
  void* RandAct(DType t, int64_t n, float scale = 1.0f) {
    return t == DType::kF32 ? static_cast<void*>(RandF32(n, scale)) : static_cast<void*>(Rand(n, scale));
  }
  void* GetAct(DType t, int64_t n) {
    return t == DType::kF32 ? static_cast<void*>(Get<float>(n)) : static_cast<void*>(Get<bf16>(n));
  }
};

double TimeMs(const std::function<void()>& fn, int reps = 5) {
  fn();  // warm-up (algorithm selection, module load)
  CUDA_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<float> ts;
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a);
    fn();
    cudaEventRecord(b);
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    ts.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

double g_peak_tflops = 0, g_copy_gbps = 0;

void Emit(const std::string& op, const std::string& model, int64_t tokens, double ms, double flops, double bytes) {
  const double tflops = flops > 0 ? flops / ms / 1e9 : 0;
  const double gbps = bytes > 0 ? bytes / ms / 1e6 : 0;
  const double frac = flops > 0 ? tflops / g_peak_tflops : gbps / g_copy_gbps;
  std::printf("%-26s %-10s %7lld %10.3f %9.1f %9.1f %7.1f%%\n", op.c_str(), model.c_str(),
              static_cast<long long>(tokens), ms, tflops, gbps, 100 * frac);
  std::printf(
      "JSON {\"op\":\"%s\",\"model\":\"%s\",\"tokens\":%lld,\"ms\":%.4f,\"tflops\":%.2f,\"gbps\":%.1f,"
      "\"frac_of_ceiling\":%.4f}\n",
      op.c_str(), model.c_str(), static_cast<long long>(tokens), ms, tflops, gbps, frac);
}

void MeasureCeilings(GemmRunner& gemm) {
  Arena ar;
  const int64_t n = 8192;
  bf16* a = ar.Rand(n * n);
  bf16* b = ar.Rand(n * n);
  bf16* d = ar.Get<bf16>(n * n);
  GemmArgs g;
  g.m = g.n = g.k = n;
  g.a = a;
  g.lda = n;
  g.b = b;
  g.ldb = n;
  g.d = d;
  g.ldd = n;
  double ms = TimeMs([&] { BENCH_CHECK(gemm.Run(g, nullptr)); }, 10);
  g_peak_tflops = 2.0 * n * n * n / ms / 1e9;
  const int64_t bytes = 2ll << 30;
  char* src = ar.Get<char>(bytes);
  char* dst = ar.Get<char>(bytes);
  CUDA_CHECK(cudaMemset(src, 1, bytes));
  ms = TimeMs([&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); }, 10);
  g_copy_gbps = 2.0 * bytes / ms / 1e6;
  std::printf("ceilings: cuBLASLt bf16 GEMM 8192^3 = %.1f TFLOP/s; D2D copy = %.1f GB/s (read+write)\n", g_peak_tflops,
              g_copy_gbps);
  std::printf(
      "JSON {\"op\":\"ceiling_gemm_bf16_8192\",\"tflops\":%.2f}\nJSON {\"op\":\"ceiling_copy_d2d\",\"gbps\":%.1f}\n",
      g_peak_tflops, g_copy_gbps);
}

// cuDNN's fused attention (attn_*_causal_cudnn rows); null when libcudnn is unavailable.
kernels::CudnnAttention* g_cudnn = nullptr;

void BenchOps(GemmRunner& gemm, const std::string& model, const ModelConfig& c, int64_t T) {
  Arena ar;
  const int64_t H = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim(), QKV = qd + 2 * kvd;
  const int nq = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  bf16* x = ar.Rand(T * H);
  bf16* y = ar.Rand(T * H);
  bf16* dy = ar.Rand(T * H);
  bf16* w = ar.Rand(std::max({QKV * H, 2 * I * H, H * I}), 0.02f);
  float* dw = ar.Get<float>(std::max({QKV * H, 2 * I * H, H * I}));
  bf16* big = ar.Rand(T * 2 * I);
  bf16* big2 = ar.Rand(T * 2 * I);
  bf16* mid = ar.Rand(T * I);
  float* rstd = ar.Get<float>(T);
  float* ws = ar.Get<float>(kernels::RmsNormBackwardWorkspaceNumel(T, H) + 1024 * 256);
  float* dwv = ar.Get<float>(H);
  CUDA_CHECK(cudaMemset(dw, 0, std::max({QKV * H, 2 * I * H, H * I}) * 4));
  CUDA_CHECK(cudaMemset(dwv, 0, H * 4));

  struct G {
    const char* name;
    int64_t n, k;
  };
  const G gs[] = {{"qkv", QKV, H}, {"o_proj", H, qd}, {"gate_up", 2 * I, H}, {"down", H, I}};
  for (const G& s : gs) {
    GemmArgs f;  // forward Y[T,n] = X[T,k] Wᵀ
    f.m = T;
    f.n = s.n;
    f.k = s.k;
    f.a = big;
    f.lda = s.k;
    f.b = w;
    f.ldb = s.k;
    f.d = big2;
    f.ldd = s.n;
    Emit(std::string("gemm_fwd_") + s.name, model, T, TimeMs([&] { BENCH_CHECK(gemm.Run(f, nullptr)); }),
         2.0 * T * s.n * s.k, 0);
    GemmArgs d;  // dgrad dX[T,k] = dY[T,n] W
    d.op_b = GemmOp::kN;
    d.m = T;
    d.n = s.k;
    d.k = s.n;
    d.a = big;
    d.lda = s.n;
    d.b = w;
    d.ldb = s.k;
    d.d = big2;
    d.ldd = s.k;
    Emit(std::string("gemm_dgrad_") + s.name, model, T, TimeMs([&] { BENCH_CHECK(gemm.Run(d, nullptr)); }),
         2.0 * T * s.n * s.k, 0);
    GemmArgs wg;  // wgrad dW[n,k] += dYᵀ X (FP32)
    wg.op_a = GemmOp::kT;
    wg.op_b = GemmOp::kN;
    wg.m = s.n;
    wg.n = s.k;
    wg.k = T;
    wg.a = big;
    wg.lda = s.n;
    wg.b = big2;
    wg.ldb = s.k;
    wg.c = dw;
    wg.ldc = s.k;
    wg.d = dw;
    wg.ldd = s.k;
    wg.out_type = GemmOutType::kF32;
    wg.beta = 1.0f;
    Emit(std::string("gemm_wgrad_") + s.name, model, T, TimeMs([&] { BENCH_CHECK(gemm.Run(wg, nullptr)); }),
         2.0 * T * s.n * s.k, 0);
  }
  const float eps = 1e-6f;
  Emit("rmsnorm_fwd", model, T,
       TimeMs([&] { BENCH_CHECK(kernels::RmsNormForward(x, w, T, H, eps, y, rstd, nullptr)); }), 0, 2.0 * T * H * 2);
  Emit("rmsnorm_bwd", model, T,
       TimeMs([&] { BENCH_CHECK(kernels::RmsNormBackward(dy, x, w, rstd, dy, T, H, y, dwv, ws, nullptr)); }), 0,
       4.0 * T * H * 2);
  kernels::RopeArgs ra;
  ra.tokens = T;
  ra.num_q_heads = nq;
  ra.num_kv_heads = nkv;
  ra.head_dim = hd;
  int32_t* pos = ar.Get<int32_t>(T);
  {
    std::vector<int32_t> hp(T);
    for (int64_t t = 0; t < T; ++t) hp[t] = static_cast<int32_t>(t % 4096);
    CUDA_CHECK(cudaMemcpy(pos, hp.data(), T * 4, cudaMemcpyHostToDevice));
  }
  const double rope_bytes = 2.0 * T * (qd + kvd) * 2;  // read q,k raw; write q,k
  Emit("qknorm_rope_fwd", model, T,
       TimeMs([&] { BENCH_CHECK(kernels::QkNormRopeForward(ra, big, QKV, w, w, pos, mid, mid + T * qd, nullptr)); }), 0,
       rope_bytes);
  Emit("qknorm_rope_bwd", model, T, TimeMs([&] {
         BENCH_CHECK(
             kernels::QkNormRopeBackward(ra, mid, mid + T * qd, big, QKV, w, w, pos, big2, QKV, dwv, dwv, ws, nullptr));
       }),
       0, 1.5 * rope_bytes);
  Emit("swiglu_fwd", model, T, TimeMs([&] { BENCH_CHECK(kernels::SwiGluForward(big, T, I, mid, nullptr)); }), 0,
       3.0 * T * I * 2);
  Emit("swiglu_bwd", model, T, TimeMs([&] { BENCH_CHECK(kernels::SwiGluBackward(big, mid, T, I, big2, nullptr)); }), 0,
       5.0 * T * I * 2);
  // Attention: one causal document of T tokens.
  {
    int32_t* cu = ar.Get<int32_t>(2);
    int32_t hcu[2] = {0, static_cast<int32_t>(T)};
    CUDA_CHECK(cudaMemcpy(cu, hcu, 8, cudaMemcpyHostToDevice));
    kernels::AttnArgs a;
    a.tokens = T;
    a.num_docs = 1;
    a.max_seqlen = T;
    a.num_q_heads = nq;
    a.num_kv_heads = nkv;
    a.head_dim = hd;
    a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(hd));
    a.cu_seqlens = cu;
    bf16* q = big;
    bf16* k = big + T * qd;
    bf16* v = k + T * kvd;
    bf16* o = big2;
    bf16* dO = ar.Rand(T * qd);
    bf16* dq = mid;
    bf16* dk = mid + T * qd;
    bf16* dv = dk + T * kvd;
    float* lse = ar.Get<float>(T * nq);
    char* aws = ar.Get<char>(kernels::FlashAttentionBackwardWorkspaceBytes(a));
    const double fwd_flops = 4.0 * nq * hd * (static_cast<double>(T) * (T + 1) / 2);
    Emit("attn_fwd_causal", model, T, TimeMs([&] {
           BENCH_CHECK(kernels::FlashAttentionForward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, nullptr));
         }),
         fwd_flops, 0);
    Emit("attn_bwd_causal", model, T, TimeMs([&] {
           BENCH_CHECK(kernels::FlashAttentionBackward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, {dO, qd}, {dq, qd},
                                                       {dk, kvd}, {dv, kvd}, aws, nullptr));
         }),
         2.5 * fwd_flops, 0);
    // With dQ added in a fixed order (SLIDEDP_DETERMINISTIC's backward).
    kernels::AttnArgs ordered = a;
    ordered.ordered_dq = true;
    char* ows = ar.Get<char>(kernels::FlashAttentionBackwardWorkspaceBytes(ordered));
    Emit("attn_bwd_causal_ordered", model, T, TimeMs([&] {
           BENCH_CHECK(kernels::FlashAttentionBackward(ordered, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, {dO, qd},
                                                       {dq, qd}, {dk, kvd}, {dv, kvd}, ows, nullptr));
         }),
         2.5 * fwd_flops, 0);
    // The same call through cuDNN (same tensors, strides and FLOP convention).
    if (g_cudnn != nullptr) {
      const kernels::AttnRowStrides ld{qd, kvd, kvd, qd, qd, qd, kvd, kvd};
      absl::StatusOr<int64_t> fwd_ws = g_cudnn->ForwardWorkspaceBytes(a, ld);
      absl::StatusOr<int64_t> bwd_ws = fwd_ws.ok() ? g_cudnn->BackwardWorkspaceBytes(a, ld) : fwd_ws;
      if (!bwd_ws.ok()) {
        std::printf("%-26s %-10s %7lld   skipped: %s\n", "attn_*_causal_cudnn", model.c_str(),
                    static_cast<long long>(T), bwd_ws.status().ToString().c_str());
      } else {
        char* cws = ar.Get<char>(std::max(*fwd_ws, *bwd_ws));
        Emit("attn_fwd_causal_cudnn", model, T, TimeMs([&] {
               BENCH_CHECK(g_cudnn->Forward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, cws, nullptr));
             }),
             fwd_flops, 0);
        Emit("attn_bwd_causal_cudnn", model, T, TimeMs([&] {
               BENCH_CHECK(g_cudnn->Backward(a, {q, qd}, {k, kvd}, {v, kvd}, {o, qd}, lse, {dO, qd}, {dq, qd},
                                             {dk, kvd}, {dv, kvd}, cws, nullptr));
             }),
             2.5 * fwd_flops, 0);
      }
    }
  }
  // Embedding (vocab 151936 table).
  {
    const int64_t V = c.vocab_size;
    bf16* table = ar.Rand(V * H);
    int32_t* tok = ar.Get<int32_t>(T);
    std::vector<int32_t> ht(T);
    for (int64_t t = 0; t < T; ++t) ht[t] = static_cast<int32_t>((t * 7919) % V);
    CUDA_CHECK(cudaMemcpy(tok, ht.data(), T * 4, cudaMemcpyHostToDevice));
    Emit("embedding_fwd", model, T,
         TimeMs([&] { BENCH_CHECK(kernels::EmbeddingForward(table, tok, T, H, y, nullptr)); }), 0, 2.0 * T * H * 2);
    // Backward over a host-built grouping (tokens drawn from 4096 ids, so ids repeat).
    std::vector<int32_t> ids(T), order(T), uniq, seg;
    for (int64_t t = 0; t < T; ++t) ids[t] = static_cast<int32_t>((t * 7919) % 4096);
    for (int64_t t = 0; t < T; ++t) order[t] = static_cast<int32_t>(t);
    std::stable_sort(order.begin(), order.end(), [&](int32_t p, int32_t q) { return ids[p] < ids[q]; });
    for (int64_t i = 0; i < T; ++i)
      if (i == 0 || ids[order[i]] != ids[order[i - 1]]) {
        uniq.push_back(ids[order[i]]);
        seg.push_back(static_cast<int32_t>(i));
      }
    seg.push_back(static_cast<int32_t>(T));
    int32_t* duniq = ar.Get<int32_t>(uniq.size());
    int32_t* dseg = ar.Get<int32_t>(seg.size());
    int32_t* dord = ar.Get<int32_t>(T);
    CUDA_CHECK(cudaMemcpy(duniq, uniq.data(), uniq.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dseg, seg.data(), seg.size() * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dord, order.data(), T * 4, cudaMemcpyHostToDevice));
    float* demb = ar.Get<float>(4096 * H);
    CUDA_CHECK(cudaMemset(demb, 0, 4096 * H * 4));
    Emit("embedding_bwd", model, T,
         TimeMs([&] { BENCH_CHECK(kernels::EmbeddingBackward(dy, duniq, dseg, dord, uniq.size(), H, demb, nullptr)); }),
         0, T * H * 2.0 + uniq.size() * H * 8.0);
  }
}

MicroBatch PackedBatch(int64_t tokens, int64_t doc_len, int64_t vocab) {
  MicroBatch mb;
  mb.cu_seqlens = {0};
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t in_doc = t % doc_len;
    mb.tokens.push_back(static_cast<int32_t>((t * 7919 + 17) % vocab));
    mb.labels.push_back(static_cast<int32_t>((t * 104729 + 3) % vocab));
    mb.positions.push_back(static_cast<int32_t>(in_doc));
    if (in_doc == doc_len - 1 || t == tokens - 1) mb.cu_seqlens.push_back(static_cast<int32_t>(t + 1));
  }
  mb.max_seqlen = static_cast<int32_t>(std::min(doc_len, tokens));
  return mb;
}

void BenchLayer(const ModelConfig& c, int64_t T, int64_t doc_len, bool fp32_residual, int64_t tile_tokens = 0) {
  CudaBackendOptions opt;
  opt.fp32_residual = fp32_residual;
  auto be = MakeCudaBackendWithOptions(c, 0, opt);
  BENCH_CHECK(be.status());
  ComputeBackend& b = **be;
  b.SetTileTokens(tile_tokens);
  ModelLayout layout = ModelLayout::Build(c);
  const int64_t P = layout.units.at(1).numel, H = c.hidden_size;
  Arena ar;
  bf16* params = ar.Rand(P, 0.02f);
  {  // norm weights near 1
    for (int t : {kInputNorm, kPostNorm, kQNorm, kKNorm}) {
      const auto& ts = layout.units[1].tensors[t];
      FillKernel<<<64, 256>>>(params + ts.offset_numel, ts.numel, 99, 0.1f);
    }
  }
  float* dparams = ar.Get<float>(P);
  CUDA_CHECK(cudaMemset(dparams, 0, P * 4));
  const DType at = b.activation_dtype();
  void* x = ar.RandAct(at, T * H);
  void* y = ar.GetAct(at, T * H);
  void* dy = ar.RandAct(at, T * H, 0.01f);
  void* dx = ar.GetAct(at, T * H);
  MicroBatch mb = PackedBatch(T, doc_len, c.vocab_size);
  auto batch = b.UploadBatch(mb);
  BENCH_CHECK(batch.status());
  double attn_pairs = 0;
  for (size_t d = 0; d + 1 < mb.cu_seqlens.size(); ++d) {
    const double L = mb.cu_seqlens[d + 1] - mb.cu_seqlens[d];
    attn_pairs += L * (L + 1) / 2;
  }
  const int64_t qd = c.q_dim(), kvd = c.kv_dim(), I = c.intermediate_size;
  const double gemm_fwd = 2.0 * T * (H * (qd + 2 * kvd) + qd * H + 3 * H * I);
  const double attn_fwd = 4.0 * c.num_attention_heads * c.head_dim * attn_pairs;
  const double flops = 3 * gemm_fwd + 3.5 * attn_fwd;
  for (ActPolicy pol : {ActPolicy::kKeepAll, ActPolicy::kSelective, ActPolicy::kRecomputeLayer}) {
    const char* pn = pol == ActPolicy::kKeepAll ? "keep_all" : pol == ActPolicy::kSelective ? "selective" : "recompute";
    double fwd_ms = 0;
    auto step = [&] {
      std::unique_ptr<SavedActivations> saved;
      BENCH_CHECK(b.DecoderForward(reinterpret_cast<const bf16_t*>(params), **batch, x, y, pol, &saved));
      BENCH_CHECK(b.DecoderBackward(reinterpret_cast<const bf16_t*>(params), **batch, x, saved.get(), dy, dx, dparams));
    };
    // The backend runs on its own stream: time with a host clock around a synchronized region.
    step();
    BENCH_CHECK(b.Synchronize());
    std::vector<double> ts;
    for (int r = 0; r < 3; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      step();
      BENCH_CHECK(b.Synchronize());
      ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ts.begin(), ts.end());
    {
      std::unique_ptr<SavedActivations> saved;
      auto t0 = std::chrono::steady_clock::now();
      BENCH_CHECK(b.DecoderForward(reinterpret_cast<const bf16_t*>(params), **batch, x, y, pol, &saved));
      BENCH_CHECK(b.Synchronize());
      fwd_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    Emit(std::string("layer_fwd_bwd_") + pn + (fp32_residual ? "_fp32res" : "_bf16res"), "qwen3-8b", T, ts[1], flops,
         0);
    std::printf("   (forward alone %.2f ms; doc length %lld; saved %lld B/token; model FLOPs count no recompute)\n",
                fwd_ms, static_cast<long long>(doc_len), static_cast<long long>(b.SavedBytesPerToken(pol)));
  }
}

void BenchHead(const ModelConfig& c, int64_t T) {  // default (FP32) residual stream
  const int64_t H = c.hidden_size, V = c.vocab_size;
  for (int fused = 1; fused >= 0; --fused) {
    CudaBackendOptions opt;
    if (!fused) opt.head_logits_budget_bytes = T * V * 2 + 1;  // one chunk: the full logits exist
    auto be = MakeCudaBackendWithOptions(c, 0, opt);
    BENCH_CHECK(be.status());
    ComputeBackend& b = **be;
    Arena ar;
    void* x = ar.RandAct(b.activation_dtype(), T * H);
    void* dx = ar.GetAct(b.activation_dtype(), T * H);
    bf16* nw = ar.Rand(H, 1.0f);
    bf16* lw = ar.Rand(V * H, 0.02f);
    float* dn = ar.Get<float>(H);
    float* dl = ar.Get<float>(V * H);
    float* loss = ar.Get<float>(1);
    CUDA_CHECK(cudaMemset(dn, 0, H * 4));
    CUDA_CHECK(cudaMemset(dl, 0, V * H * 4));
    CUDA_CHECK(cudaMemset(loss, 0, 4));
    MicroBatch mb = PackedBatch(T, 4096, V);
    auto batch = b.UploadBatch(mb);
    BENCH_CHECK(batch.status());
    auto run = [&] {
      BENCH_CHECK(b.HeadForwardBackward(reinterpret_cast<const bf16_t*>(nw), reinterpret_cast<const bf16_t*>(lw),
                                        **batch, x, 1.0f / T, dx, dn, dl, loss));
    };
    run();
    BENCH_CHECK(b.Synchronize());
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, 0));
    uint64_t zero = 0, high = 0, used = 0;
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemCurrent, &used));
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    std::vector<double> ts;
    for (int r = 0; r < 3; ++r) {
      auto t0 = std::chrono::steady_clock::now();
      run();
      BENCH_CHECK(b.Synchronize());
      ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    std::sort(ts.begin(), ts.end());
    const double flops = 3 * 2.0 * T * V * H;
    Emit(fused ? "head_ce_fused_chunked" : "head_ce_unfused_full_logits", "qwen3-8b", T, ts[1], flops, 0);
    std::printf("   peak extra device memory %.2f GiB (pool high-water above %.2f GiB in use before)\n",
                (high - used) / 1073741824.0, used / 1073741824.0);
    std::printf("JSON {\"op\":\"%s_peak_extra_bytes\",\"tokens\":%lld,\"bytes\":%llu}\n",
                fused ? "head_ce_fused_chunked" : "head_ce_unfused_full_logits", static_cast<long long>(T),
                static_cast<unsigned long long>(high - used));
  }
  std::printf("   (a PyTorch-style unfused path also upcasts logits to FP32 and keeps an FP32 grad: +%.1f GiB more)\n",
              T * V * 8.0 / 1073741824.0);
}


// One sparse decoder layer of a MoE preset (qwen3-30b-a3b: 128 experts, top-8, hidden 2048,
// moe_intermediate 768) over T tokens in documents of 4,096, forward + backward per policy, each
// repetition on a fresh layer input (new routing, as every micro-batch of a run brings), with the
// expert GEMMs planned per row-count bucket and per exact count. Prints the GPU time, the host time
// spent enqueueing (a step whose host time reaches its GPU time is bound by the host), and the
// per-expert GEMM loop against one GEMM over all routed rows (the grouping's ceiling).
void BenchMoe(const std::string& preset, int64_t T) {
  auto cfg = ModelConfig::Preset(preset);
  BENCH_CHECK(cfg.status());
  ModelConfig c = *cfg;
  c.num_hidden_layers = 1;
  BENCH_CHECK(c.Validate());
  ModelLayout layout = ModelLayout::Build(c);
  const int64_t P = layout.units.at(1).numel, H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok,
                I = c.moe_intermediate_size;
  Arena ar;
  bf16* params = ar.Rand(P, 0.02f);
  for (int t : {kInputNorm, kPostNorm, kQNorm, kKNorm}) {
    const auto& ts = layout.units[1].tensors[t];
    FillKernel<<<64, 256>>>(params + ts.offset_numel, ts.numel, 99, 0.1f);
  }
  float* dparams = ar.Get<float>(P);
  CUDA_CHECK(cudaMemset(dparams, 0, P * 4));
  float* x = ar.Get<float>(T * H);
  float* y = ar.Get<float>(T * H);
  float* dy = ar.RandF32(T * H, 0.01f);
  float* dx = ar.Get<float>(T * H);
  MicroBatch mb = PackedBatch(T, 4096, c.vocab_size);
  double attn_pairs = 0;
  for (size_t d = 0; d + 1 < mb.cu_seqlens.size(); ++d) {
    const double L = mb.cu_seqlens[d + 1] - mb.cu_seqlens[d];
    attn_pairs += L * (L + 1) / 2;
  }
  const int64_t qd = c.q_dim(), kvd = c.kv_dim();
  const double gemm_fwd = 2.0 * T * (H * (qd + 2 * kvd) + qd * H + H * E + k * 3 * H * I);
  const double attn_fwd = 4.0 * c.num_attention_heads * c.head_dim * attn_pairs;
  const double flops = 3 * gemm_fwd + 3.5 * attn_fwd;
  uint32_t seed = 777;
  const UnitParams up = UnitParams(reinterpret_cast<const bf16_t*>(params)).OfLayer(0);
  for (int buckets = 1; buckets >= 0; --buckets) {
    CudaBackendOptions opt;
    opt.gemm_row_buckets = buckets != 0;
    auto be = MakeCudaBackendWithOptions(c, 0, opt);
    BENCH_CHECK(be.status());
    ComputeBackend& b = **be;
    auto batch = b.UploadBatch(mb);
    BENCH_CHECK(batch.status());
    for (ActPolicy pol : {ActPolicy::kRecomputeLayer, ActPolicy::kKeepAll}) {
      const char* pn = pol == ActPolicy::kKeepAll ? "keep_all" : "recompute";
      std::vector<double> gpu_ms, host_ms;
      for (int r = 0; r < 6; ++r) {
        FillF32Kernel<<<1024, 256>>>(x, T * H, seed++, 1.0f);
        CUDA_CHECK(cudaDeviceSynchronize());
        BENCH_CHECK(b.Synchronize());
        auto t0 = std::chrono::steady_clock::now();
        std::unique_ptr<SavedActivations> saved;
        BENCH_CHECK(b.DecoderForward(up, **batch, x, y, pol, &saved));
        BENCH_CHECK(b.DecoderBackward(up, **batch, x, saved.get(), dy, dx, dparams));
        auto t1 = std::chrono::steady_clock::now();
        BENCH_CHECK(b.Synchronize());
        auto t2 = std::chrono::steady_clock::now();
        if (r < 2) continue;  // warm-up: module loads, the buckets' first plans
        gpu_ms.push_back(std::chrono::duration<double, std::milli>(t2 - t0).count());
        host_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      }
      std::sort(gpu_ms.begin(), gpu_ms.end());
      std::sort(host_ms.begin(), host_ms.end());
      Emit(std::string("moe_layer_fwd_bwd_") + pn + (buckets ? "_buckets" : "_exact_plans"), preset, T,
           gpu_ms[gpu_ms.size() / 2], flops, 0);
      std::printf("   (host enqueue %.2f ms of the step; fresh routing each repetition; model FLOPs active, no recompute)\n",
                  host_ms[host_ms.size() / 2]);
    }
  }
  // The experts' forward GEMMs alone: E GEMMs of T k / E rows each against one GEMM of T k rows.
  GemmRunner gemm;
  BENCH_CHECK(gemm.Init());
  const int64_t R = T * k, rows = R / E;
  bf16* xg = ar.Rand(R * H);
  bf16* gu = ar.Get<bf16>(R * 2 * I);
  bf16* w = ar.Rand(E * 2 * I * H, 0.02f);
  auto linear = [&](const bf16* a, int64_t m, const bf16* wt, bf16* d) {
    GemmArgs g;
    g.m = m;
    g.n = 2 * I;
    g.k = H;
    g.a = a;
    g.lda = H;
    g.b = wt;
    g.ldb = H;
    g.d = d;
    g.ldd = 2 * I;
    g.varies = GemmArgs::Varies::kM;
    BENCH_CHECK(gemm.Run(g, nullptr));
  };
  const double f = 2.0 * R * H * 2 * I;
  Emit("moe_gate_up_per_expert", preset, T,
       TimeMs([&] {
         for (int64_t e = 0; e < E; ++e) linear(xg + e * rows * H, rows, w + e * 2 * I * H, gu + e * rows * 2 * I);
       }),
       f, 0);
  Emit("moe_gate_up_one_gemm", preset, T, TimeMs([&] { linear(xg, R, w, gu); }), f, 0);
}

// An attention call over `tokens` queries in `docs` pieces of at most `max_seqlen`, with c's heads.
kernels::AttnArgs HeadsArgs(const ModelConfig& c, int64_t tokens, int docs, int64_t max_seqlen, const int32_t* cu,
                            const int32_t* cu_host) {
  kernels::AttnArgs a;
  a.tokens = tokens;
  a.num_docs = docs;
  a.max_seqlen = static_cast<int>(max_seqlen);
  a.num_q_heads = c.num_attention_heads;
  a.num_kv_heads = c.num_key_value_heads;
  a.head_dim = c.head_dim;
  a.softmax_scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  a.cu_seqlens = cu;
  a.cu_seqlens_host = cu_host;
  return a;
}

// A device workspace for cuDNN's forward and backward of `a` (the larger of the two), or the reason
// cuDNN does not take the call. Freed by the caller.
absl::StatusOr<void*> CudnnWorkspace(const kernels::AttnArgs& a, const kernels::AttnRowStrides& ld) {
  absl::StatusOr<int64_t> fws = g_cudnn->ForwardWorkspaceBytes(a, ld);
  if (!fws.ok()) return fws.status();
  absl::StatusOr<int64_t> bws = g_cudnn->BackwardWorkspaceBytes(a, ld);
  if (!bws.ok()) return bws.status();
  void* ws = nullptr;
  CUDA_CHECK(cudaMalloc(&ws, std::max<int64_t>(*fws, *bws)));
  return ws;
}

// One variant's rows: "<fwd_name> tokens column ms TFLOP/s" and the backward's (at 2.5x the
// forward's FLOPs), then "JSON {<json_head>,"tokens":..,"<column_key>":..,"fwd_ms":..,"bwd_ms":..}".
void ReportAttention(const std::string& fwd_name, const std::string& bwd_name, const std::string& json_head,
                     const char* column_key, int64_t tokens, int column, double fwd_flops, double f_ms, double b_ms) {
  std::printf("%-34s %8lld %6d %10.2f %9.1f\n", fwd_name.c_str(), static_cast<long long>(tokens), column, f_ms,
              fwd_flops / f_ms / 1e9);
  std::printf("%-34s %8lld %6d %10.2f %9.1f\n", bwd_name.c_str(), static_cast<long long>(tokens), column, b_ms,
              2.5 * fwd_flops / b_ms / 1e9);
  std::printf("JSON {%s,\"tokens\":%lld,\"%s\":%d,\"fwd_ms\":%.3f,\"bwd_ms\":%.3f}\n", json_head.c_str(),
              static_cast<long long>(tokens), column_key, column, f_ms, b_ms);
  std::fflush(stdout);
}

// --attn: cuDNN's attention alone over one causal document of each length, with Qwen3-8B's heads
// and the training strides (v inside the fused QKV rows), per layout (ragged THD entry, dense entry,
// dense with the padding mask) and engine configuration (the heuristics' first `engines`).
void BenchAttention(const std::vector<int64_t>& lengths, int engines) {
  auto c = ModelConfig::Preset("qwen3-8b");
  BENCH_CHECK(c.status());
  const int nq = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
  const int64_t qd = c->q_dim(), kvd = c->kv_dim(), qkv = qd + 2 * kvd;
  std::printf("%-34s %8s %6s %10s %9s\n", "attention (cudnn, qwen3-8b heads)", "tokens", "engine", "ms", "TFLOP/s");
  for (int64_t T : lengths) {
    Arena ar;
    int32_t* cu = ar.Get<int32_t>(2);
    const int32_t hcu[2] = {0, static_cast<int32_t>(T)};
    CUDA_CHECK(cudaMemcpy(cu, hcu, 8, cudaMemcpyHostToDevice));
    kernels::AttnArgs a = HeadsArgs(*c, T, 1, T, cu, hcu);
    bf16* q = ar.Rand(T * qd, 0.5f);
    bf16* k = ar.Rand(T * kvd, 0.5f);
    bf16* fused = ar.Rand(T * qkv, 0.5f);  // v at column qd + kvd of the fused rows
    bf16* v = fused + qd + kvd;
    bf16* o = ar.Get<bf16>(T * qd);
    bf16* dO = ar.Rand(T * qd);
    bf16* dq = ar.Get<bf16>(T * qd);
    bf16* dk = ar.Get<bf16>(T * kvd);
    bf16* dv_fused = ar.Get<bf16>(T * qkv);
    bf16* dv = dv_fused + qd + kvd;
    float* lse = ar.Get<float>(T * nq);
    const kernels::AttnRowStrides ld{qd, kvd, qkv, qd, qd, qd, kvd, qkv};
    const double fwd_flops = 4.0 * nq * hd * (static_cast<double>(T) * (T + 1) / 2);
    const int reps = T >= 131072 ? 2 : 5;
    // One variant's rows: forward and backward (backward at 2.5x the forward's FLOPs) and a JSON line.
    const auto report = [&](const std::string& variant, int engine, double f_ms, double b_ms) {
      ReportAttention("attn_fwd_cudnn_" + variant, "attn_bwd_cudnn_" + variant,
                      "\"op\":\"attn_cudnn\",\"layout\":\"" + variant + "\"", "engine", T, engine, fwd_flops, f_ms,
                      b_ms);
    };
    struct Layout {
      const char* name;
      bool dense, padding;
    };
    for (const Layout& lay : {Layout{"ragged", false, true}, Layout{"dense", true, false}, Layout{"dense+padding", true, true}}) {
      for (int e = 0; e < engines; ++e) {
        kernels::CudnnAttentionOptions opt;
        opt.dense_single_document = lay.dense;
        opt.dense_min_tokens = 0;
        opt.dense_padding_mask = lay.padding;
        opt.engine = e;
        g_cudnn->set_options(opt);
        absl::StatusOr<void*> got = CudnnWorkspace(a, ld);
        if (!got.ok()) {
          std::printf("attn_cudnn_%-23s %8lld %6d   %s\n", lay.name, static_cast<long long>(T), e,
                      got.status().ToString().c_str());
          break;
        }
        void* ws = *got;
        const double f_ms = TimeMs(
            [&] { BENCH_CHECK(g_cudnn->Forward(a, {q, qd}, {k, kvd}, {v, qkv}, {o, qd}, lse, ws, nullptr)); }, reps);
        const double b_ms = TimeMs(
            [&] {
              BENCH_CHECK(g_cudnn->Backward(a, {q, qd}, {k, kvd}, {v, qkv}, {o, qd}, lse, {dO, qd}, {dq, qd}, {dk, kvd},
                                            {dv, qkv}, ws, nullptr));
            },
            reps);
        CUDA_CHECK(cudaFree(ws));
        report(lay.name, e, f_ms, b_ms);
      }
    }
    // One call per kv-head group (its q heads and kv head, pointers offset): whether a call whose
    // keys and values are one head's streams them from L2 better than all heads at once.
    {
      g_cudnn->set_options({});
      const int groups = nkv, gq = nq / nkv;
      kernels::AttnArgs g = a;
      g.num_q_heads = gq;
      g.num_kv_heads = 1;
      absl::StatusOr<void*> got = CudnnWorkspace(g, ld);
      if (!got.ok()) {
        std::printf("attn_cudnn_per_kv_head %8lld   %s\n", static_cast<long long>(T), got.status().ToString().c_str());
      } else {
        void* ws = *got;
        const double f_ms = TimeMs(
            [&] {
              for (int h = 0; h < groups; ++h) {
                const int64_t qo = int64_t{h} * gq * hd, ko = int64_t{h} * hd;
                BENCH_CHECK(g_cudnn->Forward(g, {q + qo, qd}, {k + ko, kvd}, {v + ko, qkv}, {o + qo, qd},
                                             lse + int64_t{h} * gq * T, ws, nullptr));
              }
            },
            reps);
        const double b_ms = TimeMs(
            [&] {
              for (int h = 0; h < groups; ++h) {
                const int64_t qo = int64_t{h} * gq * hd, ko = int64_t{h} * hd;
                BENCH_CHECK(g_cudnn->Backward(g, {q + qo, qd}, {k + ko, kvd}, {v + ko, qkv}, {o + qo, qd},
                                              lse + int64_t{h} * gq * T, {dO + qo, qd}, {dq + qo, qd}, {dk + ko, kvd},
                                              {dv + ko, qkv}, ws, nullptr));
              }
            },
            reps);
        CUDA_CHECK(cudaFree(ws));
        report("per_kv_head", 0, f_ms, b_ms);
      }
    }
    g_cudnn->set_options({});
  }
}

// --attn-cross: a context-parallel share's attention alone: rank 0's zig-zag share of one causal
// document of T tokens over `ranks` (its first and last chunks of 2 x ranks, T / ranks queries)
// against the document's gathered keys | values ([T, 2 kv_dim] rows, as GatherContextKv lays them),
// Qwen3-8B's heads; the own kernels against cuDNN's cross entries (CudnnAttentionOptions::cross).
// FLOPs: the share's causal area (a balanced share holds 1 / ranks of the document's).
void BenchCrossAttention(const std::vector<int64_t>& lengths, int ranks) {
  auto c = ModelConfig::Preset("qwen3-8b");
  BENCH_CHECK(c.status());
  const int nq = c->num_attention_heads, nkv = c->num_key_value_heads, hd = c->head_dim;
  const int64_t qd = c->q_dim(), kvd = c->kv_dim(), ld_kv = 2 * kvd;
  std::printf("%-34s %8s %6s %10s %9s\n", "cross attention (qwen3-8b heads)", "tokens", "ranks", "ms", "TFLOP/s");
  for (int64_t T : lengths) {
    const int64_t chunk = T / (2 * ranks), L = 2 * chunk;
    Arena ar;
    const int32_t hcu[3] = {0, static_cast<int32_t>(chunk), static_cast<int32_t>(L)};
    const int32_t hbounds[4] = {0, static_cast<int32_t>(chunk), 0, static_cast<int32_t>(T)};
    int32_t* cu = ar.Get<int32_t>(3);
    int32_t* bounds = ar.Get<int32_t>(4);
    CUDA_CHECK(cudaMemcpy(cu, hcu, sizeof(hcu), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(bounds, hbounds, sizeof(hbounds), cudaMemcpyHostToDevice));
    kernels::AttnArgs a = HeadsArgs(*c, L, 2, chunk, cu, hcu);
    a.kv_bounds = bounds;
    a.kv_bounds_host = hbounds;
    a.kv_tokens = T;
    a.max_seqlen_kv = static_cast<int>(T);
    bf16* q = ar.Rand(L * qd, 0.5f);
    bf16* kv = ar.Rand(T * ld_kv, 0.5f);
    bf16* o = ar.Get<bf16>(L * qd);
    bf16* dO = ar.Rand(L * qd);
    bf16* dq = ar.Get<bf16>(L * qd);
    float* dkv = ar.Get<float>(T * ld_kv);
    float* lse = ar.Get<float>(L * nq);
    const double area = static_cast<double>(chunk) * (chunk + 1) / 2 + static_cast<double>(chunk) * (T - chunk) +
                        static_cast<double>(chunk) * (chunk + 1) / 2;
    const double fwd_flops = 4.0 * nq * hd * area;
    const int reps = T >= 262144 ? 2 : 5;
    const auto report = [&](const std::string& impl, double f_ms, double b_ms) {
      ReportAttention("attn_cross_fwd_" + impl, "attn_cross_bwd_" + impl,
                      "\"op\":\"attn_cross\",\"impl\":\"" + impl + "\"", "ranks", T, ranks, fwd_flops, f_ms, b_ms);
    };
    const kernels::AttnTensor keys{kv, ld_kv}, values{kv + kvd, ld_kv};
    {  // the own kernels
      void* ws = nullptr;
      CUDA_CHECK(cudaMalloc(&ws, kernels::FlashAttentionBackwardWorkspaceBytes(a)));
      const double f_ms =
          TimeMs([&] { BENCH_CHECK(kernels::FlashAttentionForward(a, {q, qd}, keys, values, {o, qd}, lse, nullptr)); },
                 reps);
      const double b_ms = TimeMs(
          [&] {
            BENCH_CHECK(kernels::FlashAttentionBackwardCross(a, {q, qd}, keys, values, {o, qd}, lse, {dO, qd},
                                                             {dq, qd}, dkv, dkv + kvd, ld_kv, ws, nullptr));
          },
          reps);
      CUDA_CHECK(cudaFree(ws));
      report("own", f_ms, b_ms);
    }
    kernels::CudnnAttentionOptions opt;
    opt.cross = true;
    opt.cross_min_tokens = 0;
    g_cudnn->set_options(opt);
    const kernels::AttnRowStrides ld{qd, ld_kv, ld_kv, qd, qd, qd, 0, 0};
    absl::StatusOr<void*> got = CudnnWorkspace(a, ld);
    if (!got.ok()) {
      std::printf("attn_cross_cudnn %8lld   %s\n", static_cast<long long>(T), got.status().ToString().c_str());
    } else {
      void* ws = *got;
      const double f_ms =
          TimeMs([&] { BENCH_CHECK(g_cudnn->Forward(a, {q, qd}, keys, values, {o, qd}, lse, ws, nullptr)); }, reps);
      const double b_ms = TimeMs(
          [&] {
            BENCH_CHECK(g_cudnn->BackwardCross(a, {q, qd}, keys, values, {o, qd}, lse, {dO, qd}, {dq, qd}, dkv,
                                               dkv + kvd, ld_kv, ws, nullptr));
          },
          reps);
      CUDA_CHECK(cudaFree(ws));
      report("cudnn", f_ms, b_ms);
    }
    g_cudnn->set_options({});
  }
}

}  // namespace
}  // namespace slidedp

int main(int argc, char** argv) {
  using namespace slidedp;
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("bench_kernels on %s, %d SMs\n", prop.name, prop.multiProcessorCount);
  bool quick = argc > 1 && std::string(argv[1]) == "--quick";
  // --long T [TILE]: one Qwen3-8B decoder layer over one document of T tokens, each policy, in tiles
  // of TILE tokens (the long-context ceiling per layer; docs/long-context.md), and nothing else.
  if (argc > 2 && std::string(argv[1]) == "--long") {
    auto c8 = ModelConfig::Preset("qwen3-8b");
    BENCH_CHECK(c8.status());
    const int64_t T = std::stoll(argv[2]);
    c8->max_position_embeddings = std::max<int64_t>(c8->max_position_embeddings, T);
    BenchLayer(*c8, T, T, /*fp32_residual=*/true, argc > 3 ? std::stoll(argv[3]) : 0);
    return 0;
  }
  // --attn T1,T2,... [ENGINES]: cuDNN attention alone per length, layout and engine (BenchAttention).
  if (argc > 2 && std::string(argv[1]) == "--attn") {
    absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
    BENCH_CHECK(cudnn.status());
    g_cudnn = cudnn->get();
    std::printf("cudnn attention: cuDNN %lld\n", static_cast<long long>(g_cudnn->version()));
    std::vector<int64_t> lengths;
    for (absl::string_view part : absl::StrSplit(argv[2], ',')) lengths.push_back(std::stoll(std::string(part)));
    BenchAttention(lengths, argc > 3 ? std::stoi(argv[3]) : 1);
    return 0;
  }
  // --attn-cross T1,T2,... [RANKS]: a context-parallel share's attention, own kernels vs cuDNN.
  if (argc > 2 && std::string(argv[1]) == "--attn-cross") {
    absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
    BENCH_CHECK(cudnn.status());
    g_cudnn = cudnn->get();
    std::vector<int64_t> lengths;
    for (absl::string_view part : absl::StrSplit(argv[2], ',')) lengths.push_back(std::stoll(std::string(part)));
    BenchCrossAttention(lengths, argc > 3 ? std::stoi(argv[3]) : 2);
    return 0;
  }
  // --moe T [PRESET]: one sparse decoder layer of a MoE preset (default qwen3-30b-a3b) over T tokens.
  if (argc > 2 && std::string(argv[1]) == "--moe") {
    GemmRunner ceil_gemm;
    BENCH_CHECK(ceil_gemm.Init());
    MeasureCeilings(ceil_gemm);
    BenchMoe(argc > 3 ? argv[3] : "qwen3-30b-a3b", std::stoll(argv[2]));
    return 0;
  }
  GemmRunner gemm;
  BENCH_CHECK(gemm.Init());
  MeasureCeilings(gemm);
  absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
  if (cudnn.ok()) {
    g_cudnn = cudnn->get();
    std::printf("cudnn attention: cuDNN %lld\n", static_cast<long long>(g_cudnn->version()));
  } else {
    std::printf("attn_*_causal_cudnn rows skipped: %s\n", cudnn.status().ToString().c_str());
  }
  std::printf("%-26s %-10s %7s %10s %9s %9s %8s\n", "op", "model", "tokens", "ms", "TFLOP/s", "GB/s", "ceil%");
  std::vector<std::string> models = {"qwen3-4b", "qwen3-8b", "qwen3-14b"};
  std::vector<int64_t> toks = {4096, 16384, 32768};
  if (quick) {
    models = {"qwen3-8b"};
    toks = {4096};
  }
  for (const auto& m : models) {
    auto c = ModelConfig::Preset(m);
    BENCH_CHECK(c.status());
    for (int64_t T : toks) BenchOps(gemm, m, *c, T);
  }
  auto c8 = ModelConfig::Preset("qwen3-8b");
  BENCH_CHECK(c8.status());
  BenchLayer(*c8, quick ? 8192 : 65536, 4096, /*fp32_residual=*/true);
  BenchLayer(*c8, quick ? 8192 : 65536, 4096, /*fp32_residual=*/false);
  BenchHead(*c8, quick ? 4096 : 32768);
  return 0;
}
