// hostd's metric families, refreshed at each scrape from HostCore's public snapshots (ListJobs,
// GetNode): nothing in the job path has to push metrics, and a scrape never blocks a step for
// longer than copying the job table under HostCore's mutex.
//
// Exported (prefix slidedp_):
//   jobs{state}                  gauge   jobs in each state (all states, 0 included)
//   steps_total                  counter optimizer steps completed by all jobs of this hostd
//   workers{state}               gauge   attached workers by state (idle, assigned, running)
//   draining                     gauge   1 while hostd drains (health NOT_SERVING)
//   host_state_bytes             gauge   host state of active jobs (shm + staging)
//   host_memory_available_bytes, shm_free_bytes  gauge  from /proc/meminfo and statvfs(/dev/shm)
//   job_step, job_total_steps, job_loss, job_learning_rate, job_grad_norm,
//   job_tokens_per_second, job_model_tflops, job_step_seconds, job_eta_seconds,
//   job_gpu_peak_bytes, job_host_state_bytes, job_workers            gauges {job}
// Per-job series exist only for active (not final) jobs, so their cardinality stays bounded on a
// long-lived host; finished jobs remain visible in jobs{state} and steps_total.
#pragma once

#include "absl/status/status.h"
#include "hostd/core/host_core.h"
#include "hostd/metrics/metrics.h"

namespace slidedp::metrics {

// Declares the families on `registry` and adds a collector reading `core` (which must outlive
// the registry's scrapes).
absl::Status RegisterHostMetrics(MetricsRegistry* registry, const hostd::HostCore* core);

}  // namespace slidedp::metrics
