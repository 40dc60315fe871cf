// ReferenceLossAndGrads: the whole model on the CPU backend (loss at initialization, tied
// embeddings, micro-batch accumulation, training progress, argument checks).
#include "worker/compute/cpu/cpu_reference_model.h"

#include <cmath>

#include "gtest/gtest.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::AwkwardConfig;
using testing::MakeBatch;
using testing::RandomUnitParams;
using testing::ToBf16;

// HF-style init (normal(0, 0.02), norms 1): the final norm makes the head input O(1), so logits
// have std ~0.02*sqrt(hidden) = 0.16 and the expected loss is ~ln(vocab) + 0.16^2/2.
TEST(ReferenceModel, InitialMeanLossIsLogVocab) {
  const ModelConfig config = testing::TinyConfig();
  const ModelLayout layout = ModelLayout::Build(config);
  std::mt19937_64 rng(1);
  std::normal_distribution<double> normal(0.0, config.initializer_range);
  std::vector<std::vector<double>> params;
  for (const UnitLayout& u : layout.units) {
    std::vector<double> p(u.numel, 0.0);
    for (const TensorSlot& t : u.tensors)
      for (int64_t i = 0; i < t.numel; ++i) p[t.offset_numel + i] = t.shape.size() == 1 ? 1.0 : normal(rng);
    params.push_back(std::move(p));
  }
  const std::vector<MicroBatch> batches = {MakeBatch({40, 23}, config.vocab_size, 1), MakeBatch({31}, config.vocab_size, 2)};
  int64_t trained = 0;
  for (const auto& b : batches) trained += b.num_trained();
  std::vector<std::vector<float>> grads;
  auto loss = ReferenceLossAndGrads(layout, ToBf16(params), batches, 1.0f / trained, &grads);
  ASSERT_TRUE(loss.ok()) << loss.status();
  EXPECT_NEAR(*loss, std::log(static_cast<double>(config.vocab_size)) + 0.0128, 0.03);
  ASSERT_EQ(grads.size(), static_cast<size_t>(layout.num_units()));
  for (int u = 0; u < layout.num_units(); ++u) EXPECT_EQ(static_cast<int64_t>(grads[u].size()), layout.units[u].numel);
}

// Tied model == untied model whose lm_head equals the embedding; the tied embedding gradient is
// the sum of the untied embedding and lm_head gradients.
TEST(ReferenceModel, TiedGradientIsEmbeddingPlusLmHead) {
  const ModelLayout tied = ModelLayout::Build(AwkwardConfig(true));
  const ModelLayout untied = ModelLayout::Build(AwkwardConfig(false));
  auto tied_params = ToBf16(RandomUnitParams(tied, 3));
  auto untied_params = tied_params;
  untied_params.back().assign(untied.head().numel, 0);
  std::copy(tied_params.back().begin(), tied_params.back().begin() + tied.head().numel, untied_params.back().begin());
  const TensorSlot& lm = untied.head().tensors[1];
  std::copy(tied_params[0].begin(), tied_params[0].begin() + lm.numel, untied_params.back().begin() + lm.offset_numel);
  const std::vector<MicroBatch> batches = {MakeBatch({5, 1, 9}, 37, 4)};
  std::vector<std::vector<float>> gt, gu;
  auto lt = ReferenceLossAndGrads(tied, tied_params, batches, 0.1f, &gt);
  auto lu = ReferenceLossAndGrads(untied, untied_params, batches, 0.1f, &gu);
  ASSERT_TRUE(lt.ok() && lu.ok());
  EXPECT_EQ(*lt, *lu);
  for (int64_t i = 0; i < lm.numel; ++i) {
    ASSERT_NEAR(gt[0][i], gu[0][i] + gu.back()[lm.offset_numel + i], 1e-6f) << i;
  }
}

// Two micro-batches in one call == the sums of the two separate calls.
TEST(ReferenceModel, MicroBatchesAccumulate) {
  const ModelLayout layout = ModelLayout::Build(AwkwardConfig(false));
  const auto params = ToBf16(RandomUnitParams(layout, 8));
  const MicroBatch a = MakeBatch({6, 7}, 37, 1), b = MakeBatch({3, 11, 2}, 37, 2);
  std::vector<std::vector<float>> gab, ga, gb;
  auto lab = ReferenceLossAndGrads(layout, params, {a, b}, 0.05f, &gab);
  auto la = ReferenceLossAndGrads(layout, params, {a}, 0.05f, &ga);
  auto lb = ReferenceLossAndGrads(layout, params, {b}, 0.05f, &gb);
  ASSERT_TRUE(lab.ok() && la.ok() && lb.ok());
  EXPECT_NEAR(*lab, *la + *lb, 1e-6 * *lab);
  for (int u = 0; u < layout.num_units(); ++u) {
    for (size_t i = 0; i < gab[u].size(); ++i) {
      const float sum = ga[u][i] + gb[u][i];
      ASSERT_NEAR(gab[u][i], sum, 1e-6f * std::max(1.0f, std::abs(sum))) << layout.units[u].name << "[" << i << "]";
    }
  }
}

// A few steps of plain gradient descent on one batch lower its loss: the gradients point downhill.
TEST(ReferenceModel, GradientDescentLowersTheLoss) {
  const ModelLayout layout = ModelLayout::Build(AwkwardConfig(false));
  std::vector<std::vector<double>> params = RandomUnitParams(layout, 9);
  const std::vector<MicroBatch> batches = {MakeBatch({12, 9}, 37, 3)};
  const float scale = 1.0f / batches[0].num_trained();
  double first = 0, last = 0;
  for (int step = 0; step < 8; ++step) {
    std::vector<std::vector<float>> grads;
    auto loss = ReferenceLossAndGrads(layout, ToBf16(params), batches, scale, &grads);
    ASSERT_TRUE(loss.ok());
    if (step == 0) first = *loss;
    last = *loss;
    for (int u = 0; u < layout.num_units(); ++u)
      for (size_t i = 0; i < params[u].size(); ++i) params[u][i] -= 0.5 * grads[u][i];
  }
  EXPECT_LT(last, 0.8 * first);
}

TEST(ReferenceModel, RejectsMismatchedArgumentsAndBadBatches) {
  const ModelLayout layout = ModelLayout::Build(AwkwardConfig(false));
  auto params = ToBf16(RandomUnitParams(layout, 1));
  std::vector<std::vector<float>> grads;
  const std::vector<MicroBatch> batches = {MakeBatch({4}, 37, 1)};
  auto fewer = params;
  fewer.pop_back();
  EXPECT_EQ(ReferenceLossAndGrads(layout, fewer, batches, 1.0f, &grads).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto shorter = params;
  shorter[1].pop_back();
  EXPECT_EQ(ReferenceLossAndGrads(layout, shorter, batches, 1.0f, &grads).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<MicroBatch> bad = batches;
  bad[0].tokens[0] = 99;
  auto r = ReferenceLossAndGrads(layout, params, bad, 1.0f, &grads);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(std::string(r.status().message()).find("micro-batch 0"), std::string::npos) << r.status();
}

}  // namespace
}  // namespace slidedp
