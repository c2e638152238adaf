#!/usr/bin/env bash
# Reproduce the bundled SmolLM2-135M-Instruct drafter (jaxspec/drafters/smollm2-135m-instruct) and benchmark it.
#   bash scripts/train_smollm2_drafter.sh [WORK_DIR] [--regenerate]
# By default it trains on all the self-distillation data kept in data/smollm2-135m-instruct (16813 answers of
# SmolLM2, 1.96M answer tokens, to the `train`, `train2` and `selfinstruct`..`selfinstruct4` prompts).
# --regenerate first makes that data again into WORK_DIR/data with the same commands (about 5.5 hours on the
# 2-core VM, minutes on a GPU). On the 2-core VM: taps + soft labels over 2 hours (a 28 GB file in WORK_DIR),
# training 4000 steps about 1h50. Rerunning resumes: the taps cache and Orbax checkpoints live in WORK_DIR.
set -euo pipefail
WORK=${1:-runs/smollm2}
OUT=jaxspec/drafters/smollm2-135m-instruct
DATA=data/smollm2-135m-instruct
REGENERATE=${2:-}
if [[ "$REGENERATE" == "--regenerate" ]]; then DATA="$WORK/data"; mkdir -p "$DATA"; fi

# The shipped drafter's data, in this order (it fixes which rows each step draws), each part with the command
# that makes it (run only with --regenerate, for a part not made yet). A part added to $DATA later is not read
# until named here.
FILES=()
part() {
    FILES+=("$DATA/$1.npz")
    if [[ "$REGENERATE" == "--regenerate" && ! -f "$DATA/$1.npz" ]]; then
        python -m jaxspec.train.distill --batch 64 --out "$DATA/$1.npz" "${@:2}"
    fi
}
part train.s0-1 --prompts train --samples 2
part selfinstruct.s0-1 --prompts selfinstruct --samples 2
part train.s2 --prompts train --first-sample 2 --samples 1
part selfinstruct.s2 --prompts selfinstruct --first-sample 2 --samples 1
part selfinstruct2.s0-3 --prompts selfinstruct2 --samples 4
part selfinstruct3.s0-1 --prompts selfinstruct3 --samples 2
part selfinstruct3.s2-3 --prompts selfinstruct3 --first-sample 2 --samples 2
part selfinstruct.s3-4 --prompts selfinstruct --first-sample 3 --samples 2
part selfinstruct3.s4 --prompts selfinstruct3 --first-sample 4 --samples 1
part train.s3-4 --prompts train --first-sample 3 --samples 2
part selfinstruct2.s4-7 --prompts selfinstruct2 --first-sample 4 --samples 4
part selfinstruct4.s0 --prompts selfinstruct4 --samples 1
part train2.s0-3 --prompts train2 --samples 4

# 2 layers reading target layers 1, 14, 27, blocks of 8 (depths past 7 are never reached on CPU budgets),
# an 8192-token draft vocabulary; the loss mixes the data's tokens and the target's own top-8 distribution
# (--soft-weight 0.5). The parameters of the best held-out evaluation (the last 8 held-out prompts) are exported.
python -m jaxspec.train --out "$OUT" --work "$WORK" --no-prompts \
    --data "${FILES[@]}" \
    --num-layers 2 --block-size 8 --gamma 4 --draft-vocab 8192 --soft-weight 0.5 \
    --steps 4000 --batch 8 --anchors 32 --lr 6e-4 \
    --eval-every 500 --eval-prompts 8 --patience 3 --ckpt-every 250 --save-dtype bfloat16

# held-out benchmark (the first 8 held-out prompts); writes $OUT/acceptance.json, the acceptance table budget="auto" reads
python bench/spec.py --drafter "$OUT" --budgets 2,4,8,10,12,16,32,64 --prompts 8 --save-acceptance
