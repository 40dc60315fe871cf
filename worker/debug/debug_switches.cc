#include "worker/debug/debug_switches.h"

#include <cmath>
#include <cstdlib>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"

namespace slidedp {
namespace {

// The variable's value; empty when unset (an empty value counts as unset, as it always has).
absl::string_view ValueOf(absl::FunctionRef<const char*(const char*)> lookup, const char* name) {
  const char* v = lookup(name);
  return v == nullptr ? absl::string_view() : absl::string_view(v);
}

absl::Status Malformed(const char* name, absl::string_view value, absl::string_view expected) {
  return absl::InvalidArgumentError(absl::StrCat(name, ": '", value, "' is not ", expected));
}

// A 0/1 switch; unset keeps `*out`.
absl::Status ReadFlag(absl::FunctionRef<const char*(const char*)> lookup, const char* name, bool* out) {
  const absl::string_view v = ValueOf(lookup, name);
  if (v.empty()) return absl::OkStatus();
  if (v != "0" && v != "1") return Malformed(name, v, "0 or 1");
  *out = v == "1";
  return absl::OkStatus();
}

// SLIDEDP_INJECT_NONFINITE (tests only): comma-separated "grad:STEP:UNIT[@RANK]" (element 0 of the
// unit's gradient becomes NaN) and "loss:STEP[@RANK]" (the loss does), STEP 1-based, for every
// rank unless one is given.
absl::StatusOr<std::vector<DebugSwitches::NonFiniteInjection>> ParseNonFiniteInjection(absl::string_view text) {
  std::vector<DebugSwitches::NonFiniteInjection> out;
  for (absl::string_view item : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    const std::vector<absl::string_view> at = absl::StrSplit(item, '@');
    const std::vector<absl::string_view> f = absl::StrSplit(at[0], ':');
    int64_t step = 0, unit = -1, only_rank = -1;
    const bool ok = at.size() <= 2 && (at.size() < 2 || absl::SimpleAtoi(at[1], &only_rank)) &&
                    ((f.size() == 3 && f[0] == "grad" && absl::SimpleAtoi(f[2], &unit) && unit >= 0) ||
                     (f.size() == 2 && f[0] == "loss")) &&
                    absl::SimpleAtoi(f[1], &step) && step >= 1;
    if (!ok) return Malformed("SLIDEDP_INJECT_NONFINITE", item, "grad:STEP:UNIT[@RANK] or loss:STEP[@RANK]");
    out.push_back({step - 1, static_cast<int>(unit), static_cast<int>(only_rank)});
  }
  return out;
}

// The worker's own switches (worker/agent, worker/pipeline).
absl::Status ReadWorkerSwitches(absl::FunctionRef<const char*(const char*)> lookup, DebugSwitches& s) {
  if (absl::string_view v = ValueOf(lookup, "SLIDEDP_CPU_DEVICE_MEMORY_BYTES"); !v.empty()) {
    if (!absl::SimpleAtoi(v, &s.cpu_device_memory_bytes) || s.cpu_device_memory_bytes <= 0) {
      return Malformed("SLIDEDP_CPU_DEVICE_MEMORY_BYTES", v, "a positive number of bytes");
    }
  }
  if (absl::string_view v = ValueOf(lookup, "SLIDEDP_INJECT_DELAY_MS"); !v.empty()) {
    double ms = 0;
    if (!absl::SimpleAtod(v, &ms) || !std::isfinite(ms) || ms < 0) {
      return Malformed("SLIDEDP_INJECT_DELAY_MS", v, "a number of milliseconds >= 0");
    }
    s.inject_max_delay = absl::Milliseconds(ms);
  }
  if (absl::string_view v = ValueOf(lookup, "SLIDEDP_INJECT_NONFINITE"); !v.empty()) {
    auto parsed = ParseNonFiniteInjection(v);
    if (!parsed.ok()) return parsed.status();
    s.inject_nonfinite_text = std::string(v);
    s.inject_nonfinite = *std::move(parsed);
  }
  if (absl::Status st = ReadFlag(lookup, "SLIDEDP_AUTOPOLICY_SWEEP", &s.autopolicy_sweep); !st.ok()) return st;
  return ReadFlag(lookup, "SLIDEDP_LOG_UNIT_NORMS", &s.log_unit_norms);
}

// The CUDA backend's (worker/compute/cuda, worker/kernels).
absl::Status ReadCudaSwitches(absl::FunctionRef<const char*(const char*)> lookup, DebugSwitches& s) {
  if (absl::Status st = ReadFlag(lookup, "SLIDEDP_CUDA_FP32_RESIDUAL", &s.cuda_fp32_residual); !st.ok()) return st;
  if (absl::string_view v = ValueOf(lookup, "SLIDEDP_ATTENTION"); !v.empty()) {
    if (v == "auto") {
      s.attention = DebugSwitches::Attention::kAuto;
    } else if (v == "cudnn") {
      s.attention = DebugSwitches::Attention::kCudnn;
    } else if (v == "own") {
      s.attention = DebugSwitches::Attention::kOwn;
    } else {
      return Malformed("SLIDEDP_ATTENTION", v, "one of auto, cudnn, own");
    }
  }
  if (absl::Status st = ReadFlag(lookup, "SLIDEDP_DETERMINISTIC", &s.deterministic); !st.ok()) return st;
  if (absl::Status st = ReadFlag(lookup, "SLIDEDP_CUDNN_CROSS", &s.cudnn_cross_attention); !st.ok()) return st;
  if (absl::Status st = ReadFlag(lookup, "SLIDEDP_CUDNN_WINDOW", &s.cudnn_window); !st.ok()) return st;
  if (absl::Status st = ReadFlag(lookup, "SLIDEDP_GPU_MEMORY_LEDGER", &s.gpu_memory_ledger); !st.ok()) return st;
  s.cudnn_library = std::string(ValueOf(lookup, "SLIDEDP_CUDNN_LIB"));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<DebugSwitches> DebugSwitches::Read(absl::FunctionRef<const char*(const char*)> lookup) {
  DebugSwitches s;
  if (absl::Status st = ReadWorkerSwitches(lookup, s); !st.ok()) return st;
  if (absl::Status st = ReadCudaSwitches(lookup, s); !st.ok()) return st;
  return s;
}

absl::StatusOr<DebugSwitches> DebugSwitches::FromEnvironment() {
  return Read([](const char* name) -> const char* { return std::getenv(name); });
}

const absl::StatusOr<DebugSwitches>& ProcessDebugSwitches() {
  static const absl::StatusOr<DebugSwitches>* const switches =
      new absl::StatusOr<DebugSwitches>(DebugSwitches::FromEnvironment());
  return *switches;
}

}  // namespace slidedp
