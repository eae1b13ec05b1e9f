// The small files of the commit protocol (format/markers.h) and the catalog reading them
// back: what each parser accepts, beyond what the fuzzers (tests/fuzz/) check by invariant.
#include "format/markers.h"

#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>

#include "daemon/catalog/catalog.h"
#include "daemon/io/storage.h"
#include "support/test_dirs.h"

using namespace ckpt;
using ckpt::test::ReadFile;
using ckpt::test::TempDir;
namespace fs = std::filesystem;

namespace {

void Put(const std::string& path, const std::string& content) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << content;
  out.close();
  REQUIRE(out.good());
}

}  // namespace

TEST_CASE("markers: latest holds one canonical decimal") {
  CHECK(RenderLatest(42) == "42\n");
  CHECK(ParseLatest("42\n") == 42u);
  CHECK(ParseLatest("42") == 42u);
  CHECK(ParseLatest("0\n") == 0u);
  CHECK(ParseLatest("18446744073709551615\n") == 18446744073709551615ull);
  for (const char* bad : {"", "\n", "18446744073709551616\n", "-1\n", "+1\n", " 1\n", "1 \n", "01\n", "1\n\n",
                          "5abc", "0x10\n", "1e3\n", "99999999999999999999999\n"}) {
    INFO(bad);
    CHECK_FALSE(ParseLatest(bad).has_value());
  }
}

TEST_CASE("markers: COMMITTED renders as before and parses back") {
  CommittedMarker m{"job-1", 42, 8, 1764612000};
  CHECK(RenderCommitted(m) ==
        "{\"job\":\"job-1\",\"version\":42,\"world_size\":8,\"committed_at\":1764612000}\n");
  auto back = ParseCommitted(RenderCommitted(m));
  REQUIRE(back.ok());
  CHECK((back->job == m.job && back->version == m.version && back->world_size == m.world_size &&
         back->committed_at == m.committed_at));
  for (const char* bad :
       {"", "[]", "{\"job\":1,\"version\":1,\"world_size\":1,\"committed_at\":1}",
        "{\"job\":\"j\",\"version\":-1,\"world_size\":1,\"committed_at\":1}",
        "{\"job\":\"j\",\"version\":1.0,\"world_size\":1,\"committed_at\":1}",
        "{\"job\":\"j\",\"version\":1,\"world_size\":0,\"committed_at\":1}",
        "{\"job\":\"j\",\"version\":1,\"world_size\":4294967296,\"committed_at\":1}",
        "{\"job\":\"j\",\"version\":1,\"world_size\":1,\"committed_at\":9223372036854775808}",
        "{\"job\":\"j\",\"version\":1,\"world_size\":1}"}) {
    INFO(bad);
    auto r = ParseCommitted(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == StatusCode::kDataLoss);
  }
}

TEST_CASE("markers: a registration id is the file's bytes, and nothing else") {
  CHECK(ParseRegistration("0123456789abcdef0123456789abcdef") == "0123456789abcdef0123456789abcdef");
  CHECK(ParseRegistration("run-1") == "run-1");
  CHECK(ParseRegistration(std::string(kMaxRegistrationBytes, 'x')).has_value());
  for (const std::string& bad : {std::string(), std::string("run-1\n"), std::string(" run-1"),
                                 std::string(kMaxRegistrationBytes + 1, 'x'), std::string("a\0b", 3)}) {
    CHECK_FALSE(ParseRegistration(bad).has_value());
  }
}

TEST_CASE("markers: RESTORABLE names every rank once, in order, and nothing else") {
  const RestorableMarker m{3, {{0, "r-a"}, {1, "r-b"}, {2, "r-a"}}};
  const std::string text = RenderRestorable(m);
  CHECK(text == "world_size 3\n0 r-a\n1 r-b\n2 r-a\n");
  auto back = ParseRestorable(text);
  REQUIRE(back.has_value());
  CHECK(back->world_size == 3);
  CHECK(back->registrations == m.registrations);
  for (const std::string& bad :
       {std::string(), std::string("world_size 3\n"), std::string("world_size 2\n0 a\n"),
        std::string("world_size 2\n0 a\n2 b\n"), std::string("world_size 1\n0 a\n1 b\n"),
        std::string("world_size 0\n"), std::string("world_size 01\n0 a\n"), std::string("world_size 1\n0 a"),
        std::string("world_size 1\n1 a\n"), std::string("world_size 1 \n0 a\n"), std::string("0 a\n")}) {
    INFO(bad);
    CHECK_FALSE(ParseRestorable(bad).has_value());
  }
  // The replica markers' names: the done markers' with ".repl", never taken for each other.
  CHECK(NodeMarkerName("n1-abcd", 8, NodeMarkerKind::kReplicated) == "node-n1-abcd.8.repl");
  CHECK(ParseNodeMarkerName("node-n1-abcd.8.repl", NodeMarkerKind::kReplicated)->ranks == 8);
  CHECK_FALSE(ParseNodeMarkerName("node-n1-abcd.8.repl").has_value());
  CHECK_FALSE(ParseNodeMarkerName("node-n1-abcd.8.done", NodeMarkerKind::kReplicated).has_value());
}

TEST_CASE("markers: recovery repairs a latest that holds no version number") {
  TempDir dir("markers");
  auto storage = std::make_shared<PosixStorage>();
  {
    Catalog catalog(storage, dir.path());
    REQUIRE(catalog.Recover().ok());
    // v5 committed, `latest` edited into something that only begins with its number: strtoull
    // read it as 5 and left it.
    Put(catalog.VersionDir("job", 5) + "/COMMITTED", RenderCommitted({"job", 5, 1, 0}));
    Put(catalog.JobDir("job") + "/latest", "5abc");
    // A job with nothing committed whose `latest` holds garbage: strtoull read 0 and kept it.
    fs::create_directories(catalog.JobDir("empty"));
    Put(catalog.JobDir("empty") + "/latest", "garbage");
  }
  Catalog recovered(storage, dir.path());
  REQUIRE(recovered.Recover().ok());
  CHECK(ReadFile(recovered.JobDir("job") + "/latest") == "5\n");
  CHECK(recovered.Latest("job") == 5);
  CHECK_FALSE(fs::exists(recovered.JobDir("empty") + "/latest"));
}
