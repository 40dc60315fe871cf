// GradConsumer: one step's gradients from the rings to LayerAdam; see grad_consumer.h.
#include "hostd/engine/grad_consumer.h"

#include <pthread.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/model/shard.h"
#include "common/numeric/finite.h"
#include "common/parallel/parallel_for.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/update/adamw_kernels.h"

namespace slidedp::hostd {
namespace {

// Norm-grid blocks (update::kNormBlockNumel) squared per task of a ParallelFor: 1 Mi elements.
constexpr int64_t kBlocksPerTask = (1 << 20) / update::kNormBlockNumel;

// Where block k of the chunk [offset, offset + numel) on the norm grid begins; k = the block
// count gives its end.
int64_t BlockEdge(int64_t offset, int64_t numel, int64_t k) {
  return std::min(offset + numel, std::max(offset, (offset / update::kNormBlockNumel + k) * update::kNormBlockNumel));
}

double SecondsSince(absl::Time t) { return absl::ToDoubleSeconds(absl::Now() - t); }

// [offset, offset + numel) inside [begin, end), numel > 0, without overflow for any input.
bool RangeInside(int64_t offset, int64_t numel, int64_t begin, int64_t end) {
  return numel > 0 && offset >= begin && offset <= end && numel <= end - offset;
}

// Int8 moments are requantized a 256-element block at a time: a chunk must not split one.
bool SplitsMomentBlock(const RoutePlan& plan, int64_t offset, int64_t numel, int64_t unit_numel) {
  if (plan.moments != MomentForm::kInt8) return false;
  const int64_t end = offset + numel;
  return offset % kInt8MomentBlock != 0 || (end % kInt8MomentBlock != 0 && end != unit_numel);
}

// The gradient's elements from `off` on.
update::GradPtr At(update::GradPtr g, int64_t off) {
  if (g.bf16) return g.b16() + off;
  return g.f32() + off;
}

// dst[i] = src[i] (widened exactly from BF16), or dst[i] += src[i], for i in [0, n).
void CopyWidened(update::GradPtr src, int64_t n, float* dst) {
  if (!src.bf16) {
    std::memcpy(dst, src.f32(), n * sizeof(float));
    return;
  }
  const bf16_t* b = src.b16();
  for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToFloat(b[i]);
}
void AddWidened(update::GradPtr src, int64_t n, float* dst) {
  if (!src.bf16) {
    const float* f = src.f32();
    for (int64_t i = 0; i < n; ++i) dst[i] += f[i];
    return;
  }
  const bf16_t* b = src.b16();
  for (int64_t i = 0; i < n; ++i) dst[i] += Bf16ToFloat(b[i]);
}

int64_t FirstNonFiniteOf(update::GradPtr src, int64_t n) {
  if (!src.bf16) return FirstNonFinite(src.f32(), n);
  for (int64_t i = 0; i < n; ++i) {
    if (!std::isfinite(Bf16ToFloat(src.b16()[i]))) return i;
  }
  return -1;
}

}  // namespace

GradRings::GradRings(std::vector<std::unique_ptr<shm::GradRing>>& rings, WorkerReports& reports,
                     shm::JobState& job_state, absl::Duration step_timeout)
    : rings_(rings), reports_(reports), job_state_(job_state), step_timeout_(step_timeout) {}

void GradRings::Abort() { job_state_.RaiseAbort(shm::AbortReason::kInternal); }

absl::Status GradRings::FailRank(int rank, const std::string& what) {
  Abort();
  return absl::InternalError(absl::StrCat(reports_.WorkerName(rank), " ", what));
}

absl::StatusOr<shm::GradChunkDesc> GradRings::Pop(int r, bool first_step) {
  const absl::Time deadline = absl::Now() + step_timeout_;
  while (true) {
    // Short slices while waiting for the first gradients: rank 0's communicator id is forwarded
    // from Poll, and the other ranks' NCCL setup waits on it.
    auto d = rings_[r]->Pop(absl::Milliseconds(first_step ? 10 : 100));
    if (d.ok()) return d;
    if (d.status().code() == absl::StatusCode::kDataLoss) {
      return FailRank(r, absl::StrCat("posted a corrupt gradient descriptor: ", d.status().message()));
    }
    if (d.status().code() != absl::StatusCode::kDeadlineExceeded) {
      // Prefer the worker's own error: a failing worker raises the abort before its report
      // reaches us, so give the report a moment to arrive (unless another consumer thread took
      // it already: it returns the cause).
      const absl::Time report_deadline = absl::Now() + absl::Seconds(2);
      do {
        RETURN_IF_ERROR(reports_.Poll());
        if (job_state_.abort().reason() != shm::AbortReason::kWorkerFailed || reports_.worker_failure_seen()) break;
        absl::SleepFor(absl::Milliseconds(5));
      } while (absl::Now() < report_deadline);
      return Annotate(d.status(), absl::StrCat("gradient ring of ", reports_.WorkerName(r)));
    }
    RETURN_IF_ERROR(reports_.Poll());
    if (absl::Now() > deadline) {
      job_state_.RaiseAbort(shm::AbortReason::kInternal);
      return absl::DeadlineExceededError(absl::StrCat("no gradient from ", reports_.WorkerName(r), " for ",
                                                      absl::FormatDuration(step_timeout_),
                                                      " (runtime.step_timeout_ms)"));
    }
  }
}

GradConsumer::GradConsumer(const RoutePlan& plan, const ModelLayout& layout, GradRings& rings, double max_grad_norm,
                           int aggregate_threads, std::string job_id, NonFinitePolicy policy, LossCheck loss_check)
    : plan_(plan),
      layout_(layout),
      rings_(rings),
      max_grad_norm_(max_grad_norm),
      aggregate_threads_(aggregate_threads),
      job_id_(std::move(job_id)),
      policy_(policy),
      loss_check_(std::move(loss_check)) {
  for (const UnitLayout& u : layout_.units) unit_numel_.push_back(u.numel);
  staging_.resize(unit_numel_.size());
}

void GradConsumer::AllocateStaging(int threads) {
  if (!plan_.host_staging) return;
  ParallelFor(staging_.size(), threads, [&](size_t u) { staging_[u].resize(unit_numel_[u]); });
}

int64_t GradConsumer::staging_bytes_held() const {
  int64_t bytes = 0;
  for (const std::vector<float>& s : staging_) bytes += static_cast<int64_t>(s.size() * sizeof(float));
  return bytes;
}

void GradConsumer::NoteNonFinite(int rank, int unit, int64_t offset, const float* src, int64_t numel) {
  const int64_t i = FirstNonFinite(src, numel);
  if (i < 0) return;
  absl::MutexLock l(&nonfinite_mu_);
  if (!nonfinite_ || std::make_pair(unit, offset + i) < std::make_pair(nonfinite_->unit, nonfinite_->offset)) {
    nonfinite_ = NonFiniteElement{unit, offset + i, src[i], rank};
  }
}

void GradConsumer::NoteNonFinite(int rank, int unit, int64_t offset, update::GradPtr src, int64_t numel) {
  if (!src.bf16) return NoteNonFinite(rank, unit, offset, src.f32(), numel);
  std::vector<float> widened(numel);  // (the failure path only)
  CopyWidened(src, numel, widened.data());
  NoteNonFinite(rank, unit, offset, widened.data(), numel);
}

std::string GradConsumer::NonFiniteGradient() const {
  absl::MutexLock l(&nonfinite_mu_);
  if (!nonfinite_) return "";
  const NonFiniteElement& e = *nonfinite_;
  const UnitLayout& u = layout_.units[e.unit];
  return absl::StrCat("gradient of unit ", e.unit, " (", u.name, ") is not finite: ", DescribeUnitElement(u, e.offset),
                      " is ", NonFiniteName(e.value),
                      e.rank >= 0 ? absl::StrCat(" (posted by ", rings_.WorkerName(e.rank), ")")
                                  : std::string(" (the ranks' sum; every rank's part is finite)"));
}

absl::Status GradConsumer::NonFiniteError(int64_t t, const std::string& what, const char* applied) {
  rings_.Abort();
  return absl::DataLossError(
      absl::StrCat("step ", t + 1, ": ", what, "; ", applied, " (train.skip_nonfinite: true skips such steps)"));
}

absl::StatusOr<std::string> GradConsumer::Decide(int64_t t, const std::string& gradient_nonfinite) {
  if (!gradient_nonfinite.empty()) {
    if (policy_ == NonFinitePolicy::kFail) {
      return NonFiniteError(t, gradient_nonfinite, "nothing of the step was applied");
    }
    return gradient_nonfinite;
  }
  if (policy_ == NonFinitePolicy::kSkip && loss_check_) return loss_check_(t);
  return std::string();
}

absl::StatusOr<bool> GradConsumer::SquarePieces(int rank, int unit, int64_t offset, int64_t numel, update::GradPtr src,
                                                float* dst, int threads, update::GradNormAccumulator& norm) {
  // On the norm grid (update::NormBlockSquares): LayerAdam's fused squares give the same bits.
  const int64_t blocks = update::NormBlockCount(offset, numel);
  std::vector<double> sq(blocks);
  ParallelFor((blocks + kBlocksPerTask - 1) / kBlocksPerTask, threads, [&](size_t task) {
    const int64_t first = static_cast<int64_t>(task) * kBlocksPerTask;
    const int64_t last = std::min(blocks, first + kBlocksPerTask);
    const int64_t b = BlockEdge(offset, numel, first) - offset;
    if (dst != nullptr) CopyWidened(At(src, b), BlockEdge(offset, numel, last) - offset - b, dst + b);
    update::NormBlockSquares(offset, numel, src.data, src.bf16, first, last, sq.data());
  });
  absl::Status s = norm.AddPartial(unit, offset, numel, update::SumBlockSquares(sq.data(), blocks));
  if (!s.ok()) return rings_.FailRank(rank, absl::StrCat("posted a gradient chunk twice: ", s.message()));
  bool finite = true;
  for (int64_t k = 0; k < blocks; ++k) {
    // Squares formed in double cannot overflow from finite floats: a non-finite sum means a
    // non-finite element (found only then, on the failure path).
    if (std::isfinite(sq[k])) continue;
    finite = false;
    const int64_t b = BlockEdge(offset, numel, k);
    NoteNonFinite(rank, unit, b, At(src, b - offset), BlockEdge(offset, numel, k + 1) - b);
  }
  return finite;
}

void GradConsumer::EnableSpeculation(const UndoArena* arena, int64_t first_step) {
  const int num_units = static_cast<int>(unit_numel_.size());
  arena_ = arena != nullptr && arena->first_unit() < num_units ? arena : nullptr;
  speculate_step_ = arena_ != nullptr;
  // The controller starts halfway through what the arena covers (ObserveWaits).
  speculate_from_ = next_from_ = arena_ != nullptr ? (arena_->first_unit() + num_units) / 2 : num_units;
  // The workers read whether the first step speculates from the "verdict" on the step before it.
  if (plan_.clip_staging == ClipStaging::kDevice) {
    rings_.PublishVerdict(first_step - 1, shm::StepVerdict{true, speculate_step_}, speculate_from_);
  }
}

void GradConsumer::ObserveWaits(double gate_wait_s, double ring_wait_s) {
  if (arena_ == nullptr) return;
  const int num_units = static_cast<int>(unit_numel_.size());
  const int stride = std::max(1, (num_units - arena_->first_unit()) / 16);
  constexpr double kSlackS = 0.005;  // waits below this are noise
  if (gate_wait_s > 1.2 * ring_wait_s + kSlackS) {
    next_from_ = std::max(arena_->first_unit(), next_from_ - stride);
  } else if (ring_wait_s > 1.2 * gate_wait_s + kSlackS) {
    next_from_ = std::min(num_units - 1, next_from_ + stride);
  }
}

absl::StatusOr<double> GradConsumer::PopRankNorm(int r, int64_t t, bool first_step, double& wait_s,
                                                 std::string& nonfinite) {
  const absl::Time t_wait = absl::Now();
  ASSIGN_OR_RETURN(shm::GradChunkDesc d, rings_.Pop(r, first_step));
  wait_s += SecondsSince(t_wait);
  if (d.kind != shm::ChunkKind::kSumSquares || d.step != static_cast<uint32_t>(t)) {
    // (The slot is not released: the job ends here and the ring with it.)
    return rings_.FailRank(
        r, absl::StrCat("posted unit ", d.unit, " (kind ", static_cast<uint32_t>(d.kind), ") for step ", d.step,
                        " where its squared norm for step ", t, " comes ",
                        speculate_step_ ? "after its speculative parts" : "first", " (device staging)"));
  }
  double squares;
  std::memcpy(&squares, rings_.ring(r).slot_data(d.slot), sizeof(double));
  RETURN_IF_ERROR(rings_.ring(r).Release(d.slot));
  if (!std::isfinite(squares) || squares < 0) {
    LOG(WARNING) << "job " << job_id_ << " step " << t + 1 << ": " << rings_.WorkerName(r)
                 << " posted the squared gradient norm " << squares;
    nonfinite = absl::StrCat("the squared gradient norm posted by ", rings_.WorkerName(r), " is ",
                             std::isfinite(squares) ? absl::StrCat(squares) : NonFiniteName(squares));
  }
  return squares;
}

absl::Status GradConsumer::ConsumeRank(int r, int64_t t, bool first_step, float coef, PartAction action,
                                       UnitSpan units, int threads, StepUpdates& updates,
                                       update::GradNormAccumulator& norm, double& wait_s, double& aggregate_s) {
  const int world = plan_.world;
  std::vector<int64_t> unit_got(unit_numel_.size(), 0);
  int64_t expected = 0;  // the rank's elements of units [begin, end)
  for (int u = units.begin; u < units.end; ++u) {
    expected += plan_.route == GradReduction::kGpu ? ShardOf(unit_numel_[u], world, r).numel : unit_numel_[u];
  }
  int64_t got = 0;
  while (got < expected) {
    const absl::Time t_wait = absl::Now();
    ASSIGN_OR_RETURN(shm::GradChunkDesc d, rings_.Pop(r, first_step));
    wait_s += SecondsSince(t_wait);
    const bool unit_ok = d.unit >= units.begin && d.unit < units.end;
    const ShardRange shard = unit_ok ? ShardOf(unit_numel_[d.unit], world, r) : ShardRange{};
    if (d.step != static_cast<uint32_t>(t) || !unit_ok || d.kind != shm::GradChunkKind(plan_.grad_dtype) ||
        !RangeInside(d.offset_numel, d.numel, shard.offset, shard.offset + shard.numel) ||
        d.numel > shard.numel - unit_got[d.unit] ||
        SplitsMomentBlock(plan_, d.offset_numel, d.numel, unit_numel_[d.unit])) {
      return rings_.FailRank(
          r, absl::StrCat("posted an unexpected gradient chunk: step ", d.step, " unit ", d.unit, " offset ",
                          d.offset_numel, " numel ", d.numel, " kind ", static_cast<uint32_t>(d.kind), " while hostd ",
                          action == PartAction::kSpeculate ? "speculates" : "applies", " step ", t, " (",
                          shm::ChunkKindName(shm::GradChunkKind(plan_.grad_dtype)), ", units ", units.begin, "..",
                          units.end - 1, plan_.moments == MomentForm::kInt8 ? ", on int8 moment blocks" : "",
                          "; its shard of that unit is [", shard.offset, ", ", shard.offset + shard.numel, "), ",
                          unit_ok ? unit_got[d.unit] : 0, " elements of it already received)"));
    }
    const update::GradPtr src = rings_.grad(r, d);
    unit_got[d.unit] += d.numel;
    got += d.numel;
    RETURN_IF_ERROR(TakePart(r, d, src, coef, action, threads, updates, norm, aggregate_s));
  }
  return absl::OkStatus();
}

absl::Status GradConsumer::TakePart(int r, const shm::GradChunkDesc& d, update::GradPtr src, float coef,
                                    PartAction action, int threads, StepUpdates& updates,
                                    update::GradNormAccumulator& norm, double& aggregate_s) {
  const bool device_staged = plan_.clip_staging == ClipStaging::kDevice;
  const bool host_staged = plan_.clip_staging == ClipStaging::kHost;
  if (action == PartAction::kDiscard) {
    // Not applied (the step fails or is skipped): checked, to name what is not finite.
    NoteNonFinite(r, d.unit, d.offset_numel, src, d.numel);
    RETURN_IF_ERROR(rings_.ring(r).Release(d.slot));
    if (policy_ == NonFinitePolicy::kSkip) {
      if (absl::Status s = updates.Skip(d.unit, d.offset_numel, d.numel); IsRangeRefusal(s)) {
        return rings_.FailRank(r, absl::StrCat("posted a gradient chunk twice: ", s.message()));
      } else {
        RETURN_IF_ERROR(s);
      }
    }
    return absl::OkStatus();
  }
  if (action == PartAction::kSpeculate) {
    // Before the norm: updated with c = 1, the state it overwrites saved, the gate held.
    absl::Status s = updates.Speculate(d.unit, arena_->undo(d.unit), d.offset_numel, d.numel, src, &rings_.ring(r),
                                       d.slot, update::NonFiniteGrad::kRefuse, rings_.WorkerName(r));
    if (IsRangeRefusal(s)) {
      return rings_.FailRank(r, absl::StrCat("posted a gradient chunk twice: ", s.message()));
    }
    RETURN_IF_ERROR(s);
    return absl::OkStatus();
  }
  if (!device_staged && !host_staged) {
    // Final already, and the norm only a metric: updated now (while the rest of the backward
    // pass still runs), its squares summed by the update itself.
    absl::Status s = updates.ApplySquared(d.unit, d.offset_numel, d.numel, src, &rings_.ring(r), d.slot,
                                          rings_.WorkerName(r), norm);
    if (IsRangeRefusal(s)) {
      return rings_.FailRank(r, absl::StrCat("posted a gradient chunk twice: ", s.message()));
    }
    RETURN_IF_ERROR(s);
    return absl::OkStatus();
  }
  const absl::Time t_agg = absl::Now();
  bool finite = true;
  if (!device_staged) {  // (device staging: the norm came from the ranks)
    float* dst = host_staged ? staging_[d.unit].data() + d.offset_numel : nullptr;
    absl::StatusOr<bool> f = SquarePieces(r, d.unit, d.offset_numel, d.numel, src, dst, threads, norm);
    if (!f.ok()) {
      (void)rings_.ring(r).Release(d.slot);
      return f.status();
    }
    finite = *f;
  }
  aggregate_s += SecondsSince(t_agg);
  if (host_staged) {
    RETURN_IF_ERROR(rings_.ring(r).Release(d.slot));  // staged: the slot is free again
    RETURN_IF_ERROR(SpeculateStaged(d.unit, d.offset_numel, d.numel, finite, updates));
    return absl::OkStatus();
  }
  // Device staging: final already, updated while the later parts are still coming. These parts
  // were never seen here (their norm came from the rank): LayerAdam checks them block by block
  // as it updates, so a part a broken worker's norm does not account for never reaches the
  // master. A unit updated speculatively this step is redone from its undo copy (the norm
  // clipped).
  const update::UndoMemory* redo = arena_ != nullptr && updates.Speculated(d.unit) ? &arena_->undo(d.unit) : nullptr;
  absl::Status s = updates.Apply(d.unit, d.offset_numel, d.numel, coef, src, &rings_.ring(r), d.slot,
                                 update::NonFiniteGrad::kRefuse, rings_.WorkerName(r), redo);
  if (IsRangeRefusal(s)) {
    return rings_.FailRank(r, absl::StrCat("posted a gradient chunk twice: ", s.message()));
  }
  RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

absl::Status GradConsumer::ForEachRank(const RankBody& body, StepGradients& out) {
  // Every ring at once, one thread per rank, each until its own part is in, so ranks posting
  // different numbers of chunks cannot block each other.
  const int world = plan_.world;
  std::vector<double> rank_wait_s(world, 0), rank_aggregate_s(world, 0);
  absl::Mutex error_mu;
  absl::Status error;
  const int threads_per_rank = std::max(1, aggregate_threads_ / world);
  std::vector<std::thread> consumers;
  for (int r = 0; r < world; ++r) {
    consumers.emplace_back([&, r] {
      pthread_setname_np(pthread_self(), absl::StrCat("grad-rank", r).substr(0, 15).c_str());
      absl::Status s = body(r, threads_per_rank, rank_wait_s[r], rank_aggregate_s[r]);
      if (s.ok()) return;
      absl::MutexLock l(&error_mu);
      // The cause wins over its echoes: once one consumer raises the abort word, the others (and
      // the workers' reports they poll) fail with ABORTED, possibly before it gets here.
      if (error.ok() || (error.code() == absl::StatusCode::kAborted && s.code() != absl::StatusCode::kAborted)) {
        error = s;
      }
      // Wake the other consumers (their Pop returns ABORTED) instead of letting them time out.
      rings_.Abort();
    });
  }
  for (std::thread& c : consumers) c.join();
  RETURN_IF_ERROR(error);
  // The step's host-side time is set by its slowest rank.
  out.wait_s += *std::max_element(rank_wait_s.begin(), rank_wait_s.end());
  out.aggregate_s += *std::max_element(rank_aggregate_s.begin(), rank_aggregate_s.end());
  return absl::OkStatus();
}

absl::Status GradConsumer::ConsumeShards(int64_t t, bool first_step, float coef, PartAction action, UnitSpan units,
                                         StepUpdates& updates, update::GradNormAccumulator& norm, StepGradients& out) {
  return ForEachRank(
      [&](int r, int threads, double& wait_s, double& aggregate_s) {
        return ConsumeRank(r, t, first_step, coef, action, units, threads, updates, norm, wait_s, aggregate_s);
      },
      out);
}

absl::StatusOr<shm::GradChunkDesc> GradConsumer::PopRankZeroChunk(int64_t t, bool first_step, StepGradients& out) {
  const absl::Time t_wait = absl::Now();
  ASSIGN_OR_RETURN(shm::GradChunkDesc d, rings_.Pop(0, first_step));
  out.wait_s += SecondsSince(t_wait);
  if (d.step != static_cast<uint32_t>(t) || d.unit < 0 || d.unit >= static_cast<int>(unit_numel_.size()) ||
      !RangeInside(d.offset_numel, d.numel, 0, unit_numel_[d.unit]) || d.kind != shm::GradChunkKind(plan_.grad_dtype) ||
      SplitsMomentBlock(plan_, d.offset_numel, d.numel, unit_numel_[d.unit])) {
    return rings_.FailRank(
        0,
        absl::StrCat("posted an unexpected gradient chunk: step ", d.step, " unit ", d.unit, " offset ", d.offset_numel,
                     " numel ", d.numel, " kind ", static_cast<uint32_t>(d.kind), " while hostd aggregates step ", t,
                     " (", shm::ChunkKindName(shm::GradChunkKind(plan_.grad_dtype)), ", inside the unit",
                     plan_.moments == MomentForm::kInt8 ? ", on int8 moment blocks" : "", ")"));
  }
  return d;
}

absl::Status GradConsumer::ConsumeDirect(int64_t t, bool first_step, StepUpdates& updates,
                                         update::GradNormAccumulator& norm, StepGradients& out) {
  // Each chunk is updated as it comes, its squares summed by the update itself (ApplySquared: the
  // tracker refuses a range twice, so `left` reaching 0 means every element came once).
  int64_t left = 0;
  for (int64_t n : unit_numel_) left += n;
  while (left > 0) {
    ASSIGN_OR_RETURN(shm::GradChunkDesc d, PopRankZeroChunk(t, first_step, out));
    absl::Status s = updates.ApplySquared(d.unit, d.offset_numel, d.numel, rings_.grad(0, d), &rings_.ring(0), d.slot,
                                          rings_.WorkerName(0), norm);
    if (IsRangeRefusal(s)) {
      return rings_.FailRank(0, absl::StrCat("posted a gradient chunk twice: ", s.message()));
    }
    RETURN_IF_ERROR(s);
    left -= d.numel;
  }
  return absl::OkStatus();
}

absl::Status GradConsumer::ConsumeSummed(int64_t t, bool first_step, StepUpdates& updates,
                                         update::GradNormAccumulator& norm, StepGradients& out) {
  const int world = plan_.world;
  while (!norm.complete()) {
    // Every rank posts the same chunk sequence; take rank 0's chunk, then the same from the
    // others, summing in rank order so results do not depend on arrival order.
    ASSIGN_OR_RETURN(shm::GradChunkDesc d0, PopRankZeroChunk(t, first_step, out));
    std::vector<shm::GradChunkDesc> descs = {d0};
    for (int r = 1; r < world; ++r) {
      ASSIGN_OR_RETURN(shm::GradChunkDesc d, rings_.Pop(r, first_step));
      if (d.step != d0.step || d.unit != d0.unit || d.offset_numel != d0.offset_numel || d.numel != d0.numel ||
          d.kind != d0.kind) {
        return rings_.FailRank(
            r, absl::StrCat("posted unit ", d.unit, "@", d.offset_numel, " numel ", d.numel, " kind ",
                            static_cast<uint32_t>(d.kind), " step ", d.step, " where rank 0 posted unit ", d0.unit, "@",
                            d0.offset_numel, " numel ", d0.numel, " step ", d0.step,
                            " (every rank posts the same chunks on the cpu route)"));
      }
      descs.push_back(d);
    }
    // Sum the ranks' copies in rank order into staging and take the squared norm, block by block
    // on the norm grid (the sum still in cache when squared) over several threads (one thread
    // copies only ~5-10 GB/s); results do not depend on it.
    const absl::Time t_agg = absl::Now();
    float* dst = staging_[d0.unit].data() + d0.offset_numel;
    const int64_t blocks = update::NormBlockCount(d0.offset_numel, d0.numel);
    std::vector<double> block_sq(blocks);
    auto edge = [&](int64_t k) { return BlockEdge(d0.offset_numel, d0.numel, k) - d0.offset_numel; };
    ParallelFor((blocks + kBlocksPerTask - 1) / kBlocksPerTask, aggregate_threads_, [&](size_t task) {
      const int64_t first = static_cast<int64_t>(task) * kBlocksPerTask;
      for (int64_t k = first; k < std::min(blocks, first + kBlocksPerTask); ++k) {
        const int64_t off = edge(k);
        const int64_t n = edge(k + 1) - off;
        CopyWidened(At(rings_.grad(0, descs[0]), off), n, dst + off);
        for (int r = 1; r < world; ++r) AddWidened(At(rings_.grad(r, descs[r]), off), n, dst + off);
        update::NormBlockSquares(d0.offset_numel, d0.numel, dst, false, k, k + 1, block_sq.data());
      }
    });
    absl::Status added = norm.AddPartial(d0.unit, d0.offset_numel, d0.numel,
                                         update::SumBlockSquares(block_sq.data(), blocks));
    if (!added.ok()) return rings_.FailRank(0, absl::StrCat("posted a gradient chunk twice: ", added.message()));
    bool finite = true;
    for (int64_t k = 0; k < blocks; ++k) {
      const int64_t off = edge(k);
      const int64_t n = edge(k + 1) - off;
      if (!std::isfinite(block_sq[k])) {
        finite = false;
        // Name the first rank whose own part is not finite (else only the sum overflows).
        bool named = false;
        for (int r = 0; r < world && !named; ++r) {
          const update::GradPtr src = At(rings_.grad(r, descs[r]), off);
          if (FirstNonFiniteOf(src, n) >= 0) {
            NoteNonFinite(r, d0.unit, d0.offset_numel + off, src, n);
            named = true;
          }
        }
        if (!named) {
          const int64_t i = FirstNonFinite(dst + off, n);
          absl::MutexLock l(&nonfinite_mu_);
          const NonFiniteElement e{d0.unit, d0.offset_numel + off + i, dst[off + i], -1};
          if (!nonfinite_ || std::make_pair(e.unit, e.offset) < std::make_pair(nonfinite_->unit, nonfinite_->offset)) {
            nonfinite_ = e;
          }
        }
      }
    }
    out.aggregate_s += SecondsSince(t_agg);
    for (int r = 0; r < world; ++r) RETURN_IF_ERROR(rings_.ring(r).Release(descs[r].slot));
    // Without staging a chunk is final once every rank's copy is summed: update it now, while
    // the rest of the backward pass is still running.
    if (plan_.clip_staging == ClipStaging::kNone) {
      if (!finite) return NonFiniteError(t, NonFiniteGradient(), "the parts applied before it keep this step's update");
      RETURN_IF_ERROR(updates.Apply(d0.unit, d0.offset_numel, d0.numel, 1.0f, dst));
    } else {
      RETURN_IF_ERROR(SpeculateStaged(d0.unit, d0.offset_numel, d0.numel, finite, updates));
    }
  }
  return absl::OkStatus();
}

absl::Status GradConsumer::SpeculateStaged(int unit, int64_t offset, int64_t numel, bool finite,
                                           StepUpdates& updates) {
  if (!speculate_step_ || arena_ == nullptr || !arena_->covers(unit) || unit < speculate_from_) return absl::OkStatus();
  if (!finite) speculation_stopped_.store(true);  // the step will not be applied as it is
  if (speculation_stopped_.load()) return absl::OkStatus();
  return updates.Speculate(unit, arena_->undo(unit), offset, numel, staging_[unit].data() + offset);
}

absl::StatusOr<StepGradients> GradConsumer::ConsumeDeviceStaged(int64_t t, bool first_step, StepUpdates& updates) {
  StepGradients out;
  update::GradNormAccumulator norm(unit_numel_);
  const int num_units = static_cast<int>(unit_numel_.size());
  const bool spec = speculate_step_ && arena_ != nullptr;
  const int k = spec ? speculate_from_ : num_units;
  // Each rank posts its speculated units' parts (when the step speculates) and then its squared
  // norm: the coefficient, and whether the step's gradient is finite, are known after them.
  std::vector<double> squares(plan_.world, 0);
  std::vector<std::string> rank_nonfinite(plan_.world);
  RETURN_IF_ERROR(ForEachRank(
      [&](int r, int threads, double& wait_s, double& aggregate_s) -> absl::Status {
        if (spec) {
          RETURN_IF_ERROR(ConsumeRank(r, t, first_step, 1.0f, PartAction::kSpeculate, UnitSpan{k, num_units}, threads,
                                      updates, norm, wait_s, aggregate_s));
        }
        ASSIGN_OR_RETURN(squares[r], PopRankNorm(r, t, first_step, wait_s, rank_nonfinite[r]));
        return absl::OkStatus();
      },
      out));
  double sum_squares = 0;
  std::string nonfinite;
  for (int r = 0; r < plan_.world; ++r) {  // summed in rank order
    sum_squares += squares[r];
    if (nonfinite.empty()) nonfinite = rank_nonfinite[r];
  }
  out.grad_norm = std::sqrt(sum_squares);
  absl::StatusOr<std::string> why = std::string();
  if (nonfinite.empty()) why = Decide(t, "");
  const bool apply = nonfinite.empty() && why.ok() && why->empty();
  const float coef = apply ? update::ClipCoefficient(out.grad_norm, max_grad_norm_) : 1.0f;
  const bool commit = spec && apply && coef == 1.0f;
  if (spec) {
    // A speculative part refused as not finite is expected when the rank's norm says so (the
    // step is then skipped or fails below, nothing of it kept); with a finite norm the worker is
    // broken and the job fails with that error.
    absl::Status speculated = updates.WaitSpeculation();
    if (!speculated.ok() && !(absl::IsDataLoss(speculated) && !nonfinite.empty())) return speculated;
    out.speculated_numel = updates.speculated_numel();
    out.rolled_back = !commit;
    if (!apply) RETURN_IF_ERROR(updates.RestoreSpeculation());  // nothing of the step stays
  }
  // Speculate the next step unless this one clipped (or was not applied): a job that clips for a
  // while pays no undo copies and no rollbacks, one that does not keeps the updates overlapped.
  speculate_step_ = arena_ != nullptr && apply && coef == 1.0f;
  // Before any gate of the step opens: the workers read from it whether step t+1 speculates.
  speculate_from_ = next_from_;
  rings_.PublishVerdict(t, shm::StepVerdict{!commit, speculate_step_}, speculate_from_);
  if (commit) RETURN_IF_ERROR(updates.CommitSpeculation());
  if (!why.ok()) return why.status();
  const UnitSpan rest{0, commit ? k : num_units};
  if (apply) {
    RETURN_IF_ERROR(ConsumeShards(t, first_step, coef, PartAction::kApply, rest, updates, norm, out));
    return out;
  }
  // Not applied: the parts come out of the rings checked, to name the unit that is not finite.
  absl::Status drained = ConsumeShards(t, first_step, 1.0f, PartAction::kDiscard, rest, updates, norm, out);
  if (!nonfinite.empty()) {
    const std::string element = NonFiniteGradient();
    ASSIGN_OR_RETURN(why, Decide(t, element.empty() ? nonfinite : element));
  }
  RETURN_IF_ERROR(drained);
  out.skipped = true;
  out.skipped_because = *why;
  return out;
}

absl::Status GradConsumer::ApplyHostStaged(int64_t t, StepUpdates& updates, StepGradients& out) {
  // The whole step is staged. Exact clipping needs the whole step's norm: apply the step, or skip
  // it. Forward order, so the next step's forward can start on the first units while later ones
  // update.
  absl::StatusOr<std::string> why = Decide(t, NonFiniteGradient());
  const bool apply = why.ok() && why->empty();
  const float coef = apply ? update::ClipCoefficient(out.grad_norm, max_grad_norm_) : 1.0f;
  RETURN_IF_ERROR(updates.WaitSpeculation());
  out.speculated_numel = updates.speculated_numel();
  const int num_units = static_cast<int>(unit_numel_.size());
  // Every unit the arena covers was speculated whole, unless a non-finite chunk stopped it (then
  // what was speculated is put back).
  bool whole = !speculation_stopped_.load();
  for (int u = arena_ != nullptr ? speculate_from_ : num_units; u < num_units && whole; ++u) {
    whole = updates.Speculated(u);
  }
  const bool commit = out.speculated_numel > 0 && apply && coef == 1.0f && whole;
  if (out.speculated_numel > 0 && !commit) {
    out.rolled_back = true;
    if (!apply || !whole) RETURN_IF_ERROR(updates.RestoreSpeculation());
  }
  const bool redo = out.speculated_numel > 0 && !commit && apply && whole;
  speculate_step_ = arena_ != nullptr && apply && coef == 1.0f;
  speculate_from_ = next_from_;
  if (commit) RETURN_IF_ERROR(updates.CommitSpeculation());
  RETURN_IF_ERROR(why.status());
  if (!apply) {
    for (int u = 0; u < num_units; ++u) RETURN_IF_ERROR(updates.Skip(u, 0, unit_numel_[u]));
    out.skipped = true;
    out.skipped_because = *why;
    return absl::OkStatus();
  }
  for (int u = 0; u < num_units; ++u) {
    if (commit && updates.Speculated(u)) continue;  // done: the speculative update was the step's
    const update::UndoMemory* from = redo && updates.Speculated(u) ? &arena_->undo(u) : nullptr;
    RETURN_IF_ERROR(updates.Apply(u, 0, unit_numel_[u], coef, staging_[u].data(), nullptr, 0,
                                  update::NonFiniteGrad::kApply, "", from));
  }
  return absl::OkStatus();
}

absl::StatusOr<StepGradients> GradConsumer::ConsumeStep(int64_t t, bool first_step, StepUpdates& updates) {
  {
    absl::MutexLock l(&nonfinite_mu_);
    nonfinite_.reset();
  }
  speculation_stopped_.store(false);
  if (plan_.clip_staging == ClipStaging::kDevice) return ConsumeDeviceStaged(t, first_step, updates);
  StepGradients out;
  update::GradNormAccumulator norm(unit_numel_);
  const UnitSpan all{0, static_cast<int>(unit_numel_.size())};
  absl::Status consumed;
  switch (plan_.consumer) {
    case GradConsumerKind::kShards:
      consumed = ConsumeShards(t, first_step, 1.0f, PartAction::kApply, all, updates, norm, out);
      break;
    case GradConsumerKind::kDirect: consumed = ConsumeDirect(t, first_step, updates, norm, out); break;
    case GradConsumerKind::kSummed: consumed = ConsumeSummed(t, first_step, updates, norm, out); break;
  }
  if (plan_.consumer != GradConsumerKind::kSummed && plan_.clip_staging == ClipStaging::kNone) {
    // The updates sum the squares into `norm` (ApplySquared): the norm is whole once they are
    // done, and none may outlive it, also when the step failed part-way.
    const absl::Time t_tail = absl::Now();
    absl::Status drained = updates.Drain();
    out.update_tail_s = SecondsSince(t_tail);
    RETURN_IF_ERROR(consumed);
    if (absl::IsDataLoss(drained)) {  // a refused non-finite gradient
      rings_.Abort();
      return absl::DataLossError(
          absl::StrCat(drained.message(), " (train.skip_nonfinite: true skips such steps)"));
    }
    RETURN_IF_ERROR(drained);
  }
  RETURN_IF_ERROR(consumed);
  absl::StatusOr<double> grad_norm = norm.Norm();
  if (!grad_norm.ok()) {  // (the consumers above take exactly every element: a bug)
    rings_.Abort();
    return absl::InternalError(grad_norm.status().message());
  }
  out.grad_norm = *grad_norm;
  for (int u : whole_units_) out.whole_unit_squares += norm.UnitSquares(u);
  if (plan_.clip_staging == ClipStaging::kHost) RETURN_IF_ERROR(ApplyHostStaged(t, updates, out));
  return out;
}

}  // namespace slidedp::hostd
