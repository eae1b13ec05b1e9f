// What `ckptctl status` tells an operator, against a real ckptd: each shard's state as the
// daemon reports it (a version the promoter skipped for a newer one is "skipped", naming
// that version, an aborted one "aborted", and only a real error "failed"), the exit code
// (non-zero only for a FAILED shard or an unreachable daemon), and tier figures that add up
// (per tier, the bytes of the jobs equal the sum of the shards listed; the memory tier's
// budget in use is held + in flight + kept for reuse), in text, JSON and metrics alike.
#include <ckpt/client.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr int kShardFailedExit = 5;  // docs/ops/ckptctl.md, "Exit codes"
constexpr auto kWait = std::chrono::seconds(60);

ProcessResult Ctl(const std::string& socket, std::vector<std::string> args) {
  args.insert(args.begin(), {CKPTCTL_BINARY, "--socket", socket});
  return RunProcess(args);
}

// `status --json`, which must exit `exit_code`.
json StatusJson(const DaemonProcess& d, int exit_code = 0) {
  ProcessResult r = Ctl(d.socket(), {"status", "--json"});
  INFO("ckptctl said: " << r.output);
  REQUIRE(r.exit_code == exit_code);
  return json::parse(r.output);
}

const json& Tier(const json& status, const std::string& name) {
  for (const auto& t : status["tiers"]) {
    if (t["name"] == name) return t;
  }
  FAIL("no tier " << name << " in " << status.dump());
  throw std::logic_error("unreachable");
}

const json* Shard(const json& status, const std::string& job, std::uint64_t version) {
  for (const auto& sh : status["shards"]) {
    if (sh["job"] == job && sh["version"] == version) return &sh;
  }
  return nullptr;
}

// The line of the text view's shard list for (job, version), or "".
std::string ShardLine(const std::string& text, const std::string& job, std::uint64_t version) {
  const std::size_t list = text.find("\nshards (");
  if (list == std::string::npos) return "";
  const std::string key = "job " + job;
  for (std::size_t at = text.find(key, list); at != std::string::npos; at = text.find(key, at + 1)) {
    const std::size_t end = text.find('\n', at);
    std::string line = text.substr(at, end - at);
    if (line.find(" v" + std::to_string(version) + " ") != std::string::npos) return line;
  }
  return "";
}

// Bytes of the shard files of each job under a tier's directory.
std::map<std::string, std::uint64_t> FileBytesPerJob(const std::string& tier_dir) {
  std::map<std::string, std::uint64_t> out;
  for (const auto& e : fs::recursive_directory_iterator(tier_dir)) {
    if (!e.is_regular_file() || e.path().extension() != ".safetensors") continue;
    const std::string job = fs::relative(e.path(), tier_dir).begin()->string();
    out[job] += e.file_size();
  }
  return out;
}

// The value of the metrics sample `name{labels}` in `text`, or -1.
double Sample(const std::string& text, const std::string& name_and_labels) {
  const std::size_t at = text.find("\n" + name_and_labels + " ");
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + name_and_labels.size() + 2));
}

}  // namespace

TEST_CASE("status: each tier's bytes are the sum of what its jobs hold, and the budget in use adds up",
          "[status][tools]") {
  TempDir dir("status-bytes");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  const std::string local = dir.path() + "/local";
  o.extra_args = {"--local", local, "--memory-mib", "64", "--memory-versions", "2"};
  DaemonProcess daemon(o);

  // Two jobs of different sizes, four committed versions each: the memory tier keeps two per
  // rank, so the buffers of the older ones are freed for reuse.
  std::map<std::string, TrainerState> states;
  states.emplace("sa", TrainerState(2, 1 << 20, 3));
  states.emplace("sb", TrainerState(3, 300 << 10, 5));
  std::vector<Client> clients;
  for (auto& [job, state] : states) {
    clients.push_back(Client::connect(daemon.socket()));
    clients.back().register_items(job, 0, 1, state.Items());
  }
  for (std::uint64_t v = 1; v <= 4; ++v) {
    std::size_t i = 0;
    for (auto& [job, state] : states) {
      state.Fill(v);
      clients[i].snapshot(v);
      clients[i++].wait_durable(v, Level::kCommitted, kWait);
    }
  }
  // Settled: nothing promoted or written any more, so nothing of the budget is in flight.
  json status;
  REQUIRE(Eventually([&] {
    status = StatusJson(daemon);
    return status["promotions_pending"] == 0 && Tier(status, "memory")["in_flight_bytes"] == 0;
  }));
  INFO(status.dump(2));

  const json& memory = Tier(status, "memory");
  CHECK(memory["bytes"].get<std::uint64_t>() == memory["held_bytes"].get<std::uint64_t>() +
                                                    memory["in_flight_bytes"].get<std::uint64_t>() +
                                                    memory["reusable_bytes"].get<std::uint64_t>());
  CHECK(memory["reusable_bytes"].get<std::uint64_t>() > 0);  // freed images, not shards held
  std::uint64_t jobs_held = 0;
  for (const auto& j : memory["jobs"])
    jobs_held += j["bytes"].get<std::uint64_t>() + j["replica_bytes"].get<std::uint64_t>();
  CHECK(jobs_held == memory["held_bytes"].get<std::uint64_t>());
  // Every shard is among those listed (8 < the 64 recent ones): per job, the memory tier
  // holds exactly the images the shards say it holds, the newest two versions.
  REQUIRE(status["shards"].size() == 8);
  REQUIRE(memory["jobs"].size() == 2);
  for (const auto& j : memory["jobs"]) {
    INFO("job " << j["job"]);
    std::uint64_t bytes = 0, shards = 0;
    for (const auto& sh : status["shards"]) {
      if (sh["job"] != j["job"]) continue;
      CHECK(sh["state"] == "committed");
      CHECK(sh["level"] == "committed");
      if (sh["memory_bytes"].get<std::uint64_t>() == 0) continue;
      CHECK(sh["version"].get<std::uint64_t>() >= 3);
      CHECK(sh["memory_bytes"].get<std::uint64_t>() >= sh["total_bytes"].get<std::uint64_t>());
      bytes += sh["memory_bytes"].get<std::uint64_t>();
      ++shards;
    }
    CHECK(j["bytes"] == bytes);
    CHECK(j["shards"] == shards);
    CHECK(shards == 2);
  }

  // The local tier: per job, the bytes of its shard files there (ls lists the same ranks).
  const json& local_tier = Tier(status, "local");
  const auto on_disk = FileBytesPerJob(local);
  std::uint64_t local_held = 0;
  REQUIRE(local_tier["jobs"].size() == on_disk.size());
  for (const auto& j : local_tier["jobs"]) {
    const std::string job = j["job"];
    INFO("job " << job);
    CHECK(j["bytes"] == on_disk.at(job));
    std::uint64_t listed = 0;
    const v1::ListReply list = daemon.List(job);
    for (const auto& v : list.versions()) listed += v.local_ranks_size();
    CHECK(j["shards"] == listed);
    local_held += j["bytes"].get<std::uint64_t>();
  }
  CHECK(local_tier["held_bytes"] == local_held);
  CHECK(status["in_flight_shards"] == 0);
  CHECK(status["in_flight_bytes"] == 0);

  // The text view says the same figures, and the metrics too.
  ProcessResult text = Ctl(daemon.socket(), {"status"});
  INFO(text.output);
  CHECK(text.exit_code == 0);
  CHECK(text.output.find("kept for reuse") != std::string::npos);
  CHECK(text.output.find("    job sa ") != std::string::npos);
  CHECK(text.output.find("0 shard(s), 0 B not yet persisted") != std::string::npos);
  ProcessResult metrics = Ctl(daemon.socket(), {"metrics"});
  REQUIRE(metrics.exit_code == 0);
  for (const auto& j : memory["jobs"]) {
    const std::string job = j["job"];
    CHECK(Sample(metrics.output, "ckptd_tier_held_bytes{tier=\"memory\",job=\"" + job + "\"}") ==
          static_cast<double>(j["bytes"].get<std::uint64_t>()));
  }
  for (const auto& j : local_tier["jobs"]) {
    const std::string job = j["job"];
    CHECK(Sample(metrics.output, "ckptd_tier_held_bytes{tier=\"local\",job=\"" + job + "\"}") ==
          static_cast<double>(j["bytes"].get<std::uint64_t>()));
  }
  CHECK(Sample(metrics.output, "ckptd_memory_tier_used_bytes") ==
        static_cast<double>(memory["bytes"].get<std::uint64_t>()));
  CHECK(Sample(metrics.output, "ckptd_memory_tier_reusable_bytes") ==
        static_cast<double>(memory["reusable_bytes"].get<std::uint64_t>()));
  CHECK(Sample(metrics.output, "ckptd_memory_tier_in_flight_bytes") == 0);
  // And `ckptctl jobs`, per job.
  ProcessResult jobs = Ctl(daemon.socket(), {"jobs", "--json"});
  REQUIRE(jobs.exit_code == 0);
  const json listed_jobs = json::parse(jobs.output);
  std::map<std::string, json> by_job;
  for (const auto& j : listed_jobs["jobs"]) by_job[j["job"].get<std::string>()] = j;
  for (const auto& j : memory["jobs"])
    CHECK(by_job[j["job"].get<std::string>()]["memory_bytes"] == j["bytes"]);
  for (const auto& j : local_tier["jobs"])
    CHECK(by_job[j["job"].get<std::string>()]["local_bytes"] == j["bytes"]);
}

TEST_CASE(
    "status: a version superseded before it was persisted is skipped, naming the newer one, and exits 0",
    "[status][tools]") {
  TempDir dir("status-skip");
  const std::string pause = dir.path() + "/pause";
  { std::ofstream(pause) << "hold"; }
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--local", dir.path() + "/local"};
  o.env = {"CKPTD_TEST_PAUSE=promote:1:" + pause};  // version 1's promotion holds: slow storage
  DaemonProcess daemon(o);
  struct Release {
    std::string pause;
    ~Release() { fs::remove(pause); }  // a failed check must not leave the shutdown waiting
  } release{pause};

  TrainerState state(2, 1 << 20, 7);
  Client client = Client::connect(daemon.socket());
  client.register_items("skip", 0, 1, state.Items());
  for (std::uint64_t v = 1; v <= 3; ++v) {
    state.Fill(v);
    client.snapshot(v);
    client.wait_durable(v, Level::kLocal, kWait);
    if (v == 1) REQUIRE(Eventually([&] { return fs::exists(pause + ".reached"); }));
  }
  // Version 3 came while 2 waited behind the held 1: 2 is skipped for 3.
  CHECK_THROWS_WITH(client.wait_durable(2, Level::kPersisted, kWait),
                    Catch::Contains("superseded by version 3"));

  json status = StatusJson(daemon);  // exit 0: nothing failed
  INFO(status.dump(2));
  const json* v2 = Shard(status, "skip", 2);
  REQUIRE(v2 != nullptr);
  CHECK((*v2)["state"] == "skipped");
  CHECK((*v2)["superseded_by"] == 3);
  CHECK((*v2)["aborted"] == false);
  CHECK((*v2)["in_flight"] == false);
  CHECK((*v2)["error"].get<std::string>().find("superseded by version 3") != std::string::npos);
  const json* v1 = Shard(status, "skip", 1);
  REQUIRE(v1 != nullptr);
  CHECK((*v1)["state"] == "in_progress");  // held at its promotion, on the local tier
  CHECK((*v1)["level"] == "local");
  CHECK((*v1)["in_flight"] == true);
  CHECK(status["in_flight_shards"] == 2);  // versions 1 and 3, on their way
  CHECK(status["in_flight_bytes"] == 2 * state.total_bytes());

  ProcessResult text = Ctl(daemon.socket(), {"status"});
  INFO(text.output);
  CHECK(text.exit_code == 0);
  CHECK(text.output.find("FAILED") == std::string::npos);
  const std::string line = ShardLine(text.output, "skip", 2);
  CHECK(line.find("skipped") != std::string::npos);
  CHECK(line.find("by v3: ") != std::string::npos);

  fs::remove(pause);
  client.wait_durable(3, Level::kCommitted, kWait);
  status = StatusJson(daemon);
  CHECK((*Shard(status, "skip", 2))["state"] == "skipped");
  CHECK((*Shard(status, "skip", 3))["state"] == "committed");
  CHECK((*Shard(status, "skip", 1))["state"] == "committed");
}

TEST_CASE("status: an aborted version is aborted, not failed, and exits 0", "[status][tools]") {
  TempDir dir("status-abort");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  DaemonProcess daemon(o);
  TrainerState state(2, 256 << 10);
  Client client = Client::connect(daemon.socket());
  RegisterOptions sealed;
  sealed.sealed = true;
  client.register_items("ab", 0, 1, state.Items(), sealed);
  state.Fill(1);
  client.snapshot(1);
  client.wait_snapshot(1, std::chrono::milliseconds(0), false);
  client.abort_snapshot(1, "tensor t0 changed after save(1)");
  CHECK_THROWS(client.wait_durable(1));

  json status = StatusJson(daemon);
  const json* v1 = Shard(status, "ab", 1);
  REQUIRE(v1 != nullptr);
  CHECK((*v1)["state"] == "aborted");
  CHECK((*v1)["aborted"] == true);
  CHECK((*v1)["error"].get<std::string>().find("tensor t0 changed after save(1)") != std::string::npos);
  ProcessResult text = Ctl(daemon.socket(), {"status"});
  INFO(text.output);
  CHECK(text.exit_code == 0);
  CHECK(ShardLine(text.output, "ab", 1).find("ABORTED") != std::string::npos);
}

TEST_CASE("status: a shard whose write failed is FAILED, and status exits non-zero", "[status][tools]") {
  TempDir dir("status-fail");
  const std::string armed = dir.path() + "/armed";
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.env = {"CKPTD_TEST_FAULT=file=data,op=write,fault=EIO,while=" + armed};
  DaemonProcess daemon(o);
  TrainerState state(2, 256 << 10);
  Client client = Client::connect(daemon.socket());
  client.register_items("bad", 0, 1, state.Items());
  state.Fill(1);
  client.snapshot(1);
  client.wait_durable(1, Level::kCommitted, kWait);
  CHECK(StatusJson(daemon)["shards"][0]["state"] == "committed");

  { std::ofstream(armed) << "armed"; }
  state.Fill(2);
  client.snapshot(2);
  CHECK_THROWS_WITH(client.wait_durable(2, Level::kCommitted, kWait),
                    Catch::Contains("injected by CKPTD_TEST_FAULT"));
  fs::remove(armed);

  json status = StatusJson(daemon, kShardFailedExit);  // the document is printed all the same
  const json* v2 = Shard(status, "bad", 2);
  REQUIRE(v2 != nullptr);
  CHECK((*v2)["state"] == "failed");
  CHECK((*v2)["error"].get<std::string>().find("injected by CKPTD_TEST_FAULT") != std::string::npos);
  CHECK((*Shard(status, "bad", 1))["state"] == "committed");
  ProcessResult text = Ctl(daemon.socket(), {"status"});
  INFO(text.output);
  CHECK(text.exit_code == kShardFailedExit);
  CHECK(ShardLine(text.output, "bad", 2).find("FAILED") != std::string::npos);

  // An unreachable daemon is the other failure: exit 1.
  ProcessResult down = Ctl(dir.path() + "/nope.sock", {"status", "--json"});
  CHECK(down.exit_code == 1);
  CHECK(down.output.find("is ckptd running") != std::string::npos);
}
