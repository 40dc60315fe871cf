// The model families (common/model/model_config.h) end to end through real processes: hostd +
// CPU-backend workers train each family's CI-sized preset (tiny-qwen2: q/k/v biases; tiny-llama:
// llama3-scaled RoPE; tiny-mistral); two workers give one worker's parameters (synchronous DP);
// the checkpoint holds the family's tensors and config; a job resumed from it equals the
// uninterrupted run bit for bit; the checkpoint loads again as an HF model directory. tiny-moe
// (qwen3_moe: a dense layer between sparse ones, 8 experts, top-2) runs the same course, and its
// router's load-balancing loss and expert token counts reach the metrics. tiny-qwen3.5 and
// tiny-qwen3.5-moe (Gated DeltaNet and gated attention layers; the MoE with a shared expert) too,
// and sliding-window attention shorter than the row (tiny-mistral-window: every layer;
// tiny-qwen2-window: a sliding layer after a full one), which changes what the model computes.
// tiny-gemma3 (gemma3: five sliding layers over 16 keys then a full one, sandwich norms, GeGLU,
// scaled embedding, two RoPEs, capped logits) too, and a gemma3 multimodal directory as the hub
// names it trains with its vision tower passed through byte for byte. tiny-gpt-oss (gpt_oss: a
// sliding layer over 16 keys then a full one, sinks, q/k/v/o biases, YaRN, 4 biased experts top-2
// with the clamped SwiGLU, fused as transformers holds them) runs the course too, and so does
// tiny-gemma4 (gemma4: per-layer inputs, full layers of another head_dim whose values are their keys'
// projection, two layers reading earlier layers' keys and values, proportional RoPE, a frozen
// layer_scalar); a gemma4 multimodal directory trains with its towers passed through.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_files.h"
#include "common/data/synthetic.h"
#include "common/model/model_config.h"
#include "common/safetensors/safetensors.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

std::string DataDir() {
  static std::string dir = [] {
    std::string d = ::testing::TempDir() + "/fam-data-" + std::to_string(getpid());
    data::SyntheticOptions o;
    o.vocab_size = 512;
    o.num_documents = 96;
    o.seed = 7;
    o.min_doc_tokens = 8;
    o.max_doc_tokens = 90;
    o.seq_len = 64;
    o.overwrite = data::Overwrite::kYes;
    auto m = data::WriteSyntheticDataset(d, o);
    EXPECT_TRUE(m.ok()) << m.status();
    return d;
  }();
  return dir;
}

// `model` is the spec's model map body: "preset: tiny-llama, init_seed: 3" or "path: DIR".
std::string Spec(const std::string& model, int workers, int steps, const std::string& output, int save_every = 0,
                 const std::string& train_extra = "") {
  return absl::StrCat("name: fam\nmodel: {", model, "}\ndata: {path: ", DataDir(), "}\n",
                      "output: {dir: ", output, ", save_dtype: fp32, keep_last: 5, save_every: ", save_every, "}\n",
                      "train: {seq_len: 64, global_batch: 8, micro_batch: ", 8 / workers / 2, ", steps: ", steps,
                      ", seed: 3, max_grad_norm: 1.0", train_extra, "}\n",
                      "optimizer: {lr: 2.0e-3, weight_decay: 0.1}\n", "runtime: {workers: ", workers,
                      ", step_timeout_ms: 20000}\n");
}

// The FP32 master of a checkpoint saved in fp32, per unit.
std::vector<std::vector<float>> LoadMaster(const std::string& dir, const ModelLayout& layout) {
  const int n = layout.num_units();
  std::vector<std::vector<float>> state(3 * n);
  for (int u = 0; u < n; ++u)
    for (int k = 0; k < 3; ++k) state[k * n + u].resize(layout.units[u].numel);
  checkpoint::StateArrays arrays;
  arrays.master = [&](int u) { return state[u].data(); };
  arrays.moments = checkpoint::Fp32Moments([&](int u) { return state[n + u].data(); },
                                            [&](int u) { return state[2 * n + u].data(); });
  auto loaded = checkpoint::LoadCheckpoint(dir, layout, arrays);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  state.resize(n);
  return state;
}

double MaxAbsDiff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double d = 0;
  for (size_t u = 0; u < a.size() && u < b.size(); ++u)
    for (size_t i = 0; i < a[u].size() && i < b[u].size(); ++i) d = std::max(d, std::fabs(double(a[u][i]) - b[u][i]));
  return d;
}

class FamilyTraining : public ::testing::TestWithParam<std::string> {};

TEST_P(FamilyTraining, TrainsDataParallelResumesAndLoadsBack) {
  const std::string preset = GetParam();
  const ModelConfig config = *ModelConfig::Preset(preset);
  const ModelLayout layout = ModelLayout::Build(config);
  const std::string model = absl::StrCat("preset: ", preset, ", init_seed: 3");
  NodeHarness node(2);

  v1::Job two = MustSucceed(node, Spec(model, 2, 4, "out-two", 2), "two");
  // A MoE model is compared after 2 steps: 2 workers and 1 sum gradients in different orders, and
  // once those FP32 differences move a token across a top-k boundary its expert's gradient
  // changes as a whole (this data does so at step 4), as it would under any data parallelism.
  // gemma4 too: at this learning rate its training grows the same FP32 differences fast (the
  // gradient norms of 2 workers and of 1 differ by 7e-7 at step 2, 1e-3 at step 3: measured; its
  // scores are unscaled products of normed q and k). Its math: cpu_gemma4_math_test.
  const int compared = config.is_moe() || config.is_gemma4() ? 2 : 4;
  v1::Job one = MustSucceed(node, Spec(model, 1, compared, "out-one"), "one");
  ASSERT_FALSE(two.last_checkpoint().empty());
  EXPECT_EQ(two.last().step(), 4);
  EXPECT_TRUE(std::isfinite(two.last().loss()) && two.last().loss() > 0);
  const auto m2 = LoadMaster(compared == 4 ? two.last_checkpoint() : node.dir() + "/out-two/checkpoint-2", layout);
  const auto m1 = LoadMaster(one.last_checkpoint(), layout);
  std::vector<std::vector<float>> init(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) init[u].assign(layout.units[u].numel, 0);
  checkpoint::InitRandom(layout, 3, [&](int u) { return init[u].data(); });
  EXPECT_GT(MaxAbsDiff(m1, init), 1e-3) << "training moved the parameters";
  EXPECT_LT(MaxAbsDiff(m2, m1), 2e-5) << "2 workers against 1 (FP32: only the summation order differs)";

  // The checkpoint is the family's HF directory: its config and exactly its tensors.
  const std::string ckpt = two.last_checkpoint();
  auto cfg = ModelConfig::FromFile(ckpt + "/config.json");
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_EQ(cfg->family, config.family);
  EXPECT_EQ(cfg->RopeInverseFrequencies(), config.RopeInverseFrequencies());
  EXPECT_EQ(cfg->RopeInverseFrequencies(AttentionSpan::kSliding),
            config.RopeInverseFrequencies(AttentionSpan::kSliding));
  for (int64_t l = 0; l < config.num_hidden_layers; ++l) EXPECT_EQ(cfg->AttentionWindow(l), config.AttentionWindow(l));
  const nlohmann::json saved = nlohmann::json::parse(ReadFile(ckpt + "/config.json"));
  // qwen3_5's and gemma3's causal-LM checkpoints: Qwen3_5ForCausalLM's, Gemma3ForCausalLM's text config.
  EXPECT_EQ(saved["model_type"], config.has_multimodal_layout() ? absl::StrCat(ModelTypeName(config.family), "_text")
                                                                : std::string(ModelTypeName(config.family)));
  auto weights = safetensors::SafetensorsFile::Open(ckpt + "/model.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  std::set<std::string> tensors;  // gpt_oss: each expert's slots share its fused tensor
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      EXPECT_NE((*weights)->Find(t.hf_name), nullptr) << t.hf_name;
      tensors.insert(t.hf_name);
    }
  }
  EXPECT_EQ((*weights)->tensors().size(), tensors.size());
  int64_t attention_layer = 0;  // qwen3_5: the first full-attention layer
  while (config.IsLinearAttentionLayer(attention_layer)) ++attention_layer;
  const std::string attn = absl::StrCat("model.layers.", attention_layer, ".self_attn.");
  EXPECT_EQ((*weights)->Find(attn + "q_proj.bias") != nullptr, config.has_qkv_bias());
  EXPECT_EQ((*weights)->Find(attn + "q_norm.weight") != nullptr, config.has_qk_norm());
  EXPECT_EQ((*weights)->Find("model.layers.0.linear_attn.A_log") != nullptr, config.IsLinearAttentionLayer(0));

  // Resumed from step 2, the run ends where the uninterrupted one did, bit for bit.
  v1::Job resumed = MustSucceed(node, Spec(model, 2, 4, "out-resumed"), "resumed", node.dir() + "/out-two/checkpoint-2");
  EXPECT_EQ(resumed.last().step(), 4);
  EXPECT_EQ(MaxAbsDiff(LoadMaster(two.last_checkpoint(), layout), LoadMaster(resumed.last_checkpoint(), layout)), 0.0);

  // The checkpoint as a model directory: the loader takes it (biases included) and trains on.
  v1::Job from_dir = MustSucceed(node, Spec(absl::StrCat("path: ", ckpt), 2, 1, "out-dir"), "from-dir");
  EXPECT_EQ(from_dir.last().step(), 1);
  EXPECT_TRUE(std::isfinite(from_dir.last().loss()));
  EXPECT_TRUE(node.LeakedSegments().empty());
}

INSTANTIATE_TEST_SUITE_P(Presets, FamilyTraining,
                         ::testing::Values("tiny-qwen2", "tiny-llama", "tiny-mistral", "tiny-moe", "tiny-qwen3.5",
                                           "tiny-qwen3.5-moe", "tiny-mistral-window", "tiny-qwen2-window",
                                           "tiny-gemma3", "tiny-gpt-oss", "tiny-gemma4"),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = std::isalnum(static_cast<unsigned char>(c)) ? c : '_';
                           return n;
                         });

// A window of 16 in rows of 64 (documents of 8 to 90 tokens) is another model than full attention:
// from the same initial weights (the layouts are the same) the first step's loss differs.
TEST(SlidingWindowTraining, AWindowShorterThanTheRowChangesTheLoss) {
  NodeHarness node(1);
  double first[2] = {};
  const char* presets[2] = {"tiny-mistral", "tiny-mistral-window"};
  for (int i = 0; i < 2; ++i) {
    const std::string out = absl::StrCat("out-", presets[i]);
    MustSucceed(node, Spec(absl::StrCat("preset: ", presets[i], ", init_seed: 3"), 1, 1, out), presets[i]);
    const auto lines = MetricsLines(node, out, presets[i]);
    ASSERT_EQ(lines.size(), 1u);
    first[i] = lines[0]["loss"];
  }
  std::printf("first step's loss: %.7f full attention, %.7f window 16\n", first[0], first[1]);
  EXPECT_TRUE(std::isfinite(first[1]));
  EXPECT_GT(std::fabs(first[1] - first[0]), 1e-6) << first[0] << " (full) vs " << first[1] << " (window 16)";
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// A MoE job's step record: the load-balancing loss (its coefficient times it is in the loss, and
// only then moves the parameters) and the tokens each expert was routed, summarised.
TEST(MoeTraining, AuxLossIsInTheLossAndExpertTokensReachTheMetrics) {
  const ModelConfig config = *ModelConfig::Preset("tiny-moe");
  const ModelLayout layout = ModelLayout::Build(config);
  const std::string model = "preset: tiny-moe, init_seed: 5";
  NodeHarness node(2);
  MustSucceed(node, Spec(model, 2, 2, "out-plain", 0, ", router_aux_loss_coef: 0"), "plain");
  MustSucceed(node, Spec(model, 2, 2, "out-aux", 0, ", router_aux_loss_coef: 0.5"), "aux");
  const auto plain = MetricsLines(node, "out-plain", "plain"), aux = MetricsLines(node, "out-aux", "aux");
  ASSERT_EQ(plain.size(), 2u);
  ASSERT_EQ(aux.size(), 2u);
  // Step 1 runs from the same weights: the same routing, the same aux loss, the loss apart by
  // 0.5 x it (FP32 sums of the two parts).
  const double a = aux[0]["router_aux_loss"];
  EXPECT_NEAR(static_cast<double>(plain[0]["router_aux_loss"]), a, 1e-6);
  // A balanced router gives top_k (HF's aux counts slots); tiny-moe's random one is near it.
  EXPECT_GT(a, 0.9 * config.num_experts_per_tok);
  EXPECT_LT(a, 4.0 * config.num_experts_per_tok);
  EXPECT_NEAR(static_cast<double>(aux[0]["loss"]) - static_cast<double>(plain[0]["loss"]), 0.5 * a, 1e-4);
  // Each token counts once per expert of its top-k in every sparse layer.
  const nlohmann::json& e = aux[0]["expert_tokens"];
  const double tokens = aux[0]["tokens"];
  EXPECT_DOUBLE_EQ(static_cast<double>(e["mean"]), tokens * config.num_experts_per_tok / config.num_experts);
  EXPECT_LE(static_cast<double>(e["min"]), static_cast<double>(e["mean"]));
  EXPECT_GE(static_cast<double>(e["max"]), static_cast<double>(e["mean"]));
  EXPECT_GE(static_cast<double>(e["imbalance"]), 1.0);
  EXPECT_TRUE(config.IsSparseLayer(e["imbalance_layer"].get<int>()));
  EXPECT_GE(e["unreached"].get<int>(), 0);
  EXPECT_EQ(e["unreached"].get<int>() > 0, static_cast<double>(e["min"]) == 0);
  // The aux gradient moved the second step's loss.
  EXPECT_NE(static_cast<double>(aux[1]["loss"]) - 0.5 * static_cast<double>(aux[1]["router_aux_loss"]),
            static_cast<double>(plain[1]["loss"]));
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// A released Qwen3.5 checkpoint's layout (issue 50): the multimodal wrapper (model.language_model.*),
// experts fused as transformers 5 saves them, a vision tower and mtp.* weights. Trained from the
// directory through hostd and two workers, its checkpoint is the same layout: the untrained tensors
// byte for byte, the experts fused, the wrapper's config; and an export of it too.
TEST(Qwen3_5Training, MultimodalFusedCheckpointKeepsItsLayoutAndUntrainedTensors) {
  ModelConfig config = *ModelConfig::Preset("tiny-qwen3.5-moe");
  config.multimodal = true;
  config.expert_storage = ExpertStorage::kFused;
  const ModelLayout layout = ModelLayout::Build(config);
  std::vector<std::vector<float>> master(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) master[u].assign(layout.units[u].numel, 0.0f);
  checkpoint::InitRandom(layout, 11, [&](int u) { return master[u].data(); });
  checkpoint::PassThrough pass;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"model.visual.patch_embed.proj.weight", {32, 3, 2, 4, 4}},
           {"model.visual.merger.linear_fc2.bias", {64}},
           {"mtp.fc.weight", {64, 128}},
           {"mtp.layers.0.mlp.experts.down_proj", {8, 64, 32}}}) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::string bytes(static_cast<size_t>(2 * n), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 131 + name.size()) % 251);
    pass.push_back({name, safetensors::Dtype::kBF16, shape, bytes});
  }
  NodeHarness node(2);
  const std::string src = node.dir() + "/qwen35-vl";
  std::filesystem::create_directories(src);
  const auto files = checkpoint::internal::PlanWeightFiles(
      layout, [&](int u) -> const float* { return master[u].data(); }, Dtype::kBF16, checkpoint::kDefaultShardMaxBytes,
      &pass);
  ASSERT_TRUE(checkpoint::internal::WriteWeightFiles(src, files, 2).ok());
  std::ofstream(src + "/config.json") << config.ToJson();

  v1::Job job = MustSucceed(node, Spec(absl::StrCat("path: ", src), 2, 2, "out-vl"), "vl");
  EXPECT_EQ(job.last().step(), 2);
  EXPECT_TRUE(std::isfinite(job.last().loss()));
  const std::string ckpt = job.last_checkpoint();
  auto cfg = checkpoint::ModelConfigOfDir(ckpt);
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  EXPECT_TRUE(cfg->multimodal);
  EXPECT_EQ(cfg->expert_storage, ExpertStorage::kFused);
  const nlohmann::json saved = nlohmann::json::parse(ReadFile(ckpt + "/config.json"));
  EXPECT_EQ(saved["model_type"], "qwen3_5_moe");
  EXPECT_EQ(saved["text_config"]["model_type"], "qwen3_5_moe_text");
  auto weights = safetensors::SafetensorsFile::Open(ckpt + "/model.safetensors");
  ASSERT_TRUE(weights.ok()) << weights.status();
  const safetensors::TensorInfo* fused = (*weights)->Find("model.language_model.layers.0.mlp.experts.gate_up_proj");
  ASSERT_NE(fused, nullptr);
  EXPECT_EQ(fused->shape, (std::vector<int64_t>{8, 64, 64}));
  EXPECT_EQ((*weights)->Find("model.language_model.layers.0.mlp.experts.0.gate_proj.weight"), nullptr);
  for (const checkpoint::PassThroughTensor& p : pass) {
    const safetensors::TensorInfo* t = (*weights)->Find(p.name);
    ASSERT_NE(t, nullptr) << p.name;
    EXPECT_EQ(t->shape, p.shape);
    EXPECT_TRUE((*weights)->Bytes(*t) == p.bytes) << p.name << " changed";
  }
  // Trained: the language model moved; its tensors are exactly the layout's plus the untrained ones.
  std::set<std::string> names;
  for (const UnitLayout& u : layout.units)
    for (const TensorSlot& t : u.tensors) names.insert(t.hf_name);
  EXPECT_EQ((*weights)->tensors().size(), names.size() + pass.size());
  // Resumed from its checkpoint, the job reads the untrained tensors from there and keeps them.
  v1::Job more = MustSucceed(node, Spec(absl::StrCat("path: ", src), 2, 3, "out-vl-more"), "vl-more", ckpt);
  auto again = checkpoint::ReadPassThrough(more.last_checkpoint(), config);
  ASSERT_TRUE(again.ok()) << again.status();
  ASSERT_EQ(again->size(), pass.size());
  for (const checkpoint::PassThroughTensor& p : pass) {  // (ReadPassThrough gives them in name order)
    auto it = std::find_if(again->begin(), again->end(), [&](const auto& a) { return a.name == p.name; });
    ASSERT_NE(it, again->end()) << p.name;
    EXPECT_TRUE(it->bytes == p.bytes) << p.name;
  }
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// A released Gemma 3 multimodal checkpoint's layout (Gemma3ForConditionalGeneration) as the hub's
// files name it: language_model.model.*, vision_tower.*, multi_modal_projector.*, and a config with
// text_config and vision_config. Trained from the directory through hostd and two workers, its
// checkpoints keep the directory's names (as transformers 5.17 saves them too), the
// vision tower and projector byte for byte, the wrapper's config; a resumed job keeps them.
TEST(Gemma3Training, HubNamedMultimodalDirectoryTrainsAndKeepsItsVisionTower) {
  ModelConfig config = *ModelConfig::Preset("tiny-gemma3");
  config.multimodal = true;
  config.final_logit_softcapping = 0;  // Gemma3ForConditionalGeneration does not cap its logits
  const ModelLayout layout = ModelLayout::Build(config);
  std::vector<std::vector<float>> master(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) master[u].assign(layout.units[u].numel, 0.0f);
  checkpoint::InitRandom(layout, 13, [&](int u) { return master[u].data(); });
  checkpoint::PassThrough pass;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"model.vision_tower.vision_model.embeddings.patch_embedding.weight", {32, 3, 4, 4}},
           {"model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.bias", {32}},
           {"model.multi_modal_projector.mm_input_projection_weight", {32, 64}},
           {"model.multi_modal_projector.mm_soft_emb_norm.weight", {32}}}) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::string bytes(static_cast<size_t>(2 * n), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 97 + name.size()) % 253);
    pass.push_back({name, safetensors::Dtype::kBF16, shape, bytes});
  }
  NodeHarness node(2);
  const std::string src = node.dir() + "/gemma3-vl";
  std::filesystem::create_directories(src);
  auto files = checkpoint::internal::PlanWeightFiles(
      layout, [&](int u) -> const float* { return master[u].data(); }, Dtype::kBF16, checkpoint::kDefaultShardMaxBytes,
      &pass);
  for (checkpoint::internal::PlannedFile& f : files) {  // the hub's spelling
    for (safetensors::TensorSource& t : f.tensors) {
      for (const auto& [ours, hub] :
           {std::pair<std::string, std::string>{"model.language_model.", "language_model.model."},
            {"model.vision_tower.", "vision_tower."},
            {"model.multi_modal_projector.", "multi_modal_projector."}}) {
        if (absl::StartsWith(t.name, ours)) {
          t.name = hub + t.name.substr(ours.size());
          break;
        }
      }
    }
  }
  ASSERT_TRUE(checkpoint::internal::WriteWeightFiles(src, files, 2).ok());
  nlohmann::json cfg = nlohmann::json::parse(config.ToJson());
  cfg["vision_config"] = {{"model_type", "siglip_vision_model"},
                          {"hidden_size", 32},
                          {"image_size", 8},
                          {"patch_size", 4},
                          {"num_hidden_layers", 1},
                          {"vision_use_head", false}};
  cfg["mm_tokens_per_image"] = 4;
  std::ofstream(src + "/config.json") << cfg.dump(2);
  auto weights0 = safetensors::SafetensorsFile::Open(src + "/model.safetensors");
  ASSERT_TRUE(weights0.ok()) << weights0.status();
  ASSERT_NE((*weights0)->Find("language_model.model.layers.0.pre_feedforward_layernorm.weight"), nullptr);

  v1::Job job = MustSucceed(node, Spec(absl::StrCat("path: ", src), 2, 2, "out-g3vl"), "g3vl");
  EXPECT_EQ(job.last().step(), 2);
  EXPECT_TRUE(std::isfinite(job.last().loss()));
  // Every checkpoint keeps the directory's spelling (as transformers 5.17's save_pretrained writes it).
  ModelConfig hub_config = config;
  hub_config.hub_wrapper_names = true;
  const ModelLayout hub_layout = ModelLayout::Build(hub_config);
  auto check = [&](const std::string& ckpt) {
    const nlohmann::json saved = nlohmann::json::parse(ReadFile(ckpt + "/config.json"));
    EXPECT_EQ(saved["model_type"], "gemma3");
    EXPECT_EQ(saved["text_config"]["model_type"], "gemma3_text");
    EXPECT_EQ(saved["vision_config"]["hidden_size"], 32);
    auto weights = safetensors::SafetensorsFile::Open(ckpt + "/model.safetensors");
    ASSERT_TRUE(weights.ok()) << weights.status();
    std::set<std::string> names;
    for (const UnitLayout& u : hub_layout.units)
      for (const TensorSlot& t : u.tensors) {
        names.insert(t.hf_name);
        EXPECT_NE((*weights)->Find(t.hf_name), nullptr) << t.hf_name;
      }
    for (const checkpoint::PassThroughTensor& p : pass) {
      const std::string hub_name = p.name.substr(std::string("model.").size());
      const safetensors::TensorInfo* t = (*weights)->Find(hub_name);
      ASSERT_NE(t, nullptr) << hub_name;
      EXPECT_EQ(t->shape, p.shape);
      EXPECT_TRUE((*weights)->Bytes(*t) == p.bytes) << p.name << " changed";
    }
    EXPECT_EQ((*weights)->tensors().size(), names.size() + pass.size());
  };
  check(job.last_checkpoint());
  v1::Job more =
      MustSucceed(node, Spec(absl::StrCat("path: ", src), 2, 3, "out-g3vl-more"), "g3vl-more", job.last_checkpoint());
  EXPECT_EQ(more.last().step(), 3);
  check(more.last_checkpoint());
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// A released Gemma 4 checkpoint's layout (Gemma4ForConditionalGeneration): model.language_model.*, a
// vision tower and an audio tower with their embedders, and (as the hub's E2B / E4B files may) a
// kv-shared layer's own k_proj, which transformers ignores. Trained through hostd and two workers: the
// untrained tensors byte for byte, every layer_scalar (a buffer, never trained) as it was despite
// weight decay, the wrapper's config; a resumed job keeps them.
TEST(Gemma4Training, MultimodalDirectoryKeepsItsTowersAndFrozenScalars) {
  ModelConfig config = *ModelConfig::Preset("tiny-gemma4");
  config.multimodal = true;
  config.gemma4.placeholder_tokens = {258880, 258884, 258881};  // Gemma4Config's (outside this vocabulary)
  const ModelLayout layout = ModelLayout::Build(config);
  std::vector<std::vector<float>> master(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) master[u].assign(layout.units[u].numel, 0.0f);
  checkpoint::InitRandom(layout, 17, [&](int u) { return master[u].data(); });
  for (const UnitLayout& u : layout.units) {
    if (const TensorSlot* s = u.Find(kLayerScalar)) master[u.index][s->offset_numel] = 0.375f + 0.125f * u.index;
  }
  checkpoint::PassThrough pass;
  for (const auto& [name, shape] : std::vector<std::pair<std::string, std::vector<int64_t>>>{
           {"model.vision_tower.encoder.layers.0.self_attn.q_proj.linear.weight", {32, 32}},
           {"model.embed_vision.embedding_projection.weight", {64, 32}},
           {"model.audio_tower.layers.0.feed_forward1.ffw_layer_1.linear.weight", {16, 8}},
           {"model.embed_audio.embedding_projection.weight", {64, 16}},
           {"model.language_model.layers.5.self_attn.k_proj.weight", {32, 64}}}) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::string bytes(static_cast<size_t>(2 * n), '\0');
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 89 + name.size()) % 241);
    pass.push_back({name, safetensors::Dtype::kBF16, shape, bytes});
  }
  NodeHarness node(2);
  const std::string src = node.dir() + "/gemma4-vl";
  std::filesystem::create_directories(src);
  const auto files = checkpoint::internal::PlanWeightFiles(
      layout, [&](int u) -> const float* { return master[u].data(); }, Dtype::kF32, checkpoint::kDefaultShardMaxBytes,
      &pass);
  ASSERT_TRUE(checkpoint::internal::WriteWeightFiles(src, files, 2).ok());
  nlohmann::json cfg = nlohmann::json::parse(config.ToJson());
  cfg["vision_config"] = {{"model_type", "gemma4_vision"}, {"hidden_size", 32}, {"num_hidden_layers", 1}};
  cfg["audio_config"] = {{"model_type", "gemma4_audio"}, {"hidden_size", 16}, {"num_hidden_layers", 1}};
  cfg["image_token_id"] = 258880;
  std::ofstream(src + "/config.json") << cfg.dump(2);

  v1::Job job = MustSucceed(node, Spec(absl::StrCat("path: ", src), 2, 2, "out-g4vl"), "g4vl");
  EXPECT_EQ(job.last().step(), 2);
  EXPECT_TRUE(std::isfinite(job.last().loss()));
  auto check = [&](const std::string& ckpt) {
    const nlohmann::json saved = nlohmann::json::parse(ReadFile(ckpt + "/config.json"));
    EXPECT_EQ(saved["model_type"], "gemma4");
    EXPECT_EQ(saved["text_config"]["model_type"], "gemma4_text");
    EXPECT_EQ(saved["audio_config"]["hidden_size"], 16);
    auto weights = safetensors::SafetensorsFile::Open(ckpt + "/model.safetensors");
    ASSERT_TRUE(weights.ok()) << weights.status();
    std::set<std::string> names;
    for (const UnitLayout& u : layout.units) {
      for (const TensorSlot& t : u.tensors) {
        names.insert(t.hf_name);
        const safetensors::TensorInfo* w = (*weights)->Find(t.hf_name);
        ASSERT_NE(w, nullptr) << t.hf_name;
        if (!t.trainable) {  // layer_scalar: the value it started with, weight decay notwithstanding
          std::vector<float> v(1);
          ASSERT_TRUE(safetensors::ConvertToFloat32(w->dtype, (*weights)->Bytes(*w).data(), 1, v.data()).ok());
          EXPECT_EQ(v[0], master[u.index][t.offset_numel]) << t.hf_name;
        }
      }
    }
    for (const checkpoint::PassThroughTensor& p : pass) {
      const safetensors::TensorInfo* t = (*weights)->Find(p.name);
      ASSERT_NE(t, nullptr) << p.name;
      EXPECT_EQ(t->shape, p.shape);
      EXPECT_TRUE((*weights)->Bytes(*t) == p.bytes) << p.name << " changed";
    }
    EXPECT_EQ((*weights)->tensors().size(), names.size() + pass.size());
  };
  check(job.last_checkpoint());
  v1::Job more =
      MustSucceed(node, Spec(absl::StrCat("path: ", src), 2, 3, "out-g4vl-more"), "g4vl-more", job.last_checkpoint());
  EXPECT_EQ(more.last().step(), 3);
  check(more.last_checkpoint());
  EXPECT_TRUE(node.LeakedSegments().empty());
}

}  // namespace
}  // namespace slidedp::testing
