"""`python -m chain`: drive the embedded devnet and make wallets for it.

    python -m chain devnet create --db PATH [--block-interval S] [--tempo N ...]   # prints the netuid
    python -m chain wallet create --wallet-path DIR --wallet-name N --wallet-hotkey H
    python -m chain register --db PATH --netuid N --wallet-path DIR -w N -H H
    python -m chain stake --db PATH --netuid N --wallet-path DIR -w N -H H --amount X
    python -m chain metagraph --db PATH --netuid N [--json]
    python -m chain block --db PATH
    python -m chain hyperparameters --db PATH --netuid N [--json]
    python -m chain set-hyperparameter --db PATH --netuid N NAME VALUE
    python -m chain epochs --db PATH --netuid N [--last K] [--json]
    python -m chain advance --db PATH --blocks N
    python -m chain metagraph --network test --netuid N          # a subtensor node (also: block,
    python -m chain register --network local --netuid N -w N -H H    hyperparameters, register)

Wallet flags are btcli's: --wallet-name/-w (also --wallet, --wallet.name; env BT_WALLET),
--wallet-hotkey/-H (--wallet.hotkey; BT_WALLET_HOTKEY), --wallet-path (--wallet.path;
BT_WALLET_PATH). --name and --hotkey still work, with a warning.

`--network` names the chain as btcli does (finney, test, local, ws://HOST:PORT, or devnet:PATH, the same as
--db PATH); reading a subnet and registering work on a subtensor node too, the rest only on the devnet (on a
node, stake with `btcli stake add` and change hyperparameters with `btcli hparams set`).

A mistake the user can fix (a missing database or wallet, an unknown subnet, a bad value, a chain
refusal such as an already registered hotkey) prints `error: ...` and exits with status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import asdict

from chain import connect
from chain.cli import DeprecatedFlag
from chain.devnet import DEFAULT_BLOCK_INTERVAL, HYPERPARAMETERS, DevnetChain, coerce_hyperparameter
from chain.interface import ChainError


class UserError(Exception):
    """Something the person at the terminal can fix; the message says how."""


def network_spec(text: str) -> str:
    """btcli's --network (finney, test, local, ws://, wss://) or devnet:PATH."""
    if text in ("finney", "test", "local") or text.startswith(("ws://", "wss://", "devnet:")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r} is not a network: finney, test, local, ws://HOST:PORT or devnet:PATH")


# ---------------------------------------------------------------- wallets
def _wallet(path: str, name: str, hotkey: str, must_exist: bool = True):
    import bittensor as bt

    wallet = bt.Wallet(name, hotkey, path=os.path.expanduser(path))
    if must_exist:
        missing = [
            what for what, f in (("coldkey", wallet.coldkeypub_file), ("hotkey", wallet.hotkey_file))
            if not f.exists_on_device()
        ]
        if missing:
            raise UserError(
                f"wallet {name}/{hotkey} under {path} has no {' or '.join(missing)}; create it with "
                f"`python -m chain wallet create --wallet-path {path} --wallet-name {name} --wallet-hotkey {hotkey}`"
            )
    return wallet


def create_wallet(path: str, name: str, hotkey: str) -> dict:
    """Unencrypted coldkey and hotkey (a local trust domain); existing key files are kept."""
    wallet = _wallet(path, name, hotkey, must_exist=False)
    created = []
    if not wallet.coldkeypub_file.exists_on_device():
        wallet.create_new_coldkey(use_password=False, suppress=True)
        created.append("coldkey")
    if not wallet.hotkey_file.exists_on_device():
        wallet.create_new_hotkey(use_password=False, suppress=True)
        created.append("hotkey")
    return {
        "name": name,
        "hotkey_name": hotkey,
        "coldkey": wallet.coldkeypub.ss58_address,
        "hotkey": wallet.hotkey.ss58_address,
        "created": created,
    }


# ---------------------------------------------------------------- output
def _short(address: str) -> str:
    return f"{address[:6]}..{address[-4:]}"


def metagraph_table(snapshot) -> str:
    header = (f"{'uid':>4}  {'hotkey':<12}  {'coldkey':<12}  {'stake':>12}  {'vp':>2}  {'endpoint':<21}  "
              f"{'updated':>8}  {'incentive':>9}  {'dividends':>9}  {'emission':>10}")
    lines = [f"subnet {snapshot.netuid}  block {snapshot.block}  tempo {snapshot.tempo}  "
             f"{len(snapshot)} neurons", header]
    for n in snapshot.neurons:
        endpoint = f"{n.endpoint.ip}:{n.endpoint.port}" if n.endpoint else "-"
        lines.append(
            f"{n.uid:>4}  {_short(n.hotkey):<12}  {_short(n.coldkey):<12}  {n.stake:>12.4f}  "
            f"{'*' if n.validator_permit else '':>2}  {endpoint:<21}  {n.last_update:>8}  {n.incentive:>9.4f}  "
            f"{n.dividends:>9.4f}  {n.emission:>10.4f}"
        )
    return "\n".join(lines)


def _neuron_json(n) -> dict:
    d = asdict(n)
    d["endpoint"] = None if n.endpoint is None else {**asdict(n.endpoint), "url": n.endpoint.url}
    return d


# ---------------------------------------------------------------- commands
def _open(db: str) -> DevnetChain:
    if not os.path.exists(db):
        raise UserError(f"no devnet database at {db}; create one with `python -m chain devnet create --db {db}`")
    return DevnetChain(db)


def _on_node(args) -> bool:
    """The command addresses a subtensor node (--network finney/test/local/ws://), not the devnet."""
    return bool(getattr(args, "network", None)) and not args.network.startswith("devnet:")


def _chain_of(args):
    if _on_node(args):
        return connect(args.network)
    db = args.network[len("devnet:"):] if getattr(args, "network", None) else args.db
    return _open(os.path.expanduser(db))


async def _with_chain(args, action):
    chain = _chain_of(args)
    try:
        return await action(chain)
    finally:
        await chain.close()


async def run(args) -> str:
    """The text to print for a parsed command line."""
    if args.command == "wallet":
        info = create_wallet(args.wallet_path, args.wallet_name, args.wallet_hotkey)
        if args.json:
            return json.dumps(info)
        made = ", ".join(info["created"]) or "nothing (both keys existed)"
        return f"wallet {args.wallet_name}/{args.wallet_hotkey}: coldkey {info['coldkey']}  hotkey {info['hotkey']}  created {made}"

    if args.command == "devnet":
        exists = os.path.exists(args.db)
        if exists and not args.add_subnet:
            raise UserError(f"{args.db} already exists; delete it for a fresh devnet, or pass --add-subnet "
                            f"to add another subnet to it")
        hyperparameters = {
            name: coerce_hyperparameter(name, getattr(args, name))
            for name in HYPERPARAMETERS if getattr(args, name) is not None
        }
        owner = args.owner
        if owner is None and args.wallet_path:
            owner = _wallet(args.wallet_path, args.wallet_name, args.wallet_hotkey)
        if owner is None:
            from bittensor.sp_core import ss58_encode

            owner = ss58_encode(bytes(32))  # nobody's key: a devnet subnet needs no real owner
        os.makedirs(os.path.dirname(os.path.abspath(args.db)), exist_ok=True)  # runs/node/devnet.sqlite: make runs/node
        chain = DevnetChain(args.db, block_interval=None if exists else args.block_interval, create=True)
        try:
            netuid = await chain.create_subnet(owner, netuid=args.netuid, **hyperparameters)
        finally:
            await chain.close()
        return str(netuid)

    if args.command == "register":
        wallet = _wallet(args.wallet_path, args.wallet_name, args.wallet_hotkey)
        return str(await _with_chain(args, lambda c: c.register(wallet, args.netuid)))

    if args.command in ("stake", "set-hyperparameter", "epochs", "advance") and _on_node(args):
        how = {"stake": "btcli stake add --netuid N --amount-tao X -w WALLET -H HOTKEY --network NET",
               "set-hyperparameter": "btcli hparams set --netuid N --name NAME --value VALUE --network NET"}
        raise UserError(f"{args.command} drives the embedded devnet; on a subtensor node use "
                        f"{how.get(args.command, 'btcli')}")

    if args.command == "stake":
        wallet = _wallet(args.wallet_path, args.wallet_name, args.wallet_hotkey)
        total = await _with_chain(args, lambda c: c.add_stake(wallet, wallet, args.netuid, args.amount))
        return f"{total:g}"

    if args.command == "metagraph":
        snapshot = await _with_chain(args, lambda c: c.metagraph(args.netuid))
        if args.json:
            return json.dumps({"netuid": snapshot.netuid, "block": snapshot.block, "tempo": snapshot.tempo,
                               "neurons": [_neuron_json(n) for n in snapshot.neurons]})
        return metagraph_table(snapshot)

    if args.command == "block":
        return str(await _with_chain(args, lambda c: c.block()))

    if args.command == "hyperparameters":
        if _on_node(args):
            params = asdict(await _with_chain(args, lambda c: c.hyperparameters(args.netuid)))
        else:
            params = await _with_chain(args, lambda c: c.subnet_parameters(args.netuid))
        if args.json:
            return json.dumps(params)
        return "\n".join(f"{name:<22} {value}" for name, value in params.items())

    if args.command == "set-hyperparameter":
        value = await _with_chain(args, lambda c: c.set_hyperparameter(args.netuid, args.name, args.value))
        return f"{args.name} = {value}"

    if args.command == "epochs":
        history = await _with_chain(args, lambda c: c.epoch_history(args.netuid, limit=args.last))
        if args.json:
            return json.dumps([
                {"block": e.block, "emission_budget": e.emission_budget,
                 "neurons": [{**asdict(n), "bonds": {str(k): v for k, v in n.bonds.items()}} for n in e.neurons]}
                for e in history
            ])
        lines = []
        for e in history:
            lines.append(f"epoch at block {e.block} (budget {e.emission_budget:g})")
            lines.extend(
                f"  uid {n.uid:>4}  incentive {n.incentive:.4f}  dividends {n.dividends:.4f}  "
                f"emission {n.emission:.4f}  {'permit' if n.validator_permit else ''}"
                for n in e.neurons
            )
        return "\n".join(lines) or "no epoch has run yet"

    if args.command == "advance":
        return str(await _with_chain(args, lambda c: c.advance_blocks(args.blocks)))

    raise UserError(f"unknown command {args.command}")


# btcli 11's spellings first, then the subnet template's dotted forms; the old spelling warns.
WALLET_FLAGS = (
    (("--wallet-name", "-w", "--wallet", "--wallet.name"), "--name", "BT_WALLET", "wallet_name",
     "wallet (coldkey) name"),
    (("--wallet-hotkey", "-H", "--wallet.hotkey"), "--hotkey", "BT_WALLET_HOTKEY", "wallet_hotkey", "hotkey name"),
    (("--wallet-path", "--wallet.path"), None, "BT_WALLET_PATH", "wallet_path", "wallets directory"),
)


def parser() -> argparse.ArgumentParser:
    # named as started: the console script k3-chain, else the module (never a file path inside the package)
    prog = "k3-chain" if os.path.basename(sys.argv[0]) == "k3-chain" else "python -m chain"
    p = argparse.ArgumentParser(prog=prog, description="The embedded devnet and its wallets.")
    sub = p.add_subparsers(dest="command", required=True)

    def db(sp, netuid=True):
        where = sp.add_mutually_exclusive_group(required=True)
        where.add_argument("--db", help="devnet SQLite file")
        where.add_argument("--network", "-n", type=network_spec, metavar="NETWORK",
                           help="finney, test, local, ws://HOST:PORT (a subtensor node), or devnet:PATH")
        if netuid:
            sp.add_argument("--netuid", type=int, required=True)

    def wallet(sp, required=True):
        for flags, old, env, dest, text in WALLET_FLAGS:
            default = os.environ.get(env)
            if dest == "wallet_path" and default is not None:
                default = os.path.expanduser(default)
            if default is None and not required and dest != "wallet_path":
                default = "default"  # btcli's default wallet and hotkey names
            sp.add_argument(*flags, dest=dest, default=default,
                            help=f"{text} [env {env}]" + (" (required)" if required else ""))
            if old:
                sp.add_argument(old, dest=dest, action=DeprecatedFlag, new=flags[0], help=argparse.SUPPRESS)
        sp.set_defaults(wallet_required=required)

    devnet = sub.add_parser("devnet", help="create a devnet").add_subparsers(dest="action", required=True)
    create = devnet.add_parser("create", help="create the database and one subnet; prints the netuid")
    db(create, netuid=False)
    create.add_argument("--block-interval", type=float, default=DEFAULT_BLOCK_INTERVAL, help="seconds per block")
    create.add_argument("--netuid", type=int, default=None, help="default: the lowest free netuid from 1")
    create.add_argument("--owner", default=None, help="owner coldkey ss58 (or give a wallet)")
    create.add_argument("--add-subnet", action="store_true", help="add a subnet to an existing database")
    wallet(create, required=False)
    for name, spec in HYPERPARAMETERS.items():
        create.add_argument(f"--{name.replace('_', '-')}", dest=name, default=None,
                            help=f"{spec.rule} (default {spec.default})")

    wallets = sub.add_parser("wallet", help="wallets").add_subparsers(dest="action", required=True)
    wcreate = wallets.add_parser("create", help="create an unencrypted wallet; existing keys are kept")
    wallet(wcreate)
    wcreate.add_argument("--json", action="store_true")

    register = sub.add_parser("register", help="register a wallet's hotkey; prints the uid")
    db(register)
    wallet(register)

    stake = sub.add_parser("stake", help="stake from a wallet's coldkey to its hotkey; prints the total")
    db(stake)
    wallet(stake)
    stake.add_argument("--amount", type=float, required=True)

    metagraph = sub.add_parser("metagraph", help="the subnet's neurons")
    db(metagraph)
    metagraph.add_argument("--json", action="store_true")

    db(sub.add_parser("block", help="the current block"), netuid=False)

    hyper = sub.add_parser("hyperparameters", help="a subnet's hyperparameters")
    db(hyper)
    hyper.add_argument("--json", action="store_true")

    sethp = sub.add_parser("set-hyperparameter", help="change a subnet hyperparameter")
    db(sethp)
    sethp.add_argument("name", choices=sorted(HYPERPARAMETERS))
    sethp.add_argument("value")

    epochs = sub.add_parser("epochs", help="the last epochs' results")
    db(epochs)
    epochs.add_argument("--last", type=int, default=1)
    epochs.add_argument("--json", action="store_true")

    advance = sub.add_parser("advance", help="move the devnet clock forward; prints the new block")
    db(advance, netuid=False)
    advance.add_argument("--blocks", type=int, required=True)
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(argv)
    if getattr(args, "wallet_required", False):
        missing = [flags[0] for flags, _, env, dest, _ in WALLET_FLAGS if getattr(args, dest) is None]
        if missing:
            p.error(f"{args.command}: {', '.join(missing)} required (or set "
                    f"{', '.join(env for flags, _, env, _, _ in WALLET_FLAGS if flags[0] in missing)})")
    try:
        print(asyncio.run(run(args)))
    except (UserError, ChainError, ValueError, TypeError) as e:
        name = getattr(e, "name", None) if isinstance(e, ChainError) else None
        print(f"error: {name + ': ' if name else ''}{e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
