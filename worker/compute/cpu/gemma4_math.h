// Gemma 4's reference math on the CPU backend (ModelConfig::gemma4; docs/model-families.md,
// "Gemma 4"), templated on the real type as the dense math is (float: the backend; double: the
// gradient checks and the oracle against transformers' fixtures). Semantics follow transformers
// 5.17's modeling_gemma4.py (Gemma4TextDecoderLayer, Gemma4TextModel, Gemma4ForCausalLM):
//   n  = rms(x) w_in                                  every RMSNorm is x rsqrt(mean x^2 + eps) w
//   q  = rope(rms_head(q_proj n) w_qn)                per head, before RoPE
//   k  = rope(rms_head(k_proj n) w_kn), v = rms_head(v_proj n)   (v's norm has no weight; under
//        attention_k_eq_v a full layer's v is rms_head(k_proj n); a kv-shared layer takes k and v
//        from its source layer, ModelConfig::KvSourceLayer)
//   h1 = x + rms(o_proj(softmax(q k^T) v)) w_po       scores unscaled, the layer's window and RoPE
//   h2 = h1 + rms(down(gelu_tanh(gate(m)) up(m))) w_pf,  m = rms(h1) w_pr
//   h3 = h2 + rms(ple_proj(gelu_tanh(ple_gate(h2)) * p_l)) w_pp   (per-layer inputs p_l)
//   y  = h3 * layer_scalar
// The per-layer inputs p [T, layers, ple_dim] = (rms_P(per_layer_model_projection(x0) / sqrt(hidden))
// w_pn + embed_tokens_per_layer[ids] sqrt(ple_dim)) / sqrt(2), x0 the scaled embedding output
// (layer 0's input, which computes them); layer l reads p[:, l, :]. What crosses units beyond the
// hidden state (p, the shared keys and values, and their gradients) waits in Gemma4BatchState, one
// per micro-batch, kept by the backend's DeviceBatch.
//
// A layer keeps nothing for its backward (the backend recomputes it from its input) and runs
// untiled. Reductions run in a fixed order, so results do not depend on the thread count.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "common/data/batch.h"
#include "common/model/model_config.h"
#include "worker/compute/cpu/cpu_worker_pool.h"
#include "worker/compute/cpu/dense_reference_math.h"

namespace slidedp {

// One micro-batch's state shared by Gemma 4's units.
template <typename R>
struct Gemma4BatchState {
  struct SharedKv {
    std::vector<R> k, v;    // [T, kv_dim] the source layer's keys (normed, rotated) and values (normed)
    std::vector<R> dk, dv;  // their gradient from the layers sharing them (empty until one adds)
  };
  std::vector<R> ple_token;       // [T, layers x ple_dim] embed_tokens_per_layer rows x their scale
  std::vector<R> ple;             // [T, layers x ple_dim] the per-layer inputs (layer 0's forward)
  std::vector<R> ple_grad;        // dL/d ple, added to by every layer's backward
  std::vector<R> ple_token_grad;  // dL/d ple_token (layer 0's backward), for the embedding's
  std::map<int64_t, SharedKv> kv;  // by source layer
};

// One decoder layer's sizes and its part in the batch state.
struct Gemma4LayerDims {
  DecoderDims attn;          // this layer's heads, kv heads, head_dim, intermediate; scores unscaled
  int64_t layer = 0;
  int64_t layers = 0;
  int64_t ple_dim = 0;       // 0: no per-layer inputs
  bool k_eq_v = false;       // values from k_proj (no v_proj)
  bool sliding = false;      // the sliding layers' RoPE table
  int64_t kv_source = -1;    // the layer whose keys and values it attends with (-1: its own)
  bool kv_stored = false;    // later layers attend with its keys and values
  static Gemma4LayerDims Of(const ModelConfig& c, int64_t layer);
};

// The layer's token geometry: the batch's, with the RoPE table of the layer's type (`rope` holds
// both, BuildRopeTables).
TokenGeometry Gemma4LayerGeometry(const TokenGeometry& batch, const RopeTables& rope, bool sliding);

// The embedding's token ids: the batch's, with a multimodal model's image / video / audio
// placeholders as pad_token_id (Gemma4Model embeds them so in both tables).
std::vector<int32_t> Gemma4EmbeddingTokens(const ModelConfig& c, const int32_t* tokens, int64_t num_tokens);

// x0 [T, hidden] = embed_tokens[ids] x EmbeddingScale; with per-layer inputs state->ple_token =
// embed_tokens_per_layer[ids] x PerLayerEmbeddingScale. Resets the rest of *state for the batch.
// `unit` is the embedding unit's array (ModelLayout's layout of `embed`), in W.
template <typename R, typename W>
void Gemma4EmbeddingForward(const ModelConfig& c, const UnitLayout& embed, const W* unit, const int32_t* ids,
                            int64_t num_tokens, R* x0, Gemma4BatchState<R>* state, CpuWorkerPool* pool);
// dunit += the embedding unit's gradient from dx0 and state.ple_token_grad (ids as above), but for
// pad_token_id's rows: nn.Embedding(padding_idx) gives them none (a multimodal placeholder's included).
template <typename R>
void Gemma4EmbeddingBackward(const ModelConfig& c, const UnitLayout& embed, const R* dx0, const int32_t* ids,
                             int64_t num_tokens, const Gemma4BatchState<R>& state, R* dunit);

// y = the layer of x (params: the decoder unit, DecoderOffsets' layout); layer 0 first fills
// state->ple, a layer whose keys and values others share stores them in state->kv. y may not alias x.
template <typename R>
void Gemma4LayerForward(const Gemma4LayerDims& d, const DecoderOffsets& offs, const R* params,
                        const TokenGeometry& geom, const R* x, Gemma4BatchState<R>* state, R* y, CpuWorkerPool* pool);
// dx = dL/dx (overwritten; may alias dy), dparams += dL/dparams (none for layer_scalar, which HF does
// not train); adds the layer's per-layer input gradient to state->ple_grad and a kv-shared layer's
// key and value gradients to its source's; layer 0 then turns the whole ple_grad into its
// projection's gradients, dx's share and state->ple_token_grad. Recomputes the forward from x.
template <typename R>
void Gemma4LayerBackward(const Gemma4LayerDims& d, const DecoderOffsets& offs, const R* params,
                         const TokenGeometry& geom, const R* x, const R* dy, R* dx, R* dparams,
                         Gemma4BatchState<R>* state, CpuWorkerPool* pool);

// The whole model in type R (ModelLossAndGrads for gemma4: its signature and contract, the MoE
// weight apart).
template <typename R>
double Gemma4ModelLossAndGrads(const ModelLayout& layout, const std::vector<std::vector<R>>& unit_params,
                               const std::vector<MicroBatch>& batches, double loss_scale,
                               std::vector<std::vector<R>>* unit_grads, CpuWorkerPool* pool);

}  // namespace slidedp
