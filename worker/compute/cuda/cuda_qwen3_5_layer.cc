// The CUDA backend's qwen3_5 / qwen3_5_moe decoder layer (HF Qwen3_5DecoderLayer), forward and
// backward, matching the CPU backend (worker/compute/cpu/dense_decoder_layer_math.cc and
// gated_delta_math.h, the FP32 oracle). Every RMSNorm weight acts as 1 + w (NormMode, also the
// head's final norm), except the Gated DeltaNet's gated norm.
//
//   xn1 = RMSNorm(x)
//   mixer, gated full attention: qkv = xn1·[Wq;Wk;Wv]ᵀ (q_proj's rows [query | gate] per head, so
//          the fused rows are [q + gates (2 qd) | k | v]) -> q/k (1+w) norms + RoPE on rotary_dim
//          -> attention (cuDNN; hd 256) -> og = o·σ(gate) -> h1 = x + og·Woᵀ
//   mixer, Gated DeltaNet: proj = xn1·[Wqkv;Wz;Wb;Wa]ᵀ -> causal conv1d + SiLU (q|k, v) -> L2 norm
//          of q, k -> g, beta (A_log, dt_bias in FP32 from the side copy) -> gated delta rule
//          (chunked kernels; the recurrent fallback for other head dims) -> gated RMSNorm(core, z)
//          (FP32 weight) -> h1 = x + gated·Woutᵀ
//   xn2 = RMSNorm(h1)
//   MLP, dense: y = h1 + SwiGLU(xn2·[Wg;Wu]ᵀ)·Wdᵀ
//   MLP, sparse (qwen3_5_moe): y = h1 + MoE(xn2) + σ(xn2·w_gate)·SwiGLU_shared(xn2)  (FP32 sum)
//
// Nothing is kept from forward (SavedBytesPerToken is 0, the CudaSaved it hands out is empty):
// backward reruns the layer's forward from x, as the CPU backend does for these layers, then walks it
// in reverse; parameter gradients are ADDED into dparams. The layer runs untiled (runtime.tile_tokens
// does not apply: the Gated DeltaNet mixes every token, and one path for both mixers). A
// context-parallel share is refused for a Gated DeltaNet layer (its state would have to cross ranks;
// hostd refuses such jobs at submit).
#include <cuda_runtime.h>

#include <algorithm>
#include <memory>
#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "worker/compute/cpu/gated_delta_math.h"
#include "worker/compute/cuda/cuda_backend_impl.h"
#include "worker/compute/cuda/cuda_memory.h"
#include "worker/compute/cuda/qwen3_5_kernels.h"
#include "worker/kernels/attention.h"
#include "worker/kernels/gated_delta.h"
#include "worker/kernels/gdn_ops.h"
#include "worker/kernels/reductions.h"
#include "worker/kernels/swiglu.h"

namespace slidedp::cuda_backend_internal {
namespace {

// The own attention kernels run head dims other than 64 and 128 (Qwen3.5's 256) on their slow path,
// one warp per (token, head): fine for test-sized batches, hours for a training batch. Longer
// batches at such a head dim need cuDNN.
constexpr int64_t kSlowAttentionMaxTokens = 8192;

// q and k's L2 norm epsilon (HF l2norm's default; the CPU oracle's).
constexpr float kL2NormEps = static_cast<float>(LinearAttentionDims::kL2NormEps);

}  // namespace

absl::Status CudaBackend::InitQwen3_5(const ModelLayout& layout) {
  const LinearAttentionConfig& la = config_.linear;
  if (config_.NumLinearAttentionLayers() > 0) {
    // gdn_ops: heads of at most 256 values (L2 norm, gated norm), conv kernels of at most 8 taps.
    if (la.key_head_dim > 256 || la.value_head_dim > 256 || la.conv_kernel > 8) {
      return absl::InvalidArgumentError(
          absl::StrCat(ModelTypeName(config_.family), ": the CUDA backend's Gated DeltaNet takes head dims <= 256 and ",
                       "conv kernels <= 8, not linear_key_head_dim ", la.key_head_dim, ", linear_value_head_dim ",
                       la.value_head_dim, ", linear_conv_kernel_dim ", la.conv_kernel));
    }
    if (!ChunkedDelta()) {
      RETURN_IF_ERROR(CheckRecurrentDelta(DeltaArgs(1, 1, nullptr)));
      LOG(WARNING) << "CUDA backend: Gated DeltaNet head dims " << la.key_head_dim << "/" << la.value_head_dim
                   << " are not the chunked kernels' (64 or 128); the recurrent fallback runs them (test-sized "
                      "models: sequential over tokens, every state kept in backward)";
    }
  }
  if (config_.has_shared_expert() && config_.shared_expert_intermediate_size % 8 != 0) {  // SwiGLU's 8-wide vectors
    return absl::InvalidArgumentError(absl::StrCat(ModelTypeName(config_.family),
                                                   ": the CUDA backend's shared expert needs "
                                                   "shared_expert_intermediate_size a multiple of 8, not ",
                                                   config_.shared_expert_intermediate_size));
  }
  if (config_.num_hidden_layers > config_.NumLinearAttentionLayers() && options_.deterministic &&
      !kernels::FlashAttentionFastPath(hd_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runtime.deterministic with ", ModelTypeName(config_.family), ": the ordered-dQ attention backward takes ",
        "head_dim 64 or 128, and this model's is ", hd_, " (run without deterministic)"));
  }
  layer_shapes_.clear();
  for (int u = 1; u + 1 < layout.num_units(); ++u) {
    const UnitLayout& unit = layout.units[u];
    LayerShape s;
    for (int i = 0; i < kNumDecoderTensors; ++i) {
      const TensorSlot* t = unit.Find(static_cast<DecoderTensor>(i));
      s.off[i] = t != nullptr ? t->offset_numel : -1;
      s.fp32_off[i] = t != nullptr ? t->fp32_offset : -1;
    }
    if (unit.sparse()) {
      // The two mixers' units put the router and the experts at different offsets: a block each.
      ASSIGN_OR_RETURN(CudaMoeBlock block,
                       CudaMoeBlock::Create(MoeDims::Of(config_), MoeOffsets::InUnit(unit), &gemm_));
      moe_blocks_.push_back(std::make_unique<CudaMoeBlock>(std::move(block)));
      s.moe = moe_blocks_.back().get();
    }
    layer_shapes_.push_back(s);
  }
  return absl::OkStatus();
}

absl::Status CudaBackend::SelectLayer(const UnitParams& params) {
  const int l = params.decoder_layer;
  if (l < 0 || l >= static_cast<int>(layer_shapes_.size())) {
    return absl::InvalidArgumentError(absl::StrCat(ModelTypeName(config_.family), ": decoder layer ", l,
                                                   " is not one of the model's ", layer_shapes_.size(),
                                                   " (its units must say which: UnitParams::OfLayer)"));
  }
  const LayerShape& s = layer_shapes_[l];
  std::copy(std::begin(s.off), std::end(s.off), off_);
  std::copy(std::begin(s.fp32_off), std::end(s.fp32_off), fp32_off_);
  moe_ = s.moe;
  const LinearAttentionConfig& la = config_.linear;
  if (config_.IsLinearAttentionLayer(l)) {
    lin_w_ = Stack({{off_[kLinearInProjQkv], la.conv_dim()},
                    {off_[kLinearInProjZ], la.value_dim()},
                    {off_[kLinearInProjB], la.num_value_heads},
                    {off_[kLinearInProjA], la.num_value_heads}});
  } else {
    qkv_w_ = Stack({{off_[kQProj], q_cols_}, {off_[kKProj], kvd_}, {off_[kVProj], kvd_}});
  }
  if (s.moe == nullptr) {
    gu_w_ = Stack({{off_[kGateProj], I_}, {off_[kUpProj], I_}});
  } else if (config_.has_shared_expert()) {
    const int64_t S = config_.shared_expert_intermediate_size;
    shared_gu_w_ = Stack({{off_[kSharedGateProj], S}, {off_[kSharedUpProj], S}});
  }
  return absl::OkStatus();
}

void CudaBackend::ReserveHybrid(Carver& c, HybridActs& a, int64_t T, bool linear, int sparse) const {
  LayerActs& l = a.l;
  c.Reserve(&l.xn1, T * H_);
  c.Reserve(&l.rstd1, T);
  c.ReserveBytes(&l.h1, T * H_ * act_bytes());
  c.Reserve(&l.xn2, T * H_);
  c.Reserve(&l.rstd2, T);
  if (f32()) c.Reserve(&a.branch, T * H_);
  if (linear) {
    const LinearAttentionConfig& la = config_.linear;
    const int64_t KD = la.key_dim(), VD = la.value_dim(), nv = la.num_value_heads;
    c.Reserve(&a.proj, T * (la.conv_dim() + VD + 2 * nv));
    c.Reserve(&a.qk_conv, T * 2 * KD);
    c.Reserve(&a.v_conv, T * VD);
    c.Reserve(&a.qn, T * KD);
    c.Reserve(&a.kn, T * KD);
    c.Reserve(&a.g, T * nv);
    c.Reserve(&a.beta, T * nv);
    c.Reserve(&a.core, T * VD);
    c.Reserve(&a.gated, T * VD);
  } else {
    c.Reserve(&l.qkv, T * qkv_);
    c.Reserve(&l.qr, T * qd_);
    c.Reserve(&l.kr, T * kvd_);
    c.Reserve(&l.o, T * qd_);
    c.Reserve(&l.lse, T * nq_);
    c.Reserve(&a.og, T * qd_);
  }
  if (sparse < 0) {
    c.Reserve(&l.gu, T * 2 * I_);
    c.Reserve(&l.act, T * I_);
    return;
  }
  c.Reserve(&a.moe_out, T * H_);
  if (config_.has_shared_expert()) {
    const int64_t S = config_.shared_expert_intermediate_size;
    c.Reserve(&a.shared_gu, T * 2 * S);
    c.Reserve(&a.shared_act, T * S);
    c.Reserve(&a.shared_out, T * H_);
    c.Reserve(&a.shared_logit, T);
  }
}

absl::Status CudaBackend::GdnForward(const UnitParams& params, const CudaBatch& b, const HybridActs& a) {
  const LinearAttentionConfig& la = config_.linear;
  const int64_t T = b.num_tokens_, KD = la.key_dim(), VD = la.value_dim(), C = la.conv_dim();
  const int nk = static_cast<int>(la.num_key_heads), nv = static_cast<int>(la.num_value_heads);
  const int dk = static_cast<int>(la.key_head_dim), dv = static_cast<int>(la.value_head_dim);
  const int K = static_cast<int>(la.conv_kernel);
  const int64_t P = C + VD + 2 * nv;  // proj's columns: mixed (q | k | v) | z | b | a
  const bf16 *z = a.proj + C, *beta_in = a.proj + C + VD, *a_in = a.proj + C + VD + nv;
  RETURN_IF_ERROR(StackedForward(params.bf16, lin_w_, a.l.xn1, T, H_, a.proj, P));
  // The conv in two calls, q|k and v, so that v lands contiguous (the core's layout).
  const bf16* conv = W(params.bf16, kLinearConv);
  RETURN_IF_ERROR(kernels::CausalConvSiluForward(a.proj, P, conv, b.cu_seqlens_, b.num_docs_, T, static_cast<int>(2 * KD),
                                                 K, a.qk_conv, 2 * KD, stream_));
  RETURN_IF_ERROR(kernels::CausalConvSiluForward(a.proj + 2 * KD, P, conv + 2 * KD * K, b.cu_seqlens_, b.num_docs_, T,
                                                 static_cast<int>(VD), K, a.v_conv, VD, stream_));
  RETURN_IF_ERROR(kernels::L2NormHeadsForward(a.qk_conv, 2 * KD, T, nk, dk, kL2NormEps, a.qn, KD, stream_));
  RETURN_IF_ERROR(kernels::L2NormHeadsForward(a.qk_conv + KD, 2 * KD, T, nk, dk, kL2NormEps, a.kn, KD, stream_));
  const NormW a_log = Norm(params, kLinearALog), dt_bias = Norm(params, kLinearDtBias);
  RETURN_IF_ERROR(a_log.f != nullptr && dt_bias.f != nullptr
                      ? kernels::GdnDecayBetaForward(a_in, P, beta_in, P, a_log.f, dt_bias.f, T, nv, a.g, a.beta, stream_)
                      : kernels::GdnDecayBetaForward(a_in, P, beta_in, P, a_log.b, dt_bias.b, T, nv, a.g, a.beta,
                                                     stream_));
  const kernels::GatedDeltaArgs args = DeltaArgs(T, b.num_docs_, b.cu_seqlens_);
  if (ChunkedDelta()) {
    PoolBlock ws;
    RETURN_IF_ERROR(ws.Alloc(Align256(kernels::GatedDeltaForwardWorkspaceBytes(args)), stream_));
    RETURN_IF_ERROR(kernels::GatedDeltaForward(args, a.qn, a.kn, a.v_conv, a.g, a.beta, a.core, ws.get(), stream_));
  } else {
    RETURN_IF_ERROR(RecurrentDeltaForward(args, a.qn, a.kn, a.v_conv, a.g, a.beta, a.core, stream_));
  }
  const NormW norm = Norm(params, kLinearNorm);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  return norm.f != nullptr
             ? kernels::GatedRmsNormForward(a.core, VD, z, P, norm.f, T, nv, dv, eps, a.gated, VD, stream_)
             : kernels::GatedRmsNormForward(a.core, VD, z, P, norm.b, T, nv, dv, eps, a.gated, VD, stream_);
}

absl::Status CudaBackend::GdnBackward(const UnitParams& params, const CudaBatch& b, const HybridActs& a,
                                      const bf16* dgated, bf16* dproj, float* dparams) {
  const LinearAttentionConfig& la = config_.linear;
  const int64_t T = b.num_tokens_, KD = la.key_dim(), VD = la.value_dim(), C = la.conv_dim();
  const int nk = static_cast<int>(la.num_key_heads), nv = static_cast<int>(la.num_value_heads);
  const int dk = static_cast<int>(la.key_head_dim), dv = static_cast<int>(la.value_head_dim);
  const int K = static_cast<int>(la.conv_kernel);
  const int64_t P = C + VD + 2 * nv;
  const bf16 *z = a.proj + C, *beta_in = a.proj + C + VD, *a_in = a.proj + C + VD + nv;
  const kernels::GatedDeltaArgs args = DeltaArgs(T, b.num_docs_, b.cu_seqlens_);
  const bool chunked = ChunkedDelta();
  Carver c;
  PoolBlock block;
  float *d_core, *dq, *dk_, *dv_, *dg, *dbeta, *dqk, *ws;
  bf16* d_core_b;
  char* ws_core;
  c.Reserve(&d_core, T * VD);
  c.Reserve(&d_core_b, T * VD);
  c.Reserve(&dq, T * KD);
  c.Reserve(&dk_, T * KD);
  c.Reserve(&dv_, T * VD);
  c.Reserve(&dg, T * nv);
  c.Reserve(&dbeta, T * nv);
  c.Reserve(&dqk, T * 2 * KD);
  c.Reserve(&ws, std::max({kernels::GatedRmsNormBackwardWorkspaceNumel(T, nv, dv),
                           kernels::GdnDecayBetaBackwardWorkspaceNumel(T, nv),
                           kernels::CausalConvSiluBackwardWorkspaceNumel(T, static_cast<int>(2 * KD), K),
                           kernels::CausalConvSiluBackwardWorkspaceNumel(T, static_cast<int>(VD), K)}));
  c.Reserve(&ws_core, chunked ? kernels::GatedDeltaBackwardWorkspaceBytes(args) : RecurrentDeltaBackwardWorkspaceBytes(args));
  RETURN_IF_ERROR(c.Alloc(block, stream_));

  // y = (w · rmsnorm(core)) · silu(z): d_core (FP32) and dz into proj's z columns.
  const NormW norm = Norm(params, kLinearNorm);
  const float eps = static_cast<float>(config_.rms_norm_eps);
  float* dnorm = dparams + off_[kLinearNorm];
  RETURN_IF_ERROR(norm.f != nullptr ? kernels::GatedRmsNormBackward(dgated, VD, a.core, VD, z, P, norm.f, T, nv, dv, eps,
                                                                   d_core, VD, dproj + C, P, dnorm, ws, stream_)
                                    : kernels::GatedRmsNormBackward(dgated, VD, a.core, VD, z, P, norm.b, T, nv, dv, eps,
                                                                   d_core, VD, dproj + C, P, dnorm, ws, stream_));
  // The core reads its output gradient in BF16 (gated_delta.h), the gated norm gives it in FP32.
  RETURN_IF_ERROR(kernels::CastF32ToBf16(d_core, T * VD, 1.0f, d_core_b, stream_));
  RETURN_IF_ERROR(chunked ? kernels::GatedDeltaBackward(args, a.qn, a.kn, a.v_conv, a.g, a.beta, d_core_b, dq, dk_, dv_,
                                                        dg, dbeta, ws_core, stream_)
                          : RecurrentDeltaBackward(args, a.qn, a.kn, a.v_conv, a.g, a.beta, d_core_b, dq, dk_, dv_, dg,
                                                   dbeta, ws_core, stream_));
  // g, beta from a, b: da, db into proj's a and b columns; A_log and dt_bias gradients added.
  const NormW a_log = Norm(params, kLinearALog), dt_bias = Norm(params, kLinearDtBias);
  float *dA_log = dparams + off_[kLinearALog], *ddt_bias = dparams + off_[kLinearDtBias];
  bf16 *da = dproj + C + VD + nv, *db = dproj + C + VD;
  RETURN_IF_ERROR(a_log.f != nullptr && dt_bias.f != nullptr
                      ? kernels::GdnDecayBetaBackward(dg, dbeta, a_in, P, beta_in, P, a_log.f, dt_bias.f, T, nv, da, P,
                                                      db, P, dA_log, ddt_bias, ws, stream_)
                      : kernels::GdnDecayBetaBackward(dg, dbeta, a_in, P, beta_in, P, a_log.b, dt_bias.b, T, nv, da, P,
                                                      db, P, dA_log, ddt_bias, ws, stream_));
  // The L2 norms of q and k, into the conv's q|k output gradient.
  RETURN_IF_ERROR(kernels::L2NormHeadsBackward(dq, KD, a.qk_conv, 2 * KD, T, nk, dk, kL2NormEps, dqk, 2 * KD, stream_));
  RETURN_IF_ERROR(
      kernels::L2NormHeadsBackward(dk_, KD, a.qk_conv + KD, 2 * KD, T, nk, dk, kL2NormEps, dqk + KD, 2 * KD, stream_));
  // The conv + SiLU (q|k, then v, as the forward split them): dmixed into proj's first C columns.
  const bf16* conv = W(params.bf16, kLinearConv);
  float* dconv = dparams + off_[kLinearConv];
  RETURN_IF_ERROR(kernels::CausalConvSiluBackward(dqk, 2 * KD, a.proj, P, conv, b.cu_seqlens_, b.num_docs_, T,
                                                  static_cast<int>(2 * KD), K, dproj, P, dconv, ws, stream_));
  return kernels::CausalConvSiluBackward(dv_, VD, a.proj + 2 * KD, P, conv + 2 * KD * K, b.cu_seqlens_, b.num_docs_, T,
                                         static_cast<int>(VD), K, dproj + 2 * KD, P, dconv + 2 * KD * K, ws, stream_);
}

absl::Status CudaBackend::SharedExpertForward(const UnitParams& params, const HybridActs& a, int64_t T) {
  const int64_t S = config_.shared_expert_intermediate_size;
  RETURN_IF_ERROR(StackedForward(params.bf16, shared_gu_w_, a.l.xn2, T, H_, a.shared_gu, 2 * S));
  RETURN_IF_ERROR(kernels::SwiGluForward(a.shared_gu, T, S, a.shared_act, stream_));
  GemmArgs g;  // shared_out = act · Wdᵀ
  g.m = T;
  g.n = H_;
  g.k = S;
  g.a = a.shared_act;
  g.lda = S;
  g.b = W(params.bf16, kSharedDownProj);
  g.ldb = S;
  g.d = a.shared_out;
  g.ldd = H_;
  RETURN_IF_ERROR(gemm_.Run(g, stream_));
  return SharedGateLogits(a.l.xn2, W(params.bf16, kSharedExpertGate), T, H_, a.shared_logit, stream_);
}

absl::Status CudaBackend::SharedExpertBackward(const UnitParams& params, const HybridActs& a, int64_t T,
                                               const float* dy, float* dxn, float* dparams) {
  const int64_t S = config_.shared_expert_intermediate_size;
  Carver c;
  PoolBlock block;
  bf16 *dys, *dact, *dgu;
  float *dlogit, *ws;
  c.Reserve(&dys, T * H_);
  c.Reserve(&dact, T * S);
  c.Reserve(&dgu, T * 2 * S);
  c.Reserve(&dlogit, T);
  c.Reserve(&ws, SharedGateInputBackwardWorkspaceNumel(T, H_));
  RETURN_IF_ERROR(c.Alloc(block, stream_));
  RETURN_IF_ERROR(SharedExpertGateBackward(dy, a.shared_out, a.shared_logit, T, H_, dys, dlogit, stream_));
  GemmArgs d;  // dact = dys · Wd
  d.op_b = GemmOp::kN;
  d.m = T;
  d.n = S;
  d.k = H_;
  d.a = dys;
  d.lda = H_;
  d.b = W(params.bf16, kSharedDownProj);
  d.ldb = S;
  d.d = dact;
  d.ldd = S;
  RETURN_IF_ERROR(gemm_.Run(d, stream_));
  RETURN_IF_ERROR(Wgrad(dys, H_, a.shared_act, S, T, H_, S, dparams + off_[kSharedDownProj]));
  RETURN_IF_ERROR(kernels::SwiGluBackward(a.shared_gu, dact, T, S, dgu, stream_));
  // dxn += dgu · [Wg; Wu] (after the routed experts' part), dW[g;u] += dguᵀ · xn2.
  const int parts[] = {kSharedGateProj, kSharedUpProj};
  for (int i = 0; i < 2; ++i) {
    GemmArgs g;
    g.op_b = GemmOp::kN;
    g.m = T;
    g.n = H_;
    g.k = S;
    g.a = dgu + i * S;
    g.lda = 2 * S;
    g.b = W(params.bf16, parts[i]);
    g.ldb = H_;
    g.c = dxn;
    g.ldc = H_;
    g.d = dxn;
    g.ldd = H_;
    g.out_type = Dtype::kF32;
    g.beta = 1.0f;
    RETURN_IF_ERROR(gemm_.Run(g, stream_));
    RETURN_IF_ERROR(Wgrad(dgu + i * S, 2 * S, a.l.xn2, H_, T, S, H_, dparams + off_[parts[i]]));
  }
  return SharedGateInputBackward(dlogit, W(params.bf16, kSharedExpertGate), a.l.xn2, T, H_, dxn,
                                 dparams + off_[kSharedExpertGate], ws, stream_);
}

absl::Status CudaBackend::MixerForward(const UnitParams& params, const CudaBatch& b, const void* x, bool linear,
                                       const HybridActs& a) {
  const int64_t T = b.num_tokens_;
  const LayerActs& l = a.l;
  if (linear) {
    RETURN_IF_ERROR(NormForward(x, Norm(params, kInputNorm), T, l.xn1, l.rstd1));
    RETURN_IF_ERROR(GdnForward(params, b, a));
    return ResidualGemm(a.gated, config_.linear.value_dim(), W(params.bf16, kLinearOutProj), x, l.h1, a.branch, T);
  }
  // xn1, the fused qkv rows, q/k (1 + w) norms + partial RoPE (RopeArgs skips the gate columns).
  RETURN_IF_ERROR(AttentionInputs(params, b, x, l, 0, kAllPieces));
  const kernels::AttnArgs attn = Attn(b, params.decoder_layer);
  ASSIGN_OR_RETURN(const std::optional<int64_t> cudnn_ws, CudnnWorkspace(AttnDir::kForward, attn));
  if (!cudnn_ws.has_value() && !kernels::FlashAttentionFastPath(hd_) && T > kSlowAttentionMaxTokens) {
    return absl::FailedPreconditionError(
        absl::StrCat(ModelTypeName(config_.family), " attention at head_dim ", hd_, " over ", T,
                     " tokens needs cuDNN (SLIDEDP_ATTENTION auto or cudnn, libcudnn 9): the own kernels run this head ",
                     "dim on their slow path, for at most ", kSlowAttentionMaxTokens, " tokens"));
  }
  RETURN_IF_ERROR(AttentionForward(params, b, l));
  RETURN_IF_ERROR(kernels::AttnOutputGateForward(l.o, l.qkv, qkv_, T, nq_, hd_, a.og, stream_));
  return ResidualGemm(a.og, qd_, W(params.bf16, kOProj), x, l.h1, a.branch, T);
}

absl::Status CudaBackend::MlpForward(const UnitParams& params, const CudaBatch& b, int sparse, const HybridActs& a,
                                     void* y) {
  const int64_t T = b.num_tokens_;
  const LayerActs& l = a.l;
  RETURN_IF_ERROR(NormForward(l.h1, Norm(params, kPostNorm), T, l.xn2, l.rstd2));
  if (sparse < 0) {
    RETURN_IF_ERROR(StackedForward(params.bf16, gu_w_, l.xn2, T, H_, l.gu, 2 * I_));
    RETURN_IF_ERROR(kernels::SwiGluForward(l.gu, T, I_, l.act, stream_));
    if (y == nullptr) return absl::OkStatus();
    return ResidualGemm(l.act, I_, W(params.bf16, kDownProj), l.h1, y, a.branch, T);
  }
  const bool shared = config_.has_shared_expert();
  if (shared) RETURN_IF_ERROR(SharedExpertForward(params, a, T));
  // Backward recomputes the routed experts itself (CudaMoeBlock::Backward without saved state).
  if (y == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(const MoeRouterStatsOut record, RouterRecord(b, sparse));
  PoolBlock routing_block;
  MoeSaved routing;  // SetRecordRouting: the block's top-k
  if (record_routing_) RETURN_IF_ERROR(moe_->AllocateSaved(T, MoeKeep::kRouting, routing_block, &routing, stream_));
  RETURN_IF_ERROR(moe_->Forward(params.bf16, l.xn2, T, a.moe_out, record_routing_ ? &routing : nullptr, record,
                                &b.host_counts_[sparse], stream_));
  if (record_routing_) {
    b.host_topk_.resize(num_sparse_);
    b.host_topk_[sparse].resize(T * config_.num_experts_per_tok);
    RETURN_IF_ERROR(
        CopyToHost(routing.topk_expert, b.host_topk_[sparse].data(), b.host_topk_[sparse].size() * sizeof(int32_t)));
  }
  if (shared) RETURN_IF_ERROR(SharedExpertAddGated(a.shared_out, a.shared_logit, T, H_, a.moe_out, stream_));
  return kernels::AddF32(static_cast<const float*>(l.h1), a.moe_out, T * H_, static_cast<float*>(y), stream_);
}

absl::Status CudaBackend::HybridDecoderForward(const UnitParams& params, const CudaBatch& b, const void* x, void* y,
                                               ActPolicy policy, std::unique_ptr<SavedActivations>* saved) {
  (void)policy;  // every policy keeps nothing here (SavedBytesPerToken says 0)
  RETURN_IF_ERROR(SelectLayer(params));
  ASSIGN_OR_RETURN(const int sparse, SparseOrdinal(params));
  const bool linear = config_.IsLinearAttentionLayer(params.decoder_layer);
  const int64_t T = b.num_tokens_;
  if (linear && b.context()) {
    return absl::UnimplementedError(absl::StrCat(ModelTypeName(config_.family),
                                                 ": a Gated DeltaNet layer over a context-parallel share (its "
                                                 "recurrent state does not pass between ranks)"));
  }
  {
    Carver c;
    PoolBlock block;
    HybridActs a;
    ReserveHybrid(c, a, T, linear, sparse);
    RETURN_IF_ERROR(c.Alloc(block, stream_));
    RETURN_IF_ERROR(MixerForward(params, b, x, linear, a));  // y may alias x: x is read here only
    RETURN_IF_ERROR(MlpForward(params, b, sparse, a, y));
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

absl::Status CudaBackend::HybridDecoderBackward(const UnitParams& params, const CudaBatch& b, const void* x,
                                                const void* dy, void* dx, float* dparams) {
  RETURN_IF_ERROR(SelectLayer(params));
  ASSIGN_OR_RETURN(const int sparse, SparseOrdinal(params));
  const bool linear = config_.IsLinearAttentionLayer(params.decoder_layer);
  const int64_t T = b.num_tokens_;
  if (linear && b.context()) {
    return absl::UnimplementedError(absl::StrCat(ModelTypeName(config_.family),
                                                 ": a Gated DeltaNet layer over a context-parallel share (its "
                                                 "recurrent state does not pass between ranks)"));
  }
  if (!linear && options_.deterministic && !kernels::FlashAttentionFastPath(hd_)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "runtime.deterministic with ", ModelTypeName(config_.family), ": the ordered-dQ attention backward takes ",
        "head_dim 64 or 128, and this model's is ", hd_, " (run without deterministic)"));
  }
  const LinearAttentionConfig& la = config_.linear;
  const int64_t P = la.conv_dim() + la.value_dim() + 2 * la.num_value_heads;
  const kernels::AttnArgs attn = Attn(b, params.decoder_layer);
  std::optional<int64_t> cudnn_ws;
  if (!linear) {
    ASSIGN_OR_RETURN(cudnn_ws, CudnnWorkspace(AttnDir::kBackward, attn));
  }

  Carver c;
  PoolBlock block;
  HybridActs a;
  ReserveHybrid(c, a, T, linear, sparse);
  const LayerActs& l = a.l;
  void* dxn;  // the residual dtype (FP32 with a sparse layer, which needs the FP32 stream)
  bf16 *dres_b = nullptr, *dact = nullptr, *dgu = nullptr;
  bf16 *dgated = nullptr, *dproj = nullptr;                                   // Gated DeltaNet
  bf16 *dog = nullptr, *dqr = nullptr, *dkr = nullptr, *dqkv = nullptr;       // attention
  char* ws_attn = nullptr;
  float* ws_f;
  c.ReserveBytes(&dxn, T * H_ * act_bytes());
  if (f32()) c.Reserve(&dres_b, T * H_);
  if (sparse < 0) {
    c.Reserve(&dact, T * I_);
    c.Reserve(&dgu, T * 2 * I_);
  }
  int64_t ws_numel = kernels::RmsNormBackwardWorkspaceNumel(T, H_);
  if (linear) {
    c.Reserve(&dgated, T * la.value_dim());
    c.Reserve(&dproj, T * P);
  } else {
    c.Reserve(&dog, T * qd_);
    c.Reserve(&dqr, T * qd_);
    c.Reserve(&dkr, T * kvd_);
    c.Reserve(&dqkv, T * qkv_);
    c.Reserve(&ws_attn, cudnn_ws.has_value() ? *cudnn_ws : kernels::FlashAttentionBackwardWorkspaceBytes(attn));
    ws_numel = std::max(ws_numel, kernels::QkNormRopeBackwardWorkspaceNumel(Rope(T)));
  }
  c.Reserve(&ws_f, ws_numel);
  RETURN_IF_ERROR(c.Alloc(block, stream_));

  // The forward again, up to the MLP's output (the routed experts are recomputed by their backward).
  RETURN_IF_ERROR(MixerForward(params, b, x, linear, a));
  RETURN_IF_ERROR(MlpForward(params, b, sparse, a, nullptr));

  // The MLP: dxn = dL/dxn2 (dy is read up to the norm backward, which writes dx: dx may alias dy).
  if (sparse < 0) {
    RETURN_IF_ERROR(ResidualBranchBackward(dy, T, W(params.bf16, kDownProj), I_, l.act, dact,
                                           dparams + off_[kDownProj], dres_b));
    RETURN_IF_ERROR(kernels::SwiGluBackward(l.gu, dact, T, I_, dgu, stream_));
    RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, gu_w_, dgu, 2 * I_, l.xn2, T, H_, dxn, act_gemm_type()));
  } else {
    const double* aux_grad = b.aux_weight_ != 0 ? b.aux_grad_ : nullptr;
    RETURN_IF_ERROR(moe_->Backward(params.bf16, l.xn2, T, nullptr, static_cast<const float*>(dy), aux_grad,
                                   static_cast<float*>(dxn), dparams, stream_));
    if (config_.has_shared_expert()) {
      RETURN_IF_ERROR(
          SharedExpertBackward(params, a, T, static_cast<const float*>(dy), static_cast<float*>(dxn), dparams));
    }
  }
  // dh1 = dy + RMSNorm2ᵀ(dxn), into dx.
  RETURN_IF_ERROR(
      NormBackward(dxn, l.h1, Norm(params, kPostNorm), l.rstd2, dy, T, dx, dparams + off_[kPostNorm], ws_f));

  if (linear) {
    // h1 = x + gated · Woutᵀ, then the Gated DeltaNet back to its projections, then the input norm.
    RETURN_IF_ERROR(ResidualBranchBackward(dx, T, W(params.bf16, kLinearOutProj), la.value_dim(), a.gated, dgated,
                                           dparams + off_[kLinearOutProj], dres_b));
    RETURN_IF_ERROR(GdnBackward(params, b, a, dgated, dproj, dparams));
    RETURN_IF_ERROR(StackedBackward(params.bf16, dparams, lin_w_, dproj, P, l.xn1, T, H_, dxn, act_gemm_type()));
    // dx = dh1 + RMSNorm1ᵀ(dxn), in place
    return NormBackward(dxn, x, Norm(params, kInputNorm), l.rstd1, dx, T, dx, dparams + off_[kInputNorm], ws_f);
  }
  // h1 = x + og · Woᵀ, og = o · σ(gate): dO in place of dog, dgate into dqkv's gate columns.
  RETURN_IF_ERROR(
      ResidualBranchBackward(dx, T, W(params.bf16, kOProj), qd_, a.og, dog, dparams + off_[kOProj], dres_b));
  RETURN_IF_ERROR(kernels::AttnOutputGateBackward(dog, l.o, l.qkv, qkv_, T, nq_, hd_, dog, dqkv, qkv_, stream_));
  PoolBlock kv_block;  // a context-parallel share: the group's keys and values
  const bf16* kv = nullptr;
  RETURN_IF_ERROR(GatherContextKv(b, l, kv_block, &kv));
  RETURN_IF_ERROR(AttentionBackward(b, attn, cudnn_ws, l, dog, dqr, dkr, dqkv + VColumn(), ws_attn, kv));
  kv_block.Release();
  // q/k norm + RoPE backward (query columns), the QKV projections and the input norm (dx in place).
  return QkvBackward(params, b, x, l, /*kept=*/0, /*tile=*/T, dqr, dkr, dqkv, dxn, ws_f, dx, dparams);
}

}  // namespace slidedp::cuda_backend_internal
