// WorkerAgent: session with hostd, assignments, and the per-job step loop.
#include "worker/agent/worker_agent.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/data/context_parallel.h"
#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "common/data/sampler.h"
#include "common/data/validation.h"
#include "common/io/meminfo.h"
#include "common/status/grpc_status.h"
#include "common/status/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"
#include "grpcpp/grpcpp.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"
#include "shm/shm_collective.h"
#include "worker/compute/cpu/cpu_backend.h"
#include "worker/pipeline/auto_policy.h"
#include "worker/pipeline/gradient_path.h"
#include "worker/pipeline/step_runner.h"
#include "worker/pipeline/unit_streamer.h"
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
#include <cuda_runtime_api.h>
#include "worker/comm/nccl_communicator.h"
#include "worker/pipeline/cuda_activation_store.h"
#include "worker/pipeline/cuda_gradient_path.h"
#include "worker/pipeline/cuda_streamer.h"
#include "worker/pipeline/host_registry.h"
#endif

namespace slidedp::worker {
namespace {

// runtime.cast_threads, 0: a quarter of the host's cores per rank, 1 to 8.
int CastThreads(int32_t configured, int world) {
  if (configured > 0) return configured;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / (4 * std::max(world, 1)), 1, 8);
}

// SLIDEDP_INJECT_NONFINITE (tests only): comma-separated "grad:STEP:UNIT[@RANK]" (element 0 of
// the unit's gradient becomes NaN) and "loss:STEP[@RANK]" (the loss does), STEP 1-based, for
// every rank unless one is given.
absl::StatusOr<std::vector<StepRunnerOptions::NonFiniteInjection>> ParseNonFiniteInjection(const std::string& text,
                                                                                           int rank) {
  std::vector<StepRunnerOptions::NonFiniteInjection> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<absl::string_view> at = absl::StrSplit(item, '@');
    const std::vector<absl::string_view> f = absl::StrSplit(at[0], ':');
    int64_t step = 0, unit = -1, only_rank = -1;
    const bool ok = at.size() <= 2 && (at.size() < 2 || absl::SimpleAtoi(at[1], &only_rank)) &&
                    ((f.size() == 3 && f[0] == "grad" && absl::SimpleAtoi(f[2], &unit) && unit >= 0) ||
                     (f.size() == 2 && f[0] == "loss")) &&
                    absl::SimpleAtoi(f[1], &step) && step >= 1;
    if (!ok) {
      return absl::InvalidArgumentError(
          absl::StrCat("SLIDEDP_INJECT_NONFINITE: '", item, "' is not grad:STEP:UNIT[@RANK] or loss:STEP[@RANK]"));
    }
    if (only_rank < 0 || only_rank == rank) out.push_back({step - 1, static_cast<int>(unit)});
  }
  return out;
}

// act_policy auto: how many decoder layers can keep all activations (each layer_bytes for the
// step's tokens) on a device of capacity bytes whose recompute-everything step peaked at `peak`.
// Leaves 15% of the device free: the allocator's fragmentation and the next step's variance.
int KeepAllLayers(int64_t capacity, int64_t peak, int64_t layer_bytes, int64_t layers) {
  const double headroom = 0.85 * static_cast<double>(capacity) - static_cast<double>(peak);
  if (headroom <= 0 || layer_bytes <= 0) return 0;
  return static_cast<int>(std::min<double>(static_cast<double>(layers), std::floor(headroom / layer_bytes)));
}

// AutoPolicy's budget for offloaded checkpoints: this rank's share of the host memory available
// now (hostd's state is allocated by then) less a reserve of 10% or 4 GiB, whichever is more, and
// of at most a quarter of the host's memory: pinned pages leave the page cache and the other jobs
// nothing (measured: 64 GiB pinned beside 52.6 GiB of Qwen3-4B state on a 125 GiB host took 42 s
// to pin and slowed LayerAdam by 16%).
int64_t PinnedBudgetBytes(int world) {
  absl::StatusOr<MemInfo> mem = ReadMemInfo();
  if (!mem.ok()) return -1;  // not known: no bound
  const int64_t available = static_cast<int64_t>(mem->available_bytes);
  const int64_t reserve = std::max<int64_t>(available / 10, int64_t{4} << 30);
  const int64_t usable = std::min(available - reserve, static_cast<int64_t>(mem->total_bytes / 4));
  return std::max<int64_t>(0, usable) / std::max(1, world);
}

ActPolicy ToActPolicy(ActivationPolicy p) {
  switch (p) {
    case ActivationPolicy::kKeepAll: return ActPolicy::kKeepAll;
    case ActivationPolicy::kSelective: return ActPolicy::kSelective;
    case ActivationPolicy::kRecomputeLayer: return ActPolicy::kRecomputeLayer;
    case ActivationPolicy::kAuto: return ActPolicy::kRecomputeLayer;  // until the first step's peak is known
  }
  return ActPolicy::kRecomputeLayer;
}

// This rank's share of the validation split (common/data/validation.h); no micro-batches when the
// job has no validation.
struct ValidationShare {
  int64_t micro_batches_total = 0;  // over every rank
  std::vector<MicroBatch> micro_batches;
  int per_sweep = 1;
  int sweeps = 0;
};

// Context parallelism (runtime.context_parallel): the data-parallel rank and world of a rank (its
// group reads the same rows), its place in the group, and its share of a micro-batch.
struct ContextPlace {
  int ranks = 1, rank = 0, dp_rank = 0, dp_world = 1;
  static ContextPlace Of(const v1::Assignment& a, const JobSpec& spec) {
    ContextPlace c;
    c.ranks = std::max(1, spec.context_parallel);
    c.rank = a.rank() % c.ranks;
    c.dp_rank = a.rank() / c.ranks;
    c.dp_world = std::max(1, a.world_size() / c.ranks);
    return c;
  }
  absl::StatusOr<MicroBatch> Share(MicroBatch mb) const {
    if (ranks == 1) return mb;
    ASSIGN_OR_RETURN(data::ContextShard share, data::ContextShareOf(mb, ranks, rank));
    return std::move(share.local);
  }
};

// The keys and values of context-parallel attention through the job's "ctx" shm collective.
class ShmContextGroup final : public ContextGroup {
 public:
  ShmContextGroup(std::unique_ptr<shm::ShmCollective> coll, absl::Duration timeout)
      : coll_(std::move(coll)), timeout_(timeout) {}
  int ranks() const override { return coll_->world(); }
  absl::Status AllGather(const float* local, int64_t numel, float* out) override {
    return coll_->AllGatherF32(local, numel, out, timeout_);
  }
  absl::Status ReduceScatter(float* buf, int64_t shard_numel) override {
    return coll_->ReduceScatterF32(buf, shard_numel, timeout_);
  }

 private:
  std::unique_ptr<shm::ShmCollective> coll_;
  absl::Duration timeout_;
};

#ifdef SLIDEDP_HAVE_CUDA_BACKEND
// The keys and values of context-parallel attention over NCCL (CUDA workers whose job has a
// communicator): one communicator per group, split from the job's; each collective runs on the
// compute stream and is waited for here with the job's timeout and abort, so a peer that died
// aborts the communicator instead of hanging the stream.
class NcclContextGroup final : public ContextGroup {
 public:
  static absl::StatusOr<std::unique_ptr<NcclContextGroup>> Create(NcclCommunicator& world, int device, int group,
                                                                  int rank, absl::Duration timeout,
                                                                  const shm::AbortWord* abort) {
    ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> comm,
                     world.Split(device, group, rank, absl::StrCat("context group ", group)));
    std::unique_ptr<NcclContextGroup> g(new NcclContextGroup(std::move(comm), timeout, abort));
    RETURN_IF_ERROR(CudaOk(cudaEventCreateWithFlags(&g->done_, cudaEventDisableTiming)));
    return g;
  }
  ~NcclContextGroup() override {
    if (done_ != nullptr) cudaEventDestroy(done_);
  }
  int ranks() const override { return comm_->world(); }
  absl::Status AllGather(const float*, int64_t, float*) override {
    return absl::UnimplementedError("NCCL context group: host buffers (device collectives only)");
  }
  absl::Status ReduceScatter(float*, int64_t) override {
    return absl::UnimplementedError("NCCL context group: host buffers (device collectives only)");
  }
  bool device_collectives() const override { return true; }
  absl::Status AllGatherDevice(const void* local, int64_t bytes, void* out, void* stream) override {
    return Waited(comm_->AllGatherBytesOn(local, bytes, out, static_cast<cudaStream_t>(stream)), stream);
  }
  absl::Status ReduceScatterDeviceF32(float* buf, int64_t shard_numel, void* stream) override {
    return Waited(comm_->ReduceScatterF32On(buf, shard_numel, static_cast<cudaStream_t>(stream)), stream);
  }

 private:
  NcclContextGroup(std::unique_ptr<NcclCommunicator> comm, absl::Duration timeout, const shm::AbortWord* abort)
      : comm_(std::move(comm)), timeout_(timeout), abort_(abort) {}
  absl::Status Waited(absl::Status issued, void* stream) {
    absl::Status s = issued;
    if (s.ok()) s = CudaOk(cudaEventRecord(done_, static_cast<cudaStream_t>(stream)));
    if (s.ok()) {
      s = WaitEvent(done_, timeout_, [this] { return abort_ != nullptr ? abort_->ToStatus() : absl::OkStatus(); });
    }
    if (!s.ok()) {
      comm_->Abort();  // peers may be stuck in this collective: release them and this stream
      return Annotate(s, "context-parallel collective");
    }
    return s;
  }
  static absl::Status CudaOk(cudaError_t e) {
    return e == cudaSuccess ? absl::OkStatus() : absl::InternalError(cudaGetErrorString(e));
  }
  std::unique_ptr<NcclCommunicator> comm_;
  absl::Duration timeout_;
  const shm::AbortWord* abort_;
  cudaEvent_t done_ = nullptr;
};
#endif

absl::StatusOr<ValidationShare> OpenValidation(const v1::Assignment& a, const JobSpec& spec) {
  ValidationShare v;
  const ContextPlace place = ContextPlace::Of(a, spec);
  if (a.validation_path().empty()) return v;
  // hostd verified the split at job start and sends its files' identities, as for the training
  // data: the same files are read here, or DATA_LOSS names the one that changed.
  data::ReaderOptions dopt;
  dopt.verify_checksums = data::VerifyChecksums::kNo;
  if (a.validation_files_size() != data::kNumBinFiles) {
    return absl::InvalidArgumentError(
        absl::StrCat("assignment lists ", a.validation_files_size(), " validation files, not ", data::kNumBinFiles));
  }
  for (const v1::DatasetFile& f : a.validation_files()) {
    dopt.expected_files.push_back({f.dev(), f.inode(), f.size(), f.mtime_ns(), f.ctime_ns()});
  }
  ASSIGN_OR_RETURN(auto dataset, data::DatasetReader::Open(a.validation_path(), dopt));
  const int64_t rows = dataset->num_rows();
  v.micro_batches_total = data::ValidationMicroBatches(rows, spec.micro_batch);
  for (int64_t k : data::RankValidationMicroBatches(v.micro_batches_total, place.dp_rank, place.dp_world)) {
    const std::vector<int64_t> r = data::ValidationRows(k, rows, spec.micro_batch);
    absl::StatusOr<MicroBatch> mb = data::BuildMicroBatch(*dataset, r);
    if (mb.ok()) mb = place.Share(std::move(*mb));
    if (!mb.ok()) return Annotate(mb.status(), absl::StrCat("validation micro-batch ", k));
    v.micro_batches.push_back(std::move(*mb));
  }
  // As many at once as a training step holds on this rank: the pass fits where the step did.
  v.per_sweep = static_cast<int>(std::max<int64_t>(1, spec.global_batch / place.dp_world / spec.micro_batch));
  v.sweeps = data::ValidationSweeps(v.micro_batches_total, place.dp_world, v.per_sweep);
  return v;
}

bool EvaluatesAfter(const JobSpec& spec, int64_t step, int64_t total_steps) {
  return data::EvaluatesAfter(spec.eval_every, step, total_steps);
}

}  // namespace

struct WorkerAgent::HostState {
  std::unique_ptr<shm::JobState> js;
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  std::unique_ptr<HostRegistry> registry;  // CUDA workers; destroyed (unregistered) before js unmaps
#endif
};

WorkerAgent::WorkerAgent(WorkerOptions options) : options_(std::move(options)) {
  cache_watcher_ = std::thread(&WorkerAgent::WatchHostState, this);
}

WorkerAgent::~WorkerAgent() {
  Stop();
  if (job_thread_.joinable()) job_thread_.join();
  if (cache_watcher_.joinable()) cache_watcher_.join();
  DropHostState("the worker stops");
}

absl::StatusOr<std::unique_ptr<WorkerAgent::HostState>> WorkerAgent::TakeHostState(const std::string& segment) {
  ASSIGN_OR_RETURN(std::unique_ptr<shm::JobState> fresh, shm::JobState::Attach(segment, shm::Access::kReadWrite));
  {
    absl::MutexLock l(&cache_mu_);
    if (cached_) {
      // hostd renamed the pooled file for this job and laid it out again in place: the mapping
      // (and the pages CUDA pinned through it) stay valid; re-read the layout through it.
      auto kept = cached_->js->segment().Identity(), now = fresh->segment().Identity();
      if (kept.ok() && now.ok() && kept->SameFile(*now) && cached_->js->bytes() == fresh->bytes()) {
        absl::Status s = cached_->js->Rebind();
        if (s.ok()) {
          LOG(INFO) << "state " << segment << ": the previous job's segment, still mapped and registered";
          return std::move(cached_);
        }
        LOG(WARNING) << "state " << segment << ": cannot re-read the kept mapping (" << s << "); mapping it again";
      }
    }
  }
  DropHostState("the job uses another state segment");
  auto hs = std::make_unique<HostState>();
  hs->js = std::move(fresh);
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  if (options_.backend == BackendKind::kCuda) hs->registry = std::make_unique<HostRegistry>();
#endif
  return hs;
}

void WorkerAgent::KeepHostState(std::unique_ptr<HostState> hs) {
  auto id = hs->js->segment().Identity();
  if (!id.ok() || id->links == 0) return;  // already removed by hostd: let it go now
  std::unique_ptr<HostState> old;
  absl::MutexLock l(&cache_mu_);
  old = std::move(cached_);
  cached_ = std::move(hs);
}

void WorkerAgent::DropHostState(const char* why) {
  std::unique_ptr<HostState> old;
  {
    absl::MutexLock l(&cache_mu_);
    old = std::move(cached_);
  }
  if (!old) return;
  const std::string name = old->js->segment_name();
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  if (options_.backend == BackendKind::kCuda) cudaSetDevice(options_.index);  // the registering context
#endif
  old.reset();
  LOG(INFO) << "dropped the kept mapping of " << name << " (" << why << ")";
}

void WorkerAgent::WatchHostState() {
  pthread_setname_np(pthread_self(), "state-watch");
  int tick = 0;
  while (!stop_) {
    absl::SleepFor(absl::Milliseconds(100));
    if (++tick % 10 != 0) continue;
    bool unlinked = false;
    {
      absl::MutexLock l(&cache_mu_);
      if (cached_) {
        auto id = cached_->js->segment().Identity();
        unlinked = !id.ok() || id->links == 0;
      }
    }
    if (unlinked) DropHostState("its file was removed");
  }
}

std::string WorkerAgent::worker_id() const {
  if (!options_.id.empty()) return options_.id;
  return absl::StrCat(options_.backend == BackendKind::kCuda ? "gpu" : "cpu", options_.index);
}

v1::DeviceInfo WorkerAgent::device() const {
  v1::DeviceInfo d;
  d.set_kind(options_.backend == BackendKind::kCuda ? "cuda" : "cpu");
  d.set_index(options_.index);
  d.set_name("cpu reference backend");
  d.set_numa_node(0);
  if (options_.backend == BackendKind::kCpu) {  // the CPU backend's "device" memory is host memory
    int64_t bytes = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
    if (const char* m = getenv("SLIDEDP_CPU_DEVICE_MEMORY_BYTES")) bytes = atoll(m);
    d.set_memory_bytes(bytes);
  }
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  cudaDeviceProp prop;
  if (options_.backend == BackendKind::kCuda && cudaGetDeviceProperties(&prop, options_.index) == cudaSuccess) {
    d.set_name(prop.name);
    d.set_memory_bytes(static_cast<int64_t>(prop.totalGlobalMem));
    char bus[32];
    snprintf(bus, sizeof(bus), "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
    d.set_pci_bus_id(bus);
    std::string uuid = "GPU-";
    for (int i = 0; i < 16; ++i) {
      absl::StrAppend(&uuid, absl::Hex(static_cast<unsigned char>(prop.uuid.bytes[i]), absl::kZeroPad2));
      if (i == 3 || i == 5 || i == 7 || i == 9) uuid += "-";
    }
    d.set_uuid(uuid);
    // The GPU's NUMA node, for placing this worker's host memory and LayerAdam's threads.
    std::ifstream numa(absl::StrCat("/sys/bus/pci/devices/", bus, "/numa_node"));
    int node = 0;
    if (numa >> node && node >= 0) d.set_numa_node(node);
  }
#endif
  return d;
}

void WorkerAgent::Stop() {
  stop_ = true;
  cancel_job_ = true;
  absl::MutexLock l(&stream_mu_);
  if (context_) context_->TryCancel();
}

bool WorkerAgent::Send(const v1::WorkerReport& r) {
  absl::MutexLock l(&stream_mu_);
  return stream_ && stream_->Write(r);
}

absl::Status WorkerAgent::Run() {
  double backoff = 0.1;
  int failures = 0;
  absl::Status last;
  while (!stop_) {
    absl::Time t0 = absl::Now();
    last = RunSession();
    if (stop_) break;
    if (absl::Now() - t0 > absl::Seconds(5)) backoff = 0.1, failures = 0;  // it was a real session
    ++failures;
    if (options_.exit_after_disconnects >= 0 && failures > options_.exit_after_disconnects) break;
    LOG(WARNING) << "session with hostd ended (" << last << "); reconnecting in " << backoff << " s";
    absl::SleepFor(absl::Seconds(backoff));
    backoff = std::min(backoff * 2, options_.reconnect_max_s);
  }
  if (job_thread_.joinable()) job_thread_.join();
  return last;
}

absl::Status WorkerAgent::RunSession() {
  // Made per session: a token file replaced while hostd was away is read again.
  ASSIGN_OR_RETURN(auto channel, auth::CreateHostdChannel(options_.hostd_address, options_.credentials));
  auto stub = v1::WorkerService::NewStub(channel);
  grpc::ClientContext ctx;
  auto stream = stub->Session(&ctx);
  {
    absl::MutexLock l(&stream_mu_);
    stream_ = stream.get();
    context_ = &ctx;
  }
  v1::WorkerReport hello;
  hello.mutable_hello()->set_worker_id(worker_id());
  hello.mutable_hello()->set_pid(getpid());
  *hello.mutable_hello()->mutable_device() = device();
  hello.mutable_hello()->set_build(BuildId());
  if (Send(hello)) {
    v1::HostCommand cmd;
    while (stream->Read(&cmd)) {
      if (cmd.has_assign()) {
        if (job_thread_.joinable()) job_thread_.join();  // the previous job has reported its end
        cancel_job_ = false;
        current_job_ = cmd.assign().job_id();
        job_thread_ = std::thread(&WorkerAgent::RunJob, this, cmd.assign());
      } else if (cmd.has_comm_id()) {
        absl::MutexLock l(&comm_mu_);
        comm_id_ = cmd.comm_id();
      } else if (cmd.has_release_host_state()) {
        DropHostState("hostd removes it");
        v1::WorkerReport ack;
        *ack.mutable_host_state_released() = cmd.release_host_state();
        Send(ack);
      } else if (!cmd.cancel_job_id().empty() && cmd.cancel_job_id() == current_job_) {
        cancel_job_ = true;
      }
    }
  }
  // hostd went away: a running job cannot finish (its gates and ring belong to that hostd).
  cancel_job_ = true;
  if (job_thread_.joinable()) job_thread_.join();
  DropHostState("the session with hostd ended");
  {
    absl::MutexLock l(&stream_mu_);
    stream_ = nullptr;
    context_ = nullptr;
  }
  // Read also ends on a message this worker cannot parse, with hostd's side still open: Finish
  // would then wait for hostd forever (and hostd for this worker). hostd's own status (a refusal,
  // its shutdown) comes at once; past a few seconds the call is cancelled.
  absl::Notification finished;
  std::thread canceller([&] {
    if (!finished.WaitForNotificationWithTimeout(absl::Seconds(5))) ctx.TryCancel();
  });
  const grpc::Status status = stream->Finish();
  finished.Notify();
  canceller.join();
  return FromGrpc(status);
}

void WorkerAgent::RunJob(v1::Assignment a) {
  pthread_setname_np(pthread_self(), "worker-job");
  LOG(INFO) << "job " << a.job_id() << ": rank " << a.rank() << " of " << a.world_size() << ", steps " << a.first_step()
            << ".." << a.total_steps();
  std::unique_ptr<HostState> keep;
  absl::Status s = ExecuteJob(a, &keep);
  LOG(INFO) << "job " << a.job_id() << " finished on this worker: " << s;
  if (s.ok() && keep) KeepHostState(std::move(keep));  // after every user of it is gone
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  // After a failed or cancelled job the peers may have stopped at different collectives: never
  // reuse the communicator (hostd also changes the membership key after a failure).
  if (!s.ok() && comm_) {
    comm_->Abort();
    comm_.reset();
  }
#endif
  v1::WorkerReport r;
  r.mutable_job_finished()->set_job_id(a.job_id());
  r.mutable_job_finished()->set_code(static_cast<int>(s.code()));
  r.mutable_job_finished()->set_message(std::string(s.message()));
  r.mutable_job_finished()->set_attempt(a.attempt());
  Send(r);
}

absl::StatusOr<ComputeBackend*> WorkerAgent::BackendFor(const ModelConfig& c) {
  bool same = backend_ && backend_config_.ToJson() == c.ToJson();
  if (!same) {
    backend_.reset();
    if (options_.backend == BackendKind::kCuda) {
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
      ASSIGN_OR_RETURN(backend_, MakeCudaBackend(c, options_.index));
#else
      return absl::UnimplementedError("this slidedp-worker was built without CUDA");
#endif
    } else {
      CpuBackendOptions o;
      if (const char* m = getenv("SLIDEDP_CPU_DEVICE_MEMORY_BYTES")) o.device_memory_bytes = atoll(m);
      ASSIGN_OR_RETURN(backend_, MakeCpuBackend(c, o));
    }
    backend_config_ = c;
  }
  return backend_.get();
}

absl::StatusOr<std::string> WorkerAgent::AwaitCommId(const v1::Assignment& a) {
  if (a.rank() == 0) {
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
    ASSIGN_OR_RETURN(std::string id, NcclCommunicator::NewUniqueId());
    v1::WorkerReport r;
    v1::CommId* c = r.mutable_comm_id();
    c->set_job_id(a.job_id());
    c->set_attempt(a.attempt());
    c->set_membership_key(a.membership_key());
    c->set_id(id);
    if (!Send(r)) return absl::UnavailableError("lost the session with hostd");
    return id;
#else
    return absl::UnimplementedError("NCCL needs the CUDA build");
#endif
  }
  const absl::Time deadline = absl::Now() + absl::Minutes(2);
  while (true) {
    {
      absl::MutexLock l(&comm_mu_);
      auto relayed = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(comm_mu_) { return comm_id_.has_value(); };
      comm_mu_.AwaitWithTimeout(absl::Condition(&relayed), absl::Milliseconds(50));
      if (comm_id_ && comm_id_->job_id() == a.job_id() && comm_id_->attempt() == a.attempt() &&
          comm_id_->membership_key() == a.membership_key()) {
        return comm_id_->id();
      }
      comm_id_.reset();  // a stale one (an earlier job or attempt)
    }
    if (cancel_job_ || stop_) return absl::CancelledError("job cancelled while waiting for the NCCL id");
    if (absl::Now() > deadline)
      return absl::DeadlineExceededError("rank 0's NCCL unique id did not arrive within 2 min");
  }
}

absl::StatusOr<NcclCommunicator*> WorkerAgent::CommunicatorFor(const v1::Assignment& a) {
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  if (comm_ && !comm_->broken() && comm_->key() == a.membership_key() && comm_->rank() == a.rank() &&
      comm_->world() == a.world_size()) {
    return comm_.get();
  }
  comm_.reset();
  ASSIGN_OR_RETURN(std::string id, AwaitCommId(a));
  ASSIGN_OR_RETURN(std::unique_ptr<NcclCommunicator> c,
                   NcclCommunicator::Create(options_.index, id, a.rank(), a.world_size(), a.membership_key()));
  comm_ = std::move(c);
  return comm_.get();
#else
  return absl::UnimplementedError("NCCL needs the CUDA build");
#endif
}

absl::Status WorkerAgent::ExecuteJob(const v1::Assignment& a, std::unique_ptr<HostState>* keep) {
  ASSIGN_OR_RETURN(JobSpec spec, JobSpec::Parse(a.resolved_spec_yaml(), "", JobSpec::FileCheck::kSkip));
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfigOf(spec));  // with the spec's context override, as hostd
  RETURN_IF_ERROR(config.CheckTrainable());
  ModelLayout layout = ModelLayout::Build(config);
  ASSIGN_OR_RETURN(std::unique_ptr<HostState> host_state, TakeHostState(a.state_segment()));
  shm::JobState* job_state = host_state->js.get();
  RETURN_IF_ERROR(job_state->CheckMatches(layout));
  // runtime.param_source: the segment keeps a mirror exactly when the job reads it.
  const UploadSource source = spec.param_source == ParamSource::kMaster ? UploadSource::kMaster : UploadSource::kMirror;
  if (job_state->has_mirror() != (source == UploadSource::kMirror)) {
    return absl::FailedPreconditionError(
        absl::StrCat("job segment ", job_state->segment_name(), job_state->has_mirror() ? " keeps" : " has no",
                     " BF16 mirror, the job's runtime.param_source is ", ToString(spec.param_source)));
  }
  ASSIGN_OR_RETURN(auto ring, shm::GradRing::Attach(a.ring_segment(), shm::RingRole::kProducer, &job_state->abort()));
  ASSIGN_OR_RETURN(ComputeBackend * backend, BackendFor(config));
  backend->ResetPeakMemory();  // the reported GPU peak is this job's
  backend->SetDeterministic(spec.deterministic);
  backend->SetTileTokens(spec.tile_tokens);
  // hostd verified the dataset at job start (checksums, token ids against the vocabulary, the
  // loss mask) and sends the files' identities: the same files are read here, or the job fails
  // with DATA_LOSS naming the one that changed; no second full scan per rank. Rows are read
  // with pread (a truncation mid-job is DATA_LOSS, not SIGBUS).
  data::ReaderOptions dopt;
  dopt.verify_checksums = data::VerifyChecksums::kNo;
  if (a.dataset_files_size() > 0) {
    if (a.dataset_files_size() != data::kNumBinFiles) {
      return absl::InvalidArgumentError(
          absl::StrCat("assignment lists ", a.dataset_files_size(), " dataset files, not ", data::kNumBinFiles));
    }
    for (const v1::DatasetFile& f : a.dataset_files()) {
      dopt.expected_files.push_back({f.dev(), f.inode(), f.size(), f.mtime_ns(), f.ctime_ns()});
    }
  }
  ASSIGN_OR_RETURN(auto dataset, data::DatasetReader::Open(spec.data_path, dopt));
  const ContextPlace place = ContextPlace::Of(a, spec);
  ASSIGN_OR_RETURN(auto sampler,
                   data::GlobalBatchSampler::Create(dataset->num_rows(), spec.global_batch, place.dp_world, spec.seed));

  const absl::Duration timeout = absl::Milliseconds(spec.step_timeout_ms);
  const bool gpu_route = a.grad_reduction() == v1::GRAD_REDUCTION_GPU && a.world_size() > 1;
  [[maybe_unused]] const bool sharded = a.param_delivery() == v1::PARAM_DELIVERY_SHARDED && a.world_size() > 1;
  absl::Duration inject_delay = absl::ZeroDuration();
  if (const char* d = getenv("SLIDEDP_INJECT_DELAY_MS")) inject_delay = absl::Milliseconds(atof(d));
  GradientPathOptions gopt;
  gopt.route = gpu_route ? GradRoute::kGpu : GradRoute::kCpu;
  gopt.rank = a.rank();
  gopt.world = a.world_size();
  gopt.ring_timeout = timeout;
  gopt.inject_max_delay = inject_delay;
  gopt.dtype = spec.grad_dtype == GradDtype::kBf16 ? shm::GradDtype::kBF16 : shm::GradDtype::kF32;
  gopt.stage_until_norm = a.grad_staging() == v1::GRAD_STAGING_DEVICE;
  if (gopt.stage_until_norm && !gpu_route && a.world_size() > 1) {
    return absl::FailedPreconditionError("grad_staging device needs grad_reduction gpu with several ranks");
  }
  if (gopt.stage_until_norm && a.has_speculate_from_unit()) {
    if (a.speculate_from_unit() < 0) {
      return absl::InvalidArgumentError(absl::StrCat("assignment: speculate_from_unit ", a.speculate_from_unit()));
    }
    gopt.speculate_from_unit = a.speculate_from_unit();
    gopt.job_state = job_state;
    gopt.hostd = job_state->owner();
  }

  // runtime.policy: a per-layer layout, made for this model (hostd checked) and this device.
  std::vector<ActPolicy> layer_policies;
  std::vector<double> offloaded;  // per unit, the share offloaded; empty: runtime.offload_ratio decides
  if (spec.layer_layout) {
    RETURN_IF_ERROR(spec.layer_layout->CheckModel(config));
    RETURN_IF_ERROR(spec.layer_layout->CheckDevice(device().name()));
    RunnableLayout(*spec.layer_layout, layout.num_units(), &layer_policies, &offloaded);
    std::string described;
    for (size_t i = 0; i < spec.layer_layout->layers.size(); ++i) {
      absl::StrAppend(&described, i == 0 ? "" : ", ", i, ":", LayerPolicyName(spec.layer_layout->layers[i]));
    }
    LOG(INFO) << "job " << a.job_id() << ": runtime.policy per-layer layout: " << described;
  }
  const NormValues norms =
      spec.norm_weights == NormWeights::kFp32 ? NormValues::kFp32FromMaster : NormValues::kBf16Mirror;
  const EmbeddingValues embedding =
      spec.embedding_rows == EmbeddingRows::kFp32 ? EmbeddingValues::kFp32FromMaster : EmbeddingValues::kBf16Mirror;
  std::unique_ptr<UnitStreamer> streamer;
  std::unique_ptr<GradientPath> grads;
  std::unique_ptr<shm::ShmCollective> collective;
  std::unique_ptr<ActivationStore> activations;  // null: layer inputs stay on the device
  if (options_.backend == BackendKind::kCpu) {
    streamer = std::make_unique<HostMirrorStreamer>(job_state, layout, timeout, norms, embedding, source,
                                                    CastThreads(spec.cast_threads, a.world_size()));
    if (gpu_route) {
      if (a.collective_segment().empty()) {
        return absl::FailedPreconditionError("grad_reduction gpu on CPU workers needs hostd's collective segment");
      }
      ASSIGN_OR_RETURN(collective, shm::ShmCollective::Attach(a.collective_segment(), a.rank(), &job_state->abort()));
    }
    grads = MakeHostGradientPath(layout, ring.get(), collective.get(), gopt);
    if (!offloaded.empty()) {
      activations = MakeHostActivationStore(backend, offloaded);
    } else if (spec.offload_ratio > 0) {
      activations = MakeHostActivationStore(layout, backend, spec.offload_ratio);
    }
  } else {
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
    NcclCommunicator* comm = nullptr;
    if (gpu_route || sharded) {
      auto c = CommunicatorFor(a);
      if (!c.ok()) {
        job_state->RaiseAbort(shm::AbortReason::kWorkerFailed);
        return Annotate(c.status(), "NCCL communicator");
      }
      comm = *c;
    }
    CudaStreamerOptions copt;
    copt.device = options_.index;
    copt.chunk_bytes = spec.chunk_bytes;
    copt.gate_timeout = timeout;
    copt.sharded_with = sharded ? comm : nullptr;
    copt.registry = host_state->registry.get();
    copt.norms = norms;
    copt.embedding = embedding;
    copt.urgent_rank = spec.copy_priority > 0 ? a.rank() : -1;  // DMA before Adam
    copt.source = source;
    copt.cast_on_device = spec.cast_on == CastOn::kDevice;
    copt.cast_threads = CastThreads(spec.cast_threads, a.world_size());
    ASSIGN_OR_RETURN(streamer, CudaWindowStreamer::Create(job_state, ring.get(), layout,
                                                          static_cast<cudaStream_t>(backend->native_stream()), copt));
    CudaGradientPathOptions cg;
    cg.base = gopt;
    cg.device = options_.index;
    cg.comm = gpu_route ? comm : nullptr;
    cg.abort = &job_state->abort();
    ASSIGN_OR_RETURN(grads,
                     MakeCudaGradientPath(layout, ring.get(), static_cast<cudaStream_t>(backend->native_stream()), cg));
    if (!offloaded.empty()) {
      ASSIGN_OR_RETURN(activations, MakeCudaActivationStore(backend, offloaded, options_.index));
    } else if (spec.offload_ratio > 0) {
      ASSIGN_OR_RETURN(activations, MakeCudaActivationStore(layout, backend, spec.offload_ratio, options_.index));
    }
#else
    return absl::UnimplementedError("this slidedp-worker was built without CUDA");
#endif
  }
  // Context parallelism: attention's keys and values through the job's context collective. The
  // backend holds the group for this job only.
  // CUDA workers with the job's NCCL communicator (hostd then sends no segment) split one per group.
  std::unique_ptr<ContextGroup> context_group;
  if (place.ranks > 1) {
    if (!a.context_segment().empty()) {
      ASSIGN_OR_RETURN(auto cc, shm::ShmCollective::Attach(a.context_segment(), place.rank, &job_state->abort()));
      context_group = std::make_unique<ShmContextGroup>(std::move(cc), timeout);
    } else {
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
      if (options_.backend != BackendKind::kCuda || !comm_ || !(gpu_route || sharded)) {
        return absl::FailedPreconditionError(
            "runtime.context_parallel needs hostd's context segment (or, on CUDA workers, the job's NCCL "
            "communicator)");
      }
      ASSIGN_OR_RETURN(context_group, NcclContextGroup::Create(*comm_, options_.index, place.dp_rank, place.rank,
                                                               timeout, &job_state->abort()));
#else
      return absl::FailedPreconditionError("runtime.context_parallel needs hostd's context segment");
#endif
    }
    LOG(INFO) << "job " << a.job_id() << ": context parallel, rank " << place.rank << " of " << place.ranks
              << " in its group (" << (context_group->device_collectives() ? "NCCL" : "shm")
              << "): each micro-batch's tokens split zig-zag, attention over the gathered keys and values";
  }
  RETURN_IF_ERROR(backend->SetContextGroup(context_group.get()));
  absl::Cleanup context_unset = [backend] { backend->SetContextGroup(nullptr).IgnoreError(); };
  // runtime.gpu_memory_limit: the parameter window and the gradient buffers are allocated above;
  // the backend's pool (activations, scratch) gets what they leave. No limit: the whole device.
  const int64_t memory_limit = GpuMemoryLimitBytes(spec, device().memory_bytes());
  const int64_t pipeline_bytes = streamer->device_bytes() + grads->device_bytes();
  if (memory_limit > 0 && memory_limit <= pipeline_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "runtime.gpu_memory_limit %.2f GiB leaves nothing for activations: the parameter window and gradient "
        "buffers alone take %.2f GiB (runtime.chunk_bytes, the largest unit; raise the limit)",
        memory_limit / 1073741824.0, pipeline_bytes / 1073741824.0));
  }
  RETURN_IF_ERROR(backend->SetMemoryLimit(memory_limit > 0 ? memory_limit - pipeline_bytes : 0));
  if (memory_limit > 0) {
    LOG(INFO) << "runtime.gpu_memory_limit " << memory_limit / 1073741824.0 << " GiB: the parameter window and "
              << "gradient buffers take " << pipeline_bytes / 1073741824.0 << " GiB, activations and scratch at most "
              << (memory_limit - pipeline_bytes) / 1073741824.0 << " GiB";
  }
  StepRunnerOptions ropt;
  ropt.policy = ToActPolicy(spec.act_policy);
  ropt.layer_policies = layer_policies;
  ropt.checkpoint_dtype = spec.checkpoint_dtype == CheckpointDtype::kBf16 ? DType::kBF16 : DType::kF32;
  if (spec.checkpoint_dtype == CheckpointDtype::kBf16) {
    LOG(INFO) << "job " << a.job_id() << ": runtime.checkpoint_dtype bf16: "
              << (CheckpointDType(*backend, ropt.checkpoint_dtype) == backend->activation_dtype()
                      ? "the layer inputs are BF16 already (BF16 residual stream)"
                      : "the layer inputs wait in BF16 between forward and backward");
  }
  ropt.router_aux_coef = spec.RouterAuxCoef(config.output_router_logits, config.router_aux_loss_coef);
  ropt.global_micro_batches = spec.global_batch / spec.micro_batch;
  ropt.inject_max_delay = inject_delay;
  if (const char* inj = getenv("SLIDEDP_INJECT_NONFINITE")) {
    ASSIGN_OR_RETURN(ropt.inject_nonfinite, ParseNonFiniteInjection(inj, a.rank()));
    LOG(WARNING) << "SLIDEDP_INJECT_NONFINITE=" << inj << ": test-only NaNs will be injected";
  }
  ropt.on_loss = [this, &a](int64_t step, double loss_sum) {
    v1::WorkerReport r;
    v1::StepLoss* l = r.mutable_step_loss();
    l->set_job_id(a.job_id());
    l->set_attempt(a.attempt());
    l->set_step(step);
    l->set_loss_sum(loss_sum);
    Send(r);
  };
  StepRunner runner(layout, backend, streamer.get(), grads.get(), ropt, activations.get());
  // runtime.policy auto without a cached layout: measured on the first step, solved, validated.
  AutoPolicySession::Options apo;
  apo.enabled = spec.policy_auto && !spec.layer_layout;
  apo.backend = backend;
  apo.layout = &layout;
  apo.capacity_bytes = memory_limit > 0 ? memory_limit : device().memory_bytes();
  apo.host_budget_bytes = PinnedBudgetBytes(a.world_size());
  apo.device_name = device().name();
  apo.build = BuildId();
  apo.world = a.world_size();
  apo.tokens_per_step = spec.global_batch * spec.seq_len;
  apo.checkpoint_dtype = ropt.checkpoint_dtype;
  // The CPU backend times a tiny model beside whatever else the machine runs (CI runs tests in
  // parallel on 2 cores): only a layout 4x slower than recompute counts as a miss there.
  apo.time_tolerance = options_.backend == BackendKind::kCpu ? 3.0 : 0.01;
  // The GPU suite's comparison against fixed layouts (docs/gpu-suite.md, autopolicy).
  const char* sweep = std::getenv("SLIDEDP_AUTOPOLICY_SWEEP");
  apo.sweep = sweep != nullptr && std::string(sweep) == "1";
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
  if (options_.backend == BackendKind::kCuda) {
    const int index = options_.index;
    apo.measure_rates = [index]() { return MeasurePinnedCopyRates(index); };
  }
#endif
  AutoPolicySession autopolicy(std::move(apo));
  // Validation (data.validation): this rank's micro-batches of the split, built once.
  ASSIGN_OR_RETURN(ValidationShare validation, OpenValidation(a, spec));

  double prev_gate = 0, prev_d2h = 0, prev_h2d = 0, prev_ring = 0, prev_cast = 0;
  for (int64_t step = a.first_step(); step < a.total_steps(); ++step) {
    if (cancel_job_ || stop_) {
      job_state->RaiseAbort(shm::AbortReason::kCancelled);
      return absl::CancelledError("job cancelled");
    }
    std::vector<int64_t> rows = sampler.RankRows(step, place.dp_rank);
    std::vector<MicroBatch> mbs;
    for (size_t i = 0; i < rows.size(); i += spec.micro_batch) {
      size_t n = std::min<size_t>(spec.micro_batch, rows.size() - i);
      absl::StatusOr<MicroBatch> mb = data::BuildMicroBatch(*dataset, absl::MakeConstSpan(rows.data() + i, n));
      if (mb.ok()) mb = place.Share(std::move(*mb));
      if (!mb.ok()) {  // e.g. the dataset was truncated under the job: tell every peer at once
        job_state->RaiseAbort(shm::AbortReason::kWorkerFailed);
        return Annotate(mb.status(), absl::StrCat("step ", step + 1));
      }
      mbs.push_back(std::move(*mb));
    }
    std::vector<int64_t> global_rows = sampler.GlobalRows(step);
    absl::StatusOr<int64_t> trained_or = data::CountTrainedLabels(*dataset, global_rows);
    if (!trained_or.ok()) {
      job_state->RaiseAbort(shm::AbortReason::kWorkerFailed);
      return Annotate(trained_or.status(), absl::StrCat("step ", step + 1));
    }
    const int64_t trained = *trained_or;
    const float loss_scale = trained > 0 ? 1.0f / static_cast<float>(trained) : 0.0f;
    auto result = runner.Run(step, mbs, loss_scale);
    if (!result.ok() && result.status().code() == absl::StatusCode::kResourceExhausted && gopt.stage_until_norm) {
      result = Annotate(result.status(), absl::StrFormat("gradient buffers hold %.2f GiB of this device, most of it "
                                                         "the step's gradients staged for exact clipping "
                                                         "(runtime.grad_staging: host keeps them in host memory)",
                                                         grads->device_bytes() / 1073741824.0));
    }
    if (!result.ok()) {
      // Tell every peer at once instead of letting them time out.
      if (result.status().code() != absl::StatusCode::kAborted) job_state->RaiseAbort(shm::AbortReason::kWorkerFailed);
      return Annotate(result.status(), absl::StrCat("step ", step));
    }
    v1::WorkerReport r;
    v1::StepDone* d = r.mutable_step_done();
    d->set_job_id(a.job_id());
    d->set_attempt(a.attempt());
    d->set_step(step);
    d->set_loss_sum(result->loss_sum);
    d->set_router_aux_loss(result->router_aux_loss);
    for (int64_t c : result->expert_tokens) d->add_expert_tokens(c);
    d->set_trained_tokens(trained);
    d->set_tokens(result->local_tokens);
    d->set_step_time_s(result->times.total_s);
    // The streamer's counters are cumulative: report this step's share.
    const double gate = streamer->gate_wait_s(), d2h = grads->d2h_s(), h2d = streamer->h2d_s();
    const double cast = streamer->cast_s();
    const double ring_wait = grads->ring_wait_s();
    d->set_gate_wait_s(gate - prev_gate);
    d->set_ring_wait_s(ring_wait - prev_ring);
    d->set_compute_busy_s(result->times.total_s - result->times.flush_s - (gate - prev_gate));
    d->set_d2h_busy_s(d2h - prev_d2h);
    d->set_h2d_busy_s(h2d - prev_h2d);
    d->set_cast_s(cast - prev_cast);
    prev_gate = gate, prev_d2h = d2h, prev_h2d = h2d, prev_ring = ring_wait, prev_cast = cast;
    const int64_t pipeline_bytes = streamer->device_bytes() + grads->device_bytes();
    const int64_t peak = backend->peak_memory_bytes() + pipeline_bytes;
    d->set_gpu_peak_bytes(peak);
    d->set_gpu_used_peak_bytes(backend->peak_used_memory_bytes() + pipeline_bytes);
    if (const std::string report = backend->MemoryReport(); !report.empty()) {
      LOG(INFO) << "step " << step + 1 << " GPU memory ledger (backend buffers; the pipeline's "
                << pipeline_bytes / 1073741824.0 << " GiB besides): " << report;
    }
    if (!Send(r)) return absl::UnavailableError("lost the session with hostd");
    if (spec.act_policy == ActivationPolicy::kAuto && !spec.layer_layout && step == a.first_step()) {
      int64_t tokens = 0;
      for (const MicroBatch& mb : mbs) tokens += mb.num_tokens();
      const int64_t capacity = memory_limit > 0 ? memory_limit : device().memory_bytes();
      const int64_t layer_bytes = backend->SavedBytesPerToken(ActPolicy::kKeepAll) * tokens;
      const int keep = KeepAllLayers(capacity, peak, layer_bytes, config.num_hidden_layers);
      runner.set_keep_all_last_layers(keep);
      LOG(INFO) << "act_policy auto: step " << step + 1 << " peaked at " << peak / 1073741824.0 << " GiB of "
                << capacity / 1073741824.0 << " GiB; the last " << keep << " of " << config.num_hidden_layers
                << " layers keep all activations (" << layer_bytes / 1073741824.0 << " GiB each)";
    }
    if (autopolicy.active()) {
      StepObservation seen;
      seen.total_s = result->times.total_s;
      seen.compute_s = d->compute_busy_s();
      seen.gate_s = d->gate_wait_s();
      seen.h2d_s = d->h2d_busy_s();
      seen.d2h_s = d->d2h_busy_s();
      seen.peak_bytes = peak;
      absl::StatusOr<std::optional<AutoPolicyChoice>> next =
          autopolicy.AfterStep(step, seen, mbs, a.total_steps() - step - 1);
      if (!next.ok()) {
        job_state->RaiseAbort(shm::AbortReason::kWorkerFailed);
        return Annotate(next.status(), "runtime.policy auto");
      }
      if (next->has_value()) {
        AutoPolicyChoice choice = std::move(**next);
        activations.reset();
        if (!choice.offloaded.empty()) {
          if (options_.backend == BackendKind::kCpu) {
            activations = MakeHostActivationStore(backend, choice.offloaded);
          } else {
#ifdef SLIDEDP_HAVE_CUDA_BACKEND
            ASSIGN_OR_RETURN(activations, MakeCudaActivationStore(backend, choice.offloaded, options_.index));
#endif
          }
          // Pinned now, not during the validation step.
          absl::Status pinned = ReserveCheckpoints(*activations, *backend, choice.policies, mbs, ropt.checkpoint_dtype);
          if (!pinned.ok()) {
            LOG(WARNING) << "job " << a.job_id() << ": " << pinned.message();
            activations.reset();
            choice = autopolicy.WithoutOffload();
          }
        }
        runner.SetLayout(choice.policies, activations.get());
        backend->ResetPeakMemory();  // the next step's peak is the validation's
      }
      if (a.rank() == 0 && autopolicy.validated() && !autopolicy.reported()) {
        v1::WorkerReport pr;
        v1::PolicyChosen* pc = pr.mutable_policy_chosen();
        pc->set_job_id(a.job_id());
        pc->set_attempt(a.attempt());
        pc->set_policy_yaml(autopolicy.chosen().layout.ToYaml());
        pc->set_step(autopolicy.validated_step());
        pc->set_step_time_s(autopolicy.validated_step_s());
        pc->set_gpu_peak_bytes(autopolicy.validated_peak_bytes());
        pc->set_selection_s(autopolicy.selection_s());
        autopolicy.set_reported();
        if (!Send(pr)) return absl::UnavailableError("lost the session with hostd");
      }
    }
    if (!validation.micro_batches_total || !EvaluatesAfter(spec, step, a.total_steps())) continue;
    // After the step's update (its gates), before the next step: every rank, the same sweeps.
    const absl::Time t_eval = absl::Now();
    absl::StatusOr<std::vector<double>> losses = runner.Evaluate(
        static_cast<uint32_t>(step + 1), validation.micro_batches, validation.per_sweep, validation.sweeps);
    if (!losses.ok()) {
      if (losses.status().code() != absl::StatusCode::kAborted) job_state->RaiseAbort(shm::AbortReason::kWorkerFailed);
      return Annotate(losses.status(), absl::StrCat("validation after step ", step + 1));
    }
    v1::WorkerReport er;
    v1::EvalDone* e = er.mutable_eval_done();
    e->set_job_id(a.job_id());
    e->set_attempt(a.attempt());
    e->set_step(step);
    for (double l : *losses) e->add_loss_sums(l);
    e->set_eval_s(absl::ToDoubleSeconds(absl::Now() - t_eval));
    if (!Send(er)) return absl::UnavailableError("lost the session with hostd");
  }
  RETURN_IF_ERROR(grads->Drain());  // device staging: the last step's parts may still be posting
  ring->Close();
  *keep = std::move(host_state);
  return absl::OkStatus();
}

}  // namespace slidedp::worker
