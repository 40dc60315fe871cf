// RoutePlan: every route, staging and ring decision of one job, made before anything is allocated.
//
// A pure function of the spec, the model layout and the workers' devices (PlanRoutes), so each
// decision has a unit test (job_plan_test.cc) and the executor only carries it out:
// - the gradient route: gpu (ranks reduce-scatter and post only their own, already summed shard;
//   CPU-backend workers do it through a shm collective segment) or cpu (ranks post whole units
//   and hostd sums them, also the only route of one rank);
// - where gradients wait for the clipping norm: on the devices (each rank keeps its final parts,
//   posts its squared norm first, hostd stages nothing) or in hostd's memory;
// - which consumer takes the rings (GradConsumerKind), and whether hostd holds a staging buffer;
// - the rings and the memory plan admission checks (hostd/admission).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "common/jobspec/job_spec.h"
#include "common/model/model_config.h"
#include "common/policy/context_memory.h"
#include "hostd/admission/admission.h"
#include "shm/grad_ring.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::hostd {

// What PlanRoutes needs to know of each rank's worker (from its hello).
struct WorkerDevice {
  bool cpu_backend = false;  // a CPU-backend worker (its "device memory" is host memory)
  int64_t memory_bytes = 0;  // device memory; 0 when unknown
  std::string uuid;          // the GPU's (CUDA workers; empty when unknown): workers sharing one
  std::string worker_id;     // its name at hostd (for messages)
};
std::vector<WorkerDevice> WorkerDevicesOf(absl::Span<const v1::WorkerHello> hellos);

// How hostd takes a step's gradients out of the rings (hostd/engine/grad_consumer.h).
enum class GradConsumerKind {
  kShards,  // every posted part is final (gpu route, or device staging): one consumer per rank
  kDirect,  // one rank, no clipping: applied straight from its ring slots
  kSummed,  // the ranks' copies of each chunk summed in rank order into staging (cpu route)
};

// Where the step's gradients wait until the whole step is known: for the global clipping norm,
// and with train.skip_nonfinite until the step is known finite (then without clipping the
// coefficient is 1).
enum class ClipStaging {
  kNone,    // no clipping, no skipping: each final chunk is applied as it arrives
  kHost,    // hostd stages the whole step (4 B/param of its memory), then applies in forward order
  kDevice,  // each rank stages its parts on its device and posts its squared norm first
};

struct RoutePlan {
  int world = 0;
  GradReduction route = GradReduction::kCpu;  // kGpu only with more than one rank
  bool shm_collective = false;                // CPU workers on the gpu route
  uint64_t collective_buffer_bytes = 0;       // the collective's per-rank buffer (largest padded unit)
  // runtime.context_parallel > 1: the context group's collective, per-rank buffer (the gathered keys
  // and values of a micro-batch's share, padded; the reduce-scatter of their gradients).
  uint64_t context_buffer_bytes = 0;
  int context_ranks = 1;         // ranks per context group: world / context_ranks groups, one segment each
  bool context_on_nccl = false;  // CUDA workers gather over NCCL (no segment; context_buffer_bytes 0)
  ClipStaging clip_staging = ClipStaging::kNone;
  // runtime.grad_dtype: what every posted chunk holds (staging widens BF16 to FP32 exactly).
  Dtype grad_dtype = Dtype::kF32;
  // optimizer.state_dtype: how the job segment keeps Adam's m and v.
  MomentForm moments = MomentForm::kF32;
  // runtime.param_source: whether the job segment keeps the BF16 mirror (else workers cast).
  bool mirror = true;
  CastOn cast_on = CastOn::kDevice;  // runtime.cast_on, without a mirror
  shm::StateFormat state_format() const { return shm::StateFormat{moments, mirror}; }
  GradConsumerKind consumer = GradConsumerKind::kSummed;
  // hostd's whole-step FP32 gradient buffer (staging_bytes of its own memory): for the clipping
  // norm with host staging, or to sum the ranks' full copies (cpu route, several ranks).
  bool host_staging = false;
  uint64_t staging_bytes = 0;                // total_numel x 4 where host_staging, else 0
  std::vector<int64_t> shard_numel_of_rank;  // elements each rank posts per step
  shm::GradRingConfig ring;
  MemoryPlan memory;  // everything admission counts, collective and staging included
  // The GPU memory floor of the step on a CUDA worker (common/policy/context_memory.h); PlanRoutes
  // refuses a job whose floor is over a CUDA worker's device memory (or its gpu_memory_limit).
  ContextMemory device_floor;

  // Speculative clipping (undo_arena.h): units [speculate_from_unit, num_units) are updated
  // before the step's norm is known; num_units: none. With runtime.speculation_bytes -1 (auto)
  // PlanRoutes leaves it at num_units and the executor sizes it to what the host has left
  // (SizeSpeculation); with N > 0 it is sized here and counted in `memory`.
  int speculate_from_unit = 0;
  bool speculation_auto = false;

  bool clip_by_norm = false;    // train.max_grad_norm > 0
  bool skip_nonfinite = false;  // train.skip_nonfinite

  // A step's updates wait until its whole gradient is known (clipping or skipping).
  bool stages_whole_step() const { return clip_staging != ClipStaging::kNone; }
  // The spec the workers run (Assignment.config): `spec` with the routes this plan chose, never
  // auto: runtime.grad_reduction the route, grad_staging device or host.
  JobSpec WorkerSpec(const JobSpec& spec) const;
  // What the job log says about the routes ("gradient reduction: ...; parameter delivery: ...").
  std::string RoutesLine(ParamDelivery delivery) const;
  // "host state: <memory plan> [+ shm collective N GiB]".
  std::string MemoryLine() const;
};

// runtime.speculation_bytes auto: the undo copies take what `available_bytes` of host memory the
// job's plan leaves (less a margin), up to the whole model; sets speculate_from_unit and
// memory.undo_bytes (not total_bytes: admission has passed). No-op unless plan.speculation_auto.
void SizeSpeculation(const ModelLayout& layout, uint64_t available_bytes, uint64_t mem_total_bytes, RoutePlan& plan);

// The whole plan: the parts below in order (each tested alone in job_plan_test.cc). INVALID_ARGUMENT
// for a global batch that does not split over the ranks and micro-batches, or grad_staging device
// where hostd must sum the ranks' copies; FAILED_PRECONDITION for workers the job cannot run on;
// RESOURCE_EXHAUSTED for a step over a GPU's memory.
// host_layout (a node of a sharded state, common/model/node_shard.h: each unit cut to the node's range):
// what hostd holds, posts and stages is planned on it, the workers' side (their devices, the
// collectives' buffers) on the model's `layout`. Null: the same.
absl::StatusOr<RoutePlan> PlanRoutes(const JobSpec& spec, const ModelLayout& layout, absl::Span<const WorkerDevice> workers,
                                     const ModelLayout* host_layout = nullptr);

// ---- PlanRoutes's parts, by concern ----

// The global batch splits over `world` workers' data-parallel ranks (their context-parallel groups)
// and micro-batches: INVALID_ARGUMENT otherwise, and for no worker at all.
absl::Status CheckBatchSplit(const JobSpec& spec, int world);

// The workers can run the job: runtime.backend, sharded delivery and the gpu route on one backend,
// the CUDA MoE block's limits, one GPU per NCCL rank, context parallelism on one backend.
// FAILED_PRECONDITION (INVALID_ARGUMENT for the MoE limits) naming what does not fit. Returns
// whether the job has a NCCL communicator (CUDA workers, several ranks, the gpu route or sharded
// delivery).
absl::StatusOr<bool> CheckWorkersFit(const JobSpec& spec, const ModelLayout& layout,
                                     absl::Span<const WorkerDevice> workers);

// Context parallelism (runtime.context_parallel > 1): the group size, and whether keys and values
// travel over NCCL or through a shm segment per group (context_buffer_bytes). Sets p.context_*.
void PlanContextGroups(const JobSpec& spec, const ModelLayout& layout, bool nccl, RoutePlan& p);

// The gradient route, the clipping staging, the state format and the ring consumer (p.world set).
// INVALID_ARGUMENT for grad_staging device where hostd must sum the ranks' copies.
absl::Status PlanGradientRoute(const JobSpec& spec, const ModelLayout& layout, absl::Span<const WorkerDevice> workers,
                               RoutePlan& p, const ModelLayout* host_layout = nullptr);

// What admission counts (rings, staging, cast staging, offloaded checkpoints, shm segments, undo
// copies) and the GPU memory floor, after the parts above. RESOURCE_EXHAUSTED naming the longest
// sequence that fits when the floor is over a CUDA worker's device (or its gpu_memory_limit);
// FAILED_PRECONDITION for a runtime.policy made for another model.
absl::Status PlanMemory(const JobSpec& spec, const ModelLayout& layout, absl::Span<const WorkerDevice> workers,
                        RoutePlan& p, const ModelLayout* host_layout = nullptr);

}  // namespace slidedp::hostd
