#include "common/numeric/dtype.h"

#include "absl/strings/str_cat.h"

namespace slidedp {

absl::StatusOr<Dtype> ParseDtype(absl::string_view name) {
  if (name == "fp32") return Dtype::kF32;
  if (name == "bf16") return Dtype::kBF16;
  return absl::InvalidArgumentError(absl::StrCat("unknown dtype '", name, "' (expected fp32 or bf16)"));
}

absl::StatusOr<MomentForm> ParseMomentForm(absl::string_view name) {
  if (name == "fp32") return MomentForm::kF32;
  if (name == "bf16") return MomentForm::kBF16;
  if (name == "int8") return MomentForm::kInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer state dtype '", name, "' (expected fp32, bf16 or int8)"));
}

}  // namespace slidedp
