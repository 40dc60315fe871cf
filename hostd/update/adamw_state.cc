// State dtype names, byte accounting and the run-time choice among the scalar, AVX2 and AVX-512
// tables of the compact-moment kernels. Compiled without ISA flags: it must run on any x86-64 CPU.
#include "hostd/update/adamw_state.h"

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"
#include "hostd/update/adamw_state_element_inl.h"

namespace slidedp::update {

Int8Moments Int8MomentsAt(const Int8Moments& base, int64_t offset) {
  CHECK_EQ(offset % kInt8MomentBlock, 0) << "int8 moment ranges start at a block boundary";
  const int64_t block = offset / kInt8MomentBlock;
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
