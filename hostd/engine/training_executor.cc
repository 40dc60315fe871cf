// TrainingExecutor: the hostd side of a SlideDP job (see training_executor.h).
#include "hostd/engine/training_executor.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>
#include <tuple>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/data/dataset.h"
#include "common/model/shard.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/checkpoint/checkpoint.h"
#include "hostd/checkpoint/parallel_for.h"
#include "hostd/state/admission.h"
#include "hostd/state/grad_ring.h"
#include "hostd/state/job_state.h"
#include "hostd/state/shm_collective.h"
#include "hostd/update/adamw_kernels.h"
#include "hostd/update/grad_norm.h"
#include "hostd/update/schedule.h"
#include "nlohmann/json.hpp"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kAggregatePiece = 1 << 20;  // elements summed per task (4 MiB)
constexpr const char* kShmDir = "/dev/shm";    // where POSIX shm names live as files

// Renames a segment file inside the shm dir (tmpfs: the pages, and every mapping, stay as they
// are); ALREADY_EXISTS rather than replacing another segment.
absl::Status RenameSegment(const std::string& from, const std::string& to) {
  const std::string a = std::string(kShmDir) + from, b = std::string(kShmDir) + to;
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_NOREPLACE) != 0) {
    return ErrnoStatus(absl::StrCat("rename ", a, " to ", b), errno);
  }
  return absl::OkStatus();
}

absl::StatusOr<Qwen3Config> ModelConfigOf(const JobSpec& spec) {
  if (!spec.model_preset.empty()) return Qwen3Config::Preset(spec.model_preset);
  return Qwen3Config::FromFile(spec.model_path + "/config.json");
}

update::LrScheduleKind ToScheduleKind(ScheduleKind k) {
  switch (k) {
    case ScheduleKind::kConstant: return update::LrScheduleKind::kConstant;
    case ScheduleKind::kLinear: return update::LrScheduleKind::kLinear;
    case ScheduleKind::kCosine: return update::LrScheduleKind::kCosine;
  }
  return update::LrScheduleKind::kConstant;
}

// Optimizer steps of a job: train.steps, or train.epochs over the dataset's rows (rounded up).
int64_t StepsOf(const JobSpec& spec, int64_t num_rows) {
  if (spec.steps > 0) return spec.steps;
  return std::max<int64_t>(1, static_cast<int64_t>(std::ceil(spec.epochs * num_rows / spec.global_batch)));
}


// Squared norm of one posted chunk, keyed by where it sits, so the step's norm is summed in
// (unit, offset) order whatever order the ranks' chunks arrived in.
struct ChunkSquares {
  int unit;
  int64_t offset;
  double squares;
};

// Tracks, for the step being aggregated, which units are complete and which updates are done.
struct StepProgress {
  absl::Mutex mu;
  int updates_pending ABSL_GUARDED_BY(mu) = 0;
  std::vector<int64_t> unit_left ABSL_GUARDED_BY(mu);  // elements of each unit not yet updated
  absl::Status first_error ABSL_GUARDED_BY(mu);
  absl::Time first_submit ABSL_GUARDED_BY(mu) = absl::InfiniteFuture();  // the step's first update
};

}  // namespace

TrainingExecutor::TrainingExecutor(TrainingExecutorOptions options)
    : options_(std::move(options)), instance_token_(absl::StrCat(getpid(), "-", absl::ToUnixMillis(absl::Now()))) {}
TrainingExecutor::~TrainingExecutor() {
  if (pooled_) {
    (void)state::UnlinkSegment(pooled_name_);
    for (const auto& w : pooled_holders_) {  // no wait: hostd is stopping, their sessions end too
      v1::HostCommand c;
      c.mutable_release_host_state()->set_segment(pooled_name_);
      w->commands().Push(c);
    }
  }
}

void TrainingExecutor::ReleaseWorkerMappings(const std::vector<std::shared_ptr<WorkerSession>>& holders,
                                             const std::string& segment) {
  const absl::Time t0 = absl::Now();
  std::vector<std::shared_ptr<WorkerSession>> waiting;
  for (const auto& w : holders) {
    v1::HostCommand c;
    c.mutable_release_host_state()->set_segment(segment);
    if (w->commands().Push(c)) waiting.push_back(w);
  }
  const absl::Time deadline = t0 + absl::Seconds(5);
  for (const auto& w : waiting) {
    // Between jobs a worker reports nothing else that matters: earlier reports are stale.
    while (!w->gone()) {
      const absl::Duration left = deadline - absl::Now();
      if (left <= absl::ZeroDuration()) {
        LOG(WARNING) << "worker " << w->id() << " did not confirm releasing " << segment << " within 5 s";
        break;
      }
      auto rep = w->reports().Pop(std::min(left, absl::Milliseconds(100)));
      if (rep && rep->has_host_state_released()) break;
    }
  }
  if (!waiting.empty()) {
    LOG(INFO) << waiting.size() << " worker(s) released " << segment << " in " << absl::ToDoubleSeconds(absl::Now() - t0)
              << " s";
  }
}

std::unique_ptr<state::JobState> TrainingExecutor::TakePooled(const ModelLayout& layout) {
  if (!pooled_) return nullptr;
  std::unique_ptr<state::JobState> js = std::move(pooled_);
  const uint64_t needed = state::JobState::SegmentBytes(layout);
  if (needed == js->bytes()) {
    // Its holders find it mapped (and registered) again through its new name.
    adopted_holders_ = std::move(pooled_holders_);
    pooled_holders_.clear();
    return js;
  }
  if (needed < js->bytes() && needed >= js->bytes() / 2) {
    // Laid out again in AdoptPooled and shrunk: kept mappings would cover a shorter file.
    ReleaseWorkerMappings(pooled_holders_, pooled_name_);
    pooled_holders_.clear();
    return js;
  }
  LOG(INFO) << "freeing the pooled host state (" << js->bytes() / 1e9 << " GB): the next job needs " << needed / 1e9
            << " GB";
  (void)state::UnlinkSegment(pooled_name_);
  js.reset();
  ReleaseWorkerMappings(pooled_holders_, pooled_name_);  // their mappings hold the pages too
  pooled_holders_.clear();
  return nullptr;
}

absl::StatusOr<std::unique_ptr<state::JobState>> TrainingExecutor::AdoptPooled(std::unique_ptr<state::JobState> pooled,
                                                                                const std::string& job_id,
                                                                                const ModelLayout& layout,
                                                                                int prefault_threads) {
  const std::string pool_name = pooled_name_;
  absl::StatusOr<std::string> name = state::MakeSegmentName(options_.node_name, job_id, "state");
  absl::Status renamed = name.ok() ? RenameSegment(pool_name, *name) : name.status();
  if (!renamed.ok()) {
    (void)state::UnlinkSegment(pool_name);
    return renamed;
  }
  if (state::JobState::SegmentBytes(layout) == pooled->bytes()) {
    // The same size: re-lay it out through the mapping kept in the pool (no remap, no prefault).
    state::JobStateOptions o;
    auto relaid = state::JobState::Relayout(std::move(pooled), *name, job_id, layout, o);
    if (!relaid.ok()) (void)state::UnlinkSegment(*name);
    return relaid;
  }
  pooled.reset();  // this mapping goes; the pages stay in the (renamed) file
  // The same layout or a smaller one: hostd/state lays the file out again in place (header,
  // region table, a fresh control block with every gate at version 0), keeping its pages.
  state::JobStateOptions o;
  o.prefault_threads = prefault_threads;
  auto reformatted = state::JobState::Reformat(*name, job_id, layout, o);
  if (!reformatted.ok()) (void)state::UnlinkSegment(*name);
  return reformatted;
}

void TrainingExecutor::ReturnToPool(std::unique_ptr<state::JobState> js,
                                    std::vector<std::shared_ptr<WorkerSession>> holders) {
  if (pooled_) {  // at most one pooled segment
    (void)state::UnlinkSegment(pooled_name_);
    pooled_.reset();
    ReleaseWorkerMappings(pooled_holders_, pooled_name_);
    pooled_holders_.clear();
  }
  absl::StatusOr<std::string> pool_name = state::MakeSegmentName(options_.node_name, "pool", "pooled");
  absl::Status s = pool_name.ok() ? RenameSegment(js->segment_name(), *pool_name) : pool_name.status();
  if (!s.ok()) {
    LOG(WARNING) << "cannot pool " << js->segment_name() << ": " << s;
    const std::string name = js->segment_name();
    (void)js->Unlink();
    js.reset();
    ReleaseWorkerMappings(holders, name);
    return;
  }
  pooled_name_ = *pool_name;
  pooled_ = std::move(js);
  pooled_holders_ = std::move(holders);
}

absl::StatusOr<update::LayerAdam*> TrainingExecutor::Adam() {
  absl::MutexLock l(&mu_);
  if (!adam_) {
    update::LayerAdamOptions o;
    o.num_threads = options_.update_threads;
    o.pinning = options_.pinning;
    ASSIGN_OR_RETURN(adam_, update::LayerAdam::Create(o));
    LOG(INFO) << "LayerAdam: " << adam_->num_threads() << " threads on " << adam_->num_numa_nodes() << " NUMA node(s), "
              << update::AdamIsaName(adam_->isa());
  }
  return adam_.get();
}

absl::Status TrainingExecutor::Validate(const JobSpec& spec) {
  ASSIGN_OR_RETURN(Qwen3Config config, ModelConfigOf(spec));
  if (spec.seq_len > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("train.seq_len ", spec.seq_len, " exceeds the model's max_position_embeddings ",
                                                   config.max_position_embeddings));
  }
  // The dataset is checked here, before any host state is allocated: manifest, file sizes
  // (truncation is DATA_LOSS), and token ids against the model's vocabulary.
  data::ReaderOptions dopt;
  dopt.model_vocab_size = config.vocab_size;
  dopt.verify_checksums = data::VerifyChecksums::kNo;  // a full read; sizes and ranges catch truncation
  ASSIGN_OR_RETURN(auto dataset, data::DatasetReader::Open(spec.data_path, dopt));
  if (dataset->num_rows() < spec.global_batch) {
    return absl::InvalidArgumentError(absl::StrCat("data.path: the dataset has ", dataset->num_rows(),
                                                   " rows, fewer than train.global_batch ", spec.global_batch));
  }
  if (dataset->manifest().seq_len > spec.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("data.path: the dataset was prepared with seq_len ",
                                                   dataset->manifest().seq_len, ", longer than train.seq_len ", spec.seq_len));
  }
  update::LrScheduleConfig sc;
  sc.kind = ToScheduleKind(spec.schedule);
  sc.base_lr = spec.lr;
  sc.warmup_steps = spec.warmup_steps;
  sc.total_steps = StepsOf(spec, dataset->num_rows());
  sc.min_lr = spec.min_lr;
  return Annotate(update::LrSchedule::Create(sc).status(), "schedule");
}

std::string TrainingExecutor::MembershipKey(const JobContext& ctx) const {
  std::string key = absl::StrCat("g", comm_generation_.load(), ".", instance_token_, "|");
  for (size_t r = 0; r < ctx.workers().size(); ++r) {
    absl::StrAppend(&key, r > 0 ? "," : "", ctx.workers()[r]->id(), "#", ctx.workers()[r]->serial());
  }
  return key;
}

absl::Status TrainingExecutor::Run(JobContext& ctx) {
  absl::Status status = RunAttempt(ctx);
  // A failed or cancelled attempt may have left communicators inside a collective: the next job
  // gets a new membership key, so every worker rebuilds its communicator.
  if (!status.ok()) comm_generation_.fetch_add(1);
  return status;
}

absl::Status TrainingExecutor::RunAttempt(JobContext& ctx) {
  const absl::Time attempt_start = absl::Now();
  JobSpec spec = ctx.spec();
  const int world = static_cast<int>(ctx.workers().size());
  if (spec.global_batch % (int64_t{world} * spec.micro_batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("train.global_batch ", spec.global_batch, " is not divisible by ", world,
                                                   " worker(s) x train.micro_batch ", spec.micro_batch));
  }
  if (spec.steps <= 0) {  // train.epochs: the step count follows from the dataset's rows
    data::ReaderOptions dopt;
    dopt.verify_checksums = data::VerifyChecksums::kNo;
    ASSIGN_OR_RETURN(auto dataset, data::DatasetReader::Open(spec.data_path, dopt));
    spec.steps = StepsOf(spec, dataset->num_rows());
    const double epochs = spec.epochs;
    spec.epochs = 0;  // workers get the resolved step count
    ctx.Log(absl::StrCat(epochs, " epoch(s) of ", dataset->num_rows(), " rows in batches of ", spec.global_batch,
                         " = ", spec.steps, " steps"));
  }
  ASSIGN_OR_RETURN(Qwen3Config config, ModelConfigOf(spec));
  const ModelLayout layout = ModelLayout::Build(config);
  const int num_units = layout.num_units();
  const bool clip = spec.max_grad_norm > 0;

  // ---- gradient route ----
  // gpu: every rank reduce-scatters each unit's gradient and posts only its own, already summed
  // shard (common/model/shard.h); hostd applies the shards as they come, summing nothing. One rank
  // has nothing to reduce: it takes the cpu route (the same chunks, the direct path below).
  const bool gpu_route = spec.grad_reduction == GradReduction::kGpu && world > 1;
  int cpu_workers = 0;
  for (const auto& w : ctx.workers()) cpu_workers += w->hello().device().kind() == "cpu";
  if (gpu_route && cpu_workers != 0 && cpu_workers != world) {
    return absl::FailedPreconditionError(absl::StrCat("runtime.grad_reduction gpu needs workers of one backend; ", cpu_workers,
                                                      " of ", world, " are CPU-backend (use grad_reduction: cpu)"));
  }
  // CPU-backend workers reduce-scatter through a shm collective segment hostd creates for the job.
  const bool shm_collective = gpu_route && cpu_workers == world;
  uint64_t collective_buffer_bytes = 0;
  if (shm_collective) {
    for (const UnitLayout& u : layout.units) {
      collective_buffer_bytes = std::max<uint64_t>(collective_buffer_bytes, static_cast<uint64_t>(PaddedNumel(u.numel, world)) * 4);
    }
  }
  // ---- where gradients wait for the clipping norm ----
  // With the gpu route (or one rank) every posted part is final, so each rank can keep its parts
  // on its GPU until backward ends, post its squared norm, then its parts in forward order; hostd
  // applies them with the coefficient straight from the rings and stages nothing ("device").
  // Otherwise hostd stages the whole step's gradient (FP32, 4 bytes per parameter) in its memory.
  // auto: device where the rank's parts take at most 40% of the smallest worker's device memory.
  const bool parts_final = gpu_route || world == 1;
  if (spec.grad_staging == GradStaging::kDevice && !parts_final) {
    return absl::InvalidArgumentError("runtime.grad_staging device needs runtime.grad_reduction gpu (or one worker): "
                                      "with grad_reduction cpu hostd sums the ranks' gradients, so only it knows the norm");
  }
  bool device_staging = false;
  if (clip && parts_final && spec.grad_staging != GradStaging::kHost) {
    int64_t min_device_bytes = INT64_MAX;
    for (const auto& w : ctx.workers()) min_device_bytes = std::min<int64_t>(min_device_bytes, w->hello().device().memory_bytes());
    const int64_t part_bytes = PaddedNumel(layout.total_numel, world) / world * 4;
    device_staging = spec.grad_staging == GradStaging::kDevice || part_bytes <= min_device_bytes / 10 * 4;
  }
  std::vector<int64_t> shard_numel_of_rank(world, 0);  // elements each rank posts per step
  for (int r = 0; r < world; ++r) {
    for (const UnitLayout& u : layout.units) shard_numel_of_rank[r] += gpu_route ? ShardOf(u.numel, world, r).numel : u.numel;
  }

  // ---- admission, then state ----
  const state::GradRingConfig ring_config = state::RingConfigFor(layout, spec.ring_slots, spec.chunk_bytes);
  // Device staging keeps the step's gradients on the GPUs: no staging in the host plan.
  state::JobMemoryPlan plan = state::PlanJobMemory(
      layout, ring_config, world, clip && !device_staging ? state::ClipMode::kExactGlobalNorm : state::ClipMode::kNone,
      state::GradDtype::kF32);
  // The aggregation buffer is process memory of hostd (not shm); the cpu route with several ranks
  // needs it even without clipping (the ranks' copies are summed there). One rank without
  // clipping (direct) and the gpu route without clipping: LayerAdam reads gradients straight from
  // the ring slots (a slot is released when its update is done), so no staging buffer at all.
  const bool direct = !clip && world == 1;
  // Device staging and the gpu route: one consumer per rank applies its final parts.
  const bool shard_consumers = gpu_route || device_staging;
  // Host staging: for the clipping norm when the ranks do not bring it (host staging), or to sum
  // the ranks' full copies (cpu route, several ranks). Shard consumers apply straight from the
  // rings, so one rank with device staging stages nothing either.
  const bool need_staging = (clip && !device_staging) || (!direct && !shard_consumers);
  const uint64_t staging_bytes = static_cast<uint64_t>(layout.total_numel) * 4;
  if (need_staging && !clip) {  // (with clipping the plan has it)
    plan.step_staging_bytes = staging_bytes;
    plan.total_bytes += staging_bytes;
  }
  // Each worker's offloaded layer inputs: its rows of the step, seq_len tokens each.
  state::AddActivationOffload(layout, spec.offload_ratio, world, spec.global_batch / world * spec.seq_len, plan);
  if (shm_collective) {
    const uint64_t coll_bytes = state::ShmCollective::SegmentBytes(world, collective_buffer_bytes);
    plan.shm_bytes += coll_bytes;
    plan.total_bytes += coll_bytes;
  }
  // A pooled segment of this layout is reused (its memory counts as available to this job);
  // any other pooled segment is freed first, as this job may need its memory.
  std::unique_ptr<state::JobState> reusable = TakePooled(layout);
  absl::Cleanup keep_pool = [&] {
    // Refused before adopting it: back into the pool (its file still has the pool's name).
    if (reusable && !pooled_) {
      pooled_ = std::move(reusable);
      pooled_holders_ = std::move(adopted_holders_);
      adopted_holders_.clear();
    }
  };
  ASSIGN_OR_RETURN(state::HostMemoryInfo host, state::ReadHostMemoryInfo());
  if (reusable) {
    host.mem_available_bytes += reusable->bytes();
    host.shm_free_bytes += reusable->bytes();
  }
  RETURN_IF_ERROR(state::CheckAdmission(plan, host));
  ctx.SetHostStateBytes(static_cast<int64_t>(plan.total_bytes));
  ctx.Log(absl::StrCat("host state: ", plan.ToString(),
                       shm_collective ? absl::StrFormat(" + shm collective %.2f GiB",
                                                        state::ShmCollective::SegmentBytes(world, collective_buffer_bytes) / double(1ull << 30))
                                      : std::string()));
  ctx.Log(absl::StrCat("gradient reduction: ",
                       gpu_route ? (shm_collective ? "gpu route (CPU workers: shm reduce-scatter), hostd applies each rank's shard"
                                                   : "gpu route (NCCL reduce-scatter), hostd applies each rank's shard")
                                 : (world > 1 ? "cpu (hostd sums the ranks' gradients)" : "single rank (no reduction)"),
                       "; parameter delivery: ", ToString(spec.param_delivery),
                       clip ? (device_staging ? "; clipping: device staging (each rank keeps its gradient parts on its GPU "
                                                "until the norm is known)"
                                              : "; clipping: host staging (hostd keeps the step's gradients)")
                            : ""));

  ASSIGN_OR_RETURN(update::LayerAdam * adam, Adam());
  state::JobStateOptions sopt;
  sopt.prefault_threads = std::max(1, std::min(16, adam->num_threads()));
  std::unique_ptr<state::JobState> job_state;
  bool reused_state = false;
  if (reusable) {
    const uint64_t bytes = reusable->bytes();
    const absl::Time t0 = absl::Now();
    auto adopted = AdoptPooled(std::move(reusable), ctx.job_id(), layout, sopt.prefault_threads);
    if (adopted.ok()) {
      job_state = std::move(*adopted);
      reused_state = true;
      ctx.Log(absl::StrFormat("reused pooled host state (%.2f GB, %.2f s)", bytes / 1e9, absl::ToDoubleSeconds(absl::Now() - t0)));
    } else {
      LOG(WARNING) << "job " << ctx.job_id() << ": cannot reuse the pooled host state: " << adopted.status();
    }
  }
  if (!job_state) {
    ASSIGN_OR_RETURN(job_state, state::JobState::Create(options_.node_name, ctx.job_id(), layout, sopt));
  }
  std::vector<std::unique_ptr<state::GradRing>> rings;
  std::unique_ptr<state::ShmCollective> collective;
  // Set once the job succeeded and every worker reported its end (none uses the segment any more).
  bool poolable = false;
  absl::Cleanup unlink = [&] {
    // Whatever ended the job, wake every worker still waiting on a gate, ring slot or collective
    // of it (a no-op after success: the workers have already reported the end of the job).
    job_state->RaiseAbort(state::AbortReason::kShutdown);
    for (auto& r : rings) (void)r->Unlink();
    if (collective) (void)collective->Unlink();
    std::vector<std::shared_ptr<WorkerSession>> holders = ctx.workers();
    for (auto& w : adopted_holders_) {
      if (std::find(holders.begin(), holders.end(), w) == holders.end()) holders.push_back(w);
    }
    adopted_holders_.clear();
    if (poolable && options_.pool_host_state) {
      ReturnToPool(std::move(job_state), std::move(holders));
    } else {
      // Workers keep a job's mapping after they finished it successfully: tell them it is gone.
      const std::string name = job_state->segment_name();
      (void)job_state->Unlink();
      job_state.reset();
      ReleaseWorkerMappings(holders, name);
    }
  };
  for (int r = 0; r < world; ++r) {
    ASSIGN_OR_RETURN(auto ring, state::GradRing::Create(options_.node_name, ctx.job_id(), r, ring_config,
                                                         state::RingRole::kConsumer, &job_state->abort()));
    rings.push_back(std::move(ring));
  }
  if (shm_collective) {
    ASSIGN_OR_RETURN(collective, state::ShmCollective::Create(options_.node_name, ctx.job_id(), world, collective_buffer_bytes,
                                                              &job_state->abort()));
  }

  // ---- NUMA placement: each unit's state lives on the node of the LayerAdam threads that own
  // it; the owners touch (and, where pages already sit elsewhere, migrate) it before use ----
  std::vector<int64_t> unit_bytes(num_units);
  for (int u = 0; u < num_units; ++u) unit_bytes[u] = layout.units[u].numel * 14;
  const std::vector<int> placement = adam->AssignNumaNodes(unit_bytes);
  std::vector<update::UnitMemory> memory(num_units);
  for (int u = 0; u < num_units; ++u) {
    memory[u] = update::UnitMemory{job_state->master(u), job_state->m(u), job_state->v(u), job_state->mirror(u),
                                   layout.units[u].numel, placement[u]};
    if (adam->num_numa_nodes() > 1) RETURN_IF_ERROR(adam->FirstTouch(memory[u]));
  }

  if (reused_state && ctx.resume_from().empty()) {
    // A fresh segment is zero: so must the moments of a reused one be. (Master is written whole
    // below, padding included, by the random init or the weight loader; a resumed job's
    // checkpoint writes all three.) In pieces, so the embedding does not leave one thread alone.
    std::vector<std::pair<int, int64_t>> pieces;
    for (int u = 0; u < num_units; ++u) {
      for (int64_t off = 0; off < layout.units[u].numel; off += 16 * kAggregatePiece) pieces.emplace_back(u, off);
    }
    checkpoint::ParallelFor(pieces.size(), std::max(1, sopt.prefault_threads), [&](size_t p) {
      const auto [u, off] = pieces[p];
      const size_t n = static_cast<size_t>(std::min<int64_t>(16 * kAggregatePiece, layout.units[u].numel - off));
      std::memset(job_state->m(u) + off, 0, n * sizeof(float));
      std::memset(job_state->v(u) + off, 0, n * sizeof(float));
    });
  }

  // ---- initial weights ----
  checkpoint::StateArrays arrays;
  arrays.master = [&](int u) { return job_state->master(u); };
  arrays.adam_m = [&](int u) { return job_state->m(u); };
  arrays.adam_v = [&](int u) { return job_state->v(u); };
  int64_t first_step = 0;
  if (!ctx.resume_from().empty()) {
    std::string dir = ctx.resume_from();
    if (!fs::exists(fs::path(dir) / "COMPLETE")) {
      ASSIGN_OR_RETURN(dir, checkpoint::FindLatestCheckpoint(dir));
    }
    ASSIGN_OR_RETURN(auto loaded, checkpoint::LoadCheckpoint(dir, layout, arrays));
    first_step = loaded.step;
    ctx.Log(absl::StrCat("resumed from ", dir, " at step ", first_step));
  } else if (!spec.model_path.empty()) {
    RETURN_IF_ERROR(checkpoint::LoadHfModel(spec.model_path, layout, arrays.master));
    ctx.Log(absl::StrCat("loaded weights from ", spec.model_path));
  } else {
    checkpoint::InitRandom(layout, spec.init_seed, arrays.master);
    ctx.Log(absl::StrCat("random init (seed ", spec.init_seed, ")"));
  }
  // The BF16 mirror of the initial weights, in pieces over the prefault threads (one thread
  // converts only ~1 Gparam/s: seconds for a 4B model).
  {
    struct Piece {
      int unit;
      int64_t offset, numel;
    };
    std::vector<Piece> pieces;
    for (int u = 0; u < num_units; ++u) {
      for (int64_t off = 0; off < layout.units[u].numel; off += 16 * kAggregatePiece) {
        pieces.push_back({u, off, std::min<int64_t>(16 * kAggregatePiece, layout.units[u].numel - off)});
      }
    }
    checkpoint::ParallelFor(pieces.size(), std::max(1, sopt.prefault_threads), [&](size_t p) {
      const Piece& pc = pieces[p];
      const float* w = job_state->master(pc.unit) + pc.offset;
      bf16_t* mirror = job_state->mirror(pc.unit) + pc.offset;
      for (int64_t i = 0; i < pc.numel; ++i) mirror[i] = FloatToBf16(w[i]);
    });
  }
  for (int u = 0; u < num_units; ++u) job_state->version(u).Publish(static_cast<uint32_t>(first_step));
  ctx.Log(absl::StrFormat("host state ready in %.2f s after the job started (%s)",
                          absl::ToDoubleSeconds(absl::Now() - attempt_start), reused_state ? "pooled segment" : "new segment"));
  job_state->step_counter().store(first_step);
  if (first_step >= spec.steps) {
    return absl::FailedPreconditionError(absl::StrCat("checkpoint is at step ", first_step, ", the job has ", spec.steps));
  }

  update::LrScheduleConfig sc;
  sc.kind = ToScheduleKind(spec.schedule);
  sc.base_lr = spec.lr;
  sc.warmup_steps = spec.warmup_steps;
  sc.total_steps = spec.steps;
  sc.min_lr = spec.min_lr;
  ASSIGN_OR_RETURN(update::LrSchedule schedule, update::LrSchedule::Create(sc));

  // Gradient staging (tens of GB for large models): allocated and first touched in parallel
  // before the workers are assigned, so neither the first step nor the NCCL id relay waits on it.
  std::vector<std::vector<float>> staging(num_units);
  if (need_staging) {
    checkpoint::ParallelFor(num_units, std::max(1, sopt.prefault_threads),
                            [&](size_t u) { staging[u].resize(layout.units[u].numel); });
  }
  int64_t staging_bytes_held = 0;  // (what the metrics report: the plan above must have counted it)
  for (const std::vector<float>& s : staging) staging_bytes_held += static_cast<int64_t>(s.size() * sizeof(float));

  // ---- assignments ----
  const std::string membership_key = world > 1 ? MembershipKey(ctx) : std::string();
  for (int r = 0; r < world; ++r) {
    v1::HostCommand cmd;
    v1::Assignment* a = cmd.mutable_assign();
    a->set_job_id(ctx.job_id());
    a->set_rank(r);
    a->set_world_size(world);
    a->set_resolved_spec_yaml(spec.ToYaml());
    a->set_state_segment(job_state->segment_name());
    a->set_ring_segment(rings[r]->segment_name());
    a->set_first_step(first_step);
    a->set_total_steps(spec.steps);
    a->set_data_path(spec.data_path);
    a->set_attempt(ctx.attempt());
    a->set_grad_reduction(gpu_route ? "gpu" : "cpu");
    a->set_param_delivery(ToString(spec.param_delivery));
    if (collective) a->set_collective_segment(collective->segment_name());
    if (world > 1) a->set_membership_key(membership_key);
    a->set_grad_staging(device_staging ? "device" : "host");
    if (!ctx.workers()[r]->commands().Push(cmd)) return absl::UnavailableError("a worker disconnected before its assignment");
  }
  ctx.SetTotalSteps(spec.steps);
  ctx.SetState(v1::JOB_STATE_RUNNING);
  fs::create_directories(spec.output_dir);
  std::ofstream metrics_file(fs::path(spec.output_dir) / absl::StrCat("metrics-", ctx.job_id(), ".jsonl"), std::ios::app);

  // ---- reports from workers: step results and failures ----
  std::map<int64_t, std::vector<v1::StepDone>> step_reports;
  std::vector<bool> finished(world, false);
  // Called from the ranks' consumer threads too (gpu route): one at a time.
  absl::Mutex poll_mu;
  auto poll_workers = [&]() -> absl::Status {
    absl::MutexLock poll_lock(&poll_mu);
    for (int r = 0; r < world; ++r) {
      auto& w = ctx.workers()[r];
      while (auto rep = w->reports().Pop(absl::ZeroDuration())) {
        if (rep->has_comm_id()) {
          // Rank 0 made the NCCL unique id of this job's communicator: the other ranks wait for
          // it (forwarded unchanged) before ncclCommInitRank. Ids of other jobs or attempts are stale.
          const v1::CommId& id = rep->comm_id();
          if (r != 0 || id.job_id() != ctx.job_id() || id.attempt() != ctx.attempt()) continue;
          for (int k = 1; k < world; ++k) {
            v1::HostCommand c;
            *c.mutable_comm_id() = id;
            if (!ctx.workers()[k]->commands().Push(c)) {
              job_state->RaiseAbort(state::AbortReason::kPeerDied);
              return absl::UnavailableError(absl::StrCat("worker ", ctx.workers()[k]->id(), " (rank ", k,
                                                         ") disconnected before its communicator id"));
            }
          }
          continue;
        }
        if (!rep->has_step_done() && !rep->has_job_finished()) continue;
        // A worker may still report the end of an earlier job or attempt (e.g. one that failed).
        const std::string& about = rep->has_step_done() ? rep->step_done().job_id() : rep->job_finished().job_id();
        const int attempt = rep->has_step_done() ? rep->step_done().attempt() : rep->job_finished().attempt();
        if (about != ctx.job_id() || attempt != ctx.attempt()) continue;
        if (rep->has_step_done()) step_reports[rep->step_done().step()].push_back(rep->step_done());
        if (rep->has_job_finished()) {
          finished[r] = true;
          if (rep->job_finished().code() != 0) {
            job_state->RaiseAbort(state::AbortReason::kWorkerFailed);
            return absl::Status(static_cast<absl::StatusCode>(rep->job_finished().code()),
                                absl::StrCat("worker ", w->id(), " (rank ", r, "): ", rep->job_finished().message()));
          }
        }
      }
      if (w->gone() && !finished[r]) {
        job_state->RaiseAbort(state::AbortReason::kPeerDied);
        return absl::UnavailableError(absl::StrCat("worker ", w->id(), " (rank ", r, ", pid ", w->hello().pid(),
                                                   ") disconnected during the job"));
      }
    }
    return absl::OkStatus();
  };
  // Cancel takes effect between steps: every unit then has exactly the updates of the steps
  // done, so the state (and a checkpoint of it) is consistent.
  auto stop_workers = [&]() {
    job_state->RaiseAbort(state::AbortReason::kCancelled);
    for (auto& w : ctx.workers()) {
      v1::HostCommand c;
      c.set_cancel_job_id(ctx.job_id());
      w->commands().Push(c);
    }
  };

  // Pops the next chunk of a ring, checking workers and cancellation between short waits.
  const absl::Duration step_timeout = absl::Milliseconds(spec.step_timeout_ms);
  // Short slices while waiting for the first gradients: rank 0's communicator id is forwarded
  // from here, and the other ranks' NCCL setup waits on it.
  auto pop = [&](int r, bool first) -> absl::StatusOr<state::GradChunkDesc> {
    absl::Time deadline = absl::Now() + step_timeout;
    while (true) {
      auto d = rings[r]->Pop(absl::Milliseconds(first ? 10 : 100));
      if (d.ok()) return d;
      if (d.status().code() != absl::StatusCode::kDeadlineExceeded) {
        // Prefer the worker's own error: a failing worker raises the abort before its report
        // reaches us, so give the report a moment to arrive.
        const absl::Time report_deadline = absl::Now() + absl::Seconds(2);
        do {
          RETURN_IF_ERROR(poll_workers());
          if (job_state->abort().reason() != state::AbortReason::kWorkerFailed) break;
          absl::SleepFor(absl::Milliseconds(5));
        } while (absl::Now() < report_deadline);
        return Annotate(d.status(), absl::StrCat("gradient ring of rank ", r));
      }
      RETURN_IF_ERROR(poll_workers());
      if (absl::Now() > deadline) {
        job_state->RaiseAbort(state::AbortReason::kInternal);
        return absl::DeadlineExceededError(absl::StrCat("no gradient from rank ", r, " for ",
                                                        absl::FormatDuration(step_timeout), " (runtime.step_timeout_ms)"));
      }
    }
  };

  const double flops_per_token = layout.ModelFlopsPerToken(spec.seq_len);
  const int aggregate_threads = std::clamp(adam->num_threads(), 1, 8);
  std::string last_checkpoint;
  absl::Time step_start = absl::Now();
  const absl::Time run_start = absl::Now();

  auto save = [&](int64_t steps_done) -> absl::Status {
    ctx.SetState(v1::JOB_STATE_SAVING);
    checkpoint::SaveRequest req;
    req.root_dir = spec.output_dir;
    req.step = steps_done;
    req.layout = &layout;
    req.arrays = arrays;
    req.weight_dtype = spec.save_dtype == SaveDtype::kF32 ? checkpoint::WeightDtype::kF32 : checkpoint::WeightDtype::kBF16;
    req.keep_last = static_cast<int>(spec.keep_last);
    req.trainer_state = {{"step", steps_done},
                         {"job_id", ctx.job_id()},
                         {"data_seed", spec.seed},
                         {"init_seed", spec.init_seed},
                         {"world_size", world},
                         {"spec", spec.ToYaml()}};
    ASSIGN_OR_RETURN(auto result, checkpoint::SaveCheckpoint(req));
    last_checkpoint = result.dir;
    ctx.SetLastCheckpoint(result.dir);
    ctx.Log(absl::StrFormat("checkpoint saved to %s (%.2f GB in %.1f s)", result.dir, result.bytes_written / 1e9, result.seconds));
    if (steps_done < spec.steps) ctx.SetState(v1::JOB_STATE_RUNNING);
    return absl::OkStatus();
  };

  for (int64_t t = first_step; t < spec.steps; ++t) {
    if (ctx.cancel_requested()) {
      if (ctx.checkpoint_on_cancel() && t > first_step) {
        absl::Status saved = save(t);
        stop_workers();
        RETURN_IF_ERROR(saved);
        return absl::CancelledError(absl::StrCat("cancelled at step ", t, " (hostd draining); checkpoint ", last_checkpoint));
      }
      stop_workers();
      return absl::CancelledError(absl::StrCat("cancelled at step ", t));
    }
    std::vector<int64_t> received(num_units, 0);
    int complete_units = 0;
    double aggregate_s = 0, wait_s = 0;
    double sum_squares = 0;
    StepProgress progress;
    {
      absl::MutexLock l(&progress.mu);
      for (int u = 0; u < num_units; ++u) progress.unit_left.push_back(layout.units[u].numel);
    }
    const double lr = schedule.LrAt(t);
    update::AdamWStepParams params;
    params.lr = lr;
    params.beta1 = spec.beta1;
    params.beta2 = spec.beta2;
    params.eps = spec.eps;
    params.weight_decay = spec.weight_decay;
    params.step = t + 1;
    // Updates a range of unit u; the unit's gate opens (version t+1) when its last range is done.
    // `grad` defaults to the staging buffer; with `release_ring`, `release_slot` of that ring is
    // returned once the update has read it (gradients applied straight from a ring slot).
    auto apply = [&](int u, int64_t offset, int64_t numel, float grad_scale, const float* grad = nullptr,
                     state::GradRing* release_ring = nullptr, uint32_t release_slot = 0) -> absl::Status {
      update::AdamWStepParams p = params;
      p.grad_scale = grad_scale;
      {
        absl::MutexLock l(&progress.mu);
        progress.updates_pending++;
        if (progress.first_submit == absl::InfiniteFuture()) progress.first_submit = absl::Now();
      }
      state::VersionGate* gate = &job_state->version(u);
      const uint32_t next = static_cast<uint32_t>(t + 1);
      absl::Status submitted = adam->SubmitChunk(
          memory[u], offset, numel, grad != nullptr ? grad : staging[u].data() + offset, p,
          [gate, next, u, numel, release_ring, release_slot, &progress](absl::Status s) {
            if (release_ring != nullptr) {
              absl::Status released = release_ring->Release(release_slot);
              if (s.ok()) s = released;
            }
            absl::MutexLock l(&progress.mu);
            if (!s.ok() && progress.first_error.ok()) progress.first_error = s;
            progress.unit_left[u] -= numel;
            if (progress.unit_left[u] == 0 && progress.first_error.ok()) gate->Publish(next);
            progress.updates_pending--;
          });
      if (!submitted.ok()) {  // `done` will not run
        absl::MutexLock l(&progress.mu);
        progress.updates_pending--;
      }
      return submitted;
    };
    // Wait for all submitted updates of this step even when we leave early (they touch staging).
    absl::Cleanup drain = [&] {
      absl::MutexLock l(&progress.mu);
      auto idle = [&progress]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(progress.mu) { return progress.updates_pending == 0; };
      progress.mu.Await(absl::Condition(&idle));
    };

    float coef = 1.0f;  // device staging: the clipping coefficient, known before any part arrives
    if (device_staging) {
      // Each rank posts its squared norm before its parts; sum them in rank order.
      for (int r = 0; r < world; ++r) {
        const absl::Time t_wait = absl::Now();
        ASSIGN_OR_RETURN(state::GradChunkDesc d, pop(r, t == first_step));
        wait_s += absl::ToDoubleSeconds(absl::Now() - t_wait);
        if (d.dtype != state::GradDtype::kSumSquares || d.step != static_cast<uint32_t>(t)) {
          job_state->RaiseAbort(state::AbortReason::kInternal);
          return absl::InternalError(absl::StrCat("rank ", r, " posted unit ", d.unit, " (dtype ", static_cast<int>(d.dtype),
                                                  ") for step ", d.step, " where its squared norm for step ", t,
                                                  " comes first (device staging)"));
        }
        double squares;
        std::memcpy(&squares, rings[r]->slot_data(d.slot), sizeof(double));
        RETURN_IF_ERROR(rings[r]->Release(d.slot));
        if (!std::isfinite(squares) || squares < 0) {
          // Not an error of the pipeline: the clipping coefficient becomes 0 or NaN as with host
          // staging (update::ClipCoefficient decides), so keep the value.
          LOG(WARNING) << "job " << ctx.job_id() << " step " << t + 1 << ": rank " << r << " gradient squared norm " << squares;
        }
        sum_squares += squares;
      }
      coef = update::ClipCoefficient(std::sqrt(sum_squares), spec.max_grad_norm);
    }
    if (shard_consumers) {
      // Each rank's chunks are final, disjoint shards: consume every ring at once (one thread per
      // rank, each until its own shards of every unit are in, so ranks posting different numbers
      // of chunks cannot block each other).
      std::vector<std::vector<ChunkSquares>> squares(world);
      std::vector<double> rank_wait_s(world, 0), rank_aggregate_s(world, 0);
      absl::Mutex error_mu;
      absl::Status consume_error;
      const int threads_per_rank = std::max(1, aggregate_threads / world);
      auto consume = [&](int r) -> absl::Status {
        std::vector<int64_t> unit_got(num_units, 0);
        int64_t got = 0;
        while (got < shard_numel_of_rank[r]) {
          const absl::Time t_wait = absl::Now();
          ASSIGN_OR_RETURN(state::GradChunkDesc d, pop(r, t == first_step));
          rank_wait_s[r] += absl::ToDoubleSeconds(absl::Now() - t_wait);
          const bool unit_ok = d.unit >= 0 && d.unit < num_units;
          const ShardRange shard = unit_ok ? ShardOf(layout.units[d.unit].numel, world, r) : ShardRange{};
          if (d.step != static_cast<uint32_t>(t) || !unit_ok || d.dtype != state::GradDtype::kF32 || d.numel <= 0 ||
              d.offset_numel < shard.offset || d.offset_numel + d.numel > shard.offset + shard.numel ||
              unit_got[d.unit] + d.numel > shard.numel) {
            job_state->RaiseAbort(state::AbortReason::kInternal);
            return absl::InternalError(absl::StrCat(
                "unexpected gradient chunk from rank ", r, ": step ", d.step, " unit ", d.unit, " offset ", d.offset_numel,
                " numel ", d.numel, " dtype ", static_cast<int>(d.dtype), " while applying step ", t, " (rank ", r,
                "'s shard of that unit is [", shard.offset, ", ", shard.offset + shard.numel, "), ",
                unit_ok ? unit_got[d.unit] : 0, " elements of it already received)"));
          }
          const float* src = static_cast<const float*>(rings[r]->slot_data(d.slot));
          const absl::Time t_agg = absl::Now();
          const bool host_staged = clip && !device_staging;
          if (!device_staging) {  // (device staging: the norm came from the ranks)
            float* dst = host_staged ? staging[d.unit].data() + d.offset_numel : nullptr;
            const int64_t pieces = (d.numel + kAggregatePiece - 1) / kAggregatePiece;
            std::vector<double> piece_sq(pieces);
            checkpoint::ParallelFor(pieces, threads_per_rank, [&](size_t p) {
              const int64_t off = static_cast<int64_t>(p) * kAggregatePiece;
              const int64_t n = std::min(kAggregatePiece, d.numel - off);
              if (dst != nullptr) std::memcpy(dst + off, src + off, n * sizeof(float));
              piece_sq[p] = update::SumSquares(src + off, n);
            });
            double sq = 0;
            for (double x : piece_sq) sq += x;
            squares[r].push_back(ChunkSquares{d.unit, d.offset_numel, sq});
          }
          rank_aggregate_s[r] += absl::ToDoubleSeconds(absl::Now() - t_agg);
          unit_got[d.unit] += d.numel;
          got += d.numel;
          if (host_staged) {
            RETURN_IF_ERROR(rings[r]->Release(d.slot));  // staged: the slot is free again
          } else {
            // Final already: update now (while the rest of the backward pass still runs, or, with
            // device staging, while the later parts are still coming).
            RETURN_IF_ERROR(apply(d.unit, d.offset_numel, d.numel, coef, src, rings[r].get(), d.slot));
          }
        }
        return absl::OkStatus();
      };
      std::vector<std::thread> consumers;
      for (int r = 0; r < world; ++r) {
        consumers.emplace_back([&, r] {
          pthread_setname_np(pthread_self(), absl::StrCat("grad-rank", r).substr(0, 15).c_str());
          absl::Status s = consume(r);
          if (s.ok()) return;
          absl::MutexLock l(&error_mu);
          // The cause wins over its echoes: once one consumer raises the abort word, the others
          // (and the workers' reports they poll) fail with ABORTED, possibly before it gets here.
          if (consume_error.ok() ||
              (consume_error.code() == absl::StatusCode::kAborted && s.code() != absl::StatusCode::kAborted)) {
            consume_error = s;
          }
          // Wake the other consumers (their Pop returns ABORTED) instead of letting them time out.
          job_state->RaiseAbort(state::AbortReason::kInternal);
        });
      }
      for (std::thread& c : consumers) c.join();
      {
        absl::MutexLock l(&error_mu);
        RETURN_IF_ERROR(consume_error);
      }
      std::vector<ChunkSquares> all;
      for (auto& v : squares) all.insert(all.end(), v.begin(), v.end());
      std::sort(all.begin(), all.end(), [](const ChunkSquares& a, const ChunkSquares& b) {
        return std::tie(a.unit, a.offset) < std::tie(b.unit, b.offset);
      });
      for (const ChunkSquares& c : all) sum_squares += c.squares;
      // The step's host-side time is set by its slowest rank.
      wait_s += *std::max_element(rank_wait_s.begin(), rank_wait_s.end());
      aggregate_s = *std::max_element(rank_aggregate_s.begin(), rank_aggregate_s.end());
      complete_units = num_units;
    }
    while (complete_units < num_units) {
      // Every rank posts the same chunk sequence; take rank 0's chunk, then the same from the
      // others, summing in rank order so results do not depend on arrival order.
      const absl::Time t_wait = absl::Now();
      ASSIGN_OR_RETURN(state::GradChunkDesc d0, pop(0, t == first_step));
      wait_s += absl::ToDoubleSeconds(absl::Now() - t_wait);
      if (d0.step != static_cast<uint32_t>(t) || d0.unit < 0 || d0.unit >= num_units ||
          d0.offset_numel + d0.numel > layout.units[d0.unit].numel || d0.dtype != state::GradDtype::kF32) {
        job_state->RaiseAbort(state::AbortReason::kInternal);
        return absl::InternalError(absl::StrCat("unexpected gradient chunk from rank 0: step ", d0.step, " unit ", d0.unit,
                                                " offset ", d0.offset_numel, " numel ", d0.numel, " while aggregating step ", t));
      }
      if (direct) {
        const float* src = static_cast<const float*>(rings[0]->slot_data(d0.slot));
        const absl::Time t_agg = absl::Now();
        const int64_t pieces = (d0.numel + kAggregatePiece - 1) / kAggregatePiece;
        std::vector<double> piece_sq(pieces);
        checkpoint::ParallelFor(pieces, aggregate_threads, [&](size_t p) {
          const int64_t off = static_cast<int64_t>(p) * kAggregatePiece;
          piece_sq[p] = update::SumSquares(src + off, std::min(kAggregatePiece, d0.numel - off));
        });
        for (double sq : piece_sq) sum_squares += sq;
        aggregate_s += absl::ToDoubleSeconds(absl::Now() - t_agg);
        RETURN_IF_ERROR(apply(d0.unit, d0.offset_numel, d0.numel, 1.0f, src, rings[0].get(), d0.slot));
        received[d0.unit] += d0.numel;
        if (received[d0.unit] == layout.units[d0.unit].numel) ++complete_units;
        continue;
      }
      std::vector<state::GradChunkDesc> descs = {d0};
      for (int r = 1; r < world; ++r) {
        ASSIGN_OR_RETURN(state::GradChunkDesc d, pop(r, t == first_step));
        if (d.step != d0.step || d.unit != d0.unit || d.offset_numel != d0.offset_numel || d.numel != d0.numel) {
          job_state->RaiseAbort(state::AbortReason::kInternal);
          return absl::InternalError(absl::StrCat("rank ", r, " posted unit ", d.unit, "@", d.offset_numel, " step ", d.step,
                                                  " where rank 0 posted unit ", d0.unit, "@", d0.offset_numel));
        }
        descs.push_back(d);
      }
      // Sum the ranks' copies in rank order into staging and take the squared norm, in pieces
      // over several threads (one thread copies only ~5-10 GB/s); results do not depend on it.
      const absl::Time t_agg = absl::Now();
      float* dst = staging[d0.unit].data() + d0.offset_numel;
      const int64_t pieces = (d0.numel + kAggregatePiece - 1) / kAggregatePiece;
      std::vector<double> piece_sq(pieces);
      checkpoint::ParallelFor(pieces, aggregate_threads, [&](size_t p) {
        const int64_t off = static_cast<int64_t>(p) * kAggregatePiece;
        const int64_t n = std::min(kAggregatePiece, d0.numel - off);
        std::memcpy(dst + off, static_cast<const float*>(rings[0]->slot_data(d0.slot)) + off, n * sizeof(float));
        for (int r = 1; r < world; ++r) {
          const float* src = static_cast<const float*>(rings[r]->slot_data(descs[r].slot)) + off;
          float* out = dst + off;
          for (int64_t i = 0; i < n; ++i) out[i] += src[i];
        }
        piece_sq[p] = update::SumSquares(dst + off, n);
      });
      for (double sq : piece_sq) sum_squares += sq;
      aggregate_s += absl::ToDoubleSeconds(absl::Now() - t_agg);
      for (int r = 0; r < world; ++r) RETURN_IF_ERROR(rings[r]->Release(descs[r].slot));
      received[d0.unit] += d0.numel;
      // Without clipping a chunk is final once every rank's copy is summed: update it now, while
      // the rest of the backward pass is still running.
      if (!clip) RETURN_IF_ERROR(apply(d0.unit, d0.offset_numel, d0.numel, 1.0f));
      if (received[d0.unit] == layout.units[d0.unit].numel) ++complete_units;
    }
    const double grad_norm = std::sqrt(sum_squares);
    if (clip && !device_staging) {
      // Exact clipping: the coefficient needs the whole step's norm; then update in forward
      // order so the next step's forward can start on the first units while later ones update.
      const float coef = update::ClipCoefficient(grad_norm, spec.max_grad_norm);
      for (int u = 0; u < num_units; ++u) RETURN_IF_ERROR(apply(u, 0, layout.units[u].numel, coef));
    }
    const absl::Time t_tail = absl::Now();
    std::move(drain).Invoke();
    const absl::Time t_updated = absl::Now();
    const double update_tail_s = absl::ToDoubleSeconds(t_updated - t_tail);
    // The update window: from the step's first update submitted to its last one done. With
    // clipping (the default) it opens once the norm is known, so the step's parameters over it
    // are LayerAdam's rate in place, next to the copies and the next step's forward.
    double update_s = 0;
    {
      absl::MutexLock l(&progress.mu);
      if (!progress.first_error.ok()) return progress.first_error;
      if (progress.first_submit < t_updated) update_s = absl::ToDoubleSeconds(t_updated - progress.first_submit);
    }
    job_state->step_counter().store(t + 1);

    // Metrics: wait (briefly) for every rank's StepDone of this step.
    absl::Time metrics_deadline = absl::Now() + absl::Seconds(30);
    while (static_cast<int>(step_reports[t].size()) < world && absl::Now() < metrics_deadline) {
      RETURN_IF_ERROR(poll_workers());
      if (static_cast<int>(step_reports[t].size()) < world) absl::SleepFor(absl::Milliseconds(1));
    }
    v1::StepMetrics m;
    m.set_step(t + 1);
    double loss = 0;
    int64_t tokens = 0;
    for (const v1::StepDone& d : step_reports[t]) {
      loss += d.loss_sum();
      tokens += d.tokens();
      m.set_worker_step_s(std::max(m.worker_step_s(), d.step_time_s()));
      m.set_worker_gate_wait_s(std::max(m.worker_gate_wait_s(), d.gate_wait_s()));
      m.set_worker_ring_wait_s(std::max(m.worker_ring_wait_s(), d.ring_wait_s()));
      m.set_worker_h2d_s(std::max(m.worker_h2d_s(), d.h2d_busy_s()));
      m.set_worker_d2h_s(std::max(m.worker_d2h_s(), d.d2h_busy_s()));
      m.set_trained_tokens(d.trained_tokens());
      m.set_gpu_peak_bytes(std::max<int64_t>(m.gpu_peak_bytes(), d.gpu_peak_bytes()));
    }
    step_reports.erase(t);
    const absl::Time now = absl::Now();
    const double step_s = absl::ToDoubleSeconds(now - step_start);
    step_start = now;
    m.set_host_aggregate_s(aggregate_s);
    m.set_host_wait_s(wait_s);
    m.set_host_update_tail_s(update_tail_s);
    m.set_host_update_s(update_s);
    m.set_host_update_gparams_per_s(update_s > 0 ? static_cast<double>(layout.total_numel) / update_s / 1e9 : 0);
    m.set_loss(loss);
    m.set_learning_rate(lr);
    m.set_grad_norm(grad_norm);
    m.set_step_time_s(step_s);
    m.set_tokens_per_s(step_s > 0 ? tokens / step_s : 0);
    m.set_model_tflops(step_s > 0 ? flops_per_token * tokens / step_s / world / 1e12 : 0);
    m.set_host_state_bytes(static_cast<int64_t>(plan.total_bytes));
    const double elapsed = absl::ToDoubleSeconds(now - run_start);
    m.set_eta_s(elapsed / (t + 1 - first_step) * (spec.steps - t - 1));
    ctx.ReportStep(m);
    if (metrics_file) {
      nlohmann::json j = {{"step", m.step()},          {"loss", m.loss()},       {"lr", m.learning_rate()},
                          {"grad_norm", m.grad_norm()}, {"tokens", tokens},       {"step_time_s", m.step_time_s()},
                          {"tokens_per_s", m.tokens_per_s()}, {"model_tflops", m.model_tflops()},
                          {"time_unix_ms", absl::ToUnixMillis(now)}, {"gpu_peak_bytes", m.gpu_peak_bytes()},
                          {"busy_s", {{"worker_step", m.worker_step_s()}, {"worker_gate_wait", m.worker_gate_wait_s()},
                                      {"worker_ring_wait", m.worker_ring_wait_s()}, {"worker_h2d", m.worker_h2d_s()},
                                      {"worker_d2h", m.worker_d2h_s()}, {"host_aggregate", m.host_aggregate_s()},
                                      {"host_wait", m.host_wait_s()}, {"host_update_tail", m.host_update_tail_s()},
                                      {"host_update", m.host_update_s()}}},
                          {"host_update_gparams_per_s", m.host_update_gparams_per_s()},
                          {"host_state_bytes", m.host_state_bytes()},
                          {"host_staging_bytes", staging_bytes_held},
                          {"world_size", world},
                          {"grad_reduction", gpu_route ? "gpu" : "cpu"},
                          {"grad_staging", clip ? (device_staging ? "device" : "host") : "none"},
                          {"param_delivery", ToString(spec.param_delivery)}};
      metrics_file << j.dump() << "\n" << std::flush;
    }
    if (spec.save_every_steps > 0 && (t + 1) % spec.save_every_steps == 0 && t + 1 < spec.steps) {
      RETURN_IF_ERROR(save(t + 1));
    }
  }

  // Workers report the end of the job after their last post.
  absl::Time end_deadline = absl::Now() + absl::Seconds(30);
  while (std::count(finished.begin(), finished.end(), true) < world && absl::Now() < end_deadline) {
    RETURN_IF_ERROR(poll_workers());
    absl::SleepFor(absl::Milliseconds(2));
  }
  if (spec.save_final) RETURN_IF_ERROR(save(spec.steps));
  poolable = std::count(finished.begin(), finished.end(), true) == world;
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
