"""The malformed-recipe corpus (119 recipes: YAML syntax, missing keys, wrong types, unknown keys, inf / nan,
impossible sizes, out of range, duplicate keys, alias bombs, deep nesting, binary and other encodings), each a
file's content. Read by tests/unit/test_cli_errors.py (every file, in-process) and tests/e2e/test_cli_real_process.py
(the nastiest, through `python -m ftcli`); tests/conftest.py's `recipe_corpus` writes them out."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from _recipe_common import DELETE as _DELETE, set_key as _set
from ftcli.config.recipe import builtin_recipe_text

TINY_TEXT = builtin_recipe_text("tiny-qwen-cpu")
TINY = yaml.safe_load(TINY_TEXT)


def _with(path: str, value) -> str:
    """The tiny recipe's YAML with `path` (dotted) set to `value`, or deleted for `value is _DELETE`."""
    return yaml.safe_dump(_set(json.loads(json.dumps(TINY)), path, value), sort_keys=False)

_BOMB = "\n".join(
    ["  config_overrides:", "    a0: &a0 [" + ",".join(['"lol"'] * 10) + "]"]
    + [f"    a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 24)]
)

CORPUS: dict[str, str | bytes] = {
    # --- YAML syntax
    "unclosed-flow-list": "name: x\nmodel: [\n",
    "unclosed-flow-map": TINY_TEXT.replace("optimizer: {", "optimizer: {{", 1),
    "bad-indentation": "name: x\nmodel:\n  init: random\n    config: a\n",
    "tab-indentation": "name: x\nmodel:\n\tinit: random\n",
    "unterminated-quote": 'name: "x\nmodel: {}\n',
    "stray-bracket": TINY_TEXT + "]\n",
    "mapping-in-scalar": "name: a: b\n",
    "list-and-map-mixed": "name: x\n- a\n",
    "two-documents": TINY_TEXT + "---\nname: y\n",
    "bad-directive": "%YAML 9.9\n---\nname: x\n",
    "undefined-alias": TINY_TEXT.replace("  dtype: float32\n", "  dtype: *nope\n", 1),
    "python-tag": "name: !!python/object/apply:os.system ['echo hi']\n",
    "unknown-tag": TINY_TEXT.replace("name: tiny-qwen-cpu", "name: !secret x", 1),
    "bad-binary-tag": "name: !!binary 'not base64 ~~~'\n",
    "unhashable-key": "? [a, b]\n: c\n",
    # --- top level
    "empty-file": "",
    "only-a-comment": "# nothing here\n",
    "top-level-list": "- name: x\n- model: {}\n",
    "top-level-scalar": "tiny-qwen-cpu\n",
    "top-level-null": "~\n",
    "top-level-number": "42\n",
    # --- missing keys
    "missing-name": _with("name", _DELETE),
    "missing-model": _with("model", _DELETE),
    "missing-data": _with("data", _DELETE),
    "missing-model-type": _with("model.model_type", _DELETE),
    "random-init-without-config": _with("model.config", _DELETE),
    "local-data-without-path": _with("data.path", _DELETE),
    # --- wrong types
    "name-is-a-number": _with("name", 123),
    "model-is-a-list": _with("model", [1, 2]),
    "data-is-a-string": _with("data", "chat.jsonl"),
    "training-is-a-number": _with("training", 5),
    "lr-is-a-word": _with("training.optimizer.lr", "fast"),
    "betas-one-value": _with("training.optimizer.betas", [0.9]),
    "betas-a-scalar": _with("training.optimizer.betas", 0.9),
    "epochs-a-list": _with("training.epochs", [1]),
    "grad-accum-fraction": _with("training.grad_accum", 1.5),
    "num-accelerators-word": _with("compute.num_accelerators", "eight"),
    "env-variables-list": _with("compute.env_variables", ["A=1"]),
    "env-variable-number": _with("compute.env_variables", {"A": 1}),
    "target-modules-number": _with("lora.target_modules", 5),
    "config-overrides-list": _with("model.config_overrides", [1, 2]),
    "tracking-enabled-maybe": _with("tracking.enabled", "maybe"),
    "dtype-unknown": _with("model.dtype", "float8"),
    "method-unknown": _with("training.method", "dpo"),
    # --- unknown keys
    "unknown-section": _with("trainig", {"epochs": 1}),
    "unknown-training-lr": _with("training.lr", 0.1),
    "unknown-model-key": _with("model.weights", "x"),
    "unknown-packing-key": _with("data.packing.block_length", 4096),
    "unknown-compute-key": _with("compute.gpus", 8),
    "non-string-key": TINY_TEXT.replace("name: tiny-qwen-cpu", "name: tiny-qwen-cpu\n1: one", 1),
    # --- inf / nan
    "lr-inf": _with("training.optimizer.lr", float("inf")),
    "epochs-inf": _with("training.epochs", float("inf")),
    "warmup-nan": _with("training.schedule.warmup", float("nan")),
    "grad-clip-minus-inf": _with("training.grad_clip", float("-inf")),
    "min-lr-ratio-nan": _with("training.schedule.min_lr_ratio", float("nan")),
    "every-minutes-inf": _with("training.checkpoint.every_minutes", float("inf")),
    "override-rope-theta-inf": _with("model.config_overrides", {"rope_theta": float("inf")}),
    "betas-nan": _with("training.optimizer.betas", [0.9, float("nan")]),
    # --- impossible sizes in the model config
    "override-zero-layers": _with("model.config_overrides", {"num_hidden_layers": 0}),
    "override-negative-layers": _with("model.config_overrides", {"num_hidden_layers": -1}),
    "override-negative-hidden-size": _with("model.config_overrides", {"text_config": {"hidden_size": -4}}),
    "override-heads-as-bool": _with("model.config_overrides", {"num_attention_heads": True}),
    "data-sources-not-a-list": _with("data.sources", 5),
    "eval-sources-not-a-list": _with("eval", {"sources": 5}),
    "lr-huge-exponent": TINY_TEXT.replace("lr: 3.0e-3", "lr: 1.0e999", 1),
    # --- booleans as numbers
    "lr-true": _with("training.optimizer.lr", True),
    "grad-accum-true": _with("training.grad_accum", True),
    "epochs-false": _with("training.epochs", False),
    "block-len-true": _with("data.packing.block_len", True),
    "num-accelerators-true": _with("compute.num_accelerators", True),
    "betas-true": _with("training.optimizer.betas", [True, 0.9]),
    "max-steps-true": _with("training.max_steps", True),
    "keep-last-true": _with("training.checkpoint.keep_last", True),
    "lora-r-true": _with("lora.r", True),
    # --- out of range
    "lr-zero": _with("training.optimizer.lr", 0),
    "lr-negative": _with("training.optimizer.lr", -1e-5),
    "epochs-zero": _with("training.epochs", 0),
    "grad-accum-zero": _with("training.grad_accum", 0),
    "block-len-4": _with("data.packing.block_len", 4),
    "block-len-a-trillion": _with("data.packing.block_len", 1_000_000_000_000),
    "block-len-over-max-positions": _with("data.packing.block_len", 8192),
    "dropout-one": _with("lora.dropout", 1.0),
    "min-lr-ratio-two": _with("training.schedule.min_lr_ratio", 2),
    "num-accelerators-not-multiple": _with("compute.num_accelerators", 3).replace("GPU_1xA10", "GPU_2xH100"),
    "accelerator-type-lowercase": _with("compute.accelerator_type", "gpu_8xh100"),
    "secret-ref-without-slash": _with("compute.secrets", {"HF_TOKEN": "token"}),
    "priority-without-pool": _with("compute.priority_class", "NORMAL"),
    "keep-without-full-checkpointing": _with("training.activation_checkpointing_keep", 2),
    "eager-attention-with-packing": _with("model.attn_implementation", "eager"),
    "permission-two-principals": _with("compute.permissions", [{"user_name": "a", "group_name": "b",
                                                                "level": "CAN_VIEW"}]),
    "secret-and-env-both": _with("compute.env_variables", {"HF_TOKEN": "x"}).replace(
        "compute:\n", "compute:\n  secrets: {HF_TOKEN: scope/key}\n", 1),
    # --- names
    "name-with-space": _with("name", "has space"),
    "name-with-newline": _with("name", "a\nb"),
    "name-too-long": _with("name", "x" * 101),
    "experiment-with-newline": _with("tracking.experiment", "exp\nname"),
    "run-name-with-escape": _with("tracking.run_name", "run\x1b[31m"),
    "run-name-blank": _with("tracking.run_name", "   "),
    # --- duplicate keys
    "duplicate-section": TINY_TEXT + "training:\n  epochs: 2\n",
    "duplicate-name": "name: a\n" + TINY_TEXT,
    "duplicate-nested": TINY_TEXT.replace("  dtype: float32\n", "  dtype: float32\n  dtype: bfloat16\n", 1),
    "duplicate-in-flow-map": TINY_TEXT.replace("lr: 3.0e-3,", "lr: 3.0e-3, lr: 1.0,", 1),
    # --- aliases
    "alias-bomb-in-config-overrides": TINY_TEXT.replace("model:\n", f"model:\n{_BOMB}\n", 1),
    "alias-reuse": TINY_TEXT.replace("  dtype: float32\n", "  dtype: &d float32\n", 1)
    + "lora:\n  bias: *d\n",
    "merge-key": "name: x\nbase: &b {epochs: 1}\ntraining:\n  <<: *b\n",
    "self-referential-alias": "name: x\nmodel: &m\n  config_overrides: {self: *m}\n",
    # --- deep nesting
    "deep-flow-list": "name: x\nmodel:\n  config_overrides:\n    deep: " + "[" * 5000 + "]" * 5000 + "\n",
    "deep-flow-map": "name: x\nmodel:\n  config_overrides:\n    deep: " + "{a: " * 5000 + "1" + "}" * 5000 + "\n",
    "deep-block-map": "".join("  " * i + "k:\n" for i in range(200)),
    "deep-block-list": "".join("  " * i + "-\n" for i in range(200)),
    # --- binary and encodings
    "binary-random": bytes(range(256)) * 4,
    "binary-gzip-header": b"\x1f\x8b\x08\x00" + b"\x00" * 20,
    "nul-bytes-in-utf8": TINY_TEXT.replace("name: tiny-qwen-cpu", "name: tiny\x00qwen", 1).encode(),
    "bell-character": "name: x\x07\n",
    "latin-1-text": TINY_TEXT.replace("description:", "description: caf\xe9", 1).encode("latin-1"),
    "utf-16-with-bom": TINY_TEXT.encode("utf-16"),
    "truncated-utf8": TINY_TEXT.encode() + "é".encode()[:1],
    "lone-surrogate-escape": 'name: "\\ud800"\n',
    "elf-binary": b"\x7fELF\x02\x01\x01\x00" + bytes(200),
    "oversized-file": b"# " + b"x" * (8 * 2**20) + b"\n",
}


def write_corpus(root: Path) -> Path:
    """Every corpus file as root/<case>.yaml (bytes as they are, text as UTF-8 with lone surrogates kept)."""
    for name, content in CORPUS.items():
        path = root / f"{name}.yaml"
        path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    return root
