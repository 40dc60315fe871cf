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
#include "worker/kernels/cuda_check.h"
#include "worker/kernels/cudnn_attention_graph.h"
#include "worker/kernels/cudnn_loader.h"

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
// Per-entry lengths and ragged offsets from cu_seqlens. Entries past num_docs are empty and
// start at the end of the buffer.
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
  const int64_t total = p.cu_seqlens[p.num_docs];
  const int64_t start = i <= p.num_docs ? p.cu_seqlens[i] : total;
  if (i < p.b) p.seqlen[i] = i < p.num_docs ? static_cast<int32_t>(p.cu_seqlens[i + 1] - start) : 0;
  for (int j = 0; j < p.num_arrays; ++j) p.offsets[j * p.pitch + i] = static_cast<int32_t>(start * p.mult[j]);
}

// [T, nq] (cuDNN's ragged stats) -> [nq, T] (our LSE), and back.
__global__ void LseTokenToHeadKernel(const float* __restrict__ src, int64_t tokens, int nq, float* __restrict__ dst) {
  const int64_t n = tokens * nq;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = i / tokens, t = i % tokens;
    dst[i] = src[t * nq + h];
  }
}
__global__ void LseHeadToTokenKernel(const float* __restrict__ src, int64_t tokens, int nq, float* __restrict__ dst) {
  const int64_t n = tokens * nq;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / nq, h = i % nq;
    dst[i] = src[h * tokens + t];
  }
}

int GridFor(int64_t n) { return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + 255) / 256, 132 * 8))); }
int64_t Align256(int64_t x) { return (x + 255) / 256 * 256; }

// Workspace: [cuDNN plan | seqlen | offsets | stats scratch | softmax_sum | dQ accumulator].
struct WsLayout {
  int64_t seqlen = 0, offsets = 0, stats = 0, softmax_sum = 0, dq_accum = 0, total = 0;
  int64_t offsets_pitch = 0;
};

WsLayout LayoutFor(const PlanKey& k, int64_t tokens, int64_t plan_bytes, const BwdVariant& var) {
  WsLayout w;
  int64_t at = Align256(plan_bytes);
  w.seqlen = at;
  at += Align256(k.b * 4);
  w.offsets_pitch = Align256((k.b + 1) * 4) / 4;
  w.offsets = at;
  at += kNumOffsets * w.offsets_pitch * 4;
  w.stats = at;
  at += Align256(tokens * k.nq * 4);
  if (k.direction == Direction::kBackward) {
    w.softmax_sum = at;
    at += Align256(var.ragged_accumulators ? tokens * k.nq * 4 : k.b * k.nq * k.s * 4);
    w.dq_accum = at;
    at += Align256(var.ragged_accumulators ? ((tokens - 1) * k.ld.dq + k.nq * k.hd) * 4 : k.b * k.nq * k.s * k.hd * 4);
  }
  w.total = at;
  return w;
}

}  // namespace

// ---------------------------------------------------------------- CudnnAttention
struct CudnnAttention::Impl {
  const CudnnApi* api = nullptr;
  int device = 0;
  absl::Mutex mu;
  cudnnHandle_t handle ABSL_GUARDED_BY(mu) = nullptr;
  std::map<PlanKey, std::unique_ptr<Plan>> plans ABSL_GUARDED_BY(mu);

  ~Impl() {
    absl::MutexLock lock(&mu);
    plans.clear();  // plans before the handle they were built with
    if (handle != nullptr) api->Destroy(handle);
  }

  static absl::StatusOr<PlanKey> KeyFor(const AttnArgs& a, const AttnRowStrides& ld, Direction direction) {
    if (a.head_dim <= 0 || a.head_dim % 8 != 0 || a.head_dim > 256 || a.num_q_heads <= 0 || a.num_kv_heads <= 0 ||
        a.num_q_heads % a.num_kv_heads != 0 || a.num_docs <= 0 || a.max_seqlen <= 0 || a.cu_seqlens == nullptr) {
      return absl::InvalidArgumentError(absl::StrCat("cudnn attention: bad arguments head_dim=", a.head_dim,
                                                     " heads=", a.num_q_heads, "/", a.num_kv_heads,
                                                     " docs=", a.num_docs, " max_seqlen=", a.max_seqlen));
    }
    PlanKey k;
    k.direction = direction;
    k.b = NextPow2(a.num_docs);
    k.s = std::max<int64_t>(64, NextPow2(a.max_seqlen));
    k.nq = a.num_q_heads;
    k.nkv = a.num_kv_heads;
    k.hd = a.head_dim;
    k.ld = ld;
    if (direction == Direction::kForward) k.ld.dout = k.ld.dq = k.ld.dk = k.ld.dv = 0;
    // Ragged offsets are INT32 elements: the largest is tokens · ld.
    const int64_t max_ld = std::max({ld.q, ld.k, ld.v, ld.o, ld.dout, ld.dq, ld.dk, ld.dv, k.nq});
    if (a.tokens * max_ld >= std::numeric_limits<int32_t>::max()) {
      return absl::UnimplementedError("cudnn attention: tokens · row stride exceeds INT32 ragged offsets");
    }
    return k;
  }

  absl::StatusOr<const Plan*> GetPlan(const PlanKey& k) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    auto it = plans.find(k);
    if (it != plans.end()) return it->second.get();
    absl::StatusOr<std::unique_ptr<Plan>> p =
        k.direction == Direction::kBackward ? BuildBackward(*api, handle, k) : BuildForward(*api, handle, k);
    if (!p.ok()) return p.status();
    const Plan* out = p->get();
    plans.emplace(k, std::move(*p));
    return out;
  }

  // Workspace bytes of one call: builds (and caches) its plan.
  absl::StatusOr<int64_t> WorkspaceBytes(const AttnArgs& a, const AttnRowStrides& ld, Direction direction) {
    absl::StatusOr<PlanKey> k = KeyFor(a, ld, direction);
    if (!k.ok()) return k.status();
    absl::MutexLock lock(&mu);
    absl::StatusOr<const Plan*> plan = GetPlan(*k);
    if (!plan.ok()) return plan.status();
    return LayoutFor(*k, a.tokens, (*plan)->workspace_bytes, BwdVariantFor(api->version)).total;
  }

  // Writes lengths and offsets for `k` into the workspace.
  absl::Status PrepareVarlen(const AttnArgs& a, const PlanKey& k, const WsLayout& w, char* ws, cudaStream_t stream) {
    VarlenArgs p{};
    p.cu_seqlens = a.cu_seqlens;
    p.num_docs = a.num_docs;
    p.b = static_cast<int>(k.b);
    p.seqlen = reinterpret_cast<int32_t*>(ws + w.seqlen);
    p.offsets = reinterpret_cast<int32_t*>(ws + w.offsets);
    p.pitch = w.offsets_pitch;
    p.num_arrays = kNumOffsets;
    p.mult[kOffQ] = k.ld.q;
    p.mult[kOffK] = k.ld.k;
    p.mult[kOffV] = k.ld.v;
    p.mult[kOffO] = k.ld.o;
    p.mult[kOffStats] = k.nq;
    p.mult[kOffDO] = k.ld.dout;
    p.mult[kOffDQ] = k.ld.dq;
    p.mult[kOffDK] = k.ld.dk;
    p.mult[kOffDV] = k.ld.dv;
    VarlenPrepKernel<<<static_cast<int>((k.b + 1 + 127) / 128), 128, 0, stream>>>(p);
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
  absl::StatusOr<PlanKey> key = Impl::KeyFor(a, ld, Direction::kForward);
  if (!key.ok()) return key.status();
  if (a.tokens <= 0) return absl::OkStatus();
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<const Plan*> plan = impl_->GetPlan(*key);
  if (!plan.ok()) return plan.status();
  const WsLayout w = LayoutFor(*key, a.tokens, (*plan)->workspace_bytes, BwdVariantFor(impl_->api->version));
  char* base = static_cast<char*>(ws);
  absl::Status s = impl_->PrepareVarlen(a, *key, w, base, stream);
  if (!s.ok()) return s;
  int32_t* offsets = reinterpret_cast<int32_t*>(base + w.offsets);
  float scale = a.softmax_scale, neg = std::numeric_limits<float>::lowest();
  float* stats = reinterpret_cast<float*>(base + w.stats);
  std::vector<int64_t> uids = {kUidQ, kUidK, kUidV, kUidO, kUidStats, kUidSeqQ, kUidSeqKv, kUidScale, kUidNegInf};
  std::vector<void*> ptrs = {const_cast<bf16*>(q.ptr),
                             const_cast<bf16*>(k.ptr),
                             const_cast<bf16*>(v.ptr),
                             o.ptr,
                             stats,
                             base + w.seqlen,
                             base + w.seqlen,
                             &scale,
                             &neg};
  for (int i = 0; i <= kOffStats; ++i) {
    uids.push_back(kUidOffsetBase + i);
    ptrs.push_back(offsets + i * w.offsets_pitch);
  }
  absl::Status run = impl_->Execute(**plan, uids, ptrs, base, stream);
  if (!run.ok()) return run;
  LseTokenToHeadKernel<<<GridFor(a.tokens * a.num_q_heads), 256, 0, stream>>>(stats, a.tokens, a.num_q_heads, lse);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  return absl::OkStatus();
}

absl::Status CudnnAttention::Backward(const AttnArgs& a, AttnTensor q, AttnTensor k, AttnTensor v, AttnTensor o,
                                      const float* lse, AttnTensor dout, AttnOutTensor dq, AttnOutTensor dk,
                                      AttnOutTensor dv, void* ws, cudaStream_t stream) {
  const AttnRowStrides ld{q.ld, k.ld, v.ld, o.ld, dout.ld, dq.ld, dk.ld, dv.ld};
  absl::StatusOr<PlanKey> key = Impl::KeyFor(a, ld, Direction::kBackward);
  if (!key.ok()) return key.status();
  if (a.tokens <= 0) return absl::OkStatus();
  absl::MutexLock lock(&impl_->mu);
  absl::StatusOr<const Plan*> plan = impl_->GetPlan(*key);
  if (!plan.ok()) return plan.status();
  const BwdVariant var = BwdVariantFor(impl_->api->version);
  const WsLayout w = LayoutFor(*key, a.tokens, (*plan)->workspace_bytes, var);
  char* base = static_cast<char*>(ws);
  absl::Status s = impl_->PrepareVarlen(a, *key, w, base, stream);
  if (!s.ok()) return s;
  float* stats = reinterpret_cast<float*>(base + w.stats);
  LseHeadToTokenKernel<<<GridFor(a.tokens * a.num_q_heads), 256, 0, stream>>>(lse, a.tokens, a.num_q_heads, stats);
  SLIDEDP_CUDA_RETURN_IF_LAUNCH_ERROR();
  if (var.zero_dq_accum)
    SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base + w.dq_accum, 0, w.total - w.dq_accum, stream));
  int32_t* offsets = reinterpret_cast<int32_t*>(base + w.offsets);
  float scale = a.softmax_scale, neg = std::numeric_limits<float>::lowest(), one = 1.0f;
  std::vector<int64_t> uids = {kUidQ,      kUidK,   kUidV,          kUidO,      kUidDO,    kUidDQ,
                               kUidDK,     kUidDV,  kUidStats,      kUidSeqQ,   kUidSeqKv, kUidScale,
                               kUidNegInf, kUidOne, kUidSoftmaxSum, kUidDqAccum};
  std::vector<void*> ptrs = {const_cast<bf16*>(q.ptr),
                             const_cast<bf16*>(k.ptr),
                             const_cast<bf16*>(v.ptr),
                             const_cast<bf16*>(o.ptr),
                             const_cast<bf16*>(dout.ptr),
                             dq.ptr,
                             dk.ptr,
                             dv.ptr,
                             stats,
                             base + w.seqlen,
                             base + w.seqlen,
                             &scale,
                             &neg,
                             &one,
                             base + w.softmax_sum,
                             base + w.dq_accum};
  for (int i = 0; i < kNumOffsets; ++i) {
    uids.push_back(kUidOffsetBase + i);
    ptrs.push_back(offsets + i * w.offsets_pitch);
  }
  return impl_->Execute(**plan, uids, ptrs, base, stream);
}

#endif  // SLIDEDP_HAVE_CUDNN_GRAPH_H

}  // namespace slidedp::kernels
