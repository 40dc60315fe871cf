// PlanRoutes's decisions: route, where clipping waits, the consumer, host staging, and what the
// memory plan counts for each.
#include "hostd/engine/job_plan.h"
#include "hostd/engine/step_metrics.h"
#include "hostd/engine/undo_arena.h"

#include <algorithm>
#include <vector>

#include "absl/strings/match.h"
#include "common/model/shard.h"
#include "gtest/gtest.h"
#include "shm/shm_collective.h"

namespace slidedp::hostd {
namespace {

ModelLayout Layout(const char* preset = "qwen3-0.6b") { return ModelLayout::Build(*ModelConfig::Preset(preset)); }

JobSpec Spec(int world, double max_norm, GradReduction route = GradReduction::kGpu) {
  JobSpec s;
  s.model.preset = "qwen3-0.6b";
  s.train.seq_len = 1024;
  s.train.global_batch = 4 * world;
  s.train.micro_batch = 2;
  s.train.max_grad_norm = max_norm;
  s.runtime.grad_reduction = route;
  return s;
}

// One worker: a CPU-backend one (its "device" is host memory) or a GPU.
WorkerDevice Device(bool cpu_backend, int64_t memory_bytes) {
  WorkerDevice w;
  w.cpu_backend = cpu_backend;
  w.memory_bytes = memory_bytes;
  return w;
}

std::vector<WorkerDevice> Gpus(int n, int64_t memory_bytes = int64_t{141} << 30) {
  return std::vector<WorkerDevice>(n, Device(false, memory_bytes));
}

// Two CUDA workers on one GPU (slidedp-worker --id): NCCL cannot have both as ranks, so the gpu
// route and sharded delivery are refused naming them; the cpu route with replicated delivery runs.
TEST(RoutePlan, WorkersSharingAGpuAreRefusedWhereNcclWouldRun) {
  const ModelLayout layout = Layout();
  std::vector<WorkerDevice> shared = Gpus(2);
  shared[0].uuid = shared[1].uuid = "GPU-0000";
  shared[0].worker_id = "gpu0";
  shared[1].worker_id = "gpu0b";
  auto gpu = PlanRoutes(Spec(2, 0), layout, shared);
  EXPECT_EQ(gpu.status().code(), absl::StatusCode::kFailedPrecondition) << gpu.status();
  EXPECT_TRUE(absl::StrContains(gpu.status().message(), "'gpu0' and 'gpu0b' share GPU GPU-0000")) << gpu.status();
  JobSpec sharded = Spec(2, 0, GradReduction::kCpu);
  sharded.runtime.param_delivery = ParamDelivery::kSharded;
  EXPECT_EQ(PlanRoutes(sharded, layout, shared).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(PlanRoutes(Spec(2, 0, GradReduction::kCpu), layout, shared).ok());
  shared[1].uuid = "GPU-0001";  // separate GPUs
  EXPECT_TRUE(PlanRoutes(Spec(2, 0), layout, shared).ok());
}

// runtime.backend names the workers' backend: a job of the other backend's workers is refused
// (never run on them silently), and so is sharded delivery (NCCL) on CPU workers.
TEST(RoutePlan, TheSpecsBackendAndShardedDeliveryNeedTheirWorkers) {
  const ModelLayout layout = Layout();
  std::vector<WorkerDevice> cpus = {Device(true, int64_t{64} << 30), Device(true, int64_t{64} << 30)};
  JobSpec cuda = Spec(2, 0, GradReduction::kCpu);
  cuda.runtime.backend = Backend::kCuda;
  auto on_cpu = PlanRoutes(cuda, layout, cpus);
  EXPECT_EQ(on_cpu.status().code(), absl::StatusCode::kFailedPrecondition) << on_cpu.status();
  EXPECT_TRUE(absl::StrContains(on_cpu.status().message(), "runtime.backend cuda: 2 of the job's 2 workers are CPU"))
      << on_cpu.status();
  EXPECT_TRUE(PlanRoutes(cuda, layout, Gpus(2)).ok());
  JobSpec cpu = cuda;
  cpu.runtime.backend = Backend::kCpu;
  EXPECT_EQ(PlanRoutes(cpu, layout, Gpus(2)).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(PlanRoutes(cpu, layout, cpus).ok());
  JobSpec sharded = Spec(2, 0, GradReduction::kCpu);
  sharded.runtime.param_delivery = ParamDelivery::kSharded;
  auto s = PlanRoutes(sharded, layout, cpus);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition) << s.status();
  EXPECT_TRUE(absl::StrContains(s.status().message(), "sharded")) << s.status();
  EXPECT_TRUE(PlanRoutes(sharded, layout, Gpus(2)).ok());
}

// runtime.context_parallel: CPU workers get a "ctx" collective sized for every rank's padded share of
// a micro-batch's keys and values, counted in the shm plan; CUDA workers use it or NCCL.
TEST(RoutePlan, ContextParallelPlansItsCollectivePerBackendAndRoute) {
  const ModelLayout layout = Layout();
  JobSpec s = Spec(2, 0);
  s.runtime.workers = 2;
  s.runtime.context_parallel = 2;
  const std::vector<WorkerDevice> cpus(2, Device(true, int64_t{64} << 30));
  auto p = PlanRoutes(s, layout, cpus);
  ASSERT_TRUE(p.ok()) << p.status();
  // 2 x 1024 tokens over 2 ranks: shares of at most 1,024 (+2), 2 kv_dim FP32 per token, 2 ranks.
  const uint64_t part = (2048 + 3) / 4 * 2 + 2;
  EXPECT_EQ(p->context_buffer_bytes, 2 * part * 2 * layout.config.kv_dim() * 4);
  JobSpec plain = s;
  plain.runtime.context_parallel = 1;
  auto q = PlanRoutes(plain, layout, cpus);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->context_buffer_bytes, 0u);
  EXPECT_EQ(p->memory.shm_bytes - q->memory.shm_bytes, shm::ShmCollective::SegmentBytes(2, p->context_buffer_bytes));
  // The GPU floor of a context-parallel CUDA rank: its share of the micro-batch, and the whole
  // micro-batch's gathered keys and values in attention.
  {
    JobSpec f = s;
    f.runtime.grad_reduction = GradReduction::kCpu;
    auto cp2 = PlanRoutes(f, layout, Gpus(2));
    ASSERT_TRUE(cp2.ok()) << cp2.status();
    const int64_t share = (2048 + 3) / 4 * 2 + 2;
    EXPECT_EQ(cp2->device_floor.attention,
              EstimateContextMemory(layout, {2048, share, 0, kDefaultTileTokens, 4}).attention +
                  2048 * ContextGatherBytesPerToken(layout.config));
    EXPECT_EQ(cp2->device_floor.residual, 2 * share * layout.config.hidden_size * 4);
  }
  // CUDA workers: through the same segment with the cpu route and replicated delivery (staged in
  // host memory), over NCCL with a communicator (gpu route or sharded delivery); not mixed with CPU
  // workers.
  JobSpec cpu_route = s;
  cpu_route.runtime.grad_reduction = GradReduction::kCpu;
  auto staged = PlanRoutes(cpu_route, layout, Gpus(2));
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_FALSE(staged->context_on_nccl);
  EXPECT_EQ(staged->context_buffer_bytes, p->context_buffer_bytes);
  JobSpec gpu_route = s;
  gpu_route.runtime.grad_reduction = GradReduction::kGpu;
  auto nccl = PlanRoutes(gpu_route, layout, Gpus(2));
  ASSERT_TRUE(nccl.ok()) << nccl.status();
  EXPECT_TRUE(nccl->context_on_nccl);
  EXPECT_EQ(nccl->context_buffer_bytes, 0u);
  EXPECT_TRUE(absl::StrContains(nccl->RoutesLine(ParamDelivery::kReplicated), "keys and values through NCCL"));
  JobSpec sharded = cpu_route;
  sharded.runtime.param_delivery = ParamDelivery::kSharded;
  auto split = PlanRoutes(sharded, layout, Gpus(2));
  ASSERT_TRUE(split.ok()) << split.status();
  EXPECT_TRUE(split->context_on_nccl);
  std::vector<WorkerDevice> mixed = Gpus(1);
  mixed.push_back(Device(true, int64_t{64} << 30));
  auto m = PlanRoutes(cpu_route, layout, mixed);
  EXPECT_EQ(m.status().code(), absl::StatusCode::kFailedPrecondition) << m.status();
  EXPECT_TRUE(absl::StrContains(m.status().message(), "context_parallel")) << m.status();
  JobSpec moe_cuda = cpu_route;  // MoE models on CUDA workers too (the group sums router statistics)
  moe_cuda.model.preset = "tiny-moe";
  auto mc = PlanRoutes(moe_cuda, Layout("tiny-moe"), Gpus(2));
  EXPECT_TRUE(mc.ok()) << mc.status();
  // One group of two shares one micro-batch of 4 rows: a global batch of 4 is one micro-batch for it,
  // which two data-parallel workers could not split.
  JobSpec one_micro = s;
  one_micro.train.global_batch = 4;
  one_micro.train.micro_batch = 4;
  EXPECT_TRUE(PlanRoutes(one_micro, layout, cpus).ok());
  one_micro.runtime.context_parallel = 1;
  EXPECT_EQ(PlanRoutes(one_micro, layout, cpus).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(p->RoutesLine(ParamDelivery::kReplicated), "context parallel: 1 group(s) of 2"));
  JobSpec moe = s;  // a MoE model too: its router statistics are summed over the group
  moe.model.preset = "tiny-moe";
  EXPECT_TRUE(PlanRoutes(moe, Layout("tiny-moe"), cpus).ok());
}

TEST(RoutePlan, OneRankWithoutClippingAppliesStraightFromTheRing) {
  const ModelLayout layout = Layout();
  auto p = PlanRoutes(Spec(1, 0), layout, Gpus(1));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->route, GradReduction::kCpu);  // one rank has nothing to reduce
  EXPECT_EQ(p->consumer, GradConsumerKind::kDirect);
  EXPECT_EQ(p->clip_staging, ClipStaging::kNone);
  EXPECT_FALSE(p->host_staging);
  EXPECT_EQ(p->staging_bytes, 0u);
  EXPECT_EQ(p->memory.step_staging_bytes, 0u);
  EXPECT_EQ(p->WorkerSpec(JobSpec{}).runtime.grad_reduction, GradReduction::kCpu);
  ASSERT_EQ(p->shard_numel_of_rank.size(), 1u);
  int64_t numel = 0;
  for (const UnitLayout& u : layout.units) numel += u.numel;
  EXPECT_EQ(p->shard_numel_of_rank[0], numel);
  EXPECT_TRUE(absl::StrContains(p->RoutesLine(ParamDelivery::kReplicated), "single rank"));
}

TEST(RoutePlan, OneRankWithClippingStagesOnTheDeviceWhenItFits) {
  const ModelLayout layout = Layout();
  auto big = PlanRoutes(Spec(1, 1.0), layout, Gpus(1));
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ(big->clip_staging, ClipStaging::kDevice);
  EXPECT_EQ(big->consumer, GradConsumerKind::kShards);
  EXPECT_FALSE(big->host_staging);  // one rank with device staging holds no whole-step buffer
  EXPECT_EQ(big->memory.step_staging_bytes, 0u);
  EXPECT_EQ(big->WorkerSpec(Spec(1, 1.0)).runtime.grad_staging, GradStaging::kDevice);
  EXPECT_TRUE(absl::StrContains(big->RoutesLine(ParamDelivery::kReplicated), "clipping: device staging"));

  // auto: the parts must take at most 40% of the device (0.6B: 2.4 GB of FP32 gradients).
  auto small = PlanRoutes(Spec(1, 1.0), layout, Gpus(1, int64_t{4} << 30));
  ASSERT_TRUE(small.ok());
  EXPECT_EQ(small->clip_staging, ClipStaging::kHost);
  EXPECT_EQ(small->consumer, GradConsumerKind::kSummed);
  EXPECT_TRUE(small->host_staging);
  EXPECT_EQ(small->staging_bytes, static_cast<uint64_t>(layout.total_numel) * 4);
  EXPECT_EQ(small->memory.step_staging_bytes, small->staging_bytes);

  JobSpec forced = Spec(1, 1.0);
  forced.runtime.grad_staging = GradStaging::kHost;
  EXPECT_EQ(PlanRoutes(forced, layout, Gpus(1))->clip_staging, ClipStaging::kHost);
  forced.runtime.grad_staging = GradStaging::kDevice;
  EXPECT_EQ(PlanRoutes(forced, layout, Gpus(1, int64_t{4} << 30))->clip_staging, ClipStaging::kDevice);
}

// train.skip_nonfinite stages the whole step like clipping (nothing may be applied before the
// step is known finite), also without clipping: device staging where it fits, else host.
TEST(RoutePlan, SkipNonfiniteStagesTheWholeStepLikeClipping) {
  const ModelLayout layout = Layout();
  JobSpec one = Spec(1, 0);
  one.train.skip_nonfinite = true;
  auto device = PlanRoutes(one, layout, Gpus(1));
  ASSERT_TRUE(device.ok()) << device.status();
  EXPECT_EQ(device->clip_staging, ClipStaging::kDevice);
  EXPECT_EQ(device->consumer, GradConsumerKind::kShards);  // never kDirect: it applies at once
  EXPECT_TRUE(absl::StrContains(device->RoutesLine(ParamDelivery::kReplicated), "skip_nonfinite: device staging"))
      << device->RoutesLine(ParamDelivery::kReplicated);
  auto host = PlanRoutes(one, layout, Gpus(1, int64_t{4} << 30));  // does not fit: hostd stages
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(host->clip_staging, ClipStaging::kHost);
  EXPECT_TRUE(host->host_staging);
  EXPECT_EQ(host->memory.step_staging_bytes, static_cast<uint64_t>(layout.total_numel) * 4);
  EXPECT_EQ(host->consumer, GradConsumerKind::kSummed);
  JobSpec cpu = Spec(2, 0, GradReduction::kCpu);
  cpu.train.skip_nonfinite = true;
  auto summed = PlanRoutes(cpu, layout, Gpus(2));
  ASSERT_TRUE(summed.ok()) << summed.status();
  EXPECT_EQ(summed->clip_staging, ClipStaging::kHost);
  EXPECT_EQ(summed->memory.step_staging_bytes, static_cast<uint64_t>(layout.total_numel) * 4);  // counted once
  EXPECT_TRUE(absl::StrContains(summed->RoutesLine(ParamDelivery::kReplicated), "skip_nonfinite: host staging"));
  JobSpec both = Spec(2, 1.0);
  both.train.skip_nonfinite = true;
  auto p = PlanRoutes(both, layout, Gpus(2));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(absl::StrContains(p->RoutesLine(ParamDelivery::kReplicated), "clipping and skip_nonfinite: device"));
}

TEST(RoutePlan, GpuRouteShardsEveryUnitOverTheRanks) {
  const ModelLayout layout = Layout();
  for (int world : {2, 3}) {
    auto p = PlanRoutes(Spec(world, 0), layout, Gpus(world));
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(p->route, GradReduction::kGpu);
    EXPECT_EQ(p->consumer, GradConsumerKind::kShards);
    EXPECT_FALSE(p->shm_collective);  // CUDA workers: NCCL
    EXPECT_FALSE(p->host_staging);
    int64_t total = 0;
    for (int r = 0; r < world; ++r) {
      int64_t expect = 0;
      for (const UnitLayout& u : layout.units) expect += ShardOf(u.numel, world, r).numel;
      EXPECT_EQ(p->shard_numel_of_rank[r], expect);
      total += p->shard_numel_of_rank[r];
    }
    EXPECT_EQ(total, layout.total_numel);  // the shards cover every element once
    EXPECT_EQ(PlanRoutes(Spec(world, 1.0), layout, Gpus(world))->clip_staging, ClipStaging::kDevice);
  }
}

TEST(RoutePlan, CpuRouteSumsOnTheHostAndCannotStageOnTheDevice) {
  const ModelLayout layout = Layout();
  auto p = PlanRoutes(Spec(2, 0, GradReduction::kCpu), layout, Gpus(2));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->consumer, GradConsumerKind::kSummed);
  EXPECT_TRUE(p->host_staging);  // the ranks' copies are summed there, even without clipping
  EXPECT_EQ(p->memory.step_staging_bytes, static_cast<uint64_t>(layout.total_numel) * 4);
  auto clipped = PlanRoutes(Spec(2, 1.0, GradReduction::kCpu), layout, Gpus(2));
  ASSERT_TRUE(clipped.ok());
  EXPECT_EQ(clipped->clip_staging, ClipStaging::kHost);  // auto: only hostd knows the norm
  EXPECT_EQ(clipped->memory.step_staging_bytes, static_cast<uint64_t>(layout.total_numel) * 4);  // counted once

  JobSpec device = Spec(2, 1.0, GradReduction::kCpu);
  device.runtime.grad_staging = GradStaging::kDevice;
  EXPECT_EQ(PlanRoutes(device, layout, Gpus(2)).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RoutePlan, CpuWorkersOnTheGpuRouteGetACollectiveSegmentCountedInShm) {
  const ModelLayout layout = Layout("tiny");
  const std::vector<WorkerDevice> cpus(2, Device(true, 0));
  auto p = PlanRoutes(Spec(2, 0), layout, cpus);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_TRUE(p->shm_collective);
  uint64_t largest = 0;
  for (const UnitLayout& u : layout.units) largest = std::max<uint64_t>(largest, PaddedNumel(u.numel, 2) * 4);
  EXPECT_EQ(p->collective_buffer_bytes, largest);
  auto without = PlanRoutes(Spec(2, 0, GradReduction::kCpu), layout, cpus);
  ASSERT_TRUE(without.ok());
  EXPECT_FALSE(without->shm_collective);
  EXPECT_EQ(p->memory.shm_bytes - without->memory.shm_bytes, shm::ShmCollective::SegmentBytes(2, largest));
  EXPECT_TRUE(absl::StrContains(p->MemoryLine(), "shm collective"));
}

TEST(RoutePlan, RefusesMixedBackendsAndBatchesThatDoNotSplit) {
  const ModelLayout layout = Layout("tiny");
  const std::vector<WorkerDevice> mixed = {Device(true, 0), Device(false, int64_t{80} << 30)};
  EXPECT_EQ(PlanRoutes(Spec(2, 0), layout, mixed).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_TRUE(PlanRoutes(Spec(2, 0, GradReduction::kCpu), layout, mixed).ok());  // hostd sums any backend
  JobSpec odd = Spec(2, 0);
  odd.train.global_batch = 6;  // not a multiple of 2 ranks x 2 rows
  EXPECT_EQ(PlanRoutes(odd, layout, Gpus(2)).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanRoutes(Spec(1, 0), layout, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RoutePlan, OffloadedLayerInputsAreCounted) {
  const ModelLayout layout = Layout();
  JobSpec s = Spec(2, 0);
  const uint64_t base = PlanRoutes(s, layout, Gpus(2))->memory.total_bytes;
  s.runtime.offload_ratio = 0.5;
  auto p = PlanRoutes(s, layout, Gpus(2));
  ASSERT_TRUE(p.ok());
  EXPECT_GT(p->memory.offload_bytes, 0u);
  EXPECT_EQ(p->memory.total_bytes, base + p->memory.offload_bytes);
  // runtime.checkpoint_dtype bf16: the recomputed layers' offloaded inputs take half the bytes.
  s.runtime.checkpoint_dtype = Dtype::kBF16;
  auto half = PlanRoutes(s, layout, Gpus(2));
  ASSERT_TRUE(half.ok());
  EXPECT_EQ(half->memory.offload_bytes * 2, p->memory.offload_bytes);
  EXPECT_EQ(half->memory.total_bytes, base + half->memory.offload_bytes);
  // With kept pieces only the inputs' share halves (the pieces stay FP32).
  s.runtime.act_policy = ActivationPolicy::kSelective;
  auto selective = PlanRoutes(s, layout, Gpus(2));
  s.runtime.checkpoint_dtype = Dtype::kF32;
  auto selective32 = PlanRoutes(s, layout, Gpus(2));
  ASSERT_TRUE(selective.ok() && selective32.ok());
  EXPECT_EQ(selective32->memory.offload_bytes - selective->memory.offload_bytes, p->memory.offload_bytes / 2);
}

// Speculative clipping: off without a whole-step wait; an explicit budget covers the last units
// that fit and is counted by admission; auto is sized after admission from what the host has left
// (less the margin), up to the whole model.
TEST(RoutePlan, SpeculationCoversTheLastUnitsThatFitTheBudget) {
  const ModelLayout layout = Layout();
  const int units = layout.num_units();
  auto none = PlanRoutes(Spec(1, 0), layout, Gpus(1));
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(none->speculate_from_unit, units);
  EXPECT_FALSE(none->speculation_auto);

  JobSpec capped = Spec(1, 1.0);
  capped.runtime.speculation_bytes = static_cast<int64_t>(UndoBytes(layout, units - 3));
  auto c = PlanRoutes(capped, layout, Gpus(1));
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->speculate_from_unit, units - 3);
  EXPECT_EQ(c->memory.undo_bytes, UndoBytes(layout, units - 3));
  auto uncapped = PlanRoutes(Spec(1, 1.0), layout, Gpus(1));
  ASSERT_TRUE(uncapped.ok());
  EXPECT_EQ(c->memory.total_bytes, uncapped->memory.total_bytes + c->memory.undo_bytes);

  RoutePlan a = *uncapped;
  ASSERT_TRUE(a.speculation_auto);
  const uint64_t total = 128ull << 30;
  const uint64_t margin = std::max<uint64_t>(4ull << 30, total / 20);
  SizeSpeculation(layout, a.memory.total_bytes + margin + UndoBytes(layout, 5), total, a);
  EXPECT_EQ(a.speculate_from_unit, 5);
  SizeSpeculation(layout, a.memory.total_bytes + margin + UndoBytes(layout, 0) * 2, total, a);
  EXPECT_EQ(a.speculate_from_unit, 0);  // the whole model, no more
  SizeSpeculation(layout, a.memory.total_bytes, total, a);
  EXPECT_EQ(a.speculate_from_unit, units);  // nothing left: off
  EXPECT_EQ(a.memory.undo_bytes, 0u);

  JobSpec off = Spec(1, 1.0);
  off.runtime.speculation_bytes = 0;
  auto o = PlanRoutes(off, layout, Gpus(1));
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->speculate_from_unit, units);
  EXPECT_FALSE(o->speculation_auto);
}

}  // namespace
}  // namespace slidedp::hostd

namespace slidedp::hostd {
namespace {

// MFU's denominator: the datasheet dense BF16 peak by the CUDA device name; unknown devices none.
TEST(StepMetrics, DenseBf16PeakByDeviceName) {
  EXPECT_DOUBLE_EQ(DenseBf16PeakTflops("NVIDIA H200"), 989.4);
  EXPECT_DOUBLE_EQ(DenseBf16PeakTflops("NVIDIA H100 80GB HBM3"), 989.4);
  EXPECT_DOUBLE_EQ(DenseBf16PeakTflops("NVIDIA H100 PCIe"), 756);
  EXPECT_DOUBLE_EQ(DenseBf16PeakTflops("NVIDIA H200 NVL"), 835);
  EXPECT_DOUBLE_EQ(DenseBf16PeakTflops("NVIDIA A100-SXM4-80GB"), 312);
  EXPECT_DOUBLE_EQ(DenseBf16PeakTflops("NVIDIA L40S"), 362);
  EXPECT_EQ(DenseBf16PeakTflops("cpu"), 0);
  EXPECT_EQ(DenseBf16PeakTflops("NVIDIA GeForce RTX 3090"), 0);
}

}  // namespace
}  // namespace slidedp::hostd

namespace slidedp::hostd {
namespace {

// A step whose GPU memory floor is over a CUDA worker's device is refused before anything is
// allocated, with the floor's parts and the longest sequence the model fits; CPU-backend workers
// and devices of unknown size are not sized.
TEST(RoutePlan, AStepOverTheGpuMemoryFloorIsRefusedWithTheLongestSequence) {
  const ModelLayout layout = Layout("qwen3-8b");
  JobSpec s = Spec(1, 0);
  s.model.preset = "qwen3-8b";
  s.train.seq_len = 262144;
  s.train.global_batch = 1;
  s.train.micro_batch = 1;
  auto refused = PlanRoutes(s, layout, Gpus(1));
  ASSERT_EQ(refused.status().code(), absl::StatusCode::kResourceExhausted) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "longest single sequence")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "layer inputs")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "offload_ratio")) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "runtime.checkpoint_dtype: bf16")) << refused.status();
  // With runtime.policy auto the offload shares are AutoPolicy's to choose: the floor counts no
  // input that may be offloaded, so the job is not refused for them.
  s.runtime.policy_auto = true;
  auto autop = PlanRoutes(s, layout, Gpus(1));
  ASSERT_TRUE(autop.ok()) << autop.status();
  EXPECT_EQ(autop->device_floor.checkpoints, 0);
  s.runtime.policy_auto = false;
  // Offloading most layers' inputs brings the floor under the device.
  s.runtime.offload_ratio = 0.5;
  auto offloaded = PlanRoutes(s, layout, Gpus(1));
  ASSERT_TRUE(offloaded.ok()) << offloaded.status();
  EXPECT_LE(offloaded->device_floor.device_total(), int64_t{141} << 30);
  EXPECT_EQ(offloaded->device_floor.offloaded, 18 * int64_t{262144} * 4096 * 4);
  // BF16 checkpoints halve the inputs on the device and offloaded (one micro-batch widened back).
  s.runtime.checkpoint_dtype = Dtype::kBF16;
  auto bf16 = PlanRoutes(s, layout, Gpus(1));
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->device_floor.offloaded, 18 * int64_t{262144} * 4096 * 2);
  EXPECT_EQ(bf16->device_floor.checkpoints, 18 * int64_t{262144} * 4096 * 2 + int64_t{262144} * 4096 * 2);
  EXPECT_EQ(bf16->memory.offload_bytes * 2, offloaded->memory.offload_bytes);
  // ... and 256K tokens then fit without offloading (36 x 2 GiB of inputs).
  s.runtime.offload_ratio = 0;
  auto bf16_on_gpu = PlanRoutes(s, layout, Gpus(1));
  ASSERT_TRUE(bf16_on_gpu.ok()) << bf16_on_gpu.status();
  EXPECT_EQ(bf16_on_gpu->device_floor.offloaded, 0);
  s.runtime.offload_ratio = 0.5;
  s.runtime.checkpoint_dtype = Dtype::kF32;
  // A cap below the floor refuses again, naming it.
  s.runtime.gpu_memory_limit_bytes = int64_t{40} << 30;
  auto capped = PlanRoutes(s, layout, Gpus(1));
  ASSERT_EQ(capped.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_TRUE(absl::StrContains(capped.status().message(), "runtime.gpu_memory_limit")) << capped.status();
  s.runtime.checkpoint_dtype = Dtype::kBF16;  // already BF16: not suggested again
  auto capped_bf16 = PlanRoutes(s, layout, Gpus(1));
  ASSERT_EQ(capped_bf16.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_FALSE(absl::StrContains(capped_bf16.status().message(), "checkpoint_dtype")) << capped_bf16.status();
  s.runtime.checkpoint_dtype = Dtype::kF32;
  s.runtime.gpu_memory_limit_bytes = 0;
  s.runtime.offload_ratio = 0;
  EXPECT_TRUE(PlanRoutes(s, layout, std::vector<WorkerDevice>{Device(true, int64_t{8} << 30)}).ok());
  EXPECT_TRUE(PlanRoutes(s, layout, Gpus(1, 0)).ok());
}

}  // namespace
}  // namespace slidedp::hostd

namespace slidedp::hostd {
namespace {

// A MoE shape the CUDA block does not take is refused before any host state, naming why; the CPU
// backend runs it.
TEST(RoutePlan, MoeShapesTheCudaBlockCannotRunAreRefusedOnCudaWorkers) {
  ModelConfig c = *ModelConfig::Preset("tiny-moe");
  c.moe_intermediate_size = 36;
  const ModelLayout layout = ModelLayout::Build(c);
  JobSpec s;
  s.model.preset = "tiny-moe";
  s.train.seq_len = 64;
  s.train.global_batch = 2;
  s.train.micro_batch = 1;
  s.train.max_grad_norm = 0;
  auto p = PlanRoutes(s, layout, std::vector<WorkerDevice>(1, Device(false, int64_t{80} << 30)));
  ASSERT_FALSE(p.ok());
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(p.status().message(), "moe_intermediate_size a multiple of 8")) << p.status();
  EXPECT_TRUE(PlanRoutes(s, layout, std::vector<WorkerDevice>(1, Device(true, 0))).ok());
  c.moe_intermediate_size = 32;
  EXPECT_TRUE(
      PlanRoutes(s, ModelLayout::Build(c), std::vector<WorkerDevice>(1, Device(false, int64_t{80} << 30))).ok());
}

// ---- PlanRoutes's parts, each alone ----

TEST(JobPlanParts, BatchSplitCountsContextGroupsAsRanks) {
  JobSpec s = Spec(2, 0);  // global batch 8, micro-batch 2
  EXPECT_TRUE(CheckBatchSplit(s, 2).ok());
  EXPECT_TRUE(CheckBatchSplit(s, 4).ok());
  EXPECT_EQ(CheckBatchSplit(s, 3).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckBatchSplit(s, 0).code(), absl::StatusCode::kInvalidArgument);
  s.runtime.context_parallel = 2;  // 4 workers are 2 groups: 8 rows over 2 x 2 split
  EXPECT_TRUE(CheckBatchSplit(s, 4).ok());
  const absl::Status odd = CheckBatchSplit(s, 3);
  EXPECT_EQ(odd.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(odd.message(), "does not divide the job's 3 workers")) << odd;
  s.train.global_batch = 6;
  const absl::Status groups = CheckBatchSplit(s, 4);
  EXPECT_TRUE(absl::StrContains(groups.message(), "2 context-parallel group(s) x train.micro_batch 2")) << groups;
}

TEST(JobPlanParts, WorkersFitSaysWhetherTheJobHasANcclCommunicator) {
  const ModelLayout layout = Layout();
  EXPECT_TRUE(*CheckWorkersFit(Spec(2, 0), layout, Gpus(2)));                           // gpu route
  EXPECT_FALSE(*CheckWorkersFit(Spec(2, 0, GradReduction::kCpu), layout, Gpus(2)));     // nothing over NCCL
  EXPECT_FALSE(*CheckWorkersFit(Spec(1, 0), layout, Gpus(1)));                          // one rank
  std::vector<WorkerDevice> cpus = {Device(true, int64_t{64} << 30), Device(true, int64_t{64} << 30)};
  EXPECT_FALSE(*CheckWorkersFit(Spec(2, 0), layout, cpus));  // CPU workers: the shm collective
  JobSpec sharded = Spec(2, 0, GradReduction::kCpu);
  sharded.runtime.param_delivery = ParamDelivery::kSharded;
  EXPECT_TRUE(*CheckWorkersFit(sharded, layout, Gpus(2)));
  std::vector<WorkerDevice> mixed = {Device(true, int64_t{64} << 30), Device(false, int64_t{80} << 30)};
  JobSpec cp = Spec(2, 0, GradReduction::kCpu);
  cp.runtime.context_parallel = 2;
  EXPECT_EQ(CheckWorkersFit(cp, layout, mixed).status().code(), absl::StatusCode::kFailedPrecondition);
}

// A sliding window shorter than the row trains on CPU-backend and CUDA workers alike (the own flash
// kernels' AttnArgs::window on CUDA; GPU-verified against transformers, docs/gpu-results.md).
TEST(JobPlanParts, WorkersFitTakesShortSlidingWindowsOnBothBackends) {
  const ModelLayout layout = Layout("tiny-mistral-window");  // sliding_window 16, every layer
  JobSpec s = Spec(2, 0, GradReduction::kCpu);
  s.model.preset = "tiny-mistral-window";
  s.train.seq_len = 64;
  std::vector<WorkerDevice> cpus = {Device(true, int64_t{64} << 30), Device(true, int64_t{64} << 30)};
  EXPECT_TRUE(CheckWorkersFit(s, layout, cpus).ok());
  EXPECT_TRUE(CheckWorkersFit(s, layout, Gpus(2)).ok());
  std::vector<WorkerDevice> mixed = {Device(true, int64_t{64} << 30), Device(false, int64_t{80} << 30)};
  EXPECT_TRUE(CheckWorkersFit(s, layout, mixed).ok());
}

// gemma3 trains on CPU-backend and CUDA workers alike (the CUDA backend computes its layers).
TEST(JobPlanParts, WorkersFitTakesGemma3OnCudaWorkers) {
  const ModelLayout layout = Layout("tiny-gemma3");
  JobSpec s = Spec(2, 0, GradReduction::kCpu);
  s.model.preset = "tiny-gemma3";
  s.train.seq_len = 16;
  std::vector<WorkerDevice> cpus = {Device(true, int64_t{64} << 30), Device(true, int64_t{64} << 30)};
  EXPECT_TRUE(CheckWorkersFit(s, layout, cpus).ok());
  EXPECT_TRUE(CheckWorkersFit(s, layout, Gpus(2)).ok()) << CheckWorkersFit(s, layout, Gpus(2)).status();
}

// gemma4 trains on CPU-backend and CUDA workers alike (the CUDA backend's cuda_gemma4_layer.cc), but
// for what the CUDA backend's kernels do not take, refused at submit by the field: head dims over 256
// (every released Gemma 4's full-attention layers: gemma4-e2b's 512), per-layer inputs of a width
// that is not a multiple of 8, a context-parallel group; and what no passing GPU test covers yet
// (the double-wide MLP, per-layer inputs under 16, multimodal placeholders: tiny-gemma4 has all three).
// CPU workers run all of them.
TEST(JobPlanParts, WorkersFitTakesGemma4OnCudaWorkers) {
  JobSpec s = Spec(2, 0, GradReduction::kCpu);
  s.model.preset = "tiny-gemma4";
  s.train.seq_len = 64;  // longer than its window
  std::vector<WorkerDevice> cpus = {Device(true, int64_t{64} << 30), Device(true, int64_t{64} << 30)};
  // The GPU-verified shape: no double-wide MLP, per-layer inputs of 16, text only (k_eq_v, sharing).
  ModelConfig verified = *ModelConfig::Preset("tiny-gemma4");
  verified.gemma4.double_wide_mlp = false;
  verified.gemma4.ple_dim = 16;
  const ModelLayout layout = ModelLayout::Build(verified);
  EXPECT_TRUE(CheckWorkersFit(s, layout, cpus).ok());
  EXPECT_TRUE(CheckWorkersFit(s, layout, Gpus(2)).ok()) << CheckWorkersFit(s, layout, Gpus(2)).status();
  const ModelLayout tiny = Layout("tiny-gemma4");
  EXPECT_TRUE(CheckWorkersFit(s, tiny, cpus).ok());
  const absl::Status unverified = CheckWorkersFit(s, tiny, Gpus(2)).status();
  EXPECT_EQ(unverified.code(), absl::StatusCode::kUnimplemented) << unverified;
  EXPECT_TRUE(absl::StrContains(unverified.message(), "use_double_wide_mlp")) << unverified;
  ModelConfig narrow = verified;
  narrow.gemma4.ple_dim = 8;
  EXPECT_TRUE(absl::StrContains(CheckWorkersFit(s, ModelLayout::Build(narrow), Gpus(2)).status().message(),
                                "hidden_size_per_layer_input 8 (under 16)"));

  ModelConfig wide = *ModelConfig::Preset("gemma4-e2b");
  wide.num_hidden_layers = 5;  // four sliding layers (head_dim 256) and the full last one (512)
  wide.layer_spans.resize(5);
  wide.gemma4.kv_shared_layers = 0;
  const ModelLayout e2b = ModelLayout::Build(wide);
  EXPECT_TRUE(CheckWorkersFit(s, e2b, cpus).ok());
  const absl::Status hd = CheckWorkersFit(s, e2b, Gpus(2)).status();
  EXPECT_EQ(hd.code(), absl::StatusCode::kUnimplemented) << hd;
  EXPECT_TRUE(absl::StrContains(hd.message(), "global_head_dim (per_layer_config head_dim) 512 of layer 4")) << hd;
  EXPECT_TRUE(absl::StrContains(hd.message(), "runtime.backend: cpu")) << hd;

  ModelConfig odd = verified;
  odd.gemma4.ple_dim = 20;
  const ModelLayout odd_layout = ModelLayout::Build(odd);
  EXPECT_TRUE(CheckWorkersFit(s, odd_layout, cpus).ok());
  const absl::Status ple = CheckWorkersFit(s, odd_layout, Gpus(2)).status();
  EXPECT_EQ(ple.code(), absl::StatusCode::kInvalidArgument) << ple;
  EXPECT_TRUE(absl::StrContains(ple.message(), "hidden_size_per_layer_input 20")) << ple;

  JobSpec cp = s;
  cp.runtime.context_parallel = 2;
  EXPECT_TRUE(CheckWorkersFit(cp, layout, cpus).ok());
  const absl::Status context = CheckWorkersFit(cp, layout, Gpus(2)).status();
  EXPECT_EQ(context.code(), absl::StatusCode::kUnimplemented) << context;
  EXPECT_TRUE(absl::StrContains(context.message(), "runtime.context_parallel 2")) << context;
}

// gpt_oss trains on CPU-backend and CUDA workers alike (the CUDA backend's sinks, biased router and
// experts); its experts' width need not be a multiple of 8 there.
TEST(JobPlanParts, WorkersFitTakesGptOssOnCudaWorkers) {
  const ModelLayout layout = Layout("tiny-gpt-oss");
  JobSpec s = Spec(2, 0, GradReduction::kCpu);
  s.model.preset = "tiny-gpt-oss";
  s.train.seq_len = 16;
  std::vector<WorkerDevice> cpus = {Device(true, int64_t{64} << 30), Device(true, int64_t{64} << 30)};
  EXPECT_TRUE(CheckWorkersFit(s, layout, cpus).ok());
  EXPECT_TRUE(CheckWorkersFit(s, layout, Gpus(2)).ok()) << CheckWorkersFit(s, layout, Gpus(2)).status();
}

TEST(JobPlanParts, ContextGroupsGoOverNcclOrAShmSegment) {
  const ModelLayout layout = Layout();
  JobSpec s = Spec(2, 0);
  RoutePlan none;
  PlanContextGroups(s, layout, true, none);
  EXPECT_EQ(none.context_ranks, 1);
  EXPECT_EQ(none.context_buffer_bytes, 0u);
  s.runtime.context_parallel = 2;
  RoutePlan nccl;
  PlanContextGroups(s, layout, true, nccl);
  EXPECT_EQ(nccl.context_ranks, 2);
  EXPECT_TRUE(nccl.context_on_nccl);
  EXPECT_EQ(nccl.context_buffer_bytes, 0u);
  RoutePlan shm;
  PlanContextGroups(s, layout, false, shm);
  EXPECT_FALSE(shm.context_on_nccl);
  // Two ranks' shares of a 2 x 1024-token micro-batch (two chunks of 512, plus 2 spare tokens),
  // keys and values in FP32.
  EXPECT_EQ(shm.context_buffer_bytes, uint64_t{2} * 1026 * 2 * layout.config.kv_dim() * 4);
}

TEST(JobPlanParts, GradientRouteAloneDecidesStagingAndConsumer) {
  const ModelLayout layout = Layout();
  RoutePlan one;
  one.world = 1;
  ASSERT_TRUE(PlanGradientRoute(Spec(1, 0), layout, Gpus(1), one).ok());
  EXPECT_EQ(one.route, GradReduction::kCpu);
  EXPECT_EQ(one.consumer, GradConsumerKind::kDirect);
  EXPECT_EQ(one.clip_staging, ClipStaging::kNone);
  EXPECT_EQ(one.staging_bytes, 0u);
  RoutePlan summed;
  summed.world = 2;
  ASSERT_TRUE(PlanGradientRoute(Spec(2, 1.0, GradReduction::kCpu), layout, Gpus(2), summed).ok());
  EXPECT_EQ(summed.consumer, GradConsumerKind::kSummed);
  EXPECT_EQ(summed.clip_staging, ClipStaging::kHost);
  EXPECT_EQ(summed.staging_bytes, static_cast<uint64_t>(layout.total_numel) * 4);
  EXPECT_EQ(summed.memory.total_bytes, 0u) << "memory is PlanMemory's";
  JobSpec device = Spec(2, 1.0, GradReduction::kCpu);
  device.runtime.grad_staging = GradStaging::kDevice;
  RoutePlan refused;
  refused.world = 2;
  EXPECT_EQ(PlanGradientRoute(device, layout, Gpus(2), refused).code(), absl::StatusCode::kInvalidArgument);
}

TEST(JobPlanParts, MemoryCountsWhatTheRouteDecided) {
  const ModelLayout layout = Layout();
  for (GradReduction route : {GradReduction::kCpu, GradReduction::kGpu}) {
    RoutePlan p;
    p.world = 2;
    const JobSpec s = Spec(2, 1.0, route);
    ASSERT_TRUE(PlanGradientRoute(s, layout, Gpus(2), p).ok());
    ASSERT_TRUE(PlanMemory(s, layout, Gpus(2), p).ok());
    auto whole = PlanRoutes(s, layout, Gpus(2));
    ASSERT_TRUE(whole.ok()) << whole.status();
    EXPECT_EQ(p.memory.total_bytes, whole->memory.total_bytes);
    EXPECT_EQ(p.memory.step_staging_bytes, whole->memory.step_staging_bytes);
    EXPECT_GT(p.memory.total_bytes, 0u);
  }
}

}  // namespace
}  // namespace slidedp::hostd
