"""``cpu-seeded-chunk``: a seeded request's CPU generator through a step whose token vLLM
discards (vllm_hybrid_npu/patches/vllm_v1_worker_cpu_model_runner.py).

The runner here is a stand-in holding real torch generators, vLLM's discard mask as a numpy
array and an upstream ``sample_tokens`` that does what vLLM's does to the generators: one draw
per generator in ``input_batch.generators`` (``TopKTopPSampler.forward_cpu``), then
``_bookkeeping_sync``'s rewind of each discarded row's generator by offset, which raises on a
CPU generator. The server-level test is e2e/test_seeded_chunked_prefill.py.
"""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_hybrid_npu.patches import vllm_v1_worker_cpu_model_runner as entry_mod
from vllm_hybrid_npu.patches.registry import is_ours
from vllm_hybrid_npu.support import detect_stack

VOCAB = 64


def _upstream(self, grammar_output):
    q = torch.empty(self.input_batch.num_reqs, VOCAB)
    for row, gen in self.input_batch.generators.items():
        if row < self.input_batch.num_reqs:
            q[row].exponential_(generator=gen)
    for row in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
        gen = self.input_batch.generators.get(int(row))
        if gen is not None:
            gen.set_offset(gen.get_offset() - 4)
    if self.fail:
        raise RuntimeError("upstream failed")
    return q


def _runner(rng, num_reqs: int, fail: bool = False):
    discard = np.zeros(num_reqs + 2, dtype=bool)  # vLLM's buffer is longer than the batch
    rows = list(range(num_reqs))
    for row in rng.sample(rows, rng.randint(0, num_reqs)):
        discard[row] = True
    discard[num_reqs:] = True  # stale entries past num_reqs (the buffer is max_num_reqs long)
    generators = {row: torch.Generator().manual_seed(rng.randrange(2**31))
                  for row in rng.sample(rows, rng.randint(0, num_reqs))}
    generators[num_reqs] = torch.Generator().manual_seed(rng.randrange(2**31))  # a stale row
    return SimpleNamespace(input_batch=SimpleNamespace(generators=generators, num_reqs=num_reqs),
                           discard_request_mask=SimpleNamespace(np=discard), fail=fail)


def test_a_cpu_generator_has_no_offset():
    """The defect's premise, on this torch: vLLM's rewind cannot run on a CPU generator."""
    with pytest.raises(RuntimeError, match="offset"):
        torch.Generator().get_offset()


@pytest.mark.parametrize("fail", [False, True])
def test_discarded_rows_keep_their_state_kept_rows_draw_once(rng, fail):
    wrapped = entry_mod._make_sample_tokens(_upstream, detect_stack("cpu"))
    for _ in range(20):
        runner = _runner(rng, rng.randint(1, 6), fail=fail)
        gens = dict(runner.input_batch.generators)
        before = {row: g.get_state().clone() for row, g in gens.items()}
        discard = runner.discard_request_mask.np
        if fail:
            with pytest.raises(RuntimeError, match="upstream failed"):
                wrapped(runner, None)
        else:
            wrapped(runner, None)
        # the same generator objects on the same rows afterwards, also when upstream raised
        assert runner.input_batch.generators == gens
        for row, gen in gens.items():
            if row >= runner.input_batch.num_reqs:  # stale: neither held out nor drawn from
                assert torch.equal(gen.get_state(), before[row]), f"stale row {row}"
            elif discard[row]:
                assert torch.equal(gen.get_state(), before[row]), f"row {row} advanced"
            else:  # one draw of VOCAB, as an unwrapped step would
                ref = torch.Generator()
                ref.set_state(before[row])
                torch.empty(VOCAB).exponential_(generator=ref)
                assert torch.equal(gen.get_state(), ref.get_state()), f"row {row}"


def test_without_the_entry_the_rewind_raises(rng):
    """Control: the stand-in's upstream alone fails where a discarded row has a generator."""
    runner = _runner(rng, 3)
    runner.discard_request_mask.np[0] = True
    runner.input_batch.generators[0] = torch.Generator().manual_seed(1)
    with pytest.raises(RuntimeError, match="offset"):
        _upstream(runner, None)


def test_applies_where_the_installed_cpu_runner_rewinds_by_offset():
    """The probe reads the installed vLLM's CPU runner: 0.30.0, 0.32.0 and 0.33.0 rewind by
    offset in ``GPUModelRunner._bookkeeping_sync`` (not overridden by ``CPUModelRunner``), so
    the entry applies, and ``sample_tokens`` has the signature it wraps."""
    import vllm

    if vllm.__version__.startswith("0.34."):
        pytest.skip("vLLM 0.34's CPU worker builds the V2 runner only (its V1 runner module no "
                    "longer imports): the entry is outside its row")
    runner_mod = pytest.importorskip("vllm.v1.worker.cpu_model_runner")
    cls = runner_mod.CPUModelRunner
    # the entry sets the attribute on CPUModelRunner once applied in this process
    assert "sample_tokens" not in vars(cls) or is_ours(vars(cls)["sample_tokens"])
    assert "_bookkeeping_sync" not in vars(cls) and "_sample" not in vars(cls)
    upstream = cls.__mro__[1].sample_tokens
    assert "set_offset(" in inspect.getsource(cls._bookkeeping_sync)
    (patch,) = entry_mod.PATCHES
    assert patch.probe(upstream, detect_stack("cpu")) is None
    params = tuple(inspect.signature(upstream).parameters)
    assert params[: len(patch.signature)] == patch.signature
