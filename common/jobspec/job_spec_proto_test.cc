// The job config hostd sends the workers (v1::JobConfig) holds the spec exactly: every key, set to
// something other than its default, comes back the same, and values a worker does not know are
// refused naming the key.
#include "common/jobspec/job_spec_proto.h"

#include <gtest/gtest.h>

#include "absl/strings/str_replace.h"

namespace slidedp {
namespace {

// Every key of every section away from its default (docs/job-spec.md).
constexpr char kEveryKey[] = R"(
name: every-key
model: {path: /models/m, init_seed: 7, max_position_embeddings: 65536,
        rope_scaling: {rope_type: yarn, factor: 4.0, original_max_position_embeddings: 16384}}
data: {path: /data/train, validation: /data/validation, tokenizer_check: false}
output: {dir: /out/x, save_every: 5, keep_last: 3, save_dtype: fp32, save_final: false, tensorboard: true,
         overwrite: true}
train: {seq_len: 4096, global_batch: 8, micro_batch: 2, steps: 40, seed: 11, eval_every: 10, max_grad_norm: 0.5,
        skip_nonfinite: true, router_aux_loss_coef: 0.02}
optimizer: {lr: 2.0e-5, beta1: 0.8, beta2: 0.95, eps: 1.0e-6, weight_decay: 0.1, no_decay: [bias],
            state_dtype: int8}
schedule: {kind: cosine, warmup_steps: 4, min_lr: 1.0e-6}
runtime: {backend: cuda, workers: 4, chunk_bytes: 1048576, param_delivery: sharded, grad_reduction: cpu,
          grad_staging: host, grad_dtype: bf16, param_source: master, cast_on: host, cast_threads: 3,
          act_policy: selective, norm_weights: bf16, embedding_rows: bf16, deterministic: true,
          offload_ratio: 0.25, checkpoint_dtype: bf16, tile_tokens: 1024, speculation_bytes: 123456,
          gpu_memory_limit: 0.5, copy_priority: 0.5, ring_slots: 6, step_timeout_ms: 5000, max_restarts: 2,
          context_parallel: 2,
          layer_policy: {version: 1, device: NVIDIA H100 80GB HBM3, tokens_per_step: 32768,
                         model: {hidden_size: 64, num_hidden_layers: 3, num_attention_heads: 4,
                                 num_key_value_heads: 2, head_dim: 16, intermediate_size: 128, vocab_size: 512},
                         layers: [{kind: keep_all}, {kind: recompute, offload: 1}, {kind: selective}]}}
)";

// And the keys a spec cannot set together with the above (train.measure_only needs runtime.policy
// auto, which refuses act_policy): set in code, as hostd's PolicyMeasureSpec does.
JobSpec Parsed(const std::string& text) {
  absl::StatusOr<JobSpec> spec = JobSpec::Parse(text, "/base", JobSpec::FileCheck::kSkip);
  EXPECT_TRUE(spec.ok()) << spec.status();
  if (!spec.ok()) return JobSpec{};
  spec->train.measure_only = true;
  spec->runtime.policy_file = "/policies/p.yaml";
  return *spec;
}

// Through the wire: serialized and parsed again, as a worker receives it.
absl::StatusOr<JobSpec> RoundTrip(const JobSpec& spec) {
  v1::JobConfig back;
  EXPECT_TRUE(back.ParseFromString(JobConfigOf(spec).SerializeAsString()));
  return JobSpecOf(back);
}

TEST(JobSpecProto, EveryKeyComesBackAsItWas) {
  const JobSpec spec = Parsed(kEveryKey);
  // The spec above really is away from the defaults: its YAML differs from a default spec's in
  // every key ToYaml writes (a key missing from the conversion would come back as the default).
  const std::string yaml = spec.ToYaml();
  absl::StatusOr<JobSpec> back = RoundTrip(spec);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ToYaml(), yaml);
  ASSERT_TRUE(back->runtime.layer_layout.has_value());
  EXPECT_TRUE(*back->runtime.layer_layout == *spec.runtime.layer_layout);
  EXPECT_EQ(back->optimizer.no_decay, std::vector<NoDecay>{NoDecay::kBias});
  EXPECT_EQ(back->runtime.gpu_memory_limit_fraction, 0.5);
}

TEST(JobSpecProto, AutoRoutesAndPresetsComeBack) {
  JobSpec spec = Parsed(absl::StrReplaceAll(kEveryKey, {{"path: /models/m,", "preset: tiny, num_hidden_layers: 2,"},
                                                        {"chunk_bytes: 1048576", "chunk_bytes: auto"},
                                                        {"param_delivery: sharded", "param_delivery: auto"},
                                                        {"grad_reduction: cpu", "grad_reduction: auto"},
                                                        {"grad_staging: host", "grad_staging: auto"},
                                                        {"gpu_memory_limit: 0.5", "gpu_memory_limit: 40GiB"},
                                                        {"no_decay: [bias]", "no_decay: []"}}));
  absl::StatusOr<JobSpec> back = RoundTrip(spec);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->ToYaml(), spec.ToYaml());
  EXPECT_TRUE(back->runtime.chunk_bytes_auto && back->runtime.param_delivery_auto && back->runtime.grad_reduction_auto);
  EXPECT_EQ(back->runtime.grad_staging, GradStaging::kAuto);
  EXPECT_EQ(back->model.preset, "tiny");
  spec.runtime.policy_auto = true;  // the other form of runtime.policy
  back = RoundTrip(spec);
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_TRUE(back->runtime.policy_auto);
  EXPECT_TRUE(back->optimizer.no_decay.empty());
}

TEST(JobSpecProto, ValuesAWorkerDoesNotKnowAreRefusedNamingTheKey) {
  const v1::JobConfig good = JobConfigOf(Parsed(kEveryKey));
  struct Case {
    const char* key;
    void (*spoil)(v1::JobConfig&);
  };
  const Case cases[] = {
      {"output.save_dtype", [](v1::JobConfig& c) { c.mutable_output()->set_save_dtype(v1::DTYPE_UNSPECIFIED); }},
      {"optimizer.state_dtype",
       [](v1::JobConfig& c) { c.mutable_optimizer()->set_state_dtype(static_cast<v1::MomentForm>(9)); }},
      {"optimizer.no_decay", [](v1::JobConfig& c) { c.mutable_optimizer()->add_no_decay(v1::NO_DECAY_UNSPECIFIED); }},
      {"schedule.kind", [](v1::JobConfig& c) { c.mutable_schedule()->set_kind(static_cast<v1::ScheduleKind>(4)); }},
      {"runtime.grad_staging",
       [](v1::JobConfig& c) { c.mutable_runtime()->set_grad_staging(v1::GRAD_STAGING_UNSPECIFIED); }},
      {"runtime.act_policy",
       [](v1::JobConfig& c) { c.mutable_runtime()->set_act_policy(static_cast<v1::ActivationPolicy>(5)); }},
      {"runtime.layer_policy kind",
       [](v1::JobConfig& c) {
         c.mutable_runtime()->mutable_layer_layout()->mutable_layers(1)->set_kind(v1::LAYER_KIND_UNSPECIFIED);
       }},
      {"a section is missing", [](v1::JobConfig& c) { c.clear_runtime(); }},
  };
  for (const Case& c : cases) {
    v1::JobConfig spoilt = good;
    c.spoil(spoilt);
    absl::StatusOr<JobSpec> back = JobSpecOf(spoilt);
    EXPECT_EQ(back.status().code(), absl::StatusCode::kInvalidArgument) << c.key;
    EXPECT_NE(back.status().message().find(c.key), std::string::npos) << back.status();
  }
}

}  // namespace
}  // namespace slidedp
