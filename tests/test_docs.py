"""The README and docs/: every relative link resolves to a file or heading of the
repository, docs/results.md is what its generator makes of docs/data/, every number
on it one of theirs, and the flag and metric tables are what theirs makes of the parser
and the metrics registry, equal to --help and a server's /metrics. (The examples:
tests/test_doc_examples.py.)"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import results_page
from jpaged import reference_tables
from jpaged.__main__ import main as jpaged_main
from tests.plugins.http_server import http_request

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
HEADING = re.compile(r"^#+\s+(.*)$", re.MULTILINE)
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?")
UNIT_SCALES = (1, 100, 1000)


def json_numbers(value) -> list[float | str]:
    """Every number in a JSON value: its numbers, and the numbers written in its strings."""
    if isinstance(value, dict):
        return [x for item in value.values() for x in json_numbers(item)]
    if isinstance(value, list):
        return [x for item in value for x in json_numbers(item)]
    if isinstance(value, str):
        return NUMBER.findall(value)
    if isinstance(value, bool) or value is None:
        return []
    return [abs(value)]


def unaccounted_numbers(page: str, reports: list[tuple[Path, dict]]) -> list[str]:
    """Numbers outside the page's headings that no report holds at the shown precision,
    as it is or in the units the tables show it in (a fraction in %, seconds in ms)."""
    values = [x for _, report in reports for x in json_numbers(report)]
    written = {x for x in values if isinstance(x, str)}
    numbers = [scale * x for x in values if not isinstance(x, str) for scale in UNIT_SCALES]
    shown: dict[int, set[str]] = {}
    missing = []
    for line in page.splitlines():
        if line.startswith("#"):
            continue
        for token in NUMBER.findall(line):
            decimals = len(token.partition(".")[2])
            if decimals not in shown:
                shown[decimals] = {f"{x:.{decimals}f}" for x in numbers}
            if token not in shown[decimals] and token not in written:
                missing.append(token)
    return missing


def github_anchor(heading: str) -> str:
    """The fragment GitHub gives a heading: lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def headings(page: Path) -> set[str]:
    return {github_anchor(h) for h in HEADING.findall(FENCE.sub("", page.read_text()))}


def links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_link_resolves_to_a_file_or_heading(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        file = (page.parent / path) if path else page
        if not file.exists() or anchor and anchor not in headings(file):
            broken.append(target)
    assert broken == []


def test_the_link_check_sees_a_broken_link_and_a_missing_heading(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# One title\n[ok](#one-title) [gone](nowhere.md) [lost](#two)\n"
                    "```\n[in code](skipped.md)\n```\n")
    assert links(page) == ["#one-title", "nowhere.md", "#two"]
    assert github_anchor("Tensor and data parallelism") == "tensor-and-data-parallelism"
    assert github_anchor("`LLM()`, defaults") == "llm-defaults"


def test_the_committed_results_page_is_generated_from_docs_data():
    data = REPO / "docs" / "data"
    reports = results_page.load_reports(data)
    page = (REPO / "docs" / "results.md").read_text()
    assert page == results_page.render(reports)
    assert unaccounted_numbers(page, reports) == []


# The flag and metric tables, generated from the parser and the metrics registry
# (jpaged.reference_tables), held to --help and to a running server's /metrics.

TABLE_ROW = re.compile(r"^\| (.+?) \| (.*?) \|", re.MULTILINE)
HELP_OPTION = re.compile(r"^  (-.*?)(?:  |$)", re.MULTILINE)  # up to the help column


def generated_tables() -> dict[str, str]:
    """Each generated table on the pages, by name."""
    return {match["name"]: match["body"] for page in reference_tables.PAGES
            for match in reference_tables.REGION.finditer((REPO / page).read_text())}


def table_flags(table: str) -> set[str]:
    return {flag for cell, _ in TABLE_ROW.findall(table)
            for flag in re.findall(r"`(--?[\w-]+)", cell)}


def help_flags(command: str, capsys) -> set[str]:
    """The flags `python -m jpaged COMMAND --help` lists, --help itself left out."""
    with pytest.raises(SystemExit):
        jpaged_main([command, "--help"])
    text = capsys.readouterr().out
    return {flag for options in HELP_OPTION.findall(text)
            for flag in re.findall(r"(?<![\w-])(--?[a-z][\w-]*)", options)} - {"-h", "--help"}


def test_the_committed_tables_are_generated_from_the_parser_and_the_registry():
    for page in reference_tables.PAGES:
        text = (REPO / page).read_text()
        assert reference_tables.regenerate(text) == text, "python -m " + reference_tables.__name__
    assert sorted(generated_tables()) == sorted(reference_tables.tables())


@pytest.mark.parametrize("command", reference_tables.COMMANDS)
def test_a_command_s_tables_hold_the_flags_its_help_lists(command, capsys):
    tables = generated_tables()
    documented = table_flags(tables[f"flags {command}"]) | table_flags(tables["flags engine"])
    assert documented == help_flags(command, capsys)


@pytest.mark.full  # the server's start, a tiny model's: some 20 s
def test_the_metrics_table_holds_every_series_of_a_server_s_metrics(server):
    base_url, _ = server
    exposition = http_request(base_url, "GET", "/metrics").text
    served_types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", exposition, re.MULTILINE))
    served_series = set(re.findall(r"^([\w:]+)(?:\{.*\})? ", exposition, re.MULTILINE))
    rows = [(re.findall(r"`([\w:]+)`", series), kind)
            for series, kind in TABLE_ROW.findall(generated_tables()["metrics"])[2:]]
    # The text format's # TYPE lines: a counter's series with its _total, a histogram's
    # name, and each _created series as a gauge of its own.
    documented_types = {}
    for series, kind in rows:
        documented_types[series[0].removesuffix("_bucket")] = kind
        documented_types |= {s: "gauge" for s in series if s.endswith("_created")}
    assert documented_types == served_types
    assert served_series <= {s for series, _ in rows for s in series}
