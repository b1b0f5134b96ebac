// SHA-256 against the FIPS 180-2 example vectors (appendix B), plus the empty message and
// byte-at-a-time updates, so the block buffering is exercised across every boundary.
#include "runtime/sha256.h"

#include <gtest/gtest.h>

#include <string>

namespace optfuse {
namespace {

TEST(Sha256, Fips180_2OneBlock) {
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

TEST(Sha256, Fips180_2TwoBlocks) {
  EXPECT_EQ(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq"),
            "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
}

TEST(Sha256, Fips180_2MillionA) {
  std::string a(1000000, 'a');
  EXPECT_EQ(sha256_hex(a), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  Sha256 s;  // the same message, 1 byte then 999 at a time
  s.update(a.data(), 1);
  for (size_t at = 1; at < a.size(); at += 999) s.update(a.data() + at, std::min<size_t>(999, a.size() - at));
  EXPECT_EQ(to_hex(s.finish()), "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(Sha256, EmptyAndPaddingBoundaries) {
  EXPECT_EQ(sha256_hex(""), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  // 55 and 56 bytes: the length fits in the last block, or needs one more.
  EXPECT_EQ(sha256_hex(std::string(55, 'a')), "9f4390f8d30c2dd92ec9f095b65e2b9ae9b0a925a5258e241c9f1e910f734318");
  EXPECT_EQ(sha256_hex(std::string(56, 'a')), "b35439a4ac6f0948b6d6f9e3c6af0f5f590ce20f1bde7090ef7970686ec6738a");
  std::string msg = "The quick brown fox jumps over the lazy dog";
  Sha256 s;
  for (char c : msg) s.update(&c, 1);
  EXPECT_EQ(to_hex(s.finish()), "d7a8fbb307d7809469ca9abcb0082e4f8d5651e46d3cdb762d02d0bf37c9e592");
}

// Every test above runs with the CPU's best implementation; this one checks the other against it
// on every length from 0 to 300 bytes and a few large ones (all block and padding boundaries).
TEST(Sha256, PortableAndAcceleratedAgree) {
  const bool had = sha256_accelerated();
  if (!had && !sha256_use_accelerated(true)) GTEST_SKIP() << "this CPU has no SHA extensions; only the portable code runs";
  sha256_use_accelerated(had);
  std::string data;
  for (int i = 0; i < 70000; ++i) data += static_cast<char>((i * 2654435761u) >> 13);
  for (size_t len : {size_t(1000), size_t(4096), size_t(65537), data.size()})
    for (bool on : {true, false}) {
      sha256_use_accelerated(on);
      std::string fast = to_hex(sha256(data.data(), len));
      sha256_use_accelerated(!on);
      EXPECT_EQ(fast, to_hex(sha256(data.data(), len))) << len;
    }
  for (size_t len = 0; len <= 300; ++len) {
    sha256_use_accelerated(true);
    std::string a = to_hex(sha256(data.data(), len));
    sha256_use_accelerated(false);
    ASSERT_EQ(a, to_hex(sha256(data.data(), len))) << len;
  }
  sha256_use_accelerated(had);
  EXPECT_EQ(sha256_hex("abc"), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
}

}  // namespace
}  // namespace optfuse
