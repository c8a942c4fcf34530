#!/usr/bin/env bash
# The 7B-shape end-to-end benchmark on the GPU machine, several source trees side by side, each invocation a fresh
# process (benchmarks/e2e.py; docs/performance.md quotes these runs):
#
#   [INVOCATIONS=N] [REPEATS=R] benchmarks/h200_e2e.sh NAME=TREE[:EXTRA E2E ARGS] ...
#   e.g. INVOCATIONS=3 benchmarks/h200_e2e.sh after=. after_pooled=.:"--placement pooled" before=.before
#
# The invocations go round the specs (invocation i of every spec runs before invocation i + 1 of any), so that a
# slow spell of the machine touches every tree alike. Writes $OUT/NAME-I.json and NAME-I.log (OUT: the device tool's
# output folder, else ./e2e-out) and ends with each spec's range over its invocations
# (benchmarks/lib/e2e_summary.py). Wheels the machine lacks (grpcio, protobuf, opentelemetry) may be carried in .whl/.
set -euo pipefail
mkdir -p "${OUT:-e2e-out}"
out=$(cd "${OUT:-e2e-out}" && pwd)
if compgen -G ".whl/*.whl" > /dev/null; then
    python -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
common=(--shape qwen2-7b --load-format dummy --alpha 0.8 --device cuda --dtype bfloat16
        --batches 1 32 --ks 3 --new-tokens 64 --repeats "${REPEATS:-5}")
names=()
for i in $(seq 1 "${INVOCATIONS:-1}"); do
    for spec in "$@"; do
        name=${spec%%=*}
        rest=${spec#*=}
        tree=${rest%%:*}
        extra=""
        [[ $rest == *:* ]] && extra=${rest#*:}
        [[ $i == 1 ]] && names+=("$name")
        start=$(date +%s)
        # shellcheck disable=SC2086  # EXTRA is a list of arguments
        if (cd "$tree" && PYTHONPATH=".:${PYTHONPATH:-}" python benchmarks/e2e.py "${common[@]}" $extra \
                --out "$out/$name-$i.json" > "$out/$name-$i.log" 2>&1); then
            echo "== $name ($tree $extra) invocation $i: $(( $(date +%s) - start )) s"
        else
            echo "== $name invocation $i FAILED"
            tail -20 "$out/$name-$i.log"
        fi
    done
done
python benchmarks/lib/e2e_summary.py "$out" "${names[@]}"
