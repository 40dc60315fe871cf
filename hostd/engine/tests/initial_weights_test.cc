// WriteInitialState on real job segments of every moment layout: a pooled segment's stale moments
// and scales are zeroed (and zero bytes are zero moments for every decoder), StateArraysOf gives
// the checkpoint code the segment's layout, and a resume into another state dtype converts with
// the note in the job log.
#include "hostd/engine/initial_weights.h"

#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hostd/update/adamw_state.h"
#include "shm/tests/test_util.h"

namespace slidedp::hostd {
namespace {

namespace fs = std::filesystem;

constexpr MomentForm kLayouts[] = {MomentForm::kF32, MomentForm::kBF16, MomentForm::kInt8};

class FakeContext : public JobContext {
 public:
  explicit FakeContext(std::string resume) : resume_(std::move(resume)) {}
  const std::string& job_id() const override { return job_id_; }
  const JobSpec& spec() const override { return spec_; }
  const std::string& resume_from() const override { return resume_; }
  int attempt() const override { return 0; }
  const std::vector<std::shared_ptr<WorkerSession>>& workers() const override { return workers_; }
  bool cancel_requested() const override { return false; }
  bool checkpoint_on_cancel() const override { return false; }
  void SetState(v1::JobState) override {}
  void SetTotalSteps(int64_t) override {}
  void SetHostStateBytes(int64_t) override {}
  void ReportStep(const v1::StepMetrics&) override {}
  void Log(const std::string& line) override { logs.push_back(line); }
  void SetLastCheckpoint(const std::string&) override {}
  bool Logged(const std::string& text) const {
    for (const std::string& l : logs)
      if (absl::StrContains(l, text)) return true;
    return false;
  }
  std::vector<std::string> logs;

 private:
  std::string job_id_ = "j", resume_;
  JobSpec spec_;
  std::vector<std::shared_ptr<WorkerSession>> workers_;
};

ModelLayout TinyLayout() { return ModelLayout::Build(*ModelConfig::Preset("tiny")); }

// Bytes of unit u's moments in the segment (m, v, scales), as the checkpoint code sees them.
std::string MomentBytes(shm::JobState& js, int u) {
  const shm::JobState::Moments mo = js.moments(u);
  const int64_t n = js.unit_numel(u);
  const size_t eb = mo.dtype == MomentForm::kF32 ? 4 : mo.dtype == MomentForm::kBF16 ? 2 : 1;
  std::string out(static_cast<const char*>(mo.m), n * eb);
  out.append(static_cast<const char*>(mo.v), n * eb);
  if (mo.m_scale != nullptr) {
    out.append(reinterpret_cast<const char*>(mo.m_scale), Int8MomentBlocks(n) * 4);
    out.append(reinterpret_cast<const char*>(mo.v_scale), Int8MomentBlocks(n) * 4);
  }
  return out;
}

// Stale bytes everywhere a pooled segment's previous job left them.
void Scribble(shm::JobState& js) {
  for (int u = 0; u < js.num_units(); ++u) {
    const shm::JobState::Moments mo = js.moments(u);
    const int64_t n = js.unit_numel(u);
    const size_t eb = mo.dtype == MomentForm::kF32 ? 4 : mo.dtype == MomentForm::kBF16 ? 2 : 1;
    std::memset(mo.m, 0x5a, n * eb);
    std::memset(mo.v, 0x5a, n * eb);
    if (mo.m_scale != nullptr) {
      std::memset(mo.m_scale, 0x5a, Int8MomentBlocks(n) * 4);
      std::memset(mo.v_scale, 0x5a, Int8MomentBlocks(n) * 4);
    }
  }
}

struct Segment {
  explicit Segment(const ModelLayout& layout, MomentForm dtype) {
    shm::JobStateOptions opts;
    opts.format.moments = dtype;
    auto s = shm::JobState::Create(shm::testing::TestNode(), shm::testing::UniqueJob(), layout, opts);
    EXPECT_TRUE(s.ok()) << s.status();
    js = std::move(*s);
    cleanup = std::make_unique<shm::testing::ScopedUnlink>(js->segment_name());
  }
  std::unique_ptr<shm::JobState> js;
  std::unique_ptr<shm::testing::ScopedUnlink> cleanup;
};

// What ZeroMoments writes is zero moments: every ISA's decoders turn zero codes and zero scales
// (int8) and zero BF16 into +0.0 exactly, a partial block included.
TEST(InitialWeightsTest, ZeroBytesDecodeAsZeroMoments) {
  constexpr int64_t kN = 3 * 256 + 37;
  const std::vector<int8_t> m8(kN, 0);
  const std::vector<uint8_t> v8(kN, 0);
  const std::vector<float> scales(Int8MomentBlocks(kN), 0.0f);
  const std::vector<bf16_t> b16(kN, 0);
  for (update::AdamIsa isa : {update::AdamIsa::kScalar, update::AdamIsa::kAvx2, update::AdamIsa::kAvx512}) {
    const update::AdamStateKernelTable* k = update::AdamStateKernelsFor(isa);
    if (k == nullptr) continue;
    std::vector<float> m(kN, 1.0f), v(kN, 1.0f);
    k->int8_to_f32({m8.data(), v8.data(), scales.data(), scales.data()}, m.data(), v.data(), kN);
    for (int64_t i = 0; i < kN; ++i) {
      uint32_t mb, vb;
      std::memcpy(&mb, &m[i], 4);
      std::memcpy(&vb, &v[i], 4);
      ASSERT_EQ(mb, 0u) << "int8 m " << i;
      ASSERT_EQ(vb, 0u) << "int8 v " << i;
    }
    m.assign(kN, 1.0f), v.assign(kN, 1.0f);
    k->bf16_to_f32({b16.data(), b16.data()}, m.data(), v.data(), kN);
    for (int64_t i = 0; i < kN; ++i) {
      uint32_t mb, vb;
      std::memcpy(&mb, &m[i], 4);
      std::memcpy(&vb, &v[i], 4);
      ASSERT_EQ(mb, 0u) << "bf16 m " << i;
      ASSERT_EQ(vb, 0u) << "bf16 v " << i;
    }
  }
}

// A pooled segment's moments (and int8 scales) are all zero bytes after WriteInitialState, for
// every layout; master and mirror come from the random init.
TEST(InitialWeightsTest, ReusedSegmentMomentsAreZeroedInEveryLayout) {
  const ModelLayout layout = TinyLayout();
  for (MomentForm dtype : kLayouts) {
    SCOPED_TRACE(ToString(dtype));
    Segment seg(layout, dtype);
    Scribble(*seg.js);
    FakeContext ctx("");
    JobSpec spec;
    spec.model.init_seed = 3;
    auto state = WriteInitialState(ctx, spec, layout, *seg.js, /*reused_segment=*/true, /*threads=*/2, layout, {});
    ASSERT_TRUE(state.ok()) << state.status();
    EXPECT_EQ(state->first_step, 0);
    EXPECT_TRUE(ctx.Logged("random init (seed 3)"));
    for (int u = 0; u < seg.js->num_units(); ++u) {
      const std::string bytes = MomentBytes(*seg.js, u);
      ASSERT_EQ(bytes.find_first_not_of('\0'), std::string::npos) << "unit " << u;
      for (int64_t i = 0; i < seg.js->unit_numel(u); i += 97) {
        ASSERT_EQ(seg.js->mirror(u)[i], FloatToBf16(seg.js->master(u)[i]));
      }
    }
  }
}

// A checkpoint of one layout resumes into a segment of each: bitwise for the same layout (no
// note), otherwise converted as the checkpoint code does and the note logged.
TEST(InitialWeightsTest, ResumeIntoEveryLayoutLogsTheConversion) {
  const ModelLayout layout = TinyLayout();
  const std::string root = (fs::temp_directory_path() / absl::StrCat("initial_weights_test.", ::getpid())).string();
  fs::remove_all(root);
  for (MomentForm saved : kLayouts) {
    // The saved job: random init, then moments the kernels encoded from known FP32 values.
    Segment job(layout, saved);
    FakeContext first("");
    JobSpec spec;
    spec.model.init_seed = 5;
    ASSERT_TRUE(WriteInitialState(first, spec, layout, *job.js, /*reused_segment=*/false, 2, layout, {}).ok());
    const checkpoint::StateArrays arrays = StateArraysOf(*job.js);
    EXPECT_EQ(arrays.moment_form, saved);
    for (int u = 0; u < job.js->num_units(); ++u) {
      const int64_t n = job.js->unit_numel(u);
      std::vector<float> m(n), v(n);
      for (int64_t i = 0; i < n; ++i) {
        m[i] = static_cast<float>((i * 37 + u) % 201 - 100) * 1e-5f;
        v[i] = static_cast<float>((i * 11 + u) % 301) * 1e-10f;
      }
      const checkpoint::UnitMoments mo = arrays.moments(u);
      const update::AdamStateKernelTable& k = update::ActiveAdamStateKernels();
      switch (arrays.moment_form) {
        case MomentForm::kF32:
          std::memcpy(mo.m, m.data(), n * 4);
          std::memcpy(mo.v, v.data(), n * 4);
          break;
        case MomentForm::kBF16:
          k.bf16_from_f32(m.data(), v.data(), {static_cast<bf16_t*>(mo.m), static_cast<bf16_t*>(mo.v)}, n);
          break;
        case MomentForm::kInt8:
          k.int8_from_f32(m.data(), v.data(),
                          {static_cast<int8_t*>(mo.m), static_cast<uint8_t*>(mo.v), mo.m_scale, mo.v_scale}, n);
          break;
      }
    }
    checkpoint::SaveRequest req;
    req.root_dir = root;
    req.step = 4;
    req.layout = &layout;
    req.arrays = arrays;
    req.trainer_state = {{"job_id", "j"}};
    auto saved_dir = checkpoint::SaveCheckpoint(req);
    ASSERT_TRUE(saved_dir.ok()) << saved_dir.status();

    for (MomentForm into : kLayouts) {
      SCOPED_TRACE(absl::StrCat(ToString(saved), " -> ", ToString(into)));
      Segment resumed(layout, into);
      Scribble(*resumed.js);
      FakeContext ctx(saved_dir->dir);
      auto state = WriteInitialState(ctx, spec, layout, *resumed.js, /*reused_segment=*/true, 2, layout, {});
      ASSERT_TRUE(state.ok()) << state.status();
      EXPECT_EQ(state->first_step, 4);
      EXPECT_EQ(resumed.js->step_counter().load(), 4u);
      EXPECT_TRUE(ctx.Logged("resumed from " + saved_dir->dir + " at step 4"));
      const std::string note = absl::StrCat("optimizer state converted from ", ToString(saved), " to ", ToString(into));
      EXPECT_EQ(ctx.Logged(note), saved != into) << note;
      // The same bytes a load into plain arrays of that layout gives (checked against the kernels
      // in ckpt_moments_test).
      Segment reference(layout, into);
      ASSERT_TRUE(checkpoint::LoadCheckpoint(saved_dir->dir, layout, StateArraysOf(*reference.js)).ok());
      for (int u = 0; u < layout.num_units(); ++u) {
        ASSERT_EQ(0, std::memcmp(resumed.js->master(u), job.js->master(u), layout.units[u].numel * 4));
        ASSERT_TRUE(MomentBytes(*resumed.js, u) == MomentBytes(*reference.js, u)) << "unit " << u;
        if (saved == into) {
          ASSERT_TRUE(MomentBytes(*resumed.js, u) == MomentBytes(*job.js, u)) << "unit " << u;
        }
      }
    }
    fs::remove_all(root);
  }
}

}  // namespace
}  // namespace slidedp::hostd
