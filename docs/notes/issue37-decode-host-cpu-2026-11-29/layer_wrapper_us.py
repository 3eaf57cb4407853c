"""Host time of the exporter's GDN layer wrapper (``gdn_prefill_checkpoint.make_forward``, the
``_forward_core`` entry of CUDA and vllm-ascend; not run on CPU, whose GDN function has its own
wrapper) on a step without checkpoints, around a stand-in upstream that returns at once, against
calling that upstream directly: microseconds per call (best of 7 repeats of 200,000 calls).

    PYTHONPATH=$PWD python docs/notes/issue37-decode-host-cpu-2026-11-29/layer_wrapper_us.py
"""

import timeit
import types

import vllm.forward_context as fc
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata

from vllm_hybrid_npu.patches import gdn_prefill_checkpoint as mod

PREFIX = "model.layers.0.linear_attn"
ctx = types.SimpleNamespace(attn_metadata={PREFIX: GDNAttentionMetadata(0, 0, 0, 0, 0, 0, 0)})
fc.get_forward_context = lambda: ctx  # the step's metadata: a decode-only batch, no checkpoints


def upstream(self, mixed_qkv, b, a, out):
    return out


layer = types.SimpleNamespace(prefix=PREFIX)
wrapped = mod.make_forward(upstream, None)
N = 200_000
for name, fn in (("upstream alone", lambda: upstream(layer, 1, 2, 3, 4)),
                 ("make_forward wrapper", lambda: wrapped(layer, 1, 2, 3, 4))):
    print(f"{name}: {min(timeit.repeat(fn, number=N, repeat=7)) / N * 1e6:.3f} us per call")
