"""`ftcli merge-lora`: fold a LoRA adapter into its base (ftcli.artifacts.merge) and say how the check went."""

from __future__ import annotations

from pathlib import Path


def run_merge(adapter_dir: Path, *, base: str | None, output: Path | None, dtype: str, recipe, force: bool,
              fmt: str = "plain") -> None:
    """The CLI command: merge, verify, save, and print one summary line."""
    from rich.console import Console

    from ftcli.artifacts.merge import merge
    from ftcli.model.fallbacks import quiet_library_output

    quiet_library_output(None, "cpu")  # no progress bars or PEFT's FutureWarning around the one summary line
    out, report = merge(adapter_dir, base=base, output=output, dtype=dtype, recipe=recipe, force=force, fmt=fmt)
    Console(stderr=True).print(
        f"merged {report['adapter']} into {report['base']} -> {out}  "
        f"(check: max |merged - (base+adapter)| = {report['max_abs_diff']:.3g} over {report['probe_tokens']} probe "
        f"tokens with MoE routing pinned ({report['routing_ties']} near-tie choices replayed), tolerance "
        f"{report['tolerance']:.3g}; the adapter itself moves logits by up to {report['adapter_effect']:.3g})",
        highlight=False, soft_wrap=True,
    )
