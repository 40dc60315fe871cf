// Int8 ranges and the run-time choice among the scalar, AVX2 and AVX-512 codec tables. Compiled
// without ISA flags: it must run on any x86-64 CPU.
#include "common/moments/moments.h"

#include "glog/logging.h"

namespace slidedp::moments {

Int8Moments Int8MomentsAt(const Int8Moments& base, int64_t offset) {
  CHECK_EQ(offset % kInt8MomentBlock, 0) << "int8 moment ranges start at a block boundary";
  const int64_t block = offset / kInt8MomentBlock;
  return {base.m_codes + offset, base.v_codes + offset, base.m_scales + block, base.v_scales + block};
}

const MomentCodecTable* MomentCodecsFor(AdamIsa isa) {
  if (!AdamIsaSupported(isa)) return nullptr;
  switch (isa) {
    case AdamIsa::kScalar: return &internal::kScalarMomentCodecs;
    case AdamIsa::kAvx2: return &internal::kAvx2MomentCodecs;
    case AdamIsa::kAvx512: return &internal::kAvx512MomentCodecs;
  }
  return nullptr;
}

const MomentCodecTable& ActiveMomentCodecs() {
  static const MomentCodecTable* table = MomentCodecsFor(ActiveAdamIsa());
  return *table;
}

}  // namespace slidedp::moments
