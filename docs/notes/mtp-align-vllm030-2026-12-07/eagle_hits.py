"""Build vLLM 0.30's real Scheduler + KVCacheManager for a tiny GDN hybrid (align mode,
prefix caching, block 256) with and without an EAGLE/MTP speculative config, run a cold prompt
then a repeat (as tests/patches/test_gdn_second_checkpoint.py Engine.run does) and print hits.

Monkeypatching (only what is needed, all on objects, nothing in vLLM's files):
  * vllm_config.speculative_config := a stub with vLLM's SpeculativeConfig predicates for
    method="mtp" (use_eagle / use_eagle_block_drop True, use_multi_module_mtp False, ...);
    a real SpeculativeConfig(method="mtp") needs the target model's HF files for its draft config.
  * each MambaSpec in the KVCacheConfig gets num_speculative_blocks = k, as
    MambaBase.get_kv_cache_spec sets it from vllm_config.num_speculative_tokens.
No plugin patch is applied (vLLM's own code only).
"""
from __future__ import annotations

import dataclasses
import json
import random
import sys
import tempfile
import types
from pathlib import Path

B = 256


def stub_spec_config(k: int, block_drop: bool = True):
    s = types.SimpleNamespace()
    s.method = "mtp"
    s.num_speculative_tokens = k
    s.num_speculative_tokens_per_batch_size = None
    s.disable_eagle_block_drop = not block_drop
    s.use_eagle = lambda: True
    s.use_eagle_block_drop = lambda: block_drop
    s.use_multi_module_mtp = lambda: False
    s.use_dflash = lambda: False
    s.use_dspark = lambda: False
    s.uses_draft_model = lambda: False
    s.uses_extract_hidden_states = lambda: False
    s.uses_dynamic_speculative_decoding = lambda: False
    s.max_num_new_slots_for_drafting = 0
    s.draft_model_config = None
    return s


class Engine:
    def __init__(self, eagle: bool, pmu: int | None, ckpt: bool, budget: int = 2048, k: int = 1,
                 block_drop: bool = True):
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import MambaSpec
        from vllm.v1.structured_output import StructuredOutputManager

        from vllm_hybrid_npu_lab.model import build_setup
        from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model
        from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

        d = Path(tempfile.mkdtemp(prefix="r58-tiny-"))
        (d / "config.json").write_text(json.dumps(TINY_HYBRID))
        cfg = resolve_model(str(d))[1]
        setup = build_setup(cfg, kv_cache_bytes=64 << 20, max_model_len=4096, block_size=B,
                            prefill_checkpoints=ckpt, max_num_batched_tokens=budget,
                            tune=UpstreamSetting(pmu=pmu, ckpt=ckpt).tune)
        vc = setup.vllm_config
        if eagle:
            object.__setattr__(vc, "speculative_config", stub_spec_config(k, block_drop))
            for g in setup.kv_cache_config.kv_cache_groups:
                if isinstance(g.kv_cache_spec, MambaSpec):
                    g.kv_cache_spec = dataclasses.replace(g.kv_cache_spec,
                                                          num_speculative_blocks=k)
        self.sched = Scheduler(vllm_config=vc, kv_cache_config=setup.kv_cache_config,
                               structured_output_manager=StructuredOutputManager(vc),
                               block_size=setup.scheduler_block_size,
                               hash_block_size=setup.hash_block_size, log_stats=False)
        hash_fn = get_hash_fn_by_name(vc.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(setup.hash_block_size, hash_fn)
        self.n = 0
        self.setup = setup

    def describe(self):
        from vllm.v1.core.single_type_kv_cache_manager import MambaManager
        kvm = self.sched.kv_cache_manager
        co = kvm.coordinator
        groups = [(type(g.kv_cache_spec).__name__, g.is_eagle_group)
                  for g in self.setup.kv_cache_config.kv_cache_groups]
        mgr = [(type(m).__name__, m.use_eagle, getattr(m, "drop_eagle_checkpoint_block", None))
               for m in co.single_type_managers]
        return (f"sched.use_eagle={self.sched.use_eagle} use_eagle_block_drop="
                f"{self.sched.use_eagle_block_drop} num_lookahead={self.sched.num_lookahead_tokens}"
                f" | coord={type(co).__name__} eagle_group_ids={sorted(co.eagle_group_ids)}"
                f" partial_hits={co.enable_partial_hash_hits} hash={co.hash_block_size}"
                f" | groups(spec,is_eagle_group)={groups} | managers(use_eagle,drop_ckpt)={mgr}"
                f" | attention_groups={[(type(s.spec).__name__, s.group_ids, s.use_eagle) for s in co.attention_groups]}")

    def probe(self, prompt):
        """The coordinator's hit for ``prompt`` now (read-only lookup), per group."""
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        req = Request(request_id="probe", prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                      pooling_params=None, block_hasher=self.hasher)
        co = self.sched.kv_cache_manager.coordinator
        blocks, hit, _ = co.find_longest_cache_hit(req.block_hashes, req.num_tokens - 1)
        per = []
        for gid, bl in enumerate(blocks):
            nonnull = [(i, b.block_hash_num_tokens) for i, b in enumerate(bl) if not b.is_null]
            last = nonnull[-1] if nonnull else None
            per.append((gid, len(bl), last))
        return hit, per

    def keys(self):
        """{group id: sorted token lengths of the cache keys in the pool's hash table}."""
        from vllm.v1.core.kv_cache_utils import get_group_id
        pool = self.sched.kv_cache_manager.block_pool
        out = {}
        for b in pool.blocks:
            if b.block_hash is not None and b.block_hash_num_tokens is not None:
                out.setdefault(get_group_id(b.block_hash), set()).add(b.block_hash_num_tokens)
        return {g: sorted(v) for g, v in sorted(out.items())}

    def per_group(self, prompt):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request
        req = Request(request_id="probe2", prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                      pooling_params=None, block_hasher=self.hasher)
        co = self.sched.kv_cache_manager.coordinator
        return co.find_longest_cache_hit_per_group(req.block_hashes, req.num_tokens - 1)[1]

    def run(self, prompt):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.outputs import ModelRunnerOutput
        from vllm.v1.request import Request
        self.n += 1
        req = Request(request_id=f"r{self.n}", prompt_token_ids=list(prompt),
                      sampling_params=SamplingParams(max_tokens=1, ignore_eos=True),
                      pooling_params=None, block_hasher=self.hasher)
        self.sched.add_request(req)
        hit, chunks = None, []
        while self.sched.has_unfinished_requests():
            out = self.sched.schedule()
            if hit is None:
                hit = out.scheduled_new_reqs[0].num_computed_tokens
            chunks.append(out.num_scheduled_tokens.get(req.request_id, 0))
            done = req.num_computed_tokens >= req.num_tokens
            self.sched.update_from_output(out, ModelRunnerOutput(
                req_ids=[req.request_id], req_id_to_index={req.request_id: 0},
                sampled_token_ids=[[7] if done else []]))
        return hit, chunks


def main():
    from vllm.v1.core import single_type_kv_cache_manager as stm
    assert stm.MambaManager.find_longest_cache_hit.__func__.__module__ == stm.__name__
    lengths = [int(x) for x in sys.argv[1].split(",")] if len(sys.argv) > 1 else \
        [300, 511, 512, 513, 700, 767, 768, 769, 1000, 1024, 1100, 1500]
    configs = [(None, False, 2048), (64, False, 2048), (64, True, 2048), (None, False, 512),
               (64, False, 512)]
    rng = random.Random(0)
    for pmu, ckpt, budget in configs:
        print(f"\n=== block {B}, prefix_match_unit={pmu or B}, GDN checkpoint block declared={ckpt},"
              f" max_num_batched_tokens={budget}, retention_interval=0 (vLLM default)")
        for eagle in (False, True):
            eng = Engine(eagle, pmu, ckpt, budget)
            print(f"  eagle={eagle}: {eng.describe()}")
        for n in lengths:
            row = []
            for eagle in (False, True):
                eng = Engine(eagle, pmu, ckpt, budget)
                prompt = [rng.randrange(1, 30000) for _ in range(n)]
                h0, c0 = eng.run(prompt)
                keys = eng.keys()
                ph, per = eng.probe(prompt)
                indep = eng.per_group(prompt)
                h1, c1 = eng.run(prompt)
                mk = keys.get(0, [])
                fk = keys.get(3, [])
                row.append(f"eagle={'on ' if eagle else 'off'}: repeat_hit={h1:4d} | cold_chunks={c0}"
                           f" mamba_keys={mk} attn_keys={fk} | per-group independent hits={indep}"
                           f" | reconciled={ph}, mamba g0 block(idx,key)={per[0][2]},"
                           f" attn g3 blocks={per[3][1]} | repeat_chunks={c1}")
            print(f"  N={n}:\n    " + "\n    ".join(row))


if __name__ == "__main__":
    main()
