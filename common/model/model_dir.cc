#include "common/model/model_dir.h"

#include "absl/strings/match.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"

namespace slidedp {

absl::Status AdoptDirNaming(const std::string& model_dir, ModelConfig* config) {
  namespace st = safetensors;
  if (config->is_moe() && !config->is_gpt_oss()) {  // gpt_oss: always fused (its MXFP4 names end in _blocks)
    ASSIGN_OR_RETURN(const bool fused, st::ModelDirHasTensor(model_dir, [](absl::string_view name) {
                       for (absl::string_view p : st::kNotLanguageModelPrefixes) {
                         if (absl::StartsWith(name, p)) return false;
                       }
                       return absl::EndsWith(name, st::kFusedExpertsSuffix);
                     }));
    config->expert_storage = fused ? ExpertStorage::kFused : ExpertStorage::kPerExpert;
  }
  if (config->is_gemma3() && config->multimodal) {
    ASSIGN_OR_RETURN(config->hub_wrapper_names, st::ModelDirHasTensor(model_dir, [](absl::string_view name) {
                       return absl::StartsWith(name, "language_model.model.");
                     }));
  }
  return absl::OkStatus();
}

}  // namespace slidedp
