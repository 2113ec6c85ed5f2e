"""Command-line flags and environment variables -> settings dataclasses, in one place.

A setting is stated once, on its settings dataclass: `setting(default, "help", ...)` makes the field
and says how it is spelled on the command line (its flag, when it is not the field's name, its
environment variable, its reader, its group). `settings_options` walks a settings class and derives
its table of `Option`s: where the value goes (a dotted path such as "server.port" or
"engine.settings.max_context"), its flag, its environment variable, how to read it from text, its
default (the dataclass's) and a help line. `read_options` resolves each option (flag, else
environment variable, else default) into a nested dict and `build_settings` turns that dict into the
program's (nested, frozen) settings dataclasses. `--help` lists every option by group with its
environment variable and default; `options_table` renders the same table as Markdown for the README.

A class that cannot carry flags itself (`inference.serving.EngineSpec`, `protocol.client.ClientTimeouts`:
those layers know nothing of command lines) gets its `Setting`s from the `Section` that holds it.
A table written row by row (`Option(...)`, `bind_defaults`) still works, for scripts with few options.

Shared groups live here so the miner and the validator spell them the same way: wallet and chain
(with their dataclasses `WalletSettings`, `ChainSettings`), engine (`engine_section`) and logging
(`LOG_LEVEL`, `LOG_FORMAT`).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

_MISSING = object()


class SettingsError(ValueError):
    """An option value (from a flag or from the environment) that cannot be used."""


# ---------------------------------------------------------------- value readers
def flag(text: str) -> bool:
    """A yes/no value from the environment: 1/true/yes/on or 0/false/no/off."""
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a yes/no value (use true/false, 1/0, yes/no, on/off)")


_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def byte_size(text: str) -> int:
    """A size in bytes: "1048576", "512MiB", "2GiB", "1.5GB"."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _SIZE_UNITS:
        raise ValueError(f"{text!r} is not a size (examples: 1048576, 512MiB, 2GiB, 1.5GB)")
    value = float(match.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{text!r} is not a size")
    return int(value)


def positive_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{text!r} must be a positive number")
    return value


def positive_rate(text: str) -> float:
    """A positive rate; "inf" allowed (e.g. a prefill rate of inf: no prefill allowance)."""
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"{text!r} must be a positive rate (or inf)")
    return value


def non_negative_float(text: str) -> float:
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{text!r} must be a number >= 0")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"{text!r} must be an integer >= 0")
    return value


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise ValueError(f"{text!r} is not a port (0..65535; 0 picks a free port)")
    return value


def optional_int(text: str) -> int | None:
    """An integer, or nothing for an empty string."""
    return None if text.strip() == "" else int(text)


def optional_float(text: str) -> float | None:
    """A finite number, or nothing for an empty string."""
    if text.strip() == "":
        return None
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text!r} is not a finite number")
    return value


def name_list(text: str) -> tuple[str, ...]:
    """Comma-separated names (or addresses): "a,b, c" -> ("a", "b", "c"); empty: none."""
    return tuple(word.strip() for word in text.split(",") if word.strip())


def optional_text(text: str) -> str | None:
    return None if text.strip() == "" else text


def expanded_path(text: str) -> str:
    return os.path.expanduser(text)


NETWORKS = ("finney", "test", "local")


class BadValue(argparse.ArgumentTypeError, ValueError):
    """A value a reader refuses with its own message (argparse prints it as is)."""


def network_spec(text: str) -> str:
    """A chain, as btcli's --network names one (finney, test, local, ws://HOST:PORT, wss://...), or
    devnet:PATH for the embedded SQLite devnet."""
    value = text.strip()
    if value in NETWORKS or value.startswith(("ws://", "wss://")) and len(value) > 6:
        return value
    if value.startswith("devnet:") and len(value) > len("devnet:"):
        return os.path.expanduser(value[:7]) + os.path.expanduser(value[7:])
    raise BadValue(f"{text!r} is not a network: use finney, test, local, ws://HOST:PORT, wss://... "
                     "or devnet:PATH")


def device_spec(text: str) -> str:
    """Where a model computes: cpu, cuda (the current GPU) or cuda:N. Whether this machine has it is the
    settings' problems() to say (one line), not the reader's."""
    value = text.strip().lower()
    if not re.fullmatch(r"cpu|cuda(:\d+)?", value):
        raise BadValue(f"{text!r} is not a device: use cpu, cuda or cuda:N")
    return value


# argparse prints the reader's __name__ in "invalid ... value" messages.
for _reader, _name in ((flag, "yes/no"), (byte_size, "size"), (positive_float, "positive number"),
                       (non_negative_float, "number >= 0"), (non_negative_int, "integer >= 0"),
                       (port_number, "port"), (optional_int, "integer"), (optional_float, "number"),
                       (optional_text, "text"), (expanded_path, "path"), (network_spec, "network"),
                       (device_spec, "device"), (name_list, "list")):
    _reader.__name__ = _name


# ---------------------------------------------------------------- the table
class _FromSettings:
    def __repr__(self) -> str:
        return "FROM_SETTINGS"


# An option's default when the settings dataclass holds it: `bind_defaults` reads it from there.
FROM_SETTINGS: Any = _FromSettings()


@dataclass(frozen=True)
class Option:
    """One setting: `dest` is its dotted path in the settings dataclasses. Its default is the
    dataclass field's (filled in by `bind_defaults`); `default=` only for an option that has no
    settings dataclass behind it."""

    dest: str
    flag: str
    env: str | None
    read: Callable[[str], Any]
    help: str
    group: str = "general"
    choices: tuple = ()
    required: bool = False
    secret: bool = False  # never printed back (API keys)
    metavar: str | None = None
    default: Any = FROM_SETTINGS
    # Other spellings, accepted silently and listed in --help: btcli's short flags (-w, -H, -n) and
    # the subnet template's dotted forms (--wallet.name, --subtensor.network, --axon.port).
    aliases: tuple[str, ...] = ()
    # Old spellings, still accepted with a one-line warning and left out of --help.
    deprecated: tuple[str, ...] = ()
    # Old environment variables, read (with a one-line warning) when `env` is not set.
    deprecated_env: tuple[str, ...] = ()

    @property
    def spellings(self) -> tuple[str, ...]:
        """Every flag that sets this option, the main one first."""
        return (self.flag,) + self.aliases + self.deprecated

    @property
    def is_switch(self) -> bool:
        return self.read is flag


def _describe_default(option: Option) -> str:
    if option.required:
        return "required"
    if option.secret and option.default:
        return "(set)"
    if option.default is None or option.default == "" or option.default == ():
        return "unset"
    if option.is_switch:
        return "on" if option.default else "off"
    if option.read is byte_size:
        return _human_size(option.default)
    return str(option.default)


def _human_size(size: int) -> str:
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return str(size)


def _metavar(option: Option) -> str:
    if option.metavar:
        return option.metavar
    if option.flag.endswith("-s"):
        return "SECONDS"
    if option.read in (int, non_negative_int, optional_int):
        return "N"
    if option.read in (float, positive_float, non_negative_float):
        return "X"
    return option.dest.rsplit(".", 1)[-1].upper()


def program_name(console: str, module: str) -> str:
    """The program's name in usage lines, as the user started it: `python -m neurons.miner`, `python
    neurons/miner.py` (the path as typed), or the console script `console` (k3-miner), which is also the
    answer when it cannot tell (called in-process, as tests do)."""
    for i, word in enumerate(sys.orig_argv[1:-1], 1):  # the interpreter's own options come first
        if word == "-m":
            return f"python -m {module}" if sys.orig_argv[i + 1] == module else console
        if not word.startswith("-"):
            break
    script = sys.argv[0] if sys.argv else ""
    if os.path.basename(script) == module.rsplit(".", 1)[-1] + ".py":
        return f"python {script}"
    return console


def build_parser(options: Sequence[Option], prog: str | None = None, description: str | None = None,
                 epilog: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser for `options`; every flag defaults to "not given" so that the
    environment can fill it in `read_options`."""
    _check_table(options)
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option in options:
        group = groups.get(option.group) or groups.setdefault(option.group, parser.add_argument_group(option.group))
        where = f"env {option.env}; " if option.env else ""
        text = f"{option.help} [{where}default: {_describe_default(option)}]"
        kwargs: dict[str, Any] = dict(dest=option.dest, default=argparse.SUPPRESS, help=text)
        if option.is_switch:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = option.read
            kwargs["metavar"] = _metavar(option)
            if option.choices:
                kwargs["choices"] = option.choices
                kwargs["metavar"] = "{" + ",".join(map(str, option.choices)) + "}"
        group.add_argument(option.flag, *option.aliases, **kwargs)
        if option.deprecated:
            group.add_argument(*option.deprecated, **{**kwargs, "help": argparse.SUPPRESS})
    return parser


def _warn_deprecated(options: Sequence[Option], argv: Sequence[str], environ: Mapping[str, str],
                     parser: argparse.ArgumentParser) -> None:
    """One line on stderr per old spelling used (flag or environment variable)."""
    for option in options:
        for old in option.deprecated:
            if any(token == old or token.startswith(old + "=") for token in argv):
                print(f"{parser.prog}: warning: {old} is deprecated, use {option.flag}", file=sys.stderr)
        if option.env and option.env in environ:
            continue
        for old in option.deprecated_env:
            if old in environ:
                print(f"{parser.prog}: warning: environment variable {old} is deprecated, use {option.env}",
                      file=sys.stderr)
                break


def read_options(
    options: Sequence[Option],
    argv: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
    prog: str | None = None,
    description: str | None = None,
) -> dict[str, Any]:
    """Resolve every option (flag, else environment variable, else default) into a nested dict
    keyed by the parts of `dest`. A bad value or a missing required option exits with status 2
    and a message naming the flag and the variable (argparse's behaviour)."""
    environ = os.environ if environ is None else environ
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(options, prog, description)
    given = vars(parser.parse_args(argv))
    _warn_deprecated(options, argv, environ, parser)
    values: dict[str, Any] = {}
    for option in options:
        env = next((name for name in (option.env, *option.deprecated_env)
                    if name and environ.get(name) is not None), None)
        if option.dest in given:
            value = given[option.dest]
        elif env is not None:
            raw = environ[env]
            try:
                value = option.read(raw)
            except (TypeError, ValueError) as error:
                parser.error(f"environment variable {env}={raw!r} (for {option.flag}): {error}")
            if option.choices and value not in option.choices:
                parser.error(f"environment variable {env}={raw!r} (for {option.flag}) must be one of "
                             f"{', '.join(map(str, option.choices))}")
        elif option.required:
            where = f" or set {option.env}" if option.env else ""
            parser.error(f"{option.flag} is required: {option.help}; pass {option.flag}{where}")
        else:
            value = option.default
        _put(values, option.dest, value)
    return values


def _put(tree: dict, dest: str, value: Any) -> None:
    *parents, leaf = dest.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[leaf] = value


def bind_defaults(settings: type | Any, options: Iterable[Option], prefix: str = "") -> tuple[Option, ...]:
    """`options` with every FROM_SETTINGS default read from `settings` (a dataclass, or an instance):
    the value at the option's `dest` (less `prefix`, e.g. "gateway") in the default instance. The
    dataclasses hold each default once; the flag table and --help show the same values."""
    instance = settings() if isinstance(settings, type) else settings
    out = []
    for option in options:
        if option.default is FROM_SETTINGS:
            path = option.dest
            if prefix:
                if not path.startswith(prefix + "."):
                    raise ValueError(f"option {option.flag} ({path}) is not under {prefix!r}")
                path = path[len(prefix) + 1:]
            node = instance
            for part in path.split("."):
                if not dataclasses.is_dataclass(node) or not hasattr(node, part):
                    raise ValueError(f"option {option.flag}: {type(instance).__name__} has no setting {option.dest!r}")
                node = getattr(node, part)
            option = dataclasses.replace(option, default=node)
        out.append(option)
    return tuple(out)


def _check_table(options: Sequence[Option]) -> None:
    unbound = [option.flag for option in options if option.default is FROM_SETTINGS]
    if unbound:
        raise ValueError(f"options without a default (bind_defaults was not applied): {', '.join(unbound)}")
    seen_dest, seen_flag, seen_env = set(), set(), set()
    for option in options:
        keys = [(seen_dest, option.dest, "dest")] + [(seen_flag, f, "flag") for f in option.spellings] + [
            (seen_env, e, "env") for e in (option.env, *option.deprecated_env)]
        for seen, key, what in keys:
            if key is not None and key in seen:
                raise ValueError(f"two options share the {what} {key!r}")
            seen.add(key)


# ---------------------------------------------------------------- settings declared on the dataclasses
_SETTING, _SECTION = "neurons.base.settings.Setting", "neurons.base.settings.Section"


@dataclass(frozen=True)
class Setting:
    """How a settings dataclass field is spelled on the command line. Left out: the flag is the field's
    name (`max_rounds`: --max-rounds), the environment variable is the section's prefix and the flag's
    words (K3_VALIDATOR_MAX_ROUNDS), the reader follows the field's type (bool: a --x/--no-x switch,
    int | None: an integer or nothing, ...) and the group is the section's."""

    help: str
    flag: str | None = None
    read: Callable[[str], Any] | None = None
    env: str | None = None  # the whole variable name, whatever the prefix (btcli's BT_WALLET)
    env_key: str | None = None  # the part after the section's prefix, when it is not the flag's words
    group: str | None = None
    choices: tuple = ()
    metavar: str | None = None
    aliases: tuple[str, ...] = ()  # see Option
    deprecated: tuple[str, ...] = ()
    deprecated_env: tuple[str, ...] = ()
    secret: bool = False
    required: bool = False

    def field(self, default: Any) -> Any:
        """The dataclass field with this default: `log_level: str = LOG_LEVEL.field("INFO")`."""
        return dataclasses.field(default=default, metadata={_SETTING: self})

    def option(self, dest: str, default: Any, env_prefix: str, group: str, kind: Any = None) -> Option:
        """The option at `dest`; `kind` is the field's type (for the reader when none is given)."""
        spelled = self.flag or "--" + dest.rsplit(".", 1)[-1].replace("_", "-")
        env = self.env or env_prefix + (self.env_key or spelled.lstrip("-").replace("-", "_").upper())
        return Option(dest, spelled, env, self.read or reader_for(kind, dest), self.help, group=self.group or group,
                      choices=self.choices, required=self.required, secret=self.secret, metavar=self.metavar,
                      default=default, aliases=self.aliases, deprecated=self.deprecated,
                      deprecated_env=self.deprecated_env)


def setting(default: Any, help: str, **how: Any) -> Any:
    """A settings dataclass field that is also an option: `port: int = setting(8091, "API port", read=port_number)`;
    `how` is `Setting`'s other fields."""
    return Setting(help, **how).field(default)


@dataclass(frozen=True)
class Section:
    """How the fields of a nested settings dataclass become options: their group and environment prefix
    (left out: the parent's), and `fields`, the `Setting` (or inner `Section`) of each field of a class
    that cannot say it itself (`EngineSpec` lives in inference/, `ClientTimeouts` in protocol/: neither
    knows about command lines). A field with neither a Setting nor a Section is not an option."""

    group: str | None = None
    env_prefix: str | None = None
    fields: Mapping[str, Setting | Section] = dataclasses.field(default_factory=dict)

    def field(self, cls: type, **defaults: Any) -> Any:
        """The dataclass field holding a `cls` made with its defaults, or with `defaults` in place of some (a program
        that reuses another's settings class with other defaults: the route miner's server is the miner's)."""
        factory = functools.partial(cls, **defaults) if defaults else cls
        return dataclasses.field(default_factory=factory, metadata={_SECTION: self})

    def options(self, settings: type | Any, dest: str = "", env_prefix: str = "", group: str = "general"
                ) -> tuple[Option, ...]:
        """The options of `settings` (a dataclass or an instance, whose values are the defaults)."""
        instance = settings() if isinstance(settings, type) else settings
        env_prefix, group = self.env_prefix or env_prefix, self.group or group
        out: list[Option] = []
        kinds = None
        for f in dataclasses.fields(instance):
            how = self.fields.get(f.name) or f.metadata.get(_SETTING) or f.metadata.get(_SECTION)
            path = f"{dest}.{f.name}" if dest else f.name
            if isinstance(how, Section):
                out += how.options(getattr(instance, f.name), path, env_prefix, group)
            elif isinstance(how, Setting):
                if how.read is None and kinds is None:
                    kinds = typing.get_type_hints(type(instance))
                out.append(how.option(path, getattr(instance, f.name), env_prefix, group,
                                      kinds.get(f.name) if kinds else None))
        return tuple(out)


def settings_options(settings: type | Any, env_prefix: str, group: str = "general", dest: str = "",
                     fields: Mapping[str, Setting | Section] | None = None) -> tuple[Option, ...]:
    """The option table of a settings dataclass, walked field by field (nested sections under their dotted
    path): every flag, its environment variable (`env_prefix` unless a section says otherwise) and its
    default, the dataclass's."""
    return Section(group, env_prefix, fields or {}).options(settings, dest)


def reader_for(kind: Any, dest: str = "") -> Callable[[str], Any]:
    """The reader of a field of type `kind`: bool, int, float, str, or one of them | None (empty: None)."""
    readers = {bool: flag, int: int, float: float, str: str}
    optional = {int: optional_int, float: optional_float, str: optional_text}
    args = typing.get_args(kind)
    if typing.get_origin(kind) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = next(arg for arg in args if arg is not type(None))
        if inner in optional:
            return optional[inner]
    elif kind in readers:
        return readers[kind]
    raise TypeError(f"setting {dest!r} of type {kind!r}: give it a reader (read=...)")


# ---------------------------------------------------------------- dataclasses
def build_settings(cls: type, values: Mapping[str, Any], base=None):
    """An instance of dataclass `cls` from a nested dict: a dict value for a dataclass-typed field
    becomes that dataclass (recursively); fields absent from `values` keep their defaults (or those
    of `base`, an existing instance). An unknown key is a mistake in the option table and raises."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise TypeError(f"{cls.__name__} has no settings named {unknown}")
    converted = {}
    for name, value in values.items():
        if isinstance(value, Mapping):
            inner_base = getattr(base, name) if base is not None else _default_instance(fields[name])
            inner_cls = hints.get(name)
            if not (isinstance(inner_cls, type) and dataclasses.is_dataclass(inner_cls)):
                inner_cls = type(inner_base) if inner_base is not None else None
            if inner_cls is None:
                raise TypeError(f"{cls.__name__}.{name} is not a dataclass but the options give it sub-settings")
            value = build_settings(inner_cls, value, inner_base)
        converted[name] = value
    return dataclasses.replace(base, **converted) if base is not None else cls(**converted)


def _default_instance(field: dataclasses.Field):
    """The field's default when it is a dataclass instance (given directly or by a factory)."""
    if field.default is not dataclasses.MISSING:
        return field.default if dataclasses.is_dataclass(field.default) else None
    if field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = field.default_factory()  # type: ignore[misc]
        return value if dataclasses.is_dataclass(value) else None
    return None


# ---------------------------------------------------------------- documentation
def options_table(options: Iterable[Option]) -> str:
    """Markdown: flag, environment variable, default, meaning."""
    lines = ["| flag | environment | default | meaning |", "|---|---|---|---|"]
    for option in options:
        spelled = ", ".join(f"`{f}`" for f in (option.flag,) + option.aliases)
        lines.append(f"| {spelled} | `{option.env or '-'}` | {_describe_default(option)} | {option.help} |")
    return "\n".join(lines)


def describe_values(options: Iterable[Option], values: Mapping[str, Any]) -> str:
    """Every `flag=value` on one line, for the DEBUG log at start-up; secrets are masked."""
    lines = []
    for option in options:
        node: Any = values
        for part in option.dest.split("."):
            node = node.get(part, _MISSING) if isinstance(node, Mapping) else _MISSING
        if node is _MISSING:
            continue
        shown = "***" if option.secret and node else node
        lines.append(f"{option.flag}={shown}")
    return " ".join(lines)


# ---------------------------------------------------------------- shared groups
@dataclass(frozen=True)
class WalletSettings:
    """The wallet, spelled as btcli 11 spells it (flags and BT_* variables), with the subnet template's
    dotted forms as aliases."""

    name: str = setting("default", "bittensor wallet (coldkey) name", flag="--wallet-name", env="BT_WALLET",
                        aliases=("-w", "--wallet", "--wallet.name"), deprecated_env=("K3_WALLET_NAME",),
                        metavar="NAME")
    hotkey: str = setting("default", "hotkey name inside the wallet; it signs answers and is the on-chain identity",
                          flag="--wallet-hotkey", aliases=("-H", "--wallet.hotkey"),
                          deprecated_env=("K3_WALLET_HOTKEY",), metavar="NAME")
    path: str = setting("~/.bittensor/wallets", "directory holding the wallets", flag="--wallet-path",
                        read=expanded_path, aliases=("--wallet.path",), deprecated_env=("K3_WALLET_PATH",),
                        metavar="DIR")


WALLET = Section(group="wallet", env_prefix="BT_")


class WalletNotFound(ValueError):
    """The wallet named by the settings has no hotkey file."""


def open_wallet(settings: WalletSettings):
    """The bittensor wallet the settings name; its hotkey file must exist (it signs and is the identity)."""
    import bittensor as bt  # noqa: PLC0415 (the SDK takes a second to import; only here is it needed)

    wallet = bt.Wallet(settings.name, settings.hotkey, path=str(os.path.expanduser(settings.path)))
    if not wallet.hotkey_file.exists_on_device():
        raise WalletNotFound(
            f"no hotkey file at {wallet.hotkey_file.path}: create it with `btcli wallet new-hotkey "
            f"-w {settings.name} -H {settings.hotkey} --wallet-path {settings.path}` "
            "or point --wallet-name/--wallet-hotkey/--wallet-path at an existing one")
    return wallet


def hotkey_address(settings: WalletSettings, hotkey: str) -> str:
    """An SS58 address as given, or the address of the hotkey named `hotkey` in the wallet `settings` name (the
    same coldkey directory): how an operator names its own hotkeys (WalletNotFound when there is no such file)."""
    from bittensor.sp_core import ss58_decode  # noqa: PLC0415 (the SDK takes a second to import)

    try:
        ss58_decode(hotkey)
        return hotkey
    except Exception:  # noqa: BLE001 (not an address: a hotkey name)
        pass
    return open_wallet(dataclasses.replace(settings, hotkey=hotkey)).hotkey.ss58_address


@dataclass(frozen=True)
class ChainSettings:
    """btcli's --network/-n and BT_NETWORK, the template's --subtensor.network / --subtensor.chain_endpoint;
    --chain and K3_CHAIN are the old spellings."""

    network: str = setting("finney", "chain to use: finney, test, local, a ws:// / wss:// URL, or devnet:PATH "
                           "(embedded SQLite devnet)", env="BT_NETWORK", read=network_spec, metavar="NETWORK",
                           aliases=("-n", "--subtensor.network", "--subtensor.chain_endpoint"),
                           deprecated=("--chain",), deprecated_env=("K3_CHAIN",))
    netuid: int = setting(1, "the subnet's netuid (btcli has no variable for it)", required=True)
    metagraph_refresh_s: float = setting(60.0, "seconds between metagraph reads", read=positive_float)
    timeout_s: float = setting(30.0, "deadline of one chain read or write; on expiry the last metagraph is kept",
                               flag="--chain-timeout-s", read=positive_float)


CHAIN = Section(group="chain", env_prefix="K3_")


def wallet_options() -> tuple[Option, ...]:
    """`WalletSettings`' options (dest "wallet.*"), for a table written row by row: their defaults are
    left to `bind_defaults` (FROM_SETTINGS)."""
    return tuple(dataclasses.replace(o, default=FROM_SETTINGS) for o in WALLET.options(WalletSettings, "wallet"))


def chain_options() -> tuple[Option, ...]:
    """`ChainSettings`' options (dest "chain.*"), for a table written row by row (see wallet_options)."""
    return tuple(dataclasses.replace(o, default=FROM_SETTINGS) for o in CHAIN.options(ChainSettings, "chain"))


# The flags of `inference.serving.EngineSpec` (inference/ knows nothing of command lines): its fields'
# defaults are the engine's, the spellings are here. Fields left out are not options.
ENGINE_FIELDS: dict[str, Setting | Section] = dict(
    kind=Setting("what serves the model: reference (in-process model), sharded (shard processes), remote "
                 "(an OpenAI-compatible server such as vLLM or SGLang)", flag="--engine", env_key="KIND",
                 choices=("reference", "sharded", "remote")),
    checkpoint=Setting("checkpoint directory (reference and sharded: the weights; remote: at least config.json, "
                       "k3_manifest.json and the tokenizer, for the fingerprint and text prompts)", metavar="DIR"),
    plan=Setting("sharded: placement plan file from k3-plan", metavar="FILE"),
    shards=Setting("sharded: number of local shard processes (a simple plan is built)", metavar="N"),
    shard_mode=Setting("sharded with --shards: split by pipeline stage, by expert, or both",
                       choices=("pipeline", "expert", "both")),
    shard_store=Setting("sharded across hosts: HOST:PORT where this process hosts the rendezvous store that shard "
                        "ranks 1..N-1 on other hosts join (started there with torchrun -m inference.sharding.worker)",
                        metavar="HOST:PORT"),
    remote_url=Setting("remote: base URL of the OpenAI-compatible server (the /v1 prefix is added)", metavar="URL"),
    remote_model=Setting("remote: the model name the server serves", metavar="NAME"),
    remote_api_key=Setting("remote: bearer token for the server (prefer the environment variable)", secret=True,
                           metavar="KEY"),
    remote_score_mode=Setting("remote: how the server scores prompts (prompt_logprobs for vLLM, echo for others)",
                              choices=("prompt_logprobs", "echo")),
    remote_protocol=Setting("remote: vllm (OpenAI completions with token ids and prompt_logprobs) or sglang "
                            "(SGLang's native /generate; give --remote-url without /v1)", choices=("vllm", "sglang")),
    remote_prefill_tokens_per_s=Setting(
        "remote: prompt tokens per second the server prefills at least; the first token is due "
        "--remote-first-token-floor-s + prompt/this after the request starts", flag="--remote-prefill-rate",
        read=positive_float, metavar="TOKENS_PER_S"),
    remote_first_token_floor_s=Setting("remote: the first-token deadline's floor (queueing, short prompts)",
                                       read=positive_float),
    dtype=Setting("weights dtype of the in-process model (auto: bfloat16 on a GPU, float32 on the CPU)",
                  choices=("auto", "float32", "bfloat16")),
    device=Setting("where the reference or sharded engine computes: cpu, cuda or cuda:N (sharded: cuda puts rank r "
                   "on GPU r); one line and exit 2 when CUDA is asked for and absent", read=device_spec,
                   metavar="DEVICE"),
    speculate=Setting("reference and sharded engines: speculative decoding with model-free drafts (ngram: prompt lookup; "
                      "suffix: a suffix index over prompt and output) or a draft table distilled from the checkpoint "
                      "(distilled: needs --draft-model); the output is exactly the model's",
                      choices=("none", "ngram", "suffix", "distilled")),
    draft_model=Setting("with --speculate distilled: the draft table scripts/distill_drafter.py made for the "
                        "checkpoint", metavar="FILE"),
    draft_tokens=Setting("with --speculate: most tokens drafted per step (fewer when drafts are poor)"),
    commit_layers=Setting("reference engine: commit every answer's residual states every N layers (a divisor of the "
                          "model's Attention Residuals block size), so validators can open and re-run any block of "
                          "it (docs/verification.md); -1: the model's default (4 for Kimi K3); 0: commit nothing",
                          metavar="N"),
    settings=Section(fields=dict(
        max_context=Setting("largest prompt plus output, in tokens"),
        max_concurrent_sequences=Setting("sequences served at once (the miner's declared capacity)",
                                         flag="--max-concurrent"),
        cache_memory_budget_bytes=Setting("memory for KV/state caches, e.g. 2GiB; a request that cannot fit waits "
                                          "or is refused", flag="--cache-memory", read=byte_size, metavar="SIZE"),
        max_waiting=Setting("requests that may wait for cache memory before new ones are refused"),
        forward_stall_s=Setting("the engine's watchdog: one model step running longer than this is a stall (the "
                                "scheduler restarts); raise it for a large model on slow hardware",
                                read=positive_float),
        commit_retain_s=Setting("how long the states an answer committed to are kept for validators to open",
                                read=positive_float),
        commit_max_bytes=Setting("most memory the committed states of recent answers may hold, e.g. 4GiB (the "
                                 "oldest answers go first)", flag="--commit-memory", read=byte_size, metavar="SIZE"),
        micro_batches=Setting("sharded engine: split the running sequences into up to N groups and keep one step "
                              "per group in flight, so pipeline stages work on different groups at once "
                              "(1: one step at a time; more than the number of stages gains nothing)",
                              metavar="N"),
    )),
)


def engine_section(env_prefix: str = "K3_ENGINE_") -> Section:
    """How an `EngineSpec` field of a settings class becomes the "engine" group (dest "engine.*")."""
    return Section(group="engine", env_prefix=env_prefix, fields=ENGINE_FIELDS)


def engine_options(env_prefix: str = "K3_ENGINE_") -> tuple[Option, ...]:
    """Options of `inference.serving.EngineSpec` (dest "engine.*"), with its defaults."""
    from inference.serving import EngineSpec  # noqa: PLC0415 (torch; only a table with an engine needs it)

    return engine_section(env_prefix).options(EngineSpec, "engine")


LOG_LEVEL = Setting("log level (DEBUG also logs the settings)", env="K3_LOG_LEVEL", read=str.upper, group="logging",
                    choices=("DEBUG", "INFO", "WARNING", "ERROR"))
LOG_FORMAT = Setting("one line per event: text, or json (one JSON object per line, for log collectors)",
                     env="K3_LOG_FORMAT", read=str.lower, group="logging", choices=("text", "json"))


def logging_options() -> tuple[Option, ...]:
    """The options of `log_level` / `log_format` fields (`LOG_LEVEL.field(...)`), for a table written row by row."""
    return (LOG_LEVEL.option("log_level", FROM_SETTINGS, "", "logging"),
            LOG_FORMAT.option("log_format", FROM_SETTINGS, "", "logging"))
