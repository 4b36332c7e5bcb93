"""Coverage-guided fuzzing (atheris) of the wire readers: ``codec.decode`` and ``record.parse_record``.

Not part of the suite (atheris is not a dependency; the hypothesis tests are what CI runs). Each input
is decoded as a payload, then split into a record's hash fields and list entries; any exception out of
either is a crash atheris reports (and writes the input to ``crash-*``).

    pip install atheris   # into a separate environment with msgpack and redis
    PYTHONPATH=. python tools/fuzz_wire.py -max_total_time=60
"""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from metrale.shared.codec import DecodeError, decode
    from metrale.shared.messages import MESSAGE_TYPES
    from metrale.shared.record import RunRecord, parse_record


def fuzz_one(data: bytes) -> None:
    """Decode ``data`` as a payload and, split up, as a record; neither may raise."""
    assert isinstance(decode(data), (DecodeError, *MESSAGE_TYPES))
    provider = atheris.FuzzedDataProvider(data)
    fields = {provider.ConsumeBytes(8): provider.ConsumeBytes(16) for _ in range(provider.ConsumeIntInRange(0, 4))}
    events = [provider.ConsumeBytes(provider.ConsumeIntInRange(0, 64)) for _ in range(provider.ConsumeIntInRange(0, 4))]
    record = parse_record("fuzzed", fields, events)
    assert record is None or isinstance(record, RunRecord)


if __name__ == "__main__":
    atheris.Setup(sys.argv, fuzz_one)
    atheris.Fuzz()
