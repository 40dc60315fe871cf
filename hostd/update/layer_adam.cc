// LayerAdam engine: hwloc topology -> per-NUMA-node FIFO queues and pinned workers; chunks split
// into per-worker pieces; completion counted per chunk (records recycled, queues' storage kept:
// no allocation per chunk in the steady state); per-worker mailboxes for RunOnEachWorker.
#include "hostd/update/layer_adam.h"

#include <hwloc.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/update/grad_norm.h"
#include "shm/futex.h"

namespace slidedp::update {

struct LayerAdam::ChunkState {
  std::atomic<int> remaining{0};
  DoneFn done;
  absl::Mutex mu;
  absl::Status status ABSL_GUARDED_BY(mu);
};

// One RunOnEachWorker call, shared by the caller and the workers (shared_ptr: the last worker may
// still be unlocking `mu` when the caller, woken by it, returns).
struct LayerAdam::EachWorkerCall {
  EachWorkerCall(absl::FunctionRef<void(int, int, int)> f, int n) : fn(f), num_workers(n) {}
  absl::FunctionRef<void(int, int, int)> fn;  // callable until `finished` reaches num_workers
  const int num_workers;
  absl::Mutex mu;
  int arrived ABSL_GUARDED_BY(mu) = 0;
  int finished ABSL_GUARDED_BY(mu) = 0;
};

// What SetCopyPriority installed: immutable, shared by the workers' pacers.
struct LayerAdam::CopyPriority {
  std::vector<const std::atomic<uint32_t>*> words;
  std::vector<int> yielders;  // per NodeQueue: how many of its workers pause (the highest slots)
  absl::Duration max_pause;
};

// A worker's side of copy priority: whether it is one of its node's yielding workers under the
// configuration in force for its current piece, and the pause between blocks.
class LayerAdam::BlockPacer {
 public:
  BlockPacer(LayerAdam& engine, int queue, int slot, int queue_workers)
      : engine_(engine), queue_(queue), slot_(slot), queue_workers_(queue_workers) {}

  // Before each piece: the configuration it runs under (the words stay mapped until the caller
  // clears it, which it does only with none of its chunks in flight).
  void StartPiece() {
    config_ = engine_.copy_priority();
    active_ = config_ != nullptr && slot_ >= queue_workers_ - config_->yielders[queue_];
  }
  bool active() const { return active_; }

  // Before each block of the piece: pauses while an urgent copy is in flight (bounded), unless
  // the previous block was preceded by a pause.
  void BeforeBlock() {
    if (!active_) return;
    if (just_paused_) {
      just_paused_ = false;
      return;
    }
    const std::atomic<uint32_t>* raised = FirstRaised();
    if (raised == nullptr) return;
    engine_.workers_paused_.fetch_add(1, std::memory_order_relaxed);
    const absl::Time start = absl::Now();
    const absl::Time deadline = start + config_->max_pause;
    while (raised != nullptr) {
      const absl::Time now = absl::Now();
      if (now >= deadline) break;
      // The word's writer wakes it when it drops to zero; the slice bounds a missed wake-up.
      if (const uint32_t v = raised->load(std::memory_order_acquire); v != 0) {
        shm::FutexWait(raised, v, std::min(kYieldSlice, deadline - now));
      }
      raised = FirstRaised();
    }
    engine_.paused_ns_.fetch_add(absl::ToInt64Nanoseconds(absl::Now() - start), std::memory_order_relaxed);
    engine_.workers_paused_.fetch_sub(1, std::memory_order_relaxed);
    just_paused_ = true;
  }

 private:
  const std::atomic<uint32_t>* FirstRaised() const {
    for (const std::atomic<uint32_t>* w : config_->words) {
      if (w->load(std::memory_order_relaxed) != 0) return w;
    }
    return nullptr;
  }

  LayerAdam& engine_;
  const int queue_, slot_, queue_workers_;
  std::shared_ptr<const CopyPriority> config_;
  bool active_ = false;
  bool just_paused_ = false;
};

namespace {

// The unit's mirror from element b, or nullptr when the state keeps none (param_source master).
bf16_t* MirrorOf(const UnitMemory& u, int64_t b) { return u.mirror != nullptr ? u.mirror + b : nullptr; }

// The engine whose worker this thread is (null on other threads): RunOnEachWorker refuses to be
// called where it would wait for its own caller.
thread_local const LayerAdam* worker_of_engine = nullptr;

// Pieces start on multiples of this many elements (a cache line of master/m/v is 16 elements,
// of the mirror 32), so two workers never write the same cache line.
constexpr int64_t kPieceAlignNumel = 64;

struct NodeCores {
  hwloc_obj_t node = nullptr;
  std::vector<hwloc_obj_t> cores;  // physical cores (or PUs where hwloc reports no cores)
};

// Cores grouped by the NUMA node whose cpuset they fall in (first match), in logical order.
std::vector<NodeCores> GroupCoresByNode(hwloc_topology_t topo) {
  const int num_nodes = std::max(1, hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE));
  std::vector<NodeCores> nodes(num_nodes);
  for (int i = 0; i < num_nodes; ++i) {
    nodes[i].node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, i);
  }
  hwloc_obj_type_t core_type = HWLOC_OBJ_CORE;
  if (hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_CORE) <= 0) core_type = HWLOC_OBJ_PU;
  const int num_cores = hwloc_get_nbobjs_by_type(topo, core_type);
  for (int c = 0; c < num_cores; ++c) {
    hwloc_obj_t core = hwloc_get_obj_by_type(topo, core_type, c);
    int owner = 0;
    for (int i = 0; i < num_nodes; ++i) {
      if (nodes[i].node != nullptr && nodes[i].node->cpuset != nullptr &&
          hwloc_bitmap_intersects(core->cpuset, nodes[i].node->cpuset)) {
        owner = i;
        break;
      }
    }
    nodes[owner].cores.push_back(core);
  }
  return nodes;
}

std::string BitmapString(hwloc_const_bitmap_t set) {
  char* s = nullptr;
  if (hwloc_bitmap_asprintf(&s, set) < 0 || s == nullptr) return "";
  std::string out(s);
  std::free(s);
  return out;
}

// Touches the first byte of every page overlapping [begin, begin + bytes) with an atomic no-op
// RMW: faults the page in (placing it) without changing contents or racing a neighbour piece.
void TouchPages(void* begin, int64_t bytes) {
  if (begin == nullptr || bytes <= 0) return;
  static const int64_t kPage = sysconf(_SC_PAGESIZE);
  auto* p = static_cast<unsigned char*>(begin);
  unsigned char* end = p + bytes;
  __atomic_fetch_or(p, 0, __ATOMIC_RELAXED);
  auto next = (reinterpret_cast<uintptr_t>(p) / kPage + 1) * kPage;
  for (unsigned char* q = reinterpret_cast<unsigned char*>(next); q < end; q += kPage) {
    __atomic_fetch_or(q, 0, __ATOMIC_RELAXED);
  }
}

// Calls fn(begin, numel, decay) for each part of [offset, offset + numel) that lies inside one of
// the unit's tensors, in order, with that tensor's weight decay: the padding between tensors is
// never handed to a kernel (with eps 0 a zero gradient there would make 0/0 = NaN; weight decay
// would scale whatever it holds). fn returns a status; the first error stops the walk.
template <typename Fn>
absl::Status ForEachTensorPart(absl::Span<const ElementRange> tensors, int64_t offset, int64_t numel, Fn&& fn) {
  const int64_t end = offset + numel;
  if (tensors.empty()) return numel > 0 ? fn(offset, numel, WeightDecay::kApply) : absl::OkStatus();
  // The first tensor ending after `offset` (units have a handful of tensors per piece).
  auto it = std::upper_bound(tensors.begin(), tensors.end(), offset,
                             [](int64_t o, const ElementRange& r) { return o < r.end; });
  for (; it != tensors.end() && it->begin < end; ++it) {
    const int64_t b = std::max(offset, it->begin);
    const int64_t e = std::min(end, it->end);
    if (e > b) {
      if (absl::Status s = fn(b, e - b, it->decay); !s.ok()) return s;
    }
  }
  return absl::OkStatus();
}

// Undo copies are made in blocks of this many elements (3 x 32 KiB: the block is still in L2
// when the update reads it).
constexpr int64_t kUndoBlockNumel = 8192;

// A unit's state, or its undo copy, as one view: the master and the moments in either form.
struct StateView {
  float* master;
  StateDtype moments;
  float* m;
  float* v;
  Bf16Moments bf16;
  Int8Moments int8;
};
StateView ViewOf(const UnitMemory& u) { return {u.master, u.moments, u.m, u.v, u.bf16, u.int8}; }
StateView ViewOf(const UndoMemory& d) { return {d.master, d.moments, d.m, d.v, d.bf16, d.int8}; }

// Whether the view's master and every array of its moment form are set.
bool StateSet(const StateView& s) {
  if (s.master == nullptr) return false;
  switch (s.moments) {
    case StateDtype::kFp32: return s.m != nullptr && s.v != nullptr;
    case StateDtype::kBf16: return s.bf16.m != nullptr && s.bf16.v != nullptr;
    case StateDtype::kInt8:
      return s.int8.m_codes != nullptr && s.int8.v_codes != nullptr && s.int8.m_scales != nullptr &&
             s.int8.v_scales != nullptr;
  }
  return false;
}

// Elements [b, b + n) of master, m and v from `from` to `to` (both of one moment form; with int8
// moments b is a block boundary and the scales of the blocks the range touches go too). The
// master (and FP32 moments) go through `copy` (streaming stores for a save: it is read back only
// on a rollback), the compact moments through memcpy.
template <typename CopyF32>
void CopyState(const StateView& from, const StateView& to, int64_t b, int64_t n, CopyF32 copy) {
  copy(from.master + b, to.master + b, n);
  switch (from.moments) {
    case StateDtype::kFp32:
      copy(from.m + b, to.m + b, n);
      copy(from.v + b, to.v + b, n);
      return;
    case StateDtype::kBf16:
      std::memcpy(to.bf16.m + b, from.bf16.m + b, n * sizeof(bf16_t));
      std::memcpy(to.bf16.v + b, from.bf16.v + b, n * sizeof(bf16_t));
      return;
    case StateDtype::kInt8: {
      std::memcpy(to.int8.m_codes + b, from.int8.m_codes + b, n);
      std::memcpy(to.int8.v_codes + b, from.int8.v_codes + b, n);
      const int64_t k = b / kInt8StateBlock, blocks = Int8StateBlocks(n);
      std::memcpy(to.int8.m_scales + k, from.int8.m_scales + k, blocks * sizeof(float));
      std::memcpy(to.int8.v_scales + k, from.int8.v_scales + k, blocks * sizeof(float));
      return;
    }
  }
}
void CopyState(const StateView& from, const StateView& to, int64_t b, int64_t n) {
  CopyState(from, to, b, n, [](const float* src, float* dst, int64_t k) { std::memcpy(dst, src, k * sizeof(float)); });
}

absl::Status NonFiniteGradError(int64_t offset, float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  absl::Status s = absl::DataLossError(
      absl::StrCat("LayerAdam: gradient element ", offset, " of the unit is ", value, "; not applied from it on"));
  s.SetPayload(kNonFiniteGradPayload, absl::Cord(absl::StrCat(offset, " ", absl::Hex(bits))));
  return s;
}

float GradValue(float g) { return g; }
float GradValue(bf16_t g) { return Bf16ToFloat(g); }

}  // namespace

int YieldingWorkers(int workers, double yield_fraction) {
  if (workers <= 0 || !(yield_fraction > 0)) return 0;
  if (yield_fraction >= 1) return workers;
  const int k = std::max<int>(1, static_cast<int>(std::lround(yield_fraction * workers)));
  return std::min(k, workers - 1);
}

int DefaultUpdateThreads(int cores, int reserve_cores) {
  if (reserve_cores < 0) reserve_cores = cores >= 8 ? 2 : (cores >= 4 ? 1 : 0);
  return std::max(1, cores - reserve_cores);
}

absl::StatusOr<std::vector<int>> CoresPerNumaNode() {
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0 || hwloc_topology_load(topo) != 0) {
    return absl::InternalError("hwloc: cannot load the machine topology");
  }
  std::vector<int> out;
  for (const NodeCores& n : GroupCoresByNode(topo)) out.push_back(static_cast<int>(n.cores.size()));
  hwloc_topology_destroy(topo);
  return out;
}

absl::StatusOr<std::unique_ptr<LayerAdam>> LayerAdam::Create(const LayerAdamOptions& options) {
  std::unique_ptr<LayerAdam> engine(new LayerAdam());
  engine->isa_ = options.isa.value_or(ActiveAdamIsa());
  engine->kernels_ = AdamKernelsFor(engine->isa_);
  engine->state_kernels_ = AdamStateKernelsFor(engine->isa_);
  if (engine->kernels_ == nullptr || engine->state_kernels_ == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("LayerAdam: ISA ", AdamIsaName(engine->isa_), " is not supported by this CPU"));
  }
  if (options.num_threads < 0 || options.min_piece_numel <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("LayerAdam: num_threads (", options.num_threads,
                                                   ") must be >= 0 and min_piece_numel (", options.min_piece_numel,
                                                   ") > 0"));
  }
  engine->min_piece_numel_ = options.min_piece_numel;
  engine->stream_mirror_ = options.mirror_store == MirrorStore::kStreaming;

  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) return absl::InternalError("hwloc_topology_init failed");
  engine->topology_ = topo;  // destroyed by ~LayerAdam from here on
  if (hwloc_topology_load(topo) != 0) return absl::InternalError("hwloc_topology_load failed");
  std::vector<NodeCores> nodes = GroupCoresByNode(topo);

  // Usable cores in placement order: node by node round-robin, after dropping the reserve from the
  // front of node 0.
  int total_cores = 0;
  for (const NodeCores& n : nodes) total_cores += static_cast<int>(n.cores.size());
  if (total_cores == 0) return absl::InternalError("hwloc reports no cores");
  int reserve = options.reserve_cores;
  if (reserve < 0) reserve = total_cores >= 8 ? 2 : (total_cores >= 4 ? 1 : 0);
  reserve = std::min(reserve, total_cores - 1);
  const int num_threads = options.num_threads > 0 ? options.num_threads : DefaultUpdateThreads(total_cores, reserve);
  std::vector<std::vector<hwloc_obj_t>> usable(nodes.size());
  int dropped = 0;
  for (size_t i = 0; i < nodes.size(); ++i) {
    for (hwloc_obj_t core : nodes[i].cores) {
      if (dropped < reserve) {
        ++dropped;
        continue;
      }
      usable[i].push_back(core);
    }
  }
  std::vector<std::pair<int, hwloc_obj_t>> order;  // (node, core), round-robin over nodes
  for (size_t k = 0;; ++k) {
    bool any = false;
    for (size_t i = 0; i < usable.size(); ++i) {
      if (k < usable[i].size()) {
        order.emplace_back(static_cast<int>(i), usable[i][k]);
        any = true;
      }
    }
    if (!any) break;
  }
  if (num_threads > static_cast<int>(order.size())) {
    LOG(WARNING) << "LayerAdam: " << num_threads << " workers on " << order.size()
                 << " usable cores; cores will be shared";
  }

  for (size_t i = 0; i < nodes.size(); ++i) engine->nodes_.push_back(std::make_unique<NodeQueue>());
  std::vector<WorkerSpec> specs;
  for (int w = 0; w < num_threads; ++w) {
    const auto& [node, core] = order[w % order.size()];
    WorkerSpec spec{node, engine->nodes_[node]->num_workers, ""};
    if (options.pinning == WorkerPinning::kCore) {
      spec.cpuset = BitmapString(core->cpuset);
    } else if (options.pinning == WorkerPinning::kNumaNode && nodes[node].node != nullptr) {
      spec.cpuset = BitmapString(nodes[node].node->cpuset);
    }
    engine->nodes_[node]->num_workers++;
    specs.push_back(std::move(spec));
  }
  for (auto& q : engine->nodes_) {
    absl::MutexLock l(&q->mu);
    q->calls.resize(q->num_workers);
  }
  // Units placed on a node without workers are served by a node that has some.
  std::vector<int> with_workers;
  for (size_t i = 0; i < nodes.size(); ++i) {
    if (engine->nodes_[i]->num_workers > 0) with_workers.push_back(static_cast<int>(i));
  }
  for (size_t i = 0; i < nodes.size(); ++i) {
    engine->queue_of_node_.push_back(engine->nodes_[i]->num_workers > 0 ? static_cast<int>(i)
                                                                        : with_workers[i % with_workers.size()]);
  }
  for (int w = 0; w < num_threads; ++w) {
    engine->workers_.emplace_back(&LayerAdam::WorkerLoop, engine.get(), w, specs[w]);
  }
  LOG(INFO) << "LayerAdam: " << num_threads << " workers on " << nodes.size() << " NUMA node(s), " << total_cores
            << " cores (" << reserve << " reserved), isa " << AdamIsaName(engine->isa_);
  return engine;
}

LayerAdam::~LayerAdam() {
  {
    absl::MutexLock l(&idle_mu_);
    shutting_down_ = true;
  }
  { absl::MutexLock l(&each_worker_mu_); }  // a RunOnEachWorker call under way needs the workers
  for (auto& q : nodes_) {
    absl::MutexLock l(&q->mu);
    q->stopping = true;
  }
  for (std::thread& t : workers_) t.join();
  for (auto& q : nodes_) {
    std::vector<Task> left;
    {
      absl::MutexLock l(&q->mu);
      left.assign(q->tasks.begin() + q->head, q->tasks.end());
      q->tasks.clear();
      q->head = 0;
    }
    for (const Task& t : left) FinishPiece(t.chunk, absl::CancelledError("LayerAdam stopped"));
  }
  if (topology_ != nullptr) hwloc_topology_destroy(static_cast<hwloc_topology_t>(topology_));
}

int LayerAdam::workers_on_node(int numa_node) const {
  if (numa_node < 0 || numa_node >= num_numa_nodes()) return 0;
  return nodes_[numa_node]->num_workers;
}

int LayerAdam::QueueFor(int numa_node) const { return queue_of_node_[numa_node]; }

std::vector<int> LayerAdam::AssignNumaNodes(const std::vector<int64_t>& unit_bytes) const {
  std::vector<double> load(nodes_.size(), 0.0);
  std::vector<int> out;
  out.reserve(unit_bytes.size());
  for (int64_t bytes : unit_bytes) {
    int best = -1;
    for (size_t i = 0; i < nodes_.size(); ++i) {
      if (nodes_[i]->num_workers == 0) continue;
      if (best < 0 || load[i] < load[best]) best = static_cast<int>(i);
    }
    load[best] += static_cast<double>(bytes) / nodes_[best]->num_workers;
    out.push_back(best);
  }
  return out;
}

absl::Status LayerAdam::SubmitChunk(const UnitMemory& unit, int64_t offset, int64_t numel, const float* grad,
                                    const AdamWStepParams& params, DoneFn done, const UndoMemory* undo, UndoMode mode) {
  return Submit(TaskKind::kStepF32, unit, offset, numel, grad, params, std::move(done), undo, mode);
}

absl::Status LayerAdam::SubmitRestore(const UnitMemory& unit, int64_t offset, int64_t numel, const UndoMemory& undo,
                                      DoneFn done) {
  return Submit(TaskKind::kRestore, unit, offset, numel, nullptr, AdamWStepParams{}, std::move(done), &undo,
                UndoMode::kRedo);
}

absl::Status LayerAdam::SubmitChunkBf16(const UnitMemory& unit, int64_t offset, int64_t numel, const bf16_t* grad,
                                        const AdamWStepParams& params, DoneFn done, const UndoMemory* undo,
                                        UndoMode mode) {
  return Submit(TaskKind::kStepBf16, unit, offset, numel, grad, params, std::move(done), undo, mode);
}

absl::Status LayerAdam::SubmitGradSquared(const UnitMemory& unit, int64_t offset, int64_t numel, GradPtr grad,
                                          const AdamWStepParams& params, double* block_squares, DoneFn done) {
  if (numel > 0 && block_squares == nullptr) return absl::InvalidArgumentError("LayerAdam: null block squares");
  return Submit(grad.bf16 ? TaskKind::kStepBf16 : TaskKind::kStepF32, unit, offset, numel, grad.data, params,
                std::move(done), nullptr, UndoMode::kNone, block_squares);
}

absl::Status LayerAdam::FirstTouch(const UnitMemory& unit) {
  if (unit.numa_node < 0 || unit.numa_node >= num_numa_nodes() || unit.numel < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("FirstTouch: bad unit (numel ", unit.numel, ", numa_node ", unit.numa_node, ")"));
  }
  if (num_numa_nodes() > 1) {
    auto topo = static_cast<hwloc_topology_t>(topology_);
    hwloc_obj_t node = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, unit.numa_node);
    const int64_t n = unit.numel, blocks = Int8StateBlocks(unit.numel);
    const bool f32 = unit.moments == StateDtype::kFp32, b16 = unit.moments == StateDtype::kBf16;
    const std::pair<void*, int64_t> areas[] = {
        {unit.master, n * 4},
        {f32   ? static_cast<void*>(unit.m)
         : b16 ? static_cast<void*>(unit.bf16.m)
               : unit.int8.m_codes,
         f32   ? n * 4
         : b16 ? n * 2
               : n},
        {f32   ? static_cast<void*>(unit.v)
         : b16 ? static_cast<void*>(unit.bf16.v)
               : unit.int8.v_codes,
         f32   ? n * 4
         : b16 ? n * 2
               : n},
        {unit.moments == StateDtype::kInt8 ? unit.int8.m_scales : nullptr, blocks * 4},
        {unit.moments == StateDtype::kInt8 ? unit.int8.v_scales : nullptr, blocks * 4},
        {unit.mirror, n * 2}};
    for (const auto& [addr, bytes] : areas) {
      if (node == nullptr || addr == nullptr || bytes == 0) continue;
      if (hwloc_set_area_membind(topo, addr, bytes, node->nodeset, HWLOC_MEMBIND_BIND,
                                 HWLOC_MEMBIND_MIGRATE | HWLOC_MEMBIND_BYNODESET) != 0) {
        LOG(WARNING) << "FirstTouch: binding " << bytes << " bytes to NUMA node " << unit.numa_node << " failed (errno "
                     << errno << "); relying on first touch";
      }
    }
  }
  absl::Notification finished;
  absl::Status result;
  absl::Status s = Submit(TaskKind::kTouch, unit, 0, unit.numel, nullptr, AdamWStepParams{}, [&](absl::Status st) {
    result = st;
    finished.Notify();
  });
  if (!s.ok()) return s;
  finished.WaitForNotification();
  return result;
}

absl::Status LayerAdam::Submit(TaskKind kind, const UnitMemory& unit, int64_t offset, int64_t numel, const void* grad,
                               const AdamWStepParams& params, DoneFn done, const UndoMemory* undo, UndoMode undo_mode,
                               double* block_squares) {
  if (offset < 0 || numel < 0 || unit.numel < 0 || offset > unit.numel || numel > unit.numel - offset) {
    return absl::InvalidArgumentError(
        absl::StrCat("LayerAdam: chunk [", offset, ", +", numel, ") outside the unit's ", unit.numel, " elements"));
  }
  const bool needs_grad = kind == TaskKind::kStepF32 || kind == TaskKind::kStepBf16;
  if (numel > 0 && (!StateSet(ViewOf(unit)) || (needs_grad && grad == nullptr))) {
    return absl::InvalidArgumentError("LayerAdam: null state or gradient pointer");
  }
  if (undo_mode != UndoMode::kNone) {
    const bool undo_set = undo != nullptr && StateSet(ViewOf(*undo));
    if (!undo_set || kind == TaskKind::kTouch) {
      return absl::InvalidArgumentError("LayerAdam: an undo mode without an undo copy");
    }
    if (undo->moments != unit.moments) {
      return absl::InvalidArgumentError(absl::StrCat("LayerAdam: the undo copy holds ", StateDtypeName(undo->moments),
                                                     " moments, the unit keeps ", StateDtypeName(unit.moments)));
    }
  }
  if (unit.moments == StateDtype::kInt8 && kind != TaskKind::kTouch &&
      (offset % kInt8StateBlock != 0 || ((offset + numel) % kInt8StateBlock != 0 && offset + numel != unit.numel))) {
    return absl::InvalidArgumentError(absl::StrCat("LayerAdam: chunk [", offset, ", +", numel,
                                                   ") splits an int8 moment block (", kInt8StateBlock,
                                                   " elements): chunks start and end on block boundaries"));
  }
  if (unit.numa_node < 0 || unit.numa_node >= num_numa_nodes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("LayerAdam: numa_node ", unit.numa_node, " not in [0, ", num_numa_nodes(), ")"));
  }
  if (needs_grad && params.step < 1) {
    return absl::InvalidArgumentError(absl::StrCat("LayerAdam: AdamW step must be >= 1, got ", params.step));
  }
  int64_t prev_end = 0;
  for (const ElementRange& r : unit.tensors) {
    if (r.begin < prev_end || r.end < r.begin || r.end > unit.numel) {
      return absl::InvalidArgumentError(absl::StrCat("LayerAdam: tensor range [", r.begin, ", ", r.end,
                                                     ") is not sorted, disjoint and inside the unit's ", unit.numel,
                                                     " elements"));
    }
    prev_end = r.end;
  }
  if (!done) return absl::InvalidArgumentError("LayerAdam: no completion callback");
  {
    absl::MutexLock l(&idle_mu_);
    if (shutting_down_) return absl::FailedPreconditionError("LayerAdam is shutting down");
    ++chunks_in_flight_;
  }

  NodeQueue& q = *nodes_[QueueFor(unit.numa_node)];
  // Split into at most one piece per worker, none below min_piece_numel, boundaries aligned (on
  // the norm grid when the pieces sum squares: each block is one piece's).
  const int64_t max_pieces = std::max<int64_t>(1, numel / min_piece_numel_);
  const int64_t pieces = std::min<int64_t>(q.num_workers, max_pieces);
  const int64_t align = block_squares != nullptr            ? kNormBlockNumel
                        : unit.moments == StateDtype::kInt8 ? kInt8StateBlock
                                                            : kPieceAlignNumel;
  std::vector<int64_t> bounds{offset};
  for (int64_t k = 1; k < pieces; ++k) {
    int64_t b = (offset + numel * k / pieces) / align * align;
    if (b > bounds.back() && b < offset + numel) bounds.push_back(b);
  }
  bounds.push_back(offset + numel);

  ChunkState* chunk = nullptr;  // in flight until FinishPiece gives it back to chunk_pool_
  {
    absl::MutexLock l(&pool_mu_);
    if (!chunk_pool_.empty()) {
      chunk = chunk_pool_.back().release();
      chunk_pool_.pop_back();
    }
  }
  if (chunk == nullptr) chunk = std::make_unique<ChunkState>().release();
  chunk->done = std::move(done);
  chunk->remaining.store(static_cast<int>(bounds.size() - 1), std::memory_order_relaxed);
  AdamWConstants constants = needs_grad ? MakeAdamWConstants(params) : AdamWConstants{};
  constants.stream_mirror = stream_mirror_;
  const size_t elem_bytes = kind == TaskKind::kStepBf16 ? sizeof(bf16_t) : sizeof(float);
  {
    absl::MutexLock l(&q.mu);
    for (size_t k = 0; k + 1 < bounds.size(); ++k) {
      const void* piece_grad =
          grad == nullptr ? nullptr : static_cast<const char*>(grad) + (bounds[k] - offset) * elem_bytes;
      q.tasks.push_back(Task{kind, unit, bounds[k], bounds[k + 1] - bounds[k], piece_grad, constants,
                             params.nonfinite_grad, chunk, undo != nullptr ? *undo : UndoMemory{}, undo_mode,
                             block_squares, offset / kNormBlockNumel,
                             StochasticRounding{params.rounding_seed, params.step, 0}});
    }
  }
  return absl::OkStatus();
}

void LayerAdam::WorkerLoop(int index, WorkerSpec spec) {
  worker_of_engine = this;
  const std::string name = absl::StrCat("adam-", index);
  pthread_setname_np(pthread_self(), name.c_str());
  if (!spec.cpuset.empty()) {
    hwloc_bitmap_t set = hwloc_bitmap_alloc();
    if (hwloc_bitmap_sscanf(set, spec.cpuset.c_str()) != 0 ||
        hwloc_set_cpubind(static_cast<hwloc_topology_t>(topology_), set, HWLOC_CPUBIND_THREAD) != 0) {
      LOG(WARNING) << name << ": cannot bind to cpuset " << spec.cpuset << " (errno " << errno << "); running unbound";
    }
    hwloc_bitmap_free(set);
  }
  NodeQueue& q = *nodes_[spec.node];
  const int slot = spec.slot;
  BlockPacer pacer(*this, spec.node, slot, q.num_workers);
  auto ready = [&q, slot]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(q.mu) {
    return q.stopping || q.head < q.tasks.size() || q.calls[slot] != nullptr;
  };
  while (true) {
    q.mu.LockWhen(absl::Condition(&ready));
    if (q.calls[slot] != nullptr) {  // before stopping: the destructor waits for a call under way
      std::shared_ptr<EachWorkerCall> call;
      call.swap(q.calls[slot]);
      q.mu.Unlock();
      RunEachWorkerCall(*call, index, spec.node);
      continue;
    }
    if (q.stopping) {
      q.mu.Unlock();
      return;
    }
    const Task task = q.tasks[q.head++];
    if (q.head == q.tasks.size()) {  // drained: reuse the storage from its start
      q.tasks.clear();
      q.head = 0;
    } else if (q.head >= 1024 && q.head * 2 >= q.tasks.size()) {  // never drained: drop the done half
      q.tasks.erase(q.tasks.begin(), q.tasks.begin() + static_cast<std::ptrdiff_t>(q.head));
      q.head = 0;
    }
    q.mu.Unlock();
    pacer.StartPiece();
    FinishPiece(task.chunk, RunTask(task, pacer));
  }
}

absl::Status LayerAdam::RunOnEachWorker(absl::FunctionRef<void(int, int, int)> fn) {
  if (worker_of_engine == this) {
    return absl::FailedPreconditionError(
        "LayerAdam::RunOnEachWorker on one of the engine's workers (it would wait for itself)");
  }
  absl::MutexLock serial(&each_worker_mu_);
  {
    absl::MutexLock l(&idle_mu_);
    if (shutting_down_) return absl::FailedPreconditionError("LayerAdam is shutting down");
  }
  auto call = std::make_shared<EachWorkerCall>(fn, num_threads());
  for (auto& q : nodes_) {
    absl::MutexLock l(&q->mu);
    for (std::shared_ptr<EachWorkerCall>& mailbox : q->calls) mailbox = call;
  }
  EachWorkerCall& c = *call;
  auto all_finished = [&c]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(c.mu) { return c.finished == c.num_workers; };
  absl::MutexLock l(&c.mu);
  c.mu.Await(absl::Condition(&all_finished));
  return absl::OkStatus();
}

void LayerAdam::RunEachWorkerCall(EachWorkerCall& call, int index, int node) {
  // A start barrier: a bandwidth figure needs every worker streaming at once, not the first ones
  // done before the last (held by a long piece) begin. Blocking, not spinning: workers may share
  // cores.
  {
    absl::MutexLock l(&call.mu);
    ++call.arrived;
    auto all_arrived = [&call]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(call.mu) { return call.arrived == call.num_workers; };
    call.mu.Await(absl::Condition(&all_arrived));
  }
  call.fn(index, call.num_workers, node);
  absl::MutexLock l(&call.mu);
  ++call.finished;
}

absl::Status LayerAdam::SetCopyPriority(absl::Span<const std::atomic<uint32_t>* const> urgent_words,
                                        double yield_fraction, absl::Duration max_pause) {
  if (!(yield_fraction >= 0 && yield_fraction <= 1) || max_pause <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(absl::StrCat("LayerAdam copy priority: yield_fraction ", yield_fraction,
                                                   " must be in [0, 1] and max_pause ", absl::FormatDuration(max_pause),
                                                   " positive"));
  }
  for (const std::atomic<uint32_t>* w : urgent_words) {
    if (w == nullptr) return absl::InvalidArgumentError("LayerAdam copy priority: a null urgent word");
  }
  std::shared_ptr<CopyPriority> config;
  if (!urgent_words.empty() && yield_fraction > 0) {
    config = std::make_shared<CopyPriority>();
    config->words.assign(urgent_words.begin(), urgent_words.end());
    for (const auto& q : nodes_) config->yielders.push_back(YieldingWorkers(q->num_workers, yield_fraction));
    config->max_pause = max_pause;
  }
  absl::MutexLock l(&priority_mu_);
  priority_ = std::move(config);
  return absl::OkStatus();
}

void LayerAdam::ClearCopyPriority() {
  absl::MutexLock l(&priority_mu_);
  priority_ = nullptr;
}

std::shared_ptr<const LayerAdam::CopyPriority> LayerAdam::copy_priority() const {
  absl::MutexLock l(&priority_mu_);
  return priority_;
}

template <typename G>
absl::Status LayerAdam::RunStep(const Task& t, const G* grad, BlockPacer& pacer) {
  const UnitMemory& u = t.unit;
  const int64_t o = t.offset;
  const bool refuse = t.nonfinite == NonFiniteGrad::kRefuse;
  const auto kernel = [&](int64_t b, int64_t n, WeightDecay decay, const G* g) {
    return StepPart(t, b, n, decay, g, refuse);
  };
  const auto value = [](G x) -> float {
    if constexpr (std::is_same_v<G, float>) {
      return x;
    } else {
      return Bf16ToFloat(x);
    }
  };
  // Under copy priority a yielding worker runs each tensor part in blocks, pausing between them
  // (BlockPacer); otherwise in one kernel call. The kernels are elementwise, so the split changes
  // no result bit.
  const int64_t plain_block = pacer.active() ? kYieldBlockNumel : std::numeric_limits<int64_t>::max();
  int64_t saved_to = o;  // kSave: the undo copy holds [o, saved_to) of the piece
  absl::Status status = ForEachTensorPart(u.tensors, o, t.numel, [&](int64_t b, int64_t n, WeightDecay decay) {
    const G* g = grad + (b - o);
    // Block by block; with an undo copy the copy brings the block into cache, the update then
    // reads it there.
    const int64_t block = t.undo_mode == UndoMode::kNone ? plain_block : kUndoBlockNumel;
    for (int64_t bb = b; bb < b + n; bb += std::min(block, b + n - bb)) {
      const int64_t nn = std::min(block, b + n - bb);
      pacer.BeforeBlock();
      if (t.undo_mode == UndoMode::kSave) {  // streaming stores: the copy is read back only on a rollback
        CopyState(ViewOf(u), ViewOf(t.undo), bb, nn,
                  [this](const float* src, float* dst, int64_t k) { kernels_->copy_stream(src, dst, k); });
        saved_to = bb + nn;
      } else if (t.undo_mode == UndoMode::kRedo) {
        CopyState(ViewOf(t.undo), ViewOf(u), bb, nn);
      }
      const G* gg = g + (bb - b);
      if (const int64_t bad = kernel(bb, nn, decay, gg); bad >= 0) {
        return NonFiniteGradError(bb + bad, value(gg[bad]));
      }
    }
    return absl::OkStatus();
  });
  if (!status.ok() && t.undo_mode == UndoMode::kSave && saved_to < o + t.numel) {
    // Refused part-way: the rest of the piece is saved too (unchanged), so restoring the whole
    // chunk from the undo copy is exact.
    (void)ForEachTensorPart(u.tensors, saved_to, o + t.numel - saved_to, [&](int64_t b, int64_t n, WeightDecay) {
      CopyState(ViewOf(u), ViewOf(t.undo), b, n);
      return absl::OkStatus();
    });
  }
  return status;
}

template <typename G>
int64_t LayerAdam::StepPart(const Task& t, int64_t b, int64_t n, WeightDecay decay, const G* g, bool checked) const {
  constexpr bool kF32 = std::is_same_v<G, float>;
  const UnitMemory& u = t.unit;
  AdamWConstants c = t.constants;
  // A tensor exempt from decay multiplies by f32(1 - lr*0) = 1: bitwise torch's group with
  // weight_decay 0, which skips the multiply (x * 1 is x for every float).
  if (decay == WeightDecay::kNone) c.decay = 1.0f;
  switch (u.moments) {
    case StateDtype::kFp32:
      if constexpr (kF32) {
        if (checked) return kernels_->step_f32_checked(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
        kernels_->step_f32(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
      } else {
        if (checked) return kernels_->step_bf16_checked(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
        kernels_->step_bf16(c, u.master + b, u.m + b, u.v + b, MirrorOf(u, b), g, n);
      }
      return -1;
    case StateDtype::kBf16: {
      StochasticRounding r = t.rounding;
      r.first_index = u.first_index + b;
      const Bf16Moments mv{u.bf16.m + b, u.bf16.v + b};
      if constexpr (kF32) {
        if (checked) return state_kernels_->bf16_step_f32_checked(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->bf16_step_f32(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
      } else {
        if (checked) return state_kernels_->bf16_step_bf16_checked(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->bf16_step_bf16(c, r, u.master + b, mv, MirrorOf(u, b), g, n);
      }
      return -1;
    }
    case StateDtype::kInt8: {
      // b is a block boundary: tensors begin on kTensorAlignNumel (256) elements, pieces and
      // blocks of work split on multiples of kInt8StateBlock.
      const Int8Moments mv = Int8MomentsAt(u.int8, b);
      if constexpr (kF32) {
        if (checked) return state_kernels_->int8_step_f32_checked(c, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->int8_step_f32(c, u.master + b, mv, MirrorOf(u, b), g, n);
      } else {
        if (checked) return state_kernels_->int8_step_bf16_checked(c, u.master + b, mv, MirrorOf(u, b), g, n);
        state_kernels_->int8_step_bf16(c, u.master + b, mv, MirrorOf(u, b), g, n);
      }
      return -1;
    }
  }
  return -1;
}

template <typename G>
absl::Status LayerAdam::RunStepSquared(const Task& t, const G* grad, BlockPacer& pacer) {
  const UnitMemory& u = t.unit;
  const int64_t o = t.offset;
  const int64_t end = o + t.numel;
  const bool bf16 = !std::is_same_v<G, float>;
  // Block by block on the norm grid: the block's squares first (bringing it into cache), then its
  // update reads it there. A finite sum means every element is finite (squares formed in double
  // cannot overflow from finite floats), so the unchecked kernels do.
  for (int64_t bb = o; bb < end;) {
    const int64_t be = std::min(end, (bb / kNormBlockNumel + 1) * kNormBlockNumel);
    const G* g = grad + (bb - o);
    pacer.BeforeBlock();
    double& sq = t.squares[bb / kNormBlockNumel - t.squares_first_block];
    NormBlockSquares(bb, be - bb, g, bf16, 0, 1, &sq);
    if (!std::isfinite(sq) && t.nonfinite == NonFiniteGrad::kRefuse) {
      for (int64_t i = 0; i < be - bb; ++i) {
        if (!std::isfinite(GradValue(g[i]))) return NonFiniteGradError(bb + i, GradValue(g[i]));
      }
    }
    RETURN_IF_ERROR(ForEachTensorPart(u.tensors, bb, be - bb, [&](int64_t b, int64_t n, WeightDecay decay) {
      StepPart(t, b, n, decay, grad + (b - o), /*checked=*/false);
      return absl::OkStatus();
    }));
    bb = be;
  }
  return absl::OkStatus();
}

absl::Status LayerAdam::RunTask(const Task& t, BlockPacer& pacer) {
  const UnitMemory& u = t.unit;
  const int64_t o = t.offset;
  auto block_of = [&pacer](int64_t n) { return pacer.active() ? kYieldBlockNumel : std::max<int64_t>(n, 1); };
  switch (t.kind) {
    case TaskKind::kStepF32:
      if (t.squares != nullptr) return RunStepSquared(t, static_cast<const float*>(t.grad), pacer);
      return RunStep(t, static_cast<const float*>(t.grad), pacer);
    case TaskKind::kStepBf16:
      if (t.squares != nullptr) return RunStepSquared(t, static_cast<const bf16_t*>(t.grad), pacer);
      return RunStep(t, static_cast<const bf16_t*>(t.grad), pacer);
    case TaskKind::kRestore:
      return ForEachTensorPart(u.tensors, o, t.numel, [&](int64_t b, int64_t n, WeightDecay) {
        const int64_t block = block_of(n);
        for (int64_t bb = b; bb < b + n; bb += block) {
          const int64_t nn = std::min(block, b + n - bb);
          pacer.BeforeBlock();
          CopyState(ViewOf(t.undo), ViewOf(u), bb, nn);
          if (u.mirror == nullptr) continue;
          for (int64_t i = bb; i < bb + nn; ++i) u.mirror[i] = FloatToBf16(u.master[i]);
        }
        return absl::OkStatus();
      });
    case TaskKind::kTouch:  // (before a job's first step: never paced)
      TouchPages(u.master + o, t.numel * 4);
      switch (u.moments) {
        case StateDtype::kFp32:
          TouchPages(u.m + o, t.numel * 4);
          TouchPages(u.v + o, t.numel * 4);
          break;
        case StateDtype::kBf16:
          TouchPages(u.bf16.m + o, t.numel * 2);
          TouchPages(u.bf16.v + o, t.numel * 2);
          break;
        case StateDtype::kInt8:  // (pieces split on blocks)
          TouchPages(u.int8.m_codes + o, t.numel);
          TouchPages(u.int8.v_codes + o, t.numel);
          TouchPages(u.int8.m_scales + o / kInt8StateBlock, Int8StateBlocks(t.numel) * 4);
          TouchPages(u.int8.v_scales + o / kInt8StateBlock, Int8StateBlocks(t.numel) * 4);
          break;
      }
      if (u.mirror != nullptr) TouchPages(u.mirror + o, t.numel * 2);  // (an undo copy has none)
      return absl::OkStatus();
  }
  return absl::OkStatus();
}

std::optional<NonFiniteGradElement> NonFiniteGradOf(const absl::Status& status) {
  const absl::optional<absl::Cord> payload = status.GetPayload(kNonFiniteGradPayload);
  if (!payload) return std::nullopt;
  const std::string text(*payload);
  const size_t space = text.find(' ');
  NonFiniteGradElement e;
  uint32_t bits = 0;
  if (space == std::string::npos || !absl::SimpleAtoi(text.substr(0, space), &e.offset) ||
      !absl::SimpleHexAtoi(text.substr(space + 1), &bits)) {
    return std::nullopt;
  }
  std::memcpy(&e.value, &bits, 4);
  return e;
}

void LayerAdam::FinishPiece(ChunkState* chunk, const absl::Status& status) {
  if (!status.ok()) {
    absl::MutexLock l(&chunk->mu);
    if (chunk->status.ok()) chunk->status = status;
  }
  if (chunk->remaining.fetch_sub(1, std::memory_order_acq_rel) != 1) return;
  absl::Status final_status;
  {
    absl::MutexLock l(&chunk->mu);
    final_status = chunk->status;
  }
  chunk->done(final_status);
  chunk->done = nullptr;
  {
    absl::MutexLock l(&chunk->mu);
    chunk->status = absl::OkStatus();
  }
  {
    absl::MutexLock l(&pool_mu_);
    chunk_pool_.emplace_back(chunk);
  }
  absl::MutexLock l(&idle_mu_);
  --chunks_in_flight_;
}

void LayerAdam::WaitIdle() {
  absl::MutexLock l(&idle_mu_);
  auto idle = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(idle_mu_) { return chunks_in_flight_ == 0; };
  idle_mu_.Await(absl::Condition(&idle));
}

}  // namespace slidedp::update
