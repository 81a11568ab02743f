"""Jump-forward over a required call's opening: the text a tool-call grammar forces
before the model has anything to choose, prefilled with the turn instead of decoded a
token a step. No FastAPI here.

With ``tool_choice`` required or a named function, vLLM's grammar (a structural tag)
admits only outputs that open a call: for the default model's Hermes format,
``<tool_call>\\n{"name": "lookup", "arguments": `` when one function can be called. Decoded,
that is about fifteen steps, each a pass over the whole context that can only pick the
one token the grammar leaves; appended to the turn's input, it is computed in the
prefill that the turn runs anyway, and the grammar then takes the reply from where the
opening ends (SGLang's jump-forward decoding does the same within a request). The text
the client receives is the same as if decoded, call for call; only the opening's
tokenization is the tokenizer's own rather than one picked under the grammar, which is
what the chat template renders for the call in the next turn anyway.

Only where the grammar fixes a prefix: a ``tag``, or ``tags_with_separator`` needing at
least one tag with nothing between tags. Where vLLM admits two spellings of a call (its
Hermes grammar takes the form without the newline too), the first one, the template's,
is the one opened. Other grammars (``auto``'s triggered tags, JSON arrays) are kept.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

SPELLING_DIVERGES = 1  # characters past the tags' shared prefix that tell their spellings apart
WORD_END = re.compile(r"\w+$")


def forced_opening(grammar: Any) -> tuple[Any, str]:
    """The grammar for the rest of a reply, and the opening it no longer decodes ("": the
    grammar as given). Whitespace that ends the forced text stays with the grammar:
    tokenizers join it to the word after it, so it is decoded with that word."""
    structural = getattr(grammar, "structural_tag", None)
    if not structural:
        return grammar, ""
    spec = json.loads(structural)
    form = spec.get("format") if spec.get("type") == "structural_tag" else None
    rest, opening = _rest_after_opening(form) if isinstance(form, dict) else (None, "")
    if rest is None or not opening:
        return grammar, ""
    return dataclasses.replace(grammar, structural_tag=json.dumps({**spec, "format": rest})), opening


def _rest_after_opening(form: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    if form.get("type") == "tag":
        opening = form["begin"].rstrip()
        return {**form, "begin": form["begin"][len(opening) :]}, opening
    if (
        form.get("type") != "tags_with_separator"
        or not form.get("at_least_one")
        or form.get("separator")
        or not form.get("tags")
        or any(tag.get("type") != "tag" for tag in form["tags"])
    ):
        return None, ""
    tags = form["tags"]
    shared = _shared_begin(tags)
    first = tags[0]["begin"]
    if len(first) > len(shared):  # several spellings: the first tag's alone is opened
        spelling = first[: len(shared) + SPELLING_DIVERGES]
        tags = [tag for tag in tags if tag["begin"].startswith(spelling)]
        shared = _shared_begin(tags)
    opening = _before_last_word(shared, tags)
    # The call the opening began, then (parallel calls) any more, in every spelling.
    opened = {
        **form,
        "tags": [{**tag, "begin": tag["begin"][len(opening) :]} for tag in tags],
        "stop_after_first": True,
    }
    if form.get("stop_after_first"):
        return opened, opening
    return {"type": "sequence", "elements": [opened, {**form, "at_least_one": False}]}, opening


def _before_last_word(shared: str, tags: list[dict[str, Any]]) -> str:
    """The forced text, cut where a tokenizer would cut it: before trailing whitespace,
    and before a word the tags go on to finish differently (two functions named
    ``get_…``: the name is the model's to decode whole, not ``get_`` and its rest)."""
    opening = shared.rstrip()
    if any(len(tag["begin"]) > len(opening) and WORD_END.match(tag["begin"][len(opening)]) for tag in tags):
        opening = WORD_END.sub("", opening).rstrip()
    return opening


def _shared_begin(tags: list[dict[str, Any]]) -> str:
    """The longest text every tag's ``begin`` starts with."""
    begins = [tag["begin"] for tag in tags]
    low, high = min(begins), max(begins)  # what the least and the greatest share, all share
    length = next((at for at, (a, b) in enumerate(zip(low, high, strict=False)) if a != b), len(low))
    return low[:length]
