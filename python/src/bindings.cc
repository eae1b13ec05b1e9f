// _ckpt: Python bindings of libckpt (ckpt/client.h), imported through the `ckpt` package.
//
// This is the thin first layer: it mirrors the C++ client one to one, with Python types at
// the edges (str dtype names, tuples, dicts of bytes, seconds as floats). Framework glue
// (torch state dicts, optimizer state) belongs in pure Python on top of it.
//
// Rules every binding here follows:
//  - Every call that may block (on the daemon, the file system or the CUDA driver) releases
//    the GIL for its whole C++ part, so other Python threads (data loaders, async savers)
//    keep running while the trainer waits; that includes connect and the Client's
//    destructor, which unregisters. Python objects are converted to C++ values before the
//    GIL is released and results are converted back after it is re-acquired.
//  - ckpt::Error becomes ckpt.Error (a RuntimeError subclass) with the daemon's message as
//    its text and the gRPC status code in its `code` attribute; ckpt::DaemonRestartedError
//    becomes its subclass ckpt.DaemonRestartedError, with the lost versions in `versions`.
//  - SharedRegion exports its memory through the buffer protocol (1-D, unsigned bytes,
//    writable), so memoryview(region), numpy.frombuffer(region, ...) and
//    torch.frombuffer(region, dtype=...) view the daemon-visible memory without a copy.
//    Such views keep the region object (and so the mapping) alive.
//  - GPU tensors are items whose 4th element is the device address (an int, as
//    tensor.data_ptr() gives it) instead of a SharedRegion; CUDA streams are passed as ints
//    (cudaStream_t values) or as objects with a `cuda_stream` attribute (torch.cuda.Stream).
#include <ckpt/client.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "shard_reader.h"

namespace py = pybind11;

namespace {

// The safetensors dtype names, as the shard format writes them.
constexpr std::array<std::pair<std::string_view, ckpt::DType>, 15> kDTypes{{
    {"F64", ckpt::DType::kF64},
    {"F32", ckpt::DType::kF32},
    {"F16", ckpt::DType::kF16},
    {"BF16", ckpt::DType::kBF16},
    {"F8_E4M3", ckpt::DType::kF8E4M3},
    {"F8_E5M2", ckpt::DType::kF8E5M2},
    {"I64", ckpt::DType::kI64},
    {"I32", ckpt::DType::kI32},
    {"I16", ckpt::DType::kI16},
    {"I8", ckpt::DType::kI8},
    {"U64", ckpt::DType::kU64},
    {"U32", ckpt::DType::kU32},
    {"U16", ckpt::DType::kU16},
    {"U8", ckpt::DType::kU8},
    {"BOOL", ckpt::DType::kBool},
}};

std::string_view DTypeNameOf(ckpt::DType dtype) {
  for (const auto& [n, d] : kDTypes) {
    if (d == dtype) return n;
  }
  return "?";
}

ckpt::DType ParseDType(const std::string& name) {
  for (const auto& [n, d] : kDTypes) {
    if (n == name) return d;
  }
  std::string message = "unknown dtype '" + name + "' (expected one of:";
  for (const auto& [n, d] : kDTypes) message.append(" ").append(n);
  throw py::value_error(message.append(")"));
}

// Seconds (None or <= 0: wait forever) to the client's milliseconds (0: forever). A positive
// timeout shorter than 1 ms becomes 1 ms rather than "forever".
std::chrono::milliseconds ToTimeout(std::optional<double> seconds) {
  if (!seconds || *seconds <= 0) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(*seconds * 1000.0)));
}

std::string TypeName(const py::handle& value) { return py::str(py::type::handle_of(value).attr("__name__")); }

// bytes, bytearray, memoryview or any C-contiguous buffer -> std::string (a copy).
std::string BlobBytes(const std::string& name, const py::handle& value) {
  if (py::isinstance<py::bytes>(value)) return std::string(py::reinterpret_borrow<py::bytes>(value));
  if (PyObject_CheckBuffer(value.ptr()) && !py::isinstance<py::str>(value)) {
    Py_buffer view;
    if (PyObject_GetBuffer(value.ptr(), &view, PyBUF_C_CONTIGUOUS) != 0) throw py::error_already_set();
    std::string out(static_cast<const char*>(view.buf), static_cast<std::size_t>(view.len));
    PyBuffer_Release(&view);
    return out;
  }
  throw py::type_error("blob '" + name + "' must be bytes-like, not " + TypeName(value));
}

// A dict name -> bytes-like or ckpt.Blob (whose for_rank is kept; its name, if set, must be
// the key).
std::vector<ckpt::Blob> ToBlobs(const std::optional<py::dict>& blobs) {
  std::vector<ckpt::Blob> out;
  if (!blobs) return out;
  out.reserve(blobs->size());
  for (const auto& [k, v] : *blobs) {
    if (!py::isinstance<py::str>(k)) throw py::type_error("blob names must be str");
    std::string name = py::cast<std::string>(k);
    if (py::isinstance<ckpt::Blob>(v)) {
      ckpt::Blob b = py::cast<ckpt::Blob>(v);
      if (!b.name.empty() && b.name != name) {
        throw py::value_error("blob '" + name + "' is a ckpt.Blob named '" + b.name + "'");
      }
      b.name = name;
      out.push_back(std::move(b));
      continue;
    }
    out.push_back(ckpt::Blob{name, BlobBytes(name, v)});
  }
  return out;
}

py::dict FromBlobs(const std::vector<ckpt::Blob>& blobs) {
  py::dict out;
  for (const auto& b : blobs) out[py::str(b.name)] = py::bytes(b.data);
  return out;
}

// An int that is not a bool (True would otherwise pass as address or stream 1).
bool IsInt(const py::handle& value) {
  return py::isinstance<py::int_>(value) && !py::isinstance<py::bool_>(value);
}

// One item as Python passes it: a ckpt.TensorItem, or (name, dtype, shape, region[, offset]
// [, layout]) for host memory or (name, dtype, shape, device_ptr[, offset][, layout]) for GPU
// memory (address device_ptr + offset), layout a ckpt.Layout.
ckpt::TensorItem ToItem(const py::handle& obj) {
  if (py::isinstance<ckpt::TensorItem>(obj)) {
    ckpt::TensorItem item = py::cast<ckpt::TensorItem>(obj);
    if (!item.region && item.cuda_ptr == nullptr) {
      throw py::value_error("item '" + item.name + "' has neither a region nor a device_ptr");
    }
    return item;
  }
  if (!py::isinstance<py::sequence>(obj) || py::isinstance<py::str>(obj)) {
    throw py::type_error(
        "an item must be a tuple (name, dtype, shape, region or device pointer[, offset]), not " +
        TypeName(obj));
  }
  auto t = py::reinterpret_borrow<py::sequence>(obj);
  std::size_t n = t.size();
  std::optional<ckpt::Layout> layout;
  if ((n == 5 || n == 6) && py::isinstance<ckpt::Layout>(t[n - 1])) {
    layout = py::cast<ckpt::Layout>(t[n - 1]);
    --n;
  }
  if (n != 4 && n != 5) {
    throw py::type_error(
        "an item must have 4 or 5 elements (name, dtype, shape, region or device pointer[, "
        "offset]), and a ckpt.Layout may follow, not " +
        std::to_string(t.size()));
  }
  ckpt::TensorItem item;
  item.name = py::cast<std::string>(t[0]);
  item.dtype = ParseDType(py::cast<std::string>(t[1]));
  item.shape = py::cast<std::vector<std::int64_t>>(t[2]);
  item.layout = std::move(layout);
  std::uint64_t offset = n == 5 ? py::cast<std::uint64_t>(t[4]) : 0;
  py::object where = t[3];
  if (py::isinstance<ckpt::SharedRegion>(where)) {
    item.region = py::cast<std::shared_ptr<ckpt::SharedRegion>>(where);
    item.offset = offset;
  } else if (IsInt(where)) {
    auto ptr = py::cast<std::uintptr_t>(where);
    if (ptr == 0) throw py::value_error("item '" + item.name + "': device pointer is 0");
    item.cuda_ptr = reinterpret_cast<const void*>(ptr + offset);
  } else {
    throw py::type_error("item '" + item.name +
                         "': 4th element must be a ckpt.SharedRegion or an int device "
                         "pointer (tensor.data_ptr()), not " +
                         TypeName(where));
  }
  return item;
}

// None or 0: the legacy default stream; an int: a cudaStream_t; else an object with a
// `cuda_stream` attribute (torch.cuda.Stream).
void* ToStream(const py::object& stream) {
  if (stream.is_none()) return nullptr;
  if (IsInt(stream)) return reinterpret_cast<void*>(py::cast<std::uintptr_t>(stream));
  if (py::hasattr(stream, "cuda_stream"))
    return reinterpret_cast<void*>(py::cast<std::uintptr_t>(stream.attr("cuda_stream")));
  throw py::type_error("stream must be an int (cudaStream_t), None or have a `cuda_stream` attribute, not " +
                       TypeName(stream));
}

// Holder of Client objects: the destructor unregisters (a blocking RPC), so it runs with the
// GIL released. Deallocation always happens with the GIL held by this thread.
struct ClientDeleter {
  void operator()(ckpt::Client* c) const {
    py::gil_scoped_release release;
    delete c;
  }
};
using ClientHolder = std::unique_ptr<ckpt::Client, ClientDeleter>;

}  // namespace

PYBIND11_MODULE(_ckpt, m) {
  m.doc() = "Bindings of libckpt, the client of the ckptd checkpoint daemon (use the `ckpt` package)";

  // ckpt.Error: raised for every failure the client or the daemon reports. Created once;
  // the module keeps the reference (released here on purpose so that no static object
  // drops a reference after the interpreter has shut down).
  static PyObject* error_type = py::exception<ckpt::Error>(m, "Error", PyExc_RuntimeError).release().ptr();
  py::setattr(error_type, "__doc__",
              py::str("Error reported by libckpt or ckptd. str(e) is the message; e.code is the gRPC "
                      "status code (int) of the failed call."));
  py::setattr(error_type, "code", py::none());
  // ckpt.DaemonRestartedError: versions lost to a daemon restart (see ckpt/client.h).
  static PyObject* restarted_type =
      py::exception<ckpt::DaemonRestartedError>(m, "DaemonRestartedError", error_type).release().ptr();
  py::setattr(restarted_type, "__doc__",
              py::str("Versions lost to a restart of ckptd: the call's version, and every other lost version "
                      "not reported before, were not captured (or not made durable, or not committed). "
                      "e.versions: those versions (list of int, ascending); e.code: 10 (ABORTED). The client "
                      "registered again with the restarted daemon: later snapshots work."));
  py::setattr(restarted_type, "versions", py::none());
  // ckpt.TornSnapshotError: a version aborted because its memory changed during its copy.
  static PyObject* torn_type =
      py::exception<ckpt::TornSnapshotError>(m, "TornSnapshotError", error_type).release().ptr();
  py::setattr(torn_type, "__doc__",
              py::str("A version aborted because registered memory changed between its snapshot and the end of "
                      "its copy (a torn snapshot): found by the daemon's verification (the message names the "
                      "item and its bytes) or reported by abort_snapshot. It is never committed; the previous "
                      "committed version is untouched. e.version: its number; e.code: 10 (ABORTED)."));
  py::setattr(torn_type, "version", py::none());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ckpt::TornSnapshotError& e) {
      py::object inst = py::reinterpret_borrow<py::object>(torn_type)(e.what());
      inst.attr("code") = e.code();
      inst.attr("version") = e.version();
      PyErr_SetObject(torn_type, inst.ptr());
    } catch (const ckpt::DaemonRestartedError& e) {
      py::object inst = py::reinterpret_borrow<py::object>(restarted_type)(e.what());
      inst.attr("code") = e.code();
      inst.attr("versions") = py::cast(e.versions());
      PyErr_SetObject(restarted_type, inst.ptr());
    } catch (const ckpt::Error& e) {
      py::object inst = py::reinterpret_borrow<py::object>(error_type)(e.what());
      inst.attr("code") = e.code();
      PyErr_SetObject(error_type, inst.ptr());
    }
  });

  ckpt::python::BindShardReader(m);

  py::enum_<ckpt::Level>(m, "Level", "Durability levels of a version (see wait_durable)")
      .value("CAPTURED", ckpt::Level::kCaptured, "every byte copied out of trainer memory")
      .value("LOCAL", ckpt::Level::kLocal, "durable on the daemon's node-local tier")
      .value("PERSISTED", ckpt::Level::kPersisted, "durable on the persistent tier (the shared directory)")
      .value("DURABLE", ckpt::Level::kDurable, "same as PERSISTED")
      .value("COMMITTED", ckpt::Level::kCommitted, "durable on all ranks and the commit marker written")
      .value("REPLICATED", ckpt::Level::kReplicated,
             "held in the memory of the daemon's --replicas peers (refused when replication is off)");

  m.attr("DTYPES") = [] {
    py::tuple t(kDTypes.size());
    for (std::size_t i = 0; i < kDTypes.size(); ++i) t[i] = py::str(std::string(kDTypes[i].first));
    return t;
  }();

  py::class_<ckpt::SharedRegion, std::shared_ptr<ckpt::SharedRegion>>(
      m, "SharedRegion", py::buffer_protocol(),
      "POSIX shared memory that the trainer owns and the daemon may read (and write on restore).\n\n"
      "Supports the buffer protocol (1-D unsigned bytes, writable): torch.frombuffer(region, "
      "dtype=torch.float32, count=n, offset=off) views it without a copy. The name is removed "
      "when the last reference to the region goes away, or when the process exits.")
      .def_static(
          "create",
          [](std::size_t bytes, const std::string& name) {
            py::gil_scoped_release release;
            return ckpt::SharedRegion::create(bytes, name);
          },
          py::arg("bytes"), py::arg("name") = "",
          "Creates a zero-filled region of `bytes` bytes (name: optional shm name; default chosen).")
      .def_buffer([](ckpt::SharedRegion& r) {
        return py::buffer_info(r.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(r.size())}, {1}, /*readonly=*/false);
      })
      .def_property_readonly("size", &ckpt::SharedRegion::size, "Size in bytes")
      .def_property_readonly("name", &ckpt::SharedRegion::name, "Name of the shm object")
      .def_property_readonly(
          "address", [](const ckpt::SharedRegion& r) { return reinterpret_cast<std::uintptr_t>(r.data()); },
          "Address of the mapping in this process")
      .def_property_readonly("generation", &ckpt::SharedRegion::generation,
                             "Changes when the region is resized (registrations then go stale)")
      .def("__len__", &ckpt::SharedRegion::size)
      .def("__repr__", [](const ckpt::SharedRegion& r) {
        return "<ckpt.SharedRegion name='" + r.name() + "' size=" + std::to_string(r.size()) + ">";
      });
  // resize() is left out on purpose: it remaps the memory under any memoryview or tensor
  // built over the region. It needs export tracking before it can be offered safely.

  py::class_<ckpt::Layout>(
      m, "Layout",
      "Where a tensor item sits in a global tensor (see ckpt/client.h): the box [offsets, offsets + "
      "item shape) of global tensor `global_name` (empty: the item's name) of shape `global_shape`, or, "
      "replicated=True, the whole tensor, held the same by every rank that declares it. An item "
      "without a layout is rank-private.")
      .def(py::init([](std::string global_name, std::vector<std::int64_t> global_shape,
                       std::vector<std::int64_t> offsets, bool replicated) {
             return ckpt::Layout{std::move(global_name), std::move(global_shape), std::move(offsets),
                                 replicated};
           }),
           py::arg("global_name") = "", py::arg("global_shape") = std::vector<std::int64_t>{},
           py::arg("offsets") = std::vector<std::int64_t>{}, py::arg("replicated") = false)
      .def_readwrite("global_name", &ckpt::Layout::global_name)
      .def_readwrite("global_shape", &ckpt::Layout::global_shape)
      .def_readwrite("offsets", &ckpt::Layout::offsets)
      .def_readwrite("replicated", &ckpt::Layout::replicated)
      .def(py::pickle(
          [](const ckpt::Layout& l) {
            return py::make_tuple(l.global_name, l.global_shape, l.offsets, l.replicated);
          },
          [](const py::tuple& t) {
            if (t.size() != 4) throw py::value_error("bad pickled ckpt.Layout");
            return ckpt::Layout{t[0].cast<std::string>(), t[1].cast<std::vector<std::int64_t>>(),
                                t[2].cast<std::vector<std::int64_t>>(), t[3].cast<bool>()};
          }))
      .def("__eq__",
           [](const ckpt::Layout& a, const ckpt::Layout& b) {
             return a.global_name == b.global_name && a.global_shape == b.global_shape &&
                    a.offsets == b.offsets && a.replicated == b.replicated;
           })
      .def("__repr__", [](const ckpt::Layout& l) {
        auto dims = [](const std::vector<std::int64_t>& d) {
          std::string out = "[";
          for (std::size_t i = 0; i < d.size(); ++i) out += (i ? ", " : "") + std::to_string(d[i]);
          return out + "]";
        };
        return "ckpt.Layout(global_name='" + l.global_name + "', global_shape=" + dims(l.global_shape) +
               ", offsets=" + dims(l.offsets) + ", replicated=" + (l.replicated ? "True" : "False") + ")";
      });

  py::class_<ckpt::TensorItem>(
      m, "TensorItem",
      "One tensor for register_items (the tuple forms are accepted too): `shape` elements of `dtype` "
      "(a safetensors name) at `offset` in `region` (a SharedRegion), or at GPU address `device_ptr`; "
      "`layout`: a ckpt.Layout or None (rank-private).")
      .def(py::init([](std::string name, const std::string& dtype, std::vector<std::int64_t> shape,
                       std::shared_ptr<ckpt::SharedRegion> region, std::uint64_t offset,
                       std::uintptr_t device_ptr, std::optional<ckpt::Layout> layout) {
             ckpt::TensorItem item;
             item.name = std::move(name);
             item.dtype = ParseDType(dtype);
             item.shape = std::move(shape);
             if (region && device_ptr != 0) {
               throw py::value_error("item '" + item.name + "' has both a region and a device_ptr: set one");
             }
             item.region = std::move(region);
             if (device_ptr != 0)
               item.cuda_ptr = reinterpret_cast<const void*>(device_ptr + offset);
             else
               item.offset = offset;
             item.layout = std::move(layout);
             return item;
           }),
           py::arg("name"), py::arg("dtype"), py::arg("shape"), py::arg("region") = nullptr,
           py::arg("offset") = 0, py::arg("device_ptr") = 0, py::arg("layout") = py::none())
      .def_readwrite("name", &ckpt::TensorItem::name)
      .def_property(
          "dtype", [](const ckpt::TensorItem& t) { return std::string(DTypeNameOf(t.dtype)); },
          [](ckpt::TensorItem& t, const std::string& d) { t.dtype = ParseDType(d); })
      .def_readwrite("shape", &ckpt::TensorItem::shape)
      .def_readwrite("region", &ckpt::TensorItem::region)
      .def_readwrite("offset", &ckpt::TensorItem::offset)
      .def_property_readonly(
          "device_ptr",
          [](const ckpt::TensorItem& t) { return reinterpret_cast<std::uintptr_t>(t.cuda_ptr); })
      .def_readwrite("layout", &ckpt::TensorItem::layout);

  py::class_<ckpt::Blob>(
      m, "Blob",
      "Bytes stored with a version. As a value of snapshot()'s blobs dict: `data` with `for_rank` (None: "
      "a restore at another world size gives it to every rank; an int: to that rank only). In a "
      "RestoreResult: `from_rank` is the rank that wrote it.")
      .def(py::init([](const py::object& data, std::optional<std::uint32_t> for_rank, std::string name) {
             return ckpt::Blob{name, BlobBytes(name, data), for_rank, 0};
           }),
           py::arg("data"), py::arg("for_rank") = py::none(), py::arg("name") = "")
      .def_readwrite("name", &ckpt::Blob::name)
      .def_property(
          "data", [](const ckpt::Blob& b) { return py::bytes(b.data); },
          [](ckpt::Blob& b, const py::object& data) { b.data = BlobBytes(b.name, data); })
      .def_readwrite("for_rank", &ckpt::Blob::for_rank)
      .def_readwrite("from_rank", &ckpt::Blob::from_rank)
      .def("__repr__", [](const ckpt::Blob& b) {
        return "<ckpt.Blob '" + b.name + "' " + std::to_string(b.data.size()) +
               " bytes for_rank=" + (b.for_rank ? std::to_string(*b.for_rank) : "None") +
               " from_rank=" + std::to_string(b.from_rank) + ">";
      });

  py::class_<ckpt::RestoreResult>(m, "RestoreResult", "What restore(..., result=True) returns")
      .def_readonly("version", &ckpt::RestoreResult::version)
      .def_readonly(
          "tier", &ckpt::RestoreResult::tier,
          "'memory', 'local', 'peer' (a replica in another daemon's memory, --replicas) or 'persistent'")
      .def_readonly("blobs", &ckpt::RestoreResult::blobs, "list of ckpt.Blob (with from_rank)")
      .def_readonly("tensor_bytes", &ckpt::RestoreResult::tensor_bytes)
      .def_readonly("world_size", &ckpt::RestoreResult::world_size, "the world size that wrote the version")
      .def_readonly("resharded", &ckpt::RestoreResult::resharded,
                    "True if filled from other ranks' pieces or another world size")
      .def_readonly("uncommitted", &ckpt::RestoreResult::uncommitted,
                    "True if the version was not committed yet, restored from replicas in daemons' memory")
      .def("__repr__", [](const ckpt::RestoreResult& r) {
        return "<ckpt.RestoreResult version=" + std::to_string(r.version) + " tier=" + r.tier +
               " blobs=" + std::to_string(r.blobs.size()) + " world_size=" + std::to_string(r.world_size) +
               " resharded=" + (r.resharded ? "True" : "False") + (r.uncommitted ? " uncommitted=True" : "") + ">";
      });

  py::class_<ckpt::Registration>(m, "Registration", "What register_items returns")
      .def_readonly("item_count", &ckpt::Registration::item_count)
      .def_readonly("tensor_bytes", &ckpt::Registration::tensor_bytes)
      .def_readonly("sealed", &ckpt::Registration::sealed,
                    "versions commit only once a wait sealed them (register_items(sealed=True), or verify)")
      .def_readonly("verify", &ckpt::Registration::verify,
                    "the daemon verifies each version at its sealing wait (verify=True or ckptd "
                    "--verify-snapshots)")
      .def_readonly("latest_committed", &ckpt::Registration::latest_committed,
                    "Newest committed version of the job (0: none)")
      .def("__repr__", [](const ckpt::Registration& r) {
        return "<ckpt.Registration items=" + std::to_string(r.item_count) +
               " tensor_bytes=" + std::to_string(r.tensor_bytes) +
               " latest_committed=" + std::to_string(r.latest_committed) + ">";
      });

  py::class_<ckpt::Client, ClientHolder>(
      m, "Client",
      "Connection of one trainer process (one rank) to ckptd. Per iteration: snapshot(v) after the "
      "optimizer step, wait_snapshot(v) before the next one. Usable as a context manager "
      "(unregisters on exit). Blocking calls release the GIL.")
      .def_static(
          "connect",
          [](const std::string& socket, std::optional<double> reconnect_budget) {
            ckpt::ClientOptions options;
            if (reconnect_budget) {
              if (!std::isfinite(*reconnect_budget) || *reconnect_budget < 0 || *reconnect_budget > 1e9)
                throw py::value_error("reconnect_budget must be a number of seconds, 0 to 1e9");
              options.reconnect_budget =
                  std::chrono::milliseconds(static_cast<std::int64_t>(std::ceil(*reconnect_budget * 1000.0)));
            }
            std::unique_ptr<ckpt::Client> c;
            {
              py::gil_scoped_release release;
              c = std::make_unique<ckpt::Client>(ckpt::Client::connect(socket, options));
            }
            return ClientHolder(c.release());
          },
          py::arg("socket") = "", py::arg("reconnect_budget") = py::none(),
          "Connects to the daemon at `socket` (default: $CKPTD_SOCKET if set and not empty, else "
          "/run/ckptd/ckptd.sock, the node daemon's). Does not wait for the daemon: the first call fails if "
          "none "
          "serves there. reconnect_budget: seconds a call waits for a daemon that went away (a restart) "
          "before it fails; None: $CKPT_RECONNECT_BUDGET_S, else 120; 0: one attempt, no waiting.")
      .def(
          "register_items",
          [](ckpt::Client& c, const std::string& job, std::uint32_t rank, std::uint32_t world,
             const py::iterable& items, bool sealed, bool verify) {
            std::vector<ckpt::TensorItem> out;
            for (const auto& item : items) out.push_back(ToItem(item));
            ckpt::RegisterOptions options;
            options.sealed = sealed;
            options.verify = verify;
            py::gil_scoped_release release;
            return c.register_items(job, rank, world, out, options);
          },
          py::arg("job"), py::arg("rank"), py::arg("world_size"), py::arg("items"), py::kw_only(),
          py::arg("sealed") = false, py::arg("verify") = false,
          "Registers (or re-registers) this rank's tensors. items: list of ckpt.TensorItem or tuples, each\n"
          "  (name, dtype, shape, region[, offset][, layout])      host memory: offset bytes into a "
          "SharedRegion\n"
          "  (name, dtype, shape, device_ptr[, offset][, layout])  GPU memory at device_ptr + offset (an "
          "int,\n"
          "                                              e.g. tensor.data_ptr(); CUDA builds only)\n"
          "with dtype a safetensors name (see ckpt.DTYPES), shape a list of ints and layout a ckpt.Layout "
          "(the item's place in a global tensor; omitted: rank-private). Tensors must be packed "
          "(contiguous).\n"
          "sealed=True: a version is published and can commit only once a wait sealed it (wait_snapshot or "
          "wait_snapshot_on_stream with seal=True, the client's word that the tensors did not change since "
          "the snapshot), or is dropped by abort_snapshot, or when the trainer exits or unregisters first. "
          "verify=True (implies sealed): the daemon also compares host memory with its copy at that wait "
          "and aborts the version if it changed (TornSnapshotError naming the item).")
      .def(
          "snapshot",
          [](ckpt::Client& c, std::uint64_t version, const std::optional<py::dict>& blobs,
             const py::object& stream) {
            std::vector<ckpt::Blob> b = ToBlobs(blobs);
            void* s = ToStream(stream);
            py::gil_scoped_release release;
            c.snapshot(version, b, s);
          },
          py::arg("version"), py::arg("blobs") = py::none(), py::arg("stream") = 0,
          "Asks the daemon to capture `version` and returns at once. blobs: dict name -> bytes stored "
          "with the version (pickled optimizer groups, RNG state, ...), or name -> ckpt.Blob to set its "
          "for_rank. stream (GPU tensors): the CUDA "
          "stream (int cudaStream_t or torch.cuda.Stream; 0: the legacy default stream) after whose "
          "queued work the version is taken.")
      .def(
          "wait_snapshot",
          [](ckpt::Client& c, std::uint64_t version, std::optional<double> timeout, bool seal) {
            std::chrono::nanoseconds stall;
            {
              py::gil_scoped_release release;
              stall = c.wait_snapshot(version, ToTimeout(timeout), seal);
            }
            return std::chrono::duration<double>(stall).count();
          },
          py::arg("version"), py::arg("timeout") = py::none(), py::arg("seal") = true,
          "Blocks until every byte of `version` is out of trainer memory; returns the time blocked in "
          "seconds. timeout: seconds (None: forever). seal (sealed registrations): then seal the version "
          "(verified first with verify=True: TornSnapshotError if its memory changed); False only waits.")
      .def(
          "abort_snapshot",
          [](ckpt::Client& c, std::uint64_t version, const std::string& reason) {
            py::gil_scoped_release release;
            c.abort_snapshot(version, reason);
          },
          py::arg("version"), py::arg("reason"),
          "Sealed registrations: drops `version`, not sealed yet (never published nor committed; status "
          "and `ckptctl ls` show it aborted with `reason`, at most 1024 bytes); later waits on it raise "
          "TornSnapshotError. ckpt.Error (code 9, FAILED_PRECONDITION) for a version sealed already or "
          "a registration that is not sealed.")
      .def(
          "report_stall",
          [](ckpt::Client& c, double seconds) {
            if (!(seconds >= 0)) throw py::value_error("report_stall: seconds must be >= 0");
            c.report_stall(
                std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::duration<double>(seconds)));
          },
          py::arg("seconds"),
          "Sets the stall (seconds) the next snapshot reports to the daemon, in place of the time the "
          "last wait blocked: for a trainer whose waits run on a thread of their own.")
      .def(
          "wait_snapshot_on_stream",
          [](ckpt::Client& c, std::uint64_t version, const py::object& stream, bool seal) {
            void* s = ToStream(stream);
            std::chrono::nanoseconds stall;
            {
              py::gil_scoped_release release;
              stall = c.wait_snapshot_on_stream(version, s, seal);
            }
            return std::chrono::duration<double>(stall).count();
          },
          py::arg("version"), py::arg("stream"), py::arg("seal") = true,
          "GPU registrations: makes `stream` (int cudaStream_t or torch.cuda.Stream) wait until every "
          "byte of `version` is copied, so work queued there afterwards (the optimizer step) runs after "
          "the copies; the host blocks only until the daemon has queued them. Returns the seconds the "
          "host blocked. For a host-only registration it is wait_snapshot.")
      .def(
          "wait_durable",
          [](ckpt::Client& c, std::uint64_t version, ckpt::Level level, std::optional<double> timeout) {
            py::gil_scoped_release release;
            c.wait_durable(version, level, ToTimeout(timeout));
          },
          py::arg("version"), py::arg("level") = ckpt::Level::kCommitted, py::arg("timeout") = py::none(),
          "Blocks until `version` reaches `level` (default: COMMITTED). timeout: seconds (None: forever).")
      .def(
          "restore",
          [](ckpt::Client& c, std::optional<std::uint64_t> version, bool with_tier,
             bool result) -> py::object {
            ckpt::RestoreResult r;
            {
              py::gil_scoped_release release;
              r = c.restore(version);
            }
            if (result) return py::cast(std::move(r));
            if (with_tier) return py::make_tuple(r.version, FromBlobs(r.blobs), r.tier);
            return py::make_tuple(r.version, FromBlobs(r.blobs));
          },
          py::arg("version") = py::none(), py::arg("with_tier") = false, py::arg("result") = false,
          "Fills the registered regions from `version` (None: the newest committed) and returns "
          "(version, blobs) with blobs a dict name -> bytes; with_tier=True adds the tier the daemon "
          "read it from: 'memory', 'local', 'peer' (a replica in another daemon's memory) or 'persistent'. "
          "result=True returns a ckpt.RestoreResult "
          "instead (blobs with from_rank, world_size, resharded).")
      .def(
          "status",
          [](ckpt::Client& c) {
            ckpt::DaemonStatus s;
            {
              py::gil_scoped_release release;
              s = c.status();
            }
            return s.json;
          },
          "The daemon's status as a JSON string.")
      .def(
          "unregister",
          [](ckpt::Client& c, bool finished) {
            py::gil_scoped_release release;
            c.unregister(finished);
          },
          py::arg("finished") = false,
          "Ends the registration (in-flight versions still complete). finished=True: the job is over "
          "and will not restart, so once no trainer of it is left on the daemon, its memory images and "
          "the replicas at the daemon's peers go (files stay); without it they stay for a restart.")
      .def_property_readonly("socket_path", &ckpt::Client::socket_path)
      .def_property_readonly(
          "reconnect_budget",
          [](const ckpt::Client& c) { return std::chrono::duration<double>(c.reconnect_budget()).count(); },
          "Seconds a call waits for a daemon that went away (see connect)")
      .def(
          "__enter__", [](ckpt::Client& c) -> ckpt::Client& { return c; }, py::return_value_policy::reference)
      .def("__exit__", [](ckpt::Client& c, const py::object&, const py::object&, const py::object&) {
        py::gil_scoped_release release;
        c.unregister();
      });
}
