// The subcommands that read checkpoint files themselves, with no daemon: verify, inspect.
#include <cinttypes>
#include <cstdio>
#include <filesystem>
#include <iostream>

#include "format/checksum.h"
#include "format/paths.h"
#include "format/shard_files.h"
#include "format/shard_format.h"
#include "tools/ckptctl/commands.h"
#include "tools/ckptctl/committed_version.h"
#include "tools/ckptctl/common.h"

namespace ckptctl {
namespace {

namespace fs = std::filesystem;

// The shard files `sel` names; kNotFound (and why, printed) when the job, the version or
// the rank's shard is not there.
int Resolve(const TreeSelection& sel, std::vector<std::string>* paths) {
  const ckpt::CheckpointTree tree(sel.root);
  auto chosen = ChooseVersion(tree, sel.job, sel.version);
  if (!chosen.ok()) {
    std::cerr << "ckptctl: " << chosen.status().message() << "\n";
    return kNotFound;
  }
  const std::uint64_t version = chosen.value();
  const std::string dir = tree.VersionDir(sel.job, version);
  if (sel.rank >= 0) {
    const std::string path = tree.ShardPath(sel.job, version, static_cast<std::uint32_t>(sel.rank));
    if (!PathExists(path)) {
      std::cerr << "ckptctl: version " << version << " of job '" << sel.job << "' has no shard of rank "
                << sel.rank << " (" << path << " does not exist)\n";
      return kNotFound;
    }
    paths->push_back(path);
    return kOk;
  }
  std::vector<std::pair<std::uint32_t, std::string>> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (auto rank = ckpt::ParseShardFileName(e.path().filename().string()))
      found.emplace_back(*rank, e.path());
  }
  if (found.empty()) {
    std::cerr << "ckptctl: version " << version << " of job '" << sel.job << "' has no shard file in " << dir
              << "\n";
    return kNotFound;
  }
  std::sort(found.begin(), found.end());
  for (auto& [rank, path] : found) paths->push_back(std::move(path));
  return kOk;
}

// `paths` with those of `tree` added; kOk or the reason it cannot.
int Gather(std::vector<std::string>& paths, const TreeSelection& tree) {
  if (tree.root.empty()) return kOk;
  return Resolve(tree, &paths);
}

}  // namespace

int Verify(std::vector<std::string> paths, const TreeSelection& tree, bool json) {
  if (int rc = Gather(paths, tree); rc != kOk) return rc;
  int failed = 0, missing = 0;
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  for (const auto& p : paths) {
    nlohmann::ordered_json entry = {{"path", p}};
    if (!PathExists(p)) {
      ++missing;
      entry["result"] = "missing";
      entry["error"] = p + ": no such file";
      if (!json) std::printf("MISSING %s\n", p.c_str());
      std::cerr << "ckptctl: verify: " << p << ": no such file\n";
    } else if (ckpt::Status s = ckpt::VerifyShard(p); s.ok()) {
      entry["result"] = "ok";
      if (!json) std::printf("ok      %s\n", p.c_str());
    } else {
      ++failed;
      entry["result"] = "failed";
      entry["error"] = s.message();
      if (!json) std::printf("FAILED  %s\n", s.message().c_str());
      std::cerr << "ckptctl: verify: " << s.message() << "\n";
    }
    shards.push_back(std::move(entry));
  }
  if (json) {
    PrintJson({{"shards", std::move(shards)},
               {"ok", paths.size() - failed - missing},
               {"failed", failed},
               {"missing", missing}});
  }
  return failed > 0 ? kCorrupt : missing > 0 ? kNotFound : kOk;
}

int Inspect(std::vector<std::string> paths, const TreeSelection& tree, bool json) {
  if (int rc = Gather(paths, tree); rc != kOk) return rc;
  nlohmann::ordered_json shards = nlohmann::ordered_json::array();
  int rc = kOk;
  for (const auto& path : paths) {
    if (!PathExists(path)) {
      std::cerr << "ckptctl: inspect: " << path << ": no such file\n";
      rc = std::max<int>(rc, kNotFound);
      continue;
    }
    auto info = ckpt::ReadShardHeader(path);
    if (!info.ok()) {
      std::cerr << "ckptctl: inspect: " << info.status().message() << "\n";
      rc = kCorrupt;
      continue;
    }
    if (json) {
      nlohmann::ordered_json items = nlohmann::ordered_json::array();
      for (const auto& it : info->items) {
        items.push_back({{"name", it.name},
                         {"kind", it.kind == ckpt::ItemKind::kBlob ? "blob" : "tensor"},
                         {"dtype", std::string(ckpt::DTypeName(it.dtype))},
                         {"shape", it.shape},
                         {"offset", it.in_base ? nlohmann::ordered_json() : nlohmann::ordered_json(it.offset)},
                         {"bytes", it.length},
                         {"xxh3", ckpt::ChecksumHex(it.checksum)},
                         {"in_base", it.in_base}});
      }
      shards.push_back({{"path", path},
                        {"job", info->meta.job},
                        {"version", info->meta.version},
                        {"rank", info->meta.rank},
                        {"world_size", info->meta.world_size},
                        {"format_version", info->format_version},
                        {"base", info->base ? nlohmann::ordered_json(*info->base) : nlohmann::ordered_json()},
                        {"data_start", info->data_start},
                        {"file_bytes", info->file_bytes},
                        {"items", std::move(items)}});
      continue;
    }
    std::printf("%s: job %s version %" PRIu64 " rank %u of %u, %zu items, data at offset %" PRIu64 ", %s\n",
                path.c_str(), info->meta.job.c_str(), info->meta.version, info->meta.rank,
                info->meta.world_size, info->items.size(), info->data_start, Human(info->file_bytes).c_str());
    if (info->base) {
      std::uint64_t left = 0, all = 0;
      for (const auto& it : info->items) {
        all += it.length;
        left += it.in_base ? it.length : 0;
      }
      std::printf("  differential: %s of %s are the unchanged items of base version %" PRIu64 " (%s)\n",
                  Human(left).c_str(), Human(all).c_str(), *info->base,
                  ckpt::ShardFiles::BasePath(path, *info->base).c_str());
    }
    for (const auto& it : info->items) {
      std::string shape;
      for (auto d : it.shape) shape += (shape.empty() ? "" : ", ") + std::to_string(d);
      std::printf("  %-6s %-40s %-7s [%s] %s xxh3 %s%s\n", it.kind == ckpt::ItemKind::kBlob ? "blob" : "tensor",
                  it.name.c_str(), std::string(ckpt::DTypeName(it.dtype)).c_str(), shape.c_str(),
                  Human(it.length).c_str(), ckpt::ChecksumHex(it.checksum).c_str(), it.in_base ? " (in base)" : "");
    }
  }
  if (json) PrintJson({{"shards", std::move(shards)}});
  return rc;
}

}  // namespace ckptctl
