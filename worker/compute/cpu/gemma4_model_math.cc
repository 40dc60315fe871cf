// Gemma 4's embedding (both tables) and whole model on the CPU backend (gemma4_math.h), the layers'
// math being gemma4_layer_math.cc's and the head the dense one's (soft-capped logits). Explicitly
// instantiated for float (backend; BF16 or FP32 weights) and double (gradient checks, the fixtures'
// oracle). Limits: scalar C++; meant for tiny models and oracles.
#include <algorithm>
#include <vector>

#include "common/numeric/bf16.h"
#include "worker/compute/cpu/gemma4_math.h"

namespace slidedp {

std::vector<int32_t> Gemma4EmbeddingTokens(const ModelConfig& c, const int32_t* tokens, int64_t num_tokens) {
  std::vector<int32_t> ids(tokens, tokens + num_tokens);
  const std::vector<int64_t>& placeholders = c.gemma4.placeholder_tokens;
  if (!c.multimodal || placeholders.empty()) return ids;
  for (int32_t& id : ids) {
    if (std::find(placeholders.begin(), placeholders.end(), id) != placeholders.end()) {
      id = static_cast<int32_t>(c.pad_token_id);
    }
  }
  return ids;
}

template <typename R, typename W>
void Gemma4EmbeddingForward(const ModelConfig& c, const UnitLayout& embed, const W* unit, const int32_t* ids,
                            int64_t num_tokens, R* x0, Gemma4BatchState<R>* state, CpuWorkerPool* pool) {
  EmbeddingLookup(unit + embed.tensors[0].offset_numel, ids, num_tokens, c.hidden_size, x0, pool,
                  c.EmbeddingScale());
  *state = Gemma4BatchState<R>{};
  const int64_t width = c.num_hidden_layers * c.gemma4.ple_dim;
  if (width == 0) return;
  state->ple_token.resize(num_tokens * width);
  EmbeddingLookup(unit + embed.tensors[1].offset_numel, ids, num_tokens, width, state->ple_token.data(), pool,
                  c.PerLayerEmbeddingScale());
  state->ple_grad.assign(num_tokens * width, R(0));
}

namespace {

// dtable[ids[t]] += d[t] x scale in token order, but for pad_token_id's row: both of Gemma 4's
// tables are nn.Embedding(padding_idx=pad_token_id), whose lookup gives that row no gradient (the
// tied LM head's share of it is the head's, added apart).
template <typename R>
void ScatterAddButPad(const R* d, const int32_t* ids, int64_t num_tokens, int64_t width, int64_t pad, double scale,
                      R* dtable) {
  const R s = static_cast<R>(scale);
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (ids[t] == pad) continue;
    R* row = dtable + static_cast<int64_t>(ids[t]) * width;
    for (int64_t i = 0; i < width; ++i) row[i] += d[t * width + i] * s;
  }
}

}  // namespace

template <typename R>
void Gemma4EmbeddingBackward(const ModelConfig& c, const UnitLayout& embed, const R* dx0, const int32_t* ids,
                             int64_t num_tokens, const Gemma4BatchState<R>& state, R* dunit) {
  ScatterAddButPad(dx0, ids, num_tokens, c.hidden_size, c.pad_token_id, c.EmbeddingScale(),
                   dunit + embed.tensors[0].offset_numel);
  const int64_t width = c.num_hidden_layers * c.gemma4.ple_dim;
  if (width == 0 || state.ple_token_grad.empty()) return;
  ScatterAddButPad(state.ple_token_grad.data(), ids, num_tokens, width, c.pad_token_id, c.PerLayerEmbeddingScale(),
                   dunit + embed.tensors[1].offset_numel);
}

template <typename R>
double Gemma4ModelLossAndGrads(const ModelLayout& layout, const std::vector<std::vector<R>>& unit_params,
                               const std::vector<MicroBatch>& batches, double loss_scale,
                               std::vector<std::vector<R>>* unit_grads, CpuWorkerPool* pool) {
  const ModelConfig& c = layout.config;
  const DecoderDims dims = DecoderDims::From(c);
  const int num_units = layout.num_units();
  const int embed = 0, head = num_units - 1;
  std::vector<DecoderOffsets> offs(num_units);
  std::vector<Gemma4LayerDims> layer_dims(num_units);
  for (int u = 1; u < head; ++u) {
    offs[u] = DecoderOffsets::Of(layout.units[u]);
    layer_dims[u] = Gemma4LayerDims::Of(c, layout.units[u].decoder_layer);
  }
  unit_grads->assign(num_units, {});
  for (int u = 0; u < num_units; ++u) (*unit_grads)[u].assign(layout.units[u].numel, R(0));
  const R* lm_w = layout.head_uses_embedding ? unit_params[embed].data()
                                             : unit_params[head].data() + layout.head().tensors[1].offset_numel;
  R* dlm = layout.head_uses_embedding ? (*unit_grads)[embed].data()
                                      : (*unit_grads)[head].data() + layout.head().tensors[1].offset_numel;
  double loss = 0.0;
  for (const MicroBatch& mb : batches) {
    const int64_t T = mb.num_tokens(), H = c.hidden_size;
    const RopeTables rope = BuildRopeTables(mb.positions, c);
    const TokenGeometry batch_geom = MakeTokenGeometry(mb, rope);
    const std::vector<int32_t> ids = Gemma4EmbeddingTokens(c, mb.tokens.data(), T);
    Gemma4BatchState<R> state;
    // xs[l] is the input of decoder layer l; xs.back() the head's input.
    std::vector<std::vector<R>> xs(num_units - 1, std::vector<R>(T * H));
    Gemma4EmbeddingForward(c, layout.units[embed], unit_params[embed].data(), ids.data(), T, xs[0].data(), &state,
                           pool);
    for (int u = 1; u < head; ++u) {
      const TokenGeometry geom = Gemma4LayerGeometry(batch_geom, rope, layer_dims[u].sliding);
      Gemma4LayerForward(layer_dims[u], offs[u], unit_params[u].data(), geom, xs[u - 1].data(), &state,
                         xs[u].data(), pool);
    }
    std::vector<R> grad(T * H);
    loss += HeadLossAndGrad(dims, unit_params[head].data(), lm_w, mb.labels.data(), T, xs.back().data(), loss_scale,
                            grad.data(), (*unit_grads)[head].data(), dlm, HeadChunking{}, pool);
    for (int u = head - 1; u >= 1; --u) {
      const TokenGeometry geom = Gemma4LayerGeometry(batch_geom, rope, layer_dims[u].sliding);
      Gemma4LayerBackward(layer_dims[u], offs[u], unit_params[u].data(), geom, xs[u - 1].data(), grad.data(),
                          grad.data(), (*unit_grads)[u].data(), &state, pool);
    }
    Gemma4EmbeddingBackward(c, layout.units[embed], grad.data(), ids.data(), T, state, (*unit_grads)[embed].data());
  }
  return loss;
}

#define SLIDEDP_INSTANTIATE_GEMMA4_MODEL(R)                                                                       \
  template void Gemma4EmbeddingBackward<R>(const ModelConfig&, const UnitLayout&, const R*, const int32_t*,      \
                                           int64_t, const Gemma4BatchState<R>&, R*);                             \
  template double Gemma4ModelLossAndGrads<R>(const ModelLayout&, const std::vector<std::vector<R>>&,             \
                                             const std::vector<MicroBatch>&, double, std::vector<std::vector<R>>*, \
                                             CpuWorkerPool*);

SLIDEDP_INSTANTIATE_GEMMA4_MODEL(float)
SLIDEDP_INSTANTIATE_GEMMA4_MODEL(double)

template void Gemma4EmbeddingForward<float, bf16_t>(const ModelConfig&, const UnitLayout&, const bf16_t*,
                                                    const int32_t*, int64_t, float*, Gemma4BatchState<float>*,
                                                    CpuWorkerPool*);
template void Gemma4EmbeddingForward<float, float>(const ModelConfig&, const UnitLayout&, const float*, const int32_t*,
                                                   int64_t, float*, Gemma4BatchState<float>*, CpuWorkerPool*);
template void Gemma4EmbeddingForward<double, double>(const ModelConfig&, const UnitLayout&, const double*,
                                                     const int32_t*, int64_t, double*, Gemma4BatchState<double>*,
                                                     CpuWorkerPool*);

}  // namespace slidedp
