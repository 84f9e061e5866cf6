"""Probe (#47 item 10, slow and root-only: run by hand before submitting): a DCP checkpoint save on a really full
disk. Mounts two small tmpfs (8 MiB: the first save of tiny-qwen-cpu, 14 MiB on 2 ranks, cannot fit; 20 MiB:
the save of step 2 fits, the save of step 4 does not), trains into each and unmounts them.

    sudo python scripts/probe_disk_full_checkpoint.py

Expected for each: exit code 2, exactly one `error:` line and no traceback; 8 MiB: the line says no space is left
and that there is no earlier checkpoint (run the same command again: no --resume, no --force), and nothing is
left on the disk (a failed start removes its run dir); 20 MiB: the line names step 2's checkpoint as intact and says to resume, and
checkpoints/ holds step_00000002 alone, which verifies. Prints each case's line and a verdict.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def train(out: Path, max_steps: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    args = ["train", "--recipe", "tiny-qwen-cpu", "--set", f"output.dir={out}", "--set", f"training.max_steps={max_steps}",
            "--set", "training.checkpoint.every_steps=2", "--set", "tracking.enabled=false"]
    return subprocess.run([sys.executable, "-m", "ftcli", *args], env=env, capture_output=True, text=True, timeout=600)


def case(size_mib: int, max_steps: int) -> bool:
    mount = Path(tempfile.mkdtemp(prefix=f"ftcli-full-{size_mib}m-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(mount)], check=True)
    try:
        res = train(mount / "run", max_steps)
        errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
        left = sorted(str(p.relative_to(mount)) for p in mount.rglob("*"))
        print(f"{size_mib} MiB: exit {res.returncode}; {errors}; left: {left}")
        ok = res.returncode == 2 and len(errors) == 1 and "Traceback" not in res.stderr and "No space left" in errors[0]
        if size_mib < 14:
            ok &= "there is no earlier checkpoint" in errors[0] and "run the same `ftcli train` again" in errors[0]
            ok &= "--resume" not in errors[0] and "--force" not in errors[0] and left == []
        else:
            from ftcli.train.checkpoint import list_checkpoints, verify_checkpoint

            ckpts = mount / "run" / "checkpoints"
            ok &= "step 2" in errors[0] and "is intact" in errors[0] and "--resume" in errors[0]
            ok &= sorted(p.name for p in ckpts.iterdir()) == ["step_00000002"]
            ok &= list_checkpoints(ckpts) == [ckpts / "step_00000002"]
            verify_checkpoint(ckpts / "step_00000002")  # raises when a file is not as its save wrote it
        return ok
    finally:
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    results = [case(8, 3), case(20, 5)]
    print("verdict:", "PASS" if all(results) else "FAIL")
    sys.exit(0 if all(results) else 1)
