// A per-layer activation layout (issue 22, Elastic Checkpointing): what each decoder layer keeps
// from its forward for its backward, and whether its checkpoint waits in host memory. A job gets
// one from a policy file (runtime.policy: FILE, YAML a user can read and edit, written by
// LayerLayout::ToYaml) and runs it as given; every layout gives the parameters of whole-layer
// recompute bit for bit (the CPU backend's test), since a policy changes what is kept, never what
// is computed.
//
// The file names the model shape it was made for (the sizes that decide the layers' memory and
// time), and may name a device and a batch: a layout is refused for another shape
// (FAILED_PRECONDITION naming the field), another device, or a malformed file (INVALID_ARGUMENT
// naming the key).
//
//   # slidedp activation policy
//   version: 1
//   model: {hidden_size: 2560, num_hidden_layers: 36, num_attention_heads: 32,
//           num_key_value_heads: 8, head_dim: 128, intermediate_size: 9728, vocab_size: 151936}
//   device: NVIDIA H200          # optional: the device it was measured on
//   tokens_per_step: 65536       # optional: the batch it was chosen for (informative)
//   layers:                      # one per decoder layer, the first layer first
//     - {kind: recompute, offload: true}     # offload: true (all), false, or a share in [0, 1]
//     - {kind: selective}
//     - {kind: segment, keep: [qkv, gate_up]}
//     - {kind: keep_all}
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/policy/layer_pieces.h"
#include "yaml-cpp/yaml.h"

namespace slidedp {

// What a decoder layer keeps beyond its input (the checkpoint every layer keeps), in the pieces of
// common/policy/layer_pieces.h:
//   kRecompute: nothing; backward recomputes the layer's forward;
//   kSelective: the attention output and its log-sum-exp (the attention piece);
//   kSegment:   the expensive pieces in `keep` (qkv, attention, o_proj, gate_up); backward
//               recomputes the rest between them;
//   kKeepAll:   every intermediate its backward reads.
enum class LayerKind { kRecompute, kSelective, kSegment, kKeepAll };
const char* LayerKindName(LayerKind k);

struct LayerPolicy {
  LayerKind kind = LayerKind::kRecompute;
  // The share r in [0, 1] of the layer's checkpoints (one per micro-batch: its input and what it
  // keeps) that waits in pinned host memory between the passes: the first round(r x micro-batches)
  // of them, at least one when r > 0 (worker/pipeline/activation_store.h). YAML: a number, or
  // true (1) / false (0).
  double offload = 0;
  uint32_t keep = 0;  // kSegment: the expensive pieces kept (LayerPiece bits); 0 otherwise
  // The pieces the layer keeps (kAllPieces for keep_all).
  uint32_t pieces() const;
  bool operator==(const LayerPolicy& o) const { return kind == o.kind && offload == o.offload && keep == o.keep; }
};
// "segment(qkv+gate_up)+offload", "keep_all+offload(0.25)", "keep_all", ...
std::string LayerPolicyName(const LayerPolicy& p);

// The model sizes a layout depends on, and its family (whose layer does different work).
struct ModelShape {
  std::string model_type = "qwen3";  // a policy file without one was made for qwen3
  int64_t hidden_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  // qwen3_moe (0 for a dense model): what a sparse layer's MoE block keeps depends on them. Not
  // part of a policy file's shape (kShapeFields); compared by operator==.
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  static ModelShape Of(const ModelConfig& c);
  bool operator==(const ModelShape& o) const;
  // Whether the layers keep the pieces a policy names: not qwen3_5's (qwen3_5, qwen3_5_moe), whose
  // Gated DeltaNet and gated attention layers keep nothing under any policy on either backend
  // (worker/compute/cuda/cuda_qwen3_5_layer.cc, the CPU backend's DecoderForward), nor gemma3's and
  // gemma4's (sandwich norms; the CUDA backend's LayersKeepNothing): backward recomputes each from
  // its input, so every policy runs as recompute there.
  bool layers_keep_pieces() const;
};

// Elements per token a layer keeps beyond its input for `pieces`: what the CPU backend keeps (each
// in FP32: the most any backend keeps; the CUDA backend keeps most in BF16) and admission counts.
// In a MoE model kPieceGateUp counts the larger of a dense layer's gate/up and a sparse layer's
// MoE block (probabilities, routing, its experts' gate/up and outputs for each of the k slots).
// 0 for every piece where the layers keep none (ModelShape::layers_keep_pieces).
int64_t KeptElementsPerToken(const ModelShape& shape, uint32_t pieces);

// Bytes per token the CUDA backend keeps beyond a layer's input for `pieces` (its layout of
// CudaSaved): q/k/v, the attention output, gate/up and the cheap pieces in BF16, the log-sum-exp and
// the norms' rsqrt in FP32, h1 in the residual stream's `residual_bytes` (4: FP32, the default).
// Admission counts offloaded checkpoints of CUDA workers of a dense model with it. 0 for every piece
// where the layers keep none (ModelShape::layers_keep_pieces).
int64_t CudaKeptBytesPerToken(const ModelShape& shape, uint32_t pieces, int64_t residual_bytes = 4);

// What AutoPolicy measured and solved (common/policy/layout_solver.h has the step model).
struct LayerCandidate {
  LayerPolicy policy;
  double time_s = 0;         // the candidate's forward + backward time for one layer (recompute included)
  int64_t device_bytes = 0;  // what one such layer keeps on the device from its forward to its backward
  int64_t host_bytes = 0;    // pinned host memory it takes (an offloaded checkpoint)
  int64_t h2d_bytes = 0;     // what it adds to the step's host-to-device copies
  int64_t d2h_bytes = 0;     // and to the device-to-host copies
  // Device bytes its moving checkpoints take on top of the kept ones (a layer's going out while
  // the next computes, one coming back ahead of its backward), counted once per layout: the most
  // of any candidate it uses.
  int64_t in_flight_bytes = 0;
  double forward_s = 0;  // of time_s, the forward's (0: not measured; the copies' pace is then not checked)
};

// The step's costs that no layout changes, measured on the running pipeline (seconds of busy time
// per step), and the copy rates the layers' own traffic moves at.
struct StepBase {
  double compute_s = 0;        // C0: the embedding, the head, and what the layers' probes leave out
  double h2d_s = 0;            // H0: parameter uploads
  double d2h_s = 0;            // D0: gradient downloads
  double host_s = 0;           // A: the host's update time (LayerAdam) per step
  double exposed_s = 0;        // E: what no overlap hides (the first unit's load, the flush)
  double h2d_bytes_per_s = 0;  // the layers' copies; 0: they cost no time (a backend without PCIe)
  double d2h_bytes_per_s = 0;
};

struct PolicyProblem {
  std::vector<LayerCandidate> candidates;
  int64_t layers = 0;
  int64_t device_budget_bytes = 0;  // for what the layers keep (the working set is outside it)
  int64_t host_budget_bytes = -1;   // pinned host memory for offloaded checkpoints; -1: no bound
  StepBase base;
};

// A layout's predicted step: each resource's busy time, the step, and which resource bounds it.
struct LayoutSolution {
  std::vector<int64_t> counts;  // per candidate
  double compute_s = 0, h2d_s = 0, d2h_s = 0, host_s = 0;
  double step_s = 0;  // max of the four + exposed
  int64_t device_bytes = 0, host_bytes = 0;
  std::string bottleneck;  // "GPU compute", "host-to-device copies", "device-to-host copies", "host updates"
};

// A layout AutoPolicy chose carries what it measured, so `slidedp plan` can predict from it and a
// reader sees why (the `autopolicy:` section of a policy file; a hand-written file has none).
struct AutoPolicyRecord {
  std::string build;               // the worker build that measured it
  int64_t working_set_bytes = 0;   // device bytes outside the layers' kept activations
  int64_t capacity_bytes = 0;      // the device memory (or runtime.gpu_memory_limit) it was chosen for
  double selection_s = 0;          // probes and solve
  PolicyProblem problem;
  LayoutSolution predicted;
};

inline constexpr uint64_t kMaxPolicyFileBytes = 1ull << 20;
inline constexpr int64_t kMaxPolicyLayers = 4096;

struct LayerLayout {
  ModelShape model;
  std::string device;           // empty: any device
  int64_t tokens_per_step = 0;  // 0: not said
  std::vector<LayerPolicy> layers;
  std::optional<AutoPolicyRecord> autopolicy;  // a layout AutoPolicy chose: its measurements

  // The YAML text of a policy file; `what` names it in errors (the path, or "runtime.policy").
  static absl::StatusOr<LayerLayout> Parse(const std::string& text, const std::string& what);
  // The same from a parsed node (a spec's inline runtime.layer_policy): read in place, never
  // re-emitted, so aliases in hostile YAML are never expanded.
  static absl::StatusOr<LayerLayout> FromNode(const YAML::Node& root, const std::string& what);
  // Reads and parses a policy file (bounded, regular files only: common/io/small_file.h).
  static absl::StatusOr<LayerLayout> Load(const std::string& path);
  std::string ToYaml() const;
  // FAILED_PRECONDITION naming the first size that differs from `config`, or the layer count.
  absl::Status CheckModel(const ModelConfig& config) const;
  // FAILED_PRECONDITION when the layout names a device other than `device_name`.
  absl::Status CheckDevice(const std::string& device_name) const;
  bool operator==(const LayerLayout& o) const;
};

}  // namespace slidedp
