// Test helpers: an in-memory host state (master, m and v per unit, in any state dtype) and its
// bytes, a fixture that saves it into a fresh checkpoint root, and a writer of small HF-format
// model directories with known values.
#pragma once

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "common/numeric/dtype.h"
#include "common/safetensors/safetensors.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace slidedp::checkpoint::testing {

// One job's state as plain vectors: master, and m and v in the dtype's layout (fp32: m, v;
// bf16: m16, v16; int8: m8, v8 codes with m_scale, v_scale per 256-element block).
struct HostState {
  explicit HostState(const ModelLayout& layout, MomentForm dtype = MomentForm::kF32) : dtype(dtype) {
    for (const UnitLayout& u : layout.units) {
      const bool f32 = dtype == MomentForm::kF32, b16 = dtype == MomentForm::kBF16;
      const int64_t blocks = dtype == MomentForm::kInt8 ? Int8MomentBlocks(u.numel) : 0;
      master.emplace_back(u.numel, 0.0f);
      m.emplace_back(f32 ? u.numel : 0, 0.0f);
      v.emplace_back(f32 ? u.numel : 0, 0.0f);
      m16.emplace_back(b16 ? u.numel : 0, bf16_t{0});
      v16.emplace_back(b16 ? u.numel : 0, bf16_t{0});
      m8.emplace_back(blocks > 0 ? u.numel : 0, int8_t{0});
      v8.emplace_back(blocks > 0 ? u.numel : 0, uint8_t{0});
      m_scale.emplace_back(blocks, 0.0f);
      v_scale.emplace_back(blocks, 0.0f);
    }
  }
  UnitMoments moments(int u) {
    switch (dtype) {
      case MomentForm::kF32: return {m[u].data(), v[u].data(), nullptr, nullptr};
      case MomentForm::kBF16: return {m16[u].data(), v16[u].data(), nullptr, nullptr};
      case MomentForm::kInt8: return {m8[u].data(), v8[u].data(), m_scale[u].data(), v_scale[u].data()};
    }
    return {};
  }
  StateArrays arrays() {
    return {[this](int u) { return master[u].data(); }, dtype, [this](int u) { return moments(u); }};
  }
  UnitArrayFn master_fn() {
    return [this](int u) { return master[u].data(); };
  }
  // Unit u's moment bytes (m, v, then the scales) for bitwise comparisons.
  std::string MomentBytes(int u) const {
    std::string out;
    auto add = [&](const auto& vec) {
      out.append(reinterpret_cast<const char*>(vec.data()), vec.size() * sizeof(vec[0]));
    };
    add(m[u]), add(v[u]), add(m16[u]), add(v16[u]), add(m8[u]), add(v8[u]), add(m_scale[u]), add(v_scale[u]);
    return out;
  }
  MomentForm dtype;
  std::vector<std::vector<float>> master, m, v;
  std::vector<std::vector<bf16_t>> m16, v16;
  std::vector<std::vector<int8_t>> m8;
  std::vector<std::vector<uint8_t>> v8;
  std::vector<std::vector<float>> m_scale, v_scale;
};

// Every byte of a state (master and moments), for "nothing was written" checks.
inline std::string StateBytes(const HostState& s) {
  std::string out;
  for (size_t u = 0; u < s.master.size(); ++u) {
    out.append(reinterpret_cast<const char*>(s.master[u].data()), s.master[u].size() * 4);
    out += s.MomentBytes(static_cast<int>(u));
  }
  return out;
}

// Equal byte strings, or where they first differ (the strings are megabytes: never print them).
inline ::testing::AssertionResult SameBytes(const std::string& a, const std::string& b) {
  if (a == b) return ::testing::AssertionSuccess();
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return ::testing::AssertionFailure() << "sizes " << a.size() << " and " << b.size() << ", first difference at byte "
                                       << i;
}

// A fresh checkpoint root in the temp directory (removed after the test), and saves of a state
// into it.
class CheckpointRootTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const std::string suite = ::testing::UnitTest::GetInstance()->current_test_info()->test_suite_name();
    root_ = (std::filesystem::temp_directory_path() / (suite + "." + std::to_string(::getpid()))).string();
    std::filesystem::remove_all(root_);
  }
  void TearDown() override { std::filesystem::remove_all(root_); }

  // Saves `state` at `step` as checkpoint-<step> (trainer state {"job_id": "j", "step"}); its
  // directory, or "" after a failed expectation.
  std::string Save(const ModelLayout& layout, HostState& state, int64_t step, int io_threads = 4) {
    SaveRequest r;
    r.root_dir = root_;
    r.step = step;
    r.layout = &layout;
    r.arrays = state.arrays();
    r.trainer_state = {{"job_id", "j"}, {"step", step}};
    r.io_threads = io_threads;
    auto res = SaveCheckpoint(r);
    EXPECT_TRUE(res.ok()) << res.status();
    return res.ok() ? res->dir : std::string();
  }

  std::string root_;
};

// A known, dtype-exact value for element i of tensor number k (exactly representable in F16/BF16).
inline float KnownValue(int k, int64_t i) { return static_cast<float>(((k * 7 + i * 13) % 61) - 30) / 64.0f; }

enum class Sharding { kSingle, kSharded };
enum class HeadCopy { kOmit, kInclude };

struct FakeTensor {
  std::string name;
  std::vector<int64_t> shape;
};

inline std::vector<FakeTensor> HfTensors(const ModelLayout& layout, HeadCopy head) {
  std::vector<FakeTensor> out;
  for (const UnitLayout& u : layout.units)
    for (const TensorSlot& t : u.tensors) out.push_back({t.hf_name, t.shape});
  if (layout.head_uses_embedding && head == HeadCopy::kInclude) {
    out.push_back({"lm_head.weight", {layout.config.vocab_size, layout.config.hidden_size}});
  }
  return out;
}

// Writes config.json and weights for `tensors` into dir. Tensor k's element i is KnownValue(k, i)
// (a tied model's lm_head copies the embedding's values, tensor 0).
inline void WriteHfModel(const std::string& dir, const ModelConfig& config, const std::vector<FakeTensor>& tensors,
                         safetensors::Dtype dtype, Sharding sharding) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.ToJson();
  static std::vector<std::vector<char>> keep;  // source bytes must outlive WriteFile
  keep.clear();
  std::vector<safetensors::TensorSource> src;
  for (size_t k = 0; k < tensors.size(); ++k) {
    int64_t n = 1;
    for (int64_t d : tensors[k].shape) n *= d;
    const bool tied_copy = config.tie_word_embeddings && tensors[k].name == "lm_head.weight";
    const int kv = tied_copy ? 0 : static_cast<int>(k);
    std::vector<char> bytes(n * safetensors::DtypeSize(dtype));
    for (int64_t i = 0; i < n; ++i) {
      float f = KnownValue(kv, i);
      if (dtype == safetensors::Dtype::kF32) {
        std::memcpy(bytes.data() + 4 * i, &f, 4);
      } else if (dtype == safetensors::Dtype::kBF16) {
        uint16_t b = FloatToBf16(f);
        std::memcpy(bytes.data() + 2 * i, &b, 2);
      } else if (dtype == safetensors::Dtype::kF16) {
        // |f| < 1 with 6 fractional bits: exact in F16.
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        uint16_t h;
        if (f == 0.0f) {
          h = static_cast<uint16_t>((bits >> 16) & 0x8000);
        } else {
          int e = static_cast<int>((bits >> 23) & 0xff) - 127 + 15;
          h = static_cast<uint16_t>(((bits >> 16) & 0x8000) | (e << 10) | ((bits >> 13) & 0x3ff));
        }
        std::memcpy(bytes.data() + 2 * i, &h, 2);
      } else {  // other dtypes: zeros (only used to test rejection)
      }
      (void)f;
    }
    keep.push_back(std::move(bytes));
    src.push_back({tensors[k].name, dtype, tensors[k].shape, keep.back().data(), nullptr});
  }
  safetensors::WriteOptions opts;
  opts.durability = safetensors::Durability::kNone;
  if (sharding == Sharding::kSingle) {
    if (!safetensors::WriteFile(dir + "/model.safetensors", src, opts).ok()) std::abort();
    return;
  }
  // Three shards, round-robin, plus the index.
  nlohmann::json weight_map = nlohmann::json::object();
  for (int s = 0; s < 3; ++s) {
    std::vector<safetensors::TensorSource> part;
    const std::string name = absl::StrCat("model-0000", s + 1, "-of-00003.safetensors");
    for (size_t k = s; k < src.size(); k += 3) {
      part.push_back(src[k]);
      weight_map[src[k].name] = name;
    }
    if (!safetensors::WriteFile(dir + "/" + name, part, opts).ok()) std::abort();
  }
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", weight_map}};
  std::ofstream(dir + "/model.safetensors.index.json") << index.dump(2);
}

inline ModelConfig TinyConfig(bool tied) {
  ModelConfig c = ModelConfig::Preset("tiny").value();
  c.tie_word_embeddings = tied;
  c.vocab_size = 96;  // odd-ish sizes keep the padding paths busy
  c.intermediate_size = 72;
  return c;
}

// Overwrites element `element` of tensor `name` in a safetensors file with `value` in the
// tensor's dtype (F32 or BF16), leaving the rest of the file as it is.
inline void PatchTensorElement(const std::string& path, const std::string& name, int64_t element, float value) {
  uint64_t offset = 0;
  safetensors::Dtype dtype = safetensors::Dtype::kF32;
  {
    auto f = safetensors::SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    const safetensors::TensorInfo* t = (*f)->Find(name);
    ASSERT_NE(t, nullptr) << name;
    uint64_t header = 0;
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(&header), 8);
    dtype = t->dtype;
    offset = 8 + header + t->data_begin + element * safetensors::DtypeSize(dtype);
  }
  std::fstream out(path, std::ios::in | std::ios::out | std::ios::binary);
  out.seekp(static_cast<std::streamoff>(offset));
  if (dtype == safetensors::Dtype::kBF16) {
    const uint16_t b = FloatToBf16(value);
    out.write(reinterpret_cast<const char*>(&b), 2);
  } else {
    ASSERT_EQ(dtype, safetensors::Dtype::kF32);
    out.write(reinterpret_cast<const char*>(&value), 4);
  }
  ASSERT_TRUE(out.good());
}

// Loads the HF directory `src` into `state` (its master weights) and returns what passes through
// (the tensors `layout` does not train), failing the test on an error.
inline PassThrough LoadKeepingPassThrough(const std::string& src, const ModelLayout& layout, HostState& state) {
  PassThrough pass;
  LoadOptions options;
  options.pass_through = &pass;
  const absl::Status loaded = LoadHfModel(src, layout, state.master_fn(), options);
  EXPECT_TRUE(loaded.ok()) << loaded;
  return pass;
}

// Saves `state` with the pass-through tensors `pass` as checkpoint step 1 under root/out, exports it
// to root/export, and checks that both hold every pass-through tensor with its name, shape and bytes
// (read back with `config`). Returns the two directories (empty on a failure, reported).
inline std::vector<std::string> SaveAndExportKeepingPassThrough(const std::string& root, const ModelLayout& layout,
                                                                HostState& state, const PassThrough& pass,
                                                                const ModelConfig& config) {
  SaveRequest r;
  r.root_dir = root + "/out";
  r.step = 1;
  r.layout = &layout;
  r.arrays = state.arrays();
  r.trainer_state = {{"job_id", "j"}, {"step", 1}};
  r.pass_through = &pass;
  auto saved = SaveCheckpoint(r);
  EXPECT_TRUE(saved.ok()) << saved.status();
  if (!saved.ok()) return {};
  ExportRequest e;
  e.checkpoint = saved->dir;
  e.out_dir = root + "/export";
  auto exported = ExportModel(e);
  EXPECT_TRUE(exported.ok()) << exported.status();
  if (!exported.ok()) return {};
  for (const std::string& dir : {saved->dir, e.out_dir}) {
    auto again = ReadPassThrough(dir, config);
    EXPECT_TRUE(again.ok()) << again.status();
    if (!again.ok()) return {};
    EXPECT_EQ(again->size(), pass.size()) << dir;
    for (size_t i = 0; i < std::min(pass.size(), again->size()); ++i) {
      EXPECT_EQ((*again)[i].name, pass[i].name);
      EXPECT_EQ((*again)[i].shape, pass[i].shape);
      EXPECT_TRUE((*again)[i].bytes == pass[i].bytes) << dir << ": " << pass[i].name;
    }
  }
  return {saved->dir, e.out_dir};
}

}  // namespace slidedp::checkpoint::testing
