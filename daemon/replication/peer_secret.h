// PeerSecret: the secret the replicating daemons share (--peer-secret FILE), and the token
// that proves a call comes from a daemon that knows it.
//
// The file must be a regular file owned by the daemon's uid and readable by nobody else
// (no group or other bits): a daemon refuses to start otherwise. Its bytes (at least 16,
// trailing newlines dropped) are the key. A call carries, in metadata "ckpt-peer-auth",
//   v1 <unix milliseconds> <16 hex nonce> <64 hex HMAC-SHA256(key, "ckptd-peer/v1 <call> <ms> <nonce>")>
// and the receiver accepts it within kSkew of its own clock. What this does and does not
// protect against: docs/DESIGN-NOTES.md, "Peer replication of the memory tier (issue 17)".
#pragma once

#include <chrono>
#include <string>

#include "common/status.h"

namespace ckpt {

class PeerSecret {
 public:
  static constexpr const char* kMetadataKey = "ckpt-peer-auth";
  static constexpr std::chrono::seconds kSkew{300};

  // Reads and checks the file (owner, mode, size); InvalidArgument saying what is wrong.
  static Result<PeerSecret> Load(const std::string& path);
  PeerSecret() = default;
  explicit PeerSecret(std::string key) : key_(std::move(key)) {}

  // A fresh token for one call named `call` ("PutShard", ...).
  std::string Token(const std::string& call) const;
  // Ok if `token` was made by Token(call) with the same key, within kSkew; otherwise
  // Unauthenticated (a PermissionDenied-like refusal) saying why, without the secret.
  Status Check(const std::string& token, const std::string& call) const;

 private:
  std::string Mac(const std::string& text) const;
  std::string key_;
};

}  // namespace ckpt
