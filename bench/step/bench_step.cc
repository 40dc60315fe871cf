// bench_step: the worker's training step on one GPU in "compute-only" mode: the same StepRunner
// and CUDA kernels as slidedp-worker, but every unit's BF16 parameters resident on the GPU (no
// gates, no H2D) and gradients accumulated on the GPU and dropped (no D2H, no host update). It is
// the ceiling the streamed system is measured against (issue: >= 0.95 of it at >= 64K tokens per
// GPU per step). Prints one JSON line:
//   {"mode":"compute_only","model":..,"tokens_per_step":..,"step_s":..,"tokens_per_s":..,
//    "model_tflops":..,"peak_gib":..}
// Model FLOPs per token: ModelLayout::ModelFlopsPerToken (the FSDP2 peer's convention).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "CLI/CLI.hpp"
#include "common/model/model_config.h"
#include "common/status/status_macros.h"
#include "nlohmann/json.hpp"
#include "worker/compute/backend.h"
#include "worker/pipeline/cuda_activation_store.h"
#include "worker/pipeline/gradient_path.h"
#include "worker/pipeline/step_runner.h"
#include "worker/pipeline/unit_streamer.h"

namespace slidedp {
namespace {

// Every unit uploaded once; Acquire hands out the resident copy.
class ResidentStreamer final : public UnitStreamer {
 public:
  static absl::StatusOr<std::unique_ptr<ResidentStreamer>> Create(const ModelLayout& layout) {
    std::unique_ptr<ResidentStreamer> s(new ResidentStreamer());
    int64_t max_numel = 0;
    for (const UnitLayout& u : layout.units) max_numel = std::max(max_numel, u.numel);
    // Small random values (speed does not depend on them; finite numbers keep the loss finite).
    std::vector<bf16_t> host(max_numel);
    std::mt19937 rng(0);
    std::uniform_real_distribution<float> dist(-0.02f, 0.02f);
    for (auto& v : host) v = FloatToBf16(dist(rng));
    for (const UnitLayout& u : layout.units) {
      void* p = nullptr;
      if (cudaMalloc(&p, u.numel * 2) != cudaSuccess) {
        return absl::ResourceExhaustedError(
            absl::StrCat("resident weights: cudaMalloc of ", u.numel * 2, " bytes failed"));
      }
      if (cudaMemcpy(p, host.data(), u.numel * 2, cudaMemcpyHostToDevice) != cudaSuccess) {
        return absl::InternalError("resident weights: cudaMemcpy failed");
      }
      s->units_.push_back(static_cast<bf16_t*>(p));
      s->bytes_ += u.numel * 2;
      // The FP32 norm weights, as the streamers deliver them by default (runtime.norm_weights).
      float* f = nullptr;
      if (u.fp32_numel > 0) {
        std::vector<float> ones(u.fp32_numel, 1.0f);
        if (cudaMalloc(reinterpret_cast<void**>(&f), u.fp32_numel * 4) != cudaSuccess ||
            cudaMemcpy(f, ones.data(), u.fp32_numel * 4, cudaMemcpyHostToDevice) != cudaSuccess) {
          return absl::ResourceExhaustedError("resident weights: FP32 norm weights");
        }
        s->bytes_ += u.fp32_numel * 4;
      }
      if (u.kind == UnitKind::kEmbedding) {
        // The FP32 rows the lookup reads by default (runtime.embedding_rows), in mapped pinned
        // host memory as the workers read the master: only the batch's rows cross the link.
        if (cudaHostAlloc(reinterpret_cast<void**>(&s->embed_host_), u.numel * 4, cudaHostAllocMapped) != cudaSuccess) {
          return absl::ResourceExhaustedError("resident weights: FP32 embedding table in pinned host memory");
        }
        for (int64_t i = 0; i < u.numel; ++i) s->embed_host_[i] = Bf16ToFloat(host[i]);
        s->embed_unit_ = static_cast<int>(s->fp32_.size());
        if (cudaHostGetDevicePointer(reinterpret_cast<void**>(&f), s->embed_host_, 0) != cudaSuccess) {
          return absl::InternalError("resident weights: no device pointer for the FP32 embedding table");
        }
      }
      s->fp32_.push_back(f);
    }
    return s;
  }
  ~ResidentStreamer() override {
    for (bf16_t* p : units_) cudaFree(p);
    for (size_t u = 0; u < fp32_.size(); ++u) {
      if (fp32_[u] != nullptr && static_cast<int>(u) != embed_unit_) cudaFree(fp32_[u]);
    }
    if (embed_host_) cudaFreeHost(embed_host_);
  }
  absl::StatusOr<UnitParams> Acquire(int unit, uint32_t) override { return UnitParams(units_[unit], fp32_[unit]); }
  void Release(int) override {}
  double gate_wait_s() const override { return 0; }
  double h2d_s() const override { return 0; }
  int64_t device_bytes() const override { return bytes_; }

 private:
  ResidentStreamer() = default;
  std::vector<bf16_t*> units_;
  std::vector<float*> fp32_;  // null for units without norms; the embedding's: embed_host_ mapped
  float* embed_host_ = nullptr;
  int embed_unit_ = -1;
  int64_t bytes_ = 0;
};

std::vector<MicroBatch> SyntheticBatches(const ModelConfig& c, int64_t tokens, int64_t seq, int64_t rows_per_mb) {
  std::mt19937 rng(1);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.vocab_size - 1));
  const int64_t rows = tokens / seq;
  std::vector<MicroBatch> mbs;
  for (int64_t r0 = 0; r0 < rows; r0 += rows_per_mb) {
    MicroBatch mb;
    mb.cu_seqlens.push_back(0);
    for (int64_t r = r0; r < std::min(rows, r0 + rows_per_mb); ++r) {
      std::vector<int32_t> ids(seq + 1);
      for (auto& t : ids) t = tok(rng);
      for (int64_t i = 0; i < seq; ++i) {
        mb.tokens.push_back(ids[i]);
        mb.labels.push_back(ids[i + 1]);
        mb.positions.push_back(static_cast<int32_t>(i));
      }
      mb.cu_seqlens.push_back(static_cast<int32_t>(mb.tokens.size()));
    }
    mb.max_seqlen = static_cast<int32_t>(seq);
    mbs.push_back(std::move(mb));
  }
  return mbs;
}

absl::Status Run(const std::string& model, int64_t seq, int64_t tokens, int64_t rows_per_mb, const std::string& policy,
                 int steps, int gpu, double offload_ratio) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Preset(model));
  const ModelLayout layout = ModelLayout::Build(config);
  if (tokens % seq != 0 || tokens < seq)
    return absl::InvalidArgumentError("--tokens must be a positive multiple of --seq");
  ActPolicy act = ActPolicy::kRecomputeLayer;
  if (policy == "keep_all")
    act = ActPolicy::kKeepAll;
  else if (policy == "selective")
    act = ActPolicy::kSelective;
  else if (policy != "recompute")
    return absl::InvalidArgumentError("--policy: recompute, selective or keep_all");
  ASSIGN_OR_RETURN(auto backend, MakeCudaBackend(config, gpu));
  ASSIGN_OR_RETURN(auto streamer, ResidentStreamer::Create(layout));
  auto grads = MakeDiscardGradientPath(layout, backend.get());
  StepRunnerOptions ropt;
  ropt.policy = act;
  std::unique_ptr<ActivationStore> activations;
  if (offload_ratio > 0) {
    ASSIGN_OR_RETURN(activations, MakeCudaActivationStore(layout, backend.get(), offload_ratio, gpu));
  }
  StepRunner runner(layout, backend.get(), streamer.get(), grads.get(), ropt, activations.get());
  const std::vector<MicroBatch> mbs = SyntheticBatches(config, tokens, seq, rows_per_mb);
  const float loss_scale = 1.0f / static_cast<float>(tokens);
  std::vector<double> times;
  double loss = 0;
  for (int s = 0; s < steps; ++s) {
    const absl::Time t0 = absl::Now();
    ASSIGN_OR_RETURN(StepResult r, runner.Run(s, mbs, loss_scale));
    RETURN_IF_ERROR(backend->Synchronize());
    times.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    loss = r.loss_sum;
    fprintf(stderr, "step %d: %.3f s loss %.4f\n", s, times.back(), loss);
  }
  std::vector<double> steady(times.begin() + (steps > 1 ? 1 : 0), times.end());
  std::sort(steady.begin(), steady.end());
  const double step_s = steady[steady.size() / 2];
  const double flops_per_token = layout.ModelFlopsPerToken(seq);
  const int64_t peak = backend->peak_memory_bytes() + streamer->device_bytes() + grads->device_bytes();
  nlohmann::json j = {{"mode", "compute_only"},
                      {"model", model},
                      {"policy", policy},
                      {"seq", seq},
                      {"tokens_per_step", tokens},
                      {"micro_batch_rows", rows_per_mb},
                      {"step_s", step_s},
                      {"tokens_per_s", tokens / step_s},
                      {"model_tflops", flops_per_token * tokens / step_s / 1e12},
                      {"peak_gib", peak / 1073741824.0},
                      {"offload_ratio", offload_ratio},
                      {"offload_host_gib", activations ? activations->host_bytes() / 1073741824.0 : 0.0},
                      {"loss", loss}};
  printf("%s\n", j.dump().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace slidedp

int main(int argc, char** argv) {
  CLI::App app{"slidedp compute-only step benchmark (resident weights, no streaming)"};
  std::string model = "qwen3-4b", policy = "recompute";
  int64_t seq = 4096, tokens = 65536, rows = 4;
  int steps = 4, gpu = 0;
  double offload_ratio = 0;
  app.add_option("--model", model, "preset (qwen3-0.6b .. qwen3-14b)");
  app.add_option("--seq", seq, "sequence length");
  app.add_option("--tokens", tokens, "tokens per step (a multiple of --seq)");
  app.add_option("--micro-batch-rows", rows, "rows per micro-batch");
  app.add_option("--policy", policy, "recompute | selective | keep_all");
  app.add_option("--steps", steps, "steps (the first is warm-up)");
  app.add_option("--gpu", gpu, "CUDA device");
  app.add_option("--offload-ratio", offload_ratio, "fraction of layer inputs kept in pinned host memory");
  CLI11_PARSE(app, argc, argv);
  absl::Status s = slidedp::Run(model, seq, tokens, rows, policy, steps, gpu, offload_ratio);
  if (!s.ok()) {
    fprintf(stderr, "bench_step: %s\n", s.ToString().c_str());
    printf("{\"mode\":\"compute_only\",\"error\":\"%s\"}\n", std::string(s.message()).c_str());
    return 1;
  }
  return 0;
}
