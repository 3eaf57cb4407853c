"""Diagnostic: log, for requests 0 and 4 of the check part, each MambaManager.cache_blocks call of
the first GDN group (tokens after the step, computed before, boundaries offered to the host in
blocks, live state blocks and the boundary each is hashed at); then count_states.py's JSON.
usage: PYTHONPATH=/work/wt-h15 python trace_req.py TRACE POLICY [--block-size B] --limit 6"""
import sys, json
sys.argv = [sys.argv[0]] + sys.argv[1:]
from vllm.v1.core.single_type_kv_cache_manager import MambaManager
orig = MambaManager.cache_blocks
WATCH = {"0", "4"}
log = []
def cache_blocks(self, request, num_tokens, *a, **kw):
    pend = getattr(self, "_pending_boundary_state_offloads", [])
    n0 = len(pend)
    out = orig(self, request, num_tokens, *a, **kw)
    if request.request_id in WATCH and self.kv_cache_group_id == 0:
        new = [e[3] // self.block_size for e in self._pending_boundary_state_offloads[n0:]]
        blocks = self.req_to_blocks[request.request_id]
        live = [i for i, b in enumerate(blocks) if not b.is_null]
        log.append((request.request_id, num_tokens, request.num_computed_tokens, new, live,
                    [(i, b.block_hash_num_tokens // self.block_size if b.block_hash_num_tokens else None) for i, b in enumerate(blocks) if not b.is_null]))
    return out
MambaManager.cache_blocks = cache_blocks
import runpy
sys.argv = ["count_states.py"] + sys.argv[1:]
try:
    runpy.run_path("count_states.py", run_name="__main__")
finally:
    for l in log: print("LOG", l)
