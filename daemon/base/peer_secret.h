// PeerSecret: the secret the replicating daemons share (--peer-secret FILE), and what proves,
// in both directions of a peer call, that the other end knows it.
//
// The file must be a regular file owned by the daemon's uid and readable by nobody else
// (no group or other bits): a daemon refuses to start otherwise. Its bytes (at least 16,
// trailing newlines dropped) are the key.
//
// The caller: a call carries, in metadata "ckpt-peer-auth",
//   v2 <unix milliseconds> <16 hex nonce> <64 hex HMAC-SHA256(key, "ckptd-peer/v3 call <call> <subject> <ms> <nonce>")>
// where the subject is what the call is about ("<job> <version> <rank> <origin>" for a shard,
// "<job> <origin>" for DropJob) and, after " to ", the callee's --peers entry (Addressed): a
// token is good for that one request to that one daemon only. The callee
// accepts it within kSkew of its own clock and once (it remembers the nonces it has seen
// for 2 x kSkew).
//
// The callee: whatever listens on a peer's address may not be that peer's daemon (a user of
// the node can bind the port while the daemon is down), so the caller believes nothing of a
// reply without a proof bound to the nonce it just sent, which no recorded reply has:
//   - a reply carries, in trailing metadata "ckpt-peer-proof", the 64 hex digits of
//     HMAC-SHA256(key, "ckptd-peer/v3 reply <call> <nonce> <answer>"), where the answer says
//     what the reply says (each call's is in peer_service.cc, which makes them, and in
//     replicator.cc and replicator_restore.cc, which check them);
//   - a shard image on the wire (GetShard, and PutShard the other way) ends with the
//     HMAC-SHA256 of every byte of it followed by ImageBinding (job, version, rank,
//     registration, sending node, file size, call and nonce; for a delta also the base
//     version, and each piece's offset and length before its bytes): the receiver computes
//     it as the bytes pass (ImageMac) and uses no byte of the image unless it matches.
// A token of the release before ("v1": its replies carried no proof) is refused, and that
// release sends no proof: daemons of the two trust nothing of each other (fail closed).
// The threat model: docs/ops/replication-security.md.
#pragma once

#include <chrono>
#include <cstddef>
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
  // The callee's proof of a reply, in trailing metadata.
  static constexpr const char* kProofKey = "ckpt-peer-proof";
  static constexpr std::chrono::seconds kSkew{300};
  static constexpr std::size_t kMacBytes = 32;  // an image's MAC, raw

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

  // The nonce of a token Token made (empty if `token` is not one).
  static std::string NonceOf(const std::string& token);
  // The callee's proof for its reply to the call `call` whose token had `nonce`, the reply
  // saying `answer`.
  std::string Proof(const std::string& call, const std::string& nonce, const std::string& answer) const;
  // Ok if `proof` is Proof(call, nonce, answer) with this key; else PermissionDenied saying
  // that the callee did not prove it knows the secret.
  Status CheckProof(const std::string& proof, const std::string& call, const std::string& nonce,
                    const std::string& answer) const;

  // HMAC-SHA256 of one shard image in transit, fed its bytes in order as they pass. Not
  // thread-safe (one transfer's).
  class ImageMac {
   public:
    ImageMac(ImageMac&&) noexcept;
    ImageMac& operator=(ImageMac&&) noexcept;
    ~ImageMac();
    void Update(const char* data, std::size_t n);
    // The kMacBytes of the MAC of the bytes fed, then `binding`; empty if the library failed
    // (which no check accepts). Once.
    std::string Finish(const std::string& binding);

   private:
    friend class PeerSecret;
    struct Ctx;
    explicit ImageMac(std::unique_ptr<Ctx> ctx);
    std::unique_ptr<Ctx> ctx_;
  };
  ImageMac StartImage() const;
  // What an image's MAC is bound to, after its bytes. `base_version` 0: a whole image; else
  // a delta on that version (peer.proto's ShardPiece.base_version), whose binding ends
  // differently, so that neither a whole image's MAC nor one on another base verifies it.
  static std::string ImageBinding(const std::string& call, const std::string& nonce, const std::string& job,
                                  std::uint64_t version, std::uint32_t rank, const std::string& registration,
                                  const std::string& origin, std::uint64_t file_bytes,
                                  std::uint64_t base_version = 0);
  // Whether two MACs are the same (in constant time; an empty one matches nothing).
  static bool SameMac(const std::string& a, const std::string& b);

  // The answers of the calls, as their proofs are bound to them: what the caller acts on.
  static std::string PutAnswer(const std::string& subject, std::uint64_t bytes_held);
  static std::string HasAnswer(const std::string& subject, bool held, std::uint64_t file_bytes,
                               const std::string& registration);
  // DropJob and DropNewer: how many were dropped, and (DropJob) the replica bytes the callee
  // still holds for the caller.
  static std::string DropAnswer(const std::string& subject, std::uint32_t dropped, std::uint64_t bytes_held);

  // What a token is made for: `subject`, sent to the daemon `callee` (its --peers entry), so
  // that a token cannot be relayed to another daemon.
  static std::string Addressed(const std::string& subject, const std::string& callee);

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
