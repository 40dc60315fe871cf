// cuDNN fused attention through the backend (graph) API; see cudnn_attention.h for the contract
// and the varlen mapping. A .cu file rather than .cc: besides the host-side graph building it
// holds two tiny kernels (cu_seqlens -> per-entry lengths and ragged offsets; LSE layout).
//
// The operation graphs follow the node lists cudnn-frontend 1.x emits for its composite SDPA
// forward/backward (padding mask + causal mask, stats output). cuDNN matches that pattern to its
// fused flash-attention engines; any deviation (a missing node, another data type on a virtual
// tensor) makes heuristics return no engine, which surfaces here as UNIMPLEMENTED.
#include "worker/kernels/cudnn_attention.h"

#include <dlfcn.h>
#include <sys/stat.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "worker/kernels/cuda_check.h"

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#define SLIDEDP_HAVE_CUDNN_GRAPH_H 1
#endif

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
absl::Status CudnnAttention::Forward(const AttnArgs&, AttnTensor, AttnTensor, AttnTensor, AttnOutTensor, float*,
                                     void*, cudaStream_t) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
absl::Status CudnnAttention::Backward(const AttnArgs&, AttnTensor, AttnTensor, AttnTensor, AttnTensor, const float*,
                                      AttnTensor, AttnOutTensor, AttnOutTensor, AttnOutTensor, void*, cudaStream_t) {
  return absl::UnavailableError("cudnn attention: built without cudnn_graph.h");
}
#else

namespace {

using Dims = std::array<int64_t, 4>;
using bf16 = __nv_bfloat16;

// ---------------------------------------------------------------- library loading
// Only the entry points below are resolved; their types come from the header, so a signature
// change in a future cuDNN fails to compile instead of misbehaving.
struct CudnnApi {
  void* lib = nullptr;
  int64_t version = 0;
  decltype(&cudnnGetVersion) GetVersion = nullptr;
  decltype(&cudnnGetErrorString) GetErrorString = nullptr;
  decltype(&cudnnGetLastErrorString) GetLastErrorString = nullptr;  // optional
  decltype(&cudnnCreate) Create = nullptr;
  decltype(&cudnnDestroy) Destroy = nullptr;
  decltype(&cudnnSetStream) SetStream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) CreateDescriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) DestroyDescriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) SetAttribute = nullptr;
  decltype(&cudnnBackendGetAttribute) GetAttribute = nullptr;
  decltype(&cudnnBackendFinalize) Finalize = nullptr;
  decltype(&cudnnBackendExecute) Execute = nullptr;
};

bool IsDirectory(const std::string& path) {
  struct stat st {};
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

absl::StatusOr<CudnnApi> LoadCudnnOnce() {
  std::vector<std::string> candidates;
  std::string dir;
  if (const char* env = std::getenv("SLIDEDP_CUDNN_LIB"); env != nullptr && *env != '\0') {
    std::string p = env;
    if (IsDirectory(p)) {
      dir = p;
      p += "/libcudnn.so.9";
    } else if (const size_t slash = p.rfind('/'); slash != std::string::npos) {
      dir = p.substr(0, slash);
    }
    candidates.push_back(p);
  }
  candidates.push_back("libcudnn.so.9");
  // libcudnn.so.9 is a shim that dlopens its sub-libraries by soname. Loading them first from
  // the same directory (RTLD_GLOBAL) lets those lookups find them without LD_LIBRARY_PATH, as
  // with PyTorch's pip wheel (site-packages/nvidia/cudnn/lib). Failures here are not fatal.
  if (!dir.empty()) {
    for (const char* sub : {"libcudnn_graph.so.9", "libcudnn_heuristic.so.9", "libcudnn_engines_precompiled.so.9",
                            "libcudnn_engines_runtime_compiled.so.9"}) {
      dlopen((dir + "/" + sub).c_str(), RTLD_NOW | RTLD_GLOBAL);
    }
  }
  CudnnApi api;
  std::string errors;
  for (const std::string& c : candidates) {
    api.lib = dlopen(c.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (api.lib != nullptr) break;
    const char* e = dlerror();
    absl::StrAppend(&errors, errors.empty() ? "" : "; ", e != nullptr ? e : c);
  }
  if (api.lib == nullptr) {
    return absl::UnavailableError(absl::StrCat("cudnn attention: cannot load libcudnn.so.9 (set SLIDEDP_CUDNN_LIB): ",
                                               errors));
  }
  bool missing = false;
  std::string missing_names;
  auto resolve = [&](auto& fn, const char* name, bool required) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(api.lib, name));
    if (fn == nullptr && required) {
      missing = true;
      absl::StrAppend(&missing_names, " ", name);
    }
  };
  resolve(api.GetVersion, "cudnnGetVersion", true);
  resolve(api.GetErrorString, "cudnnGetErrorString", true);
  resolve(api.GetLastErrorString, "cudnnGetLastErrorString", false);
  resolve(api.Create, "cudnnCreate", true);
  resolve(api.Destroy, "cudnnDestroy", true);
  resolve(api.SetStream, "cudnnSetStream", true);
  resolve(api.CreateDescriptor, "cudnnBackendCreateDescriptor", true);
  resolve(api.DestroyDescriptor, "cudnnBackendDestroyDescriptor", true);
  resolve(api.SetAttribute, "cudnnBackendSetAttribute", true);
  resolve(api.GetAttribute, "cudnnBackendGetAttribute", true);
  resolve(api.Finalize, "cudnnBackendFinalize", true);
  resolve(api.Execute, "cudnnBackendExecute", true);
  if (missing) return absl::UnavailableError(absl::StrCat("cudnn attention: libcudnn lacks", missing_names));
  api.version = static_cast<int64_t>(api.GetVersion());
  if (api.version < 90000) {
    return absl::UnavailableError(absl::StrCat("cudnn attention: needs cuDNN >= 9.0, found ", api.version));
  }
  return api;
}

// Loaded once per process and never unloaded (cuDNN keeps kernels and threads alive).
absl::StatusOr<const CudnnApi*> LoadCudnn() {
  static const absl::StatusOr<CudnnApi>* const api = new absl::StatusOr<CudnnApi>(LoadCudnnOnce());
  if (!api->ok()) return api->status();
  return &**api;
}

std::string LastError(const CudnnApi& api) {
  if (api.GetLastErrorString == nullptr) return "";
  char buf[512] = {};
  api.GetLastErrorString(buf, sizeof(buf));
  return buf;
}

enum class Phase { kBuild, kRun };

absl::Status CudnnError(const CudnnApi& api, cudnnStatus_t st, const std::string& what, Phase phase = Phase::kBuild) {
  const std::string detail = LastError(api);
  const std::string msg = absl::StrCat("cudnn attention: ", what, ": ", api.GetErrorString(st),
                                       detail.empty() ? "" : " (", detail, detail.empty() ? "" : ")");
  // NOT_SUPPORTED* and BAD_PARAM* while building a graph mean "this cuDNN has no engine for it";
  // the caller falls back to the own kernels. At run time every failure is an error.
  const bool unsupported = (st >= CUDNN_STATUS_NOT_SUPPORTED && st < CUDNN_STATUS_INTERNAL_ERROR) ||
                           (st >= CUDNN_STATUS_BAD_PARAM && st < CUDNN_STATUS_NOT_SUPPORTED);
  return phase == Phase::kBuild && unsupported ? absl::UnimplementedError(msg) : absl::InternalError(msg);
}

// ---------------------------------------------------------------- descriptors and graphs
// Owns one backend descriptor.
class Desc {
 public:
  Desc(const CudnnApi* api, cudnnBackendDescriptor_t d) : api_(api), d_(d) {}
  Desc(Desc&& o) noexcept : api_(o.api_), d_(std::exchange(o.d_, nullptr)) {}
  Desc& operator=(Desc&&) = delete;
  Desc(const Desc&) = delete;
  ~Desc() {
    if (d_ != nullptr) api_->DestroyDescriptor(d_);
  }
 private:
  const CudnnApi* api_;
  cudnnBackendDescriptor_t d_;
};

// A finalized execution plan and everything it references (kept alive together: the frontend
// does the same, and the backend API does not promise plans copy what they point to).
struct Plan {
  std::vector<Desc> descs;
  cudnnBackendDescriptor_t plan = nullptr;
  int64_t workspace_bytes = 0;
};

enum class TensorKind { kMemory, kVirtual, kByValue };

// Unique ids of the tensors the caller binds at execution (virtual tensors get ids >= 1000).
enum Uid : int64_t {
  kUidQ = 1, kUidK, kUidV, kUidO, kUidStats, kUidDO, kUidDQ, kUidDK, kUidDV,
  kUidSeqQ, kUidSeqKv, kUidScale, kUidNegInf, kUidOne, kUidSoftmaxSum, kUidDqAccum,
  kUidOffsetBase = 100,  // + OffsetSlot
};
// Ragged-offset arrays, one per tensor (each has its own row stride).
enum OffsetSlot : int { kOffQ, kOffK, kOffV, kOffO, kOffStats, kOffDO, kOffDQ, kOffDK, kOffDV, kNumOffsets };

// Builds one operation graph. Errors are sticky: after the first failure every call is a no-op
// returning nullptr, and Finalize() reports that first error.
class GraphBuilder {
 public:
  GraphBuilder(const CudnnApi& api, cudnnHandle_t handle) : api_(api), handle_(handle) {}

  cudnnBackendDescriptor_t Tensor(int64_t uid, cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                  TensorKind kind = TensorKind::kMemory, cudnnBackendDescriptor_t ragged = nullptr) {
    cudnnBackendDescriptor_t t = Make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    const int64_t alignment = 16;
    const bool is_virtual = kind == TensorKind::kVirtual, by_value = kind == TensorKind::kByValue;
    Set(t, CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &type);
    Set(t, CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    Set(t, CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    Set(t, CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, 1, &uid);
    Set(t, CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, 1, &alignment);
    Set(t, CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &is_virtual);
    if (by_value) Set(t, CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &by_value);
    if (ragged != nullptr) Set(t, CUDNN_ATTR_TENSOR_RAGGED_OFFSET_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &ragged);
    Finish(t, "tensor");
    return t;
  }
  cudnnBackendDescriptor_t Virtual(cudnnDataType_t type, const Dims& dims, const Dims& strides,
                                   cudnnBackendDescriptor_t ragged = nullptr) {
    return Tensor(next_virtual_uid_++, type, dims, strides, TensorKind::kVirtual, ragged);
  }
  // A scalar passed by value at execution (the variant pack points at host memory).
  cudnnBackendDescriptor_t Scalar(int64_t uid) {
    return Tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, TensorKind::kByValue);
  }

  // y = mode(x[, b[, t]]). `prec` is the compute type (FLOAT for arithmetic, INT32 for index
  // generation, BOOLEAN for compares and logic, as the frontend sets them).
  void Pointwise(cudnnPointwiseMode_t mode, cudnnDataType_t prec, cudnnBackendDescriptor_t x,
                 cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y,
                 int64_t axis = -1) {
    cudnnBackendDescriptor_t pw = Make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    Set(pw, CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    Set(pw, CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, 1, &prec);
    if (axis >= 0) Set(pw, CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, 1, &axis);
    Finish(pw, "pointwise descriptor");
    cudnnBackendDescriptor_t op = Make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &pw);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    if (b != nullptr) Set(op, CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    if (t != nullptr) Set(op, CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &t);
    Set(op, CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    AddOp(op, "pointwise");
  }
  void Reduction(cudnnReduceTensorOp_t red, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t rd = Make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    Set(rd, CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &red);
    Set(rd, CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    Finish(rd, "reduction descriptor");
    cudnnBackendDescriptor_t op = Make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    Set(op, CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &rd);
    AddOp(op, "reduction");
  }
  // c[.., M, N] = a[.., M, K] · b[.., K, N] in FP32; the overrides (per-batch [B,1,1,1] INT32
  // tensors) bound M/N/K to each entry's real length.
  void Matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c,
              cudnnBackendDescriptor_t m_override, cudnnBackendDescriptor_t n_override,
              cudnnBackendDescriptor_t k_override) {
    cudnnBackendDescriptor_t md = Make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    const cudnnDataType_t comp = CUDNN_DATA_FLOAT;
    Set(md, CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, 1, &comp);
    Finish(md, "matmul descriptor");
    cudnnBackendDescriptor_t op = Make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &a);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &b);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &c);
    Set(op, CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &md);
    if (m_override != nullptr)
      Set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_M_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &m_override);
    if (n_override != nullptr)
      Set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_N_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &n_override);
    if (k_override != nullptr)
      Set(op, CUDNN_ATTR_OPERATION_MATMUL_GEMM_K_OVERRIDE_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &k_override);
    AddOp(op, "matmul");
  }
  // y views x with other strides (used as a transpose: S [.., sq, skv] -> Sᵀ [.., skv, sq]).
  void Reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    cudnnBackendDescriptor_t op = Make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
    Set(op, CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &x);
    Set(op, CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &y);
    AddOp(op, "reshape");
  }

  // Finalizes the operation graph and returns the first engine configuration (heuristics mode A,
  // then the fallback list) that finalizes into an execution plan. (Engines' numerical notes are
  // not read: cuDNN 9.19 notes none of these engines non-deterministic, yet the Hopper backward
  // adds dQ with atomics; SLIDEDP_DETERMINISTIC runs the backward through our kernels instead.)
  absl::StatusOr<std::unique_ptr<Plan>> Build() {
    if (!status_.ok()) return status_;
    cudnnBackendDescriptor_t graph = Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
        ops_.data());
    // Deprecated since 9.x in favour of device properties, still accepted and required by 9.0.
    Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
    Finish(graph, "operation graph");
    if (!status_.ok()) return status_;

    std::string last_error = "heuristics returned no engine configuration";
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      cudnnBackendDescriptor_t heur = Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      Set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
      Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      Finish(heur, "engine heuristics");
      if (!status_.ok()) return status_;
      int64_t count = 0;
      cudnnStatus_t st = api_.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0,
                                           &count, nullptr);
      if (st != CUDNN_STATUS_SUCCESS || count <= 0) continue;
      // The results are copied into engine-config descriptors the caller creates.
      std::vector<cudnnBackendDescriptor_t> cfgs(count);
      for (auto& c : cfgs) c = Make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR);
      if (!status_.ok()) return status_;
      st = api_.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &count,
                             cfgs.data());
      if (st != CUDNN_STATUS_SUCCESS) {
        last_error = std::string(CudnnError(api_, st, "engine heuristics results").message());
        continue;
      }
      for (int64_t i = 0; i < count; ++i) {
        cudnnBackendDescriptor_t plan = nullptr;
        st = api_.CreateDescriptor(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR, &plan);
        if (st != CUDNN_STATUS_SUCCESS) return CudnnError(api_, st, "create execution plan");
        Desc owned_plan(&api_, plan);
        st = api_.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
        if (st == CUDNN_STATUS_SUCCESS)
          st = api_.SetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1,
                                 &cfgs[i]);
        if (st == CUDNN_STATUS_SUCCESS) st = api_.Finalize(plan);
        if (st != CUDNN_STATUS_SUCCESS) {  // this engine rejects the graph; try the next
          last_error = std::string(
              CudnnError(api_, st, absl::StrCat("execution plan (engine config ", i, " of ", count, ")")).message());
          continue;
        }
        auto out = std::make_unique<Plan>();
        int64_t got = 0;
        st = api_.GetAttribute(plan, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                               &out->workspace_bytes);
        if (st != CUDNN_STATUS_SUCCESS) return CudnnError(api_, st, "plan workspace size");
        out->plan = plan;
        out->descs = std::move(owned_);
        out->descs.push_back(std::move(owned_plan));
        return out;
      }
    }
    return absl::UnimplementedError(absl::StrCat("cudnn ", api_.version, " has no engine for this attention graph: ",
                                                 last_error));
  }

 private:
  cudnnBackendDescriptor_t Make(cudnnBackendDescriptorType_t type) {
    if (!status_.ok()) return nullptr;
    cudnnBackendDescriptor_t d = nullptr;
    cudnnStatus_t st = api_.CreateDescriptor(type, &d);
    if (st != CUDNN_STATUS_SUCCESS) {
      status_.Update(CudnnError(api_, st, absl::StrCat("create descriptor ", static_cast<int>(type))));
      return nullptr;
    }
    owned_.emplace_back(&api_, d);
    return d;
  }
  void Set(cudnnBackendDescriptor_t d, cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type,
           int64_t count, const void* values) {
    if (!status_.ok() || d == nullptr) return;
    cudnnStatus_t st = api_.SetAttribute(d, name, type, count, values);
    if (st != CUDNN_STATUS_SUCCESS) status_.Update(CudnnError(api_, st, absl::StrCat("set attribute ", name)));
  }
  void Finish(cudnnBackendDescriptor_t d, const char* what) {
    if (!status_.ok() || d == nullptr) return;
    cudnnStatus_t st = api_.Finalize(d);
    if (st != CUDNN_STATUS_SUCCESS) status_.Update(CudnnError(api_, st, absl::StrCat("finalize ", what)));
  }
  void AddOp(cudnnBackendDescriptor_t op, const char* what) {
    Finish(op, what);
    if (status_.ok()) ops_.push_back(op);
  }

  const CudnnApi& api_;
  cudnnHandle_t handle_;
  absl::Status status_;
  std::vector<Desc> owned_;
  std::vector<cudnnBackendDescriptor_t> ops_;
  int64_t next_virtual_uid_ = 1000;
};

// ---------------------------------------------------------------- graph pieces
// Score tensors [B, h, S, S] (virtual, FP32, row-major per head).
struct ScoreShape {
  Dims dims, strides;
};

// Keeps scores with row < seq_q and col < seq_kv; sets the rest to `neg` (-FLT_MAX rather than
// -inf, as cudnn-frontend 1.x does, so fully masked rows never compute -inf - -inf).
cudnnBackendDescriptor_t PaddingMask(GraphBuilder& g, const ScoreShape& s, cudnnBackendDescriptor_t score,
                                     cudnnBackendDescriptor_t seq_q, cudnnBackendDescriptor_t seq_kv,
                                     cudnnBackendDescriptor_t neg) {
  auto row = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  auto col = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, row, 2);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, col, 3);
  auto row_ok = g.Virtual(CUDNN_DATA_BOOLEAN, s.dims, s.strides);
  auto col_ok = g.Virtual(CUDNN_DATA_BOOLEAN, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, row, seq_q, nullptr, row_ok);
  g.Pointwise(CUDNN_POINTWISE_CMP_LT, CUDNN_DATA_BOOLEAN, col, seq_kv, nullptr, col_ok);
  auto keep = g.Virtual(CUDNN_DATA_BOOLEAN, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_LOGICAL_AND, CUDNN_DATA_BOOLEAN, row_ok, col_ok, nullptr, keep);
  auto out = g.Virtual(CUDNN_DATA_FLOAT, s.dims, s.strides);
  // BINARY_SELECT: y = t ? x : b.
  g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, score, neg, keep, out);
  return out;
}

// Top-left causal mask inside each batch entry: keeps row >= col.
cudnnBackendDescriptor_t CausalMask(GraphBuilder& g, const ScoreShape& s, cudnnBackendDescriptor_t score,
                                    cudnnBackendDescriptor_t neg) {
  auto row = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  auto col = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, row, 2);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, col, 3);
  auto keep = g.Virtual(CUDNN_DATA_BOOLEAN, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
  auto out = g.Virtual(CUDNN_DATA_FLOAT, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, score, neg, keep, out);
  return out;
}

// What a plan depends on. Not in the key: tokens, document lengths, pointers, softmax scale
// (passed by value at execution).
enum class Direction { kForward, kBackward };

struct PlanKey {
  Direction direction = Direction::kForward;
  int64_t b = 0, s = 0, nq = 0, nkv = 0, hd = 0;
  AttnRowStrides ld;
  auto Tie() const {
    return std::tie(direction, b, s, nq, nkv, hd, ld.q, ld.k, ld.v, ld.o, ld.dout, ld.dq, ld.dk, ld.dv);
  }
  bool operator<(const PlanKey& o) const { return Tie() < o.Tie(); }
};

int64_t NextPow2(int64_t x) {
  int64_t p = 1;
  while (p < x) p <<= 1;
  return p;
}

// Per-version choices of the backward graph (mirroring cudnn-frontend's).
struct BwdVariant {
  bool ragged_accumulators;  // >= 9.6: softmax_sum / dQ accumulator sized by tokens (THD)
  bool second_padding_mask;  // [9.0, 9.10): padding mask applied again after subtracting stats
  bool zero_dq_accum;        // < 9.6: the accumulator must be zeroed by the caller
};
BwdVariant BwdVariantFor(int64_t version) {
  return {version >= 90600, version >= 90000 && version < 91000, version < 90600};
}

// Tensors both directions bind: per-entry lengths, scalars, one ragged-offset array per tensor.
struct IoTensors {
  cudnnBackendDescriptor_t seq_q, seq_kv, scale, neg;
  cudnnBackendDescriptor_t off[kNumOffsets] = {};
};

void CommonTensors(GraphBuilder& g, const PlanKey& k, IoTensors* io) {
  const Dims per_batch{k.b, 1, 1, 1}, unit{1, 1, 1, 1};
  io->seq_q = g.Tensor(kUidSeqQ, CUDNN_DATA_INT32, per_batch, unit);
  io->seq_kv = g.Tensor(kUidSeqKv, CUDNN_DATA_INT32, per_batch, unit);
  io->scale = g.Scalar(kUidScale);
  io->neg = g.Scalar(kUidNegInf);
  const int last = k.direction == Direction::kBackward ? kNumOffsets : kOffStats + 1;
  for (int i = 0; i < last; ++i)
    io->off[i] = g.Tensor(kUidOffsetBase + i, CUDNN_DATA_INT32, {k.b + 1, 1, 1, 1}, unit);
}

// Row-major [B, h, S, hd] view of a packed [T, ld] buffer (head h at column h·hd); with
// `transposed`, the [B, h, hd, S] view (Kᵀ / Vᵀ as the matmuls want them).
cudnnBackendDescriptor_t Bhsd(GraphBuilder& g, int64_t uid, const PlanKey& k, int64_t heads, int64_t ld,
                              cudnnBackendDescriptor_t ragged, bool transposed = false) {
  const Dims dims = transposed ? Dims{k.b, heads, k.hd, k.s} : Dims{k.b, heads, k.s, k.hd};
  const Dims strides = transposed ? Dims{k.s * ld, k.hd, 1, ld} : Dims{k.s * ld, k.hd, ld, 1};
  return g.Tensor(uid, CUDNN_DATA_BFLOAT16, dims, strides, TensorKind::kMemory, ragged);
}

// Stats [B, nq, S, 1], token-major ([T, nq] in memory), ragged by cu_seqlens·nq.
Dims StatsStrides(const PlanKey& k) { return {k.s * k.nq, 1, k.nq, 1}; }

absl::StatusOr<std::unique_ptr<Plan>> BuildForward(const CudnnApi& api, cudnnHandle_t handle, const PlanKey& k) {
  GraphBuilder g(api, handle);
  IoTensors io;
  CommonTensors(g, k, &io);
  auto q = Bhsd(g, kUidQ, k, k.nq, k.ld.q, io.off[kOffQ]);
  auto kt = Bhsd(g, kUidK, k, k.nkv, k.ld.k, io.off[kOffK], /*transposed=*/true);
  auto v = Bhsd(g, kUidV, k, k.nkv, k.ld.v, io.off[kOffV]);
  auto o = Bhsd(g, kUidO, k, k.nq, k.ld.o, io.off[kOffO]);
  auto stats = g.Tensor(kUidStats, CUDNN_DATA_FLOAT, {k.b, k.nq, k.s, 1}, StatsStrides(k), TensorKind::kMemory,
                        io.off[kOffStats]);

  const ScoreShape sc{{k.b, k.nq, k.s, k.s}, {k.nq * k.s * k.s, k.s * k.s, k.s, 1}};
  const Dims row_dims{k.b, k.nq, k.s, 1}, row_strides{k.nq * k.s, k.s, 1, 1};
  // S = Q·Kᵀ · scale, masked.
  auto s = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Matmul(q, kt, s, io.seq_q, io.seq_kv, nullptr);
  auto s_scaled = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, io.scale, nullptr, s_scaled);
  auto s_masked = CausalMask(g, sc, PaddingMask(g, sc, s_scaled, io.seq_q, io.seq_kv, io.neg), io.neg);
  // Softmax with stats = max + log Σ exp(S - max) (natural log, like our LSE).
  auto mx = g.Virtual(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.Reduction(CUDNN_REDUCE_TENSOR_MAX, s_masked, mx);
  auto centered = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s_masked, mx, nullptr, centered);
  auto e = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, centered, nullptr, nullptr, e);
  auto sum = g.Virtual(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  auto log_sum = g.Virtual(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.Pointwise(CUDNN_POINTWISE_LOG, CUDNN_DATA_FLOAT, sum, nullptr, nullptr, log_sum);
  g.Pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, mx, log_sum, nullptr, stats);
  // P = e / sum, in the I/O type (the engine requires bmm2's A operand in BF16).
  auto p = g.Virtual(CUDNN_DATA_BFLOAT16, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_DIV, CUDNN_DATA_FLOAT, e, sum, nullptr, p);
  // O = P·V.
  g.Matmul(p, v, o, io.seq_q, nullptr, io.seq_kv);
  return g.Build();
}

absl::StatusOr<std::unique_ptr<Plan>> BuildBackward(const CudnnApi& api, cudnnHandle_t handle, const PlanKey& k) {
  const BwdVariant var = BwdVariantFor(api.version);
  GraphBuilder g(api, handle);
  IoTensors io;
  CommonTensors(g, k, &io);
  auto one = g.Scalar(kUidOne);
  auto q = Bhsd(g, kUidQ, k, k.nq, k.ld.q, io.off[kOffQ]);
  auto kt = Bhsd(g, kUidK, k, k.nkv, k.ld.k, io.off[kOffK], /*transposed=*/true);
  auto vt = Bhsd(g, kUidV, k, k.nkv, k.ld.v, io.off[kOffV], /*transposed=*/true);
  auto o = Bhsd(g, kUidO, k, k.nq, k.ld.o, io.off[kOffO]);
  auto dout = Bhsd(g, kUidDO, k, k.nq, k.ld.dout, io.off[kOffDO]);
  auto dq = Bhsd(g, kUidDQ, k, k.nq, k.ld.dq, io.off[kOffDQ]);
  auto dk = Bhsd(g, kUidDK, k, k.nkv, k.ld.dk, io.off[kOffDK]);
  auto dv = Bhsd(g, kUidDV, k, k.nkv, k.ld.dv, io.off[kOffDV]);
  auto stats = g.Tensor(kUidStats, CUDNN_DATA_FLOAT, {k.b, k.nq, k.s, 1}, StatsStrides(k), TensorKind::kMemory,
                        io.off[kOffStats]);

  const ScoreShape sc{{k.b, k.nq, k.s, k.s}, {k.nq * k.s * k.s, k.s * k.s, k.s, 1}};
  const Dims sc_t_strides{k.nq * k.s * k.s, k.s * k.s, 1, k.s};  // Sᵀ view of the same scores
  const Dims row_dims{k.b, k.nq, k.s, 1}, row_strides{k.nq * k.s, k.s, 1, 1};
  const Dims full_dims{k.b, k.nq, k.s, k.hd}, full_strides{k.nq * k.s * k.hd, k.s * k.hd, k.hd, 1};

  // softmax_sum = rowsum(dO ∘ O) (FP32, in the workspace).
  auto do_o = g.Virtual(CUDNN_DATA_FLOAT, full_dims, {k.nq * k.s * k.hd, k.s * k.hd, k.nq * k.hd, 1});
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dout, o, nullptr, do_o);
  auto row_dot = g.Virtual(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, row_dot);
  auto softmax_sum = var.ragged_accumulators
                         ? g.Tensor(kUidSoftmaxSum, CUDNN_DATA_FLOAT, row_dims, StatsStrides(k), TensorKind::kMemory,
                                    io.off[kOffStats])
                         : g.Tensor(kUidSoftmaxSum, CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_dot, one, nullptr, softmax_sum);

  // P = exp(Q·Kᵀ·scale - stats), masked.
  auto s = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Matmul(q, kt, s, io.seq_q, io.seq_kv, nullptr);
  auto s_scaled = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, io.scale, nullptr, s_scaled);
  auto s_centered = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s_scaled, stats, nullptr, s_centered);
  auto s_masked = PaddingMask(g, sc, s_centered, io.seq_q, io.seq_kv, io.neg);
  if (var.second_padding_mask) s_masked = PaddingMask(g, sc, s_masked, io.seq_q, io.seq_kv, io.neg);
  s_masked = CausalMask(g, sc, s_masked, io.neg);
  auto p = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, s_masked, nullptr, nullptr, p);

  // out = scoresᵀ·rhs, summed over each GQA group into the kv heads (dV and dK).
  auto transposed_product = [&](auto scores, auto rhs, auto out) {
    auto scores_t = g.Virtual(CUDNN_DATA_BFLOAT16, sc.dims, sc_t_strides);
    g.Reshape(scores, scores_t);
    if (k.nq == k.nkv) {
      g.Matmul(scores_t, rhs, out, io.seq_kv, nullptr, io.seq_q);
    } else {
      auto full = g.Virtual(CUDNN_DATA_BFLOAT16, full_dims, full_strides);
      g.Matmul(scores_t, rhs, full, io.seq_kv, nullptr, io.seq_q);
      g.Reduction(CUDNN_REDUCE_TENSOR_ADD, full, out);
    }
  };

  // dV = Pᵀ·dO.
  transposed_product(p, dout, dv);

  // dS = P ∘ (dO·Vᵀ - softmax_sum) · scale.
  auto dp = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Matmul(dout, vt, dp, io.seq_q, io.seq_kv, nullptr);
  auto dp_centered = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, dp, softmax_sum, nullptr, dp_centered);
  auto ds_unscaled = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dp_centered, p, nullptr, ds_unscaled);
  auto ds = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, ds_unscaled, io.scale, nullptr, ds);

  // dK = dSᵀ·Q.
  transposed_product(ds, q, dk);

  // dQ = dS·K, accumulated in FP32 (workspace), then cast into dq.
  // K back in row form, as a reshape of Kᵀ (the frontend's pattern; it keeps K's ragged offset).
  auto k_rows = g.Virtual(CUDNN_DATA_BFLOAT16, {k.b, k.nkv, k.s, k.hd}, {k.s * k.ld.k, k.hd, k.ld.k, 1},
                          io.off[kOffK]);
  g.Reshape(kt, k_rows);
  auto dq_accum = var.ragged_accumulators
                      ? g.Tensor(kUidDqAccum, CUDNN_DATA_FLOAT, full_dims, {k.s * k.ld.dq, k.hd, k.ld.dq, 1},
                                 TensorKind::kMemory, io.off[kOffDQ])
                      : g.Tensor(kUidDqAccum, CUDNN_DATA_FLOAT, full_dims, full_strides);
  g.Matmul(ds, k_rows, dq_accum, io.seq_q, nullptr, io.seq_kv);
  g.Pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, nullptr, nullptr, dq);
  return g.Build();
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
    at += Align256(var.ragged_accumulators ? ((tokens - 1) * k.ld.dq + k.nq * k.hd) * 4
                                           : k.b * k.nq * k.s * k.hd * 4);
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
    absl::StatusOr<std::unique_ptr<Plan>> p = k.direction == Direction::kBackward ? BuildBackward(*api, handle, k) : BuildForward(*api, handle, k);
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
  std::vector<void*> ptrs = {const_cast<bf16*>(q.ptr), const_cast<bf16*>(k.ptr), const_cast<bf16*>(v.ptr), o.ptr,
                             stats, base + w.seqlen, base + w.seqlen, &scale, &neg};
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
  if (var.zero_dq_accum) SLIDEDP_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(base + w.dq_accum, 0, w.total - w.dq_accum, stream));
  int32_t* offsets = reinterpret_cast<int32_t*>(base + w.offsets);
  float scale = a.softmax_scale, neg = std::numeric_limits<float>::lowest(), one = 1.0f;
  std::vector<int64_t> uids = {kUidQ, kUidK, kUidV, kUidO, kUidDO, kUidDQ, kUidDK, kUidDV, kUidStats, kUidSeqQ,
                               kUidSeqKv, kUidScale, kUidNegInf, kUidOne, kUidSoftmaxSum, kUidDqAccum};
  std::vector<void*> ptrs = {const_cast<bf16*>(q.ptr), const_cast<bf16*>(k.ptr), const_cast<bf16*>(v.ptr),
                             const_cast<bf16*>(o.ptr), const_cast<bf16*>(dout.ptr), dq.ptr, dk.ptr, dv.ptr, stats,
                             base + w.seqlen, base + w.seqlen, &scale, &neg, &one, base + w.softmax_sum,
                             base + w.dq_accum};
  for (int i = 0; i < kNumOffsets; ++i) {
    uids.push_back(kUidOffsetBase + i);
    ptrs.push_back(offsets + i * w.offsets_pitch);
  }
  return impl_->Execute(**plan, uids, ptrs, base, stream);
}

#endif  // SLIDEDP_HAVE_CUDNN_GRAPH_H

}  // namespace slidedp::kernels
