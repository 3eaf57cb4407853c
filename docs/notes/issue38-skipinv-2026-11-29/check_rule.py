"""Unit check of cf6.py's rule against vLLM 0.30's is_mamba_prefill_checkpoint_valid, no replay:
on a grid of chunk starts/ends (block 1,088, prefix-match unit 64, alignment 64, and unit 1,088),
the rule answers as vLLM does everywhere but where vLLM fails the column clause alone, and there
it answers True; with the rule off it answers as vLLM does everywhere.

    PYTHONPATH=. /work/main/.venv/bin/python docs/notes/issue38-skipinv-2026-11-29/check_rule.py
"""
import os, sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import cf6
from vllm.v1.kv_cache_interface import (get_mamba_prefill_checkpoint_position,
                                        is_mamba_prefill_checkpoint_valid as vllm_valid)

B = 1088
seen = Counter()
for hbs in (64, B):
    for skip in (False, True):
        cf6.skip = skip
        cf6.SEEN_ASK.clear()
        cf6.FLIPPED.clear()
        for start in range(0, 4 * B, 64):
            for end in range(start + 1, start + 3 * B, 7):
                cp = get_mamba_prefill_checkpoint_position(end, hbs, False)
                kw = dict(query_start=start, query_end=end, checkpoint_position=cp,
                          hash_block_size=hbs, mamba_block_size=B, checkpoint_alignment=64)
                v, r = vllm_valid(**kw), cf6.valid(**kw)
                why = cf6.first_failing(start, end, cp, hbs, B, 64)
                assert (why == "valid") == v, (kw, why, v)
                col_only = cf6.only_column(start, end, cp, hbs, B, 64)
                if col_only:
                    assert why == "one_column" and not v, kw
                    # the other four clauses hold: the column one alone fails
                    assert start % hbs == 0 and start + hbs <= cp and start < cp < end
                    assert (cp - start) % 64 == 0
                assert r == (v or (skip and col_only)), (kw, v, r, skip, col_only)
                seen[(hbs, skip, "flip" if r != v else "same")] += 1
print(dict(seen))
# the flips at the prefix-match unit 64: cold prompts up to a block, and hits leaving at most a block
cf6.skip = True
for start, end, expect in ((0, 1000, True), (0, 1088, True), (0, 1089, False), (1088, 2000, True),
                           (1088, 2176, True), (1088, 2177, False), (1152, 3000, True),
                           (1152, 3265, False), (1024, 1100, True), (0, 64, False)):
    cp = get_mamba_prefill_checkpoint_position(end, 64, False)
    kw = dict(query_start=start, query_end=end, checkpoint_position=cp, hash_block_size=64,
              mamba_block_size=B, checkpoint_alignment=64)
    got = cf6.valid(**kw) and not vllm_valid(**kw)
    print(f"start {start} end {end} cp {cp}: vLLM {vllm_valid(**kw)}, flipped {got}")
    assert got == expect, (start, end)
print("ok")
