"""A KV connector that transfers nothing and records every ``register_kv_caches`` call, for
e2e/test_engine_teardown.py (loaded by vLLM through ``kv_connector_module_path``).

It implements vLLM 0.30.0's ``KVConnectorBase_V1`` (and ``SupportsHMA``, so hybrid models keep
their KV-cache groups); every transfer hook is a no-op and the scheduler side never reports
external tokens.
"""

from __future__ import annotations

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

#: (connector id, its engine's ``num_gpu_blocks``, {layer: KV-cache tensor shape}) per call
CALLS: list[tuple[int, int | None, dict[str, tuple[int, ...]]]] = []


class RecordingConnector(KVConnectorBase_V1, SupportsHMA):
    """No-op connector; ``register_kv_caches`` appends to :data:`CALLS`."""

    def register_kv_caches(self, kv_caches):
        CALLS.append((id(self), self._vllm_config.cache_config.num_gpu_blocks,
                      {k: tuple(v.shape) for k, v in kv_caches.items()}))

    def start_load_kv(self, forward_context, **kwargs):
        pass

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        pass

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        pass

    def build_connector_meta(self, scheduler_output):
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        return False, None
