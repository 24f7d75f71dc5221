"""The studies' progress bars: drawn on a terminal only, and never with PAGEDBENCH_NO_PROGRESS set."""

from __future__ import annotations

import io

import pytest
from pagedbench.bench.common.progress import NO_PROGRESS_ENV, progress_enabled


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(("stream", "env", "shown"), [
    (Terminal(), None, True),
    (Terminal(), "0", True),
    (Terminal(), "1", False),
    (Terminal(), "yes", False),
    (io.StringIO(), None, False),  # a log file or a pipe
    (object(), None, False),  # something without isatty
])
def test_progress_enabled(monkeypatch, stream, env, shown):
    if env is None:
        monkeypatch.delenv(NO_PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(NO_PROGRESS_ENV, env)
    assert progress_enabled(stream) is shown


def test_default_stream_is_stderr(monkeypatch, capsys):
    monkeypatch.delenv(NO_PROGRESS_ENV, raising=False)
    assert progress_enabled() is False  # pytest captures stderr: not a terminal
    monkeypatch.setattr("sys.stderr", Terminal())
    assert progress_enabled() is True
