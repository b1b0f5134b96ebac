#include <algorithm>

#include "commands.h"
#include "optfuse/error.h"

namespace optfuse::cli {

std::string Options::get(const std::string& name, const std::string& fallback) const {
  for (auto it = named.rbegin(); it != named.rend(); ++it)
    if (it->first == name) return it->second;
  return fallback;
}

bool Options::flag(const std::string& name) const {
  return std::any_of(named.begin(), named.end(), [&](auto& kv) { return kv.first == name; });
}

Options parse_options(const Argv& args, const std::vector<std::string>& known, const std::vector<std::string>& flags) {
  Options o;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a.rfind("--", 0) != 0) {
      o.positional.push_back(a);
      continue;
    }
    std::string name = a.substr(2), value;
    size_t eq = name.find('=');
    if (eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    bool is_flag = std::find(flags.begin(), flags.end(), name) != flags.end();
    if (!is_flag && std::find(known.begin(), known.end(), name) == known.end())
      throw Error("unknown option --" + name);
    if (is_flag) {
      value = "1";
    } else if (eq == std::string::npos) {
      if (i + 1 >= args.size()) throw Error("option --" + name + " needs a value");
      value = args[++i];
    }
    o.named.emplace_back(name, value);
  }
  return o;
}

}  // namespace optfuse::cli
