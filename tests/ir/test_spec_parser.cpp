// Tests for the SPEC parser: real parse trees (names, keywords, values, byte positions), canonical
// printing, and the exact text of every syntax error, since users see those messages verbatim.
#include <gtest/gtest.h>

#include <string>

#include "optfuse/error.h"
#include "spec/spec_parser.h"

namespace optfuse::spec {
namespace {

using Kind = Value::Kind;

// The error message parse() throws, or a marker when it does not throw.
std::string error_of(const std::string& text) {
  try {
    Call c = parse(text);
    return "<no error; parsed " + to_string(c) + ">";
  } catch (const Error& e) {
    return e.what();
  }
}

TEST(SpecParser, ChainWithNestedCalls) {
  Call c = parse("chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))");
  EXPECT_EQ(c.name, "chain");
  EXPECT_EQ(c.pos, 0u);
  ASSERT_EQ(c.args.size(), 2u);

  const Arg& clip = c.args[0];
  EXPECT_TRUE(clip.keyword.empty());
  EXPECT_EQ(clip.pos, 6u);
  ASSERT_EQ(clip.value.kind, Kind::Call);
  EXPECT_EQ(clip.value.pos, 6u);
  EXPECT_EQ(clip.value.call->name, "clip_by_global_norm");
  EXPECT_EQ(clip.value.call->pos, 6u);
  ASSERT_EQ(clip.value.call->args.size(), 1u);
  EXPECT_EQ(clip.value.call->args[0].value.kind, Kind::Number);
  EXPECT_DOUBLE_EQ(clip.value.call->args[0].value.number, 1.0);
  EXPECT_EQ(clip.value.call->args[0].value.pos, 26u);

  ASSERT_EQ(c.args[1].value.kind, Kind::Call);
  const Call& adamw = *c.args[1].value.call;
  EXPECT_EQ(adamw.name, "adamw");
  EXPECT_EQ(adamw.pos, 32u);
  ASSERT_EQ(adamw.args.size(), 2u);
  EXPECT_EQ(adamw.args[0].keyword, "lr");
  EXPECT_EQ(adamw.args[0].pos, 38u);
  EXPECT_EQ(adamw.args[0].value.pos, 41u);
  EXPECT_DOUBLE_EQ(adamw.args[0].value.number, 1e-3);
  EXPECT_EQ(adamw.args[1].keyword, "weight_decay");
  EXPECT_EQ(adamw.args[1].pos, 47u);
  EXPECT_EQ(adamw.args[1].value.pos, 60u);
  EXPECT_DOUBLE_EQ(adamw.args[1].value.number, 0.01);

  EXPECT_EQ(to_string(c), "chain(clip_by_global_norm(1), adamw(lr=0.001, weight_decay=0.01))");
}

TEST(SpecParser, TupleAndBool) {
  Call c = parse("adam(lr=3e-4, betas=(0.9, 0.95), amsgrad=true)");
  ASSERT_EQ(c.args.size(), 3u);
  EXPECT_EQ(c.args[1].keyword, "betas");
  EXPECT_EQ(c.args[1].pos, 14u);
  const Value& betas = c.args[1].value;
  ASSERT_EQ(betas.kind, Kind::Tuple);
  EXPECT_EQ(betas.pos, 20u);
  ASSERT_EQ(betas.items.size(), 2u);
  EXPECT_DOUBLE_EQ(betas.items[0].number, 0.9);
  EXPECT_EQ(betas.items[0].pos, 21u);
  EXPECT_DOUBLE_EQ(betas.items[1].number, 0.95);
  EXPECT_EQ(betas.items[1].pos, 26u);
  EXPECT_EQ(c.args[2].value.kind, Kind::Bool);
  EXPECT_TRUE(c.args[2].value.boolean);
  EXPECT_EQ(to_string(c), "adam(lr=0.0003, betas=(0.9, 0.95), amsgrad=true)");
}

TEST(SpecParser, PositionalThenKeywordAndPythonBools) {
  Call c = parse("sgd(0.1, momentum=0.9, nesterov=True, foreach=False)");
  ASSERT_EQ(c.args.size(), 4u);
  EXPECT_TRUE(c.args[0].keyword.empty());
  EXPECT_DOUBLE_EQ(c.args[0].value.number, 0.1);
  EXPECT_EQ(c.args[1].keyword, "momentum");
  EXPECT_EQ(c.args[2].value.kind, Kind::Bool);
  EXPECT_TRUE(c.args[2].value.boolean);
  EXPECT_EQ(c.args[3].value.kind, Kind::Bool);
  EXPECT_FALSE(c.args[3].value.boolean);
  EXPECT_EQ(to_string(c), "sgd(0.1, momentum=0.9, nesterov=true, foreach=false)");
}

TEST(SpecParser, BareNameIsCallWithoutArgs) {
  Call c = parse("  adamw \n");
  EXPECT_EQ(c.name, "adamw");
  EXPECT_EQ(c.pos, 2u);
  EXPECT_TRUE(c.args.empty());
  EXPECT_EQ(to_string(c), "adamw()");
  EXPECT_EQ(to_string(parse("adamw()")), "adamw()");
}

TEST(SpecParser, Numbers) {
  Call c = parse("f(1, -3, 1e-3, .5, 2., +4, 1E+2, -0.25e1, 007)");
  const double want[] = {1, -3, 1e-3, 0.5, 2, 4, 100, -2.5, 7};
  ASSERT_EQ(c.args.size(), 9u);
  for (size_t k = 0; k < 9; ++k) {
    EXPECT_EQ(c.args[k].value.kind, Kind::Number) << k;
    EXPECT_DOUBLE_EQ(c.args[k].value.number, want[k]) << k;
  }
  EXPECT_EQ(c.args[1].value.pos, 5u);  // the sign belongs to the number
}

TEST(SpecParser, NamesStringsAndEscapes) {
  Call c = parse(R"(f('a b', "it's", x.y_2, 'q\'\n\\', mode=max))");
  ASSERT_EQ(c.args.size(), 5u);
  EXPECT_EQ(c.args[0].value.kind, Kind::String);
  EXPECT_EQ(c.args[0].value.text, "a b");
  EXPECT_EQ(c.args[1].value.text, "it's");
  EXPECT_EQ(c.args[2].value.kind, Kind::Name);
  EXPECT_EQ(c.args[2].value.text, "x.y_2");
  EXPECT_EQ(c.args[3].value.kind, Kind::String);
  EXPECT_EQ(c.args[3].value.text, "q'\n\\");
  EXPECT_EQ(c.args[4].keyword, "mode");
  EXPECT_EQ(c.args[4].value.kind, Kind::Name);
  EXPECT_EQ(c.args[4].value.text, "max");
  EXPECT_EQ(to_string(c), R"(f('a b', 'it\'s', x.y_2, 'q\'\n\\', mode=max))");
}

TEST(SpecParser, Tuples) {
  Call c = parse("f((1,), (1, 2, 3,), ((1, 2), x), betas=(0.9,0.999))");
  ASSERT_EQ(c.args.size(), 4u);
  EXPECT_EQ(c.args[0].value.items.size(), 1u);
  EXPECT_EQ(c.args[1].value.items.size(), 3u);
  const Value& nested = c.args[2].value;
  ASSERT_EQ(nested.items.size(), 2u);
  EXPECT_EQ(nested.items[0].kind, Kind::Tuple);
  EXPECT_EQ(nested.items[1].kind, Kind::Name);
  EXPECT_EQ(to_string(c), "f((1,), (1, 2, 3), ((1, 2), x), betas=(0.9, 0.999))");
}

TEST(SpecParser, WhitespaceAndNewlinesAnywhere) {
  Call c = parse(" chain (\n  adam( lr = 1 ) ,\n\tsgd\t(0.1),\n)\n");
  EXPECT_EQ(c.pos, 1u);
  ASSERT_EQ(c.args.size(), 2u);  // trailing comma before ')' is accepted
  EXPECT_EQ(c.args[0].value.call->name, "adam");
  EXPECT_EQ(c.args[0].value.pos, 11u);
  EXPECT_EQ(c.args[0].value.call->args[0].pos, 17u);
  EXPECT_EQ(c.args[0].value.call->args[0].value.pos, 22u);
  EXPECT_EQ(c.args[1].value.pos, 29u);
  EXPECT_EQ(to_string(c), "chain(adam(lr=1), sgd(0.1))");
}

TEST(SpecParser, CanonicalNumbersRoundTrip) {
  EXPECT_EQ(to_string(parse("f(1e-8, 0.1, 1e20, 123456789, 0.3333333333333333, -0.0)")),
            "f(1e-08, 0.1, 1e+20, 123456789, 0.3333333333333333, -0)");
  const std::string text = "chain(clip(1.5), adam(lr=0.0003, betas=(0.9, 0.95), eps=1e-08, m='x'))";
  EXPECT_EQ(to_string(parse(text)), text);
  EXPECT_EQ(to_string(parse(to_string(parse(text)))), text);
}

TEST(SpecParser, FormatPosition) {
  EXPECT_EQ(format_position("ab\ncd", 4), "line 2, column 2\n  cd\n   ^");
  EXPECT_EQ(format_position("\tx", 1), "line 1, column 2\n  \tx\n  \t^");  // tab kept for alignment
  EXPECT_EQ(format_position("ab\r\ncd", 1), "line 1, column 2\n  ab\n   ^");
  EXPECT_EQ(format_position("f('\xC3\xA9', @)",  // UTF-8: é is one column
            8),
            "line 1, column 8\n  f('\xC3\xA9', @)\n         ^");
}

// ---- errors: exact messages ----

TEST(SpecParserErrors, ThrowsOptfuseError) {
  EXPECT_THROW(parse("adam(lr=)"), Error);
}

TEST(SpecParserErrors, EmptyText) {
  EXPECT_EQ(error_of(""),
            "spec: empty spec: expected a call such as adam(lr=1e-3) at line 1, column 1\n  \n  ^");
  EXPECT_EQ(error_of("   "),
            "spec: empty spec: expected a call such as adam(lr=1e-3) at line 1, column 4\n"
            "     \n     ^");
}

TEST(SpecParserErrors, NotACall) {
  EXPECT_EQ(error_of("(1, 2)"), "spec: expected a rule name at line 1, column 1\n  (1, 2)\n  ^");
  EXPECT_EQ(error_of("1.0"), "spec: expected a rule name at line 1, column 1\n  1.0\n  ^");
}

TEST(SpecParserErrors, MissingComma) {
  EXPECT_EQ(error_of("chain(adam(lr=1e-3) sgd(0.1))"),
            "spec: expected ')' or ',' after argument at line 1, column 21\n"
            "  chain(adam(lr=1e-3) sgd(0.1))\n"
            "                      ^");
  EXPECT_EQ(error_of("chain(\n  adam(lr=1e-3)\n  sgd(0.1)\n)"),
            "spec: expected ')' or ',' after argument at line 3, column 3\n    sgd(0.1)\n    ^");
}

TEST(SpecParserErrors, TrailingGarbage) {
  EXPECT_EQ(error_of("adam() x"),
            "spec: expected end of text after the call at line 1, column 8\n"
            "  adam() x\n         ^");
  EXPECT_EQ(error_of("adam(lr=1))"),
            "spec: expected end of text after the call at line 1, column 11\n"
            "  adam(lr=1))\n            ^");
}

TEST(SpecParserErrors, UnterminatedParenthesis) {
  EXPECT_EQ(error_of("adam(lr=1e-3"),
            "spec: unterminated '(': expected ')' before end of text at line 1, column 5\n"
            "  adam(lr=1e-3\n      ^");
  EXPECT_EQ(error_of("adam(lr=1,"),
            "spec: unterminated '(': expected ')' before end of text at line 1, column 5\n"
            "  adam(lr=1,\n      ^");
  EXPECT_EQ(error_of("adam(betas=(0.9"),
            "spec: unterminated '(': expected ')' before end of text at line 1, column 12\n"
            "  adam(betas=(0.9\n             ^");
}

TEST(SpecParserErrors, MissingValueAfterEquals) {
  EXPECT_EQ(error_of("adam(lr=)"),
            "spec: expected a value after '=' at line 1, column 9\n  adam(lr=)\n          ^");
  EXPECT_EQ(error_of("adam(lr="),
            "spec: expected a value after '=' at line 1, column 9\n  adam(lr=\n          ^");
  EXPECT_EQ(error_of("f(,)"), "spec: expected an argument at line 1, column 3\n  f(,)\n    ^");
}

TEST(SpecParserErrors, BadNumber) {
  EXPECT_EQ(error_of("f(1e)"), "spec: invalid number '1e' at line 1, column 3\n  f(1e)\n    ^");
  EXPECT_EQ(error_of("f(x=1.2.3)"),
            "spec: invalid number '1.2.3' at line 1, column 5\n  f(x=1.2.3)\n      ^");
  EXPECT_EQ(error_of("f(-inf)"),
            "spec: invalid number '-inf' at line 1, column 3\n  f(-inf)\n    ^");
  EXPECT_EQ(error_of("f(.)"), "spec: invalid number '.' at line 1, column 3\n  f(.)\n    ^");
  EXPECT_EQ(error_of("f(1e999)"),
            "spec: number out of range '1e999' at line 1, column 3\n  f(1e999)\n    ^");
}

TEST(SpecParserErrors, UnknownCharacter) {
  EXPECT_EQ(error_of("adam(lr=@)"),
            "spec: unexpected character '@' at line 1, column 9\n  adam(lr=@)\n          ^");
  EXPECT_EQ(error_of("adam(lr=1) $"),
            "spec: unexpected character '$' at line 1, column 12\n  adam(lr=1) $\n             ^");
}

TEST(SpecParserErrors, PositionalAfterKeyword) {
  EXPECT_EQ(error_of("sgd(lr=0.1, 0.9)"),
            "spec: positional argument after keyword argument at line 1, column 13\n"
            "  sgd(lr=0.1, 0.9)\n              ^");
}

TEST(SpecParserErrors, DuplicateKeyword) {
  EXPECT_EQ(error_of("adam(lr=1, lr=2)"),
            "spec: duplicate keyword 'lr' at line 1, column 12\n"
            "  adam(lr=1, lr=2)\n             ^");
}

TEST(SpecParserErrors, EmptyAndOneItemTuple) {
  EXPECT_EQ(error_of("adam(betas=())"),
            "spec: empty tuple: expected at least one item at line 1, column 12\n"
            "  adam(betas=())\n             ^");
  EXPECT_EQ(error_of("adam(betas=(0.9))"),
            "spec: expected ',' in one-item tuple, as in (x,) at line 1, column 16\n"
            "  adam(betas=(0.9))\n                 ^");
}

TEST(SpecParserErrors, UnterminatedString) {
  EXPECT_EQ(error_of("f('abc)"),
            "spec: unterminated string: expected closing ' at line 1, column 3\n  f('abc)\n    ^");
}

TEST(SpecParserErrors, DeepNestingThrowsInsteadOfCrashing) {
  std::string deep = "f(" + std::string(100000, '(');
  std::string msg = error_of(deep);
  EXPECT_EQ(msg.rfind("spec: nesting too deep at line 1, column ", 0), 0u) << msg;
}

}  // namespace
}  // namespace optfuse::spec
