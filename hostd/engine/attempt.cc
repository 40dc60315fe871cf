// The attempt's segments and the placement of its units' state (see attempt.h).
#include "hostd/engine/attempt.h"

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp::hostd {
namespace {

// optimizer.no_decay as LayerAdam's per-tensor rule (hostd/update/weight_decay.h).
update::DecayExemptions DecayExemptionsOf(const JobSpec& spec) {
  update::DecayExemptions e{false, false};
  for (NoDecay g : spec.optimizer.no_decay) (g == NoDecay::kNorm ? e.norms : e.biases) = true;
  return e;
}

}  // namespace

AttemptSegments::AttemptSegments(HostStatePool& pool, const HostStatePool::Holders& workers)
    : pool_(pool), workers_(workers) {}

const shm::JobState* AttemptSegments::TakePooled(const ModelLayout& layout, const shm::StateFormat& format) {
  pooled_ = pool_.Take(layout, format);
  return pooled_.get();
}

absl::Status AttemptSegments::AdoptPooled(const std::string& job_id, const ModelLayout& layout,
                                          const shm::StateFormat& format, int prefault_threads) {
  ASSIGN_OR_RETURN(state_, pool_.Adopt(std::move(pooled_), job_id, layout, format, prefault_threads));
  reused_ = true;
  return absl::OkStatus();
}

void AttemptSegments::HoldTakenOver(std::unique_ptr<shm::JobState> state, int64_t step) {
  state_ = std::move(state);
  taken_over_step_ = step;
}

absl::Status AttemptSegments::CreateExchange(const std::string& node_name, const std::string& job_id,
                                             const RoutePlan& plan) {
  for (int r = 0; r < plan.world; ++r) {
    ASSIGN_OR_RETURN(
        auto ring, shm::GradRing::Create(node_name, job_id, r, plan.ring, shm::RingRole::kConsumer, &state_->abort()));
    rings_.push_back(std::move(ring));
  }
  if (plan.shm_collective) {
    ASSIGN_OR_RETURN(collective_, shm::ShmCollective::Create(node_name, job_id, plan.world,
                                                             plan.collective_buffer_bytes, &state_->abort()));
  }
  if (plan.context_buffer_bytes > 0) {  // one collective per context group (ranks g C .. g C + C - 1)
    context_ranks_ = plan.context_ranks;
    for (int g = 0; g < plan.world / plan.context_ranks; ++g) {
      ASSIGN_OR_RETURN(auto coll,
                       shm::ShmCollective::Create(node_name, job_id, plan.context_ranks, plan.context_buffer_bytes,
                                                  &state_->abort(), "/dev/shm", absl::StrCat("ctx", g)));
      context_collectives_.push_back(std::move(coll));
    }
  }
  return absl::OkStatus();
}

void AttemptSegments::NameSegments(int rank, v1::Assignment& assignment) const {
  assignment.set_state_segment(state_->segment_name());
  assignment.set_ring_segment(rings_[rank]->segment_name());
  if (collective_) assignment.set_collective_segment(collective_->segment_name());
  if (!context_collectives_.empty()) {
    assignment.set_context_segment(context_collectives_[rank / context_ranks_]->segment_name());
  }
}

absl::Status AttemptSegments::PrioritizeCopies(update::LayerAdam& adam, int world, double yield_fraction,
                                               absl::Duration max_pause) {
  copy_priority_reader_ = &adam;
  return adam.SetCopyPriority(state_->UrgentCopyWords(world), yield_fraction, max_pause);
}

void AttemptSegments::ReleaseAll() {
  if (state_ != nullptr) {
    // Before the segment can be unmapped: LayerAdam stops reading its urgent-copy words (no chunk
    // of the job is in flight here: every step's updates drain before it ends).
    if (copy_priority_reader_ != nullptr) copy_priority_reader_->ClearCopyPriority();
    // A no-op after success: the workers have already reported the end of the job.
    state_->RaiseAbort(shm::AbortReason::kShutdown);
    for (auto& r : rings_) (void)r->Unlink();
    if (collective_) (void)collective_->Unlink();
    for (auto& c : context_collectives_) (void)c->Unlink();
    pool_.Finish(std::move(state_), poolable_, workers_);
  }
  pool_.PutBack(std::move(pooled_));  // taken and refused before adopting it; nothing when none
}

absl::Status StepLoop::PlaceUnits(const ModelLayout& layout, const JobSpec& spec, shm::JobState& js) {
  const int num_units = layout.num_units();
  std::vector<int64_t> unit_bytes(num_units);
  for (int u = 0; u < num_units; ++u) {
    unit_bytes[u] = layout.units[u].numel * (js.has_mirror() ? 6 : 4) + static_cast<int64_t>(js.moments(u).bytes);
  }
  const std::vector<int> placement = adam->AssignNumaNodes(unit_bytes);
  const update::DecayExemptions decay = DecayExemptionsOf(spec);
  tensor_ranges.resize(num_units);
  int64_t first_index = 0;
  for (int u = 0; u < num_units; ++u) {
    tensor_ranges[u] = update::TensorRangesOf(layout.units[u], decay);
    memory.push_back(
        update::UnitMemory{js.master(u), js.m(u), js.v(u), js.mirror(u), layout.units[u].numel, placement[u]});
    update::UnitMemory& unit = memory.back();
    unit.tensors = tensor_ranges[u];
    const shm::JobState::Moments mv = js.moments(u);
    switch (mv.dtype) {
      case MomentForm::kF32: break;
      case MomentForm::kBF16:
        unit.moments = MomentForm::kBF16;
        unit.bf16 = update::Bf16Moments{static_cast<bf16_t*>(mv.m), static_cast<bf16_t*>(mv.v)};
        break;
      case MomentForm::kInt8:
        unit.moments = MomentForm::kInt8;
        unit.int8 =
            update::Int8Moments{static_cast<int8_t*>(mv.m), static_cast<uint8_t*>(mv.v), mv.m_scale, mv.v_scale};
        break;
    }
    unit.first_index = first_index;
    first_index += layout.units[u].numel;
    if (adam->num_numa_nodes() > 1) RETURN_IF_ERROR(adam->FirstTouch(memory.back()));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
