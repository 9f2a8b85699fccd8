"""The ``tierkv`` command (``tierkv ...`` or ``python -m tierkv ...``): ``tierkv.cli`` with one step
before it. ``tierkv serve`` listens on its port before the model stack is imported (seconds), so its
clients wait for the loading server's first answer instead of being refused (``tierkv.serve.listen``)."""
from __future__ import annotations

import sys

from tierkv.errors import ConfigError


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["serve"]:
        from tierkv.serve.listen import early
        early(args[1:])
    try:
        from tierkv.cli import main as command      # (torch: seconds, in which Ctrl-C is as likely as later)
    except KeyboardInterrupt:
        print("tierkv: interrupted", file=sys.stderr)
        return 130
    except ConfigError as error:                    # a TIERKV_* variable read at import
        print(f"tierkv: error: {error}", file=sys.stderr)
        return 2
    return command(args)


if __name__ == "__main__":
    sys.exit(main())
