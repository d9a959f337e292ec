"""``python -m rankscope COMMAND``: the ``rankscope`` command from the package, so a
Python user has one install. It runs the same Rust code as the ``rankscope``
binary: ``collector``, ``summary``, ``report``, ``compare``, ``jumps``,
``replay``, ``loadgen`` and ``launch``.

Examples::

    python -m rankscope collector --out ./rankscope-out
    python -m rankscope summary --out ./rankscope-out
    python -m rankscope report ./rankscope-out      # HTML page of the latest run
    python -m rankscope --help
"""

import sys


def main() -> int:
    from . import _native

    try:
        _native.cli(["rankscope", *sys.argv[1:]])
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
