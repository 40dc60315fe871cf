// ConsumerHarness: one job's gradient path on hostd's side, real and in-process — the JobState
// segment, one GradRing per rank (in /dev/shm), WorkerReports over real WorkerSession channels,
// GradRings, GradConsumer, StepUpdates into a LayerAdam — with this process also attached to
// every ring as the rank's producer, so a test or fuzzer can post anything a broken worker
// could (through Post, or PostUncheckedForTest past the producer's own checks) and push any
// report into a session's channel. Shared by grad_consumer_test.cc and tests/fuzz/worker_reports_fuzz.cc.
#pragma once

#include <unistd.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/model/shard.h"
#include "hostd/engine/grad_consumer.h"
#include "hostd/engine/job_plan.h"
#include "hostd/engine/step_updates.h"
#include "hostd/engine/worker_reports.h"
#include "hostd/update/layer_adam.h"
#include "hostd/update/unit_tracker.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"

namespace slidedp::hostd::testing {

class HarnessContext : public JobContext {
 public:
  HarnessContext(std::string job_id, JobSpec spec, std::vector<std::shared_ptr<WorkerSession>> workers)
      : job_id_(std::move(job_id)), spec_(std::move(spec)), workers_(std::move(workers)) {}
  const std::string& job_id() const override { return job_id_; }
  const JobSpec& spec() const override { return spec_; }
  const std::string& resume_from() const override { return resume_; }
  int attempt() const override { return 0; }
  const std::vector<std::shared_ptr<WorkerSession>>& workers() const override { return workers_; }
  bool cancel_requested() const override { return cancel.load(); }
  bool checkpoint_on_cancel() const override { return false; }
  void SetState(v1::JobState) override {}
  void SetTotalSteps(int64_t) override {}
  void SetHostStateBytes(int64_t) override {}
  void ReportStep(const v1::StepMetrics&) override {}
  void Log(const std::string&) override {}
  void SetLastCheckpoint(const std::string&) override {}

  std::atomic<bool> cancel{false};

 private:
  std::string job_id_, resume_;
  JobSpec spec_;
  std::vector<std::shared_ptr<WorkerSession>> workers_;
};

// The tiny model's spec, small ring slots (several chunks per unit).
inline JobSpec HarnessSpec(int world, double max_grad_norm, GradReduction route, GradStaging staging,
                           bool skip_nonfinite) {
  JobSpec s;
  s.name = "harness";
  s.model.preset = "tiny";
  s.train.seq_len = 64;
  s.train.global_batch = 2 * world;
  s.train.micro_batch = 1;
  s.train.steps = 4;
  s.optimizer.lr = 1e-3;
  s.train.max_grad_norm = max_grad_norm;
  s.train.skip_nonfinite = skip_nonfinite;
  s.runtime.grad_reduction = route;
  s.runtime.grad_staging = staging;
  s.runtime.chunk_bytes = 16384;
  s.runtime.ring_slots = 4;
  s.runtime.step_timeout_ms = 2000;
  return s;
}

class ConsumerHarness {
 public:
  // Workers are CUDA-kind sessions ("fake0", "fake1", ...) with `device_bytes` of memory each
  // (device staging needs some), so the gpu route needs no collective segment.
  ConsumerHarness(const JobSpec& spec, int world, int64_t device_bytes = int64_t{80} << 30)
      : spec_(spec), layout_(ModelLayout::Build(*ModelConfig::Preset(spec.model.preset))) {
    static int counter = 0;
    const std::string node = absl::StrCat("cons", getpid());
    job_id_ = absl::StrCat("h", counter++);
    std::vector<v1::WorkerHello> hellos;
    for (int r = 0; r < world; ++r) {
      v1::WorkerHello h;
      h.set_worker_id(absl::StrCat("fake", r));
      h.mutable_device()->set_kind("cuda");
      h.mutable_device()->set_memory_bytes(device_bytes);
      hellos.push_back(h);
      workers_.push_back(std::make_shared<WorkerSession>(h, r + 1));
    }
    auto plan = PlanRoutes(spec_, layout_, WorkerDevicesOf(hellos));
    if (!plan.ok()) {
      status_ = plan.status();
      return;
    }
    plan_ = *plan;
    auto js = shm::JobState::Create(node, job_id_, layout_);
    if (!js.ok()) {
      status_ = js.status();
      return;
    }
    job_state_ = std::move(*js);
    for (int r = 0; r < world; ++r) {
      auto ring = shm::GradRing::Create(node, job_id_, r, plan_.ring, shm::RingRole::kConsumer, &job_state_->abort());
      if (!ring.ok()) {
        status_ = ring.status();
        return;
      }
      auto producer = shm::GradRing::Attach((*ring)->segment_name(), shm::RingRole::kProducer, &job_state_->abort());
      if (!producer.ok()) {
        status_ = producer.status();
        return;
      }
      rings_.push_back(std::move(*ring));
      producers_.push_back(std::move(*producer));
    }
    std::vector<int64_t> numel;
    for (const UnitLayout& u : layout_.units) {
      numel.push_back(u.numel);
      tensors_.emplace_back();
      for (const TensorSlot& t : u.tensors) tensors_.back().push_back({t.offset_numel, t.offset_numel + t.numel});
    }
    for (int u = 0; u < layout_.num_units(); ++u) {
      memory_.push_back(update::UnitMemory{job_state_->master(u), job_state_->m(u), job_state_->v(u),
                                           job_state_->mirror(u), layout_.units[u].numel, 0});
      memory_.back().tensors = tensors_[u];
    }
    shm::JobState* jsp = job_state_.get();
    tracker_ = std::make_unique<update::UnitTracker>(numel, [jsp](int u, int64_t step, const absl::Status& s) {
      if (s.ok()) jsp->version(u).Publish(static_cast<uint32_t>(step));
    });
    ctx_ = std::make_unique<HarnessContext>(job_id_, spec_, workers_);
    policy_ = spec_.train.skip_nonfinite ? NonFinitePolicy::kSkip : NonFinitePolicy::kFail;
    reports_ = std::make_unique<WorkerReports>(*ctx_, *job_state_, 0, spec_.train.steps, policy_);
    grad_rings_ =
        std::make_unique<GradRings>(rings_, *reports_, *job_state_, absl::Milliseconds(spec_.runtime.step_timeout_ms));
    WorkerReports* reports = reports_.get();
    const absl::Duration timeout = absl::Milliseconds(spec_.runtime.step_timeout_ms);
    consumer_ = std::make_unique<GradConsumer>(plan_, layout_, *grad_rings_, spec_.train.max_grad_norm, 2, job_id_,
                                               policy_, [reports, timeout](int64_t t) -> absl::StatusOr<std::string> {
                                                 auto losses = reports->WaitForLosses(t, timeout);
                                                 if (!losses.ok()) return losses.status();
                                                 for (size_t r = 0; r < losses->size(); ++r) {
                                                   if (!std::isfinite((*losses)[r]))
                                                     return absl::StrCat("loss is not finite on rank ", r);
                                                 }
                                                 return std::string();
                                               });
    consumer_->AllocateStaging(1);
  }

  ~ConsumerHarness() {
    consumer_.reset();
    for (auto& r : rings_) (void)r->Unlink();
    if (job_state_) (void)job_state_->Unlink();
  }

  const absl::Status& status() const { return status_; }
  const RoutePlan& plan() const { return plan_; }
  const ModelLayout& layout() const { return layout_; }
  shm::JobState& job_state() { return *job_state_; }
  shm::GradRing& producer(int rank) { return *producers_[rank]; }
  WorkerSession& worker(int rank) { return *workers_[rank]; }
  WorkerReports& reports() { return *reports_; }
  HarnessContext& context() { return *ctx_; }
  const std::string& job_id() const { return job_id_; }
  int world() const { return static_cast<int>(workers_.size()); }

  // Every unit's range rank r posts per step: its shard on the gpu route, else the whole unit.
  ShardRange PartOf(int rank, int unit) const {
    const int64_t n = layout_.units[unit].numel;
    return plan_.route == GradReduction::kGpu ? ShardOf(n, world(), rank) : ShardRange{0, n};
  }

  // Posts what a correct rank posts for step t, gradient values value(unit, element): with
  // device staging its squared norm first, then its parts; in ring-slot-sized chunks. Returns
  // the first error (a full ring, or the consumer gone).
  absl::Status PostStep(int rank, int64_t t, const std::function<float(int, int64_t)>& value) {
    shm::GradRing& ring = *producers_[rank];
    const int64_t chunk = static_cast<int64_t>(ring.config().slot_bytes / 4);
    if (plan_.clip_staging == ClipStaging::kDevice) {
      double squares = 0;
      for (int u = 0; u < layout_.num_units(); ++u) {
        const ShardRange p = PartOf(rank, u);
        for (int64_t i = p.offset; i < p.offset + p.numel; ++i) squares += double(value(u, i)) * value(u, i);
      }
      auto slot = ring.AcquireSlot(absl::Seconds(5));
      if (!slot.ok()) return slot.status();
      std::memcpy(ring.slot_data(*slot), &squares, sizeof(double));
      shm::GradChunkDesc d;
      d.unit = -1;
      d.slot = *slot;
      d.numel = 1;
      d.step = static_cast<uint32_t>(t);
      d.kind = shm::ChunkKind::kSumSquares;
      if (absl::Status s = ring.Post(d); !s.ok()) return s;
    }
    for (int u = 0; u < layout_.num_units(); ++u) {
      const ShardRange p = PartOf(rank, u);
      for (int64_t off = p.offset; off < p.offset + p.numel; off += chunk) {
        const int64_t n = std::min(chunk, p.offset + p.numel - off);
        auto slot = ring.AcquireSlot(absl::Seconds(5));
        if (!slot.ok()) return slot.status();
        float* dst = static_cast<float*>(ring.slot_data(*slot));
        for (int64_t i = 0; i < n; ++i) dst[i] = value(u, off + i);
        shm::GradChunkDesc d;
        d.unit = u;
        d.slot = *slot;
        d.offset_numel = off;
        d.numel = n;
        d.step = static_cast<uint32_t>(t);
        if (absl::Status s = ring.Post(d); !s.ok()) return s;
      }
    }
    return absl::OkStatus();
  }

  void ReportLoss(int rank, int64_t t, double loss_sum) {
    v1::WorkerReport rep;
    rep.mutable_step_loss()->set_job_id(job_id_);
    rep.mutable_step_loss()->set_step(t);
    rep.mutable_step_loss()->set_loss_sum(loss_sum);
    workers_[rank]->reports().Push(rep);
  }

  // Consumes step t (AdamW step t+1 at version t+1) and waits for its updates.
  absl::StatusOr<StepGradients> ConsumeStep(int64_t t) {
    update::AdamWStepParams p;
    p.lr = spec_.optimizer.lr;
    p.eps = spec_.optimizer.eps;
    p.weight_decay = spec_.optimizer.weight_decay;
    p.step = t + 1;
    StepUpdates updates(Adam(), memory_, *tracker_, t + 1, p, &layout_);
    absl::StatusOr<StepGradients> g = consumer_->ConsumeStep(t, t == 0, updates);
    absl::Status drained = updates.Drain();
    if (g.ok() && !drained.ok()) return drained;
    return g;
  }

  // Closes every producer: a consumer waiting for more then ends (OUT_OF_RANGE) instead of
  // waiting out the step timeout.
  void CloseProducers() {
    for (auto& p : producers_) p->Close();
  }

  static update::LayerAdam& Adam() {
    static update::LayerAdam* adam = [] {
      update::LayerAdamOptions o;
      o.num_threads = 2;
      o.pinning = update::WorkerPinning::kNone;
      return update::LayerAdam::Create(o).value().release();
    }();
    return *adam;
  }

 private:
  absl::Status status_;
  JobSpec spec_;
  ModelLayout layout_;
  RoutePlan plan_;
  std::string job_id_;
  NonFinitePolicy policy_ = NonFinitePolicy::kFail;
  std::vector<std::shared_ptr<WorkerSession>> workers_;
  std::unique_ptr<shm::JobState> job_state_;
  std::vector<std::unique_ptr<shm::GradRing>> rings_, producers_;
  std::vector<std::vector<update::ElementRange>> tensors_;
  std::vector<update::UnitMemory> memory_;
  std::unique_ptr<update::UnitTracker> tracker_;
  std::unique_ptr<HarnessContext> ctx_;
  std::unique_ptr<WorkerReports> reports_;
  std::unique_ptr<GradRings> grad_rings_;
  std::unique_ptr<GradConsumer> consumer_;
};

}  // namespace slidedp::hostd::testing
