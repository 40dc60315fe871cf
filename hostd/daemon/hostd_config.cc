// Flag and config-file parsing for slidedp-hostd (CLI11 reads flags, yaml-cpp the file).
#include "hostd/daemon/hostd_config.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "common/log/program_logging.h"
#include "common/version.h"
#include "yaml-cpp/yaml.h"

namespace slidedp::hostd {

namespace {

// Config keys whose value may be a YAML list (each item is one more occurrence of the flag).
constexpr const char* kListKeys[] = {"extra-output-root"};

// One definition of the flags, bound to a config struct (used twice: with and without a file).
void BindFlags(CLI::App& app, HostdConfig& c) {
  app.add_option("--config", c.config_file, "YAML config file");
  app.add_option("--listen", c.listen,
                 "unix:PATH or HOST:PORT (TCP needs --tls-cert/--tls-key and client authentication)");
  app.add_option("--node-name", c.node_name, "name used in shm segment names");
  app.add_option("--state-dir", c.state_dir, "job records and metrics; default output root <state-dir>/outputs");
  app.add_option("--policy-cache", c.policy_cache,
                 "where runtime.policy auto keeps the layouts it chose (default <state-dir>/policies)");
  app.add_option("--tls-cert", c.tls_cert, "PEM certificate for TCP");
  app.add_option("--tls-key", c.tls_key, "PEM key for TCP");
  app.add_option("--tls-client-ca", c.tls_client_ca,
                 "TCP: PEM CA; clients with a certificate it signed may call (mutual TLS)");
  app.add_option("--auth-token-file", c.auth_token_file,
                 "TCP: file (mode 0600) holding the bearer token clients must send");
  app.add_flag("--dangerously-allow-unauthenticated-tcp", c.dangerously_allow_unauthenticated_tcp,
               "TCP without client authentication: anyone who reaches the port may submit jobs that read and "
               "write files as hostd's user");
  app.add_option("--peer-tls-ca", c.peer_tls_ca, "jobs over nodes: PEM CA of the other nodes' hostd certificates");
  app.add_option("--peer-tls-cert", c.peer_tls_cert, "jobs over nodes: this node's client certificate for the others");
  app.add_option("--peer-tls-key", c.peer_tls_key, "jobs over nodes: the key of --peer-tls-cert");
  app.add_option("--peer-token-file", c.peer_token_file,
                 "jobs over nodes: file (mode 0600) with the bearer token the other nodes' hostds accept");
  app.add_option("--node-address", c.node_address,
                 "jobs over nodes: this host's address the other nodes reach its workers at (default 127.0.0.1)");
  app.add_option("--socket-group", c.socket_group, "Unix socket: group that may connect (default: hostd's group)");
  app.add_option("--socket-mode", c.socket_mode, "Unix socket: mode, 0660 (owner and group) or 0600 (owner only)");
  app.add_option("--output-root", c.output_root,
                 "jobs write below this directory; a relative output.dir resolves in it (default <state-dir>/outputs)");
  app.add_option("--update-threads", c.update_threads, "LayerAdam threads (0: from topology)")->check(CLI::NonNegativeNumber);
  app.add_option("--worker-wait-s", c.worker_wait_s, "seconds a queued job waits for workers")->check(CLI::PositiveNumber);
  app.add_option("--drain-mode", c.drain_mode, "on SIGTERM: checkpoint | finish | cancel")
      ->check(CLI::IsMember({"checkpoint", "finish", "cancel"}));
  app.add_option("--metrics-port", c.metrics_port, "Prometheus metrics on 127.0.0.1:PORT (0: off)")->check(CLI::Range(0, 65535));
  app.add_option("--reclaim-stale", c.reclaim_stale, "unlink stale shm segments at start");
  app.add_option("--pool-host-state", c.pool_host_state,
                 "keep a finished job's pre-faulted state segment for the next job of the same model");
  app.add_option("--resume-interrupted", c.resume_interrupted,
                 "at start, resume the jobs a dead hostd left running or queued: from their state in shared memory "
                 "when it is consistent, else from their newest checkpoint (false: report them interrupted)");
  app.add_flag("--allow-output-anywhere", c.allow_output_anywhere,
               "jobs may write to any directory hostd can (relative output.dir still resolves in the output root)");
  // With a config file the file's values come first and the command line's last: take the last.
  for (auto* opt : app.get_options()) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
  // A list: every occurrence counts (the file's, then the command line's).
  app.add_option("--extra-output-root", c.extra_output_root,
                 "absolute output.dir values may also lie below this directory (repeatable)")
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
}

absl::Status ParseInto(int argc, const char* const* argv, HostdConfig& c, std::string* help) {
  CLI::App app{"slidedp-hostd: the node daemon that owns training state"};
  BindFlags(app, c);
  app.set_version_flag("--version", [] { return VersionReport(); });
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    *help = app.help();
    return absl::CancelledError(*help);
  } catch (const CLI::CallForVersion& e) {
    *help = std::string(e.what()) + "\n";
    return absl::CancelledError(*help);
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
  return absl::OkStatus();
}

// socket_mode: octal, within 0660 (a world-accessible socket would let every local user submit
// jobs as hostd's user), and the owner may connect (hostd's own tools and workers).
absl::Status CheckSocketMode(const std::string& text, unsigned* bits) {
  unsigned v = 0;
  bool digits = !text.empty() && text.size() <= 4;
  for (char ch : text) {
    if (ch < '0' || ch > '7') digits = false;
    v = v * 8 + static_cast<unsigned>(ch - '0');
  }
  if (!digits || (v & ~0660u) != 0 || (v & 0600u) != 0600u) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--socket-mode '", text.substr(0, 16),
        "': use 0660 (owner and group may connect) or 0600 (owner only); others never may (use --socket-group)"));
  }
  *bits = v;
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<HostdConfig> HostdConfig::Parse(int argc, const char* const* argv) {
  HostdConfig c;
  std::string help;
  if (absl::Status s = ParseInto(argc, argv, c, &help); !s.ok()) return s;
  if (!c.config_file.empty()) {
    YAML::Node root;
    try {
      root = YAML::LoadFile(c.config_file);
    } catch (const YAML::Exception& e) {
      return absl::InvalidArgumentError(absl::StrCat(c.config_file, ": ", e.what()));
    }
    if (!root.IsMap() && !root.IsNull()) return absl::InvalidArgumentError(absl::StrCat(c.config_file, ": expected a map"));
    CLI::App probe;
    HostdConfig scratch;
    BindFlags(probe, scratch);
    std::vector<std::string> args = {argv[0]};
    for (const auto& kv : root) {
      if (!kv.first.IsScalar()) return absl::InvalidArgumentError(absl::StrCat(c.config_file, ": keys must be plain strings"));
      std::string key = absl::StrReplaceAll(kv.first.as<std::string>(), {{"_", "-"}});
      if (key == "config") continue;
      if (!probe.get_option_no_throw("--" + key)) {
        return absl::InvalidArgumentError(absl::StrCat(c.config_file, ": unknown key '", kv.first.as<std::string>(), "'"));
      }
      const bool list = std::find(std::begin(kListKeys), std::end(kListKeys), key) != std::end(kListKeys);
      if (list && kv.second.IsSequence()) {
        for (const auto& item : kv.second) {
          if (!item.IsScalar()) {
            return absl::InvalidArgumentError(
                absl::StrCat(c.config_file, ": '", kv.first.as<std::string>(), "' must be a list of strings"));
          }
          args.push_back(absl::StrCat("--", key, "=", item.Scalar()));
        }
        continue;
      }
      if (!kv.second.IsScalar()) {
        return absl::InvalidArgumentError(absl::StrCat(c.config_file, ": '", kv.first.as<std::string>(), "' must be a scalar"));
      }
      // "--key=value": a value may start with '-', and the boolean flags take one this way too.
      args.push_back(absl::StrCat("--", key, "=", kv.second.Scalar()));
    }
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    std::vector<const char*> cargs;
    for (auto& a : args) cargs.push_back(a.c_str());
    const std::string file = c.config_file;
    c = HostdConfig();
    if (absl::Status s = ParseInto(static_cast<int>(cargs.size()), cargs.data(), c, &help); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": ", s.message()));
    }
  }
  const bool tcp = !absl::StartsWith(c.listen, "unix:");
  if (tcp && (c.tls_cert.empty() || c.tls_key.empty())) {
    return absl::InvalidArgumentError("a TCP --listen address needs --tls-cert and --tls-key");
  }
  if (tcp && c.tls_client_ca.empty() && c.auth_token_file.empty() && !c.dangerously_allow_unauthenticated_tcp) {
    return absl::InvalidArgumentError(
        "a TCP --listen address needs client authentication: --tls-client-ca FILE (clients present a certificate "
        "that CA signed) and/or --auth-token-file FILE (clients send that bearer token). Without it anyone who "
        "reaches the port could submit jobs that read and write files as hostd's user; "
        "--dangerously-allow-unauthenticated-tcp accepts that");
  }
  unsigned mode = 0;
  if (absl::Status s = CheckSocketMode(c.socket_mode, &mode); !s.ok()) return s;
  if (c.output_root.empty() && !c.state_dir.empty()) c.output_root = c.state_dir + "/outputs";
  return c;
}

std::string HostdConfig::NodeAddress(const std::string& hostname) const {
  if (!node_address.empty()) return node_address;
  if (absl::StartsWith(listen, "unix:")) return "127.0.0.1";
  const size_t colon = listen.rfind(':');
  std::string host = colon == std::string::npos ? listen : listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
  if (host.empty() || host == "0.0.0.0" || host == "::" || host == "*") return hostname.empty() ? "127.0.0.1" : hostname;
  return host;
}

unsigned HostdConfig::socket_mode_bits() const {
  unsigned v = 0;
  return CheckSocketMode(socket_mode, &v).ok() ? v : 0600;
}

std::string HostdConfig::ToString() const {
  std::ostringstream o;
  o << "listen=" << listen << " node=" << node_name << " state_dir=" << state_dir
    << " update_threads=" << update_threads << " drain_mode=" << drain_mode << " metrics_port=" << metrics_port
    << " pool_host_state=" << pool_host_state << " resume_interrupted=" << resume_interrupted
    << " output_root=" << output_root;
  if (!extra_output_root.empty()) o << " extra_output_root=" << absl::StrJoin(extra_output_root, ",");
  if (allow_output_anywhere) o << " allow_output_anywhere=true";
  if (absl::StartsWith(listen, "unix:")) {
    o << " socket_mode=" << socket_mode << (socket_group.empty() ? "" : " socket_group=" + socket_group);
  } else {
    std::string auth = tls_client_ca.empty() ? "" : "mtls";
    if (!auth_token_file.empty()) absl::StrAppend(&auth, auth.empty() ? "" : "+", "token");
    o << " client_auth=" << (auth.empty() ? "NONE" : auth);
  }
  return o.str();
}

}  // namespace slidedp::hostd
