"""What a running fleet asks of Redis that a Redis Cluster would refuse or broadcast (issue #34).

Watches one Redis with ``MONITOR`` while the fleet works, then reports, grouped by shape (a key's
request, tenant and other ids replaced by ``*``):

- transactions (``MULTI`` … ``EXEC`` of one connection) whose keys fall in more than one hash slot —
  a cluster refuses them (``CROSSSLOT``);
- single commands whose keys fall in more than one slot (``XREADGROUP`` of several streams, ``MGET``, a
  script's keys);
- ``PUBLISH`` / ``SUBSCRIBE`` / ``PSUBSCRIBE`` channels: a cluster forwards every ``PUBLISH`` to every
  node, and a pattern subscription has no sharded twin; ``SPUBLISH``/``SSUBSCRIBE`` are the cluster's.

A command's keys are found by the server itself (``COMMAND GETKEYS``), slots with redis-py's
``key_slot``. Not part of the suite; a tool to plan the cluster work with:

    .venv/bin/python -m tools.slot_audit redis://127.0.0.1:6387/0 --seconds 60 > audit.txt
    # … meanwhile drive the fleet on that Redis (met serve, requests, batches, met top)
"""

from __future__ import annotations

import argparse
import re
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import redis
from redis.cluster import key_slot

_LINE = re.compile(r"^\d+\.\d+ \[\d+ (?P<client>[^\]]+)\] (?P<args>.*)$")
_ARGUMENT = re.compile(r'"((?:[^"\\]|\\.)*)"')
_VARIABLE = re.compile(r"(?<=[:{])[^:{}]*(?:[0-9][^:{}]*){3,}|(?<=[:{])[0-9a-f]{8,}(?=[:}]|$)")
"""A key part with three or more digits, or a long hex run: an id, a hash, a minute."""
PUBSUB = {"PUBLISH", "SUBSCRIBE", "PSUBSCRIBE", "SPUBLISH", "SSUBSCRIBE"}
KeysOf = Callable[[Sequence[str]], list[str]]


@dataclass
class Audit:
    """Counts of what crossed slots, by shape."""

    cross_slot_transactions: Counter[str] = field(default_factory=Counter)
    cross_slot_commands: Counter[str] = field(default_factory=Counter)
    pubsub: Counter[str] = field(default_factory=Counter)
    transactions: int = 0
    commands: int = 0

    def report(self) -> str:
        lines = [f"{self.commands} commands, {self.transactions} transactions watched"]
        sections = (
            ("transactions over several slots (a cluster refuses them)", self.cross_slot_transactions),
            ("single commands over several slots", self.cross_slot_commands),
            ("pub/sub (PUBLISH reaches every cluster node; patterns have no sharded twin)", self.pubsub),
        )
        for title, counts in sections:
            lines.append(f"\n## {title}: {len(counts)} shapes")
            lines += [f"{count:>8}  {shape}" for shape, count in counts.most_common()]
        return "\n".join(lines)


def shape(key: str) -> str:
    """``key`` with its ids as ``*`` (``met:run:abc123:events`` -> ``met:run:*:events``)."""
    return _VARIABLE.sub("*", key)


def parse_line(line: str) -> tuple[str, list[str]] | None:
    """A ``MONITOR`` line's client address and arguments (still escaped as ``MONITOR`` quotes them)."""
    match = _LINE.match(line)
    if match is None:
        return None
    return match["client"], _ARGUMENT.findall(match["args"])


def audit(lines: Iterable[str], keys_of: KeysOf) -> Audit:
    """Read ``MONITOR`` lines; ``keys_of`` names the keys of one command's arguments."""
    result = Audit()
    open_transactions: dict[str, list[list[str]]] = {}
    for line in lines:
        parsed = parse_line(line)
        if parsed is None or not parsed[1]:
            continue
        client, args = parsed
        name = args[0].upper()
        result.commands += 1
        if name == "MULTI":
            open_transactions[client] = []
        elif name in ("EXEC", "DISCARD"):
            commands = open_transactions.pop(client, [])
            result.transactions += 1
            if name == "EXEC":
                _transaction(commands, keys_of, result)
        elif client in open_transactions:
            open_transactions[client].append(args)
        else:
            _command(args, keys_of, result)
    return result


def _transaction(commands: list[list[str]], keys_of: KeysOf, result: Audit) -> None:
    keys = [key for args in commands for key in _keys(args, keys_of)]
    for args in commands:
        if args[0].upper() in PUBSUB:
            result.pubsub[f"{args[0].upper()} {shape(args[1])} (in MULTI)"] += 1
    if len({key_slot(key.encode()) for key in keys}) > 1:
        names = " ".join(sorted({args[0].upper() for args in commands}))
        result.cross_slot_transactions[f"[{names}] " + " ".join(sorted({shape(key) for key in keys}))] += 1


def _command(args: list[str], keys_of: KeysOf, result: Audit) -> None:
    name = args[0].upper()
    if name in PUBSUB:
        for channel in args[1:2] if name in ("PUBLISH", "SPUBLISH") else args[1:]:
            result.pubsub[f"{name} {shape(channel)}"] += 1
        return
    keys = _keys(args, keys_of)
    if len({key_slot(key.encode()) for key in keys}) > 1:
        result.cross_slot_commands[f"{name} " + " ".join(sorted({shape(key) for key in keys}))] += 1


def _keys(args: list[str], keys_of: KeysOf) -> list[str]:
    try:
        return keys_of(args)
    except redis.ResponseError:  # no keys, or a command GETKEYS cannot read
        return []


def server_keys(client: redis.Redis) -> KeysOf:
    """``COMMAND GETKEYS`` on ``client`` (which decodes its replies)."""

    def keys_of(args: Sequence[str]) -> list[str]:
        return [str(key) for key in client.execute_command("COMMAND GETKEYS", *args)]

    return keys_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url", help="the Redis to watch (redis://host:port/db)")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long to watch")
    parser.add_argument("--record", help="also write the MONITOR lines watched to this file")
    parser.add_argument("--replay", help="read MONITOR lines from this file instead of watching")
    options = parser.parse_args()
    if options.replay:
        with open(options.replay) as saved:
            lines = saved.read().splitlines()
    else:
        lines = _watch(options.url, options.seconds)
    if options.record:
        with open(options.record, "w") as record:
            record.write("\n".join(lines) + "\n")
    print(audit(lines, server_keys(redis.Redis.from_url(options.url, decode_responses=True))).report())


def _watch(url: str, seconds: float) -> list[str]:
    watched = redis.Redis.from_url(url, decode_responses=True, socket_timeout=1.0)
    lines: list[str] = []
    deadline = time.monotonic() + seconds
    with watched.monitor() as monitor:
        while time.monotonic() < deadline:
            try:
                lines.append(str(monitor.connection.read_response()))
            except redis.TimeoutError:
                continue
    return lines


if __name__ == "__main__":
    main()
