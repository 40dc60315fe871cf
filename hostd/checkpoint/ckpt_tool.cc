// ckpt_tool: cross-checks the checkpoint code against HF (see tools/hf_checkpoint_check.py) and
// measures save throughput.
//   ckpt_tool load-hf DIR            load an HF dir, print per-tensor {sum, sum_sq, first} as JSON
//   ckpt_tool save-random ROOT ...   InitRandom + SaveCheckpoint (moments in --state-dtype); prints
//                                    the directory and GB/s
#include <cmath>
#include <cstdio>
#include <iostream>

#include "CLI/CLI.hpp"
#include "glog/logging.h"
#include "hostd/checkpoint/checkpoint.h"
#include "hostd/update/adamw_state.h"

namespace {

using namespace slidedp;

absl::StatusOr<Qwen3Config> ConfigFrom(const std::string& preset_or_dir) {
  if (auto p = Qwen3Config::Preset(preset_or_dir); p.ok()) return p;
  return Qwen3Config::FromFile(preset_or_dir + "/config.json");
}

int LoadHf(const std::string& dir) {
  auto config = Qwen3Config::FromFile(dir + "/config.json");
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

int SaveRandom(const std::string& root, const std::string& model, int64_t step, const std::string& dtype,
               const std::string& state_dtype, uint64_t shard_bytes, int threads, uint64_t seed) {
  auto config = ConfigFrom(model);
  if (!config.ok()) {
    std::cerr << config.status() << "\n";
    return 1;
  }
  auto moments = update::ParseStateDtype(state_dtype);
  if (!moments.ok()) {
    std::cerr << moments.status() << "\n";
    return 1;
  }
  const ModelLayout layout = ModelLayout::Build(*config);
  // m = 1e-3 and v = 1e-6 everywhere, in FP32 and encoded to the state dtype by the kernels.
  std::vector<std::vector<float>> master, m, v, m_scale, v_scale;
  std::vector<std::vector<bf16_t>> m16, v16;
  std::vector<std::vector<int8_t>> m8;
  std::vector<std::vector<uint8_t>> v8;
  const update::AdamStateKernelTable& kernels = update::ActiveAdamStateKernels();
  for (const auto& u : layout.units) {
    master.emplace_back(u.numel);
    m.emplace_back(u.numel, 1e-3f);
    v.emplace_back(u.numel, 1e-6f);
    if (*moments == update::StateDtype::kBf16) {
      m16.emplace_back(u.numel), v16.emplace_back(u.numel);
      kernels.bf16_from_f32(m.back().data(), v.back().data(), {m16.back().data(), v16.back().data()}, u.numel);
    } else if (*moments == update::StateDtype::kInt8) {
      m8.emplace_back(u.numel), v8.emplace_back(u.numel);
      m_scale.emplace_back(update::Int8StateBlocks(u.numel)), v_scale.emplace_back(update::Int8StateBlocks(u.numel));
      kernels.int8_from_f32(m.back().data(), v.back().data(),
                            {m8.back().data(), v8.back().data(), m_scale.back().data(), v_scale.back().data()},
                            u.numel);
    }
    if (*moments != update::StateDtype::kFp32) m.back() = {}, v.back() = {};
  }
  checkpoint::InitRandom(layout, seed, [&](int u) { return master[u].data(); });
  checkpoint::SaveRequest req;
  req.root_dir = root;
  req.step = step;
  req.layout = &layout;
  req.arrays.master = [&](int u) { return master[u].data(); };
  req.arrays.moment_dtype = *moments;
  req.arrays.moments = [&](int u) -> checkpoint::UnitMoments {
    switch (*moments) {
      case update::StateDtype::kFp32: return {m[u].data(), v[u].data()};
      case update::StateDtype::kBf16: return {m16[u].data(), v16[u].data()};
      case update::StateDtype::kInt8: return {m8[u].data(), v8[u].data(), m_scale[u].data(), v_scale[u].data()};
    }
    return {};
  };
  req.trainer_state = {{"seed", seed}};
  req.weight_dtype = dtype == "f32" ? checkpoint::WeightDtype::kF32 : checkpoint::WeightDtype::kBF16;
  req.shard_max_bytes = shard_bytes;
  req.io_threads = threads;
  auto res = checkpoint::SaveCheckpoint(req);
  if (!res.ok()) {
    std::cerr << res.status() << "\n";
    return 1;
  }
  std::printf("%s\n%.3f GB in %.2f s = %.2f GB/s (params %lld)\n", res->dir.c_str(), res->bytes_written / 1e9,
              res->seconds, res->bytes_written / 1e9 / res->seconds, static_cast<long long>(layout.param_count()));
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  CLI::App app{"slidedp checkpoint cross-check tool"};
  app.require_subcommand(1);
  std::string dir, root, model = "tiny", dtype = "bf16", state_dtype = "fp32";
  int64_t step = 1;
  uint64_t shard_bytes = 5'000'000'000, seed = 0;
  int threads = 8;
  auto* load = app.add_subcommand("load-hf", "load an HF model dir and print per-tensor statistics as JSON");
  load->add_option("dir", dir)->required();
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
  CLI11_PARSE(app, argc, argv);
  if (*load) return LoadHf(dir);
  return SaveRandom(root, model, step, dtype, state_dtype, shard_bytes, threads, seed);
}
