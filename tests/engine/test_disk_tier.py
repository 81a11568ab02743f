"""The disk tier (connectors/disk_tier.py): a session's KV survives an engine restart.

Sessions run and close on one engine (our tail store puts their whole context in the
host tier, and the disk tier writes it through); a second engine on the same directory
then resumes each one as the session service does, with a new request whose prompt is
the transcript plus a chunk. After a restart the device cache and the host tier are
empty, so every cached token of that request came from the disk tier.

Oracle: float32, token for token against a recompute on the restarted engine, salted and
with prefix-cache reads off (``generate_once(recompute=True)``), so it can read none of
the files under test. Negative control: a session's file replaced by another session's
(whole, its checksum valid) makes its answer differ from the recompute.

Then another checkpoint of the same shape in the model's place (its weights replaced in
the same directory, as an updated checkpoint is): vLLM's block hashes do not cover the
weights, and vLLM's file layout names the model by its path, so only the tier's
namespace (a weights fingerprint) keeps the new model from loading the old one's KV. It
must get no hit at all (with the fingerprint left out it gets every block).
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import pytest

from app.engine import flush_disk_tier
from connectors.disk_files import HEADER, whole_file
from tests.conftest import make_settings
from tests.helpers import generate_once, random_tokens, run_streaming_session, started_engine

pytestmark = pytest.mark.engine

BLOCK = 32  # the test engine's block size
CHUNKS = [120, 90, 70]  # a session's chunks, 16 tokens answered after each


def tier_files(root: Path) -> dict[Path, int]:
    return {path: path.stat().st_mtime_ns for path in root.rglob("*.bin")}


async def flushed_files(engine: Any, root: Path, count: int) -> dict[Path, int]:
    """The files once the engine has flushed its disk tier (as a graceful stop does):
    at least ``count`` of them."""
    await flush_disk_tier(engine)
    files = tier_files(root)
    assert len(files) >= count, (len(files), count)
    return files


def replace_checkpoint(model_dir: Path) -> None:
    """Every weight changed a little, in place: same config, shapes and tokenizer."""
    from safetensors.torch import load_file, save_file

    for path in model_dir.glob("*.safetensors"):
        save_file({name: tensor * 1.01 for name, tensor in load_file(path).items()}, path, metadata={"format": "pt"})


async def test_a_restarted_engine_resumes_sessions_from_disk(tmp_path: Path) -> None:
    tier_dir, model_dir = tmp_path / "tier", tmp_path / "model"
    shutil.copytree(make_settings().resolved_model(), model_dir)  # a copy of its own, replaced at the end
    settings = make_settings(disk_tier_gib=0.25, disk_tier_dir=str(tier_dir), model=str(model_dir))
    rng = random.Random(7)
    contexts: list[list[int]] = []
    files_of: list[list[Path]] = []  # each session's files, oldest first
    async with started_engine(settings) as engine:
        for _ in range(3):
            before = tier_files(tier_dir)
            chunks = [random_tokens(rng, n) for n in CHUNKS]
            context, _ = await run_streaming_session(engine, chunks, max_tokens=16)
            after = await flushed_files(engine, tier_dir, len(before) + len(context) // BLOCK)
            contexts.append(context)
            files_of.append(sorted(set(after) - set(before), key=after.__getitem__))

    # The first session as written; the second with one file corrupted (a byte of its KV
    # flipped); the third with one file replaced by another session's, whole: the negative control.
    # (Not two of its own files swapped: attention sums over its keys in any order, so
    # a session's blocks swapped give it the same answer.)
    corrupted = files_of[1][3]
    data = bytearray(corrupted.read_bytes())
    data[HEADER.size + 100] ^= 0xFF
    corrupted.write_bytes(bytes(data))
    files_of[2][2].write_bytes(files_of[0][2].read_bytes())

    async with started_engine(settings) as engine:
        answers = []
        for context in contexts:
            prompt = context + random_tokens(rng, 40)
            resumed = await generate_once(engine, prompt, max_tokens=16)
            recompute = await generate_once(engine, prompt, max_tokens=16, recompute=True)
            answers.append((resumed.num_cached_tokens, resumed.outputs[0].token_ids, recompute.outputs[0].token_ids))

    whole = [len(context) // BLOCK * BLOCK for context in contexts]
    (hit_1, ours_1, recompute_1), (hit_2, ours_2, recompute_2), (hit_3, ours_3, recompute_3) = answers
    # Every block of the session from disk, and the session's own answer.
    assert hit_1 == whole[0] and ours_1 == recompute_1
    # The corrupted file is a miss (its checksum fails, it is deleted): the hit stops
    # at the block before it, the rest is computed, and the answer is still right.
    assert hit_2 == 3 * BLOCK and ours_2 == recompute_2
    assert not corrupted.exists() or whole_file(corrupted.read_bytes())  # deleted, or written again whole
    # Negative control: the other session's file loads whole, and the oracle sees the wrong KV.
    assert hit_3 == whole[2]
    assert ours_3 != recompute_3, "another session's KV went unnoticed by the recompute oracle"
    assert len(os.listdir(tier_dir)) == 1  # one namespace directory

    replace_checkpoint(model_dir)
    async with started_engine(settings) as engine:
        answer = await generate_once(engine, contexts[0] + random_tokens(rng, 40), max_tokens=4)
        # Its files written before the engine stops (queued writes die with a killed engine,
        # and with them its namespace directory: a CI run saw one directory here).
        await flush_disk_tier(engine)
    assert answer.num_cached_tokens == 0, "another checkpoint's engine loaded the first model's KV"
    assert len(os.listdir(tier_dir)) == 2  # its own namespace beside the first
