"""Every benchmark's --quick run, in one process (the test suite's smoke run).

    python -m benchmarks.smoke --out DIR [NAME ...]

The runs share their engines and servers where the settings are the same
(``benchmarks.common.pooled``): each benchmark alone starts vLLM two or three times,
which on 2 cores costs more than the quick run itself. They run in the order below,
so that those with the same settings follow each other. Each writes its JSON and PNG
into DIR as it would alone; DIR/smoke.json then records, per benchmark, the result's
path or the error that ended it (one benchmark's failure does not stop the others).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import time
import traceback
from pathlib import Path
from typing import Any

from benchmarks.common import pooled

# bf16 first (resume's in-process engine, our server and vLLM's are the next four's),
# then float32 (models' in-process engine is transport's, transport's server
# transport_paired's); chunk_timeline, soak and capacity start servers of their own
# settings, moved_resume two engines of its own; disk_index, idle_hop and admission run no engine.
QUICK = (
    "resume",
    "concurrency",
    "park_resume",
    "store",
    "tier_reuse",
    "models",
    "transport",
    "transport_paired",
    "chunk_timeline",
    "soak",
    "capacity",
    "moved_resume",
    "disk_index",
    "idle_hop",
    "admission",
)


async def run_all(names: list[str], out: Path) -> dict[str, Any]:
    index: dict[str, Any] = {}
    with pooled():
        for name in names:
            module = importlib.import_module(f"benchmarks.{name}")
            result_name, args = module.parse_args(["--quick", "--out", str(out)])
            start = time.monotonic()
            try:
                await module.run(result_name, args)
            except Exception:
                index[name] = {"error": traceback.format_exc()}
            else:
                index[name] = {"result": str(out / f"{result_name}.json")}
            index[name]["seconds"] = round(time.monotonic() - start, 1)
            print(name, index[name], flush=True)
    return index


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="where the results go")
    parser.add_argument("names", nargs="*", metavar="NAME", help=f"some of: {', '.join(QUICK)} (default: all)")
    args = parser.parse_args()
    if unknown := set(args.names) - set(QUICK):
        parser.error(f"no quick run named {', '.join(sorted(unknown))}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    index = asyncio.run(run_all(args.names or list(QUICK), out))
    (out / "smoke.json").write_text(json.dumps(index, indent=2))
    print(out / "smoke.json")


if __name__ == "__main__":
    main()
