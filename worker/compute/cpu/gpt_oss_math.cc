// GPT-OSS's reference math (gpt_oss_math.h): attention sinks and the MoE block (biased top-k
// softmax router, biased experts with the clamped SwiGLU), explicitly instantiated for float
// (backend) and double (gradient checks). The experts' GEMMs are the dense Linear* ops with the
// operands' roles swapped (transformers stores these weights [in, out]), so threading and
// determinism are theirs. Limits: scalar C++, experts one after another; for tiny models and oracles.
#include "worker/compute/cpu/gpt_oss_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/dense_reference_math_internal.h"
#include "worker/compute/cpu/moe_token_loops.h"

namespace slidedp {
namespace {

using dense_math::BiasBackward;
using moe_loops::DotSerial;
using moe_loops::kMinTokensPerRange;

// y[n, O] = x[n, K] W[K, O] (W stored [in, out], as transformers' experts are): dense_reference_math's
// dx = dy W with dy := x.
template <typename R>
void MatMulInOut(const R* x, const R* w, int64_t n, int64_t K, int64_t O, R* y, CpuWorkerPool* pool) {
  LinearBackwardInput(x, w, n, O, K, y, Accumulate::kOverwrite, pool);
}

// The router (GptOssTopKRouter): logits with the bias, their full softmax (for the aux loss's
// statistics), the top-k experts by logit and their weights, the softmax of those k logits.
template <typename R>
void GptOssRoute(const MoeDims& d, const MoeOffsets& offs, const R* params, const R* x, int64_t T, MoeActs<R>* a,
                 CpuWorkerPool* pool) {
  const int64_t H = d.hidden, E = d.num_experts, k = d.top_k;
  a->router_logits.resize(T * E);
  a->router_probs.resize(T * E);
  a->topk_expert.resize(T * k);
  a->topk_weight.resize(T * k);
  LinearForward(x, params + offs.router, T, H, E, a->router_logits.data(), pool);
  const R* bias = params + offs.router_bias;
  ParallelRanges(pool, T, kMinTokensPerRange, [&](int64_t t0, int64_t t1) {
    std::vector<char> taken(E);
    for (int64_t t = t0; t < t1; ++t) {
      R* z = a->router_logits.data() + t * E;
      for (int64_t e = 0; e < E; ++e) z[e] += bias[e];
      moe_loops::SoftmaxRow(z, E, a->router_probs.data() + t * E);
      // Top-k of the logits (not of the probabilities: the same order, HF's operands).
      int32_t* sel = a->topk_expert.data() + t * k;
      moe_loops::TopKByArgMax(z, E, k, taken, sel);
      // softmax over the k selected logits; the first is their largest.
      R* w = a->topk_weight.data() + t * k;
      R wsum = 0;
      for (int64_t j = 0; j < k; ++j) {
        w[j] = std::exp(z[sel[j]] - z[sel[0]]);
        wsum += w[j];
      }
      for (int64_t j = 0; j < k; ++j) w[j] = w[j] / wsum;
    }
  });
}

// Token rows gathered in the permutation's order: xg[r] = x[token_index[r]].
template <typename R>
std::vector<R> GatherRows(const MoePermutation& perm, const R* x, int64_t rows, int64_t H, CpuWorkerPool* pool) {
  std::vector<R> xg(rows * H);
  ParallelRanges(pool, rows, kMinTokensPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy_n(x + perm.token_index[r] * H, H, xg.data() + r * H);
  });
  return xg;
}

}  // namespace

template <typename R>
void ApplyAttentionSinks(int64_t T, int64_t heads, int64_t head_dim, const R* sinks, R* attn, R* lse) {
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      R& l = lse[t * heads + h];
      const R s = sinks[h];
      // log(exp(l) + exp(s)), stably; the keys' share of the denominator is exp(l - l_s).
      const R l_s = std::max(l, s) + std::log1p(std::exp(-std::abs(l - s)));
      const R keep = std::exp(l - l_s);
      R* o = attn + (t * heads + h) * head_dim;
      for (int64_t i = 0; i < head_dim; ++i) o[i] *= keep;
      l = l_s;
    }
  }
}

template <typename R>
void AttentionSinksBackward(int64_t T, int64_t heads, int64_t head_dim, const R* sinks, const R* attn, const R* lse,
                            const R* dattn, R* dsinks) {
  std::vector<R> acc(heads, R(0));
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t at = (t * heads + h) * head_dim;
      const R dsum = DotSerial(dattn + at, attn + at, head_dim);
      acc[h] -= std::exp(sinks[h] - lse[t * heads + h]) * dsum;
    }
  }
  for (int64_t h = 0; h < heads; ++h) dsinks[h] += acc[h];
}

template <typename R>
void GptOssMoeForward(const MoeDims& d, const MoeOffsets& offs, const R* params, const R* x, int64_t T, R* y,
                      MoeActs<R>* a, CpuWorkerPool* pool) {
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, k = d.top_k, rows = T * k;
  GptOssRoute(d, offs, params, x, T, a, pool);
  a->perm = BuildMoePermutation(a->topk_expert.data(), T, k, E);
  const MoePermutation& perm = a->perm;

  // Per expert: gate_up = xg W + b (deinterleaved into gate and up), then down on the clamped GLU.
  std::vector<R> xg = GatherRows(perm, x, rows, H, pool);
  a->gate.resize(rows * I);
  a->up.resize(rows * I);
  a->expert_out.resize(rows * H);
  std::vector<R> gu, m;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = perm.expert_offsets[e], n = perm.expert_counts[e];
    if (n == 0) continue;
    gu.resize(n * 2 * I);
    MatMulInOut(xg.data() + r0 * H, params + offs.gate_at(e), n, H, 2 * I, gu.data(), pool);
    const R* b = params + offs.gate_up_bias_at(e);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = 0; i < I; ++i) {
        a->gate[(r0 + r) * I + i] = gu[r * 2 * I + 2 * i] + b[2 * i];
        a->up[(r0 + r) * I + i] = gu[r * 2 * I + 2 * i + 1] + b[2 * i + 1];
      }
    }
    m.resize(n * I);
    GptOssGlu(static_cast<R>(d.swiglu_alpha), static_cast<R>(d.swiglu_limit), a->gate.data() + r0 * I,
              a->up.data() + r0 * I, n * I, m.data());
    R* out = a->expert_out.data() + r0 * H;
    MatMulInOut(m.data(), params + offs.down_at(e), n, I, H, out, pool);
    const R* bd = params + offs.down_bias_at(e);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t h = 0; h < H; ++h) out[r * H + h] += bd[h];
  }

  // Combine: y[t] = sum of w * expert_out over the token's rows in ascending expert order.
  moe_loops::CombineAndRecord(perm, T, k, H, E, a, y, pool);
}

template <typename R>
void GptOssMoeBackward(const MoeDims& d, const MoeOffsets& offs, const R* params, const R* x, int64_t T,
                       const MoeActs<R>& a, const R* dy, const double* aux_prob_grad, R* dx, R* dparams,
                       CpuWorkerPool* pool) {
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, k = d.top_k, rows = T * k;
  const MoePermutation& perm = a.perm;
  const R alpha = static_cast<R>(d.swiglu_alpha), limit = static_cast<R>(d.swiglu_limit);

  // dL/dw[t, j] = dy[t] . expert_out, and the experts' output gradient w * dy[t]. The last reads
  // of dy, so dx may alias it.
  std::vector<R> dw(rows), dout(rows * H);
  ParallelRanges(pool, rows, kMinTokensPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = perm.token_index[r], j = perm.slot_index[r];
      const R* dyr = dy + t * H;
      dw[t * k + j] = DotSerial(dyr, a.expert_out.data() + r * H, H);
      const R w = a.topk_weight[t * k + j];
      for (int64_t i = 0; i < H; ++i) dout[r * H + i] = w * dyr[i];
    }
  });

  // Experts: out = m Wd + bd, m = GLU(gate, up), [gate | up] interleaved = xg Wgu + bgu.
  const std::vector<R> xg = GatherRows(perm, x, rows, H, pool);
  std::vector<R> dxg(rows * H), m, dm, dgate, dup, dgu;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = perm.expert_offsets[e], n = perm.expert_counts[e];
    if (n == 0) continue;
    const R* gate = a.gate.data() + r0 * I;
    const R* up = a.up.data() + r0 * I;
    const R* de = dout.data() + r0 * H;
    m.resize(n * I);
    GptOssGlu(alpha, limit, gate, up, n * I, m.data());
    // Wd [I, H]: dWd = m^T dout (the [out, in] op with m as its "dy"), dm = dout Wd^T.
    LinearBackwardWeight(m.data(), de, n, H, I, dparams + offs.down_at(e), pool);
    BiasBackward(de, n, H, dparams + offs.down_bias_at(e));
    dm.resize(n * I);
    LinearForward(de, params + offs.down_at(e), n, H, I, dm.data(), pool);
    dgate.resize(n * I);
    dup.resize(n * I);
    GptOssGluBackward(alpha, limit, gate, up, dm.data(), n * I, dgate.data(), dup.data());
    dgu.resize(n * 2 * I);
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t i = 0; i < I; ++i) {
        dgu[r * 2 * I + 2 * i] = dgate[r * I + i];
        dgu[r * 2 * I + 2 * i + 1] = dup[r * I + i];
      }
    }
    // Wgu [H, 2I]: dWgu = xg^T dgu, dxg = dgu Wgu^T.
    LinearBackwardWeight(xg.data() + r0 * H, dgu.data(), n, 2 * I, H, dparams + offs.gate_at(e), pool);
    BiasBackward(dgu.data(), n, 2 * I, dparams + offs.gate_up_bias_at(e));
    LinearForward(dgu.data(), params + offs.gate_at(e), n, 2 * I, H, dxg.data() + r0 * H, pool);
  }
  dout = {};

  // Router: through the softmax of the k selected logits, dz_j = w_j (dw_j - sum_i w_i dw_i) at the
  // selected experts; the aux loss's dL/dp through the full softmax, dz += p (aux - p . aux).
  std::vector<R> aux(E, R(0));
  const bool with_aux = aux_prob_grad != nullptr;
  if (with_aux) {
    for (int64_t e = 0; e < E; ++e) aux[e] = static_cast<R>(aux_prob_grad[e]);
  }
  std::vector<R> dz(T * E, R(0));
  ParallelRanges(pool, T, kMinTokensPerRange, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int32_t* sel = a.topk_expert.data() + t * k;
      const R* w = a.topk_weight.data() + t * k;
      const R* dwt = dw.data() + t * k;
      R* dzt = dz.data() + t * E;
      const R dw_dot_w = DotSerial(dwt, w, k);
      for (int64_t j = 0; j < k; ++j) dzt[sel[j]] += w[j] * (dwt[j] - dw_dot_w);
      if (with_aux) {
        const R* p = a.router_probs.data() + t * E;
        const R p_dot_aux = DotSerial(p, aux.data(), E);
        for (int64_t e = 0; e < E; ++e) dzt[e] += p[e] * (aux[e] - p_dot_aux);
      }
    }
  });
  LinearBackwardWeight(dz.data(), x, T, H, E, dparams + offs.router, pool);
  BiasBackward(dz.data(), T, E, dparams + offs.router_bias);
  std::vector<R> dx_acc(T * H);
  LinearBackwardInput(dz.data(), params + offs.router, T, H, E, dx_acc.data(), Accumulate::kOverwrite, pool);

  // dx = router term + the token's expert terms in ascending expert order.
  moe_loops::GatherTokenGrads(perm, T, k, H, dxg.data(), dx_acc.data(), dx, pool);
}

#define SLIDEDP_INSTANTIATE_GPT_OSS(R)                                                                               \
  template void ApplyAttentionSinks<R>(int64_t, int64_t, int64_t, const R*, R*, R*);                                 \
  template void AttentionSinksBackward<R>(int64_t, int64_t, int64_t, const R*, const R*, const R*, const R*, R*);    \
  template void GptOssMoeForward<R>(const MoeDims&, const MoeOffsets&, const R*, const R*, int64_t, R*, MoeActs<R>*, \
                                    CpuWorkerPool*);                                                                 \
  template void GptOssMoeBackward<R>(const MoeDims&, const MoeOffsets&, const R*, const R*, int64_t,                 \
                                     const MoeActs<R>&, const R*, const double*, R*, R*, CpuWorkerPool*);

SLIDEDP_INSTANTIATE_GPT_OSS(float)
SLIDEDP_INSTANTIATE_GPT_OSS(double)

}  // namespace slidedp
