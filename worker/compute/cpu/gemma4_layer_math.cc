// Gemma 4's decoder layer on the CPU backend (gemma4_math.h): its forward, and its backward from a
// recomputed forward; layer 0's per-layer input projection. Built of the dense math's op-level
// references (dense_reference_math.h) and its attention. Explicitly instantiated for float and double.
// Limits: scalar C++, untiled; meant for tiny models and oracles.
#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "worker/compute/cpu/dense_reference_math_internal.h"
#include "worker/compute/cpu/gemma4_math.h"

namespace slidedp {
namespace {

using dense_math::GatedMlp;
using dense_math::GatedMlpBackward;
using dense_math::GeluTanh;
using dense_math::GeluTanhGrad;

// What the layer's backward reads of its forward (all recomputed from the layer input).
template <typename R>
struct LayerActs {
  std::vector<R> rstd1, xn;             // input norm
  std::vector<R> q_raw, q_rstd, q_rot;  // q_proj output, its per-head norm's rsqrt, normed and rotated
  std::vector<R> k_raw, k_rstd, k_rot;  // the same for k (a layer with its own keys)
  std::vector<R> v_raw, v_rstd, v;      // v_proj output (empty under k_eq_v: k_raw), v_norm's rsqrt, v
  std::vector<R> attn, lse;
  std::vector<R> o, o_rstd;             // o_proj output, post_attention_layernorm's rsqrt
  std::vector<R> h1;                    // x + the normed attention output
  std::vector<R> rstd2, hn;             // pre_feedforward_layernorm
  std::vector<R> gate, up;
  std::vector<R> down, down_rstd;       // down_proj output, post_feedforward_layernorm's rsqrt
  std::vector<R> h2;                    // h1 + the normed MLP output
  std::vector<R> ple_gate;              // [T, ple_dim] per_layer_input_gate output (before the GELU)
  std::vector<R> ple_proj, ple_rstd;    // per_layer_projection output, post_per_layer_input_norm's rsqrt
  std::vector<R> model_proj, model_rstd;  // layer 0: the scaled projection [T, L x P] and its norm's rsqrt
};

// Views of the decoder tensors inside a flat unit array.
template <typename T>
struct Tensors {
  T* p[kNumDecoderTensors];
  Tensors(T* base, const DecoderOffsets& offs) {
    for (int i = 0; i < kNumDecoderTensors; ++i) p[i] = offs.at[i] >= 0 ? base + offs.at[i] : nullptr;
  }
  T* operator[](int i) const { return p[i]; }
};

// HF's Python-float scales, as the tensors' own type multiplies them.
template <typename R>
R ProjectionScale(int64_t hidden) {  // per_layer_model_projection_scale = hidden_size ** -0.5
  return static_cast<R>(std::pow(static_cast<double>(hidden), -0.5));
}
template <typename R>
R InputScale() {  // per_layer_input_scale = 2.0 ** -0.5
  return static_cast<R>(std::pow(2.0, -0.5));
}

// Layer 0's per-layer inputs: state->ple = (rms_P(x0 Wp^T * scale) w_pn + ple_token) / sqrt(2).
template <typename R>
void PleInputsForward(const Gemma4LayerDims& d, const Tensors<const R>& w, int64_t T, const R* x0,
                      Gemma4BatchState<R>* state, LayerActs<R>* a, CpuWorkerPool* pool) {
  const int64_t H = d.attn.hidden, LP = d.layers * d.ple_dim;
  a->model_proj.resize(T * LP);
  a->model_rstd.resize(T * d.layers);
  LinearForward(x0, w[kPleModelProj], T, H, LP, a->model_proj.data(), pool);
  const R s = ProjectionScale<R>(H);
  for (R& v : a->model_proj) v *= s;
  state->ple.resize(T * LP);
  RmsNormRows(a->model_proj.data(), w[kPleModelNorm], T * d.layers, d.ple_dim, static_cast<R>(d.attn.rms_norm_eps),
              state->ple.data(), a->model_rstd.data(), pool);
  const R c = InputScale<R>();
  for (int64_t i = 0; i < T * LP; ++i) state->ple[i] = (state->ple[i] + state->ple_token[i]) * c;
}

// Its backward from the whole state->ple_grad: the projection's and its norm's gradients, dx0 += its
// share, state->ple_token_grad.
template <typename R>
void PleInputsBackward(const Gemma4LayerDims& d, const Tensors<const R>& w, const Tensors<R>& g, int64_t T,
                       const R* x0, const LayerActs<R>& a, Gemma4BatchState<R>* state, R* dx0, CpuWorkerPool* pool) {
  const int64_t H = d.attn.hidden, LP = d.layers * d.ple_dim;
  const R c = InputScale<R>();
  state->ple_token_grad.resize(T * LP);
  for (int64_t i = 0; i < T * LP; ++i) state->ple_token_grad[i] = state->ple_grad[i] * c;
  std::vector<R> dproj(T * LP);
  RmsNormBackwardRows(a.model_proj.data(), a.model_rstd.data(), w[kPleModelNorm], state->ple_token_grad.data(),
                      T * d.layers, d.ple_dim, dproj.data(), Accumulate::kOverwrite, g[kPleModelNorm], pool);
  const R s = ProjectionScale<R>(H);
  for (R& v : dproj) v *= s;
  LinearBackwardWeight(dproj.data(), x0, T, H, LP, g[kPleModelProj], pool);
  LinearBackwardInput(dproj.data(), w[kPleModelProj], T, H, LP, dx0, Accumulate::kAdd, pool);
}

// The layer's forward into a (and y), reading and filling the batch state as gemma4_math.h says.
template <typename R>
void Forward(const Gemma4LayerDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
             const R* x, Gemma4BatchState<R>* state, LayerActs<R>* a, R* y, CpuWorkerPool* pool) {
  const Tensors<const R> w(params, offs);
  const DecoderDims& ad = d.attn;
  const int64_t T = geom.num_tokens, H = ad.hidden, hd = ad.head_dim, I = ad.intermediate, P = d.ple_dim;
  const int64_t qd = ad.q_dim(), kvd = ad.kv_dim();
  const R eps = static_cast<R>(ad.rms_norm_eps);
  if (w[kPleModelProj] != nullptr) PleInputsForward(d, w, T, x, state, a, pool);

  a->rstd1.resize(T);
  a->xn.resize(T * H);
  RmsNormRows(x, w[kInputNorm], T, H, eps, a->xn.data(), a->rstd1.data(), pool);
  a->q_raw.resize(T * qd);
  a->q_rstd.resize(T * ad.heads);
  a->q_rot.resize(T * qd);
  LinearForward(a->xn.data(), w[kQProj], T, H, qd, a->q_raw.data(), pool);
  RmsNormRows(a->q_raw.data(), w[kQNorm], T * ad.heads, hd, eps, a->q_rot.data(), a->q_rstd.data(), pool);
  ApplyRope(a->q_rot.data(), T, ad.heads, hd, geom, RopeDirection::kForward, pool);
  const R* k_use;
  const R* v_use;
  if (d.kv_source < 0) {
    a->k_raw.resize(T * kvd);
    a->k_rstd.resize(T * ad.kv_heads);
    a->k_rot.resize(T * kvd);
    LinearForward(a->xn.data(), w[kKProj], T, H, kvd, a->k_raw.data(), pool);
    if (!d.k_eq_v) {
      a->v_raw.resize(T * kvd);
      LinearForward(a->xn.data(), w[kVProj], T, H, kvd, a->v_raw.data(), pool);
    }
    RmsNormRows(a->k_raw.data(), w[kKNorm], T * ad.kv_heads, hd, eps, a->k_rot.data(), a->k_rstd.data(), pool);
    ApplyRope(a->k_rot.data(), T, ad.kv_heads, hd, geom, RopeDirection::kForward, pool);
    // v_norm: Gemma4RMSNorm(with_scale=False), over the value projection (k_proj's under k_eq_v).
    const std::vector<R> ones(hd, R(1));
    a->v_rstd.resize(T * ad.kv_heads);
    a->v.resize(T * kvd);
    RmsNormRows(d.k_eq_v ? a->k_raw.data() : a->v_raw.data(), ones.data(), T * ad.kv_heads, hd, eps, a->v.data(),
                a->v_rstd.data(), pool);
    if (d.kv_stored) {  // the dk / dv the sharing layers add stay
      state->kv[d.layer].k = a->k_rot;
      state->kv[d.layer].v = a->v;
    }
    k_use = a->k_rot.data();
    v_use = a->v.data();
  } else {
    const typename Gemma4BatchState<R>::SharedKv& kv = state->kv.at(d.kv_source);
    k_use = kv.k.data();
    v_use = kv.v.data();
  }
  a->attn.resize(T * qd);
  a->lse.resize(T * ad.heads);
  AttentionForward(ad, geom, offs.attention_window, a->q_rot.data(), k_use, v_use, a->attn.data(), a->lse.data(),
                   pool);

  a->o.resize(T * H);
  a->o_rstd.resize(T);
  a->h1.resize(T * H);
  LinearForward(a->attn.data(), w[kOProj], T, qd, H, a->o.data(), pool);
  RmsNormRows(a->o.data(), w[kPostNorm], T, H, eps, a->h1.data(), a->o_rstd.data(), pool);
  for (int64_t i = 0; i < T * H; ++i) a->h1[i] = x[i] + a->h1[i];
  a->rstd2.resize(T);
  a->hn.resize(T * H);
  RmsNormRows(a->h1.data(), w[kPreFfnNorm], T, H, eps, a->hn.data(), a->rstd2.data(), pool);
  a->gate.resize(T * I);
  a->up.resize(T * I);
  LinearForward(a->hn.data(), w[kGateProj], T, H, I, a->gate.data(), pool);
  LinearForward(a->hn.data(), w[kUpProj], T, H, I, a->up.data(), pool);
  std::vector<R> m(T * I);
  GatedMlp(MlpActivation::kGeluTanh, a->gate.data(), a->up.data(), T * I, m.data());
  a->down.resize(T * H);
  a->down_rstd.resize(T);
  a->h2.resize(T * H);
  LinearForward(m.data(), w[kDownProj], T, I, H, a->down.data(), pool);
  RmsNormRows(a->down.data(), w[kPostFfnNorm], T, H, eps, a->h2.data(), a->down_rstd.data(), pool);
  for (int64_t i = 0; i < T * H; ++i) a->h2[i] = a->h1[i] + a->h2[i];

  std::copy(a->h2.begin(), a->h2.end(), y);
  if (P > 0) {
    const R* ple = state->ple.data() + d.layer * P;
    const int64_t stride = d.layers * P;
    a->ple_gate.resize(T * P);
    LinearForward(a->h2.data(), w[kPleGate], T, H, P, a->ple_gate.data(), pool);
    std::vector<R> gated(T * P);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < P; ++i) gated[t * P + i] = GeluTanh(a->ple_gate[t * P + i]) * ple[t * stride + i];
    a->ple_proj.resize(T * H);
    a->ple_rstd.resize(T);
    LinearForward(gated.data(), w[kPleProj], T, P, H, a->ple_proj.data(), pool);
    std::vector<R> normed(T * H);
    RmsNormRows(a->ple_proj.data(), w[kPlePostNorm], T, H, eps, normed.data(), a->ple_rstd.data(), pool);
    for (int64_t i = 0; i < T * H; ++i) y[i] += normed[i];
  }
  const R scalar = w[kLayerScalar][0];
  for (int64_t i = 0; i < T * H; ++i) y[i] *= scalar;
}

}  // namespace

Gemma4LayerDims Gemma4LayerDims::Of(const ModelConfig& c, int64_t layer) {
  Gemma4LayerDims d;
  d.attn = DecoderDims::From(c);
  d.attn.head_dim = c.LayerHeadDim(layer);
  d.attn.kv_heads = c.LayerKvHeads(layer);
  d.attn.intermediate = c.LayerIntermediate(layer);
  d.attn.attn_scale = 1.0;  // Gemma4TextAttention.scaling
  d.layer = layer;
  d.layers = c.num_hidden_layers;
  d.ple_dim = c.gemma4.ple_dim;
  d.sliding = c.IsSlidingLayer(layer);
  d.k_eq_v = c.gemma4.k_eq_v && !d.sliding;
  d.kv_source = c.KvSourceLayer(layer);
  for (int64_t l = layer + 1; l < c.num_hidden_layers; ++l) d.kv_stored = d.kv_stored || c.KvSourceLayer(l) == layer;
  return d;
}

TokenGeometry Gemma4LayerGeometry(const TokenGeometry& batch, const RopeTables& rope, bool sliding) {
  TokenGeometry g = batch;
  g.rope_cos = sliding ? rope.sliding_cos.data() : rope.cos.data();
  g.rope_sin = sliding ? rope.sliding_sin.data() : rope.sin.data();
  g.rope_half = sliding ? rope.sliding_half : rope.half;
  g.sliding_rope_cos = nullptr;
  g.sliding_rope_sin = nullptr;
  return g;
}

template <typename R>
void Gemma4LayerForward(const Gemma4LayerDims& d, const DecoderOffsets& offs, const R* params,
                        const TokenGeometry& geom, const R* x, Gemma4BatchState<R>* state, R* y, CpuWorkerPool* pool) {
  LayerActs<R> acts;
  Forward(d, offs, params, geom, x, state, &acts, y, pool);
}

template <typename R>
void Gemma4LayerBackward(const Gemma4LayerDims& d, const DecoderOffsets& offs, const R* params,
                         const TokenGeometry& geom, const R* x, const R* dy, R* dx, R* dparams,
                         Gemma4BatchState<R>* state, CpuWorkerPool* pool) {
  const Tensors<const R> w(params, offs);
  const Tensors<R> g(dparams, offs);
  const DecoderDims& ad = d.attn;
  const int64_t T = geom.num_tokens, H = ad.hidden, hd = ad.head_dim, I = ad.intermediate, P = d.ple_dim;
  const int64_t qd = ad.q_dim(), kvd = ad.kv_dim();
  LayerActs<R> a;
  {
    std::vector<R> y(T * H);
    Forward(d, offs, params, geom, x, state, &a, y.data(), pool);
  }
  // y = h3 * layer_scalar (a buffer: no gradient of its own).
  const R scalar = w[kLayerScalar][0];
  std::vector<R> dh3(T * H);
  for (int64_t i = 0; i < T * H; ++i) dh3[i] = dy[i] * scalar;
  std::vector<R> dh2 = dh3;
  if (P > 0) {  // h3 = h2 + rms(ple_proj(gelu(ple_gate(h2)) * p)) w_pp
    const R* ple = state->ple.data() + d.layer * P;
    R* dple = state->ple_grad.data() + d.layer * P;
    const int64_t stride = d.layers * P;
    std::vector<R> dproj(T * H), act(T * P), gated(T * P), dgated(T * P), dgate(T * P);
    RmsNormBackwardRows(a.ple_proj.data(), a.ple_rstd.data(), w[kPlePostNorm], dh3.data(), T, H, dproj.data(),
                        Accumulate::kOverwrite, g[kPlePostNorm], pool);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < P; ++i) {
        act[t * P + i] = GeluTanh(a.ple_gate[t * P + i]);
        gated[t * P + i] = act[t * P + i] * ple[t * stride + i];
      }
    LinearBackwardWeight(dproj.data(), gated.data(), T, P, H, g[kPleProj], pool);
    LinearBackwardInput(dproj.data(), w[kPleProj], T, P, H, dgated.data(), Accumulate::kOverwrite, pool);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < P; ++i) {
        const R dg = dgated[t * P + i];
        dple[t * stride + i] += dg * act[t * P + i];
        dgate[t * P + i] = dg * ple[t * stride + i] * GeluTanhGrad(a.ple_gate[t * P + i]);
      }
    LinearBackwardWeight(dgate.data(), a.h2.data(), T, H, P, g[kPleGate], pool);
    LinearBackwardInput(dgate.data(), w[kPleGate], T, H, P, dh2.data(), Accumulate::kAdd, pool);
  }
  dh3 = {};

  // h2 = h1 + rms(down(gelu(gate) up)) w_pf, the MLP's input m = rms(h1) w_pr.
  std::vector<R> ddown(T * H), dm(T * I), dgate(T * I), dup(T * I), dhn(T * H);
  RmsNormBackwardRows(a.down.data(), a.down_rstd.data(), w[kPostFfnNorm], dh2.data(), T, H, ddown.data(),
                      Accumulate::kOverwrite, g[kPostFfnNorm], pool);
  {
    std::vector<R> m(T * I);
    GatedMlp(MlpActivation::kGeluTanh, a.gate.data(), a.up.data(), T * I, m.data());
    LinearBackwardWeight(ddown.data(), m.data(), T, I, H, g[kDownProj], pool);
  }
  LinearBackwardInput(ddown.data(), w[kDownProj], T, I, H, dm.data(), Accumulate::kOverwrite, pool);
  GatedMlpBackward(MlpActivation::kGeluTanh, a.gate.data(), a.up.data(), dm.data(), T * I, dgate.data(), dup.data());
  LinearBackwardWeight(dgate.data(), a.hn.data(), T, H, I, g[kGateProj], pool);
  LinearBackwardWeight(dup.data(), a.hn.data(), T, H, I, g[kUpProj], pool);
  LinearBackwardInput(dgate.data(), w[kGateProj], T, H, I, dhn.data(), Accumulate::kOverwrite, pool);
  LinearBackwardInput(dup.data(), w[kUpProj], T, H, I, dhn.data(), Accumulate::kAdd, pool);
  std::vector<R> dh1 = dh2;
  RmsNormBackwardRows(a.h1.data(), a.rstd2.data(), w[kPreFfnNorm], dhn.data(), T, H, dh1.data(), Accumulate::kAdd,
                      g[kPreFfnNorm], pool);

  // h1 = x + rms(o_proj(attn)) w_po.
  std::vector<R> dout(T * H), dattn(T * qd);
  RmsNormBackwardRows(a.o.data(), a.o_rstd.data(), w[kPostNorm], dh1.data(), T, H, dout.data(),
                      Accumulate::kOverwrite, g[kPostNorm], pool);
  LinearBackwardWeight(dout.data(), a.attn.data(), T, qd, H, g[kOProj], pool);
  LinearBackwardInput(dout.data(), w[kOProj], T, qd, H, dattn.data(), Accumulate::kOverwrite, pool);

  // Attention, with its own keys and values or its source layer's.
  const bool own = d.kv_source < 0;
  typename Gemma4BatchState<R>::SharedKv* shared = own ? nullptr : &state->kv.at(d.kv_source);
  const R* k_use = own ? a.k_rot.data() : shared->k.data();
  const R* v_use = own ? a.v.data() : shared->v.data();
  std::vector<R> dq(T * qd), dk(T * kvd), dv(T * kvd);
  AttentionBackward(ad, geom, offs.attention_window, a.q_rot.data(), k_use, v_use, a.attn.data(), a.lse.data(),
                    dattn.data(), dq.data(), dk.data(), dv.data(), pool);
  std::vector<R> dxn(T * H);
  if (!own) {
    if (shared->dk.empty()) {
      shared->dk.assign(T * kvd, R(0));
      shared->dv.assign(T * kvd, R(0));
    }
    for (int64_t i = 0; i < T * kvd; ++i) {
      shared->dk[i] += dk[i];
      shared->dv[i] += dv[i];
    }
  } else {
    if (d.kv_stored) {  // the sharing layers' gradients, all added by now (they come later)
      const typename Gemma4BatchState<R>::SharedKv& mine = state->kv.at(d.layer);
      for (int64_t i = 0; i < static_cast<int64_t>(mine.dk.size()); ++i) {
        dk[i] += mine.dk[i];
        dv[i] += mine.dv[i];
      }
    }
    const std::vector<R> ones(hd, R(1));
    std::vector<R> dv_raw(T * kvd), dk_raw(T * kvd), scratch(hd, R(0));
    RmsNormBackwardRows(d.k_eq_v ? a.k_raw.data() : a.v_raw.data(), a.v_rstd.data(), ones.data(), dv.data(),
                        T * ad.kv_heads, hd, dv_raw.data(), Accumulate::kOverwrite, scratch.data(), pool);
    ApplyRope(dk.data(), T, ad.kv_heads, hd, geom, RopeDirection::kBackward, pool);
    RmsNormBackwardRows(a.k_raw.data(), a.k_rstd.data(), w[kKNorm], dk.data(), T * ad.kv_heads, hd, dk_raw.data(),
                        Accumulate::kOverwrite, g[kKNorm], pool);
    if (d.k_eq_v) {
      for (int64_t i = 0; i < T * kvd; ++i) dk_raw[i] += dv_raw[i];
    } else {
      LinearBackwardWeight(dv_raw.data(), a.xn.data(), T, H, kvd, g[kVProj], pool);
      LinearBackwardInput(dv_raw.data(), w[kVProj], T, H, kvd, dxn.data(), Accumulate::kAdd, pool);
    }
    LinearBackwardWeight(dk_raw.data(), a.xn.data(), T, H, kvd, g[kKProj], pool);
    LinearBackwardInput(dk_raw.data(), w[kKProj], T, H, kvd, dxn.data(), Accumulate::kAdd, pool);
  }
  ApplyRope(dq.data(), T, ad.heads, hd, geom, RopeDirection::kBackward, pool);
  std::vector<R> dq_raw(T * qd);
  RmsNormBackwardRows(a.q_raw.data(), a.q_rstd.data(), w[kQNorm], dq.data(), T * ad.heads, hd, dq_raw.data(),
                      Accumulate::kOverwrite, g[kQNorm], pool);
  LinearBackwardWeight(dq_raw.data(), a.xn.data(), T, H, qd, g[kQProj], pool);
  LinearBackwardInput(dq_raw.data(), w[kQProj], T, H, qd, dxn.data(), Accumulate::kAdd, pool);

  // The input norm; dx is written only now (it may alias dy).
  std::copy(dh1.begin(), dh1.end(), dx);
  RmsNormBackwardRows(x, a.rstd1.data(), w[kInputNorm], dxn.data(), T, H, dx, Accumulate::kAdd, g[kInputNorm], pool);
  if (w[kPleModelProj] != nullptr) PleInputsBackward(d, w, g, T, x, a, state, dx, pool);
}

#define SLIDEDP_INSTANTIATE_GEMMA4_LAYER(R)                                                                       \
  template void Gemma4LayerForward<R>(const Gemma4LayerDims&, const DecoderOffsets&, const R*,                   \
                                      const TokenGeometry&, const R*, Gemma4BatchState<R>*, R*, CpuWorkerPool*); \
  template void Gemma4LayerBackward<R>(const Gemma4LayerDims&, const DecoderOffsets&, const R*,                  \
                                       const TokenGeometry&, const R*, const R*, R*, R*, Gemma4BatchState<R>*,   \
                                       CpuWorkerPool*);

SLIDEDP_INSTANTIATE_GEMMA4_LAYER(float)
SLIDEDP_INSTANTIATE_GEMMA4_LAYER(double)

}  // namespace slidedp
