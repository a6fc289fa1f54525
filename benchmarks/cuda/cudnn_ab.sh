#!/usr/bin/env bash
# A/B of cuDNN's attention inside CUDA graph captures (docs/runtime.md, "Attention on CUDA"), interleaved in one
# run on one GPU: "on" is eyas as it ships, "off" the same with `captured_attention` replaced by a no-op (captures
# then run the memory-efficient kernel, as eager forwards do). Same prerequisites as run.sh:
#   bash benchmarks/cuda/cudnn_ab.sh OUT_DIR
set -u
out=${1:?usage: bash benchmarks/cuda/cudnn_ab.sh OUT_DIR}
mkdir -p "$out"
log="$out/log.txt"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$log" 2>&1 || { tail "$log"; exit 1; }

eyas_with() {  # eyas_with on|off ARGS...: the eyas CLI, with cuDNN in captures or not
    local patch=""
    [ "$1" = off ] && patch="import contextlib, eyas.runtime.graphs as g; g.captured_attention = contextlib.nullcontext; "
    shift
    python3 -c "${patch}import sys; from eyas.client.cli import main; sys.exit(main(sys.argv[1:]))" "$@"
}

for round in 1 2; do
    for mode in off on; do
        whats="forward runtime"
        [ $round = 2 ] && whats=forward  # the forward again, for its spread; a runtime run takes 45 s
        for what in $whats; do
            name=$what-$mode-$round start=$SECONDS
            if [ $what = forward ]; then
                args="bench forward --device cuda --rows 1,9,33,64"
            else
                args="bench runtime --device cuda --draft-ahead 0 --repeats 10 --context-prompts 2 --batch-trees 1,4,4 --graphs on"
            fi
            timeout 120 bash -c "$(declare -f eyas_with); eyas_with $mode $args --json $out/$name.json" >> "$log" 2>&1
            echo "$name: rc=$? in $((SECONDS - start)) s" | tee -a "$log"
        done
    done
done
