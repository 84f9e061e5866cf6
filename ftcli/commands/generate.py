"""`ftcli generate`: load what a fine-tune produced and turn conversations into completions.

    RUN_OR_MODEL
      a run dir (run.json, read as a RunRecord)
        not finished: run.json status != "completed", or no run.json but recipe.yaml/checkpoints/
                      -> refused in one line (the final model is written only at the end)
        full run   -> <run>/final (RunRecord.model_dir)
        LoRA run   -> base + adapter, *not* merged (PEFT): the base is RunRecord.base_model
                      (<run>/base for a random-init base, else its hub id @ revision or local path)
      <run>/final  -> the same as its run
      a dir with adapter_config.json -> its base (adapter_config's base_model_name_or_path) + adapter
      a dir with config.json         -> a Hugging Face checkpoint (merged dir, exported final/)
      anything else of the form owner/name -> a hub id at --revision
    -> the model's own tokenizer and chat template, rendered with add_generation_prompt
    -> stop at the template's end of turn (see `stop_token_ids`) and the generation config's eos
    -> transformers' generate(GenerationConfig): greedy or sampled (temperature, top_p, top_k, seed),
       prompts left-padded into batches
    -> the completion split into reasoning and answer: harmony channels (gpt-oss: analysis / final)
       or a <think> block (Qwen3.x)

`sample_greedy` is the entry point for code that already holds a model (samples during training,
register's probe): the same rendering, stop tokens and left-padded greedy decoding.

Multi-turn chat (`ftcli chat`) is ftcli.commands.chat, over `stream_reply` below.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ftcli.config.errors import UserError

DEVICES = ("auto", "cpu", "cuda", "mps")
DTYPES = ("auto", "bfloat16", "float16", "float32")
ROLES = ("system", "developer", "user", "assistant", "tool")
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# harmony (gpt-oss): <|start|>assistant<|channel|>analysis<|message|>...<|end|> ... <|channel|>final<|message|>...
_HARMONY_MESSAGE = re.compile(
    r"<\|channel\|>(?P<channel>[^<]*?)(?:<\|constrain\|>[^<]*)?<\|message\|>(?P<body>.*?)"
    r"(?=<\|end\|>|<\|return\|>|<\|call\|>|<\|start\|>|$)",
    re.S,
)
_PROBE = "FTCLI_END_OF_TURN_PROBE"


# ------------------------------------------------------------------------------------------ source
@dataclass
class ModelSource:
    """What RUN_OR_MODEL names, resolved without loading anything (cheap checks run first)."""

    model: str  # the checkpoint to load: a local dir or a hub id (for an adapter: its base)
    revision: str | None = None
    adapter: Path | None = None  # a LoRA adapter dir applied on top of `model`, unmerged
    run_dir: Path | None = None
    model_class: str | None = None  # "causal_lm" | "image_text_to_text"; None: from the config
    trust_remote_code: bool = False

    def describe(self) -> str:
        base = f"{self.model}@{self.revision}" if self.revision else self.model
        return f"{base} + adapter {self.adapter}" if self.adapter else base


def resolve_source(ref: str, revision: str | None = None) -> ModelSource:
    """RUN_OR_MODEL -> ModelSource (see the module docstring). A user mistake is one UserError."""
    from ftcli.artifacts.rundir import CHECKPOINTS, RECIPE_FILE, RUN_JSON

    path = Path(ref).expanduser()
    if not path.exists():
        if _HUB_ID.match(ref) and not ref.startswith((".", "~")):
            return ModelSource(model=ref, revision=revision)
        raise UserError(f"{ref}: no such run dir or model dir (and not a hub id of the form owner/name)")
    if not path.is_dir():
        raise UserError(f"{path} is a file; pass a run dir, a model dir or a hub id")
    path = path.resolve()
    if (path / RUN_JSON).is_file():
        return _source_of_run(path)
    if (path.parent / RUN_JSON).is_file():  # <run>/final: the run says how to load it (e.g. its base)
        run = _source_of_run(path.parent)
        if path == (run.adapter or Path(run.model)):  # (not a LoRA run's base/: that is a plain model)
            return run
    if (path / RECIPE_FILE).is_file() or (path / CHECKPOINTS).is_dir():
        raise UserError(f"{path} is a run that has not finished (no run.json yet: it is still training, or it "
                        f"stopped early; `ftcli train --recipe {path / RECIPE_FILE} --resume` continues it)")
    if (path / "adapter_config.json").is_file():
        return _source_of_adapter(path)
    if (path / "config.json").is_file():
        return ModelSource(model=str(path))
    raise UserError(f"{path} holds no model: expected run.json (a run dir), config.json (a model dir) or "
                    "adapter_config.json (a LoRA adapter)")


def _source_of_run(run_dir: Path) -> ModelSource:
    """A finished run: its final model (full) or base + adapter (LoRA), all from the RunRecord."""
    from ftcli.config.recipe import resolve_path
    from ftcli.artifacts.rundir import read_run_record

    record = read_run_record(run_dir)
    if record.status != "completed":
        raise UserError(f"{run_dir}: the run is {record.status!r}, not completed; its final model is written "
                        "when training ends")
    model_dir = record.model_path(run_dir)
    if model_dir is None or not model_dir.is_dir():
        where = "run.json names no model_dir" if model_dir is None else f"{model_dir} does not exist"
        raise UserError(f"{run_dir}: no model in this run ({where}; a full run exports final/ only with "
                        "training.checkpoint.save_final_hf: true)")
    trust = bool((record.recipe.get("model") or {}).get("trust_remote_code", False))
    if record.method == "full":
        if not (model_dir / "config.json").is_file():
            raise UserError(f"{run_dir}: no model in this run ({model_dir} has no config.json)")
        return ModelSource(model=str(model_dir), run_dir=run_dir, model_class=record.base_model.model_class,
                           trust_remote_code=trust)
    if not (model_dir / "adapter_config.json").is_file():
        raise UserError(f"{run_dir}: no model in this LoRA run ({model_dir} has no adapter_config.json)")
    base = record.base_model
    if base.path:
        base_ref, base_revision = str(run_dir / base.path), None
        if not (Path(base_ref) / "config.json").is_file():
            raise UserError(f"{run_dir}: the LoRA run's base {base_ref} is missing (run.json base_model.path)")
    elif base.init == "random":
        raise UserError(f"{run_dir}: the base was random-init and run.json has no base_model.path; "
                        "nothing to load the adapter onto")
    elif base.id:
        base_ref, base_revision = resolve_path(base.id), base.revision
        local = Path(base_ref).expanduser()
        if local.exists():
            base_ref = str(local.resolve())
    else:
        raise UserError(f"{run_dir}: run.json names no base model for the adapter")
    return ModelSource(model=base_ref, revision=base_revision, adapter=model_dir, run_dir=run_dir,
                       model_class=base.model_class, trust_remote_code=trust)


def _source_of_adapter(adapter: Path) -> ModelSource:
    config = json.loads((adapter / "adapter_config.json").read_text())
    base = config.get("base_model_name_or_path")
    if not base:
        raise UserError(f"{adapter}: the adapter does not say which base it belongs to (base_model_name_or_path)")
    return ModelSource(model=base, revision=config.get("revision"), adapter=adapter)


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
    from ftcli.config.recipe import ModelConfig

    dev = pick_device(device)
    dtype = pick_dtype(dtype, dev)
    try:
        config = AutoConfig.from_pretrained(source.model, revision=source.revision,
                                            trust_remote_code=source.trust_remote_code)
    except (OSError, ValueError) as e:
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

    candidates = [(str(source.adapter), None)] if source.adapter is not None else []
    candidates.append((source.model, source.revision))
    problem = None
    for name, revision in candidates:
        try:
            tokenizer = AutoTokenizer.from_pretrained(name, revision=revision,
                                                      trust_remote_code=source.trust_remote_code)
        except (OSError, ValueError) as e:
            problem = _first_line(e)
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
def reply_kind(tokenizer, prompt_ids: list[int]) -> str:
    """How a reply to this prompt is structured: 'harmony' (gpt-oss channels), 'think' (the
    generation prompt opened a <think> block, Qwen3.x: the reply is reasoning until </think>) or
    'plain'."""
    if "<|channel|>" in (tokenizer.chat_template or ""):
        return "harmony"
    tail = tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False).rstrip()
    return "think" if tail.endswith("<think>") else "plain"


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """Where a reply ends: the special token the chat template closes a final assistant turn with
    (Qwen `<|im_end|>`, gpt-oss `<|return|>`), gpt-oss's `<|call|>` (a tool call ends the turn too),
    and the eos ids of the tokenizer and the model's generation config. Not gpt-oss's `<|end|>`: it
    closes the analysis message, after which the model goes on to the final channel."""
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
    if "<|call|>" in (tokenizer.chat_template or ""):
        add(tokenizer.convert_tokens_to_ids("<|call|>"))
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
    except TemplateError as e:
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

    harmony: analysis (and commentary) channels are reasoning, the final channel is the answer, and
    text outside any channel (an untrained model) is all answer; think: the prompt opened <think>,
    so the text before </think> (all of it while unclosed) is reasoning; plain: a <think>...</think>
    block the model opened itself is reasoning, the rest the answer."""
    specials = sorted((t for t in special_tokens if t), key=len, reverse=True)

    def clean(text: str) -> str:
        for tok in specials:
            text = text.replace(tok, "")
        return text.strip()

    if kind == "harmony":
        messages = [(m["channel"].split()[0] if m["channel"].split() else "", m["body"])
                    for m in _HARMONY_MESSAGE.finditer(raw)]
        if not messages:
            return None, clean(raw)
        thoughts = [clean(b) for c, b in messages if c != "final"]
        answer = "\n".join(clean(b) for c, b in messages if c == "final")
        return ("\n".join(thoughts) if thoughts else None), answer
    if kind == "think" or "</think>" in raw:
        before, closed, after = raw.partition("</think>")
        if kind == "plain" or closed:
            return clean(before.replace("<think>", "")), clean(after)
        return clean(before), ""
    return None, clean(raw)


def _complete(tokenizer, token_ids: list[int], stop_ids: list[int], kind: str) -> Completion:
    """Generated ids -> Completion; `kind` from `reply_kind` of the prompt."""
    stopped = bool(token_ids) and token_ids[-1] in stop_ids
    body = token_ids[:-1] if stopped else token_ids
    raw = tokenizer.decode(body, skip_special_tokens=False)
    reasoning, text = split_reasoning(raw, kind, _special_strings(tokenizer))
    return Completion(text=text, reasoning=reasoning, raw=raw, token_ids=list(token_ids),
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
                out.append(tokenizer.decode(body, skip_special_tokens=False))
        return out
    finally:
        model.train(was_training)


# ----------------------------------------------------------------------------------- streaming
class ReplyView:
    """Turns the growing raw text of a reply into what the terminal shows: a `reasoning:` section
    and an `answer:` section where the reply has reasoning, without the channel markup."""

    def __init__(self, tokenizer, kind: str):
        self.kind = kind
        self.specials = _special_strings(tokenizer)
        self.raw, self.shown = "", ""

    def render(self, raw: str) -> str:
        reasoning, answer = split_reasoning(raw, self.kind, self.specials)
        if reasoning is None:
            return answer
        answered = "<|channel|>final" in raw if self.kind == "harmony" else "</think>" in raw
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
        """The raw text without what may still change its meaning: a partial `<|token|>`, and a
        harmony header (`<|start|>assistant<|channel|>final`) whose `<|message|>` has not come yet."""
        raw = self.raw
        cut = raw.rfind("<|")
        if cut > raw.rfind("|>"):
            raw = raw[:cut]
        if self.kind == "harmony":
            header = max(raw.rfind("<|start|>"), raw.rfind("<|channel|>"))
            if header >= 0 and "<|message|>" not in raw[header:]:
                raw = raw[:header]
        return raw

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


# -------------------------------------------------------------------------------- prompt files
@dataclass
class PromptRow:
    line: int
    messages: list[dict]
    reference: str | None = None  # a trailing assistant turn of the row: the answer to compare with


def read_prompt_file(path: Path) -> tuple[list[PromptRow], list[tuple[int, str]]]:
    """A JSONL file of conversations -> (rows, bad rows as (line number, reason)). A row is
    {"messages": [...]} (a trailing assistant message becomes `reference`) or {"prompt": "...",
    "system": "..."}; blank lines are skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        raise UserError(f"--input {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"--input {path}: cannot read it ({e})") from None
    rows, bad = [], []
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            rows.append(_prompt_row(number, json.loads(text)))
        except json.JSONDecodeError:
            bad.append((number, "not valid JSON"))
        except ValueError as e:
            bad.append((number, str(e)))
    return rows, bad


def _prompt_row(number: int, row: Any) -> PromptRow:
    if not isinstance(row, dict):
        raise ValueError(f"a {type(row).__name__}, not an object")
    if "messages" in row:
        messages = row["messages"]
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' is not a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ROLES or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} is not {{'role': one of {'/'.join(ROLES)}, 'content': a string}}")
        reference = None
        if messages[-1]["role"] == "assistant":
            reference, messages = messages[-1]["content"], messages[:-1]
        if not messages or messages[-1]["role"] not in ("user", "tool"):
            raise ValueError("no user turn to answer")
        return PromptRow(number, messages, reference)
    if isinstance(row.get("prompt"), str) and row["prompt"].strip():
        system = row.get("system")
        if system is not None and not isinstance(system, str):
            raise ValueError("'system' is not a string")
        return PromptRow(number, conversation(row["prompt"], system))
    raise ValueError("no 'messages' list or 'prompt' string")


def _bad_rows_summary(path: Path, bad: list[tuple[int, str]], total: int, shown: int = 5) -> str:
    listed = "; ".join(f"line {n}: {why}" for n, why in bad[:shown])
    more = f"; and {len(bad) - shown} more" if len(bad) > shown else ""
    return f"{path}: {len(bad)} of {total} rows skipped ({listed}{more})"


# ---------------------------------------------------------------------------------- the command
def run_generate(ref: str, *, prompt: str | None, system: str | None, input_path: Path | None,
                 output: Path | None, force: bool, sampling: Sampling, reasoning_effort: str | None,
                 reasoning_language: str | None, dtype: str, device: str, revision: str | None,
                 batch_size: int, as_json: bool) -> None:
    """`ftcli generate`: one streamed prompt, or a JSONL file of conversations -> a JSONL file."""
    from rich.console import Console

    err = Console(stderr=True, highlight=False, soft_wrap=True)
    if (prompt is None) == (input_path is None):
        raise UserError("pass either --prompt TEXT or --input FILE.jsonl")
    if input_path is not None and (system or reasoning_language):
        raise UserError("--system/--reasoning-language apply to --prompt; put system messages into the --input rows")
    if output is not None and input_path is None:
        raise UserError("--output goes with --input FILE.jsonl")
    if output is not None and output.exists() and not force:
        raise UserError(f"{output} exists; pass --force to overwrite it")
    if batch_size < 1:
        raise UserError("--batch-size must be at least 1")
    rows, bad = read_prompt_file(input_path) if input_path is not None else ([], [])
    if input_path is not None and not rows:
        raise UserError(_bad_rows_summary(input_path, bad, len(bad)) if bad else f"{input_path}: no rows")
    source = resolve_source(ref, revision)
    kwargs = template_kwargs(reasoning_effort)
    with err.status(f"loading {source.describe()}"):
        loaded = load(source, dtype=dtype, device=device)
    if input_path is None:
        _single(loaded, conversation(prompt, system_prompt(system, reasoning_language)), sampling, kwargs,
                as_json=as_json, err=err)
        return
    total = len(rows) + len(bad)
    rows, refused = _renderable(loaded.tokenizer, rows, kwargs)
    if not rows:  # e.g. a --reasoning-effort the template does not know: the same error for every row
        raise UserError(refused[0][1])
    bad = sorted(bad + refused)
    completions = _batched(loaded, rows, sampling, kwargs, batch_size, err)
    lines = [json.dumps({"line": r.line, "messages": r.messages, "completion": c.text, "reasoning": c.reasoning,
                         **({"reference": r.reference} if r.reference is not None else {}),
                         "finish_reason": c.finish_reason, "new_tokens": len(c.token_ids)}, ensure_ascii=False)
             for r, c in zip(rows, completions)]
    text = "".join(line + "\n" for line in lines)
    if output is None:
        print(text, end="")
    else:
        output.write_text(text, encoding="utf-8")
        err.print(f"wrote {len(lines)} completions to {output}")
    if bad:
        raise UserError(_bad_rows_summary(input_path, bad, total))


def _renderable(tokenizer, rows: list[PromptRow], kwargs: dict) -> tuple[list[PromptRow], list[tuple[int, str]]]:
    """The rows the chat template renders, and (line, reason) for those it refuses."""
    good, refused = [], []
    for row in rows:
        try:
            render_prompt(tokenizer, row.messages, kwargs)
            good.append(row)
        except UserError as e:
            refused.append((row.line, str(e)))
    return good, refused


def _single(loaded: LoadedModel, messages: list[dict], sampling: Sampling, kwargs: dict, *, as_json: bool, err):
    import sys

    if as_json:
        completion, stats = stream_reply(loaded, messages, sampling, write=lambda _: None, template_kwargs=kwargs)
        print(json.dumps({**completion.to_dict(), "tokens_per_s": stats.tokens_per_s}, ensure_ascii=False))
        return

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    _, stats = stream_reply(loaded, messages, sampling, write=write, template_kwargs=kwargs)
    sys.stdout.write("\n")
    err.print(f"[dim]{stats.line()}[/]")


def _batched(loaded: LoadedModel, rows: list[PromptRow], sampling: Sampling, kwargs: dict, batch_size: int, err):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("generating"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=False) as bar:
        task = bar.add_task("generate", total=len(rows))
        start = time.perf_counter()
        completions = generate(loaded, [r.messages for r in rows], sampling, template_kwargs=kwargs,
                               batch_size=batch_size, progress=lambda n: bar.advance(task, n))
    seconds = time.perf_counter() - start
    new = sum(len(c.token_ids) for c in completions)
    err.print(f"[dim]{len(rows)} conversations, {new} new tokens in {seconds:.2f} s "
              f"({new / seconds if seconds > 0 else 0:.1f} tokens/s)[/]")
    return completions
