"""A seeded sampling request whose prompt is chunked, over HTTP (the ``cpu-seeded-chunk`` entry).

vLLM 0.30-0.33's V1 runner rewinds a seeded request's generator by a Philox offset after a step
whose token it discards (a prompt chunk before the last); CPU generators have no offset, and the
engine core died on the first such request (`docs/troubleshooting.md`). Three servers of the tiny
Qwen3-Next get the same fresh draw (a prompt longer than the token budget, a request seed,
temperature 0.8, ``n`` 1 and 2):

* the reference: caching off, a budget that fits the prompt (one prefill step);
* caching off and caching on (align mode, the plugin's defaults) with a budget of
  :data:`BUDGET` tokens, so the prompt takes several steps; on the caching-on server the second
  request hits the first one's prefix.

Every request answers 200 and every server is healthy afterwards. The servers return the
logprobs of the whole vocabulary, and the seed's promise is checked two ways: every sampled token
is the one the seed's own draws pick over the vocabulary (:func:`greedy_compare.seed_draw_errors`:
a generator advanced by a discarded step fails it), and the chunked runs equal the reference token for token on CPU, a first difference
accepted only where both tokens' logprobs moved less than :data:`greedy_compare.TIE_NATS`
between the runs (:func:`greedy_compare.compare_sampled`); with ``n`` 2 the second sequence's
request shares the token budget with the first, its chunks end off the 64-token grid and the
tolerance rule (:data:`greedy_compare.CHUNKING_BOUND`) applies.
"""

from __future__ import annotations

import json
import random

import pytest
import requests

from greedy_compare import CHUNKING_BOUND, TIE_NATS, Sequence, compare_outputs, compare_sampled, seed_draw_errors
from vllm_hybrid_npu.tools.server import PREFIX_CACHING_ARGS, VllmServer

#: tokens: the chunked servers' budget, a multiple of both CPU kinds' hybrid block (384 and 256
#: for the tiny model), so the plugin's round-up to the block leaves it as it is.
BUDGET = 768
TEMPERATURE = 0.8
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def draw(request, seed_for):
    rng = random.Random(seed_for(request, "draw"))
    length = rng.randint(BUDGET + 1, 4 * BUDGET)
    return {"prompt": [rng.randrange(100, 2000) for _ in range(length)],
            "seed": rng.randrange(2**31)}


def _complete(base_url: str, prompt: list[int], seed: int, n: int,
              logprobs: int) -> tuple[int, list[Sequence]]:
    body = {"model": "model", "prompt": prompt, "max_tokens": MAX_TOKENS, "n": n, "seed": seed,
            "temperature": TEMPERATURE, "ignore_eos": True, "logprobs": logprobs,
            "return_tokens_as_token_ids": True}
    r = requests.post(base_url + "/v1/completions", json=body, timeout=600)
    if r.status_code != 200:
        return r.status_code, []
    seqs = []
    for choice in sorted(r.json()["choices"], key=lambda c: c["index"]):
        lp = choice["logprobs"]
        tops = []
        for tok, tok_lp, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
            pos = {_id(t): float(v) for t, v in top.items()}
            pos[_id(tok)] = float(tok_lp)
            tops.append(pos)
        seqs.append(Sequence([_id(t) for t in lp["tokens"]], tops))
    return 200, seqs


def _id(token: str) -> int:
    return int(token.removeprefix("token_id:"))


def _serve(model, args, requests_n: tuple[int, ...], draw, vocab: int) -> tuple[list, int]:
    """Start a server with ``args``, send the draw with each ``n`` in order, the whole
    vocabulary's logprobs returned; returns ([(status, sequences)], the health status after)."""
    with VllmServer(model, [*args, "--max-logprobs", str(vocab)]).start() as server:
        answers = [_complete(server.base_url, draw["prompt"], draw["seed"], n, vocab)
                   for n in requests_n]
        health = requests.get(server.base_url + "/health", timeout=10).status_code
    return answers, health


def test_seeded_chunked_prompt_keeps_the_server_and_the_seed(tiny_model_dir, serve_args, draw,
                                                             exact_across_schedules,
                                                             e2e_target_name):
    if e2e_target_name != "cpu":
        pytest.skip("CPU generators only: CUDA's rewind by offset works, and the seed's draws "
                    "are reproduced here with a CPU generator")
    model = tiny_model_dir("qwen3_next")
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    length = len(draw["prompt"])
    print(f"prompt of {length} tokens, request seed {draw['seed']}, budget {BUDGET}")
    assert length > BUDGET  # the chunked servers take more than one step for it, by construction
    base = list(serve_args)
    runs = {
        "reference (caching off, unchunked)": _serve(
            model, ["--no-enable-prefix-caching", *base, "--max-num-batched-tokens", "8192"],
            (1, 2), draw, vocab),
        "caching off, chunked": _serve(
            model, ["--no-enable-prefix-caching", *base, "--max-num-batched-tokens", str(BUDGET)],
            (1, 2), draw, vocab),
        # the n = 2 request is cold; the n = 1 request after it hits its prefix (the suffix left
        # after the hit is under one block, so it may take one step)
        "caching on, chunked": _serve(
            model, [*PREFIX_CACHING_ARGS, *base, "--max-num-batched-tokens", str(BUDGET)],
            (2, 1), draw, vocab),
    }
    for label, (answers, health) in runs.items():
        assert [status for status, _ in answers] == [200, 200], f"{label}: {answers}"
        assert health == 200, f"{label}: /health answered {health} after the requests"
    by_n = {label: {len(seqs): seqs for _, seqs in answers} for label, (answers, _) in runs.items()}
    errors = [e for label, per_n in by_n.items() for n, seqs in per_n.items()
              for k, seq in enumerate(seqs)
              for e in seed_draw_errors(seq, draw["seed"] + k, TEMPERATURE, vocab,
                                        f"{label}, n={n}, sequence {k}:")]
    assert not errors, "\n".join(errors)
    ref = by_n.pop("reference (caching off, unchunked)")
    for label, per_n in by_n.items():
        for n in (1, 2):
            # n = 2 is two requests of one prompt sharing the budget: the second one's chunks
            # end where the first one's leave the budget, off the 64-token grid, so its prefill
            # is not bit-exact across schedules (CHUNKING_BOUND); n = 1's chunks end on the grid
            exact = exact_across_schedules and n == 1
            print(f"{label}, n={n}: {[s.tokens for s in per_n[n]]}")
            c = compare_outputs(ref[n], per_n[n], exact=exact)
            if not c.ok:  # a first difference only where the logits moved that little
                c = compare_sampled(ref[n], per_n[n], bound=TIE_NATS if exact else CHUNKING_BOUND)
                print(f"  against the reference: {c.summary()}")
            assert c.ok, "\n".join(c.errors) + "\n" + c.summary()
