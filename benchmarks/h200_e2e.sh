#!/usr/bin/env bash
# The 7B-shape end-to-end benchmark on the GPU machine, several source trees side by side, each
# invocation a fresh process (benchmarks/e2e.py; docs/performance.md quotes these runs):
#
#   benchmarks/h200_e2e.sh NAME=TREE[:EXTRA E2E ARGS] ...
#   e.g. benchmarks/h200_e2e.sh colocated=. pooled=.:"--placement pooled" before=.before
#
# Writes $OUT/NAME.json and NAME.log (OUT: the device tool's output folder, else ./e2e-out) and prints each
# invocation's tables. Wheels the machine lacks (grpcio, protobuf, opentelemetry) may be carried in .whl/.
set -euo pipefail
mkdir -p "${OUT:-e2e-out}"
out=$(cd "${OUT:-e2e-out}" && pwd)
if compgen -G ".whl/*.whl" > /dev/null; then
    python -m pip install -q --no-deps --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
common=(--shape qwen2-7b --load-format dummy --alpha 0.8 --device cuda --dtype bfloat16
        --batches 1 32 --ks 3 --new-tokens 64 --repeats 5)
for spec in "$@"; do
    name=${spec%%=*}
    rest=${spec#*=}
    tree=${rest%%:*}
    extra=""
    [[ $rest == *:* ]] && extra=${rest#*:}
    start=$(date +%s)
    # shellcheck disable=SC2086  # EXTRA is a list of arguments
    if (cd "$tree" && PYTHONPATH=".:${PYTHONPATH:-}" python benchmarks/e2e.py "${common[@]}" $extra \
            --out "$out/$name.json" > "$out/$name.log" 2>&1); then
        echo "== $name ($tree $extra): $(( $(date +%s) - start )) s"
    else
        echo "== $name FAILED"
    fi
    sed -n '/^| batch | k | mode | tokens/,/^$/p' "$out/$name.log" | cut -d'|' -f2-11
    grep -E "^lossless|^- batch" "$out/$name.log" || tail -20 "$out/$name.log"
done
