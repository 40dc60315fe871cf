#include "worker/agent/job_config.h"

#include "common/status/status_macros.h"

namespace slidedp::worker {
namespace {

std::vector<data::FileIdentity> FileIdentities(const google::protobuf::RepeatedPtrField<v1::DatasetFile>& files) {
  std::vector<data::FileIdentity> out;
  for (const v1::DatasetFile& f : files) out.push_back({f.dev(), f.inode(), f.size(), f.mtime_ns(), f.ctime_ns()});
  return out;
}

void TakeAssignment(const v1::Assignment& a, WorkerJobConfig& c) {
  c.job_id = a.job_id();
  c.attempt = a.attempt();
  c.rank = a.rank();
  c.world = a.world_size();
  c.first_step = a.first_step();
  c.total_steps = a.total_steps();
  c.membership_key = a.membership_key();
  c.state_segment = a.state_segment();
  c.ring_segment = a.ring_segment();
  c.collective_segment = a.collective_segment();
  c.context_segment = a.context_segment();
  if (a.has_speculate_from_unit()) c.speculate_from_unit = a.speculate_from_unit();
  c.dataset_files = FileIdentities(a.dataset_files());
  c.validation_path = a.validation_path();
  c.validation_files = FileIdentities(a.validation_files());
  c.node = a.node();
  c.nodes = std::max(1, a.nodes());
  c.node_address = a.node_address();
}

void TakeSpec(const JobSpec& spec, int64_t device_memory_bytes, WorkerJobConfig& c) {
  c.gpu_route = spec.runtime.grad_reduction == GradReduction::kGpu && c.world > 1;
  c.sharded_delivery = spec.runtime.param_delivery == ParamDelivery::kSharded && c.world > 1;
  c.node_state = spec.runtime.node_state;
  c.device_staging = spec.runtime.grad_staging == GradStaging::kDevice;
  c.data_path = spec.data.path;
  c.seq_len = spec.train.seq_len;
  c.global_batch = spec.train.global_batch;
  c.micro_batch = spec.train.micro_batch;
  c.seed = spec.train.seed;
  c.eval_every = spec.train.eval_every;
  c.context_parallel = spec.runtime.context_parallel;
  c.step_timeout = absl::Milliseconds(spec.runtime.step_timeout_ms);
  c.param_source = spec.runtime.param_source;
  c.norm_weights = spec.runtime.norm_weights;
  c.embedding_rows = spec.runtime.embedding_rows;
  c.cast_on = spec.runtime.cast_on;
  c.cast_threads = spec.runtime.cast_threads;
  c.chunk_bytes = spec.runtime.chunk_bytes;
  c.copy_priority = spec.runtime.copy_priority;
  c.grad_dtype = spec.runtime.grad_dtype;
  c.deterministic = spec.runtime.deterministic;
  c.tile_tokens = spec.runtime.tile_tokens;
  c.act_policy = spec.runtime.act_policy;
  c.policy_auto = spec.runtime.policy_auto;
  c.layer_layout = spec.runtime.layer_layout;
  c.offload_ratio = spec.runtime.offload_ratio;
  c.checkpoint_dtype = spec.runtime.checkpoint_dtype;
  c.router_aux_coef = spec.train.RouterAuxCoef(c.model.output_router_logits, c.model.router_aux_loss_coef);
  c.gpu_memory_limit_bytes = GpuMemoryLimitBytes(spec, device_memory_bytes);
}

}  // namespace

absl::StatusOr<WorkerJobConfig> WorkerJobConfigOf(const v1::Assignment& a, int64_t device_memory_bytes) {
  WorkerJobConfig c;
  ASSIGN_OR_RETURN(JobSpec spec, JobSpecOf(a.config()));
  ASSIGN_OR_RETURN(c.model, ModelConfigOf(spec));  // with the spec's context override, as hostd
  RETURN_IF_ERROR(c.model.CheckTrainable());
  TakeAssignment(a, c);
  TakeSpec(spec, device_memory_bytes, c);
  return c;
}

}  // namespace slidedp::worker
