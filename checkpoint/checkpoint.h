// Model and training checkpoints for the host state: loading HF Qwen3 checkpoints into the
// per-unit FP32 master arrays, the HF random initializer, and atomic save/resume of the full
// training state (master, Adam m and v, trainer state).
//
// On-disk layout of a saved checkpoint (HF-loadable with Qwen3ForCausalLM.from_pretrained):
//   <root>/checkpoint-<step>/
//     config.json                       HF config (torch_dtype = the weights' dtype)
//     model.safetensors                 weights, BF16 (RNE of master) or F32; tied models omit
//       or model-0000i-of-0000n.safetensors + model.safetensors.index.json  lm_head.weight
//     optimizer.safetensors             per unit u, numel = the unit's numel incl. padding:
//                                         "unit.<u>.master"  F32 [numel]
//                                         "unit.<u>.adam_m"  F32 | BF16 | I8 codes [numel]
//                                         "unit.<u>.adam_v"  F32 | BF16 | U8 codes [numel]
//                                       int8 also "unit.<u>.adam_m_scale", "unit.<u>.adam_v_scale"
//                                         F32 [ceil(numel / 256)], one per 256-element block;
//                                       __metadata__ "format", "layout" = the unit/tensor table,
//                                       "state_dtype" = "bf16" | "int8" (absent: fp32, so an fp32
//                                       job's file is byte for byte what it was before issue 21)
//     trainer_state.json                {"format", "step", "weights_dtype", "trainer_state": {...}}
//     tokenizer.json, tokenizer_config.json, ... (kModelDirFileNames: those the job's model.path
//                                       holds, copied; SaveRequest::model_files)
//     generation_config.json            the model's, or made from config.json's token ids
//     COMPLETE                          written last: {"step", "files": {name: bytes}}
// So a checkpoint directory is one transformers' AutoModelForCausalLM.from_pretrained and (when the
// job's model had tokenizer files) AutoTokenizer.from_pretrained load. ExportModel writes the same
// model directory without the optimizer state (`slidedp export`).
// The moments are stored as the job holds them (docs/optimizer-state.md, "Layouts and bytes" and
// "Checkpoints"); a load into a job of another state dtype converts with the kernels' encoders
// and decoders (common/moments/moments.h, the codec LayerAdam's compact-moment kernels step
// through).
//
// A save goes to <root>/.tmp-checkpoint-<step>-<pid>/ (every file fsynced, then the directory),
// is renamed into place and the root is fsynced. Only directories named checkpoint-<N> holding a
// COMPLETE whose file sizes match are ever considered; stale tmp directories of dead processes
// are removed by the next save. One save at a time per root directory (a save removes its own
// process's leftover tmp directories).
//
// Ownership (issue 48, "a user's results are never lost"): a checkpoint belongs to a run, the
// chain of jobs resumed one from another: trainer_state.json's "trainer_state" object holds the
// saving job's "job_id" and the run's "run_id" (absent in checkpoints saved before run ids: then
// the run is the job_id; absent both: the run is ""). A save writes, rotates (keep_last) and
// replaces only checkpoints of its own run; another run's are refused or, for
// output.overwrite, moved aside to <root>/superseded-<UTC time>-<job>/, never deleted. Only the
// root's direct children are checkpoints, so moved ones are out of every listing and resume.
//
// Throughput: files are pre-allocated and written by io_threads pwrite workers straight from the
// state arrays (master, moments in their own dtype, F32 weights) or through 16 MiB BF16
// conversion buffers. Measured 2026-11-29 on the 2-core dev VM under load (load average 7-9):
// 281M params (3.9 GB incl. optimizer) to tmpfs 1.0-2.5 GB/s; Qwen3-0.6B (8.3 GB) to its virtual
// disk with fsync 0.14 GB/s, where `dd conv=fsync` reached 0.04 GB/s at the same time:
// disk-bound. Measure on the target host with
// `ckpt_tool save-random ROOT --model qwen3-1.7b --threads 16 [--state-dtype int8]`.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "common/model/model_config.h"
#include "common/model/shard.h"
#include "common/numeric/dtype.h"
#include "common/safetensors/safetensors.h"
#include "nlohmann/json.hpp"

namespace slidedp::checkpoint {

// Returns the unit's flat FP32 array (layout.units[unit].numel floats).
using UnitArrayFn = std::function<float*(int unit)>;

// A checkpoint tensor the job does not train but keeps, bytes unchanged, in every checkpoint and
// export: a qwen3_5 checkpoint's vision tower (model.visual.*) and multi-token-prediction weights
// (mtp.*), a gemma3 one's vision tower and projector (model.vision_tower.*,
// model.multi_modal_projector.*; the hub's original vision_tower.*, multi_modal_projector.* and
// language_model.model.* are read under these, transformers' own names), a gemma4 one's vision and
// audio towers and their embedders (model.vision_tower.*, model.embed_vision.*, model.audio_tower.*,
// model.embed_audio.*) and any k_proj / v_proj / k_norm / v_norm of its kv-shared layers (which
// transformers ignores), so the output directory loads as the same transformers class the input did.
struct PassThroughTensor {
  std::string name;
  safetensors::Dtype dtype = safetensors::Dtype::kBF16;
  std::vector<int64_t> shape;
  std::string bytes;  // the tensor's data as the file held it
};
using PassThrough = std::vector<PassThroughTensor>;
// A model directory's config.json, with the experts' storage (ExpertStorage) its weights use: what
// a layout of the directory's tensors is built from. Errors of ModelConfig::FromFile and
// AdoptDirNaming (common/model/model_dir.h).
absl::StatusOr<ModelConfig> ModelConfigOfDir(const std::string& model_dir);

// Whether a checkpoint tensor the layout does not hold passes through for this model (above).
bool IsPassThroughName(const ModelConfig& config, absl::string_view name);
// The pass-through tensors of a saved checkpoint (or any model directory): read from its weight
// files, in name order. Those of LoadHfModel's errors that apply (NOT_FOUND, INVALID_ARGUMENT for a
// bad index, DATA_LOSS for a truncated file).
absl::StatusOr<PassThrough> ReadPassThrough(const std::string& model_dir, const ModelConfig& config);

struct LoadOptions {
  int threads = 0;  // tensors converted in parallel; 0 = hardware concurrency (at most 16)
  // Where the pass-through tensors go (IsPassThroughName); null: accepted and not kept.
  PassThrough* pass_through = nullptr;
  // LoadCheckpoint of a node's share of a sharded state (runtime.node_state sharded,
  // common/model/node_shard.h): unit u's arrays hold its elements [windows[u].offset, +numel) (element e
  // at index e - offset; offsets on 256-element blocks), and only those are read. Empty: whole units.
  std::vector<ShardRange> windows = {};
};

// Loads an HF Qwen3 model directory (config.json + model.safetensors, or shards listed in
// model.safetensors.index.json; the single file wins when both exist, as in HF) into the master arrays, converting
// BF16/F16/F32 to FP32 and zeroing the alignment padding between tensors. Every tensor of the layout must be present
// exactly once with its shape; a tied model's lm_head.weight may be absent (if present it is
// ignored, with a warning when it differs from the embedding). Errors:
//   NOT_FOUND         directory, config.json or a shard file missing
//   INVALID_ARGUMENT  config differs from the layout's, tensor missing/extra/duplicated/misshaped,
//                     bad index, lying safetensors header
//   DATA_LOSS         truncated file, or a weight that is NaN or infinite (naming the file, the
//                     tensor and the element); UNIMPLEMENTED  dtype other than BF16/F16/F32
absl::Status LoadHfModel(const std::string& model_dir, const ModelLayout& layout, const UnitArrayFn& master_of_unit,
                         const LoadOptions& options = {});

// HF Qwen3 initializer: Linear and Embedding weights ~ Normal(0, initializer_range), RMSNorm
// weights (input/post-attention/final norm, q_norm, k_norm) = 1 (0 where they act as 1 + w:
// qwen3_5, gemma3), gemma3's padding_idx embedding row = 0, padding = 0. Deterministic per
// (seed, tensor name), independent of the thread count. threads: 0 = hardware concurrency.
// `windows` (a node's share of a sharded state, LoadOptions::windows): unit u's array holds only its
// elements [offset, offset + numel), which get exactly the values the whole unit's would.
void InitRandom(const ModelLayout& layout, uint64_t seed, const UnitArrayFn& master_of_unit, int threads = 0,
                const std::vector<ShardRange>* windows = nullptr);

// HF's save_pretrained default max_shard_size ("5GB"): weights above it are sharded.
inline constexpr uint64_t kDefaultShardMaxBytes = 5'000'000'000;

// A file of a HF model directory besides config.json and the weights that transformers reads:
// the tokenizer's (AutoTokenizer) and generation_config.json (generate()'s defaults).
struct ModelDirFile {
  std::string name;  // one of kModelDirFileNames
  std::string content;
};
inline constexpr const char* kModelDirFileNames[] = {
    "tokenizer.json",  "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
    "merges.txt",      "added_tokens.json",     "chat_template.jinja",     "chat_template.json",
    "tokenizer.model", "generation_config.json"};
// Each file at most this (a 256K-token vocabulary's tokenizer.json is ~35 MB); all together at most
// kMaxModelDirFilesBytes.
inline constexpr uint64_t kMaxModelDirFileBytes = 64ull << 20;
inline constexpr uint64_t kMaxModelDirFilesBytes = 128ull << 20;

// Reads those of kModelDirFileNames that `model_dir` holds (a name that is absent, or a symbolic
// link to nothing, is skipped). A model path comes from a job spec, so hostile input: each file is
// opened without blocking and must be a regular file within the size caps; a symbolic link is
// followed only where it resolves inside model_dir, or, for a hub cache snapshot
// (<repo>/snapshots/<revision>), inside <repo>/blobs, where the hub keeps the files its links point
// to. INVALID_ARGUMENT naming the file otherwise (a FIFO, a device, a directory, too large, a link
// leaving the directory); NOT_FOUND when model_dir is not there.
absl::StatusOr<std::vector<ModelDirFile>> ReadModelDirFiles(const std::string& model_dir);

// generation_config.json text from config.json text: its bos/eos/pad token ids (those it has),
// marked "_from_model_config" as transformers' GenerationConfig.from_model_config does. Used when
// the model directory has none (a preset, or a model without one).
std::string GenerationConfigFromConfig(const std::string& config_json);

// One unit's Adam moments where the job keeps them, in the job's state dtype (numel = the unit's
// numel; docs/optimizer-state.md, "Layouts and bytes"):
//   fp32: m, v float[numel];  bf16: m, v bf16_t[numel];
//   int8: m int8_t codes, v uint8_t codes [numel], m_scale and v_scale float[Int8MomentBlocks(numel)].
// Pointers a dtype does not use are ignored.
struct UnitMoments {
  void* m = nullptr;
  void* v = nullptr;
  float* m_scale = nullptr;
  float* v_scale = nullptr;
};
using UnitMomentsFn = std::function<UnitMoments(int unit)>;

// The state a checkpoint saves and restores: the FP32 master and the moments per unit.
struct StateArrays {
  UnitArrayFn master;
  MomentForm moment_form = MomentForm::kF32;
  UnitMomentsFn moments;
};

// FP32 moments from two per-unit float arrays (tests, tools, callers with plain vectors).
UnitMomentsFn Fp32Moments(UnitArrayFn adam_m, UnitArrayFn adam_v);

// A node's share of a sharded state (runtime.node_state sharded, common/model/node_shard.h): unit u's
// arrays hold its elements from held[u] on (element e at index e - held[u]), and this node writes
// elements [write[u].offset, +numel) of every file. The nodes write their shares into the same files
// (the coordinator's SaveCheckpoint creates them, the others' WriteCheckpointShare fills them), so the
// checkpoint is byte for byte the one a single node holding the whole state saves.
struct NodeShare {
  std::vector<int64_t> held;
  std::vector<ShardRange> write;
  bool writes_pass_through = false;  // the coordinator's: the pass-through tensors too
};

struct SaveRequest {
  std::string root_dir;
  int64_t step = 0;
  const ModelLayout* layout = nullptr;
  StateArrays arrays;  // read only; must not change while the save runs
  // Anything the trainer needs for exact resume: data position (epoch, index), RNG seeds,
  // schedule position, job spec text... Must be a JSON object (or null).
  nlohmann::json trainer_state = nlohmann::json::object();
  Dtype weight_dtype = Dtype::kBF16;
  // > 0: keep only the newest N complete checkpoints of this run (trainer_state's run_id, else its
  // job_id; see RunIdOf): another run's are never removed.
  int64_t keep_last = 0;
  uint64_t shard_max_bytes = kDefaultShardMaxBytes;  // weights above this are sharded
  int io_threads = 8;                                // pwrite/convert workers per file
  // The model's pass-through tensors (PassThrough), written with the weights; null: none.
  const PassThrough* pass_through = nullptr;
  // Tokenizer files and generation_config.json of the job's model (ReadModelDirFiles, read once
  // when the job starts), written into the checkpoint; null or without generation_config.json: one
  // is made from config.json. Must outlive the save.
  const std::vector<ModelDirFile>* model_files = nullptr;
  // Test-only fault injection: called with "config.json", "model", "optimizer.safetensors",
  // "trainer_state.json", "model_files", "COMPLETE", "rename" just before that stage; a non-OK status aborts
  // the save there (as a crash would), and the hook may also kill the process.
  std::function<absl::Status(const std::string& stage)> fault_hook;
  // A sharded state: this node's share (null: the arrays hold every unit whole). With it,
  // SaveCheckpoint (the coordinator) calls other_nodes(tmp directory) once the weight and optimizer
  // files exist with its share written, and goes on (trainer_state.json, COMPLETE, the rename) only
  // when it returns OK: every other node has written its share there (WriteCheckpointShare).
  const NodeShare* share = nullptr;
  std::function<absl::Status(const std::string& tmp_dir)> other_nodes;
};

struct SaveResult {
  std::string dir;  // <root>/checkpoint-<step>
  uint64_t bytes_written = 0;
  double seconds = 0;                // wall time including fsyncs
  std::vector<std::string> removed;  // old checkpoints removed by keep_last
};

// Saves atomically (see the file comment). Disk full is RESOURCE_EXHAUSTED with the bytes needed
// and free, checked before writing; previous checkpoints are never touched by a failed save.
// Saving a step that already exists replaces it atomically (renameat2 RENAME_EXCHANGE) when it is
// this run's (its run id, read as ListCheckpoints does, equals RunIdOf(trainer_state)); when it is
// another run's, or names no run while this save does, or is not a directory, the save is
// FAILED_PRECONDITION naming the directory and its job, checked before writing and again after
// the exchange (swapped back), so it is left as it was and the temporary directory removed.
absl::StatusOr<SaveResult> SaveCheckpoint(const SaveRequest& request);

// Another node's part of a sharded save: writes request.share into the weight and optimizer files the
// coordinator's SaveCheckpoint created in tmp_dir (request as the coordinator's but for share; root_dir,
// model_files and the hooks unused). Returns the bytes written. FAILED_PRECONDITION when the files
// there are not the ones this node plans (another layout, dtype or step).
absl::StatusOr<uint64_t> WriteCheckpointShare(const SaveRequest& request, const std::string& tmp_dir);

// The run a SaveRequest::trainer_state (or a checkpoint's "trainer_state" object) belongs to: its
// "run_id", else its "job_id", else "" (strings only).
std::string RunIdOf(const nlohmann::json& trainer_state);

// A direct child of a root named checkpoint-<N>, and who saved it, as ListCheckpoints sees it.
struct CheckpointEntry {
  std::string dir;  // <root>/checkpoint-<N>
  int64_t step = 0;
  std::string job_id;  // trainer_state.json's; "" when it is unreadable or names none
  std::string run_id;  // its run_id, else job_id
  // A directory (not a symbolic link) holding a regular COMPLETE and a trainer_state.json of
  // this format and step. Sizes and safetensors headers are NOT checked (VerifyCheckpoint does).
  bool complete = false;
};

// Bounds of ListCheckpoints on a directory a client may have filled: the root's entries read,
// its checkpoint-<N> entries examined, the bytes of one trainer_state.json (what a save may
// write: a job spec is at most 1 MiB) and of all of them. Beyond a count bound the listing is
// FAILED_PRECONDITION; a trainer_state.json above its bound is listed incomplete, without owner.
inline constexpr size_t kMaxListedDirEntries = 65536;
inline constexpr size_t kMaxListedCheckpoints = 4096;
inline constexpr uint64_t kMaxListedStateBytes = 4ull << 20;
inline constexpr uint64_t kMaxListedStateTotalBytes = 256ull << 20;

// The root's checkpoint-<N> entries, newest step first, each with its owner (job_id, run_id) and
// whether it looks complete. Cheap enough for a request handler: reads only each entry's
// COMPLETE (its type) and trainer_state.json (bounded), never a weights file. Hostile contents:
// an entry is opened relative to the root without following a symbolic link (a link, a file,
// FIFO or anything else named checkpoint-<N> is listed, incomplete, without owner), files must be
// regular. NOT_FOUND when root is not there (an empty list when it is empty); FAILED_PRECONDITION
// naming the bound when it holds more entries than the bounds allow.
absl::StatusOr<std::vector<CheckpointEntry>> ListCheckpoints(const std::string& root);

// The newest complete checkpoint directory under root (COMPLETE present, listed file sizes match,
// safetensors headers valid, trainer_state.json parses). NOT_FOUND when there is none. Only the
// root's direct children named checkpoint-<N> that are directories, not symbolic links.
// With `job_id`: only checkpoints that job saved (trainer_state.json "job_id"), so two jobs that
// share an output directory never resume from each other's state.
absl::StatusOr<std::string> FindLatestCheckpoint(const std::string& root_dir, const std::string& job_id = "");

// As FindLatestCheckpoint, only checkpoints of run `run_id` (RunIdOf their trainer_state: a
// checkpoint without run_id belongs to the run named by its job_id).
absl::StatusOr<std::string> FindLatestCheckpointOfRun(const std::string& root_dir, const std::string& run_id);

// The job id a complete checkpoint was saved by (its trainer_state.json).
absl::StatusOr<std::string> CheckpointJobId(const std::string& dir);

// The run a checkpoint belongs to (RunIdOf its trainer_state: run_id, else job_id); DATA_LOSS
// when trainer_state.json names neither. A job resumed from the checkpoint inherits it.
absl::StatusOr<std::string> CheckpointRunId(const std::string& dir);

// Where MoveCheckpointsAside put the checkpoints.
struct MovedAside {
  std::string dir;                                         // <root>/superseded-<yyyymmddThhmmssZ>-<job_id>
  std::vector<std::pair<std::string, std::string>> moved;  // (from, to), in the order moved
};

// output.overwrite: moves `dirs` (each a direct child <root>/checkpoint-<N>, e.g.
// ListCheckpoints' entries of other runs; any type of entry, a link is moved, not followed) into
// a new <root>/superseded-<UTC yyyymmddThhmmssZ>-<job_id>[-<k>]/, each by one rename on the root's
// file system; then fsyncs. Never deletes, never overwrites. INVALID_ARGUMENT for a path that is
// not such a child or a job_id that is not [A-Za-z0-9_-]; an entry gone meanwhile is skipped; on a
// failed rename the error names what was moved already (and where) and nothing is moved back.
// An empty `dirs` creates nothing.
absl::StatusOr<MovedAside> MoveCheckpointsAside(const std::string& root, const std::vector<std::string>& dirs,
                                                const std::string& job_id);

// Verifies one checkpoint directory as FindLatestCheckpoint does; returns its step.
absl::StatusOr<int64_t> VerifyCheckpoint(const std::string& dir);

struct LoadedCheckpoint {
  int64_t step = 0;
  nlohmann::json trainer_state;                      // exactly what SaveRequest::trainer_state held
  MomentForm saved_moment_form = MomentForm::kF32;  // how the file keeps m and v
  // Non-empty when the moments were converted to the arrays' dtype: one line for the job log,
  // e.g. "optimizer state converted from fp32 to int8 (block-quantized moments: an approximation)".
  std::string conversion_note;
};

// Restores master, m and v from optimizer.safetensors (the weights files are not read).
// Moments saved in arrays.moment_form are restored bit for bit; others are converted in pieces
// of whole 256-element blocks over the threads (bounded memory): FP32 -> bf16/int8 with the
// kernels' encoders, bf16/int8 -> FP32 with their decoders, bf16 <-> int8 through FP32 (what
// conversion_note then says). Errors:
//   FAILED_PRECONDITION  the layout differs from the saved one (config or any unit's size);
//                        converted moments the job's dtype cannot hold (an infinite v or an m
//                        beyond the BF16 range)
//   DATA_LOSS            naming the file, the tensor and the element (or int8 block): master or m
//                        NaN or infinite, v NaN or negative, an int8 scale NaN, infinite or
//                        negative, an m code of -128; a moment or scale tensor missing or of the
//                        wrong dtype or shape; a state_dtype that is not fp32/bf16/int8 or that
//                        the tensors contradict
// Every structural check happens before anything is written. A value check fails after some
// pieces have landed: on any error the arrays hold a mix and the caller must not train on them.
absl::StatusOr<LoadedCheckpoint> LoadCheckpoint(const std::string& dir, const ModelLayout& layout,
                                                const StateArrays& arrays, const LoadOptions& options = {});

// `slidedp export`: the model directory of a checkpoint without its optimizer state.
struct ExportRequest {
  // A checkpoint-<N> directory, or a directory holding checkpoints (then the newest complete one
  // of its one run, or of `run`).
  std::string checkpoint;
  // A job id or run id: the checkpoints of that job or run (--job). Empty: a directory holding
  // complete checkpoints of several runs is refused.
  std::string run;
  std::string out_dir;
  std::optional<Dtype> dtype;  // unset: the checkpoint's own (trainer_state.json weights_dtype)
  uint64_t shard_max_bytes = kDefaultShardMaxBytes;
  // An out_dir that exists and is not empty: refused, or replaced when it is a model directory
  // (holds a config.json) other than the checkpoint or a directory holding it.
  enum class Existing { kRefuse, kReplace };
  Existing existing = Existing::kRefuse;
  int io_threads = 8;
};

struct ExportResult {
  std::string checkpoint;  // the checkpoint-<N> directory exported
  int64_t step = 0;
  std::string dir;                 // out_dir, absolute
  std::vector<std::string> files;  // written, sorted
  uint64_t bytes_written = 0;
  Dtype dtype = Dtype::kBF16;
  bool replaced = false;  // out_dir existed and was replaced
};

// Writes out_dir: config.json, the weights from the FP32 master in optimizer.safetensors (BF16 by
// round to nearest even, as a checkpoint's own model.safetensors, or F32; sharded with an index
// above shard_max_bytes), the checkpoint's tokenizer files and generation_config.json (made from
// config.json when it has none). Atomically: everything goes to <parent>/.tmp-export-<name>-<pid>,
// fsynced, then is renamed into place (or exchanged with the directory it replaces, which is then
// removed); a crash leaves out_dir as it was. Errors: those of VerifyCheckpoint and
// FindLatestCheckpoint; FAILED_PRECONDITION for a directory of several runs' checkpoints without
// `run` (naming each run, its jobs and newest checkpoint), or a checkpoint that is not of `run`;
// NOT_FOUND for no complete checkpoint (of `run`); for out_dir: FAILED_PRECONDITION when it exists
// and is not empty (without kReplace), is not a model directory, is or holds the checkpoint, or
// its parent is on a read-only file system or is not a directory; NOT_FOUND when its parent does
// not exist (it is not created: a mistyped mount point would fill another disk);
// PERMISSION_DENIED when the parent may not be written; RESOURCE_EXHAUSTED when the parent's file
// system lacks the space, checked before writing; each naming the path. DATA_LOSS for a master
// that is missing, misshaped or not finite (naming the tensor and element) or a layout that is not
// the config's.
absl::StatusOr<ExportResult> ExportModel(const ExportRequest& request);

// Config fields that decide tensor shapes and numerics; "" when a and b agree, else a message
// naming the first differing field and both values.
std::string DescribeConfigMismatch(const ModelConfig& file, const ModelConfig& layout);

}  // namespace slidedp::checkpoint
