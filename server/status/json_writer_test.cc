#include "server/status/json_writer.h"

#include "gtest/gtest.h"

namespace cohort::server {
namespace {

TEST(JsonWriterTest, NestsAndSeparates) {
  JsonWriter w;
  w.BeginObject()
      .Field("a", 1)
      .Key("list")
      .BeginArray()
      .Int(-2)
      .String("x")
      .Bool(true)
      .Null()
      .BeginObject()
      .EndObject()
      .BeginArray()
      .EndArray()
      .EndArray()
      .Field("b", false)
      .Field("big", int64_t{9007199254740993})
      .EndObject();
  EXPECT_EQ(w.text(), R"({"a":1,"list":[-2,"x",true,null,{},[]],"b":false,)"
                      R"("big":9007199254740993})");
}

TEST(JsonWriterTest, EscapesWhatAPeerChose) {
  EXPECT_EQ(JsonQuote("plain"), R"("plain")");
  EXPECT_EQ(JsonQuote("q\"b\\n\n\t\r\x01\x7f"),
            R"("q\"b\\n\n\t\r\u0001\u007f")");
  EXPECT_EQ(JsonQuote("</script><b>&"),
            R"("\u003c/script\u003e\u003cb\u003e\u0026")");
  // Valid UTF-8 passes, invalid bytes become U+FFFD.
  EXPECT_EQ(JsonQuote("h\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80"),
            "\"h\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80\"");
  EXPECT_EQ(JsonQuote("a\xFF"
                      "b\xC3"),
            R"("a\ufffdb\ufffd")");
  EXPECT_EQ(JsonQuote("\xC0\xAF"), R"("\ufffd\ufffd")");  // Overlong '/'.
  EXPECT_EQ(JsonQuote("\xED\xA0\x80"),
            R"("\ufffd\ufffd\ufffd")");  // Surrogate.
  EXPECT_EQ(JsonQuote("\xE2\x80\xA8"), R"("\u2028")");
  EXPECT_EQ(JsonQuote(std::string("a\0b", 3)), R"("a\u0000b")");
}

}  // namespace
}  // namespace cohort::server
