// The one version string of this build: what hostd reports as its node's version (GetNode) and
// every worker as its build (WorkerHello).
#pragma once

namespace slidedp {

inline constexpr const char* kVersion = "slidedp 0.1.0";

}  // namespace slidedp
