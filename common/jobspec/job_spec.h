// The job spec users write (YAML or JSON), parsed strictly: unknown keys, wrong types, bad
// values and missing files are INVALID_ARGUMENT errors naming the key path ("train.seq_len").
// The resolved spec (defaults filled in, paths absolute) is echoed back as YAML.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/numeric/dtype.h"
#include "common/policy/layer_policy.h"

namespace slidedp {

enum class ScheduleKind { kConstant, kLinear, kCosine };
enum class ParamDelivery { kReplicated, kSharded };
// runtime.node_state (a job over nodes): every node holds the whole host state, or its range of every
// unit (common/model/node_shard.h).
enum class NodeState { kReplicated, kSharded };
enum class GradReduction { kGpu, kCpu };
// Where a step's gradients wait for the global norm when clipping (runtime.grad_staging).
enum class GradStaging { kAuto, kDevice, kHost };
// kAuto: recompute on the first step, then keep every activation of as many of the last layers
// as the device memory left over from that step's peak allows.
enum class ActivationPolicy { kKeepAll, kRecomputeLayer, kSelective, kAuto };
enum class Backend { kAuto, kCuda, kCpu };
// Tensor groups AdamW's weight decay leaves alone (optimizer.no_decay), as HF's Trainer does by
// default: norm weights (input/post-attention/q/k norms, the final norm) and biases
// (hostd/update/weight_decay.h says which names).
enum class NoDecay { kNorm, kBias };
// Where the workers' BF16 parameters come from (runtime.param_source): hostd's BF16 mirror, which
// every update writes next to the master (2 B/param of host state), or the FP32 master itself,
// cast to BF16 by each worker chunk by chunk at upload time (no mirror in the state; costs the
// workers' host threads and memory bandwidth when a unit is loaded). Both give the same bits.
enum class ParamSource { kMirror, kMaster };
// Where a CUDA worker casts the master to BF16 with param_source master (runtime.cast_on): on the
// GPU (the FP32 chunk crosses the host link, 4 B/param, and a kernel casts it into the slot: host
// memory traffic 4 B/param per upload, no host threads), or on the host (cast_threads threads cast
// into pinned BF16 staging, then 2 B/param cross the link: host traffic 8 B/param per upload).
// Both give the same bits. The CPU backend's device is the host: it casts there either way.
enum class CastOn { kDevice, kHost };

struct JobSpec;
// The job's model config: the preset's or model.path's config.json, with the spec's context
// override applied. hostd and the workers both build it this way.
absl::StatusOr<ModelConfig> ModelConfigOf(const JobSpec& spec);

// The spec's sections, as the YAML has them (docs/job-spec.md): `spec.train.seq_len` is
// `train.seq_len`.

// model: either a HF directory (config.json + *.safetensors) or a preset with random init.
struct ModelSection {
  std::string path;    // absolute after resolution
  std::string preset;  // "tiny", "qwen3-0.6b", ... (random init with init_seed)
  uint64_t init_seed = 0;
  // Fine-tuning to a longer context than the model's config says (ModelConfig::OverrideContext):
  // model.max_position_embeddings (0: the config's) and model.rope_scaling (HF's rope_scaling
  // object as JSON text; empty: the config's RoPE).
  int64_t max_position_embeddings = 0;
  std::string rope_scaling_json;
  // model.num_hidden_layers (presets only; 0: the preset's): a reduced-depth model of the preset's
  // shape, e.g. as many of Qwen3-30B-A3B's 48 layers as a host holds, for benchmarks.
  int64_t num_hidden_layers = 0;
};

struct DataSection {
  std::string path;  // dataset directory (docs/dataset-format.md)
  // data.validation: "auto" (a parsed spec's default: the dataset's validation split when there is
  // one: data.path ends in train/ and a sibling validation/ holds a dataset, as `slidedp prepare`
  // writes them), "none", or a dataset directory. After resolution: its absolute path, or "" for
  // none (a JobSpec made in code has none).
  std::string validation;
  // data.tokenizer_check: refuse (at submit) a dataset whose manifest names another tokenizer than
  // the model directory's (docs/dataset-format.md, "source"). false: train it anyway.
  bool tokenizer_check = true;
};

struct OutputSection {
  std::string dir;         // checkpoints, metrics.jsonl
  int64_t save_every = 0;  // steps; 0: only at the end
  int64_t keep_last = 2;
  Dtype save_dtype = Dtype::kBF16;
  bool save_final = true;
  // TensorBoard event files of the step metrics in <output.dir>/tensorboard/<job-id>/
  // (hostd/metrics/tensorboard_sink.h).
  bool tensorboard = false;
  // output.overwrite: an output.dir holding another run's checkpoints is refused at submit unless
  // this is set; then the job moves them aside (<output.dir>/superseded-<time>-<job>/) when it
  // starts. Nothing is deleted either way.
  bool overwrite = false;
};

struct TrainSection {
  int64_t seq_len = 0;
  int64_t global_batch = 0;  // rows (sequences of seq_len) per optimizer step, all ranks together
  int64_t micro_batch = 1;   // rows per micro-batch per rank
  int64_t steps = 0;         // optimizer steps; or epochs (exactly one of them > 0)
  double epochs = 0;
  uint64_t seed = 0;  // data order
  // Validation loss over the whole split every eval_every steps (0: only after the last step).
  int64_t eval_every = 0;
  double max_grad_norm = 1.0;  // 0 disables clipping
  // A step whose loss or gradient is not finite changes nothing and the job goes on (GradScaler's
  // skip: Adam's step count counts only applied updates, the LR schedule follows the global
  // step); off, such a step fails the job (DATA_LOSS naming the step, and the unit or rank).
  bool skip_nonfinite = false;
  // train.measure_only (runtime.policy auto): the job runs until AutoPolicy has chosen, validated
  // and cached its layout for this shape, then ends; it saves no checkpoint and runs no
  // validation (what `slidedp plan --measure` submits: PolicyMeasureSpec).
  bool measure_only = false;
  // MoE models: the router's load-balancing loss coefficient (docs/moe.md). < 0 (the key absent):
  // the model's router_aux_loss_coef when its config sets output_router_logits, else no aux loss,
  // as HF's Qwen3MoeForCausalLM; >= 0: this coefficient (0: none). Refused for a dense model.
  double router_aux_loss_coef = -1;
  double RouterAuxCoef(bool output_router_logits, double model_coef) const {
    return router_aux_loss_coef >= 0 ? router_aux_loss_coef : output_router_logits ? model_coef : 0.0;
  }
};

struct OptimizerSection {
  double lr = 1e-5;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  std::vector<NoDecay> no_decay = {NoDecay::kNorm, NoDecay::kBias};  // in this order, each once; {}: decay all
  // How the host keeps Adam's m and v (optimizer.state_dtype): fp32 (exact, the default), bf16 or
  // int8; the compact forms are approximations, opt-in: docs/optimizer-state.md has their layouts
  // and measured effect. The FP32 master weights stay exact either way.
  MomentForm state_dtype = MomentForm::kF32;
};

struct ScheduleSection {
  ScheduleKind kind = ScheduleKind::kConstant;
  int64_t warmup_steps = 0;
  double min_lr = 0.0;
};

struct RuntimeSection {
  Backend backend = Backend::kAuto;
  int32_t workers = 0;  // 0: all attached workers
  int64_t chunk_bytes = 64ll << 20;
  // runtime.chunk_bytes `auto`: among kAutoChunkBytes, the one whose measured step is shortest
  // (measured as the routes are: RouteVariants), else the default above.
  bool chunk_bytes_auto = false;
  ParamDelivery param_delivery = ParamDelivery::kReplicated;
  GradReduction grad_reduction = GradReduction::kGpu;
  // runtime.param_delivery / grad_reduction `auto`: hostd picks the route whose measured step is
  // shortest (each route's own `slidedp plan --measure --routes` job: RouteVariants), else the
  // defaults above; the fields then hold what was picked (ResolvedRoutes).
  bool param_delivery_auto = false;
  bool grad_reduction_auto = false;
  GradStaging grad_staging = GradStaging::kAuto;
  // The type a rank's reduced gradient crosses the host link in and LayerAdam reads
  // (runtime.grad_dtype). bf16 is an approximation (rounded to nearest even after the FP32
  // reduction; the norm, clipping and the non-finite checks see the rounded values), opt-in,
  // docs/layeradam.md "BF16 gradients" has its measured effect.
  Dtype grad_dtype = Dtype::kF32;
  ParamSource param_source = ParamSource::kMirror;
  CastOn cast_on = CastOn::kDevice;
  // runtime.gpu_memory_limit: the device memory a worker may use, in bytes or as a fraction of its
  // device's (one of the two is set; both 0: no limit). GpuMemoryLimitBytes resolves it.
  int64_t gpu_memory_limit_bytes = 0;
  double gpu_memory_limit_fraction = 0;
  // runtime.policy: "fixed" (act_policy and offload_ratio as given; the default), "auto" (AutoPolicy,
  // worker/pipeline/auto_policy.h: measured and solved on the job's first step, or the layout hostd
  // cached for the same shape, batch, device and build) or a policy file
  // (common/policy/layer_policy.h), absolute after resolution. Parsing with FileCheck::kCheck reads
  // the file into layer_layout, which ToYaml writes inline (runtime.layer_policy), so workers never
  // read the file themselves. A spec may also give runtime.layer_policy inline; it then wins over
  // act_policy and offload_ratio (and over auto: hostd sends a cached layout so).
  bool policy_auto = false;
  std::string policy_file;
  std::optional<LayerLayout> layer_layout;
  // Host threads per worker that cast the master to BF16 (param_source master, cast_on host); 0: auto.
  int32_t cast_threads = 0;
  ActivationPolicy act_policy = ActivationPolicy::kRecomputeLayer;
  // Which values of the norm weights the workers compute with (runtime.norm_weights): the FP32
  // master's (HF autocast's numerics) or the BF16 mirror's (FSDP2 with param_dtype bf16).
  Dtype norm_weights = Dtype::kF32;
  // Which values of the embedding the lookup reads (runtime.embedding_rows): the FP32 master's rows
  // (HF autocast looks them up in FP32) or the BF16 mirror's. The tied LM head multiplies by the
  // BF16 table either way, as autocast casts it.
  Dtype embedding_rows = Dtype::kF32;
  // Bitwise-repeatable runs: the CUDA workers run the attention backward through kernels that add
  // dQ in a fixed order (slower; docs/kernels.md). The CPU backend always repeats bit for bit.
  bool deterministic = false;
  double offload_ratio = 0.0;  // fraction of layer checkpoints kept in pinned host memory
  // The type each decoder layer's input (its checkpoint) waits in between its forward and its
  // backward (runtime.checkpoint_dtype): FP32 (exact, the default), or BF16 (rounded to nearest even
  // once the layer's forward is done, widened back for its backward: half the bytes on the GPU and
  // in pinned host memory when offloaded). bf16 is an approximation, opt-in: the forward and the
  // loss see the exact inputs, the gradients the rounded ones. No effect where the activations are
  // BF16 already (the CUDA backend's BF16 residual stream).
  Dtype checkpoint_dtype = Dtype::kF32;
  // Tokens per tile of a decoder layer's token-local work and of the head's norm (long
  // sequences: ComputeBackend::SetTileTokens); 0: auto (kDefaultTileTokens, 32768).
  int64_t tile_tokens = 0;
  // Speculative clipping (docs/layeradam.md): the most host memory for the undo copies of units
  // updated before the step's norm is known (12 B/param). -1: auto (what the host has left after
  // the job's plan, up to the whole model); 0: off (updates wait for the norm).
  int64_t speculation_bytes = -1;
  // DMA before Adam (docs/layeradam.md): the fraction of each NUMA node's LayerAdam workers that
  // pause while a parameter copy the GPU waits for is in flight (CUDA workers mark such copies);
  // 0: off (LayerAdam and the copies share the host's memory bandwidth as they come), the default
  // until the measurements favour a setting (docs/layeradam.md, "DMA before Adam, measured").
  double copy_priority = 0.0;
  int32_t ring_slots = 4;
  // Context parallelism (issue 26): the ranks one micro-batch's tokens are split over (zig-zag,
  // common/data/context_parallel.h); attention gathers the keys and values of the whole. 1: off.
  // runtime.workers is a multiple of it: groups of that many consecutive ranks, data-parallel
  // across the groups. CPU and CUDA workers (docs/context-parallel.md).
  int32_t context_parallel = 1;
  // A job over several nodes (issue 52, docs/multi-node.md): every node's hostd address, each
  // "HOST:PORT" (TCP, TLS) or "unix:PATH" (hostds on one machine); the hostd the job is submitted to
  // is one of them and coordinates. Each node runs runtime.workers ranks (required); replicated
  // state: every node holds it all. Empty: this node only.
  std::vector<std::string> nodes;
  // With nodes: replicated (every node holds the whole state) or sharded (node n holds 1/N of every
  // unit's master and moments; docs/multi-node.md).
  NodeState node_state = NodeState::kReplicated;
  int64_t step_timeout_ms = 600000;  // a gate or ring wait longer than this fails the job
  int32_t max_restarts = 0;          // automatic restarts from the last checkpoint on failure
};

struct JobSpec {
  std::string name = "job";
  ModelSection model;
  DataSection data;
  OutputSection output;
  TrainSection train;
  OptimizerSection optimizer;
  ScheduleSection schedule;
  RuntimeSection runtime;

  // Parses and validates. base_dir resolves relative paths. Checks that files exist when
  // check_files is kCheck.
  enum class FileCheck { kCheck, kSkip };
  // output.dir: resolved against base_dir like model.path and data.path (kBaseDir), or left as
  // written (kAsWritten; the default out/<name> too) for hostd, whose output-path policy
  // (hostd/core/output_policy.h) resolves it inside its output root.
  enum class OutputDirBase { kBaseDir, kAsWritten };
  static absl::StatusOr<JobSpec> Parse(absl::string_view yaml_text, const std::string& base_dir,
                                       FileCheck check_files = FileCheck::kCheck,
                                       OutputDirBase output_base = OutputDirBase::kBaseDir);
  // Resolved spec as YAML; Parse(ToYaml()) gives the same spec.
  std::string ToYaml() const;
};

// A job name: 1-kMaxJobNameBytes characters of [A-Za-z0-9._-], not starting with '.' or '-'
// (it names the default output directory and the job ids made from it). INVALID_ARGUMENT else.
inline constexpr size_t kMaxJobNameBytes = 48;
// runtime.nodes: at most this many nodes in one job.
inline constexpr size_t kMaxJobNodes = 64;
// A hostd address of runtime.nodes: "unix:" and an absolute path, or HOST:PORT (a DNS name or IPv4
// address, or [IPv6], and a port in 1-65535). INVALID_ARGUMENT names `path`.
absl::Status CheckNodeAddress(const std::string& address, const std::string& path);
// The smallest runtime.tile_tokens.
inline constexpr int64_t kMinTileTokens = 1;
// The largest job spec hostd parses (SubmitJobRequest.spec_yaml).
inline constexpr size_t kMaxSpecBytes = 1 << 20;
absl::Status ValidateJobName(const std::string& name);

// The longest path a client may give (the kernel's PATH_MAX).
inline constexpr size_t kMaxPathBytes = 4096;
// A path a client gives (a spec's paths, the spec's directory, a --resume checkpoint): 1 to
// kMaxPathBytes bytes of UTF-8 without control characters. A NUL would cut it at the kernel, a
// newline or an escape would forge lines in logs and terminals, and bytes that are not UTF-8
// cannot travel in the protocol's strings. INVALID_ARGUMENT naming `what`.
absl::Status CheckPathText(absl::string_view path, absl::string_view what);

// The offset of the first byte that is not part of well-formed UTF-8 (RFC 3629: no overlong forms,
// no surrogates, at most U+10FFFF), or text.size().
size_t FirstInvalidUtf8(absl::string_view text);

// Text fit for the protocol's strings and one log line (an error quoting a file's bytes or a
// symbolic link's target): bytes that are not UTF-8, and control characters but tab and newline,
// become '?'.
std::string PrintableUtf8(absl::string_view text);

// Text that came from a process hostd does not trust (a worker's failure message) made one
// bounded line for a job's error, its record and the log: PrintableUtf8, with newline, carriage
// return and tab as spaces (no forged log lines), cut at a character boundary to at most
// `max_bytes` followed by "... (N more bytes)".
std::string BoundedLine(absl::string_view text, size_t max_bytes);

// An identifier a client sent (a job id), quoted in an error: bytes outside printable ASCII as
// '?' and at most 80 of them ("..." after), so a reply cannot carry escapes to a terminal.
std::string ShownId(absl::string_view id);

// The job `slidedp plan --measure` runs for `spec` when nothing measured predicts it: the same
// model, batch and runtime settings (so AutoPolicy's record is cached under the key `spec` itself
// has with runtime.policy auto, and predicts the layout `spec` runs), with runtime.policy auto,
// train.measure_only, kPolicyMeasureSteps steps of a constant schedule, nothing saved, no
// validation, and the name "<name>-plan".
JobSpec PolicyMeasureSpec(const JobSpec& spec);
// The concrete routes a job of `spec` may run on `world` workers (`cuda`: all of them CUDA, where
// sharded delivery exists): every combination of the routes `spec` leaves to `auto`, or with
// `all` of every route (what `slidedp plan --measure --routes` measures), the given ones kept
// otherwise; and with runtime.chunk_bytes `auto` each of kAutoChunkBytes. The flags cleared. One
// worker has one route (what `auto` leaves is the default).
std::vector<JobSpec> RouteVariants(const JobSpec& spec, int world, bool cuda, bool all);
inline constexpr int64_t kAutoChunkBytes[] = {16ll << 20, 64ll << 20, 256ll << 20};
// "grad_reduction gpu, param_delivery replicated, chunk_bytes 67108864"
std::string RouteName(const JobSpec& spec);

// Enough steps for AutoPolicy's longer path (two warm-ups, then the measured third step: see
// worker/pipeline/auto_policy.h), its validation and two re-solves.
inline constexpr int64_t kPolicyMeasureSteps = 16;

const char* ToString(ScheduleKind k);
const char* ToString(ParamDelivery k);
const char* ToString(NodeState k);
const char* ToString(GradReduction k);
const char* ToString(GradStaging k);
const char* ToString(ActivationPolicy k);
const char* ToString(Backend k);
const char* ToString(ParamSource k);
const char* ToString(CastOn k);
const char* ToString(NoDecay k);

inline constexpr int64_t kMinGpuMemoryLimitBytes = 1ll << 20;
// runtime.gpu_memory_limit in bytes on a device of `device_bytes`; 0: no limit.
int64_t GpuMemoryLimitBytes(const JobSpec& spec, int64_t device_bytes);
// What a worker of that device may use: the limit, or the whole device without one.
int64_t GpuCapacityBytes(const JobSpec& spec, int64_t device_bytes);

}  // namespace slidedp
