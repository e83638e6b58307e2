#!/usr/bin/env bash
# Runs Horovod's own test/parallel/test_torch.py against this tree's ringserve.torch, with only
# its import changed (`import horovod.torch as hvd` -> `import ringserve.torch as hvd`), under
# `ringserve run -np N` for each world given. Not part of CI, and it fetches nothing: bring a
# Horovod checkout (git clone https://github.com/horovod/horovod).
#
# usage: scripts/horovod_suite.sh [-k EXPR] [--known] HOROVOD_CHECKOUT [WORLD ...]
#   WORLD ...   the world sizes to run, one after the other (default: 2 3 4)
#   -k EXPR     pytest's -k, e.g. -k "not process_set"
#   --known     also deselect the tests named in docs/guide/torch.md as failing for reasons outside
#               ringserve (torch 2.13's Muon; fp16 compared exactly with an fp32 product at
#               worlds that are not a power of two), so that the count shows everything else
# Environment: PYTHON (default: .venv/bin/python, else python3), LOGS (default:
# /tmp/ringserve-horovod-suite), TEST_TIMEOUT_S (pytest-timeout per test, default 120).
#
# Each world's output is in $LOGS/world$N.log (every line prefixed with its rank); the last
# lines printed are each world's pytest summary as rank 0 saw it.
set -uo pipefail

usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }
KEXPR=""
KNOWN=0
while [ $# -gt 0 ]; do
  case "$1" in
    -k) [ $# -ge 2 ] || usage; KEXPR=$2; shift 2 ;;
    --known) KNOWN=1; shift ;;
    -h|--help) usage ;;
    -*) echo "horovod_suite: unknown flag $1" >&2; usage ;;
    *) break ;;
  esac
done
[ $# -ge 1 ] || usage
HOROVOD=$(cd "$1" && pwd) || { echo "horovod_suite: no directory $1" >&2; exit 2; }
shift
WORLDS=("$@")
[ ${#WORLDS[@]} -gt 0 ] || WORLDS=(2 3 4)
SOURCE="$HOROVOD/test/parallel/test_torch.py"
[ -f "$SOURCE" ] || { echo "horovod_suite: $SOURCE not found (is $HOROVOD a Horovod checkout?)" >&2; exit 2; }

REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -z "${PYTHON:-}" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PYTHON=$REPO/.venv/bin/python; else PYTHON=python3; fi
fi
LOGS=${LOGS:-/tmp/ringserve-horovod-suite}
mkdir -p "$LOGS"
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK/parallel" "$WORK/utils"

# The one change: the import. Anything else differing would show in this count.
sed 's/^import horovod\.torch as hvd$/import ringserve.torch as hvd/' "$SOURCE" > "$WORK/parallel/test_torch.py"
changed=$(diff "$SOURCE" "$WORK/parallel/test_torch.py" | grep -c '^>' || true)
[ "$changed" = 1 ] || { echo "horovod_suite: expected to change exactly one import line, changed $changed" >&2; exit 2; }

# Horovod's test/utils/common.py imports horovod.runner; test_torch.py uses three of its helpers,
# written here afresh from what they do.
cat > "$WORK/utils/common.py" <<'EOF'
import contextlib
import os
import tempfile


def mpi_env_rank_and_size():
    """The rank and size an MPI launcher set (PMI_*, OMPI_COMM_WORLD_*), else (0, 1)."""
    for rank_var, size_var in (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE")):
        if rank_var in os.environ and size_var in os.environ:
            return int(os.environ[rank_var]), int(os.environ[size_var])
    return 0, 1


def skip_or_fail_gpu_test(test, message):
    """Fails when HOROVOD_TEST_GPU=1 asks for GPUs, else skips."""
    if int(os.environ.get("HOROVOD_TEST_GPU", 0)):
        test.fail(message)
    else:
        test.skipTest(message)


@contextlib.contextmanager
def temppath():
    with tempfile.TemporaryDirectory() as d:
        yield os.path.join(d, "temp_test_file")
EOF

known_for() {  # the tests --known deselects at world $1, one name a line
  # torch 2.13's Muon refuses 1-D parameters (the tests build every torch.optim.Optimizer subclass)
  printf '%s\n' test_broadcast_state test_broadcast_state_options test_force_allreduce
  if [ $(( $1 & ($1 - 1) )) -ne 0 ]; then  # not a power of two: n*x is not exact in fp16
    printf '%s\n' test_horovod_allreduce_prescale test_horovod_reducescatter_prescale \
      test_horovod_grouped_reducescatter_prescale
  fi
}

# pytest's --deselect matches node id prefixes (test_broadcast_state would take
# test_broadcast_state_no_grad with it); this hook deselects exact names from $KNOWN_TESTS.
cat > "$WORK/parallel/conftest.py" <<'EOF'
import os


def pytest_collection_modifyitems(config, items):
    path = os.environ.get("KNOWN_TESTS")
    if not path:
        return
    with open(path) as f:
        known = {line.strip() for line in f if line.strip()}
    config.hook.pytest_deselected(items=[item for item in items if item.name in known])
    items[:] = [item for item in items if item.name not in known]
EOF

status=0
summaries=()
for n in "${WORLDS[@]}"; do
  log="$LOGS/world$n.log"
  known=""
  if [ "$KNOWN" = 1 ]; then known="$WORK/known$n.txt"; known_for "$n" > "$known"; fi
  echo "horovod_suite: world $n -> $log"
  (cd "$WORK/parallel" && \
   PYTHONPATH="$REPO:$WORK/utils${PYTHONPATH:+:$PYTHONPATH}" \
   RINGSERVE_COLLECTIVE_TIMEOUT_S=${RINGSERVE_COLLECTIVE_TIMEOUT_S:-30} OMP_NUM_THREADS=1 KNOWN_TESTS="$known" \
   "$PYTHON" -m ringserve.cli run -np "$n" \
     "$PYTHON" -m pytest test_torch.py ${KEXPR:+-k "$KEXPR"} -q -rA -p no:cacheprovider \
       -o addopts="" --timeout "${TEST_TIMEOUT_S:-120}") > "$log" 2>&1
  rc=$?
  [ $rc -eq 0 ] || status=1
  summary=$(grep -E '^\[0\] =* ?[0-9]+ (passed|failed)|^\[0\] =* ?[0-9]+ .* in [0-9.]+s' "$log" | tail -1 | sed 's/^\[0\] //; s/=//g; s/^ *//')
  summaries+=("world $n: ${summary:-no summary from rank 0 (see $log)} (exit $rc)")
done
printf '%s\n' "${summaries[@]}"
exit $status
