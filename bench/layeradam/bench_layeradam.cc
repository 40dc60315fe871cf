// bench_layeradam: LayerAdam's update throughput against the host's memory-copy bandwidth,
// measured in the same run with the same number of threads.
//
// Traffic conventions (both reported):
//   28 B/param: read master, m, v, grad (16), write master, m, v (12) -- the convention of
//               ../shared/bench/peers/cpu_probe.py for torch's AdamW, which has no mirror;
//   30 B/param: the above plus the BF16 mirror LayerAdam writes in the same pass.
// Copy bandwidth counts bytes read + written (a memcpy of B bytes moves 2B).
//
//   bench_layeradam [--params N] [--threads T] [--reps R] [--chunk-params C] [--isa avx512]
//                   [--pin core|node|none] [--grad fp32|bf16] [--mirror-store stream|cached]
//                   [--dump DIR]
// The last stdout line is one JSON object with every figure.
#include <sys/mman.h>
#include <xmmintrin.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "CLI/CLI.hpp"
#include "common/parallel/parallel_for.h"
#include "glog/logging.h"
#include "hostd/update/adamw_kernels.h"
#include "hostd/update/layer_adam.h"
#include "nlohmann/json.hpp"

namespace slidedp::update {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Anonymous mapping, 2 MiB aligned, transparent huge pages requested.
struct Mapping {
  explicit Mapping(size_t bytes) : size(bytes) {
    ptr = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(ptr != MAP_FAILED) << "mmap " << size << " bytes failed";
    madvise(ptr, size, MADV_HUGEPAGE);
  }
  ~Mapping() { munmap(ptr, size); }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr);
  }
  void* ptr;
  size_t size;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

enum class CopyKind { kMemcpy, kPlainStores };

// A copy with ordinary (cached) 16-byte stores, as ATen's copy_ does; glibc's memcpy switches to
// non-temporal stores for large sizes, which is faster or slower depending on the machine.
void PlainCopy(char* dst, const char* src, int64_t bytes) {
  int64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const __m128 a = _mm_loadu_ps(reinterpret_cast<const float*>(src + i));
    const __m128 b = _mm_loadu_ps(reinterpret_cast<const float*>(src + i + 16));
    const __m128 c = _mm_loadu_ps(reinterpret_cast<const float*>(src + i + 32));
    const __m128 d = _mm_loadu_ps(reinterpret_cast<const float*>(src + i + 48));
    _mm_storeu_ps(reinterpret_cast<float*>(dst + i), a);
    _mm_storeu_ps(reinterpret_cast<float*>(dst + i + 16), b);
    _mm_storeu_ps(reinterpret_cast<float*>(dst + i + 32), c);
    _mm_storeu_ps(reinterpret_cast<float*>(dst + i + 48), d);
  }
  std::memcpy(dst + i, src + i, bytes - i);
}

// Copy bandwidth in GB/s (read + write) with `threads` threads: {median, best} of `reps`.
std::pair<double, double> CopyBandwidth(CopyKind kind, int threads, char* src, char* dst, int64_t bytes, int reps) {
  std::vector<double> times;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    ParallelForRanges(threads, bytes, [=](int64_t b, int64_t e) {
      if (kind == CopyKind::kMemcpy) {
        std::memcpy(dst + b, src + b, e - b);
      } else {
        PlainCopy(dst + b, src + b, e - b);
      }
    });
    const double dt = Seconds(t0, Clock::now());
    if (r > 0) times.push_back(dt);  // the first pass is a warm-up
  }
  const double best = *std::min_element(times.begin(), times.end());
  return {2.0 * bytes / Median(times) / 1e9, 2.0 * bytes / best / 1e9};
}

void WriteFile(const std::filesystem::path& path, const void* data, size_t bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
  CHECK(f.good()) << "writing " << path;
}

// Writes inputs and LayerAdam's outputs of a few steps for torch_adamw_compare.py.
absl::Status Dump(const std::filesystem::path& dir, int64_t n, int steps, LayerAdam& engine) {
  std::filesystem::create_directories(dir);
  std::vector<float> master(n), m(n, 0.0f), v(n, 0.0f);
  std::vector<bf16_t> mirror(n);
  uint64_t state = 12345;
  auto uniform = [&state]() {  // xorshift64*, deterministic and dependency-free
    state ^= state >> 12;
    state ^= state << 25;
    state ^= state >> 27;
    return static_cast<float>(((state * 0x2545F4914F6CDD1DULL) >> 40) * (1.0 / (1 << 24))) * 2 - 1;
  };
  for (float& x : master) x = uniform() * 0.05f;
  WriteFile(dir / "theta0.f32", master.data(), n * 4);
  nlohmann::json meta = {{"numel", n}, {"steps", steps}, {"isa", AdamIsaName(engine.isa())}};
  nlohmann::json per_step = nlohmann::json::array();
  UnitMemory unit{master.data(), m.data(), v.data(), mirror.data(), n, 0};
  for (int t = 1; t <= steps; ++t) {
    std::vector<float> grad(n);
    for (float& g : grad) g = uniform() * (t == 2 ? 1.0f : 1e-2f);
    WriteFile(dir / absl::StrCat("grad", t, ".f32"), grad.data(), n * 4);
    AdamWStepParams p;
    p.lr = 1e-3 * t;
    p.weight_decay = t == 3 ? 0.0 : 0.1;
    p.beta2 = 0.999;
    p.step = t;
    p.grad_scale = t == 2 ? 0.25f : 1.0f;
    per_step.push_back({{"lr", p.lr},
                        {"weight_decay", p.weight_decay},
                        {"beta1", p.beta1},
                        {"beta2", p.beta2},
                        {"eps", p.eps},
                        {"grad_scale", p.grad_scale}});
    absl::Status status;
    absl::Status submit = engine.SubmitChunk(unit, 0, n, grad.data(), p, [&status](absl::Status s) { status = s; });
    if (!submit.ok()) return submit;
    engine.WaitIdle();
    if (!status.ok()) return status;
  }
  meta["per_step"] = per_step;
  WriteFile(dir / "theta.f32", master.data(), n * 4);
  WriteFile(dir / "m.f32", m.data(), n * 4);
  WriteFile(dir / "v.f32", v.data(), n * 4);
  WriteFile(dir / "mirror.bf16", mirror.data(), n * 2);
  std::ofstream(dir / "meta.json") << meta.dump(2) << "\n";
  std::cout << "dump written to " << dir << "\n";
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  CLI::App app{"LayerAdam throughput vs host copy bandwidth"};
  int64_t params = int64_t{1} << 27;
  int threads = 0;
  int reps = 5;
  int64_t chunk_params = int64_t{1} << 22;
  std::string isa_name, pin = "core", grad_dtype = "fp32", dump_dir, mirror_store = "stream";
  int64_t dump_numel = int64_t{1} << 20;
  int64_t tensor_numel = 0;
  bool refuse_nonfinite = false;
  app.add_option("--params", params, "parameters (state = 14 B/param + 4 B/param gradient)");
  app.add_option("--tensor-numel", tensor_numel,
                 "lay the parameters out as tensors of this many elements, each followed by 256-element "
                 "alignment padding LayerAdam must skip (UnitMemory::tensors); 0 = one tensor, no padding");
  app.add_option("--threads", threads, "update and copy threads (0 = every physical core)");
  app.add_option("--reps", reps, "timed repetitions (median reported)");
  app.add_option("--chunk-params", chunk_params, "parameters per submitted chunk");
  app.add_option("--isa", isa_name, "scalar|avx2|avx512 (default: best supported)");
  app.add_option("--pin", pin, "worker pinning: core|node|none")->check(CLI::IsMember({"core", "node", "none"}));
  app.add_option("--grad", grad_dtype, "gradient dtype: fp32|bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--mirror-store", mirror_store, "BF16 mirror stores: stream|cached")
      ->check(CLI::IsMember({"stream", "cached"}));
  app.add_option("--dump", dump_dir, "write a torch comparison dump here and exit");
  app.add_option("--dump-numel", dump_numel, "elements in the dump");
  app.add_flag("--refuse-nonfinite", refuse_nonfinite,
               "check each block of the gradient for NaN/inf before updating it (NonFiniteGrad::kRefuse, "
               "what hostd uses for device-staged parts)");
  CLI11_PARSE(app, argc, argv);
  if (params <= 0 || reps <= 0 || chunk_params <= 0) {
    std::cerr << "--params, --reps and --chunk-params must be positive\n";
    return 2;
  }

  int cores = 0;
  {
    absl::StatusOr<std::vector<int>> per_node = CoresPerNumaNode();
    if (!per_node.ok()) {
      std::cerr << per_node.status() << "\n";
      return 1;
    }
    for (int c : *per_node) cores += c;
  }
  if (threads <= 0) threads = cores;
  LayerAdamOptions options;
  options.num_threads = threads;
  options.reserve_cores = 0;
  options.mirror_store = mirror_store == "stream" ? MirrorStore::kStreaming : MirrorStore::kCached;
  options.pinning =
      pin == "core" ? WorkerPinning::kCore : (pin == "node" ? WorkerPinning::kNumaNode : WorkerPinning::kNone);
  if (!isa_name.empty()) {
    absl::StatusOr<AdamIsa> isa = ParseAdamIsa(isa_name);
    if (!isa.ok()) {
      std::cerr << isa.status() << "\n";
      return 2;
    }
    options.isa = *isa;
  }
  absl::StatusOr<std::unique_ptr<LayerAdam>> created = LayerAdam::Create(options);
  if (!created.ok()) {
    std::cerr << created.status() << "\n";
    return 1;
  }
  LayerAdam& engine = **created;
  if (!dump_dir.empty()) {
    absl::Status s = Dump(dump_dir, dump_numel, 3, engine);
    if (!s.ok()) std::cerr << s << "\n";
    return s.ok() ? 0 : 1;
  }

  const bool bf16_grad = grad_dtype == "bf16";
  Mapping master(params * 4), m(params * 4), v(params * 4), mirror(params * 2), grad(params * (bf16_grad ? 2 : 4)),
      copy_dst(params * 4);
  UnitMemory unit{master.as<float>(), m.as<float>(), v.as<float>(), mirror.as<bf16_t>(), params, 0};
  std::vector<ElementRange> tensors;
  int64_t padding = 0;
  for (int64_t b = 0; tensor_numel > 0 && b < params; b += tensor_numel + 256) {
    tensors.push_back({b, std::min(params, b + tensor_numel)});
    padding += std::min<int64_t>(256, std::max<int64_t>(0, params - b - tensor_numel));
  }
  unit.tensors = tensors;
  // Prefault: the engine's workers touch the state (NUMA placement), then every array gets
  // values in parallel. Gradients are small and varied so no denormal or NaN path is timed.
  auto t0 = Clock::now();
  if (absl::Status s = engine.FirstTouch(unit); !s.ok()) {
    std::cerr << s << "\n";
    return 1;
  }
  ParallelForRanges(threads, params, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000003) * 1e-6f - 0.5f;
      master.as<float>()[i] = x * 0.1f;
      m.as<float>()[i] = 0;
      v.as<float>()[i] = 0;
      mirror.as<bf16_t>()[i] = 0;
      copy_dst.as<float>()[i] = 0;
      if (bf16_grad) {
        grad.as<bf16_t>()[i] = FloatToBf16(x * 1e-2f);
      } else {
        grad.as<float>()[i] = x * 1e-2f;
      }
    }
  });
  const double prefault_s = Seconds(t0, Clock::now());

  // The reference is the faster of the two copies (median), so the ratio is not flattered.
  const auto [memcpy_gbps, memcpy_gbps_best] =
      CopyBandwidth(CopyKind::kMemcpy, threads, master.as<char>(), copy_dst.as<char>(), params * 4, reps);
  const auto [plain_gbps, plain_gbps_best] =
      CopyBandwidth(CopyKind::kPlainStores, threads, master.as<char>(), copy_dst.as<char>(), params * 4, reps);
  const double copy_gbps = std::max(memcpy_gbps, plain_gbps);
  const double copy_gbps_best = std::max(memcpy_gbps_best, plain_gbps_best);

  std::vector<double> times;
  int64_t step = 0;
  for (int r = 0; r < reps + 1; ++r) {
    AdamWStepParams p;
    p.step = ++step;
    p.lr = 1e-4;
    p.nonfinite_grad = refuse_nonfinite ? NonFiniteGrad::kRefuse : NonFiniteGrad::kApply;
    const auto s0 = Clock::now();
    for (int64_t o = 0; o < params; o += chunk_params) {
      const int64_t n = std::min(chunk_params, params - o);
      auto done = [](absl::Status s) { CHECK(s.ok()) << s; };
      absl::Status s = bf16_grad ? engine.SubmitChunkBf16(unit, o, n, grad.as<bf16_t>() + o, p, done)
                                 : engine.SubmitChunk(unit, o, n, grad.as<float>() + o, p, done);
      CHECK(s.ok()) << s;
    }
    engine.WaitIdle();
    const double dt = Seconds(s0, Clock::now());
    if (r > 0) times.push_back(dt);
  }
  const double dt = Median(times);
  const double best = *std::min_element(times.begin(), times.end());
  const double params_per_s = params / dt;
  const double grad_bytes = bf16_grad ? 2 : 4;
  const double gbps28 = params_per_s * (24 + grad_bytes) / 1e9;  // 28 with an fp32 gradient
  const double gbps30 = params_per_s * (26 + grad_bytes) / 1e9;

  std::printf(
      "machine: %d physical cores, %d NUMA node(s); threads %d, isa %s, pin %s, grad %s, "
      "mirror stores %s\n",
      cores, engine.num_numa_nodes(), threads, AdamIsaName(engine.isa()).c_str(), pin.c_str(), grad_dtype.c_str(),
      mirror_store.c_str());
  std::printf("params %lld (%.2f GiB state), prefault %.2f s\n", static_cast<long long>(params),
              params * 14.0 / (1 << 30), prefault_s);
  std::printf(
      "copy bandwidth (read+write): memcpy %.1f GB/s, plain stores %.1f GB/s (median); "
      "reference %.1f\n",
      memcpy_gbps, plain_gbps, copy_gbps);
  std::printf(
      "LayerAdam: %.3f Gparam/s median (%.3f best), %.1f GB/s at %.0f B/param, %.1f GB/s "
      "at %.0f B/param with mirror\n",
      params_per_s / 1e9, params / best / 1e9, gbps28, 24 + grad_bytes, gbps30, 26 + grad_bytes);
  std::printf("ratio to copy bandwidth: %.2f (%.0f B/param), %.2f (with mirror)\n", gbps28 / copy_gbps, 24 + grad_bytes,
              gbps30 / copy_gbps);
  nlohmann::json j = {{"bench", "layeradam"},
                      {"params", params},
                      {"tensor_ranges", tensors.size()},
                      {"refuse_nonfinite", refuse_nonfinite},
                      {"padding_skipped", padding},
                      {"threads", threads},
                      {"cores", cores},
                      {"numa_nodes", engine.num_numa_nodes()},
                      {"isa", AdamIsaName(engine.isa())},
                      {"pin", pin},
                      {"grad", grad_dtype},
                      {"mirror_store", mirror_store},
                      {"chunk_params", chunk_params},
                      {"reps", reps},
                      {"copy_GBps_rw", copy_gbps},
                      {"memcpy_GBps_rw", memcpy_gbps},
                      {"plain_copy_GBps_rw", plain_gbps},
                      {"copy_GBps_rw_best", copy_gbps_best},
                      {"adam_s_per_step", dt},
                      {"adam_Gparam_per_s", params_per_s / 1e9},
                      {"adam_Gparam_per_s_best", params / best / 1e9},
                      {"adam_GBps_no_mirror", gbps28},
                      {"adam_GBps_with_mirror", gbps30},
                      {"ratio_no_mirror", gbps28 / copy_gbps},
                      {"ratio_with_mirror", gbps30 / copy_gbps}};
  std::cout << j.dump() << std::endl;
  return 0;
}

}  // namespace
}  // namespace slidedp::update

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  return slidedp::update::Main(argc, argv);
}
