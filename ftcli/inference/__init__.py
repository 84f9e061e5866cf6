"""Inference on a loaded model: load (a checkpoint, or a base + LoRA adapter unmerged), render the chat
template, generate, and split the reply into reasoning and answer. Used by `ftcli generate`, `ftcli chat`,
the greedy samples during training (`sample_greedy`) and register's probe.

    ModelSource (ftcli.artifacts.resolve: what a run dir / model dir / hub id names)
    -> `load`: the model in eval mode, its own tokenizer and chat template, its stop tokens
    -> `render_prompt`: the conversation with add_generation_prompt
    -> stop at the template's end of turn (see `stop_token_ids`) and the generation config's eos
    -> transformers' generate(GenerationConfig): greedy or sampled (temperature, top_p, top_k, seed),
       prompts left-padded into batches (`generate`), or one streamed reply (`stream_reply`)
    -> `split_reasoning`: as the template's chat format splits a reply (ftcli.chat_formats: harmony channels,
       gpt-oss's analysis / final; a <think> block, Qwen3.x)

`sample_greedy` is the entry point for code that already holds a model (samples during training,
register's probe): the same rendering, stop tokens and left-padded greedy decoding.
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from ftcli import chat_formats
from ftcli.artifacts.resolve import ModelSource
from ftcli.chat_formats import ChatFormat
from ftcli.chat_formats.base import EMPTY_THINK, THINK_BLOCKS
from ftcli.config.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "bfloat16", "float16", "float32")
_PROBE = "FTCLI_END_OF_TURN_PROBE"


# --------------------------------------------------------------------------------------- loading
@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    stop_ids: list[int]
    source: ModelSource
    device: Any = None


def pick_device(device: str = "auto"):
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.split(":")[0] not in DEVICES[1:]:
        raise UserError(f"--device {device}: use auto, cpu, cuda, cuda:N or mps")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device on this machine; use --device cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device) -> str:
    """auto: bfloat16 on a GPU, float32 on CPU."""
    if dtype not in DTYPES:
        raise UserError(f"--dtype {dtype}: use {', '.join(DTYPES)}")
    if dtype == "auto":
        return "float32" if device.type == "cpu" else "bfloat16"
    return dtype


def load(source: ModelSource, *, dtype: str = "auto", device: str = "auto") -> LoadedModel:
    """Load the model (and its adapter, unmerged) in eval mode, its tokenizer and its stop tokens."""
    from transformers import AutoConfig

    from ftcli.model.build import load_model
    from ftcli.model.fallbacks import quiet_library_output
    from ftcli.config.recipe import ModelConfig

    from ftcli import hub

    dev = pick_device(device)
    dtype = pick_dtype(dtype, dev)
    offline = hub.offline_for(source.model)  # no Hub: the local HF cache only, no retries
    try:
        config = AutoConfig.from_pretrained(source.model, revision=source.revision,
                                            trust_remote_code=source.trust_remote_code, local_files_only=bool(offline))
    except (OSError, ValueError) as e:
        if offline:
            raise UserError(hub.no_connection(f"model {source.model!r}", offline)) from None
        raise UserError(f"{source.model}: cannot load its config ({_first_line(e)})") from None
    quant = getattr(config, "quantization_config", None) or {}
    quant_method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if quant_method not in (None, "mxfp4"):
        raise UserError(f"{source.model} is quantized with {quant_method}; ftcli generate loads unquantized or "
                        "MXFP4 (dequantized) checkpoints")
    cfg = ModelConfig(id=source.model, revision=source.revision, model_type=config.model_type,
                      model_class=source.model_class or _model_class(config), dtype=dtype,
                      quantization="mxfp4_dequantize" if quant_method == "mxfp4" else "none",
                      trust_remote_code=source.trust_remote_code)
    quiet_library_output(config.model_type, dev.type, say=lambda line: print(line, file=sys.stderr))
    if dev.type == "cuda":  # compiled kernels and autotune results kept for the next process
        from ftcli.model.kernels.cache import compile_notice, persistent_caches

        print(compile_notice(*persistent_caches()), file=sys.stderr)
    model = load_model(cfg, device=dev)
    if source.adapter is not None:
        from peft import PeftModel

        try:
            model = PeftModel.from_pretrained(model, str(source.adapter))
        except (RuntimeError, ValueError, KeyError) as e:
            raise UserError(f"the adapter in {source.adapter} does not fit base {source.model!r}: "
                            f"{_first_line(e)}") from None
    model.eval()
    model.config.use_cache = True  # load_model turns the KV cache off for training
    tokenizer = _load_tokenizer(source)
    return LoadedModel(model=model, tokenizer=tokenizer, stop_ids=stop_token_ids(tokenizer, model), source=source,
                       device=dev)


def _model_class(config) -> str:
    archs = getattr(config, "architectures", None) or []
    return "image_text_to_text" if any("ConditionalGeneration" in a for a in archs) else "causal_lm"


def _load_tokenizer(source: ModelSource):
    """The tokenizer saved with the trained model (final/ or the adapter dir), else the base's."""
    from transformers import AutoTokenizer

    from ftcli import hub

    candidates = [(str(source.adapter), None)] if source.adapter is not None else []
    candidates.append((source.model, source.revision))
    problem = None
    for name, revision in candidates:
        offline = hub.offline_for(name)
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision, local_files_only=bool(offline),
                                                      trust_remote_code=source.trust_remote_code)
        except (OSError, ValueError) as e:
            problem = hub.no_connection(f"the tokenizer of {name!r}", offline) if offline else _first_line(e)
            continue
        if not getattr(tokenizer, "chat_template", None):
            problem = f"the tokenizer in {name} has no chat template"
            continue
        return tokenizer
    raise UserError(f"{source.describe()}: no tokenizer with a chat template ({problem})")


def _first_line(e: BaseException) -> str:
    text = str(e).strip() or type(e).__name__
    return text.splitlines()[0]


# ---------------------------------------------------------------------------------- the template
def chat_format(tokenizer) -> ChatFormat | None:
    """The chat format the tokenizer's template writes (ftcli.chat_formats), None where it is none of them."""
    template = getattr(tokenizer, "chat_template", None)
    return chat_formats.detect(template if isinstance(template, str) else None)


def reply_kind(tokenizer, prompt_ids: list[int]) -> str:
    """How a reply to this prompt is structured, as its chat format says from the prompt's end: 'harmony'
    (gpt-oss channels), 'think' (the generation prompt opened a <think> block, Qwen3.x: the reply is
    reasoning until </think>) or 'plain'."""
    fmt = chat_format(tokenizer)
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False)
    return (fmt.replies if fmt else THINK_BLOCKS).kind(tail)


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Where a reply ends: the special token the chat template closes a final assistant turn with
    (Qwen `<|im_end|>`, gpt-oss `<|return|>`), the chat format's other stop tokens where the template
    writes them (harmony's `<|call|>`: a tool call ends the turn too), and the eos ids of the tokenizer
    and the model's generation config."""
    ids: list[int] = []

    def add(value) -> None:
        for tid in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(tid, int) and tid >= 0 and tid not in ids:
                ids.append(tid)

    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that needs more than a plain turn: eos ids only
        text = ""
    if _PROBE in text:
        closing = text.rsplit(_PROBE, 1)[1]
        special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        for tid in tokenizer(closing, add_special_tokens=False)["input_ids"]:
            if tid in special:
                add(tid)
                break
    fmt = chat_format(tokenizer)
    for stop in fmt.stop_tokens if fmt else ():
        if stop in (tokenizer.chat_template or ""):
            add(tokenizer.convert_tokens_to_ids(stop))
    add(tokenizer.eos_token_id)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        add(gen.eos_token_id)
    unk = tokenizer.unk_token_id
    return [t for t in ids if t != unk]


def render_prompt(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> list[int]:
    """The conversation as prompt token ids, ending in the template's generation prompt."""
    from jinja2 import TemplateError

    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False,
                                            **(template_kwargs or {}))
    except (TemplateError, TypeError) as e:  # TypeError: a value of a shape the template cannot iterate
        raise UserError(f"the chat template refused this conversation: {_first_line(e)}") from None
    if isinstance(ids, dict) or hasattr(ids, "keys"):  # transformers versions differ on the default
        ids = ids["input_ids"]
    return list(ids)


def conversation(prompt: str, system: str | None = None) -> list[dict]:
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]


def template_kwargs(reasoning_effort: str | None = None) -> dict:
    """Keyword arguments for the chat template: both shipped templates read `reasoning_effort`
    (gpt-oss: low | medium | high, written as "Reasoning: ..." into the system message; Qwen3.8:
    low | medium | xhigh). The reasoning *language* of gpt-oss is an instruction in the system
    message (`reasoning language: German`, as in the Multilingual-Thinking data), see `system_prompt`."""
    return {"reasoning_effort": reasoning_effort} if reasoning_effort else {}


def reasoning_efforts(tokenizer) -> tuple[str, ...] | None:
    """The `reasoning_effort` values the chat template knows: the ones it checks against (Qwen3.8:
    `not in ('xhigh', 'medium', 'low')`), else its chat format's (harmony's for gpt-oss, whose template
    writes any string it is given); () where it reads none, None where it reads one without saying which."""
    template = tokenizer.chat_template or ""
    if "reasoning_effort" not in template:
        return ()
    checked = re.search(r"reasoning_effort\s+not\s+in\s+[(\[]([^)\]]*)[)\]]", template)
    if checked:
        return tuple(re.findall(r"['\"]([^'\"]+)['\"]", checked[1]))
    fmt = chat_format(tokenizer)
    return fmt.reasoning_efforts if fmt else None


def check_reasoning_effort(tokenizer, effort: str | None, describe: str) -> None:
    """--reasoning-effort: one of the template's values, else a one-line error (a warning where the
    template reads no reasoning effort: the flag would do nothing)."""
    known = reasoning_efforts(tokenizer) if effort is not None else None
    if known == ():
        print(f"warning: --reasoning-effort has no effect: the chat template of {describe} reads none",
              file=sys.stderr)
    elif known and effort not in known:
        raise UserError(f"--reasoning-effort {effort}: the chat template of {describe} knows {' | '.join(known)}")


def system_prompt(system: str | None, reasoning_language: str | None) -> str | None:
    if not reasoning_language:
        return system
    line = f"reasoning language: {reasoning_language}"
    return f"{line}\n\n{system}" if system else line


# ----------------------------------------------------------------------------------- completions
@dataclass
class Sampling:
    max_new_tokens: int = 256
    greedy: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None

    def generation_config(self, model, stop_ids: list[int], pad_id: int):
        """The model's own generation config with ftcli's choices on top: `greedy` (or temperature 0)
        decodes greedily; any of temperature/top_p/top_k turns sampling on; none of them keeps the
        model's default (greedy unless its generation_config.json says do_sample)."""
        import copy

        from transformers import GenerationConfig

        base = getattr(model, "generation_config", None)
        config = copy.deepcopy(base) if base is not None else GenerationConfig()
        config.max_new_tokens, config.max_length = self.max_new_tokens, None
        config.eos_token_id, config.pad_token_id, config.use_cache = stop_ids, pad_id, True
        if self.greedy or self.temperature == 0:
            config.do_sample = False
        elif any(v is not None for v in (self.temperature, self.top_p, self.top_k)):
            config.do_sample = True
        if config.do_sample:
            if self.temperature is not None:
                config.temperature = self.temperature
            if self.top_p is not None:
                config.top_p = self.top_p
            if self.top_k is not None:
                config.top_k = self.top_k
        else:
            config.temperature, config.top_p, config.top_k = None, None, None
        return config


@dataclass
class Completion:
    """One reply. `text` is the answer (harmony final channel / after </think>), `reasoning` the
    analysis channel or think block (None when the template has none), `raw` the decoded tokens with
    special tokens kept, `token_ids` the generated ids (the stop token included when reached)."""

    text: str
    reasoning: str | None
    raw: str
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "length"  # "stop": reached a stop token; "length": max_new_tokens

    def to_dict(self) -> dict:
        return asdict(self)


def split_reasoning(raw: str, kind: str, special_tokens: Iterable[str] = ()) -> tuple[str | None, str]:
    """(reasoning, answer) of a decoded completion (special tokens kept, stop token removed); the
    reasoning is None when the reply has none.

    The reply style of `kind` splits it (ftcli.chat_formats): harmony: analysis (and commentary) channels
    are reasoning, the final channel is the answer, and text outside any channel (an untrained model) is
    all answer; think: the prompt opened <think>, so the text before </think> (all of it while unclosed)
    is reasoning; plain: a <think>...</think> block the model opened itself is reasoning, the rest the answer."""
    specials = sorted((t for t in special_tokens if t), key=len, reverse=True)

    def clean(text: str) -> str:
        for tok in specials:
            text = text.replace(tok, "")
        return text.strip()

    return chat_formats.replies_of_kind(kind).split(raw, kind, clean)


def _complete(tokenizer, token_ids: list[int], stop_ids: list[int], kind: str) -> Completion:
    """Generated ids -> Completion; `kind` from `reply_kind` of the prompt."""
    stopped = bool(token_ids) and token_ids[-1] in stop_ids
    body = token_ids[:-1] if stopped else token_ids
    raw = tokenizer.decode(body, skip_special_tokens=False)
    reasoning, text = split_reasoning(raw, kind, _special_strings(tokenizer))
    return Completion(text=text, reasoning=reasoning or None, raw=raw, token_ids=list(token_ids),
                      finish_reason="stop" if stopped else "length")


def _special_strings(tokenizer) -> list[str]:
    added = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    return added + list(tokenizer.all_special_tokens)


def _left_pad(prompts: list[list[int]], pad_id: int, device):
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p):] = 1
    return input_ids.to(device), attention_mask.to(device)


def _generate_ids(model, prompts: list[list[int]], config, pad_id: int, *, streamer=None,
                  synced_gpus: bool = False) -> list[list[int]]:
    """Left-padded batch -> each row's new token ids, cut after its first stop token."""
    import torch

    if not synced_gpus:  # static-state decoding with a CUDA graph per step (ftcli.model.decode), where it applies
        from ftcli.model.decode import generate_ids

        fast = generate_ids(model, prompts, config, streamer=streamer)
        if fast is not None:
            return fast
    device = next(model.parameters()).device
    input_ids, attention_mask = _left_pad(prompts, pad_id, device)
    with torch.no_grad():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=config,
                             streamer=streamer, synced_gpus=synced_gpus)
    stops = set(config.eos_token_id or [])
    rows = []
    for row in out[:, input_ids.shape[1]:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        rows.append(row[:cut])
    return rows


def generate(loaded: LoadedModel, conversations: list[list[dict]], sampling: Sampling, *,
             template_kwargs: dict | None = None, batch_size: int = 8, progress=None) -> list[Completion]:
    """Completions for conversations, in order; batches of `batch_size`, left-padded. Prompts are
    grouped by length (less padding); `sampling.seed` seeds the run once, before the first batch."""
    from transformers import set_seed

    from ftcli.data.chat import pad_token_id

    tok = loaded.tokenizer
    pad_id = pad_token_id(tok)
    config = sampling.generation_config(loaded.model, loaded.stop_ids, pad_id)
    prompts = [render_prompt(tok, c, template_kwargs) for c in conversations]
    if sampling.seed is not None:
        set_seed(sampling.seed)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    results: list[Completion | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        for i, ids in zip(idx, _generate_ids(loaded.model, [prompts[i] for i in idx], config, pad_id)):
            results[i] = _complete(tok, ids, loaded.stop_ids, reply_kind(tok, prompts[i]))
        if progress is not None:
            progress(len(idx))
    return results  # type: ignore[return-value]


def sample_greedy(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int = 64, *,
                  batch_size: int = 8, synced_gpus: bool = False, template_kwargs: dict | None = None) -> list[str]:
    """Greedy completions (decoded, special tokens kept, the stop token removed) for a model that is
    already in memory: samples during training, register's probe. The caller's train/eval mode is
    restored. Under FSDP2 every rank must call this with the same conversations and
    `synced_gpus=True`: each decoding step is a sharded forward (an all-gather per layer), and
    synced_gpus keeps a rank that reached its stop tokens stepping until all ranks are done."""
    from ftcli.data.chat import pad_token_id

    pad_id = pad_token_id(tokenizer)
    stop_ids = stop_token_ids(tokenizer, model)
    config = Sampling(max_new_tokens=max_new_tokens, greedy=True).generation_config(model, stop_ids, pad_id)
    prompts = [render_prompt(tokenizer, c, template_kwargs) for c in conversations]
    was_training = model.training
    model.eval()
    try:
        out = []
        for start in range(0, len(prompts), batch_size):
            for ids in _generate_ids(model, prompts[start:start + batch_size], config, pad_id,
                                     synced_gpus=synced_gpus):
                body = ids[:-1] if ids and ids[-1] in stop_ids else ids
                out.append(without_empty_think(tokenizer.decode(body, skip_special_tokens=False)))
        return out
    finally:
        model.train(was_training)


def without_empty_think(text: str) -> str:
    """A reply without the empty think block it opens with (Qwen's `\n</think>\n\n` after the prompt's
    `<think>\n`): the answer is what follows it."""
    return EMPTY_THINK.sub("", text, count=1)


def reply_fields(tokenizer, messages: list[dict], completion: Completion, template_kwargs: dict | None = None,
                 like: list[dict] | None = None) -> dict:
    """An output row's reply: `completion` (the answer) and `reasoning`, and where the reply calls tools,
    `tool_calls` in the OpenAI shape the conversation uses (`ftcli.inference.tool_calls`; `like`: the
    conversation as its file wrote it, where `messages` were normalized), taken out of both."""
    from ftcli.inference.tool_calls import openai_tool_calls, parse_tool_calls

    calls, rest = parse_tool_calls(completion.raw, chat_format(tokenizer))
    if not calls:
        return {"completion": completion.text, "reasoning": completion.reasoning}
    kind = reply_kind(tokenizer, render_prompt(tokenizer, messages, template_kwargs))
    reasoning, text = split_reasoning(rest, kind, _special_strings(tokenizer))
    return {"completion": text, "reasoning": reasoning or None, "tool_calls": openai_tool_calls(calls, like if like is not None else messages)}


# ----------------------------------------------------------------------------------- streaming
class ReplyView:
    """Turns the growing raw text of a reply into what the terminal shows: a `reasoning:` section
    and an `answer:` section where the reply has reasoning, without the channel markup."""

    def __init__(self, tokenizer, kind: str):
        self.kind = kind
        self.replies = chat_formats.replies_of_kind(kind)
        self.specials = _special_strings(tokenizer)
        self.raw, self.shown = "", ""

    def render(self, raw: str) -> str:
        reasoning, answer = split_reasoning(raw, self.kind, self.specials)
        if reasoning is None:
            return answer
        answered = self.replies.answered(raw)
        if not reasoning:  # an empty think block (Qwen's `\n</think>\n\n`): no reasoning section
            return answer if answered else ""
        return f"reasoning:\n{reasoning}" + (f"\n\nanswer:\n{answer}" if answered else "")

    def feed(self, chunk: str) -> str:
        """The new text to print; empty when the display changed in a way that cannot be appended
        (`finish` then prints the whole reply once more)."""
        self.raw += chunk
        view = self.render(self._settled())
        if not view.startswith(self.shown):
            return ""
        new, self.shown = view[len(self.shown):], view
        return new

    def _settled(self) -> str:
        """The raw text without what may still change its meaning: a partial `<|token|>`, and what the reply
        style holds back (a harmony header, `<|start|>assistant<|channel|>final`, whose `<|message|>` has not
        come yet)."""
        raw = self.raw
        cut = raw.rfind("<|")
        if cut > raw.rfind("|>"):
            raw = raw[:cut]
        return self.replies.settled(raw)

    def finish(self, raw: str) -> str:
        """What is left to print once the reply is complete."""
        view = self.render(raw)
        if view.startswith(self.shown):
            return view[len(self.shown):]
        return "\n---\n" + view


def _strip(text: str, specials: list[str]) -> str:
    for tok in sorted(specials, key=len, reverse=True):
        text = text.replace(tok, "")
    return text


@dataclass
class StreamStats:
    new_tokens: int
    seconds: float
    first_token_s: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        first = f", first token after {self.first_token_s:.2f} s" if self.first_token_s is not None else ""
        return f"{self.new_tokens} tokens in {self.seconds:.2f} s ({self.tokens_per_s:.1f} tokens/s{first})"


def stream_reply(loaded: LoadedModel, messages: list[dict], sampling: Sampling, *, write,
                 template_kwargs: dict | None = None) -> tuple[Completion, StreamStats]:
    """Generate one reply, calling `write(text)` as tokens arrive (transformers' TextStreamer)."""
    from transformers import TextStreamer, set_seed

    from ftcli.data.chat import pad_token_id

    tok = loaded.tokenizer
    timing: dict[str, float] = {}

    class _Streamer(TextStreamer):
        def put(self, value):
            if not self.next_tokens_are_prompt and "first" not in timing:
                timing["first"] = time.perf_counter()
            super().put(value)

        def on_finalized_text(self, text: str, stream_end: bool = False):
            new = view.feed(text)
            if new:
                write(new)

    pad_id = pad_token_id(tok)
    config = sampling.generation_config(loaded.model, loaded.stop_ids, pad_id)
    prompt = render_prompt(tok, messages, template_kwargs)
    view = ReplyView(tok, reply_kind(tok, prompt))
    if sampling.seed is not None:
        set_seed(sampling.seed)
    start = time.perf_counter()
    streamer = _Streamer(tok, skip_prompt=True, skip_special_tokens=False)
    ids = _generate_ids(loaded.model, [prompt], config, pad_id, streamer=streamer)[0]
    seconds = time.perf_counter() - start
    completion = _complete(tok, ids, loaded.stop_ids, view.kind)
    rest = view.finish(completion.raw)  # what the streamer still held back
    if rest:
        write(rest)
    first = timing["first"] - start if "first" in timing else None
    return completion, StreamStats(new_tokens=len(ids), seconds=seconds, first_token_s=first)
