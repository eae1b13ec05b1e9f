// Every file of the checkpoint tree is opened so that a FIFO, a device or a symbolic link
// cannot block or redirect it (common/safe_file.h), and shards restore whatever their
// data's alignment, with checksums that cover what the header says.
//
// A test that would hang before the fix is bounded by a FifoWatchdog: if the code under
// test is still blocked on the FIFO after a while, the watchdog opens the other end so the
// call returns, and the test fails because the watchdog had to.
#include <ckpt/client.h>
#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <sys/stat.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <thread>

#include "common/safe_file.h"
#include "daemon/io/storage.h"
#include "format/checksum.h"
#include "format/paths.h"
#include "format/shard_format.h"
#include "support/daemon_process.h"
#include "support/test_dirs.h"
#include "support/trainer_state.h"

using namespace ckpt;
using namespace ckpt::test;
namespace fs = std::filesystem;

namespace {

constexpr std::size_t kTensors = 2;
constexpr std::size_t kTensorBytes = 256 << 10;

// Unblocks whatever is stuck on the FIFO at `path` once `after` has passed: it opens the
// other end (`unblock_flags`: O_WRONLY for a reader stuck in open, O_RDONLY for a writer)
// again and again until destroyed, and remembers that it had to.
class FifoWatchdog {
 public:
  FifoWatchdog(std::string path, int unblock_flags, std::chrono::seconds after = std::chrono::seconds(10))
      : path_(std::move(path)), flags_(unblock_flags), thread_([this, after] { Run(after); }) {}
  ~FifoWatchdog() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  bool fired() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fired_;
  }

 private:
  void Run(std::chrono::seconds after) {
    std::unique_lock<std::mutex> lock(mu_);
    if (cv_.wait_for(lock, after, [this] { return stop_; })) return;
    fired_ = true;
    std::vector<int> held;  // a reader is kept open, so a writer's write does not fail
    while (!cv_.wait_for(lock, std::chrono::milliseconds(100), [this] { return stop_; })) {
      int fd = ::open(path_.c_str(), flags_ | O_NONBLOCK | O_CLOEXEC);
      if (fd < 0) continue;
      if (flags_ == O_RDONLY) {
        held.push_back(fd);
      } else {
        ::close(fd);
      }
    }
    for (int fd : held) ::close(fd);
  }

  std::string path_;
  int flags_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  bool fired_ = false;
  std::thread thread_;
};

void MakeFifo(const std::string& path) {
  fs::remove(path);
  REQUIRE(::mkfifo(path.c_str(), 0600) == 0);
}

bool Contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A daemon without a memory tier (restores read files), with a local tier or not.
struct Setup {
  explicit Setup(bool local, std::vector<std::string> extra = {}) : daemon(Options(dir, local, extra)) {}
  static DaemonOptions Options(const TempDir& d, bool local, std::vector<std::string> extra) {
    DaemonOptions o;
    o.root = d.path() + "/root";
    o.socket = d.path() + "/sock/ckptd.sock";
    o.extra_args = {"--memory-mib", "0", "--node-id", "node"};
    if (local) o.extra_args.insert(o.extra_args.end(), {"--local", d.path() + "/local"});
    o.extra_args.insert(o.extra_args.end(), extra.begin(), extra.end());
    return o;
  }
  std::string Shard(const std::string& tier, std::uint64_t v, const std::string& job = "job") const {
    return dir.path() + "/" + tier + "/" + job + "/" + VersionDirName(v) + "/" + ShardFileName(0);
  }
  // Saves versions 1..n of `job` (each committed) from one trainer, which then goes away.
  void Save(std::uint64_t n, const std::string& job = "job") {
    TrainerState state(kTensors, kTensorBytes, 7);
    Client c = Client::connect(daemon.socket());
    c.register_items(job, 0, 1, state.Items());
    for (std::uint64_t v = 1; v <= n; ++v) {
      state.Fill(v);
      c.snapshot(v);
      c.wait_durable(v, Level::kCommitted);
    }
    c.unregister();
  }
  // Restores the newest version of `job` into a fresh trainer; the error's message, or "".
  std::string Restore(const std::string& job, RestoreResult* result = nullptr, int* code = nullptr) {
    TrainerState state(kTensors, kTensorBytes, 7);
    state.Fill(99);
    Client c = Client::connect(daemon.socket());
    c.register_items(job, 0, 1, state.Items());
    try {
      RestoreResult r = c.restore();
      CHECK(state.FirstMismatch(r.version) == -1);
      if (result) *result = r;
      return "";
    } catch (const Error& e) {
      if (code) *code = e.code();
      return e.what();
    }
  }
  // The daemon still serves: another job saves, commits and restores byte-exact.
  void CheckServesAnotherJob() {
    Save(1, "other");
    RestoreResult r;
    CHECK(Restore("other", &r).empty());
    CHECK(r.version == 1);
  }
  TempDir dir{"ftypes"};
  DaemonProcess daemon;
};

std::string Prefix(std::uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

// Rewrites the header of the shard at `path` in place of the file (a new inode, renamed
// over it): `edit` changes the JSON, which is then padded with spaces to `header_bytes`
// (default: its old size) with the data section unchanged after it.
void RewriteHeader(const std::string& path, const std::function<void(nlohmann::ordered_json&)>& edit,
                   std::optional<std::uint64_t> header_bytes = std::nullopt) {
  const std::string bytes = ReadFile(path);
  REQUIRE(bytes.size() >= 8);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(bytes[i]);
  std::string json = bytes.substr(8, n);
  json.erase(json.find_last_not_of(' ') + 1);
  auto header = nlohmann::ordered_json::parse(json);
  edit(header);
  const std::string text = header.dump();
  const std::uint64_t total = header_bytes.value_or(8 + n);
  REQUIRE(8 + text.size() <= total);
  std::string out =
      Prefix(total - 8) + text + std::string(total - 8 - text.size(), ' ') + bytes.substr(8 + n);
  const std::string tmp = path + ".edit";
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(out.data(), static_cast<std::streamsize>(out.size()));
    REQUIRE(f.good());
  }
  fs::rename(tmp, path);
}

std::string Message(const Status& s) { return s.message(); }

}  // namespace

// -- the open itself -----------------------------------------------------------------------

TEST_CASE("the safe open refuses a FIFO, device, directory or link at once, naming what it is", "[files]") {
  TempDir dir("ftypes");
  const std::string fifo = dir.path() + "/fifo";
  MakeFifo(fifo);
  const std::string regular = dir.path() + "/regular";
  std::ofstream(regular) << "1\n";
  const std::string link = dir.path() + "/link";
  fs::create_symlink(regular, link);
  FifoWatchdog watchdog(fifo, O_WRONLY);

  auto r = OpenRegularForRead(fifo);
  CHECK(r.status().code() == StatusCode::kDataLoss);
  CHECK(Message(r.status()) == fifo + " is a FIFO, not a regular file");
  r = OpenRegularForRead(link);
  CHECK(Message(r.status()) == link + " is a symbolic link, not a regular file");
  r = OpenRegularForRead("/dev/null");
  CHECK(Message(r.status()) == "/dev/null is a character device, not a regular file");
  r = OpenRegularForRead(dir.path());
  CHECK(Message(r.status()) == dir.path() + " is a directory, not a regular file");
  CHECK(OpenRegularForRead(dir.path() + "/none").status().code() == StatusCode::kNotFound);
  REQUIRE(OpenRegularForRead(regular).ok());
  // The descriptor of a regular file reads as usual (O_NONBLOCK is cleared).
  CHECK((::fcntl(OpenRegularForRead(regular)->get(), F_GETFL) & O_NONBLOCK) == 0);

  // Writing: nothing through a FIFO, a link or a device, and the entry is left as it is.
  auto w = CreateRegularFile(fifo, 0, 0600);
  CHECK(w.status().code() == StatusCode::kFailedPrecondition);
  CHECK(Contains(Message(w.status()), fifo + " is a FIFO, not a regular file"));
  w = CreateRegularFile(link, 0, 0600);
  CHECK(Contains(Message(w.status()), link + " is a symbolic link"));
  CHECK(ReadFile(regular) == "1\n");
  CHECK(CreateRegularFile("/dev/null", 0, 0600).status().code() == StatusCode::kFailedPrecondition);
  REQUIRE(CreateRegularFile(regular, 0, 0600).ok());
  CHECK(fs::file_size(regular) == 0);  // a regular file is truncated, as before

  CHECK(Contains(Message(OpenDirectory(link).status()), "is a symbolic link, not a directory"));
  CHECK(Contains(Message(OpenDirectory(fifo).status()), "is a FIFO, not a directory"));
  CHECK(OpenDirectory(dir.path()).ok());
  CHECK_FALSE(watchdog.fired());
}

TEST_CASE("Storage reads no FIFO or link and writes none: a temporary path is created new", "[files]") {
  TempDir dir("ftypes");
  PosixStorage storage;
  const std::string latest = dir.path() + "/latest";
  MakeFifo(latest);
  {
    FifoWatchdog watchdog(latest, O_WRONLY);
    auto text = storage.ReadSmallFile(latest);
    CHECK(text.status().code() == StatusCode::kDataLoss);
    CHECK(Contains(Message(text.status()), latest + " is a FIFO, not a regular file"));
    CHECK_FALSE(watchdog.fired());
  }
  // A FIFO, and a link to a file outside, at the name a fixed temporary name would have (the
  // atomic write's is random and created new: neither is opened).
  const std::string tmp = latest + TmpSuffix();
  MakeFifo(tmp);
  {
    FifoWatchdog watchdog(tmp, O_RDONLY);
    REQUIRE(storage.WriteFileAtomic(latest, "7\n").ok());
    CHECK_FALSE(watchdog.fired());
  }
  CHECK(fs::is_fifo(fs::symlink_status(tmp)));
  CHECK(fs::is_regular_file(fs::symlink_status(latest)));
  CHECK(ReadFile(latest) == "7\n");
  const std::string outside = dir.path() + "/outside";
  std::ofstream(outside) << "untouched";
  fs::remove(tmp);
  fs::create_symlink(outside, tmp);
  REQUIRE(storage.WriteFileAtomic(latest, "8\n").ok());
  CHECK(ReadFile(outside) == "untouched");
  CHECK(ReadFile(latest) == "8\n");

  // A temporary path of this daemon (a shard's is predictable) is always created new: a
  // FIFO, a link or a planted regular file there is removed, never opened.
  {
    FifoWatchdog watchdog(tmp, O_RDONLY);
    auto fd = storage.CreateFile(tmp, /*direct=*/false);
    REQUIRE(fd.ok());
    CHECK(ReadFile(outside) == "untouched");
    CHECK(fs::is_regular_file(fs::symlink_status(tmp)));
    CHECK_FALSE(watchdog.fired());
  }
  fs::remove(tmp);
  MakeFifo(tmp);
  {
    FifoWatchdog watchdog(tmp, O_RDONLY);
    REQUIRE(storage.CreateFile(tmp, /*direct=*/false).ok());
    CHECK(fs::is_regular_file(fs::symlink_status(tmp)));
    CHECK_FALSE(watchdog.fired());
  }
  fs::remove(tmp);
  // The planter keeps the file open (and so its inode from being reused).
  const int planted = ::open(tmp.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0666);
  REQUIRE(planted >= 0);
  REQUIRE(::write(planted, "planted", 7) == 7);
  {
    auto fd = storage.CreateFile(tmp, /*direct=*/false);
    REQUIRE(fd.ok());
    struct stat created {
    }, held{};
    REQUIRE(::fstat(fd->get(), &created) == 0);
    REQUIRE(::fstat(planted, &held) == 0);
    CHECK(created.st_ino != held.st_ino);
    REQUIRE(storage.WriteAt(fd->get(), "shard", 5, 0, tmp).ok());
    char back[8] = {};
    CHECK(::pread(planted, back, 7, 0) == 7);
    CHECK(std::string(back) == "planted");
  }
  ::close(planted);
  fs::remove(tmp);

  // A directory the tree holds as a link to another is not listed, nor synced.
  fs::create_directory(dir.path() + "/real");
  fs::create_directory_symlink(dir.path() + "/real", dir.path() + "/linked");
  CHECK(storage.List(dir.path() + "/linked").status().code() == StatusCode::kFailedPrecondition);
  CHECK(storage.SyncDir(dir.path() + "/linked").code() == StatusCode::kFailedPrecondition);
  CHECK(storage.List(dir.path() + "/real").ok());
}

TEST_CASE("VerifyShard and ReadShardHeader of a FIFO fail at once", "[files][format]") {
  TempDir dir("ftypes");
  const std::string fifo = dir.path() + "/" + ShardFileName(0);
  MakeFifo(fifo);
  FifoWatchdog watchdog(fifo, O_WRONLY);
  auto info = ReadShardHeader(fifo);
  CHECK(info.status().code() == StatusCode::kDataLoss);
  CHECK(Contains(Message(info.status()), fifo + " is a FIFO, not a regular file"));
  Status verified = VerifyShard(fifo);
  CHECK(verified.code() == StatusCode::kDataLoss);
  CHECK(Contains(Message(verified), "is a FIFO, not a regular file"));
  CHECK_FALSE(watchdog.fired());
}

// -- the daemon ----------------------------------------------------------------------------

TEST_CASE("a FIFO as the local tier's shard: the restore reads the persistent copy", "[files][restore]") {
  Setup s(/*local=*/true);
  s.Save(1);
  MakeFifo(s.Shard("local", 1));
  FifoWatchdog watchdog(s.Shard("local", 1), O_WRONLY);
  RestoreResult r;
  CHECK(s.Restore("job", &r).empty());
  CHECK(r.version == 1);
  CHECK(r.tier == "persistent");
  CHECK_FALSE(watchdog.fired());
  CHECK(Contains(Client::connect(s.daemon.socket()).status().json, "is a FIFO, not a regular file"));
  s.CheckServesAnotherJob();
}

TEST_CASE("a FIFO as the persistent shard fails the restore with DATA_LOSS naming it", "[files][restore]") {
  Setup s(/*local=*/false);
  s.Save(1);
  MakeFifo(s.Shard("root", 1));
  FifoWatchdog watchdog(s.Shard("root", 1), O_WRONLY);
  int code = 0;
  const std::string error = s.Restore("job", nullptr, &code);
  CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
  CHECK(Contains(error, s.Shard("root", 1) + " is a FIFO, not a regular file"));
  CHECK_FALSE(watchdog.fired());
  s.CheckServesAnotherJob();
}

TEST_CASE("a shard that is a link to a file outside the root is refused, not followed", "[files][restore]") {
  Setup s(/*local=*/false);
  s.Save(1);
  // A valid shard, outside the root, linked into place.
  const std::string outside = s.dir.path() + "/outside.safetensors";
  fs::copy_file(s.Shard("root", 1), outside);
  fs::remove(s.Shard("root", 1));
  fs::create_symlink(outside, s.Shard("root", 1));
  int code = 0;
  const std::string error = s.Restore("job", nullptr, &code);
  CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
  CHECK(Contains(error, s.Shard("root", 1) + " is a symbolic link, not a regular file"));
  CHECK_FALSE(VerifyShard(s.Shard("root", 1)).ok());
  s.CheckServesAnotherJob();
}

TEST_CASE("a FIFO as a job's latest at startup is repaired, without hanging the start", "[files][startup]") {
  TempDir dir("ftypes");
  DaemonOptions o;
  o.root = dir.path() + "/root";
  o.socket = dir.path() + "/sock/ckptd.sock";
  o.extra_args = {"--memory-mib", "0"};
  {
    DaemonProcess first(o);
    TrainerState state(kTensors, kTensorBytes, 7);
    Client c = Client::connect(first.socket());
    c.register_items("job", 0, 1, state.Items());
    state.Fill(1);
    c.snapshot(1);
    c.wait_durable(1, Level::kCommitted);
    c.unregister();
  }
  const std::string latest = o.root + "/job/" + std::string(kLatestFile);
  MakeFifo(latest);
  FifoWatchdog watchdog(latest, O_WRONLY);
  DaemonProcess second(o);
  CHECK_FALSE(watchdog.fired());
  CHECK(fs::is_regular_file(fs::symlink_status(latest)));
  CHECK(ReadFile(latest) == "1\n");
  TrainerState state(kTensors, kTensorBytes, 7);
  Client c = Client::connect(second.socket());
  c.register_items("job", 0, 1, state.Items());
  CHECK(c.restore().version == 1);
  CHECK(state.FirstMismatch(1) == -1);
}

TEST_CASE("a FIFO where latest's temporary file went does not stop commits", "[files][commit]") {
  Setup s(/*local=*/false);
  s.Save(1);
  const std::string tmp = s.daemon.root() + "/job/" + std::string(kLatestFile) + ".node.tmp";
  MakeFifo(tmp);
  FifoWatchdog watchdog(tmp, O_RDONLY);
  TrainerState state(kTensors, kTensorBytes, 7);
  Client c = Client::connect(s.daemon.socket());
  c.register_items("job", 0, 1, state.Items());
  state.Fill(2);
  c.snapshot(2);
  c.wait_durable(2, Level::kCommitted);
  CHECK_FALSE(watchdog.fired());
  const std::string latest = s.daemon.root() + "/job/" + std::string(kLatestFile);
  CHECK(fs::is_regular_file(fs::symlink_status(latest)));
  CHECK(ReadFile(latest) == "2\n");
  // The temporary file has a random name: the FIFO is at no name the daemon writes, and is
  // left as it is (a restart removes it with the node's leftovers).
  CHECK(fs::is_fifo(fs::symlink_status(tmp)));
}

TEST_CASE("ckptctl verify and inspect of a FIFO fail at once, naming it", "[files][ckptctl]") {
  TempDir dir("ftypes");
  const std::string fifo = dir.path() + "/" + ShardFileName(0);
  MakeFifo(fifo);
  FifoWatchdog watchdog(fifo, O_WRONLY);
  for (const char* command : {"verify", "inspect"}) {
    INFO(command);
    ProcessResult r = RunProcess({CKPTCTL_BINARY, command, fifo});
    CHECK(r.exit_code != 0);
    CHECK(Contains(r.output, fifo + " is a FIFO, not a regular file"));
  }
  CHECK_FALSE(watchdog.fired());
}

TEST_CASE("ckptd refuses a config file that is a FIFO without hanging", "[files][config]") {
  TempDir dir("ftypes");
  const std::string fifo = dir.path() + "/ckptd.conf";
  MakeFifo(fifo);
  FifoWatchdog watchdog(fifo, O_WRONLY);
  // Flags that fail the start once the file is read: before the fix, a daemon that the
  // watchdog unblocked read an empty file and failed on them instead of serving.
  ProcessResult r = RunProcess({CKPTD_BINARY, "--config", fifo, "--root", dir.path() + "/root", "--socket",
                                dir.path() + "/ckptd.sock", "--pool-mib", "16", "--chunk-mib", "8"});
  CHECK(r.exit_code == 2);
  CHECK(Contains(r.output, fifo + " is a FIFO, not a regular file"));
  CHECK_FALSE(watchdog.fired());
}

// -- O_DIRECT and the data's alignment ---------------------------------------------------------

TEST_CASE("a valid shard whose data does not start on a 4 KiB boundary restores with O_DIRECT",
          "[files][restore][direct]") {
  Setup s(/*local=*/false, {"--direct-io", "on"});
  s.Save(1);
  // The same header with less padding: the data starts 8 + JSON size bytes in.
  const std::string shard = s.Shard("root", 1);
  auto before = ReadShardHeader(shard);
  REQUIRE(before.ok());
  const std::string old = ReadFile(shard);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(old[i]);
  std::string json = old.substr(8, n);
  json.erase(json.find_last_not_of(' ') + 1);
  RewriteHeader(
      shard, [](nlohmann::ordered_json&) {}, 8 + json.size() + 3);
  auto after = ReadShardHeader(shard);
  REQUIRE(after.ok());
  REQUIRE(after->data_start % kDataAlignment != 0);
  REQUIRE(VerifyShard(shard).ok());

  RestoreResult r;
  CHECK(s.Restore("job", &r).empty());  // byte-exact (checked inside)
  CHECK(r.version == 1);
  CHECK(r.tier == "persistent");
}

// -- the header checksum -------------------------------------------------------------------

namespace {

// A shard of one F32 item of shape [2, 3] and one blob, written with the format library.
std::string WriteSmallShard(const std::string& dir) {
  ShardMeta meta{"job", 1, 0, 1, ""};
  std::vector<ShardItem> items(2);
  items[0].name = "w";
  items[0].dtype = DType::kF32;
  items[0].shape = {2, 3};
  items[0].length = 24;
  items[1].name = "b";
  items[1].kind = ItemKind::kBlob;
  items[1].shape = {5};
  items[1].length = 5;
  auto layout = ShardLayout::Plan(meta, items);
  REQUIRE(layout.ok());
  std::string data(29, '\0');
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + 1);
  for (auto& item : layout->items()) item.checksum = Checksum::Of(data.data() + item.offset, item.length);
  const std::string path = dir + "/" + ShardFileName(0);
  std::ofstream f(path, std::ios::binary);
  f << layout->RenderHeader() << data;
  REQUIRE(f.good());
  return path;
}

}  // namespace

TEST_CASE("a header edit that keeps every item's bytes is refused by the format library and ckptctl",
          "[files][format][checksum]") {
  TempDir dir("ftypes");
  const std::string path = WriteSmallShard(dir.path());
  REQUIRE(VerifyShard(path).ok());
  const std::string good = ReadFile(path);
  std::function<void(nlohmann::ordered_json&)> edit;
  SECTION("dtype F32 -> I32") {
    edit = [](nlohmann::ordered_json& h) { h["w"]["dtype"] = "I32"; };
  }
  SECTION("shape [2, 3] -> [3, 2]") {
    edit = [](nlohmann::ordered_json& h) { h["w"]["shape"] = {3, 2}; };
  }
  SECTION("ckpt.version 1 -> 2") {
    edit = [](nlohmann::ordered_json& h) { h["__metadata__"]["ckpt.version"] = "2"; };
  }
  SECTION("ckpt.job") {
    edit = [](nlohmann::ordered_json& h) { h["__metadata__"]["ckpt.job"] = "jab"; };
  }
  SECTION("ckpt.header_xxh3 removed") {
    edit = [](nlohmann::ordered_json& h) { h["__metadata__"].erase("ckpt.header_xxh3"); };
  }
  RewriteHeader(path, edit);
  auto info = ReadShardHeader(path);
  CHECK(info.status().code() == StatusCode::kDataLoss);
  CHECK((Contains(Message(info.status()), "ckpt.header_xxh3") ||
         Contains(Message(info.status()), "header checksum mismatch")));
  CHECK(VerifyShard(path).code() == StatusCode::kDataLoss);
  ProcessResult r = RunProcess({CKPTCTL_BINARY, "verify", path});
  CHECK(r.exit_code != 0);
  // The untouched shard passes the same checks.
  std::ofstream(path, std::ios::binary | std::ios::trunc) << good;
  CHECK(VerifyShard(path).ok());
  CHECK(RunProcess({CKPTCTL_BINARY, "verify", path}).exit_code == 0);
}

TEST_CASE("a shard of format version 1 (no header checksum) is still read and verified",
          "[files][format][checksum]") {
  TempDir dir("ftypes");
  const std::string path = WriteSmallShard(dir.path());
  RewriteHeader(path, [](nlohmann::ordered_json& h) {
    h["__metadata__"].erase("ckpt.header_xxh3");
    h["__metadata__"]["ckpt.format_version"] = "1";
  });
  auto info = ReadShardHeader(path);
  REQUIRE(info.ok());
  CHECK(info->format_version == "1");
  CHECK(VerifyShard(path).ok());
  // Its item checksums still count.
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(info->data_start + 3));
  f.put('\x7f');
  f.close();
  CHECK(VerifyShard(path).code() == StatusCode::kDataLoss);
}

TEST_CASE("the daemon refuses a shard whose two items' offsets and checksums were swapped",
          "[files][restore][checksum]") {
  Setup s(/*local=*/false);
  s.Save(1);
  // Both items have the same dtype and size: before the header checksum, the swap passed
  // every check and restored t1's bytes into t0.
  RewriteHeader(s.Shard("root", 1), [](nlohmann::ordered_json& h) {
    std::swap(h["t0"]["data_offsets"], h["t1"]["data_offsets"]);
    std::swap(h["__metadata__"]["ckpt.item.t0"], h["__metadata__"]["ckpt.item.t1"]);
  });
  int code = 0;
  const std::string error = s.Restore("job", nullptr, &code);
  CHECK(code == static_cast<int>(grpc::StatusCode::DATA_LOSS));
  CHECK(Contains(error, "header checksum mismatch"));
  s.CheckServesAnotherJob();
}
