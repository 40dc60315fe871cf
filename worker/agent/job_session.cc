#include "worker/agent/job_session.h"

#include <algorithm>
#include <cmath>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/data/validation.h"
#include "common/io/meminfo.h"
#include "common/status/status_macros.h"
#include "common/version.h"
#include "glog/logging.h"
#include "shm/job_state.h"

namespace slidedp::worker {
namespace {

constexpr double kGiB = 1073741824.0;

// runtime.cast_threads, 0: a quarter of the host's cores per rank, 1 to 8.
int CastThreads(int32_t configured, int world) {
  if (configured > 0) return configured;
  const int cores = static_cast<int>(std::thread::hardware_concurrency());
  return std::clamp(cores / (4 * std::max(world, 1)), 1, 8);
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

}  // namespace

JobSession::JobSession(WorkerJobConfig config, JobHost& host, PipelineFactory& factory, const DebugSwitches& switches,
                       DeviceDescription device)
    : config_(std::move(config)),
      host_(host),
      factory_(factory),
      switches_(switches),
      device_(std::move(device)),
      layout_(ModelLayout::Build(config_.model)),
      sharding_(config_.node_state == NodeState::kSharded
                    ? MakeNodeSharding(layout_, config_.nodes, config_.world, config_.node,
                                       config_.embedding_rows == Dtype::kF32)
                    : NodeSharding{}),
      host_layout_(NodeLayout(layout_, sharding_)),
      place_(ContextPlace::Of(config_.node * config_.world + config_.rank, config_.nodes * config_.world,
                              config_.context_parallel)),
      reports_(config_.job_id, config_.attempt) {}

absl::Status JobSession::Open() {
  RETURN_IF_ERROR(AttachState());
  RETURN_IF_ERROR(PrepareBackend());
  RETURN_IF_ERROR(OpenData());
  RETURN_IF_ERROR(Configure());
  RETURN_IF_ERROR(BuildPipeline());
  RETURN_IF_ERROR(LimitMemory());
  MakeRunner();
  StartAutoPolicy();
  // Validation (data.validation): this rank's micro-batches of the split, built once.
  ASSIGN_OR_RETURN(validation_, OpenValidation(config_.validation_path, config_.validation_files, config_.global_batch,
                                               config_.micro_batch, place_));
  return absl::OkStatus();
}

absl::Status JobSession::AttachState() {
  ASSIGN_OR_RETURN(host_state_, host_.TakeHostState(config_.state_segment));
  RETURN_IF_ERROR(job_state().CheckMatches(host_layout_));
  // runtime.param_source: the segment keeps a mirror exactly when the job reads it.
  const bool reads_mirror = config_.param_source != ParamSource::kMaster;
  if (job_state().has_mirror() != reads_mirror) {
    return absl::FailedPreconditionError(
        absl::StrCat("job segment ", job_state().segment_name(), job_state().has_mirror() ? " keeps" : " has no",
                     " BF16 mirror, the job's runtime.param_source is ", ToString(config_.param_source)));
  }
  ASSIGN_OR_RETURN(ring_, shm::GradRing::Attach(config_.ring_segment, shm::RingRole::kProducer, &job_state().abort()));
  return absl::OkStatus();
}

absl::Status JobSession::PrepareBackend() {
  ASSIGN_OR_RETURN(backend_, host_.BackendFor(config_.model));
  backend_->ResetPeakMemory();                        // the reported GPU peak is this job's
  backend_->SetDeterministic(config_.deterministic);  // SLIDEDP_DETERMINISTIC=1 adds to it (CUDA)
  backend_->SetTileTokens(config_.tile_tokens);
  return absl::OkStatus();
}

absl::Status JobSession::OpenData() {
  ASSIGN_OR_RETURN(data_, StepData::Open(config_.data_path, config_.dataset_files, config_.global_batch,
                                         config_.micro_batch, config_.seed, place_));
  return absl::OkStatus();
}

absl::Status JobSession::Configure() {
  PipelineSettings& s = settings_;
  s.job_state = &job_state();
  s.ring = ring_.get();
  s.layout = &layout_;
  s.backend = backend_;
  s.registry = host_state_->registry.get();
  s.rank = config_.rank;
  s.world = config_.world;
  s.timeout = config_.step_timeout;
  GradientPathOptions& g = s.grads;
  g.route = config_.gpu_route ? GradRoute::kGpu : GradRoute::kCpu;
  g.rank = config_.rank;
  g.world = config_.world;
  g.ring_timeout = config_.step_timeout;
  g.inject_max_delay = switches_.inject_max_delay;
  g.dtype = config_.grad_dtype;
  if (sharding_.sharded()) g.sharding = &sharding_;
  g.stage_until_norm = config_.device_staging;
  if (g.stage_until_norm && !config_.gpu_route && config_.world > 1) {
    return absl::FailedPreconditionError("grad_staging device needs grad_reduction gpu with several ranks");
  }
  if (g.stage_until_norm && config_.speculate_from_unit.has_value()) {
    if (*config_.speculate_from_unit < 0) {
      return absl::InvalidArgumentError(absl::StrCat("assignment: speculate_from_unit ", *config_.speculate_from_unit));
    }
    g.speculate_from_unit = *config_.speculate_from_unit;
    g.job_state = &job_state();
    g.hostd = job_state().owner();
  }
  // runtime.policy: a per-layer layout, made for this model (hostd checked) and this device.
  if (config_.layer_layout) {
    RETURN_IF_ERROR(config_.layer_layout->CheckModel(config_.model));
    RETURN_IF_ERROR(config_.layer_layout->CheckDevice(device_.name));
    RunnableLayout(*config_.layer_layout, layout_.num_units(), &layer_policies_, &s.offloaded);
    std::string described;
    for (size_t i = 0; i < config_.layer_layout->layers.size(); ++i) {
      absl::StrAppend(&described, i == 0 ? "" : ", ", i, ":", LayerPolicyName(config_.layer_layout->layers[i]));
    }
    LOG(INFO) << "job " << config_.job_id << ": runtime.policy per-layer layout: " << described;
  }
  s.norms = config_.norm_weights;
  s.embedding = config_.embedding_rows;
  s.source = config_.param_source == ParamSource::kMaster ? UploadSource::kMaster : UploadSource::kMirror;
  s.cast_threads = CastThreads(config_.cast_threads, config_.world);
  s.chunk_bytes = config_.chunk_bytes;
  s.cast_on_device = config_.cast_on == CastOn::kDevice;
  s.urgent_copies = config_.copy_priority > 0;  // DMA before Adam
  s.offload_ratio = config_.offload_ratio;
  s.sharded_delivery = config_.sharded_delivery;
  s.collective_segment = config_.collective_segment;
  s.context_ranks = place_.ranks;
  s.context_rank = place_.rank;
  s.context_group = place_.dp_rank;
  s.context_segment = config_.context_segment;
  s.membership_key = config_.membership_key;
  s.comm_ids = this;
  return absl::OkStatus();
}

absl::Status JobSession::BuildPipeline() {
  if (absl::Status s = factory_.JoinCommunicator(settings_); !s.ok()) {
    return AbortPeers(Annotate(s, "NCCL communicator"));
  }
  // A job over nodes: the link to this local rank on the other nodes, met through hostd's store.
  std::unique_ptr<NodeLink> nodes;
  if (config_.nodes > 1) {
    if (config_.node < 0 || config_.node >= config_.nodes || config_.node_address.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("assignment: node ", config_.node, " of ", config_.nodes,
                                                     " at '", config_.node_address, "'"));
    }
    ASSIGN_OR_RETURN(std::shared_ptr<KeyValueStore> store, host_.NodeStore(config_.job_id));
    NodeLinkSettings n;
    n.node = config_.node;
    n.nodes = config_.nodes;
    n.address = config_.node_address;
    n.group = absl::StrCat(config_.job_id, "/", config_.attempt, "/local", config_.rank);
    n.store = std::move(store);
    n.timeout = config_.step_timeout;
    ASSIGN_OR_RETURN(nodes, factory_.JoinNodes(n));
    settings_.grads.nodes = nodes.get();
    LOG(INFO) << "job " << config_.job_id << ": node " << config_.node << " of " << config_.nodes << ", rank "
              << config_.rank << " of " << config_.world << " here (data-parallel rank "
              << config_.node * config_.world + config_.rank << " of " << config_.nodes * config_.world << ")";
  }
  ASSIGN_OR_RETURN(pipeline_, factory_.Build(settings_));
  pipeline_.nodes = std::move(nodes);
  // Context parallelism: attention's keys and values through the job's context group. The
  // backend holds the group for this job only.
  if (place_.ranks > 1) {
    LOG(INFO) << "job " << config_.job_id << ": context parallel, rank " << place_.rank << " of " << place_.ranks
              << " in its group (" << (pipeline_.context_group->device_collectives() ? "NCCL" : "shm")
              << "): each micro-batch's tokens split zig-zag, attention over the gathered keys and values";
  }
  RETURN_IF_ERROR(backend_->SetContextGroup(pipeline_.context_group.get()));
  context_binding_.backend = backend_;
  return absl::OkStatus();
}

absl::Status JobSession::LimitMemory() {
  // runtime.gpu_memory_limit: the parameter window and the gradient buffers are allocated above;
  // the backend's pool (activations, scratch) gets what they leave. No limit: the whole device.
  memory_limit_bytes_ = config_.gpu_memory_limit_bytes;
  const int64_t pipeline_bytes = pipeline_.device_bytes();
  if (memory_limit_bytes_ > 0 && memory_limit_bytes_ <= pipeline_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "runtime.gpu_memory_limit %.2f GiB leaves nothing for activations: the parameter window and gradient "
        "buffers alone take %.2f GiB (runtime.chunk_bytes, the largest unit; raise the limit)",
        memory_limit_bytes_ / kGiB, pipeline_bytes / kGiB));
  }
  RETURN_IF_ERROR(backend_->SetMemoryLimit(memory_limit_bytes_ > 0 ? memory_limit_bytes_ - pipeline_bytes : 0));
  if (memory_limit_bytes_ > 0) {
    LOG(INFO) << "runtime.gpu_memory_limit " << memory_limit_bytes_ / kGiB << " GiB: the parameter window and "
              << "gradient buffers take " << pipeline_bytes / kGiB << " GiB, activations and scratch at most "
              << (memory_limit_bytes_ - pipeline_bytes) / kGiB << " GiB";
  }
  return absl::OkStatus();
}

void JobSession::MakeRunner() {
  StepRunnerOptions ropt;
  ropt.policy = ToActPolicy(config_.act_policy);
  ropt.layer_policies = layer_policies_;
  checkpoint_dtype_ = config_.checkpoint_dtype;
  ropt.checkpoint_dtype = checkpoint_dtype_;
  if (config_.checkpoint_dtype == Dtype::kBF16) {
    LOG(INFO) << "job " << config_.job_id << ": runtime.checkpoint_dtype bf16: "
              << (CheckpointDType(*backend_, checkpoint_dtype_) == backend_->activation_dtype()
                      ? "the layer inputs are BF16 already (BF16 residual stream)"
                      : "the layer inputs wait in BF16 between forward and backward");
  }
  ropt.router_aux_coef = config_.router_aux_coef;
  ropt.global_micro_batches = config_.global_batch / config_.micro_batch;
  ropt.inject_max_delay = switches_.inject_max_delay;
  if (!switches_.inject_nonfinite_text.empty()) {
    for (const DebugSwitches::NonFiniteInjection& i : switches_.inject_nonfinite) {
      if (i.rank < 0 || i.rank == config_.rank) ropt.inject_nonfinite.push_back({i.step, i.unit});
    }
    LOG(WARNING) << "SLIDEDP_INJECT_NONFINITE=" << switches_.inject_nonfinite_text
                 << ": test-only NaNs will be injected";
  }
  ropt.on_loss = [this](int64_t step, double loss_sum) { host_.Send(reports_.Loss(step, loss_sum)); };
  runner_ = std::make_unique<StepRunner>(layout_, backend_, pipeline_.streamer.get(), pipeline_.grads.get(),
                                         std::move(ropt), pipeline_.activations.get());
}

void JobSession::StartAutoPolicy() {
  // runtime.policy auto without a cached layout: measured on the first step, solved, validated.
  AutoPolicySession::Options apo;
  apo.enabled = config_.policy_auto && !config_.layer_layout;
  apo.backend = backend_;
  apo.layout = &layout_;
  apo.capacity_bytes = memory_limit_bytes_ > 0 ? memory_limit_bytes_ : device_.memory_bytes;
  apo.host_budget_bytes = PinnedBudgetBytes(config_.world);
  apo.device_name = device_.name;
  apo.build = BuildId();
  apo.world = config_.world;
  apo.tokens_per_step = config_.global_batch * config_.seq_len;
  apo.checkpoint_dtype = checkpoint_dtype_;
  apo.time_tolerance = factory_.autopolicy_time_tolerance();
  // The GPU suite's comparison against fixed layouts (docs/gpu-suite.md, autopolicy).
  apo.sweep = switches_.autopolicy_sweep;
  apo.measure_rates = factory_.CopyRateProbe();
  autopolicy_ = std::make_unique<AutoPolicySession>(std::move(apo));
}

absl::Status JobSession::Train() {
  for (int64_t step = config_.first_step; step < config_.total_steps; ++step) {
    if (host_.JobCancelled()) {
      job_state().RaiseAbort(shm::AbortReason::kCancelled);
      return absl::CancelledError("job cancelled");
    }
    RETURN_IF_ERROR(TrainStep(step));
  }
  RETURN_IF_ERROR(pipeline_.grads->Drain());  // device staging: the last step's parts may still be posting
  ring_->Close();
  return absl::OkStatus();
}

absl::Status JobSession::TrainStep(int64_t step) {
  absl::StatusOr<StepBatch> batch = data_->Batch(step);
  // e.g. the dataset was truncated under the job: tell every peer at once
  if (!batch.ok()) return AbortPeers(batch.status());
  absl::StatusOr<StepResult> result = runner_->Run(step, batch->micro_batches, batch->loss_scale);
  if (!result.ok() && result.status().code() == absl::StatusCode::kResourceExhausted &&
      settings_.grads.stage_until_norm) {
    result = Annotate(result.status(), absl::StrFormat("gradient buffers hold %.2f GiB of this device, most of it "
                                                       "the step's gradients staged for exact clipping "
                                                       "(runtime.grad_staging: host keeps them in host memory)",
                                                       pipeline_.grads->device_bytes() / kGiB));
  }
  if (!result.ok()) return AbortPeersUnlessAborted(Annotate(result.status(), absl::StrCat("step ", step)));

  const PipelineCounters counters = pipeline_.counters();
  const int64_t pipeline_bytes = pipeline_.device_bytes();
  const int64_t peak = backend_->peak_memory_bytes() + pipeline_bytes;
  const v1::WorkerReport done = reports_.Done(step, *result, batch->trained_tokens, counters, peak,
                                              backend_->peak_used_memory_bytes() + pipeline_bytes);
  if (const std::string report = backend_->MemoryReport(); !report.empty()) {
    LOG(INFO) << "step " << step + 1 << " GPU memory ledger (backend buffers; the pipeline's " << pipeline_bytes / kGiB
              << " GiB besides): " << report;
  }
  if (!host_.Send(done)) return absl::UnavailableError("lost the session with hostd");
  RETURN_IF_ERROR(AfterStep(step, done.step_done(), batch->micro_batches, peak));
  return EvaluateAfter(step);
}

absl::Status JobSession::AfterStep(int64_t step, const v1::StepDone& done, const std::vector<MicroBatch>& micro_batches,
                                   int64_t peak_bytes) {
  if (config_.act_policy == ActivationPolicy::kAuto && !config_.layer_layout && step == config_.first_step) {
    KeepAllAfterFirstStep(step, micro_batches, peak_bytes);
  }
  if (!autopolicy_->active()) return absl::OkStatus();
  StepObservation seen;
  seen.total_s = done.step_time_s();
  seen.compute_s = done.compute_busy_s();
  seen.gate_s = done.gate_wait_s();
  seen.h2d_s = done.h2d_busy_s();
  seen.d2h_s = done.d2h_busy_s();
  seen.peak_bytes = peak_bytes;
  absl::StatusOr<std::optional<AutoPolicyChoice>> next =
      autopolicy_->AfterStep(step, seen, micro_batches, config_.total_steps - step - 1);
  if (!next.ok()) return AbortPeers(Annotate(next.status(), "runtime.policy auto"));
  if (next->has_value()) RETURN_IF_ERROR(AdoptLayout(std::move(**next), micro_batches));
  if (config_.rank == 0 && autopolicy_->validated() && !autopolicy_->reported()) {
    const v1::WorkerReport chosen = reports_.PolicyChosen(*autopolicy_);
    autopolicy_->set_reported();
    if (!host_.Send(chosen)) return absl::UnavailableError("lost the session with hostd");
  }
  return absl::OkStatus();
}

// act_policy auto: after the first step (every layer recomputed), the last layers that fit keep
// all their activations.
void JobSession::KeepAllAfterFirstStep(int64_t step, const std::vector<MicroBatch>& micro_batches, int64_t peak_bytes) {
  int64_t tokens = 0;
  for (const MicroBatch& mb : micro_batches) tokens += mb.num_tokens();
  const int64_t capacity = memory_limit_bytes_ > 0 ? memory_limit_bytes_ : device_.memory_bytes;
  const int64_t layer_bytes = backend_->SavedBytesPerToken(ActPolicy::kKeepAll) * tokens;
  const int64_t layers = config_.model.num_hidden_layers;
  const int keep = KeepAllLayers(capacity, peak_bytes, layer_bytes, layers);
  runner_->set_keep_all_last_layers(keep);
  LOG(INFO) << "act_policy auto: step " << step + 1 << " peaked at " << peak_bytes / kGiB << " GiB of "
            << capacity / kGiB << " GiB; the last " << keep << " of " << layers << " layers keep all activations ("
            << layer_bytes / kGiB << " GiB each)";
}

// AutoPolicy's layout from the next step on: its offloaded checkpoints pinned now, not during the
// validation step; a host that cannot pin them gets the layout without offload.
absl::Status JobSession::AdoptLayout(AutoPolicyChoice choice, const std::vector<MicroBatch>& micro_batches) {
  pipeline_.activations.reset();
  if (!choice.offloaded.empty()) {
    ASSIGN_OR_RETURN(pipeline_.activations, factory_.MakeActivationStore(backend_, choice.offloaded));
    absl::Status pinned =
        ReserveCheckpoints(*pipeline_.activations, *backend_, choice.policies, micro_batches, checkpoint_dtype_);
    if (!pinned.ok()) {
      LOG(WARNING) << "job " << config_.job_id << ": " << pinned.message();
      pipeline_.activations.reset();
      choice = autopolicy_->WithoutOffload();
    }
  }
  runner_->SetLayout(choice.policies, pipeline_.activations.get());
  backend_->ResetPeakMemory();  // the next step's peak is the validation's
  return absl::OkStatus();
}

absl::Status JobSession::EvaluateAfter(int64_t step) {
  if (!validation_.micro_batches_total || !data::EvaluatesAfter(config_.eval_every, step, config_.total_steps)) {
    return absl::OkStatus();
  }
  // After the step's update (its gates), before the next step: every rank, the same sweeps.
  const absl::Time t_eval = absl::Now();
  absl::StatusOr<std::vector<double>> losses = runner_->Evaluate(
      static_cast<uint32_t>(step + 1), validation_.micro_batches, validation_.per_sweep, validation_.sweeps);
  if (!losses.ok()) {
    return AbortPeersUnlessAborted(Annotate(losses.status(), absl::StrCat("validation after step ", step + 1)));
  }
  if (!host_.Send(reports_.Eval(step, *losses, absl::ToDoubleSeconds(absl::Now() - t_eval)))) {
    return absl::UnavailableError("lost the session with hostd");
  }
  return absl::OkStatus();
}

absl::Status JobSession::AbortPeers(absl::Status s) {
  job_state().RaiseAbort(shm::AbortReason::kWorkerFailed);
  return s;
}

absl::Status JobSession::AbortPeersUnlessAborted(absl::Status s) {
  if (s.code() != absl::StatusCode::kAborted) job_state().RaiseAbort(shm::AbortReason::kWorkerFailed);
  return s;
}

absl::Status JobSession::Publish(const std::string& id) {
  if (!host_.Send(reports_.CommId(config_.membership_key, id))) {
    return absl::UnavailableError("lost the session with hostd");
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> JobSession::Await() { return host_.AwaitCommId(config_); }

}  // namespace slidedp::worker
