// The erasure code of peer redundancy (daemon/replication/erasure_code.h): every pattern of
// up to m lost fragments rebuilt byte for byte, corrupt fragments found by their checksums
// and rebuilt around, too many losses reported as DataLoss naming them.
#include "daemon/replication/erasure_code.h"

#include <bit>
#include <catch2/catch.hpp>
#include <cstring>
#include <string>
#include <vector>

#include "support/byte_pattern.h"

using namespace ckpt;

namespace {

using Fragments = std::vector<std::vector<std::uint8_t>>;

std::vector<std::uint8_t> Pattern(std::uint64_t n, std::uint32_t seed) {
  const std::string s = test::Bytes(n, seed);
  return {s.begin(), s.end()};
}

ErasureCode Code(unsigned k, unsigned m) {
  Result<ErasureCode> code = ErasureCode::Create(k, m);
  REQUIRE(code.ok());
  return std::move(code).value();
}

// Copies of every fragment, as a peer would hold them: damage to one touches nothing else.
Fragments Copies(const EncodedStripe& e) {
  Fragments copies;
  for (const std::uint8_t* f : e.fragments()) copies.emplace_back(f, f + e.stripe().fragment_bytes);
  return copies;
}

// Pointers to the copies, nullptr for the fragments in `lost` (a bit mask).
std::vector<const std::uint8_t*> Present(const Fragments& copies, std::uint32_t lost) {
  std::vector<const std::uint8_t*> p;
  for (unsigned i = 0; i < copies.size(); ++i) p.push_back(lost >> i & 1 ? nullptr : copies[i].data());
  return p;
}

std::vector<unsigned> Indices(std::uint32_t mask) {
  std::vector<unsigned> out;
  for (unsigned i = 0; i < 32; ++i) {
    if (mask >> i & 1) out.push_back(i);
  }
  return out;
}

}  // namespace

TEST_CASE("erasure code: every pattern of up to m lost fragments is rebuilt byte-exact") {
  const std::pair<unsigned, unsigned> codes[] = {{4, 1}, {4, 2}, {3, 2}, {1, 1}};
  // 1 byte, shorter than one fragment, exactly k fragments of 64, neither a multiple of k nor
  // of 64, and a few fragments of many vectors.
  const std::uint64_t lengths[] = {1, 63, 256, 4096 + 7, 3 * 64 * 5 + 1, 200003};
  for (auto [k, m] : codes) {
    const ErasureCode code = Code(k, m);
    for (std::uint64_t length : lengths) {
      const std::vector<std::uint8_t> data =
          Pattern(length, k * 100 + m + static_cast<std::uint32_t>(length));
      Result<EncodedStripe> e = EncodeStripe(code, data.data(), length);
      REQUIRE(e.ok());
      CHECK(e->stripe().fragment_bytes == StripeFragmentBytes(length, k));
      CHECK(e->stripe().checksums.size() == k + m);
      const Fragments copies = Copies(e.value());
      for (std::uint32_t lost = 0; lost < (1u << (k + m)); ++lost) {
        if (static_cast<unsigned>(std::popcount(lost)) > m) continue;
        INFO("k=" << k << " m=" << m << " length=" << length << " lost mask=" << lost);
        std::vector<std::uint8_t> out(length, 0xA5);
        Result<StripeDamage> damage = ReconstructStripe(code, e->stripe(), Present(copies, lost), out.data());
        REQUIRE(damage.ok());
        CHECK(damage->missing == Indices(lost));
        CHECK(damage->corrupt.empty());
        REQUIRE(out == data);
      }
    }
  }
}

TEST_CASE("erasure code: Rebuild restores lost parity as well as data, at any length") {
  for (auto [k, m] : {std::pair{4u, 2u}, std::pair{3u, 2u}, std::pair{16u, 16u}}) {
    const ErasureCode code = Code(k, m);
    for (std::uint64_t bytes : {std::uint64_t{1}, std::uint64_t{33}, std::uint64_t{1000}}) {
      Fragments frags(k + m);
      for (unsigned i = 0; i < k; ++i) frags[i] = Pattern(bytes, 7 * i + 1);
      std::vector<const std::uint8_t*> data;
      std::vector<std::uint8_t*> parity;
      for (unsigned i = 0; i < k; ++i) data.push_back(frags[i].data());
      for (unsigned i = k; i < k + m; ++i) {
        frags[i].assign(bytes, 0);
        parity.push_back(frags[i].data());
      }
      REQUIRE(code.Encode(data, parity, bytes).ok());
      // Every pattern for the small codes; for 16+16, the first m, the last m and a spread.
      std::vector<std::uint32_t> patterns;
      if (k + m <= 8) {
        for (std::uint32_t lost = 1; lost < (1u << (k + m)); ++lost) {
          if (static_cast<unsigned>(std::popcount(lost)) <= m) patterns.push_back(lost);
        }
      } else {
        patterns = {0x0000FFFFu, 0xFFFF0000u, 0x55555555u, 0xAAAAAAAAu, 0x0F0F0F0Fu, 1u, 0x80000000u};
      }
      for (std::uint32_t lost : patterns) {
        INFO("k=" << k << " m=" << m << " bytes=" << bytes << " lost mask=" << lost);
        Fragments rebuilt(k + m);
        std::vector<std::uint8_t*> out(k + m, nullptr);
        for (unsigned i : Indices(lost)) {
          rebuilt[i].assign(bytes, 0x5A);
          out[i] = rebuilt[i].data();
        }
        REQUIRE(code.Rebuild(Present(frags, lost), out, bytes).ok());
        for (unsigned i : Indices(lost)) REQUIRE(rebuilt[i] == frags[i]);
      }
    }
  }
}

TEST_CASE("erasure code: fragments are 64-byte multiples and whole data fragments are not copied") {
  CHECK(StripeFragmentBytes(0, 4) == 0);
  CHECK(StripeFragmentBytes(1, 4) == 64);
  CHECK(StripeFragmentBytes(256, 4) == 64);
  CHECK(StripeFragmentBytes(257, 4) == 128);
  CHECK(StripeFragmentBytes(4 * 1000, 4) == 1024);
  CHECK(StripeFragmentBytes(65, 1) == 128);

  const ErasureCode code = Code(4, 2);
  const std::vector<std::uint8_t> data = Pattern(3 * 128 + 5, 11);  // fragments of 128: 3 whole, 1 partial
  Result<EncodedStripe> e = EncodeStripe(code, data.data(), data.size());
  REQUIRE(e.ok());
  REQUIRE(e->stripe().fragment_bytes == 128);
  for (unsigned i = 0; i < 3; ++i) CHECK(e->fragment(i) == data.data() + i * 128);
  CHECK(e->fragment(3) != data.data() + 3 * 128);
  // The partial fragment holds its 5 bytes, then zeros.
  CHECK(std::memcmp(e->fragment(3), data.data() + 384, 5) == 0);
  CHECK(std::vector<std::uint8_t>(e->fragment(3) + 5, e->fragment(3) + 128) ==
        std::vector<std::uint8_t>(123, 0));
}

TEST_CASE("erasure code: an empty buffer encodes to empty fragments and still needs k of them") {
  const ErasureCode code = Code(4, 2);
  Result<EncodedStripe> e = EncodeStripe(code, nullptr, 0);
  REQUIRE(e.ok());
  CHECK(e->stripe().fragment_bytes == 0);
  // A fragment of 0 bytes is present when its pointer is not null.
  const std::uint8_t anchor = 0;
  std::vector<const std::uint8_t*> frags(6, &anchor);
  frags[0] = frags[1] = nullptr;
  Result<StripeDamage> two_lost = ReconstructStripe(code, e->stripe(), frags, nullptr);
  REQUIRE(two_lost.ok());
  CHECK(two_lost->missing == std::vector<unsigned>{0, 1});
  CHECK(two_lost->corrupt.empty());
  frags[2] = nullptr;
  Result<StripeDamage> three_lost = ReconstructStripe(code, e->stripe(), frags, nullptr);
  CHECK(three_lost.status().code() == StatusCode::kDataLoss);
}

TEST_CASE("erasure code: a corrupt parity fragment is found and the data comes from the others") {
  const ErasureCode code = Code(4, 2);
  const std::vector<std::uint8_t> data = Pattern(10007, 3);
  Result<EncodedStripe> e = EncodeStripe(code, data.data(), data.size());
  REQUIRE(e.ok());
  Fragments copies = Copies(e.value());
  copies[5][17] ^= 0x01;

  SECTION("nothing else lost") {
    std::vector<std::uint8_t> out(data.size());
    Result<StripeDamage> damage = ReconstructStripe(code, e->stripe(), Present(copies, 0), out.data());
    REQUIRE(damage.ok());
    CHECK(damage->corrupt == std::vector<unsigned>{5});
    CHECK(damage->missing.empty());
    CHECK_FALSE(damage->intact());
    REQUIRE(out == data);
  }
  SECTION("a data fragment lost too: rebuilt from the other parity") {
    std::vector<std::uint8_t> out(data.size());
    Result<StripeDamage> damage = ReconstructStripe(code, e->stripe(), Present(copies, 0b000010), out.data());
    REQUIRE(damage.ok());
    CHECK(damage->corrupt == std::vector<unsigned>{5});
    CHECK(damage->missing == std::vector<unsigned>{1});
    REQUIRE(out == data);
  }
}

TEST_CASE("erasure code: a corrupt data fragment is found and rebuilt") {
  for (auto [k, m] : {std::pair{4u, 1u}, std::pair{3u, 2u}}) {
    const ErasureCode code = Code(k, m);
    const std::vector<std::uint8_t> data = Pattern(5000, 9);
    Result<EncodedStripe> e = EncodeStripe(code, data.data(), data.size());
    REQUIRE(e.ok());
    for (unsigned bad = 0; bad < k; ++bad) {
      INFO("k=" << k << " m=" << m << " corrupt data fragment " << bad);
      Fragments copies = Copies(e.value());
      copies[bad].back() ^= 0x80;  // the last byte: padding for the last fragment, still caught
      std::vector<std::uint8_t> out(data.size());
      Result<StripeDamage> damage = ReconstructStripe(code, e->stripe(), Present(copies, 0), out.data());
      REQUIRE(damage.ok());
      CHECK(damage->corrupt == std::vector<unsigned>{bad});
      REQUIRE(out == data);
    }
  }
}

TEST_CASE("erasure code: fragments received in place in the output are used there") {
  const ErasureCode code = Code(4, 2);
  const std::vector<std::uint8_t> data = Pattern(4 * 640, 21);  // 4 whole fragments of 640
  Result<EncodedStripe> e = EncodeStripe(code, data.data(), data.size());
  REQUIRE(e.ok());
  const std::uint64_t f = e->stripe().fragment_bytes;
  REQUIRE(f == 640);
  const Fragments copies = Copies(e.value());
  // Fragments 0 and 2 arrive at their place in `out`; 1 arrives there damaged; 3 is lost.
  std::vector<std::uint8_t> out(data.size(), 0);
  std::memcpy(out.data(), copies[0].data(), f);
  std::memcpy(out.data() + 2 * f, copies[2].data(), f);
  std::memcpy(out.data() + f, copies[1].data(), f);
  out[f + 3] ^= 0xFF;
  const std::vector<const std::uint8_t*> frags = {out.data(), out.data() + f,   out.data() + 2 * f,
                                                  nullptr,    copies[4].data(), copies[5].data()};
  Result<StripeDamage> damage = ReconstructStripe(code, e->stripe(), frags, out.data());
  REQUIRE(damage.ok());
  CHECK(damage->corrupt == std::vector<unsigned>{1});
  CHECK(damage->missing == std::vector<unsigned>{3});
  REQUIRE(out == data);
}

TEST_CASE("erasure code: fewer than k intact fragments is DataLoss naming them, output untouched") {
  const ErasureCode code = Code(4, 2);
  const std::vector<std::uint8_t> data = Pattern(777, 5);
  Result<EncodedStripe> e = EncodeStripe(code, data.data(), data.size());
  REQUIRE(e.ok());
  Fragments copies = Copies(e.value());
  copies[5][0] ^= 0x10;
  std::vector<std::uint8_t> out(data.size(), 0x3C);
  Result<StripeDamage> damage = ReconstructStripe(code, e->stripe(), Present(copies, 0b001001), out.data());
  REQUIRE(damage.status().code() == StatusCode::kDataLoss);
  const std::string& msg = damage.status().message();
  INFO(msg);
  CHECK(msg.find("3 intact fragments, 4 needed") != std::string::npos);
  CHECK(msg.find("missing 0 (data), 3 (data)") != std::string::npos);
  CHECK(msg.find("checksum mismatch in 5 (parity)") != std::string::npos);
  CHECK(out == std::vector<std::uint8_t>(data.size(), 0x3C));

  Fragments frags(6, std::vector<std::uint8_t>(64, 0));
  std::vector<std::uint8_t*> want(6, nullptr);
  want[0] = frags[0].data();
  Status st = code.Rebuild(Present(frags, 0b000111), want, 64);
  CHECK(st.code() == StatusCode::kDataLoss);
  CHECK(st.message().find("missing 0 (data), 1 (data), 2 (data)") != std::string::npos);
}

TEST_CASE("erasure code: a stripe whose checksum disagrees with the rebuilt bytes is an internal error") {
  const ErasureCode code = Code(3, 2);
  const std::vector<std::uint8_t> data = Pattern(1000, 8);
  Result<EncodedStripe> e = EncodeStripe(code, data.data(), data.size());
  REQUIRE(e.ok());
  Stripe stripe = e->stripe();
  stripe.checksums[1] ^= 1;
  const Fragments copies = Copies(e.value());
  std::vector<std::uint8_t> out(data.size());
  Result<StripeDamage> damage = ReconstructStripe(code, stripe, Present(copies, 0b00010), out.data());
  CHECK(damage.status().code() == StatusCode::kInternal);
  CHECK(damage.status().message().find("rebuilt fragment 1 (data)") != std::string::npos);
}

TEST_CASE("erasure code: invalid k and m, and mismatched stripes, are InvalidArgument") {
  for (auto [k, m, says] : {std::tuple{0u, 2u, "k >= 1"}, std::tuple{4u, 0u, "m >= 1"},
                            std::tuple{30u, 3u, "k + m = 33 fragments, at most 32"}}) {
    Result<ErasureCode> code = ErasureCode::Create(k, m);
    INFO(code.status().message());
    CHECK(code.status().code() == StatusCode::kInvalidArgument);
    CHECK(code.status().message().find(says) != std::string::npos);
  }
  CHECK(ErasureCode::Create(28, 4).ok());
  CHECK(ErasureCode::Create(1, 31).ok());

  const ErasureCode code = Code(4, 2);
  const std::vector<std::uint8_t> data = Pattern(300, 1);
  Result<EncodedStripe> e = EncodeStripe(code, data.data(), data.size());
  REQUIRE(e.ok());
  const Fragments copies = Copies(e.value());
  std::vector<std::uint8_t> out(data.size());
  CHECK(ReconstructStripe(Code(4, 1), e->stripe(), Present(copies, 0), out.data()).status().code() ==
        StatusCode::kInvalidArgument);
  Stripe wrong_size = e->stripe();
  wrong_size.fragment_bytes = 64;
  CHECK(ReconstructStripe(code, wrong_size, Present(copies, 0), out.data()).status().code() ==
        StatusCode::kInvalidArgument);
  std::vector<const std::uint8_t*> five = Present(copies, 0);
  five.pop_back();
  CHECK(ReconstructStripe(code, e->stripe(), five, out.data()).status().code() ==
        StatusCode::kInvalidArgument);
  CHECK(EncodeStripe(ErasureCode(), data.data(), data.size()).status().code() ==
        StatusCode::kInvalidArgument);

  std::vector<std::uint8_t*> want(6, nullptr);
  std::vector<std::uint8_t> spare(e->stripe().fragment_bytes);
  want[2] = spare.data();
  Status present = code.Rebuild(Present(copies, 0), want, e->stripe().fragment_bytes);
  CHECK(present.code() == StatusCode::kInvalidArgument);
  CHECK(present.message().find("2 (data), which is present") != std::string::npos);
}

TEST_CASE("erasure code: parity folded in one data fragment at a time, in any order, is Encode's") {
  for (auto [k, m] : {std::pair{4u, 1u}, std::pair{3u, 2u}, std::pair{6u, 3u}}) {
    INFO(k << "+" << m);
    ErasureCode code = Code(k, m);
    const std::uint64_t bytes = 4096 + 64;
    Fragments data(k);
    std::vector<const std::uint8_t*> in(k);
    for (unsigned i = 0; i < k; ++i) {
      data[i] = Pattern(bytes, 40 + i);
      in[i] = data[i].data();
    }
    Fragments want(m, std::vector<std::uint8_t>(bytes));
    std::vector<std::uint8_t*> out(m);
    for (unsigned j = 0; j < m; ++j) out[j] = want[j].data();
    REQUIRE(code.Encode(in, out, bytes).ok());
    for (unsigned j = 0; j < m; ++j) {
      std::vector<std::uint8_t> parity(bytes, 0);
      for (unsigned n = 0; n < k; ++n) {
        const unsigned i = k - 1 - n;  // not in index order
        REQUIRE(code.Accumulate(i, j, data[i].data(), parity.data(), bytes).ok());
      }
      CHECK(parity == want[j]);
    }
    // A fragment never folded in counts as zeros: with it folded in too, it is Encode's.
    std::vector<std::uint8_t> partial(bytes, 0);
    for (unsigned i = 1; i < k; ++i) REQUIRE(code.Accumulate(i, 0, data[i].data(), partial.data(), bytes).ok());
    CHECK(partial != want[0]);
    REQUIRE(code.Accumulate(0, 0, data[0].data(), partial.data(), bytes).ok());
    CHECK(partial == want[0]);
    CHECK(code.Accumulate(k, 0, data[0].data(), partial.data(), bytes).code() == StatusCode::kInvalidArgument);
    CHECK(code.Accumulate(0, m, data[0].data(), partial.data(), bytes).code() == StatusCode::kInvalidArgument);
    CHECK(code.Accumulate(0, 0, data[0].data(), partial.data(), 100).code() == StatusCode::kInvalidArgument);
  }
}
