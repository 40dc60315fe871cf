// The host state's digest of a job over nodes (state_digest.h): the same for any thread count, and
// different after any one master, moment or int8 scale value changes.
#include "hostd/engine/state_digest.h"

#include <unistd.h>

#include <memory>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "shm/shm_segment.h"

namespace slidedp::hostd {
namespace {

std::unique_ptr<shm::JobState> MakeState(const ModelLayout& layout, MomentForm moments, int n) {
  shm::JobStateOptions o;
  o.format.moments = moments;
  auto s = shm::JobState::Create(absl::StrCat("dg", getpid()), absl::StrCat("digest", n), layout, o);
  EXPECT_TRUE(s.ok()) << s.status();
  if (!s.ok()) return nullptr;
  for (int u = 0; u < layout.num_units(); ++u) {
    float* m = (*s)->master(u);
    for (int64_t i = 0; i < (*s)->unit_numel(u); ++i) m[i] = 0.001f * static_cast<float>(i % 977) - 0.3f;
  }
  return std::move(*s);
}

TEST(StateDigest, SameForAnyThreadCountAndChangesWithAnyValue) {
  const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset("tiny"));
  int n = 0;
  for (MomentForm form : {MomentForm::kF32, MomentForm::kInt8}) {
    std::unique_ptr<shm::JobState> s = MakeState(layout, form, n++);
    ASSERT_NE(s, nullptr);
    const uint64_t one = StateDigest(layout, *s, 1);
    EXPECT_EQ(StateDigest(layout, *s, 3), one);
    EXPECT_EQ(StateDigest(layout, *s, 64), one);
    const int last = layout.num_units() - 1;
    s->master(last)[7] += 1e-6f;
    const uint64_t master_changed = StateDigest(layout, *s, 2);
    EXPECT_NE(master_changed, one);
    static_cast<unsigned char*>(s->moments(0).v)[3] ^= 1;
    EXPECT_NE(StateDigest(layout, *s, 2), master_changed);
    if (form == MomentForm::kInt8) {
      const uint64_t before = StateDigest(layout, *s, 2);
      s->moments(1).m_scale[0] += 1.0f;
      EXPECT_NE(StateDigest(layout, *s, 2), before);
    }
    EXPECT_TRUE(s->Unlink().ok());
  }
}

}  // namespace
}  // namespace slidedp::hostd
