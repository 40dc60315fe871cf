// bench_layeradam: LayerAdam's update throughput against the host's memory bandwidth, measured in
// the same run: a STREAM-like triad on LayerAdam's own workers (the memory wall it is judged
// against), and memory-copy bandwidth with the same number of threads.
//
// Traffic conventions (all reported):
//   28 B/param: read master, m, v, grad (16), write master, m, v (12) -- the convention of
//               ../shared/bench/peers/cpu_probe.py for torch's AdamW, which has no mirror;
//   30 B/param: the above plus the BF16 mirror LayerAdam writes in the same pass. These are the
//               bytes it really moves: master, m and v are read before they are written (their
//               stores cost no extra read), and the mirror is written with streaming stores (no
//               write-allocate read). With --mirror-store cached the mirror's lines are read first:
//               32 B moved.
// Copy bandwidth counts bytes read + written (a memcpy of B bytes moves 2B).
// Triad a[i] = b[i] + s*c[i], run with streaming stores to a (12 B/element moved: read b and c,
// write a) and with cached stores (12 B/element by STREAM's convention, 16 B moved: each line of
// a is read before it is written). The triad reference is the faster of the two in bytes moved,
// and ratio_to_triad = LayerAdam's bytes moved per second / that: both sides count what crosses
// the memory bus, so neither is flattered by an uncounted write-allocate.
//
// Compact Adam moments (--state bf16|int8, optimizer.state_dtype; docs/optimizer-state.md) move
// fewer bytes: m and v read and written as 2 B each (bf16: 8 B/param instead of 16) or as 1-byte
// codes plus an FP32 scale per 256 (int8: 4.06 B/param); the figures count those.
//
//   bench_layeradam [--params N] [--threads T] [--reps R] [--chunk-params C] [--isa avx512]
//                   [--pin core|node|none] [--grad fp32|bf16] [--mirror-store stream|cached]
//                   [--state fp32|bf16|int8] [--dump DIR]
// The last stdout line is one JSON object with every figure.
#include <immintrin.h>
#include <sys/mman.h>
#include <sys/resource.h>

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
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "hostd/update/adamw_kernels.h"
#include "hostd/update/layer_adam.h"
#include "nlohmann/json.hpp"

namespace slidedp::update {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Anonymous mapping, 2 MiB aligned (mapped 2 MiB larger, the ends trimmed) and rounded up to 2 MiB,
// transparent huge pages requested: a range starting on a 2 MiB boundary shares no huge page with
// the range before it, so each worker's first touch places only its own pages.
struct Mapping {
  static constexpr size_t kAlign = size_t{2} << 20;
  explicit Mapping(size_t bytes) : size((bytes + kAlign - 1) / kAlign * kAlign) {
    void* raw = mmap(nullptr, size + kAlign, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(raw != MAP_FAILED) << "mmap " << size << " bytes failed";
    const uintptr_t begin = reinterpret_cast<uintptr_t>(raw);
    const uintptr_t aligned = (begin + kAlign - 1) / kAlign * kAlign;
    if (aligned > begin) munmap(raw, aligned - begin);
    if (begin + kAlign > aligned) munmap(reinterpret_cast<void*>(aligned + size), begin + kAlign - aligned);
    ptr = reinterpret_cast<void*>(aligned);
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

// GB/s over repetitions.
struct Bandwidth {
  double median = 0;
  double best = 0;
};

enum class TriadStores { kStreaming, kCached };

// STREAM's triad a[i] = b[i] + s * c[i] over n elements (a, b, c 64-byte aligned, n a multiple of
// 16), at the vector width of LayerAdam's kernels (TriadFor), so the reference gets no wider loads
// and stores than the update it is compared with. Streaming stores end with a fence, inside the
// timed pass, as LayerAdam's do.
__attribute__((target("avx512f"))) void Triad512(TriadStores stores, float* a, const float* b, const float* c, float s,
                                                 int64_t n) {
  const __m512 vs = _mm512_set1_ps(s);
  if (stores == TriadStores::kStreaming) {
    for (int64_t i = 0; i < n; i += 16) {
      _mm512_stream_ps(a + i, _mm512_add_ps(_mm512_load_ps(b + i), _mm512_mul_ps(vs, _mm512_load_ps(c + i))));
    }
    _mm_sfence();
  } else {
    for (int64_t i = 0; i < n; i += 16) {
      _mm512_store_ps(a + i, _mm512_add_ps(_mm512_load_ps(b + i), _mm512_mul_ps(vs, _mm512_load_ps(c + i))));
    }
  }
}

__attribute__((target("avx"))) void Triad256(TriadStores stores, float* a, const float* b, const float* c, float s,
                                             int64_t n) {
  const __m256 vs = _mm256_set1_ps(s);
  if (stores == TriadStores::kStreaming) {
    for (int64_t i = 0; i < n; i += 8) {
      _mm256_stream_ps(a + i, _mm256_add_ps(_mm256_load_ps(b + i), _mm256_mul_ps(vs, _mm256_load_ps(c + i))));
    }
    _mm_sfence();
  } else {
    for (int64_t i = 0; i < n; i += 8) {
      _mm256_store_ps(a + i, _mm256_add_ps(_mm256_load_ps(b + i), _mm256_mul_ps(vs, _mm256_load_ps(c + i))));
    }
  }
}

void Triad128(TriadStores stores, float* a, const float* b, const float* c, float s, int64_t n) {
  const __m128 vs = _mm_set1_ps(s);
  if (stores == TriadStores::kStreaming) {
    for (int64_t i = 0; i < n; i += 4) {
      _mm_stream_ps(a + i, _mm_add_ps(_mm_load_ps(b + i), _mm_mul_ps(vs, _mm_load_ps(c + i))));
    }
    _mm_sfence();
  } else {
    for (int64_t i = 0; i < n; i += 4) {
      _mm_store_ps(a + i, _mm_add_ps(_mm_load_ps(b + i), _mm_mul_ps(vs, _mm_load_ps(c + i))));
    }
  }
}

using TriadFn = void (*)(TriadStores, float*, const float*, const float*, float, int64_t);

TriadFn TriadFor(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kAvx512: return Triad512;
    case AdamIsa::kAvx2: return Triad256;
    case AdamIsa::kScalar: break;  // SSE: every x86-64 has it
  }
  return Triad128;
}

struct TriadResult {
  int64_t elems = 0;    // per array
  Bandwidth streaming;  // at 12 B/element, what it moves
  Bandwidth cached;     // at 12 B/element, STREAM's count
  Bandwidth cached_wa;  // at 16 B/element, what it moves (write-allocate)
  Bandwidth reference;  // the faster in bytes moved: max(streaming, cached_wa)
  const char* reference_stores = "";
};

// The triad on LayerAdam's own workers (RunOnEachWorker: the same pinned threads, all at once).
// Worker w owns elements [w * slice, (w + 1) * slice) of a, b and c, 2 MiB aligned, and touches
// them first, so they lie on its NUMA node, as FirstTouch places LayerAdam's state; each array
// holds at least min_elems elements. A pass runs from the first worker's start to the last one's
// end (conservative: the barrier releases the workers a few microseconds apart); `reps` timed
// passes follow a warm-up, for each store kind.
absl::StatusOr<TriadResult> MeasureTriad(LayerAdam& engine, int64_t min_elems, int reps) {
  constexpr float kScalar = 3.0f;  // STREAM's values: a = b + 3 c with b = 2, c = 1 (a becomes 5)
  constexpr int64_t kSliceAlign = Mapping::kAlign / sizeof(float);
  const int workers = engine.num_threads();
  const int64_t per_worker = (min_elems + workers - 1) / workers;
  const int64_t slice = (per_worker + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const int64_t n = slice * workers;
  Mapping a_map(n * sizeof(float)), b_map(n * sizeof(float)), c_map(n * sizeof(float));
  float* a = a_map.as<float>();
  float* b = b_map.as<float>();
  float* c = c_map.as<float>();
  RETURN_IF_ERROR(engine.RunOnEachWorker([&](int w, int, int) {
    for (int64_t i = w * slice; i < (w + 1) * slice; ++i) {
      a[i] = 0;
      b[i] = 2;
      c[i] = 1;
    }
  }));
  const TriadFn triad = TriadFor(engine.isa());
  std::vector<Clock::time_point> start(workers), end(workers);
  auto measure = [&](TriadStores stores, double bytes_per_elem) -> absl::StatusOr<Bandwidth> {
    std::vector<double> times;
    for (int r = 0; r < reps + 1; ++r) {
      RETURN_IF_ERROR(engine.RunOnEachWorker([&](int w, int, int) {
        start[w] = Clock::now();
        triad(stores, a + w * slice, b + w * slice, c + w * slice, kScalar, slice);
        end[w] = Clock::now();
      }));
      const double dt =
          Seconds(*std::min_element(start.begin(), start.end()), *std::max_element(end.begin(), end.end()));
      if (r > 0) times.push_back(dt);  // the first pass is a warm-up
    }
    const double bytes = bytes_per_elem * static_cast<double>(n);
    return Bandwidth{bytes / Median(times) / 1e9, bytes / *std::min_element(times.begin(), times.end()) / 1e9};
  };
  TriadResult result;
  result.elems = n;
  ASSIGN_OR_RETURN(result.streaming, measure(TriadStores::kStreaming, 12));
  ASSIGN_OR_RETURN(result.cached, measure(TriadStores::kCached, 12));
  result.cached_wa = Bandwidth{result.cached.median * 16 / 12, result.cached.best * 16 / 12};
  const bool streaming_faster = result.streaming.median >= result.cached_wa.median;
  result.reference = streaming_faster ? result.streaming : result.cached_wa;
  result.reference.best = std::max(result.streaming.best, result.cached_wa.best);
  result.reference_stores = streaming_faster ? "stream" : "cached";
  for (int64_t i = 0; i < n; i += 4099) {
    if (a[i] != 5.0f) return absl::InternalError(absl::StrCat("triad: a[", i, "] = ", a[i], ", not 5"));
  }
  return result;
}

// Minor + major page faults of the whole process so far (every thread's).
int64_t PageFaults() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return usage.ru_minflt + usage.ru_majflt;
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

struct BenchFlags {
  int64_t params = int64_t{1} << 27;
  int threads = 0;
  int reps = 5;
  int64_t chunk_params = int64_t{1} << 22;
  std::string isa_name, pin = "core", grad_dtype = "fp32", dump_dir, mirror_store = "stream", state = "fp32";
  int64_t dump_numel = int64_t{1} << 20;
  int64_t tensor_numel = 0;
  bool refuse_nonfinite = false;
};

// The state of one NUMA node's unit: parameters [begin, end) of the bench's arrays.
struct NodePart {
  int64_t begin = 0;
  int64_t end = 0;
  UnitMemory unit;
  std::vector<ElementRange> tensors;  // unit.tensors: the bench's tensors inside it, from begin
};

// Node parts start on multiples of this many parameters: 2 MiB of the BF16 arrays, 4 MiB of the
// FP32 ones, so no huge page straddles two nodes.
constexpr int64_t kNodePartAlign = int64_t{1} << 20;

// The bench's arrays: LayerAdam's state (m and v of `moment_elem` bytes per parameter, the int8
// codes' scales beside them), the gradient, and the copy bandwidth's destination.
struct BenchArrays {
  BenchArrays(int64_t params, int64_t moment_elem, bool bf16_grad)
      : master(params * 4),
        m(params * moment_elem),
        v(params * moment_elem),
        m_scale(Int8MomentBlocks(params) * 4 + 4096),
        v_scale(Int8MomentBlocks(params) * 4 + 4096),
        mirror(params * 2),
        grad(params * (bf16_grad ? 2 : 4)),
        copy_dst(params * 4) {}
  Mapping master, m, v, m_scale, v_scale, mirror, grad, copy_dst;
};

// --tensor-numel: the parameters as tensors of that many elements, each followed by 256 elements
// of alignment padding LayerAdam must skip.
struct TensorLayout {
  std::vector<ElementRange> tensors;
  int64_t padding = 0;  // elements
};

TensorLayout LayOutTensors(int64_t params, int64_t tensor_numel) {
  TensorLayout out;
  for (int64_t b = 0; tensor_numel > 0 && b < params; b += tensor_numel + 256) {
    out.tensors.push_back({b, std::min(params, b + tensor_numel)});
    out.padding += std::min<int64_t>(256, std::max<int64_t>(0, params - b - tensor_numel));
  }
  return out;
}

struct NodeParts {
  std::vector<NodePart> parts;
  std::vector<int> part_of_node;  // per NUMA node: its index in `parts`, -1 for a node without workers
};

// One unit per NUMA node with workers, sized by its worker count, so each worker updates memory
// of its own node (hostd spreads units over nodes likewise: AssignNumaNodes) and the triad's
// workers are the ones that ran the update. One node: one unit of every parameter.
NodeParts SplitByNode(const LayerAdam& engine, const BenchFlags& f, MomentForm state,
                      const std::vector<ElementRange>& tensors, const BenchArrays& arrays) {
  const int64_t params = f.params;
  const int threads = engine.num_threads();
  NodeParts out;
  std::vector<NodePart>& parts = out.parts;
  out.part_of_node.assign(engine.num_numa_nodes(), -1);
  for (int node = 0, workers_before = 0; node < engine.num_numa_nodes(); ++node) {
    const int workers = engine.workers_on_node(node);
    if (workers == 0) continue;
    workers_before += workers;
    NodePart part;
    part.begin = parts.empty() ? 0 : parts.back().end;
    part.end = workers_before == threads
                   ? params
                   : std::max(part.begin, params * workers_before / threads / kNodePartAlign * kNodePartAlign);
    for (const ElementRange& r : tensors) {
      if (r.end > part.begin && r.begin < part.end) {
        part.tensors.push_back({std::max(r.begin, part.begin) - part.begin, std::min(r.end, part.end) - part.begin});
      }
    }
    part.unit = UnitMemory{arrays.master.as<float>() + part.begin,
                           arrays.m.as<float>() + part.begin,
                           arrays.v.as<float>() + part.begin,
                           f.mirror_store == "none" ? nullptr : arrays.mirror.as<bf16_t>() + part.begin,
                           part.end - part.begin,
                           node};
    part.unit.moments = state;
    part.unit.bf16 = Bf16Moments{arrays.m.as<bf16_t>() + part.begin, arrays.v.as<bf16_t>() + part.begin};
    part.unit.int8 = Int8Moments{arrays.m.as<int8_t>() + part.begin, arrays.v.as<uint8_t>() + part.begin,
                                 arrays.m_scale.as<float>() + part.begin / kInt8MomentBlock,
                                 arrays.v_scale.as<float>() + part.begin / kInt8MomentBlock};
    part.unit.first_index = part.begin;
    out.part_of_node[node] = static_cast<int>(parts.size());
    parts.push_back(std::move(part));
  }
  // After the vector stopped growing (returning it moves its storage, which the spans keep).
  for (NodePart& part : parts) part.unit.tensors = part.tensors;
  return out;
}

// Prefault: the engine's workers touch the state (FirstTouch, as hostd does: NUMA placement),
// then each worker first-touches its share of its node's gradient and copy destination and gives
// every array its values. Gradients are small and varied so no denormal or NaN path is timed.
// Returns the seconds it took.
absl::StatusOr<double> Prefault(LayerAdam& engine, const NodeParts& nodes, const BenchArrays& arrays,
                                int64_t moment_elem, bool bf16_grad) {
  const int threads = engine.num_threads();
  auto t0 = Clock::now();
  for (const NodePart& part : nodes.parts) {
    if (part.unit.numel > 0) RETURN_IF_ERROR(engine.FirstTouch(part.unit));
  }
  std::vector<int> node_of(threads, -1), rank_on_node(threads);
  RETURN_IF_ERROR(engine.RunOnEachWorker([&](int w, int, int node) { node_of[w] = node; }));
  {
    std::vector<int> seen(engine.num_numa_nodes());
    for (int w = 0; w < threads; ++w) rank_on_node[w] = seen[node_of[w]]++;
  }
  RETURN_IF_ERROR(engine.RunOnEachWorker([&](int w, int, int node) {
    const NodePart& part = nodes.parts[nodes.part_of_node[node]];
    const int64_t len = part.end - part.begin, shares = engine.workers_on_node(node), share = rank_on_node[w];
    for (int64_t i = part.begin + len * share / shares; i < part.begin + len * (share + 1) / shares; ++i) {
      const float x = static_cast<float>((i * 2654435761u) % 1000003) * 1e-6f - 0.5f;
      arrays.master.as<float>()[i] = x * 0.1f;
      std::memset(arrays.m.as<char>() + i * moment_elem, 0, moment_elem);
      std::memset(arrays.v.as<char>() + i * moment_elem, 0, moment_elem);
      if (i % kInt8MomentBlock == 0)
        arrays.m_scale.as<float>()[i / kInt8MomentBlock] = arrays.v_scale.as<float>()[i / kInt8MomentBlock] = 0;
      arrays.mirror.as<bf16_t>()[i] = 0;
      arrays.copy_dst.as<float>()[i] = 0;
      if (bf16_grad) {
        arrays.grad.as<bf16_t>()[i] = FloatToBf16(x * 1e-2f);
      } else {
        arrays.grad.as<float>()[i] = x * 1e-2f;
      }
    }
  }));
  return Seconds(t0, Clock::now());
}

// Copy bandwidth in GB/s (read + write) of the master weights with memcpy and with plain stores.
struct CopyFigures {
  double memcpy = 0;  // median
  double plain = 0;   // median
  // The faster of the two copies (median), so the ratio is not flattered.
  double reference = 0;
  double reference_best = 0;
};

CopyFigures MeasureCopies(int threads, const BenchArrays& arrays, int64_t params, int reps) {
  const auto [memcpy_gbps, memcpy_gbps_best] =
      CopyBandwidth(CopyKind::kMemcpy, threads, arrays.master.as<char>(), arrays.copy_dst.as<char>(), params * 4, reps);
  const auto [plain_gbps, plain_gbps_best] = CopyBandwidth(CopyKind::kPlainStores, threads, arrays.master.as<char>(),
                                                           arrays.copy_dst.as<char>(), params * 4, reps);
  return {memcpy_gbps, plain_gbps, std::max(memcpy_gbps, plain_gbps), std::max(memcpy_gbps_best, plain_gbps_best)};
}

// One update of every parameter (AdamW step `step`), in chunks of --chunk-params per node part;
// returns seconds.
double UpdatePass(LayerAdam& engine, const BenchFlags& f, const std::vector<NodePart>& parts, const Mapping& grad,
                  bool bf16_grad, int64_t step) {
  AdamWStepParams p;
  p.step = step;
  p.lr = 1e-4;
  p.nonfinite_grad = f.refuse_nonfinite ? NonFiniteGrad::kRefuse : NonFiniteGrad::kApply;
  const auto s0 = Clock::now();
  for (const NodePart& part : parts) {
    for (int64_t o = 0; o < part.unit.numel; o += f.chunk_params) {
      const int64_t n = std::min(f.chunk_params, part.unit.numel - o);
      const int64_t g = part.begin + o;
      auto done = [](absl::Status s) { CHECK(s.ok()) << s; };
      absl::Status s = bf16_grad ? engine.SubmitChunkBf16(part.unit, o, n, grad.as<bf16_t>() + g, p, done)
                                 : engine.SubmitChunk(part.unit, o, n, grad.as<float>() + g, p, done);
      CHECK(s.ok()) << s;
    }
  }
  engine.WaitIdle();
  return Seconds(s0, Clock::now());
}

struct UpdateTiming {
  std::vector<double> times;  // seconds of each timed pass
  int warmups = 0;
  int64_t warmup_faults = 0;
  int64_t hot_path_faults = 0;  // in the timed passes
};

// Warm-up passes until one takes no page fault (at most kMaxWarmups). The state is prefaulted,
// but the first pass still faults in code (libm's pow, for the bias correction) and the engine's
// queue storage and chunk records as they first grow (LayerAdam recycles both afterwards). The
// timed passes then count the steady state's faults, every thread's: the target is 0.
UpdateTiming TimeUpdates(LayerAdam& engine, const BenchFlags& f, const std::vector<NodePart>& parts,
                         const Mapping& grad, bool bf16_grad) {
  int64_t step = 0;
  auto update_pass = [&]() { return UpdatePass(engine, f, parts, grad, bf16_grad, ++step); };
  constexpr int kMaxWarmups = 5;
  UpdateTiming out;
  while (out.warmups < kMaxWarmups) {
    const int64_t before = PageFaults();
    update_pass();
    ++out.warmups;
    const int64_t faults = PageFaults() - before;
    out.warmup_faults += faults;
    if (faults == 0) break;
  }
  const int64_t faults_before = PageFaults();
  for (int r = 0; r < f.reps; ++r) out.times.push_back(update_pass());
  out.hot_path_faults = PageFaults() - faults_before;
  return out;
}

// LayerAdam's rates over the timed passes, by each traffic convention of the file comment.
struct UpdateRates {
  double dt = 0;    // seconds per pass, median
  double best = 0;  // seconds per pass, best
  double params_per_s = 0;
  double no_mirror_bytes = 0;  // per parameter: 28 with FP32 state and gradient
  double gbps28 = 0;           // at no_mirror_bytes
  double gbps30 = 0;           // at no_mirror_bytes + the mirror's 2
  double moved_bytes = 0;      // per parameter, what the update moves
  double layeradam_gbps = 0;
  double layeradam_gbps_best = 0;
  double ratio_to_triad = 0;
  double ratio_to_triad_no_mirror = 0;
};

UpdateRates RatesOf(const UpdateTiming& timing, int64_t params, double no_mirror_bytes, const std::string& mirror_store,
                    const TriadResult& triad) {
  UpdateRates r;
  r.dt = Median(timing.times);
  r.best = *std::min_element(timing.times.begin(), timing.times.end());
  r.params_per_s = params / r.dt;
  r.no_mirror_bytes = no_mirror_bytes;
  r.gbps28 = r.params_per_s * no_mirror_bytes / 1e9;
  r.gbps30 = r.params_per_s * (no_mirror_bytes + 2) / 1e9;
  // Bytes the update moves per parameter (the triad reference's convention, see the file comment).
  // (--mirror-store none: runtime.param_source master, no mirror written.)
  r.moved_bytes = no_mirror_bytes + (mirror_store == "none" ? 0 : 2) + (mirror_store == "cached" ? 2 : 0);
  r.layeradam_gbps = r.params_per_s * r.moved_bytes / 1e9;
  r.layeradam_gbps_best = params / r.best * r.moved_bytes / 1e9;
  r.ratio_to_triad = r.layeradam_gbps / triad.reference.median;
  r.ratio_to_triad_no_mirror = r.gbps28 / triad.reference.median;
  return r;
}

// Everything Bench measured, as its report prints it.
struct BenchFigures {
  int cores = 0;
  int64_t params = 0;
  size_t tensor_ranges = 0;
  int64_t padding = 0;     // elements skipped
  double state_bytes = 0;  // held per parameter: master, mirror, m, v
  double prefault_s = 0;
  TriadResult triad;
  CopyFigures copy;
  UpdateTiming timing;
  UpdateRates rates;
};

void PrintText(const BenchFlags& f, const LayerAdam& engine, const BenchFigures& r) {
  const int threads = engine.num_threads();
  const int64_t params = r.params;
  const TriadResult& triad = r.triad;
  const UpdateRates& u = r.rates;
  std::printf(
      "machine: %d physical cores, %d NUMA node(s); threads %d, isa %s, pin %s, grad %s, "
      "mirror stores %s, moments %s\n",
      r.cores, engine.num_numa_nodes(), threads, AdamIsaName(engine.isa()).c_str(), f.pin.c_str(), f.grad_dtype.c_str(),
      f.mirror_store.c_str(), f.state.c_str());
  std::printf("params %lld (%.2f GiB state), prefault %.2f s\n", static_cast<long long>(params),
              params * r.state_bytes / (1 << 30), r.prefault_s);
  std::printf(
      "triad a = b + 3c on the %d LayerAdam workers (3 x %.2f GiB, each slice first-touched by its worker): "
      "streaming stores %.1f GB/s (best %.1f) at 12 B/elem; cached stores %.1f GB/s at 12 B/elem, %.1f at 16 B/elem "
      "with write-allocate (best %.1f); reference %.1f GB/s (%s stores, bytes moved)\n",
      threads, triad.elems * 4.0 / (1 << 30), triad.streaming.median, triad.streaming.best, triad.cached.median,
      triad.cached_wa.median, triad.cached_wa.best, triad.reference.median, triad.reference_stores);
  std::printf(
      "copy bandwidth (read+write): memcpy %.1f GB/s, plain stores %.1f GB/s (median); "
      "reference %.1f\n",
      r.copy.memcpy, r.copy.plain, r.copy.reference);
  std::printf(
      "LayerAdam: %.3f Gparam/s median (%.3f best), %.1f GB/s at %.0f B/param, %.1f GB/s "
      "at %.0f B/param with mirror\n",
      u.params_per_s / 1e9, params / u.best / 1e9, u.gbps28, u.no_mirror_bytes, u.gbps30, u.no_mirror_bytes + 2);
  std::printf("ratio to copy bandwidth: %.2f (%.0f B/param), %.2f (with mirror)\n", u.gbps28 / r.copy.reference,
              u.no_mirror_bytes, u.gbps30 / r.copy.reference);
  std::printf(
      "ratio to the triad: %.2f (LayerAdam %.1f GB/s at %.0f B/param moved / triad %.1f GB/s; target >= 0.85), "
      "%.2f at %.0f B/param without the mirror\n",
      u.ratio_to_triad, u.layeradam_gbps, u.moved_bytes, triad.reference.median, u.ratio_to_triad_no_mirror,
      u.no_mirror_bytes);
  std::printf("page faults in the timed LayerAdam reps: %lld (%lld in %d warm-up passes)\n",
              static_cast<long long>(r.timing.hot_path_faults), static_cast<long long>(r.timing.warmup_faults),
              r.timing.warmups);
}

// The last stdout line: one JSON object with every figure.
void PrintJson(const BenchFlags& f, const LayerAdam& engine, const BenchFigures& r) {
  const TriadResult& triad = r.triad;
  const UpdateRates& u = r.rates;
  nlohmann::json j = {{"bench", "layeradam"},
                      {"params", r.params},
                      {"tensor_ranges", r.tensor_ranges},
                      {"refuse_nonfinite", f.refuse_nonfinite},
                      {"padding_skipped", r.padding},
                      {"threads", engine.num_threads()},
                      {"cores", r.cores},
                      {"numa_nodes", engine.num_numa_nodes()},
                      {"isa", AdamIsaName(engine.isa())},
                      {"pin", f.pin},
                      {"grad", f.grad_dtype},
                      {"state", f.state},
                      {"mirror_store", f.mirror_store},
                      {"chunk_params", f.chunk_params},
                      {"reps", f.reps},
                      {"copy_GBps_rw", r.copy.reference},
                      {"memcpy_GBps_rw", r.copy.memcpy},
                      {"plain_copy_GBps_rw", r.copy.plain},
                      {"copy_GBps_rw_best", r.copy.reference_best},
                      {"adam_s_per_step", u.dt},
                      {"adam_Gparam_per_s", u.params_per_s / 1e9},
                      {"adam_Gparam_per_s_best", r.params / u.best / 1e9},
                      {"adam_GBps_no_mirror", u.gbps28},
                      {"adam_GBps_with_mirror", u.gbps30},
                      {"ratio_no_mirror", u.gbps28 / r.copy.reference},
                      {"ratio_with_mirror", u.gbps30 / r.copy.reference},
                      {"prefault_s", r.prefault_s},
                      {"triad_elems", triad.elems},
                      {"triad_gbps", triad.reference.median},
                      {"triad_gbps_best", triad.reference.best},
                      {"triad_reference_stores", triad.reference_stores},
                      {"triad_stream_gbps", triad.streaming.median},
                      {"triad_stream_gbps_best", triad.streaming.best},
                      {"triad_cached_gbps", triad.cached.median},
                      {"triad_cached_gbps_best", triad.cached.best},
                      {"triad_cached_gbps_write_allocate", triad.cached_wa.median},
                      {"triad_cached_gbps_write_allocate_best", triad.cached_wa.best},
                      {"layeradam_bytes_per_param", u.moved_bytes},
                      {"layeradam_bytes_per_param_no_mirror", u.no_mirror_bytes},
                      {"layeradam_gbps", u.layeradam_gbps},
                      {"layeradam_gbps_best", u.layeradam_gbps_best},
                      {"ratio_to_triad", u.ratio_to_triad},
                      {"ratio_to_triad_no_mirror", u.ratio_to_triad_no_mirror},
                      {"hot_path_page_faults", r.timing.hot_path_faults},
                      {"warmup_reps", r.timing.warmups},
                      {"warmup_page_faults", r.timing.warmup_faults}};
  std::cout << j.dump() << std::endl;
}

absl::Status Bench(const BenchFlags& f, LayerAdam& engine, int cores) {
  const int64_t params = f.params;
  const bool bf16_grad = f.grad_dtype == "bf16";
  ASSIGN_OR_RETURN(const MomentForm state, ParseMomentForm(f.state));
  if (state == MomentForm::kInt8 &&
      (f.chunk_params % kInt8MomentBlock != 0 || f.tensor_numel % kInt8MomentBlock != 0)) {
    return absl::InvalidArgumentError("--state int8: --chunk-params and --tensor-numel must be multiples of 256");
  }
  // m and v: FP32, BF16 or int8 codes (the scales apart).
  const int64_t moment_elem = state == MomentForm::kF32 ? 4 : state == MomentForm::kBF16 ? 2 : 1;
  const BenchArrays arrays(params, moment_elem, bf16_grad);
  BenchFigures r;
  r.cores = cores;
  r.params = params;
  const TensorLayout layout = LayOutTensors(params, f.tensor_numel);
  r.tensor_ranges = layout.tensors.size();
  r.padding = layout.padding;
  const NodeParts nodes = SplitByNode(engine, f, state, layout.tensors, arrays);
  ASSIGN_OR_RETURN(r.prefault_s, Prefault(engine, nodes, arrays, moment_elem, bf16_grad));

  // The triad's arrays hold at least as many bytes as the update touches (state + gradient), far
  // beyond any last-level cache at the bench's sizes; MeasureTriad unmaps them before the update runs.
  const double grad_bytes = bf16_grad ? 2 : 4;
  // m and v, read and written, per parameter (fp32 16, bf16 8, int8 4 + 2 x 2 x 4 / 256).
  const double moment_rw = state == MomentForm::kF32 ? 16 : state == MomentForm::kBF16 ? 8 : 4 + 16.0 / 256;
  r.state_bytes = 6 + moment_rw / 2;
  ASSIGN_OR_RETURN(
      r.triad,
      MeasureTriad(engine, static_cast<int64_t>(std::ceil(params * (r.state_bytes + grad_bytes) / 12)), f.reps));
  r.copy = MeasureCopies(engine.num_threads(), arrays, params, f.reps);
  r.timing = TimeUpdates(engine, f, nodes.parts, arrays.grad, bf16_grad);
  r.rates = RatesOf(r.timing, params, 8 + moment_rw + grad_bytes, f.mirror_store, r.triad);
  PrintText(f, engine, r);
  PrintJson(f, engine, r);
  return absl::OkStatus();
}

int Main(int argc, char** argv) {
  CLI::App app{"LayerAdam throughput vs a same-run triad and host copy bandwidth"};
  BenchFlags f;
  app.add_option("--params", f.params, "parameters (state = 14 B/param + 4 B/param gradient)");
  app.add_option("--tensor-numel", f.tensor_numel,
                 "lay the parameters out as tensors of this many elements, each followed by 256-element "
                 "alignment padding LayerAdam must skip (UnitMemory::tensors); 0 = one tensor, no padding");
  app.add_option("--threads", f.threads, "update, triad and copy threads (0 = every physical core)");
  app.add_option("--reps", f.reps, "timed repetitions (median reported)");
  app.add_option("--chunk-params", f.chunk_params, "parameters per submitted chunk");
  app.add_option("--isa", f.isa_name, "scalar|avx2|avx512 (default: best supported)");
  app.add_option("--pin", f.pin, "worker pinning: core|node|none")->check(CLI::IsMember({"core", "node", "none"}));
  app.add_option("--grad", f.grad_dtype, "gradient dtype: fp32|bf16")->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_option("--state", f.state, "Adam moments: fp32|bf16|int8 (optimizer.state_dtype)")
      ->check(CLI::IsMember({"fp32", "bf16", "int8"}));
  app.add_option("--mirror-store", f.mirror_store,
                 "BF16 mirror stores: stream|cached|none (none: no mirror, runtime.param_source master)")
      ->check(CLI::IsMember({"stream", "cached", "none"}));
  app.add_option("--dump", f.dump_dir, "write a torch comparison dump here and exit");
  app.add_option("--dump-numel", f.dump_numel, "elements in the dump");
  app.add_flag("--refuse-nonfinite", f.refuse_nonfinite,
               "check each block of the gradient for NaN/inf before updating it (NonFiniteGrad::kRefuse, "
               "what hostd uses for device-staged parts)");
  CLI11_PARSE(app, argc, argv);
  if (f.params <= 0 || f.reps <= 0 || f.chunk_params <= 0) {
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
  LayerAdamOptions options;
  options.num_threads = f.threads > 0 ? f.threads : cores;
  options.reserve_cores = 0;
  options.mirror_store = f.mirror_store == "stream" ? MirrorStore::kStreaming : MirrorStore::kCached;
  options.pinning =
      f.pin == "core" ? WorkerPinning::kCore : (f.pin == "node" ? WorkerPinning::kNumaNode : WorkerPinning::kNone);
  if (!f.isa_name.empty()) {
    absl::StatusOr<AdamIsa> isa = ParseAdamIsa(f.isa_name);
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
  absl::Status s = !f.dump_dir.empty() ? Dump(f.dump_dir, f.dump_numel, 3, engine) : Bench(f, engine, cores);
  if (!s.ok()) std::cerr << s << "\n";
  return s.ok() ? 0 : 1;
}

}  // namespace
}  // namespace slidedp::update

int main(int argc, char** argv) {
  google::InitGoogleLogging(argv[0]);
  FLAGS_logtostderr = true;
  return slidedp::update::Main(argc, argv);
}
