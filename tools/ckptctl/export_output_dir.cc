#include "tools/ckptctl/export_output_dir.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <regex>
#include <set>
#include <system_error>

#include "common/names.h"
#include "common/safe_file.h"
#include "format/paths.h"
#include "tools/ckptctl/committed_version.h"
#include "tools/ckptctl/export.h"

namespace ckptctl::export_internal {
namespace {

namespace fs = std::filesystem;
using ckpt::Result;
using ckpt::Status;

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

}  // namespace

OutputDir::~OutputDir() {
  if (committed_) return;
  std::error_code ec;
  if (!tmp_.empty()) fs::remove_all(tmp_, ec);
  if (!created_.empty()) fs::remove_all(created_, ec);
}

Status OutputDir::Open(const std::string& out, bool force) {
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
          (entries.size() == 1 ? " entry" : " entries") + " (" + ckpt::QuoteName(entries.front()) +
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
    while (top.has_parent_path() && top.parent_path() != top && !PathExists(top.parent_path().string()))
      top = top.parent_path();
    fs::create_directories(p, ec);
    if (ec) return ckpt::IoError("cannot create --out " + out, ec.value());
    created_ = top.string();
  } else {
    return ckpt::IoError((errno == ENOTDIR ? "cannot create --out " : "cannot look at --out ") + out, errno);
  }
  tmp_ = ckpt::JoinPath(out_, ".ckptctl-export-" + std::to_string(::getpid()) + ".tmp");  // IsLeftover
  std::error_code ec;
  fs::remove_all(tmp_, ec);  // a leftover of a killed export of a process of the same id
  if (::mkdir(tmp_.c_str(), 0755) != 0) return ckpt::IoError("cannot write into --out " + out, errno);
  return Status::Ok();
}

Result<OutFile> OutputDir::Create(const std::string& name, std::uint64_t bytes) {
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

Status OutputDir::Commit() {
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

}  // namespace ckptctl::export_internal
