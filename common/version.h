// The one version of this build, and a digest of each binary. `--version` of slidedp,
// slidedp-hostd and slidedp-worker prints VersionReport(); hostd reports kVersion as its node's
// version (GetNode), every worker BuildId() as its build (WorkerHello).
#pragma once

#include <string>

namespace slidedp {

inline constexpr const char* kVersion = "slidedp 0.2.0";

// The git commit the build was made from, 7 hex digits (`git rev-parse --short=7 HEAD`, read at
// every build by common/git_commit.cmake), or "unknown" when the source is not a git checkout.
const char* GitCommit();

// "slidedp 0.2.0 (commit abc1234)": the same text for the three binaries of one build.
std::string VersionString();

// VersionString(), then "build digest <BinaryDigest()>" on a second line: what `--version` prints.
std::string VersionReport();

// A 64-bit FNV-1a digest of this process's executable (/proc/self/exe) as 16 hex digits, so two
// builds of one commit differ; empty if the executable cannot be read.
std::string BinaryDigest();

// kVersion and BinaryDigest(): what a measurement made by this binary (AutoPolicy's cached
// layouts) is keyed by. kVersion alone if the executable cannot be read.
std::string BuildId();

}  // namespace slidedp
