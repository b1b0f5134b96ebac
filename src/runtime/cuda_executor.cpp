// Placeholder: the CUDA executor replaces this file (CUDA backend issue).
#include "optfuse/error.h"
#include "runtime/executor.h"
namespace optfuse {
std::unique_ptr<Executor> make_cuda_executor(const Plan&) { throw BackendUnavailable("CUDA executor not built yet"); }
}
