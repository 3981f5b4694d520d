#!/usr/bin/env bash
# Every GPU figure of results/README.md, on one CUDA machine, part by part:
#
#     bash scripts/gpu_figures.sh RESULTS_DIR [PART ...]
#
# PARTS: check mfu overhead tests guides guides_compile tests_ds engines speed_options (default: all,
# in that order; speed_options was called speed until issue 33: bench_speed.py's options each against
# its baseline), and issue 33's, which spend a GPU well, in three device calls of their own (each under the
# 560 s a 600 s call leaves after the wheels' install; on an H200 on 2026-11-28, `speed peers` with the old
# limits of 535 s in one call measured 2 ladder rows and 4 of the 8 peer rows; the rest ran out of budget):
#     bash scripts/gpu_figures.sh OUT speed                      # 490 s
#     bash scripts/gpu_figures.sh OUT peers_gpt2 peers_qlora     # 400 s
#     bash scripts/gpu_figures.sh OUT peers_pretrain             # 360 s   (`peers` runs all three workloads)
#     bash scripts/gpu_figures.sh OUT peers_dpo                  # 240 s   (issue 40: loss=dpo beside TRL's DPOTrainer)
#   speed          = speed_ladder (420 s) + speed_bert (70 s)
#   speed_ladder   GPT-2 small ladder (LADDER_ROWS=a,b,... picks rows) to its best combination: eager, compile (padded vocabulary), compiled
#                  loss, Liger loss, compiled optimizer step, CUDA graphs over forward/backward/optimizer,
#                  fp8 (tensorwise), regional compile, then --best (the options
#                  that beat the compiled row, combined). Rows that would overrun the budget are left out
#                  and said so (150 s held eager, compile and --best on an H200). target: >= 460,000 tokens/s
#   speed_bert     BERT-large's fastest row (bf16, fused AdamW, compiled model and loss, largest micro-batch)
#                  beside vanilla. target: >= 315 samples/s
#   peers_WORKLOAD scripts/bench_peers.py, one workload each (gpt2 200 s, qlora 200 s, pretrain 360 s, dpo 240 s) into
#                  OUT/peers/ (peers.md, peers.json; rows merge as they finish; a row its part's budget leaves
#                  out is written as not run). The GPT-2 job's shapes are the ladder's (micro-batch 8), so
#                  looplib's row reuses the ladder's compiled kernels (cache) when both run in one call.
# and issue 15's (speed to the limit; not in the default list, name them):
#   speed_mfu      GPT-2 small ladder, part 1: eager -> padded vocab -> compile -> loss compiled -> chunked loss
#                  target: >= 460,000 tokens/s in the best row (bench_mfu.py; rows written as they finish)
#   speed_mfu2     part 2: Liger loss, max-autotune, CUDA graphs, largest micro-batch (auto), fp8
#   speed_loss     chunked / Liger / plain loss + backward at 8192 tokens x 50,257 (memory, time, agreement)
#   speed_guides   BERT-large: vanilla, fused, bf16, 8-bit Adam (bitsandbytes with and without the per-step
#                  inf/NaN sync; torchao's compiled AdamW8bit), and the fastest configuration looplib finds (bf16, fused, compiled model and
#                  loss, batch_size=auto with global batch 32).
#                  targets: fastest >= 315 samples/s; adam8bit >= 0.95x fused (same batch 4)
#   speed_guides2  BERT-large, batch 4: bf16 + fused + compile, + CUDA graphs, fp8 + compile
#   speed_overhead overhead vs the hand-written loop, bf16, 5 pairs, tiny and default models.
#                  target: <= 1.01x median step, 0 syncs on non-logging steps
#   speed_profile  torch.profiler traces of one GPT-2 small step, eager and best-known compiled
#   speed_tests    the GPU tests of issue 15's options (fp8 and CUDA graphs run, chunked loss in bf16)
# and issue 29's (fitting the bigger model; not in the default list, name them):
#   memory_qlora   a Llama-3-8B-shaped model from its config (random weights), +peft=qlora, sequence 2048,
#                  batch 1, bf16, block checkpointing, under a 16 GiB cap (set_per_process_memory_fraction)
#                  target: it fits; the planner's peak within 5% of the allocator's (bench_fit.py)
#   memory_activations  GPT-2 small, bf16, batch 8: none, blocks, selective, offload (side-stream copies and
#                  synchronous ones): memory and speed, each beside the planner's figures
#   memory_tests   the GPU tests of issue 29 (offload on CUDA trains as none does, QLoRA quantises on the device)
# and issue 36's (the bigger model, sharded, and checkpoints in the background; not in the default list, name them):
#   memory_qlora_fsdp  the memory_qlora job as it is and under +engine=fsdp as one process of torchrun (the 4-bit
#                  base in FSDP2's float shards), side by side. target: the FSDP2 row's peak within 5% of the
#                  plain row's and of its own per-rank plan (bench_fit.py; the table's last line is the ratio)
#   checkpoint_stall  a ~1B GPT (fp32 weights and AdamW moments: ~13 GB per checkpoint), bf16 compute: the
#                  training time lost to each checkpoint, synchronous against checkpoint.async (staged into
#                  pinned host memory), interleaved in one run; first the GPU test of the pinned copy.
#                  target: the asynchronous stall <= 0.2x the synchronous one (bench_checkpoint.py). Needs
#                  ~30 GB of free disk under CKPT_DIR (default: RESULTS_DIR) and ~30 GB of host memory.
# and issue 35's (the time to a loss; not in the default list, name it):
#   time_to_loss   GPT-2 small (sequence 512, batch 16, bf16) on a local Python corpus: steps and seconds to the
#                  validation loss AdamW + cosine reaches at its last step, Muon + wsd beside it, each at the
#                  better of two lrs (bench_time_to_loss.py; its --tiny runs this command line on a CPU in CI).
#                  target: Muon + wsd <= 0.8x the steps and <= 0.85x the seconds
# AFTER_PART, if set, is run after each part (e.g. to copy the results off the machine).
# Each part writes RESULTS_DIR/PART.log and its benchmark's md/json/png under RESULTS_DIR/PART/,
# and runs under its own time limit (seconds, LIMIT_<PART> overrides), so one part that fails or
# hangs costs only itself. Optional packages missing on the machine (bitsandbytes, deepspeed,
# lightning, transformers) turn the rows that need them into rows that say so.
set -u
results=${1:?usage: bash scripts/gpu_figures.sh RESULTS_DIR [PART ...]}
shift
all="check mfu overhead tests guides guides_compile tests_ds engines speed_options"
parts=${*:-$all}
mkdir -p "$results"
results=$(cd "$results" && pwd)
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore MAX_JOBS=${MAX_JOBS:-16}
if [ -z "${CUDA_HOME:-}" ] && command -v nvcc >/dev/null; then  # DeepSpeed builds its CPU Adam at first use
    CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc)")")
    export CUDA_HOME
fi
py=${PYTHON:-python3}
# A fresh GPU machine (docs/testing.md): WHEELS=DIR installs the wheels of scripts/gpu_wheels.sh into
# /tmp/site (no network needed); looplib runs from this checkout (its conf/ as looplib.conf, as the
# installed package has it, when no install provides it).
if [ -n "${WHEELS:-}" ] && [ -z "${DRY:-}" ]; then
    $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} || exit 1
fi
if [ -z "${DRY:-}" ] && ! $py -c "import importlib.resources as r; r.files('looplib.conf')" 2>/dev/null; then
    ln -sfn ../conf looplib/conf
fi
# Without an installed looplib the checkout itself must be on the path: `python3 scripts/X.py` puts scripts/ first,
# not the working directory, and a test's torchrun ranks start in other directories (2026-11-28 on an H200:
# speed_bert's Hydra compose found no looplib.conf, and the torchrun tests no looplib, until this was set).
if [ -z "${DRY:-}" ] && ! (cd / && $py -c "import looplib" 2>/dev/null); then
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
planned=0
limit() { local var="LIMIT_${1^^}"; echo "${!var:-$2}"; }  # limit NAME DEFAULT: a part's seconds (LIMIT_<NAME>)

part() {  # part NAME DEFAULT_LIMIT COMMAND...   (DRY=1: print the part's limit and command only)
    local name=$1 limit=$2 var="LIMIT_${1^^}"
    shift 2
    limit=${!var:-$limit}
    planned=$((planned + limit))
    if [ -n "${DRY:-}" ]; then echo "part $name ${limit}s: $*"; return; fi
    echo "=== $name: start $(date +%T), limit ${limit}s"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >"$results/$name.log" 2>&1
    local rc=$?
    echo "=== $name: rc=$rc after $((SECONDS - t0))s"
    tail -n "${TAIL:-25}" "$results/$name.log"
    if [ -n "${AFTER_PART:-}" ]; then eval "$AFTER_PART"; fi
}

for p in $parts; do
    case $p in
    check) part check 120 bash -c "nvidia-smi; $py -c 'import torch, sys; print(sys.version); \
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))'; \
for m in bitsandbytes deepspeed hydra omegaconf transformers accelerate lightning pynvml; do \
$py -c \"import \$m; print('\$m', getattr(\$m, '__version__', 'ok'))\" 2>&1 | tail -n 1; done; \
rm -rf $results/check_run && $py -m looplib.train +precision=bf16 +optim=adam8bit max_steps=60 eval_every=30 progress=lines \
hydra.run.dir=$results/check_run && $py -m looplib.plan model=bert_large data=classification \
loss=classification batch_size=4 +precision=fp16 +optim=adam8bit" ;;
    tests) part tests 300 $py -m pytest -q -rs -p no:cacheprovider \
        tests/unit/test_loop_reference.py::test_loop_matches_reference_on_cuda \
        tests/cli/test_plan.py::test_plan_against_the_allocator_peak_on_a_gpu \
        tests/unit/test_telemetry_memory.py::test_gpu_rows_hold_nvml_memory \
        tests/cli/test_bench_guides.py::test_mfu_gpu_eager_row \
        tests/dist/test_engines_ddp.py::test_torchrun_on_cuda_uses_nccl -s ;;
    tests_ds) part tests_ds 240 $py -m pytest -q -rs -p no:cacheprovider \
        tests/dist/test_engines_deepspeed.py::test_cuda_offload_runs_and_tracks_the_local_engine ;;
    mfu) part mfu 240 $py scripts/bench_mfu.py --out "$results/mfu" ;;
    overhead) part overhead 300 $py scripts/bench_overhead.py --device cuda --precision bf16 --pairs 3 \
        --steps 150 --warmup 10 --out "$results/overhead" ;;
    guides) part guides 560 $py scripts/bench_guides.py \
        --rows vanilla,accumulation,checkpointing,fp16,fp16_all,adafactor,adafactor_all,adam8bit,adam8bit_all,bf16,tf32,fused,zero2_offload \
        --out "$results/guides" ;;
    guides_compile) part guides_compile 300 $py scripts/bench_guides.py --rows vanilla,compile \
        --out "$results/guides_compile" ;;
    engines) part engines 300 $py scripts/bench_engines.py --steps 30 --out "$results/engines" ;;
    speed_options) part speed_options 300 $py scripts/bench_speed.py ;;
    speed) l=$(limit speed_ladder 420); part speed_ladder "$l" $py scripts/bench_mfu.py --steps 12 --warmup 6 --best \
            --budget-s $((l - 15)) \
            --rows "${LADDER_ROWS:-eager,compile,compile_loss,liger,compile_optimizer,graphs_step,fp8,regional}" \
            --out "$results/speed_ladder"
        part speed_bert 70 $py scripts/bench_guides.py --rows fastest --trainer-rows none --steps 16 \
            --out "$results/speed_bert" ;;
    peers|peers_gpt2|peers_pretrain|peers_qlora|peers_dpo)
        [ "$p" = peers ] && ws="gpt2:200 qlora:200 pretrain:360" || ws=$(grep -o "${p#peers_}:[0-9]*" <<<"gpt2:200 qlora:200 pretrain:360 dpo:240")
        for w in $ws; do
            l=$(limit "peers_${w%:*}" "${w#*:}")
            part "peers_${w%:*}" "$l" $py scripts/bench_peers.py --workloads "${w%:*}" --budget-s $((l - 10)) \
                --out "$results/peers"
        done ;;
    speed_mfu) part speed_mfu 560 $py scripts/bench_mfu.py --rows eager,pad_vocab,compile,compile_loss,chunked \
        --out "$results/speed_mfu" ;;
    speed_mfu2) part speed_mfu2 560 $py scripts/bench_mfu.py --rows compile,liger,max_autotune,reduce_overhead,batch_auto,fp8 \
        --out "$results/speed_mfu2" ;;
    speed_loss) part speed_loss 240 $py scripts/bench_loss.py --device cuda --tokens 8192 --dtype bf16 --repeats 5 \
        --out "$results/speed_loss" ;;
    speed_guides) part speed_guides 560 $py scripts/bench_guides.py \
        --rows vanilla,fused,adam8bit,adam8bit_nosync,adam8bit_ao,bf16,fastest --trainer-rows none \
        --out "$results/speed_guides" ;;
    speed_guides2) part speed_guides2 560 $py scripts/bench_guides.py --rows vanilla,bf16_compile,cuda_graphs,fp8 \
        --trainer-rows bf16_compile --out "$results/speed_guides2" ;;
    speed_overhead) part speed_overhead 560 $py scripts/bench_overhead.py --device cuda --precision bf16 --pairs 5 \
        --models tiny,default --steps 150 --warmup 10 --out "$results/speed_overhead" ;;
    speed_profile) part speed_profile 400 bash -c "$py scripts/profile_step.py --out $results/speed_profile/eager \
-- model=gpt2_small data=random data.vocab_size=50257 batch_size=8 +precision=bf16 +optim=adamw optim.impl=fused; \
$py scripts/profile_step.py --out $results/speed_profile/compiled -- model=gpt2_small data=random \
data.vocab_size=50257 batch_size=8 +precision=bf16 +optim=adamw optim.impl=fused model.pad_vocab_to=64 \
+compile=default compile.loss=true" ;;
    speed_tests) part speed_tests 400 $py -m pytest -q -rs -p no:cacheprovider tests/unit/test_speed.py -k gpu ;;
    memory_qlora) part memory_qlora 560 $py scripts/bench_fit.py --rows qlora8b --steps 6 --out "$results/memory_qlora" ;;
    memory_activations) part memory_activations 400 $py scripts/bench_fit.py \
        --rows none,blocks,selective,offload,offload_sync --steps 20 --out "$results/memory_activations" ;;
    memory_qlora_fsdp) part memory_qlora_fsdp 420 $py scripts/bench_fit.py --rows qlora8b,qlora8b_fsdp --steps 6 \
        --out "$results/memory_qlora_fsdp" ;;
    memory_tests) part memory_tests 240 $py -m pytest -q -rs -s -p no:cacheprovider \
        tests/unit/test_activation_memory.py tests/unit/test_qlora_unit.py -k cuda ;;
    checkpoint_stall) part checkpoint_stall 560 bash -c "$py -m pytest -q -rs -p no:cacheprovider \
tests/unit/test_async_checkpoint.py -k cuda && $py scripts/bench_checkpoint.py --size 1b --device cuda --repeats 2 \
--dir ${CKPT_DIR:-$results} --out $results/checkpoint_stall" ;;
    time_to_loss) part time_to_loss 560 $py scripts/bench_time_to_loss.py --jobs gpt2 --recipes adamw+cosine,muon+wsd \
        --lrs 1e-3,3e-3 --seeds 1 --eval-every 20 --threads 8 --out "$results/time_to_loss" ;;
    *) echo "unknown part $p (choose from: $all speed peers peers_gpt2 peers_qlora peers_pretrain peers_dpo speed_mfu speed_mfu2 speed_loss speed_guides \
speed_overhead speed_guides2 speed_profile speed_tests memory_qlora memory_activations memory_tests \
memory_qlora_fsdp checkpoint_stall time_to_loss)"; exit 2 ;;
    esac
done
echo "=== limits of the parts run: ${planned}s in all"
