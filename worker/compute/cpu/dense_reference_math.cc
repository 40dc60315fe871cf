// Qwen3 reference math: plain loops, explicitly instantiated for float (backend) and double
// (gradient checks). Limits: scalar C++ at a few GFLOP/s; meant for tiny models and oracles.
#include "worker/compute/cpu/dense_reference_math.h"

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <cstring>
#include <limits>

#include "common/numeric/bf16.h"

namespace slidedp {
namespace {

// Rows per parallel range: keeps ranges big enough that dispatch cost stays small.
constexpr int64_t kMinRowsPerRange = 4;

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

// Dot product with 8 independent partial sums (vectorizable without reassociation flags).
template <typename R>
inline R Dot(const R* a, const R* b, int64_t n) {
  R acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int l = 0; l < 8; ++l) acc[l] += a[i + l] * b[i + l];
  }
  R tail = 0;
  for (; i < n; ++i) tail += a[i] * b[i];
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])) + tail;
}

template <typename R>
inline void Axpy(R a, const R* x, R* y, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

template <typename R>
inline R Sigmoid(R g) {
  return R(1) / (R(1) + std::exp(-g));
}

// Views of the decoder tensors inside a flat unit array.
template <typename T>
struct DecoderTensors {
  T* p[kNumDecoderTensors];  // nullptr for a tensor the family does not have
  DecoderTensors(T* base, const DecoderOffsets& offs) {
    for (int i = 0; i < kNumDecoderTensors; ++i) p[i] = offs.at[i] >= 0 ? base + offs.at[i] : nullptr;
  }
  T* operator[](int i) const { return p[i]; }
};

// y[t, :] += b for each of T rows of O.
template <typename R>
void AddBiasRows(const R* b, int64_t T, int64_t O, R* y) {
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < O; ++o) y[t * O + o] += b[o];
}

// db += sum over rows of dy (the call's sum formed first, in row order, then added once).
template <typename R>
void BiasBackward(const R* dy, int64_t T, int64_t O, R* db) {
  std::vector<R> acc(O, R(0));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t o = 0; o < O; ++o) acc[o] += dy[t * O + o];
  for (int64_t o = 0; o < O; ++o) db[o] += acc[o];
}

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
  const int64_t half = head_dim / 2;
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
  return BuildRopeTables(positions, config.RopeInverseFrequencies(), static_cast<float>(config.RopeAttentionScaling()));
}

RopeTables BuildRopeTables(const std::vector<int32_t>& positions, int64_t head_dim, double rope_theta) {
  ModelConfig plain;
  plain.head_dim = head_dim;
  plain.rope_theta = rope_theta;
  return BuildRopeTables(positions, plain);
}

TokenGeometry MakeTokenGeometry(const MicroBatch& batch, const RopeTables& rope) {
  TokenGeometry g;
  g.num_tokens = batch.num_tokens();
  g.num_docs = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
  g.cu_seqlens = batch.cu_seqlens.data();
  g.rope_cos = rope.cos.data();
  g.rope_sin = rope.sin.data();
  return g;
}

template <typename R>
int64_t DecoderActs<R>::num_elements() const {
  int64_t n = 0;
  for (const std::vector<R>* v : {&rstd1, &xn, &q_raw, &k_raw, &q_rstd, &k_rstd, &q_rot, &k_rot, &v, &attn, &lse,
                                  &h1, &rstd2, &hn, &gate, &up}) {
    n += static_cast<int64_t>(v->size());
  }
  return n;
}

template <typename R>
void DecoderAttentionInputs(const DecoderDims& d, const DecoderOffsets& offs, const R* params,
                            const TokenGeometry& geom, const R* x, DecoderActs<R>* a, CpuWorkerPool* pool) {
  const DecoderTensors<const R> w(params, offs);
  const int64_t T = geom.num_tokens, H = d.hidden, qd = d.q_dim(), kvd = d.kv_dim();
  const R eps = static_cast<R>(d.rms_norm_eps);
  a->rstd1.resize(T);
  a->xn.resize(T * H);
  RmsNormRows(x, w[kInputNorm], T, H, eps, a->xn.data(), a->rstd1.data(), pool);
  a->q_raw.resize(T * qd);
  a->k_raw.resize(T * kvd);
  a->v.resize(T * kvd);
  LinearForward(a->xn.data(), w[kQProj], T, H, qd, a->q_raw.data(), pool);
  LinearForward(a->xn.data(), w[kKProj], T, H, kvd, a->k_raw.data(), pool);
  LinearForward(a->xn.data(), w[kVProj], T, H, kvd, a->v.data(), pool);
  if (w[kQBias] != nullptr) {
    AddBiasRows(w[kQBias], T, qd, a->q_raw.data());
    AddBiasRows(w[kKBias], T, kvd, a->k_raw.data());
    AddBiasRows(w[kVBias], T, kvd, a->v.data());
  }
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

namespace {

// One query row of one head over keys [s, t] of a document: softmax-weighted sum of v into o and the
// row's log-sum-exp (shared by the whole-batch and the context-parallel rows, bit for bit).
template <typename R>
void AttendRow(const R* q, const R* k_rot, const R* v, int64_t s, int64_t t, int64_t kvd, int64_t g, int64_t hd,
               R scale, std::vector<R>& p, R* o, R* lse_out) {
  p.resize(std::max<int64_t>(t - s + 1, 1));
  R mx = -std::numeric_limits<R>::infinity();
  for (int64_t j = s; j <= t; ++j) {
    const R sc = scale * Dot(q, k_rot + j * kvd + g * hd, hd);
    p[j - s] = sc;
    mx = std::max(mx, sc);
  }
  R sum = 0;
  for (int64_t j = s; j <= t; ++j) {
    p[j - s] = std::exp(p[j - s] - mx);
    sum += p[j - s];
  }
  std::fill(o, o + hd, R(0));
  for (int64_t j = s; j <= t; ++j) Axpy(p[j - s], v + j * kvd + g * hd, o, hd);
  const R inv = R(1) / sum;
  for (int64_t i = 0; i < hd; ++i) o[i] *= inv;
  *lse_out = mx + std::log(sum);
}

// Its backward: dq_row = the row's dq; dk and dv (the kv head's columns at rows [s, t]) accumulate.
template <typename R>
void AttendRowBackward(const R* q, const R* o, const R* dout, R row_lse, const R* k_rot, const R* v, int64_t s,
                       int64_t t, int64_t kvd, int64_t kvh, int64_t hd, R scale, std::vector<R>& dq_acc, R* dk, R* dv,
                       R* dq_row) {
  const R dsum = Dot(dout, o, hd);
  std::fill(dq_acc.begin(), dq_acc.end(), R(0));
  for (int64_t j = s; j <= t; ++j) {
    const R* k = k_rot + j * kvd + kvh * hd;
    const R* vj = v + j * kvd + kvh * hd;
    const R p = std::exp(scale * Dot(q, k, hd) - row_lse);
    const R ds = p * (Dot(dout, vj, hd) - dsum);
    Axpy(ds, k, dq_acc.data(), hd);
    Axpy(scale * ds, q, dk + j * kvd + kvh * hd, hd);
    Axpy(p, dout, dv + j * kvd + kvh * hd, hd);
  }
  for (int64_t i = 0; i < hd; ++i) dq_row[i] = scale * dq_acc[i];
}

}  // namespace

namespace {
// Context parallelism (TokenGeometry::context): gather the group's keys and values, attend the local
// queries over them; backward returns each rank its tokens' dk and dv summed over the group.
void ContextAttentionForward(const DecoderDims& d, const TokenGeometry& geom, const float* q_rot, const float* k_rot,
                             const float* v, float* attn, float* lse, CpuWorkerPool* pool);
void ContextAttentionBackward(const DecoderDims& d, const TokenGeometry& geom, const float* q_rot, const float* k_rot,
                              const float* v, const float* attn, const float* lse, const float* dattn, float* dq,
                              float* dk, float* dv, CpuWorkerPool* pool);
}  // namespace

template <typename R>
void AttentionForward(const DecoderDims& d, const TokenGeometry& geom, const R* q_rot, const R* k_rot, const R* v,
                      R* attn, R* lse, CpuWorkerPool* pool) {
  if constexpr (std::is_same_v<R, float>) {
    if (geom.context != nullptr) return ContextAttentionForward(d, geom, q_rot, k_rot, v, attn, lse, pool);
  }
  const int64_t hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(1.0 / std::sqrt(static_cast<double>(hd)));
  // One task per (document, query head): disjoint output rows.
  ParallelRanges(pool, geom.num_docs * d.heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<R> p;
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t doc = task / d.heads, h = task % d.heads, g = h / group;
      const int64_t s = geom.cu_seqlens[doc], e = geom.cu_seqlens[doc + 1];
      for (int64_t t = s; t < e; ++t) {
        AttendRow(q_rot + t * qd + h * hd, k_rot, v, s, t, kvd, g, hd, scale, p, attn + t * qd + h * hd,
                  lse + t * d.heads + h);
      }
    }
  });
}

template <typename R>
void AttentionBackward(const DecoderDims& d, const TokenGeometry& geom, const R* q_rot, const R* k_rot, const R* v,
                       const R* attn, const R* lse, const R* dattn, R* dq, R* dk, R* dv, CpuWorkerPool* pool) {
  if constexpr (std::is_same_v<R, float>) {
    if (geom.context != nullptr) {
      return ContextAttentionBackward(d, geom, q_rot, k_rot, v, attn, lse, dattn, dq, dk, dv, pool);
    }
  }
  const int64_t T = geom.num_tokens, hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(1.0 / std::sqrt(static_cast<double>(hd)));
  std::fill(dk, dk + T * kvd, R(0));
  std::fill(dv, dv + T * kvd, R(0));
  // One task per (document, kv head): each writes only its own dk/dv rows and the dq rows of the
  // query heads sharing that kv head.
  ParallelRanges(pool, geom.num_docs * d.kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<R> dq_acc(hd);
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t doc = task / d.kv_heads, kvh = task % d.kv_heads;
      const int64_t s = geom.cu_seqlens[doc], e = geom.cu_seqlens[doc + 1];
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int64_t t = s; t < e; ++t) {
          const int64_t at = t * qd + h * hd;
          AttendRowBackward(q_rot + at, attn + at, dattn + at, lse[t * d.heads + h], k_rot, v, s, t, kvd, kvh, hd,
                            scale, dq_acc, dk, dv, dq + at);
        }
      }
    }
  });
}

namespace {

// The first token of the document holding each of `rows` (indices into the micro-batch of `full`).
std::vector<int64_t> DocStarts(const TokenGeometry& full, const int64_t* rows, int64_t n) {
  std::vector<int64_t> starts(n);
  const int32_t* cu = full.cu_seqlens;
  for (int64_t i = 0; i < n; ++i) {
    // The last boundary <= rows[i] among cu[0, num_docs).
    const int32_t* it = std::upper_bound(cu, cu + full.num_docs, static_cast<int32_t>(rows[i]));
    starts[i] = *(it - 1);
  }
  return starts;
}

}  // namespace

template <typename R>
void AttentionForwardRows(const DecoderDims& d, const TokenGeometry& full, const int64_t* rows, int64_t n,
                          const R* q_rot, const R* k_rot, const R* v, R* attn, R* lse, CpuWorkerPool* pool) {
  const int64_t hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(1.0 / std::sqrt(static_cast<double>(hd)));
  const std::vector<int64_t> starts = DocStarts(full, rows, n);
  // One task per (local row, query head); the arithmetic of AttentionForward's row, in its order.
  ParallelRanges(pool, n * d.heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<R> p;
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t i = task / d.heads, h = task % d.heads, g = h / group;
      AttendRow(q_rot + i * qd + h * hd, k_rot, v, starts[i], rows[i], kvd, g, hd, scale, p, attn + i * qd + h * hd,
                lse + i * d.heads + h);
    }
  });
}

template <typename R>
void AttentionBackwardRows(const DecoderDims& d, const TokenGeometry& full, const int64_t* rows, int64_t n,
                           const R* q_rot, const R* k_rot, const R* v, const R* attn, const R* lse, const R* dattn,
                           R* dq, R* dk, R* dv, CpuWorkerPool* pool) {
  const int64_t T = full.num_tokens, hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(1.0 / std::sqrt(static_cast<double>(hd)));
  const std::vector<int64_t> starts = DocStarts(full, rows, n);
  std::fill(dk, dk + T * kvd, R(0));
  std::fill(dv, dv + T * kvd, R(0));
  // One task per kv head: it alone writes that head's dk/dv columns and the dq of its query heads.
  ParallelRanges(pool, d.kv_heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<R> dq_acc(hd);
    for (int64_t kvh = i0; kvh < i1; ++kvh) {
      for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int64_t i = 0; i < n; ++i) {
          const int64_t at = i * qd + h * hd;
          AttendRowBackward(q_rot + at, attn + at, dattn + at, lse[i * d.heads + h], k_rot, v, starts[i], rows[i], kvd,
                            kvh, hd, scale, dq_acc, dk, dv, dq + at);
        }
      }
    }
  });
}

namespace {

// The whole micro-batch's keys and values [full_tokens, kv_dim] each, gathered from every rank's
// share; false (group failed) leaves them empty.
bool GatherKeysValues(const DecoderDims& d, const TokenGeometry& geom, const float* k_rot, const float* v,
                      std::vector<float>* k_full, std::vector<float>* v_full) {
  const ContextGeometry& c = *geom.context;
  const int64_t n = geom.num_tokens, kvd = d.kv_dim(), row = 2 * kvd;
  if (!c.group->status().ok()) return false;
  std::vector<float> mine(c.part * row, 0.0f), all(static_cast<int64_t>(c.ranks) * c.part * row);
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(k_rot + i * kvd, kvd, mine.begin() + i * row);
    std::copy_n(v + i * kvd, kvd, mine.begin() + i * row + kvd);
  }
  if (absl::Status s = c.group->AllGather(mine.data(), c.part * row, all.data()); !s.ok()) {
    c.group->Fail(std::move(s));
    return false;
  }
  k_full->resize(c.full_tokens * kvd);
  v_full->resize(c.full_tokens * kvd);
  for (int64_t g = 0; g < c.full_tokens; ++g) {
    const float* src = all.data() + c.gathered_position[g] * row;
    std::copy_n(src, kvd, k_full->begin() + g * kvd);
    std::copy_n(src + kvd, kvd, v_full->begin() + g * kvd);
  }
  return true;
}

TokenGeometry WholeGeometry(const ContextGeometry& c) {
  TokenGeometry full;
  full.num_tokens = c.full_tokens;
  full.num_docs = c.full_docs;
  full.cu_seqlens = c.full_cu_seqlens;
  return full;
}

void ContextAttentionForward(const DecoderDims& d, const TokenGeometry& geom, const float* q_rot, const float* k_rot,
                             const float* v, float* attn, float* lse, CpuWorkerPool* pool) {
  const ContextGeometry& c = *geom.context;
  std::vector<float> k_full, v_full;
  if (!GatherKeysValues(d, geom, k_rot, v, &k_full, &v_full)) {
    std::fill(attn, attn + geom.num_tokens * d.q_dim(), std::numeric_limits<float>::quiet_NaN());
    std::fill(lse, lse + geom.num_tokens * d.heads, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  AttentionForwardRows(d, WholeGeometry(c), c.global_index, geom.num_tokens, q_rot, k_full.data(), v_full.data(), attn,
                       lse, pool);
}

void ContextAttentionBackward(const DecoderDims& d, const TokenGeometry& geom, const float* q_rot, const float* k_rot,
                              const float* v, const float* attn, const float* lse, const float* dattn, float* dq,
                              float* dk, float* dv, CpuWorkerPool* pool) {
  const ContextGeometry& c = *geom.context;
  const int64_t n = geom.num_tokens, kvd = d.kv_dim(), row = 2 * kvd;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> k_full, v_full;
  if (!GatherKeysValues(d, geom, k_rot, v, &k_full, &v_full)) {
    std::fill(dq, dq + n * d.q_dim(), nan);
    std::fill(dk, dk + n * kvd, nan);
    std::fill(dv, dv + n * kvd, nan);
    return;
  }
  std::vector<float> dk_full(c.full_tokens * kvd), dv_full(c.full_tokens * kvd);
  AttentionBackwardRows(d, WholeGeometry(c), c.global_index, n, q_rot, k_full.data(), v_full.data(), attn, lse, dattn,
                        dq, dk_full.data(), dv_full.data(), pool);
  // Every rank's contributions to each token's dk and dv, summed at the token's owner.
  std::vector<float> buf(static_cast<int64_t>(c.ranks) * c.part * row, 0.0f);
  for (int64_t g = 0; g < c.full_tokens; ++g) {
    float* dst = buf.data() + c.gathered_position[g] * row;
    std::copy_n(dk_full.begin() + g * kvd, kvd, dst);
    std::copy_n(dv_full.begin() + g * kvd, kvd, dst + kvd);
  }
  if (absl::Status s = c.group->ReduceScatter(buf.data(), c.part * row); !s.ok()) {
    c.group->Fail(std::move(s));
    std::fill(dq, dq + n * d.q_dim(), nan);
    std::fill(dk, dk + n * kvd, nan);
    std::fill(dv, dv + n * kvd, nan);
    return;
  }
  const float* mine = buf.data() + static_cast<int64_t>(c.rank) * c.part * row;
  for (int64_t i = 0; i < n; ++i) {
    std::copy_n(mine + i * row, kvd, dk + i * kvd);
    std::copy_n(mine + i * row + kvd, kvd, dv + i * kvd);
  }
}

}  // namespace

template <typename R>
void DecoderAttention(const DecoderDims& d, const TokenGeometry& geom, DecoderActs<R>* a, CpuWorkerPool* pool) {
  a->attn.resize(geom.num_tokens * d.q_dim());
  a->lse.resize(geom.num_tokens * d.heads);
  AttentionForward(d, geom, a->q_rot.data(), a->k_rot.data(), a->v.data(), a->attn.data(), a->lse.data(), pool);
}

template <typename R>
void DecoderMlpInputs(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                      const R* x, DecoderActs<R>* a, CpuWorkerPool* pool) {
  const DecoderTensors<const R> w(params, offs);
  const int64_t T = geom.num_tokens, H = d.hidden, I = d.intermediate;
  a->h1.resize(T * H);
  LinearForward(a->attn.data(), w[kOProj], T, d.q_dim(), H, a->h1.data(), pool);
  for (int64_t i = 0; i < T * H; ++i) a->h1[i] = x[i] + a->h1[i];
  a->rstd2.resize(T);
  a->hn.resize(T * H);
  RmsNormRows(a->h1.data(), w[kPostNorm], T, H, static_cast<R>(d.rms_norm_eps), a->hn.data(), a->rstd2.data(), pool);
  if (offs.sparse()) {
    a->moe_y.resize(T * H);
    MoeBlockForward(d.moe, offs.moe, params, a->hn.data(), T, a->moe_y.data(), &a->moe, pool);
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
  const int64_t T = geom.num_tokens, H = d.hidden, I = d.intermediate;
  if (offs.sparse()) {
    for (int64_t i = 0; i < T * H; ++i) y[i] = a.h1[i] + a.moe_y[i];
    return;
  }
  std::vector<R> m(T * I);
  for (int64_t i = 0; i < T * I; ++i) m[i] = a.gate[i] * Sigmoid(a.gate[i]) * a.up[i];
  std::vector<R> down(T * H);
  LinearForward(m.data(), w[kDownProj], T, I, H, down.data(), pool);
  for (int64_t i = 0; i < T * H; ++i) y[i] = a.h1[i] + down[i];
}

template <typename R>
void DecoderForwardAll(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                       const R* x, R* y, DecoderActs<R>* acts, CpuWorkerPool* pool) {
  DecoderAttentionInputs(d, offs, params, geom, x, acts, pool);
  DecoderAttention(d, geom, acts, pool);
  DecoderMlpInputs(d, offs, params, geom, x, acts, pool);
  DecoderOutput(d, offs, params, geom, *acts, y, pool);
}

namespace {

// The rows [t0, t0 + rows) of a batch for its token-local work: their RoPE tables (attention's
// document boundaries are not part of a tile).
TokenGeometry TileGeometry(const TokenGeometry& geom, int64_t half, int64_t t0, int64_t rows) {
  TokenGeometry g;
  g.num_tokens = rows;
  g.rope_cos = geom.rope_cos + t0 * half;
  g.rope_sin = geom.rope_sin + t0 * half;
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
  // MLP: y = h1 + m Wd^T, m = silu(gate) * up.
  std::vector<R> m(T * I), dm(T * I);
  for (int64_t i = 0; i < T * I; ++i) m[i] = a.gate[i] * Sigmoid(a.gate[i]) * a.up[i];
  LinearBackwardWeight(dy, m.data(), T, I, H, g[kDownProj], pool);
  LinearBackwardInput(dy, w[kDownProj], T, I, H, dm.data(), Accumulate::kOverwrite, pool);
  std::vector<R> dgate(T * I), dup(T * I);
  for (int64_t i = 0; i < T * I; ++i) {
    const R gt = a.gate[i], sg = Sigmoid(gt);
    dup[i] = dm[i] * gt * sg;
    dgate[i] = dm[i] * a.up[i] * (sg * (R(1) + gt * (R(1) - sg)));
  }
  m = {};
  dm = {};
  LinearBackwardWeight(dgate.data(), a.hn.data(), T, H, I, g[kGateProj], pool);
  LinearBackwardWeight(dup.data(), a.hn.data(), T, H, I, g[kUpProj], pool);
  LinearBackwardInput(dgate.data(), w[kGateProj], T, H, I, dhn, Accumulate::kOverwrite, pool);
  LinearBackwardInput(dup.data(), w[kUpProj], T, H, I, dhn, Accumulate::kAdd, pool);
}

// The MLP and o_proj blocks' backward over T tokens (a's fields hold those tokens): dh1 = dL/dh1
// (overwritten), dattn = dL/d attention output (overwritten), dparams += their weights' gradients.
template <typename R>
void MlpBlockBackward(const DecoderDims& d, const DecoderOffsets& offs, const R* params, R* dparams, int64_t T,
                      const DecoderActs<R>& a, const R* dy, R* dh1, R* dattn, const double* aux_prob_grad,
                      CpuWorkerPool* pool) {
  const DecoderTensors<const R> w(params, offs);
  const DecoderTensors<R> g(dparams, offs);
  const int64_t H = d.hidden, qd = d.q_dim();
  std::vector<R> dhn(T * H);
  if (offs.sparse()) {
    // y = h1 + MoE(hn).
    MoeBlockBackward(d.moe, offs.moe, params, a.hn.data(), T, a.moe, dy, aux_prob_grad, dhn.data(), dparams, pool);
  } else {
    DenseMlpBackward(d, w, g, T, a, dy, dhn.data(), pool);
  }

  // dh1 = dy + RMSNorm2 backward.
  std::copy(dy, dy + T * H, dh1);
  RmsNormBackwardRows(a.h1.data(), a.rstd2.data(), w[kPostNorm], dhn.data(), T, H, dh1, Accumulate::kAdd,
                      g[kPostNorm], pool);
  dhn = {};

  // o_proj.
  LinearBackwardWeight(dh1, a.attn.data(), T, qd, H, g[kOProj], pool);
  LinearBackwardInput(dh1, w[kOProj], T, qd, H, dattn, Accumulate::kOverwrite, pool);
}

// RoPE, q/k norm, bias and QKV projection backward over the tokens of `geom` (a's fields hold
// them), then the input norm's: dx = dh1 + RMSNorm1 backward (dx may alias dh1). dq, dk, dv (the
// attention's input gradients) are changed in place.
template <typename R>
void QkvBlockBackward(const DecoderDims& d, const DecoderTensors<const R>& w, const DecoderTensors<R>& g,
                      const TokenGeometry& geom, const R* x, const DecoderActs<R>& a, R* dq, R* dk, R* dv,
                      const R* dh1, R* dx, CpuWorkerPool* pool) {
  const int64_t T = geom.num_tokens, H = d.hidden, hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  // RoPE backward (inverse rotation), then q/k RMSNorm backward, in place.
  ApplyRope(dq, T, d.heads, hd, geom, RopeDirection::kBackward, pool);
  ApplyRope(dk, T, d.kv_heads, hd, geom, RopeDirection::kBackward, pool);
  if (w[kQNorm] != nullptr) {
    RmsNormBackwardRows(a.q_raw.data(), a.q_rstd.data(), w[kQNorm], dq, T * d.heads, hd, dq, Accumulate::kOverwrite,
                        g[kQNorm], pool);
    RmsNormBackwardRows(a.k_raw.data(), a.k_rstd.data(), w[kKNorm], dk, T * d.kv_heads, hd, dk,
                        Accumulate::kOverwrite, g[kKNorm], pool);
  }
  if (g[kQBias] != nullptr) {
    BiasBackward(dq, T, qd, g[kQBias]);
    BiasBackward(dk, T, kvd, g[kKBias]);
    BiasBackward(dv, T, kvd, g[kVBias]);
  }

  // QKV projections.
  LinearBackwardWeight(dq, a.xn.data(), T, H, qd, g[kQProj], pool);
  LinearBackwardWeight(dk, a.xn.data(), T, H, kvd, g[kKProj], pool);
  LinearBackwardWeight(dv, a.xn.data(), T, H, kvd, g[kVProj], pool);
  std::vector<R> dxn(T * H);
  LinearBackwardInput(dq, w[kQProj], T, H, qd, dxn.data(), Accumulate::kOverwrite, pool);
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
  }
  DecoderAttention(d, geom, &whole, pool);
  return whole;
}

}  // namespace

template <typename R>
void DecoderBackward(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                     const R* x, const DecoderActs<R>& a, const R* dy, R* dx, R* dparams, CpuWorkerPool* pool,
                     const double* aux_prob_grad) {
  const DecoderTensors<const R> w(params, offs);
  const DecoderTensors<R> g(dparams, offs);
  const int64_t T = geom.num_tokens, H = d.hidden, qd = d.q_dim(), kvd = d.kv_dim();
  std::vector<R> dh1(T * H), dattn(T * qd);
  MlpBlockBackward(d, offs, params, dparams, T, a, dy, dh1.data(), dattn.data(), aux_prob_grad, pool);
  std::vector<R> dq(T * qd), dk(T * kvd), dv(T * kvd);
  AttentionBackward(d, geom, a.q_rot.data(), a.k_rot.data(), a.v.data(), a.attn.data(), a.lse.data(), dattn.data(),
                    dq.data(), dk.data(), dv.data(), pool);
  dattn = {};
  // dx is written only now (it may alias dy).
  QkvBlockBackward(d, w, g, geom, x, a, dq.data(), dk.data(), dv.data(), dh1.data(), dx, pool);
}

template <typename R>
void DecoderForwardTiled(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                         const R* x, R* y, int64_t tile, CpuWorkerPool* pool) {
  const int64_t T = geom.num_tokens, H = d.hidden, half = d.head_dim / 2, qd = d.q_dim();
  if (tile <= 0 || tile >= T) {
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
void DecoderBackwardTiled(const DecoderDims& d, const DecoderOffsets& offs, const R* params, const TokenGeometry& geom,
                          const R* x, const R* dy, R* dx, R* dparams, int64_t tile, CpuWorkerPool* pool) {
  const int64_t T = geom.num_tokens, H = d.hidden, half = d.head_dim / 2, qd = d.q_dim(), kvd = d.kv_dim();
  if (tile <= 0 || tile >= T) {
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
  AttentionBackward(d, geom, whole.q_rot.data(), whole.k_rot.data(), whole.v.data(), whole.attn.data(),
                    whole.lse.data(), dattn.data(), dq.data(), dk.data(), dv.data(), pool);
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

template <typename R, typename W>
void EmbeddingLookup(const W* embed, const int32_t* tokens, int64_t num_tokens, int64_t hidden, R* out,
                     CpuWorkerPool* pool) {
  ParallelRanges(pool, num_tokens, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const W* row = embed + static_cast<int64_t>(tokens[t]) * hidden;
      for (int64_t i = 0; i < hidden; ++i) out[t * hidden + i] = ToReal<R>(row[i]);
    }
  });
}

template <typename R>
void EmbeddingScatterAdd(const R* dout, const int32_t* tokens, int64_t num_tokens, int64_t hidden, R* dembed) {
  for (int64_t t = 0; t < num_tokens; ++t) {
    R* row = dembed + static_cast<int64_t>(tokens[t]) * hidden;
    for (int64_t i = 0; i < hidden; ++i) row[i] += dout[t * hidden + i];
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
  std::vector<R> dnorm_acc(H, R(0));
  double loss = 0.0;

  auto load_rows = [&](int64_t v0, int64_t vc) {
    for (int64_t i = 0; i < vc * H; ++i) w_chunk[i] = ToReal<R>(lm_head_w[v0 * H + i]);
  };
  auto chunk_logits = [&](int64_t tc, int64_t vc) {
    ParallelRanges(pool, tc, 1, [&](int64_t c0, int64_t c1) {
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t v = 0; v < vc; ++v) logits[c * vc + v] = Dot(xf.data() + c * H, w_chunk.data() + v * H, H);
    });
  };

  for (size_t c_begin = 0; c_begin < trained.size(); c_begin += tc_max) {
    const int64_t tc = std::min<int64_t>(tc_max, static_cast<int64_t>(trained.size() - c_begin));
    for (int64_t c = 0; c < tc; ++c) std::copy_n(x + trained[c_begin + c] * H, H, xin.data() + c * H);
    RmsNormRows(xin.data(), w_norm.data(), tc, H, eps, xf.data(), rstd.data(), pool);

    // Pass 1: online log-sum-exp over vocabulary chunks.
    std::fill(run_max.begin(), run_max.end(), -std::numeric_limits<R>::infinity());
    std::fill(run_sum.begin(), run_sum.end(), R(0));
    for (int64_t v0 = 0; v0 < V; v0 += vc_max) {
      const int64_t vc = std::min(vc_max, V - v0);
      load_rows(v0, vc);
      chunk_logits(tc, vc);
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
    }
    for (int64_t c = 0; c < tc; ++c) {
      lse[c] = run_max[c] + std::log(run_sum[c]);
      loss += static_cast<double>(scale * (lse[c] - label_logit[c]));
    }
    if (!grads) continue;

    // Pass 2: dlogits = scale * (softmax - onehot); dxf = dlogits W; dW += dlogits^T xf.
    std::fill(dxf.begin(), dxf.end(), R(0));
    for (int64_t v0 = 0; v0 < V; v0 += vc_max) {
      const int64_t vc = std::min(vc_max, V - v0);
      load_rows(v0, vc);
      chunk_logits(tc, vc);
      for (int64_t c = 0; c < tc; ++c) {
        R* l = logits.data() + c * vc;
        const int64_t label = labels[trained[c_begin + c]];
        for (int64_t v = 0; v < vc; ++v) {
          const R p = std::exp(l[v] - lse[c]);
          l[v] = scale * (v0 + v == label ? p - R(1) : p);
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
    }

    // Final RMSNorm backward into the trained tokens' dx rows.
    std::vector<R> dxin(tc * H);
    RmsNormBackwardRows(xin.data(), rstd.data(), w_norm.data(), dxf.data(), tc, H, dxin.data(),
                        Accumulate::kOverwrite, dnorm_acc.data(), pool);
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
  const DecoderDims dims = DecoderDims::From(c);
  const int num_units = layout.num_units();
  std::vector<DecoderOffsets> offs(num_units);
  for (int u = 1; u + 1 < num_units; ++u) offs[u] = DecoderOffsets::Of(layout.units[u]);
  unit_grads->assign(num_units, {});
  for (int u = 0; u < num_units; ++u) (*unit_grads)[u].assign(layout.units[u].numel, R(0));
  const int embed = 0, head = num_units - 1;
  const R* lm_w = layout.head_uses_embedding ? unit_params[embed].data()
                                             : unit_params[head].data() + layout.head().tensors[1].offset_numel;
  R* dlm = layout.head_uses_embedding ? (*unit_grads)[embed].data()
                                      : (*unit_grads)[head].data() + layout.head().tensors[1].offset_numel;
  double loss = 0.0;
  for (const MicroBatch& mb : batches) {
    const int64_t T = mb.num_tokens(), H = dims.hidden;
    const RopeTables rope = BuildRopeTables(mb.positions, dims.rope_inv_freq, dims.rope_attention_scaling);
    const TokenGeometry geom = MakeTokenGeometry(mb, rope);
    // xs[l] is the input of decoder layer l; xs.back() the head's input.
    std::vector<std::vector<R>> xs(num_units - 1, std::vector<R>(T * H));
    EmbeddingLookup(unit_params[embed].data(), mb.tokens.data(), T, H, xs[0].data(), pool);
    std::vector<DecoderActs<R>> acts(num_units - 2);
    std::vector<MoeRouterStats> router;
    for (int u = 1; u < head; ++u) {
      DecoderForwardAll(dims, offs[u], unit_params[u].data(), geom, xs[u - 1].data(), xs[u].data(), &acts[u - 1],
                        pool);
      if (offs[u].sparse()) router.push_back(acts[u - 1].moe.stats);
    }
    // The micro-batch's load-balancing loss over its sparse layers, and its gradient per probability.
    std::vector<double> aux_grad;
    if (!router.empty() && router_aux_weight != 0) {
      loss += router_aux_weight * LoadBalancingLoss(router);
      aux_grad = LoadBalancingProbGrad(router, router_aux_weight);
    }
    std::vector<R> grad(T * H);
    loss += HeadLossAndGrad(dims, unit_params[head].data(), lm_w, mb.labels.data(), T, xs.back().data(), loss_scale,
                            grad.data(), (*unit_grads)[head].data(), dlm, HeadChunking{}, pool);
    for (int u = head - 1; u >= 1; --u) {
      DecoderBackward(dims, offs[u], unit_params[u].data(), geom, xs[u - 1].data(), acts[u - 1], grad.data(),
                      grad.data(), (*unit_grads)[u].data(), pool, aux_grad.empty() ? nullptr : aux_grad.data());
    }
    EmbeddingScatterAdd(grad.data(), mb.tokens.data(), T, H, (*unit_grads)[embed].data());
  }
  return loss;
}

#define SLIDEDP_INSTANTIATE_REAL(R)                                                                                 \
  template struct DecoderActs<R>;                                                                                   \
  template void DecoderAttentionInputs<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&, \
                                          const R*, DecoderActs<R>*, CpuWorkerPool*);                               \
  template void DecoderAttention<R>(const DecoderDims&, const TokenGeometry&, DecoderActs<R>*, CpuWorkerPool*);      \
  template void DecoderMlpInputs<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,       \
                                    const R*, DecoderActs<R>*, CpuWorkerPool*);                                     \
  template void DecoderOutput<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,          \
                                 const DecoderActs<R>&, R*, CpuWorkerPool*);                                        \
  template void DecoderForwardAll<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,      \
                                     const R*, R*, DecoderActs<R>*, CpuWorkerPool*);                                \
  template void DecoderForwardTiled<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,    \
                                       const R*, R*, int64_t, CpuWorkerPool*);                                      \
  template void DecoderBackwardTiled<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,   \
                                        const R*, const R*, R*, R*, int64_t, CpuWorkerPool*);                       \
  template void DecoderBackward<R>(const DecoderDims&, const DecoderOffsets&, const R*, const TokenGeometry&,        \
                                   const R*, const DecoderActs<R>&, const R*, R*, R*, CpuWorkerPool*,               \
                                   const double*);                                                                  \
  template void LinearForward<R>(const R*, const R*, int64_t, int64_t, int64_t, R*, CpuWorkerPool*);              \
  template void LinearBackwardInput<R>(const R*, const R*, int64_t, int64_t, int64_t, R*, Accumulate,              \
                                       CpuWorkerPool*);                                                             \
  template void LinearBackwardWeight<R>(const R*, const R*, int64_t, int64_t, int64_t, R*, CpuWorkerPool*);       \
  template void RmsNormRows<R>(const R*, const R*, int64_t, int64_t, R, R*, R*, CpuWorkerPool*);                  \
  template void RmsNormBackwardRows<R>(const R*, const R*, const R*, const R*, int64_t, int64_t, R*, Accumulate,  \
                                       R*, CpuWorkerPool*);                                                         \
  template void ApplyRope<R>(R*, int64_t, int64_t, int64_t, const TokenGeometry&, RopeDirection, CpuWorkerPool*); \
  template void AttentionForward<R>(const DecoderDims&, const TokenGeometry&, const R*, const R*, const R*, R*, R*, \
                                    CpuWorkerPool*);                                                                \
  template void AttentionBackward<R>(const DecoderDims&, const TokenGeometry&, const R*, const R*, const R*,       \
                                     const R*, const R*, const R*, R*, R*, R*, CpuWorkerPool*);                     \
  template void AttentionForwardRows<R>(const DecoderDims&, const TokenGeometry&, const int64_t*, int64_t,          \
                                        const R*, const R*, const R*, R*, R*, CpuWorkerPool*);                      \
  template void AttentionBackwardRows<R>(const DecoderDims&, const TokenGeometry&, const int64_t*, int64_t,         \
                                         const R*, const R*, const R*, const R*, const R*, const R*, R*, R*, R*,    \
                                         CpuWorkerPool*);                                                           \
  template void EmbeddingScatterAdd<R>(const R*, const int32_t*, int64_t, int64_t, R*);                             \
  template double ModelLossAndGrads<R>(const ModelLayout&, const std::vector<std::vector<R>>&,                      \
                                       const std::vector<MicroBatch>&, double, std::vector<std::vector<R>>*,        \
                                       CpuWorkerPool*, double);

SLIDEDP_INSTANTIATE_REAL(float)
SLIDEDP_INSTANTIATE_REAL(double)

#define SLIDEDP_INSTANTIATE_REAL_WEIGHT(R, W)                                                                   \
  template void EmbeddingLookup<R, W>(const W*, const int32_t*, int64_t, int64_t, R*, CpuWorkerPool*);          \
  template double HeadLossAndGrad<R, W>(const DecoderDims&, const R*, const W*, const int32_t*, int64_t,        \
                                        const R*, double, R*, R*, R*, const HeadChunking&, CpuWorkerPool*);

SLIDEDP_INSTANTIATE_REAL_WEIGHT(float, bf16_t)
SLIDEDP_INSTANTIATE_REAL_WEIGHT(float, float)
SLIDEDP_INSTANTIATE_REAL_WEIGHT(double, double)

}  // namespace slidedp
