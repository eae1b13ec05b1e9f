// ShardJob: one (job, version, rank) shard on its way from trainer memory to a durable
// file. The snapshot engine fills it, the flush engine writes it, the catalog commits it;
// waiters block on it until it reaches a level or fails.
//
// Thread-safe: progress counters are atomics, the level and error are guarded by a mutex.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "backend/device_copier.h"
#include "backend/region_importer.h"
#include "ckpt/level.h"
#include "common/mutex.h"
#include "common/status.h"
#include "common/unique_fd.h"
#include "daemon/pipeline/item_hasher.h"
#include "format/shard_format.h"

namespace ckpt {

struct MemoryImage;

// Where one item's bytes come from: a region of the trainer, or blob bytes the snapshot
// request carried.
struct ItemSource {
  std::shared_ptr<ImportedRegion> region;  // tensor items
  std::uint64_t region_offset = 0;
  std::shared_ptr<const std::string> blob;  // blob items
};

// The tensor items of one registration (one descriptor-table generation), shared by every
// snapshot taken from it so that a Snapshot call does not copy thousands of items.
struct TensorSet {
  std::vector<ShardItem> items;
  std::vector<ItemSource> sources;
  std::uint64_t bytes = 0;

  // The items planned (offsets, their parts of the header), once per TensorSet: by the first
  // copy thread that needs it, not by the Register or Snapshot call. Every later version of
  // the registration then plans and renders its header in time linear in its blobs.
  Result<std::shared_ptr<const TensorPlan>> Plan() const;

 private:
  mutable std::once_flag plan_once_;
  mutable std::shared_ptr<const TensorPlan> plan_;
  mutable Status plan_status_;
};

// Where a shard goes and how it is copied: decided by snapshot admission, fixed for the
// shard's life.
struct ShardPlacement {
  std::string dir;         // the version directory on its first tier
  bool direct_io = false;  // write it with O_DIRECT
  // The level the flush engine raises the shard to once its file is published: kLocal when
  // it goes to the local tier (promotion to the persistent tier follows), else kPersisted.
  Level publish_level = Level::kPersisted;
  // Device regions: the device they are on (-1: host memory only) and the ordering of the
  // copies against the trainer (null without device events).
  int device = -1;
  std::shared_ptr<VersionSync> sync;
  // Device shards of one copy queue (one registration) are copied in order by a thread of
  // their own (see SnapshotEngine).
  std::string copy_queue;
  // Sealed registrations: the shard is published only once its client sealed it (see
  // ShardJob::Seal). Verify: the copy also hashes every piece of host memory it copies, for
  // the sealing wait to compare with the trainer's memory (see VerifyPiece).
  bool sealed = false;
  bool verify = false;
};

// Verify mode: one piece of a host tensor item as copied (the item's part in one pool
// chunk) and the xxh3-64 of its bytes then.
struct VerifyPiece {
  std::uint32_t item = 0;     // index into the layout's items
  std::uint64_t in_item = 0;  // first byte of the piece within the item
  std::uint64_t length = 0;
  std::uint64_t hash = 0;
};

class ShardJob {
 public:
  // A shard whose items and sources are given (the layout may be planned or not).
  ShardJob(ShardLayout layout, std::vector<ItemSource> sources, ShardPlacement placement);
  ShardJob(ShardLayout layout, std::vector<ItemSource> sources, std::string dir, bool direct_io)
      : ShardJob(std::move(layout), std::move(sources), Placed(std::move(dir), direct_io)) {}
  // A shard of `tensors` followed by `blobs`; the item list is assembled by Prepare().
  ShardJob(ShardMeta meta, std::shared_ptr<const TensorSet> tensors, std::vector<ShardItem> blobs,
           std::vector<ItemSource> blob_sources, ShardPlacement placement);

  // Assembles the item list (if built from a TensorSet), plans the layout and makes the
  // hasher of its items. Called by the copy thread before the first byte is copied;
  // idempotent.
  Status Prepare();
  // Computes the item checksums from the chunks the writers write (valid after Prepare).
  ItemHasher& hasher() { return *hasher_; }

  // Fixed at construction (Prepare() rebuilds the layout, never this).
  const ShardMeta& meta() const { return meta_; }
  ShardLayout& layout() { return layout_; }
  // Bytes of item data (tensors and blobs), known before the layout is planned.
  std::uint64_t data_bytes() const { return data_bytes_; }
  const std::vector<ItemSource>& sources() const { return sources_; }
  // Drops the shard's hold on trainer memory (its item sources, and the TensorSet they come
  // from): the copy thread calls it once the shard is captured or failed. A shard is kept
  // long after (for waiters, commits and status), and a source it kept would keep the
  // trainer's GPU allocation mapped in the daemon after the trainer unregistered or freed it.
  // Copies still queued on a device hold their own reference (DeviceSpan::keep).
  void ReleaseSources();
  // Older shards the Snapshot call that admitted this one stopped holding, often their last
  // reference: freeing a shard frees its item list (thousands of names and shapes), which
  // the call hands to the copy thread instead. The copy thread drops them once this shard
  // is captured or failed (TakeRetired).
  void Retire(std::vector<std::shared_ptr<ShardJob>> older) EXCLUDES(mu_);
  std::vector<std::shared_ptr<ShardJob>> TakeRetired() EXCLUDES(mu_);
  // Directory of the version and the final and temporary paths of the shard.
  const std::string& dir() const { return placement_.dir; }
  const std::string& final_path() const { return final_path_; }
  const std::string& tmp_path() const { return tmp_path_; }
  bool direct_io() const { return placement_.direct_io; }
  Level publish_level() const { return placement_.publish_level; }
  int device() const { return placement_.device; }
  const std::shared_ptr<VersionSync>& sync() const { return placement_.sync; }
  const std::string& copy_queue() const { return placement_.copy_queue; }

  // The open temporary file; opened by the flush engine on the first write.
  UniqueFd& file() { return file_; }
  // Guards the one opening of file().
  std::once_flag& open_once() { return open_once_; }
  Status& open_status() { return open_status_; }

  // Progress, for status: bytes copied out of trainer memory, bytes written.
  std::atomic<std::uint64_t> copied_bytes{0};
  std::atomic<std::uint64_t> written_bytes{0};

  // Called just before its done marker is written on the persistent tier: from then on a
  // commit of its version (by this daemon or seen from another) includes it.
  void MarkPersisted() { persisted_ = true; }
  bool persisted() const { return persisted_; }
  // True to the first caller only: the trainer is told of a failure once.
  bool ClaimErrorReport() { return !error_reported_.exchange(true); }
  // The local tier pinned the shard's version at admission; ReleaseLocalPin() is true to
  // the one caller that must unpin it.
  void MarkLocalPinned() { local_pinned_ = true; }
  bool ReleaseLocalPin() { return local_pinned_.exchange(false); }
  // True to the first caller only: a failure is handled (image dropped, error recorded,
  // session told) once, although two threads can see it: the flush thread checks for a
  // failure after handing the shard to the promoter, which may already have failed it.
  bool ClaimFailureHandling() { return !failure_handled_.exchange(true); }

  // The memory tier's copy of the shard's file image, filled by the writers as they write
  // (null when the memory tier does not keep this version).
  std::shared_ptr<MemoryImage> image;

  // When the Snapshot call arrived, and how long until each level (0 until reached).
  const std::chrono::steady_clock::time_point created = std::chrono::steady_clock::now();
  double MillisTo(Level level) const;

  // Raises the level (never lowers it) and wakes waiters.
  void Reach(Level level);
  // Records the first failure; the level stays where it was. Wakes waiters.
  void Fail(const Status& status);
  // Fail, for a failure of the shard's file (open, write, publish): the writes overlap the
  // copy, so the level reached alone cannot tell a write failure from a copy failure.
  void FailWriting(const Status& status) {
    writing_failed_.store(true, std::memory_order_relaxed);
    Fail(status);
  }
  bool writing_failed() const { return writing_failed_.load(std::memory_order_relaxed); }
  // Fail, for a shard skipped on purpose by the promoter's queue: a newer version
  // (`superseded_by`; 0 when its rank registered again) made it unneeded. Nothing went wrong,
  // so status reports it as skipped, not failed. Nothing happens if it failed first.
  void Skip(const Status& why, std::uint64_t superseded_by) EXCLUDES(mu_);
  // Whether the failure is a skip, and the version that superseded it.
  bool skipped() const EXCLUDES(mu_);
  std::uint64_t superseded_by() const EXCLUDES(mu_);
  bool failed() const;
  Status error() const;
  Level level() const;

  // Blocks until the level is at least `level` (ok), the shard failed (its error), or
  // `deadline` passes (DeadlineExceeded).
  Status WaitFor(Level level, std::chrono::steady_clock::time_point deadline);

  // Every copy is queued on the device and the completion event recorded (sync->Signal).
  void MarkOrdered();
  // Blocks until the shard is ordered or captured (ok; *ordered_only is true when it was
  // not yet captured), failed (its error), or `deadline` passes.
  Status WaitOrdered(std::chrono::steady_clock::time_point deadline, bool* ordered_only);

  // Write accounting between the copy and the writers: every byte is written when the
  // copy is done and no write is pending. Each returns true to the one caller that saw the
  // last write end; that caller then asks ClaimFinish.
  void AddPendingWrite();
  bool WriteDone();
  bool CopyDone();

  // The seal of a sealed registration's shard. The shard is finished (published, or
  // cleaned up if it failed) by one caller, once every byte is written and it is sealed,
  // aborted or failed: ClaimFinish (the flush engine, after the last write) and Seal/Abort
  // (the client's calls) each report whether the caller is that one. A shard of another
  // registration needs no seal.
  bool sealed_registration() const { return placement_.sealed; }
  bool verify() const { return placement_.verify; }
  // Every byte is written: true if the caller must finish the shard now.
  bool ClaimFinish() EXCLUDES(mu_);
  // The client vouches for the version. Ok (and *finish_now if the caller must finish it);
  // the shard's error if it failed or was aborted first. Sealing twice is ok (no finish).
  Status Seal(bool* finish_now) EXCLUDES(mu_);
  // Fails the shard with `why` (code ABORTED): it is never published. FailedPrecondition if
  // it was sealed already; its own error if it failed first. *finish_now as for Seal.
  Status Abort(const Status& why, bool* finish_now) EXCLUDES(mu_);
  bool sealed() const EXCLUDES(mu_);
  bool aborted() const EXCLUDES(mu_);
  // Written, neither sealed nor aborted nor failed: waiting for its client.
  bool awaiting_seal() const EXCLUDES(mu_);

  // Verify mode: the pieces the copy hashed, in copy order (written by the copy thread
  // before the shard is captured, read after). KeepVerifySources, called by the copy thread
  // before the shard is captured, keeps the host regions they came from for Verify.
  std::vector<VerifyPiece> verify_pieces;
  void KeepVerifySources() EXCLUDES(verify_mu_);
  // Once captured: reads every piece from the trainer's memory again and compares it with
  // the copy's hash. Aborted naming the item and the bytes if one differs; then lets go of
  // the regions. Runs once; later calls return the first result.
  Status Verify() EXCLUDES(verify_mu_);

 private:
  static ShardPlacement Placed(std::string dir, bool direct_io) {
    ShardPlacement p;
    p.dir = std::move(dir);
    p.direct_io = direct_io;
    return p;
  }

  const ShardMeta meta_;
  ShardLayout layout_;
  std::uint64_t data_bytes_ = 0;
  std::vector<ItemSource> sources_;
  std::shared_ptr<const TensorSet> tensors_;  // consumed by Prepare()
  std::unique_ptr<ItemHasher> hasher_;        // made by Prepare()
  const ShardPlacement placement_;
  std::string final_path_, tmp_path_;
  std::atomic<bool> persisted_{false};
  std::atomic<bool> error_reported_{false};
  std::atomic<bool> local_pinned_{false};
  std::atomic<bool> failure_handled_{false};
  std::atomic<bool> writing_failed_{false};
  UniqueFd file_;
  std::once_flag open_once_;
  Status open_status_;

  mutable Mutex mu_;
  CondVar changed_;
  Level level_ GUARDED_BY(mu_) = Level::kNone;
  bool ordered_ GUARDED_BY(mu_) = false;
  double reached_ms_[5] GUARDED_BY(mu_) = {0, 0, 0, 0, 0};
  Status error_ GUARDED_BY(mu_);
  int pending_writes_ GUARDED_BY(mu_) = 0;
  std::vector<std::shared_ptr<ShardJob>> retired_ GUARDED_BY(mu_);
  bool copy_done_ GUARDED_BY(mu_) = false;
  bool written_ GUARDED_BY(mu_) = false;
  bool sealed_ GUARDED_BY(mu_) = false;
  bool aborted_ GUARDED_BY(mu_) = false;
  bool skipped_ GUARDED_BY(mu_) = false;
  std::uint64_t superseded_by_ GUARDED_BY(mu_) = 0;
  bool finish_claimed_ GUARDED_BY(mu_) = false;
  Mutex verify_mu_;
  std::vector<ItemSource> verify_sources_ GUARDED_BY(verify_mu_);  // parallel to the items
  std::optional<Status> verified_ GUARDED_BY(verify_mu_);

  // True (once) when the shard is written and may be finished: sealed, aborted or failed,
  // or needing no seal.
  bool ClaimFinishLocked() REQUIRES(mu_);
};

}  // namespace ckpt
