// optfuse: optimizer update rules written as math, generated into fused kernels.
// The umbrella header of the public C++ API.
#pragma once
#include "optfuse/builtin_rules.h"
#include "optfuse/dtype.h"
#include "optfuse/error.h"
#include "optfuse/ir.h"
#include "optfuse/matrix_chain.h"
#include "optfuse/newton_schulz.h"
#include "optfuse/optimizer.h"
#include "optfuse/plan.h"
#include "optfuse/rule.h"
