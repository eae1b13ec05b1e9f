#include "daemon/pipeline/shard_job.h"

#include <unistd.h>

#include <utility>

#include "common/names.h"
#include "format/checksum.h"
#include "format/paths.h"

namespace ckpt {

ShardJob::ShardJob(ShardLayout layout, std::vector<ItemSource> sources, ShardPlacement placement)
    : meta_(layout.meta()),
      layout_(std::move(layout)),
      sources_(std::move(sources)),
      placement_(std::move(placement)) {
  // Unique per shard object: a crashed trainer's version still in flight and a new
  // snapshot of the same version never write the same temporary file.
  static std::atomic<std::uint64_t> serial{0};
  final_path_ = JoinPath(placement_.dir, ShardFileName(meta_.rank));
  tmp_path_ = final_path_ + "." + std::to_string(::getpid()) + "-" + std::to_string(serial.fetch_add(1)) +
              TmpSuffix();
  for (const auto& item : layout_.items()) data_bytes_ += item.length;
}

ShardJob::ShardJob(ShardMeta meta, std::shared_ptr<const TensorSet> tensors, std::vector<ShardItem> blobs,
                   std::vector<ItemSource> blob_sources, ShardPlacement placement)
    : ShardJob(ShardLayout::Unplanned(std::move(meta), std::move(blobs)), std::move(blob_sources),
               std::move(placement)) {
  tensors_ = std::move(tensors);
  data_bytes_ += tensors_->bytes;
}

Result<std::shared_ptr<const TensorPlan>> TensorSet::Plan() const {
  std::call_once(plan_once_, [this] {
    auto plan = TensorPlan::Make(items);
    if (plan.ok()) {
      plan_ = std::move(plan).value();
    } else {
      plan_status_ = plan.status();
    }
  });
  if (!plan_status_.ok()) return plan_status_;
  return plan_;
}

Status ShardJob::Prepare() {
  if (tensors_) {
    auto plan = tensors_->Plan();
    if (!plan.ok()) return plan.status();
    std::vector<ItemSource> sources;
    sources.reserve(tensors_->sources.size() + sources_.size());
    sources.insert(sources.end(), tensors_->sources.begin(), tensors_->sources.end());
    for (auto& src : sources_) sources.push_back(std::move(src));
    layout_ = ShardLayout::Unplanned(meta_, std::move(plan).value(), std::move(layout_.items()));
    sources_ = std::move(sources);
    tensors_.reset();
  }
  if (!layout_.planned()) {
    if (Status s = layout_.PlanInPlace(); !s.ok()) return s;
  }
  if (!hasher_) hasher_ = std::make_unique<ItemHasher>(layout_.items());
  return Status::Ok();
}

void ShardJob::ReleaseSources() {
  std::vector<ItemSource>().swap(sources_);
  tensors_.reset();
}

void ShardJob::Retire(std::vector<std::shared_ptr<ShardJob>> older) {
  MutexLock lock(mu_);
  for (auto& shard : older) {
    if (shard) retired_.push_back(std::move(shard));
  }
}

std::vector<std::shared_ptr<ShardJob>> ShardJob::TakeRetired() {
  MutexLock lock(mu_);
  return std::exchange(retired_, {});
}

void ShardJob::Reach(Level level) {
  {
    MutexLock lock(mu_);
    if (level > level_) {
      double ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - created).count();
      for (int l = static_cast<int>(level_) + 1; l <= static_cast<int>(level); ++l) reached_ms_[l] = ms;
      level_ = level;
    }
  }
  changed_.SignalAll();
}

void ShardJob::Fail(const Status& status) {
  {
    MutexLock lock(mu_);
    if (error_.ok()) error_ = status;
  }
  changed_.SignalAll();
}

void ShardJob::Skip(const Status& why, std::uint64_t superseded_by) {
  {
    MutexLock lock(mu_);
    if (!error_.ok()) return;
    error_ = why;
    skipped_ = true;
    superseded_by_ = superseded_by;
  }
  changed_.SignalAll();
}

bool ShardJob::skipped() const {
  MutexLock lock(mu_);
  return skipped_;
}

std::uint64_t ShardJob::superseded_by() const {
  MutexLock lock(mu_);
  return superseded_by_;
}

bool ShardJob::failed() const {
  MutexLock lock(mu_);
  return !error_.ok();
}

Status ShardJob::error() const {
  MutexLock lock(mu_);
  return error_;
}

double ShardJob::MillisTo(Level level) const {
  MutexLock lock(mu_);
  return reached_ms_[static_cast<int>(level)];
}

Level ShardJob::level() const {
  MutexLock lock(mu_);
  return level_;
}

Status ShardJob::WaitFor(Level level, std::chrono::steady_clock::time_point deadline) {
  MutexLock lock(mu_);
  while (level_ < level && error_.ok()) {
    if (!changed_.WaitUntil(mu_, deadline)) break;
  }
  if (level_ >= level) return Status::Ok();
  if (!error_.ok()) return error_;
  return DeadlineExceeded("version " + std::to_string(meta_.version) + " did not reach the level in time");
}

void ShardJob::MarkOrdered() {
  {
    MutexLock lock(mu_);
    ordered_ = true;
  }
  changed_.SignalAll();
}

Status ShardJob::WaitOrdered(std::chrono::steady_clock::time_point deadline, bool* ordered_only) {
  MutexLock lock(mu_);
  while (level_ < Level::kCaptured && !ordered_ && error_.ok()) {
    if (!changed_.WaitUntil(mu_, deadline)) break;
  }
  *ordered_only = false;
  if (level_ >= Level::kCaptured) return Status::Ok();
  if (!error_.ok()) return error_;
  if (ordered_) {
    *ordered_only = true;
    return Status::Ok();
  }
  return DeadlineExceeded("the copies of version " + std::to_string(meta_.version) +
                          " were not queued in time");
}

void ShardJob::AddPendingWrite() {
  MutexLock lock(mu_);
  ++pending_writes_;
}

bool ShardJob::WriteDone() {
  MutexLock lock(mu_);
  return --pending_writes_ == 0 && copy_done_;
}

bool ShardJob::CopyDone() {
  MutexLock lock(mu_);
  copy_done_ = true;
  return pending_writes_ == 0;
}

bool ShardJob::ClaimFinishLocked() {
  if (finish_claimed_ || !written_) return false;
  if (placement_.sealed && !sealed_ && error_.ok()) return false;
  finish_claimed_ = true;
  return true;
}

bool ShardJob::ClaimFinish() {
  MutexLock lock(mu_);
  written_ = true;
  return ClaimFinishLocked();
}

Status ShardJob::Seal(bool* finish_now) {
  *finish_now = false;
  MutexLock lock(mu_);
  if (!error_.ok()) return error_;
  if (sealed_) return Status::Ok();
  sealed_ = true;
  *finish_now = ClaimFinishLocked();
  return Status::Ok();
}

Status ShardJob::Abort(const Status& why, bool* finish_now) {
  *finish_now = false;
  {
    MutexLock lock(mu_);
    if (sealed_) {
      return FailedPrecondition("version " + std::to_string(meta_.version) +
                                " was sealed by an earlier wait; a sealed version cannot be aborted");
    }
    if (!error_.ok()) return error_;
    error_ = why;
    aborted_ = true;
    *finish_now = ClaimFinishLocked();
  }
  changed_.SignalAll();
  return Status::Ok();
}

void ShardJob::KeepVerifySources() {
  MutexLock lock(verify_mu_);
  verify_sources_.assign(sources_.size(), ItemSource{});
  for (std::size_t i = 0; i < sources_.size(); ++i) {
    // Device regions are not read again (their copies were not hashed either).
    if (sources_[i].region && sources_[i].region->device() < 0) verify_sources_[i] = sources_[i];
  }
}

Status ShardJob::Verify() {
  MutexLock lock(verify_mu_);
  if (verified_) return *verified_;
  const auto& items = layout_.items();
  constexpr std::size_t kStep = 1 << 20;
  std::vector<char> buf;
  std::uint64_t differing = 0;
  const VerifyPiece* first = nullptr;
  Status unreadable;
  for (const VerifyPiece& piece : verify_pieces) {
    if (piece.item >= verify_sources_.size() || !verify_sources_[piece.item].region) continue;
    const ItemSource& src = verify_sources_[piece.item];
    buf.resize(std::min<std::uint64_t>(kStep, piece.length));
    Checksum sum;
    for (std::uint64_t done = 0; done < piece.length && unreadable.ok();) {
      const std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kStep, piece.length - done));
      Status st = src.region->ReadAt(src.region_offset + piece.in_item + done, buf.data(), n);
      if (!st.ok()) {
        unreadable = st.With("item " + QuoteName(items[piece.item].name));
        break;
      }
      sum.Update(buf.data(), n);
      done += n;
    }
    if (!unreadable.ok()) break;
    if (sum.Digest() != piece.hash) {
      if (first == nullptr) first = &piece;
      ++differing;
    }
  }
  const std::string v = std::to_string(meta_.version);
  if (!unreadable.ok()) {
    verified_ = Aborted("torn snapshot: version " + v + " could not be verified against the trainer's memory (" +
                        unreadable.message() + "); it is aborted, never committed");
  } else if (first != nullptr) {
    const ShardItem& it = items[first->item];
    verified_ = Aborted("torn snapshot: item " + QuoteName(it.name) + " changed between snapshot(" + v +
                        ") and its wait: bytes [" + std::to_string(first->in_item) + ", " +
                        std::to_string(first->in_item + first->length) + ") of its " + std::to_string(it.length) +
                        " differ from the copy" +
                        (differing > 1 ? " (" + std::to_string(differing) + " pieces differ in all)" : "") +
                        "; the version is aborted, never committed (registered memory must not change until "
                        "wait_snapshot returns)");
  } else {
    verified_ = Status::Ok();
  }
  std::vector<ItemSource>().swap(verify_sources_);
  return *verified_;
}

bool ShardJob::sealed() const {
  MutexLock lock(mu_);
  return sealed_;
}

bool ShardJob::aborted() const {
  MutexLock lock(mu_);
  return aborted_;
}

bool ShardJob::awaiting_seal() const {
  MutexLock lock(mu_);
  return placement_.sealed && written_ && !finish_claimed_;
}

}  // namespace ckpt
