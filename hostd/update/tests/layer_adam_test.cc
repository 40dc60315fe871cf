// LayerAdam engine, UnitTracker and GradNormAccumulator: concurrent chunks give the single-thread
// result bit for bit, each unit completes once per step, bad submissions are refused, shutdown
// completes every chunk once, deep queues and recycled chunk records change nothing,
// RunOnEachWorker runs every worker once at the same time, copy priority pauses the yielding
// workers while an urgent word is raised (bounded, bit-exact), and the clipping norm is exact and
// order-independent.
#include "hostd/update/layer_adam.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "common/model/model_config.h"
#include "gtest/gtest.h"
#include "hostd/update/adamw_state.h"
#include "hostd/update/grad_norm.h"
#include "hostd/update/unit_tracker.h"
#include "shm/futex.h"

namespace slidedp::update {
namespace {

struct OwnedUnit {
  explicit OwnedUnit(int64_t n) : master(n), m(n), v(n), mirror(n) {}
  UnitMemory view(int node = 0) {
    return UnitMemory{
        master.data(), m.data(), v.data(), mirror.data(), static_cast<int64_t>(master.size()),
        node};
  }
  std::vector<float> master, m, v;
  std::vector<bf16_t> mirror;
};

// A mid-training state: small weights, moments of the size Adam gives them, the mirror in step.
OwnedUnit RandomState(int64_t n, std::mt19937& rng, std::normal_distribution<float>& normal) {
  OwnedUnit start(n);
  for (int64_t i = 0; i < n; ++i) {
    start.master[i] = normal(rng) * 0.02f;
    start.m[i] = normal(rng) * 1e-3f;
    start.v[i] = std::abs(normal(rng)) * 1e-6f;
    start.mirror[i] = FloatToBf16(start.master[i]);
  }
  return start;
}

// Master, m, v and mirror equal bit for bit.
bool SameState(const OwnedUnit& a, const OwnedUnit& b) {
  const size_t n = a.master.size();
  return b.master.size() == n && std::memcmp(a.master.data(), b.master.data(), n * 4) == 0 &&
         std::memcmp(a.m.data(), b.m.data(), n * 4) == 0 && std::memcmp(a.v.data(), b.v.data(), n * 4) == 0 &&
         std::memcmp(a.mirror.data(), b.mirror.data(), n * 2) == 0;
}

std::unique_ptr<LayerAdam> MakeEngine(int threads, WorkerPinning pin = WorkerPinning::kNone,
                                      int64_t min_piece = 1000) {
  LayerAdamOptions o;
  o.num_threads = threads;
  o.pinning = pin;
  o.min_piece_numel = min_piece;
  absl::StatusOr<std::unique_ptr<LayerAdam>> e = LayerAdam::Create(o);
  EXPECT_TRUE(e.ok()) << e.status();
  return std::move(*e);
}

// Random chunk boundaries covering [0, n).
std::vector<std::pair<int64_t, int64_t>> RandomChunks(int64_t n, std::mt19937& rng) {
  std::uniform_int_distribution<int64_t> len(1, n / 8);
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t o = 0; o < n;) {
    const int64_t l = std::min(n - o, len(rng));
    out.emplace_back(o, l);
    o += l;
  }
  std::shuffle(out.begin(), out.end(), rng);
  return out;
}

TEST(LayerAdam, ConcurrentChunksMatchSingleThreadBitExact) {
  const std::vector<int64_t> sizes = {200003, 77777, 4097};
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<OwnedUnit> units, expect;
  for (int64_t n : sizes) {
    units.emplace_back(n);
    for (int64_t i = 0; i < n; ++i) units.back().master[i] = normal(rng) * 0.02f;
    expect.push_back(units.back());
  }
  auto engine = MakeEngine(4);
  std::atomic<int> unit_done_calls{0};
  std::vector<std::vector<int64_t>> done_steps(sizes.size());
  absl::Mutex mu;
  UnitTracker tracker(sizes, [&](int unit, int64_t step, const absl::Status& s) {
    EXPECT_TRUE(s.ok()) << s;
    absl::MutexLock l(&mu);
    done_steps[unit].push_back(step);
    unit_done_calls++;
  });

  constexpr int kSteps = 3;
  for (int t = 1; t <= kSteps; ++t) {
    AdamWStepParams p;
    p.lr = 1e-3 * t;
    p.step = t;
    p.grad_scale = 0.8f;
    std::vector<std::vector<float>> grads;
    for (int64_t n : sizes) {
      grads.emplace_back(n);
      for (float& g : grads.back()) g = normal(rng) * 1e-2f;
    }
    for (size_t u = 0; u < sizes.size(); ++u) {
      OwnedUnit& e = expect[u];
      AdamWStep(p, e.master.data(), e.m.data(), e.v.data(), e.mirror.data(), grads[u].data(),
                sizes[u]);
    }
    // Two submitting threads, chunks of every unit interleaved in random order.
    std::vector<std::tuple<int, int64_t, int64_t>> work;
    for (size_t u = 0; u < sizes.size(); ++u) {
      for (auto [o, l] : RandomChunks(sizes[u], rng)) work.emplace_back(static_cast<int>(u), o, l);
    }
    std::shuffle(work.begin(), work.end(), rng);
    auto submit = [&](size_t first) {
      for (size_t k = first; k < work.size(); k += 2) {
        auto [u, o, l] = work[k];
        auto done = tracker.Track(u, t, o, l);
        ASSERT_TRUE(done.ok()) << done.status();
        ASSERT_TRUE(
            engine->SubmitChunk(units[u].view(), o, l, grads[u].data() + o, p, std::move(*done))
                .ok());
      }
    };
    std::thread a(submit, 0), b(submit, 1);
    a.join();
    b.join();
    for (size_t u = 0; u < sizes.size(); ++u) {
      ASSERT_TRUE(tracker.WaitForStep(static_cast<int>(u), t, absl::Seconds(30))) << u;
    }
    engine->WaitIdle();
  }
  for (size_t u = 0; u < sizes.size(); ++u) {
    ASSERT_EQ(0, std::memcmp(units[u].master.data(), expect[u].master.data(), sizes[u] * 4)) << u;
    ASSERT_EQ(0, std::memcmp(units[u].m.data(), expect[u].m.data(), sizes[u] * 4)) << u;
    ASSERT_EQ(0, std::memcmp(units[u].v.data(), expect[u].v.data(), sizes[u] * 4)) << u;
    ASSERT_EQ(0, std::memcmp(units[u].mirror.data(), expect[u].mirror.data(), sizes[u] * 2)) << u;
    EXPECT_EQ(done_steps[u], (std::vector<int64_t>{1, 2, 3})) << u;
    EXPECT_EQ(tracker.completed_step(static_cast<int>(u)), kSteps);
  }
  EXPECT_EQ(unit_done_calls.load(), kSteps * static_cast<int>(sizes.size()));
}

TEST(LayerAdam, Bf16GradientChunks) {
  constexpr int64_t kN = 50001;
  OwnedUnit unit(kN), expect(kN);
  std::vector<bf16_t> grad(kN);
  for (int64_t i = 0; i < kN; ++i) {
    unit.master[i] = expect.master[i] = std::sin(static_cast<float>(i));
    grad[i] = FloatToBf16(std::cos(static_cast<float>(i)) * 1e-3f);
  }
  AdamWStepParams p;
  AdamWStepBf16Grad(p, expect.master.data(), expect.m.data(), expect.v.data(), expect.mirror.data(),
                    grad.data(), kN);
  auto engine = MakeEngine(3);
  std::atomic<int> calls{0};
  for (int64_t o = 0; o < kN; o += 9000) {
    const int64_t l = std::min<int64_t>(9000, kN - o);
    ASSERT_TRUE(engine
                    ->SubmitChunkBf16(unit.view(), o, l, grad.data() + o, p,
                                      [&](absl::Status s) {
                                        EXPECT_TRUE(s.ok());
                                        calls++;
                                      })
                    .ok());
  }
  engine->WaitIdle();
  EXPECT_EQ(calls.load(), 6);
  EXPECT_EQ(0, std::memcmp(unit.master.data(), expect.master.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(unit.mirror.data(), expect.mirror.data(), kN * 2));
}

TEST(LayerAdam, RefusesBadSubmissions) {
  auto engine = MakeEngine(2);
  OwnedUnit unit(100);
  std::vector<float> grad(100);
  AdamWStepParams p;
  bool called = false;
  auto done = [&](absl::Status) { called = true; };
  const auto kBad = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(engine->SubmitChunk(unit.view(), 90, 11, grad.data(), p, done).code(), kBad);
  EXPECT_EQ(engine->SubmitChunk(unit.view(), -1, 5, grad.data(), p, done).code(), kBad);
  EXPECT_EQ(engine->SubmitChunk(unit.view(), 0, 5, nullptr, p, done).code(), kBad);
  EXPECT_EQ(
      engine->SubmitChunk(unit.view(engine->num_numa_nodes()), 0, 5, grad.data(), p, done).code(),
      kBad);
  p.step = 0;
  EXPECT_EQ(engine->SubmitChunk(unit.view(), 0, 5, grad.data(), p, done).code(), kBad);
  engine->WaitIdle();
  EXPECT_FALSE(called);
}

// The padding between a unit's tensors (ModelLayout aligns each to 256 elements) is never written,
// whatever the gradient holds there and whatever the hyper-parameters: eps 0 (0/0 = NaN), weight
// decay, NaN and huge gradients in the padding. Every array's padding is poisoned with a NaN
// payload and must stay bitwise as it was; the tensors get exactly the kernel's result.
TEST(LayerAdam, NeverTouchesThePaddingBetweenTensors) {
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  const ModelLayout layout = ModelLayout::Build(*config);
  auto engine = MakeEngine(3, WorkerPinning::kNone, /*min_piece=*/64);
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr uint32_t kPoisonF32 = 0x7fc0dead;  // a quiet NaN with a payload no kernel makes
  constexpr uint16_t kPoisonBf16 = 0x7fc1;
  for (const UnitLayout& ul : {layout.units[1], layout.head()}) {
    const int64_t n = ul.numel;
    std::vector<ElementRange> tensors;
    std::vector<bool> is_param(n, false);
    for (const TensorSlot& t : ul.tensors) {
      tensors.push_back({t.offset_numel, t.offset_numel + t.numel});
      std::fill(is_param.begin() + t.offset_numel, is_param.begin() + t.offset_numel + t.numel, true);
    }
    const int64_t padding = std::count(is_param.begin(), is_param.end(), false);
    ASSERT_GT(padding, 0) << ul.name << ": the tiny model's norms are shorter than the alignment";
    OwnedUnit unit(n);
    for (int64_t i = 0; i < n; ++i) {
      if (is_param[i]) {
        unit.master[i] = normal(rng) * 0.02f;
      } else {
        std::memcpy(&unit.master[i], &kPoisonF32, 4);
        std::memcpy(&unit.m[i], &kPoisonF32, 4);
        std::memcpy(&unit.v[i], &kPoisonF32, 4);
        std::memcpy(&unit.mirror[i], &kPoisonBf16, 2);
      }
    }
    OwnedUnit expect = unit;
    UnitMemory view = unit.view();
    view.tensors = tensors;
    for (int t = 1; t <= 3; ++t) {
      AdamWStepParams p;
      p.lr = 1e-2;
      p.eps = 0;  // the spec refuses it; LayerAdam must be safe with it anyway
      p.weight_decay = 0.5;
      p.step = t;
      std::vector<float> grad(n);
      for (int64_t i = 0; i < n; ++i) {
        grad[i] = is_param[i] ? normal(rng) * 1e-2f
                              : (i % 3 == 0 ? std::numeric_limits<float>::quiet_NaN() : (i % 3 == 1 ? 0.0f : 1e30f));
      }
      for (const ElementRange& r : tensors) {
        AdamWStep(p, expect.master.data() + r.begin, expect.m.data() + r.begin, expect.v.data() + r.begin,
                  expect.mirror.data() + r.begin, grad.data() + r.begin, r.end - r.begin);
      }
      // Chunks that start and end inside padding and inside tensors alike.
      std::atomic<int> pending{0};
      for (auto [o, l] : RandomChunks(n, rng)) {
        pending++;
        ASSERT_TRUE(engine
                        ->SubmitChunk(view, o, l, grad.data() + o, p,
                                      [&](absl::Status s) {
                                        EXPECT_TRUE(s.ok()) << s;
                                        pending--;
                                      })
                        .ok());
      }
      engine->WaitIdle();
      EXPECT_EQ(pending.load(), 0);
    }
    ASSERT_EQ(0, std::memcmp(unit.master.data(), expect.master.data(), n * 4)) << ul.name;
    ASSERT_EQ(0, std::memcmp(unit.m.data(), expect.m.data(), n * 4)) << ul.name;
    ASSERT_EQ(0, std::memcmp(unit.v.data(), expect.v.data(), n * 4)) << ul.name;
    ASSERT_EQ(0, std::memcmp(unit.mirror.data(), expect.mirror.data(), n * 2)) << ul.name;
    int64_t poisoned = 0;
    for (int64_t i = 0; i < n; ++i) {
      uint32_t bits;
      std::memcpy(&bits, &unit.master[i], 4);
      poisoned += !is_param[i] && bits == kPoisonF32;
    }
    EXPECT_EQ(poisoned, padding) << ul.name;
  }
  // Ranges that are not sorted, overlap or leave the unit are refused.
  OwnedUnit unit(1024);
  std::vector<float> grad(1024);
  for (std::vector<ElementRange> bad :
       {std::vector<ElementRange>{{256, 512}, {0, 64}}, std::vector<ElementRange>{{0, 300}, {256, 512}},
        std::vector<ElementRange>{{0, 2000}}}) {
    UnitMemory view = unit.view();
    view.tensors = bad;
    EXPECT_EQ(engine->SubmitChunk(view, 0, 1024, grad.data(), AdamWStepParams{}, [](absl::Status) {}).code(),
              absl::StatusCode::kInvalidArgument);
  }
}

// Speculative updates: a kSave update is the plain update bit for bit and leaves the state it
// overwrote in the undo copy; SubmitRestore gives back that state (mirror included); a kRedo
// update with another coefficient is the plain update of the saved state with it. Padding between
// tensors is never copied either way.
TEST(LayerAdam, UndoCopiesRestoreAndRedoBitExact) {
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  const ModelLayout layout = ModelLayout::Build(*config);
  const UnitLayout& ul = layout.units[1];
  const int64_t n = ul.numel;
  std::vector<ElementRange> tensors;
  for (const TensorSlot& t : ul.tensors) tensors.push_back({t.offset_numel, t.offset_numel + t.numel});
  auto engine = MakeEngine(3, WorkerPinning::kNone, /*min_piece=*/64);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  OwnedUnit start = RandomState(n, rng, normal);
  std::vector<float> grad(n);
  for (float& g : grad) g = normal(rng) * 1e-2f;
  AdamWStepParams p;
  p.lr = 1e-3;
  p.step = 4;
  auto run = [&](OwnedUnit& u, float scale, const UndoMemory* undo, UndoMode mode, bool restore) {
    UnitMemory view = u.view();
    view.tensors = tensors;
    AdamWStepParams q = p;
    q.grad_scale = scale;
    for (auto [o, l] : RandomChunks(n, rng)) {
      absl::Status s = restore ? engine->SubmitRestore(view, o, l, *undo, [](absl::Status s) { EXPECT_TRUE(s.ok()); })
                               : engine->SubmitChunk(view, o, l, grad.data() + o, q,
                                                     [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; }, undo, mode);
      ASSERT_TRUE(s.ok()) << s;
    }
    engine->WaitIdle();
  };
  auto same = [](const OwnedUnit& a, const OwnedUnit& b) { return SameState(a, b); };
  OwnedUnit plain1 = start, plain_half = start;
  run(plain1, 1.0f, nullptr, UndoMode::kNone, false);
  run(plain_half, 0.5f, nullptr, UndoMode::kNone, false);
  ASSERT_FALSE(same(plain1, plain_half));

  constexpr float kArenaPoison = -12345.0f;
  std::vector<float> um(n, kArenaPoison), mm(n, kArenaPoison), vm(n, kArenaPoison);
  const UndoMemory undo{um.data(), mm.data(), vm.data()};
  OwnedUnit spec = start;
  run(spec, 1.0f, &undo, UndoMode::kSave, false);
  EXPECT_TRUE(same(spec, plain1)) << "a speculative update is the plain one";
  int64_t copied = 0;
  for (int64_t i = 0; i < n; ++i) copied += um[i] != kArenaPoison;
  int64_t params = 0;
  for (const ElementRange& r : tensors) params += r.end - r.begin;
  EXPECT_LE(copied, params) << "padding is not copied";

  OwnedUnit redone = spec;
  run(redone, 0.5f, &undo, UndoMode::kRedo, false);
  EXPECT_TRUE(same(redone, plain_half)) << "a redo is the update of the saved state";

  OwnedUnit restored = spec;
  run(restored, 0, &undo, UndoMode::kRedo, true);
  EXPECT_TRUE(same(restored, start)) << "a restore gives the state before the speculative update";

  // A refusing speculative update that stops at a NaN part-way still saved its whole chunk: the
  // restore is exact.
  std::vector<float> bad_grad = grad;
  bad_grad[tensors[0].begin + 20000 % (tensors[0].end - tensors[0].begin)] = std::numeric_limits<float>::quiet_NaN();
  OwnedUnit refused = start;
  {
    UnitMemory view = refused.view();
    view.tensors = tensors;
    AdamWStepParams q = p;
    q.nonfinite_grad = NonFiniteGrad::kRefuse;
    int failed = 0;
    ASSERT_TRUE(engine
                    ->SubmitChunk(view, 0, n, bad_grad.data(), q, [&](absl::Status s) { failed += !s.ok(); }, &undo,
                                  UndoMode::kSave)
                    .ok());
    engine->WaitIdle();
    EXPECT_EQ(failed, 1);
  }
  run(refused, 0, &undo, UndoMode::kRedo, true);
  EXPECT_TRUE(same(refused, start)) << "a refused speculative update is restored exactly";

  // Undo copies are faulted in by the workers like state (no mirror), in several pieces.
  {
    std::vector<float> a(n, 1.0f), b(n, 2.0f), c(n, 3.0f);
    UnitMemory touch;
    touch.master = a.data();
    touch.m = b.data();
    touch.v = c.data();
    touch.numel = n;
    ASSERT_TRUE(engine->FirstTouch(touch).ok());
    EXPECT_EQ(a[n - 1] + b[n - 1] + c[n - 1], 6.0f);
  }

  // An undo mode without an undo copy is refused.
  UnitMemory view = spec.view();
  EXPECT_EQ(engine->SubmitChunk(view, 0, n, grad.data(), p, [](absl::Status) {}, nullptr, UndoMode::kSave).code(),
            absl::StatusCode::kInvalidArgument);
}

// Speculative clipping with compact moments (optimizer.state_dtype bf16 / int8): the undo copy
// keeps the unit's own form (BF16 moments; int8 codes and the scales of every block a chunk
// touches), so a speculative update is the plain one, a redo from the copy is the plain update of
// the saved state and a restore gives the state before the speculation, bit for bit (mirror
// included), also after a refused (non-finite) speculative update; chunks on int8 blocks, random
// order; an undo copy of another form is refused.
TEST(LayerAdam, CompactUndoCopiesRestoreAndRedoBitExact) {
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  const UnitLayout ul = ModelLayout::Build(*config).units[1];
  const int64_t n = ul.numel;
  std::vector<ElementRange> tensors;
  for (const TensorSlot& t : ul.tensors) tensors.push_back({t.offset_numel, t.offset_numel + t.numel});
  auto engine = MakeEngine(3, WorkerPinning::kNone, /*min_piece=*/256);
  std::mt19937 rng(31);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (MomentForm dtype : {MomentForm::kBF16, MomentForm::kInt8}) {
    SCOPED_TRACE(ToString(dtype));
    struct Compact {
      std::vector<float> master;
      std::vector<bf16_t> mirror, m16, v16;
      std::vector<int8_t> mq;
      std::vector<uint8_t> vq;
      std::vector<float> ms, vs;
      bool operator==(const Compact& o) const {
        return std::memcmp(master.data(), o.master.data(), master.size() * 4) == 0 && mirror == o.mirror &&
               m16 == o.m16 && v16 == o.v16 && mq == o.mq && vq == o.vq &&
               std::memcmp(ms.data(), o.ms.data(), ms.size() * 4) == 0 &&
               std::memcmp(vs.data(), o.vs.data(), vs.size() * 4) == 0;
      }
    };
    auto make = [&](float fill) {
      Compact c;
      c.master.resize(n);
      for (float& x : c.master) x = normal(rng) * 0.02f;
      c.mirror.assign(n, 0);
      c.m16.assign(n, FloatToBf16(fill));
      c.v16.assign(n, FloatToBf16(fill));
      c.mq.assign(n, fill == 0 ? 0 : -99);
      c.vq.assign(n, fill == 0 ? 0 : 77);
      c.ms.assign(Int8MomentBlocks(n), fill);
      c.vs.assign(Int8MomentBlocks(n), fill);
      return c;
    };
    auto view = [&](Compact& c) {
      UnitMemory u;
      u.master = c.master.data();
      u.mirror = c.mirror.data();
      u.numel = n;
      u.moments = dtype;
      u.bf16 = Bf16Moments{c.m16.data(), c.v16.data()};
      u.int8 = Int8Moments{c.mq.data(), c.vq.data(), c.ms.data(), c.vs.data()};
      u.first_index = 12345;
      u.tensors = tensors;
      return u;
    };
    auto chunks = [&] {
      std::vector<std::pair<int64_t, int64_t>> out;
      std::uniform_int_distribution<int64_t> blocks(1, 40);
      for (int64_t o = 0; o < n;) {
        const int64_t l = std::min(n - o, blocks(rng) * kInt8MomentBlock);
        out.emplace_back(o, l);
        o += l;
      }
      std::shuffle(out.begin(), out.end(), rng);
      return out;
    };
    std::vector<float> grad(n);
    auto step = [&](Compact& c, int t, float scale, const UndoMemory* undo, UndoMode mode) {
      AdamWStepParams p;
      p.lr = 1e-3;
      p.weight_decay = 0.1;
      p.step = t;
      p.rounding_seed = 7;
      p.grad_scale = scale;
      for (auto [o, l] : chunks()) {
        ASSERT_TRUE(engine
                        ->SubmitChunk(view(c), o, l, grad.data() + o, p,
                                      [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; }, undo, mode)
                        .ok());
      }
      engine->WaitIdle();
    };
    // A state with history: two plain steps first, so the moments and scales are non-trivial.
    Compact start = make(0.0f);
    for (int t = 1; t <= 2; ++t) {
      for (float& g : grad) g = normal(rng) * 1e-2f;
      step(start, t, 1.0f, nullptr, UndoMode::kNone);
    }
    for (float& g : grad) g = normal(rng) * 1e-2f;
    Compact plain1 = start, plain_half = start;
    step(plain1, 3, 1.0f, nullptr, UndoMode::kNone);
    step(plain_half, 3, 0.5f, nullptr, UndoMode::kNone);
    ASSERT_FALSE(plain1 == plain_half);

    Compact arena = make(-3.0f);  // poisoned: whatever is read back unsaved shows
    UndoMemory undo;
    undo.master = arena.master.data();
    undo.moments = dtype;
    undo.bf16 = Bf16Moments{arena.m16.data(), arena.v16.data()};
    undo.int8 = Int8Moments{arena.mq.data(), arena.vq.data(), arena.ms.data(), arena.vs.data()};
    Compact spec = start;
    step(spec, 3, 1.0f, &undo, UndoMode::kSave);
    EXPECT_TRUE(spec == plain1) << "a speculative update is the plain one";
    Compact redone = spec;
    step(redone, 3, 0.5f, &undo, UndoMode::kRedo);
    EXPECT_TRUE(redone == plain_half) << "a redo is the update of the saved state";
    auto restore = [&](Compact& c) {
      for (auto [o, l] : chunks()) {
        ASSERT_TRUE(engine->SubmitRestore(view(c), o, l, undo, [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; }).ok());
      }
      engine->WaitIdle();
    };
    Compact restored = spec;
    restore(restored);
    EXPECT_TRUE(restored == start) << "a restore gives the state before the speculative update";

    // Refused part-way at a NaN: the whole chunk was saved, the restore is exact.
    std::vector<float> good = grad;
    grad[tensors[0].begin + 1000 % (tensors[0].end - tensors[0].begin)] = std::numeric_limits<float>::quiet_NaN();
    Compact refused = start;
    {
      AdamWStepParams p;
      p.lr = 1e-3;
      p.step = 3;
      p.nonfinite_grad = NonFiniteGrad::kRefuse;
      int failed = 0;
      ASSERT_TRUE(engine
                      ->SubmitChunk(view(refused), 0, n, grad.data(), p, [&](absl::Status s) { failed += !s.ok(); },
                                    &undo, UndoMode::kSave)
                      .ok());
      engine->WaitIdle();
      EXPECT_EQ(failed, 1);
    }
    restore(refused);
    EXPECT_TRUE(refused == start) << "a refused speculative update is restored exactly";
    grad = good;

    // An undo copy of another moment form is refused before anything runs.
    UndoMemory other = undo;
    other.moments = MomentForm::kF32;
    other.m = arena.master.data();
    other.v = arena.master.data();
    Compact untouched = start;
    EXPECT_EQ(
        engine->SubmitChunk(view(untouched), 0, n, grad.data(), AdamWStepParams{}, [](absl::Status) {}, &other,
                            UndoMode::kSave)
            .code(),
        absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(untouched == start);
  }
}

// runtime.grad_dtype bf16: the speculative update and its redo take the BF16 gradient the same
// way, and each equals the plain BF16 update of the state it starts from, bit for bit.
TEST(LayerAdam, Bf16GradientUndoAndRedoBitExact) {
  const int64_t n = 100003;
  auto engine = MakeEngine(3, WorkerPinning::kNone, /*min_piece=*/64);
  std::mt19937 rng(12);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  OwnedUnit start = RandomState(n, rng, normal);
  std::vector<bf16_t> grad(n);
  std::vector<float> widened(n);
  for (int64_t i = 0; i < n; ++i) {
    grad[i] = FloatToBf16(normal(rng) * 1e-2f);
    widened[i] = Bf16ToFloat(grad[i]);
  }
  AdamWStepParams p;
  p.lr = 1e-3;
  p.step = 3;
  auto run = [&](OwnedUnit& u, float scale, bool bf16, const UndoMemory* undo, UndoMode mode) {
    AdamWStepParams q = p;
    q.grad_scale = scale;
    for (auto [o, l] : RandomChunks(n, rng)) {
      auto done = [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; };
      absl::Status s = bf16 ? engine->SubmitChunkBf16(u.view(), o, l, grad.data() + o, q, done, undo, mode)
                            : engine->SubmitChunk(u.view(), o, l, widened.data() + o, q, done, undo, mode);
      ASSERT_TRUE(s.ok()) << s;
    }
    engine->WaitIdle();
  };
  auto same = [](const OwnedUnit& a, const OwnedUnit& b) { return SameState(a, b); };
  OwnedUnit plain = start, plain_half = start, wide = start;
  run(plain, 1.0f, true, nullptr, UndoMode::kNone);
  run(plain_half, 0.5f, true, nullptr, UndoMode::kNone);
  run(wide, 1.0f, false, nullptr, UndoMode::kNone);
  EXPECT_TRUE(same(plain, wide)) << "a BF16 gradient is its exact FP32 widening";
  ASSERT_FALSE(same(plain, plain_half));
  std::vector<float> um(n), mm(n), vm(n);
  const UndoMemory undo{um.data(), mm.data(), vm.data()};
  OwnedUnit spec = start;
  run(spec, 1.0f, true, &undo, UndoMode::kSave);
  EXPECT_TRUE(same(spec, plain));
  run(spec, 0.5f, true, &undo, UndoMode::kRedo);
  EXPECT_TRUE(same(spec, plain_half)) << "the redo is the update of the saved state";
}

// NonFiniteGrad::kRefuse: a chunk with a NaN or inf is DATA_LOSS naming the element (payload),
// every element before it is updated as with kApply, nothing from it on; kApply propagates.
TEST(LayerAdam, RefusingUpdatesStopAtANonFiniteGradient) {
  auto engine = MakeEngine(1, WorkerPinning::kNone, /*min_piece=*/1 << 20);  // one piece per chunk
  constexpr int64_t kN = 20077;
  const int64_t bad = 12345;
  for (float value : {std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::infinity()}) {
    OwnedUnit unit(kN);
    for (int64_t i = 0; i < kN; ++i) unit.master[i] = 0.01f * static_cast<float>(i % 17);
    OwnedUnit expect = unit;
    std::vector<float> grad(kN, 1e-3f);
    grad[bad] = value;
    AdamWStepParams p;
    p.nonfinite_grad = NonFiniteGrad::kRefuse;
    AdamWStep(p, expect.master.data(), expect.m.data(), expect.v.data(), expect.mirror.data(), grad.data(),
              bad);  // the elements before the bad one
    absl::Notification done;
    absl::Status status;
    ASSERT_TRUE(engine
                    ->SubmitChunk(unit.view(), 0, kN, grad.data(), p,
                                  [&](absl::Status s) {
                                    status = s;
                                    done.Notify();
                                  })
                    .ok());
    done.WaitForNotification();
    EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
    auto e = NonFiniteGradOf(status);
    ASSERT_TRUE(e.has_value()) << status;
    EXPECT_EQ(e->offset, bad);
    EXPECT_EQ(std::isnan(e->value), std::isnan(value));
    ASSERT_EQ(0, std::memcmp(unit.master.data(), expect.master.data(), kN * 4));
    ASSERT_EQ(0, std::memcmp(unit.v.data(), expect.v.data(), kN * 4));
    for (float x : unit.master) ASSERT_TRUE(std::isfinite(x));
  }
  // kApply: as PyTorch, the element becomes non-finite and the chunk is OK.
  OwnedUnit unit(1000);
  std::vector<float> grad(1000, 1e-3f);
  grad[10] = std::numeric_limits<float>::quiet_NaN();
  absl::Notification done;
  ASSERT_TRUE(engine
                  ->SubmitChunk(unit.view(), 0, 1000, grad.data(), AdamWStepParams{},
                                [&](absl::Status s) {
                                  EXPECT_TRUE(s.ok()) << s;
                                  done.Notify();
                                })
                  .ok());
  done.WaitForNotification();
  EXPECT_TRUE(std::isnan(unit.master[10]));
  EXPECT_FALSE(NonFiniteGradOf(absl::DataLossError("other")).has_value());
}

// Clipping off: an update that sums its gradient's squares (SubmitGradSquared) is the plain update
// bit for bit, and its block sums are NormBlockSquares' bits on the norm grid (padding between
// tensors included, never updated), for FP32 and BF16 gradients and pieces split over workers.
TEST(LayerAdam, SquaredUpdatesArePlainUpdatesWithTheGridSquares) {
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  const UnitLayout ul = ModelLayout::Build(*config).units[1];
  const int64_t n = ul.numel;
  ASSERT_GT(n, 4 * kNormBlockNumel);
  std::vector<ElementRange> tensors;
  for (const TensorSlot& t : ul.tensors) tensors.push_back({t.offset_numel, t.offset_numel + t.numel});
  auto engine = MakeEngine(3, WorkerPinning::kNone, /*min_piece=*/64);
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16 gradients" : "fp32 gradients");
    OwnedUnit unit = RandomState(n, rng, normal), expect = unit;
    UnitMemory view = unit.view(), expect_view = expect.view();
    view.tensors = expect_view.tensors = tensors;
    for (int t = 1; t <= 2; ++t) {
      AdamWStepParams p;
      p.step = t;
      p.nonfinite_grad = NonFiniteGrad::kRefuse;
      std::vector<float> grad(n);
      std::vector<bf16_t> grad16(n);
      for (int64_t i = 0; i < n; ++i) {
        grad[i] = normal(rng) * 1e-2f;
        grad16[i] = FloatToBf16(grad[i]);
      }
      auto at = [&](int64_t o) { return bf16 ? GradPtr(grad16.data() + o) : GradPtr(grad.data() + o); };
      std::vector<std::pair<int64_t, int64_t>> chunks = RandomChunks(n, rng);
      std::vector<std::vector<double>> squares(chunks.size());
      std::atomic<int> pending{0};
      for (size_t c = 0; c < chunks.size(); ++c) {
        const auto [o, l] = chunks[c];
        squares[c].assign(NormBlockCount(o, l), -1.0);
        pending += 2;
        auto done = [&](absl::Status s) {
          EXPECT_TRUE(s.ok()) << s;
          pending--;
        };
        ASSERT_TRUE(engine->SubmitGradSquared(view, o, l, at(o), p, squares[c].data(), done).ok());
        ASSERT_TRUE(engine->SubmitGrad(expect_view, o, l, at(o), p, done).ok());
      }
      engine->WaitIdle();
      EXPECT_EQ(pending.load(), 0);
      ASSERT_TRUE(SameState(unit, expect)) << "step " << t;
      for (size_t c = 0; c < chunks.size(); ++c) {
        const auto [o, l] = chunks[c];
        std::vector<double> want(squares[c].size());
        NormBlockSquares(o, l, at(o).data, bf16, 0, static_cast<int64_t>(want.size()), want.data());
        ASSERT_EQ(0, std::memcmp(want.data(), squares[c].data(), want.size() * sizeof(double)))
            << "chunk [" << o << ", +" << l << ")";
      }
    }
  }
  // The grid: blocks where the chunk meets multiples of kNormBlockNumel.
  EXPECT_EQ(NormBlockCount(0, 0), 0);
  EXPECT_EQ(NormBlockCount(0, kNormBlockNumel), 1);
  EXPECT_EQ(NormBlockCount(kNormBlockNumel - 1, 2), 2);
  EXPECT_EQ(NormBlockCount(5, 3 * kNormBlockNumel), 4);
}

// A squared update finds a non-finite gradient element before it writes its block: with kRefuse
// the blocks before it are updated, that block and the rest of its piece are not (DATA_LOSS names
// the element); with kApply the element goes non-finite as in PyTorch.
TEST(LayerAdam, SquaredUpdatesRefuseANonFiniteBlockBeforeWritingIt) {
  auto engine = MakeEngine(1, WorkerPinning::kNone, /*min_piece=*/1 << 22);  // one piece per chunk
  constexpr int64_t kN = 5 * kNormBlockNumel + 77;
  const int64_t offset = 300;  // the chunk starts inside a grid block
  const int64_t bad = 3 * kNormBlockNumel + 5;
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (NonFiniteGrad mode : {NonFiniteGrad::kRefuse, NonFiniteGrad::kApply}) {
    OwnedUnit unit = RandomState(kN, rng, normal), expect = unit;
    std::vector<float> grad(kN - offset, 1e-3f);
    grad[bad - offset] = std::numeric_limits<float>::infinity();
    AdamWStepParams p;
    p.nonfinite_grad = mode;
    const int64_t stop = mode == NonFiniteGrad::kRefuse ? bad / kNormBlockNumel * kNormBlockNumel : kN;
    AdamWStep(p, expect.master.data() + offset, expect.m.data() + offset, expect.v.data() + offset,
              expect.mirror.data() + offset, grad.data(), stop - offset);
    std::vector<double> squares(NormBlockCount(offset, kN - offset));
    absl::Notification done;
    absl::Status status;
    ASSERT_TRUE(engine
                    ->SubmitGradSquared(unit.view(), offset, kN - offset, grad.data(), p, squares.data(),
                                        [&](absl::Status s) {
                                          status = s;
                                          done.Notify();
                                        })
                    .ok());
    done.WaitForNotification();
    ASSERT_TRUE(SameState(unit, expect));
    if (mode == NonFiniteGrad::kRefuse) {
      EXPECT_EQ(status.code(), absl::StatusCode::kDataLoss) << status;
      auto e = NonFiniteGradOf(status);
      ASSERT_TRUE(e.has_value()) << status;
      EXPECT_EQ(e->offset, bad);
      EXPECT_TRUE(std::isinf(e->value));
    } else {
      EXPECT_TRUE(status.ok()) << status;
      EXPECT_TRUE(std::isinf(squares[NormBlockCount(offset, bad - offset + 1) - 1]));
    }
  }
  OwnedUnit unit(16);
  std::vector<float> grad(16);
  EXPECT_EQ(engine->SubmitGradSquared(unit.view(), 0, 16, grad.data(), AdamWStepParams{}, nullptr, [](absl::Status) {})
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// Compact moments (optimizer.state_dtype bf16 / int8): chunks over several workers, split on int8
// blocks, give the kernels' result over each whole tensor bit for bit (BF16's stochastic rounding
// follows the element's global index, never the split); the padding is never touched; a chunk that
// splits an int8 block and an undo copy of compact moments are refused.
TEST(LayerAdam, CompactMomentsChunksAreTheKernelsOverWholeTensors) {
  auto config = ModelConfig::Preset("tiny");
  ASSERT_TRUE(config.ok());
  const UnitLayout ul = ModelLayout::Build(*config).units[1];
  const int64_t n = ul.numel;
  std::vector<ElementRange> tensors;
  for (const TensorSlot& t : ul.tensors) tensors.push_back({t.offset_numel, t.offset_numel + t.numel});
  auto engine = MakeEngine(3, WorkerPinning::kNone, /*min_piece=*/256);
  const AdamStateKernelTable& k = ActiveAdamStateKernels();
  std::mt19937 rng(21);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  constexpr int64_t kFirstIndex = (int64_t{1} << 32) - 5000;  // the rounding's index crosses 2^32
  for (MomentForm dtype : {MomentForm::kBF16, MomentForm::kInt8}) {
    SCOPED_TRACE(ToString(dtype));
    struct Compact {
      std::vector<float> master;
      std::vector<bf16_t> mirror, m16, v16;
      std::vector<int8_t> mq;
      std::vector<uint8_t> vq;
      std::vector<float> ms, vs;
    };
    auto make = [&] {
      Compact c;
      c.master.resize(n);
      for (float& x : c.master) x = normal(rng) * 0.02f;
      c.mirror.assign(n, 0);
      c.m16.assign(n, 0);
      c.v16.assign(n, 0);
      c.mq.assign(n, 0);
      c.vq.assign(n, 0);
      c.ms.assign(Int8MomentBlocks(n), 0.0f);
      c.vs.assign(Int8MomentBlocks(n), 0.0f);
      return c;
    };
    auto view = [&](Compact& c) {
      UnitMemory u;
      u.master = c.master.data();
      u.mirror = c.mirror.data();
      u.numel = n;
      u.moments = dtype;
      u.bf16 = Bf16Moments{c.m16.data(), c.v16.data()};
      u.int8 = Int8Moments{c.mq.data(), c.vq.data(), c.ms.data(), c.vs.data()};
      u.first_index = kFirstIndex;
      u.tensors = tensors;
      return u;
    };
    Compact run = make();
    Compact expect = run;
    const UnitMemory uv = view(run);
    for (int t = 1; t <= 3; ++t) {
      AdamWStepParams p;
      p.lr = 1e-3;
      p.weight_decay = 0.1;
      p.step = t;
      p.rounding_seed = 99;
      std::vector<float> grad(n);
      for (float& g : grad) g = normal(rng) * 1e-2f;
      const AdamWConstants c = MakeAdamWConstants(p);
      for (const ElementRange& r : tensors) {
        const int64_t b = r.begin, len = r.end - r.begin;
        if (dtype == MomentForm::kBF16) {
          k.bf16_step_f32(c, StochasticRounding{99, t, kFirstIndex + b}, expect.master.data() + b,
                          Bf16Moments{expect.m16.data() + b, expect.v16.data() + b}, expect.mirror.data() + b,
                          grad.data() + b, len);
        } else {
          const Int8Moments base{expect.mq.data(), expect.vq.data(), expect.ms.data(), expect.vs.data()};
          k.int8_step_f32(c, expect.master.data() + b, Int8MomentsAt(base, b), expect.mirror.data() + b,
                          grad.data() + b, len);
        }
      }
      // Chunks on block boundaries, in random order.
      std::vector<std::pair<int64_t, int64_t>> chunks;
      std::uniform_int_distribution<int64_t> blocks(1, 40);
      for (int64_t o = 0; o < n;) {
        const int64_t l = std::min(n - o, blocks(rng) * kInt8MomentBlock);
        chunks.emplace_back(o, l);
        o += l;
      }
      std::shuffle(chunks.begin(), chunks.end(), rng);
      std::atomic<int> pending{0};
      for (auto [o, l] : chunks) {
        pending++;
        ASSERT_TRUE(engine
                        ->SubmitChunk(uv, o, l, grad.data() + o, p,
                                      [&](absl::Status s) {
                                        EXPECT_TRUE(s.ok()) << s;
                                        pending--;
                                      })
                        .ok());
      }
      engine->WaitIdle();
      ASSERT_EQ(pending.load(), 0);
      ASSERT_EQ(run.master, expect.master) << "step " << t;
      ASSERT_EQ(0, std::memcmp(run.mirror.data(), expect.mirror.data(), n * 2));
      if (dtype == MomentForm::kBF16) {
        ASSERT_EQ(0, std::memcmp(run.m16.data(), expect.m16.data(), n * 2));
        ASSERT_EQ(0, std::memcmp(run.v16.data(), expect.v16.data(), n * 2));
      } else {
        ASSERT_EQ(run.mq, expect.mq);
        ASSERT_EQ(run.vq, expect.vq);
        ASSERT_EQ(0, std::memcmp(run.ms.data(), expect.ms.data(), run.ms.size() * 4));
        ASSERT_EQ(0, std::memcmp(run.vs.data(), expect.vs.data(), run.vs.size() * 4));
      }
    }
    // (The comparisons above cover all n elements: the padding, which the expectation never
    // updates, is untouched.)
    std::vector<float> grad(n, 1e-3f);
    auto done = [](absl::Status) {};
    if (dtype == MomentForm::kInt8) {
      EXPECT_EQ(engine->SubmitChunk(uv, 100, 512, grad.data(), AdamWStepParams{}, done).code(),
                absl::StatusCode::kInvalidArgument);
      EXPECT_EQ(engine->SubmitChunk(uv, 0, 300, grad.data(), AdamWStepParams{}, done).code(),
                absl::StatusCode::kInvalidArgument);
    }
    std::vector<float> undo_m(n), undo_v(n), undo_master(n);
    const UndoMemory undo{undo_master.data(), undo_m.data(), undo_v.data()};
    EXPECT_EQ(engine->SubmitChunk(uv, 0, n, grad.data(), AdamWStepParams{}, done, &undo, UndoMode::kSave).code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ(engine->SubmitRestore(uv, 0, n, undo, done).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(LayerAdam, ShutdownCompletesEveryChunkOnce) {
  auto engine = MakeEngine(1);
  OwnedUnit unit(4096);
  std::vector<float> grad(4096, 0.1f);
  AdamWStepParams p;
  absl::Notification release, first_running;
  std::vector<std::atomic<int>> calls(8);
  std::atomic<int> cancelled{0};
  ASSERT_TRUE(engine
                  ->SubmitChunk(unit.view(), 0, 512, grad.data(), p,
                                [&](absl::Status s) {
                                  first_running.Notify();
                                  release.WaitForNotification();  // holds the only worker
                                  calls[0]++;
                                })
                  .ok());
  for (int k = 1; k < 8; ++k) {
    ASSERT_TRUE(engine
                    ->SubmitChunk(unit.view(), k * 512, 512, grad.data(), p,
                                  [&, k](absl::Status s) {
                                    EXPECT_TRUE(s.ok() || s.code() == absl::StatusCode::kCancelled)
                                        << s;
                                    if (!s.ok()) cancelled++;
                                    calls[k]++;
                                  })
                    .ok());
  }
  first_running.WaitForNotification();
  std::thread destroyer([&] { engine.reset(); });
  absl::SleepFor(absl::Milliseconds(200));  // let the destructor mark the queues stopping
  release.Notify();
  destroyer.join();
  for (int k = 0; k < 8; ++k) EXPECT_EQ(calls[k].load(), 1) << k;
  // Normally 7 (the worker stops after the piece it was running); a starved destructor thread
  // could let a few more run, so only "some were cancelled" is asserted.
  EXPECT_GT(cancelled.load(), 0);
}

// Thousands of one-piece chunks queued behind a worker held in a `done` (the queue's storage is
// compacted while it never drains), then run again on the recycled chunk records: every chunk
// completes once, OK, and the unit ends as the single-thread steps leave it.
TEST(LayerAdam, DeepQueueAndRecycledChunkRecords) {
  auto engine = MakeEngine(1, WorkerPinning::kNone, /*min_piece=*/1 << 20);  // one piece per chunk
  constexpr int64_t kChunk = 33, kChunks = 3001, kN = kChunk * kChunks;
  OwnedUnit unit(kN), expect(kN);
  std::vector<float> grad(kN);
  for (int64_t i = 0; i < kN; ++i) {
    unit.master[i] = expect.master[i] = std::cos(static_cast<float>(i)) * 0.02f;
    grad[i] = std::sin(static_cast<float>(i)) * 1e-3f;
  }
  std::atomic<int> ok{0};
  for (int64_t step = 1; step <= 2; ++step) {
    AdamWStepParams p;
    p.step = step;
    AdamWStep(p, expect.master.data(), expect.m.data(), expect.v.data(), expect.mirror.data(), grad.data(), kN);
    absl::Notification holding, release;
    ASSERT_TRUE(engine
                    ->SubmitChunk(unit.view(), 0, 0, grad.data(), p,
                                  [&](absl::Status) {
                                    holding.Notify();
                                    release.WaitForNotification();
                                  })
                    .ok());
    holding.WaitForNotification();
    for (int64_t o = 0; o < kN; o += kChunk) {
      ASSERT_TRUE(engine
                      ->SubmitChunk(unit.view(), o, kChunk, grad.data() + o, p,
                                    [&](absl::Status s) {
                                      EXPECT_TRUE(s.ok()) << s;
                                      ok++;
                                    })
                      .ok());
    }
    release.Notify();
    engine->WaitIdle();
    EXPECT_EQ(ok.load(), kChunks * step);
  }
  EXPECT_EQ(0, std::memcmp(unit.master.data(), expect.master.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(unit.m.data(), expect.m.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(unit.v.data(), expect.v.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(unit.mirror.data(), expect.mirror.data(), kN * 2));
}

// Names of this process's threads, from /proc.
std::vector<std::string> ThreadNames() {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream f(e.path() / "comm");
    std::string name;
    std::getline(f, name);
    out.push_back(name);
  }
  return out;
}

TEST(LayerAdam, FirstTouchKeepsContentsAndPinnedWorkersRun) {
  auto engine = MakeEngine(2, WorkerPinning::kCore, 1);
  EXPECT_EQ(engine->num_threads(), 2);
  std::vector<std::string> names = ThreadNames();
  // Each worker names itself when it starts, in no particular order: wait for both names.
  auto named = [&](const char* n) { return std::count(names.begin(), names.end(), n) > 0; };
  for (int i = 0; i < 500 && !(named("adam-0") && named("adam-1")); ++i) {
    absl::SleepFor(absl::Milliseconds(10));  // workers name themselves as they start
    names = ThreadNames();
  }
  EXPECT_EQ(std::count(names.begin(), names.end(), "adam-0"), 1);
  EXPECT_EQ(std::count(names.begin(), names.end(), "adam-1"), 1);
  EXPECT_GE(engine->num_numa_nodes(), 1);
  OwnedUnit unit(300000);
  for (int64_t i = 0; i < 300000; ++i) {
    unit.master[i] = static_cast<float>(i);
    unit.mirror[i] = static_cast<bf16_t>(i);
  }
  ASSERT_TRUE(engine->FirstTouch(unit.view()).ok());
  for (int64_t i = 0; i < 300000; i += 997) {
    ASSERT_EQ(unit.master[i], static_cast<float>(i));
    ASSERT_EQ(unit.mirror[i], static_cast<bf16_t>(i));
  }
  const std::vector<int> nodes = engine->AssignNumaNodes({100, 200, 300});
  ASSERT_EQ(nodes.size(), 3u);
  for (int n : nodes) EXPECT_TRUE(n >= 0 && n < engine->num_numa_nodes());
}

// Each worker runs the function exactly once, on its own "adam-N" thread, all of them inside it
// together (each waits in it until all have arrived: one after another they never would), and
// none before the last has taken the call (one worker is held in a chunk's `done` meanwhile);
// chunks before, during and after the calls give the single-thread result; a worker thread (a
// `done`, or the function itself) is refused rather than left waiting for itself.
TEST(LayerAdam, RunOnEachWorkerRunsEveryWorkerOnceTogether) {
  constexpr int kWorkers = 3;  // more than this machine may have cores: the barrier must not spin
  auto engine = MakeEngine(kWorkers);
  constexpr int64_t kN = 100003;
  OwnedUnit unit(kN), expect(kN);
  std::vector<float> grad(kN);
  for (int64_t i = 0; i < kN; ++i) {
    unit.master[i] = expect.master[i] = std::sin(static_cast<float>(i)) * 0.02f;
    grad[i] = std::cos(static_cast<float>(i)) * 1e-3f;
  }
  auto submit_step = [&](int64_t step) {
    AdamWStepParams p;
    p.step = step;
    AdamWStep(p, expect.master.data(), expect.m.data(), expect.v.data(), expect.mirror.data(), grad.data(), kN);
    for (int64_t o = 0; o < kN; o += 7001) {
      const int64_t l = std::min<int64_t>(7001, kN - o);
      ASSERT_TRUE(
          engine->SubmitChunk(unit.view(), o, l, grad.data() + o, p, [](absl::Status s) { EXPECT_TRUE(s.ok()) << s; })
              .ok());
    }
  };

  struct Run {
    int worker, num_workers, numa_node;
    std::string thread_name;
    bool met_the_others;
    absl::StatusCode nested;
  };
  absl::Mutex mu;
  std::vector<Run> runs;
  int inside = 0;
  std::atomic<int> started{0};
  auto fn = [&](int worker, int num_workers, int numa_node) {
    started++;
    char name[16] = {};
    pthread_getname_np(pthread_self(), name, sizeof(name));
    const absl::StatusCode nested = engine->RunOnEachWorker([](int, int, int) {}).code();
    absl::MutexLock l(&mu);
    ++inside;
    auto all_inside = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) { return inside % kWorkers == 0; };
    const bool met = mu.AwaitWithTimeout(absl::Condition(&all_inside), absl::Seconds(20));
    runs.push_back(Run{worker, num_workers, numa_node, name, met, nested});
  };
  auto expect_each_worker_once = [&](size_t first) {
    absl::MutexLock l(&mu);
    ASSERT_EQ(runs.size(), first + kWorkers);
    std::set<int> workers;
    std::set<std::string> names;
    std::vector<int> per_node(engine->num_numa_nodes());
    for (size_t k = first; k < runs.size(); ++k) {
      const Run& r = runs[k];
      EXPECT_TRUE(r.met_the_others) << "worker " << r.worker << " ran alone";
      EXPECT_EQ(r.num_workers, kWorkers);
      EXPECT_EQ(r.thread_name, absl::StrCat("adam-", r.worker));
      EXPECT_EQ(r.nested, absl::StatusCode::kFailedPrecondition);
      ASSERT_TRUE(r.numa_node >= 0 && r.numa_node < engine->num_numa_nodes()) << r.numa_node;
      per_node[r.numa_node]++;
      workers.insert(r.worker);
      names.insert(r.thread_name);
    }
    EXPECT_EQ(workers, (std::set<int>{0, 1, 2}));
    EXPECT_EQ(names.size(), static_cast<size_t>(kWorkers));
    for (int n = 0; n < engine->num_numa_nodes(); ++n) EXPECT_EQ(per_node[n], engine->workers_on_node(n)) << n;
  };

  // After normal chunks, on an idle engine.
  submit_step(1);
  engine->WaitIdle();
  ASSERT_TRUE(engine->RunOnEachWorker(fn).ok());
  expect_each_worker_once(0);

  // With one worker held in a `done` and a step's chunks queued behind it.
  absl::Notification holding, release;
  ASSERT_TRUE(engine
                  ->SubmitChunk(unit.view(), 0, 0, grad.data(), AdamWStepParams{},
                                [&](absl::Status) {
                                  holding.Notify();
                                  release.WaitForNotification();
                                })
                  .ok());
  holding.WaitForNotification();
  submit_step(2);
  started = 0;
  std::thread caller([&] { EXPECT_TRUE(engine->RunOnEachWorker(fn).ok()); });
  absl::SleepFor(absl::Milliseconds(200));
  EXPECT_EQ(started.load(), 0) << "a worker started before the held one had taken the call";
  release.Notify();
  caller.join();
  expect_each_worker_once(kWorkers);
  engine->WaitIdle();

  submit_step(3);
  absl::Notification refused;
  ASSERT_TRUE(engine
                  ->SubmitChunk(unit.view(), 0, 0, grad.data(), AdamWStepParams{},
                                [&](absl::Status) {
                                  EXPECT_EQ(engine->RunOnEachWorker([](int, int, int) {}).code(),
                                            absl::StatusCode::kFailedPrecondition);
                                  refused.Notify();
                                })
                  .ok());
  refused.WaitForNotification();
  engine->WaitIdle();
  EXPECT_EQ(0, std::memcmp(unit.master.data(), expect.master.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(unit.m.data(), expect.m.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(unit.v.data(), expect.v.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(unit.mirror.data(), expect.mirror.data(), kN * 2));
}

// Copy priority ("DMA before Adam"): a raised urgent word holds a yielding worker's piece until
// the word drops (long max_pause), and the result is bit for bit that of an engine without it.
TEST(LayerAdam, UrgentCopyPausesYieldingWorkersUntilLoweredBitExact) {
  constexpr int64_t kN = 100003;  // 13 blocks, and an odd tail
  std::mt19937 rng(11);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  OwnedUnit paused(kN);
  for (float& x : paused.master) x = normal(rng) * 0.02f;
  OwnedUnit plain = paused;
  std::vector<float> grad(kN);
  for (float& g : grad) g = normal(rng) * 1e-2f;
  std::vector<bf16_t> grad_bf16(kN);
  for (int64_t i = 0; i < kN; ++i) grad_bf16[i] = FloatToBf16(grad[i] * 0.5f);
  const std::vector<ElementRange> tensors = {{0, 40000}, {40064, 99000}, {99072, kN}};

  auto reference = MakeEngine(2);
  auto engine = MakeEngine(2);
  std::atomic<uint32_t> rank0{0}, rank1{0};
  const std::atomic<uint32_t>* words[] = {&rank0, &rank1};
  ASSERT_TRUE(engine->SetCopyPriority(words, 1.0, absl::Seconds(60)).ok());
  EXPECT_FALSE(engine->SetCopyPriority(words, 1.5).ok());
  EXPECT_FALSE(engine->SetCopyPriority(words, 0.5, absl::ZeroDuration()).ok());
  ASSERT_TRUE(engine->SetCopyPriority(words, 1.0, absl::Seconds(60)).ok());  // (a refused call changes nothing)

  AdamWStepParams p;
  p.lr = 1e-3;
  p.weight_decay = 0.01;
  for (int t = 1; t <= 2; ++t) {
    p.step = t;
    UnitMemory pu = paused.view(), ru = plain.view();
    pu.tensors = ru.tensors = tensors;
    absl::Notification ref_done, done;
    if (t == 1) {
      ASSERT_TRUE(reference->SubmitChunk(ru, 0, kN, grad.data(), p, [&](absl::Status s) { ref_done.Notify(); }).ok());
    } else {
      ASSERT_TRUE(
          reference->SubmitChunkBf16(ru, 0, kN, grad_bf16.data(), p, [&](absl::Status s) { ref_done.Notify(); }).ok());
    }
    ASSERT_TRUE(ref_done.WaitForNotificationWithTimeout(absl::Seconds(30)));

    rank1.store(1);  // rank 1 has an urgent copy in flight
    absl::Status status = absl::UnknownError("not run");
    auto on_done = [&](absl::Status s) {
      status = s;
      done.Notify();
    };
    if (t == 1) {
      ASSERT_TRUE(engine->SubmitChunk(pu, 0, kN, grad.data(), p, on_done).ok());
    } else {
      ASSERT_TRUE(engine->SubmitChunkBf16(pu, 0, kN, grad_bf16.data(), p, on_done).ok());
    }
    EXPECT_FALSE(done.WaitForNotificationWithTimeout(absl::Milliseconds(300))) << "the chunk ran past a raised word";
    EXPECT_GE(engine->workers_paused(), 1);
    const double paused_before = engine->paused_s();
    rank1.store(0);
    shm::FutexWakeAll(&rank1);
    ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20))) << "the chunk did not resume";
    EXPECT_TRUE(status.ok()) << status;
    EXPECT_EQ(engine->workers_paused(), 0);
    EXPECT_GE(engine->paused_s(), paused_before);
  }
  EXPECT_GE(engine->paused_s(), 0.5);  // two pauses of >= 300 ms
  EXPECT_EQ(0, std::memcmp(paused.master.data(), plain.master.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(paused.m.data(), plain.m.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(paused.v.data(), plain.v.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(paused.mirror.data(), plain.mirror.data(), kN * 2));

  // Cleared: a raised word no longer holds anything.
  engine->ClearCopyPriority();
  rank0.store(1);
  absl::Notification done;
  p.step = 3;
  ASSERT_TRUE(engine->SubmitChunk(paused.view(), 0, kN, grad.data(), p, [&](absl::Status) { done.Notify(); }).ok());
  EXPECT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(20)));
}

// A word left raised (its writer died) slows the yielding workers to a block per max_pause but
// never stalls them, and the update is still exact.
TEST(LayerAdam, UrgentWordStuckRaisedStillCompletesWithinMaxPauses) {
  constexpr int64_t kN = 8 * LayerAdam::kYieldBlockNumel + 5;  // 9 blocks on one worker
  OwnedUnit paused(kN);
  for (int64_t i = 0; i < kN; ++i) paused.master[i] = 0.01f * static_cast<float>(i % 97);
  OwnedUnit plain = paused;
  std::vector<float> grad(kN);
  for (int64_t i = 0; i < kN; ++i) grad[i] = 1e-3f * static_cast<float>(i % 13) - 6e-3f;
  AdamWStepParams p;
  p.lr = 1e-3;
  p.step = 1;
  AdamWStep(p, plain.master.data(), plain.m.data(), plain.v.data(), plain.mirror.data(), grad.data(), kN);

  auto engine = MakeEngine(1, WorkerPinning::kNone, /*min_piece=*/kN);
  std::atomic<uint32_t> stuck{1};
  const std::atomic<uint32_t>* words[] = {&stuck};
  const absl::Duration max_pause = absl::Milliseconds(20);
  ASSERT_TRUE(engine->SetCopyPriority(words, 1.0, max_pause).ok());
  absl::Notification done;
  const absl::Time t0 = absl::Now();
  ASSERT_TRUE(engine->SubmitChunk(paused.view(), 0, kN, grad.data(), p, [&](absl::Status) { done.Notify(); }).ok());
  // 9 blocks: at most 9 pauses (one before every other block at least), ~0.2 s; the bound is generous.
  ASSERT_TRUE(done.WaitForNotificationWithTimeout(absl::Seconds(10))) << "a stuck word stalled LayerAdam";
  const double took = absl::ToDoubleSeconds(absl::Now() - t0);
  EXPECT_GE(took, 0.06);                // it did pause: at least 5 pauses of 20 ms (alternating with blocks)
  EXPECT_GE(engine->paused_s(), 0.06);  // and counted them
  EXPECT_LT(engine->paused_s(), 5.0);
  EXPECT_EQ(0, std::memcmp(paused.master.data(), plain.master.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(paused.m.data(), plain.m.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(paused.v.data(), plain.v.data(), kN * 4));
  EXPECT_EQ(0, std::memcmp(paused.mirror.data(), plain.mirror.data(), kN * 2));
}

TEST(LayerAdam, YieldingWorkersKeepOnePerNodeRunning) {
  EXPECT_EQ(YieldingWorkers(4, 0.5), 2);
  EXPECT_EQ(YieldingWorkers(4, 0.0), 0);
  EXPECT_EQ(YieldingWorkers(4, 1.0), 4);
  EXPECT_EQ(YieldingWorkers(4, 0.99), 3);
  EXPECT_EQ(YieldingWorkers(1, 0.5), 0);
  EXPECT_EQ(YieldingWorkers(1, 1.0), 1);
  EXPECT_EQ(YieldingWorkers(16, 0.01), 1);  // any fraction above 0 pauses someone where it can
  EXPECT_EQ(YieldingWorkers(0, 0.5), 0);
}

// yield_fraction 0.5 with 4 workers: half of the node's workers pause on a raised word, the other
// half go on updating chunks submitted meanwhile.
TEST(LayerAdam, HalfTheWorkersYieldTheOtherHalfKeepRunning) {
  auto engine = MakeEngine(4, WorkerPinning::kNone, /*min_piece=*/1024);
  const int yielders = YieldingWorkers(engine->workers_on_node(0), 0.5);
  if (yielders == 0) GTEST_SKIP() << "one worker on NUMA node 0: nobody yields";
  std::atomic<uint32_t> urgent{1};
  const std::atomic<uint32_t>* words[] = {&urgent};
  ASSERT_TRUE(engine->SetCopyPriority(words, 0.5, absl::Seconds(60)).ok());

  constexpr int kUnits = 8;
  constexpr int64_t kN = 4 * 4 * LayerAdam::kYieldBlockNumel;  // 4 pieces of 4 blocks
  std::vector<OwnedUnit> units;
  for (int u = 0; u < kUnits; ++u) units.emplace_back(kN);
  std::vector<float> grad(kN, 1e-3f);
  std::vector<std::atomic<bool>> busy(kUnits);
  std::atomic<int> completed{0};
  AdamWStepParams p;
  p.lr = 1e-4;
  p.step = 1;
  auto submit = [&](int u) {
    busy[u] = true;
    ASSERT_TRUE(engine
                    ->SubmitChunk(units[u].view(), 0, kN, grad.data(), p,
                                  [&, u](absl::Status s) {
                                    EXPECT_TRUE(s.ok()) << s;
                                    busy[u] = false;
                                    completed++;
                                  })
                    .ok());
  };
  // Keep the queue fed until the yielding workers have each taken a piece and paused on it.
  const absl::Time deadline = absl::Now() + absl::Seconds(20);
  while (engine->workers_paused() < yielders && absl::Now() < deadline) {
    bool any = false;
    for (int u = 0; u < kUnits; ++u) {
      if (!busy[u]) {
        submit(u);
        any = true;
        break;
      }
    }
    if (!any) absl::SleepFor(absl::Milliseconds(1));
  }
  ASSERT_EQ(engine->workers_paused(), yielders);
  // The others keep going: every chunk not held by a paused worker completes, and new ones too.
  const int before = completed.load();
  int submitted_after = 0;
  for (int u = 0; u < kUnits && submitted_after < 3; ++u) {
    absl::SleepFor(absl::Milliseconds(20));
    if (!busy[u]) {
      submit(u);
      ++submitted_after;
    }
  }
  const absl::Time wait_until = absl::Now() + absl::Seconds(20);
  while (completed.load() < before + submitted_after && absl::Now() < wait_until) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_GE(completed.load(), before + submitted_after) << "the non-yielding workers stopped too";
  EXPECT_EQ(engine->workers_paused(), yielders) << "more than the yielding workers paused";
  auto held = [&] {
    int n = 0;
    for (int u = 0; u < kUnits; ++u) n += busy[u] ? 1 : 0;
    return n;
  };
  while (held() > yielders && absl::Now() < wait_until) absl::SleepFor(absl::Milliseconds(1));
  EXPECT_GE(held(), 1);
  EXPECT_LE(held(), yielders);  // each paused worker holds one piece

  urgent.store(0);
  shm::FutexWakeAll(&urgent);
  engine->WaitIdle();
  EXPECT_EQ(engine->workers_paused(), 0);
}

TEST(LayerAdam, DefaultThreadCountLeavesAReserve) {
  EXPECT_EQ(DefaultUpdateThreads(2), 2);
  EXPECT_EQ(DefaultUpdateThreads(4), 3);
  EXPECT_EQ(DefaultUpdateThreads(16), 14);
  EXPECT_EQ(DefaultUpdateThreads(32, 4), 28);
  EXPECT_EQ(DefaultUpdateThreads(1, 3), 1);
  absl::StatusOr<std::vector<int>> cores = CoresPerNumaNode();
  ASSERT_TRUE(cores.ok()) << cores.status();
  int total = 0;
  for (int c : *cores) total += c;
  EXPECT_GE(total, 1);
}

TEST(UnitTracker, RefusesOverlapsAndOutOfOrderSteps) {
  int fired = 0;
  UnitTracker tracker({100, 50}, [&](int, int64_t, const absl::Status&) { fired++; });
  auto a = tracker.Track(0, 1, 0, 60);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(tracker.Track(0, 1, 59, 10).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(tracker.Track(0, 1, 0, 60).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(tracker.Track(0, 2, 60, 40).status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(tracker.Track(0, 1, 60, 41).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(tracker.Track(2, 1, 0, 1).status().code(), absl::StatusCode::kInvalidArgument);
  auto b = tracker.Track(0, 1, 60, 40);
  ASSERT_TRUE(b.ok());
  (*a)(absl::OkStatus());
  EXPECT_EQ(fired, 0);
  (*b)(absl::OkStatus());
  EXPECT_EQ(fired, 1);
  EXPECT_EQ(tracker.completed_step(0), 1);
  EXPECT_EQ(tracker.completed_step(1), 0);
  EXPECT_FALSE(tracker.WaitForStep(1, 1, absl::Milliseconds(1)));
}

TEST(UnitTracker, ChunkErrorFailsTheUnitOnce) {
  std::vector<absl::Status> seen;
  UnitTracker tracker(
      {10}, [&](int, int64_t, const absl::Status& s) { seen.push_back(s); }, 4);
  auto a = tracker.Track(0, 5, 0, 5);
  auto b = tracker.Track(0, 5, 5, 5);
  ASSERT_TRUE(a.ok() && b.ok());
  (*a)(absl::CancelledError("stopped"));
  (*b)(absl::OkStatus());
  ASSERT_EQ(seen.size(), 1u);
  EXPECT_EQ(seen[0].code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(tracker.completed_step(0), 4);
  EXPECT_TRUE(tracker.Track(0, 5, 0, 10).ok());  // the step can be retried
}

TEST(GradNorm, ExactOnceAndIndependentOfOrder) {
  const std::vector<int64_t> sizes = {10007, 3001};
  std::mt19937 rng(3);
  std::normal_distribution<float> normal(0.0f, 0.1f);
  std::vector<std::vector<float>> grads;
  double ref = 0;
  for (int64_t n : sizes) {
    grads.emplace_back(n);
    for (float& g : grads.back()) {
      g = normal(rng);
      ref += static_cast<double>(g) * g;
    }
  }
  std::vector<std::tuple<int, int64_t, int64_t>> chunks;
  for (size_t u = 0; u < sizes.size(); ++u) {
    for (auto [o, l] : RandomChunks(sizes[u], rng)) chunks.emplace_back(static_cast<int>(u), o, l);
  }
  double first = -1;
  for (int trial = 0; trial < 3; ++trial) {
    std::shuffle(chunks.begin(), chunks.end(), rng);
    GradNormAccumulator acc(sizes);
    EXPECT_EQ(acc.Norm().status().code(), absl::StatusCode::kFailedPrecondition);
    std::vector<std::thread> threads;
    for (int t = 0; t < 3; ++t) {
      threads.emplace_back([&, t] {
        for (size_t k = t; k < chunks.size(); k += 3) {
          auto [u, o, l] = chunks[k];
          EXPECT_TRUE(acc.AddChunk(u, o, l, grads[u].data() + o).ok());
        }
      });
    }
    for (auto& th : threads) th.join();
    ASSERT_TRUE(acc.complete());
    const double norm = *acc.Norm();
    EXPECT_NEAR(norm, std::sqrt(ref), 1e-12 * std::sqrt(ref));
    if (first < 0) first = norm;
    EXPECT_EQ(norm, first) << "depends on arrival order";
    auto [u, o, l] = chunks[0];
    EXPECT_EQ(acc.AddChunk(u, o, l, grads[u].data() + o).code(), absl::StatusCode::kAlreadyExists);
    EXPECT_EQ(acc.AddPartial(0, 10000, 8, 1.0).code(), absl::StatusCode::kInvalidArgument);
  }
}

TEST(GradNorm, ClipCoefficientLikeTorch) {
  EXPECT_EQ(ClipCoefficient(2.0, 1.0), 1.0f / (2.0f + 1e-6f));
  EXPECT_EQ(ClipCoefficient(0.5, 1.0), 1.0f);
  EXPECT_LT(ClipCoefficient(1.0, 1.0), 1.0f);  // 1/(1+1e-6) < 1: clipped slightly, as torch
  EXPECT_GT(ClipCoefficient(1.0, 1.0), 0.99999f);
  EXPECT_EQ(ClipCoefficient(5.0, 0.0), 1.0f);  // clipping off
  EXPECT_EQ(ClipCoefficient(std::numeric_limits<double>::infinity(), 1.0), 0.0f);
  EXPECT_TRUE(std::isnan(ClipCoefficient(std::nan(""), 1.0)));
}

}  // namespace
}  // namespace slidedp::update
