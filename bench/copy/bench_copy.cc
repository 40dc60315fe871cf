// bench_copy: what the host link gives each GPU when several copy at once, the SlideDP pattern
// (every worker streams parameters H2D and gradients D2H through pinned host memory while the CPU
// runs LayerAdam over the same memory system). For n = 1..--gpus GPUs copying together, in each
// direction alone and both at once, without and with LayerAdam running on --adam-threads threads,
// prints one JSON line per case: per-GPU and total GB/s (and LayerAdam's Gparam/s meanwhile).
//
// DMA before Adam (docs/layeradam.md): with --copy-priority F > 0 each case also runs with LayerAdam
// configured to yield (SetCopyPriority, fraction F) to one urgent-copy word per GPU, which the copy
// thread raises around each batch of H2D copies exactly as the CUDA streamer does (UrgentCopyMark).
// --duty ON:OFF (ms) makes the copies bursty, as a step's parameter loads are, so LayerAdam's rate
// with priority on is meaningful. After the three runs of a case (copies alone, with LayerAdam,
// with LayerAdam + priority) a "summary" line gives the ratios: copies with LayerAdam / alone and
// LayerAdam with copies / alone (measured once, first: "layeradam_alone").
#include <cuda_runtime_api.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "hostd/update/layer_adam.h"
#include "nlohmann/json.hpp"
#include "worker/pipeline/urgent_copy.h"

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

// Bursty copies: copy for on_ms, then idle for off_ms (on_ms 0: copy all the time).
struct Duty {
  double on_ms = 0;
  double off_ms = 0;
};

// What one GPU's copy thread has moved, and for how long it was copying (a batch's issue to its
// end): GB/s are bytes over that time, so idle gaps of a duty cycle do not count.
struct CopyCounters {
  std::atomic<int64_t> h2d_bytes{0}, d2h_bytes{0}, busy_ns{0};
};

// Copies in `dir` on GPU `g` until `stop`. With `urgent` (copy priority on), each batch of H2D
// copies raises it from before the first is queued until the stream has run the last.
void CopyLoop(int g, const GpuBuffers& b, size_t bytes, Direction dir, Duty duty, std::atomic<uint32_t>* urgent,
              const std::atomic<bool>& stop, std::atomic<int>& ready, CopyCounters* c) {
  CHECK_CUDA(cudaSetDevice(g));
  ready.fetch_add(1);
  absl::Time burst_end = absl::Now() + absl::Milliseconds(duty.on_ms);
  while (!stop.load()) {
    const absl::Time t0 = absl::Now();
    {
      slidedp::UrgentCopyMark mark(dir != Direction::kD2H ? urgent : nullptr);
      // Batches of 4 copies per stream keep the copy engines busy between host checks.
      for (int i = 0; i < 4; ++i) {
        if (dir != Direction::kD2H)
          CHECK_CUDA(cudaMemcpyAsync(b.dev_a, b.host_src, bytes, cudaMemcpyHostToDevice, b.h2d));
        if (dir != Direction::kH2D)
          CHECK_CUDA(cudaMemcpyAsync(b.host_dst, b.dev_b, bytes, cudaMemcpyDeviceToHost, b.d2h));
      }
      if (absl::Status s = mark.LowerAfter(b.h2d); !s.ok()) {
        fprintf(stderr, "%s\n", s.ToString().c_str());
        exit(1);
      }
    }
    CHECK_CUDA(cudaStreamSynchronize(b.h2d));
    CHECK_CUDA(cudaStreamSynchronize(b.d2h));
    const absl::Time t1 = absl::Now();
    c->busy_ns.fetch_add(absl::ToInt64Nanoseconds(t1 - t0));
    if (dir != Direction::kD2H) c->h2d_bytes.fetch_add(4 * static_cast<int64_t>(bytes));
    if (dir != Direction::kH2D) c->d2h_bytes.fetch_add(4 * static_cast<int64_t>(bytes));
    if (duty.on_ms > 0 && t1 >= burst_end) {
      const absl::Time idle_end = t1 + absl::Milliseconds(duty.off_ms);
      while (!stop.load() && absl::Now() < idle_end) absl::SleepFor(absl::Milliseconds(1));
      burst_end = absl::Now() + absl::Milliseconds(duty.on_ms);
    }
  }
}

enum class Mode { kCopiesAlone, kWithAdam, kWithAdamPriority, kAdamAlone };
const char* Name(Mode m) {
  switch (m) {
    case Mode::kCopiesAlone: return "copies_alone";
    case Mode::kWithAdam: return "with_layeradam";
    case Mode::kWithAdamPriority: return "with_layeradam_priority";
    case Mode::kAdamAlone: return "layeradam_alone";
  }
  return "?";
}

struct CaseResult {
  double per_gpu_avg_gbs = 0;  // H2D + D2H per GPU, while copying
  double per_gpu_h2d_gbs = 0;
  double adam_gparams = 0;  // LayerAdam's rate meanwhile (wall time)
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"slidedp host-link contention benchmark"};
  int max_gpus = 0, adam_threads = 0;
  double seconds = 2.0, copy_priority = 0.5, max_pause_ms = 2.0;
  int64_t mib = 256, adam_params = int64_t{1} << 27;
  std::string duty_text;
  app.add_option("--gpus", max_gpus, "use GPUs 0..N-1 (0: all visible)");
  app.add_option("--seconds", seconds, "measuring time per case");
  app.add_option("--mib", mib, "bytes per copy, MiB");
  app.add_option("--adam-params", adam_params, "parameters LayerAdam updates in a loop (0: no LayerAdam cases)");
  app.add_option("--adam-threads", adam_threads, "LayerAdam threads (0: its default)");
  app.add_option("--copy-priority", copy_priority,
                 "fraction of LayerAdam workers that yield to urgent H2D copies in the priority cases (0: none)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--max-pause-ms", max_pause_ms, "LayerAdam's longest pause for an urgent copy");
  app.add_option("--duty", duty_text, "ON:OFF ms: copy for ON ms, idle for OFF ms (default: copy all the time)");
  CLI11_PARSE(app, argc, argv);
  Duty duty;
  if (!duty_text.empty()) {
    std::vector<std::string> parts = absl::StrSplit(duty_text, ':');
    if (parts.size() != 2 || !absl::SimpleAtod(parts[0], &duty.on_ms) || !absl::SimpleAtod(parts[1], &duty.off_ms) ||
        duty.on_ms <= 0 || duty.off_ms < 0) {
      fprintf(stderr, "--duty: expected ON:OFF in ms (ON > 0), got '%s'\n", duty_text.c_str());
      return 2;
    }
  }

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
  // One urgent-copy word per GPU, as the job's control block has one per rank.
  std::vector<std::atomic<uint32_t>> urgent(max_gpus);
  std::vector<const std::atomic<uint32_t>*> urgent_words;
  for (auto& w : urgent) urgent_words.push_back(&w);

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
  auto run_case = [&](int n, Direction dir, Mode mode) -> CaseResult {
    const bool with_adam = mode != Mode::kCopiesAlone;
    const bool priority = mode == Mode::kWithAdamPriority;
    if (with_adam) {  // (the engine is idle between cases)
      if (priority) {
        absl::Status s = adam->SetCopyPriority(absl::MakeConstSpan(urgent_words).first(n), copy_priority,
                                               absl::Microseconds(max_pause_ms * 1000));
        if (!s.ok()) {
          fprintf(stderr, "SetCopyPriority: %s\n", s.ToString().c_str());
          exit(1);
        }
      } else {
        adam->ClearCopyPriority();
      }
    }
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
    std::vector<CopyCounters> counters(n);
    std::vector<std::thread> threads;
    for (int g = 0; g < n; ++g) {
      threads.emplace_back(CopyLoop, g, std::cref(bufs[g]), bytes, dir, duty, priority ? &urgent[g] : nullptr,
                           std::cref(stop), std::ref(ready), &counters[g]);
    }
    while (ready.load() < n) std::this_thread::yield();
    absl::SleepFor(absl::Milliseconds(200));  // warm-up: let every engine start
    struct Snap {
      int64_t h2d, d2h, busy_ns;
    };
    auto snapshot = [&] {
      std::vector<Snap> out;
      for (auto& c : counters) out.push_back({c.h2d_bytes.load(), c.d2h_bytes.load(), c.busy_ns.load()});
      return out;
    };
    // Counters advance in batches of 4 copies, so a measurement window of >= 1 s is accurate to a
    // few percent.
    const std::vector<Snap> s0 = snapshot();
    const int64_t a0 = adam_done.load();
    const double paused0 = adam ? adam->paused_s() : 0;
    const absl::Time t0 = absl::Now();
    absl::SleepFor(absl::Seconds(seconds));
    const std::vector<Snap> s1 = snapshot();
    const int64_t a1 = adam_done.load();
    const double paused1 = adam ? adam->paused_s() : 0;
    const double dt = absl::ToDoubleSeconds(absl::Now() - t0);
    stop = true;
    for (auto& t : threads) t.join();
    adam_stop = true;
    if (adam_thread.joinable()) adam_thread.join();
    if (with_adam) adam->ClearCopyPriority();
    nlohmann::json per_gpu = nlohmann::json::array();
    CaseResult r;
    double total = 0, h2d_total = 0;
    for (int g = 0; g < n; ++g) {
      const double busy = std::max(1e-9, (s1[g].busy_ns - s0[g].busy_ns) * 1e-9);
      const double gbs_h = (s1[g].h2d - s0[g].h2d) / busy / 1e9, gbs_d = (s1[g].d2h - s0[g].d2h) / busy / 1e9;
      per_gpu.push_back({{"gpu", g}, {"h2d_gbs", gbs_h}, {"d2h_gbs", gbs_d}, {"copying_fraction", busy / dt}});
      total += gbs_h + gbs_d;
      h2d_total += gbs_h;
    }
    nlohmann::json j = {{"case", Name(mode)},
                        {"gpus", n},
                        {"direction", n > 0 ? Name(dir) : "none"},
                        {"layeradam", with_adam},
                        {"copy_priority", priority ? copy_priority : 0.0},
                        {"duty_ms", {duty.on_ms, duty.off_ms}},
                        {"copy_mib", mib},
                        {"per_gpu", per_gpu},
                        {"total_gbs", total},
                        {"per_gpu_avg_gbs", n > 0 ? total / n : 0.0}};
    if (n > 0) {
      r.per_gpu_avg_gbs = total / n;
      r.per_gpu_h2d_gbs = h2d_total / n;
    }
    if (with_adam) {
      r.adam_gparams = (a1 - a0) / dt / 1e9;
      j["layeradam_gparams_per_s"] = r.adam_gparams;
      j["layeradam_paused_s"] = paused1 - paused0;  // summed over its workers
    }
    printf("%s\n", j.dump().c_str());
    fflush(stdout);
    return r;
  };
  CaseResult adam_alone;
  if (adam) adam_alone = run_case(0, Direction::kH2D, Mode::kAdamAlone);
  std::vector<int> counts;  // 1, 2, 4, ... and all of them
  for (int n = 1; n < max_gpus; n *= 2) counts.push_back(n);
  counts.push_back(max_gpus);
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  for (int n : counts) {
    for (Direction d : {Direction::kH2D, Direction::kD2H, Direction::kBoth}) {
      const CaseResult alone = run_case(n, d, Mode::kCopiesAlone);
      if (!adam) continue;
      const CaseResult with = run_case(n, d, Mode::kWithAdam);
      nlohmann::json sum = {{"summary", true},
                            {"gpus", n},
                            {"direction", Name(d)},
                            {"duty_ms", {duty.on_ms, duty.off_ms}},
                            {"copy_gbs_alone", alone.per_gpu_avg_gbs},
                            {"copy_gbs_with_adam", with.per_gpu_avg_gbs},
                            {"copy_ratio_with_adam", ratio(with.per_gpu_avg_gbs, alone.per_gpu_avg_gbs)},
                            {"h2d_ratio_with_adam", ratio(with.per_gpu_h2d_gbs, alone.per_gpu_h2d_gbs)},
                            {"adam_gparams_alone", adam_alone.adam_gparams},
                            {"adam_gparams_with_copies", with.adam_gparams},
                            {"adam_ratio_with_copies", ratio(with.adam_gparams, adam_alone.adam_gparams)}};
      if (copy_priority > 0) {
        const CaseResult pri = run_case(n, d, Mode::kWithAdamPriority);
        sum["copy_priority"] = copy_priority;
        sum["copy_gbs_with_adam_priority"] = pri.per_gpu_avg_gbs;
        sum["copy_ratio_with_adam_priority"] = ratio(pri.per_gpu_avg_gbs, alone.per_gpu_avg_gbs);
        sum["h2d_ratio_with_adam_priority"] = ratio(pri.per_gpu_h2d_gbs, alone.per_gpu_h2d_gbs);
        sum["adam_gparams_with_copies_priority"] = pri.adam_gparams;
        sum["adam_ratio_with_copies_priority"] = ratio(pri.adam_gparams, adam_alone.adam_gparams);
      }
      printf("%s\n", sum.dump().c_str());
      fflush(stdout);
    }
  }
  return 0;
}
