#!/usr/bin/env bash
# Train the hybrid GDN pair in bench/models/qwen3_5-stdlib from scratch, then sweep the DDTree budget on it.
#   1. a qwen3_5_text target (8 layers: GDN x3 + gated attention, twice; hidden 256) pretrained on the
#      Python standard library (scripts/pretrain_hybrid.py; 1 file in 20 held out);
#   2. a DFlash drafter for it, trained by `python -m jaxspec.train` on the target's own answers to 512
#      training-file prompts (one greedy, one sampled) and on 300k tokens of training text;
#   3. bench/budget_sweep.py --pair: acceptance and tokens/s vs budget, exact vs leaky GDN verification.
# On the 2-core development VM: target ~45 min, drafter ~30 min, sweep ~10 min. Rerunning resumes from
# the Orbax checkpoints and data caches in $WORK.
#   bash scripts/train_hybrid_pair.sh [WORK_DIR]
set -euo pipefail
WORK=${1:-runs/hybrid}
PAIR=bench/models/qwen3_5-stdlib

python scripts/pretrain_hybrid.py --out "$PAIR/target" --work "$WORK/work"

mapfile -t TEXT < "$WORK/work/text_files.txt"
python -m jaxspec.train --model "$PAIR/target" --out "$PAIR/drafter" --work "$WORK/drafter" \
    --prompts "$WORK/work/train_prompts.jsonl" --samples 2 --gen-batch 64 --text "${TEXT[@]}" \
    --heldout "$PAIR/target/heldout.jsonl" --eval-prompts 4 --eval-every 500 \
    --num-layers 2 --block-size 16 --draft-vocab 0 \
    --steps 1000 --batch 8 --anchors 32 --lr 6e-4 --gamma 7 --ckpt-every 250 --save-dtype bfloat16

python bench/budget_sweep.py --pair "$PAIR" --prompts 8
