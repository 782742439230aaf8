#!/usr/bin/env bash
# The GPU-side checks and measurements on the H200, as two device calls (each fits the device
# tool's 10-minute call and 8 files under $OUT). Repository root on the H200, $OUT set:
#   bash bench/h200_session.sh check   # pytest -m cuda, the training suite, and the autocast and fp32
#                                      # curves over 4 paired seeds (~8 min): run.log, train_curves.{json,md,png}
#   bash bench/h200_session.sh kernels # per-kernel times and host profile (~2 min): run.log, kernel_times.txt
#   bash bench/h200_session.sh bench   # the benchmark against every peer (~9 min):
#                                      # run.log, h200.{md,json,png,errors.log}
#   bash bench/h200_session.sh bench-resume  # the same, continuing bench/results/h200.json (same commit
#                                      # only): its whole (preset, dtype, pass) groups are kept
#   bash bench/h200_session.sh fwd     # host time per piece (small, medium), then the forward rows of
#                                      # the benchmark (~8 min): run.log, host_time.txt, h200_fwd.{md,json,png,errors.log}
#   bash bench/h200_session.sh graphs  # the region's CUDA graphs (options graphs=): pytest -m cuda, then
#                                      # fwd+bwd rows with and without them, and host time (~7 min):
#                                      # run.log, graphs.{md,json,png}, host_time.txt
#   [TESTS=0 MODES=.. SPELLINGS=.. ISOLATE=1 ROUNDS=n PRESETS=.. RESUME=1] bash bench/h200_session.sh table   # pytest -m cuda (TESTS=0: not), then the forward+backward rows of every mode (or MODES;
#                                      # ISOLATE=1: each row in a process of its own, bench --isolate; ROUNDS=n: each
#                                      # row timed n times, rounds interleaved, bench --rounds; PRESETS: a comma
#                                      # list, then RESUME=1 in a call chained on the same machine runs the
#                                      # rest (RESUME=path: an earlier call's h200.json carried in, e.g.
#                                      # out/s54/h200.json); SPELLINGS: a comma
#                                      # list for --spellings; ROUNDS at medium: max-autotune only on the spellings an
#                                      # autotune-cache call on this machine compiled, or AUTOTUNE_SPELLINGS),
#                                      # max-autotune on the dense spelling at medium (~9 min):
#                                      # run.log, h200.{md,json,png,errors.log}
#   bash bench/h200_session.sh table-fwd  # the forward rows likewise (~6 min): h200_fwd.*
#   [SPELLINGS=.. LIMIT=s MODES=..] bash bench/h200_session.sh autotune-cache  # Inductor max-autotune's fwd+bwd rows at medium on every
#                                      # spelling (~3 min of compiling each, ~9 min), after ours under
#                                      # reduce-overhead (a same-run ratio): autotune.{md,json},
#                                      # and its compiled graphs left in .inductor_cache/, which a `table`
#                                      # call chained right after on the same machine reuses (its max-autotune
#                                      # rows then fit; its notes say their first calls were cached compiles;
#                                      # the spellings it finished go to /tmp/mha_autotune_cache_done for table's ROUNDS)
#   bash bench/h200_session.sh medium-autotune  # medium's best peer, Inductor max-autotune (~3 min of
#                                      # compiling), beside Inductor and mha-fused on the dense spelling, in
#                                      # a call of its own (~5 min): run.log, h200_medium_autotune.{md,json,png}
#   [PRESET=large] bash bench/h200_session.sh ncu  # Nsight Compute on one training step's MoE and pool
#                                      # kernels (bench/ncu_kernels.py; throughput, L2/DRAM traffic, warp stalls,
#                                      # occupancy; ~4 min): run.log, ncu.txt
#   [PRESET=large] bash bench/h200_session.sh ncu-gemms  # throughput, memory, warp stalls and the stalls
#                                      # by source line (SourceCounters), on GEMM1 and the Gluon hidden kernel
#                                      # only, their first four launches (~2 min): run.log, ncu_gemms.txt;
#                                      # NCU_KERNELS=regex NCU_COUNT=n: other kernels (the weight gradients, Next 00)
#   [PRESET=large] bash bench/h200_session.sh ncu-source  # Nsight Compute's full set on GEMM1 and the
#                                      # hidden kernel (first three launches), then each one's SASS with its
#                                      # stall samples summed by part of the kernel (bench/ncu_source.py;
#                                      # ~3 min): run.log, ncu_source.txt, sass_<kernel>.csv.gz
#   bash bench/h200_session.sh probe   # each MoE kernel alone under every config (bench/gemm_probe.py), then
#                                      # CUDA time per kernel of the op (~6 min): gemm_probe.{txt,json}, kernel_times.txt
#   [PROBE=up,hidden PROBE_PRESETS=large] bash bench/h200_session.sh verify  # CUDA time per kernel of the
#                                      # op, then pytest -m cuda (~6 min); with PROBE, then gemm_probe.py on
#                                      # those kernels (90 s at most): run.log, kernel_times.txt, gemm_probe.txt
#   OLD=out/old.tar [AB_PRESETS=large,medium PROBE=up STEP_AB=1] bash bench/h200_session.sh ab
#                                      # a change's kernels against the tree before it, in one call: OLD is that
#                                      # tree (a directory, or a `git archive` tar carried in out/); per preset,
#                                      # gemm_probe.py --kernels $PROBE and gluon_probe.py in each tree in turn,
#                                      # then this tree's op replay, and with STEP_AB=1 step_ab.py at large
#                                      # (~4.5 min at large, ~2.5 at medium, +2-3 with STEP_AB; session 18's
#                                      # calls 1-2): run.log, ab_gemm.txt, ab_gluon.txt, kernel_times.txt[, step_ab_large.txt]
#   OLD=out/old.tar [AB_PRESETS=medium,large] bash bench/h200_session.sh kernel-times-ab  # CUDA time per kernel
#                                      # and op replay of the tree before a change and of this one, each in
#                                      # its own process, in one call (~5 min): run.log, kernel_times_{old,new}.txt
#   OLD=out/old.tar [ROWS_PRESETS=small,medium ROWS_MODES=mha-fused-cudagraphs] bash bench/h200_session.sh rows-ab
#                                      # benchmark rows (fwd+bwd, loop and dense) of the tree before a change and
#                                      # of this one, old, new, old, each in its own process (~7 min): host-bound
#                                      # rows move with the machine's host, so only a same-machine pair says
#                                      # whether a change moved them: run.log, rows_{old,new,old2}.md
#   [STATIC_PRESETS=medium,large] bash bench/h200_session.sh static-params  # reduce-overhead with the
#                                      # forward's parameters read in place (whole_graph.STATIC_PARAMS): the
#                                      # backend's and training GPU tests with it, then step_profile off and on
#                                      # per preset, each its own process (~7 min): run.log, static_params_<preset>.txt
#   bash bench/h200_session.sh step-graphs  # the step graphs (the default) and the trees: their GPU tests, then
#                                      # small's and medium's fwd+bwd rows under the trees and under the step
#                                      # graphs in 3 rounds, then step_profile of both at medium (~8 min):
#                                      # run.log, h200_step_graphs.{md,json,png}, step_profile_step_graphs_medium.txt
#   bash bench/h200_session.sh gluon   # the backward's hidden kernel in Gluon (gluon_moe) under each config
#                                      # against the Triton one, each checked first (bench/gluon_probe.py; ~2 min):
#                                      # run.log, gluon_probe.txt
#   bash bench/h200_session.sh verify-gluon  # verify, then gluon at large and medium, in one call (~9 min;
#                                      # landing staged work on the hidden kernel or GEMM1)
#   bash bench/h200_session.sh gluon-gemms  # the weight-gradient and slots GEMMs in Gluon against the
#                                      # Triton ones (bench/gluon_wgrad_probe.py, gluon_slots_probe.py; ~3 min):
#                                      # run.log, gluon_wgrad_probe.txt, gluon_slots_probe.txt
#   bash bench/h200_session.sh verify-gemms  # verify, then gluon-gemms at large only, in one call (~9 min;
#                                      # one machine start instead of two when landing staged Gluon work)
#   bash bench/h200_session.sh router  # the router's forward and its backward's two passes alone under
#                                      # each config (bench/router_probe.py, medium and large; ~2 min):
#                                      # run.log, router_probe.txt
#   [SMALL_KERNELS=column_sums] bash bench/h200_session.sh small-kernels  # the other small kernels alone
#                                      # under each launch config: ∂b1's tile sums, the slot-row gathers, the
#                                      # pool's fp32 projections, its forward and backward, the column sums...
#                                      # (bench/small_kernels_probe.py, medium and large; SMALL_KERNELS: its
#                                      # --kernels; cut at 300 s): run.log, small_kernels_probe.txt
#   bash bench/h200_session.sh host-large  # host time per piece at large (bench/host_time.py, 5 calls a
#                                      # piece: more would fill CUDA's launch queue and time the GPU instead;
#                                      # ~5 min of compiling): run.log, host_time_large.txt
#   bash bench/h200_session.sh host-timers  # inclusive host time per function of a training step
#                                      # (bench/host_timers.py) at small, medium and large (~3 min):
#                                      # run.log, host_timers_{small,medium,large}.txt
#   bash bench/h200_session.sh wgrad-stream  # the weight gradients' STREAM schedule (gluon_moe.WGRAD_STREAM,
#                                      # on by default since session 22) against the jobs: its GPU tests, then the large op's
#                                      # CUDA time per kernel with it off and on, then ncu on its six ∂W calls
#                                      # and gluon_wgrad_probe.py at large (~8 min): run.log,
#                                      # kernel_times_stream{0,1}.txt, ncu_wgrad_stream.txt, gluon_wgrad_probe.txt
#   bash bench/h200_session.sh sum-spread  # ∂b1's sums spread over the row blocks' jobs
#                                      # (gluon_moe.WGRAD_SUM_SPREAD, on by default since session 23): the weight-gradient GPU
#                                      # tests, then bench/flag_ab.py off against on at large and medium, then
#                                      # ncu on the large step's six weight-gradient calls with it on (~6 min):
#                                      # run.log, flag_ab_spread.txt, ncu_wgrad_spread.txt
#   bash bench/h200_session.sh column-sums  # the pool backward's sums over batch rows by our column
#                                      # sum (triton_pool.COLUMN_SUMS, the default since session 32): its GPU
#                                      # tests, then bench/flag_ab.py off against on at large and medium
#                                      # (~4 min): run.log, flag_ab_column_sums.txt
#   [CHUNK_MB=64 CHUNK_PRESETS=medium,large] bash bench/h200_session.sh slot-chunk  # the MoE's slot runs
#                                      # (MHA_COMPILE_SLOT_CHUNK_MB, session 43): the runs' GPU tests, then
#                                      # bench/flag_ab.py, the op's step as graph replays with runs of 512 MiB
#                                      # against CHUNK_MB in one process, its peak and time, per preset
#                                      # (~4 min): run.log, flag_ab_slot_chunk.txt
#   [COLUMN_RUNS="medium:256 large:512"] bash bench/h200_session.sh hidden-columns  # the backward's
#                                      # hidden layer in passes of F columns (MHA_COMPILE_HIDDEN_COLUMNS, session
#                                      # 46, off by default): its GPU tests, then bench/flag_ab.py, the op's step as
#                                      # graph replays with F in one pass against each preset:columns pair in one
#                                      # process, its peak and time (by default medium:256 medium:128 large:256
#                                      # large:512; ~9 min): run.log, flag_ab_hidden_columns.txt
#   bash bench/h200_session.sh keep-hidden  # triton_moe.KEEP_HIDDEN (staged, session 35): the KEEP_U
#                                      # variants' GPU tests (Gluon GEMM1 and hidden kernels, then the
#                                      # presets through the region), bench/flag_ab.py off against on at
#                                      # large and medium, then bench/gluon_probe.py (its "+u" rows; ~9 min):
#                                      # run.log, flag_ab_keep_hidden.txt, gluon_probe_kept.txt
#   bash bench/h200_session.sh gluon-up  # gluon_moe's GEMM1 (GLUON_UP, the default since session 34): its GPU
#                                      # tests, then bench/gemm_probe.py's up_gluon rows (each config
#                                      # checked against the Triton GEMM1, then timed beside it) at medium
#                                      # and large, gelu and silu (~4 min): run.log, gemm_probe_up_gluon.txt
#   bash bench/h200_session.sh keep-rows  # options keep_hidden under reduce-overhead (mha-fused-keep): the
#                                      # backend's GPU tests without then with MHA_COMPILE_KEEP_HIDDEN=1 on one
#                                      # Inductor cache (session 37: a stale entry was served across that switch),
#                                      # then fwd+bwd rows at large and medium: Inductor, mha-fused,
#                                      # mha-fused-cudagraphs, mha-fused-keep (~5 min): run.log, h200_s37_keep.{md,json,png}
#   [PRESET=medium] [RUNS=..] bash bench/h200_session.sh keep-step  # reduce-overhead's step with and without
#                                      # keep_hidden, or RUNS (step_profile's --runs; e.g. at large
#                                      # mha-fused-keep:dense,mha-fused-keep-static-tok:dense: tok's input copy)
#                                      # (bench/step_profile.py: do_bench, host issue, GPU kernels a step, top ops;
#                                      # ~2.5 min): run.log, step_profile_keep_<preset>.txt
#   [PRESET=large] [KEEP=1] [FLAG=DIRECT_LAUNCH] bash bench/h200_session.sh launch-ab  # triton_util.FAST_LAUNCH
#                                      # (or FLAG) off against on for a plain training step, in one process
#                                      # (bench/launch_ab.py: host issue and do_bench by round; ~2 min):
#                                      # run.log, launch_ab_<preset>.txt
#   [ROWS_ROUNDS=2] bash bench/h200_session.sh large-rows  # our large fwd+bwd rows, plain, plain with
#                                      # keep_hidden and reduce-overhead with it, loop and dense, ROWS_ROUNDS
#                                      # processes one after another (~2.5 min each): host-bound rows move
#                                      # with the host, so read a mode's rows across rounds:
#                                      # run.log, h200_large_rows_<n>.{md,json}
#   bash bench/h200_session.sh depths  # the backend's and training GPU tests, then bench/siamese_step.py (two
#                                      # forwards before one backward: the step graphs' depths, MAX_PENDING=1, the
#                                      # trees; small and medium, 3 rounds), then mem_diag at small (~7 min):
#                                      # run.log, siamese_step.txt, mem_diag_small.txt
#   [HALF=kernels|builds|rest] bash bench/h200_session.sh suite   # the GPU suite alone within 540 s, and
#                                      # which of the collected tests did not run (~9 min at most): run.log,
#                                      # suite.xml. On an H100 (3 workers) the whole suite no longer fits
#                                      # (session 60: 13 of 397 cut at 543 s), nor test_triton_kernels_cuda.py
#                                      # (session 61: 12 of 199 cut): HALF=kernels runs that file but its
#                                      # build-heavy tests, HALF=builds those (fp32 at D 1024 builds every
#                                      # config that does not fit before one that does, ~1-5 min a test),
#                                      # HALF=rest the other files (107 s in session 61), one call each
#   bash bench/h200_session.sh batch-ab  # bench/batch_ab.py: our reduce-overhead step with and without
#                                      # keep_hidden on one batch against two taken in turn (the table's
#                                      # way since session 55), large then medium, 3 rounds (~2 min):
#                                      # run.log, batch_ab.txt
#   OLD=out/old.tar [NEW=out/new.tar] bash bench/h200_session.sh pool-single-ab  # NEW's single-pass GPU
#                                      # tests, then the single pass alone in both trees in turn, twice (~3.5
#                                      # min): run.log, pool_single_ab.txt
#   OLD=out/old.tar bash bench/h200_session.sh copy-ab  # bench/copy_probe.py, then bench/batch_ab.py's
#                                      # step graphs at large and medium in OLD and this tree in turn, twice
#                                      # (copy_pairs' large copies by copy_, session 59; ~3-4 min): run.log, copy_ab.txt
#   bash bench/h200_session.sh pool-single  # the pool backward in one pass (MHA_COMPILE_POOL_BWD_SINGLE_PASS,
#                                      # by default where tok exceeds L2): its GPU tests, ncu's stalls
#                                      # by source line at large, flag_ab at large (8 rounds) and
#                                      # medium (4) (~7 min):
#                                      # run.log, ncu_pool_single.txt, flag_ab_pool_single.txt
#   bash bench/h200_session.sh verify-step-graphs  # where device time is short: the whole GPU suite
#                                      # on a cold cache, then step-graphs' rows without Inductor's (~9.5 min):
#                                      # run.log, h200_step_graphs.{md,json,png}
#   bash bench/h200_session.sh after-step-graphs  # chained on verify-step-graphs' warm machine: step_profile
#                                      # of both at medium, then hidden-columns' flag_ab at medium:256 and
#                                      # medium:128 (~5.5 min): run.log, step_profile_step_graphs_medium.txt,
#                                      # flag_ab_hidden_columns.txt
#   bash bench/h200_session.sh short   # one call when device time is short (~9 min): the fused
#                                      # kernel tests, the curves without the suite, and the
#                                      # benchmark cut at 250 s (rows past it are listed as skipped)
# Budgets are per step so a slow step cannot starve the others.
set -u
part=${1:?usage: bash bench/h200_session.sh check|kernels|probe|verify|ab|bench|bench-resume|fwd|graphs|table|table-fwd|autotune-cache|medium-autotune|ncu|ncu-gemms|ncu-source|gluon|verify-gluon|gluon-gemms|verify-gemms|router|small-kernels|host-large|host-timers|wgrad-stream|sum-spread|column-sums|slot-chunk|hidden-columns|step-graphs|keep-hidden|keep-rows|keep-step|launch-ab|large-rows|kernel-times-ab|rows-ab|static-params|gluon-up|verify-step-graphs|after-step-graphs|depths|suite|batch-ab|copy-ab|pool-single|pool-single-ab|short}
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD"
# Inductor's compiled graphs kept in the checkout (git ignores it): the device keeps ignored
# files between calls on a machine it still holds, so `table` can reuse `autotune-cache`'s.
export TORCHINDUCTOR_CACHE_DIR="$PWD/.inductor_cache"
LOG="$OUT/run.log"
# COMMIT overrides: the device copy's .git can lag the working tree it carries, and then the
# label without it ends in -dirty (session 11 ran trees its .git called 00effa4).
commit=${COMMIT:-$(git describe --always --dirty 2>/dev/null || echo unknown)}
# `python -m pip`: the image's plain `pip` belongs to another interpreter, and then the entry
# point `mha` is not registered for the python that runs torch.
python -m pip install -q --no-deps --no-build-isolation -e . >>"$LOG" 2>&1
python -c "import torch; assert 'mha' in torch._dynamo.list_backends(), 'entry point not registered'" >>"$LOG" 2>&1 || exit 1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv >>"$LOG"
echo "commit $commit, part $part" >>"$LOG"
# pytest -m cuda within a time limit (s), its last lines into the log
# (SIGINT: a suite cut by the limit still prints its summary, what passed and failed so far)
gpu_tests() {
    # 8 workers fit the H200's 141 GB; on an H100's 80, 23 tests failed beside each other (session
    # 51) that pass with 3
    workers=$(python -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 3)")
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout -s INT -k 20 "$1" python -m pytest -q -m cuda tests -n "$workers" \
        -p no:cacheprovider -rf 2>&1 | grep -E "^FAILED|passed|failed" | tail -40; } >>"$LOG"
}
# the fused op's times and CUDA time per kernel (region graphs replayed too) within a time limit (s)
fused_kernel_times() {
    { timeout -s INT "$1" python bench/kernel_times.py --presets medium,large --peers fused --graphs fused --profile \
        2>&1 | tail -400; } >"$OUT/kernel_times.txt"
}
# a flag's GPU tests (file $1, -k $2), then bench/flag_ab.py off against on for flag $3 (module:ATTR)
# at large and medium, $4 rounds each, into $OUT/$5
tests_then_flag_ab() {
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 150 python -m pytest -q -m cuda "$1" -k "$2" -p no:cacheprovider -rf \
        2>&1 | tail -8; } >>"$LOG"
    for preset in large medium; do
        timeout -s INT 100 python bench/flag_ab.py --flag "$3" --preset $preset --rounds "$4" >>"$OUT/$5" 2>&1
    done
    tail -8 "$OUT/$5" >>"$LOG"
}
# OLD (a directory, or a `git archive` tar carried in out/) as a directory: the tree an A/B compares against
old_tree() {
    local old=${OLD:?OLD: the tree to compare against, a directory or a tar of it}
    if [ -f "$old" ]; then mkdir -p /tmp/ab_old && tar xf "$old" -C /tmp/ab_old && old=/tmp/ab_old; fi
    (cd "$old" && pwd)
}
case "$part" in
check)
    gpu_tests 200
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout -s INT 360 python -m bench.train_curves --out "$OUT" --curves autocast,fp32 \
        --seeds 4 --steps 500 2>&1 | tail -30; } >>"$LOG"
    ;;
kernels)
    { timeout -s INT 150 python bench/kernel_times.py --presets medium,large --peers fused,staged,dense --profile \
        2>&1 | tail -400; } >"$OUT/kernel_times.txt"
    ;;
verify)
    # kernel_times first: it builds the kernels into Triton's on-disk cache, which the tests' eight
    # workers then share (session 31's suite on a cold cache was ~40% through at 220 s)
    fused_kernel_times 150
    gpu_tests "$([ -n "${PROBE:-}" ] && echo 250 || echo 330)"  # PROBE's 90 s must fit the call too
    if [ -n "${PROBE:-}" ]; then
        { timeout -s INT 90 python bench/gemm_probe.py --presets "${PROBE_PRESETS:-large}" --kernels "$PROBE" \
            --out "$OUT/gemm_probe.json" 2>&1; } >"$OUT/gemm_probe.txt"
    fi
    ;;
wgrad-stream)
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 150 python -m pytest -q -m cuda tests/kernels/test_gluon_moe_cuda.py \
        -k weight_grads -p no:cacheprovider -rf 2>&1 | tail -8; } >>"$LOG"
    for stream in 0 1; do
        { MHA_COMPILE_WGRAD_STREAM=$stream timeout -s INT 110 python bench/kernel_times.py --presets large \
            --peers fused --graphs fused --profile 2>&1 | tail -200; } >"$OUT/kernel_times_stream$stream.txt"
        grep -h "done large\|_wgrad_kernel " "$OUT/kernel_times_stream$stream.txt" >>"$LOG"
    done
    MHA_COMPILE_WGRAD_STREAM=1 timeout -s INT 100 ncu --clock-control none --profile-from-start off \
        -k "regex:^_wgrad_kernel$" -c 6 --section SpeedOfLight --section WarpStateStats \
        python bench/ncu_kernels.py --preset large >"$OUT/ncu_wgrad_stream.txt" 2>&1
    grep "Duration\|DRAM Throughput\|SM Active" "$OUT/ncu_wgrad_stream.txt" >>"$LOG"
    # the whole layout's calls too, by jobs and by STREAM (its "+= stream" rows), each checked first
    { timeout -s INT 90 python bench/gluon_wgrad_probe.py --presets large 2>&1; } >"$OUT/gluon_wgrad_probe.txt"
    ;;
sum-spread)
    tests_then_flag_ab tests/kernels/test_gluon_moe_cuda.py weight_grads \
        mha_compile.kernels.gluon_moe:WGRAD_SUM_SPREAD 8 flag_ab_spread.txt
    MHA_COMPILE_WGRAD_SUM_SPREAD=1 timeout -s INT 100 ncu --clock-control none --profile-from-start off \
        -k "regex:^_wgrad_kernel$" -c 6 --section SpeedOfLight --section WarpStateStats \
        python bench/ncu_kernels.py --preset large >"$OUT/ncu_wgrad_spread.txt" 2>&1
    grep "Duration\|SM Active" "$OUT/ncu_wgrad_spread.txt" >>"$LOG"
    ;;
column-sums)
    tests_then_flag_ab tests/kernels/test_triton_kernels_cuda.py column_sums \
        mha_compile.kernels.triton_pool:COLUMN_SUMS 3 flag_ab_column_sums.txt
    ;;
slot-chunk)
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 120 python -m pytest -q -m cuda tests/kernels/test_triton_kernels_cuda.py \
        tests/kernels/test_gluon_moe_cuda.py -k "run" -p no:cacheprovider -rf 2>&1 | tail -8; } >>"$LOG"
    presets=${CHUNK_PRESETS:-medium,large}
    for preset in ${presets//,/ }; do
        timeout -s INT 150 python bench/flag_ab.py --flag mha_compile.kernels.triton_moe:SLOT_CHUNK_BYTES \
            --values $((512 << 20)),$((${CHUNK_MB:-64} << 20)) --preset "$preset" --rounds 6 \
            >>"$OUT/flag_ab_slot_chunk.txt" 2>&1
    done
    grep "peak\|SLOT_CHUNK_BYTES:" "$OUT/flag_ab_slot_chunk.txt" >>"$LOG"
    ;;
hidden-columns)
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 120 python -m pytest -q -m cuda tests/kernels/test_triton_kernels_cuda.py \
        -k "column_passes" -p no:cacheprovider -rf 2>&1 | tail -8; } >>"$LOG"
    for pair in ${COLUMN_RUNS:-medium:256 medium:128 large:256 large:512}; do
        timeout -s INT 105 python bench/flag_ab.py --flag mha_compile.kernels.triton_moe:HIDDEN_COLUMNS \
            --values "0,${pair##*:}" --preset "${pair%%:*}" --rounds 3 >>"$OUT/flag_ab_hidden_columns.txt" 2>&1
    done
    grep "peak\|worst\|HIDDEN_COLUMNS:" "$OUT/flag_ab_hidden_columns.txt" >>"$LOG"
    ;;
step-graphs)
    # mha_compile's step graphs (mha_compile/step_graphs.py; reduce-overhead's default since session
    # 52) against torch's trees (step_graphs=False): their GPU tests, then small's and medium's
    # training rows under each in rounds, then step_profile of both at medium (host issue, GPU time a step)
    # log_level=WARNING: torch's DEBUG trace records, captured with a failure, would crowd its message out
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 200 python -m pytest -q -m cuda tests/backend/test_step_graphs_cuda.py \
        tests/backend/test_whole_graph_cuda.py -n 4 -p no:cacheprovider -o log_level=WARNING -rf --tb=short 2>&1 \
        | tail -60; } >>"$LOG"
    { timeout -s INT -k 15 260 python -m bench --out "$OUT" --name h200_step_graphs --budget 230 --presets small,medium \
        --passes fwd+bwd --spellings grouped_mm --modes inductor,mha-fused-trees,mha-fused-cudagraphs \
        --rounds 3 --commit "$commit" 2>&1 | tail -40; } >>"$LOG"
    { timeout -s INT -k 10 100 python bench/step_profile.py --preset medium \
        --runs mha-fused-trees:dense,mha-fused-cudagraphs:dense 2>&1; } >"$OUT/step_profile_step_graphs_medium.txt"
    grep "^==" "$OUT/step_profile_step_graphs_medium.txt" >>"$LOG"
    ;;
pool-single)
    # the pool backward's single pass (triton_pool.SINGLE_PASS, by default where tok exceeds L2;
    # PERF_NOTES v60-v61): its GPU tests, ncu's stall reasons by source line on it at large (where its
    # loop's cycles go), then flag_ab two passes against one at large (8 rounds) and medium (4) (~7 min)
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 150 python -m pytest -q -m cuda tests/kernels/test_triton_kernels_cuda.py \
        -k attend_bwd_single -p no:cacheprovider -rf 2>&1 | tail -5; } >>"$LOG"
    MHA_COMPILE_POOL_BWD_SINGLE_PASS=1 timeout -s INT 150 ncu --clock-control none --profile-from-start off \
        -k "regex:^_pool_bwd_single_kernel$" -c 2 --section SpeedOfLight --section WarpStateStats \
        --section SourceCounters --import-source yes \
        python bench/ncu_kernels.py --preset large >"$OUT/ncu_pool_single.txt" 2>&1
    tail -5 "$OUT/ncu_pool_single.txt" >>"$LOG"
    for preset in large medium; do
        timeout -s INT 150 python bench/flag_ab.py --flag mha_compile.kernels.triton_pool:SINGLE_PASS \
            --preset $preset --rounds "$([ $preset = large ] && echo 8 || echo 4)" 2>&1 | grep -v Warning
    done >"$OUT/flag_ab_pool_single.txt"
    cat "$OUT/flag_ab_pool_single.txt" >>"$LOG"
    ;;
suite)
    # the GPU suite alone, within 540 s (an H100 at 3 workers: 438 s in session 58, cut at 543 s with 13
    # tests left in session 60, hence HALF): pytest's junit file says which tests ran, and the log names
    # those collected that did not, so that a suite cut by its limit says so (~9 min at most;
    # SUITE_LIMIT=s: a shorter limit, when the call runs something else first)
    builds="where_it_fits or products_where or column_sums or bitwise_reproducible"
    case "${HALF:-all}" in
    all) files=(tests) ;;
    kernels) files=(tests/kernels/test_triton_kernels_cuda.py -k "not ($builds)") ;;
    builds) files=(tests/kernels/test_triton_kernels_cuda.py -k "$builds") ;;
    rest) files=(tests --ignore=tests/kernels/test_triton_kernels_cuda.py) ;;
    *) echo "HALF=$HALF: one of kernels, builds, rest (or unset: the whole suite)" >>"$LOG"; exit 2 ;;
    esac
    workers=$(python -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 3)")
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout -s INT -k 20 "${SUITE_LIMIT:-540}" python -m pytest -q -m cuda "${files[@]}" -n "$workers" \
        -p no:cacheprovider -rf --tb=short --junitxml="$OUT/suite.xml" 2>&1 | grep -E "^FAILED|^E |passed|failed" \
        | tail -60; } >>"$LOG"
    python -m pytest --collect-only -q -m cuda "${files[@]}" -p no:cacheprovider 2>/dev/null | grep "::" >/tmp/collected
    if [ -f "$OUT/suite.xml" ]; then
        python - "$OUT/suite.xml" /tmp/collected >>"$LOG" 2>&1 <<'PY'
import sys, xml.etree.ElementTree as ET
ran = {(c.get("classname") or "").replace(".", "/") + ".py::" + (c.get("name") or "")
       for c in ET.parse(sys.argv[1]).iter("testcase")}
collected = [line.strip() for line in open(sys.argv[2])]
missing = [name for name in collected if name not in ran]
print(f"{len(collected) - len(missing)} of {len(collected)} collected tests ran" + (", not run:" if missing else ""),
      *missing, sep="\n  ")
PY
    else
        echo "no junit file: the suite was killed before it could write one" >>"$LOG"
    fi
    ;;
batch-ab)
    # what the copy-in of alternating batches costs our rows (session 56: ~73 us a large step on an
    # H100), each way its own compiled step, interleaved by round
    { timeout -s INT -k 10 240 python bench/batch_ab.py --presets large,medium \
        --modes mha-fused-keep,mha-fused-cudagraphs --rounds 3 2>&1 | grep -v Warning | tail -20; } >"$OUT/batch_ab.txt"
    cat "$OUT/batch_ab.txt" >>"$LOG"
    ;;
pool-single-ab)
    # the single pass of OLD against NEW (each a directory or a `git archive` tar carried in out/; NEW
    # by default this tree): NEW's single-pass and large bf16 GPU tests, then small_kernels_probe.py
    # --kernels pool_single at large in each tree in turn, twice (session 59's calls 4-5; ~3.5 min)
    old=$(old_tree)
    new=${NEW:-$PWD}
    if [ -f "$new" ]; then mkdir -p /tmp/ab_new && tar xf "$new" -C /tmp/ab_new && new=/tmp/ab_new; fi
    { cd "$new" && PYTHONPATH="$new" MHA_COMPILE_NO_AUTOTUNE=1 timeout 200 python -m pytest -q -m cuda \
        tests/kernels/test_triton_kernels_cuda.py -k "attend_bwd_single or (presets and large and bf16)" -n 2 \
        -p no:cacheprovider -rf 2>&1 | tail -4; cd - >/dev/null; } >>"$LOG"
    for round in 1 2; do
        for tree in "$new" "$old"; do
            echo "== round $round, $([ "$tree" = "$old" ] && echo old || echo new)"
            (cd "$tree" && PYTHONPATH="$tree" timeout -s INT 90 python bench/small_kernels_probe.py --presets large \
                --kernels pool_single 2>&1 | grep -E "two passes|BLOCK_N")
        done
    done >"$OUT/pool_single_ab.txt"
    cat "$OUT/pool_single_ab.txt" >>"$LOG"
    ;;
copy-ab)
    # copy_pairs' copies of 1 MiB or more by copy_ alone (9ff50f7, session 59) against the tree before
    # it (OLD: a `git archive 173c1a4` tar carried in out/): bench/copy_probe.py here, then batch_ab's
    # step graphs (one batch and two) in the old and this tree in turn, twice (~3-4 min)
    old=$(old_tree)
    { timeout 60 python bench/copy_probe.py 2>&1; } >"$OUT/copy_ab.txt"
    for round in 1 2; do
        for tree in "$old" "$PWD"; do
            echo "== round $round, $([ "$tree" = "$old" ] && echo old || echo new)" >>"$OUT/copy_ab.txt"
            (cd "$tree" && PYTHONPATH="$tree" timeout -s INT 90 python bench/batch_ab.py --presets large,medium \
                --modes mha-fused-cudagraphs --rounds 3 2>&1 | grep -v Warning | tail -8) >>"$OUT/copy_ab.txt"
        done
    done
    cat "$OUT/copy_ab.txt" >>"$LOG"
    ;;
depths)
    # the backend's and the training suites' GPU tests (the step graphs' depths among them: session
    # 53), then a siamese step (two forwards before one backward) under the step graphs at two
    # depths, with MAX_PENDING=1 (the second forward eager, as before) and on the trees, small and
    # medium in 3 rounds, then what stays allocated after small's steps under each (mem_diag; ~7 min)
    workers=$(python -c "import torch; print(8 if torch.cuda.get_device_properties(0).total_memory > 100e9 else 3)")
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout -s INT -k 20 240 python -m pytest -q -m cuda tests/backend tests/training \
        -n "$workers" -p no:cacheprovider -o log_level=WARNING -rf --tb=short 2>&1 | grep -E "^FAILED|^E |passed|failed" \
        | tail -40; } >>"$LOG"
    { timeout -s INT -k 10 170 python bench/siamese_step.py --presets small,medium --rounds 3 2>&1 | tail -20; } \
        >"$OUT/siamese_step.txt"
    grep -v "^mha_compile" "$OUT/siamese_step.txt" >>"$LOG"
    { timeout -s INT -k 10 90 python bench/mem_diag.py --presets small \
        --modes mha-fused-cudagraphs,mha-fused-trees,mha-fused 2>&1 | tail -60; } >"$OUT/mem_diag_small.txt"
    ;;
keep-hidden)
    # the Gluon GEMM1's and hidden kernels' KEEP_U variants against float64 first (staged offline in
    # session 35, never run: a hang or a wrong tile shows here, within the tests' limit)
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 150 python -m pytest -q -m cuda tests/kernels/test_gluon_moe_cuda.py \
        -k "kept or gemm1" -p no:cacheprovider -rf 2>&1 | tail -8; } >>"$LOG"
    tests_then_flag_ab tests/kernels/test_triton_kernels_cuda.py kept_hidden \
        mha_compile.kernels.triton_moe:KEEP_HIDDEN 3 flag_ab_keep_hidden.txt
    { timeout -s INT 170 python bench/gluon_probe.py --presets medium,large 2>&1; } >"$OUT/gluon_probe_kept.txt"
    grep -E "^(medium|large)|gluon gelu " "$OUT/gluon_probe_kept.txt" | cut -c1-150 >>"$LOG"
    ;;
static-params)
    # whole_graph.STATIC_PARAMS (the forward's parameters read in place under reduce-overhead):
    # the GPU tests of the backend with it on, then step_profile off and on at each preset, each in
    # its own process; read each step's GPU kernel time and aten::_foreach_copy_ (the host-bound
    # do_bench moves by up to 0.4 ms between processes, session 26)
    { MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS=1 MHA_COMPILE_NO_AUTOTUNE=1 timeout 150 python -m pytest -q -m cuda tests/backend \
        tests/training -n 8 -p no:cacheprovider 2>&1 | tail -4; } >>"$LOG"
    presets=${STATIC_PRESETS:-medium,large}
    for preset in ${presets//,/ }; do
        for value in 0 1; do
            { MHA_COMPILE_CUDAGRAPH_STATIC_PARAMS=$value timeout -s INT 100 python bench/step_profile.py --preset "$preset" \
                --runs mha-fused-cudagraphs:loop 2>&1; } >>"$OUT/static_params_$preset.txt"
            grep "^==" "$OUT/static_params_$preset.txt" | tail -1 | sed "s/^/static=$value: /" >>"$LOG"
            grep "_foreach_copy_" "$OUT/static_params_$preset.txt" | tail -1 | cut -c1-160 | sed "s/^/static=$value: /" >>"$LOG"
        done
    done
    ;;
rows-ab)
    old=$(old_tree)
    for run in old new old2; do
        tree=$([ "$run" = new ] && echo "$PWD" || echo "$old")
        # --budget: no row starts after 60 s, so the table prints before the limit (a row killed
        # mid-way prints none: session 25's first try lost its old rows so)
        { cd "$tree" && PYTHONPATH="$tree" timeout -s INT -k 10 140 python -m bench --out "/tmp/rows_$run" \
            --name "rows_$run" --presets "${ROWS_PRESETS:-small,medium}" --passes fwd+bwd \
            --modes "${ROWS_MODES:-mha-fused-cudagraphs}" --spellings loop,dense --budget 60 --commit "$run" \
            2>&1 | tail -3; } >>"$LOG"
        cd - >/dev/null
        cp "/tmp/rows_$run/rows_$run.md" "$OUT/" 2>/dev/null
        grep -h "^| .*| fwd+bwd |" "/tmp/rows_$run/rows_$run.md" 2>/dev/null | sed "s/^/$run: /" | cut -c1-120 >>"$LOG"
    done
    ;;
kernel-times-ab)
    old=$(old_tree)
    for tree in "$old" "$PWD"; do
        name=$([ "$tree" = "$old" ] && echo old || echo new)
        { cd "$tree" && PYTHONPATH="$tree" timeout -s INT 140 python bench/kernel_times.py \
            --presets "${AB_PRESETS:-medium,large}" --peers fused --graphs fused --profile 2>&1 | tail -400; } \
            >"$OUT/kernel_times_$name.txt"
        cd - >/dev/null
        grep -h "^done" "$OUT/kernel_times_$name.txt" | sed "s/^/$name: /" >>"$LOG"
    done
    ;;
ab)
    old=$(old_tree)
    presets=${AB_PRESETS:-large}
    for preset in ${presets//,/ }; do
        for tree in "$old" "$PWD"; do
            echo "== $tree ($([ "$tree" = "$old" ] && echo old || echo "new, $commit")), $preset" | tee -a "$OUT/ab_gemm.txt" >>"$OUT/ab_gluon.txt"
            # each tree's own probes and package (PYTHONPATH first, before the editable install's)
            (cd "$tree" && PYTHONPATH="$tree" timeout -s INT 60 python bench/gemm_probe.py --presets "$preset" \
                --kernels "${PROBE:-up}") >>"$OUT/ab_gemm.txt" 2>&1
            (cd "$tree" && PYTHONPATH="$tree" timeout -s INT 85 python bench/gluon_probe.py --presets "$preset") \
                >>"$OUT/ab_gluon.txt" 2>&1
        done
    done
    fused_kernel_times 150
    if [ "${STEP_AB:-0}" = 1 ]; then
        timeout -s INT 200 python bench/step_ab.py --trees "$old,$PWD" --preset large --rounds 2 \
            >"$OUT/step_ab_large.txt" 2>&1
        tail -3 "$OUT/step_ab_large.txt" >>"$LOG"
    fi
    ;;
probe)
    { timeout -s INT 330 python bench/gemm_probe.py --presets medium,large --out "$OUT/gemm_probe.json" \
        2>&1; } >"$OUT/gemm_probe.txt"
    fused_kernel_times 120
    ;;
fwd)
    for preset in small medium; do
        timeout 90 python bench/host_time.py --preset $preset >>"$OUT/host_time.txt" 2>&1
    done
    { timeout -s INT 440 python -m bench --out "$OUT" --name h200_fwd --budget 400 --presets medium,large,small \
        --passes fwd --modes eager,inductor,inductor-max-autotune,mha-staged,mha-fused,mha-fused-cudagraphs \
        --spellings dense,loop,grouped_mm --commit "$commit" 2>&1 | tail -60; } >>"$LOG"
    ;;
graphs)
    gpu_tests 200
    { timeout -s INT 280 python -m bench --out "$OUT" --name graphs --budget 250 --presets small,medium,large \
        --passes fwd+bwd --modes eager,inductor,mha-fused,mha-fused-nographs,mha-fused-cudagraphs \
        --spellings dense,grouped_mm --commit "$commit" 2>&1 | tail -40; } >>"$LOG"
    timeout 60 python bench/host_time.py --preset medium >>"$OUT/host_time.txt" 2>&1
    ;;
table|table-fwd)
    pass=fwd name=h200_fwd limit=450 budget=380
    if [ "$part" = table ]; then
        pass=fwd+bwd name=h200
        # TESTS=0 when a `verify` call on the same commit ran them: the bench then gets their time
        if [ "${TESTS:-1}" = 1 ]; then gpu_tests 170; limit=410 budget=345; else limit=${TABLE_LIMIT:-560} budget=${TABLE_BUDGET:-490}; fi
    fi
    # Without a compiled cache, max-autotune's first graph (dense; ~3 min) fits only the larger budget.
    # MODES=...: a comma list for --modes (session 27 left out inductor-max-autotune to fit after
    # other work in the call: eager,inductor,mha-staged,mha-fused,mha-fused-nographs,mha-fused-cudagraphs).
    # PRESETS=large,small then RESUME=1 in a call chained after it: all 57 rows no longer fit one call
    # (session 41). Each run leaves its rows in the machine's /tmp, where the chained call's --resume
    # finds them (it keeps the groups they hold whole and runs the rest).
    # Rounds at medium with max-autotune compiling from scratch: its compiles (~3 min a spelling)
    # spend the budget in round 1 and every row gets one round (session 43's call 3).
    # Session 45's: autotune-cache had compiled grouped_mm only, and loop's compile from scratch took the
    # rest. So in rounds at medium, max-autotune runs only on the spellings autotune-cache compiled on
    # this machine (AUTOTUNE_SPELLINGS=...: those instead, whatever it costs).
    autotune_spellings=${AUTOTUNE_SPELLINGS:-}
    if [ "$part" = table ] && [ "${ROUNDS:-1}" -gt 1 ] && [[ ",${PRESETS:-medium,large,small}," == *,medium,* ]] \
        && [[ "${MODES:-inductor-max-autotune}" == *max-autotune* ]] && [ -z "$autotune_spellings" ]; then
        if [ -s /tmp/mha_autotune_cache_done ]; then
            autotune_spellings=$(sort -u /tmp/mha_autotune_cache_done | paste -sd,)
            echo "ROUNDS=$ROUNDS at medium: max-autotune only on $autotune_spellings (compiled by autotune-cache)" >>"$LOG"
        else
            echo "warning: ROUNDS=$ROUNDS at medium and no compile of autotune-cache finished on this machine:" \
                "max-autotune's compiles will take round 1's budget (run autotune-cache, LIMIT=560, in a call" \
                "chained before)" >>"$LOG"
        fi
    fi
    resume=()
    # RESUME=1: the rows an earlier call on this machine left in /tmp; RESUME=path: a file of them
    # carried from an earlier call (run's `carry`), when the machine went back in between
    if [ -n "${RESUME:-}" ]; then
        earlier=/tmp/$name.json
        [ "$RESUME" != 1 ] && earlier=$RESUME
        cp "$earlier" "$OUT/$name.json" && resume=(--resume) || { echo "RESUME: no $earlier" >>"$LOG"; exit 1; }
    fi
    { timeout -s INT -k 15 $limit python -m bench --out "$OUT" --name $name --budget $budget \
        --presets "${PRESETS:-medium,large,small}" --passes $pass --spellings "${SPELLINGS:-dense,loop,grouped_mm}" \
        ${MODES:+--modes "$MODES"} ${autotune_spellings:+--autotune-spellings "$autotune_spellings"} ${ISOLATE:+--isolate} ${ROUNDS:+--rounds "$ROUNDS"} "${resume[@]}" --commit "$commit" 2>&1 | tail -70; } >>"$LOG"
    cp "$OUT/$name.json" "/tmp/$name.json"
    ;;
gluon-up)
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 150 python -m pytest -q -m cuda tests/kernels/test_gluon_moe_cuda.py -k gemm1 \
        -p no:cacheprovider -rf 2>&1 | tail -8; } >>"$LOG"
    for act in gelu silu; do
        { timeout -s INT 120 python bench/gemm_probe.py --presets medium,large --act $act --kernels up_gluon 2>&1; } \
            >>"$OUT/gemm_probe_up_gluon.txt"
    done
    grep -E "^up|^medium|^large" "$OUT/gemm_probe_up_gluon.txt" | cut -c1-150 >>"$LOG"
    ;;
autotune-cache)
    # SPELLINGS=loop,grouped_mm (say) when a table call has already compiled the dense one.
    # Straight into the log, and killed 20 s after the interrupt: at 812f6c9 an interrupt during
    # max-autotune's compile went unanswered until the device call's own limit, and `| tail`
    # then returned nothing at all.
    # Our reduce-overhead rows (~10 s) run first, so the file holds a same-run ratio to the peer.
    timeout -s INT -k 20 "${LIMIT:-560}" python -m bench --out "$OUT" --name autotune --presets medium \
        --passes fwd+bwd --modes "${MODES:-mha-fused-cudagraphs,inductor-max-autotune}" \
        --spellings "${SPELLINGS:-dense,loop,grouped_mm}" --commit "$commit" >>"$LOG" 2>&1
    # for table's check (the machine's /tmp outlives a call): the spellings whose compiles finished
    python - "$OUT/autotune.json" >>/tmp/mha_autotune_cache_done 2>>"$LOG" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))["rows"]
print("\n".join(r["spelling"] for r in rows if r["mode"] == "inductor-max-autotune" and r.get("status") == "ok"))
EOF
    ;;
ncu)
    # --clock-control none: the device notes (METHOD.md) say to leave the clocks alone
    timeout -s INT 420 ncu --clock-control none --profile-from-start off -k "regex:_moe_|_pool_|^_up_kernel$" \
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats --section SchedulerStats \
        python bench/ncu_kernels.py --preset "${PRESET:-large}" >"$OUT/ncu.txt" 2>&1
    tail -5 "$OUT/ncu.txt" >>"$LOG"
    ;;
ncu-gemms)
    # the two GEMMs with activation epilogues, GEMM1 (Gluon's _up_kernel since session 34, the
    # Triton _moe_up_kernel with MHA_COMPILE_GLUON_UP=0; 2 a large step) and the backward's Gluon
    # hidden kernel (_hidden_kernel, 3), their first four launches (~1.5 min)
    # SourceCounters: the warp-stall reasons by source line (Triton and Gluon keep line info), the
    # reading that says whether the consumers wait on their epilogue's ALU work or on the ring
    # NCU_KERNELS, NCU_COUNT: other kernels, e.g. NCU_KERNELS=_wgrad_kernel NCU_COUNT=6 at large: the
    # three runs' ∂W2 (no sums) and ∂W1 (∂b1's column sums beside it) in turn (PERF_NOTES Next 00)
    timeout -s INT 200 ncu --clock-control none --profile-from-start off \
        -k "regex:^(${NCU_KERNELS:-_up_kernel|_moe_up_kernel|_hidden_kernel|_hidden_coop_kernel})$" \
        -c "${NCU_COUNT:-4}" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section MemoryWorkloadAnalysis_Tables --section WarpStateStats \
        --section SourceCounters --import-source yes \
        python bench/ncu_kernels.py --preset "${PRESET:-large}" >"$OUT/ncu_gemms.txt" 2>&1
    tail -5 "$OUT/ncu_gemms.txt" >>"$LOG"
    ;;
ncu-source)
    # The kernel names of GEMM1 (Gluon's, or Triton's with MHA_COMPILE_GLUON_UP=0) and of both Gluon
    # hidden kernels (the cooperative one at large).
    # The report itself (~15 MB) stays on the device; its source pages come back.
    timeout -s INT 240 ncu --clock-control none --profile-from-start off \
        -k "regex:^(_up_kernel|_moe_up_kernel|_hidden_kernel|_hidden_coop_kernel)$" -c 3 --set full --import-source yes \
        -o /tmp/gemms python bench/ncu_kernels.py --preset "${PRESET:-large}" >>"$LOG" 2>&1
    for k in _up_kernel _moe_up_kernel _hidden_kernel _hidden_coop_kernel; do
        timeout 60 ncu -i /tmp/gemms.ncu-rep -k $k -c 1 --page source --csv --print-source sass >"$OUT/sass_$k.csv" 2>>"$LOG"
        grep -q "Warp Stall" "$OUT/sass_$k.csv" || rm -f "$OUT/sass_$k.csv"
    done
    python bench/ncu_source.py "$OUT"/sass_*.csv >"$OUT/ncu_source.txt" 2>>"$LOG"
    gzip -f "$OUT"/sass_*.csv
    tail -20 "$OUT/ncu_source.txt" >>"$LOG"
    ;;
medium-autotune)
    timeout -s INT -k 15 335 python -m bench --out "$OUT" --name h200_medium_autotune --budget 300 --presets medium \
        --passes fwd+bwd --modes inductor,mha-fused,mha-fused-cudagraphs,inductor-max-autotune --spellings dense \
        --commit "$commit" >>"$LOG" 2>&1
    ;;
gluon|verify-gluon)
    limit=500
    if [ "$part" = verify-gluon ]; then
        gpu_tests 230
        fused_kernel_times 130
        limit=150
    fi
    { timeout -s INT $limit python bench/gluon_probe.py --presets large,medium 2>&1; } >"$OUT/gluon_probe.txt"
    tail -30 "$OUT/gluon_probe.txt" >>"$LOG"
    ;;
router)
    { timeout -s INT 200 python bench/router_probe.py --presets medium,large 2>&1; } >"$OUT/router_probe.txt"
    tail -40 "$OUT/router_probe.txt" >>"$LOG"
    ;;
small-kernels)
    # interrupted at 300 s: the rows printed by then are kept (each is flushed as it is timed)
    { timeout -s INT 300 python bench/small_kernels_probe.py --presets medium,large ${SMALL_KERNELS:+--kernels "$SMALL_KERNELS"} 2>&1; } \
        >"$OUT/small_kernels_probe.txt"
    tail -40 "$OUT/small_kernels_probe.txt" >>"$LOG"
    ;;
gluon-gemms|verify-gemms)
    presets=medium,large limit=150
    if [ "$part" = verify-gemms ]; then
        gpu_tests 200
        fused_kernel_times 130
        presets=large limit=70
    fi
    { timeout -s INT $limit python bench/gluon_wgrad_probe.py --presets $presets 2>&1; } >"$OUT/gluon_wgrad_probe.txt"
    { timeout -s INT $limit python bench/gluon_slots_probe.py --presets $presets 2>&1; } >"$OUT/gluon_slots_probe.txt"
    tail -30 "$OUT/gluon_wgrad_probe.txt" "$OUT/gluon_slots_probe.txt" >>"$LOG"
    ;;
host-large)
    timeout -s INT 540 python bench/host_time.py --preset large --calls 5 >"$OUT/host_time_large.txt" 2>&1
    head -25 "$OUT/host_time_large.txt" >>"$LOG"
    ;;
host-timers)
    for preset in small medium large; do
        { timeout 150 python bench/host_timers.py --preset $preset --calls 50 2>&1 | grep -v "autotuning\|chose"; } \
            >"$OUT/host_timers_$preset.txt"
    done
    ;;
keep-rows)
    for keep in 0 1; do
        { MHA_COMPILE_KEEP_HIDDEN=$keep MHA_COMPILE_NO_AUTOTUNE=1 timeout 100 python -m pytest -q -m cuda tests/backend \
            -n 8 -p no:cacheprovider -rf --tb=short 2>&1 | tail -30; } >"$OUT/backend_tests_keep$keep.txt"
        tail -3 "$OUT/backend_tests_keep$keep.txt" | sed "s/^/MHA_COMPILE_KEEP_HIDDEN=$keep: /" >>"$LOG"
    done
    { timeout -s INT -k 15 400 python -m bench --out "$OUT" --name h200_s37_keep --budget 340 --presets large,medium \
        --passes fwd+bwd --spellings loop,dense,grouped_mm --modes inductor,mha-fused,mha-fused-cudagraphs,mha-fused-keep \
        --commit "$commit" 2>&1 | tail -40; } >>"$LOG"
    ;;
keep-step)
    preset=${PRESET:-medium}
    { timeout -s INT -k 10 160 python bench/step_profile.py --preset "$preset" \
        --runs "${RUNS:-mha-fused-cudagraphs:dense,mha-fused-keep:dense}" 2>&1; } >"$OUT/step_profile_keep_$preset.txt"
    grep "^==" "$OUT/step_profile_keep_$preset.txt" >>"$LOG"
    ;;
launch-ab)
    preset=${PRESET:-large}
    { timeout -s INT -k 10 150 python bench/launch_ab.py --flag "${FLAG:-FAST_LAUNCH}" --preset "$preset" \
        --spelling loop --rounds 6 ${KEEP:+--keep} 2>&1; } >"$OUT/launch_ab_$preset.txt"
    grep -v "autotun\|chose" "$OUT/launch_ab_$preset.txt" | tail -12 >>"$LOG"
    ;;
large-rows)
    for round in $(seq 1 "${ROWS_ROUNDS:-2}"); do
        { timeout -s INT -k 15 200 python -m bench --out "$OUT" --name "h200_large_rows_$round" --budget 170 \
            --presets large --passes fwd+bwd --spellings loop,dense \
            --modes mha-fused,mha-fused-keep-plain,mha-fused-keep --commit "$commit" 2>&1 \
            | grep "^large " | cut -c1-150; } >>"$LOG"
    done
    ;;
verify-step-graphs)
    # one call where device time is short: the whole GPU suite (the step graphs' GPU tests among
    # them) on a cold kernel cache, then small's and medium's training rows under the trees and
    # under the step graphs in 3 rounds, without Inductor's (its compile would take the rounds)
    gpu_tests 320
    { timeout -s INT -k 15 230 python -m bench --out "$OUT" --name h200_step_graphs --budget 200 --presets small,medium \
        --passes fwd+bwd --spellings grouped_mm --modes mha-fused-trees,mha-fused-cudagraphs \
        --rounds 3 --commit "$commit" 2>&1 | tail -40; } >>"$LOG"
    ;;
after-step-graphs)
    # chained on the machine verify-step-graphs left warm: step_profile of the trees and the step
    # graphs at medium (host issue beside GPU time a step), then the backward's column passes at
    # medium against one pass (flag_ab: peak and time, 3 rounds), for medium's peak target
    { timeout -s INT -k 10 100 python bench/step_profile.py --preset medium \
        --runs mha-fused-trees:dense,mha-fused-cudagraphs:dense 2>&1; } >"$OUT/step_profile_step_graphs_medium.txt"
    grep "^==" "$OUT/step_profile_step_graphs_medium.txt" >>"$LOG"
    for columns in 256 128; do
        timeout -s INT 105 python bench/flag_ab.py --flag mha_compile.kernels.triton_moe:HIDDEN_COLUMNS \
            --values "0,$columns" --preset medium --rounds 3 >>"$OUT/flag_ab_hidden_columns.txt" 2>&1
    done
    grep "peak\|worst\|HIDDEN_COLUMNS:" "$OUT/flag_ab_hidden_columns.txt" >>"$LOG"
    ;;
short)
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout 120 python -m pytest -q -m cuda tests/kernels -k "not staged" -n 8 \
        -p no:cacheprovider 2>&1 | tail -8; } >>"$LOG"
    { MHA_COMPILE_NO_AUTOTUNE=1 timeout -s INT 170 python -m bench.train_curves --out "$OUT" --skip-suite \
        --curves autocast,fp32 2>&1 | tail -12; } >>"$LOG"
    { timeout -s INT 290 python -m bench --out "$OUT" --name h200 --budget 250 --presets medium,large,small \
        --modes eager,inductor,mha-staged,mha-fused,mha-fused-cudagraphs \
        --spellings dense,loop,grouped_mm --commit "$commit" 2>&1 | tail -100; } >>"$LOG"
    ;;
bench|bench-resume)
    resume=()
    if [ "$part" = bench-resume ]; then cp bench/results/h200.json "$OUT/h200.json" && resume=(--resume); fi
    { timeout -s INT 560 python -m bench --out "$OUT" --name h200 --budget 500 --presets medium,large,small \
        --modes eager,inductor,inductor-max-autotune,mha-staged,mha-fused,mha-fused-cudagraphs \
        --spellings dense,loop,grouped_mm "${resume[@]}" --commit "$commit" 2>&1 | tail -100; } >>"$LOG"
    ;;
*) echo "unknown part $part: expected check, kernels, probe, verify, ab, bench, bench-resume, fwd, graphs, table, table-fwd, autotune-cache, medium-autotune, ncu, ncu-gemms, ncu-source, gluon, verify-gluon, gluon-gemms, verify-gemms, router, small-kernels, host-large, host-timers, wgrad-stream, sum-spread, column-sums, slot-chunk, hidden-columns, step-graphs, keep-hidden, keep-rows, keep-step, launch-ab, large-rows, kernel-times-ab, rows-ab, static-params, gluon-up, depths, suite, batch-ab, copy-ab, pool-single, pool-single-ab or short" >&2; exit 2 ;;
esac
tail -150 "$LOG"
