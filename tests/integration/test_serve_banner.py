"""What ``met serve`` prints on start works as printed: the ``met top`` line watches its embedded Redis."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.integration.deployments import running_serve
from tests.integration.processes import MET, met_environment

pytestmark = pytest.mark.slow


def test_the_printed_met_top_command_watches_the_served_fleet(tmp_path: Path, model_settings: dict[str, str]) -> None:
    with running_serve(tmp_path, settings=model_settings) as endpoint:
        banner = (tmp_path / "serve.log").read_text()
        command = re.search(r"watch it: (met top --redis redis://\S+)", banner)
        assert command is not None, banner
        assert command.group(1).split()[-1] in banner.split("embedded Redis")[1], "the banner names the same Redis"
        args = [str(MET), *command.group(1).split()[1:], "--once"]
        environment = met_environment({}, torch_threads=1)
        shown = subprocess.run(args, env=environment, capture_output=True, text=True, timeout=60)
    assert shown.returncode == 0, shown.stderr
    assert endpoint.model in shown.stdout
    assert "1 live of 1" in shown.stdout
