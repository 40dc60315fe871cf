// PlanRoutes: the job's routes, staging and memory plan; see job_plan.h.
#include "hostd/engine/job_plan.h"

#include <algorithm>
#include <climits>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/model/shard.h"
#include "common/policy/context_memory.h"
#include "common/status/status_macros.h"
#include "hostd/engine/initial_weights.h"
#include "hostd/engine/undo_arena.h"
#include "shm/shm_collective.h"

namespace slidedp::hostd {
namespace {

// The most tokens a rank's share of a `tokens`-token micro-batch split over `ranks` holds: two
// chunks of at most ceil(tokens / 2 ranks) (common/data/context_parallel.h), with room to spare.
int64_t ContextShareTokens(int64_t tokens, int64_t ranks) { return (tokens + 2 * ranks - 1) / (2 * ranks) * 2 + 2; }

// What the CUDA backend's gemma4 layer takes (worker/compute/cuda/cuda_gemma4_layer.cc; the CPU
// backend runs any of it): refused here by the field, before any host state, rather than by a
// worker at job start.
absl::Status CheckGemma4OnCudaWorkers(const JobSpec& spec, const ModelConfig& c, int cuda_workers, int world) {
  const std::string on = absl::StrCat(ModelTypeName(c.family), " on CUDA workers (", cuda_workers, " of ", world,
                                      " workers are CUDA; runtime.backend: cpu runs it)");
  // Its q/k norm + RoPE and attention kernels (worker/kernels/qk_norm_rope.h, attention.h, cuDNN's
  // graphs) take head dims up to 256; every released Gemma 4's full-attention layers have 512.
  constexpr int64_t kCudaMaxHeadDim = 256;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) {
    const int64_t hd = c.LayerHeadDim(l);
    if (hd <= kCudaMaxHeadDim && hd % 8 == 0) continue;
    const char* field = c.IsSlidingLayer(l) ? "head_dim" : "global_head_dim (per_layer_config head_dim)";
    return absl::UnimplementedError(absl::StrCat(on, ": ", field, " ", hd, " of layer ", l,
                                                 " is not built; the CUDA backend's attention takes head dims that are "
                                                 "multiples of 8 up to ", kCudaMaxHeadDim));
  }
  // Its per-layer input norm and table rows (the RMSNorm and embedding kernels' 8-wide rows).
  const int64_t ple = c.gemma4.ple_dim;
  if (ple > 0 && (ple % 8 != 0 || ple > 8192)) {
    return absl::InvalidArgumentError(absl::StrCat(on, ": hidden_size_per_layer_input ", ple,
                                                   " must be a multiple of 8 up to 8192"));
  }
  // What only the GPU test case that still fails exercises (tiny-gemma4: backward 4-7.6% from the CPU
  // backend on 4 of 6 seeds, docs/gpu-results.md row 115) stays on CPU workers until it is understood:
  // the double-wide MLP, per-layer inputs narrower than 16, a multimodal checkpoint's placeholders.
  // (k_eq_v, kv sharing and per-layer inputs of 16 pass in the other cases.)
  if (c.gemma4.double_wide_mlp) {
    return absl::UnimplementedError(absl::StrCat(on, ": use_double_wide_mlp is not verified on a GPU yet"));
  }
  if (ple > 0 && ple < 16) {
    return absl::UnimplementedError(
        absl::StrCat(on, ": hidden_size_per_layer_input ", ple, " (under 16) is not verified on a GPU yet"));
  }
  if (c.multimodal) {
    return absl::UnimplementedError(absl::StrCat(
        on, ": a multimodal checkpoint (its image/audio placeholders in the embedding) is not verified on a GPU yet"));
  }
  // The per-layer inputs and shared keys and values wait in each micro-batch's state on the device,
  // which a context-parallel group would have to split and gather.
  if (spec.runtime.context_parallel > 1) {
    return absl::UnimplementedError(absl::StrCat(on, ": runtime.context_parallel ", spec.runtime.context_parallel,
                                                 " is not built (use context_parallel: 1)"));
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<WorkerDevice> WorkerDevicesOf(absl::Span<const v1::WorkerHello> hellos) {
  std::vector<WorkerDevice> out;
  for (const v1::WorkerHello& h : hellos) {
    out.push_back({h.device().kind() == "cpu", h.device().memory_bytes(), h.device().uuid(), h.worker_id()});
  }
  return out;
}

JobSpec RoutePlan::WorkerSpec(const JobSpec& spec) const {
  JobSpec out = spec;
  out.runtime.grad_reduction = route;
  out.runtime.grad_reduction_auto = false;
  out.runtime.param_delivery_auto = false;
  out.runtime.grad_staging = clip_staging == ClipStaging::kDevice ? GradStaging::kDevice : GradStaging::kHost;
  return out;
}

std::string RoutePlan::RoutesLine(ParamDelivery delivery) const {
  const char* reduction =
      route == GradReduction::kGpu
          ? (shm_collective ? "gpu route (CPU workers: shm reduce-scatter), hostd applies each rank's shard"
                            : "gpu route (NCCL reduce-scatter), hostd applies each rank's shard")
          : (world > 1 ? "cpu (hostd sums the ranks' gradients)" : "single rank (no reduction)");
  std::string staging;
  const char* why = clip_by_norm && skip_nonfinite ? "clipping and skip_nonfinite"
                    : clip_by_norm                 ? "clipping"
                                                   : "skip_nonfinite";
  if (clip_staging == ClipStaging::kDevice) {
    staging = absl::StrCat("; ", why,
                           ": device staging (each rank keeps its gradient parts on its GPU until the norm is known)");
  } else if (clip_staging == ClipStaging::kHost) {
    staging = absl::StrCat("; ", why, ": host staging (hostd keeps the step's gradients)");
  }
  const char* dtype = grad_dtype == Dtype::kBF16
                          ? "; gradients cross the host link in BF16 (runtime.grad_dtype: an approximation)"
                          : "";
  const std::string moment_note =
      moments == MomentForm::kF32
          ? std::string()
          : absl::StrCat("; Adam moments kept in ", ToString(moments), " (optimizer.state_dtype: an approximation)");
  const char* source =
      mirror ? ""
      : cast_on == CastOn::kHost
          ? "; no BF16 mirror: workers cast the FP32 master at upload, on the host (runtime.param_source, cast_on)"
          : "; no BF16 mirror: workers cast the FP32 master at upload, on the GPU (runtime.param_source, cast_on; CPU "
            "workers on the host)";
  const std::string context =
      context_ranks > 1 ? absl::StrCat("; context parallel: ", world / context_ranks, " group(s) of ", context_ranks,
                                       " ranks split each micro-batch, attention's keys and values through ",
                                       context_on_nccl ? "NCCL" : "shm")
                        : std::string();
  return absl::StrCat("gradient reduction: ", reduction, "; parameter delivery: ", ToString(delivery), staging, dtype,
                      moment_note, source, context);
}

std::string RoutePlan::MemoryLine() const {
  return absl::StrCat(
      "host state: ", memory.ToString(),
      shm_collective
          ? absl::StrFormat(" + shm collective %.2f GiB",
                            shm::ShmCollective::SegmentBytes(world, collective_buffer_bytes) / double(1ull << 30))
          : std::string());
}

int CpuWorkersOf(absl::Span<const WorkerDevice> workers) {
  int n = 0;
  for (const WorkerDevice& w : workers) n += w.cpu_backend;
  return n;
}

absl::Status CheckBatchSplit(const JobSpec& spec, int world) {
  if (world <= 0) return absl::InvalidArgumentError("a job needs at least one worker");
  // Data-parallel ranks: the workers, or their context-parallel groups (each splits its micro-batches).
  const int cp = std::max(1, spec.runtime.context_parallel);
  if (world % cp != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("runtime.context_parallel ", cp, " does not divide the job's ", world, " workers"));
  }
  const int dp = world / cp;
  if (spec.train.global_batch % (int64_t{dp} * spec.train.micro_batch) != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "train.global_batch ", spec.train.global_batch, " is not divisible by ", dp,
        cp > 1 ? " context-parallel group(s)" : " worker(s)", " x train.micro_batch ", spec.train.micro_batch));
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> CheckWorkersFit(const JobSpec& spec, const ModelLayout& layout,
                                     absl::Span<const WorkerDevice> workers) {
  const int world = static_cast<int>(workers.size());
  const bool gpu_route = spec.runtime.grad_reduction == GradReduction::kGpu && world > 1;
  const int cpu_workers = CpuWorkersOf(workers);
  // runtime.backend names the workers' backend (`slidedp run` starts them so; on a node service
  // the attached workers must be of it).
  if ((spec.runtime.backend == Backend::kCuda && cpu_workers > 0) ||
      (spec.runtime.backend == Backend::kCpu && cpu_workers < world)) {
    return absl::FailedPreconditionError(
        absl::StrCat("runtime.backend ", ToString(spec.runtime.backend), ": ",
                     spec.runtime.backend == Backend::kCuda ? cpu_workers : world - cpu_workers, " of the job's ",
                     world, " workers are ", spec.runtime.backend == Backend::kCuda ? "CPU-backend" : "CUDA",
                     " workers (runtime.backend auto takes either)"));
  }
  // Sharded delivery all-gathers each unit over NCCL: CUDA workers only.
  if (spec.runtime.param_delivery == ParamDelivery::kSharded && world > 1 && cpu_workers > 0) {
    return absl::FailedPreconditionError(
        absl::StrCat("runtime.param_delivery sharded all-gathers over NCCL and needs CUDA workers; ", cpu_workers,
                     " of ", world, " are CPU-backend (use replicated or auto)"));
  }
  // A job over nodes links each node's ranks to the others' by one engine: Gloo for CPU-backend
  // workers, NCCL for CUDA workers (docs/multi-node.md).
  if (!spec.runtime.nodes.empty() && cpu_workers != 0 && cpu_workers != world) {
    return absl::FailedPreconditionError(absl::StrCat("runtime.nodes needs workers of one backend on every node; ",
                                                      cpu_workers, " of this node's ", world, " are CPU-backend"));
  }
  if (gpu_route && cpu_workers != 0 && cpu_workers != world) {
    return absl::FailedPreconditionError(absl::StrCat("runtime.grad_reduction gpu needs workers of one backend; ",
                                                      cpu_workers, " of ", world,
                                                      " are CPU-backend (use grad_reduction: cpu)"));
  }
  // gemma4 runs on both backends (the CPU backend's gemma4_math.h, the CUDA backend's
  // cuda_gemma4_layer.cc), but for what the CUDA backend's kernels do not take.
  if (layout.config.is_gemma4() && cpu_workers != world) {
    RETURN_IF_ERROR(CheckGemma4OnCudaWorkers(spec, layout.config, world - cpu_workers, world));
  }
  // Sliding-window attention shorter than the row runs on both backends (HF's mask exactly: the CPU
  // backend's dense_attention_math.cc, the CUDA backend's own flash kernels with AttnArgs::window,
  // which skip the key blocks outside the band; cuDNN takes the full-attention layers).
  // The Gated DeltaNet's state runs through the whole sequence in order: context parallelism would
  // split it across ranks, which this build does not carry.
  if (layout.config.is_qwen3_5() && spec.runtime.context_parallel > 1 && layout.config.NumLinearAttentionLayers() > 0) {
    return absl::UnimplementedError(absl::StrCat(
        "runtime.context_parallel ", spec.runtime.context_parallel, " with ", ModelTypeName(layout.config.family),
        ": the Gated DeltaNet's recurrent state does not pass between ranks in this build (use context_parallel: 1; "
        "its layers are O(T) in memory)"));
  }
  // What the CUDA backend's MoE block takes (worker/compute/cuda/cuda_moe.cc): refused here, before
  // any host state, rather than by a worker at job start.
  if (layout.config.is_moe() && cpu_workers != world && layout.config.NumSparseLayers() > 0) {
    constexpr int64_t kCudaMoeMaxExperts = 2048;  // worker/kernels/moe.h kMoeMaxExperts
    // (gpt_oss's block takes any width: worker/kernels/gpt_oss_moe.h)
    const bool width_ok = layout.config.is_gpt_oss() || layout.config.moe_intermediate_size % 8 == 0;
    if (!width_ok || layout.config.num_experts > kCudaMoeMaxExperts) {
      return absl::InvalidArgumentError(
          absl::StrCat(ModelTypeName(layout.config.family),
                       " on CUDA workers needs moe_intermediate_size a multiple of 8 and at most ", kCudaMoeMaxExperts,
                       " experts; the model has ", layout.config.moe_intermediate_size, " and ",
                       layout.config.num_experts, " (the CPU backend runs any)"));
    }
  }
  // NCCL needs one GPU per rank: CUDA workers sharing a GPU (slidedp-worker --id) can run a job
  // only where nothing goes over NCCL (the cpu route, replicated delivery; context parallelism then
  // goes through shm).
  const bool nccl =
      cpu_workers == 0 && world > 1 && (gpu_route || spec.runtime.param_delivery == ParamDelivery::kSharded);
  if (nccl) {
    for (size_t i = 0; i < workers.size(); ++i) {
      for (size_t j = i + 1; j < workers.size(); ++j) {
        if (!workers[i].uuid.empty() && workers[i].uuid == workers[j].uuid) {
          return absl::FailedPreconditionError(absl::StrCat(
              "workers '", workers[i].worker_id, "' and '", workers[j].worker_id, "' share GPU ", workers[i].uuid,
              ", and NCCL (grad_reduction: gpu or sharded delivery) needs one GPU per rank: use grad_reduction: cpu "
              "with replicated delivery, or workers on separate GPUs"));
        }
      }
    }
  }
  if (spec.runtime.context_parallel > 1 && cpu_workers != 0 && cpu_workers != world) {
    return absl::FailedPreconditionError(absl::StrCat("runtime.context_parallel needs workers of one backend; ",
                                                      cpu_workers, " of ", world, " are CPU-backend"));
  }
  return nccl;
}

void PlanContextGroups(const JobSpec& spec, const ModelLayout& layout, bool nccl, RoutePlan& p) {
  // Context parallelism: attention's collectives over the group. CUDA workers with a NCCL
  // communicator (the gpu route or sharded delivery, world > 1) gather over NCCL (a communicator
  // split per group); otherwise through a shm segment per group, which CPU workers always use and
  // CUDA workers stage through host memory (a micro-batch's keys and values, 2 kv_dim FP32 per
  // token of a rank's padded share, every rank's in one buffer for the reduce-scatter of their
  // gradients).
  if (spec.runtime.context_parallel <= 1) return;
  const int64_t ranks = spec.runtime.context_parallel;
  p.context_ranks = static_cast<int>(ranks);
  p.context_on_nccl = nccl;
  const int64_t part = ContextShareTokens(static_cast<int64_t>(spec.train.micro_batch) * spec.train.seq_len, ranks);
  if (!p.context_on_nccl) {
    p.context_buffer_bytes = static_cast<uint64_t>(ranks * part * 2 * layout.config.kv_dim()) * sizeof(float);
  }
}

absl::Status PlanGradientRoute(const JobSpec& spec, const ModelLayout& layout, absl::Span<const WorkerDevice> workers,
                               RoutePlan& p, const ModelLayout* host_layout) {
  const ModelLayout& host = host_layout != nullptr ? *host_layout : layout;
  const int world = p.world;
  const int cpu_workers = CpuWorkersOf(workers);
  const bool clip = spec.train.max_grad_norm > 0;
  p.clip_by_norm = clip;
  p.skip_nonfinite = spec.train.skip_nonfinite;
  // Skipping a non-finite step needs nothing applied before the whole step is known finite: the
  // same staging as exact clipping (with coefficient 1 when not clipping).
  const bool stage = clip || spec.train.skip_nonfinite;
  // gpu: every rank reduce-scatters each unit's gradient and posts only its own, already summed
  // shard (common/model/shard.h); hostd applies the shards as they come, summing nothing. One rank
  // has nothing to reduce: it takes the cpu route.
  const bool gpu_route = spec.runtime.grad_reduction == GradReduction::kGpu && world > 1;
  p.route = gpu_route ? GradReduction::kGpu : GradReduction::kCpu;
  // CPU-backend workers reduce-scatter through a shm collective segment hostd creates for the job.
  p.shm_collective = gpu_route && cpu_workers == world;
  if (p.shm_collective) {
    for (const UnitLayout& u : layout.units) {
      p.collective_buffer_bytes =
          std::max<uint64_t>(p.collective_buffer_bytes, static_cast<uint64_t>(PaddedNumel(u.numel, world)) * 4);
    }
  }

  // With the gpu route (or one rank) every posted part is final, so each rank can keep its parts
  // on its device until backward ends, post its squared norm, then its parts in forward order;
  // hostd applies them with the coefficient straight from the rings and stages nothing.
  // Otherwise hostd stages the whole step's gradient (FP32, 4 bytes per parameter) in its memory.
  // auto: device where the rank's parts take at most 40% of the smallest worker's device memory.
  const bool parts_final = gpu_route || world == 1;
  if (spec.runtime.grad_staging == GradStaging::kDevice && !parts_final) {
    return absl::InvalidArgumentError(
        "runtime.grad_staging device needs runtime.grad_reduction gpu (or one worker): "
        "with grad_reduction cpu hostd sums the ranks' gradients, so only it knows the norm");
  }
  bool device_staging = false;
  if (stage && parts_final && spec.runtime.grad_staging != GradStaging::kHost) {
    int64_t min_device_bytes = INT64_MAX;
    for (const WorkerDevice& w : workers) min_device_bytes = std::min<int64_t>(min_device_bytes, w.memory_bytes);
    const int64_t part_bytes = PaddedNumel(layout.total_numel, world) / world * 4;
    // Sharded nodes: no host holds the whole gradient, so the ranks bring the norm (job_spec refuses host).
    device_staging = spec.runtime.grad_staging == GradStaging::kDevice || part_bytes <= min_device_bytes / 10 * 4 ||
                     spec.runtime.node_state == NodeState::kSharded;
  }
  p.clip_staging = !stage ? ClipStaging::kNone : device_staging ? ClipStaging::kDevice : ClipStaging::kHost;
  p.grad_dtype = spec.runtime.grad_dtype;
  p.moments = spec.optimizer.state_dtype == MomentForm::kInt8   ? MomentForm::kInt8
              : spec.optimizer.state_dtype == MomentForm::kBF16 ? MomentForm::kBF16
                                                                : MomentForm::kF32;
  p.mirror = spec.runtime.param_source == ParamSource::kMirror;
  p.cast_on = spec.runtime.cast_on;

  // Device staging and the gpu route: one consumer per rank applies its final parts. One rank
  // without clipping: LayerAdam reads gradients straight from the ring slots (a slot is released
  // when its update is done). Otherwise hostd sums the ranks' copies in rank order.
  p.consumer = (gpu_route || device_staging) ? GradConsumerKind::kShards
               : (!stage && world == 1)      ? GradConsumerKind::kDirect
                                             : GradConsumerKind::kSummed;
  // Host staging: for the clipping norm when the ranks do not bring it, or to sum the ranks' full
  // copies (cpu route). Shard consumers apply straight from the rings, so one rank with device
  // staging stages nothing either.
  p.host_staging = p.clip_staging == ClipStaging::kHost || p.consumer == GradConsumerKind::kSummed;
  p.staging_bytes = p.host_staging ? static_cast<uint64_t>(host.total_numel) * 4 : 0;
  p.shard_numel_of_rank.assign(world, 0);
  for (int r = 0; r < world; ++r) {
    for (const UnitLayout& u : host.units)
      p.shard_numel_of_rank[r] += gpu_route ? ShardOf(u.numel, world, r).numel : u.numel;
  }
  return absl::OkStatus();
}

absl::Status PlanMemory(const JobSpec& spec, const ModelLayout& layout, absl::Span<const WorkerDevice> workers,
                        RoutePlan& p, const ModelLayout* host_layout) {
  const ModelLayout& host = host_layout != nullptr ? *host_layout : layout;
  const int world = p.world;
  const int cpu_workers = CpuWorkersOf(workers);
  const int dp = world / std::max(1, spec.runtime.context_parallel);
  const bool stage = p.clip_by_norm || p.skip_nonfinite;
  p.ring = RingConfigFor(layout, spec.runtime.ring_slots, spec.runtime.chunk_bytes);
  p.memory = PlanJobMemory(host, p.ring, world,
                           p.clip_staging == ClipStaging::kHost ? ClipMode::kExactGlobalNorm : ClipMode::kNone,
                           Dtype::kF32, p.state_format());
  // Host cast staging: CUDA workers casting on the host (runtime.cast_on host), and CPU workers,
  // whose device is the host. CUDA workers casting on the GPU stage FP32 chunks on the GPU.
  if (!p.mirror) {
    int host_casters = 0;
    for (const WorkerDevice& w : workers) host_casters += w.cpu_backend || spec.runtime.cast_on == CastOn::kHost;
    AddCastStaging(host_casters, CastStagingChunkBytes(layout, spec.runtime.chunk_bytes), p.memory);
  }
  // The summing buffer is hostd's own memory (not shm); the cpu route with several ranks needs it
  // even without clipping (with clipping the plan above has it).
  if (p.host_staging && p.clip_staging != ClipStaging::kHost) {
    p.memory.step_staging_bytes = p.staging_bytes;
    p.memory.total_bytes += p.staging_bytes;
  }
  // Each worker's offloaded checkpoints: its rows of the step, seq_len tokens each. A per-layer
  // layout (runtime.policy) says what each layer keeps and offloads, in place of act_policy and
  // offload_ratio; it must have been made for this model.
  const int64_t tokens_per_worker = spec.train.global_batch / world * spec.train.seq_len;
  // A layer input waits in BF16 with runtime.checkpoint_dtype bf16: 2 B an element, offloaded or not.
  const int64_t input_element_bytes = DtypeBytes(spec.runtime.checkpoint_dtype);
  const bool cuda_workers = cpu_workers == 0;
  if (spec.runtime.layer_layout) {
    RETURN_IF_ERROR(spec.runtime.layer_layout->CheckModel(layout.config));
    const int64_t micro_batches =
        std::max<int64_t>(1, spec.train.global_batch / dp / std::max<int64_t>(1, spec.train.micro_batch));
    OffloadedPerToken per_token;
    per_token.input_element_bytes = input_element_bytes;
    for (const LayerPolicy& l : spec.runtime.layer_layout->layers) {
      // The share the store moves: whole micro-batches, at least one (activation_store.h).
      const double share = l.offload > 0 ? std::min(1.0, std::ceil(l.offload * micro_batches) / micro_batches) : 0;
      per_token.input_elements += share * static_cast<double>(layout.config.hidden_size);
      per_token.kept_bytes += share * static_cast<double>(KeptBytesPerToken(layout.config, l.pieces(), cuda_workers));
    }
    AddOffloadedCheckpoints(per_token, world, tokens_per_worker, p.memory);
  } else {
    const uint32_t kept = spec.runtime.act_policy == ActivationPolicy::kRecomputeLayer ? 0u
                          : spec.runtime.act_policy == ActivationPolicy::kSelective    ? uint32_t{kPieceAttention}
                                                                                       : kAllPieces;
    AddActivationOffload(layout, spec.runtime.offload_ratio, kept, input_element_bytes, cuda_workers, world,
                         tokens_per_worker, p.memory);
  }
  // The GPU memory floor of the step on each CUDA worker (common/policy/context_memory.h): a job
  // whose floor is over a device is refused here, with the longest sequence the model fits.
  // With context parallelism a rank holds its share of each micro-batch (two chunks of at most
  // ceil(T / 2C)) and, in attention, the whole micro-batch's keys and values.
  const int64_t whole_micro_tokens = static_cast<int64_t>(spec.train.micro_batch) * spec.train.seq_len;
  const int64_t micro_tokens = p.context_ranks > 1 ? ContextShareTokens(whole_micro_tokens, p.context_ranks)
                                                   : whole_micro_tokens;
  // Layers whose inputs may wait in host memory: runtime.offload_ratio's, a layout's with any share
  // offloaded (its one micro-batch, or some of them), or, with runtime.policy auto (AutoPolicy picks
  // the shares later), every layer: the floor never counts an input that may be offloaded.
  int offloaded_layers = layout.OffloadedLayers(spec.runtime.offload_ratio);
  if (spec.runtime.policy_auto) offloaded_layers = static_cast<int>(layout.config.num_hidden_layers);
  if (spec.runtime.layer_layout) {
    offloaded_layers = 0;
    for (const LayerPolicy& l : spec.runtime.layer_layout->layers) offloaded_layers += l.offload > 0;
  }
  const int64_t tile = spec.runtime.tile_tokens > 0 ? spec.runtime.tile_tokens : kDefaultTileTokens;
  p.device_floor = EstimateContextMemory(layout, {tokens_per_worker, micro_tokens, offloaded_layers, tile,
                                                 input_element_bytes, p.context_ranks > 1 ? whole_micro_tokens : 0});
  for (const WorkerDevice& w : workers) {
    if (w.cpu_backend || w.memory_bytes <= 0) continue;
    const int64_t limit = GpuMemoryLimitBytes(spec, w.memory_bytes);
    const int64_t capacity = GpuCapacityBytes(spec, w.memory_bytes);
    if (p.device_floor.device_total() <= capacity) continue;
    const LongestSequence longest = FindLongestSequence(
        layout, capacity, -1, tile, std::max<int64_t>(micro_tokens, int64_t{1} << 24), input_element_bytes);
    return absl::ResourceExhaustedError(absl::StrFormat(
        "GPU memory: a step of %d tokens per GPU in micro-batches of %d needs at least %s; the GPU has %.1f GiB%s. "
        "The longest single sequence (train.seq_len, micro_batch 1, one row per GPU per step) this model fits in "
        "it is %d tokens%s; lower train.seq_len, train.micro_batch or the rows per step, raise "
        "runtime.offload_ratio%s%s",
        tokens_per_worker, micro_tokens, p.device_floor.ToString(), capacity / 1073741824.0,
        limit > 0 ? " (runtime.gpu_memory_limit)" : "", longest.tokens,
        longest.offloaded_layers > 0
            ? absl::StrFormat(" with %d of %d layers' inputs offloaded (runtime.offload_ratio %.2f, %.1f GiB of "
                              "pinned host memory)",
                              longest.offloaded_layers, layout.config.num_hidden_layers,
                              static_cast<double>(longest.offloaded_layers) / layout.config.num_hidden_layers,
                              longest.memory.offloaded / 1073741824.0)
            : std::string(),
        // qwen3_5's layers run untiled (context_memory.h): a smaller tile leaves them as they are.
        layout.config.is_qwen3_5() ? "" : ", set a smaller runtime.tile_tokens",
        spec.runtime.checkpoint_dtype == Dtype::kF32
            ? ", or keep the layer inputs in BF16 (runtime.checkpoint_dtype: bf16, an approximation)"
            : ""));
  }
  if (p.shm_collective) {
    const uint64_t coll_bytes = shm::ShmCollective::SegmentBytes(world, p.collective_buffer_bytes);
    p.memory.shm_bytes += coll_bytes;
    p.memory.total_bytes += coll_bytes;
  }
  if (p.context_buffer_bytes > 0) {
    const uint64_t ctx_bytes =
        (world / p.context_ranks) * shm::ShmCollective::SegmentBytes(p.context_ranks, p.context_buffer_bytes);
    p.memory.shm_bytes += ctx_bytes;
    p.memory.total_bytes += ctx_bytes;
  }
  // Speculative clipping needs a step that waits for the whole gradient (clipping or skipping).
  // Its undo copies keep the job's moment form (undo_arena.h).
  p.speculate_from_unit = host.num_units();
  if (stage && spec.runtime.speculation_bytes > 0) {
    p.speculate_from_unit =
        FirstSpeculatedUnit(host, static_cast<uint64_t>(spec.runtime.speculation_bytes), p.moments);
    p.memory.undo_bytes = UndoBytes(host, p.speculate_from_unit, p.moments);
    p.memory.total_bytes += p.memory.undo_bytes;
  }
  p.speculation_auto = stage && spec.runtime.speculation_bytes < 0;
  return absl::OkStatus();
}

absl::StatusOr<RoutePlan> PlanRoutes(const JobSpec& spec, const ModelLayout& layout,
                                     absl::Span<const WorkerDevice> workers, const ModelLayout* host_layout) {
  RoutePlan p;
  p.world = static_cast<int>(workers.size());
  RETURN_IF_ERROR(CheckBatchSplit(spec, p.world));
  ASSIGN_OR_RETURN(const bool nccl, CheckWorkersFit(spec, layout, workers));
  PlanContextGroups(spec, layout, nccl, p);
  RETURN_IF_ERROR(PlanGradientRoute(spec, layout, workers, p, host_layout));
  RETURN_IF_ERROR(PlanMemory(spec, layout, workers, p, host_layout));
  return p;
}

void SizeSpeculation(const ModelLayout& layout, uint64_t available_bytes, uint64_t mem_total_bytes, RoutePlan& plan) {
  if (!plan.speculation_auto) return;
  // Left to the OS, the workers and the page cache besides what admission reserves: 4 GiB or 5%
  // of the host's memory, whichever is more.
  const uint64_t margin = std::max<uint64_t>(4ull << 30, mem_total_bytes / 20);
  const uint64_t used = plan.memory.total_bytes + margin;
  const uint64_t budget = available_bytes > used ? available_bytes - used : 0;
  plan.speculate_from_unit = FirstSpeculatedUnit(layout, budget, plan.moments);
  plan.memory.undo_bytes = UndoBytes(layout, plan.speculate_from_unit, plan.moments);
}

}  // namespace slidedp::hostd
