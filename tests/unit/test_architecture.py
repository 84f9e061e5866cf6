"""The house's shape: ftcli's modules import only downwards (no import circles, lazy imports included)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import ftcli

PACKAGE_ROOT = Path(ftcli.__file__).resolve().parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(PACKAGE_ROOT.rglob("*.py"))}


@functools.cache
def _source(path: Path) -> str:
    return path.read_text()


@functools.cache
def _tree(source: str) -> ast.Module:
    """A source's tree, parsed once for every walk of this file (the walks only read it, never change it)."""
    return ast.parse(source)


@functools.cache
def _nodes(source: str) -> tuple[ast.AST, ...]:
    """Every node of a source's tree (`ast.walk` order), listed once for every walk of this file."""
    return tuple(ast.walk(_tree(source)))


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every ftcli module `name` imports, at module level or inside a function."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _nodes(_source(path)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative import: resolve against this module's package
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when there is one
            targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in known else module for a in node.names]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    cycles, state, stack = [], {}, []

    def visit(node: str) -> None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


def test_import_graph_is_found():
    """Guards the walker itself: a few edges every version of ftcli has."""
    modules = _modules()
    graph = {n: _imports(n, p, set(modules)) for n, p in modules.items()}
    assert "ftcli.config.recipe" in graph["ftcli.cli"] or any("ftcli.config.recipe" in graph[m] for m in graph["ftcli.cli"])
    assert "ftcli.config.errors" in graph["ftcli.config.recipe"]
    assert len(modules) >= 20


def test_no_import_circles():
    modules = _modules()
    graph = {n: _imports(n, p, set(modules)) for n, p in modules.items()}
    # A package's __init__ re-exporting its own submodules is not a circle of design.
    for n in graph:
        graph[n] = {m for m in graph[n] if not (n.startswith(m + ".") and modules[m].name == "__init__.py")}
    assert _cycles(graph) == []


def test_walker_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


# ------------------------------------------------------------------------------------------ families
def _string_constants(path: Path) -> set[str]:
    return {node.value for node in _nodes(_source(path)) if isinstance(node, ast.Constant) and isinstance(node.value, str)}


def test_no_module_outside_families_names_a_model_type():
    """Every model-type fact lives in ftcli/families/: no other module holds a registered model type as a string
    (nor asks `startswith` of one: the prefixes a family's model types share count too)."""
    from ftcli.families import BY_MODEL_TYPE

    types = set(BY_MODEL_TYPE)
    prefixes = {t.split("_")[0] + "_" for t in types if "_" in t} | types  # qwen3_, gpt_ ... as startswith args
    offenders = {}
    for name, path in _modules().items():
        if name == "ftcli.families" or name.startswith("ftcli.families."):
            continue
        found = sorted(s for s in _string_constants(path) if s in types or s in prefixes)
        if found:
            offenders[name] = found
    assert offenders == {}
    assert len(types) >= 3  # the walk had something to look for


def test_string_walker_finds_a_planted_model_type(tmp_path):
    planted = tmp_path / "m.py"
    planted.write_text('def f(t):\n    return t.startswith("qwen3_5")  # docstrings and comments: qwen3_5\n')
    assert "qwen3_5" in _string_constants(planted)


def test_every_family_has_every_field_filled():
    """Each registered family states every fact its consumers ask (no field left empty where it has a value)."""
    import dataclasses

    from ftcli.chat_formats import CHAT_FORMATS
    from ftcli.families import BY_MODEL_TYPE, FAMILIES
    from ftcli.families import base

    rules = {base.TRANSFORMERS_PACKING_ARGS, base.BLACKWELL_GATED_DELTA, base.FLA_ON_GPU, base.SINK_ATTENTION}
    assert set(FAMILIES) and all(BY_MODEL_TYPE[t] is f for f in FAMILIES.values() for t in f.model_types)
    for name, f in FAMILIES.items():
        for fld in dataclasses.fields(f):
            value = getattr(f, fld.name)
            optional = fld.name in ("kernel_module", "setup_note", "no_pins_note", "pins", "fused_op_targets", "known_bad",
                                    "module_globals", "vlm_text_types", "per_expert_checkpoint", "notes", "decoder",
                                    "expert_layout")  # may say "none"
            assert optional or value not in (None, "", (), {}), (name, fld.name)
        assert f.name == name and f.model_types and f.attention in (base.DENSE, base.SINKS)
        assert f.packed_ops[0] == "attention" and set(f.module_globals) <= set(f.packed_ops)
        assert bool(f.module_globals) <= bool(f.kernel_module)
        assert set(f.known_bad) <= rules and f.chat_format in CHAT_FORMATS
        assert set(f.vlm_classes) == set(f.model_types)  # doctor's recorded VLM classes cover every model type
        assert set(f.vlm_text_types) <= set(f.model_types) and set(f.vlm_text_types.values()) <= set(f.model_types)
        assert f.setup_note or f.no_pins_note  # the workload's setup comment has something to say
        assert f.stored_layer_bytes > 0 and f.stored_layer_bytes_source in ("fit", *FAMILIES)
        assert callable(f.layer_shapes)


def test_estimates_and_trainers_import_no_command():
    """`plan`, `doctor` and the LoRA trainer share the estimates (ftcli.estimate), never a command module."""
    modules = _modules()
    below = [n for n in modules if n.startswith(("ftcli.estimate", "ftcli.train.lora", "ftcli.model", "ftcli.data",
                                                 "ftcli.config"))]
    assert "ftcli.estimate.fit" in below and "ftcli.train.lora.trainer" in below
    upward = {n: sorted(m for m in _imports(n, modules[n], set(modules)) if m.startswith("ftcli.commands"))
              for n in below}
    assert {n: up for n, up in upward.items() if up} == {}


# ------------------------------------------------------------------------------- the recipe schema's sections
# A section may nest another section's records where its keys hold them (eval lists data sources).
SECTION_NESTS = {"ftcli.config.sections.eval": {"ftcli.config.sections.data"}}


def test_recipe_sections_see_no_other_section():
    """Each recipe section (ftcli/config/sections/) imports the shared base and config's helpers, no other section:
    a rule between sections can only be written in ftcli.config.recipe (`Recipe`), the one module that sees them
    all, and `from ftcli.config.recipe import X` keeps naming the whole schema."""
    modules = _modules()
    sections = [n for n in modules if n.startswith("ftcli.config.sections.")]
    assert {"ftcli.config.sections.training", "ftcli.config.sections.data"} <= set(sections)
    seen = {n: {m for m in _imports(n, modules[n], set(modules)) if m.startswith("ftcli.config.sections.")}
            - {"ftcli.config.sections.base"} - SECTION_NESTS.get(n, set()) for n in sections}
    assert {n: sorted(m) for n, m in seen.items() if m} == {}
    assert "ftcli.config.sections.training" in _imports("ftcli.config.recipe", modules["ftcli.config.recipe"],
                                                         set(modules))


# ------------------------------------------------------------------------------------- chat formats have a room
def _code_strings(source: str) -> list[tuple[int, str]]:
    """(line, text) of every string literal of `source` that is not a docstring (docstrings teach, code acts)."""
    nodes = _nodes(source)
    docs = {id(body[0].value) for node in nodes
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and (body := node.body) and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in nodes
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs]


def format_mentions(name: str, source: str, words: set[str]) -> list[str]:
    return [f"{name}:{line}: {text[:60]!r}" for line, text in _code_strings(source) if any(w in text for w in words)]


def test_no_module_outside_chat_formats_names_a_chat_marker():
    """The marker strings of every chat format (its template's markers, end of turn, stop tokens, what its
    templates are detected by) and the think block are written in ftcli/chat_formats/ only: the masks, the stop
    tokens, reply splitting and tool-call parsing ask the format (docstrings and comments may show them)."""
    from ftcli.chat_formats import CHAT_FORMATS

    words = {"<think>", "</think>", "<tool_call>"}
    for f in CHAT_FORMATS.values():
        words |= {*f.markers, *f.detect, f.end_of_turn, *f.stop_tokens}
    found = [hit for name, path in _modules().items() if not name.startswith("ftcli.chat_formats")
             for hit in format_mentions(name, _source(path), words)]
    assert found == []
    assert len(words) >= 15  # the walk had something to look for


def test_chat_marker_walker_skips_docstrings_only():
    source = 'def f(x):\n    """Splits at </think>."""\n    return x.split("</think>")\n'
    assert format_mentions("m", source, {"</think>"}) == ["m:3: '</think>'"]


# ------------------------------------------------------------------------------ training features have a room
FEATURE_WORDS = ("fp8", "float8", "torchao", "liger")
# Where a feature's name may still be written outside ftcli/features/, and why:
NAMING_ALLOWED = {
    # the schema's training section: a recipe is data validated by one typed schema, and config/ is the bottom of
    # the house (it imports nothing above it), so the keys' declarations (fields, Literal choices, descriptions)
    # stay there
    "ftcli.config.sections.training": ("PrecisionConfig", "LossConfig", "FullTraining", "LoraTraining"),
    # the package's import-time silencing of torchao's warnings: transformers imports torchao whenever it is
    # installed, whatever the recipe, so it is the environment's noise, not a feature's
    "ftcli": None,
}


def _names_in(nodes) -> list[tuple[int, str]]:
    """(line, text) of every string literal, attribute, name, argument and definition among `nodes`."""
    found = []
    for node in nodes:
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.append((node.lineno, node.value))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.arg):
            found.append((node.lineno, node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found.append((node.lineno, node.name))
        elif isinstance(node, ast.alias):
            found.append((getattr(node, "lineno", 0), node.name))
    return found


def feature_mentions(name: str, source: str) -> list[str]:
    """'module:line: text' wherever `source` (the module `name`) names a training feature outside what
    NAMING_ALLOWED lets it (string literals, docstrings included, and identifiers; comments are free)."""
    nodes = _nodes(source)
    if name in NAMING_ALLOWED:
        allowed = NAMING_ALLOWED[name]
        if allowed is None:
            return []
        kept = [n for n in _tree(source).body if not (isinstance(n, ast.ClassDef) and n.name in allowed)]
        nodes = [node for top in kept for node in ast.walk(top)]  # the cached tree itself stays whole
    return [f"{name}:{line}: {text[:60]!r}" for line, text in _names_in(nodes)
            if any(word in text.lower() for word in FEATURE_WORDS)]


def test_no_module_outside_features_names_a_training_feature():
    """fp8, torchao and liger are written in ftcli/features/ only: every consumer (doctor, plan, workload,
    the trainers, the launcher, the memory model) loops over the feature records instead."""
    found = [hit for name, path in _modules().items() if not name.startswith("ftcli.features")
             for hit in feature_mentions(name, _source(path))]
    assert found == []


def test_feature_naming_walker_sees_literals_attributes_and_docstrings():
    source = '"""Uses fp8."""\nx = t.precision.fp8\ny = "liger"\n# torchao in a comment is free\nclass LossConfig:\n    impl = "liger"\n'
    assert feature_mentions("ftcli.somewhere", source) == [
        "ftcli.somewhere:1: 'Uses fp8.'", "ftcli.somewhere:2: 'fp8'", "ftcli.somewhere:3: 'liger'",
        "ftcli.somewhere:6: 'liger'"]
    assert feature_mentions("ftcli.config.sections.training", source) == [
        "ftcli.config.sections.training:1: 'Uses fp8.'", "ftcli.config.sections.training:2: 'fp8'",
        "ftcli.config.sections.training:3: 'liger'"]


# ------------------------------------------------------------------------------------------ rooms
# The rooms, bottom up. A module imports only from its own room or a lower one, lazy imports included:
#   commands -> launchers / train / inference / estimate / artifacts -> model / features -> data -> families /
#   hardware / chat_formats -> config
LAYERS = {
    "config": 0, "hub": 1,
    "families": 1, "hardware": 1, "chat_formats": 1,
    "data": 2,
    "model": 3, "features": 3, "objectives": 3,
    "artifacts": 4, "estimate": 4, "inference": 4, "train": 4, "launchers": 4,
    "commands": 5,
    "cli": 6, "__main__": 6,
}


def _room(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_module_lives_in_a_room():
    rooms = {_room(m) for m in _modules()} - {None}
    assert rooms <= set(LAYERS), sorted(rooms - set(LAYERS))


def test_imports_run_downwards_through_the_rooms():
    modules = _modules()
    known = set(modules)
    upward = []
    for name, path in modules.items():
        room = _room(name)
        if room is None:  # ftcli/__init__.py
            continue
        for target in _imports(name, path, known):
            target_room = _room(target)
            if target_room is not None and LAYERS[target_room] > LAYERS[room]:
                upward.append(f"{name} -> {target}")
    assert upward == []


def test_nothing_imports_a_command_but_the_cli():
    modules = _modules()
    known = set(modules)
    offenders = [f"{name} -> {target}" for name, path in modules.items()
                 if _room(name) not in ("commands", "cli", "__main__")
                 for target in _imports(name, path, known) if _room(target) == "commands"]
    assert offenders == []


# ------------------------------------------------------------------ objectives and methods have a room
# Where `method` / `objective` may still be compared with a name, and why: the schema (config/ is the bottom of the
# house and imports nothing above it): the discriminator that picks FullTraining or LoraTraining (the training
# section), and the rules between sections (model.quantization=mxfp4 needs LoRA: the recipe).
BRANCHING_ALLOWED = {"ftcli.config.recipe", "ftcli.config.sections.training"}
AXES = ("method", "objective")


def _axis(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id in AXES) or (isinstance(node, ast.Attribute) and node.attr in AXES)


def _names_a_value(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return True
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(_names_a_value(e) for e in node.elts)


def axis_branches(name: str, source: str) -> list[str]:
    """'module:line' wherever `source` compares a training method or objective with a name (`x.method == "lora"`,
    `objective in ("dpo", ...)`, either side) instead of asking its record (ftcli.objectives)."""
    found = []
    for node in _nodes(source):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_axis(s) for s in sides) and any(_names_a_value(s) for s in sides):
                found.append(f"{name}:{node.lineno}")
    return found


def test_no_module_outside_the_rooms_branches_on_method_or_objective():
    """Every consumer asks the Method / Objective record (writes_adapter, trains_base, checkpoint_kind, count, ...);
    only ftcli/objectives/ and the schema compare the names."""
    found = [hit for name, path in _modules().items()
             if not name.startswith("ftcli.objectives") and name not in BRANCHING_ALLOWED
             for hit in axis_branches(name, _source(path))]
    assert found == []


def test_axis_walker_sees_comparisons_either_side():
    source = ('a = recipe.training.method == "lora"\nb = "full" != run.method\nc = objective in ("sft", "dpo")\n'
              'd = quant_method == "mxfp4"\ne = method_of(t).writes_adapter\n')
    assert axis_branches("m", source) == ["m:1", "m:2", "m:3"]


# ----------------------------------------------------------------- the lower rooms take sections, not the recipe
# torchtitan hands `parallelize_llama(model, *, parallel_dims, training, compile_config, ac_config)` only the sections
# it uses. Here the recipe is taken apart in the commands, the launchers, the train launcher, the run session and the
# trainers' top functions; below them a function receives the sections it reads (`data: DataConfig`,
# `training: TrainingConfig`, ...) or small typed values. A function "takes the whole recipe" when a parameter is
# annotated `Recipe`, or is unannotated and named after it (`recipe`, `recipe_or_spec`).
RECIPE_ROOMS = {"commands", "launchers", "cli", "__main__"}  # where the whole recipe is at home
RECIPE_MODULES = {  # the train room's top, where a recipe becomes its sections
    "ftcli.train.launch", "ftcli.train.session", "ftcli.train.full", "ftcli.train.preference",
    "ftcli.train.lora.trainer", "ftcli.train.lora.callbacks",
}
RECIPE_ALLOWED = {  # "module:function": why it still takes the whole recipe
    # the recipe as a document: every key of it is read, written, logged or compared
    "ftcli.config.recipe:load_recipe": "the schema: reads and returns a Recipe",
    "ftcli.config.recipe:dump_recipe": "the schema: writes a whole Recipe to YAML",
    "ftcli.artifacts.rundir:saved_recipe": "the recipe as <run>/recipe.yaml holds it (credentials masked)",
    "ftcli.artifacts.rundir:recipe_digest": "the sha256 of the whole resolved recipe",
    "ftcli.artifacts.rundir:recipe_differences": "every key that differs from the run's recipe.yaml",
    "ftcli.artifacts.rundir:prepare_run_dir": "writes <run>/recipe.yaml (after check_run_dir(name, output_dir))",
    "ftcli.artifacts.rundir:new_run_record": "run.json stores the resolved recipe",
    "ftcli.artifacts.tracking:start_tracking": "logs the resolved recipe as the MLflow run's params",
    "ftcli.artifacts.tracking:_start": "logs the resolved recipe as the MLflow run's params",
    "ftcli.train.resume:check_resume_recipe": "compares every key with the run's recipe.yaml (applied / refused)",
    "ftcli.features:recipe_problems": "the schema's rule hook (load_recipe(rules=...)); hands each feature its sections",
    "ftcli.data.spec:data_spec": "where a recipe becomes its training DataSpec (name, data, eval holdout, pairs)",
    # the recipe as a Recipe or run.json's dict (merge-lora --recipe, register): left while merge.py is reworked
    "ftcli.artifacts.resolve:of": "ModelSettings of a Recipe or of run.json's recipe dict",
    "ftcli.artifacts.merge:merge_lora": "passes --recipe (a Recipe or run.json's dict) to ModelSettings.of",
    "ftcli.artifacts.merge:merge": "passes --recipe (a Recipe or run.json's dict) to ModelSettings.of",
    "ftcli.artifacts.merge:_merge": "passes --recipe (a Recipe or run.json's dict) to ModelSettings.of",
    "ftcli.artifacts.merge:_model_config": "passes --recipe (a Recipe or run.json's dict) to ModelSettings.of",
    # estimate's entry points: a plan reads five sections (model, data, training, lora, compute) and the name;
    # setting_of is where a recipe becomes its memory.Setting, and below it every function takes sections
    "ftcli.estimate.fit:setting_of": "a recipe -> its memory.Setting (model, data, training, lora, compute)",
    "ftcli.estimate.fit:lora_sharding": "training.sharding=auto: what fits the compute section's card (setting_of)",
    "ftcli.estimate.fit:resolved_sharding": "the LoRA trainer's sharding (lora_sharding)",
    "ftcli.estimate.fit:memory_on": "setting_of on `world` GPUs",
    "ftcli.estimate.fit:fit_here": "memory_on against this machine, messages naming the recipe",
    "ftcli.estimate.fit:can_run_here": "fit_here",
    "ftcli.estimate.plan:card_plan": "setting_of on one card, its suggestions and step time",
    "ftcli.estimate.plan:make_plan": "`ftcli plan`: card_plan per card",
    "ftcli.estimate.plan:fit_check": "card_plan on the recipe's own card",
}


def _names_recipe(annotation: ast.AST) -> bool:
    if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
        try:
            annotation = ast.parse(annotation.value, mode="eval").body
        except SyntaxError:
            return False
    return any((isinstance(n, ast.Name) and n.id == "Recipe") or (isinstance(n, ast.Attribute) and n.attr == "Recipe")
               for n in ast.walk(annotation))


def recipe_takers(name: str, source: str) -> list[str]:
    """'module:function' for each function (lambdas and methods included) of `source` with a parameter that is the
    whole recipe: annotated `Recipe` (or "Recipe", `recipe.Recipe`), or unannotated with "recipe" in its name."""
    found = []
    for node in _nodes(source):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(p for p in (a.vararg, a.kwarg) if p)]
            if any(_names_recipe(p.annotation) if p.annotation is not None else "recipe" in p.arg for p in params):
                found.append(f"{name}:{getattr(node, 'name', '<lambda>')}")
    return found


def recipe_takers_per_room() -> dict[str, int]:
    """How many functions take the whole recipe, per room (the train room's top modules counted apart as
    'train (top)'): the figure issue 40 measures."""
    counts: dict[str, int] = {}
    for name, path in _modules().items():
        room = _room(name) or "ftcli"
        room = "train (top)" if name in RECIPE_MODULES else room
        counts[room] = counts.get(room, 0) + len(recipe_takers(name, _source(path)))
    return {room: n for room, n in sorted(counts.items()) if n}


def test_lower_rooms_take_sections_not_the_recipe():
    """Below the commands, the launchers and the train room's top, a function takes the sections it reads; the
    allow-list names each exception with its reason, and shrinks: an entry that takes sections now must go."""
    takers = [hit for name, path in _modules().items()
              if _room(name) not in RECIPE_ROOMS and name not in RECIPE_MODULES
              for hit in recipe_takers(name, _source(path))]
    assert [hit for hit in takers if hit not in RECIPE_ALLOWED] == [], recipe_takers_per_room()
    assert sorted(set(RECIPE_ALLOWED) - set(takers)) == []


def test_recipe_taker_walker_sees_annotations_names_and_lambdas():
    source = ('def a(recipe): ...\ndef b(x: Recipe): ...\ndef c(x: "Recipe | None" = None): ...\n'
              'def d(*, r: recipe.Recipe): ...\nf = lambda recipe_or_spec: 1\n'
              'def e(recipe: str, training: TrainingConfig): ...\ndef g(recipe_path: str): ...\n'
              'class K:\n    def m(self, recipe): ...\n')
    assert recipe_takers("m", source) == ["m:a", "m:b", "m:c", "m:d", "m:<lambda>", "m:m"]
