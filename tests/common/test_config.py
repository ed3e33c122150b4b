"""common.run.config: defaults, YAML + overrides, validation errors naming the key, resolved round trip."""

import json
import typing
from pathlib import Path

import pytest
import yaml

from common.run.config import (RESOLVED_CONFIG_NAME, Config, ConfigError, DispatcherSection, PoolSection, coerce,
                               describe, load_config, load_run_config, parse_override, section_types, write_resolved)
from common.run.config.fields import key_types
from drafter_worker.dflash.section import DFlashSection


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    """Relative paths resolve against the cwd: keep them inside the test's own directory."""
    monkeypatch.chdir(tmp_path)


def write_yaml(path: Path, doc) -> Path:
    path.write_text(yaml.safe_dump(doc) if not isinstance(doc, str) else doc)
    return path


# -- defaults -------------------------------------------------------------------------------------

def test_defaults_load_and_validate(tmp_path):
    config = load_config()
    assert config.schedule.buckets == [128, 256, 512, 1024, 2048, 4096]
    assert config.schedule.tokens_per_batch == 8192
    assert config.schedule.order == "interleave"
    assert config.pool.pull == "deficit"
    assert config.pool.min_ready < config.pool.slots
    assert config.dispatcher.exit_when_done is True
    assert isinstance(config.dispatcher.lease_s, float)
    # the default run dir is relative and comes back absolute
    assert Path(config.run.dir).is_absolute()
    assert Path(config.run.dir) == (tmp_path / "runs" / "demo").resolve()
    assert config.data.lengths == "" and config.data.path == ""


def test_default_endpoints_live_in_the_run_dir():
    config = load_config()
    assert config.control_endpoint == f"ipc://{Path(config.run.dir) / 'control.sock'}"
    assert config.stats_endpoint == f"ipc://{Path(config.run.dir) / 'stats.sock'}"
    config = load_config(overrides=["dispatcher.endpoint=tcp://127.0.0.1:5555"])
    assert config.control_endpoint == "tcp://127.0.0.1:5555"


# -- file + overrides -----------------------------------------------------------------------------

def test_yaml_file_then_overrides(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {
        "run": {"epochs": 3, "seed": 7},
        "schedule": {"buckets": [64, 128, 256], "tokens_per_batch": 1024, "order": "shuffle"},
        "pool": {"slots": 8, "min_ready": 2},
        "target": None,  # an empty section is allowed
    })
    config = load_config(path, ["schedule.buckets=[1,2]", "schedule.tokens_per_batch=4",
                                "dispatcher.exit_when_done=false", "dispatcher.lease_s=60",
                                "target.sim_cost_per_token=0", "pool.pull=random"])
    assert config.run.epochs == 3 and config.run.seed == 7
    assert config.schedule.buckets == [1, 2]          # the override wins over the file
    assert config.schedule.tokens_per_batch == 4
    assert config.schedule.order == "shuffle"         # the file wins over the default
    assert config.pool.slots == 8 and config.pool.min_ready == 2
    assert config.pool.pull == "random"
    assert config.dispatcher.exit_when_done is False
    assert config.dispatcher.lease_s == 60.0 and type(config.dispatcher.lease_s) is float
    assert config.target.sim_cost_per_token == 0.0 and type(config.target.sim_cost_per_token) is float
    # untouched keys keep their defaults
    assert config.pool.target_credits == Config().pool.target_credits


def test_yaml_float_given_as_int_in_file(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", {"dispatcher": {"heartbeat_s": 1, "worker_timeout_s": 10}})
    config = load_config(path)
    assert type(config.dispatcher.heartbeat_s) is float and config.dispatcher.heartbeat_s == 1.0
    assert config.dispatcher.worker_timeout_s == 10.0


def test_empty_yaml_file_gives_defaults(tmp_path):
    path = write_yaml(tmp_path / "c.yaml", "")
    assert load_config(path) == load_config()


@pytest.mark.parametrize("text, expected", [
    ("pool.slots=8", ("pool", "slots", 8)),
    ("schedule.buckets=[1, 2]", ("schedule", "buckets", [1, 2])),
    ("dispatcher.exit_when_done=true", ("dispatcher", "exit_when_done", True)),
    ("dispatcher.lease_s=1.5", ("dispatcher", "lease_s", 1.5)),
    ("run.dir=", ("run", "dir", "")),
    ("dispatcher.endpoint=tcp://1.2.3.4:5=6", ("dispatcher", "endpoint", "tcp://1.2.3.4:5=6")),
])
def test_parse_override(text, expected):
    assert parse_override(text) == expected


@pytest.mark.parametrize("text", ["pool.slots", "slots=3", "a.b.c=1", "pool.slots=[1,"])
def test_parse_override_rejects(text):
    with pytest.raises(ConfigError):
        parse_override(text)


# -- errors name the key --------------------------------------------------------------------------

@pytest.mark.parametrize("overrides, key", [
    (["nosuch.x=1"], "nosuch"),
    (["pool.nosuch=1"], "pool.nosuch"),
    (["pool.slots=abc"], "pool.slots"),
    (["pool.slots=true"], "pool.slots"),            # a bool is not an integer
    (["pool.slots=2.5"], "pool.slots"),
    (["dispatcher.lease_s=soon"], "dispatcher.lease_s"),
    (["dispatcher.exit_when_done=1"], "dispatcher.exit_when_done"),
    (["pool.pull=x"], "pool.pull"),
    (["schedule.order=round_robin"], "schedule.order"),
    (["pool.transport=tcp"], "pool.transport"),
    (["target.dtype=int8"], "target.dtype"),
    (["schedule.buckets=5"], "schedule.buckets"),
    (["schedule.buckets=[128, x]"], "schedule.buckets"),
    (["schedule.buckets=[256, 128]"], "schedule.buckets"),
    (["schedule.buckets=[128, 128]"], "schedule.buckets"),
    (["schedule.buckets=[]"], "schedule.buckets"),
    (["schedule.buckets=[0, 128]"], "schedule.buckets"),
    (["schedule.tokens_per_batch=2048"], "schedule.tokens_per_batch"),   # last default bucket is 4096
    (["schedule.buckets=[64, 8192]", "schedule.tokens_per_batch=8191"], "schedule.tokens_per_batch"),
    (["pool.min_ready=16"], "pool.min_ready"),      # default slots is 16
    (["pool.slots=4", "pool.min_ready=5"], "pool.min_ready"),
    (["pool.min_ready=-1"], "pool.min_ready"),
    (["pool.slots=0", "pool.min_ready=0"], "pool.slots"),
    (["pool.target_credits=0"], "pool.target_credits"),
    (["run.epochs=0"], "run.epochs"),
    (["drafter.accum_steps=0"], "drafter.accum_steps"),
    (["drafter.collective_timeout_s=0"], "drafter.collective_timeout_s"),
    (["drafter.group_wait_s=0"], "drafter.group_wait_s"),
    (["drafter.group_wait_s=-5"], "drafter.group_wait_s"),
    (["dispatcher.heartbeat_s=0"], "dispatcher.heartbeat_s"),
    (["dispatcher.reconnect_s=0"], "dispatcher.reconnect_s"),
    (["dispatcher.abandoned_model_s=-1"], "dispatcher.abandoned_model_s"),
    (["dispatcher.worker_timeout_s=0.1", "dispatcher.heartbeat_s=0.5"], "dispatcher.worker_timeout_s"),
    (["target.count=2", "target.gpus=[0]"], "target.gpus"),
    (["data.lengths=missing.txt"], "data.lengths"),
    (["data.path=nowhere"], "data.path"),
    (["drafter.objective=medusa"], "drafter.objective"),
    (["eagle3.ttt_steps=0"], "eagle3.ttt_steps"),
    (["eagle3.draft_vocab=0"], "eagle3.draft_vocab"),
    (["eagle3.loss_decay=0"], "eagle3.loss_decay"),
    (["eagle3.dtype=float16"], "eagle3.dtype"),
    (["drafter.rendezvous=nfs"], "drafter.rendezvous"),
    (["drafter.rendezvous_host=10.0.0.1:29500"], "drafter.rendezvous_host"),   # the port is the kernel's choice
    (["drafter.rendezvous_host=tcp://10.0.0.1"], "drafter.rendezvous_host"),
])
def test_bad_values_raise_config_error_naming_the_key(overrides, key):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert key in str(info.value)


def test_the_abandoned_model_grace_follows_the_reconnect_window_unless_set():
    """A drafter cut off from its dispatcher is given up on once it would have given up itself."""
    assert load_config(None, []).dispatcher.abandoned_after_s == 60.0
    assert load_config(None, ["dispatcher.reconnect_s=300"]).dispatcher.abandoned_after_s == 300.0
    assert load_config(None, ["dispatcher.reconnect_s=300", "dispatcher.abandoned_model_s=20"]
                       ).dispatcher.abandoned_after_s == 20.0


def test_lengths_and_path_are_exclusive(tmp_path):
    (tmp_path / "lengths.txt").write_text("10\n")
    (tmp_path / "ds").mkdir()
    with pytest.raises(ConfigError, match="data.lengths"):
        load_config(None, ["data.lengths=lengths.txt", "data.path=ds"])


def test_min_ready_just_below_slots_is_accepted():
    config = load_config(None, ["pool.slots=4", "pool.min_ready=3"])
    assert (config.pool.slots, config.pool.min_ready) == (4, 3)


def test_tokens_per_batch_equal_to_last_bucket_is_accepted():
    config = load_config(None, ["schedule.buckets=[64, 128]", "schedule.tokens_per_batch=128"])
    assert config.schedule.tokens_per_batch == 128


@pytest.mark.parametrize("doc, key", [
    ({"nosuch": {"a": 1}}, "nosuch"),
    ({"pool": {"nosuch": 1}}, "pool.nosuch"),
    ({"pool": {"slots": "many"}}, "pool.slots"),
    ({"pool": {"pull": "x"}}, "pool.pull"),
    ({"schedule": {"buckets": [512, 256]}}, "schedule.buckets"),
    ({"pool": 3}, "pool"),
])
def test_bad_yaml_file_raises_config_error_naming_the_key(tmp_path, doc, key):
    path = write_yaml(tmp_path / "c.yaml", doc)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert key in str(info.value)


@pytest.mark.parametrize("text", ["- just\n- a list\n", "pool: {slots: [\n"])
def test_yaml_file_that_is_not_a_mapping_or_not_yaml(tmp_path, text):
    path = write_yaml(tmp_path / "c.yaml", text)
    with pytest.raises(ConfigError, match="c.yaml"):
        load_config(path)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="nope.yaml"):
        load_config(tmp_path / "nope.yaml")


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


# -- paths ----------------------------------------------------------------------------------------

def test_relative_paths_become_absolute(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "lengths.txt").write_text("12\n")
    config = load_config(None, ["run.dir=runs/x", "data.lengths=data/lengths.txt"])
    assert config.run.dir == str((tmp_path / "runs" / "x").resolve())
    assert config.data.lengths == str((tmp_path / "data" / "lengths.txt").resolve())
    assert config.run_dir == Path(config.run.dir)


def test_relative_dataset_path_becomes_absolute(tmp_path):
    (tmp_path / "ds").mkdir()
    config = load_config(None, ["data.path=ds"])
    assert config.data.path == str((tmp_path / "ds").resolve())


# -- resolved config ------------------------------------------------------------------------------

def test_resolved_config_round_trips(tmp_path, monkeypatch):
    (tmp_path / "lengths.txt").write_text("5\n6\n")
    path = write_yaml(tmp_path / "c.yaml", {"schedule": {"buckets": [64, 128], "tokens_per_batch": 512},
                                            "pool": {"slots": 5, "min_ready": 1, "pull": "random"}})
    config = load_config(path, ["run.dir=myrun", "data.lengths=lengths.txt", "dispatcher.lease_s=7",
                                "target.gpus=[0, 1]", "dispatcher.exit_when_done=false"])
    written = write_resolved(config)
    assert written == tmp_path / "myrun" / RESOLVED_CONFIG_NAME and written.is_file()
    # from another working directory: the resolved file holds absolute paths only
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    loaded = load_run_config(tmp_path / "myrun")
    assert loaded == config
    assert loaded.to_dict() == config.to_dict()
    # overrides still apply on top of a run's resolved config
    again = load_run_config(tmp_path / "myrun", ["pool.slots=9"])
    assert again.pool.slots == 9 and again.pool.pull == "random"


def test_write_resolved_to_explicit_dir(tmp_path):
    config = load_config()
    target = write_resolved(config, tmp_path / "other")
    assert target.parent == tmp_path / "other"
    assert load_run_config(tmp_path / "other") == config
    assert not list((tmp_path / "other").glob("*.tmp"))


def test_load_run_config_of_a_non_run_dir(tmp_path):
    with pytest.raises(ConfigError, match="not a run directory"):
        load_run_config(tmp_path)


# -- describe -------------------------------------------------------------------------------------

def test_describe_lists_every_section_and_key():
    text = describe()
    config = Config().to_dict()
    for section, values in config.items():
        assert f"{section}:" in text.splitlines()
        for key in values:
            assert any(line.startswith(f"  {key}: ") for line in text.splitlines()), key
    assert "  min_ready: 6" in text
    assert "Pull policy" in text


@pytest.mark.parametrize("text", ["0123", "12:30", "yes"])
def test_string_override_keeps_its_text(text):
    """A string key takes the override's text as typed: a secret or a path is not a YAML number or bool."""
    assert load_config(None, [f"dispatcher.secret={text}"]).dispatcher.secret == text
    assert Path(load_config(None, [f"run.dir={text}"]).run.dir).name == text


def test_float_without_dot_is_a_number(tmp_path):
    """YAML 1.1 reads 4e-5 as a string; a float key still takes it as a number."""
    config = load_config(None, ["target.sim_cost_per_token=4e-5", "dispatcher.lease_s=1e2"])
    assert config.target.sim_cost_per_token == pytest.approx(4e-5)
    assert config.dispatcher.lease_s == 100.0
    path = write_yaml(tmp_path / "c.yaml", "drafter:\n  sim_cost_per_token: 3e-7\n")
    assert load_config(path).drafter.sim_cost_per_token == pytest.approx(3e-7)


@pytest.mark.parametrize("override, key", [
    ("dispatcher.lease_s=.nan", "dispatcher.lease_s"),
    ("dispatcher.lease_s=nan", "dispatcher.lease_s"),
    ("dispatcher.heartbeat_s=.nan", "dispatcher.heartbeat_s"),
    ("dispatcher.worker_timeout_s=nan", "dispatcher.worker_timeout_s"),
    ("drafter.group_wait_s=.nan", "drafter.group_wait_s"),
])
def test_nan_durations_are_rejected(override, key):
    """A NaN lease never expires and a NaN heartbeat cannot be slept: not a positive number."""
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    assert key in str(info.value)


def test_eagle3_capture_layers_are_three_and_a_short_target_needs_them_listed(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 4,
                                                  "hidden_size": 64}))
    base = [f"target.model={model}", "drafter.objective=eagle3"]
    with pytest.raises(ConfigError, match="target.capture_layers.*1, 1, 0"):
        load_config(None, base)  # the default 1, N/2-1, N-4 of 4 layers is not three layers
    with pytest.raises(ConfigError, match="target.capture_layers: an EAGLE-3 drafter fuses exactly 3"):
        load_config(None, [*base, "target.capture_layers=[0, 1]"])
    assert load_config(None, [*base, "target.capture_layers=[0, 1, 2]"]).drafter.objective == "eagle3"


@pytest.mark.parametrize("overrides, meets", [
    ([], "file"), (["pool.transport=nixl"], "tcp"), (["pool.transport=nixl", "drafter.rendezvous=file"], "file"),
    (["drafter.rendezvous=tcp"], "tcp"), (["drafter.rendezvous=tcp", "drafter.rendezvous_host=fe80::1"], "tcp"),
])
def test_a_group_meets_over_tcp_by_default_only_across_nodes(overrides, meets):
    assert load_config(None, overrides).group_rendezvous == meets


# -- sections check themselves --------------------------------------------------------------------

def test_every_section_is_named_as_its_key_in_config():
    for name, section_type in section_types().items():
        assert section_type.section == name


def test_a_choice_error_lists_the_literal_values():
    """Every choice key rejects a value outside its Literal and names the allowed values."""
    for name, section_type in section_types().items():
        for key, hint in key_types(section_type).items():
            if typing.get_origin(hint) is typing.Literal:
                with pytest.raises(ConfigError) as info:
                    load_config(None, [f"{name}.{key}=nosuch"])
                assert str(info.value) == (f"{name}.{key}: 'nosuch' is not one of "
                                           f"{', '.join(typing.get_args(hint))}")


def test_a_section_built_in_code_is_checked_and_coerced():
    with pytest.raises(ConfigError, match="pool.pull: 'greedy' is not one of deficit, random"):
        PoolSection(pull="greedy")
    with pytest.raises(ConfigError, match=r"pool.min_ready \(5\) must be below pool.slots \(4\)"):
        PoolSection(slots=4, min_ready=5)
    with pytest.raises(ConfigError, match="dflash.attention"):
        DFlashSection(attention="xformers")
    section = DispatcherSection(heartbeat_s=1, lease_s="1e2")
    assert (section.heartbeat_s, section.lease_s) == (1.0, 100.0) and type(section.heartbeat_s) is float


@pytest.mark.parametrize("value, hint, expected", [
    (None, int | None, None),
    (3, int | None, 3),
    ([[1, 2], []], list[list[int]], [[1, 2], []]),
    ((1, 2), list[float], [1.0, 2.0]),
    ("1e-3", float, 1e-3),
    (7, str, "7"),
])
def test_coerce(value, hint, expected):
    assert coerce("s.k", value, hint) == expected


@pytest.mark.parametrize("value, hint, message", [
    ("x", int | None, "s.k: expected an integer, got 'x'"),
    ([[1, "a"]], list[list[int]], r"s.k\[0\]\[1\]: expected an integer, got 'a'"),
    (True, typing.Literal["a", "b"], "s.k: True is not one of a, b"),
])
def test_coerce_errors_name_the_key(value, hint, message):
    with pytest.raises(ConfigError, match=message):
        coerce("s.k", value, hint)
