// A job over several nodes (runtime.nodes, issue 52; docs/multi-node.md) with real processes: a
// hostd per "node" (each its own node name, socket, state and shared memory) with its CPU workers,
// the nodes' ranks of one local index joined by Gloo over TCP loopback, the hostds by their gRPC
// PeerService. Checked:
//   2 nodes x 2 ranks and 3 nodes x 1 rank   -> losses, master and Adam moments bitwise those of one
//                                               node with all the ranks (the same global batch)
//   a node's worker killed mid-job           -> the job fails on every node, naming the node
//   a checkpoint of 2 nodes resumed on 1 node and on 2 -> bitwise the run straight through
//   sharded state (runtime.node_state sharded)  -> the same, and its checkpoints resume on any node count
//   `slidedp plan` over nodes                -> the network term, its bandwidth measured
//   a spec the coordinator is not in, a busy node, a node that is not there -> refused at submit
#include <signal.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "tests/integration/node_harness.h"

namespace slidedp::testing {
namespace {

using ::testing::HasSubstr;

std::string DataDir() {
  static std::string dir = [] {
    std::string d = ::testing::TempDir() + "/mn-data-" + std::to_string(getpid());
    WriteTinyDataset(d, 120, 90, 64, 7);
    return d;
  }();
  return dir;
}

// The tiny model with 'workers' ranks per node over `nodes` (none: one node); clipping engages (a
// small max_grad_norm), so the clipping coefficient is part of what must agree.
std::string Spec(int workers, const std::vector<std::string>& nodes, int steps = 4, double max_grad_norm = 1.0,
                 const std::string& output = "out", const std::string& runtime_extra = "") {
  return absl::StrCat(
      "name: mn\nmodel: {preset: tiny, init_seed: 11}\ndata: {path: ", DataDir(), "}\n", "output: {dir: ", output,
      ", save_dtype: fp32, save_every: 2}\n", "train: {seq_len: 64, global_batch: 12, micro_batch: 1, steps: ", steps,
      ", seed: 3, max_grad_norm: ", max_grad_norm, "}\n", "optimizer: {lr: 2.0e-3, weight_decay: 0.1}\n",
      "schedule: {kind: linear, warmup_steps: 1}\n", "runtime: {workers: ", workers, ", step_timeout_ms: 20000",
      runtime_extra,
      nodes.empty() ? std::string() : absl::StrCat(", nodes: [", absl::StrJoin(nodes, ", "), "]"), "}\n");
}

std::string FileBytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

// Runs the job over `nodes_count` nodes of `workers` each and on one node of all the ranks; the
// losses (every step), the master and the moments must be the same bits.
// `nodes_extra`: runtime keys of the job over nodes only (node_state); `optimizer_extra`: optimizer keys.
// `preset`: the model (the tiny Qwen3 by default), or an absolute path: a HF model directory.
void ExpectSameAsOneNode(int nodes_count, int workers, double max_grad_norm, const std::string& runtime_extra = "",
                         const std::string& nodes_extra = "", const std::string& optimizer_extra = "",
                         const std::string& preset = "tiny") {
  const auto with_optimizer = [&](const std::string& spec) {
    return absl::StrReplaceAll(spec, {{"weight_decay: 0.1}", absl::StrCat("weight_decay: 0.1", optimizer_extra, "}")},
                                      {"{preset: tiny, init_seed: 11}",
                                       preset[0] == '/' ? absl::StrCat("{path: ", preset, "}")
                                                        : absl::StrCat("{preset: ", preset, ", init_seed: 11}")}});
  };
  std::vector<std::unique_ptr<NodeHarness>> nodes;
  std::vector<std::string> addresses;
  for (int n = 0; n < nodes_count; ++n) {
    nodes.push_back(std::make_unique<NodeHarness>(workers));
    addresses.push_back(nodes.back()->address());
  }
  // Submitted to the last node: the coordinator need not be the first listed.
  NodeHarness& coordinator = *nodes.back();
  v1::Job multi =
      MustSucceed(coordinator, with_optimizer(Spec(workers, addresses, 4, max_grad_norm, "out", runtime_extra + nodes_extra)),
                  "over-nodes");
  ASSERT_EQ(multi.state(), v1::JOB_STATE_SUCCEEDED);
  // The other nodes ran their part (and wrote nothing).
  for (int n = 0; n + 1 < nodes_count; ++n) {
    auto j = nodes[n]->WaitFinal("over-nodes", 30);
    ASSERT_TRUE(j.ok()) << j.status();
    EXPECT_EQ(j->state(), v1::JOB_STATE_SUCCEEDED) << j->error();
    EXPECT_FALSE(std::filesystem::exists(nodes[n]->dir() + "/out")) << "node " << n << " wrote outputs";
  }
  NodeHarness one(nodes_count * workers);
  MustSucceed(one, with_optimizer(Spec(nodes_count * workers, {}, 4, max_grad_norm, "out", runtime_extra)), "one-node");

  const auto multi_lines = MetricsLines(coordinator, "out", "over-nodes");
  const auto one_lines = MetricsLines(one, "out", "one-node");
  ASSERT_EQ(multi_lines.size(), 4u);
  ASSERT_EQ(one_lines.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(multi_lines[i]["loss"].get<double>(), one_lines[i]["loss"].get<double>()) << "step " << i + 1;
    EXPECT_EQ(multi_lines[i]["tokens"], one_lines[i]["tokens"]) << "step " << i + 1;
    // The job's gradient norm (a sharded state's nodes add their parts' squares: another order).
    const double norm = one_lines[i]["grad_norm"].get<double>();
    EXPECT_NEAR(multi_lines[i]["grad_norm"].get<double>(), norm, 1e-6 * norm) << "step " << i + 1;
  }
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string a = FileBytes(coordinator.dir() + "/out/checkpoint-4/" + file);
    const std::string b = FileBytes(one.dir() + "/out/checkpoint-4/" + file);
    ASSERT_FALSE(a.empty()) << file;
    EXPECT_TRUE(a == b) << file << " differs from one node's";
  }
}

TEST(MultiNode, TwoNodesOfTwoRanksAreBitwiseOneNodeOfFour) { ExpectSameAsOneNode(2, 2, 1000.0); }

TEST(MultiNode, ThreeNodesOfOneRankAreBitwiseOneNodeOfThree) { ExpectSameAsOneNode(3, 1, 1000.0); }

TEST(MultiNode, ClippedTwoNodesOfTwoRanksAreBitwiseOneNodeOfFour) { ExpectSameAsOneNode(2, 2, 0.05); }

// Exact clipping with the parts staged on the workers and speculative updates (docs/layeradam.md): each
// node's hostd sees the whole global gradient, so its norm, verdicts and undo work as on one node.
// With max_grad_norm 0.05 the first step's speculated updates are rolled back (its norm clips, and the
// steps after it do not speculate); with 1.0 every step speculates and keeps its updates.
TEST(MultiNode, SpeculativeClippingOverNodesIsBitwiseOneNode) {
  ExpectSameAsOneNode(2, 2, 0.05, ", grad_staging: device, speculation_bytes: 1000000000");
  ExpectSameAsOneNode(2, 2, 1.0, ", grad_staging: device, speculation_bytes: 1000000000");
}

// Sharded state (runtime.node_state sharded, common/model/node_shard.h): each node's hostd holds its
// range of every unit; the ranks reduce-scatter over the nodes' ranges, gather each unit from every
// node, and bring the job's norm; every node writes its share of each checkpoint into the same files.
// The losses and the checkpoint's files are the bits of one node holding everything.
// 2 x 2, clipping engaged with speculative updates on the devices; the embedding whole on every node
// (its FP32 rows are read from the master).
TEST(MultiNode, ShardedStateWithClippingIsBitwiseOneNode) {
  ExpectSameAsOneNode(2, 2, 0.05, ", grad_staging: device, speculation_bytes: 1000000000", ", node_state: sharded");
}

// 3 x 1 (no reduce-scatter inside a node), no clipping (each part applied as it comes; the nodes add
// their parts' squares for the norm), the embedding sharded too (BF16 rows) and the workers casting the
// master (no mirror); then int8 moments (their per-block scales split at the nodes' ranges).
TEST(MultiNode, ShardedStateOfSingleRankNodesIsBitwiseOneNode) {
  ExpectSameAsOneNode(3, 1, 0.0, ", embedding_rows: bf16, param_source: master", ", node_state: sharded");
  ExpectSameAsOneNode(2, 1, 1.0, "", ", node_state: sharded", ", state_dtype: int8");
}

// The other families' units cut at the nodes' ranges: Qwen3.5 MoE (Gated DeltaNet, a shared expert),
// GPT-OSS (fused expert tensors written as slices, attention sinks), Gemma 4 (two embedding tables).
TEST(MultiNode, ShardedStateOfEveryFamilyIsBitwiseOneNode) {
  for (const char* preset : {"tiny-qwen3.5-moe", "tiny-gpt-oss", "tiny-gemma4"}) {
    SCOPED_TRACE(preset);
    ExpectSameAsOneNode(2, 1, 1.0, "", ", node_state: sharded", "", preset);
  }
}

// Weights loaded from transformers' own checkpoints, each node reading its ranges of the tensors: Qwen3.5
// MoE with its vision tower passed through (the coordinator writes it), GPT-OSS's fused experts.
TEST(MultiNode, ShardedStateLoadsHfCheckpoints) {
  const char* src = std::getenv("SLIDEDP_SOURCE_DIR");
  const std::string root = src != nullptr ? src : std::filesystem::current_path().string();
  for (const char* model : {"/tests/data/hf/qwen3_5_moe_vl", "/tests/data/hf/gpt_oss"}) {
    SCOPED_TRACE(model);
    ExpectSameAsOneNode(2, 1, 1.0, "", ", node_state: sharded", "", root + model);
  }
}

// A sharded checkpoint is the one file set one node writes: it resumes on one node holding everything,
// and on two nodes sharding again, and both continue bitwise as the run straight through.
TEST(MultiNode, ShardedCheckpointResumesOnAnyNodeCount) {
  NodeHarness a(2), b(2);
  MustSucceed(b, Spec(2, {a.address(), b.address()}, 2, 0.05, b.dir() + "/first", ", node_state: sharded"), "first");
  const std::string checkpoint = b.dir() + "/first/checkpoint-2";
  ASSERT_TRUE(std::filesystem::exists(checkpoint + "/COMPLETE"));
  NodeHarness one(4);
  MustSucceed(one, Spec(4, {}, 4, 0.05, "straight"), "straight");
  MustSucceed(one, Spec(4, {}, 4, 0.05, "on-one"), "on-one", checkpoint);
  MustSucceed(a, Spec(2, {a.address(), b.address()}, 4, 0.05, a.dir() + "/on-two", ", node_state: sharded"), "on-two",
              checkpoint);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string straight = FileBytes(one.dir() + "/straight/checkpoint-4/" + file);
    ASSERT_FALSE(straight.empty());
    EXPECT_EQ(FileBytes(checkpoint + "/" + file).size(), straight.size()) << file;
    EXPECT_TRUE(FileBytes(one.dir() + "/on-one/checkpoint-4/" + file) == straight) << file;
    EXPECT_TRUE(FileBytes(a.dir() + "/on-two/checkpoint-4/" + file) == straight) << file;
  }
}

// A checkpoint of a job over 2 nodes resumes on 1 node and on 2 other nodes (each node reads the same
// path: a shared file system), and continues bitwise as one node of all the ranks does: replicated
// state is the whole state on every node, and the global batch does not depend on the ranks.
TEST(MultiNode, ResumesOnAnotherNodeCountExactly) {
  NodeHarness a(2), b(2);
  MustSucceed(b, Spec(2, {a.address(), b.address()}, 2, 0.05, b.dir() + "/first"), "first");
  const std::string checkpoint = b.dir() + "/first/checkpoint-2";
  ASSERT_TRUE(std::filesystem::exists(checkpoint + "/model.safetensors"));
  NodeHarness one(4);
  MustSucceed(one, Spec(4, {}, 4, 0.05, "straight"), "straight");
  MustSucceed(one, Spec(4, {}, 4, 0.05, "on-one"), "on-one", checkpoint);
  MustSucceed(a, Spec(2, {a.address(), b.address()}, 4, 0.05, a.dir() + "/on-two"), "on-two", checkpoint);
  const std::string straight = FileBytes(one.dir() + "/straight/checkpoint-4/model.safetensors");
  ASSERT_FALSE(straight.empty());
  EXPECT_TRUE(FileBytes(one.dir() + "/on-one/checkpoint-4/model.safetensors") == straight);
  EXPECT_TRUE(FileBytes(a.dir() + "/on-two/checkpoint-4/model.safetensors") == straight);
  EXPECT_TRUE(FileBytes(a.dir() + "/on-two/checkpoint-4/optimizer.safetensors") ==
              FileBytes(one.dir() + "/straight/checkpoint-4/optimizer.safetensors"));
}

TEST(MultiNode, ALostWorkerFailsTheJobOnEveryNode) {
  NodeHarness a(1), b(1);
  v1::SubmitJobRequest req;
  req.set_job_id("lost");
  req.set_spec_yaml(Spec(1, {a.address(), b.address()}, 100000));
  req.set_base_dir(a.dir());
  ASSERT_TRUE(a.client().Submit(req).ok());
  // Once it runs, node 1's worker dies.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    auto j = a.client().GetJob("lost");
    if (j.ok() && j->has_last() && j->last().step() >= 2) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  NodeHarness::KillAndReap(b.worker_pids()[0], SIGKILL);
  const absl::Time killed = absl::Now();
  auto ja = a.WaitFinal("lost", 60);
  auto jb = b.WaitFinal("lost", 60);
  ASSERT_TRUE(ja.ok()) << ja.status();
  ASSERT_TRUE(jb.ok()) << jb.status();
  EXPECT_EQ(ja->state(), v1::JOB_STATE_FAILED);
  EXPECT_EQ(jb->state(), v1::JOB_STATE_FAILED);
  // Within the step timeout (20 s) and a margin for the report.
  EXPECT_LT(absl::Now() - killed, absl::Seconds(45));
  EXPECT_THAT(ja->error(), HasSubstr("node 1")) << ja->error();
}

// runtime.max_restarts over nodes: node 1's worker dies after the step-2 checkpoint and a new one attaches
// (the node is back); the coordinator restarts the job on both nodes from that checkpoint, and it ends
// with the bits of the run straight through on one node. Sharded, so every node writes its share again.
TEST(MultiNode, ALostWorkerRestartsTheJobOverNodesFromItsCheckpoint) {
  NodeHarness a(1), b(1);
  v1::SubmitJobRequest req;
  req.set_job_id("restarts");
  req.set_spec_yaml(Spec(1, {a.address(), b.address()}, 6, 0.05, "out", ", node_state: sharded, max_restarts: 1"));
  req.set_base_dir(a.dir());
  ASSERT_TRUE(a.client().Submit(req).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline && !std::filesystem::exists(a.dir() + "/out/checkpoint-2/COMPLETE")) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  ASSERT_TRUE(std::filesystem::exists(a.dir() + "/out/checkpoint-2/COMPLETE"));
  NodeHarness::KillAndReap(b.worker_pids()[0], SIGKILL);
  b.AddWorker();
  auto ja = a.WaitFinal("restarts", 120);
  ASSERT_TRUE(ja.ok()) << ja.status();
  EXPECT_EQ(ja->state(), v1::JOB_STATE_SUCCEEDED) << ja->error();
  auto jb = b.WaitFinal("restarts", 30);
  ASSERT_TRUE(jb.ok()) << jb.status();
  EXPECT_EQ(jb->state(), v1::JOB_STATE_SUCCEEDED) << jb->error();
  NodeHarness one(2);
  MustSucceed(one, Spec(2, {}, 6, 0.05, "straight"), "straight");
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    const std::string straight = FileBytes(one.dir() + "/straight/checkpoint-6/" + file);
    ASSERT_FALSE(straight.empty());
    EXPECT_TRUE(FileBytes(a.dir() + "/out/checkpoint-6/" + file) == straight) << file;
  }
}

// `slidedp plan` of a job over nodes: the world of every node's ranks, the network term measured.
// A node's hostd killed mid-job: the coordinator's job fails within the step timeout, naming the node.
TEST(MultiNode, ALostHostdFailsTheJobOnTheCoordinator) {
  NodeHarness a(1), b(1);
  v1::SubmitJobRequest req;
  req.set_job_id("lost-hostd");
  req.set_spec_yaml(Spec(1, {a.address(), b.address()}, 100000));
  req.set_base_dir(a.dir());
  ASSERT_TRUE(a.client().Submit(req).ok());
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  while (absl::Now() < deadline) {
    auto j = a.client().GetJob("lost-hostd");
    if (j.ok() && j->has_last() && j->last().step() >= 2) break;
    absl::SleepFor(absl::Milliseconds(20));
  }
  NodeHarness::KillAndReap(b.hostd_pid(), SIGKILL);
  const absl::Time killed = absl::Now();
  auto ja = a.WaitFinal("lost-hostd", 90);
  ASSERT_TRUE(ja.ok()) << ja.status();
  EXPECT_EQ(ja->state(), v1::JOB_STATE_FAILED);
  EXPECT_LT(absl::Now() - killed, absl::Seconds(60));  // the step timeout (20 s) and the chain's own
  EXPECT_THAT(ja->error(), HasSubstr("node 1")) << ja->error();
  // Node 1's hostd comes back: its part is reported interrupted, not resumed alone.
  b.StartHostd();
  ASSERT_TRUE(b.client().WaitReady(20).ok());
  auto jb = b.WaitFinal("lost-hostd", 30);
  ASSERT_TRUE(jb.ok()) << jb.status();
  EXPECT_EQ(jb->state(), v1::JOB_STATE_FAILED);
  EXPECT_THAT(jb->error(), HasSubstr("interrupted")) << jb->error();
  EXPECT_THAT(jb->error(), HasSubstr("a job over nodes")) << jb->error();
  EXPECT_FALSE(std::filesystem::exists(b.dir() + "/out"));
}

TEST(MultiNode, PlanMeasuresTheNetworkBetweenNodes) {
  NodeHarness a(1), b(1);
  v1::PlanJobRequest req;
  req.set_spec_yaml(Spec(1, {a.address(), b.address()}));
  req.set_base_dir(a.dir());
  auto plan = a.client().Plan(req);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->world(), 2);
  bool network = false;
  for (const v1::PlanResource& r : plan->resources()) {
    if (r.name() != "network between nodes") continue;
    network = true;
    EXPECT_GT(r.rate(), 0) << "bandwidth not measured";
    EXPECT_GT(r.work(), 0);
    EXPECT_GT(r.busy_s(), 0);
  }
  EXPECT_TRUE(network);
  // Sharded: the weights' gather adds 2 (N-1)/N bytes a parameter to the 8 of the gradient's chain, and the
  // host update is this node's half.
  req.set_spec_yaml(Spec(1, {a.address(), b.address()}, 4, 1.0, "out", ", node_state: sharded"));
  auto sharded = a.client().Plan(req);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  double replicated_gb = 0, sharded_gb = 0;
  for (const v1::PlanResource& r : plan->resources()) {
    if (r.name() == "network between nodes") replicated_gb = r.work();
  }
  for (const v1::PlanResource& r : sharded->resources()) {
    if (r.name() == "network between nodes") sharded_gb = r.work();
  }
  EXPECT_NEAR(sharded_gb / replicated_gb, 9.0 / 8.0, 1e-9);
  bool noted = false;
  for (const std::string& n : sharded->notes()) noted |= n.find("sharded state") != std::string::npos;
  EXPECT_TRUE(noted);
}

TEST(MultiNode, RefusedAtSubmit) {
  NodeHarness a(1), b(1);
  auto submit = [&](NodeHarness& to, const std::string& spec, const std::string& id) {
    v1::SubmitJobRequest req;
    req.set_job_id(id);
    req.set_spec_yaml(spec);
    req.set_base_dir(to.dir());
    return to.client().Submit(req).status();
  };
  // The hostd it is submitted to is not among the nodes.
  NodeHarness c(1);
  absl::Status s = submit(c, Spec(1, {a.address(), b.address()}), "not-listed");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("does not list the hostd"));
  // A node nobody serves.
  s = submit(a, Spec(1, {a.address(), absl::StrCat("unix:", a.dir(), "/nobody.sock")}), "gone");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("node 1"));
  // A node busy with a job of its own: the job over nodes is refused naming it, and fails here.
  v1::SubmitJobRequest busy;
  busy.set_job_id("busy");
  busy.set_spec_yaml(Spec(1, {}, 100000));
  busy.set_base_dir(b.dir());
  ASSERT_TRUE(b.client().Submit(busy).ok());
  s = submit(a, Spec(1, {a.address(), b.address()}), "while-busy");
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr("node 1"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("busy"));
  ASSERT_TRUE(b.client().Cancel("busy").ok());
  // Malformed node lists never reach a node.
  for (const std::string& bad : {std::string("[unix:relative.sock, unix:/x.sock]"), std::string("[host, h2:1]"),
                                 std::string("[h:99999, h2:1]"), std::string("[h:1, h:1]"),
                                 std::string("[\"h 1:2\", h:3]"), std::string("[only:1]")}) {
    std::string spec = Spec(1, {a.address(), b.address()});
    spec = spec.substr(0, spec.find("nodes: [")) + "nodes: " + bad + "}\n";
    s = submit(a, spec, "bad-nodes");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << s;
  }
  // Several workers per node need the gpu route (each node's ranks reduce first).
  std::string cpu_route = Spec(2, {a.address(), b.address()});
  cpu_route.replace(cpu_route.find("workers: 2"), 10, "workers: 2, grad_reduction: cpu");
  s = submit(a, cpu_route, "cpu-route");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
}

}  // namespace
}  // namespace slidedp::testing
