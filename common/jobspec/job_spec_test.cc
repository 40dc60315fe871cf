#include "common/jobspec/job_spec.h"

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/status/utf8_prefix.h"
#include "gtest/gtest.h"

namespace slidedp {
namespace {

constexpr char kGood[] = R"(
name: tiny
model: {preset: tiny, init_seed: 3}
data: {path: data/tiny}
output: {dir: out/tiny, save_every: 10, keep_last: 3}
train: {seq_len: 128, global_batch: 8, micro_batch: 2, steps: 20, seed: 7}
optimizer: {lr: 1.0e-3, weight_decay: 0.1}
schedule: {kind: cosine, warmup_steps: 2, min_lr: 1.0e-5}
runtime: {backend: cpu, workers: 2, act_policy: selective, deterministic: true, embedding_rows: bf16}
)";

absl::Status ParseError(const std::string& text) {
  return JobSpec::Parse(text, "/base", JobSpec::FileCheck::kSkip).status();
}

TEST(JobSpec, ParsesAndResolves) {
  auto s = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->model.preset, "tiny");
  EXPECT_EQ(s->model.init_seed, 3u);
  EXPECT_EQ(s->data.path, "/base/data/tiny");
  EXPECT_EQ(s->output.dir, "/base/out/tiny");
  EXPECT_EQ(s->train.seq_len, 128);
  EXPECT_EQ(s->schedule.kind, ScheduleKind::kCosine);
  EXPECT_EQ(s->runtime.act_policy, ActivationPolicy::kSelective);
  EXPECT_TRUE(s->runtime.deterministic);
  EXPECT_EQ(s->runtime.embedding_rows, Dtype::kBF16);
  EXPECT_DOUBLE_EQ(s->train.max_grad_norm, 1.0);  // HF default
  // The resolved YAML parses back to the same spec.
  auto again = JobSpec::Parse(s->ToYaml(), "/elsewhere", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << s->ToYaml();
  EXPECT_EQ(again->ToYaml(), s->ToYaml());
}

// hostd leaves output.dir as written for its output-path policy; model and data still resolve.
TEST(JobSpec, OutputDirCanBeLeftAsWritten) {
  auto s = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip, JobSpec::OutputDirBase::kAsWritten);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->data.path, "/base/data/tiny");
  EXPECT_EQ(s->output.dir, "out/tiny");
  auto dotdot = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"dir: out/tiny", "dir: ../../etc"}}), "/base",
                               JobSpec::FileCheck::kSkip, JobSpec::OutputDirBase::kAsWritten);
  ASSERT_TRUE(dotdot.ok()) << dotdot.status();
  EXPECT_EQ(dotdot->output.dir, "../../etc");
  auto by_default = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"dir: out/tiny, ", ""}}), "/base",
                                   JobSpec::FileCheck::kSkip, JobSpec::OutputDirBase::kAsWritten);
  ASSERT_TRUE(by_default.ok()) << by_default.status();
  EXPECT_EQ(by_default->output.dir, "out/tiny");  // out/<name>, relative
}

TEST(JobSpec, ContextParallelIsOneGroupOfEveryWorkerWithFixedPolicies) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->runtime.context_parallel, 1);
  const std::string two = absl::StrReplaceAll(kGood, {{"workers: 2,", "workers: 2, context_parallel: 2,"}});
  auto cp = JobSpec::Parse(two, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(cp.ok()) << cp.status();
  EXPECT_EQ(cp->runtime.context_parallel, 2);
  auto again = JobSpec::Parse(cp->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->runtime.context_parallel, 2);
  // global_batch 8 over 1 or 2 data-parallel ranks of micro-batches of 2: fine; over 3 of them, not.
  auto groups = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"workers: 2,", "workers: 4, context_parallel: 2,"}}),
                               "/base", JobSpec::FileCheck::kSkip);  // 2 groups of 2: global 8 = 2 x micro 2 x 2
  ASSERT_TRUE(groups.ok()) << groups.status();
  for (const char* bad : {"workers: 2, context_parallel: 4,", "workers: 2, context_parallel: 0,",
                          "workers: 3, context_parallel: 2,", "workers: 6, context_parallel: 2,"}) {
    const absl::Status st = ParseError(absl::StrReplaceAll(kGood, {{"workers: 2,", bad}}));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  for (const char* bad : {"act_policy: auto", "act_policy: recompute, policy: auto"}) {
    const absl::Status st = ParseError(absl::StrReplaceAll(two, {{"act_policy: selective", bad}}));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(st.message(), "context_parallel")) << st;
  }
}

TEST(JobSpec, NodesNameEveryHostdAndRoundTrip) {
  const std::string two = absl::StrReplaceAll(
      kGood, {{"workers: 2,", "workers: 2, nodes: [\"10.0.0.1:7070\", \"[fd00::2]:7070\", unix:/run/slidedp/h.sock],"},
              {"global_batch: 8", "global_batch: 12"}});
  auto s = JobSpec::Parse(two, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->runtime.nodes, (std::vector<std::string>{"10.0.0.1:7070", "[fd00::2]:7070", "unix:/run/slidedp/h.sock"}));
  auto again = JobSpec::Parse(s->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->runtime.nodes, s->runtime.nodes);
  EXPECT_EQ(again->runtime.node_state, NodeState::kReplicated);
  // runtime.node_state sharded round-trips through YAML and the wire.
  auto sharded = JobSpec::Parse(absl::StrReplaceAll(two, {{"workers: 2,", "workers: 2, node_state: sharded,"}}), "/base",
                                JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(sharded.ok()) << sharded.status();
  EXPECT_EQ(sharded->runtime.node_state, NodeState::kSharded);
  auto yaml = JobSpec::Parse(sharded->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(yaml.ok()) << yaml.status();
  EXPECT_EQ(yaml->runtime.node_state, NodeState::kSharded);
  // Sharded without nodes, or with host staging; an unknown state.
  for (const char* bad : {"node_state: sharded", "node_state: sharded, nodes: [a:1, b:2], grad_staging: host",
                          "node_state: split, nodes: [a:1, b:2]"}) {
    const std::string text = absl::StrReplaceAll(kGood, {{"workers: 2,", absl::StrCat("workers: 2, ", bad, ",")}});
    EXPECT_EQ(ParseError(text).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  // Refused by key: fewer than two nodes, a bad or repeated address, no fixed worker count, a global
  // batch the ranks of all nodes do not divide, the cpu route with several workers, auto routes.
  for (const char* bad : {"nodes: [a:1]", "nodes: [a:1, a:1]", "nodes: [a, b:2]", "nodes: [a:0, b:2]",
                          "nodes: [\"a b:1\", c:2]", "nodes: [unix:rel, b:2]", "nodes: a:1",
                          "nodes: [a:1, b:2], grad_reduction: cpu", "nodes: [a:1, b:2, c:3]",
                          "nodes: [a:1, b:2], grad_reduction: auto", "nodes: [a:1, b:2], act_policy: auto"}) {
    const std::string text = absl::StrReplaceAll(kGood, {{"workers: 2,", absl::StrCat("workers: 2, ", bad, ",")}});
    EXPECT_EQ(ParseError(text).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(ParseError(absl::StrReplaceAll(kGood, {{"workers: 2,", "workers: 0, nodes: [a:1, b:2],"}})).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(JobSpec, GradDtypeIsFp32ByDefaultAndRoundTrips) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->runtime.grad_dtype, Dtype::kF32);
  auto bf16 = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"backend: cpu,", "backend: cpu, grad_dtype: bf16,"}}), "/base",
                             JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->runtime.grad_dtype, Dtype::kBF16);
  auto again = JobSpec::Parse(bf16->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->runtime.grad_dtype, Dtype::kBF16);
  const absl::Status bad = ParseError(absl::StrReplaceAll(kGood, {{"backend: cpu,", "backend: cpu, grad_dtype: fp8,"}}));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), "grad_dtype")) << bad;
}

TEST(JobSpec, CheckpointDtypeIsFp32ByDefaultAndRoundTrips) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->runtime.checkpoint_dtype, Dtype::kF32);
  EXPECT_EQ(DtypeBytes(def->runtime.checkpoint_dtype), 4);
  auto again_def = JobSpec::Parse(def->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again_def.ok()) << again_def.status();
  EXPECT_EQ(again_def->runtime.checkpoint_dtype, Dtype::kF32);
  auto bf16 = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"backend: cpu,", "backend: cpu, checkpoint_dtype: bf16,"}}),
                             "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(bf16.ok()) << bf16.status();
  EXPECT_EQ(bf16->runtime.checkpoint_dtype, Dtype::kBF16);
  EXPECT_EQ(DtypeBytes(bf16->runtime.checkpoint_dtype), 2);
  EXPECT_TRUE(absl::StrContains(bf16->ToYaml(), "checkpoint_dtype: bf16")) << bf16->ToYaml();
  auto again = JobSpec::Parse(bf16->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->runtime.checkpoint_dtype, Dtype::kBF16);
  for (const char* v : {"fp16", "int8", "[bf16]"}) {
    const absl::Status bad = ParseError(
        absl::StrReplaceAll(kGood, {{"backend: cpu,", absl::StrCat("backend: cpu, checkpoint_dtype: ", v, ",")}}));
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << v;
    EXPECT_TRUE(absl::StrContains(bad.message(), "runtime.checkpoint_dtype")) << bad;
  }
}

TEST(JobSpec, TileTokensIsAutoByDefaultAndRoundTrips) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->runtime.tile_tokens, 0);
  for (const char* v : {"auto", "8192", "1"}) {
    auto spec = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"backend: cpu,", absl::StrCat("backend: cpu, tile_tokens: ", v, ",")}}),
                               "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(spec.ok()) << spec.status();
    const int64_t want = std::string(v) == "auto" ? 0 : std::stoll(v);
    EXPECT_EQ(spec->runtime.tile_tokens, want) << v;
    auto again = JobSpec::Parse(spec->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->runtime.tile_tokens, want) << v;
  }
  for (const char* v : {"0", "-5", "big", "[1]", "1.5"}) {
    const absl::Status bad =
        ParseError(absl::StrReplaceAll(kGood, {{"backend: cpu,", absl::StrCat("backend: cpu, tile_tokens: ", v, ",")}}));
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << v;
    EXPECT_TRUE(absl::StrContains(bad.message(), "runtime.tile_tokens")) << bad;
  }
}

TEST(JobSpec, AMicroBatchOverInt32TokensIsRefused) {
  const absl::Status bad = ParseError(absl::StrReplaceAll(
      kGood, {{"seq_len: 128", "seq_len: 1073741824"}, {"micro_batch: 2", "micro_batch: 4"}}));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad;
  EXPECT_TRUE(absl::StrContains(bad.message(), "train.micro_batch x train.seq_len")) << bad;
}

TEST(JobSpec, StateDtypeIsFp32ByDefaultAndRoundTrips) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->optimizer.state_dtype, MomentForm::kF32);
  for (auto [name, want] : {std::pair{"bf16", MomentForm::kBF16}, std::pair{"int8", MomentForm::kInt8}}) {
    auto spec = JobSpec::Parse(
        absl::StrReplaceAll(kGood, {{"weight_decay: 0.1}", absl::StrCat("weight_decay: 0.1, state_dtype: ", name, "}")}}),
        "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(spec.ok()) << spec.status();
    EXPECT_EQ(spec->optimizer.state_dtype, want);
    auto again = JobSpec::Parse(spec->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->optimizer.state_dtype, want);
  }
  const absl::Status bad =
      ParseError(absl::StrReplaceAll(kGood, {{"weight_decay: 0.1}", "weight_decay: 0.1, state_dtype: int4}"}}));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), "state_dtype")) << bad;
}

TEST(JobSpec, ParamSourceIsTheMirrorByDefaultAndRoundTrips) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->runtime.param_source, ParamSource::kMirror);
  EXPECT_EQ(def->runtime.cast_threads, 0);
  EXPECT_EQ(def->runtime.cast_on, CastOn::kDevice);
  auto spec = JobSpec::Parse(
      absl::StrReplaceAll(kGood,
                          {{"backend: cpu,", "backend: cpu, param_source: master, cast_on: host, cast_threads: 6,"}}),
      "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->runtime.param_source, ParamSource::kMaster);
  EXPECT_EQ(spec->runtime.cast_on, CastOn::kHost);
  EXPECT_EQ(spec->runtime.cast_threads, 6);
  auto again = JobSpec::Parse(spec->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->runtime.param_source, ParamSource::kMaster);
  EXPECT_EQ(again->runtime.cast_on, CastOn::kHost);
  EXPECT_EQ(again->runtime.cast_threads, 6);
  for (const char* bad_value : {"param_source: fp32,", "param_source: [master],", "cast_threads: -1,",
                                "cast_threads: 1000,", "cast_on: gpu,", "cast_on: [host],"}) {
    const absl::Status bad =
        ParseError(absl::StrReplaceAll(kGood, {{"backend: cpu,", absl::StrCat("backend: cpu, ", bad_value)}}));
    EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument) << bad_value;
    EXPECT_TRUE(absl::StrContains(bad.message(), absl::string_view(bad_value).substr(0, 8))) << bad;
  }
}

// runtime.gpu_memory_limit: bytes with or without a unit, or a fraction of the device's memory;
// none by default; the resolved limit; round trips; nonsense, zero, negative and tiny limits are
// INVALID_ARGUMENT naming the key.
TEST(JobSpec, GpuMemoryLimitTakesBytesOrAFraction) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(GpuMemoryLimitBytes(*def, int64_t{80} << 30), 0);
  struct Case {
    const char* value;
    int64_t bytes;
    double fraction;
  };
  for (const Case& c : {Case{"40GiB", int64_t{40} << 30, 0}, Case{"40 GiB", int64_t{40} << 30, 0},
                        Case{"1.5gib", int64_t{3} << 29, 0}, Case{"100GB", 100000000000, 0},
                        Case{"512MiB", int64_t{512} << 20, 0}, Case{"42949672960", int64_t{40} << 30, 0},
                        Case{"0.5", 0, 0.5}, Case{"1", 0, 1.0}}) {
    auto spec = JobSpec::Parse(
        absl::StrReplaceAll(kGood, {{"backend: cpu,", absl::StrCat("backend: cpu, gpu_memory_limit: ", c.value, ",")}}),
        "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(spec.ok()) << c.value << ": " << spec.status();
    EXPECT_EQ(spec->runtime.gpu_memory_limit_bytes, c.bytes) << c.value;
    EXPECT_EQ(spec->runtime.gpu_memory_limit_fraction, c.fraction) << c.value;
    const int64_t device = int64_t{80} << 30;
    EXPECT_EQ(GpuMemoryLimitBytes(*spec, device), c.bytes > 0 ? c.bytes : static_cast<int64_t>(c.fraction * device));
    auto again = JobSpec::Parse(spec->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(again->runtime.gpu_memory_limit_bytes, c.bytes) << c.value;
    EXPECT_EQ(again->runtime.gpu_memory_limit_fraction, c.fraction) << c.value;
  }
  for (const char* bad : {"lots", "40XB", "-1", "0", "0GiB", "1.5x", "1000KiB", "nan", "inf", "[1]", "''", "GiB"}) {
    const absl::Status st = ParseError(
        absl::StrReplaceAll(kGood, {{"backend: cpu,", absl::StrCat("backend: cpu, gpu_memory_limit: ", bad, ",")}}));
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(st.message(), "gpu_memory_limit")) << bad << ": " << st;
  }
}

// runtime.policy: fixed by default; a policy file (relative to the spec) is read when files are
// checked and travels inline (runtime.layer_policy) in the resolved spec, which parses without the
// file; a missing or a malformed file are INVALID_ARGUMENT naming runtime.policy; auto refuses
// act_policy and offload_ratio.
TEST(JobSpec, PolicyFileIsReadOnceAndTravelsInline) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_TRUE(def->runtime.policy_file.empty());
  EXPECT_FALSE(def->runtime.layer_layout.has_value());
  const std::string dir = ::testing::TempDir() + "/spec-policy";
  std::filesystem::create_directories(dir + "/data/tiny");
  const std::string policy = R"(version: 1
model: {hidden_size: 64, num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, intermediate_size: 128, vocab_size: 512}
layers: [{kind: selective, offload: true}, {kind: keep_all}]
)";
  std::ofstream(dir + "/policy.yaml") << policy;
  std::ofstream(dir + "/broken.yaml") << "version: 1\nlayers: 3\n";
  auto with = [&](const std::string& value) {
    return absl::StrReplaceAll(kGood, {{"backend: cpu,", absl::StrCat("backend: cpu, policy: ", value, ",")}});
  };
  auto spec = JobSpec::Parse(with("policy.yaml"), dir, JobSpec::FileCheck::kCheck);
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_EQ(spec->runtime.policy_file, std::filesystem::path(dir + "/policy.yaml").lexically_normal().string());
  ASSERT_TRUE(spec->runtime.layer_layout.has_value());
  EXPECT_EQ(spec->runtime.layer_layout->layers.size(), 2u);
  EXPECT_EQ(spec->runtime.layer_layout->layers[0], (LayerPolicy{LayerKind::kSelective, true}));
  std::filesystem::remove(dir + "/policy.yaml");  // the resolved spec no longer needs it
  auto again = JobSpec::Parse(spec->ToYaml(), "/elsewhere", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status() << "\n" << spec->ToYaml();
  ASSERT_TRUE(again->runtime.layer_layout.has_value());
  EXPECT_EQ(*again->runtime.layer_layout, *spec->runtime.layer_layout);
  auto fixed = JobSpec::Parse(with("fixed"), dir, JobSpec::FileCheck::kCheck);
  ASSERT_TRUE(fixed.ok()) << fixed.status();
  EXPECT_FALSE(fixed->runtime.layer_layout.has_value());
  // Inline, aliases are read in place (a hostile spec cannot make them expand): 64 layers that are
  // all one anchored entry parse, and a wrong count is still refused.
  std::string inline_spec = absl::StrReplaceAll(
      kGood, {{"backend: cpu,", "backend: cpu, layer_policy: {version: 1, model: {hidden_size: 64, num_hidden_layers: 64, "
                                "num_attention_heads: 4, num_key_value_heads: 2, head_dim: 16, intermediate_size: 128, "
                                "vocab_size: 512}, layers: [&l {kind: keep_all}LAYERS]},"}});
  std::string more;
  for (int i = 1; i < 64; ++i) more += ", *l";
  auto aliased = JobSpec::Parse(absl::StrReplaceAll(inline_spec, {{"LAYERS", more}}), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(aliased.ok()) << aliased.status();
  EXPECT_EQ(aliased->runtime.layer_layout->layers.size(), 64u);
  EXPECT_EQ(ParseError(absl::StrReplaceAll(inline_spec, {{"LAYERS", ", *l"}})).code(),
            absl::StatusCode::kInvalidArgument);
  // auto: AutoPolicy chooses act_policy and offload_ratio itself, so it refuses them; it travels
  // in the resolved spec.
  auto auto_with_act = JobSpec::Parse(with("auto"), dir, JobSpec::FileCheck::kCheck).status();
  EXPECT_EQ(auto_with_act.code(), absl::StatusCode::kInvalidArgument) << auto_with_act;
  EXPECT_TRUE(absl::StrContains(auto_with_act.message(), "act_policy")) << auto_with_act;
  auto automatic = JobSpec::Parse(absl::StrReplaceAll(with("auto"), {{"act_policy: selective, ", ""}}), dir,
                                  JobSpec::FileCheck::kCheck);
  ASSERT_TRUE(automatic.ok()) << automatic.status();
  EXPECT_TRUE(automatic->runtime.policy_auto);
  EXPECT_TRUE(automatic->runtime.policy_file.empty());
  auto auto_again = JobSpec::Parse(automatic->ToYaml(), "/elsewhere", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(auto_again.ok()) << auto_again.status();
  EXPECT_TRUE(auto_again->runtime.policy_auto);
  for (const char* bad : {"missing.yaml", "broken.yaml", "'[1]'"}) {
    auto st = JobSpec::Parse(with(bad), dir, JobSpec::FileCheck::kCheck).status();
    EXPECT_EQ(st.code(), absl::StatusCode::kInvalidArgument) << bad << ": " << st;
    EXPECT_TRUE(absl::StrContains(st.message(), "runtime.policy")) << bad << ": " << st;
  }
}

// optimizer.no_decay: HF Trainer's groups (norm weights, biases) by default; [] decays everything;
// any order in, canonical order out; unknown or repeated entries and non-lists name the key.
TEST(JobSpec, NoDecayIsNormAndBiasByDefaultAndRoundTrips) {
  auto def = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(def.ok()) << def.status();
  EXPECT_EQ(def->optimizer.no_decay, (std::vector<NoDecay>{NoDecay::kNorm, NoDecay::kBias}));
  EXPECT_NE(def->ToYaml().find("no_decay: [norm, bias]"), std::string::npos) << def->ToYaml();
  for (auto [text, want] : {std::pair{"[]", std::vector<NoDecay>{}}, std::pair{"[bias]", std::vector{NoDecay::kBias}},
                            std::pair{"[norm]", std::vector{NoDecay::kNorm}},
                            std::pair{"[bias, norm]", std::vector{NoDecay::kNorm, NoDecay::kBias}}}) {
    auto spec = JobSpec::Parse(
        absl::StrReplaceAll(kGood, {{"weight_decay: 0.1}", absl::StrCat("weight_decay: 0.1, no_decay: ", text, "}")}}),
        "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(spec.ok()) << text << ": " << spec.status();
    EXPECT_EQ(spec->optimizer.no_decay, want) << text;
    auto again = JobSpec::Parse(spec->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(again.ok()) << again.status() << "\n" << spec->ToYaml();
    EXPECT_EQ(again->optimizer.no_decay, want) << spec->ToYaml();
    EXPECT_EQ(again->ToYaml(), spec->ToYaml());
  }
  for (auto [text, says] :
       {std::pair{"[norms]", "optimizer.no_decay: unknown value 'norms' (one of: norm, bias)"},
        std::pair{"[norm, norm]", "optimizer.no_decay: 'norm' is given twice"},
        std::pair{"norm", "optimizer.no_decay: expected a list of norm, bias (or []), got 'norm'"},
        std::pair{"[[norm]]", "optimizer.no_decay: expected norm or bias, got a list"},
        std::pair{"{norm: 1}", "optimizer.no_decay: expected a list of norm, bias (or []), got a map"}}) {
    const absl::Status s = ParseError(
        absl::StrReplaceAll(kGood, {{"weight_decay: 0.1}", absl::StrCat("weight_decay: 0.1, no_decay: ", text, "}")}}));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_TRUE(absl::StrContains(s.message(), says)) << text << ": " << s;
  }
}

TEST(JobSpec, SkipNonfiniteIsOffByDefaultAndRoundTrips) {
  auto off = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->train.skip_nonfinite);
  const std::string text = absl::StrReplaceAll(kGood, {{"seed: 7}", "seed: 7, skip_nonfinite: true}"}});
  auto on = JobSpec::Parse(text, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_TRUE(on->train.skip_nonfinite);
  auto again = JobSpec::Parse(on->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->train.skip_nonfinite);
  EXPECT_EQ(again->ToYaml(), on->ToYaml());
  EXPECT_NE(on->ToYaml().find("skip_nonfinite: true"), std::string::npos) << on->ToYaml();
  // Only booleans; the key lives in train, not elsewhere.
  absl::Status s = ParseError(absl::StrReplaceAll(kGood, {{"seed: 7}", "seed: 7, skip_nonfinite: maybe}"}}));
  EXPECT_NE(s.message().find("train.skip_nonfinite: expected true or false, got 'maybe'"), std::string::npos) << s;
  s = ParseError(absl::StrReplaceAll(kGood, {{"weight_decay: 0.1}", "weight_decay: 0.1, skip_nonfinite: true}"}}));
  EXPECT_NE(s.message().find("unknown key 'optimizer.skip_nonfinite'"), std::string::npos) << s;
  s = ParseError(
      absl::StrReplaceAll(text, {{"skip_nonfinite: true}", "skip_nonfinite: true, skip_nonfinite: false}"}}));
  EXPECT_NE(s.message().find("'train.skip_nonfinite' is given twice"), std::string::npos) << s;
}

// output.tensorboard: off by default, a boolean, round-trips.
TEST(JobSpec, TensorBoardIsOffByDefaultAndRoundTrips) {
  auto off = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(off.ok()) << off.status();
  EXPECT_FALSE(off->output.tensorboard);
  const std::string text = absl::StrReplaceAll(kGood, {{"keep_last: 3}", "keep_last: 3, tensorboard: true}"}});
  auto on = JobSpec::Parse(text, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_TRUE(on->output.tensorboard);
  auto again = JobSpec::Parse(on->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->output.tensorboard);
  EXPECT_NE(on->ToYaml().find("tensorboard: true"), std::string::npos) << on->ToYaml();
  absl::Status s =
      ParseError(absl::StrReplaceAll(kGood, {{"keep_last: 3}", "keep_last: 3, tensorboard: yes please}"}}));
  EXPECT_NE(s.message().find("output.tensorboard: expected true or false"), std::string::npos) << s;
}

// runtime.copy_priority (DMA before Adam): a fraction in [0, 1], off (0) by default, round-trips.
TEST(JobSpec, CopyPriorityIsOffByDefaultAndIsAFraction) {
  auto d = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_DOUBLE_EQ(d->runtime.copy_priority, 0.0);
  for (const char* v : {"0", "0.25", "1"}) {
    const std::string text = absl::StrReplaceAll(
        kGood, {{"embedding_rows: bf16}", absl::StrCat("embedding_rows: bf16, copy_priority: ", v, "}")}});
    auto s = JobSpec::Parse(text, "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(s.ok()) << s.status();
    EXPECT_DOUBLE_EQ(s->runtime.copy_priority, std::stod(v));
    auto again = JobSpec::Parse(s->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_DOUBLE_EQ(again->runtime.copy_priority, std::stod(v)) << s->ToYaml();
  }
  for (const char* v : {"-0.1", "1.5", "half"}) {
    absl::Status s = ParseError(absl::StrReplaceAll(
        kGood, {{"embedding_rows: bf16}", absl::StrCat("embedding_rows: bf16, copy_priority: ", v, "}")}}));
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << v;
    EXPECT_NE(s.message().find("runtime.copy_priority"), std::string::npos) << s;
  }
}

TEST(JobSpec, ValidationDefaultsToTheSplitBesideTrainAndRoundTrips) {
  const std::string root =
      std::filesystem::path(::testing::TempDir() + "/spec-val-" + std::to_string(getpid())).lexically_normal().string();
  std::filesystem::create_directories(root + "/ds/train");
  std::filesystem::create_directories(root + "/ds/validation");
  std::ofstream(root + "/ds/validation/manifest.json") << "{}";
  std::string text = absl::StrReplaceAll(kGood, {{"data/tiny", "ds/train"}});
  auto s = JobSpec::Parse(text, root, JobSpec::FileCheck::kCheck);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->data.validation, root + "/ds/validation");
  EXPECT_EQ(s->train.eval_every, 0);
  auto back = JobSpec::Parse(s->ToYaml(), "/elsewhere", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->data.validation, s->data.validation);
  // none, an explicit directory, and eval_every.
  auto none = JobSpec::Parse(absl::StrReplaceAll(text, {{"path: ds/train}", "path: ds/train, validation: none}"}}),
                             root, JobSpec::FileCheck::kCheck);
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->data.validation, "");
  auto none_back = JobSpec::Parse(none->ToYaml(), "/elsewhere", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(none_back.ok());
  EXPECT_EQ(none_back->data.validation, "");
  auto given = JobSpec::Parse(
      absl::StrReplaceAll(text, {{"path: ds/train}", "path: ds/train, validation: ds/validation}"},
                                 {"seed: 7}", "seed: 7, eval_every: 5}"}}),
      root, JobSpec::FileCheck::kCheck);
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->data.validation, root + "/ds/validation");
  EXPECT_EQ(given->train.eval_every, 5);
  // Without a split beside it, auto finds none; eval_every then is refused naming the key.
  auto alone = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"seed: 7}", "seed: 7, eval_every: 5}"}}), root,
                              JobSpec::FileCheck::kCheck);
  ASSERT_FALSE(alone.ok());
  EXPECT_TRUE(absl::StrContains(alone.status().message(), "train.eval_every")) << alone.status();
  EXPECT_TRUE(absl::StrContains(
      ParseError(absl::StrReplaceAll(kGood, {{"seed: 7}", "seed: 7, eval_every: -1}"}})).message(), "eval_every"));
  auto missing = JobSpec::Parse(absl::StrReplaceAll(text, {{"path: ds/train}", "path: ds/train, validation: nope}"}}),
                                root, JobSpec::FileCheck::kCheck);
  ASSERT_FALSE(missing.ok());
  EXPECT_TRUE(absl::StrContains(missing.status().message(), "data.validation")) << missing.status();
  std::filesystem::remove_all(root);
}

TEST(JobSpec, JsonIsAccepted) {
  auto s = JobSpec::Parse(R"({"model": {"preset": "tiny"}, "data": {"path": "d"},
                              "train": {"seq_len": 16, "global_batch": 2, "steps": 1}})",
                          "/b", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->train.global_batch, 2);
}

struct BadCase {
  const char* what;
  std::string text;
  const char* message_part;
};

TEST(JobSpec, RejectsBadSpecsWithPreciseMessages) {
  std::string base = "model: {preset: tiny}\ndata: {path: d}\n";
  std::vector<BadCase> cases = {
      {"unknown section", base + "train: {seq_len: 8, global_batch: 2, steps: 1}\nbogus: 1\n", "unknown key 'bogus'"},
      {"unknown key", base + "train: {seq_len: 8, global_batch: 2, steps: 1, sequence_len: 3}\n", "train.sequence_len"},
      {"wrong type", base + "train: {seq_len: abc, global_batch: 2, steps: 1}\n", "train.seq_len: expected an integer, got 'abc'"},
      {"zero size", base + "train: {seq_len: 0, global_batch: 2, steps: 1}\n", "train.seq_len: must be >= 1"},
      {"negative", base + "train: {seq_len: 8, global_batch: -4, steps: 1}\n", "train.global_batch: must be >= 1"},
      {"indivisible", base + "train: {seq_len: 8, global_batch: 6, micro_batch: 4, steps: 1}\n", "not a multiple"},
      {"ranks", base + "train: {seq_len: 8, global_batch: 6, steps: 1}\nruntime: {workers: 4}\n", "not divisible by runtime.workers"},
      {"enum", base + "train: {seq_len: 8, global_batch: 2, steps: 1}\nschedule: {kind: step}\n", "unknown value 'step'"},
      {"no steps", base + "train: {seq_len: 8, global_batch: 2}\n", "exactly one of train.steps or train.epochs"},
      {"two models", "model: {preset: tiny, path: x}\ndata: {path: d}\ntrain: {seq_len: 8, global_batch: 2, steps: 1}\n", "exactly one of model.path"},
      {"not yaml", "model: [unclosed\n", "not valid YAML"},
      {"not a map", "- 1\n- 2\n", "top level must be a map"},
      {"section type", base + "train: 5\n", "train: expected a map"},
      {"lr range", base + "train: {seq_len: 8, global_batch: 2, steps: 1}\noptimizer: {lr: -1}\n", "optimizer.lr: must be in"},
      {"warmup", base + "train: {seq_len: 8, global_batch: 2, steps: 3}\nschedule: {warmup_steps: 5}\n", "warmup_steps 5 exceeds"},
      {"beta1 = 1", base + "train: {seq_len: 8, global_batch: 2, steps: 1}\noptimizer: {beta1: 1}\n",
       "must be in [0, 0.999999999], got 1"},
      {"device staging, cpu route", base + "train: {seq_len: 8, global_batch: 2, steps: 1}\n"
       "runtime: {workers: 2, grad_reduction: cpu, grad_staging: device}\n", "grad_staging device needs"},
      {"two documents", base + "train: {seq_len: 8, global_batch: 2, steps: 1}\n---\nname: other\n", "2 YAML documents"},
      {"rope key misspelt", "model: {preset: tiny, rope_scaling: {rope_type: yarn, factor: 4.0, beta_fst: 32}}\n"
       "data: {path: d}\ntrain: {seq_len: 8, global_batch: 2, steps: 1}\n", "unknown key 'beta_fst'"},
      {"huge context_parallel", base + "train: {seq_len: 8, global_batch: 2, steps: 1}\n"
       "runtime: {workers: 2147483647, context_parallel: 2147483647}\n", ""},
      {"NUL in data.path", "model: {preset: tiny}\ndata: {path: \"d\\0x\"}\ntrain: {seq_len: 8, global_batch: 2, steps: 1}\n",
       "data.path 'd?x' is not a usable path: it holds a control character"},
      {"newline in output.dir", base + "output: {dir: \"a\\nb\"}\ntrain: {seq_len: 8, global_batch: 2, steps: 1}\n",
       "output.dir 'a?b' is not a usable path"},
  };
  for (const BadCase& c : cases) {
    absl::Status s = ParseError(c.text);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(s.message().find(c.message_part), std::string::npos) << c.what << ": " << s.message();
  }
}

// The spec's directory (the client's) and its paths: UTF-8 without control characters, at most
// kMaxPathBytes; PrintableUtf8 makes any text fit for the protocol's strings.
TEST(JobSpec, PathsAreUtf8WithoutControlCharacters) {
  const std::string good = kGood;
  EXPECT_TRUE(JobSpec::Parse(good, "/base/caf\xc3\xa9", JobSpec::FileCheck::kSkip).ok());
  absl::Status s = JobSpec::Parse(good, "/tmp/x\xffy", JobSpec::FileCheck::kSkip).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(s.message(), "base_dir")) << s;
  EXPECT_TRUE(absl::StrContains(s.message(), "not UTF-8")) << s;
  EXPECT_FALSE(CheckPathText(std::string(kMaxPathBytes + 1, 'a'), "p").ok());
  EXPECT_TRUE(CheckPathText(std::string(kMaxPathBytes, 'a'), "p").ok());
  EXPECT_FALSE(CheckPathText("", "p").ok());
  EXPECT_FALSE(CheckPathText("a\x1b[31m", "p").ok());
  EXPECT_EQ(PrintableUtf8("ok\tline\nx\xff\x1b[1mcaf\xc3\xa9"), "ok\tline\nx??[1mcaf\xc3\xa9");
}

// Untrusted text made one bounded line; ids quoted printable; cuts never split a character.
TEST(JobSpec, BoundedLineShownIdAndUtf8Prefix) {
  EXPECT_EQ(BoundedLine("a\nb\r\tc\x1b", 100), "a b  c?");
  const std::string e = "\xc3\xa9";  // é, two bytes
  std::string text = "a";
  for (int i = 0; i < 10; ++i) text += e;
  EXPECT_EQ(Utf8Prefix(text, 4), "a" + e);  // not "a" + e + the first byte of the next
  EXPECT_EQ(Utf8Prefix(text, 100), text);
  const std::string cut = BoundedLine(text, 4);
  EXPECT_EQ(cut, "a" + e + "... (18 more bytes)");
  EXPECT_EQ(ShownId("job\x1b[2J\n"), "job?[2J?");
  EXPECT_EQ(ShownId(std::string(100, 'a')), std::string(80, 'a') + "...");
}

TEST(JobSpec, NonScalarKeysAreInvalidArgumentNotExceptions) {
  // Found by tests/fuzz/jobspec_fuzz.cc: yaml-cpp threw on a map used as a key.
  for (const char* text : {"{{}}", "[1]: 2", "model: {[a]: b}", "train: {{x: 1}: 2}"}) {
    EXPECT_EQ(ParseError(text).code(), absl::StatusCode::kInvalidArgument) << text;
  }
}

TEST(JobSpec, OversizedSpecIsRejected) {
  std::string big(2 << 20, '#');
  EXPECT_EQ(ParseError(big).code(), absl::StatusCode::kInvalidArgument);
}

TEST(JobSpec, TextThatIsNotUtf8IsRejectedWithTheOffset) {
  const std::string good = kGood;
  EXPECT_TRUE(ParseError(good + "# caf\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80\n").ok());  // 2-, 3-, 4-byte forms
  for (const std::string& bad : {std::string("\xff"), std::string("\xc3"), std::string("\xc0\xaf"),
                                 std::string("\xed\xa0\x80"), std::string("\xf4\x90\x80\x80"), std::string("\xe2\x82")}) {
    absl::Status s = ParseError(good + "# " + bad + "\n");
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_NE(s.message().find(absl::StrCat("at offset ", good.size() + 2)), std::string::npos) << s;
  }
}

TEST(JobSpec, KeysGivenTwiceAreRejected) {
  const std::string good = kGood;
  EXPECT_NE(ParseError(good + "train: {steps: 3}\n").message().find("'train' is given twice"), std::string::npos);
  EXPECT_NE(ParseError("name: a\nname: b\n").message().find("'name' is given twice"), std::string::npos);
  absl::Status s = ParseError(absl::StrReplaceAll(good, {{"steps: 20,", "steps: 20, steps: 21,"}}));
  EXPECT_NE(s.message().find("'train.steps' is given twice"), std::string::npos) << s;
}

TEST(JobSpec, NamesAreCheckedBeforeTheyNameAnything) {
  for (const char* ok : {"a", "qwen3-1.7b-sft", "run_2", "x.y.z"}) EXPECT_TRUE(ValidateJobName(ok).ok()) << ok;
  for (const std::string& bad : {std::string(""), std::string("../x"), std::string("a/b"), std::string(".x"),
                                 std::string("-x"), std::string("a b"), std::string("a\x01"), std::string("na\xc3\xafve"),
                                 std::string(kMaxJobNameBytes + 1, 'n')}) {
    EXPECT_EQ(ValidateJobName(bad).code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_TRUE(ValidateJobName(std::string(kMaxJobNameBytes, 'n')).ok());
}

TEST(JobSpec, MissingFilesAreReported) {
  auto s = JobSpec::Parse("model: {path: /nonexistent/model}\ndata: {path: /nonexistent/data}\n"
                          "train: {seq_len: 8, global_batch: 2, steps: 1}\n",
                          "/", JobSpec::FileCheck::kCheck);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("no config.json"), std::string::npos);
}

}  // namespace
}  // namespace slidedp

namespace slidedp {
namespace {

// model.max_position_embeddings and model.rope_scaling: a longer context than the config's.
TEST(JobSpec, ContextOverrideReachesTheModelConfigAndRoundTrips) {
  const std::string text = absl::StrReplaceAll(
      kGood, {{"model: {preset: tiny, init_seed: 3}",
               "model: {preset: tiny, init_seed: 3, max_position_embeddings: 16384, "
               "rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 4096}}"}});
  auto s = JobSpec::Parse(text, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->model.max_position_embeddings, 16384);
  auto c = ModelConfigOf(*s);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->max_position_embeddings, 16384);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kYarn);
  EXPECT_EQ(c->rope_scaling.factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 4096);
  EXPECT_GT(c->RopeAttentionScaling(), 1.0);
  // The resolved spec keeps the override (the workers build the same config from it).
  auto back = JobSpec::Parse(s->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(back.ok()) << back.status();
  auto c2 = ModelConfigOf(*back);
  ASSERT_TRUE(c2.ok()) << c2.status();
  EXPECT_TRUE(c2->rope_scaling == c->rope_scaling);
  EXPECT_EQ(c2->RopeInverseFrequencies(), c->RopeInverseFrequencies());
  // The config written for the checkpoint says the override, and reads back the same.
  auto saved = ModelConfig::FromJson(c->ToJson());
  ASSERT_TRUE(saved.ok()) << saved.status();
  EXPECT_EQ(saved->max_position_embeddings, 16384);
  EXPECT_EQ(saved->RopeInverseFrequencies(), c->RopeInverseFrequencies());
  // A bad override is refused naming the key.
  auto bad = JobSpec::Parse(absl::StrReplaceAll(text, {{"rope_type: yarn", "rope_type: longrope"}}), "/base",
                            JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(bad.ok());
  auto bc = ModelConfigOf(*bad);
  ASSERT_FALSE(bc.ok());
  EXPECT_TRUE(absl::StrContains(bc.status().message(), "model.rope_scaling")) << bc.status();
  EXPECT_TRUE(absl::StrContains(ParseError(absl::StrReplaceAll(kGood, {{"init_seed: 3}", "init_seed: 3, rope_scaling: 4}"}})).message(),
                                "model.rope_scaling"));
}

}  // namespace
}  // namespace slidedp

namespace slidedp {
namespace {

// model.num_hidden_layers: a preset at reduced depth (a MoE preset's mlp_only_layers past it go).
TEST(JobSpec, NumHiddenLayersReducesAPresetsDepth) {
  const std::string text = absl::StrReplaceAll(
      kGood, {{"model: {preset: tiny, init_seed: 3}", "model: {preset: tiny-moe, init_seed: 3, num_hidden_layers: 1}"}});
  auto s = JobSpec::Parse(text, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(s.ok()) << s.status();
  auto c = ModelConfigOf(*s);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_hidden_layers, 1);
  EXPECT_TRUE(c->mlp_only_layers.empty());  // tiny-moe's layer 1 is gone
  auto back = JobSpec::Parse(s->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->model.num_hidden_layers, 1);
  // Deeper than the preset, or on a model directory: refused naming the key.
  auto deep = JobSpec::Parse(absl::StrReplaceAll(text, {{"num_hidden_layers: 1", "num_hidden_layers: 9"}}), "/base",
                             JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(deep.ok());
  EXPECT_TRUE(absl::StrContains(ModelConfigOf(*deep).status().message(), "model.num_hidden_layers 9"));
  EXPECT_TRUE(absl::StrContains(
      ParseError(absl::StrReplaceAll(kGood, {{"model: {preset: tiny, init_seed: 3}",
                                              "model: {path: /m, num_hidden_layers: 2}"}})).message(),
      "model.num_hidden_layers reduces a preset's depth"));
  // Sliding layers past the new depth go too (tiny-qwen2-window's layer 1), and the window with them.
  for (const auto& [depth, window] : {std::pair{"2", 16}, std::pair{"1", 0}}) {
    auto w = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"model: {preset: tiny, init_seed: 3}",
                                                         absl::StrCat("model: {preset: tiny-qwen2-window, "
                                                                      "num_hidden_layers: ",
                                                                      depth, "}")}}),
                            "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(w.ok()) << w.status();
    auto wc = ModelConfigOf(*w);
    ASSERT_TRUE(wc.ok()) << wc.status();
    EXPECT_EQ(wc->sliding_window, window) << depth;
    EXPECT_EQ(wc->AttentionWindow(1), window) << depth;
  }
  // gemma4: the layers that shared keys and values still do (those past the original first shared
  // one), and the last layer is full (Gemma4TextConfig's rule): gemma4-e2b's first 18 layers keep 15,
  // 16 and 17 shared; its first 12 none, the last of them (sliding in the full model) full.
  for (const auto& [depth, shared] : {std::pair{18, 3}, std::pair{12, 0}}) {
    auto g = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"model: {preset: tiny, init_seed: 3}",
                                                         absl::StrCat("model: {preset: gemma4-e2b, num_hidden_layers: ",
                                                                      depth, "}")}}),
                            "/base", JobSpec::FileCheck::kSkip);
    ASSERT_TRUE(g.ok()) << g.status();
    auto gc = ModelConfigOf(*g);
    ASSERT_TRUE(gc.ok()) << gc.status();
    EXPECT_EQ(gc->gemma4.kv_shared_layers, shared) << depth;
    EXPECT_FALSE(gc->IsSlidingLayer(depth - 1)) << depth;
    EXPECT_EQ(gc->KvSourceLayer(depth - 1), shared > 0 ? 14 : -1) << depth;
  }
}

// train.measure_only is AutoPolicy's; PolicyMeasureSpec keeps what the policy cache's key reads
// (the batch, every runtime setting but the policy) and changes what a measurement must not do.
TEST(JobSpec, MeasureOnlyNeedsPolicyAutoAndTheMeasureSpecKeepsTheShape) {
  const absl::Status bad = ParseError(absl::StrReplaceAll(kGood, {{"seed: 7}", "seed: 7, measure_only: true}"}}));
  EXPECT_EQ(bad.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.message(), "runtime.policy auto")) << bad;
  auto s = JobSpec::Parse(kGood, "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(s.ok()) << s.status();
  s->runtime.offload_ratio = 0.5;
  const JobSpec m = PolicyMeasureSpec(*s);
  EXPECT_EQ(m.name, "tiny-plan");
  EXPECT_TRUE(m.runtime.policy_auto && m.train.measure_only);
  EXPECT_EQ(m.runtime.act_policy, ActivationPolicy::kRecomputeLayer);
  EXPECT_EQ(m.runtime.offload_ratio, 0);
  EXPECT_EQ(m.train.steps, kPolicyMeasureSteps);
  EXPECT_FALSE(m.output.save_final);
  EXPECT_EQ(m.output.save_every, 0);
  EXPECT_EQ(m.train.global_batch, s->train.global_batch);
  EXPECT_EQ(m.train.seq_len, s->train.seq_len);
  EXPECT_EQ(m.runtime.deterministic, s->runtime.deterministic);
  auto again = JobSpec::Parse(m.ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->train.measure_only);
  EXPECT_EQ(again->ToYaml(), m.ToYaml());
  s->name = std::string(kMaxJobNameBytes, 'n');
  EXPECT_TRUE(ValidateJobName(PolicyMeasureSpec(*s).name).ok()) << PolicyMeasureSpec(*s).name;
}


// runtime.grad_reduction / param_delivery auto round-trip; RouteVariants lists the routes left open
// (sharded delivery only on CUDA workers), every route with `all`, and one for one worker.
TEST(JobSpec, AutoRoutesRoundTripAndTheirVariants) {
  auto s = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"workers: 2,", "workers: 2, grad_reduction: auto,"}}), "/base",
                          JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_TRUE(s->runtime.grad_reduction_auto);
  EXPECT_FALSE(s->runtime.param_delivery_auto);
  auto again = JobSpec::Parse(s->ToYaml(), "/base", JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->runtime.grad_reduction_auto);
  EXPECT_EQ(RouteVariants(*s, 2, /*cuda=*/false, false).size(), 2u);
  EXPECT_EQ(RouteVariants(*s, 2, /*cuda=*/true, false).size(), 2u);  // delivery was given: replicated
  EXPECT_EQ(RouteVariants(*s, 2, /*cuda=*/true, true).size(), 4u);
  EXPECT_EQ(RouteVariants(*s, 2, /*cuda=*/false, true).size(), 2u);
  for (const JobSpec& v : RouteVariants(*s, 2, true, true)) {
    EXPECT_FALSE(v.runtime.grad_reduction_auto || v.runtime.param_delivery_auto);
    EXPECT_TRUE(absl::StartsWith(RouteName(v), "grad_reduction ")) << RouteName(v);
  }
  const std::vector<JobSpec> one = RouteVariants(*s, 1, true, true);
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].runtime.grad_reduction, GradReduction::kGpu);
  s->runtime.grad_reduction_auto = false;
  s->runtime.grad_reduction = GradReduction::kCpu;
  EXPECT_EQ(RouteVariants(*s, 1, true, true)[0].runtime.grad_reduction, GradReduction::kCpu);  // one worker: as given
  EXPECT_EQ(RouteVariants(*s, 2, false, false).size(), 1u);
  EXPECT_EQ(ParseError(absl::StrReplaceAll(kGood, {{"workers: 2,", "workers: 2, grad_reduction: maybe,"}})).code(),
            absl::StatusCode::kInvalidArgument);
  // chunk_bytes auto: each of kAutoChunkBytes, on any number of workers.
  auto chunks = JobSpec::Parse(absl::StrReplaceAll(kGood, {{"workers: 2,", "workers: 2, chunk_bytes: auto,"}}), "/base",
                               JobSpec::FileCheck::kSkip);
  ASSERT_TRUE(chunks.ok()) << chunks.status();
  EXPECT_TRUE(chunks->runtime.chunk_bytes_auto);
  EXPECT_TRUE(absl::StrContains(chunks->ToYaml(), "chunk_bytes: auto")) << chunks->ToYaml();
  const std::vector<JobSpec> one_worker = RouteVariants(*chunks, 1, true, false);
  ASSERT_EQ(one_worker.size(), std::size(kAutoChunkBytes));
  EXPECT_EQ(one_worker[0].runtime.chunk_bytes, kAutoChunkBytes[0]);
  EXPECT_FALSE(one_worker[0].runtime.chunk_bytes_auto);
  EXPECT_EQ(RouteVariants(*chunks, 2, true, true).size(), 4 * std::size(kAutoChunkBytes));
}

}  // namespace
}  // namespace slidedp
