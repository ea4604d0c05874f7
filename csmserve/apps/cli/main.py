"""`csmserve` command line (also `python -m csmserve`): the parser and its dispatch to `speak`
(apps/cli/speak.py), `serve` (apps/cli/serve.py), `bench` (apps/cli/bench.py), `talk` (apps/talk/).
Errors (bad flags, unreadable files, a server's refusal) are one line on stderr and exit code 2.
Building the parser imports no torch and no server (`csmserve --help` stays quick).
"""
from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from csmserve.apps.common import CLIError, one_line
from csmserve.extras import MissingExtraError


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors (`csmserve speak: error: ...`) and exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    from csmserve.apps.cli.bench import add_bench_parser
    from csmserve.apps.cli.serve import run_serve
    from csmserve.apps.cli.speak import add_speak_parser
    from csmserve.apps.talk.cli import add_talk_parser
    from csmserve.server.flags import add_serve_parser

    parser = Parser(prog="csmserve", description="Streaming inference for Sesame CSM-1B.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_speak_parser(sub)
    add_serve_parser(sub).set_defaults(func=run_serve)
    add_bench_parser(sub)
    add_talk_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print(f"csmserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `csmserve speak ... -o - | head`: the reader left
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 1
    except (CLIError, ValueError, NotImplementedError, RuntimeError, OSError, MissingExtraError) as e:
        msg = one_line(e)
        print(f"csmserve {args.command}: error: {msg}", file=sys.stderr)
        return 2
