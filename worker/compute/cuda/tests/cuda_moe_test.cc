// CudaMoeBlock (cuda_moe.h) against the CPU reference block (moe_reference_math.h,
// MoeBlockForward / MoeBlockBackward<float>) on the same BF16 parameters and inputs, at awkward
// sizes: hidden 72, moe_intermediate 40, 7 experts, top-2, 37 tokens, renormalised, stacked layout
// (gate and up apart: two GEMMs), aux-loss gradient on, one expert that no token reaches and two
// experts with equal router rows (every token's probabilities tie: the lower expert must win); hidden
// 136, moe_intermediate 24, 16 experts, top-4, 53 tokens, norm_topk_prob false, HF's fused gate|up
// layout (one GEMM); and the first sizes in a unit's padded layout (256-element aligned tensors).
//
// The router is exact in BF16 so that both sides route alike: each router row has one nonzero,
// +-1 or +-2, on an input column whose values lie on a 0.125 grid, so every logit is a BF16 value
// computed exactly on both sides (the GPU rounds the router GEMM's output to BF16, as HF autocast;
// the reference keeps FP32) and unequal logits are >= 0.125 apart (no near-ties that rounding could
// flip). The routing must then match exactly; outputs and gradients differ by the GPU's BF16
// roundings of gu, act, the expert outputs and the backward's operands (HF autocast's), so they are
// compared by relative L2 error: 1e-2 for the output and dxn and the expert weight gradients, 2e-2
// for the router's (dz = p * (dp - p.dp) cancels, which enlarges the relative error of its BF16
// operands). Also: the statistics, untouched gradients of the expert without rows, backward from
// each MoeKeep (and none) bit for bit alike, dxn aliasing dout, and bitwise repeatability.
//
// GPT-OSS's block (MoeDims::gpt_oss) against GptOssMoeForward / GptOssMoeBackward<double> on the same
// BF16 values, with biases everywhere: hidden 64, intermediate 32, 8 experts, top-2, 211 tokens, packed
// layout, aux-loss gradient on, a tie and an expert without rows; hidden 72, intermediate 24, 5
// experts, top-3, 97 tokens, the unit's padded layout. The router is exact as above (its bias on the
// same 0.125 grid), and the gate_up pre-activations are exact too, so that both sides clamp the same
// elements: xn on a 0.125 grid, gate_up weights on a 0.25 grid and its bias on a 1/32 grid of at most
// 0.75, so every gate_up GEMM output is a multiple of 1/32, exact in the FP32 accumulator and in BF16
// below 8 (at 8 and above the rounding cannot bring a value back within the limit 7, bias included).
// They are spread (about 6) so that a fifth of the gates and ups pass +-7 and some sit exactly on it
// (where the clamp passes the gradient). Tolerances as above: relative L2 1e-2 for out, dxn and the
// experts' weight and bias gradients, 2e-2 for the router's weight, 5e-2 for its bias (each token's dz
// sums to zero over the experts, so the E column sums are small next to the BF16-rounded terms they
// add up: a host emulation of these roundings gave up to 2.0e-2 over 400 draws, median 4e-3, against
// 6e-3 for the router weight and 4e-3 for everything else), 4e-3 for the BF16 routing weights (one
// rounding), 1e-6 for the FP32 probabilities and S_e; the routing and counts exactly.
#include "worker/compute/cuda/cuda_moe.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "worker/compute/cpu/gpt_oss_math.h"
#include "worker/compute/cpu/moe_reference_math.h"
#include "worker/kernels/gemm.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)
using cuda_backend_internal::CudaMoeBlock;
using cuda_backend_internal::MoeKeep;
using cuda_backend_internal::MoeRouterStatsOut;
using cuda_backend_internal::MoeSaved;
using cuda_backend_internal::PoolBlock;

enum class Layout { kStacked, kFusedGateUp, kUnit };

struct Case {
  std::string name;
  MoeDims dims;
  int64_t tokens = 0;
  Layout layout = Layout::kStacked;
  int32_t dead_expert = -1;                 // no token reaches it
  std::pair<int32_t, int32_t> tie{-1, -1};  // experts with equal router rows
  bool aux = false;                         // an aux-loss gradient on dL/dp
};

MoeDims Dims(int64_t H, int64_t I, int64_t E, int64_t k, bool norm) {
  MoeDims d;
  d.hidden = H;
  d.intermediate = I;
  d.num_experts = E;
  d.top_k = k;
  d.norm_topk_prob = norm;
  return d;
}

int64_t A256(int64_t n) { return (n + 255) / 256 * 256; }

MoeOffsets Offsets(const MoeDims& d, Layout layout) {
  if (layout == Layout::kStacked) return MoeOffsets::Stacked(d);
  if (layout == Layout::kFusedGateUp) return MoeOffsets::FusedGateUp(d);
  // As ModelLayout lays a sparse unit out: something before the router, each tensor 256-aligned,
  // one expert block (gate | up | down) per expert.
  const int64_t E = d.num_experts, H = d.hidden, I = d.intermediate;
  MoeOffsets o;
  o.router = 512;
  o.gate = A256(o.router + E * H);
  o.up = o.gate + A256(I * H);
  o.down = o.up + A256(I * H);
  o.gate_up_expert_stride = o.down_expert_stride = 2 * A256(I * H) + A256(H * I);
  o.block_numel = o.gate + E * o.gate_up_expert_stride;
  return o;
}

double Bf(double v) { return Bf16ToFloat(FloatToBf16(static_cast<float>(v))); }

// Parameters (BF16 values; zero in the layout's gaps) and inputs with the exact router above.
void RandomBlock(const Case& c, const MoeOffsets& o, std::vector<double>* params, std::vector<double>* x) {
  const MoeDims& d = c.dims;
  const int64_t E = d.num_experts, H = d.hidden, I = d.intermediate, T = c.tokens;
  std::normal_distribution<double> normal;
  params->assign(o.block_numel, 0.0);
  *x = RandVec(T * H);
  // Router columns: distinct, from 1 (column 0 is the dead expert's), on the 0.125 grid in x.
  std::vector<int64_t> cols(H - 1);
  std::iota(cols.begin(), cols.end(), 1);
  std::shuffle(cols.begin(), cols.end(), Rng());
  std::uniform_int_distribution<int> grid(-24, 24), pos(0, 24), sign(0, 1), mag(1, 2);
  for (int64_t e = 0; e < E; ++e) {
    int64_t col = cols[e];
    double w = (sign(Rng()) ? -1.0 : 1.0) * mag(Rng());
    if (e == c.dead_expert) col = 0, w = -16.0;
    if (e == c.tie.second) col = cols[c.tie.first], w = (*params)[o.router + c.tie.first * H + cols[c.tie.first]];
    (*params)[o.router + e * H + col] = w;
    for (int64_t t = 0; t < T; ++t) (*x)[t * H + col] = col == 0 ? 1.0 + 0.125 * pos(Rng()) : 0.125 * grid(Rng());
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < I * H; ++i) (*params)[o.gate_at(e) + i] = Bf(normal(Rng()) / std::sqrt(double(H)));
    for (int64_t i = 0; i < I * H; ++i) (*params)[o.up_at(e) + i] = Bf(normal(Rng()) / std::sqrt(double(H)));
    for (int64_t i = 0; i < H * I; ++i) (*params)[o.down_at(e) + i] = Bf(normal(Rng()) / std::sqrt(double(I)));
  }
}

std::vector<int32_t> DownI32(const int32_t* p, size_t n) {
  std::vector<int32_t> h(n);
  cudaMemcpy(h.data(), p, n * sizeof(int32_t), cudaMemcpyDeviceToHost);
  return h;
}

std::vector<float> DownRawF32(const float* p, size_t n) {
  std::vector<float> h(n);
  cudaMemcpy(h.data(), p, n * sizeof(float), cudaMemcpyDeviceToHost);
  return h;
}

bool SameBits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// ---- GPT-OSS.

struct GptOssCase {
  std::string name;
  int64_t hidden = 0, inter = 0, experts = 0, top_k = 0, tokens = 0;
  bool padded = false;                      // tensors 256-aligned, as ModelLayout lays a unit out
  int32_t dead_expert = -1;                 // no token reaches it
  std::pair<int32_t, int32_t> tie{-1, -1};  // experts with equal router rows and biases
  bool aux = false;

  MoeDims Dims() const {
    MoeDims d = slidedp::Dims(hidden, inter, experts, top_k, false);
    d.gpt_oss = true;
    return d;
  }
};

// router [E, H] | router bias [E] | per expert: gate_up [H, 2I] | gate_up bias [2I] | down [I, H] |
// down bias [H] (a gpt_oss unit's order, MoeOffsets::InUnit), packed or 256-aligned.
MoeOffsets GptOssOffsets(const MoeDims& d, bool padded) {
  auto a = [&](int64_t n) { return padded ? A256(n) : n; };
  const int64_t E = d.num_experts, H = d.hidden, I = d.intermediate;
  MoeOffsets o;
  o.router = padded ? 512 : 0;
  o.router_bias = o.router + a(E * H);
  o.gate = o.router_bias + a(E);
  o.gate_up_bias = o.gate + a(H * 2 * I);
  o.down = o.gate_up_bias + a(2 * I);
  o.down_bias = o.down + a(I * H);
  o.gate_up_expert_stride = o.down_expert_stride = a(H * 2 * I) + a(2 * I) + a(I * H) + a(H);
  o.block_numel = o.gate + E * o.gate_up_expert_stride;
  return o;
}

// Parameters and inputs on the grids of the file comment (BF16 values; zero in the layout's gaps).
void RandomGptOssBlock(const GptOssCase& c, const MoeOffsets& o, std::vector<double>* params, std::vector<double>* x) {
  const int64_t E = c.experts, H = c.hidden, I = c.inter, T = c.tokens;
  std::normal_distribution<double> normal;
  std::uniform_int_distribution<int> x_grid(-16, 16), w_grid(-4, 4), b_grid(-24, 24);
  params->assign(o.block_numel, 0.0);
  x->resize(T * H);
  for (auto& v : *x) v = 0.125 * x_grid(Rng());
  // Router: as RandomBlock's, plus a bias on the 0.125 grid (none for the dead expert: its logits stay
  // exact at -16 .. -64).
  std::vector<int64_t> cols(H - 1);
  std::iota(cols.begin(), cols.end(), 1);
  std::shuffle(cols.begin(), cols.end(), Rng());
  std::uniform_int_distribution<int> grid(-24, 24), pos(0, 24), sign(0, 1), mag(1, 2), bias(-8, 8);
  for (int64_t e = 0; e < E; ++e) {
    int64_t col = cols[e];
    double w = (sign(Rng()) ? -1.0 : 1.0) * mag(Rng()), b = 0.125 * bias(Rng());
    if (e == c.dead_expert) col = 0, w = -16.0, b = 0.0;
    if (e == c.tie.second) {
      col = cols[c.tie.first];
      w = (*params)[o.router + c.tie.first * H + col];
      b = (*params)[o.router_bias + c.tie.first];
    }
    (*params)[o.router + e * H + col] = w;
    (*params)[o.router_bias + e] = b;
    for (int64_t t = 0; t < T; ++t) (*x)[t * H + col] = col == 0 ? 1.0 + 0.125 * pos(Rng()) : 0.125 * grid(Rng());
  }
  for (int64_t e = 0; e < E; ++e) {
    for (int64_t i = 0; i < H * 2 * I; ++i) (*params)[o.gate_at(e) + i] = 0.25 * w_grid(Rng());
    for (int64_t i = 0; i < 2 * I; ++i) (*params)[o.gate_up_bias_at(e) + i] = b_grid(Rng()) / 32.0;
    for (int64_t i = 0; i < I * H; ++i) (*params)[o.down_at(e) + i] = Bf(normal(Rng()) / std::sqrt(double(I)));
    for (int64_t i = 0; i < H; ++i) (*params)[o.down_bias_at(e) + i] = Bf(0.5 * normal(Rng()));
  }
}

// The GPU side of one case: device copies of the inputs and one forward + backward.
struct GpuRun {
  std::vector<float> out, dxn, dparams;
  std::vector<int64_t> counts;
  std::vector<int32_t> topk_expert, stat_counts;
  std::vector<float> topk_weight, probs;
  std::vector<double> prob_sums;
};

class CudaMoeGpuTest : public GpuTest {
 protected:
  void SetUp() override {
    GpuTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_OK(gemm_.Init());
    ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  void TearDown() override {
    if (stream_ != nullptr) cudaStreamDestroy(stream_);
    GpuTest::TearDown();
  }

  // Forward into a state kept as `keep`, then backward from `backward_keep`'s view of it (kNothing:
  // no state); dparams starts at g0. alias: dxn written over dout's buffer.
  void Run(const CudaMoeBlock& block, int64_t T, const bf16* params, const bf16* xn, const std::vector<float>& dy,
           const double* aux, const std::vector<float>& g0, MoeKeep keep, MoeKeep backward_keep, bool alias,
           GpuRun* r) {
    const MoeDims& d = block.dims();
    const int64_t H = d.hidden, E = d.num_experts, k = d.top_k;
    Dev<float> out(T * H), dout(T * H), dxn(T * H), dparams(g0.size());
    Dev<int32_t> stat_counts(E);
    Dev<double> prob_sums(E);
    Upload(dout, dy);
    Upload(dparams, g0);
    PoolBlock saved_block;
    MoeSaved saved;
    ASSERT_OK(block.AllocateSaved(T, keep, saved_block, &saved, stream_));
    MoeRouterStatsOut stats;
    stats.expert_counts = stat_counts.get();
    stats.prob_sums = prob_sums.get();
    const bf16_t* p = reinterpret_cast<const bf16_t*>(params);
    ASSERT_OK(block.Forward(p, xn, T, out.get(), &saved, stats, &r->counts, stream_));
    MoeSaved view = saved;  // a state with less kept: the pieces backward must recompute are dropped
    if (backward_keep != MoeKeep::kAll) {
      view.gu = nullptr;
      view.expert_out = nullptr;
      view.keep = backward_keep;
    }
    float* dx = alias ? dout.get() : dxn.get();
    ASSERT_OK(block.Backward(p, xn, T, backward_keep == MoeKeep::kNothing ? nullptr : &view, dout.get(), aux, dx,
                             dparams.get(), stream_));
    ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
    r->out = DownRawF32(out.get(), T * H);
    r->dxn = DownRawF32(dx, T * H);
    r->dparams = DownRawF32(dparams.get(), g0.size());
    r->stat_counts = DownI32(stat_counts.get(), E);
    r->prob_sums.resize(E);
    cudaMemcpy(r->prob_sums.data(), prob_sums.get(), E * sizeof(double), cudaMemcpyDeviceToHost);
    if (keep != MoeKeep::kNothing) {
      r->topk_expert = DownI32(saved.topk_expert, T * k);
      r->topk_weight = DownRawF32(saved.topk_weight, T * k);
      r->probs = DownRawF32(saved.probs, T * E);
    }
  }

  void Check(const Case& c) {
    const MoeDims& d = c.dims;
    const int64_t E = d.num_experts, H = d.hidden, I = d.intermediate, T = c.tokens;
    const MoeOffsets o = Offsets(d, c.layout);
    std::vector<double> params, x;
    RandomBlock(c, o, &params, &x);
    std::normal_distribution<float> normal;
    std::vector<float> dy(T * H), g0(o.block_numel);
    for (auto& v : dy) v = normal(Rng());  // the FP32 residual gradient: full FP32 values
    for (auto& v : g0) v = normal(Rng());  // gradients already accumulated: backward adds
    std::vector<double> aux(E);
    for (auto& v : aux) v = 1e-2 * normal(Rng());

    // CPU reference on the same values.
    const std::vector<float> pf = ToF32(params), xf = ToF32(x);
    std::vector<float> y_ref(T * H), dx_ref(T * H), grad_ref(o.block_numel, 0.0f);
    MoeActs<float> acts;
    MoeBlockForward(d, o, pf.data(), xf.data(), T, y_ref.data(), &acts, nullptr);
    MoeBlockBackward(d, o, pf.data(), xf.data(), T, acts, dy.data(), c.aux ? aux.data() : nullptr, dx_ref.data(),
                     grad_ref.data(), nullptr);

    std::unique_ptr<Dev<bf16>> dparams_bf16(NewBf16(params)), dxn(NewBf16(x));
    Dev<double> daux(E);
    Upload(daux, aux);
    const double* aux_dev = c.aux ? daux.get() : nullptr;
    auto block = CudaMoeBlock::Create(d, o, &gemm_);
    ASSERT_OK(block.status());

    GpuRun run;
    Run(*block, T, dparams_bf16->get(), dxn->get(), dy, aux_dev, g0, MoeKeep::kAll, MoeKeep::kAll, false, &run);
    if (HasFatalFailure()) return;

    // Routing: exactly the reference's.
    EXPECT_EQ(run.topk_expert, acts.topk_expert) << c.name << ": top-k experts";
    ExpectRelErr(c.name + " routing weights", Cast(run.topk_weight), Cast(acts.topk_weight), 1e-6);
    ExpectRelErr(c.name + " router probs", Cast(run.probs), Cast(acts.router_probs), 1e-6);
    EXPECT_EQ(run.counts, acts.stats.expert_counts) << c.name << ": host expert counts";
    EXPECT_EQ(std::vector<int64_t>(run.stat_counts.begin(), run.stat_counts.end()), acts.stats.expert_counts)
        << c.name << ": C_e";
    ExpectRelErr(c.name + " S_e (prob sums)", run.prob_sums, acts.stats.prob_sums, 1e-6);
    if (c.dead_expert >= 0) {
      EXPECT_EQ(run.counts[c.dead_expert], 0) << c.name << ": the dead expert got rows";
    }

    // Output and gradients.
    ExpectRelErr(c.name + " out", Cast(run.out), Cast(y_ref), 1e-2);
    ExpectRelErr(c.name + " dxn", Cast(run.dxn), Cast(dx_ref), 1e-2);
    auto grad = [&](int64_t off, int64_t n, std::vector<double>* got, std::vector<double>* ref) {
      for (int64_t i = off; i < off + n; ++i) {
        got->push_back(static_cast<double>(run.dparams[i]) - g0[i]);
        ref->push_back(grad_ref[i]);
      }
    };
    std::vector<double> gr, rr, gg, rg, gu, ru, gd, rd;
    grad(o.router, E * H, &gr, &rr);
    std::vector<char> touched(o.block_numel, 0);
    std::fill(touched.begin() + o.router, touched.begin() + o.router + E * H, 1);
    for (int64_t e = 0; e < E; ++e) {
      if (acts.stats.expert_counts[e] == 0) continue;
      grad(o.gate_at(e), I * H, &gg, &rg);
      grad(o.up_at(e), I * H, &gu, &ru);
      grad(o.down_at(e), H * I, &gd, &rd);
      std::fill(touched.begin() + o.gate_at(e), touched.begin() + o.gate_at(e) + I * H, 1);
      std::fill(touched.begin() + o.up_at(e), touched.begin() + o.up_at(e) + I * H, 1);
      std::fill(touched.begin() + o.down_at(e), touched.begin() + o.down_at(e) + H * I, 1);
    }
    ExpectRelErr(c.name + " d router", gr, rr, 2e-2);
    ExpectRelErr(c.name + " d gate_proj (experts with rows)", gg, rg, 1e-2);
    ExpectRelErr(c.name + " d up_proj", gu, ru, 1e-2);
    ExpectRelErr(c.name + " d down_proj", gd, rd, 1e-2);
    int64_t changed = 0;  // everything else (experts without rows, the layout's gaps): bit for bit g0
    for (int64_t i = 0; i < o.block_numel; ++i) {
      if (!touched[i] && std::memcmp(&run.dparams[i], &g0[i], sizeof(float)) != 0) ++changed;
    }
    EXPECT_EQ(changed, 0) << c.name << ": gradient elements outside the router and the reached experts changed";

    // Repeatability, the other saved states and dxn over dout: all bit for bit the first run.
    struct Variant {
      MoeKeep keep, backward_keep;
      bool alias;
      const char* name;
    };
    for (const Variant& v : {Variant{MoeKeep::kAll, MoeKeep::kAll, false, "again"},
                             Variant{MoeKeep::kRouting, MoeKeep::kRouting, false, "kRouting"},
                             Variant{MoeKeep::kAll, MoeKeep::kRouting, false, "kAll read as kRouting"},
                             Variant{MoeKeep::kNothing, MoeKeep::kNothing, false, "kNothing"},
                             Variant{MoeKeep::kAll, MoeKeep::kAll, true, "dxn over dout"}}) {
      GpuRun again;
      Run(*block, T, dparams_bf16->get(), dxn->get(), dy, aux_dev, g0, v.keep, v.backward_keep, v.alias, &again);
      if (HasFatalFailure()) return;
      EXPECT_TRUE(SameBits(again.out, run.out)) << c.name << " " << v.name << ": out differs";
      EXPECT_TRUE(SameBits(again.dxn, run.dxn)) << c.name << " " << v.name << ": dxn differs";
      EXPECT_TRUE(SameBits(again.dparams, run.dparams)) << c.name << " " << v.name << ": dparams differ";
      EXPECT_EQ(again.counts, run.counts) << c.name << " " << v.name;
    }
  }

  void CheckGptOss(const GptOssCase& c) {
    const MoeDims d = c.Dims();
    const int64_t E = c.experts, H = c.hidden, I = c.inter, T = c.tokens;
    const MoeOffsets o = GptOssOffsets(d, c.padded);
    std::vector<double> params, x;
    RandomGptOssBlock(c, o, &params, &x);
    std::normal_distribution<float> normal;
    std::vector<float> dy(T * H), g0(o.block_numel);
    for (auto& v : dy) v = normal(Rng());  // the FP32 residual gradient: full FP32 values
    for (auto& v : g0) v = normal(Rng());  // gradients already accumulated: backward adds
    std::vector<double> aux(E);
    for (auto& v : aux) v = 1e-2 * normal(Rng());

    // CPU reference in double on the same values.
    const std::vector<double> dyd(dy.begin(), dy.end());
    std::vector<double> y_ref(T * H), dx_ref(T * H), grad_ref(o.block_numel, 0.0);
    MoeActs<double> acts;
    GptOssMoeForward(d, o, params.data(), x.data(), T, y_ref.data(), &acts, nullptr);
    GptOssMoeBackward(d, o, params.data(), x.data(), T, acts, dyd.data(), c.aux ? aux.data() : nullptr, dx_ref.data(),
                      grad_ref.data(), nullptr);
    int64_t clamped = 0, on_limit = 0;
    for (int64_t i = 0; i < T * c.top_k * I; ++i) {
      clamped += (acts.gate[i] > 7.0) + (std::fabs(acts.up[i]) > 7.0);
      on_limit += (acts.gate[i] == 7.0) + (std::fabs(acts.up[i]) == 7.0);
    }
    EXPECT_GT(clamped, T * c.top_k * I / 10) << c.name << ": the clamps should act";
    std::printf("%s: %lld of %lld gate/up values clamped, %lld on the limit\n", c.name.c_str(),
                static_cast<long long>(clamped), static_cast<long long>(2 * T * c.top_k * I),
                static_cast<long long>(on_limit));

    std::unique_ptr<Dev<bf16>> dparams_bf16(NewBf16(params)), dxn(NewBf16(x));
    Dev<double> daux(E);
    Upload(daux, aux);
    const double* aux_dev = c.aux ? daux.get() : nullptr;
    auto block = CudaMoeBlock::Create(d, o, &gemm_);
    ASSERT_OK(block.status());

    GpuRun run;
    Run(*block, T, dparams_bf16->get(), dxn->get(), dy, aux_dev, g0, MoeKeep::kAll, MoeKeep::kAll, false, &run);
    if (HasFatalFailure()) return;

    // Routing: exactly the reference's; the weights one BF16 rounding away.
    EXPECT_EQ(run.topk_expert, acts.topk_expert) << c.name << ": top-k experts";
    ExpectRelErr(c.name + " routing weights (BF16)", Cast(run.topk_weight), acts.topk_weight, 4e-3);
    ExpectRelErr(c.name + " router probs", Cast(run.probs), acts.router_probs, 1e-6);
    EXPECT_EQ(run.counts, acts.stats.expert_counts) << c.name << ": host expert counts";
    EXPECT_EQ(std::vector<int64_t>(run.stat_counts.begin(), run.stat_counts.end()), acts.stats.expert_counts)
        << c.name << ": C_e";
    ExpectRelErr(c.name + " S_e (prob sums)", run.prob_sums, acts.stats.prob_sums, 1e-6);
    if (c.dead_expert >= 0) {
      EXPECT_EQ(run.counts[c.dead_expert], 0) << c.name << ": the dead expert got rows";
    }

    // Output and gradients.
    ExpectRelErr(c.name + " out", Cast(run.out), y_ref, 1e-2);
    ExpectRelErr(c.name + " dxn", Cast(run.dxn), dx_ref, 1e-2);
    std::vector<char> touched(o.block_numel, 0);
    auto grad = [&](int64_t off, int64_t n, std::vector<double>* got, std::vector<double>* ref) {
      for (int64_t i = off; i < off + n; ++i) {
        got->push_back(static_cast<double>(run.dparams[i]) - g0[i]);
        ref->push_back(grad_ref[i]);
        touched[i] = 1;
      }
    };
    std::vector<double> gr, rr, gbr, rbr, ggu, rgu, gbgu, rbgu, gd, rd, gbd, rbd;
    grad(o.router, E * H, &gr, &rr);
    grad(o.router_bias, E, &gbr, &rbr);
    for (int64_t e = 0; e < E; ++e) {
      if (acts.stats.expert_counts[e] == 0) continue;
      grad(o.gate_at(e), H * 2 * I, &ggu, &rgu);
      grad(o.gate_up_bias_at(e), 2 * I, &gbgu, &rbgu);
      grad(o.down_at(e), I * H, &gd, &rd);
      grad(o.down_bias_at(e), H, &gbd, &rbd);
    }
    ExpectRelErr(c.name + " d router weight", gr, rr, 2e-2);
    ExpectRelErr(c.name + " d router bias", gbr, rbr, 5e-2);
    ExpectRelErr(c.name + " d gate_up_proj (experts with rows)", ggu, rgu, 1e-2);
    ExpectRelErr(c.name + " d gate_up_proj_bias", gbgu, rbgu, 1e-2);
    ExpectRelErr(c.name + " d down_proj", gd, rd, 1e-2);
    ExpectRelErr(c.name + " d down_proj_bias", gbd, rbd, 1e-2);
    int64_t changed = 0;  // everything else (experts without rows, the layout's gaps): bit for bit g0
    for (int64_t i = 0; i < o.block_numel; ++i) {
      if (!touched[i] && std::memcmp(&run.dparams[i], &g0[i], sizeof(float)) != 0) ++changed;
    }
    EXPECT_EQ(changed, 0) << c.name << ": gradient elements outside the router and the reached experts changed";

    // Repeatability, the other saved states and dxn over dout: all bit for bit the first run.
    struct Variant {
      MoeKeep keep, backward_keep;
      bool alias;
      const char* name;
    };
    for (const Variant& v : {Variant{MoeKeep::kAll, MoeKeep::kAll, false, "again"},
                             Variant{MoeKeep::kRouting, MoeKeep::kRouting, false, "kRouting"},
                             Variant{MoeKeep::kAll, MoeKeep::kRouting, false, "kAll read as kRouting"},
                             Variant{MoeKeep::kNothing, MoeKeep::kNothing, false, "kNothing"},
                             Variant{MoeKeep::kAll, MoeKeep::kAll, true, "dxn over dout"}}) {
      GpuRun again;
      Run(*block, T, dparams_bf16->get(), dxn->get(), dy, aux_dev, g0, v.keep, v.backward_keep, v.alias, &again);
      if (HasFatalFailure()) return;
      EXPECT_TRUE(SameBits(again.out, run.out)) << c.name << " " << v.name << ": out differs";
      EXPECT_TRUE(SameBits(again.dxn, run.dxn)) << c.name << " " << v.name << ": dxn differs";
      EXPECT_TRUE(SameBits(again.dparams, run.dparams)) << c.name << " " << v.name << ": dparams differ";
      EXPECT_EQ(again.counts, run.counts) << c.name << " " << v.name;
    }
  }

  template <typename T>
  static std::vector<double> Cast(const std::vector<T>& v) {
    return std::vector<double>(v.begin(), v.end());
  }

  GemmRunner gemm_;
  cudaStream_t stream_ = nullptr;
};

TEST_F(CudaMoeGpuTest, SevenExpertsTopTwoStacked) {
  Case c;
  c.name = "H72 I40 E7 top-2 T37 renorm stacked";
  c.dims = Dims(72, 40, 7, 2, true);
  c.tokens = 37;
  c.layout = Layout::kStacked;
  c.dead_expert = 6;
  c.tie = {2, 4};
  c.aux = true;
  Check(c);
}

TEST_F(CudaMoeGpuTest, SixteenExpertsTopFourRawFused) {
  Case c;
  c.name = "H136 I24 E16 top-4 T53 raw fused";
  c.dims = Dims(136, 24, 16, 4, false);
  c.tokens = 53;
  c.layout = Layout::kFusedGateUp;
  c.dead_expert = 0;
  Check(c);
}

TEST_F(CudaMoeGpuTest, UnitLayout) {
  Case c;
  c.name = "H72 I40 E7 top-2 T37 renorm unit layout";
  c.dims = Dims(72, 40, 7, 2, true);
  c.tokens = 37;
  c.layout = Layout::kUnit;
  c.dead_expert = 3;
  c.aux = true;
  Check(c);
}

TEST_F(CudaMoeGpuTest, GptOssEightExpertsTopTwoPacked) {
  GptOssCase c;
  c.name = "gpt_oss H64 I32 E8 top-2 T211 packed";
  c.hidden = 64, c.inter = 32, c.experts = 8, c.top_k = 2, c.tokens = 211;
  c.dead_expert = 5;
  c.tie = {1, 6};
  c.aux = true;
  CheckGptOss(c);
}

TEST_F(CudaMoeGpuTest, GptOssFiveExpertsTopThreeUnitLayout) {
  GptOssCase c;
  c.name = "gpt_oss H72 I24 E5 top-3 T97 unit layout";
  c.hidden = 72, c.inter = 24, c.experts = 5, c.top_k = 3, c.tokens = 97;
  c.padded = true;
  CheckGptOss(c);
}

TEST_F(CudaMoeGpuTest, GptOssNeedsItsBiases) {
  GptOssCase c;
  c.hidden = 64, c.inter = 32, c.experts = 8, c.top_k = 2;
  MoeOffsets o = GptOssOffsets(c.Dims(), false);
  EXPECT_TRUE(CudaMoeBlock::Create(c.Dims(), o, &gemm_).ok());
  o.down_bias = -1;
  EXPECT_FALSE(CudaMoeBlock::Create(c.Dims(), o, &gemm_).ok());
  c.inter = 20;  // any intermediate size: its kernels have no 8-wide vectors
  EXPECT_TRUE(CudaMoeBlock::Create(c.Dims(), GptOssOffsets(c.Dims(), true), &gemm_).ok());
}

TEST_F(CudaMoeGpuTest, NoTokens) {
  const MoeDims d = Dims(72, 40, 7, 2, true);
  auto block = CudaMoeBlock::Create(d, MoeOffsets::Stacked(d), &gemm_);
  ASSERT_OK(block.status());
  Dev<int32_t> counts(7);
  Dev<double> sums(7);
  MoeRouterStatsOut stats;
  stats.expert_counts = counts.get();
  stats.prob_sums = sums.get();
  std::vector<int64_t> host;
  ASSERT_OK(block->Forward(nullptr, nullptr, 0, nullptr, nullptr, stats, &host, stream_));
  ASSERT_OK(block->Backward(nullptr, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr, stream_));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream_));
  EXPECT_EQ(host, std::vector<int64_t>(7, 0));
  EXPECT_EQ(DownI32(counts.get(), 7), std::vector<int32_t>(7, 0));
}

TEST_F(CudaMoeGpuTest, RejectsUnsupportedSizes) {
  EXPECT_FALSE(CudaMoeBlock::Create(Dims(72, 36, 7, 2, true), MoeOffsets::Stacked(Dims(72, 36, 7, 2, true)), &gemm_)
                   .ok());  // moe_intermediate not a multiple of 8
  EXPECT_FALSE(CudaMoeBlock::Create(Dims(72, 40, 7, 8, true), MoeOffsets::Stacked(Dims(72, 40, 7, 8, true)), &gemm_)
                   .ok());  // top_k > experts
}

}  // namespace
}  // namespace slidedp
