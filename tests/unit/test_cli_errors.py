"""Every user-reachable error is one line on stderr, exit code 2, never a traceback; file errors name
the path.

The error format: one line `error: <what is wrong, where, what to do>`. Where several problems are
found at once (several recipe keys, several workload rules), the first line counts them and each follows
on its own line indented by two spaces (`  - ...`). Nothing else reaches stderr.

The malformed-recipe corpus (`CORPUS`, 119 recipes: tests/support/_recipe_corpus.py) runs each file through
`recipes show` and `render-workload --recipe` in-process; the nastiest files through a real process:
tests/e2e/test_cli_real_process.py.
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from _recipe_corpus import CORPUS, TINY_TEXT

from ftcli import cli

runner = CliRunner()


def assert_one_error(res, *must_contain: str) -> str:
    """exit 2, nothing on stdout, `error: ...` (+ indented lines) on stderr, no exception escaped."""
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.stdout == ""
    lines = res.stderr.splitlines()
    assert lines and lines[0].startswith("error: "), res.stderr
    assert all(line.startswith("  ") for line in lines[1:]), res.stderr
    assert "Traceback" not in res.output
    for text in must_contain:
        assert text in res.stderr, res.stderr
    return res.stderr


def invoke(*args: str):
    return runner.invoke(cli.app, list(args))


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 60
    assert len(CORPUS) == 119


@pytest.mark.parametrize("command", [["recipes", "show"], ["render-workload", "--recipe"]])
@pytest.mark.parametrize("case", list(CORPUS))
def test_malformed_recipe_is_one_error_line(case, command, recipe_corpus):
    path = recipe_corpus / f"{case}.yaml"
    stderr = assert_one_error(invoke(*command, str(path)))
    assert str(path) in stderr.splitlines()[0]  # file errors name the path


@pytest.mark.parametrize("case,expected", [
    ("binary-random", "recipe {path} is not UTF-8 text (byte 0x80 at offset 128); is it a binary file?"),
    ("latin-1-text", "recipe {path} is not UTF-8 text (byte 0xe9 at offset %d); is it a binary file?"
     % (TINY_TEXT.index("description:") + len("description: caf"))),
    ("nul-bytes-in-utf8", "invalid recipe {path}: not valid YAML: control character #x0000 at offset %d "
                          "(a binary file?)" % (TINY_TEXT.index("name: tiny-qwen-cpu") + len("name: tiny"))),
    ("oversized-file", "recipe {path} is larger than 8 MiB; is it the right file?"),
    ("empty-file", "invalid recipe {path}: expected a mapping of sections at the top level"),
    ("top-level-list", "invalid recipe {path}: expected a mapping of sections at the top level"),
    ("override-zero-layers", "invalid recipe {path}: model.config_overrides: num_hidden_layers must be at least 1 (got 0)"),
    ("override-negative-hidden-size",
     "invalid recipe {path}: model.config_overrides: text_config.hidden_size must be at least 1 (got -4)"),
])
def test_file_errors_name_the_path(case, expected, recipe_corpus):
    path = recipe_corpus / f"{case}.yaml"
    assert invoke("recipes", "show", str(path)).stderr == f"error: {expected.format(path=path)}\n"


def _denied(path: Path) -> PermissionError:
    """The error the OS gives a non-root user for `path` under chmod 0 (injected: root reads and writes
    through chmod 0, and CI runs as root)."""
    return PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))


def test_unreadable_recipe_is_one_line(tmp_path, monkeypatch):
    import ftcli.config.strict_yaml

    path = tmp_path / "locked.yaml"
    path.write_text(TINY_TEXT)

    def open_denied(file, *args, **kwargs):
        if Path(file) == path:
            raise _denied(path)
        return open(file, *args, **kwargs)

    monkeypatch.setattr(ftcli.config.strict_yaml, "open", open_denied, raising=False)  # the open read_text_file uses
    res = invoke("recipes", "show", str(path))
    assert assert_one_error(res) == f"error: cannot read recipe {path}: Permission denied\n"


# ---------------------------------------------------------------------------- workload --check
@pytest.mark.parametrize("content,expected", [
    (bytes(range(256)), "workload {path} is not UTF-8 text (byte 0x80 at offset 128); is it a binary file?"),
    (b"experiment_name: a\x00b\n", "not valid YAML: control character #x0000 at offset 18 (a binary file?)"),
    (b"experiment_name: a\nexperiment_name: b\n", "not valid YAML line 2: duplicate key 'experiment_name' "
                                                  "(first set at line 1)"),
    (b"x: &a [1]\ny: *a\n", "not valid YAML line 2: YAML aliases (*a) are not supported; write the value out"),
    (b"x: " + b"[" * 5000 + b"]" * 5000 + b"\n", "not valid YAML line 1: nested deeper than 64 levels"),
])
def test_check_of_a_bad_workload_file_is_one_line(content, expected, tmp_path):
    path = tmp_path / "w.yaml"
    path.write_bytes(content)
    res = invoke("render-workload", "--check", str(path))
    assert assert_one_error(res) == f"error: {path}: {expected.format(path=path)}\n"


def test_check_with_several_problems_lists_them_indented(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("experiment_name: x\nbogus: 1\n")
    stderr = assert_one_error(invoke("render-workload", "--check", str(path)))
    assert stderr.splitlines() == [
        f"error: {path}: 4 problems",
        "  - missing required key 'compute'",
        "  - missing required key 'command'",
        "  - unknown key 'bogus'",
        "  - environment.version: not set; set it explicitly (e.g. databricks_ai_v6), the CLI's default changes",
    ]


# --------------------------------------------------------------------------------- output paths
@pytest.mark.parametrize("command", [
    ["recipes", "cp", "tiny-qwen-cpu", "{out}"],
    ["render-workload", "--recipe", "tiny-qwen-cpu", "-o", "{out}"],
    ["pack-preview", "--recipe", "tiny-qwen-cpu", "--dump", "{out}"],
])
def test_writing_into_a_missing_directory_is_refused_before_any_work(command, tmp_path, monkeypatch):
    import ftcli.commands.preview

    monkeypatch.setattr(ftcli.commands.preview, "run_preview", lambda *a, **k: pytest.fail("tokenized before the check"))
    out = tmp_path / "missing" / "out.yaml"
    res = invoke(*[a.format(out=out) for a in command])
    parent = out.parent
    assert assert_one_error(res) == (
        f"error: cannot write {out}: {parent} does not exist; create it first (mkdir -p {parent})\n"
    )
    assert not parent.exists()


@pytest.mark.parametrize("command,example", [
    (["recipes", "cp", "tiny-qwen-cpu", "{out}"], None),  # cp into a folder writes {out}/<name>.yaml: a folder here
    (["render-workload", "--recipe", "tiny-qwen-cpu", "-o", "{out}"], None),
    (["pack-preview", "--recipe", "tiny-qwen-cpu", "--dump", "{out}"], "blocks.jsonl"),
])
def test_a_folder_as_the_output_is_refused_in_the_words_generate_uses(command, example, tmp_path):
    """One check for every command's output file (ftcli.config.safe_files.check_output_path, also `generate -o`)."""
    out = tmp_path / "out"
    (out / "tiny-qwen-cpu.yaml").mkdir(parents=True)
    folder = out / "tiny-qwen-cpu.yaml" if command[0] == "recipes" else out
    hint = f", e.g. {folder / example}" if example else ""
    res = invoke(*[a.format(out=out) for a in command])
    assert assert_one_error(res) == f"error: {folder} is a folder; give a file path{hint}\n"


def test_writing_below_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "out.yaml"
    assert assert_one_error(invoke("recipes", "cp", "tiny-qwen-cpu", str(out))) == (
        f"error: cannot write {out}: {out.parent} is not a folder\n"
    )


@pytest.mark.parametrize("command", [
    ["recipes", "cp", "tiny-qwen-cpu", "{out}"],
    ["render-workload", "--recipe", "tiny-qwen-cpu", "-o", "{out}"],
    ["render-workload", "--recipe", "tiny-qwen-cpu", "--launcher", "slurm", "-o", "{out}"],
    ["pack-preview", "--recipe", "tiny-qwen-cpu", "--examples", "30", "--blocks", "1", "--dump", "{out}"],
])
@pytest.mark.parametrize("dangling", [True, False])
def test_a_link_is_never_written_through_and_force_replaces_it(command, dangling, tmp_path):
    """Without --force a link is refused (dangling or not); with --force the link is replaced by the output and its
    target is left alone (issue 47, item 15: as `generate -o --force` does)."""
    target = tmp_path / "elsewhere" / "target.yaml"
    target.parent.mkdir()
    if not dangling:
        target.write_text("VICTIM\n")
    link = tmp_path / "link.yaml"
    link.symlink_to(target)
    res = invoke(*[a.format(out=link) for a in command])
    assert assert_one_error(res) == (
        f"error: {link} is a symbolic link (to {target}); pass --force to replace the link (its target is left alone)\n"
    )
    assert link.is_symlink()
    res = invoke(*[a.format(out=link) for a in command], "--force")
    assert res.exit_code == 0, res.output
    assert not link.is_symlink() and link.stat().st_size > 0
    assert (not target.exists()) if dangling else target.read_text() == "VICTIM\n"


def test_cp_of_a_path_like_name_is_an_unknown_recipe(tmp_path):
    (tmp_path / "evil.yaml").write_text(TINY_TEXT)
    res = invoke("recipes", "cp", f"../../../../../../..{tmp_path}/evil", str(tmp_path / "out.yaml"))
    assert_one_error(res, "no recipe file or built-in recipe named")
    assert not (tmp_path / "out.yaml").exists()


def test_unwritable_output_is_one_line(tmp_path, monkeypatch):
    out = tmp_path / "locked" / "w.yaml"
    out.parent.mkdir()
    os_open = os.open

    def open_denied(path, *args, **kwargs):
        if Path(path) == out:
            raise _denied(out)
        return os_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", open_denied)  # what ftcli.config.safe_files.open_output calls
    res = invoke("render-workload", "--recipe", "tiny-qwen-cpu", "-o", str(out))
    assert assert_one_error(res) == f"error: cannot write {out}: Permission denied\n"
    assert not out.exists()


# ------------------------------------------------------------------------------------ register
@pytest.mark.parametrize("flag,value,shown", [
    ("--name", "a\nb", "'a\\nb': contains the control character '\\n'"),
    ("--name", "model\x1b[2J", "'model\\x1b[2J': contains the control character '\\x1b'"),
    ("--name", "a\u202eb", "'a\\u202eb': contains the control character '\\u202e'"),
    ("--name", "  ", "'  ': must not be empty"),
    ("--alias", "champ\r", "'champ\\r': contains the control character '\\r'"),
])
def test_register_names_must_be_printable(flag, value, shown, tmp_path, monkeypatch):
    import ftcli.commands.register

    monkeypatch.setattr(ftcli.commands.register, "run_register", lambda *a, **k: pytest.fail("registered"))
    name = value if flag == "--name" else "ok.model"
    alias = ["--alias", value] if flag == "--alias" else []
    stderr = assert_one_error(invoke("register", str(tmp_path), "--name", name, *alias))
    assert stderr.startswith(f"error: {flag} {shown}")


# ------------------------------------------------------------------------------------ #47 items 11, 12
def test_output_dir_naming_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("keep")
    res = runner.invoke(cli.app, ["train", "--recipe", "tiny-qwen-cpu", "--set", f"output.dir={tmp_path / 'afile'}",
                                  "--set", "tracking.enabled=false"])
    assert assert_one_error(res) == f"error: output dir {tmp_path / 'afile'} is a file; set output.dir to a directory\n"
    assert (tmp_path / "afile").read_text() == "keep"


def test_epochs_beyond_any_run_is_refused_by_the_schema():
    res = runner.invoke(cli.app, ["recipes", "show", "tiny-qwen-cpu", "--set", "training.epochs=1e300"])
    assert "training.epochs" in assert_one_error(res) and "100000" in res.stderr


@pytest.mark.parametrize("setting, problem", [
    ("model.config_overrides.hidden_size=abc", "model pkg://assets/tiny-qwen3_5.json: hidden_size is 'abc'; it must "
                                               "be a whole number >= 1 (model.config or model.config_overrides)"),
    ("model.config_overrides.hidden_size=128.5", "model pkg://assets/tiny-qwen3_5.json: hidden_size is 128.5; it must "
                                                 "be a whole number >= 1 (model.config or model.config_overrides)"),
    ("model.config=/nonexistent/config.json", "model.config /nonexistent/config.json: cannot read it (No such file or "
                                              "directory)"),
])
def test_a_config_that_builds_no_model_is_refused_alike_by_plan_doctor_and_train(setting, problem, tmp_path):
    """One validation (ftcli.estimate.shape) for the three: plan and train refuse in one line, doctor says
    `fits here: no` with the same words and exits 1 (it said `yes` and train refused 6-10 s later)."""
    plan = runner.invoke(cli.app, ["plan", "--recipe", "tiny-qwen-cpu", "--set", setting])
    assert assert_one_error(plan) == f"error: {problem}\n"
    train = runner.invoke(cli.app, ["train", "--recipe", "tiny-qwen-cpu", "--set", setting, "--set",
                                    f"output.dir={tmp_path / 'run'}", "--set", "tracking.enabled=false"])
    assert assert_one_error(train) == f"error: recipe tiny-qwen-cpu cannot run here: {problem}\n"
    assert not (tmp_path / "run").exists()
    doctor = runner.invoke(cli.app, ["doctor", "--recipe", "tiny-qwen-cpu", "--set", setting, "--json"])
    report = json.loads(doctor.stdout)
    assert doctor.exit_code == 1 and (report["fits_here"], report["fits_detail"]) == (False, problem)
