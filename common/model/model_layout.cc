// ModelLayout: a model's streamed units (embedding, decoder layers, final norm + LM head), their
// tensors at aligned offsets and FP32 side copies (see model_config.h).
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "absl/strings/numbers.h"
#include "common/model/model_config.h"
#include "common/model/model_config_internal.h"

namespace slidedp {
namespace {

int64_t AlignUp(int64_t n) { return (n + kTensorAlignNumel - 1) / kTensorAlignNumel * kTensorAlignNumel; }

// Norm weights (and only they: biases are BF16 in HF's autocast linear) get an FP32 side copy.
enum class SideCopy { kNone, kFp32 };

void AddTensor(UnitLayout& unit, std::string name, std::vector<int64_t> shape, SideCopy side = SideCopy::kNone) {
  int64_t numel = 1;
  for (int64_t d : shape) numel *= d;
  const bool norm = side == SideCopy::kFp32;
  TensorSlot t;
  t.hf_name = std::move(name);
  t.shape = std::move(shape);
  t.offset_numel = unit.numel;
  t.numel = numel;
  t.fp32_offset = norm ? unit.fp32_numel : -1;
  unit.tensors.push_back(std::move(t));
  unit.numel += AlignUp(numel);
  if (norm) unit.fp32_numel += (numel + kFp32SideAlignNumel - 1) / kFp32SideAlignNumel * kFp32SideAlignNumel;
}

}  // namespace

std::string TensorIndexString(const std::vector<int64_t>& shape, int64_t flat) {
  std::vector<int64_t> index(shape.size());
  for (size_t d = shape.size(); d-- > 0;) {
    if (shape[d] <= 0) return absl::StrCat("[", flat, "]");
    index[d] = flat % shape[d];
    flat /= shape[d];
  }
  std::string s = "[";
  for (size_t d = 0; d < index.size(); ++d) absl::StrAppend(&s, d > 0 ? ", " : "", index[d]);
  return s + "]";
}

std::string DescribeUnitElement(const UnitLayout& unit, int64_t offset) {
  const TensorSlot* before = nullptr;
  for (const TensorSlot& t : unit.tensors) {
    if (offset >= t.offset_numel && offset < t.offset_numel + t.numel) {
      return t.hf_name + TensorIndexString(t.shape, offset - t.offset_numel);
    }
    if (t.offset_numel + t.numel <= offset) before = &t;
  }
  return before != nullptr ? absl::StrCat("the padding after ", before->hf_name)
                           : absl::StrCat("element ", offset, " of ", unit.name);
}

void CopyNormsFromMaster(const UnitLayout& unit, const float* master, float* side) {
  for (const TensorSlot& t : unit.tensors) {
    if (t.fp32_offset >= 0) std::copy_n(master + t.offset_numel, t.numel, side + t.fp32_offset);
  }
}

namespace {

// The routed experts of a sparse unit, per expert (gate, up, down, each aligned), as the hub's
// per-expert tensors or as slices of transformers 5's fused ones (ExpertStorage).
void AddExperts(UnitLayout& u, const ModelConfig& c, const std::string& p) {
  const int64_t h = c.hidden_size, mi = c.moe_intermediate_size, e_count = c.num_experts;
  ExpertLayout& x = u.experts;
  x.num_experts = e_count;
  x.first_offset = u.numel;
  x.first_tensor = static_cast<int>(u.tensors.size());
  for (int64_t e = 0; e < e_count; ++e) {
    if (c.expert_storage == ExpertStorage::kPerExpert) {
      const std::string expert = absl::StrCat(p, "mlp.experts.", e, ".");
      AddTensor(u, expert + "gate_proj.weight", {mi, h});
      AddTensor(u, expert + "up_proj.weight", {mi, h});
      AddTensor(u, expert + "down_proj.weight", {h, mi});
    } else {
      // gate_up_proj [E, 2 mi, h]: expert e's gate rows, then its up rows; down_proj [E, h, mi].
      const std::string gate_up = p + "mlp.experts.gate_up_proj", down = p + "mlp.experts.down_proj";
      auto slice = [&](const std::string& name, std::vector<int64_t> shape, std::vector<int64_t> full, int64_t at) {
        AddTensor(u, name, std::move(shape));
        u.tensors.back().hf_shape = std::move(full);
        u.tensors.back().hf_offset_numel = at;
      };
      slice(gate_up, {mi, h}, {e_count, 2 * mi, h}, e * 2 * mi * h);
      slice(gate_up, {mi, h}, {e_count, 2 * mi, h}, e * 2 * mi * h + mi * h);
      slice(down, {h, mi}, {e_count, h, mi}, e * h * mi);
    }
    if (e == 0) {
      for (int t = 0; t < kNumExpertTensors; ++t) {
        x.offset_in_expert[t] = u.tensors[x.first_tensor + t].offset_numel - x.first_offset;
      }
      x.expert_numel = u.numel - x.first_offset;
    }
  }
}

// gpt_oss's experts (GptOssExperts), per expert (gate_up, its bias, down, its bias, each aligned),
// as slices of transformers' fused tensors: gate_up_proj [E, h, 2 I] (x @ W, gate and up in
// alternate columns), gate_up_proj_bias [E, 2 I], down_proj [E, I, h], down_proj_bias [E, h].
void AddGptOssExperts(UnitLayout& u, const ModelConfig& c, const std::string& p) {
  const int64_t h = c.hidden_size, mi = c.moe_intermediate_size, e_count = c.num_experts;
  ExpertLayout& x = u.experts;
  x.num_experts = e_count;
  x.tensors_per_expert = kNumGptOssExpertTensors;
  x.first_offset = u.numel;
  x.first_tensor = static_cast<int>(u.tensors.size());
  const std::string e_prefix = p + "mlp.experts.";
  auto slice = [&](const std::string& name, std::vector<int64_t> shape, std::vector<int64_t> full, int64_t at) {
    AddTensor(u, e_prefix + name, std::move(shape));
    u.tensors.back().hf_shape = std::move(full);
    u.tensors.back().hf_offset_numel = at;
  };
  for (int64_t e = 0; e < e_count; ++e) {
    slice("gate_up_proj", {h, 2 * mi}, {e_count, h, 2 * mi}, e * h * 2 * mi);
    slice("gate_up_proj_bias", {2 * mi}, {e_count, 2 * mi}, e * 2 * mi);
    slice("down_proj", {mi, h}, {e_count, mi, h}, e * mi * h);
    slice("down_proj_bias", {h}, {e_count, h}, e * h);
    if (e == 0) {
      for (int t = 0; t < kNumGptOssExpertTensors; ++t) {
        x.offset_in_expert[t] = u.tensors[x.first_tensor + t].offset_numel - x.first_offset;
      }
      x.expert_numel = u.numel - x.first_offset;
    }
  }
}

}  // namespace

std::string TensorSlot::Key() const { return is_slice() ? absl::StrCat(hf_name, "@", hf_offset_numel) : hf_name; }

ModelLayout ModelLayout::Build(const ModelConfig& c) {
  ModelLayout m;
  m.config = c;
  m.head_uses_embedding = c.tie_word_embeddings;
  const int64_t h = c.hidden_size;
  const std::string prefix = c.WeightPrefix();

  UnitLayout embed;
  embed.kind = UnitKind::kEmbedding;
  embed.name = "embed";
  AddTensor(embed, prefix + "embed_tokens.weight", {c.vocab_size, h});
  if (c.is_gemma4() && c.gemma4.ple_dim > 0) {  // its per-layer inputs' table (Gemma4Fields)
    AddTensor(embed, prefix + "embed_tokens_per_layer.weight",
              {c.gemma4.ple_vocab, c.num_hidden_layers * c.gemma4.ple_dim});
  }
  m.units.push_back(std::move(embed));

  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    UnitLayout u;
    u.kind = UnitKind::kDecoder;
    u.decoder_layer = static_cast<int>(l);
    u.attention_window = c.AttentionWindow(l);
    u.sliding_rope = c.UsesSlidingRope(l);
    u.name = absl::StrCat("layer.", l);
    if (c.is_gemma4()) {  // its layers differ in sizes and tensors (model_config_gemma4.cc)
      config_internal::AddGemma4DecoderTensors(
          c, l, [&](DecoderTensor t, std::string name, std::vector<int64_t> shape, bool side) -> TensorSlot& {
            u.slot[t] = static_cast<int>(u.tensors.size());
            AddTensor(u, std::move(name), std::move(shape), side ? SideCopy::kFp32 : SideCopy::kNone);
            return u.tensors.back();
          });
      m.units.push_back(std::move(u));
      continue;
    }
    const std::string p = absl::StrCat(prefix, "layers.", l, ".");
    auto add = [&](DecoderTensor t, const char* name, std::vector<int64_t> shape) {
      u.slot[t] = static_cast<int>(u.tensors.size());
      const bool side = t == kInputNorm || t == kPostNorm || t == kQNorm || t == kKNorm || t == kLinearNorm ||
                        t == kLinearDtBias || t == kLinearALog || t == kPreFfnNorm || t == kPostFfnNorm ||
                        t == kSinks;  // gpt_oss's sink logits join the softmax in FP32 (HF: an FP32 parameter)
      AddTensor(u, p + name, std::move(shape), side ? SideCopy::kFp32 : SideCopy::kNone);
    };
    const bool bias = c.has_qkv_bias();
    add(kInputNorm, "input_layernorm.weight", {h});
    if (c.IsLinearAttentionLayer(l)) {
      // HF Qwen3_5GatedDeltaNet's parameters. dt_bias and A_log reach the compute in FP32 (side
      // copy) as HF's g = -exp(A_log.float()) * softplus(a.float() + dt_bias) reads them.
      const LinearAttentionConfig& la = c.linear;
      add(kLinearInProjQkv, "linear_attn.in_proj_qkv.weight", {la.conv_dim(), h});
      add(kLinearInProjZ, "linear_attn.in_proj_z.weight", {la.value_dim(), h});
      add(kLinearInProjB, "linear_attn.in_proj_b.weight", {la.num_value_heads, h});
      add(kLinearInProjA, "linear_attn.in_proj_a.weight", {la.num_value_heads, h});
      add(kLinearConv, "linear_attn.conv1d.weight", {la.conv_dim(), 1, la.conv_kernel});
      add(kLinearDtBias, "linear_attn.dt_bias", {la.num_value_heads});
      add(kLinearALog, "linear_attn.A_log", {la.num_value_heads});
      add(kLinearNorm, "linear_attn.norm.weight", {la.value_head_dim});
      add(kLinearOutProj, "linear_attn.out_proj.weight", {h, la.value_dim()});
    } else {
      // qwen3_5's q_proj also emits the output gate: [query | gate] per head, 2 x q_dim rows.
      add(kQProj, "self_attn.q_proj.weight", {c.has_attention_output_gate() ? 2 * c.q_dim() : c.q_dim(), h});
      if (bias) add(kQBias, "self_attn.q_proj.bias", {c.q_dim()});
      add(kKProj, "self_attn.k_proj.weight", {c.kv_dim(), h});
      if (bias) add(kKBias, "self_attn.k_proj.bias", {c.kv_dim()});
      add(kVProj, "self_attn.v_proj.weight", {c.kv_dim(), h});
      if (bias) add(kVBias, "self_attn.v_proj.bias", {c.kv_dim()});
      add(kOProj, "self_attn.o_proj.weight", {h, c.q_dim()});
      if (c.has_o_bias()) add(kOBias, "self_attn.o_proj.bias", {h});
      if (c.has_attention_sinks()) add(kSinks, "self_attn.sinks", {c.num_attention_heads});
      if (c.has_qk_norm()) {
        add(kQNorm, "self_attn.q_norm.weight", {c.head_dim});
        add(kKNorm, "self_attn.k_norm.weight", {c.head_dim});
      }
    }
    add(kPostNorm, "post_attention_layernorm.weight", {h});
    if (c.has_sandwich_norms()) {  // gemma3: the MLP between two norms of its own
      add(kPreFfnNorm, "pre_feedforward_layernorm.weight", {h});
      add(kPostFfnNorm, "post_feedforward_layernorm.weight", {h});
    }
    if (c.IsSparseLayer(l)) {
      // docs/moe.md: the router, the shared expert (qwen3_5_moe), then the routed experts.
      if (c.is_gpt_oss()) {  // GptOssTopKRouter: a linear layer with a bias
        add(kRouter, "mlp.router.weight", {c.num_experts, h});
        add(kRouterBias, "mlp.router.bias", {c.num_experts});
      } else {
        add(kRouter, "mlp.gate.weight", {c.num_experts, h});
      }
      if (c.has_shared_expert()) {
        const int64_t si = c.shared_expert_intermediate_size;
        add(kSharedGateProj, "mlp.shared_expert.gate_proj.weight", {si, h});
        add(kSharedUpProj, "mlp.shared_expert.up_proj.weight", {si, h});
        add(kSharedDownProj, "mlp.shared_expert.down_proj.weight", {h, si});
        add(kSharedExpertGate, "mlp.shared_expert_gate.weight", {1, h});
      }
      if (c.is_gpt_oss()) {
        AddGptOssExperts(u, c, p);
      } else {
        AddExperts(u, c, p);
      }
    } else {
      add(kGateProj, "mlp.gate_proj.weight", {c.intermediate_size, h});
      add(kUpProj, "mlp.up_proj.weight", {c.intermediate_size, h});
      add(kDownProj, "mlp.down_proj.weight", {h, c.intermediate_size});
    }
    m.units.push_back(std::move(u));
  }

  UnitLayout head;
  head.kind = UnitKind::kHead;
  head.name = "head";
  AddTensor(head, prefix + "norm.weight", {h}, SideCopy::kFp32);
  if (!c.tie_word_embeddings) AddTensor(head, c.HeadWeightName(), {c.vocab_size, h});
  m.units.push_back(std::move(head));

  for (size_t i = 0; i < m.units.size(); ++i) {
    m.units[i].index = static_cast<int>(i);
    m.total_numel += m.units[i].numel;
  }
  return m;
}

const TensorSlot* ModelLayout::Find(absl::string_view hf_name, int* unit_index) const {
  auto find_in = [&](const UnitLayout& u) -> const TensorSlot* {
    for (const TensorSlot& t : u.tensors) {
      if (t.hf_name == hf_name) {
        if (unit_index) *unit_index = u.index;
        return &t;
      }
    }
    return nullptr;
  };
  // "model.layers.N.*" lives in layer N's unit: look only there (a MoE model has ~20k tensors,
  // and a checkpoint load looks each one up).
  absl::string_view rest = hf_name;
  int64_t layer = -1;
  const std::string layers = config.WeightPrefix() + "layers.";
  if (absl::ConsumePrefix(&rest, layers) && rest.find('.') != absl::string_view::npos &&
      absl::SimpleAtoi(rest.substr(0, rest.find('.')), &layer) && layer >= 0 &&
      layer + 1 < static_cast<int64_t>(units.size()) && units[layer + 1].decoder_layer == layer) {
    return find_in(units[layer + 1]);
  }
  for (const UnitLayout& u : units) {
    if (const TensorSlot* t = find_in(u)) return t;
  }
  return nullptr;
}

int64_t ModelLayout::param_count() const {
  int64_t n = 0;
  for (const UnitLayout& u : units)
    for (const TensorSlot& t : u.tensors) n += t.trainable ? t.numel : 0;
  return n;
}

int64_t ModelLayout::ActiveParamCount() const {
  int64_t n = param_count();
  for (const UnitLayout& u : units) {
    if (!u.sparse()) continue;
    int64_t expert = 0;  // one expert's parameters, padding apart
    for (int t = 0; t < u.experts.tensors_per_expert; ++t) {
      expert += u.ExpertSlot(0, t, u.experts.tensors_per_expert)->numel;
    }
    n -= (u.num_experts() - config.num_experts_per_tok) * expert;
  }
  return n;
}

int ModelLayout::OffloadedLayers(double ratio) const {
  const int layers = static_cast<int>(config.num_hidden_layers);
  return std::clamp(static_cast<int>(std::lround(ratio * layers)), 0, layers);
}

double ModelLayout::ModelFlopsPerToken(int64_t seq_len) const {
  const ModelConfig& c = config;
  double matmul = static_cast<double>(ActiveParamCount()) - static_cast<double>(c.vocab_size * c.hidden_size);
  if (c.tie_word_embeddings) matmul += static_cast<double>(c.vocab_size * c.hidden_size);
  // gemma4's per-layer input table is looked up, not multiplied.
  if (c.is_gemma4()) matmul -= static_cast<double>(c.gemma4.ple_vocab * c.num_hidden_layers * c.gemma4.ple_dim);
  // Causal attention, forward and backward: 12 x q_dim FLOPs per key a query sees, seq_len / 2 keys on
  // average over a row (the peers' 6 x seq_len x q_dim); a sliding layer's window W < seq_len sees
  // W - W^2 / (2 seq_len) on average (the band's area over the row: attention FLOPs as run).
  double attention_keys = 0;
  const double seq = static_cast<double>(seq_len);
  auto keys_of = [&](int64_t l) {
    const double w = static_cast<double>(c.AttentionWindow(l));
    return (w > 0 && w < seq) ? w - w * w / (2.0 * seq) : seq / 2.0;
  };
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    if (!c.IsLinearAttentionLayer(l)) attention_keys += keys_of(l);
  }
  double attention = 12.0 * attention_keys * static_cast<double>(c.q_dim());
  if (c.is_gemma4()) {  // its full-attention layers' heads are wider: each layer at its own q_dim
    attention = 0;
    for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
      attention += 12.0 * keys_of(l) * static_cast<double>(c.num_attention_heads * c.LayerHeadDim(l));
    }
  }
  // A Gated DeltaNet layer's recurrence per token and value head: S^T k, k u^T and S^T q, each
  // 2 x key_head_dim x value_head_dim, forward; x 3 with backward (the chunked kernels' extra
  // intra-chunk work is not counted, as attention's recompute is not).
  const LinearAttentionConfig& la = c.linear;
  const double linear = 3.0 * 6.0 * static_cast<double>(la.num_value_heads * la.key_head_dim * la.value_head_dim);
  return 6.0 * matmul + attention + static_cast<double>(c.NumLinearAttentionLayers()) * linear;
}

}  // namespace slidedp
