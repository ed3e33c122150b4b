"""Read the deploy recipes the way a user's shell, systemd or kubectl would, and list what they use.

Everything is checked against the real thing: subcommands and options against the parser that
``hsd/cli.py`` builds, config keys against the sections' dataclasses (``common/run/config/sections.py``
and the drafter families'). A new subcommand or key needs no change here.

Where a recipe runs ``hsd``:
- shell scripts and sbatch files: code lines (continuations joined), with ``hsd`` or ``"$hsd_bin"``;
- systemd units: ``ExecStart=`` lines;
- Kubernetes manifests: ``command``/``args`` lists of every container;
- markdown: fenced code blocks and backtick spans.
Those are *strict*: the word after ``hsd`` must be a subcommand. Everywhere else (comments, prose,
here-documents) an ``hsd WORD`` is checked only when options or overrides follow it, so that
"(default: hsd from PATH)" is read as prose.
"""

from __future__ import annotations

import argparse
import functools
import re
import shlex
import typing
from dataclasses import dataclass
from pathlib import Path

from common.run.config import section_types
from hsd.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
SECTIONS = {name: set(typing.get_type_hints(section_type)) for name, section_type in section_types().items()}
SHELL_SUFFIXES = {".sh", ".sbatch", ".bash"}

_HSD = re.compile(r"(?:(?<![\w.$-])hsd|\"?\$\{?hsd_bin\}?\"?)[ \t]+(?=[a-z])")
_CUT = re.compile(r"[|;&#`)]")
# section.key=value anywhere, and `section.key` mentioned in markdown spans and comments
_OVERRIDE = re.compile(r"(?<![\w./@$-])([a-z_]+)\.([a-z_][a-z0-9_]*)=")
_MENTION = re.compile(r"(?<![\w./@$-])([a-z_]+)\.([a-z_][a-z0-9_]*)\b(?![.-])")


@dataclass
class Snippet:
    path: Path
    line: int
    text: str
    strict: bool  # a place where an `hsd WORD` must be a real invocation

    def where(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def deploy_files() -> list[Path]:
    return sorted(p for p in DEPLOY.rglob("*") if p.is_file())


def is_shell(path: Path) -> bool:
    if path.suffix in SHELL_SUFFIXES:
        return True
    first = path.read_text(errors="replace").split("\n", 1)[0]
    return first.startswith("#!") and first.rstrip().endswith(("sh", "bash"))


def _joined_lines(text: str) -> list[tuple[int, str]]:
    """Logical lines: backslash continuations joined, each with its first line number."""
    out, buffer, start = [], "", 0
    for number, line in enumerate(text.splitlines(), 1):
        if not buffer:
            start = number
        if line.rstrip().endswith("\\"):
            buffer += line.rstrip()[:-1] + " "
            continue
        out.append((start, buffer + line))
        buffer = ""
    if buffer:
        out.append((start, buffer))
    return out


def _shell_snippets(path: Path, text: str) -> list[Snippet]:
    snippets, heredoc_end = [], None
    for number, line in _joined_lines(text):
        stripped = line.strip()
        if heredoc_end is not None:
            if stripped == heredoc_end:
                heredoc_end = None
            else:
                snippets.append(Snippet(path, number, line, strict=False))
            continue
        if stripped.startswith("#"):
            snippets.append(Snippet(path, number, stripped.lstrip("#"), strict=False))
            continue
        marker = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", line)
        if marker:
            heredoc_end = marker.group(1)
        snippets.append(Snippet(path, number, line, strict=True))
    return snippets


def _markdown_snippets(path: Path, text: str) -> list[Snippet]:
    snippets, prose, in_fence, fence_start = [], [], False, 0
    block: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            if in_fence:
                snippets += [Snippet(path, fence_start + n, t, strict=True)
                             for n, t in _joined_lines("\n".join(block))]
                block = []
            in_fence, fence_start = not in_fence, number
            continue
        if in_fence:
            block.append(line)
        else:
            prose.append((number, line))
    # backtick spans may wrap across lines: read the prose as one text, remember line starts
    text_out = "\n".join(line for _, line in prose)
    starts = [number for number, _ in prose]
    for match in re.finditer(r"`([^`]+)`", text_out):
        line = starts[text_out.count("\n", 0, match.start())]
        snippets.append(Snippet(path, line, match.group(1).replace("\n", " "), strict=True))
    without_spans = re.sub(r"`[^`]+`", " ", text_out)
    snippets += [Snippet(path, starts[i], t, strict=False) for i, t in enumerate(without_spans.split("\n"))]
    return snippets


def _command_lists(node) -> list[list[str]]:
    """Every ``command``/``args`` list of strings in a parsed manifest."""
    found = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("command", "args") and isinstance(value, list) and all(isinstance(v, str) for v in value):
                found.append(value)
            else:
                found += _command_lists(value)
    elif isinstance(node, list):
        for item in node:
            found += _command_lists(item)
    return found


def _yaml_snippets(path: Path, text: str) -> list[Snippet]:
    import yaml
    snippets = [Snippet(path, n, line.split("#", 1)[1], strict=False)
                for n, line in enumerate(text.splitlines(), 1) if "#" in line]
    for doc in yaml.safe_load_all(text):
        for command in _command_lists(doc):
            snippets.append(Snippet(path, 0, shlex.join(command), strict=True))
    return snippets


def _unit_snippets(path: Path, text: str) -> list[Snippet]:
    snippets = []
    for number, line in _joined_lines(text):
        stripped = line.strip()
        if stripped.startswith(("#", ";")):
            snippets.append(Snippet(path, number, stripped[1:], strict=False))
        elif stripped.startswith("ExecStart"):
            snippets.append(Snippet(path, number, stripped.split("=", 1)[1], strict=True))
    return snippets


def snippets(path: Path) -> list[Snippet]:
    text = path.read_text()
    if path.suffix == ".md":
        return _markdown_snippets(path, text)
    if path.suffix in (".yaml", ".yml"):
        return _yaml_snippets(path, text)
    if path.suffix in (".service", ".target", ".timer", ".socket"):
        return _unit_snippets(path, text)
    if is_shell(path):
        return _shell_snippets(path, text)
    return [Snippet(path, n, line, strict=not line.lstrip().startswith("#"))
            for n, line in enumerate(text.splitlines(), 1)]


# -- what the parser and the config accept ----------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _commands() -> dict[str, argparse.ArgumentParser]:
    return _subparsers(build_parser())


@functools.lru_cache(maxsize=1)
def _deploy_file_names() -> frozenset[str]:
    return frozenset(p.name for p in deploy_files())


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps no public handle on its subparsers
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def config_key_problem(section: str, key: str) -> str | None:
    if section not in SECTIONS:
        return f"unknown config section {section!r} in {section}.{key}"
    if key not in SECTIONS[section]:
        return f"unknown config key {section}.{key}"
    return None


def invocation_problems(snippet: Snippet) -> list[str]:
    """Problems of every `hsd ...` invocation in one snippet."""
    problems = []
    commands = _commands()
    for match in _HSD.finditer(snippet.text):
        rest = _CUT.split(snippet.text[match.end():], 1)[0]
        try:
            tokens = shlex.split(rest)
        except ValueError:  # an unbalanced quote of the surrounding shell line
            tokens = rest.split()
        if not tokens or not re.fullmatch(r"[a-z][a-z0-9-]*", tokens[0]):
            continue  # `-g hsd deploy/...`: the user hsd, not the command
        has_args = any(t.startswith("--") or _OVERRIDE.match(t) for t in tokens[1:])
        if not (snippet.strict or has_args):
            continue
        name = tokens[0]
        if name not in commands:
            problems.append(f"{snippet.where()}: 'hsd {name}' is not a subcommand "
                            f"(known: {', '.join(sorted(commands))})")
            continue
        parser, args = commands[name], tokens[1:]
        nested = _subparsers(parser)
        if nested and args and not args[0].startswith("-"):
            if args[0] not in nested:
                problems.append(f"{snippet.where()}: 'hsd {name} {args[0]}' is not a subcommand "
                                f"(known: {', '.join(sorted(nested))})")
                continue
            parser, args = nested[args[0]], args[1:]
        options = set(parser._option_string_actions)
        for token in args:
            if "$" in token:
                continue  # a shell variable: its value is checked where it is set
            if token.startswith("--"):
                option = token.split("=", 1)[0]
                if option not in options:
                    problems.append(f"{snippet.where()}: 'hsd {name}' has no option {option}")
            elif "=" in token and "." in token.split("=", 1)[0]:
                dotted = token.split("=", 1)[0]
                if dotted.count(".") != 1:
                    problems.append(f"{snippet.where()}: override {token!r} is not section.key=value")
                elif problem := config_key_problem(*dotted.split(".")):
                    problems.append(f"{snippet.where()}: {problem}")
    return problems


def key_problems(snippet: Snippet) -> list[str]:
    """`section.key=` overrides anywhere, and `section.key` mentions of a known section."""
    problems = []
    pattern = _MENTION if snippet.strict or snippet.path.suffix != ".md" else _OVERRIDE
    file_names = _deploy_file_names()  # `run.sh` names a script, not the key sh of section run
    for match in pattern.finditer(snippet.text):
        section, key = match.groups()
        if f"{section}.{key}" in file_names:
            continue
        if section in SECTIONS and key not in SECTIONS[section]:
            problems.append(f"{snippet.where()}: unknown config key {section}.{key}")
    return problems
