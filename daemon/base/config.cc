#include "daemon/base/config.h"

#include <grp.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iostream>
#include <map>
#include <sstream>
#include <vector>

#include "common/listen_address.h"
#include "common/safe_file.h"
#include "common/socket_path.h"
#include "daemon/base/peer_list.h"
#include "daemon/base/peer_secret.h"

namespace ckpt {

std::string DefaultSocketPath() { return DefaultClientSocketPath(); }

namespace {

// The config file is read here rather than by CLI11, whose std::ifstream would block on a
// FIFO and follow a symbolic link: it must be a regular file (common/safe_file.h).
Result<std::string> ReadConfigFile(const std::string& path) {
  auto fd = OpenRegularForRead(path);
  if (!fd.ok()) return fd.status();
  constexpr std::size_t kMaxBytes = 1 << 20;
  std::string text;
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd->get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return IoError("read " + path, errno);
    if (n == 0) return text;
    text.append(buf, static_cast<std::size_t>(n));
    if (text.size() > kMaxBytes) return InvalidArgument(path + " is larger than 1 MiB: not a config file");
  }
}

// Keys are compared without case, dashes and underscores: `keep_last` and `KeepLast` are
// both taken for a misspelling of keep-last.
std::string Normalized(const std::string& name) {
  std::string n;
  for (char ch : name) {
    if (ch != '-' && ch != '_') n += static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  }
  return n;
}

// The error for a key of the config file that no option has, with the option it most
// likely means.
std::string UnknownKeyError(const CLI::App& app, const std::string& key, const std::string& file) {
  std::string msg = "unknown key '" + key + "' in " + (file.empty() ? std::string("the config") : file);
  for (const CLI::Option* opt : app.get_options()) {
    const std::string name = opt->get_single_name();
    if (opt->get_configurable() && !name.empty() && Normalized(name) == Normalized(key)) {
      return msg + " (did you mean '" + name + "'? keys are the long flags without the dashes)";
    }
  }
  return msg + " (keys are the long flags without the dashes; see ckptd --help)";
}

// CLI11 keeps the first of two settings of one key and drops the second without a word
// (`pool-mib = 64` then `pool-mib = 5` ran with 64): a key set twice is an error, except
// for the options that take a list (allow-uid).
void CheckRepeatedKeys(CLI::App& app, const std::string& text, const std::string& file) {
  std::istringstream in(text);
  std::map<std::string, int> seen;
  for (const CLI::ConfigItem& item : CLI::ConfigINI().from_config(in)) {
    if (item.name == "++" || item.name == "--") continue;  // section markers
    std::string key = item.name;
    for (auto p = item.parents.rbegin(); p != item.parents.rend(); ++p) key = *p + "." + key;
    if (++seen[key] != 2) continue;
    const CLI::Option* opt = app.get_option_no_throw("--" + key);
    if (opt != nullptr && opt->get_items_expected_max() > 1) continue;
    throw CLI::ConfigError("key '" + key + "' is set twice in " +
                           (file.empty() ? std::string("the config") : file) + " (each key may appear once)");
  }
}

// A group given by name or number; nullopt if no such group.
std::optional<gid_t> ResolveGroup(const std::string& name) {
  if (!name.empty() && name.find_first_not_of("0123456789") == std::string::npos && name.size() < 10) {
    return static_cast<gid_t>(std::stoul(name));
  }
  struct group entry {};
  std::vector<char> buf(16384);
  struct group* found = nullptr;
  if (::getgrnam_r(name.c_str(), &entry, buf.data(), buf.size(), &found) != 0 || found == nullptr) {
    return std::nullopt;
  }
  return found->gr_gid;
}

// Defines every option, lets `parse` feed the app (argv or config-file text), then checks
// what no single option can.
std::optional<Config> Parse(const std::function<void(CLI::App&)>& parse, int* exit_code, std::ostream& out,
                            std::ostream& err) {
  Config c;
  c.socket_path = DefaultSocketPath();
  CLI::App app{"ckptd: node-local checkpoint daemon (lazy snapshots, safetensors shards)"};
  // Unknown flags and unknown keys in the file are errors (CLI11 ignores unknown keys by
  // default, which ran `keep_last = 3` as "keep every version").
  app.allow_extras(false);
  app.allow_config_extras(CLI::config_extras_mode::error);
  app.set_version_flag("--version", std::string("ckptd ") + CKPTD_VERSION);
  std::string& config_file = c.config_file;
  std::string erasure_spec;  // --erasure K+M, parsed below
  app.add_option("--config", config_file, "Read options from this file (key = value, same names as flags)")
      ->configurable(false);
  app.add_flag("--check-config", c.check_config,
               "Validate the flags, the config file and the directories they name; print the effective "
               "config and exit 0, or print the error and exit 2")
      ->configurable(false);
  app.add_option("--socket", c.socket_path,
                 "Unix socket to serve on ($CKPTD_SOCKET, else /run/ckptd/ckptd.sock)")
      ->capture_default_str();
  std::string socket_mode = "0600";
  app.add_option("--socket-mode", socket_mode, "Permission bits of the socket, octal")
      ->check([](const std::string& v) {
        return v.find_first_not_of("01234567") == std::string::npos && !v.empty() && v.size() <= 4
                   ? std::string()
                   : "must be octal permission bits such as 0600";
      })
      ->capture_default_str();
  std::string socket_group;
  app.add_option(
      "--socket-group", socket_group,
      "Group of the socket (name or number; default: the daemon's), for a socket-mode such as 0660");
  app.add_option(
         "--root,--persistent", c.root,
         "Persistent tier: the checkpoint root, shared by all nodes (COMMITTED and latest live here); "
         "must exist unless --create-root")
      ->capture_default_str();
  app.add_flag("--create-root", c.create_root,
               "Create --root and --local if missing (default: a missing one is an error, so that an "
               "unmounted file system is never replaced by a local directory)");
  app.add_option(
      "--local", c.local_dir,
      "Local tier (node-local NVMe or /dev/shm): shards land here first, then are promoted to --root");
  app.add_option(
      "--node-id", c.node_id,
      "This daemon's name in temporary files on the shared directory (default: host name + socket hash)");
  app.add_option("--local-keep", c.local_keep, "Committed versions the local tier keeps per job")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--memory-versions", c.memory_versions,
                 "Newest versions per rank kept in daemon memory (restore without reading a file; 0: none)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  // Bounded so that the budget in bytes (memory_mib << 20) cannot overflow.
  app.add_option("--memory-mib", c.memory_mib, "Memory tier budget in MiB (0: no memory tier)")
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1} << 40))
      ->capture_default_str();
  app.add_option("--pool-mib", c.pool_mib, "Host pool size in MiB (allocated at start)")
      ->check(CLI::Range(16, 1 << 22))
      ->capture_default_str();
  std::string pool_numa = "local";
  app.add_option("--pool-numa", pool_numa,
                 "NUMA placement of the host pool: local (first touch), interleave (over every node "
                 "allowed), or a node number")
      ->capture_default_str();
  app.add_option("--chunk-mib", c.chunk_mib, "Pool chunk size in MiB")
      ->check(CLI::Range(1, 1024))
      ->capture_default_str();
  app.add_option("--writers", c.writers, "Writer threads (writes in flight)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--copiers", c.copiers, "Copy threads")->check(CLI::Range(1, 64))->capture_default_str();
  app.add_option("--copy-streams", c.copy_streams, "CUDA streams copying one shard (chunk i on stream i % N)")
      ->check(CLI::Range(1, 16))
      ->capture_default_str();
  std::map<std::string, DirectIoMode> modes{
      {"auto", DirectIoMode::kAuto}, {"on", DirectIoMode::kOn}, {"off", DirectIoMode::kOff}};
  app.add_option("--direct-io", c.direct_io, "O_DIRECT writes: auto, on or off")
      ->transform(CLI::CheckedTransformer(modes, CLI::ignore_case))
      ->default_str("auto");
  app.add_option("--keep-last", c.keep_last, "Committed versions the persistent tier keeps per job (0: all)")
      ->capture_default_str();
  app.add_option("--keep-every", c.keep_every,
                 "With --keep-last, also keep every committed version that is a multiple of this (0: none)")
      ->capture_default_str();
  app.add_option("--persistent-base-every", c.persistent_base_every,
                 "Write a persistent shard with only the items changed since a base version fewer than this "
                 "many versions older, which holds the rest (needs --local; 0: every shard whole)")
      ->check(CLI::Range(0, 1000000))
      ->capture_default_str();
  std::map<std::string, bool> restart_waits{{"newest", true}, {"none", false}};
  app.add_option("--restart-waits", c.restart_waits_newest,
                 "A trainer's restart waits for its rank's newest version in flight (newest) or restores "
                 "the newest committed version at once (none)")
      ->transform(CLI::CheckedTransformer(restart_waits, CLI::ignore_case))
      ->default_str("newest");
  app.add_flag("--verify-snapshots", c.verify_snapshots,
               "Verify every version at its trainer's wait: host memory that changed since the snapshot "
               "aborts the version (costs one more read of the state per checkpoint)");
  app.add_option("--allow-uid", c.allow_uids, "Also serve this uid (repeatable)");
  std::int64_t job_group = -1;
  app.add_option(
         "--job-group", job_group,
         "Share the jobs of this group's members with the whole group (default: a job is its owner's only)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{UINT32_MAX - 1}));
  app.add_option("--max-connections", c.max_connections,
                 "Connections held at once, in all (0: half the open-file limit, at most 16384)")
      ->capture_default_str();
  app.add_option("--max-connections-per-uid", c.max_connections_per_uid,
                 "Connections one uid may hold at once (0: no limit)")
      ->capture_default_str();
  app.add_option("--max-sessions-per-uid", c.max_sessions_per_uid,
                 "Sessions (registered trainers) one uid may hold at once (0: no limit)")
      ->capture_default_str();
  app.add_option("--max-registrations-per-uid", c.max_registrations_per_uid,
                 "Registrations one uid may have in progress at once (0: no limit)")
      ->capture_default_str();
  app.add_option("--max-items-per-uid", c.max_items_per_uid,
                 "Items one uid may hold over all its sessions (0: no limit)")
      ->capture_default_str();
  app.add_option("--idle-timeout-s", c.idle_timeout_s, "Close a connection idle this long (0: never)")
      ->capture_default_str();
  app.add_option("--max-blob-mib", c.max_blob_mib, "Largest blob total per snapshot in MiB")
      ->capture_default_str();
  app.add_option("--log-level", c.log_level, "trace, debug, info, warn or error")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error"}))
      ->capture_default_str();
  app.add_option("--log-file", c.log_file,
                 "Append the log to this file instead of stdout/stderr; SIGHUP reopens it (logrotate)");
  app.add_option("--ready-fd", c.ready_fd, "Write 'ready' to this fd once serving")->configurable(false);
  app.add_option(
      "--metrics-listen", c.metrics_listen,
      "Serve Prometheus metrics on http://ADDR:PORT/metrics (e.g. 127.0.0.1:9464; off by default)");
  app.add_option("--metrics-textfile", c.metrics_textfile,
                 "Write Prometheus metrics to this file (node_exporter textfile collector), atomically");
  app.add_option("--metrics-interval-s", c.metrics_interval_s, "Seconds between writes of --metrics-textfile")
      ->check(CLI::Range(1, 86400))
      ->capture_default_str();
  app.add_option("--replicas", c.replicas,
                 "Peer daemons that hold a copy of each shard in memory (0: no replication)")
      ->check(CLI::Range(0, 16))
      ->capture_default_str();
  app.add_option("--peer-listen", c.peer_listen,
                 "ADDR:PORT of the daemon-to-daemon replication server (TCP; needed with --replicas)");
  app.add_option("--peers", c.peers,
                 "Every daemon's --peer-listen address, this one's included, in one order shared by all "
                 "(comma-separated), or 'slurm' ($SLURM_JOB_NODELIST with the --peer-listen port)")
      ->delimiter(',');
  app.add_option("--peer-secret", c.peer_secret,
                 "File holding the secret shared by the peer daemons (readable by the daemon's user only)");
  app.add_option("--peer-progress-timeout-s", c.peer_progress_timeout_s,
                 "Seconds a peer transfer may go without moving a byte before it is given up (a restore "
                 "then reads the next source)")
      ->check(CLI::Range(1, 3600))
      ->capture_default_str();
  app.add_option(
         "--replica-commit-timeout-s", c.replica_commit_timeout_s,
         "Seconds a persisted version waits for every rank's shard to be held by --replicas peers before "
         "it commits anyway, recorded as under-replicated (0: commits do not wait for replicas)")
      ->check(CLI::Range(0, 86400))
      ->capture_default_str();
  app.add_flag("--replica-deltas,!--no-replica-deltas", c.replica_deltas,
               "Send a replica as a delta on the version the peer holds (only the chunks that changed); "
               "--no-replica-deltas sends every replica whole")
      ->capture_default_str();
  app.add_option("--erasure", erasure_spec,
                 "K+M: protect this daemon's shards with a Reed-Solomon code over groups of K+M daemons of "
                 "--peers (in its order), each holding M/K of parity for the others, so that any M lost nodes "
                 "of a group are rebuilt from the rest (besides or instead of --replicas; 'off' or empty: off)");
  app.add_flag("--warm-start", c.warm_start,
               "At start, pull the shards this node's ranks last committed back from peers' memory into this "
               "daemon's memory tier (needs --replicas)");
  app.add_option("--warm-start-mib-per-s", c.warm_start_mib_per_s,
                 "MiB/s a warm start reads from peers at most (0: no cap)")
      ->check(CLI::Range(std::uint64_t{0}, std::uint64_t{1} << 20))
      ->capture_default_str();
  app.add_option("--peer-max-connections", c.peer_max_connections,
                 "Connections the peer server holds at once (0: a quarter of the open-file limit)")
      ->capture_default_str();
  app.add_option("--peer-max-connections-per-address", c.peer_max_connections_per_address,
                 "Connections the peer server holds at once from one remote address")
      ->check(CLI::Range(1, 65536))
      ->capture_default_str();
  // What the file is being parsed from, for the unknown-key error ("" while parsing argv).
  std::string parsing_file;
  try {
    parse(app);
    if (!config_file.empty()) {
      auto text = ReadConfigFile(config_file);
      if (!text.ok()) {
        err << "ckptd: --config: " << text.status().message() << "\n";
        *exit_code = 2;
        return std::nullopt;
      }
      // After the flags: an option given on the command line wins over the file.
      parsing_file = config_file;
      CheckRepeatedKeys(app, text.value(), config_file);
      std::istringstream in(text.value());
      app.parse_from_stream(in);
    }
  } catch (const CLI::ConfigError& e) {
    static const std::string kExtras = "INI was not able to parse ";
    const std::string what = e.what();
    err << "ckptd: "
        << (what.rfind(kExtras, 0) == 0 ? UnknownKeyError(app, what.substr(kExtras.size()), parsing_file)
                                        : what)
        << "\n";
    *exit_code = 2;
    return std::nullopt;
  } catch (const CLI::ParseError& e) {
    // CLI11's own codes (105, 109, ...) differ by error; a usage error exits 2, as documented.
    *exit_code = app.exit(e, out, err) == 0 ? 0 : 2;
    return std::nullopt;
  }
  auto fail = [&](const std::string& message) {
    err << "ckptd: " << message << "\n";
    *exit_code = 2;
    return std::nullopt;
  };
  c.socket_mode = static_cast<std::uint32_t>(std::strtoul(socket_mode.c_str(), nullptr, 8));
  if (c.socket_mode & ~0777u) {
    return fail("--socket-mode " + socket_mode + ": only permission bits (at most 0777) apply to a socket");
  }
  if (!socket_group.empty()) {
    c.socket_group = ResolveGroup(socket_group);
    if (!c.socket_group) return fail("--socket-group " + socket_group + ": no such group");
  }
  if (c.socket_path.empty() || c.socket_path.front() != '/') {
    return fail("--socket '" + c.socket_path + "' must be an absolute path");
  }
  if (job_group >= 0) c.job_group = static_cast<gid_t>(job_group);
  if (auto numa = NumaPlacement::Parse(pool_numa); numa.ok()) {
    c.pool_numa = numa.value();
  } else {
    return fail(numa.status().message());
  }
  // A node the daemon may not use is a configuration error (exit 2, and --check-config says
  // so), not a start that fails later and is restarted for ever.
  if (c.pool_numa.mode == NumaPlacement::Mode::kNode) {
    auto allowed = AllowedNumaNodes();
    if (!allowed.ok()) return fail("--pool-numa " + pool_numa + ": this kernel has no NUMA support");
    bool ok = false;
    std::string list;
    for (int n : allowed.value()) {
      ok = ok || n == c.pool_numa.node;
      list += (list.empty() ? "" : ",") + std::to_string(n);
    }
    if (!ok) {
      return fail("--pool-numa " + pool_numa +
                  ": not a NUMA node this daemon may allocate on (allowed: " + list + ")");
    }
  }
  if (!c.metrics_listen.empty()) {
    if (auto addr = ParseListenAddress(c.metrics_listen); !addr.ok()) {
      return fail("--metrics-listen: " + addr.status().message());
    }
  }
  if (!c.metrics_textfile.empty()) {
    // Absolute, so that its temporary file goes to the same directory whatever the cwd.
    std::error_code ec;
    c.metrics_textfile = std::filesystem::absolute(c.metrics_textfile, ec).lexically_normal().string();
    if (ec || c.metrics_textfile.back() == '/') {
      return fail("--metrics-textfile: '" + c.metrics_textfile + "' is not a file path");
    }
  }
  if (c.replicas > 0) {
    if (c.peer_listen.empty()) return fail("--replicas " + std::to_string(c.replicas) + " needs --peer-listen ADDR:PORT");
    if (auto addr = ParseListenAddress(c.peer_listen); !addr.ok()) {
      return fail("--peer-listen: " + addr.status().message());
    }
    if (c.peer_secret.empty()) {
      return fail("--replicas " + std::to_string(c.replicas) +
                  " needs --peer-secret FILE (the secret the peer daemons share)");
    }
    if (c.peers.empty()) return fail("--replicas " + std::to_string(c.replicas) + " needs --peers");
    // The list must name this daemon and hold R others; the secret must be this user's only.
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const char* slurm = std::getenv("SLURM_JOB_NODELIST");
    if (auto peers = ResolvePeers(c.peers, c.peer_listen, c.replicas, slurm ? slurm : "", host); !peers.ok()) {
      return fail(peers.status().message());
    }
    if (auto secret = PeerSecret::Load(c.peer_secret); !secret.ok()) return fail(secret.status().message());
  }
  if (!erasure_spec.empty() && erasure_spec != "off") {
    // Digits only: no sign, no overflow (K + M is at most 32 anyway).
    unsigned k = 0, m = 0;
    const std::size_t plus = erasure_spec.find('+');
    auto digits = [](const std::string& t) {
      return !t.empty() && t.size() <= 2 && std::all_of(t.begin(), t.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
    };
    const std::string ks = plus == std::string::npos ? "" : erasure_spec.substr(0, plus);
    const std::string ms = plus == std::string::npos ? "" : erasure_spec.substr(plus + 1);
    if (digits(ks) && digits(ms)) {
      k = static_cast<unsigned>(std::stoul(ks));
      m = static_cast<unsigned>(std::stoul(ms));
    }
    if (!digits(ks) || !digits(ms) || k < 1 || m < 1 || k + m > 32) {
      return fail("--erasure '" + erasure_spec +
                  "': expected K+M with K >= 1 data and M >= 1 parity daemons, K + M at most 32 (e.g. 4+1)");
    }
    if (m >= k) {
      return fail("--erasure '" + erasure_spec + "': M must be below K (with M >= K the parity takes as much memory "
                  "as M/K replicas, at least one: use --replicas instead)");
    }
    c.erasure_k = k;
    c.erasure_m = m;
    const std::string flag = "--erasure " + erasure_spec;
    if (c.peer_listen.empty()) return fail(flag + " needs --peer-listen ADDR:PORT");
    if (auto addr = ParseListenAddress(c.peer_listen); !addr.ok()) return fail("--peer-listen: " + addr.status().message());
    if (c.peer_secret.empty()) return fail(flag + " needs --peer-secret FILE (the secret the peer daemons share)");
    if (c.peers.empty()) return fail(flag + " needs --peers");
    if (c.memory_mib == 0 || c.memory_versions == 0) {
      return fail(flag + " needs a memory tier (--memory-mib and --memory-versions above 0): a rebuild reads the "
                  "other daemons' shards from their memory");
    }
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    const char* slurm = std::getenv("SLURM_JOB_NODELIST");
    auto peers = ResolvePeers(c.peers, c.peer_listen, c.replicas, slurm ? slurm : "", host);
    if (!peers.ok()) return fail(peers.status().message());
    const std::size_t n = peers.value().addresses.size();
    if (n % (k + m) != 0) {
      return fail(flag + ": --peers names " + std::to_string(n) + " daemons, not a multiple of K+M = " +
                  std::to_string(k + m) + " (the ring is cut into groups of K+M in its order)");
    }
    if (auto secret = PeerSecret::Load(c.peer_secret); !secret.ok()) return fail(secret.status().message());
  } else {
    c.erasure_k = c.erasure_m = 0;
  }
  if (c.warm_start && c.replicas == 0) {
    return fail("--warm-start needs --replicas (it pulls shards from peers' memory)");
  }
  if (c.chunk_mib * 4 > c.pool_mib) {
    return fail("--pool-mib (" + std::to_string(c.pool_mib) + ") must hold at least 4 chunks of " +
                std::to_string(c.chunk_mib) + " MiB");
  }
  if (c.node_id.empty()) {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    std::uint64_t h = 1469598103934665603ull;  // FNV-1a of the socket path
    for (unsigned char ch : c.socket_path) h = (h ^ ch) * 1099511628211ull;
    char buf[320];
    std::snprintf(buf, sizeof buf, "%s-%08llx", host, static_cast<unsigned long long>(h & 0xffffffffull));
    c.node_id = buf;
  }
  for (char& ch : c.node_id) {
    if (!std::isalnum(static_cast<unsigned char>(ch)) && ch != '-' && ch != '_') ch = '_';
  }
  // Directories of the tree are opened without following a link (common/safe_file.h): a
  // root that is a link is named by its target, which also makes the check below see
  // through links.
  for (std::string* dir : {&c.root, &c.local_dir}) {
    if (dir->empty()) continue;
    if (char* real = ::realpath(dir->c_str(), nullptr)) {
      *dir = real;
      std::free(real);
    }
  }
  if (c.persistent_base_every > 0 && c.local_dir.empty()) {
    return fail("--persistent-base-every needs --local: differential shards are written when a shard is "
                "promoted from the local tier to --root, where its checksums are known");
  }
  if (!c.local_dir.empty() && c.local_dir == c.root) {
    return fail("--local and --root are the same directory (" + c.root +
                "); give one directory only, or two different ones");
  }
  c.effective = app.config_to_str(/*default_also=*/true, /*write_description=*/false);
  // The node id the daemon uses (computed, or with its odd characters replaced), not the
  // text given.
  if (auto at = c.effective.find("node-id=");
      at != std::string::npos && (at == 0 || c.effective[at - 1] == '\n')) {
    c.effective.replace(at, c.effective.find('\n', at) - at, "node-id=\"" + c.node_id + "\"");
  }
  *exit_code = 0;
  return c;
}

}  // namespace

std::optional<Config> ParseConfig(int argc, char** argv, int* exit_code, std::ostream& out,
                                  std::ostream& err) {
  return Parse([&](CLI::App& app) { app.parse(argc, argv); }, exit_code, out, err);
}

std::optional<Config> ParseConfig(int argc, char** argv, int* exit_code) {
  return ParseConfig(argc, argv, exit_code, std::cout, std::cerr);
}

std::optional<Config> ParseConfigText(const std::string& text, int* exit_code) {
  return Parse(
      [&](CLI::App& app) {
        CheckRepeatedKeys(app, text, "");
        std::istringstream in(text);
        app.parse_from_stream(in);
      },
      exit_code, std::cout, std::cerr);
}

}  // namespace ckpt
