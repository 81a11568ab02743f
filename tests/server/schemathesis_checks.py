"""A schemathesis extension (loaded by SCHEMATHESIS_HOOKS in test_schema_fuzz): its
``positive_data_acceptance``, but for a chunk refused for its token count.

JSON Schema cannot state a token limit: a chunk's chat messages are bounded in number
(``maxItems``: as many empty messages as the limit holds), but each message's text may
cost any number of tokens, so a schema-valid chunk can exceed ``max_chunk_tokens`` (a
fresh seed found 17 messages of multi-byte text: 359 tokens against 256). Such a chunk
gets 400 ``chunk_too_large``, which this check accepts; and so is a chunk the session
has no room left for (400 ``context_length_exceeded``: the run's own chunks filled it,
found by ten fresh-seed runs over every route). Every other refusal of valid data still
fails it.
"""

from __future__ import annotations

from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

TOKEN_LIMIT_CODES = {"chunk_too_large", "context_length_exceeded"}


@schemathesis.check
def positive_data_acceptance_but_token_limits(ctx: Any, response: Any, case: Any) -> bool | None:
    if response.status_code == 400:
        try:
            code = response.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            code = None
        if code in TOKEN_LIMIT_CODES:
            return None
    return positive_data_acceptance(ctx, response, case)
