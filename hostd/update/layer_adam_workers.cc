// LayerAdam engine, the workers: hwloc topology -> per-NUMA-node FIFO queues and pinned worker
// threads, the worker loop, per-worker mailboxes for RunOnEachWorker, copy priority (see
// layer_adam.h; the work they do: layer_adam.cc).
#include <hwloc.h>
#include <pthread.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <utility>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/update/layer_adam.h"
#include "hostd/update/layer_adam_internal.h"
#include "shm/futex.h"

namespace slidedp::update {
namespace {

// The engine whose worker this thread is (null on other threads): RunOnEachWorker refuses to be
// called where it would wait for its own caller.
thread_local const LayerAdam* worker_of_engine = nullptr;

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

}  // namespace slidedp::update
