#include "common/socket_path.h"

#include <cstdlib>

namespace ckpt {

std::string DefaultClientSocketPath() {
  if (const char* s = std::getenv("CKPTD_SOCKET"); s != nullptr && *s != '\0') return s;
  return kSystemSocketPath;
}

}  // namespace ckpt
