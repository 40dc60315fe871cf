// absl::Status <-> grpc::Status. The codes are the same numbers (STYLE.md: standard codes only),
// so the mapping is 1:1 both ways.
#pragma once

#include <string>

#include "absl/status/status.h"
#include "common/status/utf8_prefix.h"
#include "grpcpp/support/status.h"

namespace slidedp {

inline absl::Status FromGrpc(const grpc::Status& s) {
  if (s.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
}

// The message travels in the response's trailing metadata, which a client refuses above 8 KiB
// (it then sees RESOURCE_EXHAUSTED "received initial metadata size exceeds limit" instead of the
// error): messages that quote a client's long input are cut to kMaxGrpcMessageBytes.
inline constexpr size_t kMaxGrpcMessageBytes = 2048;

inline grpc::Status ToGrpc(const absl::Status& s) {
  if (s.ok()) return grpc::Status::OK;
  std::string message(s.message());
  if (message.size() > kMaxGrpcMessageBytes) {
    // Cut at a character boundary: a split UTF-8 sequence makes clients decode the whole
    // message as Latin-1.
    const size_t keep = Utf8Prefix(message, kMaxGrpcMessageBytes).size();
    const size_t cut = message.size() - keep;
    message = message.substr(0, keep) + "... (" + std::to_string(cut) + " more bytes)";
  }
  return grpc::Status(static_cast<grpc::StatusCode>(s.code()), message);
}

}  // namespace slidedp
