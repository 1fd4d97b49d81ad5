#!/usr/bin/env bash
# The checks that want an accelerator, in one pass: parity with transformers on the device (float32
# at JAX's default and at full matmul precision, and bfloat16), a train step, greedy decoding,
# loading GPT-2 medium against the usual recipe, and (host-gpu) an 8 GB bfloat16 Llama-shaped
# checkpoint (written first, about 30 s) loaded onto one GPU by port, read + jax.device_put and Orbax
# v1, beside the host-to-device copy rate from pinned memory (bench/host.py). Each step
# is time-boxed and the pass goes on after a failure; every step's output lands in $OUT (default
# ./device-out), summary.md first.
#
#   OUT=/tmp/device bash bench/device.sh            # with port installed, or from a checkout:
#   PYTHONPATH=src bash bench/device.sh
#   STEPS=parity-float32,train bash bench/device.sh   # only these steps; each step's limit: NAME_LIMIT below
set -u
OUT=${OUT:-device-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
summary="$OUT/summary.md"
: > "$summary"

step() {  # step NAME SECONDS COMMAND...: run it under a time limit, log it, and add its tail to the summary
  local name=$1 limit=$2
  shift 2
  case ",${STEPS:-all}," in *",all,"*|*",$name,"*) ;; *) return ;; esac
  local began=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  local rc=$?
  { echo "## $name: rc $rc in $((SECONDS - began)) s (limit $limit s)"; echo '```'; echo "$*"; echo '```'
    echo '```'; grep -v "^WARNING\|^I0000\|^W0000\|UserWarning\|warnings.warn" "$OUT/$name.log" | tail -"${TAIL:-30}"; echo '```'; } >> "$summary"
}

step environment 60 bash -c "nvidia-smi -L; $PY -c 'import jax, torch, transformers, equinox, numpy; print(\"jax\", jax.__version__, jax.devices(), \"torch\", torch.__version__, \"transformers\", transformers.__version__, \"equinox\", equinox.__version__, \"numpy\", numpy.__version__)'"
TAIL=40 step parity-float32 ${PARITY_LIMIT:-110} $PY bench/parity.py --cases all --meshes 1x1
step parity-2026-highest ${HIGHEST_LIMIT:-60} env JAX_DEFAULT_MATMUL_PRECISION=highest $PY bench/parity.py --cases 2026 --meshes 1x1
step parity-2026-bfloat16 ${BF16_LIMIT:-60} $PY bench/parity.py --cases 2026 --meshes 1x1 --dtype bfloat16
step train ${TRAIN_LIMIT:-75} $PY bench/train.py --models gpt2,llama --remat off,true --steps 3
step decode ${DECODE_LIMIT:-50} $PY bench/decode.py --models llama,gpt2 --batches 1,8 --prompt 64 --new 32 --repeats 1
step load ${LOAD_LIMIT:-110} $PY bench/bench.py --sizes medium --dtypes float32,bfloat16 --mesh 1x1 --repeats 2 --methods port,recipe,floor-per-tensor,read+put,put --workdir /tmp/port-bench
TAIL=40 step host-gpu ${HOST_LIMIT:-240} $PY bench/host.py --checkpoints llama-4b --device gpu --mesh 1x1 --rounds 2 --methods port,h2d,read+put,orbax,floor --timeout 90 --every-round --workdir /tmp/port-host
cat "$summary"
