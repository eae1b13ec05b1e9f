// The host side of the release words (client/release_words.h), without a GPU: the floor and
// the values a session may be given, the release that stores the floor into every word (as
// the daemon's mapping of the same object sees it), and the watch that releases them when
// a real ckptd process exits (SIGKILL, or a stop), including the hand-over from one daemon
// to the next.
#include "client/release_words.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <string>

#include "common/pid_namespace.h"
#include "support/daemon_process.h"
#include "support/eventually.h"
#include "support/test_dirs.h"

using namespace ckpt;
using namespace ckpt::test;

namespace {

DaemonOptions Options(const TempDir& dir, const std::string& name) {
  DaemonOptions o;
  o.root = dir.path() + "/" + name + "-root";
  o.socket = dir.path() + "/" + name + ".sock";
  return o;
}

// The daemon's view of the words: the same object, mapped by name.
struct PeerMapping {
  explicit PeerMapping(const std::string& name) {
    fd = ::shm_open(name.c_str(), O_RDWR, 0);
    REQUIRE(fd >= 0);
    void* p = ::mmap(nullptr, kReleaseWordsBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    REQUIRE(p != MAP_FAILED);
    words = static_cast<std::atomic<std::uint32_t>*>(p);
  }
  ~PeerMapping() {
    ::munmap(words, kReleaseWordsBytes);
    ::close(fd);
  }
  int fd = -1;
  std::atomic<std::uint32_t>* words = nullptr;
};

bool AllWordsAre(const ReleaseWords& w, std::uint32_t value) {
  for (std::uint32_t i = 0; i < kReleaseWordCount; ++i) {
    if (w.word(i).load() != value) return false;
  }
  return true;
}

std::string OwnNamespace() { return PidNamespaceOf(0).value(); }

}  // namespace

TEST_CASE("release words: the floor covers every value handed out, and a release stores it everywhere") {
  auto made = ReleaseWords::Create();
  REQUIRE(made.ok());
  ReleaseWords& w = *made.value();
  CHECK(w.name().rfind("/ckpt-release-", 0) == 0);
  CHECK(AllWordsAre(w, 0));
  CHECK(w.SessionBase() == 0);

  // A session of base 0 whose daemon got three snapshots may have written 1, 2 and 3.
  for (int i = 0; i < 3; ++i) w.NoteSnapshotSent();
  CHECK(w.floor() == 3);
  PeerMapping daemon(w.name());
  daemon.words[5].store(2);  // the daemon's stream wrote version 2's value into slot 5
  CHECK(w.word(5).load() == 2);
  CHECK(w.word(5 + kReleaseWordCount).load() == 2);  // slots wrap like the daemon's ring

  w.ReleaseAll();
  CHECK(w.releases() == 1);
  CHECK(AllWordsAre(w, 3));  // every wait (on values <= 3) is satisfied; none went back
  CHECK(daemon.words[0].load() == 3);
  // The next session starts above anything a word holds.
  CHECK(w.SessionBase() == 3);

  // A client that goes away removes the name; what is mapped stays.
  const std::string name = w.name();
  w.Unlink();
  CHECK(::shm_open(name.c_str(), O_RDWR, 0) < 0);
  CHECK(errno == ENOENT);
  w.NoteSnapshotSent();
  w.ReleaseAll();
  CHECK(daemon.words[7].load() == 4);
}

TEST_CASE("release words are released when the real daemon process is killed") {
  TempDir dir("release-kill");
  auto words = std::move(ReleaseWords::Create()).value();
  DaemonWatch watch([&] { words->ReleaseAll(); });
  DaemonProcess daemon(Options(dir, "a"));
  REQUIRE(watch.Watch(daemon.pid(), OwnNamespace()).ok());
  words->NoteSnapshotSent();
  words->NoteSnapshotSent();
  CHECK(words->releases() == 0);
  CHECK(AllWordsAre(*words, 0));  // a stream waiting for value 1 or 2 would wait

  daemon.Kill9();
  REQUIRE(Eventually([&] { return words->releases() == 1; }, std::chrono::seconds(30)));
  CHECK(AllWordsAre(*words, 2));
  CHECK(watch.exits() == 1);
}

TEST_CASE("release words are released when the daemon stops, and the watch follows the next daemon") {
  TempDir dir("release-stop");
  auto words = std::move(ReleaseWords::Create()).value();
  DaemonWatch watch([&] { words->ReleaseAll(); });
  auto a = std::make_unique<DaemonProcess>(Options(dir, "a"));
  REQUIRE(watch.Watch(a->pid(), OwnNamespace()).ok());
  words->NoteSnapshotSent();
  CHECK(a->Stop() == 0);
  REQUIRE(Eventually([&] { return words->releases() == 1; }, std::chrono::seconds(30)));
  CHECK(AllWordsAre(*words, 1));

  // The next session (another daemon) gets values above the floor; its exit releases again.
  auto b = std::make_unique<DaemonProcess>(Options(dir, "b"));
  REQUIRE(watch.Watch(b->pid(), OwnNamespace()).ok());
  words->NoteSnapshotSent();
  b->Kill9();
  REQUIRE(Eventually([&] { return words->releases() == 2; }, std::chrono::seconds(30)));
  CHECK(AllWordsAre(*words, 2));
  CHECK(watch.exits() == 2);
}

TEST_CASE("a daemon that exited as the next was being watched is released exactly once") {
  TempDir dir("release-handover");
  auto words = std::move(ReleaseWords::Create()).value();
  DaemonWatch watch([&] { words->ReleaseAll(); });
  auto a = std::make_unique<DaemonProcess>(Options(dir, "a"));
  auto b = std::make_unique<DaemonProcess>(Options(dir, "b"));
  REQUIRE(watch.Watch(a->pid(), OwnNamespace()).ok());
  a->Kill9();
  // Whether the watcher thread saw A's exit before this or not, it is handled once.
  REQUIRE(watch.Watch(b->pid(), OwnNamespace()).ok());
  REQUIRE(Eventually([&] { return watch.exits() == 1; }, std::chrono::seconds(30)));
  CHECK(words->releases() == 1);
  b->Kill9();
  REQUIRE(Eventually([&] { return watch.exits() == 2; }, std::chrono::seconds(30)));
  CHECK(words->releases() == 2);
}

TEST_CASE("the watch refuses a daemon in another PID namespace and keeps the one it had") {
  TempDir dir("release-namespace");
  auto words = std::move(ReleaseWords::Create()).value();
  DaemonWatch watch([&] { words->ReleaseAll(); });
  DaemonProcess a(Options(dir, "a"));
  REQUIRE(watch.Watch(a.pid(), OwnNamespace()).ok());

  Status other = watch.Watch(a.pid(), "pid:[1]");
  CHECK(other.code() == StatusCode::kFailedPrecondition);
  CHECK(other.message().find("ckptd runs in PID namespace pid:[1], this trainer in " + OwnNamespace()) == 0);
  CHECK(watch.Watch(a.pid(), "").message().find("(not reported)") != std::string::npos);
  CHECK(watch.Watch(0, OwnNamespace()).message() == "the daemon did not report its pid");

  a.Kill9();
  REQUIRE(Eventually([&] { return words->releases() == 1; }, std::chrono::seconds(30)));
}
