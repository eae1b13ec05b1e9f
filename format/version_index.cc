#include "format/version_index.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

#include "common/names.h"
#include "format/limits.h"
#include "format/paths.h"

namespace ckpt {
namespace {

using Json = nlohmann::json;

// A JSON string. Names are mostly plain ASCII, which needs no escapes: written as it is
// (the JSON library's dump, which Render used for every string, took most of its time).
std::string Str(std::string_view s) {
  for (unsigned char c : s) {
    if (c < 0x20 || c >= 0x7f || c == '"' || c == '\\') return Json(s).dump();
  }
  std::string out;
  out.reserve(s.size() + 2);
  out += '"';
  out += s;
  out += '"';
  return out;
}

std::string Dims(const std::vector<std::int64_t>& dims) {
  std::string out = "[";
  for (std::size_t i = 0; i < dims.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(dims[i]);
  }
  return out + "]";
}

// --- Parse -------------------------------------------------------------------------------

// Where in the file a value is, for errors: "tensors.\"w\".chunks[3]".
class Where {
 public:
  explicit Where(std::string path) : path_(std::move(path)) {}
  Where Key(std::string_view key) const { return Where(path_ + "." + std::string(key)); }
  Where Name(std::string_view name) const { return Where(path_ + "." + QuoteName(name)); }
  Where At(std::size_t i) const { return Where(path_ + "[" + std::to_string(i) + "]"); }
  Status Bad(const std::string& what) const { return DataLoss("index.json: " + path_ + ": " + what); }

 private:
  std::string path_;
};

// The members of an object, which must be exactly `keys`.
Status CheckKeys(const Json& j, const Where& where, std::initializer_list<std::string_view> keys) {
  if (!j.is_object()) return where.Bad("is not an object");
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (std::find(keys.begin(), keys.end(), it.key()) == keys.end()) {
      return where.Bad("has an unknown member " + QuoteName(it.key()));
    }
  }
  for (std::string_view k : keys) {
    if (!j.contains(std::string(k))) return where.Bad("lacks \"" + std::string(k) + "\"");
  }
  return Status::Ok();
}

Status GetUint(const Json& j, const Where& where, std::uint64_t max, std::uint64_t* out) {
  if (!j.is_number_unsigned() || j.get<std::uint64_t>() > max) {
    return where.Bad("is not an integer from 0 to " + std::to_string(max));
  }
  *out = j.get<std::uint64_t>();
  return Status::Ok();
}

Status GetRank(const Json& j, const Where& where, std::uint32_t world_size, std::uint32_t* out) {
  std::uint64_t r = 0;
  if (Status s = GetUint(j, where, world_size - 1, &r); !s.ok()) return s;
  *out = static_cast<std::uint32_t>(r);
  return Status::Ok();
}

Status GetDims(const Json& j, const Where& where, std::vector<std::int64_t>* out) {
  if (!j.is_array() || j.size() > 64) return where.Bad("is not an array of dimensions");
  out->clear();
  for (const auto& d : j) {
    if (!d.is_number_unsigned() || d.get<std::uint64_t>() > static_cast<std::uint64_t>(INT64_MAX)) {
      return where.Bad("is not an array of non-negative integers");
    }
    out->push_back(d.get<std::int64_t>());
  }
  return Status::Ok();
}

Status GetName(const Json& j, const Where& where, std::string* out) {
  if (!j.is_string()) return where.Bad("is not a string");
  *out = j.get<std::string>();
  if (std::string err = CheckItemName(*out); !err.empty()) return where.Bad(err);
  return Status::Ok();
}

Status GetDType(const Json& j, const Where& where, DType* out) {
  if (!j.is_string()) return where.Bad("is not a dtype name");
  auto dtype = ParseDType(j.get<std::string>());
  if (!dtype) return where.Bad("is an unknown dtype " + QuoteName(j.get<std::string>()));
  *out = *dtype;
  return Status::Ok();
}

// "file" must be the shard of `rank`, "key" a safetensors key of an item there.
Status GetFileAndKey(const Json& j, const Where& where, std::uint32_t rank, std::string* file,
                     std::string* key) {
  if (!j["file"].is_string() || j["file"].get<std::string>() != ShardFileName(rank)) {
    return where.Key("file").Bad("is not " + ShardFileName(rank) + ", the shard of rank " +
                                 std::to_string(rank));
  }
  *file = j["file"].get<std::string>();
  if (!j["key"].is_string()) return where.Key("key").Bad("is not a string");
  *key = j["key"].get<std::string>();
  std::string_view name = *key;
  if (name.starts_with(kBlobPrefix)) name.remove_prefix(kBlobPrefix.size());
  if (std::string err = CheckItemName(name); !err.empty()) return where.Key("key").Bad(err);
  return Status::Ok();
}

Status ParseChunk(const Json& j, const Where& where, const IndexTensor& tensor, std::uint32_t world_size,
                  IndexChunk* out) {
  if (Status s = CheckKeys(j, where, {"rank", "file", "key", "offsets", "shape"}); !s.ok()) return s;
  if (Status s = GetRank(j["rank"], where.Key("rank"), world_size, &out->rank); !s.ok()) return s;
  if (Status s = GetFileAndKey(j, where, out->rank, &out->file, &out->key); !s.ok()) return s;
  if (Status s = GetDims(j["offsets"], where.Key("offsets"), &out->offsets); !s.ok()) return s;
  if (Status s = GetDims(j["shape"], where.Key("shape"), &out->shape); !s.ok()) return s;
  if (out->offsets.size() != tensor.shape.size() || out->shape.size() != tensor.shape.size()) {
    return where.Bad("has offsets " + Dims(out->offsets) + " and shape " + Dims(out->shape) +
                     " for a tensor of shape " + Dims(tensor.shape));
  }
  for (std::size_t d = 0; d < tensor.shape.size(); ++d) {
    if (out->shape[d] > tensor.shape[d] || out->offsets[d] > tensor.shape[d] - out->shape[d]) {
      return where.Bad("box at " + Dims(out->offsets) + " of shape " + Dims(out->shape) +
                       " does not fit the tensor's shape " + Dims(tensor.shape));
    }
    if (tensor.replicated && (out->offsets[d] != 0 || out->shape[d] != tensor.shape[d])) {
      return where.Bad("is a chunk of a replicated tensor but not the whole tensor");
    }
  }
  return Status::Ok();
}

Status ParseTensor(const Json& j, const Where& where, std::uint32_t world_size, IndexTensor* out) {
  if (Status s = CheckKeys(j, where, {"dtype", "shape", "replicated", "chunks"}); !s.ok()) return s;
  if (Status s = GetDType(j["dtype"], where.Key("dtype"), &out->dtype); !s.ok()) return s;
  if (Status s = GetDims(j["shape"], where.Key("shape"), &out->shape); !s.ok()) return s;
  if (!j["replicated"].is_boolean()) return where.Key("replicated").Bad("is not true or false");
  out->replicated = j["replicated"].get<bool>();
  const Json& chunks = j["chunks"];
  if (!chunks.is_array()) return where.Key("chunks").Bad("is not an array");
  out->chunks.resize(chunks.size());
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    if (Status s = ParseChunk(chunks[i], where.Key("chunks").At(i), *out, world_size, &out->chunks[i]);
        !s.ok()) {
      return s;
    }
  }
  return Status::Ok();
}

Status ParseItem(const Json& j, const Where& where, std::uint32_t rank, IndexItem* out) {
  if (Status s = CheckKeys(j, where, {"name", "file", "key", "dtype", "shape"}); !s.ok()) return s;
  if (Status s = GetName(j["name"], where.Key("name"), &out->name); !s.ok()) return s;
  if (Status s = GetFileAndKey(j, where, rank, &out->file, &out->key); !s.ok()) return s;
  if (Status s = GetDType(j["dtype"], where.Key("dtype"), &out->dtype); !s.ok()) return s;
  return GetDims(j["shape"], where.Key("shape"), &out->shape);
}

Status ParseBlob(const Json& j, const Where& where, std::uint32_t world_size, IndexBlob* out) {
  if (Status s = CheckKeys(j, where, {"rank", "name", "file", "key", "bytes", "for_rank"}); !s.ok()) return s;
  if (Status s = GetRank(j["rank"], where.Key("rank"), world_size, &out->rank); !s.ok()) return s;
  if (Status s = GetName(j["name"], where.Key("name"), &out->name); !s.ok()) return s;
  if (Status s = GetFileAndKey(j, where, out->rank, &out->file, &out->key); !s.ok()) return s;
  if (Status s = GetUint(j["bytes"], where.Key("bytes"), kMaxShardDataBytes, &out->bytes); !s.ok()) return s;
  if (!j["for_rank"].is_null()) {
    std::uint32_t r = 0;
    if (Status s = GetRank(j["for_rank"], where.Key("for_rank"), world_size, &r); !s.ok()) return s;
    out->for_rank = r;
  }
  return Status::Ok();
}

// --- Build -------------------------------------------------------------------------------

std::uint64_t Volume(const std::vector<std::int64_t>& shape) {
  std::uint64_t v = 1;
  for (auto d : shape) v *= static_cast<std::uint64_t>(d);
  return v;
}

// Two chunks of one tensor that share an element, if any: swept along the dimension whose
// offsets differ most, so that splits along any one dimension cost n log n.
std::optional<std::pair<std::size_t, std::size_t>> FindOverlap(const std::vector<IndexChunk>& chunks,
                                                               std::size_t dims) {
  std::vector<std::size_t> order;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    if (Volume(chunks[i].shape) != 0) order.push_back(i);
  }
  if (order.size() < 2 || dims == 0) {
    return order.size() < 2 ? std::nullopt : std::optional(std::pair(order[0], order[1]));
  }
  std::size_t sweep = 0, most = 0;
  for (std::size_t d = 0; d < dims; ++d) {
    std::set<std::int64_t> distinct;
    for (std::size_t i : order) distinct.insert(chunks[i].offsets[d]);
    if (distinct.size() > most) most = distinct.size(), sweep = d;
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return chunks[a].offsets[sweep] < chunks[b].offsets[sweep];
  });
  for (std::size_t x = 0; x < order.size(); ++x) {
    const IndexChunk& a = chunks[order[x]];
    const std::int64_t a_end = a.offsets[sweep] + a.shape[sweep];
    for (std::size_t y = x + 1; y < order.size() && chunks[order[y]].offsets[sweep] < a_end; ++y) {
      const IndexChunk& b = chunks[order[y]];
      bool meet = true;
      for (std::size_t d = 0; d < dims && meet; ++d) {
        meet = a.offsets[d] < b.offsets[d] + b.shape[d] && b.offsets[d] < a.offsets[d] + a.shape[d];
      }
      if (meet) return std::pair(order[x], order[y]);
    }
  }
  return std::nullopt;
}

Status CheckCoverage(const std::string& name, const IndexTensor& t) {
  if (t.replicated) return Status::Ok();
  const std::uint64_t whole = Volume(t.shape);
  std::uint64_t covered = 0;
  for (const auto& c : t.chunks) covered += Volume(c.shape);  // each <= whole: sums without overlap fit
  if (auto pair = FindOverlap(t.chunks, t.shape.size())) {
    const IndexChunk& a = t.chunks[pair->first];
    const IndexChunk& b = t.chunks[pair->second];
    return FailedPrecondition("global tensor " + QuoteName(name) + ": the chunk of rank " +
                              std::to_string(a.rank) + " (" + QuoteName(a.key) + " at " + Dims(a.offsets) +
                              ", shape " + Dims(a.shape) + ") overlaps the chunk of rank " +
                              std::to_string(b.rank) + " (" + QuoteName(b.key) + " at " + Dims(b.offsets) +
                              ", shape " + Dims(b.shape) + ")");
  }
  if (covered != whole) {
    return FailedPrecondition("global tensor " + QuoteName(name) + " of shape " + Dims(t.shape) + " has " +
                              std::to_string(whole) + " elements, but its chunks on " +
                              std::to_string(t.chunks.size()) + " ranks cover only " +
                              std::to_string(covered) + " of them: every element must be in one rank's item");
  }
  return Status::Ok();
}

}  // namespace

std::string VersionIndex::Render() const {
  std::string out = "{\"format\": " + Str(kIndexFormat) + ", \"job\": " + Str(job) +
                    ", \"version\": " + std::to_string(version) +
                    ", \"world_size\": " + std::to_string(world_size) + ",\n \"tensors\": {";
  bool first = true;
  for (const auto& [name, t] : tensors) {
    out += first ? "\n  " : ",\n  ";
    first = false;
    out += Str(name) + ": {\"dtype\": \"" + std::string(DTypeName(t.dtype)) +
           "\", \"shape\": " + Dims(t.shape) + ", \"replicated\": " + (t.replicated ? "true" : "false") +
           ", \"chunks\": [";
    for (std::size_t i = 0; i < t.chunks.size(); ++i) {
      const IndexChunk& c = t.chunks[i];
      out += i ? ",\n    " : "\n    ";
      out += "{\"rank\": " + std::to_string(c.rank) + ", \"file\": " + Str(c.file) +
             ", \"key\": " + Str(c.key) + ", \"offsets\": " + Dims(c.offsets) +
             ", \"shape\": " + Dims(c.shape) + "}";
    }
    out += "]}";
  }
  out += "},\n \"private\": {";
  first = true;
  for (const auto& [rank, items] : private_items) {
    out += first ? "\n  " : ",\n  ";
    first = false;
    out += "\"" + std::to_string(rank) + "\": [";
    for (std::size_t i = 0; i < items.size(); ++i) {
      const IndexItem& it = items[i];
      out += i ? ",\n    " : "\n    ";
      out += "{\"name\": " + Str(it.name) + ", \"file\": " + Str(it.file) + ", \"key\": " + Str(it.key) +
             ", \"dtype\": \"" + std::string(DTypeName(it.dtype)) + "\", \"shape\": " + Dims(it.shape) + "}";
    }
    out += "]";
  }
  out += "},\n \"blobs\": [";
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    const IndexBlob& b = blobs[i];
    out += i ? ",\n  " : "\n  ";
    out += "{\"rank\": " + std::to_string(b.rank) + ", \"name\": " + Str(b.name) +
           ", \"file\": " + Str(b.file) + ", \"key\": " + Str(b.key) +
           ", \"bytes\": " + std::to_string(b.bytes) +
           ", \"for_rank\": " + (b.for_rank ? std::to_string(*b.for_rank) : "null") + "}";
  }
  out += "]}\n";
  return out;
}

Result<VersionIndex> VersionIndex::Parse(std::string_view text) {
  if (text.size() > kMaxIndexBytes)
    return DataLoss("index.json is larger than " + std::to_string(kMaxIndexBytes));
  Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return DataLoss("index.json is not JSON");
  const Where top("top level");
  if (Status s = CheckKeys(j, top, {"format", "job", "version", "world_size", "tensors", "private", "blobs"});
      !s.ok()) {
    return s;
  }
  if (!j["format"].is_string() || j["format"].get<std::string>() != kIndexFormat) {
    return top.Key("format").Bad("is not \"" + std::string(kIndexFormat) + "\" (an index this reader knows)");
  }
  VersionIndex index;
  if (!j["job"].is_string() || !CheckJobId(j["job"].get<std::string>()).empty()) {
    return top.Key("job").Bad("is not a job id");
  }
  index.job = j["job"].get<std::string>();
  if (Status s = GetUint(j["version"], top.Key("version"), UINT64_MAX, &index.version); !s.ok()) return s;
  std::uint64_t world = 0;
  if (Status s = GetUint(j["world_size"], top.Key("world_size"), kMaxWorldSize, &world); !s.ok()) return s;
  if (world == 0) return top.Key("world_size").Bad("is 0");
  index.world_size = static_cast<std::uint32_t>(world);

  const Json& tensors = j["tensors"];
  if (!tensors.is_object()) return top.Key("tensors").Bad("is not an object");
  for (auto it = tensors.begin(); it != tensors.end(); ++it) {
    const Where where = Where("tensors").Name(it.key());
    if (std::string err = CheckItemName(it.key()); !err.empty()) return where.Bad(err);
    IndexTensor t;
    if (Status s = ParseTensor(it.value(), where, index.world_size, &t); !s.ok()) return s;
    index.tensors.emplace(it.key(), std::move(t));
  }
  const Json& priv = j["private"];
  if (!priv.is_object()) return top.Key("private").Bad("is not an object");
  for (auto it = priv.begin(); it != priv.end(); ++it) {
    const Where where = Where("private").Name(it.key());
    const std::string& key = it.key();
    if (key.empty() || key.size() > 10 || key.find_first_not_of("0123456789") != std::string::npos ||
        (key.size() > 1 && key[0] == '0') || std::stoull(key) >= index.world_size) {
      return where.Bad("is not a rank of world size " + std::to_string(index.world_size));
    }
    const auto rank = static_cast<std::uint32_t>(std::stoull(key));
    if (!it.value().is_array()) return where.Bad("is not an array");
    auto& items = index.private_items[rank];
    items.resize(it.value().size());
    for (std::size_t i = 0; i < items.size(); ++i) {
      if (Status s = ParseItem(it.value()[i], where.At(i), rank, &items[i]); !s.ok()) return s;
    }
  }
  const Json& blobs = j["blobs"];
  if (!blobs.is_array()) return top.Key("blobs").Bad("is not an array");
  index.blobs.resize(blobs.size());
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    if (Status s = ParseBlob(blobs[i], Where("blobs").At(i), index.world_size, &index.blobs[i]); !s.ok())
      return s;
  }
  return index;
}

Status VersionIndexBuilder::Add(const ShardInfo& shard) {
  const ShardMeta& m = shard.meta;
  if (added_ == 0) {
    if (m.world_size == 0) return InvalidArgument("shard has world size 0");
    index_.job = m.job;
    index_.version = m.version;
    index_.world_size = m.world_size;
    seen_.assign(m.world_size, false);
  } else if (m.job != index_.job || m.version != index_.version || m.world_size != index_.world_size) {
    return InvalidArgument("shard of rank " + std::to_string(m.rank) + " is of job " + QuoteName(m.job) +
                           ", version " + std::to_string(m.version) + ", world size " +
                           std::to_string(m.world_size) + ", not of the version being indexed (job " +
                           QuoteName(index_.job) + ", version " + std::to_string(index_.version) +
                           ", world size " + std::to_string(index_.world_size) + ")");
  }
  if (m.rank >= index_.world_size || seen_[m.rank]) {
    return InvalidArgument("rank " + std::to_string(m.rank) + " of world size " +
                           std::to_string(index_.world_size) + " is given twice or is no rank");
  }
  seen_[m.rank] = true;
  ++added_;
  const std::string file = ShardFileName(m.rank);
  for (const ShardItem& item : shard.items) {
    if (item.kind == ItemKind::kBlob) {
      index_.blobs.push_back(
          IndexBlob{m.rank, item.name, file, item.TensorKey(), item.length, item.for_rank});
      continue;
    }
    if (!item.layout) {
      index_.private_items[m.rank].push_back(
          IndexItem{item.name, file, item.TensorKey(), item.dtype, item.shape});
      continue;
    }
    const GlobalLayout& l = *item.layout;
    auto [it, fresh] = index_.tensors.try_emplace(l.global_name);
    IndexTensor& t = it->second;
    if (fresh) {
      t.dtype = item.dtype;
      t.shape = l.global_shape;
      t.replicated = l.replicated;
    } else if (t.dtype != item.dtype || t.shape != l.global_shape || t.replicated != l.replicated) {
      const IndexChunk& other = t.chunks.front();
      return FailedPrecondition("global tensor " + QuoteName(l.global_name) + " is declared as " +
                                std::string(DTypeName(t.dtype)) + " " + Dims(t.shape) +
                                (t.replicated ? " replicated" : "") + " by rank " +
                                std::to_string(other.rank) + " (" + QuoteName(other.key) + ") but as " +
                                std::string(DTypeName(item.dtype)) + " " + Dims(l.global_shape) +
                                (l.replicated ? " replicated" : "") + " by rank " + std::to_string(m.rank) +
                                " (" + QuoteName(item.name) + ")");
    }
    t.chunks.push_back(IndexChunk{m.rank, file, item.TensorKey(), l.offsets, item.shape});
  }
  return Status::Ok();
}

Result<VersionIndex> VersionIndexBuilder::Finish() && {
  if (added_ == 0) return InvalidArgument("no shard to index");
  if (added_ != index_.world_size) {
    const auto missing = std::find(seen_.begin(), seen_.end(), false) - seen_.begin();
    return InvalidArgument("the shard of rank " + std::to_string(missing) + " of " +
                           std::to_string(index_.world_size) + " is missing from the version to index");
  }
  auto by_rank = [](const auto& a, const auto& b) { return a.rank < b.rank; };
  for (auto& [name, t] : index_.tensors) {
    std::stable_sort(t.chunks.begin(), t.chunks.end(), by_rank);
    if (Status s = CheckCoverage(name, t); !s.ok()) return s;
  }
  std::stable_sort(index_.blobs.begin(), index_.blobs.end(), by_rank);
  return std::move(index_);
}

Result<VersionIndex> VersionIndex::Build(const std::vector<ShardInfo>& shards) {
  VersionIndexBuilder builder;
  for (const auto& shard : shards) {
    if (Status s = builder.Add(shard); !s.ok()) return s;
  }
  return std::move(builder).Finish();
}

}  // namespace ckpt
