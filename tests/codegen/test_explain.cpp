// What `optfuse explain` prints (codegen/explain.*): the chain, passes, IR and plan (bytes per
// element, step schedule) by default; the generated source only when asked for, and alone with
// explain_source (`--source-only`), byte for byte the generator's text.
#include <gtest/gtest.h>

#include <string>

#include "codegen/cpu_source.h"
#include "codegen/cuda_source.h"
#include "codegen/explain.h"
#include "optfuse/builtin_rules.h"
#include "optfuse/error.h"
#include "optfuse/plan.h"

namespace optfuse {
namespace {

const char* kSpec = "chain(clip_by_global_norm(1.0), adamw(lr=1e-3, weight_decay=0.01))";

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

TEST(Explain, DefaultTextIsThePlanWithoutTheSource) {
  const std::string text = explain_text(parse_chain(kSpec), "cpu", false);
  for (const char* part : {"== chain\n", "== passes\n", "== IR after passes\n", "== plan\n", "total bytes per element: 32\n",
                           "  schedule:\n", "combine 0: sum_squares/global in chunk order"})
    EXPECT_TRUE(contains(text, part)) << "missing '" << part << "' in\n" << text;
  EXPECT_FALSE(contains(text, "== generated")) << text;
  EXPECT_FALSE(contains(text, "OF_ROLES")) << "source text leaked into the default output";
}

TEST(Explain, SourceIsAppendedWhenAskedFor) {
  const Chain chain = parse_chain(kSpec);
  const std::string src = generate_cpu_source(make_plan(chain));
  const std::string plain = explain_text(chain, "cpu", false), with = explain_text(chain, "cpu", true);
  EXPECT_EQ(with, plain + "\n== generated cpu source\n" + src);
  EXPECT_EQ(explain_text(chain, "cuda", true), plain + "\n== generated cuda source\n" + generate_cuda_source(make_plan(chain)));
}

TEST(Explain, SourceOnlyIsTheGeneratedSourceAlone) {
  const Chain chain = parse_chain(kSpec);
  EXPECT_EQ(explain_source(chain, "cpu"), generate_cpu_source(make_plan(chain)));
  EXPECT_EQ(explain_source(chain, "cuda"), generate_cuda_source(make_plan(chain)));
  EXPECT_THROW(explain_source(chain, "metal"), Error);
}

TEST(Explain, SourceOnlyOfAMatrixChainNamesBothParts) {
  const std::string src = explain_source(make_builtin("muon"), "cpu");
  const size_t one = src.find("// ######## part 1 of 2"), two = src.find("// ######## part 2 of 2");
  ASSERT_NE(one, std::string::npos) << src;
  ASSERT_NE(two, std::string::npos) << src;
  EXPECT_EQ(one, 0u);
  EXPECT_LT(one, two);
  // Every line is C++ or a comment: nothing of the plan's text.
  EXPECT_FALSE(contains(src, "== plan")) << src;
}

}  // namespace
}  // namespace optfuse
