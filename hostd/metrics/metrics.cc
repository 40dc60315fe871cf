// Metrics registry, text-format rendering and the /metrics HTTP endpoint (see metrics.h).
#include "hostd/metrics/metrics.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "common/status/status_macros.h"
#include "glog/logging.h"

namespace slidedp::metrics {

namespace {

bool ValidName(const std::string& s, bool allow_colon) {
  if (s.empty()) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    const char c = s[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_' || (allow_colon && c == ':');
    const bool digit = c >= '0' && c <= '9';
    if (!(alpha || (i > 0 && digit))) return false;
  }
  return true;
}

// HELP text escapes only backslash and newline.
std::string EscapeHelp(const std::string& v) {
  std::string out;
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

}  // namespace

std::string EscapeLabelValue(const std::string& v) {
  std::string out;
  out.reserve(v.size());
  for (char c : v) {
    if (c == '\\') out += "\\\\";
    else if (c == '"') out += "\\\"";
    else if (c == '\n') out += "\\n";
    else out += c;
  }
  return out;
}

std::string FormatSampleValue(double v) {
  if (std::isnan(v)) return "NaN";
  if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
  if (v == std::floor(v) && std::fabs(v) < 1e15) return absl::StrCat(static_cast<int64_t>(v));
  char buf[32];
  snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

// ---- MetricFamily ----

void MetricFamily::Set(const std::vector<std::string>& label_values, double value) {
  CHECK_EQ(label_values.size(), label_names_.size()) << name_;
  absl::MutexLock l(&mu_);
  series_[label_values] = value;
}

void MetricFamily::Add(const std::vector<std::string>& label_values, double delta) {
  CHECK_EQ(label_values.size(), label_names_.size()) << name_;
  if (kind_ == MetricKind::kCounter && !(delta >= 0)) {
    LOG(WARNING) << "counter " << name_ << ": dropped delta " << delta << " (counters only go up)";
    return;
  }
  absl::MutexLock l(&mu_);
  series_[label_values] += delta;
}

double MetricFamily::Get(const std::vector<std::string>& label_values) const {
  absl::MutexLock l(&mu_);
  auto it = series_.find(label_values);
  return it == series_.end() ? 0.0 : it->second;
}

void MetricFamily::Clear() {
  absl::MutexLock l(&mu_);
  series_.clear();
}

void MetricFamily::RenderTo(std::string* out) const {
  absl::MutexLock l(&mu_);
  absl::StrAppend(out, "# HELP ", name_, " ", EscapeHelp(help_), "\n");
  absl::StrAppend(out, "# TYPE ", name_, " ", kind_ == MetricKind::kCounter ? "counter" : "gauge", "\n");
  for (const auto& [values, v] : series_) {
    absl::StrAppend(out, name_);
    if (!values.empty()) {
      out->push_back('{');
      for (size_t i = 0; i < values.size(); ++i) {
        absl::StrAppend(out, i ? "," : "", label_names_[i], "=\"", EscapeLabelValue(values[i]), "\"");
      }
      out->push_back('}');
    }
    absl::StrAppend(out, " ", FormatSampleValue(v), "\n");
  }
}

// ---- MetricsRegistry ----

absl::StatusOr<MetricFamily*> MetricsRegistry::Counter(const std::string& name, const std::string& help,
                                                       std::vector<std::string> label_names) {
  return Declare(name, help, MetricKind::kCounter, std::move(label_names));
}

absl::StatusOr<MetricFamily*> MetricsRegistry::Gauge(const std::string& name, const std::string& help,
                                                     std::vector<std::string> label_names) {
  return Declare(name, help, MetricKind::kGauge, std::move(label_names));
}

absl::StatusOr<MetricFamily*> MetricsRegistry::Declare(const std::string& name, const std::string& help, MetricKind kind,
                                                       std::vector<std::string> label_names) {
  if (!ValidName(name, /*allow_colon=*/true)) {
    return absl::InvalidArgumentError(absl::StrCat("metric name '", name, "' is not [a-zA-Z_:][a-zA-Z0-9_:]*"));
  }
  for (const std::string& l : label_names) {
    if (!ValidName(l, /*allow_colon=*/false) || absl::StartsWith(l, "__")) {
      return absl::InvalidArgumentError(absl::StrCat("metric ", name, ": label name '", l, "' is not valid"));
    }
  }
  absl::MutexLock l(&mu_);
  auto it = families_.find(name);
  if (it != families_.end()) {
    if (it->second->kind() != kind || it->second->label_names() != label_names) {
      return absl::AlreadyExistsError(absl::StrCat("metric ", name, " is already declared with another type or labels"));
    }
    return it->second.get();
  }
  auto family = std::unique_ptr<MetricFamily>(new MetricFamily(name, help, kind, std::move(label_names)));
  MetricFamily* raw = family.get();
  families_.emplace(name, std::move(family));
  return raw;
}

void MetricsRegistry::AddCollector(std::function<void()> collector) {
  absl::MutexLock l(&mu_);
  collectors_.push_back(std::move(collector));
}

std::string MetricsRegistry::Scrape() {
  absl::MutexLock scrape(&scrape_mu_);
  std::vector<std::function<void()>> collectors;
  {
    absl::MutexLock l(&mu_);
    collectors = collectors_;
  }
  for (auto& c : collectors) c();
  std::string out;
  absl::MutexLock l(&mu_);
  for (const auto& [name, family] : families_) family->RenderTo(&out);
  return out;
}

// ---- MetricsHttpServer ----

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(MetricsRegistry* registry,
                                                                           const MetricsHttpOptions& options) {
  if (options.port < 0 || options.port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat("metrics port ", options.port, " is outside 0..65535"));
  }
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(options.port));
  if (inet_pton(AF_INET, options.bind_address.c_str(), &addr.sin_addr) != 1) {
    return absl::InvalidArgumentError(absl::StrCat("metrics bind address '", options.bind_address, "' is not an IPv4 address"));
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return ErrnoStatus("metrics socket()", errno);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int e = errno;
    close(fd);
    return ErrnoStatus(absl::StrCat("metrics bind ", options.bind_address, ":", options.port), e);
  }
  if (listen(fd, 16) != 0) {
    const int e = errno;
    close(fd);
    return ErrnoStatus("metrics listen()", e);
  }
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  auto server = std::unique_ptr<MetricsHttpServer>(new MetricsHttpServer(registry, options, fd, ntohs(addr.sin_port)));
  if (pipe2(server->wake_pipe_, O_CLOEXEC) != 0) return ErrnoStatus("metrics pipe2()", errno);
  server->thread_ = std::thread([s = server.get()] {
    pthread_setname_np(pthread_self(), "metrics-http");
    s->ServeLoop();
  });
  LOG(INFO) << "metrics: http://" << options.bind_address << ":" << server->port() << "/metrics";
  return server;
}

MetricsHttpServer::MetricsHttpServer(MetricsRegistry* registry, MetricsHttpOptions options, int listen_fd, int port)
    : registry_(registry), options_(std::move(options)), listen_fd_(listen_fd), port_(port) {}

MetricsHttpServer::~MetricsHttpServer() { Stop(); }

void MetricsHttpServer::Stop() {
  if (thread_.joinable()) {
    (void)!write(wake_pipe_[1], "x", 1);
    thread_.join();
  }
  for (int* fd : {&listen_fd_, &wake_pipe_[0], &wake_pipe_[1]}) {
    if (*fd >= 0) close(*fd);
    *fd = -1;
  }
}

void MetricsHttpServer::ServeLoop() {
  while (true) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
    int n = poll(fds, 2, -1);
    if (n < 0) {
      if (errno == EINTR) continue;
      LOG(ERROR) << "metrics: poll failed: " << strerror(errno);
      return;
    }
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;  // ECONNABORTED, EMFILE...: try again at the next poll
    timeval tv{options_.io_timeout_ms / 1000, (options_.io_timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    HandleConnection(fd);
    // Half-close, then discard what the client still sends (bounded): closing with unread input
    // would reset the connection and could destroy the response before the client reads it.
    shutdown(fd, SHUT_WR);
    char sink[4096];
    for (size_t drained = 0; drained < (1u << 20);) {
      ssize_t r = recv(fd, sink, sizeof(sink), 0);
      if (r <= 0) break;
      drained += static_cast<size_t>(r);
    }
    close(fd);
  }
}

namespace {

void SendAll(int fd, absl::string_view data) {
  while (!data.empty()) {
    ssize_t w = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return;  // peer gone or timed out: nothing useful left to do
    data.remove_prefix(static_cast<size_t>(w));
  }
}

void SendResponse(int fd, int code, absl::string_view reason, absl::string_view content_type, absl::string_view body,
                  bool include_body) {
  std::string head = absl::StrCat("HTTP/1.1 ", code, " ", reason, "\r\nContent-Type: ", content_type,
                                  "\r\nContent-Length: ", body.size(), "\r\nConnection: close\r\n\r\n");
  SendAll(fd, head);
  if (include_body) SendAll(fd, body);
}

}  // namespace

void MetricsHttpServer::HandleConnection(int fd) {
  // Read until the end of the headers (a GET has no body), within the size bound.
  std::string request;
  char buf[1024];
  while (request.find("\r\n\r\n") == std::string::npos && request.find("\n\n") == std::string::npos) {
    if (request.size() > options_.max_request_bytes) {
      SendResponse(fd, 431, "Request Header Fields Too Large", "text/plain", "request too large\n", true);
      return;
    }
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return;  // closed early or stalled past io_timeout_ms
    request.append(buf, static_cast<size_t>(r));
  }
  if (request.size() > options_.max_request_bytes + sizeof(buf)) {
    SendResponse(fd, 431, "Request Header Fields Too Large", "text/plain", "request too large\n", true);
    return;
  }
  ++requests_served_;
  absl::string_view line(request);
  line = line.substr(0, line.find_first_of("\r\n"));
  std::vector<absl::string_view> parts = absl::StrSplit(line, ' ');
  if (parts.size() != 3 || !absl::StartsWith(parts[2], "HTTP/1.")) {
    SendResponse(fd, 400, "Bad Request", "text/plain", "bad request line\n", true);
    return;
  }
  const bool head = parts[0] == "HEAD";
  if (parts[0] != "GET" && !head) {
    SendResponse(fd, 405, "Method Not Allowed", "text/plain", "only GET and HEAD\n", true);
    return;
  }
  absl::string_view path = parts[1].substr(0, parts[1].find('?'));
  if (path != "/metrics") {
    SendResponse(fd, 404, "Not Found", "text/plain", "not found: try /metrics\n", !head);
    return;
  }
  std::string body = registry_->Scrape();
  SendResponse(fd, 200, "OK", "text/plain; version=0.0.4; charset=utf-8", body, !head);
}

}  // namespace slidedp::metrics
