// Qwen3 reference math, the decoder layer: its forward in four phases (attention inputs, attention,
// MLP inputs, output), its backward, and the same layer tiled over tokens as the backends run a long
// micro-batch. Built of the op-level references (dense_reference_math.cc), the attention
// (dense_attention_math.cc) and, in a sparse layer, the MoE block (moe_reference_math.cc).
// Explicitly instantiated for float (backend) and double (gradient checks). Limits: scalar C++;
// meant for tiny models and oracles.
#include <algorithm>
#include <vector>

#include <cmath>

#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/dense_reference_math_internal.h"
#include "worker/compute/cpu/gated_delta_math.h"
#include "worker/compute/cpu/gpt_oss_math.h"

namespace slidedp {
namespace {

using dense_math::AddBiasRows;
using dense_math::BiasBackward;
using dense_math::GatedMlp;
using dense_math::GatedMlpBackward;
using dense_math::SwiGlu;
using dense_math::SwiGluBackward;

// Views of the decoder tensors inside a flat unit array.
template <typename T>
struct DecoderTensors {
  T* p[kNumDecoderTensors];  // nullptr for a tensor the family does not have
  DecoderTensors(T* base, const DecoderOffsets& offs) {
    for (int i = 0; i < kNumDecoderTensors; ++i) p[i] = offs.at[i] >= 0 ? base + offs.at[i] : nullptr;
  }
  T* operator[](int i) const { return p[i]; }
};


// A qwen3_5 Gated DeltaNet layer's sizes and tensor offsets for gated_delta_math.h.
LinearAttentionDims LinearDimsOf(const DecoderDims& d) {
  LinearAttentionDims l;
  l.hidden = d.hidden;
  l.num_k_heads = d.linear_k_heads;
  l.num_v_heads = d.linear_v_heads;
  l.k_dim = d.linear_k_dim;
  l.v_dim = d.linear_v_dim;
  l.conv_kernel = d.linear_conv;
  l.norm_eps = d.rms_norm_eps;
  return l;
}

LinearAttentionOffsets LinearOffsetsOf(const DecoderOffsets& offs) {
  LinearAttentionOffsets o;
  o.in_proj_qkv = offs.at[kLinearInProjQkv];
  o.in_proj_z = offs.at[kLinearInProjZ];
  o.in_proj_b = offs.at[kLinearInProjB];
  o.in_proj_a = offs.at[kLinearInProjA];
  o.conv1d = offs.at[kLinearConv];
  o.dt_bias = offs.at[kLinearDtBias];
  o.a_log = offs.at[kLinearALog];
  o.norm = offs.at[kLinearNorm];
  o.out_proj = offs.at[kLinearOutProj];
  return o;
}

template <typename R>
R Sigmoid(R x) {
  return R(1) / (R(1) + std::exp(-x));
}

// The attention output o_proj reads: attn, or attn * sigmoid(gate) with qwen3_5's output gate.
template <typename R>
std::vector<R> GatedAttention(const DecoderDims& d, const DecoderActs<R>& a, int64_t T) {
  std::vector<R> o(a.attn.begin(), a.attn.begin() + T * d.q_dim());
  if (d.output_gate) {
    for (int64_t i = 0; i < T * d.q_dim(); ++i) o[i] *= Sigmoid(a.qgate[i]);
  }
  return o;
}

// The norm of the MLP's input: post_attention_layernorm, or gemma3's pre_feedforward_layernorm
// (its post_attention_layernorm norms the attention output instead).
DecoderTensor MlpInputNorm(const DecoderDims& d) { return d.sandwich_norms ? kPreFfnNorm : kPostNorm; }

// The dense MLP's hidden activations m = act(gate) * up [T, intermediate], and its output
// down_proj(m) [T, hidden].
template <typename R>
std::vector<R> MlpHidden(const DecoderDims& d, const DecoderActs<R>& a, int64_t T) {
  std::vector<R> m(T * d.intermediate);
  GatedMlp(d.mlp_act, a.gate.data(), a.up.data(), T * d.intermediate, m.data());
  return m;
}
template <typename R>
std::vector<R> MlpOutput(const DecoderDims& d, const DecoderTensors<const R>& w, const std::vector<R>& m, int64_t T,
                         CpuWorkerPool* pool) {
  std::vector<R> down(T * d.hidden);
  LinearForward(m.data(), w[kDownProj], T, d.intermediate, d.hidden, down.data(), pool);
  return down;
}

// gemma3's post_feedforward_layernorm of the MLP's output `down`: its output and rsqrt per token.
template <typename R>
void PostFeedforwardNorm(const DecoderDims& d, const DecoderTensors<const R>& w, const std::vector<R>& down, int64_t T,
                         std::vector<R>* normed, std::vector<R>* rstd, CpuWorkerPool* pool) {
  normed->resize(T * d.hidden);
  rstd->resize(T);
  RmsNormRows(down.data(), w[kPostFfnNorm], T, d.hidden, static_cast<R>(d.rms_norm_eps), normed->data(), rstd->data(),
              pool);
}

// qwen3_5_moe's shared expert beside the routed ones: y += sigmoid(hn . w_gate) * SwiGLU_s(hn).
template <typename R>
void SharedExpertForward(const DecoderDims& d, const DecoderTensors<const R>& w, int64_t T, DecoderActs<R>* a, R* y,
                         CpuWorkerPool* pool) {
  const int64_t H = d.hidden, S = d.shared_intermediate;
  a->shared_gate.resize(T * S);
  a->shared_up.resize(T * S);
  a->shared_logit.resize(T);
  LinearForward(a->hn.data(), w[kSharedGateProj], T, H, S, a->shared_gate.data(), pool);
  LinearForward(a->hn.data(), w[kSharedUpProj], T, H, S, a->shared_up.data(), pool);
  LinearForward(a->hn.data(), w[kSharedExpertGate], T, H, 1, a->shared_logit.data(), pool);
  std::vector<R> m(T * S), ys(T * H);
  SwiGlu(a->shared_gate.data(), a->shared_up.data(), T * S, m.data());
  LinearForward(m.data(), w[kSharedDownProj], T, S, H, ys.data(), pool);
  for (int64_t t = 0; t < T; ++t) {
    const R s = Sigmoid(a->shared_logit[t]);
    for (int64_t h = 0; h < H; ++h) y[t * H + h] += s * ys[t * H + h];
  }
}

// Its backward: dhn += dL/dhn through the shared expert, its weights' gradients added.
template <typename R>
void SharedExpertBackward(const DecoderDims& d, const DecoderTensors<const R>& w, const DecoderTensors<R>& g,
                          int64_t T, const DecoderActs<R>& a, const R* dy, R* dhn, CpuWorkerPool* pool) {
  const int64_t H = d.hidden, S = d.shared_intermediate;
  std::vector<R> m(T * S), ys(T * H), dys(T * H), dlogit(T);
  SwiGlu(a.shared_gate.data(), a.shared_up.data(), T * S, m.data());
  LinearForward(m.data(), w[kSharedDownProj], T, S, H, ys.data(), pool);
  for (int64_t t = 0; t < T; ++t) {
    const R s = Sigmoid(a.shared_logit[t]);
    R dot = 0;
    for (int64_t h = 0; h < H; ++h) {
      dys[t * H + h] = dy[t * H + h] * s;
      dot += dy[t * H + h] * ys[t * H + h];
    }
    dlogit[t] = dot * s * (R(1) - s);
  }
  LinearBackwardWeight(dlogit.data(), a.hn.data(), T, H, 1, g[kSharedExpertGate], pool);
  LinearBackwardInput(dlogit.data(), w[kSharedExpertGate], T, H, 1, dhn, Accumulate::kAdd, pool);
  std::vector<R> dm(T * S), dgate(T * S), dup(T * S);
  LinearBackwardWeight(dys.data(), m.data(), T, S, H, g[kSharedDownProj], pool);
  LinearBackwardInput(dys.data(), w[kSharedDownProj], T, S, H, dm.data(), Accumulate::kOverwrite, pool);
  SwiGluBackward(a.shared_gate.data(), a.shared_up.data(), dm.data(), T * S, dgate.data(), dup.data());
  LinearBackwardWeight(dgate.data(), a.hn.data(), T, H, S, g[kSharedGateProj], pool);
  LinearBackwardWeight(dup.data(), a.hn.data(), T, H, S, g[kSharedUpProj], pool);
  LinearBackwardInput(dgate.data(), w[kSharedGateProj], T, H, S, dhn, Accumulate::kAdd, pool);
  LinearBackwardInput(dup.data(), w[kSharedUpProj], T, H, S, dhn, Accumulate::kAdd, pool);
}

}  // namespace

template <typename R>
int64_t DecoderActs<R>::num_elements() const {
  int64_t n = 0;
  for (const std::vector<R>* v :
       {&rstd1, &xn, &q_raw, &k_raw, &q_rstd, &k_rstd, &q_rot, &k_rot, &v, &attn, &lse, &h1, &rstd2, &hn, &gate, &up}) {
    n += static_cast<int64_t>(v->size());
  }
  return n;
}

template <typename R>
void DecoderAttentionInputs(const DecoderDims& d, const DecoderOffsets& offs, const R* params,
                            const TokenGeometry& batch_geom, const R* x, DecoderActs<R>* a, CpuWorkerPool* pool) {
  const TokenGeometry geom = LayerGeometry(batch_geom, offs);
  const DecoderTensors<const R> w(params, offs);
  const int64_t T = geom.num_tokens, H = d.hidden, qd = d.q_dim(), kvd = d.kv_dim();
  const R eps = static_cast<R>(d.rms_norm_eps);
  a->rstd1.resize(T);
  a->xn.resize(T * H);
  RmsNormRows(x, w[kInputNorm], T, H, eps, a->xn.data(), a->rstd1.data(), pool);
  if (offs.linear()) {
    // qwen3_5's Gated DeltaNet: the whole mixer here (it mixes tokens; DecoderAttention then has
    // nothing left to do), its output after out_proj in attn.
    a->linear_mixer = true;
    a->attn.resize(T * H);
    LinearAttentionForward(LinearDimsOf(d), LinearOffsetsOf(offs), params, geom, a->xn.data(), a->attn.data(),
                           &a->linear, pool);
    return;
  }
  a->q_raw.resize(T * qd);
  a->k_raw.resize(T * kvd);
  a->v.resize(T * kvd);
  if (d.output_gate) {
    // q_proj emits [query | gate] per head (HF Qwen3NextAttention): split them.
    const int64_t hd = d.head_dim;
    std::vector<R> full(T * 2 * qd);
    LinearForward(a->xn.data(), w[kQProj], T, H, 2 * qd, full.data(), pool);
    a->qgate.resize(T * qd);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < d.heads; ++h) {
        const R* src = full.data() + t * 2 * qd + h * 2 * hd;
        std::copy(src, src + hd, a->q_raw.begin() + t * qd + h * hd);
        std::copy(src + hd, src + 2 * hd, a->qgate.begin() + t * qd + h * hd);
      }
    }
  } else {
    LinearForward(a->xn.data(), w[kQProj], T, H, qd, a->q_raw.data(), pool);
  }
  LinearForward(a->xn.data(), w[kKProj], T, H, kvd, a->k_raw.data(), pool);
  LinearForward(a->xn.data(), w[kVProj], T, H, kvd, a->v.data(), pool);
  if (w[kQBias] != nullptr) {
    AddBiasRows(w[kQBias], T, qd, a->q_raw.data());
    AddBiasRows(w[kKBias], T, kvd, a->k_raw.data());
    AddBiasRows(w[kVBias], T, kvd, a->v.data());
  }
  if (w[kSinks] != nullptr) a->sinks.assign(w[kSinks], w[kSinks] + d.heads);
  if (w[kQNorm] != nullptr) {
    a->q_rstd.resize(T * d.heads);
    a->k_rstd.resize(T * d.kv_heads);
    a->q_rot.resize(T * qd);
    a->k_rot.resize(T * kvd);
    RmsNormRows(a->q_raw.data(), w[kQNorm], T * d.heads, d.head_dim, eps, a->q_rot.data(), a->q_rstd.data(), pool);
    RmsNormRows(a->k_raw.data(), w[kKNorm], T * d.kv_heads, d.head_dim, eps, a->k_rot.data(), a->k_rstd.data(), pool);
  } else {
    a->q_rot = a->q_raw;
    a->k_rot = a->k_raw;
  }
  ApplyRope(a->q_rot.data(), T, d.heads, d.head_dim, geom, RopeDirection::kForward, pool);
  ApplyRope(a->k_rot.data(), T, d.kv_heads, d.head_dim, geom, RopeDirection::kForward, pool);
}

template <typename R>
void DecoderAttention(const DecoderDims& d, const DecoderOffsets& offs, const TokenGeometry& geom, DecoderActs<R>* a,
                      CpuWorkerPool* pool) {
  if (a->linear_mixer) return;  // the Gated DeltaNet ran whole in DecoderAttentionInputs
  a->attn.resize(geom.num_tokens * d.q_dim());
  a->lse.resize(geom.num_tokens * d.heads);
  AttentionForward(d, geom, offs.attention_window, a->q_rot.data(), a->k_rot.data(), a->v.data(), a->attn.data(),
                   a->lse.data(), pool);
  if (!a->sinks.empty()) {
    ApplyAttentionSinks(geom.num_tokens, d.heads, d.head_dim, a->sinks.data(), a->attn.data(), a->lse.data());
  }
}

template <typename R>
void DecoderMlpInputs(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                      const R* x, DecoderActs<R>* a, CpuWorkerPool* pool) {
  const DecoderTensors<const R> w(params, offs);
  const int64_t T = geom.num_tokens, H = d.hidden, I = d.intermediate;
  const R eps = static_cast<R>(d.rms_norm_eps);
  a->h1.resize(T * H);
  if (offs.linear()) {
    std::copy(a->attn.begin(), a->attn.begin() + T * H, a->h1.begin());
  } else {
    LinearForward(GatedAttention(d, *a, T).data(), w[kOProj], T, d.q_dim(), H, a->h1.data(), pool);
    if (w[kOBias] != nullptr) AddBiasRows(w[kOBias], T, H, a->h1.data());
  }
  if (d.sandwich_norms) {  // gemma3: the attention output through post_attention_layernorm
    a->attn_out = a->h1;
    a->attn_out_rstd.resize(T);
    RmsNormRows(a->attn_out.data(), w[kPostNorm], T, H, eps, a->h1.data(), a->attn_out_rstd.data(), pool);
  }
  for (int64_t i = 0; i < T * H; ++i) a->h1[i] = x[i] + a->h1[i];
  a->rstd2.resize(T);
  a->hn.resize(T * H);
  RmsNormRows(a->h1.data(), w[MlpInputNorm(d)], T, H, eps, a->hn.data(), a->rstd2.data(), pool);
  if (offs.sparse()) {
    a->moe_y.resize(T * H);
    MoeBlockForward(d.moe, offs.moe, params, a->hn.data(), T, a->moe_y.data(), &a->moe, pool);
    if (offs.shared_expert()) SharedExpertForward(d, w, T, a, a->moe_y.data(), pool);
    return;
  }
  a->gate.resize(T * I);
  a->up.resize(T * I);
  LinearForward(a->hn.data(), w[kGateProj], T, H, I, a->gate.data(), pool);
  LinearForward(a->hn.data(), w[kUpProj], T, H, I, a->up.data(), pool);
}

template <typename R>
void DecoderOutput(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                   const DecoderActs<R>& a, R* y, CpuWorkerPool* pool) {
  const DecoderTensors<const R> w(params, offs);
  const int64_t T = geom.num_tokens, H = d.hidden;
  if (offs.sparse()) {
    for (int64_t i = 0; i < T * H; ++i) y[i] = a.h1[i] + a.moe_y[i];
    return;
  }
  std::vector<R> down = MlpOutput(d, w, MlpHidden(d, a, T), T, pool);
  if (d.sandwich_norms) {  // gemma3: the MLP's output through post_feedforward_layernorm
    std::vector<R> normed, rstd;
    PostFeedforwardNorm(d, w, down, T, &normed, &rstd, pool);
    down.swap(normed);
  }
  for (int64_t i = 0; i < T * H; ++i) y[i] = a.h1[i] + down[i];
}

template <typename R>
void DecoderForwardAll(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                       const R* x, R* y, DecoderActs<R>* acts, CpuWorkerPool* pool) {
  DecoderAttentionInputs(d, offs, params, geom, x, acts, pool);
  DecoderAttention(d, offs, geom, acts, pool);
  DecoderMlpInputs(d, offs, params, geom, x, acts, pool);
  DecoderOutput(d, offs, params, geom, *acts, y, pool);
}

namespace {

// The rows [t0, t0 + rows) of a batch for its token-local work: their RoPE tables (attention's
// document boundaries are not part of a tile).
TokenGeometry TileGeometry(const TokenGeometry& geom, int64_t head_half, int64_t t0, int64_t rows) {
  const int64_t half = geom.rope_half > 0 ? geom.rope_half : head_half;
  TokenGeometry g;
  g.rope_half = geom.rope_half;
  g.num_tokens = rows;
  g.rope_cos = geom.rope_cos + t0 * half;
  g.rope_sin = geom.rope_sin + t0 * half;
  if (geom.sliding_rope_cos != nullptr) {
    g.sliding_rope_cos = geom.sliding_rope_cos + t0 * half;
    g.sliding_rope_sin = geom.sliding_rope_sin + t0 * half;
  }
  return g;
}

// Rows [t0, t0 + rows) of a [T, width] vector.
template <typename R>
std::vector<R> Rows(const std::vector<R>& v, int64_t t0, int64_t rows, int64_t width) {
  return std::vector<R>(v.begin() + t0 * width, v.begin() + (t0 + rows) * width);
}

// The dense MLP's backward: dhn = dL/d(its input) (overwritten), its weights' gradients added.
template <typename R>
void DenseMlpBackward(const DecoderDims& d, const DecoderTensors<const R>& w, const DecoderTensors<R>& g, int64_t T,
                      const DecoderActs<R>& a, const R* dy, R* dhn, CpuWorkerPool* pool) {
  const int64_t H = d.hidden, I = d.intermediate;
  // MLP: its output m Wd^T, m = act(gate) * up; dy is the gradient at that output.
  std::vector<R> m = MlpHidden(d, a, T), dm(T * I);
  // gemma3: y = h1 + rms_pf(m Wd^T): dy through post_feedforward_layernorm first.
  std::vector<R> dout;
  if (d.sandwich_norms) {
    const std::vector<R> down = MlpOutput(d, w, m, T, pool);
    std::vector<R> normed, rstd;
    PostFeedforwardNorm(d, w, down, T, &normed, &rstd, pool);
    dout.resize(T * H);
    RmsNormBackwardRows(down.data(), rstd.data(), w[kPostFfnNorm], dy, T, H, dout.data(), Accumulate::kOverwrite,
                        g[kPostFfnNorm], pool);
    dy = dout.data();
  }
  LinearBackwardWeight(dy, m.data(), T, I, H, g[kDownProj], pool);
  LinearBackwardInput(dy, w[kDownProj], T, I, H, dm.data(), Accumulate::kOverwrite, pool);
  std::vector<R> dgate(T * I), dup(T * I);
  GatedMlpBackward(d.mlp_act, a.gate.data(), a.up.data(), dm.data(), T * I, dgate.data(), dup.data());
  m = {};
  dm = {};
  LinearBackwardWeight(dgate.data(), a.hn.data(), T, H, I, g[kGateProj], pool);
  LinearBackwardWeight(dup.data(), a.hn.data(), T, H, I, g[kUpProj], pool);
  LinearBackwardInput(dgate.data(), w[kGateProj], T, H, I, dhn, Accumulate::kOverwrite, pool);
  LinearBackwardInput(dup.data(), w[kUpProj], T, H, I, dhn, Accumulate::kAdd, pool);
}

// The MLP and o_proj blocks' backward over T tokens (a's fields hold those tokens): dh1 = dL/dh1
// (overwritten), dattn = dL/d attention output (overwritten), dparams += their weights' gradients.
// A Gated DeltaNet layer: dattn = dL/d(its mixer output) [T, hidden]. With qwen3_5's output gate
// dqgate ([T, q_dim], overwritten) receives the gate logits' gradient.
template <typename R>
void MlpBlockBackward(const DecoderDims& d, const DecoderOffsets& offs, const R* params, R* dparams, int64_t T,
                      const DecoderActs<R>& a, const R* dy, R* dh1, R* dattn, const double* aux_prob_grad,
                      CpuWorkerPool* pool, R* dqgate = nullptr) {
  const DecoderTensors<const R> w(params, offs);
  const DecoderTensors<R> g(dparams, offs);
  const int64_t H = d.hidden, qd = d.q_dim();
  std::vector<R> dhn(T * H);
  if (offs.sparse()) {
    // y = h1 + MoE(hn) (+ the shared expert).
    MoeBlockBackward(d.moe, offs.moe, params, a.hn.data(), T, a.moe, dy, aux_prob_grad, dhn.data(), dparams, pool);
    if (offs.shared_expert()) SharedExpertBackward(d, w, g, T, a, dy, dhn.data(), pool);
  } else {
    DenseMlpBackward(d, w, g, T, a, dy, dhn.data(), pool);
  }

  // dh1 = dy + the MLP input norm's backward.
  std::copy(dy, dy + T * H, dh1);
  const DecoderTensor norm2 = MlpInputNorm(d);
  RmsNormBackwardRows(a.h1.data(), a.rstd2.data(), w[norm2], dhn.data(), T, H, dh1, Accumulate::kAdd, g[norm2], pool);
  dhn = {};

  if (offs.linear()) {  // h1 = x + mixer output
    std::copy(dh1, dh1 + T * H, dattn);
    return;
  }
  // o_proj's output gradient: dh1, or gemma3's through post_attention_layernorm.
  std::vector<R> dattn_out;
  const R* do_proj = dh1;
  if (d.sandwich_norms) {
    dattn_out.resize(T * H);
    RmsNormBackwardRows(a.attn_out.data(), a.attn_out_rstd.data(), w[kPostNorm], dh1, T, H, dattn_out.data(),
                        Accumulate::kOverwrite, g[kPostNorm], pool);
    do_proj = dattn_out.data();
  }
  // o_proj (of the gated attention output, qwen3_5; with gpt_oss's bias).
  if (g[kOBias] != nullptr) BiasBackward(do_proj, T, H, g[kOBias]);
  const std::vector<R> o_in = GatedAttention(d, a, T);
  LinearBackwardWeight(do_proj, o_in.data(), T, qd, H, g[kOProj], pool);
  LinearBackwardInput(do_proj, w[kOProj], T, qd, H, dattn, Accumulate::kOverwrite, pool);
  if (d.output_gate) {
    for (int64_t i = 0; i < T * qd; ++i) {
      const R s = Sigmoid(a.qgate[i]);
      dqgate[i] = dattn[i] * a.attn[i] * s * (R(1) - s);
      dattn[i] *= s;
    }
  }
}

// RoPE, q/k norm, bias and QKV projection backward over the tokens of `geom` (a's fields hold
// them), then the input norm's: dx = dh1 + RMSNorm1 backward (dx may alias dh1). dq, dk, dv (the
// attention's input gradients) are changed in place.
template <typename R>
void QkvBlockBackward(const DecoderDims& d, const DecoderTensors<const R>& w, const DecoderTensors<R>& g,
                      const TokenGeometry& geom, const R* x, const DecoderActs<R>& a, R* dq, R* dk, R* dv, const R* dh1,
                      R* dx, CpuWorkerPool* pool, const R* dqgate = nullptr) {
  const int64_t T = geom.num_tokens, H = d.hidden, hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  // RoPE backward (inverse rotation), then q/k RMSNorm backward, in place.
  ApplyRope(dq, T, d.heads, hd, geom, RopeDirection::kBackward, pool);
  ApplyRope(dk, T, d.kv_heads, hd, geom, RopeDirection::kBackward, pool);
  if (w[kQNorm] != nullptr) {
    RmsNormBackwardRows(a.q_raw.data(), a.q_rstd.data(), w[kQNorm], dq, T * d.heads, hd, dq, Accumulate::kOverwrite,
                        g[kQNorm], pool);
    RmsNormBackwardRows(a.k_raw.data(), a.k_rstd.data(), w[kKNorm], dk, T * d.kv_heads, hd, dk, Accumulate::kOverwrite,
                        g[kKNorm], pool);
  }
  if (g[kQBias] != nullptr) {
    BiasBackward(dq, T, qd, g[kQBias]);
    BiasBackward(dk, T, kvd, g[kKBias]);
    BiasBackward(dv, T, kvd, g[kVBias]);
  }

  // QKV projections; with the output gate, q_proj's gradient interleaves [dquery | dgate] per head.
  std::vector<R> dxn(T * H);
  if (d.output_gate) {
    std::vector<R> full(T * 2 * qd);
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t h = 0; h < d.heads; ++h) {
        R* dst = full.data() + t * 2 * qd + h * 2 * hd;
        std::copy(dq + t * qd + h * hd, dq + t * qd + (h + 1) * hd, dst);
        std::copy(dqgate + t * qd + h * hd, dqgate + t * qd + (h + 1) * hd, dst + hd);
      }
    }
    LinearBackwardWeight(full.data(), a.xn.data(), T, H, 2 * qd, g[kQProj], pool);
    LinearBackwardInput(full.data(), w[kQProj], T, H, 2 * qd, dxn.data(), Accumulate::kOverwrite, pool);
  } else {
    LinearBackwardWeight(dq, a.xn.data(), T, H, qd, g[kQProj], pool);
    LinearBackwardInput(dq, w[kQProj], T, H, qd, dxn.data(), Accumulate::kOverwrite, pool);
  }
  LinearBackwardWeight(dk, a.xn.data(), T, H, kvd, g[kKProj], pool);
  LinearBackwardWeight(dv, a.xn.data(), T, H, kvd, g[kVProj], pool);
  LinearBackwardInput(dk, w[kKProj], T, H, kvd, dxn.data(), Accumulate::kAdd, pool);
  LinearBackwardInput(dv, w[kVProj], T, H, kvd, dxn.data(), Accumulate::kAdd, pool);

  // Input RMSNorm; the residual path contributes dh1.
  if (dx != dh1) std::copy(dh1, dh1 + T * H, dx);
  RmsNormBackwardRows(x, a.rstd1.data(), w[kInputNorm], dxn.data(), T, H, dx, Accumulate::kAdd, g[kInputNorm], pool);
}

// Attention over the whole batch from its inputs computed tile by tile: q_rot, k_rot, v, attn and
// lse of every token (the other fields left empty).
template <typename R>
DecoderActs<R> TiledAttention(const DecoderDims& d, const DecoderOffsets& offs, const R* params,
                              const TokenGeometry& geom, const R* x, int64_t tile, CpuWorkerPool* pool) {
  const int64_t T = geom.num_tokens, H = d.hidden, half = d.head_dim / 2, qd = d.q_dim(), kvd = d.kv_dim();
  DecoderActs<R> whole;
  whole.q_rot.resize(T * qd);
  whole.k_rot.resize(T * kvd);
  whole.v.resize(T * kvd);
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t rows = std::min(tile, T - t0);
    DecoderActs<R> t;
    DecoderAttentionInputs(d, offs, params, TileGeometry(geom, half, t0, rows), x + t0 * H, &t, pool);
    std::copy(t.q_rot.begin(), t.q_rot.end(), whole.q_rot.begin() + t0 * qd);
    std::copy(t.k_rot.begin(), t.k_rot.end(), whole.k_rot.begin() + t0 * kvd);
    std::copy(t.v.begin(), t.v.end(), whole.v.begin() + t0 * kvd);
    whole.sinks = t.sinks;
  }
  DecoderAttention(d, offs, geom, &whole, pool);
  return whole;
}

}  // namespace

template <typename R>
void DecoderBackward(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& batch_geom,
                     const R* x, const DecoderActs<R>& a, const R* dy, R* dx, R* dparams, CpuWorkerPool* pool,
                     const double* aux_prob_grad) {
  const TokenGeometry geom = LayerGeometry(batch_geom, offs);  // its RoPE tables
  const DecoderTensors<const R> w(params, offs);
  const DecoderTensors<R> g(dparams, offs);
  const int64_t T = geom.num_tokens, H = d.hidden, qd = d.q_dim(), kvd = d.kv_dim();
  std::vector<R> dh1(T * H), dattn(T * std::max(qd, H)), dqgate(d.output_gate ? T * qd : 0);
  MlpBlockBackward(d, offs, params, dparams, T, a, dy, dh1.data(), dattn.data(), aux_prob_grad, pool, dqgate.data());
  if (offs.linear()) {
    // The Gated DeltaNet, then the input norm: dx = dh1 + RMSNorm1 backward (dx may alias dy).
    std::vector<R> dxn(T * H);
    LinearAttentionBackward(LinearDimsOf(d), LinearOffsetsOf(offs), params, geom, a.xn.data(), a.linear,
                            dattn.data(), dxn.data(), dparams, pool);
    std::copy(dh1.begin(), dh1.end(), dx);
    RmsNormBackwardRows(x, a.rstd1.data(), w[kInputNorm], dxn.data(), T, H, dx, Accumulate::kAdd, g[kInputNorm], pool);
    return;
  }
  std::vector<R> dq(T * qd), dk(T * kvd), dv(T * kvd);
  if (g[kSinks] != nullptr) {
    AttentionSinksBackward(T, d.heads, d.head_dim, w[kSinks], a.attn.data(), a.lse.data(), dattn.data(), g[kSinks]);
  }
  AttentionBackward(d, geom, offs.attention_window, a.q_rot.data(), a.k_rot.data(), a.v.data(), a.attn.data(),
                    a.lse.data(), dattn.data(), dq.data(), dk.data(), dv.data(), pool);
  dattn = {};
  // dx is written only now (it may alias dy).
  QkvBlockBackward(d, w, g, geom, x, a, dq.data(), dk.data(), dv.data(), dh1.data(), dx, pool, dqgate.data());
}

template <typename R>
void DecoderForwardTiled(const DecoderDims& d, const DecoderOffsets& offs, const R* params,
                         const TokenGeometry& batch_geom, const R* x, R* y, int64_t tile, CpuWorkerPool* pool) {
  const TokenGeometry geom = LayerGeometry(batch_geom, offs);  // its RoPE tables
  const int64_t T = geom.num_tokens, H = d.hidden, half = d.head_dim / 2, qd = d.q_dim();
  // qwen3_5's layers run whole (the Gated DeltaNet mixes every token; the gated attention's gate
  // is not tiled).
  if (tile <= 0 || tile >= T || offs.linear() || d.output_gate) {
    DecoderActs<R> acts;
    DecoderForwardAll(d, offs, params, geom, x, y, &acts, pool);
    return;
  }
  // Attention's inputs tile by tile, attention whole, then the MLP tile by tile (y may alias x:
  // a tile's x rows are read before its y rows are written).
  const DecoderActs<R> whole = TiledAttention(d, offs, params, geom, x, tile, pool);
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t rows = std::min(tile, T - t0);
    const TokenGeometry tg = TileGeometry(geom, half, t0, rows);
    DecoderActs<R> t;
    t.attn = Rows(whole.attn, t0, rows, qd);
    DecoderMlpInputs(d, offs, params, tg, x + t0 * H, &t, pool);
    DecoderOutput(d, offs, params, tg, t, y + t0 * H, pool);
  }
}

template <typename R>
void DecoderBackwardTiled(const DecoderDims& d, const DecoderOffsets& offs, const R* params,
                          const TokenGeometry& batch_geom, const R* x, const R* dy, R* dx, R* dparams, int64_t tile,
                          CpuWorkerPool* pool) {
  const TokenGeometry geom = LayerGeometry(batch_geom, offs);  // its RoPE tables
  const int64_t T = geom.num_tokens, H = d.hidden, half = d.head_dim / 2, qd = d.q_dim(), kvd = d.kv_dim();
  if (tile <= 0 || tile >= T || offs.linear() || d.output_gate) {
    DecoderActs<R> acts;
    std::vector<R> y(T * H);
    DecoderForwardAll(d, offs, params, geom, x, y.data(), &acts, pool);
    DecoderBackward(d, offs, params, geom, x, acts, dy, dx, dparams, pool);
    return;
  }
  const DecoderTensors<const R> w(params, offs);
  const DecoderTensors<R> g(dparams, offs);
  // Attention's inputs and output, recomputed whole (tile by tile for the inputs).
  const DecoderActs<R> whole = TiledAttention(d, offs, params, geom, x, tile, pool);
  // The MLP and o_proj blocks tile by tile (each tile's MLP inputs recomputed); dh1 waits whole.
  std::vector<R> dh1(T * H), dattn(T * qd);
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t rows = std::min(tile, T - t0);
    DecoderActs<R> t;
    t.attn = Rows(whole.attn, t0, rows, qd);
    DecoderMlpInputs(d, offs, params, TileGeometry(geom, half, t0, rows), x + t0 * H, &t, pool);
    MlpBlockBackward(d, offs, params, dparams, rows, t, dy + t0 * H, dh1.data() + t0 * H, dattn.data() + t0 * qd,
                     nullptr, pool);
  }
  std::vector<R> dq(T * qd), dk(T * kvd), dv(T * kvd);
  if (g[kSinks] != nullptr) {
    AttentionSinksBackward(T, d.heads, d.head_dim, w[kSinks], whole.attn.data(), whole.lse.data(), dattn.data(),
                           g[kSinks]);
  }
  AttentionBackward(d, geom, offs.attention_window, whole.q_rot.data(), whole.k_rot.data(), whole.v.data(),
                    whole.attn.data(), whole.lse.data(), dattn.data(), dq.data(), dk.data(), dv.data(), pool);
  dattn = {};
  // The QKV block tile by tile, each tile's attention inputs recomputed (their norms' statistics).
  for (int64_t t0 = 0; t0 < T; t0 += tile) {
    const int64_t rows = std::min(tile, T - t0);
    const TokenGeometry tg = TileGeometry(geom, half, t0, rows);
    DecoderActs<R> t;
    DecoderAttentionInputs(d, offs, params, tg, x + t0 * H, &t, pool);
    QkvBlockBackward(d, w, g, tg, x + t0 * H, t, dq.data() + t0 * qd, dk.data() + t0 * kvd, dv.data() + t0 * kvd,
                     dh1.data() + t0 * H, dx + t0 * H, pool);
  }
}

#define SLIDEDP_INSTANTIATE_DECODER_LAYER(R)                                                                         \
  template struct DecoderActs<R>;                                                                                    \
  template void DecoderAttentionInputs<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&, \
                                          const R*, DecoderActs<R>*, CpuWorkerPool*);                                \
  template void DecoderAttention<R>(const DecoderDims&, const DecoderOffsets&, const TokenGeometry&,                 \
                                    DecoderActs<R>*, CpuWorkerPool*);                                                \
  template void DecoderMlpInputs<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,       \
                                    const R*, DecoderActs<R>*, CpuWorkerPool*);                                      \
  template void DecoderOutput<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,          \
                                 const DecoderActs<R>&, R*, CpuWorkerPool*);                                         \
  template void DecoderForwardAll<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,      \
                                     const R*, R*, DecoderActs<R>*, CpuWorkerPool*);                                 \
  template void DecoderForwardTiled<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,    \
                                       const R*, R*, int64_t, CpuWorkerPool*);                                       \
  template void DecoderBackwardTiled<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,   \
                                        const R*, const R*, R*, R*, int64_t, CpuWorkerPool*);                        \
  template void DecoderBackward<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,        \
                                   const R*, const DecoderActs<R>&, const R*, R*, R*, CpuWorkerPool*, const double*);

SLIDEDP_INSTANTIATE_DECODER_LAYER(float)
SLIDEDP_INSTANTIATE_DECODER_LAYER(double)

}  // namespace slidedp
