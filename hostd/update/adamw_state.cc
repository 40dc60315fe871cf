// State dtype names, byte accounting and the run-time choice among the scalar, AVX2 and AVX-512
// tables of the compact-moment kernels. Compiled without ISA flags: it must run on any x86-64 CPU.
#include "hostd/update/adamw_state.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "hostd/update/adamw_state_element_inl.h"

namespace slidedp::update {

std::string StateDtypeName(StateDtype dtype) {
  switch (dtype) {
    case StateDtype::kFp32: return "fp32";
    case StateDtype::kBf16: return "bf16";
    case StateDtype::kInt8: return "int8";
  }
  return "unknown";
}

absl::StatusOr<StateDtype> ParseStateDtype(absl::string_view name) {
  if (name == "fp32") return StateDtype::kFp32;
  if (name == "bf16") return StateDtype::kBf16;
  if (name == "int8") return StateDtype::kInt8;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown optimizer state dtype '", name, "' (expected fp32, bf16 or int8)"));
}

int64_t MomentStateBytes(StateDtype dtype, int64_t n) {
  switch (dtype) {
    case StateDtype::kFp32: return 2 * n * static_cast<int64_t>(sizeof(float));
    case StateDtype::kBf16: return 2 * n * static_cast<int64_t>(sizeof(bf16_t));
    case StateDtype::kInt8: return 2 * n + 2 * Int8StateBlocks(n) * static_cast<int64_t>(sizeof(float));
  }
  return 0;
}

Int8Moments Int8MomentsAt(const Int8Moments& base, int64_t offset) {
  CHECK_EQ(offset % kInt8StateBlock, 0) << "int8 moment ranges start at a block boundary";
  const int64_t block = offset / kInt8StateBlock;
  return {base.m_codes + offset, base.v_codes + offset, base.m_scales + block, base.v_scales + block};
}

uint32_t StochasticRoundingKey(uint64_t seed, int64_t step, uint32_t index_hi) {
  return RoundingKey(seed, step, index_hi);
}

const AdamStateKernelTable* AdamStateKernelsFor(AdamIsa isa) {
  if (!AdamIsaSupported(isa)) return nullptr;
  switch (isa) {
    case AdamIsa::kScalar: return &internal::kScalarStateKernels;
    case AdamIsa::kAvx2: return &internal::kAvx2StateKernels;
    case AdamIsa::kAvx512: return &internal::kAvx512StateKernels;
  }
  return nullptr;
}

const AdamStateKernelTable& ActiveAdamStateKernels() {
  static const AdamStateKernelTable* table = AdamStateKernelsFor(ActiveAdamIsa());
  return *table;
}

}  // namespace slidedp::update
