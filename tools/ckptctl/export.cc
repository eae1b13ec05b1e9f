// The writer of an export (export.h): the safetensors header of each file, the index, and
// RunExport, which takes a version through every stage: export_source.cc (load),
// export_plan.cc (select, check, pack), export_copy.cc (the copies), export_output_dir.cc
// (the directory renamed into place).
#include "tools/ckptctl/export.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <memory>
#include <nlohmann/json.hpp>

#include "format/dtype.h"
#include "tools/ckptctl/export_copy.h"
#include "tools/ckptctl/export_output_dir.h"
#include "tools/ckptctl/export_source.h"

namespace ckptctl {
namespace {

using ckpt::Result;
using ckpt::Status;
using export_internal::CheckAgainstShards;
using export_internal::LoadVersion;
using export_internal::OutputDir;
using export_internal::ShardSet;
using export_internal::TensorCopier;
using export_internal::WriteFully;
using Json = nlohmann::ordered_json;

// The data section of an exported file starts on a multiple of this (the header is padded with
// spaces, as the safetensors library pads its own), so that every tensor, placed in order of
// decreasing element size, is aligned to its element.
inline constexpr std::uint64_t kHeaderAlignment = 8;

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

Result<ExportReport> RunExport(const ExportOptions& options) {
  std::unique_ptr<ShardSet> shards;
  RaiseOpenFileLimit();
  auto src = LoadVersion(options.root, options.job, options.version, &shards);
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
