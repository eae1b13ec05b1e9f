// Metrics (docs/ops/metrics.md): the text format itself, then real ckptd processes serving
// GET /metrics, the textfile and GetMetrics, checked by byte count after a workload, by
// promtool, and by a real Prometheus server scraping the daemon.
#include <arpa/inet.h>
#include <ckpt/client.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>
#include <thread>

#include "common/unique_fd.h"
#include "daemon/metrics/registry.h"
#include "format/paths.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kTensors = 2;
constexpr std::size_t kTensorBytes = 1 << 20;
constexpr std::uint64_t kStateBytes = kTensors * kTensorBytes;

// The samples of a text exposition, by series ("name{a=\"x\",b=\"y\"}" as written). Throws
// on a line that is not a comment or a well-formed sample, or a sample of a metric whose
// # TYPE came not before it.
std::map<std::string, double> ParseExposition(const std::string& text) {
  static const std::regex sample(
      R"re(^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*"(,[a-zA-Z_][a-zA-Z0-9_]*="(\\.|[^"\\])*")*)?\})? ([^ ]+)$)re");
  std::map<std::string, double> out;
  std::set<std::string> typed;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream words(line.substr(7));
      std::string name, type;
      words >> name >> type;
      if (type != "counter" && type != "gauge" && type != "histogram")
        throw std::runtime_error("type: " + line);
      typed.insert(name);
      continue;
    }
    if (line.rfind("# HELP ", 0) == 0) continue;
    std::smatch m;
    if (!std::regex_match(line, m, sample)) throw std::runtime_error("not a sample line: '" + line + "'");
    std::string name = m[1];
    for (const char* suffix : {"_bucket", "_sum", "_count"}) {
      const std::string s = suffix;
      if (!typed.count(name) && name.size() > s.size() &&
          name.compare(name.size() - s.size(), s.size(), s) == 0) {
        name = name.substr(0, name.size() - s.size());
      }
    }
    if (!typed.count(name)) throw std::runtime_error("sample before its # TYPE: " + line);
    const std::string value = m[m.size() - 1];
    out[line.substr(0, line.size() - value.size() - 1)] = value == "+Inf"   ? INFINITY
                                                          : value == "-Inf" ? -INFINITY
                                                                            : std::stod(value);
  }
  return out;
}

double Value(const std::map<std::string, double>& samples, const std::string& series) {
  auto it = samples.find(series);
  if (it == samples.end()) throw std::runtime_error("no series " + series);
  return it->second;
}

struct HttpReply {
  int status = 0;
  std::string headers, body;
};

// A connection to 127.0.0.1:port that has sent `request` (which may be part of one).
UniqueFd ConnectAndSend(int port, const std::string& request) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<std::uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) {
    throw std::runtime_error("connect to 127.0.0.1:" + std::to_string(port) + ": " + std::strerror(errno));
  }
  if (::send(fd.get(), request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    throw std::runtime_error("send failed");
  }
  return fd;
}

// Reads what the server sends until it closes the connection.
std::string ReadToEnd(int fd) {
  std::string raw;
  char buf[65536];
  for (ssize_t n; (n = ::recv(fd, buf, sizeof buf, 0)) > 0;) raw.append(buf, static_cast<std::size_t>(n));
  return raw;
}

HttpReply ParseReply(const std::string& raw) {
  HttpReply r;
  const auto end = raw.find("\r\n\r\n");
  if (raw.rfind("HTTP/1.1 ", 0) != 0 || end == std::string::npos)
    throw std::runtime_error("bad reply: " + raw);
  r.status = std::stoi(raw.substr(9, 3));
  r.headers = raw.substr(0, end);
  r.body = raw.substr(end + 4);
  return r;
}

HttpReply HttpRequest(int port, const std::string& request) {
  UniqueFd fd = ConnectAndSend(port, request);
  return ParseReply(ReadToEnd(fd.get()));
}

// Whether the server keeps `fd` open without having sent anything on it.
bool OpenAndSilent(int fd) {
  char c;
  return ::recv(fd, &c, 1, MSG_DONTWAIT | MSG_PEEK) < 0 && errno == EAGAIN;
}

// The reply on `fd`, read to its end, which must come while every connection of `held`
// stays open and silent: the server answered `fd` without waiting for any of them.
HttpReply ReplyWhileHeldOpen(int fd, const std::vector<UniqueFd>& held) {
  std::vector<pollfd> fds{{fd, POLLIN, 0}};
  for (const auto& h : held) fds.push_back({h.get(), POLLIN, 0});
  std::string raw;
  for (;;) {
    // A bound against a hang only; the order of events is what is checked.
    const int n = ::poll(fds.data(), fds.size(), 60'000);
    if (n < 0 && errno == EINTR) continue;
    REQUIRE(n > 0);
    for (std::size_t i = 1; i < fds.size(); ++i) {
      INFO("held connection " << i - 1 << " of " << held.size());
      REQUIRE(fds[i].revents == 0);  // closed (or answered) before the reply came
    }
    if (!fds[0].revents) continue;
    char buf[65536];
    const ssize_t got = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (got > 0) {
      raw.append(buf, static_cast<std::size_t>(got));
    } else if (got == 0 || errno != EAGAIN) {
      return ParseReply(raw);
    }
  }
}

HttpReply HttpGet(int port, const std::string& path) {
  return HttpRequest(port, "GET " + path + " HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
}

// The port a daemon started with --metrics-listen 127.0.0.1:0 logged.
int MetricsPort(const DaemonProcess& d) {
  static const std::regex line(R"(metrics on http://127\.0\.0\.1:([0-9]+)/metrics)");
  std::smatch m;
  std::string log;
  REQUIRE(Eventually([&] {
    log = d.Log();
    return std::regex_search(log, m, line);
  }));
  return std::stoi(m[1]);
}

// A socket bound to a loopback port of the kernel's choice (port 0), listening if asked;
// *port says which.
UniqueFd BindLoopback(int* port, bool listen) {
  UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  if (listen) REQUIRE(::listen(fd.get(), 1) == 0);
  socklen_t len = sizeof addr;
  REQUIRE(::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  *port = ntohs(addr.sin_port);
  return fd;
}

// A port free a moment ago.
int FreePort() {
  int port = 0;
  BindLoopback(&port, /*listen=*/false);
  return port;
}

// A program on $PATH, or "" (the test then says why it does not run).
std::string OnPath(const std::string& name) {
  const char* path = std::getenv("PATH");
  std::istringstream dirs(path ? path : "/usr/bin:/bin");
  for (std::string dir; std::getline(dirs, dir, ':');) {
    const std::string p = dir + "/" + name;
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return "";
}

// Runs `promtool check metrics` on a file; its output, with the exit code in front.
ProcessResult Promtool(const std::string& promtool, const std::string& file) {
  return RunProcess({"/bin/sh", "-c", "'" + promtool + "' check metrics < '" + file + "'"});
}

struct Fixture {
  TempDir dir{"metrics"};
  DaemonOptions options;
  std::unique_ptr<DaemonProcess> daemon;
  int port = 0;

  explicit Fixture(std::vector<std::string> extra = {}) {
    options.root = dir.path() + "/root";
    options.socket = dir.path() + "/sock/ckptd.sock";
    fs::create_directories(options.root);
    options.extra_args = {"--local", dir.path() + "/local", "--memory-mib",
                          "64",      "--metrics-listen",    "127.0.0.1:0"};
    options.extra_args.insert(options.extra_args.end(), extra.begin(), extra.end());
    daemon = std::make_unique<DaemonProcess>(options);
    port = MetricsPort(*daemon);
  }
  std::map<std::string, double> Scrape() const {
    HttpReply r = HttpGet(port, "/metrics");
    REQUIRE(r.status == 200);
    return ParseExposition(r.body);
  }
};

// Versions 1 and 2 of job `job` saved and committed; wait_snapshot before the second
// snapshot, so the client reports a stall with it.
void SaveTwo(const std::string& socket, const std::string& job, TrainerState& state) {
  Client c = Client::connect(socket);
  c.register_items(job, 0, 1, state.Items());
  state.Fill(1);
  c.snapshot(1);
  c.wait_snapshot(1);
  c.wait_durable(1, Level::kCommitted);
  state.Fill(2);
  c.snapshot(2);
  c.wait_durable(2, Level::kCommitted);
}

}  // namespace

TEST_CASE("metrics: the text format: HELP, TYPE, escaped label values, cumulative histogram buckets") {
  metrics::Family<metrics::Counter> counter("ckptd_test_total", "A counter.\nSecond line with \\.");
  counter.With({{"job", "a\"b\\c\nd"}}).Add(3);
  counter.With({{"job", "plain"}}).Add();
  metrics::Histogram h({0.1, 1});
  h.Observe(0.05);
  h.Observe(0.1);  // le is "less or equal": still the first bucket
  h.Observe(0.5);
  h.Observe(7);
  metrics::Exposition out;
  counter.Render(out, [](const metrics::Labels& l) { return l[0].second != "hidden"; });
  counter.With({{"job", "hidden"}}).Add();
  out.Header("ckptd_test_seconds", "histogram", "A histogram.");
  h.Render(out, "ckptd_test_seconds", {{"tier", "local"}});
  const std::string text = out.text();
  CHECK(
      text.find(
          "# HELP ckptd_test_total A counter.\\nSecond line with \\\\.\n# TYPE ckptd_test_total counter\n") ==
      0);
  CHECK(text.find("ckptd_test_total{job=\"a\\\"b\\\\c\\nd\"} 3\n") != std::string::npos);
  CHECK(text.find("ckptd_test_total{job=\"plain\"} 1\n") != std::string::npos);
  CHECK(text.find("hidden") == std::string::npos);  // made after the render
  auto samples = ParseExposition(text);
  CHECK(Value(samples, "ckptd_test_seconds_bucket{tier=\"local\",le=\"0.1\"}") == 2);
  CHECK(Value(samples, "ckptd_test_seconds_bucket{tier=\"local\",le=\"1\"}") == 3);
  CHECK(Value(samples, "ckptd_test_seconds_bucket{tier=\"local\",le=\"+Inf\"}") == 4);
  CHECK(Value(samples, "ckptd_test_seconds_count{tier=\"local\"}") == 4);
  CHECK(Value(samples, "ckptd_test_seconds_sum{tier=\"local\"}") == Approx(7.65));
  // A filter hides a series.
  metrics::Exposition filtered;
  counter.Render(filtered, [](const metrics::Labels& l) { return l[0].second != "hidden"; });
  CHECK(filtered.text().find("hidden") == std::string::npos);
  CHECK(filtered.text().find("plain") != std::string::npos);
}

TEST_CASE("metrics: counters move by the bytes of a snapshot, commit, promotion and restore") {
  Fixture f;
  auto before = f.Scrape();
  CHECK(Value(before, "ckptd_bytes_copied_total{source=\"host\"}") == 0);
  CHECK(Value(before, "ckptd_sessions_open") == 0);
  CHECK(Value(before, "ckptd_build_info{version=\"0.1.0\"}") == 1);
  CHECK(Value(before, "ckptd_pool_capacity_bytes") == 64.0 * (1 << 20));
  CHECK(Value(before, "ckptd_memory_tier_budget_bytes") == 64.0 * (1 << 20));
  const double start = Value(before, "ckptd_start_time_seconds");
  const double now = static_cast<double>(std::time(nullptr));
  CHECK(start <= now + 1);
  CHECK(start > now - 120);

  TrainerState state(kTensors, kTensorBytes, 7);
  {
    Client c = Client::connect(f.options.socket);
    c.register_items("jobm", 0, 1, state.Items());
    auto open = f.Scrape();
    CHECK(Value(open, "ckptd_sessions_open") == 1);
    state.Fill(1);
    c.snapshot(1);
    c.wait_snapshot(1);
    c.wait_durable(1, Level::kCommitted);
    state.Fill(2);
    c.snapshot(2);  // reports the stall of wait_snapshot(1)
    c.wait_durable(2, Level::kCommitted);
  }
  auto after = f.Scrape();
  CHECK(Value(after, "ckptd_bytes_copied_total{source=\"host\"}") == 2 * kStateBytes);
  CHECK(Value(after, "ckptd_bytes_copied_total{source=\"device\"}") == 0);
  CHECK(Value(after, "ckptd_bytes_written_total{tier=\"local\"}") == 2 * kStateBytes);
  CHECK(Value(after, "ckptd_bytes_written_total{tier=\"memory\"}") == 2 * kStateBytes);
  CHECK(Value(after, "ckptd_bytes_written_total{tier=\"persistent\"}") == 0);  // promoted, not written
  const std::uint64_t file_bytes =
      fs::file_size(f.options.root + "/jobm/" + VersionDirName(2) + "/" + ShardFileName(0));
  CHECK(Value(after, "ckptd_bytes_promoted_total{tier=\"persistent\"}") == 2.0 * file_bytes);
  CHECK(Value(after, "ckptd_promotion_duration_seconds_count{tier=\"persistent\"}") == 2);
  CHECK(Value(after, "ckptd_versions_committed_total{job=\"jobm\"}") == 2);
  CHECK(Value(after, "ckptd_flush_duration_seconds_count{tier=\"local\"}") == 2);
  CHECK(Value(after, "ckptd_flush_duration_seconds_count{tier=\"persistent\"}") == 0);
  CHECK(Value(after, "ckptd_snapshot_stall_seconds_count") == 1);
  CHECK(Value(after, "ckptd_errors_total{kind=\"write\"}") == 0);
  CHECK(Value(after, "ckptd_sessions_open") == 0);
  CHECK(Value(after, "ckptd_promotions_pending") == 0);
  CHECK(Value(after, "ckptd_memory_tier_used_bytes") >= static_cast<double>(file_bytes));
  CHECK(after.count("ckptd_versions_failed_total{job=\"jobm\"}") == 0);

  // A restarted trainer restores version 2 from the memory tier.
  {
    TrainerState fresh(kTensors, kTensorBytes, 7);
    Client c = Client::connect(f.options.socket);
    c.register_items("jobm", 0, 1, fresh.Items());
    RestoreResult r = c.restore();
    REQUIRE(r.version == 2);
    REQUIRE(r.tier == "memory");
    CHECK(fresh.FirstMismatch(2) == -1);
  }
  auto restored = f.Scrape();
  CHECK(Value(restored, "ckptd_bytes_restored_total{tier=\"memory\"}") == kStateBytes);
  CHECK(Value(restored, "ckptd_bytes_restored_total{tier=\"persistent\"}") == 0);
  CHECK(Value(restored, "ckptd_restore_duration_seconds_count{tier=\"memory\"}") == 1);
  CHECK(Value(restored, "ckptd_errors_total{kind=\"restore\"}") == 0);

  // The same text over gRPC and through ckptctl (other figures, such as the pool, may
  // differ between two renders; the counters of finished work do not).
  v1::GetMetricsReply rep;
  {
    grpc::ClientContext ctx;
    REQUIRE(f.daemon->Stub()->GetMetrics(&ctx, v1::GetMetricsRequest(), &rep).ok());
  }
  auto via_grpc = ParseExposition(rep.text());
  CHECK(Value(via_grpc, "ckptd_bytes_restored_total{tier=\"memory\"}") == kStateBytes);
  CHECK(Value(via_grpc, "ckptd_versions_committed_total{job=\"jobm\"}") == 2);
  ProcessResult ctl = RunProcess({CKPTCTL_BINARY, "--socket", f.options.socket, "metrics"});
  REQUIRE(ctl.exit_code == 0);
  auto via_ctl = ParseExposition(ctl.output);
  CHECK(Value(via_ctl, "ckptd_bytes_copied_total{source=\"host\"}") == 2 * kStateBytes);
}

TEST_CASE("metrics: a failed version and a failed restore are counted, by job and by kind") {
  // The first shard data write fails: version 1's shard on the local tier.
  ::setenv("CKPTD_TEST_FAULT", "file=data,op=write,fault=ENOSPC,count=1", 1);
  Fixture f;
  ::unsetenv("CKPTD_TEST_FAULT");
  TrainerState state(kTensors, kTensorBytes, 3);
  Client c = Client::connect(f.options.socket);
  c.register_items("jobf", 0, 1, state.Items());
  // Nothing is committed yet: the restore fails.
  CHECK_THROWS_AS(c.restore(), Error);
  state.Fill(1);
  c.snapshot(1);
  CHECK_THROWS_AS(c.wait_durable(1, Level::kCommitted), Error);
  // The wait hears of the failure as soon as the shard fails; the writer that failed it
  // counts it right after.
  REQUIRE(Eventually([&] { return f.Scrape().count("ckptd_versions_failed_total{job=\"jobf\"}") > 0; }));
  auto s = f.Scrape();
  CHECK(Value(s, "ckptd_errors_total{kind=\"restore\"}") == 1);
  CHECK(Value(s, "ckptd_errors_total{kind=\"write\"}") == 1);
  CHECK(Value(s, "ckptd_errors_total{kind=\"copy\"}") == 0);
  CHECK(Value(s, "ckptd_versions_failed_total{job=\"jobf\"}") == 1);
  CHECK(s.count("ckptd_versions_committed_total{job=\"jobf\"}") == 0);
  CHECK(Value(s, "ckptd_restore_duration_seconds_count{tier=\"persistent\"}") == 0);
  // The next version commits; the failed one stays counted once.
  state.Fill(2);
  c.snapshot(2);
  c.wait_durable(2, Level::kCommitted);
  s = f.Scrape();
  CHECK(Value(s, "ckptd_versions_failed_total{job=\"jobf\"}") == 1);
  CHECK(Value(s, "ckptd_versions_committed_total{job=\"jobf\"}") == 1);
}

TEST_CASE("metrics: GET of another path is 404, another method 405, HEAD has headers only") {
  Fixture f;
  CHECK(HttpGet(f.port, "/").status == 404);
  CHECK(HttpGet(f.port, "/metricsx").status == 404);
  HttpReply post = HttpRequest(f.port, "POST /metrics HTTP/1.1\r\nContent-Length: 0\r\n\r\n");
  CHECK(post.status == 405);
  CHECK(post.headers.find("Allow: GET, HEAD") != std::string::npos);
  HttpReply head = HttpRequest(f.port, "HEAD /metrics HTTP/1.1\r\n\r\n");
  CHECK(head.status == 200);
  CHECK(head.body.empty());
  HttpReply get = HttpGet(f.port, "/metrics?name[]=x");
  CHECK(get.status == 200);
  CHECK(get.headers.find("Content-Type: text/plain; version=0.0.4") != std::string::npos);
  CHECK(get.headers.find("Content-Length: " + std::to_string(get.body.size())) != std::string::npos);
  // A client that sends half a request and goes away does not stop the next scrape.
  {
    UniqueFd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<std::uint16_t>(f.port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    REQUIRE(::connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
    REQUIRE(::send(fd.get(), "GET /met", 8, MSG_NOSIGNAL) == 8);
  }
  CHECK(HttpGet(f.port, "/metrics").status == 200);
}

TEST_CASE("metrics: ten half-sent requests do not hold up a scrape") {
  Fixture f;
  // Each has sent its request line and then stalls, as a broken or hostile client would.
  std::vector<UniqueFd> stalled;
  for (int i = 0; i < 10; ++i) stalled.push_back(ConnectAndSend(f.port, "GET /metrics HTTP/1.1\r\n"));
  UniqueFd scrape =
      ConnectAndSend(f.port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
  HttpReply r = ReplyWhileHeldOpen(scrape.get(), stalled);
  CHECK(r.status == 200);
  CHECK(Value(ParseExposition(r.body), "ckptd_sessions_open") == 0);
  for (const auto& fd : stalled) CHECK(OpenAndSilent(fd.get()));
  // Each is closed at the end of its time, with a reason.
  for (const auto& fd : stalled) CHECK(ParseReply(ReadToEnd(fd.get())).status == 408);
}

TEST_CASE("metrics: a request with bare LF line ends is answered") {
  Fixture f;
  UniqueFd scrape = ConnectAndSend(f.port, "GET /metrics HTTP/1.1\nHost: 127.0.0.1\n\n");
  // Answered as a whole request, not at the end of its time (by which this one, opened
  // later, would still be open).
  std::vector<UniqueFd> later;
  later.push_back(ConnectAndSend(f.port, "GET /met"));
  HttpReply r = ReplyWhileHeldOpen(scrape.get(), later);
  CHECK(r.status == 200);
  CHECK(Value(ParseExposition(r.body), "ckptd_sessions_open") == 0);
  HttpReply missing = HttpRequest(f.port, "GET /nothing HTTP/1.0\n\n");
  CHECK(missing.status == 404);
}

TEST_CASE(
    "metrics: past 64 open connections the oldest is closed with a 503 and a scrape is still answered") {
  Fixture f;
  constexpr int kCap = 64;  // docs/ops/metrics.md
  std::vector<UniqueFd> held;
  for (int i = 0; i < kCap; ++i) held.push_back(ConnectAndSend(f.port, "GET /metrics HTTP/1.1\r\n"));
  // The 65th connection: the server closes the oldest to take it.
  UniqueFd oldest = std::move(held.front());
  held.erase(held.begin());
  UniqueFd scrape = ConnectAndSend(f.port, "GET /metrics HTTP/1.1\r\n\r\n");
  HttpReply r = ReplyWhileHeldOpen(scrape.get(), held);
  CHECK(r.status == 200);
  // Closed with a reason, not by its deadline (that would be 408).
  HttpReply dropped = ParseReply(ReadToEnd(oldest.get()));
  CHECK(dropped.status == 503);
  CHECK(dropped.body.find("too many connections") != std::string::npos);
  for (const auto& fd : held) CHECK(OpenAndSilent(fd.get()));
}

TEST_CASE("metrics: out of descriptors the endpoint does not spin and serves again once it has some") {
  Fixture f;
  const pid_t pid = f.daemon->pid();
  rlimit old{};
  REQUIRE(::prlimit(pid, RLIMIT_NOFILE, nullptr, &old) == 0);
  // A soft limit of the lowest descriptor number the daemon has free: every accept fails
  // with EMFILE (the limit is on numbers, not on how many are open).
  std::set<int> open_fds;
  for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd"))
    open_fds.insert(std::stoi(e.path().filename().string()));
  rlimit tight = old;
  tight.rlim_cur = 0;
  while (open_fds.count(static_cast<int>(tight.rlim_cur))) ++tight.rlim_cur;
  REQUIRE(::prlimit(pid, RLIMIT_NOFILE, &tight, nullptr) == 0);
  // Complete requests, left pending in the listener's backlog.
  std::vector<UniqueFd> pending;
  for (int i = 0; i < 3; ++i)
    pending.push_back(ConnectAndSend(f.port, "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"));
  // A measuring window, not a wait for anything: from the connects on, a daemon that spun
  // on the failing accept would burn a core in it; one that backs off uses next to nothing.
  const std::uint64_t before = f.daemon->CpuTicks();
  const auto t0 = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const double window_ticks =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() * ::sysconf(_SC_CLK_TCK);
  const std::uint64_t used = f.daemon->CpuTicks() - before;
  INFO("daemon CPU ticks in the window: " << used << " of " << window_ticks);
  CHECK(static_cast<double>(used) < window_ticks / 4);
  CHECK(Eventually([&] { return f.daemon->Log().find("out of file descriptors") != std::string::npos; },
                   std::chrono::seconds(10)));
  for (const auto& fd : pending) CHECK(OpenAndSilent(fd.get()));
  // Descriptors again: the pending scrapes are answered.
  REQUIRE(::prlimit(pid, RLIMIT_NOFILE, &old, nullptr) == 0);
  for (const auto& fd : pending) CHECK(ParseReply(ReadToEnd(fd.get())).status == 200);
}

TEST_CASE(
    "metrics: an address not of this host or a textfile in a missing directory is a configuration "
    "error at start and at --check-config where a port in use only warns") {
  TempDir dir("metrics-config");
  fs::create_directories(dir.path() + "/root");
  auto ckptd = [&](std::vector<std::string> extra) {
    std::vector<std::string> argv = {
        CKPTD_BINARY, "--root", dir.path() + "/root", "--socket", dir.path() + "/s.sock",
        "--pool-mib", "16",     "--chunk-mib",        "4"};
    argv.insert(argv.end(), extra.begin(), extra.end());
    return RunProcess(argv);
  };
  const std::string nowhere = dir.path() + "/nodir/ckptd.prom";
  for (const bool check : {true, false}) {
    const std::string mode = check ? "--check-config" : "--log-level=info";
    // 192.0.2.1 is TEST-NET-1 (RFC 5737): no host has it.
    ProcessResult r = ckptd({mode, "--metrics-listen", "192.0.2.1:9464"});
    INFO(mode << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("bind 192.0.2.1:9464: Cannot assign requested address") != std::string::npos);
    CHECK(r.output.find("not an address of this host") != std::string::npos);
    r = ckptd({mode, "--metrics-textfile", nowhere});
    INFO(mode << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--metrics-textfile " + nowhere + ": directory " + dir.path() +
                        "/nodir does not exist") != std::string::npos);
    CHECK(!fs::exists(dir.path() + "/s.sock"));
  }
  // A file where the directory should be.
  std::ofstream(dir.path() + "/file") << "x";
  ProcessResult r = ckptd({"--check-config", "--metrics-textfile", dir.path() + "/file/ckptd.prom"});
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find(dir.path() + "/file is not a directory") != std::string::npos);
  // A port in use may be the running daemon's: --check-config says so and passes.
  int taken_port = 0;
  UniqueFd holder = BindLoopback(&taken_port, /*listen=*/true);
  const std::string taken = "127.0.0.1:" + std::to_string(taken_port);
  r = ckptd({"--check-config", "--metrics-listen", taken});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("configuration OK") != std::string::npos);
  CHECK(r.output.find("warning: --metrics-listen " + taken) != std::string::npos);
  CHECK(r.output.find("Address already in use") != std::string::npos);
  // A free port: nothing to say, and nothing is left listening.
  const int free_port = FreePort();
  r = ckptd({"--check-config", "--metrics-listen", "127.0.0.1:" + std::to_string(free_port)});
  INFO(r.output);
  CHECK(r.exit_code == 0);
  CHECK(r.output.find("warning") == std::string::npos);
}

TEST_CASE("metrics: a malformed --metrics-listen exits 2, a port in use exits 1, both say why") {
  TempDir dir("metrics-bad");
  fs::create_directories(dir.path() + "/root");
  for (const char* bad :
       {"9464", "127.0.0.1", "127.0.0.1:99999", "::1:9464", "example.org:9464", "127.0.0.1:x"}) {
    ProcessResult r = RunProcess({CKPTD_BINARY, "--root", dir.path() + "/root", "--socket",
                                  dir.path() + "/s.sock", "--metrics-listen", bad});
    INFO(bad << ": " << r.output);
    CHECK(r.exit_code == 2);
    CHECK(r.output.find("--metrics-listen") != std::string::npos);
    CHECK(r.output.find(std::string("'") + bad + "'") != std::string::npos);
  }
  // A port someone else listens on.
  int taken_port = 0;
  UniqueFd holder = BindLoopback(&taken_port, /*listen=*/true);
  const std::string taken = "127.0.0.1:" + std::to_string(taken_port);
  ProcessResult r =
      RunProcess({CKPTD_BINARY, "--root", dir.path() + "/root", "--socket", dir.path() + "/s.sock",
                  "--pool-mib", "16", "--chunk-mib", "4", "--metrics-listen", taken});
  INFO(r.output);
  CHECK(r.exit_code == 1);
  CHECK(r.output.find("bind " + taken) != std::string::npos);
  CHECK(r.output.find("in use") != std::string::npos);
  CHECK(!fs::exists(dir.path() + "/s.sock"));  // it stopped before making its socket
  // A textfile in a directory that does not exist: the first write fails the start.
  const std::string nowhere = dir.path() + "/nodir/ckptd.prom";
  r = RunProcess({CKPTD_BINARY, "--root", dir.path() + "/root", "--socket", dir.path() + "/s.sock",
                  "--pool-mib", "16", "--chunk-mib", "4", "--metrics-textfile", nowhere});
  INFO(r.output);
  CHECK(r.exit_code == 2);
  CHECK(r.output.find("cannot start: --metrics-textfile " + nowhere) != std::string::npos);
  CHECK(r.output.find("warning") == std::string::npos);  // no second try on the way out
}

TEST_CASE("metrics: promtool check metrics passes on the daemon's output after a workload") {
  const std::string promtool = OnPath("promtool");
  if (promtool.empty()) {
    WARN("skipped: promtool is not installed (Debian package prometheus)");
    return;
  }
  Fixture f;
  TrainerState state(kTensors, kTensorBytes, 11);
  SaveTwo(f.options.socket, "jobp", state);
  {
    Client c = Client::connect(f.options.socket);
    TrainerState fresh(kTensors, kTensorBytes, 11);
    c.register_items("jobp", 0, 1, fresh.Items());
    c.restore();
  }
  HttpReply r = HttpGet(f.port, "/metrics");
  REQUIRE(r.status == 200);
  const std::string file = f.dir.path() + "/scrape.prom";
  std::ofstream(file) << r.body;
  ProcessResult check = Promtool(promtool, file);
  INFO(check.output);
  CHECK(check.exit_code == 0);
  CHECK(check.output.empty());  // promtool prints lint problems even when it exits 0
  // promtool does catch a bad text: the same check fails on a counter without _total.
  std::ofstream(file + ".bad") << "# HELP ckptd_bytes counter\n# TYPE ckptd_bytes counter\nckptd_bytes 1\n";
  CHECK(Promtool(promtool, file + ".bad").output.find("_total") != std::string::npos);
}

TEST_CASE("metrics: the textfile is replaced atomically every interval, and written at shutdown") {
  TempDir dir("metrics-textfile");
  const std::string collector = dir.path() + "/textfile";
  fs::create_directories(collector);
  DaemonOptions options;
  options.root = dir.path() + "/root";
  options.socket = dir.path() + "/sock/ckptd.sock";
  fs::create_directories(options.root);
  const std::string prom = collector + "/ckptd.prom";
  options.extra_args = {"--metrics-textfile", prom, "--metrics-interval-s", "1"};
  auto daemon = std::make_unique<DaemonProcess>(options);
  // Written before the daemon says it serves.
  REQUIRE(fs::exists(prom));
  struct stat first {};
  REQUIRE(::stat(prom.c_str(), &first) == 0);
  CHECK((first.st_mode & 0777) == 0644);  // node_exporter runs as its own user

  TrainerState state(kTensors, kTensorBytes, 5);
  SaveTwo(options.socket, "jobt", state);
  // Every read sees a whole file (the last metric is there), and a rewrite is a new inode:
  // the file is replaced by a rename, never rewritten in place.
  std::set<ino_t> inodes;
  double committed = 0;
  REQUIRE(Eventually(
      [&] {
        struct stat st {};
        if (::stat(prom.c_str(), &st) != 0) return false;
        inodes.insert(st.st_ino);
        const std::string text = ReadFile(prom);
        REQUIRE(text.find("ckptd_promotions_pending") != std::string::npos);
        auto samples = ParseExposition(text);
        auto it = samples.find("ckptd_versions_committed_total{job=\"jobt\"}");
        committed = it == samples.end() ? 0 : it->second;
        return committed == 2 && inodes.size() >= 2;
      },
      std::chrono::seconds(20)));
  CHECK(inodes.count(first.st_ino) == 1);

  // At shutdown: the last figures, and no temporary file left for the collector to see.
  REQUIRE(daemon->Stop() == 0);
  auto last = ParseExposition(ReadFile(prom));
  CHECK(Value(last, "ckptd_bytes_copied_total{source=\"host\"}") == 2 * kStateBytes);
  CHECK(Value(last, "ckptd_bytes_written_total{tier=\"persistent\"}") == 2 * kStateBytes);
  CHECK(ListFiles(collector) == std::vector<std::string>{"ckptd.prom"});
  const std::string promtool = OnPath("promtool");
  if (!promtool.empty()) {
    ProcessResult check = Promtool(promtool, prom);
    INFO(check.output);
    CHECK(check.exit_code == 0);
  }
}

TEST_CASE("metrics: a real Prometheus server scrapes the daemon and reports its counter") {
  const std::string prometheus = OnPath("prometheus");
  if (prometheus.empty()) {
    WARN("skipped: prometheus is not installed (Debian package prometheus)");
    return;
  }
  Fixture f;
  TrainerState state(kTensors, kTensorBytes, 13);
  SaveTwo(f.options.socket, "jobq", state);
  const double written = Value(f.Scrape(), "ckptd_bytes_written_total{tier=\"local\"}");
  REQUIRE(written == 2 * kStateBytes);

  const std::string config = f.dir.path() + "/prometheus.yml";
  std::ofstream(config) << "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                        << "scrape_configs:\n  - job_name: ckptd\n    static_configs:\n"
                        << "      - targets: ['127.0.0.1:" << f.port << "']\n";
  // The web port is picked free, and picked again should another process take it first.
  pid_t pid = -1;
  int web = 0;
  std::string log;
  for (int attempt = 0; attempt < 5 && pid < 0; ++attempt) {
    web = FreePort();
    log = f.dir.path() + "/prometheus-" + std::to_string(attempt) + ".log";
    pid =
        StartProcess({prometheus, "--config.file=" + config, "--storage.tsdb.path=" + f.dir.path() + "/tsdb",
                      "--web.listen-address=127.0.0.1:" + std::to_string(web)},
                     log);
    bool up = Eventually(
        [&] {
          try {
            return HttpGet(web, "/-/ready").status == 200;
          } catch (const std::exception&) {
            return false;
          }
        },
        std::chrono::seconds(30));
    if (!up) {
      ::kill(pid, SIGKILL);
      WaitProcess(pid);
      pid = -1;
    }
  }
  INFO(ReadFile(log));
  REQUIRE(pid > 0);
  struct Stop {
    pid_t pid;
    ~Stop() {
      ::kill(pid, SIGTERM);
      WaitProcess(pid);
    }
  } stop{pid};

  // Until the first scrape has landed, the query answers an empty vector.
  double seen = -1;
  bool got = Eventually(
      [&] {
        HttpReply r = HttpGet(web, "/api/v1/query?query=ckptd_bytes_written_total%7Btier%3D%22local%22%7D");
        if (r.status != 200) return false;
        auto j = nlohmann::json::parse(r.body);
        if (j["status"] != "success" || j["data"]["result"].empty()) return false;
        const auto& sample = j["data"]["result"][0];
        CHECK(sample["metric"]["job"] == "ckptd");
        seen = std::stod(sample["value"][1].get<std::string>());
        return seen == written;
      },
      std::chrono::seconds(30));
  INFO("Prometheus saw " << seen);
  CHECK(got);
  // Its view of the target: up, with no scrape error.
  HttpReply targets = HttpGet(web, "/api/v1/targets");
  auto t = nlohmann::json::parse(targets.body);
  REQUIRE(t["data"]["activeTargets"].size() == 1);
  CHECK(t["data"]["activeTargets"][0]["health"] == "up");
  CHECK(t["data"]["activeTargets"][0]["lastError"] == "");
}
