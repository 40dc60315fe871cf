// HostActivationStore: the CPU backend's ActivationStore (see activation_store.h).
#include "worker/pipeline/activation_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp {
namespace {

class HostActivationStore final : public ActivationStore {
 public:
  HostActivationStore(ComputeBackend* backend, std::vector<bool> offloaded)
      : backend_(backend), offloaded_(std::move(offloaded)) {}

  bool offloads(int unit) const override {
    return unit >= 0 && unit < static_cast<int>(offloaded_.size()) && offloaded_[unit];
  }

  absl::Status Offload(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs) override {
    std::vector<std::vector<uint8_t>>& kept = host_[unit];
    kept.clear();
    for (auto& b : inputs) {
      kept.emplace_back(static_cast<size_t>(b->bytes()));
      RETURN_IF_ERROR(backend_->CopyToHost(b->data(), kept.back().data(), b->bytes()));
      host_bytes_ = std::max<int64_t>(host_bytes_, TotalBytes());
    }
    inputs.clear();  // the device copies go now
    return absl::OkStatus();
  }

  absl::Status Prefetch(int unit) override {
    if (!offloads(unit) || restored_.count(unit)) return absl::OkStatus();
    auto it = host_.find(unit);
    if (it == host_.end())
      return absl::InternalError(absl::StrCat("saved input of unit ", unit, " was never offloaded"));
    std::vector<std::unique_ptr<DeviceBuffer>> bufs;
    for (const auto& h : it->second) {
      ASSIGN_OR_RETURN(auto b, backend_->Allocate(static_cast<int64_t>(h.size())));
      RETURN_IF_ERROR(backend_->CopyToDevice(h.data(), b->data(), static_cast<int64_t>(h.size())));
      bufs.push_back(std::move(b));
    }
    host_.erase(it);
    restored_[unit] = std::move(bufs);
    return absl::OkStatus();
  }

  absl::Status Restore(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs) override {
    RETURN_IF_ERROR(Prefetch(unit));
    inputs = std::move(restored_[unit]);
    restored_.erase(unit);
    return absl::OkStatus();
  }

  int64_t host_bytes() const override { return host_bytes_; }
  double copy_s() const override { return 0; }

 private:
  int64_t TotalBytes() const {
    int64_t b = 0;
    for (const auto& [u, v] : host_) {
      for (const auto& h : v) b += static_cast<int64_t>(h.size());
    }
    return b;
  }

  ComputeBackend* backend_;
  std::vector<bool> offloaded_;  // per unit
  std::map<int, std::vector<std::vector<uint8_t>>> host_;
  std::map<int, std::vector<std::unique_ptr<DeviceBuffer>>> restored_;
  int64_t host_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ActivationStore> MakeHostActivationStore(const ModelLayout& layout, ComputeBackend* backend,
                                                         double ratio) {
  return MakeHostActivationStore(backend, OffloadedUnits(layout, ratio));
}

std::vector<bool> OffloadedUnits(const ModelLayout& layout, double ratio) {
  std::vector<bool> out(layout.num_units(), false);
  const int n = layout.OffloadedLayers(ratio);
  for (int u = 1; u <= n && u < layout.num_units(); ++u) out[u] = true;
  return out;
}

std::unique_ptr<ActivationStore> MakeHostActivationStore(ComputeBackend* backend, std::vector<bool> offloaded) {
  return std::make_unique<HostActivationStore>(backend, std::move(offloaded));
}

}  // namespace slidedp
