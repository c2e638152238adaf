#!/usr/bin/env bash
# Reproduce the bundled SmolLM2-135M-Instruct drafter from scratch (jaxspec/drafters/smollm2-135m-instruct)
# and benchmark it. On the 2-core development VM: self-distillation ~35 min, taps ~11 min, training ~45 min.
# Rerunning resumes: the data cache and Orbax checkpoints live in $WORK.
#   bash scripts/train_smollm2_drafter.sh [WORK_DIR]
set -euo pipefail
WORK=${1:-runs/smollm2}
OUT=jaxspec/drafters/smollm2-135m-instruct

# 400 written + 1046 self-instruct prompts x 2 answers (1 greedy + 1 sampled at T=0.8), 8192-token draft
# vocabulary, 2 layers reading target layers 1, 14, 27; blocks of 8 (depths past 7 are never reached on CPU
# budgets). The parameters of the best held-out evaluation (the last 8 held-out prompts) are exported.
python -m jaxspec.train --out "$OUT" --work "$WORK" --prompts train selfinstruct --samples 2 --gen-batch 64 \
    --num-layers 2 --block-size 8 --gamma 4 --draft-vocab 8192 \
    --steps 2000 --batch 8 --anchors 32 --lr 6e-4 \
    --eval-every 500 --eval-prompts 8 --patience 2 --ckpt-every 250 --save-dtype bfloat16

# held-out benchmark (the first 8 held-out prompts); writes $OUT/acceptance.json, the acceptance table budget="auto" reads
python bench/spec.py --drafter "$OUT" --budgets 2,4,8,16,32,64 --prompts 8 --save-acceptance
