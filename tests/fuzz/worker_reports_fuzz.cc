// libFuzzer target: a misbehaving worker, as hostd's gradient path sees it. Real GradRing segments
// in /dev/shm, the real WorkerReports, GradRings and GradConsumer into a real LayerAdam
// (hostd/engine/tests/consumer_harness.h); this process is every rank's producer. The input picks
// a job (ranks, gradient route, clipping, staging, train.skip_nonfinite) and then a program of
// what the ranks do: correct steps, descriptors with any unit, slot, offset, numel, step and dtype
// (through Post, or past its checks), slot contents with NaN and inf, closed rings, and StepLoss
// / StepDone / JobFinished / CommId reports with any step, loss, code and job. hostd then consumes
// up to two steps. Nothing may crash, leak, hang or touch memory outside hostd's buffers (ASan);
// every INTERNAL error must name the worker ("worker fakeN (rank N)"), and no state may end up
// non-finite.
//
// Input: 4 config bytes (world-1, route|clip|staging bits, skip, steps), then 12-byte operations
// (opcode, rank, then fields) until the input ends.
#include <unistd.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "absl/strings/match.h"
#include "common/numeric/finite.h"
#include "glog/logging.h"
#include "hostd/engine/tests/consumer_harness.h"

namespace {

using slidedp::hostd::testing::ConsumerHarness;
using slidedp::hostd::testing::HarnessSpec;
namespace shm = slidedp::shm;
namespace v1 = slidedp::v1;

class Reader {
 public:
  Reader(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool done() const { return p_ >= end_; }
  uint8_t U8() { return p_ < end_ ? *p_++ : 0; }
  uint32_t U32() {
    uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= uint32_t{U8()} << (8 * i);
    return v;
  }
  int64_t I64() { return static_cast<int64_t>(uint64_t{U32()} | (uint64_t{U32()} << 32)); }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

float Value(uint8_t kind, int unit, int64_t i) {
  switch (kind % 8) {
    case 0: return std::numeric_limits<float>::quiet_NaN();
    case 1: return std::numeric_limits<float>::infinity();
    case 2: return 3e38f;  // finite, but squares and sums overflow float
    default: return 1e-3f * static_cast<float>((i * 7 + unit) % 13 - 6);
  }
}

// Fills the slot with a pattern; an acquired slot stays the producer's until it is posted.
void Fill(ConsumerHarness& h, int rank, uint32_t slot, uint8_t kind, int unit) {
  auto* f = static_cast<float*>(h.producer(rank).slot_data(slot));
  const int64_t n = static_cast<int64_t>(h.producer(rank).config().slot_bytes / 4);
  for (int64_t i = 0; i < n; ++i) f[i] = kind % 8 < 3 && i != 5 ? 0.5f : Value(kind, unit, i);
}

// A correct rank's step, without waiting for slots (skipped when the ring is full).
void PostGood(ConsumerHarness& h, int rank, int64_t t, uint8_t kind) {
  shm::GradRing& ring = h.producer(rank);
  const int64_t chunk = static_cast<int64_t>(ring.config().slot_bytes / 4);
  const bool device = h.plan().clip_staging == slidedp::hostd::ClipStaging::kDevice;
  if (device) {
    auto slot = ring.AcquireSlot(absl::ZeroDuration());
    if (!slot.ok()) return;
    const double squares = kind % 8 == 0 ? std::nan("") : 1.0;
    std::memcpy(ring.slot_data(*slot), &squares, sizeof(double));
    shm::GradChunkDesc d;
    d.unit = -1;
    d.slot = *slot;
    d.numel = 1;
    d.step = static_cast<uint32_t>(t);
    d.kind = shm::ChunkKind::kSumSquares;
    if (!ring.Post(d).ok()) return;
  }
  for (int u = 0; u < h.layout().num_units(); ++u) {
    const slidedp::ShardRange p = h.PartOf(rank, u);
    for (int64_t off = p.offset; off < p.offset + p.numel; off += chunk) {
      auto slot = ring.AcquireSlot(absl::ZeroDuration());
      if (!slot.ok()) return;
      const int64_t n = std::min(chunk, p.offset + p.numel - off);
      auto* f = static_cast<float*>(ring.slot_data(*slot));
      for (int64_t i = 0; i < n; ++i) f[i] = u == 1 && off + i == 300 ? Value(kind, u, i) : 1e-3f;
      shm::GradChunkDesc d;
      d.unit = u;
      d.slot = *slot;
      d.offset_numel = off;
      d.numel = n;
      d.step = static_cast<uint32_t>(t);
      if (!ring.Post(d).ok()) return;
    }
  }
}

void CheckStatus(const absl::Status& s, const char* what) {
  const int code = static_cast<int>(s.code());
  if (code < 0 || code > 16) {
    fprintf(stderr, "%s: status code %d is not canonical: %s\n", what, code, s.ToString().c_str());
    abort();
  }
  if (s.code() == absl::StatusCode::kInternal && !absl::StrContains(s.message(), "worker fake")) {
    fprintf(stderr, "%s: INTERNAL that does not name the worker: %s\n", what, s.ToString().c_str());
    abort();
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  FLAGS_minloglevel = 3;
  FLAGS_logtostderr = true;
  ConsumerHarness::Adam();  // the engine's threads once, not per input
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Reader in(data, size);
  const int world = 1 + in.U8() % 3;
  const uint8_t job = in.U8();
  const bool skip = in.U8() & 1;
  const int64_t steps = 1 + in.U8() % 3;
  const slidedp::GradReduction route = job & 1 ? slidedp::GradReduction::kCpu : slidedp::GradReduction::kGpu;
  const double clip = job & 2 ? 1.0 : 0.0;
  const slidedp::GradStaging staging = (job >> 2) % 3 == 0   ? slidedp::GradStaging::kAuto
                                       : (job >> 2) % 3 == 1 ? slidedp::GradStaging::kHost
                                                             : slidedp::GradStaging::kDevice;
  slidedp::JobSpec spec = HarnessSpec(world, clip, route, staging, skip);
  spec.train.steps = steps;
  spec.runtime.chunk_bytes = 65536;  // 16K-element slots: a few chunks per unit
  spec.runtime.ring_slots = 12;
  spec.runtime.step_timeout_ms = 20;  // a rank that posts too little ends the step quickly
  ConsumerHarness h(spec, world);
  if (!h.status().ok()) return 0;  // e.g. grad_staging device on the cpu route: refused by the plan

  for (int op = 0; op < 64 && !in.done(); ++op) {
    const uint8_t code = in.U8();
    const int rank = in.U8() % world;
    shm::GradRing& ring = h.producer(rank);
    switch (code % 7) {
      case 0: PostGood(h, rank, in.U8() % 4, in.U8()); break;
      case 1:
      case 2: {  // one descriptor with fuzzed fields, through Post (1) or past its checks (2)
        shm::GradChunkDesc d;
        d.unit = static_cast<int32_t>(static_cast<int8_t>(in.U8()));
        const uint8_t slot_mode = in.U8();
        d.offset_numel = slot_mode & 0x80 ? in.I64() : static_cast<int64_t>(in.U32() % 40000);
        d.numel = slot_mode & 0x40 ? in.I64() : static_cast<int64_t>(in.U32() % 20000);
        d.step = in.U8() % 4;
        d.kind = static_cast<shm::ChunkKind>(in.U8() % 4);
        const uint8_t fill = in.U8();
        if (slot_mode & 0x20) {
          d.slot = slot_mode % 16;  // any slot, acquired or not
        } else {
          auto slot = ring.AcquireSlot(absl::ZeroDuration());
          if (!slot.ok()) break;
          d.slot = *slot;
          Fill(h, rank, d.slot, fill, d.unit);
        }
        if (code % 7 == 1) {
          (void)ring.Post(d);
        } else {
          (void)ring.PostUncheckedForTest(d);
        }
        break;
      }
      case 3: {  // a report
        const uint8_t kind = in.U8();
        const int64_t step = static_cast<int8_t>(in.U8());
        const double loss = kind & 0x10 ? std::nan("") : (kind & 0x20 ? -INFINITY : 1.5);
        v1::WorkerReport rep;
        const std::string job_id = kind & 0x40 ? "other" : h.job_id();
        switch (kind % 4) {
          case 0:
            rep.mutable_step_loss()->set_job_id(job_id);
            rep.mutable_step_loss()->set_step(step);
            rep.mutable_step_loss()->set_loss_sum(loss);
            break;
          case 1:
            rep.mutable_step_done()->set_job_id(job_id);
            rep.mutable_step_done()->set_step(step);
            rep.mutable_step_done()->set_loss_sum(loss);
            rep.mutable_step_done()->set_tokens(static_cast<int64_t>(step) * -7);
            break;
          case 2:
            rep.mutable_job_finished()->set_job_id(job_id);
            rep.mutable_job_finished()->set_code(static_cast<int32_t>(in.U32()));
            rep.mutable_job_finished()->set_message(std::string(in.U8(), 'x'));
            break;
          default:
            rep.mutable_comm_id()->set_job_id(job_id);
            rep.mutable_comm_id()->set_id(std::string(in.U8(), 'c'));
            break;
        }
        h.worker(rank).reports().Push(rep);
        break;
      }
      case 4: h.ReportLoss(rank, in.U8() % 4, in.U8() & 1 ? std::nan("") : 2.0); break;
      case 5: ring.Close(); break;
      default: (void)ring.Release(in.U8() % 16); break;  // a "producer" releasing slots itself
    }
  }
  h.CloseProducers();  // nothing more comes: a starved consumer ends now
  for (int64_t t = 0; t < std::min<int64_t>(steps, 2); ++t) {
    absl::StatusOr<slidedp::hostd::StepGradients> g = h.ConsumeStep(t);
    CheckStatus(g.status(), "ConsumeStep");
    if (!g.ok()) break;
  }
  CheckStatus(h.reports().Poll(), "Poll");
  // Whatever happened, no state went non-finite (a worker's NaN or inf never reaches it). Adam's
  // v may be +inf: a finite gradient above ~1.8e19 squares to it in float, as in PyTorch, and the
  // element's update is then 0 (found by this fuzzer: crashes/worker_reports/crash-c637...; the
  // checkpoint loader accepts it, see slidedp::FiniteRule::kSecondMoment).
  const int64_t n = h.layout().total_numel;
  for (int u = 0; u < h.layout().num_units(); ++u) {
    const int64_t un = h.layout().units[u].numel;
    const int64_t bad_master = slidedp::FirstNonFinite(h.job_state().master(u), un);
    const int64_t bad_m = slidedp::FirstNonFinite(h.job_state().m(u), un);
    const int64_t bad_v = slidedp::FirstNonFinite(h.job_state().v(u), un, slidedp::FiniteRule::kSecondMoment);
    if (bad_master >= 0 || bad_m >= 0 || bad_v >= 0) {
      fprintf(stderr, "unit %d of %lld elements: master %lld, m %lld, v %lld became non-finite\n", u,
              static_cast<long long>(n), static_cast<long long>(bad_master), static_cast<long long>(bad_m),
              static_cast<long long>(bad_v));
      abort();
    }
  }
  return 0;
}
