// FirstNonFinite on awkward lengths and positions (block edges, tails) for both rules.
#include "common/numeric/finite.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace slidedp {
namespace {

TEST(FirstNonFinite, FindsTheFirstBadElementAnywhere) {
  const float kBad[] = {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
                        std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  for (int64_t n : {1, 22, 63, 64, 65, 129, 1000}) {
    std::vector<float> x(n);
    for (int64_t i = 0; i < n; ++i) x[i] = std::ldexp(1.0f + i % 7, static_cast<int>(i % 200) - 100) * (i % 2 ? -1 : 1);
    EXPECT_EQ(FirstNonFinite(x.data(), n), -1) << n;
    x[n / 2] = std::numeric_limits<float>::max();  // finite
    EXPECT_EQ(FirstNonFinite(x.data(), n), -1) << n;
    for (int64_t pos : {int64_t{0}, n / 3, n - 1}) {
      for (float bad : kBad) {
        std::vector<float> y = x;
        y[pos] = bad;
        if (pos + 1 < n) y[n - 1] = bad;  // a later one does not win
        EXPECT_EQ(FirstNonFinite(y.data(), n), pos) << n << " " << pos;
        EXPECT_EQ(FirstNonFinite(y.data(), n, FiniteRule::kFiniteNonNegative), std::min<int64_t>(pos, 1)) << n;
      }
    }
  }
}

TEST(FirstNonFinite, NonNegativeRuleAllowsZeroesOfBothSigns) {
  std::vector<float> v = {0.0f, -0.0f, 1e-30f, 3.0f, std::numeric_limits<float>::denorm_min()};
  EXPECT_EQ(FirstNonFinite(v.data(), v.size(), FiniteRule::kFiniteNonNegative), -1);
  v.push_back(-std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(FirstNonFinite(v.data(), v.size(), FiniteRule::kFiniteNonNegative), 5);
  EXPECT_EQ(FirstNonFinite(v.data(), v.size()), -1);
}

}  // namespace
}  // namespace slidedp
