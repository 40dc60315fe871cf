// Loads an HF Qwen3 model directory (single or sharded safetensors) into the FP32 master arrays.
// Everything is checked before the first byte is converted, so a bad directory leaves the
// arrays untouched.
#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/strip.h"
#include "checkpoint/checkpoint.h"
#include "checkpoint/mxfp4.h"
#include "common/io/json_depth.h"
#include "common/model/model_dir.h"
#include "common/io/small_file.h"
#include "common/numeric/finite.h"
#include "common/parallel/parallel_for.h"
#include "common/safetensors/safetensors.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::checkpoint {
namespace {

namespace fs = std::filesystem;
using safetensors::SafetensorsFile;
using safetensors::TensorInfo;

std::string ShapeString(const std::vector<int64_t>& shape) {
  return absl::StrCat("[", absl::StrJoin(shape, ", "), "]");
}

// Lists at most 8 names, then a count, so one broken directory cannot flood a log line.
std::string NameList(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min<size_t>(names.size(), 8));
  std::string s = absl::StrJoin(shown, ", ");
  if (names.size() > shown.size()) absl::StrAppend(&s, " and ", names.size() - shown.size(), " more");
  return s;
}

struct Located {
  const SafetensorsFile* file;
  const TensorInfo* info;
};

// A weight_map file name must be a plain name inside the model directory.
bool IsPlainFileName(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos &&
         name.find('\0') == std::string::npos;
}

absl::Status OpenShards(const std::string& dir, std::vector<std::unique_ptr<SafetensorsFile>>* files,
                        std::map<std::string, Located>* tensors) {
  const std::string single = dir + "/model.safetensors";
  const std::string index_path = dir + "/model.safetensors.index.json";
  std::map<std::string, std::string> weight_map;  // tensor -> file; empty for a single file
  std::error_code ec;
  if (fs::exists(single, ec)) {
    ASSIGN_OR_RETURN(auto f, SafetensorsFile::Open(single));
    files->push_back(std::move(f));
  } else if (fs::exists(index_path, ec)) {
    ASSIGN_OR_RETURN(std::string text, ReadSmallFile(index_path, kMaxManifestFileBytes, "safetensors index"));
    RETURN_IF_ERROR(CheckJsonDepth(text, index_path));
    nlohmann::json index = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (index.is_discarded() || !index.is_object() || !index.contains("weight_map") ||
        !index["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(index_path, ": not a JSON object with a \"weight_map\" object"));
    }
    std::set<std::string> shard_names;
    for (auto it = index["weight_map"].begin(); it != index["weight_map"].end(); ++it) {
      if (!it->is_string() || !IsPlainFileName(it->get<std::string>())) {
        return absl::InvalidArgumentError(absl::StrCat(index_path, ": weight_map entry for \"", it.key(),
                                                       "\" must be a file name in the model directory, got ",
                                                       it->dump()));
      }
      weight_map[it.key()] = it->get<std::string>();
      shard_names.insert(it->get<std::string>());
    }
    for (const std::string& name : shard_names) {
      auto f = SafetensorsFile::Open(dir + "/" + name);
      if (!f.ok()) return Annotate(f.status(), absl::StrCat("shard listed in ", index_path));
      files->push_back(std::move(*f));
    }
  } else {
    return absl::NotFoundError(
        absl::StrCat(dir, ": neither model.safetensors nor model.safetensors.index.json is present"));
  }

  for (const auto& f : *files) {
    const std::string fname = fs::path(f->path()).filename().string();
    for (const TensorInfo& t : f->tensors()) {
      if (!weight_map.empty()) {
        auto w = weight_map.find(t.name);
        if (w == weight_map.end() || w->second != fname) {
          return absl::InvalidArgumentError(
              absl::StrCat(f->path(), " holds tensor \"", t.name, "\" but ", index_path,
                           w == weight_map.end() ? " does not list it" : " maps it to " + w->second));
        }
      }
      auto [pos, inserted] = tensors->emplace(t.name, Located{f.get(), &t});
      if (!inserted) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor \"", t.name, "\" appears in both ", pos->second.file->path(), " and ", f->path()));
      }
    }
  }
  for (const auto& [name, file] : weight_map) {
    if (!tensors->count(name)) {
      return absl::InvalidArgumentError(
          absl::StrCat(index_path, " maps tensor \"", name, "\" to ", file, " but that file does not contain it"));
    }
  }
  return absl::OkStatus();
}

// gemma4: the multimodal model's towers and their embedders (model.vision_tower.*, model.embed_vision.*,
// model.audio_tower.*, model.embed_audio.*); and a kv-shared layer's own k_proj, v_proj, k_norm,
// v_norm where a directory has them: transformers builds none and ignores them at load
// (_keys_to_ignore_on_load_unexpected), so they are kept as the directory has them.
bool IsGemma4PassThroughName(const ModelConfig& c, absl::string_view name) {
  if (c.multimodal) {
    for (const char* tower : {"vision_tower.", "embed_vision.", "audio_tower.", "embed_audio."}) {
      if (absl::StartsWith(name, absl::StrCat("model.", tower))) return true;
    }
  }
  absl::string_view rest = name;
  int64_t layer = -1;
  if (!absl::ConsumePrefix(&rest, c.WeightPrefix() + "layers.") || rest.find('.') == absl::string_view::npos ||
      !absl::SimpleAtoi(rest.substr(0, rest.find('.')), &layer) || layer < 0 || layer >= c.num_hidden_layers ||
      c.KvSourceLayer(layer) < 0) {
    return false;
  }
  rest.remove_prefix(rest.find('.') + 1);
  for (const char* m : {"self_attn.k_proj.", "self_attn.v_proj.", "self_attn.k_norm.", "self_attn.v_norm."}) {
    if (absl::StartsWith(rest, m)) return true;
  }
  return false;
}

std::string LayerTypesText(const ModelConfig& c) {
  std::string s;
  for (int64_t l = 0; l < c.num_hidden_layers; ++l) s += c.IsLinearAttentionLayer(l) ? 'L' : 'A';
  return s;
}

std::string LinearText(const LinearAttentionConfig& l) {
  return absl::StrCat("key heads ", l.num_key_heads, " x ", l.key_head_dim, ", value heads ", l.num_value_heads, " x ",
                      l.value_head_dim, ", conv ", l.conv_kernel);
}

}  // namespace

std::string DescribeConfigMismatch(const ModelConfig& a, const ModelConfig& b) {
  auto differ = [](const char* field, auto x, auto y) -> std::string {
    if (x == y) return "";
    return absl::StrCat(field, " is ", x, " in the checkpoint but ", y, " in the job's model");
  };
  for (std::string m :
       {differ("model_type", std::string(ModelTypeName(a.family)), std::string(ModelTypeName(b.family))),
        differ("hidden_size", a.hidden_size, b.hidden_size),
        differ("num_hidden_layers", a.num_hidden_layers, b.num_hidden_layers),
        differ("num_attention_heads", a.num_attention_heads, b.num_attention_heads),
        differ("num_key_value_heads", a.num_key_value_heads, b.num_key_value_heads),
        differ("head_dim", a.head_dim, b.head_dim),
        // (Only dense layers read it: qwen3_5_moe's config has none.)
        a.NumSparseLayers() == a.num_hidden_layers && b.NumSparseLayers() == b.num_hidden_layers
            ? std::string()
            : differ("intermediate_size", a.intermediate_size, b.intermediate_size),
        differ("vocab_size", a.vocab_size, b.vocab_size),
        differ("tie_word_embeddings", a.tie_word_embeddings, b.tie_word_embeddings),
        differ("rope_theta", a.rope_theta, b.rope_theta), differ("rms_norm_eps", a.rms_norm_eps, b.rms_norm_eps),
        // qwen3_moe: the experts' layout and the routing's math.
        differ("num_experts", a.num_experts, b.num_experts),
        differ("num_experts_per_tok", a.num_experts_per_tok, b.num_experts_per_tok),
        differ("moe_intermediate_size", a.moe_intermediate_size, b.moe_intermediate_size),
        differ("norm_topk_prob", a.norm_topk_prob, b.norm_topk_prob),
        differ("decoder_sparse_step", a.decoder_sparse_step, b.decoder_sparse_step),
        differ("mlp_only_layers", absl::StrJoin(a.mlp_only_layers, ","), absl::StrJoin(b.mlp_only_layers, ",")),
        // qwen3_5: the mixers, the linear attention's sizes, the shared expert, where the weights live.
        differ("layer_types", LayerTypesText(a), LayerTypesText(b)),
        differ("linear attention sizes", LinearText(a.linear), LinearText(b.linear)),
        differ("partial_rotary_factor", a.partial_rotary_factor, b.partial_rotary_factor),
        differ("shared_expert_intermediate_size", a.shared_expert_intermediate_size, b.shared_expert_intermediate_size),
        differ("checkpoint layout", std::string(a.multimodal ? "multimodal" : "causal LM"),
               std::string(b.multimodal ? "multimodal" : "causal LM")),
        // gemma3: the attention's scale, the logits' cap, the sliding layers' RoPE.
        differ("query_pre_attn_scalar", a.query_pre_attn_scalar, b.query_pre_attn_scalar),
        differ("final_logit_softcapping", a.final_logit_softcapping, b.final_logit_softcapping),
        a.RopeInverseFrequencies() == b.RopeInverseFrequencies() && a.RopeAttentionScaling() == b.RopeAttentionScaling()
            ? std::string()
            : std::string("the RoPE scaling (rope_parameters / rope_scaling) differs between the checkpoint and the "
                          "job's model"),
        a.RopeInverseFrequencies(AttentionSpan::kSliding) == b.RopeInverseFrequencies(AttentionSpan::kSliding)
            ? std::string()
            : std::string("the sliding layers' RoPE (rope_parameters.sliding_attention / rope_local_base_freq) "
                          "differs between the checkpoint and the job's model")}) {
    if (!m.empty()) return m;
  }
  return "";
}

absl::StatusOr<ModelConfig> ModelConfigOfDir(const std::string& model_dir) {
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::FromFile(model_dir + "/config.json"));
  RETURN_IF_ERROR(AdoptDirNaming(model_dir, &config));
  return config;
}

bool IsPassThroughName(const ModelConfig& config, absl::string_view name) {
  if (config.is_gemma3()) {
    const std::string wrapper = config.WrapperPrefix();
    return config.multimodal && (absl::StartsWith(name, wrapper + "vision_tower.") ||
                                 absl::StartsWith(name, wrapper + "multi_modal_projector."));
  }
  if (config.is_gemma4()) return IsGemma4PassThroughName(config, name);
  if (!config.is_qwen3_5()) return false;
  return absl::StartsWith(name, "model.visual.") || absl::StartsWith(name, "mtp.");
}

absl::StatusOr<PassThrough> ReadPassThrough(const std::string& model_dir, const ModelConfig& config) {
  PassThrough out;
  if (!config.has_multimodal_layout()) return out;
  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, Located> found;
  RETURN_IF_ERROR(OpenShards(model_dir, &files, &found));
  for (const auto& [name, loc] : found) {
    if (!IsPassThroughName(config, name)) continue;
    out.push_back({name, loc.info->dtype, loc.info->shape, std::string(loc.file->Bytes(*loc.info))});
  }
  for (const auto& f : files) RETURN_IF_ERROR(f->Intact());
  return out;
}

absl::Status LoadHfModel(const std::string& model_dir, const ModelLayout& layout, const UnitArrayFn& master_of_unit,
                         const LoadOptions& options) {
  std::error_code ec;
  if (!fs::is_directory(model_dir, ec))
    return absl::NotFoundError(absl::StrCat("model directory ", model_dir, " not found"));
  const std::string config_path = model_dir + "/config.json";
  ASSIGN_OR_RETURN(ModelConfig config, ModelConfig::FromFile(config_path));
  // The weights do not depend on RoPE: a job's context override (model.rope_scaling,
  // model.max_position_embeddings) starts from the directory's weights as they are.
  ModelConfig job = layout.config;
  job.rope_theta = config.rope_theta;
  job.rope_scaling = config.rope_scaling;
  job.max_position_embeddings = config.max_position_embeddings;
  if (std::string m = DescribeConfigMismatch(config, job); !m.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(config_path, ": ", m));
  }

  std::vector<std::unique_ptr<SafetensorsFile>> files;
  std::map<std::string, Located> found;
  RETURN_IF_ERROR(OpenShards(model_dir, &files, &found));

  // One job per layout slot: the slot's elements of its checkpoint tensor (the whole tensor, or
  // one expert's slice of a fused one).
  struct Job {
    float* dst;
    Located src;
    int64_t src_offset;  // elements into the checkpoint tensor
    int64_t numel;
  };
  std::vector<Job> jobs;
  // gpt_oss's MXFP4 experts (mxfp4.h): a slot of a fused expert tensor read from <name>_blocks and
  // <name>_scales, dequantized as transformers does.
  struct Mxfp4Job {
    float* dst;
    const TensorSlot* slot;
    Located blocks, scales;
  };
  std::vector<Mxfp4Job> mxfp4_jobs;
  std::vector<std::string> missing, misshaped;
  std::set<std::string> used;
  for (const UnitLayout& unit : layout.units) {
    float* base = master_of_unit(unit.index);
    for (const TensorSlot& slot : unit.tensors) {
      auto it = found.find(slot.hf_name);
      const auto blocks = found.find(slot.hf_name + "_blocks"), scales = found.find(slot.hf_name + "_scales");
      if (it == found.end() && config.mxfp4_experts && blocks != found.end() && scales != found.end()) {
        const bool first = used.insert(blocks->first).second;
        used.insert(scales->first);
        if (absl::Status s = CheckMxfp4Pair(slot, *blocks->second.info, *scales->second.info); !s.ok()) {
          if (first) misshaped.push_back(std::string(s.message()));
          continue;
        }
        mxfp4_jobs.push_back({base + slot.offset_numel, &slot, blocks->second, scales->second});
        continue;
      }
      if (it == found.end()) {
        if (!used.count(slot.hf_name)) missing.push_back(slot.hf_name);
        used.insert(slot.hf_name);
        continue;
      }
      const bool first = used.insert(slot.hf_name).second;
      const std::vector<int64_t>& want = slot.is_slice() ? slot.hf_shape : slot.shape;
      if (it->second.info->shape != want) {
        if (first) {
          misshaped.push_back(absl::StrCat(slot.hf_name, " is ", ShapeString(it->second.info->shape), " in ",
                                           it->second.file->path(), ", expected ", ShapeString(want)));
        }
        continue;
      }
      jobs.push_back({base + slot.offset_numel, it->second, slot.hf_offset_numel, slot.numel});
    }
  }
  const Located* tied_head = nullptr;
  std::vector<std::string> extra;
  std::vector<std::pair<std::string, const Located*>> passing;  // by the name every checkpoint keeps
  for (const auto& [name, loc] : found) {
    if (used.count(name)) continue;
    if (IsPassThroughName(layout.config, name)) {
      passing.emplace_back(name, &loc);
      continue;
    }
    if (layout.head_uses_embedding && name == layout.config.HeadWeightName()) {
      const std::vector<int64_t> want = {layout.config.vocab_size, layout.config.hidden_size};
      if (loc.info->shape != want) {
        misshaped.push_back(absl::StrCat(name, " is ", ShapeString(loc.info->shape), ", expected ", ShapeString(want)));
      }
      tied_head = &loc;
      continue;
    }
    extra.push_back(name);
  }
  if (!missing.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat(model_dir, ": ", missing.size(), " tensor(s) missing: ", NameList(missing)));
  }
  if (!misshaped.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(model_dir, ": wrong shape: ", NameList(misshaped)));
  }
  if (!extra.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        model_dir, ": ", extra.size(), " tensor(s) not part of a ", ModelTypeName(layout.config.family), " model of this config: ", NameList(extra)));
  }
  for (const Job& job : jobs) {
    switch (job.src.info->dtype) {
      case safetensors::Dtype::kBF16:
      case safetensors::Dtype::kF16:
      case safetensors::Dtype::kF32: break;
      default:
        return absl::UnimplementedError(absl::StrCat(job.src.file->path(), ": tensor \"", job.src.info->name,
                                                     "\" has dtype ", safetensors::DtypeName(job.src.info->dtype),
                                                     " (supported: BF16, F16, F32)"));
    }
  }

  // Zero the alignment padding so the arrays are fully defined.
  for (const UnitLayout& unit : layout.units) {
    float* base = master_of_unit(unit.index);
    int64_t pos = 0;
    for (const TensorSlot& slot : unit.tensors) {
      std::fill(base + pos, base + slot.offset_numel, 0.0f);
      pos = slot.offset_numel + slot.numel;
    }
    std::fill(base + pos, base + unit.numel, 0.0f);
  }
  // Large tensors (the embedding is most of a small model) are split so all threads share them.
  constexpr int64_t kPieceNumel = int64_t{1} << 22;
  struct Piece {
    const Job* job;
    int64_t begin, count;
  };
  std::vector<Piece> pieces;
  for (const Job& job : jobs) {
    for (int64_t b = 0; b < job.numel; b += kPieceNumel) pieces.push_back({&job, b, std::min(kPieceNumel, job.numel - b)});
  }
  // Each piece is checked for NaN and inf as it is converted (still in cache): a damaged model
  // would otherwise train NaN and report success. The first bad piece in file order is reported.
  std::vector<absl::Status> piece_status(pieces.size());
  ParallelFor(pieces.size(), options.threads, [&](size_t i) {
    const Piece& p = pieces[i];
    const TensorInfo& info = *p.job->src.info;
    const char* src =
        p.job->src.file->Bytes(info).data() + (p.job->src_offset + p.begin) * safetensors::DtypeSize(info.dtype);
    float* dst = p.job->dst + p.begin;
    absl::Status s = safetensors::ConvertToFloat32(info.dtype, src, p.count, dst);
    if (!s.ok()) {
      piece_status[i] = Annotate(s, absl::StrCat(p.job->src.file->path(), ": ", info.name));
      return;
    }
    if (const int64_t bad = FirstNonFinite(dst, p.count); bad >= 0) {
      piece_status[i] = absl::DataLossError(absl::StrCat(p.job->src.file->path(), ": tensor \"", info.name, "\" holds ",
                                                         dst[bad], " at ",
                                                         TensorIndexString(info.shape, p.job->src_offset + p.begin + bad),
                                                         " (weights must be finite)"));
    }
  });
  std::vector<absl::Status> mxfp4_status(mxfp4_jobs.size());
  ParallelFor(mxfp4_jobs.size(), options.threads, [&](size_t i) {
    const Mxfp4Job& j = mxfp4_jobs[i];
    DequantizeMxfp4Slot(*j.slot, j.blocks.file->Bytes(*j.blocks.info).data(),
                        j.scales.file->Bytes(*j.scales.info).data(), j.dst);
    if (const int64_t bad = FirstNonFinite(j.dst, j.slot->numel); bad >= 0) {
      mxfp4_status[i] = absl::DataLossError(absl::StrCat(
          j.blocks.file->path(), ": ", j.blocks.info->name, " dequantizes to ", j.dst[bad], " at ", j.slot->hf_name,
          TensorIndexString(j.slot->hf_shape, j.slot->hf_offset_numel + bad), " (weights must be finite)"));
    }
  });
  // A file truncated while it was read read zeros past its new end (common/io/mapping_guard.h).
  for (const auto& f : files) RETURN_IF_ERROR(f->Intact());
  for (const absl::Status& s : piece_status) RETURN_IF_ERROR(s);
  for (const absl::Status& s : mxfp4_status) RETURN_IF_ERROR(s);
  if (!mxfp4_jobs.empty()) {
    LOG(INFO) << model_dir << ": " << mxfp4_jobs.size() << " expert matrices dequantized from MXFP4 "
              << "(quantization_config mxfp4, as transformers' convert_moe_packed_tensors); checkpoints and exports "
              << "save them unquantized, in the job's save dtype (bf16 unless output.save_dtype says otherwise), "
              << "with config.json's quantization_config dropped";
  }

  if (tied_head != nullptr) {
    // Tied: the embedding is the LM head. A differing copy in the file is ignored, as HF does.
    const TensorSlot& embed = layout.embedding().tensors[0];
    const float* e = master_of_unit(layout.embedding().index) + embed.offset_numel;
    std::vector<float> row(static_cast<size_t>(layout.config.hidden_size));
    int64_t differing_rows = 0;
    const auto bytes = tied_head->file->Bytes(*tied_head->info);
    const size_t row_bytes = row.size() * safetensors::DtypeSize(tied_head->info->dtype);
    for (int64_t r = 0; r < layout.config.vocab_size; ++r) {
      RETURN_IF_ERROR(safetensors::ConvertToFloat32(tied_head->info->dtype, bytes.data() + r * row_bytes,
                                                    static_cast<int64_t>(row.size()), row.data()));
      if (std::memcmp(row.data(), e + r * row.size(), row.size() * sizeof(float)) != 0) ++differing_rows;
    }
    if (differing_rows > 0) {
      RETURN_IF_ERROR(tied_head->file->Intact());
      LOG(WARNING) << model_dir << ": tie_word_embeddings is true but " << layout.config.HeadWeightName()
                   << " differs from the embedding in "
                   << differing_rows << " rows; using the embedding (as HF does)";
    }
  }
  if (options.pass_through != nullptr) {
    options.pass_through->clear();
    for (const auto& [name, loc] : passing) {
      const absl::string_view b = loc->file->Bytes(*loc->info);
      options.pass_through->push_back({name, loc->info->dtype, loc->info->shape, std::string(b)});
    }
    for (const auto& f : files) RETURN_IF_ERROR(f->Intact());
    if (!passing.empty()) {
      LOG(INFO) << model_dir << ": " << passing.size() << " tensor(s) not trained, kept unchanged for every checkpoint "
                << "(the vision tower and projector, multi-token prediction)";
    }
  }
  size_t bytes = 0;
  for (const auto& f : files) bytes += f->file_size();
  VLOG(1) << "loaded " << jobs.size() << " tensors (" << bytes << " bytes) from " << model_dir;
  return absl::OkStatus();
}

}  // namespace slidedp::checkpoint
