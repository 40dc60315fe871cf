// Per-call client authentication of the TCP listener; see client_auth.h.
#include "hostd/service/client_auth.h"

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/auth/bearer_token.h"
#include "common/status/grpc_status.h"
#include "glog/logging.h"
#include "grpc/grpc_security_constants.h"

namespace slidedp::hostd {
namespace {

constexpr absl::string_view kHealthService = "/grpc.health.v1.Health/";
constexpr absl::string_view kBearer = "Bearer ";

// What this listener accepts, for the refusal message.
std::string Accepted(const ClientAuthPolicy& policy) {
  const bool certs = policy.certificates == ClientAuthPolicy::Certificates::kAccepted;
  const bool token = !policy.token.empty();
  const std::string cert_text = "a client certificate signed by hostd's --tls-client-ca (slidedp --tls-cert/--tls-key)";
  const std::string token_text =
      "the bearer token of hostd's --auth-token-file (slidedp --token-file or SLIDEDP_TOKEN_FILE)";
  if (certs && token) return absl::StrCat(cert_text, " or ", token_text);
  return certs ? cert_text : token_text;
}

}  // namespace

absl::Status AuthorizeCall(const ClientAuthPolicy& policy, absl::string_view method, bool peer_certificate_verified,
                           std::optional<absl::string_view> authorization) {
  if (absl::StartsWith(method, kHealthService)) return absl::OkStatus();
  if (policy.certificates == ClientAuthPolicy::Certificates::kAccepted && peer_certificate_verified) {
    return absl::OkStatus();
  }
  const std::string needs = absl::StrCat("hostd requires client authentication on TCP: present ", Accepted(policy));
  if (!authorization.has_value()) return absl::PermissionDeniedError(absl::StrCat(needs, "; this call presented none"));
  if (policy.token.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(needs, "; this listener accepts no bearer token"));
  }
  if (!absl::StartsWith(*authorization, kBearer)) {
    return absl::PermissionDeniedError(absl::StrCat(needs, "; the authorization metadata is not 'Bearer <token>'"));
  }
  if (!auth::TokenEquals(policy.token, authorization->substr(kBearer.size()))) {
    return absl::PermissionDeniedError(absl::StrCat(needs, "; the bearer token presented is not that token"));
  }
  return absl::OkStatus();
}

grpc::Status ClientAuthProcessor::Process(const InputMetadata& auth_metadata, grpc::AuthContext* context,
                                          OutputMetadata* consumed_auth_metadata, OutputMetadata*) {
  absl::string_view method;
  std::optional<absl::string_view> authorization;
  for (const auto& [key, value] : auth_metadata) {
    const absl::string_view k(key.data(), key.size());
    if (k == ":path") method = absl::string_view(value.data(), value.size());
    if (k == "authorization") {
      authorization = absl::string_view(value.data(), value.size());
      consumed_auth_metadata->insert({"authorization", std::string(*authorization)});
    }
  }
  // TLS put the certificate into the connection's properties only after verifying it against the
  // client CA (GRPC_SSL_REQUEST_CLIENT_CERTIFICATE_AND_VERIFY): one that fails never gets here.
  const bool verified = context != nullptr && !context->FindPropertyValues(GRPC_X509_PEM_CERT_PROPERTY_NAME).empty();
  absl::Status s = AuthorizeCall(policy_, method, verified, authorization);
  if (!s.ok()) {
    LOG_EVERY_N(WARNING, 100) << "refused a TCP call to " << method.substr(0, 128) << ": " << s.message()
                              << " (every 100th refusal is logged)";
  }
  return ToGrpc(s);
}

}  // namespace slidedp::hostd
