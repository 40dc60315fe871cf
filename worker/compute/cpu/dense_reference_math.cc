// Qwen3 reference math, the op-level references: linear layers, RMSNorm, RoPE, and the geometry
// every op shares (decoder sizes and offsets, RoPE tables, token geometry). The attention, the
// decoder layer and the model's ends live beside it (dense_attention_math.cc,
// dense_decoder_layer_math.cc, dense_model_math.cc). Plain loops, explicitly instantiated for
// float (backend) and double (gradient checks). Limits: scalar C++ at a few GFLOP/s; meant for tiny
// models and oracles.
#include "worker/compute/cpu/dense_reference_math.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "worker/compute/cpu/dense_reference_math_internal.h"

namespace slidedp {
namespace {

using dense_math::Axpy;
using dense_math::Dot;

// Rows per parallel range: keeps ranges big enough that dispatch cost stays small.
constexpr int64_t kMinRowsPerRange = 4;

}  // namespace

template <typename R>
void LinearForward(const R* x, const R* w, int64_t T, int64_t K, int64_t O, R* y, CpuWorkerPool* pool) {
  ParallelRanges(pool, T, kMinRowsPerRange, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const R* xr = x + t * K;
      R* yr = y + t * O;
      for (int64_t o = 0; o < O; ++o) yr[o] = Dot(xr, w + o * K, K);
    }
  });
}

template <typename R>
void LinearBackwardInput(const R* dy, const R* w, int64_t T, int64_t K, int64_t O, R* dx, Accumulate mode,
                         CpuWorkerPool* pool) {
  ParallelRanges(pool, T, kMinRowsPerRange, [&](int64_t t0, int64_t t1) {
    std::vector<R> acc(K);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), R(0));
      const R* dyr = dy + t * O;
      for (int64_t o = 0; o < O; ++o) Axpy(dyr[o], w + o * K, acc.data(), K);
      R* dxr = dx + t * K;
      if (mode == Accumulate::kAdd) {
        for (int64_t k = 0; k < K; ++k) dxr[k] += acc[k];
      } else {
        std::copy(acc.begin(), acc.end(), dxr);
      }
    }
  });
}

template <typename R>
void LinearBackwardWeight(const R* dy, const R* x, int64_t T, int64_t K, int64_t O, R* dw, CpuWorkerPool* pool) {
  ParallelRanges(pool, O, kMinRowsPerRange, [&](int64_t o0, int64_t o1) {
    std::vector<R> acc(K);
    for (int64_t o = o0; o < o1; ++o) {
      std::fill(acc.begin(), acc.end(), R(0));
      for (int64_t t = 0; t < T; ++t) Axpy(dy[t * O + o], x + t * K, acc.data(), K);
      R* dwr = dw + o * K;
      for (int64_t k = 0; k < K; ++k) dwr[k] += acc[k];
    }
  });
}

template <typename R>
void RmsNormRows(const R* x, const R* w, int64_t rows, int64_t n, R eps, R* y, R* rstd, CpuWorkerPool* pool) {
  ParallelRanges(pool, rows, kMinRowsPerRange * 4, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const R* xr = x + r * n;
      const R rs = R(1) / std::sqrt(Dot(xr, xr, n) / static_cast<R>(n) + eps);
      rstd[r] = rs;
      R* yr = y + r * n;
      for (int64_t i = 0; i < n; ++i) yr[i] = (xr[i] * rs) * w[i];
    }
  });
}

// dx_i = rs*w_i*dy_i - x_i * rs^3/n * sum_j dy_j w_j x_j;  dw_i += sum_r dy_ri x_ri rs_r.
template <typename R>
void RmsNormBackwardRows(const R* x, const R* rstd, const R* w, const R* dy, int64_t rows, int64_t n, R* dx,
                         Accumulate mode, R* dw, CpuWorkerPool* pool) {
  // Weight gradient first (dx may overwrite dy), serially over rows in order.
  std::vector<R> dw_acc(n, R(0));
  for (int64_t r = 0; r < rows; ++r) {
    const R* xr = x + r * n;
    const R* dyr = dy + r * n;
    const R rs = rstd[r];
    for (int64_t i = 0; i < n; ++i) dw_acc[i] += dyr[i] * (xr[i] * rs);
  }
  for (int64_t i = 0; i < n; ++i) dw[i] += dw_acc[i];
  ParallelRanges(pool, rows, kMinRowsPerRange * 4, [&](int64_t r0, int64_t r1) {
    std::vector<R> dyw(n);
    for (int64_t r = r0; r < r1; ++r) {
      const R* xr = x + r * n;
      const R* dyr = dy + r * n;
      const R rs = rstd[r];
      for (int64_t i = 0; i < n; ++i) dyw[i] = dyr[i] * w[i];
      const R c = Dot(dyw.data(), xr, n) * (rs * rs * rs) / static_cast<R>(n);
      R* dxr = dx + r * n;
      for (int64_t i = 0; i < n; ++i) {
        const R g = rs * dyw[i] - xr[i] * c;
        dxr[i] = mode == Accumulate::kAdd ? dxr[i] + g : g;
      }
    }
  });
}

template <typename R>
void ApplyRope(R* x, int64_t T, int64_t heads, int64_t head_dim, const TokenGeometry& geom, RopeDirection dir,
               CpuWorkerPool* pool) {
  // Partial RoPE (qwen3_5): the tables cover the first 2 x rope_half dims of each head; the rest pass.
  const int64_t half = geom.rope_half > 0 ? geom.rope_half : head_dim / 2;
  ParallelRanges(pool, T, kMinRowsPerRange * 4, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* cs = geom.rope_cos + t * half;
      const float* sn = geom.rope_sin + t * half;
      for (int64_t h = 0; h < heads; ++h) {
        R* v = x + (t * heads + h) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const R c = static_cast<R>(cs[i]);
          const R s = dir == RopeDirection::kForward ? static_cast<R>(sn[i]) : -static_cast<R>(sn[i]);
          const R a = v[i], b = v[i + half];
          v[i] = a * c - b * s;
          v[i + half] = b * c + a * s;
        }
      }
    }
  });
}

DecoderDims DecoderDims::From(const ModelConfig& c) {
  DecoderDims d;
  d.hidden = c.hidden_size;
  d.heads = c.num_attention_heads;
  d.kv_heads = c.num_key_value_heads;
  d.head_dim = c.head_dim;
  d.intermediate = c.intermediate_size;
  d.vocab = c.vocab_size;
  d.rms_norm_eps = c.rms_norm_eps;
  d.rope_theta = c.rope_theta;
  d.qk_norm = c.has_qk_norm();
  d.qkv_bias = c.has_qkv_bias();
  d.rope_inv_freq = c.RopeInverseFrequencies();
  d.rope_attention_scaling = static_cast<float>(c.RopeAttentionScaling());
  if (c.is_moe()) d.moe = MoeDims::Of(c);
  d.output_gate = c.has_attention_output_gate();
  d.rotary_dim = c.rotary_dim();
  d.shared_intermediate = c.shared_expert_intermediate_size;
  d.linear_k_heads = c.linear.num_key_heads;
  d.linear_v_heads = c.linear.num_value_heads;
  d.linear_k_dim = c.linear.key_head_dim;
  d.linear_v_dim = c.linear.value_head_dim;
  d.linear_conv = c.linear.conv_kernel;
  d.attn_scale = c.AttentionScale();
  d.mlp_act = c.mlp_activation();
  d.sandwich_norms = c.has_sandwich_norms();
  d.final_logit_softcap = c.final_logit_softcapping;
  d.embed_scale = c.EmbeddingScale();
  d.pad_token = c.pad_token_id;
  return d;
}

DecoderOffsets DecoderOffsets::From(const ModelConfig& config) {
  ModelConfig one = config;
  one.num_hidden_layers = 1;
  return Of(ModelLayout::Build(one).units[1]);
}

DecoderOffsets DecoderOffsets::Of(const UnitLayout& unit) {
  DecoderOffsets offs;
  for (int i = 0; i < kNumDecoderTensors; ++i) {
    offs.at[i] = unit.slot[i] >= 0 ? unit.tensors[unit.slot[i]].offset_numel : -1;
  }
  offs.unit_numel = unit.numel;
  offs.moe = MoeOffsets::InUnit(unit);
  offs.attention_window = unit.attention_window;
  offs.sliding_rope = unit.sliding_rope;
  return offs;
}

RopeTables BuildRopeTables(const std::vector<int32_t>& positions, const std::vector<float>& inv_freq,
                           float attention_scaling) {
  RopeTables r;
  r.half = static_cast<int64_t>(inv_freq.size());
  r.cos.resize(positions.size() * r.half);
  r.sin.resize(positions.size() * r.half);
  for (size_t t = 0; t < positions.size(); ++t) {
    for (int64_t i = 0; i < r.half; ++i) {
      const float angle = static_cast<float>(positions[t]) * inv_freq[i];
      // HF: emb.cos() * attention_scaling in FP32 (x * 1.0f is x: plain RoPE is unchanged).
      r.cos[t * r.half + i] = std::cos(angle) * attention_scaling;
      r.sin[t * r.half + i] = std::sin(angle) * attention_scaling;
    }
  }
  return r;
}

RopeTables BuildRopeTables(const std::vector<int32_t>& positions, const ModelConfig& config) {
  RopeTables r =
      BuildRopeTables(positions, config.RopeInverseFrequencies(), static_cast<float>(config.RopeAttentionScaling()));
  if (config.has_sliding_rope()) {
    RopeTables s = BuildRopeTables(positions, config.RopeInverseFrequencies(AttentionSpan::kSliding),
                                   static_cast<float>(config.RopeAttentionScaling(AttentionSpan::kSliding)));
    r.sliding_cos = std::move(s.cos);
    r.sliding_sin = std::move(s.sin);
    r.sliding_half = s.half;
  }
  return r;
}

RopeTables BuildRopeTables(const std::vector<int32_t>& positions, int64_t head_dim, double rope_theta) {
  ModelConfig plain;
  plain.head_dim = head_dim;
  plain.rope_theta = rope_theta;
  return BuildRopeTables(positions, plain);
}

template <typename R>
void AddNormWeightOffsets(const ModelConfig& config, const UnitLayout& unit, R* params) {
  if (!config.norms_add_one()) return;
  auto shift = [&](const TensorSlot* t) {
    if (t == nullptr) return;
    for (int64_t i = 0; i < t->numel; ++i) params[t->offset_numel + i] += R(1);
  };
  if (unit.kind == UnitKind::kHead) {
    shift(&unit.tensors[0]);
  } else if (unit.kind == UnitKind::kDecoder) {
    for (DecoderTensor t : {kInputNorm, kPostNorm, kQNorm, kKNorm, kPreFfnNorm, kPostFfnNorm}) shift(unit.Find(t));
  }
}
template void AddNormWeightOffsets<float>(const ModelConfig&, const UnitLayout&, float*);
template void AddNormWeightOffsets<double>(const ModelConfig&, const UnitLayout&, double*);

TokenGeometry MakeTokenGeometry(const MicroBatch& batch, const RopeTables& rope) {
  TokenGeometry g;
  g.num_tokens = batch.num_tokens();
  g.num_docs = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
  g.cu_seqlens = batch.cu_seqlens.data();
  g.rope_cos = rope.cos.data();
  g.rope_sin = rope.sin.data();
  g.rope_half = rope.half;
  if (!rope.sliding_cos.empty()) {
    g.sliding_rope_cos = rope.sliding_cos.data();
    g.sliding_rope_sin = rope.sliding_sin.data();
  }
  return g;
}

TokenGeometry LayerGeometry(const TokenGeometry& geom, const DecoderOffsets& offs) {
  TokenGeometry g = geom;
  if (offs.sliding_rope && geom.sliding_rope_cos != nullptr) {
    g.rope_cos = geom.sliding_rope_cos;
    g.rope_sin = geom.sliding_rope_sin;
  }
  g.sliding_rope_cos = nullptr;
  g.sliding_rope_sin = nullptr;
  return g;
}

#define SLIDEDP_INSTANTIATE_DENSE_OPS(R)                                                                               \
  template void LinearForward<R>(const R*, const R*, int64_t, int64_t, int64_t, R*, CpuWorkerPool*);                   \
  template void LinearBackwardInput<R>(const R*, const R*, int64_t, int64_t, int64_t, R*, Accumulate, CpuWorkerPool*); \
  template void LinearBackwardWeight<R>(const R*, const R*, int64_t, int64_t, int64_t, R*, CpuWorkerPool*);            \
  template void RmsNormRows<R>(const R*, const R*, int64_t, int64_t, R, R*, R*, CpuWorkerPool*);                       \
  template void RmsNormBackwardRows<R>(const R*, const R*, const R*, const R*, int64_t, int64_t, R*, Accumulate, R*,   \
                                       CpuWorkerPool*);                                                                \
  template void ApplyRope<R>(R*, int64_t, int64_t, int64_t, const TokenGeometry&, RopeDirection, CpuWorkerPool*);

SLIDEDP_INSTANTIATE_DENSE_OPS(float)
SLIDEDP_INSTANTIATE_DENSE_OPS(double)

}  // namespace slidedp
