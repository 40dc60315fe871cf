// TrainingExecutor: the hostd side of a SlideDP job (see training_executor.h).
#include "hostd/engine/training_executor.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/data/dataset.h"
#include "common/tokenizer/identity.h"
#include "common/jobspec/job_spec_proto.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/admission/admission.h"
#include "hostd/checkpoint/checkpoint.h"
#include "hostd/core/output_ownership.h"
#include "hostd/engine/grad_consumer.h"
#include "hostd/engine/initial_weights.h"
#include "hostd/engine/attempt.h"
#include "hostd/engine/job_checks.h"
#include "hostd/engine/job_plan.h"
#include "common/policy/layout_solver.h"
#include "hostd/engine/policy_cache.h"
#include "hostd/engine/step_plan.h"
#include "hostd/engine/step_metrics.h"
#include "common/data/micro_batch.h"
#include "common/data/validation.h"
#include "hostd/engine/step_updates.h"
#include "hostd/engine/undo_arena.h"
#include "hostd/engine/worker_reports.h"
#include "hostd/metrics/tensorboard_sink.h"
#include "hostd/update/schedule.h"
#include "hostd/update/unit_tracker.h"
#include "hostd/update/weight_decay.h"
#include "shm/grad_ring.h"
#include "shm/job_state.h"
#include "shm/shm_collective.h"

namespace slidedp::hostd {
namespace {

// optimizer.no_decay as LayerAdam's per-tensor rule (hostd/update/weight_decay.h).
update::DecayExemptions DecayExemptionsOf(const JobSpec& spec) {
  update::DecayExemptions e{false, false};
  for (NoDecay g : spec.optimizer.no_decay) (g == NoDecay::kNorm ? e.norms : e.biases) = true;
  return e;
}

// Bin file f's identity as hostd verified it, for an assignment.
void SetDatasetFile(int f, const data::FileIdentity& id, v1::DatasetFile* df) {
  df->set_name(data::BinFileName(f));
  df->set_dev(id.dev);
  df->set_inode(id.ino);
  df->set_size(id.size);
  df->set_mtime_ns(id.mtime_ns);
  df->set_ctime_ns(id.ctime_ns);
}

}  // namespace

absl::StatusOr<std::vector<data::FileIdentity>> TrainingExecutor::VerifyDataset(JobContext& ctx, JobSpec& spec,
                                                                                int64_t model_vocab) {
  // Once per job: a restarted attempt whose files still have the identities the first attempt
  // verified skips the content pass (Open with expected_files compares them, reads the offsets).
  data::ReaderOptions dopt;
  dopt.model_vocab_size = model_vocab;
  dopt.verify_checksums = data::VerifyChecksums::kYes;
  const bool cached = verified_.job_id == ctx.job_id() && verified_.data_path == spec.data.path;
  if (cached) dopt.expected_files = verified_.files;
  const absl::Time t0 = absl::Now();
  absl::StatusOr<std::unique_ptr<data::DatasetReader>> dataset = data::DatasetReader::Open(spec.data.path, dopt);
  if (cached && absl::IsDataLoss(dataset.status())) {  // changed since: verify it again, whole
    ctx.Log(absl::StrCat("dataset changed since the job's first attempt verified it (", dataset.status().message(),
                         "); verifying it again"));
    dopt.expected_files.clear();
    dataset = data::DatasetReader::Open(spec.data.path, dopt);
  }
  if (!dataset.ok()) return dataset.status();
  const data::DatasetReader& d = **dataset;
  {
    // Again at start (the files may have been replaced while the job was queued); the note of a
    // check that could not be made goes to the job's log.
    ASSIGN_OR_RETURN(const std::optional<tok::TokenizerIdentity> model_tokenizer, ModelTokenizerOf(spec));
    ASSIGN_OR_RETURN(std::string note, CheckDatasetTokenizer(spec, "data.path", spec.data.path, d, model_tokenizer));
    if (!note.empty() && ctx.attempt() == 0) ctx.Log(note);
  }
  if (dopt.expected_files.empty()) {
    uint64_t bytes = 0;
    for (const data::FileIdentity& f : d.file_identities()) bytes += static_cast<uint64_t>(f.size);
    const double s = absl::ToDoubleSeconds(absl::Now() - t0);
    ctx.Log(
        absl::StrFormat("dataset %s verified: %d files, %.3f GB, CRC-32, token ids and loss mask in %.2f s "
                        "(%.2f GB/s)",
                        spec.data.path, data::kNumBinFiles, bytes / 1e9, s, s > 0 ? bytes / 1e9 / s : 0.0));
    verified_ = {ctx.job_id(), spec.data.path, d.file_identities()};
  }
  if (spec.train.steps == 0) {  // train.epochs: the step count follows from the rows; the workers get it resolved
    spec.train.steps = StepsOf(spec, d.num_rows());
    const double epochs = spec.train.epochs;
    spec.train.epochs = 0;
    ctx.Log(absl::StrCat(epochs, " epoch(s) of ", d.num_rows(), " rows in batches of ", spec.train.global_batch, " = ",
                         spec.train.steps, " steps"));
  }
  return d.file_identities();
}


TrainingExecutor::TrainingExecutor(TrainingExecutorOptions options)
    : options_(std::move(options)),
      pool_(options_.node_name, options_.pool_host_state),
      instance_token_(absl::StrCat(getpid(), "-", absl::ToUnixMillis(absl::Now()))) {}
TrainingExecutor::~TrainingExecutor() = default;

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
  RETURN_IF_ERROR(CheckOutputDir(spec.output.dir));
  if (spec.train.measure_only && !PolicyCache(options_.policy_cache_dir).enabled()) {
    return absl::FailedPreconditionError(
        "train.measure_only caches AutoPolicy's layout, and this hostd keeps no policy cache (--state-dir or "
        "--policy-cache)");
  }
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfigOf(spec));
  RETURN_IF_ERROR(config.CheckTrainable());  // a family the compute backends do not run yet
  if (!spec.model.path.empty()) RETURN_IF_ERROR(CheckModelWeightsPresent(spec.model.path));
  if (spec.runtime.layer_layout) {
    // A policy file (or a layout inline) made for another model shape fails here, not at start.
    RETURN_IF_ERROR(spec.runtime.layer_layout->CheckModel(config));
  }
  if (spec.train.router_aux_loss_coef >= 0 && !config.is_moe()) {
    return absl::InvalidArgumentError(absl::StrCat("train.router_aux_loss_coef: the model (", ModelTypeName(config.family),
                                                   ") has no router; the key is for qwen3_moe models"));
  }
  if (spec.train.seq_len > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("train.seq_len ", spec.train.seq_len,
                                                   " exceeds the model's max_position_embeddings ",
                                                   config.max_position_embeddings));
  }
  if (!config.SlidingWindowCovers(spec.train.seq_len)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the model's sliding_window is ", config.sliding_window, " tokens, shorter than train.seq_len ",
                     spec.train.seq_len, ": sliding-window attention is not implemented (a row of at most ",
                     config.sliding_window, " tokens trains exactly as the model attends)"));
  }
  // The dataset is checked here, at submit: manifest, file sizes (truncation is DATA_LOSS), token
  // ids against the model's vocabulary, the loss mask. Its CRC-32s are verified when the job
  // starts (VerifyDataset): the files may change while it is queued, and a large dataset must
  // not stall this gRPC handler twice.
  data::ReaderOptions dopt;
  dopt.model_vocab_size = config.vocab_size;
  dopt.verify_checksums = data::VerifyChecksums::kNo;
  ASSIGN_OR_RETURN(auto dataset, data::DatasetReader::Open(spec.data.path, dopt));
  ASSIGN_OR_RETURN(const std::optional<tok::TokenizerIdentity> model_tokenizer, ModelTokenizerOf(spec));
  RETURN_IF_ERROR(CheckDatasetTokenizer(spec, "data.path", spec.data.path, *dataset, model_tokenizer).status());
  if (dataset->num_rows() < spec.train.global_batch) {
    return absl::InvalidArgumentError(absl::StrCat("data.path: the dataset has ", dataset->num_rows(),
                                                   " rows, fewer than train.global_batch ", spec.train.global_batch));
  }
  if (dataset->manifest().seq_len > spec.train.seq_len) {
    return absl::InvalidArgumentError(absl::StrCat("data.path: the dataset was prepared with seq_len ",
                                                   dataset->manifest().seq_len, ", longer than train.seq_len ",
                                                   spec.train.seq_len));
  }
  if (!spec.data.validation.empty()) {
    absl::StatusOr<std::unique_ptr<data::DatasetReader>> v = data::DatasetReader::Open(spec.data.validation, dopt);
    if (!v.ok()) return Annotate(v.status(), "data.validation");
    if ((*v)->manifest().seq_len > spec.train.seq_len) {
      return absl::InvalidArgumentError(absl::StrCat("data.validation: the split was prepared with seq_len ",
                                                     (*v)->manifest().seq_len, ", longer than train.seq_len ",
                                                     spec.train.seq_len));
    }
    if ((*v)->num_rows() == 0) return absl::InvalidArgumentError("data.validation: the split has no rows");
    RETURN_IF_ERROR(
        CheckDatasetTokenizer(spec, "data.validation", spec.data.validation, **v, model_tokenizer).status());
  }
  return Annotate(ScheduleOf(spec, StepsOf(spec, dataset->num_rows())).status(), "schedule");
}

absl::Status TrainingExecutor::VerifyValidation(JobContext& ctx, Attempt& a, int64_t model_vocab) {
  data::ReaderOptions dopt;
  dopt.model_vocab_size = model_vocab;
  dopt.verify_checksums = data::VerifyChecksums::kYes;
  absl::StatusOr<std::unique_ptr<data::DatasetReader>> v = data::DatasetReader::Open(a.spec.data.validation, dopt);
  if (!v.ok()) return Annotate(v.status(), "data.validation");
  const data::DatasetReader& d = **v;
  if (d.num_rows() == 0) return absl::InvalidArgumentError("data.validation: the split has no rows");
  std::vector<int64_t> rows(d.num_rows());
  for (int64_t r = 0; r < d.num_rows(); ++r) rows[r] = r;
  ASSIGN_OR_RETURN(a.validation_tokens, data::CountTrainedLabels(d, rows));
  if (a.validation_tokens == 0) {
    return absl::InvalidArgumentError("data.validation: the split trains no token (its loss mask is all 0)");
  }
  a.validation_files = d.file_identities();
  a.validation_micro_batches = data::ValidationMicroBatches(d.num_rows(), a.spec.train.micro_batch);
  ctx.Log(absl::StrFormat("validation split %s: %d rows, %d trained tokens, in %d micro-batches; evaluated %s",
                          a.spec.data.validation, d.num_rows(), a.validation_tokens, a.validation_micro_batches,
                          a.spec.train.eval_every > 0
                              ? absl::StrCat("every ", a.spec.train.eval_every, " steps and at the end")
                              : std::string("after the last step")));
  return absl::OkStatus();
}

absl::Status TrainingExecutor::RecordValidation(JobContext& ctx, Attempt& a, int64_t t, v1::StepMetrics& m) {
  const absl::Duration timeout = absl::Milliseconds(a.spec.runtime.step_timeout_ms);
  ASSIGN_OR_RETURN(std::vector<v1::EvalDone> evals, a.reports->WaitForEval(t, timeout));
  const int world = static_cast<int>(evals.size());
  // Micro-batch k's sum came from data-parallel rank k % R as its (k / R)-th: added in k order, the
  // same for any R. With context parallelism each rank of a group sent its share of the group's
  // micro-batches, added in rank order.
  const int cp = std::max(1, a.spec.runtime.context_parallel);
  std::vector<double> sums(a.validation_micro_batches, 0.0);
  double eval_s = 0;
  for (int r = 0; r < world; ++r) {
    const std::vector<int64_t> mine =
        data::RankValidationMicroBatches(a.validation_micro_batches, r / cp, std::max(1, world / cp));
    if (evals[r].loss_sums_size() != static_cast<int64_t>(mine.size())) {
      a.job_state->RaiseAbort(shm::AbortReason::kInternal);
      return absl::InternalError(absl::StrCat(a.reports->WorkerName(r), " reported ", evals[r].loss_sums_size(),
                                              " validation sums, not its ", mine.size(), " micro-batches"));
    }
    for (size_t i = 0; i < mine.size(); ++i) sums[mine[i]] += evals[r].loss_sums(static_cast<int>(i));
    eval_s = std::max(eval_s, evals[r].eval_s());
  }
  double total = 0;
  for (double v : sums) total += v;
  const double loss = total / static_cast<double>(a.validation_tokens);
  m.set_eval_loss(loss);
  m.set_eval_tokens(a.validation_tokens);
  m.set_eval_s(eval_s);
  ctx.Log(absl::StrFormat("step %d: validation loss %.6f over %d tokens (%.2f s)", t + 1, loss, a.validation_tokens,
                          eval_s));
  return absl::OkStatus();
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

absl::StatusOr<int64_t> TrainingExecutor::AdoptInterruptedState(const std::string& job_id, const JobSpec& spec) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfigOf(spec));
  const ModelLayout layout = ModelLayout::Build(config);
  ASSIGN_OR_RETURN(std::string name, shm::MakeSegmentName(options_.node_name, job_id, "state"));
  ASSIGN_OR_RETURN(std::unique_ptr<shm::JobState> js, shm::JobState::Attach(name, shm::Access::kReadWrite));
  RETURN_IF_ERROR(js->CheckMatches(layout));
  const char* want = ToString(spec.optimizer.state_dtype);
  if (absl::string_view(ToString(js->moment_dtype())) != want) {
    return absl::FailedPreconditionError(absl::StrCat("state segment ", name, " keeps ", ToString(js->moment_dtype()),
                                                      " Adam moments, the job's optimizer.state_dtype is ", want));
  }
  if (js->has_mirror() != (spec.runtime.param_source == ParamSource::kMirror)) {
    return absl::FailedPreconditionError(absl::StrCat("state segment ", name, js->has_mirror() ? " keeps" : " has no",
                                                      " BF16 mirror, the job's runtime.param_source is ",
                                                      ToString(spec.runtime.param_source)));
  }
  if (js->job_id() != job_id) {
    return absl::FailedPreconditionError(absl::StrCat("state segment ", name, " belongs to job '", js->job_id(), "'"));
  }
  ASSIGN_OR_RETURN(int64_t step, js->ConsistentStep());
  if (spec.train.steps > 0 && step > spec.train.steps) {
    return absl::FailedPreconditionError(
        absl::StrCat("state segment ", name, " is at step ", step, ", beyond the job's ", spec.train.steps));
  }
  RETURN_IF_ERROR(js->TakeOver());
  LOG(INFO) << "job " << job_id << ": took over its state segment " << name << " (" << js->bytes() << " bytes) at step "
            << step << " from the previous hostd";
  absl::MutexLock l(&mu_);
  adopted_[job_id] = AdoptedState{std::move(js), step};
  return step;
}

void TrainingExecutor::ForgetJob(const std::string& job_id) {
  std::unique_ptr<shm::JobState> js;
  {
    absl::MutexLock l(&mu_);
    auto it = adopted_.find(job_id);
    if (it == adopted_.end()) return;
    js = std::move(it->second.state);
    adopted_.erase(it);
  }
  LOG(INFO) << "job " << job_id << " will not run: removing the state segment taken over for it";
  (void)js->Unlink();
}

absl::Status TrainingExecutor::AcquireState(JobContext& ctx, Attempt& a) {
  // The state a dead hostd left for this job (AdoptInterruptedState), else a pooled segment of
  // this layout; either one's memory counts as available to this job. Any other pooled segment
  // is freed first, as this job may need its memory.
  std::unique_ptr<shm::JobState> adopted;
  {
    absl::MutexLock l(&mu_);
    if (auto it = adopted_.find(ctx.job_id()); it != adopted_.end()) {
      adopted = std::move(it->second.state);
      a.shm_step = it->second.step;
      adopted_.erase(it);
    }
  }
  if (!adopted) a.pooled = pool_.Take(a.layout, a.plan.state_format());
  const shm::JobState* held = adopted ? adopted.get() : a.pooled.get();
  ASSIGN_OR_RETURN(HostMemoryInfo host, ReadHostMemoryInfo());
  if (held) {
    host.mem_available_bytes += held->bytes();
    host.shm_free_bytes += held->bytes();
  }
  if (absl::Status s = CheckAdmission(a.plan.memory, host); !s.ok()) {
    if (adopted) (void)adopted->Unlink();
    return s;
  }
  SizeSpeculation(a.layout, host.mem_available_bytes, host.mem_total_bytes, a.plan);
  ctx.SetHostStateBytes(static_cast<int64_t>(a.plan.memory.total_bytes));
  ctx.Log(a.plan.MemoryLine());
  ctx.Log(a.plan.RoutesLine(a.spec.runtime.param_delivery));

  ASSIGN_OR_RETURN(a.adam, Adam());
  a.bulk_threads = std::max(1, std::min(16, a.adam->num_threads()));
  if (adopted) {
    a.job_state = std::move(adopted);
    a.job_state->abort().Reset();  // a worker may have raised it when the previous hostd died
    return absl::OkStatus();
  }
  if (a.pooled) {
    const uint64_t bytes = a.pooled->bytes();
    const absl::Time t0 = absl::Now();
    auto adopted = pool_.Adopt(std::move(a.pooled), ctx.job_id(), a.layout, a.plan.state_format(), a.bulk_threads);
    if (adopted.ok()) {
      a.job_state = std::move(*adopted);
      a.reused_state = true;
      ctx.Log(absl::StrFormat("reused pooled host state (%.2f GB, %.2f s)", bytes / 1e9,
                              absl::ToDoubleSeconds(absl::Now() - t0)));
      return absl::OkStatus();
    }
    LOG(WARNING) << "job " << ctx.job_id() << ": cannot reuse the pooled host state: " << adopted.status();
  }
  shm::JobStateOptions sopt;
  sopt.format = a.plan.state_format();
  sopt.prefault_threads = a.bulk_threads;
  ASSIGN_OR_RETURN(a.job_state, shm::JobState::Create(options_.node_name, ctx.job_id(), a.layout, sopt));
  return absl::OkStatus();
}

absl::Status TrainingExecutor::CreateSegments(JobContext& ctx, Attempt& a) {
  for (int r = 0; r < a.plan.world; ++r) {
    ASSIGN_OR_RETURN(auto ring, shm::GradRing::Create(options_.node_name, ctx.job_id(), r, a.plan.ring,
                                                      shm::RingRole::kConsumer, &a.job_state->abort()));
    a.rings.push_back(std::move(ring));
  }
  if (a.plan.shm_collective) {
    ASSIGN_OR_RETURN(a.collective, shm::ShmCollective::Create(options_.node_name, ctx.job_id(), a.plan.world,
                                                              a.plan.collective_buffer_bytes, &a.job_state->abort()));
  }
  if (a.plan.context_buffer_bytes > 0) {  // one collective per context group (ranks g C .. g C + C - 1)
    for (int g = 0; g < a.plan.world / a.plan.context_ranks; ++g) {
      ASSIGN_OR_RETURN(auto coll, shm::ShmCollective::Create(options_.node_name, ctx.job_id(), a.plan.context_ranks,
                                                             a.plan.context_buffer_bytes, &a.job_state->abort(),
                                                             "/dev/shm", absl::StrCat("ctx", g)));
      a.context_collectives.push_back(std::move(coll));
    }
  }
  // NUMA placement: each unit's state lives on the node of the LayerAdam threads that own it;
  // the owners touch (and, where pages already sit elsewhere, migrate) it before use.
  const int num_units = a.layout.num_units();
  std::vector<int64_t> unit_bytes(num_units);
  shm::JobState& js = *a.job_state;
  for (int u = 0; u < num_units; ++u) {
    unit_bytes[u] = a.layout.units[u].numel * (js.has_mirror() ? 6 : 4) + static_cast<int64_t>(js.moments(u).bytes);
  }
  const std::vector<int> placement = a.adam->AssignNumaNodes(unit_bytes);
  a.tensor_ranges.resize(num_units);
  int64_t first_index = 0;
  for (int u = 0; u < num_units; ++u) {
    a.tensor_ranges[u] = update::TensorRangesOf(a.layout.units[u], DecayExemptionsOf(a.spec));
    a.memory.push_back(
        update::UnitMemory{js.master(u), js.m(u), js.v(u), js.mirror(u), a.layout.units[u].numel, placement[u]});
    update::UnitMemory& memory = a.memory.back();
    memory.tensors = a.tensor_ranges[u];
    const shm::JobState::Moments mv = js.moments(u);
    switch (mv.dtype) {
      case MomentForm::kF32: break;
      case MomentForm::kBF16:
        memory.moments = MomentForm::kBF16;
        memory.bf16 = update::Bf16Moments{static_cast<bf16_t*>(mv.m), static_cast<bf16_t*>(mv.v)};
        break;
      case MomentForm::kInt8:
        memory.moments = MomentForm::kInt8;
        memory.int8 = update::Int8Moments{static_cast<int8_t*>(mv.m), static_cast<uint8_t*>(mv.v), mv.m_scale,
                                          mv.v_scale};
        break;
    }
    memory.first_index = first_index;
    first_index += a.layout.units[u].numel;
    if (a.adam->num_numa_nodes() > 1) RETURN_IF_ERROR(a.adam->FirstTouch(a.memory.back()));
  }
  return absl::OkStatus();
}

void TrainingExecutor::ReleaseSegments(JobContext& ctx, Attempt& a) {
  // Before the segment can be unmapped: LayerAdam stops reading its urgent-copy words (no chunk
  // of the job is in flight here: every step's updates drain before it ends).
  if (a.adam != nullptr) a.adam->ClearCopyPriority();
  // A no-op after success: the workers have already reported the end of the job.
  a.job_state->RaiseAbort(shm::AbortReason::kShutdown);
  for (auto& r : a.rings) (void)r->Unlink();
  if (a.collective) (void)a.collective->Unlink();
  for (auto& c : a.context_collectives) (void)c->Unlink();
  pool_.Finish(std::move(a.job_state), a.poolable, ctx.workers());
}

absl::Status TrainingExecutor::SendAssignments(JobContext& ctx, const Attempt& a) {
  const int world = a.plan.world;
  const std::string membership_key = world > 1 ? MembershipKey(ctx) : std::string();
  const v1::JobConfig config = JobConfigOf(a.plan.WorkerSpec(a.spec));
  for (int r = 0; r < world; ++r) {
    v1::HostCommand cmd;
    v1::Assignment* as = cmd.mutable_assign();
    as->set_job_id(ctx.job_id());
    as->set_rank(r);
    as->set_world_size(world);
    *as->mutable_config() = config;
    as->set_state_segment(a.job_state->segment_name());
    as->set_ring_segment(a.rings[r]->segment_name());
    as->set_first_step(a.first_step);
    as->set_total_steps(a.spec.train.steps);
    as->set_attempt(ctx.attempt());
    if (a.undo != nullptr) as->set_speculate_from_unit(a.plan.speculate_from_unit);
    if (a.collective) as->set_collective_segment(a.collective->segment_name());
    if (!a.context_collectives.empty()) {
      as->set_context_segment(a.context_collectives[r / a.plan.context_ranks]->segment_name());
    }
    if (world > 1) as->set_membership_key(membership_key);
    if (!a.spec.data.validation.empty()) {
      as->set_validation_path(a.spec.data.validation);
      for (int f = 0; f < data::kNumBinFiles; ++f) SetDatasetFile(f, a.validation_files[f], as->add_validation_files());
    }
    for (int f = 0; f < data::kNumBinFiles; ++f) SetDatasetFile(f, a.dataset_files[f], as->add_dataset_files());
    if (!ctx.workers()[r]->commands().Push(cmd))
      return absl::UnavailableError("a worker disconnected before its assignment");
  }
  return absl::OkStatus();
}

absl::Status TrainingExecutor::SaveCheckpoint(JobContext& ctx, Attempt& a, int64_t steps_done) {
  ctx.SetState(v1::JOB_STATE_SAVING);
  checkpoint::SaveRequest req;
  req.root_dir = a.spec.output.dir;
  req.step = steps_done;
  req.layout = &a.layout;
  req.arrays = StateArraysOf(*a.job_state);
  req.weight_dtype = a.spec.output.save_dtype;
  req.keep_last = a.spec.output.keep_last;
  req.model_files = &a.model_files;
  req.trainer_state = {{"step", steps_done},
                       {"job_id", ctx.job_id()},
                       {"run_id", ctx.run_id()},
                       {"data_seed", a.spec.train.seed},
                       {"init_seed", a.spec.model.init_seed},
                       {"world_size", a.plan.world},
                       {"spec", a.spec.ToYaml()},
                       {"skipped_steps", a.skipped_steps}};
  ASSIGN_OR_RETURN(auto result, checkpoint::SaveCheckpoint(req));
  a.last_checkpoint = result.dir;
  ctx.SetLastCheckpoint(result.dir);
  ctx.Log(absl::StrFormat("checkpoint saved to %s (%.2f GB in %.1f s)", result.dir, result.bytes_written / 1e9,
                          result.seconds));
  // A save at a cancel ends the job from SAVING (the runner sets CANCELLED next).
  if (steps_done < a.spec.train.steps && !ctx.cancel_requested()) ctx.SetState(v1::JOB_STATE_RUNNING);
  return absl::OkStatus();
}

absl::Status TrainingExecutor::RunStep(JobContext& ctx, Attempt& a, int64_t t) {
  update::AdamWStepParams params;
  params.lr = a.schedule->LrAt(t);  // the schedule follows the global step, skipped ones included
  params.beta1 = a.spec.optimizer.beta1;
  params.beta2 = a.spec.optimizer.beta2;
  params.eps = a.spec.optimizer.eps;
  params.weight_decay = a.spec.optimizer.weight_decay;
  params.step = t + 1 - a.skipped_steps;  // Adam's bias correction counts applied updates only
  params.rounding_seed = a.spec.train.seed;  // BF16 moments' stochastic rounding (the data order's seed)
  const double paused_before = a.adam->paused_s();
  StepUpdates updates(*a.adam, a.memory, *a.tracker, t + 1, params, &a.layout, &a.job_state->updating_step());
  updates.SetBeforeFirstSkip([&a] { a.job_state->skipped_steps_counter().store(a.skipped_steps + 1); });
  ASSIGN_OR_RETURN(StepGradients grads, a.consumer->ConsumeStep(t, t == a.first_step, updates));
  if (grads.skipped) {
    a.job_state->skipped_steps_counter().store(++a.skipped_steps);
    const std::string line =
        absl::StrCat("warning: step ", t + 1, " skipped (train.skip_nonfinite): ", grads.skipped_because,
                     "; weights and Adam moments unchanged, ", a.skipped_steps, " step(s) skipped so far");
    LOG(WARNING) << "job " << ctx.job_id() << ": " << line;
    ctx.Log(line);
  }
  const absl::Time t_tail = absl::Now();
  RETURN_IF_ERROR(updates.Drain());
  const absl::Time t_updated = absl::Now();
  HostStepTimes host;
  host.wait_s = grads.wait_s;
  host.aggregate_s = grads.aggregate_s;
  host.update_tail_s = grads.update_tail_s + absl::ToDoubleSeconds(t_updated - t_tail);
  if (updates.first_submit() < t_updated) host.update_s = absl::ToDoubleSeconds(t_updated - updates.first_submit());
  host.adam_paused_s = a.adam->paused_s() - paused_before;
  a.job_state->step_counter().store(t + 1);

  // Metrics: wait (briefly) for every rank's StepDone of this step.
  ASSIGN_OR_RETURN(std::vector<v1::StepDone> reports, a.reports->WaitForStep(t, absl::Seconds(30)));
  // (A non-finite loss fails the job in WorkerReports as it arrives; skipping jobs checked it
  // before the step's updates.)
  const absl::Time now = absl::Now();
  const double step_s = absl::ToDoubleSeconds(now - a.step_start);
  a.step_start = now;
  StepRecord record = MakeStepRecord(t + 1, reports, host, step_s, params.lr, grads.grad_norm, a.layout.total_numel,
                                     a.layout.ModelFlopsPerToken(a.spec.train.seq_len), a.plan.world,
                                     static_cast<int64_t>(a.plan.memory.total_bytes));
  const double elapsed = absl::ToDoubleSeconds(now - a.run_start);
  record.metrics.set_eta_s(elapsed / (t + 1 - a.first_step) * (a.spec.train.steps - t - 1));
  record.metrics.set_skipped(grads.skipped);
  record.metrics.set_skipped_steps(a.skipped_steps);
  record.metrics.set_speculated_fraction(static_cast<double>(grads.speculated_numel) /
                                         static_cast<double>(std::max<int64_t>(1, a.layout.total_numel)));
  record.metrics.set_speculation_rolled_back(grads.speculated_numel > 0 && grads.rolled_back);
  a.consumer->ObserveWaits(record.metrics.worker_gate_wait_s(), record.metrics.worker_ring_wait_s());
  // This step's gate waits are the step before's updates showing.
  record.metrics.set_host_hidden_fraction(
      a.prev_update_s > 0 ? std::clamp(1.0 - record.metrics.worker_gate_wait_s() / a.prev_update_s, 0.0, 1.0) : -1.0);
  a.prev_update_s = host.update_s;
  if (record.metrics.host_update_gparams_per_s() > 0 && t > a.first_step) {
    absl::MutexLock l(&mu_);
    update_rates_[static_cast<int>(a.plan.moments)] = record.metrics.host_update_gparams_per_s();
  }
  if (a.peak_tflops > 0) record.metrics.set_mfu(record.metrics.model_tflops() / a.peak_tflops);
  if (a.layout.config.is_moe()) {
    std::vector<int> sparse;
    for (int l = 0; l < a.layout.config.num_hidden_layers; ++l) {
      if (a.layout.config.IsSparseLayer(l)) sparse.push_back(l);
    }
    if (absl::Status s = AddRouterMetrics(reports, sparse, a.layout.config.num_experts, &record.metrics); !s.ok()) {
      return Annotate(s, absl::StrCat("step ", t + 1, ": a worker's router report"));
    }
  }
  a.step_times.emplace_back(t + 1, record.metrics.step_time_s());
  a.reports->SetCancelGrace(std::max(absl::Seconds(2 * record.metrics.step_time_s()), WorkerReports::kMinCancelGrace));
  if (!a.spec.data.validation.empty() && data::EvaluatesAfter(a.spec.train.eval_every, t, a.spec.train.steps)) {
    RETURN_IF_ERROR(RecordValidation(ctx, a, t, record.metrics));
  }
  ctx.ReportStep(record.metrics);
  a.metrics->Append(record, now, a.plan, a.spec, a.consumer->staging_bytes_held());
  if (a.tensorboard) a.tensorboard->Append(record.metrics, now);
  return absl::OkStatus();
}

absl::Status TrainingExecutor::RunAttempt(JobContext& ctx) {
  const absl::Time attempt_start = absl::Now();
  JobSpec spec = ctx.spec();
  if (SavesCheckpoints(spec)) {
    // Submit refused an output.dir holding another run's checkpoints; a job that ran since (queued
    // before this one) may have written some: the job's own run only, or output.overwrite.
    ASSIGN_OR_RETURN(std::vector<checkpoint::CheckpointEntry> others,
                     OtherRunsCheckpoints(spec.output.dir, ctx.run_id()));
    if (!spec.output.overwrite) RETURN_IF_ERROR(RefuseOtherRuns(spec.output.dir, others));
    ASSIGN_OR_RETURN(std::string moved, MoveOtherRunsAside(spec.output.dir, others, ctx.job_id()));
    if (!moved.empty()) ctx.Log(moved);
  }
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfigOf(spec));
  // Every dataset file's checksum (and ids, and mask), before any host state is allocated: a
  // flipped bit would otherwise train. Here, not at submit: a large dataset takes seconds.
  ASSIGN_OR_RETURN(std::vector<data::FileIdentity> dataset_files, VerifyDataset(ctx, spec, config.vocab_size));
  ModelLayout layout = ModelLayout::Build(config);
  std::vector<v1::WorkerHello> hellos;
  for (const auto& w : ctx.workers()) hellos.push_back(w->hello());
  // runtime.policy auto: a layout cached for this shape, batch, device and build runs at once
  // (inline, as a policy file's would); otherwise the workers measure and choose one.
  {
    std::string said;
    spec = ResolveRoutes(spec, hellos, &said);  // before the policy's key, which names the routes
    if (!said.empty()) ctx.Log(said);
  }
  std::string policy_key;
  if (spec.runtime.policy_auto && !spec.runtime.layer_layout) {
    std::string said;
    spec.runtime.layer_layout = CachedLayout(spec, config, hellos, &policy_key, &said);
    if (spec.runtime.layer_layout) policy_key.clear();
    ctx.Log(said);
  }
  if (spec.train.measure_only && spec.runtime.layer_layout) {
    ctx.Log("train.measure_only: this shape's layout is measured already; nothing to run");
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(RoutePlan plan, PlanRoutes(spec, layout, WorkerDevicesOf(hellos)));
  Attempt a(std::move(spec), std::move(layout), std::move(plan));
  a.policy_key = std::move(policy_key);
  if (std::any_of(hellos.begin(), hellos.end(), [](const v1::WorkerHello& h) { return h.device().kind() == "cuda"; })) {
    ctx.Log(LongestSequenceNote(a.spec, a.layout, a.plan, hellos));
  }
  if (a.spec.runtime.layer_layout && a.spec.runtime.layer_layout->autopolicy) {  // a cached (or file) AutoPolicy layout
    a.predicted_step_s = a.spec.runtime.layer_layout->autopolicy->predicted.step_s;
    a.predicted_bottleneck = a.spec.runtime.layer_layout->autopolicy->predicted.bottleneck;
    a.layout_from_step = 2;  // the first step warms up
  }
  a.dataset_files = std::move(dataset_files);
  for (const v1::WorkerHello& h : hellos) {
    const double peak = h.device().kind() == "cuda" ? DenseBf16PeakTflops(h.device().name()) : 0;
    a.peak_tflops = a.peak_tflops == 0 && &h == &hellos.front() ? peak : std::min(a.peak_tflops, peak);
  }
  if (!a.spec.data.validation.empty()) RETURN_IF_ERROR(VerifyValidation(ctx, a, config.vocab_size));
  if (!a.spec.model.path.empty()) {
    ASSIGN_OR_RETURN(a.model_files, checkpoint::ReadModelDirFiles(a.spec.model.path));
  }

  // ---- admission, host state, rings ----
  absl::Cleanup keep_pool = [&] { pool_.PutBack(std::move(a.pooled)); };  // refused before adopting it
  RETURN_IF_ERROR(AcquireState(ctx, a));
  absl::Cleanup release = [&] { ReleaseSegments(ctx, a); };
  RETURN_IF_ERROR(CreateSegments(ctx, a));

  // ---- initial weights, schedule, staging ----
  if (a.shm_step) {
    // The state the dead hostd left holds exactly shm_step steps: nothing to load.
    a.first_step = *a.shm_step;
    a.skipped_steps = static_cast<int64_t>(a.job_state->skipped_steps_counter().load());
    a.job_state->step_counter().store(static_cast<uint64_t>(a.first_step));
    ctx.Log(
        absl::StrFormat("resumed from shared memory at step %d (the state the previous hostd left; no checkpoint "
                        "read), host state ready in %.2f s",
                        a.first_step, absl::ToDoubleSeconds(absl::Now() - attempt_start)));
    if (a.first_step == a.spec.train.steps) {
      // The previous hostd died after the last update: only the end of the job is left.
      if (a.spec.output.save_final) RETURN_IF_ERROR(SaveCheckpoint(ctx, a, a.spec.train.steps));
      return absl::OkStatus();
    }
  } else {
    ASSIGN_OR_RETURN(InitialState initial,
                     WriteInitialState(ctx, a.spec, a.layout, *a.job_state, a.reused_state, a.bulk_threads));
    a.first_step = initial.first_step;
    a.skipped_steps = initial.skipped_steps;
    ctx.Log(absl::StrFormat("host state ready in %.2f s after the job started (%s)",
                            absl::ToDoubleSeconds(absl::Now() - attempt_start),
                            a.reused_state ? "pooled segment" : "new segment"));
  }
  if (a.first_step >= a.spec.train.steps) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint is at step ", a.first_step, ", the job has ", a.spec.train.steps));
  }
  ASSIGN_OR_RETURN(a.schedule, ScheduleOf(a.spec, a.spec.train.steps));
  std::vector<int64_t> unit_numel;
  for (const UnitLayout& u : a.layout.units) unit_numel.push_back(u.numel);
  shm::JobState* js = a.job_state.get();
  a.tracker = std::make_unique<update::UnitTracker>(
      unit_numel,
      [js](int u, int64_t step, const absl::Status& s) {
        if (s.ok()) js->version(u).Publish(static_cast<uint32_t>(step));  // the unit's next forward may read it
      },
      a.first_step);
  const NonFinitePolicy policy = a.spec.train.skip_nonfinite ? NonFinitePolicy::kSkip : NonFinitePolicy::kFail;
  a.reports = std::make_unique<WorkerReports>(ctx, *a.job_state, a.first_step, a.spec.train.steps, policy);
  const absl::Duration step_timeout = absl::Milliseconds(a.spec.runtime.step_timeout_ms);
  a.grad_rings = std::make_unique<GradRings>(a.rings, *a.reports, *a.job_state, step_timeout);
  // Skipping jobs check every rank's loss before a step's updates (the workers send it before
  // their step's last gradients, so waiting for it never waits on hostd).
  WorkerReports* reports = a.reports.get();
  LossCheck loss_check = [reports, step_timeout](int64_t t) -> absl::StatusOr<std::string> {
    ASSIGN_OR_RETURN(std::vector<double> losses, reports->WaitForLosses(t, step_timeout));
    for (size_t r = 0; r < losses.size(); ++r) {
      if (!std::isfinite(losses[r])) {
        return absl::StrCat("loss is ", NonFiniteName(losses[r]), " on ", reports->WorkerName(static_cast<int>(r)));
      }
    }
    return std::string();
  };
  a.consumer = std::make_unique<GradConsumer>(a.plan, a.layout, *a.grad_rings, a.spec.train.max_grad_norm,
                                              std::clamp(a.adam->num_threads(), 1, 8), ctx.job_id(), policy,
                                              std::move(loss_check));
  a.consumer->AllocateStaging(a.bulk_threads);
  if (a.plan.speculate_from_unit < a.layout.num_units()) {
    const absl::Time t0 = absl::Now();
    int64_t covered = 0;
    for (int u = a.plan.speculate_from_unit; u < a.layout.num_units(); ++u) covered += a.layout.units[u].numel;
    ASSIGN_OR_RETURN(a.undo, UndoArena::Create(a.layout, a.plan.speculate_from_unit, a.memory, *a.adam));
    ctx.Log(absl::StrFormat(
        "speculative clipping: units %d..%d (%.1f%% of the parameters) update before the step's norm is known; "
        "undo copies %.2f GiB, ready in %.2f s",
        a.plan.speculate_from_unit, a.layout.num_units() - 1,
        100.0 * static_cast<double>(covered) / static_cast<double>(a.layout.total_numel),
        a.undo->bytes() / double(1ull << 30), absl::ToDoubleSeconds(absl::Now() - t0)));
  } else if (a.plan.stages_whole_step()) {
    ctx.Log(a.spec.runtime.speculation_bytes == 0
                ? "speculative clipping off (runtime.speculation_bytes: 0): updates wait for the step's norm"
                : "speculative clipping off: no host memory left for undo copies (runtime.speculation_bytes)");
  }
  a.consumer->EnableSpeculation(a.undo.get(), a.first_step);
  // DMA before Adam: the ranks' urgent-copy words start lowered (a worker of an earlier attempt
  // may have died with its word raised), and LayerAdam yields to them from the first step.
  a.job_state->ResetUrgentCopies();
  if (a.spec.runtime.copy_priority > 0) {
    // A pause ends after 2 ms even with the word still raised: about one 64 MiB chunk's copy at
    // the link's ~30-50 GB/s, so a copy gets the bandwidth and a stuck word costs LayerAdam little.
    const absl::Duration max_pause = absl::Milliseconds(2);
    RETURN_IF_ERROR(
        a.adam->SetCopyPriority(a.job_state->UrgentCopyWords(a.plan.world), a.spec.runtime.copy_priority, max_pause));
    ctx.Log(absl::StrFormat(
        "copy priority %g (runtime.copy_priority): %d of %d LayerAdam workers on NUMA node 0 pause while a "
        "parameter copy the GPU waits for is in flight (up to %s at a time)",
        a.spec.runtime.copy_priority, update::YieldingWorkers(a.adam->workers_on_node(0), a.spec.runtime.copy_priority),
        a.adam->workers_on_node(0), absl::FormatDuration(max_pause)));
  }

  // ---- the workers start ----
  RETURN_IF_ERROR(SendAssignments(ctx, a));
  ctx.SetTotalSteps(a.spec.train.steps);
  ctx.SetState(v1::JOB_STATE_RUNNING);
  std::error_code ec;
  std::filesystem::create_directories(a.spec.output.dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("output.dir ", a.spec.output.dir, ": ", ec.message()));
  a.metrics = std::make_unique<MetricsFile>(a.spec.output.dir, ctx.job_id());
  if (a.spec.output.tensorboard) {
    a.tensorboard = std::make_unique<metrics::TensorBoardSink>(a.spec.output.dir, ctx.job_id(), absl::Now(),
                                                               [&ctx](const std::string& line) { ctx.Log(line); });
  }
  a.run_start = a.step_start = absl::Now();

  for (int64_t t = a.first_step; t < a.spec.train.steps; ++t) {
    // Cancel takes effect between steps: every unit then has exactly the updates of the steps
    // done, so the state (and a checkpoint of it) is consistent.
    if (ctx.cancel_requested()) {
      if (ctx.checkpoint_on_cancel() && t > a.first_step && !a.spec.train.measure_only) {
        absl::Status saved = SaveCheckpoint(ctx, a, t);
        a.reports->StopWorkers();
        RETURN_IF_ERROR(saved);
        return absl::CancelledError(absl::StrCat("cancelled at step ", t, "; checkpoint ", a.last_checkpoint));
      }
      a.reports->StopWorkers();
      if (ctx.checkpoint_on_cancel() && !a.spec.train.measure_only) {
        // Nothing ran since the job started or resumed: there is no new state to save.
        return absl::CancelledError(absl::StrCat(
            "cancelled at step ", t, " before this run's first step ended; nothing new to save",
            ctx.resume_from().empty() ? std::string() : absl::StrCat(" (it resumed from ", ctx.resume_from(), ")")));
      }
      return absl::CancelledError(absl::StrCat("cancelled at step ", t));
    }
    RETURN_IF_ERROR(RunStep(ctx, a, t));
    if (auto chosen = a.reports->TakePolicyChosen();
        chosen && RecordPolicy(ctx, a, *chosen) && a.spec.train.measure_only) {
      // Its purpose is served: the layout and its measurements are cached for `slidedp plan` and
      // the next job of this shape. The state is this job's own and is dropped unsaved.
      a.reports->StopWorkers();
      ctx.Log(absl::StrCat("train.measure_only: AutoPolicy's layout is measured and cached; the job ends after step ",
                           t + 1, " without saving"));
      return absl::OkStatus();
    }
    if (a.spec.train.measure_only) continue;  // saves nothing
    if (a.spec.output.save_every > 0 && (t + 1) % a.spec.output.save_every == 0 && t + 1 < a.spec.train.steps) {
      RETURN_IF_ERROR(SaveCheckpoint(ctx, a, t + 1));
    }
  }

  // Workers report the end of the job after their last post.
  RETURN_IF_ERROR(a.reports->WaitForEnd(absl::Seconds(30)));
  const bool cached = [&] {
    auto chosen = a.reports->TakePolicyChosen();
    return chosen && RecordPolicy(ctx, a, *chosen);
  }();
  LogPrediction(ctx, a);
  if (a.spec.train.measure_only) {
    if (cached) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("train.measure_only: AutoPolicy cached no layout in the job's ",
                                                      a.spec.train.steps, " steps (the workers' logs say why)"));
  }
  if (a.spec.output.save_final) RETURN_IF_ERROR(SaveCheckpoint(ctx, a, a.spec.train.steps));
  a.poolable = a.reports->all_finished();
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
