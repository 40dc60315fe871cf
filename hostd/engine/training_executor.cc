// TrainingExecutor: the hostd side of a SlideDP job (see training_executor.h).
#include "hostd/engine/training_executor.h"

#include "hostd/engine/state_digest.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <system_error>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/data/dataset.h"
#include "common/tokenizer/identity.h"
#include "common/jobspec/job_spec_proto.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/admission/admission.h"
#include "checkpoint/checkpoint.h"
#include "hostd/core/output_ownership.h"
#include "hostd/engine/grad_consumer.h"
#include "hostd/engine/initial_weights.h"
#include "hostd/engine/attempt.h"
#include "hostd/engine/job_checks.h"
#include "hostd/engine/state_digest.h"
#include "hostd/engine/job_plan.h"
#include "common/policy/layout_solver.h"
#include "hostd/engine/policy_cache.h"
#include "hostd/engine/step_prediction.h"
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

// Bin file f's identity as hostd verified it, for an assignment.
void SetDatasetFile(int f, const data::FileIdentity& id, v1::DatasetFile* df) {
  df->set_name(data::BinFileName(f));
  df->set_dev(id.dev);
  df->set_inode(id.ino);
  df->set_size(id.size);
  df->set_mtime_ns(id.mtime_ns);
  df->set_ctime_ns(id.ctime_ns);
}

// data.validation: checksums, ids and mask of the split at the attempt's start, its trained tokens
// and micro-batches.
absl::Status VerifyValidation(JobContext& ctx, const JobSpec& spec, int64_t model_vocab, AttemptData& out) {
  data::ReaderOptions dopt;
  dopt.model_vocab_size = model_vocab;
  dopt.verify_checksums = data::VerifyChecksums::kYes;
  absl::StatusOr<std::unique_ptr<data::DatasetReader>> v = data::DatasetReader::Open(spec.data.validation, dopt);
  if (!v.ok()) return Annotate(v.status(), "data.validation");
  const data::DatasetReader& d = **v;
  if (d.num_rows() == 0) return absl::InvalidArgumentError("data.validation: the split has no rows");
  std::vector<int64_t> rows(d.num_rows());
  for (int64_t r = 0; r < d.num_rows(); ++r) rows[r] = r;
  ASSIGN_OR_RETURN(out.validation_tokens, data::CountTrainedLabels(d, rows));
  if (out.validation_tokens == 0) {
    return absl::InvalidArgumentError("data.validation: the split trains no token (its loss mask is all 0)");
  }
  out.validation_files = d.file_identities();
  out.validation_micro_batches = data::ValidationMicroBatches(d.num_rows(), spec.train.micro_batch);
  ctx.Log(absl::StrFormat("validation split %s: %d rows, %d trained tokens, in %d micro-batches; evaluated %s",
                          spec.data.validation, d.num_rows(), out.validation_tokens, out.validation_micro_batches,
                          spec.train.eval_every > 0
                              ? absl::StrCat("every ", spec.train.eval_every, " steps and at the end")
                              : std::string("after the last step")));
  return absl::OkStatus();
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
    return absl::InvalidArgumentError(absl::StrCat("train.router_aux_loss_coef: the model (",
                                                   ModelTypeName(config.family),
                                                   ") has no router; the key is for qwen3_moe models"));
  }
  if (spec.train.seq_len > config.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat("train.seq_len ", spec.train.seq_len,
                                                   " exceeds the model's max_position_embeddings ",
                                                   config.max_position_embeddings));
  }
  // A sliding window shorter than the row trains on the CPU backend; CUDA workers are refused by
  // the job plan (CheckWorkersFit), which knows the workers' backends.
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

absl::Status TrainingExecutor::RecordValidation(JobContext& ctx, Attempt& a, int64_t t, v1::StepMetrics& m) {
  const absl::Duration timeout = absl::Milliseconds(a.spec.runtime.step_timeout_ms);
  ASSIGN_OR_RETURN(std::vector<v1::EvalDone> evals, a.loop.reports->WaitForEval(t, timeout));
  const int world = static_cast<int>(evals.size());
  // Micro-batch k's sum came from data-parallel rank k % R as its (k / R)-th: added in k order, the
  // same for any R. With context parallelism each rank of a group sent its share of the group's
  // micro-batches, added in rank order.
  const int cp = std::max(1, a.spec.runtime.context_parallel);
  std::vector<double> sums(a.data.validation_micro_batches, 0.0);
  double eval_s = 0;
  for (int r = 0; r < world; ++r) {
    const std::vector<int64_t> mine =
        data::RankValidationMicroBatches(a.data.validation_micro_batches, r / cp, std::max(1, world / cp));
    if (evals[r].loss_sums_size() != static_cast<int64_t>(mine.size())) {
      a.segments.state().RaiseAbort(shm::AbortReason::kInternal);
      return absl::InternalError(absl::StrCat(a.loop.reports->WorkerName(r), " reported ", evals[r].loss_sums_size(),
                                              " validation sums, not its ", mine.size(), " micro-batches"));
    }
    for (size_t i = 0; i < mine.size(); ++i) sums[mine[i]] += evals[r].loss_sums(static_cast<int>(i));
    eval_s = std::max(eval_s, evals[r].eval_s());
  }
  double total = 0;
  for (double v : sums) total += v;
  const double loss = total / static_cast<double>(a.data.validation_tokens);
  m.set_eval_loss(loss);
  m.set_eval_tokens(a.data.validation_tokens);
  m.set_eval_s(eval_s);
  ctx.Log(absl::StrFormat("step %d: validation loss %.6f over %d tokens (%.2f s)", t + 1, loss,
                          a.data.validation_tokens, eval_s));
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

bool TrainingExecutor::WritesOutputs(const JobContext& ctx) {
  std::optional<JobNodes> nodes = ctx.job_nodes();
  return !nodes || nodes->coordinating();
}

absl::Status TrainingExecutor::ExchangeNodeStep(JobContext& ctx, Attempt& a, int64_t t,
                                                const std::vector<v1::StepDone>& reports, double whole_unit_squares,
                                                StepRecord& record) {
  const JobNodes nodes = *ctx.job_nodes();
  v1::NodeStep mine;
  mine.set_job_id(ctx.job_id());
  mine.set_node(nodes.self);
  mine.set_step(t);
  for (const v1::StepDone& d : reports) {
    mine.add_loss_sums(d.loss_sum());
    mine.set_tokens(mine.tokens() + d.tokens());
  }
  mine.set_step_time_s(record.metrics.step_time_s());
  if (!a.sharding.sharded() && DigestsAfter(t, a.spec.train.steps, a.plan.memory.total_bytes)) {
    mine.set_state_digest(StateDigest(a.layout, a.segments.state(), std::max(1, a.loop.bulk_threads)));
  }
  // With staging the ranks brought the job's norm (every node's the same); without, it is this node's.
  const bool partial_norm = a.sharding.sharded() && !a.plan.stages_whole_step();
  if (partial_norm) {
    const double g = record.metrics.grad_norm();
    mine.set_grad_squares(g * g - (nodes.coordinating() ? 0.0 : whole_unit_squares));
  }
  if (!nodes.coordinating()) return ctx.mesh()->ReportNodeStep(mine);
  ASSIGN_OR_RETURN(std::vector<v1::NodeStep> others,
                   ctx.mesh()->WaitNodeSteps(ctx.job_id(), t, absl::Milliseconds(a.spec.runtime.step_timeout_ms)));
  std::vector<const v1::NodeStep*> all(nodes.count(), nullptr);
  all[nodes.self] = &mine;
  for (const v1::NodeStep& o : others) all[o.node()] = &o;
  // The job's loss: every rank's part in global rank order, as one node with all the ranks adds them.
  double loss = 0;
  int64_t tokens = 0;
  for (int n = 0; n < nodes.count(); ++n) {
    if (all[n]->loss_sums_size() != static_cast<int>(reports.size())) {
      return absl::DataLossError(absl::StrCat("step ", t + 1, ": node ", n, " reported ", all[n]->loss_sums_size(),
                                              " ranks' losses, this node runs ", reports.size()));
    }
    for (double l : all[n]->loss_sums()) loss += l;
    tokens += all[n]->tokens();
    if (mine.has_state_digest() && (!all[n]->has_state_digest() || all[n]->state_digest() != mine.state_digest())) {
      return absl::DataLossError(absl::StrFormat(
          "step %d: node %d's host state (digest %016x) differs from node %d's (%016x): the nodes' replicated "
          "states diverged",
          t + 1, n, all[n]->state_digest(), nodes.self, mine.state_digest()));
    }
  }
  if (partial_norm) {  // in node order
    double squares = 0;
    for (int n = 0; n < nodes.count(); ++n) squares += all[n]->grad_squares();
    record.metrics.set_grad_norm(std::sqrt(std::max(0.0, squares)));
  }
  record.tokens = tokens;
  record.metrics.set_loss(loss);
  const double step_s = record.metrics.step_time_s();
  record.metrics.set_tokens_per_s(step_s > 0 ? static_cast<double>(tokens) / step_s : 0);
  return absl::OkStatus();
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
    a.segments.NameSegments(r, *as);
    as->set_first_step(a.loop.first_step);
    as->set_total_steps(a.spec.train.steps);
    as->set_attempt(ctx.attempt());
    if (a.loop.undo != nullptr) as->set_speculate_from_unit(a.plan.speculate_from_unit);
    if (world > 1) as->set_membership_key(membership_key);
    if (std::optional<JobNodes> nodes = ctx.job_nodes()) {
      as->set_node(nodes->self);
      as->set_nodes(nodes->count());
      as->set_node_address(ctx.mesh()->node_address());
    }
    if (!a.spec.data.validation.empty()) {
      as->set_validation_path(a.spec.data.validation);
      for (int f = 0; f < data::kNumBinFiles; ++f)
        SetDatasetFile(f, a.data.validation_files[f], as->add_validation_files());
    }
    for (int f = 0; f < data::kNumBinFiles; ++f) SetDatasetFile(f, a.data.dataset_files[f], as->add_dataset_files());
    if (!ctx.workers()[r]->commands().Push(cmd))
      return absl::UnavailableError("a worker disconnected before its assignment");
  }
  return absl::OkStatus();
}

absl::Status TrainingExecutor::SaveCheckpoint(JobContext& ctx, Attempt& a, int64_t steps_done) {
  // A job over nodes: its coordinator saves; with a sharded state every node writes its share.
  if (!WritesOutputs(ctx) && !a.sharding.sharded()) return absl::OkStatus();
  ctx.SetState(v1::JOB_STATE_SAVING);
  checkpoint::SaveRequest req;
  req.root_dir = a.spec.output.dir;
  req.step = steps_done;
  req.layout = &a.layout;
  req.arrays = StateArraysOf(a.segments.state());
  checkpoint::NodeShare share;
  if (a.sharding.sharded()) {
    req.layout = &a.model_layout;
    const bool coordinating = WritesOutputs(ctx);
    for (const UnitLayout& u : a.model_layout.units) {
      const ShardRange range = a.sharding.Range(u.index, u.numel);
      share.held.push_back(range.offset);
      // A unit every node holds whole is the coordinator's to write.
      share.write.push_back(!a.sharding.IsReplicated(u.index) || coordinating ? range : ShardRange{0, 0});
    }
    share.writes_pass_through = coordinating;
    req.share = &share;
  }
  req.weight_dtype = a.spec.output.save_dtype;
  req.keep_last = a.spec.output.keep_last;
  req.model_files = &a.outputs.model_files;
  req.pass_through = &a.outputs.pass_through;
  req.trainer_state = {{"step", steps_done},
                       {"job_id", ctx.job_id()},
                       {"run_id", ctx.run_id()},
                       {"data_seed", a.spec.train.seed},
                       {"init_seed", a.spec.model.init_seed},
                       {"world_size", a.plan.world},
                       {"spec", a.spec.ToYaml()},
                       {"skipped_steps", a.measured.skipped_steps}};
  if (a.sharding.sharded()) {
    if (!WritesOutputs(ctx)) {
      RETURN_IF_ERROR(SaveNodeShare(ctx, a, req));
      if (steps_done < a.spec.train.steps && !ctx.cancel_requested()) ctx.SetState(v1::JOB_STATE_RUNNING);
      return absl::OkStatus();
    }
    req.other_nodes = [&](const std::string& tmp) { return AwaitNodeShares(ctx, a, steps_done, tmp); };
  }
  absl::StatusOr<checkpoint::SaveResult> saved = checkpoint::SaveCheckpoint(req);
  if (!saved.ok() && a.sharding.sharded()) {  // the other nodes stop waiting for a directory
    (void)ctx.mesh()->StoreSet(ctx.job_id(), ShareKey(ctx, steps_done, "dir"),
                               absl::StrCat("error: ", saved.status().message()));
  }
  ASSIGN_OR_RETURN(auto result, std::move(saved));
  a.outputs.last_checkpoint = result.dir;
  ctx.SetLastCheckpoint(result.dir);
  ctx.Log(absl::StrFormat("checkpoint saved to %s (%.2f GB in %.1f s)", result.dir, result.bytes_written / 1e9,
                          result.seconds));
  // A save at a cancel ends the job from SAVING (the runner sets CANCELLED next).
  if (steps_done < a.spec.train.steps && !ctx.cancel_requested()) ctx.SetState(v1::JOB_STATE_RUNNING);
  return absl::OkStatus();
}

std::string TrainingExecutor::ShareKey(const JobContext& ctx, int64_t step, const std::string& what) {
  return absl::StrCat("checkpoint/", ctx.attempt(), "/", step, "/", what);
}

absl::Status TrainingExecutor::AwaitNodeShares(JobContext& ctx, Attempt& a, int64_t step, const std::string& tmp) {
  const JobNodes nodes = *ctx.job_nodes();
  RETURN_IF_ERROR(ctx.mesh()->StoreSet(ctx.job_id(), ShareKey(ctx, step, "dir"), tmp));
  const absl::Duration timeout = absl::Milliseconds(a.spec.runtime.step_timeout_ms);
  for (int n = 0; n < nodes.count(); ++n) {
    if (n == nodes.self) continue;
    absl::StatusOr<std::string> done =
        ctx.mesh()->StoreGet(ctx.job_id(), ShareKey(ctx, step, absl::StrCat("done/", n)), timeout);
    if (!done.ok()) return Annotate(done.status(), absl::StrCat("node ", n, "'s share of the checkpoint"));
    if (*done != "ok") {
      return absl::InternalError(absl::StrCat("node ", n, " could not write its share of the checkpoint: ", *done));
    }
  }
  return absl::OkStatus();
}

absl::Status TrainingExecutor::SaveNodeShare(JobContext& ctx, Attempt& a, const checkpoint::SaveRequest& req) {
  const JobNodes nodes = *ctx.job_nodes();
  const absl::Duration timeout = absl::Milliseconds(a.spec.runtime.step_timeout_ms);
  ASSIGN_OR_RETURN(std::string tmp, ctx.mesh()->StoreGet(ctx.job_id(), ShareKey(ctx, req.step, "dir"), timeout));
  if (absl::StartsWith(tmp, "error: ")) {
    return absl::AbortedError(absl::StrCat("the coordinating node's checkpoint of step ", req.step, " failed: ",
                                           tmp.substr(7)));
  }
  // The coordinator's temporary directory: a direct child of output.dir (the peer is authenticated;
  // the path is checked all the same).
  const std::filesystem::path dir(tmp);
  std::error_code ec;
  const bool inside = dir.is_absolute() &&
                      std::filesystem::weakly_canonical(dir.parent_path(), ec) ==
                          std::filesystem::weakly_canonical(std::filesystem::path(req.root_dir), ec) &&
                      absl::StartsWith(dir.filename().string(), ".tmp-checkpoint-") &&
                      std::filesystem::is_directory(std::filesystem::symlink_status(dir, ec));
  absl::Status written =
      inside ? checkpoint::WriteCheckpointShare(req, tmp).status()
             : absl::FailedPreconditionError(absl::StrCat("the coordinator's checkpoint directory ", tmp,
                                                          " is not a directory in output.dir ", req.root_dir,
                                                          " here (every node must see output.dir on a shared file system)"));
  RETURN_IF_ERROR(ctx.mesh()->StoreSet(ctx.job_id(), ShareKey(ctx, req.step, absl::StrCat("done/", nodes.self)),
                                       written.ok() ? std::string("ok") : std::string(written.message())));
  if (written.ok()) ctx.Log(absl::StrCat("wrote this node's share of checkpoint-", req.step, " into ", tmp));
  return written;
}

absl::Status TrainingExecutor::RunStep(JobContext& ctx, Attempt& a, int64_t t) {
  update::AdamWStepParams params;
  params.lr = a.loop.schedule->LrAt(t);  // the schedule follows the global step, skipped ones included
  params.beta1 = a.spec.optimizer.beta1;
  params.beta2 = a.spec.optimizer.beta2;
  params.eps = a.spec.optimizer.eps;
  params.weight_decay = a.spec.optimizer.weight_decay;
  params.step = t + 1 - a.measured.skipped_steps;  // Adam's bias correction counts applied updates only
  params.rounding_seed = a.spec.train.seed;        // BF16 moments' stochastic rounding (the data order's seed)
  const double paused_before = a.loop.adam->paused_s();
  StepUpdates updates(*a.loop.adam, a.loop.memory, *a.loop.tracker, t + 1, params, &a.layout,
                      &a.segments.state().updating_step());
  updates.SetBeforeFirstSkip([&a] { a.segments.state().skipped_steps_counter().store(a.measured.skipped_steps + 1); });
  ASSIGN_OR_RETURN(StepGradients grads, a.loop.consumer->ConsumeStep(t, t == a.loop.first_step, updates));
  if (grads.skipped) {
    a.segments.state().skipped_steps_counter().store(++a.measured.skipped_steps);
    const std::string line =
        absl::StrCat("warning: step ", t + 1, " skipped (train.skip_nonfinite): ", grads.skipped_because,
                     "; weights and Adam moments unchanged, ", a.measured.skipped_steps, " step(s) skipped so far");
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
  host.adam_paused_s = a.loop.adam->paused_s() - paused_before;
  a.segments.state().step_counter().store(t + 1);

  // Metrics: wait (briefly) for every rank's StepDone of this step.
  ASSIGN_OR_RETURN(std::vector<v1::StepDone> reports, a.loop.reports->WaitForStep(t, absl::Seconds(30)));
  // (A non-finite loss fails the job in WorkerReports as it arrives; skipping jobs checked it
  // before the step's updates.)
  const absl::Time now = absl::Now();
  const double step_s = absl::ToDoubleSeconds(now - a.measured.step_start);
  a.measured.step_start = now;
  StepRecord record = MakeStepRecord(t + 1, reports, host, step_s, params.lr, grads.grad_norm, a.layout.total_numel,
                                     a.model_layout.ModelFlopsPerToken(a.spec.train.seq_len), a.plan.world,
                                     static_cast<int64_t>(a.plan.memory.total_bytes));
  const double elapsed = absl::ToDoubleSeconds(now - a.measured.run_start);
  record.metrics.set_eta_s(elapsed / (t + 1 - a.loop.first_step) * (a.spec.train.steps - t - 1));
  record.metrics.set_skipped(grads.skipped);
  record.metrics.set_skipped_steps(a.measured.skipped_steps);
  record.metrics.set_speculated_fraction(static_cast<double>(grads.speculated_numel) /
                                         static_cast<double>(std::max<int64_t>(1, a.layout.total_numel)));
  record.metrics.set_speculation_rolled_back(grads.speculated_numel > 0 && grads.rolled_back);
  a.loop.consumer->ObserveWaits(record.metrics.worker_gate_wait_s(), record.metrics.worker_ring_wait_s());
  // This step's gate waits are the step before's updates showing.
  record.metrics.set_host_hidden_fraction(
      a.measured.prev_update_s > 0
          ? std::clamp(1.0 - record.metrics.worker_gate_wait_s() / a.measured.prev_update_s, 0.0, 1.0)
          : -1.0);
  a.measured.prev_update_s = host.update_s;
  if (record.metrics.host_update_gparams_per_s() > 0 && t > a.loop.first_step) {
    absl::MutexLock l(&mu_);
    update_rates_[static_cast<int>(a.plan.moments)] = record.metrics.host_update_gparams_per_s();
  }
  if (a.measured.peak_tflops > 0) record.metrics.set_mfu(record.metrics.model_tflops() / a.measured.peak_tflops);
  if (a.layout.config.is_moe()) {
    std::vector<int> sparse;
    for (int l = 0; l < a.layout.config.num_hidden_layers; ++l) {
      if (a.layout.config.IsSparseLayer(l)) sparse.push_back(l);
    }
    if (absl::Status s = AddRouterMetrics(reports, sparse, a.layout.config.num_experts, &record.metrics); !s.ok()) {
      return Annotate(s, absl::StrCat("step ", t + 1, ": a worker's router report"));
    }
  }
  a.measured.step_times.emplace_back(t + 1, record.metrics.step_time_s());
  a.loop.reports->SetCancelGrace(
      std::max(absl::Seconds(2 * record.metrics.step_time_s()), WorkerReports::kMinCancelGrace));
  if (!a.spec.data.validation.empty() && data::EvaluatesAfter(a.spec.train.eval_every, t, a.spec.train.steps)) {
    RETURN_IF_ERROR(RecordValidation(ctx, a, t, record.metrics));
  }
  if (ctx.job_nodes()) RETURN_IF_ERROR(ExchangeNodeStep(ctx, a, t, reports, grads.whole_unit_squares, record));
  ctx.ReportStep(record.metrics);
  if (!WritesOutputs(ctx)) return absl::OkStatus();
  a.outputs.metrics->Append(record, now, a.plan, a.spec, a.loop.consumer->staging_bytes_held());
  if (a.outputs.tensorboard) a.outputs.tensorboard->Append(record.metrics, now);
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<TrainingExecutor::Attempt>> TrainingExecutor::PrepareAttempt(JobContext& ctx) {
  JobSpec spec = ctx.spec();
  if (SavesCheckpoints(spec) && WritesOutputs(ctx)) {
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
    return std::unique_ptr<Attempt>();
  }
  // runtime.node_state sharded: this node holds its range of every unit (common/model/node_shard.h).
  NodeSharding sharding;
  if (std::optional<JobNodes> nodes = ctx.job_nodes(); nodes && spec.runtime.node_state == NodeState::kSharded) {
    sharding = MakeNodeSharding(layout, nodes->count(), static_cast<int>(hellos.size()), nodes->self,
                                spec.runtime.embedding_rows == Dtype::kF32);
  }
  const ModelLayout host_layout = NodeLayout(layout, sharding);
  ASSIGN_OR_RETURN(RoutePlan plan, PlanRoutes(spec, layout, WorkerDevicesOf(hellos), &host_layout));
  auto attempt = std::make_unique<Attempt>(std::move(spec), std::move(layout), std::move(sharding), std::move(plan),
                                           pool_, ctx.workers());
  Attempt& a = *attempt;
  if (ctx.job_nodes() &&
      std::any_of(hellos.begin(), hellos.end(), [](const v1::WorkerHello& h) { return h.device().kind() == "cuda"; })) {
    ctx.Log("note: a job over nodes on CUDA workers runs NCCL between the nodes, a path not yet run on GPUs here "
            "(docs/multi-node.md): compare its first steps with one node's");
  }
  if (a.sharding.sharded()) {
    ctx.Log(absl::StrFormat("sharded host state: node %d of %d holds %.1f%% of the model's elements (%lld of %lld)%s",
                            a.sharding.node, a.sharding.nodes,
                            100.0 * static_cast<double>(a.layout.total_numel) /
                                static_cast<double>(std::max<int64_t>(1, a.model_layout.total_numel)),
                            static_cast<long long>(a.layout.total_numel),
                            static_cast<long long>(a.model_layout.total_numel),
                            a.sharding.IsReplicated(0) ? "; the embedding whole on every node (runtime.embedding_rows f32)"
                                                       : ""));
  }
  a.policy_key = std::move(policy_key);
  if (std::any_of(hellos.begin(), hellos.end(), [](const v1::WorkerHello& h) { return h.device().kind() == "cuda"; })) {
    ctx.Log(LongestSequenceNote(a.spec, a.model_layout, a.plan, hellos));
  }
  if (a.spec.runtime.layer_layout && a.spec.runtime.layer_layout->autopolicy) {  // a cached (or file) AutoPolicy layout
    a.measured.predicted_step_s = a.spec.runtime.layer_layout->autopolicy->predicted.step_s;
    a.measured.predicted_bottleneck = a.spec.runtime.layer_layout->autopolicy->predicted.bottleneck;
    a.measured.layout_from_step = 2;  // the first step warms up
  }
  a.data.dataset_files = std::move(dataset_files);
  for (const v1::WorkerHello& h : hellos) {
    const double peak = h.device().kind() == "cuda" ? DenseBf16PeakTflops(h.device().name()) : 0;
    a.measured.peak_tflops =
        a.measured.peak_tflops == 0 && &h == &hellos.front() ? peak : std::min(a.measured.peak_tflops, peak);
  }
  if (!a.spec.data.validation.empty()) RETURN_IF_ERROR(VerifyValidation(ctx, a.spec, config.vocab_size, a.data));
  if (!a.spec.model.path.empty()) {
    ASSIGN_OR_RETURN(a.outputs.model_files, checkpoint::ReadModelDirFiles(a.spec.model.path));
  }
  return attempt;
}

absl::Status TrainingExecutor::RunAttempt(JobContext& ctx) {
  const absl::Time attempt_start = absl::Now();
  ASSIGN_OR_RETURN(std::unique_ptr<Attempt> attempt, PrepareAttempt(ctx));
  if (attempt == nullptr) return absl::OkStatus();  // train.measure_only, with nothing to measure
  Attempt& a = *attempt;

  // ---- admission, host state, rings (released when the attempt goes: AttemptSegments) ----
  RETURN_IF_ERROR(AcquireState(ctx, a));
  RETURN_IF_ERROR(a.segments.CreateExchange(options_.node_name, ctx.job_id(), a.plan));
  RETURN_IF_ERROR(a.loop.PlaceUnits(a.layout, a.spec, a.segments.state()));

  // ---- initial weights, schedule, staging ----
  if (a.segments.taken_over_step()) {
    // The state the dead hostd left holds exactly that many steps: nothing to load.
    a.loop.first_step = *a.segments.taken_over_step();
    a.measured.skipped_steps = static_cast<int64_t>(a.segments.state().skipped_steps_counter().load());
    a.segments.state().step_counter().store(static_cast<uint64_t>(a.loop.first_step));
    if (!a.spec.model.path.empty()) {
      ASSIGN_OR_RETURN(a.outputs.pass_through, checkpoint::ReadPassThrough(a.spec.model.path, a.layout.config));
    }
    ctx.Log(
        absl::StrFormat("resumed from shared memory at step %d (the state the previous hostd left; no checkpoint "
                        "read), host state ready in %.2f s",
                        a.loop.first_step, absl::ToDoubleSeconds(absl::Now() - attempt_start)));
    if (a.loop.first_step == a.spec.train.steps) {
      // The previous hostd died after the last update: only the end of the job is left.
      if (a.spec.output.save_final) RETURN_IF_ERROR(SaveCheckpoint(ctx, a, a.spec.train.steps));
      return absl::OkStatus();
    }
  } else {
    ASSIGN_OR_RETURN(InitialState initial,
                     WriteInitialState(ctx, a.spec, a.layout, a.segments.state(), a.segments.reused(),
                                       a.loop.bulk_threads, a.model_layout, a.sharding));
    a.loop.first_step = initial.first_step;
    a.measured.skipped_steps = initial.skipped_steps;
    a.outputs.pass_through = std::move(initial.pass_through);
    ctx.Log(absl::StrFormat("host state ready in %.2f s after the job started (%s)",
                            absl::ToDoubleSeconds(absl::Now() - attempt_start),
                            a.segments.reused() ? "pooled segment" : "new segment"));
  }
  if (a.loop.first_step >= a.spec.train.steps) {
    return absl::FailedPreconditionError(
        absl::StrCat("checkpoint is at step ", a.loop.first_step, ", the job has ", a.spec.train.steps));
  }
  RETURN_IF_ERROR(BuildStepLoop(ctx, a));

  // ---- the workers start ----
  RETURN_IF_ERROR(SendAssignments(ctx, a));
  ctx.SetTotalSteps(a.spec.train.steps);
  ctx.SetState(v1::JOB_STATE_RUNNING);
  std::error_code ec;
  if (WritesOutputs(ctx)) std::filesystem::create_directories(a.spec.output.dir, ec);
  if (ec) return absl::FailedPreconditionError(absl::StrCat("output.dir ", a.spec.output.dir, ": ", ec.message()));
  if (WritesOutputs(ctx)) a.outputs.metrics = std::make_unique<MetricsFile>(a.spec.output.dir, ctx.job_id());
  if (a.spec.output.tensorboard && WritesOutputs(ctx)) {
    a.outputs.tensorboard = std::make_unique<metrics::TensorBoardSink>(
        a.spec.output.dir, ctx.job_id(), absl::Now(), [&ctx](const std::string& line) { ctx.Log(line); });
  }
  a.measured.run_start = a.measured.step_start = absl::Now();

  for (int64_t t = a.loop.first_step; t < a.spec.train.steps; ++t) {
    // Cancel takes effect between steps: every unit then has exactly the updates of the steps
    // done, so the state (and a checkpoint of it) is consistent.
    if (ctx.cancel_requested()) {
      // (A sharded state's checkpoint needs every node's share, and a cancel reaches the others as an
      // abort: it saves at output.save_every and at the end only.)
      if (ctx.checkpoint_on_cancel() && t > a.loop.first_step && !a.spec.train.measure_only && !a.sharding.sharded()) {
        absl::Status saved = SaveCheckpoint(ctx, a, t);
        a.loop.reports->StopWorkers();
        RETURN_IF_ERROR(saved);
        return absl::CancelledError(absl::StrCat("cancelled at step ", t, "; checkpoint ", a.outputs.last_checkpoint));
      }
      a.loop.reports->StopWorkers();
      if (ctx.checkpoint_on_cancel() && !a.spec.train.measure_only) {
        // Nothing ran since the job started or resumed: there is no new state to save.
        return absl::CancelledError(absl::StrCat(
            "cancelled at step ", t, " before this run's first step ended; nothing new to save",
            ctx.resume_from().empty() ? std::string() : absl::StrCat(" (it resumed from ", ctx.resume_from(), ")")));
      }
      return absl::CancelledError(absl::StrCat("cancelled at step ", t));
    }
    RETURN_IF_ERROR(RunStep(ctx, a, t));
    if (auto chosen = a.loop.reports->TakePolicyChosen();
        chosen && RecordPolicy(ctx, a, *chosen) && a.spec.train.measure_only) {
      // Its purpose is served: the layout and its measurements are cached for `slidedp plan` and
      // the next job of this shape. The state is this job's own and is dropped unsaved.
      a.loop.reports->StopWorkers();
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
  RETURN_IF_ERROR(a.loop.reports->WaitForEnd(absl::Seconds(30)));
  const bool cached = [&] {
    auto chosen = a.loop.reports->TakePolicyChosen();
    return chosen && RecordPolicy(ctx, a, *chosen);
  }();
  LogPrediction(ctx, a.measured);
  if (a.spec.train.measure_only) {
    if (cached) return absl::OkStatus();
    return absl::FailedPreconditionError(absl::StrCat("train.measure_only: AutoPolicy cached no layout in the job's ",
                                                      a.spec.train.steps, " steps (the workers' logs say why)"));
  }
  if (a.spec.output.save_final) RETURN_IF_ERROR(SaveCheckpoint(ctx, a, a.spec.train.steps));
  if (a.loop.reports->all_finished()) a.segments.MarkPoolable();
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
