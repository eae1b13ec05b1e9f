// The one decimal rule of names and markers: digits only, no sign, no leading zero, at most
// 19 digits, no value above the caller's bound; padded names drop their zeros first.
#include "common/decimal.h"

#include <catch2/catch.hpp>

using ckpt::ParseDecimal;
using ckpt::ParsePaddedDecimal;

TEST_CASE("ParseDecimal accepts canonical decimals only", "[decimal]") {
  CHECK(ParseDecimal("0") == 0u);
  CHECK(ParseDecimal("7") == 7u);
  CHECK(ParseDecimal("1000") == 1000u);
  CHECK(ParseDecimal("9999999999999999999") == ckpt::kMaxDecimal);
  CHECK_FALSE(ParseDecimal(""));
  CHECK_FALSE(ParseDecimal("00"));
  CHECK_FALSE(ParseDecimal("07"));
  CHECK_FALSE(ParseDecimal("+7"));
  CHECK_FALSE(ParseDecimal("-7"));
  CHECK_FALSE(ParseDecimal(" 7"));
  CHECK_FALSE(ParseDecimal("7 "));
  CHECK_FALSE(ParseDecimal("1e3"));
  CHECK_FALSE(ParseDecimal("0x10"));
  CHECK_FALSE(ParseDecimal("10000000000000000000"));  // 20 digits
  CHECK_FALSE(ParseDecimal("18446744073709551615"));  // 2^64 - 1: 20 digits too
  CHECK_FALSE(ParseDecimal("18446744073709551615", UINT64_MAX));  // no bound goes past 19 digits
  CHECK_FALSE(ParseDecimal("18446744073709551616"));  // 2^64
  CHECK_FALSE(ParseDecimal("99999999999999999999999"));
}

TEST_CASE("ParseDecimal honours the caller's bound", "[decimal]") {
  CHECK(ParseDecimal("4294967295", UINT32_MAX) == UINT32_MAX);
  CHECK_FALSE(ParseDecimal("4294967296", UINT32_MAX));
  CHECK(ParseDecimal("10", 10) == 10u);
  CHECK_FALSE(ParseDecimal("11", 10));
  CHECK(ParseDecimal("0", 0) == 0u);
  CHECK_FALSE(ParseDecimal("1", 0));
}

TEST_CASE("ParsePaddedDecimal drops the padding of fixed-width names", "[decimal]") {
  CHECK(ParsePaddedDecimal("0000000042") == 42u);
  CHECK(ParsePaddedDecimal("00000") == 0u);
  CHECK(ParsePaddedDecimal("0") == 0u);
  CHECK(ParsePaddedDecimal("42") == 42u);
  CHECK_FALSE(ParsePaddedDecimal(""));
  CHECK_FALSE(ParsePaddedDecimal("00-1"));
  CHECK_FALSE(ParsePaddedDecimal("0099999", 99998));
  CHECK(ParsePaddedDecimal("000009999999999999999999") == ckpt::kMaxDecimal);
  CHECK_FALSE(ParsePaddedDecimal("00010000000000000000000"));
}
