// Per-op benchmark of the CUDA kernels at Qwen3-4B/8B/14B shapes (4K/16K/32K tokens), one
// decoder layer forward+backward at Qwen3-8B over 64K tokens, and the fused LM head + loss
// against an unfused (full-logits) path. Ceilings are measured in the same run: a cuBLASLt BF16
// GEMM (8192³) and a device-to-device copy (bytes read + written). Prints a table and one JSON
// line per measurement. Times are medians of CUDA-event-timed repetitions after a warm-up.
//
// The families live one a file (bench_kernels.h): GEMMs, memory-bound ops, attention, layers; the
// harness (bench_harness.h) times and prints them.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_split.h"
#include "bench/kernels/bench_kernels.h"
#include "common/model/model_config.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/rmsnorm.h"

namespace slidedp::bench {
namespace {

// Every op's rows at one model's shapes over T tokens (one causal document for attention).
void BenchOps(GemmRunner& gemm, const std::string& model, const ModelConfig& c, int64_t T) {
  Arena ar;
  const int64_t H = c.hidden_size, I = c.intermediate_size, qd = c.q_dim(), kvd = c.kv_dim(), QKV = qd + 2 * kvd;
  const int64_t weight_numel = std::max({QKV * H, 2 * I * H, H * I});
  OpOperands o;
  o.x = ar.Rand(T * H);
  o.y = ar.Rand(T * H);
  o.dy = ar.Rand(T * H);
  o.w = ar.Rand(weight_numel, 0.02f);
  o.dw = ar.Get<float>(weight_numel);
  o.big = ar.Rand(T * 2 * I);
  o.big2 = ar.Rand(T * 2 * I);
  o.mid = ar.Rand(T * I);
  o.rstd = ar.Get<float>(T);
  o.ws = ar.Get<float>(kernels::RmsNormBackwardWorkspaceNumel(T, H) + 1024 * 256);
  o.dwv = ar.Get<float>(H);
  CUDA_CHECK(cudaMemset(o.dw, 0, weight_numel * 4));
  CUDA_CHECK(cudaMemset(o.dwv, 0, H * 4));
  BenchGemms(gemm, model, c, T, o);
  BenchNormRopeSwiGlu(ar, model, c, T, o);
  BenchCausalAttention(ar, model, c, T, o);
  BenchEmbedding(ar, model, c, T, o);
}

}  // namespace
}  // namespace slidedp::bench

int main(int argc, char** argv) {
  using namespace slidedp;
  using namespace slidedp::bench;
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
