"""`dsv4.LLM`: vLLM's offline API (`LLM`, `SamplingParams`, `generate`, `chat`) over the dsv4 engine.

    llm = dsv4.LLM("/path/to/DeepSeek-V4-Flash-NVFP4", device="cuda")     # or "demo": the built-in tiny model
    out = llm.generate(["The capital of France is"], dsv4.SamplingParams(temperature=0, max_tokens=32))
    out[0].outputs[0].text, out[0].outputs[0].token_ids, out[0].outputs[0].finish_reason

A prompt is a string, token ids (a list or tuple of ints, or a 1-D integer numpy array or torch tensor), or
{"prompt_token_ids": [...]} / {"prompt": "..."}; `generate` takes one prompt or a list of them (a 2-D integer
array is a batch of rows). As in vLLM, a string is tokenized as the tokenizer config says, which for V4 adds no
BOS: pass token ids, or begin the string with "<｜begin▁of▁sentence｜>", for one. `chat` renders messages with
DeepSeek-V4's chat encoding (BOS included). `stream` (a dsv4 addition) yields one request's text as it is
produced.

Every prompt and SamplingParams of a call is checked before any of them runs; a bad one raises RequestError (a
ValueError; RequestTypeError for a wrong type, also a TypeError) naming it, and the engine is left as it was. A
request that fails while it runs ends with finish_reason "error" and the reason in `outputs[0].error`
(`generate`, `chat`) or raises RequestFailed (`stream`); the other requests are unaffected. An interrupt
(KeyboardInterrupt) aborts the call's unfinished requests and propagates.

Several GPUs (vLLM's names): `tensor_parallel_size`, `pipeline_parallel_size`, `enable_expert_parallel`. On one
machine the LLM spawns one worker process per further GPU (on the CPU, gloo processes); under torchrun each process
is one rank and only rank 0 returns from `LLM(...)` (docs/parallel.md). A rank that fails stops the engine:
`generate` raises WorkerFailure naming the rank and cause. `shutdown()` (or `del`, or leaving a `with` block) stops
the workers.
"""

from __future__ import annotations

import dataclasses
import numbers
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import MappingProxyType

import torch

from .checkpoint.canonical import open_checkpoint
from .checkpoint.dummy import check_dummy_layout, dummy_model
from .checkpoint.errors import CheckpointError
from .checkpoint.loader import layout_plan, load
from .checkpoint.writer import FORMATS
from .config import ConfigError, ModelConfig
from .kernels import ops_for
from .parallel import Layout
from .runtime import workers
from .runtime.cache import pages_for
from .runtime.chat import encode_messages
from .runtime.demo import resolve_model
from .runtime.engine import DEFAULT_MAX_MODEL_LEN, DEFAULT_MAX_NUM_BATCHED_TOKENS, Engine
from .runtime.params import RequestError, RequestOutput, RequestTypeError, SamplingParams, check_token_ids
from .runtime.tokenizer import Tokenizer

DUMMY_STORAGE = "nvfp4-experts"          # load_format="dummy": NVIDIA's NVFP4-experts layout
_DTYPES = MappingProxyType({"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
                            "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
                            "float16": torch.float16, "fp16": torch.float16, "half": torch.float16})


def _dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None / "auto": exact fp32 on CPU, bf16 on GPU."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected auto or one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


class RequestFailed(RuntimeError):
    """A request that was accepted but failed while it ran (its sampling, detokenization, or the model step)."""


class LLM:
    def __init__(self, model: str | Path, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = "auto", kernels: str = "auto", w4a4: bool = False,
                 tokenizer: str | Path | None = None, skip_tokenizer_init: bool = False,
                 max_num_seqs: int = 8, max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 max_logprobs: int = 20, gpu_memory_utilization: float = 0.9, num_cache_pages: int | None = None,
                 load_format: str = "auto", hf_overrides: dict | None = None,
                 seed: int = 0, progress: bool = True, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1,
                 enable_expert_parallel: bool = False, enforce_eager: bool = False,
                 disable_custom_all_reduce: bool = False, kv_cache_dtype: str = "auto"):
        """model: a checkpoint folder (any dialect and format) or "demo". tokenizer: a folder with
        tokenizer.json (default: the checkpoint's, else DeepSeek-V4's packaged one). skip_tokenizer_init:
        token ids in and out, no text. The engine options size the decode cache: max_num_seqs sequences of
        up to max_model_len tokens (default min(max_position_embeddings, 4096)); max_num_batched_tokens is
        the per-step token budget (prefill chunk size). max_logprobs caps SamplingParams.logprobs (vLLM's
        default, 20). The cache's pages take gpu_memory_utilization of a GPU's memory after the weights (vLLM's
        meaning), or num_cache_pages pages of 256 tokens if given; on CPU, max_num_seqs x max_model_len tokens.

        load_format="dummy" (vLLM's name) reads no weights: model is a preset ("v4-flash", "v4-pro", "tiny"), a
        config.json or a checkpoint folder, and the weights are drawn at random on the device in NVIDIA's NVFP4-experts
        storage, or in another with "dummy-bf16", "dummy-official", "dummy-nvfp4" (`checkpoint.dummy`, reproducible from
        `seed`), for benchmarks at real dimensions. hf_overrides changes config fields (num_hidden_layers keeps the
        first layers).

        tensor_parallel_size (attention by heads, experts split, vocabulary-split embedding and head),
        pipeline_parallel_size (contiguous layer ranges) and enable_expert_parallel (routed experts partitioned over
        the TP ranks instead of split): docs/parallel.md. A layout the model cannot be split into is refused
        before anything is loaded. disable_custom_all_reduce (vLLM's name) sends every all-reduce through NCCL
        instead of small ones through torch's symmetric-memory one-shot kernel. On a GPU, decode steps replay CUDA
        graphs captured at start-up (one per batch size and length bucket up to max_num_seqs and max_model_len; on
        every rank of a parallel engine with one pipeline stage); enforce_eager=True (vLLM's name) runs the same
        padded steps uncaptured, which give the same tokens. Async scheduling (vLLM's, in one process; on unless
        `self.engine.async_scheduling = False`) launches each decode step before the last one's tokens are read back,
        fed with them on the device, so the GPU need not wait for the host between steps. kv_cache_dtype (vLLM's
        name): "fp8" (experimental) keeps the attention's compressed entries as packed fp8 rows (448 e4m3 codes in
        blocks of 64 with a power-of-two scale each, 64 bf16 rope values: 584 instead of 1,024 bytes, the K = V rows
        rounded as DeepSeek's reference rounds them) and the lightning indexer's keys in fp8 e4m3 with a
        power-of-two scale per key (132 instead of 256 bytes); "fp8-indexer" only the indexer's keys; "auto" (the
        default) keeps the compute dtype, whose logits equal transformers'."""
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        load_format, dummy_format = _load_format(load_format, hf_overrides)
        layout = Layout(tensor_parallel_size, pipeline_parallel_size, enable_expert_parallel)
        self._group = None
        if layout.parallel:
            path, self._group = _start_parallel(layout, model, device, _dtype(dtype, device), dict(
                kernels=kernels, w4a4=w4a4, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                max_num_batched_tokens=max_num_batched_tokens, num_cache_pages=num_cache_pages,
                gpu_memory_utilization=gpu_memory_utilization, load_format=load_format, dummy_format=dummy_format,
                hf_overrides=hf_overrides, seed=seed, progress=progress, enforce_eager=enforce_eager,
                one_shot_all_reduce=not disable_custom_all_reduce, kv_cache_dtype=kv_cache_dtype))
            self._finalizer = weakref.finalize(self, self._group.shutdown)
            self.model = self._group.model
        else:
            path = self._load_here(model, device, dtype, kernels, w4a4, load_format, dummy_format, hf_overrides, seed,
                                   progress)
        try:
            tok = None if skip_tokenizer_init else Tokenizer.from_checkpoint(tokenizer or path, self.model.config)
            self.engine = Engine(self.model, tok, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                 max_num_batched_tokens=max_num_batched_tokens, max_logprobs=max_logprobs,
                                 num_cache_pages=num_cache_pages, gpu_memory_utilization=gpu_memory_utilization,
                                 driver=self._group and self._group.driver, enforce_eager=enforce_eager,
                                 kv_cache_dtype=kv_cache_dtype)
        except BaseException:
            self.shutdown()
            raise

    def _load_here(self, model, device, dtype, kernels, w4a4, load_format, dummy_format, hf_overrides, seed,
                   progress) -> Path | None:
        """One process: load (or draw) the whole model; returns the folder to look for a tokenizer in."""
        ops = ops_for(device, kernels, w4a4)
        if load_format == "dummy":
            path, cfg = _dummy_config(model, hf_overrides)
            self.model = dummy_model(cfg, dummy_format, device, _dtype(dtype, device), ops, seed)
            if ops.reads_tiled and device.type == "cuda":
                self.model.prepare_for_kernels_()
        elif load_format == "auto":
            path = resolve_model(model)
            self.model = load(path, device, _dtype(dtype, device), ops, progress=progress)
        return path

    def shutdown(self) -> None:
        """Stop a parallel engine's worker processes and free its process groups (a no-op on one process)."""
        if getattr(self, "_group", None) is not None:
            self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer if self.engine.text else None

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `prompts`: one prompt or a list of them."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        return self._run([self._tokenize(p, f"prompts[{i}]") for i, p in enumerate(batch)], params, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True, *,
             thinking: bool = False, reasoning_effort: str | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Chat completions for one conversation (a list of message dicts) or a list of them. The reply text
        can be split into reasoning, content and tool calls with `dsv4.runtime.chat.parse_reply`."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        texts = [encode_messages(c, thinking=thinking, reasoning_effort=reasoning_effort, tools=tools) for c in convs]
        return self.generate(texts, sampling_params, use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Text of one request as it becomes final (held back while it could still turn into a stop string).
        The finished RequestOutput is the generator's return value; a request that fails while it runs raises
        RequestFailed."""
        text, ids = self._tokenize(prompt, "prompt")
        params = _per_prompt(sampling_params, 1)[0]
        seq = self.engine.add_request(ids, params, prompt=text)
        try:
            while not seq.finished:
                if seq in self.engine.step():
                    delta = seq.tracker.take_delta()
                    if delta:
                        yield delta
        finally:
            if not seq.finished:
                self.engine.abort(seq.request_id)
        out = seq.output()
        if out.outputs[0].finish_reason == "error":
            raise RequestFailed(f"request {seq.request_id!r} failed: {out.outputs[0].error}")
        return out

    # ------------------------------------------------------------------ internals
    def _tokenize(self, prompt, where: str) -> tuple[str | None, list[int]]:
        """One prompt -> (its text or None, its token ids); `where` names it in errors."""
        if isinstance(prompt, dict):
            unknown = sorted(map(str, set(prompt) - {"prompt", "prompt_token_ids"}))
            if unknown or not prompt:
                raise RequestError(f"{where}: a prompt dict takes 'prompt_token_ids' and / or 'prompt', got keys "
                                   f"{sorted(map(str, prompt))}")
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise RequestTypeError(f"{where}['prompt'] must be a string, got {type(text).__name__} {text!r:.80}")
            if "prompt_token_ids" in prompt:
                return text, check_token_ids(f"{where}['prompt_token_ids']", prompt["prompt_token_ids"])
            if text is None:
                raise RequestTypeError(f"{where}['prompt'] must be a string, got None")
            prompt = text
        if isinstance(prompt, str):
            tok = self.get_tokenizer()
            if tok is None:
                raise RequestError("text prompts need a tokenizer; this LLM was made with skip_tokenizer_init=True, "
                                   "so pass token ids")
            return prompt, tok.encode(prompt)
        if isinstance(prompt, (bytes, bytearray)):
            raise RequestTypeError(f"{where} is bytes: decode it to a str for text, or pass token ids as a list of "
                                   "ints")
        return None, check_token_ids(where, prompt)

    def _run(self, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        for i, ((_, ids), p) in enumerate(zip(prompts, params)):     # every request is checked before any is added
            self.engine.check_request(ids, p, f"prompts[{i}]")
        seqs = []
        bar = None
        try:
            for (text, ids), p in zip(prompts, params):
                seqs.append(self.engine.add_request(ids, p, prompt=text))
            if use_tqdm:
                from tqdm import tqdm

                bar = tqdm(total=len(seqs), desc="generating", unit="prompt")
            done = 0
            while done < len(seqs):
                self.engine.step()
                now = sum(s.finished for s in seqs)
                if bar is not None:
                    bar.update(now - done)
                done = now
        finally:
            for s in seqs:                       # interrupted: nothing of this call stays in the engine
                if not s.finished:
                    self.engine.abort(s.request_id)
            if bar is not None:
                bar.close()
        return [s.output() for s in seqs]


def _start_parallel(layout: Layout, model: str | Path, device: torch.device, dtype: torch.dtype,
                    opts: dict) -> tuple[Path | None, workers.ParallelGroup]:
    """Check the layout against the model (config, then every rank's slices, from headers only), then start the
    ranks; -> (the folder to look for a tokenizer in, rank 0's group)."""
    if opts["load_format"] == "dummy":
        path, cfg = _dummy_config(model, opts["hf_overrides"])
        layout.check(cfg)
        check_dummy_layout(cfg, opts["dummy_format"], layout)
        checkpoint = None
    elif opts["load_format"] == "auto":
        path = resolve_model(model)
        ckpt = open_checkpoint(path)
        cfg = ckpt.config
        layout.check(cfg)
        plan = layout_plan(ckpt, layout)
        if plan.problems:
            raise CheckpointError(f"cannot load {path} as {layout.describe()}: {len(plan.problems)} problem(s)\n  "
                                  + "\n  ".join(plan.problems[:60]))
        checkpoint = str(path)
    else:
        raise ValueError(f"unknown load_format {opts['load_format']!r}; expected 'auto' or 'dummy'")
    max_len = opts["max_model_len"] or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    pages = opts["num_cache_pages"]
    if pages is None and device.type != "cuda":
        pages = opts["max_num_seqs"] * pages_for(max_len)
    step_tokens = opts["max_num_batched_tokens"] or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, opts["max_num_seqs"])
    step_tokens = min(step_tokens, max_len)       # the step the cache sizing measures (CUDA)
    spec = workers.RankSpec(layout, cfg, checkpoint, opts["dummy_format"], opts["seed"], device.type, dtype,
                            opts["kernels"], opts["w4a4"], opts["max_num_seqs"], pages, step_tokens,
                            opts["gpu_memory_utilization"], opts["progress"], max_len,
                            _decode_runner(device, layout, opts["enforce_eager"]), opts["one_shot_all_reduce"],
                            opts["kv_cache_dtype"])
    return path, workers.start(spec)


def _decode_runner(device: torch.device, layout: Layout, enforce_eager: bool) -> str:
    """How a parallel engine runs decode steps (workers.RankSpec.decode_runner): on CUDA with one pipeline stage the
    decode runner, its graphs captured or, with enforce_eager, its padded steps uncaptured (the same tokens); else
    plain steps (graphs of several stages would need the point-to-point sends inside them)."""
    if device.type != "cuda" or layout.pp > 1:
        return "plain"
    return "padded" if enforce_eager else "graphs"


def _load_format(value: str, hf_overrides: dict | None) -> tuple[str, str]:
    """LLM's load_format -> ("auto" or "dummy", the dummy weights' storage); hf_overrides only with dummy weights
    (a checkpoint's config is its own)."""
    if value == "auto" and hf_overrides:
        raise ConfigError("hf_overrides applies to load_format='dummy' only; a checkpoint's config is its own")
    if value in ("auto", "dummy"):
        return value, DUMMY_STORAGE
    storage = value.removeprefix("dummy-")
    if value.startswith("dummy-") and storage in FORMATS:
        return "dummy", storage
    raise ValueError(f"unknown load_format {value!r}; expected 'auto', 'dummy' or one of "
                     f"{['dummy-' + f for f in FORMATS]}")


def _dummy_config(model: str | Path, overrides: dict | None) -> tuple[Path | None, ModelConfig]:
    """(the folder to look for a tokenizer in, or None; the config) of a dummy model."""
    where = Path(model)
    if where.is_dir():
        path, cfg = where, ModelConfig.from_json(where / "config.json")
    elif where.suffix == ".json":
        path, cfg = where.parent, ModelConfig.from_json(where)
    else:
        path, cfg = None, ModelConfig.preset(str(model))
    changes = dict(overrides or {})
    layers = changes.pop("num_hidden_layers", None)
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(ModelConfig)})
    if unknown:
        raise ConfigError(f"hf_overrides: {unknown} are not config fields of ModelConfig")
    cfg = cfg.replace(**changes) if changes else cfg
    return path, cfg.with_layers(layers) if layers is not None else cfg


def _as_batch(prompts) -> list:
    """vLLM's rule: a string, a dict, a flat list of ints (or a 1-D integer array / tensor) is one prompt; any
    other list (or a 2-D array / tensor, by rows) is a batch."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (bytes, bytearray)):
        raise RequestTypeError("prompts is bytes: decode it to a str for text, or pass token ids as a list of ints")
    ndim = getattr(prompts, "ndim", None)
    if ndim is not None and hasattr(prompts, "dtype"):                    # numpy array or torch tensor
        if ndim == 1:
            return [prompts]
        if ndim == 2:
            return list(prompts)
        raise RequestTypeError(f"prompts as an array must be 1-D (one prompt) or 2-D (a batch), got shape "
                               f"{tuple(prompts.shape)}")
    if not isinstance(prompts, (list, tuple)):
        raise RequestTypeError(f"prompts must be a string, a list of token ids, a prompt dict, or a list of them; got "
                               f"{type(prompts).__name__} {prompts!r:.80}")
    scalars = [isinstance(p, numbers.Number) or getattr(p, "ndim", None) == 0 for p in prompts]
    if prompts and all(scalars):
        return [prompts]                    # token ids (check_token_ids refuses bools and floats among them)
    if any(scalars):
        raise RequestTypeError("prompts mixes numbers with other things; give one list of token ids or a list of "
                               f"prompts, got {prompts!r:.80}")
    return list(prompts)


def _per_prompt(params, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    if isinstance(params, (list, tuple)) and all(isinstance(p, SamplingParams) for p in params):
        if len(params) != n:
            raise RequestError(f"{len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
        return list(params)
    hint = " (make one with SamplingParams(**params))" if isinstance(params, dict) else ""
    raise RequestTypeError(f"sampling_params must be a SamplingParams or a list of them, one per prompt; got "
                           f"{type(params).__name__}{hint}")
