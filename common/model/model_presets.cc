// ModelConfig::Preset: the named shapes benchmarks and tests build models of (see model_config.h).
#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"

namespace slidedp {

std::string ModelConfig::PresetNames() {
  return "qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b, qwen3-14b, qwen3-32b, qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-3b, "
         "qwen2.5-7b, qwen2.5-14b, llama3.2-1b, llama3.2-3b, llama3.1-8b, mistral-7b, qwen3-30b-a3b, tiny, tiny-qwen2, "
         "tiny-qwen2-window, tiny-llama, tiny-mistral, tiny-mistral-window, tiny-moe, qwen3.5-0.8b, qwen3.5-2b, "
         "qwen3.5-4b, qwen3.5-9b, qwen3.5-27b, qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, tiny-qwen3.5, "
         "tiny-qwen3.5-moe, gemma3-1b, gemma3-4b, gemma3-12b, gemma3-27b, tiny-gemma3, gpt-oss-20b, gpt-oss-120b, "
         "tiny-gpt-oss, gemma4-e2b, gemma4-e4b, gemma4-31b, tiny-gemma4";
}

namespace {

// The shape of a preset: sizes, and whether the LM head is the embedding.
void SetShape(ModelConfig& c, int64_t h, int64_t l, int64_t nh, int64_t inter, bool tied) {
  c.hidden_size = h;
  c.num_hidden_layers = l;
  c.num_attention_heads = nh;
  c.intermediate_size = inter;
  c.tie_word_embeddings = tied;
}

// Qwen3-MoE as released: softmax top-k renormalised, every layer sparse, HF's aux-loss settings.
void SetMoe(ModelConfig& c, int64_t experts, int64_t top_k, int64_t expert_intermediate) {
  c.num_experts = experts;
  c.num_experts_per_tok = top_k;
  c.moe_intermediate_size = expert_intermediate;
  c.norm_topk_prob = true;
  c.decoder_sparse_step = 1;
  c.router_aux_loss_coef = 0.001;
  c.output_router_logits = false;
}

// The CI-sized shape every tiny preset starts from.
void SetTiny(ModelConfig& c, ModelFamily family) {
  SetShape(c, 64, 2, 4, 128, true);
  c.family = family;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.vocab_size = 512;
  c.max_position_embeddings = 4096;
}

// One released Qwen3.5 language model: the text_config of its hub config.json (the multimodal
// checkpoint's language model; vision tower and MTP weights are not part of a preset). Every size
// shares the rest: vocab 248,320, gated attention at head_dim 256 with a quarter rotated (theta 1e7),
// a Gated DeltaNet of 16 key heads of 128 and value heads of 128 with a conv of 4, full attention
// in every fourth layer (full_attention_interval 4), 262,144 positions, RMSNorm eps 1e-6.
struct Qwen3_5HubShape {
  const char* name;
  int64_t hidden;
  int64_t layers;
  int64_t heads;
  int64_t kv_heads;
  int64_t intermediate;        // the dense MLP's; the routed experts' for qwen3_5_moe (see below)
  int64_t linear_value_heads;  // linear_num_value_heads: what grows with size besides the above
  bool tied;
  int64_t experts;              // qwen3_5_moe only (0 for dense): num_experts,
  int64_t top_k;                // num_experts_per_tok,
  int64_t shared_intermediate;  // shared_expert_intermediate_size
};

// Each row is https://huggingface.co/<repo>/blob/main/config.json's text_config, read field by field
// (where the copies read are listed: docs/model-families.md, "Presets"). A size whose config could
// not be read is not listed.
constexpr Qwen3_5HubShape kQwen3_5Hub[] = {
    {"qwen3.5-0.8b", 1024, 24, 8, 2, 3584, 16, true, 0, 0, 0},               // Qwen/Qwen3.5-0.8B
    {"qwen3.5-2b", 2048, 24, 8, 2, 6144, 16, true, 0, 0, 0},                 // Qwen/Qwen3.5-2B
    {"qwen3.5-4b", 2560, 32, 16, 4, 9216, 32, true, 0, 0, 0},                // Qwen/Qwen3.5-4B
    {"qwen3.5-9b", 4096, 32, 16, 4, 12288, 32, false, 0, 0, 0},              // Qwen/Qwen3.5-9B
    {"qwen3.5-27b", 5120, 64, 24, 4, 17408, 48, false, 0, 0, 0},             // Qwen/Qwen3.5-27B
    {"qwen3.5-35b-a3b", 2048, 40, 16, 2, 512, 32, false, 256, 8, 512},       // Qwen/Qwen3.5-35B-A3B
    {"qwen3.5-122b-a10b", 3072, 48, 32, 2, 1024, 64, false, 256, 8, 1024},   // Qwen/Qwen3.5-122B-A10B
    {"qwen3.5-397b-a17b", 4096, 60, 32, 2, 1024, 64, false, 512, 10, 1024},  // Qwen/Qwen3.5-397B-A17B
};

// Qwen3.5's presets (ModelConfig::Preset): false for another name.
bool Qwen3_5Preset(absl::string_view name, ModelConfig& c) {
  auto moe = [&](int64_t experts, int64_t top_k, int64_t expert_intermediate) {
    SetMoe(c, experts, top_k, expert_intermediate);
  };
  const auto* hub = std::find_if(std::begin(kQwen3_5Hub), std::end(kQwen3_5Hub),
                                 [&](const Qwen3_5HubShape& s) { return name == s.name; });
  if (hub != std::end(kQwen3_5Hub)) {
    const Qwen3_5HubShape& s = *hub;
    // Qwen3_5MoeTextConfig has no intermediate_size (every layer is sparse and nothing reads it);
    // the MoE rows carry the expert size there so the field stays in range for Validate.
    SetShape(c, s.hidden, s.layers, s.heads, s.intermediate, s.tied);
    c.family = s.experts > 0 ? ModelFamily::kQwen3_5Moe : ModelFamily::kQwen3_5;
    c.num_key_value_heads = s.kv_heads;
    c.vocab_size = 248320;
    c.head_dim = 256;
    c.rope_theta = 1e7;
    c.partial_rotary_factor = 0.25;
    c.max_position_embeddings = 262144;
    c.rms_norm_eps = 1e-6;
    c.linear = LinearAttentionConfig{16, s.linear_value_heads, 128, 128, 4};
    if (s.experts > 0) {
      moe(s.experts, s.top_k, s.intermediate);
      c.shared_expert_intermediate_size = s.shared_intermediate;
    }
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      c.layer_mixers.push_back((l + 1) % 4 == 0 ? TokenMixer::kAttention : TokenMixer::kLinearAttention);
    }
  } else if (name == "tiny-qwen3.5" || name == "tiny-qwen3.5-moe") {
    // CI-sized qwen3_5: four layers in the released 3:1 pattern (linear, linear, linear, full),
    // gated attention at head_dim 32 with a quarter of it rotated, a Gated DeltaNet of 2 key and 4
    // value heads of 16.
    SetTiny(c, name == "tiny-qwen3.5" ? ModelFamily::kQwen3_5 : ModelFamily::kQwen3_5Moe);
    c.num_hidden_layers = 4;
    c.head_dim = 32;
    c.rope_theta = 1e7;
    c.partial_rotary_factor = 0.25;
    c.linear = LinearAttentionConfig{2, 4, 16, 16, 4};
    c.layer_mixers = {TokenMixer::kLinearAttention, TokenMixer::kLinearAttention, TokenMixer::kLinearAttention,
                      TokenMixer::kAttention};
    if (c.family == ModelFamily::kQwen3_5Moe) {
      c.tie_word_embeddings = false;
      moe(8, 2, 32);
      c.shared_expert_intermediate_size = 48;
    }
  } else {
    return false;
  }
  return true;
}

// One released Gemma 3 language model: google/gemma-3-<size>-pt's config.json (gemma3_text for 1B;
// the multimodal checkpoints' text_config, with Gemma3TextConfig's defaults where it says nothing,
// for the others; vision tower not included). Every size shares the rest: RoPE bases 1e6 (global)
// and 1e4 (sliding), five sliding layers then a full one, tied embeddings, RMSNorm eps 1e-6, no soft-
// capping (both null). Sources: docs/model-families.md, "Gemma 3".
struct Gemma3HubShape {
  const char* name;
  int64_t hidden;
  int64_t layers;
  int64_t heads;
  int64_t kv_heads;
  int64_t head_dim;
  int64_t intermediate;
  double query_pre_attn_scalar;
  int64_t vocab;  // 262,144 (1B); the multimodal ones' default 262,208
  int64_t sliding_window;
  int64_t max_positions;
  double global_rope_linear;  // the full-attention layers' linear RoPE factor (0: none)
};

constexpr Gemma3HubShape kGemma3Hub[] = {
    {"gemma3-1b", 1152, 26, 4, 1, 256, 6912, 256, 262144, 512, 32768, 0},        // google/gemma-3-1b-pt
    {"gemma3-4b", 2560, 34, 8, 4, 256, 10240, 256, 262208, 1024, 131072, 8},     // google/gemma-3-4b-pt
    {"gemma3-12b", 3840, 48, 16, 8, 256, 15360, 256, 262208, 1024, 131072, 8},   // google/gemma-3-12b-pt
    {"gemma3-27b", 5376, 62, 32, 16, 128, 21504, 168, 262208, 1024, 131072, 8},  // google/gemma-3-27b-pt
};

// Gemma 3's presets (ModelConfig::Preset): false for another name.
bool Gemma3Preset(absl::string_view name, ModelConfig& c) {
  c.family = ModelFamily::kGemma3;
  c.rope_theta = 1e6;
  c.sliding_rope_theta = 1e4;
  c.rms_norm_eps = 1e-6;
  c.pad_token_id = 0;
  constexpr int64_t kPattern = 6;  // five sliding layers, then a full one
  const auto* hub = std::find_if(std::begin(kGemma3Hub), std::end(kGemma3Hub),
                                 [&](const Gemma3HubShape& s) { return name == s.name; });
  if (hub != std::end(kGemma3Hub)) {
    const Gemma3HubShape& s = *hub;
    SetShape(c, s.hidden, s.layers, s.heads, s.intermediate, true);
    c.num_key_value_heads = s.kv_heads;
    c.head_dim = s.head_dim;
    c.query_pre_attn_scalar = s.query_pre_attn_scalar;
    c.vocab_size = s.vocab;
    c.sliding_window = s.sliding_window;
    c.max_position_embeddings = s.max_positions;
    if (s.global_rope_linear > 0) {
      c.rope_scaling.type = RopeScaling::Type::kLinear;
      c.rope_scaling.factor = s.global_rope_linear;
    }
  } else if (name == "tiny-gemma3") {
    // CI-sized: six layers in the released 5:1 pattern, a window of 16 (shorter than CI's rows of
    // 64 and most of its documents), query_pre_attn_scalar apart from head_dim, the released 4B+'s
    // linear factor on the global RoPE, and soft-capped logits (Gemma3ForCausalLM's
    // final_logit_softcapping; no released config sets it) so CI runs every piece of the family.
    SetTiny(c, ModelFamily::kGemma3);
    c.num_hidden_layers = 6;
    c.query_pre_attn_scalar = 24;
    c.sliding_window = 16;
    c.rope_scaling.type = RopeScaling::Type::kLinear;
    c.rope_scaling.factor = 8;
    c.final_logit_softcapping = 10;
  } else {
    return false;
  }
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    c.layer_spans.push_back((l + 1) % kPattern != 0 ? AttentionSpan::kSliding : AttentionSpan::kFull);
  }
  return true;
}

// GPT-OSS's presets (ModelConfig::Preset): false for another name. The released ones are
// openai/gpt-oss-20b's and -120b's config.json (docs/model-families.md, "GPT-OSS"): hidden 2880, 64
// query heads and 8 kv heads of 64, experts of 2880 (4 a token), vocabulary 201,088, sliding and
// full layers alternating (window 128), RoPE theta 150,000 with YaRN factor 32 over 4,096
// positions (beta_fast 32, beta_slow 1, not truncated), 131,072 positions, eps 1e-5, untied,
// router_aux_loss_coef 0.9 (applied only with output_router_logits, false), pad <|endoftext|>.
bool GptOssPreset(absl::string_view name, ModelConfig& c) {
  c.family = ModelFamily::kGptOss;
  int64_t experts = 0, top_k = 4;
  if (name == "gpt-oss-20b" || name == "gpt-oss-120b") {
    const bool big = name == "gpt-oss-120b";
    SetShape(c, 2880, big ? 36 : 24, 64, 2880, false);
    c.num_key_value_heads = 8;
    c.head_dim = 64;
    c.vocab_size = 201088;
    c.max_position_embeddings = 131072;
    c.sliding_window = 128;
    c.pad_token_id = 199999;
    experts = big ? 128 : 32;
  } else if (name == "tiny-gpt-oss") {
    // CI-sized: a sliding layer (window 16, shorter than CI's rows of 64) then a full one, 4
    // experts top-2 of width 32, the released RoPE (at head_dim 16 its YaRN ramp spans
    // frequencies 2 to 4 of 8).
    SetTiny(c, ModelFamily::kGptOss);
    c.tie_word_embeddings = false;
    c.intermediate_size = 32;
    c.sliding_window = 16;
    experts = 4;
    top_k = 2;
  } else {
    return false;
  }
  c.rms_norm_eps = 1e-5;
  c.rope_theta = 150000;
  c.rope_scaling.type = RopeScaling::Type::kYarn;
  c.rope_scaling.factor = 32;
  c.rope_scaling.original_max_position_embeddings = 4096;
  c.rope_scaling.beta_fast = 32;
  c.rope_scaling.beta_slow = 1;
  c.rope_scaling.truncate = false;
  SetMoe(c, experts, top_k, c.intermediate_size);
  c.router_aux_loss_coef = 0.9;
  c.expert_storage = ExpertStorage::kFused;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    c.layer_spans.push_back(l % 2 == 0 ? AttentionSpan::kSliding : AttentionSpan::kFull);
  }
  return true;
}

}  // namespace

absl::StatusOr<ModelConfig> ModelConfig::Preset(absl::string_view name) {
  ModelConfig c;
  c.vocab_size = 151936;
  c.head_dim = 128;
  c.num_key_value_heads = 8;
  auto set = [&](int64_t h, int64_t l, int64_t nh, int64_t inter, bool tied) { SetShape(c, h, l, nh, inter, tied); };
  // Llama 3.x: vocab 128,256, theta 500,000, eps 1e-5, llama3 RoPE scaling over 8,192.
  auto llama3 = [&](double factor) {
    c.family = ModelFamily::kLlama;
    c.vocab_size = 128256;
    c.rope_theta = 500000;
    c.rms_norm_eps = 1e-5;
    c.max_position_embeddings = 131072;
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = factor;
    c.rope_scaling.low_freq_factor = 1;
    c.rope_scaling.high_freq_factor = 4;
    c.rope_scaling.original_max_position_embeddings = 8192;
  };
  auto moe = [&](int64_t experts, int64_t top_k, int64_t expert_intermediate) {
    SetMoe(c, experts, top_k, expert_intermediate);
  };
  auto tiny = [&](ModelFamily family) { SetTiny(c, family); };
  if (name == "qwen3-0.6b") {
    set(1024, 28, 16, 3072, true);
  } else if (name == "qwen3-1.7b") {
    set(2048, 28, 16, 6144, true);
  } else if (name == "qwen3-4b") {
    set(2560, 36, 32, 9728, true);
  } else if (name == "qwen3-8b") {
    set(4096, 36, 32, 12288, false);
  } else if (name == "qwen3-14b") {
    set(5120, 40, 40, 17408, false);
  } else if (name == "qwen3-32b") {  // the hub's Qwen/Qwen3-32B config.json: 64 query heads on hidden 5120
    set(5120, 64, 64, 25600, false);
  } else if (absl::StartsWith(name, "qwen2.5-")) {
    c.family = ModelFamily::kQwen2;
    c.max_position_embeddings = 32768;
    if (name == "qwen2.5-0.5b") {
      set(896, 24, 14, 4864, true);
      c.num_key_value_heads = 2;
      c.head_dim = 64;
    } else if (name == "qwen2.5-1.5b") {
      set(1536, 28, 12, 8960, true);
      c.num_key_value_heads = 2;
    } else if (name == "qwen2.5-3b") {
      set(2048, 36, 16, 11008, true);
      c.num_key_value_heads = 2;
    } else if (name == "qwen2.5-7b") {
      set(3584, 28, 28, 18944, false);
      c.num_key_value_heads = 4;
      c.vocab_size = 152064;
    } else if (name == "qwen2.5-14b") {
      set(5120, 48, 40, 13824, false);
      c.vocab_size = 152064;
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown model preset \"", name, "\" (known: ", PresetNames(), ")"));
    }
  } else if (name == "llama3.2-1b") {
    set(2048, 16, 32, 8192, true);
    c.head_dim = 64;
    llama3(32);
  } else if (name == "llama3.2-3b") {
    set(3072, 28, 24, 8192, true);
    llama3(32);
  } else if (name == "llama3.1-8b") {
    set(4096, 32, 32, 14336, false);
    llama3(8);
  } else if (name == "mistral-7b") {  // v0.3: no sliding window
    set(4096, 32, 32, 14336, false);
    c.family = ModelFamily::kMistral;
    c.vocab_size = 32768;
    c.rms_norm_eps = 1e-5;
    c.max_position_embeddings = 32768;
  } else if (name == "qwen3-30b-a3b") {  // the hub's Qwen/Qwen3-30B-A3B config.json
    set(2048, 48, 32, 6144, false);
    c.family = ModelFamily::kQwen3Moe;
    c.num_key_value_heads = 4;
    c.max_position_embeddings = 40960;
    moe(128, 8, 768);
  } else if (name == "tiny") {
    tiny(ModelFamily::kQwen3);
  } else if (name == "tiny-qwen2" || name == "tiny-qwen2-window") {
    tiny(ModelFamily::kQwen2);
    if (name == "tiny-qwen2-window") {
      // Layers of two spans: layer 0 full, layer 1 sliding over 16 (max_window_layers 1).
      c.sliding_window = 16;
      c.layer_spans = {AttentionSpan::kFull, AttentionSpan::kSliding};
    }
  } else if (name == "tiny-llama") {
    tiny(ModelFamily::kLlama);
    c.rope_theta = 500000;
    c.rope_scaling.type = RopeScaling::Type::kLlama3;
    c.rope_scaling.factor = 8;
    c.rope_scaling.original_max_position_embeddings = 256;  // bands that matter at CI's lengths
    c.tie_word_embeddings = false;
  } else if (name == "tiny-mistral" || name == "tiny-mistral-window") {
    tiny(ModelFamily::kMistral);
    if (name == "tiny-mistral-window") {
      // Sliding-window attention in CI: a window shorter than CI's rows (64) and most of its documents.
      c.sliding_window = 16;
      c.layer_spans.assign(c.num_hidden_layers, AttentionSpan::kSliding);
    }
  } else if (name == "tiny-moe") {
    // Untied like the Qwen3-MoE releases; layer 1 dense (mlp_only_layers) between two sparse ones,
    // so a model's decoder units differ in size.
    tiny(ModelFamily::kQwen3Moe);
    c.num_hidden_layers = 3;
    c.tie_word_embeddings = false;
    moe(8, 2, 32);
    c.mlp_only_layers = {1};
  } else if (absl::StartsWith(name, "gemma3-") || name == "tiny-gemma3") {
    if (!Gemma3Preset(name, c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown model preset \"", name, "\" (known: ", PresetNames(), ")"));
    }
  } else if (absl::StartsWith(name, "gemma4-") || name == "tiny-gemma4") {
    if (!config_internal::Gemma4Preset(name, &c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown model preset \"", name, "\" (known: ", PresetNames(), ")"));
    }
  } else if (absl::StartsWith(name, "gpt-oss-") || name == "tiny-gpt-oss") {
    if (!GptOssPreset(name, c)) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown model preset \"", name, "\" (known: ", PresetNames(), ")"));
    }
  } else if (absl::StartsWith(name, "qwen3.5-") || absl::StartsWith(name, "tiny-qwen3.5")) {
    if (!Qwen3_5Preset(name, c)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown model preset \"", name, "\" (known: ", PresetNames(), ")"));
    }
  } else {
    return absl::InvalidArgumentError(absl::StrCat("unknown model preset \"", name, "\" (known: ", PresetNames(), ")"));
  }
  return c;
}

}  // namespace slidedp
