#!/usr/bin/env bash
# The compose demo on a real Docker engine, end to end: build the image, then train the elastic digits
# demo (examples/train_digits_elastic.py) with docker-compose and check every run from the
# containers' own output and exit codes:
#
#   scale 2, 4, 8   every worker exits 0 and prints the same parameter hash, in a world of N; a call
#                   without the job's token (the coordinator made it, secure by default) is refused
#   grow and stop   4 train; `up --scale worker=6` adds 2 at a commit; `docker stop` of one makes it
#                   leave at its next commit (exit 0); the other 5 finish with identical parameters
#   kill            4 train; `docker kill` of one (exit 137); the other 3 go on from their last
#                   commit and finish with identical parameters
#   ps              the parameter-server demo (examples/train_digits_ps.py, ssp mode):
#                   `--profile ps up --scale worker=4 --scale ps=2`; shard 1's process is killed
#                   (SIGKILL) mid-run, its restart policy brings it back, it resumes from its
#                   checkpoint; every worker exits 0 and prints its test accuracy
#
# Then `down`. Exits non-zero if any check fails; prints what each step took.
#
#   sudo bash scripts/compose_e2e.sh                 # from the repository root, or from anywhere
#   KEEP_ENGINE=1 bash scripts/compose_e2e.sh        # leave the engine running afterwards
#   SCENARIOS="scale:2 kill" bash scripts/compose_e2e.sh
#
# The engine is ../shared/tools/docker-engine, found beside the repository root or above it
# (RINGSERVE_DOCKER_ENGINE overrides). An engine this script had to start is stopped at the end
# (`docker-engine down`) unless KEEP_ENGINE=1. Needs root. Not part of the default test run: about
# 9-10 minutes on 2 busy cores (about 2 of them the image build, 4 more the first time). Every change that
# touches deployment (Dockerfile, docker-compose.yml, the examples it runs, config defaults,
# advertising, the elastic loop) runs it first.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
find_engine() {
  local d=$ROOT
  while [ "$d" != / ]; do
    d=$(dirname "$d")
    if [ -x "$d/shared/tools/docker-engine" ]; then echo "$d/shared/tools/docker-engine"; return; fi
  done
  return 1
}
ENGINE=${RINGSERVE_DOCKER_ENGINE:-$(find_engine || true)}
[ -n "$ENGINE" ] && [ -x "$ENGINE" ] || { echo "compose_e2e: no ../shared/tools/docker-engine above $ROOT" >&2; exit 2; }

PROJECT=${COMPOSE_PROJECT:-ringserve-e2e}
SCENARIOS=${SCENARIOS:-"scale:2 scale:4 scale:8 grow-stop kill ps"}
EPOCHS=${E2E_EPOCHS:-10}              # plain runs
LONG_EPOCHS=${E2E_LONG_EPOCHS:-200}   # runs changed mid-way: long enough for containers to start and join
PS_EPOCHS=${E2E_PS_EPOCHS:-40}        # the ps demo: long enough for a shard to die and come back
WAIT_S=${E2E_TIMEOUT_S:-900}          # one run, at most
LOGS=${E2E_LOGS:-$(mktemp -d "${TMPDIR:-/tmp}/compose-e2e.XXXXXX")}
export RINGSERVE_IMAGE=${RINGSERVE_IMAGE:-ringserve:e2e}

FAILED=0
TIMINGS=()
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*"; }
load() { cut -d' ' -f1 /proc/loadavg; }
fail() { log "FAIL: $*"; FAILED=1; }
pass() { log "ok: $*"; }
dc() { docker-compose -p "$PROJECT" -f "$ROOT/docker-compose.yml" --project-directory "$ROOT" "$@"; }

workers() { # every worker container of the project, running or not, oldest first
  docker ps -a -q --filter "label=com.docker.compose.project=$PROJECT" \
    --filter "label=com.docker.compose.service=worker" | tac
}
running_workers() {
  docker ps -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=worker"
}
exit_code() { docker inspect -f '{{.State.ExitCode}}' "$1"; }
all_logs() { # every worker's output so far, as its own lines (no compose prefixes)
  local c
  for c in $(workers); do docker logs "$c" 2>&1 || true; done
}
matches() { all_logs > "$LOGS/.now"; grep -Eq "$1" "$LOGS/.now"; }  # no pipe: grep -q would cut it

wait_for_log() { # PATTERN TIMEOUT_S: until a worker's output matches (extended regex)
  local deadline=$(( $(date +%s) + $2 ))
  until matches "$1"; do
    if [ "$(date +%s)" -gt "$deadline" ]; then return 1; fi
    if [ -z "$(running_workers)" ]; then matches "$1"; return; fi
    sleep 1
  done
}

wait_workers_exit() { # TIMEOUT_S
  local deadline=$(( $(date +%s) + $1 ))
  while [ -n "$(running_workers)" ]; do
    if [ "$(date +%s)" -gt "$deadline" ]; then return 1; fi
    sleep 2
  done
}

save_logs() { # NAME: each worker's output into $LOGS/NAME/, and the coordinator's
  local dir=$LOGS/$1 c i=0
  mkdir -p "$dir"
  for c in $(workers); do docker logs "$c" > "$dir/worker-$i.log" 2>&1 || true; i=$((i + 1)); done
  dc logs --no-color coordinator > "$dir/coordinator.log" 2>&1 || true
}

# check_finish NAME EXPECT_SIZE EXPECT_EXIT...: the workers that exit 0 and print a final hash are
# EXPECT_SIZE, every one "of EXPECT_SIZE" with one hash; the exit codes, sorted, are EXPECT_EXIT.
check_finish() {
  local name=$1 size=$2; shift 2
  local dir=$LOGS/$name codes=() finals=() c f
  for c in $(workers); do codes+=("$(exit_code "$c")"); done
  local got want
  got=$(printf '%s\n' "${codes[@]}" | sort -n | tr '\n' ' ')
  want=$(printf '%s\n' "$@" | sort -n | tr '\n' ' ')
  [ "$got" = "$want" ] && pass "$name: exit codes ${got% }" || fail "$name: exit codes $got, expected $want (logs in $dir)"
  for f in "$dir"/worker-*.log; do
    local last; last=$(grep -E '^rank [0-9]+ of [0-9]+: parameters sha256 [0-9a-f]{64}$' "$f" | tail -1 || true)
    [ -n "$last" ] && finals+=("$last")
  done
  local sizes hashes ranks
  sizes=$(printf '%s\n' "${finals[@]}" | awk '{print $4}' | sed 's/:$//' | sort -u | tr '\n' ' ')
  hashes=$(printf '%s\n' "${finals[@]}" | awk '{print $7}' | sort -u)
  ranks=$(printf '%s\n' "${finals[@]}" | awk '{print $2}' | sort -n | tr '\n' ' ')
  if [ "${#finals[@]}" -eq "$size" ] && [ "$sizes" = "$size " ] && [ "$(echo "$hashes" | wc -l)" -eq 1 ] \
      && [ "$ranks" = "$(seq 0 $((size - 1)) | tr '\n' ' ')" ]; then
    pass "$name: ranks ${ranks% } of $size hold identical parameters (sha256 ${hashes:0:16}...)"
  else
    fail "$name: final hashes: $(printf '%s; ' "${finals[@]}") (expected $size ranks of $size, one hash)"
  fi
  grep -hqE "^all $size ranks hold identical parameters" "$dir"/worker-*.log \
    && pass "$name: rank 0 compared all $size hashes" || fail "$name: rank 0 never printed 'all $size ranks hold identical parameters'"
  grep -hE '^epoch [0-9]+/[0-9]+ on' "$dir"/worker-*.log | tail -1 | sed "s/^/[$name] last: /" || true
}

down() { dc --profile ps down -v --remove-orphans -t 5 > /dev/null 2>&1 || true; }

scenario_scale() { # N
  local n=$1 name=scale-$1 t0; t0=$(now)
  log "== $name: docker-compose up --scale worker=$n ($EPOCHS epochs; load $(load))"
  down
  DEMO_EPOCHS=$EPOCHS dc up -d --no-build --scale worker="$n" > "$LOGS/$name.up.log" 2>&1 || { fail "$name: up failed: $(tail -3 "$LOGS/$name.up.log")"; return; }
  outsider "$name"
  wait_workers_exit "$WAIT_S" || fail "$name: workers still running after ${WAIT_S}s"
  save_logs "$name"
  check_finish "$name" "$n" $(for _ in $(seq "$n"); do echo 0; done)
  down
  TIMINGS+=("$name: $(since "$t0") s (load $(load) at the end)")
}

outsider() { # NAME: a call without the job's token, from inside the compose network, is refused
  local got
  got=$(dc exec -T coordinator python -c "import grpc
from ringserve._proto import coordinator_pb2 as pb, coordinator_pb2_grpc as rpc
try:
    rpc.CoordinatorStub(grpc.insecure_channel('coordinator:50051')).Status(pb.StatusRequest(), timeout=10)
    print('answered')
except grpc.RpcError as e:
    print(e.code().name)" 2>&1 | tail -1)
  if [ "$got" = UNAUTHENTICATED ]; then pass "$1: a call without the token is refused ($got)"
  else fail "$1: a call without the token got: $got"; fi
}

scenario_grow_stop() {
  local name=grow-stop t0 t1; t0=$(now)
  log "== $name: 4 train, --scale worker=6 adds 2, docker stop of one ($LONG_EPOCHS epochs; load $(load))"
  down
  DEMO_EPOCHS=$LONG_EPOCHS dc up -d --no-build --scale worker=4 > "$LOGS/$name.up.log" 2>&1 || { fail "$name: up failed"; return; }
  wait_for_log '^training on 4 workers' 300 || { fail "$name: 4 workers never trained together"; save_logs "$name"; down; return; }
  wait_for_log '^epoch 1/' 300 || fail "$name: no epoch finished on 4 workers"
  t1=$(now)
  DEMO_EPOCHS=$LONG_EPOCHS dc up -d --no-build --no-recreate --scale worker=6 >> "$LOGS/$name.up.log" 2>&1 || fail "$name: scale up failed"
  if wait_for_log '^training on 6 workers from commit [1-9]' 300; then
    pass "$name: 6 workers train $(since "$t1") s after --scale worker=6 ($(grep -oE 'training on 6 workers from commit [0-9]+ \(epoch [0-9]+' "$LOGS/.now" | head -1))"
  else
    fail "$name: the 2 new workers never joined"
  fi
  local victim; victim=$(workers | sed -n 3p)  # one of the first four
  wait_for_log "^epoch [0-9]+/$LONG_EPOCHS on 6 workers" 300 || fail "$name: no epoch finished on 6 workers"
  t1=$(now)
  docker stop -t 30 "$victim" > /dev/null
  log "$name: docker stop took $(since "$t1") s"
  if wait_for_log '^training on 5 workers from commit [1-9]' 120; then pass "$name: 5 train on after the stop"; else fail "$name: no world of 5 after the stop"; fi
  wait_workers_exit "$WAIT_S" || fail "$name: workers still running after ${WAIT_S}s"
  save_logs "$name"
  docker logs "$victim" 2>&1 | grep -q 'leaving the world after a commit, as SIGTERM asked' \
    && pass "$name: the stopped worker left at a commit" || fail "$name: the stopped worker did not leave at a commit"
  check_finish "$name" 5 0 0 0 0 0 0
  down
  TIMINGS+=("$name: $(since "$t0") s (load $(load) at the end)")
}

scenario_kill() {
  local name=kill t0 t1; t0=$(now)
  log "== $name: 4 train, docker kill of one ($LONG_EPOCHS epochs; load $(load))"
  down
  DEMO_EPOCHS=$LONG_EPOCHS dc up -d --no-build --scale worker=4 > "$LOGS/$name.up.log" 2>&1 || { fail "$name: up failed"; return; }
  wait_for_log '^training on 4 workers' 300 || { fail "$name: 4 workers never trained together"; save_logs "$name"; down; return; }
  wait_for_log '^epoch 2/' 300 || fail "$name: no 2 epochs on 4 workers"
  local victim; victim=$(workers | sed -n 2p)
  t1=$(now)
  docker kill "$victim" > /dev/null
  if wait_for_log '^training on 3 workers from commit [1-9]' 120; then
    pass "$name: 3 train on $(since "$t1") s after the kill ($(grep -oE 'training on 3 workers from commit [0-9]+ \(epoch [0-9]+' "$LOGS/.now" | head -1))"
  else
    fail "$name: the survivors did not go on"
  fi
  wait_workers_exit "$WAIT_S" || fail "$name: workers still running after ${WAIT_S}s"
  save_logs "$name"
  check_finish "$name" 3 0 0 0 137
  down
  TIMINGS+=("$name: $(since "$t0") s (load $(load) at the end)")
}

checkpointed() { # CONTAINER: how many shards' checkpoint folders hold a checkpoint (the volume is shared)
  docker exec "$1" python -c "import pathlib
print(sum(any(d.glob('v*.npz')) for d in pathlib.Path('/var/lib/ringserve/ps').rglob('shard-*')))" 2>/dev/null || echo 0
}

shards() { # the ps containers, oldest first
  docker ps -a -q --filter "label=com.docker.compose.project=$PROJECT" --filter "label=com.docker.compose.service=ps" | tac
}

scenario_ps() {
  local name=ps t0 t1 victim; t0=$(now)
  log "== $name: --profile ps up --scale worker=4 --scale ps=2, one shard killed mid-run ($PS_EPOCHS epochs; load $(load))"
  down
  DEMO_EPOCHS=$PS_EPOCHS PS_SHARDS=2 RINGSERVE_CHECKPOINT_UPDATES=20 \
    dc --profile ps up -d --no-build --scale worker=4 --scale ps=2 > "$LOGS/$name.up.log" 2>&1 \
    || { fail "$name: up failed: $(tail -3 "$LOGS/$name.up.log")"; down; return; }
  victim=$(shards | sed -n 2p)
  local deadline=$(( $(date +%s) + 600 ))
  until [ "$(checkpointed "$victim")" = 2 ]; do  # both shards have written a checkpoint
    if [ "$(date +%s)" -gt "$deadline" ] || [ -z "$(running_workers)" ]; then
      fail "$name: the shards wrote no checkpoints while the workers trained"; save_logs "$name"; down; return; fi
    sleep 1
  done
  t1=$(now)
  docker exec "$victim" python -c "import os
for p in os.listdir('/proc'):
    if p.isdigit() and int(p) != os.getpid() and b'ringserve' in open(f'/proc/{p}/cmdline', 'rb').read():
        os.kill(int(p), 9)" > /dev/null 2>&1 || fail "$name: could not kill the shard in $victim"
  wait_workers_exit "$WAIT_S" || fail "$name: workers still running after ${WAIT_S}s"
  save_logs "$name"
  local c i=0
  for c in $(shards); do docker logs "$c" > "$LOGS/$name/ps-$i.log" 2>&1 || true; i=$((i + 1)); done
  local restarts; restarts=$(docker inspect -f '{{.RestartCount}}' "$victim")
  [ "$restarts" -ge 1 ] && pass "$name: the killed shard was restarted ($restarts) by its policy" \
    || fail "$name: the killed shard was not restarted"
  grep -hqE 'resumed from' "$LOGS/$name"/ps-*.log && pass "$name: a shard resumed from its checkpoint ($(grep -hoE 'resumed from [^,]*' "$LOGS/$name"/ps-*.log | head -1))" \
    || fail "$name: no shard says it resumed from a checkpoint (logs in $LOGS/$name)"
  local codes=() accuracies
  for c in $(workers); do codes+=("$(exit_code "$c")"); done
  [ "$(printf '%s\n' "${codes[@]}" | sort -u | tr '\n' ' ')" = "0 " ] && [ "${#codes[@]}" -eq 4 ] \
    && pass "$name: 4 workers exit 0" || fail "$name: exit codes ${codes[*]}, expected 0 0 0 0"
  accuracies=$(grep -hoE '^rank [0-9]+: test accuracy [0-9.]+% after [0-9]+ steps \(ssp mode' "$LOGS/$name"/worker-*.log || true)
  [ "$(echo "$accuracies" | grep -c accuracy)" -eq 4 ] && pass "$name: $(echo "$accuracies" | tr '\n' ';')" \
    || fail "$name: not every worker printed its test accuracy (logs in $LOGS/$name)"
  log "$name: the shard's kill to the workers' end took $(since "$t1") s"
  down
  TIMINGS+=("$name: $(since "$t0") s (load $(load) at the end)")
}

T0=$(now)
ENGINE_WAS_UP=0
docker info > /dev/null 2>&1 && ENGINE_WAS_UP=1
cleanup() {
  down
  if [ "$ENGINE_WAS_UP" = 0 ] && [ "${KEEP_ENGINE:-0}" != 1 ]; then "$ENGINE" down || true; fi
}
trap cleanup EXIT

t=$(now); "$ENGINE" up; TIMINGS+=("engine up: $(since "$t") s")
eval "$("$ENGINE" env)"
t=$(now)
log "building $RINGSERVE_IMAGE (log: $LOGS/build.log)"
dc build --build-arg TORCH_INDEX_URL="${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" > "$LOGS/build.log" 2>&1 \
  || { tail -20 "$LOGS/build.log"; echo "compose_e2e: the image build failed" >&2; exit 1; }
TIMINGS+=("build: $(since "$t") s")

for s in $SCENARIOS; do
  case "$s" in
    scale:*) scenario_scale "${s#scale:}" ;;
    grow-stop) scenario_grow_stop ;;
    kill) scenario_kill ;;
    ps) scenario_ps ;;
    *) fail "unknown scenario $s" ;;
  esac
done

echo
echo "compose_e2e timings ($(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg)):"
printf '  %s\n' "${TIMINGS[@]}" "total: $(since "$T0") s"
echo "logs: $LOGS"
if [ "$FAILED" != 0 ]; then echo "compose_e2e: FAILED" >&2; exit 1; fi
echo "compose_e2e: all passed"
