#include "format/shard_files.h"

#include <unistd.h>

#include <cerrno>
#include <unordered_map>
#include <utility>

#include "common/names.h"
#include "common/safe_file.h"
#include "format/checksum.h"
#include "format/paths.h"

namespace ckpt {

namespace {

// "dir/name" -> {"dir", "name"}; a path without a slash is in ".".
std::pair<std::string, std::string> SplitPath(const std::string& path) {
  const std::size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return {".", path};
  return {slash == 0 ? "/" : path.substr(0, slash), path.substr(slash + 1)};
}

}  // namespace

std::string ShardFiles::BasePath(const std::string& path, std::uint64_t base) {
  // ROOT/JOB/vNNN/rank-R.safetensors -> ROOT/JOB/v<base>/rank-R.safetensors
  const auto [dir, name] = SplitPath(path);
  const auto [job_dir, version_dir] = SplitPath(dir);
  // A directory not named like a version ("." when run from inside one): its parent. A
  // version a rollback set aside may be "vN.K" (the K-th set aside under that number).
  const std::string number = version_dir.substr(0, version_dir.find('.', 1));
  const bool named_version = ParseVersionDirName(number).has_value() &&
                             (number.size() == version_dir.size() ||
                              version_dir.find_first_not_of("0123456789", number.size() + 1) == std::string::npos);
  const std::string parent = named_version ? job_dir : dir + "/..";
  return parent + "/" + VersionDirName(base) + "/" + name;
}

Result<ShardFiles> ShardFiles::Open(const std::string& path) {
  auto fd = OpenRegularForRead(path);
  if (!fd.ok()) return fd.status().With("cannot open shard");
  auto info = ReadShardHeader(fd->get(), path);
  if (!info.ok()) return info.status();
  return Adopt(std::move(fd).value(), std::move(info).value(), path);
}

Result<ShardFiles> ShardFiles::Adopt(UniqueFd fd, ShardInfo info, const std::string& path) {
  ShardFiles files;
  files.path_ = path;
  files.fd_ = std::move(fd);
  files.info_ = std::move(info);
  if (!files.info_.base) return files;
  const ShardInfo& own = files.info_;
  const std::uint64_t base = *own.base;
  files.base_path_ = BasePath(path, base);
  auto base_fd = OpenRegularForRead(files.base_path_);
  // A version a rollback set aside (JOB/set-aside/vN) reads from a base still in JOB/ unless
  // the base was set aside too.
  if (const auto [up, aside] = SplitPath(SplitPath(SplitPath(files.base_path_).first).first);
      !base_fd.ok() && base_fd.status().code() == StatusCode::kNotFound && aside == kSetAsideDir) {
    const std::string outside = up + "/" + VersionDirName(base) + "/" + SplitPath(path).second;
    if (auto fd = OpenRegularForRead(outside); fd.ok() || fd.status().code() != StatusCode::kNotFound) {
      files.base_path_ = outside;
      base_fd = std::move(fd);
    }
  }
  const std::string& base_path = files.base_path_;
  const std::string what = path + " is a differential shard of version " + std::to_string(own.meta.version) +
                           " whose unchanged items are in version " + std::to_string(base) + "'s shard " +
                           base_path;
  if (!base_fd.ok()) {
    return DataLoss(what + ", which cannot be read: " + base_fd.status().message());
  }
  auto base_info = ReadShardHeader(base_fd->get(), base_path);
  if (!base_info.ok()) return DataLoss(what + ", which is damaged: " + base_info.status().message());
  const ShardMeta& b = base_info->meta;
  if (base_info->base) return DataLoss(what + ", which is itself differential (a base must be a full shard)");
  if (b.job != own.meta.job || b.version != base || b.rank != own.meta.rank ||
      b.world_size != own.meta.world_size) {
    return DataLoss(what + ", which holds job '" + b.job + "' version " + std::to_string(b.version) + " rank " +
                    std::to_string(b.rank) + " of world size " + std::to_string(b.world_size) + " instead");
  }
  std::unordered_map<std::string, const ShardItem*> by_key;
  by_key.reserve(base_info->items.size());
  for (const ShardItem& item : base_info->items) by_key.emplace(item.TensorKey(), &item);
  files.base_offset_.assign(own.items.size(), 0);
  for (std::size_t i = 0; i < own.items.size(); ++i) {
    const ShardItem& item = own.items[i];
    if (!item.in_base) continue;
    auto it = by_key.find(item.TensorKey());
    if (it == by_key.end()) return DataLoss(what + ", which has no item " + QuoteName(item.name));
    const ShardItem& held = *it->second;
    if (held.kind != item.kind || held.dtype != item.dtype || held.shape != item.shape ||
        held.length != item.length || held.checksum != item.checksum) {
      return DataLoss(what + ", whose item " + QuoteName(item.name) + " is not the one the version recorded (" +
                      std::string(DTypeName(held.dtype)) + " " + ShapeText(held.shape) + " xxh3 " +
                      ChecksumHex(held.checksum) + " there, " + std::string(DTypeName(item.dtype)) + " " +
                      ShapeText(item.shape) + " xxh3 " + ChecksumHex(item.checksum) + " recorded)");
    }
    files.base_offset_[i] = held.offset;
  }
  files.base_data_start_ = base_info->data_start;
  files.base_fd_ = std::move(base_fd).value();
  return files;
}

ShardFiles::Location ShardFiles::Locate(std::size_t i) const {
  const ShardItem& item = info_.items[i];
  if (item.in_base) return {base_fd_.get(), base_data_start_ + base_offset_[i], &base_path_};
  return {fd_.get(), info_.data_start + item.offset, &path_};
}

Status ShardFiles::Read(std::size_t i, std::uint64_t from, char* out, std::size_t n) const {
  const Location at = Locate(i);
  std::size_t done = 0;
  while (done < n) {
    ssize_t r = ::pread(at.fd, out + done, n - done, static_cast<off_t>(at.offset + from + done));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return IoError("cannot read " + *at.path, errno);
    if (r == 0) return DataLoss(*at.path + " ended early (truncated shard)");
    done += static_cast<std::size_t>(r);
  }
  return Status::Ok();
}

std::uint64_t ShardFiles::stored_bytes() const {
  std::uint64_t n = 0;
  for (const ShardItem& item : info_.items) n += item.in_base ? 0 : item.length;
  return n;
}

std::uint64_t ShardFiles::item_bytes() const {
  std::uint64_t n = 0;
  for (const ShardItem& item : info_.items) n += item.length;
  return n;
}

}  // namespace ckpt
