// The kernel benchmark's layer family, through the CUDA backend as training runs it: one decoder
// layer's forward + backward per activation policy (host-clocked: the backend runs on its own
// stream), the fused chunked LM head + loss against the unfused full-logits path (time and peak
// memory), and a MoE preset's sparse layer with its expert GEMMs.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "bench/kernels/bench_kernels.h"
#include "worker/compute/cuda/cuda_backend.h"

namespace slidedp::bench {
namespace {

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

// A decoder unit's BF16 parameters (weights at scale 0.02, its norms' weights drawn again at 0.1) and
// their zeroed FP32 gradient.
struct LayerParams {
  bf16* params;
  float* dparams;
};
LayerParams RandLayerParams(Arena& ar, const UnitLayout& unit) {
  bf16* params = ar.Rand(unit.numel, 0.02f);
  for (int t : {kInputNorm, kPostNorm, kQNorm, kKNorm}) {
    const auto& ts = unit.tensors[t];
    FillRandom(params + ts.offset_numel, ts.numel, 99, 0.1f, 64);
  }
  float* dparams = ar.Get<float>(unit.numel);
  CUDA_CHECK(cudaMemset(dparams, 0, unit.numel * 4));
  return {params, dparams};
}

// Model FLOPs of one layer's forward + backward over mb's T tokens (no recompute counted): 3x the
// forward GEMMs (the attention projections plus the MLP's `mlp_weights` weights per token) and 3.5x
// the causal attention's forward.
double LayerStepFlops(const ModelConfig& c, const MicroBatch& mb, int64_t T, int64_t mlp_weights) {
  double attn_pairs = 0;
  for (size_t d = 0; d + 1 < mb.cu_seqlens.size(); ++d) {
    const double L = mb.cu_seqlens[d + 1] - mb.cu_seqlens[d];
    attn_pairs += L * (L + 1) / 2;
  }
  const int64_t H = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim();
  const double gemm_fwd = 2.0 * T * (H * (qd + 2 * kvd) + qd * H + mlp_weights);
  const double attn_fwd = 4.0 * c.num_attention_heads * c.head_dim * attn_pairs;
  return 3 * gemm_fwd + 3.5 * attn_fwd;
}

// The middle of three runs of `step`, each timed with a host clock around a region synchronized with
// the backend (which runs on its own stream).
double HostMedianOfThreeMs(ComputeBackend& b, const std::function<void()>& step) {
  std::vector<double> ts;
  for (int r = 0; r < 3; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    step();
    BENCH_CHECK(b.Synchronize());
    ts.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ts.begin(), ts.end());
  return ts[1];
}

}  // namespace

void BenchLayer(const ModelConfig& c, int64_t T, int64_t doc_len, bool fp32_residual, int64_t tile_tokens) {
  CudaBackendOptions opt;
  opt.fp32_residual = fp32_residual;
  auto be = MakeCudaBackendWithOptions(c, 0, opt);
  BENCH_CHECK(be.status());
  ComputeBackend& b = **be;
  b.SetTileTokens(tile_tokens);
  ModelLayout layout = ModelLayout::Build(c);
  const int64_t H = c.hidden_size;
  Arena ar;
  const LayerParams lp = RandLayerParams(ar, layout.units.at(1));
  const auto* params = reinterpret_cast<const bf16_t*>(lp.params);
  const Dtype at = b.activation_dtype();
  void* x = ar.RandAct(at, T * H);
  void* y = ar.GetAct(at, T * H);
  void* dy = ar.RandAct(at, T * H, 0.01f);
  void* dx = ar.GetAct(at, T * H);
  MicroBatch mb = PackedBatch(T, doc_len, c.vocab_size);
  auto batch = b.UploadBatch(mb);
  BENCH_CHECK(batch.status());
  const double flops = LayerStepFlops(c, mb, T, 3 * H * c.intermediate_size);
  for (ActPolicy pol : {ActPolicy::kKeepAll, ActPolicy::kSelective, ActPolicy::kRecomputeLayer}) {
    const char* pn = pol == ActPolicy::kKeepAll ? "keep_all" : pol == ActPolicy::kSelective ? "selective" : "recompute";
    double fwd_ms = 0;
    auto step = [&] {
      std::unique_ptr<SavedActivations> saved;
      BENCH_CHECK(b.DecoderForward(params, **batch, x, y, pol, &saved));
      BENCH_CHECK(b.DecoderBackward(params, **batch, x, saved.get(), dy, dx, lp.dparams));
    };
    step();
    BENCH_CHECK(b.Synchronize());
    const double step_ms = HostMedianOfThreeMs(b, step);
    {
      std::unique_ptr<SavedActivations> saved;
      auto t0 = std::chrono::steady_clock::now();
      BENCH_CHECK(b.DecoderForward(params, **batch, x, y, pol, &saved));
      BENCH_CHECK(b.Synchronize());
      fwd_ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    }
    Emit(std::string("layer_fwd_bwd_") + pn + (fp32_residual ? "_fp32res" : "_bf16res"), "qwen3-8b", T, step_ms, flops,
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
    const double run_ms = HostMedianOfThreeMs(b, run);
    CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &high));
    const double flops = 3 * 2.0 * T * V * H;
    Emit(fused ? "head_ce_fused_chunked" : "head_ce_unfused_full_logits", "qwen3-8b", T, run_ms, flops, 0);
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
  const int64_t H = c.hidden_size, E = c.num_experts, k = c.num_experts_per_tok, I = c.moe_intermediate_size;
  Arena ar;
  const LayerParams lp = RandLayerParams(ar, layout.units.at(1));
  float* x = ar.Get<float>(T * H);
  float* y = ar.Get<float>(T * H);
  float* dy = ar.RandF32(T * H, 0.01f);
  float* dx = ar.Get<float>(T * H);
  MicroBatch mb = PackedBatch(T, 4096, c.vocab_size);
  const double flops = LayerStepFlops(c, mb, T, H * E + k * 3 * H * I);
  uint32_t seed = 777;
  const UnitParams up = UnitParams(reinterpret_cast<const bf16_t*>(lp.params)).OfLayer(0);
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
        FillRandom(x, T * H, seed++, 1.0f, 1024);
        CUDA_CHECK(cudaDeviceSynchronize());
        BENCH_CHECK(b.Synchronize());
        auto t0 = std::chrono::steady_clock::now();
        std::unique_ptr<SavedActivations> saved;
        BENCH_CHECK(b.DecoderForward(up, **batch, x, y, pol, &saved));
        BENCH_CHECK(b.DecoderBackward(up, **batch, x, saved.get(), dy, dx, lp.dparams));
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
      std::printf(
          "   (host enqueue %.2f ms of the step; fresh routing each repetition; model FLOPs active, no recompute)\n",
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
    GemmArgs g = MakeGemm(m, 2 * I, H, a, H, wt, H, d, 2 * I);
    g.varies = GemmArgs::Varies::kM;
    BENCH_CHECK(gemm.Run(g, nullptr));
  };
  const double f = 2.0 * R * H * 2 * I;
  Emit("moe_gate_up_per_expert", preset, T, TimeMs([&] {
         for (int64_t e = 0; e < E; ++e) linear(xg + e * rows * H, rows, w + e * 2 * I * H, gu + e * rows * 2 * I);
       }),
       f, 0);
  Emit("moe_gate_up_one_gemm", preset, T, TimeMs([&] { linear(xg, R, w, gu); }), f, 0);
}

}  // namespace slidedp::bench
