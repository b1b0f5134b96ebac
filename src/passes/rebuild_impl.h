// Implementation of rebuild() (a template, so it lives in a header).
#pragma once
#include <map>

namespace optfuse {

template <class Fn>
Program rebuild(const Program& in, Fn rewrite) {
  Program out;
  out.chain_text = in.chain_text;
  out.states = in.states;
  out.hypers = in.hypers;
  out.uniform_states = in.uniform_states;
  out.precision = in.precision;
  std::vector<NodeId> map(in.graph.size(), kNoNode);
  for (size_t i = 0; i < in.graph.size(); ++i) {
    Node n = in.graph.node(static_cast<NodeId>(i));
    for (int k = 0; k < op_arity(n.op); ++k) n.in[k] = map[static_cast<size_t>(n.in[k])];
    map[i] = rewrite(out.graph, n, static_cast<NodeId>(i));
  }
  auto m = [&](NodeId id) { return id == kNoNode ? kNoNode : map[static_cast<size_t>(id)]; };
  out.param_out = m(in.param_out);
  for (NodeId s : in.state_out) out.state_out.push_back(m(s));
  out.skip = m(in.skip);
  for (NodeId u : in.uniform_state_out) out.uniform_state_out.push_back(m(u));
  for (auto& [id, name] : in.names)
    if (m(id) != kNoNode) out.names.emplace(m(id), name);
  return out;
}

}  // namespace optfuse
