"""Issue 38, `skipinv` counterfactual (lab only; not a runtime capability): cf5.py
(../issue38-item3-cuda-2026-11-29) run unchanged, with vLLM's align-mode split told to keep a
prompt's final chunk whole where its prefill checkpoint is invalid ONLY by the column clause of
`is_mamba_prefill_checkpoint_valid` (`checkpoint_col > initial_state_col`), and no checkpoint
planned for it.

    PYTHONPATH=. /work/main/.venv/bin/python docs/notes/issue38-skipinv-2026-11-29/cf6.py \
        MODE POLICY PART [KV_GIB HOST_GIB]
    # MODE: plain | skipinv | two_notail+skipinv | (any cf5 mode)[+skipinv]
    #       plain: cf5.py's plain, passed through (the wrapper's observers only)
    #       skipinv: plain + the rule below; X+skipinv: cf5's mode X + the rule
    # POLICY, PART, KV_GIB, HOST_GIB: cf5.py's (HOST_GIB 0: no host tier, no connector)

The rule. vLLM 0.30's `Scheduler._mamba_block_aligned_split` asks
`is_mamba_prefill_checkpoint_valid` (the name imported into vllm.v1.core.sched.scheduler) only
for a chunk that reaches the prefill's end; where it answers True the split drops its
block-aligned stops (`use_internal_checkpoint`: no next-block stop after a mid-block start, no
`last_cache_position`, no `tail_boundary`; a junction stop stays). Here the scheduler module's
name is rebound to a function that also answers True where every clause holds but
`cdiv(query_end, B) - 2 > (query_start - 1) // B`. So the split keeps that chunk whole, through
vLLM's own code path.

The KV-cache manager is left alone. `MambaManager._needs_internal_checkpoint`
(vllm/v1/core/single_type_kv_cache_manager.py) imports the function under its own name and still
gets vLLM's answer. For these chunks that is False, so `get_num_blocks_to_allocate` plans no
checkpoint (`_checkpoints` popped, no checkpoint block), and `_cache_partial_tail_block` (also as
wrapped by the runtime's retention entry, which only reads `_checkpoints`) takes vLLM's no-
checkpoint branch. That branch keys a sub-block state only at num_tokens == the prompt's last
hash boundary, and only in the running block at column num_tokens // B. The runtime's junction
rule (`JunctionRule.decide`) also reads vLLM's own function from kv_cache_interface, so it plans
nothing either.

Observers (no answer changes), added to cf5's JSON line under "skipinv":
* flipped: unique (request, chunk start) where the rule answered True and vLLM would not,
  split by start (cold start=0, a hit on the block grid, a hit mid-block);
  split_whole / split_cut: of the flipped split calls, those vLLM then returned whole or cut
  (at a junction);
* first_failing_clause: for every final-chunk ask, the first clause of vLLM's function that fails
  (diag_ckinv.py's names), or `valid`;
* keys: every GDN key present on the request's Mamba blocks after `MambaManager.cache_blocks`
  ran for a flipped chunk (start < num_tokens <= the chunk's end), per group and block, once.
  Classes:
  - prefix: keyed at or below the chunk start, i.e. the hit it started from;
  - running_at_end: the running-state block (column cdiv(end, B) - 1) keyed at the chunk's
    end, i.e. the state the step leaves there;
  - crossed: the initial state's block (column start // B) keyed at its boundary after a
    mid-block start; CUDA's one pass writes that state there (core.junction_columns);
  - crossed_at_cp: crossed, and that boundary is also the prompt's checkpoint position;
  - at_cp: keyed at the checkpoint position otherwise (should be 0);
  - other: anything else (should be 0).
"""
import json, os, runpy, sys
from collections import Counter

import vllm.v1.core.sched.scheduler as S
from vllm.utils.math_utils import cdiv

mode = base = ""
skip = False
orig_valid = S.is_mamba_prefill_checkpoint_valid
orig_split = S.Scheduler._mamba_block_aligned_split
FLIPPED: set = set()
FLIP_START = Counter()
CLAUSE = Counter()
SEEN_ASK: set = set()
SPLIT = Counter()
KEYS = Counter()
CUR: dict = {}  # request id -> (start, end, cp) of its flipped chunk in progress
SEEN_KEY: set = set()
_in_call = []


def first_failing(qs, qe, cp, hbs, B, align):
    if align is None:
        return "no_alignment"
    if qs % hbs:
        return "start_off_hash"
    if not cdiv(qe, B) - 2 > (qs - 1) // B:
        return "one_column"
    if not qs + hbs <= cp:
        return "cp_within_unit"
    if not qs < cp < qe:
        return "cp_outside"
    if (cp - qs) % align:
        return "off_alignment"
    return "valid"


def only_column(qs, qe, cp, hbs, B, align):
    return (align is not None and qs % hbs == 0 and not cdiv(qe, B) - 2 > (qs - 1) // B
            and qs + hbs <= cp and qs < cp < qe and (cp - qs) % align == 0)


def valid(query_start, query_end, checkpoint_position, hash_block_size, mamba_block_size,
          checkpoint_alignment):
    ok = orig_valid(query_start=query_start, query_end=query_end,
                    checkpoint_position=checkpoint_position, hash_block_size=hash_block_size,
                    mamba_block_size=mamba_block_size, checkpoint_alignment=checkpoint_alignment)
    req = sys._getframe(1).f_locals.get("request")
    rid = getattr(req, "request_id", None)
    args = (query_start, query_end, checkpoint_position, hash_block_size, mamba_block_size,
            checkpoint_alignment)
    if (rid, query_start) not in SEEN_ASK:
        SEEN_ASK.add((rid, query_start))
        CLAUSE[first_failing(*args)] += 1
    if ok or not skip or not only_column(*args):
        return ok
    if (rid, query_start) not in FLIPPED:
        FLIPPED.add((rid, query_start))
        B = mamba_block_size
        FLIP_START["cold" if query_start == 0 else
                   "hit_on_block" if query_start % B == 0 else "hit_mid_block"] += 1
    if _in_call:
        _in_call[-1]["flip"] = (query_start, checkpoint_position)
    return True


def split(self, request, num_new_tokens, num_new_local_computed_tokens=0,
          num_external_computed_tokens=0):
    _in_call.append({})
    try:
        n = orig_split(self, request, num_new_tokens, num_new_local_computed_tokens,
                       num_external_computed_tokens)
    finally:
        call = _in_call.pop()
    rid = request.request_id
    if "flip" in call:
        start, cp = call["flip"]
        SPLIT["split_whole" if n >= num_new_tokens else "split_cut"] += 1
        CUR[rid] = (start, start + n, cp)
    else:
        CUR.pop(rid, None)
    return n


def main():
    global mode, base, skip
    mode = sys.argv[1]
    skip = mode == "skipinv" or mode.endswith("+skipinv")
    base = "plain" if mode == "skipinv" else mode.removesuffix("+skipinv")
    S.is_mamba_prefill_checkpoint_valid = valid
    S.Scheduler._mamba_block_aligned_split = split

    from vllm.v1.core.single_type_kv_cache_manager import MambaManager

    orig_cache = MambaManager.cache_blocks


    def cache_blocks(self, request, num_tokens, retention_interval=None, *, replay_boundaries):
        orig_cache(self, request, num_tokens, retention_interval=retention_interval,
                   replay_boundaries=replay_boundaries)
        f = CUR.get(request.request_id)
        if f is None or self.mamba_cache_mode != "align":
            return
        start, end, cp = f
        if not start < num_tokens <= end:
            return
        B = self.block_size
        for c, blk in enumerate(self.req_to_blocks.get(request.request_id, [])):
            if blk.is_null or blk.block_hash is None:
                continue
            t = blk.block_hash_num_tokens
            key = (request.request_id, self.kv_cache_group_id, c, t, blk.block_id)
            if key in SEEN_KEY:
                continue
            SEEN_KEY.add(key)
            if t is None:
                cls = "other"
            elif t <= start:
                cls = "prefix"
            elif c == cdiv(num_tokens, B) - 1 and t == num_tokens:
                cls = "running_at_end"
            elif start % B and c == start // B and t == (c + 1) * B and t < num_tokens:
                cls = "crossed_at_cp" if t == cp else "crossed"
            elif t == cp:
                cls = "at_cp"
            else:
                cls = "other"
            KEYS[f"g{self.kv_cache_group_id}:{cls}"] += 1


    MambaManager.cache_blocks = cache_blocks

    import builtins
    _print = builtins.print


    def _p(*a, **k):  # add the counts to cf5's JSON line
        if a and isinstance(a[0], str) and a[0].startswith("{"):
            d = json.loads(a[0])
            d["mode"] = mode
            d["base_mode"] = base
            d["skipinv"] = {"on": skip, "flipped": len(FLIPPED), "flipped_by_start": dict(FLIP_START),
                            **dict(SPLIT), "first_failing_clause": dict(CLAUSE),
                            "keys": dict(sorted(KEYS.items()))}
            d["cf6_path"] = os.path.abspath(__file__)
            a = (json.dumps(d),) + a[1:]
        return _print(*a, **k)


    builtins.print = _p
    here = os.path.dirname(os.path.abspath(__file__))
    cf5 = os.path.join(here, "..", "issue38-item3-cuda-2026-11-29", "cf5.py")
    sys.argv = [cf5, base] + sys.argv[2:]
    runpy.run_path(cf5, run_name="__main__")


if __name__ == "__main__":
    main()
