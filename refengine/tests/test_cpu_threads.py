"""torch's CPU thread count as the engine sets it (``engine/cpu_threads.py``)."""

from __future__ import annotations

import pytest
import torch
from pagedbench.refengine.engine import cpu_threads
from pagedbench.refengine.errors import InvalidArgumentError


@pytest.fixture(autouse=True)
def restore_threads(monkeypatch):
    for name in cpu_threads.THREAD_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _topology(tmp_path, cores_of_cpu: dict[int, int]):
    for cpu, core in cores_of_cpu.items():
        d = tmp_path / f"cpu{cpu}" / "topology"
        d.mkdir(parents=True)
        (d / "physical_package_id").write_text("0\n")
        (d / "core_id").write_text(f"{core}\n")
    return tmp_path


def test_smt_siblings_count_once(tmp_path):
    topo = _topology(tmp_path, {0: 0, 1: 0, 2: 1, 3: 1})
    assert cpu_threads.physical_cores([0, 1, 2, 3], topo) == 2
    assert cpu_threads.physical_cores([0, 2], topo) == 2
    assert cpu_threads.physical_cores([1], topo) == 1
    assert cpu_threads.physical_cores([0, 7], topo) == 2  # unreadable topology: every CPU a core


def test_default_lowers_to_the_usable_cores(monkeypatch):
    torch.set_num_threads(3)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: [5])
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus, *a: len(cpus))
    assert cpu_threads.configure_threads(None) == 1
    assert torch.get_num_threads() == 1


def test_default_never_raises_a_lower_count(monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(cpu_threads, "physical_cores", lambda cpus, *a: len(cpus))
    assert cpu_threads.configure_threads(None) == 1


def test_environment_setting_is_left_alone(monkeypatch):
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: [0])
    assert cpu_threads.configure_threads(None) == 2


def test_explicit_count_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(cpu_threads, "usable_cpus", lambda: [0])
    assert cpu_threads.configure_threads(2) == 2


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True])
def test_bad_count_is_refused_unchanged(bad):
    torch.set_num_threads(1)
    with pytest.raises(InvalidArgumentError, match=r"num_threads must be an int >= 1 or None, got"):
        cpu_threads.configure_threads(bad)
    assert torch.get_num_threads() == 1


def test_llm_applies_and_checks_num_threads():
    from pagedbench.refengine import LLM, load_model

    loaded = load_model(dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32))
    torch.set_num_threads(2)
    llm = LLM(loaded, num_blocks=8, block_size=4, num_threads=1)
    assert llm.num_threads == 1 and torch.get_num_threads() == 1
    llm.close()
    with pytest.raises(InvalidArgumentError, match="num_threads"):
        LLM(loaded, num_blocks=8, block_size=4, num_threads=0)
