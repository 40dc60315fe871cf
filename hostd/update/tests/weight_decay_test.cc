// Weight decay per tensor (optimizer.no_decay): which HF names are norm weights and biases, and
// LayerAdam applying decay only to the others on every update path (FP32 and BF16 gradients,
// summed squares, speculative save and redo, BF16 and int8 moments), bit for bit what
// torch.optim.AdamW gives with two parameter groups, the second with weight_decay 0.
#include "hostd/update/weight_decay.h"

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "hostd/update/adamw_state.h"
#include "hostd/update/grad_norm.h"
#include "hostd/update/layer_adam.h"

namespace slidedp::update {
namespace {

TEST(WeightDecay, NormWeightsAndBiasesByHfName) {
  for (const char* norm : {"model.layers.3.input_layernorm.weight", "model.layers.3.post_attention_layernorm.weight",
                           "model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight",
                           "model.norm.weight", "norm.weight", "model.layers.0.pre_feedforward_layernorm.weight",
                           "encoder.LayerNorm.weight", "blocks.0.RMSNorm.weight"}) {
    EXPECT_TRUE(IsNormWeight(norm)) << norm;
    EXPECT_FALSE(IsBias(norm)) << norm;
    EXPECT_EQ(DecayOf(norm, {}), WeightDecay::kNone) << norm;
    EXPECT_EQ(DecayOf(norm, {.norms = false, .biases = true}), WeightDecay::kApply) << norm;
  }
  // HF's Trainer's rule: "bias" anywhere in the lower-cased name (its regex search), so also fused
  // experts' biases, Qwen3.5's dt_bias and a module named for biases.
  for (const char* bias :
       {"model.layers.0.self_attn.q_proj.bias", "model.layers.0.self_attn.v_proj.bias", "lm_head.bias",
        "model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.linear_attn.dt_bias",
        "model.layers.0.mlp.router.bias", "model.layers.0.mlp.biased_proj.weight", "model.Bias_table"}) {
    EXPECT_TRUE(IsBias(bias)) << bias;
    EXPECT_EQ(DecayOf(bias, {}), WeightDecay::kNone) << bias;
    EXPECT_EQ(DecayOf(bias, {.norms = true, .biases = false}), WeightDecay::kApply) << bias;
  }
  // Embedding and LM head are decayed (HF's rule), as are projections; names that only contain
  // "norm" elsewhere are not norms.
  for (const char* weight : {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_proj.weight",
                             "model.layers.0.mlp.down_proj.weight", "model.normalizer.weight",
                             "model.layers.0.norm.scale"}) {
    EXPECT_FALSE(IsNormWeight(weight)) << weight;
    EXPECT_FALSE(IsBias(weight)) << weight;
    EXPECT_EQ(DecayOf(weight, {}), WeightDecay::kApply) << weight;
  }
  // The tiny Qwen3 model: its 1-D tensors are exactly its norms.
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  for (const UnitLayout& u : ModelLayout::Build(*config).units) {
    const std::vector<ElementRange> ranges = TensorRangesOf(u, {});
    ASSERT_EQ(ranges.size(), u.tensors.size());
    for (size_t i = 0; i < ranges.size(); ++i) {
      const TensorSlot& t = u.tensors[i];
      EXPECT_EQ(ranges[i].begin, t.offset_numel);
      EXPECT_EQ(ranges[i].end, t.offset_numel + t.numel);
      EXPECT_EQ(ranges[i].decay, t.shape.size() == 1 ? WeightDecay::kNone : WeightDecay::kApply) << t.hf_name;
      EXPECT_EQ(TensorRangesOf(u, {false, false})[i].decay, WeightDecay::kApply) << t.hf_name;
    }
  }
}

// A tensor that is not trainable (gemma4's layer_scalar: an nn.Buffer in HF) gets no range, so no
// update writes it, weight decay included; the others keep theirs.
TEST(WeightDecay, BuffersGetNoRange) {
  auto config = ModelConfig::Preset("tiny-gemma4");
  ASSERT_TRUE(config.ok());
  for (const UnitLayout& u : ModelLayout::Build(*config).units) {
    const std::vector<ElementRange> ranges = TensorRangesOf(u, {});
    const TensorSlot* scalar = u.Find(kLayerScalar);
    ASSERT_EQ(ranges.size(), u.tensors.size() - (scalar != nullptr ? 1 : 0)) << u.name;
    for (const ElementRange& r : ranges) {
      EXPECT_FALSE(scalar != nullptr && r.begin <= scalar->offset_numel && scalar->offset_numel < r.end) << u.name;
    }
  }
}

// A decoder unit with every kind of tensor weight decay tells apart, of awkward sizes, each
// aligned as ModelLayout aligns them: matrices, norm weights, a bias (Qwen2-style).
UnitLayout MixedUnit() {
  UnitLayout u;
  u.name = "layer.0";
  int64_t offset = 0;
  auto add = [&](std::string name, std::vector<int64_t> shape) {
    TensorSlot t;
    t.hf_name = std::move(name);
    t.numel = 1;
    for (int64_t d : shape) t.numel *= d;
    t.shape = std::move(shape);
    t.offset_numel = offset;
    offset += (t.numel + kTensorAlignNumel - 1) / kTensorAlignNumel * kTensorAlignNumel;
    u.tensors.push_back(std::move(t));
  };
  add("model.layers.0.input_layernorm.weight", {96});
  add("model.layers.0.self_attn.q_proj.weight", {96, 41});
  add("model.layers.0.self_attn.q_proj.bias", {96});
  add("model.layers.0.self_attn.q_norm.weight", {22});
  add("model.layers.0.self_attn.k_norm.weight", {22});
  add("model.layers.0.post_attention_layernorm.weight", {96});
  add("model.layers.0.mlp.down_proj.weight", {96, 301});
  u.numel = offset;
  return u;
}

std::unique_ptr<LayerAdam> MakeEngine() {
  LayerAdamOptions o;
  o.num_threads = 3;
  o.pinning = WorkerPinning::kNone;
  o.min_piece_numel = 256;
  auto e = LayerAdam::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// One unit's state in any moment layout (what UnitMemory points at).
struct State {
  State(int64_t n, MomentForm dtype)
      : dtype(dtype),
        master(n),
        m(n),
        v(n),
        mirror(n),
        m16(n),
        v16(n),
        mq(n),
        vq(n),
        ms(Int8MomentBlocks(n)),
        vs(Int8MomentBlocks(n)) {}
  UnitMemory view(absl::Span<const ElementRange> tensors) {
    UnitMemory u{master.data(), m.data(), v.data(), mirror.data(), static_cast<int64_t>(master.size()), 0};
    u.moments = dtype;
    u.bf16 = Bf16Moments{m16.data(), v16.data()};
    u.int8 = Int8Moments{mq.data(), vq.data(), ms.data(), vs.data()};
    u.first_index = 4096;
    u.tensors = tensors;
    return u;
  }
  UndoMemory undo() {
    UndoMemory d{master.data(), m.data(), v.data(), dtype};
    d.bf16 = Bf16Moments{m16.data(), v16.data()};
    d.int8 = Int8Moments{mq.data(), vq.data(), ms.data(), vs.data()};
    return d;
  }
  bool operator==(const State& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(master, o.master) && same(m, o.m) && same(v, o.v) && same(mirror, o.mirror) && same(m16, o.m16) &&
           same(v16, o.v16) && same(mq, o.mq) && same(vq, o.vq) && same(ms, o.ms) && same(vs, o.vs);
  }
  MomentForm dtype;
  std::vector<float> master, m, v;
  std::vector<bf16_t> mirror, m16, v16;
  std::vector<int8_t> mq;
  std::vector<uint8_t> vq;
  std::vector<float> ms, vs;
};

// Chunks covering [0, n) in random order, on int8 block boundaries (every layout accepts them).
std::vector<std::pair<int64_t, int64_t>> Chunks(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> blocks(1, 12);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t o = 0; o < n;) {
    const int64_t l = std::min(n - o, blocks(rng) * kInt8MomentBlock);
    out.emplace_back(o, l);
    o += l;
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

// A zero gradient on zero moments leaves the update term 0 (m = 0, so 0 / (sqrt(0) + eps)): what
// is left is the decay. Exempt tensors keep their bits; the others are theta * f32(1 - lr*wd);
// with no exemptions every tensor decays. Every moment layout.
TEST(LayerAdam, ExemptTensorsAreNotDecayedByAZeroGradient) {
  const UnitLayout unit = MixedUnit();
  const int64_t n = unit.numel;
  auto engine = MakeEngine();
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  const std::vector<float> zeros(n, 0.0f);
  AdamWStepParams p;
  p.lr = 1e-2;
  p.weight_decay = 0.5;
  p.step = 1;
  const float factor = static_cast<float>(1.0 - p.lr * p.weight_decay);
  for (MomentForm dtype : {MomentForm::kF32, MomentForm::kBF16, MomentForm::kInt8}) {
    for (const DecayExemptions exempt : {DecayExemptions{}, DecayExemptions{false, false}}) {
      SCOPED_TRACE(absl::StrCat(ToString(dtype), exempt.norms ? " norms and biases exempt" : " all decayed"));
      const std::vector<ElementRange> ranges = TensorRangesOf(unit, exempt);
      State s(n, dtype);
      for (float& x : s.master) x = normal(rng) * 0.1f;
      const std::vector<float> before = s.master;
      for (auto [o, l] : Chunks(n, rng)) {
        ASSERT_TRUE(
            engine
                ->SubmitChunk(s.view(ranges), o, l, zeros.data() + o, p, [](absl::Status st) { EXPECT_TRUE(st.ok()); })
                .ok());
      }
      engine->WaitIdle();
      int exempt_tensors = 0;
      for (const TensorSlot& t : unit.tensors) {
        const bool decayed = DecayOf(t.hf_name, exempt) == WeightDecay::kApply;
        exempt_tensors += !decayed;
        for (int64_t i = t.offset_numel; i < t.offset_numel + t.numel; ++i) {
          const float want = decayed ? before[i] * factor : before[i];
          ASSERT_EQ(std::memcmp(&s.master[i], &want, 4), 0)
              << t.hf_name << "[" << i - t.offset_numel << "]: " << s.master[i] << " want " << want;
          ASSERT_EQ(s.mirror[i], FloatToBf16(want)) << t.hf_name;
        }
      }
      EXPECT_EQ(exempt_tensors, exempt.norms ? 5 : 0);
    }
  }
}

// torch's _single_tensor_adam for one parameter group, in FP32 with the step constants rounded
// from double (torch/optim/adam.py): weight_decay 0 skips the multiply (`if weight_decay != 0`).
void TorchAdamWGroup(const AdamWStepParams& p, float* theta, float* m, float* v, const float* grad, int64_t n) {
  const double t = static_cast<double>(p.step);
  const float bc2_sqrt = static_cast<float>(std::pow(1.0 - std::pow(p.beta2, t), 0.5));
  const float neg_step = static_cast<float>(-(p.lr / (1.0 - std::pow(p.beta1, t))));
  const float decay = static_cast<float>(1.0 - p.lr * p.weight_decay);
  const float w = static_cast<float>(1.0 - p.beta1), b2 = static_cast<float>(p.beta2);
  const float one_minus_b2 = static_cast<float>(1.0 - p.beta2), eps = static_cast<float>(p.eps);
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i] * p.grad_scale;
    if (p.weight_decay != 0) theta[i] = theta[i] * decay;
    m[i] = std::fma(w, g - m[i], m[i]);  // exp_avg.lerp_(g, 1 - b1), ATen's vector lerp (weight < 0.5)
    const float gg = one_minus_b2 * g;
    const float vb = v[i] * b2;
    v[i] = vb + gg * g;
    const float denom = std::sqrt(v[i]) / bc2_sqrt + eps;
    const float step = neg_step * m[i];
    theta[i] = theta[i] + step / denom;
  }
}

// The reference step of a whole unit: each tensor with its group's weight decay (exempt tensors
// in the group of weight_decay 0). FP32 moments through TorchAdamWGroup; compact moments through
// the scalar state kernels with the group's constants; padding untouched.
void ReferenceStep(const UnitLayout& unit, const DecayExemptions& exempt, const AdamWStepParams& p, const float* grad,
                   State& s) {
  const AdamStateKernelTable& k = *AdamStateKernelsFor(AdamIsa::kScalar);
  for (const TensorSlot& t : unit.tensors) {
    AdamWStepParams group = p;
    if (DecayOf(t.hf_name, exempt) == WeightDecay::kNone) group.weight_decay = 0;
    const int64_t o = t.offset_numel;
    switch (s.dtype) {
      case MomentForm::kF32:
        TorchAdamWGroup(group, &s.master[o], &s.m[o], &s.v[o], grad + o, t.numel);
        for (int64_t i = o; i < o + t.numel; ++i) s.mirror[i] = FloatToBf16(s.master[i]);
        break;
      case MomentForm::kBF16:
        k.bf16_step_f32(MakeAdamWConstants(group), StochasticRounding{p.rounding_seed, p.step, 4096 + o}, &s.master[o],
                        Bf16Moments{&s.m16[o], &s.v16[o]}, &s.mirror[o], grad + o, t.numel);
        break;
      case MomentForm::kInt8:
        k.int8_step_f32(MakeAdamWConstants(group), &s.master[o],
                        Int8MomentsAt(Int8Moments{s.mq.data(), s.vq.data(), s.ms.data(), s.vs.data()}, o), &s.mirror[o],
                        grad + o, t.numel);
        break;
    }
  }
}

enum class Path { kF32, kBf16Grad, kSquared, kSpeculativeRedo };

// Three steps on every update path and moment layout, random chunks in random order: the state is
// the reference's (two torch param groups) bit for bit, padding included. The BF16-gradient path
// is the reference on the widened gradient; the speculative path saves at grad scale 1 and redoes
// from the copy at 0.5, so it must equal the reference at 0.5.
TEST(LayerAdam, DecayPerTensorIsTorchAdamWWithTwoParamGroups) {
  const UnitLayout unit = MixedUnit();
  const int64_t n = unit.numel;
  auto engine = MakeEngine();
  std::mt19937 rng(17);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (MomentForm dtype : {MomentForm::kF32, MomentForm::kBF16, MomentForm::kInt8}) {
    for (Path path : {Path::kF32, Path::kBf16Grad, Path::kSquared, Path::kSpeculativeRedo}) {
      if (path == Path::kSquared && dtype != MomentForm::kF32) continue;  // grid blocks split int8 blocks
      for (const DecayExemptions exempt :
           {DecayExemptions{}, DecayExemptions{true, false}, DecayExemptions{false, false}}) {
        SCOPED_TRACE(absl::StrCat(ToString(dtype), " path ", static_cast<int>(path), " norms ", exempt.norms,
                                  " biases ", exempt.biases));
        const std::vector<ElementRange> ranges = TensorRangesOf(unit, exempt);
        State ours(n, dtype);
        for (float& x : ours.master) x = normal(rng) * 0.05f;
        for (int64_t i = 0; i < n; ++i) ours.mirror[i] = FloatToBf16(ours.master[i]);
        State ref = ours;
        State arena(n, dtype);
        for (int t = 1; t <= 3; ++t) {
          AdamWStepParams p;
          p.lr = 3e-2;
          p.beta2 = 0.95;
          p.weight_decay = 0.3;
          p.step = t;
          p.rounding_seed = 11;
          std::vector<float> grad(n);
          std::vector<bf16_t> grad16(n);
          for (int64_t i = 0; i < n; ++i) {
            grad16[i] = FloatToBf16(normal(rng) * 1e-2f);
            grad[i] = path == Path::kBf16Grad ? Bf16ToFloat(grad16[i]) : normal(rng) * 1e-2f;
          }
          std::vector<double> squares(NormBlockCount(0, n));
          for (auto [o, l] : Chunks(n, rng)) {
            const auto done = [](absl::Status st) { EXPECT_TRUE(st.ok()) << st; };
            absl::Status s;
            switch (path) {
              case Path::kF32: s = engine->SubmitChunk(ours.view(ranges), o, l, grad.data() + o, p, done); break;
              case Path::kBf16Grad:
                s = engine->SubmitChunkBf16(ours.view(ranges), o, l, grad16.data() + o, p, done);
                break;
              case Path::kSquared: break;
              case Path::kSpeculativeRedo: {
                const UndoMemory undo = arena.undo();
                s = engine->SubmitChunk(ours.view(ranges), o, l, grad.data() + o, p, done, &undo, UndoMode::kSave);
                break;
              }
            }
            ASSERT_TRUE(s.ok()) << s;
          }
          if (path == Path::kSquared) {  // pieces of the norm grid: one chunk for the whole unit
            ASSERT_TRUE(engine
                            ->SubmitGradSquared(ours.view(ranges), 0, n, grad.data(), p, squares.data(),
                                                [](absl::Status st) { EXPECT_TRUE(st.ok()) << st; })
                            .ok());
          }
          engine->WaitIdle();
          if (path == Path::kSpeculativeRedo) {
            AdamWStepParams half = p;
            half.grad_scale = 0.5f;
            const UndoMemory undo = arena.undo();
            for (auto [o, l] : Chunks(n, rng)) {
              ASSERT_TRUE(engine
                              ->SubmitChunk(
                                  ours.view(ranges), o, l, grad.data() + o, half,
                                  [](absl::Status st) { EXPECT_TRUE(st.ok()) << st; }, &undo, UndoMode::kRedo)
                              .ok());
            }
            engine->WaitIdle();
            p = half;
          }
          ReferenceStep(unit, exempt, p, grad.data(), ref);
          ASSERT_TRUE(ours == ref) << "step " << t;
        }
      }
    }
  }
}

}  // namespace
}  // namespace slidedp::update
