#include "tools/ckptctl/export_source.h"

#include <unistd.h>

#include <cerrno>
#include <unordered_set>

#include "common/safe_file.h"
#include "format/markers.h"
#include "format/paths.h"
#include "format/version_index.h"
#include "tools/ckptctl/committed_version.h"

namespace ckptctl {
namespace export_internal {

using ckpt::DataLoss;
using ckpt::Result;
using ckpt::Status;

namespace {

Result<std::string> ReadSmallFile(const std::string& path, std::uint64_t limit) {
  auto fd = ckpt::OpenRegularForRead(path);
  if (!fd.ok()) return fd.status();
  std::string text;
  char buf[64 << 10];
  for (;;) {
    ssize_t r = ::read(fd->get(), buf, sizeof buf);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ckpt::IoError("cannot read " + path, errno);
    if (r == 0) break;
    text.append(buf, static_cast<std::size_t>(r));
    if (text.size() > limit) return DataLoss(path + " is larger than " + std::to_string(limit) + " bytes");
  }
  return text;
}

// The index (format/version_index.h) as the tensors to export.

ExportChunk ChunkOf(const ckpt::IndexChunk& c) { return {c.rank, c.file, c.key, c.offsets, c.shape}; }

ExportTensor PrivateTensor(std::uint32_t rank, const ckpt::IndexItem& item) {
  ExportTensor out;
  out.name = "rank" + std::to_string(rank) + "/" + item.name;
  out.kind = ExportTensor::Kind::kPrivate;
  out.dtype = item.dtype;
  out.shape = item.shape;
  out.chunks.push_back(
      {rank, item.file, item.key, std::vector<std::int64_t>(item.shape.size(), 0), item.shape});
  return out;
}

ExportTensor BlobTensor(const ckpt::IndexBlob& blob) {
  ExportTensor out;
  out.name = "rank" + std::to_string(blob.rank) + "/" + std::string(ckpt::kBlobPrefix) + blob.name;
  out.kind = ExportTensor::Kind::kBlob;
  out.dtype = ckpt::DType::kU8;
  out.shape = {static_cast<std::int64_t>(blob.bytes)};
  out.chunks.push_back({blob.rank, blob.file, blob.key, {0}, out.shape});
  return out;
}

// Global tensors by name (the index's map), then private items by rank, then blobs.
Status FromIndex(const ckpt::VersionIndex& index, ExportSource& src) {
  for (const auto& [name, t] : index.tensors) {
    ExportTensor out;
    out.name = name;
    out.kind = ExportTensor::Kind::kGlobal;
    out.dtype = t.dtype;
    out.shape = t.shape;
    out.replicated = t.replicated;
    if (!Elements(out.shape, ckpt::DTypeSize(out.dtype)))
      return DataLoss("tensor " + Quote(name) + " has a shape too large to be real: " + ShapeText(t.shape));
    for (const auto& c : t.chunks) out.chunks.push_back(ChunkOf(c));
    src.tensors.push_back(std::move(out));
  }
  for (const auto& [rank, items] : index.private_items)
    for (const auto& item : items) src.tensors.push_back(PrivateTensor(rank, item));
  for (const auto& blob : index.blobs) src.tensors.push_back(BlobTensor(blob));
  return Status::Ok();
}

// A version without index.json (committed before the daemon wrote one): the index the shard
// headers make (their layouts, if format 3; else every item rank-private).
Result<ckpt::VersionIndex> IndexFromHeaders(ShardSet& shards, std::uint32_t world_size) {
  ckpt::VersionIndexBuilder builder;
  for (std::uint32_t rank = 0; rank < world_size; ++rank) {
    auto shard = shards.Get(rank);
    if (!shard.ok()) return shard.status();
    if (Status s = builder.Add(shard.value()->info); !s.ok()) return DataLoss(s.message());
  }
  auto index = std::move(builder).Finish();
  if (!index.ok()) return DataLoss(index.status().message());
  return index;
}

Status CheckUniqueNames(const std::vector<ExportTensor>& tensors) {
  std::unordered_set<std::string> seen;
  for (const auto& t : tensors) {
    if (t.name.empty()) return DataLoss("the index lists a tensor with an empty name");
    if (t.name == "__metadata__")
      return DataLoss("the index lists a tensor named __metadata__, which safetensors reserves");
    if (!seen.insert(t.name).second)
      return DataLoss("two tensors of the export would be named " + Quote(t.name));
  }
  return Status::Ok();
}

}  // namespace

std::string BoxText(const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) {
    if (d) out += ", ";
    const std::int64_t o = d < offsets.size() ? offsets[d] : 0;
    out += std::to_string(o) + ":" + std::to_string(o + shape[d]);
  }
  return out + "]";
}

std::string ShapeText(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t d = 0; d < shape.size(); ++d) out += (d ? "," : "") + std::to_string(shape[d]);
  return out + "]";
}

std::optional<std::uint64_t> Elements(const std::vector<std::int64_t>& shape, std::size_t element_bytes) {
  std::uint64_t n = 1;
  for (auto d : shape) {
    if (d < 0) return std::nullopt;
    if (d == 0)
      n = 0;
    else if (n != 0 && n > kMaxTensorBytes / static_cast<std::uint64_t>(d))
      return std::nullopt;
    else
      n *= static_cast<std::uint64_t>(d);
  }
  if (n > kMaxTensorBytes / element_bytes) return std::nullopt;
  return n;
}

Result<OpenShard*> ShardSet::Get(std::uint32_t rank) {
  auto it = shards_.find(rank);
  if (it != shards_.end()) return it->second.get();
  auto shard = std::make_unique<OpenShard>();
  shard->path = ckpt::JoinPath(dir_, ckpt::ShardFileName(rank));
  auto fd = ckpt::OpenRegularForRead(shard->path);
  if (!fd.ok()) {
    return DataLoss("version " + std::to_string(version_) + " of job '" + job_ + "' is committed but rank " +
                    std::to_string(rank) + "'s shard cannot be opened: " + fd.status().message());
  }
  auto info = ckpt::ReadShardHeader(fd->get(), shard->path);
  if (!info.ok())
    return DataLoss("corrupted shard of rank " + std::to_string(rank) + ": " + info.status().message());
  shard->info = info.value();
  auto files = ckpt::ShardFiles::Adopt(std::move(fd).value(), std::move(info).value(), shard->path);
  if (!files.ok())
    return DataLoss("rank " + std::to_string(rank) + "'s shard cannot be read: " + files.status().message());
  shard->files = std::move(files).value();
  const auto& m = shard->info.meta;
  if (m.job != job_ || m.version != version_ || m.rank != rank || m.world_size != world_size_) {
    return DataLoss(shard->path + " holds job '" + m.job + "' version " + std::to_string(m.version) +
                    " rank " + std::to_string(m.rank) + " of " + std::to_string(m.world_size) +
                    ", not job '" + job_ + "' version " + std::to_string(version_) + " rank " +
                    std::to_string(rank) + " of " + std::to_string(world_size_));
  }
  for (std::size_t i = 0; i < shard->info.items.size(); ++i)
    shard->by_key[shard->info.items[i].TensorKey()] = i;
  OpenShard* raw = shard.get();
  shards_.emplace(rank, std::move(shard));
  return raw;
}

Status CheckAgainstShards(ShardSet& shards, const ExportSource& src) {
  for (const auto& t : src.tensors) {
    for (const auto& c : t.chunks) {
      auto shard = shards.Get(c.rank);
      if (!shard.ok()) return shard.status();
      const OpenShard& s = *shard.value();
      auto it = s.by_key.find(c.key);
      const std::string what = "tensor " + Quote(t.name) + ": the chunk of rank " + std::to_string(c.rank);
      if (it == s.by_key.end())
        return DataLoss(what + " is item " + Quote(c.key) + ", which " + s.path + " does not hold");
      const ckpt::ShardItem& item = s.info.items[it->second];
      const bool want_blob = t.kind == ExportTensor::Kind::kBlob;
      if ((item.kind == ckpt::ItemKind::kBlob) != want_blob)
        return DataLoss(what + " is item " + Quote(c.key) + ", which " + s.path + " holds as a " +
                        (want_blob ? "tensor, not a blob" : "blob, not a tensor"));
      if (want_blob ? item.length != t.bytes() : (item.dtype != t.dtype || item.shape != c.shape))
        return DataLoss(what + " is listed in the index as " + std::string(ckpt::DTypeName(t.dtype)) + " " +
                        ShapeText(c.shape) + " but " + s.path + " holds " + Quote(c.key) + " as " +
                        std::string(ckpt::DTypeName(item.dtype)) + " " + ShapeText(item.shape));
    }
  }
  return Status::Ok();
}

Result<ExportSource> LoadVersion(const std::string& root, const std::string& job, std::uint64_t version,
                                 std::unique_ptr<ShardSet>* shards_out) {
  if (std::string why = ckpt::CheckJobId(job); !why.empty())
    return ckpt::InvalidArgument("job id " + Quote(job) + ": " + why);
  const ckpt::CheckpointTree tree(root);
  auto chosen = ChooseVersion(tree, job, version);
  if (!chosen.ok()) return chosen.status();
  version = chosen.value();
  ExportSource src;
  src.job = job;
  src.version = version;
  src.version_dir = tree.VersionDir(job, version);
  const std::string marker_path = tree.CommittedMarker(job, version);
  auto marker_text = ReadSmallFile(marker_path, 64 << 10);
  if (!marker_text.ok()) {
    if (marker_text.status().code() == ckpt::StatusCode::kNotFound)
      return ckpt::NotFound("version " + std::to_string(version) + " of job '" + job +
                            "' is not committed (no " + marker_path +
                            "); only a committed version can be exported");
    return marker_text.status();
  }
  auto marker = ckpt::ParseCommitted(marker_text.value());
  if (!marker.ok()) return marker.status().With(marker_path);
  if (marker->job != job || marker->version != version)
    return DataLoss(marker_path + " names job '" + marker->job + "' version " +
                    std::to_string(marker->version));
  src.world_size = marker->world_size;

  auto shards = std::make_unique<ShardSet>(src.version_dir, job, version, src.world_size);
  const std::string index_path = tree.IndexFile(job, version);
  auto index_text = ReadSmallFile(index_path, ckpt::kMaxIndexBytes);
  Result<ckpt::VersionIndex> index = ckpt::VersionIndex{};
  if (index_text.ok()) {
    src.from_index = true;
    index = ckpt::VersionIndex::Parse(index_text.value());
    if (!index.ok()) {
      // Its messages start "index.json: ..." or "index.json is ...": name the whole path instead.
      std::string why = index.status().message();
      if (why.rfind(ckpt::kIndexFileName, 0) == 0) why.erase(0, ckpt::kIndexFileName.size());
      return DataLoss(index_path + why);
    }
    if (index->job != job || index->version != version || index->world_size != src.world_size)
      return DataLoss(index_path + " describes job '" + index->job + "' version " +
                      std::to_string(index->version) + " of " + std::to_string(index->world_size) +
                      " ranks, but the directory holds job '" + job + "' version " + std::to_string(version) +
                      " of " + std::to_string(src.world_size) + " (COMMITTED)");
  } else if (index_text.status().code() == ckpt::StatusCode::kNotFound) {
    index = IndexFromHeaders(*shards, src.world_size);
    if (!index.ok()) return index.status();
  } else {
    return index_text.status();
  }
  if (Status s = FromIndex(index.value(), src); !s.ok()) return s;
  if (Status s = CheckUniqueNames(src.tensors); !s.ok()) return s;
  *shards_out = std::move(shards);
  return src;
}

}  // namespace export_internal

using export_internal::CheckAgainstShards;
using export_internal::LoadVersion;
using export_internal::ShardSet;

ckpt::Result<ExportSource> LoadExportSource(const std::string& root, const std::string& job,
                                            std::uint64_t version) {
  std::unique_ptr<ShardSet> shards;
  auto src = LoadVersion(root, job, version, &shards);
  if (!src.ok()) return src;
  if (ckpt::Status s = CheckAgainstShards(*shards, src.value()); !s.ok()) return s;
  return src;
}

}  // namespace ckptctl
