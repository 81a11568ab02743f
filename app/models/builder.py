"""Build the embedded models: small random-weight Llamas with a byte-level BPE tokenizer
(and, through ``app.models.smollm2``, the real default model).

Nothing is downloaded. Each preset is built deterministically from this file and
``tokenizer_corpus.txt`` into a cache directory whose name carries a hash of both,
so a change to either builds a fresh copy and an unchanged tree reuses the old one.

The weights are random: the text these models write is meaningless. They exist so
that the server, the tests and the benchmarks run on any machine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.models import smollm2

logger = logging.getLogger(__name__)

_HERE = Path(__file__).resolve().parent
CORPUS_PATH = _HERE / "tokenizer_corpus.txt"
EOS_TOKEN = "<|endoftext|>"
# A minimal chat template so /v1/chat/completions works on the embedded model.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@dataclass(frozen=True)
class ModelPreset:
    """Shape of one embedded model."""

    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    dtype: str
    # Larger than the usual 0.02 so greedy decoding does not collapse to one token.
    init_std: float = 0.08
    seed: int = 0


PRESETS: dict[str, ModelPreset] = {
    # Random weights, for the tests of mechanics: starts in seconds, about 400 tok/s on one core.
    "tiny": ModelPreset(
        name="tiny",
        hidden_size=256,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=512,
        vocab_size=1024,
        max_position_embeddings=8192,
        dtype="bfloat16",
    ),
    # For benchmarks: large enough that compute, not Python overhead, dominates
    # (137M parameters, 12 KiB of KV per token in bf16).
    "bench": ModelPreset(
        name="bench",
        hidden_size=1024,
        num_layers=12,
        num_heads=16,
        num_kv_heads=4,
        intermediate_size=2816,
        vocab_size=1024,
        max_position_embeddings=8192,
        dtype="bfloat16",
    ),
}


def default_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "streaming-sessions" / "models"


def _fingerprint(preset: ModelPreset) -> str:
    digest = hashlib.sha256()
    digest.update(Path(__file__).read_bytes())
    digest.update(CORPUS_PATH.read_bytes())
    digest.update(json.dumps(asdict(preset), sort_keys=True).encode())
    return digest.hexdigest()[:16]


def model_dir_for(preset_name: str, cache_dir: Path | None = None) -> Path:
    preset = PRESETS[preset_name]
    return (cache_dir or default_cache_dir()) / f"{preset.name}-{_fingerprint(preset)}"


def ensure_model(preset_name: str = "tiny", cache_dir: Path | None = None) -> Path:
    """Return the directory of the preset's model, building (or converting) it on first use."""
    if preset_name == smollm2.PRESET_NAME:
        return smollm2.ensure_smollm2(cache_dir or default_cache_dir())
    if preset_name not in PRESETS:
        known = sorted([*PRESETS, smollm2.PRESET_NAME])
        raise ValueError(f"unknown model preset {preset_name!r}; known: {known}")
    target = model_dir_for(preset_name, cache_dir)
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build next to the target and rename, so concurrent builders never see half a model.
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        _build(PRESETS[preset_name], staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            # Another process finished first; its copy is identical.
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("built embedded model %r at %s", preset_name, target)
    return target


def _build_tokenizer(vocab_size: int):  # -> PreTrainedTokenizerFast
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([CORPUS_PATH.read_text()], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=EOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )


def randomize(model: Any, seed: int, std: float) -> None:
    """Seeded random weights, drawn in the parameters' sorted order: normal with ``std``,
    norms at 1."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def _build(preset: ModelPreset, out_dir: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = _build_tokenizer(preset.vocab_size)
    # The model may only produce ids the tokenizer can decode, so the two sizes match
    # (the small corpus yields fewer merges than preset.vocab_size asks for).
    vocab_size = len(tokenizer)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        max_position_embeddings=preset.max_position_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        tie_word_embeddings=False,
        dtype=preset.dtype,
    )
    model = LlamaForCausalLM(config)
    randomize(model, preset.seed, preset.init_std)
    model = model.to(getattr(torch, preset.dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    (out_dir / "EMBEDDED_MODEL.md").write_text(
        f"# Embedded model `{preset.name}`\n\n"
        "Random weights, built locally by app/models/builder.py. Its text is meaningless.\n"
    )
