// How a client of hostd (the slidedp CLI, slidedp-worker) opens its gRPC channel. A Unix socket
// is used as is: its file mode and group are the local access policy. Any other address is TCP,
// always over TLS, with the client credentials hostd's TCP listener asks for: a certificate for
// mutual TLS and/or a bearer token sent as `authorization: Bearer <token>` on every call.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "grpcpp/grpcpp.h"

namespace slidedp::auth {

struct ClientCredentialsOptions {
  std::string tls_ca_file;                  // PEM CA that signed hostd's certificate (empty: the system's roots)
  std::string tls_cert_file, tls_key_file;  // PEM certificate and key of this client (mutual TLS)
  std::string token_file;                   // bearer token, as for hostd's --auth-token-file
  std::string tls_server_name;              // the name hostd's certificate must carry (empty: the address's host)

  // Defaults from the environment: SLIDEDP_TLS_CA, SLIDEDP_TLS_CERT, SLIDEDP_TLS_KEY,
  // SLIDEDP_TOKEN_FILE, SLIDEDP_TLS_SERVER_NAME (unset or empty: the field stays empty).
  static ClientCredentialsOptions FromEnvironment();
};

// "unix:PATH" (or "unix-abstract:NAME"): a local socket; anything else is a TCP address.
bool IsUnixAddress(absl::string_view address);

// A channel to hostd at `address`. For TCP the files are read now: NOT_FOUND / PERMISSION_DENIED /
// INVALID_ARGUMENT name the file (a token file readable by others is refused, as hostd refuses
// its own); a certificate without its key, or a key without its certificate, is INVALID_ARGUMENT.
// For a Unix socket the credentials are not used.
absl::StatusOr<std::shared_ptr<grpc::Channel>> CreateHostdChannel(const std::string& address,
                                                                  const ClientCredentialsOptions& credentials,
                                                                  grpc::ChannelArguments args = {});

}  // namespace slidedp::auth
