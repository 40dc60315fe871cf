// Checkpoints of compact Adam moments (optimizer.state_dtype fp32 | bf16 | int8): the file format,
// bitwise round trips per dtype, every conversion between dtypes against the kernels' own
// conversions (common/moments), today's fp32 files unchanged byte for byte, and hostile files (bad
// values, scales, tensors, metadata) refused with the right code before, or as, they land. A
// resumed job stepping on bitwise needs LayerAdam's kernels: hostd/update/tests/compact_resume_test.cc.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <random>

#include "absl/strings/match.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/tests/ckpt_test_util.h"
#include "common/moments/moments.h"
#include "gtest/gtest.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;
using namespace slidedp::checkpoint::testing;

constexpr MomentForm kAllDtypes[] = {MomentForm::kF32, MomentForm::kBF16, MomentForm::kInt8};
const moments::MomentCodecTable& Kernels() { return moments::ActiveMomentCodecs(); }

// Unit u's FP32 m and v for every state dtype: random, with the spread of real moments (several
// decades inside a block), an all-zero block, -0 and a subnormal.
void RandomFp32Moments(int64_t n, uint64_t seed, std::vector<float>& m, std::vector<float>& v) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> decades(-3.0f, 0.0f);
  m.assign(n, 0.0f);
  v.assign(n, 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float scale = std::pow(10.0f, decades(rng));
    m[i] = normal(rng) * 1e-4f * scale;
    v[i] = std::fabs(normal(rng)) * 1e-9f * scale * scale;
  }
  for (int64_t i = 256; i < std::min<int64_t>(n, 512); ++i) m[i] = v[i] = 0.0f;  // block 1 all zero
  if (n > 2) {
    m[0] = -0.0f;
    v[1] = 1e-42f;
  }
}

// A state of `dtype` whose moments are the kernels' encoding of RandomFp32Moments; master random.
void FillState(const ModelLayout& layout, HostState& s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (const UnitLayout& u : layout.units) {
    for (float& w : s.master[u.index]) w = normal(rng);
    std::vector<float> m, v;
    RandomFp32Moments(u.numel, seed * 1000 + u.index, m, v);
    const UnitMoments mo = s.moments(u.index);
    switch (s.dtype) {
      case MomentForm::kF32:
        s.m[u.index] = m;
        s.v[u.index] = v;
        break;
      case MomentForm::kBF16:
        Kernels().bf16_from_f32(m.data(), v.data(), {s.m16[u.index].data(), s.v16[u.index].data()}, u.numel);
        break;
      case MomentForm::kInt8:
        Kernels().int8_from_f32(m.data(), v.data(),
                                {static_cast<int8_t*>(mo.m), static_cast<uint8_t*>(mo.v), mo.m_scale, mo.v_scale},
                                u.numel);
        break;
    }
  }
}

// What the kernels make of unit u's moments in `from` when converted to `to` (through FP32).
std::string KernelConversion(HostState& from, int u, int64_t n, MomentForm to, const ModelLayout& layout) {
  std::vector<float> m(n), v(n);
  const UnitMoments in = from.moments(u);
  switch (from.dtype) {
    case MomentForm::kF32:
      m = from.m[u];
      v = from.v[u];
      break;
    case MomentForm::kBF16:
      Kernels().bf16_to_f32({from.m16[u].data(), from.v16[u].data()}, m.data(), v.data(), n);
      break;
    case MomentForm::kInt8:
      Kernels().int8_to_f32(
          {static_cast<const int8_t*>(in.m), static_cast<const uint8_t*>(in.v), in.m_scale, in.v_scale}, m.data(),
          v.data(), n);
      break;
  }
  HostState out(layout, to);
  const UnitMoments o = out.moments(u);
  switch (to) {
    case MomentForm::kF32:
      out.m[u] = m;
      out.v[u] = v;
      break;
    case MomentForm::kBF16:
      Kernels().bf16_from_f32(m.data(), v.data(), {out.m16[u].data(), out.v16[u].data()}, n);
      break;
    case MomentForm::kInt8:
      Kernels().int8_from_f32(m.data(), v.data(),
                              {static_cast<int8_t*>(o.m), static_cast<uint8_t*>(o.v), o.m_scale, o.v_scale}, n);
      break;
  }
  return out.MomentBytes(u);
}

// Awkward sizes: the embedding is one load piece (2^22 elements) plus a tail, and grown by 37
// elements of padding, so the last int8 block is partial and a conversion runs ~65 steps.
ModelLayout LargeAwkwardLayout() {
  ModelConfig c = TinyConfig(true);
  c.vocab_size = 33000;
  c.hidden_size = 128;
  ModelLayout layout = ModelLayout::Build(c);
  layout.units[0].numel += 37;
  return layout;
}

std::string FileBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

uint64_t Fnv1a64(const std::string& bytes) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : bytes) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// Rewrites optimizer.safetensors of checkpoint `dir` through `edit` (its tensors, their bytes and
// the metadata) and records the new size in COMPLETE, so VerifyCheckpoint still passes and the
// loader itself has to notice what was changed.
struct EditableTensor {
  std::string name;
  st::Dtype dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};
void RewriteOptimizer(
    const std::string& dir,
    const std::function<void(std::vector<EditableTensor>&, std::map<std::string, std::string>&)>& edit) {
  const std::string path = dir + "/optimizer.safetensors";
  std::vector<EditableTensor> tensors;
  std::map<std::string, std::string> metadata;
  {
    auto f = st::SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    for (const st::TensorInfo& t : (*f)->tensors()) {
      tensors.push_back({t.name, t.dtype, t.shape, std::string((*f)->Bytes(t))});
    }
    metadata = (*f)->metadata();
  }
  edit(tensors, metadata);
  std::vector<st::TensorSource> src;
  for (const EditableTensor& t : tensors) src.push_back({t.name, t.dtype, t.shape, t.bytes.data(), nullptr});
  st::WriteOptions opts;
  opts.metadata = metadata;
  opts.durability = st::Durability::kNone;
  ASSERT_TRUE(st::WriteFile(path, src, opts).ok());
  nlohmann::json complete = nlohmann::json::parse(std::ifstream(dir + "/COMPLETE"));
  complete["files"]["optimizer.safetensors"] = fs::file_size(path);
  std::ofstream(dir + "/COMPLETE", std::ios::trunc) << complete.dump();
}

// Overwrites `len` bytes of tensor `name` at byte `offset` within it (file size unchanged).
void PatchTensorBytes(const std::string& path, const std::string& name, uint64_t offset, const void* data, size_t len) {
  uint64_t at = 0;
  {
    auto f = st::SafetensorsFile::Open(path);
    ASSERT_TRUE(f.ok()) << f.status();
    const st::TensorInfo* t = (*f)->Find(name);
    ASSERT_NE(t, nullptr) << name;
    ASSERT_LE(offset + len, t->byte_size());
    uint64_t header = 0;
    std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(&header), 8);
    at = 8 + header + t->data_begin + offset;
  }
  std::fstream out(path, std::ios::in | std::ios::out | std::ios::binary);
  out.seekp(static_cast<std::streamoff>(at));
  out.write(static_cast<const char*>(data), static_cast<std::streamsize>(len));
  ASSERT_TRUE(out.good());
}

class CkptMomentsTest : public CheckpointRootTest {};

// The documented tensors: names, dtypes, shapes, and state_dtype in the metadata (absent: fp32).
TEST_F(CkptMomentsTest, FileHoldsTheMomentsInTheirOwnDtype) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  for (MomentForm dtype : kAllDtypes) {
    SCOPED_TRACE(ToString(dtype));
    HostState s(layout, dtype);
    FillState(layout, s, 3);
    const std::string dir = Save(layout, s, 1);
    auto f = st::SafetensorsFile::Open(dir + "/optimizer.safetensors");
    ASSERT_TRUE(f.ok()) << f.status();
    const auto& meta = (*f)->metadata();
    if (dtype == MomentForm::kF32) {
      EXPECT_EQ(meta.count("state_dtype"), 0u);
    } else {
      EXPECT_EQ(meta.at("state_dtype"), ToString(dtype));
    }
    const st::Dtype m_dtype = dtype == MomentForm::kF32    ? st::Dtype::kF32
                              : dtype == MomentForm::kBF16 ? st::Dtype::kBF16
                                                           : st::Dtype::kI8;
    const st::Dtype v_dtype = dtype == MomentForm::kInt8 ? st::Dtype::kU8 : m_dtype;
    size_t expected_tensors = 0;
    for (const UnitLayout& u : layout.units) {
      const std::string p = "unit." + u.name + ".";
      const auto* master = (*f)->Find(p + "master");
      const auto* m = (*f)->Find(p + "adam_m");
      const auto* v = (*f)->Find(p + "adam_v");
      ASSERT_TRUE(master && m && v) << u.name;
      EXPECT_EQ(master->dtype, st::Dtype::kF32);
      EXPECT_EQ(m->dtype, m_dtype);
      EXPECT_EQ(v->dtype, v_dtype);
      EXPECT_EQ(m->shape, std::vector<int64_t>{u.numel});
      EXPECT_EQ(v->shape, std::vector<int64_t>{u.numel});
      const std::string mo = s.MomentBytes(u.index);
      EXPECT_TRUE(SameBytes(std::string((*f)->Bytes(*m)) + std::string((*f)->Bytes(*v)),
                            mo.substr(0, m->byte_size() + v->byte_size())));
      expected_tensors += 3;
      const auto* ms = (*f)->Find(p + "adam_m_scale");
      const auto* vs = (*f)->Find(p + "adam_v_scale");
      if (dtype == MomentForm::kInt8) {
        ASSERT_TRUE(ms && vs) << u.name;
        EXPECT_EQ(ms->dtype, st::Dtype::kF32);
        EXPECT_EQ(ms->shape, std::vector<int64_t>{Int8MomentBlocks(u.numel)});
        EXPECT_EQ(vs->shape, std::vector<int64_t>{Int8MomentBlocks(u.numel)});
        EXPECT_EQ(0, std::memcmp((*f)->Bytes(*ms).data(), s.m_scale[u.index].data(), ms->byte_size()));
        EXPECT_EQ(0, std::memcmp((*f)->Bytes(*vs).data(), s.v_scale[u.index].data(), vs->byte_size()));
        expected_tensors += 2;
      } else {
        EXPECT_TRUE(ms == nullptr && vs == nullptr);
      }
    }
    EXPECT_EQ((*f)->tensors().size(), expected_tensors);
    fs::remove_all(dir);
  }
}

// Same dtype: master, codes and scales come back bit for bit (several pieces, a partial block).
TEST_F(CkptMomentsTest, RoundTripIsBitwisePerDtype) {
  const ModelLayout layout = LargeAwkwardLayout();
  for (MomentForm dtype : kAllDtypes) {
    SCOPED_TRACE(ToString(dtype));
    HostState saved(layout, dtype);
    FillState(layout, saved, 5);
    const std::string dir = Save(layout, saved, 2, /*io_threads=*/3);
    HostState loaded(layout, dtype);
    auto lc = LoadCheckpoint(dir, layout, loaded.arrays(), {.threads = 3});
    ASSERT_TRUE(lc.ok()) << lc.status();
    EXPECT_EQ(lc->saved_moment_form, dtype);
    EXPECT_EQ(lc->conversion_note, "");
    EXPECT_TRUE(SameBytes(StateBytes(loaded), StateBytes(saved)));
    fs::remove_all(dir);
  }
}

// Every pair of dtypes: the loaded moments are exactly the kernels' conversion of the saved ones
// (decoder, then encoder), master untouched, and the note says what happened.
TEST_F(CkptMomentsTest, EveryConversionIsTheKernelsConversion) {
  const ModelLayout layout = LargeAwkwardLayout();
  for (MomentForm from : kAllDtypes) {
    HostState saved(layout, from);
    FillState(layout, saved, 6);
    const std::string dir = Save(layout, saved, 3);
    for (MomentForm to : kAllDtypes) {
      if (to == from) continue;
      SCOPED_TRACE(absl::StrCat(ToString(from), " -> ", ToString(to)));
      HostState loaded(layout, to);
      auto lc = LoadCheckpoint(dir, layout, loaded.arrays(), {.threads = 3});
      ASSERT_TRUE(lc.ok()) << lc.status();
      EXPECT_EQ(lc->saved_moment_form, from);
      EXPECT_TRUE(absl::StrContains(
          lc->conversion_note, absl::StrCat("optimizer state converted from ", ToString(from), " to ", ToString(to))))
          << lc->conversion_note;
      EXPECT_EQ(absl::StrContains(lc->conversion_note, "an approximation"), to != MomentForm::kF32);
      for (const UnitLayout& u : layout.units) {
        ASSERT_EQ(0, std::memcmp(loaded.master[u.index].data(), saved.master[u.index].data(), u.numel * 4)) << u.name;
        ASSERT_TRUE(SameBytes(loaded.MomentBytes(u.index), KernelConversion(saved, u.index, u.numel, to, layout)))
            << u.name;
      }
    }
    fs::remove_all(dir);
  }
  // The note fp32 -> int8 reads as the job log will show it.
  HostState fp32(layout, MomentForm::kF32), int8(layout, MomentForm::kInt8);
  FillState(layout, fp32, 7);
  auto lc = LoadCheckpoint(Save(layout, fp32, 4), layout, int8.arrays());
  ASSERT_TRUE(lc.ok()) << lc.status();
  EXPECT_EQ(lc->conversion_note,
            "optimizer state converted from fp32 to int8 (block-quantized moments: an approximation)");
}

// An fp32 job writes exactly the bytes the code before compact moments wrote (digest of the file
// the pre-issue-21 code, commit b46b887, saved for this state), so today's checkpoints are these
// files; they load bitwise into fp32 and convert into the compact dtypes.
TEST_F(CkptMomentsTest, Fp32FilesAreTodaysFormatAndLoad) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  HostState s(layout, MomentForm::kF32);
  for (const UnitLayout& u : layout.units) {
    for (int64_t i = 0; i < u.numel; ++i) {
      s.master[u.index][i] = static_cast<float>(static_cast<int>((u.index * 7919 + i * 31) % 2001) - 1000) / 4096.0f;
      s.m[u.index][i] = static_cast<float>(static_cast<int>((u.index * 104729 + i * 17) % 2001) - 1000) * 1e-6f;
      s.v[u.index][i] = static_cast<float>((u.index * 13 + i * 29) % 1000) * 1e-9f;
    }
  }
  SaveRequest r;
  r.root_dir = root_;
  r.step = 7;
  r.layout = &layout;
  r.arrays.master = s.master_fn();
  r.arrays.moments = Fp32Moments([&](int u) { return s.m[u].data(); }, [&](int u) { return s.v[u].data(); });
  r.trainer_state = {{"job_id", "golden"}};
  auto res = SaveCheckpoint(r);
  ASSERT_TRUE(res.ok()) << res.status();
  const std::string bytes = FileBytes(res->dir + "/optimizer.safetensors");
  EXPECT_EQ(bytes.size(), 804344u);
  EXPECT_EQ(Fnv1a64(bytes), 0x32ddbbba166ccf05ull);

  HostState back(layout, MomentForm::kF32);
  auto lc = LoadCheckpoint(res->dir, layout, back.arrays());
  ASSERT_TRUE(lc.ok()) << lc.status();
  EXPECT_EQ(lc->saved_moment_form, MomentForm::kF32);
  EXPECT_TRUE(SameBytes(StateBytes(back), StateBytes(s)));
  for (MomentForm to : {MomentForm::kBF16, MomentForm::kInt8}) {
    HostState compact(layout, to);
    ASSERT_TRUE(LoadCheckpoint(res->dir, layout, compact.arrays()).ok());
    for (const UnitLayout& u : layout.units) {
      ASSERT_TRUE(SameBytes(compact.MomentBytes(u.index), KernelConversion(s, u.index, u.numel, to, layout)));
    }
  }
}

// Bad values in a compact file are DATA_LOSS naming the file, the tensor and the element or
// block, whether the load copies (same dtype) or converts (into fp32).
TEST_F(CkptMomentsTest, BadCompactValuesAreDataLossNamingTheTensor) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  const UnitLayout& layer = layout.units[2];
  const std::string p = "unit." + layer.name + ".";
  const TensorSlot& down = layer.tensors[kDownProj];
  struct Case {
    MomentForm dtype;
    std::string tensor;
    uint64_t byte_offset;
    std::vector<char> bytes;
    std::string what;  // in the message
  };
  auto f32 = [](float x) {
    std::vector<char> b(4);
    std::memcpy(b.data(), &x, 4);
    return b;
  };
  auto b16 = [](float x) {
    const bf16_t h = FloatToBf16(x);
    std::vector<char> b(2);
    std::memcpy(b.data(), &h, 2);
    return b;
  };
  const int64_t block = 3;
  const std::vector<Case> cases = {
      {MomentForm::kInt8, "adam_m_scale", block * 4, f32(std::nanf("")), "holds nan at block 3 (elements 768..1023"},
      {MomentForm::kInt8, "adam_v_scale", block * 4, f32(std::numeric_limits<float>::infinity()), "at block 3"},
      {MomentForm::kInt8, "adam_m_scale", 0, f32(-1e-3f), "int8 block scales must be finite and >= 0"},
      {MomentForm::kInt8,
       "adam_m",
       static_cast<uint64_t>(down.offset_numel + 5),
       {static_cast<char>(0x80)},
       "code -128 at element " + std::to_string(down.offset_numel + 5) + " (" + down.hf_name + "[0, 5])"},
      {MomentForm::kBF16, "adam_m", 2 * 7, b16(std::numeric_limits<float>::infinity()), "holds inf at element 7"},
      {MomentForm::kBF16, "adam_v", 2 * static_cast<uint64_t>(down.offset_numel), b16(-1e-9f),
       "second moment must be >= 0"},
      {MomentForm::kBF16, "adam_v", 2 * static_cast<uint64_t>(layer.tensors[kInputNorm].numel), b16(std::nanf("")),
       "the padding after"},
  };
  for (const Case& k : cases) {
    for (MomentForm into : {k.dtype, MomentForm::kF32}) {
      SCOPED_TRACE(k.tensor + " " + ToString(k.dtype) + " into " + ToString(into));
      HostState s(layout, k.dtype);
      FillState(layout, s, 21);
      const std::string dir = Save(layout, s, 5);
      const std::string file = dir + "/optimizer.safetensors";
      PatchTensorBytes(file, p + k.tensor, k.byte_offset, k.bytes.data(), k.bytes.size());
      HostState loaded(layout, into);
      auto lc = LoadCheckpoint(dir, layout, loaded.arrays(), {.threads = 2});
      EXPECT_EQ(lc.status().code(), absl::StatusCode::kDataLoss) << lc.status();
      EXPECT_TRUE(absl::StrContains(lc.status().message(), file)) << lc.status();
      EXPECT_TRUE(absl::StrContains(lc.status().message(), "\"" + p + k.tensor + "\"")) << lc.status();
      EXPECT_TRUE(absl::StrContains(lc.status().message(), k.what)) << lc.status();
      fs::remove_all(dir);
    }
  }
}

// A file whose tensors are missing, misshaped or of another dtype than its metadata says (or
// whose metadata names no known dtype) is DATA_LOSS before a single byte of the state is written.
TEST_F(CkptMomentsTest, LyingTensorsAndMetadataAreDataLossAndWriteNothing) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  const std::string p = "unit." + layout.units[1].name + ".";
  const std::string p0 = "unit." + layout.units[0].name + ".", n0 = std::to_string(layout.units[0].numel);
  using Tensors = std::vector<EditableTensor>;
  using Meta = std::map<std::string, std::string>;
  struct Case {
    std::string name;
    MomentForm saved;
    std::function<void(Tensors&, Meta&)> edit;
    std::string what;
  };
  auto drop = [](Tensors& ts, const std::string& name) {
    ts.erase(std::remove_if(ts.begin(), ts.end(), [&](const EditableTensor& t) { return t.name == name; }), ts.end());
  };
  auto find = [](Tensors& ts, const std::string& name) -> EditableTensor& {
    for (EditableTensor& t : ts)
      if (t.name == name) return t;
    ADD_FAILURE() << name;
    return ts.front();
  };
  const std::vector<Case> cases = {
      {"missing v scale", MomentForm::kInt8, [&](Tensors& ts, Meta&) { drop(ts, p + "adam_v_scale"); },
       "\"" + p + "adam_v_scale\" is missing (state_dtype int8 stores F32 ["},
      {"short m scale", MomentForm::kInt8,
       [&](Tensors& ts, Meta&) {
         EditableTensor& t = find(ts, p + "adam_m_scale");
         t.shape[0] -= 1;
         t.bytes.resize(t.bytes.size() - 4);
       },
       "\"" + p + "adam_m_scale\" is F32 ["},
      {"short codes", MomentForm::kInt8,
       [&](Tensors& ts, Meta&) {
         EditableTensor& t = find(ts, p + "adam_v");
         t.shape[0] -= 256;
         t.bytes.resize(t.bytes.size() - 256);
       },
       "\"" + p + "adam_v\" is U8 ["},
      {"int8 file claiming fp32", MomentForm::kInt8, [&](Tensors&, Meta& m) { m.erase("state_dtype"); },
       "\"" + p0 + "adam_m\" is I8 [" + n0 + "], but state_dtype fp32 stores F32 [" + n0 + "] there"},
      {"int8 file claiming bf16", MomentForm::kInt8, [&](Tensors&, Meta& m) { m["state_dtype"] = "bf16"; },
       "\"" + p0 + "adam_m\" is I8 [" + n0 + "], but state_dtype bf16 stores BF16"},
      {"fp32 file claiming int8", MomentForm::kF32, [&](Tensors&, Meta& m) { m["state_dtype"] = "int8"; },
       "\"" + p0 + "adam_m\" is F32 [" + n0 + "], but state_dtype int8 stores I8"},
      {"unknown dtype", MomentForm::kBF16, [&](Tensors&, Meta& m) { m["state_dtype"] = "fp8"; },
       "state_dtype \"fp8\" is not fp32, bf16 or int8"},
      {"bf16 file with scales", MomentForm::kBF16,
       [&](Tensors& ts, Meta&) {
         ts.push_back({p + "adam_m_scale", st::Dtype::kF32, {1}, std::string(4, '\0')});
       },
       "holds int8 block scales for unit " + layout.units[1].name + " but its state_dtype is bf16"},
      {"moment of the wrong dtype", MomentForm::kBF16,
       [&](Tensors& ts, Meta&) { find(ts, p + "adam_m").dtype = st::Dtype::kF16; }, "\"" + p + "adam_m\" is F16"},
  };
  for (const Case& k : cases) {
    for (MomentForm into : kAllDtypes) {
      SCOPED_TRACE(k.name + " into " + ToString(into));
      HostState s(layout, k.saved);
      FillState(layout, s, 31);
      const std::string dir = Save(layout, s, 6);
      RewriteOptimizer(dir, k.edit);
      ASSERT_TRUE(VerifyCheckpoint(dir).ok());
      HostState loaded(layout, into);
      FillState(layout, loaded, 32);  // a sentinel: a refused load must leave it as it was
      const std::string before = StateBytes(loaded);
      auto lc = LoadCheckpoint(dir, layout, loaded.arrays());
      EXPECT_EQ(lc.status().code(), absl::StatusCode::kDataLoss) << lc.status();
      EXPECT_TRUE(absl::StrContains(lc.status().message(), dir + "/optimizer.safetensors")) << lc.status();
      EXPECT_TRUE(absl::StrContains(lc.status().message(), k.what)) << lc.status();
      EXPECT_TRUE(SameBytes(StateBytes(loaded), before)) << "the refused load wrote into the state";
      fs::remove_all(dir);
    }
  }
}

// A hostile header that misaligns every tensor (a 1-byte tensor first) still loads the right
// values: the loader reads the mapping through memcpy only.
TEST_F(CkptMomentsTest, MisalignedTensorsLoad) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  for (MomentForm dtype : kAllDtypes) {
    SCOPED_TRACE(ToString(dtype));
    HostState s(layout, dtype);
    FillState(layout, s, 41);
    const std::string dir = Save(layout, s, 8);
    RewriteOptimizer(dir, [](std::vector<EditableTensor>& ts, std::map<std::string, std::string>&) {
      ts.insert(ts.begin(), {"padding", st::Dtype::kU8, {1}, std::string(1, '\x7f')});
    });
    for (MomentForm into : kAllDtypes) {
      HostState loaded(layout, into);
      auto lc = LoadCheckpoint(dir, layout, loaded.arrays());
      ASSERT_TRUE(lc.ok()) << lc.status();
      for (const UnitLayout& u : layout.units) {
        ASSERT_TRUE(SameBytes(loaded.MomentBytes(u.index), KernelConversion(s, u.index, u.numel, into, layout)));
      }
    }
    fs::remove_all(dir);
  }
}

// Values fine in the file's dtype that the job's dtype cannot hold are FAILED_PRECONDITION, naming
// what to resume with: +inf v (a valid FP32/BF16 second moment) poisons an int8 block; an m
// beyond BF16's range rounds to inf.
TEST_F(CkptMomentsTest, ConvertedValuesTheJobCannotHoldAreFailedPrecondition) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(false));
  const UnitLayout& layer = layout.units[1];
  HostState s(layout, MomentForm::kF32);
  FillState(layout, s, 51);
  s.v[layer.index][600] = std::numeric_limits<float>::infinity();
  s.m[layer.index][700] = 3.4e38f;
  const std::string dir = Save(layout, s, 9);
  {
    HostState int8(layout, MomentForm::kInt8);
    auto lc = LoadCheckpoint(dir, layout, int8.arrays());
    EXPECT_EQ(lc.status().code(), absl::StatusCode::kFailedPrecondition) << lc.status();
    EXPECT_TRUE(
        absl::StrContains(lc.status().message(), "\"unit." + layer.name + ".adam_v_scale\" that holds nan at block 2"))
        << lc.status();
    EXPECT_TRUE(absl::StrContains(lc.status().message(), "resume this checkpoint with optimizer.state_dtype fp32"))
        << lc.status();
  }
  {
    HostState bf16(layout, MomentForm::kBF16);
    auto lc = LoadCheckpoint(dir, layout, bf16.arrays());
    EXPECT_EQ(lc.status().code(), absl::StatusCode::kFailedPrecondition) << lc.status();
    EXPECT_TRUE(
        absl::StrContains(lc.status().message(), "\"unit." + layer.name + ".adam_m\" that holds inf at element 700"))
        << lc.status();
  }
  s.m[layer.index][700] = 1.0f;  // +inf v alone is a BF16 second moment as it is an FP32 one
  HostState bf16(layout, MomentForm::kBF16);
  auto lc = LoadCheckpoint(Save(layout, s, 10), layout, bf16.arrays());
  ASSERT_TRUE(lc.ok()) << lc.status();
  EXPECT_EQ(Bf16ToFloat(bf16.v16[layer.index][600]), std::numeric_limits<float>::infinity());
}

// Arrays the state dtype needs but the accessor lacks (a compact job's m(u) is nullptr) are
// INVALID_ARGUMENT for both save and load, before anything is written.
TEST_F(CkptMomentsTest, MissingArraysAreInvalidArgument) {
  const ModelLayout layout = ModelLayout::Build(TinyConfig(true));
  HostState s(layout, MomentForm::kInt8);
  FillState(layout, s, 61);
  const std::string dir = Save(layout, s, 1);
  StateArrays no_scales = s.arrays();
  no_scales.moments = [&](int u) {
    UnitMoments mo = s.moments(u);
    mo.v_scale = nullptr;
    return mo;
  };
  SaveRequest r;
  r.root_dir = root_;
  r.step = 2;
  r.layout = &layout;
  r.arrays = no_scales;
  EXPECT_EQ(SaveCheckpoint(r).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_FALSE(fs::exists(root_ + "/checkpoint-2"));
  EXPECT_EQ(LoadCheckpoint(dir, layout, no_scales).status().code(), absl::StatusCode::kInvalidArgument);
  StateArrays fp32_view = s.arrays();  // what JobState::m(u)/v(u) give a compact job
  fp32_view.moment_form = MomentForm::kF32;
  fp32_view.moments = [](int) { return UnitMoments{}; };
  r.arrays = fp32_view;
  EXPECT_EQ(SaveCheckpoint(r).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadCheckpoint(dir, layout, fp32_view).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp::checkpoint
