"""Policy schedulers driven through vLLM's real Scheduler and KV-cache manager (hit-rate lab
replay: real hybrid KV-cache specs, align mode, only the forward pass stood in).

Tiny hybrid (3 GDN + 1 attention layer), block size 256 tokens, requests 10 simulated seconds
apart (each runs alone). Trace blocks are 512 tokens, so a prompt sharing its first ``k`` trace
blocks with an earlier one shares ``512 * k`` tokens; the hits expected below are worked out by
hand from the rule each policy states. ``tail`` and ``adaptive`` are the lab's retired policies
(``vllm_hybrid_npu_lab/retired_policies.py``), built through the split-rule extension
point (``scheduler_class(SplitRule)``); their names raise.
"""

from __future__ import annotations

import json

import pytest

from vllm_hybrid_npu_lab.model import build_setup
from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model
from vllm_hybrid_npu_lab.replay import replay
from vllm_hybrid_npu_lab.trace import TraceRequest
from vllm_hybrid_npu_lab.scheduling.scheduler import CheckpointPolicyMixin, scheduler_class
from vllm_hybrid_npu_lab.retired_policies import RULES

TINY = TINY_HYBRID
BS = 256


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-hybrid-sched")
    (d / "config.json").write_text(json.dumps(TINY))
    return resolve_model(str(d))[1]


def _run(cfg, rows, policy, max_num_batched_tokens=8192):
    reqs = [TraceRequest(10_000.0 * i, n, out, tuple(h)) for i, (n, out, h) in enumerate(rows)]
    setup = build_setup(
        cfg,
        kv_cache_bytes=64 << 20,
        max_model_len=max(r.input_length + r.output_length for r in reqs),
        block_size=BS,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    assert setup.block_size == BS
    return replay(reqs, setup, scheduler_class(RULES.get(policy, policy)))


# Four 2000-token prompts sharing 3 trace blocks = 1536 tokens = 6 blocks of 256. The prompt's
# last block boundary (1792) lies past the shared prefix.
SHARED = [(2000, 4, [1, 2, 3, 10 + i]) for i in range(4)]


def test_upstream_misses_the_first_repeat(cfg):
    # upstream's only first-sight state is at 1792 (not shared); vLLM's junction checkpoint on
    # the second request makes the third hit 1536.
    assert _run(cfg, SHARED, "upstream").cached_per_request == [0, 0, 1536, 1536]


def test_tail_hits_the_first_repeat(cfg):
    # a state at every block boundary: the second request hits all 6 shared blocks.
    assert _run(cfg, SHARED, "tail").cached_per_request == [0, 1536, 1536, 1536]


def test_adaptive_hits_a_power_of_two_then_the_junction(cfg):
    # first sight stores 1, 2, 4 blocks (and 1792): the second hits 4 blocks = 1024; its prefill
    # checkpoints the junction (1536), so the third hits 1536.
    assert _run(cfg, SHARED, "adaptive").cached_per_request == [0, 1024, 1536, 1536]


@pytest.mark.parametrize("policy", ["tail", "adaptive"])
def test_prompt_shorter_than_a_block_and_exact_resend(cfg, policy):
    # 200-token prompts: no block boundary, nothing to cut; a resend hits at most
    # (200 - 1) // 256 * 256 = 0 tokens, as upstream.
    rows = [(200, 2, [7]), (200, 2, [7])]
    up = _run(cfg, rows, "upstream")
    res = _run(cfg, rows, policy)
    assert res.cached_per_request == up.cached_per_request == [0, 0]
    assert res.computed_prompt_tokens == up.computed_prompt_tokens == 400


@pytest.mark.parametrize("policy", ["upstream", "tail", "adaptive", "lean"])
def test_chunk_limit_smaller_than_prompt(cfg, policy):
    # token budget 512 (2 blocks): every policy's prefill chunks end at 512, 1024, 1536, ...,
    # so a state at the shared 1536 is computed on first sight. Upstream's sparse retention
    # (prefix_cache_retention_interval=0) keeps only the replay boundary (1792) and drops it;
    # the policies retain it (lean: 1536 is one of the prompt's last 2 boundaries, 1536 and
    # 1792), and the second request hits all 1536 shared tokens.
    res = _run(cfg, SHARED[:2], policy, max_num_batched_tokens=512)
    hit = 0 if policy == "upstream" else 1536
    assert res.cached_per_request == [0, hit]
    assert res.computed_prompt_tokens == 2000 + 2000 - hit


def test_policy_class_keeps_base_and_dense_retention(cfg):
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    assert scheduler_class("upstream") is Scheduler
    lean = scheduler_class("lean")
    assert issubclass(lean, Scheduler) and issubclass(lean, CheckpointPolicyMixin)
    assert scheduler_class("lean") is lean  # cached
    assert issubclass(scheduler_class("lean", AsyncScheduler), AsyncScheduler)
    # a split rule (the extension point): a dense-retention class named after the rule
    tail = scheduler_class(RULES["tail"])
    assert issubclass(tail, Scheduler) and issubclass(tail, CheckpointPolicyMixin)
    assert tail.__name__ == "TailCheckpointScheduler" and tail.dense_retention
    assert tail.split_rule is RULES["tail"] and scheduler_class(RULES["tail"]) is tail
    atail = scheduler_class(RULES["tail"], AsyncScheduler)
    assert issubclass(atail, AsyncScheduler)
    with pytest.raises(ValueError, match="checkpoint policy='every'"):
        scheduler_class("every")
    from vllm_hybrid_npu_lab.scheduling.split import SplitRule

    with pytest.raises(ValueError, match="'lean'"):
        scheduler_class(SplitRule("lean", RULES["tail"].chunk_tokens))


@pytest.mark.parametrize("name", ["tail", "adaptive"])
def test_retired_policy_names_raise(name):
    with pytest.raises(ValueError, match=f"checkpoint policy='{name}'.*was retired"):
        scheduler_class(name)
    import vllm_hybrid_npu_lab.scheduling.scheduler as mod

    assert not any(name in p for p, _ in mod.SCHEDULER_CLASS_NAMES.values())
    with pytest.raises(AttributeError):
        getattr(mod, f"{name.capitalize()}CheckpointScheduler")
