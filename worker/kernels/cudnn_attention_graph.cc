// cuDNN SDPA graphs through the backend API; see cudnn_attention_graph.h.
//
// The operation graphs follow the node lists cudnn-frontend 1.x emits for its composite SDPA
// forward/backward (padding mask + causal mask, stats output). cuDNN matches that pattern to its
// fused flash-attention engines; any deviation (a missing node, another data type on a virtual
// tensor) makes heuristics return no engine, which surfaces here as UNIMPLEMENTED.
#include "worker/kernels/cudnn_attention_graph.h"

#ifdef SLIDEDP_HAVE_CUDNN_GRAPH_H

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"

namespace slidedp::kernels::cudnn_internal {
namespace {

using Dims = std::array<int64_t, 4>;

enum class TensorKind { kMemory, kVirtual, kByValue };

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

  // Finalizes the operation graph and returns the `engine`-th (0: the first) engine configuration
  // (heuristics mode A, then the fallback list) that finalizes into an execution plan. (Engines'
  // numerical notes are not read: cuDNN 9.19 notes none of these engines non-deterministic, yet the
  // Hopper backward adds dQ with atomics; SLIDEDP_DETERMINISTIC runs the backward through our
  // kernels instead.)
  absl::StatusOr<std::unique_ptr<Plan>> Build(int engine = 0) {
    if (!status_.ok()) return status_;
    cudnnBackendDescriptor_t graph = Make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    Set(graph, CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
        ops_.data());
    // Deprecated since 9.x in favour of device properties, still accepted and required by 9.0.
    Set(graph, CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle_);
    Finish(graph, "operation graph");
    if (!status_.ok()) return status_;

    std::string last_error = "heuristics returned no engine configuration";
    int accepted = 0;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      cudnnBackendDescriptor_t heur = Make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      Set(heur, CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &graph);
      Set(heur, CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      Finish(heur, "engine heuristics");
      if (!status_.ok()) return status_;
      int64_t count = 0;
      cudnnStatus_t st =
          api_.GetAttribute(heur, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count, nullptr);
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
        if (accepted++ < engine) {
          last_error = absl::StrCat("only ", accepted, " engine configurations accept this graph");
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
    return absl::UnimplementedError(
        absl::StrCat("cudnn ", api_.version, " has no engine for this attention graph: ", last_error));
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

// Causal mask inside each batch entry: keeps row >= col (top-left diagonal), or with
// bottom_right row + seq_kv - seq_q >= col (the diagonal ends at the last key: the pattern of
// cudnn-frontend 1.x's composite diagonal band mask, row shifted by the per-entry lengths).
cudnnBackendDescriptor_t CausalMask(GraphBuilder& g, const ScoreShape& s, cudnnBackendDescriptor_t score,
                                    cudnnBackendDescriptor_t neg, bool bottom_right = false,
                                    cudnnBackendDescriptor_t seq_q = nullptr, cudnnBackendDescriptor_t seq_kv = nullptr) {
  auto row = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  auto col = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, row, 2);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, col, 3);
  if (bottom_right) {
    auto plus_kv = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
    g.Pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_INT32, row, seq_kv, nullptr, plus_kv, 3);
    auto shifted = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
    g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_INT32, plus_kv, seq_q, nullptr, shifted, 3);
    row = shifted;
  }
  auto keep = g.Virtual(CUDNN_DATA_BOOLEAN, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_CMP_GE, CUDNN_DATA_BOOLEAN, row, col, nullptr, keep);
  auto out = g.Virtual(CUDNN_DATA_FLOAT, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, score, neg, keep, out);
  return out;
}

// A sliding window's left bound after the causal mask: keeps col + window > row (the keys
// row - window < col), the pattern of cudnn-frontend's composite diagonal-band node for a top-left
// left bound (its own index generation, the window a FLOAT by-value scalar added to the INT32
// column index, then CMP_GT and the select).
cudnnBackendDescriptor_t LeftBoundMask(GraphBuilder& g, const ScoreShape& s, cudnnBackendDescriptor_t score,
                                       cudnnBackendDescriptor_t window, cudnnBackendDescriptor_t neg) {
  auto row = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  auto col = g.Virtual(CUDNN_DATA_INT32, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, row, 2);
  g.Pointwise(CUDNN_POINTWISE_GEN_INDEX, CUDNN_DATA_INT32, score, nullptr, nullptr, col, 3);
  auto col_plus = g.Virtual(CUDNN_DATA_FLOAT, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_ADD, CUDNN_DATA_FLOAT, col, window, nullptr, col_plus, 3);
  auto keep = g.Virtual(CUDNN_DATA_BOOLEAN, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_CMP_GT, CUDNN_DATA_BOOLEAN, col_plus, row, nullptr, keep);
  auto out = g.Virtual(CUDNN_DATA_FLOAT, s.dims, s.strides);
  g.Pointwise(CUDNN_POINTWISE_BINARY_SELECT, CUDNN_DATA_FLOAT, score, neg, keep, out);
  return out;
}

// Tensors both directions bind: per-entry lengths, scalars, one ragged-offset array per tensor.
struct IoTensors {
  cudnnBackendDescriptor_t seq_q, seq_kv, scale, neg, window = nullptr;
  cudnnBackendDescriptor_t off[kNumOffsets] = {};
};

// Without padding the lengths are null (no mask, no overrides); without ragged, the offsets.
void CommonTensors(GraphBuilder& g, const PlanKey& k, IoTensors* io) {
  const Dims per_batch{k.b, 1, 1, 1}, unit{1, 1, 1, 1};
  if (k.padding) {
    io->seq_q = g.Tensor(kUidSeqQ, CUDNN_DATA_INT32, per_batch, unit);
    io->seq_kv = g.Tensor(kUidSeqKv, CUDNN_DATA_INT32, per_batch, unit);
  } else {
    io->seq_q = io->seq_kv = nullptr;
  }
  io->scale = g.Scalar(kUidScale);
  io->neg = g.Scalar(kUidNegInf);
  if (k.window > 0) io->window = g.Scalar(kUidWindow);
  if (!k.ragged) return;
  const int last = k.direction == Direction::kBackward ? kNumOffsets : kOffStats + 1;
  for (int i = 0; i < last; ++i) io->off[i] = g.Tensor(kUidOffsetBase + i, CUDNN_DATA_INT32, {k.b + 1, 1, 1, 1}, unit);
}

// The padding mask where the key has one, else the scores as they are.
cudnnBackendDescriptor_t MaybePaddingMask(GraphBuilder& g, const PlanKey& k, const ScoreShape& s,
                                          cudnnBackendDescriptor_t score, const IoTensors& io) {
  return k.padding ? PaddingMask(g, s, score, io.seq_q, io.seq_kv, io.neg) : score;
}

// Row-major [B, h, S, hd] view of a packed [T, ld] buffer (head h at column h·hd), S = `rows` (the
// key side's k.skv(), else k.s); with `transposed`, the [B, h, hd, S] view (Kᵀ / Vᵀ as the matmuls
// want them).
cudnnBackendDescriptor_t Bhsd(GraphBuilder& g, int64_t uid, const PlanKey& k, int64_t heads, int64_t ld,
                              cudnnBackendDescriptor_t ragged, bool transposed = false, int64_t rows = 0) {
  const int64_t S = rows > 0 ? rows : k.s;
  const Dims dims = transposed ? Dims{k.b, heads, k.hd, S} : Dims{k.b, heads, S, k.hd};
  const Dims strides = transposed ? Dims{S * ld, k.hd, 1, ld} : Dims{S * ld, k.hd, ld, 1};
  return g.Tensor(uid, CUDNN_DATA_BFLOAT16, dims, strides, TensorKind::kMemory, ragged);
}

// The [B, nq, S, S_kv] scores (row-major) of a plan.
ScoreShape ScoresOf(const PlanKey& k) {
  const int64_t s = k.s, skv = k.skv();
  return {{k.b, k.nq, s, skv}, {k.nq * s * skv, s * skv, skv, 1}};
}

// Its causal mask, top-left or bottom-right per the key, then its window's left bound if it has one.
cudnnBackendDescriptor_t KeyCausalMask(GraphBuilder& g, const PlanKey& k, const ScoreShape& sc,
                                       cudnnBackendDescriptor_t score, const IoTensors& io) {
  auto causal = CausalMask(g, sc, score, io.neg, k.bottom_right, io.seq_q, io.seq_kv);
  return k.window > 0 ? LeftBoundMask(g, sc, causal, io.window, io.neg) : causal;
}

// Stats [B, nq, S, 1]: ragged, token-major ([T, nq] in memory) with offsets cu_seqlens·nq; dense,
// head-major ([nq, S], our LSE's layout).
Dims StatsStrides(const PlanKey& k) { return k.ragged ? Dims{k.s * k.nq, 1, k.nq, 1} : Dims{k.nq * k.s, k.s, 1, 1}; }

}  // namespace

absl::StatusOr<std::unique_ptr<Plan>> BuildForward(const CudnnApi& api, cudnnHandle_t handle, const PlanKey& k) {
  GraphBuilder g(api, handle);
  IoTensors io;
  CommonTensors(g, k, &io);
  auto q = Bhsd(g, kUidQ, k, k.nq, k.ld.q, io.off[kOffQ]);
  auto kt = Bhsd(g, kUidK, k, k.nkv, k.ld.k, io.off[kOffK], /*transposed=*/true, k.skv());
  auto v = Bhsd(g, kUidV, k, k.nkv, k.ld.v, io.off[kOffV], /*transposed=*/false, k.skv());
  auto o = Bhsd(g, kUidO, k, k.nq, k.ld.o, io.off[kOffO]);
  auto stats = g.Tensor(kUidStats, CUDNN_DATA_FLOAT, {k.b, k.nq, k.s, 1}, StatsStrides(k), TensorKind::kMemory,
                        io.off[kOffStats]);

  const ScoreShape sc = ScoresOf(k);
  const Dims row_dims{k.b, k.nq, k.s, 1}, row_strides{k.nq * k.s, k.s, 1, 1};
  // S = Q·Kᵀ · scale, masked.
  auto s = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Matmul(q, kt, s, io.seq_q, io.seq_kv, nullptr);
  auto s_scaled = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, io.scale, nullptr, s_scaled);
  auto s_masked = KeyCausalMask(g, k, sc, MaybePaddingMask(g, k, sc, s_scaled, io), io);
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
  return g.Build(k.engine);
}

absl::StatusOr<std::unique_ptr<Plan>> BuildBackward(const CudnnApi& api, cudnnHandle_t handle, const PlanKey& k) {
  const BwdVariant var = BwdVariantFor(api.version);
  GraphBuilder g(api, handle);
  IoTensors io;
  CommonTensors(g, k, &io);
  auto one = g.Scalar(kUidOne);
  auto q = Bhsd(g, kUidQ, k, k.nq, k.ld.q, io.off[kOffQ]);
  const int64_t skv = k.skv();
  auto kt = Bhsd(g, kUidK, k, k.nkv, k.ld.k, io.off[kOffK], /*transposed=*/true, skv);
  auto vt = Bhsd(g, kUidV, k, k.nkv, k.ld.v, io.off[kOffV], /*transposed=*/true, skv);
  auto o = Bhsd(g, kUidO, k, k.nq, k.ld.o, io.off[kOffO]);
  auto dout = Bhsd(g, kUidDO, k, k.nq, k.ld.dout, io.off[kOffDO]);
  auto dq = Bhsd(g, kUidDQ, k, k.nq, k.ld.dq, io.off[kOffDQ]);
  auto dk = Bhsd(g, kUidDK, k, k.nkv, k.ld.dk, io.off[kOffDK], /*transposed=*/false, skv);
  auto dv = Bhsd(g, kUidDV, k, k.nkv, k.ld.dv, io.off[kOffDV], /*transposed=*/false, skv);
  auto stats = g.Tensor(kUidStats, CUDNN_DATA_FLOAT, {k.b, k.nq, k.s, 1}, StatsStrides(k), TensorKind::kMemory,
                        io.off[kOffStats]);

  const ScoreShape sc = ScoresOf(k);
  // Sᵀ [B, nq, S_kv, S]: a view of the same scores (element (kv, q) at q·S_kv + kv).
  const Dims sc_t_dims{k.b, k.nq, skv, k.s}, sc_t_strides{k.nq * k.s * skv, k.s * skv, 1, skv};
  const Dims row_dims{k.b, k.nq, k.s, 1}, row_strides{k.nq * k.s, k.s, 1, 1};
  const Dims full_dims{k.b, k.nq, k.s, k.hd}, full_strides{k.nq * k.s * k.hd, k.s * k.hd, k.hd, 1};
  // dK / dV of every query head before the GQA sum (key rows).
  const Dims kv_full_dims{k.b, k.nq, skv, k.hd}, kv_full_strides{k.nq * skv * k.hd, skv * k.hd, k.hd, 1};

  // softmax_sum = rowsum(dO ∘ O) (FP32, in the workspace).
  auto do_o = g.Virtual(CUDNN_DATA_FLOAT, full_dims, {k.nq * k.s * k.hd, k.s * k.hd, k.nq * k.hd, 1});
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, dout, o, nullptr, do_o);
  auto row_dot = g.Virtual(CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.Reduction(CUDNN_REDUCE_TENSOR_ADD, do_o, row_dot);
  const bool ragged_acc = var.ragged_accumulators && k.ragged;
  auto softmax_sum = ragged_acc ? g.Tensor(kUidSoftmaxSum, CUDNN_DATA_FLOAT, row_dims, StatsStrides(k),
                                           TensorKind::kMemory, io.off[kOffStats])
                                : g.Tensor(kUidSoftmaxSum, CUDNN_DATA_FLOAT, row_dims, row_strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, row_dot, one, nullptr, softmax_sum);

  // P = exp(Q·Kᵀ·scale - stats), masked.
  auto s = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Matmul(q, kt, s, io.seq_q, io.seq_kv, nullptr);
  auto s_scaled = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_MUL, CUDNN_DATA_FLOAT, s, io.scale, nullptr, s_scaled);
  auto s_centered = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_SUB, CUDNN_DATA_FLOAT, s_scaled, stats, nullptr, s_centered);
  auto s_masked = MaybePaddingMask(g, k, sc, s_centered, io);
  if (var.second_padding_mask) s_masked = MaybePaddingMask(g, k, sc, s_masked, io);
  s_masked = KeyCausalMask(g, k, sc, s_masked, io);
  auto p = g.Virtual(CUDNN_DATA_FLOAT, sc.dims, sc.strides);
  g.Pointwise(CUDNN_POINTWISE_EXP, CUDNN_DATA_FLOAT, s_masked, nullptr, nullptr, p);

  // out = scoresᵀ·rhs, summed over each GQA group into the kv heads (dV and dK).
  auto transposed_product = [&](auto scores, auto rhs, auto out) {
    auto scores_t = g.Virtual(CUDNN_DATA_BFLOAT16, sc_t_dims, sc_t_strides);
    g.Reshape(scores, scores_t);
    if (k.nq == k.nkv) {
      g.Matmul(scores_t, rhs, out, io.seq_kv, nullptr, io.seq_q);
    } else {
      auto full = g.Virtual(CUDNN_DATA_BFLOAT16, kv_full_dims, kv_full_strides);
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
  auto k_rows = g.Virtual(CUDNN_DATA_BFLOAT16, {k.b, k.nkv, skv, k.hd}, {skv * k.ld.k, k.hd, k.ld.k, 1}, io.off[kOffK]);
  g.Reshape(kt, k_rows);
  // The accumulator: ragged like dq (>= 9.6), else [B, S, nq, hd] (dense, >= 9.6; the frontend's
  // layout) or [B, nq, S, hd] (< 9.6).
  const Dims bshd_strides{k.s * k.nq * k.hd, k.hd, k.nq * k.hd, 1};
  auto dq_accum = ragged_acc ? g.Tensor(kUidDqAccum, CUDNN_DATA_FLOAT, full_dims, {k.s * k.ld.dq, k.hd, k.ld.dq, 1},
                                        TensorKind::kMemory, io.off[kOffDQ])
                             : g.Tensor(kUidDqAccum, CUDNN_DATA_FLOAT, full_dims,
                                        var.ragged_accumulators ? bshd_strides : full_strides);
  g.Matmul(ds, k_rows, dq_accum, io.seq_q, nullptr, io.seq_kv);
  g.Pointwise(CUDNN_POINTWISE_IDENTITY, CUDNN_DATA_FLOAT, dq_accum, nullptr, nullptr, dq);
  return g.Build(k.engine);
}

}  // namespace slidedp::kernels::cudnn_internal

#endif  // SLIDEDP_HAVE_CUDNN_GRAPH_H
