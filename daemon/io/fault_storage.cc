#include "daemon/io/fault_storage.h"
#include "common/strings.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <thread>

#include "format/paths.h"

namespace ckpt {
namespace {

constexpr std::string_view kTag = " (injected by CKPTD_TEST_FAULT)";

std::string_view BaseName(std::string_view path) {
  auto slash = path.find_last_of('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

FaultSpec::File ClassifyName(std::string_view name, std::string_view dir) {
  if (name == kLatestFile) return FaultSpec::File::kLatest;
  if (name == kCommittedMarker) return FaultSpec::File::kCommitted;
  if (name == kOwnerFile) return FaultSpec::File::kOwner;
  if (ParseShardFileName(name)) return FaultSpec::File::kData;
  if (ParseNodeMarkerName(name)) return FaultSpec::File::kDone;
  // The rank's record and its registration's name (format/paths.h).
  if (name.starts_with("rank-") && BaseName(dir) == kRanksDir) return FaultSpec::File::kRanks;
  return FaultSpec::File::kAny;
}

// Which file of the commit protocol `path` is; a temporary file (NAME.SOMETHING.tmp) counts
// as the file it becomes. A shard is kData here, told from its header by the write's offset.
FaultSpec::File Classify(std::string_view path) {
  std::string_view name = BaseName(path);
  std::string_view dir = path.substr(0, path.size() - name.size());
  if (!dir.empty()) dir.remove_suffix(1);
  if (!EndsWith(name, kTmpSuffix)) return ClassifyName(name, dir);
  // The writer's own part of a temporary name comes after the final name: cut it off one
  // dot at a time until a name of the protocol remains.
  name.remove_suffix(kTmpSuffix.size());
  for (;;) {
    if (FaultSpec::File f = ClassifyName(name, dir); f != FaultSpec::File::kAny) return f;
    auto dot = name.find_last_of('.');
    if (dot == std::string_view::npos) return FaultSpec::File::kAny;
    name = name.substr(0, dot);
  }
}

}  // namespace

Result<FaultSpec> FaultSpec::Parse(std::string_view text) {
  FaultSpec spec;
  bool have_fault = false;
  const std::string all(text);
  while (!text.empty()) {
    auto comma = text.find(',');
    std::string_view field = text.substr(0, comma);
    text = comma == std::string_view::npos ? std::string_view() : text.substr(comma + 1);
    auto eq = field.find('=');
    if (eq == std::string_view::npos)
      return InvalidArgument("CKPTD_TEST_FAULT=" + all + ": no '=' in a field");
    std::string_view key = field.substr(0, eq);
    std::string value(field.substr(eq + 1));
    auto bad = [&] { return InvalidArgument("CKPTD_TEST_FAULT=" + all + ": bad " + std::string(key)); };
    if (key == "file") {
      static const std::pair<std::string_view, File> kFiles[] = {
          {"any", File::kAny},      {"data", File::kData},   {"header", File::kHeader},
          {"done", File::kDone},    {"ranks", File::kRanks}, {"committed", File::kCommitted},
          {"latest", File::kLatest}, {"owner", File::kOwner}};
      bool found = false;
      for (const auto& [n, f] : kFiles) {
        if (value == n) spec.file = f, found = true;
      }
      if (!found) return bad();
    } else if (key == "op") {
      static const std::pair<std::string_view, Op> kOps[] = {{"any", Op::kAny},
                                                             {"write", Op::kWrite},
                                                             {"create", Op::kCreate},
                                                             {"datasync", Op::kDataSync},
                                                             {"rename", Op::kRename}};
      bool found = false;
      for (const auto& [n, o] : kOps) {
        if (value == n) spec.op = o, found = true;
      }
      if (!found) return bad();
    } else if (key == "fault") {
      have_fault = true;
      if (value == "ENOSPC") {
        spec.err = ENOSPC;
      } else if (value == "EIO") {
        spec.err = EIO;
      } else if (value == "EROFS") {
        spec.err = EROFS;
      } else if (value == "short") {
        spec.fault = Fault::kShort;
      } else if (value == "slow") {
        spec.fault = Fault::kSlow;
      } else if (value == "hold") {
        spec.fault = Fault::kHold;
      } else {
        return bad();
      }
    } else if (key == "under") {
      if (value.empty()) return bad();
      spec.under = value.back() == '/' ? value : value + "/";
    } else if (key == "while") {
      if (value.empty()) return bad();
      spec.while_path = value;
    } else if (key == "count" || key == "delay_ms") {
      char* end = nullptr;
      unsigned long long n = std::strtoull(value.c_str(), &end, 10);
      if (value.empty() || *end != '\0') return bad();
      if (key == "count") {
        spec.count = n;
      } else {
        spec.delay_ms = static_cast<std::uint32_t>(n);
      }
    } else {
      return InvalidArgument("CKPTD_TEST_FAULT=" + all + ": unknown field " + std::string(key));
    }
  }
  if (!have_fault) return InvalidArgument("CKPTD_TEST_FAULT=" + all + ": no fault=");
  if (spec.fault == Fault::kHold && spec.while_path.empty()) {
    return InvalidArgument("CKPTD_TEST_FAULT=" + all + ": fault=hold needs while=PATH (it holds until PATH is removed)");
  }
  if (spec.fault == Fault::kShort && spec.op != Op::kWrite) {
    return InvalidArgument("CKPTD_TEST_FAULT=" + all + ": a short write needs op=write");
  }
  return spec;
}

bool FaultStorage::Hits(FaultSpec::Op op, const std::string& path, std::int64_t offset) {
  if (spec_.op != FaultSpec::Op::kAny && spec_.op != op) return false;
  if (!spec_.under.empty() && !path.starts_with(spec_.under)) return false;
  if (spec_.file != FaultSpec::File::kAny) {
    FaultSpec::File kind = Classify(path);
    // A shard's header is its write at offset 0; its other calls are the data's and the
    // header's alike (one file, one fdatasync).
    if (kind == FaultSpec::File::kData && op == FaultSpec::Op::kWrite) {
      kind = offset == 0 ? FaultSpec::File::kHeader : FaultSpec::File::kData;
    } else if (kind == FaultSpec::File::kData && spec_.file == FaultSpec::File::kHeader) {
      kind = FaultSpec::File::kHeader;
    }
    if (kind != spec_.file) return false;
  }
  if (!spec_.while_path.empty() && ::access(spec_.while_path.c_str(), F_OK) != 0) return false;
  const std::uint64_t n = hits_.fetch_add(1) + 1;
  return spec_.count == 0 || n <= spec_.count;
}

bool FaultStorage::Delays() const {
  return spec_.fault == FaultSpec::Fault::kSlow || spec_.fault == FaultSpec::Fault::kHold;
}

void FaultStorage::Delay() const {
  if (spec_.fault == FaultSpec::Fault::kSlow) {
    std::this_thread::sleep_for(std::chrono::milliseconds(spec_.delay_ms));
    return;
  }
  // kHold: until the test removes while_path, and never past a minute, so that a test that
  // dies holding it does not hang the daemon.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (::access(spec_.while_path.c_str(), F_OK) == 0 && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

Status FaultStorage::Injected(const std::string& call) const {
  return IoError(call + std::string(kTag), spec_.err);
}

Result<UniqueFd> FaultStorage::CreateFile(const std::string& path, bool direct) {
  if (Hits(FaultSpec::Op::kCreate, path, -1)) {
    if (!Delays()) return Injected("create " + path);
    Delay();
  }
  return StorageWrapper::CreateFile(path, direct);
}

Status FaultStorage::WriteAt(int fd, const void* buf, std::size_t len, std::uint64_t offset,
                             const std::string& what) {
  if (Hits(FaultSpec::Op::kWrite, what, static_cast<std::int64_t>(offset))) {
    switch (spec_.fault) {
      case FaultSpec::Fault::kSlow:
      case FaultSpec::Fault::kHold:
        Delay();
        break;
      case FaultSpec::Fault::kShort: {
        // Half the bytes land, in whole 4 KiB blocks so that an O_DIRECT file takes them,
        // then the disk takes no more: what a real short write ends in.
        const std::size_t part = len / 2 / 4096 * 4096;
        if (part > 0) {
          if (Status s = StorageWrapper::WriteAt(fd, buf, part, offset, what); !s.ok()) return s;
        }
        return IoError("write " + what + " made no progress after " + std::to_string(part) + " of " +
                           std::to_string(len) + " bytes at offset " + std::to_string(offset) +
                           std::string(kTag),
                       EIO);
      }
      case FaultSpec::Fault::kErrno:
        return Injected("write " + what + " at offset " + std::to_string(offset));
    }
  }
  return StorageWrapper::WriteAt(fd, buf, len, offset, what);
}

Status FaultStorage::DataSync(int fd, const std::string& what) {
  if (Hits(FaultSpec::Op::kDataSync, what, -1)) {
    if (!Delays()) return Injected("fdatasync " + what);
    Delay();
  }
  return StorageWrapper::DataSync(fd, what);
}

Status FaultStorage::Rename(const std::string& from, const std::string& to) {
  if (Hits(FaultSpec::Op::kRename, to, -1)) {
    if (!Delays()) return Injected("rename " + from + " to " + to);
    Delay();
  }
  return StorageWrapper::Rename(from, to);
}

Result<std::shared_ptr<Storage>> WrapWithTestFault(std::shared_ptr<Storage> storage) {
  const char* env = std::getenv("CKPTD_TEST_FAULT");
  if (env == nullptr || *env == '\0') return storage;
  auto spec = FaultSpec::Parse(env);
  if (!spec.ok()) return spec.status();
  spdlog::warn("CKPTD_TEST_FAULT={}: storage faults are injected (a test seam; never set it in production)",
               env);
  return std::shared_ptr<Storage>(
      std::make_shared<FaultStorage>(std::move(storage), std::move(spec).value()));
}

}  // namespace ckpt
