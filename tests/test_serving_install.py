"""The launcher refuses an environment whose numpy the wheel's Python backend stub cannot run
with, before anything starts (under numpy 2 the stub corrupts every text input)."""

from __future__ import annotations

import pytest

from engine.serving import cli, install


def test_stub_numpy_check() -> None:
    install.check_stub_numpy("1.26.4")
    with pytest.raises(install.StubNumpyError, match=r"numpy 2\.5\.2.*numpy<2"):
        install.check_stub_numpy("2.5.2")
    install.check_stub_numpy()  # this venv's own numpy (pinned below 2 by nvidia-pytriton)


def test_launcher_reports_the_numpy_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def refuse() -> None:
        install.check_stub_numpy("2.0.0")

    monkeypatch.setattr(cli, "find_tritonserver", refuse)
    assert cli.main(["--check"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: this environment has numpy 2.0.0")
