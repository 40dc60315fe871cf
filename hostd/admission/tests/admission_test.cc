// Admission control: the memory plan's numbers, and refusals against injected host memory.
#include "hostd/admission/admission.h"

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <utility>

#include "absl/strings/str_format.h"
#include "common/jobspec/job_spec.h"
#include "common/policy/layer_pieces.h"
#include "common/policy/layer_policy.h"
#include "gtest/gtest.h"
#include "shm/job_state.h"
#include "shm/tests/test_util.h"

namespace slidedp::hostd {
namespace {

constexpr uint64_t kGiB = 1ull << 30;

ModelLayout Layout(const char* preset) { return ModelLayout::Build(ModelConfig::Preset(preset).value()); }

TEST(PlanJobMemory, FourteenBytesPerParamPlusRings) {
  const ModelLayout layout = Layout("qwen3-0.6b");
  const shm::GradRingConfig ring{8, 64ull << 20};
  const MemoryPlan plan = PlanJobMemory(layout, ring, 2, ClipMode::kNone);
  const uint64_t n = static_cast<uint64_t>(layout.total_numel);
  EXPECT_EQ(plan.param_numel, layout.total_numel);
  EXPECT_EQ(plan.master_bytes, 4 * n);
  EXPECT_EQ(plan.adam_bytes, 8 * n);
  EXPECT_EQ(plan.mirror_bytes, 2 * n);
  EXPECT_EQ(plan.job_segment_bytes, shm::JobState::SegmentBytes(layout));
  EXPECT_GE(plan.job_segment_bytes, 14 * n);
  EXPECT_LT(plan.job_segment_bytes, 14 * n + 4096ull * (4 * layout.num_units() + 2));
  EXPECT_EQ(plan.ring_bytes, 2 * shm::GradRing::SegmentBytes(ring));
  EXPECT_GE(plan.ring_bytes, 2 * 8 * (64ull << 20));
  EXPECT_EQ(plan.step_staging_bytes, 0u);
  EXPECT_EQ(plan.total_bytes, plan.job_segment_bytes + plan.ring_bytes);
  EXPECT_EQ(plan.shm_bytes, plan.total_bytes);

  const MemoryPlan clipped = PlanJobMemory(layout, ring, 2, ClipMode::kExactGlobalNorm);
  EXPECT_EQ(clipped.step_staging_bytes, 2 * n);
  EXPECT_EQ(clipped.total_bytes, plan.total_bytes + 2 * n);
  const MemoryPlan clipped32 = PlanJobMemory(layout, ring, 2, ClipMode::kExactGlobalNorm, Dtype::kF32);
  EXPECT_EQ(clipped32.step_staging_bytes, 4 * n);
  // The staging buffer is hostd's own memory, not a segment.
  EXPECT_EQ(clipped32.shm_bytes, plan.shm_bytes);
  EXPECT_EQ(clipped32.total_bytes, plan.total_bytes + 4 * n);
}

// runtime.offload_ratio: each worker keeps round(ratio x layers) layer inputs of its whole step
// (FP32, hidden x 4 B per token; BF16, 2 B, with runtime.checkpoint_dtype bf16) in host memory; the
// plan counts them outside /dev/shm.
TEST(PlanJobMemory, CountsTheWorkersOffloadedLayerInputs) {
  const ModelLayout layout = Layout("qwen3-8b");  // 36 layers, hidden 4096
  MemoryPlan plan = PlanJobMemory(layout, shm::GradRingConfig{4, 32ull << 20}, 2, ClipMode::kNone);
  const MemoryPlan before = plan;
  AddActivationOffload(layout, 0.0, 0, 4, false, 2, 65536, plan);
  EXPECT_EQ(plan.offload_bytes, 0u);
  EXPECT_EQ(plan.total_bytes, before.total_bytes);
  AddActivationOffload(layout, 0.5, 0, 4, false, 2, 65536, plan);  // 18 layers x 64K tokens x 16 KiB, x 2 workers
  EXPECT_EQ(layout.OffloadedLayers(0.5), 18);
  EXPECT_EQ(plan.offload_bytes, 2ull * 18 * 65536 * 4096 * 4);  // 36 GiB
  EXPECT_EQ(plan.total_bytes, before.total_bytes + plan.offload_bytes);
  EXPECT_EQ(plan.shm_bytes, before.shm_bytes);
  EXPECT_NE(plan.ToString().find("activation offload 36.00"), std::string::npos) << plan.ToString();
  EXPECT_EQ(layout.OffloadedLayers(1.0), 36);
  EXPECT_EQ(layout.OffloadedLayers(2.0), 36);  // clamped
  EXPECT_EQ(layout.OffloadedLayers(0.01), 0);
  // Selective layers offload their attention output and log-sum-exp as well: 32 heads x 128 + 32
  // more elements a token, FP32 on CPU workers.
  MemoryPlan selective = before;
  AddActivationOffload(layout, 0.5, kPieceAttention, 4, false, 2, 65536, selective);
  EXPECT_EQ(selective.offload_bytes, 2ull * 18 * 65536 * (4096 + 4096 + 32) * 4);
  // CUDA workers keep the output in BF16 and the log-sum-exp in FP32 (CudaBackend's layout).
  MemoryPlan selective_cuda = before;
  AddActivationOffload(layout, 0.5, kPieceAttention, 4, true, 2, 65536, selective_cuda);
  EXPECT_EQ(selective_cuda.offload_bytes, 2ull * 18 * 65536 * (4096 * 4 + 4096 * 2 + 32 * 4));
  // runtime.checkpoint_dtype bf16: the inputs take 2 B an element, the kept pieces as before.
  MemoryPlan bf16 = before;
  AddActivationOffload(layout, 0.5, 0, 2, false, 2, 65536, bf16);
  EXPECT_EQ(bf16.offload_bytes, 2ull * 18 * 65536 * 4096 * 2);  // 18 GiB: half the FP32 inputs'
  EXPECT_EQ(bf16.total_bytes, before.total_bytes + bf16.offload_bytes);
  MemoryPlan bf16_selective = before;
  AddActivationOffload(layout, 0.5, kPieceAttention, 2, false, 2, 65536, bf16_selective);
  EXPECT_EQ(bf16_selective.offload_bytes, 2ull * 18 * 65536 * (4096 * 2 + (4096 + 32) * 4));
  // A per-layer layout's sum, as job_plan.cc adds it: shares of inputs and kept pieces.
  MemoryPlan shares = before;
  OffloadedPerToken per_token;
  per_token.input_elements = 1.5 * 4096;
  per_token.kept_bytes = 0.5 * (4096 + 32) * 4;
  per_token.input_element_bytes = 2;
  AddOffloadedCheckpoints(per_token, 2, 65536, shares);
  EXPECT_EQ(shares.offload_bytes, 2ull * 65536 * (3 * 4096 + 2 * (4096 + 32)));
}

// What a kept piece takes a token: the CPU backend's FP32 elements, the CUDA backend's layout
// (dense models; a CUDA MoE block keeps its own set, so MoE models are counted as on the CPU).
TEST(PlanJobMemory, KeptBytesFollowTheWorkersBackend) {
  const ModelConfig dense = Layout("qwen3-8b").config;
  const ModelShape shape = ModelShape::Of(dense);
  for (uint32_t pieces : {0u, uint32_t{kPieceAttention}, uint32_t{kPieceQkv | kPieceGateUp}, kAllPieces}) {
    EXPECT_EQ(KeptBytesPerToken(dense, pieces, false), 4 * KeptElementsPerToken(shape, pieces)) << pieces;
    EXPECT_EQ(KeptBytesPerToken(dense, pieces, true), CudaKeptBytesPerToken(shape, pieces)) << pieces;
    EXPECT_LE(KeptBytesPerToken(dense, pieces, true), KeptBytesPerToken(dense, pieces, false)) << pieces;
  }
  EXPECT_EQ(KeptBytesPerToken(dense, kPieceAttention, true), 4096 * 2 + 32 * 4);
  absl::StatusOr<ModelConfig> moe = ModelConfig::Preset("qwen3-30b-a3b");
  ASSERT_TRUE(moe.ok()) << moe.status();
  EXPECT_EQ(KeptBytesPerToken(*moe, kPieceGateUp, true), 4 * KeptElementsPerToken(ModelShape::Of(*moe), kPieceGateUp));
}

// qwen3_5's layers keep nothing on either backend (every policy recomputes them from the layer
// input): a kept piece takes nothing, and an offloaded checkpoint is the layer input alone, whatever
// the policy says it keeps.
TEST(PlanJobMemory, Qwen3_5OffloadsTheLayerInputsAlone) {
  for (const char* preset : {"qwen3.5-4b", "qwen3.5-35b-a3b", "tiny-qwen3.5"}) {
    const ModelLayout layout = Layout(preset);
    for (uint32_t pieces : {0u, uint32_t{kPieceAttention}, uint32_t{kPieceQkv | kPieceGateUp}, kAllPieces}) {
      for (bool cuda : {false, true}) EXPECT_EQ(KeptBytesPerToken(layout.config, pieces, cuda), 0) << preset << pieces;
    }
    const MemoryPlan before = PlanJobMemory(layout, shm::GradRingConfig{4, 32ull << 20}, 2, ClipMode::kNone);
    const uint64_t offloaded = layout.OffloadedLayers(0.5);
    const uint64_t inputs = 2ull * offloaded * 65536 * layout.config.hidden_size * 4;  // 2 workers, FP32
    for (bool cuda : {false, true}) {
      MemoryPlan keep_all = before;
      AddActivationOffload(layout, 0.5, kAllPieces, 4, cuda, 2, 65536, keep_all);
      EXPECT_EQ(keep_all.offload_bytes, inputs) << preset;
      EXPECT_EQ(keep_all.total_bytes, before.total_bytes + inputs) << preset;
    }
  }
  EXPECT_EQ(Layout("qwen3.5-4b").OffloadedLayers(0.5), 16);
}

TEST(PlanJobMemory, Qwen3_8BIsAboutFourteenBytesPerParam) {
  const ModelLayout layout = Layout("qwen3-8b");
  const MemoryPlan plan = PlanJobMemory(layout, shm::GradRingConfig{8, 64ull << 20}, 1, ClipMode::kNone);
  const double gib_per_bparam =
      static_cast<double>(plan.job_segment_bytes) / kGiB / (static_cast<double>(layout.param_count()) / 1e9);
  EXPECT_NEAR(gib_per_bparam, 13.04, 0.05);
}

// Issue 4's host-memory target (<= 13.1 GiB per billion parameters) with the job spec's default
// rings, without host gradient staging (device staging or no clipping): 4B on 1 worker, 8B on 2.
TEST(PlanJobMemory, DefaultRingsKeepHostMemoryWithinTheTarget) {
  const JobSpec spec;
  for (const auto& [preset, workers] :
       {std::pair<const char*, int>{"qwen3-4b", 1}, {"qwen3-8b", 2}, {"qwen3-14b", 2}}) {
    const ModelLayout layout = Layout(preset);
    const shm::GradRingConfig ring = RingConfigFor(layout, spec.runtime.ring_slots, spec.runtime.chunk_bytes);
    const MemoryPlan plan = PlanJobMemory(layout, ring, workers, ClipMode::kNone, Dtype::kF32);
    const double gib_per_bparam =
        static_cast<double>(plan.total_bytes) / kGiB / (static_cast<double>(layout.param_count()) / 1e9);
    std::printf("%s, %d worker(s): %s = %.4f GiB per billion params\n", preset, workers, plan.ToString().c_str(),
                gib_per_bparam);
    EXPECT_LE(gib_per_bparam, 13.1) << preset;
  }
}

TEST(CheckAdmission, RefusesWithTheNumbersAndTheLimit) {
  const MemoryPlan plan = PlanJobMemory(Layout("qwen3-8b"), shm::GradRingConfig{8, 64ull << 20}, 1, ClipMode::kNone);
  ASSERT_GT(plan.total_bytes, 100 * kGiB);

  HostMemoryInfo big{512 * kGiB, 400 * kGiB, 256 * kGiB, 250 * kGiB};
  EXPECT_TRUE(CheckAdmission(plan, big).ok());

  HostMemoryInfo small_ram{125 * kGiB, 100 * kGiB, 256 * kGiB, 250 * kGiB};
  absl::Status s = CheckAdmission(plan, small_ram);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("host memory"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("99.00 GiB is available"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find(absl::StrFormat("%.2f GiB", plan.total_bytes / double(kGiB))), absl::string_view::npos)
      << s;

  HostMemoryInfo small_shm{512 * kGiB, 400 * kGiB, 64 * kGiB, 63 * kGiB};
  s = CheckAdmission(plan, small_shm);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_NE(s.message().find("/dev/shm has 63.00 GiB free"), absl::string_view::npos) << s;

  // Exactly at the limit (after the reserve) fits; one byte more does not.
  AdmissionPolicy no_reserve{0};
  HostMemoryInfo exact{plan.total_bytes, plan.total_bytes, plan.shm_bytes, plan.shm_bytes};
  EXPECT_TRUE(CheckAdmission(plan, exact, no_reserve).ok());
  exact.mem_available_bytes -= 1;
  EXPECT_FALSE(CheckAdmission(plan, exact, no_reserve).ok());
}

// A small job's refusal shows its numbers in a unit that shows them (not "needs 0.00 GiB ... has
// 0.00 GiB free").
TEST(Admission, SmallNumbersAreShownInTheirUnit) {
  const MemoryPlan plan = PlanJobMemory(Layout("tiny"), shm::GradRingConfig{2, 1ull << 20}, 1, ClipMode::kNone);
  ASSERT_LT(plan.shm_bytes, kGiB / 64);
  HostMemoryInfo tiny_shm{512 * kGiB, 400 * kGiB, 8ull << 20, 512 << 10};
  const absl::Status s = CheckAdmission(plan, tiny_shm);
  ASSERT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
  EXPECT_EQ(s.message().find("0.00 GiB"), absl::string_view::npos) << s;
  EXPECT_NE(s.message().find("/dev/shm has 512.0 KiB free of 8.0 MiB"), absl::string_view::npos) << s;
}

TEST(ReadHostMemoryInfo, ParsesMeminfo) {
  const std::string path = absl::StrCat(::testing::TempDir(), "/meminfo.", ::getpid());
  {
    std::ofstream out(path);
    out << "MemTotal:       131072000 kB\nMemFree:         1000 kB\n"
           "MemAvailable:   65536000 kB\nShmem:  12 kB\n";
  }
  auto info = ReadHostMemoryInfo(path, "/dev/shm");
  ASSERT_TRUE(info.ok()) << info.status();
  EXPECT_EQ(info->mem_total_bytes, 131072000ull * 1024);
  EXPECT_EQ(info->mem_available_bytes, 65536000ull * 1024);
  EXPECT_GT(info->shm_total_bytes, 0u);
  EXPECT_LE(info->shm_free_bytes, info->shm_total_bytes);
  {
    std::ofstream out(path);
    out << "MemTotal: 1 kB\n";
  }
  EXPECT_EQ(ReadHostMemoryInfo(path).status().code(), absl::StatusCode::kDataLoss);
  std::remove(path.c_str());
  EXPECT_EQ(ReadHostMemoryInfo("/nonexistent/meminfo").status().code(), absl::StatusCode::kNotFound);

  auto real = ReadHostMemoryInfo();
  ASSERT_TRUE(real.ok()) << real.status();
  EXPECT_GT(real->mem_available_bytes, 0u);
  EXPECT_LE(real->mem_available_bytes, real->mem_total_bytes);
}

}  // namespace
}  // namespace slidedp::hostd
