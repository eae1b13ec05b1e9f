#include "common/pid_namespace.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace ckpt {

Result<std::string> PidNamespaceOf(pid_t pid) {
  const std::string path = pid == 0 ? "/proc/self/ns/pid" : "/proc/" + std::to_string(pid) + "/ns/pid";
  char target[128];
  const ssize_t n = ::readlink(path.c_str(), target, sizeof(target) - 1);
  if (n < 0) return Internal("readlink " + path + ": " + std::strerror(errno));
  return std::string(target, static_cast<std::size_t>(n));
}

}  // namespace ckpt
