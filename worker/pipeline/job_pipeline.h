// JobPipeline: one job's parts between the shared-memory state and the compute backend (parameter
// streaming, the gradient path, the activation store, the context group), and PipelineFactory,
// which makes them for one kind of device: cpu_pipeline.h (the CPU reference backend) and
// cuda_pipeline.h (CUDA). Everything the worker does differently per device goes through the
// factory, so the worker's job code (worker/agent/job_session.h) has no per-backend branch.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/collective/key_value_store.h"
#include "common/collective/node_link.h"
#include "common/model/model_config.h"
#include "worker/compute/backend.h"
#include "worker/pipeline/activation_store.h"
#include "worker/pipeline/auto_policy.h"
#include "worker/pipeline/gradient_path.h"
#include "worker/pipeline/unit_streamer.h"

namespace slidedp {

class HostRegistry;
namespace shm {
class GradRing;
class JobState;
class ShmCollective;
}  // namespace shm

// The device a worker computes on, as it registers with hostd (v1::DeviceInfo less kind and index).
struct DeviceDescription {
  std::string name = "cpu reference backend";
  int64_t memory_bytes = 0;  // 0: not known
  std::string uuid;          // CUDA: "GPU-..."
  std::string pci_bus_id;    // CUDA: "0000:18:00.0"
  int numa_node = 0;
};

// How the ranks of a job agree on a new NCCL communicator's unique id: rank 0 publishes the one it
// made, the others wait for it (hostd relays it: WorkerReport.comm_id, HostCommand.comm_id).
class CommIdExchange {
 public:
  virtual ~CommIdExchange() = default;
  virtual absl::Status Publish(const std::string& id) = 0;
  virtual absl::StatusOr<std::string> Await() = 0;
};

// What a factory builds a job's pipeline from.
struct PipelineSettings {
  shm::JobState* job_state = nullptr;
  shm::GradRing* ring = nullptr;  // this rank's gradient ring
  const ModelLayout* layout = nullptr;
  ComputeBackend* backend = nullptr;
  HostRegistry* registry = nullptr;  // CUDA: the state segment's registrations, kept across jobs
  int rank = 0;
  int world = 1;
  absl::Duration timeout;  // runtime.step_timeout_ms: every gate, ring and collective wait
  // The gradient path; grads.route kGpu is the gpu route with several ranks (ranks reduce-scatter).
  GradientPathOptions grads;
  bool sharded_delivery = false;   // param_delivery sharded with several ranks (CUDA: NCCL all-gather)
  std::string collective_segment;  // CPU workers on the gpu route: hostd's ShmCollective
  // Parameter delivery.
  Dtype norms = Dtype::kF32;
  Dtype embedding = Dtype::kF32;
  UploadSource source = UploadSource::kMirror;
  int cast_threads = 1;
  int64_t chunk_bytes = 64ll << 20;  // CUDA: H2D chunk
  bool cast_on_device = true;        // CUDA, source kMaster: cast on the GPU (else on the host)
  bool urgent_copies = false;        // CUDA: mark the copies the GPU waits for (runtime.copy_priority)
  // Layer inputs kept in host memory: per unit its offloaded share (a per-layer layout), or else
  // the first offload_ratio of the layers; neither: none.
  std::vector<double> offloaded;
  double offload_ratio = 0;
  // Context parallelism: this rank's place in its group of context_ranks (context_group: the
  // group's index, its data-parallel rank), and hostd's context segment (empty: NCCL, CUDA only).
  int context_ranks = 1;
  int context_rank = 0;
  int context_group = 0;
  std::string context_segment;
  // The job's NCCL communicator (CUDA): hostd's membership key and how rank 0's id travels.
  std::string membership_key;
  CommIdExchange* comm_ids = nullptr;
};

// Cumulative seconds of the pipeline's waits and copies since the job began.
struct PipelineCounters {
  double gate_wait_s = 0;
  double d2h_s = 0;
  double h2d_s = 0;
  double cast_s = 0;
  double ring_wait_s = 0;
};

// The parts of one job; destroyed in reverse order (the context group first, the streamer last;
// the cross-node link after the gradient path that uses it).
struct JobPipeline {
  std::unique_ptr<NodeLink> nodes;  // a job over several nodes: this rank's link to the others
  std::unique_ptr<UnitStreamer> streamer;
  std::unique_ptr<GradientPath> grads;
  std::unique_ptr<shm::ShmCollective> collective;  // CPU workers' reduce-scatter on the gpu route
  std::unique_ptr<ActivationStore> activations;    // null: layer inputs stay on the device
  std::unique_ptr<ContextGroup> context_group;     // context parallelism only

  // The device memory the window and the gradient buffers take (the backend gets the rest).
  int64_t device_bytes() const { return streamer->device_bytes() + grads->device_bytes(); }
  PipelineCounters counters() const;
};

// A job over several nodes: the link of this local rank to the same rank on the other nodes.
struct NodeLinkSettings {
  int node = 0, nodes = 1;
  std::string address;  // where this rank listens for the others
  std::string group;    // the link's name in the store (job, attempt, local rank)
  std::shared_ptr<KeyValueStore> store;
  absl::Duration timeout;  // runtime.step_timeout_ms
};

class PipelineFactory {
 public:
  virtual ~PipelineFactory() = default;

  virtual DeviceDescription Describe() const = 0;
  // A compute backend for `config` (the worker keeps it warm between jobs of one model shape).
  virtual absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeBackend(const ModelConfig& config) = 0;
  // What a state segment keeps registered with the device across jobs: a HostRegistry on CUDA,
  // null on the CPU. Shared only so that a build without CUDA can hold a null one.
  virtual std::shared_ptr<HostRegistry> NewHostRegistry() = 0;
  // Makes the worker's device the calling thread's (CUDA: the context that registered a state
  // segment's mirrors, before they are unregistered).
  virtual void UseDevice() = 0;

  // The job's NCCL communicator where its routes need one (CUDA with the gpu route or sharded
  // delivery): the one kept from the last job while hostd's membership key, rank and world match,
  // else a new one. Nothing elsewhere.
  virtual absl::Status JoinCommunicator(const PipelineSettings& settings) = 0;
  // After a failed or cancelled job the peers may have stopped at different collectives: the
  // communicator is aborted and never reused.
  virtual void DropCommunicator() = 0;

  // A job over several nodes: the cross-node link of this rank (CPU workers: Gloo over TCP, host
  // buffers; CUDA workers: NCCL, device buffers).
  virtual absl::StatusOr<std::unique_ptr<NodeLink>> JoinNodes(const NodeLinkSettings& settings) = 0;
  // The streamer, the gradient path, the activation store and the context group, in that order.
  virtual absl::StatusOr<JobPipeline> Build(const PipelineSettings& settings) = 0;
  // An activation store for AutoPolicy's layout, offloading each unit's share as given.
  virtual absl::StatusOr<std::unique_ptr<ActivationStore>> MakeActivationStore(ComputeBackend* backend,
                                                                               std::vector<double> offloaded) = 0;
  // AutoPolicy: the probe of the store's copy rates (empty: copies cost no time), and the noise a
  // layout's step time must beat recompute's by (the CPU backend times a tiny model among other
  // processes: only gross misses count there).
  virtual std::function<absl::StatusOr<CopyRates>()> CopyRateProbe() const = 0;
  virtual double autopolicy_time_tolerance() const = 0;
};

// A CUDA worker in a build without CUDA: it registers (kind cuda) and fails every job UNIMPLEMENTED.
std::unique_ptr<PipelineFactory> MakeMissingCudaPipelineFactory();

}  // namespace slidedp
