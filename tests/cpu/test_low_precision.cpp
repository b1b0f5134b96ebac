// Mixed precision on the host backends: a dtype per role, master weights (a float32 copy, or
// bfloat16 + int16 remainders), Kahan compensation and stochastic rounding, against the float64
// reference evaluator and against the properties each promises:
//   - the CPU backend matches the reference within 2 ulps of each role's storage type at the scale
//     (the same bound as test_cpu_backend.cpp: both round every stored value once per step; where
//     float32 and float64 land on either side of a rounding point they differ by one ulp, carried on);
//   - stochastic rounding is unbiased (mean within 3 standard errors) and its random bits depend
//     only on (tensor key, element, step, role): equal on both backends where the stored values are
//     exact in float32, run to run, and for a tensor cut into shards;
//   - remainders rebuild the float32 master bit for bit; a master copy equals a float32 run;
//   - Kahan compensation keeps updates far below one ulp that plain bfloat16 rounds away.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "codegen/abi.h"
#include "ir/low_precision.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/optimizer.h"
#include "testing/precision_cases.h"
#include "testing/tensor_set.h"
#include "testing/error_of.h"

namespace optfuse {
namespace {

using testing::HostTensorSet;
using testing::TensorSpec;

const std::vector<TensorSpec> kSizes = {{1, 0}, {3, 1}, {1023, 0}, {20000, 1}};

float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Runs `steps` steps (new gradients each step) on a copy of `set`.
HostTensorSet run(const Chain& c, const Precision& prec, const HostTensorSet& set, Backend b, int steps,
                  uint64_t seed = 7) {
  return testing::run_steps(c, prec, set, b, steps, seed);
}

TEST(LowPrecision, CpuMatchesReferenceForEveryOptionAndDtype) {
  for (const char* spec : {"adamw(lr=0.01, weight_decay=0.1)", "chain(clip_by_global_norm(1.0), sgd(lr=0.05, momentum=0.9))"})
    for (const testing::PrecisionCase& c : testing::precision_cases()) {
      SCOPED_TRACE(std::string(spec) + " / " + c.name);
      Chain chain = parse_chain(spec);
      Plan plan = make_plan(chain, c.prec);
      HostTensorSet set(plan, kSizes, testing::role_storage(plan, c.param, c.grad, c.states, c.stochastic), 3);
      HostTensorSet ref = run(chain, c.prec, set, Backend::reference, 6);
      HostTensorSet cpu = run(chain, c.prec, set, Backend::cpu, 6);
      // (stochastically rounded states one ulp apart move a float32 master by lr x 2^-8 of its update)
      EXPECT_EQ(testing::compare_to_reference(plan, cpu, ref, c.stochastic ? 1e-4 : 1e-5), "");
    }
}

// ---- stochastic rounding --------------------------------------------------------------------

TEST(LowPrecision, StochasticRoundingIsUnbiased) {
  const int n = 40000;
  for (float x : {1.0f + 0x1.0p-12f, -3.0f - 0x1.8p-10f, 1e-3f + 1e-7f, 0.1f, -7.3e-6f}) {  // none exact in either type
    for (DType d : {DType::bf16, DType::f16}) {
      double sum = 0, sum_sq = 0;
      const uint64_t base = lowp::rng_base(42, 1);
      for (int e = 0; e < n; ++e) {
        uint32_t r = lowp::rng_bits(base, static_cast<uint64_t>(e), 0);
        double y = d == DType::bf16 ? bf16_bits_to_float(lowp::float_to_bf16_sr(x, r))
                                    : f16_bits_to_float(lowp::float_to_f16_sr(x, r));
        sum += y;
        sum_sq += y * y;
      }
      const double mean = sum / n, var = std::max(sum_sq / n - mean * mean, 0.0);
      const double se = std::sqrt(var / n);
      EXPECT_GT(var, 0.0) << x << " " << dtype_name(d) << ": both neighbours must occur";
      EXPECT_LE(std::fabs(mean - x), 3 * se + 1e-12 * std::fabs(x)) << x << " " << dtype_name(d) << " mean " << mean;
    }
  }
}

TEST(LowPrecision, StochasticRoundingKeepsExactAndSpecialValues) {
  for (uint32_t r : {0u, 0x7fffu, 0xffffffffu, 0x12345678u}) {
    EXPECT_EQ(lowp::float_to_bf16_sr(1.5f, r), float_to_bf16_bits(1.5f));
    EXPECT_EQ(lowp::float_to_f16_sr(1.5f, r), float_to_f16_bits(1.5f));
    EXPECT_EQ(lowp::float_to_bf16_sr(INFINITY, r), float_to_bf16_bits(INFINITY));
    EXPECT_EQ(lowp::float_to_f16_sr(-INFINITY, r), float_to_f16_bits(-INFINITY));
    EXPECT_TRUE(std::isnan(bf16_bits_to_float(lowp::float_to_bf16_sr(NAN, r))));
    EXPECT_TRUE(std::isnan(f16_bits_to_float(lowp::float_to_f16_sr(NAN, r))));
    EXPECT_EQ(lowp::float_to_f16_sr(1e6f, r), float_to_f16_bits(1e6f));  // beyond float16: nearest (inf)
  }
  // Always one of the two neighbours.
  const float x = 1.0f + 0x1.0p-9f;
  for (uint32_t r = 0; r < 70000; r += 97) {
    float y = bf16_bits_to_float(lowp::float_to_bf16_sr(x, r));
    EXPECT_TRUE(y == 1.0f || y == 1.0f + 0x1.0p-7f) << y;
  }
}

// A chain whose float32 and float64 results are the same number (power-of-two lr, short
// mantissas): the stochastic stores of both backends see the same value and the same bits.
TEST(LowPrecision, StochasticStoresAreBitwiseEqualOnBothBackendsAndRunToRun) {
  Chain c = sgd({{"lr", 0x1.0p-12}});
  Plan plan = make_plan(c);
  for (DType d : {DType::bf16, DType::f16}) {
    HostTensorSet set(plan, kSizes, testing::role_storage(plan, d, d, d, true), 5);
    HostTensorSet a = run(c, {}, set, Backend::cpu, 4), b = run(c, {}, set, Backend::cpu, 4);
    HostTensorSet ref = run(c, {}, set, Backend::reference, 4);
    size_t moved = 0, total = 0;
    for (size_t t = 0; t < set.size(); ++t) {
      EXPECT_EQ(a.bytes(t, 0), b.bytes(t, 0)) << "run to run, tensor " << t;
      EXPECT_EQ(a.bytes(t, 0), ref.bytes(t, 0)) << "cpu vs reference, tensor " << t << " " << dtype_name(d);
      for (int64_t i = 0; i < set.specs()[t].numel; ++i, ++total) moved += a.value(t, 0, i) != set.value(t, 0, i);
    }
    // Updates of about 2^-12 of values near 1 are below half an ulp of both types: nearest rounding
    // would move nothing; stochastic rounding moves some.
    EXPECT_GT(moved, total / 100) << dtype_name(d);
  }
}

TEST(LowPrecision, StochasticStreamIsTheSameForShardsOfATensor) {
  Chain c = adamw({{"lr", 1e-3}});
  Plan plan = make_plan(c);
  const int64_t n = 5000, cut = 1234;
  HostTensorSet whole(plan, {{n, 0}}, testing::role_storage(plan, DType::bf16, DType::bf16, DType::bf16, true), 11);
  const HostTensorSet start = whole;
  HostTensorSet sharded = whole;
  Optimizer a(c, Backend::cpu), b(c, Backend::cpu);
  a.set_tensors(whole.refs());
  // The same memory as two tensors: [0, cut) and [cut, n), the second with rng_offset = cut.
  TensorRef full = sharded.refs()[0], lo = full, hi = full;
  auto slice = [](Buffer& buf, int64_t first, int64_t count) {
    buf.data = static_cast<char*>(buf.data) + first * static_cast<int64_t>(dtype_size(buf.dtype));
    buf.numel = count;
  };
  for (Buffer* x : {&lo.param, &lo.grad, &lo.states[0], &lo.states[1]}) slice(*x, 0, cut);
  for (Buffer* x : {&hi.param, &hi.grad, &hi.states[0], &hi.states[1]}) slice(*x, cut, n - cut);
  hi.rng_offset = cut;
  b.set_tensors({lo, hi});
  for (int k = 0; k < 3; ++k) {
    a.step();
    b.step();
  }
  for (size_t r = 0; r < whole.num_roles(); ++r) EXPECT_EQ(whole.bytes(0, r), sharded.bytes(0, r)) << "role " << r;
  // A different key is a different stream.
  HostTensorSet same = start, other = start;
  std::vector<TensorRef> refs = other.refs();
  refs[0].rng_key += 1;
  Optimizer o1(c, Backend::cpu), o2(c, Backend::cpu);
  o1.set_tensors(same.refs());
  o2.set_tensors(refs);
  o1.step();
  o2.step();
  EXPECT_NE(same.bytes(0, 2), other.bytes(0, 2));
}

// ---- master weights -----------------------------------------------------------------------

TEST(LowPrecision, RemaindersRebuildTheMasterBitForBit) {
  std::mt19937 rng(1);
  for (int k = 0; k < 200000; ++k) {
    float m = bits_to_float(rng());
    if (std::isnan(m)) continue;
    float p = lowp::param_of_master(m), r = lowp::remainder_of_master(m);
    ASSERT_EQ(float_bits(lowp::master_from_remainder(p, r)), float_bits(m)) << m;
    ASSERT_EQ(float_bits(p) & 0xffffu, 0u);                 // a bfloat16 value
    ASSERT_TRUE(r >= -32768.0f && r <= 32767.0f && r == std::floor(r));
    if (std::isfinite(p))  // nearest: within half a bfloat16 ulp of the master (2^-134 among subnormals)
      ASSERT_LE(std::fabs(static_cast<double>(p) - m), std::max(std::ldexp(std::fabs(static_cast<double>(m)), -8), std::ldexp(1.0, -134)));
  }
}

// A bfloat16 model stepping with lr = 1e-5: the master copy is the float32 run, the parameter is
// always the master rounded to nearest; remainders hold the same master; plain bfloat16 stalls.
TEST(LowPrecision, MasterWeightsFollowTheFloat32Run) {
  Chain c = adamw({{"lr", 1e-5}, {"weight_decay", 0.0}});
  Precision copy, rem;
  copy.master = MasterWeights::copy;
  rem.master = MasterWeights::remainders;
  Plan plain_plan = make_plan(c), copy_plan = make_plan(c, copy), rem_plan = make_plan(c, rem);
  // Same starting values: bfloat16 parameters and gradients (exact in float32 too).
  HostTensorSet fp32(plain_plan, kSizes, testing::role_storage(plain_plan, DType::f32, DType::f32, DType::f32), 9);
  HostTensorSet bf(plain_plan, kSizes, testing::role_storage(plain_plan, DType::bf16, DType::bf16, DType::f32), 9);
  HostTensorSet mc(copy_plan, kSizes, testing::role_storage(copy_plan, DType::bf16, DType::bf16, DType::f32), 9);
  HostTensorSet mr(rem_plan, kSizes, testing::role_storage(rem_plan, DType::bf16, DType::bf16, DType::f32), 9);
  for (size_t t = 0; t < fp32.size(); ++t)
    for (int64_t i = 0; i < fp32.specs()[t].numel; ++i) store_element(fp32.bytes(t, 0).data(), DType::f32, i, bf.value(t, 0, i));
  const int steps = 10;
  auto go = [&](const Precision& p, HostTensorSet& s) {
    Optimizer opt(c, Backend::cpu, 2, p);
    opt.set_tensors(s.refs());
    for (int k = 0; k < steps; ++k) {
      s.randomize_grads(100 + static_cast<uint64_t>(k));  // bfloat16 gradients...
      if (s.dtype(1) == DType::f32)                       // ...and the same values in float32
        for (size_t t = 0; t < s.size(); ++t)
          for (int64_t i = 0; i < s.specs()[t].numel; ++i)
            store_element(s.bytes(t, 1).data(), DType::f32, i, bf16_bits_to_float(float_to_bf16_bits(static_cast<float>(s.value(t, 1, i)))));
      opt.step();
    }
  };
  go({}, fp32);
  go({}, bf);
  go(copy, mc);
  go(rem, mr);
  const size_t master = mc.num_roles() - 1, remainder = mr.num_roles() - 1;
  size_t moved_fp32 = 0, moved_bf16 = 0, total = 0;
  HostTensorSet start(plain_plan, kSizes, testing::role_storage(plain_plan, DType::bf16, DType::bf16, DType::f32), 9);
  for (size_t t = 0; t < fp32.size(); ++t)
    for (int64_t i = 0; i < fp32.specs()[t].numel; ++i, ++total) {
      const double want = fp32.value(t, 0, i), m = mc.value(t, master, i);
      ASSERT_LE(std::fabs(m - want), 1e-6 * std::fabs(want)) << "tensor " << t << " element " << i;
      ASSERT_EQ(float_to_bf16_bits(static_cast<float>(m)), float_to_bf16_bits(static_cast<float>(mc.value(t, 0, i))))
          << "the parameter is the master rounded to nearest";
      const float rebuilt = lowp::master_from_remainder(static_cast<float>(mr.value(t, 0, i)), static_cast<float>(mr.value(t, remainder, i)));
      ASSERT_EQ(float_bits(rebuilt), float_bits(static_cast<float>(m))) << "remainders hold the master copy's value";
      moved_fp32 += want != start.value(t, 0, i);
      moved_bf16 += bf.value(t, 0, i) != start.value(t, 0, i);
    }
  EXPECT_GT(moved_fp32, total * 9 / 10);
  EXPECT_LT(moved_bf16, total / 10) << "plain bfloat16 rounds 1e-5 updates away";
}

TEST(LowPrecision, KahanKeepsUpdatesBelowOneUlp) {
  Chain c = sgd({{"lr", 1e-4}});
  Precision kahan;
  kahan.kahan = true;
  Plan plain = make_plan(c), kp = make_plan(c, kahan);
  HostTensorSet fp32(plain, {{4096, 0}}, testing::role_storage(plain, DType::f32, DType::f32, DType::f32), 2);
  HostTensorSet bf(plain, {{4096, 0}}, testing::role_storage(plain, DType::bf16, DType::f32, DType::f32), 2);
  HostTensorSet kb(kp, {{4096, 0}}, testing::role_storage(kp, DType::bf16, DType::f32, DType::f32), 2);
  for (int64_t i = 0; i < 4096; ++i) store_element(fp32.bytes(0, 0).data(), DType::f32, i, bf.value(0, 0, i));
  Optimizer a(c, Backend::cpu), b(c, Backend::cpu), k(c, Backend::cpu, 1, kahan);
  a.set_tensors(fp32.refs());
  b.set_tensors(bf.refs());
  k.set_tensors(kb.refs());
  for (int s = 0; s < 200; ++s) {  // the same gradient every step: a steady drift of 1e-4 per step
    for (HostTensorSet* x : {&fp32, &bf, &kb})
      for (int64_t i = 0; i < 4096; ++i) store_element(x->bytes(0, 1).data(), DType::f32, i, std::sin(0.37 * static_cast<double>(i)));
    a.step();
    b.step();
    k.step();
  }
  double err_plain = 0, err_kahan = 0;
  for (int64_t i = 0; i < 4096; ++i) {
    const double want = fp32.value(0, 0, i), ulp = std::ldexp(1.0, std::ilogb(std::fabs(want)) - 7);
    err_plain = std::max(err_plain, std::fabs(bf.value(0, 0, i) - want) / ulp);
    err_kahan = std::max(err_kahan, std::fabs(kb.value(0, 0, i) - want) / ulp);
  }
  EXPECT_LE(err_kahan, 1.0) << "Kahan-compensated bfloat16 stays within one ulp of the float32 run";
  EXPECT_GE(err_plain, 3.0) << "plain bfloat16 drifts away (updates below half an ulp are lost)";
}

// explain's byte count: precision states at their fixed size. bfloat16 storage with a float32
// master: reads grad 2 + master 4 + exp_avg 2 + exp_avg_sq 2, writes param 2 + the same three.
TEST(LowPrecision, DescribeCountsFixedDtypeStatesAtTheirSize) {
  Precision copy, rem;
  copy.master = MasterWeights::copy;
  rem.master = MasterWeights::remainders;
  EXPECT_NE(make_plan(adamw(), copy).describe(DType::bf16).find("total bytes per element: 20\n"), std::string::npos);
  // remainders: param 2 + remainder 2 + grad 2 + states 2 + 2 read; param, remainder, states written
  EXPECT_NE(make_plan(adamw(), rem).describe(DType::bf16).find("total bytes per element: 18\n"), std::string::npos);
  EXPECT_NE(make_plan(adamw()).describe(DType::f32).find("total bytes per element: 28\n"), std::string::npos);
}

// ---- errors ---------------------------------------------------------------------------------

using testing::error_of;

TEST(LowPrecision, BadCombinationsAreClearErrors) {
  Chain c = adamw();
  Precision copy, rem, kahan, both;
  copy.master = MasterWeights::copy;
  rem.master = MasterWeights::remainders;
  kahan.kahan = true;
  both.master = MasterWeights::copy;
  both.kahan = true;
  EXPECT_EQ(error_of([&] { make_plan(c, both); }),
            "kahan compensates the rounding of parameters stored without a master copy; with master weights (copy) "
            "nothing is rounded away: choose one");
  auto set_error = [&](const Precision& p, DType param, DType states) {
    Plan plan = make_plan(c, p);
    HostTensorSet s(plan, {{4, 0}}, testing::role_storage(plan, param, param, states), 1);
    Optimizer o(c, Backend::cpu, 1, p);
    return error_of([&] { o.set_tensors(s.refs()); });
  };
  EXPECT_EQ(set_error(copy, DType::f32, DType::f32),
            "tensor 0: master weights keep a float32 copy of float16/bfloat16 parameters; this parameter is float32 "
            "(step it without master weights)");
  EXPECT_EQ(set_error(rem, DType::f16, DType::f32),
            "tensor 0: master-weight remainders rebuild a float32 master from a bfloat16 parameter; this parameter is "
            "float16");
  EXPECT_EQ(set_error(kahan, DType::f16, DType::f16),
            "tensor 0: the chain's kahan compensation is for bfloat16 parameters; this parameter is float16");
  {  // a master state of the wrong dtype
    Plan plan = make_plan(c, copy);
    StorageVariant v = testing::role_storage(plan, DType::bf16, DType::bf16, DType::f32);
    v.back().dtype = DType::bf16;
    HostTensorSet s(plan, {{4, 0}}, v, 1);
    Optimizer o(c, Backend::cpu, 1, copy);
    EXPECT_EQ(error_of([&] { o.set_tensors(s.refs()); }),
              "tensor 0: state master_weights.master_param must be float32, got bfloat16");
  }
}

}  // namespace
}  // namespace optfuse
