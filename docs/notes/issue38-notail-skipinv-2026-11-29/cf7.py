"""Issue 38, `notail_skipinv` (lab only; not a runtime capability): cf5.py's `two_notail`
(../issue38-item3-cuda-2026-11-29) with cf6.py's `skipinv` rule (../issue38-skipinv-2026-11-29),
both unchanged, in one replay.

    PYTHONPATH=. /work/main/.venv/bin/python docs/notes/issue38-notail-skipinv-2026-11-29/cf7.py \
        notail_skipinv POLICY PART [KV_GIB HOST_GIB]

cf7 runs cf6.py (via runpy) with MODE `two_notail+skipinv`; cf6 rebinds vLLM's scheduler-module
`is_mamba_prefill_checkpoint_valid` and `Scheduler._mamba_block_aligned_split` and then runs
cf5.py with MODE `two_notail`, which patches MambaManager (second checkpoint block keyed at cp,
the exporter's slot keyed at L), KVCacheManager.allocate_slots, and the host manager's
prepare_store (every partial-tail key dropped). Nothing in cf5 touches the two scheduler names,
and cf6 touches no name that cf5 patches (cf6 wraps MambaManager.cache_blocks, which cf5 leaves
alone), so both sets of changes are live together.

cf7 adds a "cf7" object to the JSON line that proves it per run:
* bound: the source file of the function bound at each patched name when the JSON is printed
  (cf6.py for the two scheduler names and cache_blocks' observer, cf5.py for the MambaManager
  methods of `two`);
* active: skipinv.on, skipinv.flipped > 0 (the rule changed answers), extra_taken > 0 (two's
  second block was taken), skipped_gdn_tail + skipped_attn_tail > 0 (no-tail drops happened),
  and composed = all of these.
"""
import builtins, json, os, runpy, sys

MODES = {"notail_skipinv": "two_notail+skipinv"}


def _src(f):
    f = getattr(f, "__func__", f)
    c = getattr(f, "__code__", None)
    return os.path.basename(c.co_filename) if c else repr(f)


def main():
    mode = sys.argv[1]
    if mode not in MODES:
        raise SystemExit(f"unknown mode {mode!r}; cf7 knows {sorted(MODES)}")
    _print = builtins.print

    def _p(*a, **k):
        if a and isinstance(a[0], str) and a[0].startswith("{"):
            import vllm.v1.core.sched.scheduler as S
            from vllm.v1.core.single_type_kv_cache_manager import MambaManager
            from vllm.v1.core.kv_cache_manager import KVCacheManager
            d = json.loads(a[0])
            si = d.get("skipinv", {})
            bound = {
                "scheduler.is_mamba_prefill_checkpoint_valid": _src(S.is_mamba_prefill_checkpoint_valid),
                "Scheduler._mamba_block_aligned_split": _src(S.Scheduler._mamba_block_aligned_split),
                "MambaManager.cache_blocks": _src(MambaManager.cache_blocks),
                "MambaManager.get_num_blocks_to_allocate": _src(MambaManager.get_num_blocks_to_allocate),
                "MambaManager.allocate_new_blocks": _src(MambaManager.allocate_new_blocks),
                "MambaManager._cache_partial_tail_block": _src(MambaManager._cache_partial_tail_block),
                "KVCacheManager.allocate_slots": _src(KVCacheManager.allocate_slots),
            }
            active = {
                "skipinv_on": bool(si.get("on")),
                "flipped": si.get("flipped", 0),
                "extra_taken": d.get("extra_taken", 0),
                "skipped_tails": d.get("skipped_gdn_tail", 0) + d.get("skipped_attn_tail", 0),
            }
            active["composed"] = (active["skipinv_on"] and active["flipped"] > 0
                                  and active["extra_taken"] > 0 and active["skipped_tails"] > 0
                                  and d.get("base_mode") == "two_notail"
                                  and bound["scheduler.is_mamba_prefill_checkpoint_valid"] == "cf6.py"
                                  and bound["Scheduler._mamba_block_aligned_split"] == "cf6.py"
                                  and bound["MambaManager.allocate_new_blocks"] == "cf5.py"
                                  and bound["MambaManager._cache_partial_tail_block"] == "cf5.py")
            d["cf7"] = {"mode": mode, "bound": bound, "active": active,
                        "path": os.path.abspath(__file__)}
            a = (json.dumps(d),) + a[1:]
        return _print(*a, **k)

    builtins.print = _p  # cf6 captures this as its own print, so its JSON passes through here
    here = os.path.dirname(os.path.abspath(__file__))
    cf6 = os.path.join(here, "..", "issue38-skipinv-2026-11-29", "cf6.py")
    sys.argv = [cf6, MODES[mode]] + sys.argv[2:]
    runpy.run_path(cf6, run_name="__main__")


if __name__ == "__main__":
    main()
