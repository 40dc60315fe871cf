// CastPool: every piece split gives FloatToBf16's bits over the whole range (lengths around the
// piece and line boundaries, one to six threads), calls repeat on the same threads, and a pool is
// torn down cleanly idle or right after a call.
#include "worker/pipeline/cast_pool.h"

#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

namespace slidedp {
namespace {

TEST(CastPool, EveryThreadCountAndLengthIsFloatToBf16) {
  std::mt19937 rng(3);
  const int64_t max_n = 6 * CastPool::kMinPieceNumel + 77;
  std::vector<float> in(max_n + 1);
  for (float& x : in) {
    const uint32_t bits = rng();
    std::memcpy(&x, &bits, 4);  // every exponent, NaNs and infinities included
  }
  for (int threads : {1, 2, 3, 6}) {
    CastPool pool(threads);
    EXPECT_EQ(pool.threads(), threads);
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{31}, CastPool::kMinPieceNumel - 1, CastPool::kMinPieceNumel,
                      2 * CastPool::kMinPieceNumel + 1, 3 * CastPool::kMinPieceNumel + 33, max_n}) {
      for (int offset : {0, 1}) {
        std::vector<bf16_t> out(n + 1, 0x5a5a);
        pool.Cast(in.data() + offset, out.data(), n);
        for (int64_t i = 0; i < n; ++i) {
          ASSERT_EQ(out[i], FloatToBf16(in[offset + i])) << threads << " threads, n " << n << ", element " << i;
        }
        EXPECT_EQ(out[n], 0x5a5a) << "wrote past the end";
      }
    }
  }
  { CastPool idle(4); }  // started and stopped without a call
}

}  // namespace
}  // namespace slidedp
