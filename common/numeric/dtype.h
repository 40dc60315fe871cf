// The project's numeric types, one enum per concept (docs/architecture.md, "One name per
// concept"):
//   Dtype       the type an array of numbers is kept or moves in: FP32 or BF16 (a job spec's
//               save_dtype, grad_dtype, checkpoint_dtype, norm_weights, embedding_rows; a kernel's
//               output; a checkpoint's weights).
//   MomentForm  how Adam's m and v are kept: FP32, BF16 (m rounded to nearest even, v
//               stochastically) or int8 codes with an FP32 scale per kInt8MomentBlock elements
//               (docs/optimizer-state.md).
// The values are stable: shared memory and files record them as uint32.
// A safetensors file's element types (common/safetensors) and a shared-memory region's
// (shm::ShmDtype) are file and segment formats with more members, not these.
#pragma once

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp {

enum class Dtype : uint32_t { kF32 = 0, kBF16 = 1 };
enum class MomentForm : uint32_t { kF32 = 0, kBF16 = 1, kInt8 = 2 };

// "fp32" | "bf16", as job specs, metrics and logs spell them.
inline const char* ToString(Dtype d) { return d == Dtype::kBF16 ? "bf16" : "fp32"; }
// "fp32" | "bf16" | "int8".
inline const char* ToString(MomentForm f) {
  switch (f) {
    case MomentForm::kF32: return "fp32";
    case MomentForm::kBF16: return "bf16";
    case MomentForm::kInt8: return "int8";
  }
  return "unknown";
}
// The names above back; INVALID_ARGUMENT naming the expected ones otherwise.
absl::StatusOr<Dtype> ParseDtype(absl::string_view name);
absl::StatusOr<MomentForm> ParseMomentForm(absl::string_view name);
// Whether a value read from memory another process wrote is a member.
inline bool IsMomentForm(uint32_t v) { return v <= static_cast<uint32_t>(MomentForm::kInt8); }

inline int64_t DtypeBytes(Dtype d) { return d == Dtype::kBF16 ? 2 : 4; }

// Elements per int8 quantization block (the unit of requantization and of range alignment).
inline constexpr int64_t kInt8MomentBlock = 256;
// Blocks (and scales per moment) for n elements: ceil(n / 256).
inline int64_t Int8MomentBlocks(int64_t n) { return (n + kInt8MomentBlock - 1) / kInt8MomentBlock; }
// Host bytes of m and v together for n elements: fp32 8n; bf16 4n; int8 2n codes and two FP32
// scales per block (a partial last block counts whole).
inline int64_t MomentBytes(MomentForm f, int64_t n) {
  switch (f) {
    case MomentForm::kF32: return 8 * n;
    case MomentForm::kBF16: return 4 * n;
    case MomentForm::kInt8: return 2 * n + 8 * Int8MomentBlocks(n);
  }
  return 0;
}

}  // namespace slidedp
