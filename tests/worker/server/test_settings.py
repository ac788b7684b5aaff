"""The server's settings (issue 15): no key beyond loopback unless asked for (and then warned), the weights
root defaults to the model directory."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from pydantic import ValidationError
from rollout_worker.engine.config import EngineConfig
from rollout_worker.server.app import create_app
from rollout_worker.server.settings import ServerSettings
from rollout_worker.web.middleware import is_loopback


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("[::1]", True), ("localhost", True),
     ("0.0.0.0", False), ("::", False), ("10.0.0.7", False), ("example.org", False), ("", False)],
)  # fmt: skip
def test_is_loopback(host: str, loopback: bool) -> None:
    assert is_loopback(host) is loopback


def test_a_network_address_needs_a_key_or_the_explicit_flag(tiny64: Path) -> None:
    with pytest.raises(ValidationError, match=r"0\.0\.0\.0 is not a loopback address"):
        ServerSettings(model=tiny64, host="0.0.0.0")
    assert not ServerSettings(model=tiny64, host="0.0.0.0", api_key="k").open_to_network
    assert ServerSettings(model=tiny64, host="0.0.0.0", allow_unauthenticated=True).open_to_network
    assert not ServerSettings(model=tiny64).open_to_network


def test_serving_the_network_without_a_key_is_warned(tiny64: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = EngineConfig.load(str(tiny64), 1)
    with caplog.at_level(logging.WARNING):
        create_app(ServerSettings(model=tiny64), cfg)
        assert "open to the network" not in caplog.text
        app = create_app(ServerSettings(model=tiny64, host="0.0.0.0", allow_unauthenticated=True), cfg)
    assert "listening on 0.0.0.0: every route, mutating ones included, is open to the network" in caplog.text
    assert app.state.server.weights_root == tiny64.resolve()  # not its parent
