"""What a scripts/fuzz-schema run found, over all its seeds, grouped: one line per
(operation, failed check, status and message of the answer), with the number of runs it
came up in and one seed to replay it with. Reads each run's JUnit report.

    python scripts/fuzz_summary.py REPORT_DIR
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path

# A failure's text: "- ST202 Schema-valid request rejected", then "[400] Bad Request:" and
# the answer's body in backquotes (schemathesis's JUnit report).
CHECK = re.compile(r"^- (ST\d+ [^\n]*|[A-Z][^\n]*)$", re.M)
ANSWER = re.compile(r"^\[(\d{3})\][^\n]*\n\s*\n\s*`(.*?)`\s*$", re.M | re.S)


def normalized(body: str) -> str:
    """An answer's text with what varies from case to case (numbers, quoted names) blanked,
    so that one refusal found with different values is one finding."""
    body = re.sub(r"'[^']*'", "'…'", re.sub(r"\s+", " ", body))
    return re.sub(r"-?\d+(\.\d+)?(e[+-]?\d+)?", "#", body)[:160]


def findings(report: Path) -> dict[tuple[str, str, str], set[str]]:
    """(operation, check, answer) -> the seeds of the runs that found it. An accepted
    request's answer is its status alone (its body names a new object each time)."""
    found: dict[tuple[str, str, str], set[str]] = defaultdict(set)
    for junit in sorted(report.rglob("junit-*.xml")):
        seed = junit.parent.name.removeprefix("seed-")
        try:
            cases = list(ET.parse(junit).getroot().iter("testcase"))
        except ET.ParseError:  # a run that was stopped before its report was written
            found[("(no report)", str(junit), "")].add(seed)
            continue
        for case in cases:
            for failure in [*case.iter("failure"), *case.iter("error")]:
                text = failure.text or failure.attrib.get("message", "")
                for block in re.split(r"\n(?=\d+\. Test Case ID)", text):
                    check = CHECK.search(block)
                    answer = ANSWER.search(block)
                    accepted = answer is not None and answer.group(1).startswith("2")
                    body = normalized(answer.group(2)) if answer and not accepted else ""
                    status = f"[{answer.group(1)}] " if answer else ""
                    found[(case.attrib.get("name", "?"), check.group(1) if check else "?", status + body)].add(seed)
    return found


def main() -> None:
    report = Path(sys.argv[1])
    runs = len(list(report.rglob("junit-*.xml")))
    found = findings(report)
    print(f"{runs} runs, {len(found)} distinct findings" + (":" if found else ""))
    for (operation, check, answer), seeds in sorted(found.items(), key=lambda item: -len(item[1])):
        print(f"  {len(seeds)}/{runs} runs  {operation}  {check}  {answer}  (replay: SEED={min(seeds)})")


if __name__ == "__main__":
    main()
