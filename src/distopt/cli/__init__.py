"""The ``distopt`` command: ``distopt train | bench | memory | export | convert``.

Each subcommand lives in its own module and is imported only when used, so ``distopt memory``
starts instantly and a broken optional dependency of one command cannot break the others.
A command that needs the ``train`` extra checks for it before its module is imported.
"""

from __future__ import annotations

import importlib
import sys

from .._extras import BENCH_NEEDS, TRAIN_NEEDS, require
from .._version import DISTRIBUTION, __version__

# subcommand -> (module, function taking argv and returning an exit code, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str, str]] = {}
# subcommand -> the packages of the train extra it imports
NEEDS: dict[str, tuple[str, ...]] = {}


def register(
    name: str, module: str, function: str, help_line: str, needs: tuple[str, ...] = ()
) -> None:
    SUBCOMMANDS[name] = (module, function, help_line)
    NEEDS[name] = needs


register("train", "distopt.train.launch", "main", "train the demo GPT on several ranks",
         needs=TRAIN_NEEDS)
register("bench", "distopt.bench", "main", "benchmark distopt against DDP, ZeRO and FSDP2",
         needs=BENCH_NEEDS)
register("memory", "distopt.cli.memory_command", "main", "bytes per parameter and GiB per rank")
register("export", "distopt.cli.export", "main", "checkpoint -> plain PyTorch file")
register("convert", "distopt.cli.convert", "main", "DeepSpeed/Megatron-Core checkpoint -> DCP")


def _usage() -> str:
    lines = ["usage: distopt <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {help_line}" for name, (_, _, help_line) in SUBCOMMANDS.items()]
    lines += ["", "distopt <command> --help shows a command's options;",
              "distopt --version shows the version."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"distopt {__version__} ({DISTRIBUTION})")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"distopt: unknown command '{name}'\n\n{_usage()}", file=sys.stderr)
        return 2
    require(f"distopt {name}", NEEDS[name])
    module, function, _ = SUBCOMMANDS[name]
    return int(getattr(importlib.import_module(module), function)(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
