// JobState: one segment with every unit's master/Adam/mirror regions and the control block.
#include "shm/job_state.h"

#include <algorithm>
#include <cstring>
#include <new>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::shm {
namespace {

constexpr const char* kControlRegion = "control";

std::string UnitRegion(int unit, const char* what) { return absl::StrCat("u", unit, ".", what); }

std::vector<RegionSpec> JobRegions(const ModelLayout& layout, const StateFormat& format) {
  const MomentForm moments = format.moments;
  std::vector<RegionSpec> regions;
  regions.push_back(RegionSpec{kControlRegion, sizeof(JobControlBlock) + layout.units.size() * sizeof(VersionGate),
                               ShmDtype::kBytes});
  for (int u = 0; u < layout.num_units(); ++u) {
    const uint64_t n = static_cast<uint64_t>(layout.units[u].numel);
    regions.push_back(RegionSpec{UnitRegion(u, "master"), n * 4, ShmDtype::kF32});
    switch (moments) {
      case MomentForm::kF32:
        regions.push_back(RegionSpec{UnitRegion(u, "adam_m"), n * 4, ShmDtype::kF32});
        regions.push_back(RegionSpec{UnitRegion(u, "adam_v"), n * 4, ShmDtype::kF32});
        break;
      case MomentForm::kBF16:
        regions.push_back(RegionSpec{UnitRegion(u, "adam_m"), n * 2, ShmDtype::kBF16});
        regions.push_back(RegionSpec{UnitRegion(u, "adam_v"), n * 2, ShmDtype::kBF16});
        break;
      case MomentForm::kInt8:
        regions.push_back(RegionSpec{UnitRegion(u, "adam_m"), n, ShmDtype::kI8});
        regions.push_back(RegionSpec{UnitRegion(u, "adam_v"), n, ShmDtype::kU8});
        regions.push_back(RegionSpec{UnitRegion(u, "adam_m_scale"), static_cast<uint64_t>(Int8MomentBlocks(static_cast<int64_t>(n))) * 4, ShmDtype::kF32});
        regions.push_back(RegionSpec{UnitRegion(u, "adam_v_scale"), static_cast<uint64_t>(Int8MomentBlocks(static_cast<int64_t>(n))) * 4, ShmDtype::kF32});
        break;
    }
    if (format.mirror) regions.push_back(RegionSpec{UnitRegion(u, "mirror"), n * 2, ShmDtype::kBF16});
  }
  return regions;
}

// Regions per unit for each format.
uint64_t UnitRegions(const StateFormat& f) { return (f.moments == MomentForm::kInt8 ? 5 : 3) + (f.mirror ? 1 : 0); }

}  // namespace

uint64_t LayoutFingerprint(const ModelLayout& layout) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over (count, kind, numel...)
  auto mix = [&h](uint64_t v) {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xff;
      h *= 1099511628211ull;
    }
  };
  mix(layout.units.size());
  for (const UnitLayout& u : layout.units) {
    mix(static_cast<uint64_t>(u.kind));
    mix(static_cast<uint64_t>(u.numel));
  }
  return h;
}

uint64_t JobState::SegmentBytes(const ModelLayout& layout, const StateFormat& format, uint64_t alignment) {
  return ShmSegment::RequiredBytes(JobRegions(layout, format), alignment);
}

JobState::Moments JobState::moments(int unit) const {
  const UnitView& u = units_[unit];
  return Moments{moment_form(), u.m, u.v, u.m_scale, u.v_scale, u.moment_bytes};
}

absl::StatusOr<std::unique_ptr<JobState>> JobState::Create(const std::string& node, const std::string& job_id,
                                                           const ModelLayout& layout, const JobStateOptions& options) {
  if (layout.units.empty()) return absl::InvalidArgumentError("JobState: model layout has no units");
  ASSIGN_OR_RETURN(std::string name, MakeSegmentName(node, job_id, "state"));
  ShmCreateOptions seg_opts;
  seg_opts.alignment = options.alignment;
  seg_opts.shm_dir = options.shm_dir;
  seg_opts.allocation = options.first_touch == FirstTouch::kAtCreate ? Allocation::kAll : Allocation::kHeaderOnly;
  seg_opts.allocate_threads = options.prefault_threads;
  ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg, ShmSegment::Create(name, JobRegions(layout, options.format), seg_opts));
  return Initialize(std::move(seg), job_id, layout, options);
}

absl::StatusOr<std::unique_ptr<JobState>> JobState::Reformat(const std::string& segment_name, const std::string& job_id,
                                                             const ModelLayout& layout,
                                                             const JobStateOptions& options) {
  if (layout.units.empty()) return absl::InvalidArgumentError("JobState: model layout has no units");
  ShmCreateOptions seg_opts;
  seg_opts.alignment = options.alignment;
  seg_opts.shm_dir = options.shm_dir;
  ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg, ShmSegment::Reformat(segment_name, JobRegions(layout, options.format), seg_opts));
  JobStateOptions o = options;
  o.first_touch = FirstTouch::kAtCreate;  // the pages exist: map them all now
  return Initialize(std::move(seg), job_id, layout, o);
}

absl::StatusOr<std::unique_ptr<JobState>> JobState::Relayout(std::unique_ptr<JobState> state,
                                                             const std::string& new_name, const std::string& job_id,
                                                             const ModelLayout& layout,
                                                             const JobStateOptions& options) {
  if (layout.units.empty()) return absl::InvalidArgumentError("JobState: model layout has no units");
  std::unique_ptr<ShmSegment> seg = std::move(state->segment_);
  state.reset();
  RETURN_IF_ERROR(seg->Relayout(new_name, JobRegions(layout, options.format), options.alignment));
  JobStateOptions o = options;
  o.first_touch = FirstTouch::kByOwner;  // every page is allocated and mapped here already
  return Initialize(std::move(seg), job_id, layout, o);
}

absl::StatusOr<std::unique_ptr<JobState>> JobState::Initialize(std::unique_ptr<ShmSegment> seg,
                                                               const std::string& job_id, const ModelLayout& layout,
                                                               const JobStateOptions& options) {
  const std::string name = seg->name();
  std::unique_ptr<JobState> state(new JobState(std::move(seg)));
  auto fail = [&](const absl::Status& s) {
    state->segment_->Unlink().IgnoreError();
    return s;
  };
  // The control block is written now by the creator, so allocate it regardless of first touch.
  ASSIGN_OR_RETURN(Region control, state->segment_->FindRegion(kControlRegion));
  if (absl::Status s = state->segment_->Allocate(control.offset, control.bytes); !s.ok()) return fail(s);
  auto* block = new (state->segment_->data(control)) JobControlBlock();
  block->num_units = static_cast<uint32_t>(layout.units.size());
  block->moment_form = static_cast<uint32_t>(options.format.moments);
  block->has_mirror = options.format.mirror ? 1 : 0;
  block->total_numel = static_cast<uint64_t>(layout.total_numel);
  block->layout_fingerprint = LayoutFingerprint(layout);
  std::strncpy(block->job_id, job_id.c_str(), sizeof(block->job_id) - 1);
  auto* gates =
      reinterpret_cast<VersionGate*>(static_cast<uint8_t*>(state->segment_->data(control)) + sizeof(JobControlBlock));
  for (size_t u = 0; u < layout.units.size(); ++u) new (&gates[u]) VersionGate();
  if (absl::Status s = state->BindViews(); !s.ok()) return fail(s);
  if (options.first_touch == FirstTouch::kAtCreate) {
    if (absl::Status s = state->segment_->PrefaultAll(options.prefault_threads); !s.ok()) {
      return fail(s);
    }
  }
  LOG(INFO) << "job " << job_id << ": state segment " << name << ", " << layout.units.size() << " units, "
            << state->bytes() << " bytes";
  return state;
}

absl::StatusOr<std::unique_ptr<JobState>> JobState::Attach(const std::string& segment_name, Access access) {
  ASSIGN_OR_RETURN(std::unique_ptr<ShmSegment> seg, ShmSegment::Open(segment_name, access));
  std::unique_ptr<JobState> state(new JobState(std::move(seg)));
  RETURN_IF_ERROR(state->BindViews());
  return state;
}

// Resolves the region table into typed pointers, checking every size against the control block.
absl::Status JobState::Rebind() {
  RETURN_IF_ERROR(segment_->Reload());
  return BindViews();
}

absl::Status JobState::BindViews() {
  const std::string& name = segment_->name();
  ASSIGN_OR_RETURN(Region control, segment_->FindRegion(kControlRegion));
  if (control.bytes < sizeof(JobControlBlock)) {
    return absl::DataLossError(absl::StrCat("job segment ", name, ": control region is ", control.bytes,
                                            " bytes, less than ", sizeof(JobControlBlock)));
  }
  control_ = static_cast<JobControlBlock*>(segment_->data(control));
  const uint64_t n = control_->num_units;
  if (control_->moment_form > static_cast<uint32_t>(MomentForm::kInt8)) {
    return absl::DataLossError(
        absl::StrCat("job segment ", name, ": control block names moment layout ", control_->moment_form));
  }
  if (control_->has_mirror > 1) {
    return absl::DataLossError(absl::StrCat("job segment ", name, ": control block's mirror flag is ",
                                            control_->has_mirror));
  }
  const MomentForm moments = moment_form();
  const bool has_mirror = this->has_mirror();
  if (control.bytes != sizeof(JobControlBlock) + n * sizeof(VersionGate) ||
      segment_->regions().size() != 1 + UnitRegions(format()) * n) {
    return absl::DataLossError(absl::StrCat("job segment ", name, ": control block says ", n, " units (",
                                            ToString(moments), " moments, ", has_mirror ? "with" : "without",
                                            " mirror) but the segment has ", segment_->regions().size(),
                                            " regions and a ", control.bytes, "-byte control region"));
  }
  versions_ = reinterpret_cast<VersionGate*>(static_cast<uint8_t*>(segment_->data(control)) + sizeof(JobControlBlock));
  units_.assign(n, UnitView{});
  const ShmDtype m_dtype = moments == MomentForm::kF32    ? ShmDtype::kF32
                           : moments == MomentForm::kBF16 ? ShmDtype::kBF16
                                                          : ShmDtype::kI8;
  const ShmDtype v_dtype = moments == MomentForm::kInt8 ? ShmDtype::kU8 : m_dtype;
  for (uint64_t u = 0; u < n; ++u) {
    const int ui = static_cast<int>(u);
    ASSIGN_OR_RETURN(Region master, segment_->FindRegion(UnitRegion(ui, "master")));
    ASSIGN_OR_RETURN(Region m, segment_->FindRegion(UnitRegion(ui, "adam_m")));
    ASSIGN_OR_RETURN(Region v, segment_->FindRegion(UnitRegion(ui, "adam_v")));
    Region mirror{};
    if (has_mirror) {
      ASSIGN_OR_RETURN(mirror, segment_->FindRegion(UnitRegion(ui, "mirror")));
    }
    const uint64_t numel = master.bytes / 4;
    const uint64_t element_bytes = moments == MomentForm::kF32 ? 4 : moments == MomentForm::kBF16 ? 2 : 1;
    Region m_scale{}, v_scale{};
    bool scales_ok = true;
    if (moments == MomentForm::kInt8) {
      ASSIGN_OR_RETURN(m_scale, segment_->FindRegion(UnitRegion(ui, "adam_m_scale")));
      ASSIGN_OR_RETURN(v_scale, segment_->FindRegion(UnitRegion(ui, "adam_v_scale")));
      scales_ok = m_scale.bytes == static_cast<uint64_t>(Int8MomentBlocks(static_cast<int64_t>(numel))) * 4 && v_scale.bytes == m_scale.bytes &&
                  m_scale.dtype == ShmDtype::kF32 && v_scale.dtype == ShmDtype::kF32;
    }
    if (master.bytes % 4 != 0 || m.bytes != numel * element_bytes || v.bytes != m.bytes || !scales_ok ||
        (has_mirror && (mirror.bytes != numel * 2 || mirror.dtype != ShmDtype::kBF16)) ||
        master.dtype != ShmDtype::kF32 || m.dtype != m_dtype || v.dtype != v_dtype) {
      return absl::DataLossError(absl::StrCat("job segment ", name, ": unit ", u, " regions disagree (master ",
                                              master.bytes, ", m ", m.bytes, " ", ShmDtypeName(m.dtype), ", v ",
                                              v.bytes, " ", ShmDtypeName(v.dtype), ", mirror ", mirror.bytes,
                                              " bytes; ", ToString(moments), " moments)"));
    }
    UnitView& view = units_[u];
    view.numel = static_cast<int64_t>(numel);
    view.offset = master.offset;
    const Region& last = has_mirror ? mirror : moments == MomentForm::kInt8 ? v_scale : v;
    view.span_bytes = last.offset + last.bytes - master.offset;
    view.master = static_cast<float*>(segment_->data(master));
    view.m = segment_->data(m);
    view.v = segment_->data(v);
    if (moments == MomentForm::kInt8) {
      view.m_scale = static_cast<float*>(segment_->data(m_scale));
      view.v_scale = static_cast<float*>(segment_->data(v_scale));
    }
    view.moment_bytes = m.bytes + v.bytes + m_scale.bytes + v_scale.bytes;
    view.mirror = has_mirror ? static_cast<bf16_t*>(segment_->data(mirror)) : nullptr;
  }
  return absl::OkStatus();
}

absl::Status JobState::CheckMatches(const ModelLayout& layout) const {
  if (control_->num_units != layout.units.size() || control_->layout_fingerprint != LayoutFingerprint(layout) ||
      control_->total_numel != static_cast<uint64_t>(layout.total_numel)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job segment ", segment_->name(), " holds ", control_->num_units, " units / ", control_->total_numel,
        " elements (fingerprint ", control_->layout_fingerprint, "), but the model layout has ", layout.units.size(),
        " units / ", layout.total_numel, " elements (fingerprint ", LayoutFingerprint(layout), ")"));
  }
  return absl::OkStatus();
}

void JobState::PublishVerdict(int64_t t, const StepVerdict& verdict, int speculate_from_unit) {
  control_->speculate_from_unit.store(static_cast<uint32_t>(std::max(speculate_from_unit, 0)),
                                      std::memory_order_relaxed);  // (ordered by the verdict's release)
  const uint32_t w = static_cast<uint32_t>(t + 1) << 2 | (verdict.post_all ? kVerdictPostAll : 0) |
                     (verdict.speculate_next ? kVerdictSpeculateNext : 0);
  control_->clip_verdict.store(w, std::memory_order_release);
  FutexWakeAll(&control_->clip_verdict);
}

absl::StatusOr<StepVerdict> JobState::WaitVerdict(int64_t t, absl::Duration timeout,
                                                   const ProcessIdentity& hostd) const {
  const uint32_t want = static_cast<uint32_t>(t + 1);
  WaitGuards g;
  g.abort = &control_->abort;
  g.peer = hostd;
  g.peer_role = "hostd";
  RETURN_IF_ERROR(WaitForWord(
      control_->clip_verdict, [want](uint32_t w) { return (w >> 2) >= want; }, timeout, g,
      [&] { return absl::StrCat("hostd's clipping verdict on step ", want); }));
  const uint32_t w = control_->clip_verdict.load(std::memory_order_acquire);
  return StepVerdict{(w & kVerdictPostAll) != 0, (w & kVerdictSpeculateNext) != 0};
}

bool JobState::SpeculatesStep(int64_t t) const {
  const uint32_t w = control_->clip_verdict.load(std::memory_order_acquire);
  return (w >> 2) == static_cast<uint32_t>(t) && (w & kVerdictSpeculateNext) != 0;
}

bool JobState::SpeculatesUnit(int64_t t, int u) const {
  return SpeculatesStep(t) && u >= 0 &&
         static_cast<uint32_t>(u) >= control_->speculate_from_unit.load(std::memory_order_relaxed);
}

std::atomic<uint32_t>* JobState::urgent_copy_word(int rank) const {
  if (rank < 0 || rank >= kMaxUrgentCopyRanks) return nullptr;
  return &control_->urgent_copies[rank];
}

std::vector<const std::atomic<uint32_t>*> JobState::UrgentCopyWords(int world) const {
  std::vector<const std::atomic<uint32_t>*> out;
  for (int r = 0; r < std::min(world, kMaxUrgentCopyRanks); ++r) out.push_back(&control_->urgent_copies[r]);
  return out;
}

void JobState::ResetUrgentCopies() {
  for (std::atomic<uint32_t>& w : control_->urgent_copies) {
    w.store(0, std::memory_order_release);
    FutexWakeAll(&w);
  }
}

absl::StatusOr<int64_t> JobState::ConsistentStep() const {
  const std::string& name = segment_->name();
  if (num_units() == 0) return absl::FailedPreconditionError(absl::StrCat("job segment ", name, " has no units"));
  if (control_->state_written.load(std::memory_order_acquire) != 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "job segment ", name, ": its initial state (weights or checkpoint) was never completely written"));
  }
  const uint32_t v = versions_[0].Load();
  for (int u = 1; u < num_units(); ++u) {
    if (versions_[u].Load() != v) {
      return absl::FailedPreconditionError(absl::StrCat("job segment ", name, ": unit 0 is at step ", v, ", unit ", u,
                                                        " at step ", versions_[u].Load(), " (a step was half done)"));
    }
  }
  const uint64_t updating = control_->updating_step.load(std::memory_order_acquire);
  if (updating > v) {
    return absl::FailedPreconditionError(absl::StrCat("job segment ", name, ": the updates of step ", updating,
                                                      " had begun and not all finished (every unit at step ", v, ")"));
  }
  const uint64_t counted = control_->step.load(std::memory_order_acquire);
  if (counted != v && counted + 1 != v) {
    return absl::FailedPreconditionError(
        absl::StrCat("job segment ", name, ": step counter ", counted, " disagrees with the units' step ", v));
  }
  return static_cast<int64_t>(v);
}

std::string JobState::job_id() const {
  return std::string(control_->job_id, strnlen(control_->job_id, sizeof(control_->job_id)));
}

absl::Status JobState::TakeOver() {
  RETURN_IF_ERROR(segment_->TakeOwnership());
  control_->abort.Reset();
  ResetUrgentCopies();  // a dead worker's raised word must not hold the resumed job's LayerAdam
  return absl::OkStatus();
}

bool JobState::RaiseAbort(AbortReason reason) {
  const bool won = control_->abort.Raise(reason);
  for (int u = 0; u < num_units(); ++u) versions_[u].WakeAll();
  return won;
}

absl::Status JobState::PrefaultUnit(int unit) {
  if (unit < 0 || unit >= num_units()) {
    return absl::OutOfRangeError(absl::StrCat("PrefaultUnit(", unit, "): job has ", num_units(), " units"));
  }
  const UnitView& view = units_[unit];
  if (segment_->access() == Access::kReadWrite) {
    RETURN_IF_ERROR(segment_->Allocate(view.offset, view.span_bytes));
  }
  return segment_->Prefault(view.offset, view.span_bytes);
}

}  // namespace slidedp::shm
