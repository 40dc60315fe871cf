// Client authentication on hostd's TCP listener (docs/operations.md, "Who may use hostd"). Every
// call except the gRPC health check must come over a connection whose client certificate TLS
// verified against --tls-client-ca, or carry `authorization: Bearer <token>` matching the token
// of --auth-token-file; any other call ends PERMISSION_DENIED before a handler runs. That covers
// JobService, NodeService, WorkerService and reflection alike, and any service added later.
// Health stays open so load balancers and `slidedp health` need no credentials; it tells only
// SERVING or NOT_SERVING.
//
// The Unix socket has no such check: its file mode and group decide who may connect.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "grpcpp/security/auth_metadata_processor.h"

namespace slidedp::hostd {

struct ClientAuthPolicy {
  enum class Certificates { kNotAccepted, kAccepted };
  Certificates certificates = Certificates::kNotAccepted;  // kAccepted: --tls-client-ca is set
  std::string token;                                       // empty: no token is accepted
};

// Whether a call to `method` (its HTTP/2 :path, "/pkg.Service/Method") may proceed.
// `peer_certificate_verified`: TLS verified a client certificate against the client CA.
// `authorization`: the call's authorization header, if any. PERMISSION_DENIED says what the
// listener accepts; it never quotes a token, presented or expected.
absl::Status AuthorizeCall(const ClientAuthPolicy& policy, absl::string_view method, bool peer_certificate_verified,
                           std::optional<absl::string_view> authorization);

// The gRPC side: attached to the TCP listener's credentials, runs AuthorizeCall on every call
// and takes the authorization header out of what handlers see.
class ClientAuthProcessor final : public grpc::AuthMetadataProcessor {
 public:
  explicit ClientAuthProcessor(ClientAuthPolicy policy) : policy_(std::move(policy)) {}
  bool IsBlocking() const override { return false; }  // a few comparisons: on gRPC's own thread
  grpc::Status Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                       OutputMetadata* consumed_auth_metadata, OutputMetadata* response_metadata) override;

 private:
  const ClientAuthPolicy policy_;
};

}  // namespace slidedp::hostd
