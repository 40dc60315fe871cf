// bench_copy: what the host link gives each GPU when several copy at once, the SlideDP pattern
// (every worker streams parameters H2D and gradients D2H through pinned host memory while the CPU
// runs LayerAdam over the same memory system). For n = 1..--gpus GPUs copying together, in each
// direction alone and both at once, without and with LayerAdam running on --adam-threads threads,
// prints one JSON line per case: per-GPU and total GB/s (and LayerAdam's Gparam/s meanwhile).
#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "hostd/update/layer_adam.h"
#include "nlohmann/json.hpp"

namespace {

#define CHECK_CUDA(x)                                                                   \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                          \
    }                                                                                   \
  } while (0)

struct GpuBuffers {
  void* host_src = nullptr;  // pinned, H2D source
  void* host_dst = nullptr;  // pinned, D2H target
  void* dev_a = nullptr;
  void* dev_b = nullptr;
  cudaStream_t h2d = nullptr, d2h = nullptr;
};

enum class Direction { kH2D, kD2H, kBoth };
const char* Name(Direction d) { return d == Direction::kH2D ? "h2d" : d == Direction::kD2H ? "d2h" : "both"; }

// Copies in `dir` on GPU `g` until `stop`; returns bytes moved per direction.
void CopyLoop(int g, const GpuBuffers& b, size_t bytes, Direction dir, const std::atomic<bool>& stop,
              std::atomic<int>& ready, std::atomic<int64_t>* h2d_bytes, std::atomic<int64_t>* d2h_bytes) {
  CHECK_CUDA(cudaSetDevice(g));
  ready.fetch_add(1);
  while (!stop.load()) {
    // Batches of 4 copies per stream keep the copy engines busy between host checks.
    for (int i = 0; i < 4; ++i) {
      if (dir != Direction::kD2H) CHECK_CUDA(cudaMemcpyAsync(b.dev_a, b.host_src, bytes, cudaMemcpyHostToDevice, b.h2d));
      if (dir != Direction::kH2D) CHECK_CUDA(cudaMemcpyAsync(b.host_dst, b.dev_b, bytes, cudaMemcpyDeviceToHost, b.d2h));
    }
    CHECK_CUDA(cudaStreamSynchronize(b.h2d));
    CHECK_CUDA(cudaStreamSynchronize(b.d2h));
    if (dir != Direction::kD2H) h2d_bytes->fetch_add(4 * static_cast<int64_t>(bytes));
    if (dir != Direction::kH2D) d2h_bytes->fetch_add(4 * static_cast<int64_t>(bytes));
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"slidedp host-link contention benchmark"};
  int max_gpus = 0, adam_threads = 0;
  double seconds = 2.0;
  int64_t mib = 256, adam_params = int64_t{1} << 27;
  app.add_option("--gpus", max_gpus, "use GPUs 0..N-1 (0: all visible)");
  app.add_option("--seconds", seconds, "measuring time per case");
  app.add_option("--mib", mib, "bytes per copy, MiB");
  app.add_option("--adam-params", adam_params, "parameters LayerAdam updates in a loop (0: no LayerAdam cases)");
  app.add_option("--adam-threads", adam_threads, "LayerAdam threads (0: its default)");
  CLI11_PARSE(app, argc, argv);

  int visible = 0;
  CHECK_CUDA(cudaGetDeviceCount(&visible));
  if (max_gpus <= 0 || max_gpus > visible) max_gpus = visible;
  const size_t bytes = static_cast<size_t>(mib) << 20;
  std::vector<GpuBuffers> bufs(max_gpus);
  for (int g = 0; g < max_gpus; ++g) {
    CHECK_CUDA(cudaSetDevice(g));
    CHECK_CUDA(cudaHostAlloc(&bufs[g].host_src, bytes, cudaHostAllocPortable));
    CHECK_CUDA(cudaHostAlloc(&bufs[g].host_dst, bytes, cudaHostAllocPortable));
    memset(bufs[g].host_src, 1, bytes);
    memset(bufs[g].host_dst, 0, bytes);
    CHECK_CUDA(cudaMalloc(&bufs[g].dev_a, bytes));
    CHECK_CUDA(cudaMalloc(&bufs[g].dev_b, bytes));
    CHECK_CUDA(cudaStreamCreateWithFlags(&bufs[g].h2d, cudaStreamNonBlocking));
    CHECK_CUDA(cudaStreamCreateWithFlags(&bufs[g].d2h, cudaStreamNonBlocking));
  }

  // LayerAdam over a separate state of adam_params parameters, run back to back in a loop.
  std::unique_ptr<slidedp::update::LayerAdam> adam;
  std::vector<float> master, m, v, grad;
  std::vector<slidedp::bf16_t> mirror;
  if (adam_params > 0) {
    slidedp::update::LayerAdamOptions o;
    o.num_threads = adam_threads;
    auto a = slidedp::update::LayerAdam::Create(o);
    if (!a.ok()) {
      fprintf(stderr, "LayerAdam: %s\n", a.status().ToString().c_str());
      return 1;
    }
    adam = std::move(*a);
    master.assign(adam_params, 0.01f);
    m.assign(adam_params, 0.0f);
    v.assign(adam_params, 0.0f);
    grad.assign(adam_params, 0.001f);
    mirror.assign(adam_params, 0);
  }
  auto run_case = [&](int n, Direction dir, bool with_adam) {
    std::atomic<bool> stop{false}, adam_stop{false};
    std::atomic<int> ready{0};
    std::atomic<int64_t> adam_done{0};
    std::thread adam_thread;
    if (with_adam) {
      adam_thread = std::thread([&] {
        slidedp::update::UnitMemory unit{master.data(), m.data(), v.data(), mirror.data(), adam_params, 0};
        slidedp::update::AdamWStepParams p;
        p.lr = 1e-5;
        int64_t step = 1;
        while (!adam_stop.load()) {
          p.step = step++;
          absl::Notification done;
          if (!adam->SubmitChunk(unit, 0, adam_params, grad.data(), p, [&](absl::Status) { done.Notify(); }).ok()) return;
          done.WaitForNotification();
          adam_done.fetch_add(adam_params);
        }
      });
    }
    std::vector<std::atomic<int64_t>> h2d(n), d2h(n);
    std::vector<std::thread> threads;
    for (int g = 0; g < n; ++g) {
      threads.emplace_back(CopyLoop, g, std::cref(bufs[g]), bytes, dir, std::cref(stop), std::ref(ready), &h2d[g], &d2h[g]);
    }
    while (ready.load() < n) std::this_thread::yield();
    absl::SleepFor(absl::Milliseconds(200));  // warm-up: let every engine start
    auto snapshot = [&](std::vector<std::atomic<int64_t>>& c) {
      std::vector<int64_t> out;
      for (auto& x : c) out.push_back(x.load());
      return out;
    };
    // Counters advance in batches of 4 copies, so a measurement window of >= 1 s is accurate to a
    // few percent.
    const std::vector<int64_t> h0 = snapshot(h2d), d0 = snapshot(d2h);
    const int64_t a0 = adam_done.load();
    const absl::Time t0 = absl::Now();
    absl::SleepFor(absl::Seconds(seconds));
    const std::vector<int64_t> h1 = snapshot(h2d), d1 = snapshot(d2h);
    const int64_t a1 = adam_done.load();
    const double dt = absl::ToDoubleSeconds(absl::Now() - t0);
    stop = true;
    for (auto& t : threads) t.join();
    adam_stop = true;
    if (adam_thread.joinable()) adam_thread.join();
    nlohmann::json per_gpu = nlohmann::json::array();
    double total = 0;
    for (int g = 0; g < n; ++g) {
      const double gbs_h = (h1[g] - h0[g]) / dt / 1e9, gbs_d = (d1[g] - d0[g]) / dt / 1e9;
      per_gpu.push_back({{"gpu", g}, {"h2d_gbs", gbs_h}, {"d2h_gbs", gbs_d}});
      total += gbs_h + gbs_d;
    }
    nlohmann::json j = {{"gpus", n}, {"direction", Name(dir)}, {"layeradam", with_adam}, {"copy_mib", mib},
                        {"per_gpu", per_gpu}, {"total_gbs", total}, {"per_gpu_avg_gbs", total / n}};
    if (with_adam) j["layeradam_gparams_per_s"] = (a1 - a0) / dt / 1e9;
    printf("%s\n", j.dump().c_str());
    fflush(stdout);
  };
  for (bool with_adam : {false, true}) {
    if (with_adam && !adam) continue;
    std::vector<int> counts;  // 1, 2, 4, ... and all of them
    for (int n = 1; n < max_gpus; n *= 2) counts.push_back(n);
    counts.push_back(max_gpus);
    for (int n : counts) {
      for (Direction d : {Direction::kH2D, Direction::kD2H, Direction::kBoth}) run_case(n, d, with_adam);
    }
  }
  return 0;
}
