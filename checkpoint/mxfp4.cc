// MXFP4 dequantization of gpt-oss experts (mxfp4.h), as transformers' convert_moe_packed_tensors.
#include "checkpoint/mxfp4.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace slidedp::checkpoint {
namespace {

// transformers' FP4_VALUES: e2m1, the sign in bit 3.
constexpr float kFp4Values[16] = {+0.0f, +0.5f, +1.0f, +1.5f, +2.0f, +3.0f, +4.0f, +6.0f,
                                  -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
constexpr int64_t kBlockValues = 32;  // values per scale (16 bytes of two codes each)

std::string ShapeText(const std::vector<int64_t>& s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

}  // namespace

float Mxfp4Value(uint8_t code) { return kFp4Values[code & 0x0F]; }

void DequantizeMxfp4Transposed(const uint8_t* blocks, const uint8_t* scales, int64_t out_dim, int64_t in_dim,
                               float* w) {
  const int64_t groups = in_dim / kBlockValues;
  for (int64_t r = 0; r < out_dim; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      // torch.ldexp(bf16 codes, scale - 127): the codes times pow(2.0, e) in float32 (inf past 2^127).
      const float power = std::ldexp(1.0f, static_cast<int>(scales[r * groups + g]) - 127);
      const uint8_t* bytes = blocks + (r * groups + g) * (kBlockValues / 2);
      for (int64_t b = 0; b < kBlockValues / 2; ++b) {
        const int64_t in = g * kBlockValues + 2 * b;
        w[in * out_dim + r] = Mxfp4Value(bytes[b] & 0x0F) * power;
        w[(in + 1) * out_dim + r] = Mxfp4Value(bytes[b] >> 4) * power;
      }
    }
  }
}

absl::Status CheckMxfp4Pair(const TensorSlot& slot, const safetensors::TensorInfo& blocks,
                            const safetensors::TensorInfo& scales) {
  if (!slot.is_slice() || slot.hf_shape.size() != 3) {
    return absl::InvalidArgumentError(absl::StrCat(blocks.name, ": ", slot.hf_name, " is not a fused expert tensor"));
  }
  const int64_t experts = slot.hf_shape[0], in_dim = slot.hf_shape[1], out_dim = slot.hf_shape[2];
  if (in_dim % kBlockValues != 0) {
    return absl::InvalidArgumentError(absl::StrCat(blocks.name, ": MXFP4 blocks need ", slot.hf_name, "'s input size ",
                                                   in_dim, " to be a multiple of 32"));
  }
  const std::vector<int64_t> want_blocks = {experts, out_dim, in_dim / kBlockValues, kBlockValues / 2};
  const std::vector<int64_t> want_scales = {experts, out_dim, in_dim / kBlockValues};
  for (const auto& [t, want] :
       {std::pair<const safetensors::TensorInfo*, const std::vector<int64_t>*>{&blocks, &want_blocks},
        {&scales, &want_scales}}) {
    if (t->dtype != safetensors::Dtype::kU8) {
      return absl::InvalidArgumentError(
          absl::StrCat(t->name, " has dtype ", safetensors::DtypeName(t->dtype), " (MXFP4 tensors are U8)"));
    }
    if (t->shape != *want) {
      return absl::InvalidArgumentError(absl::StrCat(t->name, " is ", ShapeText(t->shape), ", expected ",
                                                     ShapeText(*want), " for ", slot.hf_name, " ",
                                                     ShapeText(slot.hf_shape)));
    }
  }
  return absl::OkStatus();
}

void DequantizeMxfp4Slot(const TensorSlot& slot, const char* blocks, const char* scales, float* dst) {
  const int64_t in_dim = slot.hf_shape[1], out_dim = slot.hf_shape[2];
  const int64_t matrix = in_dim * out_dim;
  const int64_t expert = slot.hf_offset_numel / matrix;
  const int64_t groups = in_dim / kBlockValues;
  const auto* b = reinterpret_cast<const uint8_t*>(blocks) + expert * out_dim * groups * (kBlockValues / 2);
  const auto* s = reinterpret_cast<const uint8_t*>(scales) + expert * out_dim * groups;
  const int64_t skip = slot.hf_offset_numel - expert * matrix;
  if (skip == 0 && slot.numel == matrix) {
    DequantizeMxfp4Transposed(b, s, out_dim, in_dim, dst);
    return;
  }
  // Part of the expert's matrix (a node's share of a sharded state, common/model/node_shard.h).
  if (slot.numel <= 0) return;
  std::vector<float> whole(static_cast<size_t>(matrix));
  DequantizeMxfp4Transposed(b, s, out_dim, in_dim, whole.data());
  std::copy_n(whole.data() + skip, std::min(slot.numel, matrix - skip), dst);
}

}  // namespace slidedp::checkpoint
