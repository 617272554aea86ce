"""The daemon's experiment and training options: TOML file, precedence, KEY=VALUE, roles.

Precedence: a SHOAL_* variable, else the flag, else the TOML file (--config),
else the default. All of it is parsed without starting anything.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.averaging.outer import allreduce_config, resolve_options
from shoal.peer.cli import parse_command_line
from shoal.peer.config import (
    DEFAULT_CHECKPOINT_INTERVAL,
    DEFAULT_INNER_STEPS,
    Config,
    ConfigError,
)
from shoal.peer.session import verification_options
from shoal.transport.multiaddr import Multiaddr

BOOT = "/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWADf7hekRQXQ55CudbEHpoUS6EF5ffbxFgghynqtjpfrD"
HOST_ID = "12D3KooWADf7hekRQXQ55CudbEHpoUS6EF5ffbxFgghynqtjpfrD"


def run_config(*argv: str, **environ: str) -> Config:
    command, config = parse_command_line(["run", *argv], environ)
    assert command == "run"
    return config


def toml_file(tmp_path: Path, text: str, name: str = "shoal.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def config_error(*argv: str, **environ: str) -> str:
    with pytest.raises(ConfigError) as caught:
        run_config(*argv, **environ)
    message = str(caught.value)
    assert "\n" not in message
    return message


# --- defaults -------------------------------------------------------------------------------


def test_training_defaults() -> None:
    config = run_config()
    assert config.host_experiment is None and config.join is None
    assert config.no_train is False
    assert config.task == "bytegpt" and config.task_option == ()
    assert config.data is None
    assert config.strategy == "diloco" and config.strategy_option == ()
    assert config.inner_steps == DEFAULT_INNER_STEPS
    assert config.status_addr == ("127.0.0.1", 8080)
    assert config.checkpoint_interval == DEFAULT_CHECKPOINT_INTERVAL
    assert config.threads is None
    assert config.reachability == "auto"
    assert config.checkpoints_dir == config.data_dir / "checkpoints"


# --- the TOML file ----------------------------------------------------------------------------


def test_a_toml_file_sets_options(tmp_path: Path) -> None:
    data = tmp_path / "corpus.txt"
    data.write_text("hello")
    path = toml_file(
        tmp_path,
        f"""
        host-experiment = "shakespeare"
        task = "bytegpt"
        task_option = {{ d_model = 64, tie = true, name = "42", lr = 1e-3, data = "a,b" }}
        data = "{data}"
        strategy = "streaming"
        inner_steps = 20
        strategy_option = ["outer_lr=0.5", "codec=int8"]
        status_addr = "127.0.0.1:9000"
        checkpoint_interval = 12.5
        threads = 2
        reachability = "private"
        no_train = false
        bootstrap = ["{BOOT}"]
        listen = "/ip4/127.0.0.1/tcp/0"
        """,
    )
    config = run_config("--config", str(path))
    assert config.config == path
    assert config.host_experiment == "shakespeare"
    # A table keeps TOML's types, and its strings may hold commas.
    assert dict(config.task_option) == {
        "d_model": 64,
        "tie": True,
        "name": "42",
        "lr": 1e-3,
        "data": "a,b",
    }
    assert config.data == data
    assert config.strategy == "streaming"
    assert config.inner_steps == 20
    assert config.strategy_option == (("outer_lr", 0.5), ("codec", "int8"))
    assert config.status_addr == ("127.0.0.1", 9000)
    assert config.checkpoint_interval == 12.5
    assert config.threads == 2
    assert config.reachability == "private"
    assert config.no_train is False
    assert config.bootstrap == (Multiaddr(BOOT),)
    assert config.listen == (Multiaddr("/ip4/127.0.0.1/tcp/0"),)
    assert config.sources["inner_steps"] == f"{path} (inner_steps)"
    assert any(f"[{path} (strategy)]" in line for line in config.describe())


def test_precedence_is_flag_then_env_then_toml_then_default(tmp_path: Path) -> None:
    path = toml_file(tmp_path, "inner_steps = 20\nstrategy = 'noloco'\nthreads = 3\n")
    config = run_config(
        "--config", str(path), "--inner-steps", "30", "--strategy", "streaming",
        SHOAL_INNER_STEPS="40",
    )  # fmt: skip
    assert config.inner_steps == 30  # flag over env over file
    assert config.sources["inner_steps"] == "--inner-steps, overriding SHOAL_INNER_STEPS"
    assert config.strategy == "streaming"  # flag over file
    assert config.sources["strategy"] == "--strategy"
    assert config.threads == 3  # file over default
    assert config.task == "bytegpt"  # default
    assert "task" not in config.sources
    env_only = run_config("--config", str(path), SHOAL_INNER_STEPS="40")
    assert env_only.inner_steps == 40  # env over file


def test_the_config_file_itself_comes_from_the_flag_before_the_env(tmp_path: Path) -> None:
    from_flag = toml_file(tmp_path, "inner_steps = 1\n", "flag.toml")
    from_env = toml_file(tmp_path, "inner_steps = 2\n", "env.toml")
    config = run_config("--config", str(from_flag), SHOAL_CONFIG=str(from_env))
    assert config.inner_steps == 1
    assert config.config == from_flag


def test_a_blank_variable_does_not_hide_the_file(tmp_path: Path) -> None:
    path = toml_file(tmp_path, "inner_steps = 7\n")
    assert run_config("--config", str(path), SHOAL_INNER_STEPS=" ").inner_steps == 7


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("frobnicate = 1\n", ["unknown option 'frobnicate'", "inner_steps"]),
        ("config = 'other.toml'\n", ["unknown option 'config'"]),
        ("inner_steps = = 3\n", ["not valid TOML", "line 1"]),
        ("inner_steps = 'many'\n", ["(inner_steps)", "positive whole number", "'many'"]),
        ("inner_steps = 0\n", ["(inner_steps)", "positive whole number"]),
        ("strategy = ['diloco']\n", ["(strategy)", "single value", "list"]),
        ("[strategy]\nname = 'diloco'\n", ["(strategy)", "single value", "table"]),
        ("no_train = 'maybe'\n", ["(no_train)", "true/false"]),
        ("task_option = 5\n", ["(task_option)", "KEY=VALUE"]),
        ("status_addr = '1.2.3.4:99999'\n", ["(status_addr)", "'off'"]),
        ("join = 'a b'\n", ["(join)", "invalid experiment name"]),
        ("data = '/nonexistent/corpus'\n", ["(data)", "does not exist"]),
    ],
)
def test_a_bad_toml_file_is_one_line_naming_the_file(
    tmp_path: Path, text: str, words: list[str]
) -> None:
    path = toml_file(tmp_path, text)
    message = config_error("--config", str(path))
    assert str(path) in message
    for word in words:
        assert word in message


def test_a_binary_or_missing_config_file_is_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "shoal.toml"
    binary.write_bytes(b"\xff\xfe inner_steps = 1")
    assert "not valid TOML" in config_error("--config", str(binary))
    missing = tmp_path / "missing.toml"
    assert "cannot read config file" in config_error("--config", str(missing))
    assert "cannot read config file" in config_error("--config", str(tmp_path))  # a directory


def test_a_bad_value_in_the_file_is_not_checked_when_a_flag_replaces_it(tmp_path: Path) -> None:
    path = toml_file(tmp_path, "inner_steps = 'many'\n")
    assert run_config("--config", str(path), "--inner-steps", "5").inner_steps == 5


# --- KEY=VALUE options ----------------------------------------------------------------------


def test_key_values_read_numbers_booleans_and_strings() -> None:
    config = run_config(
        "--task-option", "d_model=64", "--task-option", "lr=1e-3,tie=true,off=false",
        "--task-option", "name=hello, quoted=\"42\", neg=-3, big=1_000",
    )  # fmt: skip
    assert dict(config.task_option) == {
        "d_model": 64,
        "lr": 1e-3,
        "tie": True,
        "off": False,
        "name": "hello",
        "quoted": "42",
        "neg": -3,
        "big": 1000,
    }
    assert isinstance(dict(config.task_option)["d_model"], int)


def test_a_json_value_keeps_its_commas_and_the_items_around_it_split() -> None:
    config = run_config(
        "--task-option", 'config={"model_type": "llama", "sizes": [1, 2], "n": "a,}"},context=32',
        "--task-option", "name=it's,x=1",
    )  # fmt: skip
    assert dict(config.task_option) == {
        "config": '{"model_type": "llama", "sizes": [1, 2], "n": "a,}"}',
        "context": 32,
        "name": "it's",
        "x": 1,
    }


def test_a_repeated_key_keeps_the_last_value() -> None:
    config = run_config("--strategy-option", "outer_lr=0.5", "--strategy-option", "outer_lr=0.7")
    assert config.strategy_option == (("outer_lr", 0.7),)


def test_key_values_from_the_flags_replace_the_environments() -> None:
    config = run_config(
        "--strategy-option", "codec=int8", SHOAL_STRATEGY_OPTIONS="outer_lr=0.5,codec=none"
    )
    assert config.strategy_option == (("codec", "int8"),)  # replaced, not merged
    assert config.sources["strategy_option"].startswith("--strategy-option")
    config = run_config(SHOAL_STRATEGY_OPTIONS="outer_lr=0.5,codec=none")
    assert config.strategy_option == (("outer_lr", 0.5), ("codec", "none"))


@pytest.mark.parametrize("item", ["d_model", "=3", " =3"])
def test_an_item_without_key_or_value_is_refused(item: str) -> None:
    message = config_error("--task-option", item)
    assert "--task-option" in message and "KEY=VALUE" in message


def test_an_empty_value_is_an_empty_string() -> None:
    assert run_config("--task-option", "name=").task_option == (("name", ""),)


# --- switches and simple values -------------------------------------------------------------


def test_no_train_as_a_flag_and_as_a_variable() -> None:
    assert run_config("--no-train").no_train is True
    assert run_config("--no-train").sources["no_train"] == "--no-train"
    for true in ("1", "true", "YES", "on"):
        assert run_config(SHOAL_NO_TRAIN=true).no_train is True
    for false in ("0", "false", "no", "off"):
        assert run_config(SHOAL_NO_TRAIN=false).no_train is False
    assert run_config("--no-train", SHOAL_NO_TRAIN="0").no_train is True  # the flag wins
    assert "SHOAL_NO_TRAIN" in config_error(SHOAL_NO_TRAIN="sometimes")


@pytest.mark.parametrize(
    ("argv", "environ", "words"),
    [
        (["--strategy", "sgd"], {}, ["--strategy", "unknown strategy 'sgd'", "diloco"]),
        (["--inner-steps", "0"], {}, ["--inner-steps", "positive whole number"]),
        (["--inner-steps", "1.5"], {}, ["--inner-steps"]),
        ([], {"SHOAL_THREADS": "-1"}, ["SHOAL_THREADS"]),
        (["--checkpoint-interval", "0"], {}, ["--checkpoint-interval", "seconds"]),
        (["--checkpoint-interval", "nan"], {}, ["--checkpoint-interval"]),
        (["--status-addr", "http://x:1"], {}, ["--status-addr", "'off'"]),
        (["--reachability", "maybe"], {}, ["--reachability", "public"]),
        (["--task", " "], {}, ["--task", "empty task"]),
        (["--data", "/nonexistent/corpus"], {}, ["--data", "/nonexistent/corpus", "does not"]),
        (["--host-experiment", "no spaces"], {}, ["--host-experiment", "invalid experiment"]),
        (["--host-experiment", f"x@{HOST_ID}"], {}, ["--host-experiment", "'x@"]),
        ([], {"SHOAL_JOIN": "-x"}, ["SHOAL_JOIN", "invalid experiment name"]),
        (["--join", "x@12D3KooWnope"], {}, ["--join", "invalid host peer ID '12D3KooWnope'"]),
        (["--join", "x@"], {}, ["--join", "invalid host peer ID ''"]),
    ],
)
def test_bad_values_name_the_flag_or_variable(
    argv: list[str], environ: dict[str, str], words: list[str]
) -> None:
    message = config_error(*argv, **environ)
    for word in words:
        assert word in message


def test_status_addr_off_and_any_port() -> None:
    assert run_config("--status-addr", "off").status_addr is None
    assert run_config(SHOAL_STATUS_ADDR="127.0.0.1:0").status_addr == ("127.0.0.1", 0)


def test_join_keeps_name_at_peer_id() -> None:
    assert run_config("--join", f" shakespeare@{HOST_ID} ").join == f"shakespeare@{HOST_ID}"
    assert run_config("--join", "shakespeare").join == "shakespeare"


# --- which experiment: experiment_role() ------------------------------------------------------


def test_no_flags_hosts_the_default_experiment() -> None:
    assert run_config().experiment_role() == ("host", "default")


def test_bootstrap_alone_joins_the_default_experiment() -> None:
    assert run_config("--bootstrap", BOOT).experiment_role() == ("join", "default")


def test_named_roles() -> None:
    assert run_config("--host-experiment", "x").experiment_role() == ("host", "x")
    # Hosting with --bootstrap: a new experiment in an existing network.
    assert run_config("--host-experiment", "x", "--bootstrap", BOOT).experiment_role() == (
        "host",
        "x",
    )
    ref = f"x@{HOST_ID}"
    assert run_config("--join", ref, "--bootstrap", BOOT).experiment_role() == ("join", ref)


def test_no_train_has_no_role() -> None:
    assert run_config("--no-train").experiment_role() is None
    assert run_config("--no-train", "--host-experiment", "x").experiment_role() is None


@pytest.mark.parametrize(
    ("argv", "environ", "names"),
    [
        (["--host-experiment", "a", "--join", "b"], {}, ["--host-experiment", "--join"]),
        (["--host-experiment", "a"], {"SHOAL_JOIN": "b"}, ["--host-experiment", "SHOAL_JOIN"]),
    ],
)
def test_hosting_and_joining_together_is_refused(
    argv: list[str], environ: dict[str, str], names: list[str]
) -> None:
    config = run_config(*argv, **environ)
    with pytest.raises(ConfigError) as caught:
        config.experiment_role()
    message = str(caught.value)
    assert "exclude each other" in message
    for name in names:
        assert name in message


def test_hosting_and_joining_from_the_file_name_the_file(tmp_path: Path) -> None:
    path = toml_file(tmp_path, "host_experiment = 'a'\njoin = 'b'\n")
    with pytest.raises(ConfigError, match=str(path)):
        run_config("--config", str(path)).experiment_role()


def test_the_status_view_of_the_configuration_has_json_types() -> None:
    config = run_config(
        "--inner-steps", "30", "--strategy-option", "outer_lr=0.5", "--status-addr", "off"
    )
    view = config.to_json()
    assert view["inner-steps"] == 30 and view["no-train"] is False
    assert view["strategy-option"] == {"outer_lr": 0.5}
    assert view["status-addr"] is None and view["threads"] is None
    assert view["host-experiment"] == "default"  # what the peer does, default included
    assert view["join"] is None
    assert isinstance(view["listen"], list) and isinstance(view["data-dir"], str)
    import json

    assert json.loads(json.dumps(view)) == view


# --- verification -------------------------------------------------------------------------------


def test_new_diloco_experiments_verify_unless_told_not_to() -> None:
    """`--verify` decides a new experiment's policy; the manifest then carries it (an
    experiment made before verification existed has no `verify` and runs without)."""
    base = {"inner_steps": 50}
    assert verification_options(run_config(), base)["verify"] is True
    assert verification_options(run_config("--verify", "off"), base)["verify"] is False
    assert verification_options(run_config("--strategy", "streaming"), base)["verify"] is False
    assert verification_options(run_config(SHOAL_VERIFY="on"), base)["verify"] is True
    explicit = verification_options(run_config("--verify", "on"), {**base, "verify": False})
    assert explicit["verify"] is False  # --strategy-option verify=false wins
    bf16 = verification_options(run_config("--precision", "bf16"), base)
    assert bf16["audit_threshold_angle"] > resolve_options("diloco", {})["audit_threshold_angle"]
    assert resolve_options("diloco", {})["verify"] is False  # a manifest without the key
    assert "verify takes on or off" in config_error("--verify", "maybe")


def test_a_sparse_codec_is_hosted_unverified_by_auto_and_verified_when_asked() -> None:
    """Auto leaves sparse experiments unverified (an audit's reveal is many sparse
    rounds' bytes); --verify on audits them, with the robust reduction."""
    sparse = {"inner_steps": 50, "codec": "topk"}
    assert verification_options(run_config(), sparse)["verify"] is False
    on = verification_options(run_config("--verify", "on"), sparse)
    assert resolve_options("diloco", on)["verify"] is True


def test_a_sparse_codec_s_outer_step_defaults_to_sparseloco_s_and_is_recorded() -> None:
    """Nesterov momentum on top of error feedback diverged (bench/wan.py); a sparse
    codec takes momentum 0 and lr 1 unless told otherwise, and the manifest writes them
    out, so an experiment keeps its outer step whatever later defaults say."""
    sparse = resolve_options("diloco", {"codec": "topk"})
    assert (sparse["outer_momentum"], sparse["outer_lr"]) == (0.0, 1.0)
    assert sparse.to_dict()["outer_momentum"] == 0.0 and sparse.to_dict()["outer_lr"] == 1.0
    given = resolve_options("diloco", {"codec": "dct", "outer_momentum": 0.9, "outer_lr": 0.7})
    assert (given["outer_momentum"], given["outer_lr"]) == (0.9, 0.7)
    dense = resolve_options("diloco", {"codec": "int8"})
    assert (dense["outer_momentum"], dense["outer_lr"]) == (0.9, 0.7)


def test_verification_options_are_checked_and_need_diloco() -> None:
    opts = resolve_options("diloco", {"verify": True, "audit_rate": 0.1})
    assert opts["audit_rate"] == 0.1 and opts["audit_segment_steps"] == 3
    for bad in ({"audit_rate": 2}, {"audit_segment_steps": 0}, {"reduction": "median"}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            resolve_options("diloco", bad)
    with pytest.raises(ValueError, match="needs the diloco strategy"):
        resolve_options("streaming", {"verify": True})
    # Verifying rounds average with CenteredClip unless told otherwise.
    assert (
        allreduce_config(resolve_options("diloco", {"verify": True})).reduction == "centered_clip"
    )
    assert allreduce_config(resolve_options("diloco", {})).reduction == "mean"
    plain = resolve_options("diloco", {"verify": True, "reduction": "mean"})
    assert allreduce_config(plain).reduction == "mean"


def test_pipeline_roles_include_a_monitor_that_serves_and_trains_nothing() -> None:
    """`--role monitor` (e.g. a bootstrap peer hosting a pipelined experiment); a role
    the daemon does not know is refused, naming the ones it does."""
    assert run_config("--role", "monitor").role == "monitor"
    assert run_config(SHOAL_ROLE="Stage").role == "stage"
    with pytest.raises(ConfigError) as caught:
        run_config("--role", "observer")
    assert "auto, trainer, stage, monitor" in str(caught.value)
