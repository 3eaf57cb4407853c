"""Lab replay of issue 38 item 4 as built (2026-11-28; not part of the lab's reports): the check
part of the shared trace with the runtime's own junction entries (``gdn-junction-split``,
``-allocate``, ``-count``, ``-blocks``: chunks run to the token budget's end, junctions exported)
on the lab's real vLLM scheduler and KV-cache manager, as vLLM 0.30's CPU exporter path runs
them. The lab itself (``replay``) turns the rule off, modelling the paths without it (CUDA, the
NPU); here it is forced on. The blocks the entries reserve are cached by vLLM's own manager, so
the hits count the in-step states (unlike ``../issue38-counterfactual-2026-11-28/cf.py``).

    python docs/notes/issue38-budget-rule-2026-11-28/replay_rule.py KV_GIB HOST_GIB MODE POLICY
    # MODE: plain (vLLM's split as installed) or rule (the entries on); POLICY: a lab policy
    # (upstream:ret=4b,ckpt = the 16 GiB advice) or "off" (caching off)

Same arrivals, budget and model as ``advise --limit 3000`` (requests 1,501-3,000); one JSON line.
"""
import json, pathlib, sys, time
from vllm_hybrid_npu_lab import advise as A

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "issue38-counterfactual-2026-11-28"))
from cf import check_part  # noqa: E402  (the same check part, arrivals, budget and model)

args, cfg, check, common, timing = check_part(sys.argv[1], sys.argv[2])
mode, policy = sys.argv[3], sys.argv[4]
t = time.time()
if policy == "off":
    rep = A.Replayer(check, cfg, kv_cache_gib=args.kv_cache_gib, tp=args.tp, common=common,
                     timing=timing, label="off", quiet=True)
    r = rep.caching_off()
else:
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.core.single_type_kv_cache_manager import MambaManager
    from vllm_hybrid_npu.patches import gdn_junction as J
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.policies import get_policy, setup_kwargs
    from vllm_hybrid_npu_lab.replay import replay

    pol = get_policy(policy)
    cls = pol.scheduler_class()
    if mode == "rule":
        Scheduler._mamba_block_aligned_split = J._make_split(Scheduler._mamba_block_aligned_split, None)
        KVCacheManager.allocate_slots = J._make_allocate(KVCacheManager.allocate_slots, None)
        MambaManager.get_num_blocks_to_allocate = J._make_count(MambaManager.get_num_blocks_to_allocate, None)
        MambaManager.allocate_new_blocks = J._make_blocks(MambaManager.allocate_new_blocks, None)

        class RuleScheduler(cls):
            @property
            def _vhn_junction_rule(self):  # J.RULE; replay() sets it None after __init__: ignored
                rule = self.__dict__.get("_forced_rule")
                if rule is None:
                    managers = tuple(m for m in self.kv_cache_manager.coordinator.single_type_managers
                                     if type(m).__name__ == "MambaManager" and m.mamba_cache_mode == "align"
                                     and m.has_prefill_checkpoint_blocks)
                    rule = self.__dict__["_forced_rule"] = J.JunctionRule(
                        self.cache_config.block_size, self.hash_block_size,
                        self.mamba_prefill_checkpoint_alignment, False, managers)
                vars(self.kv_cache_manager)[J.RULE] = rule
                return rule

            @_vhn_junction_rule.setter
            def _vhn_junction_rule(self, value):
                pass

        assert J.RULE == "_vhn_junction_rule"
        cls = RuleScheduler
    setup = build_setup(cfg, tp=args.tp, kv_cache_bytes=int(args.kv_cache_gib * (1 << 30)),
                        host_cache_bytes=int(float(args.host_cache_gib) * (1 << 30)),
                        **setup_kwargs(pol), **common)
    r = replay(check, setup, cls, **timing).to_dict()
out = {k: r[k] for k in ("token_hit_rate", "prefill_steps_per_prompt", "extra_prefill_steps_per_prompt",
                         "extra_prefill_steps_by_reason", "block_size", "preemptions")}
out.update(mode=mode, policy=policy, kv=sys.argv[1], host=sys.argv[2], wall_s=round(time.time() - t))
print(json.dumps(out))
