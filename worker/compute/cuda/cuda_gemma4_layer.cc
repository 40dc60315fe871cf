// The CUDA backend's gemma4 decoder layer (HF Gemma4TextDecoderLayer) and the embedding's per-layer
// table, forward and backward, matching the CPU backend (worker/compute/cpu/gemma4_math.h, whose
// header gives the layer's formula; gemma4_layer_math.cc and gemma4_model_math.cc, the FP32 oracle).
// Every RMSNorm weight acts as w (NormMode: plain); scores are unscaled (AttentionScale 1).
//
//   layer 0:  x0 = x;  mp = (bf16(x0)·Wpᵀ) hidden^-0.5 -> RMSNorm_P(mp) w_pn -> ple = (· + ple_token) 2^-0.5
//             into the batch state (Gemma4DeviceState), which every layer reads its columns of
//   xn1 = RMSNorm(x)   qkv = xn1·[Wq;Wk;Wv]ᵀ (no Wv under k_eq_v: v_raw = k_proj's output; q alone in a
//   kv-shared layer)   qr, kr = RoPE(q_norm(q)), RoPE(k_norm(k)) with the layer type's table (sliding:
//   default; full: proportional, unrotated pairs at frequency 0)   v = v_norm(v_raw) (no weight)
//   o, lse = attention(qr, kr, v), the layer's window; a kv-shared layer's kr and v are its source's,
//   which a kv-stored layer writes straight into the batch state
//   h1 = x + RMSNorm(o·Woᵀ) w_po       (SandwichForward: the branch BF16, added in FP32)
//   xn2 = RMSNorm(h1) w_pr   gu = xn2·[Wg;Wu]ᵀ   act = gelu_tanh(g)·u   h2 = h1 + RMSNorm(act·Wdᵀ) w_pf
//   h3 = h2 + RMSNorm(gelu_tanh(bf16(h2)·W_gateᵀ, an FP32 output) · ple[:, l] ·W_projᵀ) w_pp   (none: h2)
//   y = h3 · layer_scalar
//
// Backward reruns the forward from x (nothing is kept: SavedBytesPerToken 0, as gemma3's), then walks
// it in reverse; parameter gradients are ADDED into dparams, none for layer_scalar (HF's buffer). A
// layer adds its per-layer input gradient into the state's ple_grad; a kv-shared layer adds its key
// and value gradients (FP32) into its source's, which the source (later in backward) adds to its own
// before its k/v norms; layer 0 then takes the whole ple_grad back through the projection into dx
// and leaves dL/d ple_token for the embedding's backward.
//
// Limits: FP32 residual stream only; untiled (runtime.tile_tokens does not apply); head dims at most
// 256 (the q/k norm + RoPE and attention kernels'; released Gemma 4 full layers have 512: refused at
// Init and at submit, hostd/engine/job_plan.cc); no context-parallel shares (refused likewise).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "worker/compute/cuda/cuda_backend_impl.h"
#include "worker/compute/cuda/cuda_memory.h"
#include "worker/compute/cuda/gemma4_kernels.h"
#include "worker/kernels/attention.h"
#include "worker/kernels/embedding.h"
#include "worker/kernels/qk_norm_rope.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/rmsnorm.h"
#include "worker/kernels/swiglu.h"

namespace slidedp::cuda_backend_internal {
namespace {

// The kernels' limits on a layer's sizes: q/k norm + RoPE and the own attention kernels take head
// dims of at most 256 (and cuDNN's graphs 256, multiples of 8); the RMSNorm kernels rows of a
// multiple of 8 up to 8192 (the per-layer inputs' norm runs over ple_dim), the embedding rows of a
// multiple of 8 (the per-layer table's layers x ple_dim).
constexpr int64_t kMaxHeadDim = 256;
constexpr int64_t kMaxNormWidth = 8192;

// HF's Python-float scales, as FP32 multiplies them (the CPU backend's ProjectionScale, InputScale).
float ProjectionScale(int64_t hidden) { return static_cast<float>(std::pow(static_cast<double>(hidden), -0.5)); }
float InputScale() { return static_cast<float>(std::pow(2.0, -0.5)); }

}  // namespace

absl::Status CudaBackend::InitGemma4(const ModelLayout& layout) {
  const std::string family = ModelTypeName(config_.family);
  const int64_t P = config_.gemma4.ple_dim;
  if (P > 0 && (P % 8 != 0 || P > kMaxNormWidth)) {
    return absl::InvalidArgumentError(absl::StrCat(family, ": the CUDA backend takes hidden_size_per_layer_input a ",
                                                   "multiple of 8 up to ", kMaxNormWidth, ", not ", P));
  }
  gemma4_layers_.clear();
  for (int u = 1; u + 1 < layout.num_units(); ++u) {
    const UnitLayout& unit = layout.units[u];
    Gemma4Layer g;
    for (int i = 0; i < kNumDecoderTensors; ++i) {
      const TensorSlot* t = unit.Find(static_cast<DecoderTensor>(i));
      g.off[i] = t != nullptr ? t->offset_numel : -1;
      g.fp32_off[i] = t != nullptr ? t->fp32_offset : -1;
    }
    g.dims = Gemma4LayerDims::Of(config_, unit.decoder_layer);
    const int64_t hd = g.dims.attn.head_dim;
    if (hd % 8 != 0 || hd > kMaxHeadDim) {
      return absl::InvalidArgumentError(absl::StrCat(
          family, ": the CUDA backend takes head dims that are multiples of 8 up to ", kMaxHeadDim, "; layer ",
          unit.decoder_layer, " (", g.dims.sliding ? "sliding, head_dim" : "full attention, global_head_dim",
          ") has ", hd, " (use runtime.backend: cpu)"));
    }
    if (g.dims.attn.intermediate % 8 != 0) {  // GeGLU's 8-wide vectors
      return absl::InvalidArgumentError(absl::StrCat(family, ": the CUDA backend takes intermediate_size a ",
                                                     "multiple of 8; layer ", unit.decoder_layer, "'s MLP has ",
                                                     g.dims.attn.intermediate));
    }
    gemma4_layers_.push_back(g);
  }
  ple_table_offset_ = P > 0 ? layout.embedding().tensors.at(1).offset_numel : 0;
  return absl::OkStatus();
}

absl::StatusOr<const Gemma4LayerDims*> CudaBackend::SelectGemma4Layer(const UnitParams& params, const CudaBatch& b) {
  const int l = params.decoder_layer;
  if (l < 0 || l >= static_cast<int>(gemma4_layers_.size())) {
    return absl::InvalidArgumentError(absl::StrCat(ModelTypeName(config_.family), ": decoder layer ", l,
                                                   " is not one of the model's ", gemma4_layers_.size(),
                                                   " (its units must say which: UnitParams::OfLayer)"));
  }
  if (b.context()) {
    return absl::UnimplementedError(absl::StrCat(ModelTypeName(config_.family),
                                                 ": a context-parallel share on the CUDA backend (its shared keys "
                                                 "and values and per-layer inputs are not split across ranks)"));
  }
  if (b.gemma4_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(ModelTypeName(config_.family), ": decoder layer ", l, " of a batch with no embedding forward"));
  }
  const Gemma4Layer& g = gemma4_layers_[l];
  std::copy(std::begin(g.off), std::end(g.off), off_);
  std::copy(std::begin(g.fp32_off), std::end(g.fp32_off), fp32_off_);
  const DecoderDims& a = g.dims.attn;
  I_ = a.intermediate;
  nkv_ = static_cast<int>(a.kv_heads);
  hd_ = static_cast<int>(a.head_dim);
  qd_ = a.q_dim();
  kvd_ = a.kv_dim();
  q_cols_ = qd_;
  qkv_ = g.dims.kv_source >= 0 ? qd_ : qd_ + kvd_ + (g.dims.k_eq_v ? 0 : kvd_);
  return &g.dims;
}

StackedWeight CudaBackend::Gemma4QkvForwardWeight(const Gemma4LayerDims& d) const {
  if (d.kv_source >= 0) return Stack({{off_[kQProj], qd_}});
  if (d.k_eq_v) return Stack({{off_[kQProj], qd_}, {off_[kKProj], kvd_}});
  return Stack({{off_[kQProj], qd_}, {off_[kKProj], kvd_}, {off_[kVProj], kvd_}});
}

StackedWeight CudaBackend::Gemma4QkvBackwardWeight(const Gemma4LayerDims& d) const {
  if (d.kv_source >= 0) return Stack({{off_[kQProj], qd_}});
  return Stack({{off_[kQProj], qd_}, {off_[kKProj], kvd_}, {off_[d.k_eq_v ? kKProj : kVProj], kvd_}});
}

absl::Status CudaBackend::ScaleByLayerScalar(const UnitParams& params, const float* x, int64_t n, float* y) {
  const NormW s = Norm(params, kLayerScalar);
  return s.f != nullptr ? ScaleByDeviceScalar(x, n, s.f, y, stream_) : ScaleByDeviceScalar(x, n, s.b, y, stream_);
}

absl::Status CudaBackend::Gemma4EmbeddingForward(const UnitParams& embed, const CudaBatch& b) {
  b.gemma4_ = std::make_unique<Gemma4DeviceState>();
  const int64_t T = b.num_tokens_, width = config_.num_hidden_layers * config_.gemma4.ple_dim;
  if (width == 0) return absl::OkStatus();
  Gemma4DeviceState& s = *b.gemma4_;
  Carver c;
  c.Reserve(&s.ple_token, T * width);
  c.Reserve(&s.ple, T * width);
  c.Reserve(&s.ple_grad, T * width);
  RETURN_IF_ERROR(c.Alloc(s.ple_block, stream_));
  const float scale = static_cast<float>(config_.PerLayerEmbeddingScale());
  RETURN_IF_ERROR(embed.fp32 != nullptr
                      ? kernels::EmbeddingForward(embed.fp32 + ple_table_offset_, b.tokens_, T, width, s.ple_token,
                                                  stream_, scale)
                      : kernels::EmbeddingForward(reinterpret_cast<const bf16*>(embed.bf16) + ple_table_offset_,
                                                  b.tokens_, T, width, s.ple_token, stream_, scale));
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(s.ple_grad, 0, T * width * sizeof(float), stream_));
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemma4EmbeddingBackward(const CudaBatch& b, float* dembed) {
  if (b.gemma4_ == nullptr) return absl::FailedPreconditionError("EmbeddingBackward: the batch had no forward");
  const Gemma4DeviceState& s = *b.gemma4_;
  const int64_t width = config_.num_hidden_layers * config_.gemma4.ple_dim;
  // As the CPU backend: the per-layer table gets a gradient once layer 0's backward has formed it.
  if (width == 0 || !s.ple_token_grad) return absl::OkStatus();
  // The grouping leaves out pad_token_id's positions: nn.Embedding(padding_idx) gives its row none.
  return kernels::EmbeddingBackward(s.ple_grad, b.uniq_tokens_, b.seg_offsets_, b.sorted_pos_, b.num_unique_, width,
                                    dembed + ple_table_offset_, stream_,
                                    static_cast<float>(config_.PerLayerEmbeddingScale()));
}

void CudaBackend::ReserveGemma4(Carver& c, Gemma4Acts& a, int64_t T, const Gemma4LayerDims& d) const {
  const int64_t H = H_, P = d.ple_dim, LP = d.layers * d.ple_dim;
  const bool own = d.kv_source < 0;
  if (off_[kPleModelProj] >= 0) {
    c.Reserve(&a.x0, T * H);
    c.Reserve(&a.model_proj, T * LP);
    c.Reserve(&a.model_rstd, T * d.layers);
    c.Reserve(&a.model_normed, T * LP);
  }
  c.Reserve(&a.xn1, T * H);
  c.Reserve(&a.rstd1, T);
  c.Reserve(&a.qkv, T * qkv_);
  c.Reserve(&a.qr, T * qd_);
  if (own && !d.kv_stored) {
    c.Reserve(&a.kr, T * kvd_);
    c.Reserve(&a.v, T * kvd_);
  }
  if (own) c.Reserve(&a.v_rstd, T * nkv_);
  c.Reserve(&a.o, T * qd_);
  c.Reserve(&a.lse, T * nq_);
  c.Reserve(&a.ob, T * H);
  c.Reserve(&a.rstd_o, T);
  c.Reserve(&a.h1, T * H);
  c.Reserve(&a.xn2, T * H);
  c.Reserve(&a.rstd2, T);
  c.Reserve(&a.gu, T * 2 * I_);
  c.Reserve(&a.act, T * I_);
  c.Reserve(&a.down, T * H);
  c.Reserve(&a.rstd_d, T);
  c.Reserve(&a.h2, T * H);
  if (P > 0) {
    c.Reserve(&a.h2b, T * H);
    c.Reserve(&a.ple_gate, T * P);
    c.Reserve(&a.gated, T * P);
    c.Reserve(&a.ple_proj, T * H);
    c.Reserve(&a.ple_rstd, T);
  }
  c.Reserve(&a.normed, T * H);
}

absl::Status CudaBackend::Gemma4PleInputsForward(const UnitParams& params, const CudaBatch& b,
                                                 const Gemma4LayerDims& d, const void* x, const Gemma4Acts& a) {
  const int64_t T = b.num_tokens_, LP = d.layers * d.ple_dim;
  Gemma4DeviceState& s = *b.gemma4_;
  RETURN_IF_ERROR(kernels::CastF32ToBf16(static_cast<const float*>(x), T * H_, 1.0f, a.x0, stream_));
  GemmArgs g;  // model_proj = (x0 · Wpᵀ) hidden^-0.5, BF16 (HF: the linear's output times the scale)
  g.m = T;
  g.n = LP;
  g.k = H_;
  g.a = a.x0;
  g.lda = H_;
  g.b = W(params.bf16, kPleModelProj);
  g.ldb = H_;
  g.d = a.model_proj;
  g.ldd = LP;
  g.alpha = ProjectionScale(H_);
  RETURN_IF_ERROR(gemm_.Run(g, stream_));
  const NormW nw = Norm(params, kPleModelNorm);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  RETURN_IF_ERROR(nw.f != nullptr ? kernels::RmsNormForward(a.model_proj, nw.f, T * d.layers, d.ple_dim, eps,
                                                            a.model_normed, a.model_rstd, stream_)
                                  : kernels::RmsNormForward(a.model_proj, nw.b, T * d.layers, d.ple_dim, eps,
                                                            a.model_normed, a.model_rstd, stream_));
  return PleInputsCombine(a.model_normed, s.ple_token, T * LP, InputScale(), s.ple, stream_);
}

absl::Status CudaBackend::Gemma4PleInputsBackward(const UnitParams& params, const CudaBatch& b,
                                                  const Gemma4LayerDims& d, const Gemma4Acts& a, bf16* dnormed,
                                                  bf16* dproj, float* ws, void* dx, float* dparams) {
  const int64_t T = b.num_tokens_, LP = d.layers * d.ple_dim;
  Gemma4DeviceState& s = *b.gemma4_;
  // ple = (normed + ple_token) 2^-0.5: dL/d ple_token = dL/d normed = ple_grad 2^-0.5, in place (every
  // layer has added its share by now; the embedding's backward reads it).
  RETURN_IF_ERROR(ScaleF32InPlace(s.ple_grad, T * LP, InputScale(), stream_));
  s.ple_token_grad = true;
  RETURN_IF_ERROR(kernels::CastF32ToBf16(s.ple_grad, T * LP, 1.0f, dnormed, stream_));
  const NormW nw = Norm(params, kPleModelNorm);
  float* dnw = dparams + off_[kPleModelNorm];
  const bf16* no_res = nullptr;
  RETURN_IF_ERROR(nw.f != nullptr ? kernels::RmsNormBackward(dnormed, a.model_proj, nw.f, a.model_rstd, no_res,
                                                             T * d.layers, d.ple_dim, dproj, dnw, ws, stream_)
                                  : kernels::RmsNormBackward(dnormed, a.model_proj, nw.b, a.model_rstd, no_res,
                                                             T * d.layers, d.ple_dim, dproj, dnw, ws, stream_));
  // model_proj = s x0 · Wpᵀ: dx += s dproj · Wp (FP32, onto the layer's dx), dWp += s dprojᵀ · x0.
  const float scale = ProjectionScale(H_);
  GemmArgs g;
  g.op_b = GemmOp::kN;
  g.m = T;
  g.n = H_;
  g.k = LP;
  g.a = dproj;
  g.lda = LP;
  g.b = W(params.bf16, kPleModelProj);
  g.ldb = H_;
  g.c = dx;
  g.ldc = H_;
  g.d = dx;
  g.ldd = H_;
  g.out_type = Dtype::kF32;
  g.alpha = scale;
  g.beta = 1.0f;
  RETURN_IF_ERROR(gemm_.Run(g, stream_));
  float* dw = dparams + off_[kPleModelProj];
  GemmArgs w;
  w.op_a = GemmOp::kT;
  w.op_b = GemmOp::kN;
  w.m = LP;
  w.n = H_;
  w.k = T;
  w.a = dproj;
  w.lda = LP;
  w.b = a.x0;
  w.ldb = H_;
  w.c = dw;
  w.ldc = H_;
  w.d = dw;
  w.ldd = H_;
  w.out_type = Dtype::kF32;
  w.alpha = scale;
  w.beta = 1.0f;
  return gemm_.Run(w, stream_);
}

absl::Status CudaBackend::Gemma4Forward(const UnitParams& params, const CudaBatch& b, const Gemma4LayerDims& d,
                                        const void* x, const Gemma4Acts& a, void* y) {
  Gemma4DeviceState& s = *b.gemma4_;
  const int64_t T = b.num_tokens_, P = d.ple_dim;
  const int layer = params.decoder_layer;
  const float eps = static_cast<float>(config_.rms_norm_eps);
  if (off_[kPleModelProj] >= 0) RETURN_IF_ERROR(Gemma4PleInputsForward(params, b, d, x, a));

  // Attention's inputs: q (and k) normed and rotated, v normed without a weight.
  RETURN_IF_ERROR(NormForward(x, Norm(params, kInputNorm), T, a.xn1, a.rstd1));
  RETURN_IF_ERROR(StackedForward(params.bf16, Gemma4QkvForwardWeight(d), a.xn1, T, H_, a.qkv, qkv_));
  kernels::RopeArgs rope = Rope(T, layer);
  const NormW qn = Norm(params, kQNorm);
  const bf16 *keys, *values;
  if (d.kv_source < 0) {
    const NormW kn = Norm(params, kKNorm);
    RETURN_IF_ERROR(qn.f != nullptr
                        ? kernels::QkNormRopeForward(rope, a.qkv, qkv_, qn.f, kn.f, b.positions_, a.qr, a.kr, stream_)
                        : kernels::QkNormRopeForward(rope, a.qkv, qkv_, qn.b, kn.b, b.positions_, a.qr, a.kr, stream_));
    // v_norm over v_proj's output, or k_proj's under k_eq_v (before k_norm).
    RETURN_IF_ERROR(HeadRmsNormForward(a.qkv + qd_ + (d.k_eq_v ? 0 : kvd_), qkv_, T, nkv_, hd_, eps, a.v, a.v_rstd,
                                       stream_));
    keys = a.kr;
    values = a.v;
  } else {
    auto kv = s.kv.find(d.kv_source);
    if (kv == s.kv.end()) {
      return absl::FailedPreconditionError(absl::StrCat("gemma4: layer ", layer, " attends with layer ", d.kv_source,
                                                        "'s keys, which this batch's forward has not stored"));
    }
    rope.num_kv_heads = 0;  // q alone
    const float* no_kf = nullptr;
    const bf16* no_kb = nullptr;
    RETURN_IF_ERROR(qn.f != nullptr ? kernels::QkNormRopeForward(rope, a.qkv, qkv_, qn.f, no_kf, b.positions_, a.qr,
                                                                 nullptr, stream_)
                                    : kernels::QkNormRopeForward(rope, a.qkv, qkv_, qn.b, no_kb, b.positions_, a.qr,
                                                                 nullptr, stream_));
    keys = kv->second.k;
    values = kv->second.v;
  }
  const kernels::AttnArgs attn = Attn(b, layer);
  const kernels::AttnRowStrides ld = Gemma4AttnStrides();
  ASSIGN_OR_RETURN(const std::optional<int64_t> cudnn_ws, CudnnWorkspace(AttnDir::kForward, attn, ld));
  if (cudnn_ws.has_value()) {
    PoolBlock ws;
    RETURN_IF_ERROR(ws.Alloc(Align256(*cudnn_ws), stream_));
    RETURN_IF_ERROR(cudnn_->Forward(attn, {a.qr, qd_}, {keys, kvd_}, {values, kvd_}, {a.o, qd_}, a.lse, ws.get(),
                                    stream_));
  } else {
    RETURN_IF_ERROR(
        kernels::FlashAttentionForward(attn, {a.qr, qd_}, {keys, kvd_}, {values, kvd_}, {a.o, qd_}, a.lse, stream_));
  }

  // h1 = x + RMSNorm(o · Woᵀ) w_po; h2 = h1 + RMSNorm(GeGLU(RMSNorm(h1) w_pr) · Wdᵀ) w_pf.
  RETURN_IF_ERROR(
      SandwichForward(a.o, qd_, W(params.bf16, kOProj), params, kPostNorm, x, a.h1, a.ob, a.rstd_o, a.normed, T));
  RETURN_IF_ERROR(NormForward(a.h1, Norm(params, kPreFfnNorm), T, a.xn2, a.rstd2));
  RETURN_IF_ERROR(StackedForward(params.bf16, Stack({{off_[kGateProj], I_}, {off_[kUpProj], I_}}), a.xn2, T, H_,
                                 a.gu, 2 * I_));
  RETURN_IF_ERROR(kernels::SwiGluForward(a.gu, T, I_, a.act, stream_, Glu()));
  RETURN_IF_ERROR(SandwichForward(a.act, I_, W(params.bf16, kDownProj), params, kPostFfnNorm, a.h1, a.h2, a.down,
                                  a.rstd_d, a.normed, T));

  // h3 = h2 + RMSNorm(ple_proj(gelu_tanh(ple_gate(h2)) · p_l)) w_pp, into y (y null: its pieces alone).
  const float* h3 = a.h2;
  if (P > 0) {
    RETURN_IF_ERROR(kernels::CastF32ToBf16(a.h2, T * H_, 1.0f, a.h2b, stream_));
    // The gate in FP32 (HF's autocast: BF16): gelu_tanh's tail turns a negative gate's rounding into
    // percents of its output, and post_per_layer_input_norm weights exactly the tokens whose gated
    // inputs are small the most; [T, ple_dim] floats keep the CPU oracle's numerics there.
    GemmArgs g;
    g.m = T;
    g.n = P;
    g.k = H_;
    g.a = a.h2b;
    g.lda = H_;
    g.b = W(params.bf16, kPleGate);
    g.ldb = H_;
    g.d = a.ple_gate;
    g.ldd = P;
    g.out_type = Dtype::kF32;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    RETURN_IF_ERROR(PleGateForward(a.ple_gate, s.ple + layer * P, d.layers * P, T, P, a.gated, stream_));
    RETURN_IF_ERROR(SandwichForward(a.gated, P, W(params.bf16, kPleProj), params, kPlePostNorm, a.h2, y, a.ple_proj,
                                    a.ple_rstd, a.normed, T));
    h3 = static_cast<const float*>(y);
  }
  if (y == nullptr) return absl::OkStatus();
  return ScaleByLayerScalar(params, h3, T * H_, static_cast<float*>(y));  // y = h3 · layer_scalar
}

absl::Status CudaBackend::Gemma4DecoderForward(const UnitParams& params, const CudaBatch& b, const void* x, void* y,
                                               std::unique_ptr<SavedActivations>* saved) {
  ASSIGN_OR_RETURN(const Gemma4LayerDims* d, SelectGemma4Layer(params, b));
  const int64_t T = b.num_tokens_;
  {
    Carver c;
    PoolBlock block;
    Gemma4Acts a;
    ReserveGemma4(c, a, T, *d);
    RETURN_IF_ERROR(c.Alloc(block, stream_));
    if (d->kv_stored) RETURN_IF_ERROR(Gemma4StoredKv(b, params.decoder_layer, &a));
    // y may alias x: x is read before y is written (the per-layer projection, the input norm, h1).
    RETURN_IF_ERROR(Gemma4Forward(params, b, *d, x, a, y));
  }
  if (saved != nullptr) {
    auto keep = std::make_unique<CudaSaved>();
    keep->policy_ = ActPolicy::kRecomputeLayer;
    keep->num_tokens_ = T;
    Carver none;
    RETURN_IF_ERROR(keep->Allocate(none, stream_));
    *saved = std::move(keep);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemma4StoredKv(const CudaBatch& b, int layer, Gemma4Acts* a) {
  Gemma4DeviceState::SharedKv& kv = b.gemma4_->kv[layer];
  if (kv.block.get() == nullptr) {  // the first forward of this batch: the sharers' gradients start at 0
    const int64_t n = b.num_tokens_ * kvd_;
    Carver c;
    c.Reserve(&kv.k, n);
    c.Reserve(&kv.v, n);
    c.Reserve(&kv.dk, n);
    c.Reserve(&kv.dv, n);
    RETURN_IF_ERROR(c.Alloc(kv.block, stream_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kv.dk, 0, n * sizeof(float), stream_));
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(kv.dv, 0, n * sizeof(float), stream_));
  }
  a->kr = kv.k;
  a->v = kv.v;
  return absl::OkStatus();
}

absl::Status CudaBackend::Gemma4DecoderBackward(const UnitParams& params, const CudaBatch& b, const void* x,
                                                const void* dy, void* dx, float* dparams) {
  ASSIGN_OR_RETURN(const Gemma4LayerDims* dp, SelectGemma4Layer(params, b));
  const Gemma4LayerDims& d = *dp;
  Gemma4DeviceState& s = *b.gemma4_;
  const int64_t T = b.num_tokens_, H = H_, P = d.ple_dim, LP = d.layers * d.ple_dim;
  const int layer = params.decoder_layer;
  const bool own = d.kv_source < 0, projection = off_[kPleModelProj] >= 0;
  const int64_t dqkv_cols = Gemma4DqkvCols(d);
  const kernels::AttnArgs attn = Attn(b, layer);
  const kernels::AttnRowStrides ld = Gemma4AttnStrides();
  ASSIGN_OR_RETURN(const std::optional<int64_t> cudnn_ws, CudnnWorkspace(AttnDir::kBackward, attn, ld));
  kernels::RopeArgs rope = Rope(T, layer);
  if (!own) rope.num_kv_heads = 0;  // q alone

  Carver c;
  PoolBlock block;
  Gemma4Acts a;
  ReserveGemma4(c, a, T, d);
  float *dh3, *dh2 = nullptr, *dh1, *dxn, *ws;
  bf16 *dres_b, *dpre, *dact, *dgu, *dattn, *dq, *dk, *dv, *dqkv;
  bf16 *dgated = nullptr, *dgate = nullptr, *dnormed = nullptr, *dproj = nullptr;
  char* ws_attn;
  c.Reserve(&dh3, T * H);
  c.Reserve(&dh1, T * H);
  c.Reserve(&dxn, T * H);
  c.Reserve(&dres_b, T * H);
  c.Reserve(&dpre, T * H);
  c.Reserve(&dact, T * I_);
  c.Reserve(&dgu, T * 2 * I_);
  c.Reserve(&dattn, T * qd_);
  c.Reserve(&dq, T * qd_);
  c.Reserve(&dk, T * kvd_);
  c.Reserve(&dv, T * kvd_);
  c.Reserve(&dqkv, T * dqkv_cols);
  if (P > 0) {
    c.Reserve(&dh2, T * H);
    c.Reserve(&dgated, T * P);
    c.Reserve(&dgate, T * P);
  }
  if (projection) {
    c.Reserve(&dnormed, T * LP);
    c.Reserve(&dproj, T * LP);
  }
  int64_t ws_numel = std::max({kernels::RmsNormBackwardWorkspaceNumel(T, H), kernels::QkNormRopeBackwardWorkspaceNumel(rope)});
  if (projection) ws_numel = std::max(ws_numel, kernels::RmsNormBackwardWorkspaceNumel(T * d.layers, d.ple_dim));
  c.Reserve(&ws, ws_numel);
  c.Reserve(&ws_attn, cudnn_ws.has_value() ? *cudnn_ws : kernels::FlashAttentionBackwardWorkspaceBytes(attn));
  RETURN_IF_ERROR(c.Alloc(block, stream_));
  if (d.kv_stored) RETURN_IF_ERROR(Gemma4StoredKv(b, layer, &a));

  // The forward again, up to h3's pieces.
  RETURN_IF_ERROR(Gemma4Forward(params, b, d, x, a, nullptr));

  // y = h3 · layer_scalar (a buffer: no gradient of its own). dy is read here only: dx may alias it.
  RETURN_IF_ERROR(ScaleByLayerScalar(params, static_cast<const float*>(dy), T * H, dh3));
  // h3 = h2 + RMSNorm(gated · W_projᵀ) w_pp, gated = gelu_tanh(bf16(h2) · W_gateᵀ) · p_l.
  const float* dh2_or_3 = dh3;
  if (P > 0) {
    RETURN_IF_ERROR(SandwichBackward(dh3, T, W(params.bf16, kPleProj), P, a.gated, params, kPlePostNorm, a.ple_proj,
                                     a.ple_rstd, dgated, dparams + off_[kPleProj], dparams, dres_b, dpre, ws));
    RETURN_IF_ERROR(
        PleGateBackward(dgated, a.ple_gate, s.ple + layer * P, LP, T, P, s.ple_grad + layer * P, dgate, stream_));
    RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, Stack({{off_[kPleGate], P}}), dgate, P, a.h2b, T, H, dxn,
                                    Dtype::kF32));
    RETURN_IF_ERROR(kernels::AddF32(dh3, dxn, T * H, dh2, stream_));
    dh2_or_3 = dh2;
  }
  // h2 = h1 + RMSNorm(act · Wdᵀ) w_pf, act = GeGLU(RMSNorm(h1) w_pr): dh1 = dh2 + the MLP's share.
  RETURN_IF_ERROR(SandwichBackward(dh2_or_3, T, W(params.bf16, kDownProj), I_, a.act, params, kPostFfnNorm, a.down,
                                   a.rstd_d, dact, dparams + off_[kDownProj], dparams, dres_b, dpre, ws));
  RETURN_IF_ERROR(kernels::SwiGluBackward(a.gu, dact, T, I_, dgu, stream_, Glu()));
  RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, Stack({{off_[kGateProj], I_}, {off_[kUpProj], I_}}), dgu,
                                  2 * I_, a.xn2, T, H, dxn, Dtype::kF32));
  RETURN_IF_ERROR(NormBackward(dxn, a.h1, Norm(params, kPreFfnNorm), a.rstd2, dh2_or_3, T, dh1,
                               dparams + off_[kPreFfnNorm], ws));
  // h1 = x + RMSNorm(o · Woᵀ) w_po.
  RETURN_IF_ERROR(SandwichBackward(dh1, T, W(params.bf16, kOProj), qd_, a.o, params, kPostNorm, a.ob, a.rstd_o, dattn,
                                   dparams + off_[kOProj], dparams, dres_b, dpre, ws));

  // Attention, with its own keys and values or its source layer's.
  Gemma4DeviceState::SharedKv* shared = nullptr;
  if (!own || d.kv_stored) {
    auto kv = s.kv.find(own ? layer : d.kv_source);
    if (kv == s.kv.end()) {
      return absl::FailedPreconditionError(
          absl::StrCat("gemma4: layer ", layer, "'s backward without its batch's stored keys and values"));
    }
    shared = &kv->second;
  }
  const bf16* keys = own ? a.kr : shared->k;
  const bf16* values = own ? a.v : shared->v;
  RETURN_IF_ERROR(cudnn_ws.has_value()
                      ? cudnn_->Backward(attn, {a.qr, qd_}, {keys, kvd_}, {values, kvd_}, {a.o, qd_}, a.lse,
                                         {dattn, qd_}, {dq, qd_}, {dk, kvd_}, {dv, kvd_}, ws_attn, stream_)
                      : kernels::FlashAttentionBackward(attn, {a.qr, qd_}, {keys, kvd_}, {values, kvd_}, {a.o, qd_},
                                                        a.lse, {dattn, qd_}, {dq, qd_}, {dk, kvd_}, {dv, kvd_}, ws_attn,
                                                        stream_));
  const int64_t kv_numel = T * kvd_;
  if (!own) {  // the source layer's keys and values: their gradient waits in the state (FP32)
    RETURN_IF_ERROR(kernels::AddBf16ToF32(shared->dk, dk, kv_numel, shared->dk, stream_));
    RETURN_IF_ERROR(kernels::AddBf16ToF32(shared->dv, dv, kv_numel, shared->dv, stream_));
  } else if (d.kv_stored) {  // the sharing layers' gradients, all added by now (they come later)
    RETURN_IF_ERROR(kernels::AddBf16ToF32(shared->dk, dk, kv_numel, shared->dk, stream_));
    RETURN_IF_ERROR(kernels::AddBf16ToF32(shared->dv, dv, kv_numel, shared->dv, stream_));
    RETURN_IF_ERROR(kernels::CastF32ToBf16(shared->dk, kv_numel, 1.0f, dk, stream_));
    RETURN_IF_ERROR(kernels::CastF32ToBf16(shared->dv, kv_numel, 1.0f, dv, stream_));
  }

  // q/k norm + RoPE (q alone in a kv-shared layer) and v_norm, into dqkv's q | k | v columns.
  const NormW qn = Norm(params, kQNorm);
  float* dqn = dparams + off_[kQNorm];
  if (own) {
    const NormW kn = Norm(params, kKNorm);
    float* dkn = dparams + off_[kKNorm];
    RETURN_IF_ERROR(qn.f != nullptr ? kernels::QkNormRopeBackward(rope, dq, dk, a.qkv, qkv_, qn.f, kn.f, b.positions_,
                                                                  dqkv, dqkv_cols, dqn, dkn, ws, stream_)
                                    : kernels::QkNormRopeBackward(rope, dq, dk, a.qkv, qkv_, qn.b, kn.b, b.positions_,
                                                                  dqkv, dqkv_cols, dqn, dkn, ws, stream_));
    RETURN_IF_ERROR(HeadRmsNormBackward(dv, a.qkv + qd_ + (d.k_eq_v ? 0 : kvd_), qkv_, a.v_rstd, T, nkv_, hd_,
                                        dqkv + qd_ + kvd_, dqkv_cols, stream_));
  } else {
    const float* no_kf = nullptr;
    const bf16* no_kb = nullptr;
    RETURN_IF_ERROR(qn.f != nullptr ? kernels::QkNormRopeBackward(rope, dq, nullptr, a.qkv, qkv_, qn.f, no_kf,
                                                                  b.positions_, dqkv, dqkv_cols, dqn, nullptr, ws,
                                                                  stream_)
                                    : kernels::QkNormRopeBackward(rope, dq, nullptr, a.qkv, qkv_, qn.b, no_kb,
                                                                  b.positions_, dqkv, dqkv_cols, dqn, nullptr, ws,
                                                                  stream_));
  }
  // The projections (under k_eq_v k_proj's twice: keys and values), then the input norm; dx is
  // written only now.
  RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, Gemma4QkvBackwardWeight(d), dqkv, dqkv_cols, a.xn1, T, H, dxn,
                                  Dtype::kF32));
  RETURN_IF_ERROR(
      NormBackward(dxn, x, Norm(params, kInputNorm), a.rstd1, dh1, T, dx, dparams + off_[kInputNorm], ws));
  if (!projection) return absl::OkStatus();
  return Gemma4PleInputsBackward(params, b, d, a, dnormed, dproj, ws, dx, dparams);
}

}  // namespace slidedp::cuda_backend_internal
