// ErasureGroup: erasure-coded peer redundancy of the memory tier (ckptd --erasure K+M),
// besides or instead of full replicas (replicator.h).
//
// The group. --peers is cut, in its order, into groups of K+M daemons; this daemon's group
// is the one holding it, and its position there (0..K+M-1) fixes its part. Every daemon
// numbers the shards of one version of a job it publishes 0, 1, ... (its slots: the j-th
// one to be published). Slot j of a version has K+M stripes; stripe s gathers, at data
// positions c = 0..K-1, chunk c of the j-th shard of the daemon at position (s + M + c) mod
// (K+M), and its M parity rows are held by the daemons at (s + j) mod (K+M), j < M. A shard
// image of L bytes is cut in K chunks of ceil(L / K) rounded up to 64 bytes (zeros past its
// end); each goes to the M holders of its stripe, which fold it into their row
// (parity_store.h). So each daemon keeps its own shards, sends K chunks to each of M
// holders (M times its shard's bytes on the network, as M replicas would), and holds M
// parity rows of about 1/K of a shard: M/K of a replica's memory. Any M lost daemons of a
// group lose at most M members of any stripe, which the rest rebuild.
//
// Sender (a thread of its own, at the lowest CPU priority, like the replicator's): each
// shard this daemon published with a memory image, its K chunks checksummed (xxh3-64) and
// sent to their holders (PutChunk), each chunk's bytes under an HMAC of the shared secret
// bound to the call and to the chunk's member entry (job, version, slot, stripe, position,
// rank, registration, origin, sizes, checksum), each acknowledgement proven. A newer
// version of a (job, rank) supersedes one still queued. A send that fails is counted and
// logged; the next version is protected anew.
//
// Rebuild (Fetch, a restore source between this daemon's memory and the persistent tier:
// Holding names kSource after the replicas' holders): for each of the K stripes holding one
// of this daemon's chunks of the shard, the parity rows from their holders (GetParity, with
// the stripe's member entries), each checked against its MAC and its checksum (a row that
// fails is missing), and the other members' chunks from their daemons' memory (GetChunk,
// each checked against the checksum its member entry records); then the lost chunk is
// decoded (ErasureCode::Rebuild) and checked against its own recorded checksum, so a stripe
// with other bytes than the shard's can never be decoded into it. The restore then checks
// the header and every item, as for any source. Fewer than K intact members of a stripe:
// DataLoss naming what was missing or corrupt, and the restore reads the next source.
//
// What is not done: the parity a lost daemon held is not re-encoded for the versions
// before its replacement joined (the next version the job writes is encoded over the whole
// group again); the parity is held beside --memory-mib, under a cap of its own
// (parity_store.h). Thread-safe.
#pragma once

#include <atomic>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/base/config.h"
#include "daemon/base/peer_secret.h"
#include "daemon/base/throttled_log.h"
#include "daemon/pipeline/tier_set.h"
#include "daemon/replication/parity_store.h"
#include "daemon/replication/peer_service.h"
#include "daemon/tiers/memory_tier.h"

namespace grpc {
class Channel;
class ClientContext;
}  // namespace grpc

namespace ckpt {

class ErasureGroup : public PeerShards {
 public:
  // The restore source a rebuild is, as Holding names it.
  static constexpr const char* kSource = "erasure-rebuild";

  // Resolves the group, and starts a peer server of its own when `start_server` (no
  // replicator serves --peer-listen). `error`: a failure worth the error log.
  // InvalidArgument for a configuration error (exit 2).
  static Result<std::unique_ptr<ErasureGroup>> Create(const Config& config, MemoryTier& memory, bool start_server,
                                                      std::function<void(const std::string&)> error);
  ~ErasureGroup() override;
  // Stops the sender (what is queued is not sent) and the server it started. Idempotent.
  void Stop() EXCLUDES(mu_);

  // The parity this daemon holds (the peer server folds chunks into it).
  ParityStore* store() { return &store_; }
  const ErasureGeometry& geometry() const { return store_.geometry(); }
  // "4+1, position 2 of group 0 (127.0.0.1:7001, ...)".
  std::string Describe() const;

  // This daemon published `image`'s shard: send its chunks to their holders.
  void Enqueue(std::shared_ptr<MemoryImage> image) EXCLUDES(mu_);
  // The job finished: every daemon of the group drops its parity (DropParity).
  void OnJobFinished(const std::string& job) EXCLUDES(mu_);
  // `version` of `job` committed: the parity held for it follows the memory tiers' retention.
  void OnCommitted(const std::string& job, std::uint64_t version);

  // PeerShards.
  std::vector<std::string> Holding(const std::string& job, std::uint64_t version, std::uint32_t rank) override;
  Result<std::shared_ptr<MemoryImage>> Fetch(const std::string& peer, const std::string& job, std::uint64_t version,
                                             std::uint32_t rank) override;
  bool AnyHolds(const std::string&, std::uint64_t, std::uint32_t, const std::string&) override { return false; }
  // A restore of `version` left the timeline above it: the queued sends above it are dropped,
  // and every daemon of the group drops its parity above it (once per job and version).
  void DropNewer(const std::string& job, std::uint32_t rank, std::uint64_t version) override EXCLUDES(mu_);

  // The shard rebuilt from the group (what Fetch(kSource, ...) does). One stripe at a time:
  // the memory it takes beside the image is about (K + M + 1) / K of the shard.
  Result<std::shared_ptr<MemoryImage>> Rebuild(const std::string& job, std::uint64_t version, std::uint32_t rank);

  struct Counters {
    std::uint64_t chunks_sent = 0;
    std::uint64_t send_failures = 0;
    std::uint64_t rebuilds = 0;
    std::uint64_t rebuild_failures = 0;
    std::uint64_t corrupt_fragments = 0;  // parity rows or chunks that failed their checks
    std::uint64_t pending = 0;            // shards queued or being sent
  };
  Counters counters() EXCLUDES(mu_);
  std::uint64_t parity_bytes() const { return store_.parity_bytes(); }

 private:
  ErasureGroup(ErasureCode code, ErasureGeometry geometry, std::uint32_t versions_kept, std::uint64_t max_parity_bytes,
               PeerSecret secret, std::chrono::milliseconds progress_timeout,
               std::function<void(const std::string&)> error);
  void SendLoop() EXCLUDES(mu_);
  Status SendShard(const std::shared_ptr<MemoryImage>& image, std::uint32_t slot);
  Status SendChunk(const std::string& holder, const v1::StripeMember& member, const char* data, std::uint64_t n);
  std::uint32_t SlotOf(const ShardMeta& meta) EXCLUDES(mu_);
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& peer) EXCLUDES(mu_);
  // One stripe's parity row from `holder` (GetParity), checked; *members: its member entries.
  struct Row {
    unsigned row = 0;
    std::vector<v1::StripeMember> members;
    std::vector<std::uint8_t> bytes;
  };
  Result<Row> ReadParity(const std::string& holder, const std::string& job, std::uint64_t version, unsigned stripe,
                         std::uint32_t rank);
  // Bytes [offset, offset + length) of (job, version, rank)'s image on `peer` (GetChunk), checked.
  Result<std::vector<std::uint8_t>> ReadRange(const std::string& peer, const std::string& job, std::uint64_t version,
                                              std::uint32_t rank, std::uint64_t offset, std::uint64_t length);
  void Note(const std::string& message);
  // Asks every other daemon of the group to drop its parity of `job` above `version` (every
  // version with `all`); one that does not answer within 3 s is logged.
  void TellGroupToDrop(const std::string& job, std::uint64_t version, bool all);
  Result<std::shared_ptr<MemoryImage>> RebuildShard(const std::string& job, std::uint64_t version,
                                                    std::uint32_t rank);
  // Whether a GetParity reply's member entries fit the stripe asked for and each other, and
  // the parity's size is what they imply.
  Status CheckMembers(const v1::ParityPiece& first, const std::string& job, std::uint64_t version,
                      unsigned stripe) const;

  ParityStore store_;
  const PeerSecret secret_;
  const std::chrono::milliseconds progress_timeout_;  // --peer-progress-timeout-s
  const std::function<void(const std::string&)> error_;
  std::unique_ptr<PeerServer> server_;
  ThrottledLog log_;
  std::atomic<std::uint64_t> chunks_sent_{0}, send_failures_{0}, rebuilds_{0}, rebuild_failures_{0}, corrupt_{0};

  Mutex mu_;
  CondVar changed_;
  bool stopping_ GUARDED_BY(mu_) = false;
  struct Queued {
    ShardMeta meta;
    std::weak_ptr<MemoryImage> image;
  };
  std::deque<Queued> queue_ GUARDED_BY(mu_);
  bool busy_ GUARDED_BY(mu_) = false;  // the sender is sending a shard
  // Per (job, version), the slot of each rank published, in publishing order.
  std::map<std::pair<std::string, std::uint64_t>, std::map<std::uint32_t, std::uint32_t>> slots_ GUARDED_BY(mu_);
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ GUARDED_BY(mu_);
  // Per job, the version the group was last told to drop the parity above (DropNewer): the
  // ranks of a restore ask once each, the group is told once.
  std::map<std::string, std::uint64_t> dropped_above_ GUARDED_BY(mu_);
  grpc::ClientContext* sending_ GUARDED_BY(mu_) = nullptr;  // the PutChunk in flight (Stop cancels it)
  std::string sending_job_ GUARDED_BY(mu_);                  // the shard being sent
  std::uint64_t sending_version_ GUARDED_BY(mu_) = 0;
  // Per job, bumped by DropNewer: a shard being sent checks it before each chunk.
  std::map<std::string, std::uint64_t> generation_ GUARDED_BY(mu_);
  std::thread sender_;
};

}  // namespace ckpt
