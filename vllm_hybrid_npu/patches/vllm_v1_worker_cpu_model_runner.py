"""vLLM's CPU model runner: a seeded request survives a prompt chunk whose sampled token is dropped.

For a request whose prompt does not end in this step (chunked prefill), vLLM's V1 runner samples a
token with the others and then discards it (``discard_request_mask``, set in ``_prepare_inputs``).
``GPUModelRunner._bookkeeping_sync`` then rewinds that request's per-request generator by its
Philox offset: ``gen.set_offset(gen.get_offset() - 4)``. vLLM's CPU runner (``CPUModelRunner``, a
subclass that does not override it) creates those generators on the CPU
(``torch.Generator(device=self.device)`` in ``_update_states``), a Mersenne Twister with no offset:
``get_offset`` raises ``RuntimeError: CPU Generator does not use offset`` and the engine core dies
on the first request with ``seed`` set whose prompt takes more than one step. CUDA's generator has
the offset (the rewind works there); vLLM's V2 runner does not rewind this way.

The entry wraps ``CPUModelRunner.sample_tokens`` (the one method that holds both the sampling and
the rewind): while it runs, the CPU generators of the rows whose token is discarded are taken out of
``input_batch.generators`` (the dict ``SamplingMetadata.generators`` is) and put back afterwards,
also when it raises. Invariant: a CPU generator advances only in a step whose token its request
keeps, so the first kept token of a chunked prompt draws what an unchunked prompt's first token
draws (the seed's tokens do not depend on the chunking). The discarded token of that step is drawn
from the unseeded noise. Rows whose token is kept keep their generators, non-CPU generators are
left alone, and a step with no held-out generator runs upstream's code as it is; where every
generator of a step is held out, vLLM 0.30's sampler takes its unseeded fast path for that step,
which only rows without a generator see.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any

from vllm_hybrid_npu.patches.registry import Patch
from vllm_hybrid_npu.support import Stack

MODULE = "vllm.v1.worker.cpu_model_runner"
VERSIONS = ("0.30.0", "0.32.0", "0.33.0")


def discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """The CPU generators of ``runner``'s rows whose sampled token this step discards.

    Args:
        runner: a vLLM V1 model runner after ``execute_model`` (its ``input_batch.generators``:
            batch row -> ``torch.Generator``; ``discard_request_mask.np``: bool per row).

    Returns:
        ``{row: generator}`` for rows ``< input_batch.num_reqs`` whose mask is set and whose
        generator is on the CPU (empty when no row has a generator).
    """
    generators = runner.input_batch.generators
    if not generators:
        return {}
    discard = runner.discard_request_mask.np[: runner.input_batch.num_reqs]
    return {row: gen for row, gen in generators.items()
            if row < len(discard) and discard[row] and gen.device.type == "cpu"}


def _make_sample_tokens(upstream: Any, stack: Stack) -> Any:
    @functools.wraps(upstream)
    def sample_tokens(self, grammar_output, *args, **kwargs):
        held = discarded_cpu_generators(self)
        if not held:
            return upstream(self, grammar_output, *args, **kwargs)
        generators = self.input_batch.generators
        for row in held:
            del generators[row]
        try:
            return upstream(self, grammar_output, *args, **kwargs)
        finally:
            generators.update(held)

    return sample_tokens


def _probe(upstream: Any, stack: Stack) -> str | None:
    runner = sys.modules[MODULE].CPUModelRunner
    try:
        source = inspect.getsource(runner._bookkeeping_sync)
    except (AttributeError, OSError, TypeError):
        return "the CPU runner has no _bookkeeping_sync source to check (upstream kept)"
    if "set_offset" not in source:
        return "the installed CPU runner does not rewind generators by offset"
    return None


PATCHES = [
    Patch(name="cpu-seeded-chunk", module=MODULE, qualname="CPUModelRunner.sample_tokens",
          targets=("cpu",), vllm=VERSIONS, make=_make_sample_tokens, probe=_probe,
          signature=("self", "grammar_output"), behaviour_changing=False,
          why="a seeded request's CPU generator is left out of a step whose token vLLM discards "
              "(a prompt chunk before the last), instead of GPUModelRunner._bookkeeping_sync's "
              "Philox-offset rewind, which raises on CPU generators and killed the engine core",
          until="vLLM's CPU runner rewinds CPU generators itself (or stops drawing for discarded "
                "rows)"),
]
