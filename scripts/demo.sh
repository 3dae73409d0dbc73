#!/usr/bin/env bash
# Set up ./.venv (first run only) and run dsv4 on its built-in demo model: write a tiny random V4
# checkpoint, convert it to NVFP4, and inspect the result.
source "$(dirname "$0")/env.sh"
demo="${DSV4_DEMO_DIR:-.cache/demo}"
dsv4 make-tiny "$demo/bf16" --seed 0
dsv4 convert "$demo/bf16" "$demo/nvfp4" --format nvfp4 --naming deepseek
dsv4 inspect "$demo/nvfp4"
