// CastF32ToBf16 on every ISA the host has is FloatToBf16, bit for bit: rounding ties both ways,
// subnormals, infinities, NaNs of every sign and payload, and every length's tail.
#include "common/numeric/bf16_cast.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace slidedp {
namespace {

float FromBits(uint32_t b) {
  float f;
  std::memcpy(&f, &b, sizeof(f));
  return f;
}

std::vector<float> Values() {
  std::vector<float> v;
  for (uint32_t b : {0x00000000u, 0x80000000u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u, 0x3f807fffu,
                     0x3f808001u, 0x7f7fffffu, 0xff7fffffu, 0x7f800000u, 0xff800000u, 0x7f800001u, 0xffc00000u,
                     0x7fffffffu, 0xff800001u, 0x7fbfffffu, 0x7f7f8000u})
    v.push_back(FromBits(b));
  std::mt19937 rng(7);
  for (int i = 0; i < 20000; ++i) v.push_back(FromBits(rng()));  // every exponent, NaNs included
  std::normal_distribution<float> normal(0.f, 0.02f);
  for (int i = 0; i < 20000; ++i) v.push_back(normal(rng));
  return v;
}

TEST(Bf16Cast, EveryIsaIsFloatToBf16BitForBit) {
  const std::vector<float> in = Values();
  for (CastIsa isa : {CastIsa::kScalar, CastIsa::kAvx2, CastIsa::kAvx512}) {
    bf16_t none = 0;
    if (!CastF32ToBf16On(isa, in.data(), &none, 0)) {
      GTEST_LOG_(INFO) << "ISA " << static_cast<int>(isa) << " not on this host";
      continue;
    }
    // Every tail length and an unaligned start.
    for (int64_t offset : {0, 1, 3}) {
      for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{15}, int64_t{16}, int64_t{17}, int64_t{33},
                        static_cast<int64_t>(in.size()) - 3}) {
        std::vector<bf16_t> out(n + 1, 0xabcd);
        ASSERT_TRUE(CastF32ToBf16On(isa, in.data() + offset, out.data(), n));
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(out[i], FloatToBf16(in[offset + i]))
              << "isa " << static_cast<int>(isa) << " element " << i << " of " << n;
        }
        EXPECT_EQ(out[n], 0xabcd) << "wrote past the end";
      }
    }
  }
  std::vector<bf16_t> out(in.size());
  CastF32ToBf16(in.data(), out.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) ASSERT_EQ(out[i], FloatToBf16(in[i])) << i;
}

}  // namespace
}  // namespace slidedp
