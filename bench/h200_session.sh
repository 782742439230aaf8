#!/usr/bin/env bash
# One device call on the H200 that checks and measures everything GPU-side (about 9 minutes):
#   the CUDA tests, the benchmark against every peer, and the bf16 training curves.
# Usage (repository root on the H200, $OUT set by the device tool):  bash bench/h200_session.sh
# It writes at most 8 files under $OUT (the device tool's limit): run.log, h200.{md,json,png,errors.log},
# train_curves.{json,md,png}. Budgets are per step so a slow step cannot starve the others.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
LOG="$OUT/run.log"
commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
# `python -m pip`: the image's plain `pip` belongs to another interpreter, and then the entry
# point `mha` is not registered for the python that runs torch.
python -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1
python -c "import torch; assert 'mha' in torch._dynamo.list_backends(), 'entry point not registered'" >>"$LOG" 2>&1 || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >>"$LOG"
{ MHA_COMPILE_NO_AUTOTUNE=1 timeout 180 python -m pytest -q -m cuda tests -n 8 -p no:cacheprovider 2>&1 | tail -15; } >>"$LOG"
{ timeout -s INT 260 python -m bench --out "$OUT" --name h200 --budget 220 --presets medium,large,small \
    --modes eager,inductor,mha-staged,mha-fused,mha-fused-cudagraphs --spellings dense,loop,grouped_mm \
    --commit "$commit" 2>&1 | tail -70; } >>"$LOG"
{ timeout -s INT 110 python -m bench.train_curves --out "$OUT" 2>&1 | tail -30; } >>"$LOG"
tail -120 "$LOG"
