// Replicator: peer replication of the memory tier, the caller's side. Its receiving side is
// PeerServer (peer_service.h), which it starts; the stream of a shard image is shard_stream.h.
//
// Sender (replicator.cc): each shard this daemon captured and published with a memory image
// is sent (whole, or as a delta: see Deltas below) to the peer rule's R holders (PeerList:
// the next R daemons of --peers), over the Peer service (proto/ckpt/v1/peer.proto) in
// pieces with checksums, which reference the image's memory rather than copy it
// (piece_wire.h). One thread sends, at the lowest CPU
// priority (nice 19), one piece in flight per stream (gRPC's flow control bounds the bytes in
// flight to the window), and it yields to the trainer's data path: while the host pool holds
// more than a quarter of its bytes (copies and flushes in flight) it waits 3 ms between
// pieces of 1 MiB. A newer version of a (job, rank) supersedes one still queued. A holder
// that refuses or cannot be reached is replaced by the next daemon of the ring that does not
// hold the shard yet, so R copies exist whenever R peers can take them.
//
// Deltas (replicator_delta.cc): per (peer, job, rank), the newest version the peer
// acknowledged, with its registration and item table. The next version of that rank goes to
// that peer as a delta on it (shard_stream.h's DeltaPlan: the header and the items that
// changed) when the registration is the same and at least one item is the same; the whole
// image goes otherwise, and once more after a delta the peer refused with
// FAILED_PRECONDITION (it no longer holds the base). The entry is forgotten when the peer
// drops the job's replicas (DropJob, DropNewer) and on any failed send to it.
//
// Restore side (PeerShards, replicator_restore.cc): asks the peers which hold a shard, reads
// an image back (GetShard), own or replica, into a buffer of its own, without piece
// checksums: the image's MAC is checked as it arrives, and the restore verifies the header
// and every item it reads. AnyHolds and DropNewer pass over a peer that did not answer a
// moment ago. For a warm start (warm_start.h): ReplicasSentFrom asks a peer which replicas
// of a job it holds from this daemon's address, and FetchWith reads one into a buffer the
// caller gives (the memory tier's), reporting each piece.
//
// Trust: whatever listens on a peer's address may be something else than that peer's
// daemon. Every answer this daemon acts on (an acknowledgement, "held", a dropped count, an
// image) must carry the callee's proof of the secret bound to this call's nonce
// (PeerSecret); one without is ignored like a peer that did not answer, counted
// (ckptd_replication_events_total{event="unproven"}) and logged at most once a second.
//
// Level `replicated` (WaitReplicated): reached when R peers acknowledged the shard, after
// verifying it, each proving it knows the secret.
//
// Where this daemon's shards are (ReplicaMapOf, JobReplicationOf): the peers that
// acknowledged each (job, version, rank), kept per rank for the versions a holder keeps
// (--memory-versions + 1, and after a commit what the holder's retention keeps), forgotten
// where this daemon had them dropped (DropJob, DropNewer).
// A holder may still drop a replica on its own (its budget, its retention): the map says what
// was acknowledged, not what is held now. After a restart it is empty; ReplicaMapOf rebuilds
// a job's part from the peers' ListReplicas the first time it is asked. What each peer holds
// of this daemon's shards in bytes (Peers: sent_bytes_held) is what the peer last said, with
// when: on each acknowledgement and in its answer to a DropJob. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "common/mutex.h"
#include "common/status.h"
#include "daemon/base/config.h"
#include "daemon/base/peer_list.h"
#include "daemon/base/peer_secret.h"
#include "daemon/base/throttled_log.h"
#include "daemon/replication/peer_service.h"
#include "daemon/replication/shard_stream.h"
#include "daemon/tiers/memory_tier.h"
#include "daemon/pipeline/tier_set.h"

namespace grpc {
class Channel;
class ClientContext;
class Status;
}  // namespace grpc

namespace ckpt::v1 {
class HasShardReply;
}  // namespace ckpt::v1

namespace ckpt {

class ErasureGroup;
class ParityStore;

class Replicator : public PeerShards {
 public:
  struct Hooks {
    std::function<void(const std::string&)> error;  // a failure worth the error log
    std::function<std::uint64_t()> pool_used;       // bytes the host pool holds now
    std::uint64_t pool_bytes = 0;
    // R peers hold the shard: hands it to the claim that may make its version restorable
    // (ReplicaClaims::Submit, written on its own thread); the shard's `replicated` level is
    // reported at once, whatever the claim's fate.
    std::function<void(const ShardMeta&)> replicated;
  };
  // Reads the secret, resolves the peers and starts the server and the sender.
  // InvalidArgument for a configuration error (exit 2).
  // `parity`: the parity store the peer server folds erasure chunks into (--erasure), or null.
  static Result<std::unique_ptr<Replicator>> Create(const Config& config, MemoryTier& memory, Hooks hooks,
                                                    ParityStore* parity = nullptr);
  // With --erasure too: a rebuild from the group is the restore source after the replicas
  // (Holding names ErasureGroup::kSource last; Fetch and DropNewer pass it on).
  void SetErasure(ErasureGroup* erasure) { erasure_ = erasure; }
  ~Replicator() override;
  // Stops the server and the sender (what is queued is not sent). Idempotent.
  void Stop() EXCLUDES(mu_);

  std::uint32_t replicas() const { return peers_.replicas; }
  const PeerList& peers() const { return peers_; }
  // The address the server is bound to ("127.0.0.1:7001").
  const std::string& bound() const { return bound_; }

  // This daemon published `image`'s shard (complete): send it to the holders.
  void Enqueue(std::shared_ptr<MemoryImage> image) EXCLUDES(mu_);
  // The shard will not be sent (no memory image, or it failed): its waits hear why.
  void NotReplicable(const ShardMeta& meta, const std::string& why) EXCLUDES(mu_);
  // Until R peers hold (job, version, rank) (ok), its replication failed (the error), or
  // `deadline` passes (DeadlineExceeded).
  Status WaitReplicated(const std::string& job, std::uint64_t version, std::uint32_t rank,
                        std::chrono::steady_clock::time_point deadline) EXCLUDES(mu_);
  // The job is finished (FinishJob, or the last session of it unregistered as finished):
  // every peer is told to drop the replicas of it this daemon sent (every peer of the ring,
  // not only those that acknowledged one since this daemon started, which a restart forgets).
  // A job that merely lost its sessions (a crash, a failed collective) keeps them: they are
  // what its restart restores from.
  struct JobDropped {
    std::uint32_t told = 0;     // peers asked
    std::uint32_t dropped = 0;  // peers that answered, proven
  };
  JobDropped OnJobFinished(const std::string& job) EXCLUDES(mu_);

  // PeerShards.
  std::vector<std::string> Holding(const std::string& job, std::uint64_t version, std::uint32_t rank) override;
  bool AnyHolds(const std::string& job, std::uint64_t version, std::uint32_t rank,
                const std::string& registration) override;
  void DropNewer(const std::string& job, std::uint32_t rank, std::uint64_t version) override;
  Result<std::shared_ptr<MemoryImage>> Fetch(const std::string& peer, const std::string& job, std::uint64_t version,
                                             std::uint32_t rank) override;

  // A fetch as a warm start makes it (FetchWith): where the image goes, and what runs as
  // its pieces arrive.
  struct FetchOptions {
    // The image to receive into (null with the refusal set: no room); unset: a buffer
    // outside the memory tier's budget, as a restore's fetch.
    MakeImage make;
    // With the image bytes of each piece once it is in the image (progress, and a rate limit
    // that may sleep here: the wait does not count as the peer's stall).
    std::function<void(std::uint64_t bytes)> on_piece;
    // Set: the transfer is cancelled (the daemon stops).
    const std::atomic<bool>* cancel = nullptr;
  };
  // Fetch with `options`; the bytes count as fetched for a restore only when options.make is
  // unset (a warm start counts its own).
  Result<std::shared_ptr<MemoryImage>> FetchWith(const std::string& peer, const std::string& job,
                                                 std::uint64_t version, std::uint32_t rank,
                                                 const FetchOptions& options);
  // The complete replicas of `job` that `peer` holds as sent by this daemon's address
  // (ListReplicas), proven; an error saying why if the peer cannot say.
  struct ReplicaHeld {
    std::uint64_t version = 0;
    std::uint32_t rank = 0;
    std::uint64_t file_bytes = 0;
  };
  Result<std::vector<ReplicaHeld>> ReplicasSentFrom(const std::string& peer, const std::string& job);

  struct PeerInfo {
    std::string address;
    std::uint64_t held_bytes = 0;       // replicas this daemon holds that it sent
    std::uint64_t sent_bytes_held = 0;  // this daemon's replicas it holds, as it last said
    // When it said so; the epoch: not since this daemon started (sent_bytes_held unknown).
    std::chrono::system_clock::time_point sent_said_at{};
    bool holder = false;
    std::string error;
  };
  std::vector<PeerInfo> Peers() EXCLUDES(mu_);
  // Where the replicas of this daemon's shards of `job` are: per (version, rank), the peers
  // holding one. From the acknowledgements since this daemon started; when it has none for the
  // job (a restart), or `ask_peers`, asked of every peer (ListReplicas, kHasDeadline each).
  struct ReplicaMap {
    std::map<std::pair<std::uint64_t, std::uint32_t>, std::vector<std::string>> holders;
    std::string source;                   // "acknowledged", "listed" or "unknown" (ckpt.proto)
    std::vector<std::string> unanswered;  // "ADDRESS: why", peers that could not say
  };
  ReplicaMap ReplicaMapOf(const std::string& job, bool ask_peers) EXCLUDES(mu_);
  // Whether the ranks of `version` of `job` that this daemon sent to peers are each held by
  // R of them, as far as the acknowledgements say (no peer is asked).
  struct RankHolders {
    std::uint32_t rank = 0;
    std::vector<std::string> peers;
    std::string error;  // why it is short of R, if it is and the send said why
  };
  std::vector<RankHolders> JobReplicationOf(const std::string& job, std::uint64_t version) EXCLUDES(mu_);
  // `version` of `job` committed: the replica map forgets, per rank, what a holder that saw
  // the commit drops (it keeps the newest --memory-versions committed replicas and newer ones).
  void OnCommitted(const std::string& job, std::uint64_t version) EXCLUDES(mu_);
  // The jobs this daemon replicated a shard of since it started, sorted.
  std::vector<std::string> ReplicatedJobs() EXCLUDES(mu_);
  std::uint64_t replicated_shards() const { return replicated_; }
  std::uint64_t failures() const { return failures_; }

 private:
  using Key = std::tuple<std::string, std::uint64_t, std::uint32_t>;  // job, version, rank
  struct State {
    std::uint32_t acks = 0;
    bool done = false;  // acks == R, or failed
    Status error;
  };
  Replicator(PeerList peers, PeerSecret secret, MemoryTier& memory, Hooks hooks,
             std::chrono::milliseconds progress_timeout, bool deltas);
  void SendLoop() EXCLUDES(mu_);
  // Sends one image to `peer`; *held: the peer's replica bytes for this daemon after it. The
  // pieces in flight reference the image's memory, so they hold a reference to it.
  // A delta (`delta.base_version` set) sends only its ranges.
  Status SendTo(const std::string& peer, const std::shared_ptr<MemoryImage>& image, std::uint64_t* held,
                const DeltaPlan& delta);
  // Sends `image` (its header parsed into `items`, ending at `header_end`; items empty: not
  // parsed, no delta) to `peer`: as a delta when DeltaBaseFor says so, whole otherwise and
  // after a delta refused for its base; remembers the version as the peer's next base once
  // acknowledged, forgets the peer's base of the rank on any failure.
  Status SendShard(const std::string& peer, const std::shared_ptr<MemoryImage>& image,
                   const std::vector<ItemSpan>& items, std::uint64_t header_end, std::uint64_t* held)
      EXCLUDES(mu_);
  // The delta to send `meta`'s version to `peer` as (base_version 0: the whole image).
  DeltaPlan DeltaBaseFor(const std::string& peer, const ShardMeta& meta, const std::vector<ItemSpan>& items,
                         std::uint64_t header_end) EXCLUDES(mu_);
  // `peer` acknowledged `meta`'s version, whose items are `items`: its next base.
  void NoteDeltaBase(const std::string& peer, const ShardMeta& meta, std::vector<ItemSpan> items) EXCLUDES(mu_);
  // Forgets the bases of `job` (of `rank` only, unless it is kAllRanks) that `peer` (every
  // peer if empty) holds.
  static constexpr std::uint32_t kAllRanks = ~std::uint32_t{0};
  void ForgetDeltaBases(const std::string& peer, const std::string& job, std::uint32_t rank) EXCLUDES(mu_);
  void Pace();
  // The deadline of a HasShard, DropNewer or DropJob call.
  static constexpr std::chrono::seconds kHasDeadline{3};
  // Whether `peer` failed to answer a HasShard or DropNewer within the last kSilentFor, and
  // noting whether it answered (AnyHolds, DropNewer).
  static constexpr std::chrono::seconds kSilentFor{5};
  bool RecentlySilent(const std::string& peer) EXCLUDES(mu_);
  void NoteAnswer(const std::string& peer, bool answered) EXCLUDES(mu_);
  // One HasShard call to `peer` (kHasDeadline).
  grpc::Status AskHasShard(const std::string& peer, const std::string& job, std::uint64_t version,
                           std::uint32_t rank, v1::HasShardReply* reply);
  std::shared_ptr<grpc::Channel> ChannelTo(const std::string& peer) EXCLUDES(mu_);
  void Finish(const Key& key, Status st, std::uint32_t acks) EXCLUDES(mu_);
  void NoteError(const std::string& peer, const std::string& error) EXCLUDES(mu_);
  // `peer` acknowledged (job, version, rank), saying it holds `held` bytes of this daemon's
  // replicas: the map and the count follow.
  void NoteAcknowledged(const std::string& peer, const Key& key, std::uint64_t held) EXCLUDES(mu_);
  // `peer` dropped this daemon's replicas of `job` and holds `held` bytes of its others.
  void NoteDropped(const std::string& peer, const std::string& job, std::uint64_t held) EXCLUDES(mu_);
  // The versions of (job, rank) above `version` are being dropped everywhere (DropNewer).
  void ForgetNewer(const std::string& job, std::uint32_t rank, std::uint64_t version) EXCLUDES(mu_);
  // `peer` answered without proof of the secret (`why`): counted and logged (throttled);
  // returns PermissionDenied with `why`'s message.
  Status Unproven(const std::string& peer, const Status& why);
  // The proof a reply carried (trailing metadata), or "".
  static std::string ProofOf(const grpc::ClientContext& ctx);
  // Why a transfer with `peer` was given up after `limit` without progress (ProgressWatch).
  static std::string Stalled(const std::string& peer, std::chrono::milliseconds limit);

  const PeerList peers_;
  const PeerSecret secret_;
  MemoryTier& memory_;
  const Hooks hooks_;
  const std::chrono::milliseconds progress_timeout_;  // --peer-progress-timeout-s
  const bool deltas_;  // --replica-deltas
  std::string bound_;
  std::unique_ptr<PeerServer> server_;
  ErasureGroup* erasure_ = nullptr;  // set once, before any restore
  std::atomic<std::uint64_t> replicated_{0}, failures_{0};
  ThrottledLog unproven_log_, send_log_;

  Mutex mu_;
  CondVar changed_;
  bool stopping_ GUARDED_BY(mu_) = false;
  // Shards to send. The queue does not hold their images: one the memory tier drops before
  // it is sent (a newer committed version replaced it) is not worth sending, and its
  // buffer must not stay out of the budget meanwhile.
  struct Queued {
    ShardMeta meta;
    std::weak_ptr<MemoryImage> image;
  };
  std::deque<Queued> queue_ GUARDED_BY(mu_);
  std::map<Key, State> states_ GUARDED_BY(mu_);
  std::deque<Key> state_order_ GUARDED_BY(mu_);  // oldest first, to bound states_
  std::map<std::string, std::shared_ptr<grpc::Channel>> channels_ GUARDED_BY(mu_);
  // Per peer, the replica bytes of this daemon's shards it said it holds, and when.
  struct Said {
    std::uint64_t bytes = 0;
    std::chrono::system_clock::time_point at{};
  };
  std::map<std::string, Said> sent_held_ GUARDED_BY(mu_);
  // The replica map (see the top): per (job, version, rank), the peers that acknowledged it.
  std::map<Key, std::vector<std::string>> holders_ GUARDED_BY(mu_);
  // Jobs whose part of holders_ is known: acknowledged or listed since this daemon started.
  std::set<std::string> mapped_jobs_ GUARDED_BY(mu_);
  // Per job, the versions this daemon saw commit (the newest kCommitsKept).
  std::map<std::string, std::set<std::uint64_t>> committed_ GUARDED_BY(mu_);
  // Deltas (see the top): per (peer, job, rank), the newest version the peer acknowledged.
  struct DeltaBase {
    std::uint64_t version = 0;
    std::string session;          // its registration: a delta never crosses one
    std::vector<ItemSpan> items;  // its header's items
  };
  std::map<std::tuple<std::string, std::string, std::uint32_t>, DeltaBase> delta_bases_ GUARDED_BY(mu_);
  std::map<std::string, std::string> peer_error_ GUARDED_BY(mu_);
  // When a send to the peer last failed (erased by a success): see SendTo.
  std::map<std::string, std::chrono::steady_clock::time_point> send_failed_at_ GUARDED_BY(mu_);
  // When a HasShard or DropNewer to the peer last failed (erased by an answer): RecentlySilent.
  std::map<std::string, std::chrono::steady_clock::time_point> has_failed_at_ GUARDED_BY(mu_);
  std::thread sender_;
};

}  // namespace ckpt
