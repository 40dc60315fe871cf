// CudaGradientPath: the CUDA side of GradientPath (worker/pipeline/gradient_path.h).
//
// Buffers: a small pool of FP32 gradient buffers in GPU memory, reused across units and steps;
// a buffer is handed out again only after its last copy finished (so the compute stream never
// waits for a copy, it just takes another buffer while the pool is below its cap).
// Finish(unit): an event on the compute stream; for the gpu route, the in-place reduce-scatter on
// the communicator's stream after it (a job over nodes: chained through the nodes there, ChainReduce);
// then the job goes to the poster thread, which for each
// chunk of this rank's part waits for a free ring slot, copies on the D2H stream into the
// (registered) slot, waits for the copy and posts the descriptor.
#pragma once

#include <cuda_runtime_api.h>

#include <memory>

#include "worker/comm/nccl_communicator.h"
#include "worker/comm/nccl_node_link.h"
#include "worker/pipeline/gradient_path.h"

namespace slidedp {

struct CudaGradientPathOptions {
  GradientPathOptions base;
  int device = 0;
  NcclCommunicator* comm = nullptr;       // required for the gpu route with world > 1
  // A job over several nodes: this rank's NCCL link to the other nodes (base.nodes is the same link).
  NcclNodeLink* nodes = nullptr;
  const shm::AbortWord* abort = nullptr;  // the job's abort word: waits give up when raised
  int max_buffers = 5;                    // pool cap (beyond it Begin waits for an idle buffer)
  // Device staging: log each unit's squared gradient norm per step with every digit (the worker's
  // SLIDEDP_LOG_UNIT_NORMS=1), to find where two runs part.
  bool log_unit_norms = false;
};

absl::StatusOr<std::unique_ptr<GradientPath>> MakeCudaGradientPath(const ModelLayout& layout, shm::GradRing* ring,
                                                                   cudaStream_t compute,
                                                                   const CudaGradientPathOptions& options);

}  // namespace slidedp
