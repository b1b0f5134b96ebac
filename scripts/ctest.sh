#!/usr/bin/env bash
# ctest with the reasons of skipped tests: runs `ctest ARGS...` and then, since ctest itself prints
# only "***Skipped" for a GoogleTest that called GTEST_SKIP() (gtest_discover_tests marks the test
# skipped when its output has "[  SKIPPED ]"), prints each skipped test with the message it gave,
# read from the run's log (<test dir>/Testing/Temporary/LastTest.log). Exit status: ctest's.
#
#   scripts/ctest.sh --test-dir build --output-on-failure -j2
set -uo pipefail
dir=.
args=("$@")
for ((i = 0; i < ${#args[@]}; ++i)); do
  case "${args[i]}" in
    --test-dir) dir="${args[i + 1]:-.}" ;;
    --test-dir=*) dir="${args[i]#--test-dir=}" ;;
  esac
done
ctest "$@"
rc=$?
log="$dir/Testing/Temporary/LastTest.log"
[[ -f "$log" ]] || exit "$rc"
# A test's block in the log: "N/M Test: NAME", its output up to "<end of output>", and for a skipped
# test "Skip regular expression found in output". GoogleTest prints a skip as "FILE:LINE: Skipped",
# the message's lines, then "[  SKIPPED ] NAME".
awk '
  /^[0-9]+\/[0-9]+ Test: / { name = $0; sub(/^[0-9]+\/[0-9]+ Test: /, "", name); reason = ""; in_msg = 0; next }
  /^\[  SKIPPED \]/ { in_msg = 0; next }
  in_msg && NF { reason = reason (reason == "" ? "" : " ") $0; next }
  /: Skipped$/ { in_msg = 1; next }
  /^Skip regular expression found in output/ {
    r = reason == "" ? "(no reason printed)" : reason
    if (!(r in count)) order[++reasons] = r
    names[r] = names[r] (count[r]++ ? ", " : "") name
    n++
  }
  END {
    if (n == 0) exit
    printf "ctest: %d test(s) skipped; the reasons, each with the tests that gave it:\n", n
    for (i = 1; i <= reasons; ++i) {
      r = order[i]
      printf "  %d: %s\n", count[r], r
      line = "     "
      k = split(names[r], parts, ", ")
      for (j = 1; j <= k; ++j) {
        item = parts[j] (j < k ? "," : "")
        if (length(line) + length(item) > 110) { print line; line = "     " }
        line = line " " item
      }
      print line
    }
  }
' "$log"
exit "$rc"
