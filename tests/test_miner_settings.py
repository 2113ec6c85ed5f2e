"""Miner settings from flags and environment (neurons/base/settings.py), and the budget arithmetic."""
import dataclasses
import importlib.util
from pathlib import Path

import pytest

from chain.interface import MetagraphSnapshot, NeuronInfo
from inference.serving import EngineSpec
from neurons import miner as miner_entry
from neurons.base.settings import (FROM_SETTINGS, Option, Section, Setting, bind_defaults, build_settings, byte_size,
                                   describe_values, flag, optional_text, options_table, positive_float, read_options,
                                   setting, settings_options)
from neurons.miner_app import (AccessSettings, CallerBudget, CallerBudgets, MinerSettings, Refusal, ValidatorAccess,
                               miner_options, read_miner_settings)
from protocol.client import ClientTimeouts

ROOT = Path(__file__).resolve().parent.parent
REQUIRED = ["--netuid", "7"]


def test_flags_win_over_the_environment_which_wins_over_defaults():
    env = {"K3_MINER_PORT": "9000", "K3_MINER_HOST": "10.0.0.1", "K3_ENGINE_MAX_CONTEXT": "4096",
           "K3_MINER_PUBLISH": "no", "K3_ENGINE_CACHE_MEMORY": "512MiB"}
    settings, _ = read_miner_settings(REQUIRED + ["--port", "9100", "--max-concurrent", "3"], env)
    assert settings.chain.netuid == 7
    assert settings.server.port == 9100  # flag over environment
    assert settings.server.host == "10.0.0.1"  # environment over default
    assert settings.server.publish is False
    assert settings.engine.settings.max_context == 4096 and settings.engine.settings.max_concurrent_sequences == 3
    assert settings.engine.settings.cache_memory_budget_bytes == 512 * 2**20
    assert settings.engine.settings.max_waiting == 128  # untouched: the EngineSettings default
    assert settings.server.metrics_port == 9091 and settings.access.min_validator_stake == 1000.0
    assert isinstance(settings.engine, EngineSpec)
    flipped, _ = read_miner_settings(REQUIRED + ["--publish"], env)
    assert flipped.server.publish is True


def test_bad_values_and_missing_required_options_exit_with_a_message_naming_them(capsys):
    with pytest.raises(SystemExit) as exit_:
        read_miner_settings(REQUIRED, {"K3_MINER_PORT": "eighty"})
    assert exit_.value.code == 2
    assert "K3_MINER_PORT='eighty'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        read_miner_settings([], {})
    err = capsys.readouterr().err
    assert "--netuid is required" in err and "K3_NETUID" in err
    with pytest.raises(SystemExit):
        read_miner_settings(REQUIRED + ["--engine", "magic"], {})
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        read_miner_settings(REQUIRED, {"K3_ENGINE_KIND": "magic"})
    assert "K3_ENGINE_KIND='magic'" in capsys.readouterr().err


def test_value_readers():
    assert byte_size("2GiB") == 2 * 2**30 and byte_size("1.5GB") == 1_500_000_000 and byte_size("4096") == 4096
    for bad in ("lots", "-1MiB", "2 parsecs"):
        with pytest.raises(ValueError):
            byte_size(bad)
    assert flag("Yes") is True and flag("off") is False
    with pytest.raises(ValueError):
        flag("maybe")


def test_a_generic_table_builds_nested_dataclasses():
    from dataclasses import dataclass, field

    @dataclass(frozen=True)
    class Inner:
        depth: int = 1
        name: str = "x"

    @dataclass(frozen=True)
    class Outer:
        inner: Inner = field(default_factory=Inner)
        rate: float = 0.5

    table = (Option("inner.depth", "--depth", "T_DEPTH", int, "depth", default=1),
             Option("rate", "--rate", "T_RATE", float, "rate", default=0.5))
    values = read_options(table, ["--depth", "4"], {"T_RATE": "0.25"})
    assert build_settings(Outer, values) == Outer(Inner(depth=4, name="x"), 0.25)
    with pytest.raises(TypeError, match="no settings named"):
        build_settings(Outer, {"speed": 1})
    with pytest.raises(ValueError, match="share the flag"):
        read_options(table + (Option("other", "--depth", None, int, "dup", default=0),), [], {})


def test_a_settings_class_states_each_option_once_on_its_fields():
    """The table is derived from the fields: flag from the name, variable from the prefix and the flag,
    reader from the type, default from the dataclass; a Section gives a class without flags its own."""
    from dataclasses import dataclass
    from typing import Optional

    @dataclass(frozen=True)
    class Inner:
        depth: int = setting(1, "depth", env_key="DEEP")
        label: Optional[str] = setting(None, "label")
        hidden: float = 2.0  # no Setting: not an option

    @dataclass(frozen=True)
    class Outer:
        inner: Inner = Section(group="inner").field(Inner)
        rate: float = setting(0.5, "rate", flag="--speed", read=positive_float)
        on: bool = setting(True, "a switch", env="WHOLE_NAME")
        timeouts: ClientTimeouts = Section(env_prefix="T2_", fields={
            "connect": Setting("connect", flag="--connect-s", read=positive_float)}).field(ClientTimeouts)

    table = settings_options(Outer, "T_")
    assert [(o.dest, o.flag, o.env, o.group, o.default) for o in table] == [
        ("inner.depth", "--depth", "T_DEEP", "inner", 1), ("inner.label", "--label", "T_LABEL", "inner", None),
        ("rate", "--speed", "T_SPEED", "general", 0.5), ("on", "--on", "WHOLE_NAME", "general", True),
        ("timeouts.connect", "--connect-s", "T2_CONNECT_S", "general", 3.0)]
    assert [o.read for o in table] == [int, optional_text, positive_float, flag, positive_float]
    values = read_options(table, ["--depth", "4", "--no-on", "--connect-s", "1.5"], {"T_SPEED": "0.25", "T_LABEL": ""})
    assert build_settings(Outer, values) == Outer(Inner(depth=4), 0.25, False, ClientTimeouts(connect=1.5))

    @dataclass(frozen=True)
    class Unreadable:
        sizes: tuple = setting((1, 2), "no reader for a tuple")

    with pytest.raises(TypeError, match="sizes.*read="):
        settings_options(Unreadable, "T_")


def test_flag_defaults_are_the_settings_dataclasses_defaults():
    """Every flag's default comes from its settings dataclass: no flags and no environment give
    exactly the dataclasses' defaults (the required --netuid aside)."""
    from benchmarks.endpoint import BenchmarkSettings, benchmark_options
    from neurons.validator_app.settings import ValidatorSettings, read_validator_settings, validator_options

    assert read_miner_settings(REQUIRED, {})[0] == dataclasses.replace(
        MinerSettings(), chain=dataclasses.replace(MinerSettings().chain, netuid=7))
    assert read_validator_settings(REQUIRED, {}) == dataclasses.replace(
        ValidatorSettings(), chain=dataclasses.replace(ValidatorSettings().chain, netuid=7))
    assert build_settings(BenchmarkSettings, read_options(benchmark_options(), [], {})) == BenchmarkSettings()
    for table in (miner_options(), validator_options(), benchmark_options()):
        assert all(option.default is not FROM_SETTINGS for option in table)
    # the benchmark's log level is its own dataclass's, not the miner's
    assert {o.flag: o.default for o in benchmark_options()}["--log-level"] == BenchmarkSettings().log_level == "WARNING"


def test_an_option_without_a_default_or_a_dataclass_is_refused():
    table = (Option("depth", "--depth", None, int, "depth"),)
    with pytest.raises(ValueError, match="--depth"):
        read_options(table, [], {})
    with pytest.raises(ValueError, match="no setting 'nowhere'"):
        bind_defaults(MinerSettings, (Option("nowhere", "--nowhere", None, int, "x"),))


def test_help_and_the_settings_table_cover_every_option(capsys):
    with pytest.raises(SystemExit) as exit_:
        miner_entry.main(["--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    table = options_table(miner_options())
    for option in miner_options():
        assert option.flag in text and option.flag in table
        if option.env:
            assert option.env in text


def test_settings_problems_are_reported_before_anything_starts(capsys):
    assert miner_entry.main(REQUIRED + ["--host", "0.0.0.0", "--checkpoint", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert "--external-ip" in err and "not a checkpoint directory" in err
    remote = MinerSettings(engine=EngineSpec(kind="remote", remote_url="http://x", remote_model="k3"))
    assert any("--checkpoint" in problem for problem in remote.problems())


def test_the_cheating_script_adds_its_options_to_the_miners():
    module = importlib.import_module("localnet.cheats.miner")
    settings, extras = read_miner_settings(REQUIRED + ["--cheat", "buffer", "--token-delay-ms", "20"], {},
                                           extra=module.CHEAT_OPTIONS)
    assert extras == {"cheat": {"kind": "buffer", "token_delay_ms": 20.0, "long_tokens": 512}}
    assert settings.chain.netuid == 7


# ---------------------------------------------------------------- budgets
def neuron(uid, stake, permit=True):
    return NeuronInfo(uid=uid, hotkey=f"hk{uid}", coldkey=f"ck{uid}", stake=stake, validator_permit=permit,
                      endpoint=None, last_update=0, block_at_registration=0)


def test_budgets_follow_stake_share_with_floors_and_the_capacity_cap():
    snapshot = MetagraphSnapshot(netuid=3, block=10, neurons=(
        neuron(0, 900.0), neuron(1, 90.0), neuron(2, 10.0), neuron(3, 1.0), neuron(4, 5000.0, permit=False)))
    settings = AccessSettings(min_validator_stake=5.0, requests_per_window=1000, min_requests=20, min_streams=1,
                              overcommit=2.0)
    access = ValidatorAccess(snapshot, settings, capacity=8)
    big, mid, small = (access.check(f"hk{uid}") for uid in (0, 1, 2))
    # stake shares among eligible validators: 0.9, 0.09, 0.01
    assert (big.requests_per_window, mid.requests_per_window, small.requests_per_window) == (900, 90, 20)
    assert (big.max_streams, mid.max_streams, small.max_streams) == (8, 2, 1)
    for hotkey, code in (("hk3", "insufficient_stake"), ("hk4", "no_validator_permit"), ("nobody", "not_registered")):
        with pytest.raises(Refusal) as refused:
            access.check(hotkey)
        assert (refused.value.status, refused.value.code) == (403, code)
    with pytest.raises(Refusal) as refused:
        ValidatorAccess(None, settings, capacity=8).check("hk0")
    assert (refused.value.status, refused.value.code) == (503, "metagraph_unavailable")


def test_request_bucket_refills_over_the_window_and_streams_are_capped():
    budgets = CallerBudgets(window_s=10.0, capacity=2)
    budget = CallerBudget(uid=0, stake=1.0, requests_per_window=5, max_streams=2)
    for _ in range(5):
        budgets.take_request("a", budget, now=100.0)
    with pytest.raises(Refusal) as refused:
        budgets.take_request("a", budget, now=100.0)
    assert refused.value.code == "rate_limited" and refused.value.retry_after_s == pytest.approx(2.0)
    budgets.take_request("a", budget, now=102.0)  # one request refilled after window / size seconds
    budgets.take_request("b", budget, now=102.0)  # another caller has its own bucket
    budgets.open_stream("a", budget)
    budgets.open_stream("b", budget)
    with pytest.raises(Refusal) as refused:
        budgets.open_stream("a", budget)
    assert (refused.value.status, refused.value.code) == (429, "over_capacity")
    budgets.close_stream("b")
    budgets.open_stream("a", budget)
    with pytest.raises(Refusal) as refused:
        budgets.open_stream("a", budget)
    assert refused.value.code == "caller_streams"
    assert budgets.streams_in_flight == 2


# ---------------------------------------------------------------- one flag vocabulary (btcli's, the template's)
@pytest.mark.parametrize("argv", [
    ["--wallet-name", "w1", "--wallet-hotkey", "h1", "--wallet-path", "/wallets", "--network", "test"],
    ["-w", "w1", "-H", "h1", "--wallet-path", "/wallets", "-n", "test"],
    ["--wallet", "w1", "-H", "h1", "--wallet-path=/wallets", "--network=test"],
    ["--wallet.name", "w1", "--wallet.hotkey", "h1", "--wallet.path", "/wallets", "--subtensor.network", "test"],
])
def test_btcli_and_template_spellings_set_the_same_settings(argv, capsys):
    settings, _ = read_miner_settings(REQUIRED + argv, {})
    assert (settings.wallet.name, settings.wallet.hotkey, settings.wallet.path) == ("w1", "h1", "/wallets")
    assert settings.chain.network == "test"
    assert "deprecated" not in capsys.readouterr().err


def test_btcli_environment_variables_are_read_and_flags_still_win():
    env = {"BT_WALLET": "env-w", "BT_WALLET_HOTKEY": "env-h", "BT_WALLET_PATH": "/env", "BT_NETWORK": "ws://n:9944"}
    settings, _ = read_miner_settings(REQUIRED, env)
    assert (settings.wallet.name, settings.wallet.hotkey, settings.wallet.path) == ("env-w", "env-h", "/env")
    assert settings.chain.network == "ws://n:9944"
    settings, _ = read_miner_settings(REQUIRED + ["-w", "flag-w", "--subtensor.chain_endpoint", "wss://x:443"], env)
    assert settings.wallet.name == "flag-w" and settings.chain.network == "wss://x:443"


def test_old_spellings_still_work_with_one_warning_line(capsys):
    settings, _ = read_miner_settings(REQUIRED + ["--chain", "local"], {"K3_WALLET_NAME": "old", "K3_CHAIN": "x"})
    err = capsys.readouterr().err.strip().splitlines()
    assert settings.chain.network == "local" and settings.wallet.name == "old"
    assert any("--chain is deprecated, use --network" in line for line in err)
    assert any("K3_WALLET_NAME is deprecated, use BT_WALLET" in line for line in err)
    # the new variable wins over the old one, silently
    settings, _ = read_miner_settings(REQUIRED, {"K3_WALLET_NAME": "old", "BT_WALLET": "new"})
    assert settings.wallet.name == "new" and "deprecated" not in capsys.readouterr().err


def test_the_axon_port_alias_and_a_bad_network_are_handled(capsys):
    settings, _ = read_miner_settings(REQUIRED + ["--axon.port", "8123"], {})
    assert settings.server.port == 8123
    with pytest.raises(SystemExit) as exit_:
        read_miner_settings(REQUIRED + ["--network", "mainnet"], {})
    assert exit_.value.code == 2 and "not a network" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        read_miner_settings(REQUIRED, {"BT_NETWORK": "ftp://x"})
    assert "BT_NETWORK='ftp://x'" in capsys.readouterr().err


def test_the_settings_dump_is_one_line():
    settings, _ = read_miner_settings(REQUIRED + ["--remote-api-key", "sekrit"], {})
    dump = describe_values(miner_options(), dataclasses.asdict(settings))
    assert "\n" not in dump and "--netuid=7" in dump and "sekrit" not in dump and "--remote-api-key=***" in dump
