// Tests for the verification driver: the token batch format and its labels, and RunWholeModel on
// the CPU backend against the CPU oracle (ReferenceLossAndGrads), tied and untied, every
// activation policy and both micro-batch groupings.
#include <cmath>
#include <cstdint>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "common/safetensors/safetensors.h"
#include "gtest/gtest.h"
#include "tools/verify/token_batch.h"
#include "tools/verify/whole_model.h"
#include "worker/compute/cpu/cpu_reference_model.h"

namespace slidedp::verify {
namespace {

TEST(TokenBatch, PackedRowLabelsPositionsAndBoundaries) {
  auto batch = ParseTokenBatch(R"({"rows": [[5, 6, 7, 8, 9, 10], [1, 2, 3]], "doc_lens": [[3, 1, 2], []]})", "t");
  ASSERT_TRUE(batch.ok()) << batch.status();
  const std::vector<MicroBatch> per_row = BuildMicroBatches(*batch, Grouping::kPerRow);
  ASSERT_EQ(per_row.size(), 2u);
  const MicroBatch& a = per_row[0];
  EXPECT_EQ(a.tokens, (std::vector<int32_t>{5, 6, 7, 8, 9, 10}));
  EXPECT_EQ(a.labels, (std::vector<int32_t>{6, 7, kIgnoreIndex, kIgnoreIndex, 10, kIgnoreIndex}));
  EXPECT_EQ(a.positions, (std::vector<int32_t>{0, 1, 2, 0, 0, 1}));
  EXPECT_EQ(a.cu_seqlens, (std::vector<int32_t>{0, 3, 4, 6}));
  EXPECT_EQ(a.max_seqlen, 3);
  EXPECT_EQ(per_row[1].labels, (std::vector<int32_t>{2, 3, kIgnoreIndex}));
  EXPECT_EQ(per_row[1].cu_seqlens, (std::vector<int32_t>{0, 3}));

  const std::vector<MicroBatch> single = BuildMicroBatches(*batch, Grouping::kSingle);
  ASSERT_EQ(single.size(), 1u);
  EXPECT_EQ(single[0].num_tokens(), 9);
  EXPECT_EQ(single[0].num_trained(), 5);
  EXPECT_EQ(single[0].cu_seqlens, (std::vector<int32_t>{0, 3, 4, 6, 9}));
  EXPECT_EQ(single[0].positions.back(), 2);
}

TEST(TokenBatch, RejectsMalformedFiles) {
  EXPECT_FALSE(ParseTokenBatch("not json", "t").ok());
  EXPECT_FALSE(ParseTokenBatch(R"({"rows": []})", "t").ok());
  EXPECT_FALSE(ParseTokenBatch(R"({"rows": [[]]})", "t").ok());
  EXPECT_FALSE(ParseTokenBatch(R"({"rows": [[1, -2]]})", "t").ok());
  EXPECT_FALSE(ParseTokenBatch(R"({"rows": [[1, 2.5]]})", "t").ok());
  EXPECT_FALSE(ParseTokenBatch(R"({"rows": [[1, 2, 3]], "doc_lens": [[1, 1]]})", "t").ok());
  EXPECT_FALSE(ParseTokenBatch(R"({"rows": [[1, 2, 3]], "doc_lens": [[3, 0]]})", "t").ok());
  EXPECT_FALSE(ParseTokenBatch(R"({"rows": [[1, 2, 3]], "doc_lens": [[3], [1]]})", "t").ok());
  auto s = ParseTokenBatch(R"({"rows": [[1, 2, 3]], "doc_lens": [[2, 2]]})", "batch.json");
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("doc_lens[0] sums to 4"), absl::string_view::npos) << s.status();
}

std::vector<std::vector<bf16_t>> RandomParams(const ModelLayout& layout, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<std::vector<bf16_t>> params(layout.num_units());
  for (const UnitLayout& u : layout.units) {
    params[u.index].assign(u.numel, FloatToBf16(0.0f));
    for (const TensorSlot& t : u.tensors) {
      const bool norm = t.shape.size() == 1;
      for (int64_t i = 0; i < t.numel; ++i) {
        const float v = norm ? 1.0f + 0.1f * normal(rng) : 0.05f * normal(rng);
        params[u.index][t.offset_numel + i] = FloatToBf16(v);
      }
    }
  }
  return params;
}

TokenBatch RandomBatch(int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  TokenBatch b;
  const std::vector<std::vector<int64_t>> docs = {{40}, {7, 1, 20, 12}, {2, 25, 3}};
  for (const auto& lens : docs) {
    int64_t n = 0;
    for (int64_t l : lens) n += l;
    std::vector<int32_t> row(n);
    for (auto& t : row) t = static_cast<int32_t>(rng() % vocab);
    b.rows.push_back(row);
    b.doc_lens.push_back(lens.size() > 1 ? lens : std::vector<int64_t>{});
  }
  return b;
}

double RelL2(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    den += double(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

class WholeModelTest : public ::testing::TestWithParam<bool> {};

TEST_P(WholeModelTest, MatchesCpuOracleForEveryPolicyAndGrouping) {
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  config->tie_word_embeddings = GetParam();
  const ModelLayout layout = ModelLayout::Build(*config);
  const auto params = RandomParams(layout, 3);
  const TokenBatch tokens = RandomBatch(config->vocab_size, 4);
  const std::vector<MicroBatch> per_row = BuildMicroBatches(tokens, Grouping::kPerRow);
  int64_t trained = 0;
  for (const auto& mb : per_row) trained += mb.num_trained();
  ASSERT_EQ(trained, 40 - 1 + (7 + 1 + 20 + 12 - 4) + (2 + 25 + 3 - 3));
  const float scale = 1.0f / static_cast<float>(trained);

  std::vector<std::vector<float>> oracle_grads;
  auto oracle = ReferenceLossAndGrads(layout, params, per_row, scale, &oracle_grads);
  ASSERT_TRUE(oracle.ok()) << oracle.status();
  EXPECT_NEAR(*oracle, std::log(static_cast<double>(config->vocab_size)), 1.0);

  auto backend = MakeCpuBackend(*config);
  ASSERT_TRUE(backend.ok());
  for (ActPolicy policy : {ActPolicy::kKeepAll, ActPolicy::kRecomputeLayer, ActPolicy::kSelective}) {
    for (Grouping grouping : {Grouping::kPerRow, Grouping::kSingle}) {
      SCOPED_TRACE(::testing::Message() << "policy " << LayerPiecesName(policy.pieces) << " grouping "
                                        << static_cast<int>(grouping));
      auto got = RunWholeModel(**backend, layout, params, BuildMicroBatches(tokens, grouping), scale, policy);
      ASSERT_TRUE(got.ok()) << got.status();
      EXPECT_NEAR(got->loss, *oracle, 1e-5 * std::abs(*oracle));
      ASSERT_EQ(got->unit_grads.size(), oracle_grads.size());
      for (size_t u = 0; u < oracle_grads.size(); ++u) {
        EXPECT_LT(RelL2(got->unit_grads[u], oracle_grads[u]), 1e-5) << layout.units[u].name;
      }
      // The tied embedding gradient holds the LM head's contribution: rows of tokens that never
      // occur still get a gradient through the head.
      if (GetParam()) {
        const std::vector<float>& g = got->unit_grads[0];
        bool any_nonzero = false;
        for (int64_t v = 0; v < config->vocab_size && !any_nonzero; ++v) {
          bool used = false;
          for (const auto& row : tokens.rows) {
            for (int32_t t : row) used |= t == v;
          }
          if (used) continue;
          for (int64_t i = 0; i < config->hidden_size; ++i) any_nonzero |= g[v * config->hidden_size + i] != 0.0f;
        }
        EXPECT_TRUE(any_nonzero);
      }
    }
  }
}

TEST(WholeModel, RejectsWrongParameterCount) {
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  const ModelLayout layout = ModelLayout::Build(*config);
  auto params = RandomParams(layout, 1);
  params[1].pop_back();
  auto backend = MakeCpuBackend(*config);
  ASSERT_TRUE(backend.ok());
  auto got = RunWholeModel(**backend, layout, params, BuildMicroBatches(RandomBatch(512, 1), Grouping::kSingle), 1.0f,
                           ActPolicy::kKeepAll);
  EXPECT_EQ(got.status().code(), absl::StatusCode::kInvalidArgument);
}

// GPT-OSS keeps its experts fused (one HF tensor, a slice per expert in the units): the dump holds
// each HF name once, at its HF shape, every slice's values where TensorSlot::hf_offset_numel puts them.
TEST(WholeModel, HfTensorsGatherFusedExpertSlices) {
  auto config = ModelConfig::Preset("tiny-gpt-oss");
  ASSERT_TRUE(config.ok());
  const ModelLayout layout = ModelLayout::Build(*config);
  std::vector<std::vector<float>> per_unit(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) {
    per_unit[u].resize(layout.units[u].numel);
    for (size_t i = 0; i < per_unit[u].size(); ++i) per_unit[u][i] = static_cast<float>(u * 1000003 + i);
  }
  const std::string path = ::testing::TempDir() + "/fused_slices.safetensors";
  ASSERT_TRUE(safetensors::WriteFile(path, HfTensorsF32(layout, per_unit)).ok());
  auto file = safetensors::SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  int slices = 0;
  std::set<std::string> names;
  for (const UnitLayout& unit : layout.units) {
    for (const TensorSlot& slot : unit.tensors) {
      names.insert(slot.hf_name);
      const safetensors::TensorInfo* t = (*file)->Find(slot.hf_name);
      ASSERT_NE(t, nullptr) << slot.hf_name;
      EXPECT_EQ(t->shape, slot.is_slice() ? slot.hf_shape : slot.shape) << slot.hf_name;
      int64_t numel = 1;
      for (int64_t d : t->shape) numel *= d;
      std::vector<float> got(numel);
      ASSERT_TRUE((*file)->ReadAsFloat32(*t, got.data()).ok());
      const int64_t at = slot.is_slice() ? slot.hf_offset_numel : 0;
      slices += slot.is_slice();
      for (int64_t i = 0; i < slot.numel; ++i) {
        ASSERT_EQ(got[at + i], per_unit[unit.index][slot.offset_numel + i]) << slot.hf_name << " @" << at + i;
      }
    }
  }
  EXPECT_GT(slices, 0);
  EXPECT_EQ((*file)->tensors().size(), names.size());
}

INSTANTIATE_TEST_SUITE_P(TiedAndUntied, WholeModelTest, ::testing::Bool());

}  // namespace
}  // namespace slidedp::verify
