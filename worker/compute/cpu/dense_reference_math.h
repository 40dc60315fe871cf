// The dense decoder math of the CPU reference backend (Qwen3, and the families of
// common/model/model_config.h), in plain C++ templated on the real type.
//
// float is what the backend runs (FP32 activations, BF16 parameters upcast); double is what the
// gradient checks run, on exactly the same code. Semantics follow HF transformers'
// Qwen3DecoderLayer / Qwen3ForCausalLM:
//   h = x + o_proj(attn(rope(q_norm(q_proj(n1))), rope(k_norm(k_proj(n1))), v_proj(n1))), n1 = rms(x)
//   y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2)),                               n2 = rms2(h)
// RMSNorm is x * rsqrt(mean(x^2) + eps) * w; q_norm/k_norm act per head over head_dim before
// RoPE (qwen3 only); qwen2 adds biases to the q/k/v projections (HF Qwen2Attention); RoPE pairs i with i + head_dim/2
// (rotate_half); GQA shares one kv head among heads/kv_heads query heads; attention is causal inside each document of
// the packed batch (cu_seqlens) with scale 1/sqrt(head_dim), and in a sliding layer limited to the last window keys
// (AttentionForward). Weights are HF's [out, in] row-major: y = x W^T.
// gemma3 (HF Gemma3DecoderLayer / Gemma3ForCausalLM) differs in: the embedding times EmbeddingScale; every norm's
// weight acts as 1 + w; h = x + rms_po(o_proj(attn)), y = h + rms_pf(down_proj(gelu_tanh(gate) * up)) with the MLP's
// input rms_pr(h) (the sandwich norms: post_attention, pre_feedforward, post_feedforward); scores scaled by
// query_pre_attn_scalar^-0.5; sliding layers rotating with their own RoPE (TokenGeometry's sliding tables); logits
// cap * tanh(logits / cap) where final_logit_softcapping is set.
// gpt_oss (HF GptOssDecoderLayer) differs in: biases on q/k/v and o_proj; a learned sink logit per head in each
// attention softmax; a MoE block of its own in every layer (gpt_oss_math.h, through MoeBlockForward).
//
// Every reduction is computed by one thread in a fixed order, so results are deterministic and
// independent of the thread count. Backward ops ADD into parameter gradients; per-call partial
// sums are formed first and added once, so accumulating two micro-batches equals the sum of the
// two separate gradients bitwise (decoder layers).
//
// Defined by concern: dense_reference_math.cc (the ops and their geometry), dense_attention_math.cc,
// dense_decoder_layer_math.cc and dense_model_math.cc (embedding, head, whole model).
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"

#include "common/model/model_config.h"
#include "worker/compute/backend.h"
#include "worker/compute/cpu/cpu_worker_pool.h"
#include "worker/compute/cpu/moe_reference_math.h"

namespace slidedp {

// The Gated DeltaNet mixer's activations (gated_delta_math.h).
template <typename R>
struct LinearAttentionActs {
  std::vector<R> mixed;      // [T, conv_dim] in_proj_qkv output (the conv's input)
  std::vector<R> z;          // [T, value_dim] in_proj_z output (the gate)
  std::vector<R> b;          // [T, nv] in_proj_b output
  std::vector<R> a;          // [T, nv] in_proj_a output
  std::vector<R> core;       // [T, value_dim] delta-rule output (the gated norm's input)
  std::vector<R> core_rstd;  // [T, nv] the gated norm's rsqrt

  int64_t num_elements() const;
};

// Sizes a decoder layer and the head need.
struct DecoderDims {
  int64_t hidden = 0;
  int64_t heads = 0;
  int64_t kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate = 0;
  int64_t vocab = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  bool qk_norm = true;                // per-head q/k RMSNorm before RoPE (qwen3)
  bool qkv_bias = false;              // biases on the q/k/v projections (qwen2)
  // The attention scores' factor (ModelConfig::AttentionScale); 0 means 1/sqrt(head_dim).
  double attn_scale = 0;
  // gemma3: the gated MLP's activation, the sandwich norms, the logits' soft cap (0: none) and the
  // embedding's scale (ModelConfig::EmbeddingScale; 1 elsewhere).
  MlpActivation mlp_act = MlpActivation::kSilu;
  bool sandwich_norms = false;
  double final_logit_softcap = 0;
  double embed_scale = 1;
  // The embedding row that gets no gradient (ModelConfig::pad_token_id; -1: none).
  int64_t pad_token = -1;
  std::vector<float> rope_inv_freq;   // [head_dim / 2], ModelConfig::RopeInverseFrequencies
  float rope_attention_scaling = 1;   // ModelConfig::RopeAttentionScaling, multiplied into cos and sin
  MoeDims moe;                        // a qwen3_moe model's sparse block (num_experts 0 otherwise)
  // qwen3_5: the attention output gate (q_proj emits [query | gate] per head), the head dims RoPE
  // rotates (rope_inv_freq has rotary_dim / 2 entries), the Gated DeltaNet's sizes (its layers:
  // DecoderOffsets::linear()), and the shared expert's width (0: none).
  bool output_gate = false;
  int64_t rotary_dim = 0;
  int64_t shared_intermediate = 0;
  int64_t linear_k_heads = 0, linear_v_heads = 0, linear_k_dim = 0, linear_v_dim = 0, linear_conv = 0;

  int64_t q_dim() const { return heads * head_dim; }
  int64_t kv_dim() const { return kv_heads * head_dim; }
  double AttentionScale() const { return attn_scale > 0 ? attn_scale : 1.0 / std::sqrt(static_cast<double>(head_dim)); }
  static DecoderDims From(const ModelConfig& config);
};

// Element offsets of the decoder tensors inside one flat unit array (ModelLayout's layout); -1 for
// a tensor the family does not have. A sparse unit (qwen3_moe) has the router and experts at `moe`
// in place of the MLP; its attention tensors sit where a dense unit's do. With them, what else of
// the unit's layout the layer's math reads: its attention window.
struct DecoderOffsets {
  int64_t at[kNumDecoderTensors] = {};
  int64_t unit_numel = 0;
  MoeOffsets moe;  // all zeros in a dense unit
  int64_t attention_window = 0;  // UnitLayout::attention_window: 0 full causal, else the sliding window
  bool sliding_rope = false;     // UnitLayout::sliding_rope: q and k rotate with the sliding layers' RoPE
  bool sparse() const { return moe.block_numel > 0; }
  // A qwen3_5 Gated DeltaNet layer: its linear_attn tensors in place of the attention's.
  bool linear() const { return at[kLinearInProjQkv] >= 0; }
  bool shared_expert() const { return at[kSharedGateProj] >= 0; }
  // A model's first decoder layer (every layer of a dense model).
  static DecoderOffsets From(const ModelConfig& config);
  // One decoder unit of a ModelLayout (dense or sparse).
  static DecoderOffsets Of(const UnitLayout& unit);
};

// RoPE cos/sin per token, [T, head_dim/2], computed in FP32 as HF does (angle = position *
// inv_freq; inv_freq = 1 / theta^(2i/d) unless the model's RoPE scaling changes it; cos and sin
// then multiplied by the scaling's attention factor, HF's attention_scaling: 1 but for yarn).
struct RopeTables {
  int64_t half = 0;
  std::vector<float> cos;
  std::vector<float> sin;
  // gemma3: the sliding layers' own tables (ModelConfig::has_sliding_rope; empty otherwise).
  std::vector<float> sliding_cos;
  std::vector<float> sliding_sin;
  int64_t sliding_half = 0;  // their width: half's but in gemma4, whose layer types differ in head_dim
};
RopeTables BuildRopeTables(const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                           float attention_scaling);
// The model's tables: its inverse frequencies and attention scaling (and its sliding layers').
RopeTables BuildRopeTables(const std::vector<int32_t>& positions, const ModelConfig& config);
// Plain RoPE's tables (no scaling).
RopeTables BuildRopeTables(const std::vector<int32_t>& positions, int64_t head_dim, double rope_theta);

// A micro-batch share's view of the whole, for attention (MicroBatchContext's arrays).
struct ContextGeometry {
  ContextGroup* group = nullptr;
  int ranks = 1;
  int rank = 0;
  int64_t full_tokens = 0;
  int64_t full_docs = 0;
  const int32_t* full_cu_seqlens = nullptr;    // [full_docs + 1]
  const int64_t* global_index = nullptr;       // [num_tokens]
  int64_t part = 0;
  const int64_t* gathered_position = nullptr;  // [full_tokens]
};

// Token geometry of one packed micro-batch, shared by every op. Points into storage owned by
// the caller (a CpuDeviceBatch or a test's MicroBatch + RopeTables).
struct TokenGeometry {
  int64_t num_tokens = 0;
  int64_t num_docs = 0;
  const int32_t* cu_seqlens = nullptr;  // [num_docs + 1]
  const float* rope_cos = nullptr;      // [num_tokens, rope_half]
  const float* rope_sin = nullptr;
  int64_t rope_half = 0;                // the tables' width: rotary_dim / 2 (0: head_dim / 2)
  // gemma3's sliding layers' tables (same width), null without them: a layer whose
  // DecoderOffsets::sliding_rope is set rotates with these (LayerGeometry).
  const float* sliding_rope_cos = nullptr;
  const float* sliding_rope_sin = nullptr;
  // Set: the tokens are one rank's share and AttentionForward / AttentionBackward (FP32) attend over
  // the whole micro-batch through the group (AttentionForwardRows / AttentionBackwardRows).
  const ContextGeometry* context = nullptr;
};
TokenGeometry MakeTokenGeometry(const MicroBatch& batch, const RopeTables& rope);
// The geometry a decoder layer computes with: its RoPE tables in rope_cos / rope_sin (the sliding
// ones for a layer with offs.sliding_rope, which are then no longer offered: applying it twice is
// applying it once).
TokenGeometry LayerGeometry(const TokenGeometry& geom, const DecoderOffsets& offs);

// qwen3_5's and gemma3's RMSNorms compute x * (1 + w): adds the 1 to those weights of a unit's
// parameters (the decoder's input/post-attention, q/k and gemma3's feedforward norms; the head's final
// norm; not the Gated DeltaNet's gated norm), so the plain-weight norms below compute them exactly as
// HF's FP32 1 + w does. The gradient with respect to 1 + w is the gradient with respect to w.
// Nothing for other families.
template <typename R>
void AddNormWeightOffsets(const ModelConfig& config, const UnitLayout& unit, R* params);

// ---- Op-level references (also the oracles for the CUDA kernels' tests) ----

enum class Accumulate { kOverwrite, kAdd };
enum class RopeDirection { kForward, kBackward };

// y[T, O] = x[T, K] W[O, K]^T.
template <typename R>
void LinearForward(const R* x, const R* w, int64_t T, int64_t K, int64_t O, R* y, CpuWorkerPool* pool);
// dx[T, K] = (or +=) dy[T, O] W[O, K].
template <typename R>
void LinearBackwardInput(const R* dy, const R* w, int64_t T, int64_t K, int64_t O, R* dx, Accumulate mode,
                         CpuWorkerPool* pool);
// dW[O, K] += dy[T, O]^T x[T, K] (the call's sum is formed first, then added once).
template <typename R>
void LinearBackwardWeight(const R* dy, const R* x, int64_t T, int64_t K, int64_t O, R* dw, CpuWorkerPool* pool);
// RMSNorm over `rows` rows of n: y = (x * rstd) * w, rstd = 1/sqrt(mean(x^2) + eps) (saved).
template <typename R>
void RmsNormRows(const R* x, const R* w, int64_t rows, int64_t n, R eps, R* y, R* rstd, CpuWorkerPool* pool);
// RMSNorm backward: dx = (or +=) dL/dx, dw += dL/dw. dx may alias dy.
template <typename R>
void RmsNormBackwardRows(const R* x, const R* rstd, const R* w, const R* dy, int64_t rows, int64_t n, R* dx,
                         Accumulate mode, R* dw, CpuWorkerPool* pool);
// RoPE in place on [T, heads, head_dim] (rotate_half pairing i, i + head_dim/2); kBackward applies
// the transposed rotation (the inverse one but for the tables' attention scaling), which is the
// gradient of kForward.
template <typename R>
void ApplyRope(R* x, int64_t T, int64_t heads, int64_t head_dim, const TokenGeometry& geom, RopeDirection dir,
               CpuWorkerPool* pool);
// Causal varlen GQA attention: q_rot [T, q_dim], k_rot and v [T, kv_dim] -> attn [T, q_dim] and
// lse [T, heads] (natural log of the softmax denominator of the scaled scores). Query i sees key j
// iff j is in i's document, j <= i, and, for window > 0 (a sliding layer), i - j < window: the
// window keys up to and including itself. That is transformers' sliding-window mask exactly
// (masking_utils.py: causal_mask_function kv <= q, sliding_window_overlay kv > q - sliding_window,
// and'ed with the packed documents' mask); window 0 is full causal attention.
template <typename R>
void AttentionForward(const DecoderDims& dims, const TokenGeometry& geom, int64_t window, const R* q_rot,
                      const R* k_rot, const R* v, R* attn, R* lse, CpuWorkerPool* pool);
// Its backward from the saved output and lse: dq overwritten, dk and dv overwritten.
template <typename R>
void AttentionBackward(const DecoderDims& dims, const TokenGeometry& geom, int64_t window, const R* q_rot,
                       const R* k_rot, const R* v, const R* attn, const R* lse, const R* dattn, R* dq, R* dk, R* dv,
                       CpuWorkerPool* pool);

// Context parallelism (common/data/context_parallel.h): the attention of one rank's queries against
// the keys and values of the whole micro-batch, which the rank's group gathered. full: the whole
// micro-batch's geometry (its documents; its RoPE tables are not read); rows[i]: local query i's
// index in the micro-batch (ascending). q_rot [n, q_dim]; k_rot and v [T, kv_dim] of the whole
// micro-batch in its order -> attn [n, q_dim], lse [n, heads]: each row bit for bit what
// AttentionForward gives that token with the same window.
template <typename R>
void AttentionForwardRows(const DecoderDims& dims, const TokenGeometry& full, int64_t window, const int64_t* rows,
                          int64_t n, const R* q_rot, const R* k_rot, const R* v, R* attn, R* lse, CpuWorkerPool* pool);
// Its backward: dq [n, q_dim] overwritten, bit for bit AttentionBackward's rows; dk and dv [T,
// kv_dim] overwritten with these queries' contributions alone (the group sums them over its ranks:
// AttentionBackward's up to FP32 summation order).
template <typename R>
void AttentionBackwardRows(const DecoderDims& dims, const TokenGeometry& full, int64_t window, const int64_t* rows,
                           int64_t n, const R* q_rot, const R* k_rot, const R* v, const R* attn, const R* lse,
                           const R* dattn, R* dq, R* dk, R* dv, CpuWorkerPool* pool);

// ---- Decoder layer ----

// What a decoder layer's backward reads. Fields left empty are recomputed (or not needed).
template <typename R>
struct DecoderActs {
  std::vector<R> rstd1;   // [T] input RMSNorm's rsqrt
  std::vector<R> xn;      // [T, hidden] normalized input (QKV GEMM input)
  std::vector<R> q_raw;   // [T, q_dim] q_proj output, bias added (q_norm input)
  std::vector<R> k_raw;   // [T, kv_dim]
  std::vector<R> q_rstd;  // [T, heads] (empty without q/k norms)
  std::vector<R> k_rstd;  // [T, kv_heads]
  std::vector<R> q_rot;   // [T, q_dim] after q_norm (if any) and RoPE
  std::vector<R> k_rot;   // [T, kv_dim]
  std::vector<R> v;       // [T, kv_dim]
  std::vector<R> attn;    // [T, q_dim] attention output (o_proj input)
  std::vector<R> lse;     // [T, heads] log-sum-exp of the scaled scores
  std::vector<R> h1;      // [T, hidden] residual stream after attention
  std::vector<R> rstd2;   // [T]
  std::vector<R> hn;      // [T, hidden] the MLP's input norm's output (gemma3: pre_feedforward_layernorm's)
  std::vector<R> gate;    // [T, intermediate]
  std::vector<R> up;      // [T, intermediate]
  // gemma3's sandwich norms: o_proj's output [T, hidden] and its post-attention norm's rsqrt [T]
  // (h1 = x + that norm's output). Not counted by num_elements: the CPU backend recomputes a gemma3
  // layer from its input.
  std::vector<R> attn_out;
  std::vector<R> attn_out_rstd;
  // qwen3_5: the attention output gate's logits [T, q_dim] (q_proj's gate half); a Gated DeltaNet
  // layer's mixer (its output, after out_proj, in attn [T, hidden]); the shared expert's gate and up
  // [T, shared_I] and its sigmoid gate's logit [T]. Not counted by num_elements: the CPU backend
  // recomputes a qwen3_5 layer from its input.
  std::vector<R> qgate;
  bool linear_mixer = false;
  LinearAttentionActs<R> linear;
  std::vector<R> shared_gate, shared_up, shared_logit;
  // gpt_oss: its layer's attention sinks [heads] (self_attn.sinks, copied by DecoderAttentionInputs),
  // which DecoderAttention folds into attn and lse (gpt_oss_math.h: ApplyAttentionSinks).
  std::vector<R> sinks;
  // A sparse layer's MoE block (in place of gate/up): its activations and output [T, hidden]
  // (before the residual). Not counted by num_elements: the CPU backend recomputes them.
  MoeActs<R> moe;
  std::vector<R> moe_y;

  int64_t num_elements() const;
};

// Forward phases. params is the flat unit array (DecoderOffsets layout), x is [T, hidden].
// Phase 1: rstd1, xn, q_raw, k_raw, q_rstd, k_rstd, q_rot, k_rot, v.
template <typename R>
void DecoderAttentionInputs(const DecoderDims& dims, const DecoderOffsets& offs, const R* params,
                            const TokenGeometry& geom, const R* x, DecoderActs<R>* acts, CpuWorkerPool* pool);
// Phase 2: attn, lse (needs q_rot, k_rot, v), within the layer's window (offs.attention_window).
template <typename R>
void DecoderAttention(const DecoderDims& dims, const DecoderOffsets& offs, const TokenGeometry& geom,
                      DecoderActs<R>* acts, CpuWorkerPool* pool);
// Phase 3: h1, rstd2, hn, gate, up (needs attn; gemma3 also attn_out, attn_out_rstd); in a sparse
// unit hn's MoE block (moe, moe_y) in place of gate, up.
template <typename R>
void DecoderMlpInputs(const DecoderDims& dims, const DecoderOffsets& offs, const R* params,
                      const TokenGeometry& geom, const R* x, DecoderActs<R>* acts, CpuWorkerPool* pool);
// Phase 4: y = h1 + down_proj(act(gate) * up) (gemma3: h1 + rms_pf(that)), or h1 + moe_y in a sparse
// unit. y may alias x.
template <typename R>
void DecoderOutput(const DecoderDims& dims, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                   const DecoderActs<R>& acts, R* y, CpuWorkerPool* pool);
// All four phases.
template <typename R>
void DecoderForwardAll(const DecoderDims& dims, const DecoderOffsets& offs, const R* params,
                       const TokenGeometry& geom, const R* x, R* y, DecoderActs<R>* acts, CpuWorkerPool* pool);

// dx = dL/dx (overwritten; may alias dy), dparams += dL/dparams. acts must be complete. In a
// sparse unit aux_prob_grad ([num_experts], LoadBalancingProbGrad; null: none) is the auxiliary
// loss's gradient with respect to each router probability.
template <typename R>
void DecoderBackward(const DecoderDims& dims, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                     const R* x, const DecoderActs<R>& acts, const R* dy, R* dx, R* dparams, CpuWorkerPool* pool,
                     const double* aux_prob_grad = nullptr);

// The same layer with its token-local work (norms, projections, RoPE, MLP) in tiles of `tile`
// rows, as the backends run a micro-batch longer than their tile (ComputeBackend::TileRows):
// attention's inputs tile by tile, attention whole, the MLP tile by tile; backward recomputes the
// forward as it goes (no activations kept). Every op but the weight gradients works row by row,
// so y and dx equal the untiled layer's bit for bit; each weight gradient is summed per tile, then
// added (the tiles' partial sums: equal within FP32 rounding). tile <= 0 or >= T: untiled.
template <typename R>
void DecoderForwardTiled(const DecoderDims& dims, const DecoderOffsets& offs, const R* params,
                         const TokenGeometry& geom, const R* x, R* y, int64_t tile, CpuWorkerPool* pool);
template <typename R>
void DecoderBackwardTiled(const DecoderDims& dims, const DecoderOffsets& offs, const R* params,
                          const TokenGeometry& geom, const R* x, const R* dy, R* dx, R* dparams, int64_t tile,
                          CpuWorkerPool* pool);

// Embedding: out[t] = embed[tokens[t]] x scale; dembed[tokens[t]] += dout[t] x scale (in token order).
// scale is DecoderDims::embed_scale (gemma3's; 1 leaves the rows as they are, bit for bit). The
// gradient skips pad_token's positions (DecoderDims::pad_token: HF's nn.Embedding(padding_idx)
// gives that row none; -1: every token counts).
template <typename R, typename W>
void EmbeddingLookup(const W* embed, const int32_t* tokens, int64_t num_tokens, int64_t hidden, R* out,
                     CpuWorkerPool* pool, double scale = 1);
template <typename R>
void EmbeddingScatterAdd(const R* dout, const int32_t* tokens, int64_t num_tokens, int64_t hidden, R* dembed,
                         double scale = 1, int64_t pad_token = -1);

// Chunk sizes of the head: tokens per chunk and vocabulary rows per chunk; the largest
// temporary is token_chunk x vocab_chunk logits.
struct HeadChunking {
  int64_t token_chunk = 32;
  int64_t vocab_chunk = 2048;
};

// Final RMSNorm + LM head (+ gemma3's soft cap, DecoderDims::final_logit_softcap) + cross entropy,
// forward and backward, chunked over trained tokens and
// vocabulary with an online log-sum-exp. Returns sum_t loss_scale * CE_t over tokens whose label
// is not kIgnoreIndex; writes dx (zero rows for ignored tokens); adds into dnorm [hidden] and
// dlm_head [vocab, hidden]. W is the LM head's storage type (bf16_t, float or double); the norm
// weights come in R. With dx null it returns the loss alone (evaluation): no gradient is formed
// and dnorm / dlm_head are not touched (the loss is the same bits either way).
template <typename R, typename W>
double HeadLossAndGrad(const DecoderDims& dims, const R* norm_w, const W* lm_head_w, const int32_t* labels,
                       int64_t num_tokens, const R* x, double loss_scale, R* dx, R* dnorm, R* dlm_head,
                       const HeadChunking& chunking, CpuWorkerPool* pool);

// The whole non-streaming model in type R (for gradient checks and FP64 oracles): embedding, all
// decoder layers, head; unit_params in ModelLayout order. unit_grads are resized and overwritten.
// With tied embeddings the LM head reads (and adds its gradient into) the embedding unit.
// Returns sum over micro-batches and trained tokens of loss_scale * CE, plus, in a MoE model,
// router_aux_weight * the load-balancing loss of each micro-batch (LoadBalancingLoss over its
// sparse layers), whose gradient the backward includes. Batches must be valid. gemma4's model is
// gemma4_math.h's (Gemma4ModelLossAndGrads), which this calls.
template <typename R>
double ModelLossAndGrads(const ModelLayout& layout, const std::vector<std::vector<R>>& unit_params,
                         const std::vector<MicroBatch>& batches, double loss_scale,
                         std::vector<std::vector<R>>* unit_grads, CpuWorkerPool* pool,
                         double router_aux_weight = 0);

}  // namespace slidedp
