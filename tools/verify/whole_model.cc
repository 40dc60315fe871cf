// RunWholeModel: the plain unit loop over device buffers.
#include "tools/verify/whole_model.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp::verify {

absl::StatusOr<WholeModelResult> RunWholeModel(ComputeBackend& backend, const ModelLayout& layout,
                                               const std::vector<std::vector<bf16_t>>& unit_params,
                                               const std::vector<MicroBatch>& batches, float loss_scale,
                                               ActPolicy policy, const std::vector<std::vector<float>>* fp32_norms,
                                               const std::vector<float>* embed_fp32, double router_aux_coef) {
  const int num_units = layout.num_units();
  if (static_cast<int>(unit_params.size()) != num_units) {
    return absl::InvalidArgumentError(
        absl::StrCat("RunWholeModel: ", unit_params.size(), " parameter arrays for ", num_units, " units"));
  }
  if (num_units < 3) return absl::InvalidArgumentError("RunWholeModel: the model has no decoder layer");
  // Parameters (BF16, and the norm weights' FP32 side copies, as the workers get them) and
  // gradients (FP32, zeroed) in device memory, one buffer per unit.
  std::vector<std::unique_ptr<DeviceBuffer>> params(num_units), norms(num_units), grads(num_units);
  for (int u = 0; u < num_units; ++u) {
    const int64_t numel = layout.units[u].numel;
    if (static_cast<int64_t>(unit_params[u].size()) != numel) {
      return absl::InvalidArgumentError(absl::StrCat("RunWholeModel: unit ", layout.units[u].name, " has ",
                                                     unit_params[u].size(), " parameters, layout says ", numel));
    }
    ASSIGN_OR_RETURN(params[u], backend.Allocate(numel * 2));
    RETURN_IF_ERROR(backend.CopyToDevice(unit_params[u].data(), params[u]->data(), numel * 2));
    ASSIGN_OR_RETURN(grads[u], backend.Allocate(numel * 4));
    RETURN_IF_ERROR(backend.Memset(*grads[u], 0));
    const UnitLayout& unit = layout.units[u];
    if (unit.fp32_numel > 0) {
      std::vector<float> side(unit.fp32_numel, 0.0f);
      if (fp32_norms != nullptr && static_cast<int64_t>((*fp32_norms)[u].size()) == unit.fp32_numel) {
        side = (*fp32_norms)[u];
      } else {
        std::vector<float> values(numel);
        for (int64_t i = 0; i < numel; ++i) values[i] = Bf16ToFloat(unit_params[u][i]);
        CopyNormsFromMaster(unit, values.data(), side.data());
      }
      ASSIGN_OR_RETURN(norms[u], backend.Allocate(unit.fp32_numel * 4));
      RETURN_IF_ERROR(backend.CopyToDevice(side.data(), norms[u]->data(), unit.fp32_numel * 4));
    }
  }
  const int embed = 0, head = num_units - 1;
  if (embed_fp32 != nullptr) {
    const int64_t numel = layout.units[embed].numel;
    if (static_cast<int64_t>(embed_fp32->size()) != numel) {
      return absl::InvalidArgumentError(absl::StrCat("RunWholeModel: FP32 embedding table of ", embed_fp32->size(),
                                                     " values, layout says ", numel));
    }
    ASSIGN_OR_RETURN(norms[embed], backend.Allocate(numel * 4));
    RETURN_IF_ERROR(backend.CopyToDevice(embed_fp32->data(), norms[embed]->data(), numel * 4));
  }
  // norms[u]: the unit's FP32 values (norm weights' side copy; the embedding's FP32 table).
  auto unit_params_of = [&](int u) {
    return UnitParams(params[u]->as<bf16_t>(), norms[u] != nullptr ? norms[u]->as<float>() : nullptr)
        .OfLayer(layout.units[u].decoder_layer);
  };
  const UnitLayout& head_unit = layout.head();
  const int64_t norm_off = head_unit.tensors[0].offset_numel;
  const UnitParams norm_w = unit_params_of(head).Tensor(head_unit.tensors[0]);
  float* dnorm = grads[head]->as<float>() + norm_off;
  const bf16_t* lm_w;
  float* dlm;
  if (layout.head_uses_embedding) {
    lm_w = params[embed]->as<bf16_t>();
    dlm = grads[embed]->as<float>();
  } else {
    const int64_t off = head_unit.tensors[1].offset_numel;
    lm_w = params[head]->as<bf16_t>() + off;
    dlm = grads[head]->as<float>() + off;
  }
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceBuffer> loss_buf, backend.Allocate(2 * sizeof(float)));
  const double share = batches.empty() ? 0.0 : 1.0 / static_cast<double>(batches.size());

  const int64_t H = layout.config.hidden_size;
  const int64_t act_bytes = DtypeBytes(backend.activation_dtype());
  WholeModelResult result;
  const int num_sparse = static_cast<int>(layout.config.NumSparseLayers());
  if (num_sparse > 0) backend.SetRecordRouting(true);
  for (size_t i = 0; i < batches.size(); ++i) {
    auto uploaded = backend.UploadBatch(batches[i]);
    if (!uploaded.ok()) return Annotate(uploaded.status(), absl::StrCat("micro-batch ", i));
    const DeviceBatch& batch = **uploaded;
    const int64_t bytes = batch.num_tokens() * H * act_bytes;
    // xs[l]: input of decoder layer l (xs[0] = embedding output); xs.back(): the head's input.
    std::vector<std::unique_ptr<DeviceBuffer>> xs(num_units - 1);
    for (auto& x : xs) {
      ASSIGN_OR_RETURN(x, backend.Allocate(bytes));
    }
    ASSIGN_OR_RETURN(std::unique_ptr<DeviceBuffer> grad, backend.Allocate(bytes));
    RETURN_IF_ERROR(backend.Memset(*loss_buf, 0));

    RETURN_IF_ERROR(backend.EmbeddingForward(unit_params_of(embed), batch, xs[0]->data()));
    std::vector<std::unique_ptr<SavedActivations>> saved(num_units);
    for (int u = 1; u < head; ++u) {
      RETURN_IF_ERROR(backend.DecoderForward(unit_params_of(u), batch, xs[u - 1]->data(), xs[u]->data(), policy,
                                             &saved[u]));
    }
    if (num_sparse > 0) {
      result.routing.emplace_back(num_sparse);
      for (int l = 0; l < num_sparse; ++l) RETURN_IF_ERROR(backend.RoutedExperts(batch, l, &result.routing.back()[l]));
    }
    if (layout.config.is_moe()) {
      RETURN_IF_ERROR(backend.RouterAuxLoss(batch, static_cast<float>(router_aux_coef * share),
                                            static_cast<float>(share), loss_buf->as<float>(),
                                            loss_buf->as<float>() + 1));
    }
    RETURN_IF_ERROR(backend.HeadForwardBackward(norm_w, lm_w, batch, xs.back()->data(), loss_scale, grad->data(),
                                                dnorm, dlm, loss_buf->as<float>()));
    for (int u = head - 1; u >= 1; --u) {
      RETURN_IF_ERROR(backend.DecoderBackward(unit_params_of(u), batch, xs[u - 1]->data(), saved[u].get(),
                                              grad->data(), grad->data(), grads[u]->as<float>()));
      saved[u].reset();
    }
    RETURN_IF_ERROR(backend.EmbeddingBackward(grad->data(), batch, grads[embed]->as<float>()));
    float loss = 0;
    RETURN_IF_ERROR(backend.Synchronize());
    RETURN_IF_ERROR(backend.CopyToHost(loss_buf->data(), &loss, sizeof(float)));
    result.loss += loss;
  }
  RETURN_IF_ERROR(backend.Synchronize());
  result.unit_grads.resize(num_units);
  for (int u = 0; u < num_units; ++u) {
    result.unit_grads[u].resize(layout.units[u].numel);
    RETURN_IF_ERROR(backend.CopyToHost(grads[u]->data(), result.unit_grads[u].data(), layout.units[u].numel * 4));
  }
  return result;
}

std::vector<safetensors::TensorSource> HfTensorsF32(const ModelLayout& layout,
                                                    const std::vector<std::vector<float>>& per_unit) {
  std::vector<safetensors::TensorSource> tensors;
  // A slice of a fused HF tensor (gpt_oss's experts, TensorSlot::is_slice): one tensor per HF name,
  // its bytes gathered from the slices at their hf_offset_numel.
  struct Slice {
    const float* data;
    int64_t at, numel;
  };
  std::map<std::string, std::vector<Slice>> fused;
  for (const UnitLayout& unit : layout.units) {
    for (const TensorSlot& slot : unit.tensors) {
      const float* data = per_unit[unit.index].data() + slot.offset_numel;
      if (slot.is_slice()) {
        auto [it, first] = fused.try_emplace(slot.hf_name);
        it->second.push_back({data, slot.hf_offset_numel, slot.numel});
        if (!first) continue;
      }
      safetensors::TensorSource t;
      t.name = slot.hf_name;
      t.dtype = safetensors::Dtype::kF32;
      t.shape = slot.is_slice() ? slot.hf_shape : slot.shape;
      t.data = slot.is_slice() ? nullptr : data;
      tensors.push_back(std::move(t));
    }
  }
  for (safetensors::TensorSource& t : tensors) {
    if (t.data != nullptr) continue;
    t.fill = [slices = fused.at(t.name)](uint64_t byte_offset, size_t byte_len, char* dst) {
      const int64_t first = static_cast<int64_t>(byte_offset / 4), last = first + static_cast<int64_t>(byte_len / 4);
      for (const Slice& s : slices) {
        const int64_t lo = std::max(first, s.at), hi = std::min(last, s.at + s.numel);
        if (lo < hi) std::memcpy(dst + (lo - first) * 4, s.data + (lo - s.at), (hi - lo) * 4);
      }
    };
  }
  return tensors;
}

}  // namespace slidedp::verify
