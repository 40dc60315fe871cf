// GradConsumer, GradRings and WorkerReports against a broken worker, with real rings in /dev/shm
// and this process as the producer (ConsumerHarness): every bad descriptor kind fails the job with
// INTERNAL naming the worker (id and rank) and nothing outside hostd's buffers is touched; every
// misbehaving report is INTERNAL naming the worker; a non-finite gradient or loss fails the step
// with DATA_LOSS naming the step, the unit, the element and the worker before anything of it is
// applied (where the plan stages the step), or, with train.skip_nonfinite, skips it: master, m, v
// and mirror bitwise unchanged and every unit's gate at the next version.
#include <cmath>
#include <cstring>
#include <limits>
#include <thread>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "hostd/engine/tests/consumer_harness.h"

namespace slidedp::hostd {
namespace {

using testing::ConsumerHarness;
using testing::HarnessSpec;

float Value(int unit, int64_t i) { return 1e-3f * std::sin(0.01f * static_cast<float>(i) + unit); }

// Runs `producers` (one thread per rank) while hostd consumes step t; then stops the producers.
absl::StatusOr<StepGradients> ConsumeWhile(ConsumerHarness& h, int64_t t,
                                           const std::vector<std::function<void()>>& producers) {
  std::vector<std::thread> threads;
  for (const auto& p : producers) threads.emplace_back(p);
  absl::StatusOr<StepGradients> g = h.ConsumeStep(t);
  h.job_state().RaiseAbort(shm::AbortReason::kShutdown);  // wakes producers blocked on a slot
  h.CloseProducers();
  for (auto& th : threads) th.join();
  return g;
}

// A rank that posts its step correctly.
std::function<void()> Good(ConsumerHarness& h, int rank, int64_t t, std::function<float(int, int64_t)> v = Value) {
  return [&h, rank, t, v] { (void)h.PostStep(rank, t, v); };
}

void ExpectNamesWorker(const absl::StatusOr<StepGradients>& g, int rank, const std::string& what) {
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInternal) << what << ": " << g.status();
  EXPECT_TRUE(absl::StrContains(g.status().message(), absl::StrCat("worker fake", rank, " (rank ", rank, ")")))
      << what << ": " << g.status();
}

// One chunk of `unit` from `rank` with the given descriptor fields, posted without the
// producer's own checks (as a broken or foreign worker could).
void PostRaw(ConsumerHarness& h, int rank, shm::GradChunkDesc d, bool acquire = true) {
  if (acquire) {
    auto slot = h.producer(rank).AcquireSlot(absl::Seconds(5));
    ASSERT_TRUE(slot.ok()) << slot.status();
    d.slot = *slot;
  }
  ASSERT_TRUE(h.producer(rank).PostUncheckedForTest(d).ok());
}

TEST(GradConsumer, EveryBadDescriptorIsInternalNamingTheWorker) {
  struct Case {
    std::string what;
    GradReduction route;
    double clip;
    GradStaging staging;
    std::function<void(ConsumerHarness&)> post;  // rank 1 misbehaves (rank 0 is correct)
  };
  auto chunk = [](int unit, int64_t offset, int64_t numel, uint32_t step, shm::ChunkKind dtype) {
    shm::GradChunkDesc d;
    d.unit = unit;
    d.offset_numel = offset;
    d.numel = numel;
    d.step = step;
    d.kind = dtype;
    return d;
  };
  const auto kF32 = shm::ChunkKind::kGradF32;
  const std::vector<Case> cases = {
      {"outside its shard", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(1, 0, 16, 0, kF32)); }},  // rank 0's part of unit 1
      {"wrong step", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, 16, 7, kF32)); }},
      {"wrong dtype (BF16)", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, 16, 0, shm::ChunkKind::kGradBF16)); }},
      {"unknown dtype", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) {
         PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, 16, 0, static_cast<shm::ChunkKind>(9)));
       }},
      {"a norm where a part belongs", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(-1, 0, 1, 0, shm::ChunkKind::kSumSquares)); }},
      {"unit out of range", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(99, 0, 16, 0, kF32)); }},
      {"offset that overflows", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(1, std::numeric_limits<int64_t>::max() - 8, 16, 0, kF32)); }},
      {"numel beyond the slot", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) {
         PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, int64_t{1} << 61, 0, shm::ChunkKind::kSumSquares));
       }},
      {"negative numel", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, -4, 0, kF32)); }},
      {"a slot it did not acquire", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) {
         shm::GradChunkDesc d = chunk(1, h.PartOf(1, 1).offset, 16, 0, kF32);
         d.slot = 3;  // free: never acquired
         PostRaw(h, 1, d, /*acquire=*/false);
       }},
      {"one slot in two descriptors", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) {
         shm::GradChunkDesc d = chunk(1, h.PartOf(1, 1).offset, 16, 0, kF32);
         auto slot = h.producer(1).AcquireSlot(absl::Seconds(5));
         ASSERT_TRUE(slot.ok());
         d.slot = *slot;
         PostRaw(h, 1, d, /*acquire=*/false);
         d.offset_numel += 16;  // the next range, in the same slot again
         PostRaw(h, 1, d, /*acquire=*/false);
       }},
      {"a range twice (no staging)", GradReduction::kGpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) {
         for (int k = 0; k < 2; ++k) PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, 16, 0, kF32));
       }},
      {"a range twice (host staging)", GradReduction::kGpu, 1.0, GradStaging::kHost,
       [&](ConsumerHarness& h) {
         for (int k = 0; k < 2; ++k) PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, 16, 0, kF32));
       }},
      {"a range twice (device staging)", GradReduction::kGpu, 1.0, GradStaging::kDevice,
       [&](ConsumerHarness& h) {
         shm::GradChunkDesc norm = chunk(-1, 0, 1, 0, shm::ChunkKind::kSumSquares);
         PostRaw(h, 1, norm);
         for (int k = 0; k < 2; ++k) PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, 16, 0, kF32));
       }},
      {"a part before its norm (device staging)", GradReduction::kGpu, 1.0, GradStaging::kDevice,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(1, h.PartOf(1, 1).offset, 16, 0, kF32)); }},
      {"another chunk than rank 0 (cpu route)", GradReduction::kCpu, 0, GradStaging::kAuto,
       [&](ConsumerHarness& h) { PostRaw(h, 1, chunk(2, 0, 16, 0, kF32)); }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    ConsumerHarness h(HarnessSpec(2, c.clip, c.route, c.staging, false), 2);
    ASSERT_TRUE(h.status().ok()) << h.status();
    c.post(h);
    auto g = ConsumeWhile(h, 0, {Good(h, 0, 0)});
    ExpectNamesWorker(g, 1, c.what);
    EXPECT_EQ(h.job_state().abort().reason(), shm::AbortReason::kInternal) << "the workers are told at once";
  }
  // Rank 0 of the cpu route (one rank: the direct consumer) the same way.
  ConsumerHarness one(HarnessSpec(1, 0, GradReduction::kCpu, GradStaging::kAuto, false), 1);
  ASSERT_TRUE(one.status().ok()) << one.status();
  ASSERT_EQ(one.plan().consumer, GradConsumerKind::kDirect);
  PostRaw(one, 0, chunk(2, one.layout().units[2].numel - 8, 16, 0, kF32));  // past the unit's end
  ExpectNamesWorker(ConsumeWhile(one, 0, {}), 0, "direct consumer");
}

TEST(GradConsumer, BadReportsAreInternalNamingTheWorker) {
  struct Report {
    enum Kind { kDone, kLoss, kFinished } kind;
    int64_t step = 0;
    double loss = 1.0;
    int code = 0;
  };
  struct Case {
    std::string what;
    int64_t steps;                // the job's
    std::vector<Report> reports;  // from rank 1
    absl::StatusCode code;
    std::string message;
  };
  const int64_t far = WorkerReports::kReportWindowSteps + 1;
  const std::vector<Case> cases = {
      {"a step after the job's last", 4, {{Report::kDone, 4}}, absl::StatusCode::kInternal, "step 4 (0-based)"},
      {"a negative step", 4, {{Report::kLoss, -1}}, absl::StatusCode::kInternal, "step -1 (0-based)"},
      {"a step far ahead", 100, {{Report::kDone, far}}, absl::StatusCode::kInternal, "outside the steps [0, 9)"},
      {"a step twice", 4, {{Report::kDone, 0}, {Report::kDone, 0}}, absl::StatusCode::kInternal, "done twice"},
      {"two losses for one step",
       4,
       {{Report::kLoss, 0, 1.0}, {Report::kDone, 0, 2.0}},
       absl::StatusCode::kInternal,
       "two losses"},
      {"a status code that is none",
       4,
       {{Report::kFinished, 0, 0, 1234}},
       absl::StatusCode::kUnknown,
       "(status code 1234) gone wrong"},
      {"a NaN loss",
       4,
       {{Report::kLoss, 1, std::nan("")}},
       absl::StatusCode::kDataLoss,
       "step 2: loss is NaN on worker fake1 (rank 1)"},
      {"an infinite loss in StepDone",
       4,
       {{Report::kDone, 0, -INFINITY}},
       absl::StatusCode::kDataLoss,
       "step 1: loss is -inf on worker fake1 (rank 1)"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.what);
    JobSpec spec = HarnessSpec(2, 0, GradReduction::kGpu, GradStaging::kAuto, false);
    spec.train.steps = c.steps;
    ConsumerHarness h(spec, 2);
    ASSERT_TRUE(h.status().ok()) << h.status();
    for (const Report& r : c.reports) {
      v1::WorkerReport rep;
      if (r.kind == Report::kDone) {
        rep.mutable_step_done()->set_job_id(h.job_id());
        rep.mutable_step_done()->set_step(r.step);
        rep.mutable_step_done()->set_loss_sum(r.loss);
      } else if (r.kind == Report::kLoss) {
        rep.mutable_step_loss()->set_job_id(h.job_id());
        rep.mutable_step_loss()->set_step(r.step);
        rep.mutable_step_loss()->set_loss_sum(r.loss);
      } else {
        rep.mutable_job_finished()->set_job_id(h.job_id());
        rep.mutable_job_finished()->set_code(r.code);
        rep.mutable_job_finished()->set_message("gone wrong");
      }
      h.worker(1).reports().Push(rep);
    }
    absl::Status s = h.reports().Poll();
    EXPECT_EQ(s.code(), c.code) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "worker fake1 (rank 1)")) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), c.message)) << s;
    EXPECT_NE(h.job_state().abort().reason(), shm::AbortReason::kNone);
  }
  // Reports of another job or attempt are dropped, whatever they hold.
  ConsumerHarness h(HarnessSpec(2, 0, GradReduction::kGpu, GradStaging::kAuto, false), 2);
  v1::WorkerReport stale;
  stale.mutable_step_done()->set_job_id("another");
  stale.mutable_step_done()->set_step(-5);
  stale.mutable_step_done()->set_loss_sum(std::nan(""));
  h.worker(0).reports().Push(stale);
  EXPECT_TRUE(h.reports().Poll().ok());
}

// A cancel the step in flight does not reach its end for (a stalled worker) stops the job
// mid-step after the grace: CANCELLED, the abort word raised so the workers stop too.
TEST(GradConsumer, ACancelStopsAStalledStepAfterTheGrace) {
  ConsumerHarness h(HarnessSpec(1, 0, GradReduction::kCpu, GradStaging::kAuto, false), 1);
  ASSERT_TRUE(h.status().ok()) << h.status();
  h.reports().SetCancelGrace(absl::Milliseconds(100));
  EXPECT_TRUE(h.reports().Poll().ok());
  h.context().cancel = true;
  const absl::Time cancelled = absl::Now();
  EXPECT_TRUE(h.reports().Poll().ok());  // within the grace
  EXPECT_FALSE(h.job_state().abort().raised());
  absl::Status s;
  while (s.ok() && absl::Now() - cancelled < absl::Seconds(2)) {
    absl::SleepFor(absl::Milliseconds(10));
    s = h.reports().Poll();
  }
  EXPECT_GE(absl::Now() - cancelled, absl::Milliseconds(100));
  EXPECT_EQ(s.code(), absl::StatusCode::kCancelled) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "mid-step")) << s;
  EXPECT_TRUE(h.job_state().abort().raised());
  EXPECT_EQ(h.job_state().abort().reason(), shm::AbortReason::kCancelled);
}

// A worker stopped by another's abort reports ABORTED, perhaps before the one that raised it says
// why: the job's error is the cause, not the echo; with no cause within the grace, the echo.
TEST(GradConsumer, TheCauseOfAnAbortWinsOverTheWorkersItStopped) {
  auto finished = [](const std::string& job, absl::StatusCode code, const std::string& message) {
    v1::WorkerReport rep;
    rep.mutable_job_finished()->set_job_id(job);
    rep.mutable_job_finished()->set_code(static_cast<int>(code));
    rep.mutable_job_finished()->set_message(message);
    return rep;
  };
  {
    ConsumerHarness h(HarnessSpec(2, 0, GradReduction::kGpu, GradStaging::kAuto, false), 2);
    ASSERT_TRUE(h.status().ok()) << h.status();
    h.worker(0).reports().Push(finished(h.job_id(), absl::StatusCode::kAborted, "job aborted: worker failed"));
    EXPECT_TRUE(h.reports().Poll().ok());  // rank 1 has not said why yet
    h.worker(1).reports().Push(finished(h.job_id(), absl::StatusCode::kDataLoss, "tokens.bin is shorter"));
    const absl::Status s = h.reports().Poll();
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "worker fake1 (rank 1): tokens.bin is shorter")) << s;
  }
  {
    ConsumerHarness h(HarnessSpec(2, 0, GradReduction::kGpu, GradStaging::kAuto, false), 2);
    ASSERT_TRUE(h.status().ok()) << h.status();
    h.worker(0).reports().Push(finished(h.job_id(), absl::StatusCode::kAborted, "job aborted: worker failed"));
    h.worker(1).reports().Push(finished(h.job_id(), absl::StatusCode::kAborted, "job aborted"));
    const absl::Status s = h.reports().Poll();  // every worker finished: the first echo
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "rank 0")) << s;
  }
}

// Snapshot of every unit's four arrays, to show a step changed nothing.
struct Snapshot {
  explicit Snapshot(ConsumerHarness& h) {
    for (int u = 0; u < h.layout().num_units(); ++u) {
      const int64_t n = h.layout().units[u].numel;
      bytes.emplace_back(reinterpret_cast<const char*>(h.job_state().master(u)),
                         reinterpret_cast<const char*>(h.job_state().master(u) + n));
      bytes.back().append(reinterpret_cast<const char*>(h.job_state().m(u)), n * 4);
      bytes.back().append(reinterpret_cast<const char*>(h.job_state().v(u)), n * 4);
      bytes.back().append(reinterpret_cast<const char*>(h.job_state().mirror(u)), n * 2);
    }
  }
  bool operator==(const Snapshot& o) const { return bytes == o.bytes; }
  std::vector<std::string> bytes;
};

void FillMaster(ConsumerHarness& h) {
  for (int u = 0; u < h.layout().num_units(); ++u) {
    for (int64_t i = 0; i < h.layout().units[u].numel; ++i) h.job_state().master(u)[i] = 0.01f * std::cos(i + u);
  }
}

// A NaN in layer.0's up_proj (unit 1) from rank 1, step 0.
constexpr int kBadUnit = 1;
int64_t BadElement(const ConsumerHarness& h) {
  const TensorSlot& up = h.layout().units[kBadUnit].tensors[kUpProj];
  // The element of up_proj in the middle of rank 1's shard (gpu route), or row 3 col 7.
  const ShardRange part = h.PartOf(1, kBadUnit);
  const int64_t want = up.offset_numel + 3 * up.shape[1] + 7;
  return want >= part.offset && want < part.offset + part.numel ? want : part.offset + part.numel - 1;
}

TEST(GradConsumer, NonFiniteGradientFailsTheStepNamingUnitElementAndWorker) {
  struct Case {
    std::string what;
    int world;
    GradReduction route;
    double clip;
    GradStaging staging;
    ClipStaging expect_staging;
    const char* applied;
  };
  for (const Case& c : {Case{"one rank, no staging", 1, GradReduction::kCpu, 0, GradStaging::kAuto, ClipStaging::kNone,
                             "parts applied before it keep"},
                        Case{"gpu route, no staging", 2, GradReduction::kGpu, 0, GradStaging::kAuto, ClipStaging::kNone,
                             "parts applied before it keep"},
                        Case{"cpu route, summed, no staging", 2, GradReduction::kCpu, 0, GradStaging::kAuto,
                             ClipStaging::kNone, "parts applied before it keep"},
                        Case{"host staging", 2, GradReduction::kGpu, 1.0, GradStaging::kHost, ClipStaging::kHost,
                             "nothing of the step was applied"},
                        Case{"device staging", 2, GradReduction::kGpu, 1.0, GradStaging::kDevice, ClipStaging::kDevice,
                             "nothing of the step was applied"}}) {
    SCOPED_TRACE(c.what);
    ConsumerHarness h(HarnessSpec(c.world, c.clip, c.route, c.staging, false), c.world);
    ASSERT_TRUE(h.status().ok()) << h.status();
    ASSERT_EQ(h.plan().clip_staging, c.expect_staging);
    FillMaster(h);
    const int bad_rank = c.world - 1;
    const int64_t bad = BadElement(h);
    const Snapshot before(h);
    std::vector<std::function<void()>> producers;
    for (int r = 0; r < c.world; ++r) {
      producers.push_back(Good(h, r, 0, [&, r](int u, int64_t i) {
        return r == bad_rank && u == kBadUnit && i == bad ? std::numeric_limits<float>::quiet_NaN() : Value(u, i);
      }));
    }
    auto g = ConsumeWhile(h, 0, producers);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kDataLoss) << g.status();
    const std::string msg(g.status().message());
    EXPECT_TRUE(absl::StrContains(msg, "step 1: gradient of unit 1 (layer.0) is not finite: ")) << msg;
    EXPECT_TRUE(absl::StrContains(msg, DescribeUnitElement(h.layout().units[kBadUnit], bad) + " is NaN")) << msg;
    EXPECT_TRUE(absl::StrContains(msg, absl::StrCat("posted by worker fake", bad_rank, " (rank ", bad_rank, ")")))
        << msg;
    EXPECT_TRUE(absl::StrContains(msg, c.applied)) << msg;
    EXPECT_TRUE(absl::StrContains(msg, "train.skip_nonfinite")) << msg;
    // No NaN reaches the state; a staged step changes nothing at all (without staging, the parts
    // applied before the bad one keep their update).
    if (c.expect_staging != ClipStaging::kNone) {
      EXPECT_TRUE(Snapshot(h) == before);
    }
    for (int u = 0; u < h.layout().num_units(); ++u) {
      for (int64_t i = 0; i < h.layout().units[u].numel; ++i) ASSERT_TRUE(std::isfinite(h.job_state().master(u)[i]));
    }
  }
}

// Device staging applies parts hostd never read; a broken worker whose posted norm is finite while
// a part holds a NaN: LayerAdam's refusing update stops at it, the step fails with DATA_LOSS naming
// the unit, element and worker, and no NaN reaches the state (found by worker_reports_fuzz:
// crashes/worker_reports/crash-a525...).
TEST(GradConsumer, ALyingNormDoesNotLetANanPartIntoTheMaster) {
  for (bool skip : {false, true}) {
    ConsumerHarness h(HarnessSpec(2, 1.0, GradReduction::kGpu, GradStaging::kDevice, skip), 2);
    ASSERT_TRUE(h.status().ok()) << h.status();
    FillMaster(h);
    const int64_t bad = BadElement(h);
    // Rank 1 posts the squared norm of finite values, then a part with a NaN in it.
    std::vector<std::function<void()>> producers = {Good(h, 0, 0), nullptr};
    producers[1] = [&] {
      shm::GradRing& ring = h.producer(1);
      double squares = 0;
      for (int u = 0; u < h.layout().num_units(); ++u) {
        const ShardRange p = h.PartOf(1, u);
        for (int64_t i = p.offset; i < p.offset + p.numel; ++i) squares += double(Value(u, i)) * Value(u, i);
      }
      auto slot = ring.AcquireSlot(absl::Seconds(5));
      if (!slot.ok()) return;
      std::memcpy(ring.slot_data(*slot), &squares, sizeof(double));
      shm::GradChunkDesc d;
      d.unit = -1;
      d.slot = *slot;
      d.numel = 1;
      d.kind = shm::ChunkKind::kSumSquares;
      if (!ring.Post(d).ok()) return;
      const int64_t chunk = static_cast<int64_t>(ring.config().slot_bytes / 4);
      for (int u = 0; u < h.layout().num_units(); ++u) {
        const ShardRange p = h.PartOf(1, u);
        for (int64_t off = p.offset; off < p.offset + p.numel; off += chunk) {
          const int64_t n = std::min(chunk, p.offset + p.numel - off);
          auto s = ring.AcquireSlot(absl::Seconds(5));
          if (!s.ok()) return;
          float* dst = static_cast<float*>(ring.slot_data(*s));
          for (int64_t i = 0; i < n; ++i) {
            dst[i] = u == kBadUnit && off + i == bad ? std::numeric_limits<float>::quiet_NaN() : Value(u, off + i);
          }
          shm::GradChunkDesc c;
          c.unit = u;
          c.slot = *s;
          c.offset_numel = off;
          c.numel = n;
          if (!ring.Post(c).ok()) return;
        }
      }
    };
    if (skip) {
      h.ReportLoss(0, 0, 1.0);
      h.ReportLoss(1, 0, 1.0);
    }
    auto g = ConsumeWhile(h, 0, producers);
    EXPECT_EQ(g.status().code(), absl::StatusCode::kDataLoss) << g.status();
    const std::string msg(g.status().message());
    EXPECT_TRUE(absl::StrContains(msg, "step 1: gradient of unit 1 (layer.0) is not finite: " +
                                           DescribeUnitElement(h.layout().units[kBadUnit], bad) + " is NaN"))
        << msg;
    EXPECT_TRUE(absl::StrContains(msg, "posted by worker fake1 (rank 1), found as it was applied")) << msg;
    for (int u = 0; u < h.layout().num_units(); ++u) {
      for (int64_t i = 0; i < h.layout().units[u].numel; ++i) ASSERT_TRUE(std::isfinite(h.job_state().master(u)[i]));
    }
  }
}

TEST(GradConsumer, SkipNonfiniteSkipsTheWholeStepAndOpensEveryGate) {
  struct Case {
    std::string what;
    int world;
    GradReduction route;
    double clip;
    GradStaging staging;
    bool nan_loss;  // else a NaN gradient element
  };
  for (const Case& c :
       {Case{"host staging, no clipping, NaN gradient", 2, GradReduction::kCpu, 0, GradStaging::kAuto, false},
        Case{"device staging, NaN gradient", 2, GradReduction::kGpu, 0, GradStaging::kDevice, false},
        Case{"host staging with clipping, NaN loss", 2, GradReduction::kGpu, 1.0, GradStaging::kHost, true},
        Case{"device staging, NaN loss", 1, GradReduction::kGpu, 1.0, GradStaging::kDevice, true}}) {
    SCOPED_TRACE(c.what);
    ConsumerHarness h(HarnessSpec(c.world, c.clip, c.route, c.staging, /*skip_nonfinite=*/true), c.world);
    ASSERT_TRUE(h.status().ok()) << h.status();
    ASSERT_NE(h.plan().clip_staging, ClipStaging::kNone);
    FillMaster(h);
    // Step 0 is applied (every rank's loss finite), step 1 is skipped, step 2 applied again.
    for (int64_t t = 0; t < 3; ++t) {
      const bool bad_step = t == 1;
      const Snapshot before(h);
      const int bad_rank = c.world - 1;
      const int64_t bad = BadElement(h);
      std::vector<std::function<void()>> producers;
      for (int r = 0; r < c.world; ++r) {
        h.ReportLoss(r, t, bad_step && c.nan_loss && r == bad_rank ? std::nan("") : 2.5);
        producers.push_back(Good(h, r, t, [&, r](int u, int64_t i) {
          return bad_step && !c.nan_loss && r == bad_rank && u == kBadUnit && i == bad
                     ? std::numeric_limits<float>::infinity()
                     : Value(u, i);
        }));
      }
      std::vector<std::thread> threads;
      for (const auto& p : producers) threads.emplace_back(p);
      absl::StatusOr<StepGradients> g = h.ConsumeStep(t);
      for (auto& th : threads) th.join();
      ASSERT_TRUE(g.ok()) << g.status();
      EXPECT_EQ(g->skipped, bad_step);
      for (int u = 0; u < h.layout().num_units(); ++u) {
        EXPECT_EQ(h.job_state().version(u).Load(), static_cast<uint32_t>(t + 1)) << "unit " << u << " step " << t;
      }
      if (bad_step) {
        EXPECT_TRUE(Snapshot(h) == before) << "a skipped step changes nothing";
        EXPECT_TRUE(absl::StrContains(g->skipped_because, c.nan_loss ? "loss is not finite on rank"
                                                                     : "gradient of unit 1 (layer.0) is not finite"))
            << g->skipped_because;
      } else {
        EXPECT_FALSE(Snapshot(h) == before);
      }
    }
  }
}

// A range StepUpdates refuses is told apart by its payload, not by its code or text: LayerAdam's own
// INTERNAL failures are not read as "a worker posted a chunk twice".
TEST(StepUpdatesRefusal, IsTypedNotACode) {
  EXPECT_TRUE(IsRangeRefusal(RangeRefusal("unit 2 [0, +8) taken twice")));
  EXPECT_EQ(RangeRefusal("x").code(), absl::StatusCode::kInternal);
  EXPECT_FALSE(IsRangeRefusal(absl::InternalError("unit 2 [0, +8) taken twice")));
  EXPECT_FALSE(IsRangeRefusal(absl::OkStatus()));
}

}  // namespace
}  // namespace slidedp::hostd
