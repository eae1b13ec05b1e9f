// PeerCluster: the nodes of a job for the peer replication tests, as real ckptd processes
// on loopback TCP: several daemons on one machine, each with its own socket, local tier and
// peer address, sharing one persistent directory. A node's loss is kill -9 of its daemon and
// the removal of its local tier; its replacement is a fresh daemon in its place (same
// --peer-listen address, empty memory and local tier). Rank r runs on node r / kRanksPerNode.
#pragma once

#include <ckpt/client.h>
#include <sys/stat.h>

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "support/daemon_process.h"
#include "support/free_ports.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

namespace ckpt::test {

inline constexpr std::size_t kTensors = 2;
inline constexpr std::size_t kTensorBytes = 1 << 20;
inline constexpr std::uint32_t kRanksPerNode = 2;

inline std::string WriteSecret(const std::string& path, const std::string& secret, mode_t mode = 0600) {
  { std::ofstream(path) << secret << "\n"; }
  ::chmod(path.c_str(), mode);
  return path;
}

// A job's nodes: N daemons, each with --replicas R and the same --peers list.
struct Cluster {
  const TempDir& dir;
  std::uint32_t replicas;
  std::vector<std::string> addresses;
  std::string secret;
  std::vector<std::unique_ptr<DaemonProcess>> daemons;
  std::vector<std::vector<std::string>> env;  // per node
  std::vector<std::string> extra_args;          // added to every node's flags
  std::uint64_t open_files = 0;                 // every node's open-file limit (0: inherited)

  Cluster(const TempDir& d, int nodes, std::uint32_t r) : dir(d), replicas(r), daemons(nodes), env(nodes) {
    for (int p : FreePorts(nodes)) addresses.push_back("127.0.0.1:" + std::to_string(p));
    secret = WriteSecret(dir.path() + "/peer-secret", "a shared secret of the test cluster");
  }
  std::string root() const { return dir.path() + "/persistent"; }
  std::string local(int i) const { return dir.path() + "/node" + std::to_string(i) + "/local"; }
  std::string socket(int i) const { return dir.path() + "/node" + std::to_string(i) + "/sock/ckptd.sock"; }
  std::string peers() const {
    std::string s;
    for (const auto& a : addresses) s += (s.empty() ? "" : ",") + a;
    return s;
  }
  DaemonOptions Options(int i, const std::string& secret_file) const {
    DaemonOptions o;
    o.root = root();
    o.socket = socket(i);
    o.extra_args = {"--local", local(i), "--memory-mib", "256", "--replicas", std::to_string(replicas),
                    "--peer-listen", addresses[i], "--peers", peers(), "--peer-secret", secret_file};
    o.extra_args.insert(o.extra_args.end(), extra_args.begin(), extra_args.end());
    o.env = env[i];
    o.open_files = open_files;
    return o;
  }
  void Start(int i) { daemons[i] = std::make_unique<DaemonProcess>(Options(i, secret)); }
  void StartAll() {
    for (int i = 0; i < static_cast<int>(daemons.size()); ++i) Start(i);
  }
  // The node is gone: its daemon killed, its local tier deleted.
  void Lose(int i) {
    daemons[i]->Kill9();
    std::filesystem::remove_all(local(i));
  }
  DaemonProcess& operator[](int i) { return *daemons[i]; }
};

struct Rank {
  std::uint32_t rank;
  TrainerState state;
  std::unique_ptr<Client> client;
  explicit Rank(std::uint32_t r) : rank(r), state(kTensors, kTensorBytes, 100 + r) {}
  void Connect(const std::string& socket, const std::string& job, std::uint32_t world) {
    client = std::make_unique<Client>(Client::connect(socket));
    client->register_items(job, rank, world, state.Items());
  }
};

// Every rank of a job, rank r on node r / kRanksPerNode.
struct Job {
  std::string name;
  std::uint32_t world;
  std::vector<std::unique_ptr<Rank>> ranks;
  Job(std::string n, std::uint32_t w) : name(std::move(n)), world(w) {}
  int NodeOf(std::uint32_t r) const { return static_cast<int>(r / kRanksPerNode); }
  // A fresh trainer process for every rank (the job restarted), connected to its node.
  void Launch(Cluster& c) {
    ranks.clear();
    for (std::uint32_t r = 0; r < world; ++r) {
      ranks.push_back(std::make_unique<Rank>(r));
      ranks.back()->Connect(c.socket(NodeOf(r)), name, world);
    }
  }
  // Fills every rank's state with `v` and asks for its snapshot (waits for nothing).
  void Snapshot(std::uint64_t v) {
    for (auto& r : ranks) {
      r->state.Fill(v);
      r->client->snapshot(v);
    }
  }
  // Saves `v` on every rank and waits until it is committed and replicated.
  void Save(std::uint64_t v) {
    Snapshot(v);
    for (auto& r : ranks) r->client->wait_durable(v, Level::kCommitted);
    for (auto& r : ranks) r->client->wait_durable(v, Level::kReplicated);
  }
  // Restores the newest version on every rank; the tier each read.
  std::vector<std::string> RestoreAll(std::uint64_t expect) {
    std::vector<std::string> tiers;
    for (auto& r : ranks) {
      r->state.Fill(999);  // not the content of any saved version
      RestoreResult got = r->client->restore();
      INFO("rank " << r->rank);
      REQUIRE(got.version == expect);
      CHECK(r->state.FirstMismatch(expect) == -1);  // byte-exact
      tiers.push_back(got.tier);
    }
    return tiers;
  }
};

// The value of one sample line of `ckptctl metrics` on the daemon at `socket` ("NAME{LABELS}
// VALUE"), or -1 if the series is not there.
inline double Metric(const std::string& socket, const std::string& series) {
  ProcessResult m = RunProcess({CKPTCTL_BINARY, "--socket", socket, "metrics"});
  const auto at = m.output.find("\n" + series + " ");
  if (at == std::string::npos) return -1;
  return std::stod(m.output.substr(at + series.size() + 2));
}

inline std::string ErrorsOf(const v1::StatusReply& st) {
  std::string all;
  for (const auto& e : st.errors()) all += e + "\n";
  return all;
}


}  // namespace ckpt::test
