// Placeholder: replaced by the bench command (CPU backend issue).
#include "commands.h"
#include "optfuse/error.h"
namespace optfuse::cli {
int bench_command(const Argv&) { throw Error("bench: not built yet"); }
}
