// Keeps a read-only file mapping from killing the process when the file shrinks under it.
//
// hostd maps the safetensors files a client names (the model to load, a checkpoint to resume) and
// checks their sizes against their headers before reading. A client that truncates such a file
// afterwards, while a load copies from the mapping, would make the next read of a page past the
// new end raise SIGBUS, and the default action ends hostd with every job it serves. A guarded
// mapping instead has that page replaced by a page of zeros (the read goes on, reading zeros) and
// remembers the fault; whoever reads through the mapping asks Intact() once done and throws away
// what it read when the answer is DATA_LOSS.
//
// The SIGBUS handler is installed once, at the first Register; a fault outside every guarded
// mapping goes to the handler that was there before it (or the default action: the process ends,
// as it would have). Up to kMaxGuardedMappings mappings are guarded at a time.
#pragma once

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace slidedp {

inline constexpr int kMaxGuardedMappings = 4096;

class MappingGuard {
 public:
  // Guards [base, base + bytes) (a read-only mapping of the file `path`, which labels errors).
  // RESOURCE_EXHAUSTED when kMaxGuardedMappings are guarded already; INTERNAL when the handler
  // cannot be installed.
  static absl::StatusOr<MappingGuard> Register(const void* base, size_t bytes, std::string path);

  MappingGuard() = default;
  MappingGuard(MappingGuard&& other) noexcept;
  MappingGuard& operator=(MappingGuard&& other) noexcept;
  MappingGuard(const MappingGuard&) = delete;
  MappingGuard& operator=(const MappingGuard&) = delete;
  ~MappingGuard();  // stops guarding (call before the range is unmapped)

  // OK while no read of the mapping has faulted; DATA_LOSS (naming the file) once one has: the
  // file shrank after it was mapped, and some bytes read since then were zeros, not the file's.
  absl::Status Intact() const;

 private:
  void Release();
  int slot_ = -1;
  std::string path_;
};

}  // namespace slidedp
