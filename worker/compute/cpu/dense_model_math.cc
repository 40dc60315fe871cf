// Qwen3 reference math, the model's ends and the whole model: the embedding, the final RMSNorm + LM
// head + cross entropy (chunked, online log-sum-exp), and the non-streaming model's loss and
// gradients built of them and the decoder layer (dense_decoder_layer_math.cc). Explicitly
// instantiated for float (backend; BF16 or FP32 weights) and double (gradient checks). Limits:
// scalar C++; meant for tiny models and oracles.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "common/numeric/bf16.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/dense_reference_math_internal.h"
#include "worker/compute/cpu/gemma4_math.h"

namespace slidedp {
namespace {

using dense_math::Axpy;
using dense_math::Dot;

// A stored weight (bf16_t, float or double) in the real type R.
template <typename R>
inline R ToReal(bf16_t v) {
  return static_cast<R>(Bf16ToFloat(v));
}
template <typename R>
inline R ToReal(float v) {
  return static_cast<R>(v);
}
template <typename R>
inline R ToReal(double v) {
  return static_cast<R>(v);
}

}  // namespace

template <typename R, typename W>
void EmbeddingLookup(const W* embed, const int32_t* tokens, int64_t num_tokens, int64_t hidden, R* out,
                     CpuWorkerPool* pool, double scale) {
  // gemma3: HF's row * embed_scale (the scale already in the model's dtype), here in R.
  const R s = static_cast<R>(scale);
  ParallelRanges(pool, num_tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const W* row = embed + static_cast<int64_t>(tokens[t]) * hidden;
      for (int64_t i = 0; i < hidden; ++i) out[t * hidden + i] = ToReal<R>(row[i]);
      if (scale != 1) {
        for (int64_t i = 0; i < hidden; ++i) out[t * hidden + i] *= s;
      }
    }
  });
}

template <typename R>
void EmbeddingScatterAdd(const R* dout, const int32_t* tokens, int64_t num_tokens, int64_t hidden, R* dembed,
                         double scale, int64_t pad_token) {
  const R s = static_cast<R>(scale);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (tokens[t] == pad_token) continue;
    R* row = dembed + static_cast<int64_t>(tokens[t]) * hidden;
    if (scale == 1) {
      for (int64_t i = 0; i < hidden; ++i) row[i] += dout[t * hidden + i];
    } else {
      for (int64_t i = 0; i < hidden; ++i) row[i] += dout[t * hidden + i] * s;
    }
  }
}

template <typename R, typename W>
double HeadLossAndGrad(const DecoderDims& d, const R* norm_w, const W* lm_head_w, const int32_t* labels,
                       int64_t num_tokens, const R* x, double loss_scale, R* dx, R* dnorm, R* dlm_head,
                       const HeadChunking& chunking, CpuWorkerPool* pool) {
  const int64_t H = d.hidden, V = d.vocab;
  const int64_t tc_max = std::max<int64_t>(chunking.token_chunk, 1);
  const int64_t vc_max = std::max<int64_t>(std::min(chunking.vocab_chunk, V), 1);
  const R eps = static_cast<R>(d.rms_norm_eps);
  const R scale = static_cast<R>(loss_scale);
  // gemma3's final_logit_softcapping: logits = tanh(logits / cap) * cap, as Gemma3ForCausalLM
  // computes them before the loss; tanh_chunk keeps the tanh for the gradient (1 - tanh^2).
  const R cap = static_cast<R>(d.final_logit_softcap);
  const bool capped = d.final_logit_softcap > 0;

  const bool grads = dx != nullptr;  // no dx: the loss alone (evaluation), no pass 2
  if (grads) std::fill(dx, dx + num_tokens * H, R(0));
  std::vector<int64_t> trained;
  for (int64_t t = 0; t < num_tokens; ++t)
    if (labels[t] != kIgnoreIndex) trained.push_back(t);
  if (trained.empty()) return 0.0;

  std::vector<R> w_norm(H);
  for (int64_t i = 0; i < H; ++i) w_norm[i] = ToReal<R>(norm_w[i]);
  std::vector<R> w_chunk(vc_max * H);  // LM head rows of one vocabulary chunk, upcast
  std::vector<R> xin(tc_max * H), xf(tc_max * H), rstd(tc_max), dxf(tc_max * H);
  std::vector<R> logits(tc_max * vc_max), run_max(tc_max), run_sum(tc_max), label_logit(tc_max), lse(tc_max);
  std::vector<R> tanh_chunk(capped ? tc_max * vc_max : 0);
  std::vector<R> dnorm_acc(H, R(0));
  double loss = 0.0;

  // Each vocabulary chunk [v0, v0 + vc) in order: its LM head rows upcast into w_chunk, the tc
  // tokens' logits against them, then on_chunk(v0, vc).
  auto for_each_vocab_chunk = [&](int64_t tc, const auto& on_chunk) {
    for (int64_t v0 = 0; v0 < V; v0 += vc_max) {
      const int64_t vc = std::min(vc_max, V - v0);
      for (int64_t i = 0; i < vc * H; ++i) w_chunk[i] = ToReal<R>(lm_head_w[v0 * H + i]);
      ParallelRanges(pool, tc, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c) {
          for (int64_t v = 0; v < vc; ++v) {
            const R logit = Dot(xf.data() + c * H, w_chunk.data() + v * H, H);
            if (!capped) {
              logits[c * vc + v] = logit;
              continue;
            }
            const R t = std::tanh(logit / cap);
            tanh_chunk[c * vc + v] = t;
            logits[c * vc + v] = t * cap;
          }
        }
      });
      on_chunk(v0, vc);
    }
  };

  for (size_t c_begin = 0; c_begin < trained.size(); c_begin += tc_max) {
    const int64_t tc = std::min<int64_t>(tc_max, static_cast<int64_t>(trained.size() - c_begin));
    for (int64_t c = 0; c < tc; ++c) std::copy_n(x + trained[c_begin + c] * H, H, xin.data() + c * H);
    RmsNormRows(xin.data(), w_norm.data(), tc, H, eps, xf.data(), rstd.data(), pool);

    // Pass 1: online log-sum-exp over vocabulary chunks.
    std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<R>::infinity());
    std::fill(run_sum.begin(), run_sum.end(), R(0));
    for_each_vocab_chunk(tc, [&](int64_t v0, int64_t vc) {
      for (int64_t c = 0; c < tc; ++c) {
        const R* l = logits.data() + c * vc;
        R mx = run_max[c];
        for (int64_t v = 0; v < vc; ++v) mx = std::max(mx, l[v]);
        R sum = run_sum[c] * std::exp(run_max[c] - mx);
        for (int64_t v = 0; v < vc; ++v) sum += std::exp(l[v] - mx);
        run_max[c] = mx;
        run_sum[c] = sum;
        const int64_t label = labels[trained[c_begin + c]];
        if (label >= v0 && label < v0 + vc) label_logit[c] = l[label - v0];
      }
    });
    for (int64_t c = 0; c < tc; ++c) {
      lse[c] = run_max[c] + std::log(run_sum[c]);
      loss += static_cast<double>(scale * (lse[c] - label_logit[c]));
    }
    if (!grads) continue;

    // Pass 2: dlogits = scale * (softmax - onehot); dxf = dlogits W; dW += dlogits^T xf.
    std::fill(dxf.begin(), dxf.end(), R(0));
    for_each_vocab_chunk(tc, [&](int64_t v0, int64_t vc) {
      for (int64_t c = 0; c < tc; ++c) {
        R* l = logits.data() + c * vc;
        const int64_t label = labels[trained[c_begin + c]];
        for (int64_t v = 0; v < vc; ++v) {
          const R p = std::exp(l[v] - lse[c]);
          l[v] = scale * (v0 + v == label ? p - R(1) : p);
          if (capped) {  // through the soft cap: d(cap tanh(z / cap)) / dz = 1 - tanh^2
            const R t = tanh_chunk[c * vc + v];
            l[v] *= R(1) - t * t;
          }
        }
      }
      ParallelRanges(pool, tc, 1, [&](int64_t c0, int64_t c1) {
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t v = 0; v < vc; ++v) Axpy(logits[c * vc + v], w_chunk.data() + v * H, dxf.data() + c * H, H);
      });
      ParallelRanges(pool, vc, 16, [&](int64_t r0, int64_t r1) {
        std::vector<R> acc(H);
        for (int64_t v = r0; v < r1; ++v) {
          std::fill(acc.begin(), acc.end(), R(0));
          for (int64_t c = 0; c < tc; ++c) Axpy(logits[c * vc + v], xf.data() + c * H, acc.data(), H);
          R* row = dlm_head + (v0 + v) * H;
          for (int64_t i = 0; i < H; ++i) row[i] += acc[i];
        }
      });
    });

    // Final RMSNorm backward into the trained tokens' dx rows.
    std::vector<R> dxin(tc * H);
    RmsNormBackwardRows(xin.data(), rstd.data(), w_norm.data(), dxf.data(), tc, H, dxin.data(), Accumulate::kOverwrite,
                        dnorm_acc.data(), pool);
    for (int64_t c = 0; c < tc; ++c) std::copy_n(dxin.data() + c * H, H, dx + trained[c_begin + c] * H);
  }
  if (grads) {
    for (int64_t i = 0; i < H; ++i) dnorm[i] += dnorm_acc[i];
  }
  return loss;
}

template <typename R>
double ModelLossAndGrads(const ModelLayout& layout, const std::vector<std::vector<R>>& unit_params,
                         const std::vector<MicroBatch>& batches, double loss_scale,
                         std::vector<std::vector<R>>* unit_grads, CpuWorkerPool* pool, double router_aux_weight) {
  const ModelConfig& c = layout.config;
  if (c.is_gemma4()) return Gemma4ModelLossAndGrads(layout, unit_params, batches, loss_scale, unit_grads, pool);
  const DecoderDims dims = DecoderDims::From(c);
  const int num_units = layout.num_units();
  // qwen3_5's and gemma3's (1 + w) norms: the math reads 1 + w (AddNormWeightOffsets); gradients are w's.
  std::vector<std::vector<R>> shifted;
  const std::vector<std::vector<R>>* params = &unit_params;
  if (c.norms_add_one()) {
    shifted = unit_params;
    for (int u = 0; u < num_units; ++u) AddNormWeightOffsets(c, layout.units[u], shifted[u].data());
    params = &shifted;
  }
  const std::vector<std::vector<R>>& unit_params_math = *params;
  std::vector<DecoderOffsets> offs(num_units);
  for (int u = 1; u + 1 < num_units; ++u) offs[u] = DecoderOffsets::Of(layout.units[u]);
  unit_grads->assign(num_units, {});
  for (int u = 0; u < num_units; ++u) (*unit_grads)[u].assign(layout.units[u].numel, R(0));
  const int embed = 0, head = num_units - 1;
  const R* lm_w = layout.head_uses_embedding ? unit_params_math[embed].data()
                                             : unit_params_math[head].data() + layout.head().tensors[1].offset_numel;
  R* dlm = layout.head_uses_embedding ? (*unit_grads)[embed].data()
                                      : (*unit_grads)[head].data() + layout.head().tensors[1].offset_numel;
  double loss = 0.0;
  for (const MicroBatch& mb : batches) {
    const int64_t T = mb.num_tokens(), H = dims.hidden;
    const RopeTables rope = BuildRopeTables(mb.positions, c);
    const TokenGeometry geom = MakeTokenGeometry(mb, rope);
    // xs[l] is the input of decoder layer l; xs.back() the head's input.
    std::vector<std::vector<R>> xs(num_units - 1, std::vector<R>(T * H));
    EmbeddingLookup(unit_params_math[embed].data(), mb.tokens.data(), T, H, xs[0].data(), pool, dims.embed_scale);
    std::vector<DecoderActs<R>> acts(num_units - 2);
    std::vector<MoeRouterStats> router;
    for (int u = 1; u < head; ++u) {
      DecoderForwardAll(dims, offs[u], unit_params_math[u].data(), geom, xs[u - 1].data(), xs[u].data(), &acts[u - 1], pool);
      if (offs[u].sparse()) router.push_back(acts[u - 1].moe.stats);
    }
    // The micro-batch's load-balancing loss over its sparse layers, and its gradient per probability.
    std::vector<double> aux_grad;
    if (!router.empty() && router_aux_weight != 0) {
      loss += router_aux_weight * LoadBalancingLoss(router);
      aux_grad = LoadBalancingProbGrad(router, router_aux_weight);
    }
    std::vector<R> grad(T * H);
    loss += HeadLossAndGrad(dims, unit_params_math[head].data(), lm_w, mb.labels.data(), T, xs.back().data(), loss_scale,
                            grad.data(), (*unit_grads)[head].data(), dlm, HeadChunking{}, pool);
    for (int u = head - 1; u >= 1; --u) {
      DecoderBackward(dims, offs[u], unit_params_math[u].data(), geom, xs[u - 1].data(), acts[u - 1], grad.data(),
                      grad.data(), (*unit_grads)[u].data(), pool, aux_grad.empty() ? nullptr : aux_grad.data());
    }
    EmbeddingScatterAdd(grad.data(), mb.tokens.data(), T, H, (*unit_grads)[embed].data(), dims.embed_scale,
                        dims.pad_token);
  }
  return loss;
}

#define SLIDEDP_INSTANTIATE_MODEL(R)                                                                         \
  template void EmbeddingScatterAdd<R>(const R*, const int32_t*, int64_t, int64_t, R*, double, int64_t);              \
  template double ModelLossAndGrads<R>(const ModelLayout&, const std::vector<std::vector<R>>&,               \
                                       const std::vector<MicroBatch>&, double, std::vector<std::vector<R>>*, \
                                       CpuWorkerPool*, double);

SLIDEDP_INSTANTIATE_MODEL(float)
SLIDEDP_INSTANTIATE_MODEL(double)

#define SLIDEDP_INSTANTIATE_REAL_WEIGHT(R, W)                                                                      \
  template void EmbeddingLookup<R, W>(const W*, const int32_t*, int64_t, int64_t, R*, CpuWorkerPool*, double);     \
  template double HeadLossAndGrad<R, W>(const DecoderDims&, const R*, const W*, const int32_t*, int64_t, const R*, \
                                        double, R*, R*, R*, const HeadChunking&, CpuWorkerPool*);

SLIDEDP_INSTANTIATE_REAL_WEIGHT(float, bf16_t)
SLIDEDP_INSTANTIATE_REAL_WEIGHT(float, float)
SLIDEDP_INSTANTIATE_REAL_WEIGHT(double, double)

}  // namespace slidedp
