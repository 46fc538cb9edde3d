"""Speculative decoding from the command line and in the server's metrics."""

from __future__ import annotations

import pytest

from jpaged import __main__ as cli
from jpaged.engine.protocol import EngineState
from jpaged.engine.stats import SpecDecodeCounts
from jpaged.entrypoints.metrics import EngineCollector
from tests.plugins.hf_models import transformers_answer

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def test_generate_with_speculation_prints_the_greedy_answer(tiny_llama_dir, capsys,
                                                            jpaged_logger_restored):
    prompt = "the theme in the theme in the"
    status = cli.main(["generate", "--model", str(tiny_llama_dir), "--raw", "--max-tokens",
                       "12", "--speculative-config", NGRAM, prompt])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert out == f"{transformers_answer(tiny_llama_dir, prompt, 12)}\n"


@pytest.mark.parametrize(("value", "message"), [
    ("{method: ngram}", "not JSON"), ("[1, 2]", "a JSON object"),
])
def test_a_speculative_config_that_is_not_a_json_object_is_refused(value, message, capsys):
    with pytest.raises(SystemExit):
        cli.main(["generate", "--speculative-config", value, "hi"])
    err = capsys.readouterr().err
    assert "--speculative-config" in err and message in err


def test_metrics_carry_vllms_speculative_decoding_counters():
    class Engine:
        state = EngineState(spec_decode=SpecDecodeCounts(
            num_drafts=4, num_draft_tokens=12, num_accepted_tokens=7,
            num_accepted_tokens_per_pos=[4, 2, 1]))

    families = {family.name: family for family in EngineCollector(Engine()).collect()}
    values = {name: [sample.value for sample in family.samples]
              for name, family in families.items() if "spec_decode" in name}
    assert values == {
        "jpaged:spec_decode_num_drafts": [4], "jpaged:spec_decode_num_draft_tokens": [12],
        "jpaged:spec_decode_num_accepted_tokens": [7],
        "jpaged:spec_decode_num_accepted_tokens_per_pos": [4, 2, 1]}
    labels = [s.labels for s in families["jpaged:spec_decode_num_accepted_tokens_per_pos"].samples]
    assert labels == [{"position": "0"}, {"position": "1"}, {"position": "2"}]


def test_acceptance_figures_follow_vllms_definitions():
    counts = SpecDecodeCounts()
    counts.record([(3, 3), (0, 0), (3, 1), (2, 0)])  # (proposed, accepted) per draw
    assert (counts.num_drafts, counts.num_draft_tokens, counts.num_accepted_tokens) == (3, 8, 4)
    assert counts.num_accepted_tokens_per_pos == [2, 1, 1]
    assert counts.draft_acceptance_rate == 4 / 8
    assert counts.mean_acceptance_length == 1 + 4 / 3
