// TensorBoardSink: the table's fields of a step record (scaled, presence respected, unknown and
// non-numeric fields skipped), one event per record in <output>/tensorboard/<job>/, and an events
// file that cannot be created or written logged once and then left alone.
#include "hostd/metrics/tensorboard_sink.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "common/tensorboard/event_reader.h"
#include "google/protobuf/descriptor.pb.h"
#include "google/protobuf/dynamic_message.h"
#include "google/protobuf/text_format.h"
#include "gtest/gtest.h"

namespace slidedp::metrics {
namespace {

using ::testing::TempDir;

std::map<std::string, float> ByTag(const std::vector<tensorboard::Scalar>& scalars) {
  std::map<std::string, float> out;
  for (const auto& s : scalars) out[s.tag] = s.value;
  return out;
}

v1::StepMetrics Record(int64_t step) {
  v1::StepMetrics m;
  m.set_step(step);
  m.set_loss(2.5 / step);
  m.set_learning_rate(1e-4);
  m.set_grad_norm(0.75);
  m.set_tokens_per_s(12345.5);
  m.set_model_tflops(321.25);
  m.set_step_time_s(0.5);
  m.set_host_state_bytes(3ll << 30);
  m.set_gpu_peak_bytes(3ll << 29);
  return m;
}

TEST(StepScalars, TheTablesFieldsOfAStepRecord) {
  const auto got = ByTag(StepScalars(Record(2), kStepScalarFields));
  const std::map<std::string, float> want = {{"train/loss", 1.25f},          {"train/lr", 1e-4f},
                                             {"train/grad_norm", 0.75f},     {"perf/tokens_per_s", 12345.5f},
                                             {"perf/model_tflops", 321.25f}, {"perf/step_time_s", 0.5f},
                                             {"memory/host_gib", 3.0f},      {"memory/gpu_peak_gib", 1.5f}};
  EXPECT_EQ(got, want);  // no eval_loss set (or no such field), no mfu field
}

// A record type with a validation loss only some steps carry (`optional`), as a later
// v1::StepMetrics may have.
TEST(StepScalars, OptionalFieldsOnlyWhenSetNonNumericNever) {
  google::protobuf::FileDescriptorProto file;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"pb(
        name: "rec.proto"
        syntax: "proto3"
        message_type {
          name: "Rec"
          field { name: "loss" number: 1 type: TYPE_DOUBLE label: LABEL_OPTIONAL }
          field {
            name: "eval_loss"
            number: 2
            type: TYPE_DOUBLE
            label: LABEL_OPTIONAL
            proto3_optional: true
            oneof_index: 0
          }
          field { name: "gpu_peak_bytes" number: 3 type: TYPE_STRING label: LABEL_OPTIONAL }
          field { name: "grad_norm" number: 4 type: TYPE_FLOAT label: LABEL_REPEATED }
          oneof_decl { name: "_eval_loss" }
        })pb",
      &file));
  google::protobuf::DescriptorPool pool;
  const google::protobuf::FileDescriptor* fd = pool.BuildFile(file);
  ASSERT_NE(fd, nullptr);
  google::protobuf::DynamicMessageFactory factory(&pool);
  std::unique_ptr<google::protobuf::Message> rec(factory.GetPrototype(fd->message_type(0))->New());
  const auto* r = rec->GetReflection();
  r->SetDouble(rec.get(), fd->message_type(0)->FindFieldByName("loss"), 3.0);
  r->SetString(rec.get(), fd->message_type(0)->FindFieldByName("gpu_peak_bytes"), "12");
  r->AddFloat(rec.get(), fd->message_type(0)->FindFieldByName("grad_norm"), 1.0f);
  EXPECT_EQ(ByTag(StepScalars(*rec, kStepScalarFields)), (std::map<std::string, float>{{"train/loss", 3.0f}}));
  r->SetDouble(rec.get(), fd->message_type(0)->FindFieldByName("eval_loss"), 0.0);  // set, even to 0
  EXPECT_EQ(ByTag(StepScalars(*rec, kStepScalarFields)),
            (std::map<std::string, float>{{"train/loss", 3.0f}, {"eval/loss", 0.0f}}));
}

TEST(TensorBoardSink, OneEventPerRecordInTheJobsDirectory) {
  const std::string out = TempDir() + "/tbsink-" + std::to_string(getpid());
  std::filesystem::remove_all(out);
  std::vector<std::string> logs;
  TensorBoardSink sink(out, "job-7", absl::Now(), [&](const std::string& l) { logs.push_back(l); });
  ASSERT_TRUE(sink.writing()) << (logs.empty() ? "" : logs[0]);
  EXPECT_EQ(std::filesystem::path(sink.path()).parent_path().string(), out + "/tensorboard/job-7");
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_EQ(logs[0], "TensorBoard events: " + sink.path());
  for (int step = 1; step <= 4; ++step) sink.Append(Record(step), absl::Now());
  auto got = tensorboard::ReadEventFile(sink.path());
  ASSERT_TRUE(got.ok()) << got.status();
  ASSERT_EQ(got->scalars.size(), 4u * 8);
  for (int step = 1; step <= 4; ++step) {
    const tensorboard::ScalarEvent& loss = got->scalars[(step - 1) * 8];
    EXPECT_EQ(loss.step, step);
    EXPECT_EQ(loss.tag, "train/loss");
    EXPECT_EQ(loss.value, static_cast<float>(2.5 / step));
  }
  std::filesystem::remove_all(out);
}

TEST(TensorBoardSink, UncreatableDirectoryIsLoggedOnceAndNothingFails) {
  const std::string out = TempDir() + "/tbsink-bad-" + std::to_string(getpid());
  std::filesystem::create_directories(out);
  std::ofstream(out + "/tensorboard") << "a file where the directory would go";
  std::vector<std::string> logs;
  TensorBoardSink sink(out, "job-1", absl::Now(), [&](const std::string& l) { logs.push_back(l); });
  EXPECT_FALSE(sink.writing());
  sink.Append(Record(1), absl::Now());
  ASSERT_EQ(logs.size(), 1u);
  EXPECT_TRUE(absl::StrContains(logs[0], "TensorBoard events stopped")) << logs[0];
  EXPECT_TRUE(absl::StrContains(logs[0], out + "/tensorboard")) << logs[0];
  std::filesystem::remove_all(out);
}

// A write that fails mid-job (here EFBIG: the file-size limit, as a full disk would give ENOSPC)
// stops the sink after one log line; the records before it stay readable.
TEST(TensorBoardSink, AWriteErrorStopsTheSinkAfterOneLogLine) {
  const std::string out = TempDir() + "/tbsink-efbig-" + std::to_string(getpid());
  std::filesystem::remove_all(out);
  std::vector<std::string> logs;
  TensorBoardSink sink(out, "job-2", absl::Now(), [&](const std::string& l) { logs.push_back(l); });
  ASSERT_TRUE(sink.writing());
  sink.Append(Record(1), absl::Now());
  const std::string path = sink.path();
  rlimit saved;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &saved), 0);
  signal(SIGXFSZ, SIG_IGN);
  rlimit small = saved;
  small.rlim_cur = std::filesystem::file_size(path);
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &small), 0);
  sink.Append(Record(2), absl::Now());
  sink.Append(Record(3), absl::Now());
  ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &saved), 0);
  signal(SIGXFSZ, SIG_DFL);
  EXPECT_FALSE(sink.writing());
  ASSERT_EQ(logs.size(), 2u);
  EXPECT_TRUE(absl::StrContains(logs[1], "TensorBoard events stopped")) << logs[1];
  auto got = tensorboard::ReadEventFile(path);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_EQ(got->scalars.size(), 8u);
  std::filesystem::remove_all(out);
}

}  // namespace
}  // namespace slidedp::metrics
