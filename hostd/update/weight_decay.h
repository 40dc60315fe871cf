// Which tensors AdamW's decoupled weight decay applies to (optimizer.no_decay, docs/job-spec.md).
//
// HF's Trainer (Trainer.get_decay_parameter_names; LLaMA-Factory and axolotl use it) decays every
// parameter except those of LayerNorm-type modules (RMSNorm included) and biases, by putting them
// in two torch.optim.AdamW parameter groups, the second with weight_decay 0. LayerAdam gets the
// same result per tensor range (ElementRange::decay). The groups are told apart by HF name, not by
// rank: norm weights and biases are both 1-D.
//   norm: the weight of a module named `norm`, `*_norm`, `*layernorm*` or `*rmsnorm*` (Qwen3,
//         Llama: input_layernorm, post_attention_layernorm, self_attn.q_norm, self_attn.k_norm,
//         model.norm), HF's name patterns "layernorm", "rmsnorm", "(^|.)norm($|.)", "_norm($|.)".
//   bias: any tensor whose lower-cased name contains "bias" (HF Trainer's get_decay_parameter_names:
//   q_proj.bias, experts.gate_up_proj_bias, dt_bias).
// The embedding and an untied lm_head are decayed (HF's rule).
#pragma once

#include <vector>

#include "absl/strings/string_view.h"
#include "common/model/model_config.h"
#include "hostd/update/layer_adam.h"

namespace slidedp::update {

// The tensor groups a job exempts from weight decay; HF's default exempts both.
struct DecayExemptions {
  bool norms = true;
  bool biases = true;
};

// Whether `hf_name` is a norm weight / a bias in the sense above.
bool IsNormWeight(absl::string_view hf_name);
bool IsBias(absl::string_view hf_name);

// kNone when the tensor belongs to an exempt group, else kApply.
WeightDecay DecayOf(absl::string_view hf_name, const DecayExemptions& exempt);

// The unit's tensor ranges for UnitMemory::tensors, each with its weight decay; a tensor that is not
// trainable (TensorSlot::trainable) is left out, so LayerAdam never writes it.
std::vector<ElementRange> TensorRangesOf(const UnitLayout& unit, const DecayExemptions& exempt);

}  // namespace slidedp::update
