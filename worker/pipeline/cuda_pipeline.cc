#include "worker/pipeline/cuda_pipeline.h"

#include <cuda_runtime_api.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "shm/job_state.h"
#include "worker/comm/nccl_communicator.h"
#include "worker/comm/nccl_context_group.h"
#include "worker/comm/shm_context_group.h"
#include "worker/pipeline/cuda_activation_store.h"
#include "worker/pipeline/cuda_gradient_path.h"
#include "worker/pipeline/cuda_streamer.h"
#include "worker/pipeline/host_registry.h"

namespace slidedp {
namespace {

class CudaPipelineFactory final : public PipelineFactory {
 public:
  explicit CudaPipelineFactory(CudaPipelineOptions options) : options_(options) {}
  ~CudaPipelineFactory() override = default;

  DeviceDescription Describe() const override {
    DeviceDescription d;
    cudaDeviceProp prop;
    if (cudaGetDeviceProperties(&prop, options_.device) != cudaSuccess) return d;
    d.name = prop.name;
    d.memory_bytes = static_cast<int64_t>(prop.totalGlobalMem);
    char bus[32];
    snprintf(bus, sizeof(bus), "%04x:%02x:%02x.0", prop.pciDomainID, prop.pciBusID, prop.pciDeviceID);
    d.pci_bus_id = bus;
    std::string uuid = "GPU-";
    for (int i = 0; i < 16; ++i) {
      absl::StrAppend(&uuid, absl::Hex(static_cast<unsigned char>(prop.uuid.bytes[i]), absl::kZeroPad2));
      if (i == 3 || i == 5 || i == 7 || i == 9) uuid += "-";
    }
    d.uuid = uuid;
    // The GPU's NUMA node, for placing this worker's host memory and LayerAdam's threads.
    std::ifstream numa(absl::StrCat("/sys/bus/pci/devices/", bus, "/numa_node"));
    int node = 0;
    if (numa >> node && node >= 0) d.numa_node = node;
    return d;
  }

  absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeBackend(const ModelConfig& config) override {
    return MakeCudaBackend(config, options_.device);
  }

  std::shared_ptr<HostRegistry> NewHostRegistry() override { return std::make_shared<HostRegistry>(); }
  void UseDevice() override { cudaSetDevice(options_.device); }

  absl::Status JoinCommunicator(const PipelineSettings& s) override {
    if (s.grads.route != GradRoute::kGpu && !s.sharded_delivery) return absl::OkStatus();
    if (comm_ && !comm_->broken() && comm_->key() == s.membership_key && comm_->rank() == s.rank &&
        comm_->world() == s.world) {
      return absl::OkStatus();
    }
    comm_.reset();
    std::string id;
    if (s.rank == 0) {
      ASSIGN_OR_RETURN(id, NcclCommunicator::NewUniqueId());
      RETURN_IF_ERROR(s.comm_ids->Publish(id));
    } else {
      ASSIGN_OR_RETURN(id, s.comm_ids->Await());
    }
    ASSIGN_OR_RETURN(comm_, NcclCommunicator::Create(options_.device, id, s.rank, s.world, s.membership_key));
    return absl::OkStatus();
  }

  // NCCL between the nodes' GPUs of one local rank (IB/RoCE or sockets, as NCCL finds them).
  absl::StatusOr<std::unique_ptr<NodeLink>> JoinNodes(const NodeLinkSettings& n) override {
    ASSIGN_OR_RETURN(std::unique_ptr<NcclNodeLink> link,
                     NcclNodeLink::Join(options_.device, n.node, n.nodes, n.group, *n.store, n.timeout));
    return std::unique_ptr<NodeLink>(std::move(link));
  }

  void DropCommunicator() override {
    if (!comm_) return;
    comm_->Abort();
    comm_.reset();
  }

  absl::StatusOr<JobPipeline> Build(const PipelineSettings& s) override {
    const bool gpu_route = s.grads.route == GradRoute::kGpu;
    NcclCommunicator* comm = gpu_route || s.sharded_delivery ? comm_.get() : nullptr;  // JoinCommunicator's
    const auto compute = static_cast<cudaStream_t>(s.backend->native_stream());
    JobPipeline p;
    CudaStreamerOptions copt;
    copt.device = options_.device;
    copt.chunk_bytes = s.chunk_bytes;
    copt.gate_timeout = s.timeout;
    copt.sharded_with = s.sharded_delivery ? comm : nullptr;
    copt.registry = s.registry;
    copt.norms = s.norms;
    copt.embedding = s.embedding;
    copt.urgent_rank = s.urgent_copies ? s.rank : -1;  // DMA before Adam
    copt.source = s.source;
    copt.cast_on_device = s.cast_on_device;
    copt.cast_threads = s.cast_threads;
    if (s.grads.sharding != nullptr && s.grads.sharding->sharded()) {  // runtime.node_state sharded
      copt.sharding = s.grads.sharding;
      copt.node_link = static_cast<NcclNodeLink*>(s.grads.nodes);  // JoinNodes made it
      copt.local = s.world > 1 ? comm : nullptr;
      copt.rank = s.rank;
      copt.world = s.world;
      copt.sharded_with = nullptr;  // the node ranges' gather replaces sharded delivery
    }
    ASSIGN_OR_RETURN(p.streamer, CudaWindowStreamer::Create(s.job_state, s.ring, *s.layout, compute, copt));
    CudaGradientPathOptions cg;
    cg.base = s.grads;
    cg.device = options_.device;
    cg.comm = gpu_route ? comm : nullptr;
    cg.nodes = static_cast<NcclNodeLink*>(s.grads.nodes);  // JoinNodes made it
    cg.abort = &s.job_state->abort();
    cg.log_unit_norms = options_.log_unit_norms;
    ASSIGN_OR_RETURN(p.grads, MakeCudaGradientPath(*s.layout, s.ring, compute, cg));
    if (!s.offloaded.empty()) {
      ASSIGN_OR_RETURN(p.activations, MakeCudaActivationStore(s.backend, s.offloaded, options_.device));
    } else if (s.offload_ratio > 0) {
      ASSIGN_OR_RETURN(p.activations, MakeCudaActivationStore(*s.layout, s.backend, s.offload_ratio, options_.device));
    }
    if (s.context_ranks > 1) {
      ASSIGN_OR_RETURN(p.context_group, MakeContextGroup(s, comm));
    }
    return p;
  }

  absl::StatusOr<std::unique_ptr<ActivationStore>> MakeActivationStore(ComputeBackend* backend,
                                                                       std::vector<double> offloaded) override {
    return MakeCudaActivationStore(backend, std::move(offloaded), options_.device);
  }

  std::function<absl::StatusOr<CopyRates>()> CopyRateProbe() const override {
    const int index = options_.device;
    return [index]() { return MeasurePinnedCopyRates(index); };
  }
  double autopolicy_time_tolerance() const override { return 0.01; }

 private:
  // Attention's keys and values through hostd's context segment, or (hostd then sends none) over a
  // communicator split per group from the job's.
  absl::StatusOr<std::unique_ptr<ContextGroup>> MakeContextGroup(const PipelineSettings& s, NcclCommunicator* comm) {
    if (!s.context_segment.empty()) {
      ASSIGN_OR_RETURN(auto g,
                       ShmContextGroup::Attach(s.context_segment, s.context_rank, &s.job_state->abort(), s.timeout));
      return std::unique_ptr<ContextGroup>(std::move(g));
    }
    if (comm == nullptr) {
      return absl::FailedPreconditionError(
          "runtime.context_parallel needs hostd's context segment (or, on CUDA workers, the job's NCCL "
          "communicator)");
    }
    ASSIGN_OR_RETURN(auto g, NcclContextGroup::Create(*comm, options_.device, s.context_group, s.context_rank,
                                                      s.timeout, &s.job_state->abort()));
    return std::unique_ptr<ContextGroup>(std::move(g));
  }

  CudaPipelineOptions options_;
  // Warm between jobs with the same membership (the job thread only; DropCommunicator after it).
  std::unique_ptr<NcclCommunicator> comm_;
};

}  // namespace

std::unique_ptr<PipelineFactory> MakeCudaPipelineFactory(CudaPipelineOptions options) {
  return std::make_unique<CudaPipelineFactory>(options);
}

}  // namespace slidedp
