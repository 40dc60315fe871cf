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

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "CLI/CLI.hpp"
#include "hostd/update/layer_adam.h"
#include "nlohmann/json.hpp"
#include "worker/pipeline/urgent_copy.h"

namespace {

#define CHECK_CUDA(x)                                                                    \
  do {                                                                                   \
    cudaError_t e_ = (x);                                                                \
    if (e_ != cudaSuccess) {                                                             \
      fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      exit(1);                                                                           \
    }                                                                                    \
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

struct BenchFlags {
  int max_gpus = 0;  // GPUs 0..max_gpus-1 (all visible ones once main has checked)
  int adam_threads = 0;
  double seconds = 2.0, copy_priority = 0.5, max_pause_ms = 2.0;
  int64_t mib = 256, adam_params = int64_t{1} << 27;
  Duty duty;
};

// --duty ON:OFF in ms, ON > 0.
bool ParseDuty(const std::string& text, Duty* duty) {
  std::vector<std::string> parts = absl::StrSplit(text, ':');
  return parts.size() == 2 && absl::SimpleAtod(parts[0], &duty->on_ms) && absl::SimpleAtod(parts[1], &duty->off_ms) &&
         duty->on_ms > 0 && duty->off_ms >= 0;
}

// What each copy thread has moved, read at one moment.
struct CopySnapshot {
  int64_t h2d, d2h, busy_ns;
};

std::vector<CopySnapshot> Snapshot(const std::vector<CopyCounters>& counters) {
  std::vector<CopySnapshot> out;
  for (auto& c : counters) out.push_back({c.h2d_bytes.load(), c.d2h_bytes.load(), c.busy_ns.load()});
  return out;
}

// One case's measurement window: the copy threads' counters and LayerAdam's at its ends.
struct Window {
  std::vector<CopySnapshot> s0, s1;
  int64_t a0 = 0, a1 = 0;           // parameters LayerAdam updated
  double paused0 = 0, paused1 = 0;  // LayerAdam's pauses for urgent copies, summed over its workers
  double dt = 0;                    // seconds
};

// The GPUs' buffers and streams, the urgent-copy words and LayerAdam with its own state: what every
// case runs on.
class CopyBench {
 public:
  explicit CopyBench(const BenchFlags& f);
  // LayerAdam over a separate state of adam_params parameters, run back to back in a loop.
  absl::Status CreateLayerAdam();
  // LayerAdam alone, then for n = 1, 2, 4, ... and all GPUs each direction alone and with LayerAdam.
  void RunAllCases();

 private:
  CaseResult RunCase(int n, Direction dir, Mode mode);
  void SetCopyPriority(Mode mode, int n);
  std::thread StartLayerAdamLoop(const std::atomic<bool>& stop, std::atomic<int64_t>* done);
  Window MeasureCopies(int n, Direction dir, std::atomic<uint32_t>* urgent, const std::atomic<int64_t>& adam_done);
  // Prints the case's JSON line.
  CaseResult Report(int n, Direction dir, Mode mode, const Window& w);
  // Prints the summary line of a case's runs (with_priority: none when copy_priority is 0).
  void PrintSummary(int n, Direction dir, const CaseResult& alone, const CaseResult& with,
                    const CaseResult* with_priority, const CaseResult& adam_alone);

  BenchFlags f_;
  size_t bytes_;  // per copy
  std::vector<GpuBuffers> bufs_;
  // One urgent-copy word per GPU, as the job's control block has one per rank.
  std::vector<std::atomic<uint32_t>> urgent_;
  std::vector<const std::atomic<uint32_t>*> urgent_words_;
  std::unique_ptr<slidedp::update::LayerAdam> adam_;
  std::vector<float> master_, m_, v_, grad_;
  std::vector<slidedp::bf16_t> mirror_;
};

CopyBench::CopyBench(const BenchFlags& f)
    : f_(f), bytes_(static_cast<size_t>(f.mib) << 20), bufs_(f.max_gpus), urgent_(f.max_gpus) {
  for (int g = 0; g < f_.max_gpus; ++g) {
    CHECK_CUDA(cudaSetDevice(g));
    CHECK_CUDA(cudaHostAlloc(&bufs_[g].host_src, bytes_, cudaHostAllocPortable));
    CHECK_CUDA(cudaHostAlloc(&bufs_[g].host_dst, bytes_, cudaHostAllocPortable));
    memset(bufs_[g].host_src, 1, bytes_);
    memset(bufs_[g].host_dst, 0, bytes_);
    CHECK_CUDA(cudaMalloc(&bufs_[g].dev_a, bytes_));
    CHECK_CUDA(cudaMalloc(&bufs_[g].dev_b, bytes_));
    CHECK_CUDA(cudaStreamCreateWithFlags(&bufs_[g].h2d, cudaStreamNonBlocking));
    CHECK_CUDA(cudaStreamCreateWithFlags(&bufs_[g].d2h, cudaStreamNonBlocking));
  }
  for (auto& w : urgent_) urgent_words_.push_back(&w);
}

absl::Status CopyBench::CreateLayerAdam() {
  slidedp::update::LayerAdamOptions o;
  o.num_threads = f_.adam_threads;
  auto a = slidedp::update::LayerAdam::Create(o);
  if (!a.ok()) return a.status();
  adam_ = std::move(*a);
  master_.assign(f_.adam_params, 0.01f);
  m_.assign(f_.adam_params, 0.0f);
  v_.assign(f_.adam_params, 0.0f);
  grad_.assign(f_.adam_params, 0.001f);
  mirror_.assign(f_.adam_params, 0);
  return absl::OkStatus();
}

void CopyBench::RunAllCases() {
  CaseResult adam_alone;
  if (adam_) adam_alone = RunCase(0, Direction::kH2D, Mode::kAdamAlone);
  std::vector<int> counts;  // 1, 2, 4, ... and all of them
  for (int n = 1; n < f_.max_gpus; n *= 2) counts.push_back(n);
  counts.push_back(f_.max_gpus);
  for (int n : counts) {
    for (Direction d : {Direction::kH2D, Direction::kD2H, Direction::kBoth}) {
      const CaseResult alone = RunCase(n, d, Mode::kCopiesAlone);
      if (!adam_) continue;
      const CaseResult with = RunCase(n, d, Mode::kWithAdam);
      if (f_.copy_priority > 0) {
        const CaseResult pri = RunCase(n, d, Mode::kWithAdamPriority);
        PrintSummary(n, d, alone, with, &pri, adam_alone);
      } else {
        PrintSummary(n, d, alone, with, nullptr, adam_alone);
      }
    }
  }
}

CaseResult CopyBench::RunCase(int n, Direction dir, Mode mode) {
  const bool with_adam = mode != Mode::kCopiesAlone;
  if (with_adam) SetCopyPriority(mode, n);  // (the engine is idle between cases)
  std::atomic<bool> adam_stop{false};
  std::atomic<int64_t> adam_done{0};
  std::thread adam_thread;
  if (with_adam) adam_thread = StartLayerAdamLoop(adam_stop, &adam_done);
  const bool priority = mode == Mode::kWithAdamPriority;
  const Window w = MeasureCopies(n, dir, priority ? urgent_.data() : nullptr, adam_done);
  adam_stop = true;
  if (adam_thread.joinable()) adam_thread.join();
  if (with_adam) adam_->ClearCopyPriority();
  return Report(n, dir, mode, w);
}

void CopyBench::SetCopyPriority(Mode mode, int n) {
  if (mode != Mode::kWithAdamPriority) {
    adam_->ClearCopyPriority();
    return;
  }
  absl::Status s = adam_->SetCopyPriority(absl::MakeConstSpan(urgent_words_).first(n), f_.copy_priority,
                                          absl::Microseconds(f_.max_pause_ms * 1000));
  if (!s.ok()) {
    fprintf(stderr, "SetCopyPriority: %s\n", s.ToString().c_str());
    exit(1);
  }
}

std::thread CopyBench::StartLayerAdamLoop(const std::atomic<bool>& stop, std::atomic<int64_t>* done) {
  return std::thread([this, &stop, done] {
    slidedp::update::UnitMemory unit{master_.data(), m_.data(), v_.data(), mirror_.data(), f_.adam_params, 0};
    slidedp::update::AdamWStepParams p;
    p.lr = 1e-5;
    int64_t step = 1;
    while (!stop.load()) {
      p.step = step++;
      absl::Notification chunk_done;
      if (!adam_->SubmitChunk(unit, 0, f_.adam_params, grad_.data(), p, [&](absl::Status) { chunk_done.Notify(); })
               .ok())
        return;
      chunk_done.WaitForNotification();
      done->fetch_add(f_.adam_params);
    }
  });
}

// Runs GPUs 0..n-1's copy threads (`urgent`: their words, with copy priority on) through a
// warm-up and the measured window, then stops them.
Window CopyBench::MeasureCopies(int n, Direction dir, std::atomic<uint32_t>* urgent,
                                const std::atomic<int64_t>& adam_done) {
  std::atomic<bool> stop{false};
  std::atomic<int> ready{0};
  std::vector<CopyCounters> counters(n);
  std::vector<std::thread> threads;
  for (int g = 0; g < n; ++g) {
    threads.emplace_back(CopyLoop, g, std::cref(bufs_[g]), bytes_, dir, f_.duty, urgent ? urgent + g : nullptr,
                         std::cref(stop), std::ref(ready), &counters[g]);
  }
  while (ready.load() < n) std::this_thread::yield();
  absl::SleepFor(absl::Milliseconds(200));  // warm-up: let every engine start
  // Counters advance in batches of 4 copies, so a measurement window of >= 1 s is accurate to a
  // few percent.
  Window w;
  w.s0 = Snapshot(counters);
  w.a0 = adam_done.load();
  w.paused0 = adam_ ? adam_->paused_s() : 0;
  const absl::Time t0 = absl::Now();
  absl::SleepFor(absl::Seconds(f_.seconds));
  w.s1 = Snapshot(counters);
  w.a1 = adam_done.load();
  w.paused1 = adam_ ? adam_->paused_s() : 0;
  w.dt = absl::ToDoubleSeconds(absl::Now() - t0);
  stop = true;
  for (auto& t : threads) t.join();
  return w;
}

CaseResult CopyBench::Report(int n, Direction dir, Mode mode, const Window& w) {
  const bool with_adam = mode != Mode::kCopiesAlone;
  const bool priority = mode == Mode::kWithAdamPriority;
  nlohmann::json per_gpu = nlohmann::json::array();
  CaseResult r;
  double total = 0, h2d_total = 0;
  for (int g = 0; g < n; ++g) {
    const double busy = std::max(1e-9, (w.s1[g].busy_ns - w.s0[g].busy_ns) * 1e-9);
    const double gbs_h = (w.s1[g].h2d - w.s0[g].h2d) / busy / 1e9, gbs_d = (w.s1[g].d2h - w.s0[g].d2h) / busy / 1e9;
    per_gpu.push_back({{"gpu", g}, {"h2d_gbs", gbs_h}, {"d2h_gbs", gbs_d}, {"copying_fraction", busy / w.dt}});
    total += gbs_h + gbs_d;
    h2d_total += gbs_h;
  }
  nlohmann::json j = {{"case", Name(mode)},
                      {"gpus", n},
                      {"direction", n > 0 ? Name(dir) : "none"},
                      {"layeradam", with_adam},
                      {"copy_priority", priority ? f_.copy_priority : 0.0},
                      {"duty_ms", {f_.duty.on_ms, f_.duty.off_ms}},
                      {"copy_mib", f_.mib},
                      {"per_gpu", per_gpu},
                      {"total_gbs", total},
                      {"per_gpu_avg_gbs", n > 0 ? total / n : 0.0}};
  if (n > 0) {
    r.per_gpu_avg_gbs = total / n;
    r.per_gpu_h2d_gbs = h2d_total / n;
  }
  if (with_adam) {
    r.adam_gparams = (w.a1 - w.a0) / w.dt / 1e9;
    j["layeradam_gparams_per_s"] = r.adam_gparams;
    j["layeradam_paused_s"] = w.paused1 - w.paused0;  // summed over its workers
  }
  printf("%s\n", j.dump().c_str());
  fflush(stdout);
  return r;
}

void CopyBench::PrintSummary(int n, Direction dir, const CaseResult& alone, const CaseResult& with,
                             const CaseResult* with_priority, const CaseResult& adam_alone) {
  auto ratio = [](double a, double b) { return b > 0 ? a / b : 0.0; };
  nlohmann::json sum = {{"summary", true},
                        {"gpus", n},
                        {"direction", Name(dir)},
                        {"duty_ms", {f_.duty.on_ms, f_.duty.off_ms}},
                        {"copy_gbs_alone", alone.per_gpu_avg_gbs},
                        {"copy_gbs_with_adam", with.per_gpu_avg_gbs},
                        {"copy_ratio_with_adam", ratio(with.per_gpu_avg_gbs, alone.per_gpu_avg_gbs)},
                        {"h2d_ratio_with_adam", ratio(with.per_gpu_h2d_gbs, alone.per_gpu_h2d_gbs)},
                        {"adam_gparams_alone", adam_alone.adam_gparams},
                        {"adam_gparams_with_copies", with.adam_gparams},
                        {"adam_ratio_with_copies", ratio(with.adam_gparams, adam_alone.adam_gparams)}};
  if (with_priority != nullptr) {
    const CaseResult& pri = *with_priority;
    sum["copy_priority"] = f_.copy_priority;
    sum["copy_gbs_with_adam_priority"] = pri.per_gpu_avg_gbs;
    sum["copy_ratio_with_adam_priority"] = ratio(pri.per_gpu_avg_gbs, alone.per_gpu_avg_gbs);
    sum["h2d_ratio_with_adam_priority"] = ratio(pri.per_gpu_h2d_gbs, alone.per_gpu_h2d_gbs);
    sum["adam_gparams_with_copies_priority"] = pri.adam_gparams;
    sum["adam_ratio_with_copies_priority"] = ratio(pri.adam_gparams, adam_alone.adam_gparams);
  }
  printf("%s\n", sum.dump().c_str());
  fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"slidedp host-link contention benchmark"};
  BenchFlags f;
  std::string duty_text;
  app.add_option("--gpus", f.max_gpus, "use GPUs 0..N-1 (0: all visible)");
  app.add_option("--seconds", f.seconds, "measuring time per case");
  app.add_option("--mib", f.mib, "bytes per copy, MiB");
  app.add_option("--adam-params", f.adam_params, "parameters LayerAdam updates in a loop (0: no LayerAdam cases)");
  app.add_option("--adam-threads", f.adam_threads, "LayerAdam threads (0: its default)");
  app.add_option("--copy-priority", f.copy_priority,
                 "fraction of LayerAdam workers that yield to urgent H2D copies in the priority cases (0: none)")
      ->check(CLI::Range(0.0, 1.0));
  app.add_option("--max-pause-ms", f.max_pause_ms, "LayerAdam's longest pause for an urgent copy");
  app.add_option("--duty", duty_text, "ON:OFF ms: copy for ON ms, idle for OFF ms (default: copy all the time)");
  CLI11_PARSE(app, argc, argv);
  if (!duty_text.empty() && !ParseDuty(duty_text, &f.duty)) {
    fprintf(stderr, "--duty: expected ON:OFF in ms (ON > 0), got '%s'\n", duty_text.c_str());
    return 2;
  }

  int visible = 0;
  CHECK_CUDA(cudaGetDeviceCount(&visible));
  if (f.max_gpus <= 0 || f.max_gpus > visible) f.max_gpus = visible;
  CopyBench bench(f);
  if (f.adam_params > 0) {
    if (absl::Status s = bench.CreateLayerAdam(); !s.ok()) {
      fprintf(stderr, "LayerAdam: %s\n", s.ToString().c_str());
      return 1;
    }
  }
  bench.RunAllCases();
  return 0;
}
