"""The correctness harness's verdict (tests/correctness/harness.py ``Report.passed``): a
float32 mismatch whose recompute had its two likeliest tokens within NEAR_TIE_MARGIN is a
near-tie, tolerated up to MAX_NEAR_TIE_RATE of comparisons; any other mismatch fails the
run at once. Oracle: the rule as docs/correctness.md states it, on hand-made reports."""

from __future__ import annotations

from tests.correctness.harness import MAX_NEAR_TIE_RATE, NEAR_TIE_MARGIN, Mismatch, Report, _margin


def mismatch(margin: float | None) -> Mismatch:
    return Mismatch(
        "prefix", session=0, chunk=1, prompt_tokens=64, expected=[1, 2], got=[1, 3], position=1, margin=margin
    )


def report(*margins: float | None, compared: int = 200) -> Report:
    return Report(
        seed=0,
        chunks_checked=compared // 2,
        prefix_requests_compared=compared - compared // 2,
        mismatches=[mismatch(m) for m in margins],
    )


def test_the_margin_is_between_the_two_likeliest_tokens() -> None:
    assert _margin([-2.5, -0.25, -1.0]) == 0.75
    assert _margin([-0.1]) == float("inf")  # one candidate: no tie possible


def test_a_near_tie_within_the_rate_passes_and_is_reported() -> None:
    tolerated = int(MAX_NEAR_TIE_RATE * 200)
    run = report(*[NEAR_TIE_MARGIN / 2] * tolerated)
    assert run.passed and len(run.near_ties) == tolerated and not run.failures
    assert len(run.summary()["near_ties"]) == tolerated


def test_near_ties_above_the_rate_fail() -> None:
    assert not report(*[NEAR_TIE_MARGIN / 2] * (int(MAX_NEAR_TIE_RATE * 200) + 1)).passed


def test_a_mismatch_with_a_clear_margin_fails_at_once() -> None:
    # The seed bug's smallest margin was 0.0026 (docs/correctness.md): it must fail.
    run = report(0.0026)
    assert not run.passed and run.failures and not run.near_ties
    assert not report(NEAR_TIE_MARGIN).passed  # the threshold itself is not a near-tie


def test_a_mismatch_without_a_measured_margin_fails() -> None:
    # The device oracle (bf16) measures none: every mismatch there is a failure.
    assert not report(None).passed
    assert report().passed
