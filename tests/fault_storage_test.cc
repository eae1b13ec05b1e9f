// The CKPTD_TEST_FAULT seam itself (daemon/io/fault_storage.h): which calls it fails, on a
// real directory, so that the fault matrix breaks exactly the file and call it names.
#include "daemon/io/fault_storage.h"

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "format/paths.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::ReadFile;
using ckpt::test::TempDir;
namespace fs = std::filesystem;

namespace {

FaultStorage Make(const std::string& spec) {
  auto parsed = FaultSpec::Parse(spec);
  REQUIRE(parsed.ok());
  return FaultStorage(std::make_shared<PosixStorage>(), parsed.value());
}

}  // namespace

TEST_CASE("CKPTD_TEST_FAULT values are parsed strictly", "[faults]") {
  CHECK(FaultSpec::Parse("file=latest,op=rename,fault=EIO,while=/x,count=2").ok());
  CHECK(FaultSpec::Parse("file=data,fault=slow,delay_ms=5").ok());
  CHECK_FALSE(FaultSpec::Parse("").ok());  // no fault=
  CHECK_FALSE(FaultSpec::Parse("file=latest").ok());
  CHECK_FALSE(FaultSpec::Parse("file=lates,fault=EIO").ok());
  CHECK_FALSE(FaultSpec::Parse("file=latest,fault=ENOMEM").ok());
  CHECK_FALSE(FaultSpec::Parse("file=latest,fault=EIO,count=x").ok());
  CHECK_FALSE(FaultSpec::Parse("file=latest,fault=EIO,colour=red").ok());
  CHECK_FALSE(FaultSpec::Parse("file=latest,op=rename,fault=short").ok());  // short is a write
  CHECK_FALSE(FaultSpec::Parse("file=latest,fault=EIO,under=").ok());
  CHECK(FaultSpec::Parse("file=owner,op=create,fault=hold,while=/x").ok());
  CHECK_FALSE(FaultSpec::Parse("file=owner,op=create,fault=hold").ok());  // hold until what?
  auto spec = FaultSpec::Parse("file=header,op=any,fault=EROFS,while=/armed,count=3");
  REQUIRE(spec.ok());
  CHECK(spec->file == FaultSpec::File::kHeader);
  CHECK(spec->op == FaultSpec::Op::kAny);
  CHECK(spec->err == EROFS);
  CHECK(spec->while_path == "/armed");
  CHECK(spec->count == 3);
}

TEST_CASE("a fault hits only its file, temporary names included, while armed, count times", "[faults]") {
  TempDir dir("seam");
  const std::string job = dir.path() + "/job";
  fs::create_directories(job + "/v0000000001");
  fs::create_directories(job + "/ranks");
  const std::string armed = dir.path() + "/armed";
  FaultStorage s = Make("file=done,op=write,fault=ENOSPC,count=2,while=" + armed);
  const std::string done = job + "/v0000000001/" + NodeMarkerName("host-1234abcd", 8);

  REQUIRE(s.WriteFileAtomic(done, "a").ok());  // not armed
  std::ofstream(armed) << "1";
  Status failed = s.WriteFileAtomic(done, "b");
  CHECK(failed.code() == StatusCode::kResourceExhausted);
  CHECK(failed.message().find("injected by CKPTD_TEST_FAULT") != std::string::npos);
  CHECK(failed.message().find(NodeMarkerName("host-1234abcd", 8)) != std::string::npos);
  CHECK(ReadFile(done) == "a");
  // Other files of the protocol are untouched.
  CHECK(s.WriteFileAtomic(job + "/latest", "1\n").ok());
  CHECK(s.WriteFileAtomic(job + "/ranks/" + RankFileName(0), "r").ok());
  CHECK(s.WriteFileAtomic(job + "/v0000000001/COMMITTED", "{}").ok());
  CHECK_FALSE(s.WriteFileAtomic(done, "c").ok());  // the second hit
  CHECK(s.WriteFileAtomic(done, "d").ok());        // count spent
  CHECK(ReadFile(done) == "d");

  // under=DIR: the same file elsewhere (another tier) is untouched.
  FaultStorage elsewhere = Make("file=done,fault=EIO,under=" + dir.path() + "/other");
  CHECK(elsewhere.WriteFileAtomic(done, "e").ok());
  FaultStorage here = Make("file=done,fault=EIO,under=" + job);
  CHECK_FALSE(here.WriteFileAtomic(done, "f").ok());
}

TEST_CASE("a shard's header is its write at offset 0, and a short write lands half, then fails", "[faults]") {
  TempDir dir("seam");
  const std::string shard = dir.path() + "/v0000000001/" + ShardFileName(3);
  fs::create_directories(dir.path() + "/v0000000001");
  const std::string tmp = shard + ".123-4" + TmpSuffix();  // the flush engine's own tmp name
  std::string block(8192, 'x');

  FaultStorage header = Make("file=header,fault=EIO");
  auto fd = header.CreateFile(tmp, false);
  REQUIRE(fd.ok());
  CHECK(header.WriteAt(fd->get(), block.data(), 4096, 4096, tmp).ok());  // data
  CHECK_FALSE(header.WriteAt(fd->get(), block.data(), 4096, 0, tmp).ok());

  FaultStorage data = Make("file=data,fault=short");
  CHECK(data.WriteAt(fd->get(), block.data(), 4096, 0, tmp).ok());  // the header
  Status s = data.WriteAt(fd->get(), block.data(), block.size(), 4096, tmp);
  CHECK_FALSE(s.ok());
  CHECK(s.message().find("made no progress after 4096 of 8192 bytes") != std::string::npos);
  fd->reset();
  CHECK(fs::file_size(tmp) == 8192);  // the header and half the data

  FaultStorage renames = Make("file=data,op=rename,fault=EROFS");
  Status r = renames.Rename(tmp, shard);
  CHECK(r.message().find("Read-only file system") != std::string::npos);
  CHECK(fs::exists(tmp));
  CHECK(renames.Rename(tmp, dir.path() + "/elsewhere").ok());  // not a shard's name
}

TEST_CASE("a held call waits while its path exists and goes through once it is removed", "[faults]") {
  TempDir dir("seam");
  const std::string job = dir.path() + "/job";
  fs::create_directories(job);
  const std::string gate = dir.path() + "/gate";
  std::ofstream(gate) << "1";
  FaultStorage s = Make("file=owner,op=create,fault=hold,while=" + gate);
  CHECK(s.WriteFileAtomic(job + "/latest", "1\n").ok());  // another file: not held
  std::atomic<bool> done{false};
  Status written;
  std::thread writer([&] {
    written = s.WriteFileAtomic(job + "/" + std::string(kOwnerFile), "uid=1\n");
    done = true;
  });
  // Held: its temporary file is not even created while the gate exists.
  bool created = false;
  for (int i = 0; i < 50 && !created; ++i) {
    for (const auto& e : fs::directory_iterator(job)) created |= e.path().filename().string().starts_with("owner");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  CHECK_FALSE(created);
  CHECK_FALSE(done);
  fs::remove(gate);
  writer.join();
  CHECK(written.ok());
  CHECK(ReadFile(job + "/owner") == "uid=1\n");
}
