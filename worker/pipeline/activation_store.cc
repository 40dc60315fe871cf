// HostActivationStore: the CPU backend's ActivationStore, and what every store shares (see
// activation_store.h).
#include "worker/pipeline/activation_store.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp {

int OffloadedCheckpoints(double ratio, int n) {
  if (!(ratio > 0) || n <= 0) return 0;
  const int k = static_cast<int>(std::lround(std::min(1.0, ratio) * n));
  return std::clamp(k, 1, n);
}

absl::Status ReserveCheckpoints(ActivationStore& store, const ComputeBackend& backend,
                                const std::vector<ActPolicy>& policies, const std::vector<MicroBatch>& micro_batches,
                                Dtype checkpoint_dtype) {
  constexpr int64_t kPieceAlignmentRoom = 32 * 256;  // the CUDA backend aligns each piece to 256 bytes
  const int64_t input_per_token = backend.config().hidden_size * DtypeBytes(CheckpointDType(backend, checkpoint_dtype));
  for (size_t l = 0; l < policies.size(); ++l) {
    const int unit = static_cast<int>(l) + 1;
    if (!store.offloads(unit)) continue;
    std::vector<CheckpointBytes> sizes;
    for (const MicroBatch& mb : micro_batches) {
      CheckpointBytes c;
      c.input = mb.num_tokens() * input_per_token;
      if (policies[l].pieces != 0) c.kept = backend.SavedBytesPerToken(policies[l]) * mb.num_tokens() + kPieceAlignmentRoom;
      sizes.push_back(c);
    }
    RETURN_IF_ERROR(store.Reserve(unit, sizes));
  }
  return absl::OkStatus();
}

MovedCheckpoints TakeCheckpoints(int count, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                                 std::vector<std::unique_ptr<SavedActivations>>& saved) {
  MovedCheckpoints out;
  for (int i = 0; i < count && i < static_cast<int>(inputs.size()); ++i) {
    out.buffers.push_back(std::move(inputs[i]));
    std::unique_ptr<DeviceBuffer> kept;
    if (i < static_cast<int>(saved.size()) && saved[i] != nullptr) kept = saved[i]->Detach();
    out.has_kept.push_back(kept != nullptr);
    if (kept != nullptr) out.buffers.push_back(std::move(kept));
  }
  return out;
}

absl::Status PutCheckpoints(const std::vector<bool>& has_kept, std::vector<std::unique_ptr<DeviceBuffer>> buffers,
                            std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                            std::vector<std::unique_ptr<SavedActivations>>& saved) {
  size_t b = 0;
  for (size_t i = 0; i < has_kept.size(); ++i) {
    if (i >= inputs.size() || b >= buffers.size()) {
      return absl::InternalError(absl::StrCat("activation store: checkpoint ", i, " has nowhere to go back to"));
    }
    inputs[i] = std::move(buffers[b++]);
    if (!has_kept[i]) continue;
    if (i >= saved.size() || saved[i] == nullptr || b >= buffers.size()) {
      return absl::InternalError(absl::StrCat("activation store: the kept block of checkpoint ", i, " lost its owner"));
    }
    RETURN_IF_ERROR(saved[i]->Attach(std::move(buffers[b++])));
  }
  return absl::OkStatus();
}

namespace {

class HostActivationStore final : public ActivationStore {
 public:
  HostActivationStore(ComputeBackend* backend, std::vector<double> offloaded)
      : backend_(backend), offloaded_(std::move(offloaded)) {}

  double ratio(int unit) const override {
    return unit >= 0 && unit < static_cast<int>(offloaded_.size()) ? offloaded_[unit] : 0.0;
  }

  absl::Status Offload(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                       std::vector<std::unique_ptr<SavedActivations>>& saved) override {
    MovedCheckpoints moved =
        TakeCheckpoints(OffloadedCheckpoints(ratio(unit), static_cast<int>(inputs.size())), inputs, saved);
    Unit& h = host_[unit];
    h.has_kept = std::move(moved.has_kept);
    h.bytes.clear();
    for (auto& b : moved.buffers) {
      h.bytes.emplace_back(static_cast<size_t>(b->bytes()));
      RETURN_IF_ERROR(backend_->CopyToHost(b->data(), h.bytes.back().data(), b->bytes()));
      host_bytes_ = std::max<int64_t>(host_bytes_, TotalBytes());
    }
    return absl::OkStatus();  // the device copies go with `moved`
  }

  absl::Status Prefetch(int unit) override {
    if (!offloads(unit) || restored_.count(unit)) return absl::OkStatus();
    auto it = host_.find(unit);
    if (it == host_.end()) {
      return absl::InternalError(absl::StrCat("the checkpoints of unit ", unit, " were never offloaded"));
    }
    Restored r;
    r.has_kept = std::move(it->second.has_kept);
    for (const auto& h : it->second.bytes) {
      ASSIGN_OR_RETURN(auto b, backend_->Allocate(static_cast<int64_t>(h.size())));
      RETURN_IF_ERROR(backend_->CopyToDevice(h.data(), b->data(), static_cast<int64_t>(h.size())));
      r.buffers.push_back(std::move(b));
    }
    host_.erase(it);
    restored_[unit] = std::move(r);
    return absl::OkStatus();
  }

  absl::Status Restore(int unit, std::vector<std::unique_ptr<DeviceBuffer>>& inputs,
                       std::vector<std::unique_ptr<SavedActivations>>& saved) override {
    RETURN_IF_ERROR(Prefetch(unit));
    Restored r = std::move(restored_[unit]);
    restored_.erase(unit);
    return PutCheckpoints(r.has_kept, std::move(r.buffers), inputs, saved);
  }

  int64_t host_bytes() const override { return host_bytes_; }
  double copy_s() const override { return 0; }

 private:
  struct Unit {
    std::vector<bool> has_kept;
    std::vector<std::vector<uint8_t>> bytes;  // TakeCheckpoints' order
  };
  struct Restored {
    std::vector<bool> has_kept;
    std::vector<std::unique_ptr<DeviceBuffer>> buffers;
  };

  int64_t TotalBytes() const {
    int64_t b = 0;
    for (const auto& [u, v] : host_) {
      for (const auto& h : v.bytes) b += static_cast<int64_t>(h.size());
    }
    return b;
  }

  ComputeBackend* backend_;
  std::vector<double> offloaded_;  // per unit
  std::map<int, Unit> host_;
  std::map<int, Restored> restored_;
  int64_t host_bytes_ = 0;
};

}  // namespace

std::unique_ptr<ActivationStore> MakeHostActivationStore(const ModelLayout& layout, ComputeBackend* backend,
                                                         double ratio) {
  return MakeHostActivationStore(backend, OffloadedUnits(layout, ratio));
}

std::vector<double> OffloadedUnits(const ModelLayout& layout, double ratio) {
  std::vector<double> out(layout.num_units(), 0.0);
  const int n = layout.OffloadedLayers(ratio);
  for (int u = 1; u <= n && u < layout.num_units(); ++u) out[u] = 1.0;
  return out;
}

std::unique_ptr<ActivationStore> MakeHostActivationStore(ComputeBackend* backend, std::vector<double> offloaded) {
  return std::make_unique<HostActivationStore>(backend, std::move(offloaded));
}

}  // namespace slidedp
