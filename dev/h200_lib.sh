# The start every dev/h200_*.sh script shares (sourced after `set -uo pipefail` and after setting
# $parts to the parts asked for): the repository root as working directory, $out ($OUT, default
# out/), the compile caches in .devcache, unbuffered Python, and
#   has PART          whether PART is one of $parts
#   build_and_cxx     the parts build and cxx of dev/h200_training_loop.sh, where asked for (its logs in $out)
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-out}
mkdir -p "$out"
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$PWD/.devcache} PYTHONUNBUFFERED=1
has() { [[ " $parts " == *" $1 "* ]]; }
build_and_cxx() {
  local asked=""
  has build && asked="build"
  has cxx && asked="$asked cxx"
  [ -z "$asked" ] || OUT="$out" dev/h200_training_loop.sh $asked
}
