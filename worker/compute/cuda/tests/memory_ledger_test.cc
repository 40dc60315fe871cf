// The GPU memory ledger's bookkeeping (plain C++: runs without a GPU).
#include "worker/compute/cuda/memory_ledger.h"

#include <source_location>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::cuda_backend_internal {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kGiB = int64_t{1} << 30;

std::source_location Here(std::source_location site = std::source_location::current()) { return site; }

TEST(MemoryLedger, ReportsWhatWasLiveAtThePeakBySite) {
  MemoryLedger ledger;
  const std::source_location a = Here();
  const std::source_location b = Here();  // another line: another site
  int x = 0, y = 0, z = 0;
  ledger.Add(&x, 2 * kGiB, a);
  ledger.Add(&y, 1 * kGiB, a);
  ledger.Add(&z, 4 * kGiB, b);  // the peak: 7 GiB
  ledger.Remove(&z);
  ledger.Remove(&y);
  ledger.Add(&z, 1 * kGiB, b);  // 3 GiB now, below the peak
  EXPECT_EQ(ledger.live_bytes(), 3 * kGiB);
  EXPECT_EQ(ledger.peak_bytes(), 7 * kGiB);
  const std::string report = ledger.TakePeakReport();
  EXPECT_THAT(report, HasSubstr("7.00 GiB live at the peak: 4.00 GiB " + SiteName(b) + " (1 buffer); 3.00 GiB " +
                                SiteName(a) + " (2 buffers);"));
  EXPECT_THAT(SiteName(a), HasSubstr("memory_ledger_test.cc:"));
  // The peak restarts from what is live now.
  EXPECT_EQ(ledger.peak_bytes(), 3 * kGiB);
  EXPECT_THAT(ledger.TakePeakReport(), HasSubstr("3.00 GiB live at the peak: 2.00 GiB " + SiteName(a)));
}

TEST(MemoryLedger, IgnoresUnknownAndEmptyBuffersAndReplacesAReusedPointer) {
  MemoryLedger ledger;
  int x = 0, y = 0;
  ledger.Remove(&x);
  ledger.Remove(nullptr);
  ledger.Add(nullptr, kGiB, Here());
  ledger.Add(&y, 0, Here());
  EXPECT_EQ(ledger.live_bytes(), 0);
  ledger.Add(&x, kGiB, Here());
  ledger.Add(&x, 2 * kGiB, Here());  // its free not seen: counted once, at its new size
  EXPECT_EQ(ledger.live_bytes(), 2 * kGiB);
  ledger.Remove(&x);
  EXPECT_EQ(ledger.live_bytes(), 0);
  EXPECT_THAT(ledger.TakePeakReport(), Not(HasSubstr("(2 buffers)")));
}

}  // namespace
}  // namespace slidedp::cuda_backend_internal
