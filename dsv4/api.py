"""`dsv4.LLM`: vLLM's offline API (`LLM`, `SamplingParams`, `generate`, `chat`) over the dsv4 engine.

    llm = dsv4.LLM("/path/to/DeepSeek-V4-Flash-NVFP4", device="cuda")     # or "demo": the built-in tiny model
    out = llm.generate(["The capital of France is"], dsv4.SamplingParams(temperature=0, max_tokens=32))
    out[0].outputs[0].text, out[0].outputs[0].token_ids, out[0].outputs[0].finish_reason

A prompt is a string, a list of token ids, or {"prompt_token_ids": [...]} / {"prompt": "..."}. As in vLLM, a
string is tokenized as the tokenizer config says, which for V4 adds no BOS: pass token ids, or begin the
string with "<｜begin▁of▁sentence｜>", for one. `chat` renders messages with DeepSeek-V4's chat encoding
(BOS included). `stream` (a dsv4 addition) yields one request's text as it is produced.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from types import MappingProxyType

import torch

from .checkpoint.loader import load
from .runtime.chat import encode_messages
from .runtime.demo import resolve_model
from .runtime.engine import Engine, RequestError
from .runtime.params import RequestOutput, SamplingParams
from .runtime.tokenizer import Tokenizer

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


class LLM:
    def __init__(self, model: str | Path, *, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = "auto", kernels: str = "auto", w4a4: bool = False,
                 tokenizer: str | Path | None = None, skip_tokenizer_init: bool = False,
                 max_num_seqs: int = 8, max_model_len: int | None = None, max_num_batched_tokens: int | None = None,
                 progress: bool = True):
        """model: a checkpoint folder (any dialect and format) or "demo". tokenizer: a folder with
        tokenizer.json (default: the checkpoint's, else DeepSeek-V4's packaged one). skip_tokenizer_init:
        token ids in and out, no text. The engine options size the decode cache: max_num_seqs sequences of
        up to max_model_len tokens (default min(max_position_embeddings, 4096)); max_num_batched_tokens is
        the per-step token budget (prefill chunk size)."""
        path = resolve_model(model)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = load(path, device, _dtype(dtype, device), kernels, w4a4, progress=progress)
        tok = None if skip_tokenizer_init else Tokenizer.from_checkpoint(tokenizer or path, self.model.config)
        self.engine = Engine(self.model, tok, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                             max_num_batched_tokens=max_num_batched_tokens)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer if self.engine.text else None

    # ------------------------------------------------------------------ generation
    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. `prompts`: one prompt or a list of them."""
        batch = _as_batch(prompts)
        params = _per_prompt(sampling_params, len(batch))
        return self._run([self._tokenize(p) for p in batch], params, use_tqdm)

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
        The finished RequestOutput is the generator's return value."""
        text, ids = self._tokenize(prompt)
        seq = self.engine.add_request(ids, sampling_params, prompt=text)
        try:
            while not seq.finished:
                if seq in self.engine.step():
                    delta = seq.tracker.take_delta()
                    if delta:
                        yield delta
        finally:
            if not seq.finished:
                self.engine.abort(seq.request_id)
        return seq.output()

    # ------------------------------------------------------------------ internals
    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestError(f"a prompt dict needs 'prompt_token_ids' or 'prompt', got keys {sorted(prompt)}")
        if isinstance(prompt, str):
            tok = self.get_tokenizer()
            if tok is None:
                raise RequestError("text prompts need a tokenizer; this LLM was made with skip_tokenizer_init=True, "
                                   "so pass token ids")
            return prompt, tok.encode(prompt)
        return None, list(prompt)

    def _run(self, prompts: list[tuple[str | None, list[int]]], params: list[SamplingParams],
             use_tqdm: bool) -> list[RequestOutput]:
        seqs = []
        try:
            for (text, ids), p in zip(prompts, params):
                seqs.append(self.engine.add_request(ids, p, prompt=text))
        except Exception:
            for s in seqs:
                self.engine.abort(s.request_id)
            raise
        bar = None
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
        if bar is not None:
            bar.close()
        return [s.output() for s in seqs]


def _as_batch(prompts) -> list:
    """vLLM's rule: a string, a dict or a flat list of ints is one prompt; any other list is a batch."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    return prompts


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} SamplingParams for {n} prompts; give one, or one per prompt")
    return params
