// Config: everything ckptd can be told, with its defaults. ParseConfig is the one place
// that reads flags and the optional config file (INI/TOML key = value, same names as the
// long flags without dashes; flags win over the file). An unknown flag or key is an error
// naming it (exit 2), so a misspelled key never runs a daemon with a default instead.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

#include "daemon/base/numa.h"

namespace ckpt {

enum class DirectIoMode { kAuto, kOn, kOff };

struct Config {
  // The --config file ("" if none): SIGHUP reads it again.
  std::string config_file;
  // Unix socket path. Default: $CKPTD_SOCKET if set, else /run/ckptd/ckptd.sock
  // (common/socket_path.h).
  std::string socket_path;
  // Permission bits of the socket file. A socket directory the daemon creates is 0700;
  // one that exists (systemd's RuntimeDirectory=) is left as it is.
  std::uint32_t socket_mode = 0600;
  // Group of the socket file (nullopt: the daemon's), so socket-mode 0660 admits a group.
  std::optional<gid_t> socket_group;
  // The persistent tier: the checkpoint root, shared by every node of a job (the parallel
  // file system). COMMITTED markers and `latest` live here. It must exist unless
  // create_root (so that an unmounted file system is an error, not a local directory).
  std::string root = "/var/lib/ckptd";
  // Create --root and --local if they are missing (mode 0700).
  bool create_root = false;
  // The local tier (node-local NVMe or /dev/shm); empty: none, shards go straight to root.
  // With one, shards are written here first and promoted to root in the background.
  std::string local_dir;
  // This daemon's name in the files it writes to the shared directory (temporary files are
  // NAME.NODE.tmp: a restart removes only its own). Default: the host name and a hash of
  // the socket path, so several daemons on one machine differ too.
  std::string node_id;
  // Committed versions the local tier keeps per job (at least 1).
  std::uint32_t local_keep = 2;
  // The memory tier: the newest versions of each rank kept in daemon memory, so a restarted
  // trainer restores without reading a file; bounded by memory_mib (0: no memory tier).
  std::uint32_t memory_versions = 1;
  std::uint64_t memory_mib = 4096;
  // Host pool size: the daemon's memory for data in flight, allocated once at start.
  std::uint64_t pool_mib = 1024;
  // Where the pool's pages live (--pool-numa local|interleave|N: daemon/base/numa.h).
  NumaPlacement pool_numa;
  // Pool chunk size: the unit of copy and of write.
  std::uint64_t chunk_mib = 16;
  // Threads writing chunks to storage (writes in flight).
  std::uint32_t writers = 4;
  // Threads copying from trainer memory (shards captured in parallel).
  std::uint32_t copiers = 2;
  // CUDA streams one shard's device copies are spread over (chunk i on stream i % N).
  std::uint32_t copy_streams = 2;
  // O_DIRECT use: auto probes each directory, on requires it, off never uses it.
  DirectIoMode direct_io = DirectIoMode::kAuto;
  // Peers allowed besides the daemon's own uid (SO_PEERCRED check).
  std::vector<uid_t> allow_uids;
  // A job belongs to the uid that first registers it (ROOT/JOB/owner). If that uid is a
  // member of this group, the job is shared with the group's members; none: never shared.
  std::optional<gid_t> job_group;
  // Per-uid limits, so one uid cannot starve the others (0: no limit). Connections held at
  // once, in all (0: half the open-file limit, at most 16384) and by one uid; sessions open
  // at once; registrations in progress at once; items summed over a uid's open sessions.
  std::uint32_t max_connections = 0;
  std::uint32_t max_connections_per_uid = 128;
  std::uint32_t max_sessions_per_uid = 256;
  std::uint32_t max_registrations_per_uid = 16;
  std::uint64_t max_items_per_uid = 1u << 20;
  // A connection with no call for this long is closed (0: never); clients reconnect by
  // themselves on their next call.
  std::uint32_t idle_timeout_s = 600;
  // Committed versions kept per job: after each commit, older committed versions beyond the
  // newest `keep_last` are deleted. 0 keeps every version.
  std::uint32_t keep_last = 0;
  // With keep_last, also keep every committed version that is a multiple of this (0: none).
  std::uint32_t keep_every = 0;
  // Differential versions on the persistent tier (daemon/pipeline/differential.h): a shard
  // promoted from the local tier is written with only its changed items when a base version
  // fewer than this many versions older holds the others. 0: every shard is written whole.
  std::uint32_t persistent_base_every = 0;
  // A trainer's restart (a new registration of a rank whose trainer exited) first waits
  // for the rank's newest version in flight to settle, so that the restart can restore it
  // ("newest"), or restores the newest version committed by then at once, giving up the
  // versions in flight ("none"). See docs/DESIGN-NOTES.md, "A restart waits for what it
  // will restore, not for older versions".
  bool restart_waits_newest = true;
  // Verify mode for every registration: each version is checked, at the trainer's wait,
  // against the checksums of its copy, and aborted if its memory changed (see Session).
  bool verify_snapshots = false;
  // Largest total of blob bytes one snapshot may carry.
  std::uint64_t max_blob_mib = 256;
  // trace, debug, info, warn, error.
  std::string log_level = "info";
  // Append the log to this file instead of stdout/stderr ("": none); SIGHUP reopens it.
  std::string log_file;
  // --check-config: validate, print `effective`, exit 0 (or 2 with the error).
  bool check_config = false;
  // Every configurable option in force, as `key = value` lines (what --check-config prints;
  // a reload compares two of these to name the keys that changed).
  std::string effective;
  // If >= 0, write "ready\n" to this fd once serving, then close it (for tests and
  // launchers). systemd's NOTIFY_SOCKET is honoured independently.
  int ready_fd = -1;
  // Metrics (docs/ops/metrics.md): serve GET /metrics on this ADDR:PORT (empty: off; port 0
  // picks a free one, logged), and/or write them to this file every metrics_interval_s and
  // at shutdown, atomically, for node_exporter's textfile collector (empty: off).
  std::string metrics_listen;
  std::string metrics_textfile;
  std::uint32_t metrics_interval_s = 15;
  // Peer replication of the memory tier (daemon/replication/, DESIGN-NOTES "Peer
  // replication"). Each shard captured here is sent to `replicas` peers (0: off); the peers
  // are the next `replicas` entries after this daemon's own in `peers` (cyclically). `peers`
  // is every daemon's --peer-listen address in one order shared by all of them (a
  // comma-separated list in the flag), this daemon's own included; "slurm" takes the
  // hosts of $SLURM_JOB_NODELIST (sorted as Slurm lists them) with the port of
  // `peer_listen`. `peer_listen` is ADDR:PORT of the daemon-to-daemon gRPC server; the
  // entry of `peers` equal to it (or, for a 0.0.0.0/[::] address, the one with this host's
  // name and that port) is this daemon. `peer_secret`: a file only this user may read (mode
  // 0600 or 0400, owned by the daemon's uid) holding the secret all the daemons share.
  std::uint32_t replicas = 0;
  std::string peer_listen;
  std::vector<std::string> peers;
  std::string peer_secret;
  // A peer transfer (a fetch for a restore, a replica sent) that moves no byte for this long
  // is given up, and the restore goes on with the next source: a peer that stalls costs a
  // trainer this much, not the call's deadline.
  std::uint32_t peer_progress_timeout_s = 5;
  // With replicas, a version commits once every rank's shard is persisted *and* held by
  // `replicas` peers (each rank's daemon claims it in its `.repl` marker), so a node lost at
  // any moment leaves the newest committed version in its peers' memory. A version whose
  // shards are all persisted but not all replicated this many seconds later commits anyway,
  // recorded as under-replicated (its UNDER_REPLICATED marker, a metric, the error log); 0:
  // never wait for replicas (the commit needs persistence only).
  std::uint32_t replica_commit_timeout_s = 30;
  // Send a replica as a delta on the version the peer already holds of the same rank (the
  // chunks whose checksums changed), not whole: on by default; off, every replica is sent
  // whole (a comparison, or a peer that should not be trusted to keep its base).
  bool replica_deltas = true;
  // Erasure-coded peer redundancy (--erasure K+M; daemon/replication/erasure_group.h): the
  // --peers ring is cut into groups of K+M daemons in its order; each daemon's shards are cut
  // in K chunks folded into parity held by the group's other daemons, so that any M lost
  // daemons' shards of a group are rebuilt from the rest. 0: off. Besides or instead of
  // --replicas.
  std::uint32_t erasure_k = 0;
  std::uint32_t erasure_m = 0;
  // Connections the peer server holds at once: in all, and from one remote address (the
  // rest are closed as they come). 0 for the total: derived from the open-file limit.
  std::uint32_t peer_max_connections = 0;
  std::uint32_t peer_max_connections_per_address = 16;
  // Warm start (daemon/replication/warm_start.h): at start, pull back from peers' memory
  // the shards of every job's newest committed version that peers hold as sent by this
  // daemon's --peers address (the node this one replaces), before its trainers register.
  // Pulls (at start and `ckptctl prefetch --from-peers`) read at most this many MiB/s
  // (0: no cap), so that they leave the network and the peers' CPU to running jobs.
  bool warm_start = false;
  std::uint64_t warm_start_mib_per_s = 512;

  std::uint64_t pool_bytes() const { return pool_mib << 20; }
  std::uint64_t chunk_bytes() const { return chunk_mib << 20; }
  std::uint64_t memory_bytes() const { return memory_mib << 20; }
};

// The default socket path for the current user (also used by the client and ckptctl).
std::string DefaultSocketPath();

// Parses argv. On --help, --version or a bad flag or key prints to stdout/stderr and
// returns nullopt with *exit_code set (0 for --help and --version, 2 for errors).
std::optional<Config> ParseConfig(int argc, char** argv, int* exit_code);
// The same, printing to `out` and `err` (a reload logs what it would print).
std::optional<Config> ParseConfig(int argc, char** argv, int* exit_code, std::ostream& out,
                                  std::ostream& err);
// Parses the text of a config file as --config would read it, without flags. Errors as for
// ParseConfig. Used by the config fuzzer (tests/fuzz/).
std::optional<Config> ParseConfigText(const std::string& text, int* exit_code);

}  // namespace ckpt
