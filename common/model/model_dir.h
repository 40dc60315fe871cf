// What a model directory's tensor names say about its layout beyond config.json: whether a MoE
// model's experts are fused (ExpertStorage) and whether a gemma3 multimodal checkpoint uses the hub's
// spelling (ModelConfig::hub_wrapper_names). Checkpoints keep the names the user's files had.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "common/model/model_config.h"

namespace slidedp {

// Sets config->expert_storage and config->hub_wrapper_names from the directory's weights
// (model.safetensors, or the names model.safetensors.index.json lists), read bounded and validated
// (the directory is a job spec's: hostile). The errors of safetensors::ModelDirHasTensor; a directory
// without weights leaves the defaults (the loader refuses it later).
absl::Status AdoptDirNaming(const std::string& model_dir, ModelConfig* config);

}  // namespace slidedp
