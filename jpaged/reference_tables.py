"""The command line's flags and the server's metrics as Markdown tables, generated into the
pages that show them from the parser and the metrics registry, as docs/results.md is from
its data: a flag or a metric cannot be added without its row.

    python -m jpaged.reference_tables      # rewrites the tables in docs/

A page marks each table it shows with a pair of comments, and the rest of it is prose:

    <!-- generated: flags serve -->
    | flag | default | meaning |
    ...
    <!-- end generated -->

The tables: `flags generate`, `flags chat` and `flags serve` (each command's own flags),
`flags engine` (the flags all three take) and `metrics` (every series `GET /metrics` serves).
"""

from __future__ import annotations

import argparse
import re
import sys
import types
from collections.abc import Callable
from pathlib import Path

from jpaged.__main__ import _parser

PAGES = (Path("docs/cli.md"), Path("docs/serving.md"))
COMMANDS = ("generate", "chat", "serve")
REGION = re.compile(r"(<!-- generated: (?P<name>[\w ]+) -->\n)(?P<body>.*?)"
                    r"(<!-- end generated -->)", re.DOTALL)


def documented_actions(command: argparse.ArgumentParser) -> list[argparse.Action]:
    """A command's arguments and flags as --help lists them, --help itself left out."""
    return [a for a in command._actions if not isinstance(a, argparse._HelpAction)
            and a.help != argparse.SUPPRESS]


def engine_flags(commands: dict[str, argparse.ArgumentParser]) -> list[argparse.Action]:
    """The flags every command takes (the engine's), in the first command's order."""
    shared = set.intersection(*({a.dest for a in documented_actions(c) if a.option_strings}
                                for c in commands.values()))
    first = next(iter(commands.values()))
    return [a for a in documented_actions(first) if a.dest in shared and a.option_strings]


def own_flags(name: str, commands: dict[str, argparse.ArgumentParser]) -> list[argparse.Action]:
    """A command's arguments and the flags not every command takes."""
    shared = {a.dest for a in engine_flags(commands)}
    return [a for a in documented_actions(commands[name]) if a.dest not in shared]


def flag_table(actions: list[argparse.Action], prog: str) -> str:
    rows = ["| flag | default | meaning |", "| --- | --- | --- |"]
    for action in actions:
        rows.append(f"| {_flag_cell(action)} | {_default_cell(action)} | "
                    f"{_cell(_meaning(action, prog))} |")
    return "\n".join(rows) + "\n"


def _flag_cell(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{(action.metavar or action.dest).upper()} ...`" if action.nargs == "+" else \
            f"`{(action.metavar or action.dest).upper()}`"
    takes_value = action.nargs != 0
    metavar = action.metavar or (None if action.choices else action.dest.upper())
    long, *others = sorted(action.option_strings, key=lambda s: -len(s))
    first = f"{long} {metavar}" if takes_value and metavar else long
    return ", ".join(f"`{s}`" for s in (first, *others))


def _default_cell(action: argparse.Action) -> str:
    default = action.default
    if action.nargs == 0 and default is False:  # a switch, off unless given
        return "off"
    if default is None or default == [] or not action.option_strings:
        return ""
    return f"`{default}`"


def _meaning(action: argparse.Action, prog: str) -> str:
    help_text = action.help or ""
    if "%" in help_text:  # argparse's own expansion of %(default)s and the like
        help_text = help_text % {**vars(action), "prog": prog}
    if action.choices and action.nargs != 0:
        choices = ", ".join(f"`{c}`" for c in action.choices)
        help_text = f"{help_text} (one of {choices})" if help_text else f"one of {choices}"
    if action.option_strings and action.default == [] and action.nargs is None:
        help_text += " (repeatable)" if "repeatable" not in help_text else ""
    return help_text


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def metric_families() -> list:
    """Every metric family the server's registry serves, each labelled one with a sample
    (so that its label names show), read from an idle engine's state."""
    from jpaged.engine.protocol import EngineState
    from jpaged.engine.stats import LoRACounts, SpecDecodeCounts
    from jpaged.entrypoints.metrics import ServerMetrics

    state = EngineState(kv_group_blocks_used=(0,), mode_fallbacks={"any": 0},
                        spec_decode=SpecDecodeCounts(num_accepted_tokens_per_pos=[0]),
                        lora=LoRACounts(running={"any": 0}, waiting={"any": 0}))
    metrics = ServerMetrics(types.SimpleNamespace(state=state))
    return list(metrics.registry.collect())


def metric_table(families: list) -> str:
    rows = ["| series | type | labels | meaning |", "| --- | --- | --- | --- |"]
    for family in families:
        series = list(dict.fromkeys(sample.name for sample in family.samples))
        labels = list(dict.fromkeys(label for sample in family.samples
                                    for label in sample.labels if label != "le"))
        rows.append(f"| {', '.join(f'`{s}`' for s in series)} | {family.type} | "
                    f"{', '.join(f'`{label}`' for label in labels)} | "
                    f"{_cell(family.documentation)} |")
    return "\n".join(rows) + "\n"


def tables() -> dict[str, Callable[[], str]]:
    """Each table a page may hold, by the name its comment gives."""
    parser = _parser()
    commands = parser.commands
    made: dict[str, Callable[[], str]] = {
        f"flags {name}": (lambda name=name: flag_table(own_flags(name, commands),
                                                       commands[name].prog))
        for name in COMMANDS}
    made["flags engine"] = lambda: flag_table(engine_flags(commands), parser.prog)
    made["metrics"] = lambda: metric_table(metric_families())
    return made


def regenerate(page: str, made: dict[str, Callable[[], str]] | None = None) -> str:
    """The page with every generated table made again from the code."""
    made = tables() if made is None else made

    def table(match: re.Match) -> str:
        name = match["name"]
        if name not in made:
            raise ValueError(f"no generated table {name!r}; the tables are "
                             f"{', '.join(sorted(made))}")
        return match[1] + made[name]() + match[4]

    return REGION.sub(table, page)


def main(argv: list[str] | None = None) -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
    made = tables()
    for page in PAGES:
        page.write_text(regenerate(page.read_text(), made))
        print(f"wrote {page}", file=sys.stderr)


if __name__ == "__main__":
    main()
