// gpt_oss checkpoints: MXFP4 dequantization as transformers' convert_moe_packed_tensors (a hand-made
// block of known values: the FP4 table, the nibble order, the scale's exponent, the transpose);
// a released-style directory (quantization_config mxfp4, *_blocks / *_scales experts, BF16 rest)
// loads to those values, saves unquantized (BF16, config.json without quantization_config) and loads
// back the same; bad MXFP4 tensors are refused; InitRandom gives GptOssPreTrainedModel's init.
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/mxfp4.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using safetensors::Dtype;
using namespace slidedp::checkpoint::testing;

std::string TempDir(const char* what) {
  const std::string d = (fs::temp_directory_path() / absl::StrCat(what, ".", ::getpid())).string();
  fs::remove_all(d);
  return d;
}

TEST(Mxfp4, TheFp4TableIsTransformers) {
  const float want[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int code = 0; code < 16; ++code) {
    EXPECT_EQ(Mxfp4Value(static_cast<uint8_t>(code)), want[code]) << code;
    EXPECT_EQ(std::signbit(Mxfp4Value(static_cast<uint8_t>(code))), code >= 8) << code;
  }
}

// Two rows (out) of 64 inputs: two blocks of 32 each, with known codes and scales.
TEST(Mxfp4, AHandMadeBlockDequantizesToKnownValues) {
  const int64_t out_dim = 2, in_dim = 64;
  std::vector<uint8_t> blocks(out_dim * 2 * 16, 0), scales(out_dim * 2, 127);
  auto byte = [&](int64_t r, int64_t g, int64_t b) -> uint8_t& { return blocks[(r * 2 + g) * 16 + b]; };
  // Row 0, block 0 at 2^0: byte 0 = 0x21 -> in 0 = code 1 (0.5, low nibble first), in 1 = code 2 (1.0);
  // byte 1 = 0xF8 -> in 2 = code 8 (-0.0), in 3 = code 15 (-6.0).
  byte(0, 0, 0) = 0x21;
  byte(0, 0, 1) = 0xF8;
  // Row 0, block 1 at 2^2: byte 0 = 0x7A -> in 32 = code 10 (-1.0 x 4), in 33 = code 7 (6.0 x 4).
  scales[0 * 2 + 1] = 129;
  byte(0, 1, 0) = 0x7A;
  // Row 1, block 0 at 2^-7: byte 15 = 0x3C -> in 30 = code 12 (-2.0 / 128), in 31 = code 3 (1.5 / 128).
  scales[1 * 2 + 0] = 120;
  byte(1, 0, 15) = 0x3C;
  // Row 1, block 1 at 2^-127 (scale 0): in 32 = 0.5 x 2^-127 = 2^-128, below float's normal range.
  scales[1 * 2 + 1] = 0;
  byte(1, 1, 0) = 0x01;
  std::vector<float> w(in_dim * out_dim, 99.0f);
  DequantizeMxfp4Transposed(blocks.data(), scales.data(), out_dim, in_dim, w.data());
  auto at = [&](int64_t in, int64_t r) { return w[in * out_dim + r]; };  // transposed: [in, out]
  std::map<std::pair<int64_t, int64_t>, float> known = {
      {{0, 0}, 0.5f},         {{1, 0}, 1.0f},        {{2, 0}, -0.0f},
      {{3, 0}, -6.0f},        {{32, 0}, -4.0f},      {{33, 0}, 24.0f},
      {{30, 1}, -2.0f / 128}, {{31, 1}, 1.5f / 128}, {{32, 1}, std::ldexp(1.0f, -128)}};
  for (int64_t in = 0; in < in_dim; ++in) {
    for (int64_t r = 0; r < out_dim; ++r) {
      auto it = known.find({in, r});
      const float want = it != known.end() ? it->second : 0.0f;
      EXPECT_EQ(at(in, r), want) << "in " << in << " out " << r;
    }
  }
  EXPECT_TRUE(std::signbit(at(2, 0)));
  // Scales past float's range make inf, and 0 x 2^128 NaN, as transformers' float32 power of two.
  scales[0] = 255;
  DequantizeMxfp4Transposed(blocks.data(), scales.data(), out_dim, in_dim, w.data());
  EXPECT_TRUE(std::isinf(at(0, 0)));
  EXPECT_TRUE(std::isnan(at(4, 0)));
}

// tiny-gpt-oss as the released checkpoints store it: BF16 tensors but for the experts' matrices,
// which are *_blocks / *_scales (their biases BF16), and quantization_config mxfp4 in config.json.
// Codes and scales follow a pattern; returns the dequantized value of each fused tensor's element.
struct Mxfp4Dir {
  ModelConfig config;
  std::map<std::string, std::vector<float>> experts;  // fused name -> [E, in, out] values
};

Mxfp4Dir WriteMxfp4GptOss(const std::string& dir, uint8_t bad_scale = 0, bool bad_shape = false) {
  Mxfp4Dir out;
  out.config = ModelConfig::Preset("tiny-gpt-oss").value();
  const ModelLayout layout = ModelLayout::Build(out.config);
  fs::create_directories(dir);
  nlohmann::json config = nlohmann::json::parse(out.config.ToJson());
  config["quantization_config"] = {
      {"quant_method", "mxfp4"},
      {"modules_to_not_convert",
       {"model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"}}};
  std::ofstream(dir + "/config.json") << config.dump(2);
  static std::vector<std::vector<char>> keep;
  keep.clear();
  std::vector<safetensors::TensorSource> src;
  std::map<std::string, bool> written;
  int k = 0;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      if (written[t.hf_name]) continue;
      written[t.hf_name] = true;
      const std::vector<int64_t> shape = t.is_slice() ? t.hf_shape : t.shape;
      const bool quantized =
          absl::EndsWith(t.hf_name, "experts.gate_up_proj") || absl::EndsWith(t.hf_name, "experts.down_proj");
      if (!quantized) {
        int64_t n = 1;
        for (int64_t d : shape) n *= d;
        std::vector<char> bytes(2 * n);
        for (int64_t i = 0; i < n; ++i) {
          const uint16_t b = FloatToBf16(KnownValue(k, i));
          std::memcpy(bytes.data() + 2 * i, &b, 2);
        }
        keep.push_back(std::move(bytes));
        src.push_back({t.hf_name, Dtype::kBF16, shape, keep.back().data(), nullptr});
        ++k;
        continue;
      }
      const int64_t experts = shape[0], in = shape[1], o = shape[2], groups = in / 32;
      std::vector<char> blocks(experts * o * groups * 16), scales(experts * o * groups);
      for (size_t i = 0; i < blocks.size(); ++i) blocks[i] = static_cast<char>((i * 37 + k * 11) % 256);
      for (size_t i = 0; i < scales.size(); ++i) scales[i] = static_cast<char>(120 + (i * 5 + k) % 12);
      if (bad_scale != 0) scales[3] = static_cast<char>(bad_scale);
      std::vector<float>& v = out.experts[t.hf_name];
      v.resize(experts * in * o);
      for (int64_t e = 0; e < experts; ++e)
        for (int64_t r = 0; r < o; ++r)
          for (int64_t c = 0; c < in; ++c) {
            const uint8_t b = static_cast<uint8_t>(blocks[((e * o + r) * groups + c / 32) * 16 + (c % 32) / 2]);
            const int s = static_cast<uint8_t>(scales[(e * o + r) * groups + c / 32]);
            v[(e * in + c) * o + r] = Mxfp4Value(c % 2 == 0 ? (b & 15) : (b >> 4)) * std::ldexp(1.0f, s - 127);
          }
      keep.push_back(std::move(blocks));
      src.push_back({t.hf_name + "_blocks",
                     Dtype::kU8,
                     {experts, o, bad_shape ? groups * 2 : groups, bad_shape ? 8 : 16},
                     keep.back().data(),
                     nullptr});
      keep.push_back(std::move(scales));
      src.push_back({t.hf_name + "_scales", Dtype::kU8, {experts, o, groups}, keep.back().data(), nullptr});
      ++k;
    }
  }
  safetensors::WriteOptions opts;
  opts.durability = safetensors::Durability::kNone;
  if (!safetensors::WriteFile(dir + "/model.safetensors", src, opts).ok()) std::abort();
  return out;
}

TEST(GptOssCheckpoint, Mxfp4ExpertsLoadDequantizedAndSaveUnquantized) {
  const std::string dir = TempDir("gpt_oss_mxfp4"), root = TempDir("gpt_oss_mxfp4_out");
  const Mxfp4Dir made = WriteMxfp4GptOss(dir);
  auto config = ModelConfigOfDir(dir);
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_TRUE(config->mxfp4_experts);
  const ModelLayout layout = ModelLayout::Build(*config);
  HostState state(layout);
  ASSERT_TRUE(LoadHfModel(dir, layout, state.master_fn()).ok());
  int checked = 0;
  for (const UnitLayout& u : layout.units) {
    for (const TensorSlot& t : u.tensors) {
      auto it = made.experts.find(t.hf_name);
      if (it == made.experts.end()) continue;
      for (int64_t i = 0; i < t.numel; ++i) {
        ASSERT_EQ(state.master[u.index][t.offset_numel + i], it->second[t.hf_offset_numel + i])
            << t.Key() << "[" << i << "]";
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 2 * 2 * 4);  // two layers, two matrices, four experts

  // Saved: unquantized BF16 experts under transformers' parameter names, no quantization_config;
  // every value exact (FP4 times a power of two fits BF16), and it loads back the same.
  SaveRequest save;
  save.root_dir = root;
  save.step = 1;
  save.layout = &layout;
  save.arrays = state.arrays();
  save.trainer_state = {{"job_id", "mxfp4"}};
  auto saved = SaveCheckpoint(save);
  ASSERT_TRUE(saved.ok()) << saved.status();
  std::ifstream cfg(saved->dir + "/config.json");
  const nlohmann::json written = nlohmann::json::parse(cfg);
  EXPECT_FALSE(written.contains("quantization_config"));
  auto file = safetensors::SafetensorsFile::Open(saved->dir + "/model.safetensors");
  ASSERT_TRUE(file.ok()) << file.status();
  for (const auto& [name, values] : made.experts) {
    const safetensors::TensorInfo* t = (*file)->Find(name);
    ASSERT_NE(t, nullptr) << name;
    EXPECT_EQ(t->dtype, Dtype::kBF16);
    EXPECT_EQ((*file)->Find(name + "_blocks"), nullptr);
    std::vector<float> got(t->numel);
    ASSERT_TRUE((*file)->ReadAsFloat32(*t, got.data()).ok());
    EXPECT_EQ(got, values) << name;
  }
  auto back_config = ModelConfigOfDir(saved->dir);
  ASSERT_TRUE(back_config.ok()) << back_config.status();
  EXPECT_FALSE(back_config->mxfp4_experts);
  HostState back(layout);
  ASSERT_TRUE(LoadHfModel(saved->dir, ModelLayout::Build(*back_config), back.master_fn()).ok());
  EXPECT_EQ(back.master, state.master);
  fs::remove_all(dir);
  fs::remove_all(root);
}

TEST(GptOssCheckpoint, BadMxfp4TensorsAreRefused) {
  {
    const std::string dir = TempDir("gpt_oss_mxfp4_shape");
    const Mxfp4Dir made = WriteMxfp4GptOss(dir, 0, /*bad_shape=*/true);
    const ModelLayout layout = ModelLayout::Build(*ModelConfigOfDir(dir));
    HostState state(layout);
    const absl::Status s = LoadHfModel(dir, layout, state.master_fn());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "gate_up_proj_blocks")) << s;
    fs::remove_all(dir);
  }
  {
    const std::string dir = TempDir("gpt_oss_mxfp4_inf");
    WriteMxfp4GptOss(dir, /*bad_scale=*/255);
    const ModelLayout layout = ModelLayout::Build(*ModelConfigOfDir(dir));
    HostState state(layout);
    const absl::Status s = LoadHfModel(dir, layout, state.master_fn());
    EXPECT_EQ(s.code(), absl::StatusCode::kDataLoss) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "finite")) << s;
    fs::remove_all(dir);
  }
  {
    // Blocks without quantization_config: transformers would not dequantize them either.
    const std::string dir = TempDir("gpt_oss_mxfp4_noconfig");
    const Mxfp4Dir made = WriteMxfp4GptOss(dir);
    std::ofstream(dir + "/config.json") << made.config.ToJson();
    const ModelLayout layout = ModelLayout::Build(*ModelConfigOfDir(dir));
    HostState state(layout);
    const absl::Status s = LoadHfModel(dir, layout, state.master_fn());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "missing")) << s;
    fs::remove_all(dir);
  }
}

// GptOssPreTrainedModel._init_weights: linear biases 0, the experts' biases 0, the router's bias and
// the sinks normal like the weights.
TEST(GptOssCheckpoint, RandomInitIsTransformers) {
  const ModelConfig c = ModelConfig::Preset("tiny-gpt-oss").value();
  const ModelLayout layout = ModelLayout::Build(c);
  HostState state(layout);
  InitRandom(layout, 7, state.master_fn());
  const UnitLayout& u = layout.units[1];
  auto stats = [&](const TensorSlot* t) {
    double sum2 = 0;
    for (int64_t i = 0; i < t->numel; ++i) sum2 += std::pow(state.master[1][t->offset_numel + i], 2);
    return std::sqrt(sum2 / static_cast<double>(t->numel));
  };
  for (DecoderTensor t : {kQBias, kKBias, kVBias, kOBias}) EXPECT_EQ(stats(u.Find(t)), 0.0) << u.Find(t)->hf_name;
  EXPECT_GT(stats(u.Find(kSinks)), 0.0);
  EXPECT_GT(stats(u.Find(kRouterBias)), 0.0);
  for (int64_t e = 0; e < u.num_experts(); ++e) {
    EXPECT_EQ(stats(u.FindExpert(e, kGptOssGateUpBias)), 0.0);
    EXPECT_EQ(stats(u.FindExpert(e, kGptOssDownBias)), 0.0);
    EXPECT_NEAR(stats(u.FindExpert(e, kGptOssGateUp)), 0.02, 0.002);
  }
  EXPECT_EQ(stats(u.Find(kInputNorm)), 1.0);
}

}  // namespace
}  // namespace slidedp::checkpoint
