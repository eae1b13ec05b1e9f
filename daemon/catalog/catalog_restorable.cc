// RESTORABLE markers: a version not committed yet whose every rank's shard is replicated
// to peers' memory (the daemons' .repl markers claim each rank with its current
// registration) may be restored from there; a restore that leaves the timeline above it
// drops theirs.
#include "daemon/catalog/catalog.h"

#include <algorithm>

#include "format/markers.h"
#include "format/paths.h"

namespace ckpt {

Status Catalog::DecideRestorable(const std::string& job, std::uint64_t version, std::uint32_t world_size,
                                 bool* restorable) {
  *restorable = false;
  if (world_size == 0) return InvalidArgument("a version of a job with world size 0 is never restorable");
  auto names = storage_->List(VersionDir(job, version));
  if (!names.ok()) return names.status().With("list version " + std::to_string(version));
  std::uint64_t named = 0;
  std::vector<std::string> markers;
  for (const auto& n : names.value()) {
    if (n == kCommittedMarker) return Status::Ok();  // the committed version is what restores read
    if (auto id = ParseNodeMarkerName(n, NodeMarkerKind::kReplicated)) {
      named += id->ranks;
      markers.push_back(n);
    }
  }
  if (named < world_size) return Status::Ok();
  auto current =
      CurrentRegistrationsIfClaimed(job, version, markers, NodeMarkerKind::kReplicated, world_size);
  if (!current) return Status::Ok();
  const RestorableMarker marker{world_size, std::move(*current)};
  const std::string path = tree_.RestorableMarker(job, version);
  // Every daemon whose claim completes the version may write it, each the same contents (the
  // registrations are the ranks' current ones); one of an earlier run with the same number
  // (the job rolled back past it) is replaced.
  if (auto text = storage_->ReadSmallFile(path); text.ok()) {
    if (auto old = ParseRestorable(text.value());
        old && old->world_size == marker.world_size && old->registrations == marker.registrations) {
      *restorable = true;
      return Status::Ok();
    }
  }
  if (Status s = storage_->WriteFileAtomic(path, RenderRestorable(marker)); !s.ok()) {
    return s.With("write " + path);
  }
  *restorable = true;
  return Status::Ok();
}

Result<RestorableMarker> Catalog::ReadRestorable(const std::string& job, std::uint64_t version) {
  const std::string path = tree_.RestorableMarker(job, version);
  auto text = storage_->ReadSmallFile(path);
  if (!text.ok()) return text.status();
  auto marker = ParseRestorable(text.value());
  if (!marker) return DataLoss(path + " is not a RESTORABLE marker");
  return std::move(*marker);
}

std::vector<std::uint64_t> Catalog::RestorableNewerThan(const std::string& job, std::uint64_t after) {
  std::vector<std::uint64_t> out;
  auto names = storage_->List(JobDir(job));
  if (!names.ok()) return out;
  for (const auto& n : names.value()) {
    auto v = ParseVersionDirName(n);
    if (v && *v > after && storage_->Exists(tree_.RestorableMarker(job, *v))) out.push_back(*v);
  }
  std::sort(out.rbegin(), out.rend());
  return out;
}

void Catalog::DropRestorableNewerThan(const std::string& job, std::uint64_t version) {
  for (std::uint64_t v : RestorableNewerThan(job, version)) {
    const std::string path = tree_.RestorableMarker(job, v);
    if (Status s = storage_->Remove(path); !s.ok() && s.code() != StatusCode::kNotFound) {
      Report("job " + job + ": " + path + " of the timeline left by a restore of version " +
             std::to_string(version) + " could not be removed: " + s.message());
    }
  }
}

}  // namespace ckpt
