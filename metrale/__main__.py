"""``python -m metrale``: the ``met`` command, for an environment whose scripts are not on ``PATH``."""

from metrale.cli.main import app

app(prog_name="met")
