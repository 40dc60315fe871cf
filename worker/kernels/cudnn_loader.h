// libcudnn.so.9 loaded at run time (dlopen; no link-time dependency): the entry points the fused
// attention uses, cuDNN failures as a Status, and the owner of one backend descriptor. Shared by
// cudnn_attention_graph.cc (building the graphs) and cudnn_attention.cu (plan cache, execution).
// Declares nothing when built without cuDNN 9's cudnn_graph.h (SLIDEDP_HAVE_CUDNN_GRAPH_H unset).
#pragma once

#if __has_include(<cudnn_graph.h>)
#include <cudnn_graph.h>
#define SLIDEDP_HAVE_CUDNN_GRAPH_H 1
#endif

#ifdef SLIDEDP_HAVE_CUDNN_GRAPH_H

#include <cstdint>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace slidedp::kernels::cudnn_internal {

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

// Loaded once per process and never unloaded (cuDNN keeps kernels and threads alive).
absl::StatusOr<const CudnnApi*> LoadCudnn();

enum class Phase { kBuild, kRun };

// The failure of a cuDNN call as a Status: UNIMPLEMENTED while building a graph when cuDNN has no
// engine for it (the caller falls back to the own kernels), INTERNAL otherwise.
absl::Status CudnnError(const CudnnApi& api, cudnnStatus_t st, const std::string& what, Phase phase = Phase::kBuild);

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

}  // namespace slidedp::kernels::cudnn_internal

#endif  // SLIDEDP_HAVE_CUDNN_GRAPH_H
