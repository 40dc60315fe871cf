// LoadCheckpoint: a checkpoint's optimizer state back into a job's arrays (master, and the Adam
// moments converted to the job's state dtype where it keeps another). The on-disk layout is
// described in checkpoint.h.
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <optional>
#include <sstream>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/checkpoint_files.h"
#include "common/io/small_file.h"
#include "common/moments/moments.h"
#include "common/numeric/bf16.h"
#include "common/numeric/finite.h"
#include "common/parallel/parallel_for.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
namespace st = safetensors;
using internal::FileDtypeOfM;
using internal::FileDtypeOfV;
using internal::HasMomentArrays;
using internal::IsKnownMomentForm;
using internal::kFormat;
using internal::kStateDtypeKey;
using internal::LayoutSignature;
using internal::MomentElementBytes;
using internal::ReadJsonObject;
using internal::StateTensorName;
constexpr int64_t kBlock = kInt8MomentBlock;

// ---- LoadCheckpoint's parts ----

// Elements per task of a load (a multiple of the int8 block, so tasks never split one), and per
// conversion step inside a task: a conversion stages that many elements in FP32 (2 x 256 KiB
// per thread), whatever the model's size.
constexpr int64_t kLoadPieceNumel = int64_t{1} << 22;
constexpr int64_t kConvertNumel = int64_t{1} << 16;
static_assert(kLoadPieceNumel % kBlock == 0 && kConvertNumel % kBlock == 0 && kLoadPieceNumel % kConvertNumel == 0);

// A read-only range of moments in some dtype: element 0 at a block boundary (scales from its
// block 0). Only ever points at aligned memory (the job's arrays or ConvertBuffers): the file
// mapping is read through memcpy (CopyRaw), since a hostile header may misalign any tensor.
struct MomentsView {
  const void* m = nullptr;
  const void* v = nullptr;
  const float* m_scale = nullptr;
  const float* v_scale = nullptr;
};

MomentsView ReadOnly(const UnitMoments& mo) { return {mo.m, mo.v, mo.m_scale, mo.v_scale}; }

// The range of dtype-d moments `offset` elements (a multiple of the int8 block) into `mo`.
UnitMoments MomentsAt(MomentForm d, const UnitMoments& mo, int64_t offset) {
  const size_t eb = MomentElementBytes(d);
  UnitMoments at{static_cast<char*>(mo.m) + offset * eb, static_cast<char*>(mo.v) + offset * eb, nullptr, nullptr};
  if (d == MomentForm::kInt8) {
    at.m_scale = mo.m_scale + offset / kBlock;
    at.v_scale = mo.v_scale + offset / kBlock;
  }
  return at;
}

// The first value of n moments (from element `first` of the unit) that a job must not train on.
struct BadValue {
  const char* kind;   // "adam_m", "adam_v", "adam_m_scale", "adam_v_scale"
  int64_t index;      // element of the unit; block of the unit for a scale
  std::string value;  // as printed
  const char* rule;
};

std::string FloatText(float x) { return absl::StrCat(x); }

constexpr char kRuleFinite[] = "the state must be finite";
constexpr char kRuleSecondMoment[] = "Adam's second moment must be >= 0 and not NaN";
constexpr char kRuleScale[] = "int8 block scales must be finite and >= 0";
constexpr char kRuleMCode[] = "int8 m codes are in [-127, 127]";

// The first i in [0, n) with bad(x[i]), or -1: branch-free over blocks of 64 (so it vectorizes),
// then element by element inside the block that holds one (as FirstNonFinite does).
template <typename T, typename Bad>
int64_t FirstWhere(const T* x, int64_t n, Bad bad) {
  constexpr int64_t kScan = 64;
  int64_t i = 0;
  for (; i + kScan <= n; i += kScan) {
    uint32_t any = 0;
    for (int64_t k = 0; k < kScan; ++k) any |= static_cast<uint32_t>(bad(x[i + k]));
    if (any != 0) break;
  }
  for (; i < n; ++i) {
    if (bad(x[i])) return i;
  }
  return -1;
}

// Checks n elements of `view` (dtype d) starting at unit element `first` (a block boundary).
// The rules: m finite, v not NaN and >= 0 (+inf is what a huge finite gradient makes of it, as in
// PyTorch), int8 scales finite and >= 0 (a NaN scale is a block the kernel poisoned), int8 m codes
// not -128 (the encoder never writes it; it would decode beyond the block's maximum).
std::optional<BadValue> FirstBadMoment(MomentForm d, const MomentsView& view, int64_t first, int64_t n) {
  switch (d) {
    case MomentForm::kF32: {
      const float* m = static_cast<const float*>(view.m);
      const float* v = static_cast<const float*>(view.v);
      if (int64_t i = FirstNonFinite(m, n, FiniteRule::kFinite); i >= 0) {
        return BadValue{"adam_m", first + i, FloatText(m[i]), kRuleFinite};
      }
      if (int64_t i = FirstNonFinite(v, n, FiniteRule::kSecondMoment); i >= 0) {
        return BadValue{"adam_v", first + i, FloatText(v[i]), kRuleSecondMoment};
      }
      return std::nullopt;
    }
    case MomentForm::kBF16: {
      // The FP32 rules on the upper 16 bits: non-finite is an all-ones exponent; NaN or negative
      // (but not -0) is above +inf's bits.
      const bf16_t* m = static_cast<const bf16_t*>(view.m);
      const bf16_t* v = static_cast<const bf16_t*>(view.v);
      if (int64_t i = FirstWhere(m, n, [](bf16_t b) { return (b & 0x7fffu) >= 0x7f80u; }); i >= 0) {
        return BadValue{"adam_m", first + i, FloatText(Bf16ToFloat(m[i])), kRuleFinite};
      }
      if (int64_t i = FirstWhere(v, n, [](bf16_t b) { return b > 0x7f80u && b != 0x8000u; }); i >= 0) {
        return BadValue{"adam_v", first + i, FloatText(Bf16ToFloat(v[i])), kRuleSecondMoment};
      }
      return std::nullopt;
    }
    case MomentForm::kInt8: {
      const int64_t blocks = Int8MomentBlocks(n);
      const float* scales[] = {view.m_scale, view.v_scale};
      const char* kinds[] = {"adam_m_scale", "adam_v_scale"};
      for (int k = 0; k < 2; ++k) {
        for (int64_t b = 0; b < blocks; ++b) {
          const float x = scales[k][b];
          if (BreaksFiniteRule(x, FiniteRule::kFinite) || BreaksFiniteRule(x, FiniteRule::kSecondMoment)) {
            return BadValue{kinds[k], first / kBlock + b, FloatText(x), kRuleScale};
          }
        }
      }
      const int8_t* m = static_cast<const int8_t*>(view.m);
      if (int64_t i = FirstWhere(m, n, [](int8_t c) { return c == INT8_MIN; }); i >= 0) {
        return BadValue{"adam_m", first + i, "code -128", kRuleMCode};
      }
      return std::nullopt;  // every uint8 v code is valid
    }
  }
  return std::nullopt;
}

// "holds nan at element 5 (layers.0.mlp.down_proj.weight[0, 5]); the state must be finite", or
// for a scale "... at block 3 (elements 768..1023 from layers.0...[..])".
std::string DescribeBadValue(const UnitLayout& unit, const BadValue& bad) {
  const bool scale = absl::EndsWith(bad.kind, "_scale");
  const std::string where = scale
                                ? absl::StrCat("block ", bad.index, " (elements ", bad.index * kBlock, "..",
                                               std::min(unit.numel, (bad.index + 1) * kBlock) - 1, " from ",
                                               DescribeUnitElement(unit, bad.index * kBlock), ")")
                                : absl::StrCat("element ", bad.index, " (", DescribeUnitElement(unit, bad.index), ")");
  return absl::StrCat("holds ", bad.value, " at ", where, "; ", bad.rule);
}

// One unit's tensors in the file, checked before anything is written.
struct UnitSource {
  const UnitLayout* unit = nullptr;
  const st::TensorInfo* master = nullptr;
  const st::TensorInfo* m = nullptr;
  const st::TensorInfo* v = nullptr;
  const st::TensorInfo* m_scale = nullptr;  // int8 only
  const st::TensorInfo* v_scale = nullptr;
  float* master_dst = nullptr;
  UnitMoments dst;
};

std::string ShapeText(const std::vector<int64_t>& shape) { return absl::StrCat("[", absl::StrJoin(shape, ", "), "]"); }

// The tensor `name` as `dtype` [numel]; DATA_LOSS naming what the file has instead (and the
// file's state dtype, for the moments: a header whose metadata and tensors disagree).
absl::StatusOr<const st::TensorInfo*> FindStateTensor(const st::SafetensorsFile& file, const std::string& name,
                                                      st::Dtype dtype, int64_t numel, MomentForm saved) {
  const st::TensorInfo* t = file.Find(name);
  if (t != nullptr && t->dtype == dtype && t->shape == std::vector<int64_t>{numel}) return t;
  const std::string expected =
      absl::StrCat("state_dtype ", ToString(saved), " stores ", st::DtypeName(dtype), " [", numel, "] there");
  if (t == nullptr)
    return absl::DataLossError(absl::StrCat(file.path(), ": tensor \"", name, "\" is missing (", expected, ")"));
  return absl::DataLossError(absl::StrCat(file.path(), ": tensor \"", name, "\" is ", st::DtypeName(t->dtype), " ",
                                          ShapeText(t->shape), ", but ", expected));
}

absl::StatusOr<MomentForm> SavedMomentForm(const st::SafetensorsFile& file) {
  auto it = file.metadata().find(kStateDtypeKey);
  if (it == file.metadata().end()) return MomentForm::kF32;  // every checkpoint before compact moments
  absl::StatusOr<MomentForm> d = ParseMomentForm(it->second);
  if (!d.ok()) {
    return absl::DataLossError(absl::StrCat(file.path(), ": __metadata__ ", kStateDtypeKey, " \"", it->second,
                                            "\" is not fp32, bf16 or int8"));
  }
  return *d;
}

absl::StatusOr<UnitSource> CheckUnitSource(const st::SafetensorsFile& file, const UnitLayout& unit, MomentForm saved,
                                           const StateArrays& arrays) {
  UnitSource src;
  src.unit = &unit;
  const int64_t n = unit.numel;
  ASSIGN_OR_RETURN(src.master, FindStateTensor(file, StateTensorName(unit, "master"), st::Dtype::kF32, n, saved));
  ASSIGN_OR_RETURN(src.m, FindStateTensor(file, StateTensorName(unit, "adam_m"), FileDtypeOfM(saved), n, saved));
  ASSIGN_OR_RETURN(src.v, FindStateTensor(file, StateTensorName(unit, "adam_v"), FileDtypeOfV(saved), n, saved));
  const std::string m_scale = StateTensorName(unit, "adam_m_scale"), v_scale = StateTensorName(unit, "adam_v_scale");
  if (saved == MomentForm::kInt8) {
    const int64_t blocks = Int8MomentBlocks(n);
    ASSIGN_OR_RETURN(src.m_scale, FindStateTensor(file, m_scale, st::Dtype::kF32, blocks, saved));
    ASSIGN_OR_RETURN(src.v_scale, FindStateTensor(file, v_scale, st::Dtype::kF32, blocks, saved));
  } else if (file.Find(m_scale) != nullptr || file.Find(v_scale) != nullptr) {
    return absl::DataLossError(absl::StrCat(file.path(), ": holds int8 block scales for unit ", unit.name, " but its ",
                                            kStateDtypeKey, " is ", ToString(saved)));
  }
  src.master_dst = arrays.master(unit.index);
  src.dst = arrays.moments(unit.index);
  if (src.master_dst == nullptr || !HasMomentArrays(arrays.moment_form, src.dst)) {
    return absl::InvalidArgumentError(absl::StrCat("LoadCheckpoint: unit ", unit.name, " lacks its master or ",
                                                   ToString(arrays.moment_form), " moment arrays"));
  }
  return src;
}

// Copies `bytes` bytes of tensor t from byte `offset` (bounds: the caller's ranges lie inside the
// tensor, whose size the header check tied to its shape).
void CopyRaw(const st::SafetensorsFile& file, const st::TensorInfo* t, uint64_t offset, uint64_t bytes, void* dst) {
  std::memcpy(dst, file.Bytes(*t).data() + offset, bytes);
}

// The moments [begin, begin + n) of the file (dtype `saved`) copied raw into `out` (buffers or
// the job's arrays, laid out for `saved`, element 0 = element `begin`).
void CopyMoments(const st::SafetensorsFile& file, const UnitSource& src, MomentForm saved, int64_t begin, int64_t n,
                 const UnitMoments& out) {
  const size_t eb = MomentElementBytes(saved);
  CopyRaw(file, src.m, begin * eb, n * eb, out.m);
  CopyRaw(file, src.v, begin * eb, n * eb, out.v);
  if (saved == MomentForm::kInt8) {
    const uint64_t blocks = Int8MomentBlocks(n);
    CopyRaw(file, src.m_scale, begin / kBlock * sizeof(float), blocks * sizeof(float), out.m_scale);
    CopyRaw(file, src.v_scale, begin / kBlock * sizeof(float), blocks * sizeof(float), out.v_scale);
  }
}

// Per-task buffers of a conversion: the file's moments raw (float storage keeps every view
// aligned for its dtype), then widened to FP32.
struct ConvertBuffers {
  explicit ConvertBuffers(MomentForm saved)
      : m_raw(RawFloats(saved)),
        v_raw(RawFloats(saved)),
        m_scale(kConvertNumel / kBlock),
        v_scale(kConvertNumel / kBlock),
        m(kConvertNumel),
        v(kConvertNumel) {}
  static size_t RawFloats(MomentForm d) { return (kConvertNumel * MomentElementBytes(d) + 3) / 4; }
  UnitMoments raw() { return {m_raw.data(), v_raw.data(), m_scale.data(), v_scale.data()}; }
  std::vector<float> m_raw, v_raw, m_scale, v_scale, m, v;
};

// FP32 of n moments of dtype d (the kernels' decoders; FP32 is copied).
void DecodeToF32(const moments::MomentCodecTable& k, MomentForm d, const MomentsView& in, float* m, float* v,
                 int64_t n) {
  switch (d) {
    case MomentForm::kF32:
      std::memcpy(m, in.m, n * sizeof(float));
      std::memcpy(v, in.v, n * sizeof(float));
      return;
    case MomentForm::kBF16:
      k.bf16_to_f32({static_cast<const bf16_t*>(in.m), static_cast<const bf16_t*>(in.v)}, m, v, n);
      return;
    case MomentForm::kInt8:
      k.int8_to_f32({static_cast<const int8_t*>(in.m), static_cast<const uint8_t*>(in.v), in.m_scale, in.v_scale}, m, v,
                    n);
      return;
  }
}

// n FP32 moments into dtype d at `out` (element 0 on a block boundary; the kernels' encoders).
void EncodeFromF32(const moments::MomentCodecTable& k, MomentForm d, const float* m, const float* v,
                   const UnitMoments& out, int64_t n) {
  switch (d) {
    case MomentForm::kF32:
      std::memcpy(out.m, m, n * sizeof(float));
      std::memcpy(out.v, v, n * sizeof(float));
      return;
    case MomentForm::kBF16:
      k.bf16_from_f32(m, v, {static_cast<bf16_t*>(out.m), static_cast<bf16_t*>(out.v)}, n);
      return;
    case MomentForm::kInt8:
      k.int8_from_f32(m, v, {static_cast<int8_t*>(out.m), static_cast<uint8_t*>(out.v), out.m_scale, out.v_scale}, n);
      return;
  }
}

std::string ConversionNote(MomentForm from, MomentForm to) {
  const std::string head = absl::StrCat("optimizer state converted from ", ToString(from), " to ", ToString(to));
  const char* via = from != MomentForm::kF32 && to != MomentForm::kF32 ? " through fp32" : "";
  switch (to) {
    case MomentForm::kInt8: return absl::StrCat(head, via, " (block-quantized moments: an approximation)");
    case MomentForm::kBF16: return absl::StrCat(head, via, " (moments rounded to BF16: an approximation)");
    case MomentForm::kF32:
      return absl::StrCat(head, " (decoded exactly: the moments keep the precision they were saved with)");
  }
  return head;
}

// One task of a load: master and moments of [begin, begin + count) of one unit.
struct LoadPiece {
  const UnitSource* src;
  int64_t begin, count;
  int64_t held = 0;  // the element of the unit the arrays' element 0 is (LoadOptions::windows)
};

absl::Status LoadPieceOf(const st::SafetensorsFile& file, const LoadPiece& p, MomentForm saved, MomentForm target) {
  const UnitLayout& unit = *p.src->unit;
  const auto data_loss = [&](const BadValue& bad) {
    return absl::DataLossError(
        absl::StrCat(file.path(), ": tensor \"", StateTensorName(unit, bad.kind), "\" ", DescribeBadValue(unit, bad)));
  };
  float* master = p.src->master_dst + (p.begin - p.held);
  CopyRaw(file, p.src->master, p.begin * sizeof(float), p.count * sizeof(float), master);
  if (const int64_t bad = FirstNonFinite(master, p.count, FiniteRule::kFinite); bad >= 0) {
    return data_loss({"master", p.begin + bad, FloatText(master[bad]), kRuleFinite});
  }
  if (saved == target) {  // a resume: bit for bit, checked where it landed
    const UnitMoments dst = MomentsAt(target, p.src->dst, p.begin - p.held);
    CopyMoments(file, *p.src, saved, p.begin, p.count, dst);
    if (auto bad = FirstBadMoment(target, ReadOnly(dst), p.begin, p.count)) return data_loss(*bad);
    return absl::OkStatus();
  }
  const moments::MomentCodecTable& codecs = moments::ActiveMomentCodecs();
  ConvertBuffers buf(saved);
  const UnitMoments raw = buf.raw();
  for (int64_t b = p.begin; b < p.begin + p.count; b += kConvertNumel) {
    const int64_t n = std::min(kConvertNumel, p.begin + p.count - b);
    CopyMoments(file, *p.src, saved, b, n, raw);
    if (auto bad = FirstBadMoment(saved, ReadOnly(raw), b, n)) return data_loss(*bad);
    DecodeToF32(codecs, saved, ReadOnly(raw), buf.m.data(), buf.v.data(), n);
    const UnitMoments dst = MomentsAt(target, p.src->dst, b - p.held);
    EncodeFromF32(codecs, target, buf.m.data(), buf.v.data(), dst, n);
    // What the job's dtype cannot hold: +inf v (fine in FP32 and BF16) poisons an int8 block; an
    // m beyond BF16's range rounds to inf.
    if (auto bad = FirstBadMoment(target, ReadOnly(dst), b, n)) {
      return absl::FailedPreconditionError(
          absl::StrCat(file.path(), ": converting the moments from ", ToString(saved), " to ", ToString(target),
                       " gives \"", StateTensorName(unit, bad->kind), "\" that ", DescribeBadValue(unit, *bad),
                       target == MomentForm::kInt8 ? " (an infinite moment in a block poisons its int8 scale)" : "",
                       "; resume this checkpoint with optimizer.state_dtype ", ToString(saved)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

UnitMomentsFn Fp32Moments(UnitArrayFn adam_m, UnitArrayFn adam_v) {
  return [m = std::move(adam_m), v = std::move(adam_v)](int unit) {
    return UnitMoments{m(unit), v(unit), nullptr, nullptr};
  };
}

absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& dir, const ModelLayout& layout,
                                                const StateArrays& arrays, const LoadOptions& options) {
  if (!arrays.master || !arrays.moments || !IsKnownMomentForm(arrays.moment_form)) {
    return absl::InvalidArgumentError(
        "LoadCheckpoint: the master and moments accessors and a moment_form are required");
  }
  ASSIGN_OR_RETURN(int64_t step, VerifyCheckpoint(dir));
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::FromFile(dir + "/config.json"));
  if (std::string m = DescribeConfigMismatch(config, layout.config); !m.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(dir, "/config.json: ", m));
  }
  ASSIGN_OR_RETURN(nlohmann::json state, ReadJsonObject(dir + "/trainer_state.json"));
  ASSIGN_OR_RETURN(auto file, st::SafetensorsFile::Open(dir + "/optimizer.safetensors"));
  auto sig = file->metadata().find("layout");
  if (sig == file->metadata().end() || sig->second != LayoutSignature(layout)) {
    return absl::FailedPreconditionError(
        absl::StrCat(file->path(), ": saved with a different unit layout than the job's (model or alignment changed)"));
  }
  ASSIGN_OR_RETURN(const MomentForm saved, SavedMomentForm(*file));
  const MomentForm target = arrays.moment_form;
  // Every tensor checked before the first byte lands.
  std::vector<UnitSource> sources;
  sources.reserve(layout.units.size());
  for (const UnitLayout& unit : layout.units) {
    ASSIGN_OR_RETURN(UnitSource src, CheckUnitSource(*file, unit, saved, arrays));
    sources.push_back(src);
  }
  // Pieces over the threads (the embedding alone is most of a small model), each checked as it
  // lands: a NaN there (a damaged file, or a checkpoint of a run that diverged) would train NaN
  // and report success.
  if (!options.windows.empty() && options.windows.size() != layout.units.size()) {
    return absl::InvalidArgumentError("LoadCheckpoint: one window per unit");
  }
  std::vector<LoadPiece> pieces;
  for (const UnitSource& src : sources) {
    const int u = src.unit->index;
    const ShardRange w = options.windows.empty() ? ShardRange{0, src.unit->numel} : options.windows[u];
    if (w.offset < 0 || w.numel < 0 || w.offset + w.numel > src.unit->numel || w.offset % kBlock != 0) {
      return absl::InvalidArgumentError(absl::StrCat("LoadCheckpoint: window of unit ", src.unit->name));
    }
    for (int64_t b = w.offset; b < w.offset + w.numel; b += kLoadPieceNumel) {
      pieces.push_back({&src, b, std::min(kLoadPieceNumel, w.offset + w.numel - b), w.offset});
    }
  }
  std::vector<absl::Status> piece_status(pieces.size());
  ParallelFor(pieces.size(), options.threads,
              [&](size_t i) { piece_status[i] = LoadPieceOf(*file, pieces[i], saved, target); });
  RETURN_IF_ERROR(file->Intact());  // truncated while loading: some pieces read zeros
  for (const absl::Status& s : piece_status) RETURN_IF_ERROR(s);
  LoadedCheckpoint loaded;
  loaded.step = step;
  loaded.trainer_state = state.contains("trainer_state") ? state["trainer_state"] : nlohmann::json::object();
  loaded.saved_moment_form = saved;
  if (saved != target) loaded.conversion_note = ConversionNote(saved, target);
  return loaded;
}

}  // namespace slidedp::checkpoint
