#!/usr/bin/env bash
# Set up ./.venv (first run only) and run the main job, `dsv4 generate`, on the built-in demo model: a tiny
# random DeepSeek-V4 with the real tokenizer, stored in NVFP4, written to $DSV4_CACHE (default
# ~/.cache/dsv4) on first use. Its weights are random, so the streamed text is gibberish.
source "$(dirname "$0")/env.sh" ""   # no extras (an explicit argument: sourcing keeps the caller's "$@" otherwise)
dsv4 generate --model demo "DeepSeek-V4 is" --max-tokens 48 --seed 0 "$@"
