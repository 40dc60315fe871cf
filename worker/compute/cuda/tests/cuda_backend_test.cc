// The CUDA backend (cuda_backend.h) against the FP32 CPU backend on one decoder layer (forward and
// backward under each activation policy), the embedding (BF16 and FP32 rows, forward and backward)
// and the fused head (norm + LM head + cross entropy), for three small Qwen3 shapes (head dims 64,
// 128, 16), both residual streams and both attentions (own kernels; cuDNN with FP32 norm weights,
// skipped where libcudnn does not load). One packed micro-batch of three documents with repeated
// token ids and ignored labels; outputs NaN-poisoned first. qwen3_5 and qwen3_5_moe (the presets
// tiny-qwen3.5 and tiny-qwen3.5-moe, and Qwen3.5's head shapes at a small hidden size: attention at
// head_dim 256 with partial RoPE, Gated DeltaNet heads of 128), a Gated DeltaNet layer and a gated
// attention layer each, on a row of documents of 1, 63, 64, 65, 130 and 2 tokens, with the head's
// (1 + w) norm. gemma4 (its units share per-micro-batch state): the whole model, unit by unit in
// pipeline order (CheckGemma4). And the checkpoint conversion (ConvertActivations) against the CPU
// backend's, bit for bit.
#include "worker/compute/cuda/cuda_backend.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/numeric/bf16.h"
#include "gtest/gtest.h"
#include "worker/compute/backend.h"
#include "worker/kernels/cudnn_attention.h"
#include "worker/kernels/tests/gpu_test.h"
#include "worker/kernels/tests/kernel_test_util.h"

namespace slidedp {
namespace {

using namespace kernel_test;  // the test-support helpers (kernel_test_util.h, gpu_test.h)

struct Pair {
  std::unique_ptr<ComputeBackend> gpu, cpu;
};

// Activations: the GPU backend's activation_dtype() (BF16 or FP32 residual stream), FP32 on the CPU
// backend; both get the same BF16-representable values.
struct Act {
  std::unique_ptr<DeviceBuffer> g, c;
  int64_t n = 0;
};

int64_t GpuActBytes(const Pair& p) { return DtypeBytes(p.gpu->activation_dtype()); }

absl::Status MakeAct(Pair& p, const std::vector<double>& v, Act* a) {
  a->n = v.size();
  const int64_t ab = GpuActBytes(p);
  auto g = p.gpu->Allocate(a->n * ab);
  if (!g.ok()) return g.status();
  auto c = p.cpu->Allocate(a->n * 4);
  if (!c.ok()) return c.status();
  a->g = std::move(*g);
  a->c = std::move(*c);
  auto hb = ToBf16(v);
  auto hf = ToF32(v);
  absl::Status s = ab == 4 ? p.gpu->CopyToDevice(hf.data(), a->g->data(), a->n * 4)
                           : p.gpu->CopyToDevice(hb.data(), a->g->data(), a->n * 2);
  if (!s.ok()) return s;
  return p.cpu->CopyToDevice(hf.data(), a->c->data(), a->n * 4);
}
std::vector<double> GetG(Pair& p, DeviceBuffer& b, int64_t n) {
  if (GpuActBytes(p) == 4) {
    std::vector<float> h(n);
    (void)p.gpu->CopyToHost(b.data(), h.data(), n * 4);
    return std::vector<double>(h.begin(), h.end());
  }
  std::vector<bf16_t> h(n);
  (void)p.gpu->CopyToHost(b.data(), h.data(), n * 2);
  std::vector<double> o(n);
  for (int64_t i = 0; i < n; ++i) o[i] = Bf16ToFloat(h[i]);
  return o;
}
std::vector<double> GetF(ComputeBackend& be, const void* d, int64_t n) {
  std::vector<float> h(n);
  (void)be.CopyToHost(d, h.data(), n * 4);
  return std::vector<double>(h.begin(), h.end());
}

bool EndsWith(const std::string& s, const std::string& tail) {
  return s.size() >= tail.size() && s.compare(s.size() - tail.size(), tail.size(), tail) == 0;
}

// A tensor's random values: weights of scale 1/sqrt(fan-in), biases, norm weights near 1 (for
// qwen3_5 near 0: they act as 1 + w, except the Gated DeltaNet's gated norm), and qwen3_5's A_log and
// dt_bias as HF initializes them (A = exp(A_log) ~ 1, softplus(dt_bias) ~ 0.05).
std::vector<double> InitTensor(const ModelConfig& cfg, const TensorSlot& ts) {
  const bool norm = ts.fp32_offset >= 0, bias = ts.shape.size() == 1 && !norm;
  if (cfg.is_qwen3_5()) {
    if (EndsWith(ts.hf_name, "linear_attn.A_log")) return RandVec(ts.numel, 0.5, 0.0);
    if (EndsWith(ts.hf_name, "linear_attn.dt_bias")) return RandVec(ts.numel, 0.5, -3.0);
    if (EndsWith(ts.hf_name, "linear_attn.norm.weight")) return RandVec(ts.numel, 0.2, 1.0);
    if (EndsWith(ts.hf_name, "linear_attn.conv1d.weight")) {
      return RandVec(ts.numel, 1.0 / std::sqrt(static_cast<double>(cfg.linear.conv_kernel)));
    }
    if (norm) return RandVec(ts.numel, 0.2, 0.0);
  }
  return norm   ? RandVec(ts.numel, 0.2, 1.0)
         : bias ? RandVec(ts.numel, 0.5)
                : RandVec(ts.numel, 1.0 / std::sqrt(static_cast<double>(ts.shape[1])));
}

// RobustRouting: the CPU backend routes on FP32 logits, the CUDA backend on BF16 ones (HF autocast)
// from a BF16 xn2, so a near-tie between a token's k-th and (k+1)-th expert could route the two
// differently and fail the comparison for a reason that is not a bug. So the router reads one input
// column per expert (row e: 1 at column e, where the post-attention norm's weight is 0: a factor of
// 1), and the layer input carries a large, well separated value there, a rotation per token,
// 8 (e + t mod E): the mixer adds O(1) to those columns, so a token's expert logits keep gaps of ~8
// such units (~5.7 sigma of that noise) while rounding moves them by ~0.1; every expert gets tokens.
void RobustRoutingInput(const ModelConfig& cfg, int64_t T, std::vector<double>* x) {
  const int64_t H = cfg.hidden_size, E = cfg.num_experts;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E && e < H; ++e) (*x)[t * H + e] = 8.0 * static_cast<double>((e + t) % E);
  }
}
void RobustRoutingParams(const ModelConfig& cfg, const UnitLayout& unit, std::vector<double>* params) {
  const int64_t H = cfg.hidden_size, E = cfg.num_experts;
  const TensorSlot& router = *unit.Find(kRouter);
  const TensorSlot& post_norm = *unit.Find(kPostNorm);
  std::fill(params->begin() + router.offset_numel, params->begin() + router.offset_numel + router.numel, 0.0);
  for (int64_t e = 0; e < E && e < H; ++e) {
    (*params)[router.offset_numel + e * H + e] = 1.0;
    (*params)[post_norm.offset_numel + e] = cfg.norms_add_one() ? 0.0 : 1.0;
  }
}

// One decoder layer (`unit`, HF layer `layer` or -1) on both backends: forward and backward under
// each policy against the CPU backend's keep-all run.
void CheckLayer(const std::string& label, const ModelConfig& cfg, Pair& p, const DeviceBatch& bg,
                const DeviceBatch& bc, const UnitLayout& unit, int layer, int64_t T, Act& x, Act& y, Act& dy, Act& dx,
                const std::vector<double>& xv, bool fp32_norms) {
  const int64_t H = cfg.hidden_size;
  const int64_t AB = GpuActBytes(p);
  const bool q35 = cfg.is_qwen3_5();
  std::vector<double> params(unit.numel, 0.0);
  for (const TensorSlot& ts : unit.tensors) {
    auto v = InitTensor(cfg, ts);
    std::copy(v.begin(), v.end(), params.begin() + ts.offset_numel);
  }
  if (cfg.is_moe() && unit.Find(kRouter) != nullptr) RobustRoutingParams(cfg, unit, &params);
  auto pb = ToBf16(params);
  auto pg = p.gpu->Allocate(pb.size() * 2);
  ASSERT_OK(pg.status());
  auto pc = p.cpu->Allocate(pb.size() * 2);
  ASSERT_OK(pc.status());
  ASSERT_OK(p.gpu->CopyToDevice(pb.data(), (*pg)->data(), pb.size() * 2));
  ASSERT_OK(p.cpu->CopyToDevice(pb.data(), (*pc)->data(), pb.size() * 2));
  std::vector<float> side(unit.fp32_numel, 0.0f);
  for (const TensorSlot& ts : unit.tensors) {
    if (ts.fp32_offset < 0) continue;
    for (int64_t i = 0; i < ts.numel; ++i) {  // the BF16 value plus 0.3 of a BF16 step
      const float b = Bf16ToFloat(pb[ts.offset_numel + i]);
      side[ts.fp32_offset + i] = b + 0.3f * std::fabs(b) * 0.0078125f;
    }
  }
  auto sg = p.gpu->Allocate(std::max<int64_t>(1, side.size()) * 4);
  ASSERT_OK(sg.status());
  auto sc_side = p.cpu->Allocate(std::max<int64_t>(1, side.size()) * 4);
  ASSERT_OK(sc_side.status());
  ASSERT_OK(p.gpu->CopyToDevice(side.data(), (*sg)->data(), side.size() * 4));
  ASSERT_OK(p.cpu->CopyToDevice(side.data(), (*sc_side)->data(), side.size() * 4));
  UnitParams PG((*pg)->as<bf16_t>(), fp32_norms ? (*sg)->as<float>() : nullptr);
  UnitParams PC((*pc)->as<bf16_t>(), fp32_norms ? (*sc_side)->as<float>() : nullptr);
  if (layer >= 0) {
    PG = PG.OfLayer(layer);
    PC = PC.OfLayer(layer);
  }

  std::unique_ptr<SavedActivations> sc;
  ASSERT_OK(p.cpu->DecoderForward(PC, bc, x.c->data(), y.c->data(), ActPolicy::kKeepAll, &sc));
  auto ref_y = GetF(*p.cpu, y.c->data(), T * H);
  auto dpc = p.cpu->Allocate(unit.numel * 4);
  ASSERT_OK(dpc.status());
  ASSERT_OK(p.cpu->Memset(**dpc, 0));
  ASSERT_OK(p.cpu->DecoderBackward(PC, bc, x.c->data(), sc.get(), dy.c->data(), dx.c->data(), (*dpc)->as<float>()));
  auto ref_dx = GetF(*p.cpu, dx.c->data(), T * H);
  auto ref_dp = GetF(*p.cpu, (*dpc)->data(), unit.numel);

  // qwen3_5's layers keep nothing under any policy: two policies suffice (a kept-nothing saved object,
  // and none at all with dx aliasing dy).
  const std::vector<ActPolicy> policies =
      q35 ? std::vector<ActPolicy>{ActPolicy::kKeepAll, ActPolicy::kRecomputeLayer}
          : std::vector<ActPolicy>{ActPolicy::kKeepAll,
                                   ActPolicy::kSelective,
                                   ActPolicy::kRecomputeLayer,
                                   ActPolicy::Segment(kPieceGateUp),
                                   ActPolicy::Segment(kPieceGateUp | kPieceQkv),
                                   ActPolicy::Segment(kPieceQkv | kPieceOProj),
                                   ActPolicy::Segment(kExpensivePieces)};
  for (ActPolicy pol : policies) {
    const std::string pname = pol == ActPolicy::kKeepAll          ? "keep-all"
                              : pol == ActPolicy::kSelective      ? "selective"
                              : pol == ActPolicy::kRecomputeLayer ? "recompute"
                                                                  : "segment " + LayerPiecesName(pol.pieces);
    cudaMemset(y.g->data(), 0xFF, T * H * AB);
    cudaDeviceSynchronize();
    std::unique_ptr<SavedActivations> sg;
    ASSERT_OK(p.gpu->DecoderForward(PG, bg, x.g->data(), y.g->data(), pol, &sg));
    ASSERT_OK(p.gpu->Synchronize());
    const bool bytes_ok = sg->bytes() >= p.gpu->SavedBytesPerToken(pol) * T;
    std::printf("%s  %-58s saved=%lld B, %lld B/token\n", bytes_ok ? "PASS" : "FAIL",
                (label + " saved bytes >= SavedBytesPerToken·T " + pname).c_str(), static_cast<long long>(sg->bytes()),
                static_cast<long long>(p.gpu->SavedBytesPerToken(pol)));
    EXPECT_GE(sg->bytes(), p.gpu->SavedBytesPerToken(pol) * T)
        << label << " saved bytes >= SavedBytesPerToken·T " << pname;
    const std::vector<double> got_y = GetG(p, *y.g, T * H);
    ExpectRelErr(label + " layer fwd y [" + pname + "]", got_y, ref_y, 1.5e-2);
    if (q35 && AB == 4) {  // the layer's branches alone (x is exact in both; MoE cases make it large)
      std::vector<double> gb(T * H), rb(T * H);
      for (int64_t i = 0; i < T * H; ++i) {
        gb[i] = got_y[i] - static_cast<float>(xv[i]);
        rb[i] = ref_y[i] - static_cast<float>(xv[i]);
      }
      ExpectRelErr(label + " layer fwd y-x [" + pname + "]", gb, rb, 1.5e-2);
    }
    if (q35 || cfg.is_gemma3()) {
      EXPECT_EQ(sg->bytes(), 0) << label << " qwen3_5's and gemma3's layers keep nothing";
    } else if (pol != ActPolicy::kRecomputeLayer) {
      // What the forward kept moves out (an activation store's offload) and comes back at another
      // address before the backward reads it.
      const int64_t kept = sg->bytes();
      std::unique_ptr<DeviceBuffer> block = sg->Detach();
      ASSERT_NE(block, nullptr) << pname;
      ASSERT_EQ(block->bytes(), kept);
      std::vector<char> host(kept);
      ASSERT_OK(p.gpu->CopyToHost(block->data(), host.data(), kept));
      auto spacer = p.gpu->Allocate(kept);  // the block comes back elsewhere
      ASSERT_OK(spacer.status());
      block.reset();
      auto back = p.gpu->Allocate(kept);
      ASSERT_OK(back.status());
      ASSERT_OK(p.gpu->CopyToDevice(host.data(), (*back)->data(), kept));
      ASSERT_OK(sg->Attach(std::move(*back)));
    }
    auto dpg = p.gpu->Allocate(unit.numel * 4);
    ASSERT_OK(dpg.status());
    ASSERT_OK(p.gpu->Memset(**dpg, 0));
    // dx aliases a copy of dy (the interface allows it) on the recompute run.
    void* dx_ptr = dx.g->data();
    if (pol == ActPolicy::kRecomputeLayer) {
      cudaMemcpy(dx.g->data(), dy.g->data(), T * H * AB, cudaMemcpyDeviceToDevice);
      cudaDeviceSynchronize();
    } else {
      cudaMemset(dx.g->data(), 0xFF, T * H * AB);
      cudaDeviceSynchronize();
    }
    ASSERT_OK(p.gpu->DecoderBackward(PG, bg, x.g->data(), pol == ActPolicy::kRecomputeLayer ? nullptr : sg.get(),
                                     pol == ActPolicy::kRecomputeLayer ? dx_ptr : dy.g->data(), dx_ptr,
                                     (*dpg)->as<float>()));
    ASSERT_OK(p.gpu->Synchronize());
    // A Gated DeltaNet layer rounds its conv output, normalised q/k, core output and gated-norm
    // output to BF16 (HF's autocast does likewise) and its backward runs through two norms: measured
    // on an H100/H200 (2026-12-07) over seeds 1468229433, 7, 12345, tiny-qwen3.5 (dk = dv = 16, the
    // recurrent fallback) gave dx 1.4e-2..3.06e-2 and d input_layernorm 1.6e-2..4.06e-2 against the
    // FP32 CPU oracle in both residual modes (the chunked kernels at dk = dv = 128: 5e-3..8e-3).
    // Its bounds are 5e-2 / 6e-2; the other layers keep 3e-2 / 4e-2.
    const bool gdn_layer = unit.Find(kLinearInProjQkv) != nullptr;
    ExpectRelErr(label + " layer bwd dx [" + pname + "]", GetG(p, *dx.g, T * H), ref_dx, gdn_layer ? 5e-2 : 3e-2);
    auto got_dp = GetF(*p.gpu, (*dpg)->data(), unit.numel);
    for (const TensorSlot& ts : unit.tensors) {
      std::vector<double> gv(got_dp.begin() + ts.offset_numel, got_dp.begin() + ts.offset_numel + ts.numel);
      std::vector<double> rv(ref_dp.begin() + ts.offset_numel, ref_dp.begin() + ts.offset_numel + ts.numel);
      std::string tn = ts.hf_name.substr(ts.hf_name.find("layers.") + 7);
      ExpectRelErr(label + " layer bwd d" + tn + " [" + pname + "]", gv, rv, gdn_layer ? 6e-2 : 4e-2);
    }
  }
}

// fp32_residual: which residual stream the CUDA backend keeps (CudaBackendOptions). The tolerances
// are the BF16-stream ones in both modes (the FP32 stream is expected to be well inside them).
// attention: the backend's attention (cuDNN or the own kernels).
// fp32_norms: the norm weights also come as an FP32 side copy (UnitParams::fp32), with values
// between BF16 neighbours, which both backends must use.
// tile: the CUDA backend's tile (ComputeBackend::SetTileTokens; 0: its default, more than this
// batch): a smaller one runs the layer's token-local work and the head's norm tile by tile, tiles
// cutting documents, against the untiled CPU backend.
// layers: the decoder layers checked (HF index, passed as UnitParams::OfLayer); -1: unit 1 without
// a layer index (the dense families' layers are alike). docs: the packed row's document lengths.
// qwen3_5 (Gated DeltaNet and gated attention layers): its norms zero-centred (they act as 1 + w),
// A_log and dt_bias as HF initializes them (a decay g = -exp(A_log) softplus(a + dt_bias) near
// -0.05, so the state carries across the 64-token chunks), the branch y - x compared too (FP32
// residual). qwen3_5_moe: the routing made robust to rounding (RobustRouting above).
void CheckBackend(const std::string& label_base, const ModelConfig& cfg, bool fp32_residual,
                  CudaBackendOptions::Attention attention, bool fp32_norms, int64_t tile = 0,
                  const std::vector<int>& layers = {-1}, const std::vector<int>& docs = {37, 100, 13}) {
  const std::string label = label_base + (fp32_residual ? "[fp32 res" : "[bf16 res") +
                            (attention == CudaBackendOptions::Attention::kCudnn ? ", cudnn" : ", own") +
                            (fp32_norms ? ", fp32 norms" : "") + (tile > 0 ? ", tile " + std::to_string(tile) : "") +
                            "]";
  Pair p;
  CudaBackendOptions opt;
  opt.fp32_residual = fp32_residual;
  opt.attention = attention;
  auto g = MakeCudaBackendWithOptions(cfg, 0, opt);
  ASSERT_OK(g.status());
  auto c = MakeCpuBackend(cfg);
  ASSERT_OK(c.status());
  p.gpu = std::move(*g);
  p.cpu = std::move(*c);
  p.gpu->SetTileTokens(tile);
  const bool dtype_ok = p.gpu->activation_dtype() == (fp32_residual ? Dtype::kF32 : Dtype::kBF16);
  std::printf("%s  %-58s\n", dtype_ok ? "PASS" : "FAIL", (label + " activation_dtype matches the option").c_str());
  EXPECT_TRUE(dtype_ok) << label << " activation_dtype matches the option";
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size;
  const int64_t AB = GpuActBytes(p);  // GPU activation bytes per element
  // A packed micro-batch: documents of `docs` tokens, positions restarting, some labels ignored.
  MicroBatch mb;
  mb.cu_seqlens = {0};
  std::uniform_int_distribution<int> ut(0, static_cast<int>(V) - 1);
  for (int d : docs) {
    for (int i = 0; i < d; ++i) {
      mb.tokens.push_back(ut(Rng()) % 97);  // repeated ids exercise the embedding grouping
      mb.positions.push_back(i);
      mb.labels.push_back(i == d - 1 || i % 11 == 5 ? kIgnoreIndex : ut(Rng()));
    }
    mb.cu_seqlens.push_back(mb.cu_seqlens.back() + d);
    mb.max_seqlen = std::max(mb.max_seqlen, d);
  }
  const int64_t T = mb.num_tokens();
  auto bg = p.gpu->UploadBatch(mb);
  ASSERT_OK(bg.status());
  auto bc = p.cpu->UploadBatch(mb);
  ASSERT_OK(bc.status());

  ModelLayout layout = ModelLayout::Build(cfg);
  Act x, y, dy, dx;
  std::vector<double> xv = RandVec(T * H);
  if (cfg.is_moe()) RobustRoutingInput(cfg, T, &xv);
  ASSERT_OK(MakeAct(p, xv, &x));
  ASSERT_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &y));
  ASSERT_OK(MakeAct(p, RandVec(T * H), &dy));
  ASSERT_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &dx));
  for (const int layer : layers) {
    const UnitLayout& unit = layout.units.at(1 + std::max(layer, 0));
    const std::string llabel =
        layer < 0 ? label
                  : label + " L" + std::to_string(layer) + (cfg.IsLinearAttentionLayer(layer) ? "(gdn)" : "(attn)");
    CheckLayer(llabel, cfg, p, **bg, **bc, unit, layer, T, x, y, dy, dx, xv, fp32_norms);
    if (::testing::Test::HasFatalFailure()) return;
  }

  // Embedding forward/backward.
  {
    auto table = RandVec(V * H);
    auto tb = ToBf16(table);
    auto tg = p.gpu->Allocate(tb.size() * 2);
    auto tc = p.cpu->Allocate(tb.size() * 2);
    ASSERT_OK(tg.status());
    ASSERT_OK(tc.status());
    ASSERT_OK(p.gpu->CopyToDevice(tb.data(), (*tg)->data(), tb.size() * 2));
    ASSERT_OK(p.cpu->CopyToDevice(tb.data(), (*tc)->data(), tb.size() * 2));
    cudaMemset(y.g->data(), 0xFF, T * H * AB);
    cudaDeviceSynchronize();
    ASSERT_OK(p.gpu->EmbeddingForward((*tg)->as<bf16_t>(), **bg, y.g->data()));
    ASSERT_OK(p.cpu->EmbeddingForward((*tc)->as<bf16_t>(), **bc, y.c->data()));
    ASSERT_OK(p.gpu->Synchronize());
    ExpectRelErr(label + " embedding fwd", GetG(p, *y.g, T * H), GetF(*p.cpu, y.c->data(), T * H), 0.0);
    {  // FP32 rows (runtime.embedding_rows: fp32), off the BF16 grid
      std::vector<float> t32(V * H);
      for (int64_t i = 0; i < V * H; ++i) t32[i] = static_cast<float>(table[i]) * 1.0007f + 1e-4f;
      auto fg = p.gpu->Allocate(V * H * 4);
      auto fc = p.cpu->Allocate(V * H * 4);
      ASSERT_OK(fg.status());
      ASSERT_OK(fc.status());
      ASSERT_OK(p.gpu->CopyToDevice(t32.data(), (*fg)->data(), V * H * 4));
      ASSERT_OK(p.cpu->CopyToDevice(t32.data(), (*fc)->data(), V * H * 4));
      ASSERT_OK(p.gpu->EmbeddingForward(UnitParams((*tg)->as<bf16_t>(), (*fg)->as<float>()), **bg, y.g->data()));
      ASSERT_OK(p.cpu->EmbeddingForward(UnitParams((*tc)->as<bf16_t>(), (*fc)->as<float>()), **bc, y.c->data()));
      ASSERT_OK(p.gpu->Synchronize());
      // The CPU backend keeps FP32 activations: with the BF16 stream the GPU rounds the rows.
      ExpectRelErr(label + " embedding fwd, FP32 rows", GetG(p, *y.g, T * H), GetF(*p.cpu, y.c->data(), T * H),
                   AB == 4 ? 0.0 : 4e-3);
    }
    auto eg = p.gpu->Allocate(V * H * 4);
    auto ec = p.cpu->Allocate(V * H * 4);
    ASSERT_OK(eg.status());
    ASSERT_OK(ec.status());
    ASSERT_OK(p.gpu->Memset(**eg, 0));
    ASSERT_OK(p.cpu->Memset(**ec, 0));
    ASSERT_OK(p.gpu->EmbeddingBackward(dy.g->data(), **bg, (*eg)->as<float>()));
    ASSERT_OK(p.cpu->EmbeddingBackward(dy.c->data(), **bc, (*ec)->as<float>()));
    ASSERT_OK(p.gpu->Synchronize());
    ExpectRelErr(label + " embedding bwd", GetF(*p.gpu, (*eg)->data(), V * H), GetF(*p.cpu, (*ec)->data(), V * H),
                 1e-5);
  }
  // Head: final norm + LM head + CE, forward and backward.
  {
    auto nw = RandVec(H, 0.2, cfg.norms_add_one() ? 0.0 : 1.0);  // qwen3_5's and gemma3's final norm act as 1 + w
    auto lw = RandVec(V * H, 1.0 / std::sqrt(static_cast<double>(H)));
    auto nb = ToBf16(nw), lb = ToBf16(lw);
    auto ng = p.gpu->Allocate(H * 2), nc = p.cpu->Allocate(H * 2), lg = p.gpu->Allocate(V * H * 2),
         lc = p.cpu->Allocate(V * H * 2);
    ASSERT_OK(ng.status());
    ASSERT_OK(nc.status());
    ASSERT_OK(lg.status());
    ASSERT_OK(lc.status());
    ASSERT_OK(p.gpu->CopyToDevice(nb.data(), (*ng)->data(), H * 2));
    ASSERT_OK(p.cpu->CopyToDevice(nb.data(), (*nc)->data(), H * 2));
    ASSERT_OK(p.gpu->CopyToDevice(lb.data(), (*lg)->data(), V * H * 2));
    ASSERT_OK(p.cpu->CopyToDevice(lb.data(), (*lc)->data(), V * H * 2));
    const float loss_scale = 1.0f / static_cast<float>(mb.num_trained());
    auto dn_g = p.gpu->Allocate(H * 4), dn_c = p.cpu->Allocate(H * 4), dl_g = p.gpu->Allocate(V * H * 4),
         dl_c = p.cpu->Allocate(V * H * 4), ls_g = p.gpu->Allocate(4), ls_c = p.cpu->Allocate(4);
    ASSERT_OK(dn_g.status());
    ASSERT_OK(dn_c.status());
    ASSERT_OK(dl_g.status());
    ASSERT_OK(dl_c.status());
    ASSERT_OK(ls_g.status());
    ASSERT_OK(ls_c.status());
    for (auto* b : {dn_g->get(), dl_g->get(), ls_g->get()}) ASSERT_OK(p.gpu->Memset(*b, 0));
    for (auto* b : {dn_c->get(), dl_c->get(), ls_c->get()}) ASSERT_OK(p.cpu->Memset(*b, 0));
    cudaMemset(dx.g->data(), 0xFF, T * H * AB);
    cudaDeviceSynchronize();
    ASSERT_OK(p.gpu->HeadForwardBackward((*ng)->as<bf16_t>(), (*lg)->as<bf16_t>(), **bg, x.g->data(), loss_scale,
                                         dx.g->data(), (*dn_g)->as<float>(), (*dl_g)->as<float>(),
                                         (*ls_g)->as<float>()));
    ASSERT_OK(p.cpu->HeadForwardBackward((*nc)->as<bf16_t>(), (*lc)->as<bf16_t>(), **bc, x.c->data(), loss_scale,
                                         dx.c->data(), (*dn_c)->as<float>(), (*dl_c)->as<float>(),
                                         (*ls_c)->as<float>()));
    ASSERT_OK(p.gpu->Synchronize());
    ExpectRelErr(label + " head loss", GetF(*p.gpu, (*ls_g)->data(), 1), GetF(*p.cpu, (*ls_c)->data(), 1), 2e-3);
    ExpectRelErr(label + " head dx", GetG(p, *dx.g, T * H), GetF(*p.cpu, dx.c->data(), T * H), 3e-2);
    ExpectRelErr(label + " head dnorm", GetF(*p.gpu, (*dn_g)->data(), H), GetF(*p.cpu, (*dn_c)->data(), H), 3e-2);
    ExpectRelErr(label + " head dlm_head", GetF(*p.gpu, (*dl_g)->data(), V * H), GetF(*p.cpu, (*dl_c)->data(), V * H),
                 3e-2);
  }
}

using Attention = CudaBackendOptions::Attention;

// qwen3_5's packed row: documents of odd lengths around the Gated DeltaNet's 64-token chunks (one
// token, 63, 64, 65, two chunks and a bit, two tokens).
const std::vector<int> kQwen35Docs = {1, 63, 64, 65, 130, 2};

struct BackendCase {
  // "mini64", "mini128", "tiny", "qwen2", "llama3", "yarn", "yarn_llama", or qwen3_5's "qwen35"
  // (tiny-qwen3.5), "qwen35_moe" (tiny-qwen3.5-moe), "qwen35_hd256"
  const char* model;
  bool fp32_residual;
  Attention attention;
  int64_t tile = 0;  // CheckBackend's tile (0: untiled)
};

std::string Name(const BackendCase& c) {
  return std::string(c.model) + (c.fp32_residual ? "_Fp32Residual" : "_Bf16Residual") +
         (c.attention == Attention::kCudnn ? "_CudnnFp32Norms" : "_Own") +
         (c.tile > 0 ? "_Tile" + std::to_string(c.tile) : "");
}
std::string CaseName(const ::testing::TestParamInfo<BackendCase>& info) { return Name(info.param); }
void PrintTo(const BackendCase& c, std::ostream* os) { *os << Name(c); }

class CudaBackendGpuTest : public GpuTest, public ::testing::WithParamInterface<BackendCase> {};

TEST_P(CudaBackendGpuTest, MatchesCpuBackend) {
  const BackendCase& b = GetParam();
  if (b.attention == Attention::kCudnn) {
    absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
    if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  }
  ModelConfig c;
  c.hidden_size = 256;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 64;
  c.intermediate_size = 384;
  c.vocab_size = 1000;
  c.tie_word_embeddings = false;
  ModelConfig c128 = c;
  c128.head_dim = 128;
  c128.num_attention_heads = 4;
  c128.num_key_value_heads = 1;
  // The FP32 norm weights (the workers' default) with cuDNN (the default attention).
  const bool norms = b.attention == Attention::kCudnn;
  const std::string model = b.model;
  if (model == "mini64") {
    CheckBackend("qwen3-mini(hd64)", c, b.fp32_residual, b.attention, norms, b.tile);
  } else if (model == "mini128") {
    CheckBackend("qwen3-mini(hd128)", c128, b.fp32_residual, b.attention, norms, b.tile);
  } else if (model == "qwen2") {  // q/k/v biases, no q/k norm
    ModelConfig q = c;
    q.family = ModelFamily::kQwen2;
    CheckBackend("qwen2-mini(hd64)", q, b.fp32_residual, b.attention, norms, b.tile);
  } else if (model == "llama3") {  // no q/k norm, llama3-scaled RoPE (every band within 137 tokens)
    ModelConfig l = c128;
    l.family = ModelFamily::kLlama;
    l.rope_theta = 500000;
    l.rope_scaling.type = RopeScaling::Type::kLlama3;
    l.rope_scaling.factor = 8;
    l.rope_scaling.low_freq_factor = 1;
    l.rope_scaling.high_freq_factor = 4;
    l.rope_scaling.original_max_position_embeddings = 64;
    CheckBackend("llama3-mini(hd128)", l, b.fp32_residual, b.attention, norms, b.tile);
  } else if (model == "yarn" || model == "yarn_llama") {
    // YaRN over 64 original positions (correction range [0, 6] at hd64, [0, 11] at hd128): the
    // ramp's table and the attention factor 0.1 ln 4 + 1 on cos and sin, through the fused q/k
    // norm + RoPE kernels (qwen3) or RoPE alone (llama).
    ModelConfig y = model == "yarn" ? c : c128;
    if (model == "yarn_llama") y.family = ModelFamily::kLlama;
    y.rope_scaling.type = RopeScaling::Type::kYarn;
    y.rope_scaling.factor = 4;
    y.rope_scaling.original_max_position_embeddings = 64;
    CheckBackend(model == "yarn" ? "yarn-qwen3-mini(hd64)" : "yarn-llama-mini(hd128)", y, b.fp32_residual,
                 b.attention, norms, b.tile);
  } else if (model == "qwen35" || model == "qwen35_moe") {
    // The CI presets: layers 0 (Gated DeltaNet, 2 key / 4 value heads of 16: the recurrent fallback)
    // and 3 (gated attention, head_dim 32, RoPE on 8 of them); qwen3_5_moe: every layer sparse with a
    // shared expert (FP32 residual only).
    const std::string preset = model == "qwen35" ? "tiny-qwen3.5" : "tiny-qwen3.5-moe";
    auto q = ModelConfig::Preset(preset);
    ASSERT_OK(q.status());
    CheckBackend(preset, *q, b.fp32_residual, b.attention, norms, b.tile, {0, 3}, kQwen35Docs);
  } else if (model == "qwen35_hd256") {
    // Qwen3.5's head shapes at a small hidden size: gated attention at head_dim 256 with a quarter of
    // it rotated (cuDNN, or the own kernels' slow path), a Gated DeltaNet of 2 key and 4 value heads
    // of 128 (the chunked kernels).
    auto q = ModelConfig::Preset("tiny-qwen3.5");
    ASSERT_OK(q.status());
    q->hidden_size = 256;
    q->num_hidden_layers = 2;
    q->layer_mixers = {TokenMixer::kLinearAttention, TokenMixer::kAttention};
    q->num_attention_heads = 4;
    q->num_key_value_heads = 2;
    q->head_dim = 256;
    q->partial_rotary_factor = 0.25;
    q->intermediate_size = 512;
    q->linear = LinearAttentionConfig{2, 4, 128, 128, 4};
    ASSERT_OK(q->Validate());
    CheckBackend("qwen3.5-mini(hd256, gdn 2/4x128)", *q, b.fp32_residual, b.attention, norms, b.tile, {0, 1},
                 kQwen35Docs);
  } else if (model == "gemma3" || model == "gemma3_hd256") {
    // tiny-gemma3 (CI's preset: head_dim 16, window 16, query_pre_attn_scalar 24, soft-capped
    // logits, the scaled embedding with pad id 0 among the tokens), its layers 0 (sliding, local
    // RoPE) and 5 (full, linear-scaled global RoPE); or Gemma 3's head_dim 256 at a small hidden
    // size, a window of 48 inside documents of 37, 100 and 13 tokens.
    auto q = ModelConfig::Preset("tiny-gemma3");
    ASSERT_OK(q.status());
    std::vector<int> layers = {0, 5};
    if (model == "gemma3_hd256") {
      q->hidden_size = 256;
      q->num_hidden_layers = 2;
      q->layer_spans = {AttentionSpan::kSliding, AttentionSpan::kFull};
      q->num_attention_heads = 4;
      q->num_key_value_heads = 2;
      q->head_dim = 256;
      q->query_pre_attn_scalar = 200;
      q->sliding_window = 48;
      q->intermediate_size = 384;
      layers = {0, 1};
      ASSERT_OK(q->Validate());
    }
    CheckBackend(model == "gemma3" ? "tiny-gemma3" : "gemma3-mini(hd256, window 48)", *q, b.fp32_residual,
                 b.attention, norms, b.tile, layers);
  } else if (model == "gpt_oss") {
    // tiny-gpt-oss (CI's preset): attention sinks, q/k/v/o biases, YaRN, layer 0 sliding and layer 1
    // full, the biased top-k-then-softmax router, experts with biases and the clamped SwiGLU.
    auto q = ModelConfig::Preset("tiny-gpt-oss");
    ASSERT_OK(q.status());
    CheckBackend("tiny-gpt-oss", *q, b.fp32_residual, b.attention, norms, b.tile, {0, 1});
  } else {
    auto tiny = ModelConfig::Preset("tiny");
    if (!tiny.ok()) GTEST_SKIP() << "preset tiny: " << tiny.status().ToString();
    CheckBackend("tiny(hd16)", *tiny, b.fp32_residual, b.attention, norms, b.tile);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, CudaBackendGpuTest,
    ::testing::Values(BackendCase{"mini64", true, Attention::kOwn}, BackendCase{"mini128", true, Attention::kOwn},
                      BackendCase{"tiny", true, Attention::kOwn}, BackendCase{"mini64", false, Attention::kOwn},
                      BackendCase{"mini128", false, Attention::kOwn}, BackendCase{"tiny", false, Attention::kOwn},
                      BackendCase{"mini64", true, Attention::kCudnn}, BackendCase{"mini128", true, Attention::kCudnn},
                      BackendCase{"tiny", true, Attention::kCudnn}, BackendCase{"mini64", false, Attention::kCudnn},
                      BackendCase{"mini128", false, Attention::kCudnn}, BackendCase{"tiny", false, Attention::kCudnn},
                      BackendCase{"qwen2", true, Attention::kCudnn}, BackendCase{"qwen2", false, Attention::kOwn},
                      BackendCase{"llama3", true, Attention::kCudnn}, BackendCase{"llama3", false, Attention::kOwn},
                      BackendCase{"yarn", true, Attention::kCudnn}, BackendCase{"yarn_llama", false, Attention::kOwn},
                      // tiles of 64, 64, 22 and of 37 x 4, 2 tokens over documents of 37, 100 and 13
                      BackendCase{"mini128", true, Attention::kCudnn, 64},
                      BackendCase{"qwen2", false, Attention::kOwn, 37},
                      BackendCase{"yarn", true, Attention::kCudnn, 37},
                      // qwen3_5 (its layers run untiled; the tile case checks that they do)
                      BackendCase{"qwen35", true, Attention::kOwn}, BackendCase{"qwen35", false, Attention::kOwn},
                      BackendCase{"qwen35", true, Attention::kCudnn}, BackendCase{"qwen35", true, Attention::kOwn, 64},
                      BackendCase{"qwen35_moe", true, Attention::kOwn},
                      BackendCase{"qwen35_moe", true, Attention::kCudnn},
                      BackendCase{"qwen35_hd256", true, Attention::kCudnn},
                      BackendCase{"qwen35_hd256", false, Attention::kCudnn},
                      BackendCase{"qwen35_hd256", true, Attention::kOwn},
                      // gemma3 (FP32 residual only: the sandwich norms)
                      BackendCase{"gemma3", true, Attention::kOwn}, BackendCase{"gemma3", true, Attention::kCudnn},
                      BackendCase{"gemma3", true, Attention::kCudnn, 37},
                      BackendCase{"gemma3_hd256", true, Attention::kCudnn},
                      BackendCase{"gemma3_hd256", true, Attention::kOwn, 64},
                      // gpt_oss (sinks: the own kernels whichever is asked; FP32 residual: MoE)
                      BackendCase{"gpt_oss", true, Attention::kOwn}, BackendCase{"gpt_oss", true, Attention::kCudnn}),
    CaseName);

// gemma3 on the BF16 residual stream is refused by name (its sandwich norms run in FP32 only).
TEST(CudaBackendOptionsGpuTest, Gemma3RefusesTheBf16ResidualStream) {
  auto q = ModelConfig::Preset("tiny-gemma3");
  ASSERT_OK(q.status());
  CudaBackendOptions opt;
  opt.fp32_residual = false;
  auto g = MakeCudaBackendWithOptions(*q, 0, opt);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented) << g.status();
}

// ---- gemma4 (cuda_gemma4_layer.cc). Its units share per-micro-batch state beyond the hidden state
// (the per-layer inputs layer 0 forms, the keys and values kv-shared layers read, and their
// gradients), so the whole model runs on both backends as the pipeline drives it: the embedding
// (both tables), every layer's forward in order, the head, every layer's backward in reverse, the
// embedding's backward. Each layer gets the CPU backend's input (its forward) and output gradient
// (its backward) on both backends, so its comparison is of that layer alone and errors do not
// compound; the state each backend carries is its own.

// One unit's parameters on both backends: the same BF16 values and, with fp32_side, the FP32 side
// copy (norm weights, layer_scalar) between BF16 neighbours; an embedding unit's FP32 side is its
// FP32 rows (runtime.embedding_rows fp32), off the BF16 grid.
struct Unit2 {
  std::unique_ptr<DeviceBuffer> g, c, gs, cs;
  UnitParams PG{nullptr}, PC{nullptr};
};

void UploadUnit(Pair& p, const UnitLayout& unit, const std::vector<double>& params, bool fp32_side, Unit2* u) {
  auto pb = ToBf16(params);
  auto g = p.gpu->Allocate(pb.size() * 2);
  auto c = p.cpu->Allocate(pb.size() * 2);
  ASSERT_OK(g.status());
  ASSERT_OK(c.status());
  u->g = std::move(*g);
  u->c = std::move(*c);
  ASSERT_OK(p.gpu->CopyToDevice(pb.data(), u->g->data(), pb.size() * 2));
  ASSERT_OK(p.cpu->CopyToDevice(pb.data(), u->c->data(), pb.size() * 2));
  u->PG = UnitParams(u->g->as<bf16_t>());
  u->PC = UnitParams(u->c->as<bf16_t>());
  if (!fp32_side) return;
  std::vector<float> side;
  if (unit.kind == UnitKind::kEmbedding) {
    side.resize(params.size());
    for (size_t i = 0; i < params.size(); ++i) side[i] = static_cast<float>(params[i]) * 1.0007f + 1e-4f;
  } else {
    side.assign(std::max<int64_t>(1, unit.fp32_numel), 0.0f);
    for (const TensorSlot& ts : unit.tensors) {
      if (ts.fp32_offset < 0) continue;
      for (int64_t i = 0; i < ts.numel; ++i) {  // the BF16 value plus 0.3 of a BF16 step
        const float b = Bf16ToFloat(pb[ts.offset_numel + i]);
        side[ts.fp32_offset + i] = b + 0.3f * std::fabs(b) * 0.0078125f;
      }
    }
  }
  auto gs = p.gpu->Allocate(side.size() * 4);
  auto cs = p.cpu->Allocate(side.size() * 4);
  ASSERT_OK(gs.status());
  ASSERT_OK(cs.status());
  u->gs = std::move(*gs);
  u->cs = std::move(*cs);
  ASSERT_OK(p.gpu->CopyToDevice(side.data(), u->gs->data(), side.size() * 4));
  ASSERT_OK(p.cpu->CopyToDevice(side.data(), u->cs->data(), side.size() * 4));
  u->PG = UnitParams(u->g->as<bf16_t>(), u->gs->as<float>());
  u->PC = UnitParams(u->c->as<bf16_t>(), u->cs->as<float>());
}

// A unit's gradient, tensor by tensor, against the CPU backend's.
void ExpectUnitGrads(const std::string& label, const UnitLayout& unit, const std::vector<double>& got,
                     const std::vector<double>& ref, double tol) {
  for (const TensorSlot& ts : unit.tensors) {
    std::vector<double> gv(got.begin() + ts.offset_numel, got.begin() + ts.offset_numel + ts.numel);
    std::vector<double> rv(ref.begin() + ts.offset_numel, ref.begin() + ts.offset_numel + ts.numel);
    const size_t at = ts.hf_name.find("layers.");
    const std::string tn = at == std::string::npos ? ts.hf_name : ts.hf_name.substr(at + 7);
    ExpectRelErr(label + " d" + tn, gv, rv, tol);
  }
}

// fp32_side: the decoder units come with their FP32 side copies and the embedding with FP32 rows.
// The bounds are gemma3's (the layer's forward 1.5e-2, its dx 3e-2, its parameters' gradients
// 4e-2, the head's, the embedding's lookup exact and its scatter 1e-5); the per-layer table's
// gradient comes out of every layer's backward (each backend's own per-layer input gradient), so it
// takes the parameters' bound.
void CheckGemma4(const std::string& label_base, const ModelConfig& cfg, CudaBackendOptions::Attention attention,
                 bool fp32_side, const std::vector<int>& docs) {
  const std::string label = label_base + (attention == CudaBackendOptions::Attention::kCudnn ? "[cudnn" : "[own") +
                            (fp32_side ? ", fp32 side]" : "]");
  Pair p;
  CudaBackendOptions opt;
  opt.fp32_residual = true;  // gemma4's only stream (its sandwich norms)
  opt.attention = attention;
  auto g = MakeCudaBackendWithOptions(cfg, 0, opt);
  ASSERT_OK(g.status());
  auto c = MakeCpuBackend(cfg);
  ASSERT_OK(c.status());
  p.gpu = std::move(*g);
  p.cpu = std::move(*c);
  const int64_t H = cfg.hidden_size, V = cfg.vocab_size, L = cfg.num_hidden_layers;
  ASSERT_EQ(p.gpu->activation_dtype(), Dtype::kF32);
  ASSERT_EQ(p.gpu->SavedBytesPerToken(ActPolicy::kKeepAll), 0) << "gemma4's layers keep nothing";

  // A packed micro-batch: documents of `docs` tokens, positions restarting, some labels ignored; the
  // pad id every 7th token and a multimodal model's placeholders (embedded as pad) every 11th.
  MicroBatch mb;
  mb.cu_seqlens = {0};
  std::uniform_int_distribution<int> ut(0, static_cast<int>(V) - 1);
  const std::vector<int64_t>& placeholders = cfg.gemma4.placeholder_tokens;
  for (int d : docs) {
    for (int i = 0; i < d; ++i) {
      const int64_t t = static_cast<int64_t>(mb.tokens.size());
      int32_t tok = ut(Rng()) % 97;  // repeated ids exercise the embedding grouping
      if (t % 7 == 3) tok = static_cast<int32_t>(cfg.pad_token_id);
      if (!placeholders.empty() && t % 11 == 4) tok = static_cast<int32_t>(placeholders[t % placeholders.size()]);
      mb.tokens.push_back(tok);
      mb.positions.push_back(i);
      mb.labels.push_back(i == d - 1 || i % 11 == 5 ? kIgnoreIndex : ut(Rng()));
    }
    mb.cu_seqlens.push_back(mb.cu_seqlens.back() + d);
    mb.max_seqlen = std::max(mb.max_seqlen, d);
  }
  const int64_t T = mb.num_tokens();
  auto bg = p.gpu->UploadBatch(mb);
  ASSERT_OK(bg.status());
  auto bc = p.cpu->UploadBatch(mb);
  ASSERT_OK(bc.status());

  const ModelLayout layout = ModelLayout::Build(cfg);
  std::vector<Unit2> units(layout.num_units());
  for (int u = 0; u + 1 < layout.num_units(); ++u) {
    const UnitLayout& unit = layout.units[u];
    std::vector<double> params(unit.numel, 0.0);
    for (const TensorSlot& ts : unit.tensors) {
      // Table rows of spread 1 / their scale: layer inputs (x0, the per-layer inputs) of spread ~1
      // (rows of spread 1 would make x0 ~ 8 at hidden 64, and the per-layer gates as wide).
      const double scale = ts.offset_numel == 0 ? cfg.EmbeddingScale() : cfg.PerLayerEmbeddingScale();
      auto v = unit.kind == UnitKind::kEmbedding ? RandVec(ts.numel, 1.0 / scale) : InitTensor(cfg, ts);
      // Gemma 4's scores are unscaled: with q_norm / k_norm weights near 1 a head of d dims gives
      // logits of spread ~sqrt(d) (16 at d = 256), a softmax so sharp that BF16's rounding of q and k
      // moves dq and dk by whole percents (measured on an H100: 4-7% at d = 128 and 256 against the
      // FP32 CPU backend, every other gradient within 2%), which HF's BF16 shows as well. Weights near
      // d^-1/4 give the scores the spread of a 1/sqrt(d)-scaled model, so the comparison measures the
      // code rather than that sensitivity.
      if (&ts == unit.Find(kQNorm) || &ts == unit.Find(kKNorm)) {
        for (double& w : v) w *= std::pow(static_cast<double>(ts.numel), -0.25);
      }
      std::copy(v.begin(), v.end(), params.begin() + ts.offset_numel);
    }
    UploadUnit(p, unit, params, fp32_side, &units[u]);
    if (::testing::Test::HasFatalFailure()) return;
    if (u > 0) {
      units[u].PG = units[u].PG.OfLayer(unit.decoder_layer);
      units[u].PC = units[u].PC.OfLayer(unit.decoder_layer);
    }
  }

  // The embedding: x0 (both tables: the per-layer one reaches the layers through the batch state).
  std::vector<Act> xs(L + 1);  // xs[l]: layer l's input, the CPU backend's values on both; xs[L] the head's
  {
    Act x0;
    ASSERT_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &x0));
    cudaMemset(x0.g->data(), 0xFF, T * H * 4);
    cudaDeviceSynchronize();
    ASSERT_OK(p.gpu->EmbeddingForward(units[0].PG, **bg, x0.g->data()));
    ASSERT_OK(p.cpu->EmbeddingForward(units[0].PC, **bc, x0.c->data()));
    ASSERT_OK(p.gpu->Synchronize());
    const std::vector<double> ref = GetF(*p.cpu, x0.c->data(), T * H);
    ExpectRelErr(label + " embedding fwd", GetG(p, *x0.g, T * H), ref, 0.0);
    ASSERT_OK(MakeAct(p, ref, &xs[0]));
  }

  // Every layer's forward, in order; odd layers in place (y = x, a copy of the input) and without a
  // saved object.
  std::vector<std::unique_ptr<SavedActivations>> saved_g(L), saved_c(L);
  for (int64_t l = 0; l < L; ++l) {
    const Unit2& u = units[1 + l];
    const std::string ll = label + " L" + std::to_string(l) + (cfg.IsSlidingLayer(l) ? "(sliding" : "(full") +
                           (cfg.KvSourceLayer(l) >= 0 ? ", kv of L" + std::to_string(cfg.KvSourceLayer(l)) : "") + ")";
    Act y;
    ASSERT_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &y));
    ASSERT_OK(p.cpu->DecoderForward(u.PC, **bc, xs[l].c->data(), y.c->data(), ActPolicy::kKeepAll, &saved_c[l]));
    const bool in_place = l % 2 == 1;
    if (in_place) {
      cudaMemcpy(y.g->data(), xs[l].g->data(), T * H * 4, cudaMemcpyDeviceToDevice);
    } else {
      cudaMemset(y.g->data(), 0xFF, T * H * 4);
    }
    cudaDeviceSynchronize();
    ASSERT_OK(p.gpu->DecoderForward(u.PG, **bg, in_place ? y.g->data() : xs[l].g->data(), y.g->data(),
                                    ActPolicy::kKeepAll, in_place ? nullptr : &saved_g[l]));
    ASSERT_OK(p.gpu->Synchronize());
    if (!in_place) {
      EXPECT_EQ(saved_g[l]->bytes(), 0) << ll << " keeps nothing";
    }
    const std::vector<double> ref = GetF(*p.cpu, y.c->data(), T * H);
    ExpectRelErr(ll + " layer fwd y", GetG(p, *y.g, T * H), ref, 1.5e-2);
    ASSERT_OK(MakeAct(p, ref, &xs[l + 1]));
  }

  // The head (final norm, soft-capped logits, cross entropy) on the last layer's output.
  std::vector<double> dyv;
  {
    auto nb = ToBf16(RandVec(H, 0.2, 1.0)), lb = ToBf16(RandVec(V * H, 1.0 / std::sqrt(static_cast<double>(H))));
    auto ng = p.gpu->Allocate(H * 2), nc = p.cpu->Allocate(H * 2), lg = p.gpu->Allocate(V * H * 2),
         lc = p.cpu->Allocate(V * H * 2);
    ASSERT_OK(ng.status());
    ASSERT_OK(nc.status());
    ASSERT_OK(lg.status());
    ASSERT_OK(lc.status());
    ASSERT_OK(p.gpu->CopyToDevice(nb.data(), (*ng)->data(), H * 2));
    ASSERT_OK(p.cpu->CopyToDevice(nb.data(), (*nc)->data(), H * 2));
    ASSERT_OK(p.gpu->CopyToDevice(lb.data(), (*lg)->data(), V * H * 2));
    ASSERT_OK(p.cpu->CopyToDevice(lb.data(), (*lc)->data(), V * H * 2));
    const float loss_scale = 1.0f / static_cast<float>(mb.num_trained());
    auto dn_g = p.gpu->Allocate(H * 4), dn_c = p.cpu->Allocate(H * 4), dl_g = p.gpu->Allocate(V * H * 4),
         dl_c = p.cpu->Allocate(V * H * 4), ls_g = p.gpu->Allocate(4), ls_c = p.cpu->Allocate(4);
    ASSERT_OK(dn_g.status());
    ASSERT_OK(dn_c.status());
    ASSERT_OK(dl_g.status());
    ASSERT_OK(dl_c.status());
    ASSERT_OK(ls_g.status());
    ASSERT_OK(ls_c.status());
    for (auto* b : {dn_g->get(), dl_g->get(), ls_g->get()}) ASSERT_OK(p.gpu->Memset(*b, 0));
    for (auto* b : {dn_c->get(), dl_c->get(), ls_c->get()}) ASSERT_OK(p.cpu->Memset(*b, 0));
    Act dx;
    ASSERT_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &dx));
    cudaMemset(dx.g->data(), 0xFF, T * H * 4);
    cudaDeviceSynchronize();
    ASSERT_OK(p.gpu->HeadForwardBackward((*ng)->as<bf16_t>(), (*lg)->as<bf16_t>(), **bg, xs[L].g->data(), loss_scale,
                                         dx.g->data(), (*dn_g)->as<float>(), (*dl_g)->as<float>(),
                                         (*ls_g)->as<float>()));
    ASSERT_OK(p.cpu->HeadForwardBackward((*nc)->as<bf16_t>(), (*lc)->as<bf16_t>(), **bc, xs[L].c->data(), loss_scale,
                                         dx.c->data(), (*dn_c)->as<float>(), (*dl_c)->as<float>(),
                                         (*ls_c)->as<float>()));
    ASSERT_OK(p.gpu->Synchronize());
    dyv = GetF(*p.cpu, dx.c->data(), T * H);
    ExpectRelErr(label + " head loss", GetF(*p.gpu, (*ls_g)->data(), 1), GetF(*p.cpu, (*ls_c)->data(), 1), 2e-3);
    ExpectRelErr(label + " head dx", GetG(p, *dx.g, T * H), dyv, 3e-2);
    ExpectRelErr(label + " head dnorm", GetF(*p.gpu, (*dn_g)->data(), H), GetF(*p.cpu, (*dn_c)->data(), H), 3e-2);
    ExpectRelErr(label + " head dlm_head", GetF(*p.gpu, (*dl_g)->data(), V * H), GetF(*p.cpu, (*dl_c)->data(), V * H),
                 3e-2);
  }

  // Every layer's backward, in reverse: the kv-shared layers add their key and value gradients to
  // their source's, every layer its per-layer input gradient, and layer 0 takes them all back to
  // its input and the embedding's per-layer table. Odd layers with dx = dy and no saved object.
  for (int64_t l = L - 1; l >= 0; --l) {
    const Unit2& u = units[1 + l];
    const UnitLayout& unit = layout.units[1 + l];
    const std::string ll = label + " L" + std::to_string(l) + (cfg.IsSlidingLayer(l) ? "(sliding" : "(full") +
                           (cfg.KvSourceLayer(l) >= 0 ? ", kv of L" + std::to_string(cfg.KvSourceLayer(l)) : "") + ")";
    Act dy, dx;
    ASSERT_OK(MakeAct(p, dyv, &dy));
    ASSERT_OK(MakeAct(p, std::vector<double>(T * H, 0.0), &dx));
    auto dpg = p.gpu->Allocate(unit.numel * 4), dpc = p.cpu->Allocate(unit.numel * 4);
    ASSERT_OK(dpg.status());
    ASSERT_OK(dpc.status());
    ASSERT_OK(p.gpu->Memset(**dpg, 0));
    ASSERT_OK(p.cpu->Memset(**dpc, 0));
    ASSERT_OK(p.cpu->DecoderBackward(u.PC, **bc, xs[l].c->data(), saved_c[l].get(), dy.c->data(), dx.c->data(),
                                     (*dpc)->as<float>()));
    const bool in_place = l % 2 == 1;
    if (!in_place) {
      cudaMemset(dx.g->data(), 0xFF, T * H * 4);
      cudaDeviceSynchronize();
    }
    void* dx_g = in_place ? dy.g->data() : dx.g->data();
    ASSERT_OK(p.gpu->DecoderBackward(u.PG, **bg, xs[l].g->data(), in_place ? nullptr : saved_g[l].get(),
                                     dy.g->data(), dx_g, (*dpg)->as<float>()));
    ASSERT_OK(p.gpu->Synchronize());
    const std::vector<double> ref_dx = GetF(*p.cpu, dx.c->data(), T * H);
    ExpectRelErr(ll + " layer bwd dx", GetF(*p.gpu, dx_g, T * H), ref_dx, 3e-2);
    ExpectUnitGrads(ll + " layer bwd", unit, GetF(*p.gpu, (*dpg)->data(), unit.numel),
                    GetF(*p.cpu, (*dpc)->data(), unit.numel), 4e-2);
    dyv = ref_dx;
  }

  // The embedding's backward: embed_tokens from the same dx0 on both, embed_tokens_per_layer from
  // each backend's own per-layer input gradient; the pad row (placeholders' included) gets none.
  {
    const UnitLayout& embed = layout.units[0];
    Act dx0;
    ASSERT_OK(MakeAct(p, dyv, &dx0));
    auto eg = p.gpu->Allocate(embed.numel * 4), ec = p.cpu->Allocate(embed.numel * 4);
    ASSERT_OK(eg.status());
    ASSERT_OK(ec.status());
    ASSERT_OK(p.gpu->Memset(**eg, 0));
    ASSERT_OK(p.cpu->Memset(**ec, 0));
    ASSERT_OK(p.gpu->EmbeddingBackward(dx0.g->data(), **bg, (*eg)->as<float>()));
    ASSERT_OK(p.cpu->EmbeddingBackward(dx0.c->data(), **bc, (*ec)->as<float>()));
    ASSERT_OK(p.gpu->Synchronize());
    const std::vector<double> got = GetF(*p.gpu, (*eg)->data(), embed.numel);
    const std::vector<double> ref = GetF(*p.cpu, (*ec)->data(), embed.numel);
    for (size_t t = 0; t < embed.tensors.size(); ++t) {
      const TensorSlot& ts = embed.tensors[t];
      std::vector<double> gv(got.begin() + ts.offset_numel, got.begin() + ts.offset_numel + ts.numel);
      std::vector<double> rv(ref.begin() + ts.offset_numel, ref.begin() + ts.offset_numel + ts.numel);
      ExpectRelErr(label + " embedding bwd d" + ts.hf_name, gv, rv, t == 0 ? 1e-5 : 4e-2);
      const int64_t width = ts.shape[1], pad = cfg.pad_token_id;
      double pad_abs = 0;
      for (int64_t i = 0; i < width; ++i) pad_abs += std::fabs(gv[pad * width + i]);
      EXPECT_EQ(pad_abs, 0.0) << label << " " << ts.hf_name << ": the pad row gets no gradient";
    }
  }
}

// tiny-gemma4 (CI's preset: layers sliding, sliding, full twice over a window of 16; sliding heads
// of 16, full of 32 with one kv head whose values are its keys' projection and a quarter of their
// pairs rotated; per-layer inputs of 8; layers 4 and 5 attend with layers 3's and 2's keys and
// values through MLPs twice as wide; soft-capped logits), made multimodal so that its placeholders
// embed as pad. gemma4_hd128: the same pieces at head dims the tensor-core kernels and cuDNN take
// (sliding 128, full 256 with its own v_proj and one kv head), per-layer inputs of 16, a window of 48.
// gemma4_nople: tiny-gemma4 without per-layer inputs and sharing (31B's shape).
struct Gemma4Case {
  const char* model;  // "gemma4", "gemma4_hd128", "gemma4_nople"
  Attention attention;
};
std::string Gemma4Name(const ::testing::TestParamInfo<Gemma4Case>& info) {
  return std::string(info.param.model) + (info.param.attention == Attention::kCudnn ? "_CudnnFp32Side" : "_Own");
}
void PrintTo(const Gemma4Case& c, std::ostream* os) {
  *os << c.model << (c.attention == Attention::kCudnn ? "_CudnnFp32Side" : "_Own");
}

class CudaBackendGemma4GpuTest : public GpuTest, public ::testing::WithParamInterface<Gemma4Case> {};

TEST_P(CudaBackendGemma4GpuTest, WholeModelMatchesCpuBackendUnitByUnit) {
  const Gemma4Case& b = GetParam();
  if (b.attention == Attention::kCudnn) {
    absl::StatusOr<std::unique_ptr<kernels::CudnnAttention>> cudnn = kernels::CudnnAttention::Create(0);
    if (!cudnn.ok()) GTEST_SKIP() << "cudnn attention: " << cudnn.status().ToString();
  }
  auto q = ModelConfig::Preset("tiny-gemma4");
  ASSERT_OK(q.status());
  const std::string model = b.model;
  std::vector<int> docs = {37, 100, 13};
  if (model == "gemma4") {
    q->multimodal = true;
    q->gemma4.placeholder_tokens = {300, 301, 307};
  } else if (model == "gemma4_hd128") {
    q->hidden_size = 256;
    q->num_hidden_layers = 4;
    q->layer_spans = {AttentionSpan::kSliding, AttentionSpan::kFull, AttentionSpan::kSliding, AttentionSpan::kFull};
    q->num_attention_heads = 4;
    q->num_key_value_heads = 2;
    q->head_dim = 128;
    q->gemma4.full_head_dim = 256;
    q->gemma4.full_kv_heads = 1;
    q->gemma4.k_eq_v = false;
    q->intermediate_size = 384;
    q->gemma4.ple_dim = 16;
    q->gemma4.kv_shared_layers = 2;
    q->gemma4.double_wide_mlp = false;
    q->sliding_window = 48;
  } else {
    q->gemma4.ple_dim = 0;
    q->gemma4.ple_vocab = 0;
    q->gemma4.kv_shared_layers = 0;
    q->gemma4.double_wide_mlp = false;
  }
  ASSERT_OK(q->Validate());
  CheckGemma4(model == "gemma4" ? "tiny-gemma4(multimodal)" : model == "gemma4_hd128" ? "gemma4-mini(hd128/256)"
                                                                                       : "tiny-gemma4(no ple, no sharing)",
              *q, b.attention, b.attention == Attention::kCudnn, docs);
}

INSTANTIATE_TEST_SUITE_P(Gemma4, CudaBackendGemma4GpuTest,
                         ::testing::Values(Gemma4Case{"gemma4", Attention::kOwn}, Gemma4Case{"gemma4", Attention::kCudnn},
                                           Gemma4Case{"gemma4_hd128", Attention::kOwn},
                                           Gemma4Case{"gemma4_hd128", Attention::kCudnn},
                                           Gemma4Case{"gemma4_nople", Attention::kOwn}),
                         Gemma4Name);

// gemma4 on the BF16 residual stream is refused by name (its sandwich norms run in FP32 only), and
// so are head dims over the kernels' 256 (every released Gemma 4's full-attention layers).
TEST(CudaBackendOptionsGpuTest, Gemma4RefusesTheBf16ResidualStreamAndWideHeads) {
  auto q = ModelConfig::Preset("tiny-gemma4");
  ASSERT_OK(q.status());
  CudaBackendOptions opt;
  opt.fp32_residual = false;
  auto g = MakeCudaBackendWithOptions(*q, 0, opt);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kUnimplemented) << g.status();
  auto e2b = ModelConfig::Preset("gemma4-e2b");
  ASSERT_OK(e2b.status());
  auto w = MakeCudaBackendWithOptions(*e2b, 0, CudaBackendOptions{});
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << w.status();
  EXPECT_NE(w.status().message().find("global_head_dim"), std::string::npos) << w.status();
}

// The checkpoint conversion (runtime.checkpoint_dtype bf16) bit for bit the CPU backend's: FP32 ->
// BF16 on random bit patterns (NaNs of every payload, infinities, subnormals, ties), BF16 -> FP32
// on every pattern, an odd count (the kernels' scalar tails), a dtype to itself a copy.
using CudaConvertGpuTest = GpuTest;
TEST_F(CudaConvertGpuTest, ConvertActivationsIsTheCpuBackendsBitForBit) {
  auto tiny = ModelConfig::Preset("tiny");
  ASSERT_OK(tiny.status());
  auto g = MakeCudaBackendWithOptions(*tiny, 0, CudaBackendOptions{});
  ASSERT_OK(g.status());
  auto c = MakeCpuBackend(*tiny);
  ASSERT_OK(c.status());
  ComputeBackend& gpu = **g;
  ComputeBackend& cpu = **c;
  const int64_t n = 3 * 65536 + 7;
  std::vector<uint32_t> bits(n);
  for (auto& b : bits) b = static_cast<uint32_t>(Rng()());
  for (uint32_t i = 0; i < 65536; ++i) bits[i] = 0x3f800000u + (i << 1);  // ties and near-ties
  const uint32_t special[] = {0x7f800000u, 0xff800000u, 0x7f800001u, 0xffffffffu, 0x7fc00000u,
                              0x00000001u, 0x80000000u, 0x7f7fffffu, 0x3f808000u, 0x3f818000u};
  for (size_t i = 0; i < sizeof(special) / 4; ++i) bits[70000 + i] = special[i];
  std::vector<uint16_t> narrow_bits(n);
  for (int64_t i = 0; i < n; ++i) narrow_bits[i] = static_cast<uint16_t>(i < 65536 ? i : bits[i] >> 16);
  struct Way {
    Dtype from, to;
    const void* host;
  };
  for (const Way& w : {Way{Dtype::kF32, Dtype::kBF16, bits.data()}, Way{Dtype::kBF16, Dtype::kF32, narrow_bits.data()},
                       Way{Dtype::kF32, Dtype::kF32, bits.data()}}) {
    const int64_t in_bytes = n * DtypeBytes(w.from), out_bytes = n * DtypeBytes(w.to);
    std::vector<std::vector<uint8_t>> got;
    for (ComputeBackend* be : {&gpu, &cpu}) {
      auto src = be->Allocate(in_bytes);
      auto dst = be->Allocate(out_bytes);
      ASSERT_OK(src.status());
      ASSERT_OK(dst.status());
      ASSERT_OK(be->CopyToDevice(w.host, (*src)->data(), in_bytes));
      ASSERT_OK(be->Memset(**dst, 0xff));
      ASSERT_OK(be->ConvertActivations((*src)->data(), w.from, (*dst)->data(), w.to, n));
      got.emplace_back(out_bytes);
      ASSERT_OK(be->CopyToHost((*dst)->data(), got.back().data(), out_bytes));
    }
    int64_t differ = 0;
    for (int64_t i = 0; i < out_bytes; ++i) differ += got[0][i] != got[1][i];
    EXPECT_EQ(differ, 0) << DtypeBytes(w.from) << " -> " << DtypeBytes(w.to) << " bytes an element";
  }
  EXPECT_FALSE(gpu.ConvertActivations(nullptr, Dtype::kF32, nullptr, Dtype::kBF16, 1).ok());
  EXPECT_TRUE(gpu.ConvertActivations(nullptr, Dtype::kF32, nullptr, Dtype::kBF16, 0).ok());
}

}  // namespace
}  // namespace slidedp
