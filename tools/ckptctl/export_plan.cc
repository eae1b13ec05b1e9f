// What an export writes, before it writes it (export.h): the tensors kept (--filter,
// --blobs), checked to be tiled by their chunks, and packed into files of at most
// --max-shard-size.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <optional>
#include <regex>

#include "tools/ckptctl/export.h"
#include "tools/ckptctl/export_source.h"

namespace ckptctl {

using ckpt::DataLoss;
using ckpt::Result;
using ckpt::Status;
using export_internal::BoxText;
using export_internal::Elements;
using export_internal::Quote;
using export_internal::ShapeText;

std::uint64_t ExportTensor::bytes() const {
  return Elements(shape, ckpt::DTypeSize(dtype)).value_or(0) * ckpt::DTypeSize(dtype);
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
        return DataLoss(cw + " covers " + BoxText(c.offsets, c.shape) + ", outside the tensor's shape " +
                        ShapeText(t.shape));
      if (t.replicated && (c.offsets[d] != 0 || c.shape[d] != t.shape[d]))
        return DataLoss(cw + " covers " + BoxText(c.offsets, c.shape) +
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
                        BoxText(a.offsets, a.shape) + " and rank " + std::to_string(b.rank) + " " +
                        BoxText(b.offsets, b.shape) + " overlap; they do not tile the tensor");
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

}  // namespace ckptctl
