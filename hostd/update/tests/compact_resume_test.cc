// A job of compact Adam moments (optimizer.state_dtype bf16 | int8) resumed from its own
// checkpoint continues bitwise: LayerAdam's compact-moment kernels stepping a state that
// checkpoint/ saved and loaded (the format's own tests, which need no kernels, are
// checkpoint/tests/ckpt_moments_test.cc).
#include <filesystem>
#include <random>

#include "checkpoint/checkpoint.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "gtest/gtest.h"
#include "hostd/update/adamw_kernels.h"
#include "hostd/update/adamw_state.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using namespace slidedp::checkpoint::testing;

const update::AdamStateKernelTable& Kernels() { return update::ActiveAdamStateKernels(); }

class CompactResumeTest : public CheckpointRootTest {};

// A job resumed from its own compact checkpoint continues bitwise: the loaded state is the saved
// bytes, and the next kernel step from it equals the step the uninterrupted job takes.
TEST_F(CompactResumeTest, ResumedCompactJobContinuesBitwise) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  for (MomentForm dtype : {MomentForm::kInt8, MomentForm::kBF16}) {
    SCOPED_TRACE(ToString(dtype));
    HostState run(layout, dtype);  // from zero moments, three steps on random gradients
    std::mt19937_64 rng(11);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    for (auto& unit : run.master)
      for (float& w : unit) w = normal(rng) * 0.05f;
    std::vector<std::vector<std::vector<float>>> grads(4);
    for (auto& step : grads) {
      for (const UnitLayout& u : layout.units) {
        step.emplace_back(u.numel);
        for (float& g : step.back()) g = normal(rng) * 1e-2f;
      }
    }
    auto step = [&](HostState& s, int t) {
      update::AdamWStepParams p;
      p.step = t + 1;
      const update::AdamWConstants c = update::MakeAdamWConstants(p);
      int64_t first_index = 0;
      for (const UnitLayout& u : layout.units) {
        const UnitMoments mo = s.moments(u.index);
        if (dtype == MomentForm::kInt8) {
          Kernels().int8_step_f32(c, s.master[u.index].data(),
                                  {static_cast<int8_t*>(mo.m), static_cast<uint8_t*>(mo.v), mo.m_scale, mo.v_scale},
                                  nullptr, grads[t][u.index].data(), u.numel);
        } else {
          Kernels().bf16_step_f32(c, {.seed = 99, .step = p.step, .first_index = first_index}, s.master[u.index].data(),
                                  {s.m16[u.index].data(), s.v16[u.index].data()}, nullptr, grads[t][u.index].data(),
                                  u.numel);
        }
        first_index += u.numel;
      }
    };
    for (int t = 0; t < 3; ++t) step(run, t);
    const std::string dir = Save(layout, run, 3);
    HostState resumed(layout, dtype);
    auto lc = LoadCheckpoint(dir, layout, resumed.arrays());
    ASSERT_TRUE(lc.ok()) << lc.status();
    ASSERT_TRUE(SameBytes(StateBytes(resumed), StateBytes(run)));
    step(run, 3);
    step(resumed, 3);
    EXPECT_TRUE(SameBytes(StateBytes(resumed), StateBytes(run)));
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace slidedp::checkpoint
