#include "worker/pipeline/job_pipeline.h"

namespace slidedp {

PipelineCounters JobPipeline::counters() const {
  PipelineCounters c;
  c.gate_wait_s = streamer->gate_wait_s();
  c.d2h_s = grads->d2h_s();
  c.h2d_s = streamer->h2d_s();
  c.cast_s = streamer->cast_s();
  c.ring_wait_s = grads->ring_wait_s();
  return c;
}

namespace {

class MissingCudaPipelineFactory final : public PipelineFactory {
 public:
  DeviceDescription Describe() const override { return DeviceDescription(); }
  absl::StatusOr<std::unique_ptr<ComputeBackend>> MakeBackend(const ModelConfig&) override { return Missing(); }
  std::shared_ptr<HostRegistry> NewHostRegistry() override { return nullptr; }
  void UseDevice() override {}
  absl::Status JoinCommunicator(const PipelineSettings&) override {
    return absl::UnimplementedError("NCCL needs the CUDA build");
  }
  void DropCommunicator() override {}
  absl::StatusOr<std::unique_ptr<NodeLink>> JoinNodes(const NodeLinkSettings&) override { return Missing(); }
  absl::StatusOr<JobPipeline> Build(const PipelineSettings&) override { return Missing(); }
  absl::StatusOr<std::unique_ptr<ActivationStore>> MakeActivationStore(ComputeBackend*, std::vector<double>) override {
    return Missing();
  }
  std::function<absl::StatusOr<CopyRates>()> CopyRateProbe() const override { return nullptr; }
  double autopolicy_time_tolerance() const override { return 0.01; }

 private:
  static absl::Status Missing() { return absl::UnimplementedError("this slidedp-worker was built without CUDA"); }
};

}  // namespace

std::unique_ptr<PipelineFactory> MakeMissingCudaPipelineFactory() {
  return std::make_unique<MissingCudaPipelineFactory>();
}

}  // namespace slidedp
