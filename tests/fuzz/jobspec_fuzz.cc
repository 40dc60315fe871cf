// libFuzzer target: the job spec parser (common/jobspec, YAML via yaml-cpp) on arbitrary text.
// Any input must give a status, never a crash; an accepted spec must survive its own round trip
// (Parse(ToYaml()) accepted and printing the same YAML), since hostd echoes the resolved spec and
// workers re-parse it from their assignment.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "common/jobspec/job_spec.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  absl::string_view text(reinterpret_cast<const char*>(data), size);
  auto spec = slidedp::JobSpec::Parse(text, "/fuzz-base", slidedp::JobSpec::FileCheck::kSkip);
  if (!spec.ok()) return 0;
  const std::string yaml = spec->ToYaml();
  auto again = slidedp::JobSpec::Parse(yaml, "/fuzz-base", slidedp::JobSpec::FileCheck::kSkip);
  if (!again.ok()) {
    fprintf(stderr, "resolved spec does not re-parse: %s\n--- resolved:\n%s\n", again.status().ToString().c_str(), yaml.c_str());
    abort();
  }
  if (again->ToYaml() != yaml) {
    fprintf(stderr, "round trip changed the spec\n--- first:\n%s\n--- second:\n%s\n", yaml.c_str(), again->ToYaml().c_str());
    abort();
  }
  return 0;
}
