// FirstNonFinite on awkward lengths and positions (block edges, tails) for both rules.
#include "common/numeric/finite.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gtest/gtest.h"

namespace slidedp {
namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(FirstNonFinite, FindsTheFirstBadElementAnywhere) {
  for (int64_t n : {1, 22, 63, 64, 65, 129, 1000}) {
    std::vector<float> x(n), v(n);
    for (int64_t i = 0; i < n; ++i) {
      x[i] = std::ldexp(1.0f + i % 7, static_cast<int>(i % 200) - 100) * (i % 2 ? -1 : 1);
      v[i] = std::fabs(x[i]);
    }
    x[n / 2] = std::numeric_limits<float>::max();  // finite
    EXPECT_EQ(FirstNonFinite(x.data(), n), -1) << n;
    EXPECT_EQ(FirstNonFinite(v.data(), n, FiniteRule::kSecondMoment), -1) << n;
    for (int64_t pos : {int64_t{0}, n / 3, n - 1}) {
      for (float bad : {kNaN, -kNaN, kInf, -kInf}) {
        std::vector<float> y = x, w = v;
        y[pos] = w[pos] = bad;
        if (pos + 1 < n) y[n - 1] = w[n - 1] = kNaN;  // a later one does not win
        EXPECT_EQ(FirstNonFinite(y.data(), n), pos) << n << " " << pos;
        const bool allowed = bad == kInf;  // v may be +inf
        EXPECT_EQ(FirstNonFinite(w.data(), n, FiniteRule::kSecondMoment), allowed ? (pos + 1 < n ? n - 1 : -1) : pos)
            << n << " " << pos;
      }
    }
  }
}

TEST(FirstNonFinite, SecondMomentRuleAllowsZeroesOfBothSignsAndInfinity) {
  std::vector<float> v = {0.0f, -0.0f, 1e-30f, 3.0f, std::numeric_limits<float>::denorm_min(), kInf};
  EXPECT_EQ(FirstNonFinite(v.data(), v.size(), FiniteRule::kSecondMoment), -1);
  EXPECT_EQ(FirstNonFinite(v.data(), v.size()), 5);
  v.push_back(-std::numeric_limits<float>::denorm_min());
  EXPECT_EQ(FirstNonFinite(v.data(), v.size(), FiniteRule::kSecondMoment), 6);
  v.back() = kNaN;
  EXPECT_EQ(FirstNonFinite(v.data(), v.size(), FiniteRule::kSecondMoment), 6);
}

}  // namespace
}  // namespace slidedp
