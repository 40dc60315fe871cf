// Qwen3 reference math, the attention: causal varlen GQA attention over packed documents, full or
// within a sliding window (dense_reference_math.h: AttentionForward's mask), forward and backward,
// for the whole micro-batch and for a context-parallel rank's rows (the keys and values gathered
// from the rank's group). Explicitly instantiated for float (backend) and double (gradient checks);
// context parallelism runs in float alone. Limits: scalar C++, one task per (document, head); a
// sliding layer visits only its window's keys; meant for tiny models and oracles.
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/dense_reference_math_internal.h"

namespace slidedp {
namespace {

using dense_math::Axpy;
using dense_math::Dot;

// The first key query t sees, s being its document's start: s, or in a sliding layer the oldest of
// the window keys ending at t (HF: kv > q - sliding_window). Every key from it to t is seen.
int64_t FirstKey(int64_t s, int64_t t, int64_t window) { return window > 0 ? std::max(s, t - window + 1) : s; }

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
void AttentionForwardRows(const DecoderDims& d, const TokenGeometry& full, int64_t window, const int64_t* rows,
                          int64_t n, const R* q_rot, const R* k_rot, const R* v, R* attn, R* lse, CpuWorkerPool* pool) {
  const int64_t hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(d.AttentionScale());
  const std::vector<int64_t> starts = DocStarts(full, rows, n);
  // One task per (local row, query head); the arithmetic of AttentionForward's row, in its order.
  ParallelRanges(pool, n * d.heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<R> p;
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t i = task / d.heads, h = task % d.heads, g = h / group;
      AttendRow(q_rot + i * qd + h * hd, k_rot, v, FirstKey(starts[i], rows[i], window), rows[i], kvd, g, hd, scale, p,
                attn + i * qd + h * hd, lse + i * d.heads + h);
    }
  });
}

template <typename R>
void AttentionBackwardRows(const DecoderDims& d, const TokenGeometry& full, int64_t window, const int64_t* rows,
                           int64_t n, const R* q_rot, const R* k_rot, const R* v, const R* attn, const R* lse,
                           const R* dattn, R* dq, R* dk, R* dv, CpuWorkerPool* pool) {
  const int64_t T = full.num_tokens, hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(d.AttentionScale());
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
          AttendRowBackward(q_rot + at, attn + at, dattn + at, lse[i * d.heads + h], k_rot, v,
                            FirstKey(starts[i], rows[i], window), rows[i], kvd, kvh, hd, scale, dq_acc, dk, dv,
                            dq + at);
        }
      }
    }
  });
}

namespace {

// Context parallelism (TokenGeometry::context): gather the group's keys and values, attend the local
// queries over them; backward returns each rank its tokens' dk and dv summed over the group.

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

void ContextAttentionForward(const DecoderDims& d, const TokenGeometry& geom, int64_t window, const float* q_rot,
                             const float* k_rot, const float* v, float* attn, float* lse, CpuWorkerPool* pool) {
  const ContextGeometry& c = *geom.context;
  std::vector<float> k_full, v_full;
  if (!GatherKeysValues(d, geom, k_rot, v, &k_full, &v_full)) {
    std::fill(attn, attn + geom.num_tokens * d.q_dim(), std::numeric_limits<float>::quiet_NaN());
    std::fill(lse, lse + geom.num_tokens * d.heads, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  AttentionForwardRows(d, WholeGeometry(c), window, c.global_index, geom.num_tokens, q_rot, k_full.data(),
                       v_full.data(), attn, lse, pool);
}

void ContextAttentionBackward(const DecoderDims& d, const TokenGeometry& geom, int64_t window, const float* q_rot,
                              const float* k_rot, const float* v, const float* attn, const float* lse,
                              const float* dattn, float* dq, float* dk, float* dv, CpuWorkerPool* pool) {
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
  AttentionBackwardRows(d, WholeGeometry(c), window, c.global_index, n, q_rot, k_full.data(), v_full.data(), attn, lse,
                        dattn, dq, dk_full.data(), dv_full.data(), pool);
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
void AttentionForward(const DecoderDims& d, const TokenGeometry& geom, int64_t window, const R* q_rot, const R* k_rot,
                      const R* v, R* attn, R* lse, CpuWorkerPool* pool) {
  if constexpr (std::is_same_v<R, float>) {
    if (geom.context != nullptr) return ContextAttentionForward(d, geom, window, q_rot, k_rot, v, attn, lse, pool);
  }
  const int64_t hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(d.AttentionScale());
  // One task per (document, query head): disjoint output rows.
  ParallelRanges(pool, geom.num_docs * d.heads, 1, [&](int64_t i0, int64_t i1) {
    std::vector<R> p;
    for (int64_t task = i0; task < i1; ++task) {
      const int64_t doc = task / d.heads, h = task % d.heads, g = h / group;
      const int64_t s = geom.cu_seqlens[doc], e = geom.cu_seqlens[doc + 1];
      for (int64_t t = s; t < e; ++t) {
        AttendRow(q_rot + t * qd + h * hd, k_rot, v, FirstKey(s, t, window), t, kvd, g, hd, scale, p,
                  attn + t * qd + h * hd, lse + t * d.heads + h);
      }
    }
  });
}

template <typename R>
void AttentionBackward(const DecoderDims& d, const TokenGeometry& geom, int64_t window, const R* q_rot, const R* k_rot,
                       const R* v, const R* attn, const R* lse, const R* dattn, R* dq, R* dk, R* dv,
                       CpuWorkerPool* pool) {
  if constexpr (std::is_same_v<R, float>) {
    if (geom.context != nullptr) {
      return ContextAttentionBackward(d, geom, window, q_rot, k_rot, v, attn, lse, dattn, dq, dk, dv, pool);
    }
  }
  const int64_t T = geom.num_tokens, hd = d.head_dim, qd = d.q_dim(), kvd = d.kv_dim();
  const int64_t group = d.heads / d.kv_heads;
  const R scale = static_cast<R>(d.AttentionScale());
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
          AttendRowBackward(q_rot + at, attn + at, dattn + at, lse[t * d.heads + h], k_rot, v, FirstKey(s, t, window),
                            t, kvd, kvh, hd, scale, dq_acc, dk, dv, dq + at);
        }
      }
    }
  });
}

#define SLIDEDP_INSTANTIATE_ATTENTION(R)                                                                              \
  template void AttentionForward<R>(const DecoderDims&, const TokenGeometry&, int64_t, const R*, const R*, const R*,  \
                                    R*, R*, CpuWorkerPool*);                                                          \
  template void AttentionBackward<R>(const DecoderDims&, const TokenGeometry&, int64_t, const R*, const R*, const R*, \
                                     const R*, const R*, const R*, R*, R*, R*, CpuWorkerPool*);                       \
  template void AttentionForwardRows<R>(const DecoderDims&, const TokenGeometry&, int64_t, const int64_t*, int64_t,   \
                                        const R*, const R*, const R*, R*, R*, CpuWorkerPool*);                        \
  template void AttentionBackwardRows<R>(const DecoderDims&, const TokenGeometry&, int64_t, const int64_t*, int64_t,  \
                                         const R*, const R*, const R*, const R*, const R*, const R*, R*, R*, R*,      \
                                         CpuWorkerPool*);

SLIDEDP_INSTANTIATE_ATTENTION(float)
SLIDEDP_INSTANTIATE_ATTENTION(double)

}  // namespace slidedp
