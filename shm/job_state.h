// The authoritative training state of one job in one shared-memory segment
// "/slidedp.<node>.<job>.state": for every streamed unit (embedding, decoder layers, head) its FP32
// master weights, Adam m and v, and (unless the job casts the master at upload time,
// runtime.param_source: master) the BF16 upload mirror, plus a control block with a version
// gate per unit, the job-wide abort word and the step counter.
//
// hostd Create()s it (and later Unlink()s it when the job ends); workers Attach() by name.
// Region names: "control", "u<i>.master", "u<i>.adam_m", "u<i>.adam_v" (int8 moments: also
// "u<i>.adam_m_scale", "u<i>.adam_v_scale"), "u<i>.mirror" (when kept), each aligned to 4096
// bytes; a unit's regions are contiguous, so PrefaultUnit() touches one range.
//
// NUMA: pages land on the node of the thread that allocates them. With FirstTouch::kByOwner,
// Create allocates only the header and control block; each LayerAdam owner thread then calls
// PrefaultUnit(u) for the units it updates, before the first step.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "common/numeric/dtype.h"
#include "shm/futex.h"
#include "shm/shm_segment.h"

namespace slidedp::shm {

enum class FirstTouch {
  kAtCreate,  // Create allocates and prefaults everything (prefault_threads threads)
  kByOwner,   // owners call PrefaultUnit(u) from their own (NUMA-pinned) threads
};

// How a job keeps Adam's m and v (optimizer.state_dtype; docs/optimizer-state.md):
// kF32: "u<i>.adam_m" / "u<i>.adam_v" F32 [numel];
// kBF16: the same regions BF16 [numel];
// kInt8: "u<i>.adam_m" I8 and "u<i>.adam_v" U8 [numel] codes, with "u<i>.adam_m_scale" and
//        "u<i>.adam_v_scale" F32 [ceil(numel / kInt8MomentBlock)], one scale per block.

// What a segment holds besides the FP32 master: how m and v are kept, and whether the BF16
// mirror is (the control block records both; workers read them back).
struct StateFormat {
  MomentForm moments = MomentForm::kF32;
  bool mirror = true;
};

struct JobStateOptions {
  StateFormat format;  // Create/Reformat/Relayout
  FirstTouch first_touch = FirstTouch::kAtCreate;
  int prefault_threads = 1;
  uint64_t alignment = kPageBytes;
  std::string shm_dir = "/dev/shm";
};

// Ranks with an urgent-copy word (JobControlBlock::urgent_copies): one cache line of them. A rank
// beyond it marks nothing (its copies then get no priority over LayerAdam).
inline constexpr int kMaxUrgentCopyRanks = 16;

// Fixed part of the "control" region; num_units VersionGates follow it.
struct alignas(64) JobControlBlock {
  uint32_t num_units;
  uint32_t moment_form;  // MomentForm
  uint64_t total_numel;
  uint64_t layout_fingerprint;  // LayoutFingerprint() of the ModelLayout it was created for
  char job_id[104];
  AbortWord abort;
  alignas(64) std::atomic<uint64_t> step;  // completed optimizer steps (written by hostd)
  std::atomic<uint64_t> skipped_steps;     // of those, skipped as non-finite (train.skip_nonfinite)
  // The 1-based step whose LayerAdam updates have begun: hostd stores t+1 before the first update
  // of step t touches master, m, v or mirror. With every gate at version V and this <= V, no
  // update is under way and the state is exactly that of V steps (ConsistentStep).
  std::atomic<uint64_t> updating_step;
  // Speculative clipping (docs/layeradam.md): hostd's verdict on step t once its norm is known,
  // (t + 1) << 2 | kVerdictPostAll | kVerdictSpeculateNext (StepVerdict); before the first step
  // of an attempt, hostd stores first_step << 2 | (speculate the first step ? 2 : 0). Workers
  // wait on it (futex) after posting a step's squared norm.
  std::atomic<uint32_t> clip_verdict;
  // With the verdict: a speculated step posts the parts of units >= this during backward (written
  // before the verdict word, read after it).
  std::atomic<uint32_t> speculate_from_unit;
  uint32_t has_mirror;  // 1: every unit has its "u<i>.mirror" region; 0: none has
  // 1 once a job's initial state (random init, the model's weights or a checkpoint) is written
  // whole; 0 while it is being written (hostd clears it first). A segment left at 0 by a hostd
  // that died while loading holds no step of anything: ConsistentStep refuses it.
  std::atomic<uint32_t> state_written;
  uint8_t pad[24];
  // DMA before Adam (docs/layeradam.md): per rank, the number of its host-to-device copies in
  // flight that its GPU waits for (the worker increments before issuing them and decrements, then
  // FUTEX_WAKEs, when they finish). hostd's LayerAdam reads them (relaxed, once per block) and
  // pauses some workers while any is nonzero. Zero at Create/Relayout/Reformat/TakeOver.
  alignas(64) std::atomic<uint32_t> urgent_copies[kMaxUrgentCopyRanks];
};
static_assert(sizeof(JobControlBlock) == 320 && std::is_standard_layout_v<JobControlBlock>);
static_assert(offsetof(JobControlBlock, urgent_copies) == 256);

// hostd's verdict on a device-staged step once its gradient norm is known (speculative clipping).
struct StepVerdict {
  // Post every part of the step again (c < 1 or non-finite: the speculative updates were rolled
  // back; or the step was not speculated); otherwise only the parts of units that were not
  // posted speculatively.
  bool post_all = true;
  // Post the next step's speculative parts during its backward.
  bool speculate_next = false;
};
inline constexpr uint32_t kVerdictPostAll = 1;
inline constexpr uint32_t kVerdictSpeculateNext = 2;

// Hash of the unit count and each unit's kind and numel: a worker checks its layout matches.
uint64_t LayoutFingerprint(const ModelLayout& layout);

class JobState {
 public:
  static absl::StatusOr<std::unique_ptr<JobState>> Create(const std::string& node, const std::string& job_id,
                                                          const ModelLayout& layout,
                                                          const JobStateOptions& options = {});
  // Lays a segment this process owns (a pooled one, renamed for the job) out for `layout`, which
  // must not need more bytes than the file has: new control block (gates at version 0, no abort,
  // step 0), pages kept and mapped. Master, Adam moments and mirror hold stale data: the caller
  // initializes them. FAILED_PRECONDITION when the file is too small.
  static absl::StatusOr<std::unique_ptr<JobState>> Reformat(const std::string& segment_name, const std::string& job_id,
                                                            const ModelLayout& layout,
                                                            const JobStateOptions& options = {});
  // Reformat without remapping: `state` (a pooled segment this process keeps mapped, its file
  // already renamed to `new_name`) is laid out for `layout` through its own mapping, whose page
  // tables stay populated, so nothing is prefaulted again. Needs SegmentBytes(layout) equal to
  // the segment's size (FAILED_PRECONDITION otherwise; Reformat handles a smaller layout).
  static absl::StatusOr<std::unique_ptr<JobState>> Relayout(std::unique_ptr<JobState> state,
                                                            const std::string& new_name, const std::string& job_id,
                                                            const ModelLayout& layout,
                                                            const JobStateOptions& options = {});
  // Maps an existing job segment (workers: kReadWrite if they may raise the abort word).
  static absl::StatusOr<std::unique_ptr<JobState>> Attach(const std::string& segment_name, Access access);
  // Exact segment size Create() uses (admission control counts with it).
  static uint64_t SegmentBytes(const ModelLayout& layout, const StateFormat& format = {},
                               uint64_t alignment = kPageBytes);

  // FAILED_PRECONDITION when the segment was made for another model layout.
  absl::Status CheckMatches(const ModelLayout& layout) const;
  // The number of optimizer steps the state holds exactly, when it is consistent: every unit's
  // gate at the same version V and no update of step V+1 begun (updating_step <= V). Otherwise
  // FAILED_PRECONDITION saying why (the first unit at another version, or the step whose updates
  // were under way). What a restarted hostd checks before resuming from the segment.
  absl::StatusOr<int64_t> ConsistentStep() const;
  // The job id the segment was created for.
  std::string job_id() const;
  // Re-reads the segment's layout through this mapping after its owner re-laid it out in place
  // (a worker keeping a pooled segment mapped between jobs); the views change, the mapping not.
  absl::Status Rebind();

  int num_units() const { return static_cast<int>(units_.size()); }
  int64_t unit_numel(int unit) const { return units_[unit].numel; }
  float* master(int unit) const { return units_[unit].master; }
  // How this segment keeps m and v, and where: m(u) / v(u) are the FP32 moments (nullptr for
  // compact ones); moments(u) is every layout's view.
  MomentForm moment_form() const { return static_cast<MomentForm>(control_->moment_form); }
  float* m(int unit) const {
    return moment_form() == MomentForm::kF32 ? static_cast<float*>(units_[unit].m) : nullptr;
  }
  float* v(int unit) const {
    return moment_form() == MomentForm::kF32 ? static_cast<float*>(units_[unit].v) : nullptr;
  }
  struct Moments {
    MomentForm dtype;
    void* m;          // F32 / BF16 / I8 codes, numel of them
    void* v;          // F32 / BF16 / U8 codes
    float* m_scale;   // kInt8: one per kInt8MomentBlock elements; else nullptr
    float* v_scale;
    uint64_t bytes;   // m, v and scales together
  };
  Moments moments(int unit) const;
  // The unit's BF16 mirror; nullptr when the segment keeps none (has_mirror()).
  bf16_t* mirror(int unit) const { return units_[unit].mirror; }
  bool has_mirror() const { return control_->has_mirror != 0; }
  StateFormat format() const { return StateFormat{moment_form(), has_mirror()}; }
  VersionGate& version(int unit) const { return versions_[unit]; }
  AbortWord& abort() const { return control_->abort; }
  std::atomic<uint64_t>& step_counter() const { return control_->step; }
  std::atomic<uint64_t>& skipped_steps_counter() const { return control_->skipped_steps; }
  std::atomic<uint64_t>& updating_step() const { return control_->updating_step; }
  std::atomic<uint32_t>& state_written() const { return control_->state_written; }
  // hostd: the verdict on step t (0-based), published (release) and every waiter woken, with the
  // first unit step t + 1 speculates. Also the attempt's start: PublishVerdict(first_step - 1, ...).
  void PublishVerdict(int64_t t, const StepVerdict& verdict, int speculate_from_unit = 0);
  // Workers: waits for hostd's verdict on step t (guards: the abort word, and the liveness of
  // `hostd`, the hostd the worker's job came from: captured at the job's start, since a hostd
  // restarted meanwhile takes the segment over and owner() then names it).
  absl::StatusOr<StepVerdict> WaitVerdict(int64_t t, absl::Duration timeout, const ProcessIdentity& hostd) const;
  // Whether step t is speculated: the verdict on step t - 1 says so (false when none is published).
  bool SpeculatesStep(int64_t t) const;
  // Whether step t posts unit u's part speculatively: SpeculatesStep(t) and u >= the first unit
  // published with that verdict.
  bool SpeculatesUnit(int64_t t, int u) const;
  // DMA before Adam: rank's urgent-copy word (null for a rank outside [0, kMaxUrgentCopyRanks)),
  // and the words of ranks [0, world) that exist, for LayerAdam::SetCopyPriority.
  std::atomic<uint32_t>* urgent_copy_word(int rank) const;
  std::vector<const std::atomic<uint32_t>*> UrgentCopyWords(int world) const;
  // Zeroes every rank's word and wakes its waiters (a job's start: no worker of the job runs).
  void ResetUrgentCopies();
  // hostd (the creator): the process that publishes versions, for liveness checks in waits.
  ProcessIdentity owner() const { return segment_->creator(); }

  // Raises the abort word and wakes every version waiter at once (not just at its next slice).
  bool RaiseAbort(AbortReason reason);
  // A restarted hostd resuming the job from this segment (its creator died): this process becomes
  // its owner (the publisher workers check for liveness) and the abort word is cleared. Only
  // while no worker of the job runs.
  absl::Status TakeOver();
  // Allocates (fallocate, from this thread's NUMA node) and maps the unit's regions.
  absl::Status PrefaultUnit(int unit);

  const std::string& segment_name() const { return segment_->name(); }
  uint64_t bytes() const { return segment_->bytes(); }
  ShmSegment& segment() const { return *segment_; }
  absl::Status Unlink() { return segment_->Unlink(); }

 private:
  struct UnitView {
    int64_t numel = 0;
    uint64_t offset = 0;  // of master; the unit's regions are contiguous from there
    uint64_t span_bytes = 0;
    float* master = nullptr;
    void* m = nullptr;
    void* v = nullptr;
    float* m_scale = nullptr;
    float* v_scale = nullptr;
    uint64_t moment_bytes = 0;
    bf16_t* mirror = nullptr;
  };
  explicit JobState(std::unique_ptr<ShmSegment> segment) : segment_(std::move(segment)) {}
  // The creator's part after the segment exists: control block, gates, views, first touch.
  static absl::StatusOr<std::unique_ptr<JobState>> Initialize(std::unique_ptr<ShmSegment> seg,
                                                              const std::string& job_id, const ModelLayout& layout,
                                                              const JobStateOptions& options);
  absl::Status BindViews();

  std::unique_ptr<ShmSegment> segment_;
  JobControlBlock* control_ = nullptr;
  VersionGate* versions_ = nullptr;
  std::vector<UnitView> units_;
};

}  // namespace slidedp::shm
