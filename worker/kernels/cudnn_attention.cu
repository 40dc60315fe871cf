// cuDNN fused attention: the plan cache, the per-call varlen preparation and execution; see
// cudnn_attention.h for the contract and the varlen mapping. The library is loaded by
// cudnn_loader.cc and the graphs are built by cudnn_attention_graph.cc. A .cu file rather than .cc:
// it holds two tiny kernels (cu_seqlens -> per-entry lengths and ragged offsets; LSE layout).
#include "worker/kernels/cudnn_attention.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/status/status_macros.h"
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/cudnn_attention_graph.h"
#include "worker/kernels/cudnn_loader.h"
#include "worker/kernels/reductions.h"

namespace slidedp::kernels {

#ifndef SLIDEDP_HAVE_CUDNN_GRAPH_H
// Built without cuDNN headers: every call reports UNAVAILABLE and callers use the own kernels.
struct CudnnAttention::Impl {};
CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnAttention::~CudnnAttention() = default;
absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(int) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
int64_t CudnnAttention::version() const { return 0; }
void CudnnAttention::set_options(const CudnnAttentionOptions&) {}
int CudnnAttention::cached_plans(bool) const { return 0; }
absl::StatusOr<int64_t> CudnnAttention::ForwardWorkspaceBytes(const AttnArgs&, const AttnRowStrides&) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
absl::StatusOr<int64_t> CudnnAttention::BackwardWorkspaceBytes(const AttnArgs&, const AttnRowStrides&) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
absl::Status CudnnAttention::Forward(const AttnArgs&, AttnTensor, AttnTensor, AttnTensor, AttnOutTensor, float*, void*,
                                     cudaStream_t) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
absl::Status CudnnAttention::Backward(const AttnArgs&, AttnTensor, AttnTensor, AttnTensor, AttnTensor, const float*,
                                      AttnTensor, AttnOutTensor, AttnOutTensor, AttnOutTensor, void*, cudaStream_t) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
absl::Status CudnnAttention::BackwardCross(const AttnArgs&, AttnTensor, AttnTensor, AttnTensor, AttnTensor,
                                           const float*, AttnTensor, AttnOutTensor, float*, float*, int64_t, void*,
                                           cudaStream_t) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
#else

using namespace cudnn_internal;  // cudnn_loader.h, cudnn_attention_graph.h

namespace {

using bf16 = __nv_bfloat16;

int64_t NextPow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// ---------------------------------------------------------------- kernels and workspace
// Per-entry lengths and ragged offsets from cu_seqlens, relative to its first entry (a group of
// documents starts at its own first row). Entries past num_docs are empty and start at the end.
struct VarlenArgs {
  const int32_t* cu_seqlens;
  int num_docs;
  int b;
  int32_t* seqlen;   // [b]
  int32_t* offsets;  // [num_arrays][pitch]
  int64_t pitch;
  int num_arrays;
  int64_t mult[kNumOffsets];  // elements per token of each tensor
};

__global__ void VarlenPrepKernel(VarlenArgs p) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i > p.b) return;
  const int64_t base = p.cu_seqlens[0];
  const int64_t total = p.cu_seqlens[p.num_docs] - base;
  const int64_t start = i <= p.num_docs ? p.cu_seqlens[i] - base : total;
  if (i < p.b) p.seqlen[i] = i < p.num_docs ? static_cast<int32_t>(p.cu_seqlens[i + 1] - base - start) : 0;
  for (int j = 0; j < p.num_arrays; ++j) p.offsets[j * p.pitch + i] = static_cast<int32_t>(start * p.mult[j]);
}

// [T, nq] (cuDNN's ragged stats) -> [nq, T] of our LSE, whose heads are `ld` apart, and back.
__global__ void LseTokenToHeadKernel(const float* __restrict__ src, int64_t tokens, int nq, float* __restrict__ dst,
                                     int64_t ld) {
  const int64_t n = tokens * nq;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = i / tokens, t = i % tokens;
    dst[h * ld + t] = src[t * nq + h];
  }
}
__global__ void LseHeadToTokenKernel(const float* __restrict__ src, int64_t ld, int64_t tokens, int nq,
                                     float* __restrict__ dst) {
  const int64_t n = tokens * nq;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / nq, h = i % nq;
    dst[i] = src[h * ld + t];
  }
}

// A cross piece's two lengths (one dense entry: seq_q, seq_kv).
__global__ void CrossLengthsKernel(int32_t* seq_q, int32_t len_q, int32_t* seq_kv, int32_t len_kv) {
  *seq_q = len_q;
  *seq_kv = len_kv;
}

int GridFor(int64_t n) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 8))); }
int64_t Align256(int64_t x) { return (x + 255) / 256 * 256; }

// Workspace: [cuDNN plan | seqlen | seqlen_kv | offsets | stats scratch | softmax_sum | dQ
// accumulator | a cross piece's dK, dV].
struct WsLayout {
  int64_t seqlen = 0, seqlen_kv = 0, offsets = 0, stats = 0, softmax_sum = 0, dq_accum = 0, dk = 0, dv = 0, total = 0;
  int64_t offsets_pitch = 0;
};

WsLayout LayoutFor(const PlanKey& k, int64_t tokens, int64_t plan_bytes, const BwdVariant& var) {
  WsLayout w;
  int64_t at = Align256(plan_bytes);
  w.seqlen = at;
  at += Align256(k.b * 4);
  w.seqlen_kv = at;
  at += Align256(k.b * 4);
  w.offsets_pitch = Align256((k.b + 1) * 4) / 4;
  w.offsets = at;
  at += kNumOffsets * w.offsets_pitch * 4;
  w.stats = at;
  at += Align256(tokens * k.nq * 4);
  if (k.direction == Direction::kBackward) {
    const bool ragged_acc = var.ragged_accumulators && k.ragged;
    w.softmax_sum = at;
    at += Align256(ragged_acc ? tokens * k.nq * 4 : k.b * k.nq * k.s * 4);
    w.dq_accum = at;
    at += Align256(ragged_acc ? ((tokens - 1) * k.ld.dq + k.nq * k.hd) * 4 : k.b * k.nq * k.s * k.hd * 4);
    if (k.s_kv > 0) {  // cross: dK, dV [s_kv, ld] BF16 each, added into the caller's FP32 afterwards
      w.dk = at;
      at += Align256(k.s_kv * k.ld.dk * 2);
      w.dv = at;
      at += Align256(k.s_kv * k.ld.dv * 2);
    }
  }
  w.total = at;
  return w;
}

}  // namespace

// ---------------------------------------------------------------- CudnnAttention
namespace {

// One cuDNN execution of a call: documents [d0, d1) at rows [t0, t1), ragged or one dense entry.
struct Piece {
  int64_t t0 = 0, t1 = 0;
  int d0 = 0, d1 = 0;
  int max_len = 0;
  bool dense = false;
};

int64_t MaxLd(const AttnRowStrides& ld, int64_t nq) {
  return std::max({ld.q, ld.k, ld.v, ld.o, ld.dout, ld.dq, ld.dk, ld.dv, nq});
}

// The pieces of one call (cudnn_attention.h, "Long calls").
absl::StatusOr<std::vector<Piece>> PiecesOf(const AttnArgs& a, const AttnRowStrides& ld,
                                            const CudnnAttentionOptions& opt) {
  const int64_t max_ld = MaxLd(ld, a.num_q_heads);
  const auto fits = [&](int64_t tokens) { return tokens * max_ld < opt.ragged_offset_limit; };
  if (a.num_docs == 1 && ((opt.dense_single_document && a.tokens >= opt.dense_min_tokens) || !fits(a.tokens)))
    return std::vector<Piece>{{0, a.tokens, 0, 1, static_cast<int>(a.tokens), true}};
  if (fits(a.tokens)) return std::vector<Piece>{{0, a.tokens, 0, a.num_docs, a.max_seqlen, false}};
  if (a.cu_seqlens_host == nullptr) {
    return absl::UnimplementedError(absl::StrCat("cudnn attention: ", a.tokens, " tokens of ", a.num_docs,
                                                 " documents exceed INT32 ragged offsets (row stride ", max_ld,
                                                 ") and the call has no host copy of cu_seqlens to group them"));
  }
  const int32_t* cu = a.cu_seqlens_host;
  std::vector<Piece> out;
  Piece group;
  const auto flush = [&] {
    if (group.d1 > group.d0) out.push_back(group);
  };
  for (int d = 0; d < a.num_docs; ++d) {
    const int64_t start = cu[d], end = cu[d + 1], len = end - start;
    if (!fits(len)) {  // alone, densely
      flush();
      out.push_back({start, end, d, d + 1, static_cast<int>(len), true});
      group = Piece{end, end, d + 1, d + 1, 0, false};
      continue;
    }
    if (!fits(end - group.t0)) {
      flush();
      group = Piece{start, start, d, d, 0, false};
    }
    group.t1 = end;
    group.d1 = d + 1;
    group.max_len = std::max<int>(group.max_len, static_cast<int>(len));
  }
  flush();
  return out;
}

// One query piece of a cross call: its queries [q0, q1) and keys [kv0, kv1) of the gathered whole.
struct CrossPiece {
  int64_t q0 = 0, q1 = 0, kv0 = 0, kv1 = 0;
};

// The non-empty query pieces of a cross call (cudnn_attention.h, "Cross attention").
absl::StatusOr<std::vector<CrossPiece>> CrossPiecesOf(const AttnArgs& a, const CudnnAttentionOptions& opt) {
  if (!opt.cross) return absl::UnimplementedError("cudnn attention: cross attention is off (options.cross)");
  if (a.cu_seqlens_host == nullptr || a.kv_bounds_host == nullptr) {
    return absl::UnimplementedError("cudnn attention: a cross call needs host copies of cu_seqlens and kv_bounds");
  }
  std::vector<CrossPiece> out;
  for (int d = 0; d < a.num_docs; ++d) {
    const CrossPiece p{a.cu_seqlens_host[d], a.cu_seqlens_host[d + 1], a.kv_bounds_host[2 * d],
                       a.kv_bounds_host[2 * d + 1]};
    const int64_t len_q = p.q1 - p.q0, len_kv = p.kv1 - p.kv0;
    if (p.q0 < 0 || len_q < 0 || p.q1 > a.tokens || p.kv0 < 0 || p.kv1 > a.kv_tokens ||
        (len_q > 0 && len_kv < len_q)) {
      return absl::InvalidArgumentError(absl::StrCat("cudnn attention: cross piece ", d, " has queries [", p.q0, ", ",
                                                     p.q1, ") of ", a.tokens, " and keys [", p.kv0, ", ", p.kv1,
                                                     ") of ", a.kv_tokens));
    }
    if (len_q == 0) continue;
    if (len_q < opt.cross_min_tokens) {
      return absl::UnimplementedError(absl::StrCat("cudnn attention: a cross piece of ", len_q,
                                                   " queries, under cross_min_tokens ", opt.cross_min_tokens));
    }
    out.push_back(p);
  }
  return out;
}

}  // namespace

struct CudnnAttention::Impl {
  const CudnnApi* api = nullptr;
  int device = 0;
  absl::Mutex mu;
  cudnnHandle_t handle ABSL_GUARDED_BY(mu) = nullptr;
  std::map<PlanKey, std::unique_ptr<Plan>> plans ABSL_GUARDED_BY(mu);
  CudnnAttentionOptions options ABSL_GUARDED_BY(mu);
  uint64_t stamp ABSL_GUARDED_BY(mu) = 0;  // one per public call: plans it used are not evicted

  ~Impl() {
    absl::MutexLock lock(&mu);
    plans.clear();  // plans before the handle they were built with
    if (handle != nullptr) api->Destroy(handle);
  }

  static absl::Status CheckArgs(const AttnArgs& a) {
    if (a.head_dim <= 0 || a.head_dim % 8 != 0 || a.head_dim > 256 || a.num_q_heads <= 0 || a.num_kv_heads <= 0 ||
        a.num_q_heads % a.num_kv_heads != 0 || a.num_docs <= 0 || a.max_seqlen <= 0 || a.cu_seqlens == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("cudnn attention: bad arguments head_dim=", a.head_dim,
                                                     " heads=", a.num_q_heads, "/", a.num_kv_heads,
                                                     " docs=", a.num_docs, " max_seqlen=", a.max_seqlen));
    }
    // What the graphs do not build: attention sinks, the output's low half, a window in a cross
    // (bottom-right) call.
    if (a.sinks != nullptr) return absl::UnimplementedError("cudnn attention: attention sinks");
    if (a.o_lo != nullptr) return absl::UnimplementedError("cudnn attention: the output's low half (AttnArgs::o_lo)");
    if (a.cross() && a.window > 0 && a.window < a.max_seqlen_kv) {
      return absl::UnimplementedError("cudnn attention: a sliding window in cross attention");
    }
    return absl::OkStatus();
  }

  PlanKey KeyFor(const AttnArgs& a, const AttnRowStrides& ld, Direction direction, const Piece& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    PlanKey k;
    k.direction = direction;
    k.ragged = !p.dense;
    k.padding = k.ragged || options.dense_padding_mask;
    k.engine = options.engine;
    k.b = p.dense ? 1 : NextPow2(p.d1 - p.d0);
    k.s = p.dense ? p.t1 - p.t0 : std::max<int64_t>(64, NextPow2(p.max_len));
    k.nq = a.num_q_heads;
    k.nkv = a.num_kv_heads;
    k.hd = a.head_dim;
    k.ld = ld;
    // A window shorter than the piece's rows bounds the band on the left (else it is the causal mask's).
    if (a.window > 0 && a.window < (p.dense ? k.s : p.max_len)) k.window = a.window;
    if (direction == Direction::kForward) k.ld.dout = k.ld.dq = k.ld.dk = k.ld.dv = 0;
    return k;
  }

  // A cross piece's dense plan: B = 1, its own lengths, bottom-right causal; dK / dV in the
  // workspace's scratch at the key side's width.
  PlanKey CrossKeyFor(const AttnArgs& a, const AttnRowStrides& ld, Direction direction, const CrossPiece& p) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    PlanKey k;
    k.direction = direction;
    k.ragged = false;
    k.padding = true;  // the lengths the bottom-right diagonal is placed by
    k.bottom_right = true;
    k.engine = options.engine;
    k.b = 1;
    k.s = p.q1 - p.q0;
    k.s_kv = p.kv1 - p.kv0;
    k.nq = a.num_q_heads;
    k.nkv = a.num_kv_heads;
    k.hd = a.head_dim;
    k.ld = ld;
    k.ld.dk = k.ld.dv = static_cast<int64_t>(a.num_kv_heads) * a.head_dim;
    if (direction == Direction::kForward) k.ld.dout = k.ld.dq = k.ld.dk = k.ld.dv = 0;
    return k;
  }

  absl::StatusOr<const Plan*> GetPlan(const PlanKey& k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = plans.find(k);
    if (it != plans.end()) {
      it->second->last_use = stamp;
      return it->second.get();
    }
    absl::StatusOr<std::unique_ptr<Plan>> p =
        k.direction == Direction::kBackward ? BuildBackward(*api, handle, k) : BuildForward(*api, handle, k);
    if (!p.ok()) return p.status();
    (*p)->last_use = stamp;
    const Plan* out = p->get();
    plans.emplace(k, std::move(*p));
    if (!k.ragged) EvictDensePlans();
    return out;
  }

  // Keeps at most kMaxDensePlans dense plans: the least recently used go, never one this call used.
  // A plan's engine may own the module its queued kernels run from, so the device is drained first
  // (rare: a job meets this only past kMaxDensePlans distinct long one-document lengths).
  void EvictDensePlans() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    bool drained = false;
    for (;;) {
      int dense = 0;
      auto oldest = plans.end();
      for (auto it = plans.begin(); it != plans.end(); ++it) {
        if (it->first.ragged) continue;
        ++dense;
        if (it->second->last_use < stamp && (oldest == plans.end() || it->second->last_use < oldest->second->last_use))
          oldest = it;
      }
      if (dense <= CudnnAttention::kMaxDensePlans || oldest == plans.end()) return;
      if (!drained) {
        drained = true;
        if (cudaDeviceSynchronize() != cudaSuccess) return;  // keep the plans; the error surfaces later
      }
      plans.erase(oldest);
    }
  }

  // Workspace bytes of one call (the largest piece's): builds (and caches) the pieces' plans.
  absl::StatusOr<int64_t> WorkspaceBytes(const AttnArgs& a, const AttnRowStrides& ld, Direction direction) {
    RETURN_IF_ERROR(CheckArgs(a));
    absl::MutexLock lock(&mu);
    int64_t most = 0;
    if (a.cross()) {
      ++stamp;
      ASSIGN_OR_RETURN(std::vector<CrossPiece> pieces, CrossPiecesOf(a, options));
      for (const CrossPiece& p : pieces) {
        const PlanKey k = CrossKeyFor(a, ld, direction, p);
        ASSIGN_OR_RETURN(const Plan* plan, GetPlan(k));
        most = std::max(most, LayoutFor(k, k.s, plan->workspace_bytes, BwdVariantFor(api->version)).total);
      }
      return most;
    }
    ASSIGN_OR_RETURN(std::vector<Piece> pieces, BeginCall(a, ld));
    for (const Piece& p : pieces) {
      const PlanKey k = KeyFor(a, ld, direction, p);
      ASSIGN_OR_RETURN(const Plan* plan, GetPlan(k));
      most = std::max(most, LayoutFor(k, p.t1 - p.t0, plan->workspace_bytes, BwdVariantFor(api->version)).total);
    }
    return most;
  }

  // The pieces of a call about to run (a new stamp: the plans it uses stay cached through it).
  absl::StatusOr<std::vector<Piece>> BeginCall(const AttnArgs& a, const AttnRowStrides& ld)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    if (a.window > 0 && a.window < a.max_seqlen && !options.window_mask) {
      return absl::UnimplementedError("cudnn attention: a sliding window (CudnnAttentionOptions::window_mask is off)");
    }
    ++stamp;
    return PiecesOf(a, ld, options);
  }

  // One piece's plan and workspace layout, its lengths and offsets written; direct: a dense piece
  // that is the whole call, whose stats ([nq, rows]) are the LSE itself.
  struct PieceRun {
    PlanKey key;
    const Plan* plan = nullptr;
    WsLayout w;
    int64_t rows = 0;
    bool direct = false;
  };
  absl::StatusOr<PieceRun> StartPiece(const AttnArgs& a, const AttnRowStrides& ld, Direction direction,
                                      const Piece& p, char* base, cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ASSIGN_OR_RETURN(PieceRun r, PlanPiece(a, KeyFor(a, ld, direction, p), p.t1 - p.t0));
    RETURN_IF_ERROR(PrepareVarlen(a, p, r.key, r.w, base, stream));
    return r;
  }
  // The plan and workspace layout of a piece of `rows` queries under `key`.
  absl::StatusOr<PieceRun> PlanPiece(const AttnArgs& a, const PlanKey& key, int64_t rows)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    PieceRun r;
    r.key = key;
    ASSIGN_OR_RETURN(r.plan, GetPlan(key));
    r.rows = rows;
    r.w = LayoutFor(key, rows, r.plan->workspace_bytes, BwdVariantFor(api->version));
    r.direct = !key.ragged && rows == a.tokens;
    return r;
  }

  // Writes lengths and offsets of piece `p` (relative to its first row) into the workspace.
  absl::Status PrepareVarlen(const AttnArgs& a, const Piece& p, const PlanKey& k, const WsLayout& w, char* ws,
                             cudaStream_t stream) {
    VarlenArgs v{};
    v.cu_seqlens = a.cu_seqlens + p.d0;
    v.num_docs = p.d1 - p.d0;
    v.b = static_cast<int>(k.b);
    v.seqlen = reinterpret_cast<int32_t*>(ws + w.seqlen);
    v.offsets = reinterpret_cast<int32_t*>(ws + w.offsets);
    v.pitch = w.offsets_pitch;
    v.num_arrays = kNumOffsets;
    v.mult[kOffQ] = k.ld.q;
    v.mult[kOffK] = k.ld.k;
    v.mult[kOffV] = k.ld.v;
    v.mult[kOffO] = k.ld.o;
    v.mult[kOffStats] = k.nq;
    v.mult[kOffDO] = k.ld.dout;
    v.mult[kOffDQ] = k.ld.dq;
    v.mult[kOffDK] = k.ld.dk;
    v.mult[kOffDV] = k.ld.dv;
    VarlenPrepKernel<<<static_cast<int>((k.b + 1 + 127) / 128), 128, 0, stream>>>(v);
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    return absl::OkStatus();
  }

  absl::Status Execute(const Plan& plan, std::vector<int64_t>& uids, std::vector<void*>& ptrs, void* ws,
                       cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    cudnnStatus_t st = api->SetStream(handle, stream);
    if (st != CUDNN_STATUS_SUCCESS) return CudnnError(*api, st, "set stream", Phase::kRun);
    cudnnBackendDescriptor_t vp = nullptr;
    st = api->CreateDescriptor(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR, &vp);
    if (st != CUDNN_STATUS_SUCCESS) return CudnnError(*api, st, "create variant pack", Phase::kRun);
    Desc owned(api, vp);
    const int64_t n = static_cast<int64_t>(uids.size());
    st = api->SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, n, uids.data());
    if (st == CUDNN_STATUS_SUCCESS)
      st = api->SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, n, ptrs.data());
    if (st == CUDNN_STATUS_SUCCESS)
      st = api->SetAttribute(vp, CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &ws);
    if (st == CUDNN_STATUS_SUCCESS) st = api->Finalize(vp);
    if (st != CUDNN_STATUS_SUCCESS) return CudnnError(*api, st, "variant pack", Phase::kRun);
    st = api->Execute(handle, plan.plan, vp);
    if (st != CUDNN_STATUS_SUCCESS) return CudnnError(*api, st, "execute", Phase::kRun);
    return absl::OkStatus();
  }

  // Binds the lengths and offsets a piece's plan has.
  static void BindVarlen(const PlanKey& k, const WsLayout& w, char* base, int num_offsets, std::vector<int64_t>& uids,
                         std::vector<void*>& ptrs) {
    if (k.padding) {
      uids.insert(uids.end(), {kUidSeqQ, kUidSeqKv});
      ptrs.insert(ptrs.end(), {base + w.seqlen, base + (k.s_kv > 0 ? w.seqlen_kv : w.seqlen)});
    }
    if (!k.ragged) return;
    int32_t* offsets = reinterpret_cast<int32_t*>(base + w.offsets);
    for (int i = 0; i < num_offsets; ++i) {
      uids.push_back(kUidOffsetBase + i);
      ptrs.push_back(offsets + i * w.offsets_pitch);
    }
  }

  // Where a piece's stats live: the LSE itself for a direct piece, else the workspace's scratch.
  static float* StatsOf(const PieceRun& run, const float* lse, char* base) {
    return run.direct ? const_cast<float*>(lse) : reinterpret_cast<float*>(base + run.w.stats);
  }

  // One forward execution: q, k, v, o at the piece's rows, the stats in the plan's layout.
  struct FwdTensors {
    const bf16 *q, *k, *v;
    bf16* o;
  };
  absl::Status RunForward(const AttnArgs& a, const PieceRun& run, const FwdTensors& t, float* stats, int num_offsets,
                          char* base, cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    float scale = a.softmax_scale, neg = std::numeric_limits<float>::lowest();
    float window = static_cast<float>(run.key.window);
    std::vector<int64_t> uids = {kUidQ, kUidK, kUidV, kUidO, kUidStats, kUidScale, kUidNegInf};
    std::vector<void*> ptrs = {const_cast<bf16*>(t.q), const_cast<bf16*>(t.k), const_cast<bf16*>(t.v), t.o, stats,
                               &scale, &neg};
    if (run.key.window > 0) uids.push_back(kUidWindow), ptrs.push_back(&window);
    BindVarlen(run.key, run.w, base, num_offsets, uids, ptrs);
    return Execute(*run.plan, uids, ptrs, base, stream);
  }

  // One backward execution: the eight tensors at the piece's rows (dk / dv: the caller's rows or
  // a cross piece's scratch), the stats in the plan's layout.
  struct BwdTensors {
    const bf16 *q, *k, *v, *o, *dout;
    void *dq, *dk, *dv;
  };
  absl::Status RunBackward(const AttnArgs& a, const PieceRun& run, const BwdTensors& t, float* stats, int num_offsets,
                           char* base, cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const WsLayout& w = run.w;
    if (BwdVariantFor(api->version).zero_dq_accum) {  // up to a cross piece's dK / dV scratch
      SLIDEDP_CUDA_RETURN_IF_ERROR(
          cudaMemsetAsync(base + w.dq_accum, 0, (w.dk > 0 ? w.dk : w.total) - w.dq_accum, stream));
    }
    float scale = a.softmax_scale, neg = std::numeric_limits<float>::lowest(), one = 1.0f;
    std::vector<int64_t> uids = {kUidQ,     kUidK,      kUidV,     kUidO,       kUidDO,
                                 kUidDQ,    kUidDK,     kUidDV,    kUidStats,   kUidScale,
                                 kUidNegInf, kUidOne,   kUidSoftmaxSum, kUidDqAccum};
    std::vector<void*> ptrs = {const_cast<bf16*>(t.q), const_cast<bf16*>(t.k),    const_cast<bf16*>(t.v),
                               const_cast<bf16*>(t.o), const_cast<bf16*>(t.dout), t.dq,
                               t.dk,                   t.dv,                      stats,
                               &scale,                 &neg,                      &one,
                               base + w.softmax_sum,   base + w.dq_accum};
    float window = static_cast<float>(run.key.window);
    if (run.key.window > 0) uids.push_back(kUidWindow), ptrs.push_back(&window);
    BindVarlen(run.key, w, base, num_offsets, uids, ptrs);
    return Execute(*run.plan, uids, ptrs, base, stream);
  }

  // One cross piece's plan and workspace layout, its lengths written; stats are the LSE itself when
  // the piece is the whole call.
  absl::StatusOr<PieceRun> StartCrossPiece(const AttnArgs& a, const AttnRowStrides& ld, Direction direction,
                                           const CrossPiece& p, char* base, cudaStream_t stream)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    ASSIGN_OR_RETURN(PieceRun r, PlanPiece(a, CrossKeyFor(a, ld, direction, p), p.q1 - p.q0));
    CrossLengthsKernel<<<1, 1, 0, stream>>>(reinterpret_cast<int32_t*>(base + r.w.seqlen), static_cast<int32_t>(r.rows),
                                            reinterpret_cast<int32_t*>(base + r.w.seqlen_kv),
                                            static_cast<int32_t>(p.kv1 - p.kv0));
    SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    return r;
  }

  // [nq, rows] stats of a dense piece <-> rows [t0, t0 + rows) of the [nq, tokens] LSE.
  static absl::Status StatsToLse(const float* stats, int64_t rows, int nq, float* lse, int64_t t0, int64_t tokens,
                                 cudaStream_t stream) {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(lse + t0, tokens * sizeof(float), stats, rows * sizeof(float),
                                                   rows * sizeof(float), nq, cudaMemcpyDeviceToDevice, stream));
    return absl::OkStatus();
  }
  static absl::Status LseToStats(const float* lse, int64_t t0, int64_t tokens, int64_t rows, int nq, float* stats,
                                 cudaStream_t stream) {
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemcpy2DAsync(stats, rows * sizeof(float), lse + t0, tokens * sizeof(float),
                                                   rows * sizeof(float), nq, cudaMemcpyDeviceToDevice, stream));
    return absl::OkStatus();
  }

  absl::Status CrossForward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o, float* lse,
                            char* base, cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const AttnRowStrides ld{q.ld, k.ld, v.ld, o.ld};
    ++stamp;
    ASSIGN_OR_RETURN(std::vector<CrossPiece> pieces, CrossPiecesOf(a, options));
    for (const CrossPiece& p : pieces) {
      ASSIGN_OR_RETURN(const PieceRun run, StartCrossPiece(a, ld, Direction::kForward, p, base, stream));
      float* stats = StatsOf(run, lse, base);
      RETURN_IF_ERROR(RunForward(
          a, run, {q.ptr + p.q0 * q.ld, k.ptr + p.kv0 * k.ld, v.ptr + p.kv0 * v.ld, o.ptr + p.q0 * o.ld}, stats, 0,
          base, stream));
      if (!run.direct) RETURN_IF_ERROR(StatsToLse(stats, run.rows, a.num_q_heads, lse, p.q0, a.tokens, stream));
    }
    return absl::OkStatus();
  }

  absl::Status CrossBackward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                             const float* lse, AttnTensor dout, AttnOutTensor dq, float* dk_acc, float* dv_acc,
                             int64_t ld_acc, char* base, cudaStream_t stream) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const AttnRowStrides ld{q.ld, k.ld, v.ld, o.ld, dout.ld, dq.ld, 0, 0};
    const int64_t kvd = static_cast<int64_t>(a.num_kv_heads) * a.head_dim;
    ++stamp;
    ASSIGN_OR_RETURN(std::vector<CrossPiece> pieces, CrossPiecesOf(a, options));
    for (const CrossPiece& p : pieces) {
      ASSIGN_OR_RETURN(const PieceRun run, StartCrossPiece(a, ld, Direction::kBackward, p, base, stream));
      const WsLayout& w = run.w;
      float* stats = StatsOf(run, lse, base);
      if (!run.direct) RETURN_IF_ERROR(LseToStats(lse, p.q0, a.tokens, run.rows, a.num_q_heads, stats, stream));
      RETURN_IF_ERROR(RunBackward(a, run,
                                  {q.ptr + p.q0 * q.ld, k.ptr + p.kv0 * k.ld, v.ptr + p.kv0 * v.ld, o.ptr + p.q0 * o.ld,
                                   dout.ptr + p.q0 * dout.ld, dq.ptr + p.q0 * dq.ld, base + w.dk, base + w.dv},
                                  stats, 0, base, stream));
      const int64_t rows_kv = p.kv1 - p.kv0;
      RETURN_IF_ERROR(AddRowsBf16ToF32(reinterpret_cast<const bf16*>(base + w.dk), kvd, rows_kv, kvd,
                                       dk_acc + p.kv0 * ld_acc, ld_acc, stream));
      RETURN_IF_ERROR(AddRowsBf16ToF32(reinterpret_cast<const bf16*>(base + w.dv), kvd, rows_kv, kvd,
                                       dv_acc + p.kv0 * ld_acc, ld_acc, stream));
    }
    return absl::OkStatus();
  }
};

CudnnAttention::CudnnAttention(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
CudnnAttention::~CudnnAttention() = default;

absl::StatusOr<std::unique_ptr<CudnnAttention>> CudnnAttention::Create(int device) {
  absl::StatusOr<const CudnnApi*> api = LoadCudnn();
  if (!api.ok()) return api.status();
  SLIDEDP_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  auto impl = std::make_unique<Impl>();
  impl->api = *api;
  impl->device = device;
  cudnnHandle_t handle = nullptr;
  cudnnStatus_t st = (*api)->Create(&handle);
  if (st != CUDNN_STATUS_SUCCESS) {
    absl::Status s = CudnnError(**api, st, "cudnnCreate");
    return absl::UnavailableError(s.message());
  }
  {
    absl::MutexLock lock(&impl->mu);
    impl->handle = handle;
  }
  return std::unique_ptr<CudnnAttention>(new CudnnAttention(std::move(impl)));
}

int64_t CudnnAttention::version() const { return impl_->api->version; }

void CudnnAttention::set_options(const CudnnAttentionOptions& options) {
  absl::MutexLock lock(&impl_->mu);
  impl_->options = options;
}

int CudnnAttention::cached_plans(bool dense_only) const {
  absl::MutexLock lock(&impl_->mu);
  int n = 0;
  for (const auto& [key, plan] : impl_->plans) n += !dense_only || !key.ragged;
  return n;
}

absl::StatusOr<int64_t> CudnnAttention::ForwardWorkspaceBytes(const AttnArgs& a, const AttnRowStrides& ld) {
  return impl_->WorkspaceBytes(a, ld, Direction::kForward);
}

absl::StatusOr<int64_t> CudnnAttention::BackwardWorkspaceBytes(const AttnArgs& a, const AttnRowStrides& ld) {
  return impl_->WorkspaceBytes(a, ld, Direction::kBackward);
}

absl::Status CudnnAttention::Forward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnOutTensor o,
                                     float* lse, void* ws, cudaStream_t stream) {
  AttnRowStrides ld;
  ld.q = q.ld;
  ld.k = k.ld;
  ld.v = v.ld;
  ld.o = o.ld;
  RETURN_IF_ERROR(Impl::CheckArgs(a));
  if (a.tokens <= 0) return absl::OkStatus();
  absl::MutexLock lock(&impl_->mu);
  char* base = static_cast<char*>(ws);
  if (a.cross()) return impl_->CrossForward(a, q, k, v, o, lse, base, stream);
  ASSIGN_OR_RETURN(std::vector<Piece> pieces, impl_->BeginCall(a, ld));
  for (const Piece& p : pieces) {
    ASSIGN_OR_RETURN(const Impl::PieceRun run, impl_->StartPiece(a, ld, Direction::kForward, p, base, stream));
    float* stats = Impl::StatsOf(run, lse, base);
    RETURN_IF_ERROR(impl_->RunForward(
        a, run, {q.ptr + p.t0 * q.ld, k.ptr + p.t0 * k.ld, v.ptr + p.t0 * v.ld, o.ptr + p.t0 * o.ld}, stats,
        kOffStats + 1, base, stream));
    if (run.direct) continue;
    if (run.key.ragged) {
      LseTokenToHeadKernel<<<GridFor(run.rows * a.num_q_heads), 256, 0, stream>>>(stats, run.rows, a.num_q_heads,
                                                                                   lse + p.t0, a.tokens);
      SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    } else {
      RETURN_IF_ERROR(Impl::StatsToLse(stats, run.rows, a.num_q_heads, lse, p.t0, a.tokens, stream));
    }
  }
  return absl::OkStatus();
}

absl::Status CudnnAttention::Backward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                      const float* lse, AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk,
                                      AttnOutTensor dv, void* ws, cudaStream_t stream) {
  const AttnRowStrides ld{q.ld, k.ld, v.ld, o.ld, dout.ld, dq.ld, dk.ld, dv.ld};
  RETURN_IF_ERROR(Impl::CheckArgs(a));
  if (a.cross()) return absl::InvalidArgumentError("cudnn attention: a cross call's backward is BackwardCross");
  if (a.tokens <= 0) return absl::OkStatus();
  absl::MutexLock lock(&impl_->mu);
  ASSIGN_OR_RETURN(std::vector<Piece> pieces, impl_->BeginCall(a, ld));
  char* base = static_cast<char*>(ws);
  for (const Piece& p : pieces) {
    ASSIGN_OR_RETURN(const Impl::PieceRun run, impl_->StartPiece(a, ld, Direction::kBackward, p, base, stream));
    float* stats = Impl::StatsOf(run, lse, base);  // a direct piece's is the LSE as it is
    if (!run.direct && run.key.ragged) {
      LseHeadToTokenKernel<<<GridFor(run.rows * a.num_q_heads), 256, 0, stream>>>(lse + p.t0, a.tokens, run.rows,
                                                                                  a.num_q_heads, stats);
      SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
    } else if (!run.direct) {
      RETURN_IF_ERROR(Impl::LseToStats(lse, p.t0, a.tokens, run.rows, a.num_q_heads, stats, stream));
    }
    RETURN_IF_ERROR(impl_->RunBackward(a, run,
                                       {q.ptr + p.t0 * q.ld, k.ptr + p.t0 * k.ld, v.ptr + p.t0 * v.ld,
                                        o.ptr + p.t0 * o.ld, dout.ptr + p.t0 * dout.ld, dq.ptr + p.t0 * dq.ld,
                                        dk.ptr + p.t0 * dk.ld, dv.ptr + p.t0 * dv.ld},
                                       stats, kNumOffsets, base, stream));
  }
  return absl::OkStatus();
}

absl::Status CudnnAttention::BackwardCross(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                           const float* lse, AttnTensor dout, AttnOutTensor dq, float* dk_acc,
                                           float* dv_acc, int64_t ld_acc, void* ws, cudaStream_t stream) {
  RETURN_IF_ERROR(Impl::CheckArgs(a));
  if (!a.cross()) return absl::InvalidArgumentError("cudnn attention: BackwardCross without kv_bounds");
  if (a.tokens <= 0) return absl::OkStatus();
  absl::MutexLock lock(&impl_->mu);
  return impl_->CrossBackward(a, q, k, v, o, lse, dout, dq, dk_acc, dv_acc, ld_acc, static_cast<char*>(ws), stream);
}

#endif  // SLIDEDP_HAVE_CUDNN_GRAPH_H

}  // namespace slidedp::kernels
