// AutoPolicy's probes and choice on one worker; see auto_policy.h.
#include "worker/pipeline/auto_policy.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "common/numeric/bf16.h"
#include "common/policy/layout_solver.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"
#include "worker/pipeline/activation_store.h"

namespace slidedp {
namespace {

// Small uniform values from a fixed xorshift: weights and activations of a plausible scale, so the
// probe's kernels run as they do on real data (no zeros, no overflow).
class Noise {
 public:
  float Next(float scale) {
    s_ ^= s_ << 13;
    s_ ^= s_ >> 7;
    s_ ^= s_ << 17;
    return scale * (static_cast<float>(s_ >> 40) / static_cast<float>(1ull << 24) * 2.0f - 1.0f);
  }

 private:
  uint64_t s_ = 0x2545f4914f6cdd1dull;
};

absl::StatusOr<std::unique_ptr<DeviceBuffer>> Filled(ComputeBackend* b, int64_t count, Dtype dtype, float scale,
                                                     Noise& noise) {
  ASSIGN_OR_RETURN(auto buf, b->Allocate(count * DtypeBytes(dtype)));
  if (dtype == Dtype::kF32) {
    std::vector<float> v(static_cast<size_t>(count));
    for (float& x : v) x = noise.Next(scale);
    RETURN_IF_ERROR(b->CopyToDevice(v.data(), buf->data(), buf->bytes()));
  } else {
    std::vector<bf16_t> v(static_cast<size_t>(count));
    for (bf16_t& x : v) x = FloatToBf16(noise.Next(scale));
    RETURN_IF_ERROR(b->CopyToDevice(v.data(), buf->data(), buf->bytes()));
  }
  return buf;
}

// The recompute step's peak less the checkpoints it kept on the device: what no layout changes.
int64_t WorkingSetBytes(const AutoPolicyInputs& in) {
  return std::max<int64_t>(0, in.recompute_step.peak_bytes - in.layout->config.num_hidden_layers * in.checkpoint_bytes);
}

// The device bytes a layout may keep: the capacity's usable fraction less the working set.
int64_t LayoutBudgetBytes(const AutoPolicyInputs& in) {
  return std::max<int64_t>(0, static_cast<int64_t>(kAutoPolicyUsableFraction * static_cast<double>(in.capacity_bytes)) -
                                  WorkingSetBytes(in));
}

// What a layer's `bytes` measured on the recompute step's tokens become on the largest step the
// job can have (AutoPolicyInputs::largest_step_scale).
int64_t AtLargestStep(const AutoPolicyInputs& in, int64_t bytes) {
  return static_cast<int64_t>(std::ceil(static_cast<double>(bytes) * std::max(1.0, in.largest_step_scale)));
}

// The device room checkpoints take while they cross, for layers moving `moved` bytes each: one
// layer's going out (freed when its copy ends), one coming back ahead of its backward, and the
// pool's blocks split around them (4 inputs' room, as measured safe for inputs alone), plus what a
// layer moves beyond its input.
int64_t InFlightBytes(int64_t checkpoint_bytes, int64_t moved) {
  return moved > 0 ? 4 * checkpoint_bytes + std::max<int64_t>(0, moved - checkpoint_bytes) : 0;
}

}  // namespace

std::vector<LayerPolicy> ProbedPolicies(const ModelConfig& config) {
  // Layers that keep nothing under any policy (ModelShape::layers_keep_pieces: Qwen3.5's, Gemma's) run every
  // policy as recompute: timing the others would only spend the probe's time.
  if (!ModelShape::Of(config).layers_keep_pieces()) return {LayerPolicy{LayerKind::kRecompute}};
  auto segment = [](uint32_t keep) { return LayerPolicy{LayerKind::kSegment, false, keep}; };
  return {LayerPolicy{LayerKind::kRecompute},
          LayerPolicy{LayerKind::kSelective},
          segment(kPieceGateUp),
          segment(kPieceGateUp | kPieceQkv),
          segment(kPieceGateUp | kPieceQkv | kPieceAttention),
          segment(kExpensivePieces),
          LayerPolicy{LayerKind::kKeepAll}};
}

namespace {

// ProfileLayer's measurement of one decoder layer (unit `probed`) under each policy.
absl::StatusOr<std::vector<LayerProbe>> ProfileUnit(ComputeBackend* backend, const ModelLayout& layout, int probed,
                                                    const std::vector<MicroBatch>& micro_batches,
                                                    const std::vector<LayerPolicy>& policies, int repeats) {
  const UnitLayout& unit = layout.units[probed];
  const int64_t hidden = layout.config.hidden_size;
  const Dtype act = backend->activation_dtype();
  Noise noise;
  ASSIGN_OR_RETURN(auto params, Filled(backend, unit.numel, Dtype::kBF16, 0.02f, noise));
  ASSIGN_OR_RETURN(auto grads, backend->Allocate(unit.numel * 4));
  RETURN_IF_ERROR(backend->Memset(*grads, 0));
  std::vector<std::unique_ptr<DeviceBatch>> batches;
  std::vector<std::unique_ptr<DeviceBuffer>> x, y, dy;
  for (const MicroBatch& mb : micro_batches) {
    ASSIGN_OR_RETURN(auto b, backend->UploadBatch(mb));
    const int64_t n = mb.num_tokens() * hidden;
    ASSIGN_OR_RETURN(auto xi, Filled(backend, n, act, 1.0f, noise));
    ASSIGN_OR_RETURN(auto yi, backend->Allocate(n * DtypeBytes(act)));
    ASSIGN_OR_RETURN(auto dyi, Filled(backend, n, act, 1e-3f, noise));
    batches.push_back(std::move(b));
    x.push_back(std::move(xi));
    y.push_back(std::move(yi));
    dy.push_back(std::move(dyi));
  }
  const UnitParams p = UnitParams(params->as<bf16_t>()).OfLayer(unit.decoder_layer);
  std::vector<LayerProbe> out;
  for (size_t k = 0; k < policies.size(); ++k) {
    const ActPolicy policy = ActPolicyOf(policies[k]);
    LayerProbe probe;
    probe.policy = policies[k];
    probe.policy.offload = 0;
    probe.time_s = probe.forward_s = std::numeric_limits<double>::infinity();
    absl::Status status;
    for (int r = 0; r <= std::max(1, repeats) && status.ok(); ++r) {  // r == 0 warms up
      status = [&]() -> absl::Status {
        RETURN_IF_ERROR(backend->Synchronize());
        const absl::Time t0 = absl::Now();
        std::vector<std::unique_ptr<SavedActivations>> saved(batches.size());
        for (size_t i = 0; i < batches.size(); ++i) {
          RETURN_IF_ERROR(backend->DecoderForward(p, *batches[i], x[i]->data(), y[i]->data(), policy,
                                                  policy == ActPolicy::kRecomputeLayer ? nullptr : &saved[i]));
        }
        RETURN_IF_ERROR(backend->Synchronize());
        if (r > 0) probe.forward_s = std::min(probe.forward_s, absl::ToDoubleSeconds(absl::Now() - t0));
        int64_t kept = 0;
        for (const auto& s : saved) kept += s ? s->bytes() : 0;
        for (size_t i = batches.size(); i-- > 0;) {
          // dy is overwritten by dx: the next repeat's gradient is a scaled one, equally costly.
          RETURN_IF_ERROR(backend->DecoderBackward(p, *batches[i], x[i]->data(), saved[i].get(), dy[i]->data(),
                                                   dy[i]->data(), grads->as<float>()));
        }
        RETURN_IF_ERROR(backend->Synchronize());
        if (r > 0) probe.time_s = std::min(probe.time_s, absl::ToDoubleSeconds(absl::Now() - t0));
        probe.saved_bytes = kept;
        return absl::OkStatus();
      }();
    }
    if (!status.ok()) {
      if (status.code() != absl::StatusCode::kResourceExhausted || k == 0) return status;
      LOG(INFO) << "AutoPolicy: " << LayerPolicyName(probe.policy) << " does not fit for the probe ("
                << status.message() << "); not a candidate";
      RETURN_IF_ERROR(backend->Synchronize());
      continue;
    }
    out.push_back(probe);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::vector<LayerProbe>> ProfileLayer(ComputeBackend* backend, const ModelLayout& layout,
                                                     const std::vector<MicroBatch>& micro_batches,
                                                     const std::vector<LayerPolicy>& policies, int repeats) {
  if (layout.num_units() < 3) return absl::FailedPreconditionError("AutoPolicy: the model has no decoder layer");
  if (micro_batches.empty()) return absl::InvalidArgumentError("AutoPolicy: no micro-batch to profile");
  // The layers probed stand for all: a MoE model's sparse ones (its dense ones cost less), and among
  // them the first of each attention span (a sliding layer's attention costs less than a full one's
  // at rows longer than its window). Each kind's times count by its number of layers, so the probes
  // are the mean layer's: what the solver's interchangeable layers add up to; its bytes are the
  // largest kind's.
  std::map<int64_t, std::pair<int, int>> kinds;  // attention window -> (first unit, layers)
  const bool moe = layout.config.is_moe() && layout.config.NumSparseLayers() > 0;
  for (int u = 1; u + 1 < layout.num_units(); ++u) {
    const UnitLayout& unit = layout.units[u];
    if (unit.kind != UnitKind::kDecoder || (moe && !unit.sparse())) continue;
    ++kinds.try_emplace(unit.attention_window, u, 0).first->second.second;
  }
  if (kinds.empty()) kinds.emplace(0, std::make_pair(1, 1));
  std::vector<LayerProbe> mean;
  int layers = 0;
  for (const auto& [window, first_and_count] : kinds) {
    const auto [unit, count] = first_and_count;
    ASSIGN_OR_RETURN(std::vector<LayerProbe> probes,
                     ProfileUnit(backend, layout, unit, micro_batches, policies, repeats));
    if (kinds.size() == 1) return probes;
    auto same = [](const LayerProbe& a, const LayerProbe& b) {
      return LayerPolicyName(a.policy) == LayerPolicyName(b.policy);
    };
    if (mean.empty()) {
      mean = probes;
      for (LayerProbe& m : mean) m.time_s = m.forward_s = 0, m.saved_bytes = 0;
    }
    // A policy that did not fit one kind's probe is no candidate for any.
    std::erase_if(mean, [&](const LayerProbe& m) {
      return std::none_of(probes.begin(), probes.end(), [&](const LayerProbe& p) { return same(p, m); });
    });
    for (LayerProbe& m : mean) {
      for (const LayerProbe& p : probes) {
        if (!same(p, m)) continue;
        m.time_s += count * p.time_s;
        m.forward_s += count * p.forward_s;
        m.saved_bytes = std::max(m.saved_bytes, p.saved_bytes);
      }
    }
    layers += count;
    LOG(INFO) << "AutoPolicy: probed layer " << layout.units[unit].decoder_layer << " for its " << count
              << (window > 0 ? absl::StrCat(" sliding layers (window ", window, ")") : std::string(" full layers"));
  }
  for (LayerProbe& m : mean) {
    m.time_s /= layers;
    m.forward_s /= layers;
  }
  return mean;
}

absl::StatusOr<AutoPolicyChoice> ChooseLayout(const AutoPolicyInputs& in, int64_t device_budget_bytes) {
  if (in.layout == nullptr || in.probes.empty()) return absl::InvalidArgumentError("AutoPolicy: nothing measured");
  const ModelLayout& layout = *in.layout;
  const int64_t layers = layout.config.num_hidden_layers;
  const LayerProbe* recompute = nullptr;
  for (const LayerProbe& p : in.probes) {
    if (p.policy.kind == LayerKind::kRecompute) recompute = &p;
  }
  if (recompute == nullptr) return absl::InvalidArgumentError("AutoPolicy: the recompute kind was not measured");
  const StepObservation& s = in.recompute_step;
  AutoPolicyRecord rec;
  rec.build = in.build;
  rec.capacity_bytes = in.capacity_bytes;
  // The working set: the recompute step's peak less the checkpoints it kept on the device.
  rec.working_set_bytes = WorkingSetBytes(in);
  PolicyProblem& problem = rec.problem;
  problem.layers = layers;
  problem.device_budget_bytes = device_budget_bytes >= 0 ? device_budget_bytes : LayoutBudgetBytes(in);
  problem.host_budget_bytes = in.host_budget_bytes;
  StepBase& base = problem.base;
  // The worker queues compute asynchronously, so its gate waits overlap the GPU's work: the compute
  // stream's time is the step less its flush, and what the layers do not take of it (the embedding,
  // the head, stalls on copies or gates) stays as it is when the layers change. Also where the
  // host's updates pace the step (small batches, long gate waits): measured on Qwen3-4B at 16K
  // (session 23), a layout's gain in GPU time came off the step as a whole (the gradients reach
  // LayerAdam sooner) rather than leaving it at the gated recompute step's length, so the step
  // model keeps no separate host floor here (that run's figures: a floor predicted -10.1% off the
  // steady step, this model -4.6%).
  const double flush = std::max(0.0, s.total_s - s.compute_s - s.gate_s);
  base.compute_s = std::max(0.0, s.total_s - flush - static_cast<double>(layers) * recompute->time_s);
  base.h2d_s = s.h2d_s;
  base.d2h_s = s.d2h_s;
  base.exposed_s = flush;
  base.h2d_bytes_per_s = in.rates.h2d_bytes_per_s;
  base.d2h_bytes_per_s = in.rates.d2h_bytes_per_s;
  for (const LayerProbe& p : in.probes) {
    for (double share : OffloadShares(in.micro_batches)) {
      if (share > 0 && in.host_budget_bytes == 0) continue;
      const int64_t checkpoint = AtLargestStep(in, in.checkpoint_bytes);
      const double kept = static_cast<double>(checkpoint + AtLargestStep(in, p.saved_bytes));
      const auto moved = static_cast<int64_t>(std::llround(share * kept));
      LayerCandidate c;
      c.policy = p.policy;
      c.policy.offload = share;
      c.time_s = p.time_s;
      c.forward_s = p.forward_s;
      c.device_bytes = static_cast<int64_t>(std::llround(kept)) - moved;
      c.host_bytes = c.h2d_bytes = c.d2h_bytes = moved;
      c.in_flight_bytes = InFlightBytes(checkpoint, moved);
      problem.candidates.push_back(c);
    }
  }
  ASSIGN_OR_RETURN(rec.predicted, SolvePolicy(problem));
  // Checkpoints crossing PCIe also take host memory bandwidth from LayerAdam, which the step model
  // does not see: a layout offloads only when that gains kAutoPolicyOffloadGain over the best one
  // that does not.
  if (rec.predicted.h2d_s > base.h2d_s) {
    PolicyProblem on_device = problem;
    std::erase_if(on_device.candidates, [](const LayerCandidate& c) { return c.policy.offload > 0; });
    on_device.host_budget_bytes = 0;
    absl::StatusOr<LayoutSolution> kept = SolvePolicy(on_device);
    if (kept.ok() && kept->step_s <= (1 + kAutoPolicyOffloadGain) * rec.predicted.step_s) {
      LOG(INFO) << absl::StrFormat(
          "AutoPolicy: offloading (%s) predicts %.3f s, within %.0f%% of %.3f s with every checkpoint on the device; "
          "nothing is offloaded",
          MixName(problem.candidates, rec.predicted.counts), rec.predicted.step_s, 100 * kAutoPolicyOffloadGain,
          kept->step_s);
      problem = std::move(on_device);
      rec.predicted = std::move(*kept);
    }
  }
  AutoPolicyChoice out;
  out.layout.model = ModelShape::Of(layout.config);
  out.layout.device = in.device_name;
  out.layout.tokens_per_step = in.tokens_per_step;
  out.layout.layers = PlaceLayers(problem.candidates, rec.predicted.counts);
  out.predicted_peak_bytes = rec.working_set_bytes + rec.predicted.device_bytes;
  out.summary = absl::StrFormat(
      "%s; predicted step %.3f s (compute %.3f, H2D %.3f, D2H %.3f, host %.3f, exposed %.3f s), bound by %s; "
      "device peak %.2f GiB of %.2f GiB, pinned host %.2f GiB",
      MixName(problem.candidates, rec.predicted.counts), rec.predicted.step_s, rec.predicted.compute_s,
      rec.predicted.h2d_s, rec.predicted.d2h_s, rec.predicted.host_s, base.exposed_s, rec.predicted.bottleneck,
      out.predicted_peak_bytes / 1073741824.0, in.capacity_bytes / 1073741824.0,
      rec.predicted.host_bytes / 1073741824.0);
  out.layout.autopolicy = std::move(rec);
  RunnableLayout(out.layout, layout.num_units(), &out.policies, &out.offloaded);
  return out;
}

void RunnableLayout(const LayerLayout& layout, int num_units, std::vector<ActPolicy>* policies,
                    std::vector<double>* offloaded) {
  policies->clear();
  offloaded->assign(static_cast<size_t>(num_units), 0.0);
  bool any = false;
  for (size_t i = 0; i < layout.layers.size() && static_cast<int>(i) + 1 < num_units; ++i) {
    policies->push_back(ActPolicyOf(layout.layers[i]));
    (*offloaded)[i + 1] = layout.layers[i].offload;
    any |= layout.layers[i].offload > 0;
  }
  if (!any) offloaded->clear();
}

std::vector<double> OffloadShares(int micro_batches) {
  const int n = std::max(1, micro_batches);
  std::vector<double> out;
  int last = -1;
  for (int q = 0; q <= 4; ++q) {
    const int k = n >= 4 ? static_cast<int>(std::lround(q * n / 4.0)) : std::min(q, n);
    if (k == last) continue;
    out.push_back(static_cast<double>(k) / n);
    last = k;
  }
  return out;
}

std::vector<SweepLayout> SweepLayouts(const AutoPolicyInputs& in) {
  std::vector<SweepLayout> out;
  if (in.layout == nullptr) return out;
  const ModelLayout& layout = *in.layout;
  const int64_t layers = layout.config.num_hidden_layers;
  const int64_t working_set = WorkingSetBytes(in), budget = LayoutBudgetBytes(in);
  const int64_t checkpoint = AtLargestStep(in, in.checkpoint_bytes);
  for (const LayerProbe& p : in.probes) {
    if (p.policy.kind == LayerKind::kRecompute) continue;
    const int64_t saved = AtLargestStep(in, p.saved_bytes);
    for (const double ratio : {0.0, 0.5}) {
      const int64_t offloaded = std::llround(ratio * static_cast<double>(layers));
      // The device and pinned bytes of the last k layers kept as p, the first `offloaded` whole.
      auto bytes = [&](int64_t k, int64_t* host) {
        int64_t device = 0, most_moved = 0;
        *host = 0;
        for (int64_t l = 0; l < layers; ++l) {
          const int64_t kept = checkpoint + (l >= layers - k ? saved : 0);
          if (l < offloaded) {
            *host += kept;
            most_moved = std::max(most_moved, kept);
          } else {
            device += kept;
          }
        }
        return device + InFlightBytes(checkpoint, most_moved);
      };
      int64_t k = layers, host = 0;
      while (k > 0 && bytes(k, &host) > budget) --k;
      if (k == 0 || (offloaded > 0 && in.host_budget_bytes >= 0 && host > in.host_budget_bytes)) continue;
      SweepLayout s;
      s.name = absl::StrCat("last ", k, " ", LayerPolicyName(p.policy), offloaded > 0 ? ", first " : "",
                            offloaded > 0 ? absl::StrCat(offloaded, " offloaded") : "");
      s.choice.layout.model = ModelShape::Of(layout.config);
      s.choice.layout.device = in.device_name;
      s.choice.layout.tokens_per_step = in.tokens_per_step;
      for (int64_t l = 0; l < layers; ++l) {
        LayerPolicy lp = l >= layers - k ? p.policy : LayerPolicy{};
        lp.offload = l < offloaded ? 1.0 : 0.0;
        s.choice.layout.layers.push_back(lp);
      }
      s.choice.predicted_peak_bytes = working_set + bytes(k, &host);
      s.choice.summary = s.name;
      RunnableLayout(s.choice.layout, layout.num_units(), &s.choice.policies, &s.choice.offloaded);
      out.push_back(std::move(s));
    }
  }
  return out;
}

namespace {

// Every layer whole-layer recompute, nothing offloaded: where AutoPolicy goes back to.
AutoPolicyChoice AllRecompute(const ModelLayout& layout) {
  AutoPolicyChoice out;
  out.layout.model = ModelShape::Of(layout.config);
  out.layout.layers.assign(static_cast<size_t>(layout.config.num_hidden_layers), LayerPolicy{});
  RunnableLayout(out.layout, layout.num_units(), &out.policies, &out.offloaded);
  return out;
}

}  // namespace

std::optional<AutoPolicyChoice> AutoPolicySession::RecomputeWithRecord(const Measured& measured) const {
  if (!measured.choice.layout.autopolicy) return std::nullopt;
  AutoPolicyRecord rec = *measured.choice.layout.autopolicy;
  std::vector<int64_t> counts(rec.problem.candidates.size(), 0);
  const auto it = std::find_if(rec.problem.candidates.begin(), rec.problem.candidates.end(),
                               [](const LayerCandidate& c) { return c.policy == LayerPolicy{}; });
  if (it == rec.problem.candidates.end()) return std::nullopt;
  counts[static_cast<size_t>(it - rec.problem.candidates.begin())] = rec.problem.layers;
  rec.predicted = PredictPolicy(rec.problem, counts);
  AutoPolicyChoice out = AllRecompute(*options_.layout);
  out.layout.device = measured.choice.layout.device;
  out.layout.tokens_per_step = measured.choice.layout.tokens_per_step;
  out.predicted_peak_bytes = rec.working_set_bytes + rec.predicted.device_bytes;
  out.summary = MixName(rec.problem.candidates, counts);
  out.layout.autopolicy = std::move(rec);
  return out;
}

AutoPolicyChoice AutoPolicySession::WithoutOffload() {
  inputs_.host_budget_bytes = 0;
  first_look_.reset();
  if (phase_ == Phase::kSweep) {  // the sweep ends here; the validated layout runs on
    LOG(WARNING) << "AutoPolicy sweep: no host memory to pin for " << sweep_[sweep_at_].name << "; the sweep ends";
    phase_ = Phase::kDone;
    return choice_;
  }
  if (phase_ == Phase::kValidate) {
    absl::StatusOr<AutoPolicyChoice> choice = ChooseLayout(inputs_);
    if (choice.ok()) {
      Adopt(std::move(*choice));
      LOG(WARNING) << "AutoPolicy: no host memory to pin for offloaded checkpoints; " << choice_.summary;
      return choice_;
    }
  }
  LOG(WARNING) << "AutoPolicy: no host memory to pin for offloaded checkpoints; every layer goes back to recompute";
  phase_ = Phase::kDone;
  return AllRecompute(*options_.layout);
}

absl::StatusOr<std::optional<AutoPolicyChoice>> AutoPolicySession::AfterStep(
    int64_t step, const StepObservation& seen, const std::vector<MicroBatch>& micro_batches, int64_t steps_left) {
  switch (phase_) {
    case Phase::kMeasure: return AfterMeasureStep(step, seen, micro_batches, steps_left);
    case Phase::kSweep: return AfterSweepStep(step, seen, steps_left > 0);
    case Phase::kValidate: return AfterValidationStep(step, seen, steps_left);
    case Phase::kDone: break;
  }
  return std::nullopt;
}

namespace {

// What the recompute step `seen` and the probes (in->probes, in->rates, already set) tell of the
// job, into the rest of `in`.
void DescribeJob(const AutoPolicySession::Options& options, const StepObservation& seen,
                 const std::vector<MicroBatch>& micro_batches, AutoPolicyInputs* in) {
  const ModelLayout& layout = *options.layout;
  int64_t tokens = 0;
  for (const MicroBatch& mb : micro_batches) tokens += mb.num_tokens();
  in->layout = &layout;
  in->checkpoint_bytes =
      tokens * layout.config.hidden_size * DtypeBytes(CheckpointDType(*options.backend, options.checkpoint_dtype));
  in->micro_batches = static_cast<int>(micro_batches.size());
  // Rows hold their documents' tokens only, so a later step can hold more than this one: every
  // row full (the job's tokens per step, this rank's share).
  const int64_t largest = options.tokens_per_step / std::max(1, options.world);
  in->largest_step_scale = tokens > 0 && largest > tokens ? static_cast<double>(largest) / tokens : 1.0;
  in->recompute_step = seen;
  in->capacity_bytes = options.capacity_bytes;
  in->host_budget_bytes = options.host_budget_bytes;
  in->device_name = options.device_name;
  in->build = options.build;
  in->tokens_per_step = options.tokens_per_step > 0 ? options.tokens_per_step : tokens * options.world;
}

void LogBaseCosts(int64_t step, const StepObservation& seen, const AutoPolicyInputs& in) {
  std::string probes;
  for (const LayerProbe& p : in.probes) {
    absl::StrAppend(&probes, probes.empty() ? "" : ", ",
                    absl::StrFormat("%s %.4f s (forward %.4f) keeping %.3f GiB", LayerPolicyName(p.policy), p.time_s,
                                    p.forward_s, p.saved_bytes / 1073741824.0));
  }
  LOG(INFO) << "AutoPolicy: step " << step + 1 << " (all recompute) took " << seen.total_s << " s (compute "
            << seen.compute_s << ", gate waits " << seen.gate_s << ", H2D " << seen.h2d_s << ", D2H " << seen.d2h_s
            << " s), peak " << seen.peak_bytes / 1073741824.0 << " GiB; one layer: " << probes << "; checkpoint "
            << in.checkpoint_bytes / 1073741824.0 << " GiB (the layers' bytes x" << in.largest_step_scale
            << " for a step of full rows); pinned copies " << in.rates.h2d_bytes_per_s / 1e9 << " / "
            << in.rates.d2h_bytes_per_s / 1e9 << " GB/s";
}

}  // namespace

absl::StatusOr<std::optional<AutoPolicyChoice>> AutoPolicySession::AfterMeasureStep(
    int64_t step, const StepObservation& seen, const std::vector<MicroBatch>& micro_batches, int64_t steps_left) {
  if (steps_left <= 0) {
    phase_ = Phase::kDone;
    return std::nullopt;
  }
  // The job's first step warms everything up (kernel plans, the memory pool), and LayerAdam's
  // first pass over the state (first touches) can still hold the second step's gates: the base
  // costs come from the third step of a job long enough to gain from the wait, else the second.
  if (warmups_left_ < 0) warmups_left_ = steps_left >= kAutoPolicyLongJobSteps ? 2 : (steps_left >= 3 ? 1 : 0);
  if (warmups_left_ > 0 && steps_left >= 3) {
    --warmups_left_;
    return std::nullopt;
  }
  const absl::Time t0 = absl::Now();
  ASSIGN_OR_RETURN(inputs_.probes, ProfileLayer(options_.backend, *options_.layout, micro_batches,
                                                    ProbedPolicies(options_.layout->config)));
  if (options_.measure_rates) {
    ASSIGN_OR_RETURN(inputs_.rates, options_.measure_rates());
  }
  DescribeJob(options_, seen, micro_batches, &inputs_);
  LogBaseCosts(step, seen, inputs_);
  absl::StatusOr<AutoPolicyChoice> choice = ChooseLayout(inputs_);
  selection_s_ += absl::ToDoubleSeconds(absl::Now() - t0);
  if (!choice.ok()) {
    if (choice.status().code() != absl::StatusCode::kResourceExhausted) return choice.status();
    LOG(WARNING) << "AutoPolicy: " << choice.status().message() << "; every layer stays whole-layer recompute";
    phase_ = Phase::kDone;
    return std::nullopt;
  }
  Adopt(std::move(*choice));
  LOG(INFO) << "AutoPolicy: chose in " << selection_s_ << " s: " << choice_.summary;
  measure_step_ = step;
  phase_ = Phase::kValidate;
  return choice_;
}

std::optional<AutoPolicyChoice> AutoPolicySession::AfterSweepStep(int64_t step, const StepObservation& seen,
                                                                  bool more_steps) {
  SweepLayout& done = sweep_[sweep_at_++];
  done.step_s = seen.total_s;
  done.peak_bytes = seen.peak_bytes;
  LOG(INFO) << absl::StrFormat("AutoPolicy sweep: %s: step %d %.3f s, peak %.2f GiB (predicted %.2f GiB)", done.name,
                               step + 1, done.step_s, done.peak_bytes / 1073741824.0,
                               done.choice.predicted_peak_bytes / 1073741824.0);
  if (sweep_at_ < sweep_.size() && more_steps) return sweep_[sweep_at_].choice;
  phase_ = Phase::kDone;
  const SweepLayout* best = nullptr;
  for (size_t i = 0; i < sweep_at_; ++i) {
    if (best == nullptr || sweep_[i].step_s < best->step_s) best = &sweep_[i];
  }
  LOG(INFO) << absl::StrFormat(
      "AutoPolicy sweep: %d fixed layouts; the fastest, %s, %.3f s; AutoPolicy's layout %.3f s (%+.1f%%); "
      "back to AutoPolicy's layout",
      static_cast<int>(sweep_at_), best->name, best->step_s, validated_step_s_,
      100 * (validated_step_s_ - best->step_s) / best->step_s);
  if (!more_steps) return std::nullopt;
  return choice_;
}

absl::StatusOr<std::optional<AutoPolicyChoice>> AutoPolicySession::AfterValidationStep(int64_t step,
                                                                                       const StepObservation& seen,
                                                                                       int64_t steps_left) {
  const bool more_steps = steps_left > 0;
  const double max_peak = kAutoPolicyMaxPeakFraction * static_cast<double>(options_.capacity_bytes);
  // A layout runs two steps when the job has them, and counts the slower: the first after a switch
  // may not show what the next does (the host updating beside the layout's own copies).
  const bool over = static_cast<double>(seen.peak_bytes) > max_peak;
  if (!over && !first_look_ && steps_left >= 3) {
    first_look_ = seen;
    first_look_step_ = step;
    return std::nullopt;
  }
  StepObservation timed = seen;
  int64_t timed_step = step;
  if (first_look_) {
    if (first_look_->total_s > timed.total_s) timed_step = first_look_step_;
    timed.total_s = std::max(timed.total_s, first_look_->total_s);
    timed.peak_bytes = std::max(timed.peak_bytes, first_look_->peak_bytes);
    first_look_.reset();
  }
  if (over) return ResolveOverBudget(step, seen, max_peak, more_steps);
  // Time. Each layout that fit is remembered with its measured step; a layout slower than its
  // prediction that offloads checkpoints is solved again with every checkpoint on the device (the
  // copies' overlap with compute is the model's least certain part); then the fastest measured
  // layout runs, or recompute when none beats the recompute step.
  measured_.push_back({choice_, timed.total_s, timed.peak_bytes, timed_step});
  ASSIGN_OR_RETURN(const bool resolved, ResolveOnDevice(timed, timed_step, more_steps));
  if (resolved) return choice_;
  return KeepFastest(step, more_steps);
}

absl::StatusOr<std::optional<AutoPolicyChoice>> AutoPolicySession::ResolveOverBudget(int64_t step,
                                                                                     const StepObservation& seen,
                                                                                     double max_peak, bool more_steps) {
  LOG(WARNING) << "AutoPolicy: step " << step + 1 << " peaked at " << seen.peak_bytes / 1073741824.0 << " GiB, over "
               << max_peak / 1073741824.0 << " GiB (predicted " << choice_.predicted_peak_bytes / 1073741824.0
               << " GiB)";
  if (resolves_ >= kMaxResolves || !more_steps) {
    phase_ = Phase::kDone;
    if (!more_steps) return std::nullopt;
    LOG(WARNING) << "AutoPolicy: " << resolves_ << " re-solves did not fit; every layer goes back to recompute";
    return AllRecompute(*options_.layout);
  }
  ++resolves_;
  const int64_t over = seen.peak_bytes - choice_.predicted_peak_bytes;
  const int64_t budget = std::max<int64_t>(
      0, choice_.layout.autopolicy->problem.device_budget_bytes -
             std::max<int64_t>(over, seen.peak_bytes - static_cast<int64_t>(max_peak)) - options_.capacity_bytes / 50);
  ASSIGN_OR_RETURN(AutoPolicyChoice choice, TimedChooseLayout(budget));
  Adopt(std::move(choice));
  LOG(INFO) << "AutoPolicy: re-solved (" << resolves_ << " of at most " << kMaxResolves << ") with "
            << budget / 1073741824.0 << " GiB for the layers: " << choice_.summary;
  return choice_;
}

absl::StatusOr<bool> AutoPolicySession::ResolveOnDevice(const StepObservation& timed, int64_t timed_step,
                                                        bool more_steps) {
  const AutoPolicyRecord& rec = *choice_.layout.autopolicy;
  const bool slower_than_predicted = timed.total_s > (1 + kAutoPolicyPredictionSlack) * rec.predicted.step_s;
  if (!more_steps || !slower_than_predicted || choice_.offloaded.empty() || resolves_ >= kMaxResolves) return false;
  ++resolves_;
  inputs_.host_budget_bytes = 0;
  absl::StatusOr<AutoPolicyChoice> choice = TimedChooseLayout();
  if (!choice.ok()) {
    if (choice.status().code() != absl::StatusCode::kResourceExhausted) return choice.status();
    return false;
  }
  const double error = rec.predicted.step_s > 0 ? (timed.total_s - rec.predicted.step_s) / rec.predicted.step_s : 0;
  LOG(WARNING) << absl::StrFormat(
      "AutoPolicy: step %d took %.3f s against %.3f s predicted (%+.1f%%) with %d layers offloading; "
      "solving again with every checkpoint on the device",
      timed_step + 1, timed.total_s, rec.predicted.step_s, 100 * error,
      static_cast<int>(
          std::count_if(choice_.offloaded.begin(), choice_.offloaded.end(), [](double r) { return r > 0; })));
  Adopt(std::move(*choice));
  LOG(INFO) << "AutoPolicy: re-solved (" << resolves_ << " of at most " << kMaxResolves << "): " << choice_.summary;
  return true;
}

std::optional<AutoPolicyChoice> AutoPolicySession::KeepFastest(int64_t step, bool more_steps) {
  phase_ = Phase::kDone;
  const Measured* best = nullptr;
  for (const Measured& m : measured_) {
    if (best == nullptr || m.step_s < best->step_s) best = &m;
  }
  const double recompute_bar = (1 + options_.time_tolerance) * inputs_.recompute_step.total_s;
  if (best->step_s > recompute_bar) {
    LOG(WARNING) << "AutoPolicy: the fastest layout took " << best->step_s << " s, slower than "
                 << inputs_.recompute_step.total_s << " s with every layer recomputed; going back to recompute";
    // Recompute is the measured answer: it is reported and cached like any layout, so the next
    // job of this shape does not probe again.
    std::optional<AutoPolicyChoice> recompute = RecomputeWithRecord(*best);
    if (recompute) {
      SetValidated(std::move(*recompute), measure_step_, inputs_.recompute_step.total_s,
                   inputs_.recompute_step.peak_bytes);
    }
    if (!more_steps) return std::nullopt;
    return recompute ? choice_ : AllRecompute(*options_.layout);
  }
  const bool switch_back = best->step != step;
  SetValidated(best->choice, best->step, best->step_s, best->peak_bytes);
  const AutoPolicyRecord& kept = *choice_.layout.autopolicy;
  LOG(INFO) << absl::StrFormat(
      "AutoPolicy: validated on step %d: %.3f s measured against %.3f s predicted (%+.1f%%), peak %.2f GiB "
      "against %.2f GiB predicted%s",
      best->step + 1, best->step_s, kept.predicted.step_s,
      100 * (best->step_s - kept.predicted.step_s) / kept.predicted.step_s, best->peak_bytes / 1073741824.0,
      choice_.predicted_peak_bytes / 1073741824.0, switch_back ? "; it runs again from the next step" : "");
  if (options_.sweep && more_steps) {
    sweep_ = SweepLayouts(inputs_);
    if (!sweep_.empty()) {
      LOG(INFO) << "AutoPolicy sweep: " << sweep_.size() << " fixed layouts, one step each";
      phase_ = Phase::kSweep;
      sweep_at_ = 0;
      return sweep_[0].choice;
    }
  }
  if (switch_back && more_steps) return choice_;
  return std::nullopt;
}

absl::StatusOr<AutoPolicyChoice> AutoPolicySession::TimedChooseLayout(int64_t device_budget_bytes) {
  const absl::Time t0 = absl::Now();
  absl::StatusOr<AutoPolicyChoice> choice = ChooseLayout(inputs_, device_budget_bytes);
  selection_s_ += absl::ToDoubleSeconds(absl::Now() - t0);
  return choice;
}

void AutoPolicySession::Adopt(AutoPolicyChoice choice) {
  choice_ = std::move(choice);
  choice_.layout.autopolicy->selection_s = selection_s_;
}

void AutoPolicySession::SetValidated(AutoPolicyChoice choice, int64_t step, double step_s, int64_t peak_bytes) {
  choice_ = std::move(choice);
  validated_ = true;
  validated_step_ = step;
  validated_step_s_ = step_s;
  validated_peak_bytes_ = peak_bytes;
}

}  // namespace slidedp
