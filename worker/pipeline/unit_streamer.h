// UnitStreamer: how a unit's BF16 parameters reach the compute device and how gradients leave
// it. The version gate is checked here: Acquire(unit, t) returns only once step t-1's update of
// the unit is published (version >= t).
//
// HostMirrorStreamer (CPU backend): the device IS host memory, so parameters are read in place
// from the shared-memory mirror and gradients are copied with memcpy. The CUDA streamer
// (worker/pipeline/cuda_streamer.*) copies through a bounded window of GPU slots instead.
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "common/numeric/bf16.h"
#include "hostd/state/job_state.h"

namespace slidedp {

class UnitStreamer {
 public:
  virtual ~UnitStreamer() = default;
  // Device pointer to the unit's BF16 parameters, valid until Release(unit). Waits for the gate.
  virtual absl::StatusOr<const bf16_t*> Acquire(int unit, uint32_t min_version) = 0;
  virtual void Release(int unit) = 0;
  // Hint: start bringing `unit` in (after its gate opens) while other work runs.
  virtual void Prefetch(int unit, uint32_t min_version) {}
  // Copies device gradient memory into host memory (a ring slot). Synchronous.
  virtual absl::Status CopyToHost(void* host_dst, const void* device_src, int64_t bytes) = 0;
  // Seconds spent blocked on version gates, and copying in each direction, since construction.
  virtual double gate_wait_s() const = 0;
  virtual double h2d_s() const = 0;
  virtual double d2h_s() const = 0;
};

class HostMirrorStreamer : public UnitStreamer {
 public:
  HostMirrorStreamer(state::JobState* state, absl::Duration gate_timeout)
      : state_(state), gate_timeout_(gate_timeout) {}
  absl::StatusOr<const bf16_t*> Acquire(int unit, uint32_t min_version) override;
  void Release(int unit) override {}
  absl::Status CopyToHost(void* host_dst, const void* device_src, int64_t bytes) override;
  double gate_wait_s() const override { return gate_wait_s_; }
  double h2d_s() const override { return 0; }
  double d2h_s() const override { return d2h_s_; }

 private:
  state::JobState* state_;
  absl::Duration gate_timeout_;
  double gate_wait_s_ = 0;
  double d2h_s_ = 0;
};

}  // namespace slidedp
