#!/usr/bin/env bash
# One GPU run of every published measurement, into one folder (DESIGN.md's benchmark protocol, rounds 3 and 4).
#
#   LIGER_LAB_COMMIT=$(git rev-parse --short HEAD) bash scripts/h200_snapshot.sh OUT_DIR [PART ...]
#
# PART is any of: tests notebooks ops e2e lengths e2e-1.5b head trl (default: all, in that order). Each part
# writes its rows (JSON, for `python -m benchmarks.import_results`) and its log to OUT_DIR and goes on after a
# failure; the exit code says whether any part failed. On a machine that keeps no git history set LIGER_LAB_COMMIT
# so every row names the commit measured; PYTEST_WORKERS sets how many pytest workers share the GPU (default 6).
# PART_TIMEOUT_S bounds each part (default 900 s): a part that hangs is killed, logged as exit 124, and the next one
# runs, so a lease of fixed length is never spent waiting on one part. PYTHON names the interpreter (default python3,
# which on a GPU image is its virtual environment's). The Hugging Face libraries run offline: nothing here downloads,
# and a machine without network access must not wait on the hub.
# On a lent machine (device tool): carry the wheels of ../shared/tools/gpu-wheels.sh as .whl, and install all but
# huggingface_hub, transformers, tokenizers and hf_xet (the image's transformers 5.17 and hub 1.33 import; the hub
# 2.4 wheel of the set imports httpx2, which the set lacks), after removing a /tmp/site a warm machine kept:
#   rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site \
#     $(ls .whl/*.whl | grep -v -E "huggingface_hub|transformers-|tokenizers-|hf_xet") && export PYTHONPATH=/tmp/site:$PWD
# Seen on 2026-12-03 (ff3b723): tests (8 workers) 65 s, head 60 s, trl 200 s, e2e at one size 85 s, lengths 170 s,
# ops 30 s (one round then; 5 rounds since, so about 3 min); two lease machines of one session had hosts about
# 2x apart, so compare rows of one machine only.
# Back on the checkout: copy the JSON files to benchmarks/results/, import them, name them in
# benchmarks/readme_table.py and run it; copy the executed notebooks to solutions/ and run
# `python -m liger_lab.workbook.chapters`.
set -u
out=${1:?usage: h200_snapshot.sh OUT_DIR [PART ...]}
shift
parts=${*:-tests notebooks ops e2e lengths e2e-1.5b head trl}
commit=${LIGER_LAB_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
export LIGER_LAB_COMMIT=$commit
# The cuda tests are small next to the GPU: several pytest workers share it (pytest-xdist). Timed parts run alone.
workers=${PYTEST_WORKERS:-6}
part_timeout=${PART_TIMEOUT_S:-900}
py=${PYTHON:-python3}
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
mkdir -p "$out"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem --format=csv > "$out/gpu-$commit.csv"
failed=0
run() {  # run NAME COMMAND...: the command's output to OUT/NAME.log, its time and exit code on stdout
    local name=$1
    shift
    local start=$SECONDS
    timeout "$part_timeout" "$@" > "$out/$name.log" 2>&1
    local code=$?
    echo "$name: exit $code in $((SECONDS - start)) s"
    [ $code -eq 0 ] || failed=1
}
for part in $parts; do
    case $part in
        tests) run "cuda-tests-$commit" "$py" -m pytest -q -rfE -m cuda -p no:cacheprovider -n "$workers" \
            --junitxml="$out/cuda-tests-$commit.xml" tests ;;
        notebooks) mkdir -p "$out/solutions" && cp solutions/*.ipynb "$out/solutions/" \
            && run notebooks "$py" scripts/execute_notebooks.py "$out"/solutions/*.ipynb ;;
        ops) run wall-clock-ops "$py" -m benchmarks.wall_clock ops --json "$out/h200-wall-clock-ops.json" ;;
        e2e) run wall-clock-e2e "$py" -m benchmarks.wall_clock e2e --json "$out/h200-wall-clock-e2e.json" ;;
        lengths) run wall-clock-lengths "$py" -m benchmarks.wall_clock lengths \
            --json "$out/h200-wall-clock-lengths.json" ;;
        e2e-1.5b) run e2e-1.5b "$py" -m liger_lab bench e2e --model 1.5b --reference hf+compile \
            --json "$out/h200-e2e-1.5b.json" ;;
        head) run rl-head "$py" -m benchmarks.rl_head --json "$out/h200-rl-head.json" ;;
        trl) run trl-steps "$py" -m benchmarks.trl_steps --json "$out/h200-trl-steps.json" ;;
        *) echo "unknown part $part" >&2; failed=1 ;;
    esac
done
exit $failed
