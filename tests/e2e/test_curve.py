"""The control plane over TCP with CURVE: keys from `hsd keys`, a run over loopback TCP, and the
clients the dispatcher refuses at the handshake (a key it does not allow, no CURVE at all)."""

from __future__ import annotations

import pytest

from common.wire import messages
from common.wire.client import DispatcherClient, DispatcherUnavailable
from common.run.config import Config, ConfigError
from common.wire.curve import CurveClient, client_from_config, key_pair, public_key, server_from_config
from hsd_testing import (assert_exactly_once, curve_args, free_port, hsd, report, running_hsd, sim_args,
                         wait_for_stats)


@pytest.fixture
def keys(tmp_path):
    out = tmp_path / "keys"
    printed = hsd("keys", "--out", str(out), "--name", "node-a", "--name", "intruder").stdout
    assert "server_public_key: " in printed and str(out / "node-a.key") in printed
    return out


def test_key_config_errors_name_the_key(keys):
    config = Config()
    config.curve.server_public_key = str(keys / "dispatcher.key")
    with pytest.raises(ConfigError, match="curve.client_secret_key"):
        client_from_config(config.curve)
    config.curve.client_secret_key = str(keys / "node-a.key")  # a public key only: no pair in it
    with pytest.raises(ConfigError, match="holds only a public key"):
        client_from_config(config.curve)
    config.curve.server_secret_key = str(keys / "node-a.key_secret")
    with pytest.raises(ConfigError, match="not the public half"):
        server_from_config(config.curve)
    config.curve.server_secret_key = str(keys / "dispatcher.key_secret")
    with pytest.raises(ConfigError, match="curve.allowed_client_keys"):
        server_from_config(config.curve)
    config.curve.allowed_client_keys = [str(keys / "missing.key")]
    with pytest.raises(ConfigError, match="no key file"):
        server_from_config(config.curve)
    config.curve.allowed_client_keys = [str(keys)]  # a directory: every .key file in it
    server = server_from_config(config.curve)
    assert len(server.allowed) == 3
    z85 = public_key(str(keys / "node-a.key"), what="test").decode()
    assert public_key(z85, what="test") == key_pair(str(keys / "node-a.key_secret"), what="test")[0]


def test_run_over_tcp_with_curve_refuses_unknown_keys(run_dir, tmp_path, keys):
    control, stats_port = free_port(), free_port()
    args = sim_args(run_dir, "run.epochs=1", "data.synthetic_samples=80", "target.count=1", "drafter.count=1",
                    "target.sim_cost_per_token=1e-4", *curve_args(keys, control, stats_port))
    with running_hsd("launch", *args, log_path=tmp_path / "launch.log") as launch:
        # hsd stats reads the run's config, and with it this node's key pair
        first = wait_for_stats(run_dir, lambda s: s if len(s["workers"]) == 2 else None, 120,
                               what="both workers registered over CURVE")
        assert first["auth"]["mechanism"] == "curve" and first["auth"]["refused"] == 0
        server = public_key(str(keys / "dispatcher.key"), what="test")
        intruder = CurveClient(server, *key_pair(str(keys / "intruder.key_secret"), what="test"))
        for endpoint in (f"tcp://127.0.0.1:{control}", f"tcp://127.0.0.1:{stats_port}"):
            for curve in (intruder, None):  # a key the dispatcher does not allow; no CURVE at all
                client = DispatcherClient(endpoint, timeout_s=1.5, curve=curve)
                try:
                    with pytest.raises(DispatcherUnavailable):
                        client.call(messages.Stats())
                finally:
                    client.close()
        auth = wait_for_stats(run_dir, lambda s: s["auth"] if s["auth"]["refused"] >= 2
                              and s["auth"]["handshakes_failed"] >= 4 else None, 30,
                              what="the refused handshakes counted")
        assert auth["accepted"] >= 3  # target, drafter, and the stats reads of this test
        assert "keys refused" in hsd("stats", "--run-dir", str(run_dir)).stdout
        assert launch.wait(timeout=240) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    assert "not in curve.allowed_client_keys" in (run_dir / "logs" / "dispatcher.log").read_text()
    assert_exactly_once(report(run_dir))


def test_non_loopback_tcp_needs_curve_or_a_secret(run_dir):
    proc = hsd("dispatcher", *sim_args(run_dir, "dispatcher.endpoint=tcp://0.0.0.0:1"), check=False, timeout=60)
    assert proc.returncode == 2 and "CURVE keys" in proc.stderr
