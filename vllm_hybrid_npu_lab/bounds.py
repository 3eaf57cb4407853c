"""Reference replays that bound what any hybrid checkpoint policy can reach (lab only).

``free-states`` (:func:`free_states_scheduler`): the hybrid model as vLLM 0.30 runs it in align
mode (same block pool, same running requests with their GDN state blocks, same attention block
size) except that *cached* GDN states cost nothing and exist everywhere: a request hits the
longest prefix the full-attention group holds, whatever states exist, and no GDN state is ever
registered in the prefix cache (each state block freed goes straight back to the pool, uncached).
Every real policy needs a state page set (one page per GDN layer) resident for each prefix it can
hit, in the same pool, so at the same budget it gets less than this reference up to the eviction
order (this one is vLLM's LRU): the gap between a policy and ``free-states`` is what its cached
states cost, the gap between ``free-states`` and the attention bound is what the running requests'
states and the hybrid's block size cost, which no checkpoint placement can recover.

How (vLLM 0.30, ``vllm/v1/core/kv_cache_coordinator.py``, ``HybridKVCacheCoordinator``): the
coordinator's ``attention_groups`` entries for Mamba groups get a ``MambaManager`` subclass whose
``find_longest_cache_hit`` returns the candidate length (block-aligned) with null blocks (the
replay has no forward pass to read a state), and the Mamba managers' ``cache_blocks`` do nothing.
"""

from __future__ import annotations

from typing import Any


def free_states_scheduler(base: type) -> type:
    """Return a subclass of ``base`` (vLLM's ``Scheduler``) replaying with free cached states.

    Raises ``TypeError`` at construction if the coordinator is not vLLM 0.30's hybrid one, and
    ``ValueError`` naming ``--host-cache-gib`` when the scheduler has a host tier: vLLM's
    OffloadingConnector still looks up, loads and stores a GDN state per hit on the host, so
    with a host tier this replay is no bound (its host hits would need states it calls free);
    it models the device cache only.
    """

    class FreeStatesScheduler(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            if getattr(self, "connector", None) is not None:
                raise ValueError(
                    "--policy free-states models the device cache only: with --host-cache-gib "
                    "the host tier's GDN states are not free; compare with the attention bound"
                )
            from vllm.v1.core.single_type_kv_cache_manager import MambaManager
            from vllm.v1.kv_cache_interface import MambaSpec

            coord = self.kv_cache_manager.coordinator
            groups = getattr(coord, "attention_groups", None)
            if groups is None:
                raise TypeError("free-states needs vLLM 0.30's HybridKVCacheCoordinator")

            class OracleMamba(MambaManager):
                @classmethod
                def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids,
                                           block_pool, kv_cache_spec, drop_eagle_block,
                                           alignment_tokens, dcp_world_size=1, pcp_world_size=1):
                    n = min(max_length, len(block_hashes) * kv_cache_spec.block_size)
                    n = n // kv_cache_spec.block_size
                    blocks = tuple([block_pool.null_block] * n for _ in kv_cache_group_ids)
                    return blocks, n * kv_cache_spec.block_size

            new = []
            for entry in groups:
                spec, ids, cls, eagle = entry
                if isinstance(spec, MambaSpec):
                    entry = type(entry)(spec, ids, OracleMamba, eagle) if hasattr(entry, "_fields") \
                        else (spec, ids, OracleMamba, eagle)
                new.append(entry)
            coord.attention_groups = new
            for gid, g in enumerate(self.kv_cache_manager.kv_cache_config.kv_cache_groups):
                if isinstance(g.kv_cache_spec, MambaSpec):
                    coord.single_type_managers[gid].cache_blocks = lambda *a, **k: None

    return FreeStatesScheduler
