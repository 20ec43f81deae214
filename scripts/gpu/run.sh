#!/bin/bash
# The GPU check, run on the GPU machine from a kit folder that scripts/gpu/prepare.sh made:
# build llama.cpp with CUDA (libllama for the daemon, llama-bench, llama-server,
# llama-quantize), make a random-weight model of the default model's exact shapes and
# types, then the steps in $STEPS (all by default, in this order):
#   probe        llama_decode with the step shapes that once aborted the daemon (several
#                sequences of several rows each; probe_shapes.py): with the daemon's
#                defaults they must run clean; a control with cuBLAS's f16 shows the fault
#   stress       the daemon with its default config (speculation on, draft_max 64, 8 slots,
#                n_gpu_layers "auto"), 8 concurrent greedy streaming clients, prompts of
#                ~20, ~500 and ~1500 tokens, for $STRESS_S seconds (60): every request must
#                end `done` and the daemon must still be alive (spec_stress.py)
#   llama-bench  tg128 and pp512 (fa auto and on)
#   daemon       the daemon's bench: 1 client (decode, first token), 4 and 8 clients
#   server       the same against llama-server -np 8 -kvu --swa-full
# Results: $OUT/results.md and results.json (stress.json, daemon.json, ... beside them);
# the whole log in $OUT/full.log. Exit status 1 if the stress or a probe failed.
#
#   OUT=<dir> bash KIT/run.sh                                   (GPU machine; H100/H200)
#   OUT=<dir> KIT_DATA=KIT bash scripts/gpu/run.sh              (the same, with the checkout's
#                                                                scripts and the kit's data)
#   OUT=<dir> BIN=<llama.cpp bin> SITE=<site dir> bash KIT/run.sh --dry   (CPU dry run)
#
# Env: STEPS ("probe stress llama-bench daemon server"), STRESS_S (60), STRESS_CLIENTS (8),
#      STRESS_MAX_TOKENS (256), STRESS_LENGTHS (short,500,1500),
#      DAEMON_ENV (e.g. "GGML_CUDA_DISABLE_GRAPHS=1 CUDA_LAUNCH_BLOCKING=1": set for
#      both daemon runs), DAEMON_TOML (TOML merged over both daemons' configs, e.g.
#      $'speculative.draft_max = 16\nserver.slots = 4'),
#      SFCORE_SRC (the daemon's source checkout; default: the current directory when it
#      holds sfcore_daemon/, as a device run's repository root does, else the kit's
#      snapshot sfcore.tar), WORK (/tmp/gpukit; a build there is reused while the source
#      is the same), PY (python3), JOBS (16), CUDA_ARCH (90), CUDA_FA (OFF), ONLY_BUILD=1
#      (stop after the build and the model), BIN (skip the build, use these binaries),
#      SITE (skip the wheel install, use this site dir), LIBDIR (libllama.so's folder;
#      default BIN), MODEL (use this GGUF instead of making one), NGL (99 GPU, 0 dry).
# Progress lines (timestamped) on stdout; everything else in $OUT/full.log.
set -u -o pipefail
KIT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)   # the scripts
DATA=$(cd "${KIT_DATA:-$KIT}" && pwd)                  # what prepare.sh made
: "${OUT:?set OUT to an output folder}"
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
WORK=${WORK:-/tmp/gpukit}
PY=${PY:-python3}
JOBS=${JOBS:-16}
STEPS=" ${STEPS:-probe stress llama-bench daemon server} "
STRESS_S=${STRESS_S:-60}
if [ $DRY = 1 ]; then NGL=${NGL:-0}; DRYF=--dry; else NGL=${NGL:-99}; DRYF=; fi
LOG=$OUT/full.log
mkdir -p "$WORK"
: > "$LOG"
T0=$SECONDS
export PYTHONUNBUFFERED=1

log() { local m="[$(date +%H:%M:%S) +$((SECONDS - T0))s] $*"; echo "$m"; echo "$m" >> "$LOG"; }
# step NAME TIMEOUT cmd... : stdout/stderr to the full log, progress to stdout
step() {
  local name=$1 t=$2 s=$SECONDS rc
  shift 2
  log "== $name (timeout ${t}s)"
  timeout -k 5 "$t" "$@" >> "$LOG" 2>&1
  rc=$?
  log "== $name: rc=$rc, $((SECONDS - s))s"
  echo "\"$name\": {\"rc\": $rc, \"s\": $((SECONDS - s))}," >> "$WORK/steps.txt"
  return $rc
}
wanted() { [[ "$STEPS" == *" $1 "* ]]; }
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  sleep 1
  for p in "${PIDS[@]}"; do kill -9 "$p" 2>/dev/null; done
}
trap cleanup EXIT
: > "$WORK/steps.txt"

log "kit $KIT (data $DATA), work $WORK, out $OUT, dry=$DRY, ngl=$NGL, steps:$STEPS"
[ -n "${DAEMON_ENV:-}" ] && log "DAEMON_ENV: $DAEMON_ENV"
[ -n "${DAEMON_TOML:-}" ] && log "DAEMON_TOML: $(echo "$DAEMON_TOML" | tr '\n' ';')"
{
  echo "---- environment"; uname -a; nproc; free -g | head -2
  nvidia-smi 2>&1 | head -15
  command -v nvcc && nvcc --version | tail -2
  cmake --version | head -1; ninja --version; $PY -V; command -v $PY
} >> "$LOG" 2>&1
GPU=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)
log "gpu: ${GPU:-none}"

# ------------------------------------------------------------------ 1. build llama.cpp
SDIST=$(tar -tzf "$DATA/llama-src.tar.gz" | head -1 | cut -d/ -f1)   # llama_cpp_python-<version>
SRC=$WORK/src/$SDIST
BUILD=$WORK/build
CUDA_ARGS=()
CUDA_LIBDIRS=""
find_cuda_extras() {
  # nvcc, plus cuBLAS and libcuda wherever this image keeps them (a toolkit without
  # cuBLAS, with cuBLAS only in a Python venv's nvidia/* wheels, is handled by shims).
  local nvcc root shim h l roots
  nvcc=$(ls "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc 2>/dev/null | head -1)
  [ -z "$nvcc" ] && nvcc=$(command -v nvcc)
  [ -z "$nvcc" ] && { log "no nvcc found"; return 1; }
  CUDA_ARGS+=(-DCMAKE_CUDA_COMPILER="$(readlink -f "$nvcc")")
  root=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
  shim=$WORK/cudashim
  rm -rf "$shim"; mkdir -p "$shim/include" "$shim/lib"
  # the toolkit first, then Python wheels (torch's nvidia-cublas: nvidia/cu13/{include,lib})
  roots="$root $($PY -c 'import nvidia; print(" ".join(nvidia.__path__))' 2>/dev/null)"
  for r in /opt/*/.venv/lib/python3*/site-packages/nvidia /usr/local/lib/python3*/dist-packages/nvidia \
           /usr/local/cuda /usr/local/cuda-13* /usr/include /usr/lib/x86_64-linux-gnu; do
    [ -d "$r" ] && roots="$roots $r"
  done
  log "cuda search roots: $roots"
  if [ ! -e "$root/include/cublas_v2.h" ]; then
    h=$(find $roots -maxdepth 5 -name cublas_v2.h 2>/dev/null | head -1)
    if [ -n "$h" ]; then
      ln -sf "$(dirname "$h")"/cublas*.h "$shim/include/"
      CUDA_ARGS+=(-DCMAKE_CUDA_FLAGS="-I$shim/include" -DCMAKE_CXX_FLAGS="-I$shim/include")
      log "cublas headers: $(dirname "$h") (shim)"
    else
      log "WARNING: cublas_v2.h not found"
    fi
  fi
  if ! ls "$root"/lib*/libcublas.so >/dev/null 2>&1; then
    l=$( (find $roots -maxdepth 5 -name 'libcublas.so.13*'; find $roots -maxdepth 5 -name 'libcublas.so*') 2>/dev/null | head -1)
    if [ -n "$l" ]; then
      ln -sf "$(dirname "$l")"/libcublas*.so* "$shim/lib/"
      ln -sf "$(ls "$(dirname "$l")"/libcublas.so* | head -1)" "$shim/lib/libcublas.so"
      ln -sf "$(ls "$(dirname "$l")"/libcublasLt.so* | head -1)" "$shim/lib/libcublasLt.so"
      CUDA_ARGS+=(-DCUDA_cublas_LIBRARY="$shim/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$shim/lib/libcublasLt.so")
      CUDA_LIBDIRS="$CUDA_LIBDIRS:$(dirname "$l")"
      log "cublas libs: $(dirname "$l") (shim)"
    else
      log "WARNING: libcublas.so not found"
    fi
  fi
  if ! ls "$root"/lib*/stubs/libcuda.so "$root"/lib*/libcuda.so >/dev/null 2>&1; then
    l=$(ls /usr/local/nvidia/lib64/libcuda.so* /usr/local/nvidia/lib/libcuda.so* \
          /usr/lib/x86_64-linux-gnu/libcuda.so* /usr/lib64/libcuda.so* \
          "$root"/compat/libcuda.so* 2>/dev/null | head -1)
    [ -z "$l" ] && l=$(ldconfig -p 2>/dev/null | awk '/libcuda\.so/ {print $NF; exit}')
    if [ -n "$l" ]; then
      ln -sf "$l" "$shim/lib/libcuda.so"
      CUDA_ARGS+=(-DCUDA_cuda_driver_LIBRARY="$shim/lib/libcuda.so")
      log "libcuda: $l (shim)"
    else
      CUDA_ARGS+=(-DGGML_CUDA_NO_VMM=ON)
      log "WARNING: libcuda.so not found: GGML_CUDA_NO_VMM=ON"
    fi
  fi
  return 0
}

COMMON_FLAGS=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
  -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_APP=OFF)
TARGETS=(llama ggml llama-server llama-bench llama-quantize)

unpack_src() {
  local stamp
  stamp="$(sha256sum "$DATA/llama-src.tar.gz" | cut -c1-16)"
  if [ "$(cat "$WORK/src/.kitstamp" 2>/dev/null)" != "$stamp" ]; then
    rm -rf "$WORK/src"; mkdir -p "$WORK/src"
    [ -z "${BIN:-}" ] && rm -rf "$BUILD"  # a build of other sources; given binaries stay
    tar -C "$WORK/src" -xzf "$DATA/llama-src.tar.gz" || { log "FATAL: untar"; exit 1; }
    echo "$stamp" > "$WORK/src/.kitstamp"
  fi
}

if [ -n "${BIN:-}" ]; then
  log "using prebuilt binaries in $BIN (no build)"
  if [ -n "${SRCDIR:-}" ]; then SRC=$SRCDIR; else unpack_src; fi
else
  BIN=$BUILD/bin
  unpack_src
  find_cuda_extras
  if [ ! -f "$BUILD/build.ninja" ]; then
    step cmake-configure 120 cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -G Ninja \
      -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_CUDA_FA="${CUDA_FA:-OFF}" \
      -DGGML_CCACHE=OFF "${COMMON_FLAGS[@]}" "${CUDA_ARGS[@]}" \
      || { log "FATAL: configure failed (see full.log)"; tail -40 "$LOG"; rm -f "$BUILD/build.ninja"; exit 1; }
  else
    log "build dir exists: incremental build (a finished one takes seconds)"
  fi
  [ -n "${STOP_AFTER_CONFIGURE:-}" ] && { log "stop after configure"; exit 0; }
  BS=$SECONDS
  step cmake-build 480 cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" \
    || { log "FATAL: build failed or timed out (see full.log; a rerun resumes it)"; grep -m5 -B2 -A10 -E "error|FAILED" "$LOG" | tail -60; exit 1; }
  BUILD_S=$((SECONDS - BS))
  log "build time ${BUILD_S}s"
fi
LIBDIR=${LIBDIR:-$BIN}   # where libllama.so and libggml*.so are (a shared build puts them in bin/)
export LD_LIBRARY_PATH="$LIBDIR${CUDA_LIBDIRS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
ls -la "$BIN" >> "$LOG" 2>&1

# ------------------------------------------------------------------ 2. the model
if [ -n "${MODEL:-}" ]; then
  Q4=$MODEL
  log "model: $Q4 (given)"
else
  F16=$WORK/rand-f16.gguf
  Q4=$WORK/rand-q4_k_m.gguf
  if [ ! -s "$Q4" ] || [ "$KIT/make_model.py" -nt "$Q4" ]; then
    step make-model 180 $PY "$KIT/make_model.py" make "$DATA/model_meta.json.gz" "$F16" || exit 1
    step quantize 240 "$BIN/llama-quantize" "$F16" "$Q4" Q4_K_M "$JOBS" || exit 1
    rm -f "$F16"
  fi
  step check-types 60 $PY "$KIT/make_model.py" check "$DATA/model_meta.json.gz" "$Q4"
fi
[ -n "${ONLY_BUILD:-}" ] && { log "built: $BIN, model $Q4"; exit 0; }
grep -E "^check |MISMATCH" "$LOG" | tail -20 | sed 's/^/    /'

GPU="$GPU" DRY=$DRY NGL=$NGL Q4="$Q4" BUILD_S="${BUILD_S:-reused/prebuilt}" STEPS="$STEPS" \
DAEMON_ENV="${DAEMON_ENV:-}" DAEMON_TOML="${DAEMON_TOML:-}" $PY - "$OUT/meta.json" <<'EOF'
import json, os, sys
e = os.environ
json.dump({"gpu": e["GPU"], "dry": e["DRY"] == "1", "ngl": int(e["NGL"]), "model": e["Q4"],
           "model_bytes": os.path.getsize(e["Q4"]), "build_s": e["BUILD_S"],
           "host_cpus": os.cpu_count(), "steps": e["STEPS"].split(),
           "daemon_env": e["DAEMON_ENV"], "daemon_toml": e["DAEMON_TOML"]},
          open(sys.argv[1], "w"), indent=1)
EOF
report() { $PY "$KIT/bench.py" report --dir "$OUT" --meta "$OUT/meta.json" > /dev/null 2>> "$LOG"; }

# ------------------------------------------------------------------ the daemon's files
if [ -z "${SITE:-}" ]; then
  SITE=$WORK/site
  rm -rf "$SITE"; mkdir -p "$SITE"
  if ! $PY -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$DATA"/whl/*.whl >> "$LOG" 2>&1; then
    log "pip failed; unzipping the wheels"
    for w in "$DATA"/whl/*.whl; do $PY -m zipfile -e "$w" "$SITE"; done
  fi
fi
if [ -z "${SFCORE_SRC:-}" ] && [ -f sfcore_daemon/__init__.py ]; then SFCORE_SRC=$PWD; fi
if [ -n "${SFCORE_SRC:-}" ]; then
  SFCORE=$(cd "$SFCORE_SRC" && pwd)
  REV=$(git -C "$SFCORE" log -1 --format='%h %s' 2>/dev/null | cut -c1-70)
  git -C "$SFCORE" status --porcelain sfcore_daemon 2>/dev/null | grep -q . && REV="$REV, with uncommitted changes"
  log "daemon source: $SFCORE${REV:+ ($REV)}"
else
  SFCORE=$WORK/sfcore
  rm -rf "$SFCORE"; mkdir -p "$SFCORE"
  tar -C "$SFCORE" -xf "$DATA/sfcore.tar"
  log "daemon source: the kit's snapshot ($(cat "$DATA/sfcore.rev" 2>/dev/null))"
fi
DPY="$SITE:$SFCORE:$SRC${PYTHONPATH:+:$PYTHONPATH}"
# start_daemon NAME CONFIG: the daemon in the background (DAEMON_ENV set), its pid in DPID
start_daemon() {
  log "daemon ($1): ${DAEMON_ENV:+$DAEMON_ENV }PYTHONPATH=$DPY LLAMA_CPP_LIB_PATH=$LIBDIR $PY -m sfcore_daemon --config $2"
  # shellcheck disable=SC2086  # DAEMON_ENV is a list of NAME=VALUE words
  env ${DAEMON_ENV:-} PYTHONPATH="$DPY" LLAMA_CPP_LIB_PATH="$LIBDIR" \
    $PY -m sfcore_daemon --config "$2" > "$WORK/daemon-$1.log" 2>&1 &
  DPID=$!
  PIDS+=($DPID)
}
stop_daemon() {
  kill "$DPID" 2>/dev/null; wait "$DPID" 2>/dev/null
  { echo "---- daemon-$1.log (tail)"; tail -60 "$WORK/daemon-$1.log"; } >> "$LOG"
}
daemon_config() {  # daemon_config OUT BASE-TOML: BASE with DAEMON_TOML merged over it
  PYTHONPATH="$SITE" $PY "$KIT/daemon_toml.py" "$1" "$2" "${DAEMON_TOML:-}" \
    || { log "FATAL: daemon config"; exit 1; }
  { echo "---- $1"; cat "$1"; } >> "$LOG"
}
STRESS_RC=0
PROBE_RC=0

# ------------------------------------------------------------------ 2b. shape probe
# llama_decode driven directly (probe_shapes.py) with the step shapes that aborted the
# daemon on an H200: several sequences of several rows each, which a CUDA graph captures
# and replays once a shape repeats. With the daemon's defaults each probe must run out its
# time; the control forces llama.cpp's own cuBLAS compute type (f16) and shows whether
# this build and GPU have the fault at all (docs/gpu.md, "The crash").
# probe NAME MUST-PASS ENV... -- ARGS...
probe() {
  local name=$1 must=$2 rc line envs=()
  shift 2
  while [ "$1" != "--" ]; do envs+=("$1"); shift; done
  shift
  env "${envs[@]}" PYTHONPATH="$DPY" LLAMA_CPP_LIB_PATH="$LIBDIR" timeout -k 5 60 \
    $PY "$KIT/probe_shapes.py" --model "$Q4" --ngl "$NGL" --log "$WORK/probe-$name.steps" "$@" \
    > "$WORK/probe-$name.log" 2>&1
  rc=$?
  line=$(grep -h "^probe:" "$WORK/probe-$name.log" | tail -1)
  [ -z "$line" ] && line="aborted (rc $rc) at: $(tail -1 "$WORK/probe-$name.steps" 2>/dev/null); $(grep -h -m1 "CUDA error" "$WORK/probe-$name.log")"
  log "probe $name (${envs[*]:-defaults} $*): $line"
  echo "| $name | ${envs[*]:-daemon defaults} | $* | $line |" >> "$OUT/probe.md"
  [ "$must" = must ] && [ $rc -ne 0 ] && PROBE_RC=1
  return 0
}
if wanted probe; then
  echo "| probe | environment | shape | result |" > "$OUT/probe.md"
  echo "|---|---|---|---|" >> "$OUT/probe.md"
  probe control-f16 control GGML_CUDA_CUBLAS_COMPUTE_TYPE=f16 -- --seconds 5 --fixed 3:20
  probe fixed-3x20 must -- --seconds 8 --fixed 3:20
  probe fixed-8x9 must -- --seconds 8 --fixed 8:9
  probe random-64 must -- --seconds 15 --draft-rows 64 --prefill
fi

# ------------------------------------------------------------------ 3. stress
if wanted stress; then
  SOCK=/tmp/sfcore-stress.sock
  rm -rf "$SOCK" "$WORK/prompts"
  # The daemon's defaults (speculation on, draft_max 64, 8 slots, n_gpu_layers "auto",
  # the prompt store) but for where the model, the socket and the store are.
  daemon_config "$WORK/stress.toml" "$(printf '[server]\nsocket_path = "%s"\n[model]\npath = "%s"\n[cache]\ndir = "%s"\n[log]\nlevel = "info"\n' \
    "$SOCK" "$Q4" "$WORK/prompts")"
  start_daemon stress "$WORK/stress.toml"
  if step stress-start 120 $PY "$KIT/bench.py" wait-daemon --socket "$SOCK" --timeout 110 --out "$WORK/info-stress.json"; then
    grep -h "model: .* layers" "$WORK/daemon-stress.log" | tail -1 | sed 's/^/    /'
    step stress $((STRESS_S + 180)) $PY "$KIT/spec_stress.py" --socket "$SOCK" --seconds "$STRESS_S" \
      --clients "${STRESS_CLIENTS:-8}" --max-tokens "${STRESS_MAX_TOKENS:-256}" \
      --lengths "${STRESS_LENGTHS:-short,500,1500}" --pid "$DPID" \
      --log "$WORK/daemon-stress.log" --json "$OUT/stress.json"
    STRESS_RC=$?
    grep "stress: requests" "$LOG" | tail -1 | sed 's/^/    /'
  else
    STRESS_RC=1
    log "daemon did not come up:"; tail -20 "$WORK/daemon-stress.log"
    $PY - "$OUT/stress.json" "$WORK/daemon-stress.log" <<'EOF'
import json, sys
tail = open(sys.argv[2], errors="replace").read().splitlines()[-20:]
json.dump({"ok": False, "requests": 0, "done": 0, "errors": 0, "daemon_alive": False,
           "health_after": "the daemon did not come up", "daemon_log_tail": tail},
          open(sys.argv[1], "w"), indent=1)
EOF
  fi
  stop_daemon stress
  report
fi

# ------------------------------------------------------------------ 4. llama-bench
# 3 runs each (medians); 1 if the build left little of the ~600 s a device call may take
RUNSF=
if [ $((SECONDS - T0)) -gt "${LATE_S:-380}" ]; then RUNSF="--runs 1"; log "late: 1 run per measure"; fi
if wanted llama-bench && [ -x "$BIN/llama-bench" ]; then
  step llama-bench 150 $PY "$KIT/bench.py" llama-bench --bin "$BIN" --model "$Q4" --ngl "$NGL" \
    --out "$OUT/llama_bench.json" --timeout 120 $DRYF $RUNSF
  grep "bench: llama-bench fa" "$LOG" | sed 's/^/    /'
  report
elif wanted llama-bench; then
  log "llama-bench: skipped ($BIN/llama-bench not there)"
fi

# ------------------------------------------------------------------ 5. the daemon's bench
if wanted daemon; then
  SOCK=/tmp/sfcore-bench.sock
  rm -f "$SOCK"
  daemon_config "$WORK/daemon.toml" "$(printf '[server]\nsocket_path = "%s"\nslots = 8\n[model]\npath = "%s"\nn_gpu_layers = %s\nflash_attn = "auto"\n[cache]\nenabled = false\n[log]\nlevel = "info"\n' \
    "$SOCK" "$Q4" "$([ "$NGL" = 0 ] && echo 0 || echo -1)")"
  start_daemon bench "$WORK/daemon.toml"
  if step daemon-start 120 $PY "$KIT/bench.py" wait-daemon --socket "$SOCK" --timeout 110 --out "$WORK/info.json"; then
    grep "daemon ready\|daemon system_info" "$LOG" | tail -2 | sed 's/^/    /'
    grep -h "model: .* layers" "$WORK/daemon-bench.log" | tail -1 | sed 's/^/    /'
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$LOG" 2>&1
    step daemon-bench 240 $PY "$KIT/bench.py" daemon --socket "$SOCK" --out "$OUT/daemon.json" $DRYF $RUNSF
    grep "bench: daemon-" "$LOG" | sed 's/^/    /'
    report
  else
    log "daemon did not come up:"; tail -20 "$WORK/daemon-bench.log"
  fi
  stop_daemon bench
fi

# ------------------------------------------------------------------ 6. llama-server
if wanted server && [ -x "$BIN/llama-server" ]; then
  PORT=18080
  SARGS=(-m "$Q4" -ngl "$NGL" -np 8 -c 8192 -kvu --swa-full -fa auto --cache-ram 0
    --host 127.0.0.1 --port "$PORT" --no-webui)
  log "llama-server ${SARGS[*]}"
  "$BIN/llama-server" "${SARGS[@]}" > "$WORK/server.log" 2>&1 &
  SPID=$!
  PIDS+=($SPID)
  if step server-start 120 $PY "$KIT/bench.py" wait-server --port "$PORT" --timeout 110; then
    grep "server ready" "$LOG" | tail -1 | sed 's/^/    /'
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv >> "$LOG" 2>&1
    step server-bench 240 $PY "$KIT/bench.py" server --port "$PORT" --out "$OUT/server.json" $DRYF $RUNSF
    grep "bench: server-" "$LOG" | sed 's/^/    /'
  else
    log "llama-server did not come up:"; tail -20 "$WORK/server.log"
  fi
  kill "$SPID" 2>/dev/null; wait "$SPID" 2>/dev/null
  { echo "---- server.log (tail)"; grep -v "^srv  *log_server_r\|update_slots\|slot  *release\|launch_slot_\|print_timing\|prompt eval time\|eval time\|total time" "$WORK/server.log" | tail -80; } >> "$LOG"
elif wanted server; then
  log "llama-server: skipped ($BIN/llama-server not there)"
fi

# ------------------------------------------------------------------ 7. report
step report 30 $PY "$KIT/bench.py" report --dir "$OUT" --meta "$OUT/meta.json"
cat "$OUT/results.md" 2>/dev/null
log "done in $((SECONDS - T0))s; steps: $(tr '\n' ' ' < "$WORK/steps.txt")"
wanted probe && log "probe: $([ $PROBE_RC = 0 ] && echo PASSED || echo FAILED)"
wanted stress && log "stress: $([ $STRESS_RC = 0 ] && echo PASSED || echo FAILED)"
exit $((STRESS_RC | PROBE_RC))
