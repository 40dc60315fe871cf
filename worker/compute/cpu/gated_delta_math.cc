// Qwen3.5 Gated DeltaNet reference math (see gated_delta_math.h): the mixer's ops and the mixer,
// explicitly instantiated for float (backend) and double (gradient checks). The GEMMs are the dense
// Linear* ops. Limits: scalar C++; the recurrence costs ~6 dk dv FLOPs per token and value head
// forward and ~4x that backward (which recomputes the states), one head per thread.
#include "worker/compute/cpu/gated_delta_math.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"

#include "worker/compute/cpu/dense_reference_math_internal.h"

namespace slidedp {
namespace {

using dense_math::Axpy;
using dense_math::Dot;
using dense_math::Sigmoid;

// Parallel range sizes: conv channels (a range walks all T tokens), rows of the per-row ops.
constexpr int64_t kMinChannelsPerRange = 16;
constexpr int64_t kMinRowsPerRange = 16;

// torch.nn.functional.softplus with beta 1, threshold 20: x itself above the threshold.
constexpr double kSoftplusThreshold = 20;

template <typename R>
inline R Softplus(R x) {
  return x > R(kSoftplusThreshold) ? x : std::log1p(std::exp(x));
}

template <typename R>
inline R SoftplusGrad(R x) {
  return x > R(kSoftplusThreshold) ? R(1) : Sigmoid(x);
}

template <typename R>
inline R Silu(R x) {
  return x * Sigmoid(x);
}

template <typename R>
inline R SiluGrad(R x) {
  const R s = Sigmoid(x);
  return s * (R(1) + x * (R(1) - s));
}

inline int64_t DocBegin(const TokenGeometry& geom, int64_t d) { return geom.cu_seqlens[d]; }
inline int64_t DocEnd(const TokenGeometry& geom, int64_t d) { return geom.cu_seqlens[d + 1]; }

// ---- The recurrence's per-token pieces, shared by the forward and the backward's recomputation so
// that recomputed states are the forward's bit for bit. S is [dk, dv] row-major. ----

// m[j] = sum_i S[i, j] x[i], i ascending.
template <typename R>
inline void ReadState(const R* S, const R* x, int64_t dk, int64_t dv, R* m) {
  std::fill(m, m + dv, R(0));
  for (int64_t i = 0; i < dk; ++i) Axpy(x[i], S + i * dv, m, dv);
}

// S_out = decay * S_in (may alias); m = S_out^T k; diff = v - m; u = beta * diff.
template <typename R>
inline void DecayAndRead(const R* S_in, R decay, const R* k, const R* v, R beta, int64_t dk, int64_t dv, R* S_out,
                         R* m, R* diff, R* u) {
  for (int64_t x = 0; x < dk * dv; ++x) S_out[x] = S_in[x] * decay;
  ReadState(S_out, k, dk, dv, m);
  for (int64_t j = 0; j < dv; ++j) {
    diff[j] = v[j] - m[j];
    u[j] = beta * diff[j];
  }
}

// S += k u^T.
template <typename R>
inline void AddOuter(R* S, const R* k, const R* u, int64_t dk, int64_t dv) {
  for (int64_t i = 0; i < dk; ++i) Axpy(k[i], u, S + i * dv, dv);
}

// One value head's view of the packed q, k, v, g, beta.
template <typename R>
struct HeadInputs {
  const R* q;
  const R* k;
  const R* v;
  const R* g;
  const R* beta;
  int64_t h, kh, nk, nv, dk, dv;
  R scale;  // 1 / sqrt(dk)

  const R* q_at(int64_t t) const { return q + (t * nk + kh) * dk; }
  const R* k_at(int64_t t) const { return k + (t * nk + kh) * dk; }
  const R* v_at(int64_t t) const { return v + (t * nv + h) * dv; }
  R decay_at(int64_t t) const { return std::exp(g[t * nv + h]); }
  R beta_at(int64_t t) const { return beta[t * nv + h]; }
};

// Scratch of one recurrence step.
template <typename R>
struct StepScratch {
  std::vector<R> m, diff, u, qs;
  StepScratch(int64_t dk, int64_t dv) : m(dv), diff(dv), u(dv), qs(dk) {}
};

// S = state after token t given the state before it.
template <typename R>
inline void AdvanceState(const HeadInputs<R>& in, int64_t t, R* S, StepScratch<R>* s) {
  DecayAndRead(S, in.decay_at(t), in.k_at(t), in.v_at(t), in.beta_at(t), in.dk, in.dv, S, s->m.data(),
               s->diff.data(), s->u.data());
  AddOuter(S, in.k_at(t), s->u.data(), in.dk, in.dv);
}

template <typename R>
inline void ScaledQuery(const HeadInputs<R>& in, int64_t t, R* qs) {
  const R* q = in.q_at(t);
  for (int64_t i = 0; i < in.dk; ++i) qs[i] = q[i] * in.scale;
}

template <typename R>
HeadInputs<R> MakeHeadInputs(const LinearAttentionDims& dims, const R* q, const R* k, const R* v, const R* g,
                             const R* beta, int64_t h) {
  return HeadInputs<R>{q,
                       k,
                       v,
                       g,
                       beta,
                       h,
                       h / dims.group(),
                       dims.num_k_heads,
                       dims.num_v_heads,
                       dims.k_dim,
                       dims.v_dim,
                       R(1) / std::sqrt(static_cast<R>(dims.k_dim))};
}

// Where one value head writes its dq and dk rows: the packed [T, key_dim] arrays when it owns its
// key head (group 1), else a [T, nv, dk] scratch summed over the group afterwards.
template <typename R>
struct KeyGradRows {
  R* base;
  int64_t row_stride;
  int64_t offset;
  R* at(int64_t t) const { return base + t * row_stride + offset; }
};

// The reverse-time adjoint of one token. dS holds dL/dS_t from the tokens after t on entry and
// dL/dS_{t-1} on exit. S_prev, S_cur: the states before and after token t; Sp: scratch [dk, dv].
template <typename R>
void BackwardStep(const HeadInputs<R>& in, int64_t t, const R* S_prev, const R* S_cur, const R* dout, R* dS, R* Sp,
                  StepScratch<R>* s, std::vector<R>* du, std::vector<R>* dm, R* dq, R* dk, R* dv, R* dg, R* dbeta) {
  const int64_t dk_ = in.dk, dv_ = in.dv;
  const R* k = in.k_at(t);
  const R* d_o = dout + (t * in.nv + in.h) * dv_;
  const R decay = in.decay_at(t), beta = in.beta_at(t);
  // o_t = S_t^T qs_t.
  ScaledQuery(in, t, s->qs.data());
  for (int64_t i = 0; i < dk_; ++i) {
    Axpy(s->qs[i], d_o, dS + i * dv_, dv_);
    dq[i] = in.scale * Dot(S_cur + i * dv_, d_o, dv_);
  }
  // S_t = S' + k u^T, u = beta (v - S'^T k), S' = decay S_{t-1}.
  DecayAndRead(S_prev, decay, k, in.v_at(t), beta, dk_, dv_, Sp, s->m.data(), s->diff.data(), s->u.data());
  ReadState(dS, k, dk_, dv_, du->data());
  R db = 0;
  for (int64_t j = 0; j < dv_; ++j) {
    db += (*du)[j] * s->diff[j];
    dv[j] = beta * (*du)[j];
    (*dm)[j] = -beta * (*du)[j];
  }
  *dbeta = db;
  for (int64_t i = 0; i < dk_; ++i) {
    dk[i] = Dot(dS + i * dv_, s->u.data(), dv_);
    Axpy(k[i], dm->data(), dS + i * dv_, dv_);  // dS becomes dL/dS'
    dk[i] += Dot(Sp + i * dv_, dm->data(), dv_);
  }
  *dg = Dot(dS, Sp, dk_ * dv_);  // dS'/dg = S'
  for (int64_t x = 0; x < dk_ * dv_; ++x) dS[x] *= decay;
}

// ceil(sqrt(n)) for n >= 1.
int64_t CeilSqrt(int64_t n) {
  int64_t r = static_cast<int64_t>(std::sqrt(static_cast<double>(n)));
  while (r * r < n) ++r;
  while (r > 1 && (r - 1) * (r - 1) >= n) --r;
  return std::max<int64_t>(r, 1);
}

// One value head's backward over one document [s0, s1): checkpoints every L tokens, then chunk by
// chunk from the last, the chunk's states recomputed from its checkpoint and walked backwards.
template <typename R>
void HeadDocumentBackward(const HeadInputs<R>& in, int64_t s0, int64_t s1, int64_t checkpoint_interval,
                          const R* dout, const KeyGradRows<R>& dq_rows, const KeyGradRows<R>& dk_rows, R* dv, R* dg,
                          R* dbeta) {
  const int64_t n = s1 - s0, state = in.dk * in.dv;
  if (n <= 0) return;
  const int64_t L = checkpoint_interval > 0 ? std::min(checkpoint_interval, n) : CeilSqrt(n);
  const int64_t chunks = (n + L - 1) / L;
  StepScratch<R> scratch(in.dk, in.dv);
  std::vector<R> checkpoints(chunks * state);
  std::vector<R> S(state, R(0));
  for (int64_t c = 0; c < chunks; ++c) {
    std::copy(S.begin(), S.end(), checkpoints.begin() + c * state);
    if (c + 1 == chunks) break;
    for (int64_t t = s0 + c * L; t < s0 + (c + 1) * L; ++t) AdvanceState(in, t, S.data(), &scratch);
  }
  std::vector<R> states((L + 1) * state), dS(state, R(0)), Sp(state), du(in.dv), dm(in.dv);
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t c0 = s0 + c * L, len = std::min(L, s1 - c0);
    std::copy_n(checkpoints.begin() + c * state, state, states.begin());
    for (int64_t i = 0; i < len; ++i) {
      R* next = states.data() + (i + 1) * state;
      std::copy_n(states.data() + i * state, state, next);
      AdvanceState(in, c0 + i, next, &scratch);
    }
    for (int64_t i = len - 1; i >= 0; --i) {
      const int64_t t = c0 + i;
      const int64_t gi = t * in.nv + in.h;
      BackwardStep(in, t, states.data() + i * state, states.data() + (i + 1) * state, dout, dS.data(), Sp.data(),
                   &scratch, &du, &dm, dq_rows.at(t), dk_rows.at(t), dv + gi * in.dv, dg + gi, dbeta + gi);
    }
  }
}

// The mixer's inputs to the recurrence from mixed, a, b: the conv (pre, if wanted), q, k, v
// (split, q and k normalised), g, beta. Shared by forward and backward so both see the same bits.
template <typename R>
struct DeltaInputs {
  std::vector<R> pre;           // [T, conv_dim] conv pre-activation (backward only)
  std::vector<R> q, k;          // [T, key_dim] normalised
  std::vector<R> v;             // [T, value_dim]
  std::vector<R> q_inv, k_inv;  // [T, nk]
  std::vector<R> g, beta;       // [T, nv]
};

enum class KeepConvInput { kNo, kYes };

template <typename R>
void ComputeDeltaInputs(const LinearAttentionDims& dims, const LinearAttentionOffsets& offs, const R* params,
                        const TokenGeometry& geom, const R* mixed, const R* a, const R* b, KeepConvInput keep_pre,
                        DeltaInputs<R>* out, CpuWorkerPool* pool) {
  const int64_t T = geom.num_tokens, C = dims.conv_dim(), KD = dims.key_dim(), VD = dims.value_dim();
  std::vector<R> c(T * C);
  if (keep_pre == KeepConvInput::kYes) out->pre.resize(T * C);
  CausalConv1dSiluForward(mixed, params + offs.conv1d, C, dims.conv_kernel, geom,
                          keep_pre == KeepConvInput::kYes ? out->pre.data() : nullptr, c.data(), pool);
  out->q.resize(T * KD);
  out->k.resize(T * KD);
  out->v.resize(T * VD);
  ParallelRanges(pool, T, kMinRowsPerRange, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const R* row = c.data() + t * C;
      std::copy_n(row, KD, out->q.data() + t * KD);
      std::copy_n(row + KD, KD, out->k.data() + t * KD);
      std::copy_n(row + 2 * KD, VD, out->v.data() + t * VD);
    }
  });
  const R eps = static_cast<R>(LinearAttentionDims::kL2NormEps);
  out->q_inv.resize(T * dims.num_k_heads);
  out->k_inv.resize(T * dims.num_k_heads);
  HeadL2NormForward(out->q.data(), T * dims.num_k_heads, dims.k_dim, eps, out->q.data(), out->q_inv.data(), pool);
  HeadL2NormForward(out->k.data(), T * dims.num_k_heads, dims.k_dim, eps, out->k.data(), out->k_inv.data(), pool);
  out->g.resize(T * dims.num_v_heads);
  out->beta.resize(T * dims.num_v_heads);
  DecayAndBetaForward(a, b, params + offs.a_log, params + offs.dt_bias, T, dims.num_v_heads, out->g.data(),
                      out->beta.data(), pool);
}

}  // namespace

absl::Status LinearAttentionDims::Validate() const {
  if (hidden <= 0 || num_k_heads <= 0 || num_v_heads <= 0 || k_dim <= 0 || v_dim <= 0 || conv_kernel <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("linear attention sizes must be positive: hidden ", hidden,
                                                   ", heads ", num_k_heads, "/", num_v_heads, ", head dims ", k_dim,
                                                   "/", v_dim, ", conv kernel ", conv_kernel));
  }
  if (num_v_heads % num_k_heads != 0) {
    return absl::InvalidArgumentError(absl::StrCat("linear_num_value_heads ", num_v_heads,
                                                   " is not a multiple of linear_num_key_heads ", num_k_heads));
  }
  if (!(norm_eps > 0)) return absl::InvalidArgumentError("linear attention norm eps must be positive");
  return absl::OkStatus();
}

LinearAttentionOffsets LinearAttentionOffsets::Packed(const LinearAttentionDims& d, int64_t base,
                                                      int64_t* end_numel) {
  LinearAttentionOffsets o;
  int64_t at = base;
  auto take = [&at](int64_t numel) {
    const int64_t here = at;
    at += numel;
    return here;
  };
  o.in_proj_qkv = take(d.conv_dim() * d.hidden);
  o.in_proj_z = take(d.value_dim() * d.hidden);
  o.in_proj_b = take(d.num_v_heads * d.hidden);
  o.in_proj_a = take(d.num_v_heads * d.hidden);
  o.conv1d = take(d.conv_dim() * d.conv_kernel);
  o.dt_bias = take(d.num_v_heads);
  o.a_log = take(d.num_v_heads);
  o.norm = take(d.v_dim);
  o.out_proj = take(d.hidden * d.value_dim());
  if (end_numel != nullptr) *end_numel = at;
  return o;
}

template <typename R>
int64_t LinearAttentionActs<R>::num_elements() const {
  return static_cast<int64_t>(mixed.size() + z.size() + b.size() + a.size() + core.size() + core_rstd.size());
}

// ---- Causal conv1d + SiLU ----

template <typename R>
void CausalConv1dSiluForward(const R* x, const R* w, int64_t channels, int64_t kernel, const TokenGeometry& geom,
                             R* pre, R* y, CpuWorkerPool* pool) {
  const int64_t C = channels, K = kernel;
  ParallelRanges(pool, C, kMinChannelsPerRange, [&](int64_t c0, int64_t c1) {
    for (int64_t d = 0; d < geom.num_docs; ++d) {
      const int64_t s0 = DocBegin(geom, d), s1 = DocEnd(geom, d);
      for (int64_t t = s0; t < s1; ++t) {
        const int64_t j0 = std::max<int64_t>(0, s0 - (t - (K - 1)));  // first tap inside the document
        for (int64_t ch = c0; ch < c1; ++ch) {
          R acc = 0;
          for (int64_t j = j0; j < K; ++j) acc += w[ch * K + j] * x[(t - (K - 1) + j) * C + ch];
          if (pre != nullptr) pre[t * C + ch] = acc;
          y[t * C + ch] = Silu(acc);
        }
      }
    }
  });
}

template <typename R>
void CausalConv1dSiluBackward(const R* x, const R* w, const R* pre, const R* dy, int64_t channels, int64_t kernel,
                              const TokenGeometry& geom, R* dx, R* dw, CpuWorkerPool* pool) {
  const int64_t C = channels, K = kernel;
  ParallelRanges(pool, C, kMinChannelsPerRange, [&](int64_t c0, int64_t c1) {
    std::vector<R> dw_acc((c1 - c0) * K, R(0));
    for (int64_t t = 0; t < geom.num_tokens; ++t) {
      for (int64_t ch = c0; ch < c1; ++ch) dx[t * C + ch] = 0;
    }
    // Token t's pre-activation gradient scatters into the K inputs it read (ascending t).
    for (int64_t d = 0; d < geom.num_docs; ++d) {
      const int64_t s0 = DocBegin(geom, d), s1 = DocEnd(geom, d);
      for (int64_t t = s0; t < s1; ++t) {
        const int64_t j0 = std::max<int64_t>(0, s0 - (t - (K - 1)));
        for (int64_t ch = c0; ch < c1; ++ch) {
          const R dp = dy[t * C + ch] * SiluGrad(pre[t * C + ch]);
          R* dwr = dw_acc.data() + (ch - c0) * K;
          for (int64_t j = j0; j < K; ++j) {
            const int64_t s = t - (K - 1) + j;
            dx[s * C + ch] += w[ch * K + j] * dp;
            dwr[j] += dp * x[s * C + ch];
          }
        }
      }
    }
    for (int64_t i = 0; i < (c1 - c0) * K; ++i) dw[c0 * K + i] += dw_acc[i];
  });
}

// ---- Per-head L2 norm ----

template <typename R>
void HeadL2NormForward(const R* x, int64_t rows, int64_t dim, R eps, R* y, R* inv, CpuWorkerPool* pool) {
  ParallelRanges(pool, rows, kMinRowsPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const R* xr = x + r * dim;
      const R iv = R(1) / std::sqrt(Dot(xr, xr, dim) + eps);
      inv[r] = iv;
      R* yr = y + r * dim;
      for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * iv;
    }
  });
}

template <typename R>
void HeadL2NormBackward(const R* y, const R* inv, const R* dy, int64_t rows, int64_t dim, R* dx,
                        CpuWorkerPool* pool) {
  ParallelRanges(pool, rows, kMinRowsPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const R* yr = y + r * dim;
      const R* dyr = dy + r * dim;
      const R proj = Dot(dyr, yr, dim), iv = inv[r];
      R* dxr = dx + r * dim;
      for (int64_t i = 0; i < dim; ++i) dxr[i] = iv * (dyr[i] - yr[i] * proj);
    }
  });
}

// ---- Decay and beta ----

template <typename R>
void DecayAndBetaForward(const R* a, const R* b, const R* a_log, const R* dt_bias, int64_t tokens, int64_t heads,
                         R* g, R* beta, CpuWorkerPool* pool) {
  ParallelRanges(pool, tokens, kMinRowsPerRange, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t i = t * heads + h;
        g[i] = -std::exp(a_log[h]) * Softplus(a[i] + dt_bias[h]);
        beta[i] = Sigmoid(b[i]);
      }
    }
  });
}

template <typename R>
void DecayAndBetaBackward(const R* a, const R* beta, const R* a_log, const R* dt_bias, const R* dg, const R* dbeta,
                          int64_t tokens, int64_t heads, R* da, R* db, R* da_log, R* ddt_bias, CpuWorkerPool* pool) {
  std::vector<R> dlog_acc(heads, R(0)), dbias_acc(heads, R(0));
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t i = t * heads + h;
      const R x = a[i] + dt_bias[h], neg_a = -std::exp(a_log[h]);
      const R da_i = dg[i] * neg_a * SoftplusGrad(x);
      dlog_acc[h] += dg[i] * (neg_a * Softplus(x));  // dg/dA_log = g
      dbias_acc[h] += da_i;
      da[i] = da_i;
      db[i] = dbeta[i] * beta[i] * (R(1) - beta[i]);
    }
  }
  for (int64_t h = 0; h < heads; ++h) {
    da_log[h] += dlog_acc[h];
    ddt_bias[h] += dbias_acc[h];
  }
  (void)pool;  // O(T nv) and one fixed order; not worth the dispatch
}

// ---- The gated delta rule ----

template <typename R>
void GatedDeltaRuleForward(const LinearAttentionDims& dims, const TokenGeometry& geom, const R* q, const R* k,
                           const R* v, const R* g, const R* beta, R* o, CpuWorkerPool* pool) {
  const int64_t dk = dims.k_dim, dv = dims.v_dim, nv = dims.num_v_heads;
  ParallelRanges(pool, nv, 1, [&](int64_t h0, int64_t h1) {
    StepScratch<R> scratch(dk, dv);
    std::vector<R> S(dk * dv);
    for (int64_t h = h0; h < h1; ++h) {
      const HeadInputs<R> in = MakeHeadInputs(dims, q, k, v, g, beta, h);
      for (int64_t d = 0; d < geom.num_docs; ++d) {
        std::fill(S.begin(), S.end(), R(0));
        for (int64_t t = DocBegin(geom, d); t < DocEnd(geom, d); ++t) {
          AdvanceState(in, t, S.data(), &scratch);
          ScaledQuery(in, t, scratch.qs.data());
          ReadState(S.data(), scratch.qs.data(), dk, dv, o + (t * nv + h) * dv);
        }
      }
    }
  });
}

template <typename R>
void GatedDeltaRuleBackward(const LinearAttentionDims& dims, const TokenGeometry& geom, const R* q, const R* k,
                            const R* v, const R* g, const R* beta, const R* dout, R* dq, R* dk, R* dv, R* dg,
                            R* dbeta, CpuWorkerPool* pool, int64_t checkpoint_interval) {
  const int64_t T = geom.num_tokens, kd = dims.k_dim, nk = dims.num_k_heads, nv = dims.num_v_heads;
  const int64_t group = dims.group();
  // With shared key heads each value head writes its own rows, summed per key head below.
  std::vector<R> dq_heads, dk_heads;
  if (group > 1) {
    dq_heads.resize(T * nv * kd);
    dk_heads.resize(T * nv * kd);
  }
  ParallelRanges(pool, nv, 1, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const HeadInputs<R> in = MakeHeadInputs(dims, q, k, v, g, beta, h);
      const KeyGradRows<R> dq_rows = group > 1 ? KeyGradRows<R>{dq_heads.data(), nv * kd, h * kd}
                                               : KeyGradRows<R>{dq, nk * kd, in.kh * kd};
      const KeyGradRows<R> dk_rows = group > 1 ? KeyGradRows<R>{dk_heads.data(), nv * kd, h * kd}
                                               : KeyGradRows<R>{dk, nk * kd, in.kh * kd};
      for (int64_t d = 0; d < geom.num_docs; ++d) {
        HeadDocumentBackward(in, DocBegin(geom, d), DocEnd(geom, d), checkpoint_interval, dout, dq_rows, dk_rows, dv,
                             dg, dbeta);
      }
    }
  });
  if (group == 1) return;
  ParallelRanges(pool, T, kMinRowsPerRange, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t kh = 0; kh < nk; ++kh) {
        R* q_dst = dq + (t * nk + kh) * kd;
        R* k_dst = dk + (t * nk + kh) * kd;
        const R* q_src = dq_heads.data() + (t * nv + kh * group) * kd;
        const R* k_src = dk_heads.data() + (t * nv + kh * group) * kd;
        std::copy_n(q_src, kd, q_dst);
        std::copy_n(k_src, kd, k_dst);
        for (int64_t r = 1; r < group; ++r) {
          for (int64_t i = 0; i < kd; ++i) {
            q_dst[i] += q_src[r * kd + i];
            k_dst[i] += k_src[r * kd + i];
          }
        }
      }
    }
  });
}

// ---- Gated RMSNorm ----

template <typename R>
void GatedRmsNormForward(const R* x, const R* z, const R* w, int64_t rows, int64_t dim, R eps, R* y, R* rstd,
                         CpuWorkerPool* pool) {
  ParallelRanges(pool, rows, kMinRowsPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const R* xr = x + r * dim;
      const R* zr = z + r * dim;
      const R rs = R(1) / std::sqrt(Dot(xr, xr, dim) / static_cast<R>(dim) + eps);
      rstd[r] = rs;
      R* yr = y + r * dim;
      for (int64_t i = 0; i < dim; ++i) yr[i] = (w[i] * (xr[i] * rs)) * Silu(zr[i]);
    }
  });
}

// n = x rstd, y = w n silu(z): dn = dy w silu(z), dz = dy w n silu'(z), dw += dy n silu(z),
// dx = rstd dn - x rstd^3 / dim (dn . x).
template <typename R>
void GatedRmsNormBackward(const R* x, const R* z, const R* w, const R* rstd, const R* dy, int64_t rows, int64_t dim,
                          R* dx, R* dz, R* dw, CpuWorkerPool* pool) {
  // Weight gradient first (dx may overwrite dy), serially over rows in order.
  std::vector<R> dw_acc(dim, R(0));
  for (int64_t r = 0; r < rows; ++r) {
    const R* xr = x + r * dim;
    const R* zr = z + r * dim;
    const R* dyr = dy + r * dim;
    for (int64_t i = 0; i < dim; ++i) dw_acc[i] += dyr[i] * ((xr[i] * rstd[r]) * Silu(zr[i]));
  }
  for (int64_t i = 0; i < dim; ++i) dw[i] += dw_acc[i];
  ParallelRanges(pool, rows, kMinRowsPerRange, [&](int64_t r0, int64_t r1) {
    std::vector<R> dn(dim);
    for (int64_t r = r0; r < r1; ++r) {
      const R* xr = x + r * dim;
      const R* zr = z + r * dim;
      const R* dyr = dy + r * dim;
      const R rs = rstd[r];
      R* dzr = dz + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const R dyw = dyr[i] * w[i];
        dn[i] = dyw * Silu(zr[i]);
        dzr[i] = dyw * (xr[i] * rs) * SiluGrad(zr[i]);
      }
      const R c = Dot(dn.data(), xr, dim) * (rs * rs * rs) / static_cast<R>(dim);
      R* dxr = dx + r * dim;
      for (int64_t i = 0; i < dim; ++i) dxr[i] = rs * dn[i] - xr[i] * c;
    }
  });
}

// ---- The mixer ----

template <typename R>
void LinearAttentionForward(const LinearAttentionDims& dims, const LinearAttentionOffsets& offs, const R* params,
                            const TokenGeometry& geom, const R* xn, R* out, LinearAttentionActs<R>* acts,
                            CpuWorkerPool* pool) {
  const int64_t T = geom.num_tokens, H = dims.hidden, C = dims.conv_dim(), VD = dims.value_dim();
  const int64_t nv = dims.num_v_heads;
  std::vector<R> mixed(T * C), z(T * VD), b(T * nv), a(T * nv);
  LinearForward(xn, params + offs.in_proj_qkv, T, H, C, mixed.data(), pool);
  LinearForward(xn, params + offs.in_proj_z, T, H, VD, z.data(), pool);
  LinearForward(xn, params + offs.in_proj_b, T, H, nv, b.data(), pool);
  LinearForward(xn, params + offs.in_proj_a, T, H, nv, a.data(), pool);

  std::vector<R> core(T * VD), core_rstd(T * nv);
  {
    DeltaInputs<R> in;
    ComputeDeltaInputs(dims, offs, params, geom, mixed.data(), a.data(), b.data(), KeepConvInput::kNo, &in, pool);
    GatedDeltaRuleForward(dims, geom, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                          core.data(), pool);
  }
  std::vector<R> y(T * VD);
  GatedRmsNormForward(core.data(), z.data(), params + offs.norm, T * nv, dims.v_dim, static_cast<R>(dims.norm_eps),
                      y.data(), core_rstd.data(), pool);
  LinearForward(y.data(), params + offs.out_proj, T, VD, H, out, pool);
  if (acts != nullptr) {
    acts->mixed = std::move(mixed);
    acts->z = std::move(z);
    acts->b = std::move(b);
    acts->a = std::move(a);
    acts->core = std::move(core);
    acts->core_rstd = std::move(core_rstd);
  }
}

template <typename R>
void LinearAttentionBackward(const LinearAttentionDims& dims, const LinearAttentionOffsets& offs, const R* params,
                             const TokenGeometry& geom, const R* xn, const LinearAttentionActs<R>& acts,
                             const R* dout, R* dxn, R* dparams, CpuWorkerPool* pool, int64_t checkpoint_interval) {
  const int64_t T = geom.num_tokens, H = dims.hidden, C = dims.conv_dim(), KD = dims.key_dim();
  const int64_t VD = dims.value_dim(), nv = dims.num_v_heads;

  // out = y Wout^T, y = gated_norm(core, z): dout is last read here (dxn may alias it).
  std::vector<R> dcore(T * VD), dz(T * VD);
  {
    std::vector<R> y(T * VD), rstd(T * nv), dy(T * VD);
    GatedRmsNormForward(acts.core.data(), acts.z.data(), params + offs.norm, T * nv, dims.v_dim,
                        static_cast<R>(dims.norm_eps), y.data(), rstd.data(), pool);
    LinearBackwardWeight(dout, y.data(), T, VD, H, dparams + offs.out_proj, pool);
    LinearBackwardInput(dout, params + offs.out_proj, T, VD, H, dy.data(), Accumulate::kOverwrite, pool);
    GatedRmsNormBackward(acts.core.data(), acts.z.data(), params + offs.norm, acts.core_rstd.data(), dy.data(),
                         T * nv, dims.v_dim, dcore.data(), dz.data(), dparams + offs.norm, pool);
  }

  // The recurrence and what feeds it, back to the conv's output.
  DeltaInputs<R> in;
  ComputeDeltaInputs(dims, offs, params, geom, acts.mixed.data(), acts.a.data(), acts.b.data(), KeepConvInput::kYes,
                     &in, pool);
  std::vector<R> dc(T * C), da(T * nv), db(T * nv);
  {
    std::vector<R> dq(T * KD), dk(T * KD), dv(T * VD), dg(T * nv), dbeta(T * nv);
    GatedDeltaRuleBackward(dims, geom, in.q.data(), in.k.data(), in.v.data(), in.g.data(), in.beta.data(),
                           dcore.data(), dq.data(), dk.data(), dv.data(), dg.data(), dbeta.data(), pool,
                           checkpoint_interval);
    DecayAndBetaBackward(acts.a.data(), in.beta.data(), params + offs.a_log, params + offs.dt_bias, dg.data(),
                         dbeta.data(), T, nv, da.data(), db.data(), dparams + offs.a_log, dparams + offs.dt_bias,
                         pool);
    HeadL2NormBackward(in.q.data(), in.q_inv.data(), dq.data(), T * dims.num_k_heads, dims.k_dim, dq.data(), pool);
    HeadL2NormBackward(in.k.data(), in.k_inv.data(), dk.data(), T * dims.num_k_heads, dims.k_dim, dk.data(), pool);
    ParallelRanges(pool, T, kMinRowsPerRange, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        R* row = dc.data() + t * C;
        std::copy_n(dq.data() + t * KD, KD, row);
        std::copy_n(dk.data() + t * KD, KD, row + KD);
        std::copy_n(dv.data() + t * VD, VD, row + 2 * KD);
      }
    });
  }
  std::vector<R> dmixed(T * C);
  CausalConv1dSiluBackward(acts.mixed.data(), params + offs.conv1d, in.pre.data(), dc.data(), C, dims.conv_kernel,
                           geom, dmixed.data(), dparams + offs.conv1d, pool);

  // The four input projections.
  LinearBackwardWeight(dmixed.data(), xn, T, H, C, dparams + offs.in_proj_qkv, pool);
  LinearBackwardWeight(dz.data(), xn, T, H, VD, dparams + offs.in_proj_z, pool);
  LinearBackwardWeight(db.data(), xn, T, H, nv, dparams + offs.in_proj_b, pool);
  LinearBackwardWeight(da.data(), xn, T, H, nv, dparams + offs.in_proj_a, pool);
  LinearBackwardInput(dmixed.data(), params + offs.in_proj_qkv, T, H, C, dxn, Accumulate::kOverwrite, pool);
  LinearBackwardInput(dz.data(), params + offs.in_proj_z, T, H, VD, dxn, Accumulate::kAdd, pool);
  LinearBackwardInput(db.data(), params + offs.in_proj_b, T, H, nv, dxn, Accumulate::kAdd, pool);
  LinearBackwardInput(da.data(), params + offs.in_proj_a, T, H, nv, dxn, Accumulate::kAdd, pool);
}

#define SLIDEDP_INSTANTIATE_GATED_DELTA(R)                                                                            \
  template struct LinearAttentionActs<R>;                                                                             \
  template void CausalConv1dSiluForward<R>(const R*, const R*, int64_t, int64_t, const TokenGeometry&, R*, R*,        \
                                           CpuWorkerPool*);                                                           \
  template void CausalConv1dSiluBackward<R>(const R*, const R*, const R*, const R*, int64_t, int64_t,                 \
                                            const TokenGeometry&, R*, R*, CpuWorkerPool*);                            \
  template void HeadL2NormForward<R>(const R*, int64_t, int64_t, R, R*, R*, CpuWorkerPool*);                          \
  template void HeadL2NormBackward<R>(const R*, const R*, const R*, int64_t, int64_t, R*, CpuWorkerPool*);            \
  template void DecayAndBetaForward<R>(const R*, const R*, const R*, const R*, int64_t, int64_t, R*, R*,              \
                                       CpuWorkerPool*);                                                               \
  template void DecayAndBetaBackward<R>(const R*, const R*, const R*, const R*, const R*, const R*, int64_t, int64_t, \
                                        R*, R*, R*, R*, CpuWorkerPool*);                                              \
  template void GatedDeltaRuleForward<R>(const LinearAttentionDims&, const TokenGeometry&, const R*, const R*,        \
                                         const R*, const R*, const R*, R*, CpuWorkerPool*);                           \
  template void GatedDeltaRuleBackward<R>(const LinearAttentionDims&, const TokenGeometry&, const R*, const R*,       \
                                          const R*, const R*, const R*, const R*, R*, R*, R*, R*, R*, CpuWorkerPool*, \
                                          int64_t);                                                                   \
  template void GatedRmsNormForward<R>(const R*, const R*, const R*, int64_t, int64_t, R, R*, R*, CpuWorkerPool*);    \
  template void GatedRmsNormBackward<R>(const R*, const R*, const R*, const R*, const R*, int64_t, int64_t, R*, R*,   \
                                        R*, CpuWorkerPool*);                                                          \
  template void LinearAttentionForward<R>(const LinearAttentionDims&, const LinearAttentionOffsets&, const R*,        \
                                          const TokenGeometry&, const R*, R*, LinearAttentionActs<R>*,                \
                                          CpuWorkerPool*);                                                            \
  template void LinearAttentionBackward<R>(const LinearAttentionDims&, const LinearAttentionOffsets&, const R*,       \
                                           const TokenGeometry&, const R*, const LinearAttentionActs<R>&, const R*,   \
                                           R*, R*, CpuWorkerPool*, int64_t);

SLIDEDP_INSTANTIATE_GATED_DELTA(float)
SLIDEDP_INSTANTIATE_GATED_DELTA(double)

}  // namespace slidedp
