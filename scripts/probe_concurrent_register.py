"""Probe (#47 item 7, slow: run by hand before submitting): N concurrent `ftcli register <run> --name m --alias prod`
(no --force) on a NEW sqlite store, as N users would start them at once.

    python scripts/probe_concurrent_register.py [N=3]

Expected: every process exits 0 or 2 (no traceback: a new store's first use is serialized), exactly one of
them says it set the alias, every other one says in one line that another register holds it, and the
alias points at the version of the one that said it set it. Prints one line per process and a verdict.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def make_run(root: Path) -> Path:
    from transformers import AutoTokenizer

    import torch

    from ftcli.config.recipe import load_recipe, resolve_path
    from ftcli.model.build import load_model

    run = root / "run"
    torch.manual_seed(0)
    recipe = load_recipe("tiny-qwen-cpu")
    load_model(recipe.model).save_pretrained(run / "final")
    AutoTokenizer.from_pretrained(resolve_path("pkg://assets/tokenizer-qwen")).save_pretrained(run / "final")
    base = {"id": None, "revision": None, "init": "random", "model_type": "qwen3_5_text", "model_class": "causal_lm"}
    (run / "run.json").write_text(json.dumps({"ftcli_version": "0", "method": "full", "recipe": recipe.to_dict(),
                                              "model_dir": "final", "base_model": base, "status": "completed"}))
    return run


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    root = Path(tempfile.mkdtemp(prefix="ftcli-probe-register-"))
    run = make_run(root)
    uri = f"sqlite:///{root / 'new.db'}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    cmd = [sys.executable, "-m", "ftcli", "register", str(run), "--name", "m", "--alias", "prod", "--json",
           "--tracking-uri", uri]
    procs = [subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(n)]
    results = [(p.wait(timeout=900), p.stdout.read(), p.stderr.read()) for p in procs]
    set_by = []
    for k, (rc, out, err) in enumerate(results):
        if rc == 0:
            version = json.loads(out)["version"]
            set_by.append(version)
            print(f"register {k}: exit 0, set prod -> version {version}")
        else:
            last = err.strip().splitlines()[-1] if err.strip() else ""
            print(f"register {k}: exit {rc}, {'TRACEBACK ' if 'Traceback' in err else ''}{last}")
    from mlflow import MlflowClient

    alias = MlflowClient(uri, registry_uri=uri).get_model_version_by_alias("m", "prod").version
    tracebacks = sum("Traceback" in err for _, _, err in results)
    ok = tracebacks == 0 and len(set_by) == 1 and set_by[0] == str(alias) and all(rc in (0, 2) for rc, _, _ in results)
    print(f"alias prod -> version {alias}; {len(set_by)} said they set it; {tracebacks} tracebacks: "
          f"{'OK' if ok else 'FAIL'}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
