#include "common/test_pause.h"

#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <string>
#include <thread>

namespace ckpt {
namespace {

struct PauseSpec {
  std::string point;
  std::uint64_t version = 0;
  std::string path;
  bool set = false;
};

const PauseSpec& Spec() {
  static const PauseSpec spec = [] {
    PauseSpec s;
    const char* env = std::getenv("CKPTD_TEST_PAUSE");
    if (env == nullptr) return s;
    std::string v = env;
    auto a = v.find(':');
    auto b = a == std::string::npos ? a : v.find(':', a + 1);
    if (b == std::string::npos) return s;
    s.point = v.substr(0, a);
    s.version = std::strtoull(v.substr(a + 1, b - a - 1).c_str(), nullptr, 10);
    s.path = v.substr(b + 1);
    s.set = !s.path.empty();
    return s;
  }();
  return spec;
}

}  // namespace

void TestPause(std::string_view point, std::uint64_t version) {
  const PauseSpec& s = Spec();
  if (!s.set || s.point != point || (s.version != 0 && s.version != version)) return;
  int fd = ::open((s.path + ".reached").c_str(), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
  if (fd >= 0) ::close(fd);
  // The test holds the daemon here (usually to kill it); removing PATH lets it go on.
  while (::access(s.path.c_str(), F_OK) == 0) std::this_thread::sleep_for(std::chrono::milliseconds(5));
}

}  // namespace ckpt
