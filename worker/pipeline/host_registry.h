// HostRegistry: host ranges registered with CUDA (cudaHostRegister: page-locked and mapped for
// DMA), kept across jobs. Registering pins every page and costs about a second per few GB, so a
// worker whose next job runs on the same pooled, still-mapped state segment keeps the mirrors'
// registrations instead of redoing them (worker/agent: the cached host state).
//
// Ensure() of a range registered exactly as before is free; a range that overlaps registered
// ones differently replaces them. The destructor unregisters everything. One thread at a time.
#pragma once

#include <cstdint>
#include <map>

#include "absl/status/status.h"

namespace slidedp {

class HostRegistry {
 public:
  HostRegistry() = default;
  HostRegistry(const HostRegistry&) = delete;
  HostRegistry& operator=(const HostRegistry&) = delete;
  ~HostRegistry();

  // Registers the pages holding [p, p + bytes) unless exactly that page range already is.
  // RESOURCE_EXHAUSTED (with the size) when CUDA refuses.
  absl::Status Ensure(void* p, uint64_t bytes);

 private:
  std::map<uint64_t, uint64_t> ranges_;  // page-aligned begin -> end
};

}  // namespace slidedp
