"""Every command the documents show exists as typed: `nemo-fp4qat ...` lines parse with the CLI's own
parser (and every subcommand is documented), `make` targets exist, example scripts exist. The NeMo-Run
commands are run as typed (dry run) in tests/nemo/test_nemo_run.py, which takes its list from here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "docs" / "architecture.md",
    ROOT / "docs" / "configuration.md",
    ROOT / "examples" / "README.md",
    ROOT / "examples" / "Dockerfile",
    ROOT / "benchmarks" / "RESULTS.md",
    *sorted((ROOT / "conf").rglob("*.yaml")),
    *sorted((ROOT / "examples").glob("*.py")),
]
# a command in backticks, or a shell line in a code block / comment ("#   nemo llm ...", "$ make demo")
COMMAND = re.compile(r"(?:`|^[#$ ]*)((?:nemo-fp4qat\b|nemo llm\b|make\b|python examples/)[^`\n]*?)(?:`|\\?$)", re.M)
PLACEHOLDERS = {"EXPORT_DIR": "runs/demo/export", "HF_DIR": "hf", "STATE": "state.pt", "DIR": "d", "F": "key.txt",
                "N": "2", "A": "acct", "P": "part"}  # fmt: skip


def documented(prefix: str) -> list[tuple[str, str]]:
    """(document, command) for every documented command starting with ``prefix``."""
    out = []
    for doc in DOCS:
        for m in COMMAND.finditer(doc.read_text()):
            cmd = " ".join(m.group(1).split("#")[0].split())  # a trailing shell comment is not typed
            if cmd.startswith(prefix):
                out.append((str(doc.relative_to(ROOT)), cmd))
    return sorted(set(out))


def _argv(cmd: str) -> list[str]:
    cmd = re.sub(r"\[[^\]]*\]", " ", cmd)  # optional parts
    argv = []
    for tok in cmd.split()[1:]:
        tok = tok.split("|")[0]  # first of the alternatives
        argv.append(PLACEHOLDERS.get(tok, tok))
    return argv


CLI = documented("nemo-fp4qat")


def test_documents_show_commands():
    assert len(CLI) >= 8 and documented("make demo") and documented("nemo llm finetune")


@pytest.mark.parametrize("doc,cmd", CLI, ids=[c for _, c in CLI])
def test_nemo_fp4qat_command_parses_as_typed(doc, cmd):
    from nemo_fp4qat.cli import build_parser

    argv = _argv(cmd)
    if len(argv) <= 1:  # a name in prose (`nemo-fp4qat serve`): the subcommand must exist
        (sub,) = [a for a in build_parser()._actions if a.__class__.__name__ == "_SubParsersAction"]
        assert not argv or argv[0] in sub.choices, f"{doc} names `{cmd}`, which is not a subcommand"
        return
    try:
        build_parser().parse_args(argv)
    except SystemExit as e:
        pytest.fail(f"{doc} shows `{cmd}`, which the CLI rejects (exit {e.code}; argv {argv})")


def test_every_subcommand_is_documented():
    from nemo_fp4qat.cli import build_parser

    parser = build_parser()
    (sub,) = [a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"]
    shown = {_argv(c)[0] for _, c in CLI if _argv(c)}
    assert set(sub.choices) <= shown, f"undocumented: {set(sub.choices) - shown}"


def test_the_parser_rejects_what_is_not_there():
    """The check above can fail: a misspelt flag or subcommand exits."""
    from nemo_fp4qat.cli import build_parser

    for argv in (["demo", "--qad-stpes", "3"], ["evaluate"], ["serve"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)


@pytest.mark.parametrize("doc,cmd", documented("make"), ids=[c for _, c in documented("make")])
def test_make_targets_exist(doc, cmd):
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    assert cmd.split()[1] in targets, f"{doc} shows `{cmd}`, but the Makefile has no such target"


@pytest.mark.parametrize("doc,cmd", documented("python examples/"), ids=[c for _, c in documented("python examples/")])
def test_example_scripts_exist(doc, cmd):
    assert (ROOT / cmd.split()[1]).is_file(), f"{doc} shows `{cmd}`"
