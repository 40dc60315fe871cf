// Portable scalar conversions between FP32 and the compact moments: the fallback and the reference
// the vector codecs must match bit for bit. Compiled with -ffp-contract=off (see CMakeLists.txt).
#include <cmath>
#include <cstdint>

#include "common/moments/moment_codec_inl.h"
#include "common/moments/moments.h"

namespace slidedp::moments {
namespace {

// ---- int8 ----

void Int8FromF32(const float* m, const float* v, const Int8Moments& out, int64_t n) {
  for (int64_t start = 0, block = 0; start < n; start += kInt8MomentBlock, ++block) {
    const int64_t len = std::min(kInt8MomentBlock, n - start);
    float s_new[kInt8MomentBlock];
    uint32_t m_abs = 0, s_abs = 0;
    for (int64_t i = 0; i < len; ++i) {
      s_new[i] = std::sqrt(v[start + i]);
      m_abs = std::max(m_abs, FloatBits(m[start + i]) & 0x7fffffffu);
      s_abs = std::max(s_abs, FloatBits(s_new[i]) & 0x7fffffffu);
    }
    const Int8BlockScales b = MakeInt8BlockScales(m_abs, s_abs);
    EncodeInt8Elements(b, m + start, s_new, 0, len, out.m_codes + start, out.v_codes + start);
    out.m_scales[block] = b.m_scale;
    out.v_scales[block] = b.v_scale;
  }
}

void Int8ToF32(const Int8MomentsView& in, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const int64_t block = i / kInt8MomentBlock;
    m[i] = DecodeM(in.m_codes[i], in.m_scales[block]);
    v[i] = DecodeV(in.v_codes[i], Int8VStep(in.v_scales[block]));
  }
}

// ---- bf16 ----

void Bf16FromF32(const float* m, const float* v, const Bf16Moments& out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    out.m[i] = FloatToBf16(m[i]);
    out.v[i] = FloatToBf16(v[i]);
  }
}

void Bf16ToF32(const Bf16MomentsView& in, float* m, float* v, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    m[i] = Bf16ToFloat(in.m[i]);
    v[i] = Bf16ToFloat(in.v[i]);
  }
}

}  // namespace

namespace internal {
const MomentCodecTable kScalarMomentCodecs = {
    .int8_from_f32 = &Int8FromF32,
    .int8_to_f32 = &Int8ToF32,
    .bf16_from_f32 = &Bf16FromF32,
    .bf16_to_f32 = &Bf16ToF32,
};
}  // namespace internal

}  // namespace slidedp::moments
