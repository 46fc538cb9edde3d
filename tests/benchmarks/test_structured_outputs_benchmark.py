"""benchmarks.structured_outputs --quick: every section runs and reports what it should;
the schemas' instances are valid and their grammars accept them token by token."""

from __future__ import annotations

import json

import jsonschema
import pytest

from benchmarks import structured_outputs

# A benchmark run: the full tier.
pytestmark = pytest.mark.full


@pytest.mark.parametrize("case", structured_outputs.SCHEMAS, ids=lambda case: case.name)
def test_each_instance_is_valid_against_its_schema(case):
    jsonschema.validate(case.instance, case.schema)


@pytest.mark.default_model  # SmolLM2's tokenizer drives the random model's grammars
def test_quick_run_reports_every_section():
    report = structured_outputs.main(["--quick"])
    json.loads(json.dumps(report, allow_nan=False))
    assert set(report["throughput"]) == {"batch_1", "batch_4"}
    for batch in report["throughput"].values():
        assert batch["same_token_counts"]
        assert batch["schema_tokens_per_s"]["median"] > 0
        assert batch["plain_tokens_per_s"]["median"] > 0
        assert batch["fill_ms_per_step"] > 0
        assert 0 <= batch["schema_outputs_valid"] <= batch["requests"]
    overlap = report["overlap"]
    for key in ("plain_step_ms", "in_line_step_ms", "overlapped_step_ms", "fill_ms_in_line"):
        assert overlap[key] > 0
    schemas = report["fill"]["smollm2"]["schemas"]
    assert list(schemas) == [case.name for case in structured_outputs.SCHEMAS[:3]]
    for row in schemas.values():
        assert row["instance_walks"]
        assert row["batch_4_us_per_row"]["max"] >= row["batch_4_us_per_row"]["median"] > 0
    assert set(report["fill_share_of_step"]["smollm2"]) == set(schemas)
    assert "load_average_end" in report["machine"]


@pytest.mark.default_model
def test_quick_plain_only_run():
    report = structured_outputs.main(["--quick", "--plain-only"])
    assert report["plain"]["output_tokens_per_s"]["median"] > 0
    assert "throughput" not in report
