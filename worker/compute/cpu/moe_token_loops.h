// The per-token loops both MoE blocks of the CPU backend share (moe_reference_math.cc: Qwen3-MoE /
// Qwen3.5-MoE; gpt_oss_math.cc: GPT-OSS): combining the experts' rows into each token's output, the
// router's statistics, and gathering the experts' input gradients back per token. Each sums a
// token's rows in ascending expert order, so both blocks give the same bits for the same rows.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "worker/compute/cpu/cpu_worker_pool.h"
#include "worker/compute/cpu/moe_reference_math.h"

namespace slidedp::moe_loops {

// Tokens per parallel range of the per-token loops (router, combine): each token is cheap.
inline constexpr int64_t kMinTokensPerRange = 16;

template <typename R>
inline R DotSerial(const R* a, const R* b, int64_t n) {
  R acc = 0;
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// The grouped rows of token t (its k slots) in ascending row order, which is ascending expert
// order because rows are grouped expert by expert.
inline void RowsOfToken(const MoePermutation& perm, int64_t t, int64_t k, int64_t* rows) {
  std::copy_n(perm.row_of_slot.data() + t * k, k, rows);
  std::sort(rows, rows + k);
}

// p = softmax(z) over E values (max-subtracted, summed in order).
template <typename R>
void SoftmaxRow(const R* z, int64_t E, R* p) {
  R mx = z[0];
  for (int64_t e = 1; e < E; ++e) mx = std::max(mx, z[e]);
  R sum = 0;
  for (int64_t e = 0; e < E; ++e) {
    p[e] = std::exp(z[e] - mx);
    sum += p[e];
  }
  for (int64_t e = 0; e < E; ++e) p[e] = p[e] / sum;
}

// The k largest of v[0..E) by repeated arg-max, largest first; the strict '>' keeps the lower index
// on equal values (torch.topk's order here). `taken`: E scratch flags.
template <typename R>
void TopKByArgMax(const R* v, int64_t E, int64_t k, std::vector<char>& taken, int32_t* sel) {
  std::fill(taken.begin(), taken.end(), 0);
  for (int64_t j = 0; j < k; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e) {
      if (!taken[e] && (best < 0 || v[e] > v[best])) best = e;
    }
    taken[best] = 1;
    sel[j] = static_cast<int32_t>(best);
  }
}

// y[t] = sum of topk_weight * expert_out over the token's rows, in ascending expert order; then the
// router's statistics (expert counts, summed probabilities) into a->stats.
template <typename R>
void CombineAndRecord(const MoePermutation& perm, int64_t T, int64_t k, int64_t H, int64_t E, MoeActs<R>* a, R* y,
                      CpuWorkerPool* pool) {
  ParallelRanges(pool, T, kMinTokensPerRange, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> token_rows(k);
    for (int64_t t = t0; t < t1; ++t) {
      RowsOfToken(perm, t, k, token_rows.data());
      R* yr = y + t * H;
      std::fill(yr, yr + H, R(0));
      for (int64_t r : token_rows) {
        const R w = a->topk_weight[t * k + perm.slot_index[r]];
        const R* o = a->expert_out.data() + r * H;
        for (int64_t i = 0; i < H; ++i) yr[i] += o[i] * w;
      }
    }
  });
  MoeRouterStats& st = a->stats;
  st.num_tokens = T;
  st.expert_counts = perm.expert_counts;
  st.prob_sums.assign(E, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t e = 0; e < E; ++e) st.prob_sums[e] += static_cast<double>(a->router_probs[t * E + e]);
  }
}

// dx[t] = dx_acc[t] (the router's term) + the token's rows of dxg in ascending expert order.
template <typename R>
void GatherTokenGrads(const MoePermutation& perm, int64_t T, int64_t k, int64_t H, const R* dxg, R* dx_acc, R* dx,
                      CpuWorkerPool* pool) {
  ParallelRanges(pool, T, kMinTokensPerRange, [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> token_rows(k);
    for (int64_t t = t0; t < t1; ++t) {
      RowsOfToken(perm, t, k, token_rows.data());
      R* acc = dx_acc + t * H;
      for (int64_t r : token_rows) {
        const R* g = dxg + r * H;
        for (int64_t i = 0; i < H; ++i) acc[i] += g[i];
      }
      std::copy_n(acc, H, dx + t * H);
    }
  });
}

}  // namespace slidedp::moe_loops
