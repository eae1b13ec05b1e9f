// PeerSecret: the secret the replicating daemons share (--peer-secret FILE), and the token
// that proves a call comes from a daemon that knows it.
//
// The file must be a regular file owned by the daemon's uid and readable by nobody else
// (no group or other bits): a daemon refuses to start otherwise. Its bytes (at least 16,
// trailing newlines dropped) are the key. A call carries, in metadata "ckpt-peer-auth",
//   v1 <unix milliseconds> <16 hex nonce> <64 hex HMAC-SHA256(key, "ckptd-peer/v2 <call> <subject> <ms> <nonce>")>
// where the subject is what the call is about ("<job> <version> <rank> <origin>" for a shard,
// "<job> <origin>" for DropJob): a token is good for that one request only. The receiver
// accepts it within kSkew of its own clock and once (it remembers the nonces it has seen
// for 2 x kSkew). What this does and does not protect against: docs/DESIGN-NOTES.md, "Peer
// replication of the memory tier (issue 17)".
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"

namespace ckpt {

class PeerSecret {
 public:
  static constexpr const char* kMetadataKey = "ckpt-peer-auth";
  // PutShard's subject, sent in metadata too: the receiver authenticates it before it reads
  // a byte of the stream, then holds the first piece to it.
  static constexpr const char* kSubjectKey = "ckpt-peer-subject";
  static constexpr std::chrono::seconds kSkew{300};

  // Reads and checks the file (owner, mode, size); InvalidArgument saying what is wrong.
  static Result<PeerSecret> Load(const std::string& path);
  PeerSecret();
  explicit PeerSecret(std::string key);

  // A fresh token for one call named `call` ("PutShard", ...) about `subject`.
  std::string Token(const std::string& call, const std::string& subject) const;
  // The same, made at `unix_ms` (tests).
  std::string TokenAt(const std::string& call, const std::string& subject, std::int64_t unix_ms) const;
  // Ok if `token` was made by Token(call, subject) with the same key, within kSkew, and was
  // not presented before; otherwise PermissionDenied saying why, without the secret.
  Status Check(const std::string& token, const std::string& call, const std::string& subject) const;

  // The subjects of the calls.
  static std::string ShardSubject(const std::string& job, std::uint64_t version, std::uint32_t rank,
                                  const std::string& origin);
  static std::string JobSubject(const std::string& job, const std::string& origin);

 private:
  class Nonces;
  std::string Mac(const std::string& text) const;
  std::string key_;
  std::shared_ptr<Nonces> seen_;  // shared by the copies of one secret
};

}  // namespace ckpt
