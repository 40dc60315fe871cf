// The run-time choice among the scalar, AVX2 and AVX-512 tables of the compact-moment kernels,
// each the codec of its ISA (common/moments) with its steps. Compiled without ISA flags: it must
// run on any x86-64 CPU.
#include "hostd/update/adamw_state.h"

#include "hostd/update/adamw_state_element_inl.h"

namespace slidedp::update {

uint32_t StochasticRoundingKey(uint64_t seed, int64_t step, uint32_t index_hi) {
  return RoundingKey(seed, step, index_hi);
}

const AdamStateKernelTable* AdamStateKernelsFor(AdamIsa isa) {
  if (!AdamIsaSupported(isa)) return nullptr;
  // Copies of the two constant tables, made on first use: never read before they are made, as a
  // namespace-scope copy could be during another file's static initialization.
  static const AdamStateKernelTable kScalar{moments::internal::kScalarMomentCodecs, internal::kScalarStateSteps};
  static const AdamStateKernelTable kAvx2{moments::internal::kAvx2MomentCodecs, internal::kAvx2StateSteps};
  static const AdamStateKernelTable kAvx512{moments::internal::kAvx512MomentCodecs, internal::kAvx512StateSteps};
  switch (isa) {
    case AdamIsa::kScalar: return &kScalar;
    case AdamIsa::kAvx2: return &kAvx2;
    case AdamIsa::kAvx512: return &kAvx512;
  }
  return nullptr;
}

const AdamStateKernelTable& ActiveAdamStateKernels() {
  static const AdamStateKernelTable* table = AdamStateKernelsFor(ActiveAdamIsa());
  return *table;
}

}  // namespace slidedp::update
