// The instruction set the host's Adam kernels run on: the moment codecs here (moments.h) and
// LayerAdam's step kernels (hostd/update/adamw_kernels.h, adamw_state.h) keep one table per ISA
// and take the one this CPU runs best, or the one SLIDEDP_ADAM_ISA names, so that a checkpoint's
// conversions and the training steps always run the same code.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace slidedp::moments {

// Instruction set a kernel table was built for.
enum class AdamIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

std::string AdamIsaName(AdamIsa isa);
absl::StatusOr<AdamIsa> ParseAdamIsa(absl::string_view name);  // "scalar" | "avx2" | "avx512"

// True when this CPU (and build) can run the ISA.
bool AdamIsaSupported(AdamIsa isa);

// The ISA every "active" table uses: the best supported one, or SLIDEDP_ADAM_ISA when set (an
// unsupported or unknown value falls back to the best supported one with a warning). Decided once
// per process.
AdamIsa ActiveAdamIsa();

}  // namespace slidedp::moments
