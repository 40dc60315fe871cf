// WorkerJobConfig: everything a worker takes from its Assignment for one job, typed, in one struct.
// WorkerJobConfigOf is the one place that reads the job config hostd sent (Assignment.config, the
// spec hostd parsed, validated and resolved: common/jobspec/job_spec_proto.h); no text is parsed.
// Values are copied as sent; they are checked where the job uses them (JobSession), in the order
// the job has always checked them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/data/dataset.h"
#include "common/jobspec/job_spec_proto.h"
#include "common/model/model_config.h"
#include "common/policy/layer_policy.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::worker {

struct WorkerJobConfig {
  // ---- the assignment: which job, this rank, the job's segments and routes ----
  std::string job_id;
  int32_t attempt = 0;
  int rank = 0;
  int world = 1;
  int64_t first_step = 0;  // 0, or the resumed step
  int64_t total_steps = 0;
  std::string membership_key;  // hostd's key of the ranks' NCCL communicator
  std::string state_segment;
  std::string ring_segment;
  std::string collective_segment;  // CPU workers on the gpu route: hostd's ShmCollective
  std::string context_segment;     // context parallelism: hostd's context collective (empty: NCCL)
  bool gpu_route = false;          // grad_reduction gpu with several ranks: ranks reduce-scatter
  bool sharded_delivery = false;   // param_delivery sharded with several ranks
  bool device_staging = false;     // grad_staging device: exact clipping's gradients wait on the device
  std::optional<int32_t> speculate_from_unit;
  std::vector<data::FileIdentity> dataset_files;  // as hostd verified them (empty: not sent)
  std::string validation_path;                    // empty: no validation
  std::vector<data::FileIdentity> validation_files;
  // A job over several nodes (runtime.nodes): this node's index, the node count (1: this node only)
  // and the address this worker listens on for the other nodes. The data-parallel rank is
  // node * world + rank of nodes * world.
  int node = 0;
  int nodes = 1;
  std::string node_address;
  // runtime.node_state: sharded, this node's hostd holds only its range of each unit (node_shard.h).
  NodeState node_state = NodeState::kReplicated;

  // ---- the job spec ----
  ModelConfig model;  // the preset's or config.json, with the spec's context override (as hostd)
  std::string data_path;
  int64_t seq_len = 0;
  int64_t global_batch = 0;
  int64_t micro_batch = 1;
  uint64_t seed = 0;
  int64_t eval_every = 0;
  int context_parallel = 1;
  absl::Duration step_timeout;  // every gate, ring and collective wait
  ParamSource param_source = ParamSource::kMirror;
  Dtype norm_weights = Dtype::kF32;
  Dtype embedding_rows = Dtype::kF32;
  CastOn cast_on = CastOn::kDevice;
  int32_t cast_threads = 0;  // 0: auto
  int64_t chunk_bytes = 0;
  double copy_priority = 0;
  Dtype grad_dtype = Dtype::kF32;
  bool deterministic = false;
  int64_t tile_tokens = 0;
  ActivationPolicy act_policy = ActivationPolicy::kRecomputeLayer;
  bool policy_auto = false;                 // runtime.policy auto (unless layer_layout is given)
  std::optional<LayerLayout> layer_layout;  // runtime.policy: a per-layer layout
  double offload_ratio = 0;
  Dtype checkpoint_dtype = Dtype::kF32;
  double router_aux_coef = 0;  // the MoE load-balancing loss's coefficient (0: none)
  // runtime.gpu_memory_limit on this worker's device; 0: no limit.
  int64_t gpu_memory_limit_bytes = 0;
};

// The job's config on this worker, whose device has `device_memory_bytes` (0: not known). Fails
// where the spec does not parse or its model cannot be trained.
absl::StatusOr<WorkerJobConfig> WorkerJobConfigOf(const v1::Assignment& a, int64_t device_memory_bytes);

}  // namespace slidedp::worker
