// ReferenceLossAndGrads: a plain loop over units and micro-batches on the CPU backend.
#include "worker/compute/cpu/cpu_reference_model.h"

#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/compute/cpu/cpu_backend.h"

namespace slidedp {

absl::StatusOr<double> ReferenceLossAndGrads(const ModelLayout& layout,
                                             const std::vector<std::vector<bf16_t>>& unit_params_bf16,
                                             const std::vector<MicroBatch>& batches, float loss_scale,
                                             std::vector<std::vector<float>>* unit_grads,
                                             const std::vector<std::vector<float>>* fp32_norms,
                                             const float* embed_fp32) {
  if (unit_grads == nullptr) return absl::InvalidArgumentError("ReferenceLossAndGrads: unit_grads is null");
  const int num_units = layout.num_units();
  if (static_cast<int>(unit_params_bf16.size()) != num_units) {
    return absl::InvalidArgumentError(absl::StrCat("ReferenceLossAndGrads: ", unit_params_bf16.size(),
                                                   " parameter arrays for ", num_units, " units"));
  }
  for (int u = 0; u < num_units; ++u) {
    if (static_cast<int64_t>(unit_params_bf16[u].size()) != layout.units[u].numel) {
      return absl::InvalidArgumentError(absl::StrCat("ReferenceLossAndGrads: unit ", layout.units[u].name, " has ",
                                                     unit_params_bf16[u].size(), " parameters, layout says ",
                                                     layout.units[u].numel));
    }
  }
  if (fp32_norms != nullptr && static_cast<int>(fp32_norms->size()) != num_units) {
    return absl::InvalidArgumentError("ReferenceLossAndGrads: fp32_norms needs one side copy per unit");
  }
  // Each unit says which layer it is: layers of a model may differ (experts, mixers, windows).
  auto params = [&](int u) {
    return UnitParams(unit_params_bf16[u].data(),
                      fp32_norms != nullptr && !(*fp32_norms)[u].empty() ? (*fp32_norms)[u].data() : nullptr)
        .OfLayer(layout.units[u].decoder_layer);
  };
  ASSIGN_OR_RETURN(std::unique_ptr<ComputeBackend> backend, MakeCpuBackend(layout.config));
  unit_grads->assign(num_units, {});
  for (int u = 0; u < num_units; ++u) (*unit_grads)[u].assign(layout.units[u].numel, 0.0f);

  const int embed = 0, head = num_units - 1;
  const int64_t H = layout.config.hidden_size;
  const bf16_t* lm_w = layout.head_uses_embedding
                           ? unit_params_bf16[embed].data()
                           : unit_params_bf16[head].data() + layout.head().tensors[1].offset_numel;
  float* dlm = layout.head_uses_embedding ? (*unit_grads)[embed].data()
                                          : (*unit_grads)[head].data() + layout.head().tensors[1].offset_numel;
  double loss = 0.0;
  for (size_t i = 0; i < batches.size(); ++i) {
    auto uploaded = backend->UploadBatch(batches[i]);
    if (!uploaded.ok()) return Annotate(uploaded.status(), absl::StrCat("micro-batch ", i));
    const DeviceBatch& batch = **uploaded;
    const int64_t T = batch.num_tokens();
    // xs[l]: input of decoder layer l; xs.back(): the head's input.
    std::vector<std::vector<float>> xs(num_units - 1, std::vector<float>(T * H));
    RETURN_IF_ERROR(backend->EmbeddingForward(UnitParams(unit_params_bf16[embed].data(), embed_fp32), batch,
                                              xs[0].data()));
    std::vector<std::unique_ptr<SavedActivations>> saved(num_units);
    for (int u = 1; u < head; ++u) {
      RETURN_IF_ERROR(backend->DecoderForward(params(u), batch, xs[u - 1].data(), xs[u].data(),
                                              ActPolicy::kKeepAll, &saved[u]));
    }
    std::vector<float> grad(T * H);
    float loss_sum = 0.0f;
    const UnitParams norm_w = params(head).Tensor(layout.head().tensors[0]);
    RETURN_IF_ERROR(backend->HeadForwardBackward(norm_w, lm_w, batch, xs.back().data(),
                                                 loss_scale, grad.data(), (*unit_grads)[head].data(), dlm,
                                                 &loss_sum));
    loss += loss_sum;
    for (int u = head - 1; u >= 1; --u) {
      RETURN_IF_ERROR(backend->DecoderBackward(params(u), batch, xs[u - 1].data(), saved[u].get(),
                                               grad.data(), grad.data(), (*unit_grads)[u].data()));
    }
    RETURN_IF_ERROR(backend->EmbeddingBackward(grad.data(), batch, (*unit_grads)[embed].data()));
  }
  return loss;
}

}  // namespace slidedp
