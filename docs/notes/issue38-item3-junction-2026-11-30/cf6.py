"""cf6 (2026-11-30): cf5.py with two more modes, `junq` and `junq_notail` (the block boundary
below a sub-block prompt checkpoint handed to the runtime's own junction entries as a crossed
position; `_notail`: with cf5's partial-tail drop at the host manager). Below: cf5's docstring.

Issue 38 item 3 counterfactual with CUDA's junction export replayed (lab only; not a runtime
capability). cf4.py (../issue38-item3-final-2026-11-29) with the lab's current replay path and one
more mode.

    PYTHONPATH=. /work/main/.venv/bin/python docs/notes/issue38-item3-cuda-2026-11-29/cf5.py \
        MODE POLICY PART [KV_GIB HOST_GIB]
    # MODE: plain (vLLM + the lab's exporter as installed) or two (cf3's two checkpoints per
    #       row: the state at the prompt's last block boundary L stays cached in the exporter's
    #       checkpoint slot, keyed and offered to the host tier as vLLM's split leaves it, and
    #       the sub-block checkpoint cp goes to a second reserved block, keyed at cp and offered
    #       as the partial tail), or the item-2/3 variants of `two`:
    #       two_devcp  - the second block (cp) is cached on the device but never offered to the
    #                    host tier (partial tails from paths `two` leaves as installed still are)
    #       two_coldcp - as `two`, but the host's LRU puts every partial-tail page (boundary off
    #                    the block grid: the tail's attention page and GDN states, whichever path
    #                    offered it) at the cold end when its store completes
    #       two_notail - as `two`, but no partial-tail page (attention page or GDN state at a
    #                    boundary off the block grid) is ever stored on the host tier: every such
    #                    key is dropped from the host manager's prepare_store, whichever path
    #                    offered it (the connector then sees nothing to store for that job)
    #       (two_strict: cf3's, not used here)
    # POLICY: a lab policy, e.g. upstream:ret=1b,pmu=64,ckpt=final
    # PART: fit (requests 1-1,500 of --limit 3000) or check (1,501-3,000), as advise splits them,
    #       or rest (3,001-3,993, the trace's end; a third slice, at the same rate as the 3,000)

What changed against cf4.py:
* The replay gets advise's --target (default cuda) explicitly, as advise and hitrate pass it
  (`timing["target"]`); vllm_hybrid_npu_lab.replay.replay then binds the runtime's junction
  entries (exporter.apply_junction_entries, the CUDA stop told the one pass writes the crossing)
  wherever replay.junctions_modelled says, as for advise/hitrate since 284e647. cf4 passed no
  target, so at this commit it got the same default; the JSON records target,
  junctions_modelled and whether the rule was bound on the replay's scheduler (junction_rule_on).
* two_notail (above).
* Partial-tail offers by path: every hand-off a Mamba manager queues for the connector
  (`_pending_boundary_state_offloads`) at a boundary off its block grid is counted by the
  function that queued it (file:function), in `tail_offers_by_path` (one entry per GDN group).
* Every run records the lab's module path (it must be this worktree's).

Replays one part of ../shared/data/mooncake_synthetic_trace.jsonl (relative to the repository
root, the working directory) with advise's arrivals, rate and model; prints one JSON line.

Host-page classes (the connector's keys: one page per key; block B = the attention group's
tokens per block): attn_block (attention, boundary on the block grid), attn_tail (attention,
partial tail below a block boundary), gdn_L (GDN state at the request's last block boundary below
its prompt end), gdn_other (GDN state at another block boundary: retention grid, chunk
checkpoint, junction), gdn_tail (GDN state at a sub-block boundary). Per class: pages stored,
evicted, evicted without ever being loaded, and loads.
"""
import argparse, json, sys, time

from vllm_hybrid_npu_lab import advise as A
from vllm_hybrid_npu_lab.host_tier import HostLink
from vllm_hybrid_npu_lab.presets import resolve_model
from vllm_hybrid_npu_lab.trace import read_trace

mode, policy, part = sys.argv[1], sys.argv[2], sys.argv[3]
if part not in ("fit", "check", "rest"):
    raise SystemExit(f"PART must be fit, check or rest, not {part!r}")
kv = sys.argv[4] if len(sys.argv) > 4 else "16"
host = sys.argv[5] if len(sys.argv) > 5 else "256"
p = argparse.ArgumentParser(); A.add_arguments(p)
args = p.parse_args(["--trace", "../shared/data/mooncake_synthetic_trace.jsonl", "--limit", "3000",
                     "--kv-cache-gib", kv, "--host-cache-gib", host])
model_name, cfg = resolve_model(args.model)
requests = read_trace(args.trace, args.limit)
n_fit = min(len(requests) - 1, max(1, round(len(requests) * args.fit_fraction)))
fit = requests[:n_fit] if part == "fit" else requests[n_fit:]  # as advise splits them
offered = A._rate(requests)
rate = args.tokens_per_s or (offered / args.offered_load if offered > 0 else 40000.0)
if part == "rest":  # requests 3,001-3,993 (the trace's end), same rate as the 3,000 above
    requests = read_trace(args.trace, None)
    fit = requests[int(args.limit):]
common = dict(max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
              max_model_len=max(r.input_length + r.output_length for r in requests),
              kernel_block_size=args.kernel_block_size)
timing = dict(step_ms=args.step_ms, tokens_per_s=rate, carry_outputs=not args.no_carry,
              link=HostLink(args.host_link_gbps, args.host_link_latency_us), target=args.target)

stats = {"extra_taken": 0, "extra_cached": 0, "extra_freed_with_slot": 0, "extra_freed_at_free": 0,
         "slot_not_at_block": 0, "no_free_block": 0, "reserve_plus1": 0, "L_off_grid": 0}

TWO_MODES = ("two", "two_strict", "two_devcp", "two_coldcp", "two_notail")
JUNQ_MODES = ("junq", "junq_notail")  # cf6
if mode == "cfg_notail":
    # cf6: vLLM's own branch without partial tails (the one it takes for EAGLE / DCP): the
    # OffloadingConnector scheduler's config built with supports_partial_tail=False (neither
    # stored nor looked up); the rest as installed
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import scheduler as _OSCH

    _orig_from_spec = _OSCH.SchedulerOffloadConfig.from_spec.__func__

    def _from_spec(cls, *a, **k):
        cfg = _orig_from_spec(cls, *a, **k)
        stats["supports_partial_tail_installed"] = cfg.supports_partial_tail
        return cfg._replace(supports_partial_tail=False)

    _OSCH.SchedulerOffloadConfig.from_spec = classmethod(_from_spec)
if mode in TWO_MODES:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm.v1.kv_cache_interface import get_mamba_prefill_checkpoint_position

    PROMPT_LEN: dict[str, int] = {}
    orig_alloc_slots = KVCacheManager.allocate_slots

    def allocate_slots(self, request, *a, **k):
        PROMPT_LEN[request.request_id] = request.num_prompt_tokens
        return orig_alloc_slots(self, request, *a, **k)

    KVCacheManager.allocate_slots = allocate_slots

    def _prompt_ckpt(self, rid):
        """The exporter's checkpoint position of the whole prompt (what the retention fix keeps)."""
        P = PROMPT_LEN.get(rid)
        if P is None:
            return None
        return get_mamba_prefill_checkpoint_position(P, self.block_pool.hash_block_size,
                                                     self.drop_eagle_checkpoint_block)

    def _wants_second(self, rid, num_tokens, total_computed):
        """This chunk exports the prompt's checkpoint and it is off the block grid."""
        if not (self.mamba_cache_mode == "align" and self.has_prefill_checkpoint_blocks):
            return False
        cp = get_mamba_prefill_checkpoint_position(num_tokens, self.block_pool.hash_block_size,
                                                   self.drop_eagle_checkpoint_block)
        if cp <= 0 or cp % self.block_size == 0 or cp != _prompt_ckpt(self, rid):
            return False
        if mode == "two_strict" and (cp // self.block_size * self.block_size - total_computed) % \
                self.kv_cache_spec.prefill_checkpoint_alignment:
            return False
        return self._needs_internal_checkpoint(rid, total_computed, num_tokens, cp)

    orig_gnba = MambaManager.get_num_blocks_to_allocate

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False):
        n = orig_gnba(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                      num_local_computed_tokens, num_tokens_main_model,
                      apply_admission_cap=apply_admission_cap)
        if not apply_admission_cap:
            self._cf_start[request_id] = total_computed_tokens
        if (n <= self.block_pool.num_gpu_blocks and request_id not in self._cf_extra
                and _wants_second(self, request_id, num_tokens_main_model, total_computed_tokens)):
            stats["reserve_plus1"] += 1
            n += 1  # the second checkpoint block, reserved like the first
        return n

    MambaManager.get_num_blocks_to_allocate = get_num_blocks_to_allocate

    orig_anb = MambaManager.allocate_new_blocks

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
        out = orig_anb(self, request_id, num_tokens, num_tokens_main_model)
        ck = self._checkpoints.get(request_id) if self.mamba_cache_mode == "align" else None
        if (ck is not None and request_id not in self._cf_extra
                and ck[0] % self.block_size != 0 and ck[0] == _prompt_ckpt(self, request_id)):
            start = self._cf_start.get(request_id, 0)
            L = ck[0] // self.block_size * self.block_size
            if (L - start) % self.kv_cache_spec.prefill_checkpoint_alignment:
                stats["L_off_grid"] += 1  # the kernels could not write the state at L
                if mode == "two_strict":
                    return out
            if self.block_pool.get_num_free_blocks() < 1:
                stats["no_free_block"] += 1
            else:
                self._cf_extra[request_id] = (self.block_pool.get_new_blocks(1)[0], ck[1])
                stats["extra_taken"] += 1
        return out

    MambaManager.allocate_new_blocks = allocate_new_blocks

    orig_cptb = MambaManager._cache_partial_tail_block

    def _cache_partial_tail_block(self, request, num_tokens, retention_interval):
        rid = request.request_id
        ck = self._checkpoints.get(rid)
        extra = self._cf_extra.get(rid)
        if ck is None or extra is None:
            return orig_cptb(self, request, num_tokens, retention_interval)
        if len(extra) > 2:
            return None  # this prompt's two checkpoints are cached already
        cp, idx = ck
        block = extra[0]
        if (retention_interval == 0 and num_tokens < request.num_prompt_tokens
                and cp != request.shared_prefix_boundary):
            return orig_cptb(self, request, num_tokens, retention_interval)
        slot = self.req_to_blocks[rid][idx]
        L = (idx + 1) * self.block_size
        if slot.is_null or slot.block_hash is None or slot.block_hash_num_tokens != L:
            # the slot is not keyed at the block boundary: keep the exporter's behaviour
            stats["slot_not_at_block"] += 1
            self._cf_extra[rid] = (block, idx, True)
            return orig_cptb(self, request, num_tokens, retention_interval)
        # vLLM's split leaves the state at L in this slot, keyed at L (cache_blocks did that and
        # offered it to the connector as an aligned boundary); the sub-block checkpoint gets the
        # second block, keyed at cp and offered as the partial tail.
        h = self.block_pool.cache_partial_block(request=request, block=block, num_tokens=cp,
                                                kv_cache_group_id=self.kv_cache_group_id,
                                                block_size=self.block_size)
        if h is not None:
            if mode != "two_devcp":  # two_devcp: cp stays on the device only
                self._pending_boundary_state_offloads.append((rid, self.kv_cache_group_id, block, cp))
            stats["extra_cached"] += 1
        self._cf_extra[rid] = (block, idx, True)
        return h

    MambaManager._cache_partial_tail_block = _cache_partial_tail_block

    orig_rsb = MambaManager.remove_skipped_blocks

    def remove_skipped_blocks(self, request_id, processed_computed_tokens, num_prompt_tokens=None):
        orig_rsb(self, request_id, processed_computed_tokens, num_prompt_tokens)
        extra = self._cf_extra.get(request_id)
        if extra is not None:
            blocks = self.req_to_blocks.get(request_id, [])
            idx = extra[1]
            if idx < len(blocks) and blocks[idx].is_null:
                # the checkpoint slot went back to the pool (evictable, still cached): so does
                # the second checkpoint
                self._cf_extra.pop(request_id)
                self.block_pool.free_blocks([extra[0]])
                stats["extra_freed_with_slot"] += 1

    MambaManager.remove_skipped_blocks = remove_skipped_blocks

    orig_pop = MambaManager.pop_blocks_for_free

    def pop_blocks_for_free(self, request_id):
        blocks = orig_pop(self, request_id)
        extra = self._cf_extra.pop(request_id, None)
        if extra is not None:
            stats["extra_freed_at_free"] += 1
            blocks = list(blocks)
            # just after the slot: freed (reverse order) before it, like a tail block
            blocks.insert(min(extra[1] + 1, len(blocks)), extra[0])
        return blocks

    MambaManager.pop_blocks_for_free = pop_blocks_for_free

    orig_init = MambaManager.__init__

    def __init__(self, *a, **k):
        orig_init(self, *a, **k)
        self._cf_extra = {}
        self._cf_start = {}

    MambaManager.__init__ = __init__
elif mode in JUNQ_MODES:
    # cf6: the runtime's own junction entries (vllm_hybrid_npu.patches.gdn_junction) hand the
    # Mamba managers one more position for a chunk whose reserved prompt checkpoint cp lies off
    # the block grid (a prefix-match unit below the block): q = cp // B * B, the block boundary
    # below it, if the chunk crosses it (q > start). The managers put a block in q's column
    # (gdn-junction-count / -blocks, as for a shared-prefix junction), vLLM caches it under the
    # block hash at q, and the OffloadingConnector can offer it at the block grid. Everything else
    # is the runtime's rule as installed.
    from vllm_hybrid_npu.patches import gdn_junction as _GJ

    _orig_crossed = _GJ.JunctionRule.crossed

    def _crossed(self, request, start, end):
        got = _orig_crossed(self, request, start, end)
        if got or self.hash_block == self.block or request.num_tokens > request.num_prompt_tokens:
            return got
        from vllm.v1.kv_cache_interface import (get_mamba_prefill_checkpoint_position,
                                                is_mamba_prefill_checkpoint_valid)
        cp = get_mamba_prefill_checkpoint_position(end, self.hash_block, self.eagle_drop)
        if not cp or cp % self.block == 0 or not is_mamba_prefill_checkpoint_valid(
                query_start=start, query_end=end, checkpoint_position=cp,
                hash_block_size=self.hash_block, mamba_block_size=self.block,
                checkpoint_alignment=self.alignment):
            return 0
        q = cp // self.block * self.block
        if q <= start:
            stats["junq_below_start"] = stats.get("junq_below_start", 0) + 1
            return 0
        stats["junq_handed"] = stats.get("junq_handed", 0) + 1
        return q

    _GJ.JunctionRule.crossed = _crossed
    _orig_log_once = _GJ.gdn._log_once

    def _log_once(key, *a, **k):  # observe only: the manager could not place the block
        stats[f"log_{key}"] = stats.get(f"log_{key}", 0) + 1
        if stats[f"log_{key}"] <= 3:
            stats.setdefault("log_examples", []).append(a[0] % a[1:] if a else key)
        return _orig_log_once(key, *a, **k)

    _GJ.gdn._log_once = _log_once
elif mode not in ("plain", "cfg_notail"):
    raise SystemExit(f"unknown mode {mode!r}")

# Partial-tail offers by path: the Mamba managers' hand-off list for the connector, wrapped so
# that each entry queued at a boundary off the manager's block grid is counted by the function
# that queued it. A data descriptor on the class: the base __init__ and every reassignment
# (take_pending_boundary_state_offloads, pop_blocks_for_free) go through it. No entry changes.
import os as _os
from vllm.v1.core.single_type_kv_cache_manager import MambaManager as _MM
TAIL_OFFERS: dict = {}


class _Offers(list):
    __slots__ = ("mgr",)

    def append(self, entry):
        if entry[3] % self.mgr.block_size:
            f = sys._getframe(1).f_code
            k = f"{_os.path.basename(f.co_filename)}:{f.co_name}"
            TAIL_OFFERS[k] = TAIL_OFFERS.get(k, 0) + 1
        super().append(entry)


def _get_offers(self):
    return self.__dict__["_cf_offers"]


def _set_offers(self, value):
    lst = _Offers(value)
    lst.mgr = self
    self.__dict__["_cf_offers"] = lst


_MM._pending_boundary_state_offloads = property(_get_offers, _set_offers)

import vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler as OS
_SCHED = [c for c in vars(OS).values() if isinstance(c, type) and "_lookup_complete_chunks" in vars(c)][0]
_orig_sinit = _SCHED.__init__
stats.update(host_evicted_keys=0, host_first_evict_req=None, host_store_keys=0, host_store_fail=0,
             host_manager=None)
CLASSES = ("attn_block", "attn_tail", "gdn_L", "gdn_other", "gdn_tail", "unknown")
HC = {f"{w}_{c}": 0 for w in ("stored", "evicted", "evicted_unloaded", "loads") for c in CLASSES}
KEY_CLASS: dict = {}
LOADED: set = set()
HASH_IDX: dict = {}  # req_id -> {block hash: index}


def _sinit(self, *a, **k):
    _orig_sinit(self, *a, **k)
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_offload.base import get_offload_block_hash, get_offload_group_idx
    gdn_groups = {g.group_idx for g in self.config.kv_group_configs
                  if isinstance(getattr(g, "kv_cache_spec", None), MambaSpec)}
    B = self.config.kv_group_configs[0].tokens_per_block
    tph = self.config.tokens_per_hash
    stats.update(host_gdn_groups=sorted(gdn_groups), host_block=B, host_tokens_per_hash=tph)

    def classify(key, req_id):
        rs = self._req_status.get(req_id)
        if rs is None:
            return "unknown"
        req = rs.req
        idx_of = HASH_IDX.get(req_id)
        if idx_of is None or len(idx_of) < len(req.block_hashes):
            idx_of = HASH_IDX[req_id] = {h: i for i, h in enumerate(req.block_hashes)}
        i = idx_of.get(get_offload_block_hash(key))
        if i is None:
            return "unknown"
        boundary = (i + 1) * tph
        gdn = get_offload_group_idx(key) in gdn_groups
        if boundary % B:
            return "gdn_tail" if gdn else "attn_tail"
        if not gdn:
            return "attn_block"
        return "gdn_L" if boundary == (req.num_prompt_tokens - 1) // B * B else "gdn_other"

    mgr = self.manager
    stats["host_manager"] = type(mgr).__name__
    orig = mgr.prepare_store
    orig_load = mgr.prepare_load

    def _pl(keys, req_context):
        for key in keys:
            HC[f"loads_{KEY_CLASS.get(key, 'unknown')}"] += 1
            LOADED.add(key)
        return orig_load(keys, req_context)

    mgr.prepare_load = _pl
    if mode == "two_coldcp":
        orig_cs = mgr.complete_store
        lru = mgr._policy.evictable_chunks

        def _cs(keys, req_context, success=True):
            orig_cs(keys, req_context, success)
            for key in keys:
                if KEY_CLASS.get(key) in ("attn_tail", "gdn_tail") and key in lru:
                    lru.move_to_end(key, last=False)  # the cold end: evicted first
                    stats["cold_inserted"] = stats.get("cold_inserted", 0) + 1

        mgr.complete_store = _cs

    def _ps(keys, req_context):
        if mode in ("two_notail", "junq_notail"):
            kept = []
            for key in keys:
                c = classify(key, req_context.req_id)
                if c in ("attn_tail", "gdn_tail"):
                    stats[f"skipped_{c}"] = stats.get(f"skipped_{c}", 0) + 1
                else:
                    if c == "unknown":
                        stats["notail_unknown"] = stats.get("notail_unknown", 0) + 1
                    kept.append(key)
            keys = kept
        out = orig(keys, req_context)
        if out is None:
            stats["host_store_fail"] += 1
        else:
            for key in out.keys_to_store:
                c = KEY_CLASS[key] = classify(key, req_context.req_id)
                HC[f"stored_{c}"] += 1
                LOADED.discard(key)
            for key in out.evicted_keys:
                c = KEY_CLASS.pop(key, "unknown")
                HC[f"evicted_{c}"] += 1
                if key not in LOADED:
                    HC[f"evicted_unloaded_{c}"] += 1
                LOADED.discard(key)
            stats["host_store_keys"] += len(out.keys_to_store)
            if out.evicted_keys:
                stats["host_evicted_keys"] += len(out.evicted_keys)
                if stats["host_first_evict_req"] is None:
                    stats["host_first_evict_req"] = getattr(req_context, "req_id", None) or str(req_context)[:80]
        return out
    mgr.prepare_store = _ps
_SCHED.__init__ = _sinit

from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
from vllm_hybrid_npu_lab.replay import replay

import vllm_hybrid_npu_lab.replay as _R
import vllm_hybrid_npu_lab.exporter as _E
_orig_aje = _E.apply_junction_entries
JUNC = {}


def _aje(scheduler, target="npu"):
    on = _orig_aje(scheduler, target)
    JUNC["junction_rule_on"] = on
    return on


_E.apply_junction_entries = _aje  # replay imports it from the module at call time: observe only
t = time.time()
pol = get_policy(policy)
setup = build_setup(cfg, tp=args.tp, kv_cache_bytes=int(float(kv) * (1 << 30)),
                    host_cache_bytes=int(float(host) * (1 << 30)), **setup_kwargs(pol), **common)
res = replay(fit, setup, pol.scheduler_class(), **timing)
r = res.to_dict()
import os
if os.environ.get("CF_DUMP"):
    with open(os.environ["CF_DUMP"], "w") as f:
        json.dump({"cached": res.cached_per_request, "host": res.host_per_request,
                   "miss": res.miss_per_request,
                   "prompt_len": [len(x) for x in __import__("vllm_hybrid_npu_lab.trace", fromlist=["x"]).carried_prompts(fit, __import__("vllm_hybrid_npu_lab.replay", fromlist=["x"]).output_token, carry=timing["carry_outputs"])[0]]}, f)
out = {k: r[k] for k in ("token_hit_rate", "request_hit_rate", "prefill_steps_per_prompt",
                         "extra_prefill_steps_per_prompt", "device_cached_prompt_tokens",
                         "host_cached_prompt_tokens", "cached_prompt_tokens", "prompt_tokens",
                         "block_size", "hash_block_size", "num_blocks", "preemptions",
                         "cached_states", "extra_prefill_steps_by_reason", "miss_reasons")}
out["host_load_jobs"] = r["host"].get("load_jobs")
out["host_store_jobs"] = r["host"].get("store_jobs")
out["host_store_gib"] = round(r["host"].get("store_bytes", 0) / (1 << 30), 1) if isinstance(r.get("host"), dict) else None
out["host_pages"] = {k: v for k, v in HC.items() if v}
out["tail_offers_by_path"] = TAIL_OFFERS
out.update(target=args.target, junctions_modelled=_R.junctions_modelled(args.target, float(host) > 0),
           junction_rule_on=JUNC.get("junction_rule_on", False),
           lab_path=_os.path.dirname(_R.__file__))
out.update(mode=mode, policy=policy, part=part, kv=kv, host=host, n_requests=len(fit), rate=rate,
           wall_s=round(time.time() - t), **stats)
print(json.dumps(out))
