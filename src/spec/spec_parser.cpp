// Hand-written recursive descent over characters (no separate lexer: the grammar is small and
// scanning in place keeps every error position exact).
//   spec  := call EOF
//   call  := NAME [ '(' [ arg (',' arg)* [','] ] ')' ]
//   arg   := NAME '=' value | value
//   value := NUMBER | STRING | BOOL | NAME | call | '(' value ',' [ value (',' value)* [','] ] ')'
#include "spec/spec_parser.h"

#include <charconv>
#include <cstdio>
#include <set>

#include "optfuse/error.h"

namespace optfuse::spec {
namespace {

// Locale-independent on purpose: <cctype> answers depend on the process locale.
bool is_alpha(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
bool is_digit(char c) { return c >= '0' && c <= '9'; }
bool is_ident_start(char c) { return is_alpha(c) || c == '_'; }
bool is_ident_char(char c) { return is_ident_start(c) || is_digit(c) || c == '.'; }
bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
// Characters that can start or continue some token; anything else is reported as itself rather
// than as a confusing "expected ..." message.
bool is_known(char c) {
  return is_ident_char(c) || is_space(c) || c == '+' || c == '-' || c == '\'' || c == '"' ||
         c == '(' || c == ')' || c == ',' || c == '=';
}

// Bounds recursion so hostile input like "((((..." throws instead of overflowing the stack.
constexpr int kMaxDepth = 100;

class Parser {
 public:
  explicit Parser(const std::string& text) : s_(text) {}

  Call parse_spec() {
    skip_ws();
    if (eof()) fail("empty spec: expected a call such as adam(lr=1e-3)", i_);
    if (!is_ident_start(peek())) expected("expected a rule name");
    size_t pos = i_;
    Call call = parse_call_rest(read_ident(), pos, 0);
    skip_ws();
    if (!eof()) expected("expected end of text after the call");
    return call;
  }

 private:
  const std::string& s_;
  size_t i_ = 0;

  bool eof() const { return i_ >= s_.size(); }
  char peek() const { return s_[i_]; }
  void skip_ws() {
    while (!eof() && is_space(peek())) ++i_;
  }

  [[noreturn]] void fail(const std::string& what, size_t pos) const {
    throw Error("spec: " + what + " at " + format_position(s_, pos));
  }
  // Fails at the current position, preferring to name a character the grammar never uses.
  [[noreturn]] void expected(const std::string& what) const {
    if (!eof() && !is_known(peek())) {
      unsigned char c = static_cast<unsigned char>(peek());
      char buf[8];
      std::snprintf(buf, sizeof buf, c >= 0x20 && c < 0x7f ? "'%c'" : "0x%02X", c);
      fail(std::string("unexpected character ") + buf, i_);
    }
    fail(what, i_);
  }
  // Reported at the opening parenthesis, since that is what the user has to fix.
  [[noreturn]] void unterminated(size_t open) const {
    fail("unterminated '(': expected ')' before end of text", open);
  }

  std::string read_ident() {
    size_t start = i_;
    while (!eof() && is_ident_char(peek())) ++i_;
    return s_.substr(start, i_ - start);
  }

  // After NAME: parses "(args)" if present; whitespace before '(' is allowed like anywhere else.
  Call parse_call_rest(std::string name, size_t pos, int depth) {
    Call call{std::move(name), {}, pos};
    skip_ws();
    if (eof() || peek() != '(') return call;
    if (depth >= kMaxDepth) fail("nesting too deep", i_);
    size_t open = i_++;
    std::set<std::string> seen;
    for (;;) {
      skip_ws();
      if (eof()) unterminated(open);
      if (peek() == ')') break;  // empty list, or trailing comma
      Arg arg = parse_arg(depth + 1);
      if (arg.keyword.empty() && !seen.empty())
        fail("positional argument after keyword argument", arg.pos);
      if (!arg.keyword.empty() && !seen.insert(arg.keyword).second)
        fail("duplicate keyword '" + arg.keyword + "'", arg.pos);
      call.args.push_back(std::move(arg));
      skip_ws();
      if (eof()) unterminated(open);
      if (peek() == ')') break;
      if (peek() != ',') expected("expected ')' or ',' after argument");
      ++i_;
    }
    ++i_;
    return call;
  }

  Arg parse_arg(int depth) {
    Arg arg;
    arg.pos = i_;
    if (is_ident_start(peek())) {
      std::string name = read_ident();
      skip_ws();
      if (!eof() && peek() == '=') {
        ++i_;
        skip_ws();
        arg.keyword = std::move(name);
        arg.value = parse_value("expected a value after '='", depth);
        return arg;
      }
      i_ = arg.pos;  // not a keyword: rescan the identifier as a value
    }
    arg.value = parse_value("expected an argument", depth);
    return arg;
  }

  Value parse_value(const char* what, int depth) {
    Value v;
    v.pos = i_;
    if (eof()) expected(what);
    char c = peek();
    if (is_ident_start(c)) {
      std::string name = read_ident();
      skip_ws();
      if (!eof() && peek() == '(') {
        v.kind = Value::Kind::Call;
        v.call = std::make_shared<Call>(parse_call_rest(std::move(name), v.pos, depth));
      } else if (name == "true" || name == "True" || name == "false" || name == "False") {
        v.kind = Value::Kind::Bool;
        v.boolean = name[0] == 't' || name[0] == 'T';
      } else {
        v.kind = Value::Kind::Name;
        v.text = std::move(name);
      }
    } else if (is_digit(c) || c == '.' || c == '+' || c == '-') {
      v.kind = Value::Kind::Number;
      v.number = parse_number();
    } else if (c == '\'' || c == '"') {
      v.kind = Value::Kind::String;
      v.text = parse_string();
    } else if (c == '(') {
      v.kind = Value::Kind::Tuple;
      v.items = parse_tuple(depth);
    } else {
      expected(what);
    }
    return v;
  }

  // Takes the whole run of number-like characters first, so "1.2.3" or "1e" is reported as one
  // bad token rather than as a valid prefix followed by a puzzling error.
  double parse_number() {
    size_t start = i_, j = i_, n = s_.size();
    if (s_[j] == '+' || s_[j] == '-') ++j;
    while (j < n && (is_ident_char(s_[j]) ||
                     ((s_[j] == '+' || s_[j] == '-') && (s_[j - 1] == 'e' || s_[j - 1] == 'E'))))
      ++j;
    std::string tok = s_.substr(start, j - start);
    // Strict shape: [+-] (D+ [. D*] | . D+) [(e|E) [+-] D+]; from_chars alone would accept "inf".
    size_t k = (tok[0] == '+' || tok[0] == '-') ? 1 : 0, mant = 0, exp = 1;
    while (k < tok.size() && is_digit(tok[k])) ++k, ++mant;
    if (k < tok.size() && tok[k] == '.')
      for (++k; k < tok.size() && is_digit(tok[k]); ++k) ++mant;
    if (k < tok.size() && (tok[k] == 'e' || tok[k] == 'E')) {
      ++k, exp = 0;
      if (k < tok.size() && (tok[k] == '+' || tok[k] == '-')) ++k;
      while (k < tok.size() && is_digit(tok[k])) ++k, ++exp;
    }
    if (mant == 0 || exp == 0 || k != tok.size()) fail("invalid number '" + tok + "'", start);
    // from_chars is locale-independent but rejects a leading '+'.
    const char* first = tok.data() + (tok[0] == '+' ? 1 : 0);
    double d = 0;
    auto res = std::from_chars(first, tok.data() + tok.size(), d);
    if (res.ec != std::errc() || res.ptr != tok.data() + tok.size())
      fail("number out of range '" + tok + "'", start);
    i_ = j;
    return d;
  }

  std::string parse_string() {
    size_t start = i_;
    char quote = s_[i_++];
    std::string out;
    for (;;) {
      // Strings stay on one line so a missing quote is caught where it happens.
      if (eof() || peek() == '\n') fail("unterminated string: expected closing " +
                                        std::string(1, quote), start);
      char c = s_[i_++];
      if (c == quote) return out;
      if (c != '\\') {
        out += c;
        continue;
      }
      if (eof()) continue;  // reported as unterminated on the next iteration
      char e = s_[i_];
      if (e == 'n') out += '\n';
      else if (e == 't') out += '\t';
      else if (e == '\\' || e == '\'' || e == '"') out += e;
      else fail("invalid escape in string: expected one of \\n \\t \\\\ \\' \\\"", i_ - 1);
      ++i_;
    }
  }

  std::vector<Value> parse_tuple(int depth) {
    if (depth >= kMaxDepth) fail("nesting too deep", i_);
    size_t open = i_++;
    std::vector<Value> items;
    for (;;) {
      skip_ws();
      if (eof()) unterminated(open);
      if (peek() == ')') {
        if (items.empty()) fail("empty tuple: expected at least one item", open);
        break;  // trailing comma
      }
      items.push_back(parse_value("expected a tuple item", depth + 1));
      skip_ws();
      if (eof()) unterminated(open);
      if (peek() == ')') {
        // "(0.9)" is far more likely a typo for a tuple than a grouping, so it is not accepted.
        if (items.size() == 1) fail("expected ',' in one-item tuple, as in (x,)", i_);
        break;
      }
      if (peek() != ',') expected("expected ')' or ',' in tuple");
      ++i_;
    }
    ++i_;
    return items;
  }
};

std::string format_number(double d) {
  // Shortest precision that round-trips, i.e. %.17g with the noise digits trimmed.
  char buf[64];
  for (int prec = 1;; ++prec) {
    auto res = std::to_chars(buf, buf + sizeof buf, d, std::chars_format::general, prec);
    double back = 0;
    std::from_chars(buf, res.ptr, back);
    if (back == d || prec >= 17) return std::string(buf, res.ptr);
  }
}

}  // namespace

Call parse(const std::string& text) { return Parser(text).parse_spec(); }

std::string format_position(const std::string& text, size_t pos) {
  if (pos > text.size()) pos = text.size();
  size_t line = 1, start = 0;
  for (size_t k = 0; k < pos; ++k)
    if (text[k] == '\n') ++line, start = k + 1;
  size_t end = text.find('\n', start);
  std::string src = text.substr(start, (end == std::string::npos ? text.size() : end) - start);
  if (!src.empty() && src.back() == '\r') src.pop_back();
  // Tabs are copied so the caret lines up; UTF-8 continuation bytes take no column.
  std::string caret;
  for (size_t k = start; k < pos; ++k) {
    unsigned char c = static_cast<unsigned char>(text[k]);
    if ((c & 0xC0) != 0x80) caret += c == '\t' ? '\t' : ' ';
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(caret.size() + 1) +
         "\n  " + src + "\n  " + caret + "^";
}

std::string to_string(const Value& v) {
  switch (v.kind) {
    case Value::Kind::Number: return format_number(v.number);
    case Value::Kind::Bool: return v.boolean ? "true" : "false";
    case Value::Kind::Name: return v.text;
    case Value::Kind::Call: return v.call ? to_string(*v.call) : "<null>";
    case Value::Kind::String: {
      std::string out = "'";
      for (char c : v.text) {
        if (c == '\n') out += "\\n";
        else if (c == '\t') out += "\\t";
        else if (c == '\\' || c == '\'') out += std::string("\\") + c;
        else out += c;
      }
      return out + "'";
    }
    case Value::Kind::Tuple: {
      std::string out = "(";
      for (size_t k = 0; k < v.items.size(); ++k) out += (k ? ", " : "") + to_string(v.items[k]);
      return out + (v.items.size() == 1 ? ",)" : ")");
    }
  }
  return "";
}

std::string to_string(const Call& call) {
  std::string out = call.name + "(";
  for (size_t k = 0; k < call.args.size(); ++k) {
    if (k) out += ", ";
    if (!call.args[k].keyword.empty()) out += call.args[k].keyword + "=";
    out += to_string(call.args[k].value);
  }
  return out + ")";
}

}  // namespace optfuse::spec
