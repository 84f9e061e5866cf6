"""`ftcli generate` / `ftcli chat` on tiny random-init models (CPU): decoding against an independent
argmax loop, adapter-on-base against merged, seeds, left-padded batches, harmony/think splitting, and
user mistakes as one line."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from typer.testing import CliRunner

from ftcli import cli

from ftcli import inference as generate
from ftcli.commands import generate as generate_cmd
from ftcli.artifacts.resolve import model_source
from ftcli.commands.chat import Chat, run_chat
from ftcli.inference import Sampling
from ftcli.artifacts.rundir import BaseModelRecord, RunRecord, write_run_record
from ftcli.config.errors import UserError

runner = CliRunner()
CONFIGS = {"qwen": ("tiny-qwen3_5.json", "qwen3_5_text"), "gpt-oss": ("tiny-gpt-oss.json", "gpt_oss")}
PROMPTS = [
    [{"role": "user", "content": "What is 2 plus 4?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Repeat after me: river quiet light window cloud tiger"}],
    [{"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "What is the capital of Kenya?"}, {"role": "assistant", "content": "Nairobi."},
     {"role": "user", "content": "And what is the capital of Sweden?"}],
]


def _tiny(name: str, seed: int = 0):
    from ftcli.model.build import load_model
    from ftcli.config.recipe import ModelConfig

    config, model_type = CONFIGS[name]
    torch.manual_seed(seed)
    return load_model(ModelConfig(init="random", config=f"pkg://assets/{config}", tokenizer="unused",
                                  model_type=model_type, dtype="float32"))


def _tokenizer(name: str):
    from transformers import AutoTokenizer

    from ftcli.config.recipe import resolve_path

    return AutoTokenizer.from_pretrained(resolve_path(f"pkg://assets/tokenizer-{name}"))


def _save(model, tokenizer, path):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: _save(_tiny(name), _tokenizer(name), root / name) for name in CONFIGS}


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, model_dirs):
    """A finished full run: run.json (RunRecord) + final/, as `ftcli train` leaves it."""
    run = tmp_path_factory.mktemp("full-run")
    _save(_tiny("qwen"), _tokenizer("qwen"), run / "final")
    (run / "recipe.yaml").write_text("name: tiny-qwen-cpu\n")
    base = BaseModelRecord(init="random", model_type="qwen3_5_text")
    write_run_record(run, RunRecord(method="full", base_model=base))
    return run


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A finished LoRA run over a random-init gpt-oss saved at <run>/base, plus the merged model."""
    from peft import LoraConfig, get_peft_model

    run = tmp_path_factory.mktemp("lora-run")
    tok = _tokenizer("gpt-oss")
    base = _tiny("gpt-oss", seed=1)
    _save(base, tok, run / "base")
    torch.manual_seed(2)  # init_lora_weights=False: B is random too, so the adapter changes the replies
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear",
                                                 init_lora_weights=False))
    _save(peft_model, tok, run / "final")
    (run / "recipe.yaml").write_text("name: tiny-gpt-oss-cpu\n")
    write_run_record(run, RunRecord(method="lora", base_model=BaseModelRecord(
        init="random", path="base", model_type="gpt_oss", model_class="causal_lm")))
    merged = _save(peft_model.merge_and_unload(), tok, run.parent / "lora-merged")
    return run, merged


def _load(path) -> generate.LoadedModel:
    return generate.load(model_source(str(path)), device="cpu")


def argmax_decode(model, prompt: list[int], stop_ids: list[int], max_new_tokens: int) -> list[int]:
    """The oracle: the whole sequence through the model at every step (no KV cache), argmax of the
    last position, until a stop token or max_new_tokens."""
    ids, new = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new_tokens):
            token = int(model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, -1].argmax())
            ids.append(token)
            new.append(token)
            if token in stop_ids:
                break
    return new


# ------------------------------------------------------------------------------------- decoding
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_equals_argmax_decode_loop(name, model_dirs):
    loaded = _load(model_dirs[name])
    out = generate.generate(loaded, PROMPTS[:2], Sampling(max_new_tokens=12, greedy=True), batch_size=1)
    for conv, completion in zip(PROMPTS[:2], out):
        prompt = generate.render_prompt(loaded.tokenizer, conv)
        expected = argmax_decode(loaded.model, prompt, loaded.stop_ids, 12)
        assert completion.token_ids == expected
        assert len(expected) == 12 and completion.finish_reason == "length"  # random weights never stop
    texts = generate.sample_greedy(loaded.model, loaded.tokenizer, PROMPTS[:2], max_new_tokens=12)
    assert texts == [loaded.tokenizer.decode(c.token_ids, skip_special_tokens=False) for c in out]


def test_adapter_on_base_equals_merged(lora_run):
    from peft import PeftModel

    run, merged_dir = lora_run
    on_base, merged = _load(run), _load(merged_dir)
    assert isinstance(on_base.model, PeftModel) and on_base.source.adapter == run / "final"
    assert on_base.source.model == str(run / "base")
    greedy = Sampling(max_new_tokens=16, greedy=True)
    a = [c.token_ids for c in generate.generate(on_base, PROMPTS, greedy)]
    b = [c.token_ids for c in generate.generate(merged, PROMPTS, greedy)]
    assert a == b
    base_only = [c.token_ids for c in generate.generate(_load(run / "base"), PROMPTS, greedy)]
    assert base_only != a  # the adapter is applied: without it the replies differ
    assert model_source(str(run / "final")) == on_base.source  # <run>/final is its run


def test_seed_makes_sampling_reproducible(model_dirs):
    loaded = _load(model_dirs["gpt-oss"])

    def sample(seed):
        return generate.generate(loaded, PROMPTS[:2], Sampling(max_new_tokens=16, temperature=1.0, seed=seed))

    first, again, other = sample(1), sample(1), sample(2)
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert all(x.token_ids != y.token_ids for x, y in zip(first, other))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_batched_left_padded_equals_one_by_one(name, model_dirs):
    loaded = _load(model_dirs[name])
    lengths = {len(generate.render_prompt(loaded.tokenizer, c)) for c in PROMPTS}
    assert len(lengths) == len(PROMPTS)  # every row of the batch is padded differently
    greedy = Sampling(max_new_tokens=10, greedy=True)
    batched = generate.generate(loaded, PROMPTS, greedy, batch_size=4)
    single = generate.generate(loaded, PROMPTS, greedy, batch_size=1)
    assert [c.token_ids for c in batched] == [c.token_ids for c in single]


def test_sample_greedy_stops_at_end_of_turn_and_restores_mode(model_dirs):
    loaded = _load(model_dirs["qwen"])
    model, tok = loaded.model, loaded.tokenizer
    prompt = generate.render_prompt(tok, PROMPTS[0])
    first = argmax_decode(model, prompt, [], 3)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    with torch.no_grad():  # make <|im_end|> the argmax right after the 3rd new token
        model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
        hidden = model.model(input_ids=torch.tensor([prompt + first])).last_hidden_state[0, -1]
        logits = model.lm_head(hidden)
        model.lm_head.bias[im_end] = logits.max() - logits[im_end] + 1.0
    expected = argmax_decode(model, prompt, loaded.stop_ids, 20)
    assert expected[-1] == im_end and len(expected) <= 20
    model.train()
    texts = generate.sample_greedy(model, tok, [PROMPTS[0]], max_new_tokens=20)
    assert model.training
    assert texts == [tok.decode(expected[:-1], skip_special_tokens=False)]
    (completion,) = generate.generate(loaded, [PROMPTS[0]], Sampling(max_new_tokens=20, greedy=True))
    assert completion.token_ids == expected and completion.finish_reason == "stop"


# --------------------------------------------------------------------------------- the template
def test_stop_tokens_are_the_templates_end_of_turn():
    qwen, oss = _tokenizer("qwen"), _tokenizer("gpt-oss")
    assert generate.stop_token_ids(qwen) == [qwen.convert_tokens_to_ids("<|im_end|>")]
    assert generate.stop_token_ids(oss) == [oss.convert_tokens_to_ids(t) for t in ("<|return|>", "<|call|>")]
    assert oss.convert_tokens_to_ids("<|end|>") not in generate.stop_token_ids(oss)


def test_gpt_oss_reasoning_effort_and_language_reach_the_template():
    tok = _tokenizer("gpt-oss")
    messages = generate.conversation("¿Cuál es el capital de Australia?",
                                     generate.system_prompt(None, "German"))
    assert messages[0] == {"role": "system", "content": "reasoning language: German"}
    text = tok.decode(generate.render_prompt(tok, messages, generate.template_kwargs("high")))
    assert "Reasoning: high\n\n" in text
    assert "<|start|>developer<|message|># Instructions\n\nreasoning language: German\n\n<|end|>" in text
    assert text.endswith("<|start|>user<|message|>¿Cuál es el capital de Australia?<|end|><|start|>assistant")
    assert generate.reply_kind(tok, generate.render_prompt(tok, messages)) == "harmony"


HARMONY = ("<|channel|>analysis<|message|>Die Hauptstadt ist Canberra.<|end|><|start|>assistant"
           "<|channel|>final<|message|>La capital de Australia es Canberra.")


def test_harmony_and_think_replies_split_into_reasoning_and_answer():
    assert generate.split_reasoning(HARMONY, "harmony") == ("Die Hauptstadt ist Canberra.",
                                                            "La capital de Australia es Canberra.")
    assert generate.split_reasoning("<|channel|>final<|message|>Hola", "harmony") == (None, "Hola")
    assert generate.split_reasoning("garbage<|end|>", "harmony", ["<|end|>"]) == (None, "garbage")
    assert generate.split_reasoning("Hmm.\n</think>\n\nCanberra.", "think") == ("Hmm.", "Canberra.")
    assert generate.split_reasoning("Still thinking", "think") == ("Still thinking", "")
    assert generate.split_reasoning("<think>x</think>y", "plain") == ("x", "y")
    assert generate.split_reasoning("Canberra.", "plain") == (None, "Canberra.")
    qwen = _tokenizer("qwen")
    assert generate.reply_kind(qwen, generate.render_prompt(qwen, PROMPTS[0])) == "think"


def test_streamed_view_shows_reasoning_then_answer():
    view = generate.ReplyView(_tokenizer("gpt-oss"), "harmony")
    pieces = [view.feed(HARMONY[i:i + 7]) for i in range(0, len(HARMONY), 7)]
    shown = "".join(pieces) + view.finish(HARMONY)
    assert shown == "reasoning:\nDie Hauptstadt ist Canberra.\n\nanswer:\nLa capital de Australia es Canberra."


# -------------------------------------------------------------------------------------- the CLI
def test_cli_single_prompt_json_equals_greedy(full_run):
    res = runner.invoke(cli.app, ["generate", str(full_run), "-p", "What is 2 plus 4?", "--greedy",
                                  "--max-new-tokens", "8", "--device", "cpu", "--json"])
    assert res.exit_code == 0, res.output
    got = json.loads(res.stdout.strip().splitlines()[-1])
    loaded = _load(full_run / "final")
    prompt = generate.render_prompt(loaded.tokenizer, PROMPTS[0])
    assert got["token_ids"] == argmax_decode(loaded.model, prompt, loaded.stop_ids, 8)
    assert got["finish_reason"] == "length" and got["tokens_per_s"] > 0


def test_cli_single_prompt_streams_and_reports_tokens_per_s(model_dirs):
    res = runner.invoke(cli.app, ["generate", str(model_dirs["gpt-oss"]), "-p", "Hi", "--greedy",
                                  "--max-new-tokens", "6", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    loaded = _load(model_dirs["gpt-oss"])
    (completion,) = generate.generate(loaded, [PROMPTS[2]], Sampling(max_new_tokens=6, greedy=True))
    view = generate.ReplyView(loaded.tokenizer, "harmony").render(completion.raw)
    assert res.stdout == view + "\n"
    assert "6 tokens in " in res.output and " tokens/s" in res.output


def test_cli_input_file_bad_rows_are_counted_and_the_rest_written(model_dirs, tmp_path):
    rows = [
        json.dumps({"prompt": "What is 2 plus 4?"}),
        "{not json",
        json.dumps({"messages": "hi"}),
        "",
        json.dumps({"messages": PROMPTS[2] + [{"role": "assistant", "content": "Hello!"}]}),
        json.dumps([1, 2]),
        json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"},
                                 {"role": "user", "content": "c"}]}),
    ]
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(rows) + "\n")
    res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), "--input", str(src), "-o", str(out),
                                  "--greedy", "--max-new-tokens", "5", "--batch-size", "2"])
    assert res.exit_code == 2
    assert "Traceback" not in res.output
    errors = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert " ".join(" ".join(errors).split()) == (
        f"error: {src}: 4 of 6 rows skipped (line 2: not valid JSON; line 3: messages not a list (got str); "
        "line 6: a list, not an object; line 7: system not first (system message at position 1))")
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["line"] for w in written] == [1, 5]
    assert written[1]["messages"] == PROMPTS[2] and written[1]["reference"] == "Hello!"
    loaded = _load(model_dirs["qwen"])
    expected = generate.generate(loaded, [PROMPTS[0], PROMPTS[2]], Sampling(max_new_tokens=5, greedy=True))
    assert [w["completion"] for w in written] == [c.text for c in expected]
    assert [w["reasoning"] for w in written] == [c.reasoning for c in expected]
    assert [w["new_tokens"] for w in written] == [5, 5]


def _write_run(path, **record):
    path.mkdir()
    (path / "recipe.yaml").write_text("name: tiny-qwen-cpu\n")
    if record:
        write_run_record(path, RunRecord(**record))
    return path


@pytest.mark.parametrize("case,expected", [
    ("empty dir", "{p} holds no model: expected run.json (a run dir), config.json (a model dir) or "
                  "adapter_config.json (a LoRA adapter)"),
    ("no final exported", "{p}: no model in this run (run.json names no model_dir; a full run exports final/ only "
                          "with training.checkpoint.save_final_hf: true)"),
    ("final missing", "{p}: no model in this run ({p}/final does not exist; a full run exports final/ only with "
                      "training.checkpoint.save_final_hf: true)"),
    ("still training", "{p} is a run that has not finished (no run.json yet: it is still training, or it stopped "
                       "early; `ftcli train --recipe {p}/recipe.yaml --resume` continues it)"),
    ("status running", "{p}: the run is 'running', not completed; its final model is written when training ends"),
    ("lora base missing", "base model dir {p}/base (run.json base_model.path) is missing or has no config.json"),
    ("no such path", "{p}: no such run dir or model dir (and not a hub id of the form owner/name)"),
])
def test_cli_bad_model_is_one_line(case, expected, tmp_path):
    p = tmp_path / "run"
    if case == "empty dir":
        p.mkdir()
    elif case == "no final exported":
        _write_run(p, method="full", model_dir=None)
    elif case == "final missing":
        _write_run(p, method="full")
    elif case == "still training":
        _write_run(p)
        (p / "checkpoints" / "step_00000010").mkdir(parents=True)
    elif case == "status running":
        _write_run(p, method="full", status="running")
    elif case == "lora base missing":
        _write_run(p, method="lora", base_model=BaseModelRecord(init="random", path="base"))
        (p / "final").mkdir()
        (p / "final" / "adapter_config.json").write_text("{}")
    for command in (["generate", str(p), "-p", "hi"], ["chat", str(p)]):
        res = runner.invoke(cli.app, command)
        assert res.exit_code == 2
        assert " ".join(res.output.split()) == "error: " + expected.format(p=p)


def test_cli_bad_model_fails_before_heavy_imports(tmp_path):
    code = ("import sys\n"
            f"sys.argv = ['ftcli', 'generate', {str(tmp_path)!r}, '-p', 'hi']\n"
            "from ftcli.cli import run\n"
            "try:\n    run()\nexcept SystemExit as e:\n    code = e.code\n"
            "print('RESULT', code, [m for m in ('torch', 'transformers') if m in sys.modules])\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "RESULT 2 []", proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr


def test_hub_id_resolves_with_its_revision_and_fails_offline_in_one_line(tmp_path):
    source = model_source("openai/gpt-oss-20b", "abc123")
    assert source == generate.ModelSource(model="openai/gpt-oss-20b", revision="abc123")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "ftcli", "generate", "no-such-org/no-such-model", "-p", "hi"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0] == ("error: no connection to the Hub (HF_HUB_OFFLINE is set) and model 'no-such-org/no-such-model' "
                                          "is not in the local HF cache; point model.id/tokenizer/data.path at a local "
                                          "copy or UC volume")


def test_reasoning_effort_the_template_refuses_is_one_line(model_dirs):
    res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), "-p", "hi", "--reasoning-effort", "high",
                                  "--device", "cpu"])
    assert res.exit_code == 2
    assert " ".join(res.output.split()).endswith(  # the template's own values, before anything is rendered
        f"error: --reasoning-effort high: the chat template of {model_dirs['qwen']} knows xhigh | medium | low")


@pytest.mark.parametrize("args,expected", [
    ([], "pass either --prompt TEXT or --input FILE.jsonl"),
    (["-p", "hi", "-o", "x.jsonl"], "--output goes with --input FILE.jsonl"),
    (["--input", "missing.jsonl"], "--input missing.jsonl: no such file"),
])
def test_cli_bad_options_are_one_line(args, expected, model_dirs):
    res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), *args])
    assert res.exit_code == 2 and " ".join(res.output.split()) == "error: " + expected


# ------------------------------------------------------------------------------------------ chat
def test_chat_keeps_history_and_handles_commands():
    sent = []

    def fake_reply(loaded, messages, sampling, *, write, template_kwargs):
        if messages[-1]["content"] == "interrupt me":
            raise KeyboardInterrupt  # Ctrl-C while the reply streams
        sent.append([dict(m) for m in messages])
        write(f"reply{len(sent)}")
        return generate.Completion(text=f"reply{len(sent)}", reasoning=None, raw=""), generate.StreamStats(3, 1.0, None)

    loaded = generate.LoadedModel(model=None, tokenizer=None, stop_ids=[], source=generate.ModelSource(model="m"))
    lines = ["hello", "interrupt me", "/system Be brief.", "again", "/reset", "fresh", "/bogus", "/system", "last",
             "/exit", "never"]
    stdin = io.StringIO("".join(line + "\n" for line in lines))
    out = []
    run_chat(loaded, Sampling(), system=None, template_kwargs={}, stdin=stdin, write=out.append, reply=fake_reply)
    sys_msg = {"role": "system", "content": "Be brief."}
    assert sent == [
        [{"role": "user", "content": "hello"}],
        [sys_msg, {"role": "user", "content": "hello"}, {"role": "assistant", "content": "reply1"},
         {"role": "user", "content": "again"}],
        [sys_msg, {"role": "user", "content": "fresh"}],
        [{"role": "user", "content": "fresh"}, {"role": "assistant", "content": "reply3"},
         {"role": "user", "content": "last"}],
    ]
    text = "".join(out)
    assert "system prompt set: Be brief." in text and "conversation reset" in text and "system prompt cleared" in text
    assert "unknown command /bogus" in text and "[interrupted]" in text and "3 tokens in 1.00 s (3.0 tokens/s)" in text
    assert Chat("x").command("/quit") is None


def test_chat_cli_streams_replies_with_history(model_dirs):
    res = runner.invoke(cli.app, ["chat", str(model_dirs["gpt-oss"]), "--greedy", "--max-new-tokens", "4",
                                  "--device", "cpu", "--reasoning-effort", "low"],
                        input=b"\xff\xfe\nWhat is 2 plus 4?\nHi\n/exit\n")  # a first line that is not UTF-8
    assert res.exit_code == 0, res.output
    assert "[skipped: this line is not UTF-8 text (byte 0xFF at character 1)]\n" in res.stdout
    banner = res.stdout.splitlines()[:2]  # who, then the commands: each line whole at 80 columns
    assert banner[0].startswith("chatting with ") and banner[1] == (
        "/system TEXT sets the system prompt, /reset forgets the chat, /exit leaves") and len(banner[1]) <= 80
    loaded = _load(model_dirs["gpt-oss"])
    greedy = Sampling(max_new_tokens=4, greedy=True)
    kwargs = generate.template_kwargs("low")
    (first,) = generate.generate(loaded, [PROMPTS[0]], greedy, template_kwargs=kwargs)
    history = PROMPTS[0] + [{"role": "assistant", "content": first.text}, {"role": "user", "content": "Hi"}]
    (second,) = generate.generate(loaded, [history], greedy, template_kwargs=kwargs)
    for completion in (first, second):
        view = generate.ReplyView(loaded.tokenizer, "harmony").render(completion.raw)
        assert f"assistant> {view}\n[4 tokens in " in res.stdout


def _recording_reply(sent):
    def reply(loaded, messages, sampling, *, write, template_kwargs):
        sent.append([dict(m) for m in messages])
        return generate.Completion(text="ok", reasoning=None, raw=""), generate.StreamStats(1, 1.0, None)
    return reply


def test_chat_skips_lines_that_are_not_utf8_text():
    """Bytes that are not UTF-8 (read as lone surrogates, as `ftcli chat` reads stdin) and a lone
    surrogate are one skipped line each; the conversation goes on."""
    loaded = generate.LoadedModel(model=None, tokenizer=None, stop_ids=[], source=generate.ModelSource(model="m"))
    raw = b"\xff\xfehi\n" + "\ud800 x".encode("utf-8", "surrogatepass") + b"\nhello\n"
    stdin = io.TextIOWrapper(io.BytesIO(raw), encoding="utf-8", errors="surrogateescape")
    sent, out = [], []
    run_chat(loaded, Sampling(), system=None, template_kwargs={}, stdin=stdin, write=out.append,
             reply=_recording_reply(sent))
    assert sent == [[{"role": "user", "content": "hello"}]]
    skipped = [line for line in "".join(out).splitlines() if line.startswith("[skipped")]
    assert skipped == ["[skipped: this line is not UTF-8 text (byte 0xFF at character 1)]",
                       "[skipped: this line is not UTF-8 text (byte 0xED at character 1)]"]
    out.clear()
    run_chat(loaded, Sampling(), system=None, template_kwargs={}, stdin=io.StringIO("a\ud800\n"), write=out.append,
             reply=_recording_reply(sent))
    assert "[skipped: this line is not UTF-8 text (a lone surrogate U+D800 at character 2)]\n" in out
    strict = io.TextIOWrapper(io.BytesIO(b"\xff\n"), encoding="utf-8")
    with pytest.raises(UserError, match=r"^the input is not UTF-8 text \(invalid start byte at byte 0\); chat reads UTF-8$"):
        run_chat(loaded, Sampling(), system=None, template_kwargs={}, stdin=strict, write=out.append,
                 reply=_recording_reply(sent))


class _CountingTokenizer:
    """The real tokenizer, recording how many characters each call tokenizes."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars, self.renders = tokenizer, [], 0

    def __call__(self, text, **kwargs):
        self.chars.append(len(text))
        return self.tokenizer(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.renders += 1
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_chat_refuses_a_prompt_longer_than_the_context_before_tokenizing_it_whole():
    from types import SimpleNamespace

    from ftcli.inference.prompt_checks import CHUNK_CHARS

    tokenizer = _CountingTokenizer(_tokenizer("qwen"))
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=64))
    loaded = generate.LoadedModel(model=model, tokenizer=tokenizer, stop_ids=[], source=generate.ModelSource(model="m"))
    huge = "word " * 200_000  # 1M characters on one line
    def rendered_len(text):
        return len(generate.render_prompt(tokenizer.tokenizer, [{"role": "user", "content": text}]))

    medium = next(" ".join(["seven"] * n) for n in range(1, 64) if rendered_len(" ".join(["seven"] * n)) >= 64)
    rendered = rendered_len(medium)  # over 64 tokens with the template, under it without
    assert rendered >= 64 > len(tokenizer.tokenizer(medium, add_special_tokens=False)["input_ids"])
    sent, out = [], []
    stdin = io.StringIO(huge + "\n" + medium + "\nhi\n")
    run_chat(loaded, Sampling(), system=None, template_kwargs={}, stdin=stdin, write=out.append,
             reply=_recording_reply(sent))
    assert sent == [[{"role": "user", "content": "hi"}]]
    assert sum(tokenizer.chars[:1]) == CHUNK_CHARS and max(tokenizer.chars) <= CHUNK_CHARS
    assert tokenizer.renders == 2  # the medium line and "hi": the huge one is never rendered
    first = len(tokenizer.tokenizer(huge[:CHUNK_CHARS], add_special_tokens=False)["input_ids"])
    skipped = [line for line in "".join(out).splitlines() if line.startswith("[skipped")]
    assert skipped == [
        f"[skipped: the prompt is longer than the model's context of 64 tokens (max_position_embeddings): {first:,} "
        f"tokens in its first {CHUNK_CHARS:,} of 999,999 characters; shorten it]",
        f"[skipped: the prompt is {rendered} tokens with its chat template, the model's context is 64 "
        "(max_position_embeddings); shorten it]"]


def test_generate_prompt_over_the_context_or_not_text_is_one_line(model_dirs):
    from ftcli.inference.prompt_checks import CHUNK_CHARS, count_tokens

    huge = "word " * 200_000
    res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), "-p", huge, "--device", "cpu"])
    tokens, read = count_tokens(_tokenizer("qwen"), [{"content": huge}], 4096)
    assert read < len(huge) and read % CHUNK_CHARS == 0 and "Traceback" not in res.output
    assert res.exit_code == 2 and [line for line in res.output.splitlines() if line.startswith("error:")] == [
        f"error: the prompt is longer than the model's context of 4,096 tokens (max_position_embeddings): {tokens:,} "
        f"tokens in its first {read:,} of 1,000,000 characters; shorten it"]
    with pytest.raises(UserError, match=r"^--prompt is not UTF-8 text \(byte 0xFF at character 3\)$"):
        generate_cmd.run_generate(str(model_dirs["qwen"]), prompt="hi\udcff", system=None, input_path=None, output=None,
                              force=False, sampling=Sampling(), reasoning_effort=None, reasoning_language=None,
                              dtype="auto", device="cpu", revision=None, batch_size=1, as_json=False)


def test_generate_output_must_be_a_file_in_an_existing_folder(model_dirs, tmp_path):
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n")
    (tmp_path / "a-file").write_text("x")
    cases = [
        (tmp_path / "missing" / "out.jsonl", f"cannot write {tmp_path}/missing/out.jsonl: {tmp_path}/missing does not "
                                              f"exist; create it first (mkdir -p {tmp_path}/missing)"),
        (tmp_path, f"{tmp_path} is a folder; give a file path, e.g. {tmp_path}/completions.jsonl"),
        (tmp_path / "a-file" / "out.jsonl", f"cannot write {tmp_path}/a-file/out.jsonl: {tmp_path}/a-file is not a "
                                            "folder"),
    ]
    for out, expected in cases:
        for force in ([], ["--force"]):
            res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), "--input", str(src), "-o", str(out),
                                          *force])
            assert res.exit_code == 2 and " ".join(res.output.split()) == "error: " + expected


def test_generate_output_through_a_symlink_is_refused_and_force_replaces_the_link(model_dirs, tmp_path):
    """Dangling or not, a link at --output is a file ftcli did not write: refused; --force replaces the
    link with the output and leaves its target alone. Rows that are not UTF-8 text are counted skips."""
    src = tmp_path / "prompts.jsonl"
    src.write_text(json.dumps({"prompt": "hi"}) + "\n" + json.dumps({"prompt": "a\ud800"}) + "\n"
                   + json.dumps({"messages": [{"role": "user", "content": "\udcff"}]}) + "\n")
    dangling, linked, target = tmp_path / "dangling.jsonl", tmp_path / "linked.jsonl", tmp_path / "target.txt"
    dangling.symlink_to(tmp_path / "nowhere.txt")
    target.write_text("keep me")
    linked.symlink_to(target)
    for out, to in ((dangling, tmp_path / "nowhere.txt"), (linked, target)):
        res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), "--input", str(src), "-o", str(out)])
        assert res.exit_code == 2 and " ".join(res.output.split()) == (
            f"error: {out} is a symbolic link (to {to}); pass --force to replace the link (its target is left alone)")
    assert not (tmp_path / "nowhere.txt").exists() and target.read_text() == "keep me"
    for out in (dangling, linked):
        res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), "--input", str(src), "-o", str(out),
                                      "--force", "--greedy", "--max-new-tokens", "2"])
        assert res.exit_code == 2 and "Traceback" not in res.output
        errors = [line for line in res.output.splitlines() if line.startswith("error:")]
        assert " ".join(" ".join(errors).split()) == (
            f"error: {src}: 2 of 3 rows skipped (line 2: 'prompt' or 'system' is not UTF-8 text (a lone surrogate "
            "U+D800 at character 2); line 3: message 0 is not UTF-8 text (byte 0xFF at character 1))")
        assert not out.is_symlink() and [json.loads(x)["line"] for x in out.read_text().splitlines()] == [1]
    assert not (tmp_path / "nowhere.txt").exists() and target.read_text() == "keep me"


# ------------------------------------------------------------------------------------------ FSDP2
def test_sample_greedy_under_fsdp2_equals_unsharded(model_dirs, tmp_path):
    """The way trainers sample: every rank calls sample_greedy on its FSDP2-sharded model with
    synced_gpus=True. Same prompts on both ranks give the unsharded replies; uneven work (rank 0 done
    after 3 tokens, rank 1 after 8) does not hang and each rank still gets the unsharded replies."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           "tests/support/_generate_fsdp_worker.py", str(model_dirs["qwen"]), str(tmp_path)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    loaded = _load(model_dirs["qwen"])
    conversations = [PROMPTS[0], PROMPTS[2]]
    expected = generate.sample_greedy(loaded.model, loaded.tokenizer, conversations, max_new_tokens=6)
    assert ranks[0]["same"] == ranks[1]["same"] == expected
    for r in range(2):
        alone = generate.sample_greedy(loaded.model, loaded.tokenizer, [conversations[r]], max_new_tokens=3 + 5 * r)
        assert ranks[r]["uneven"] == alone and ranks[r]["training"] is True


def test_cpu_kernel_fallback_advice_is_one_ftcli_line(model_dirs, capsys):
    """On CPU, transformers' "install causal_conv1d / flash-linear-attention" records are dropped (GPU-only
    packages, never installed on a CPU machine) and ftcli says one line instead, only for a model using them."""
    import logging

    from ftcli.model.fallbacks import FALLBACK_LOGGER

    capsys.readouterr()
    generate.load(model_source(str(model_dirs["qwen"])), device="cpu")
    err = capsys.readouterr().err
    assert err.count("CPU: the fast kernels (flash-linear-attention, causal-conv1d) are GPU-only") == 1
    generate.load(model_source(str(model_dirs["gpt-oss"])), device="cpu")
    assert "GPU-only" not in capsys.readouterr().err  # gpt-oss has no such kernel
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger(FALLBACK_LOGGER)
    logger.addHandler(handler)
    try:
        logger.warning("`causal_conv1d_fn` is falling back to its reference PyTorch implementation because "
                       "`causal_conv1d` is not installed. This is correct but much slower; install `causal_conv1d`")
        logger.warning("another warning")
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == ["another warning"]


def test_reasoning_effort_is_checked_against_the_template(model_dirs):
    assert generate.reasoning_efforts(_tokenizer("gpt-oss")) == ("low", "medium", "high")  # harmony's values
    assert generate.reasoning_efforts(_tokenizer("qwen")) == ("xhigh", "medium", "low")  # what the template checks
    for command in (["chat", str(model_dirs["gpt-oss"])], ["generate", str(model_dirs["gpt-oss"]), "-p", "hi"]):
        res = runner.invoke(cli.app, [*command, "--reasoning-effort", "extreme"], input="")
        assert res.exit_code == 2, res.output
        assert " ".join(res.output.split()).endswith(
            f"error: --reasoning-effort extreme: the chat template of {model_dirs['gpt-oss']} knows low | medium | high")
    generate.check_reasoning_effort(_tokenizer("gpt-oss"), "high", "x")  # accepted
    generate.check_reasoning_effort(_tokenizer("gpt-oss"), None, "x")


def test_empty_think_block_shows_no_reasoning_section_and_samples_start_with_the_answer():
    raw = "\n</think>\n\nThe capital is Nairobi."
    view = generate.ReplyView(_tokenizer("qwen"), "think")
    shown = "".join(view.feed(t) for t in ["\n", "</think>", "\n\n", "The capital", " is Nairobi."]) + view.finish(raw)
    assert shown == "The capital is Nairobi."
    thought = "let me see\n</think>\n\nNairobi."
    assert generate.ReplyView(_tokenizer("qwen"), "think").render(thought) == "reasoning:\nlet me see\n\nanswer:\nNairobi."
    assert generate.without_empty_think(raw) == "The capital is Nairobi."
    assert generate.without_empty_think("<think>\n\n</think>\n\n13") == "13"
    assert generate.without_empty_think(thought) == thought  # a real think block stays


CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]


@pytest.mark.parametrize("name", ["qwen", "gpt-oss"])
def test_tool_calls_the_template_writes_parse_back_to_the_call(name):
    """The template's own rendering of an assistant tool call, as the model would generate it, parses back to
    that call (OpenAI shape: arguments a JSON string, or an object where the conversation's calls have one)."""
    from ftcli.inference.tool_calls import openai_tool_calls, parse_tool_calls

    tok = _tokenizer(name)
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}]
    prompt = tok.apply_chat_template(ASK, tools=tools, tokenize=False, add_generation_prompt=True)
    full = tok.apply_chat_template(ASK + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], tools=tools,
                                   tokenize=False)
    generated = full[len(prompt):] if full.startswith(prompt) else full[full.rindex("<|start|>assistant") + 18:]
    calls, rest = parse_tool_calls(generated)
    assert calls == [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}]
    assert "get_weather" not in rest and "Paris" not in rest
    assert openai_tool_calls(calls) == [{"id": "call_0", "type": "function", "function": {
        "name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}}]
    history = [{"role": "assistant", "tool_calls": [CALL]}]
    assert openai_tool_calls(calls, history)[0]["function"]["arguments"] == {"city": "Paris", "days": 3}


def test_generate_input_rows_carry_parsed_tool_calls():
    from ftcli.inference.tool_calls import parse_tool_calls

    tok = _tokenizer("qwen")
    raw = ("\n</think>\n\nLet me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
           "</function>\n</tool_call>")
    completion = generate.Completion(text="ignored", reasoning=None, raw=raw)
    assert generate.reply_fields(tok, ASK, completion) == {
        "completion": "Let me check.", "reasoning": None,
        "tool_calls": [{"id": "call_0", "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    hermes = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert parse_tool_calls(hermes) == ([{"name": "get_weather", "arguments": {"city": "Paris"}}], "")
    plain = generate.Completion(text="Hi.", reasoning=None, raw="\n</think>\n\nHi.")
    assert generate.reply_fields(tok, ASK, plain) == {"completion": "Hi.", "reasoning": None}


def test_generate_input_reads_every_row_train_reads(model_dirs, tmp_path):
    """OpenAI wire-format tool calls (arguments a JSON string), ShareGPT, Alpaca and prompt/completion rows:
    generate reads each as training does (ftcli.data.formats.row_messages), and a call whose arguments are not
    JSON is one reason naming the row and the field, never a traceback."""
    wire = {**CALL, "function": {**CALL["function"], "arguments": '{"city": "Paris", "days": 3}'}}
    tool_turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": [wire]},
                  {"role": "tool", "content": "21 C"}]
    broken = {**CALL, "function": {**CALL["function"], "arguments": "{city: Paris"}}
    rows = [
        {"messages": tool_turns},
        {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello!"}]},
        {"instruction": "Name the capital.", "input": "Kenya", "output": "Nairobi."},
        {"prompt": "What is 2 plus 4?", "completion": "6"},
        {"messages": [*ASK, {"role": "assistant", "content": "", "tool_calls": [broken]}, {"role": "tool", "content": "x"}]},
    ]
    src, out = tmp_path / "prompts.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = runner.invoke(cli.app, ["generate", str(model_dirs["qwen"]), "--input", str(src), "-o", str(out),
                                  "--greedy", "--max-new-tokens", "3"])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert " ".join(res.output.split()).endswith(
        f"error: {src}: 1 of 5 rows skipped (line 5: invalid tool call (message 1 tool_calls[0].function.arguments "
        "is a string that is not JSON))")
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["line"] for w in written] == [1, 2, 3, 4]
    assert written[0]["messages"] == tool_turns  # the row as its file wrote it
    assert [w.get("reference") for w in written] == [None, "Hello!", "Nairobi.", "6"]
    parsed = [*ASK, {"role": "assistant", "content": "", "tool_calls": [CALL]}, {"role": "tool", "content": "21 C"}]
    expected = generate.generate(_load(model_dirs["qwen"]), [
        parsed, [{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Name the capital.\nKenya"}],
        [{"role": "user", "content": "What is 2 plus 4?"}]], Sampling(max_new_tokens=3, greedy=True))
    assert [w["completion"] for w in written] == [c.text for c in expected]


def test_gpu_kernel_caches_persist_under_ftcli_cache_unless_the_user_set_them(tmp_path, monkeypatch):
    """A GPU process keeps its compiled kernels and autotune results in <ftcli cache>/kernels (FTCLI_CACHE),
    where the next process finds them; a cache dir the user set is left as it is."""
    from ftcli.model.kernels.cache import compile_notice, persistent_caches

    monkeypatch.setenv("FTCLI_CACHE", str(tmp_path / "c"))
    env = {"TRITON_CACHE_DIR": "/mine/triton"}
    root, warm = persistent_caches(env)
    assert (root, warm) == (tmp_path / "c" / "kernels", False)
    assert env == {"TRITON_CACHE_DIR": "/mine/triton", "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
                   "TILELANG_CACHE_DIR": str(root / "tilelang"), "FLA_CACHE_RESULTS": "1"}
    assert "compiles and autotunes" in compile_notice(root, warm) and "paid once" in compile_notice(root, warm)
    (root / "inductor").mkdir(parents=True)
    (root / "inductor" / "kernel.so").write_bytes(b"x")
    assert persistent_caches({})[1] is True
    assert compile_notice(root, True).startswith(f"GPU kernels: reusing the compiled kernels and autotune results in {root}")


def test_each_chat_format_parses_its_own_tool_calls():
    """A reply's tool calls are parsed by its template's chat format only (ChatML's text in a harmony reply stays
    text); without a known format, by every format's parsers."""
    from ftcli.chat_formats import CHAT_FORMATS
    from ftcli.inference.tool_calls import parse_tool_calls

    hermes = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    harmony = ' to=functions.f<|channel|>commentary json<|message|>{"a": 1}<|call|>'
    call = [{"name": "f", "arguments": {"a": 1}}]
    assert parse_tool_calls(hermes, CHAT_FORMATS["chatml"]) == (call, "")
    assert parse_tool_calls(hermes, CHAT_FORMATS["harmony"]) == ([], hermes)
    assert parse_tool_calls(harmony, CHAT_FORMATS["harmony"]) == (call, "<|call|>")
    assert parse_tool_calls(harmony, CHAT_FORMATS["chatml"]) == ([], harmony)
    assert parse_tool_calls(hermes + harmony) == (call + call, "<|call|>")
    completion = generate.Completion(text=hermes, reasoning=None, raw="<|channel|>final<|message|>" + hermes)
    assert generate.reply_fields(_tokenizer("gpt-oss"), ASK, completion) == {"completion": hermes, "reasoning": None}


def test_input_that_is_a_device_or_holds_line_separators_in_strings(tmp_path):
    """#47 item 11: `--input /dev/zero` read until MemoryError; a row holding U+2028 or NEL inside a JSON string
    was cut there (str.splitlines) and counted as two bad rows."""
    with pytest.raises(UserError) as err:
        generate_cmd.read_prompt_file("/dev/zero")
    assert str(err.value) == ("--input /dev/zero: not a regular file (a device or a pipe); write the rows to a .jsonl "
                              "file")
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\r\n" +
                    json.dumps({"prompt": "second"}) + "\n", encoding="utf-8")
    rows, bad = generate_cmd.read_prompt_file(path)
    assert bad == [] and [r.messages[-1]["content"] for r in rows] == ["a\u2028b\x85c", "second"]
