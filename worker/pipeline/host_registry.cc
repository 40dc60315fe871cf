// HostRegistry: cudaHostRegister'd ranges kept across jobs.
#include "worker/pipeline/host_registry.h"

#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"

namespace slidedp {
namespace {
constexpr uint64_t kPage = 4096;
}  // namespace

HostRegistry::~HostRegistry() {
  for (const auto& [begin, end] : ranges_) cudaHostUnregister(reinterpret_cast<void*>(begin));
}

absl::Status HostRegistry::Ensure(void* p, uint64_t bytes) {
  const uint64_t begin = reinterpret_cast<uint64_t>(p) & ~(kPage - 1);
  const uint64_t end = (reinterpret_cast<uint64_t>(p) + bytes + kPage - 1) & ~(kPage - 1);
  auto it = ranges_.find(begin);
  if (it != ranges_.end() && it->second == end) return absl::OkStatus();
  // Drop every registered range overlapping [begin, end).
  for (auto r = ranges_.begin(); r != ranges_.end();) {
    if (r->first < end && begin < r->second) {
      cudaHostUnregister(reinterpret_cast<void*>(r->first));
      r = ranges_.erase(r);
    } else {
      ++r;
    }
  }
  cudaError_t e = cudaHostRegister(reinterpret_cast<void*>(begin), end - begin, cudaHostRegisterDefault);
  if (e != cudaSuccess) {
    cudaGetLastError();
    return absl::ResourceExhaustedError(
        absl::StrCat("cudaHostRegister of ", end - begin, " bytes failed: ", cudaGetErrorString(e)));
  }
  ranges_[begin] = end;
  return absl::OkStatus();
}

}  // namespace slidedp
