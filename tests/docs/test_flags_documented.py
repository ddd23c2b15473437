"""Every flag of every command is in a guide (issue 45): the flags are read from click itself, so a
new flag that no guide names fails here, not in a user's hands."""

from __future__ import annotations

from pathlib import Path

import click

from rl_msprobe.cli import main

ROOT = Path(__file__).resolve().parents[2]
GUIDES = [*sorted((ROOT / "docs" / "commands").glob("*.md")), ROOT / "README.md", ROOT / "SKILL.md"]
GUIDES.append(ROOT / "docs" / "troubleshooting.md")


def commands(group: click.Command, prefix: str = "rl-msprobe") -> list[tuple[str, click.Command]]:
    """Every command under `group` (the top group loads its sub-commands on demand)."""
    out = [(prefix, group)]
    if isinstance(group, click.Group):
        ctx = click.Context(group)
        for name in group.list_commands(ctx):
            sub = group.get_command(ctx, name)
            assert sub is not None, name
            out += commands(sub, f"{prefix} {name}")
    return out


def flags() -> dict[str, list[str]]:
    """--flag -> the commands that take it (--help and the hidden ones aside)."""
    found: dict[str, list[str]] = {}
    for name, command in commands(main):
        for param in command.params:
            if not isinstance(param, click.Option) or param.hidden:
                continue
            for opt in [*param.opts, *param.secondary_opts]:
                if opt.startswith("--") and opt != "--help":
                    found.setdefault(opt, []).append(name)
    return found


def test_the_guides_exist_and_the_flags_are_read() -> None:
    assert all(g.is_file() for g in GUIDES), [str(g) for g in GUIDES if not g.is_file()]
    found = flags()
    assert {"--tree", "--python", "--mode", "--steps", "--prefill-only", "--max-dump-gib"} <= set(found)


def test_every_flag_is_in_a_guide() -> None:
    text = "\n".join(g.read_text(encoding="utf-8") for g in GUIDES)
    missing = {
        flag: where
        for flag, where in flags().items()
        if not any(
            f"{flag}{end}" in text for end in (" ", "`", "=", ",", ")", "\n", ".", ";", ":", "/", "]", "|")
        )
    }
    assert not missing, (
        "flags in no guide (docs/commands/*.md, README.md, SKILL.md, docs/troubleshooting.md): "
        + ("; ".join(f"{flag} ({', '.join(where)})" for flag, where in sorted(missing.items())))
    )
