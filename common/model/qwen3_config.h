// Qwen3 dense model configuration (HF config.json) and the streamed-unit layout shared by
// hostd (state segments, checkpoints, LayerAdam) and workers (compute, streaming).
//
// A model is streamed as units: the embedding, each decoder layer, and the head (final norm +
// LM head). Each unit's parameters are one flat array; tensors sit at fixed offsets inside it,
// each aligned to kTensorAlignNumel elements so vector loads and DMA chunks stay aligned.
// With tied embeddings the head unit holds only the final norm and reads the LM head weight from
// the embedding unit; the two gradient contributions are summed into the embedding's gradient.
#pragma once

#include <cstdint>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"

namespace slidedp {

struct Qwen3Config {
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 128;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 40960;
  double rope_theta = 1e6;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  double initializer_range = 0.02;
  std::string torch_dtype = "bfloat16";

  int64_t q_dim() const { return num_attention_heads * head_dim; }
  int64_t kv_dim() const { return num_key_value_heads * head_dim; }

  // Checks internal consistency (positive sizes, heads divisible by kv heads, ...).
  absl::Status Validate() const;

  // Parses HF config.json text. Unknown keys are ignored (HF configs carry many);
  // a model_type other than "qwen3" or missing required sizes is INVALID_ARGUMENT.
  static absl::StatusOr<Qwen3Config> FromJson(absl::string_view json_text);
  static absl::StatusOr<Qwen3Config> FromFile(const std::string& path);
  // HF-loadable config.json text (model_type qwen3, architectures Qwen3ForCausalLM).
  std::string ToJson() const;

  // Reference shapes: "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", and
  // "tiny" (a Qwen3-shaped model small enough for CI: hidden 64, 2 layers, vocab 512).
  static absl::StatusOr<Qwen3Config> Preset(absl::string_view name);
};

enum class UnitKind { kEmbedding, kDecoder, kHead };

// Tensor order inside a decoder unit. Compute backends index tensors by these values.
enum DecoderTensor : int {
  kInputNorm = 0,  // [hidden]
  kQProj,          // [q_dim, hidden]
  kKProj,          // [kv_dim, hidden]
  kVProj,          // [kv_dim, hidden]
  kOProj,          // [hidden, q_dim]
  kQNorm,          // [head_dim]
  kKNorm,          // [head_dim]
  kPostNorm,       // [hidden]
  kGateProj,       // [intermediate, hidden]
  kUpProj,         // [intermediate, hidden]
  kDownProj,       // [hidden, intermediate]
  kNumDecoderTensors
};
// Embedding unit: tensor 0 = embed_tokens [vocab, hidden].
// Head unit: tensor 0 = final norm [hidden]; tensor 1 = lm_head [vocab, hidden] when untied.

inline constexpr int64_t kTensorAlignNumel = 256;

struct TensorSlot {
  std::string hf_name;          // e.g. "model.layers.3.mlp.up_proj.weight"
  std::vector<int64_t> shape;   // row-major, HF's shape
  int64_t offset_numel = 0;     // from the start of the unit
  int64_t numel = 0;
  // Norm weights (the 1-D tensors) also reach the workers in FP32, read from the master, in a
  // side copy of UnitLayout::fp32_numel floats: this tensor's offset there, -1 for the others.
  // HF under bf16 autocast computes RMSNorm with the FP32 weights; near 1.0 BF16's spacing
  // (2^-8) would swallow fine-tuning updates of ~1e-5 for hundreds of steps.
  int64_t fp32_offset = -1;
};

inline constexpr int64_t kFp32SideAlignNumel = 64;  // 256 B per side-copy entry

struct UnitLayout {
  UnitKind kind = UnitKind::kDecoder;
  int index = 0;                // position in ModelLayout::units (forward order)
  int decoder_layer = -1;       // HF layer index for decoder units
  std::string name;             // "embed", "layer.3", "head"
  std::vector<TensorSlot> tensors;
  int64_t numel = 0;            // padded total, a multiple of kTensorAlignNumel
  int64_t fp32_numel = 0;       // the FP32 side copy of the norm weights (TensorSlot::fp32_offset)
};

// "[i, j]": the row-major index of flat element `flat` of a tensor of `shape`.
std::string TensorIndexString(const std::vector<int64_t>& shape, int64_t flat);
// What element `offset` of the unit is, for error messages: "model.layers.3.mlp.up_proj.weight[5, 17]",
// or "the padding after model.layers.3.input_layernorm.weight" (or "at the start of the unit").
std::string DescribeUnitElement(const UnitLayout& unit, int64_t offset);

// Fills the unit's FP32 side copy (unit.fp32_numel floats) from its FP32 values in the unit's
// layout (the master): each norm weight at its TensorSlot::fp32_offset.
void CopyNormsFromMaster(const UnitLayout& unit, const float* master, float* side);

struct ModelLayout {
  Qwen3Config config;
  std::vector<UnitLayout> units;  // forward order: embed, layer.0 .. layer.L-1, head
  int64_t total_numel = 0;
  bool head_uses_embedding = false;  // tied: the head's LM head weight is the embedding's

  static ModelLayout Build(const Qwen3Config& config);

  const UnitLayout& embedding() const { return units.front(); }
  const UnitLayout& head() const { return units.back(); }
  int num_units() const { return static_cast<int>(units.size()); }
  // Looks up a tensor by its HF name; nullptr if absent. Also returns the unit index.
  const TensorSlot* Find(absl::string_view hf_name, int* unit_index) const;
  // Trainable parameter count (no padding; tied weights counted once).
  int64_t param_count() const;
  // Model FLOPs per trained token at sequence length seq_len, the convention of
  // ../shared/bench/peers/fsdp2_qwen3.py (so our TFLOP/s and the peer's compare): 6 x matmul
  // parameters (the LM head counts; the embedding lookup does not) + causal attention
  // 6 * layers * seq_len * q_dim; recompute is not counted.
  double ModelFlopsPerToken(int64_t seq_len) const;
  // runtime.offload_ratio's layers: round(ratio x decoder layers), clamped; the workers offload
  // the inputs of units 1..k, and hostd's memory plan counts them.
  int OffloadedLayers(double ratio) const;
};

}  // namespace slidedp
