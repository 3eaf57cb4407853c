"""``resend-tail`` (vLLM 0.30): where a prompt's partial attention tail block is registered, on
hand-counted cases with stand-in managers, and a resend after decode steps on vLLM's real
``Scheduler`` (the lab's replay; the e2e test runs it in an engine, one output token per prompt;
``tests/ascend/test_scheduler_composition.py`` on vllm-ascend's coordinator).

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


def _outside_030() -> str | None:
    try:
        from vllm_hybrid_npu.patches.registry import stack_skip_reason
        from vllm_hybrid_npu.support import Stack, detect_stack

        return stack_skip_reason(resend_tail.PATCHES[0], Stack(target="cpu", vllm=detect_stack().vllm))
    except Exception as exc:  # no vLLM here
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.skipif(_outside_030() is not None, reason=f"resend-tail: {_outside_030()}")
@pytest.mark.parametrize("control", [False, True], ids=["entries", "control-keep"])
def test_resend_after_decode_steps_on_vllms_scheduler(apply_entries, monkeypatch, seed, control):
    """vLLM 0.30's real ``Scheduler`` and ``HybridKVCacheCoordinator`` (the lab's replay of the
    tiny hybrid, block 256 tokens, ``--prefix-match-unit 64``, the checkpoint declared), the two
    entries applied for the CPU target: prompts of ``n`` tokens on the 64-token grid with the
    checkpoint ``n - 64`` inside a block, each decoding 2-6 tokens, then resent. Hits in tokens:
    0, then the checkpoint ``(n - 1) // 64 * 64``; the control (the decode-step keep dropped,
    ``kept`` always False) 0, as before the keep."""
    import random

    from vllm_hybrid_npu.support import Stack, detect_stack
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID
    from vllm_hybrid_npu_lab.replay import replay
    from vllm_hybrid_npu_lab.trace import TraceRequest
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    from vllm.v1.core.sched.scheduler import Scheduler  # imports both entries' modules

    report = apply_entries("resend-tail-declared", "resend-tail",
                           stack=Stack(target="cpu", vllm=detect_stack().vllm))
    assert {"resend-tail-declared", "resend-tail"} <= set(report.applied)
    if control:
        monkeypatch.setattr(resend_tail, "kept", lambda block, end: False)
    setup = build_setup(TINY_HYBRID, kv_cache_bytes=64 << 20, max_model_len=8192, block_size=256,
                        max_num_batched_tokens=8192, prefill_checkpoints=True,
                        tune=UpstreamSetting(pmu=UNIT, ckpt=True).tune)
    bs = setup.block_size
    assert (bs, setup.hash_block_size) == (256, UNIT)
    rng = random.Random(seed)
    grid = [x for x in range(bs + UNIT, 8 * bs + 1, UNIT) if x % bs in (128, 192)]
    rows = [(rng.choice(grid), rng.randint(2, 6)) for _ in range(3)]
    reqs = []
    for k, (n, out) in enumerate(rows):  # each prompt its own trace blocks (512 tokens each)
        ids = tuple(100 * (k + 1) + j for j in range(-(-n // 512)))
        reqs += [TraceRequest(10_000.0 * len(reqs), n, out, ids),
                 TraceRequest(10_000.0 * (len(reqs) + 1), n, out, ids)]
    coordinators = []

    class Recording(Scheduler):
        def schedule(self, *a, **k):
            coordinators.append(type(self.kv_cache_manager.coordinator).__qualname__)
            return super().schedule(*a, **k)

    cached = list(replay(reqs, setup, Recording, carry_outputs=False, target="cpu").cached_per_request)
    assert set(coordinators) == {"HybridKVCacheCoordinator"}
    want = [0] * len(reqs) if control else [h for n, _ in rows for h in (0, (n - 1) // UNIT * UNIT)]
    assert cached == want, (seed, rows, cached)
