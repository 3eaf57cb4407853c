"""The option ``tailsplit`` (registry entry ``sub-block-tail-split-off``, vLLM
0.30): the scheduler's name of ``is_mamba_prefill_checkpoint_valid`` also answers True where vLLM's
check fails by its column clause alone, so vLLM's own split runs such a final chunk whole.

* the rule (``core.only_column_clause_fails``) against vLLM's function itself, on fresh draws:
  with ``mamba_block_size`` 1 vLLM's column clause always holds once the others do (the column
  of ``query_end`` lies past the start's), so "fails by the column alone" is "vLLM says no, and
  says yes at block 1";
* the entry: skipped by default, applied with ``off``; a bad value names the variable;
* vLLM's real ``Scheduler`` (tiny hybrid, block 256, ``--prefix-match-unit 64``, the exporter's
  checkpoint declared) splits, hand-counted: a cold prompt of ``64 < L < 256`` tokens off the
  64-token grid stops at ``L // 64 * 64`` by default and runs whole with ``off``; a hit at ``m``
  inside block 1 with the prompt ending inside block 2 stops at 512 by default and runs whole with
  ``off``; a non-final chunk keeps vLLM's stop, and so does, at ``--prefix-match-unit 32``, a
  cold prompt whose checkpoint also fails the 64-token alignment. The KV-cache manager's name
  keeps vLLM's function (it reserves no checkpoint there).
(The real engine: ``e2e/test_prefill_checkpoints.py::test_sub_block_tail_split_off_runs_the_last_chunk_whole``;
the lab: ``tests/lab/test_step_reasons.py``.)
"""

from __future__ import annotations

import json
import random
import types

import pytest

pytest.importorskip("vllm")

from vllm_hybrid_npu.core import prefill_checkpoints as core  # noqa: E402
from vllm_hybrid_npu.patches import sub_block_tail_split as T  # noqa: E402
from vllm_hybrid_npu.envs import OPTIONS_ENV  # noqa: E402


def _outside() -> str | None:
    """Why the entry is not for this machine's stack (its vLLM, target, matrix row), or None."""
    from vllm_hybrid_npu.patches.registry import stack_skip_reason
    from vllm_hybrid_npu.support import detect_stack

    return stack_skip_reason(T.PATCHES[0], detect_stack())


pytestmark = pytest.mark.skipif(_outside() is not None, reason=f"{T.ENTRY}: {_outside()}")


def test_rule_is_vllms_check_without_its_column_clause(seed):
    from vllm.v1.kv_cache_interface import is_mamba_prefill_checkpoint_valid as vllm_valid

    rng = random.Random(seed)
    counts = {"column_only": 0, "valid": 0, "other": 0}
    for _ in range(20_000):
        block = rng.choice([256, 384, 1088, 2048])
        unit = rng.choice([u for u in (16, 32, 64, block) if block % u == 0])
        start = rng.randrange(0, 4 * block) // unit * unit if rng.random() < 0.8 else rng.randrange(0, 4 * block)
        end = start + rng.randrange(1, 3 * block)
        cp = rng.randrange(0, end + unit) // unit * unit
        align = rng.choice([None, 16, 64])
        kw = dict(query_start=start, query_end=end, checkpoint_position=cp, hash_block_size=unit,
                  checkpoint_alignment=align)
        want = not vllm_valid(**kw, mamba_block_size=block) and vllm_valid(**kw, mamba_block_size=1)
        got = core.only_column_clause_fails(**kw, mamba_block_size=block)
        assert got == want, (seed, kw, block)
        counts["column_only" if got else "valid" if vllm_valid(**kw, mamba_block_size=block) else "other"] += 1
    assert all(counts.values()), (seed, counts)  # every kind drawn, so the comparison bit


def test_entry_skipped_by_default_and_applied_with_off(apply_entries, monkeypatch):
    import vllm.v1.core.sched.scheduler as S
    import vllm.v1.core.single_type_kv_cache_manager as M
    import vllm.v1.kv_cache_interface as K

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    report = apply_entries(T.ENTRY)
    assert report.skipped[T.ENTRY] == f"{OPTIONS_ENV}=tailsplit=on (vLLM's split)"
    assert S.is_mamba_prefill_checkpoint_valid is K.is_mamba_prefill_checkpoint_valid
    monkeypatch.setenv(OPTIONS_ENV, "tailsplit=off")
    report = apply_entries(T.ENTRY)
    assert report.applied == [T.ENTRY] and not report.failed, report.line()
    assert S.is_mamba_prefill_checkpoint_valid is not K.is_mamba_prefill_checkpoint_valid
    assert M.is_mamba_prefill_checkpoint_valid is K.is_mamba_prefill_checkpoint_valid
    monkeypatch.setenv(OPTIONS_ENV, "tailsplit=no")
    with pytest.raises(ValueError, match=OPTIONS_ENV):
        T.tail_split()


@pytest.fixture(scope="module")
def scheduler_of(tmp_path_factory):
    """``scheduler_of()``: vLLM's real ``Scheduler`` for the tiny hybrid, block 256,
    ``--prefix-match-unit 64``, the exporter's checkpoint declared (alignment 64)."""
    from vllm_hybrid_npu_lab.model import build_setup
    from vllm_hybrid_npu_lab.presets import TINY_HYBRID, resolve_model
    from vllm_hybrid_npu_lab.upstream_grid import UpstreamSetting

    d = tmp_path_factory.mktemp("tiny-hybrid-tail-split")
    (d / "config.json").write_text(json.dumps(TINY_HYBRID))
    cfg = resolve_model(str(d))[1]

    def make(unit=64):
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        setup = build_setup(cfg, kv_cache_bytes=64 << 20, max_model_len=4096, block_size=256,
                            prefill_checkpoints=True, tune=UpstreamSetting(pmu=unit, ckpt=True).tune)
        sched = Scheduler(vllm_config=setup.vllm_config, kv_cache_config=setup.kv_cache_config,
                          structured_output_manager=StructuredOutputManager(setup.vllm_config),
                          block_size=setup.scheduler_block_size,
                          hash_block_size=setup.hash_block_size)
        assert sched.cache_config.block_size == 256 and sched.hash_block_size == unit
        assert sched.mamba_has_prefill_checkpoint_blocks
        return sched

    return make


def _request(prompt, computed=0):
    return types.SimpleNamespace(request_id="r", num_prompt_tokens=prompt, num_tokens=prompt,
                                 num_computed_tokens=computed, shared_prefix_boundary=0)


def test_vllms_split_runs_the_column_only_chunk_whole(scheduler_of, apply_entries, monkeypatch, seed):
    rng = random.Random(seed)
    cold = rng.choice([n for n in range(65, 256) if n % 64])
    m = 256 + 64 * rng.randrange(1, 4)  # a hit inside block 1
    end = rng.choice([n for n in range(512 + 65, 768) if n % 64])  # inside block 2
    odd = rng.choice([n for n in range(256 + 65, 512) if n % 64])  # from 256: column and unit
    # (a hit at 256, the checkpoint (odd - 1) // 64 * 64 >= 320 in the start's column)
    # unit 32: a cold prompt whose checkpoint (p - 1) // 32 * 32 is an odd multiple of 32 fails
    # the 64-token alignment as well as the column: vLLM's stop at p // 32 * 32 either way
    p32 = rng.choice([n for n in range(97, 256) if (n - 1) // 32 % 2 and n % 32])
    where = dict(seed=seed, cold=cold, m=m, end=end, odd=odd, p32=p32)

    def splits():
        s, s32 = scheduler_of(), scheduler_of(32)
        return (s._mamba_block_aligned_split(_request(cold), cold),
                s._mamba_block_aligned_split(_request(end), end - m, m),
                s._mamba_block_aligned_split(_request(odd), odd - 256, 256),
                s._mamba_block_aligned_split(_request(3000), 700),  # a non-final chunk
                s32._mamba_block_aligned_split(_request(p32), p32))

    monkeypatch.delenv(OPTIONS_ENV, raising=False)
    apply_entries(T.ENTRY)
    vllms = splits()
    monkeypatch.setenv(OPTIONS_ENV, "tailsplit=off")
    assert apply_entries(T.ENTRY).applied == [T.ENTRY]
    ours = splits()
    # vLLM: the tail stop, the next block boundary, the tail stop from 256, the non-final chunk
    # floored to the block, the unit-32 tail stop
    assert vllms == (cold // 64 * 64, 512 - m, odd // 64 * 64 - 256, 512, p32 // 32 * 32), where
    assert ours == (cold, end - m, odd - 256, 512, p32 // 32 * 32), where
