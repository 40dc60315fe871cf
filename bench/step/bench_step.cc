// bench_step: the worker's training step on one GPU in "compute-only" mode: the same StepRunner
// and CUDA kernels as slidedp-worker, but every unit's BF16 parameters resident on the GPU (no
// gates, no H2D) and gradients accumulated on the GPU and dropped (no D2H, no host update). It is
// the ceiling the streamed system is measured against (issue: >= 0.95 of it at >= 64K tokens per
// GPU per step). Prints one JSON line:
//   {"mode":"compute_only","model":..,"layers":..,"tokens_per_step":..,"step_s":..,"tokens_per_s":..,
//    "model_tflops":..,"peak_gib":..}
// Model FLOPs per token: ModelLayout::ModelFlopsPerToken (the FSDP2 peer's convention), of the model
// as run: --layers reduces the preset's depth (a long sequence's ceiling measured on a few layers,
// the per-layer rate being what matters), --max-position-embeddings / --rope-scaling apply a job's
// context override (model.max_position_embeddings, model.rope_scaling) so rows past the preset's
// context run, --tile-tokens is runtime.tile_tokens, --checkpoint-dtype runtime.checkpoint_dtype.
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

// What to run (the command line).
struct BenchOptions {
  std::string model = "qwen3-4b";
  std::string policy = "recompute";
  int64_t seq = 4096;
  int64_t tokens = 65536;
  int64_t rows_per_mb = 4;
  int steps = 4;
  int gpu = 0;
  double offload_ratio = 0;
  int64_t max_position_embeddings = 0;  // 0: the preset's
  std::string rope_scaling_json;        // empty: the preset's RoPE
  int64_t tile_tokens = 0;              // 0: the backend's default (runtime.tile_tokens auto)
  int64_t layers = 0;                   // 0: the preset's depth
  std::string checkpoint_dtype = "fp32";  // runtime.checkpoint_dtype: fp32 | bf16
};

// The preset with the command line's context override and depth.
absl::StatusOr<ModelConfig> BenchConfig(const BenchOptions& o) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::Preset(o.model));
  if (o.max_position_embeddings > 0 || !o.rope_scaling_json.empty()) {
    RETURN_IF_ERROR(config.OverrideContext(o.max_position_embeddings, o.rope_scaling_json));
  }
  if (o.layers > 0) {
    if (o.layers > config.num_hidden_layers) {
      return absl::InvalidArgumentError(absl::StrCat("--layers ", o.layers, ": ", o.model, " has ",
                                                     config.num_hidden_layers, " (--layers only reduces the depth)"));
    }
    RETURN_IF_ERROR(config.ReduceDepth(o.layers));
  }
  if (o.seq > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("--seq ", o.seq, " exceeds max_position_embeddings ",
                                                   config.max_position_embeddings,
                                                   " (raise it with --max-position-embeddings, and --rope-scaling)"));
  }
  return config;
}

absl::Status Run(const BenchOptions& o) {
  ASSIGN_OR_RETURN(const ModelConfig config, BenchConfig(o));
  const ModelLayout layout = ModelLayout::Build(config);
  const int64_t seq = o.seq, tokens = o.tokens;
  if (tokens % seq != 0 || tokens < seq)
    return absl::InvalidArgumentError("--tokens must be a positive multiple of --seq");
  ActPolicy act = ActPolicy::kRecomputeLayer;
  if (o.policy == "keep_all")
    act = ActPolicy::kKeepAll;
  else if (o.policy == "selective")
    act = ActPolicy::kSelective;
  else if (o.policy != "recompute")
    return absl::InvalidArgumentError("--policy: recompute, selective or keep_all");
  if (o.checkpoint_dtype != "fp32" && o.checkpoint_dtype != "bf16") {
    return absl::InvalidArgumentError("--checkpoint-dtype: fp32 or bf16");
  }
  ASSIGN_OR_RETURN(auto backend, MakeCudaBackend(config, o.gpu));
  if (o.tile_tokens > 0) backend->SetTileTokens(o.tile_tokens);
  ASSIGN_OR_RETURN(auto streamer, ResidentStreamer::Create(layout));
  auto grads = MakeDiscardGradientPath(layout, backend.get());
  StepRunnerOptions ropt;
  ropt.policy = act;
  ropt.checkpoint_dtype = o.checkpoint_dtype == "bf16" ? Dtype::kBF16 : Dtype::kF32;
  std::unique_ptr<ActivationStore> activations;
  if (o.offload_ratio > 0) {
    ASSIGN_OR_RETURN(activations, MakeCudaActivationStore(layout, backend.get(), o.offload_ratio, o.gpu));
  }
  StepRunner runner(layout, backend.get(), streamer.get(), grads.get(), ropt, activations.get());
  const std::vector<MicroBatch> mbs = SyntheticBatches(config, tokens, seq, o.rows_per_mb);
  const float loss_scale = 1.0f / static_cast<float>(tokens);
  std::vector<double> times;
  double loss = 0;
  for (int s = 0; s < o.steps; ++s) {
    const absl::Time t0 = absl::Now();
    ASSIGN_OR_RETURN(StepResult r, runner.Run(s, mbs, loss_scale));
    RETURN_IF_ERROR(backend->Synchronize());
    times.push_back(absl::ToDoubleSeconds(absl::Now() - t0));
    loss = r.loss_sum;
    fprintf(stderr, "step %d: %.3f s loss %.4f\n", s, times.back(), loss);
  }
  std::vector<double> steady(times.begin() + (o.steps > 1 ? 1 : 0), times.end());
  std::sort(steady.begin(), steady.end());
  const double step_s = steady[steady.size() / 2];
  const double flops_per_token = layout.ModelFlopsPerToken(seq);
  const int64_t peak = backend->peak_memory_bytes() + streamer->device_bytes() + grads->device_bytes();
  nlohmann::json j = {
      {"mode", "compute_only"},
      {"model", o.model},
      {"layers", config.num_hidden_layers},
      {"max_position_embeddings", config.max_position_embeddings},
      {"rope_scaling",
       o.rope_scaling_json.empty() ? nlohmann::json() : nlohmann::json::parse(o.rope_scaling_json, nullptr, false)},
      {"tile_tokens", backend->tile_tokens()},
      {"policy", o.policy},
      {"seq", seq},
      {"tokens_per_step", tokens},
      {"micro_batch_rows", o.rows_per_mb},
      {"step_s", step_s},
      {"tokens_per_s", tokens / step_s},
      {"model_tflops", flops_per_token * tokens / step_s / 1e12},
      {"peak_gib", peak / 1073741824.0},
      {"offload_ratio", o.offload_ratio},
      {"checkpoint_dtype", o.checkpoint_dtype},
      {"offload_host_gib", activations ? activations->host_bytes() / 1073741824.0 : 0.0},
      {"loss", loss}};
  printf("%s\n", j.dump().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace slidedp

int main(int argc, char** argv) {
  CLI::App app{"slidedp compute-only step benchmark (resident weights, no streaming)"};
  slidedp::BenchOptions o;
  app.add_option("--model", o.model, "preset (qwen3-0.6b .. qwen3-14b)");
  app.add_option("--seq", o.seq, "sequence length");
  app.add_option("--tokens", o.tokens, "tokens per step (a multiple of --seq)");
  app.add_option("--micro-batch-rows", o.rows_per_mb, "rows per micro-batch");
  app.add_option("--policy", o.policy, "recompute | selective | keep_all");
  app.add_option("--steps", o.steps, "steps (the first is warm-up)");
  app.add_option("--gpu", o.gpu, "CUDA device");
  app.add_option("--offload-ratio", o.offload_ratio, "fraction of layer inputs kept in pinned host memory");
  app.add_option("--max-position-embeddings", o.max_position_embeddings,
                 "the context the model is run at (model.max_position_embeddings; 0: the preset's)");
  app.add_option("--rope-scaling", o.rope_scaling_json,
                 "RoPE for the longer context as HF's rope_scaling object, JSON (model.rope_scaling), e.g. "
                 "'{\"rope_type\":\"yarn\",\"factor\":8.0,\"original_max_position_embeddings\":32768}'");
  app.add_option("--tile-tokens", o.tile_tokens,
                 "tokens per tile of the layers' token-local work and the head (runtime.tile_tokens; 0: default)");
  app.add_option("--checkpoint-dtype", o.checkpoint_dtype,
                 "the type layer inputs wait in between forward and backward (runtime.checkpoint_dtype): fp32 | bf16");
  app.add_option("--layers", o.layers, "decoder layers (fewer than the preset's: a reduced-depth run; 0: all)");
  CLI11_PARSE(app, argc, argv);
  absl::Status s = slidedp::Run(o);
  if (!s.ok()) {
    fprintf(stderr, "bench_step: %s\n", s.ToString().c_str());
    const nlohmann::json j = {{"mode", "compute_only"}, {"error", std::string(s.message())}};
    printf("%s\n", j.dump().c_str());
    return 1;
  }
  return 0;
}
