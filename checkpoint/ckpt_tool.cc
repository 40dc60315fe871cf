// ckpt_tool: cross-checks the checkpoint code against HF (see tools/hf_checkpoint_check.py) and
// measures save throughput.
//   ckpt_tool load-hf DIR            load an HF dir, print per-tensor {sum, sum_sq, first} as JSON
//   ckpt_tool save-random ROOT ...   InitRandom + SaveCheckpoint (moments in --state-dtype); prints
//                                    the directory and GB/s
//   ckpt_tool load DIR ...           LoadCheckpoint into moments of --state-dtype (converting when the
//                                    checkpoint keeps another); prints the note and GB/s
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "checkpoint/checkpoint.h"
#include "CLI/CLI.hpp"
#include "common/moments/moments.h"
#include "glog/logging.h"

namespace {

using namespace slidedp;

absl::StatusOr<ModelConfig> ConfigFrom(const std::string& preset_or_dir) {
  if (auto p = ModelConfig::Preset(preset_or_dir); p.ok()) return p;
  return checkpoint::ModelConfigOfDir(preset_or_dir);
}

int LoadHf(const std::string& dir) {
  auto config = checkpoint::ModelConfigOfDir(dir);
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 1;
  }
  const ModelLayout layout = ModelLayout::Build(*config);
  std::vector<std::vector<float>> units;
  for (const auto& u : layout.units) units.emplace_back(u.numel);
  absl::Status s = checkpoint::LoadHfModel(dir, layout, [&](int u) { return units[u].data(); });
  if (!s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  nlohmann::json out = nlohmann::json::object();
  for (const auto& u : layout.units) {
    for (const auto& t : u.tensors) {
      const float* p = units[u.index].data() + t.offset_numel;
      double sum = 0, sq = 0;
      for (int64_t i = 0; i < t.numel; ++i) {
        sum += p[i];
        sq += double(p[i]) * p[i];
      }
      out[t.hf_name] = {{"numel", t.numel}, {"sum", sum}, {"sum_sq", sq}, {"first", p[0]}, {"last", p[t.numel - 1]}};
    }
  }
  std::cout << out.dump(1) << "\n";
  return 0;
}

// A job's state as plain vectors: master and the moments in one state dtype.
struct VectorState {
  VectorState(const ModelLayout& layout, MomentForm dtype) : dtype(dtype) {
    for (const auto& u : layout.units) {
      const bool f32 = dtype == MomentForm::kF32, b16 = dtype == MomentForm::kBF16;
      const bool i8 = dtype == MomentForm::kInt8;
      master.emplace_back(u.numel);
      m.emplace_back(f32 ? u.numel : 0), v.emplace_back(f32 ? u.numel : 0);
      m16.emplace_back(b16 ? u.numel : 0), v16.emplace_back(b16 ? u.numel : 0);
      m8.emplace_back(i8 ? u.numel : 0), v8.emplace_back(i8 ? u.numel : 0);
      m_scale.emplace_back(i8 ? Int8MomentBlocks(u.numel) : 0);
      v_scale.emplace_back(i8 ? Int8MomentBlocks(u.numel) : 0);
    }
  }
  checkpoint::UnitMoments moments(int u) {
    switch (dtype) {
      case MomentForm::kF32: return {m[u].data(), v[u].data()};
      case MomentForm::kBF16: return {m16[u].data(), v16[u].data()};
      case MomentForm::kInt8: return {m8[u].data(), v8[u].data(), m_scale[u].data(), v_scale[u].data()};
    }
    return {};
  }
  checkpoint::StateArrays arrays() {
    return {[this](int u) { return master[u].data(); }, dtype, [this](int u) { return moments(u); }};
  }
  MomentForm dtype;
  std::vector<std::vector<float>> master, m, v, m_scale, v_scale;
  std::vector<std::vector<bf16_t>> m16, v16;
  std::vector<std::vector<int8_t>> m8;
  std::vector<std::vector<uint8_t>> v8;
};

int SaveRandom(const std::string& root, const std::string& model, int64_t step, const std::string& dtype,
               const std::string& state_dtype, uint64_t shard_bytes, int threads, uint64_t seed,
               const std::string& files_from) {
  auto config = ConfigFrom(model);
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 1;
  }
  auto moments = ParseMomentForm(state_dtype);
  if (!moments.ok()) {
    std::cerr << moments.status() << "\n";
    return 1;
  }
  const ModelLayout layout = ModelLayout::Build(*config);
  // m = 1e-3 and v = 1e-6 everywhere, encoded to the state dtype by the kernels.
  VectorState state(layout, *moments);
  const moments::MomentCodecTable& codecs = moments::ActiveMomentCodecs();
  for (const auto& u : layout.units) {
    const std::vector<float> m(u.numel, 1e-3f), v(u.numel, 1e-6f);
    const checkpoint::UnitMoments out = state.moments(u.index);
    switch (*moments) {
      case MomentForm::kF32: state.m[u.index] = m, state.v[u.index] = v; break;
      case MomentForm::kBF16:
        codecs.bf16_from_f32(m.data(), v.data(), {static_cast<bf16_t*>(out.m), static_cast<bf16_t*>(out.v)}, u.numel);
        break;
      case MomentForm::kInt8:
        codecs.int8_from_f32(m.data(), v.data(),
                             {static_cast<int8_t*>(out.m), static_cast<uint8_t*>(out.v), out.m_scale, out.v_scale},
                             u.numel);
        break;
    }
  }
  checkpoint::InitRandom(layout, seed, [&](int u) { return state.master[u].data(); });
  checkpoint::SaveRequest req;
  req.root_dir = root;
  req.step = step;
  req.layout = &layout;
  req.arrays = state.arrays();
  req.trainer_state = {{"seed", seed}};
  req.weight_dtype = dtype == "f32" ? Dtype::kF32 : Dtype::kBF16;
  req.shard_max_bytes = shard_bytes;
  req.io_threads = threads;
  std::vector<checkpoint::ModelDirFile> model_files;
  if (!files_from.empty()) {
    auto read = checkpoint::ReadModelDirFiles(files_from);
    if (!read.ok()) {
      std::cerr << read.status() << "\n";
      return 1;
    }
    model_files = std::move(*read);
    req.model_files = &model_files;
  }
  auto res = checkpoint::SaveCheckpoint(req);
  if (!res.ok()) {
    std::cerr << res.status() << "\n";
    return 1;
  }
  std::printf("%s\n%.3f GB in %.2f s = %.2f GB/s (params %lld)\n", res->dir.c_str(), res->bytes_written / 1e9,
              res->seconds, res->bytes_written / 1e9 / res->seconds, static_cast<long long>(layout.param_count()));
  return 0;
}

int Load(const std::string& dir, const std::string& state_dtype, int threads) {
  auto config = checkpoint::ModelConfigOfDir(dir);
  auto moments = ParseMomentForm(state_dtype);
  if (!config.ok() || !moments.ok()) {
    std::cerr << (config.ok() ? moments.status() : config.status()) << "\n";
    return 1;
  }
  const ModelLayout layout = ModelLayout::Build(*config);
  VectorState state(layout, *moments);
  const auto t0 = std::chrono::steady_clock::now();
  auto loaded = checkpoint::LoadCheckpoint(dir, layout, state.arrays(), {.threads = threads});
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  if (!loaded.ok()) {
    std::cerr << loaded.status() << "\n";
    return 1;
  }
  const double gb = std::filesystem::file_size(dir + "/optimizer.safetensors") / 1e9;
  std::printf("step %lld, saved %s, loaded as %s%s%s\n%.3f GB in %.2f s = %.2f GB/s\n",
              static_cast<long long>(loaded->step), ToString(loaded->saved_moment_form), state_dtype.c_str(),
              loaded->conversion_note.empty() ? "" : ": ", loaded->conversion_note.c_str(), gb, seconds, gb / seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  CLI::App app{"slidedp checkpoint cross-check tool"};
  app.require_subcommand(1);
  std::string dir, root, model = "tiny", dtype = "bf16", state_dtype = "fp32", files_from;
  int64_t step = 1;
  uint64_t shard_bytes = 5'000'000'000, seed = 0;
  int threads = 8;
  auto* load = app.add_subcommand("load-hf", "load an HF model dir and print per-tensor statistics as JSON");
  load->add_option("dir", dir)->required();
  auto* load_ckpt =
      app.add_subcommand("load", "load a checkpoint's optimizer state (timed), converting to --state-dtype");
  load_ckpt->add_option("dir", dir, "a checkpoint-<step> directory")->required();
  load_ckpt->add_option("--state-dtype", state_dtype, "the Adam moments' dtype to load into")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  load_ckpt->add_option("--threads", threads);
  auto* save = app.add_subcommand("save-random", "random-init a model and save a checkpoint");
  save->add_option("root", root)->required();
  save->add_option("--model", model, "preset name or an HF model dir (its config.json)");
  save->add_option("--step", step);
  save->add_option("--dtype", dtype, "the weights' dtype")->check(CLI::IsMember({"bf16", "f32"}));
  save->add_option("--state-dtype", state_dtype, "the Adam moments' dtype")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  save->add_option("--shard-bytes", shard_bytes);
  save->add_option("--threads", threads);
  save->add_option("--seed", seed);
  save->add_option("--model-files-from", files_from,
                   "copy the tokenizer files and generation_config.json of this model directory, as a job does");
  CLI11_PARSE(app, argc, argv);
  if (*load) return LoadHf(dir);
  if (*load_ckpt) return Load(dir, state_dtype, threads);
  return SaveRandom(root, model, step, dtype, state_dtype, shard_bytes, threads, seed, files_from);
}
