// read_shard / read_shard_header: the shard file as Python values, for the daemon-less
// loader (python/ckpt/loader.py).
//
// What flows out: a dict with the shard's metadata and one dict per item in file order
// (name, kind, dtype, shape, offset, length, checksum and, for read_shard, `data`: a
// bytearray of exactly the item's bytes). Each item gets its own bytearray, so a tensor
// built over it with torch.frombuffer / numpy.frombuffer owns its memory alone (no view
// into a shared temporary buffer). The bytes are checksummed as they sit in that
// bytearray, so what is verified is what the caller gets. File I/O and hashing run with
// the GIL released.
#include "shard_reader.h"

#include <ckpt/client.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <string>
#include <vector>

#include "common/names.h"
#include "common/safe_file.h"
#include "common/unique_fd.h"
#include "format/checksum.h"
#include "format/dtype.h"
#include "format/shard_files.h"
#include "format/shard_format.h"

namespace py = pybind11;

namespace ckpt::python {
namespace {

[[noreturn]] void Throw(const Status& s) { throw ckpt::Error(GrpcCodeNumber(s.code()), s.message()); }

// Opens `path` (common/safe_file.h: a FIFO, device, directory or symbolic link there is
// refused at once, as ckpt.Error DATA_LOSS naming it) and parses its header from the same
// descriptor. Another open failure becomes OSError (FileNotFoundError, PermissionError,
// ...) with the path, as Python's own open() would raise.
struct OpenShard {
  UniqueFd fd;
  ShardInfo info;
};

OpenShard Open(const std::string& path) {
  OpenShard shard;
  int open_errno = 0;
  Result<ShardInfo> info = Status::Ok();
  {
    py::gil_scoped_release release;
    auto fd = OpenRegularForRead(path);
    if (fd.ok()) {
      shard.fd = std::move(fd.value());
      info = ReadShardHeader(shard.fd.get(), path);
    } else if (fd.status().code() == StatusCode::kDataLoss) {
      info = fd.status();
    } else {
      open_errno = fd.status().code() == StatusCode::kNotFound ? ENOENT : (errno != 0 ? errno : EIO);
    }
  }
  if (open_errno != 0) {
    errno = open_errno;
    PyErr_SetFromErrnoWithFilename(PyExc_OSError, path.c_str());
    throw py::error_already_set();
  }
  if (!info.ok()) Throw(info.status());
  shard.info = std::move(info).value();
  return shard;
}

py::dict ToPython(const std::string& path, const ShardInfo& info, std::vector<py::object>* data) {
  py::list items;
  for (std::size_t i = 0; i < info.items.size(); ++i) {
    const ShardItem& it = info.items[i];
    py::dict d;
    d["name"] = it.name;
    d["kind"] = it.kind == ItemKind::kBlob ? "blob" : "tensor";
    d["dtype"] = std::string(DTypeName(it.dtype));
    py::tuple shape(it.shape.size());
    for (std::size_t k = 0; k < it.shape.size(); ++k) shape[k] = it.shape[k];
    d["shape"] = std::move(shape);
    d["offset"] = it.offset;
    d["in_base"] = it.in_base;
    d["length"] = it.length;
    d["checksum"] = ChecksumHex(it.checksum);
    if (data) d["data"] = (*data)[i];
    items.append(std::move(d));
  }
  py::dict out;
  out["path"] = path;
  out["job"] = info.meta.job;
  out["version"] = info.meta.version;
  out["rank"] = info.meta.rank;
  out["world_size"] = info.meta.world_size;
  out["data_start"] = info.data_start;
  out["file_bytes"] = info.file_bytes;
  out["base"] = info.base ? py::object(py::int_(*info.base)) : py::object(py::none());
  out["items"] = std::move(items);
  return out;
}

py::dict ReadShard(const std::string& path, bool verify) {
  OpenShard shard = Open(path);
  const ShardInfo& info = shard.info;
  // Allocate every item's bytearray first (needs the GIL), then fill them without it.
  std::vector<py::object> data;
  std::vector<char*> dest;
  data.reserve(info.items.size());
  dest.reserve(info.items.size());
  for (const ShardItem& it : info.items) {
    PyObject* ba = PyByteArray_FromStringAndSize(nullptr, static_cast<Py_ssize_t>(it.length));
    if (!ba) throw py::error_already_set();
    data.push_back(py::reinterpret_steal<py::object>(ba));
    dest.push_back(PyByteArray_AS_STRING(ba));
  }
  Status status;
  {
    py::gil_scoped_release release;
    // A differential shard's unchanged items are read from its base (format/shard_files.h).
    auto files = ShardFiles::Adopt(std::move(shard.fd), info, path);
    if (!files.ok()) status = files.status();
    for (std::size_t i = 0; i < info.items.size() && status.ok(); ++i) {
      const ShardItem& it = info.items[i];
      status = files->Read(i, 0, dest[i], it.length);
      if (!status.ok() || !verify) continue;
      std::uint64_t sum = Checksum::Of(dest[i], it.length);
      if (sum != it.checksum) {
        status = DataLoss(*files->Locate(i).path + ": checksum mismatch in " +
                          std::string(it.kind == ItemKind::kBlob ? "blob " : "item ") + QuoteName(it.name) +
                          " (stored " + ChecksumHex(it.checksum) + ", computed " + ChecksumHex(sum) + ")");
      }
    }
  }
  if (!status.ok()) Throw(status);
  return ToPython(path, info, &data);
}

}  // namespace

void BindShardReader(py::module_& m) {
  m.def("read_shard", &ReadShard, py::arg("path"), py::arg("verify") = true,
        "Reads a shard file (no daemon needed). Returns a dict: path, job, version, rank, "
        "world_size, data_start, file_bytes and items, a list in file order of dicts (name, kind "
        "'tensor' or 'blob', dtype, shape, offset, length, checksum, data: a bytearray of the item's "
        "bytes, one per item). verify: check every item's xxh3 checksum (a mismatch raises "
        "ckpt.Error naming the item and the file, code 15 DATA_LOSS). A malformed file raises "
        "ckpt.Error; a file that cannot be opened raises OSError.");
  m.def(
      "read_shard_header",
      [](const std::string& path) {
        OpenShard shard = Open(path);
        return ToPython(path, shard.info, nullptr);
      },
      py::arg("path"), "As read_shard, without reading the data (items have no 'data').");
}

}  // namespace ckpt::python
