// Tests for the metrics registry (text format, labels, thread safety) and the HTTP endpoint,
// scraped over a real TCP socket.
#include "hostd/metrics/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmath>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace slidedp::metrics {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using ::testing::StartsWith;

TEST(MetricsRegistry, RendersHelpTypeAndLabelledSamplesInNameOrder) {
  MetricsRegistry reg;
  auto jobs = reg.Gauge("slidedp_jobs", "Jobs by state.", {"state"});
  ASSERT_TRUE(jobs.ok()) << jobs.status();
  auto steps = reg.Counter("slidedp_steps_total", "Optimizer steps completed.", {"job"});
  ASSERT_TRUE(steps.ok());
  (*jobs)->Set({"running"}, 1);
  (*jobs)->Set({"queued"}, 3);
  (*steps)->Add({"a"}, 2);
  (*steps)->Add({"a"}, 5);
  (*steps)->Add({"b\"x\\y\nz"}, 1.5);
  const std::string text = reg.Scrape();
  EXPECT_EQ(text,
            "# HELP slidedp_jobs Jobs by state.\n"
            "# TYPE slidedp_jobs gauge\n"
            "slidedp_jobs{state=\"queued\"} 3\n"
            "slidedp_jobs{state=\"running\"} 1\n"
            "# HELP slidedp_steps_total Optimizer steps completed.\n"
            "# TYPE slidedp_steps_total counter\n"
            "slidedp_steps_total{job=\"a\"} 7\n"
            "slidedp_steps_total{job=\"b\\\"x\\\\y\\nz\"} 1.5\n");
}

TEST(MetricsRegistry, CountersOnlyGoUpAndGaugesCanBeCleared) {
  MetricsRegistry reg;
  MetricFamily* c = *reg.Counter("c_total", "c");
  c->Add({}, 4);
  c->Add({}, -1);
  c->Add({}, std::nan(""));
  EXPECT_EQ(c->Get({}), 4);
  MetricFamily* g = *reg.Gauge("g", "g", {"k"});
  g->Set({"x"}, -2.25);
  EXPECT_THAT(reg.Scrape(), HasSubstr("g{k=\"x\"} -2.25\n"));
  g->Clear();
  EXPECT_THAT(reg.Scrape(), Not(HasSubstr("g{k=")));
}

TEST(MetricsRegistry, RejectsBadNamesAndConflictingRedeclaration) {
  MetricsRegistry reg;
  EXPECT_EQ(reg.Gauge("1abc", "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Gauge("a-b", "x").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Gauge("ok", "x", {"bad-label"}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.Gauge("ok", "x", {"__reserved"}).status().code(), absl::StatusCode::kInvalidArgument);
  auto a = reg.Gauge("ns:ok", "x", {"l"});
  ASSERT_TRUE(a.ok());
  auto again = reg.Gauge("ns:ok", "x", {"l"});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*a, *again);
  EXPECT_EQ(reg.Counter("ns:ok", "x", {"l"}).status().code(), absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(reg.Gauge("ns:ok", "x", {"m"}).status().code(), absl::StatusCode::kAlreadyExists);
}

TEST(MetricsRegistry, FormatsSpecialValues) {
  EXPECT_EQ(FormatSampleValue(0), "0");
  EXPECT_EQ(FormatSampleValue(12345678901234.0), "12345678901234");
  EXPECT_EQ(FormatSampleValue(0.1), "0.10000000000000001");
  EXPECT_EQ(FormatSampleValue(1e300), "1.0000000000000001e+300");
  EXPECT_EQ(FormatSampleValue(INFINITY), "+Inf");
  EXPECT_EQ(FormatSampleValue(-INFINITY), "-Inf");
  EXPECT_EQ(FormatSampleValue(std::nan("")), "NaN");
}

TEST(MetricsRegistry, ConcurrentAddsAreNotLostAndCollectorsRunPerScrape) {
  MetricsRegistry reg;
  MetricFamily* c = *reg.Counter("adds_total", "adds", {"t"});
  MetricFamily* scrapes = *reg.Gauge("scrapes", "scrapes");
  int collector_runs = 0;
  reg.AddCollector([&] { scrapes->Set({}, ++collector_runs); });
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 20000; ++i) c->Add({std::to_string(t % 2)}, 1);
    });
  }
  std::thread scraper([&] {
    for (int i = 0; i < 50; ++i) (void)reg.Scrape();
  });
  for (auto& t : threads) t.join();
  scraper.join();
  EXPECT_EQ(c->Get({"0"}), 40000);
  EXPECT_EQ(c->Get({"1"}), 40000);
  EXPECT_THAT(reg.Scrape(), HasSubstr("scrapes 51\n"));
}

// ---- HTTP over a real socket ----

int Connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0) << strerror(errno);
  return fd;
}

std::string Exchange(int port, const std::string& request) {
  int fd = Connect(port);
  size_t off = 0;
  while (off < request.size()) {
    ssize_t w = send(fd, request.data() + off, request.size() - off, MSG_NOSIGNAL);
    if (w <= 0) break;  // the server may answer 431 and close before reading everything
    off += w;
  }
  std::string out;
  char buf[4096];
  ssize_t r;
  while ((r = recv(fd, buf, sizeof(buf), 0)) > 0) out.append(buf, r);
  close(fd);
  return out;
}

class MetricsHttp : public ::testing::Test {
 protected:
  void SetUp() override {
    MetricFamily* g = *reg_.Gauge("slidedp_workers", "Attached workers.");
    g->Set({}, 2);
    MetricsHttpOptions o;
    o.port = 0;
    o.io_timeout_ms = 300;
    auto s = MetricsHttpServer::Start(&reg_, o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = std::move(*s);
    ASSERT_GT(server_->port(), 0);
  }
  MetricsRegistry reg_;
  std::unique_ptr<MetricsHttpServer> server_;
};

TEST_F(MetricsHttp, GetMetricsReturnsTextFormat) {
  std::string resp = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\nHost: x\r\nAccept: */*\r\n\r\n");
  EXPECT_THAT(resp, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_THAT(resp, HasSubstr("Content-Type: text/plain; version=0.0.4"));
  EXPECT_THAT(resp, HasSubstr("\r\n\r\n# HELP slidedp_workers Attached workers.\n# TYPE slidedp_workers gauge\nslidedp_workers 2\n"));
  const std::string body = resp.substr(resp.find("\r\n\r\n") + 4);
  EXPECT_THAT(resp, HasSubstr(absl::StrCat("Content-Length: ", body.size(), "\r\n")));
  // A query string is ignored; values set between scrapes show up.
  reg_.Gauge("slidedp_workers", "Attached workers.").value()->Set({}, 3);
  EXPECT_THAT(Exchange(server_->port(), "GET /metrics?x=1 HTTP/1.0\r\n\r\n"), HasSubstr("slidedp_workers 3\n"));
}

TEST_F(MetricsHttp, HeadHasNoBody) {
  std::string resp = Exchange(server_->port(), "HEAD /metrics HTTP/1.1\r\n\r\n");
  EXPECT_THAT(resp, StartsWith("HTTP/1.1 200 OK\r\n"));
  EXPECT_EQ(resp.substr(resp.find("\r\n\r\n") + 4), "");
}

TEST_F(MetricsHttp, OtherPathsMethodsAndGarbageAreRejectedAndTheServerKeepsServing) {
  EXPECT_THAT(Exchange(server_->port(), "GET / HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404 Not Found"));
  EXPECT_THAT(Exchange(server_->port(), "GET /metricsx HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 404 Not Found"));
  EXPECT_THAT(Exchange(server_->port(), "POST /metrics HTTP/1.1\r\n\r\n"), StartsWith("HTTP/1.1 405"));
  EXPECT_THAT(Exchange(server_->port(), "hello\r\n\r\n"), StartsWith("HTTP/1.1 400"));
  // Headers beyond the bound: 431, without buffering them all.
  std::string huge = "GET /metrics HTTP/1.1\r\nX-Pad: " + std::string(64 * 1024, 'a') + "\r\n\r\n";
  EXPECT_THAT(Exchange(server_->port(), huge), StartsWith("HTTP/1.1 431"));
  // A client that connects and says nothing is dropped after io_timeout_ms, not forever.
  int idle = Connect(server_->port());
  std::string resp = Exchange(server_->port(), "GET /metrics HTTP/1.1\r\n\r\n");
  EXPECT_THAT(resp, StartsWith("HTTP/1.1 200 OK"));
  close(idle);
  EXPECT_GE(server_->requests_served(), 5);
}

TEST_F(MetricsHttp, StopClosesThePort) {
  const int port = server_->port();
  server_->Stop();
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  inet_pton(AF_INET, "127.0.0.1", &a.sin_addr);
  EXPECT_NE(connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)), 0);
  close(fd);
}

TEST(MetricsHttpStart, BusyPortIsAnError) {
  MetricsRegistry reg;
  auto a = MetricsHttpServer::Start(&reg, {});
  ASSERT_TRUE(a.ok());
  MetricsHttpOptions o;
  o.port = (*a)->port();
  auto b = MetricsHttpServer::Start(&reg, o);
  EXPECT_FALSE(b.ok());
  EXPECT_THAT(std::string(b.status().message()), HasSubstr(absl::StrCat("127.0.0.1:", o.port)));
  o.bind_address = "localhost";
  EXPECT_EQ(MetricsHttpServer::Start(&reg, o).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace slidedp::metrics
