"""The ``tierkv`` command (``tierkv ...`` or ``python -m tierkv ...``): ``tierkv.cli`` with one step
before it. ``tierkv serve`` listens on its port before the model stack is imported (seconds), so its
clients wait for the loading server's first answer instead of being refused (``tierkv.serve.listen``)."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        from tierkv.serve.listen import early
        early(args[1:])
    from tierkv.cli import main as command
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
