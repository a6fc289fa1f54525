#!/usr/bin/env bash
# The CUDA checks and benchmarks of BENCHMARKS.md in one run, from the repository's root, on a machine with one
# NVIDIA GPU and a python3 that has torch, transformers, grpcio, protobuf and msgpack (Ray is not needed):
#   bash benchmarks/cuda/run.sh OUT_DIR
# Every JSON record and one log go to OUT_DIR; a failing step is reported and the next one runs.
set -u
out=${1:?usage: bash benchmarks/cuda/run.sh OUT_DIR}
mkdir -p "$out"
log="$out/log.txt"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$log"
python3 -c "import sys, torch, transformers; print(sys.version.split()[0], torch.__version__, transformers.__version__)" | tee -a "$log"
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$log" 2>&1 || { tail "$log"; exit 1; }

step() {  # step NAME SECONDS COMMAND...: run COMMAND with --json OUT_DIR/NAME.json, at most SECONDS
    local name=$1 limit=$2 start=$SECONDS
    shift 2
    echo "== $name: $*" >> "$log"
    timeout "$limit" "$@" --json "$out/$name.json" >> "$log" 2>&1
    echo "$name: rc=$? in $((SECONDS - start)) s" | tee -a "$log"
}

runtime="eyas bench runtime --device cuda --draft-ahead 0 --repeats 10 --context-prompts 2 --batch-trees 1,4,4"
step forward-1b 90 eyas bench forward --device cuda --rows 1,9,33,64
step runtime-bf16-graphs 120 $runtime --graphs on
step runtime-f32-graphs 100 $runtime --dtype float32 --graphs on
step forward-1b-f32 90 eyas bench forward --device cuda --dtype float32 --rows 1,9,33,64
step runtime-bf16-eager 120 $runtime --graphs off
step runtime-f32-eager 100 $runtime --dtype float32 --graphs off
for dtype in bfloat16 float32; do  # does one forward grow with the keys it reads? a tiny model, so launches dominate
    for context in 100 1700; do
        step forward-tiny-$dtype-$context 60 eyas bench forward --size tiny --device cuda --dtype $dtype --context $context --rows 1,9,33
    done
done
grep -E "Error|error:" "$log" | tail -5
