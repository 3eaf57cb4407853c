"""``resend-tail`` (vLLM 0.30): where a prompt's partial attention tail block is registered, on
hand-counted cases with stand-in managers (no engine; the e2e test runs it in vLLM's scheduler).

Block 384 tokens, hash unit 64 (``--prefix-match-unit 64``). vLLM 0.30 registers the tail at
``n // 64 * 64`` (upstream, recorded here as a call); vLLM 0.32's rule, carried, registers it at
``(n - 1) // 64 * 64`` where the request's Mamba manager holds its checkpoint there.
"""

from __future__ import annotations

import types

import pytest

from vllm_hybrid_npu.patches import resend_tail

BLOCK, UNIT = 384, 64


class _Pool:
    hash_block_size = UNIT

    def __init__(self):
        self.partial: list[tuple[int, int]] = []  # (block id, tokens)

    def cache_partial_block(self, request, block, num_tokens, kv_cache_group_id, block_size):
        assert block_size == BLOCK and kv_cache_group_id == 0
        self.partial.append((block.block_id, num_tokens))
        block.block_hash_num_tokens = num_tokens  # vLLM's re-key: the block's one entry


def _call(n, computed, checkpoint=None, eagle=False, declared=True, keyed=None):
    """Run the entry's wrapper for an ``n``-token prompt with ``computed`` tokens cached; the
    request's Mamba checkpoint (position, block index) or None; ``keyed``: {block index: tokens
    of the entry that block already holds}. Returns (upstream calls, partial registrations)."""
    upstream_calls = []
    wrapped = resend_tail._make_tail(lambda self, request, num_tokens: upstream_calls.append(num_tokens),
                                     stack=None)
    mamba = types.SimpleNamespace(_checkpoints={} if checkpoint is None else {"r": checkpoint})
    blocks = [types.SimpleNamespace(block_id=10 + i, block_hash_num_tokens=(keyed or {}).get(i))
              for i in range(4)]
    manager = types.SimpleNamespace(block_pool=_Pool(), block_size=BLOCK, use_eagle=eagle,
                                    kv_cache_group_id=0, req_to_blocks={"r": blocks})
    setattr(manager, resend_tail.FLAG, (mamba,) if declared else ())
    wrapped(manager, types.SimpleNamespace(request_id="r", num_prompt_tokens=n), computed)
    return upstream_calls, manager.block_pool.partial


def test_grid_ending_prompt_with_its_checkpoint_registers_the_tail_there():
    # 896 = 2 x 384 + 128: checkpoint at 832 (13 units), in block 2 (tokens 768-1151)
    assert _call(896, 896, checkpoint=(832, 2)) == ([], [(12, 832)])
    # 768 = 2 x 384 (upstream: a full block, no partial entry): checkpoint 704 in block 1
    assert _call(768, 768, checkpoint=(704, 1)) == ([], [(11, 704)])


@pytest.mark.parametrize("case", [
    dict(n=900, computed=900, checkpoint=(896, 2)),  # off the grid: both rules give 896
    dict(n=320, computed=320, checkpoint=None),  # one block, no checkpoint: state at its end
    dict(n=896, computed=896, checkpoint=(768, 2)),  # a checkpoint elsewhere (not this rule's)
    dict(n=896, computed=896, checkpoint=(832, 2), eagle=True),  # EAGLE: 0.32 keeps n too
    dict(n=896, computed=896, checkpoint=(832, 2), declared=False),  # no checkpoints declared
])
def test_elsewhere_vllm_030s_rule_stays(case):
    assert _call(**case) == ([case["computed"]], [])


def test_nothing_registered_before_the_boundary_is_computed():
    # a chunk that stops short of the checkpoint: nothing to register yet, upstream not asked
    assert _call(896, 800, checkpoint=(832, 2)) == ([], [])


def test_decode_steps_keep_the_tail_registered_at_the_checkpoint():
    # 896 = 2 x 384 + 128: the prefill registered the tail at 832 in block 2 (tokens 768-1151);
    # each decode step (897, 898, ... tokens) the Mamba manager holds no checkpoint any more, and
    # 0.30's rule would register 896 in that same block, dropping 832 (the resend then hit 0)
    for computed in (897, 898, 1000):
        assert _call(896, computed, keyed={2: 832}) == ([], []), computed
    # under EAGLE's drop the tail at 832 serves the checkpoint at 768: kept alike
    assert _call(896, 897, keyed={2: 832}, eagle=True) == ([], [])


@pytest.mark.parametrize("case", [
    dict(n=896, computed=897, keyed={2: 896}),  # 0.30's own tail (no checkpoint had been there)
    dict(n=896, computed=897),  # nothing registered in that block
    dict(n=900, computed=901, keyed={2: 896}),  # off the grid: 0.30's rule
    dict(n=896, computed=897, keyed={2: 832}, declared=False),  # no checkpoints declared
])
def test_decode_steps_elsewhere_go_to_vllm_030(case):
    assert _call(**case) == ([case["computed"]], [])
