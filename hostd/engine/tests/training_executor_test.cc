// TrainingExecutor against scripted in-process ranks (no gRPC, no compute): each fake rank attaches
// the job's shared-memory state and ring like a worker, waits for its gates and posts known
// gradients, either whole (one rank) or as its own shard of the summed gradient (gpu route).
// Checks that the gpu route applies shards to the same parameters as one rank posting the whole
// gradient, that bad shards fail the job, the NCCL id relay and the membership key.
#include "hostd/engine/training_executor.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/jobspec/job_spec_proto.h"
#include "common/status/status_macros.h"
#include "common/data/synthetic.h"
#include "common/model/shard.h"
#include "gtest/gtest.h"
#include "checkpoint/checkpoint.h"
#include "hostd/engine/undo_arena.h"
#include "hostd/update/adamw_kernels.h"
#include "hostd/update/adamw_state.h"
#include "hostd/update/schedule.h"
#include "nlohmann/json.hpp"
#include "shm/grad_ring.h"
#include "shm/job_state.h"

namespace slidedp::hostd {
namespace {

class FakeContext : public JobContext {
 public:
  FakeContext(std::string job_id, JobSpec spec, std::vector<std::shared_ptr<WorkerSession>> workers)
      : job_id_(std::move(job_id)), spec_(std::move(spec)), workers_(std::move(workers)) {}
  const std::string& job_id() const override { return job_id_; }
  const JobSpec& spec() const override { return spec_; }
  const std::string& resume_from() const override { return resume_; }
  // As HostCore: a resumed job continues its checkpoint's run.
  const std::string& run_id() const override {
    if (run_id_.empty()) {
      absl::StatusOr<std::string> run =
          resume_.empty() ? absl::StatusOr<std::string>(job_id_) : checkpoint::CheckpointRunId(resume_);
      run_id_ = run.ok() ? *run : job_id_;
    }
    return run_id_;
  }
  int attempt() const override { return 0; }
  const std::vector<std::shared_ptr<WorkerSession>>& workers() const override { return workers_; }
  bool cancel_requested() const override { return false; }
  bool checkpoint_on_cancel() const override { return false; }
  void SetState(v1::JobState) override {}
  void SetTotalSteps(int64_t) override {}
  void SetHostStateBytes(int64_t) override {}
  void ReportStep(const v1::StepMetrics& m) override {
    norms.push_back(m.grad_norm());
    metrics.push_back(m);
  }
  void Log(const std::string& line) override { logs.push_back(line); }
  void SetLastCheckpoint(const std::string&) override {}
  std::vector<double> norms;
  std::vector<v1::StepMetrics> metrics;
  std::vector<std::string> logs;
  std::string resume_;
  mutable std::string run_id_;

 private:
  std::string job_id_;
  JobSpec spec_;
  std::vector<std::shared_ptr<WorkerSession>> workers_;
};

// Per step, a factor on every gradient (empty: 1), so a test can make the norm clip on some steps.
std::vector<float> g_step_scale;

// Every gradient rounded to its BF16 value (what a rank with runtime.grad_dtype bf16 posts).
bool g_round_to_bf16 = false;

// The summed (over ranks) gradient of element i of unit u at step t.
float Grad(int t, int u, int64_t i) {
  const float scale = t < static_cast<int>(g_step_scale.size()) ? g_step_scale[t] : 1.0f;
  const float g = scale * 0.01f * std::sin(0.001f * static_cast<float>(i) + u + 0.37f * t);
  return g_round_to_bf16 ? Bf16ToFloat(FloatToBf16(g)) : g;
}

struct RankResult {
  v1::Assignment assignment;
  std::string comm_id;                     // what rank > 0 received
  std::vector<std::vector<float>> master;  // rank 0: the final master weights
  uint64_t skipped_steps = 0;              // rank 0: the control block's count at the end
  std::vector<std::vector<float>> m, v;    // rank 0: the final Adam moments (FP32 moments)
  std::vector<std::string> moments;        // rank 0: every unit's m, v and scales as stored, any layout
  int64_t rolled_back_steps = 0;           // device staging: verdicts that asked for every part again
  absl::Status status;
};

// m, v and (int8) their scales, as the segment keeps them.
std::string MomentBytes(const shm::JobState::Moments& mv, int64_t n) {
  const int64_t elem = mv.dtype == MomentForm::kF32 ? 4 : mv.dtype == MomentForm::kBF16 ? 2 : 1;
  std::string out(static_cast<const char*>(mv.m), n * elem);
  out.append(static_cast<const char*>(mv.v), n * elem);
  if (mv.dtype == MomentForm::kInt8) {
    const int64_t blocks = (n + kInt8MomentBlock - 1) / kInt8MomentBlock;
    out.append(reinterpret_cast<const char*>(mv.m_scale), blocks * 4);
    out.append(reinterpret_cast<const char*>(mv.v_scale), blocks * 4);
  }
  return out;
}

// The next command for a fake worker, acknowledging releases of kept state mappings (which a
// real worker handles on its session thread) on the way.
std::optional<v1::HostCommand> NextCommand(WorkerSession& w) {
  while (true) {
    auto c = w.commands().Pop(absl::Seconds(20));
    if (!c || !c->has_release_host_state()) return c;
    v1::WorkerReport ack;
    *ack.mutable_host_state_released() = c->release_host_state();
    w.reports().Push(ack);
  }
}

enum class Fault {
  kNone,
  kOutsideShard,
  kNoSquaredNorm,
  kNanAtStep1,      // element kNanElement of unit 1 is NaN at step 1 (0-based), from this rank
  kPaddingGarbage,  // huge values in every padding element, every step
  kWrongDtype,      // gradient chunks in the other type than runtime.grad_dtype's
};
constexpr int64_t kNanElement = 300;  // inside unit 1's q_proj (a parameter, not padding)

// Whether element i of unit u is a parameter (else alignment padding).
bool IsParam(const UnitLayout& u, int64_t i) {
  for (const TensorSlot& t : u.tensors) {
    if (i >= t.offset_numel && i < t.offset_numel + t.numel) return true;
  }
  return false;
}

// One scripted rank. On the gpu route rank r posts its shards in pieces of slot/(r+1) elements,
// so ranks post different numbers of chunks per unit.
void FakeRank(std::shared_ptr<WorkerSession> w, int rank, Fault fault, RankResult* out) {
  auto fail = [&](absl::Status s) {
    out->status = s;
    v1::WorkerReport rep;
    rep.mutable_job_finished()->set_job_id(out->assignment.job_id());
    rep.mutable_job_finished()->set_code(static_cast<int>(s.code()));
    rep.mutable_job_finished()->set_message(std::string(s.message()));
    w->reports().Push(rep);
  };
  auto cmd = NextCommand(*w);
  if (!cmd || !cmd->has_assign()) return fail(absl::DeadlineExceededError("no assignment"));
  const v1::Assignment a = cmd->assign();
  out->assignment = a;
  const int world = a.world_size();
  if (world > 1 && rank == 0) {
    v1::WorkerReport rep;
    rep.mutable_comm_id()->set_job_id(a.job_id());
    rep.mutable_comm_id()->set_attempt(a.attempt());
    rep.mutable_comm_id()->set_membership_key(a.membership_key());
    rep.mutable_comm_id()->set_id("unique-id-of-" + a.job_id());
    // A stale id (another attempt) first: hostd must not forward it.
    v1::WorkerReport stale = rep;
    stale.mutable_comm_id()->set_attempt(a.attempt() + 7);
    stale.mutable_comm_id()->set_id("stale");
    w->reports().Push(stale);
    w->reports().Push(rep);
  }
  if (world > 1 && rank > 0) {
    auto c = NextCommand(*w);
    if (!c || !c->has_comm_id()) return fail(absl::DeadlineExceededError("no comm id"));
    out->comm_id = c->comm_id().id();
  }
  auto js = shm::JobState::Attach(a.state_segment(), shm::Access::kReadWrite);
  if (!js.ok()) return fail(js.status());
  auto ring = shm::GradRing::Attach(a.ring_segment(), shm::RingRole::kProducer, &(*js)->abort());
  if (!ring.ok()) return fail(ring.status());
  auto spec = JobSpecOf(a.config());
  const bool gpu = a.config().runtime().grad_reduction() == v1::GRAD_REDUCTION_GPU;
  if (!spec.ok()) return fail(spec.status());
  // (With bf16 the test sets g_round_to_bf16, so the squared norm below is the posted values'.)
  const bool bf16 = (spec->runtime.grad_dtype == Dtype::kBF16) != (fault == Fault::kWrongDtype);
  const int units = (*js)->num_units();
  const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset("tiny"));
  auto grad = [&](int64_t t, int u, int64_t i) {
    if (fault == Fault::kNanAtStep1 && t == 1 && u == 1 && i == kNanElement) {
      return std::numeric_limits<float>::quiet_NaN();
    }
    if (fault == Fault::kPaddingGarbage && !IsParam(layout.units[u], i)) return i % 2 ? 1.0f : -3e5f;
    return Grad(static_cast<int>(t), u, i);
  };
  // The cpu route needs the same chunk sequence from every rank; shards may come in any pieces.
  // (BF16 chunks as FP32's, half a slot each, so the norm's partial sums are the same.)
  const int64_t piece = static_cast<int64_t>((*ring)->config().slot_bytes / 4) / (gpu ? rank + 1 : 1);
  // Device staging: the rank's squared norm first, then its parts in forward order.
  const bool device_staging = a.config().runtime().grad_staging() == v1::GRAD_STAGING_DEVICE;
  for (int64_t t = a.first_step(); t < a.total_steps(); ++t) {
    for (int u = 0; u < units; ++u) {
      absl::Status s = (*js)->version(u).WaitAtLeast(static_cast<uint32_t>(t), absl::Seconds(20), (*js)->abort());
      if (!s.ok()) return fail(s);
    }
    {  // the loss first, as a worker sends it before its last gradients
      v1::WorkerReport rep;
      rep.mutable_step_loss()->set_job_id(a.job_id());
      rep.mutable_step_loss()->set_step(t);
      rep.mutable_step_loss()->set_loss_sum(1.0);
      w->reports().Push(rep);
    }
    auto post_unit = [&](int u) -> absl::Status {
      const int64_t numel = (*js)->unit_numel(u);
      ShardRange range = gpu ? ShardOf(numel, world, rank) : ShardRange{0, numel};
      if (fault == Fault::kOutsideShard && u == units - 1) range = ShardRange{0, numel};
      for (int64_t off = range.offset; off < range.offset + range.numel; off += piece) {
        const int64_t n = std::min(piece, range.offset + range.numel - off);
        ASSIGN_OR_RETURN(uint32_t slot, (*ring)->AcquireSlot(absl::Seconds(20)));
        if (bf16) {
          bf16_t* dst = static_cast<bf16_t*>((*ring)->slot_data(slot));
          for (int64_t i = 0; i < n; ++i) dst[i] = FloatToBf16(grad(t, u, off + i));
        } else {
          float* dst = static_cast<float*>((*ring)->slot_data(slot));
          for (int64_t i = 0; i < n; ++i) dst[i] = grad(t, u, off + i);
        }
        shm::GradChunkDesc d;
        d.kind = bf16 ? shm::ChunkKind::kGradBF16 : shm::ChunkKind::kGradF32;
        d.unit = u;
        d.slot = slot;
        d.offset_numel = off;
        d.numel = n;
        d.step = static_cast<uint32_t>(t);
        RETURN_IF_ERROR((*ring)->Post(d));
      }
      return absl::OkStatus();
    };
    if (!device_staging) {
      for (int u = units - 1; u >= 0; --u) {  // backward order (head first)
        if (absl::Status s = post_unit(u); !s.ok()) return fail(s);
      }
    } else {
      // Speculative clipping: the units hostd speculates as they are final (backward order), then
      // the squared norm, then after hostd's verdict the rest (or everything again) in forward
      // order; without it the norm first, then the parts in forward order.
      const bool speculate = a.has_speculate_from_unit() && (*js)->SpeculatesStep(t);
      int k = units;
      while (speculate && k > 0 && (*js)->SpeculatesUnit(t, k - 1)) --k;
      if (speculate) {
        for (int u = units - 1; u >= k; --u) {
          if (absl::Status s = post_unit(u); !s.ok()) return fail(s);
        }
      }
      if (fault != Fault::kNoSquaredNorm) {
        double squares = 0;
        for (int u = 0; u < units; ++u) {
          const ShardRange range =
              gpu ? ShardOf((*js)->unit_numel(u), world, rank) : ShardRange{0, (*js)->unit_numel(u)};
          for (int64_t i = range.offset; i < range.offset + range.numel; ++i) {
            const double g = grad(t, u, i);
            squares += g * g;
          }
        }
        auto slot = (*ring)->AcquireSlot(absl::Seconds(20));
        if (!slot.ok()) return fail(slot.status());
        std::memcpy((*ring)->slot_data(*slot), &squares, sizeof(double));
        shm::GradChunkDesc d;
        d.unit = -1;
        d.slot = *slot;
        d.numel = 1;
        d.step = static_cast<uint32_t>(t);
        d.kind = shm::ChunkKind::kSumSquares;
        if (absl::Status s = (*ring)->Post(d); !s.ok()) return fail(s);
      }
      shm::StepVerdict verdict;
      if (speculate && fault != Fault::kNoSquaredNorm) {  // (a rank without its norm posts on)
        auto v = (*js)->WaitVerdict(t, absl::Seconds(20), (*js)->owner());
        if (!v.ok()) return fail(v.status());
        verdict = *v;
        out->rolled_back_steps += verdict.post_all;
      }
      for (int u = 0; u < units; ++u) {
        if (speculate && u >= k && !verdict.post_all) continue;
        if (absl::Status s = post_unit(u); !s.ok()) return fail(s);
      }
    }
    v1::WorkerReport rep;
    rep.mutable_step_done()->set_job_id(a.job_id());
    rep.mutable_step_done()->set_step(t);
    rep.mutable_step_done()->set_loss_sum(1.0);
    rep.mutable_step_done()->set_tokens(16);
    if (!g_step_scale.empty()) {  // waits that move the speculation controller up and down
      rep.mutable_step_done()->set_gate_wait_s(t % 2 == 0 ? 0.5 : 0);
      rep.mutable_step_done()->set_ring_wait_s(t % 2 == 1 ? 0.5 : 0);
    }
    w->reports().Push(rep);
  }
  for (int u = 0; u < units; ++u) {
    absl::Status s =
        (*js)->version(u).WaitAtLeast(static_cast<uint32_t>(a.total_steps()), absl::Seconds(20), (*js)->abort());
    if (!s.ok()) return fail(s);
  }
  if (rank == 0) {
    for (int u = 0; u < units; ++u) {
      out->master.emplace_back((*js)->master(u), (*js)->master(u) + (*js)->unit_numel(u));
      const int64_t n = (*js)->unit_numel(u);
      if ((*js)->m(u) != nullptr) {
        out->m.emplace_back((*js)->m(u), (*js)->m(u) + n);
        out->v.emplace_back((*js)->v(u), (*js)->v(u) + n);
      }
      out->moments.push_back(MomentBytes((*js)->moments(u), n));
    }
    out->skipped_steps = (*js)->skipped_steps_counter().load();
  }
  v1::WorkerReport rep;
  rep.mutable_job_finished()->set_job_id(a.job_id());
  w->reports().Push(rep);
}

JobSpec TinySpec(int world, double max_norm, const std::string& route) {
  JobSpec s;
  s.name = "engine";
  s.model.preset = "tiny";
  s.model.init_seed = 3;
  // (one directory per test binary, removed when it exits; with the dataset the executor
  // verifies at job start; the fake ranks post gradients of their own and read none of it)
  static const struct OutputDir {
    std::string path = ::testing::TempDir() + "/engine-" + std::to_string(getpid());
    OutputDir() {
      data::SyntheticOptions o;
      o.vocab_size = 512;
      o.num_documents = 64;
      o.seq_len = 64;
      EXPECT_TRUE(data::WriteSyntheticDataset(path + "/data", o).ok());
    }
    ~OutputDir() { std::filesystem::remove_all(path); }
  } output_dir;
  s.output.dir = output_dir.path;
  s.data.path = output_dir.path + "/data";
  s.output.save_final = false;
  s.train.steps = 3;
  s.train.seq_len = 64;
  s.train.global_batch = 4 * world;
  s.train.micro_batch = 2;
  s.optimizer.lr = 1e-3;
  s.optimizer.weight_decay = 0.1;
  s.train.max_grad_norm = max_norm;
  s.runtime.chunk_bytes = 16384;  // 4096-element slots: several chunks per shard
  s.runtime.ring_slots = 4;
  s.runtime.step_timeout_ms = 20000;
  s.runtime.grad_reduction = route == "gpu" ? GradReduction::kGpu : GradReduction::kCpu;
  return s;
}

struct JobRun {
  absl::Status status;
  std::vector<RankResult> ranks;
  std::vector<double> norms;
  std::vector<v1::StepMetrics> metrics;
  std::vector<std::string> logs;
};

int64_t next_serial = 1;

std::vector<std::shared_ptr<WorkerSession>> Workers(int world, const std::string& kind = "cuda") {
  std::vector<std::shared_ptr<WorkerSession>> ws;
  for (int r = 0; r < world; ++r) {
    v1::WorkerHello h;
    h.set_worker_id(absl::StrCat("fake", r));
    h.mutable_device()->set_kind(kind);  // cuda: NCCL route, no shm collective segment
    ws.push_back(std::make_shared<WorkerSession>(h, next_serial++));
  }
  return ws;
}

JobRun RunJob(TrainingExecutor& ex, const std::string& job_id, const JobSpec& spec,
              std::vector<std::shared_ptr<WorkerSession>> workers, Fault fault = Fault::kNone, int faulty_rank = -1,
              const std::string& resume = "") {
  const int world = static_cast<int>(workers.size());
  JobRun run;
  run.ranks.resize(world);
  FakeContext ctx(job_id, spec, workers);
  ctx.resume_ = resume;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back(FakeRank, workers[r], r, r == faulty_rank ? fault : Fault::kNone, &run.ranks[r]);
  }
  run.status = ex.Run(ctx);
  for (auto& th : threads) th.join();
  run.norms = ctx.norms;
  run.metrics = ctx.metrics;
  run.logs = ctx.logs;
  return run;
}

double MaxAbsDiff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0;
  for (size_t u = 0; u < a.size() && u < b.size(); ++u) {
    EXPECT_EQ(a[u].size(), b[u].size());
    for (size_t i = 0; i < a[u].size() && i < b[u].size(); ++i) d = std::max(d, std::fabs(double(a[u][i]) - b[u][i]));
  }
  return d;
}

TrainingExecutorOptions Options() {
  TrainingExecutorOptions o;
  o.node_name = absl::StrCat("engtest", getpid());
  o.update_threads = 2;
  o.pinning = update::WorkerPinning::kNone;
  return o;
}

bool Reused(const JobRun& run) {
  for (const std::string& l : run.logs) {
    if (absl::StrContains(l, "reused pooled host state")) return true;
  }
  return false;
}

std::vector<std::string> NodeSegments() {
  std::vector<std::string> out;
  const std::string prefix = absl::StrCat("slidedp.", Options().node_name, ".");
  for (const auto& e : std::filesystem::directory_iterator("/dev/shm")) {
    if (e.path().filename().string().rfind(prefix, 0) == 0) out.push_back(e.path().filename().string());
  }
  return out;
}

// Every job after the first reuses the pooled state segment of the one before (same model):
// the results below, compared with a first job on a fresh segment, show it is reset completely.
TEST(TrainingExecutor, GpuRouteShardsGiveTheSameParametersAsOneRankWithTheWholeGradient) {
  auto ex = std::make_unique<TrainingExecutor>(Options());
  for (double max_norm : {0.0, 0.05}) {
    JobRun one = RunJob(*ex, absl::StrCat("one", max_norm > 0), TinySpec(1, max_norm, "gpu"), Workers(1));
    ASSERT_TRUE(one.status.ok()) << one.status;
    EXPECT_EQ(Reused(one), max_norm > 0);  // the very first job allocates
    ASSERT_FALSE(one.ranks[0].master.empty());
    EXPECT_FALSE(one.ranks[0].assignment.config().runtime().grad_reduction() == v1::GRAD_REDUCTION_GPU);  // one rank: the cpu route
    EXPECT_TRUE(one.ranks[0].assignment.membership_key().empty());
    for (int world : {2, 3}) {
      JobRun sharded =
          RunJob(*ex, absl::StrCat("sharded", world, max_norm > 0), TinySpec(world, max_norm, "gpu"), Workers(world));
      ASSERT_TRUE(sharded.status.ok()) << sharded.status;
      EXPECT_TRUE(Reused(sharded));
      EXPECT_EQ(sharded.ranks[0].assignment.config().runtime().grad_reduction(), v1::GRAD_REDUCTION_GPU);
      EXPECT_EQ(sharded.ranks[0].assignment.config().runtime().param_delivery(), v1::PARAM_DELIVERY_REPLICATED);
      EXPECT_TRUE(sharded.ranks[0].assignment.collective_segment().empty());  // CUDA workers: NCCL
      const double d = MaxAbsDiff(sharded.ranks[0].master, one.ranks[0].master);
      ASSERT_EQ(sharded.norms.size(), one.norms.size());
      for (size_t i = 0; i < one.norms.size(); ++i) EXPECT_NEAR(sharded.norms[i], one.norms[i], 1e-9 * one.norms[i]);
      if (max_norm > 0) {
        EXPECT_GT(one.norms[0], max_norm);        // the clip coefficient is in play
        EXPECT_LE(d, 1e-6) << "world " << world;  // only the norm's summation order differs
      } else {
        EXPECT_EQ(d, 0.0) << "world " << world;  // the same gradients, applied elementwise
      }
    }
  }
  // Between jobs only the pooled segment remains; the executor's end removes it.
  EXPECT_EQ(NodeSegments(), std::vector<std::string>{absl::StrCat("slidedp.", Options().node_name, ".pool.pooled")});
  ex.reset();
  EXPECT_TRUE(NodeSegments().empty());
}

// Speculative clipping (runtime.speculation_bytes): updates that run before the norm is known and
// are committed, redone or switched off give the master weights and Adam moments of the path that
// waits for the norm, bit for bit, over steps that clip and steps that do not; for host and device
// staging, one and two ranks, and an undo arena that covers every unit or only the last ones.
TEST(TrainingExecutor, SpeculativeClippingIsBitwiseThePathThatWaitsForTheNorm) {
  TrainingExecutor ex(Options());
  // Norms below and above the threshold: speculated steps that commit (1, 7) or are redone (2, 4),
  // and steps not speculated after one that clipped (3, 5, 6).
  g_step_scale = {1, 3, 1, 3, 3, 1, 1};
  const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset("tiny"));
  const uint64_t last_units = UndoBytes(layout, layout.num_units() - 2);
  for (GradStaging staging : {GradStaging::kHost, GradStaging::kDevice}) {
    for (int world : {1, 2}) {
      JobSpec base = TinySpec(world, 1e9, "gpu");
      base.train.steps = static_cast<int64_t>(g_step_scale.size());
      base.runtime.grad_staging = staging;
      base.runtime.speculation_bytes = 0;
      // The threshold between the small and the large steps' norms.
      JobRun probe = RunJob(ex, absl::StrCat("probe", world, ToString(staging)), base, Workers(world));
      ASSERT_TRUE(probe.status.ok()) << probe.status;
      ASSERT_EQ(probe.norms.size(), g_step_scale.size());
      base.train.max_grad_norm = 0.5 * (probe.norms[0] + probe.norms[1]);
      JobRun waiting = RunJob(ex, absl::StrCat("waiting", world, ToString(staging)), base, Workers(world));
      ASSERT_TRUE(waiting.status.ok()) << waiting.status;
      for (int64_t budget : {int64_t{-1}, static_cast<int64_t>(last_units)}) {
        SCOPED_TRACE(absl::StrCat(ToString(staging), " world ", world, " budget ", budget));
        JobSpec spec = base;
        spec.runtime.speculation_bytes = budget;
        JobRun run = RunJob(ex, absl::StrCat("spec", world, ToString(staging), budget > 0), spec, Workers(world));
        ASSERT_TRUE(run.status.ok()) << run.status;
        bool logged = false;
        for (const std::string& l : run.logs) logged |= absl::StrContains(l, "speculative clipping: units");
        EXPECT_TRUE(logged);
        if (staging == GradStaging::kDevice) {
          EXPECT_EQ(run.ranks[0].assignment.speculate_from_unit(),
                    budget > 0 ? layout.num_units() - 2 : 0);
          // Speculated: steps 1 (commit), 2 (clips: redo), 4 (redo) and 7 (commit); 3, 5 and 6 follow a
          // step that clipped.
          EXPECT_EQ(run.ranks[0].rolled_back_steps, 2);
        }
        ASSERT_EQ(run.norms, waiting.norms);
        ASSERT_EQ(run.metrics.size(), g_step_scale.size());
        const bool speculated[] = {true, true, false, true, false, false, true};
        std::set<double> fractions;  // the controller moves the first speculated unit with the waits
        for (size_t t = 0; t < run.metrics.size(); ++t) {
          if (speculated[t]) fractions.insert(run.metrics[t].speculated_fraction());
          EXPECT_EQ(run.metrics[t].speculated_fraction() > 0, speculated[t]) << t;
          EXPECT_EQ(run.metrics[t].speculation_rolled_back(), t == 1 || t == 3) << t;
          EXPECT_EQ(waiting.metrics[t].speculated_fraction(), 0) << t;
        }
        EXPECT_GE(fractions.size(), 2u);
        int clipped = 0;
        for (double n : run.norms) clipped += n > spec.train.max_grad_norm;
        EXPECT_EQ(clipped, 3);
        for (int u = 0; u < layout.num_units(); ++u) {
          const size_t bytes = layout.units[u].numel * sizeof(float);
          ASSERT_EQ(0, std::memcmp(run.ranks[0].master[u].data(), waiting.ranks[0].master[u].data(), bytes)) << u;
          ASSERT_EQ(0, std::memcmp(run.ranks[0].m[u].data(), waiting.ranks[0].m[u].data(), bytes)) << u;
          ASSERT_EQ(0, std::memcmp(run.ranks[0].v[u].data(), waiting.ranks[0].v[u].data(), bytes)) << u;
        }
      }
    }
  }
  g_step_scale.clear();
}

// runtime.grad_dtype bf16: hostd takes BF16 chunks on every consumer (direct, summed, shards) and
// staging (host, device, speculative) and applies exactly what FP32 chunks holding the same
// rounded values give, bit for bit; an FP32 chunk in a BF16 job is refused.
TEST(TrainingExecutor, Bf16GradientsAreTheFp32PathOnTheRoundedValues) {
  TrainingExecutor ex(Options());
  g_step_scale = {1, 3, 1, 1};
  struct Case {
    int world;
    double max_norm;
    const char* route;
    GradStaging staging;
  };
  for (const Case& c : {Case{1, 0, "gpu", GradStaging::kAuto}, Case{2, 0, "cpu", GradStaging::kAuto},
                        Case{2, 0, "gpu", GradStaging::kAuto}, Case{1, 1e9, "gpu", GradStaging::kHost},
                        Case{2, 1e9, "gpu", GradStaging::kDevice}, Case{2, 1e9, "cpu", GradStaging::kHost}}) {
    SCOPED_TRACE(absl::StrCat("world ", c.world, " route ", c.route, " clip ", c.max_norm > 0, " staging ",
                              ToString(c.staging)));
    JobSpec spec = TinySpec(c.world, c.max_norm, c.route);
    spec.train.steps = static_cast<int64_t>(g_step_scale.size());
    spec.runtime.grad_staging = c.staging;
    g_round_to_bf16 = false;
    JobRun exact = RunJob(ex, "bf16-exact", spec, Workers(c.world));
    ASSERT_TRUE(exact.status.ok()) << exact.status;
    if (c.max_norm > 0) spec.train.max_grad_norm = 0.5 * (exact.norms[0] + exact.norms[1]);  // steps 2 clips
    g_round_to_bf16 = true;
    JobRun rounded = RunJob(ex, "bf16-rounded", spec, Workers(c.world));
    spec.runtime.grad_dtype = Dtype::kBF16;
    JobRun bf16 = RunJob(ex, "bf16", spec, Workers(c.world));
    g_round_to_bf16 = false;
    ASSERT_TRUE(rounded.status.ok()) << rounded.status;
    ASSERT_TRUE(bf16.status.ok()) << bf16.status;
    ASSERT_EQ(bf16.norms, rounded.norms);
    bool logged = false;
    for (const std::string& l : bf16.logs) logged |= absl::StrContains(l, "gradients cross the host link in BF16");
    EXPECT_TRUE(logged);
    const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset("tiny"));
    for (int u = 0; u < layout.num_units(); ++u) {
      const size_t bytes = layout.units[u].numel * sizeof(float);
      ASSERT_EQ(0, std::memcmp(bf16.ranks[0].master[u].data(), rounded.ranks[0].master[u].data(), bytes)) << u;
      ASSERT_EQ(0, std::memcmp(bf16.ranks[0].m[u].data(), rounded.ranks[0].m[u].data(), bytes)) << u;
      ASSERT_EQ(0, std::memcmp(bf16.ranks[0].v[u].data(), rounded.ranks[0].v[u].data(), bytes)) << u;
    }
    EXPECT_GT(MaxAbsDiff(bf16.ranks[0].master, exact.ranks[0].master), 0) << "the rounding is in effect";
  }
  g_step_scale.clear();
  // A rank posting FP32 chunks into a BF16 job is a broken worker: INTERNAL, naming the types.
  for (int world : {1, 2}) {
    JobSpec spec = TinySpec(world, 0, "gpu");
    spec.runtime.grad_dtype = Dtype::kBF16;
    JobRun wrong = RunJob(ex, absl::StrCat("bf16-wrong", world), spec, Workers(world), Fault::kWrongDtype, world - 1);
    EXPECT_EQ(wrong.status.code(), absl::StatusCode::kInternal) << wrong.status;
    EXPECT_TRUE(absl::StrContains(wrong.status.message(), "BF16")) << wrong.status;
  }
}

// Device staging (runtime.grad_staging device): ranks post their squared norms, then their parts
// in forward order, and hostd applies them with the coefficient at once, staging nothing: the
// same parameters as host staging, 4 bytes per parameter less host memory.
TEST(TrainingExecutor, DeviceStagingGivesTheSameParametersAsHostStaging) {
  TrainingExecutor ex(Options());
  for (int world : {1, 2}) {
    JobSpec host = TinySpec(world, 0.05, "gpu");
    host.runtime.grad_staging = GradStaging::kHost;
    JobSpec device = host;
    device.runtime.grad_staging = GradStaging::kDevice;
    JobRun h = RunJob(ex, absl::StrCat("host-staged", world), host, Workers(world));
    JobRun d = RunJob(ex, absl::StrCat("device-staged", world), device, Workers(world));
    ASSERT_TRUE(h.status.ok()) << h.status;
    ASSERT_TRUE(d.status.ok()) << d.status;
    EXPECT_EQ(h.ranks[0].assignment.config().runtime().grad_staging(), v1::GRAD_STAGING_HOST);
    EXPECT_EQ(d.ranks[0].assignment.config().runtime().grad_staging(), v1::GRAD_STAGING_DEVICE);
    ASSERT_EQ(d.norms.size(), h.norms.size());
    for (size_t i = 0; i < h.norms.size(); ++i) EXPECT_NEAR(d.norms[i], h.norms[i], 1e-9 * h.norms[i]);
    EXPECT_GT(h.norms[0], 0.05);  // the coefficient is in play
    EXPECT_LE(MaxAbsDiff(d.ranks[0].master, h.ranks[0].master), 1e-6) << "world " << world;
    bool logged = false;
    for (const std::string& l : d.logs) logged |= absl::StrContains(l, "clipping: device staging");
    EXPECT_TRUE(logged);
  }
  // auto: device memory reported by the workers decides (the fake ones report none: host).
  JobRun a = RunJob(ex, "auto-staged", TinySpec(1, 0.05, "gpu"), Workers(1));
  ASSERT_TRUE(a.status.ok()) << a.status;
  EXPECT_EQ(a.ranks[0].assignment.config().runtime().grad_staging(), v1::GRAD_STAGING_HOST);
  auto big = Workers(1);
  v1::WorkerHello hello = big[0]->hello();
  hello.mutable_device()->set_memory_bytes(int64_t{80} << 30);
  big[0] = std::make_shared<WorkerSession>(hello, next_serial++);
  JobRun b = RunJob(ex, "auto-staged-device", TinySpec(1, 0.05, "gpu"), big);
  ASSERT_TRUE(b.status.ok()) << b.status;
  EXPECT_EQ(b.ranks[0].assignment.config().runtime().grad_staging(), v1::GRAD_STAGING_DEVICE);
}

// A rank that posts gradient parts where its squared norm must come first fails the job with
// INTERNAL; device staging with hostd summing full copies (the cpu route) is refused up front.
TEST(TrainingExecutor, DeviceStagingFaultsAreClearErrors) {
  TrainingExecutor ex(Options());
  JobSpec device = TinySpec(2, 0.05, "gpu");
  device.runtime.grad_staging = GradStaging::kDevice;
  JobRun bad = RunJob(ex, "no-norm", device, Workers(2), Fault::kNoSquaredNorm, 1);
  EXPECT_EQ(bad.status.code(), absl::StatusCode::kInternal) << bad.status;
  EXPECT_TRUE(absl::StrContains(bad.status.message(), "squared norm")) << bad.status;
  JobSpec cpu = TinySpec(2, 0.05, "cpu");
  cpu.runtime.grad_staging = GradStaging::kDevice;
  FakeContext ctx("device-cpu-route", cpu, Workers(2));
  absl::Status s = ex.Run(ctx);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "runtime.grad_staging")) << s;
}

TEST(TrainingExecutor, CpuWorkersGetAShmCollectiveSegmentThatIsRemovedWithTheJob) {
  TrainingExecutor ex(Options());
  JobRun run = RunJob(ex, "coll", TinySpec(2, 0, "gpu"), Workers(2, "cpu"));
  ASSERT_TRUE(run.status.ok()) << run.status;
  const std::string seg = run.ranks[0].assignment.collective_segment();
  ASSERT_FALSE(seg.empty());
  EXPECT_EQ(run.ranks[1].assignment.collective_segment(), seg);
  EXPECT_FALSE(std::filesystem::exists("/dev/shm" + seg)) << seg;
  // The cpu route needs none.
  JobRun cpu = RunJob(ex, "coll-cpu", TinySpec(2, 0, "cpu"), Workers(2, "cpu"));
  ASSERT_TRUE(cpu.status.ok()) << cpu.status;  // (hostd sums the ranks' whole copies)
  EXPECT_TRUE(cpu.ranks[0].assignment.collective_segment().empty());
  EXPECT_EQ(cpu.ranks[0].assignment.config().runtime().grad_reduction(), v1::GRAD_REDUCTION_CPU);
}

TEST(TrainingExecutor, CommIdIsRelayedFromRankZeroAndTheMembershipKeyFollowsSessionsAndFailures) {
  TrainingExecutor ex(Options());
  auto workers = Workers(3);
  JobRun first = RunJob(ex, "relay1", TinySpec(3, 0, "gpu"), workers);
  ASSERT_TRUE(first.status.ok()) << first.status;
  const std::string key = first.ranks[0].assignment.membership_key();
  EXPECT_TRUE(absl::StrContains(key, "fake0#")) << key;
  for (int r = 1; r < 3; ++r) {
    EXPECT_EQ(first.ranks[r].assignment.membership_key(), key);
    EXPECT_EQ(first.ranks[r].comm_id, "unique-id-of-relay1");  // the stale id was not forwarded
  }
  // Same sessions, a job that succeeded before: the key stays (workers keep their communicator).
  JobRun second = RunJob(ex, "relay2", TinySpec(3, 0, "gpu"), workers);
  ASSERT_TRUE(second.status.ok()) << second.status;
  EXPECT_EQ(second.ranks[0].assignment.membership_key(), key);
  // A rank posting outside its shard fails the job quickly with the numbers...
  JobRun bad = RunJob(ex, "relay-bad", TinySpec(3, 0, "gpu"), workers, Fault::kOutsideShard, 1);
  EXPECT_EQ(bad.status.code(), absl::StatusCode::kInternal) << bad.status;
  EXPECT_TRUE(absl::StrContains(bad.status.message(), "rank 1")) << bad.status;
  // ...and the next job gets a new key (the failed job may have broken the communicators).
  JobRun after = RunJob(ex, "relay3", TinySpec(3, 0, "gpu"), workers);
  ASSERT_TRUE(after.status.ok()) << after.status;
  const std::string key_after = after.ranks[0].assignment.membership_key();
  EXPECT_NE(key_after, key);
  // New sessions of the same workers: a new key too.
  JobRun fresh = RunJob(ex, "relay4", TinySpec(3, 0, "gpu"), Workers(3));
  ASSERT_TRUE(fresh.status.ok()) << fresh.status;
  EXPECT_NE(fresh.ranks[0].assignment.membership_key(), key_after);
}

// What the executor must produce, computed here: the tiny model's random init, then AdamW (the
// reference kernel, on the tensors only) with Grad(t) for every applied step t, the scheduled LR
// of the global step t, and Adam's step count over applied steps only (GradScaler's semantics).
struct ReferenceState {
  explicit ReferenceState(const JobSpec& spec) : layout(ModelLayout::Build(*ModelConfig::Preset("tiny"))) {
    for (const UnitLayout& u : layout.units) {
      master.emplace_back(u.numel, 0.0f);
      m.emplace_back(u.numel, 0.0f);
      v.emplace_back(u.numel, 0.0f);
      mirror.emplace_back(u.numel, 0);
    }
    checkpoint::InitRandom(layout, spec.model.init_seed, [&](int u) { return master[u].data(); });
  }
  void Apply(const JobSpec& spec, const update::LrSchedule& schedule, int64_t t, int64_t adam_step) {
    update::AdamWStepParams p;
    p.lr = schedule.LrAt(t);
    p.beta1 = spec.optimizer.beta1;
    p.beta2 = spec.optimizer.beta2;
    p.eps = spec.optimizer.eps;
    p.weight_decay = spec.optimizer.weight_decay;
    p.step = adam_step;
    for (const UnitLayout& u : layout.units) {
      std::vector<float> g(u.numel);
      for (int64_t i = 0; i < u.numel; ++i) g[i] = Grad(static_cast<int>(t), u.index, i);
      for (const TensorSlot& ts : u.tensors) {
        const int64_t o = ts.offset_numel;
        // optimizer.no_decay's default: torch's second group, weight_decay 0, holds the 1-D
        // tensors (norm weights and biases).
        update::AdamWStepParams q = p;
        if (ts.shape.size() == 1) q.weight_decay = 0;
        update::AdamWStep(q, master[u.index].data() + o, m[u.index].data() + o, v[u.index].data() + o,
                          mirror[u.index].data() + o, g.data() + o, ts.numel);
      }
    }
  }
  ModelLayout layout;
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<bf16_t>> mirror;
};

// ReferenceState with compact moments: every tensor stepped whole by the state kernels, the BF16
// rounding indexed by the element's place in the model and seeded with the job's seed.
struct CompactReference {
  CompactReference(const JobSpec& spec, MomentForm dtype)
      : dtype(dtype), layout(ModelLayout::Build(*ModelConfig::Preset("tiny"))) {
    int64_t first = 0;
    for (const UnitLayout& u : layout.units) {
      master.emplace_back(u.numel, 0.0f);
      mirror.emplace_back(u.numel, 0);
      const int64_t elem = dtype == MomentForm::kBF16 ? 2 : 1;
      m.emplace_back(u.numel * elem, '\0');
      v.emplace_back(u.numel * elem, '\0');
      m_scale.emplace_back(Int8MomentBlocks(u.numel), 0.0f);
      v_scale.emplace_back(Int8MomentBlocks(u.numel), 0.0f);
      first_index.push_back(first);
      first += u.numel;
    }
    checkpoint::InitRandom(layout, spec.model.init_seed, [&](int u) { return master[u].data(); });
  }
  // `copies`: how many ranks posted the whole gradient (the cpu route sums them: exact for 2).
  void Apply(const JobSpec& spec, int64_t t, int copies) {
    update::AdamWStepParams p;
    p.lr = spec.optimizer.lr;
    p.beta1 = spec.optimizer.beta1;
    p.beta2 = spec.optimizer.beta2;
    p.eps = spec.optimizer.eps;
    p.weight_decay = spec.optimizer.weight_decay;
    p.step = t + 1;
    const update::AdamWConstants decayed = update::MakeAdamWConstants(p);
    update::AdamWStepParams no_decay_params = p;  // the 1-D tensors (optimizer.no_decay's default)
    no_decay_params.weight_decay = 0;
    const update::AdamWConstants not_decayed = update::MakeAdamWConstants(no_decay_params);
    const update::AdamStateKernelTable& k = update::ActiveAdamStateKernels();
    for (const UnitLayout& u : layout.units) {
      const int ui = u.index;
      std::vector<float> g(u.numel);
      for (int64_t i = 0; i < u.numel; ++i) g[i] = static_cast<float>(copies) * Grad(static_cast<int>(t), ui, i);
      for (const TensorSlot& ts : u.tensors) {
        const int64_t o = ts.offset_numel;
        const update::AdamWConstants& c = ts.shape.size() == 1 ? not_decayed : decayed;
        if (dtype == MomentForm::kBF16) {
          auto* m16 = reinterpret_cast<bf16_t*>(m[ui].data());
          auto* v16 = reinterpret_cast<bf16_t*>(v[ui].data());
          k.bf16_step_f32(c, update::StochasticRounding{spec.train.seed, p.step, first_index[ui] + o},
                          master[ui].data() + o, update::Bf16Moments{m16 + o, v16 + o}, mirror[ui].data() + o,
                          g.data() + o, ts.numel);
        } else {
          const update::Int8Moments base{reinterpret_cast<int8_t*>(m[ui].data()),
                                         reinterpret_cast<uint8_t*>(v[ui].data()), m_scale[ui].data(),
                                         v_scale[ui].data()};
          k.int8_step_f32(c, master[ui].data() + o, update::Int8MomentsAt(base, o), mirror[ui].data() + o,
                          g.data() + o, ts.numel);
        }
      }
    }
  }
  std::string Moments(int u) const {
    std::string out = m[u] + v[u];
    if (dtype == MomentForm::kInt8) {
      out.append(reinterpret_cast<const char*>(m_scale[u].data()), m_scale[u].size() * 4);
      out.append(reinterpret_cast<const char*>(v_scale[u].data()), v_scale[u].size() * 4);
    }
    return out;
  }
  MomentForm dtype;
  ModelLayout layout;
  std::vector<std::vector<float>> master, m_scale, v_scale;
  std::vector<std::vector<bf16_t>> mirror;
  std::vector<std::string> m, v;
  std::vector<int64_t> first_index;
};

// optimizer.state_dtype bf16 / int8: whatever the route, staging and worker count, the job's
// master weights and stored moments after three steps are the state kernels' over the whole
// tensors bit for bit (chunks on int8 blocks; the BF16 rounding follows the element's global
// index and the job's seed). Each job after the first reuses the pooled segment the one before
// left, laid out for the other moments. A job saved after two steps and resumed for a third is
// the three-step job bit for bit; resumed with another state_dtype, the moments are converted and
// the log says so.
TEST(TrainingExecutor, CompactMomentsAreTheStateKernelsOnEveryRoute) {
  TrainingExecutor ex(Options());
  struct Case {
    const char* what;
    int world;
    double clip;
    const char* route;
  };
  for (MomentForm dtype : {MomentForm::kBF16, MomentForm::kInt8}) {
    for (const Case& c : {Case{"one rank, direct", 1, 0, "cpu"}, Case{"one rank, staged", 1, 1e9, "cpu"},
                          Case{"gpu route", 2, 0, "gpu"}, Case{"gpu route, staged", 2, 1e9, "gpu"},
                          Case{"cpu route, summed", 2, 0, "cpu"}}) {
      SCOPED_TRACE(absl::StrCat(ToString(dtype), ", ", c.what));
      JobSpec spec = TinySpec(c.world, c.clip, c.route);
      spec.optimizer.state_dtype = dtype == MomentForm::kInt8 ? MomentForm::kInt8 : MomentForm::kBF16;
      spec.train.seed = 17;
      JobRun run =
          RunJob(ex, absl::StrCat("compact-", ToString(dtype), c.world, c.clip > 0, c.route), spec, Workers(c.world));
      ASSERT_TRUE(run.status.ok()) << run.status;
      CompactReference ref(spec, dtype);
      const int copies = std::string(c.route) == "cpu" ? c.world : 1;
      for (int64_t t = 0; t < spec.train.steps; ++t) ref.Apply(spec, t, copies);
      ASSERT_EQ(run.ranks[0].master.size(), ref.master.size());
      for (size_t u = 0; u < ref.master.size(); ++u) {
        ASSERT_EQ(0, std::memcmp(run.ranks[0].master[u].data(), ref.master[u].data(), ref.master[u].size() * 4))
            << "unit " << u;
        ASSERT_TRUE(run.ranks[0].moments[u] == ref.Moments(static_cast<int>(u))) << "unit " << u;
      }
      bool noted = false;
      for (const std::string& l : run.logs) noted |= absl::StrContains(l, "Adam moments kept in");
      EXPECT_TRUE(noted);
    }
  }
  for (MomentForm dtype : {MomentForm::kBF16, MomentForm::kInt8}) {
    SCOPED_TRACE(absl::StrCat(ToString(dtype), ", resumed"));
    JobSpec spec = TinySpec(1, 0, "cpu");
    spec.optimizer.state_dtype = dtype == MomentForm::kInt8 ? MomentForm::kInt8 : MomentForm::kBF16;
    spec.train.seed = 17;
    spec.train.steps = 2;
    spec.output.save_final = true;
    spec.output.dir = absl::StrCat(spec.output.dir, "/compact-", ToString(dtype));
    const std::string id = absl::StrCat("compact-resume-", ToString(dtype));
    JobRun first = RunJob(ex, id, spec, Workers(1));
    ASSERT_TRUE(first.status.ok()) << first.status;
    auto ckpt = checkpoint::FindLatestCheckpoint(spec.output.dir, id);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    JobSpec more = spec;
    more.train.steps = 3;
    more.output.save_final = false;
    JobRun resumed = RunJob(ex, id, more, Workers(1), Fault::kNone, -1, *ckpt);
    ASSERT_TRUE(resumed.status.ok()) << resumed.status;
    CompactReference ref(more, dtype);
    for (int64_t t = 0; t < more.train.steps; ++t) ref.Apply(more, t, 1);
    for (size_t u = 0; u < ref.master.size(); ++u) {
      ASSERT_EQ(0, std::memcmp(resumed.ranks[0].master[u].data(), ref.master[u].data(), ref.master[u].size() * 4))
          << "unit " << u;
      ASSERT_TRUE(resumed.ranks[0].moments[u] == ref.Moments(static_cast<int>(u))) << "unit " << u;
    }
    // Into the other layout, and into FP32: converted, and said.
    for (MomentForm other : {dtype == MomentForm::kInt8 ? MomentForm::kBF16 : MomentForm::kInt8, MomentForm::kF32}) {
      JobSpec converted = more;
      converted.optimizer.state_dtype = other;
      JobRun run = RunJob(ex, absl::StrCat(id, "-to-", ToString(other)), converted, Workers(1), Fault::kNone, -1, *ckpt);
      ASSERT_TRUE(run.status.ok()) << run.status;
      bool noted = false;
      for (const std::string& l : run.logs) noted |= absl::StrContains(l, "converted");
      EXPECT_TRUE(noted) << "to " << ToString(other);
    }
  }
}

// Speculative clipping with compact moments: the undo copies keep BF16 moments or int8 codes and
// scales, so steps that speculate and commit, or are redone after the norm clips, leave master
// and moments bit for bit as the path that waits for the norm; host and device staging, one and
// two ranks, the automatic budget and one of exactly the last two units' compact undo bytes.
TEST(TrainingExecutor, CompactMomentsSpeculateBitwiseThePathThatWaitsForTheNorm) {
  TrainingExecutor ex(Options());
  g_step_scale = {1, 3, 1, 3, 3, 1, 1};
  const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset("tiny"));
  for (MomentForm dtype : {MomentForm::kBF16, MomentForm::kInt8}) {
    const uint64_t last_units = UndoBytes(layout, layout.num_units() - 2, dtype);
    EXPECT_LT(last_units, UndoBytes(layout, layout.num_units() - 2)) << "compact undo copies are smaller";
    for (GradStaging staging : {GradStaging::kHost, GradStaging::kDevice}) {
      for (int world : {1, 2}) {
        const std::string tag = absl::StrCat(ToString(dtype), ToString(staging), world);
        JobSpec base = TinySpec(world, 1e9, "gpu");
        base.optimizer.state_dtype = dtype == MomentForm::kInt8 ? MomentForm::kInt8 : MomentForm::kBF16;
        base.train.seed = 5;
        base.train.steps = static_cast<int64_t>(g_step_scale.size());
        base.runtime.grad_staging = staging;
        base.runtime.speculation_bytes = 0;
        JobRun probe = RunJob(ex, "cprobe" + tag, base, Workers(world));
        ASSERT_TRUE(probe.status.ok()) << probe.status;
        ASSERT_EQ(probe.norms.size(), g_step_scale.size());
        base.train.max_grad_norm = 0.5 * (probe.norms[0] + probe.norms[1]);
        JobRun waiting = RunJob(ex, "cwaiting" + tag, base, Workers(world));
        ASSERT_TRUE(waiting.status.ok()) << waiting.status;
        for (int64_t budget : {int64_t{-1}, static_cast<int64_t>(last_units)}) {
          SCOPED_TRACE(absl::StrCat(tag, " budget ", budget));
          JobSpec spec = base;
          spec.runtime.speculation_bytes = budget;
          JobRun run = RunJob(ex, absl::StrCat("cspec", tag, budget > 0), spec, Workers(world));
          ASSERT_TRUE(run.status.ok()) << run.status;
          ASSERT_EQ(run.norms, waiting.norms);
          ASSERT_EQ(run.metrics.size(), g_step_scale.size());
          int speculated = 0, rolled_back = 0;
          for (const v1::StepMetrics& m : run.metrics) {
            speculated += m.speculated_fraction() > 0;
            rolled_back += m.speculation_rolled_back();
          }
          EXPECT_GE(speculated, 3);
          EXPECT_EQ(rolled_back, 2);
          for (int u = 0; u < layout.num_units(); ++u) {
            ASSERT_EQ(0, std::memcmp(run.ranks[0].master[u].data(), waiting.ranks[0].master[u].data(),
                                     layout.units[u].numel * sizeof(float)))
                << u;
            ASSERT_TRUE(run.ranks[0].moments[u] == waiting.ranks[0].moments[u]) << u;
          }
        }
      }
    }
  }
  g_step_scale.clear();
}

update::LrSchedule LinearSchedule(const JobSpec& spec) {
  update::LrScheduleConfig c;
  c.kind = update::LrScheduleKind::kLinear;
  c.base_lr = spec.optimizer.lr;
  c.warmup_steps = spec.schedule.warmup_steps;
  c.total_steps = spec.train.steps;
  return *update::LrSchedule::Create(c);
}

// train.skip_nonfinite: a step whose gradient holds a NaN changes nothing (master, m, v); the job
// goes on; the next applied update counts Adam's step without the skipped one while the LR
// schedule follows the global step, bit for bit as computed here; the count is in the control
// block, the metrics, the log and the checkpoint, and a resumed job continues it.
TEST(TrainingExecutor, SkipNonfiniteSkipsTheStepWithGradScalerSemantics) {
  TrainingExecutor ex(Options());
  for (GradStaging staging : {GradStaging::kHost, GradStaging::kDevice}) {
    SCOPED_TRACE(ToString(staging));
    JobSpec spec = TinySpec(1, 0, "cpu");
    spec.train.skip_nonfinite = true;
    spec.runtime.grad_staging = staging;
    spec.schedule.kind = ScheduleKind::kLinear;
    spec.schedule.warmup_steps = 1;
    spec.train.steps = 4;
    spec.output.save_final = true;
    spec.output.dir = spec.output.dir + "/skip-" + ToString(staging);
    const std::string id = absl::StrCat("skip-", ToString(staging));
    JobRun run = RunJob(ex, id, spec, Workers(1), Fault::kNanAtStep1, 0);
    ASSERT_TRUE(run.status.ok()) << run.status;
    ASSERT_EQ(run.metrics.size(), 4u);
    for (int t = 0; t < 4; ++t) {
      EXPECT_EQ(run.metrics[t].skipped(), t == 1) << t;
      EXPECT_EQ(run.metrics[t].skipped_steps(), t >= 1 ? 1 : 0) << t;
    }
    EXPECT_EQ(run.ranks[0].skipped_steps, 1u);
    bool warned = false;
    for (const std::string& l : run.logs) {
      warned |= absl::StrContains(l,
                                  "warning: step 2 skipped (train.skip_nonfinite): gradient of unit 1 (layer.0) "
                                  "is not finite");
    }
    EXPECT_TRUE(warned);
    const update::LrSchedule schedule = LinearSchedule(spec);
    ReferenceState ref(spec);
    ref.Apply(spec, schedule, 0, 1);
    ref.Apply(spec, schedule, 2, 2);  // step 1 skipped: LrAt(2), Adam step 2
    ref.Apply(spec, schedule, 3, 3);
    ASSERT_EQ(run.ranks[0].master.size(), ref.master.size());
    for (size_t u = 0; u < ref.master.size(); ++u) {
      ASSERT_EQ(0, std::memcmp(run.ranks[0].master[u].data(), ref.master[u].data(), ref.master[u].size() * 4)) << u;
    }
    // The checkpoint keeps the count; resuming continues it (Adam step 4 for global step 5).
    auto ckpt = checkpoint::FindLatestCheckpoint(spec.output.dir, id);
    ASSERT_TRUE(ckpt.ok()) << ckpt.status();
    std::ifstream f(*ckpt + "/trainer_state.json");
    const nlohmann::json ts = nlohmann::json::parse(f);
    EXPECT_EQ(ts["trainer_state"]["skipped_steps"], 1) << ts.dump();
    JobSpec more = spec;
    more.train.steps = 5;
    JobRun resumed = RunJob(ex, id, more, Workers(1), Fault::kNone, -1, *ckpt);
    ASSERT_TRUE(resumed.status.ok()) << resumed.status;
    EXPECT_EQ(resumed.ranks[0].skipped_steps, 1u);
    bool logged = false;
    for (const std::string& l : resumed.logs) logged |= absl::StrContains(l, "(1 skipped as non-finite)");
    EXPECT_TRUE(logged);
    ref.Apply(more, LinearSchedule(more), 4, 4);
    for (size_t u = 0; u < ref.master.size(); ++u) {
      ASSERT_EQ(0, std::memcmp(resumed.ranks[0].master[u].data(), ref.master[u].data(), ref.master[u].size() * 4)) << u;
    }
  }
}

// Without skip_nonfinite the same NaN fails the job: DATA_LOSS naming the step, the unit, the
// element and the worker, before the NaN reaches the master weights.
TEST(TrainingExecutor, NonFiniteGradientFailsTheJobWithDataLoss) {
  TrainingExecutor ex(Options());
  for (double clip : {0.0, 1.0}) {
    JobRun run = RunJob(ex, absl::StrCat("nan", clip > 0), TinySpec(2, clip, "gpu"), Workers(2), Fault::kNanAtStep1, 0);
    EXPECT_EQ(run.status.code(), absl::StatusCode::kDataLoss) << run.status;
    const std::string msg(run.status.message());
    EXPECT_TRUE(absl::StrContains(msg,
                                  "step 2: gradient of unit 1 (layer.0) is not finite: "
                                  "model.layers.0.self_attn.q_proj.weight[0, 44] is NaN (posted by worker fake0 "
                                  "(rank 0))"))
        << msg;
    EXPECT_TRUE(absl::StrContains(msg, clip > 0 ? "nothing of the step was applied" : "parts applied before it"))
        << msg;
  }
}

// LayerAdam never writes the padding between tensors, whatever the workers post there: with
// gradients of 1 and -3e5 in every padding element (an update would move it by about lr), the
// padding stays exactly as initialized (0).
TEST(TrainingExecutor, PaddingIsNeverUpdated) {
  TrainingExecutor ex(Options());
  JobSpec spec = TinySpec(1, 0, "cpu");
  JobRun run = RunJob(ex, "padding", spec, Workers(1), Fault::kPaddingGarbage, 0);
  ASSERT_TRUE(run.status.ok()) << run.status;
  const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset("tiny"));
  int64_t padding = 0;
  for (const UnitLayout& u : layout.units) {
    for (int64_t i = 0; i < u.numel; ++i) {
      if (IsParam(u, i)) continue;
      ++padding;
      ASSERT_EQ(run.ranks[0].master[u.index][i], 0.0f) << u.name << " element " << i;
    }
  }
  EXPECT_GT(padding, 1000);
}

}  // namespace
}  // namespace slidedp::hostd
