// The benchmark workloads: their shapes are part of what a benchmark figure means (docs quote
// "gpt2-small, 148 tensors, 124M elements"), so they are pinned here, together with --scale
// and the host memory the CPU benchmark steps.
#include "testing/workloads.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <string>

#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"

namespace optfuse::testing {
namespace {

TEST(BenchWorkloads, Gpt2SmallShapes) {
  Workload w = make_workload("gpt2-small");
  EXPECT_EQ(w.name, "gpt2-small");
  EXPECT_EQ(w.tensors.size(), 148u);
  EXPECT_EQ(w.total_elements(), 124439808);
  EXPECT_EQ(w.tensors[0].numel, 50257 * 768);  // wte
  EXPECT_EQ(w.tensors[1].numel, 1024 * 768);   // wpe
  EXPECT_EQ(w.tensors[4].numel, 768 * 2304);   // h.0.attn.c_attn.weight
  EXPECT_EQ(w.tensors.back().numel, 768);      // ln_f.bias
}

TEST(BenchWorkloads, Llama1bShapes) {
  Workload w = make_workload("llama-1b");
  EXPECT_EQ(w.tensors.size(), 147u);
  EXPECT_EQ(w.total_elements(), 1498482688);  // "1.50B"
  EXPECT_EQ(w.tensors.front().numel, int64_t{128256} * 2048);  // embedding
  EXPECT_EQ(w.tensors.back().numel, int64_t{128256} * 2048);   // untied head
  EXPECT_EQ(w.tensors[3].numel, 512 * 2048);                   // layers.0.self_attn.k_proj
  EXPECT_EQ(w.tensors[7].numel, 8192 * 2048);                  // layers.0.mlp.gate_proj
}

TEST(BenchWorkloads, SyntheticShapes) {
  Workload many = make_workload("many-small");
  ASSERT_EQ(many.tensors.size(), 2000u);
  for (const NamedTensor& t : many.tensors) EXPECT_EQ(t.numel, 4096);
  EXPECT_EQ(many.total_elements(), 2000 * 4096);

  Workload big = make_workload("one-big");
  ASSERT_EQ(big.tensors.size(), 1u);
  EXPECT_EQ(big.total_elements(), 268435456);

  Workload cpu = make_workload("cpu-default");
  ASSERT_EQ(cpu.tensors.size(), 1u);
  EXPECT_EQ(cpu.total_elements(), 64 * 1024 * 1024);
}

TEST(BenchWorkloads, EveryListedNameIsKnownAndSpecsMatch) {
  for (const std::string& name : workload_names()) {
    Workload w = make_workload(name);
    EXPECT_EQ(w.name, name);
    std::vector<TensorSpec> specs = w.specs(1);
    ASSERT_EQ(specs.size(), w.tensors.size()) << name;
    for (size_t i = 0; i < specs.size(); ++i) {
      EXPECT_EQ(specs[i].numel, w.tensors[i].numel) << name;
      EXPECT_EQ(specs[i].group, 1) << name;
      EXPECT_FALSE(w.tensors[i].name.empty()) << name;
    }
  }
}

TEST(BenchWorkloads, ScaleMultipliesEveryTensorAndKeepsAtLeastOneElement) {
  Workload full = make_workload("gpt2-small"), tenth = make_workload("gpt2-small", 0.1);
  ASSERT_EQ(tenth.tensors.size(), full.tensors.size());
  EXPECT_DOUBLE_EQ(tenth.scale, 0.1);
  for (size_t i = 0; i < full.tensors.size(); ++i)  // truncated, as bench/workload_shapes.py does
    EXPECT_EQ(tenth.tensors[i].numel, static_cast<int64_t>(static_cast<double>(full.tensors[i].numel) * 0.1));

  // 768 * 1e-6 < 1: every tensor still has one element, so tensor counts never change with scale.
  Workload tiny = make_workload("gpt2-small", 1e-6);
  ASSERT_EQ(tiny.tensors.size(), 148u);
  for (const NamedTensor& t : tiny.tensors) EXPECT_GE(t.numel, 1);
  EXPECT_EQ(tiny.tensors[2].numel, 1);  // h.0.ln_1.weight: 768 elements

  Workload bigger = make_workload("many-small", 2.0);
  EXPECT_EQ(bigger.total_elements(), 2000 * 8192);
}

TEST(BenchWorkloads, UnknownNameListsTheKnownOnes) {
  try {
    make_workload("gpt3");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    std::string msg = e.what();
    EXPECT_NE(msg.find("unknown workload 'gpt3'"), std::string::npos) << msg;
    for (const std::string& name : workload_names()) EXPECT_NE(msg.find(name), std::string::npos) << msg;
  }
}

TEST(BenchWorkloads, BadScaleIsAnError) {
  for (double s : {0.0, -1.0, std::nan(""), static_cast<double>(INFINITY)}) EXPECT_THROW(make_workload("one-big", s), Error) << s;
}

TEST(BenchWorkloads, BytesPerElementFollowsThePlan) {
  EXPECT_EQ(plan_bytes_per_element(make_plan(adamw()), DType::f32), 28);  // 4 reads + 3 writes
  EXPECT_EQ(plan_bytes_per_element(make_plan(adamw()), DType::bf16), 14);
  // clip_by_global_norm adds a reduce pass that reads the gradients once more.
  EXPECT_EQ(plan_bytes_per_element(make_plan(parse_chain("chain(clip_by_global_norm(1.0), adamw())")), DType::f32),
            32);
}

TEST(BenchWorkloads, HostMemoryIsAlignedRandomAndInitialised) {
  Plan plan = make_plan(adamw());
  Workload w = make_workload("gpt2-small", 0.001);
  for (DType d : {DType::f32, DType::bf16}) {
    HostWorkloadMemory mem(plan, w, d, 3);
    std::vector<TensorRef> refs = mem.refs();
    ASSERT_EQ(refs.size(), w.tensors.size());
    for (size_t t = 0; t < refs.size(); ++t) {
      const TensorRef& r = refs[t];
      ASSERT_EQ(r.states.size(), 2u);
      EXPECT_EQ(r.param.numel, w.tensors[t].numel);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(r.param.data) % 64, 0u);
      EXPECT_EQ(reinterpret_cast<uintptr_t>(r.states[1].data) % 64, 0u);
      for (int64_t i = 0; i < r.param.numel; ++i) {
        double p = load_element(r.param.data, d, i), g = load_element(r.grad.data, d, i);
        // Uniform in (-1, 1) and never zero (bfloat16 rounding may land on +-1).
        ASSERT_TRUE(std::fabs(p) <= 1.0 && p != 0.0) << p << " " << dtype_name(d) << " tensor " << t << " element " << i;
        ASSERT_TRUE(std::fabs(g) <= 1.0 && g != 0.0) << g << " " << dtype_name(d) << " tensor " << t << " element " << i;
        if (d == DType::f32) ASSERT_TRUE(std::fabs(p) < 1.0 && std::fabs(g) < 1.0);
        ASSERT_EQ(load_element(r.states[0].data, d, i), 0.0);  // adamw's states start at 0
      }
    }
    // Parameters and gradients are different random streams.
    EXPECT_NE(load_element(refs[0].param.data, d, 0), load_element(refs[0].grad.data, d, 0));
  }
}

}  // namespace
}  // namespace optfuse::testing
