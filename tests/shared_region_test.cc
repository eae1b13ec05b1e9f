// ckpt::SharedRegion's names and process exit (client/shared_region.cc): a region still held when
// the process that created it exits normally has its name removed then, and a forked child
// that exits leaves its parent's regions alone.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cerrno>
#include <cstdlib>
#include <string>

#include "ckpt/client.h"

namespace {

bool NameExists(const std::string& name) {
  int fd = ::shm_open(name.c_str(), O_RDONLY, 0);
  if (fd < 0) return false;
  ::close(fd);
  return true;
}

// Runs `child` in a forked process; `child` ends it with std::exit, which runs the exit
// handlers but no destructor of a local still in scope. Returns the child's exit status.
template <typename F>
int InForkedChild(F child) {
  pid_t pid = ::fork();
  if (pid == 0) {
    child();
    std::_Exit(2);  // `child` returned instead of exiting
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

}  // namespace

TEST_CASE("a region still held when its process exits has its name removed", "[shm]") {
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  int status = InForkedChild([&] {
    auto region = ckpt::SharedRegion::create(4096);  // still held at exit(): never destroyed
    const std::string& name = region->name();
    (void)!::write(pipe_fds[1], name.data(), name.size());
    ::close(pipe_fds[1]);
    std::exit(NameExists(name) ? 0 : 3);
  });
  ::close(pipe_fds[1]);
  char buf[256] = {};
  ssize_t n = ::read(pipe_fds[0], buf, sizeof buf - 1);
  ::close(pipe_fds[0]);
  REQUIRE(WIFEXITED(status));
  REQUIRE(WEXITSTATUS(status) == 0);
  REQUIRE(n > 0);
  CHECK_FALSE(NameExists(std::string(buf, static_cast<std::size_t>(n))));
}

TEST_CASE("a forked child that exits leaves its parent's regions", "[shm]") {
  auto region = ckpt::SharedRegion::create(4096);
  int status = InForkedChild([&] {
    auto held = region;  // the child holds it too, at exit()
    std::exit(0);
  });
  REQUIRE(WIFEXITED(status));
  CHECK(NameExists(region->name()));
  const std::string name = region->name();
  region.reset();
  CHECK_FALSE(NameExists(name));
}
