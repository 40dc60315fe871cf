// Validation (data.validation, train.eval_every) through real processes: hostd + CPU workers
// evaluate the whole split after every eval_every steps and after the last one; the loss is the
// same bits for 1, 2 and 3 ranks (each micro-batch computed on its own, summed in order by hostd)
// and equals the non-streaming reference's; the default finds `slidedp prepare`'s validation/
// split beside train/; a job without one that asks for eval_every is refused at submit.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "common/data/dataset.h"
#include "common/data/micro_batch.h"
#include "common/data/synthetic.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "nlohmann/json.hpp"
#include "tests/integration/node_harness.h"
#include "worker/compute/cpu/cpu_reference_model.h"

namespace slidedp::testing {
namespace {

// <root>/train (96 documents) and <root>/validation (an odd 13-or-so rows), as prepare lays them out.
std::string DataRoot() {
  static std::string root = [] {
    std::string d = ::testing::TempDir() + "/val-data-" + std::to_string(getpid());
    for (const auto& [split, docs, seed] : {std::tuple{"train", 96, 5}, std::tuple{"validation", 23, 6}}) {
      data::SyntheticOptions o;
      o.vocab_size = 512;
      o.num_documents = docs;
      o.seed = seed;
      o.min_doc_tokens = 8;
      o.max_doc_tokens = 90;
      o.seq_len = 64;
      o.prompt_fraction = 0.3;  // untrained tokens: the loss divides by the trained ones only
      o.overwrite = data::Overwrite::kYes;
      auto m = data::WriteSyntheticDataset(d + "/" + split, o);
      EXPECT_TRUE(m.ok()) << m.status();
    }
    return d;
  }();
  return root;
}

std::string Spec(int workers, const std::string& output, const std::string& extra_data, double lr, int eval_every) {
  return absl::StrCat("name: val\nmodel: {preset: tiny, init_seed: 4}\ndata: {path: ", DataRoot(), "/train",
                      extra_data, "}\n", "output: {dir: ", output, ", save_final: false}\n",
                      "train: {seq_len: 64, global_batch: 12, micro_batch: 2, steps: 4, seed: 3, eval_every: ",
                      eval_every, "}\n", "optimizer: {lr: ", lr, "}\n", "runtime: {workers: ", workers,
                      ", step_timeout_ms: 20000}\n");
}

// step -> eval_loss of the records that have one.
std::map<int64_t, double> EvalLosses(const std::vector<nlohmann::json>& lines) {
  std::map<int64_t, double> out;
  for (const auto& j : lines) {
    if (j.contains("eval_loss")) out[j["step"].get<int64_t>()] = j["eval_loss"].get<double>();
  }
  return out;
}

// The loss of the whole split with the initial parameters, by the CPU reference model (the same
// BF16 weights, FP32 norm weights and embedding rows as the workers).
double ReferenceValidationLoss() {
  const ModelLayout layout = ModelLayout::Build(*ModelConfig::Preset("tiny"));
  const int U = layout.num_units();
  std::vector<std::vector<float>> master(U);
  for (int u = 0; u < U; ++u) master[u].assign(layout.units[u].numel, 0);
  checkpoint::InitRandom(layout, 4, [&](int u) { return master[u].data(); });
  std::vector<std::vector<bf16_t>> params(U);
  std::vector<std::vector<float>> norms(U), grads;
  for (int u = 0; u < U; ++u) {
    params[u].resize(master[u].size());
    for (size_t i = 0; i < master[u].size(); ++i) params[u][i] = FloatToBf16(master[u][i]);
    norms[u].resize(layout.units[u].fp32_numel);
    CopyNormsFromMaster(layout.units[u], master[u].data(), norms[u].data());
  }
  auto dataset = data::DatasetReader::Open(DataRoot() + "/validation");
  EXPECT_TRUE(dataset.ok()) << dataset.status();
  std::vector<int64_t> rows((*dataset)->num_rows());
  for (size_t r = 0; r < rows.size(); ++r) rows[r] = static_cast<int64_t>(r);
  auto trained = data::CountTrainedLabels(**dataset, rows);
  EXPECT_TRUE(trained.ok());
  double sum = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    auto mb = data::BuildMicroBatch(**dataset, absl::MakeConstSpan(&rows[r], 1));
    EXPECT_TRUE(mb.ok());
    auto l = ReferenceLossAndGrads(layout, params, {*mb}, 1.0f, &grads, &norms, master[0].data());
    EXPECT_TRUE(l.ok()) << l.status();
    sum += *l;
  }
  return sum / static_cast<double>(*trained);
}

TEST(Validation, SameLossForAnyRankCountAndTheReferences) {
  NodeHarness node(3);
  // lr 0: the parameters stay the initial ones, so every pass and rank count sees the same model.
  std::map<int, std::map<int64_t, double>> by_world;
  for (int world : {1, 2, 3}) {
    const std::string out = absl::StrCat("out", world);
    v1::Job j = MustSucceed(node, Spec(world, out, "", 0.0, 2), absl::StrCat("w", world));
    by_world[world] = EvalLosses(MetricsLines(node, out, absl::StrCat("w", world)));
    EXPECT_TRUE(j.last().has_eval_loss());
    EXPECT_GT(j.last().eval_tokens(), 0);
  }
  ASSERT_EQ(by_world[1].size(), 2u) << "a pass after steps 2 and 4";
  EXPECT_TRUE(by_world[1].count(2) && by_world[1].count(4));
  for (int world : {2, 3}) {
    for (const auto& [step, loss] : by_world[1]) {
      EXPECT_EQ(by_world[world][step], loss) << world << " ranks, step " << step << ": not the same bits";
    }
  }
  const double ref = ReferenceValidationLoss();
  EXPECT_NEAR(by_world[1][4], ref, 1e-5 * std::abs(ref)) << "the non-streaming reference's loss";
  EXPECT_GT(ref, 1.0);
  EXPECT_TRUE(node.LeakedSegments().empty());
}

TEST(Validation, TrainingMovesTheValidationLossAndNoneTurnsItOff) {
  NodeHarness node(2);
  v1::Job j = MustSucceed(node, Spec(2, "out-train", "", 3e-3, 1), "train");
  const std::map<int64_t, double> losses = EvalLosses(MetricsLines(node, "out-train", "train"));
  ASSERT_EQ(losses.size(), 4u) << "eval_every 1: after every step";
  EXPECT_LT(losses.at(4), losses.at(1)) << "a learnable dataset: the validation loss falls";
  v1::Job none = MustSucceed(node, Spec(2, "out-none", ", validation: none", 3e-3, 0), "none");
  EXPECT_TRUE(EvalLosses(MetricsLines(node, "out-none", "none")).empty());
  EXPECT_FALSE(none.last().has_eval_loss());
  // eval_every without a validation split is refused at submit, naming the key.
  auto refused = node.RunJob(Spec(2, "out-bad", ", validation: none", 3e-3, 2), "bad", 60);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "train.eval_every")) << refused.status();
}

}  // namespace
}  // namespace slidedp::testing
