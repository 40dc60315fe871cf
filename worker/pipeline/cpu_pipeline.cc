#include "worker/pipeline/cpu_pipeline.h"

#include <unistd.h>

#include <utility>

#include "common/collective/gloo_group.h"
#include "common/status/status_macros.h"
#include "shm/job_state.h"
#include "shm/shm_collective.h"
#include "worker/comm/shm_context_group.h"
#include "worker/compute/cpu/cpu_backend.h"

namespace slidedp {
namespace {

class CpuPipelineFactory final : public PipelineFactory {
 public:
  explicit CpuPipelineFactory(CpuPipelineOptions options) : options_(options) {}

  DeviceDescription Describe() const override {
    DeviceDescription d;  // the CPU backend's "device" memory is host memory
    d.memory_bytes = options_.device_memory_bytes > 0
                         ? options_.device_memory_bytes
                         : static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE);
    return d;
  }

  absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeBackend(const ModelConfig& config) override {
    CpuBackendOptions o;
    o.device_memory_bytes = options_.device_memory_bytes;
    return MakeCpuBackend(config, o);
  }

  std::shared_ptr<HostRegistry> NewHostRegistry() override { return nullptr; }
  void UseDevice() override {}
  absl::Status JoinCommunicator(const PipelineSettings&) override { return absl::OkStatus(); }
  void DropCommunicator() override {}

  // Gloo over TCP between the nodes' CPU workers of one local rank.
  absl::StatusOr<std::unique_ptr<NodeLink>> JoinNodes(const NodeLinkSettings& n) override {
    GlooGroupOptions o;
    o.rank = n.node;
    o.size = n.nodes;
    o.store = n.store;
    o.prefix = n.group;
    o.host = n.address;
    o.timeout = n.timeout;
    ASSIGN_OR_RETURN(std::unique_ptr<GlooGroup> group, GlooGroup::Connect(o));
    return std::unique_ptr<NodeLink>(std::move(group));
  }

  absl::StatusOr<JobPipeline> Build(const PipelineSettings& s) override {
    JobPipeline p;
    auto streamer = std::make_unique<HostMirrorStreamer>(s.job_state, *s.layout, s.timeout, s.norms, s.embedding,
                                                         s.source, s.cast_threads);
    if (s.grads.route == GradRoute::kGpu) {
      if (s.collective_segment.empty()) {
        return absl::FailedPreconditionError("grad_reduction gpu on CPU workers needs hostd's collective segment");
      }
      ASSIGN_OR_RETURN(p.collective, shm::ShmCollective::Attach(s.collective_segment, s.rank, &s.job_state->abort()));
    }
    if (s.grads.sharding != nullptr && s.grads.sharding->sharded()) {
      streamer->ShardOverNodes(s.grads.sharding, s.grads.nodes, p.collective.get(), s.rank, s.world);
    }
    p.streamer = std::move(streamer);
    p.grads = MakeHostGradientPath(*s.layout, s.ring, p.collective.get(), s.grads);
    if (!s.offloaded.empty()) {
      p.activations = MakeHostActivationStore(s.backend, s.offloaded);
    } else if (s.offload_ratio > 0) {
      p.activations = MakeHostActivationStore(*s.layout, s.backend, s.offload_ratio);
    }
    if (s.context_ranks > 1) {
      if (s.context_segment.empty()) {
        return absl::FailedPreconditionError(
            options_.mention_nccl_context_groups
                ? "runtime.context_parallel needs hostd's context segment (or, on CUDA workers, the job's NCCL "
                  "communicator)"
                : "runtime.context_parallel needs hostd's context segment");
      }
      ASSIGN_OR_RETURN(p.context_group,
                       ShmContextGroup::Attach(s.context_segment, s.context_rank, &s.job_state->abort(), s.timeout));
    }
    return p;
  }

  absl::StatusOr<std::unique_ptr<ActivationStore>> MakeActivationStore(ComputeBackend* backend,
                                                                       std::vector<double> offloaded) override {
    return MakeHostActivationStore(backend, std::move(offloaded));
  }

  std::function<absl::StatusOr<CopyRates>()> CopyRateProbe() const override { return nullptr; }
  // The CPU backend times a tiny model beside whatever else the machine runs (CI runs tests in
  // parallel on 2 cores): only a layout 4x slower than recompute counts as a miss there.
  double autopolicy_time_tolerance() const override { return 3.0; }

 private:
  CpuPipelineOptions options_;
};

}  // namespace

std::unique_ptr<PipelineFactory> MakeCpuPipelineFactory(CpuPipelineOptions options) {
  return std::make_unique<CpuPipelineFactory>(options);
}

}  // namespace slidedp
