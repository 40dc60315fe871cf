// Prometheus text-format metrics for hostd (exposition format 0.0.4): a thread-safe registry of
// counter and gauge families with labels, and a minimal HTTP server that answers
// GET /metrics on 127.0.0.1:PORT (opt-in: hostd's --metrics-port).
//
// Values are pushed (Counter::Add / Gauge::Set from the code that knows them) or pulled: a
// collector callback runs at each scrape and sets gauges from a snapshot (e.g. HostCore's job
// table), so nothing has to be kept in sync between scrapes.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"

namespace slidedp::metrics {

enum class MetricKind { kCounter, kGauge };

class MetricsRegistry;

// One metric family: a name, a help line, fixed label names, and one value per label-value tuple.
// Obtained from MetricsRegistry; lives as long as the registry.
class MetricFamily {
 public:
  const std::string& name() const { return name_; }
  MetricKind kind() const { return kind_; }
  const std::vector<std::string>& label_names() const { return label_names_; }

  // label_values must have one entry per label name (a mismatch is a bug: CHECK).
  // Gauge: sets the value. Counter: Set is allowed only to mirror an external monotonic counter.
  void Set(const std::vector<std::string>& label_values, double value);
  // Adds delta (a counter's delta must be >= 0; negative deltas are dropped with a warning).
  void Add(const std::vector<std::string>& label_values, double delta);
  double Get(const std::vector<std::string>& label_values) const;  // 0 when never set
  // Forgets every series (for gauges rebuilt by a collector, so vanished jobs disappear).
  void Clear();

 private:
  friend class MetricsRegistry;
  MetricFamily(std::string name, std::string help, MetricKind kind, std::vector<std::string> label_names)
      : name_(std::move(name)), help_(std::move(help)), kind_(kind), label_names_(std::move(label_names)) {}
  void RenderTo(std::string* out) const;

  const std::string name_, help_;
  const MetricKind kind_;
  const std::vector<std::string> label_names_;
  mutable absl::Mutex mu_;
  std::map<std::vector<std::string>, double> series_ ABSL_GUARDED_BY(mu_);
};

class MetricsRegistry {
 public:
  // Declares (or returns the already declared) family. INVALID_ARGUMENT for a name or label name
  // outside Prometheus' grammar; ALREADY_EXISTS when the name exists with another kind or labels.
  absl::StatusOr<MetricFamily*> Counter(const std::string& name, const std::string& help,
                                        std::vector<std::string> label_names = {});
  absl::StatusOr<MetricFamily*> Gauge(const std::string& name, const std::string& help,
                                      std::vector<std::string> label_names = {});

  // Runs at every Scrape(), before rendering, without the registry lock held (it may call
  // Set/Add/Clear on families). Keep it cheap: it runs on the HTTP server's thread.
  void AddCollector(std::function<void()> collector);

  // Runs the collectors, then renders every family in name order.
  std::string Scrape();

 private:
  absl::StatusOr<MetricFamily*> Declare(const std::string& name, const std::string& help, MetricKind kind,
                                        std::vector<std::string> label_names);
  absl::Mutex mu_;
  std::map<std::string, std::unique_ptr<MetricFamily>> families_ ABSL_GUARDED_BY(mu_);
  std::vector<std::function<void()>> collectors_ ABSL_GUARDED_BY(mu_);
  absl::Mutex scrape_mu_;  // one scrape at a time (collectors need not be reentrant)
};

// Escapes a label value for the text format (backslash, double quote, newline).
std::string EscapeLabelValue(const std::string& v);
// Formats a sample value as Prometheus expects (integers without exponent, NaN, +Inf, -Inf).
std::string FormatSampleValue(double v);

struct MetricsHttpOptions {
  std::string bind_address = "127.0.0.1";  // loopback only: the endpoint has no authentication
  int port = 0;                            // 0: an ephemeral port (tests); see port()
  size_t max_request_bytes = 8192;         // request line + headers; larger gets 431
  int io_timeout_ms = 2000;                // a client that stalls longer is dropped
};

// Serves GET /metrics (and HEAD) from one named thread, one connection at a time, closing each
// connection after the response (HTTP/1.0 semantics; Prometheus scrapers cope). Other paths get
// 404, other methods 405, malformed requests 400.
class MetricsHttpServer {
 public:
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(MetricsRegistry* registry,
                                                                   const MetricsHttpOptions& options);
  ~MetricsHttpServer();  // Stop()
  void Stop();
  int port() const { return port_; }
  int64_t requests_served() const { return requests_served_.load(); }

 private:
  MetricsHttpServer(MetricsRegistry* registry, MetricsHttpOptions options, int listen_fd, int port);
  void ServeLoop();
  void HandleConnection(int fd);

  MetricsRegistry* registry_;
  MetricsHttpOptions options_;
  int listen_fd_;
  int port_;
  int wake_pipe_[2] = {-1, -1};
  std::atomic<int64_t> requests_served_{0};
  std::thread thread_;
};

}  // namespace slidedp::metrics
