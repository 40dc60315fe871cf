// gpt_oss's reference math against transformers' modeling_gpt_oss.py written out here, in double:
// attention with sinks (eager_attention_forward's softmax over the scores and the sink's column, the
// sink dropped after it) within a window, and its gradients (the sinks' included) against central
// differences; GptOssExperts._apply_gate (the clamped SwiGLU) on values past the limits, and its
// backward; the whole MoE block (GptOssTopKRouter + GptOssExperts' loop) and its gradients with the
// aux loss's. And the CPU backend on gpt_oss layers: every policy gives the same outputs and
// gradients, and FP32 follows the FP64 math.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu/cpu_backend.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/gpt_oss_math.h"
#include "worker/compute/cpu/tests/cpu_test_util.h"

namespace slidedp {
namespace {

using testing::AwkwardGptOssConfig;
using testing::MakeBatch;
using testing::RandomNormals;
using testing::RandomUnitParams;

constexpr double kStep = 1e-6;

// Attention of 4 heads over 2 kv heads of 8 (GQA), as in the gpt_oss layer.
DecoderDims SinkDims() {
  DecoderDims d;
  d.heads = 4;
  d.kv_heads = 2;
  d.head_dim = 8;
  return d;
}

struct SinkCase {
  DecoderDims d = SinkDims();
  MicroBatch mb = MakeBatch({5, 1, 9, 4}, 50, 3);
  RopeTables rope = BuildRopeTables(mb.positions, 8, 1e4);
  TokenGeometry geom = MakeTokenGeometry(mb, rope);
  int64_t T = mb.num_tokens();
  std::vector<double> q = RandomNormals<double>(T * 32, 1), k = RandomNormals<double>(T * 16, 2),
                      v = RandomNormals<double>(T * 16, 3), sinks = RandomNormals<double>(4, 4);
};

// eager_attention_forward with module.sinks: the scaled scores of the visible keys (the window's,
// in the query's document) and the sink as one more column, softmax, the sink's column dropped.
std::vector<double> HfSinkAttention(const SinkCase& s, int64_t window) {
  const DecoderDims& d = s.d;
  const double scale = 1.0 / std::sqrt(8.0);
  std::vector<double> out(s.T * 32, 0.0);
  for (int64_t doc = 0; doc + 1 < static_cast<int64_t>(s.mb.cu_seqlens.size()); ++doc) {
    const int64_t b = s.mb.cu_seqlens[doc], e = s.mb.cu_seqlens[doc + 1];
    for (int64_t t = b; t < e; ++t) {
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t g = h / 2;
        std::vector<double> logits;
        std::vector<int64_t> keys;
        for (int64_t j = b; j <= t; ++j) {
          if (window > 0 && !(j > t - window)) continue;  // sliding_window_overlay: kv > q - window
          double dot = 0;
          for (int64_t i = 0; i < 8; ++i) dot += s.q[t * 32 + h * 8 + i] * s.k[j * 16 + g * 8 + i];
          logits.push_back(dot * scale);
          keys.push_back(j);
        }
        logits.push_back(s.sinks[h]);
        const double mx = *std::max_element(logits.begin(), logits.end());
        double sum = 0;
        for (double& l : logits) sum += (l = std::exp(l - mx));
        for (size_t j = 0; j < keys.size(); ++j) {
          for (int64_t i = 0; i < 8; ++i) out[t * 32 + h * 8 + i] += logits[j] / sum * s.v[keys[j] * 16 + g * 8 + i];
        }
      }
    }
  }
  return out;
}

std::vector<double> OurSinkAttention(const SinkCase& s, int64_t window, std::vector<double>* lse) {
  std::vector<double> attn(s.T * 32);
  lse->resize(s.T * 4);
  AttentionForward(s.d, s.geom, window, s.q.data(), s.k.data(), s.v.data(), attn.data(), lse->data(), nullptr);
  ApplyAttentionSinks<double>(s.T, 4, 8, s.sinks.data(), attn.data(), lse->data());
  return attn;
}

TEST(GptOssSinks, AttentionIsTheSoftmaxWithTheSinkColumnDropped) {
  SinkCase s;
  for (int64_t window : {0, 1, 3}) {
    std::vector<double> lse;
    const std::vector<double> ours = OurSinkAttention(s, window, &lse);
    EXPECT_LT(testing::RelativeL2(ours, HfSinkAttention(s, window)), 1e-13) << "window " << window;
  }
  // A sink far below every score changes nothing; far above, it takes the whole softmax.
  std::vector<double> plain(s.T * 32), plain_lse(s.T * 4), lse;
  AttentionForward(s.d, s.geom, 0, s.q.data(), s.k.data(), s.v.data(), plain.data(), plain_lse.data(), nullptr);
  s.sinks.assign(4, -1e3);
  EXPECT_EQ(OurSinkAttention(s, 0, &lse), plain);
  EXPECT_EQ(lse, plain_lse);
  s.sinks.assign(4, 1e3);
  for (double o : OurSinkAttention(s, 0, &lse)) EXPECT_EQ(o, 0.0);
}

TEST(GptOssSinks, GradientsMatchCentralDifferences) {
  SinkCase s;
  const std::vector<double> c = RandomNormals<double>(s.T * 32, 9);
  for (int64_t window : {0, 2}) {
    auto loss = [&]() {
      std::vector<double> lse;
      const std::vector<double> o = OurSinkAttention(s, window, &lse);
      return std::inner_product(o.begin(), o.end(), c.begin(), 0.0);
    };
    std::vector<double> lse;
    const std::vector<double> attn = OurSinkAttention(s, window, &lse);
    std::vector<double> dq(s.T * 32), dk(s.T * 16), dv(s.T * 16), dsinks(4, 0.0);
    AttentionSinksBackward<double>(s.T, 4, 8, s.sinks.data(), attn.data(), lse.data(), c.data(), dsinks.data());
    AttentionBackward(s.d, s.geom, window, s.q.data(), s.k.data(), s.v.data(), attn.data(), lse.data(), c.data(),
                      dq.data(), dk.data(), dv.data(), nullptr);
    for (auto [vec, grad] : {std::pair<std::vector<double>*, std::vector<double>*>{&s.sinks, &dsinks},
                             {&s.q, &dq},
                             {&s.k, &dk},
                             {&s.v, &dv}}) {
      for (size_t i = 0; i < vec->size(); i += std::max<size_t>(1, vec->size() / 23)) {
        const double saved = (*vec)[i];
        (*vec)[i] = saved + kStep;
        const double up = loss();
        (*vec)[i] = saved - kStep;
        const double down = loss();
        (*vec)[i] = saved;
        const double fd = (up - down) / (2 * kStep);
        EXPECT_NEAR((*grad)[i], fd, 1e-7 * std::max(1.0, std::fabs(fd))) << "window " << window << " index " << i;
      }
    }
    // The sink only takes probability away: a larger sink lowers every key's weight.
    for (double g : dsinks) EXPECT_NE(g, 0.0);
  }
}

// GptOssExperts._apply_gate on gate_up [.., 2I] (gate = even columns, up = odd ones), written out.
double HfGate(double gate, double up) {
  const double limit = 7.0, alpha = 1.702;
  gate = std::min(gate, limit);                // gate.clamp(min=None, max=limit)
  up = std::min(std::max(up, -limit), limit);  // up.clamp(min=-limit, max=limit)
  const double glu = gate * (1.0 / (1.0 + std::exp(-gate * alpha)));
  return (up + 1) * glu;
}

TEST(GptOssGlu, ClampedSwigluAsTransformersAndItsGradient) {
  // Past the limits on both sides: the gate is clamped from above only (-20 passes), up both ways.
  const std::vector<double> gate = {20.0, -20.0, 7.5, 6.9, -7.5, 0.3, -1.2, 3.0, 7.0, 1.0};
  const std::vector<double> up = {0.5, -0.5, 20.0, -20.0, 6.5, -6.9, 1.1, -0.4, 2.0, 7.0};
  const int64_t n = static_cast<int64_t>(gate.size());
  std::vector<double> m(n), dm = RandomNormals<double>(n, 5), dgate(n), dup(n);
  GptOssGlu(1.702, 7.0, gate.data(), up.data(), n, m.data());
  GptOssGluBackward(1.702, 7.0, gate.data(), up.data(), dm.data(), n, dgate.data(), dup.data());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(m[i], HfGate(gate[i], up[i]), 1e-15 * (1 + std::fabs(m[i]))) << i;
    // Central differences where the clamp is not at its kink (7.0 exactly: PyTorch passes the
    // gradient there, the one-sided slope we test separately).
    if (gate[i] != 7.0 && up[i] != 7.0) {
      const double fg = (HfGate(gate[i] + kStep, up[i]) - HfGate(gate[i] - kStep, up[i])) / (2 * kStep);
      const double fu = (HfGate(gate[i], up[i] + kStep) - HfGate(gate[i], up[i] - kStep)) / (2 * kStep);
      EXPECT_NEAR(dgate[i], dm[i] * fg, 1e-7 * (1 + std::fabs(dm[i] * fg))) << i;
      EXPECT_NEAR(dup[i], dm[i] * fu, 1e-7 * (1 + std::fabs(dm[i] * fu))) << i;
    }
  }
  EXPECT_EQ(dgate[0], 0.0);  // gate 20: clamped
  EXPECT_NE(dgate[1], 0.0);  // gate -20: not clamped (the clamp is one-sided)
  EXPECT_EQ(dup[2], 0.0);    // up 20 and -20: clamped
  EXPECT_EQ(dup[3], 0.0);
  EXPECT_NE(dgate[8], 0.0);  // at the limit the gradient passes, as torch.clamp's backward
  EXPECT_NE(dup[9], 0.0);
  // float follows double.
  std::vector<float> gf(gate.begin(), gate.end()), uf(up.begin(), up.end()), mf(n);
  GptOssGlu(1.702f, 7.0f, gf.data(), uf.data(), n, mf.data());
  for (int64_t i = 0; i < n; ++i) EXPECT_NEAR(mf[i], m[i], 2e-6 * (1 + std::fabs(m[i]))) << i;
}

// The block of a gpt_oss unit: its layout's parameters, its experts' gate_up weights scaled up so
// that the clamps bite.
struct MoeCase {
  ModelConfig config = AwkwardGptOssConfig(false);
  ModelLayout layout = ModelLayout::Build(config);
  const UnitLayout& unit = layout.units[1];
  MoeDims dims = MoeDims::Of(config);
  MoeOffsets offs = MoeOffsets::InUnit(unit);
  std::vector<double> params = RandomUnitParams(layout, 21)[1];
  int64_t T = 13;
  std::vector<double> x = RandomNormals<double>(T * 48, 22);
  MoeCase() {
    for (int64_t e = 0; e < unit.num_experts(); ++e) {
      const TensorSlot* gu = unit.FindExpert(e, kGptOssGateUp);
      for (int64_t i = 0; i < gu->numel; ++i) params[gu->offset_numel + i] *= 6.0;
    }
  }
};

// GptOssMLP.forward as transformers computes it: the router, then the experts' loop in expert order.
std::vector<double> HfMoe(const MoeCase& c, int* clamped) {
  const int64_t H = 48, I = 12, E = 5, k = 2;
  const double* p = c.params.data();
  std::vector<double> y(c.T * H, 0.0);
  std::vector<std::vector<std::pair<int64_t, double>>> routed(E);  // per expert: (token, weight)
  for (int64_t t = 0; t < c.T; ++t) {
    std::vector<double> z(E);
    for (int64_t e = 0; e < E; ++e) {
      z[e] = p[c.unit.Find(kRouterBias)->offset_numel + e];
      for (int64_t i = 0; i < H; ++i) z[e] += c.x[t * H + i] * p[c.unit.Find(kRouter)->offset_numel + e * H + i];
    }
    std::vector<int64_t> order(E);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return z[a] > z[b]; });
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += std::exp(z[order[j]] - z[order[0]]);
    for (int64_t j = 0; j < k; ++j) routed[order[j]].push_back({t, std::exp(z[order[j]] - z[order[0]]) / sum});
  }
  for (int64_t e = 0; e < E; ++e) {
    const double* wgu = p + c.unit.FindExpert(e, kGptOssGateUp)->offset_numel;
    const double* bgu = p + c.unit.FindExpert(e, kGptOssGateUpBias)->offset_numel;
    const double* wd = p + c.unit.FindExpert(e, kGptOssDown)->offset_numel;
    const double* bd = p + c.unit.FindExpert(e, kGptOssDownBias)->offset_numel;
    for (const auto& [t, w] : routed[e]) {
      std::vector<double> gu(2 * I), m(I);
      for (int64_t j = 0; j < 2 * I; ++j) {
        gu[j] = bgu[j];
        for (int64_t i = 0; i < H; ++i) gu[j] += c.x[t * H + i] * wgu[i * 2 * I + j];  // x @ gate_up_proj[e]
      }
      for (int64_t i = 0; i < I; ++i) {
        m[i] = HfGate(gu[2 * i], gu[2 * i + 1]);
        *clamped += gu[2 * i] > 7 || std::fabs(gu[2 * i + 1]) > 7;
      }
      for (int64_t h = 0; h < H; ++h) {
        double o = bd[h];
        for (int64_t i = 0; i < I; ++i) o += m[i] * wd[i * H + h];  // @ down_proj[e]
        y[t * H + h] += o * w;
      }
    }
  }
  return y;
}

TEST(GptOssMoe, BlockIsTransformersRouterAndExpertLoop) {
  MoeCase c;
  int clamped = 0;
  const std::vector<double> want = HfMoe(c, &clamped);
  EXPECT_GT(clamped, 10) << "the test should reach the clamps";
  std::vector<double> y(c.T * 48);
  MoeActs<double> acts;
  MoeBlockForward(c.dims, c.offs, c.params.data(), c.x.data(), c.T, y.data(), &acts, nullptr);
  EXPECT_LT(testing::RelativeL2(y, want), 1e-13);
  // The aux loss's statistics: the full softmax of the biased logits, the routed counts.
  int64_t routed = 0;
  for (int64_t n : acts.stats.expert_counts) routed += n;
  EXPECT_EQ(routed, c.T * 2);
  double prob = 0;
  for (double s : acts.stats.prob_sums) prob += s;
  EXPECT_NEAR(prob, static_cast<double>(c.T), 1e-12);
}

TEST(GptOssMoe, GradientsMatchCentralDifferences) {
  MoeCase c;
  const std::vector<double> cy = RandomNormals<double>(c.T * 48, 30);
  const std::vector<double> aux = {0.3, -0.2, 0.5, 0.1, -0.4};  // dL/dp of every token
  auto loss = [&]() {
    std::vector<double> y(c.T * 48);
    MoeActs<double> acts;
    MoeBlockForward(c.dims, c.offs, c.params.data(), c.x.data(), c.T, y.data(), &acts, nullptr);
    double l = std::inner_product(y.begin(), y.end(), cy.begin(), 0.0);
    for (int64_t t = 0; t < c.T; ++t)
      for (int64_t e = 0; e < 5; ++e) l += aux[e] * acts.router_probs[t * 5 + e];
    return l;
  };
  std::vector<double> y(c.T * 48), dx(c.T * 48), dparams(c.params.size(), 0.0);
  MoeActs<double> acts;
  MoeBlockForward(c.dims, c.offs, c.params.data(), c.x.data(), c.T, y.data(), &acts, nullptr);
  MoeBlockBackward(c.dims, c.offs, c.params.data(), c.x.data(), c.T, acts, cy.data(), aux.data(), dx.data(),
                   dparams.data(), nullptr);
  auto check = [&](std::vector<double>& vec, const std::vector<double>& grad, int64_t at, const std::string& what) {
    const double saved = vec[at];
    vec[at] = saved + kStep;
    const double up = loss();
    vec[at] = saved - kStep;
    const double down = loss();
    vec[at] = saved;
    const double fd = (up - down) / (2 * kStep);
    EXPECT_NEAR(grad[at], fd, 2e-6 * std::max(1.0, std::fabs(fd))) << what;
  };
  int checked = 0;
  for (const TensorSlot& t : c.unit.tensors) {
    if (t.offset_numel < c.unit.Find(kRouter)->offset_numel) continue;  // the block's tensors only
    for (int64_t i = 0; i < t.numel; i += std::max<int64_t>(1, t.numel / 7)) {
      check(c.params, dparams, t.offset_numel + i, absl::StrCat(t.Key(), "[", i, "]"));
      ++checked;
    }
  }
  for (int64_t i = 0; i < c.T * 48; i += 17) check(c.x, dx, i, absl::StrCat("x[", i, "]"));
  EXPECT_GT(checked, 100);
}

// The backend on gpt_oss layers (a sliding and a full one): every activation policy gives the same
// outputs and gradients bit for bit, and FP32 follows the FP64 math on the same BF16 parameters.
TEST(GptOssBackend, PoliciesAgreeAndFollowTheDoubleMath) {
  const ModelConfig c = AwkwardGptOssConfig(false);
  const ModelLayout layout = ModelLayout::Build(c);
  const std::vector<std::vector<bf16_t>> params = testing::ToBf16(RandomUnitParams(layout, 4));
  const std::vector<std::vector<double>> params64 = testing::ToDouble(params);
  const MicroBatch mb = MakeBatch({7, 1, 10, 5}, c.vocab_size, 8);
  const int64_t n = mb.num_tokens() * c.hidden_size;
  const std::vector<float> x = RandomNormals<float>(n, 1), dy = RandomNormals<float>(n, 2);
  struct Run {
    std::vector<float> y, dx, dparams;
  };
  auto run = [&](ActPolicy policy, int unit) {
    auto be = MakeCpuBackend(c);
    EXPECT_TRUE(be.ok()) << be.status();
    auto batch = (*be)->UploadBatch(mb);
    EXPECT_TRUE(batch.ok()) << batch.status();
    const UnitParams p = UnitParams(params[unit].data()).OfLayer(layout.units[unit].decoder_layer);
    Run r{std::vector<float>(n), std::vector<float>(n), std::vector<float>(params[unit].size(), 0.0f)};
    std::unique_ptr<SavedActivations> saved;
    EXPECT_TRUE((*be)->DecoderForward(p, **batch, x.data(), r.y.data(), policy, &saved).ok());
    EXPECT_TRUE(
        (*be)->DecoderBackward(p, **batch, x.data(), saved.get(), dy.data(), r.dx.data(), r.dparams.data()).ok());
    return r;
  };
  for (int unit : {1, 2}) {
    const Run ref = run(ActPolicy::kKeepAll, unit);
    for (ActPolicy policy : {ActPolicy::kRecomputeLayer, ActPolicy::kSelective}) {
      const Run r = run(policy, unit);
      EXPECT_EQ(r.y, ref.y) << "unit " << unit;
      EXPECT_EQ(r.dx, ref.dx) << "unit " << unit;
      EXPECT_EQ(r.dparams, ref.dparams) << "unit " << unit;
    }
    // FP64 on the same parameters and inputs.
    const DecoderDims dims = DecoderDims::From(c);
    const DecoderOffsets offs = DecoderOffsets::Of(layout.units[unit]);
    const RopeTables rope = BuildRopeTables(mb.positions, c);
    const TokenGeometry geom = MakeTokenGeometry(mb, rope);
    const std::vector<double> x64(x.begin(), x.end()), dy64(dy.begin(), dy.end());
    std::vector<double> y64(n), dx64(n), dp64(params64[unit].size(), 0.0);
    DecoderActs<double> acts;
    DecoderForwardAll(dims, offs, params64[unit].data(), geom, x64.data(), y64.data(), &acts, nullptr);
    DecoderBackward(dims, offs, params64[unit].data(), geom, x64.data(), acts, dy64.data(), dx64.data(), dp64.data(),
                    nullptr);
    EXPECT_LT(testing::RelativeL2(std::vector<double>(ref.y.begin(), ref.y.end()), y64), 1e-6) << unit;
    EXPECT_LT(testing::RelativeL2(std::vector<double>(ref.dx.begin(), ref.dx.end()), dx64), 1e-5) << unit;
    EXPECT_LT(testing::RelativeL2(std::vector<double>(ref.dparams.begin(), ref.dparams.end()), dp64), 1e-5) << unit;
    // The sinks and every bias receive a gradient.
    const UnitLayout& u = layout.units[unit];
    for (DecoderTensor t : {kSinks, kQBias, kKBias, kVBias, kOBias, kRouterBias}) {
      const TensorSlot* s = u.Find(t);
      ASSERT_NE(s, nullptr) << t;
      double largest = 0;
      for (int64_t i = 0; i < s->numel; ++i) largest = std::max(largest, std::fabs(dp64[s->offset_numel + i]));
      EXPECT_GT(largest, 0) << s->hf_name;
    }
  }
}

}  // namespace
}  // namespace slidedp
