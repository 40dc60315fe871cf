#include "common/jobspec/job_spec_proto.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status/status_macros.h"

namespace slidedp {
namespace {

// Each wire enum lists its C++ enum's members in order from 1 (0: unset): checked here, so a
// member added on one side only fails the build.
#define SLIDEDP_SAME_ENUM(cpp, wire) static_assert(static_cast<int>(cpp) + 1 == static_cast<int>(wire), #cpp)
SLIDEDP_SAME_ENUM(Dtype::kF32, v1::DTYPE_F32);
SLIDEDP_SAME_ENUM(Dtype::kBF16, v1::DTYPE_BF16);
SLIDEDP_SAME_ENUM(MomentForm::kF32, v1::MOMENT_FORM_F32);
SLIDEDP_SAME_ENUM(MomentForm::kBF16, v1::MOMENT_FORM_BF16);
SLIDEDP_SAME_ENUM(MomentForm::kInt8, v1::MOMENT_FORM_INT8);
SLIDEDP_SAME_ENUM(ScheduleKind::kConstant, v1::SCHEDULE_KIND_CONSTANT);
SLIDEDP_SAME_ENUM(ScheduleKind::kLinear, v1::SCHEDULE_KIND_LINEAR);
SLIDEDP_SAME_ENUM(ScheduleKind::kCosine, v1::SCHEDULE_KIND_COSINE);
SLIDEDP_SAME_ENUM(Backend::kAuto, v1::BACKEND_AUTO);
SLIDEDP_SAME_ENUM(Backend::kCuda, v1::BACKEND_CUDA);
SLIDEDP_SAME_ENUM(Backend::kCpu, v1::BACKEND_CPU);
SLIDEDP_SAME_ENUM(ActivationPolicy::kKeepAll, v1::ACTIVATION_POLICY_KEEP_ALL);
SLIDEDP_SAME_ENUM(ActivationPolicy::kRecomputeLayer, v1::ACTIVATION_POLICY_RECOMPUTE);
SLIDEDP_SAME_ENUM(ActivationPolicy::kSelective, v1::ACTIVATION_POLICY_SELECTIVE);
SLIDEDP_SAME_ENUM(ActivationPolicy::kAuto, v1::ACTIVATION_POLICY_AUTO);
SLIDEDP_SAME_ENUM(ParamSource::kMirror, v1::PARAM_SOURCE_MIRROR);
SLIDEDP_SAME_ENUM(ParamSource::kMaster, v1::PARAM_SOURCE_MASTER);
SLIDEDP_SAME_ENUM(CastOn::kDevice, v1::CAST_ON_DEVICE);
SLIDEDP_SAME_ENUM(CastOn::kHost, v1::CAST_ON_HOST);
SLIDEDP_SAME_ENUM(NoDecay::kNorm, v1::NO_DECAY_NORM);
SLIDEDP_SAME_ENUM(NoDecay::kBias, v1::NO_DECAY_BIAS);
SLIDEDP_SAME_ENUM(LayerKind::kRecompute, v1::LAYER_KIND_RECOMPUTE);
SLIDEDP_SAME_ENUM(LayerKind::kSelective, v1::LAYER_KIND_SELECTIVE);
SLIDEDP_SAME_ENUM(LayerKind::kSegment, v1::LAYER_KIND_SEGMENT);
SLIDEDP_SAME_ENUM(LayerKind::kKeepAll, v1::LAYER_KIND_KEEP_ALL);
SLIDEDP_SAME_ENUM(ParamDelivery::kReplicated, v1::PARAM_DELIVERY_REPLICATED);
SLIDEDP_SAME_ENUM(ParamDelivery::kSharded, v1::PARAM_DELIVERY_SHARDED);
SLIDEDP_SAME_ENUM(NodeState::kReplicated, v1::NODE_STATE_REPLICATED);
SLIDEDP_SAME_ENUM(NodeState::kSharded, v1::NODE_STATE_SHARDED);
SLIDEDP_SAME_ENUM(GradReduction::kGpu, v1::GRAD_REDUCTION_GPU);
SLIDEDP_SAME_ENUM(GradReduction::kCpu, v1::GRAD_REDUCTION_CPU);
#undef SLIDEDP_SAME_ENUM

template <typename Wire, typename E>
Wire ToWire(E e) {
  return static_cast<Wire>(static_cast<int>(e) + 1);
}

// The C++ member of a wire value in [1, last]; INVALID_ARGUMENT naming `field` otherwise.
template <typename E>
absl::Status FromWire(int wire, E last, const char* field, E& out) {
  if (wire < 1 || wire > static_cast<int>(last) + 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("job config: ", field, " has the value ", wire, ", which this worker does not know"));
  }
  out = static_cast<E>(wire - 1);
  return absl::OkStatus();
}

// grad_staging's wire enum predates the others (HOST = 1, DEVICE = 2) and has AUTO last.
v1::GradStaging StagingToWire(GradStaging g) {
  switch (g) {
    case GradStaging::kHost: return v1::GRAD_STAGING_HOST;
    case GradStaging::kDevice: return v1::GRAD_STAGING_DEVICE;
    case GradStaging::kAuto: return v1::GRAD_STAGING_AUTO;
  }
  return v1::GRAD_STAGING_UNSPECIFIED;
}
absl::Status StagingFromWire(v1::GradStaging w, GradStaging& out) {
  switch (w) {
    case v1::GRAD_STAGING_HOST: out = GradStaging::kHost; return absl::OkStatus();
    case v1::GRAD_STAGING_DEVICE: out = GradStaging::kDevice; return absl::OkStatus();
    case v1::GRAD_STAGING_AUTO: out = GradStaging::kAuto; return absl::OkStatus();
    default: break;
  }
  return absl::InvalidArgumentError(absl::StrCat("job config: runtime.grad_staging has the value ", static_cast<int>(w),
                                                 ", which this worker does not know"));
}

v1::LayerLayout LayoutToWire(const LayerLayout& l) {
  v1::LayerLayout w;
  v1::LayerLayout::Shape& m = *w.mutable_model();
  m.set_model_type(l.model.model_type);
  m.set_hidden_size(l.model.hidden_size);
  m.set_num_hidden_layers(l.model.num_hidden_layers);
  m.set_num_attention_heads(l.model.num_attention_heads);
  m.set_num_key_value_heads(l.model.num_key_value_heads);
  m.set_head_dim(l.model.head_dim);
  m.set_intermediate_size(l.model.intermediate_size);
  m.set_vocab_size(l.model.vocab_size);
  m.set_num_experts(l.model.num_experts);
  m.set_num_experts_per_tok(l.model.num_experts_per_tok);
  m.set_moe_intermediate_size(l.model.moe_intermediate_size);
  w.set_device(l.device);
  w.set_tokens_per_step(l.tokens_per_step);
  for (const LayerPolicy& p : l.layers) {
    v1::LayerLayout::Layer& layer = *w.add_layers();
    layer.set_kind(ToWire<v1::LayerKind>(p.kind));
    layer.set_offload(p.offload);
    layer.set_keep(p.keep);
  }
  return w;
}

absl::StatusOr<LayerLayout> LayoutFromWire(const v1::LayerLayout& w) {
  LayerLayout l;
  const v1::LayerLayout::Shape& m = w.model();
  l.model.model_type = m.model_type();
  l.model.hidden_size = m.hidden_size();
  l.model.num_hidden_layers = m.num_hidden_layers();
  l.model.num_attention_heads = m.num_attention_heads();
  l.model.num_key_value_heads = m.num_key_value_heads();
  l.model.head_dim = m.head_dim();
  l.model.intermediate_size = m.intermediate_size();
  l.model.vocab_size = m.vocab_size();
  l.model.num_experts = m.num_experts();
  l.model.num_experts_per_tok = m.num_experts_per_tok();
  l.model.moe_intermediate_size = m.moe_intermediate_size();
  l.device = w.device();
  l.tokens_per_step = w.tokens_per_step();
  for (const v1::LayerLayout::Layer& layer : w.layers()) {
    LayerPolicy& p = l.layers.emplace_back();
    RETURN_IF_ERROR(FromWire(layer.kind(), LayerKind::kKeepAll, "runtime.layer_policy kind", p.kind));
    p.offload = layer.offload();
    p.keep = layer.keep();
  }
  return l;
}

void ModelToWire(const ModelSection& s, v1::JobConfig::Model& w) {
  w.set_path(s.path);
  w.set_preset(s.preset);
  w.set_init_seed(s.init_seed);
  w.set_max_position_embeddings(s.max_position_embeddings);
  w.set_rope_scaling_json(s.rope_scaling_json);
  w.set_num_hidden_layers(s.num_hidden_layers);
}
void ModelFromWire(const v1::JobConfig::Model& w, ModelSection& s) {
  s.path = w.path();
  s.preset = w.preset();
  s.init_seed = w.init_seed();
  s.max_position_embeddings = w.max_position_embeddings();
  s.rope_scaling_json = w.rope_scaling_json();
  s.num_hidden_layers = w.num_hidden_layers();
}

void DataToWire(const DataSection& s, v1::JobConfig::Data& w) {
  w.set_path(s.path);
  w.set_validation(s.validation);
  w.set_tokenizer_check(s.tokenizer_check);
}
void DataFromWire(const v1::JobConfig::Data& w, DataSection& s) {
  s.path = w.path();
  s.validation = w.validation();
  s.tokenizer_check = w.tokenizer_check();
}

void OutputToWire(const OutputSection& s, v1::JobConfig::Output& w) {
  w.set_dir(s.dir);
  w.set_save_every(s.save_every);
  w.set_keep_last(s.keep_last);
  w.set_save_dtype(ToWire<v1::Dtype>(s.save_dtype));
  w.set_save_final(s.save_final);
  w.set_tensorboard(s.tensorboard);
  w.set_overwrite(s.overwrite);
}
absl::Status OutputFromWire(const v1::JobConfig::Output& w, OutputSection& s) {
  s.dir = w.dir();
  s.save_every = w.save_every();
  s.keep_last = w.keep_last();
  RETURN_IF_ERROR(FromWire(w.save_dtype(), Dtype::kBF16, "output.save_dtype", s.save_dtype));
  s.save_final = w.save_final();
  s.tensorboard = w.tensorboard();
  s.overwrite = w.overwrite();
  return absl::OkStatus();
}

void TrainToWire(const TrainSection& s, v1::JobConfig::Train& w) {
  w.set_seq_len(s.seq_len);
  w.set_global_batch(s.global_batch);
  w.set_micro_batch(s.micro_batch);
  w.set_steps(s.steps);
  w.set_epochs(s.epochs);
  w.set_seed(s.seed);
  w.set_eval_every(s.eval_every);
  w.set_max_grad_norm(s.max_grad_norm);
  w.set_skip_nonfinite(s.skip_nonfinite);
  w.set_measure_only(s.measure_only);
  w.set_router_aux_loss_coef(s.router_aux_loss_coef);
}
void TrainFromWire(const v1::JobConfig::Train& w, TrainSection& s) {
  s.seq_len = w.seq_len();
  s.global_batch = w.global_batch();
  s.micro_batch = w.micro_batch();
  s.steps = w.steps();
  s.epochs = w.epochs();
  s.seed = w.seed();
  s.eval_every = w.eval_every();
  s.max_grad_norm = w.max_grad_norm();
  s.skip_nonfinite = w.skip_nonfinite();
  s.measure_only = w.measure_only();
  s.router_aux_loss_coef = w.router_aux_loss_coef();
}

void OptimizerToWire(const OptimizerSection& s, v1::JobConfig::Optimizer& w) {
  w.set_lr(s.lr);
  w.set_beta1(s.beta1);
  w.set_beta2(s.beta2);
  w.set_eps(s.eps);
  w.set_weight_decay(s.weight_decay);
  for (NoDecay g : s.no_decay) w.add_no_decay(ToWire<v1::NoDecay>(g));
  w.set_state_dtype(ToWire<v1::MomentForm>(s.state_dtype));
}
absl::Status OptimizerFromWire(const v1::JobConfig::Optimizer& w, OptimizerSection& s) {
  s.lr = w.lr();
  s.beta1 = w.beta1();
  s.beta2 = w.beta2();
  s.eps = w.eps();
  s.weight_decay = w.weight_decay();
  s.no_decay.clear();
  for (int g : w.no_decay()) {
    RETURN_IF_ERROR(FromWire(g, NoDecay::kBias, "optimizer.no_decay", s.no_decay.emplace_back()));
  }
  return FromWire(w.state_dtype(), MomentForm::kInt8, "optimizer.state_dtype", s.state_dtype);
}

void ScheduleToWire(const ScheduleSection& s, v1::JobConfig::Schedule& w) {
  w.set_kind(ToWire<v1::ScheduleKind>(s.kind));
  w.set_warmup_steps(s.warmup_steps);
  w.set_min_lr(s.min_lr);
}
absl::Status ScheduleFromWire(const v1::JobConfig::Schedule& w, ScheduleSection& s) {
  s.warmup_steps = w.warmup_steps();
  s.min_lr = w.min_lr();
  return FromWire(w.kind(), ScheduleKind::kCosine, "schedule.kind", s.kind);
}

void RuntimeToWire(const RuntimeSection& s, v1::JobConfig::Runtime& w) {
  w.set_backend(ToWire<v1::Backend>(s.backend));
  w.set_workers(s.workers);
  w.set_chunk_bytes(s.chunk_bytes);
  w.set_chunk_bytes_auto(s.chunk_bytes_auto);
  w.set_param_delivery(ToWire<v1::ParamDelivery>(s.param_delivery));
  w.set_grad_reduction(ToWire<v1::GradReduction>(s.grad_reduction));
  w.set_param_delivery_auto(s.param_delivery_auto);
  w.set_grad_reduction_auto(s.grad_reduction_auto);
  w.set_grad_staging(StagingToWire(s.grad_staging));
  w.set_grad_dtype(ToWire<v1::Dtype>(s.grad_dtype));
  w.set_param_source(ToWire<v1::ParamSource>(s.param_source));
  w.set_cast_on(ToWire<v1::CastOn>(s.cast_on));
  w.set_gpu_memory_limit_bytes(s.gpu_memory_limit_bytes);
  w.set_gpu_memory_limit_fraction(s.gpu_memory_limit_fraction);
  w.set_policy_auto(s.policy_auto);
  w.set_policy_file(s.policy_file);
  if (s.layer_layout) *w.mutable_layer_layout() = LayoutToWire(*s.layer_layout);
  w.set_cast_threads(s.cast_threads);
  w.set_act_policy(ToWire<v1::ActivationPolicy>(s.act_policy));
  w.set_norm_weights(ToWire<v1::Dtype>(s.norm_weights));
  w.set_embedding_rows(ToWire<v1::Dtype>(s.embedding_rows));
  w.set_deterministic(s.deterministic);
  w.set_offload_ratio(s.offload_ratio);
  w.set_checkpoint_dtype(ToWire<v1::Dtype>(s.checkpoint_dtype));
  w.set_tile_tokens(s.tile_tokens);
  w.set_speculation_bytes(s.speculation_bytes);
  w.set_copy_priority(s.copy_priority);
  w.set_ring_slots(s.ring_slots);
  w.set_context_parallel(s.context_parallel);
  w.set_step_timeout_ms(s.step_timeout_ms);
  w.set_max_restarts(s.max_restarts);
  for (const std::string& n : s.nodes) w.add_nodes(n);
  w.set_node_state(ToWire<v1::NodeState>(s.node_state));
}

absl::Status RuntimeFromWire(const v1::JobConfig::Runtime& w, RuntimeSection& s) {
  RETURN_IF_ERROR(FromWire(w.backend(), Backend::kCpu, "runtime.backend", s.backend));
  s.workers = w.workers();
  s.chunk_bytes = w.chunk_bytes();
  s.chunk_bytes_auto = w.chunk_bytes_auto();
  RETURN_IF_ERROR(FromWire(w.param_delivery(), ParamDelivery::kSharded, "runtime.param_delivery", s.param_delivery));
  RETURN_IF_ERROR(FromWire(w.grad_reduction(), GradReduction::kCpu, "runtime.grad_reduction", s.grad_reduction));
  s.param_delivery_auto = w.param_delivery_auto();
  s.grad_reduction_auto = w.grad_reduction_auto();
  RETURN_IF_ERROR(StagingFromWire(w.grad_staging(), s.grad_staging));
  RETURN_IF_ERROR(FromWire(w.grad_dtype(), Dtype::kBF16, "runtime.grad_dtype", s.grad_dtype));
  RETURN_IF_ERROR(FromWire(w.param_source(), ParamSource::kMaster, "runtime.param_source", s.param_source));
  RETURN_IF_ERROR(FromWire(w.cast_on(), CastOn::kHost, "runtime.cast_on", s.cast_on));
  s.gpu_memory_limit_bytes = w.gpu_memory_limit_bytes();
  s.gpu_memory_limit_fraction = w.gpu_memory_limit_fraction();
  s.policy_auto = w.policy_auto();
  s.policy_file = w.policy_file();
  s.layer_layout.reset();
  if (w.has_layer_layout()) {
    ASSIGN_OR_RETURN(s.layer_layout, LayoutFromWire(w.layer_layout()));
  }
  s.cast_threads = w.cast_threads();
  RETURN_IF_ERROR(FromWire(w.act_policy(), ActivationPolicy::kAuto, "runtime.act_policy", s.act_policy));
  RETURN_IF_ERROR(FromWire(w.norm_weights(), Dtype::kBF16, "runtime.norm_weights", s.norm_weights));
  RETURN_IF_ERROR(FromWire(w.embedding_rows(), Dtype::kBF16, "runtime.embedding_rows", s.embedding_rows));
  s.deterministic = w.deterministic();
  s.offload_ratio = w.offload_ratio();
  RETURN_IF_ERROR(FromWire(w.checkpoint_dtype(), Dtype::kBF16, "runtime.checkpoint_dtype", s.checkpoint_dtype));
  s.tile_tokens = w.tile_tokens();
  s.speculation_bytes = w.speculation_bytes();
  s.copy_priority = w.copy_priority();
  s.ring_slots = w.ring_slots();
  s.context_parallel = w.context_parallel();
  s.step_timeout_ms = w.step_timeout_ms();
  s.max_restarts = w.max_restarts();
  s.nodes.assign(w.nodes().begin(), w.nodes().end());
  RETURN_IF_ERROR(FromWire(w.node_state(), NodeState::kSharded, "runtime.node_state", s.node_state));
  return absl::OkStatus();
}

}  // namespace

v1::JobConfig JobConfigOf(const JobSpec& spec) {
  v1::JobConfig c;
  c.set_name(spec.name);
  ModelToWire(spec.model, *c.mutable_model());
  DataToWire(spec.data, *c.mutable_data());
  OutputToWire(spec.output, *c.mutable_output());
  TrainToWire(spec.train, *c.mutable_train());
  OptimizerToWire(spec.optimizer, *c.mutable_optimizer());
  ScheduleToWire(spec.schedule, *c.mutable_schedule());
  RuntimeToWire(spec.runtime, *c.mutable_runtime());
  return c;
}

absl::StatusOr<JobSpec> JobSpecOf(const v1::JobConfig& c) {
  if (!c.has_model() || !c.has_data() || !c.has_output() || !c.has_train() || !c.has_optimizer() || !c.has_schedule() ||
      !c.has_runtime()) {
    return absl::InvalidArgumentError("job config: a section is missing (a hostd of another version?)");
  }
  JobSpec spec;
  spec.name = c.name();
  ModelFromWire(c.model(), spec.model);
  DataFromWire(c.data(), spec.data);
  RETURN_IF_ERROR(OutputFromWire(c.output(), spec.output));
  TrainFromWire(c.train(), spec.train);
  RETURN_IF_ERROR(OptimizerFromWire(c.optimizer(), spec.optimizer));
  RETURN_IF_ERROR(ScheduleFromWire(c.schedule(), spec.schedule));
  RETURN_IF_ERROR(RuntimeFromWire(c.runtime(), spec.runtime));
  return spec;
}

}  // namespace slidedp
