"""Which clause of vLLM's is_mamba_prefill_checkpoint_valid fails where the split asks it (the
prompt's final chunk: `checkpoint_invalid` in the lab's step reasons), under cf5.py's replay.
Observation only: the scheduler's name is wrapped, every answer is passed on unchanged.

    PYTHONPATH=. /work/main/.venv/bin/python docs/notes/issue38-item3-cuda-2026-11-29/diag_ckinv.py \
        MODE POLICY PART [KV_GIB HOST_GIB]      # cf5.py's arguments; prints cf5's JSON line with
                                                # a "ckinv" object added
Clauses, in vLLM 0.30's order (the first failing one is counted per request and chunk start):
  start_off_hash   query_start % hash_block_size != 0
  one_column       cdiv(query_end, B) - 2 <= (query_start - 1) // B: the checkpoint's block
                   column is not past the initial state's (the final chunk ends within the block
                   after the one holding its start)
  cp_within_unit   query_start + hash_block_size > checkpoint_position
  cp_outside       not query_start < checkpoint_position < query_end
  off_alignment    (checkpoint_position - query_start) % alignment != 0
"""
import json, os, runpy, sys

import vllm.v1.core.sched.scheduler as S
from vllm.utils.math_utils import cdiv

orig = S.is_mamba_prefill_checkpoint_valid
SEEN: dict = {}
COUNT: dict = {}
SPAN: dict = {}


def wrapped(query_start, query_end, checkpoint_position, hash_block_size, mamba_block_size,
            checkpoint_alignment):
    ok = orig(query_start=query_start, query_end=query_end, checkpoint_position=checkpoint_position,
              hash_block_size=hash_block_size, mamba_block_size=mamba_block_size,
              checkpoint_alignment=checkpoint_alignment)
    req = sys._getframe(1).f_locals.get("request")
    key = (getattr(req, "request_id", None), query_start)
    if key in SEEN:
        return ok
    B = mamba_block_size
    if ok:
        why = "valid"
    elif checkpoint_alignment is None:
        why = "no_alignment"
    elif query_start % hash_block_size:
        why = "start_off_hash"
    elif not cdiv(query_end, B) - 2 > (query_start - 1) // B:
        why = "one_column"
    elif not query_start + hash_block_size <= checkpoint_position:
        why = "cp_within_unit"
    elif not query_start < checkpoint_position < query_end:
        why = "cp_outside"
    else:
        why = "off_alignment"
    SEEN[key] = why
    COUNT[why] = COUNT.get(why, 0) + 1
    if why != "valid":
        b = "start=0" if query_start == 0 else (
            f"remaining<{(query_end - query_start) // B + 1}B" if query_end - query_start < 4 * B
            else "remaining>=4B")
        SPAN[f"{why} {b}"] = SPAN.get(f"{why} {b}", 0) + 1
    return ok


S.is_mamba_prefill_checkpoint_valid = wrapped

import builtins
_print = builtins.print


def _p(*a, **k):  # add the counts to cf5's JSON line
    if a and isinstance(a[0], str) and a[0].startswith("{"):
        d = json.loads(a[0])
        d["ckinv"] = {"first_failing_clause_per_request_start": COUNT, "by_remaining": SPAN}
        a = (json.dumps(d),) + a[1:]
    return _print(*a, **k)


builtins.print = _p
here = os.path.dirname(os.path.abspath(__file__))
sys.argv = [os.path.join(here, "cf5.py")] + sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
