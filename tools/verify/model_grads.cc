// model_grads: loss and every parameter gradient of an HF Qwen3 model on one token batch, through
// our compute backend (CPU or CUDA), written as safetensors for tools/verify/hf_compare.py.
//
//   model_grads --model HF_DIR --tokens BATCH.json --backend cuda|cpu --out GRADS.safetensors
//               [--grouping per-row|single] [--policy keep-all|recompute|selective] [--device N]
//               [--embedding-rows fp32|bf16]
//
// The model directory is loaded with the checkpoint loader (FP32), rounded to BF16 per unit (the
// upload mirror the workers compute with; the norm weights and the embedding rows also kept in
// FP32, as the workers get them by default) and run non-streaming by RunWholeModel with
// loss_scale = 1 / (trained labels of the whole batch), i.e. the mean token cross entropy as HF's
// loss. Output: every parameter's gradient under its HF name (F32, HF shape, no padding; a tied
// model has only model.embed_tokens.weight, holding both contributions) and "loss" [1] F32, and "rope.inv_freq" [head_dim / 2] F32 (the RoPE frequencies computed with).
// The batch file format is described in tools/verify/token_batch.h. One JSON summary line goes to
// stdout.
#include <chrono>
#include <iostream>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "common/numeric/bf16.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "nlohmann/json.hpp"
#include "tools/verify/token_batch.h"
#include "tools/verify/whole_model.h"
#include "worker/compute/backend.h"

namespace slidedp::verify {
namespace {

struct Options {
  std::string model_dir;
  std::string tokens_path;
  std::string backend = "cpu";
  std::string out_path;
  std::string grouping = "per-row";
  std::string policy = "keep-all";
  std::string embedding_rows = "fp32";  // runtime.embedding_rows
  int device = 0;
};

absl::StatusOr<ActPolicy> ParsePolicy(const std::string& s) {
  if (s == "keep-all") return ActPolicy::kKeepAll;
  if (s == "recompute") return ActPolicy::kRecomputeLayer;
  if (s == "selective") return ActPolicy::kSelective;
  return absl::InvalidArgumentError(absl::StrCat("--policy ", s, ": expected keep-all, recompute or selective"));
}

absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeBackend(const std::string& name, const ModelConfig& config,
                                                            int device) {
  if (name == "cpu") return MakeCpuBackend(config);
  if (name == "cuda") {
#ifdef SLIDEDP_VERIFY_HAVE_CUDA
    return MakeCudaBackend(config, device);
#else
    (void)device;
    return absl::UnimplementedError("--backend cuda: this build has no CUDA backend (SLIDEDP_CUDA off)");
#endif
  }
  return absl::InvalidArgumentError(absl::StrCat("--backend ", name, ": expected cuda or cpu"));
}

absl::Status Run(const Options& o) {
  ASSIGN_OR_RETURN(const ModelConfig config, checkpoint::ModelConfigOfDir(o.model_dir));
  const ModelLayout layout = ModelLayout::Build(config);
  ASSIGN_OR_RETURN(const ActPolicy policy, ParsePolicy(o.policy));
  if (o.grouping != "per-row" && o.grouping != "single") {
    return absl::InvalidArgumentError(absl::StrCat("--grouping ", o.grouping, ": expected per-row or single"));
  }
  const Grouping grouping = o.grouping == "single" ? Grouping::kSingle : Grouping::kPerRow;

  if (o.embedding_rows != "fp32" && o.embedding_rows != "bf16") {
    return absl::InvalidArgumentError(absl::StrCat("--embedding-rows ", o.embedding_rows, ": expected fp32 or bf16"));
  }
  // FP32 master as loaded, then what the workers compute with: its BF16 copy, the norm weights
  // in FP32 (runtime.norm_weights: fp32) and the embedding rows in FP32 (runtime.embedding_rows).
  std::vector<std::vector<float>> master(layout.num_units()), norms(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) master[u].assign(layout.units[u].numel, 0.0f);
  RETURN_IF_ERROR(checkpoint::LoadHfModel(o.model_dir, layout, [&](int u) { return master[u].data(); }));
  std::vector<std::vector<bf16_t>> params(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) {
    params[u].resize(master[u].size());
    for (size_t i = 0; i < master[u].size(); ++i) params[u][i] = FloatToBf16(master[u][i]);
    norms[u].resize(layout.units[u].fp32_numel);
    CopyNormsFromMaster(layout.units[u], master[u].data(), norms[u].data());
  }
  std::vector<float> embed_fp32;
  if (o.embedding_rows == "fp32") embed_fp32 = std::move(master[0]);
  master.clear();

  ASSIGN_OR_RETURN(const TokenBatch tokens, ReadTokenBatchFile(o.tokens_path));
  const std::vector<MicroBatch> batches = BuildMicroBatches(tokens, grouping);
  int64_t trained = 0, num_tokens = 0;
  for (const MicroBatch& mb : batches) {
    trained += mb.num_trained();
    num_tokens += mb.num_tokens();
  }
  if (trained == 0) return absl::InvalidArgumentError(absl::StrCat(o.tokens_path, ": no token has a label"));
  const float loss_scale = static_cast<float>(1.0 / static_cast<double>(trained));

  ASSIGN_OR_RETURN(std::unique_ptr<ComputeBackend> backend, MakeBackend(o.backend, config, o.device));
  const auto t0 = std::chrono::steady_clock::now();
  // A MoE model: the load-balancing loss when its config asks for it, as HF's forward adds it.
  const double aux_coef = config.output_router_logits ? config.router_aux_loss_coef : 0.0;
  ASSIGN_OR_RETURN(WholeModelResult result, RunWholeModel(*backend, layout, params, batches, loss_scale, policy, &norms,
                                                          embed_fp32.empty() ? nullptr : &embed_fp32, aux_coef));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  const float loss = static_cast<float>(result.loss);
  std::vector<safetensors::TensorSource> out = HfTensorsF32(layout, result.unit_grads);
  safetensors::TensorSource loss_tensor;
  loss_tensor.name = "loss";
  loss_tensor.dtype = safetensors::Dtype::kF32;
  loss_tensor.shape = {1};
  loss_tensor.data = &loss;
  out.push_back(std::move(loss_tensor));
  // The RoPE inverse frequencies our backends computed with (ModelConfig::RopeInverseFrequencies),
  // for a bitwise check against HF's rotary_emb.inv_freq.
  const std::vector<float> inv_freq = config.RopeInverseFrequencies();
  safetensors::TensorSource rope_tensor;
  rope_tensor.name = "rope.inv_freq";
  rope_tensor.dtype = safetensors::Dtype::kF32;
  rope_tensor.shape = {static_cast<int64_t>(inv_freq.size())};
  rope_tensor.data = inv_freq.data();
  out.push_back(std::move(rope_tensor));
  // MoE: the experts each micro-batch's tokens were routed to, per sparse layer ("routing.B.L":
  // micro-batch B, sparse ordinal L, [tokens, top_k] int32), so the HF reference can follow the
  // same routing (tools/verify/hf_compare.py: expert gradients are discontinuous in it).
  for (size_t b = 0; b < result.routing.size(); ++b) {
    for (size_t l = 0; l < result.routing[b].size(); ++l) {
      safetensors::TensorSource t;
      t.name = absl::StrCat("routing.", b, ".", l);
      t.dtype = safetensors::Dtype::kI32;
      t.shape = {static_cast<int64_t>(result.routing[b][l].size()) / config.num_experts_per_tok,
                 config.num_experts_per_tok};
      t.data = result.routing[b][l].data();
      out.push_back(std::move(t));
    }
  }
  safetensors::WriteOptions wo;
  wo.durability = safetensors::Durability::kNone;
  wo.metadata = {{"backend", o.backend},
                 {"grouping", o.grouping},
                 {"policy", o.policy},
                 {"micro_batches", std::to_string(batches.size())},
                 {"num_tokens", std::to_string(num_tokens)},
                 {"trained_tokens", std::to_string(trained)}};
  RETURN_IF_ERROR(safetensors::WriteFile(o.out_path, out, wo).status());

  nlohmann::json summary = {{"loss", result.loss},         {"backend", o.backend},
                            {"grouping", o.grouping},      {"policy", o.policy},
                            {"micro_batches", batches.size()}, {"num_tokens", num_tokens},
                            {"trained_tokens", trained},   {"seconds", seconds},
                            {"out", o.out_path}};
  std::cout << summary.dump() << std::endl;
  return absl::OkStatus();
}

}  // namespace
}  // namespace slidedp::verify

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  slidedp::verify::Options o;
  CLI::App app{"Loss and parameter gradients of an HF Qwen3 model on a token batch, through a slidedp backend"};
  app.add_option("--model", o.model_dir, "HF model directory (config.json + safetensors)")->required();
  app.add_option("--tokens", o.tokens_path, "token batch JSON (tools/verify/token_batch.h)")->required();
  app.add_option("--backend", o.backend, "cuda or cpu")->capture_default_str();
  app.add_option("--out", o.out_path, "output safetensors file")->required();
  app.add_option("--grouping", o.grouping, "per-row (one micro-batch per row) or single")->capture_default_str();
  app.add_option("--policy", o.policy, "decoder activation policy: keep-all, recompute, selective")
      ->capture_default_str();
  app.add_option("--device", o.device, "CUDA device index")->capture_default_str();
  app.add_option("--embedding-rows", o.embedding_rows, "embedding lookup from FP32 (the workers' default) or BF16 rows")
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  const absl::Status s = slidedp::verify::Run(o);
  if (!s.ok()) {
    std::cerr << "model_grads: " << s << std::endl;
    return 1;
  }
  return 0;
}
