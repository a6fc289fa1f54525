#!/usr/bin/env bash
# The CUDA checks and benchmarks of BENCHMARKS.md in one run, from the repository's root, on a machine with one
# NVIDIA GPU and a python3 that has torch, transformers, grpcio, protobuf and msgpack (Ray is not needed):
#   bash benchmarks/cuda/run.sh OUT_DIR            # eyas bench forward and runtime: bf16 and float32, graphs on and off
#   bash benchmarks/cuda/run.sh OUT_DIR cudnn-ab   # cuDNN's attention inside graph captures (docs/runtime.md,
#                                                  # "Attention on CUDA") off and on, interleaved: "on" is eyas as it
#                                                  # ships, "off" the same with `captured_attention` a no-op
# Every JSON record and one log go to OUT_DIR; a failing step is reported and the next one runs.
set -u
out=${1:?usage: bash benchmarks/cuda/run.sh OUT_DIR [cudnn-ab]}
mode=${2:-}
[ -z "$mode" ] || [ "$mode" = cudnn-ab ] || { echo "usage: bash benchmarks/cuda/run.sh OUT_DIR [cudnn-ab]" >&2; exit 2; }
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

# the eyas CLI with captures run without cuDNN's attention
eyas_cudnn_off=(python3 -c "import contextlib, sys, eyas.runtime.graphs as g; from eyas.client.cli import main
g.captured_attention = contextlib.nullcontext; sys.exit(main(sys.argv[1:]))")
forward="bench forward --device cuda --rows 1,9,33,64"
runtime="bench runtime --device cuda --draft-ahead 0 --repeats 10 --context-prompts 2 --batch-trees 1,4,4"
if [ "$mode" = cudnn-ab ]; then
    for round in 1 2; do
        for cudnn in off on; do
            cli=(eyas)
            [ $cudnn = off ] && cli=("${eyas_cudnn_off[@]}")
            step forward-$cudnn-$round 120 "${cli[@]}" $forward
            # the forward again in the second round, for its spread; a runtime run takes 45 s
            [ $round = 1 ] && step runtime-$cudnn-$round 120 "${cli[@]}" $runtime --graphs on
        done
    done
    exit 0
fi
step forward-1b 90 eyas $forward
step runtime-bf16-graphs 120 eyas $runtime --graphs on
step runtime-f32-graphs 100 eyas $runtime --dtype float32 --graphs on
step forward-1b-f32 90 eyas $forward --dtype float32
step runtime-bf16-eager 120 eyas $runtime --graphs off
step runtime-f32-eager 100 eyas $runtime --dtype float32 --graphs off
for dtype in bfloat16 float32; do  # does one forward grow with the keys it reads? a tiny model, so launches dominate
    for context in 100 1700; do
        step forward-tiny-$dtype-$context 60 eyas bench forward --size tiny --device cuda --dtype $dtype --context $context --rows 1,9,33
    done
done
grep -E "Error|error:" "$log" | tail -5
