"""The command line: parse, load the recipe, dispatch. No work happens here.

Each subcommand's work lives in one module, imported only when that command runs, so
`ftcli --help` and `ftcli render-workload` never import torch:

    recipes          ftcli.config.recipe       (schema, built-ins, overrides)
    render-workload  ftcli.commands.workload     (ftcli.launchers: AI Runtime YAML, sbatch script)
    pack-preview     ftcli.commands.preview      (over ftcli.data: tokenize, mask, pack)
    train            ftcli.train.launch       (torchrun) -> ftcli.train.full (FSDP2) | ftcli.train.lora.trainer (TRL)
    merge-lora       ftcli.commands.merge
    register         ftcli.commands.register
    plan             ftcli.commands.plan         (over ftcli.estimate: shape, memory, fit, step time, data size)
    doctor           ftcli.commands.doctor       (over ftcli.model.kernels)
    generate, chat   ftcli.commands.generate     (+ ftcli.commands.chat: the interactive loop)
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from typer.core import TyperGroup

from rich.markup import escape

from ftcli import __version__
from ftcli.config.errors import UserError
from ftcli.config.safe_files import check_output_path, write_output

_UsageError = typer.BadParameter.__mro__[1]  # typer's vendored click UsageError, reached through its public subclass


class _Group(TyperGroup):
    """Turns a `UserError` raised anywhere below into one red line and exit code 2, and shows flags as flags
    in every command's help (`_flags_as_flags`)."""

    def parse_args(self, ctx, args):
        if not args and self.no_args_is_help and not ctx.resilient_parsing:  # `ftcli recipes`: help, exit 0
            typer.echo(ctx.get_help(), nl=False)
            ctx.exit(0)
        return super().parse_args(ctx, args)

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as e:
            _fail(str(e))
        except _UsageError as e:
            extra = re.fullmatch(r"Got unexpected extra argument(?:s|\(s\))? \((.*)\)", e.message)
            if extra and extra[1].lower() in ("true", "false", "yes", "no", "1", "0"):  # `--force true`
                e.message += (f"; a flag such as --force takes no value: write the flag alone to turn it on, "
                              f"leave it out for off")
            raise

    def get_command(self, ctx, cmd_name):
        command = super().get_command(ctx, cmd_name)
        if command is not None:
            _flags_as_flags(command.get_params(ctx))
        return command

    def get_params(self, ctx):
        return _flags_as_flags(super().get_params(ctx))


def _flags_as_flags(params: list) -> list:
    """Typer's help prints each option's type, `--force <bool>` for a flag that takes no value (and refuses
    `--force true`): an empty metavar, Typer's own knob for that column, shows it as `--force`."""
    for param in params:
        if getattr(param, "is_flag", False) and param.metavar is None:
            param.metavar = ""
    return params


app = typer.Typer(
    cls=_Group,
    name="ftcli",
    help="Fine-tune LLMs from named recipes: pack, train (FSDP2 or LoRA), merge, register.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
recipes_app = typer.Typer(cls=_Group, help="List, show and copy built-in recipes.", no_args_is_help=True)
app.add_typer(recipes_app, name="recipes")
console = Console()
err_console = Console(stderr=True)

# `--help` of each command ends with these (one command a line; tests/unit/test_cli.py runs the cheap ones).
EXAMPLES = {
    "recipes list": ["ftcli recipes list"],
    "recipes show": ["ftcli recipes show tiny-qwen-cpu --set training.optimizer.lr=2e-5"],
    "recipes cp": ["ftcli recipes cp tiny-qwen-cpu my.yaml"],
    "render-workload": ["ftcli render-workload --recipe qwen-b300 -o workload.yaml",
                        "ftcli render-workload --check workload.yaml"],
    "pack-preview": ["ftcli pack-preview --recipe tiny-qwen-cpu --blocks 2",
                     "ftcli pack-preview --recipe my.yaml --set data.path=chats.jsonl --set data.format=auto"],
    "train": ["ftcli train --recipe tiny-qwen-cpu",
              "ftcli train --recipe my.yaml --set data.path=chats.jsonl --set data.format=auto",
              "ftcli train --recipe tiny-qwen-cpu --resume"],
    "merge-lora": ["ftcli merge-lora runs/tiny-gpt-oss-cpu -o runs/tiny-gpt-oss-merged"],
    "register": ["ftcli register runs/tiny-qwen-cpu --name tiny-qwen --alias champion"],
    "plan": ["ftcli plan --recipe qwen-b300", "ftcli plan --recipe gpt-oss-h100 --accelerator GPU_8xH200"],
    "doctor": ["ftcli doctor", "ftcli doctor --recipe qwen-b300"],
    "generate": ['ftcli generate runs/tiny-qwen-cpu -p "What is 2 plus 4?" --greedy',
                 "ftcli generate runs/tiny-qwen-cpu --input prompts.jsonl --output completions.jsonl"],
    "chat": ["ftcli chat runs/tiny-qwen-cpu"],
}


def _examples(command: str) -> str:
    """The `--help` epilog of `command`: its EXAMPLES, one a line (typer keeps the lines of an epilog
    given as separate paragraphs)."""
    return "Examples:\n\n" + "\n\n".join(f"  {line}" for line in EXAMPLES[command])


RecipeOpt = typer.Option(..., "--recipe", "-r", help="Built-in recipe name or path to a recipe YAML.")
OptionalRecipeOpt = typer.Option(None, "--recipe", "-r", help="Built-in recipe name or path to a recipe YAML.")
SetOpt = typer.Option(None, "--set", "-s", help="Override a recipe value: dotted.key=value (repeatable), e.g. "
                      "data.path=chats.jsonl.")
ForceOpt = typer.Option(False, "--force", help="Overwrite existing output (a link there is replaced, not followed).")


def _fail(message: str) -> None:
    """Print `error: <message>` and exit 2. The message is one line; a list of problems (several recipe
    keys at once) follows it as indented `  - ` lines."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _load(recipe: str | None, overrides: list[str] | None):
    from ftcli.features import load_recipe

    if recipe is None:
        if overrides:
            _fail("--set needs --recipe")
        return None
    return load_recipe(recipe, overrides or [])


def _version(value: bool) -> None:
    if value:
        console.print(f"ftcli {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Show the version."),
) -> None:
    """ftcli: fine-tune LLMs from named recipes, all the way to a registered model."""


# ------------------------------------------------------------------------------------------ recipes
@recipes_app.command("list", epilog=_examples("recipes list"))
def recipes_list() -> None:
    """List the built-in recipes."""
    from rich import box
    from rich.table import Table

    from ftcli.config.recipe import builtin_recipe_names
    from ftcli.features import load_recipe

    # one line per recipe at 80 columns: the description is `recipes show NAME`'s first line
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, show_edge=False, collapse_padding=True)
    table.add_column("name", no_wrap=True)
    table.add_column("method", no_wrap=True)
    table.add_column("compute", no_wrap=True)
    table.add_column("model", overflow="fold")  # fold, never cut (tests/e2e/test_cli_real_process.py)
    for name in builtin_recipe_names():
        r = load_recipe(name)
        model = r.model.id or f"tiny {r.model.model_type} (random)"
        card = r.compute.accelerator_type.removeprefix("GPU_")
        if r.model.init == "random":
            compute = f"CPU ({r.training.cpu_processes} proc)"
        else:
            compute = card if r.compute.num_nodes == 1 else f"{r.compute.num_nodes} x {card}"
        table.add_row(name, r.training.method, compute, model)
    console.print(table)
    console.print("ftcli recipes show NAME: what a recipe is for and every value it sets", highlight=False)


@recipes_app.command("show", epilog=_examples("recipes show"))
def recipes_show(
    name: str = typer.Argument(..., help="Built-in recipe name or path.", metavar="RECIPE"),
    overrides: Optional[list[str]] = SetOpt,
) -> None:
    """Print a recipe, fully resolved (every default shown), as YAML."""
    from ftcli.config.recipe import dump_recipe

    print(dump_recipe(_load(name, overrides)), end="")


@recipes_app.command("cp", epilog=_examples("recipes cp"))
def recipes_cp(
    name: str = typer.Argument(..., help="Built-in recipe or recipe file to start from.", metavar="RECIPE"),
    dest: Path = typer.Argument(..., help="Where to write the new recipe YAML (its folder must exist).",
                                metavar="DEST"),
    force: bool = ForceOpt,
) -> None:
    """Copy a built-in recipe (or a recipe file) to DEST to start a custom one."""
    from ftcli.config.recipe import recipe_text, renamed

    if dest.is_dir():
        dest = dest / f"{Path(name).stem}.yaml"
    text, old = renamed(recipe_text(name), dest.stem)
    check_output_path(dest, force)
    write_output(dest, text)  # a link at DEST (--force) is replaced, never written through
    named = f" (name: {dest.stem}, was {old}: it trains into runs/{dest.stem})" if old and old != dest.stem else ""
    console.print(f"wrote {dest}{named}; edit it, then: ftcli train --recipe {dest}", soft_wrap=True)


# ---------------------------------------------------------------------------------- render-workload
@app.command("render-workload", epilog=_examples("render-workload"))
def render_workload(
    recipe: Optional[str] = OptionalRecipeOpt,
    overrides: Optional[list[str]] = SetOpt,
    launcher: Optional[str] = typer.Option(
        None, "--launcher", "-l", help="databricks (AI Runtime YAML) or slurm (sbatch script); default: the "
                                       "recipe's compute.launcher."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the file here (default: stdout); its folder must exist."),
    check: Optional[Path] = typer.Option(None, "--check", help="Validate an existing workload YAML or sbatch script instead."),
    no_fit_check: bool = typer.Option(False, "--no-fit-check", help="Render even when the plan says it does not fit."),
    force: bool = ForceOpt,
) -> None:
    """Render the file a cluster runs for a recipe: a Databricks AI Runtime workload YAML (`databricks air run -f`)
    or a Slurm sbatch script (`sbatch`)."""
    from ftcli.commands import workload

    if check is not None:
        what, problems = workload.check_file(check)
        if len(problems) == 1:
            _fail(f"{check}: {problems[0]}")
        if problems:
            _fail(f"{check}: {len(problems)} problems\n" + "\n".join(f"  - {p}" for p in problems))
        console.print(f"{check}: valid {what}", soft_wrap=True, highlight=False)  # a path is never cut
        return
    if launcher is not None:
        overrides = [*(overrides or []), f"compute.launcher={launcher}"]
    r = _load(recipe, overrides)
    if r is None:
        _fail("render-workload needs --recipe (or --check FILE)")
    if output is not None:
        check_output_path(output, force)
    rendered = workload.render(r, fit_check=not no_fit_check)
    if output is None:
        print(rendered.text, end="")
    else:
        write_output(output, rendered.text)
    for warning in rendered.warnings:  # after the file: the last lines on screen
        err_console.print(f"[yellow]warning:[/] {escape(warning)}", highlight=False, soft_wrap=True)
    if output is not None:
        # the command on a line of its own, to copy whole (a path does not break inside a sentence)
        err_console.print(f"wrote {output}; submit with:\n  {rendered.submit.format(path=output)}", highlight=False,
                          soft_wrap=True)


# ------------------------------------------------------------------------------------- pack-preview
@app.command("pack-preview", epilog=_examples("pack-preview"))
def pack_preview(
    recipe: str = RecipeOpt,
    overrides: Optional[list[str]] = SetOpt,
    blocks: int = typer.Option(2, "--blocks", min=0, help="Blocks to show in detail."),
    examples: Optional[int] = typer.Option(None, "--examples", min=1, help="Read at most this many examples."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON."),
    dump: Optional[Path] = typer.Option(None, "--dump", help="Write the exact blocks as JSON lines (the folder must exist)."),
    strict: bool = typer.Option(False, "--strict", help="Stop at the first bad row."),
    force: bool = ForceOpt,
) -> None:
    """Show how the recipe's data is tokenized, masked and packed: the blocks `train` consumes."""
    r = _load(recipe, overrides)
    from ftcli.commands.preview import run_preview

    if dump is not None:
        check_output_path(dump, force, "blocks.jsonl")
    run_preview(r, blocks=blocks, examples=examples, as_json=as_json, dump=dump, strict=strict)


# -------------------------------------------------------------------------------------------- train
@app.command("train", epilog=_examples("train"))
def train(
    recipe: str = RecipeOpt,
    overrides: Optional[list[str]] = SetOpt,
    resume: Optional[str] = typer.Option(
        None, "--resume", help="Resume from the latest checkpoint of the run dir, or from DIR.", metavar="[DIR]"
    ),
    force: bool = typer.Option(False, "--force", help="Start over in an ftcli run dir: delete its checkpoints, final "
                               "model and metrics (never files ftcli did not write)."),
) -> None:
    """Train: full-parameter SFT (FSDP2) or LoRA (TRL + PEFT), under torchrun.

    Your own data: --set data.path=FILE_OR_FOLDER --set data.format=auto (or messages, sharegpt, alpaca,
    prompt_completion, text); `ftcli pack-preview` with the same --set shows what trains. No eval:
    --set eval.enabled=false.

    SIGTERM / Ctrl-C: every rank stops at the next step with a checkpoint; exit 143 (SIGTERM) or 130 (SIGINT).

    A full-path checkpoint resumes on any number of processes (same ranks x grad_accum: same blocks per step)."""
    r = _load(recipe, overrides)
    from ftcli.train.launch import run_train

    run_train(r, resume=resume, force=force)


# ---------------------------------------------------------------------------------------- merge-lora
@app.command("merge-lora", epilog=_examples("merge-lora"))
def merge_lora(
    adapter_dir: Path = typer.Argument(..., help="A LoRA run dir or its adapter dir.", metavar="RUN_OR_ADAPTER"),
    base: Optional[str] = typer.Option(None, "--base", help="Base model id or path (default: from the adapter)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Where to write the merged model."),
    dtype: str = typer.Option("bfloat16", "--dtype", help="bfloat16 | float16 | float32."),
    fmt: str = typer.Option("plain", "--format", help="plain: every weight in --dtype; mxfp4: gpt-oss expert "
                            "weights re-quantized to MXFP4 (the base's format), the rest in --dtype."),
    recipe: Optional[str] = OptionalRecipeOpt,
    overrides: Optional[list[str]] = SetOpt,
    force: bool = ForceOpt,
) -> None:
    """Merge a LoRA adapter into its base (MXFP4 bases dequantized), streamed one layer at a time, and verify it."""
    r = _load(recipe, overrides)
    from ftcli.commands.merge import run_merge

    run_merge(adapter_dir, base=base, output=output, dtype=dtype, recipe=r, force=force, fmt=fmt)


# ------------------------------------------------------------------------------------------ register
@app.command("register", epilog=_examples("register"))
def register(
    model_dir: Path = typer.Argument(..., help="A run dir (with run.json) or a model dir.", metavar="RUN_OR_MODEL"),
    name: str = typer.Option(..., "--name", help="Registered model name (catalog.schema.model for UC)."),
    registry_uri: Optional[str] = typer.Option(None, "--registry-uri", help="e.g. databricks-uc."),
    tracking_uri: Optional[str] = typer.Option(None, "--tracking-uri", help="MLflow tracking URI."),
    alias: Optional[str] = typer.Option(None, "--alias", help="Set this alias on the new version."),
    adapter_only: bool = typer.Option(False, "--adapter-only", help="Log only the LoRA adapter (+ base ref)."),
    merged: bool = typer.Option(False, "--merged", help="Merge a LoRA adapter first and log full weights."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    recipe: Optional[str] = OptionalRecipeOpt,
    overrides: Optional[list[str]] = SetOpt,
    force: bool = typer.Option(False, "--force", help="Move an alias that already points at another version."),
    checkpoint: str = typer.Option("last", "--checkpoint", help="A run dir's last (final) or best (best eval) model."),
) -> None:
    """Log a trained model to MLflow and register it (local registry or Unity Catalog)."""
    from ftcli.config.recipe import plain_text_problem

    for flag, value in (("--name", name), ("--alias", alias)):
        problem = None if value is None else plain_text_problem(value)
        if problem:
            _fail(f"{flag} {value!r}: {problem}")
    r = _load(recipe, overrides)
    from ftcli.commands.register import run_register

    run_register(
        model_dir, name=name, registry_uri=registry_uri, tracking_uri=tracking_uri, alias=alias,
        adapter_only=adapter_only, merged=merged, as_json=as_json, recipe=r, force=force, checkpoint=checkpoint,
    )


# ---------------------------------------------------------------------------------------------- plan
@app.command("plan", epilog=_examples("plan"))
def plan(
    recipe: str = RecipeOpt,
    overrides: Optional[list[str]] = SetOpt,
    accelerators: Optional[list[str]] = typer.Option(
        None, "--accelerator", "-a", help="Plan for this accelerator type too, e.g. GPU_8xH100 (repeatable)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
) -> None:
    """Memory per GPU, fit, s/step, wall time and GPU-hours of a recipe on each known card."""
    r = _load(recipe, overrides)
    from ftcli.commands.plan import run_plan

    run_plan(r, accelerators=list(accelerators or []), as_json=as_json)


# -------------------------------------------------------------------------------------------- doctor
@app.command("doctor", epilog=_examples("doctor"))
def doctor(
    recipe: Optional[str] = OptionalRecipeOpt,
    overrides: Optional[list[str]] = SetOpt,
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    deep: bool = typer.Option(
        False, "--deep", help="Import torch and transformers for every check, even where the tested versions' "
        "recorded facts answer it (slower)."
    ),
) -> None:
    """Versions, packed-kernel backends, known-bad combinations; with a recipe, whether it can run here."""
    r = _load(recipe, overrides)
    from ftcli.commands.doctor import run_doctor

    code = run_doctor(r, as_json=as_json, deep=deep)
    raise typer.Exit(code)


# ---------------------------------------------------------------------------------- generate, chat
ModelArg = typer.Argument(
    ..., help="A run dir, a merged/model dir, a LoRA adapter dir, or a hub id.", metavar="RUN_OR_MODEL"
)
SystemOpt = typer.Option(None, "--system", help="System prompt.")

# The decoding options `generate` and `chat` share, in the order their --help lists them:
# (parameter, annotation, option).
DECODING_OPTIONS = (
    ("max_new_tokens", "int",
     typer.Option(256, "--max-new-tokens", min=1, help="Generate at most this many tokens per reply.")),
    ("temperature", "Optional[float]",
     typer.Option(None, "--temperature", min=0.0, help="Sample at this temperature (0: greedy).")),
    ("top_p", "Optional[float]",
     typer.Option(None, "--top-p", min=0.0, max=1.0, help="Nucleus sampling: keep this probability mass.")),
    ("top_k", "Optional[int]", typer.Option(None, "--top-k", min=0, help="Sample among the k most likely tokens.")),
    ("greedy", "bool", typer.Option(False, "--greedy", help="Greedy decoding (overrides sampling options).")),
    ("seed", "Optional[int]", typer.Option(None, "--seed", help="Seed the sampling (reproducible replies).")),
    ("reasoning_effort", "Optional[str]",
     typer.Option(None, "--reasoning-effort", help="Chat-template reasoning effort (gpt-oss: low|medium|high).")),
    ("reasoning_language", "Optional[str]", typer.Option(
        None, "--reasoning-language", help="gpt-oss: adds 'reasoning language: LANG' to the system prompt.")),
    ("dtype", "str",
     typer.Option("auto", "--dtype", help="auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float16 | float32")),
    ("device", "str", typer.Option("auto", "--device", help="auto (CUDA when present) | cpu | cuda | cuda:N | mps.")),
    ("revision", "Optional[str]",
     typer.Option(None, "--revision", help="Hub revision (commit, tag, branch) for a hub id.")),
)


def _decoding(max_new_tokens, greedy, temperature, top_p, top_k, seed, **model_options) -> dict:
    """The DECODING_OPTIONS as the keyword arguments ftcli.commands.generate's runners take."""
    from ftcli.inference import Sampling

    sampling = Sampling(max_new_tokens=max_new_tokens, greedy=greedy, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed)
    return {"sampling": sampling, **model_options}


def _with_decoding_options(command):
    """`command` with its parameter `decoding` spelled out as the DECODING_OPTIONS, where it stands (typer
    reads a command's options from its signature); the command gets them back as `decoding`, the keyword
    arguments of `_decoding`."""
    signature = inspect.signature(command)
    params = []
    for param in signature.parameters.values():
        if param.name != "decoding":
            params.append(param)
            continue
        params += [inspect.Parameter(name, param.kind, default=option, annotation=annotation)
                   for name, annotation, option in DECODING_OPTIONS]

    @functools.wraps(command)
    def run(**kwargs):
        decoding = _decoding(**{name: kwargs.pop(name) for name, _, _ in DECODING_OPTIONS})
        return command(**kwargs, decoding=decoding)

    run.__signature__ = signature.replace(parameters=params)
    run.__annotations__ = {p.name: p.annotation for p in params} | {"return": signature.return_annotation}
    return run


@app.command("generate", epilog=_examples("generate"))
@_with_decoding_options
def generate(
    model: str = ModelArg,
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="One user prompt; the reply streams."),
    system: Optional[str] = SystemOpt,
    input_path: Optional[Path] = typer.Option(None, "--input", "-i", help="JSONL of conversations to complete."),
    output: Optional[Path] = typer.Option(
        None, "--output", "-o", help="With --input: write completions here (default: stdout)."
    ),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="With --input: conversations per batch."),
    decoding: Optional[dict] = None,  # the DECODING_OPTIONS (see _with_decoding_options)
    as_json: bool = typer.Option(False, "--json", help="With --prompt: print the reply as one JSON object."),
    force: bool = ForceOpt,
) -> None:
    """Generate with a trained model: one streamed prompt, or a JSONL file of conversations."""
    from ftcli.commands.generate import run_generate

    run_generate(model, prompt=prompt, system=system, input_path=input_path, output=output, force=force,
                 batch_size=batch_size, as_json=as_json, **decoding)


@app.command("chat", epilog=_examples("chat"))
@_with_decoding_options
def chat(
    model: str = ModelArg,
    system: Optional[str] = SystemOpt,
    decoding: Optional[dict] = None,  # the DECODING_OPTIONS (see _with_decoding_options)
) -> None:
    """Chat with a trained model: multi-turn, with /system TEXT, /reset and /exit."""
    from ftcli.commands.chat import run_chat_command

    run_chat_command(model, system=system, **decoding)


def _normalize_argv(argv: list[str]) -> list[str]:
    """`--resume` may be given without a value: it then means the run dir's latest checkpoint."""
    out = []
    for i, arg in enumerate(argv):
        out.append(arg)
        if arg == "--resume" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            out.append("latest")
    return out


def run() -> None:
    """Console-script entry (`ftcli`)."""
    app(args=_normalize_argv(sys.argv[1:]), prog_name="ftcli")
