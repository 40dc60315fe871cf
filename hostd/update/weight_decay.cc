// Tensor groups exempt from weight decay by HF name (weight_decay.h).
#include "hostd/update/weight_decay.h"

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"

namespace slidedp::update {

bool IsNormWeight(absl::string_view hf_name) {
  // The module is the name without its last component ("weight").
  const size_t dot = hf_name.rfind('.');
  if (dot == absl::string_view::npos || hf_name.substr(dot + 1) != "weight") return false;
  const absl::string_view path = hf_name.substr(0, dot);
  const size_t last = path.rfind('.');
  const std::string module = absl::AsciiStrToLower(last == absl::string_view::npos ? path : path.substr(last + 1));
  return module == "norm" || absl::EndsWith(module, "_norm") || absl::StrContains(module, "layernorm") ||
         absl::StrContains(module, "rmsnorm");
}

// HF's Trainer (get_decay_parameter_names): any parameter whose lower-cased name contains "bias" —
// q_proj.bias, and also gpt_oss's gate_up_proj_bias / down_proj_bias and qwen3_5's dt_bias.
bool IsBias(absl::string_view hf_name) { return absl::StrContains(absl::AsciiStrToLower(hf_name), "bias"); }

WeightDecay DecayOf(absl::string_view hf_name, const DecayExemptions& exempt) {
  if (exempt.norms && IsNormWeight(hf_name)) return WeightDecay::kNone;
  if (exempt.biases && IsBias(hf_name)) return WeightDecay::kNone;
  return WeightDecay::kApply;
}

std::vector<ElementRange> TensorRangesOf(const UnitLayout& unit, const DecayExemptions& exempt) {
  std::vector<ElementRange> ranges;
  ranges.reserve(unit.tensors.size());
  for (const TensorSlot& t : unit.tensors) {
    if (!t.trainable) continue;  // a buffer HF never steps (gemma4's layer_scalar): no update writes it
    ranges.push_back({t.offset_numel, t.offset_numel + t.numel, DecayOf(t.hf_name, exempt)});
  }
  return ranges;
}

}  // namespace slidedp::update
