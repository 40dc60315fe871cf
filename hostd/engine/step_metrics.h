// StepMetrics: one optimizer step's record, as WatchJob streams carry it (v1::StepMetrics) and as
// `<output>/metrics-<job>.jsonl` keeps it (one JSON line per step, docs/operations.md).
//
// Where the time went (busy_s): the workers' gate and ring waits, H2D and D2H (the slowest rank
// of each), hostd's aggregation, waiting and update tail, and host_update, the window from the
// step's first update submitted to its last one done (with clipping it opens once the norm is
// known, so the step's parameters over it are LayerAdam's rate in place).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/jobspec/job_spec.h"
#include "hostd/engine/job_plan.h"
#include "slidedp/v1/slidedp.pb.h"

namespace slidedp::hostd {

// Host-side figures of one step, measured by the executor and GradConsumer.
struct HostStepTimes {
  double wait_s = 0;
  double aggregate_s = 0;
  double update_tail_s = 0;  // after the last chunk, until every update was done
  double update_s = 0;       // the update window
  double adam_paused_s = 0;  // LayerAdam workers paused for urgent copies, summed (DMA before Adam)
};

struct StepRecord {
  v1::StepMetrics metrics;
  int64_t tokens = 0;  // tokens of the step over every rank
};

// The step's record from every rank's StepDone and hostd's own figures. `step_s`: wall time of
// the step; `world`: ranks; model TFLOP/s per rank.
StepRecord MakeStepRecord(int64_t step, const std::vector<v1::StepDone>& reports, const HostStepTimes& host,
                          double step_s, double lr, double grad_norm, int64_t total_numel, double flops_per_token,
                          int world, int64_t host_state_bytes);

// MoE models: the step's router figures from every rank's StepDone (router_aux_loss, expert_tokens)
// into `m`: the aux loss summed over ranks, the expert token counts summed over ranks and
// summarised over every (sparse layer, expert) pair, and the most imbalanced layer.
// `sparse_layers`: the model's sparse layers' HF indices in order. A report whose expert_tokens
// is not sparse_layers x num_experts non-negative counts is refused (INVALID_ARGUMENT naming the rank).
absl::Status AddRouterMetrics(const std::vector<v1::StepDone>& reports, const std::vector<int>& sparse_layers,
                              int64_t num_experts, v1::StepMetrics* m);

// The dense BF16 tensor-core peak of a GPU by its CUDA device name, from NVIDIA's datasheets
// (TFLOP/s, no sparsity): H100/H200 SXM 989.4, H100 NVL / H200 NVL 835, H100 PCIe 756, GH200 989.4,
// B200 2250, A100 312, L40S 362, L40 181, L4 121; 0 for another (or a CPU) device: no MFU.
double DenseBf16PeakTflops(const std::string& device_name);

// `<output>/metrics-<job>.jsonl`, appended to (a resumed job continues its file).
class MetricsFile {
 public:
  MetricsFile(const std::string& output_dir, const std::string& job_id);
  // One JSON line; `plan` and `spec` name the routes, `staging_bytes_held` what hostd holds.
  void Append(const StepRecord& r, absl::Time now, const RoutePlan& plan, const JobSpec& spec,
              int64_t staging_bytes_held);

 private:
  std::ofstream out_;
};

}  // namespace slidedp::hostd
