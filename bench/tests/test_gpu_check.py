"""`make gpu-check` on a machine without a GPU: a clear refusal, nothing written; its arguments checked."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from pagedbench.bench import gpu_check

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")


def test_refuses_without_a_gpu_and_writes_nothing(tmp_path):
    run = subprocess.run([sys.executable, "-m", "pagedbench.bench.gpu_check", "--out", str(tmp_path / "gpu")],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    assert "no CUDA GPU here" in run.stdout and "nothing checked" in run.stdout
    assert not (tmp_path / "gpu").exists()


@pytest.mark.parametrize(("argv", "message"), [
    (["--budget-s", "0"], "--budget-s must be > 0"),
    (["--only", "nope"], "invalid choice: 'nope'"),
])
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        gpu_check.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_every_check_has_a_runner():
    assert set(gpu_check.RUNNERS) == set(gpu_check.CHECKS)


def test_a_check_killed_at_its_limit_keeps_what_it_printed(tmp_path):
    code = "import time; print('compiled 1 of 9', flush=True); time.sleep(30)"
    returncode, tail = gpu_check._run_logged([sys.executable, "-c", code], tmp_path / "c.log", 2)
    assert returncode is None
    assert "compiled 1 of 9" in (tmp_path / "c.log").read_text() and "killed at its 2 s limit" in tail
    returncode, tail = gpu_check._run_logged([sys.executable, "-c", "print('done')"], tmp_path / "d.log", 30)
    assert returncode == 0 and tail.strip() == "done"
