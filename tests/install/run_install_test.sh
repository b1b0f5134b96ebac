#!/usr/bin/env bash
# Install check: builds optfuse from this source tree, installs it with `cmake --install` into a
# fresh temporary prefix, then configures, builds and runs examples/find_package (an outside project
# that does find_package(optfuse) and links optfuse::optfuse, plus examples/custom_rule.cpp) against
# that prefix only. Also runs the installed `optfuse` program. Exits non-zero on any failure.
#
#   tests/install/run_install_test.sh            # temporary directories, removed afterwards
#   KEEP=1 tests/install/run_install_test.sh     # keep them (path printed) to look around
#   JOBS=8 ...                                   # parallel build jobs (default: all CPUs)
set -euo pipefail

src=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/optfuse-install-test.XXXXXX")
jobs=${JOBS:-$(nproc 2>/dev/null || echo 2)}
if [[ "${KEEP:-0}" != 1 ]]; then
  trap 'rm -rf "$work"' EXIT
else
  echo "keeping $work"
fi
gen=()
if command -v ninja >/dev/null 2>&1; then gen=(-G Ninja); fi

step() { echo; echo "== $*"; }

step "configure and build optfuse (library and tools, no tests) in $work/build"
cmake -S "$src" -B "$work/build" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DOPTFUSE_BUILD_TESTS=OFF -DOPTFUSE_BUILD_TOOLS=ON >"$work/configure.log" 2>&1 ||
  { cat "$work/configure.log"; exit 1; }
cmake --build "$work/build" -j "$jobs"

step "install into $work/prefix"
cmake --install "$work/build" --prefix "$work/prefix"
for f in include/optfuse/optimizer.h include/optfuse/builtin_rules.h lib/liboptfuse.a \
         lib/cmake/optfuse/optfuse-config.cmake lib/cmake/optfuse/optfuse-config-version.cmake \
         lib/cmake/optfuse/optfuseTargets.cmake bin/optfuse; do
  [[ -e "$work/prefix/$f" ]] || { echo "FAIL: $f was not installed"; exit 1; }
done
# Only the public headers are installed: nothing from src/ may leak into the package.
if find "$work/prefix/include" -name '*.h' | grep -v '/include/optfuse/' | grep -q .; then
  echo "FAIL: headers outside include/optfuse were installed"; exit 1
fi

step "configure examples/find_package against the installed prefix only"
# The build tree's package registry must not be what find_package finds: point it at the prefix
# and forbid the registries.
cmake -S "$src/examples/find_package" -B "$work/example" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF \
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF >"$work/example-configure.log" 2>&1 ||
  { cat "$work/example-configure.log"; exit 1; }
found=$(grep -E '^optfuse_DIR:' "$work/example/CMakeCache.txt" | cut -d= -f2-)
if [[ "$found" != "$work/prefix/lib/cmake/optfuse" ]]; then
  echo "FAIL: find_package(optfuse) found '$found', not the installed package"; exit 1
fi
cmake --build "$work/example" -j "$jobs"

step "run the examples"
# A private cache directory, so the run compiles its kernels rather than reusing another build's.
export OPTFUSE_CACHE_DIR="$work/cache"
"$work/example/optfuse_hello"
"$work/example/optfuse_custom_rule" >"$work/custom_rule.out" || { cat "$work/custom_rule.out"; exit 1; }
grep -E '^(== plan|OK:)' "$work/custom_rule.out"
grep -q 'exp_avg_var_new' "$work/custom_rule.out" || { echo "FAIL: explain output lacks the rule's names"; exit 1; }

step "run the installed optfuse program"
"$work/prefix/bin/optfuse" explain "chain(clip_by_global_norm(1.0), adamw())" | grep 'total bytes per element'
"$work/prefix/bin/optfuse" check "adamw(lr=1e-2)" --steps 3 | tail -1

echo
echo "install test: OK"
