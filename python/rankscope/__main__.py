"""``python -m rankscope COMMAND``: the ``rankscope`` command that pip installed with
this package. The command is a native binary (collector, summary, report,
compare, compact, jumps, top, replay, loadgen, launch, demo); this module finds it and runs it
in this process's place, so signals and exit codes are the command's own.

Examples::

    python -m rankscope collector --out ./rankscope-out
    python -m rankscope demo --steps 100
    python -m rankscope report ./rankscope-out      # HTML page of the latest run
    python -m rankscope --help

The same command is on the PATH of the environment as ``rankscope``, which
starts faster: it does not import torch.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from importlib import metadata
from pathlib import Path
from typing import List, NoReturn, Optional


def command_path() -> Optional[Path]:
    """The ``rankscope`` binary installed with this package, or ``None``.

    It is the file the wheel put in the environment's scripts folder: found
    through the installed distribution's file list, so a ``--user`` or
    ``--prefix`` install is found as well as a venv.
    """
    try:
        files = metadata.distribution("rankscope").files or []
    except metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name == "rankscope" and file.parent.name in ("bin", "scripts"):
            path = Path(file.locate())
            if path.is_file():
                return path
    fallback = Path(sysconfig.get_path("scripts")) / "rankscope"
    return fallback if fallback.is_file() else None


def main(argv: Optional[List[str]] = None) -> NoReturn:
    args = sys.argv[1:] if argv is None else argv
    path = command_path()
    if path is None:
        print(
            "error: the rankscope command is not installed with this package: "
            "reinstall the rankscope wheel (pip install rankscope-*.whl), or `make python` "
            "in a source checkout",
            file=sys.stderr,
        )
        sys.exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(path, [str(path), *args])


if __name__ == "__main__":
    main()
