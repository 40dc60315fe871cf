// Pieces of ModelConfig's parsing shared by its files (model_config.cc: the families' common fields,
// RoPE, MoE; model_config_qwen3_5.cc: Qwen3.5's; model_config_gemma3.cc: Gemma 3's;
// model_config_gpt_oss.cc: GPT-OSS's; model_config_gemma4.cc: Gemma 4's; model_config_window.cc:
// sliding windows; model_config_json.cc: writing config.json).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"
#include "common/model/model_config.h"
#include "nlohmann/json.hpp"

namespace slidedp::config_internal {

// INVALID_ARGUMENT "config.json: <field>: <why>".
absl::Status Refuse(absl::string_view field, absl::string_view why);
// HF's rope_type name of a scaling type.
const char* RopeTypeName(RopeScaling::Type type);
// rope_scaling / rope_parameters of `j` (one RoPE for every layer) into c's rope_theta, rope_scaling
// and partial_rotary_factor; fields are named `label`.<field> in messages (default: the key read).
absl::Status ParseRope(const nlohmann::json& j, ModelConfig* c, absl::string_view label = "");
// qwen3_moe's MoE fields (and qwen3_5_moe's, which it shares) with Qwen3MoeConfig's defaults.
absl::Status ParseMoe(const nlohmann::json& j, ModelConfig* c);
// Refuses a key of `j` not in `known` nor among PreTrainedConfig's bookkeeping fields (use_cache,
// architectures, id2label, ...; keys starting with "_" pass), naming `where` + key.
absl::Status RefuseUnknownKeys(const nlohmann::json& j, absl::Span<const char* const> known, absl::string_view where,
                               absl::string_view model_type);
// The multimodal wrapper's own keys (qwen3_5, qwen3_5_moe).
absl::Span<const char* const> Qwen3_5WrapperKeys();
// qwen3_5 / qwen3_5_moe's text config fields; `where` prefixes field names ("text_config.").
absl::Status ParseQwen3_5(const nlohmann::json& t, absl::string_view where, ModelConfig* c);
// qwen3_5's fields in range (the other families: at their defaults).
absl::Status CheckQwen3_5(const ModelConfig& c);
// gemma3 (model_config_gemma3.cc): the multimodal wrapper's own keys; Gemma3TextConfig's defaults
// for the sizes a config leaves out; its text config's fields (`t`; `wrapper` is the file, the same
// object for a gemma3_text config), the two RoPEs included; their ranges.
absl::Span<const char* const> Gemma3WrapperKeys();
void SetGemma3Defaults(ModelConfig* c);
absl::Status ParseGemma3(const nlohmann::json& t, const nlohmann::json& wrapper, absl::string_view where,
                         ModelConfig* c);
absl::Status CheckGemma3(const ModelConfig& c);
// gpt_oss (model_config_gpt_oss.cc): GptOssConfig's defaults for the sizes a config leaves out; its
// fields (the experts, the RoPE, an MXFP4 quantization_config); their ranges; and its fields as
// config.json spells them (quantization_config dropped: checkpoints are never quantized).
void SetGptOssDefaults(ModelConfig* c);
absl::Status ParseGptOss(const nlohmann::json& t, ModelConfig* c);
absl::Status CheckGptOss(const ModelConfig& c);
void WriteGptOssFields(const ModelConfig& c, bool preset, nlohmann::ordered_json& t);
// gemma4 (model_config_gemma4.cc): the multimodal wrapper's own keys; Gemma4TextConfig's defaults
// for the sizes a config leaves out; its text config's fields (`t`; `wrapper` is the file), its
// layer_types, window and RoPEs included (ParseAttentionSpans leaves gemma4 to it); their ranges;
// its fields and RoPEs as config.json spells them; its RoPE frequencies (RopeInverseFrequencies);
// its presets (false for another name); and decoder unit `layer`'s tensors in unit order, each
// through `add` (ModelLayout::Build's: slot, HF name, shape, FP32 side copy), which returns it.
absl::Span<const char* const> Gemma4WrapperKeys();
void SetGemma4Defaults(ModelConfig* c);
absl::Status ParseGemma4(const nlohmann::json& t, const nlohmann::json& wrapper, absl::string_view where,
                         ModelConfig* c);
absl::Status CheckGemma4(const ModelConfig& c);
void WriteGemma4Fields(const ModelConfig& c, nlohmann::ordered_json& t);
void WriteGemma4Rope(const ModelConfig& c, nlohmann::ordered_json& t);
std::vector<float> Gemma4InverseFrequencies(const ModelConfig& c, AttentionSpan span);
bool Gemma4Preset(absl::string_view name, ModelConfig* c);
using AddDecoderTensor =
    std::function<TensorSlot&(DecoderTensor slot, std::string name, std::vector<int64_t> shape, bool fp32_side)>;
void AddGemma4DecoderTensors(const ModelConfig& c, int64_t layer, const AddDecoderTensor& add);
// Which layers slide and the window (model_config_window.cc): parsed from a config.json object as
// HF applies each family's fields, checked, and written back (sliding_window, use_sliding_window,
// max_window_layers, layer_types as the family spells them).
absl::Status ParseAttentionSpans(const nlohmann::json& j, ModelConfig* c);
absl::Status CheckAttentionSpans(const ModelConfig& c);
void WriteAttentionSpans(const ModelConfig& c, nlohmann::ordered_json& t);

}  // namespace slidedp::config_internal
