// `slidedp`'s global flags (global_flags.h).
#include "client/cli/global_flags.h"

#include <cstdlib>

#include "common/log/program_logging.h"
#include "common/version.h"

namespace slidedp::client {

void AddGlobalFlags(CLI::App& app, GlobalFlags& flags) {
  app.set_version_flag("--version", [] { return VersionReport(); });
  auto* verbose_flag =
      app.add_flag("-v,--verbose", flags.verbose, "log everything (info), not only warnings and errors");
  app.add_flag("-q,--quiet", flags.quiet, "log errors only")->excludes(verbose_flag);
  ClientOptions& copt = flags.client;
  if (const char* a = std::getenv("SLIDEDP_HOSTD")) copt.address = a;
  app.add_option("--hostd", copt.address, "hostd address: unix:PATH or HOST:PORT (env SLIDEDP_HOSTD)");
  app.add_option("--timeout", copt.timeout_s, "seconds per request (at most 1e6)");
  // TCP addresses only (always TLS): what hostd's TCP listener asks of clients.
  copt.credentials = auth::ClientCredentialsOptions::FromEnvironment();
  app.add_option("--tls-ca", copt.credentials.tls_ca_file, "TCP: PEM CA of hostd's certificate (env SLIDEDP_TLS_CA)");
  app.add_option("--tls-cert", copt.credentials.tls_cert_file,
                 "TCP: PEM client certificate for mutual TLS (env SLIDEDP_TLS_CERT)");
  app.add_option("--tls-key", copt.credentials.tls_key_file, "TCP: PEM key of --tls-cert (env SLIDEDP_TLS_KEY)");
  app.add_option("--token-file", copt.credentials.token_file,
                 "TCP: file (mode 0600) with the bearer token hostd expects (env SLIDEDP_TOKEN_FILE)");
  app.add_option("--tls-server-name", copt.credentials.tls_server_name,
                 "TCP: name in hostd's certificate, when not the address's host (env SLIDEDP_TLS_SERVER_NAME)");
}

absl::Status ApplyGlobalFlags(const GlobalFlags& flags) {
  if (absl::Status t = CheckTimeout(flags.client.timeout_s); !t.ok()) return t;
  if (flags.verbose || flags.quiet) {
    SetLogVerbosity(ProgramKind::kCommandLine, flags.verbose ? LogVerbosity::kVerbose : LogVerbosity::kQuiet);
  }
  return absl::OkStatus();
}

}  // namespace slidedp::client
