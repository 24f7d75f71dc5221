"""Hardware and model profiles: every shipped file loads, parameter counts match the published ones,
and each kind of bad file is refused with the file, the field and the line."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from pagedbench.bench.costmodel.hardware import HARDWARE_DIR, hardware_names, load_hardware
from pagedbench.bench.costmodel.models import MODELS_DIR, load_model, model_names
from pagedbench.bench.costmodel.profile_fields import ProfileError


def test_every_shipped_profile_loads():
    assert {"a100-40gb", "a100-80gb", "h100-sxm", "h200"} <= set(hardware_names())
    assert {"opt-13b", "llama-2-13b", "llama-3.1-8b", "llama-2-7b", "llama-2-70b"} <= set(model_names())
    for name in hardware_names():
        assert load_hardware(name).name == name
    for name in model_names():
        assert load_model(name).name == name


# Published totals (model cards / papers), in billions; our count from config.json fields must be within 1%.
KNOWN_PARAMS_B = {
    "opt-13b": 12.85, "llama-2-13b": 13.02, "llama-3.1-8b": 8.03, "llama-2-7b": 6.74,
    "llama-2-70b": 68.98, "codellama-34b": 33.74, "phi-2": 2.78, "qwen-72b": 72.29,
}


@pytest.mark.parametrize("name", sorted(KNOWN_PARAMS_B))
def test_parameter_count_matches_published(name):
    got = load_model(name).num_params / 1e9
    assert got == pytest.approx(KNOWN_PARAMS_B[name], rel=0.01)


def test_opt_mlp_is_ungated_and_llama_gated():
    # OPT-13B's two 5120x20480 matrices vs Llama-2-13B's three 5120x13824 ones, per layer.
    assert load_model("opt-13b").linear_params_per_layer == 4 * 5120 * 5120 + 2 * 5120 * 20480 + (
        3 * 5120 + 5120 + 20480 + 5120)
    assert load_model("llama-2-13b").linear_params_per_layer == 4 * 5120 * 5120 + 3 * 5120 * 13824


def test_kv_bytes_per_token_opt_13b_is_800_kib():
    # The vLLM paper's "800 KB per token": 2 (K, V) x 40 layers x 5120 x 2 bytes.
    assert load_model("opt-13b").kv_bytes_per_token == 800 * 1024


def _copy(tmp_path: Path, src_dir: Path, name: str) -> Path:
    shutil.copy(src_dir / f"{name}.yaml", tmp_path / f"{name}.yaml")
    return tmp_path / f"{name}.yaml"


def _line_of(path: Path, field: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if line.startswith(f"{field}:"))


def test_unknown_profile_names_the_known_ones():
    with pytest.raises(ProfileError, match=r"unknown profile 'a100-41gb'.*a100-40gb"):
        load_hardware("a100-41gb")


def test_missing_field_names_file_and_field(tmp_path):
    path = _copy(tmp_path, MODELS_DIR, "opt-13b")
    path.write_text("".join(l for l in path.read_text().splitlines(True) if not l.startswith("head_dim:")))
    with pytest.raises(ProfileError, match=r"opt-13b\.yaml: field 'head_dim': missing") as e:
        load_model("opt-13b", tmp_path)
    assert e.value.field == "head_dim" and e.value.path == path


@pytest.mark.parametrize(("field", "bad", "expect"), [
    ("num_hidden_layers", "-40", r"expected > 0, got -40"),
    ("num_hidden_layers", "forty", r"expected int, got str 'forty'"),
    ("num_hidden_layers", "true", r"expected int, got bool True"),  # a bool is not a count
    ("num_hidden_layers", "40.0", r"expected int, got float"),
    ("architecture", "gpt2", r"expected one of \['opt', 'llama', 'qwen', 'phi'\]"),
])
def test_bad_model_value_names_file_field_and_line(tmp_path, field, bad, expect):
    path = _copy(tmp_path, MODELS_DIR, "opt-13b")
    line = _line_of(path, field)
    path.write_text(path.read_text().replace(f"\n{field}: ", f"\n{field}: {bad} #", 1))
    with pytest.raises(ProfileError, match=rf"opt-13b\.yaml:{line}: field '{field}': {expect}") as e:
        load_model("opt-13b", tmp_path)
    assert e.value.line == line


@pytest.mark.parametrize(("field", "bad", "expect"), [
    ("bandwidth_fraction", "1.5", r"expected in \(0, 1\], got 1\.5"),
    ("bandwidth_fraction", "0", r"expected in \(0, 1\], got 0"),
    ("step_overhead_s", "-0.001", r"expected >= 0, got -0\.001"),
    ("memory_bytes", "4.0e+10", r"expected int, got float"),
    ("dense_flops_per_s", "3.12e14", r"expected float, got str '3\.12e14' \(YAML 1\.1 reads"),
    ("name", "h100-sxm", r"expected 'a100-40gb' \(the file name\), got 'h100-sxm'"),
])
def test_bad_hardware_value_names_file_field_and_line(tmp_path, field, bad, expect):
    path = _copy(tmp_path, HARDWARE_DIR, "a100-40gb")
    line = _line_of(path, field)
    path.write_text(path.read_text().replace(f"\n{field}: ", f"\n{field}: {bad} #", 1))
    with pytest.raises(ProfileError, match=rf"a100-40gb\.yaml:{line}: field '{field}': {expect}"):
        load_hardware("a100-40gb", tmp_path)


def test_unexpected_field_is_refused(tmp_path):
    # A misspelt field would otherwise leave the real one missing or, with defaults, silently unused.
    path = _copy(tmp_path, HARDWARE_DIR, "h200")
    path.write_text(path.read_text() + "bandwith_fraction: 0.8\n")
    with pytest.raises(ProfileError, match=r"field 'bandwith_fraction': unexpected field"):
        load_hardware("h200", tmp_path)


def test_profile_error_is_a_value_error():
    assert issubclass(ProfileError, ValueError)
