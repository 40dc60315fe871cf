// Compact Adam moments' codec (moments.h): names and bytes of the forms, int8 ranges, every ISA's
// conversions against the code maps and each other bit for bit, re-encoding stable, and the ISA
// names and the dispatch SLIDEDP_ADAM_ISA overrides. The kernels that step through this codec are
// tested in hostd/update/tests/adamw_state_test.cc.
#include "common/moments/moments.h"

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "common/moments/moments_test_util.h"
#include "common/numeric/bf16.h"
#include "gtest/gtest.h"

namespace slidedp::moments {
namespace {

using namespace slidedp::moments::testing;

TEST(Moments, NamesParseAndBytes) {
  for (MomentForm d : {MomentForm::kF32, MomentForm::kBF16, MomentForm::kInt8}) {
    absl::StatusOr<MomentForm> back = ParseMomentForm(ToString(d));
    ASSERT_TRUE(back.ok());
    EXPECT_EQ(*back, d);
  }
  EXPECT_EQ(ToString(MomentForm::kInt8), "int8");
  EXPECT_EQ(ParseMomentForm("fp8").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(MomentBytes(MomentForm::kF32, 1000), 8000);
  EXPECT_EQ(MomentBytes(MomentForm::kBF16, 1000), 4000);
  EXPECT_EQ(MomentBytes(MomentForm::kInt8, 0), 0);
  EXPECT_EQ(MomentBytes(MomentForm::kInt8, 1), 2 + 8);  // a partial block counts whole
  EXPECT_EQ(MomentBytes(MomentForm::kInt8, 256), 512 + 8);
  EXPECT_EQ(MomentBytes(MomentForm::kInt8, 257), 514 + 16);
  EXPECT_EQ(MomentBytes(MomentForm::kInt8, int64_t{1} << 30), (int64_t{2} << 30) + (int64_t{1} << 25));
  EXPECT_EQ(Int8MomentBlocks(0), 0);
  EXPECT_EQ(Int8MomentBlocks(256), 1);
  EXPECT_EQ(Int8MomentBlocks(257), 2);
  int8_t mc[1024];
  uint8_t vc[1024];
  float ms[4], vs[4];
  const Int8Moments base{mc, vc, ms, vs};
  const Int8Moments at = Int8MomentsAt(base, 512);
  EXPECT_EQ(at.m_codes, mc + 512);
  EXPECT_EQ(at.v_codes, vc + 512);
  EXPECT_EQ(at.m_scales, ms + 2);
  EXPECT_EQ(at.v_scales, vs + 2);
}

// FP32 -> int8 -> FP32: each value within half a code step (m: 1/16 of |m| on the 3-bit-mantissa
// grid, or 2^-15 of the block absmax where it flushes; v: half a step of (v/vmax)^(1/4) in 255ths),
// non-zero v never decodes to 0, and re-encoding the decoded values gives the same codes and scales
// (a checkpoint converted back and forth is stable). FP32 -> BF16 -> FP32 is nearest-even.
TEST(Moments, ConversionsRoundTrip) {
  for (int64_t n : {1, 255, 256, 257, 4099}) {
    std::vector<float> m0, v0;
    RandomMoments(n, static_cast<uint32_t>(n * 3), &m0, &v0);
    Int8State want(n, 0);
    std::vector<float> want_m;
    for (AdamIsa isa : SupportedIsas()) {
      SCOPED_TRACE(::testing::Message() << AdamIsaName(isa) << " n=" << n);
      const MomentCodecTable* k = MomentCodecsFor(isa);
      Int8State s(n, 1), again(n, 2);
      k->int8_from_f32(m0.data(), v0.data(), s.Ref(), n);
      std::vector<float> m(n), v(n);
      k->int8_to_f32(s.View(), m.data(), v.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t b = i / kInt8MomentBlock;
        const double m_abs = s.ms.data[b], s_abs = s.vs.data[b];
        ASSERT_LE(std::fabs(m[i] - m0[i]),
                  std::max(std::fabs(m0[i]) / 16.0, m_abs * 1.2 * std::ldexp(1.0, -16)) * 1.0001)
            << i;
        if (v0[i] > 0) {
          ASSERT_GT(v[i], 0) << i;
          const double q_want = 255.0 * std::pow(v0[i] / (s_abs * s_abs), 0.25);
          const double q_got = 255.0 * std::pow(v[i] / (s_abs * s_abs), 0.25);
          if (q_want >= 0.5) {
            ASSERT_LE(std::fabs(q_got - q_want), 0.5 + 1e-4) << i;
          }
        } else {
          ASSERT_EQ(v[i], 0.0f) << i;
        }
      }
      k->int8_from_f32(m.data(), v.data(), again.Ref(), n);
      ASSERT_EQ(0, std::memcmp(s.m.data, again.m.data, n));
      ASSERT_EQ(0, std::memcmp(s.v.data, again.v.data, n));
      for (int64_t b = 0; b < s.blocks; ++b) {
        // The scale of a block re-encoded from its decoded values: its absmax element decodes to
        // scale * 1.0 (m) and to ((255^2 * f32(scale / 255^2)))^2 (v), within an ulp or two.
        ASSERT_EQ(Bits(again.ms.data[b]), Bits(s.ms.data[b])) << b;
        ASSERT_NEAR(again.vs.data[b], s.vs.data[b], 4e-7 * s.vs.data[b]) << b;
      }
      if (want_m.empty()) {
        want.CopyFrom(s);
        want_m = m;
      } else {
        ASSERT_TRUE(SameInt8(s, want));
        ASSERT_EQ(0, std::memcmp(m.data(), want_m.data(), 4 * n));
      }
      std::vector<bf16_t> m16(n), v16(n);
      k->bf16_from_f32(m0.data(), v0.data(), {m16.data(), v16.data()}, n);
      k->bf16_to_f32({m16.data(), v16.data()}, m.data(), v.data(), n);
      for (int64_t i = 0; i < n; ++i) {
        ASSERT_EQ(m16[i], FloatToBf16(m0[i]));
        ASSERT_EQ(v16[i], FloatToBf16(v0[i]));
        ASSERT_EQ(m[i], Bf16ToFloat(m16[i]));
        ASSERT_EQ(v[i], Bf16ToFloat(v16[i]));
      }
    }
  }
}

TEST(Moments, IsaNamesAndDispatch) {
  EXPECT_EQ(*ParseAdamIsa("avx2"), AdamIsa::kAvx2);
  EXPECT_EQ(*ParseAdamIsa("avx512"), AdamIsa::kAvx512);
  EXPECT_EQ(*ParseAdamIsa("scalar"), AdamIsa::kScalar);
  EXPECT_EQ(ParseAdamIsa("sse").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(AdamIsaSupported(ActiveAdamIsa()));
  EXPECT_TRUE(AdamIsaSupported(AdamIsa::kScalar));
  // ctest also runs this with SLIDEDP_ADAM_ISA set (see CMakeLists.txt).
  if (const char* forced = std::getenv("SLIDEDP_ADAM_ISA"); forced != nullptr) {
    absl::StatusOr<AdamIsa> want = ParseAdamIsa(forced);
    ASSERT_TRUE(want.ok()) << want.status();
    if (AdamIsaSupported(*want)) {
      EXPECT_EQ(ActiveAdamIsa(), *want);
    } else {
      EXPECT_NE(ActiveAdamIsa(), *want);
    }
  } else {
    EXPECT_EQ(ActiveAdamIsa(), AdamIsaSupported(AdamIsa::kAvx512) ? AdamIsa::kAvx512
                               : AdamIsaSupported(AdamIsa::kAvx2) ? AdamIsa::kAvx2
                                                                  : AdamIsa::kScalar);
  }
}

TEST(Moments, ActiveTableFollowsDispatch) {
  std::printf("active ISA: %s\n", AdamIsaName(ActiveAdamIsa()).c_str());
  EXPECT_EQ(&ActiveMomentCodecs(), MomentCodecsFor(ActiveAdamIsa()));
}

}  // namespace
}  // namespace slidedp::moments
