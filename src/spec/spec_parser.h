// SPEC text -> AST. A SPEC names an optimizer chain in a call syntax, e.g.
//   chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))
// This layer only knows the syntax; mapping names to rules and checking arguments happens later,
// which is why every node keeps its byte offset: later layers report errors at the same positions.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

namespace optfuse::spec {

struct Call;

struct Value {
  enum class Kind { Number, Bool, Tuple, Call, Name, String };
  Kind kind = Kind::Number;
  double number = 0;           // Number: decimal/exponent with optional sign; never inf or nan
  bool boolean = false;        // Bool: true/false/True/False
  std::string text;            // Name (bare identifier that is not a call), String ('..' or "..")
  std::vector<Value> items;    // Tuple: (a, b, ...) with >= 2 items, or (a,) for one
  std::shared_ptr<Call> call;  // Call
  size_t pos = 0;              // 0-based byte offset where the value starts
};

struct Arg {
  std::string keyword;  // empty when positional
  Value value;
  size_t pos = 0;  // offset of the keyword, or of the value when positional
};

struct Call {
  std::string name;
  std::vector<Arg> args;
  size_t pos = 0;  // offset of the name
};

// Parses text that must hold exactly one call; a bare name ("adamw") is a call with no args.
// Throws optfuse::Error "spec: <what> at line L, column C\n<line>\n<caret>" on any syntax error.
Call parse(const std::string& text);

// "line L, column C" (1-based; columns count UTF-8 characters), then the line and a caret under C.
std::string format_position(const std::string& text, size_t pos);

// Canonical form used for golden output: name(a, k=v), numbers in shortest %.17g-style form
// ("0.001", "1e-08"), bools lowercase, strings single-quoted, one-item tuples as (x,).
std::string to_string(const Call& call);
std::string to_string(const Value& value);

}  // namespace optfuse::spec
