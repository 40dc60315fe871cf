// AutoPolicy's choice from measurements (ChooseLayout, no device): the layout fits the budget it
// was given and predicts its peak as the working set plus what the layers keep; checkpoints go to
// host memory only when the device needs the room and the host has it, and cost PCIe time when
// they do; the session measures on the second step of a long job and validates on the next, going
// back to recompute when the layout is slower than both the recompute step and its prediction.
#include "worker/pipeline/auto_policy.h"

#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "common/policy/layout_solver.h"
#include "worker/compute/cpu/cpu_backend.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

constexpr int64_t kGiB = 1ll << 30;

// Probes shaped like Qwen3-8B's at 64K tokens on an H200 (session 17's measurement).
AutoPolicyInputs EightB(const ModelLayout& layout) {
  AutoPolicyInputs in;
  in.layout = &layout;
  auto seg = [](uint32_t keep) { return LayerPolicy{LayerKind::kSegment, 0, keep}; };
  in.probes = {{LayerPolicy{LayerKind::kRecompute}, 0.1776, 0},
               {LayerPolicy{LayerKind::kSelective}, 0.1704, kGiB / 2},
               {seg(kPieceGateUp), 0.1579, 3 * kGiB},
               {seg(kPieceGateUp | kPieceQkv | kPieceAttention), 0.1495, 4258 * (kGiB / 1000)},
               {LayerPolicy{LayerKind::kKeepAll}, 0.1443, 8383 * (kGiB / 1000)}};
  for (LayerProbe& p : in.probes) p.forward_s = p.time_s / 3;
  in.checkpoint_bytes = kGiB;
  in.recompute_step = {7.37, 5.33, 2.0, 0.65, 0.8, 84 * kGiB};
  in.capacity_bytes = 140 * kGiB;
  in.rates = {52e9, 55e9};
  in.device_name = "NVIDIA H200";
  in.build = "test";
  in.tokens_per_step = 65536;
  return in;
}

ModelLayout Layout36() {
  ModelConfig c = *ModelConfig::Preset("tiny");
  c.num_hidden_layers = 36;
  return ModelLayout::Build(c);
}

TEST(AutoPolicy, LayersThatKeepNothingAreProbedAsRecomputeAlone) {
  // Qwen3.5's layers keep nothing under any policy: only recompute is timed.
  for (const char* preset : {"tiny-qwen3.5", "tiny-qwen3.5-moe"}) {
    const std::vector<LayerPolicy> probed = ProbedPolicies(*ModelConfig::Preset(preset));
    ASSERT_EQ(probed.size(), 1u) << preset;
    EXPECT_EQ(probed[0].kind, LayerKind::kRecompute) << preset;
  }
  const std::vector<LayerPolicy> dense = ProbedPolicies(*ModelConfig::Preset("tiny"));
  EXPECT_EQ(dense.size(), 7u);
  EXPECT_EQ(dense.front().kind, LayerKind::kRecompute);
  EXPECT_EQ(dense.back().kind, LayerKind::kKeepAll);
}

TEST(AutoPolicy, TheLayoutFitsAndPredictsItsPeak) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.host_budget_bytes = kGiB;  // no room to offload
  auto c = ChooseLayout(in);
  ASSERT_TRUE(c.ok()) << c.status();
  const AutoPolicyRecord& r = *c->layout.autopolicy;
  EXPECT_EQ(r.working_set_bytes, 84 * kGiB - 36 * kGiB);
  EXPECT_EQ(c->predicted_peak_bytes, r.working_set_bytes + r.predicted.device_bytes);
  EXPECT_LE(c->predicted_peak_bytes, static_cast<int64_t>(0.9 * 140 * kGiB));
  EXPECT_EQ(c->layout.layers.size(), 36u);
  EXPECT_EQ(c->policies.size(), 36u);
  int offloaded = 0;
  for (const LayerPolicy& l : c->layout.layers) offloaded += l.offload > 0;
  EXPECT_LE(offloaded, 1);
  // Faster than all recompute: 36 layers of 0.1776 s.
  EXPECT_LT(r.predicted.compute_s, r.problem.base.compute_s + 36 * 0.1776);
  // The base: the compute stream's time outside the layers (total less flush less the layers).
  const double flush = 7.37 - 5.33 - 2.0;
  EXPECT_NEAR(r.problem.base.exposed_s, flush, 1e-9);
  EXPECT_NEAR(r.problem.base.compute_s, 7.37 - flush - 36 * 0.1776, 1e-9);
  // Most-kept last.
  EXPECT_NE(c->layout.layers.back().kind, LayerKind::kRecompute);
}

// A small batch whose step the host's updates pace (Qwen3-4B at 16K on an H200, session 23, its
// third step: gate waits 1.17 of 2.00 s, 36 recompute layers 0.84 s of GPU work): the layers' gain
// comes off the whole step (measured: keep-all's steady step 1.797 s), so the base keeps the gated
// time outside the layers and no host floor; keep-all is predicted 1.884 s (-4.6%).
TEST(AutoPolicy, AHostPacedStepKeepsItsGainOffTheWholeStep) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.host_budget_bytes = 0;
  in.probes = {{LayerPolicy{LayerKind::kRecompute}, 0.0234, 0},
               {LayerPolicy{LayerKind::kSelective}, 0.0246, kGiB / 8},
               {LayerPolicy{LayerKind::kKeepAll}, 0.0202, 1674 * (kGiB / 1000)}};
  for (LayerProbe& p : in.probes) p.forward_s = p.time_s / 4;
  in.recompute_step = {1.999, 0.828, 1.171, 0.363, 0.379, 31 * kGiB};
  auto c = ChooseLayout(in);
  ASSERT_TRUE(c.ok()) << c.status();
  const AutoPolicyRecord& r = *c->layout.autopolicy;
  EXPECT_EQ(r.problem.base.host_s, 0.0);
  EXPECT_NEAR(r.problem.base.compute_s, 1.999 - 36 * 0.0234, 1e-9);
  EXPECT_EQ(MixName(r.problem.candidates, r.predicted.counts), "36 keep_all");
  EXPECT_NEAR(r.predicted.step_s, 1.999 - 36 * (0.0234 - 0.0202), 1e-9);
  EXPECT_NEAR((1.797 - r.predicted.step_s) / r.predicted.step_s, -0.046, 0.001);
}

// Rows hold their documents' tokens only: the layers' bytes are planned for a step of full rows,
// so a later, fuller step still fits.
TEST(AutoPolicy, MemoryIsPlannedForTheLargestStep) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.host_budget_bytes = 0;
  auto measured = ChooseLayout(in);
  in.largest_step_scale = 1.5;
  auto largest = ChooseLayout(in);
  ASSERT_TRUE(measured.ok() && largest.ok());
  const auto& a = measured->layout.autopolicy->problem.candidates;
  const auto& b = largest->layout.autopolicy->problem.candidates;
  ASSERT_EQ(a.size(), b.size());
  for (size_t j = 0; j < a.size(); ++j) EXPECT_NEAR(b[j].device_bytes, 1.5 * a[j].device_bytes, 2);
  // The working set is the step's own (not scaled), and the layout keeps less to fit.
  EXPECT_EQ(largest->layout.autopolicy->working_set_bytes, measured->layout.autopolicy->working_set_bytes);
  EXPECT_LE(largest->layout.autopolicy->predicted.device_bytes,
            largest->layout.autopolicy->problem.device_budget_bytes);
  EXPECT_GE(largest->layout.autopolicy->predicted.compute_s, measured->layout.autopolicy->predicted.compute_s);
}

TEST(AutoPolicy, CheckpointsGoToTheHostWhenItHasRoomAndTheDeviceNeedsIt) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.host_budget_bytes = 64 * kGiB;
  auto roomy = ChooseLayout(in);
  ASSERT_TRUE(roomy.ok()) << roomy.status();
  int offloaded = 0;
  for (const LayerPolicy& l : roomy->layout.layers) offloaded += l.offload > 0;
  EXPECT_GT(offloaded, 1);
  EXPECT_GT(roomy->layout.autopolicy->predicted.h2d_s, in.recompute_step.h2d_s);
  // Offloaded layers come first.
  EXPECT_GT(roomy->layout.layers.front().offload, 0);
  // A budget that every layer can keep all in: nothing crosses PCIe.
  in.capacity_bytes = 1000 * kGiB;
  auto big = ChooseLayout(in);
  ASSERT_TRUE(big.ok()) << big.status();
  for (const LayerPolicy& l : big->layout.layers) {
    EXPECT_EQ(l, (LayerPolicy{LayerKind::kKeepAll})) << LayerPolicyName(l);
  }
}

// Offload copies must keep pace with the passes: the forward sends out no more than the link
// carries in the forward's time.
TEST(AutoPolicy, OffloadKeepsPaceWithTheForward) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.micro_batches = 8;
  in.host_budget_bytes = 1000 * kGiB;
  auto c = ChooseLayout(in);
  ASSERT_TRUE(c.ok()) << c.status();
  const AutoPolicyRecord& r = *c->layout.autopolicy;
  EXPECT_TRUE(CopiesKeepPace(r.problem, r.predicted.counts));
  double sent = 0, forward = 0;
  for (size_t j = 0; j < r.problem.candidates.size(); ++j) {
    sent += static_cast<double>(r.predicted.counts[j] * r.problem.candidates[j].d2h_bytes);
    forward += static_cast<double>(r.predicted.counts[j]) * r.problem.candidates[j].forward_s;
  }
  EXPECT_GT(sent, 0);
  EXPECT_LE(sent / in.rates.d2h_bytes_per_s, forward + 1e-6);
}

TEST(AutoPolicy, NothingFitsIsResourceExhausted) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.host_budget_bytes = 0;
  in.capacity_bytes = 60 * kGiB;  // the working set alone is 48 GiB, 36 checkpoints 36 GiB
  EXPECT_EQ(ChooseLayout(in).status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(AutoPolicy, RunnableLayoutMarksOffloadedUnits) {
  LayerLayout l;
  l.layers = {{LayerKind::kRecompute, 1}, {LayerKind::kSegment, 0, kPieceGateUp}, {LayerKind::kKeepAll, 0.25}};
  std::vector<ActPolicy> policies;
  std::vector<double> offloaded;
  RunnableLayout(l, 5, &policies, &offloaded);
  ASSERT_EQ(policies.size(), 3u);
  EXPECT_EQ(policies[0], ActPolicy::kRecomputeLayer);
  EXPECT_EQ(policies[1], ActPolicy::Segment(kPieceGateUp));
  EXPECT_EQ(policies[2], ActPolicy::kKeepAll);
  EXPECT_EQ(offloaded, (std::vector<double>{0, 1, 0, 0.25, 0}));
  l.layers[0].offload = 0;
  l.layers[2].offload = 0;
  RunnableLayout(l, 5, &policies, &offloaded);
  EXPECT_TRUE(offloaded.empty());
}

TEST(AutoPolicy, OffloadSharesAreWholeMicroBatches) {
  EXPECT_EQ(OffloadShares(1), (std::vector<double>{0, 1}));
  EXPECT_EQ(OffloadShares(2), (std::vector<double>{0, 0.5, 1}));
  EXPECT_EQ(OffloadShares(3), (std::vector<double>{0, 1.0 / 3, 2.0 / 3, 1}));
  EXPECT_EQ(OffloadShares(8), (std::vector<double>{0, 0.25, 0.5, 0.75, 1}));
  EXPECT_EQ(OffloadShares(6), (std::vector<double>{0, 2.0 / 6, 3.0 / 6, 5.0 / 6, 1}));
}

// With copies nearly free and the host roomy, every layer keeps all and what the device cannot
// hold crosses PCIe: kept pieces included, in shares of the layers' checkpoints.
TEST(AutoPolicy, KeptPiecesOffloadInShares) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.micro_batches = 8;
  in.host_budget_bytes = 1000 * kGiB;
  in.rates = {1e13, 1e13};
  auto c = ChooseLayout(in);
  ASSERT_TRUE(c.ok()) << c.status();
  const AutoPolicyRecord& r = *c->layout.autopolicy;
  double moved = 0;
  for (const LayerPolicy& l : c->layout.layers) {
    EXPECT_EQ(l.kind, LayerKind::kKeepAll) << LayerPolicyName(l);
    moved += l.offload;
  }
  EXPECT_GT(moved, 1);
  EXPECT_NEAR(r.predicted.compute_s, r.problem.base.compute_s + 36 * 0.1443, 1e-9);
  // Its peak fits, in-flight room included.
  EXPECT_LE(c->predicted_peak_bytes, static_cast<int64_t>(0.9 * 140 * kGiB));
  int64_t in_flight = 0;
  for (size_t j = 0; j < r.problem.candidates.size(); ++j) {
    if (r.predicted.counts[j] > 0) in_flight = std::max(in_flight, r.problem.candidates[j].in_flight_bytes);
  }
  EXPECT_GT(in_flight, 4 * kGiB);
  // Offloaded layers first, the largest share first.
  for (size_t i = 1; i < c->layout.layers.size(); ++i) {
    EXPECT_GE(c->layout.layers[i - 1].offload, c->layout.layers[i].offload);
  }
}

// The sweep AutoPolicy is compared with: per kept kind and offload ratio, the most layers of that
// kind that fit the budget, last; the first half offloaded whole where asked.
TEST(AutoPolicy, SweepLayoutsKeepTheMostThatFits) {
  const ModelLayout layout = Layout36();
  AutoPolicyInputs in = EightB(layout);
  in.host_budget_bytes = 200 * kGiB;
  const std::vector<SweepLayout> sweep = SweepLayouts(in);
  ASSERT_EQ(sweep.size(), 8u);  // 4 kinds x 2 ratios
  const int64_t usable = static_cast<int64_t>(0.9 * 140 * kGiB);
  for (const SweepLayout& s : sweep) {
    EXPECT_LE(s.choice.predicted_peak_bytes, usable) << s.name;
    ASSERT_EQ(s.choice.layout.layers.size(), 36u);
    EXPECT_EQ(s.choice.layout.layers.front().offload > 0, s.name.find("offloaded") != std::string::npos) << s.name;
    EXPECT_NE(s.choice.layout.layers.back().kind, LayerKind::kRecompute) << s.name;
  }
  // Keep-all on the device: 8.38 + 1 GiB a layer kept, 1 GiB a layer recomputed, in the 78 GiB the
  // working set leaves: 5 layers; with the first half offloaded, more.
  EXPECT_EQ(sweep[6].name, "last 5 keep_all");
  EXPECT_EQ(sweep[7].name.rfind("last ", 0), 0u);
  EXPECT_NE(sweep[7].name, "last 5 keep_all, first 18 offloaded");
  // No host room: the offloading ones go.
  in.host_budget_bytes = 0;
  EXPECT_EQ(SweepLayouts(in).size(), 4u);
}

// A session on the CPU backend's real probes: 1 GiB of device, no host room to offload.
AutoPolicySession::Options SessionOptions(ComputeBackend* backend, const ModelLayout& layout) {
  AutoPolicySession::Options o;
  o.enabled = true;
  o.backend = backend;
  o.layout = &layout;
  o.capacity_bytes = 1ll << 30;
  o.host_budget_bytes = 0;
  o.device_name = "cpu";
  o.build = "test";
  return o;
}

// A model whose layers differ in attention span (Qwen2 with its upper layers sliding): one layer of
// each kind is timed on the CPU backend and the probes are their mean, one per policy, each as
// long as the two kinds' timed layers, its bytes the largest kind's.
TEST(AutoPolicy, ProfileLayerTimesEachAttentionSpan) {
  ModelConfig config = *ModelConfig::Preset("tiny-qwen2-window");
  ASSERT_GT(config.NumSlidingLayers(), 0);
  ASSERT_LT(config.NumSlidingLayers(), config.num_hidden_layers);
  const ModelLayout layout = ModelLayout::Build(config);
  auto backend = MakeCpuBackend(config);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const std::vector<MicroBatch> mbs = {testing::MakeBatch({100, 28}, config.vocab_size, 1)};
  const std::vector<LayerPolicy> policies = {LayerPolicy{LayerKind::kRecompute}, LayerPolicy{LayerKind::kKeepAll}};
  auto probes = ProfileLayer(backend->get(), layout, mbs, policies, 1);
  ASSERT_TRUE(probes.ok()) << probes.status();
  ASSERT_EQ(probes->size(), 2u);
  EXPECT_EQ((*probes)[0].policy.kind, LayerKind::kRecompute);
  EXPECT_EQ((*probes)[1].policy.kind, LayerKind::kKeepAll);
  for (const LayerProbe& p : *probes) {
    EXPECT_GT(p.time_s, 0);
    EXPECT_GT(p.forward_s, 0);
    EXPECT_LE(p.forward_s, p.time_s);
  }
  EXPECT_EQ((*probes)[0].saved_bytes, 0);
  EXPECT_GT((*probes)[1].saved_bytes, 0);
}

// A job long enough to gain from the wait is measured on its third step: LayerAdam's first pass
// over the state can still hold the second step's gates. A shorter job on its second.
TEST(AutoPolicySession, ALongJobIsMeasuredOnItsThirdStep) {
  const ModelConfig config = *ModelConfig::Preset("tiny");
  const ModelLayout layout = ModelLayout::Build(config);
  auto backend = MakeCpuBackend(config);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const AutoPolicySession::Options o = SessionOptions(backend->get(), layout);
  const std::vector<MicroBatch> mbs = {testing::MakeBatch({64}, config.vocab_size, 1)};
  StepObservation step;
  step.total_s = step.compute_s = 1.0;
  step.peak_bytes = 1 << 20;
  AutoPolicySession long_job(o);
  for (int k = 0; k < 2; ++k) {
    auto r = long_job.AfterStep(k, step, mbs, kAutoPolicyLongJobSteps - k);
    ASSERT_TRUE(r.ok()) << r.status();
    EXPECT_FALSE(r->has_value()) << "step " << k + 1;
  }
  auto r = long_job.AfterStep(2, step, mbs, kAutoPolicyLongJobSteps - 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->has_value());
  AutoPolicySession short_job(o);
  r = short_job.AfterStep(0, step, mbs, kAutoPolicyLongJobSteps - 1);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_value());
  r = short_job.AfterStep(1, step, mbs, kAutoPolicyLongJobSteps - 2);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_TRUE(r->has_value());
}

// The session on the CPU backend's real probes, fed step figures: a layout slower than the
// recompute step sends the job back to recompute, and that answer is reported with its record
// (every layer recompute, predicted from the same measurements), so hostd caches it.
TEST(AutoPolicySession, RecomputeIsAMeasuredAnswerWithItsRecord) {
  const ModelConfig config = *ModelConfig::Preset("tiny");
  const ModelLayout layout = ModelLayout::Build(config);
  auto backend = MakeCpuBackend(config);
  ASSERT_TRUE(backend.ok()) << backend.status();
  const AutoPolicySession::Options o = SessionOptions(backend->get(), layout);
  AutoPolicySession session(o);
  const std::vector<MicroBatch> mbs = {testing::MakeBatch({30, 34}, config.vocab_size, 1),
                                       testing::MakeBatch({64}, config.vocab_size, 2)};
  StepObservation step;
  step.total_s = step.compute_s = 1.0;
  step.peak_bytes = 1 << 20;
  auto r = session.AfterStep(0, step, mbs, 9);  // warm-up
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_value());
  r = session.AfterStep(1, step, mbs, 8);  // measured: a layout to validate
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->has_value());
  EXPECT_FALSE(session.validated());
  StepObservation slow = step;
  slow.total_s = 2.0;  // twice the recompute step, on both validation steps
  r = session.AfterStep(2, slow, mbs, 7);
  ASSERT_TRUE(r.ok()) << r.status();
  EXPECT_FALSE(r->has_value());  // (its first look)
  r = session.AfterStep(3, slow, mbs, 6);
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(r->has_value());
  EXPECT_TRUE(session.validated());
  EXPECT_FALSE(session.active());
  const AutoPolicyChoice& c = session.chosen();
  for (const LayerPolicy& l : c.layout.layers) EXPECT_EQ(l, LayerPolicy{}) << LayerPolicyName(l);
  ASSERT_TRUE(c.layout.autopolicy.has_value());
  EXPECT_EQ(c.layout.autopolicy->predicted.step_s,
            PredictPolicy(c.layout.autopolicy->problem, c.layout.autopolicy->predicted.counts).step_s);
  EXPECT_EQ(MixName(c.layout.autopolicy->problem.candidates, c.layout.autopolicy->predicted.counts),
            absl::StrCat(config.num_hidden_layers, " recompute"));
  EXPECT_EQ(session.validated_step(), 1);
  EXPECT_EQ(session.validated_step_s(), 1.0);
  // What the cache would hold parses back.
  auto again = LayerLayout::Parse(c.layout.ToYaml(), "cached");
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << c.layout.ToYaml();
  EXPECT_EQ(*again, c.layout);
}

}  // namespace
}  // namespace slidedp
