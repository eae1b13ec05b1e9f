#include "tools/ckptctl/export.h"

#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "common/names.h"
#include "common/safe_file.h"
#include "common/unique_fd.h"
#include "format/checksum.h"
#include "format/markers.h"
#include "format/paths.h"
#include "format/shard_format.h"
#include "format/version_index.h"

namespace ckptctl {
namespace {

namespace fs = std::filesystem;
using ckpt::DataLoss;
using ckpt::Result;
using ckpt::Status;
using Json = nlohmann::ordered_json;

// No tensor of more bytes than this is believed (an index could claim any shape); far above
// any real one, and small enough that offsets of files holding several never wrap 64 bits.
inline constexpr std::uint64_t kMaxTensorBytes = std::uint64_t{1} << 56;
// One buffer carries every chunk from shard to export.
inline constexpr std::size_t kCopyBufferBytes = 8 << 20;
// The data section of an exported file starts on a multiple of this (the header is padded with
// spaces, as the safetensors library pads its own), so that every tensor, placed in order of
// decreasing element size, is aligned to its element.
inline constexpr std::uint64_t kHeaderAlignment = 8;

std::string Quote(const std::string& name) { return ckpt::QuoteName(name); }

std::string Box(const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& shape) {
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

bool Exists(const std::string& path) {
  struct stat st {};
  return ::lstat(path.c_str(), &st) == 0;
}

// Elements of `shape`, or nullopt if a dimension is negative or the bytes pass kMaxTensorBytes.
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

// ---------------------------------------------------------------------------------------
// The version: which one, and the shards it is made of.

std::uint64_t NewestCommitted(const ckpt::CheckpointTree& tree, const std::string& job) {
  std::uint64_t newest = 0;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(tree.JobDir(job), ec)) {
    auto v = ckpt::ParseVersionDirName(e.path().filename().string());
    if (v && *v > newest && Exists(tree.CommittedMarker(job, *v))) newest = *v;
  }
  return newest;
}

// One rank's shard, open, with its header parsed from the same descriptor (what is read is the
// file that was checked, whatever is renamed over the path meanwhile).
struct OpenShard {
  std::string path;
  ckpt::UniqueFd fd;
  ckpt::ShardInfo info;
  std::unordered_map<std::string, std::size_t> by_key;  // TensorKey() -> index in info.items
};

// The shards of one version, opened on first use and kept open for the copies.
class ShardSet {
 public:
  ShardSet(std::string version_dir, std::string job, std::uint64_t version, std::uint32_t world_size)
      : dir_(std::move(version_dir)), job_(std::move(job)), version_(version), world_size_(world_size) {}

  Result<OpenShard*> Get(std::uint32_t rank) {
    auto it = shards_.find(rank);
    if (it != shards_.end()) return it->second.get();
    auto shard = std::make_unique<OpenShard>();
    shard->path = ckpt::JoinPath(dir_, ckpt::ShardFileName(rank));
    auto fd = ckpt::OpenRegularForRead(shard->path);
    if (!fd.ok()) {
      return DataLoss("version " + std::to_string(version_) + " of job '" + job_ +
                      "' is committed but rank " + std::to_string(rank) +
                      "'s shard cannot be opened: " + fd.status().message());
    }
    shard->fd = std::move(fd.value());
    auto info = ckpt::ReadShardHeader(shard->fd.get(), shard->path);
    if (!info.ok())
      return DataLoss("corrupted shard of rank " + std::to_string(rank) + ": " + info.status().message());
    shard->info = std::move(info.value());
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

 private:
  std::string dir_, job_;
  std::uint64_t version_;
  std::uint32_t world_size_;
  std::map<std::uint32_t, std::unique_ptr<OpenShard>> shards_;
};

// ---------------------------------------------------------------------------------------
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

// Every chunk names an item of its shard of the dtype and shape the index gives it (the
// header checksum vouches for what the header says, so this catches an index that is wrong).
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

// The version's tensors, not yet checked against the shards (CheckAgainstShards), so that an
// export checks only the shards of what it exports.
Result<ExportSource> Load(const std::string& root, const std::string& job, std::uint64_t version,
                          std::unique_ptr<ShardSet>* shards_out) {
  if (std::string why = ckpt::CheckJobId(job); !why.empty())
    return ckpt::InvalidArgument("job id " + Quote(job) + ": " + why);
  const ckpt::CheckpointTree tree(root);
  if (!Exists(tree.JobDir(job)))
    return ckpt::NotFound("no job '" + job + "' under " + root + " (" + tree.JobDir(job) +
                          " does not exist)");
  if (version == 0) {
    version = NewestCommitted(tree, job);
    if (version == 0) return ckpt::NotFound("job '" + job + "' under " + root + " has no committed version");
  }
  ExportSource src;
  src.job = job;
  src.version = version;
  src.version_dir = tree.VersionDir(job, version);
  if (!Exists(src.version_dir))
    return ckpt::NotFound("job '" + job + "' has no version " + std::to_string(version) + " under " + root +
                          " (" + src.version_dir + " does not exist)");
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

// ---------------------------------------------------------------------------------------
// Writing.

// Where the runs of elements of one chunk go: the chunk's bytes, front to back, are runs of
// run_bytes contiguous in the global tensor too; RunOffset(i) is where run i starts there.
class ChunkRuns {
 public:
  ChunkRuns(const std::vector<std::int64_t>& global, const ExportChunk& c, std::size_t element) {
    const std::size_t n = global.size();
    // k: the outermost dimension of the run: every dimension inside it is whole in the chunk.
    std::size_t k = n;
    std::uint64_t run = 1;
    while (k > 0) {
      --k;
      run *= static_cast<std::uint64_t>(c.shape[k]);
      if (c.shape[k] != global[k]) break;
    }
    run_bytes_ = run * element;
    strides_.assign(n, element);
    for (std::size_t d = n; d-- > 1;) strides_[d - 1] = strides_[d] * static_cast<std::uint64_t>(global[d]);
    outer_.assign(c.shape.begin(), c.shape.begin() + static_cast<std::ptrdiff_t>(k));
    base_ = 0;
    for (std::size_t d = 0; d < n; ++d) base_ += static_cast<std::uint64_t>(c.offsets[d]) * strides_[d];
  }

  std::uint64_t run_bytes() const { return run_bytes_; }

  std::uint64_t RunOffset(std::uint64_t i) const {
    std::uint64_t off = base_;
    for (std::size_t d = outer_.size(); d-- > 0;) {
      const auto extent = static_cast<std::uint64_t>(outer_[d]);
      off += (i % extent) * strides_[d];
      i /= extent;
    }
    return off;
  }

 private:
  std::uint64_t run_bytes_ = 0;
  std::vector<std::uint64_t> strides_;  // bytes per step of each dimension of the global tensor
  std::vector<std::int64_t> outer_;     // the chunk's extents outside the run
  std::uint64_t base_ = 0;              // where the chunk's first element lies
};

Status ReadFully(int fd, char* buf, std::size_t n, std::uint64_t offset, const std::string& path) {
  std::size_t got = 0;
  while (got < n) {
    ssize_t r = ::pread(fd, buf + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ckpt::IoError("cannot read " + path, errno);
    if (r == 0) return DataLoss(path + " ends before the data its header lists (truncated)");
    got += static_cast<std::size_t>(r);
  }
  return Status::Ok();
}

Status WriteFully(int fd, const char* buf, std::size_t n, std::uint64_t offset, const std::string& path) {
  std::size_t done = 0;
  while (done < n) {
    ssize_t w = ::pwrite(fd, buf + done, n - done, static_cast<off_t>(offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return ckpt::IoError("cannot write " + path, errno);
    done += static_cast<std::size_t>(w);
  }
  return Status::Ok();
}

// One output file being written, under its temporary path.
struct OutFile {
  std::string path;
  ckpt::UniqueFd fd;
};

class TensorCopier {
 public:
  TensorCopier(ShardSet& shards, const volatile std::sig_atomic_t* interrupted)
      : shards_(shards), interrupted_(interrupted), buf_(kCopyBufferBytes) {}

  // Writes tensor `t` at `offset` of `out`. `warnings` gets a line per replicated copy passed over.
  Status Copy(const ExportTensor& t, OutFile& out, std::uint64_t offset, std::vector<std::string>* warnings) {
    if (!t.replicated) {
      for (const auto& c : t.chunks)
        if (Status s = CopyChunk(t, c, out, offset); !s.ok()) return s;
      return Status::Ok();
    }
    // Any copy will do: the first whose checksum holds, in rank order.
    std::vector<const ExportChunk*> copies;
    for (const auto& c : t.chunks) copies.push_back(&c);
    std::stable_sort(copies.begin(), copies.end(), [](auto* a, auto* b) { return a->rank < b->rank; });
    std::string failures;
    for (const ExportChunk* c : copies) {
      Status s = CopyChunk(t, *c, out, offset);
      if (s.ok()) {
        if (!failures.empty()) warnings->push_back(failures);
        return s;
      }
      if (s.code() != ckpt::StatusCode::kDataLoss) return s;
      failures += (failures.empty() ? "" : "; ") + s.message();
    }
    return DataLoss("replicated tensor " + Quote(t.name) + ": no copy is intact: " + failures);
  }

 private:
  Status CopyChunk(const ExportTensor& t, const ExportChunk& c, OutFile& out, std::uint64_t offset) {
    auto shard = shards_.Get(c.rank);
    if (!shard.ok()) return shard.status();
    OpenShard& s = *shard.value();
    const ckpt::ShardItem& item = s.info.items[s.by_key.at(c.key)];
    const std::size_t element = t.kind == ExportTensor::Kind::kBlob ? 1 : ckpt::DTypeSize(t.dtype);
    const ChunkRuns runs(t.shape, c, element);
    const std::uint64_t begin = s.info.data_start + item.offset;
    ckpt::Checksum sum;
    std::uint64_t run = 0, within = 0;
    for (std::uint64_t done = 0; done < item.length;) {
      if (interrupted_ && *interrupted_) return ckpt::Cancelled("interrupted");
      const auto want = static_cast<std::size_t>(std::min<std::uint64_t>(buf_.size(), item.length - done));
      if (Status st = ReadFully(s.fd.get(), buf_.data(), want, begin + done, s.path); !st.ok()) return st;
      sum.Update(buf_.data(), want);
      for (std::size_t p = 0; p < want;) {
        const auto take =
            static_cast<std::size_t>(std::min<std::uint64_t>(runs.run_bytes() - within, want - p));
        if (Status st = WriteFully(out.fd.get(), buf_.data() + p, take, offset + runs.RunOffset(run) + within,
                                   out.path);
            !st.ok())
          return st;
        p += take;
        within += take;
        if (within == runs.run_bytes()) {
          ++run;
          within = 0;
        }
      }
      done += want;
    }
    if (sum.Digest() != item.checksum)
      return DataLoss("corrupted shard " + s.path + " (rank " + std::to_string(c.rank) + "): item " +
                      Quote(c.key) +
                      (t.kind == ExportTensor::Kind::kGlobal
                           ? ", chunk " + Box(c.offsets, c.shape) + " of tensor " + Quote(t.name)
                           : "") +
                      ", fails its checksum (stored " + ckpt::ChecksumHex(item.checksum) + ", computed " +
                      ckpt::ChecksumHex(sum.Digest()) + ")");
    return Status::Ok();
  }

  ShardSet& shards_;
  const volatile std::sig_atomic_t* interrupted_;
  std::vector<char> buf_;
};

// The header of one exported file: tensors in order of decreasing element size (then as
// given), packed from offset 0; `offsets` gets each tensor's offset in the data section.
std::string RenderHeader(const std::vector<const ExportTensor*>& order, const ExportSource& src,
                         std::vector<std::uint64_t>* offsets) {
  Json header;
  header["__metadata__"] = {{"format", "pt"},
                            {"ckpt.job", src.job},
                            {"ckpt.version", std::to_string(src.version)},
                            {"ckpt.world_size", std::to_string(src.world_size)}};
  std::uint64_t at = 0;
  for (const ExportTensor* t : order) {
    offsets->push_back(at);
    header[t->name] = {{"dtype", std::string(ckpt::DTypeName(t->dtype))},
                       {"shape", t->shape},
                       {"data_offsets", {at, at + t->bytes()}}};
    at += t->bytes();
  }
  std::string json = header.dump(-1, ' ', false, Json::error_handler_t::replace);
  json.resize((8 + json.size() + kHeaderAlignment - 1) / kHeaderAlignment * kHeaderAlignment - 8, ' ');
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i)
    out[static_cast<std::size_t>(i)] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json;
}

bool IsExportFileName(const std::string& name) {
  if (name == "model.safetensors" || name == kExportIndexName) return true;
  static const std::regex kSharded("model-[0-9]{5,}-of-[0-9]{5,}\\.safetensors");
  return std::regex_match(name, kSharded);
}

// The temporary directory of an export that was killed before it could remove it.
bool IsLeftover(const std::string& name) {
  static const std::regex kTmp("\\.ckptctl-export-[0-9]+\\.tmp");
  return std::regex_match(name, kTmp);
}

Status SyncDir(const std::string& dir) {
  auto fd = ckpt::OpenDirectory(dir);
  if (!fd.ok()) return fd.status();
  if (::fsync(fd->get()) != 0) return ckpt::IoError("cannot sync " + dir, errno);
  return Status::Ok();
}

// The output directory while an export is written: the files go into a temporary directory
// inside it and are renamed into it by Commit(). Unless committed, the destructor removes the
// temporary directory, and the output directory too if this export created it.
class OutputDir {
 public:
  OutputDir() = default;
  OutputDir(const OutputDir&) = delete;
  OutputDir& operator=(const OutputDir&) = delete;
  ~OutputDir() {
    if (committed_) return;
    std::error_code ec;
    if (!tmp_.empty()) fs::remove_all(tmp_, ec);
    if (!created_.empty()) fs::remove_all(created_, ec);
  }

  Status Open(const std::string& out, bool force) {
    if (out.empty()) return ckpt::InvalidArgument("--out is empty");
    out_ = out;
    struct stat st {};
    if (::stat(out.c_str(), &st) == 0) {  // following a link: --out may be one to a directory
      if (!S_ISDIR(st.st_mode))
        return ckpt::FailedPrecondition("--out " + out + " is " + ckpt::FileTypeName(st.st_mode) +
                                        ", not a directory");
      std::error_code ec;
      std::vector<std::string> entries;
      for (const auto& e : fs::directory_iterator(out, ec)) entries.push_back(e.path().filename().string());
      if (ec) return ckpt::IoError("cannot list --out " + out, ec.value());
      if (!entries.empty() && !force) {
        std::sort(entries.begin(), entries.end());
        return ckpt::AlreadyExists(
            "--out " + out + " already has " + std::to_string(entries.size()) +
            (entries.size() == 1 ? " entry" : " entries") + " (" + Quote(entries.front()) +
            (entries.size() > 1 ? ", ..." : "") +
            "); export into a new or empty directory, or pass --force to replace an earlier "
            "export there (its other files are kept)");
      }
      existing_ = std::move(entries);
      // The directory itself from here on, not a symbolic link to it (OpenDirectory, for the
      // syncs, follows none).
      fs::path real = fs::canonical(out, ec);
      if (ec) return ckpt::IoError("cannot resolve --out " + out, ec.value());
      out_ = real.string();
    } else if (errno == ENOENT) {
      // Create the missing part of the path; remember its top, to take it away on failure.
      std::error_code ec;
      fs::path p = fs::absolute(out, ec).lexically_normal();
      if (ec) return ckpt::IoError("cannot create --out " + out, ec.value());
      fs::path top = p;
      while (top.has_parent_path() && top.parent_path() != top && !Exists(top.parent_path().string()))
        top = top.parent_path();
      fs::create_directories(p, ec);
      if (ec) return ckpt::IoError("cannot create --out " + out, ec.value());
      created_ = top.string();
    } else {
      return ckpt::IoError((errno == ENOTDIR ? "cannot create --out " : "cannot look at --out ") + out,
                           errno);
    }
    tmp_ = ckpt::JoinPath(out_, ".ckptctl-export-" + std::to_string(::getpid()) + ".tmp");  // IsLeftover
    std::error_code ec;
    fs::remove_all(tmp_, ec);  // a leftover of a killed export of a process of the same id
    if (::mkdir(tmp_.c_str(), 0755) != 0) return ckpt::IoError("cannot write into --out " + out, errno);
    return Status::Ok();
  }

  Result<OutFile> Create(const std::string& name, std::uint64_t bytes) {
    OutFile f;
    f.path = ckpt::JoinPath(tmp_, name);
    auto fd = ckpt::CreateRegularFile(f.path, 0, 0644);
    if (!fd.ok()) return fd.status().With("cannot create an exported file in " + out_);
    f.fd = std::move(fd.value());
    // Ask for the space now, so that a full disk fails before hours of copying, not after.
    int rc = ::posix_fallocate(f.fd.get(), 0, static_cast<off_t>(bytes));
    if (rc == EOPNOTSUPP || rc == EINVAL)
      rc = ::ftruncate(f.fd.get(), static_cast<off_t>(bytes)) == 0 ? 0 : errno;
    if (rc != 0)
      return ckpt::IoError("cannot make room for " + std::to_string(bytes) + " bytes in " + f.path, rc);
    names_.push_back(name);
    return f;
  }

  // Renames every file into the output directory, the index last, then removes what an
  // earlier export left there that this one does not replace.
  Status Commit() {
    if (Status s = SyncDir(tmp_); !s.ok()) return s;
    std::vector<std::string> order = names_;
    std::stable_partition(order.begin(), order.end(),
                          [](const std::string& n) { return n != kExportIndexName; });
    for (const auto& name : order) {
      const std::string from = ckpt::JoinPath(tmp_, name), to = ckpt::JoinPath(out_, name);
      if (::rename(from.c_str(), to.c_str()) != 0)
        return ckpt::IoError("cannot rename " + from + " to " + to, errno);
    }
    committed_ = true;
    const std::set<std::string> mine(names_.begin(), names_.end());
    std::error_code ec;
    for (const auto& name : existing_) {
      if (IsExportFileName(name) && !mine.count(name)) ::unlink(ckpt::JoinPath(out_, name).c_str());
      if (IsLeftover(name)) fs::remove_all(ckpt::JoinPath(out_, name), ec);
    }
    ::rmdir(tmp_.c_str());
    return SyncDir(out_);
  }

 private:
  std::string out_, tmp_, created_;
  std::vector<std::string> existing_;  // what was in the directory before
  std::vector<std::string> names_;     // the files written under tmp_
  bool committed_ = false;
};

Status WriteIndex(OutputDir& dir, const std::vector<ExportFile>& files,
                  const std::vector<ExportTensor>& tensors, std::uint64_t total_size) {
  // As transformers writes it: json.dumps(index, indent=2, sort_keys=True) + "\n".
  nlohmann::json weight_map = nlohmann::json::object();
  for (const auto& f : files)
    for (std::size_t i : f.tensors) weight_map[tensors[i].name] = f.name;
  nlohmann::json index = {{"metadata", {{"total_size", total_size}}}, {"weight_map", std::move(weight_map)}};
  const std::string text = index.dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  auto f = dir.Create(std::string(kExportIndexName), text.size());
  if (!f.ok()) return f.status();
  if (Status s = WriteFully(f->fd.get(), text.data(), text.size(), 0, f->path); !s.ok()) return s;
  if (::fsync(f->fd.get()) != 0) return ckpt::IoError("cannot sync " + f->path, errno);
  return Status::Ok();
}

// Lets the copies keep one descriptor per rank open: a version of thousands of ranks passes
// the usual soft limit of 1024.
void RaiseOpenFileLimit() {
  struct rlimit lim {};
  if (::getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    ::setrlimit(RLIMIT_NOFILE, &lim);
  }
}

}  // namespace

std::uint64_t ExportTensor::bytes() const {
  return Elements(shape, ckpt::DTypeSize(dtype)).value_or(0) * ckpt::DTypeSize(dtype);
}

Result<ExportSource> LoadExportSource(const std::string& root, const std::string& job,
                                      std::uint64_t version) {
  std::unique_ptr<ShardSet> shards;
  auto src = Load(root, job, version, &shards);
  if (!src.ok()) return src;
  if (Status s = CheckAgainstShards(*shards, src.value()); !s.ok()) return s;
  return src;
}

Status SelectTensors(std::vector<ExportTensor>& tensors, const std::string& filter, bool blobs,
                     std::size_t* skipped_blobs) {
  std::optional<std::regex> re;
  if (!filter.empty()) {
    try {
      re.emplace(filter, std::regex::ECMAScript);
    } catch (const std::regex_error& e) {
      return ckpt::InvalidArgument("--filter " + Quote(filter) +
                                   " is not a valid regular expression (ECMAScript): " + e.what());
    }
  }
  const std::size_t before = tensors.size();
  std::size_t skipped = 0;
  std::vector<ExportTensor> kept;
  for (auto& t : tensors) {
    if (re && !std::regex_search(t.name, *re)) continue;
    if (t.kind == ExportTensor::Kind::kBlob && !blobs) {
      ++skipped;
      continue;
    }
    kept.push_back(std::move(t));
  }
  tensors = std::move(kept);
  if (skipped_blobs) *skipped_blobs = skipped;
  if (tensors.empty()) {
    if (before == 0) return ckpt::NotFound("the version holds no tensor to export");
    if (re)
      return ckpt::NotFound("--filter " + Quote(filter) + " matches none of the " + std::to_string(before) +
                            " tensors" + (skipped ? " (blobs only with --blobs)" : ""));
    return ckpt::NotFound("the version holds only blobs, which are exported with --blobs");
  }
  return Status::Ok();
}

Status CheckTiling(const ExportTensor& t) {
  const std::string what = "tensor " + Quote(t.name);
  const std::size_t n = t.shape.size();
  if (t.chunks.empty()) return DataLoss(what + " has no chunks");
  const auto volume = Elements(t.shape, ckpt::DTypeSize(t.dtype));
  if (!volume) return DataLoss(what + " has a shape too large to be real: " + ShapeText(t.shape));
  std::uint64_t covered = 0;
  for (const auto& c : t.chunks) {
    const std::string cw = what + ": the chunk of rank " + std::to_string(c.rank) + " (" + Quote(c.key) + ")";
    if (c.offsets.size() != n || c.shape.size() != n)
      return DataLoss(cw + " has " + std::to_string(c.shape.size()) + " dimensions, the tensor " +
                      std::to_string(n));
    for (std::size_t d = 0; d < n; ++d) {
      if (c.offsets[d] < 0 || c.shape[d] < 0 || c.offsets[d] > t.shape[d] ||
          c.shape[d] > t.shape[d] - c.offsets[d])
        return DataLoss(cw + " covers " + Box(c.offsets, c.shape) + ", outside the tensor's shape " +
                        ShapeText(t.shape));
      if (t.replicated && (c.offsets[d] != 0 || c.shape[d] != t.shape[d]))
        return DataLoss(cw + " covers " + Box(c.offsets, c.shape) +
                        ", but the tensor is replicated: every copy is " + ShapeText(t.shape) + " whole");
    }
    covered += Elements(c.shape, ckpt::DTypeSize(t.dtype)).value_or(0);
  }
  if (t.replicated) return Status::Ok();
  // No two boxes overlap: sorted by their start in dimension 0, each is compared with those
  // that start before it ends there.
  std::vector<const ExportChunk*> order;
  for (const auto& c : t.chunks)
    if (Elements(c.shape, 1).value_or(0) > 0) order.push_back(&c);
  if (n > 0)
    std::sort(order.begin(), order.end(), [](auto* a, auto* b) { return a->offsets[0] < b->offsets[0]; });
  for (std::size_t i = 0; i < order.size(); ++i) {
    for (std::size_t j = i + 1; j < order.size(); ++j) {
      const ExportChunk& a = *order[i];
      const ExportChunk& b = *order[j];
      if (n > 0 && b.offsets[0] >= a.offsets[0] + a.shape[0]) break;
      bool overlap = true;
      for (std::size_t d = 0; d < n && overlap; ++d)
        overlap = a.offsets[d] < b.offsets[d] + b.shape[d] && b.offsets[d] < a.offsets[d] + a.shape[d];
      if (overlap)
        return DataLoss(what + ": the chunks of rank " + std::to_string(a.rank) + " " +
                        Box(a.offsets, a.shape) + " and rank " + std::to_string(b.rank) + " " +
                        Box(b.offsets, b.shape) + " overlap; they do not tile the tensor");
    }
  }
  if (covered != *volume)
    return DataLoss(what + ": its " + std::to_string(t.chunks.size()) + " chunks cover " +
                    std::to_string(covered) + " of its " + std::to_string(*volume) + " elements " +
                    ShapeText(t.shape) + "; they do not tile the tensor (a chunk is missing)");
  return Status::Ok();
}

Result<std::uint64_t> ParseByteSize(std::string_view text) {
  const auto bad = [&](const std::string& why) {
    return ckpt::InvalidArgument(
        "--max-shard-size " + Quote(std::string(text)) + ": " + why +
        " (write a byte count or a number with KB, MB, GB, TB or KiB, MiB, GiB, TiB, e.g. "
        "5GB, 500MB, 2GiB)");
  };
  std::string_view s = text;
  while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
  while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
  std::size_t digits = 0;
  while (digits < s.size() && (std::isdigit(static_cast<unsigned char>(s[digits])) || s[digits] == '.'))
    ++digits;
  std::string_view number = s.substr(0, digits), unit = s.substr(digits);
  while (!unit.empty() && unit.front() == ' ') unit.remove_prefix(1);
  if (number.empty() || std::count(number.begin(), number.end(), '.') > 1 || number == ".")
    return bad("not a number followed by a unit");
  std::string upper(unit);
  for (auto& ch : upper) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  static const std::map<std::string, double> kUnits = {
      {"", 1},      {"B", 1},        {"KB", 1e3},        {"MB", 1e6},           {"GB", 1e9},
      {"TB", 1e12}, {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}, {"TIB", 1099511627776.0}};
  auto it = kUnits.find(upper);
  if (it == kUnits.end()) return bad("unknown unit " + Quote(std::string(unit)));
  if (unit == "b" || (unit.size() == 2 && unit[1] == 'b'))
    return bad("ambiguous unit " + Quote(std::string(unit)) +
               ": transformers reads a lower-case b as bits, huggingface_hub as bytes; write " + upper);
  const std::string num(number);
  char* end = nullptr;
  const double value = std::strtod(num.c_str(), &end);
  if (end != num.c_str() + num.size()) return bad("not a number followed by a unit");
  const double bytes = std::floor(value * it->second);
  if (!(bytes >= 1)) return bad("a file must hold at least one byte");
  if (bytes > 1.8e19) return bad("too large");
  return static_cast<std::uint64_t>(bytes);
}

std::vector<ExportFile> PackFiles(const std::vector<std::uint64_t>& sizes, std::uint64_t max_bytes) {
  std::vector<ExportFile> files;
  bool current_open = false;  // the last file takes more tensors
  for (std::size_t i = 0; i < sizes.size(); ++i) {
    if (sizes[i] > max_bytes) {
      files.push_back({{}, {i}, sizes[i]});
      current_open = false;
      continue;
    }
    if (!current_open || files.back().data_bytes + sizes[i] > max_bytes) {
      files.push_back({});
      current_open = true;
    }
    files.back().tensors.push_back(i);
    files.back().data_bytes += sizes[i];
  }
  for (std::size_t i = 0; i < files.size(); ++i) files[i].name = ExportFileName(i, files.size());
  return files;
}

std::string ExportFileName(std::size_t index, std::size_t count) {
  if (count == 1) return "model.safetensors";
  char buf[64];
  std::snprintf(buf, sizeof buf, "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return buf;
}

Result<ExportReport> RunExport(const ExportOptions& options) {
  std::unique_ptr<ShardSet> shards;
  RaiseOpenFileLimit();
  auto src = Load(options.root, options.job, options.version, &shards);
  if (!src.ok()) return src.status();
  ExportReport report;
  if (Status s = SelectTensors(src->tensors, options.filter, options.blobs, &report.skipped_blobs); !s.ok())
    return s;
  // Only what is exported must be intact: a filter can save the rest of a damaged version.
  if (Status s = CheckAgainstShards(*shards, src.value()); !s.ok()) return s;
  for (const auto& t : src->tensors)
    if (Status s = CheckTiling(t); !s.ok()) return s;

  std::vector<std::uint64_t> sizes;
  for (const auto& t : src->tensors) sizes.push_back(t.bytes());
  report.job = src->job;
  report.version = src->version;
  report.world_size = src->world_size;
  report.from_index = src->from_index;
  report.out = options.out;
  report.files = PackFiles(sizes, options.max_shard_bytes);
  for (const auto& t : src->tensors) {
    report.tensor_names.push_back(t.name);
    report.total_size += t.bytes();
  }

  OutputDir dir;
  if (Status s = dir.Open(options.out, options.force); !s.ok()) return s;
  TensorCopier copier(*shards, options.interrupted);
  for (const ExportFile& file : report.files) {
    std::vector<const ExportTensor*> order;
    for (std::size_t i : file.tensors) order.push_back(&src->tensors[i]);
    std::stable_sort(order.begin(), order.end(), [](const ExportTensor* a, const ExportTensor* b) {
      return ckpt::DTypeSize(a->dtype) > ckpt::DTypeSize(b->dtype);
    });
    std::vector<std::uint64_t> offsets;
    const std::string header = RenderHeader(order, src.value(), &offsets);
    auto out = dir.Create(file.name, header.size() + file.data_bytes);
    if (!out.ok()) return out.status();
    if (Status s = WriteFully(out->fd.get(), header.data(), header.size(), 0, out->path); !s.ok()) return s;
    for (std::size_t i = 0; i < order.size(); ++i) {
      if (Status s = copier.Copy(*order[i], out.value(), header.size() + offsets[i], &report.warnings);
          !s.ok())
        return s;
    }
    if (::fsync(out->fd.get()) != 0) return ckpt::IoError("cannot sync " + out->path, errno);
  }
  if (Status s = WriteIndex(dir, report.files, src->tensors, report.total_size); !s.ok()) return s;
  if (Status s = dir.Commit(); !s.ok()) return s;
  return report;
}

}  // namespace ckptctl
