// The peer token (daemon/base/peer_secret.*): good for one request once, refused with
// another key, call, subject or time, and refused when presented again. The callee's proof
// and an image's MAC: good only with the key, for the caller's nonce and what was said.
#include <catch2/catch.hpp>
#include <chrono>
#include <string>

#include "daemon/base/peer_secret.h"

using namespace ckpt;

namespace {

std::int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

const std::string kShard = PeerSecret::ShardSubject("job", 7, 3, "10.0.0.2:7000");

}  // namespace

TEST_CASE("a peer token is accepted once, for its call and subject only", "[peer_secret]") {
  PeerSecret a("a secret of at least sixteen bytes");
  PeerSecret receiver("a secret of at least sixteen bytes");
  const std::string token = a.Token("PutShard", kShard);
  CHECK(receiver.Check(token, "PutShard", kShard).ok());

  SECTION("presented again: a replay") {
    Status again = receiver.Check(token, "PutShard", kShard);
    CHECK(again.code() == StatusCode::kPermissionDenied);
    CHECK_THAT(again.message(), Catch::Contains("used before"));
  }
  SECTION("the copies of one secret share what they have seen") {
    PeerSecret copy = receiver;
    CHECK(copy.Check(token, "PutShard", kShard).code() == StatusCode::kPermissionDenied);
  }
  SECTION("a fresh token for the same request is accepted") {
    CHECK(receiver.Check(a.Token("PutShard", kShard), "PutShard", kShard).ok());
  }
}

TEST_CASE("a peer token is refused for another subject, call, key or time", "[peer_secret]") {
  PeerSecret a("a secret of at least sixteen bytes");
  PeerSecret receiver("a secret of at least sixteen bytes");
  SECTION("another shard or origin") {
    const std::string token = a.Token("PutShard", kShard);
    for (const std::string& other :
         {PeerSecret::ShardSubject("job", 8, 3, "10.0.0.2:7000"), PeerSecret::ShardSubject("job", 7, 2, "10.0.0.2:7000"),
          PeerSecret::ShardSubject("other", 7, 3, "10.0.0.2:7000"),
          PeerSecret::ShardSubject("job", 7, 3, "10.0.0.9:7000")}) {
      INFO(other);
      Status st = receiver.Check(token, "PutShard", other);
      CHECK(st.code() == StatusCode::kPermissionDenied);
      CHECK_THAT(st.message(), Catch::Contains("for this request"));
    }
    // Those refusals did not use the token up.
    CHECK(receiver.Check(token, "PutShard", kShard).ok());
  }
  SECTION("another call") {
    const std::string drop = PeerSecret::JobSubject("job", "10.0.0.2:7000");
    CHECK(receiver.Check(a.Token("DropJob", drop), "PutShard", drop).code() == StatusCode::kPermissionDenied);
  }
  SECTION("another key") {
    PeerSecret other("another secret, sixteen bytes or more");
    Status st = receiver.Check(other.Token("HasShard", kShard), "HasShard", kShard);
    CHECK(st.code() == StatusCode::kPermissionDenied);
    CHECK_THAT(st.message(), Catch::Contains("--peer-secret"));
    CHECK_THAT(st.message(), !Catch::Contains("sixteen"));  // the secret is not in the message
  }
  SECTION("too old or from the future") {
    for (std::int64_t off : {-301000, 301000}) {
      Status st = receiver.Check(a.TokenAt("GetShard", kShard, NowMs() + off), "GetShard", kShard);
      CHECK(st.code() == StatusCode::kPermissionDenied);
      CHECK_THAT(st.message(), Catch::Contains("off this daemon's clock"));
    }
    CHECK(receiver.Check(a.TokenAt("GetShard", kShard, NowMs() - 200000), "GetShard", kShard).ok());
  }
  SECTION("malformed") {
    for (const std::string& bad : {std::string(), std::string("v1"), std::string("v1 1 2 3"),
                                   a.Token("GetShard", kShard).substr(1)}) {
      CHECK(receiver.Check(bad, "GetShard", kShard).code() == StatusCode::kPermissionDenied);
    }
  }
}

TEST_CASE("a token of the release before is refused, saying why", "[peer_secret]") {
  PeerSecret receiver("a secret of at least sixteen bytes");
  // As that release made it: "v1 <ms> <nonce> <mac>".
  const std::string old = "v1 " + std::to_string(NowMs()) + " 0123456789abcdef " + std::string(64, 'a');
  Status st = receiver.Check(old, "HasShard", kShard);
  CHECK(st.code() == StatusCode::kPermissionDenied);
  CHECK_THAT(st.message(), Catch::Contains("older ckptd release"));
}

TEST_CASE("a callee's proof holds only with the key, for the caller's nonce and the answer given", "[peer_secret]") {
  PeerSecret caller("a secret of at least sixteen bytes");
  PeerSecret callee("a secret of at least sixteen bytes");
  const std::string token = caller.Token("HasShard", kShard);
  const std::string nonce = PeerSecret::NonceOf(token);
  REQUIRE(nonce.size() == 16);
  const std::string proof = callee.Proof("HasShard", nonce, "held 1");
  CHECK(caller.CheckProof(proof, "HasShard", nonce, "held 1").ok());
  auto refused = [&](const std::string& p, const std::string& call, const std::string& n, const std::string& answer) {
    Status st = caller.CheckProof(p, call, n, answer);
    return st.code() == StatusCode::kPermissionDenied &&
           st.message().find("did not prove it knows --peer-secret") != std::string::npos;
  };
  CHECK(refused("", "HasShard", nonce, "held 1"));                                           // none: an impostor
  CHECK(refused(proof, "HasShard", nonce, "held 0"));                                        // another answer
  CHECK(refused(proof, "GetShard", nonce, "held 1"));                                        // another call
  CHECK(refused(proof, "HasShard", PeerSecret::NonceOf(caller.Token("HasShard", kShard)), "held 1"));  // a replay
  CHECK(refused(PeerSecret("another secret, sixteen bytes or more").Proof("HasShard", nonce, "held 1"), "HasShard",
                nonce, "held 1"));
  CHECK(refused(proof, "HasShard", "", "held 1"));  // a caller without a nonce trusts nothing
  CHECK(PeerSecret::NonceOf("v1 1 0123456789abcdef x").empty());
}

TEST_CASE("an image's MAC covers every byte and its binding, fed in any pieces", "[peer_secret]") {
  PeerSecret a("a secret of at least sixteen bytes");
  std::string image(100000, '\0');
  for (std::size_t i = 0; i < image.size(); ++i) image[i] = static_cast<char>(i * 7);
  const std::string binding = PeerSecret::ImageBinding("GetShard", "0123456789abcdef", "job", 7, 3, "reg-1",
                                                       "10.0.0.2:7000", image.size());
  auto mac_of = [&](const PeerSecret& key, const std::string& bytes, std::size_t step, const std::string& b) {
    PeerSecret::ImageMac mac = key.StartImage();
    for (std::size_t at = 0; at < bytes.size(); at += step) mac.Update(bytes.data() + at, std::min(step, bytes.size() - at));
    return mac.Finish(b);
  };
  const std::string whole = mac_of(a, image, image.size(), binding);
  CHECK(whole.size() == PeerSecret::kMacBytes);
  CHECK(PeerSecret::SameMac(mac_of(a, image, 4096, binding), whole));
  CHECK(PeerSecret::SameMac(mac_of(a, image, 1, binding), whole));
  std::string changed = image;
  changed[54321] ^= 1;
  CHECK_FALSE(PeerSecret::SameMac(mac_of(a, changed, 4096, binding), whole));
  for (const std::string& other :
       {PeerSecret::ImageBinding("GetShard", "0123456789abcdef", "job", 7, 3, "reg-2", "10.0.0.2:7000", image.size()),
        PeerSecret::ImageBinding("GetShard", "0123456789abcdef", "job", 7, 2, "reg-1", "10.0.0.2:7000", image.size()),
        PeerSecret::ImageBinding("GetShard", "0123456789abcdef", "job", 8, 3, "reg-1", "10.0.0.2:7000", image.size()),
        PeerSecret::ImageBinding("GetShard", "0123456789abcdef", "jo", 7, 3, "reg-1", "10.0.0.2:7000", image.size()),
        PeerSecret::ImageBinding("GetShard", "0123456789abcdef", "job", 7, 3, "reg-1", "10.0.0.3:7000", image.size()),
        PeerSecret::ImageBinding("GetShard", "fedcba9876543210", "job", 7, 3, "reg-1", "10.0.0.2:7000", image.size()),
        PeerSecret::ImageBinding("PutShard", "0123456789abcdef", "job", 7, 3, "reg-1", "10.0.0.2:7000", image.size())}) {
    CHECK_FALSE(PeerSecret::SameMac(mac_of(a, image, 4096, other), whole));
  }
  CHECK_FALSE(PeerSecret::SameMac(mac_of(PeerSecret("another secret, sixteen bytes or more"), image, 4096, binding),
                                  whole));
  CHECK_FALSE(PeerSecret::SameMac("", ""));
}
