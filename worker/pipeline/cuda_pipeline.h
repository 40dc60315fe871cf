// The CUDA backend's PipelineFactory (job_pipeline.h): the window streamer, the CUDA gradient path
// (NCCL reduce-scatter on the gpu route), pinned activation stores, context groups over hostd's
// segment or split from the job's NCCL communicator, which the factory keeps warm between jobs.
// Built only with CUDA; this header needs no CUDA headers, so the worker names it in every build.
#pragma once

#include <memory>

#include "worker/pipeline/job_pipeline.h"

namespace slidedp {

struct CudaPipelineOptions {
  int device = 0;               // the GPU ordinal
  bool log_unit_norms = false;  // SLIDEDP_LOG_UNIT_NORMS (CudaGradientPathOptions::log_unit_norms)
};

std::unique_ptr<PipelineFactory> MakeCudaPipelineFactory(CudaPipelineOptions options);

}  // namespace slidedp
