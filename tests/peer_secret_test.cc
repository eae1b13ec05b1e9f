// The peer token (issue 17, daemon/replication/peer_secret.*): good for one request once,
// refused with another key, call, subject or time, and refused when presented again.
#include <catch2/catch.hpp>
#include <chrono>
#include <string>

#include "daemon/replication/peer_secret.h"

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
