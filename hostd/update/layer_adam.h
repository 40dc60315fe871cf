// LayerAdam: the host's AdamW engine. A pool of update workers ("adam-N"), each pinned with hwloc
// to one core of a NUMA node, applies the fused AdamW + BF16-mirror step (adamw_kernels.h) to
// gradient chunks of units (embedding, decoder layers, head) whose state lives on that node.
//
// Two ways a job drives it (docs/layeradam.md has the numbers):
//  - no clipping: each chunk is submitted as soon as its gradient lands in the ring; the ring
//    slot is freed from the chunk's `done`; a unit's version gate is published when UnitTracker
//    says all its chunks for the step are applied. Staging costs only the ring.
//  - exact global-norm clipping: the coefficient needs the norm of the whole step's gradient, so
//    every chunk is staged (2 B/param in BF16, 4 in FP32) while GradNormAccumulator sums squares;
//    once the norm is known the caller submits the units in forward order with
//    grad_scale = ClipCoefficient(norm, max_norm), so step t+1's forward can start on the first
//    layers while the last ones are still updating. Each node's queue is FIFO: submission order is
//    execution order.
//
// Threading: SubmitChunk may be called from any thread; `done` runs on a worker thread and must be
// short (it may call SubmitChunk). Chunks of one unit must not overlap while in flight.
// RunOnEachWorker runs a function on every worker at once (bench_layeradam's same-thread triad).
//
// DMA before Adam (docs/layeradam.md): SetCopyPriority installs a job's "urgent copy" words (one
// per rank, in shared memory; nonzero while that rank has a host-to-device copy in flight that the
// GPU waits for). While one is raised, a fraction of each node's workers pause between cache-sized
// blocks of their piece, leaving the memory bandwidth to the copy; each pause is bounded.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"
#include "common/numeric/bf16.h"
#include "hostd/update/adamw_kernels.h"
#include "hostd/update/adamw_state.h"

namespace slidedp::update {

// Whether AdamW's decoupled weight decay (theta *= 1 - lr*wd) applies to a tensor: optimizer.no_decay
// exempts norm weights and biases, as HF's Trainer does (weight_decay.h). kNone is the step of a
// torch.optim.AdamW parameter group with weight_decay 0, bit for bit (f32(1 - lr*0) is 1).
enum class WeightDecay { kApply, kNone };

// Elements [begin, end) of a unit that hold one tensor's parameters, and whether weight decay
// applies to them.
struct ElementRange {
  int64_t begin = 0;
  int64_t end = 0;
  WeightDecay decay = WeightDecay::kApply;
};

// The optimizer state of one unit: parallel arrays of numel elements (master, m, v or their
// compact forms, mirror: pointers into the job's shared-memory state) and the NUMA node (hwloc
// logical index) whose workers update it.
struct UnitMemory {
  float* master = nullptr;
  float* m = nullptr;  // FP32 moments (moments kFp32); unused otherwise
  float* v = nullptr;
  bf16_t* mirror = nullptr;  // nullptr: the job keeps no BF16 mirror (runtime.param_source master)
  int64_t numel = 0;
  int numa_node = 0;
  // Compact Adam moments (optimizer.state_dtype; adamw_state.h, docs/optimizer-state.md): BF16 in
  // `bf16`, or int8 codes and per-256 scales in `int8` (element 0 of the unit is block 0's first).
  // Int8 chunks start on a block boundary and end on one or at the unit's end, and are split at
  // block boundaries. Undo copies (speculative clipping) keep the same form (UndoMemory).
  MomentForm moments = MomentForm::kF32;
  Bf16Moments bf16{};
  Int8Moments int8{};
  // BF16 moments: the global index of the unit's element 0 (its offset in the whole model), so the
  // stochastic rounding of v depends on the element, never on how the work was split.
  int64_t first_index = 0;
  // The unit's tensors (sorted by begin, disjoint, inside [0, numel)): an update writes only these
  // elements, never the alignment padding between tensors (ModelLayout aligns each tensor to 256
  // elements), whatever the gradient and hyper-parameters hold there; each range's `decay` says
  // whether AdamWStepParams::weight_decay applies to it. Empty: every element is a parameter, all
  // decayed. The ranges must outlive every update of the unit.
  absl::Span<const ElementRange> tensors = {};
};

// AdamWStepParams::nonfinite_grad = kRefuse: a chunk whose gradient holds a NaN or inf completes
// with DATA_LOSS carrying this payload, "<element offset in the unit> <the value's bits, hex>"
// (NonFiniteGradOf parses it). The checked kernels stop before that element: its piece is
// updated up to it, nothing of the piece from it on; other pieces of the chunk run to their end
// or their own non-finite element.
inline constexpr char kNonFiniteGradPayload[] = "slidedp.update.NonFiniteGrad";
struct NonFiniteGradElement {
  int64_t offset = 0;
  float value = 0;
};
std::optional<NonFiniteGradElement> NonFiniteGradOf(const absl::Status& status);

// Speculative updates (exact clipping overlapped with backward, docs/layeradam.md): an undo copy
// of a unit's master, m and v, laid out as the unit's own (element i of the unit at index i; int8
// codes likewise and block k's scales at index k), written by UndoMode::kSave before an update
// overwrites them and read back by kRedo / kRestore. Only the unit's tensor elements are copied
// (never the padding between tensors). `moments` must be the unit's (UnitMemory::moments).
struct UndoMemory {
  float* master = nullptr;
  float* m = nullptr;  // FP32 moments
  float* v = nullptr;
  MomentForm moments = MomentForm::kF32;
  Bf16Moments bf16{};
  Int8Moments int8{};
};

enum class UndoMode {
  kNone,
  kSave,  // copy the chunk's master, m, v into the undo copy, then update (block by block)
  kRedo,  // copy them back from the undo copy, then update: the update of the saved state
};

// A gradient range an update reads: FP32, or BF16 (runtime.grad_dtype bf16; widened exactly).
// Converts implicitly from either pointer type.
struct GradPtr {
  const void* data = nullptr;
  bool bf16 = false;
  GradPtr() = default;
  GradPtr(const float* f) : data(f) {}               // NOLINT(google-explicit-constructor)
  GradPtr(const bf16_t* b) : data(b), bf16(true) {}  // NOLINT(google-explicit-constructor)
  const float* f32() const { return bf16 ? nullptr : static_cast<const float*>(data); }
  const bf16_t* b16() const { return bf16 ? static_cast<const bf16_t*>(data) : nullptr; }
};

enum class WorkerPinning {
  kCore,      // each worker bound to one physical core of its node (default)
  kNumaNode,  // each worker bound to all cores of its node
  kNone,      // no binding (tests on shared machines)
};

enum class MirrorStore { kStreaming, kCached };

struct LayerAdamOptions {
  // Number of update workers; 0 = default: every physical core the process may use minus
  // reserve_cores (at least 1). More workers than cores is allowed (cores are then shared).
  int num_threads = 0;
  // Cores left to the rest of the host (hostd's control plane, the GPU workers' issuing threads);
  // -1 = default: 2 with >= 8 cores, 1 with 4-7, 0 below. Reserved cores are the first cores of
  // NUMA node 0 (where the kernel's housekeeping usually runs).
  int reserve_cores = -1;
  WorkerPinning pinning = WorkerPinning::kCore;
  // A submitted chunk is split into at most one piece per worker of its node, none smaller than
  // this (scheduling overhead stays negligible against ~1 ns/param of work).
  int64_t min_piece_numel = 1 << 15;
  // Kernel ISA; unset = ActiveAdamIsa(). An unsupported ISA fails Create.
  std::optional<AdamIsa> isa;
  // Streaming (non-temporal) or cached stores for the BF16 mirror (AdamWConstants::stream_mirror).
  MirrorStore mirror_store = MirrorStore::kStreaming;
};

// The number of a node's `workers` that pause while an urgent copy is in flight at
// `yield_fraction` (in [0, 1]): round(yield_fraction * workers), at most workers - 1 (one keeps
// running) unless yield_fraction is 1.
int YieldingWorkers(int workers, double yield_fraction);

class LayerAdam {
 public:
  using DoneFn = std::function<void(absl::Status)>;

  // Reads the hwloc topology and starts the workers.
  static absl::StatusOr<std::unique_ptr<LayerAdam>> Create(const LayerAdamOptions& options);
  // Stops the workers cooperatively: pieces already running finish; queued chunks complete with
  // CANCELLED. Every accepted chunk's `done` runs exactly once before the destructor returns.
  ~LayerAdam();
  LayerAdam(const LayerAdam&) = delete;
  LayerAdam& operator=(const LayerAdam&) = delete;

  int num_threads() const { return static_cast<int>(workers_.size()); }
  int num_numa_nodes() const { return static_cast<int>(nodes_.size()); }
  int workers_on_node(int numa_node) const;
  AdamIsa isa() const { return isa_; }

  // Chooses a NUMA node for each unit: greedily the node with the fewest bytes per worker so far
  // (round-robin by bytes), among nodes that have workers.
  std::vector<int> AssignNumaNodes(const std::vector<int64_t>& unit_bytes) const;

  // Has the unit's node workers touch every page of its four arrays (reading and writing back
  // each page's first word, so contents are kept), so pages not yet faulted are placed on that
  // node. With more than one NUMA node the range is also bound there (hwloc membind, migrating
  // pages already placed; best effort, logged on failure). Call before the unit is in use;
  // blocks until done.
  absl::Status FirstTouch(const UnitMemory& unit);

  // Applies one AdamW step to elements [offset, offset + numel) of `unit` with `grad` (numel
  // elements, read until `done` runs). Returns INVALID_ARGUMENT (and never calls `done`) for a
  // bad range, null pointers, a bad node or a non-positive step; FAILED_PRECONDITION after
  // shutdown started. Otherwise `done` runs exactly once, on a worker thread, with OK once every
  // element is updated, CANCELLED if the engine stopped first, or with params.nonfinite_grad
  // kRefuse DATA_LOSS (kNonFiniteGradPayload) when the gradient holds a NaN or inf.
  // With `undo` (and mode kSave or kRedo) each block of the chunk is first copied into (kSave) or
  // back from (kRedo) the undo copy, in cache-sized blocks, on the same worker that updates it.
  absl::Status SubmitChunk(const UnitMemory& unit, int64_t offset, int64_t numel, const float* grad,
                           const AdamWStepParams& params, DoneFn done, const UndoMemory* undo = nullptr,
                           UndoMode mode = UndoMode::kNone);
  // Copies elements [offset, offset + numel) of master, m and v back from `undo` and rewrites the
  // mirror from the restored master (FloatToBf16, as every update and the initial load write it):
  // the state before a kSave update, bit for bit. `done` as SubmitChunk's.
  absl::Status SubmitRestore(const UnitMemory& unit, int64_t offset, int64_t numel, const UndoMemory& undo,
                             DoneFn done);
  // As SubmitChunk with a BF16 gradient (runtime.grad_dtype bf16), widened exactly to FP32.
  absl::Status SubmitChunkBf16(const UnitMemory& unit, int64_t offset, int64_t numel, const bf16_t* grad,
                               const AdamWStepParams& params, DoneFn done, const UndoMemory* undo = nullptr,
                               UndoMode mode = UndoMode::kNone);
  // SubmitChunk or SubmitChunkBf16, as `grad` says.
  absl::Status SubmitGrad(const UnitMemory& unit, int64_t offset, int64_t numel, GradPtr grad,
                          const AdamWStepParams& params, DoneFn done, const UndoMemory* undo = nullptr,
                          UndoMode mode = UndoMode::kNone) {
    return Submit(grad.bf16 ? TaskKind::kStepBf16 : TaskKind::kStepF32, unit, offset, numel, grad.data, params,
                  std::move(done), undo, mode);
  }

  // As SubmitGrad without an undo copy, also summing the gradient's squares for the global norm
  // as it updates (no pass of its own over the gradient): block_squares[k] receives the sum of
  // squares of the chunk's block k on the norm grid (grad_norm.h: NormBlockSquares' bits, padding
  // between tensors included), NormBlockCount(offset, numel) doubles that stay valid until `done`.
  // Each block's sum is formed before the block is updated, so a non-finite block (its sum is not
  // finite) is found first: with params.nonfinite_grad kRefuse nothing of it is written (DATA_LOSS
  // as SubmitChunk's, naming its first non-finite element, padding included); with kApply it is
  // updated as PyTorch does. Pieces split at grid blocks.
  absl::Status SubmitGradSquared(const UnitMemory& unit, int64_t offset, int64_t numel, GradPtr grad,
                                 const AdamWStepParams& params, double* block_squares, DoneFn done);

  // Blocks until every chunk accepted so far has completed (its `done` has returned).
  void WaitIdle();

  // Runs fn(worker, num_workers(), numa_node) once on every worker thread ("adam-<worker>", bound
  // as LayerAdamOptions::pinning says; numa_node is its node's hwloc logical index), all at the
  // same time: each worker takes the call before any queued chunk piece once the piece it is
  // running ends, and none starts fn before all have taken it. Returns when every fn has returned.
  // For measuring on the engine's own threads (a memory-bandwidth reference: bench_layeradam's
  // triad); chunks submitted meanwhile wait in their queues and run afterwards. Calls are
  // serialized. fn must not wait for chunks (WaitIdle, a chunk's completion): the workers are all
  // in it. FAILED_PRECONDITION from a worker thread (a `done` or fn itself: it would wait for
  // itself) and after shutdown started.
  absl::Status RunOnEachWorker(absl::FunctionRef<void(int worker, int num_workers, int numa_node)> fn);

  // DMA before Adam: from now on, while any of `urgent_words` is nonzero, YieldingWorkers(n,
  // yield_fraction) of each node's n workers pause before each block (kYieldBlockNumel elements)
  // of a piece: they wait on the words (futex, kYieldSlice at a time) until all are zero or
  // max_pause has passed since the pause began, then run at least one block before pausing
  // again, so a word left raised (its writer died) slows the engine but never stalls it. Pausing
  // changes timing only: results are bit-identical. The words are read until ClearCopyPriority
  // (or the next SetCopyPriority) and must stay mapped until then; pieces under way when either
  // is called finish with the words they started with, so call both while none of the caller's
  // chunks is in flight (a job's start and end). Empty words or yield_fraction 0: off.
  // INVALID_ARGUMENT for a yield_fraction outside [0, 1], a null word or a non-positive max_pause.
  absl::Status SetCopyPriority(absl::Span<const std::atomic<uint32_t>* const> urgent_words, double yield_fraction,
                               absl::Duration max_pause = absl::Milliseconds(2));
  void ClearCopyPriority();
  // Total time workers spent paused for urgent copies (summed over workers), and how many are
  // paused now (tests, metrics).
  double paused_s() const { return static_cast<double>(paused_ns_.load(std::memory_order_relaxed)) * 1e-9; }
  int workers_paused() const { return workers_paused_.load(std::memory_order_relaxed); }

  // Pieces run in blocks of this many elements while copy priority is on: a check of the words
  // per ~20-50 us of work (3 x 32 KiB of master, m, v), and the latency of a yield.
  static constexpr int64_t kYieldBlockNumel = 8192;
  static constexpr absl::Duration kYieldSlice = absl::Microseconds(200);

 private:
  enum class TaskKind { kStepF32, kStepBf16, kTouch, kRestore };
  struct ChunkState;
  struct EachWorkerCall;
  struct CopyPriority;  // immutable once installed
  class BlockPacer;     // one per worker: pauses between blocks
  struct Task {
    TaskKind kind;
    UnitMemory unit;
    int64_t offset;  // element range within the unit (for kTouch: of all four arrays)
    int64_t numel;
    const void* grad;  // first element of this piece
    AdamWConstants constants;
    NonFiniteGrad nonfinite;
    ChunkState* chunk;  // from chunk_pool_; back there when its last piece finishes
    UndoMemory undo;
    UndoMode undo_mode;
    double* squares;              // SubmitGradSquared: the chunk's block sums, else nullptr
    int64_t squares_first_block;  // the grid index of squares[0]
    StochasticRounding rounding;  // BF16 moments: seed and Adam step (first_index per part)
  };
  struct NodeQueue {
    absl::Mutex mu;
    // FIFO: tasks[head, end). The storage stays as the queue drains, so a step's pieces allocate
    // nothing once the queue has been as deep as it gets (a deque allocates a node every two tasks
    // on the submitting thread and frees it on a worker: heap growth, so page faults, for steps).
    std::vector<Task> tasks ABSL_GUARDED_BY(mu);
    size_t head ABSL_GUARDED_BY(mu) = 0;
    bool stopping ABSL_GUARDED_BY(mu) = false;
    // RunOnEachWorker's mailboxes, one per worker of the node (WorkerSpec::slot): a worker takes
    // its call before the shared tasks, so one busy node cannot hold the others at the barrier
    // behind a queue of chunks.
    std::vector<std::shared_ptr<EachWorkerCall>> calls ABSL_GUARDED_BY(mu);
    int num_workers = 0;
  };
  struct WorkerSpec {
    int node;            // NodeQueue index
    int slot;            // the worker's index among its node's workers (its mailbox)
    std::string cpuset;  // hwloc bitmap list string to bind to; empty = no binding
  };

  LayerAdam() = default;
  absl::Status Submit(TaskKind kind, const UnitMemory& unit, int64_t offset, int64_t numel,
                      const void* grad, const AdamWStepParams& params, DoneFn done, const UndoMemory* undo = nullptr,
                      UndoMode undo_mode = UndoMode::kNone, double* block_squares = nullptr);
  int QueueFor(int numa_node) const;
  void WorkerLoop(int index, WorkerSpec spec);
  void RunEachWorkerCall(EachWorkerCall& call, int index, int node);
  absl::Status RunTask(const Task& task, BlockPacer& pacer);
  template <typename G>
  absl::Status RunStep(const Task& task, const G* grad, BlockPacer& pacer);
  template <typename G>
  absl::Status RunStepSquared(const Task& task, const G* grad, BlockPacer& pacer);
  // One part of a step, [b, b + n) of the unit (inside one tensor, whose weight decay is `decay`)
  // with its gradient g: the kernel of the unit's moment layout; with `checked`, the index of a
  // refused non-finite element (within the part), else -1.
  template <typename G>
  int64_t StepPart(const Task& task, int64_t b, int64_t n, WeightDecay decay, const G* g, bool checked) const;
  std::shared_ptr<const CopyPriority> copy_priority() const;
  void FinishPiece(ChunkState* chunk, const absl::Status& status);

  AdamIsa isa_ = AdamIsa::kScalar;
  const AdamKernelTable* kernels_ = nullptr;
  const AdamStateKernelTable* state_kernels_ = nullptr;
  int64_t min_piece_numel_ = 1;
  bool stream_mirror_ = true;
  void* topology_ = nullptr;  // hwloc_topology_t, kept for binding (opaque to keep hwloc.h private)
  std::vector<std::unique_ptr<NodeQueue>> nodes_;
  std::vector<int> queue_of_node_;  // NUMA node -> queue index holding workers
  std::vector<std::thread> workers_;

  // Chunk records, recycled rather than freed for the same reason as NodeQueue::tasks' storage:
  // taken by the submitting thread, given back by whichever worker finishes the chunk.
  absl::Mutex pool_mu_;
  std::vector<std::unique_ptr<ChunkState>> chunk_pool_ ABSL_GUARDED_BY(pool_mu_);

  absl::Mutex idle_mu_;
  int64_t chunks_in_flight_ ABSL_GUARDED_BY(idle_mu_) = 0;
  bool shutting_down_ ABSL_GUARDED_BY(idle_mu_) = false;
  // Held for the whole of a RunOnEachWorker call (one at a time, each mailbox holds one call);
  // the destructor takes it after setting shutting_down_, so it never stops the workers under a
  // call that is waiting for them.
  absl::Mutex each_worker_mu_;

  // Taken by each worker once per piece (a piece is >= min_piece_numel of work: the lock is noise).
  mutable absl::Mutex priority_mu_;
  std::shared_ptr<const CopyPriority> priority_ ABSL_GUARDED_BY(priority_mu_);
  std::atomic<int64_t> paused_ns_{0};
  std::atomic<int> workers_paused_{0};
};

// Physical cores per NUMA node (hwloc logical order) that this process may run on.
absl::StatusOr<std::vector<int>> CoresPerNumaNode();
// The default worker count for `cores` physical cores (see LayerAdamOptions::reserve_cores).
int DefaultUpdateThreads(int cores, int reserve_cores = -1);

}  // namespace slidedp::update
