// The run-time choice among the scalar, AVX2 and AVX-512 kernel tables. Compiled without ISA
// flags: it must run on any x86-64 CPU.
#include "common/moments/adam_isa.h"

#include <cstdlib>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace slidedp::moments {

std::string AdamIsaName(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kScalar: return "scalar";
    case AdamIsa::kAvx2: return "avx2";
    case AdamIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

absl::StatusOr<AdamIsa> ParseAdamIsa(absl::string_view name) {
  if (name == "scalar") return AdamIsa::kScalar;
  if (name == "avx2") return AdamIsa::kAvx2;
  if (name == "avx512") return AdamIsa::kAvx512;
  return absl::InvalidArgumentError(absl::StrCat("unknown AdamW ISA '", name, "' (expected scalar, avx2 or avx512)"));
}

bool AdamIsaSupported(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kScalar: return true;
    case AdamIsa::kAvx2: return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case AdamIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  }
  return false;
}

namespace {

AdamIsa BestSupportedIsa() {
  if (AdamIsaSupported(AdamIsa::kAvx512)) return AdamIsa::kAvx512;
  if (AdamIsaSupported(AdamIsa::kAvx2)) return AdamIsa::kAvx2;
  return AdamIsa::kScalar;
}

AdamIsa ChooseIsa() {
  const AdamIsa best = BestSupportedIsa();
  const char* forced = std::getenv("SLIDEDP_ADAM_ISA");
  if (forced == nullptr || *forced == '\0') return best;
  absl::StatusOr<AdamIsa> isa = ParseAdamIsa(forced);
  if (!isa.ok()) {
    LOG(WARNING) << "SLIDEDP_ADAM_ISA: " << isa.status().message() << "; using " << AdamIsaName(best);
    return best;
  }
  if (!AdamIsaSupported(*isa)) {
    LOG(WARNING) << "SLIDEDP_ADAM_ISA=" << forced << " is not supported by this CPU; using " << AdamIsaName(best);
    return best;
  }
  return *isa;
}

}  // namespace

AdamIsa ActiveAdamIsa() {
  static const AdamIsa isa = ChooseIsa();
  return isa;
}

}  // namespace slidedp::moments
