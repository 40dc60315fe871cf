// Event files: CRC-32C against RFC 3720's vectors, the TFRecord framing and Event encoding against
// bytes worked out by hand from TensorFlow's field numbers (not from our .proto), and files read
// back with every CRC checked.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <regex>
#include <string>

#include "absl/strings/escaping.h"
#include "common/tensorboard/crc32c.h"
#include "common/tensorboard/event_reader.h"
#include "common/tensorboard/event_writer.h"
#include "gtest/gtest.h"
#include "tensorboard/event.pb.h"

namespace slidedp::tensorboard {
namespace {

std::string Bytes(const std::string& hex) { return absl::HexStringToBytes(hex); }

std::string TempRoot() { return ::testing::TempDir() + "/tb-" + std::to_string(getpid()); }

std::string TempDir(const std::string& name) {
  const std::string dir = TempRoot() + "/" + name;
  std::filesystem::remove_all(dir);
  return dir;
}

// The test's files go when the tests are done.
class RemoveTempRoot : public ::testing::Environment {
  void TearDown() override { std::filesystem::remove_all(TempRoot()); }
};
::testing::Environment* const kRemoveTempRoot = ::testing::AddGlobalTestEnvironment(new RemoveTempRoot);

TEST(Crc32c, Rfc3720Vectors) {
  EXPECT_EQ(Crc32c(""), 0u);
  EXPECT_EQ(Crc32c("123456789"), 0xE3069283u);
  // RFC 3720, B.4: 32 bytes of zeros, of ones, ascending and descending.
  EXPECT_EQ(Crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(Crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string up, down;
  for (int i = 0; i < 32; ++i) {
    up.push_back(static_cast<char>(i));
    down.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(Crc32c(up), 0x46DD794Eu);
  EXPECT_EQ(Crc32c(down), 0x113FDB5Cu);
}

TEST(Crc32c, MaskRoundTrips) {
  for (uint32_t crc : {0u, 1u, 0xE3069283u, 0xffffffffu}) {
    EXPECT_EQ(UnmaskCrc(MaskCrc(crc)), crc);
    EXPECT_NE(MaskCrc(crc), crc);
  }
}

// Event{wall_time: 1.5, step: 3, summary {value {tag: "a", simple_value: 2}}}, encoded by hand:
// 09 <double 1.5>, 10 03, 2a 0a (Summary, 10 bytes) 0a 08 (Value, 8 bytes) 0a 01 'a' 15 <float 2>.
const char kEventHex[] =
    "09000000000000f83f"
    "1003"
    "2a0a"
    "0a08"
    "0a0161"
    "1500000040";

TEST(EventEncoding, MatchesTensorFlowFieldNumbers) {
  Event e;
  e.set_wall_time(1.5);
  e.set_step(3);
  Summary::Value* v = e.mutable_summary()->add_value();
  v->set_tag("a");
  v->set_simple_value(2.0f);
  EXPECT_EQ(absl::BytesToHexString(e.SerializeAsString()), kEventHex);

  Event first;
  first.set_wall_time(1.5);
  first.set_file_version(std::string(kFileVersion));
  EXPECT_EQ(first.SerializeAsString(), Bytes("09000000000000f83f"
                                             "1a0d") +
                                           "brain.Event:2");
}

TEST(FrameRecord, LengthCrcDataCrc) {
  // Length 23 (LE), masked CRC-32C of those 8 bytes, the data, masked CRC-32C of the data
  // (CRCs from an independent bit-by-bit CRC-32C).
  EXPECT_EQ(absl::BytesToHexString(FrameRecord(Bytes(kEventHex))), std::string("1700000000000000"
                                                                               "e7cef81e") +
                                                                       kEventHex + "e81c3a9d");
  auto records = SplitRecords(FrameRecord("") + FrameRecord("xyz"));
  ASSERT_TRUE(records.ok()) << records.status();
  EXPECT_EQ(*records, (std::vector<std::string>{"", "xyz"}));
}

TEST(SplitRecords, CorruptOrTruncatedIsDataLoss) {
  const std::string good = FrameRecord("hello") + FrameRecord("world");
  for (size_t at : {size_t{3}, size_t{9}, size_t{14}, good.size() - 1}) {
    std::string bad = good;
    bad[at] ^= 0x01;
    EXPECT_EQ(SplitRecords(bad).status().code(), absl::StatusCode::kDataLoss) << "byte " << at;
  }
  for (size_t keep : {size_t{5}, size_t{20}, good.size() - 1}) {
    EXPECT_EQ(SplitRecords(good.substr(0, keep)).status().code(), absl::StatusCode::kDataLoss) << keep;
  }
}

TEST(EventFileName, FollowsTensorFlow) {
  EXPECT_EQ(EventFileName(1700000000, "node7", 42, 0), "events.out.tfevents.1700000000.node7.42.0.slidedp");
  EXPECT_EQ(EventFileName(12, "h", 1, 3), "events.out.tfevents.0000000012.h.1.3.slidedp");
}

TEST(EventFileWriter, WritesRecordsThatReadBackWithTheirCrcs) {
  const std::string dir = TempDir("write") + "/tensorboard/job-1";  // parents are created
  const absl::Time t0 = absl::FromUnixSeconds(1700000000);
  auto w = EventFileWriter::Create(dir, t0);
  ASSERT_TRUE(w.ok()) << w.status();
  const std::string name = std::filesystem::path((*w)->path()).filename().string();
  EXPECT_TRUE(std::regex_match(name, std::regex(R"(events\.out\.tfevents\.1700000000\.[^/]+\.\d+\.\d+\.slidedp)")))
      << name;
  for (int step = 1; step <= 3; ++step) {
    const Scalar scalars[] = {{"train/loss", 10.0f / step}, {"train/lr", 1e-3f * step}};
    ASSERT_TRUE((*w)->WriteScalars(step, t0 + absl::Seconds(step), scalars).ok());
    // Flushed as written: what is on disk now holds this step, with nothing after it.
    auto now = ReadEventFile((*w)->path());
    ASSERT_TRUE(now.ok()) << now.status();
    ASSERT_EQ(now->scalars.size(), 2u * step);
  }
  auto got = ReadEventFile((*w)->path());
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->file_version, "brain.Event:2");
  EXPECT_EQ(got->first_wall_time, 1700000000.0);
  ASSERT_EQ(got->scalars.size(), 6u);
  EXPECT_EQ(got->scalars[4].step, 3);
  EXPECT_EQ(got->scalars[4].tag, "train/loss");
  EXPECT_EQ(got->scalars[4].value, 10.0f / 3);
  EXPECT_EQ(got->scalars[5].tag, "train/lr");
  EXPECT_EQ(got->scalars[5].value, 3e-3f);
  EXPECT_EQ(got->scalars[5].wall_time, 1700000003.0);
}

TEST(EventFileWriter, TwoWritersOfOneProcessInOneSecondGetTwoFiles) {
  const std::string dir = TempDir("two");
  const absl::Time t0 = absl::FromUnixSeconds(1700000000);
  auto a = EventFileWriter::Create(dir, t0);
  auto b = EventFileWriter::Create(dir, t0);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_NE((*a)->path(), (*b)->path());
}

TEST(EventFileWriter, UncreatableDirectoryIsAnError) {
  const std::string dir = TempDir("bad");
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/file") << "x";
  auto w = EventFileWriter::Create(dir + "/file/tensorboard", absl::Now());
  ASSERT_FALSE(w.ok());
  EXPECT_NE(w.status().message().find(dir + "/file/tensorboard"), std::string::npos) << w.status();
}

}  // namespace
}  // namespace slidedp::tensorboard
