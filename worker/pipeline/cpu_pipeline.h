// The CPU reference backend's PipelineFactory (job_pipeline.h): the host mirror streamer, the
// host gradient path (reduce-scatter through hostd's ShmCollective on the gpu route), host
// activation stores, and context groups over hostd's context segment. Its "device" is the host.
#pragma once

#include <cstdint>
#include <memory>

#include "worker/pipeline/job_pipeline.h"

namespace slidedp {

struct CpuPipelineOptions {
  // The backend's "device" capacity (SLIDEDP_CPU_DEVICE_MEMORY_BYTES); 0: the host's memory, and
  // allocations are not bounded.
  int64_t device_memory_bytes = 0;
  // A build with CUDA: the error of a context-parallel job without hostd's context segment also
  // names the CUDA workers' way (the job's NCCL communicator).
  bool mention_nccl_context_groups = false;
};

std::unique_ptr<PipelineFactory> MakeCpuPipelineFactory(CpuPipelineOptions options);

}  // namespace slidedp
