// Job memory plan and admission check against /proc/meminfo and /dev/shm.
#include "hostd/admission/admission.h"

#include <sys/statvfs.h>

#include <algorithm>
#include <cerrno>
#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/io/meminfo.h"
#include "common/policy/layer_policy.h"
#include "common/status/status_macros.h"
#include "shm/job_state.h"

namespace slidedp::hostd {
namespace {

// Bytes in the unit that shows them: "63.00 GiB", "12.5 MiB", "640.0 KiB", "17 bytes" (a small
// job's needs are not "0.00 GiB").
std::string Bytes(uint64_t b) {
  constexpr double kKib = 1024.0, kMib = kKib * 1024, kGib = kMib * 1024;
  const double d = static_cast<double>(b);
  if (d >= kGib) return absl::StrFormat("%.2f GiB", d / kGib);
  if (d >= kMib) return absl::StrFormat("%.1f MiB", d / kMib);
  if (d >= kKib) return absl::StrFormat("%.1f KiB", d / kKib);
  return absl::StrFormat("%d bytes", b);
}

}  // namespace

std::string MemoryPlan::ToString() const {
  return absl::StrFormat(
      "%s (master %s, adam m+v %s, bf16 mirror %s, job segment %s, grad rings %s, step gradient staging %s, "
      "activation offload %s, undo copies %s, cast staging %s; %d params)",
      Bytes(total_bytes), Bytes(master_bytes), Bytes(adam_bytes), Bytes(mirror_bytes), Bytes(job_segment_bytes),
      Bytes(ring_bytes), Bytes(step_staging_bytes), Bytes(offload_bytes), Bytes(undo_bytes), Bytes(cast_staging_bytes),
      param_numel);
}

shm::GradRingConfig RingConfigFor(const ModelLayout& layout, int slots, int64_t chunk_bytes) {
  int64_t max_unit_numel = 0;
  for (const UnitLayout& u : layout.units) max_unit_numel = std::max(max_unit_numel, u.numel);
  shm::GradRingConfig ring;
  ring.num_slots = static_cast<uint32_t>(slots);
  ring.slot_bytes = std::min<uint64_t>({static_cast<uint64_t>(chunk_bytes), kMaxGradChunkBytes,
                                        static_cast<uint64_t>((max_unit_numel * 4 + 4095) / 4096 * 4096)});
  // Whole pages: a chunk is then a multiple of 1,024 FP32 (2,048 BF16) elements, so chunks never
  // split an int8 moment block (kInt8MomentBlock) between two updates.
  ring.slot_bytes = std::max<uint64_t>(4096, ring.slot_bytes / 4096 * 4096);
  return ring;
}

MemoryPlan PlanJobMemory(const ModelLayout& layout, const shm::GradRingConfig& ring, int num_workers, ClipMode clip,
                         Dtype staging_dtype, const shm::StateFormat& format) {
  MemoryPlan p;
  p.param_numel = layout.total_numel;
  const uint64_t n = static_cast<uint64_t>(layout.total_numel);
  p.master_bytes = 4 * n;
  for (const UnitLayout& u : layout.units) p.adam_bytes += MomentBytes(format.moments, static_cast<uint64_t>(u.numel));
  p.mirror_bytes = format.mirror ? 2 * n : 0;
  p.job_segment_bytes = shm::JobState::SegmentBytes(layout, format);
  p.ring_bytes = static_cast<uint64_t>(num_workers < 0 ? 0 : num_workers) * shm::GradRing::SegmentBytes(ring);
  p.step_staging_bytes = clip == ClipMode::kExactGlobalNorm ? DtypeBytes(staging_dtype) * n : 0;
  p.shm_bytes = p.job_segment_bytes + p.ring_bytes;
  p.total_bytes = p.shm_bytes + p.step_staging_bytes;
  return p;
}

int64_t CastStagingChunkBytes(const ModelLayout& layout, int64_t chunk_bytes) {
  int64_t largest = 0;
  for (const UnitLayout& u : layout.units) largest = std::max(largest, u.numel * 2);
  const int64_t bytes = std::min(chunk_bytes, largest);
  return std::max<int64_t>(4096, (bytes + 4095) / 4096 * 4096);
}

void AddCastStaging(int num_workers, int64_t chunk_bytes, MemoryPlan& plan) {
  const uint64_t bytes =
      static_cast<uint64_t>(std::max(num_workers, 0)) * kCastStagingBuffers * static_cast<uint64_t>(chunk_bytes);
  plan.cast_staging_bytes += bytes;
  plan.total_bytes += bytes;
}

void AddOffloadedCheckpoints(const OffloadedPerToken& per_token, int num_workers, int64_t tokens_per_worker,
                             MemoryPlan& plan) {
  const double bytes_per_token = per_token.bytes();
  if (!(bytes_per_token > 0) || num_workers <= 0 || tokens_per_worker <= 0) return;
  const uint64_t bytes = static_cast<uint64_t>(
      std::ceil(bytes_per_token * static_cast<double>(tokens_per_worker) * static_cast<double>(num_workers)));
  plan.offload_bytes += bytes;
  plan.total_bytes += bytes;
}

int64_t KeptBytesPerToken(const ModelConfig& config, uint32_t pieces, bool cuda_workers) {
  const ModelShape shape = ModelShape::Of(config);
  if (cuda_workers && !config.is_moe()) return CudaKeptBytesPerToken(shape, pieces);
  return 4 * KeptElementsPerToken(shape, pieces);
}

void AddActivationOffload(const ModelLayout& layout, double ratio, uint32_t kept_pieces, int64_t input_element_bytes,
                          bool cuda_workers, int num_workers, int64_t tokens_per_worker, MemoryPlan& plan) {
  if (ratio <= 0) return;
  const double layers = layout.OffloadedLayers(ratio);
  OffloadedPerToken per_token;
  per_token.input_elements = layers * static_cast<double>(layout.config.hidden_size);
  per_token.kept_bytes = layers * static_cast<double>(KeptBytesPerToken(layout.config, kept_pieces, cuda_workers));
  per_token.input_element_bytes = input_element_bytes;
  AddOffloadedCheckpoints(per_token, num_workers, tokens_per_worker, plan);
}

absl::StatusOr<HostMemoryInfo> ReadHostMemoryInfo(const std::string& meminfo_path, const std::string& shm_dir) {
  HostMemoryInfo info;
  ASSIGN_OR_RETURN(const MemInfo mem, ReadMemInfo(meminfo_path));
  info.mem_total_bytes = mem.total_bytes;
  info.mem_available_bytes = mem.available_bytes;
  struct statvfs st;
  if (::statvfs(shm_dir.c_str(), &st) != 0) return ErrnoStatus(absl::StrCat("statvfs ", shm_dir), errno);
  info.shm_total_bytes = static_cast<uint64_t>(st.f_blocks) * st.f_frsize;
  info.shm_free_bytes = static_cast<uint64_t>(st.f_bavail) * st.f_frsize;
  return info;
}

absl::Status CheckAdmission(const MemoryPlan& plan, const HostMemoryInfo& host, const AdmissionPolicy& policy) {
  const uint64_t usable =
      host.mem_available_bytes > policy.reserve_bytes ? host.mem_available_bytes - policy.reserve_bytes : 0;
  if (plan.total_bytes > usable) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("job needs %s of host memory but only %s is available (limit: host memory, "
                        "MemAvailable %s minus %s reserve); needs %s",
                        Bytes(plan.total_bytes), Bytes(usable), Bytes(host.mem_available_bytes),
                        Bytes(policy.reserve_bytes), plan.ToString()));
  }
  if (plan.shm_bytes > host.shm_free_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "job needs %s of shared memory but /dev/shm has %s free of %s (limit: /dev/shm size; remount it "
        "larger, e.g. mount -o remount,size=...); needs %s",
        Bytes(plan.shm_bytes), Bytes(host.shm_free_bytes), Bytes(host.shm_total_bytes), plan.ToString()));
  }
  return absl::OkStatus();
}

}  // namespace slidedp::hostd
