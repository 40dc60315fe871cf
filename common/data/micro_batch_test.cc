// Rows -> MicroBatch: labels at document boundaries and masks, positions, cu_seqlens.
#include "common/data/micro_batch.h"

#include <unistd.h>

#include <filesystem>

#include "glog/logging.h"
#include "gtest/gtest.h"

namespace slidedp::data {
namespace {

constexpr int32_t I = kIgnoreIndex;

std::unique_ptr<DatasetReader> Build(const std::string& name) {
  const std::string dir = testing::TempDir() + "/mb_test_" + std::to_string(::getpid()) + "_" + name;
  std::filesystem::remove_all(dir);
  WriterOptions o{.vocab_size = 100, .seq_len = 6, .packing = Packing::kPacked};
  auto w = DatasetWriter::Create(dir, o);
  CHECK(w.ok());
  // doc A: prompt 10 11 | answer 12 13 ; doc B: 20 21 (all trained) ; doc C: 30..37 (8 > seq_len 6: split 6 + 2)
  CHECK((*w)->AddDocument(std::vector<uint32_t>{10, 11, 12, 13}, std::vector<uint8_t>{0, 0, 1, 1}).ok());
  CHECK((*w)->AddDocument(std::vector<uint32_t>{20, 21}, std::vector<uint8_t>{1, 1}).ok());
  CHECK((*w)->AddDocument(std::vector<uint32_t>{30, 31, 32, 33, 34, 35, 36, 37}, std::vector<uint8_t>(8, 1)).ok());
  CHECK((*w)->Finish().ok());
  auto r = DatasetReader::Open(dir);
  CHECK(r.ok()) << r.status();
  return std::move(*r);
}

TEST(MicroBatch, LabelsShiftWithinDocumentsAndStopAtBoundaries) {
  auto ds = Build("labels");
  ASSERT_EQ(ds->num_rows(), 3);  // [A B] [C0..C5] [C6 C7]
  std::vector<int64_t> rows = {0, 2};
  auto mb = BuildMicroBatch(*ds, rows);
  ASSERT_TRUE(mb.ok()) << mb.status();
  EXPECT_EQ(mb->tokens, (std::vector<int32_t>{10, 11, 12, 13, 20, 21, 36, 37}));
  // Position t predicts t+1 only where t+1 is trained and in the same piece (HF shift convention).
  EXPECT_EQ(mb->labels, (std::vector<int32_t>{I, 12, 13, I, 21, I, 37, I}));
  EXPECT_EQ(mb->positions, (std::vector<int32_t>{0, 1, 2, 3, 0, 1, 0, 1}));
  EXPECT_EQ(mb->cu_seqlens, (std::vector<int32_t>{0, 4, 6, 8}));
  EXPECT_EQ(mb->max_seqlen, 4);
  auto trained = CountTrainedLabels(*ds, rows);
  ASSERT_TRUE(trained.ok());
  EXPECT_EQ(*trained, 4);
}

TEST(MicroBatch, SplitDocumentRestartsPositions) {
  auto ds = Build("split");
  std::vector<int64_t> rows = {1};
  auto mb = BuildMicroBatch(*ds, rows);
  ASSERT_TRUE(mb.ok());
  EXPECT_EQ(mb->positions, (std::vector<int32_t>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(mb->labels, (std::vector<int32_t>{31, 32, 33, 34, 35, I}));
  EXPECT_EQ(mb->max_seqlen, 6);
}

TEST(MicroBatch, RejectsRowOutsideDataset) {
  auto ds = Build("oob");
  std::vector<int64_t> rows = {3};
  EXPECT_EQ(BuildMicroBatch(*ds, rows).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp::data
