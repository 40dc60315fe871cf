// Qwen3-MoE block reference math: the router and the per-expert GEMMs over tokens grouped by
// expert, explicitly instantiated for float (backend) and double (gradient checks). The GEMMs are
// the dense Linear* ops, so threading and determinism are theirs. Limits: scalar C++, experts run
// one after another; meant for tiny models and oracles.
#include "worker/compute/cpu/moe_reference_math.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "common/status/status_macros.h"
#include "worker/compute/cpu/dense_reference_math.h"
#include "worker/compute/cpu/dense_reference_math_internal.h"
#include "worker/compute/cpu/gpt_oss_math.h"
#include "worker/compute/cpu/moe_token_loops.h"

namespace slidedp {
namespace {

using dense_math::SwiGlu;
using dense_math::SwiGluBackward;

using moe_loops::DotSerial;
using moe_loops::kMinTokensPerRange;
using moe_loops::RowsOfToken;

// Sum of the selected probabilities in slot order: the norm_topk_prob denominator, recomputed
// the same way in forward and backward.
template <typename R>
inline R SelectedProbSum(const R* probs_row, const int32_t* experts, int64_t k) {
  R s = 0;
  for (int64_t j = 0; j < k; ++j) s += probs_row[experts[j]];
  return s;
}

}  // namespace

MoeOffsets MoeOffsets::Stacked(const MoeDims& d) {
  const int64_t E = d.num_experts, H = d.hidden, I = d.intermediate;
  MoeOffsets o;
  o.router = 0;
  o.gate = E * H;
  o.up = o.gate + E * I * H;
  o.gate_up_expert_stride = I * H;
  o.down = o.up + E * I * H;
  o.down_expert_stride = H * I;
  o.block_numel = o.down + E * H * I;
  return o;
}

MoeDims MoeDims::Of(const ModelConfig& c) {
  MoeDims d;
  d.hidden = c.hidden_size;
  d.intermediate = c.moe_intermediate_size;
  d.num_experts = c.num_experts;
  d.top_k = c.num_experts_per_tok;
  d.norm_topk_prob = c.norm_topk_prob;
  d.gpt_oss = c.is_gpt_oss();
  return d;
}

MoeOffsets MoeOffsets::InUnit(const UnitLayout& unit) {
  MoeOffsets o;
  const TensorSlot* router = unit.Find(kRouter);
  if (!unit.sparse() || router == nullptr) return o;  // a dense unit: no block
  o.router = router->offset_numel;
  if (unit.experts.tensors_per_expert == kNumGptOssExpertTensors) {  // gpt_oss
    o.router_bias = unit.Find(kRouterBias)->offset_numel;
    o.gate = unit.FindExpert(0, kGptOssGateUp)->offset_numel;
    o.gate_up_bias = unit.FindExpert(0, kGptOssGateUpBias)->offset_numel;
    o.down = unit.FindExpert(0, kGptOssDown)->offset_numel;
    o.down_bias = unit.FindExpert(0, kGptOssDownBias)->offset_numel;
    o.gate_up_expert_stride = unit.ExpertNumel();
    o.down_expert_stride = unit.ExpertNumel();
    o.block_numel = unit.numel;
    return o;
  }
  o.gate = unit.FindExpert(0, kExpertGateProj)->offset_numel;
  o.up = unit.FindExpert(0, kExpertUpProj)->offset_numel;
  o.down = unit.FindExpert(0, kExpertDownProj)->offset_numel;
  o.gate_up_expert_stride = unit.ExpertNumel();
  o.down_expert_stride = unit.ExpertNumel();
  o.block_numel = unit.numel;
  return o;
}

MoeOffsets MoeOffsets::FusedGateUp(const MoeDims& d) {
  const int64_t E = d.num_experts, H = d.hidden, I = d.intermediate;
  MoeOffsets o;
  o.router = 0;
  o.gate = E * H;
  o.up = o.gate + I * H;
  o.gate_up_expert_stride = 2 * I * H;
  o.down = o.gate + E * 2 * I * H;
  o.down_expert_stride = H * I;
  o.block_numel = o.down + E * H * I;
  return o;
}

MoePermutation BuildMoePermutation(const int32_t* topk_expert, int64_t num_tokens, int64_t top_k,
                                   int64_t num_experts) {
  const int64_t rows = num_tokens * top_k;
  MoePermutation p;
  p.expert_counts.assign(num_experts, 0);
  for (int64_t i = 0; i < rows; ++i) ++p.expert_counts[topk_expert[i]];
  p.expert_offsets.assign(num_experts + 1, 0);
  for (int64_t e = 0; e < num_experts; ++e) p.expert_offsets[e + 1] = p.expert_offsets[e] + p.expert_counts[e];
  p.token_index.resize(rows);
  p.slot_index.resize(rows);
  p.row_of_slot.resize(rows);
  std::vector<int64_t> cursor(p.expert_offsets.begin(), p.expert_offsets.end() - 1);
  // Tokens in ascending order, so each expert's rows come out in token order (a token holds an
  // expert in at most one slot).
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t r = cursor[topk_expert[t * top_k + j]]++;
      p.token_index[r] = static_cast<int32_t>(t);
      p.slot_index[r] = static_cast<int32_t>(j);
      p.row_of_slot[t * top_k + j] = r;
    }
  }
  return p;
}

double LoadBalancingLoss(const std::vector<MoeRouterStats>& layers) {
  if (layers.empty()) return 0.0;
  const int64_t E = static_cast<int64_t>(layers[0].expert_counts.size());
  int64_t n = 0;
  std::vector<double> counts(E, 0.0), probs(E, 0.0);
  for (const MoeRouterStats& l : layers) {
    n += l.num_tokens;
    for (int64_t e = 0; e < E; ++e) {
      counts[e] += static_cast<double>(l.expert_counts[e]);
      probs[e] += l.prob_sums[e];
    }
  }
  if (n == 0) return 0.0;
  const double inv_n = 1.0 / static_cast<double>(n);
  double sum = 0.0;
  for (int64_t e = 0; e < E; ++e) sum += (counts[e] * inv_n) * (probs[e] * inv_n);
  return static_cast<double>(E) * sum;
}

std::vector<double> LoadBalancingProbGrad(const std::vector<MoeRouterStats>& layers, double coef) {
  if (layers.empty()) return {};
  const int64_t E = static_cast<int64_t>(layers[0].expert_counts.size());
  int64_t n = 0;
  std::vector<double> grad(E, 0.0);
  for (const MoeRouterStats& l : layers) {
    n += l.num_tokens;
    for (int64_t e = 0; e < E; ++e) grad[e] += static_cast<double>(l.expert_counts[e]);
  }
  if (n == 0) return grad;
  const double scale = coef * static_cast<double>(E) / (static_cast<double>(n) * static_cast<double>(n));
  for (double& g : grad) g *= scale;
  return grad;
}

absl::StatusOr<std::vector<MoeRouterStats>> SumRouterStatsOverGroup(const std::vector<MoeRouterStats>& mine,
                                                                    int64_t experts, int ranks,
                                                                    const GatherWords& gather) {
  const int64_t E = experts, L = static_cast<int64_t>(mine.size());
  if (ranks < 1 || E < 1) return absl::InvalidArgumentError("router statistics: no ranks or experts");
  const int64_t words = L * (1 + 2 * E);  // 8-byte words: tokens, counts, sums per layer
  std::vector<uint64_t> packed(words);
  for (int64_t l = 0; l < L; ++l) {
    if (static_cast<int64_t>(mine[l].expert_counts.size()) != E || static_cast<int64_t>(mine[l].prob_sums.size()) != E) {
      return absl::InvalidArgumentError("router statistics: a layer's arrays are not num_experts long");
    }
    uint64_t* w = packed.data() + l * (1 + 2 * E);
    w[0] = static_cast<uint64_t>(mine[l].num_tokens);
    for (int64_t e = 0; e < E; ++e) {
      w[1 + e] = static_cast<uint64_t>(mine[l].expert_counts[e]);
      std::memcpy(&w[1 + E + e], &mine[l].prob_sums[e], sizeof(double));
    }
  }
  std::vector<uint64_t> all(static_cast<size_t>(ranks) * words);
  RETURN_IF_ERROR(gather(packed.data(), words, all.data()));
  std::vector<MoeRouterStats> whole(L);
  for (int64_t l = 0; l < L; ++l) {
    whole[l].expert_counts.assign(E, 0);
    whole[l].prob_sums.assign(E, 0.0);
    for (int r = 0; r < ranks; ++r) {
      const uint64_t* w = all.data() + static_cast<int64_t>(r) * words + l * (1 + 2 * E);
      whole[l].num_tokens += static_cast<int64_t>(w[0]);
      for (int64_t e = 0; e < E; ++e) {
        whole[l].expert_counts[e] += static_cast<int64_t>(w[1 + e]);
        double v;
        std::memcpy(&v, &w[1 + E + e], sizeof(double));
        whole[l].prob_sums[e] += v;
      }
    }
  }
  return whole;
}

template <typename R>
void MoeRoute(const MoeDims& d, const MoeOffsets& offs, const R* params, const R* x, int64_t T, MoeActs<R>* a,
              CpuWorkerPool* pool) {
  const int64_t H = d.hidden, E = d.num_experts, k = d.top_k;
  a->router_logits.resize(T * E);
  a->router_probs.resize(T * E);
  a->topk_expert.resize(T * k);
  a->topk_weight.resize(T * k);
  LinearForward(x, params + offs.router, T, H, E, a->router_logits.data(), pool);
  ParallelRanges(pool, T, kMinTokensPerRange, [&](int64_t t0, int64_t t1) {
    std::vector<char> taken(E);
    for (int64_t t = t0; t < t1; ++t) {
      const R* z = a->router_logits.data() + t * E;
      R* p = a->router_probs.data() + t * E;
      moe_loops::SoftmaxRow(z, E, p);
      int32_t* sel = a->topk_expert.data() + t * k;
      moe_loops::TopKByArgMax(p, E, k, taken, sel);
      R* w = a->topk_weight.data() + t * k;
      const R s = d.norm_topk_prob ? SelectedProbSum(p, sel, k) : R(1);
      for (int64_t j = 0; j < k; ++j) w[j] = d.norm_topk_prob ? p[sel[j]] / s : p[sel[j]];
    }
  });
}

template <typename R>
void MoeBlockForward(const MoeDims& d, const MoeOffsets& offs, const R* params, const R* x, int64_t T, R* y,
                     MoeActs<R>* a, CpuWorkerPool* pool) {
  if (d.gpt_oss) return GptOssMoeForward(d, offs, params, x, T, y, a, pool);
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, k = d.top_k, rows = T * k;
  MoeRoute(d, offs, params, x, T, a, pool);
  a->perm = BuildMoePermutation(a->topk_expert.data(), T, k, E);
  const MoePermutation& perm = a->perm;

  // Grouped GEMMs: gate and up over each expert's gathered rows, then down on silu(gate) * up.
  std::vector<R> xg(rows * H);
  ParallelRanges(pool, rows, kMinTokensPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy_n(x + perm.token_index[r] * H, H, xg.data() + r * H);
  });
  a->gate.resize(rows * I);
  a->up.resize(rows * I);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = perm.expert_offsets[e], n = perm.expert_counts[e];
    if (n == 0) continue;
    LinearForward(xg.data() + r0 * H, params + offs.gate_at(e), n, H, I, a->gate.data() + r0 * I, pool);
    LinearForward(xg.data() + r0 * H, params + offs.up_at(e), n, H, I, a->up.data() + r0 * I, pool);
  }
  xg = {};
  std::vector<R> m(rows * I);
  SwiGlu(a->gate.data(), a->up.data(), rows * I, m.data());
  a->expert_out.resize(rows * H);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = perm.expert_offsets[e], n = perm.expert_counts[e];
    if (n == 0) continue;
    LinearForward(m.data() + r0 * I, params + offs.down_at(e), n, I, H, a->expert_out.data() + r0 * H, pool);
  }

  // Combine: y[t] = sum of w * expert_out over the token's rows in ascending expert order.
  moe_loops::CombineAndRecord(perm, T, k, H, E, a, y, pool);
}

template <typename R>
void MoeBlockBackward(const MoeDims& d, const MoeOffsets& offs, const R* params, const R* x, int64_t T,
                      const MoeActs<R>& a, const R* dy, const double* aux_prob_grad, R* dx, R* dparams,
                      CpuWorkerPool* pool) {
  if (d.gpt_oss) return GptOssMoeBackward(d, offs, params, x, T, a, dy, aux_prob_grad, dx, dparams, pool);
  const int64_t H = d.hidden, I = d.intermediate, E = d.num_experts, k = d.top_k, rows = T * k;
  const MoePermutation& perm = a.perm;

  // dL/dw[t, j] = dy[t] . expert_out, and the grouped down_proj output gradient w * dy[t]. These
  // are the last reads of dy, so dx may alias it.
  std::vector<R> dw(rows), dout(rows * H);
  ParallelRanges(pool, rows, kMinTokensPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t t = perm.token_index[r], j = perm.slot_index[r];
      const R* dyr = dy + t * H;
      dw[t * k + j] = DotSerial(dyr, a.expert_out.data() + r * H, H);
      const R w = a.topk_weight[t * k + j];
      for (int64_t i = 0; i < H; ++i) dout[r * H + i] = w * dyr[i];
    }
  });

  // Experts: y_e = m Wd^T with m = silu(gate) * up; gate = xg Wg^T, up = xg Wu^T.
  std::vector<R> m(rows * I), dm(rows * I);
  SwiGlu(a.gate.data(), a.up.data(), rows * I, m.data());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = perm.expert_offsets[e], n = perm.expert_counts[e];
    if (n == 0) continue;
    LinearBackwardWeight(dout.data() + r0 * H, m.data() + r0 * I, n, I, H, dparams + offs.down_at(e), pool);
    LinearBackwardInput(dout.data() + r0 * H, params + offs.down_at(e), n, I, H, dm.data() + r0 * I,
                        Accumulate::kOverwrite, pool);
  }
  m = {};
  dout = {};
  std::vector<R> dgate(rows * I), dup(rows * I);
  SwiGluBackward(a.gate.data(), a.up.data(), dm.data(), rows * I, dgate.data(), dup.data());
  dm = {};
  std::vector<R> xg(rows * H), dxg(rows * H);
  ParallelRanges(pool, rows, kMinTokensPerRange, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) std::copy_n(x + perm.token_index[r] * H, H, xg.data() + r * H);
  });
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = perm.expert_offsets[e], n = perm.expert_counts[e];
    if (n == 0) continue;
    LinearBackwardWeight(dgate.data() + r0 * I, xg.data() + r0 * H, n, H, I, dparams + offs.gate_at(e), pool);
    LinearBackwardWeight(dup.data() + r0 * I, xg.data() + r0 * H, n, H, I, dparams + offs.up_at(e), pool);
    LinearBackwardInput(dgate.data() + r0 * I, params + offs.gate_at(e), n, H, I, dxg.data() + r0 * H,
                        Accumulate::kOverwrite, pool);
    LinearBackwardInput(dup.data() + r0 * I, params + offs.up_at(e), n, H, I, dxg.data() + r0 * H, Accumulate::kAdd,
                        pool);
  }
  xg = {};
  dgate = {};
  dup = {};

  // Router: dL/dp from the routing weights (through the renormalisation w_j = p_j / s, whose
  // Jacobian gives (dw_j - sum_i dw_i w_i) / s; without it dp_j = dw_j), scattered to the selected
  // experts, plus the aux loss term on every probability; then softmax backward
  // dz = p * (dp - sum_e p_e dp_e).
  std::vector<R> aux(E, R(0));
  if (aux_prob_grad != nullptr) {
    for (int64_t e = 0; e < E; ++e) aux[e] = static_cast<R>(aux_prob_grad[e]);
  }
  std::vector<R> dz(T * E);
  ParallelRanges(pool, T, kMinTokensPerRange, [&](int64_t t0, int64_t t1) {
    std::vector<R> dp(E);
    for (int64_t t = t0; t < t1; ++t) {
      const R* p = a.router_probs.data() + t * E;
      const int32_t* sel = a.topk_expert.data() + t * k;
      const R* w = a.topk_weight.data() + t * k;
      const R* dwt = dw.data() + t * k;
      std::copy(aux.begin(), aux.end(), dp.begin());
      if (d.norm_topk_prob) {
        const R s = SelectedProbSum(p, sel, k);
        const R dw_dot_w = DotSerial(dwt, w, k);
        for (int64_t j = 0; j < k; ++j) dp[sel[j]] += (dwt[j] - dw_dot_w) / s;
      } else {
        for (int64_t j = 0; j < k; ++j) dp[sel[j]] += dwt[j];
      }
      const R p_dot_dp = DotSerial(p, dp.data(), E);
      for (int64_t e = 0; e < E; ++e) dz[t * E + e] = p[e] * (dp[e] - p_dot_dp);
    }
  });
  LinearBackwardWeight(dz.data(), x, T, H, E, dparams + offs.router, pool);
  std::vector<R> dx_acc(T * H);
  LinearBackwardInput(dz.data(), params + offs.router, T, H, E, dx_acc.data(), Accumulate::kOverwrite, pool);

  // dx = router term + the token's expert terms in ascending expert order.
  moe_loops::GatherTokenGrads(perm, T, k, H, dxg.data(), dx_acc.data(), dx, pool);
}

#define SLIDEDP_INSTANTIATE_MOE_REAL(R)                                                                             \
  template struct MoeActs<R>;                                                                                       \
  template void MoeRoute<R>(const MoeDims&, const MoeOffsets&, const R*, const R*, int64_t, MoeActs<R>*,            \
                            CpuWorkerPool*);                                                                        \
  template void MoeBlockForward<R>(const MoeDims&, const MoeOffsets&, const R*, const R*, int64_t, R*, MoeActs<R>*, \
                                   CpuWorkerPool*);                                                                 \
  template void MoeBlockBackward<R>(const MoeDims&, const MoeOffsets&, const R*, const R*, int64_t,                 \
                                    const MoeActs<R>&, const R*, const double*, R*, R*, CpuWorkerPool*);

SLIDEDP_INSTANTIATE_MOE_REAL(float)
SLIDEDP_INSTANTIATE_MOE_REAL(double)

}  // namespace slidedp
