// Lowers a plan's phases into the step schedule (include/optfuse/schedule.h).
#include "optfuse/schedule.h"

#include <sstream>

#include "optfuse/plan.h"

namespace optfuse {

std::vector<ScheduleStep> make_schedule(const Plan& plan) {
  using K = ScheduleStep::Kind;
  std::vector<ScheduleStep> s;
  for (size_t i = 0; i < plan.phases.size(); ++i) {
    const int p = static_cast<int>(i);
    s.push_back({K::Scalar, p});
    if (plan.matrix()) s.push_back({K::Values, p});
    s.push_back({K::Pass, p});
    if (plan.phases[i].kind == ElementPhase::Kind::Reduce) {
      s.push_back({K::Exchange, p});
      s.push_back({K::Combine, p});
    } else if (plan.matrix()) {
      s.push_back({K::Commit, p});
    }
  }
  return s;
}

std::string describe_schedule(const Plan& plan) {
  std::ostringstream o;
  const Graph& g = plan.program.graph;
  for (const ScheduleStep& st : plan.schedule) {
    const ElementPhase& ph = plan.phases[static_cast<size_t>(st.phase)];
    switch (st.kind) {
      case ScheduleStep::Kind::Scalar:
        o << "scalar " << st.phase << ": uniform values per group for pass " << st.phase
          << (ph.kind == ElementPhase::Kind::Update
                  ? (plan.program.uniform_states.empty() ? "; decide skip, commit the step count"
                                                          : "; decide skip, commit the step count and uniform states")
                  : "")
          << "\n";
        break;
      case ScheduleStep::Kind::Pass:
        o << "pass " << st.phase << ": " << (ph.kind == ElementPhase::Kind::Reduce ? "reduce" : "update") << ", "
          << ph.reads() << " element(s) read + " << ph.writes() << " written per parameter element\n";
        break;
      case ScheduleStep::Kind::Exchange:
        o << "exchange " << st.phase << ": hook point (a sharded step gathers every rank's partial sums here)\n";
        break;
      case ScheduleStep::Kind::Combine: {
        o << "combine " << st.phase << ":";
        for (NodeId r : ph.reductions) {
          const Node& n = g.node(r);
          o << " " << op_name(n.op) << "/" << scope_name(reduction_scope(n));
        }
        o << " in chunk order\n";
        break;
      }
      case ScheduleStep::Kind::Values:
        o << "values " << st.phase << ": " << plan.layout.row_values << " row and " << plan.layout.col_values
          << " column value(s) per row / column for pass " << st.phase << ", and their per-tensor sums\n";
        break;
      case ScheduleStep::Kind::Commit:
        o << "commit " << st.phase << ": row and column states take their new values (groups not skipped)\n";
        break;
    }
  }
  return o.str();
}

}  // namespace optfuse
