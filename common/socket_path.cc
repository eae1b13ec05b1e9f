#include "common/socket_path.h"

#include <unistd.h>

#include <cstdlib>

namespace ckpt {

std::string DefaultClientSocketPath() {
  if (const char* s = std::getenv("CKPTD_SOCKET"); s != nullptr && *s != '\0') return s;
  if (const char* x = std::getenv("XDG_RUNTIME_DIR"); x != nullptr && *x != '\0') {
    return std::string(x) + "/ckptd.sock";
  }
  return "/tmp/ckptd-" + std::to_string(::getuid()) + "/ckptd.sock";
}

}  // namespace ckpt
