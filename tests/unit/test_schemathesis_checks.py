"""The fuzzing check's exceptions (tests/http/schemathesis_checks.py): each refusal of
schema-valid data it accepts is one no JSON Schema can prevent, and nothing else.
Oracle: the rules as its docstring states them, on hand-made errors."""

from __future__ import annotations

from pathlib import Path

from tests.http.schemathesis_checks import refusal_no_schema_can_prevent

INT64_MAX = 2**63 - 1


def error(message: str, param: str | None = None, code: str = "invalid_request") -> dict[str, str | None]:
    return {"message": message, "type": "invalid_request_error", "param": param, "code": code}


def test_a_value_beyond_a_stated_bound_by_exact_comparison_is_accepted() -> None:
    over = error(f"priority: Input should be less than or equal to {INT64_MAX}", "priority")
    assert refusal_no_schema_can_prevent(over, {"priority": 2**63 + 191})
    # Within the bound exactly: the refusal would be the server's fault.
    assert not refusal_no_schema_can_prevent(over, {"priority": INT64_MAX})
    nested = error(f"tokens.0: Input should be less than or equal to {INT64_MAX}", "tokens.0")
    assert refusal_no_schema_can_prevent(nested, {"tokens": [2**64]})
    under = error("seed: Input should be greater than or equal to -5", "seed")
    assert refusal_no_schema_can_prevent(under, {"seed": -6}) and not refusal_no_schema_can_prevent(under, {"seed": -5})
    assert not refusal_no_schema_can_prevent(over, {"other": 2**70})  # the param names nothing in the body


def test_token_limits_missing_objects_and_prompt_bounds_are_accepted() -> None:
    assert refusal_no_schema_can_prevent(error("too long", "input", "chunk_too_large"), {})
    assert refusal_no_schema_can_prevent(error("not found", "previous_response_id", "previous_response_not_found"), {})
    assert refusal_no_schema_can_prevent(error("No tool call found", "input", "tool_call_not_found"), {})
    unmatched = "The tool specified in `tool_choice` does not match any of the specified `tools`"
    assert refusal_no_schema_can_prevent(error(unmatched, "tool_choice", "invalid_request"), {})
    assert refusal_no_schema_can_prevent(
        error("bad_words entries must tokenize to at least one token.", "bad_words", "400"), {}
    )
    assert refusal_no_schema_can_prevent(error("No item with id '0' in this list.", "after", "invalid_value"), None)
    assert refusal_no_schema_can_prevent(error("must be within the prompt", "routed_experts_prompt_start", "400"), {})
    # Anthropic's error shape: no param, no code.
    removal = {"type": "BadRequestError", "message": "tool_removal references tool 'f', which is not declared in tools"}
    assert refusal_no_schema_can_prevent(removal, {})
    too_long = {"type": "BadRequestError", "message": "This model's maximum context length is 2048 tokens. However,"}
    assert refusal_no_schema_can_prevent(too_long, {})


def test_rules_inside_strings_or_between_fields_are_accepted() -> None:
    assert refusal_no_schema_can_prevent(
        error("Invalid structured_outputs structural_tag specification.", "structured_outputs"), {}
    )
    assert refusal_no_schema_can_prevent(error("Value error, thinking.budget_tokens must be less than max_tokens"), {})
    # Fuzzing (2026-12-04, EPYC), seven of nine no-parser seeds: a batch's structured output with its json
    # as a string that is no JSON Schema (the schema takes a string there: vLLM does).
    assert refusal_no_schema_can_prevent(error("Invalid JSON grammar specification."), {})


def test_every_other_refusal_still_fails_the_check() -> None:
    assert not refusal_no_schema_can_prevent(error("max_tokens: Input should be a valid integer", "max_tokens"), {})
    assert not refusal_no_schema_can_prevent(error("bad", "after", "invalid_request"), None)
    assert not refusal_no_schema_can_prevent(error("Model is required", "model"), {"model": ""})
    # A rule the schema now states is no exception (it was, until the eleventh round).
    assert not refusal_no_schema_can_prevent(
        error("when using `logprob_token_ids`, `logprobs` must be set to true.", "logprob_token_ids"), {}
    )


def test_a_negative_case_whose_body_fits_the_schema_is_judged_as_sent() -> None:
    # schemathesis's shrinker can leave a "negative" body the schema takes (its issue
    # #4332): a fresh seed reported such a conversation as accepted schema-violating data.
    from types import SimpleNamespace

    from tests.http.schemathesis_checks import body_fits_schema

    raw = {
        "components": {
            "schemas": {"Part": {"type": "object", "properties": {"type": {"enum": ["text"]}}, "required": ["type"]}}
        }
    }
    definition = {
        "requestBody": {
            "content": {
                "application/json": {"schema": {"type": "array", "items": {"$ref": "#/components/schemas/Part"}}}
            }
        }
    }
    operation = SimpleNamespace(definition=SimpleNamespace(raw=definition), schema=SimpleNamespace(raw_schema=raw))
    assert body_fits_schema(SimpleNamespace(operation=operation, body=[{"type": "text"}]))
    assert not body_fits_schema(SimpleNamespace(operation=operation, body=[{"type": "image"}]))
    assert not body_fits_schema(SimpleNamespace(operation=operation, body=object()))  # nothing sent as JSON


def test_the_fuzz_summary_groups_findings_over_runs(tmp_path: Path) -> None:
    """scripts/fuzz_summary.py on JUnit reports written as schemathesis writes them: one
    refusal found with different values in two runs is one finding of 2/2 runs; an
    accepted request is grouped by its status alone; a run without a report is named."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fuzz_summary", Path(__file__).parents[2] / "scripts/fuzz_summary.py")
    assert spec is not None and spec.loader is not None
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)

    def case(check: str, status: int, body: str) -> str:
        return (
            f"1. Test Case ID: x\n\n- {check}\n\n    Valid data should have been accepted\n\n"
            f"[{status}] Bad Request:\n\n    `{body}`\n\nReproduce with:\n\n    curl ..."
        )

    for seed, value in (("11", "4.6e+16"), ("22", "-7.5")):
        run = tmp_path / f"seed-{seed}"
        run.mkdir()
        refused = case("ST202 Schema-valid request rejected", 400, f'{{"message": "got {value}", "param": \'t\'}}')
        accepted = case("ST201 Schema-violating request accepted", 200, f'{{"id": "resp_{seed}"}}')
        (run / "junit-1.xml").write_text(
            '<testsuites><testsuite><testcase name="POST /invocations"><failure type="failure" message="ST202">'
            f'{refused}</failure></testcase><testcase name="POST /v1/responses"><failure>{accepted}</failure>'
            "</testcase></testsuite></testsuites>"
        )
    (tmp_path / "seed-33").mkdir()
    (tmp_path / "seed-33" / "junit-2.xml").write_text("")  # stopped before its report was written
    found = summary.findings(tmp_path)
    assert found[
        ("POST /invocations", "ST202 Schema-valid request rejected", '[400] {"message": "got #", "param": \'…\'}')
    ] == {"11", "22"}
    assert found[("POST /v1/responses", "ST201 Schema-violating request accepted", "[200] ")] == {"11", "22"}
    assert [key for key in found if key[0] == "(no report)"] and len(found) == 3
