// Flag and config-file parsing for slidedp-hostd (CLI11 reads flags, yaml-cpp the file).
#include "hostd/daemon/hostd_config.h"

#include <fstream>
#include <sstream>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "yaml-cpp/yaml.h"

namespace slidedp::hostd {

namespace {

// One definition of the flags, bound to a config struct (used twice: with and without a file).
void BindFlags(CLI::App& app, HostdConfig& c) {
  app.add_option("--config", c.config_file, "YAML config file");
  app.add_option("--listen", c.listen, "unix:PATH or HOST:PORT (TCP needs --tls-cert/--tls-key)");
  app.add_option("--node-name", c.node_name, "name used in shm segment names");
  app.add_option("--state-dir", c.state_dir, "job records and metrics");
  app.add_option("--tls-cert", c.tls_cert, "PEM certificate for TCP");
  app.add_option("--tls-key", c.tls_key, "PEM key for TCP");
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
  // With a config file the file's values come first and the command line's last: take the last.
  for (auto* opt : app.get_options()) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
}

absl::Status ParseInto(int argc, const char* const* argv, HostdConfig& c, std::string* help) {
  CLI::App app{"slidedp-hostd: the node daemon that owns training state"};
  BindFlags(app, c);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    *help = app.help();
    return absl::CancelledError(*help);
  } catch (const CLI::ParseError& e) {
    return absl::InvalidArgumentError(e.what());
  }
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
      if (!kv.second.IsScalar()) {
        return absl::InvalidArgumentError(absl::StrCat(c.config_file, ": '", kv.first.as<std::string>(), "' must be a scalar"));
      }
      args.push_back("--" + key);
      args.push_back(kv.second.Scalar());
    }
    for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
    std::vector<const char*> cargs;
    for (auto& a : args) cargs.push_back(a.c_str());
    c = HostdConfig();
    if (absl::Status s = ParseInto(static_cast<int>(cargs.size()), cargs.data(), c, &help); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(c.config_file, ": ", s.message()));
    }
  }
  if (c.listen.rfind("unix:", 0) != 0 && (c.tls_cert.empty() || c.tls_key.empty())) {
    return absl::InvalidArgumentError("a TCP --listen address needs --tls-cert and --tls-key");
  }
  return c;
}

std::string HostdConfig::ToString() const {
  std::ostringstream o;
  o << "listen=" << listen << " node=" << node_name << " state_dir=" << state_dir << " update_threads=" << update_threads
    << " drain_mode=" << drain_mode << " metrics_port=" << metrics_port << " pool_host_state=" << pool_host_state
    << " resume_interrupted=" << resume_interrupted;
  return o.str();
}

}  // namespace slidedp::hostd
