// End-to-end training through real processes: hostd + CPU-backend workers over gRPC and shared
// memory. Checks synchronous-DP equivalence, a non-streaming reference, version-gate ordering
// under injected delays, exact resume, and a worker killed mid-step.
#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <map>
#include <random>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_replace.h"
#include "nlohmann/json.hpp"

#include "checkpoint/checkpoint.h"
#include "common/data/micro_batch.h"
#include "common/data/sampler.h"
#include "common/data/synthetic.h"
#include "common/jobspec/job_spec.h"
#include "shm/job_state.h"
#include "client/cli/plan_report.h"
#include "tests/integration/node_harness.h"
#include "worker/compute/cpu/cpu_reference_model.h"

namespace slidedp::testing {
namespace {

struct SpecOptions {
  int workers = 2;
  int global_batch = 8;
  int micro_batch = 2;
  int steps = 4;
  int save_every = 0;
  int max_restarts = 0;
  int chunk_bytes = 64 << 20;  // gradient ring slot (= chunk) size
  double max_grad_norm = 1.0;
  std::string output = "out";
  std::string grad_reduction;  // runtime.grad_reduction; empty: the spec default (gpu)
  std::string grad_staging;    // runtime.grad_staging; empty: the spec default (auto)
  double offload_ratio = 0;    // runtime.offload_ratio
  int64_t tile_tokens = 0;     // runtime.tile_tokens; 0: the spec default (auto)
  std::string norm_weights;    // runtime.norm_weights; empty: the spec default (fp32)
  std::string embedding_rows;  // runtime.embedding_rows; empty: the spec default (fp32)
  std::string act_policy;      // runtime.act_policy; empty: the spec default (recompute)
  std::string grad_dtype;      // runtime.grad_dtype; empty: the spec default (fp32)
  std::string param_source;    // runtime.param_source; empty: the spec default (mirror)
  int cast_threads = 0;        // runtime.cast_threads; 0: the spec default (auto)
  std::string gpu_memory_limit;  // runtime.gpu_memory_limit; empty: none
  std::string policy;            // runtime.policy; empty: the spec default (fixed)
  std::string checkpoint_dtype;  // runtime.checkpoint_dtype; empty: the spec default (fp32)
  std::string state_dtype;     // optimizer.state_dtype; empty: the spec default (fp32)
  int context_parallel = 1;    // runtime.context_parallel
  bool validate = false;       // data.validation: the training data itself (evaluated after the last step)
  std::string preset = "tiny";
  double router_aux_loss_coef = -1;  // train.router_aux_loss_coef; < 0: not in the spec
};

// One worker taking the whole global batch of 8 in micro-batches of 4.
SpecOptions OneWorker(int steps, std::string output) {
  SpecOptions o;
  o.workers = 1;
  o.micro_batch = 4;
  o.steps = steps;
  o.output = std::move(output);
  return o;
}

std::string DataDir() {
  static std::string dir = [] {
    std::string d = ::testing::TempDir() + "/it-data-" + std::to_string(getpid());
    data::SyntheticOptions o;
    o.vocab_size = 512;
    o.num_documents = 96;
    o.seed = 5;
    o.min_doc_tokens = 8;
    o.max_doc_tokens = 90;
    o.seq_len = 64;
    o.overwrite = data::Overwrite::kYes;
    auto m = data::WriteSyntheticDataset(d, o);
    EXPECT_TRUE(m.ok()) << m.status();
    return d;
  }();
  return dir;
}

std::string Spec(const SpecOptions& o) {
  return absl::StrCat(
      "name: it\nmodel: {preset: ", o.preset, ", init_seed: 11}\ndata: {path: ", DataDir(),
      o.validate ? ", validation: " + DataDir() : std::string(), "}\n", "output: {dir: ", o.output,
      ", save_dtype: fp32, keep_last: 5, save_every: ", o.save_every, "}\n",
      "train: {seq_len: 64, global_batch: ", o.global_batch, ", micro_batch: ", o.micro_batch, ", steps: ", o.steps,
      ", seed: 3, max_grad_norm: ", o.max_grad_norm,
      o.router_aux_loss_coef < 0 ? std::string() : absl::StrCat(", router_aux_loss_coef: ", o.router_aux_loss_coef),
      "}\n", "optimizer: {lr: 1.0e-3, weight_decay: 0.1",
      o.state_dtype.empty() ? std::string() : ", state_dtype: " + o.state_dtype, "}\n",
      "schedule: {kind: linear, warmup_steps: 1}\n", "runtime: {workers: ", o.workers,
      ", ring_slots: 4, step_timeout_ms: 20000, max_restarts: ", o.max_restarts, ", chunk_bytes: ", o.chunk_bytes,
      o.grad_reduction.empty() ? std::string() : ", grad_reduction: " + o.grad_reduction,
      o.grad_staging.empty() ? std::string() : ", grad_staging: " + o.grad_staging,
      o.norm_weights.empty() ? std::string() : ", norm_weights: " + o.norm_weights,
      o.embedding_rows.empty() ? std::string() : ", embedding_rows: " + o.embedding_rows,
      o.act_policy.empty() ? std::string() : ", act_policy: " + o.act_policy,
      o.grad_dtype.empty() ? std::string() : ", grad_dtype: " + o.grad_dtype,
      o.param_source.empty() ? std::string() : ", param_source: " + o.param_source,
      o.cast_threads == 0 ? std::string() : absl::StrCat(", cast_threads: ", o.cast_threads),
      o.gpu_memory_limit.empty() ? std::string() : ", gpu_memory_limit: " + o.gpu_memory_limit,
      o.policy.empty() ? std::string() : ", policy: " + o.policy,
      o.tile_tokens == 0 ? std::string() : absl::StrCat(", tile_tokens: ", o.tile_tokens),
      o.checkpoint_dtype.empty() ? std::string() : ", checkpoint_dtype: " + o.checkpoint_dtype,
      o.context_parallel == 1 ? std::string() : absl::StrCat(", context_parallel: ", o.context_parallel),
      ", offload_ratio: ", o.offload_ratio,
      "}\n");
}

ModelLayout TinyLayout() { return ModelLayout::Build(*ModelConfig::Preset("tiny")); }

// Master, Adam m and v of a checkpoint saved in fp32, per unit, one after another.
std::vector<std::vector<float>> LoadState(const std::string& dir) {
  ModelLayout layout = TinyLayout();
  const int n = layout.num_units();
  std::vector<std::vector<float>> state(3 * n);
  for (int u = 0; u < n; ++u) {
    for (int k = 0; k < 3; ++k) state[k * n + u].resize(layout.units[u].numel);
  }
  checkpoint::StateArrays arrays;
  arrays.master = [&](int u) { return state[u].data(); };
  arrays.moments = checkpoint::Fp32Moments([&](int u) { return state[n + u].data(); },
                                            [&](int u) { return state[2 * n + u].data(); });
  auto loaded = checkpoint::LoadCheckpoint(dir, layout, arrays);
  EXPECT_TRUE(loaded.ok()) << loaded.status();
  return state;
}

// FP32 master weights of a saved checkpoint, per unit.
std::vector<std::vector<float>> LoadMaster(const std::string& dir) {
  std::vector<std::vector<float>> state = LoadState(dir);
  state.resize(TinyLayout().num_units());
  return state;
}

double MaxAbsDiff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  double d = 0;
  for (size_t u = 0; u < a.size(); ++u)
    for (size_t i = 0; i < a[u].size(); ++i) d = std::max(d, std::fabs(double(a[u][i]) - b[u][i]));
  return d;
}

// Of two LoadState results: the largest difference of Adam's m or v in a unit, relative to the
// largest magnitude of that moment in the unit (the units' master weights are left out).
double MaxRelativeMomentDiff(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  const size_t units = static_cast<size_t>(TinyLayout().num_units());
  double worst = 0;
  for (size_t k = units; k < a.size(); ++k) {
    double diff = 0, scale = 0;
    for (size_t i = 0; i < a[k].size(); ++i) {
      diff = std::max(diff, std::fabs(double(a[k][i]) - b[k][i]));
      scale = std::max(scale, std::fabs(double(b[k][i])));
    }
    if (scale > 0) worst = std::max(worst, diff / scale);
  }
  return worst;
}

// The non-streaming reference: the whole model at once (CPU reference math), the same batches,
// exact global-norm clipping and AdamW in double precision (PyTorch's formula; weight decay on the
// matrices only: optimizer.no_decay's default leaves the 1-D tensors, the norms, alone). Forward and
// backward use the BF16 rounding of every weight except the norm weights and the embedding rows
// the lookup reads, which stay FP32 unless o.norm_weights / o.embedding_rows is "bf16"
// (runtime.norm_weights, runtime.embedding_rows; the tied LM head uses the BF16 table).
std::vector<std::vector<float>> ReferenceTraining(const SpecOptions& o, std::vector<double>* losses) {
  ModelLayout layout = TinyLayout();
  const int U = layout.num_units();
  std::vector<std::vector<float>> master(U), grads(U);
  std::vector<std::vector<double>> m(U), v(U);
  std::vector<std::vector<double>> decay_of(U);  // wd per element: 0 on the 1-D tensors
  for (int u = 0; u < U; ++u) {
    master[u].assign(layout.units[u].numel, 0);
    m[u].assign(layout.units[u].numel, 0);
    v[u].assign(layout.units[u].numel, 0);
    decay_of[u].assign(layout.units[u].numel, 0.1);
    for (const TensorSlot& ts : layout.units[u].tensors) {
      if (ts.shape.size() == 1) std::fill_n(decay_of[u].begin() + ts.offset_numel, ts.numel, 0.0);
    }
  }
  checkpoint::InitRandom(layout, 11, [&](int u) { return master[u].data(); });
  auto dataset = data::DatasetReader::Open(DataDir());
  EXPECT_TRUE(dataset.ok());
  auto sampler = data::GlobalBatchSampler::Create((*dataset)->num_rows(), o.global_batch, 1, 3);
  EXPECT_TRUE(sampler.ok());
  const double lr0 = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8;
  for (int t = 0; t < o.steps; ++t) {
    // What the workers compute with: the BF16 mirror, and the norm weights in FP32.
    std::vector<std::vector<bf16_t>> params(U);
    std::vector<std::vector<float>> norms(U);
    for (int u = 0; u < U; ++u) {
      params[u].resize(master[u].size());
      for (size_t i = 0; i < master[u].size(); ++i) params[u][i] = FloatToBf16(master[u][i]);
      norms[u].resize(layout.units[u].fp32_numel);
      CopyNormsFromMaster(layout.units[u], master[u].data(), norms[u].data());
    }
    std::vector<int64_t> rows = sampler->GlobalRows(t);
    auto trained = data::CountTrainedLabels(**dataset, rows);
    EXPECT_TRUE(trained.ok());
    std::vector<std::vector<double>> sum(U);
    for (int u = 0; u < U; ++u) sum[u].assign(master[u].size(), 0);
    double loss = 0;
    for (size_t i = 0; i < rows.size(); i += o.micro_batch) {
      auto mb = data::BuildMicroBatch(**dataset, absl::MakeConstSpan(rows.data() + i, o.micro_batch));
      EXPECT_TRUE(mb.ok());
      auto l = ReferenceLossAndGrads(layout, params, {*mb}, 1.0f / *trained, &grads,
                                     o.norm_weights == "bf16" ? nullptr : &norms,
                                     o.embedding_rows == "bf16" ? nullptr : master[0].data());
      EXPECT_TRUE(l.ok()) << l.status();
      loss += *l;
      for (int u = 0; u < U; ++u)
        for (size_t k = 0; k < grads[u].size(); ++k) sum[u][k] += grads[u][k];
    }
    losses->push_back(loss);
    double sq = 0;
    for (int u = 0; u < U; ++u)
      for (double g : sum[u]) sq += g * g;
    const double norm = std::sqrt(sq);
    const double coef = o.max_grad_norm > 0 ? std::min(1.0, o.max_grad_norm / (norm + 1e-6)) : 1.0;
    // linear schedule, warmup 1: step 0 has lr 0, then linear decay to 0 at `steps`.
    const double lr = t < 1 ? lr0 * t / 1.0 : lr0 * double(o.steps - t) / double(o.steps - 1);
    const int step = t + 1;
    for (int u = 0; u < U; ++u) {
      for (size_t k = 0; k < master[u].size(); ++k) {
        double g = sum[u][k] * coef;
        double p = master[u][k] * (1 - lr * decay_of[u][k]);
        m[u][k] = b1 * m[u][k] + (1 - b1) * g;
        v[u][k] = b2 * v[u][k] + (1 - b2) * g * g;
        double denom = std::sqrt(v[u][k]) / std::sqrt(1 - std::pow(b2, step)) + eps;
        p -= lr / (1 - std::pow(b1, step)) * m[u][k] / denom;
        master[u][k] = static_cast<float>(p);
      }
    }
  }
  return master;
}

TEST(Training, TwoWorkersMatchOneWorkerAndTheNonStreamingReference) {
  SpecOptions two;
  two.output = "out-two";
  SpecOptions one = two;
  one.workers = 1;
  one.micro_batch = 4;  // twice the per-worker batch in one rank
  one.output = "out-one";
  std::vector<std::vector<float>> m2, m1;
  {
    NodeHarness node(2);
    v1::Job j = MustSucceed(node, Spec(two), "two");
    EXPECT_EQ(j.last().step(), 4);
    EXPECT_GT(j.last().loss(), 0);
    m2 = LoadMaster(j.last_checkpoint());
    EXPECT_TRUE(node.LeakedSegments().empty());
  }
  {
    NodeHarness node(1);
    v1::Job j = MustSucceed(node, Spec(one), "one");
    m1 = LoadMaster(j.last_checkpoint());
  }
  std::vector<double> ref_losses;
  std::vector<std::vector<float>> ref = ReferenceTraining(one, &ref_losses);
  ModelLayout layout = TinyLayout();
  std::vector<std::vector<float>> init(layout.num_units());
  for (int u = 0; u < layout.num_units(); ++u) init[u].assign(layout.units[u].numel, 0);
  checkpoint::InitRandom(layout, 11, [&](int u) { return init[u].data(); });

  const double moved = MaxAbsDiff(m1, init);
  const double dp = MaxAbsDiff(m2, m1);
  const double vs_ref = MaxAbsDiff(m1, ref);
  std::cout << "max |param change| " << moved << ", 2 vs 1 worker " << dp << ", 1 worker vs reference " << vs_ref
            << "\n";
  EXPECT_GT(moved, 1e-3);  // training did move the parameters: the comparisons below can fail
  EXPECT_LT(dp, 2e-5);     // FP32 tolerance: only the gradient summation order differs
  EXPECT_LT(vs_ref, 2e-5);
}

TEST(Training, WithoutClippingChunksUpdateAsTheyArriveAndMatchTheReference) {
  SpecOptions o;
  o.max_grad_norm = 0;   // no clipping: LayerAdam updates each chunk as soon as it is summed
  o.chunk_bytes = 8192;  // 2048-element chunks: every unit arrives in several pieces
  o.output = "out-noclip";
  std::vector<std::vector<float>> got;
  {
    NodeHarness node(2, {}, {"SLIDEDP_INJECT_DELAY_MS=2"});
    got = LoadMaster(MustSucceed(node, Spec(o), "noclip").last_checkpoint());
  }
  // One worker without clipping takes the direct path: LayerAdam reads the ring slots.
  std::vector<std::vector<float>> direct;
  {
    NodeHarness node(1, {}, {"SLIDEDP_INJECT_DELAY_MS=2"});
    SpecOptions one = o;
    one.workers = 1;
    one.output = "out-noclip-direct";
    direct = LoadMaster(MustSucceed(node, Spec(one), "noclip-direct").last_checkpoint());
  }
  std::vector<double> losses;
  SpecOptions ref = o;
  ref.workers = 1;
  ref.micro_batch = 2;
  std::vector<std::vector<float>> want = ReferenceTraining(ref, &losses);
  const double d = MaxAbsDiff(got, want);
  const double d_direct = MaxAbsDiff(direct, want);
  std::cout << "no clipping vs reference: 2 workers " << d << ", 1 worker (direct from ring slots) " << d_direct
            << "\n";
  EXPECT_LT(d, 2e-5);
  EXPECT_LT(d_direct, 2e-5);
}

TEST(Training, NormWeightsAndEmbeddingRowsComeFromTheMasterInFp32OrFromTheMirror) {
  // lr 1e-3 moves the norm weights (initialised to 1.0) by less than BF16's spacing there
  // (2^-7), so the mirror keeps them at 1.0 while the master moves: the settings differ. The
  // embedding's random initial values already differ from their BF16 rounding.
  SpecOptions fp32 = OneWorker(4, "out-norm-fp32");
  SpecOptions bf16 = OneWorker(4, "out-norm-bf16");
  bf16.norm_weights = "bf16";
  SpecOptions rows = OneWorker(4, "out-rows-bf16");
  rows.embedding_rows = "bf16";
  std::vector<std::vector<float>> got_fp32, got_bf16, got_rows;
  {
    NodeHarness node(1);
    got_fp32 = LoadMaster(MustSucceed(node, Spec(fp32), "norm-fp32").last_checkpoint());
    got_bf16 = LoadMaster(MustSucceed(node, Spec(bf16), "norm-bf16").last_checkpoint());
    got_rows = LoadMaster(MustSucceed(node, Spec(rows), "rows-bf16").last_checkpoint());
  }
  std::vector<double> losses;
  const std::vector<std::vector<float>> want_fp32 = ReferenceTraining(fp32, &losses);
  const std::vector<std::vector<float>> want_bf16 = ReferenceTraining(bf16, &losses);
  const std::vector<std::vector<float>> want_rows = ReferenceTraining(rows, &losses);
  const double d_fp32 = MaxAbsDiff(got_fp32, want_fp32), d_bf16 = MaxAbsDiff(got_bf16, want_bf16);
  const double d_rows = MaxAbsDiff(got_rows, want_rows);
  const double apart = MaxAbsDiff(want_fp32, want_bf16), apart_rows = MaxAbsDiff(want_fp32, want_rows);
  std::cout << "fp32 values vs reference " << d_fp32 << ", bf16 norms vs reference " << d_bf16
            << ", bf16 embedding rows vs reference " << d_rows << "; references apart from the fp32 one: bf16 norms "
            << apart << ", bf16 embedding rows " << apart_rows << "\n";
  EXPECT_LT(d_fp32, 2e-5);
  EXPECT_LT(d_bf16, 2e-5);
  EXPECT_LT(d_rows, 2e-5);
  EXPECT_GT(apart, 4e-5);  // the references differ by more than twice the match tolerance
  EXPECT_GT(apart_rows, 4e-5);
}

TEST(Training, EpochsBecomeStepsOverTheDataset) {
  auto dataset = data::DatasetReader::Open(DataDir());
  ASSERT_TRUE(dataset.ok());
  const int64_t rows = (*dataset)->num_rows();
  const int64_t expected = (2 * rows + 7) / 8;  // 2 epochs, global batch 8, rounded up
  NodeHarness node(2);
  std::string spec = Spec(SpecOptions());
  const std::string steps = "steps: 4,";
  ASSERT_NE(spec.find(steps), std::string::npos);
  spec.replace(spec.find(steps), steps.size(), "epochs: 2,");
  v1::Job j = MustSucceed(node, spec, "epochs");
  EXPECT_EQ(j.total_steps(), expected);
  EXPECT_EQ(j.last().step(), expected);
}

TEST(Training, GateOrderingHoldsUnderInjectedDelays) {
  SpecOptions o;
  o.steps = 3;
  o.output = "out-plain";
  std::vector<std::vector<float>> plain, delayed;
  {
    NodeHarness node(2);
    plain = LoadMaster(MustSucceed(node, Spec(o), "plain").last_checkpoint());
  }
  {
    NodeHarness node(2, {}, {"SLIDEDP_INJECT_DELAY_MS=3"});
    o.output = "out-delayed";
    delayed = LoadMaster(MustSucceed(node, Spec(o), "delayed").last_checkpoint());
  }
  // Aggregation is in rank order and every update waits for its gate: bitwise identical.
  EXPECT_EQ(MaxAbsDiff(plain, delayed), 0.0);
}

TEST(Training, ResumeFromCheckpointEqualsUninterruptedRun) {
  NodeHarness node(2);
  SpecOptions full;
  full.steps = 6;
  full.save_every = 3;
  full.output = "out-full";
  v1::Job j = MustSucceed(node, Spec(full), "full");
  auto uninterrupted = LoadMaster(j.last_checkpoint());
  // A second job that resumes from the step-3 checkpoint of the first.
  SpecOptions resumed = full;
  resumed.output = "out-resumed";
  v1::Job r = MustSucceed(node, Spec(resumed), "resumed", node.dir() + "/out-full/checkpoint-3");
  EXPECT_EQ(r.last().step(), 6);
  EXPECT_EQ(MaxAbsDiff(uninterrupted, LoadMaster(r.last_checkpoint())), 0.0);
}

TEST(Training, KilledWorkerFailsTheJobQuicklyAndTheOtherStaysUsable) {
  NodeHarness node(2);
  SpecOptions o;
  o.steps = 1000000;
  o.output = "out-killed";
  v1::SubmitJobRequest req;
  req.set_job_id("victim");
  req.set_spec_yaml(Spec(o));
  req.set_base_dir(node.dir());
  ASSERT_TRUE(node.client().Submit(req).ok());
  // Let it run a few steps, then kill rank 1's process.
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    auto j = node.client().GetJob("victim");
    if (j.ok() && j->last().step() >= 3) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  int victim = node.worker_pids()[1];
  kill(victim, SIGKILL);
  waitpid(victim, nullptr, 0);
  absl::Time killed = absl::Now();
  auto j = node.WaitFinal("victim", 30);
  ASSERT_TRUE(j.ok()) << j.status();
  const double seconds = absl::ToDoubleSeconds(absl::Now() - killed);
  EXPECT_EQ(j->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(j->error_code(), static_cast<int>(absl::StatusCode::kUnavailable)) << j->error();
  EXPECT_LT(seconds, 10.0) << "the job should fail within a bounded time";
  std::cout << "job failed " << seconds << " s after the kill: " << j->error() << "\n";
  // The surviving worker runs the next job; nothing is left in /dev/shm.
  MustSucceed(node, Spec(OneWorker(2, "out-next")), "next");
  EXPECT_TRUE(node.LeakedSegments().empty());
}

}  // namespace
}  // namespace slidedp::testing

namespace slidedp::testing {
namespace {

TEST(Service, SigtermDrainsWithACheckpointThatResumes) {
  std::string ckpt_root;
  int64_t saved_step = 0;
  {
    NodeHarness node(2, {"--drain-mode", "checkpoint"});
    SpecOptions o;
    o.steps = 100000;
    o.output = "out-drain";
    v1::SubmitJobRequest req;
    req.set_job_id("drained");
    req.set_spec_yaml(Spec(o));
    req.set_base_dir(node.dir());
    ASSERT_TRUE(node.client().Submit(req).ok());
    absl::Time deadline = absl::Now() + absl::Seconds(60);
    while (absl::Now() < deadline) {
      auto j = node.client().GetJob("drained");
      if (j.ok() && j->last().step() >= 3) break;
      absl::SleepFor(absl::Milliseconds(20));
    }
    kill(node.hostd_pid(), SIGTERM);
    int status = 0;
    ASSERT_EQ(waitpid(node.hostd_pid(), &status, 0), node.hostd_pid());
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    ckpt_root = node.dir() + "/out-drain";
    auto latest = checkpoint::FindLatestCheckpoint(ckpt_root);
    ASSERT_TRUE(latest.ok()) << latest.status();
    auto step = checkpoint::VerifyCheckpoint(*latest);
    ASSERT_TRUE(step.ok()) << step.status();
    saved_step = *step;
    EXPECT_GE(saved_step, 3);
    EXPECT_TRUE(node.LeakedSegments().empty());
  }
  // A new node resumes the drained job from its checkpoint and finishes two more steps.
  NodeHarness node(2);
  SpecOptions o;
  o.steps = static_cast<int>(saved_step) + 2;
  o.output = "out-after-drain";
  v1::Job j = MustSucceed(node, Spec(o), "after-drain", ckpt_root);
  EXPECT_EQ(j.last().step(), saved_step + 2);
}

}  // namespace
}  // namespace slidedp::testing

namespace slidedp::testing {
namespace {

TEST(Service, HostdKilledWorkersReattachAndTheJobIsReportedWithItsCheckpoint) {
  // hostd --resume-interrupted=false: the job is reported interrupted, with its checkpoint.
  NodeHarness node(2, {"--resume-interrupted", "false"});
  SpecOptions o;
  o.steps = 100000;
  o.save_every = 2;
  o.output = "out-crash";
  v1::SubmitJobRequest req;
  req.set_job_id("crashed");
  req.set_spec_yaml(Spec(o));
  req.set_base_dir(node.dir());
  ASSERT_TRUE(node.client().Submit(req).ok());
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    auto j = node.client().GetJob("crashed");
    if (j.ok() && !j->last_checkpoint().empty() && j->last().step() >= 3) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  kill(node.hostd_pid(), SIGKILL);
  waitpid(node.hostd_pid(), nullptr, 0);
  EXPECT_FALSE(node.LeakedSegments().empty());  // a killed hostd leaves its segments behind

  // Workers notice (their gate waits check hostd's liveness) and wait to re-register.
  node.StartHostd();
  ASSERT_TRUE(node.client().WaitReady(20).ok());
  node.WaitWorkers(2);
  EXPECT_TRUE(node.LeakedSegments().empty());  // reclaimed at start
  auto j = node.client().GetJob("crashed");
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->state(), v1::JOB_STATE_FAILED);
  EXPECT_NE(j->error().find("interrupted"), std::string::npos) << j->error();
  ASSERT_FALSE(j->last_checkpoint().empty());
  auto step = checkpoint::VerifyCheckpoint(j->last_checkpoint());
  ASSERT_TRUE(step.ok()) << step.status();

  // Resume by job id: continues from that checkpoint.
  SpecOptions more = o;
  more.steps = static_cast<int>(*step) + 2;
  more.output = "out-crash-resumed";
  v1::Job r = MustSucceed(node, Spec(more), "crash-resumed", "crashed");
  EXPECT_EQ(r.last().step(), *step + 2);
}

}  // namespace
}  // namespace slidedp::testing

namespace slidedp::testing {
namespace {

TEST(Service, KilledWorkerWithAutomaticRestartResumesOnTheSurvivor) {
  NodeHarness node(2);
  SpecOptions o;
  o.workers = 0;  // all attached workers: two at first, one after the restart
  o.steps = 40;
  o.save_every = 2;
  o.max_restarts = 1;
  o.output = "out-restart";
  v1::SubmitJobRequest req;
  req.set_job_id("restarted");
  req.set_spec_yaml(Spec(o));
  req.set_base_dir(node.dir());
  ASSERT_TRUE(node.client().Submit(req).ok());
  absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    auto j = node.client().GetJob("restarted");
    if (j.ok() && !j->last_checkpoint().empty() && j->last().step() >= 3) break;
    absl::SleepFor(absl::Milliseconds(10));
  }
  int victim = node.worker_pids()[1];
  kill(victim, SIGKILL);
  waitpid(victim, nullptr, 0);
  auto j = node.WaitFinal("restarted", 120);
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
  EXPECT_EQ(j->last().step(), 40);
  EXPECT_EQ(j->num_workers(), 1);
  EXPECT_TRUE(node.LeakedSegments().empty());
}

}  // namespace
}  // namespace slidedp::testing

namespace slidedp::testing {
namespace {

// The largest gpu_peak_bytes a job's metrics report; every line's used peak is within it (the CPU
// backend has no caching pool: the two are the same).
int64_t PeakBytes(const NodeHarness& node, const std::string& output, const std::string& job) {
  int64_t p = 0;
  for (const auto& j : MetricsLines(node, output, job)) {
    p = std::max<int64_t>(p, j["gpu_peak_bytes"]);
    EXPECT_GT(j.value("gpu_used_peak_bytes", int64_t{0}), 0) << j.dump();
    EXPECT_LE(j.value("gpu_used_peak_bytes", int64_t{0}), j["gpu_peak_bytes"].get<int64_t>()) << j.dump();
  }
  return p;
}

// Both gradient routes with 2 workers (gpu: each rank reduce-scatters and posts only its summed
// shard; cpu: hostd sums full copies) end at the 1-worker parameters, with and without clipping
// (without: shards are applied straight from the ring slots as they arrive, in small chunks).
// With clipping, the gpu route runs with both gradient stagings: "device" (the default here:
// each rank keeps its parts until backward ends and posts its squared norm first) and "host";
// the 1-worker reference itself uses device staging, and host staging is checked against it too.
TEST(Training, GpuAndCpuGradientRoutesMatchOneWorker) {
  for (double max_norm : {1.0, 0.0}) {
    SpecOptions base;
    base.max_grad_norm = max_norm;
    base.chunk_bytes = 8192;  // several chunks per unit, so ranks post different chunk counts
    const std::string tag = max_norm > 0 ? "clip" : "noclip";
    SpecOptions one = base;
    one.workers = 1;
    one.micro_batch = 4;
    one.output = "out-one-" + tag;
    std::vector<std::vector<float>> m1;
    int64_t host_bytes_device_staging = 0;
    {
      NodeHarness node(1);
      m1 = LoadMaster(MustSucceed(node, Spec(one), "one-" + tag).last_checkpoint());
      auto lines = MetricsLines(node, one.output, "one-" + tag);
      ASSERT_EQ(lines.size(), 4u);
      EXPECT_EQ(lines.back().value("grad_staging", ""), max_norm > 0 ? "device" : "none");
      // One rank stages nothing in hostd's memory: device staging (and, without clipping, the
      // direct path) applies the parts straight from the ring slots.
      EXPECT_EQ(lines.back().value("host_staging_bytes", int64_t{-1}), 0);
      if (max_norm > 0) {  // one worker, host staging: the same parameters, 4 bytes/param more host memory
        SpecOptions host = one;
        host.grad_staging = "host";
        host.output = "out-one-host";
        const double d = MaxAbsDiff(LoadMaster(MustSucceed(node, Spec(host), "one-host").last_checkpoint()), m1);
        std::cout << "1 worker, host vs device gradient staging: max |diff| " << d << "\n";
        EXPECT_LE(d, 1e-6);
        auto host_lines = MetricsLines(node, host.output, "one-host");
        ASSERT_EQ(host_lines.size(), 4u);
        EXPECT_EQ(host_lines.back().value("grad_staging", ""), "host");
        EXPECT_EQ(host_lines.back().value("host_staging_bytes", int64_t{-1}), TinyLayout().total_numel * 4);
        host_bytes_device_staging = lines.back().value("host_state_bytes", int64_t{0});
        EXPECT_EQ(host_lines.back().value("host_state_bytes", int64_t{0}) - host_bytes_device_staging,
                  TinyLayout().total_numel * 4);
        EXPECT_NEAR(host_lines.back().value("grad_norm", 0.0), lines.back().value("grad_norm", 0.0), 1e-9);
      }
    }
    NodeHarness node(2);
    struct Run {
      std::string route, staging;
    };
    std::vector<Run> runs = {{"cpu", ""}, {"gpu", ""}};
    if (max_norm > 0) runs.push_back({"gpu", "host"});
    for (const Run& run : runs) {
      SpecOptions two = base;
      two.grad_reduction = run.route;
      two.grad_staging = run.staging;
      const std::string id = run.route + (run.staging.empty() ? "" : "-" + run.staging) + "-" + tag;
      two.output = "out-" + id;
      v1::Job j = MustSucceed(node, Spec(two), id);
      if (j.last_checkpoint().empty()) continue;
      const double d = MaxAbsDiff(LoadMaster(j.last_checkpoint()), m1);
      std::cout << "2 workers, " << id << ": max |diff| vs 1 worker " << d << "\n";
      EXPECT_LE(d, 1e-5) << id;
      auto lines = MetricsLines(node, two.output, id);
      ASSERT_EQ(lines.size(), 4u) << id;
      EXPECT_EQ(lines.back().value("grad_reduction", ""), run.route);
      // auto staging: on the devices where every rank's part is final (gpu route), else on the host
      const std::string staging = max_norm == 0                               ? "none"
                                  : run.route == "gpu" && run.staging.empty() ? "device"
                                                                              : "host";
      EXPECT_EQ(lines.back().value("grad_staging", ""), staging) << id;
      // hostd holds a whole step's gradients where it sums the ranks' copies or waits for the norm
      EXPECT_EQ(lines.back().value("host_staging_bytes", int64_t{-1}),
                run.route == "cpu" || staging == "host" ? TinyLayout().total_numel * 4 : 0)
          << id;
      EXPECT_GT(lines.back().value("host_state_bytes", int64_t{0}), 0);
      EXPECT_GT(lines.back().value("grad_norm", 0.0), 0.0);
      // The update window (first update submitted to last done) and LayerAdam's rate over it.
      const double update_s = lines.back()["busy_s"].value("host_update", 0.0);
      EXPECT_GT(update_s, 0.0) << id;
      EXPECT_NEAR(lines.back().value("host_update_gparams_per_s", 0.0) * update_s * 1e9,
                  static_cast<double>(TinyLayout().total_numel), 1.0)
          << id;
      // Copy priority is on by default, but CPU workers have no DMA to mark urgent: LayerAdam never paused.
      ASSERT_TRUE(lines.back()["busy_s"].contains("host_adam_paused")) << id;
      EXPECT_EQ(lines.back()["busy_s"].value("host_adam_paused", -1.0), 0.0) << id;
    }
    EXPECT_TRUE(node.LeakedSegments().empty());
  }
}

// Context parallelism (issue 26): two workers that split every micro-batch's tokens zig-zag and
// gather attention's keys and values through the job's context collective train as one worker
// taking the whole micro-batches: the same losses, validation loss and parameters within FP32
// summation order, on both gradient routes and with a kept-attention policy; and so do four
// workers in two groups of two (data parallelism across the groups).
TEST(Training, ContextParallelTwoWorkersMatchOneWorker) {
  SpecOptions one = OneWorker(4, "out-cp-one");
  one.validate = true;
  std::vector<std::vector<float>> m1, state1;
  std::vector<double> losses1;
  double eval1 = 0;
  auto losses_of = [](const std::vector<nlohmann::json>& lines) {
    std::vector<double> l;
    for (const auto& j : lines) l.push_back(j.value("loss", 0.0));
    return l;
  };
  {
    NodeHarness node(1);
    state1 = LoadState(MustSucceed(node, Spec(one), "cp-one").last_checkpoint());
    m1.assign(state1.begin(), state1.begin() + TinyLayout().num_units());
    auto lines = MetricsLines(node, one.output, "cp-one");
    ASSERT_EQ(lines.size(), 4u);
    losses1 = losses_of(lines);
    eval1 = lines.back().value("eval_loss", 0.0);
    EXPECT_GT(eval1, 0.0);
  }
  NodeHarness node(2);
  struct Run {  // a gradient route, a layer policy, tiles of a share, checkpoints offloaded
    std::string route, act_policy;
    int64_t tile_tokens = 0;
    double offload_ratio = 0;
  };
  for (const Run& run : {Run{"gpu", ""}, Run{"cpu", ""}, Run{"gpu", "selective"}, Run{"gpu", "", 48, 0},
                         Run{"gpu", "", 0, 0.5}}) {
    SpecOptions cp = one;
    cp.workers = 2;
    cp.context_parallel = 2;
    cp.grad_reduction = run.route;
    cp.act_policy = run.act_policy;
    cp.tile_tokens = run.tile_tokens;
    cp.offload_ratio = run.offload_ratio;
    const std::string id = absl::StrCat("cp-", run.route, run.act_policy.empty() ? "" : "-" + run.act_policy,
                                        run.tile_tokens ? absl::StrCat("-tile", run.tile_tokens) : "",
                                        run.offload_ratio > 0 ? "-offload" : "");
    cp.output = "out-" + id;
    v1::Job j = MustSucceed(node, Spec(cp), id);
    ASSERT_FALSE(j.last_checkpoint().empty()) << id;
    const std::vector<std::vector<float>> state = LoadState(j.last_checkpoint());
    const double d = MaxAbsDiff({state.begin(), state.begin() + TinyLayout().num_units()}, m1);
    std::cout << "context parallel 2, " << id << ": max |diff| of the parameters vs 1 worker " << d << "\n";
    EXPECT_LE(d, 1e-5) << id;
    // Every gradient: Adam's moments are sums of the steps' gradients (m linear in them, v in their
    // squares), each tensor within FP32 summation order of the one-worker run's.
    const double moments = MaxRelativeMomentDiff(state, state1);
    std::cout << "context parallel 2, " << id << ": Adam moments, max |diff| / max |value| per tensor " << moments
              << "\n";
    EXPECT_LE(moments, 1e-4) << id;
    auto lines = MetricsLines(node, cp.output, id);
    ASSERT_EQ(lines.size(), 4u) << id;
    const std::vector<double> losses = losses_of(lines);
    for (size_t s = 0; s < losses.size(); ++s) {
      EXPECT_NEAR(losses[s], losses1[s], 1e-5 * std::abs(losses1[s])) << id << " step " << s + 1;
    }
    EXPECT_NEAR(lines.back().value("eval_loss", 0.0), eval1, 1e-5 * eval1) << id;
  }
  // The workers split the micro-batches (not data parallelism, which would match as well).
  std::string logs;
  for (int w = 0; w < 2; ++w) {
    std::ifstream log(node.dir() + "/worker" + std::to_string(w) + ".log");
    logs.append(std::istreambuf_iterator<char>(log), std::istreambuf_iterator<char>());
  }
  for (int r = 0; r < 2; ++r) EXPECT_TRUE(absl::StrContains(logs, absl::StrCat("context parallel, rank ", r, " of 2")));
  {  // A MoE model with its load-balancing loss: the group's router statistics make the whole
     // micro-batch's aux loss (counted once) and its gradient on every rank's tokens.
    SpecOptions moe1 = one;
    moe1.preset = "tiny-moe";
    moe1.router_aux_loss_coef = 0.05;
    moe1.output = "out-cp-moe-one";
    SpecOptions moe2 = moe1;
    moe2.workers = 2;
    moe2.context_parallel = 2;
    moe2.output = "out-cp-moe";
    std::vector<nlohmann::json> l1, l2;
    {
      NodeHarness solo(1);
      MustSucceed(solo, Spec(moe1), "cp-moe-one");
      l1 = MetricsLines(solo, moe1.output, "cp-moe-one");
    }
    MustSucceed(node, Spec(moe2), "cp-moe");
    l2 = MetricsLines(node, moe2.output, "cp-moe");
    ASSERT_EQ(l1.size(), 4u);
    ASSERT_EQ(l2.size(), 4u);
    for (size_t s = 0; s < 4; ++s) {
      const double a1 = l1[s].value("router_aux_loss", 0.0), a2 = l2[s].value("router_aux_loss", 0.0);
      EXPECT_GT(a1, 0.0);
      EXPECT_NEAR(a2, a1, 1e-5 * a1) << "aux loss, step " << s + 1;
      EXPECT_NEAR(l2[s].value("loss", 0.0), l1[s].value("loss", 0.0), 1e-5 * l1[s].value("loss", 0.0))
          << "MoE loss, step " << s + 1;
    }
    EXPECT_NEAR(l2.back().value("eval_loss", 0.0), l1.back().value("eval_loss", 0.0),
                1e-5 * l1.back().value("eval_loss", 0.0));
    EXPECT_EQ(l2.back()["expert_tokens"].dump(), l1.back()["expert_tokens"].dump());
  }
  {  // Two groups of two (data parallelism across context-parallel groups, each with its own
     // collective), and one group of three (six chunks a row, a rank's share of odd length).
    NodeHarness four(4);
    SpecOptions dpcp = one;
    dpcp.workers = 4;
    dpcp.context_parallel = 2;
    dpcp.micro_batch = 2;  // global 8 = 2 groups x 2 micro-batches of 2 rows
    dpcp.output = "out-cp-dp";
    SpecOptions three = one;
    three.workers = 3;
    three.context_parallel = 3;
    three.output = "out-cp-three";
    for (const SpecOptions& o : {dpcp, three}) {
      const std::string id = o.workers == 4 ? "cp-dp" : "cp-three";
      v1::Job j = MustSucceed(four, Spec(o), id);
      ASSERT_FALSE(j.last_checkpoint().empty()) << id;
      const std::vector<std::vector<float>> state = LoadState(j.last_checkpoint());
      const double d = MaxAbsDiff({state.begin(), state.begin() + TinyLayout().num_units()}, m1);
      const double moments = MaxRelativeMomentDiff(state, state1);
      std::cout << id << ": max |diff| of the parameters vs 1 worker " << d << ", of Adam's moments (relative) "
                << moments << "\n";
      EXPECT_LE(d, 1e-5) << id;
      EXPECT_LE(moments, 1e-4) << id;
      auto lines = MetricsLines(four, o.output, id);
      ASSERT_EQ(lines.size(), 4u) << id;
      EXPECT_NEAR(lines.back().value("eval_loss", 0.0), eval1, 1e-5 * eval1) << id;
    }
    EXPECT_TRUE(four.LeakedSegments().empty());
  }
  // Refused at submit: a group that is not the whole job, and auto policies (each rank would choose).
  SpecOptions bad = one;
  bad.workers = 2;
  bad.context_parallel = 2;
  bad.act_policy = "auto";
  auto refused = node.RunJob(Spec(bad), "cp-auto");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "context_parallel")) << refused.status();
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// gemma4 split over a context-parallel group of two: the per-layer inputs and the shared keys and
// values of each rank's tokens stay on the rank (the attention gathers and reduce-scatters as for any
// family); the losses equal one worker's. Steps 1 and 2 only: gemma4's training at this learning rate
// grows FP32 summation differences fast (families_test).
TEST(Training, ContextParallelGemma4MatchesOneWorker) {
  SpecOptions one = OneWorker(2, "out-cp-g4-one");
  one.preset = "tiny-gemma4";
  SpecOptions cp = one;
  cp.workers = 2;
  cp.context_parallel = 2;
  cp.output = "out-cp-g4";
  std::vector<nlohmann::json> l1, l2;
  {
    NodeHarness solo(1);
    MustSucceed(solo, Spec(one), "cp-g4-one");
    l1 = MetricsLines(solo, one.output, "cp-g4-one");
  }
  NodeHarness node(2);
  MustSucceed(node, Spec(cp), "cp-g4");
  l2 = MetricsLines(node, cp.output, "cp-g4");
  ASSERT_EQ(l1.size(), 2u);
  ASSERT_EQ(l2.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    const double a = l1[s].value("loss", 0.0), b = l2[s].value("loss", 0.0);
    EXPECT_NEAR(b, a, 1e-5 * a) << "step " << s + 1;
    EXPECT_NEAR(l2[s].value("grad_norm", 0.0), l1[s].value("grad_norm", 0.0), 1e-5 * l1[s].value("grad_norm", 0.0))
        << "step " << s + 1;
  }
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// runtime.grad_dtype bf16 through real CPU workers: every route and staging trains with the
// gradients rounded to BF16 on the wire (metrics say so), close to the FP32 run but not equal to
// it; one and two workers on the gpu route agree as closely as in FP32 (the rounding comes after
// the reduction).
TEST(Training, Bf16GradientsTrainCloseToFp32OnEveryRoute) {
  NodeHarness node(2);
  for (double max_norm : {1.0, 0.0}) {
    const std::string tag = max_norm > 0 ? "clip" : "noclip";
    SpecOptions base;
    base.max_grad_norm = max_norm;
    base.chunk_bytes = 8192;
    base.grad_reduction = "gpu";
    base.output = "out-fp32-" + tag;
    const auto fp32 = LoadMaster(MustSucceed(node, Spec(base), "fp32-" + tag).last_checkpoint());
    struct Run {
      int workers;
      std::string route, staging;
    };
    std::vector<std::vector<float>> gpu_two;
    for (const Run& run : {Run{2, "gpu", ""}, Run{2, "cpu", ""}, Run{2, "gpu", "host"}, Run{1, "gpu", ""}}) {
      SpecOptions o = base;
      o.workers = run.workers;
      o.micro_batch = run.workers == 1 ? 4 : 2;
      o.grad_reduction = run.route;
      o.grad_staging = max_norm > 0 ? run.staging : "";
      o.grad_dtype = "bf16";
      const std::string id = absl::StrCat("bf16-", run.workers, run.route, run.staging, "-", tag);
      o.output = "out-" + id;
      const auto master = LoadMaster(MustSucceed(node, Spec(o), id).last_checkpoint());
      const double d = MaxAbsDiff(master, fp32);
      std::cout << id << ": max |diff| vs FP32 gradients " << d << "\n";
      EXPECT_GT(d, 0) << id;
      EXPECT_LE(d, 1e-3) << id;  // lr 1e-3, 4 steps: a rounded gradient moves Adam's steps a little
      auto lines = MetricsLines(node, o.output, id);
      ASSERT_EQ(lines.size(), 4u) << id;
      EXPECT_EQ(lines.back().value("grad_dtype", ""), "bf16") << id;
      if (run.workers == 2 && run.route == "gpu" && run.staging.empty()) gpu_two = master;
      if (run.workers == 1) {
        EXPECT_LE(MaxAbsDiff(master, gpu_two), 1e-5) << id;
      }
    }
  }
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// runtime.param_source master through real CPU workers: the state segment keeps no BF16 mirror
// (2 B/param less host state), the workers cast the master after each gate, and every route
// trains to the same bits as with the mirror, also with int8 moments and with the casts split
// over three threads (runtime.cast_threads); a pooled segment made with a mirror serves a job
// without one and back.
TEST(Training, MasterSourceTrainsBitwiseAsTheMirror) {
  NodeHarness node(2);
  struct Run {
    int workers;
    std::string route, state;
    double max_norm;
  };
  const int64_t elements = TinyLayout().total_numel;
  for (const Run& run : {Run{2, "gpu", "", 1.0}, Run{2, "cpu", "", 0.0}, Run{1, "gpu", "", 0.0},
                         Run{1, "gpu", "", 1.0}, Run{2, "gpu", "int8", 0.0}}) {
    SpecOptions o;
    o.workers = run.workers;
    o.micro_batch = run.workers == 1 ? 4 : 2;
    o.grad_reduction = run.route;
    o.max_grad_norm = run.max_norm;
    o.state_dtype = run.state;
    o.chunk_bytes = 8192;
    const std::string id = absl::StrCat(run.workers, run.route, run.state, run.max_norm > 0 ? "clip" : "noclip");
    o.output = "out-mirror-" + id;
    const v1::Job with = MustSucceed(node, Spec(o), "mirror-" + id);
    o.param_source = "master";
    o.cast_threads = run.max_norm > 0 && run.workers == 2 ? 3 : 0;
    o.output = "out-master-" + id;
    const v1::Job without = MustSucceed(node, Spec(o), "master-" + id);
    if (with.last_checkpoint().empty() || without.last_checkpoint().empty()) continue;
    EXPECT_EQ(MaxAbsDiff(LoadState(with.last_checkpoint()), LoadState(without.last_checkpoint())), 0.0) << id;
    auto lines = MetricsLines(node, o.output, "master-" + id);
    ASSERT_EQ(lines.size(), 4u) << id;
    EXPECT_EQ(lines.back().value("param_source", ""), "master") << id;
    auto mirror_lines = MetricsLines(node, "out-mirror-" + id, "mirror-" + id);
    ASSERT_EQ(mirror_lines.size(), 4u) << id;
    for (size_t i = 0; i < lines.size(); ++i) {
      EXPECT_EQ(lines[i].value("loss", 0.0), mirror_lines[i].value("loss", 0.0)) << id << " step " << i;
    }
    // The mirror's 2 B/param go; the workers' cast staging (3 chunks each, page-rounded) comes.
    const int64_t saved = mirror_lines.back().value("host_state_bytes", int64_t{0}) -
                          lines.back().value("host_state_bytes", int64_t{0});
    std::cout << id << ": host state without the mirror " << lines.back().value("host_state_bytes", int64_t{0})
              << " bytes, " << saved << " fewer\n";
    EXPECT_GE(saved, 2 * elements - run.workers * 3 * 12288) << id;
    EXPECT_GT(lines.back().value("busy_s", nlohmann::json::object()).value("worker_cast", -1.0), 0.0) << id;
  }
  const std::string log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_NE(log.find("no BF16 mirror"), std::string::npos) << "see " << node.dir();
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// A second job of the same model reuses the first job's pooled, pre-faulted state segment, and
// ends at exactly the same parameters as the first (the reused segment is fully reset).
TEST(Service, SecondJobReusesThePooledHostStateAndGivesTheSameResult) {
  NodeHarness node(1);
  SpecOptions o = OneWorker(4, "out-cold");
  v1::Job cold = MustSucceed(node, Spec(o), "cold");
  EXPECT_EQ(node.PooledSegments().size(), 1u);
  EXPECT_TRUE(node.LeakedSegments().empty());
  o.output = "out-warm";
  v1::Job warm = MustSucceed(node, Spec(o), "warm");
  const std::string log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_EQ(log.find("job cold: reused pooled host state"), std::string::npos);
  EXPECT_NE(log.find("job warm: reused pooled host state"), std::string::npos) << "see " << node.dir();
  std::cout << "submit to first step: cold " << cold.submit_to_first_step_s() << " s, warm "
            << warm.submit_to_first_step_s() << " s\n";
  if (!cold.last_checkpoint().empty() && !warm.last_checkpoint().empty()) {
    EXPECT_EQ(MaxAbsDiff(LoadMaster(cold.last_checkpoint()), LoadMaster(warm.last_checkpoint())), 0.0);
  }
  EXPECT_EQ(node.PooledSegments().size(), 1u);
  EXPECT_TRUE(node.LeakedSegments().empty());
  // The worker kept the first job's mapping (on CUDA also the mirrors' registrations) and the
  // second job found it: hostd renamed the pooled file, the worker re-read its layout.
  const std::string worker_log = ReadFile(node.dir() + "/worker0.log");
  EXPECT_NE(worker_log.find("the previous job's segment, still mapped"), std::string::npos) << "see " << node.dir();
}

// Without pooling hostd removes each finished job's segment and tells the worker, which drops
// the mapping it kept (its memory is free before the next admission check).
TEST(Service, WithoutPoolingTheWorkerReleasesItsKeptMappingWhenHostdSaysSo) {
  NodeHarness node(1, {"--pool-host-state=false"});
  SpecOptions o = OneWorker(2, "out-a");
  MustSucceed(node, Spec(o), "a");
  o.output = "out-b";
  MustSucceed(node, Spec(o), "b");
  EXPECT_TRUE(node.PooledSegments().empty());
  EXPECT_TRUE(node.LeakedSegments().empty());
  const std::string worker_log = ReadFile(node.dir() + "/worker0.log");
  EXPECT_NE(worker_log.find("(hostd removes it)"), std::string::npos) << "see " << node.dir();
  EXPECT_EQ(worker_log.find("still mapped"), std::string::npos);
  const std::string hostd_log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_NE(hostd_log.find("worker(s) released"), std::string::npos);
  EXPECT_EQ(hostd_log.find("did not confirm"), std::string::npos);
}

}  // namespace
}  // namespace slidedp::testing

namespace slidedp::testing {
namespace {

// A micro-batch too large for the worker's device memory fails the job with RESOURCE_EXHAUSTED
// and the numbers; the worker stays attached and runs a job that fits right afterwards. The
// CPU backend is given a "device" capacity between the peaks of the two jobs, measured first.
TEST(Faults, DeviceMemoryTooSmallIsAClearErrorAndTheWorkerStaysUsable) {
  // Layer checkpoints of every micro-batch stay until backward: device memory follows the tokens
  // per step per worker.
  SpecOptions small;
  small.workers = 1;
  small.global_batch = 2;
  small.micro_batch = 1;
  small.steps = 2;
  SpecOptions big = small;
  big.global_batch = 16;
  big.micro_batch = 4;
  int64_t peak_small = 0, peak_big = 0;
  {
    NodeHarness node(1);
    small.output = "out-small";
    big.output = "out-big";
    MustSucceed(node, Spec(small), "small");
    MustSucceed(node, Spec(big), "big");
    peak_small = PeakBytes(node, "out-small", "small");
    peak_big = PeakBytes(node, "out-big", "big");
  }
  ASSERT_GT(peak_small, 0);
  ASSERT_GT(peak_big, peak_small);
  const int64_t capacity = (peak_small + peak_big) / 2;
  NodeHarness node(1, {}, {absl::StrCat("SLIDEDP_CPU_DEVICE_MEMORY_BYTES=", capacity)});
  auto failed = node.RunJob(Spec(big), "too-big");
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(failed->error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << failed->error();
  EXPECT_TRUE(absl::StrContains(failed->error(), "device memory exhausted")) << failed->error();
  EXPECT_TRUE(absl::StrContains(failed->error(), "GiB free of")) << failed->error();
  EXPECT_TRUE(absl::StrContains(failed->error(), "train.global_batch")) << failed->error();
  std::cout << "too-big: " << failed->error() << "\n";
  // With the step's gradients staged on the device the message also names runtime.grad_staging.
  SpecOptions big_staged = big;
  big_staged.grad_staging = "device";
  big_staged.output = "out-big-staged";
  auto staged = node.RunJob(Spec(big_staged), "too-big-staged");
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_EQ(staged->error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << staged->error();
  EXPECT_TRUE(absl::StrContains(staged->error(), "runtime.grad_staging: host")) << staged->error();
  small.output = "out-after";
  MustSucceed(node, Spec(small), "fits");
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// runtime.policy with a per-layer layout file: every layer kind (keep_all, selective, recompute,
// segment), with none, a share or all of its checkpoints (input and kept pieces) offloaded, in
// mixed layouts, trains to the parameters of
// whole-layer recompute bit for bit, with one worker and with two; a layout made for another
// model is FAILED_PRECONDITION naming the size, a malformed file is refused at submit with
// INVALID_ARGUMENT, and the node keeps serving.
TEST(Training, PerLayerLayoutsAreBitwiseRecompute) {
  NodeHarness node(2);
  const std::string shape =
      "model: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, "
      "intermediate_size: 128, vocab_size: 512}\n";
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(node.dir() + "/" + name) << text;
    return name;
  };
  // Each layout, and the elements per token its offloaded checkpoints hold (admission's count: the
  // input, 64, and the kept pieces in FP32 — keep_all 748, selective 68, segment(qkv+gate_up)
  // 384 — times the share, in whole micro-batches of the 2 each rank runs).
  const std::vector<std::pair<std::string, int64_t>> layouts = {
      {"[{kind: keep_all, offload: 0.5}, {kind: selective}]", 406},
      {"[{kind: selective, offload: true}, {kind: recompute, offload: 0.3}]", 132 + 32},
      {"[{kind: recompute}, {kind: keep_all, offload: true}]", 812},
      {"[{kind: segment, keep: [gate_up, qkv], offload: true}, {kind: segment, keep: [attention, o_proj]}]", 448},
      {"[{kind: keep_all, offload: true}, {kind: keep_all, offload: 0.5}]", 812 + 406},
  };
  for (int workers : {1, 2}) {
    SpecOptions o;
    o.workers = workers;
    o.micro_batch = workers == 1 ? 4 : 2;
    o.max_grad_norm = 1.0;
    o.output = absl::StrCat("out-recompute-", workers);
    const auto base = LoadMaster(MustSucceed(node, Spec(o), absl::StrCat("recompute-", workers)).last_checkpoint());
    ASSERT_FALSE(base.empty());
    for (size_t i = 0; i < layouts.size(); ++i) {
      const auto& [layers, elements] = layouts[i];
      SpecOptions p = o;
      p.policy = write(absl::StrCat("policy", i, ".yaml"), "version: 1\n" + shape + "layers: " + layers + "\n");
      p.output = absl::StrCat("out-layout-", workers, "-", i);
      const std::string id = absl::StrCat("layout-", workers, "-", i);
      const auto got = LoadMaster(MustSucceed(node, Spec(p), id).last_checkpoint());
      EXPECT_EQ(MaxAbsDiff(got, base), 0.0) << layers << " on " << workers << " worker(s)";
      // The layout ran as written: hostd counted its offloaded checkpoints (per worker, its rows of
      // 64 tokens), and each worker said what it runs.
      const int64_t tokens = (8 / workers * 64) * workers;
      EXPECT_EQ(MetricsLines(node, p.output, id).back().value("host_state_bytes", int64_t{0}) -
                    MetricsLines(node, o.output, absl::StrCat("recompute-", workers)).back().value("host_state_bytes", int64_t{0}),
                elements * tokens * 4)
          << layers;
    }
  }
  const std::string worker_log = ReadFile(node.dir() + "/worker0.log");
  for (const char* said : {"0:keep_all+offload(0.5), 1:selective", "0:selective+offload, 1:recompute+offload(0.3)",
                           "0:recompute, 1:keep_all+offload",
                           "0:segment(qkv+gate_up)+offload, 1:segment(attention+o_proj)",
                           "0:keep_all+offload, 1:keep_all+offload(0.5)"}) {
    EXPECT_NE(worker_log.find(said), std::string::npos) << said << " (see " << node.dir() << ")";
  }
  // Made for another model: the job fails before its first step, naming the size.
  SpecOptions other;
  other.workers = 1;
  other.policy = write("other.yaml", "version: 1\n" + absl::StrReplaceAll(shape, {{"hidden_size: 64", "hidden_size: 128"}}) +
                                         "layers: [{kind: recompute}, {kind: recompute}]\n");
  other.output = "out-other";
  auto failed = node.RunJob(Spec(other), "layout-other");
  if (failed.ok()) {
    EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED);
    EXPECT_EQ(failed->error_code(), static_cast<int>(absl::StatusCode::kFailedPrecondition)) << failed->error();
    EXPECT_TRUE(absl::StrContains(failed->error(), "model.hidden_size 128")) << failed->error();
  } else {
    EXPECT_EQ(failed.status().code(), absl::StatusCode::kFailedPrecondition) << failed.status();
    EXPECT_TRUE(absl::StrContains(failed.status().message(), "model.hidden_size 128")) << failed.status();
  }
  // Malformed: refused at submit.
  SpecOptions broken = other;
  broken.policy = write("broken.yaml", "version: 1\n" + shape + "layers: [{kind: keep_some}, {kind: recompute}]\n");
  auto refused = node.RunJob(Spec(broken), "layout-broken");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << refused.status();
  EXPECT_TRUE(absl::StrContains(refused.status().message(), "keep_some")) << refused.status();
  SpecOptions fine;
  fine.workers = 1;
  fine.output = "out-after-layouts";
  MustSucceed(node, Spec(fine), "after-layouts");
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// runtime.gpu_memory_limit: a job whose step needs more than the limit fails with
// RESOURCE_EXHAUSTED naming it (the device itself has room); one that fits runs with its peak
// under the limit and the same parameters as without a limit; the next job on the same worker,
// without a limit, gets the whole device back. The limit sits between the peaks of two batch
// sizes, measured first.
TEST(Faults, GpuMemoryLimitIsRespectedOrAClearError) {
  SpecOptions small;
  small.workers = 1;
  small.global_batch = 32;
  small.micro_batch = 8;
  small.steps = 2;
  SpecOptions big = small;
  big.global_batch = 96;  // (the dataset has 102 rows)
  big.micro_batch = 32;
  NodeHarness node(1);
  auto peak = [&](const std::string& output, const std::string& job) { return PeakBytes(node, output, job); };
  small.output = "out-small";
  big.output = "out-big";
  const auto free_small = LoadMaster(MustSucceed(node, Spec(small), "small").last_checkpoint());
  MustSucceed(node, Spec(big), "big");
  const int64_t peak_small = peak("out-small", "small"), peak_big = peak("out-big", "big");
  ASSERT_GT(peak_big, peak_small);
  const int64_t limit = (peak_small + peak_big) / 2;
  std::cout << "peaks: small " << peak_small << ", big " << peak_big << " bytes; limit " << limit << "\n";
  ASSERT_GE(limit, slidedp::kMinGpuMemoryLimitBytes) << "the tiny model's peaks are below the smallest limit a spec takes";

  SpecOptions big_limited = big;
  big_limited.gpu_memory_limit = absl::StrCat(limit);
  big_limited.output = "out-big-limited";
  auto failed = node.RunJob(Spec(big_limited), "big-limited");
  ASSERT_TRUE(failed.ok()) << failed.status();
  EXPECT_EQ(failed->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(failed->error_code(), static_cast<int>(absl::StatusCode::kResourceExhausted)) << failed->error();
  EXPECT_TRUE(absl::StrContains(failed->error(), "runtime.gpu_memory_limit")) << failed->error();
  std::cout << "big-limited: " << failed->error() << "\n";

  SpecOptions small_limited = small;
  small_limited.gpu_memory_limit = absl::StrCat(limit);
  small_limited.output = "out-small-limited";
  const auto limited = LoadMaster(MustSucceed(node, Spec(small_limited), "small-limited").last_checkpoint());
  EXPECT_EQ(MaxAbsDiff(limited, free_small), 0.0);
  EXPECT_LE(peak("out-small-limited", "small-limited"), limit);

  big.output = "out-big-again";
  MustSucceed(node, Spec(big), "big-again");
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// Offloading layer checkpoints (here: through the CPU backend's store, which moves them out and
// back) changes where they wait, not what backward computes: bitwise the same parameters.
TEST(Training, ActivationOffloadGivesTheSameParameters) {
  NodeHarness node(2);
  SpecOptions base;
  base.output = "out-keep";
  SpecOptions half = base, all = base;
  half.offload_ratio = 0.5;
  half.output = "out-half";
  all.offload_ratio = 1.0;
  all.output = "out-all";
  auto keep = LoadMaster(MustSucceed(node, Spec(base), "keep").last_checkpoint());
  auto offload_half = LoadMaster(MustSucceed(node, Spec(half), "half").last_checkpoint());
  auto offload_all = LoadMaster(MustSucceed(node, Spec(all), "all").last_checkpoint());
  EXPECT_EQ(MaxAbsDiff(keep, offload_half), 0.0);
  EXPECT_EQ(MaxAbsDiff(keep, offload_all), 0.0);
  // ... and the checkpoints really left the "device": its peak falls with the ratio.
  auto peak = [&](const std::string& output, const std::string& job) { return PeakBytes(node, output, job); };
  const int64_t p_keep = peak("out-keep", "keep"), p_half = peak("out-half", "half"), p_all = peak("out-all", "all");
  EXPECT_GT(p_keep, 0);
  EXPECT_LT(p_half, p_keep);
  EXPECT_LT(p_all, p_half);
  // hostd's memory plan counts the workers' copies: per worker, the offloaded layers' inputs of
  // its 4 rows x 64 tokens, FP32 (hidden x 4 B per token).
  auto host_state = [&](const std::string& output, const std::string& job) {
    return MetricsLines(node, output, job).back().value("host_state_bytes", int64_t{0});
  };
  const ModelLayout layout = TinyLayout();
  const int64_t per_layer = 2 * (8 / 2 * 64) * layout.config.hidden_size * 4;  // both workers
  EXPECT_EQ(host_state("out-half", "half") - host_state("out-keep", "keep"), layout.OffloadedLayers(0.5) * per_layer);
  EXPECT_EQ(host_state("out-all", "all") - host_state("out-keep", "keep"), layout.OffloadedLayers(1.0) * per_layer);
}

// runtime.checkpoint_dtype bf16 through real CPU workers: every layer input waits in BF16 between
// its forward and its backward. The forward still runs on the exact inputs, so the first step's
// loss is the FP32 run's bit for bit and later ones stay close; the gradients see the rounded
// inputs, so the parameters move (a little); offloading the BF16 inputs changes nothing of that.
// The memory: the workers' device peak falls, and hostd counts half the bytes for the offloaded
// inputs (2 B an element), the selective layers' kept pieces still 4.
TEST(Training, Bf16CheckpointsKeepTheLossHalveTheInputsAndMoveTheGradientsALittle) {
  NodeHarness node(2);
  struct Run {
    std::string id, dtype, act_policy;
    double offload;
  };
  const std::vector<Run> runs = {{"fp32-keep", "", "", 0},         {"bf16-keep", "bf16", "", 0},
                                 {"fp32-all", "fp32", "", 1},      {"bf16-all", "bf16", "", 1},
                                 {"fp32-sel", "", "selective", 1}, {"bf16-sel", "bf16", "selective", 1}};
  std::map<std::string, std::vector<std::vector<float>>> master;
  std::map<std::string, std::vector<nlohmann::json>> lines;
  for (const Run& run : runs) {
    SpecOptions o;
    o.checkpoint_dtype = run.dtype;
    o.act_policy = run.act_policy;
    o.offload_ratio = run.offload;
    o.output = "out-" + run.id;
    master[run.id] = LoadMaster(MustSucceed(node, Spec(o), run.id).last_checkpoint());
    lines[run.id] = MetricsLines(node, o.output, run.id);
    ASSERT_EQ(lines[run.id].size(), 4u) << run.id;
    EXPECT_EQ(lines[run.id].back().value("checkpoint_dtype", ""), run.dtype == "bf16" ? "bf16" : "fp32") << run.id;
  }
  for (const auto& [fp32, bf16] : {std::pair<std::string, std::string>{"fp32-keep", "bf16-keep"},
                                   {"fp32-all", "bf16-all"},
                                   {"fp32-sel", "bf16-sel"}}) {
    const auto& a = lines[fp32];
    const auto& b = lines[bf16];
    // (a) The first step's loss comes before any update: bit for bit; later ones see the moved parameters.
    EXPECT_EQ(a[0].value("loss", 0.0), b[0].value("loss", 1.0)) << bf16;
    double loss_diff = 0;
    for (size_t i = 1; i < a.size(); ++i) {
      loss_diff = std::max(loss_diff, std::fabs(a[i].value("loss", 0.0) - b[i].value("loss", 1.0)));
    }
    EXPECT_LE(loss_diff, 1e-3) << bf16;
    // (b) The gradients saw the rounded inputs.
    const double d = MaxAbsDiff(master[fp32], master[bf16]);
    double sum = 0;
    int64_t count = 0;
    for (size_t u = 0; u < master[fp32].size(); ++u) {
      for (size_t i = 0; i < master[fp32][u].size(); ++i, ++count) {
        sum += std::fabs(double(master[fp32][u][i]) - master[bf16][u][i]);
      }
    }
    std::cout << bf16 << ": step 1 loss " << b[0].value("loss", 0.0) << ", max |loss diff| after step 1 " << loss_diff
              << ", parameters vs FP32 checkpoints max |diff| " << d << ", mean |diff| "
              << sum / std::max<int64_t>(count, 1) << "\n";
    EXPECT_GT(d, 0.0) << bf16;
    EXPECT_LE(d, 1e-3) << bf16;
  }
  // Where the BF16 inputs wait does not change what backward computes.
  EXPECT_EQ(MaxAbsDiff(master["bf16-keep"], master["bf16-all"]), 0.0);
  EXPECT_EQ(MaxAbsDiff(master["fp32-keep"], master["fp32-all"]), 0.0);
  // (c) hostd counts the offloaded inputs at 2 B an element: per worker its 4 rows x 64 tokens, every
  // layer, both workers; the selective layers' attention output and LSE stay 4 B an element.
  auto host_state = [&](const std::string& id) { return lines[id].back().value("host_state_bytes", int64_t{0}); };
  const ModelLayout layout = TinyLayout();
  const int64_t inputs_fp32 = layout.config.num_hidden_layers * 2 * (8 / 2 * 64) * layout.config.hidden_size * 4;
  EXPECT_EQ(host_state("fp32-all") - host_state("fp32-keep"), inputs_fp32);
  EXPECT_EQ(host_state("bf16-all") - host_state("bf16-keep"), inputs_fp32 / 2);
  EXPECT_EQ(host_state("fp32-sel") - host_state("bf16-sel"), inputs_fp32 / 2);
  EXPECT_EQ(host_state("bf16-keep"), host_state("fp32-keep"));
  // (d) The workers' device peak falls: the layer inputs on the device take half the bytes.
  const int64_t p_fp32 = PeakBytes(node, "out-fp32-keep", "fp32-keep");
  const int64_t p_bf16 = PeakBytes(node, "out-bf16-keep", "bf16-keep");
  std::cout << "device peak: FP32 checkpoints " << p_fp32 << " bytes, BF16 " << p_bf16 << "\n";
  EXPECT_LT(p_bf16, p_fp32);
  EXPECT_TRUE(node.LeakedSegments().empty());
}

// runtime.tile_tokens reaches the workers' backends: micro-batches of 128 tokens in tiles of 23
// (tiles cutting documents, a short last tile) train as untiled ones: the same losses to FP32
// rounding (the backend's own test: outputs and input gradients bit for bit, weight gradients
// summed per tile) and parameters within what Adam makes of that rounding.
TEST(Training, TiledLayersTrainAsUntiled) {
  NodeHarness node(2);
  SpecOptions base;
  base.output = "out-untiled";
  SpecOptions tiled = base;
  tiled.tile_tokens = 23;
  tiled.output = "out-tiled";
  auto untiled_master = LoadMaster(MustSucceed(node, Spec(base), "untiled").last_checkpoint());
  auto tiled_master = LoadMaster(MustSucceed(node, Spec(tiled), "tiled").last_checkpoint());
  const double diff = MaxAbsDiff(untiled_master, tiled_master);
  EXPECT_GT(diff, 0.0);  // the tiles really ran: their weight gradients differ in rounding
  EXPECT_LT(diff, 1e-4);
  const auto a = MetricsLines(node, "out-untiled", "untiled"), b = MetricsLines(node, "out-tiled", "tiled");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_NEAR(a[i].value("loss", 0.0), b[i].value("loss", 1.0), 1e-5) << "step " << i + 1;
  }
}

// act_policy auto: the first step recomputes, later steps keep every activation of the last
// layers that fit next to the first step's peak; what backward computes stays the same.
TEST(Training, AutoActivationPolicyKeepsLayersThatFitAndGivesTheSameParameters) {
  NodeHarness node(1);
  SpecOptions recompute = OneWorker(4, "out-recompute");
  SpecOptions autop = OneWorker(4, "out-auto");
  autop.act_policy = "auto";
  auto want = LoadMaster(MustSucceed(node, Spec(recompute), "recompute").last_checkpoint());
  auto got = LoadMaster(MustSucceed(node, Spec(autop), "auto").last_checkpoint());
  EXPECT_EQ(MaxAbsDiff(want, got), 0.0);
  // The CPU "device" is host memory: every layer fits.
  const std::string log = ReadFile(node.dir() + "/worker0.log");
  EXPECT_TRUE(absl::StrContains(log, "act_policy auto: step 1 peaked at")) << log;
  EXPECT_TRUE(absl::StrContains(log, "the last 2 of 2 layers keep all activations")) << log;
  int64_t peak_first = 0, peak_later = 0;
  for (const auto& j : MetricsLines(node, "out-auto", "auto")) {
    (j["step"] == 1 ? peak_first : peak_later) =
        std::max<int64_t>(j["step"] == 1 ? peak_first : peak_later, j["gpu_peak_bytes"]);
  }
  EXPECT_GT(peak_later, peak_first);  // the kept activations are really held
}

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

// runtime.policy auto: the worker measures the second step (all recompute), profiles one layer under
// each kind, solves the layout under runtime.gpu_memory_limit (set so that not every layer can keep
// everything), validates it on the third step and reports it; hostd logs and caches it under the
// state dir. Every such run trains to the parameters of whole-layer recompute bit for bit. Six
// steps: warm-up, measure, validate (two steps), and room for a re-solve (a layout that offloads
// and runs slower than predicted, which CPU timings beside other tests can make). The
// next job of the same shape runs the cached layout without probes; a cache entry of another build
// is re-measured; the cached file runs as a policy file.
TEST(Training, AutoPolicyChoosesValidatesAndCachesALayoutBitwiseRecompute) {
  SpecOptions recompute = OneWorker(6, "out-ap-recompute");
  SpecOptions keep = OneWorker(6, "out-ap-keep");
  keep.act_policy = "keep_all";
  int64_t peak_recompute = 0, peak_keep = 0;
  std::vector<std::vector<float>> want;
  {
    NodeHarness node(1);
    want = LoadMaster(MustSucceed(node, Spec(recompute), "ap-recompute").last_checkpoint());
    MustSucceed(node, Spec(keep), "ap-keep");
    peak_recompute = PeakBytes(node, recompute.output, "ap-recompute");
    peak_keep = PeakBytes(node, keep.output, "ap-keep");
  }
  ASSERT_GT(peak_keep, peak_recompute);
  NodeHarness node(1);
  SpecOptions autop = OneWorker(6, "out-ap-1");
  autop.policy = "auto";
  // Room for about half of what keeping every layer whole adds, within AutoPolicy's 90%.
  autop.gpu_memory_limit =
      absl::StrCat(static_cast<int64_t>((peak_recompute + (peak_keep - peak_recompute) / 2) / 0.85));
  auto got = LoadMaster(MustSucceed(node, Spec(autop), "ap-1").last_checkpoint());
  EXPECT_EQ(MaxAbsDiff(got, want), 0.0);
  std::string worker_log = ReadFile(node.dir() + "/worker0.log");
  EXPECT_TRUE(absl::StrContains(worker_log, "AutoPolicy: step 2 (all recompute) took")) << worker_log;
  EXPECT_TRUE(absl::StrContains(worker_log, "AutoPolicy: chose in")) << worker_log;
  EXPECT_TRUE(absl::StrContains(worker_log, "AutoPolicy: validated on step ")) << worker_log;
  std::string hostd_log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_TRUE(absl::StrContains(hostd_log, "AutoPolicy chose")) << hostd_log;
  EXPECT_TRUE(absl::StrContains(hostd_log, "cached at")) << hostd_log;
  EXPECT_TRUE(absl::StrContains(hostd_log, "job ap-1: AutoPolicy's layout: predicted")) << hostd_log;
  std::vector<std::string> cached;
  for (const auto& e : std::filesystem::directory_iterator(node.dir() + "/state/policies")) {
    cached.push_back(e.path().string());
  }
  ASSERT_EQ(cached.size(), 1u);
  auto layout = LayerLayout::Load(cached[0]);
  ASSERT_TRUE(layout.ok()) << layout.status();
  ASSERT_TRUE(layout->autopolicy.has_value());
  EXPECT_EQ(layout->layers.size(), 2u);
  EXPECT_GT(layout->autopolicy->predicted.step_s, 0);
  // The limit leaves room for some kept activations, not all: the layout is not all keep_all.
  int keep_all = 0;
  for (const LayerPolicy& l : layout->layers) keep_all += l.kind == LayerKind::kKeepAll && !l.offload;
  EXPECT_LT(keep_all, 2) << ReadFile(cached[0]);

  // `slidedp plan`: the cached measurements predict the step, each resource's busy time and the
  // bottleneck; against the run's own metrics; a fixed policy has nothing measured to predict from.
  {
    v1::PlanJobRequest req;
    req.set_spec_yaml(Spec(autop));
    req.set_base_dir(node.dir());
    auto plan = node.client().Plan(req);
    ASSERT_TRUE(plan.ok()) << plan.status();
    const std::string text = client::FormatPlan(*plan);
    std::cout << text;
    EXPECT_GT(plan->step_s(), 0) << text;
    EXPECT_FALSE(plan->bottleneck().empty()) << text;
    EXPECT_TRUE(absl::StrContains(plan->layout_source(), "policy cache")) << text;
    EXPECT_GT(plan->gpu_peak_bytes(), 0) << text;
    EXPECT_GE(plan->resources_size(), 5) << text;
    EXPECT_TRUE(absl::StrContains(text, "host updates (LayerAdam)")) << text;
    EXPECT_TRUE(absl::StrContains(text, "  layers 0")) << text;
    auto cmp = client::ComparePlan(*plan, ReadFile(node.dir() + "/out-ap-1/metrics-ap-1.jsonl"));
    ASSERT_TRUE(cmp.ok()) << cmp.status();
    std::cout << *cmp;
    EXPECT_TRUE(absl::StrContains(*cmp, "GPU compute")) << *cmp;
    EXPECT_EQ(client::ComparePlan(*plan, "{not json\n").status().code(), absl::StatusCode::kInvalidArgument);
    req.set_spec_yaml(Spec(recompute));
    auto fixed = node.client().Plan(req);
    ASSERT_TRUE(fixed.ok()) << fixed.status();
    EXPECT_EQ(fixed->step_s(), 0);
    EXPECT_TRUE(absl::StrContains(client::FormatPlan(*fixed), "not measured")) << client::FormatPlan(*fixed);
    req.set_spec_yaml("name: x\nmodel: {preset: nonesuch}\n");
    EXPECT_EQ(node.client().Plan(req).status().code(), absl::StatusCode::kInvalidArgument);
  }

  // The same shape again: the cached layout, no probes, the same parameters.
  autop.output = "out-ap-2";
  got = LoadMaster(MustSucceed(node, Spec(autop), "ap-2").last_checkpoint());
  EXPECT_EQ(MaxAbsDiff(got, want), 0.0);
  hostd_log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_TRUE(absl::StrContains(hostd_log, "job ap-2: runtime.policy auto: the layout cached at")) << hostd_log;
  EXPECT_TRUE(absl::StrContains(hostd_log, "job ap-2: AutoPolicy's layout: predicted")) << hostd_log;
  worker_log = ReadFile(node.dir() + "/worker0.log");
  EXPECT_EQ(Count(worker_log, "AutoPolicy: chose in"), 1u) << "measured twice:\n" << worker_log;

  // Another build's measurement is stale: measured again, and the cache entry replaced.
  std::string text = ReadFile(cached[0]);
  const std::string build = layout->autopolicy->build;
  ASSERT_FALSE(build.empty());
  std::ofstream(cached[0]) << absl::StrReplaceAll(text, {{"build: " + build, "build: slidedp 0.0.1 0000"}});
  autop.output = "out-ap-3";
  got = LoadMaster(MustSucceed(node, Spec(autop), "ap-3").last_checkpoint());
  EXPECT_EQ(MaxAbsDiff(got, want), 0.0);
  hostd_log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_TRUE(absl::StrContains(hostd_log, "stale: measured again")) << hostd_log;
  worker_log = ReadFile(node.dir() + "/worker0.log");
  EXPECT_EQ(Count(worker_log, "AutoPolicy: chose in"), 2u) << worker_log;
  EXPECT_TRUE(absl::StrContains(ReadFile(cached[0]), "build: " + build));

  // The cached file is a policy file a user can run (and edit).
  SpecOptions file = OneWorker(6, "out-ap-file");
  file.policy = cached[0];
  file.gpu_memory_limit = autop.gpu_memory_limit;
  got = LoadMaster(MustSucceed(node, Spec(file), "ap-file").last_checkpoint());
  EXPECT_EQ(MaxAbsDiff(got, want), 0.0);
  EXPECT_TRUE(node.LeakedSegments().empty());
}

}  // namespace
}  // namespace slidedp::testing

namespace slidedp::testing {
namespace {

bool BitwiseEqual(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].size() != b[i].size() || std::memcmp(a[i].data(), b[i].data(), a[i].size() * sizeof(float)) != 0) {
      return false;
    }
  }
  return true;
}

// hostd killed with SIGKILL at a point of a 2-worker job and started again: the job resumes,
// from the state the dead hostd left in shared memory when every unit holds the same step and no
// update was under way (else from its newest checkpoint), and finishes with master weights and
// Adam moments bitwise equal to an uninterrupted run's.
// `slidedp plan --measure`: with nothing measured for the shape, plan queues a job that measures it
// (runtime.policy auto, train.measure_only: PolicyMeasureSpec), which stops once AutoPolicy's layout
// is validated and cached and saves nothing; plan then predicts the fixed policy the spec names, and
// an auto spec of the same shape, from that record. Asked again, it queues nothing.
TEST(Training, PlanMeasureRunsAMeasuringJobThenPredictsFromIt) {
  NodeHarness node(1);
  SpecOptions fixed = OneWorker(40, "out-pm");
  fixed.act_policy = "selective";
  v1::PlanJobRequest req;
  req.set_spec_yaml(Spec(fixed));
  req.set_base_dir(node.dir());
  auto before = node.client().Plan(req);
  ASSERT_TRUE(before.ok()) << before.status();
  EXPECT_EQ(before->step_s(), 0);
  EXPECT_EQ(before->measure_job_ids_size(), 0);
  EXPECT_TRUE(absl::StrContains(client::FormatPlan(*before), "slidedp plan --measure")) << client::FormatPlan(*before);

  req.set_measure(true);
  auto queued = node.client().Plan(req);
  ASSERT_TRUE(queued.ok()) << queued.status();
  ASSERT_EQ(queued->measure_job_ids_size(), 1);
  EXPECT_TRUE(absl::StartsWith(queued->measure_job_ids(0), "it-plan-")) << queued->measure_job_ids(0);
  // Asked again while that job is pending: the same job, not a second one.
  // (Checked when the job is still pending after the second plan returned, so it was pending
  // all through it.)
  auto asked_again = node.client().Plan(req);
  ASSERT_TRUE(asked_again.ok()) << asked_again.status();
  auto pending = node.client().GetJob(queued->measure_job_ids(0));
  ASSERT_TRUE(pending.ok()) << pending.status();
  if (pending->state() == v1::JOB_STATE_QUEUED || pending->state() == v1::JOB_STATE_STARTING ||
      pending->state() == v1::JOB_STATE_RUNNING || pending->state() == v1::JOB_STATE_SAVING) {
    ASSERT_EQ(asked_again->measure_job_ids_size(), 1);
    EXPECT_EQ(asked_again->measure_job_ids(0), queued->measure_job_ids(0));
  }
  auto job = node.WaitFinal(queued->measure_job_ids(0), 240);
  ASSERT_TRUE(job.ok()) << job.status();
  ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << job->error();
  EXPECT_LT(job->last().step(), kPolicyMeasureSteps);  // it stopped once the layout was cached
  EXPECT_TRUE(job->last_checkpoint().empty());
  for (const auto& e : std::filesystem::directory_iterator(node.dir() + "/out-pm")) {
    EXPECT_TRUE(absl::StartsWith(e.path().filename().string(), "metrics-")) << e.path();  // no checkpoint
  }
  const std::string hostd_log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_TRUE(absl::StrContains(hostd_log, "train.measure_only: AutoPolicy's layout is measured and cached"))
      << hostd_log;

  auto plan = node.client().Plan(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string text = client::FormatPlan(*plan);
  std::cout << text;
  EXPECT_EQ(plan->measure_job_ids_size(), 0) << text;
  EXPECT_GT(plan->step_s(), 0) << text;
  EXPECT_FALSE(plan->bottleneck().empty()) << text;
  EXPECT_GT(plan->gpu_peak_bytes(), 0) << text;
  EXPECT_TRUE(absl::StrContains(plan->layout_source(), "AutoPolicy's measurements of this shape")) << text;
  EXPECT_TRUE(absl::StrContains(plan->layout_yaml(), "selective")) << text;
  // What another batch or more GPUs would change: predicted from the same record.
  ASSERT_GE(plan->alternatives_size(), 3) << text;
  EXPECT_TRUE(absl::StrContains(text, "what if")) << text;
  for (const v1::PlanAlternative& a : plan->alternatives()) {
    EXPECT_TRUE(a.step_s() > 0 || !a.note().empty()) << a.what();
    if (absl::StartsWith(a.what(), "2x the tokens") && a.step_s() > 0) {
      // Twice the tokens take no less (the same, when host updates bound the step: they do not grow).
      EXPECT_GE(a.step_s(), plan->step_s()) << text;
    }
  }

  SpecOptions autop = fixed;
  autop.act_policy.clear();
  autop.policy = "auto";
  req.set_spec_yaml(Spec(autop));
  req.set_measure(false);
  auto from_cache = node.client().Plan(req);
  ASSERT_TRUE(from_cache.ok()) << from_cache.status();
  EXPECT_GT(from_cache->step_s(), 0) << client::FormatPlan(*from_cache);
  EXPECT_TRUE(absl::StrContains(from_cache->layout_source(), "policy cache")) << client::FormatPlan(*from_cache);

  // Another batch is another shape: nothing predicts it until measured.
  fixed.global_batch = 16;
  req.set_spec_yaml(Spec(fixed));
  auto other = node.client().Plan(req);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(other->step_s(), 0);
}

// runtime.grad_reduction auto: `slidedp plan --measure --routes` measures each route with its own
// job (two CPU workers: the gpu route through the shared-memory collective, the cpu route summed by
// hostd); plan then takes the route of the shorter measured step and lists the other as measured;
// a job with auto routes runs the chosen route, and says so.
TEST(Training, PlanMeasuresEachRouteAndAutoRoutesRunTheShortest) {
  NodeHarness node(2);
  SpecOptions o;
  o.steps = 4;
  o.output = "out-routes";
  o.policy = "auto";
  o.grad_reduction = "auto";
  v1::PlanJobRequest req;
  req.set_spec_yaml(Spec(o));
  req.set_base_dir(node.dir());
  req.set_measure(true);
  req.set_routes(true);
  auto queued = node.client().Plan(req);
  ASSERT_TRUE(queued.ok()) << queued.status();
  ASSERT_EQ(queued->measure_job_ids_size(), 2) << client::FormatPlan(*queued);
  for (const std::string& id : queued->measure_job_ids()) {
    auto job = node.WaitFinal(id, 240);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << id << ": " << job->error();
  }
  const std::string hostd_log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_TRUE(absl::StrContains(hostd_log, "measures grad_reduction gpu, param_delivery replicated")) << hostd_log;
  EXPECT_TRUE(absl::StrContains(hostd_log, "measures grad_reduction cpu, param_delivery replicated")) << hostd_log;

  req.set_measure(false);
  req.set_routes(false);
  auto plan = node.client().Plan(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  const std::string text = client::FormatPlan(*plan);
  std::cout << text;
  EXPECT_GT(plan->step_s(), 0) << text;
  std::string chosen;
  for (const std::string& n : plan->notes()) {
    if (absl::StartsWith(n, "runtime routes auto: ")) chosen = n.substr(21, n.find(',', 40) - 21);
  }
  ASSERT_TRUE(absl::StartsWith(chosen, "grad_reduction ")) << text;
  EXPECT_TRUE(absl::StrContains(text, "the shortest measured step")) << text;
  int measured = 0;
  for (const v1::PlanAlternative& a : plan->alternatives()) {
    if (absl::StrContains(a.what(), "(measured by its own job)")) {
      ++measured;
      EXPECT_GT(a.step_s(), 0);
      EXPECT_FALSE(absl::StartsWith(a.what(), chosen)) << a.what();
    }
  }
  EXPECT_EQ(measured, 1) << text;
  EXPECT_FALSE(absl::StrContains(text, "grad_reduction: ")) << text;  // the estimate of a measured route is dropped
  // Asked again, nothing is left to measure.
  req.set_measure(true);
  req.set_routes(true);
  auto again = node.client().Plan(req);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->measure_job_ids_size(), 0) << client::FormatPlan(*again);

  MustSucceed(node, Spec(o), "routes-auto");
  const std::string log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("job routes-auto: runtime routes auto: ", chosen))) << log;
}

// runtime.chunk_bytes auto on one worker: each of kAutoChunkBytes is measured by its own job and
// the job runs the one of the shortest measured step.
TEST(Training, AutoChunkBytesRunsTheShortestMeasured) {
  NodeHarness node(1);
  SpecOptions o = OneWorker(4, "out-chunks");
  o.policy = "auto";
  const std::string spec = absl::StrReplaceAll(Spec(o), {{absl::StrCat("chunk_bytes: ", o.chunk_bytes), "chunk_bytes: auto"}});
  ASSERT_TRUE(absl::StrContains(spec, "chunk_bytes: auto")) << spec;
  v1::PlanJobRequest req;
  req.set_spec_yaml(spec);
  req.set_base_dir(node.dir());
  req.set_measure(true);
  auto queued = node.client().Plan(req);
  ASSERT_TRUE(queued.ok()) << queued.status();
  ASSERT_EQ(queued->measure_job_ids_size(), static_cast<int>(std::size(kAutoChunkBytes)));
  for (const std::string& id : queued->measure_job_ids()) {
    auto job = node.WaitFinal(id, 240);
    ASSERT_TRUE(job.ok()) << job.status();
    ASSERT_EQ(job->state(), v1::JOB_STATE_SUCCEEDED) << id << ": " << job->error();
  }
  req.set_measure(false);
  auto plan = node.client().Plan(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  std::string said;
  for (const std::string& n : plan->notes()) {
    if (absl::StartsWith(n, "runtime routes auto: ")) said = n;
  }
  EXPECT_TRUE(absl::StrContains(said, "the shortest measured step")) << client::FormatPlan(*plan);
  for (int64_t c : kAutoChunkBytes) EXPECT_TRUE(absl::StrContains(said, absl::StrCat("chunk_bytes ", c, " "))) << said;
  const std::string chosen = said.substr(21, said.find(", the shortest") - 21);
  MustSucceed(node, spec, "chunks-auto");
  const std::string log = ReadFile(node.dir() + "/hostd0.log");
  EXPECT_TRUE(absl::StrContains(log, absl::StrCat("job chunks-auto: runtime routes auto: ", chosen))) << log;
}

TEST(Service, HostdKilledMidJobResumesFromSharedMemoryBitwise) {
  NodeHarness node(2);
  SpecOptions o;
  o.steps = 14;
  o.save_every = 5;
  o.output = "out-ref";
  v1::Job ref = MustSucceed(node, Spec(o), "ref");
  const auto expected = LoadState(ref.last_checkpoint());

  std::vector<std::string> recoveries;
  std::mt19937 rng(std::random_device{}());
  // Trials 0-3 are killed as they come; trial 4's segment is then marked as if the kill had hit
  // LayerAdam in the middle of a step (updating_step beyond the units' step): it must resume from
  // its checkpoint instead, just as exactly.
  for (int trial = 0; trial < 5; ++trial) {
    const std::string id = absl::StrCat("crash", trial);
    o.output = "out-" + id;
    v1::SubmitJobRequest req;
    req.set_job_id(id);
    req.set_spec_yaml(Spec(o));
    req.set_base_dir(node.dir());
    ASSERT_TRUE(node.client().Submit(req).ok());
    // Trial 0 is killed right after a step's report (the workers are then in the next forward:
    // nothing is being updated); the others at a random moment of a step.
    // (At most step 8 of 14 and 60 ms after it: the job must still be running when hostd dies.)
    const int at_step = trial == 4 ? 7 : 2 + 2 * trial;
    absl::Time deadline = absl::Now() + absl::Seconds(60);
    int64_t seen = 0;
    while (absl::Now() < deadline) {
      auto j = node.client().GetJob(id);
      if (j.ok() && j->last().step() >= at_step) {
        seen = j->last().step();
        break;
      }
      absl::SleepFor(absl::Milliseconds(trial == 0 ? 1 : 20));
    }
    ASSERT_GE(seen, at_step);
    if (trial > 0) absl::SleepFor(absl::Microseconds(std::uniform_int_distribution<int>(0, 60'000)(rng)));
    kill(node.hostd_pid(), SIGKILL);
    waitpid(node.hostd_pid(), nullptr, 0);
    if (trial == 4) {
      auto js =
          shm::JobState::Attach(absl::StrCat("/slidedp.", node.node(), ".", id, ".state"), shm::Access::kReadWrite);
      ASSERT_TRUE(js.ok()) << js.status();
      (*js)->updating_step().store((*js)->version(0).Load() + 1);
    }
    const absl::Time restart = absl::Now();
    node.StartHostd();
    ASSERT_TRUE(node.client().WaitReady(20).ok());
    // Restart to the first step the new hostd completes.
    int64_t step_at_restart = -1;
    double to_next_step_s = -1;
    while (absl::Now() < restart + absl::Seconds(60)) {
      auto j = node.client().GetJob(id);
      if (!j.ok()) continue;
      if (step_at_restart < 0) step_at_restart = j->last().step();
      if (to_next_step_s < 0 && j->last().step() != step_at_restart) {
        to_next_step_s = absl::ToDoubleSeconds(absl::Now() - restart);
      }
      if (j.ok() && (j->state() == v1::JOB_STATE_SUCCEEDED || j->state() == v1::JOB_STATE_FAILED ||
                     j->state() == v1::JOB_STATE_CANCELLED)) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
    auto j = node.WaitFinal(id, 60);
    ASSERT_TRUE(j.ok()) << j.status();
    ASSERT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error() << " (logs in " << node.dir() << ")";
    EXPECT_EQ(j->hostd_restarts(), 1);
    EXPECT_EQ(j->last().step(), o.steps);
    std::cout << id << ": killed after step " << seen << ", resumed from " << j->recovery() << "; restart to a step "
              << to_next_step_s << " s\n";
    recoveries.push_back(j->recovery());
    EXPECT_TRUE(BitwiseEqual(LoadState(j->last_checkpoint()), expected)) << id << " resumed from " << j->recovery();
  }
  EXPECT_TRUE(absl::StartsWith(recoveries[0], "shared memory at step")) << recoveries[0];
  EXPECT_TRUE(absl::StartsWith(recoveries[4], "checkpoint ")) << recoveries[4];
  EXPECT_NE(recoveries[4].find("had begun"), std::string::npos) << recoveries[4];
  EXPECT_TRUE(node.LeakedSegments().empty());
}

}  // namespace
}  // namespace slidedp::testing
