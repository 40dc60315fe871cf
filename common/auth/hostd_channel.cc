// Client channels to hostd: insecure on a Unix socket, TLS (+ client certificate, + bearer token)
// on TCP; see hostd_channel.h.
#include "common/auth/hostd_channel.h"

#include <cstdlib>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/auth/bearer_token.h"
#include "common/io/small_file.h"
#include "common/status/status_macros.h"

namespace slidedp::auth {
namespace {

std::string EnvOr(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr ? v : "";
}

// Adds `authorization: Bearer <token>` to every call on the channel. gRPC attaches plugin call
// credentials only to channels of privacy and integrity (their default minimum level: TLS here),
// so the token never travels in plain text.
class BearerTokenPlugin final : public grpc::MetadataCredentialsPlugin {
 public:
  explicit BearerTokenPlugin(std::string token) : header_(absl::StrCat("Bearer ", token)) {}
  bool IsBlocking() const override { return false; }
  const char* GetType() const override { return "slidedp-bearer-token"; }
  grpc::Status GetMetadata(grpc::string_ref, grpc::string_ref, const grpc::AuthContext&,
                           std::multimap<std::string, std::string>* metadata) override {
    metadata->insert({"authorization", header_});
    return grpc::Status::OK;
  }

 private:
  const std::string header_;
};

}  // namespace

ClientCredentialsOptions ClientCredentialsOptions::FromEnvironment() {
  ClientCredentialsOptions o;
  o.tls_ca_file = EnvOr("SLIDEDP_TLS_CA");
  o.tls_cert_file = EnvOr("SLIDEDP_TLS_CERT");
  o.tls_key_file = EnvOr("SLIDEDP_TLS_KEY");
  o.token_file = EnvOr("SLIDEDP_TOKEN_FILE");
  o.tls_server_name = EnvOr("SLIDEDP_TLS_SERVER_NAME");
  return o;
}

bool IsUnixAddress(absl::string_view address) {
  return absl::StartsWith(address, "unix:") || absl::StartsWith(address, "unix-abstract:");
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateHostdChannel(const std::string& address,
                                                                  const ClientCredentialsOptions& credentials,
                                                                  grpc::ChannelArguments args) {
  if (IsUnixAddress(address)) return grpc::CreateCustomChannel(address, grpc::InsecureChannelCredentials(), args);
  if (credentials.tls_cert_file.empty() != credentials.tls_key_file.empty()) {
    return absl::InvalidArgumentError(
        "a client certificate needs its key and a key its certificate: give both --tls-cert and --tls-key "
        "(SLIDEDP_TLS_CERT, SLIDEDP_TLS_KEY)");
  }
  grpc::SslCredentialsOptions ssl;
  if (!credentials.tls_ca_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_root_certs, ReadSmallFile(credentials.tls_ca_file, kMaxConfigFileBytes, "TLS CA"));
  }
  if (!credentials.tls_cert_file.empty()) {
    ASSIGN_OR_RETURN(ssl.pem_cert_chain,
                     ReadSmallFile(credentials.tls_cert_file, kMaxConfigFileBytes, "TLS client certificate"));
    ASSIGN_OR_RETURN(ssl.pem_private_key,
                     ReadSmallFile(credentials.tls_key_file, kMaxConfigFileBytes, "TLS client key"));
  }
  std::shared_ptr<grpc::ChannelCredentials> creds = grpc::SslCredentials(ssl);
  if (!credentials.token_file.empty()) {
    ASSIGN_OR_RETURN(std::string token, ReadTokenFile(credentials.token_file));
    creds = grpc::CompositeChannelCredentials(
        creds, grpc::MetadataCredentialsFromPlugin(std::make_unique<BearerTokenPlugin>(std::move(token))));
  }
  if (!credentials.tls_server_name.empty()) args.SetSslTargetNameOverride(credentials.tls_server_name);
  return grpc::CreateCustomChannel(address, creds, args);
}

}  // namespace slidedp::auth
