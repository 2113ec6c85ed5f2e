"""Rows a full disk kept back survive a validator killed before the disk has room (neurons/validator_app/spill.py),
are written once and only once, and a spill file that is not the store's own is never replayed."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

from neurons.validator_app import spill
from neurons.validator_app.rounds import ValidatorLoop
from neurons.validator_app.store import STORE_FULL_FILE_ENV, ValidatorStore
from scoring.metrics import Measurement

ROOT = Path(__file__).resolve().parents[1]
HOTKEY = "5FHneW46xGXgs5mUiveU4sbTyGBzmstUspZC92UhjJM694ty"


def row(i: int) -> Measurement:
    return Measurement(uid=1, hotkey=HOTKEY, at=float(i + 1), kind="chat", request_id=f"req-{i}", outcome="completed",
                       tier0_ok=True, prompt_tokens=10, completion_tokens=4, ttft_s=0.1, total_s=0.5)


@pytest.fixture
def disk(tmp_path, monkeypatch):
    """A database, its test-only full-disk switch and a spill directory of its own."""
    ram = tmp_path / "ram"
    ram.mkdir()
    monkeypatch.setenv(STORE_FULL_FILE_ENV, str(tmp_path / "disk-full"))
    monkeypatch.setenv(spill.SPILL_DIR_ENV, str(ram))
    return types.SimpleNamespace(db=tmp_path / "v.sqlite", full=tmp_path / "disk-full", ram=ram)


def request_ids(db: Path) -> list[str]:
    with ValidatorStore(db, readonly=True) as store:
        return [r["request_id"] for r in store.measurement_rows()]


def test_rows_kept_back_by_a_full_disk_survive_a_sigkill(disk):
    """A real validator-store process keeps rows while its disk is full and is SIGKILLed; the next process to open
    the database writes them."""
    ValidatorStore(disk.db).close()
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        sys.path.insert(0, {str(ROOT)!r})
        from neurons.validator_app.store import ValidatorStore
        from scoring.metrics import Measurement
        store = ValidatorStore({str(disk.db)!r})
        store.add_measurements([(Measurement(uid=1, hotkey={HOTKEY!r}, at=1.0, kind="chat", request_id="req-0",
                                             outcome="completed"), None)], 0, source="organic")
        Path({str(disk.full)!r}).write_text("full")
        for i in (1, 2):
            store.add_measurements([(Measurement(uid=1, hotkey={HOTKEY!r}, at=1.0 + i, kind="chat",
                                                 request_id=f"req-{{i}}", outcome="completed"), None)], 0,
                                   source="organic")
        store.add_failures([dict(uid=1, hotkey={HOTKEY!r}, check="unreachable", reason="down")], 0)
        print(store.deferred_rows, flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, env=os.environ.copy())
    try:
        assert child.stdout.readline().strip() == "3"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert request_ids(disk.db) == ["req-0"]  # the kill took what the process held
    assert len(list(disk.ram.iterdir())) == 1
    disk.full.unlink()
    with ValidatorStore(disk.db) as store:
        assert store.deferred_rows == 0
        assert [r["request_id"] for r in store.measurement_rows()] == ["req-0", "req-1", "req-2"]
        assert [r["check_name"] for r in store.failures()] == ["unreachable"]
    assert not list(disk.ram.iterdir())
    with sqlite3.connect(disk.db) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"


def test_a_spill_already_written_is_deleted_unread_and_one_still_full_is_kept(disk):
    with ValidatorStore(disk.db) as store:
        disk.full.write_text("full")
        store.add_measurements([(row(0), None)], 0, source="organic")
        (left,) = disk.ram.iterdir()
        copy = left.read_bytes()
        disk.full.unlink()
        assert store.write_deferred() == 0 and not left.exists()
    left.write_bytes(copy)  # as if a kill came between the commit and the delete
    os.chmod(left, 0o600)
    with ValidatorStore(disk.db) as store:
        assert [r["request_id"] for r in store.measurement_rows()] == ["req-0"]  # not twice
    assert not left.exists()
    # a process that starts while the disk is still full keeps the earlier rows, in memory and in the spill
    with ValidatorStore(disk.db) as store:
        disk.full.write_text("full")
        store.add_measurements([(row(1), None)], 0, source="organic")
    with ValidatorStore(disk.db) as store:
        assert store.deferred_rows == 1 and left.exists()
        store.add_measurements([(row(2), None)], 0, source="organic")
        assert store.deferred_rows == 2
    disk.full.unlink()
    with ValidatorStore(disk.db) as store:
        assert [r["request_id"] for r in store.measurement_rows()] == ["req-0", "req-1", "req-2"]
    assert not left.exists()


def test_a_line_cut_short_by_a_kill_is_dropped_and_the_rest_written(disk):
    with ValidatorStore(disk.db) as store:
        disk.full.write_text("full")
        store.add_measurements([(row(0), None)], 0, source="organic")
        store.add_measurements([(row(1), None)], 0, source="organic")
    (left,) = disk.ram.iterdir()
    left.write_text(left.read_text()[:-20])  # the kill came in the middle of the last write
    disk.full.unlink()
    assert request_ids(disk.db) == []
    with ValidatorStore(disk.db) as store:
        assert [r["request_id"] for r in store.measurement_rows()] == ["req-0"]


@pytest.mark.parametrize("tamper", ["another table", "a column it lacks", "SQL for a name", "readable by others",
                                    "another database"])
def test_a_spill_that_is_not_the_stores_own_is_refused_and_left_alone(disk, tamper, caplog):
    """The spill's directory may be shared (/dev/shm): a file planted there writes nothing."""
    with ValidatorStore(disk.db) as store:
        disk.full.write_text("full")
        store.add_measurements([(row(0), None)], 0, source="organic")
    disk.full.unlink()
    (left,) = disk.ram.iterdir()
    header, batch = (json.loads(line) for line in left.read_text().splitlines())
    if tamper == "another table":
        batch["table"] = "weights"
    elif tamper == "a column it lacks":
        batch["columns"][0] = "secret"
    elif tamper == "SQL for a name":
        batch["table"] = "measurements; DELETE FROM measurements"
    elif tamper == "another database":
        header["db"] = "/elsewhere/v.sqlite"
    left.write_text(json.dumps(header) + "\n" + json.dumps(batch) + "\n")
    os.chmod(left, 0o644 if tamper == "readable by others" else 0o600)
    with ValidatorStore(disk.db) as store:
        assert store.deferred_rows == 0
        assert store.measurement_count() == 0
    assert left.exists()
    assert "cannot be read" in caplog.text and "move" in caplog.text


def test_a_link_planted_where_the_spill_goes_is_neither_written_through_nor_read(disk, tmp_path, caplog):
    """Someone with write access to the shared directory links the spill's name to a file of the validator's user:
    the rows do not land in that file, and a link found at start is refused."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    with ValidatorStore(disk.db) as store:
        name = spill.RowSpill(disk.db).path.name
        (disk.ram / name).symlink_to(victim)
        disk.full.write_text("full")
        store.add_measurements([(row(0), None)], 0, source="organic")
        assert store.deferred_rows == 1  # kept in memory; the spill refused
    assert victim.read_text() == "precious\n"
    assert "cannot keep rows" in caplog.text
    disk.full.unlink()
    with ValidatorStore(disk.db) as store:
        assert store.measurement_count() == 0
    assert "not a plain file" in caplog.text and (disk.ram / name).is_symlink()


async def test_the_validator_writes_kept_rows_once_the_disk_has_room_without_a_new_row(disk):
    """ValidatorLoop.write_deferred_rows retries every DEFERRED_RETRY_S: a kill a while after the disk has room
    finds the rows written, whenever the next measurement comes."""
    with ValidatorStore(disk.db) as store:
        disk.full.write_text("full")
        store.add_measurements([(row(0), None)], 0, source="organic")
        stop = asyncio.Event()
        task = asyncio.create_task(ValidatorLoop.write_deferred_rows(types.SimpleNamespace(store=store), stop))
        await asyncio.sleep(1.5)
        assert store.deferred_rows == 1
        disk.full.unlink()
        for _ in range(40):
            if not store.deferred_rows:
                break
            await asyncio.sleep(0.1)
        stop.set()
        await asyncio.wait_for(task, 5)
        assert store.deferred_rows == 0
    assert request_ids(disk.db) == ["req-0"] and not list(disk.ram.iterdir())
