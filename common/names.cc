#include "common/names.h"

#include <cstdio>

namespace ckpt {

std::string QuoteName(std::string_view name) {
  std::string out = "'";
  for (std::size_t i = 0; i < name.size() && i < 80; ++i) {
    unsigned char c = static_cast<unsigned char>(name[i]);
    if (c >= 0x20 && c < 0x7f && c != '\'') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (name.size() > 80) out += "...";
  return out + "'";
}

std::string CheckJobId(std::string_view job) {
  if (job.empty()) return "job id is empty";
  if (job.size() > kMaxJobIdLength) {
    return "job id " + QuoteName(job) + " is longer than " + std::to_string(kMaxJobIdLength) + " characters";
  }
  if (job[0] == '.') return "job id " + QuoteName(job) + " starts with '.'";
  for (char c : job) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
              c == '_' || c == '-';
    if (!ok) {
      return "job id " + QuoteName(job) + " has a character outside [A-Za-z0-9._-]";
    }
  }
  return {};
}

std::string CheckItemName(std::string_view name) {
  if (name.empty()) return "item name is empty";
  if (name.size() > kMaxItemNameLength) {
    return "item name " + QuoteName(name) + " is longer than " + std::to_string(kMaxItemNameLength) +
           " characters";
  }
  for (char ch : name) {
    unsigned char c = static_cast<unsigned char>(ch);
    if (c == 0) return "item name " + QuoteName(name) + " contains a NUL byte";
    if (c < 0x20 || c == 0x7f) {
      return "item name " + QuoteName(name) + " contains a control character";
    }
    if (c >= 0x80) return "item name " + QuoteName(name) + " is not printable ASCII";
    if (c == '/') return "item name " + QuoteName(name) + " contains '/'";
  }
  if (name == "__metadata__") {
    return "item name '__metadata__' is reserved by the safetensors format";
  }
  if (name.find("..") != std::string_view::npos) {
    return "item name " + QuoteName(name) + " contains '..'";
  }
  return {};
}

}  // namespace ckpt
