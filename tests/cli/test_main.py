"""The ``met`` command itself: help that loads nothing heavy, switches shown as switches, ``--version``,
log lines kept out of interactive output, and the curl ``met serve`` prints."""

from __future__ import annotations

import itertools
import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from metrale.cli.help_format import reflowed
from metrale.cli.main import app, configure_logging
from metrale.cli.serve_cmd import _announce

runner = CliRunner()

COMMANDS = [
    [],
    ["serve"],
    ["chat"],
    ["generate"],
    ["gateway"],
    ["worker"],
    ["batch-runner"],
    ["batch"],
    ["batch", "submit"],
    ["batch", "status"],
    ["batch", "list"],
    ["batch", "cancel"],
    ["batch", "download"],
    ["fleet"],
    ["fleet", "up"],
    ["bench"],
    ["top"],
    ["model"],
    ["model", "init-tiny"],
    ["model", "inspect"],
]
HEAVY_MODULES = [
    "torch",
    "transformers",
    "httpx",
    "fastapi",
    "uvicorn",
    "redis",
    "textual",
    "metrale.worker",
    "metrale.gateway",
    "metrale.top",
]


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "met" for c in COMMANDS])
def test_help_loads_no_heavy_module(command: list[str]) -> None:
    """``met … --help`` imports only typer, rich and the command modules (a fresh interpreter)."""
    script = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from metrale.cli.main import app\n"
        f"result = CliRunner().invoke(app, {[*command, '--help']!r})\n"
        "assert result.exit_code == 0, result.output\n"
        f"print(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "met" for c in COMMANDS])
def test_help_shows_switches_without_a_type(command: list[str]) -> None:
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "160"}, terminal_width=160)
    assert result.exit_code == 0, result.output
    assert "<bool>" not in result.output
    assert "--help" in result.output


def test_option_types_are_still_shown() -> None:
    result = runner.invoke(app, ["worker", "--help"], env={"COLUMNS": "160"}, terminal_width=160)
    assert "<int>" in result.output and "<path>" in result.output


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert (result.exit_code, result.output.strip()) == (0, f"met {version('metrale')}")


def test_python_dash_m_runs_met() -> None:
    """``python -m metrale`` is ``met`` (a fresh interpreter, as a user without the script on PATH)."""
    done = subprocess.run([sys.executable, "-m", "metrale", "--version"], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout.strip()) == (0, f"met {version('metrale')}"), done.stderr
    usage = subprocess.run([sys.executable, "-m", "metrale", "--help"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 0 and "Usage: met " in usage.stdout, usage.stderr


@pytest.fixture
def restored_logging() -> Iterator[None]:
    """The levels as a ``met`` process starts them, restored after: a library the test session imports can
    set its own logger's level (litellm, imported by tests/clients, sets ``httpx`` to WARNING)."""
    loggers = [logging.getLogger(name) for name in ("", "metrale", "httpx")]
    levels = [logger.level for logger in loggers]
    loggers[2].setLevel(logging.NOTSET)
    yield
    for logger, level in zip(loggers, levels, strict=True):
        logger.setLevel(level)


@pytest.mark.usefixtures("restored_logging")
@pytest.mark.parametrize(
    ("verbose", "interactive", "library_info", "own_info", "own_debug"),
    [
        (False, True, False, False, False),  # met chat / bench / generate: warnings only
        (False, False, False, True, False),  # servers: Metrale's INFO lines, libraries' warnings
        (True, True, True, True, True),  # -v: everything
    ],
    ids=["interactive", "server", "verbose"],
)
def test_log_levels(verbose: bool, interactive: bool, library_info: bool, own_info: bool, own_debug: bool) -> None:
    configure_logging(verbose=verbose, interactive=interactive)
    assert logging.getLogger("httpx").isEnabledFor(logging.INFO) is library_info
    assert logging.getLogger("metrale.worker.kernels").isEnabledFor(logging.INFO) is own_info
    assert logging.getLogger("metrale.cli").isEnabledFor(logging.DEBUG) is own_debug


def _printed_curl(capsys: pytest.CaptureFixture[str], *, auth: bool) -> str:
    _announce("127.0.0.1", 8000, "metrale-tiny", None, auth=auth, builtin=True)
    return capsys.readouterr().err


def test_the_printed_curl_is_valid_json_without_keys(capsys: pytest.CaptureFixture[str]) -> None:
    printed = _printed_curl(capsys, auth=False)
    assert "Authorization" not in printed and "MET_API_KEY" not in printed
    body = json.loads(printed.split("-d '", 1)[1].rsplit("'", 1)[0])
    assert body["model"] == "metrale-tiny" and body["messages"][0]["role"] == "user"
    assert "toy model" in printed


def test_with_keys_the_curl_sends_the_key_from_the_environment(capsys: pytest.CaptureFixture[str]) -> None:
    printed = _printed_curl(capsys, auth=True)
    assert '-H "Authorization: Bearer $MET_API_KEY"' in printed
    assert "export MET_API_KEY=" in printed


def _description(help_text: str) -> list[list[str]]:
    """The paragraphs (lists of rendered lines) between a help page's usage line and its first box."""
    lines = help_text.splitlines()
    start = next(i for i, line in enumerate(lines) if "Usage:" in line) + 1
    end = next(i for i, line in enumerate(lines) if line.startswith("╭"))
    paragraphs: list[list[str]] = [[]]
    for line in lines[start:end]:
        if line.strip():
            paragraphs[-1].append(line.rstrip())
        elif paragraphs[-1]:
            paragraphs.append([])
    return [paragraph for paragraph in paragraphs if paragraph]


@pytest.mark.parametrize("command", COMMANDS, ids=[" ".join(c) or "met" for c in COMMANDS])
def test_help_prose_fills_an_80_column_terminal(command: list[str]) -> None:
    """The docstrings are written at ~110 columns; each paragraph's lines are joined before typer wraps
    them, so no line of a paragraph ends early (a ragged 'else an' / 'in-process fakeredis' break)."""
    result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"}, terminal_width=80)
    assert result.exit_code == 0
    for paragraph in _description(result.output):
        for line, following in itertools.pairwise(paragraph):
            next_word = following.split()[0]
            assert len(line) + 1 + len(next_word) > 76, f"{line!r} had room for {next_word!r}:\n{result.output}"


def test_reflowed_keeps_paragraphs_list_items_and_indented_lines() -> None:
    text = """First line
    goes on here.

    - an item
      that goes on
    - another
        indented code
    last words"""
    assert reflowed(text) == (
        "First line goes on here.\n\n- an item that goes on\n- another\n    indented code last words"
    )
