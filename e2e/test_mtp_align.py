"""Speculative decoding with the model's MTP head in align mode (issue #14), on the tiny random
Qwen3-Next with a one-layer MTP head (``make-model --mtp-layers 1``).

Engines: ``speculative_config={"method": "mtp", "num_speculative_tokens": 2}`` (vLLM 0.30 maps
``qwen3_next`` to its ``Qwen3NextMTP`` draft model; 2 tokens reuse the one MTP layer twice),
in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), one after the other, once per model runner:

* *align*: ``--enable-prefix-caching --mamba-cache-mode align``;
* *off*: prefix caching off (the reference), same speculative decoding.

What runs where:

* ``test_mtp_head_loaded_from_checkpoint`` (CPU and CUDA): the align engine starts (config
  validation, KV-cache groups with ``num_speculative_blocks`` = 2, draft model loaded) and every
  ``mtp.*`` tensor of the checkpoint is found, by value, in vLLM's draft model: norms exactly, the
  linear layers by their outputs on random inputs (vLLM's CPU backend repacks linear weights), the
  routed experts as multisets of values (repacked in place on CPU). vLLM's own loader does not
  catch a missing head tensor: with ``mtp.fc.weight`` or ``mtp.layers.0.self_attn.k_proj.weight``
  deleted from the checkpoint, vLLM 0.30.0 (CPU) starts without an error (measured 2026-11-23),
  because its strict check (``default_loader.py:447-470``) counts every parameter of a module
  whose quant method has ``process_weights_after_loading`` as loaded, i.e. of every linear and
  MoE layer.
* the generation tests need CUDA: vLLM 0.30.0's CPU backend cannot decode speculatively.
  (1) In align mode the first step raises ``TypeError: 'function' object is not subscriptable``
  at ``vllm/v1/worker/mamba_utils.py:1213`` (``precopy_mamba_align_fused_kernel[grid]``, reached
  from ``gpu_model_runner.py:4348`` ``preprocess_mamba``): with speculative decoding on a hybrid
  model the V1 runner uses the fused Triton pre-copy/post-process kernels
  (``MambaBuffers.create(with_postprocess_align=True)``, ``gpu_model_runner.py:1064``), which have
  no CPU counterpart. (2) Even with prefix caching off, the CPU runner's kernel swaps
  (``cpu_model_runner.py:81-117``) replace module attributes that vLLM's warm-up dispatchers
  captured at import, so the Triton kernels stay in place and the dispatcher raises
  ``TypeError: Cannot inspect kernel parameters for function``
  (``jit_warmup_triton_helper.py:238``): with 2 speculative tokens from the second draft step
  (``_eagle_step_slot_mapping_metadata``, ``llm_base_proposer.py:794``), with 1 from the greedy
  rejection sampler (``_rejection_greedy_sample``, ``rejection_sampler.py:469``).

The CUDA tests run the V2 GPU model runner (vLLM's default on CUDA) and the V1 runner
(``VLLM_USE_V2_MODEL_RUNNER=0``, vLLM's environment cache reset around it). They check: shared-
prefix prompts hit the prefix cache in whole blocks (with EAGLE/MTP drafting vLLM drops the last
matched block, ``kv_cache_coordinator.py:903-941``, and align mode stops prefill chunks one block
earlier, ``scheduler.py:443-446``, so a hit may be a block shorter than without it); the greedy
outputs of *align* equal those of *off* under :func:`greedy_compare.compare_greedy`'s rule (both
speculate; they differ in schedule only: a cache hit vs a cold prefill, align mode's chunk ends
at block boundaries), with :data:`greedy_compare.CHUNKING_BOUND`, or token for token where the
target's ``exact_across_schedules`` says so (e2e/conftest.py); draft tokens were proposed and
verified. Engines use the e2e target's engine arguments (on CUDA ``block_size=64``, so align-mode
chunk ends fall on the GDN kernels' 64-token grid) and end with :func:`engines.shutdown_engine`.
Prompts are drawn fresh (``seed_for``: the seed is printed on failure).
"""

from __future__ import annotations

import random

import pytest
from engines import metric_counter, shutdown_engine  # e2e/engines.py
from greedy_compare import CHUNKING_BOUND, Sequence, compare_outputs  # e2e/greedy_compare.py

NUM_SPEC = 2  # draft tokens per step
MAX_TOKENS = 12
RUNNERS = ("v2", "v1")
SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")  # vllm:spec_decode_num_<name>


def _gen(llm, prompts):
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=20)
    return llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)


def _out(mod, x):
    y = mod(x)
    return y[0] if isinstance(y, tuple) else y


def head_mismatches(draft, ckpt, gen) -> tuple[set[str], list[str]]:
    """Compare vLLM's Qwen3-Next draft model (``Qwen3NextMTP``) with the checkpoint's ``mtp.*``
    tensors.

    Args:
        draft: the loaded ``Qwen3NextMTP`` module.
        ckpt: ``{name: tensor}`` of the checkpoint (CPU).
        gen: CPU ``torch.Generator`` for the random inputs of the linear layers.

    Returns:
        (the ``mtp.*`` names compared, a description of each mismatch). Norm weights must be
        equal; a linear layer's output on 4 random bf16 rows must be within 2% (of the largest
        reference entry) of ``x @ W.T`` with ``W`` the checkpoint tensor(s) stacked as vLLM fuses
        them (q|k|v, gate|up); a routed expert's fused weights must hold the same multiset of
        values as its checkpoint tensors (any layout).
    """
    import torch

    model = draft.model
    checked: set[str] = set()
    bad: list[str] = []

    def same(param, name):
        checked.add(name)
        if not param.detach().cpu().equal(ckpt[name]):
            bad.append(f"{name}: differs from the draft model's parameter")

    def linear(mod, names):
        checked.update(names)
        w = torch.cat([ckpt[n] for n in names]).float()
        x = torch.randn(4, w.shape[1], generator=gen).to(torch.bfloat16)
        device = next(iter(mod.parameters())).device
        y = _out(mod, x.to(device)).float().cpu()
        ref = x.float() @ w.T
        err = (y - ref).abs().max().item() if y.shape == ref.shape else float("inf")
        if not err <= 0.02 * ref.abs().max().item():
            bad.append(f"{'+'.join(names)}: output {tuple(y.shape)} off {tuple(ref.shape)} by {err:.4g}")

    def values(t):
        return t.detach().float().cpu().flatten().sort().values

    linear(model.fc, ["mtp.fc.weight"])
    for n in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden"):
        same(getattr(model, n).weight, f"mtp.{n}.weight")
    for i, layer in enumerate(model.layers):
        p = f"mtp.layers.{i}."
        same(layer.input_layernorm.weight, p + "input_layernorm.weight")
        same(layer.post_attention_layernorm.weight, p + "post_attention_layernorm.weight")
        same(layer.self_attn.q_norm.weight, p + "self_attn.q_norm.weight")
        same(layer.self_attn.k_norm.weight, p + "self_attn.k_norm.weight")
        linear(layer.self_attn.qkv_proj, [p + f"self_attn.{a}_proj.weight" for a in "qkv"])
        linear(layer.self_attn.o_proj, [p + "self_attn.o_proj.weight"])
        mlp = layer.mlp
        linear(mlp.gate, [p + "mlp.gate.weight"])
        linear(mlp.shared_expert_gate, [p + "mlp.shared_expert_gate.weight"])
        linear(mlp.shared_expert.gate_up_proj,
               [p + "mlp.shared_expert.gate_proj.weight", p + "mlp.shared_expert.up_proj.weight"])
        linear(mlp.shared_expert.down_proj, [p + "mlp.shared_expert.down_proj.weight"])
        experts = dict(mlp.experts.named_parameters())
        w13 = [v for k, v in experts.items() if k.endswith("w13_weight")]
        w2 = [v for k, v in experts.items() if k.endswith("w2_weight")]
        if len(w13) != 1 or len(w2) != 1:
            bad.append(f"{p}mlp.experts: no single w13/w2 pair among {sorted(experts)}")
            continue
        for e in range(w13[0].shape[0]):
            gate_up = [p + f"mlp.experts.{e}.{k}_proj.weight" for k in ("gate", "up")]
            down = p + f"mlp.experts.{e}.down_proj.weight"
            checked.update(gate_up + [down])
            if not values(w13[0][e]).equal(values(torch.cat([ckpt[n] for n in gate_up]))):
                bad.append(f"{'+'.join(gate_up)}: not the values of expert {e}'s w13")
            if not values(w2[0][e]).equal(values(ckpt[down])):
                bad.append(f"{down}: not the values of expert {e}'s w2")
    return checked, bad


@pytest.fixture(scope="module", params=RUNNERS)
def runs(request, tiny_model_dir, engine_args, e2e_target_name, seed_for):
    runner = request.param
    if e2e_target_name != "cuda" and runner == "v2":
        pytest.skip("the CPU target has one model runner (CPUModelRunner, a V1 runner)")
    import torch
    import vllm.envs
    from safetensors.torch import load_file
    from vllm import LLM
    from vllm.model_executor.models import qwen3_next_mtp

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if e2e_target_name == "cuda":
        mp.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
    vllm.envs.disable_envs_cache()  # an earlier engine of this process froze the environment
    loads = []
    upstream_load = qwen3_next_mtp.Qwen3NextMTP.load_weights

    def recording_load(self, weights):
        loaded = upstream_load(self, weights)
        loads.append(self)
        return loaded

    mp.setattr(qwen3_next_mtp.Qwen3NextMTP, "load_weights", recording_load)
    model = tiny_model_dir("qwen3_next", mtp_layers=1)
    spec = {"method": "mtp", "num_speculative_tokens": NUM_SPEC}
    out = {"runner": runner}
    prompts = None
    try:
        for name, kw in [("align", dict(enable_prefix_caching=True, mamba_cache_mode="align")),
                         ("off", dict(enable_prefix_caching=False))]:
            llm = LLM(model=str(model), speculative_config=spec,
                      **{**engine_args, "disable_log_stats": False, **kw})
            try:
                cfg = llm.llm_engine.vllm_config
                worker_runner = (llm.llm_engine.engine_core.engine_core.model_executor
                                 .driver_worker.worker.model_runner)
                r = {"bs": cfg.cache_config.block_size, "mode": cfg.cache_config.mamba_cache_mode,
                     "method": cfg.speculative_config.method,
                     "num_spec": cfg.speculative_config.num_speculative_tokens,
                     "runner": type(worker_runner).__module__ + "." + type(worker_runner).__name__}
                if name == "align":
                    groups = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_config \
                        .kv_cache_groups
                    r["spec_blocks"] = sorted({
                        getattr(g.kv_cache_spec, "num_speculative_blocks", None) for g in groups
                        if type(g.kv_cache_spec).__name__ == "MambaSpec"})
                    r["layers"] = [n for g in groups for n in g.layer_names]
                    sched = llm.llm_engine.engine_core.engine_core.scheduler
                    r["policy"] = getattr(sched, "checkpoint_policy", "upstream")
                    r["sched_class"] = type(sched).__module__ + "." + type(sched).__name__
                    r["ckpt_blocks"] = sorted({
                        getattr(g.kv_cache_spec, "num_prefill_checkpoint_blocks", None)
                        for g in groups if type(g.kv_cache_spec).__name__ == "MambaSpec"})
                    assert len(loads) == 1, f"{len(loads)} Qwen3NextMTP loads"
                    gen = torch.Generator().manual_seed(seed_for(request, f"inputs-{runner}"))
                    ckpt = load_file(model / "model.safetensors")
                    r["checked"], r["mismatches"] = head_mismatches(loads[0], ckpt, gen)
                    r["ckpt_mtp"] = {k for k in ckpt if k.startswith("mtp.")}
                    if e2e_target_name != "cuda":
                        out[name] = r
                        break  # CPU: no speculative decoding (module docstring)
                    rng = random.Random(seed_for(request, f"prompts-{runner}"))
                    bs = r["bs"]
                    draw = lambda n: [rng.randrange(10, 2000) for _ in range(n)]  # noqa: E731
                    shared = draw(3 * bs + bs // 2)
                    prompts = [shared + draw(bs // 3) for _ in range(3)]
                assert r["bs"] == out.get("align", r)["bs"], "block size differs between engines"
                # deltas: the metrics registry is per process, not per engine
                counts0 = {k: metric_counter(llm, f"vllm:spec_decode_num_{k}") for k in SPEC_COUNTERS}
                r["outs"] = _gen(llm, prompts[:1]) + _gen(llm, prompts[1:]) + _gen(llm, prompts[:1])
                for k in SPEC_COUNTERS:
                    r[k] = metric_counter(llm, f"vllm:spec_decode_num_{k}") - counts0[k]
                out[name] = r
            finally:
                shutdown_engine(llm)
                del llm
        yield prompts, out
    finally:
        mp.undo()
        vllm.envs.disable_envs_cache()


def test_mtp_head_loaded_from_checkpoint(runs):
    _, out = runs
    r = out["align"]
    assert r["method"] == "mtp" and r["num_spec"] == NUM_SPEC and r["mode"] == "align", r
    assert r["spec_blocks"] == [NUM_SPEC], r["spec_blocks"]  # every GDN group: 2 speculative blocks
    assert "mtp.layers.0.self_attn.attn" in r["layers"], r["layers"]  # the head's KV cache
    assert not r["mismatches"], "\n".join(r["mismatches"])
    assert r["checked"] == r["ckpt_mtp"], sorted(r["ckpt_mtp"] ^ r["checked"])


def test_mtp_checkpoint_declared_only_where_the_worker_writes_it(runs, e2e_target_name):
    """With MTP, vLLM changes align mode itself (the eagle block drop, MTP's prefill lookahead);
    the scheduler stays vLLM's own. The plugin declares its one prefill checkpoint block per GDN
    group only where its worker writes under speculative decoding: vLLM 0.30's CPU path on a CPU
    without AMX tiles (vLLM's C++ conv kernel runs there). Elsewhere (CUDA, an AMX CPU) none is
    declared and vLLM keeps its split."""
    import torch
    import vllm

    _, out = runs
    r = out["align"]
    assert r["policy"] == "upstream", r["policy"]
    assert r["sched_class"].startswith("vllm.v1.core.sched."), r["sched_class"]
    amx = bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())
    writes = e2e_target_name == "cpu" and vllm.__version__.startswith("0.30.0") and not amx
    assert r["ckpt_blocks"] == ([1] if writes else [0]), (r["ckpt_blocks"], e2e_target_name, amx)


@pytest.mark.cuda
def test_model_runner_in_use(runs):
    _, out = runs
    for name in ("align", "off"):
        module = out[name]["runner"]
        if out["runner"] == "v2":
            assert ".worker.gpu." in module, module
        else:
            assert ".worker.gpu_model_runner." in module, module


@pytest.mark.cuda
def test_align_hits_shared_prefix_in_whole_blocks(runs):
    prompts, out = runs
    bs = out["align"]["bs"]
    cached = [o.num_cached_tokens for o in out["align"]["outs"]]
    bound = (len(prompts[0]) - 1) // bs * bs  # whole blocks, the last prompt token computed
    assert cached[0] == 0, cached
    assert all(0 < c <= bound and c % bs == 0 for c in cached[1:]), (cached, bs, bound)
    assert all(o.num_cached_tokens == 0 for o in out["off"]["outs"])


@pytest.mark.cuda
def test_align_greedy_equals_caching_off(runs, exact_across_schedules):
    _, out = runs
    ref = [Sequence.from_output(o.outputs[0]) for o in out["off"]["outs"]]
    got = [Sequence.from_output(o.outputs[0]) for o in out["align"]["outs"]]
    assert all(len(s.tokens) == MAX_TOKENS for s in ref + got)
    c = compare_outputs(ref, got, exact_across_schedules, bound=CHUNKING_BOUND)
    assert c.ok, "\n".join(c.errors) + "\n" + c.summary()


@pytest.mark.cuda
def test_drafts_proposed_and_verified(runs):
    _, out = runs
    for name in ("align", "off"):
        r = out[name]
        # at least one verify step per request after its prefill, NUM_SPEC tokens each
        assert r["draft_tokens"] >= NUM_SPEC * len(r["outs"]), (name, r["draft_tokens"])
        assert r["draft_tokens"] == NUM_SPEC * r["drafts"], (name, r["draft_tokens"], r["drafts"])
        assert 0 <= r["accepted_tokens"] <= r["draft_tokens"], (name, r["accepted_tokens"])
