"""The `dsv4` command line. Each subcommand imports what it needs when it runs, so `dsv4 --help` stays fast."""

from __future__ import annotations

import argparse
import os
import re
import sys
from types import MappingProxyType

# Mirrors dsv4.checkpoint.writer.FORMATS / NAMINGS and dsv4.runtime.cache.KV_CACHE_DTYPES (kept literal so --help
# imports no torch; a test checks).
FORMATS = ("bf16", "official", "nvfp4-experts", "nvfp4")
NAMINGS = ("deepseek", "hf")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8-indexer")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_HELP = ("fp8 (experimental): the attention's compressed entries as packed fp8 rows (584 instead of 1,024 "
                 "bytes, rounded as DeepSeek's reference rounds them) and the lightning indexer's keys in fp8 e4m3 "
                 "with a scale each; fp8-indexer: only the indexer's keys; auto: the compute dtype (default)")
FORMAT_HELP = ("bf16: every linear in bf16. official: DeepSeek's release layout (FP8 128x128 UE8M0 attention, "
               "indexer wq_b, shared experts and MTP projections; MXFP4 routed experts; bf16 compressors, router, "
               "embedding, head). nvfp4-experts: official with NVFP4 routed experts (NVIDIA's V4 builds) plus "
               "hf_quant_config.json. nvfp4: every linear NVFP4 except compressor projections, router, embedding "
               "and head (plus hf_quant_config.json).")
NAMING_HELP = ("deepseek: DeepSeek's tensor names and config.json. hf: names and config.json transformers "
               "reads (what save_pretrained writes for bf16; per-expert module names when quantized).")


def _size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*", text, re.IGNORECASE)
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size like 4GB, 500MB or 1048576")
    unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(unit or " "))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dsv4", description="DeepSeek-V4 checkpoints and inference.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    c = sub.add_parser("convert", help="convert a checkpoint to another format or naming",
                       description="Read a V4 checkpoint in any supported dialect (DeepSeek, NVIDIA NVFP4, "
                                   "transformers stacked / per-expert / save_pretrained) and format, and write it "
                                   "as sharded safetensors + model.safetensors.index.json + config.json, one "
                                   "tensor group at a time. Quantized sources are dequantized exactly and "
                                   "re-quantized; MXFP4 -> NVFP4 is re-blocked losslessly where possible. NVFP4 "
                                   "input scales are 1.0 (no calibration).")
    c.add_argument("src", help="checkpoint folder (or a single .safetensors file next to its config.json)")
    c.add_argument("dst", help="output folder (created; must not already hold a checkpoint unless --overwrite)")
    c.add_argument("--format", required=True, choices=FORMATS, help=FORMAT_HELP)
    c.add_argument("--naming", default="deepseek", choices=NAMINGS, help=NAMING_HELP + " Default: deepseek.")
    c.add_argument("--shard-size", type=_size, default="4GiB", metavar="SIZE",
                   help="largest shard data size, e.g. 4GB (default), 500MB or a byte count; units are powers of 1024")
    c.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")
    c.add_argument("--no-progress", action="store_true", help="no progress bar")

    t = sub.add_parser("make-tiny", help="write a small random V4 checkpoint (tests, demos)",
                       description="Write a random ModelConfig.tiny() checkpoint: 5 layers (sliding, sliding, CSA "
                                   "ratio 4, HCA ratio 128, CSA) + an MTP block, 2 hash-routed layers, 8 experts; "
                                   "non-trivial values everywhere and the SwiGLU clamp hit by a fair share of "
                                   "expert activations.")
    t.add_argument("dst", help="output folder")
    t.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    t.add_argument("--format", default="bf16", choices=FORMATS, help="storage format (default bf16); " + FORMAT_HELP)
    t.add_argument("--naming", default="deepseek", choices=NAMINGS, help="default deepseek; " + NAMING_HELP)
    t.add_argument("--shard-size", type=_size, default="4GiB", metavar="SIZE", help="largest shard data size")
    t.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in DST")

    i = sub.add_parser("inspect", help="describe a checkpoint and list everything dsv4 refuses in it",
                       description="Print the dialect, the storage format and bytes of each tensor group, "
                                   "parameter counts against config.json, and every problem dsv4 would refuse "
                                   "(exit status 1 if there is any). Reads headers only unless --audit.")
    i.add_argument("path", help="checkpoint folder or .safetensors file")
    i.add_argument("--audit", action="store_true",
                   help="also read every tensor and report all-zero and non-finite ones (dsv4.checkpoint.audit)")
    i.add_argument("--plan", action="store_true",
                   help="also plan a parallel layout (the sizes below): weight bytes per rank, refused if the model "
                        "cannot be split so or a rank's weights do not fit --device-memory")
    _parallel_args(i, collectives=False)
    i.add_argument("--device-memory", type=_size, metavar="SIZE",
                   help="memory of one device for --plan, e.g. 141GiB (default: this machine's GPU, if any)")
    i.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of --device-memory the weights and the cache may take (default 0.9)")
    i.add_argument("--max-num-seqs", type=int, default=8,
                   help="sequence slots whose fixed state --plan sets aside before the cache's pages (default 8)")
    i.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_HELP)
    for name, help_, desc in (
            ("generate", "generate text from a prompt, streaming it as it is produced",
             "Load a checkpoint (or the built-in demo model) and continue PROMPT, printing the text as it is "
             "produced. As in vLLM, the prompt is tokenized without a BOS; start it with "
             "<｜begin▁of▁sentence｜> for one."),
            ("chat", "chat with a model interactively",
             "An interactive chat in DeepSeek-V4's chat format: type a message, get the streamed reply; the "
             "conversation is kept. Ctrl-C stops a reply (the turn is dropped); /reset starts over; /exit, /quit "
             "or end of input (Ctrl-D) quits.")):
        g = sub.add_parser(name, help=help_, description=desc)
        if name == "generate":
            g.add_argument("prompt", help="the text to continue")
        else:
            g.add_argument("--system", help="a system prompt")
            g.add_argument("--thinking", action="store_true", help="thinking mode (reasoning before the answer)")
        _model_args(g)
        _sampling_args(g, max_tokens=64 if name == "generate" else 512)
    _serve_args(sub)
    return p


def _serve_args(sub) -> None:
    s = sub.add_parser(
        "serve", help="serve a model over HTTP: OpenAI's and Anthropic's APIs",
        description="Serve MODEL (a checkpoint folder or `demo`) over HTTP until SIGINT / SIGTERM: POST "
                    "/v1/completions, /v1/chat/completions (DeepSeek-V4 chat encoding; thinking through "
                    "chat_template_kwargs {\"thinking\": true}, reasoning as reasoning_content; DSML tool calls "
                    "as tool_calls), /v1/messages (Anthropic), /tokenize, /detokenize; GET /v1/models, /health, "
                    "/metrics (Prometheus). Refusals are OpenAI error objects: 400 bad parameter or JSON, prompt past "
                    "--max-model-len; 401 missing or wrong key (--api-key; /health stays open); 404 unknown model; "
                    "413 body too large; 503 queue full (--max-waiting) or shutting down. On SIGINT / SIGTERM "
                    "running requests get --shutdown-timeout seconds, then are aborted; exit status 0.")
    s.add_argument("model_arg", nargs="?", metavar="MODEL", help="checkpoint folder, or `demo` (as --model)")
    s.add_argument("--model", help="the same as MODEL")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, logged)")
    s.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="name(s) clients use as `model` (default: MODEL as given)")
    s.add_argument("--api-key", default=os.environ.get("DSV4_API_KEY"),
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY); default $DSV4_API_KEY")
    s.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    s.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    s.add_argument("--kernels", default="auto", choices=("auto", "ref", "triton"), help="kernel backend")
    s.add_argument("--max-model-len", type=int, help="longest sequence, prompt included (default: "
                                                     "min(max_position_embeddings, 4096))")
    s.add_argument("--max-num-seqs", type=int, default=8, help="sequences decoded together (cache slots; default 8)")
    s.add_argument("--max-num-batched-tokens", type=int, help="tokens per step (the prefill chunk)")
    s.add_argument("--max-logprobs", type=int, default=20, help="largest logprobs / top_logprobs (default 20)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the GPU's memory for weights, activations and the cache's pages (default 0.9)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="requests that may wait for a slot; more get 503 (default 1024)")
    s.add_argument("--max-request-bytes", type=_size, default="32MiB", metavar="SIZE",
                   help="largest request body; larger get 413 (default 32MiB)")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT / SIGTERM, how long running requests may still take (default 10)")
    s.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    s.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    s.add_argument("--enforce-eager", action="store_true", help="decode steps without CUDA graph capture")
    s.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each decode step before the last one's tokens are read back, fed with them on the "
                        "device (default: on)")
    s.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_HELP)
    _load_format_args(s)
    _parallel_args(s)


def _model_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--model", required=True, metavar="PATH",
                   help="checkpoint folder (any dialect and format), or `demo`: the built-in demo model (a tiny "
                        "random NVFP4 V4 with the real tokenizer, written to $DSV4_CACHE, default "
                        "~/.cache/dsv4, on first use; its text is gibberish)")
    g.add_argument("--device", help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    g.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="compute dtype: auto (fp32 on CPU, bf16 on GPU), float32, bfloat16, float16")
    g.add_argument("--kernels", default="auto", choices=("auto", "ref", "triton"), help="kernel backend")
    g.add_argument("--max-model-len", type=int, help="longest sequence, prompt included (default: "
                                                     "min(max_position_embeddings, 4096))")
    g.add_argument("--no-progress", action="store_true", help="no progress bar while loading")
    g.add_argument("--enforce-eager", action="store_true", help="decode steps without CUDA graph capture")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="launch each decode step before the last one's tokens are read back, fed with them on the "
                        "device (default: on)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES, help=KV_CACHE_HELP)
    _load_format_args(g)
    _parallel_args(g)


def _parallel_args(g: argparse.ArgumentParser, collectives: bool = True) -> None:
    """The layout's options; collectives: also how its all-reduces run (not for inspect, which runs none)."""
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="ranks of one pipeline stage: attention split by heads, experts by their intermediate "
                        "dimension, embedding and head by vocabulary (default 1)")
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, metavar="P",
                   help="pipeline stages, each a contiguous range of layers (default 1)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="partition the routed experts over the tensor-parallel ranks instead of splitting each")
    if collectives:
        g.add_argument("--disable-custom-all-reduce", action="store_true",
                       help="every all-reduce through NCCL, none through the symmetric-memory one-shot kernel")


def _load_format_args(g: argparse.ArgumentParser) -> None:
    g.add_argument("--load-format", default="auto", choices=("auto", "dummy"),
                   help="dummy: read no weights; MODEL is a preset (v4-flash, v4-pro), a config.json or a "
                        "checkpoint folder, and random weights are drawn on the device (benchmarks)")
    g.add_argument("--dummy-format", default="nvfp4-experts", choices=FORMATS,
                   help="storage of dummy weights (default nvfp4-experts)")
    g.add_argument("--hf-overrides", type=_json_object, metavar="JSON",
                   help='config fields to change for dummy weights (with --load-format dummy only), e.g. '
                        '\'{"num_hidden_layers": 4}\'')


def _json_object(text: str) -> dict:
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _sampling_args(g: argparse.ArgumentParser, max_tokens: int) -> None:
    g.add_argument("--max-tokens", type=int, default=max_tokens, help=f"tokens to generate (default {max_tokens})")
    g.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default 1.0)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set of tokens whose probability "
                                                            "reaches this (default 1.0 = off)")
    g.add_argument("--top-k", type=int, default=0, help="0 = off")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this times the most likely one's "
                                                            "probability (default 0.0 = off)")
    g.add_argument("--seed", type=int, help="per-request sampling seed (reproducible output)")
    g.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sentence token")


def _llm(args: argparse.Namespace):
    from .api import LLM

    llm = LLM(args.model, device=args.device, dtype=args.dtype, kernels=args.kernels,
              max_model_len=args.max_model_len, max_num_seqs=1, progress=not args.no_progress,
              load_format=_load_format(args), hf_overrides=args.hf_overrides,
              enforce_eager=args.enforce_eager, kv_cache_dtype=args.kv_cache_dtype, **_parallel(args))
    llm.engine.async_scheduling = args.async_scheduling
    return llm


def _load_format(args: argparse.Namespace) -> str:
    """--load-format and --dummy-format as LLM's load_format."""
    return args.load_format if args.load_format == "auto" else f"dummy-{args.dummy_format}"


def _parallel(args: argparse.Namespace) -> dict:
    return dict(tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                enable_expert_parallel=args.enable_expert_parallel,
                disable_custom_all_reduce=args.disable_custom_all_reduce)


def _params(args: argparse.Namespace):
    from .runtime.params import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                          seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, max_tokens=args.max_tokens)


def _print_stream(llm, prompt, params) -> str:
    pieces = []
    for delta in llm.stream(prompt, params):
        pieces.append(delta)
        print(delta, end="", flush=True)
    print(flush=True)
    return "".join(pieces)


def _generate(args: argparse.Namespace) -> int:
    params = _params(args)
    with _llm(args) as llm:                 # leaving it stops a parallel engine's workers
        _print_stream(llm, args.prompt, params)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from .api import RequestFailed
    from .runtime.chat import ChatParseError, encode_messages, parse_reply

    params, llm = _params(args), _llm(args)
    start = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(start)
    print("dsv4 chat: /reset starts over, /exit, /quit or Ctrl-D quits", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(start)
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        try:
            text = _print_stream(llm, encode_messages(messages, thinking=args.thinking), params)
        except (KeyboardInterrupt, RequestFailed) as e:    # the reply ends; the chat goes on without this turn
            print(f"\n[{'interrupted' if isinstance(e, KeyboardInterrupt) else e}]", file=sys.stderr)
            messages.pop()
            continue
        try:
            reply = parse_reply(text, thinking=args.thinking)
            messages.append({"role": "assistant", "content": reply.content,
                             "reasoning_content": reply.reasoning_content})
        except ChatParseError:     # e.g. a reply cut by --max-tokens: keep it as plain content
            messages.append({"role": "assistant", "content": text})


def _serve(args: argparse.Namespace) -> int:
    import logging

    model = args.model or args.model_arg
    if model is None or (args.model and args.model_arg and args.model != args.model_arg):
        print("dsv4 serve: error: give the model once: MODEL or --model", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from .server.app import run
    except ImportError as e:
        print(f"dsv4 serve: error: {e}; the server needs fastapi, uvicorn, pydantic and prometheus_client "
              "(pip install dsv4 with its dependencies)", file=sys.stderr)
        return 1
    from .api import LLM

    llm = LLM(model, device=args.device, dtype=args.dtype, kernels=args.kernels, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
              max_logprobs=args.max_logprobs, gpu_memory_utilization=args.gpu_memory_utilization,
              progress=not args.no_progress, load_format=_load_format(args),
              hf_overrides=args.hf_overrides, enforce_eager=args.enforce_eager,
              kv_cache_dtype=args.kv_cache_dtype, **_parallel(args))
    llm.engine.async_scheduling = args.async_scheduling
    run(llm, served_names=tuple(args.served_model_name or [model]), root=str(model), host=args.host, port=args.port,
        api_key=args.api_key, max_waiting=args.max_waiting, shutdown_timeout=args.shutdown_timeout,
        max_body_bytes=args.max_request_bytes)
    return 0


def _convert(args: argparse.Namespace) -> int:
    from .checkpoint.convert import convert_checkpoint

    report = convert_checkpoint(args.src, args.dst, fmt=args.format, naming=args.naming, shard_bytes=args.shard_size,
                                progress=not args.no_progress, overwrite=args.overwrite)
    print(report.summary())
    return 0


def _make_tiny(args: argparse.Namespace) -> int:
    from .checkpoint.tiny import make_tiny

    report = make_tiny(args.dst, seed=args.seed, fmt=args.format, naming=args.naming, shard_bytes=args.shard_size,
                       overwrite=args.overwrite)
    print(report.summary())
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from .checkpoint.inspect import inspect_checkpoint

    layout = memory = None
    if args.plan:
        import torch

        from .parallel import Layout

        layout = Layout(args.tensor_parallel_size, args.pipeline_parallel_size, args.enable_expert_parallel)
        memory = args.device_memory
        if memory is None and torch.cuda.is_available():
            memory = torch.cuda.get_device_properties(0).total_memory
    report = inspect_checkpoint(args.path, audit=args.audit, layout=layout, device_memory=memory,
                                utilization=args.gpu_memory_utilization)
    plan = report.plan
    if plan is not None and memory is not None and plan.bytes_per_rank and report.ok:
        import torch

        from .runtime.cache import tokens_that_fit

        budget = int(memory * args.gpu_memory_utilization)
        report.cache_tokens = [tokens_that_fit(layout.shard(report.config, rank).stage_config(), budget - weights,
                                               torch.bfloat16, args.kv_cache_dtype, args.max_num_seqs)
                               for rank, weights in enumerate(plan.bytes_per_rank)]
        report.notes.append(f"cache tokens: what fits in {args.gpu_memory_utilization:g} of the device after the "
                            f"rank's weights and {args.max_num_seqs} slots' state, in bf16 ({args.kv_cache_dtype}), "
                            "before the activation workspace (a few GiB); every rank of a stage holds its whole cache")
    print(report.render())
    return 0 if report.ok else 1


COMMANDS = MappingProxyType({"convert": _convert, "make-tiny": _make_tiny, "inspect": _inspect,
                             "generate": _generate, "chat": _chat, "serve": _serve})


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from .checkpoint.errors import CheckpointError
    from .config import ConfigError

    errors = (CheckpointError, ConfigError)
    if args.command in ("generate", "chat", "serve"):
        from .api import RequestFailed
        from .runtime.cache import CacheCapacityError
        from .parallel import LayoutError
        from .runtime.chat import ChatFormatError
        from .runtime.params import RequestError
        from .runtime.spmd import WorkerFailure
        from .runtime.tokenizer import TokenizerError

        errors += (CacheCapacityError, ChatFormatError, LayoutError, RequestError, RequestFailed, TokenizerError,
                   WorkerFailure)
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except errors as e:
        print(f"dsv4 {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
