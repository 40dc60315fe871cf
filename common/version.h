// The one version string of this build: what hostd reports as its node's version (GetNode) and
// every worker as its build (WorkerHello, with BuildId's digest of its binary).
#pragma once

#include <string>

namespace slidedp {

inline constexpr const char* kVersion = "slidedp 0.1.0";

// kVersion and a 64-bit FNV-1a digest of this process's executable (/proc/self/exe), so two
// builds of one version differ: what a measurement made by this binary (AutoPolicy's cached
// layouts) is keyed by. kVersion alone if the executable cannot be read.
std::string BuildId();

}  // namespace slidedp
