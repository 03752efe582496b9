"""scripts/eval_quality.py: a served cluster's perplexity equals transformers' on the same
token windows."""
import math

import pytest

from tests.scripts import load_script

eval_quality = load_script("eval_quality")


@pytest.mark.parametrize("num_tokens, window, stride", [(10, 4, 3), (11, 4, 3), (10, 4, 1), (2, 8, 7), (300, 128, 64)])
def test_windows_score_every_token_but_the_first_once(num_tokens, window, stride):
    spans = eval_quality.windows(num_tokens, window, stride)
    scored = [token for span in spans for token in range(span.end - span.scored, span.end)]
    assert scored == list(range(1, num_tokens))
    for span in spans:
        assert span.end - span.begin <= window and span.scored <= span.end - span.begin - 1


def test_the_served_perplexity_equals_transformers(tiny_model_dir, capsys):
    pytest.importorskip("transformers")
    args = eval_quality.parse_args(["--model", str(tiny_model_dir), "--max-tokens", "300", "--window", "128",
                                    "--compare-hf", "--profile", "tiny-cpu"])
    report = eval_quality.evaluate(args)
    assert report["text_tokens"] == 300 and report["scored_tokens"] == 299 and report["windows"] == 3
    for name in ("baton_ppl", "hf_ppl"):
        assert math.isfinite(report[name]) and report[name] > 1
    assert report["relative_difference"] < 0.01
    assert report["max_token_nll_difference"] < 1e-3  # float32 on both sides: the same numbers
