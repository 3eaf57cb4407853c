"""A prompt's last chunk kept whole where only the checkpoint's column stops it: an opt-in
(``VLLM_HYBRID_NPU_OPTIONS=tailsplit=off``).

With a prefix-match unit below the block (``--prefix-match-unit``) and a GDN prefill checkpoint
declared (the plugin's exporter), vLLM 0.30's ``Scheduler._mamba_block_aligned_split`` keeps a
prompt's final chunk whole only where ``is_mamba_prefill_checkpoint_valid`` answers True. One of
its clauses wants the checkpoint's block-table column (``cdiv(end, B) - 2``) past the initial
state's (``(start - 1) // B``): a chunk that spans at most one column past its start (a cold
prompt of at most one block, a hit leaving at most about a block) fails it, and the split then
stops the chunk at the prompt's last prefix-match boundary (``tail_boundary``), or first at the
next block boundary after a start inside a block, so that align mode caches the GDN state there:
one or two more prefill steps than caching off. In the lab's replays of the shared trace with a
host tier and the exporter at ``--prefix-match-unit 64`` that clause alone costs extra prefill
steps (docs/hitrate-guide.md, "The last chunk kept whole").

``off`` rebinds the name the scheduler module imported (``vllm.v1.core.sched.scheduler.
is_mamba_prefill_checkpoint_valid``; only ``_mamba_block_aligned_split`` reads it there) to vLLM's
function that also answers True where the column clause alone fails
(:func:`vllm_hybrid_npu.core.prefill_checkpoints.only_column_clause_fails`). The split then takes
vLLM's own internal-checkpoint path for that chunk (no tail, next-block or last-block stop; a
shared-prefix junction's stop stays). The KV-cache manager imports the function under its own
name and keeps vLLM's answer: it reserves no checkpoint block for that chunk, so the state at the
prompt's last prefix-match boundary is not cached (the hit the prompt started from and the state
at its end, where vLLM keys it, stay), and the worker's checkpoint plan, which asks vLLM's own
function, writes none. The junction entries (:mod:`.gdn_junction`) read vLLM's function from
``vllm.v1.kv_cache_interface`` too. On the NPU, vllm-ascend 0.30.0rc2 wraps the split
(``patch/platform/patch_mamba_block_aligned_split.py``) and calls vLLM's, which reads this name,
so the entry applies there as well; where the ``gdn-chunk-end`` entry's mid-block stop cuts a chunk
started inside a block at its next boundary (paths that do not write the crossed boundary's
state), it still does. One edge stays: after a start inside a block, vLLM floors a shared-prefix
junction's stop from the start, so a junction more than a block past it stops the whole chunk at
``start + block``, where nothing is cached (still fewer steps than the split).
The default ``on`` is vLLM's behaviour (entry skipped). Whether ``off`` pays depends on the
traffic (fewer steps, one state fewer per such prompt): the lab's
``tailsplit=off`` key replays it. Until: vLLM's split weighs that state against the step.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from vllm_hybrid_npu import envs
from vllm_hybrid_npu.core import prefill_checkpoints as core
from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

logger = logging.getLogger("vllm_hybrid_npu")

#: The option (``VLLM_HYBRID_NPU_OPTIONS`` key): ``on`` (vLLM's split, default) or ``off``.
SPLIT_KEY = "tailsplit"
ENTRY = "sub-block-tail-split-off"
MODULE = "vllm.v1.core.sched.scheduler"
QUALNAME = "is_mamba_prefill_checkpoint_valid"
VERSIONS = ("0.30.0",)
SIGNATURE = ("query_start", "query_end", "checkpoint_position", "hash_block_size",
             "mamba_block_size", "checkpoint_alignment")


def tail_split() -> str:
    """The option ``tailsplit`` (default ``on``).

    Raises:
        ValueError: a value other than ``on`` or ``off`` (the message names the variable).
    """
    return envs.option(SPLIT_KEY)


def make_valid(upstream: Any, stack: Stack | None = None) -> Any:
    """Registry ``make`` of the scheduler module's ``is_mamba_prefill_checkpoint_valid`` (vLLM
    0.30.0, keyword arguments in :data:`SIGNATURE`, tokens): ``upstream``'s answer, or True where
    it fails by the column clause alone (:func:`core.only_column_clause_fails`). Pure: no state,
    the same answer for the same arguments."""
    @functools.wraps(upstream)
    def is_mamba_prefill_checkpoint_valid(query_start, query_end, checkpoint_position,
                                          hash_block_size, mamba_block_size,
                                          checkpoint_alignment):
        args = dict(query_start=query_start, query_end=query_end,
                    checkpoint_position=checkpoint_position, hash_block_size=hash_block_size,
                    mamba_block_size=mamba_block_size, checkpoint_alignment=checkpoint_alignment)
        return upstream(**args) or core.only_column_clause_fails(**args)

    return is_mamba_prefill_checkpoint_valid


def _make(upstream: Any, stack: Stack) -> Any:
    logger.info("vllm-hybrid-npu: %s: a prompt's last chunk spanning at most one block column "
                "past its start runs whole (no split for the GDN state at its last prefix-match "
                "boundary, which is then not cached)", envs.option_text(SPLIT_KEY, "off"))
    return make_valid(upstream, stack)


def _wanted(stack: Stack) -> str | None:
    """Skip reason unless :func:`tail_split` is ``off`` (a bad value raises ValueError)."""
    return None if tail_split() == "off" else f"{envs.option_text(SPLIT_KEY, 'on')} (vLLM's split)"


PATCHES = [
    Patch(
        name=ENTRY,
        module=MODULE,
        qualname=QUALNAME,
        targets=("cpu", "cuda", "npu"),
        vllm=VERSIONS,
        why=f"opt-in ({envs.option_text(SPLIT_KEY, 'off')}): with --prefix-match-unit below the "
        "block and a prefill "
        "checkpoint declared, a prompt's last chunk that fails vLLM's checkpoint check by its "
        "column clause alone runs whole (vLLM's internal-checkpoint path) instead of stopping at "
        "its last prefix-match boundary; that state is not cached (the KV-cache manager keeps "
        "vLLM's answer); lab: docs/hitrate-guide.md",
        until="vLLM's split weighs the sub-block state against the extra prefill step",
        make=_make,
        wanted=_wanted,
        signature=SIGNATURE,
        behaviour_changing=True,
    ),
]
